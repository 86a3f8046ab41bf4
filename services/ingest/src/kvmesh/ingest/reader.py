"""The ingest's ZMQ side: each rank's SUB socket, and its replay DEALER (or snapshot REQ) on a gap.

Frames go to the rank's `SeqTracker`; its actions are carried out here (a replay task, a snapshot task of
`kvmesh.ingest.resync`, a clear, a rebuild, a delivery to `kvmesh.ingest.batches.Batches`). What one burst
of the SUB socket delivered becomes one stream message. A sequence frame of 8 bytes, or of 24 with vLLM's
publisher epoch (`kvmesh.core.engine_snapshot.decode_seq_frame`), is accepted; a new epoch is a restart.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from kvmesh.core import wire
from kvmesh.core.engine_snapshot import decode_seq_frame
from kvmesh.core.errors import WireError
from kvmesh.core.sequencing import (
    Action,
    Deliver,
    NewEpoch,
    Rebuild,
    ReplayDone,
    Resync,
    StartReplay,
    StartSnapshot,
)
from kvmesh.ingest.batches import Batches, Rank
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.liveness import EngineWatch
from kvmesh.ingest.resync import SnapshotFetcher
from kvmesh.ingest.status import IngestCounters

log = logging.getLogger("kvmesh.ingest")

DRAIN_BATCH = 256
"""Live messages read without yielding to the event loop before the publisher gets a turn."""


def batch_ts(payload: bytes) -> float | None:
    """The ts of an engine batch payload, or None when it does not decode."""
    try:
        return wire.decode_batch(payload).ts
    except WireError:
        return None


class RankReader:
    """Reads every rank's engine sockets.

    Args:
        ctx: the ZMQ context.
        settings: topic, replay timeout, worker id.
        counters: decode errors, foreign replay topics.
        batches: where delivered batches and clears go.
        watch: engine liveness, told of every burst (None with probing off).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        settings: IngestSettings,
        counters: IngestCounters,
        batches: Batches,
        watch: EngineWatch | None,
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.counters = counters
        self.batches = batches
        self.watch = watch
        self.snapshots = SnapshotFetcher(ctx, settings, batches, watch, self.act)

    async def read(self, rank: Rank) -> None:
        """Read the rank's SUB socket until cancelled."""
        sock = self.ctx.socket(zmq.SUB)
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
                if self.watch is not None:  # first: an engine back from gone rejoins before its batch applies
                    self.watch.heard(rank.rank)
                self.on_frames(rank, frames)
                for _ in range(DRAIN_BATCH):
                    try:
                        frames = raw.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.on_frames(rank, frames)
                # What one burst delivered for this rank becomes one stream message.
                self.batches.end_burst(rank)
        finally:
            sock.close(linger=0)

    def on_frames(self, rank: Rank, frames: list[bytes]) -> None:
        """Take one live message ``[topic, seq, payload]``; a malformed one is counted and dropped."""
        if len(frames) != 3:
            self.counters.decode_errors += 1
            log.warning(
                "worker %s rank %d: live message with %d frames (want 3), dropped",
                self.settings.worker_id,
                rank.rank,
                len(frames),
                extra={"worker_id": self.settings.worker_id, "dp_rank": rank.rank},
            )
            return
        try:
            seq, publisher = decode_seq_frame(frames[1])
        except WireError as exc:
            self.counters.decode_errors += 1
            log.warning(
                "worker %s rank %d: live message dropped: %s",
                self.settings.worker_id,
                rank.rank,
                exc,
                extra={"worker_id": self.settings.worker_id, "dp_rank": rank.rank},
            )
            return
        try:
            self.act(rank, rank.tracker.on_live(seq, frames[2], publisher), flush=False)
        except Exception:
            # Never let one message stop the reader (the engine would go unread for good).
            self.counters.decode_errors += 1
            log.exception(
                "worker %s rank %d seq %d: message failed; dropped",
                self.settings.worker_id,
                rank.rank,
                seq,
                extra={"worker_id": self.settings.worker_id, "dp_rank": rank.rank, "seq": seq},
            )

    def act(self, rank: Rank, actions: list[Action], *, flush: bool = True) -> None:
        """Carry out the tracker's actions; ``flush=False`` lets deliveries coalesce until the burst ends."""
        s = self.settings
        for a in actions:
            if isinstance(a, Deliver):
                self.batches.deliver(rank, a.seq, a.payload)
            elif isinstance(a, StartReplay):
                log.warning(
                    "worker %s rank %d: sequence gap before seq %d (last %s); replaying from %d",
                    s.worker_id,
                    rank.rank,
                    rank.tracker.gap_end,
                    rank.tracker.last_seq,
                    a.from_seq,
                    extra={
                        "worker_id": s.worker_id,
                        "dp_rank": rank.rank,
                        "seq": rank.tracker.gap_end,
                        "last_seq": rank.tracker.last_seq,
                        "from_seq": a.from_seq,
                    },
                )
                if rank.replay_endpoint is not None:
                    # A replay the tracker abandoned (engine restart, overflow) may still be waiting on its
                    # socket; left running, its timeout or END would end this new replay early (the
                    # tracker cannot tell the two apart) and its task would be orphaned.
                    if rank.replay_task is not None and not rank.replay_task.done():
                        rank.replay_task.cancel()
                    rank.replay_task = asyncio.create_task(self.replay(rank, a.from_seq))
            elif isinstance(a, Resync):
                log.warning(
                    "worker %s rank %d: resynchronising after seq %s (%s): clearing its index entries",
                    s.worker_id,
                    rank.rank,
                    a.after_seq,
                    a.reason,
                    extra={
                        "worker_id": s.worker_id,
                        "dp_rank": rank.rank,
                        "seq": a.after_seq,
                        "reason": a.reason,
                    },
                )
                self.batches.enqueue_clear(rank, a.reason, seq=-1 if a.after_seq is None else a.after_seq)
            elif isinstance(a, NewEpoch):
                log.warning(
                    "worker %s rank %d: engine restarted (seq %d); epoch %d, clearing its index entries",
                    s.worker_id,
                    rank.rank,
                    a.first_seq,
                    a.epoch,
                    extra={
                        "worker_id": s.worker_id,
                        "dp_rank": rank.rank,
                        "seq": a.first_seq,
                        "epoch": a.epoch,
                    },
                )
                self.batches.enqueue_clear(rank, "restart", seq=a.first_seq - 1)
            elif isinstance(a, StartSnapshot):
                log.warning(
                    "worker %s rank %d: sequence gap or restart before seq %d (last %s); asking for a snapshot",
                    s.worker_id,
                    rank.rank,
                    rank.tracker.gap_end,
                    rank.tracker.last_seq,
                    extra={"worker_id": s.worker_id, "dp_rank": rank.rank, "seq": rank.tracker.gap_end},
                )
                if rank.snapshot_task is not None and not rank.snapshot_task.done():
                    rank.snapshot_task.cancel()  # its answer would be stale (another token) anyway
                rank.snapshot_task = asyncio.create_task(self.snapshots.fetch(rank, a.token))
            elif isinstance(a, Rebuild):
                events, rank.snapshot_events = rank.snapshot_events or [], None
                log.warning(
                    "worker %s rank %d: rebuilding from the engine's snapshot at seq %d (%d event(s))",
                    s.worker_id,
                    rank.rank,
                    a.cut,
                    len(events),
                    extra={"worker_id": s.worker_id, "dp_rank": rank.rank, "seq": a.cut},
                )
                self.batches.rebuild(rank, a.cut, a.after_seq, events)
            elif isinstance(a, ReplayDone):
                log.info(
                    "worker %s rank %d: replay done (healed=%s)",
                    s.worker_id,
                    rank.rank,
                    a.healed,
                    extra={"worker_id": s.worker_id, "dp_rank": rank.rank, "healed": a.healed},
                )
        if flush:
            self.batches.end_burst(rank)

    async def replay(self, rank: Rank, from_seq: int) -> None:
        """Ask the engine's replay ROUTER for batches from ``from_seq`` and feed them to the tracker.

        The first replay after a start also asks for the recovered cursor's own batch (`Rank.verify`): when
        its ts differs from the stream's copy, the engine restarted while no ingest read it.
        """
        assert rank.replay_endpoint is not None
        s = self.settings
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(rank.replay_endpoint)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + s.replay_timeout_s
        topic = s.topic.encode()
        verify, rank.verify = rank.verify, None
        if verify is not None and verify[0] != from_seq - 1:
            verify = None
        try:
            await sock.send_multipart(wire.encode_replay_request(from_seq if verify is None else verify[0]))
            while rank.tracker.replaying:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await sock.poll(timeout=remaining * 1000):
                    self.act(rank, rank.tracker.on_replay_end("replay_timeout"))
                    return
                frames = await sock.recv_multipart()
                if self.watch is not None:
                    self.watch.heard(rank.rank)
                try:
                    reply = wire.decode_replay_reply(frames)
                except WireError as exc:
                    log.warning(
                        "worker %s rank %d: bad replay reply: %s",
                        s.worker_id,
                        rank.rank,
                        exc,
                        extra={"worker_id": s.worker_id, "dp_rank": rank.rank},
                    )
                    continue
                if reply.is_end:
                    self.act(rank, rank.tracker.on_replay_end("replay_incomplete"))
                    return
                if reply.topic is not None and not reply.topic.startswith(topic):
                    # Not this engine's (the live SUB filters by the same prefix): another engine behind
                    # the replay endpoint. Its batches would be taken for ours.
                    self.counters.bad_replay_topics += 1
                    log.error(
                        "worker %s rank %d: replay reply seq %d has topic %r, not the configured %r; ignored",
                        s.worker_id,
                        rank.rank,
                        reply.seq,
                        reply.topic[:64],
                        topic,
                        extra={"worker_id": s.worker_id, "dp_rank": rank.rank, "seq": reply.seq},
                    )
                    continue
                if verify is not None:
                    check, verify = verify, None
                    if reply.seq == check[0]:
                        if self._same_engine(rank, check, reply.payload):
                            continue  # the batch the stream already holds: the same engine incarnation
                        self.act(rank, rank.tracker.on_engine_restarted())
                        return
                self.act(rank, rank.tracker.on_replay(reply.seq, reply.payload))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(
                "worker %s rank %d: replay failed",
                s.worker_id,
                rank.rank,
                extra={"worker_id": s.worker_id, "dp_rank": rank.rank},
            )
            self.act(rank, rank.tracker.on_replay_end("replay_error"))
        finally:
            sock.close(linger=0)
            rank.replay_seconds += loop.time() - started

    def _same_engine(self, rank: Rank, check: tuple[int, float], payload: bytes) -> bool:
        """Whether the engine's batch at the cursor carries the stream's ts (else it restarted; logged)."""
        ts = batch_ts(payload)
        if ts == check[1]:
            return True
        log.warning(
            "worker %s rank %d: the engine's seq %d has ts %s, the stream's has %s: the engine restarted while "
            "no ingest read it; new epoch, replaying from 0",
            self.settings.worker_id,
            rank.rank,
            check[0],
            ts,
            check[1],
            extra={"worker_id": self.settings.worker_id, "dp_rank": rank.rank, "seq": check[0]},
        )
        return False
