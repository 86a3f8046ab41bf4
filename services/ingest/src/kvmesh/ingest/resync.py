"""The ingest's snapshot requests: rebuild a rank from the engine's KV-cache state (vLLM PR #57789).

When a rank's `kvmesh.core.sequencing.SeqTracker` asks for a snapshot (`StartSnapshot`: a gap, or an engine
restart first seen past seq 0, with ``--snapshot-endpoint`` set), `SnapshotFetcher.fetch` sends one request
on a REQ socket to the rank's snapshot ROUTER and waits up to ``--replay-timeout-s`` for the reply
``[cut, epoch, chunks…]`` (`kvmesh.core.engine_snapshot`). A usable reply is decoded and normalised first,
then handed to the tracker, whose `Rebuild` the reader carries out: a Cleared("snapshot"), the snapshot's
events as one message at the cut, then the live batches after it. An unavailable reply (cut ≤ -2), a reply
of another publisher epoch, one that does not decode, or no reply at all is handed to the tracker as a
failure: it replays instead (with a replay socket) or resynchronises.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvmesh.core.engine_snapshot import SNAPSHOT_REQUEST, decode_snapshot_reply
from kvmesh.core.errors import WireError
from kvmesh.core.events import Event
from kvmesh.core.sequencing import Action, Rebuild
from kvmesh.ingest.batches import Batches, Rank
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.liveness import EngineWatch

log = logging.getLogger("kvmesh.ingest")

DECODE_SLICE_S = 0.05
"""Longest the snapshot decode holds the event loop before it yields (seconds)."""


class SnapshotFetcher:
    """Asks a rank's snapshot socket for the engine's state and hands the outcome to the rank's tracker.

    Args:
        ctx: the ZMQ context.
        settings: worker id, replay timeout (the snapshot's too).
        batches: decodes and normalises the snapshot's chunks.
        watch: engine liveness, told of every reply (None with probing off).
        act: carries out the tracker's actions (`kvmesh.ingest.reader.RankReader.act`).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        settings: IngestSettings,
        batches: Batches,
        watch: EngineWatch | None,
        act: Callable[[Rank, list[Action]], None],
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.batches = batches
        self.watch = watch
        self.act = act

    async def fetch(self, rank: Rank, token: int) -> None:
        """Request one snapshot for ``rank`` (tracker token ``token``) and hand its outcome to the tracker."""
        assert rank.snapshot_endpoint is not None
        s = self.settings
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(rank.snapshot_endpoint)
        try:
            await sock.send(SNAPSHOT_REQUEST)
            if not await sock.poll(timeout=s.replay_timeout_s * 1000):
                self._failed(rank, token, "snapshot_timeout", f"no reply within {s.replay_timeout_s} s")
                return
            frames = await sock.recv_multipart()
            if self.watch is not None:
                self.watch.heard(rank.rank)
            reply = decode_snapshot_reply(frames)
            tracker = rank.tracker
            if not reply.available:
                log.warning(
                    "worker %s rank %d: snapshot unavailable (cut %d); falling back to %s",
                    s.worker_id,
                    rank.rank,
                    reply.cut,
                    "replay" if tracker.replay else "a resync",
                    extra={"worker_id": s.worker_id, "dp_rank": rank.rank, "cut": reply.cut},
                )
                self.act(rank, tracker.on_snapshot(token, reply.cut))
                return
            if tracker.publisher is not None and reply.epoch != tracker.publisher:
                self._failed(rank, token, "snapshot_epoch", "the reply names another publisher epoch")
                return
            events = await self._decode(rank, reply.chunks)
            rank.snapshot_events = events
            log.info(
                "worker %s rank %d: snapshot at seq %d, %d event(s) in %d chunk(s)",
                s.worker_id,
                rank.rank,
                reply.cut,
                len(rank.snapshot_events),
                len(reply.chunks),
                extra={"worker_id": s.worker_id, "dp_rank": rank.rank, "cut": reply.cut},
            )
            actions = tracker.on_snapshot(token, reply.cut)
            if actions and not any(isinstance(a, Rebuild) for a in actions):
                log.warning(
                    "worker %s rank %d: snapshot at seq %d not used: the live stream is at seq %s; falling back "
                    "to %s",
                    s.worker_id,
                    rank.rank,
                    reply.cut,
                    tracker.live_high,
                    "replay" if tracker.replay else "a resync",
                    extra={"worker_id": s.worker_id, "dp_rank": rank.rank, "cut": reply.cut},
                )
            self.act(rank, actions)
        except asyncio.CancelledError:
            raise
        except WireError as exc:
            self._failed(rank, token, "snapshot_bad_reply", str(exc))
        except Exception as exc:  # never let a snapshot stop the rank: fall back
            log.exception(
                "worker %s rank %d: snapshot failed",
                s.worker_id,
                rank.rank,
                extra={"worker_id": s.worker_id, "dp_rank": rank.rank},
            )
            self._failed(rank, token, "snapshot_error", type(exc).__name__)
        finally:
            rank.snapshot_events = None
            sock.close(linger=0)

    async def _decode(self, rank: Rank, chunks: tuple[bytes, ...]) -> list[Event]:
        """The snapshot's events, decoded and normalised chunk by chunk, giving the event loop a turn every
        `DECODE_SLICE_S` (a snapshot of a large cache takes seconds: the other ranks, the publish loop and the
        registry heartbeats go on meanwhile).

        Raises:
            WireError: as `kvmesh.ingest.batches.Batches.snapshot_events`.
        """
        loop = asyncio.get_running_loop()
        events: list[Event] = []
        since = loop.time()
        for i, chunk in enumerate(chunks):
            events += self.batches.snapshot_events(rank, (chunk,), start=i)
            if loop.time() - since >= DECODE_SLICE_S:
                await asyncio.sleep(0)
                since = loop.time()
        return events

    def _failed(self, rank: Rank, token: int, reason: str, why: str) -> None:
        s = self.settings
        log.warning(
            "worker %s rank %d: snapshot not used (%s: %s); falling back to %s",
            s.worker_id,
            rank.rank,
            reason,
            why,
            "replay" if rank.tracker.replay else "a resync",
            extra={"worker_id": s.worker_id, "dp_rank": rank.rank, "reason": reason},
        )
        self.act(rank, rank.tracker.on_snapshot_failed(token, reason))
