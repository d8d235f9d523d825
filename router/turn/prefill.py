"""The P leg: one token computed (or pulled from D with the handle), P's dict for D."""

from __future__ import annotations

import time
from typing import Any

from carryover.router.errors import EngineFailed, EngineUnavailable, UpstreamError, is_client_fault
from carryover.router.fleet.instance import Instance
from carryover.router.fleet.policy import pick_prefill
from carryover.router.handles.fates import Event
from carryover.router.handles.ledger import HeldHandle, Stage
from carryover.router.outcomes import RetryCause
from carryover.router.turn import prefill_answer
from carryover.router.turn.commit import release_replaced, written_event
from carryover.router.turn.costs import pull_pays
from carryover.router.turn.model import Prepared, TurnPath, TurnRequest
from carryover.router.turn.placement import (
    cached_on,
    holding,
    note_choice,
    note_warm,
    note_warm_stored,
)
from carryover.router.turn.prefill_answer import PrefillAnswer
from carryover.router.turn.services import TurnServices
from carryover.state import Path, Plan, Reason, Record, StoreUnavailable, release_handle

__all__ = ["run_prefill"]


async def run_prefill(
    svc: TurnServices, req: TurnRequest, prepared: Prepared
) -> tuple[Instance | None, dict[str, Any] | None]:
    """Run the P leg; ``(None, None)`` when no P could serve it (D then runs alone)."""
    tried: set[Instance] = set()
    last = prepared.record.prefill if prepared.record is not None else None
    held = holding(svc, prepared, warm=True)
    # A conversation's first turn: its home P by its id (router/fleet/policy.py).
    home = (
        req.key.storage_key()
        if req.key is not None and req.turn == 1 and prepared.record is None
        else None
    )
    with svc.leg(req, "prefill", **{"carryover.path": prepared.path}):
        for _ in range(3):
            candidates = svc.pool.available(req.model, "prefill", tried)
            instance = pick_prefill(
                candidates, svc.rng, held=held, last=last, affinity=svc.affinity, home=home
            )
            if instance is None:
                return await _no_prefill(svc, req, prepared)
            note_choice(svc, prepared, "prefill", instance, candidates)
            planned, path_before = prepared.plan, prepared.path
            _give_back_if_pull_wasted(svc, req, prepared, instance)
            plan_ = prepared.plan
            claimed = prepared.claimed if plan_.attaches_handle else None
            kv = plan_.handle if plan_.handle is not None else {"do_remote_decode": True}
            path, body = req.runtime.api.prefill(req, prepared, kv)
            if claimed is not None:
                # From here a client that leaves must not release it.
                svc.ledger.move(claimed, Stage.SENT)
                prepared.spend_handle(prepared.path)
            else:
                note_warm(svc, prepared, instance)
            with svc.pool.lease(instance, req.tenant) as lease:
                try:
                    answer: PrefillAnswer = await svc.upstream.post_json(
                        f"{instance.url}{path}",
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
                        svc.ledger.move(claimed, Stage.CLAIMED)
                        prepared.unsend(planned, path_before)
                    continue
                except UpstreamError as exc:
                    if is_client_fault(exc):
                        if claimed is not None:
                            # P's own refusal proves it never read the handle; a 408 or 429
                            # may come from a proxy in front of a P that did.
                            svc.ledger.settle(claimed, _refusal(exc))
                        raise
                    if claimed is not None and _rejected(exc):
                        # A stale or expired handle: vLLM answers a fast 500. Not the
                        # instance's fault (no verdict); retry cold, never with the handle.
                        svc.metrics.retries.labels(RetryCause.PREFILL_HANDLE_REJECTED).inc()
                        svc.ledger.settle(claimed, Event.P_REJECTED)
                        prepared.path = TurnPath.COLD_ERROR
                        continue
                    lease.failed(exc)
                    svc.metrics.retries.labels(RetryCause.PREFILL_FAILED).inc()
                    if claimed is not None:
                        # P may have read the blocks: never released under it.
                        svc.ledger.settle(claimed, Event.P_FAILED)
                        prepared.path = TurnPath.COLD_ERROR
                    tried.add(instance)
                    continue
                if claimed is not None:
                    if plan_.path is Path.RELEASE:  # it went with remote_num_tokens 0
                        svc.ledger.settle(claimed, Event.P_FREED, str(plan_.reason))
                    else:
                        svc.ledger.settle(claimed, Event.P_READ)
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
                prepared.prefill_ids = answer.ran()
                svc.metrics.prefilled.labels(req.model_label, req.turn_label).observe(
                    time.monotonic() - req.started
                )
                if claimed is None:
                    note_warm_stored(svc, prepared, instance)
                return instance, params
        return await _no_prefill(svc, req, prepared)


def _give_back_if_pull_wasted(
    svc: TurnServices, req: TurnRequest, prepared: Prepared, instance: Instance
) -> None:
    """Where the chosen P's own cache holds all but a few of the handle's tokens (the index
    says), a pull costs more than computing them: the handle goes to P with
    ``remote_num_tokens`` 0, so D frees its blocks and P computes (docs/turn-costs.md)."""
    plan_ = prepared.plan
    if plan_.path not in (Path.REUSE, Path.PARTIAL) or plan_.handle is None:
        return
    cached = cached_on(svc, prepared, instance)
    if cached is None:  # nothing known of P: the handle goes
        return
    if pull_pays(cached.device_tokens, plan_.reused_tokens, req.model.costs):
        return
    prepared.plan = Plan(
        Path.RELEASE, Reason.PULL_DOES_NOT_PAY, release_handle(plan_.handle), 0, plan_.common
    )
    prepared.path = TurnPath.PREFILL_CACHE


def _rejected(exc: UpstreamError) -> bool:
    return isinstance(exc, EngineFailed) and exc.upstream_status == 500


#: P's answers that do not prove the request never ran: a proxy's timeout or rate limit in
#: front of a P that may have started reading the handle.
_UNPROVEN = frozenset({408, 429})


def _refusal(exc: UpstreamError) -> Event:
    status = exc.upstream_status if isinstance(exc, EngineFailed) else None
    return Event.P_UNPROVEN if status in _UNPROVEN else Event.P_REFUSED


async def _no_prefill(svc: TurnServices, req: TurnRequest, prepared: Prepared) -> tuple[None, None]:
    """No P could serve: D runs alone, or the turn is refused at once (config)."""
    claimed = prepared.claimed if prepared.plan.attaches_handle else None
    if claimed is not None:
        prepared.spend_handle()
    if req.model.when_prefill_down == "fail":
        if claimed is not None and prepared.record is not None and req.key is not None:
            # Never sent: put it back, so the client's retry still reuses D's blocks. The
            # write owns the handle from here: a client leaving meanwhile changes nothing.
            svc.ledger.move(claimed, Stage.WRITING)
            await svc.to_the_end(_put_back(svc, req, prepared.record, claimed))
        raise EngineUnavailable(f"no healthy prefill instance for {req.model_name}")
    if claimed is not None:
        # D serves alone; a release goes through a P, and there is none.
        svc.ledger.settle(claimed, Event.NO_PREFILL)
    return None, None


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
        svc.ledger.settle(claimed, Event.STORE_UNKNOWN)
        return
    svc.ledger.settle(claimed, written_event(put_back))
    release_replaced(svc, req, put_back)
