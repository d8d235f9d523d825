"""How long simulated work takes. Defaults resemble an 8B model on one H100 (bf16)."""

from __future__ import annotations

import msgspec

__all__ = ["Timing"]


class Timing(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Seconds of simulated work, all multiplied by ``speed`` (0 = no delays at all).

    Attributes:
        prefill_fixed: per prefill forward pass.
        prefill_per_token: per prompt token computed (≈ 16k tokens/s).
        prefill_attention: per computed token per token of context before it (the quadratic term).
        decode_step: one decode step of the batch.
        decode_per_seq: added per running sequence in that step.
        kv_bytes_per_token: KV bytes per token (Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 x 2 B).
        kv_bandwidth: bytes/s of a NIXL transfer.
        kv_transfer_fixed: per transfer (handshake, descriptors, notification).
        warm_bandwidth: bytes/s of a load from the warm tier (LMCache in host memory, over
            PCIe: slower than NIXL between GPUs).
        warm_fixed: per load from the warm tier (lookup and the server's round trip).
        speed: multiplier on every delay.
    """

    prefill_fixed: float = 0.004
    prefill_per_token: float = 6.0e-5
    prefill_attention: float = 1.0e-9
    decode_step: float = 0.007
    decode_per_seq: float = 5.0e-5
    kv_bytes_per_token: int = 131072
    kv_bandwidth: float = 40e9
    kv_transfer_fixed: float = 0.002
    warm_bandwidth: float = 12e9
    warm_fixed: float = 0.003
    speed: float = 1.0

    def prefill(self, computed: int, context_before: int) -> float:
        attention = self.prefill_attention * computed * (context_before + computed / 2)
        return self.speed * (self.prefill_fixed + self.prefill_per_token * computed + attention)

    def decode(self, batch: int) -> float:
        return self.speed * (self.decode_step + self.decode_per_seq * batch)

    def warm_load(self, tokens: int) -> float:
        seconds = self.warm_fixed + tokens * self.kv_bytes_per_token / self.warm_bandwidth
        return self.speed * seconds

    def transfer(self, tokens: int) -> float:
        seconds = self.kv_transfer_fixed + tokens * self.kv_bytes_per_token / self.kv_bandwidth
        return self.speed * seconds
