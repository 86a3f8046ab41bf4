"""The indexer service: stream → `IndexState` → match queries over NATS request-reply.

On start its `kvmesh.runtime.replica.StreamReplica` loads the newest snapshot that verifies from the group's
Object Store bucket (falling back to older ones), then reads the events stream from the snapshot's sequence
+ 1 with an ordered push consumer (no durable consumer, so nothing is orphaned when a replica goes away) and
applies every message in stream order; the service joins the match queue group only once it has caught up with the stream's last sequence as of
its start — a replica that is behind never answers. When the stream no longer holds the messages after
every usable snapshot, it starts from what the stream holds, marks the state incomplete
(`IndexState.mark_gap`, shown by ``kvmesh status``) and logs it.

While running, the holder of the group's snapshot-writer lease writes snapshots and purges what no kept
snapshot needs (`kvmesh.indexer.writer`), and every replica watches the worker registry and publishes
`WorkerRemoved` when a worker's key expires or is deleted (`kvmesh.indexer.members`). Match and status
endpoints (`kvmesh.indexer.endpoints`) are a NATS micro service (``kvmesh-indexer``), so ``$SRV.PING``,
``$SRV.INFO`` and ``$SRV.STATS`` discover it. The decisions all of these carry out are in
`kvmesh.indexer.policy`, without I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.service import EndpointConfig, ServiceConfig

from kvmesh.core.protocol import IndexerStatus
from kvmesh.core.state import IndexState
from kvmesh.indexer.config import IndexerSettings
from kvmesh.indexer.endpoints import IndexerMetrics, MatchEndpoint, status_reply, status_responder
from kvmesh.indexer.members import RegistryWatch
from kvmesh.indexer.policy import SnapshotSchedule
from kvmesh.indexer.writer import SnapshotWriter, check_retention, new_stats
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import (
    close_quietly,
    connect,
    connect_options,
    wait_for_stream,
)
from kvmesh.runtime.registry import RegistrySettings, open_registry
from kvmesh.runtime.replica import StreamReplica, retry_start
from kvmesh.runtime.runner import VERSION, supervise
from kvmesh.runtime.snapshots import SnapshotLease, SnapshotStore, open_kv

log = logging.getLogger("kvmesh.indexer")

_STOP_TIMEOUT_S = 5.0
"""Bound on each shutdown step, so a stuck call never keeps a stopping replica (and its connection) alive."""


T = TypeVar("T")


class _Stopped(Exception):
    """`stop()` was called during start-up."""


async def _true(aw: Awaitable[None]) -> bool:
    await aw
    return True


class IndexerService:
    """One indexer replica."""

    def __init__(self, settings: IndexerSettings) -> None:
        self.settings = settings
        self.replica = settings.replica_name()
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._nc: Client | None = None
        self._replica: StreamReplica | None = None
        self._empty = IndexState()
        self._started = time.monotonic()
        self._store: SnapshotStore | None = None
        self._writer: SnapshotWriter | None = None
        self._watch: RegistryWatch | None = None
        self._schedule = SnapshotSchedule(
            every_messages=settings.snapshot_every_messages,
            every_s=settings.snapshot_every_s,
            now=self._started,
        )
        self.snapshots: dict[str, Any] = new_stats()
        """Snapshots written by this replica (`kvmesh.indexer.writer.new_stats`)."""
        self.metrics: IndexerMetrics | None = None
        """The Prometheus endpoint (None with ``--metrics-port`` unset)."""

    # The replica's state and counters (an empty state until `run()` has connected).

    @property
    def state(self) -> IndexState:
        """The index state this replica serves."""
        return self._replica.state if self._replica is not None else self._empty

    @property
    def read_messages(self) -> int:
        """Stream messages this replica's consumer received."""
        return self._replica.read_messages if self._replica is not None else 0

    @property
    def decode_errors(self) -> int:
        """Stream messages that could not be decoded (skipped)."""
        return self._replica.decode_errors if self._replica is not None else 0

    @property
    def apply_errors(self) -> int:
        """Stream messages that failed to apply (skipped)."""
        return self._replica.apply_errors if self._replica is not None else 0

    @property
    def resubscribes(self) -> int:
        """Times the stream consumer stalled and was re-created (NATS restarts)."""
        return self._replica.resubscribes if self._replica is not None else 0

    @property
    def removals_published(self) -> int:
        """`WorkerRemoved` messages this replica published for workers that left the registry."""
        return self._watch.removals_published if self._watch is not None else 0

    @property
    def expiry_grace_s(self) -> float:
        """The expiry grace in use: ``--expiry-grace-s``, capped at 2/3 of the registry's TTL."""
        return self._watch.grace_s if self._watch is not None else self.settings.expiry_grace_s

    @property
    def recovery(self) -> dict[str, Any]:
        """How this replica started: snapshot used, skipped ones, start sequence, messages read to ready."""
        return self._replica.recovery if self._replica is not None else {}

    async def run(self) -> None:
        """Catch up with the stream, then serve match queries until `stop()`."""
        s = self.settings
        self._nc = nc = await connect(s.nats_url, name=f"kvmesh-indexer-{self.replica}", **connect_options(s))
        try:
            self.metrics = await IndexerMetrics.open(self)
            await self._run(nc)
        finally:
            if self.metrics is not None:
                await self.metrics.aclose()
            # Always close the connection, even when start-up failed or a task would not stop: a connection
            # left open outlives its event loop (and, in tests, surfaces as an unclosed socket elsewhere).
            await close_quietly(nc)

    async def _run(self, nc: Client) -> None:
        s = self.settings
        js = nc.jetstream()
        name = f"indexer {self.replica}"

        async def step(op: Callable[[], Awaitable[T]], what: str) -> T:
            # Every start-up call rides out timeouts while fresh R3 buckets and streams elect their leaders.
            out = await retry_start(op, what=what, name=name, stop=self._stop)
            if out is None or self._stop.is_set():
                raise _Stopped
            return out

        try:
            await step(
                lambda: _true(wait_for_stream(js, s.stream, stop=self._stop)), f"wait for stream {s.stream}"
            )
            # Buckets as durable as the stream they index (0: the stream's own replica count).
            stream_config = (
                await step(lambda: js.stream_info(s.stream), f"read stream info of {s.stream}")
            ).config
            replicas = s.buckets_replicas or max(1, stream_config.num_replicas or 1)
            self._store = await step(
                lambda: SnapshotStore.open(
                    js,
                    s.snapshot_bucket_name(),
                    memory=s.buckets_memory,
                    max_bytes=s.buckets_max_bytes,
                    replicas=replicas,
                ),
                f"open snapshot bucket {s.snapshot_bucket_name()}",
            )
            lease_kv = await step(
                lambda: open_kv(
                    js,
                    s.lease_bucket_name(),
                    ttl_s=s.lease_ttl_s,
                    memory=s.buckets_memory,
                    replicas=replicas,
                ),
                f"open lease bucket {s.lease_bucket_name()}",
            )
            registry_kv = await step(
                lambda: open_registry(
                    js,
                    RegistrySettings(
                        bucket=s.registry_bucket_name(),
                        ttl_s=s.worker_ttl_s,
                        memory=s.buckets_memory,
                        replicas=replicas,
                    ),
                ),
                f"open registry bucket {s.registry_bucket_name()}",
            )
            info = await step(lambda: js.stream_info(s.stream), f"read stream info of {s.stream}")
            check_retention(s, self.replica, info.config.max_age or 0.0)
            self._replica = replica = StreamReplica(
                js,
                stream=s.stream,
                events_prefix=s.events_prefix,
                store=self._store,
                name=name,
                stop=self._stop,
                on_message=self._schedule.count,
                max_blocks=s.max_blocks,
            )
            self._writer = writer = SnapshotWriter(
                s,
                self.replica,
                js=js,
                store=self._store,
                lease=SnapshotLease(lease_kv, self.replica),
                stream=replica,
                schedule=self._schedule,
                stats=self.snapshots,
                stop=self._stop,
            )
            self._watch = watch = RegistryWatch(
                s, self.replica, js=js, kv=registry_kv, store=self._store, stream=replica, stop=self._stop
            )
            start_seq = await step(lambda: replica.recover(info), f"recover from the snapshots of {s.stream}")
        except _Stopped:
            return
        log.info(
            "indexer %s: reading %s from seq %d (%d messages, last seq %d)",
            self.replica,
            s.stream,
            start_seq,
            info.state.messages,
            info.state.last_seq,
            extra={"replica": self.replica, "stream_seq": start_seq},
        )
        consume = asyncio.create_task(replica.follow(start_seq))
        service = None
        tasks: list[asyncio.Task[None]] = [consume]
        subs: list[Any] = []
        try:
            await replica.wait_caught_up()
            if self._stop.is_set():
                return
            service = await add_service(
                nc,
                ServiceConfig(
                    name="kvmesh-indexer",
                    version=VERSION,
                    description="kvmesh prefix index replica",
                    metadata={"replica": self.replica},
                    queue_group=subjects.INDEXER_QUEUE,
                ),
            )
            m = self.metrics
            match = MatchEndpoint(self.replica, lambda: self.state, m.match_latency if m else None)
            await service.add_endpoint(
                EndpointConfig(name="match", subject=s.match_subject, handler=match.handle)
            )
            subs.append(await nc.subscribe(subjects.STATUS_SUBJECT, cb=status_responder(self.status_message)))
            subs.append(await nc.subscribe(subjects.SNAPSHOT_SUBJECT, cb=writer.on_request))
            # The server must know every subscription before anyone is told we are ready. nats-py writes PING
            # straight to the socket but SUB through its pending buffer, so one flush can overtake the SUB.
            await nc.flush()
            await nc.flush()
            # Whatever the restore allocated is long-lived: keep it out of the cyclic collector's full passes
            # (the index's own maps hold only ints and are not tracked; a pass takes ~1 ms at a million blocks).
            gc.collect()
            gc.freeze()
            self.recovery["read_to_ready"] = self.read_messages
            self.recovery["ready_s"] = round(time.monotonic() - self._started, 3)
            self.ready.set()
            log.info(
                "indexer %s: ready at stream seq %d (%d blocks) after %.2f s, %d messages read",
                self.replica,
                self.state.applied_seq,
                self.state.block_total(),
                time.monotonic() - self._started,
                self.read_messages,
                extra={"replica": self.replica, "stream_seq": self.state.applied_seq},
            )
            await supervise(
                nc,
                {
                    "stream consumer": consume,
                    "snapshot lease": writer.hold_lease(),
                    "snapshot writer": writer.run(),
                    "registry watch": watch.run(),
                }
                | ({"metrics lag watch": m.watch(js)} if m else {}),
                stop=self._stop,
                name=f"indexer {self.replica}",
                stop_grace_s=_STOP_TIMEOUT_S,
                health_file=s.health_file,
            )
        finally:
            self._stop.set()  # background loops check it: nats-py may swallow a cancellation
            for t in tasks:
                t.cancel()
            _, stuck = await asyncio.wait(tasks, timeout=_STOP_TIMEOUT_S)
            if stuck:
                log.warning("indexer %s: %d tasks did not stop in time", self.replica, len(stuck))
            for sub_ in subs:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(sub_.unsubscribe(), _STOP_TIMEOUT_S)
            if self._writer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._writer.lease.release(), _STOP_TIMEOUT_S)
            if service is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(service.stop(), _STOP_TIMEOUT_S)

    def stop(self) -> None:
        """Ask `run()` to finish."""
        self._stop.set()

    async def snapshot(self, *, force: bool = False) -> dict[str, Any]:
        """Write a snapshot now if this replica holds (or can take) the writer lease (`SnapshotWriter.snapshot`).

        Raises:
            RuntimeError: before `run()` has recovered (there is no state to write yet).
        """
        if self._writer is None:
            raise RuntimeError(f"indexer {self.replica}: not started")
        return await self._writer.snapshot(force=force)

    def status(self) -> dict[str, Any]:
        """Return this replica's sequence, size, digest and counters (what `kvmesh status` shows), as a dict."""
        out: dict[str, Any] = msgspec.to_builtins(self.status_message())
        return out

    def status_message(self) -> IndexerStatus:
        """Return this replica's ``kvmesh status`` reply (`kvmesh.core.protocol.IndexerStatus`)."""
        return status_reply(
            replica=self.replica,
            stream=self.settings.stream,
            ready=self.ready.is_set(),
            state=self.state,
            reader=self._replica,
            snapshots=self.snapshots,
            snapshot_writer=self._writer is not None and self._writer.lease.held,
        )
