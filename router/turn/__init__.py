"""One conversation turn: model (what a turn carries), prepare, prefill, decode, commit, and
the runner that strings them together."""

from carryover.router.turn.model import DONE_FRAME, Relay, TurnOutcome, TurnRequest
from carryover.router.turn.path import TurnPath
from carryover.router.turn.runner import TurnRunner

__all__ = ["DONE_FRAME", "Relay", "TurnOutcome", "TurnPath", "TurnRequest", "TurnRunner"]
