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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections import Counter, deque
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import zmq
import zmq.asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext

from kvmesh.core import wire
from kvmesh.core.endpoints import offset_endpoint
from kvmesh.core.errors import WireError
from kvmesh.core.events import Cleared, Event, EventsMessage, Removed, Stored, encode_message
from kvmesh.core.liveness import LivenessChange
from kvmesh.core.normalize import BlockSizeMismatchError, Normalizer
from kvmesh.core.protocol import WorkerRecord
from kvmesh.core.sequencing import (
    Deliver,
    NewEpoch,
    ReplayDone,
    Resync,
    SeqTracker,
    StartReplay,
    StreamOrder,
)
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.liveness import EngineWatch, ProbeTarget
from kvmesh.ingest.recovery import RankCursor, fresh_tracker, recover_rank
from kvmesh.runtime import subjects
from kvmesh.runtime.metrics import MetricsLoadPublisher
from kvmesh.runtime.nats import StreamSettings, close_quietly, connect, ensure_stream
from kvmesh.runtime.registry import RegistrySettings, deregister, heartbeat, key_present, open_registry
from kvmesh.runtime.replica import retry_start

log = logging.getLogger("kvmesh.ingest")

_PAYLOAD_HEADROOM = 4096
_STOP_FLUSH_S = 2.0
"""Seconds a stopping ingest spends publishing what it buffered (the rest is replayed after a restart)."""
_DRAIN_BATCH = 256
_COALESCE_MAX_EVENTS = 1024
"""Events per coalesced stream message before it is cut (the max-payload split still applies after)."""
"""Live messages read without yielding to the event loop before the publisher gets a turn."""
_ACK_TIMEOUT_S = 5.0
"""Seconds to wait for a publish's ack on a live connection before re-sending from it on, in order."""
_SETTLE_S = 2.0
"""Seconds a failed publish waits for the rest of the window's outcome before the unstored are re-sent."""


@dataclass(slots=True)
class _Outgoing:
    subject: str
    msg_id: str
    data: bytes
    holder: tuple[str, int]
    epoch: int = 0
    seq: int = 0
    stored_seq: int | None = None
    """Stream sequence of an earlier send's ack (it is not sent again, only checked in order)."""


@dataclass(slots=True)
class IngestCounters:
    """Counters of one ingest (cumulative), shown by `kvmesh status`."""

    batches: int = 0
    published: int = 0
    publish_retries: int = 0
    decode_errors: int = 0
    rejected_events: int = 0
    dropped_batches: int = 0
    split_batches: int = 0
    bad_dp_rank_batches: int = 0
    """Engine batches whose dp_rank is outside [0, data_parallel_size): their events are rejected."""
    reorders: int = 0
    reordered_resends: int = 0
    """Messages deleted from the stream and sent again after an earlier one that failed (engine order kept)."""
    """Holders found stored out of engine order in the stream (acks not rising), each resynchronised."""
    bad_replay_topics: int = 0
    """Replay replies whose topic is not the configured one (another engine's), ignored."""
    undecodable_stream_messages: int = 0
    """Messages on this worker's subjects that did not decode at start (skipped by cursor recovery)."""


@dataclass(slots=True)
class _Rank:
    """State of one data-parallel rank's subscription."""

    rank: int
    endpoint: str
    replay_endpoint: str | None
    tracker: SeqTracker
    normalizer: Normalizer
    warned_block_size: bool = False
    holder_rank: int = -1
    """dp_rank the engine's batches carry (vLLM data_parallel_rank / SGLang attn_dp_rank); -1 until known."""
    pending: list[Event] = field(default_factory=list)
    """Events of consecutive delivered batches not yet enqueued (coalesced into one stream message)."""
    pending_key: tuple[int, int] | None = None
    """(dp_rank, epoch) of ``pending``."""
    pending_first: int = -1
    pending_last: int = -1
    pending_ts: float = 0.0
    verify: tuple[int, float] | None = None
    """(engine seq, batch ts) of the last batch the stream holds from before this ingest started: the first
    replay asks for it too, and another ts there means the engine restarted while no ingest read it."""
    replay_task: asyncio.Task[None] | None = None
    replay_queue: asyncio.Queue[tuple[str, int, bytes]] = field(default_factory=asyncio.Queue)


