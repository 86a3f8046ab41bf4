"""Traces: OpenTelemetry spans of the event pipeline and of route requests, their context in NATS headers.

`configure` installs this process's tracer from the standard ``OTEL_*`` variables (every service calls it
at start, in `kvmesh.runtime.runner.run_service`):

- ``OTEL_TRACES_EXPORTER``: ``none`` (the default: nothing is installed), ``console`` (spans as JSON on
  stdout), ``otlp`` (needs ``pip install opentelemetry-exporter-otlp``; gRPC, or HTTP when
  ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``/``OTEL_EXPORTER_OTLP_PROTOCOL`` is ``http/protobuf``), or a
  comma-separated list of them;
- ``OTEL_SERVICE_NAME``: the ``service.name`` resource attribute (default ``kvmesh-<service>``);
- the rest (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``,
  ``OTEL_RESOURCE_ATTRIBUTES``, …) is read by the OpenTelemetry SDK itself.

The W3C trace context (``traceparent``, ``tracestate``) travels in NATS headers, next to the headers a
message already has (``Nats-Msg-Id``; JetStream stores headers with the message):

| span | kind | where | parent | attributes (besides ``messaging.*``) |
|---|---|---|---|---|
| ``kvmesh.ingest.publish`` | producer | the ingest's publish of one stream message, send to ack | none (a new trace) | ``kvmesh.worker_id``, ``kvmesh.dp_rank``, ``kvmesh.epoch``, ``kvmesh.engine_seq``, ``kvmesh.stream_seq`` (from the ack) |
| ``kvmesh.replica.apply`` | consumer | an indexer's or a local-index router's apply of that message | the publish, from the stored headers | ``kvmesh.replica``, ``kvmesh.stream_seq``, ``kvmesh.worker_id``, ``kvmesh.dp_rank``, ``kvmesh.epoch``, ``kvmesh.engine_seq``, ``kvmesh.skipped`` |
| ``kvmesh.route`` | server | the router's answer to one route request | the caller's span, when the request carries one | ``kvmesh.request_id``, ``kvmesh.model``, ``kvmesh.prompt_tokens``, ``kvmesh.worker_id``, ``kvmesh.dp_rank``, ``kvmesh.cached_tokens``, ``kvmesh.available_tokens``, ``kvmesh.mode``, ``kvmesh.error_code`` |
| ``kvmesh.index.match`` | server | an indexer's answer to a router's match query (``--index remote``) | the router's ``kvmesh.route`` | ``kvmesh.replica``, ``kvmesh.model``, ``kvmesh.prompt_tokens``, ``kvmesh.candidates``, ``kvmesh.outcome`` |

An apply span is only made for a message whose publish was traced (its headers carry a ``traceparent``):
a replica reading an untraced stream makes no span per message. `kvmesh.client.Router` puts the caller's
current context in each route request when a span is active there, whatever this module's state.

With no exporter configured nothing is installed: each hot-path call is one check of a module global (about
0.1 µs) and no header is added.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

import msgspec
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvmesh.core.errors import ConfigError
from kvmesh.core.protocol import RouteReply, RouteRequest

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("kvmesh.tracing")

TRACEPARENT: Final[str] = "traceparent"
"""The W3C header that carries a span's trace id, span id and sampled flag."""
TRACESTATE: Final[str] = "tracestate"
"""The W3C header of vendor trace state (passed on when present)."""
EXPORTERS: Final[frozenset[str]] = frozenset({"none", "console", "otlp"})
"""Values ``OTEL_TRACES_EXPORTER`` may list."""
OTLP_INSTALL: Final[str] = "pip install opentelemetry-exporter-otlp"
"""How to get the OTLP exporter, which kvmesh does not depend on."""

PUBLISH_SPAN: Final[str] = "kvmesh.ingest.publish"
APPLY_SPAN: Final[str] = "kvmesh.replica.apply"
ROUTE_SPAN: Final[str] = "kvmesh.route"
MATCH_SPAN: Final[str] = "kvmesh.index.match"

_W3C: Final = TraceContextTextMapPropagator()
_OFF: Final = contextlib.nullcontext(None)

_tracer: Tracer | None = None
"""This process's tracer; None while tracing is off (every hot-path function checks it first)."""
_provider: TracerProvider | None = None


def enabled() -> bool:
    """True when `configure` installed a tracer in this process."""
    return _tracer is not None


