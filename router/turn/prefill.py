"""The P leg: one token computed (or pulled from D with the handle), P's dict for D."""

from __future__ import annotations

import asyncio
import time

from carryover.router.errors import EngineFailed, EngineUnavailable, UpstreamError, is_client_fault
from carryover.router.fleet.instance import Instance
from carryover.router.fleet.policy import pick_prefill
from carryover.router.handles.fates import Event
from carryover.router.handles.ledger import HeldHandle
from carryover.router.outcomes import RetryCause
from carryover.router.turn import prefill_answer
from carryover.router.turn.commit import settle_write
from carryover.router.turn.costs import pull_pays
from carryover.router.turn.model import NOTHING_HELD, PrefillOutcome, Prepared, TurnRequest
from carryover.router.turn.path import PathNote, TurnPath, final_path
from carryover.router.turn.placement import KvView
from carryover.router.turn.prefill_answer import PrefillAnswer
from carryover.router.turn.services import TurnServices
from carryover.router.turn.timing import timed
from carryover.state import Path, Plan, Reason, Record, StoreUnavailable, release_handle

__all__ = ["run_prefill"]


async def run_prefill(
    svc: TurnServices,
    req: TurnRequest,
    prepared: Prepared,
    plan: Plan,
    notes: tuple[PathNote, ...],
) -> PrefillOutcome:
    """Run the P leg with what the turn still holds (``plan``) after the attempts before
    (``notes``); its outcome says whether a P answered (else D runs alone)."""
    tried: set[Instance] = set()
    last = prepared.record.prefill if prepared.record is not None else None
    kv_view = prepared.kv
    held = kv_view.holding_warm
    # A conversation's first turn: its home P by its id (router/fleet/policy.py).
    home = (
        req.key.storage_key()
        if req.key is not None and req.turn == 1 and prepared.record is None
        else None
    )
    noted = list(notes)
    path = final_path(prepared.entry, noted)
    with timed(svc.metrics, req, "prefill", **{"carryover.path": path}):
        for _ in range(3):
            candidates = svc.pool.available(req.model, "prefill", tried)
            instance = pick_prefill(
                candidates, svc.rng, held=held, last=last, affinity=svc.affinity, home=home
            )
            if instance is None:
                return await _no_prefill(svc, req, prepared, plan, noted)
            choice = kv_view.choice("prefill", instance, candidates)
            sent, wasted = _pull_or_give_back(req, kv_view, plan, instance)
            claimed = prepared.claimed if sent.attaches_handle else None
            kv = sent.handle if sent.handle is not None else {"do_remote_decode": True}
            leg_path, body = req.runtime.api.prefill(req, prepared, kv)
            attempt: list[PathNote] = [PathNote.PULL_WASTED] if wasted else []
            if claimed is not None:
                # From here a client that leaves must not release it.
                svc.ledger.record(claimed, Event.SENDING)
            elif final_path(prepared.entry, noted) is not TurnPath.WARM and kv_view.loads_warm(
                instance
            ):
                attempt.append(PathNote.WARM_LOADED)
            with svc.pool.lease(instance, req.tenant) as lease:
                try:
                    answer: PrefillAnswer = await svc.upstream.post_json(
                        f"{instance.url}{leg_path}",
                        body,
                        timeout=svc.config.timeouts.prefill,
                        headers=req.engine_headers,
                        decode=prefill_answer.read,
                    )
                except EngineUnavailable as exc:
                    # Never sent (no connection): the handle goes to the next P, if any.
                    lease.failed(exc)
                    svc.metrics.retries.labels(RetryCause.PREFILL_FAILED).inc()
                    tried.add(instance)
                    if claimed is not None:
                        svc.ledger.record(claimed, Event.NEVER_LEFT)
                    else:
                        noted += attempt
                    continue
                except UpstreamError as exc:
                    if is_client_fault(exc):
                        if claimed is not None:
                            # P's own refusal proves it never read the handle; a 408 or 429
                            # may come from a proxy in front of a P that did.
                            svc.ledger.record(claimed, _refusal(exc))
                        raise
                    noted += attempt
                    if claimed is not None:
                        plan = NOTHING_HELD
                        noted.append(PathNote.REUSE_LOST)
                        if _rejected(exc):
                            # A stale or expired handle: vLLM answers a fast 500. Not the
                            # instance's fault (no verdict); retry cold, never with it.
                            svc.metrics.retries.labels(RetryCause.PREFILL_HANDLE_REJECTED).inc()
                            svc.ledger.record(claimed, Event.P_REJECTED)
                            continue
                        # P may have read the blocks: never released under it.
                        svc.ledger.record(claimed, Event.P_FAILED)
                    lease.failed(exc)
                    svc.metrics.retries.labels(RetryCause.PREFILL_FAILED).inc()
                    tried.add(instance)
                    continue
                noted += attempt
                if claimed is not None:
                    plan = NOTHING_HELD  # the handle went: later attempts run cold
                    if sent.path is Path.RELEASE:  # it went with remote_num_tokens 0
                        svc.ledger.record(claimed, Event.P_FREED, str(sent.reason))
                    else:
                        svc.ledger.record(claimed, Event.P_READ)
                params = answer.kv_transfer_params
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
                svc.metrics.prefilled.labels(req.model_label, req.turn_label).observe(
                    time.monotonic() - req.started
                )
                if claimed is None:
                    kv_view.warm_stored(instance)
                return PrefillOutcome(instance, params, answer.ran, plan, tuple(noted), choice)
        return await _no_prefill(svc, req, prepared, plan, noted)


