"""Render, claim, plan: the prompt ids, the conversation's record, what to send P."""

from __future__ import annotations

import asyncio
import logging

from carryover.router.errors import BadRequest, EngineUnavailable
from carryover.router.fields import NON_TEXT_CONTENT, UNKNOWN_FIELD, reuse_blockers
from carryover.router.fleet.instance import Instance
from carryover.router.handles.fates import Event
from carryover.router.handles.ledger import Origin
from carryover.router.outcomes import RetryCause
from carryover.router.render.context import refuse_past_context
from carryover.router.render.errors import RenderFailed
from carryover.router.tokens.legs import mend_rendered
from carryover.router.turn.model import NOTHING_HELD, Prepared, TokensPrompt, TurnRequest
from carryover.router.turn.path import Entry
from carryover.router.turn.placement import KvView
from carryover.router.turn.services import TurnServices
from carryover.router.turn.timing import timed
from carryover.state import (
    HashedTokens,
    NotDurable,
    PlanSettings,
    Reason,
    Record,
    StoreUnavailable,
    chunk_size_for,
)

__all__ = ["prepare"]

log = logging.getLogger("carryover.turn")

_PROMPT_FIELD = frozenset({"prompt"})
# Prompts whose ids do not determine their KV.
_IDS_DO_NOT_DETERMINE_KV = frozenset(
    {NON_TEXT_CONTENT, UNKNOWN_FIELD, "mm_payload", "prompt_embeds"}
)


async def prepare(svc: TurnServices, req: TurnRequest) -> Prepared:
    tokens: TokensPrompt | None = None
    if req.model.tokens_only:
        # The render server applies every field of the request, and the engines run exactly
        # the ids it returns: nothing is left for an engine to apply unchecked.
        tokens = await _render_tokens(svc, req)
        if tokens.generate.get("features") or tokens.generate.get("content_parts"):
            return await _prepare_unchecked(svc, req, [NON_TEXT_CONTENT], tokens)
        ids: list[int] | None = tokens.ids
    else:
        renders = req.runtime.renderer.renders if req.chat else _PROMPT_FIELD
        blockers = reuse_blockers(req.body, chat=req.chat, renders=renders)
        if blockers:
            return await _prepare_unchecked(svc, req, blockers)
        ids = await _render(svc, req)
    record: Record | None = None
    store_failed = False
    use_state = req.reuses and ids is not None
    if use_state:
        record, store_failed = await _claim(svc, req)
        if record is not None:
            svc.metrics.handle_age.observe(max(0.0, svc.clock() - record.created_at))
        elif not store_failed and svc.gate is not None:
            # A new record: 429 when the tenant holds its limit (nothing claimed to settle).
            svc.gate.admit_new(req.tenant)
    hashed = None
    decided = NOTHING_HELD
    if ids is not None and use_state:
        chunk = record.prefix.chunk_size if record else chunk_size_for(req.model.block_size)
        hashed = HashedTokens(ids, chunk)
        if record is not None:
            settings = PlanSettings(
                partial_reuse=req.model.partial_reuse,
                recompute_threshold=req.model.kv_recompute_threshold,
            )
            epoch = svc.pool.epoch_of(record.decode)
            decided = svc.planner(
                record, hashed, now=svc.clock(), decode_epoch=epoch, settings=settings
            )
    if req.turn is None:
        req.turn = record.turn + 1 if record is not None else 1
    claimed = (
        svc.ledger.hold(Origin.CLAIMED, record.handle, req.release_target)
        if record is not None
        else None
    )
    if claimed is not None and decided.handle is None:
        # Nothing of it goes to P: its blocks are gone, or about to be, or unreadable.
        dropped = _DROPPED.get(decided.reason) if decided.reason else None
        svc.ledger.record(claimed, dropped or Event.UNREADABLE)
    entry = Entry(
        decided,
        conversation=req.key is not None,
        checked=True,
        state_known=ids is not None and not store_failed and req.model_name_known,
    )
    return Prepared(
        ids,
        hashed,
        record,
        entry,
        KvView(svc.kv, ids, req.cache_salt, hashed),
        tokens=tokens,
        claimed=claimed,
    )


#: Why a claimed record's handle goes nowhere, by the plan's reason for not attaching it.
_DROPPED = {
    Reason.EXPIRED: Event.RECORD_EXPIRED,
    Reason.STALE_ENGINE: Event.DECODE_RESTARTED,
}


async def _claim(svc: TurnServices, req: TurnRequest) -> tuple[Record | None, bool]:
    """The record, taken out of the store; ``(None, True)`` when the store failed. The claim
    runs to its end even if the client leaves meanwhile: a record it took is then released
    (nobody will send it), and one it may have taken is left to expire."""
    assert req.key is not None
    claim = svc.background.run(svc.store.claim(req.key))
    try:
        with timed(svc.metrics, req, "claim"):
            return await asyncio.shield(claim), False
    except asyncio.CancelledError:
        claim.add_done_callback(lambda done: _give_up(svc, req, done))
        raise
    except (NotDurable, StoreUnavailable) as exc:
        _claim_failed(svc, exc)
        return None, True


