"""Index snapshots in a JetStream Object Store bucket, and the snapshot-writer lease in a KV bucket.

One bucket per index group (the events stream): `kvmesh.runtime.subjects.snapshot_bucket`. Objects are
named ``snap-<applied_seq, 20 digits>`` so names sort by stream sequence; the bytes are
`kvmesh.core.snapshot` encodings (format version + XXH3 checksum, on top of the Object Store's own SHA-256).
Each snapshot's description, ``kvmesh seq <applied_seq> stream <stream id>``, names the stream it was read
from (`stream_id`: the stream's creation time, so a deleted and re-created stream of the same name is
another stream): recovery, prune and purge only use and count snapshots of the stream as it is now, whose
sequence is within the stream and agrees with the name (recovery also checks the decoded header).

The bucket also holds one ``member-<worker>`` object per worker seen in the worker registry (its model as
description): the durable record that the worker heartbeats, so a replica started after the worker's key
and its delete marker are both gone still knows to remove it (`kvmesh.indexer.service`).

The lease (`SnapshotLease`) is one key in a KV bucket whose max age is the lease TTL: ``create`` takes it
when absent, the holder renews it with ``update(last=revision)``, and an unrenewed lease simply ages out.
It only saves work — two writers at the same stream sequence would write identical snapshots — so it needs
no fencing.

Also here, because recovery and the offline ``kvmesh replay`` must choose the same way: `plan_recovery`
(which snapshot to start from, and whether the stream still covers what follows it), `replay_stream` (read
the stream into an `IndexState` with an ordered consumer) and the stream retention rule
(`default_stream_max_age_s`).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import io
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    ObjectMeta,
    ObjectStoreConfig,
    StorageType,
)

from kvmesh.core.apply import StreamApplier
from kvmesh.core.errors import SnapshotError
from kvmesh.core.snapshot import decode_snapshot
from kvmesh.core.state import IndexState, StateExport
from kvmesh.runtime import subjects

log = logging.getLogger(__name__)

PREFIX: Final[str] = "snap-"
MEMBER_PREFIX: Final[str] = "member-"
LEASE_KEY: Final[str] = "snapshot-writer"

DEFAULT_SNAPSHOT_EVERY_S: Final[float] = 300.0
"""An indexer writes a snapshot when the last one is this old (``--snapshot-every-s``)."""
DEFAULT_SNAPSHOT_KEEP: Final[int] = 3
"""Snapshots kept per index group (``--snapshot-keep``)."""
MIN_STREAM_MAX_AGE_S: Final[float] = 24 * 3600.0
"""The stream's max age is never below a day, whatever the snapshot interval."""
STREAM_AGE_FACTOR: Final[int] = 4
"""How many times the span of the kept snapshots the stream keeps by age (see `default_stream_max_age_s`)."""
DEFAULT_STREAM_MAX_BYTES: Final[int] = 8 * 2**30
"""Size bound of the events stream (oldest dropped first)."""


def default_stream_max_age_s(
    snapshot_every_s: float = DEFAULT_SNAPSHOT_EVERY_S, snapshot_keep: int = DEFAULT_SNAPSHOT_KEEP
) -> float:
    """The events stream's default max age: ``max(24 h, 4 × snapshot interval × snapshots kept)``.

    The kept snapshots span about ``interval × keep``; the stream must still hold the message after the oldest
    of them even when snapshots were late (a writer restarting, a slow upload), hence the factor 4. Age is the
    backstop only: after each snapshot the writer purges what the oldest kept snapshot no longer needs.
    """
    return max(MIN_STREAM_MAX_AGE_S, STREAM_AGE_FACTOR * snapshot_every_s * snapshot_keep)


DEFAULT_STREAM_MAX_AGE_S: Final[float] = default_stream_max_age_s()
"""`default_stream_max_age_s` of the default snapshot settings (24 h)."""


def snapshot_name(applied_seq: int) -> str:
    """Object name of the snapshot at a stream sequence."""
    return f"{PREFIX}{applied_seq:020d}"


def stream_id(info: Any) -> str:
    """The identity of a stream as of ``info`` (a `nats.js.api.StreamInfo`): its creation time, ISO 8601.

    A stream deleted and created again under the same name gets another identity ("" when the server does
    not report the creation time).
    """
    created = getattr(info, "created", None)
    return created.isoformat() if created is not None else ""


