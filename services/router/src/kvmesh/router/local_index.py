"""The router's in-process index (``--index local``): restore, follow, and watch the lag behind the stream.

`LocalIndex.start` restores a `kvmesh.runtime.replica.StreamReplica` from the indexers' newest snapshot and
the stream, and returns the task that follows the stream once the replica has caught up; `watch_lag` reads
the stream's last sequence every `LAG_CHECK_S` into a `kvmesh.router.health.LagMeter`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats.js.errors
from nats.aio.client import Client

from kvmesh.router.config import RouterSettings
from kvmesh.router.health import IndexView, LagMeter
from kvmesh.router.stats import ReplicaFigures
from kvmesh.runtime.nats import wait_for_stream
from kvmesh.runtime.replica import StreamReplica, retry_start
from kvmesh.runtime.snapshots import SnapshotStore

log = logging.getLogger("kvmesh.router")

LAG_CHECK_S = 0.5
"""Seconds between two reads of the stream's last sequence (the local replica's lag)."""


class LocalIndex:
    """The router's replica of the index.

    Args:
        settings: the router's settings (stream, events prefix, snapshot bucket).
        stop: set by the router to stop the start-up and the replica.
        clock: monotonic seconds.
    """

    def __init__(self, settings: RouterSettings, *, stop: asyncio.Event, clock: Callable[[], float]) -> None:
        self.settings = settings
        self._stop = stop
        self._clock = clock
        self.replica: StreamReplica | None = None
        """The replica, once `start` opened it."""
        self.lag_meter = LagMeter()

    async def start(self, nc: Client) -> asyncio.Task[None] | None:
        """Restore the index from the newest snapshot and the stream; return the following task once caught
        up (None when stopped first)."""
        s = self.settings
        js = nc.jetstream()

        async def step(op: Callable[[], Awaitable[Any]], what: str) -> Any:
            # Every start-up call rides out timeouts while fresh R3 buckets and streams elect their leaders.
            return await retry_start(op, what=what, name="router", stop=self._stop)

        async def waited() -> bool:
            await wait_for_stream(js, s.stream, stop=self._stop)
            return True

        async def open_store() -> SnapshotStore | bool:
            try:
                return await SnapshotStore.open(js, s.snapshot_bucket_name(), create=False)
            except nats.js.errors.BucketNotFoundError:
                # No indexer has written a snapshot yet, so none has purged the stream either: it is whole.
                return False

        if await step(waited, f"wait for stream {s.stream}") is None or self._stop.is_set():
            return None
        opened = await step(open_store, f"open snapshot bucket {s.snapshot_bucket_name()}")
        if opened is None:
            return None
        store: SnapshotStore | None = opened or None
        self.replica = replica = StreamReplica(
            js,
            stream=s.stream,
            events_prefix=s.events_prefix,
            store=store,
            name="router",
            stop=self._stop,
            max_blocks=s.max_blocks,
        )
        info = await step(lambda: js.stream_info(s.stream), f"read stream info of {s.stream}")
        start_seq = (
            None if info is None else await step(lambda: replica.recover(info), "recover from snapshots")
        )
        if start_seq is None:
            return None
        follow = asyncio.create_task(replica.follow(start_seq))
        await replica.wait_caught_up()
        if follow.done():
            follow.result()  # the consumer failed: fail the router
        if self._stop.is_set():
            follow.cancel()
            return None
        # Whatever the restore allocated is long-lived: keep it out of the cyclic collector's full passes
        # (the index's own maps hold only ints and are not tracked; a pass takes ~1 ms at a million blocks).
        gc.collect()
        gc.freeze()
        log.info(
            "router: index replica caught up at stream seq %d (%d blocks, %d messages read)",
            replica.state.applied_seq,
            replica.state.block_total(),
            replica.read_messages,
            extra={"replica": "router", "stream_seq": replica.state.applied_seq},
        )
        return follow

    async def watch_lag(self, nc: Client) -> None:
        """Read the stream's last sequence every `LAG_CHECK_S` (what `lag` measures the replica against)."""
        js = nc.jetstream()
        while True:
            try:
                info = await js.stream_info(self.settings.stream)
            except Exception as exc:  # NATS unreachable or the stream re-created: the replica handles it
                log.debug("router: cannot read stream %s: %r", self.settings.stream, exc)
            else:
                self.lag_meter.note(int(info.state.last_seq), self._clock())
            await asyncio.sleep(LAG_CHECK_S)

    def lag(self, now: float) -> tuple[int, float]:
        """Return how far the replica is behind the stream, (messages, seconds) (`LagMeter.lag`); (0, 0.0)
        before it opened."""
        if self.replica is None:
            return 0, 0.0
        return self.lag_meter.lag(self.replica.state.applied_seq, now)

    def view(self, now: float) -> IndexView | None:
        """Return the replica as the route mode sees it at ``now`` (None before it opened)."""
        if self.replica is None:
            return None
        messages, seconds = self.lag(now)
        return IndexView(
            caught_up=self.replica.caught_up,
            rebuilding=bool(self.replica.rebuilds),
            lag_messages=messages,
            lag_s=seconds,
        )

    def figures(self, now: float) -> ReplicaFigures | None:
        """Return the replica's figures for the router's stats (None before it opened)."""
        replica = self.replica
        if replica is None:
            return None
        messages, seconds = self.lag(now)
        return ReplicaFigures(
            stream=self.settings.stream,
            applied_seq=replica.state.applied_seq,
            blocks=replica.state.block_total(),
            read_messages=replica.read_messages,
            decode_errors=replica.decode_errors,
            apply_errors=replica.apply_errors,
            recovery=replica.recovery,
            lag_messages=messages,
            lag_s=seconds,
            max_blocks=replica.state.max_blocks,
            evicted_blocks=replica.state.counters.evicted_blocks,
        )
