"""The indexer's request-reply endpoints: match queries (NATS micro service) and ``kvmesh status``.

Match protocol (msgpack, `kvmesh.core.protocol`): request `MatchRequest` ``{"model", "token_ids", "lora_name",
"cache_salt"}``, ``token_ids`` either the token ids packed as little-endian uint32 (msgpack bin: what the router
sends, no per-token work on either side) or a msgpack array of ints; reply `kvmesh.indexer.policy.match_reply`
or, with a NATS service error (`protocol.ERROR_STATUS`), `ErrorReply` ``{"error": {"code", "message"}}`` with
codes ``bad_request`` (400) and ``unknown_model`` (404). Status: `IndexerStatus` (JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import msgspec
import nats.errors
from nats.micro.request import Request

from kvmesh.core import protocol
from kvmesh.core.errors import RequestError, UnknownModelError, clip_echo
from kvmesh.core.protocol import ERROR_STATUS, IndexerStatus, MatchRequest
from kvmesh.core.state import IndexState
from kvmesh.indexer import policy
from kvmesh.indexer.metrics import INSTRUMENTS, MATCH_LATENCY, PREFIX, IndexerFigures, indexer_samples
from kvmesh.runtime import tracing
from kvmesh.runtime.metrics import (
    Samples,
    ServiceMetrics,
    StreamLag,
    replica_instruments,
    replica_samples,
    replica_view,
    start_metrics,
)
from kvmesh.runtime.replica import StreamReplica

if TYPE_CHECKING:
    from opentelemetry.metrics import Histogram

    from kvmesh.indexer.service import IndexerService

LAG_CHECK_S = 1.0
"""Seconds between two reads of the stream's last sequence, with metrics on (the replica's lag)."""


class MatchEndpoint:
    """Answers match queries from the state a replica serves now.

    Args:
        replica: this replica's name (in every reply).
        state: returns the index state to match against (a replica replaces its state when it rebuilds).
        latency: seconds per match, by outcome (None: not measured).
    """

    def __init__(
        self, replica: str, state: Callable[[], IndexState], latency: Histogram | None = None
    ) -> None:
        self.replica = replica
        self._state = state
        self._encoder = msgspec.msgpack.Encoder()
        self._latency = latency

    async def handle(self, req: Request) -> None:
        """Answer one match request (a bad one with ``bad_request``, an unserved model with ``unknown_model``).

        With tracing on it is a ``kvmesh.index.match`` server span, the child of the router's route span when
        the request carries its context (`kvmesh.runtime.tracing`).
        """
        with tracing.server_span(tracing.MATCH_SPAN, req.headers, {"kvmesh.replica": self.replica}):
            if self._latency is None:
                tracing.annotate({"kvmesh.outcome": await self._handle(req)})
                return
            t0 = time.perf_counter()
            outcome = await self._handle(req)
            self._latency.record(time.perf_counter() - t0, {"outcome": outcome})
            tracing.annotate({"kvmesh.outcome": outcome})

    async def _handle(self, req: Request) -> str:
        try:
            query = protocol.decode(req.data, MatchRequest, format="msgpack")
        except RequestError as exc:
            await self._error(req, "bad_request", str(exc))
            return "bad_request"
        try:
            tokens = query.token_ids
            result = self._state().match(
                query.model,
                policy.unpack_tokens(tokens) if isinstance(tokens, bytes) else tokens,
                lora_name=query.lora_name,
                cache_salt=query.cache_salt,
            )
        except UnknownModelError:
            await self._error(req, "unknown_model", f"no worker serves model {query.model!r}")
            return "unknown_model"
        except RequestError as exc:
            await self._error(req, "bad_request", str(exc))
            return "bad_request"
        if tracing.enabled():
            prompt = len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)
            tracing.annotate(
                {
                    "kvmesh.model": query.model,
                    "kvmesh.prompt_tokens": prompt,
                    "kvmesh.candidates": len(result.candidates),
                }
            )
        await req.respond(protocol.encode(policy.match_reply(result, self.replica), format="msgpack"))
        return "ok"

    async def _error(self, req: Request, code: str, message: str) -> None:
        message = clip_echo(message)  # it may repeat the request's model name
        await req.respond_error(
            str(ERROR_STATUS[code]),
            f"{code}: {message}",
            protocol.encode(protocol.error_reply(code, message), format="msgpack"),
        )


def status_reply(
    *,
    replica: str,
    stream: str,
    ready: bool,
    state: IndexState,
    reader: StreamReplica | None,
    snapshots: dict[str, Any],
    snapshot_writer: bool,
) -> IndexerStatus:
    """A replica's ``kvmesh status`` reply: its sequence, size, digest, counters, recovery and snapshots.

    Args:
        reader: the replica's stream reader (None before `run()` connected: zero counters).
    """
    st = state
    return IndexerStatus(
        replica=replica,
        stream=stream,
        ready=ready,
        applied_seq=st.applied_seq,
        blocks=st.block_total(),
        digest=f"{st.digest():016x}",
        models=st.models(),
        counters=asdict(st.counters)
        | {
            "decode_errors": reader.decode_errors if reader is not None else 0,
            "apply_errors": reader.apply_errors if reader is not None else 0,
        },
        workers=st.workers(),
        complete=st.gap_seq is None,
        incomplete=[f"{w}/{r}" for w, r in st.incomplete()],
        holder_health={f"{w}/{r}": why for (w, r), why in st.holder_health().items()},
        reset_epoch=st.reset_epoch,
        read_messages=reader.read_messages if reader is not None else 0,
        resubscribes=reader.resubscribes if reader is not None else 0,
        stream_id=reader.stream_id if reader is not None else "",
        rebuilds=reader.rebuilds if reader is not None else 0,
        recovery=reader.recovery if reader is not None else {},
        snapshots=snapshots,
        snapshot_writer=snapshot_writer,
        max_blocks=st.max_blocks,
    )


def status_responder(status: Callable[[], IndexerStatus]) -> Callable[[Any], Awaitable[None]]:
    """A ``kvmesh status`` subscription callback that replies ``status()`` as JSON (when asked for a reply)."""

    async def on_status(msg: Any) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(protocol.encode(status()))

    return on_status


class IndexerMetrics:
    """An indexer's Prometheus endpoint (``--metrics-port``): its replica's figures, its own
    (`kvmesh.indexer.metrics`) and the match latency; `watch` reads the stream's last sequence every
    `LAG_CHECK_S` (the lag) and notes when this replica writes a snapshot (its age)."""

    def __init__(self, service: IndexerService, metrics: ServiceMetrics) -> None:
        self._service = service
        self.metrics = metrics
        self.lag = StreamLag()
        self.match_latency: Histogram = metrics.histogram(MATCH_LATENCY, "seconds to answer a match query")
        self._written = 0
        self._written_at: float | None = None
        metrics.observe(self._replica_samples, replica_instruments(PREFIX))
        metrics.observe(self._own_samples, INSTRUMENTS)

    @classmethod
    async def open(cls, service: IndexerService) -> IndexerMetrics | None:
        """Serve the service's metrics on its ``--metrics-port`` (None when unset: nothing is created).

        Raises:
            OSError: the port is taken.
        """
        made: list[IndexerMetrics] = []
        metrics = await start_metrics(
            "indexer", service.settings.metrics_port, lambda m: made.append(cls(service, m))
        )
        return made[0] if metrics is not None else None

    async def watch(self, js: Any) -> None:
        """Read the stream's last sequence every `LAG_CHECK_S` (NATS errors skip a read) until cancelled."""
        stream = self._service.settings.stream
        while True:
            with contextlib.suppress(Exception):
                info = await js.stream_info(stream)
                self.lag.note(int(info.state.last_seq), time.monotonic())
            self._note_snapshot()
            await asyncio.sleep(LAG_CHECK_S)

    def _note_snapshot(self) -> None:
        written = int(self._service.snapshots.get("written", 0))
        if written != self._written:
            self._written, self._written_at = written, time.monotonic()

    def _replica_samples(self) -> Samples:
        svc = self._service
        reader = svc._replica  # None before it connected
        if reader is None:
            return {}
        lag = self.lag.lag(reader.state.applied_seq, time.monotonic())
        view = replica_view(reader, stream_last_seq=self.lag.stream_last_seq, lag=lag)
        return replica_samples(PREFIX, view, {"replica": svc.replica})

    def _own_samples(self) -> Samples:
        svc = self._service
        self._note_snapshot()
        writer = svc._writer
        return indexer_samples(
            IndexerFigures(
                replica=svc.replica,
                ready=svc.ready.is_set(),
                snapshot_writer=writer is not None and writer.lease.held,
                snapshots=svc.snapshots,
                snapshot_age_s=None if self._written_at is None else time.monotonic() - self._written_at,
                pending_messages=svc._schedule.since,
                removals_published=svc.removals_published,
            )
        )

    async def aclose(self) -> None:
        """Stop serving."""
        await self.metrics.aclose()