_DESCRIPTION = re.compile(r"^kvmesh seq (\d+) stream (\S*)$")


def _description(applied_seq: int, stream: str) -> str:
    return f"kvmesh seq {applied_seq} stream {stream}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotEntry:
    """One stored snapshot."""

    name: str
    applied_seq: int
    """The sequence in the name."""
    size_bytes: int
    mtime: str
    stream_id: str | None = None
    """The stream it was read from (`stream_id`); None for an object without a kvmesh description (written
    before snapshots carried it, or not by kvmesh)."""
    described_seq: int | None = None
    """The sequence its description states (None without one)."""

    def of_stream(self, stream: str, last_seq: int) -> bool:
        """True for a snapshot of stream ``stream`` (an identity) whose name and description agree and whose
        sequence the stream has reached: the only ones prune and purge count."""
        return self.stream_id == stream and self.described_seq == self.applied_seq <= last_seq


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedSnapshot:
    """A snapshot that verified, with what was skipped on the way to it."""

    entry: SnapshotEntry
    export: StateExport
    skipped: tuple[tuple[str, str], ...]
    """``(name, reason)`` of newer snapshots that did not verify."""


class SnapshotStore:
    """The snapshot bucket of one index group."""

    def __init__(self, js: JetStreamContext, obs: Any, bucket: str) -> None:
        self._js = js
        self._obs = obs
        self.bucket = bucket

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        bucket: str,
        *,
        create: bool = True,
        memory: bool = False,
        max_bytes: int = -1,
        replicas: int = 1,
    ) -> SnapshotStore:
        """Open the bucket, creating it when missing (and ``create``).

        Raises:
            nats.js.errors.BucketNotFoundError: missing and not ``create``.
        """
        try:
            obs = await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            if not create:
                raise
            obs = await js.create_object_store(
                bucket,
                config=ObjectStoreConfig(
                    description="kvmesh index snapshots",
                    storage=StorageType.MEMORY if memory else StorageType.FILE,
                    max_bytes=max_bytes,
                    replicas=replicas,
                ),
            )
        return cls(js, obs, bucket)

    async def list(self) -> list[SnapshotEntry]:
        """Return the stored snapshots, newest (highest sequence) first."""
        try:
            infos = await self._obs.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        out = []
        for info in infos:
            if info.deleted or not info.name.startswith(PREFIX):
                continue
            try:
                seq = int(info.name[len(PREFIX) :])
            except ValueError:
                continue
            described = _DESCRIPTION.match(info.description or "")
            out.append(
                SnapshotEntry(
                    name=info.name,
                    applied_seq=seq,
                    size_bytes=info.size or 0,
                    mtime=info.mtime or "",
                    stream_id=(described.group(2) or None) if described else None,
                    described_seq=int(described.group(1)) if described else None,
                )
            )
        out.sort(key=lambda e: e.applied_seq, reverse=True)
        return out

    async def get(self, name: str, *, timeout_s: float = 10.0) -> bytes:
        """Read one snapshot's bytes (the Object Store checks its SHA-256 on the way).

        Raises:
            TimeoutError: the read took longer than ``timeout_s`` plus a second per MiB (nats-py's reader can
                wait forever for a chunk of an object replaced meanwhile; recovery then skips the snapshot).
        """
        info = await self._obs.get_info(name)
        buf = io.BytesIO()
        await asyncio.wait_for(self._obs.get(name, writeinto=buf), timeout_s + (info.size or 0) / 2**20)
        return buf.getvalue()

    async def put(self, applied_seq: int, data: bytes, *, stream: str = "") -> SnapshotEntry:
        """Store a snapshot under its sequence's name (replacing one of the same name).

        Args:
            stream: the identity (`stream_id`) of the stream the state was read from.
        """
        name = snapshot_name(applied_seq)
        info = await self._obs.put(
            name, data, meta=ObjectMeta(name=name, description=_description(applied_seq, stream))
        )
        return SnapshotEntry(
            name=name,
            applied_seq=applied_seq,
            size_bytes=info.size or len(data),
            mtime=info.mtime or "",
            stream_id=stream,
            described_seq=applied_seq,
        )

    async def put_raw(self, name: str, data: bytes) -> None:
        """Store arbitrary bytes under a name (tests use it to corrupt a snapshot)."""
        await self._obs.put(name, data)

    async def prune(self, keep: int, *, stream: str, last_seq: int) -> builtins.list[str]:
        """Delete all but the newest ``keep`` snapshots of the stream; return the deleted names.

        Only snapshots of ``stream`` (an identity, `stream_id`) within ``last_seq`` whose name and description
        agree count (`SnapshotEntry.of_stream`). Snapshots of another stream (one deleted since) are deleted
        too; objects without a kvmesh description or beyond the stream are left alone and never counted.
        """
        deleted = []
        entries = await self.list()
        ours = [e for e in entries if e.of_stream(stream, last_seq)]
        others = [e for e in entries if e.stream_id is not None and e.stream_id != stream]
        for entry in ours[keep:] + others:
            try:
                await self._obs.delete(entry.name)
                deleted.append(entry.name)
            except nats.js.errors.NotFoundError:
                pass
        return deleted

    async def kept(self, *, stream: str, last_seq: int) -> builtins.list[SnapshotEntry]:
        """The snapshots of ``stream`` within ``last_seq`` (what purge may rely on), newest first."""
        return [e for e in await self.list() if e.of_stream(stream, last_seq)]

    async def members(self) -> dict[str, str]:
        """Every worker recorded as a registry member: worker id → model."""
        try:
            infos = await self._obs.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return {}
        return {
            info.name[len(MEMBER_PREFIX) :]: info.description or ""
            for info in infos
            if not info.deleted and info.name.startswith(MEMBER_PREFIX)
        }

    async def put_member(self, worker_id: str, model: str) -> None:
        """Record that ``worker_id`` (of ``model``) heartbeats into the worker registry."""
        name = MEMBER_PREFIX + worker_id
        await self._obs.put(name, model.encode(), meta=ObjectMeta(name=name, description=model))

    async def delete_member(self, worker_id: str) -> None:
        """Forget a member (its removal is in the stream and its key is gone)."""
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self._obs.delete(MEMBER_PREFIX + worker_id)

    async def load_newest(self, *, max_seq: int | None = None) -> LoadedSnapshot | None:
        """Load the newest snapshot that verifies, skipping corrupt or unreadable ones for older ones.

        Args:
            max_seq: ignore snapshots beyond this stream sequence (None: no bound).
        """
        skipped: list[tuple[str, str]] = []
        for entry in await self.list():
            if max_seq is not None and entry.applied_seq > max_seq:
                continue
            try:
                data = await self.get(entry.name)
                export = decode_snapshot(data)
            except SnapshotError as exc:
                log.warning("snapshot %s/%s is not usable (%s): %s", self.bucket, entry.name, exc.reason, exc)
                skipped.append((entry.name, exc.reason))
                continue
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("snapshot %s/%s cannot be read: %r", self.bucket, entry.name, exc)
                skipped.append((entry.name, type(exc).__name__))
                continue
            if export.applied_seq != entry.applied_seq:
                log.warning(
                    "snapshot %s/%s holds seq %d, skipped", self.bucket, entry.name, export.applied_seq
                )
                skipped.append((entry.name, "name"))
                continue
            return LoadedSnapshot(entry=entry, export=export, skipped=tuple(skipped))
        return None


