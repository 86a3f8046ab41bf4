"""A service's OpenTelemetry metrics, exported for Prometheus on ``--metrics-port`` (off by default).

`ServiceMetrics` holds an OpenTelemetry `MeterProvider` whose only reader is a `PrometheusMetricReader` on a
private `prometheus_client.CollectorRegistry` (so several services can share a process, as in tests), and
serves that registry's text exposition on ``http://<host>:<port>/metrics`` from the service's own event loop:
every callback runs on the loop that owns the state it reads, so a scrape never sees a half-applied message.

Two kinds of instruments:

- observed ones (counter, up-down counter, gauge), declared as `Instrument` rows and read by one function per
  service: ``read()`` returns, per metric name, its samples (attributes, value), computed from the counters the
  service already keeps for ``kvmesh status``. It is called once per scrape (not once per instrument), and
  costs nothing between scrapes;
- synchronous histograms for latencies (`ServiceMetrics.histogram`, bucket bounds in seconds), recorded on the
  hot path only where a service was given one: with metrics off nothing is created and the hot path checks
  one ``None``.

Names follow ``kvmesh_<service>_<what>_<unit>``: a counter's name carries no ``_total`` (the exporter adds it),
a unit ``s`` keeps a name ending in ``_seconds`` as it is, and a unit in braces (``{message}``) adds nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Histogram, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvmesh.core.index import DEFAULT_TIER
from kvmesh.core.state import IndexState
from kvmesh.runtime.replica import StreamReplica

log = logging.getLogger("kvmesh.metrics")

Sample = tuple[Mapping[str, str], float]
"""One observed value: its attributes (Prometheus labels) and the value."""
Samples = Mapping[str, Sequence[Sample]]
"""Metric name → its samples at one moment (what a service's ``read()`` returns)."""

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Default histogram bounds in seconds, 100 µs to 10 s (OpenTelemetry's default ones are for milliseconds)."""

_MAX_REQUEST_BYTES = 8192
_READ_TIMEOUT_S = 5.0


class Instrument(NamedTuple):
    """One observed metric: its full name (``kvmesh_ingest_gaps``), kind (``counter``, ``up_down_counter``,
    ``gauge``), unit (UCUM: ``s``, ``By``, or an annotation in braces such as ``{message}``) and description."""

    name: str
    kind: str
    unit: str
    description: str


@dataclass(slots=True)
class _Source:
    """One ``read()`` and the samples it gave for the scrape under way."""

    read: Callable[[], Samples]
    current: Samples | None = None

    def samples(self, name: str) -> Sequence[Sample]:
        if self.current is None:
            try:
                self.current = self.read()
            except Exception:  # a bug in a mapping must not fail the scrape of every other metric
                log.exception("metrics: reading the service's state failed")
                self.current = {}
        return self.current.get(name, ())


class ServiceMetrics:
    """The metrics of one service (``ingest``, ``indexer``, ``router``) and their HTTP endpoint.

    Args:
        service: the service's name, in the ``service.name`` resource attribute (``kvmesh-<service>``).
    """

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        """The private registry the exporter writes to (never prometheus_client's global one)."""
        self.port: int | None = None
        """The port the endpoint listens on, once `serve` bound it (the one picked when asked for 0)."""
        self._sources: list[_Source] = []
        self._server: asyncio.Server | None = None
        reader = PrometheusMetricReader(scope_info_enabled=False, registry=self.registry)
        self._provider: MeterProvider | None = MeterProvider(
            metric_readers=[reader],
            resource=Resource({"service.name": f"kvmesh-{service}"}),
            shutdown_on_exit=False,
        )
        self._meter = self._provider.get_meter(f"kvmesh.{service}")

    def observe(self, read: Callable[[], Samples], instruments: Iterable[tuple[str, str, str, str]]) -> None:
        """Declare ``instruments`` (`Instrument` rows, or plain (name, kind, unit, description) tuples), whose
        values ``read()`` gives: called once per scrape, on the loop that serves it; a name it leaves out has
        no samples then.

        Raises:
            ValueError: an instrument of unknown kind.
        """
        source = _Source(read)
        self._sources.append(source)
        for row in instruments:
            inst = Instrument(*row)
            callback = _callback(source, inst.name)
            if inst.kind == "counter":
                self._meter.create_observable_counter(
                    inst.name, [callback], unit=inst.unit, description=inst.description
                )
            elif inst.kind == "up_down_counter":
                self._meter.create_observable_up_down_counter(
                    inst.name, [callback], unit=inst.unit, description=inst.description
                )
            elif inst.kind == "gauge":
                self._meter.create_observable_gauge(
                    inst.name, [callback], unit=inst.unit, description=inst.description
                )
            else:
                raise ValueError(f"metric {inst.name}: unknown kind {inst.kind!r}")

    def histogram(
        self,
        name: str,
        description: str,
        *,
        buckets: Sequence[float] = LATENCY_BUCKETS_S,
        unit: str = "s",
    ) -> Histogram:
        """A histogram: by default of latencies in seconds (name ending in ``_seconds``; ``buckets``: upper
        bounds in ``unit``); record with ``h.record(value, attributes)``. A count histogram gives its
        ``unit`` as an annotation (``"{candidate}"``) and its own ``buckets``."""
        return self._meter.create_histogram(
            name, unit=unit, description=description, explicit_bucket_boundaries_advisory=list(buckets)
        )

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every metric now (each ``read()`` called once)."""
        for source in self._sources:
            source.current = None
        try:
            return generate_latest(self.registry)
        finally:
            for source in self._sources:
                source.current = None

    async def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Listen on ``host:port`` (0: a free port) and answer ``GET /metrics`` (and ``/``) with the
        exposition; return the bound port.

        Raises:
            OSError: the port is taken or cannot be bound.
        """
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("%s: metrics on http://%s:%d/metrics", self.service, host, self.port)
        return self.port

    async def aclose(self) -> None:
        """Stop serving and shut the meter provider down (idempotent)."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
        if self._provider is not None:
            with contextlib.suppress(Exception):
                self._provider.shutdown(timeout_millis=1000)
            self._provider = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            parts = head.split(b"\r\n", 1)[0].split(b" ")
            method, path = (parts[0], parts[1].split(b"?", 1)[0]) if len(parts) >= 2 else (b"", b"")
            if method not in (b"GET", b"HEAD"):
                await _respond(writer, b"405 Method Not Allowed", b"text/plain", b"GET only\n")
            elif path not in (b"/metrics", b"/"):
                await _respond(writer, b"404 Not Found", b"text/plain", b"see /metrics\n")
            else:
                body = self.exposition()
                await _respond(
                    writer, b"200 OK", CONTENT_TYPE_LATEST.encode(), b"" if method == b"HEAD" else body
                )
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _callback(source: _Source, name: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
    def observe(_options: CallbackOptions) -> Iterator[Observation]:
        for attributes, value in source.samples(name):
            yield Observation(value, dict(attributes))

    return observe


async def _respond(writer: asyncio.StreamWriter, status: bytes, content_type: bytes, body: bytes) -> None:
    writer.write(
        b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type
        + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
    )  # fmt: skip
    await writer.drain()


async def start_metrics(
    service: str, port: int | None, setup: Callable[[ServiceMetrics], None]
) -> ServiceMetrics | None:
    """Create and serve a service's metrics when ``port`` is set (None: off, nothing is created).

    Args:
        setup: declares the service's instruments (called before the endpoint opens).

    Raises:
        OSError: the port is taken or cannot be bound.
    """
    if port is None:
        return None
    metrics = ServiceMetrics(service)
    setup(metrics)
    try:
        await metrics.serve(port)
    except OSError:
        await metrics.aclose()
        raise
    return metrics


# ---------------------------------------------------------------------- an index replica's figures


def replica_instruments(prefix: str) -> tuple[Instrument, ...]:
    """The instruments of an index replica (an indexer's, ``prefix`` ``kvmesh_indexer``; a local-index
    router's, ``kvmesh_router_replica``), whose values `replica_samples` gives."""
    return (
        Instrument(f"{prefix}_applied_seq", "gauge", "{message}", "last stream sequence applied"),
        Instrument(
            f"{prefix}_stream_last_seq", "gauge", "{message}", "the stream's last sequence as last read"
        ),
        Instrument(f"{prefix}_lag_messages", "gauge", "{message}", "stream messages not yet applied"),
        Instrument(
            f"{prefix}_lag_seconds",
            "gauge",
            "s",
            "how long the oldest message not yet applied has been there",
        ),
        Instrument(f"{prefix}_read_messages", "counter", "{message}", "stream messages read"),
        Instrument(
            f"{prefix}_skipped_messages", "counter", "{message}", "stream messages skipped, by reason"
        ),
        Instrument(f"{prefix}_blocks", "gauge", "{block}", "blocks indexed per worker, dp_rank and tier"),
        Instrument(f"{prefix}_held_orphans", "gauge", "{event}", "stored events held for an unknown parent"),
        Instrument(
            f"{prefix}_held_messages", "counter", "{message}", "engine messages held until earlier ones came"
        ),
        Instrument(f"{prefix}_sequence_gaps", "counter", "{message}", "messages applied past an engine gap"),
        Instrument(
            f"{prefix}_evicted_blocks", "counter", "{block}", "blocks dropped to stay within --max-blocks"
        ),
        Instrument(f"{prefix}_rebuilds", "counter", "{rebuild}", "rebuilds from a re-created stream"),
        Instrument(f"{prefix}_resubscribes", "counter", "{resubscribe}", "stalled consumers re-created"),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaView:
    """What `replica_samples` reads of one replica at one moment."""

    state: IndexState
    stream_last_seq: int
    lag_messages: int
    lag_s: float
    read_messages: int
    decode_errors: int
    apply_errors: int
    rebuilds: int
    resubscribes: int


class StreamLag:
    """A replica's lag behind its stream, from the stream's last sequence read now and then (the same rule as
    the router's ``LagMeter``).

    Cost: `note` O(1); `lag` amortised O(1). At most 1,024 sequences are kept (then seconds are a lower bound).
    """

    def __init__(self) -> None:
        self.stream_last_seq = 0
        """The stream's last sequence as last read."""
        self._polls: collections.deque[tuple[float, int]] = collections.deque(maxlen=1024)

    def note(self, last_seq: int, now: float) -> None:
        """Record that the stream's last sequence was ``last_seq`` at monotonic time ``now``."""
        self.stream_last_seq = last_seq
        if not self._polls or self._polls[-1][1] < last_seq:
            self._polls.append((now, last_seq))

    def lag(self, applied_seq: int, now: float) -> tuple[int, float]:
        """(messages, seconds) behind: the last sequence read minus ``applied_seq`` (0 when ahead), and how long
        ago the stream was first seen holding a message not applied yet (0.0 when none)."""
        polls = self._polls
        while polls and polls[0][1] <= applied_seq:
            polls.popleft()
        seconds = max(0.0, now - polls[0][0]) if polls else 0.0
        return max(0, self.stream_last_seq - applied_seq), seconds


def replica_view(replica: StreamReplica, *, stream_last_seq: int, lag: tuple[int, float]) -> ReplicaView:
    """A `ReplicaView` of ``replica`` now (``lag``: messages and seconds behind the stream, as measured
    against ``stream_last_seq``, the stream's last sequence as last read)."""
    return ReplicaView(
        state=replica.state,
        stream_last_seq=stream_last_seq,
        lag_messages=lag[0],
        lag_s=lag[1],
        read_messages=replica.read_messages,
        decode_errors=replica.decode_errors,
        apply_errors=replica.apply_errors,
        rebuilds=replica.rebuilds,
        resubscribes=replica.resubscribes,
    )


def replica_samples(prefix: str, view: ReplicaView, labels: Mapping[str, str]) -> dict[str, list[Sample]]:
    """The samples of `replica_instruments` (``labels`` on each, e.g. ``{"replica": "idx-1"}``).

    Cost: O(holders × tiers), never O(blocks) (no digest: it walks every block).
    """
    st = view.state
    base = dict(labels)
    blocks: list[Sample] = []
    orphans = 0
    for (worker, rank), tier, count, held in _holder_tiers(st):
        orphans += held
        if count or tier == "gpu":
            blocks.append(({**base, "worker_id": worker, "dp_rank": str(rank), "tier": tier}, float(count)))
    c = st.counters
    return {
        f"{prefix}_applied_seq": [(base, float(st.applied_seq))],
        f"{prefix}_stream_last_seq": [(base, float(view.stream_last_seq))],
        f"{prefix}_lag_messages": [(base, float(view.lag_messages))],
        f"{prefix}_lag_seconds": [(base, view.lag_s)],
        f"{prefix}_read_messages": [(base, float(view.read_messages))],
        f"{prefix}_skipped_messages": [
            ({**base, "reason": "undecodable"}, float(view.decode_errors)),
            ({**base, "reason": "apply_error"}, float(view.apply_errors)),
            ({**base, "reason": "duplicate"}, float(c.duplicate_messages)),
            ({**base, "reason": "stale"}, float(c.stale_messages)),
            ({**base, "reason": "out_of_order"}, float(c.out_of_order)),
            ({**base, "reason": "malformed"}, float(c.malformed_messages)),
        ],
        f"{prefix}_blocks": blocks,
        f"{prefix}_held_orphans": [(base, float(orphans))],
        f"{prefix}_held_messages": [(base, float(c.held_messages))],
        f"{prefix}_sequence_gaps": [(base, float(c.sequence_gaps))],
        f"{prefix}_evicted_blocks": [(base, float(c.evicted_blocks))],
        f"{prefix}_rebuilds": [(base, float(view.rebuilds))],
        f"{prefix}_resubscribes": [(base, float(view.resubscribes))],
    }


def _holder_tiers(state: IndexState) -> Iterator[tuple[tuple[str, int], str, int, int]]:
    """((worker, dp_rank), tier, blocks, held orphans) of every holder's tiers (``gpu``: the default tier,
    which also carries the holder's held orphans)."""
    for by_size in state._indexes.values():
        for index in by_size.values():
            for t in index.tier_counts():
                tier = "gpu" if t.tier == DEFAULT_TIER else t.tier
                yield (t.holder.worker_id, t.holder.dp_rank), tier, t.blocks, t.held_orphans


def parse_exposition(text: str) -> dict[str, float]:
    """A Prometheus text exposition as ``'name{a="x",b="y"}'`` → value (labels as the exporter wrote them;
    comment lines skipped): for tests and tools that compare scrapes.

    Raises:
        ValueError: a sample line that does not parse.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if not key:
            raise ValueError(f"not a sample line: {line!r}")
        out[key] = float(value)
    return out


__all__ = [
    "LATENCY_BUCKETS_S",
    "Instrument",
    "ReplicaView",
    "Sample",
    "Samples",
    "ServiceMetrics",
    "StreamLag",
    "parse_exposition",
    "replica_instruments",
    "replica_samples",
    "replica_view",
    "start_metrics",
]
