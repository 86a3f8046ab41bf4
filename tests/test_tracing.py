"""Traces: ingest publish → each replica's apply, and a client's route → router (→ indexer match), in NATS headers.

The services run in process (`tests.pipeline`) with an in-memory span exporter installed through
`kvmesh.runtime.tracing.configure`; the engine is a simulated vLLM worker over real ZMQ, NATS a real server.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from tests.pipeline import Pipeline, eventually, pipeline

from kvmesh.core.errors import ConfigError
from kvmesh.core.events import EventsMessage, decode_message
from kvmesh.runtime import tracing
from kvmesh.sim.engine import SimWorker

BS = 4
PROMPT = list(range(100, 116))  # 4 blocks


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on for the test, every span exported to memory as it ends; off again afterwards."""
    exporter = InMemorySpanExporter()
    assert tracing.configure("test", {}, exporter=exporter) is not None
    try:
        yield exporter
    finally:
        tracing.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


async def wait_spans(
    exporter: InMemorySpanExporter, name: str, check: Callable[[list[ReadableSpan]], bool]
) -> list[ReadableSpan]:
    """The finished spans called ``name`` once ``check`` accepts them (10 s at most)."""

    async def probe() -> list[ReadableSpan]:
        return named(exporter, name)

    return await eventually(probe, check)


def stream_seq(span: ReadableSpan) -> int:
    seq = (span.attributes or {})["kvmesh.stream_seq"]
    assert isinstance(seq, int)
    return seq


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def worker(name: str, seed: int) -> SimWorker:
    return SimWorker(
        name,
        num_blocks=16,
        block_size=BS,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        seed=seed,
    )


async def start(p: Pipeline, w: SimWorker, index: str) -> None:
    await p.start_ingest(w.worker_id, w.publisher.endpoint, w.publisher.replay_endpoint, block_size=BS)
    await w.publisher.wait_for_subscribers(1)
    await p.start_indexer()
    await p.start_router(index)


async def stored(p: Pipeline, seq: int) -> tuple[dict[str, str], EventsMessage]:
    """A stream message's stored headers and decoded body."""
    assert p._nc is not None
    raw = await p._nc.jetstream().get_msg(p.stream, seq)
    message = decode_message(raw.data or b"")
    assert isinstance(message, EventsMessage)
    return dict(raw.headers or {}), message


