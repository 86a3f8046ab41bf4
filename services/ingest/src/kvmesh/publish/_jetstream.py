"""`JetStreamPublisher`: an engine's KV events straight to the events stream, as an ingest publishes them.

The engine calls `stored` / `removed` / `cleared`; each call is one engine batch of its rank, numbered from 0
in the publisher's epoch, and goes through the ingest's own machinery: `kvmesh.ingest.batches.Batches`
(wire decode, block checks, local hashes, coalescing, max-payload split), `kvmesh.ingest.publish.Publisher`
(bounded outbox, ordered acks, ``Nats-Msg-Id``, in-order re-sends), `kvmesh.ingest.recovery` (the last
epoch on the rank's subject) and `kvmesh.ingest.registration.Registration` (the worker's registry key).
Nothing here decides what a second implementation could decide differently.

Epochs: a publisher cannot replay what an earlier process published, so every start is a new incarnation:
the epoch is one above the highest found on the worker's subjects, announced by a ``Cleared("restart")``
(by an empty announcement on a worker's first start), and index replicas drop the old incarnation's blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from dataclasses import replace
from types import TracebackType
from typing import Any

from nats.aio.client import Client

from kvmesh.core import protocol, wire
from kvmesh.core.errors import ConfigError
from kvmesh.core.events import Cleared, Event
from kvmesh.core.normalize import Normalizer
from kvmesh.core.protocol import IngestStatus
from kvmesh.core.sequencing import SeqTracker
from kvmesh.ingest.batches import Batches, Rank
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.outbox import Coalescer, MessageIds, Outgoing
from kvmesh.ingest.publish import Publisher
from kvmesh.ingest.recovery import recover_rank
from kvmesh.ingest.registration import Registration
from kvmesh.ingest.status import IngestCounters, ingest_status
from kvmesh.publish._events import EventPublisherBase, check_rank
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import StreamSettings, close_quietly, connect, connect_options, ensure_stream
from kvmesh.runtime.runner import supervise

log = logging.getLogger("kvmesh.publish")

_NO_ENDPOINT = "inproc://kvmesh-publish"
"""The ingest settings' ZMQ endpoint, unused: this publisher reads no engine socket."""


