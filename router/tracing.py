"""Optional OpenTelemetry spans for each turn: render, store, P leg, D leg.

On only when the OpenTelemetry SDK and its OTLP/HTTP exporter are installed (the ``tracing``
extra) and an endpoint is configured the standard way (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; ``OTEL_SDK_DISABLED=true`` turns it off). Otherwise
every call here is a no-op, so the router never needs the package.

Spans are started with an explicit parent rather than through the current context: a streamed
D leg lives in an async generator, which the ASGI server resumes from other contexts. The
W3C ``traceparent`` of a client is honoured, and each turn's own is sent on to the engines
(vLLM joins it with ``--otlp-traces-endpoint``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["NO_TRACE", "Tracing", "TurnTrace"]

log = logging.getLogger("carryover.tracing")


class TurnTrace:
    """One turn's root span and its children; the base class is the no-op."""

    def leg(self, name: str, **attributes: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def headers(self) -> dict[str, str]:
        """Trace headers for the engines (``traceparent``)."""
        return {}

    def set(self, **attributes: Any) -> None:
        return None

    def end(self, error: str | None = None) -> None:
        return None


NO_TRACE = TurnTrace()


class _SdkTurnTrace(TurnTrace):
    def __init__(self, tracer: Any, root: Any) -> None:
        from opentelemetry import trace

        self._tracer = tracer
        self._root = root
        self._context = trace.set_span_in_context(root)

    @contextlib.contextmanager
    def _leg(self, name: str, attributes: dict[str, Any]) -> Iterator[None]:
        from opentelemetry.trace import Status, StatusCode

        span = self._tracer.start_span(name, context=self._context, attributes=attributes)
        try:
            yield
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            span.end()

    def leg(self, name: str, **attributes: Any) -> contextlib.AbstractContextManager[None]:
        return self._leg(name, attributes)

    def headers(self) -> dict[str, str]:
        from opentelemetry import propagate

        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=self._context)
        return carrier

    def set(self, **attributes: Any) -> None:
        for key, value in attributes.items():
            if value is not None:
                self._root.set_attribute(f"carryover.{key}", value)

    def end(self, error: str | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if error is not None:
            self._root.set_status(Status(StatusCode.ERROR, error))
        self._root.end()


class Tracing:
    """Starts turn traces; holds the SDK provider when tracing is on."""

    def __init__(self, tracer: Any = None, provider: Any = None) -> None:
        self._tracer = tracer
        self._provider = provider

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Tracing:
        env = os.environ if environ is None else environ
        if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return cls()
        if not (
            env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        ):
            return cls()
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            log.warning("an OTLP endpoint is set but the tracing extra is not installed")
            return cls()
        # A provider of our own, not the global one: an embedding application keeps its own.
        provider = TracerProvider(resource=Resource.create({"service.name": "carryover"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider.get_tracer("carryover"), provider)

    def turn(self, headers: Mapping[str, str], **attributes: Any) -> TurnTrace:
        if self._tracer is None:
            return NO_TRACE
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind

        parent = propagate.extract(dict(headers))
        root = self._tracer.start_span(
            "carryover.turn",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={f"carryover.{k}": v for k, v in attributes.items() if v is not None},
        )
        return _SdkTurnTrace(self._tracer, root)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
