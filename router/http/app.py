"""The Litestar app: routes, lifespan and error rendering, assembled in ``create_app``."""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException

from carryover.router.config import RouterConfig
from carryover.router.engines.upstream import Upstream
from carryover.router.errors import CarryoverError, error_body, http_error_type
from carryover.router.fleet.discovery import Resolver, give_back_left, resolve
from carryover.router.fleet.draining import refresh_draining_forever
from carryover.router.fleet.held import report_held_forever
from carryover.router.fleet.instance import Instance
from carryover.router.fleet.pool import InstancePool
from carryover.router.fleet.pressure import relieve_forever
from carryover.router.handles.ledger import Origin
from carryover.router.http.auth import Authenticator
from carryover.router.http.inference import chat_completions, completions, models
from carryover.router.http.operations import (
    drain_instance,
    end_conversation,
    health,
    inspect_conversation,
    metrics,
    openapi,
    ready,
)
from carryover.router.http.readiness import watch_models
from carryover.router.http.services import Services, json_response
from carryover.router.kv.metrics import KvMetrics
from carryover.router.kv.service import KvEvents
from carryover.router.loop_lag import watch_loop_lag
from carryover.router.memory import trim_after_large_requests
from carryover.router.metrics import RouterMetrics
from carryover.router.openai import BodyLimits
from carryover.router.outcomes import ReleaseCause
from carryover.router.render.choose import Renderers
from carryover.router.store import check_store, open_store
from carryover.router.tenants.limits import TenantGate
from carryover.router.tenants.salt import salts_of
from carryover.router.tenants.usage import read_usage_forever
from carryover.router.tokens.check import keep_checking
from carryover.router.tracing import Tracing
from carryover.router.turn import TurnRunner
from carryover.router.turn.runtime import Models
from carryover.router.turn.services import Planner
from carryover.state import Record, Store, plan
from carryover.state.resp import redacted_url

if TYPE_CHECKING:
    import httpx

__all__ = ["Services", "create_app"]

log = logging.getLogger("carryover.router")


def _error_response(exc: CarryoverError) -> Response[bytes]:
    return json_response(
        exc.status_code, error_body(exc.status_code, exc.public_message, exc.error_type, exc.param)
    )


def _handle_carryover(_: Request[Any, Any, Any], exc: CarryoverError) -> Response[bytes]:
    return _error_response(exc)