async def open_kv(
    js: JetStreamContext,
    bucket: str,
    *,
    ttl_s: float | None,
    memory: bool = False,
    replicas: int = 1,
    markers: bool = False,
) -> Any:
    """Open a KV bucket, creating it when missing with a max age of ``ttl_s``.

    Args:
        markers: ask the server to leave a delete marker when a key ages out, so watchers see expiry.
    """
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        pass
    config = KeyValueConfig(
        bucket=bucket,
        ttl=ttl_s,
        storage=StorageType.MEMORY if memory else StorageType.FILE,
        replicas=replicas,
        max_bytes=16 * 2**20,
        limit_marker_ttl=max(1.0, ttl_s or 1.0) if markers else None,
    )
    try:
        return await js.create_key_value(config)
    except nats.js.errors.BadRequestError:
        return await js.key_value(bucket)  # created concurrently by another component


class SnapshotLease:
    """The snapshot-writer lease of one index group: at most one holder per TTL."""

    def __init__(self, kv: Any, owner: str) -> None:
        self._kv = kv
        self.owner = owner
        self._revision: int | None = None

    @property
    def held(self) -> bool:
        """True after the last `try_acquire` succeeded."""
        return self._revision is not None

    async def try_acquire(self) -> bool:
        """Take or renew the lease; False when another owner holds it."""
        value = self.owner.encode()
        if self._revision is not None:
            try:
                self._revision = await self._kv.update(LEASE_KEY, value, last=self._revision)
                return True
            except nats.js.errors.KeyWrongLastSequenceError:
                self._revision = None  # it aged out and someone else took it, or it was deleted
        try:
            self._revision = await self._kv.create(LEASE_KEY, value)
            return True
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        try:
            entry = await self._kv.get(LEASE_KEY)
        except nats.js.errors.KeyNotFoundError:
            return False
        if entry.value == value:  # ours from before a restart: adopt it
            self._revision = entry.revision
            return True
        return False

    async def holder(self) -> str | None:
        """Return the current holder's name, or None."""
        try:
            entry = await self._kv.get(LEASE_KEY)
        except nats.js.errors.KeyNotFoundError:
            return None
        return bytes(entry.value or b"").decode() or None

    async def release(self) -> None:
        """Give the lease up (on a clean stop) so another replica takes over at once."""
        if self._revision is None:
            return
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error):
            await self._kv.delete(LEASE_KEY, last=self._revision)
        self._revision = None


