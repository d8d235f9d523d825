"""How long a handle lives, for an arm's engines and its router alike: D's
``decoder_kv_blocks_ttl`` and the margin within which P declines to read (vLLM's 5 s,
docs/vllm-protocol.md §4). A run that scales time scales both, so that a handle stays
usable for the same share of D's TTL as on a fleet: scaling the TTL alone would leave
P's 5 s to eat half of a 9.6 s TTL."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VLLM_EXPIRY_MARGIN", "Lifetimes"]

#: P declines a read this close to D's deadline (vLLM's _KV_BLOCKS_EXPIRY_SAFETY_MARGIN).
VLLM_EXPIRY_MARGIN = 5.0


@dataclass(frozen=True)
class Lifetimes:
    decode_ttl: float
    expiry_margin: float = VLLM_EXPIRY_MARGIN

    @classmethod
    def scaled(cls, decode_ttl: float, time_scale: float) -> Lifetimes:
        """D's TTL and P's margin as a fleet has them, times ``time_scale``."""
        return cls(decode_ttl * time_scale, VLLM_EXPIRY_MARGIN * time_scale)

    def decode_config(self) -> dict[str, float]:
        """D's ``kv_connector_extra_config`` entries."""
        return {"decoder_kv_blocks_ttl": self.decode_ttl}

    def engine_flags(self) -> list[str]:
        """Every simulated engine's flags (the instance holding the blocks declines)."""
        return ["--sim-expiry-margin", str(self.expiry_margin)]

    def router_flags(self) -> list[str]:
        """The router told the same, with no queue margin: a record lives exactly as long
        as P would still read its handle."""
        return [
            *("--decoder-kv-blocks-ttl", str(self.decode_ttl)),
            *("--expiry-safety-margin", str(self.expiry_margin)),
            *("--queue-margin", "0"),
        ]
