"""The ingest service: engine ZMQ PUB (+ replay ROUTER) → decode → check → hash → JetStream.

```
 engine rank r ── SUB [topic, seq, payload] ──▶ SeqTracker ──▶ decode_batch ──▶ Normalizer ──▶ outbox
        └── ROUTER replay ◀── DEALER on a gap ──┘   (gaps, restarts)     (wire)        (keys)       │
                                                                                                  ▼
                                           JetStream publish, acked, Nats-Msg-Id, bounded window
```

The ZMQ side never waits for NATS: batches go to a bounded outbox; when it is full the oldest batch is
dropped and the (worker, dp_rank) resynchronised. Per (worker, dp_rank) the cursor (epoch, last engine
sequence) is recovered on start from the last message on that rank's subject.

This module is the lifecycle; each concern has its own: `reader` (ZMQ SUB and replay), `batches` (engine
batches to stream messages), `outbox` (publish policy), `publish` (publish loop), `recovery` (cursors at
start), `registration` (registry key), `liveness`, `probes` (engine liveness), `status`, `eventless` (no events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Coroutine
from typing import Any

import zmq.asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext

from kvmesh.core import protocol
from kvmesh.core.endpoints import offset_endpoint
from kvmesh.core.events import Cleared, Event
from kvmesh.core.normalize import Normalizer
from kvmesh.core.protocol import IngestStatus
from kvmesh.core.sequencing import SeqTracker
from kvmesh.ingest.batches import Batches, Rank
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.engine_sleep import SleepWatch
from kvmesh.ingest.eventless import run_eventless
from kvmesh.ingest.liveness import EngineWatch, ProbeTarget
from kvmesh.ingest.metrics import (
    INSTRUMENTS,
    PUBLISH_LATENCY,
    SLEEP_INSTRUMENTS,
    ingest_samples,
    sleep_samples,
)
from kvmesh.ingest.outbox import Coalescer, MessageIds, Outgoing
from kvmesh.ingest.publish import Publisher
from kvmesh.ingest.reader import RankReader
from kvmesh.ingest.recovery import RankCursor, fresh_tracker, recover_rank
from kvmesh.ingest.registration import Registration
from kvmesh.ingest.status import IngestCounters, ingest_status
from kvmesh.runtime import subjects
from kvmesh.runtime.metrics import ServiceMetrics, start_metrics
from kvmesh.runtime.nats import StreamSettings, close_quietly, connect, connect_options, ensure_stream
from kvmesh.runtime.replica import retry_start
from kvmesh.runtime.runner import supervise
from kvmesh.runtime.vllm_metrics import MetricsLoadPublisher

log = logging.getLogger("kvmesh.ingest")

STOP_FLUSH_S = 2.0
"""Seconds a stopping ingest spends publishing what it buffered (the rest is replayed after a restart)."""


class IngestService:
    """One ingest: all data-parallel ranks of one engine, publishing to the events stream."""

    def __init__(self, settings: IngestSettings) -> None:
        self.settings = settings
        self.counters = IngestCounters()
        self._ctx = zmq.asyncio.Context()
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._ranks: dict[int, Rank] = {}
        self._stop = asyncio.Event()
        ids = MessageIds(os.urandom(4).hex())
        self.batches = Batches(settings, self.counters, self._ranks, ids, self._push)
        self.publisher = Publisher(settings, self.counters, ids, self.batches.overflow_clear)
        self.registration = Registration(settings, self._ranks, self._rejoin)
        self._rejoined = False
        """True when this ingest started a new incarnation because its worker had been removed."""
        self._rank_verify: dict[int, tuple[int, float]] = {}
        """Rank → (engine seq, batch ts) of the last batch in the stream, checked against the engine's replay."""
        self._watch: EngineWatch | None = None
        """Engine liveness per rank (None with probing off)."""
        self.metrics: ServiceMetrics | None = None
        """The Prometheus endpoint (None with ``--metrics-port`` unset)."""
        self.sleep_watch = SleepWatch(
            worker_id=settings.worker_id, ranks=self._ranks, clear=self.batches.enqueue_clear
        )
        """Clears a rank whose engine's ``--metrics-url`` page shows it asleep (`kvmesh.ingest.engine_sleep`)."""
        self.ready = asyncio.Event()

    def _push(self, out: Outgoing) -> None:
        """Hand a message to the publisher (`Batches` is made before it, to build its overflow clears)."""
        self.publisher.push(out)

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Connect, recover cursors, then read every rank and publish until `stop()`."""
        s = self.settings
        if not s.kv_events:  # registry heartbeats only: no ZMQ socket, nothing on the stream
            return await run_eventless(self)
        pub = self.publisher
        self._nc = await connect(
            s.nats_url,
            name=f"kvmesh-ingest-{s.worker_id}",
            on_disconnect=pub.on_disconnect,
            **connect_options(s),
        )
        self.batches.max_payload = self._nc.max_payload or self.batches.max_payload
        self.metrics = await start_metrics("ingest", s.metrics_port, self._declare_metrics)
        self._js = js = self._nc.jetstream()
        pub.nc, pub.js, self.registration.js = self._nc, js, js
        settings = StreamSettings(
            name=s.stream,
            prefix=s.events_prefix,
            replicas=s.stream_replicas,
            memory=s.stream_memory,
            max_bytes=s.stream_max_bytes,
            max_age_s=s.stream_max_age_s,
        )
        # Start-up calls ride out a stream or cluster without a JetStream leader (an R3 stream electing one,
        # a lost quorum) instead of exiting; stop() interrupts the wait.
        ensured = await retry_start(
            lambda: _true(ensure_stream(js, settings)),
            what=f"ensure stream {s.stream}",
            name=f"ingest {s.worker_id}",
            stop=self._stop,
        )
        if ensured is None:
            await close_quietly(self._nc)
            self._ctx.destroy(linger=0)
            if self.metrics is not None:
                await self.metrics.aclose()
            return
        with contextlib.suppress(Exception):  # the registry gets the stream's replica count (3 on a cluster)
            info = await js.stream_info(s.stream)
            self.registration.stream_replicas = info.config.num_replicas or s.stream_replicas
        status_sub = await self._nc.subscribe(f"{subjects.STATUS_SUBJECT}.ingest", cb=self._on_status)
        await self._start_ranks()
        self._watch = self._engine_watch()
        self.registration.watch = self._watch
        reader = RankReader(self._ctx, s, self.counters, self.batches, self._watch)
        loops: dict[str, Coroutine[Any, Any, None]] = {
            f"rank {rank.rank} reader": reader.read(rank) for rank in self._ranks.values()
        }
        loops["publish loop"] = pub.run()
        if not s.backend_of:  # a backend (a shared pool) is no routable worker: it has no registry key
            loops["registry heartbeat"] = self.registration.run()
        if self._watch is not None:
            loops["engine liveness"] = self._watch.run()
        if s.metrics_url:  # engine load for the routers (vLLM's Prometheus page)
            scraper = MetricsLoadPublisher(
                self._nc, url=s.metrics_url, worker_id=s.worker_id, fetch=self.sleep_watch.fetch
            )
            loops["engine metrics"] = scraper.run()
        self.ready.set()
        log.info(
            "ingest %s: model %s, %d rank(s) from %s, replay %s, snapshot %s, publishing to %s",
            s.worker_id,
            s.model,
            len(s.local_ranks()),
            s.zmq_endpoint,
            s.replay_endpoint or "off",
            s.snapshot_endpoint or "off",
            s.stream,
        )
        try:
            await supervise(
                self._nc, loops, stop=self._stop, name=f"ingest {s.worker_id}", health_file=s.health_file
            )
        finally:
            await self._shut_down(status_sub)

    async def _start_ranks(self) -> None:
        """Recover every rank's cursor, decide the incarnation, and announce each rank."""
        s = self.settings
        has_replay = s.replay_endpoint is not None
        recovered = {r: await self._recover(r, has_replay) for r in s.local_ranks()}
        trackers = {r: c.tracker for r, c in recovered.items()}
        resync = {r for r, c in recovered.items() if c.resync}
        found = any(c.found for c in recovered.values())
        if found and not (s.backend_of or await self.registration.still_registered()):  # a pool has no key
            # The worker was removed (clean stop, TTL) or is about to be: the index drops every message of
            # the old incarnation from here on. Start a new one on every rank, above every rank's epoch
            # (the removal covers the worker's highest), replaying what the engine still holds.
            epoch = max(t.epoch for t in trackers.values()) + 1
            log.warning(
                "worker %s: cursor recovered but the worker is not registered (removed); starting "
                "incarnation %d on every rank",
                s.worker_id,
                epoch,
            )
            snap = s.snapshot_endpoint is not None
            trackers = {r: fresh_tracker(has_replay, epoch, has_snapshot=snap) for r in trackers}
            self._rank_verify.clear()
            resync.clear()
            self._rejoined = True
        for r, tracker in trackers.items():
            self._ranks[r] = rank = self._new_rank(r, tracker)
            # Announce the rank so routers see the worker before it caches anything (a rejoin clears it);
            # a rank whose subject held nothing decodable is resynchronised by its announcement.
            events: list[Event] = [Cleared("rejoin")] if self._rejoined else []
            if r in resync:
                events = [Cleared("resync")]
            self.batches.hello(rank, events)

    def _new_rank(self, r: int, tracker: SeqTracker) -> Rank:
        s = self.settings
        rank = Rank(
            r,
            offset_endpoint(s.zmq_endpoint, r),
            offset_endpoint(s.replay_endpoint, r) if s.replay_endpoint else None,
            tracker,
            Normalizer(block_size=s.block_size),
            Coalescer(s.max_coalesced_batches),
        )
        rank.verify = self._rank_verify.get(r)
        if s.snapshot_endpoint:
            rank.snapshot_endpoint = offset_endpoint(s.snapshot_endpoint, r)
        return rank

    def _engine_watch(self) -> EngineWatch | None:
        """The engine liveness watch over every rank (None with probing off)."""
        s = self.settings
        if s.engine_probe_after_s <= 0:
            return None
        return EngineWatch(
            self._ctx,
            worker_id=s.worker_id,
            targets={
                r.rank: ProbeTarget(r.replay_endpoint, None if r.replay_endpoint else s.health_url)
                for r in self._ranks.values()
            },
            policy=s.liveness_policy(),
            probe_timeout_s=s.engine_probe_timeout_s,
            on_change=self.registration.on_engine_change,
        )

    async def _shut_down(self, status_sub: Any) -> None:
        """Stop replays, publish what is buffered for a few seconds, leave the registry on a clean stop (the
        loops have ended: `supervise` cancelled them)."""
        replays = [t for r in self._ranks.values() for t in (r.replay_task, r.snapshot_task) if t is not None]
        for t in replays:
            t.cancel()
        await asyncio.gather(*replays, return_exceptions=True)
        for rank in self._ranks.values():
            self.batches.flush(rank)
        with contextlib.suppress(Exception):
            await status_sub.unsubscribe()
        pub = self.publisher
        await pub.flush(timeout_s=STOP_FLUSH_S)
        if len(pub.outbox) or len(pub.window):
            log.warning(
                "worker %s: stopping with %d batch(es) unpublished and %d unacknowledged; a restarted "
                "ingest replays them from the engine",
                self.settings.worker_id,
                len(pub.outbox),
                len(pub.window),
            )
        if self._stop.is_set() and not self.settings.backend_of:  # a clean stop: leave the registry now
            await self.registration.deregister()
        assert self._nc is not None
        await close_quietly(self._nc)
        self._ctx.destroy(linger=0)
        if self.metrics is not None:
            await self.metrics.aclose()

    def stop(self) -> None:
        """Ask `run()` to finish (publishing what is buffered first, for a few seconds)."""
        self._stop.set()

    async def _recover(self, rank: int, has_replay: bool) -> RankCursor:
        """The rank's cursor, resuming after the last decodable message on its subject (`recover_rank`)."""
        assert self._js is not None
        s = self.settings
        subject = subjects.events_subject(s.events_prefix, s.model, s.worker_id, rank)
        seen: set[int] = set()

        def undecodable(stream_seq: int, exc: Exception) -> None:
            if stream_seq in seen:  # met again by a retried walk
                return
            seen.add(stream_seq)
            self.counters.undecodable_stream_messages += 1
            log.warning(
                "worker %s rank %d: undecodable message at stream seq %d on %s (%s); skipped, recovering "
                "from the message before it",
                s.worker_id,
                rank,
                stream_seq,
                subject,
                exc,
            )

        cursor = await recover_rank(
            self._js,
            stream=s.stream,
            subject=subject,
            who=f"ingest {s.worker_id} rank {rank}",
            has_replay=has_replay,
            has_snapshot=s.snapshot_endpoint is not None,
            stop=self._stop,
            on_undecodable=undecodable,
        )
        if cursor.verify is not None:
            self._rank_verify[rank] = cursor.verify
        return cursor

    def _rejoin(self, reason: str) -> None:
        """Start a new incarnation on every rank, announced by a Cleared.

        The new epoch is above every rank's (a removal covers the worker's highest epoch).
        """
        epoch = max((r.tracker.epoch for r in self._ranks.values()), default=0) + 1
        for rank in self._ranks.values():
            rank.tracker.rejoin(epoch)
            self.batches.enqueue_clear(rank, reason)

    # ------------------------------------------------------------------ status

    def status(self) -> IngestStatus:
        """Return this ingest's cursors and counters (what `kvmesh status` shows)."""
        live = self._watch.ranks if self._watch is not None else {}
        return ingest_status(self.settings, self.counters, self.publisher.unacknowledged, self._ranks, live)

    def _declare_metrics(self, metrics: ServiceMetrics) -> None:
        """The ingest's metrics (`kvmesh.ingest.metrics`): its status counters and the publish latency."""
        metrics.observe(lambda: ingest_samples(self.status(), reconnects=self._reconnects()), INSTRUMENTS)
        worker = self.settings.worker_id
        metrics.observe(lambda: sleep_samples(worker, self.sleep_watch.clears), SLEEP_INSTRUMENTS)
        self.publisher.latency = metrics.histogram(PUBLISH_LATENCY, "seconds from publish to JetStream ack")

    def _reconnects(self) -> int:
        return int(self._nc.stats["reconnects"]) if self._nc is not None else 0

    async def _on_status(self, msg: Any) -> None:
        if msg.reply:
            await msg.respond(protocol.encode(self.status()))


async def _true(op: Awaitable[Any]) -> bool:
    """Await ``op`` and return True (`retry_start` takes None for "stopped")."""
    await op
    return True