@dataclass(slots=True, kw_only=True)
class RecoveryPlan:
    """Where a state rebuild starts: which snapshot (if any), which stream sequence, and what is missing."""

    export: StateExport | None
    """The snapshot's state, or None to start empty."""
    snapshot: str | None
    snapshot_seq: int | None
    start_seq: int
    """First stream sequence to read."""
    skipped: list[list[str]] = field(default_factory=list)
    """``[name, reason]`` of snapshots not used, newest first."""
    gap: list[int] | None = None
    """``[first, last]`` stream sequences that are gone and no snapshot covers, or None when whole."""

    def state(self, *, max_blocks: int | None = None) -> IndexState:
        """Build the starting state (takes ownership of the export), bounded by ``max_blocks`` (None: no
        bound); marks the gap if there is one."""
        state = (
            IndexState.from_export(self.export, max_blocks=max_blocks)
            if self.export is not None
            else IndexState(max_blocks=max_blocks)
        )
        if self.gap is not None:
            state.mark_gap(self.gap[0] - 1)
        return state


async def plan_recovery(
    store: SnapshotStore | None,
    *,
    first_seq: int,
    last_seq: int,
    only_seq: int | None = None,
    name: str = "kvmesh",
    stream: str | None = None,
) -> RecoveryPlan:
    """Choose the snapshot to start from: the newest that verifies and that the stream still continues.

    Snapshots beyond the stream's last sequence or failing to read or verify are skipped. The first whose
    ``seq + 1 ≥ first_seq`` (or ``seq ≥ last_seq``) is used. If none is covered, the newest valid one (or an
    empty state) is used from the stream's first sequence, and the plan carries the gap.

    Args:
        store: the group's snapshot bucket, or None to start from the stream alone.
        first_seq: the stream's first sequence now.
        last_seq: the stream's last sequence now.
        only_seq: consider only the snapshot at this sequence (``kvmesh replay --from-snapshot SEQ``).
        name: who is recovering (log lines).
        stream: the stream's identity (`stream_id`): snapshots of another stream are skipped (None: any).
            One without an identity (written before snapshots carried it) is still considered.
    """
    skipped: list[list[str]] = []
    uncovered: tuple[str, StateExport] | None = None
    for entry in await store.list() if store is not None else []:
        if only_seq is not None and entry.applied_seq != only_seq:
            continue
        if stream is not None and entry.stream_id is not None and entry.stream_id != stream:
            skipped.append([entry.name, "of another stream (deleted and re-created since)"])
            continue
        if entry.applied_seq > last_seq:
            skipped.append([entry.name, "beyond the stream's last sequence"])
            continue
        if entry.described_seq is not None and entry.described_seq != entry.applied_seq:
            log.warning("%s: snapshot %s describes seq %d, skipped", name, entry.name, entry.described_seq)
            skipped.append([entry.name, "name and description disagree"])
            continue
        try:
            export = decode_snapshot(await store.get(entry.name))  # type: ignore[union-attr]
        except SnapshotError as exc:
            log.warning("%s: snapshot %s skipped (%s): %s", name, entry.name, exc.reason, exc)
            skipped.append([entry.name, exc.reason])
            continue
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("%s: snapshot %s unreadable, skipped: %r", name, entry.name, exc)
            skipped.append([entry.name, type(exc).__name__])
            continue
        if export.applied_seq != entry.applied_seq:
            log.warning("%s: snapshot %s holds seq %d, skipped", name, entry.name, export.applied_seq)
            skipped.append([entry.name, "name and content disagree"])
            continue
        if export.applied_seq + 1 >= first_seq or export.applied_seq >= last_seq:
            return RecoveryPlan(
                export=export,
                snapshot=entry.name,
                snapshot_seq=export.applied_seq,
                start_seq=export.applied_seq + 1,
                skipped=skipped,
            )
        log.warning(
            "%s: snapshot %s (seq %d) is older than the stream's first message %d; trying older",
            name,
            entry.name,
            export.applied_seq,
            first_seq,
        )
        skipped.append([entry.name, "stream no longer holds its next message"])
        if uncovered is None:
            uncovered = (entry.name, export)
    base_seq = uncovered[1].applied_seq if uncovered is not None else 0
    plan = RecoveryPlan(
        export=uncovered[1] if uncovered is not None else None,
        snapshot=uncovered[0] if uncovered is not None else None,
        snapshot_seq=base_seq if uncovered is not None else None,
        start_seq=max(first_seq, base_seq + 1),
        skipped=skipped,
    )
    if first_seq > base_seq + 1:
        # Messages base_seq+1 .. first_seq-1 existed and are gone (purged, aged out, or over max bytes).
        plan.gap = [base_seq + 1, first_seq - 1]
        log.error(
            "%s: stream messages %d..%d are gone and no snapshot covers them: starting from seq %d; the index is "
            "INCOMPLETE for every worker until it clears (see kvmesh status)",
            name,
            base_seq + 1,
            first_seq - 1,
            first_seq,
        )
    return plan


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayStats:
    """What `replay_stream` read."""

    messages: int
    """Stream messages received."""
    decode_errors: int
    apply_errors: int
    seconds: float