def traceparent(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def test_configure_reads_otel_traces_exporter(caplog: pytest.LogCaptureFixture) -> None:
    """Unset or ``none`` installs nothing, ``console`` a provider named kvmesh-<service> (or OTEL_SERVICE_NAME),
    ``otlp`` without its package stays off with how to install it, and an unknown exporter is refused."""
    assert tracing.configure("router", {}) is None
    assert tracing.configure("router", {"OTEL_TRACES_EXPORTER": "none"}) is None
    assert not tracing.enabled()
    with caplog.at_level(logging.WARNING, "kvmesh.tracing"):
        assert tracing.configure("router", {"OTEL_TRACES_EXPORTER": "otlp"}) is None
    assert [r.getMessage() for r in caplog.records] == [
        "OTEL_TRACES_EXPORTER=otlp needs the OTLP exporter (pip install opentelemetry-exporter-otlp); "
        "not exporting to OTLP"
    ]
    assert not tracing.enabled()
    try:
        provider = tracing.configure("router", {"OTEL_TRACES_EXPORTER": "console"})
        assert provider is not None and tracing.enabled()
        assert provider.resource.attributes["service.name"] == "kvmesh-router"
        env = {"OTEL_TRACES_EXPORTER": "console,none", "OTEL_SERVICE_NAME": "edge-router"}
        provider = tracing.configure("router", env)
        assert provider is not None and provider.resource.attributes["service.name"] == "edge-router"
    finally:
        tracing.shutdown()
    assert not tracing.enabled()
    with pytest.raises(ConfigError) as err:
        tracing.configure("router", {"OTEL_TRACES_EXPORTER": "jaeger,console"})
    assert err.value.problems == [
        "OTEL_TRACES_EXPORTER: unknown exporter jaeger (choose from none, console, otlp)"
    ]


def test_a_service_refuses_an_unknown_exporter_at_start() -> None:
    """``kvmesh router`` with ``OTEL_TRACES_EXPORTER=jaeger`` exits 2 naming the variable, before connecting."""
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "jaeger", "KVMESH_NATS_URL": "nats://127.0.0.1:1"}
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.router"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "OTEL_TRACES_EXPORTER: unknown exporter jaeger (choose from none, console, otlp)" in done.stderr


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.e2e
async def test_one_trace_from_an_ingest_publish_to_every_replica_apply(
    nats_url: str, uid: str, spans: InMemorySpanExporter
) -> None:
    """A batch's publish span is the parent of the indexer's and the router replica's apply spans; the stored
    message carries its traceparent next to its Nats-Msg-Id; all three name worker, rank, epoch and sequences."""
    w = worker("worker-a", 1)
    try:
        async with pipeline(nats_url, uid) as p:
            await start(p, w, "local")
            assert p.indexer is not None
            assert (await w.serve_request(PROMPT, 0))["cached_tokens"] == 0
            # The announcement and the prompt's batch, each applied by both replicas.
            publishes = await wait_spans(spans, tracing.PUBLISH_SPAN, lambda s: len(s) == 2)
            applies = await wait_spans(spans, tracing.APPLY_SPAN, lambda s: len(s) == 4)
            publish = max(publishes, key=stream_seq)
            attrs = dict(publish.attributes or {})
            seq = attrs["kvmesh.stream_seq"]
            assert isinstance(seq, int)
            headers, message = await stored(p, seq)
            assert message.events  # the prompt's BlockStored
            assert headers == {
                "Nats-Msg-Id": attrs["messaging.message.id"],
                "traceparent": traceparent(publish),
            }
            assert publish.kind == SpanKind.PRODUCER and publish.parent is None
            assert publish.status.status_code == StatusCode.UNSET
            holder = {
                "kvmesh.worker_id": "worker-a",
                "kvmesh.dp_rank": 0,
                "kvmesh.epoch": message.epoch,
                "kvmesh.engine_seq": message.seq,
            }
            subject = f"{p.prefix}.test-model.worker-a.0"
            assert attrs == {
                "messaging.system": "nats",
                "messaging.operation.type": "send",
                "messaging.destination.name": subject,
                "messaging.message.id": headers["Nats-Msg-Id"],
                **holder,
                "kvmesh.stream_seq": seq,
            }
            children = [s for s in applies if parent_id(s) == publish.context.span_id]
            assert sorted(
                (dict(s.attributes or {}) for s in children), key=lambda a: str(a["kvmesh.replica"])
            ) == [
                {
                    "messaging.system": "nats",
                    "messaging.operation.type": "process",
                    "messaging.destination.name": subject,
                    "kvmesh.replica": replica,
                    "kvmesh.stream_seq": seq,
                    **holder,
                }
                for replica in sorted([f"indexer {p.indexer.replica}", "router"])
            ]
            assert {s.context.trace_id for s in children} == {publish.context.trace_id}
            assert {s.kind for s in children} == {SpanKind.CONSUMER}
    finally:
        w.close()


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.e2e
@pytest.mark.parametrize("index", ["local", "remote"])
async def test_one_trace_from_a_client_route_through_the_router(
    nats_url: str, uid: str, index: str, spans: InMemorySpanExporter
) -> None:
    """A route called inside the caller's span is answered in a child server span naming the request and the
    choice; with --index remote the indexer's match span is the route span's child."""
    w = worker("worker-b", 2)
    provider = tracing._provider
    assert provider is not None
    caller_tracer = provider.get_tracer("test")
    try:
        async with pipeline(nats_url, uid) as p:
            await start(p, w, index)
            assert p.indexer is not None
            await w.serve_request(PROMPT, 0)
            await eventually(lambda: p.route(PROMPT), lambda r: r.cached_tokens == 16)
            spans.clear()
            with caller_tracer.start_as_current_span("caller") as caller:
                reply = await p.route(PROMPT, request_id="r-1")
            assert (reply.worker_id, reply.dp_rank, reply.cached_tokens, reply.mode) == (
                "worker-b",
                0,
                16,
                "exact",
            )
            (route,) = await wait_spans(spans, tracing.ROUTE_SPAN, lambda s: len(s) == 1)
            assert route.kind == SpanKind.SERVER
            assert parent_id(route) == caller.get_span_context().span_id
            assert route.context.trace_id == caller.get_span_context().trace_id
            assert dict(route.attributes or {}) == {
                "kvmesh.request_id": "r-1",
                "kvmesh.model": "test-model",
                "kvmesh.prompt_tokens": len(PROMPT),
                "kvmesh.worker_id": "worker-b",
                "kvmesh.dp_rank": 0,
                "kvmesh.cached_tokens": 16,
                "kvmesh.available_tokens": 16,
                "kvmesh.mode": "exact",
            }
            matches = named(spans, tracing.MATCH_SPAN)
            if index == "local":
                assert matches == []
                return
            (match,) = matches
            assert match.kind == SpanKind.SERVER and parent_id(match) == route.context.span_id
            assert match.context.trace_id == route.context.trace_id
            assert dict(match.attributes or {}) == {
                "kvmesh.replica": p.indexer.replica,
                "kvmesh.model": "test-model",
                "kvmesh.prompt_tokens": len(PROMPT),
                "kvmesh.candidates": 1,
                "kvmesh.outcome": "ok",
            }
    finally:
        w.close()


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.e2e
async def test_a_route_error_marks_its_span(nats_url: str, uid: str, spans: InMemorySpanExporter) -> None:
    """An unknown model's route span has status error and its code."""
    w = worker("worker-c", 3)
    try:
        async with pipeline(nats_url, uid) as p:
            await start(p, w, "local")
            with pytest.raises(Exception, match="no worker serves model 'other-model'"):
                await p.route(PROMPT, model="other-model", request_id="r-2")
            (route,) = await wait_spans(spans, tracing.ROUTE_SPAN, lambda s: len(s) == 1)
            assert route.status.status_code == StatusCode.ERROR
            assert dict(route.attributes or {}) == {
                "kvmesh.error_code": "unknown_model",
                "kvmesh.request_id": "r-2",
            }
    finally:
        w.close()


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.e2e
async def test_no_span_and_no_header_when_tracing_is_off(nats_url: str, uid: str) -> None:
    """With tracing off the stored messages carry only Nats-Msg-Id, a route outside any span sends no headers,
    and the services make no span even for a request that carries a caller's context."""
    assert not tracing.enabled()
    caller_spans = InMemorySpanExporter()
    app = TracerProvider()  # the calling application's own tracing, not kvmesh's
    app.add_span_processor(SimpleSpanProcessor(caller_spans))
    w = worker("worker-d", 4)
    seen: list[dict[str, str] | None] = []
    try:
        async with pipeline(nats_url, uid) as p:
            await start(p, w, "remote")
            assert p._nc is not None

            async def note(msg: Any) -> None:
                seen.append(msg.headers)

            spy = await p._nc.subscribe(p.route_subject, cb=note)
            await w.serve_request(PROMPT, 0)
            await eventually(lambda: p.route(PROMPT), lambda r: r.cached_tokens == 16)
            info = await p._nc.jetstream().stream_info(p.stream)
            for seq in range(1, info.state.last_seq + 1):
                headers, _ = await stored(p, seq)
                assert list(headers) == ["Nats-Msg-Id"]
            assert seen and all(h is None for h in seen)
            seen.clear()
            with app.get_tracer("app").start_as_current_span("caller") as caller:
                await p.route(PROMPT, request_id="r-3")
            await eventually(_async(lambda: len(seen)), lambda n: n == 1)
            assert seen[0] is not None and sorted(seen[0]) == ["traceparent"]
            assert seen[0]["traceparent"].split("-")[1] == f"{caller.get_span_context().trace_id:032x}"
            await spy.unsubscribe()
            assert [s.name for s in caller_spans.get_finished_spans()] == ["caller"]
    finally:
        w.close()
        app.shutdown()


def _async(fn: Callable[[], Any]) -> Callable[[], Any]:
    async def probe() -> Any:
        return fn()

    return probe


def test_hot_path_calls_cost_nothing_measurable_when_off() -> None:
    """With tracing off the publish, apply and route hooks return at once and touch no headers."""
    assert not tracing.enabled()
    headers = {"Nats-Msg-Id": "m-1"}
    assert tracing.start_publish(headers, "s", ("w", 0), 1, 2) is None
    assert headers == {"Nats-Msg-Id": "m-1"}
    assert (
        tracing.start_apply({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}, "r", "s", 1, b"")
        is None
    )
    with tracing.server_span(tracing.ROUTE_SPAN, None) as span:
        assert span is None
    assert tracing.context_headers() is None
