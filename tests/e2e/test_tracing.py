"""OpenTelemetry spans, exported over OTLP/HTTP to a real receiver on loopback."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.support.ports import free_port
from tests.support.router_proc import RouterProcess
from tests.support.sims import running, sim_config
from tests.support.stack import chat_turn, router_args
from tests.support.waiting import eventually

TEXT = "Explain, step {i}, how lighthouses were kept lit through long winter storms. "


@asynccontextmanager
async def otlp_receiver() -> AsyncIterator[tuple[str, list[Any]]]:
    """An OTLP/HTTP trace endpoint that keeps every span it is sent."""
    spans: list[Any] = []

    async def traces(request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                spans.extend(scope.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", spans
    finally:
        await runner.cleanup()


async def test_a_turn_is_traced_leg_by_leg_under_the_clients_trace(tmp_path: Path) -> None:
    async with (
        otlp_receiver() as (endpoint, spans),
        running(sim_config("kv_producer", threshold=16)) as p,
        running(sim_config("kv_consumer", threshold=16)) as d,
        httpx.AsyncClient(timeout=30) as client,
    ):
        # Batches leave only at shutdown: what is exported is what the shutdown flushed.
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "600000"}
        router = RouterProcess(router_args([p], [d]), tmp_path, env=env)
        await router.start()
        try:
            trace_id = uuid.uuid4().hex
            traceparent = f"00-{trace_id}-{'ab' * 8}-01"
            conversation = uuid.uuid4().hex
            messages: list[dict[str, Any]] = [{"role": "user", "content": TEXT.format(i=1) * 3}]
            first = await chat_turn(client, router.url, messages, conversation_id=conversation)
            messages += [
                {"role": "assistant", "content": first.content},
                {"role": "user", "content": TEXT.format(i=2)},
            ]
            client.headers["traceparent"] = traceparent
            second = await chat_turn(
                client, router.url, messages, conversation_id=conversation, stream=True
            )
            assert (first.status, second.status, second.path) == (200, 200, "reuse")
            state = (await client.get(d.url + "/sim/state")).json()
        finally:
            # Shutdown flushes what is still batched, to the receiver in this event loop: the
            # stop waits in a thread, so that the loop can take the export.
            await asyncio.to_thread(router.stop)

        async def ours_count() -> int:
            return sum(1 for s in spans if s.trace_id.hex() == trace_id)

        await eventually(ours_count, lambda n: n >= 6, what="the turn's six spans are exported")
        ours = {s.name: s for s in spans if s.trace_id.hex() == trace_id}
        assert set(ours) == {"carryover.turn", "render", "claim", "prefill", "decode", "commit"}
        root = ours["carryover.turn"]
        assert root.parent_span_id.hex() == "ab" * 8  # the client's span is the parent
        for name in ("render", "claim", "prefill", "decode", "commit"):
            assert ours[name].parent_span_id == root.span_id, name
        attributes = {a.key: a.value for a in root.attributes}
        assert attributes["carryover.path"].string_value == "reuse"
        assert attributes["carryover.turn"].int_value == 2
        # The engines were sent the turn's trace context.
        assert state["last_traceparent"].split("-")[1] == trace_id
        # The first turn was traced too, as a trace of its own.
        assert sum(1 for s in spans if s.name == "carryover.turn") == 2