async def replay_stream(
    js: JetStreamContext,
    state: IndexState,
    *,
    stream: str,
    events_prefix: str,
    start_seq: int,
    to_seq: int,
    timeout_s: float = 60.0,
    on_message: Callable[[int], None] | None = None,
) -> ReplayStats:
    """Apply the stream's messages ``start_seq .. to_seq`` to a state with an ordered consumer (no durable one).

    Messages that do not decode or fail to apply are counted and skipped by the indexer's own apply path
    (`kvmesh.core.apply.StreamApplier`).

    Raises:
        TimeoutError: no message arrived for ``timeout_s`` seconds before ``to_seq`` was applied.
    """
    t0 = time.perf_counter()
    applier = StreamApplier()
    if to_seq < start_seq or state.applied_seq >= to_seq:
        return ReplayStats(messages=0, decode_errors=0, apply_errors=0, seconds=0.0)
    done = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        # A callback, not next_msg(): nats-py then hands messages over without a task per message.
        seq = msg.metadata.sequence.stream
        if seq > to_seq:  # delivered ahead of our unsubscribe: not part of this replay
            done.set()
            return
        if on_message is not None:
            on_message(seq)
        applier.apply(state, seq, msg.data)
        if state.applied_seq >= to_seq:
            done.set()

    sub = await js.subscribe(
        subjects.events_wildcard(events_prefix),
        stream=stream,
        cb=on_msg,
        ordered_consumer=True,
        pending_msgs_limit=1 << 20,
        pending_bytes_limit=1 << 30,
        config=ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(1, start_seq)
        ),
    )
    try:
        seen = -1
        while not done.is_set():
            if applier.messages == seen:
                raise TimeoutError(
                    f"stream {stream}: nothing after seq {state.applied_seq} within {timeout_s:g} s"
                )
            seen = applier.messages
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
    return ReplayStats(
        messages=applier.messages,
        decode_errors=applier.decode_errors,
        apply_errors=applier.apply_errors,
        seconds=time.perf_counter() - t0,
    )