def _claim_failed(svc: TurnServices, exc: NotDurable | StoreUnavailable) -> None:
    svc.metrics.store_errors.labels("claim").inc()
    if isinstance(exc, NotDurable):
        svc.ledger.lost(Origin.CLAIMED, Event.NOT_DURABLE)
        log.warning("claim not durable, turn served cold: %s", exc)
    else:
        # The claim may still have taken the record: its handle is lost to everyone.
        svc.ledger.lost(Origin.CLAIMED, Event.STORE_UNKNOWN)
        log.warning("store unavailable, turn served cold: %s", exc)


def _give_up(svc: TurnServices, req: TurnRequest, done: asyncio.Task[Record | None]) -> None:
    """The client left during the claim: what it took was never sent, so it is released."""
    if done.cancelled():
        return
    exc = done.exception()
    if isinstance(exc, NotDurable | StoreUnavailable):
        _claim_failed(svc, exc)
    if exc is not None:
        return
    record = done.result()
    if record is not None:
        held = svc.ledger.hold(Origin.CLAIMED, record.handle, req.release_target)
        svc.ledger.record(held, Event.CLIENT_GONE)


async def _prepare_unchecked(
    svc: TurnServices, req: TurnRequest, blockers: list[str], tokens: TokensPrompt | None = None
) -> Prepared:
    """A turn with fields the engine must apply itself (router/fields.py): nothing is
    rendered or checked, no handle attached; the stored one is taken and released."""
    for name in blockers:
        svc.metrics.unchecked.labels(name).inc()
    record: Record | None = None
    if req.reuses:
        record, failed = await _claim(svc, req)
        if record is not None:
            held = svc.ledger.hold(Origin.CLAIMED, record.handle, req.release_target)
            svc.ledger.record(held, Event.UNCHECKED)
        elif not failed and svc.gate is not None:
            svc.gate.admit_new(req.tenant)
    if req.turn is None:
        req.turn = record.turn + 1 if record is not None else 1
    cold = NOTHING_HELD
    entry = Entry(cold, conversation=req.key is not None, checked=False, state_known=False)
    return Prepared(
        None,
        None,
        None,
        entry,
        KvView(None, None, None, None),
        storable=not set(blockers) & _IDS_DO_NOT_DETERMINE_KV,
        tokens=tokens,
    )


async def _render_tokens(svc: TurnServices, req: TurnRequest) -> TokensPrompt:
    """The render server's GenerateRequest; without it no turn can run (tokens-only engines
    cannot render), so its failure is the request's: 503, or its 4xx for a bad request."""
    check = req.runtime.tokens_check
    if check is not None and check.refusal is not None:
        raise EngineUnavailable(check.refusal)
    request = dict(req.body)
    request["model"] = req.model_name
    with timed(svc.metrics, req, "render"):
        generate = mend_rendered(await req.runtime.render.render(request, chat=req.chat), req.body)
    if req.cache_salt is not None:
        generate["cache_salt"] = req.cache_salt  # whatever the render server copied
    if (generate.get("sampling_params") or {}).get("stop"):
        # A --tokens-only engine does not detokenize and refuses stop strings (vLLM 0.32
        # token_in_token_out/serving.py): say so before any engine sees the request.
        raise BadRequest(
            "stop strings are not supported by this model's tokens-only engines; "
            "use stop_token_ids",
            param="stop",
        )
    return TokensPrompt(generate, request)


async def _render(svc: TurnServices, req: TurnRequest) -> list[int] | None:
    """The prompt ids, or ``None`` when the backend is down (the turn then runs without
    reuse: engines render themselves, nothing is checked, nothing is attached)."""
    context = req.runtime.max_model_len
    if not req.chat:
        prompt = req.body.get("prompt")
        if isinstance(prompt, list):
            refuse_past_context(len(prompt), context)
            return prompt  # token ids are taken as they are
    renderer = req.runtime.renderer
    body = req.body
    if (
        req.model.render.exclude_tools_when_tool_choice_none
        and body.get("tool_choice") == "none"
        and "tools" in body
    ):
        # The template gets no tools when the engines leave them out (vLLM's
        # ``--exclude-tools-when-tool-choice-none``, ``vllm/renderers/online_renderer.py``).
        body = {key: value for key, value in body.items() if key != "tools"}
    candidates: list[Instance | None] = [*svc.pool.available(req.model, "prefill")] or [None]
    with timed(svc.metrics, req, "render"):
        for attempt, instance in enumerate(candidates[:2]):
            url = instance.url if instance is not None else None
            try:
                if req.chat:
                    ids = await renderer.chat(
                        body, req.model_name, url, size=req.body_bytes, max_model_len=context
                    )
                else:
                    prompt = str(req.body.get("prompt"))
                    ids = await renderer.text(prompt, req.model_name, url, max_model_len=context)
            except RenderFailed as exc:
                log.warning("render failed (attempt %d): %s", attempt + 1, exc)
                continue
            refuse_past_context(len(ids), context)  # whichever renderer: P is never sent it
            return ids
        svc.metrics.retries.labels(RetryCause.RENDER_FAILED).inc()
        return None
