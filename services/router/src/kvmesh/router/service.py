"""The router service: ``kvmesh.route`` requests → indexer match → cost over affinity and load → JSON reply.

A NATS micro service (``kvmesh-router``, queue group ``kvmesh-router``) with one endpoint, ``route``, so
``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS`` find it (the endpoint's stats ``data`` is a
`kvmesh.core.protocol.RouterStats`). Every error reply is an `ErrorReply` with the NATS service-error headers
(``Nats-Service-Error``: ``"<code>: <message>"``; ``Nats-Service-Error-Code``: 400/404/503/500).

The modules, policy apart from I/O:

* `kvmesh.router.answer` (pure) — the match answer, candidates, decision, reply and explain;
* `kvmesh.router.health` (pure) — replica lag, the route mode, each holder's state;
* `kvmesh.router.stats` (pure) — the ``$SRV.STATS`` data;
* `kvmesh.router.endpoint` — the ``route`` endpoint: parse, match, carry out the answer, reply;
* `kvmesh.router.local_index` — the in-process replica's start and the lag watch (``--index local``);
* `kvmesh.router.notes` — the lifecycle notes, load reports and the start-up sync;
* this module — the connection, the registry watcher, the micro service and the lifecycle of the rest.

Load, shared by every replica (plain subscriptions, no queue group, so each replica sees every event):

* ``<requests_prefix>.routed`` — published by the replica that routed a request with a ``request_id``
  (before it replies, after recording it itself), applied by every other replica (the connection does not
  echo a replica's own messages back to it);
* ``<requests_prefix>.prefill_done`` / ``.finished`` — published by clients (`kvmesh.client.Router`);
* ``<requests_prefix>.sync`` — a starting replica asks its peers for their ledger (`LedgerSnapshot`), so a
  restart loses nothing other replicas hold; it subscribes to the lifecycle events first, so nothing falls
  between the snapshot and the live events;
* ``<load_prefix>.<worker>`` — engine load reports (`WorkerLoad`, JSON), kept ``load_ttl_s``.

Requests without a ``request_id`` are routed but not accounted (nobody could finish them).

Candidates are what the index holds for the model (every worker that announced itself, nothing cached
included, until the registry's `WorkerRemoved` reaches the stream), narrowed and completed by the worker
registry (``--use-registry``, on by default): a `kvmesh.runtime.registry.RegistryWatcher` follows the
registry bucket, so a worker whose heartbeats stopped leaves the candidates at once, and a registered
worker the index does not know yet joins them with zero overlap. A model with no registered worker at all
(workers fed without heartbeats) keeps the index's candidates. A rank its worker's record lists in
``stale_ranks`` (engine silent) is no candidate; a model whose every rank is stale answers ``no_workers``,
as does a request whose named ``candidates`` have only stale ranks (naming one and why).
Each route scores at most ``--max-candidates`` (`kvmesh.core.route.select_candidates`: holders with overlap
first, and only a few idle registered ranks the index lacks), so its cost does not grow with empty ranks.

Every reply carries ``mode``: ``exact``; ``degraded`` with ``degraded_reason`` (the local replica lags the
stream beyond ``--max-lag-messages`` / ``--max-lag-s``, measured against the stream's last sequence read
every `LAG_CHECK_S`, or the chosen holder is incomplete, its history lost, or stale, its heartbeat late);
``load_only`` (the local replica is rebuilding: overlaps are ignored). Explain gives each scored holder's
``health``; the endpoint's stats carry the non-exact holders and the lag (``kvmesh status``).

Where the overlaps come from (``--index``):

* ``local`` (default): the router holds its own `kvmesh.runtime.replica.StreamReplica` (the indexers' newest
  snapshot, then the stream), joins the route queue group only once it has caught up, and matches in
  process: one NATS round trip per route, at the memory of one index per router. The answer's
  ``index_seq`` is this router's applied sequence. The indexers still write the snapshots and publish
  worker removals. This halves route latency (docs/benchmarks.md).
* ``remote``: a match query to the indexers' queue group per route (msgpack, token ids packed as uint32).
  Routers hold no index; a route costs two NATS round trips.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import nats.js.errors
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.service import EndpointConfig, EndpointStats, ServiceConfig

from kvmesh.core.load import EngineLoads, LoadLedger
from kvmesh.core.protocol import FORMS_METADATA_KEY, ROUTE_FORMS, RouterStats
from kvmesh.router.config import RouterSettings
from kvmesh.router.endpoint import MAX_IN_FLIGHT, RouteEndpoint, WorkerRegistry
from kvmesh.router.http_ingests import Registrations
from kvmesh.router.http_server import HttpApi, serve_http
from kvmesh.router.local_index import LAG_CHECK_S, LocalIndex
from kvmesh.router.metrics import INSTRUMENTS, REPLICA_PREFIX, router_samples
from kvmesh.router.notes import LifecycleNotes
from kvmesh.router.stats import index_stats, router_stats
from kvmesh.runtime import subjects
from kvmesh.runtime.metrics import (
    Samples,
    ServiceMetrics,
    replica_instruments,
    replica_samples,
    replica_view,
    start_metrics,
)
from kvmesh.runtime.nats import connect, connect_options, micro_endpoint
from kvmesh.runtime.registry import RegistryWatcher
from kvmesh.runtime.replica import StreamReplica
from kvmesh.runtime.runner import VERSION, supervise
from kvmesh.runtime.snapshots import SnapshotStore

__all__ = ["LAG_CHECK_S", "MAX_IN_FLIGHT", "RouterService", "WorkerRegistry"]

log = logging.getLogger("kvmesh.router")

_STOP_TIMEOUT_S = 5.0


class RouterService:
    """One router replica.

    Args:
        settings: the replica's settings.
        registry: live workers per model; None uses the indexer's candidates as they are.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(
        self,
        settings: RouterSettings,
        *,
        registry: WorkerRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.policy = settings.policy()
        self.ledger = LoadLedger(ttl_s=settings.request_ttl_s, prefill_progress=settings.prefill_progress)
        self.engine_loads = EngineLoads(ttl_s=settings.load_ttl_s)
        self._clock = clock
        self._stop = asyncio.Event()
        self._nc: Client | None = None
        self.ready = asyncio.Event()
        self.notes = LifecycleNotes(settings, self.ledger, self.engine_loads, clock=clock)
        self.local = LocalIndex(settings, stop=self._stop, clock=clock) if settings.index == "local" else None
        """The in-process index (``--index local``), else None."""
        self.endpoint = RouteEndpoint(
            settings, policy=self.policy, notes=self.notes, local=self.local, clock=clock
        )
        self.endpoint.registry = registry
        self.notes.predictions.records = self.endpoint.records
        self.metrics: ServiceMetrics | None = None
        """The Prometheus endpoint (None with ``--metrics-port`` unset)."""
        self.http_port: int | None = None
        """The port the RFC #1403 API listens on once serving (``--http-port``; None: off)."""
        self.http: HttpApi | None = None

    @property
    def registry(self) -> WorkerRegistry | None:
        """Live workers per model (the registry watcher once `run` started it), or None."""
        return self.endpoint.registry

    @property
    def replica(self) -> StreamReplica | None:
        """The in-process index (``--index local``, once it opened), else None."""
        return self.local.replica if self.local is not None else None

    @property
    def synced_requests(self) -> int:
        """In-flight requests restored from a peer's ledger at start-up."""
        return self.notes.synced_requests

    async def run(self) -> None:
        """Join the shared accounting, then serve route requests until `stop()`."""
        s = self.settings
        # no_echo: the replica records what it routed before publishing it; its own lifecycle events coming
        # back would only be decoded and applied a second time (idempotently) on every route.
        self._nc = nc = await connect(s.nats_url, name="kvmesh-router", no_echo=True, **connect_options(s))
        self.endpoint.bind(nc)
        self.metrics = await start_metrics("router", s.metrics_port, self._declare_metrics)
        follow: asyncio.Task[None] | None = None
        watch: asyncio.Task[None] | None = None
        lag: asyncio.Task[None] | None = None
        if self.registry is None and s.use_registry:
            js = nc.jetstream()

            async def members() -> dict[str, str]:
                try:
                    store = await SnapshotStore.open(js, s.snapshot_bucket_name(), create=False)
                except nats.js.errors.BucketNotFoundError:
                    return {}
                return await store.members()

            watcher = RegistryWatcher(js, s.registry_bucket_name(), members=members)
            self.endpoint.registry = watcher
            watch = asyncio.create_task(watcher.run())
        try:
            if self.local is not None:
                follow = await self.local.start(nc)
                if follow is None:
                    return  # stopped while catching up
                lag = asyncio.create_task(self.local.watch_lag(nc))
            loops = {"index replica": follow, "registry watch": watch, "lag watch": lag}
            await self._serve(nc, {name: t for name, t in loops.items() if t is not None})
        finally:
            background = {t for t in (follow, watch, lag) if t is not None}
            for t in background:
                t.cancel()
            if background:
                await asyncio.wait(background, timeout=_STOP_TIMEOUT_S)
            with contextlib.suppress(Exception):
                await nc.drain()
            if self.metrics is not None:
                await self.metrics.aclose()

    async def _serve(self, nc: Client, loops: dict[str, asyncio.Task[None]]) -> None:
        s = self.settings
        subs = await self.notes.subscribe(nc)
        await nc.flush()
        await nc.flush()  # see below: subscribed for live events before asking peers for their snapshot
        await self.notes.sync_from_peers(nc)
        subs.append(await self.notes.serve_sync(nc))
        service = await add_service(
            nc,
            ServiceConfig(
                name="kvmesh-router",
                version=VERSION,
                description="kvmesh KV-cache-aware router (affinity balanced against load)",
                queue_group=subjects.ROUTER_QUEUE,
                stats_handler=self._stats,
                # The route request forms this router reads (clients fall back to JSON without them).
                metadata={FORMS_METADATA_KEY: ",".join(ROUTE_FORMS)},
            ),
        )
        await service.add_endpoint(
            EndpointConfig(name="route", subject=s.route_subject, handler=self.endpoint.on_route)
        )
        # nats.micro counts an error only when a handler raises; the router answers its errors itself.
        self.endpoint.micro_endpoint = micro_endpoint(service, "route")
        # The server must know every subscription before anyone is told we are ready. nats-py writes PING
        # straight to the socket but SUB through its pending buffer, so one flush can overtake the SUB.
        await nc.flush()
        await nc.flush()
        http = await self._start_http()
        self.ready.set()
        log.info(
            "router: serving %s (%s; from peers: %d in-flight requests, %d sessions, %d predicted entries)",
            s.route_subject,
            "local index" if self.replica is not None else f"indexers on {s.match_subject}",
            self.synced_requests,
            self.notes.synced_sessions,
            self.notes.synced_predicted,
        )
        if self.replica is None and s.max_blocks is not None:
            log.warning(
                "router: --max-blocks bounds a local index replica; with --index remote it has no effect"
            )
        try:
            # A failed index replica, registry watch or lag watch fails the router rather than let it serve
            # a stale index or stale candidates.
            await supervise(nc, loops, stop=self._stop, name="router", health_file=s.health_file)
        finally:
            if http is not None:
                http.close()
                assert self.http is not None
                await self.http.registrations.aclose()
            with contextlib.suppress(Exception):
                await service.stop()
            # answer what was accepted before the connection drains
            await self.endpoint.drain(_STOP_TIMEOUT_S)
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _start_http(self) -> asyncio.Server | None:
        """Listen for the RFC #1403 API (``--http-port``) over the local index; None when off."""
        s = self.settings
        if s.http_port is None or self.local is None:
            return None
        local = self.local
        self.http = HttpApi(
            lambda: local.replica.state if local.replica is not None else None,
            Registrations(s),
            ready=lambda: local.replica is not None,
        )
        server = await serve_http(self.http, s.http_host, s.http_port)
        self.http_port = int(server.sockets[0].getsockname()[1])
        log.info("router: RFC #1403 indexer API on http://%s:%d", s.http_host, self.http_port)
        return server

    def stop(self) -> None:
        """Ask `run()` to finish."""
        self._stop.set()

    def lag(self, now: float) -> tuple[int, float]:
        """Return how far the local replica is behind the stream: (messages, seconds); (0, 0.0) without one.

        Messages: the stream's last sequence as last read minus the applied sequence (0 when ahead, e.g. a
        re-created stream being rebuilt). Seconds: how long ago the stream was first seen holding a message
        the replica has still not applied (0 when none; precise to `LAG_CHECK_S`).
        """
        return self.local.lag(now) if self.local is not None else (0, 0.0)

    def _stats(self, _endpoint: EndpointStats) -> dict[str, Any]:
        """The route endpoint's ``$SRV.STATS`` data (`stats_message`)."""
        return msgspec.to_builtins(self.stats_message())  # type: ignore[no-any-return]

    def stats_message(self) -> RouterStats:
        """The route endpoint's stats now (`kvmesh.router.stats.router_stats`)."""
        e = self.endpoint
        now = self._clock()
        route_mode, reason = e.index_mode(now)
        index = index_stats(
            route_mode,
            reason,
            e.holders_status(),
            route_subject=self.settings.route_subject,
            match_subject=self.settings.match_subject,
            replica=self.local.figures(now) if self.local is not None else None,
        )
        return router_stats(
            routed=e.routed,
            errors=e.errors,
            ledger=self.ledger.stats(),
            engine_reports=len(self.engine_loads),
            modes=e.modes,
            candidates_cut=e.bounded,
            index=index,
            latency=e.latency,
            sessions=len(self.notes.sessions),
            predicted_blocks=self.notes.predictions.held(),
        )

    def _declare_metrics(self, metrics: ServiceMetrics) -> None:
        """The router's metrics (`kvmesh.router.metrics`) and, with a local index, its replica's."""
        metrics.observe(lambda: router_samples(self.stats_message()), INSTRUMENTS)
        self.endpoint.use_metrics(metrics)
        if self.local is not None:
            metrics.observe(self._replica_samples, replica_instruments(REPLICA_PREFIX))

    def _replica_samples(self) -> Samples:
        local = self.local
        if local is None or local.replica is None:
            return {}
        view = replica_view(
            local.replica, stream_last_seq=local.lag_meter.stream_last_seq, lag=local.lag(self._clock())
        )
        return replica_samples(REPLICA_PREFIX, view, {})
