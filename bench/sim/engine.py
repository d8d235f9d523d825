"""One simulated vLLM engine: scheduler, KV pool, and the NIXL P/D semantics of vLLM 0.33.

Every rule here follows ``docs/vllm-protocol.md`` (section numbers in comments), including
what the CPU build did.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from bench.sim.answers import AnswerPlanner
from bench.sim.config import SimConfig
from bench.sim.kv import BlockPool, OutOfBlocks, token_hashes
from bench.sim.kv_events import KvEventPublisher
from bench.sim.metrics import EngineMetrics
from bench.sim.sidechannel import SideChannelError, read_remote, serve_side_channel
from bench.sim.warm_tier import RemoteWarmTier, WarmTierClient
from router.render.chat_template import ChatTemplate

__all__ = ["EngineError", "Finished", "GenerationRequest", "SimEngine", "Token"]

log = logging.getLogger("carryover.sim")

# vLLM declines a D->P read this close to D's deadline (docs/vllm-protocol.md §4).
EXPIRY_SAFETY_MARGIN = 5.0
_SIDE_CHANNEL_TIMEOUT = 5.0


class EngineError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class GenerationRequest:
    request_id: str  # vLLM's internal id: "<response id>-<8 hex>"
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    thinking: bool = False
    kv_params: dict[str, Any] | None = None


@dataclass
class Token:
    token_id: int
    text: str


@dataclass
class Finished:
    reason: str  # "stop" | "length"
    stop_reason: str | int | None
    kv_params: dict[str, Any] | None
    cached_tokens: int


@dataclass(eq=False)
class _Sequence:
    request: GenerationRequest
    role: str  # "prefill" (P leg), "decode" (D leg / D-node), "plain"
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # prompt tokens with KV before scheduling (cache hits + loads)
    cached: int = 0  # prompt tokens from the local prefix cache
    external: int = 0  # prompt tokens loaded from another instance
    answer: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    text: str = ""
    events: asyncio.Queue[Token | Finished | EngineError] = field(default_factory=asyncio.Queue)
    aborted: bool = False
    finished: bool = False


@dataclass
class _Hold:
    blocks: list[int]
    deadline: float  # on this engine's monotonic clock
    pinned: bool  # True: D's pin for a later turn; False: P's lease for D's read


class SimEngine:
    def __init__(self, config: SimConfig, template: ChatTemplate) -> None:
        self.config = config
        self.template = template
        self.planner = AnswerPlanner(template, noncanonical=config.noncanonical_outputs)
        self.metrics = EngineMetrics(config.served_model_name)
        self.engine_id = config.new_engine_id()
        self.pool = self._new_pool()
        self.kv_events: KvEventPublisher | None = None
        #: A warm tier shared with other engines (LMCache's server, simulated): the one at
        #: ``--sim-warm-tier URL``, or set by whoever builds the fleet; ``None``: none.
        self.warm_tier: WarmTierClient | None = (
            RemoteWarmTier(config.warm_tier) if config.warm_tier else None
        )
        self._warm_saves: set[asyncio.Task[None]] = set()
        self._holds: dict[str, _Hold] = {}
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._side_channel: asyncio.Server | None = None
        # Seconds this engine's clock runs ahead of the host's: tests move time forward
        # (``advance_clock``) instead of sleeping through a TTL.
        self._clock_offset = 0.0

    def _new_pool(self) -> BlockPool:
        return BlockPool(
            self.config.num_blocks,
            self.config.block_size,
            prefix_caching=self.config.enable_prefix_caching,
            events=self.config.kv_events is not None,
        )

    async def publish_kv_events(self) -> None:
        """Send what entered and left the prefix cache since the last call (one batch)."""
        events = self.pool.take_events()
        if events and self.kv_events is not None:
            await self.kv_events.publish(events)

    def now(self) -> float:
        """This engine's monotonic clock (pins, leases and their deadlines live on it)."""
        return time.monotonic() + self._clock_offset

    def advance_clock(self, seconds: float) -> None:
        self._clock_offset += seconds

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self.config.kv_events is not None:
            self.kv_events = KvEventPublisher(self.config.kv_events)
            self.kv_events.start()
        self._tasks = [
            asyncio.create_task(self._schedule()),
            asyncio.create_task(self._expire_holds()),
        ]
        if self.config.kv_transfer is not None:
            self._side_channel = await serve_side_channel(
                "0.0.0.0"
                if self.config.side_channel_host not in ("localhost", "127.0.0.1")
                else "127.0.0.1",
                self.config.side_channel_port,
                self._serve_read,
            )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._side_channel is not None:
            self._side_channel.close()
            await self._side_channel.wait_closed()
            self._side_channel = None
        if self.kv_events is not None:
            await self.kv_events.stop()
            self.kv_events = None
        for save in list(self._warm_saves):
            save.cancel()
        if isinstance(self.warm_tier, RemoteWarmTier):
            await self.warm_tier.close()

    def restart(self) -> None:
        """Come back as a new engine: new id, empty pool, nothing held (as a process restart)."""
        for seq in [*self._waiting, *self._running]:
            seq.aborted = True
            seq.events.put_nowait(EngineError(500, "engine restarted", "InternalServerError"))
        self._waiting.clear()
        self._running.clear()
        self._holds.clear()
        self.engine_id = self.config.new_engine_id()
        self.metrics.restarted()
        self.pool = self._new_pool()
        if self.kv_events is not None:
            self.kv_events.restart()

    def evict_held(self) -> int:
        """Free every pinned and leased block now (fault injection)."""
        count = len(self._holds)
        for hold in self._holds.values():
            self.pool.release(hold.blocks)
        self._holds.clear()
        return count

    @property
    def held_requests(self) -> list[str]:
        return list(self._holds)

    def refresh_gauges(self) -> None:
        self.metrics.set_gauges(
            running=len(self._running),
            waiting=len(self._waiting),
            usage=self.pool.usage(),
            pinned=sum(1 for h in self._holds.values() if h.pinned),
        )

    # -- the request path --------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Token | Finished, None]:
        """Run one request; yields its tokens then a :class:`Finished`. Cancelling the consumer
        aborts the request (no handle, blocks freed)."""
        cfg = self.config
        if len(request.prompt) + request.max_tokens > cfg.max_model_len:
            raise EngineError(
                400,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"you requested {len(request.prompt) + request.max_tokens} tokens "
                f"({len(request.prompt)} in the messages, {request.max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
            )
        if _cdiv(len(request.prompt) + request.max_tokens, cfg.block_size) > cfg.num_blocks:
            raise EngineError(400, "request needs more KV blocks than this instance has")
        seq = _Sequence(request, self._role(request.kv_params))
        try:
            await self._load(seq)
            self._waiting.append(seq)
            self.metrics.queries(len(request.prompt), seq.cached)
            self._wake.set()
            while True:
                event = await seq.events.get()
                if isinstance(event, EngineError):
                    raise event
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            if not seq.finished:
                seq.aborted = True
                self._abort(seq)
                self.metrics.finished("abort")

    def _role(self, kv: dict[str, Any] | None) -> str:
        if kv is None:
            return "plain"
        if kv.get("do_remote_decode"):
            return "prefill"
        return "decode"

    def _cache_lookup(self, seq: _Sequence) -> None:
        prompt = seq.request.prompt
        size = self.config.block_size
        # Leave at least one prompt token to compute (vLLM never reports a full-prompt hit).
        hit_blocks = self.pool.lookup(token_hashes(prompt, size), (len(prompt) - 1) // size)
        seq.blocks = hit_blocks
        seq.cached = seq.computed = len(hit_blocks) * size

    async def _load(self, seq: _Sequence) -> None:
        self._cache_lookup(seq)
        kv = seq.request.kv_params or {}
        if seq.role == "prefill" and kv.get("remote_block_ids"):
            await self._pull_from_decode(seq, kv)
        elif seq.role == "decode" and kv.get("do_remote_prefill") and kv.get("remote_block_ids"):
            await self._load_from_prefill(seq, kv)
        elif self.warm_tier is not None:
            # NIXL is the first connector: only a request without a handle asks the tier.
            await self._load_warm(seq, self.warm_tier)

    async def _load_warm(self, seq: _Sequence, tier: WarmTierClient) -> None:
        """The leading whole chunks the warm tier holds beyond the local hit."""
        prompt = seq.request.prompt
        size = self.config.block_size
        limit = (len(prompt) - 1) // size * size  # leave a token to compute, as vLLM does
        contents = (await tier.lookup(prompt, limit))[seq.computed // size :]
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

    async def _pull_from_decode(self, seq: _Sequence, handle: dict[str, Any]) -> None:
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
        new_blocks = _cdiv(seq.computed + count, size) - seq.computed // size
        remote_ids = handle["remote_block_ids"][0][-new_blocks:]  # the LAST blocks of D's list
        await self._read_into(seq, handle, remote_ids, new_blocks, count, from_decode=True)

    async def _load_from_prefill(self, seq: _Sequence, params: dict[str, Any]) -> None:
        """D loading the prompt P computed (§1)."""
        prompt = seq.request.prompt
        size = self.config.block_size
        count = len(prompt) - seq.computed
        new_blocks = _cdiv(len(prompt), size) - seq.computed // size
        remote_ids = params["remote_block_ids"][0][-new_blocks:] if new_blocks else []
        await self._read_into(seq, params, remote_ids, new_blocks, count, from_decode=False)

    async def _read_into(
        self,
        seq: _Sequence,
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

    async def _allocate(self, count: int) -> list[int]:
        while True:
            try:
                return self.pool.allocate(count)
            except OutOfBlocks:
                await asyncio.sleep(0.005)

    # -- holder side of the side channel -----------------------------------------------------

    async def _serve_read(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("engine_id") != self.engine_id:
            raise SideChannelError(
                "engine_mismatch",
                f"Remote NIXL agent engine ID mismatch. Expected {message.get('engine_id')}, "
                f"received {self.engine_id}",
            )
        request_id = str(message.get("request_id"))
        if message.get("op") == "notify":
            self._drop_hold(request_id)
            return {"ok": True}
        deadline = message.get("deadline")
        if isinstance(deadline, (int, float)) and self.now() + EXPIRY_SAFETY_MARGIN >= deadline:
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

    # -- scheduler ---------------------------------------------------------------------------

    async def _schedule(self) -> None:
        timing = self.config.timing
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
            cost = 0.0
            while self._waiting and len(self._running) < self.config.max_num_seqs:
                seq = self._waiting[0]
                if seq.aborted:
                    self._waiting.popleft()
                    continue
                try:
                    cost += self._prefill(seq)
                except OutOfBlocks:
                    break
                self._waiting.popleft()
                self._running.append(seq)
            if self._running:
                cost += timing.decode(len(self._running))
            await asyncio.sleep(cost)
            if not self._running:
                await asyncio.sleep(0.005)  # waiting for blocks to free up
            for seq in list(self._running):
                if seq.aborted:
                    self._running.remove(seq)
                    continue
                self._step(seq)
            await self.publish_kv_events()  # one batch per step, as vLLM's scheduler sends

    def _prefill(self, seq: _Sequence) -> float:
        prompt = seq.request.prompt
        size = self.config.block_size
        missing = _cdiv(len(prompt), size) - len(seq.blocks)
        if missing > 0:
            seq.blocks += self.pool.allocate(missing)
        computed = len(prompt) - seq.computed
        self.pool.compute(seq.blocks, prompt, seq.computed, len(prompt))
        if self.warm_tier is not None and seq.role != "decode":
            # Saved as computed, after the step (LMCache's connector on P; D saves nothing).
            contents = [self.pool.content[b] for b in seq.blocks]
            task = asyncio.create_task(self.warm_tier.save(prompt, contents, size))
            self._warm_saves.add(task)
            task.add_done_callback(self._warm_saves.discard)
        # Pulled and loaded blocks are cached under this prompt's token hashes (§3).
        self.pool.cache(seq.blocks, prompt)
        self.metrics.prompt_sources(computed, seq.cached, seq.external)
        fingerprint = self.pool.fingerprint(seq.blocks, len(prompt))
        request = seq.request
        seq.answer = self.planner.plan(
            fingerprint,
            max_tokens=request.max_tokens,
            ignore_eos=request.ignore_eos,
            thinking=request.thinking,
        )
        return self.config.timing.prefill(computed, seq.computed)

    def _step(self, seq: _Sequence) -> None:
        request = seq.request
        size = self.config.block_size
        # The token produced at this step needs KV only once the next one is computed.
        needed = _cdiv(len(request.prompt) + len(seq.output), size)
        if needed > len(seq.blocks):
            try:
                seq.blocks += self.pool.allocate(needed - len(seq.blocks))
            except OutOfBlocks:
                return  # wait a step for blocks
        token = seq.answer[len(seq.output)]
        seq.output.append(token)
        piece = self.template.token_text(token)
        eos = token == self.template.eos_token_id and not request.ignore_eos
        seq.text += "" if eos else piece
        stop = next((s for s in request.stop if s in seq.text), None)
        if stop is not None:
            self._finish(seq, "stop", stop, handle_allowed=False)
            return
        seq.events.put_nowait(Token(token, "" if eos else piece))
        if eos or len(seq.output) >= len(seq.answer):
            self._finish(seq, "stop", None, handle_allowed=True)
        elif len(seq.output) >= request.max_tokens:
            self._finish(seq, "length", None, handle_allowed=True)

    def _finish(
        self, seq: _Sequence, reason: str, stop_reason: str | None, *, handle_allowed: bool
    ) -> None:
        """End a request. Only EOS/stop-token and length endings return params (§1): a stop
        *string* is an abort inside vLLM, so it frees the blocks and returns none (Q7)."""
        seq.finished = True
        self._running.remove(seq)
        request = seq.request
        params = None
        if handle_allowed and seq.role == "prefill":
            params = self._lease_for_decode(seq)
        elif handle_allowed and seq.role == "decode" and self.config.bidirectional:
            params = self._pin_for_next_turn(seq)
        else:
            self.pool.release(seq.blocks)
        self.metrics.finished(reason)
        self.metrics.generated(len(request.prompt), len(seq.output))
        seq.events.put_nowait(Finished(reason, stop_reason, params, self._cached_reported(seq)))

    @staticmethod
    def _cached_reported(seq: _Sequence) -> int:
        """``usage.prompt_tokens_details.cached_tokens``: after a remote prefill, P's hits as
        P reported them in its dict, not D's own near-total hits from the transfer (vLLM 0.32,
        ``v1/engine/output_processor.py``, ``remote_prefill_cached_tokens``)."""
        kv = seq.request.kv_params or {}
        remote = kv.get("remote_prefill_cached_tokens")
        if kv.get("do_remote_prefill") and isinstance(remote, int):
            return remote
        return seq.cached + seq.external

    def _lease_for_decode(self, seq: _Sequence) -> dict[str, Any]:
        """P-node dict (§1): P holds the prompt's blocks until D reads them or the lease ends."""
        prompt = seq.request.prompt
        keep = _cdiv(len(prompt), self.config.block_size)
        held, extra = seq.blocks[:keep], seq.blocks[keep:]
        self.pool.release(extra)
        request_id = seq.request.request_id
        self._holds[request_id] = _Hold(
            held, self.now() + self.config.extra.kv_lease_duration, pinned=False
        )
        params = self._node_params(request_id, held, len(prompt), p_node=True, expiry=None)
        params["remote_prefill_cached_tokens"] = seq.cached + seq.external
        return params

    def _pin_for_next_turn(self, seq: _Sequence) -> dict[str, Any]:
        """D-node dict (§1): D pins prompt + output - 1 tokens for ``decoder_kv_blocks_ttl``."""
        request = seq.request
        tokens = request.prompt + seq.output
        kept_tokens = len(tokens) - 1  # the last sampled token was never run
        self.pool.compute(seq.blocks, tokens, len(request.prompt), kept_tokens)
        self.pool.cache(seq.blocks, tokens[:kept_tokens])
        keep = _cdiv(kept_tokens, self.config.block_size)
        held, extra = seq.blocks[:keep], seq.blocks[keep:]
        self.pool.release(extra)
        deadline = self.now() + self.config.extra.decoder_kv_blocks_ttl
        self._holds[request.request_id] = _Hold(held, deadline, pinned=True)
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

    def _abort(self, seq: _Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._waiting:
            self._waiting.remove(seq)
        self.pool.release(seq.blocks)
        seq.blocks = []

    @staticmethod
    def new_request_id(response_id: str) -> str:
        return f"{response_id}-{secrets.token_hex(4)}"