def _handle_http(_: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    status = exc.status_code
    kind = http_error_type(status)
    message = exc.detail if status < 500 else "internal error"
    return json_response(status, error_body(status, str(message), kind))


def _handle_unexpected(_: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    log.exception("unexpected error", exc_info=exc)
    return json_response(500, error_body(500, "internal error", "InternalServerError"))


def create_app(
    config: RouterConfig,
    *,
    store: Store | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    seed: int | None = None,
    clock: Callable[[], float] = time.time,
    planner: Planner | None = None,
    resolver: Resolver | None = None,
) -> Litestar:
    """Build the router. The keyword arguments replace what the config would make: the store
    (embedding, tests), the transport to the engines (in-process fakes), the wall clock
    (records, expiry; tests drive it) and the planner (``state.plan``; the benchmark's
    unchecked arm names its own in ``config.planner``) and the DNS resolver of ``dns://``
    instances (router/fleet/discovery.py)."""
    chosen_planner = planner or (_import_planner(config.planner) if config.planner else plan)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        owned_store = store is None
        backend: Store = store or open_store(config, clock=clock)
        if owned_store:
            await check_store(backend, config)
        upstream = Upstream(config.timeouts, transport)
        metrics_ = RouterMetrics()
        pool = InstancePool(config, upstream, backend, metrics_, resolver or resolve)
        renderers = Renderers(config, upstream, metrics_)
        kv = KvEvents(config, KvMetrics(metrics_.registry))
        models = Models.build(config.models, renderers.renderers, upstream)
        gate = TenantGate(config, metrics_.tenant_limited)
        runner = TurnRunner(
            config,
            pool,
            backend,
            upstream,
            metrics_,
            random.Random(seed),
            clock=clock,
            planner=chosen_planner,
            kv=kv,
            gate=gate,
        )
        services = Services(
            config=config,
            store=backend,
            upstream=upstream,
            pool=pool,
            runner=runner,
            metrics=metrics_,
            auth=Authenticator(
                config.api_keys, config.admin_key, private_metrics=config.private_metrics
            ),
            models=models,
            tracing=Tracing.from_environment(),
            clock=clock,
            kv=kv,
            salts=salts_of(config),
            gate=gate,
            limits=BodyLimits(config.max_messages, config.max_tools, config.max_nesting_depth),
        )
        app.state.services = services
        kv.start()
        kv.watch_warm_tiers(
            upstream, interval=config.health_interval, timeout=config.timeouts.health
        )
        pool.on_restart.append(lambda instance: kv.instance_restarted(instance.name))

        def giving_back(cause: ReleaseCause) -> Callable[[Instance, Record], Awaitable[bool]]:
            """Releases a handle claimed from ``instance``'s records (relief, departure)."""

            def give_back(instance: Instance, record: Record) -> Awaitable[bool]:
                runtime = models.of(instance.model)
                name = runtime.name or ""
                return runner.give_back(runtime, name, record.handle, Origin.RELIEVED, cause)

            return give_back

        async def instance_left(instance: Instance) -> int:
            kv.left(instance.name)
            if instance.role != "decode":
                return 0
            release = giving_back(ReleaseCause.INSTANCE_GONE)
            given = await give_back_left(backend, instance, release, runner.ledger, now=clock())
            backend.forget(instance.name)
            return given

        pool.on_join.append(lambda instance: kv.joined(instance.config, instance.model))
        pool.on_leave.append(instance_left)
        await pool.start()
        discovery = asyncio.create_task(watch_models(services, max(config.health_interval, 10.0)))
        renderers.start(pool, lambda model: models.of(model).name)

        def decode_names() -> list[str]:
            return [i.name for i in pool.decodes()]

        held = asyncio.create_task(
            report_held_forever(backend, decode_names, metrics_, config.held_interval)
        )
        counting = (
            asyncio.create_task(
                read_usage_forever(
                    backend,
                    decode_names,
                    gate,
                    metrics_,
                    interval=config.held_interval,
                    clock=clock,
                )
            )
            if gate.reads_usage
            else None
        )
        relief = asyncio.create_task(
            relieve_forever(
                backend,
                pool.decodes,
                giving_back(ReleaseCause.DECODE_PRESSURE),
                runner.ledger,
                metrics_,
                high_water=config.decode_kv_high_water,
                low_water=config.decode_kv_low_water,
                interval=config.health_interval,
                clock=clock,
            )
        )
        checking = [
            asyncio.create_task(
                keep_checking(
                    runtime.tokens_check,
                    runtime.render,
                    runtime.config,
                    functools.partial(getattr, runtime, "name"),
                    retry=config.health_interval,
                    interval=60.0,
                )
            )
            for runtime in models
            if runtime.tokens_check is not None
        ]
        lagging = asyncio.create_task(
            watch_loop_lag(metrics_.loop_lag, collections=metrics_.gc_pauses)
        )
        publishing = asyncio.create_task(metrics_.publish_forever())
        trimming = asyncio.create_task(trim_after_large_requests(services.large_ended))
        draining = asyncio.create_task(
            refresh_draining_forever(backend, pool, metrics_, config.health_interval)
        )
        log.info("serving", extra=_summary(config, backend))
        try:
            yield
        finally:
            services.closing = True
            deadline = time.monotonic() + config.shutdown_grace
            while services.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            discovery.cancel()
            for task in checking:
                task.cancel()
            held.cancel()
            if counting is not None:
                counting.cancel()
            relief.cancel()
            publishing.cancel()
            trimming.cancel()
            lagging.cancel()
            draining.cancel()
            renderers.stop()
            await kv.stop()
            await runner.drain_background()
            await pool.stop()
            await upstream.aclose()
            if owned_store:
                await backend.close()
            await asyncio.to_thread(services.tracing.shutdown)  # flushes the last spans
            metrics_.worker_exited()

    return Litestar(
        route_handlers=[
            chat_completions,
            completions,
            models,
            health,
            ready,
            metrics,
            end_conversation,
            inspect_conversation,
            drain_instance,
            openapi,
        ],
        openapi_config=None,  # the published document is router.http.api_schema's
        lifespan=[lifespan],
        exception_handlers={
            CarryoverError: _handle_carryover,
            HTTPException: _handle_http,
            Exception: _handle_unexpected,
        },
        request_max_body_size=config.max_body_bytes,
        logging_config=None,
    )


def _summary(config: RouterConfig, store: Store) -> dict[str, Any]:
    """What this process serves, in the one line it logs at startup."""
    durability = getattr(store, "durability", None)
    return {
        "listen": f"{config.host}:{config.port}",
        "workers": config.workers,
        "models": [
            {
                "name": model.name or "(asked from the engines)",
                "prefill": [i.url if i.discovered else i.label for i in model.prefill],
                "decode": [i.url if i.discovered else i.label for i in model.decode],
                "render": model.render.backend,
                "engine_api": model.engine_api,
                "kv_events": sum(1 for i in (*model.prefill, *model.decode) if i.kv_events),
            }
            for model in config.models
        ],
        "store": redacted_url(config.redis) if config.redis else "in-process",
        "durability": str(durability) if durability is not None else None,
        "tenants": len(set(config.api_keys.values())) or "none (no keys)",
        "shared_cache": config.shared_cache,
    }


def _import_planner(path: str) -> Planner:
    """``module:function``, imported by name (the router never imports the benchmark)."""
    module, _, name = path.partition(":")
    found: Planner = getattr(importlib.import_module(module), name)
    return found