class JetStreamPublisher(EventPublisherBase):
    """Publish one worker's KV events (every data-parallel rank) to the events stream.

    Owns a NATS connection, the outbox and the worker's registry key; does not own the engine's cache (the
    caller reports it) nor any ZMQ socket. Use `open_jetstream`, or construct, `start` and `aclose`; an
    ``async with`` closes it. The event methods are synchronous and never wait for NATS (the outbox keeps
    up to ``max_buffered_batches`` messages; when full the oldest is dropped and its rank cleared in the
    index once NATS is back); call them from the thread running the event loop the publisher was started
    on (from another thread: ``loop.call_soon_threadsafe(pub.stored, ...)``).

    Args:
        settings: the ingest settings that apply (worker, model, ``block_size`` (required),
            ``data_parallel_size``, NATS URL and credentials, stream, subjects, outbox bound, ack window,
            registry TTL); the ZMQ ones are ignored.

    Raises:
        ConfigError: the settings have problems (all listed), or no block size.
    """

    def __init__(self, settings: IngestSettings) -> None:
        s = settings if settings.zmq_endpoint == _NO_ENDPOINT else _without_zmq(settings)
        problems = s.validate()
        if s.block_size is None:
            problems.append("block_size is required (tokens per block of every stored event)")
        if problems:
            raise ConfigError("; ".join(problems))
        self.settings = s
        self.block_size: int = s.block_size  # type: ignore[assignment]  # checked above
        self.counters = IngestCounters()
        self._ranks: dict[int, Rank] = {}
        ids = MessageIds(os.urandom(4).hex())
        self.batches = Batches(s, self.counters, self._ranks, ids, self._push)
        self.publisher = Publisher(s, self.counters, ids, self.batches.overflow_clear)
        self.registration = Registration(s, self._ranks, self._rejoin)
        self._nc: Client | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._status_sub: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._flush_due = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self, *, connect_wait_s: float | None = 10.0) -> None:
        """Connect, make sure the stream exists, choose the epoch, announce every rank, start publishing.

        Args:
            connect_wait_s: give up connecting after this many seconds (None: keep trying).

        Raises:
            kvmesh.core.errors.ConnectError: NATS could not be reached within ``connect_wait_s``.
            kvmesh.core.errors.TransportError: the stream could not be created or read.
        """
        s = self.settings
        self._loop, self._thread = asyncio.get_running_loop(), threading.get_ident()
        self._nc = nc = await connect(
            s.nats_url,
            name=f"kvmesh-publish-{s.worker_id}",
            on_disconnect=self.publisher.on_disconnect,
            wait_s=connect_wait_s,
            **connect_options(s),
        )
        self.batches.max_payload = nc.max_payload or self.batches.max_payload
        js = nc.jetstream()
        self.publisher.nc, self.publisher.js, self.registration.js = nc, js, js
        await ensure_stream(
            js,
            StreamSettings(
                name=s.stream,
                prefix=s.events_prefix,
                replicas=s.stream_replicas,
                memory=s.stream_memory,
                max_bytes=s.stream_max_bytes,
                max_age_s=s.stream_max_age_s,
            ),
        )
        found = False
        epoch = -1
        for r in range(s.data_parallel_size):
            cursor = await recover_rank(
                js,
                stream=s.stream,
                subject=subjects.events_subject(s.events_prefix, s.model, s.worker_id, r),
                who=f"publisher {s.worker_id} rank {r}",
                has_replay=False,
                stop=self._stop,
                on_undecodable=lambda _seq, _exc: None,
            )
            if cursor.found or cursor.resync:
                found = True
                epoch = max(epoch, cursor.tracker.epoch)
        epoch = epoch + 1 if found else 0
        for r in range(s.data_parallel_size):
            self._ranks[r] = rank = Rank(
                r,
                _NO_ENDPOINT,
                None,
                SeqTracker(epoch=epoch, last_seq=None, replay=False),
                Normalizer(block_size=self.block_size),
                Coalescer(s.max_coalesced_batches),
            )
            events: list[Event] = [Cleared("restart")] if found else []
            self.batches.hello(rank, events)
        self._status_sub = await nc.subscribe(f"{subjects.STATUS_SUBJECT}.ingest", cb=self._on_status)
        loops = {"publish loop": self.publisher.run(), "registry heartbeat": self.registration.run()}
        self._task = asyncio.create_task(
            supervise(nc, loops, stop=self._stop, name=f"publisher {s.worker_id}")
        )
        log.info(
            "publisher %s: model %s, %d rank(s), epoch %d, publishing to %s",
            s.worker_id,
            s.model,
            s.data_parallel_size,
            epoch,
            s.stream,
            extra={"worker_id": s.worker_id, "epoch": epoch},
        )

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything published so far is acknowledged by the stream.

        Returns:
            True when nothing is left unacknowledged, False after ``timeout_s`` seconds.
        """
        self._flush()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.publisher.idle:  # the outbox has no "emptied" event: poll it
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Publish what is buffered (for at most ``timeout_s`` seconds), leave the registry, disconnect.

        A publisher stopped this way takes its worker out of every index at once (the registry removal); one
        that dies leaves it until the registry TTL. Calling it again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        self._flush()
        if self._status_sub is not None:
            with contextlib.suppress(Exception):
                await self._status_sub.unsubscribe()
        if self._nc is not None:
            await self.publisher.flush(timeout_s=timeout_s)
            await self.registration.deregister()
            await close_quietly(self._nc)

    async def __aenter__(self) -> JetStreamPublisher:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ events

    @property
    def epoch(self) -> int:
        """This publisher's incarnation (the epoch of every message it publishes)."""
        return self._ranks[0].tracker.epoch if self._ranks else -1

    def status(self) -> IngestStatus:
        """Cursors and counters, as an ingest reports them (what ``kvmesh status`` shows)."""
        return ingest_status(self.settings, self.counters, self.publisher.unacknowledged, self._ranks, {})

    # ------------------------------------------------------------------ internals

    def _check(self, dp_rank: int) -> None:
        if self._closed or not self._ranks:
            raise RuntimeError("the publisher is not started or is closed")
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                "call the publisher from its event loop's thread (loop.call_soon_threadsafe from others)"
            )
        check_rank(dp_rank, self.settings.data_parallel_size)

    def _deliver(self, dp_rank: int, event: wire.KVEvent) -> int:
        rank = self._ranks[dp_rank]
        t = rank.tracker
        seq = 0 if t.last_seq is None else t.last_seq + 1
        t.last_seq = seq
        payload = wire.encode_batch(wire.EngineBatch(ts=time.time(), events=(event,), dp_rank=dp_rank))
        self.batches.deliver(rank, seq, payload)
        if not self._flush_due and self._loop is not None:
            # Calls made in one turn of the loop share a stream message (the ingest's coalescing).
            self._flush_due = True
            self._loop.call_soon(self._flush)
        return seq

    def _flush(self) -> None:
        self._flush_due = False
        for rank in self._ranks.values():
            self.batches.flush(rank)

    def _push(self, out: Outgoing) -> None:
        self.publisher.push(out)

    def _rejoin(self, reason: str) -> None:
        """The registry key vanished (TTL): a new incarnation on every rank, announced by a Cleared."""
        epoch = max((r.tracker.epoch for r in self._ranks.values()), default=0) + 1
        for rank in self._ranks.values():
            rank.tracker.rejoin(epoch)
            self.batches.enqueue_clear(rank, reason)

    async def _on_status(self, msg: Any) -> None:
        if msg.reply:
            await msg.respond(protocol.encode(self.status()))


