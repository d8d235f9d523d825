"""The simulated engine's NIXL connector: KV loaded from another instance (P pulling D's
history, D loading the prompt P computed), the warm tier, and the holder's side: leases,
pins, the side channel's reads and their expiry (section numbers: ``docs/vllm-protocol.md``).

A mixin of :class:`carryover.bench.sim.engine.SimEngine`, which owns the state it reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from carryover.bench.sim.config import SimConfig
from carryover.bench.sim.kv import BlockPool, OutOfBlocks, token_hashes
from carryover.bench.sim.metrics import EngineMetrics
from carryover.bench.sim.sequence import EngineError, EngineSequence, Hold, cdiv
from carryover.bench.sim.sidechannel import SideChannelError, read_remote
from carryover.bench.sim.warm_tier import WarmTierClient

__all__ = ["NixlTransfer"]

log = logging.getLogger("carryover.sim")

_SIDE_CHANNEL_TIMEOUT = 5.0


class NixlTransfer:
    """Loading and holding KV blocks across instances, for :class:`SimEngine`."""

    config: SimConfig
    pool: BlockPool
    metrics: EngineMetrics
    engine_id: str
    warm_tier: WarmTierClient | None
    _holds: dict[str, Hold]
    _waiting: deque[EngineSequence]  # the scheduler's queue
    # D's reads of P's blocks not done yet, by P's side channel: (host, port, engine id) to
    # P's request ids, whose leases D renews (§4).
    _lease_renewals: dict[tuple[str, int, str], set[str]]
    # Seconds this engine's clock runs ahead of the host's (set by the engine).
    _clock_offset: float

    def now(self) -> float:
        """This engine's monotonic clock (pins, leases and their deadlines live on it)."""
        return time.monotonic() + self._clock_offset

    def advance_clock(self, seconds: float) -> None:
        self._clock_offset += seconds

    def _cache_lookup(self, seq: EngineSequence) -> None:
        prompt = seq.request.prompt
        size = self.config.block_size
        # Leave at least one prompt token to compute (vLLM never reports a full-prompt hit).
        hit_blocks = self.pool.lookup(
            token_hashes(prompt, size, seq.request.cache_salt), (len(prompt) - 1) // size
        )
        seq.blocks = hit_blocks
        seq.cached = seq.computed = len(hit_blocks) * size

    async def _load(self, seq: EngineSequence) -> None:
        self._cache_lookup(seq)
        kv = seq.request.kv_params or {}
        if seq.role == "prefill" and kv.get("remote_block_ids"):
            await self._pull_from_decode(seq, kv)
        elif seq.role == "decode" and kv.get("do_remote_prefill") and kv.get("remote_block_ids"):
            await self._load_from_prefill(seq, kv)
        elif self.warm_tier is not None:
            # NIXL is the first connector: only a request without a handle asks the tier.
            await self._load_warm(seq, self.warm_tier)

    async def _load_warm(self, seq: EngineSequence, tier: WarmTierClient) -> None:
        """The leading whole chunks the warm tier holds beyond the local hit."""
        prompt = seq.request.prompt
        size = self.config.block_size
        limit = (len(prompt) - 1) // size * size  # leave a token to compute, as vLLM does
        contents = (await tier.lookup(prompt, limit, seq.request.cache_salt))[
            seq.computed // size :
        ]
        if not contents:
            return
        blocks = await self._allocate(len(contents))
        count = len(contents) * size
        await asyncio.sleep(self.config.timing.warm_load(count))
        for block, content in zip(blocks, contents, strict=True):
            self.pool.content[block] = content
        seq.blocks += blocks
        seq.computed += count
        seq.external = count

    async def _pull_from_decode(self, seq: EngineSequence, handle: dict[str, Any]) -> None:
        """Turn N+1 on P with D's handle (§3): pull what P lacks, end-trim aligned."""
        prompt = seq.request.prompt
        size = self.config.block_size
        if not self.config.bidirectional:
            # Flag on D only: vLLM reports external tokens but registers no receive (§4).
            await asyncio.Event().wait()
        remote_tokens = int(handle.get("remote_num_tokens") or 0)
        count = min(remote_tokens, len(prompt)) - seq.computed
        threshold = self.config.extra.kv_recompute_threshold
        if count <= 0 or (threshold > 0 and count < threshold):
            # Nothing pulled: P only notifies D, which frees the blocks (§3).
            if count > 0:
                log.debug("Skipping remote pull: %d remote tokens < threshold %d", count, threshold)
            await self._notify(handle)
            return
        new_blocks = cdiv(seq.computed + count, size) - seq.computed // size
        remote_ids = handle["remote_block_ids"][0][-new_blocks:]  # the LAST blocks of D's list
        await self._read_into(seq, handle, remote_ids, new_blocks, count, from_decode=True)

    async def _load_from_prefill(self, seq: EngineSequence, params: dict[str, Any]) -> None:
        """D loading the prompt P computed (§1), renewing P's lease until it has read it."""
        prompt = seq.request.prompt
        size = self.config.block_size
        count = len(prompt) - seq.computed
        new_blocks = cdiv(len(prompt), size) - seq.computed // size
        remote_ids = params["remote_block_ids"][0][-new_blocks:] if new_blocks else []
        holder = (
            str(params.get("remote_host")),
            int(params.get("remote_port") or 0),
            str(params.get("remote_engine_id")),
        )
        lease = str(params.get("remote_request_id"))
        self._lease_renewals.setdefault(holder, set()).add(lease)
        try:
            await self._read_into(seq, params, remote_ids, new_blocks, count, from_decode=False)
        finally:
            leases = self._lease_renewals.get(holder, set())
            leases.discard(lease)
            if not leases:
                self._lease_renewals.pop(holder, None)

    async def _renew_leases(self) -> None:
        """D's heartbeats (§4): every ``kv_lease_duration // 6`` seconds, one message to each
        P whose blocks a request here still waits to read, naming those requests; P extends
        their leases. So a request that waits long for free blocks on D still reads what P
        computed (vLLM 0.32, ``nixl/base_scheduler.py``, ``on_new_request``)."""
        interval = max(self.config.extra.kv_lease_duration // 6, 0.05)
        while True:
            await asyncio.sleep(interval)
            for (host, port, engine_id), leases in list(self._lease_renewals.items()):
                try:
                    await read_remote(
                        host,
                        port,
                        {"op": "heartbeat", "engine_id": engine_id, "request_ids": sorted(leases)},
                        _SIDE_CHANNEL_TIMEOUT,
                    )
                except SideChannelError:
                    pass  # P gone or restarted: the read fails on its own

    async def _read_into(
        self,
        seq: EngineSequence,
        handle: dict[str, Any],
        remote_ids: list[int],
        new_blocks: int,
        count: int,
        *,
        from_decode: bool,
    ) -> None:
        blocks = await self._allocate(new_blocks)
        try:
            if len(remote_ids) != new_blocks:
                raise SideChannelError("bad_request", "remote block list shorter than needed")
            reply = await read_remote(
                str(handle.get("remote_host")),
                int(handle.get("remote_port") or 0),
                {
                    "op": "read",
                    "engine_id": handle.get("remote_engine_id"),
                    "request_id": handle.get("remote_request_id"),
                    "block_ids": remote_ids,
                    "deadline": handle.get("remote_blocks_expiry_time"),
                },
                _SIDE_CHANNEL_TIMEOUT,
            )
        except SideChannelError as exc:
            self.metrics.failed_transfer(expired=exc.kind == "expired")
            if exc.kind == "expired":
                log.warning("Declining expired remote read for %s", seq.request.request_id)
            if self.config.failure_policy == "recompute":
                if from_decode:
                    # vLLM 0.32 on P: the request waits for a receive that never comes and its
                    # blocks are never freed (§4). Reproduced on purpose.
                    await asyncio.Event().wait()
                self.pool.release(blocks)
                return  # D recomputes locally
            self.pool.release(blocks)
            self.metrics.finished("error")
            raise EngineError(500, "Internal server error", "InternalServerError") from exc
        await asyncio.sleep(self.config.timing.transfer(count))
        for block, content in zip(blocks, reply["contents"], strict=True):
            self.pool.content[block] = content
        seq.blocks += blocks
        seq.computed += count
        seq.external = count
        self.metrics.transferred(count)

    async def _notify(self, handle: dict[str, Any]) -> None:
        try:
            await read_remote(
                str(handle.get("remote_host")),
                int(handle.get("remote_port") or 0),
                {
                    "op": "notify",
                    "engine_id": handle.get("remote_engine_id"),
                    "request_id": handle.get("remote_request_id"),
                },
                _SIDE_CHANNEL_TIMEOUT,
            )
        except SideChannelError:
            self.metrics.failed_transfer(expired=False)

    def _load_may_allocate(self) -> bool:
        """Whether a request may take blocks for KV it loads from another instance now.
        vLLM allocates them when the request reaches the head of its waiting queue, so not
        while a preempted request waits there for blocks to recompute."""
        return not any(seq.preempted for seq in self._waiting)

    async def _allocate(self, count: int) -> list[int]:
        """Blocks for KV loaded from elsewhere, once the scheduler lets loads take any and
        they are free (polled: the simulator has no allocation queue)."""
        while True:
            if self._load_may_allocate():
                try:
                    return self.pool.allocate(count)
                except OutOfBlocks:
                    pass
            await asyncio.sleep(0.005)

    # -- holder side of the side channel -----------------------------------------------------

    async def _serve_read(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("engine_id") != self.engine_id:
            raise SideChannelError(
                "engine_mismatch",
                f"Remote NIXL agent engine ID mismatch. Expected {message.get('engine_id')}, "
                f"received {self.engine_id}",
            )
        if message.get("op") == "heartbeat":
            self._extend_leases(message.get("request_ids"))
            return {"ok": True}
        request_id = str(message.get("request_id"))
        if message.get("op") == "notify":
            self._drop_hold(request_id)
            return {"ok": True}
        deadline = message.get("deadline")
        margin = self.config.expiry_margin
        if isinstance(deadline, (int, float)) and self.now() + margin >= deadline:
            raise SideChannelError("expired", "Declining expired remote read")
        block_ids = message.get("block_ids")
        if not isinstance(block_ids, list) or not all(
            isinstance(b, int) and 0 <= b < self.pool.num_blocks for b in block_ids
        ):
            raise SideChannelError("bad_request", "invalid block ids")
        contents = [self.pool.content[b] for b in block_ids]
        if not self._drop_hold(request_id):
            # vLLM reads anyway and only logs it (§4): a reused block gives wrong KV.
            log.error(
                "Potentially invalid KV blocks for unrecognized request %s were retrieved by a "
                "remote worker. They may have expired.",
                request_id,
            )
            self.metrics.notification_after_expiry()
        return {"contents": contents}

    def _extend_leases(self, request_ids: object) -> None:
        """P's side of a heartbeat: each named lease lasts ``kv_lease_duration`` from now."""
        if not isinstance(request_ids, list):
            raise SideChannelError("bad_request", "heartbeat without request ids")
        deadline = self.now() + self.config.extra.kv_lease_duration
        for request_id in request_ids:
            hold = self._holds.get(str(request_id))
            if hold is not None and not hold.pinned:
                hold.deadline = max(hold.deadline, deadline)

    def _drop_hold(self, request_id: str) -> bool:
        hold = self._holds.pop(request_id, None)
        if hold is None:
            return False
        self.pool.release(hold.blocks)
        return True

    async def _expire_holds(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            now = self.now()
            for request_id, hold in list(self._holds.items()):
                if now >= hold.deadline:
                    log.warning("Releasing expired KV blocks for request %s", request_id)
                    if hold.pinned:
                        self.metrics.pin_expired()
                    self._drop_hold(request_id)

    def _lease_for_decode(self, seq: EngineSequence) -> dict[str, Any]:
        """P-node dict (§1): P holds the prompt's blocks until D reads them or the lease ends."""
        prompt = seq.request.prompt
        keep = cdiv(len(prompt), self.config.block_size)
        held, extra = seq.blocks[:keep], seq.blocks[keep:]
        self.pool.release(extra)
        request_id = seq.request.request_id
        self._holds[request_id] = Hold(
            held, self.now() + self.config.extra.kv_lease_duration, pinned=False
        )
        params = self._node_params(request_id, held, len(prompt), p_node=True, expiry=None)
        params["remote_prefill_cached_tokens"] = seq.cached + seq.external
        return params

    def _pin_for_next_turn(self, seq: EngineSequence) -> dict[str, Any]:
        """D-node dict (§1): D pins prompt + output - 1 tokens for ``decoder_kv_blocks_ttl``."""
        request = seq.request
        tokens = request.prompt + seq.output
        kept_tokens = len(tokens) - 1  # the last sampled token was never run
        self.pool.compute(seq.blocks, tokens, len(request.prompt), kept_tokens)
        self.pool.cache(seq.blocks, tokens[:kept_tokens], request.cache_salt)
        keep = cdiv(kept_tokens, self.config.block_size)
        held, extra = seq.blocks[:keep], seq.blocks[keep:]
        self.pool.release(extra)
        deadline = self.now() + self.config.extra.decoder_kv_blocks_ttl
        self._holds[request.request_id] = Hold(held, deadline, pinned=True)
        return self._node_params(
            request.request_id, held, kept_tokens, p_node=False, expiry=deadline
        )

    def _node_params(
        self, request_id: str, blocks: list[int], tokens: int, *, p_node: bool, expiry: float | None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "do_remote_prefill": p_node,
            "do_remote_decode": not p_node,
            "remote_block_ids": [list(blocks)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.config.side_channel_host,
            "remote_port": self.config.side_channel_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": tokens,
            "remote_blocks_expiry_time": expiry,
        }
        if self.config.streams_handles:  # 0.33.0 added the generation field (§1)
            params["remote_registration_generation"] = 0
        params["transfer_mode"] = "pull"
        return params