def configure(
    service: str, environ: Mapping[str, str], *, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """Install this process's tracer from ``OTEL_*`` variables (see the module docstring), or leave it off.

    Args:
        service: the kvmesh service (``"router"``); ``service.name`` is ``kvmesh-<service>`` unless
            ``OTEL_SERVICE_NAME`` says otherwise.
        environ: the process environment.
        exporter: export to this exporter synchronously (an in-memory one in tests) instead of what
            ``OTEL_TRACES_EXPORTER`` names.

    Returns:
        The provider installed (replacing an earlier one of this module), or None when tracing stays off
        (``none``, unset, or ``otlp`` alone without its package, which is logged with how to install it).

    Raises:
        ConfigError: ``OTEL_TRACES_EXPORTER`` names an exporter other than ``none``, ``console``, ``otlp``.
    """
    # The SDK only when tracing is on: importing it costs ~40 ms, which the client and the CLI need not pay.
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor  # noqa: PLC0415

    global _tracer, _provider
    exporters: list[SpanExporter] = []
    if exporter is None:
        names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "none").split(",")]
        unknown = sorted({n for n in names if n} - EXPORTERS)
        if unknown:
            choices = "none, console, otlp"
            raise ConfigError(
                [f"OTEL_TRACES_EXPORTER: unknown exporter {', '.join(unknown)} (choose from {choices})"]
            )
        exporters = [e for e in (_exporter(n, environ) for n in dict.fromkeys(names)) if e is not None]
        if not exporters:
            return None
    name = environ.get("OTEL_SERVICE_NAME") or f"kvmesh-{service}"
    provider = TracerProvider(
        resource=Resource.create({"service.name": name}), shutdown_on_exit=exporter is None
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    for e in exporters:
        provider.add_span_processor(BatchSpanProcessor(e))
    shutdown()
    _provider, _tracer = provider, provider.get_tracer("kvmesh")
    log.info(
        "tracing on: service.name %s, exporters %s", name, [type(e).__name__ for e in exporters] or "given"
    )
    return provider


def _exporter(name: str, environ: Mapping[str, str]) -> SpanExporter | None:
    """The exporter ``OTEL_TRACES_EXPORTER`` names (None for ``none``, or an OTLP exporter not installed)."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter  # noqa: PLC0415 - see configure

        return ConsoleSpanExporter()
    if name != "otlp":
        return None
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    kind = "http" if protocol in ("http/protobuf", "http/json") else "grpc"
    try:  # an optional package: imported by name, only when asked for
        module = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{kind}.trace_exporter")
    except ImportError:
        log.warning(
            "OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter (%s); not exporting to OTLP", OTLP_INSTALL
        )
        return None
    exp: SpanExporter = module.OTLPSpanExporter()
    return exp


def shutdown() -> None:
    """Flush and remove this process's tracer (tracing is off afterwards); nothing when it is off."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


# ------------------------------------------------------------------------------------------- propagation


def context_headers(headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """Add the current span's context to ``headers`` (a new dict when None) and return them.

    Returns:
        ``headers`` unchanged (None when None) when no span is active in the caller's context.
    """
    if not trace.get_current_span().get_span_context().is_valid:
        return headers
    out = {} if headers is None else headers
    _W3C.inject(out)
    return out


def _parent(headers: Mapping[str, str] | None) -> Any:
    """The context a message's headers carry (None: none, the span is a root)."""
    if not headers or TRACEPARENT not in headers:
        return None
    return _W3C.extract(headers)


def server_span(
    name: str, headers: Mapping[str, str] | None, attributes: Mapping[str, Any] | None = None
) -> contextlib.AbstractContextManager[Span | None]:
    """A server span around one request, the current span inside; its parent from the request's headers.

    An exception raised inside is recorded and sets the span's status to error. Yields None (and costs one
    check) when tracing is off.
    """
    tracer = _tracer
    if tracer is None:
        return _OFF
    return tracer.start_as_current_span(
        name, context=_parent(headers), kind=SpanKind.SERVER, attributes=attributes
    )


def annotate(attributes: Mapping[str, Any]) -> None:
    """Set attributes on the current span (nothing when tracing is off)."""
    if _tracer is not None:
        trace.get_current_span().set_attributes(attributes)


# ------------------------------------------------------------------------------------------- the pipeline


def start_publish(
    headers: dict[str, str], subject: str, holder: tuple[str, int], epoch: int, seq: int
) -> Span | None:
    """Start the span of one stream message's publish and put its context in ``headers``.

    Args:
        headers: the message's headers (``Nats-Msg-Id`` already set); ``traceparent`` (and ``tracestate``)
            are added.
        subject: the events subject.
        holder: (worker id, dp rank).
        epoch: the engine epoch; seq: the (last) engine sequence of the message.

    Returns:
        The span, to end with `on_ack` or `fail_publish` (None when tracing is off: ``headers`` are left alone).
    """
    tracer = _tracer
    if tracer is None:
        return None
    span = tracer.start_span(
        PUBLISH_SPAN,
        context=None,
        kind=SpanKind.PRODUCER,
        attributes={
            "messaging.system": "nats",
            "messaging.operation.type": "send",
            "messaging.destination.name": subject,
            "messaging.message.id": headers.get("Nats-Msg-Id", ""),
            "kvmesh.worker_id": holder[0],
            "kvmesh.dp_rank": holder[1],
            "kvmesh.epoch": epoch,
            "kvmesh.engine_seq": seq,
        },
    )
    _W3C.inject(headers, context=trace.set_span_in_context(span))
    return span


def fail_publish(span: Span | None, error: BaseException) -> None:
    """End a publish span whose publish call raised ``error`` (nothing for None: tracing was off)."""
    if span is None:
        return
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, type(error).__name__))
    span.end()