def _without_zmq(settings: IngestSettings) -> IngestSettings:
    """The settings with the unused ZMQ endpoint set to a placeholder (no replay, no probing)."""
    return replace(settings, zmq_endpoint=_NO_ENDPOINT, replay_endpoint=None, engine_probe_after_s=0.0)


async def open_jetstream(
    *,
    worker_id: str,
    model: str,
    block_size: int,
    nats_url: str | None = None,
    data_parallel_size: int = 1,
    connect_wait_s: float | None = 10.0,
    **options: Any,
) -> JetStreamPublisher:
    """Start a `JetStreamPublisher` (see there) for one worker.

    Args:
        worker_id: the worker's id, as route replies name it.
        model: the model name route requests use.
        block_size: tokens per block of every stored event.
        nats_url: NATS URL (comma-separated list allowed; credentials in it never reach a log); default
            ``nats://127.0.0.1:4222``.
        data_parallel_size: ranks reported through ``dp_rank`` (each its own holder in the index).
        connect_wait_s: give up connecting after this many seconds (None: keep trying).
        **options: any other `kvmesh.ingest.config.IngestSettings` field: ``stream``, ``events_prefix``,
            ``max_buffered_batches`` (outbox bound), ``max_pending_acks``, ``worker_ttl_s``,
            ``nats_user``/``nats_password``/``nats_creds_file``/…, ``stream_memory``, ``stream_max_bytes``.

    Raises:
        ConfigError: bad settings (all problems listed); an unknown option is a TypeError.
        kvmesh.core.errors.ConnectError: NATS unreachable within ``connect_wait_s``.
    """
    kw: dict[str, Any] = {"nats_url": nats_url} if nats_url is not None else {}
    settings = IngestSettings(
        worker_id=worker_id,
        model=model,
        block_size=block_size,
        data_parallel_size=data_parallel_size,
        zmq_endpoint=_NO_ENDPOINT,
        engine_probe_after_s=0.0,
        **kw,
        **options,
    )
    pub = JetStreamPublisher(settings)
    await pub.start(connect_wait_s=connect_wait_s)
    return pub
