"""One conversation turn: model (what a turn carries), prepare, prefill, decode, commit, and
the runner that strings them together."""

from router.turn.model import Relay, TurnOutcome, TurnPath, TurnRequest
from router.turn.runner import TurnRunner

__all__ = ["Relay", "TurnOutcome", "TurnPath", "TurnRequest", "TurnRunner"]
