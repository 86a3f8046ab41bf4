"""The indexer's snapshot writer: the writer lease, the snapshot loop, ``kvmesh snapshot`` and the purge.

The holder of the group's snapshot-writer lease writes a snapshot when `kvmesh.indexer.policy.
SnapshotSchedule` says it is due (and on ``kvmesh snapshot``): the state is copied between two applied
messages (`IndexState.export`), encoded in a thread, stored, the oldest snapshots beyond ``snapshot_keep``
deleted, and the stream messages no kept snapshot needs purged (`policy.retention_floor`, `policy.purge_cut`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from kvmesh.core import protocol
from kvmesh.core.errors import RequestError
from kvmesh.core.protocol import SnapshotRequest
from kvmesh.core.snapshot import encode_snapshot
from kvmesh.indexer import policy
from kvmesh.indexer.config import IndexerSettings
from kvmesh.runtime import subjects
from kvmesh.runtime.replica import StreamReplica
from kvmesh.runtime.snapshots import SnapshotLease, SnapshotStore, default_stream_max_age_s, stream_id

log = logging.getLogger("kvmesh.indexer")

LOOP_S = 0.2
"""How often the snapshot loop asks the schedule whether a snapshot is due (seconds)."""


def new_stats() -> dict[str, Any]:
    """The snapshot counters of ``kvmesh status``: ``{"written", "last", "max_stall_ms", "last_stall_ms"}``."""
    return {"written": 0, "last": None, "max_stall_ms": 0.0, "last_stall_ms": 0.0}


def check_retention(settings: IndexerSettings, replica: str, max_age_s: float) -> None:
    """Warn when the stream (keeping messages ``max_age_s`` seconds, 0: no limit) may age out messages that the
    kept snapshots still need (`kvmesh.runtime.snapshots.default_stream_max_age_s`)."""
    s = settings
    if not s.snapshot_every_s or not max_age_s:
        return
    wanted = default_stream_max_age_s(s.snapshot_every_s, s.snapshot_keep)
    if max_age_s < wanted:
        log.warning(
            "indexer %s: stream %s keeps messages %.0f s, less than the %.0f s that snapshots every %.0f s "
            "with %d kept need (max(24 h, 4 × interval × keep)); a restart may find a gap",
            replica,
            s.stream,
            max_age_s,
            wanted,
            s.snapshot_every_s,
            s.snapshot_keep,
            extra={"replica": replica},
        )


class SnapshotWriter:
    """Writes one replica's snapshots while it holds the writer lease.

    Args:
        settings: the replica's settings (stream, events prefix, keep, purge, lease TTL).
        replica: this replica's name (``kvmesh status``, log lines).
        js: a JetStream context.
        store: the group's snapshot bucket.
        lease: the group's snapshot-writer lease.
        stream: the replica whose state is written.
        schedule: when snapshots are due (the replica's consumer counts messages into it).
        stats: the counters ``kvmesh status`` shows (`new_stats`), updated in place.
        stop: set by the owner; ends the loops.
    """

    def __init__(
        self,
        settings: IndexerSettings,
        replica: str,
        *,
        js: Any,
        store: SnapshotStore,
        lease: SnapshotLease,
        stream: StreamReplica,
        schedule: policy.SnapshotSchedule,
        stats: dict[str, Any],
        stop: asyncio.Event,
    ) -> None:
        self.settings = settings
        self.replica = replica
        self.lease = lease
        self.stats = stats
        self._js = js
        self._store = store
        self._stream = stream
        self._schedule = schedule
        self._stop = stop
        self._lock = asyncio.Lock()

    async def snapshot(self, *, force: bool = False) -> dict[str, Any]:
        """Write a snapshot now if this replica holds (or can take) the writer lease.

        Returns:
            ``{"written": True, "replica", "name", "stream_id", "applied_seq", "bytes", "stall_ms", "encode_ms",
            "store_ms", "deleted", "purged_before"}`` or ``{"written": False, "reason"}``.

        Raises:
            nats.errors.Error, TimeoutError: the stream could not be read or the snapshot stored (the
                messages it would have covered still count towards the next attempt).
        """
        async with self._lock:
            if not await self.lease.try_acquire():
                return {"written": False, "reason": f"lease held by {await self.lease.holder()}"}
            replica = self._stream
            if policy.nothing_new(
                force=force,
                last=self.stats["last"],
                applied_seq=replica.state.applied_seq,
                stream_id=replica.stream_id,
            ):
                return {"written": False, "reason": policy.NOTHING_NEW}
            info = await self._js.stream_info(self.settings.stream)
            if policy.stream_recreated(replica.stream_id, stream_id(info)):
                return {"written": False, "reason": policy.REBUILDING}
            t0 = time.perf_counter()
            export = replica.state.export()
            t1 = time.perf_counter()
            taken = self._schedule.begin(time.monotonic())
            try:
                data = await asyncio.to_thread(encode_snapshot, export)
                t2 = time.perf_counter()
                entry = await self._store.put(export.applied_seq, data, stream=replica.stream_id)
            except BaseException:
                self._schedule.upload_failed(taken)
                raise
            t3 = time.perf_counter()
            info = await self._js.stream_info(self.settings.stream)
            deleted = await self._store.prune(
                self.settings.snapshot_keep, stream=stream_id(info), last_seq=info.state.last_seq
            )
            purged = await self._purge(info) if self.settings.purge_after_snapshot else None
            stall_ms = (t1 - t0) * 1e3
            result = {
                "written": True,
                "replica": self.replica,
                "name": entry.name,
                "stream_id": replica.stream_id,
                "applied_seq": export.applied_seq,
                "bytes": len(data),
                "stall_ms": round(stall_ms, 2),
                "encode_ms": round((t2 - t1) * 1e3, 1),
                "store_ms": round((t3 - t2) * 1e3, 1),
                "deleted": deleted,
                "purged_before": purged,
            }
            self.stats["written"] += 1
            self.stats["last"] = result
            self.stats["last_stall_ms"] = result["stall_ms"]
            self.stats["max_stall_ms"] = max(self.stats["max_stall_ms"], result["stall_ms"])
            log.info(
                "indexer %s: snapshot %s written (%d bytes, stall %.1f ms, encode %.0f ms, store %.0f ms)",
                self.replica,
                entry.name,
                len(data),
                stall_ms,
                (t2 - t1) * 1e3,
                (t3 - t2) * 1e3,
                extra={"replica": self.replica, "snapshot": entry.name, "stream_seq": export.applied_seq},
            )
            return result

    async def _purge(self, info: Any) -> int | None:
        """Purge stream messages before the oldest kept snapshot's next one, but never an ingest's last
        message on a live worker's rank subject (ingest resumes its cursor from it). Returns the cut.

        Only snapshots of the stream as of ``info`` (its identity, within its last sequence) count: objects
        planted beyond the stream or left from a deleted stream of the same name never allow a cut.
        """
        s = self.settings
        kept = await self._store.kept(stream=stream_id(info), last_seq=info.state.last_seq)
        floor = policy.retention_floor([e.applied_seq for e in kept], s.snapshot_keep)
        if floor is None:
            return None  # keep the stream whole until K snapshots exist
        cursors = []
        for model, worker, rank in self._stream.state.live_holders():
            try:
                last = await self._js.get_last_msg(
                    s.stream, subjects.events_subject(s.events_prefix, model, worker, rank)
                )
            except nats.js.errors.NotFoundError:
                continue
            cursors.append(last.seq)
        info = await self._js.stream_info(s.stream)
        cut = policy.purge_cut(floor, cursors, info.state.first_seq)
        if cut is None:
            return None
        await self._js.purge_stream(s.stream, seq=cut)
        log.info(
            "indexer %s: purged stream %s before seq %d",
            self.replica,
            s.stream,
            cut,
            extra={"replica": self.replica, "stream_seq": cut},
        )
        return cut

    async def run(self) -> None:
        """Write snapshots when due while this replica holds the lease, until stopped; one warning per outage."""
        failing = False
        while not self._stop.is_set():
            await asyncio.sleep(LOOP_S)
            if not self._schedule.due(time.monotonic()) or not self.lease.held:
                continue
            try:
                await self.snapshot()
                if failing:
                    log.info(
                        "indexer %s: snapshots work again", self.replica, extra={"replica": self.replica}
                    )
                failing = False
            except Exception as exc:
                if self._stop.is_set():
                    return
                if not failing:  # one warning per outage (a bucket without a leader fails every attempt)
                    log.warning(
                        "indexer %s: snapshot failed (%r); retrying quietly",
                        self.replica,
                        exc,
                        extra={"replica": self.replica},
                    )
                failing = True
                self._schedule.attempt_failed(time.monotonic())

    async def hold_lease(self) -> None:
        """Take and renew the writer lease every third of its TTL, until stopped."""
        while not self._stop.is_set():
            try:
                await self.lease.try_acquire()
            except Exception as exc:
                log.debug("indexer %s: lease renewal failed: %r", self.replica, exc)
            # Sleep on the stop event: a cancellation swallowed inside nats-py must not keep this loop alive.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.settings.lease_ttl_s / 3)

    async def on_request(self, msg: Any) -> None:
        """Answer `kvmesh snapshot`: ``{"stream": S}`` (or an empty body) asks the replicas of stream S.

        Replies ``{"replica", "stream", **result}`` (`snapshot`'s result, forced), or with ``"written": False``,
        ``"reason"`` and ``"error"`` (the exception's class name) when it failed.
        """
        try:
            wanted = protocol.decode(msg.data or b"{}", SnapshotRequest).stream
        except RequestError:
            wanted = None  # an unreadable request asks every group
        if wanted is not None and wanted != self.settings.stream:
            return  # another index group's request: its replicas answer
        try:
            result = await self.snapshot(force=True)
        except Exception as exc:
            log.warning(
                "indexer %s: requested snapshot failed: %r",
                self.replica,
                exc,
                extra={"replica": self.replica},
            )
            result = {
                "written": False,
                "reason": f"the snapshot could not be stored or the stream read ({type(exc).__name__}: "
                f"{exc or 'no detail'}); JetStream may be electing a leader, try again",
                "error": type(exc).__name__,
            }
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                answer = {"replica": self.replica, "stream": self.settings.stream, **result}
                await msg.respond(protocol.encode(msgspec.convert(answer, protocol.SnapshotResult)))
