"""One conversation turn: model (what a turn carries), prepare, prefill, decode, commit, and
the runner that strings them together."""

from router.turn.model import DONE_FRAME, Relay, TurnOutcome, TurnPath, TurnRequest
from router.turn.runner import TurnRunner

__all__ = ["DONE_FRAME", "Relay", "TurnOutcome", "TurnPath", "TurnRequest", "TurnRunner"]
