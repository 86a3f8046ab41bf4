"""A replica of the prefix index: the newest valid snapshot plus the events stream after it, applied in order.

The indexer service and a router with a local index (``kvmesh router --index local``) both hold one. A
`StreamReplica` is the async shell around the pure `kvmesh.core.state.IndexState`:

1. `StreamReplica.recover` loads the index's compiled kernels (`kvmesh.core.tables.compile_all`, in a
   thread), so that the first message applied does not pay for them, then the newest snapshot of the group's
   Object Store bucket that verifies and that the stream still continues (`kvmesh.runtime.snapshots.plan_recovery`; an older one, or the stream's
   first message with the state marked incomplete, when not);
2. `StreamReplica.follow` reads the stream from the next sequence with an ordered push consumer (no durable
   consumer, so nothing is orphaned when a replica goes away) and applies every message; a message that
   cannot be decoded or applied is counted, logged with its sequence and subject, and skipped;
3. `StreamReplica.wait_caught_up` returns once the stream's last sequence as of `recover` is applied.

A stream deleted and created again under the same name (its creation time changes; without one, its last
sequence stays below what was applied) is detected every `RECREATED_CHECK_S` while following: the replica then
recovers afresh from the new stream (and only its snapshots) and reads it from there (``rebuilds`` counts it).

Two replicas that have applied the stream up to the same sequence hold the same state (`IndexState.digest`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js.api import ConsumerConfig, DeliverPolicy, StreamInfo

from kvmesh.core.apply import Skipped, StreamApplier
from kvmesh.core.state import IndexState
from kvmesh.core.tables import compile_all
from kvmesh.runtime import subjects, tracing
from kvmesh.runtime.snapshots import SnapshotStore, plan_recovery, stream_id

log = logging.getLogger("kvmesh.replica")

RECREATED_CHECK_S = 2.0
"""How often a following replica checks that the stream is still the one it recovered from (seconds)."""
RECREATED_CONFIRM = 3
"""Checks in a row that must see the stream behind the applied sequence (when its identity is unknown)."""
STALL_S = 5.0
"""A consumer that applied nothing for this long while the stream holds more is re-created (seconds)."""
EVICTION_LOG_INTERVAL_S = 60.0
"""After the first, evictions by a ``--max-blocks`` bound are logged at most this often (seconds)."""
STOP_TIMEOUT_S = 5.0
"""Bound on each shutdown step (seconds)."""
RETRY_FIRST_S = 0.25
"""First pause of `retry_start` (seconds); it doubles per attempt up to `RETRY_MAX_S`."""
RETRY_MAX_S = 4.0
"""Longest pause of `retry_start` (seconds)."""

T = TypeVar("T")


async def retry_start(
    op: Callable[[], Awaitable[T]],
    *,
    what: str,
    name: str,
    stop: asyncio.Event,
    first_s: float = RETRY_FIRST_S,
    max_s: float = RETRY_MAX_S,
) -> T | None:
    """Run one start-up JetStream call until it succeeds; None when ``stop`` was set first.

    A call that times out or fails on the server's side (an R3 bucket or stream electing its leader, no
    JetStream quorum, NATS reconnecting) is retried after a pause that doubles from ``first_s`` to ``max_s``
    seconds, with one warning per attempt naming ``what`` and the error. A definite "not found"
    (`nats.js.errors.NotFoundError`, which includes a missing bucket) is the caller's to handle and is raised.

    Args:
        op: makes and awaits the call (called once per attempt).
        what: the call, for log lines (``"open snapshot bucket KVMESH_EVENTS_SNAPSHOTS"``).
        name: who is starting (``"indexer host-1"``).
        stop: set by the owner; checked between attempts and interrupts a pause.
    """
    pause = first_s
    attempt = 0
    while not stop.is_set():
        attempt += 1
        try:
            return await op()
        except nats.js.errors.NotFoundError:
            raise
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            log.warning("%s: %s failed (attempt %d: %r); retrying in %.2f s", name, what, attempt, exc, pause)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), pause)
        pause = min(pause * 2, max_s)
    return None


class StreamReplica:
    """One replica's index state and the stream consumer that keeps it current.

    Args:
        js: a JetStream context.
        stream: the events stream (``KVMESH_EVENTS`` by default).
        events_prefix: subject prefix of the events (``kvmesh.events``).
        store: the group's snapshot bucket, or None to rebuild from the stream alone.
        name: who this replica is in log lines (``"indexer host-123"``, ``"router host-456"``).
        stop: set by the owner to stop `follow` and `wait_caught_up`.
        on_message: called once per stream message read (before it is applied), e.g. to count towards
            the next snapshot.
        max_blocks: the state's block bound (`kvmesh.core.state.IndexState`), or None for none.
    """

    def __init__(
        self,
        js: Any,
        *,
        stream: str,
        events_prefix: str,
        store: SnapshotStore | None,
        name: str,
        stop: asyncio.Event,
        on_message: Callable[[], None] | None = None,
        max_blocks: int | None = None,
    ) -> None:
        self._max_blocks = max_blocks
        self._evicted_seen = 0
        """Evictions already reported (`_log_evictions`)."""
        self._evicted_logged = 0.0
        self.state = IndexState(max_blocks=max_blocks)
        self._applier = StreamApplier()
        self.resubscribes = 0
        """Times the consumer stalled and was re-created (NATS restarts)."""
        self.rebuilds = 0
        """Times the stream was found deleted and re-created, and the state rebuilt from the new one."""
        self.stream_id = ""
        """Identity (`kvmesh.runtime.snapshots.stream_id`) of the stream the state was read from."""
        self.recovery: dict[str, Any] = {}
        """How this replica started: snapshot used, skipped ones, start sequence, gap."""
        self._js = js
        self._stream = stream
        self._events_prefix = events_prefix
        self._store = store
        self._name = name
        self._stop = stop
        self._on_message = on_message
        self._target_seq = 0
        self._caught_up = asyncio.Event()

    @property
    def read_messages(self) -> int:
        """Stream messages the consumer received."""
        return self._applier.messages

    @property
    def decode_errors(self) -> int:
        """Stream messages that did not decode (skipped)."""
        return self._applier.decode_errors

    @property
    def apply_errors(self) -> int:
        """Stream messages that failed to apply (skipped)."""
        return self._applier.apply_errors

    @property
    def caught_up(self) -> bool:
        """True once the stream's last sequence as of `recover` was applied."""
        return self._caught_up.is_set() or self.state.applied_seq >= self._target_seq

    async def recover(self, info: StreamInfo) -> int:
        """Load the newest usable snapshot into `state`; return the stream sequence to read from.

        The index's compiled kernels are loaded first, in a thread (`kvmesh.core.tables.compile_all`: about
        half a second from numba's cache, once per process; at once after that), so the first message applied
        does not stall the event loop for them.

        Args:
            info: the stream's info as of start-up; its last sequence is the catch-up target.
        """
        await asyncio.to_thread(compile_all)
        self._target_seq = info.state.last_seq
        identity = stream_id(info)
        plan = await plan_recovery(
            self._store,
            first_seq=info.state.first_seq,
            last_seq=info.state.last_seq,
            name=self._name,
            stream=identity,
        )
        self.stream_id = identity
        self.state = plan.state(max_blocks=self._max_blocks)
        self.recovery = {
            "snapshot": plan.snapshot,
            "snapshot_seq": plan.snapshot_seq,
            "skipped": plan.skipped,
            "start_seq": plan.start_seq,
            "gap": plan.gap,
        }
        if plan.snapshot is not None:
            log.info(
                "%s: restored snapshot %s (seq %s, %d blocks)",
                self._name,
                plan.snapshot,
                plan.snapshot_seq,
                self.state.block_total(),
            )
        if self._max_blocks is not None:
            log.info("%s: index bounded at %d blocks (--max-blocks)", self._name, self._max_blocks)
        self._evicted_seen = self.state.counters.evicted_blocks
        return plan.start_seq

    async def wait_caught_up(self) -> None:
        """Return once the consumer applied the stream's last sequence as of `recover` (or on stop).

        Messages can be deleted after start-up (an operator removing a poison message, age limits): every
        second, if the stream holds no message after what was applied, the replica is caught up too.
        """
        if self.state.applied_seq >= self._target_seq:
            self._caught_up.set()
            return
        stop_wait = asyncio.create_task(self._stop.wait())
        caught = asyncio.create_task(self._caught_up.wait())
        try:
            while not (stop_wait.done() or caught.done()):
                await asyncio.wait({stop_wait, caught}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if not (stop_wait.done() or caught.done()) and not await self._more_to_read():
                    self._caught_up.set()
        finally:
            stop_wait.cancel()
            caught.cancel()

    async def _more_to_read(self) -> bool:
        """Tell whether the stream holds a message after ``applied_seq`` (True when it cannot tell)."""
        try:
            await self._js.get_msg(self._stream, seq=self.state.applied_seq + 1, next=True)
        except nats.js.errors.NotFoundError:
            return False
        except Exception:
            return True
        return True

    async def follow(self, start_seq: int) -> None:
        """Read the stream from ``start_seq`` until stopped, with an ordered consumer.

        nats-py's ordered consumer re-creates itself when heartbeats stop, but gives up for good if that
        attempt fails (the server still down): when the stream has messages past ``applied_seq`` and nothing
        was applied for `STALL_S`, subscribe again from ``applied_seq + 1``.
        """
        while not self._stop.is_set():
            try:
                sub = await self._js.subscribe(
                    subjects.events_wildcard(self._events_prefix),
                    stream=self._stream,
                    ordered_consumer=True,
                    config=ConsumerConfig(
                        deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(1, start_seq)
                    ),
                )
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                # NATS down or the stream electing a leader: keep trying, never die over it.
                log.warning("%s: cannot read the stream yet (%r); retrying", self._name, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 1.0)
                continue
            recreated = asyncio.create_task(self._watch_recreated())
            tasks = {
                asyncio.create_task(self._consume(sub)),
                asyncio.create_task(self._watch_stall()),
                recreated,
            }
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()  # a consumer that failed fails the replica
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(sub.unsubscribe(), STOP_TIMEOUT_S)
            if recreated in done:
                info = recreated.result()
                old_seq, old_id = self.state.applied_seq, self.stream_id
                start = await retry_start(
                    lambda info=info: self.recover(info),  # type: ignore[misc]
                    what="recover from the new stream",
                    name=self._name,
                    stop=self._stop,
                )
                if start is None:
                    return
                start_seq = start
                self.rebuilds += 1
                self._caught_up.clear()
                log.warning(
                    "%s: stream %s was deleted and re-created (created %s, was %s; applied seq %d, now last seq "
                    "%d): state rebuilt, reading it from seq %d",
                    self._name,
                    self._stream,
                    self.stream_id,
                    old_id,
                    old_seq,
                    info.state.last_seq,
                    start_seq,
                )
                continue
            start_seq = self.state.applied_seq + 1
            self.resubscribes += 1
            log.warning("%s: consumer stalled; reading again from seq %d", self._name, start_seq)

    async def _watch_recreated(self) -> Any:
        """Return the stream's info once it is another stream than the one recovered from: its creation time
        changed (a missing stream is waited for).

        The last sequence falling below what was applied is no proof on its own: right after a cluster
        failover the new leader can answer with a last sequence behind the one its consumers already
        delivered. It counts only when the stream's creation time is unknown, and only when it lasts
        `RECREATED_CONFIRM` checks in a row.
        """
        behind = 0
        while True:
            await asyncio.sleep(RECREATED_CHECK_S)
            try:
                info = await self._js.stream_info(self._stream)
            except Exception:
                continue  # deleted and not created again yet, or NATS unreachable
            identity = stream_id(info)
            if identity and self.stream_id:
                if identity != self.stream_id:
                    return info
                continue
            behind = behind + 1 if info.state.last_seq < self.state.applied_seq else 0
            if behind >= RECREATED_CONFIRM:
                return info

    async def _watch_stall(self) -> None:
        """Return when the stream holds messages past ``applied_seq`` but none was applied for `STALL_S`."""
        last_applied = self.state.applied_seq
        while True:
            await asyncio.sleep(STALL_S)
            applied = self.state.applied_seq
            if applied != last_applied:
                last_applied = applied
                continue
            try:
                info = await self._js.stream_info(self._stream)
            except Exception:
                continue  # NATS unreachable: nothing to read anyway
            if info.state.last_seq > applied:
                return

    async def _consume(self, sub: Any) -> None:
        applier = self._applier
        on_message = self._on_message
        async for msg in sub.messages:
            seq = msg.metadata.sequence.stream
            if on_message is not None:
                on_message()
            if seq >= self._target_seq or getattr(msg.metadata, "num_pending", None) == 0:
                # Waiters wake only at our next await, after this message has been applied below. Nothing
                # pending also counts: the start-up target may have been deleted from the stream.
                self._caught_up.set()
            span = tracing.start_apply(msg.headers, self._name, msg.subject, seq, msg.data)
            skipped = applier.apply(self.state, seq, msg.data)
            if span is not None:
                tracing.end_apply(span, None if skipped is None else skipped.kind)
            if skipped is not None:
                log_skipped(self._name, skipped, msg.subject)
            if self.state.counters.evicted_blocks != self._evicted_seen:
                self._log_evictions(seq)

    def _log_evictions(self, seq: int) -> None:
        """Warn when the bound first evicts, then at most once a minute (by monotonic time), with the count."""
        evicted = self.state.counters.evicted_blocks
        now = time.monotonic()
        if self._evicted_seen and now - self._evicted_logged < EVICTION_LOG_INTERVAL_S:
            return
        log.warning(
            "%s: the index reached its bound of %s blocks at stream seq %d: %d blocks evicted so far (the largest "
            "caches lose their least recently stored blocks); a bound below what the engines hold makes routes "
            "miss cached prefixes",
            self._name,
            self._max_blocks,
            seq,
            evicted,
        )
        self._evicted_seen, self._evicted_logged = evicted, now


def log_skipped(name: str, skipped: Skipped, subject: str) -> None:
    """Log a stream message the apply path skipped, with its sequence and subject (a traceback when it failed
    to apply: that is a bug, where an undecodable message is bad input)."""
    if skipped.kind == "undecodable":
        log.warning(
            "%s: stream seq %d (%s) undecodable, skipped: %s", name, skipped.seq, subject, skipped.error
        )
    else:
        log.error(
            "%s: stream seq %d (%s) failed to apply, skipped",
            name,
            skipped.seq,
            subject,
            exc_info=skipped.error,
        )
