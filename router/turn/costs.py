"""Where a turn's history comes from, by what each source costs (docs/turn-costs.md).

A later turn can find its history in three places: D's pinned blocks (the handle: P pulls
them), P's own prefix cache (P computes only what it lacks), or D's own cache (D runs the turn
alone, no P leg). These functions price each in *computed tokens*, what P spends computing one
prompt token, from what the KV-event index says each instance holds, and pick the cheapest.
Pure: the caller reads the index and the load.
"""

from __future__ import annotations

from carryover.router.config import TurnCosts

__all__ = ["decode_local_pays", "prefill_leg_cost", "pull_cost", "pull_pays"]


def pull_cost(pulled: int, costs: TurnCosts) -> float:
    """What pulling ``pulled`` tokens from D costs: a fixed part (handshake, descriptors, the
    notification) and the bytes."""
    return costs.pull_tokens + costs.pulled_token * pulled if pulled > 0 else 0.0


def pull_pays(prefill_holds: int, handle_tokens: int, costs: TurnCosts) -> bool:
    """Whether the handle saves more than its pull costs, when P already holds
    ``prefill_holds`` leading tokens of the prompt on its device: P pulls only what it lacks
    (vLLM's pull scheduler), so a handle that adds a few tokens to P's own hit buys a
    transfer to save almost nothing."""
    gain = handle_tokens - prefill_holds
    return gain > 0 and pull_cost(gain, costs) < gain


def prefill_leg_cost(
    prompt: int, prefill_holds: int, handle_tokens: int, costs: TurnCosts
) -> float:
    """A turn with a P leg: the leg itself (P's pass, D's pull of P's blocks, a round trip),
    what P computes, and the pull when it pays."""
    gain = handle_tokens - prefill_holds
    if pull_pays(prefill_holds, handle_tokens, costs):
        return costs.prefill_leg_tokens + pull_cost(gain, costs) + prompt - handle_tokens
    return costs.prefill_leg_tokens + prompt - prefill_holds


def decode_local_pays(
    prompt: int,
    decode_holds: int,
    decode_running: float,
    prefill_holds: int,
    handle_tokens: int,
    costs: TurnCosts,
) -> bool:
    """Whether D should compute the rest of the prompt itself: cheaper than the P leg once
    each of D's running streams counts the stall it suffers while D computes (a prompt
    computed on D holds up every decode step of that batch)."""
    rest = prompt - decode_holds
    stalled = 1.0 + costs.decode_stall * decode_running
    return rest * stalled < prefill_leg_cost(prompt, prefill_holds, handle_tokens, costs)