def _pull_or_give_back(
    req: TurnRequest, kv_view: KvView, plan: Plan, instance: Instance
) -> tuple[Plan, bool]:
    """What goes to ``instance``, and whether the pull was given up: where its own cache
    holds all but a few of the handle's tokens (the index says), a pull costs more than
    computing them, so the handle goes with ``remote_num_tokens`` 0 (D frees its blocks, P
    computes; docs/turn-costs.md)."""
    if plan.path not in (Path.REUSE, Path.PARTIAL) or plan.handle is None:
        return plan, False
    cached = kv_view.cached(instance)
    if cached is None:  # nothing known of P: the handle goes
        return plan, False
    if pull_pays(cached.device_tokens, plan.reused_tokens, req.model.costs):
        return plan, False
    given_back = Plan(
        Path.RELEASE, Reason.PULL_DOES_NOT_PAY, release_handle(plan.handle), 0, plan.common
    )
    return given_back, True


def _rejected(exc: UpstreamError) -> bool:
    return isinstance(exc, EngineFailed) and exc.upstream_status == 500


#: P's answers that do not prove the request never ran: a proxy's timeout or rate limit in
#: front of a P that may have started reading the handle.
_UNPROVEN = frozenset({408, 429})


def _refusal(exc: UpstreamError) -> Event:
    status = exc.upstream_status if isinstance(exc, EngineFailed) else None
    return Event.P_UNPROVEN if status in _UNPROVEN else Event.P_REFUSED


async def _no_prefill(
    svc: TurnServices, req: TurnRequest, prepared: Prepared, plan: Plan, notes: list[PathNote]
) -> PrefillOutcome:
    """No P could serve: D runs alone, or the turn is refused at once (config)."""
    claimed = prepared.claimed if plan.attaches_handle else None
    if req.model.when_prefill_down == "fail":
        if claimed is not None and prepared.record is not None and req.key is not None:
            # Never sent: put it back, so the client's retry still reuses D's blocks. The
            # write owns the handle from here: a client leaving meanwhile changes nothing.
            svc.ledger.record(claimed, Event.WRITING)
            await asyncio.shield(svc.background.run(_put_back(svc, req, prepared.record, claimed)))
        raise EngineUnavailable(f"no healthy prefill instance for {req.model_name}")
    if claimed is None:
        return PrefillOutcome(None, None, None, plan, tuple(notes))
    # D serves alone; a release goes through a P, and there is none.
    svc.ledger.record(claimed, Event.NO_PREFILL)
    return PrefillOutcome(None, None, None, NOTHING_HELD, (*notes, PathNote.REUSE_LOST))


async def _put_back(
    svc: TurnServices, req: TurnRequest, record: Record, claimed: HeldHandle
) -> None:
    assert req.key is not None
    try:
        put_back = await svc.store.commit(
            req.key, record, now=svc.clock(), running_for=req.running_for
        )
    except StoreUnavailable:
        svc.metrics.store_errors.labels("commit").inc()
        svc.ledger.record(claimed, Event.STORE_UNKNOWN)
        return
    settle_write(svc, req, claimed, put_back)