def on_ack(span: Span) -> Callable[[Any], None]:
    """The done callback of a publish's ack future that ends its span: the ack's stream sequence as
    ``kvmesh.stream_seq`` (``kvmesh.duplicate`` when the server dropped it by its ``Nats-Msg-Id``), a failed
    or cancelled ack as an error."""

    def acked(fut: Any) -> None:
        if fut.cancelled():
            span.set_status(Status(StatusCode.ERROR, "cancelled"))
        elif (exc := fut.exception()) is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        else:
            ack = fut.result()
            span.set_attribute("kvmesh.stream_seq", int(ack.seq))
            if getattr(ack, "duplicate", False):
                span.set_attribute("kvmesh.duplicate", True)
        span.end()

    return acked


class _Head(msgspec.Struct):
    """The fields of a stream message an apply span names (the rest, events included, is skipped)."""

    worker_id: str | None = None
    dp_rank: int | None = None
    epoch: int | None = None
    seq: int | None = None


_head_decoder: Final = msgspec.msgpack.Decoder(_Head)


def start_apply(
    headers: Mapping[str, str] | None, replica: str, subject: str, stream_seq: int, data: bytes
) -> Span | None:
    """Start the span of a replica's apply of one stream message, child of its publish's span.

    Returns:
        The span, to end with `end_apply`; None when tracing is off or the message carries no trace context
        (nothing is decoded then).
    """
    tracer = _tracer
    if tracer is None or not headers or TRACEPARENT not in headers:
        return None
    attributes: dict[str, Any] = {
        "messaging.system": "nats",
        "messaging.operation.type": "process",
        "messaging.destination.name": subject,
        "kvmesh.replica": replica,
        "kvmesh.stream_seq": stream_seq,
    }
    try:
        head = _head_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass  # the apply path counts and logs it
    else:
        for key, value in (
            ("kvmesh.worker_id", head.worker_id),
            ("kvmesh.dp_rank", head.dp_rank),
            ("kvmesh.epoch", head.epoch),
            ("kvmesh.engine_seq", head.seq),
        ):
            if value is not None:
                attributes[key] = value
    return tracer.start_span(
        APPLY_SPAN, context=_W3C.extract(headers), kind=SpanKind.CONSUMER, attributes=attributes
    )


def end_apply(span: Span, skipped: str | None) -> None:
    """End an apply span; ``skipped`` is why the message was not applied (``undecodable``, ``failed``)."""
    if skipped is not None:
        span.set_attribute("kvmesh.skipped", skipped)
        if skipped == "failed":
            span.set_status(Status(StatusCode.ERROR, "failed to apply"))
    span.end()


# ------------------------------------------------------------------------------------------- routes


def note_route(parsed: RouteRequest, reply: RouteReply) -> None:
    """Set a route's request and answer on the current (``kvmesh.route``) span; nothing when tracing is off."""
    if _tracer is None:
        return
    span = trace.get_current_span()
    span.set_attributes(
        {
            "kvmesh.model": parsed.model,
            "kvmesh.prompt_tokens": len(parsed.token_ids),
            "kvmesh.worker_id": reply.worker_id,
            "kvmesh.dp_rank": reply.dp_rank,
            "kvmesh.cached_tokens": reply.cached_tokens,
            "kvmesh.mode": reply.mode,
        }
    )
    if parsed.request_id is not None:
        span.set_attribute("kvmesh.request_id", parsed.request_id)
    if reply.available_tokens is not None:
        span.set_attribute("kvmesh.available_tokens", reply.available_tokens)


def note_error(code: str, request_id: str | None) -> None:
    """Mark the current span as failed with a route error ``code`` (``bad_request``, …)."""
    if _tracer is None:
        return
    span = trace.get_current_span()
    span.set_attribute("kvmesh.error_code", code)
    if request_id is not None:
        span.set_attribute("kvmesh.request_id", request_id)
    span.set_status(Status(StatusCode.ERROR, code))