class IngestService:
    """One ingest: all data-parallel ranks of one engine, publishing to the events stream."""

    def __init__(self, settings: IngestSettings) -> None:
        self.settings = settings
        self.counters = IngestCounters()
        self._ctx = zmq.asyncio.Context()
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._outbox: deque[_Outgoing] = deque()
        self._outbox_ready = asyncio.Event()
        self._inflight: deque[tuple[_Outgoing, asyncio.Future[Any], float]] = deque()
        """Published, awaiting the ack: (message, ack future, loop time sent)."""
        self._connections = 0
        """Connections lost so far: in-flight messages of an earlier connection are re-sent."""
        self._queued: Counter[tuple[str, int]] = Counter()
        """Outbox messages per holder (worker, dp_rank)."""
        self._overflowed: dict[tuple[str, int], tuple[int, int]] = {}
        """Holders whose oldest batches were dropped → (epoch, seq) of the last dropped; cleared lazily."""
        self._ranks: dict[int, _Rank] = {}
        self._order = StreamOrder()
        """Checks each holder's publish acks rise in engine order (an inversion is repaired)."""
        self._stop = asyncio.Event()
        self._clear_serial = 0
        self._nonce = os.urandom(4).hex()
        self._max_payload = 1024 * 1024
        self._registry_kv: Any = None
        self._rejoined = False
        """True when this ingest started a new incarnation because its worker had been removed."""
        self._rank_verify: dict[int, tuple[int, float]] = {}
        """Rank → (engine seq, batch ts) of the last batch in the stream, checked against the engine's replay."""
        self._stream_replicas = settings.stream_replicas
        """Replicas of the events stream as it exists (what the registry bucket is created with)."""
        self._watch: EngineWatch | None = None
        """Engine liveness per rank (None with probing off)."""
        self._repairs: list[tuple[_Outgoing, int]] = []
        """Messages whose ack showed them stored before an earlier one of their holder (to delete, re-send)."""
        self._serial = 0
        """Messages still to publish one at a time after a failure or a repair."""
        self._beat_now = asyncio.Event()
        """Set to send a heartbeat at once (an engine rank changed liveness)."""
        self._left_for_dead = False
        """True while every engine rank is gone and this ingest took the worker out of the registry."""
        self._rejoined_live = False
        """The engine came back and this ingest rejoined: the next heartbeat puts the key it had deleted."""
        self.ready = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Connect, recover cursors, then read every rank and publish until `stop()`."""
        s = self.settings
        self._nc = await connect(
            s.nats_url, name=f"kvmesh-ingest-{s.worker_id}", on_disconnect=self._on_disconnect
        )
        self._max_payload = self._nc.max_payload or self._max_payload
        self._js = js = self._nc.jetstream()
        name = f"ingest {s.worker_id}"
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
        if (
            await retry_start(
                lambda: _true(ensure_stream(js, settings)),
                what=f"ensure stream {s.stream}",
                name=name,
                stop=self._stop,
            )
            is None
        ):
            await close_quietly(self._nc)
            self._ctx.destroy(linger=0)
            return
        with contextlib.suppress(Exception):  # the registry gets the stream's replica count (3 on a cluster)
            info = await self._js.stream_info(s.stream)
            self._stream_replicas = info.config.num_replicas or s.stream_replicas
        status_sub = await self._nc.subscribe(f"{subjects.STATUS_SUBJECT}.ingest", cb=self._on_status)
        recovered = {
            r: await self._recover(r, s.replay_endpoint is not None) for r in range(s.data_parallel_size)
        }
        trackers = {r: c.tracker for r, c in recovered.items()}
        resync = {r for r, c in recovered.items() if c.resync}
        if any(c.found for c in recovered.values()) and not await self._still_registered():
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
            trackers = {r: fresh_tracker(s.replay_endpoint is not None, epoch) for r in trackers}
            self._rank_verify.clear()
            resync.clear()
            self._rejoined = True
        for r, tracker in trackers.items():
            endpoint = offset_endpoint(s.zmq_endpoint, r)
            replay = offset_endpoint(s.replay_endpoint, r) if s.replay_endpoint else None
            self._ranks[r] = _Rank(r, endpoint, replay, tracker, Normalizer(block_size=s.block_size))
            self._ranks[r].verify = self._rank_verify.get(r)
            # Announce the rank so routers see the worker before it caches anything (a rejoin clears it).
            # A rank whose subject held nothing decodable is resynchronised by its announcement.
            events: list[Event] = [Cleared("rejoin")] if self._rejoined else []
            if r in resync:
                events = [Cleared("resync")]
            self._enqueue_events(
                r, tracker.epoch, _cursor(tracker), events, msg_id=self._unique_id(r, tracker, "hello")
            )
        tasks = [asyncio.create_task(self._read_rank(rank)) for rank in self._ranks.values()]
        tasks.append(asyncio.create_task(self._publish_loop()))
        tasks.append(asyncio.create_task(self._heartbeat_loop()))
        if s.engine_probe_after_s > 0:
            self._watch = EngineWatch(
                self._ctx,
                worker_id=s.worker_id,
                targets={
                    r.rank: ProbeTarget(r.replay_endpoint, None if r.replay_endpoint else s.health_url)
                    for r in self._ranks.values()
                },
                policy=s.liveness_policy(),
                probe_timeout_s=s.engine_probe_timeout_s,
                on_change=self._on_engine_change,
            )
            tasks.append(asyncio.create_task(self._watch.run()))
        if s.metrics_url:  # engine load for the routers (vLLM's Prometheus page)
            scraper = MetricsLoadPublisher(self._nc, url=s.metrics_url, worker_id=s.worker_id)
            tasks.append(asyncio.create_task(scraper.run()))
        self.ready.set()
        log.info(
            "ingest %s: model %s, %d rank(s) from %s, replay %s, publishing to %s",
            s.worker_id,
            s.model,
            s.data_parallel_size,
            s.zmq_endpoint,
            s.replay_endpoint or "off",
            s.stream,
        )
        try:
            await self._stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            for rank in self._ranks.values():
                if rank.replay_task is not None:
                    rank.replay_task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for rank in self._ranks.values():
                self._flush_pending(rank)
            with contextlib.suppress(Exception):
                await status_sub.unsubscribe()
            await self._flush(timeout_s=_STOP_FLUSH_S)
            if self._outbox or self._inflight:
                log.warning(
                    "worker %s: stopping with %d batch(es) unpublished and %d unacknowledged; a restarted "
                    "ingest replays them from the engine",
                    self.settings.worker_id,
                    len(self._outbox),
                    len(self._inflight),
                )
            if self._stop.is_set():  # a clean stop: leave the registry now rather than at the TTL
                await self._deregister()
            await close_quietly(self._nc)
            self._ctx.destroy(linger=0)

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
            stop=self._stop,
            on_undecodable=undecodable,
        )
        if cursor.verify is not None:
            self._rank_verify[rank] = cursor.verify
        return cursor

    # ------------------------------------------------------------------ ZMQ side

    async def _read_rank(self, rank: _Rank) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.settings.topic.encode())
        sock.connect(rank.endpoint)
        # A synchronous view of the same socket: after each awaited message, what is already queued is read
        # without an awaitable per message (zmq.asyncio's per-recv future was a third of the ingest's time).
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        try:
            while True:
                frames = await sock.recv_multipart()
                if (
                    self._watch is not None
                ):  # first: an engine back from gone rejoins before its batch applies
                    self._watch.heard(rank.rank)
                self._on_frames(rank, frames)
                for _ in range(_DRAIN_BATCH):
                    try:
                        frames = raw.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frames(rank, frames)
                # What one burst delivered for this rank becomes one stream message.
                self._flush_pending(rank)
        finally:
            sock.close(linger=0)

    def _on_frames(self, rank: _Rank, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.counters.decode_errors += 1
            log.warning(
                "worker %s rank %d: live message with %d frames (want 3), dropped",
                self.settings.worker_id,
                rank.rank,
                len(frames),
            )
            return
        try:
            seq = wire.decode_seq(frames[1])
        except WireError as exc:
            self.counters.decode_errors += 1
            log.warning(
                "worker %s rank %d: live message dropped: %s", self.settings.worker_id, rank.rank, exc
            )
            return
        try:
            self._act(rank, rank.tracker.on_live(seq, frames[2]), flush=False)
        except Exception:
            # Never let one message stop the reader (the engine would go unread for good).
            self.counters.decode_errors += 1
            log.exception(
                "worker %s rank %d seq %d: message failed; dropped", self.settings.worker_id, rank.rank, seq
            )

    def _act(self, rank: _Rank, actions: list[Any], *, flush: bool = True) -> None:
        """Carry out the tracker's actions; ``flush=False`` lets deliveries coalesce until `_flush_pending`."""
        self._do_actions(rank, actions)
        if flush:
            self._flush_pending(rank)

    def _do_actions(self, rank: _Rank, actions: list[Any]) -> None:
        s = self.settings
        for a in actions:
            if isinstance(a, Deliver):
                self._deliver(rank, a.seq, a.payload)
            elif isinstance(a, StartReplay):
                log.warning(
                    "worker %s rank %d: sequence gap before seq %d (last %s); replaying from %d",
                    s.worker_id,
                    rank.rank,
                    rank.tracker.gap_end,
                    rank.tracker.last_seq,
                    a.from_seq,
                )
                if rank.replay_endpoint is not None:
                    # A replay the tracker abandoned (engine restart, overflow) may still be waiting on its
                    # socket; left running, its timeout or END would end this new replay early (the
                    # tracker cannot tell the two apart) and its task would be orphaned.
                    if rank.replay_task is not None and not rank.replay_task.done():
                        rank.replay_task.cancel()
                    rank.replay_task = asyncio.create_task(self._replay(rank, a.from_seq))
            elif isinstance(a, Resync):
                log.warning(
                    "worker %s rank %d: resynchronising after seq %s (%s): clearing its index entries",
                    s.worker_id,
                    rank.rank,
                    a.after_seq,
                    a.reason,
                )
                self._enqueue_clear(rank, a.reason, seq=-1 if a.after_seq is None else a.after_seq)
            elif isinstance(a, NewEpoch):
                log.warning(
                    "worker %s rank %d: engine restarted (seq %d); epoch %d, clearing its index entries",
                    s.worker_id,
                    rank.rank,
                    a.first_seq,
                    a.epoch,
                )
                self._enqueue_clear(rank, "restart", seq=a.first_seq - 1)
            elif isinstance(a, ReplayDone):
                log.info("worker %s rank %d: replay done (healed=%s)", s.worker_id, rank.rank, a.healed)

    async def _replay(self, rank: _Rank, from_seq: int) -> None:
        """Ask the engine's replay ROUTER for batches from ``from_seq`` and feed them to the tracker."""
        assert rank.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(rank.replay_endpoint)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.replay_timeout_s
        topic = self.settings.topic.encode()
        verify, rank.verify = rank.verify, None
        if verify is not None and verify[0] != from_seq - 1:
            verify = None
        try:
            await sock.send_multipart(wire.encode_replay_request(from_seq if verify is None else verify[0]))
            while rank.tracker.replaying:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await sock.poll(timeout=remaining * 1000):
                    self._act(rank, rank.tracker.on_replay_end("replay_timeout"))
                    return
                frames = await sock.recv_multipart()
                if self._watch is not None:
                    self._watch.heard(rank.rank)
                try:
                    reply = wire.decode_replay_reply(frames)
                except WireError as exc:
                    log.warning(
                        "worker %s rank %d: bad replay reply: %s", self.settings.worker_id, rank.rank, exc
                    )
                    continue
                if reply.is_end:
                    self._act(rank, rank.tracker.on_replay_end("replay_incomplete"))
                    return
                if reply.topic is not None and not reply.topic.startswith(topic):
                    # Not this engine's (the live SUB filters by the same prefix): another engine behind
                    # the replay endpoint. Its batches would be taken for ours.
                    self.counters.bad_replay_topics += 1
                    log.error(
                        "worker %s rank %d: replay reply seq %d has topic %r, not the configured %r; ignored",
                        self.settings.worker_id,
                        rank.rank,
                        reply.seq,
                        reply.topic[:64],
                        topic,
                    )
                    continue
                if verify is not None:
                    check, verify = verify, None
                    if reply.seq == check[0]:
                        ts = _batch_ts(reply.payload)
                        if ts == check[1]:
                            continue  # the batch the stream already holds: the same engine incarnation
                        log.warning(
                            "worker %s rank %d: the engine's seq %d has ts %s, the stream's has %s: the engine "
                            "restarted while no ingest read it; new epoch, replaying from 0",
                            self.settings.worker_id,
                            rank.rank,
                            check[0],
                            ts,
                            check[1],
                        )
                        self._act(rank, rank.tracker.on_engine_restarted())
                        return
                self._act(rank, rank.tracker.on_replay(reply.seq, reply.payload))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("worker %s rank %d: replay failed", self.settings.worker_id, rank.rank)
            self._act(rank, rank.tracker.on_replay_end("replay_error"))
        finally:
            sock.close(linger=0)

    def _deliver(self, rank: _Rank, seq: int, payload: bytes) -> None:
        s = self.settings
        self.counters.batches += 1
        try:
            batch = wire.decode_batch(payload)
        except WireError as exc:
            self.counters.decode_errors += 1
            log.warning(
                "worker %s rank %d seq %d: undecodable batch dropped: %s", s.worker_id, rank.rank, seq, exc
            )
            self._enqueue_clear(rank, "malformed")
            return
        dp_rank = batch.dp_rank if batch.dp_rank is not None else rank.rank
        if not 0 <= dp_rank < s.data_parallel_size:
            # Not a rank this ingest reads (vLLM and SGLang stamp rank r on the publisher of port + r): a
            # new holder and subject per bad value would be invented. The events go, nothing else does.
            self.counters.bad_dp_rank_batches += 1
            self.counters.rejected_events += len(batch.events)
            log.error(
                "worker %s endpoint rank %d seq %d: batch carries dp_rank %d outside [0, %d); its %d "
                "event(s) rejected",
                s.worker_id,
                rank.rank,
                seq,
                dp_rank,
                s.data_parallel_size,
                len(batch.events),
            )
            # The seq is still this endpoint's: cover it with no events, so its holder's engine sequence
            # in the stream has no gap (the index would flag one).
            holder = rank.holder_rank if rank.holder_rank >= 0 else rank.rank
            self._append_pending(rank, holder, seq, [], batch.ts)
            return
        result = rank.normalizer.normalize(batch)
        for err in batch.errors:
            self.counters.decode_errors += 1
            log.warning(
                "worker %s rank %d seq %d: malformed event dropped: %s", s.worker_id, rank.rank, seq, err
            )
        for rej in result.rejections:
            self.counters.rejected_events += 1
            if isinstance(rej, BlockSizeMismatchError):
                if not rank.warned_block_size:
                    rank.warned_block_size = True
                    log.error(
                        "worker %s rank %d seq %d: events have block size %d but %d is expected; "
                        "rejecting them (set --block-size to the engine's block size)",
                        s.worker_id,
                        rank.rank,
                        seq,
                        rej.got,
                        rej.expected,
                    )
            else:
                log.warning("worker %s rank %d seq %d: event rejected: %s", s.worker_id, rank.rank, seq, rej)
        if batch.unknown_events:
            log.info(
                "worker %s rank %d seq %d: %d unknown event(s) skipped",
                s.worker_id,
                rank.rank,
                seq,
                batch.unknown_events,
            )
        if dp_rank != rank.holder_rank and rank.holder_rank >= 0:
            log.warning(
                "worker %s endpoint rank %d seq %d: batches now carry dp_rank %d (was %d)",
                s.worker_id,
                rank.rank,
                seq,
                dp_rank,
                rank.holder_rank,
            )
        rank.holder_rank = dp_rank
        self._append_pending(rank, dp_rank, seq, result.events, batch.ts)
        if result.lost:
            self._enqueue_clear(rank, "malformed")

    def _append_pending(self, rank: _Rank, dp_rank: int, seq: int, events: list[Event], ts: float) -> None:
        """Add one delivered batch's events to the rank's coalesced message (flushing it first when full)."""
        key = (dp_rank, rank.tracker.epoch)
        if (
            rank.pending_key != key
            or len(rank.pending) >= _COALESCE_MAX_EVENTS
            or (
                rank.pending_key is not None
                and seq - rank.pending_first >= self.settings.max_coalesced_batches
            )
        ):
            self._flush_pending(rank)
        if rank.pending_key is None:
            rank.pending_key = key
            rank.pending_first = seq
        rank.pending.extend(events)
        rank.pending_last = seq
        rank.pending_ts = ts

    def _flush_pending(self, rank: _Rank) -> None:
        """Enqueue the coalesced batches of a rank as one stream message (in order, before anything newer)."""
        if rank.pending_key is None:
            return
        dp_rank, epoch = rank.pending_key
        events, first, last = rank.pending, rank.pending_first, rank.pending_last
        rank.pending, rank.pending_key = [], None
        self._enqueue_events(dp_rank, epoch, last, events, ts=rank.pending_ts, first_seq=first)

    # ------------------------------------------------------------------ NATS side

    def _unique_id(self, rank: int, tracker: SeqTracker, kind: str) -> str:
        self._clear_serial += 1
        return f"{self.settings.worker_id}:{rank}:{tracker.epoch}:{tracker.last_seq}:{kind}:{self._nonce}:{self._clear_serial}"

    def _enqueue_clear(self, rank: _Rank, reason: str, *, seq: int | None = None) -> None:
        """Enqueue a Cleared for the rank's holder after what is pending.

        ``seq`` is the engine seq the clear records (default the tracker's cursor); a resync passes the
        last batch delivered before the loss, so the holder's seqs in the stream never go back.
        """
        self._flush_pending(rank)
        t = rank.tracker
        holder = rank.holder_rank if rank.holder_rank >= 0 else rank.rank
        at = _cursor(t) if seq is None else seq
        self._enqueue_events(
            holder, t.epoch, at, [Cleared(reason)], msg_id=self._unique_id(holder, t, reason)
        )

    def _enqueue_events(
        self,
        dp_rank: int,
        epoch: int,
        seq: int,
        events: list[Event],
        *,
        ts: float = 0.0,
        msg_id: str | None = None,
        first_seq: int | None = None,
    ) -> None:
        s = self.settings
        subject = subjects.events_subject(s.events_prefix, s.model, s.worker_id, dp_rank)
        # The nonce makes ids unique per ingest process: a re-used worker id (another model, a restart
        # within the duplicate window) never collides with what an earlier incarnation published.
        base_id = msg_id or f"{s.worker_id}:{dp_rank}:{epoch}:{seq}:{self._nonce}"
        block_size = self._block_size(dp_rank)
        msg = EventsMessage(
            worker_id=s.worker_id,
            dp_rank=dp_rank,
            model=s.model,
            block_size=block_size,
            epoch=epoch,
            seq=seq,
            first_seq=first_seq if first_seq is not None and first_seq != seq else None,
            ts=ts,
            events=events,
        )
        data = encode_message(msg)
        limit = self._max_payload - _PAYLOAD_HEADROOM
        holder = (s.worker_id, dp_rank)
        if len(data) <= limit:
            self._push(_Outgoing(subject, base_id, data, holder, epoch, seq))
            return
        self.counters.split_batches += 1
        parts = _split_events(events, math.ceil(len(data) / limit) + 1)
        for i, part in enumerate(parts):
            pm = msgspec.structs.replace(msg, part=i, events=part)
            self._push(_Outgoing(subject, f"{base_id}:{i}", encode_message(pm), holder, epoch, seq))

    def _block_size(self, dp_rank: int) -> int:
        rank = self._ranks.get(dp_rank)
        if rank is not None and rank.normalizer.block_size is not None:
            return rank.normalizer.block_size
        return self.settings.block_size or 0

    def _push(self, out: _Outgoing) -> None:
        """Append to the outbox; when it is full, drop the oldest batch and mark its holder for a resync.

        The clear that resynchronises a holder is not queued here (it would take a slot and need its own
        drop rule): `_next_outgoing` emits one right before the holder's next message, or at once when none
        of its messages is left, so any number of drops of one holder costs one clear.
        """
        while len(self._outbox) >= self.settings.max_buffered_batches:
            dropped = self._outbox.popleft()
            self._queued[dropped.holder] -= 1
            self.counters.dropped_batches += 1
            if dropped.holder not in self._overflowed:
                log.error(
                    "worker %s: outbox full (%d batches, NATS unreachable?); dropping the oldest (%s) and "
                    "resynchronising dp rank %d",
                    self.settings.worker_id,
                    self.settings.max_buffered_batches,
                    dropped.msg_id,
                    dropped.holder[1],
                )
            self._overflowed[dropped.holder] = (dropped.epoch, dropped.seq)
        self._outbox.append(out)
        self._queued[out.holder] += 1
        self._outbox_ready.set()

    def _next_outgoing(self) -> _Outgoing | None:
        """Return the next message to publish (leaving it in the outbox), emitting due overflow clears first."""
        for holder, (epoch, seq) in list(self._overflowed.items()):
            if self._queued[holder] == 0 or (self._outbox and self._outbox[0].holder == holder):
                del self._overflowed[holder]
                s = self.settings
                clear = EventsMessage(
                    worker_id=holder[0],
                    dp_rank=holder[1],
                    model=s.model,
                    block_size=self._block_size(holder[1]),
                    epoch=epoch,
                    seq=seq,
                    events=[Cleared("overflow")],
                )
                self._clear_serial += 1
                msg_id = f"{holder[0]}:{holder[1]}:{epoch}:{seq}:overflow:{self._nonce}:{self._clear_serial}"
                subject = subjects.events_subject(s.events_prefix, s.model, holder[0], holder[1])
                self._outbox.appendleft(_Outgoing(subject, msg_id, encode_message(clear), holder, epoch, seq))
                self._queued[holder] += 1
                break
        return self._outbox[0] if self._outbox else None

    async def _on_disconnect(self) -> None:
        """Take our unsent publishes out of the client's reconnect buffer.

        nats-py re-sends what it buffered as soon as it reconnects, before we learn of it; those would land
        ahead of the in-flight messages the dead connection lost, out of order. The publish loop re-sends
        everything unacknowledged itself, in order (the server drops what did land by its Nats-Msg-Id).
        """
        self._connections += 1
        nc, js = self._nc, self._js
        prefix = getattr(js, "_async_reply_prefix", None)
        if nc is None or not prefix:
            return
        marker = b" " + bytes(prefix)
        pending: list[bytes] = nc._pending  # private: nats-py has no way to withdraw buffered publishes
        keep = [
            c for c in pending if not (c.startswith((b"HPUB ", b"PUB ")) and marker in c[: c.find(b"\r\n")])
        ]
        if len(keep) != len(pending):
            log.info(
                "worker %s: withdrew %d buffered publish(es) to re-send in order",
                self.settings.worker_id,
                len(pending) - len(keep),
            )
            nc._pending = keep
            nc._pending_data_size = sum(len(c) for c in keep)

    def _requeue_inflight(self) -> None:
        """Put every message of the window back at the front of the outbox, in order.

        Those already acknowledged keep their stream sequence (`_Outgoing.stored_seq`): they are not sent
        again, only taken in order, so the ack check (`StreamOrder`) sees every holder's stream sequences.
        """
        inflight = self._inflight
        # Sent again one at a time: each outcome known before the next (see `_repair_overtaken`).
        self._serial = max(self._serial, len(inflight))
        while inflight:
            out, fut, _ = inflight.pop()
            stored = _ack_seq(fut)
            if stored is not None:
                out.stored_seq = stored
            else:
                fut.cancel()  # frees nats-py's pending-ack slot; a late ack is ignored
                self.counters.publish_retries += 1
            self._outbox.appendleft(out)
            self._queued[out.holder] += 1

    async def _settle_window(self) -> None:
        """After a failed publish, wait (at most `_SETTLE_S`) for the outcome of the rest of the window, so
        what was stored is known and only the rest is sent again."""
        pending = [fut for _, fut, _ in self._inflight if not fut.done()]
        if pending:
            await asyncio.wait(pending, timeout=_SETTLE_S)

    async def _unstore_overtakers(self) -> None:
        """Keep each holder's stream order equal to engine order after a failed publish.

        A message of the window that failed (a publish lost in a stream leader election) is sent again after
        the rest; any later message of the same holder that was stored meanwhile would then sit before it in
        the stream. Those are deleted from the stream and sent again after it (under a new message id, or the
        server would drop them as duplicates). Index replicas that read them before the delete hold them and
        ignore the copies as repeats, so no replica ever applies them out of order either. A delete that
        fails leaves the message where it is; the replicas' hold still applies it in engine order.
        """
        assert self._js is not None
        failed: set[tuple[str, int]] = set()
        loop = asyncio.get_running_loop()
        for i, (out, fut, sent) in enumerate(self._inflight):
            stored = _ack_seq(fut)
            if stored is None:
                failed.add(out.holder)
                continue
            if out.holder not in failed or not await self._unstore(out, stored):
                continue
            log.warning(
                "worker %s dp_rank %d: engine seq %d was stored (stream seq %d) before an earlier one that "
                "failed; deleted, re-sending it after",
                out.holder[0],
                out.holder[1],
                out.seq,
                stored,
            )
            unsent: asyncio.Future[Any] = loop.create_future()
            unsent.cancel()  # `_requeue_inflight` sends it again
            self._inflight[i] = (out, unsent, sent)

    async def _unstore(self, out: _Outgoing, stored: int) -> bool:
        """Delete ``out`` (stored at stream seq ``stored``) so it can be sent again in order, under a new
        message id; False (logged) when the delete failed and it stays where it is."""
        try:
            await self._delete_stored(stored)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning(
                "worker %s dp_rank %d: could not delete engine seq %d (stream seq %d) to re-send it in "
                "order (%r); index replicas will apply it in engine order",
                out.holder[0],
                out.holder[1],
                out.seq,
                stored,
                exc,
            )
            return False
        self.counters.reordered_resends += 1
        self._clear_serial += 1
        out.msg_id = f"{out.msg_id}:again{self._clear_serial}"
        return True

    async def _repair_overtaken(self) -> None:
        """Put messages whose ack showed them stored before an earlier one of their holder back in order.

        Each is deleted from the stream and sent again with a new message id; what is still in the window
        goes back behind them, and all of it is then sent one message at a time (`_serial`), so every
        outcome is known before the next send and the repair converges.
        """
        repairs, self._repairs = self._repairs, []
        await self._settle_window()
        await self._unstore_overtakers()
        waiting = len(self._inflight)
        self._requeue_inflight()
        for out, stored in reversed(repairs):
            if not await self._unstore(out, stored):
                self.counters.published += 1  # it stays where it is
                continue
            out.stored_seq = None
            self._outbox.appendleft(out)
            self._queued[out.holder] += 1
        self._serial = max(self._serial, len(repairs) + waiting)

    async def _delete_stored(self, stream_seq: int) -> None:
        """Delete one message from the events stream, riding out a leader election (about 8 s at most).

        Raises:
            TimeoutError, nats.errors.Error: it could not be deleted.
        """
        assert self._js is not None
        pause = 0.25
        for attempt in range(5):
            try:
                await self._js.delete_msg(self.settings.stream, stream_seq)
                return
            except nats.js.errors.NotFoundError:
                return  # already gone (a delete whose answer was lost, aged out, purged)
            except (TimeoutError, nats.errors.Error):
                if attempt == 4 or self._nc is None or self._nc.is_closed:
                    raise
            await asyncio.sleep(pause)
            pause *= 2

    async def _publish_loop(self) -> None:
        """Publish the outbox in order with a bounded window of outstanding acks; retry in order on failure.

        Nothing is handed to the client while it is disconnected (it would buffer it and send it ahead of
        the messages the dead connection lost): on a disconnect, or an ack that fails or does not come
        within `_ACK_TIMEOUT_S`, every unacknowledged message goes back to the front of the outbox and is
        re-sent, in order, once connected; ``Nats-Msg-Id`` makes the server drop those that had landed.
        Waiting for an ack never holds back a new batch while the window has room.
        """
        assert self._js is not None and self._nc is not None
        js, nc = self._js, self._nc
        loop = asyncio.get_running_loop()
        window = self.settings.max_pending_acks
        inflight = self._inflight
        backoff = 0.1
        connection = self._connections
        try:
            while True:
                if not nc.is_connected or connection != self._connections:
                    # A reconnect can be quicker than this loop: the connection count tells it happened.
                    while not nc.is_connected and not nc.is_closed:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                    if nc.is_closed:
                        return
                    # The acks that did come tell what was stored: keep engine order before re-sending.
                    await self._unstore_overtakers()
                    self._requeue_inflight()
                    connection = self._connections
                    continue
                failed = self._take_acks(loop.time())
                if self._repairs and not failed and nc.is_connected:
                    await self._repair_overtaken()
                    continue
                while (
                    not failed
                    and len(inflight) < (1 if self._serial else window)
                    and nc.is_connected
                    and connection == self._connections
                ):
                    out = self._next_outgoing()
                    if out is None:
                        break
                    if out.stored_seq is not None:  # stored by an earlier send: only its ack is taken
                        self._outbox.popleft()
                        self._queued[out.holder] -= 1
                        done: asyncio.Future[Any] = loop.create_future()
                        done.set_result(out.stored_seq)
                        inflight.append((out, done, loop.time()))
                        continue
                    try:
                        fut = await js.publish_async(
                            out.subject, out.data, headers={"Nats-Msg-Id": out.msg_id}, wait_stall=5.0
                        )
                    except nats.errors.MaxPayloadError as exc:
                        # Permanent: retrying would block every later batch. Drop it and resynchronise.
                        self._outbox.popleft()
                        self._queued[out.holder] -= 1
                        self.counters.dropped_batches += 1
                        self._overflowed[out.holder] = (out.epoch, out.seq)
                        log.error(
                            "worker %s: message %s of %d bytes exceeds the server's max payload (%r); dropped, "
                            "resynchronising dp rank %d",
                            self.settings.worker_id,
                            out.msg_id,
                            len(out.data),
                            exc,
                            out.holder[1],
                        )
                        continue
                    except (TimeoutError, nats.errors.Error, OSError) as exc:
                        log.debug("publish of %s failed: %r", out.msg_id, exc)
                        failed = True
                        break
                    self._outbox.popleft()
                    self._queued[out.holder] -= 1
                    inflight.append((out, fut, loop.time()))
                if failed:
                    if nc.is_connected:
                        await self._settle_window()
                        await self._unstore_overtakers()
                        self._requeue_inflight()
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, 2.0)
                    continue
                if inflight and inflight[0][1].done():
                    backoff = 0.1
                    continue
                if not inflight and not self._outbox and not self._overflowed:
                    self._outbox_ready.clear()
                    await self._outbox_ready.wait()
                    continue
                # Wait for the oldest ack, or (window permitting) a new batch; wake up now and then to
                # notice a lost connection or an ack that is overdue.
                waits: list[asyncio.Future[Any]] = [inflight[0][1]] if inflight else []
                ready: asyncio.Task[Any] | None = None
                if len(inflight) < window and nc.is_connected:
                    self._outbox_ready.clear()
                    ready = asyncio.create_task(self._outbox_ready.wait())
                    waits.append(ready)
                await asyncio.wait(waits, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
                if ready is not None:
                    ready.cancel()
        finally:
            self._requeue_inflight()

    def _take_acks(self, now: float) -> bool:
        """Count the acknowledged messages at the front of the window; return True if one failed or is overdue."""
        inflight = self._inflight
        while inflight and inflight[0][1].done():
            out, fut, _ = inflight[0]
            exc = None if fut.cancelled() else fut.exception()
            if fut.cancelled() or exc is not None:
                log.warning(
                    "worker %s: publish of %s failed (%r); retrying in order",
                    self.settings.worker_id,
                    out.msg_id,
                    exc,
                )
                return True
            inflight.popleft()
            if self._serial:
                self._serial -= 1
            stream_seq = _ack_seq(fut)
            if stream_seq is not None:
                top = self._order.high.get(out.holder)
                if top is not None and stream_seq < top[2]:
                    # Stored before an earlier message of its holder: delete it and send it again after.
                    self._check_order(out, stream_seq)
                    self._repairs.append((out, stream_seq))
                    continue
                self._check_order(out, stream_seq)
            self.counters.published += 1
        if inflight and now - inflight[0][2] > _ACK_TIMEOUT_S:
            log.warning(
                "worker %s: publish of %s not acknowledged in %.0f s; retrying in order",
                self.settings.worker_id,
                inflight[0][0].msg_id,
                _ACK_TIMEOUT_S,
            )
            return True
        return False

    def _check_order(self, out: _Outgoing, stream_seq: int) -> None:
        """Check a holder's acks rise in engine order; count and log an inversion.

        An inversion means a message was stored after later ones of its holder (a publish failed, e.g.
        during a stream leader election, while later ones landed; it was then re-sent). Every index replica
        holds the holder's later messages until the late one arrives and applies them in engine order
        (`kvmesh.core.state`), so nothing is cleared here: a clear would throw away the exact state the
        replicas rebuild, and the engine's cache would stay under-counted until it stores its blocks again.
        """
        inv = self._order.on_ack(out.holder, out.epoch, out.seq, stream_seq)
        if inv is None:
            return
        self.counters.reorders += 1
        worker, dp_rank = out.holder
        log.warning(
            "worker %s dp_rank %d: stream stored epoch %d engine seq %d at stream seq %d, after epoch %d engine "
            "seq %d at stream seq %d (a failed publish re-sent); index replicas apply them in engine order",
            worker,
            dp_rank,
            inv.earlier[0],
            inv.earlier[1],
            inv.earlier[2],
            inv.later[0],
            inv.later[1],
            inv.later[2],
        )

    async def _flush(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        task = asyncio.create_task(self._publish_loop())
        # The outbox is a plain deque with no "emptied" event; poll it for at most `timeout_s`.
        while (self._outbox or self._inflight or self._overflowed) and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    # ------------------------------------------------------------------ registry

    async def _open_registry(self) -> Any:
        """Open (creating when missing, with the stream's replica count) the registry bucket."""
        assert self._js is not None
        s = self.settings
        return await open_registry(
            self._js,
            RegistrySettings(
                bucket=s.registry_bucket or subjects.registry_bucket(s.stream),
                ttl_s=s.worker_ttl_s,
                memory=s.stream_memory,
                replicas=self._stream_replicas,
            ),
        )

    async def _heartbeat_loop(self) -> None:
        """Keep this worker's registry key alive (every TTL/3). If the key vanished while we were away (TTL
        expired: the worker was removed from the index), start a new incarnation on every rank so the
        worker's later events are not dropped as the removed incarnation's.

        The liveness check is a direct get of the own key (`key_present`): it creates no consumer, and only
        a definite "no such key / deleted / aged out" counts as gone; a timeout or an unreadable bucket
        leaves the worker as it is.
        """
        s = self.settings
        registered = False
        kv = self._registry_kv
        while True:
            try:
                if kv is None:
                    kv = self._registry_kv = await self._open_registry()
                if self._watch is not None and self._watch.all_gone():
                    if not self._left_for_dead:
                        # Routes to it would fail: leave now (watchers publish the removal) and rejoin as a
                        # new incarnation once the engine answers again.
                        self._left_for_dead = True
                        log.error(
                            "worker %s: every engine rank is gone; leaving the registry until it answers",
                            s.worker_id,
                        )
                        await deregister(kv, s.worker_id)
                    await self._wait_beat()
                    continue
                if self._rejoined_live:
                    self._rejoined_live = False  # the key is missing because we deleted it: put it again
                elif registered and not await self._key_present_or_unknown(kv):
                    log.warning(
                        "worker %s: registry entry expired; rejoining as a new incarnation", s.worker_id
                    )
                    self._rejoin("rejoin")
                epochs = [r.tracker.epoch for r in self._ranks.values()]
                await heartbeat(
                    kv,
                    WorkerRecord(
                        worker_id=s.worker_id,
                        model=s.model,
                        dp_ranks=s.data_parallel_size,
                        block_size=s.block_size,
                        incarnation=max(epochs, default=0),
                        heartbeat_ts=time.time(),
                        stale_ranks=self._stale_ranks(),
                    ),
                )
                registered = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Open (re-creating if needed) the bucket again next time: it may have been deleted.
                kv = self._registry_kv = None
                log.warning("worker %s: heartbeat failed (%r); retrying", s.worker_id, exc)
            await self._wait_beat()

    def _on_engine_change(self, _rank: int, change: LivenessChange) -> None:
        """An engine rank changed liveness: heartbeat at once. A worker that had left rejoins right away, as a
        new incarnation, before the batch that brought it back is applied (a later rejoin would clear it)."""
        if change.state == "live" and self._left_for_dead:
            self._left_for_dead = False
            self._rejoined_live = True
            log.warning(
                "worker %s: engine answers again; rejoining as a new incarnation", self.settings.worker_id
            )
            self._rejoin("rejoin")
        self._beat_now.set()

    async def _wait_beat(self) -> None:
        """Sleep until the next heartbeat is due (TTL/3), or an engine rank changed liveness."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._beat_now.wait(), self.settings.worker_ttl_s / 3)
        self._beat_now.clear()

    def _stale_ranks(self) -> dict[int, str]:
        """dp_rank → why its engine is stale, for the registry record (routers skip those ranks)."""
        if self._watch is None:
            return {}
        out = {}
        for r, reason in self._watch.stale_ranks().items():
            rank = self._ranks.get(r)
            out[rank.holder_rank if rank is not None and rank.holder_rank >= 0 else r] = reason
        return out

    async def _key_present_or_unknown(self, kv: Any) -> bool:
        """`key_present`, but True when there is no definite answer (the heartbeat is put regardless)."""
        try:
            return await key_present(kv, self.settings.worker_id)
        except Exception as exc:
            log.info(
                "worker %s: registry check gave no answer (%r); heartbeating on", self.settings.worker_id, exc
            )
            return True

    def _rejoin(self, reason: str) -> None:
        """Start a new incarnation on every rank, announced by a Cleared.

        The new epoch is above every rank's (a removal covers the worker's highest epoch).
        """
        epoch = max((r.tracker.epoch for r in self._ranks.values()), default=0) + 1
        for rank in self._ranks.values():
            rank.tracker.rejoin(epoch)
            self._enqueue_clear(rank, reason)

    async def _still_registered(self) -> bool:
        """Whether this worker's registry key exists, asked at start before resuming a recovered cursor.

        An answer that is not definite (timeout, bucket unreadable) counts as "not registered": a new
        incarnation costs a clear and a replay, resuming a removed one loses every later message.
        """
        try:
            self._registry_kv = await self._open_registry()
            return await key_present(self._registry_kv, self.settings.worker_id)
        except Exception as exc:
            self._registry_kv = None
            log.warning(
                "worker %s: cannot read its registry key (%r); starting a new incarnation",
                self.settings.worker_id,
                exc,
            )
            return False

    async def _deregister(self) -> None:
        """Delete this worker's registry key (a clean stop: watchers publish its removal at once)."""
        s = self.settings
        try:
            kv = self._registry_kv or await asyncio.wait_for(self._open_registry(), _STOP_FLUSH_S)
            await asyncio.wait_for(deregister(kv, s.worker_id), _STOP_FLUSH_S)
            log.info("worker %s: deregistered", s.worker_id)
        except Exception as exc:
            log.warning(
                "worker %s: could not delete its registry key (%r); it expires after %.1f s",
                s.worker_id,
                exc,
                s.worker_ttl_s,
            )

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """Return this ingest's cursors and counters (what `kvmesh status` shows)."""
        s = self.settings
        return {
            "worker_id": s.worker_id,
            "model": s.model,
            "outbox": len(self._outbox) + len(self._inflight),
            "counters": asdict(self.counters),
            "ranks": {
                str(r.rank): {
                    "endpoint": r.endpoint,
                    "epoch": r.tracker.epoch,
                    "last_seq": r.tracker.last_seq,
                    "replaying": r.tracker.replaying,
                    "block_size": r.normalizer.block_size,
                    "sequence": asdict(r.tracker.stats),
                    "events": asdict(r.normalizer.stats),
                    "engine": self._engine_status(r.rank),
                }
                for r in self._ranks.values()
            },
        }

    def _engine_status(self, rank: int) -> dict[str, Any]:
        """The rank's engine liveness: state (live, stale, gone or unprobed), why, probes sent."""
        live = self._watch.ranks.get(rank) if self._watch is not None else None
        if live is None:
            return {"state": "unprobed", "reason": "", "probes": 0}
        return {"state": live.state, "reason": live.reason, "probes": live.probes}

    async def _on_status(self, msg: Any) -> None:
        if msg.reply:
            await msg.respond(msgspec.json.encode(self.status()))


def _batch_ts(payload: bytes) -> float | None:
    """The ts of an engine batch payload, or None when it does not decode."""
    try:
        return wire.decode_batch(payload).ts
    except WireError:
        return None


def _ack_seq(fut: asyncio.Future[Any]) -> int | None:
    """Stream sequence of a settled publish (a PubAck, or the int of an earlier send), else None."""
    if not fut.done() or fut.cancelled() or fut.exception() is not None:
        return None
    res = fut.result()
    return res if isinstance(res, int) else int(res.seq)


def _cursor(tracker: SeqTracker) -> int:
    """Engine seq an ingest-made message records: the last one delivered, or -1 before any of the epoch.

    A restarted ingest resumes after it (`_recover`), so a message made before the engine's first batch must
    not claim seq 0, or that batch would never be replayed.
    """
    return -1 if tracker.last_seq is None else tracker.last_seq


def _split_events(events: list[Event], parts: int) -> list[list[Event]]:
    """Split events into about ``parts`` lists of similar encoded size.

    Long Stored runs are cut without breaking the parent chain (each piece's parent is the previous piece's
    last block); long Removed lists are cut into several removals. A stored block weighs two hashes (engine
    and local), a removed block one.
    """

    def weight(e: Event) -> int:
        if isinstance(e, Stored):
            return 2 * len(e.engine_hashes)
        if isinstance(e, Removed):
            return len(e.engine_hashes)
        return 1

    per_part = max(2, math.ceil(sum(weight(e) for e in events) / parts))
    out: list[list[Event]] = [[]]
    size = 0

    def add(e: Event) -> None:
        nonlocal size
        n = weight(e)
        if size + n > per_part and out[-1]:
            out.append([])
            size = 0
        out[-1].append(e)
        size += n

    for e in events:
        if isinstance(e, Stored) and weight(e) > per_part:
            step = max(1, per_part // 2)
            parent = e.parent
            for i in range(0, len(e.engine_hashes), step):
                chunk = Stored(e.engine_hashes[i : i + step], parent, e.local_hashes[i : i + step], e.medium)
                parent = chunk.engine_hashes[-1]
                add(chunk)
        elif isinstance(e, Removed) and weight(e) > per_part:
            for i in range(0, len(e.engine_hashes), per_part):
                add(Removed(e.engine_hashes[i : i + per_part], e.medium))
        else:
            add(e)
    return out


async def _true(op: Awaitable[Any]) -> bool:
    """Await ``op`` and return True (`retry_start` takes None for "stopped")."""
    await op
    return True
