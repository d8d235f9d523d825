"""One conversation turn, end to end: render → claim → plan → P leg → D leg → commit.

Invariants kept here (``DESIGN.md``): a handle is attached only when the prefix check passed
on the exact ids P and D run (they get them as ``prompt_token_ids``); a claimed handle goes to
P at most once; a store, render or engine failure costs reuse, never the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from router.config import ModelConfig, RouterConfig
from router.errors import (
    EngineFailed,
    EngineTimeout,
    EngineUnavailable,
    UpstreamError,
    is_client_fault,
)
from router.fields import NON_TEXT_CONTENT, reuse_blockers
from router.metrics import RouterMetrics, turn_bucket
from router.outcomes import LeftToExpire, ReleaseCause
from router.policy import pick_decode, pick_prefill
from router.pool import Instance, InstancePool, streams_handles
from router.relay import DecodeOutput
from router.render.backends import Renderer, RenderFailed
from router.tracing import NO_TRACE, TurnTrace
from router.upstream import Upstream, iter_sse
from state import (
    ConversationKey,
    HashedTokens,
    Path,
    Plan,
    PlanSettings,
    Reason,
    Record,
    Store,
    StoreUnavailable,
    block_size_of,
    chunk_size_for,
    plan,
    release_handle,
)

__all__ = ["TurnOutcome", "TurnRequest", "TurnRunner"]

log = logging.getLogger("carryover.turn")

_PROMPT_FIELD = frozenset({"prompt"})
# Prompts whose ids do not determine their KV.
_IDS_DO_NOT_DETERMINE_KV = frozenset({NON_TEXT_CONTENT, "mm_payload", "prompt_embeds"})

# Fields the P leg must not carry: it generates exactly one token and never streams (§1.3).
_PREFILL_DROP = (
    "max_completion_tokens",
    "min_tokens",
    "min_completion_tokens",
    "stream_options",
    "return_token_ids",
    "logprobs",
    "top_logprobs",
    "n",
)


@dataclass
class TurnRequest:
    model: ModelConfig
    model_name: str
    key: ConversationKey | None
    body: dict[str, Any]  # the client's body, conversation id removed
    chat: bool
    stream: bool
    client_wants_ids: bool
    request_id: str
    turn: int | None  # chat: the number of user messages; completions: from the record
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)  # wall clock: fences DELETE races
    trace: TurnTrace = NO_TRACE

    @property
    def engine_headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id, **self.trace.headers()}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclass
class _Prepared:
    ids: list[int] | None
    hashed: HashedTokens | None
    record: Record | None
    plan: Plan
    path: str  # the X-Carryover-Path vocabulary
    # False when the prompt's ids do not determine its KV (images, audio, embeddings): what D
    # holds at the end is then never stored for a later turn.
    storable: bool = True
    sent: bool = False  # the claimed handle (or its release) went to P

    def spend_handle(self, path: str = "cold-error") -> None:
        """The claimed handle was used or lost: later attempts run cold."""
        self.plan = Plan(Path.COLD, Reason.NO_RECORD)
        self.path = path


class Relay:
    """A started stream: its first chunk, then the rest. ``aclose`` ends the turn's stream
    (its lease, connection and span) even when iteration never began, which a generator
    that never started cannot do."""

    def __init__(self, first: bytes, rest: AsyncGenerator[bytes, None]) -> None:
        self._first: bytes | None = first
        self._rest = rest

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._rest)

    async def aclose(self) -> None:
        self._first = None
        await self._rest.aclose()


@dataclass
class TurnOutcome:
    path: str
    body: bytes | None = None
    chunks: Relay | None = None


def path_of(plan_: Plan) -> str:
    if plan_.path is Path.REUSE:
        return "reuse"
    if plan_.path is Path.PARTIAL:
        return "partial"
    if plan_.path is Path.RELEASE:
        return "cold-mismatch"
    if plan_.reason in (Reason.EXPIRED, Reason.STALE_ENGINE):
        return "cold-expired"
    if plan_.reason is Reason.BAD_HANDLE:
        return "cold-mismatch"
    return "cold-miss"


class TurnRunner:
    def __init__(
        self,
        config: RouterConfig,
        pool: InstancePool,
        store: Store,
        upstream: Upstream,
        renderers: dict[int, Renderer],
        metrics: RouterMetrics,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._store = store
        self._upstream = upstream
        self._renderers = renderers  # by id() of the ModelConfig
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._background: set[asyncio.Task[bool]] = set()

    @contextlib.contextmanager
    def _leg(self, req: TurnRequest, name: str, **attributes: Any) -> Iterator[None]:
        """Time one step of the turn: the leg histogram, and a span when tracing is on."""
        started = time.perf_counter()
        try:
            with req.trace.leg(name, **attributes):
                yield
        finally:
            self._metrics.legs.labels(name).observe(time.perf_counter() - started)

    async def drain_background(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # -- entry -------------------------------------------------------------------------------

    async def run(self, req: TurnRequest) -> TurnOutcome:
        prepared = await self._prepare(req)
        try:
            if req.stream:
                chunks = self._stream(req, prepared)
                first = await anext(chunks)  # P leg + D's first chunk: errors are HTTP errors
                return TurnOutcome(prepared.path, chunks=Relay(first, chunks))
            body = await self._complete(req, prepared)
        except asyncio.CancelledError:
            # The client left. A claimed handle not yet sent to P is nobody's now; one that
            # was sent may be under P's read, and is left to P and D's TTL.
            if prepared.plan.handle is not None and prepared.record is not None:
                self._release(req, prepared.record.handle, ReleaseCause.CLIENT_GONE)
            elif prepared.sent:
                self._metrics.left_to_expire.labels(LeftToExpire.SENT_THEN_CANCELLED).inc()
            raise
        return TurnOutcome(prepared.path, body=body)

    # -- render, claim, plan -----------------------------------------------------------------

    async def _prepare(self, req: TurnRequest) -> _Prepared:
        renders = self._renderers[id(req.model)].renders if req.chat else _PROMPT_FIELD
        blockers = reuse_blockers(req.body, chat=req.chat, renders=renders)
        if blockers:
            return await self._prepare_unchecked(req, blockers)
        ids = await self._render(req)
        record: Record | None = None
        store_failed = False
        use_state = req.key is not None and req.model.reuse and ids is not None
        if use_state:
            assert req.key is not None
            try:
                with self._leg(req, "claim"):
                    record = await self._store.claim(req.key)
                if record is not None:
                    self._metrics.handle_age.observe(max(0.0, time.time() - record.created_at))
            except StoreUnavailable as exc:
                store_failed = True
                self._metrics.store_errors.labels("claim").inc()
                # The claim may still have taken the record: its handle is lost to everyone.
                self._metrics.left_to_expire.labels(LeftToExpire.CLAIM_OUTCOME_UNKNOWN).inc()
                log.warning("store unavailable, turn served cold: %s", exc)
        hashed = None
        if ids is not None and use_state:
            chunk = record.prefix.chunk_size if record else chunk_size_for(req.model.block_size)
            hashed = HashedTokens(ids, chunk)
        decided = self._plan(req, record, hashed)
        path = "cold-error" if (ids is None or store_failed) else path_of(decided)
        if req.turn is None:
            req.turn = record.turn + 1 if record is not None else 1
        if decided.path is Path.RELEASE:
            self._metrics.releases.labels(str(decided.reason)).inc()
        self._metrics.turns.labels(req.model_name, path).inc()
        if ids is not None:
            self._metrics.prompt_tokens.labels(req.model_name, "reused").inc(decided.reused_tokens)
            self._metrics.prompt_tokens.labels(req.model_name, "computed").inc(
                len(ids) - decided.reused_tokens
            )
        return _Prepared(ids, hashed, record, decided, path)

    async def _prepare_unchecked(self, req: TurnRequest, blockers: list[str]) -> _Prepared:
        """A turn with fields the engine must apply itself (router/fields.py): nothing is
        rendered or checked, no handle attached; the stored one is taken and released."""
        for name in blockers:
            self._metrics.unchecked.labels(name).inc()
        record: Record | None = None
        if req.key is not None and req.model.reuse:
            try:
                with self._leg(req, "claim"):
                    record = await self._store.claim(req.key)
            except StoreUnavailable as exc:
                self._metrics.store_errors.labels("claim").inc()
                self._metrics.left_to_expire.labels(LeftToExpire.CLAIM_OUTCOME_UNKNOWN).inc()
                log.warning("store unavailable: %s", exc)
            if record is not None:
                self._release(req, record.handle, ReleaseCause.REUSE_DISABLED)
        if req.turn is None:
            req.turn = record.turn + 1 if record is not None else 1
        path = "cold-unchecked"
        self._metrics.turns.labels(req.model_name, path).inc()
        storable = not set(blockers) & _IDS_DO_NOT_DETERMINE_KV
        return _Prepared(None, None, None, Plan(Path.COLD, Reason.NO_RECORD), path, storable)

    def _plan(self, req: TurnRequest, record: Record | None, hashed: HashedTokens | None) -> Plan:
        if record is None or hashed is None:
            return Plan(Path.COLD, Reason.NO_RECORD)
        now = time.time()
        epoch = self._pool.epoch_of(record.decode)
        if not req.model.prefix_check:
            # Measurement arm only: what happens without the check (counts wrong answers).
            if record.expired(now) or epoch != record.decode_epoch:
                return Plan(Path.COLD, Reason.EXPIRED)
            tokens = int(record.handle.get("remote_num_tokens") or 0)
            return Plan(Path.REUSE, None, record.handle, tokens)
        settings = PlanSettings(
            partial_reuse=req.model.partial_reuse,
            recompute_threshold=req.model.kv_recompute_threshold,
        )
        return plan(record, hashed, now=now, decode_epoch=epoch, settings=settings)

    async def _render(self, req: TurnRequest) -> list[int] | None:
        """The prompt ids, or ``None`` when the backend is down (the turn then runs without
        reuse: engines render themselves, nothing is checked, nothing is attached)."""
        if not req.chat:
            prompt = req.body.get("prompt")
            if isinstance(prompt, list):
                return prompt  # token ids are taken as they are
        renderer = self._renderers[id(req.model)]
        candidates: list[Instance | None] = [*self._pool.available(req.model, "prefill")] or [None]
        with self._leg(req, "render"):
            for attempt, instance in enumerate(candidates[:2]):
                url = instance.url if instance is not None else None
                try:
                    if req.chat:
                        return await renderer.chat(req.body, req.model_name, url)
                    return await renderer.text(str(req.body.get("prompt")), req.model_name, url)
                except RenderFailed as exc:
                    log.warning("render failed (attempt %d): %s", attempt + 1, exc)
            self._metrics.retries.labels("render_failed").inc()
            return None

    # -- the P leg ---------------------------------------------------------------------------

    def _prefill_body(
        self, req: TurnRequest, ids: list[int] | None, kv: dict[str, Any]
    ) -> dict[str, Any]:
        body = {k: v for k, v in req.body.items() if k not in _PREFILL_DROP}
        body["model"] = req.model_name
        body["max_tokens"] = 1
        body["stream"] = False
        kv = dict(kv)
        if ids is not None:
            if req.chat:
                kv["prompt_token_ids"] = ids  # P runs exactly the checked ids (§1.8)
            else:
                body["prompt"] = ids
        body["kv_transfer_params"] = kv
        return body

    async def _prefill(
        self, req: TurnRequest, prepared: _Prepared
    ) -> tuple[Instance | None, dict[str, Any] | None]:
        """Run the P leg; ``(None, None)`` when no P could serve it (D then runs alone)."""
        tried: set[Instance] = set()
        affinity = prepared.record.prefill if prepared.record is not None else None
        with self._leg(req, "prefill", **{"carryover.path": prepared.path}):
            for _ in range(3):
                instance = pick_prefill(
                    self._pool.available(req.model, "prefill", tried),
                    affinity,
                    self._config.affinity_slack,
                    self._rng,
                )
                if instance is None:
                    return await self._no_prefill(req, prepared)
                with_handle = prepared.plan.attaches_handle
                kv = (
                    prepared.plan.handle
                    if prepared.plan.handle is not None
                    else {"do_remote_decode": True}
                )
                body = self._prefill_body(req, prepared.ids, kv)
                if with_handle:
                    prepared.spend_handle(prepared.path)  # sent once, whatever happens next
                    prepared.sent = True
                with self._pool.lease(instance) as lease:
                    try:
                        answer = await self._upstream.post_json(
                            f"{instance.url}{req.path}",
                            body,
                            timeout=self._config.timeouts.prefill,
                            headers=req.engine_headers,
                        )
                    except UpstreamError as exc:
                        if is_client_fault(exc):
                            if with_handle:
                                # P refused the request before running it: the handle was
                                # never read, and the claimed record is gone.
                                self._release(req, kv, ReleaseCause.PREFILL_REFUSED)
                            raise
                        if (
                            with_handle
                            and isinstance(exc, EngineFailed)
                            and exc.upstream_status == 500
                        ):
                            # A stale or expired handle: vLLM answers a fast 500. Not the
                            # instance's fault (no verdict); retry cold, never with the handle.
                            self._metrics.retries.labels("prefill_handle_rejected").inc()
                            prepared.path = "cold-error"
                            continue
                        lease.failed(exc)
                        self._metrics.retries.labels("prefill_failed").inc()
                        if with_handle:
                            prepared.path = "cold-error"
                        tried.add(instance)
                        continue
                    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
                        lease.failed(
                            EngineFailed(
                                f"prefill instance {instance.name} returned no P-node params: "
                                "is it a kv_producer?"
                            )
                        )
                        tried.add(instance)
                        continue
                    lease.succeeded()
                    return instance, params
            return await self._no_prefill(req, prepared)

    async def _no_prefill(self, req: TurnRequest, prepared: _Prepared) -> tuple[None, None]:
        """No P could serve: D runs alone, or the turn is refused at once (config)."""
        unsent = prepared.plan.attaches_handle
        if unsent:
            prepared.spend_handle()
        if req.model.when_prefill_down == "fail":
            if unsent and prepared.record is not None and req.key is not None:
                # Never sent: put it back, so the client's retry still reuses D's blocks.
                try:
                    put_back = await self._store.commit(
                        req.key, prepared.record, now=time.time(), started_at=req.started_at
                    )
                    if not put_back.written:  # a later turn is stored: this one is dead
                        self._release(req, prepared.record.handle, ReleaseCause.SUPERSEDED)
                    self._release_replaced(req, put_back.replaced)
                except StoreUnavailable:
                    self._metrics.store_errors.labels("commit").inc()
                    self._metrics.left_to_expire.labels(LeftToExpire.COMMIT_OUTCOME_UNKNOWN).inc()
            raise EngineUnavailable(f"no healthy prefill instance for {req.model_name}")
        if unsent:
            self._metrics.releases.labels("no_prefill").inc()
        return None, None

    # -- the D leg ---------------------------------------------------------------------------

    def _decode_body(
        self, req: TurnRequest, ids: list[int] | None, p_params: dict[str, Any] | None
    ) -> dict[str, Any]:
        body = dict(req.body)
        body["model"] = req.model_name
        body["return_token_ids"] = True  # the ids D ran are S_D (§8.6)
        # P's dict verbatim (never rewrite remote_host, §1.9); no P: D computes alone and
        # still returns a handle (bidir-cpu "Extra").
        kv: dict[str, Any] = (
            dict(p_params) if p_params is not None else {"do_remote_prefill": False}
        )
        if ids is not None:
            if req.chat:
                kv["prompt_token_ids"] = ids
            else:
                body["prompt"] = ids
        body["kv_transfer_params"] = kv
        return body

    def _pick_decode(
        self, req: TurnRequest, tried: set[Instance], timed_out: set[Instance]
    ) -> Instance:
        """Another D than those tried if there is one, else one tried again: a retry after a
        dropped connection on the only D is better than a certain 503. One that timed out is
        not tried again (the client has waited long enough)."""
        instance = pick_decode(self._pool.available(req.model, "decode", tried), self._rng)
        if instance is None:
            again = self._pool.available(req.model, "decode", timed_out)
            instance = pick_decode([i for i in again if i in tried], self._rng)
        if instance is None:
            raise EngineUnavailable(f"no healthy decode instance for {req.model_name}")
        return instance

    async def _complete(self, req: TurnRequest, prepared: _Prepared) -> bytes:
        tried: set[Instance] = set()
        timed_out: set[Instance] = set()
        last: UpstreamError | None = None
        for attempt in range(2):
            p_instance, p_params = await self._prefill(req, prepared)
            decode = self._pick_decode(req, tried, timed_out)
            body = self._decode_body(req, prepared.ids, p_params)
            with self._pool.lease(decode) as lease:
                try:
                    with self._leg(req, "decode", **{"carryover.instance": decode.name}):
                        answer = await self._upstream.post_json(
                            f"{decode.url}{req.path}",
                            body,
                            timeout=self._config.timeouts.request,
                            headers=req.engine_headers,
                        )
                except UpstreamError as exc:
                    if is_client_fault(exc):
                        raise
                    lease.failed(exc)
                    self._metrics.retries.labels("decode_failed").inc()
                    tried.add(decode)
                    if isinstance(exc, EngineTimeout):
                        timed_out.add(decode)
                    prepared.spend_handle()
                    last = exc
                    log.warning("decode attempt %d failed: %s", attempt + 1, exc.message)
                    continue
                lease.succeeded()
            if not isinstance(answer, dict):
                raise EngineFailed("decode instance answered with a non-object body")
            output = DecodeOutput(client_wants_ids=req.client_wants_ids)
            data = output.body(answer)
            await self._commit(req, prepared, output, decode, p_instance, streamed=False)
            self._metrics.e2e.labels("false").observe(time.monotonic() - req.started)
            return data
        assert last is not None
        raise last

    async def _stream(self, req: TurnRequest, prepared: _Prepared) -> AsyncGenerator[bytes, None]:
        tried: set[Instance] = set()
        timed_out: set[Instance] = set()
        for attempt in range(2):
            p_instance, p_params = await self._prefill(req, prepared)
            decode = self._pick_decode(req, tried, timed_out)
            body = self._decode_body(req, prepared.ids, p_params)
            # Everything the stream holds (the lease, the connection, the span) is released
            # by one exit stack, whatever ends the stream: its end, an error, or a client that
            # left and closed this generator.
            held = contextlib.AsyncExitStack()
            lease = held.enter_context(self._pool.lease(decode))
            try:
                response = await held.enter_async_context(
                    self._upstream.stream(
                        f"{decode.url}{req.path}",
                        body,
                        first_byte=self._config.timeouts.first_byte,
                        headers=req.engine_headers,
                    )
                )
                lines = iter_sse(response, idle_timeout=self._config.timeouts.first_byte)
                first = await anext(lines)
            except (UpstreamError, StopAsyncIteration) as exc:
                await held.aclose()
                if is_client_fault(exc):
                    raise
                error = exc if isinstance(exc, UpstreamError) else EngineFailed("empty stream")
                lease.failed(error)
                self._metrics.retries.labels("decode_failed").inc()
                tried.add(decode)
                if isinstance(exc, EngineTimeout):
                    timed_out.add(decode)
                prepared.spend_handle()
                if attempt == 1:
                    raise error from None
                continue
            break
        output = DecodeOutput(client_wants_ids=req.client_wants_ids)
        # A span over the whole stream, first byte to [DONE].
        held.enter_context(self._leg(req, "decode", **{"carryover.instance": decode.name}))
        async with held:
            try:
                yield output.chunk(first)
                self._metrics.ttft.labels(turn_bucket(req.turn or 1)).observe(
                    time.monotonic() - req.started
                )
                async for data in lines:
                    if data == "[DONE]":
                        break
                    yield output.chunk(data)
                lease.succeeded()
            except UpstreamError as exc:
                # Mid-stream: the client gets an error event and [DONE], never a cut stream.
                lease.failed(exc)
                log.warning("decode stream failed mid-way: %s", exc.message)
                yield _sse_error(exc)
                yield b"data: [DONE]\n\n"
                return
            await self._commit(req, prepared, output, decode, p_instance, streamed=True)
            self._metrics.e2e.labels("true").observe(time.monotonic() - req.started)
            yield b"data: [DONE]\n\n"

    # -- commit ------------------------------------------------------------------------------

    async def _commit(
        self,
        req: TurnRequest,
        prepared: _Prepared,
        output: DecodeOutput,
        decode: Instance,
        prefill: Instance | None,
        *,
        streamed: bool,
    ) -> None:
        handle = output.handle
        if not isinstance(handle, dict) or not handle.get("do_remote_decode"):
            if streamed and decode.version is not None and not streams_handles(decode.version):
                cause = "streamed_before_0.33"
            elif output.stop_reason is not None and isinstance(output.stop_reason, str):
                cause = "stop_string"
            else:
                cause = "none_returned"
            self._metrics.no_handle.labels(cause).inc()
            return
        if req.key is None or not req.model.reuse:
            self._release(req, handle, ReleaseCause.NO_CONVERSATION)
            return
        if not prepared.storable:
            self._release(req, handle, ReleaseCause.IDS_DO_NOT_DETERMINE_KV)
            return
        if prepared.ids is not None and output.prompt_ids != prepared.ids:
            # The record would describe the checked ids, the blocks hold what D ran.
            log.warning("decode instance %s ran other prompt ids than were checked", decode.name)
            self._release(req, handle, ReleaseCause.DECODE_PROMPT_MISMATCH)
            return
        ids = prepared.ids if prepared.ids is not None else output.prompt_ids
        if ids is None:
            self._release(req, handle, ReleaseCause.NO_PROMPT_IDS)
            return
        sequence_end = len(ids) + len(output.output_ids)
        try:
            tokens = int(handle.get("remote_num_tokens") or 0)
            block_size = block_size_of(handle, decode.block_size)
        except (ValueError, TypeError):
            self._release(req, handle, ReleaseCause.BAD_HANDLE)
            return
        if not 0 < tokens <= sequence_end:
            self._release(req, handle, ReleaseCause.BAD_HANDLE)
            return
        chunk = chunk_size_for(block_size)
        hashed = prepared.hashed
        if hashed is not None and hashed.chunk_size == chunk:
            sequence = hashed.extended(output.output_ids)
        else:
            sequence = HashedTokens([*ids, *output.output_ids], chunk)
        now = time.time()
        record = Record(
            turn=req.turn or 1,
            handle=handle,
            decode=decode.name,
            decode_epoch=decode.epoch,
            prefill=prefill.name if prefill is not None else None,
            block_size=block_size,
            prefix=sequence.prefix(tokens, output_start=len(ids)),
            created_at=now,
            expires_at=now + req.model.record_ttl,
        )
        try:
            with self._leg(req, "commit"):
                committed = await self._store.commit(
                    req.key, record, now=now, started_at=req.started_at
                )
        except StoreUnavailable as exc:
            # The write may still land when the store answers again: releasing now would
            # leave a stored handle to freed blocks, which the next turn would send to P.
            self._metrics.store_errors.labels("commit").inc()
            self._metrics.left_to_expire.labels(LeftToExpire.COMMIT_OUTCOME_UNKNOWN).inc()
            log.warning("store unavailable, record may not be kept; D frees it at its TTL: %s", exc)
            return
        if committed.ended:  # DELETE came while this turn ran: the conversation is over
            self._release(req, handle, ReleaseCause.CONVERSATION_ENDED)
        elif not committed.written:
            self._release(req, handle, ReleaseCause.SUPERSEDED)
        self._release_replaced(req, committed.replaced)

    def _release_replaced(self, req: TurnRequest, replaced: Record | None) -> None:
        """A record overwritten before anyone claimed it: its handle was never sent, and
        nobody else will send it now."""
        if replaced is not None:
            self._release(req, replaced.handle, ReleaseCause.REPLACED)

    def _release(self, req: TurnRequest, handle: dict[str, Any], cause: str) -> None:
        """Free D's pinned blocks now: a one-token P request carrying the handle with
        ``remote_num_tokens: 0`` makes P compute locally and D release them (bidir-cpu Q4)."""
        self._metrics.releases.labels(cause).inc()
        task = asyncio.create_task(self.release(req.model, req.model_name, handle))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def release(self, model: ModelConfig, model_name: str, handle: dict[str, Any]) -> bool:
        instance = pick_prefill(self._pool.available(model, "prefill"), None, 0, self._rng)
        if instance is None:
            return False
        body = {
            "model": model_name,
            "prompt": [0],
            "max_tokens": 1,
            "kv_transfer_params": release_handle(handle),
        }
        try:
            await self._upstream.post_json(
                f"{instance.url}/v1/completions", body, timeout=self._config.timeouts.prefill
            )
        except UpstreamError as exc:
            log.info("release of a handle failed (D frees it at its TTL): %s", exc.message)
            return False
        return True


def _sse_error(exc: UpstreamError) -> bytes:
    body = {
        "error": {
            "message": exc.message,
            "type": exc.error_type,
            "param": None,
            "code": exc.status_code,
        }
    }
    return b"data: " + msgspec.json.encode(body) + b"\n\n"
