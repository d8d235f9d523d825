"""One simulated vLLM engine: scheduler, KV pool, and the NIXL P/D semantics of vLLM 0.33
(the connector's side in ``bench/sim/transfer.py``).

Every rule here follows ``docs/vllm-protocol.md`` (section numbers in comments), including
what the CPU build did.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

from carryover.bench.sim.answers import AnswerPlanner
from carryover.bench.sim.chat import SimTemplate
from carryover.bench.sim.config import SimConfig
from carryover.bench.sim.kv import BlockPool, OutOfBlocks
from carryover.bench.sim.kv_events import KvEventPublisher
from carryover.bench.sim.metrics import EngineMetrics
from carryover.bench.sim.sequence import (
    EngineError,
    EngineSequence,
    Finished,
    GenerationRequest,
    Hold,
    Token,
    cdiv,
)
from carryover.bench.sim.sidechannel import serve_side_channel
from carryover.bench.sim.transfer import NixlTransfer
from carryover.bench.sim.warm_tier import RemoteWarmTier, WarmTierClient

__all__ = ["EngineError", "Finished", "GenerationRequest", "SimEngine", "Token"]

log = logging.getLogger("carryover.sim")


class SimEngine(NixlTransfer):
    def __init__(self, config: SimConfig, template: SimTemplate) -> None:
        self.config = config
        self.template = template
        self.planner = AnswerPlanner(template, noncanonical=config.noncanonical_outputs)
        self.metrics = EngineMetrics(
            config.served_model_name, num_blocks=config.num_blocks, block_size=config.block_size
        )
        self.engine_id = config.new_engine_id()
        self.pool = self._new_pool()
        self.kv_events: KvEventPublisher | None = None
        #: A warm tier shared with other engines (LMCache's server, simulated): the one at
        #: ``--sim-warm-tier URL``, or set by whoever builds the fleet; ``None``: none.
        self.warm_tier: WarmTierClient | None = (
            RemoteWarmTier(config.warm_tier) if config.warm_tier else None
        )
        self._warm_saves: set[asyncio.Task[None]] = set()
        self._holds: dict[str, Hold] = {}
        self._lease_renewals: dict[tuple[str, int, str], set[str]] = {}
        self._waiting: deque[EngineSequence] = deque()
        self._running: list[EngineSequence] = []
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
            self._tasks.append(asyncio.create_task(self._renew_leases()))
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

    def lease_seconds_left(self) -> dict[str, float]:
        """P's leases on blocks D has not read yet, by request id, in seconds of this clock."""
        now = self.now()
        return {rid: hold.deadline - now for rid, hold in self._holds.items() if not hold.pinned}

    def renewing_leases(self) -> list[str]:
        """P's request ids whose blocks a request here waits to read (heartbeats go out)."""
        return sorted(rid for leases in self._lease_renewals.values() for rid in leases)

    def refresh_gauges(self) -> None:
        pins = [h for h in self._holds.values() if h.pinned]
        self.metrics.set_gauges(
            running=len(self._running),
            waiting=len(self._waiting),
            usage=self.pool.usage(),
            pinned=len(pins),
            pinned_usage=sum(len(h.blocks) for h in pins) / self.config.num_blocks,
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
        if cdiv(len(request.prompt) + request.max_tokens, cfg.block_size) > cfg.num_blocks:
            raise EngineError(400, "request needs more KV blocks than this instance has")
        seq = EngineSequence(request, self._role(request.kv_params))
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

    # -- scheduler ---------------------------------------------------------------------------

    async def _schedule(self) -> None:
        timing = self.config.timing
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
            cost = 0.0
            while self._waiting and len(self._running) < self.config.max_num_seqs:
                seq = self._next_waiting()
                if seq.aborted:
                    self._waiting.remove(seq)
                    continue
                try:
                    cost += self._prefill(seq)
                except OutOfBlocks:
                    break
                self._waiting.remove(seq)
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
                if seq in self._running and not self._step(seq):
                    self._preempt()
            await self.publish_kv_events()  # one batch per step, as vLLM's scheduler sends

    def _next_waiting(self) -> EngineSequence:
        """The request to admit next: the first that holds KV it loaded from another instance,
        else the head of the queue. vLLM's scheduler drains its ``kv_holding_waiting`` queue
        before ``waiting`` (vLLM 0.32, ``v1/core/sched/scheduler.py``): a request that already
        holds blocks needs few more, and its blocks come back when it ends. Behind a preempted
        head that needs more blocks than are free, it would hold them forever."""
        return next(
            (seq for seq in self._waiting if seq.external and not seq.preempted), self._waiting[0]
        )

    def _preempt(self) -> None:
        """No free block for a running request's next token: as vLLM's scheduler does
        (recompute preemption), the request admitted last gives its blocks back and waits at
        the head of the queue, to recompute its prompt and output when blocks free up. A
        request alone in the batch preempts itself (vLLM 0.32, ``v1/core/sched/scheduler.py``,
        ``schedule()``: "No more request to preempt"), so that a waiting request holding
        loaded KV can take its blocks instead of both waiting on pins to expire."""
        victim = self._running.pop()
        self.pool.release(victim.blocks)
        victim.blocks, victim.computed, victim.preempted = [], 0, True
        self._waiting.appendleft(victim)
        self.metrics.preempted()

    def _resume(self, seq: EngineSequence) -> float:
        """A preempted request back in the batch: its prompt and output so far recomputed
        (its answer stays the one it was streaming). Only with a free block to spare for each
        running request's next token: running requests come first, as in vLLM's scheduler,
        or the two would take each other's blocks in turn forever."""
        tokens = seq.request.prompt + seq.output
        needed = cdiv(len(tokens), self.config.block_size)
        if self.pool.num_blocks - self.pool.used < needed + len(self._running):
            raise OutOfBlocks(f"{seq.request.request_id} waits for the running requests")
        seq.blocks = self.pool.allocate(needed)
        self.pool.compute(seq.blocks, seq.request.prompt, 0, len(seq.request.prompt))
        seq.preempted = False
        return self.config.timing.prefill(len(tokens), 0)

    def _prefill(self, seq: EngineSequence) -> float:
        if seq.preempted:
            return self._resume(seq)
        prompt = seq.request.prompt
        size = self.config.block_size
        missing = cdiv(len(prompt), size) - len(seq.blocks)
        if missing > 0:
            seq.blocks += self.pool.allocate(missing)
        computed = len(prompt) - seq.computed
        self.pool.compute(seq.blocks, prompt, seq.computed, len(prompt))
        if self.warm_tier is not None and seq.role != "decode":
            # Saved as computed, after the step (LMCache's connector on P; D saves nothing).
            contents = [self.pool.content[b] for b in seq.blocks]
            task = asyncio.create_task(
                self.warm_tier.save(prompt, contents, size, seq.request.cache_salt)
            )
            self._warm_saves.add(task)
            task.add_done_callback(self._warm_saves.discard)
        # Pulled and loaded blocks are cached under this prompt's token hashes (§3).
        self.pool.cache(seq.blocks, prompt, seq.request.cache_salt)
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

    def _step(self, seq: EngineSequence) -> bool:
        """One token for ``seq``; False when no block was free for it."""
        request = seq.request
        size = self.config.block_size
        # The token produced at this step needs KV only once the next one is computed.
        needed = cdiv(len(request.prompt) + len(seq.output), size)
        if needed > len(seq.blocks):
            try:
                seq.blocks += self.pool.allocate(needed - len(seq.blocks))
            except OutOfBlocks:
                return False
        token = seq.answer[len(seq.output)]
        seq.output.append(token)
        piece = self.template.token_text(token)
        eos = token == self.template.eos_token_id and not request.ignore_eos
        seq.text += "" if eos else piece
        stop = next((s for s in request.stop if s in seq.text), None)
        if stop is not None:
            self._finish(seq, "stop", stop, handle_allowed=False)
            return True
        seq.events.put_nowait(Token(token, "" if eos else piece))
        if eos or len(seq.output) >= len(seq.answer):
            self._finish(seq, "stop", None, handle_allowed=True)
        elif len(seq.output) >= request.max_tokens:
            self._finish(seq, "length", None, handle_allowed=True)
        return True

    def _finish(
        self, seq: EngineSequence, reason: str, stop_reason: str | None, *, handle_allowed: bool
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
    def _cached_reported(seq: EngineSequence) -> int:
        """``usage.prompt_tokens_details.cached_tokens``: after a remote prefill, P's hits as
        P reported them in its dict, not D's own near-total hits from the transfer (vLLM 0.32,
        ``v1/engine/output_processor.py``, ``remote_prefill_cached_tokens``)."""
        kv = seq.request.kv_params or {}
        remote = kv.get("remote_prefill_cached_tokens")
        if kv.get("do_remote_prefill") and isinstance(remote, int):
            return remote
        return seq.cached + seq.external

    def _abort(self, seq: EngineSequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._waiting:
            self._waiting.remove(seq)
        self.pool.release(seq.blocks)
        seq.blocks = []

    @staticmethod
    def new_request_id(response_id: str) -> str:
        return f"{response_id}-{secrets.token_hex(4)}"
