"""Index snapshots in a JetStream Object Store bucket, and the snapshot-writer lease in a KV bucket.

One bucket per index group (the events stream): `kvmesh.runtime.subjects.snapshot_bucket`. Objects are
named ``snap-<applied_seq, 20 digits>`` so names sort by stream sequence; the bytes are
`kvmesh.core.snapshot` encodings (format version + XXH3 checksum, on top of the Object Store's own SHA-256).

The lease (`SnapshotLease`) is one key in a KV bucket whose max age is the lease TTL: ``create`` takes it
when absent, the holder renews it with ``update(last=revision)``, and an unrenewed lease simply ages out.
It only saves work — two writers at the same stream sequence would write identical snapshots — so it needs
no fencing.
"""

from __future__ import annotations

import asyncio
import io
import logging
from dataclasses import dataclass
from typing import Any, Final

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, ObjectMeta, ObjectStoreConfig, StorageType

from kvmesh.core.snapshot import SnapshotError, decode_snapshot
from kvmesh.core.state import StateExport

log = logging.getLogger(__name__)

PREFIX: Final[str] = "snap-"
LEASE_KEY: Final[str] = "snapshot-writer"


def snapshot_name(applied_seq: int) -> str:
    """Object name of the snapshot at a stream sequence."""
    return f"{PREFIX}{applied_seq:020d}"


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotEntry:
    """One stored snapshot."""

    name: str
    applied_seq: int
    size_bytes: int
    mtime: str


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
            out.append(
                SnapshotEntry(
                    name=info.name, applied_seq=seq, size_bytes=info.size or 0, mtime=info.mtime or ""
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

    async def put(self, applied_seq: int, data: bytes) -> SnapshotEntry:
        """Store a snapshot under its sequence's name (replacing one of the same name)."""
        name = snapshot_name(applied_seq)
        info = await self._obs.put(
            name, data, meta=ObjectMeta(name=name, description=f"kvmesh seq {applied_seq}")
        )
        return SnapshotEntry(
            name=name, applied_seq=applied_seq, size_bytes=info.size or len(data), mtime=info.mtime or ""
        )

    async def put_raw(self, name: str, data: bytes) -> None:
        """Store arbitrary bytes under a name (tests use it to corrupt a snapshot)."""
        await self._obs.put(name, data)

    async def prune(self, keep: int) -> list[str]:
        """Delete all but the newest ``keep`` snapshots; return the deleted names."""
        deleted = []
        for entry in (await self.list())[keep:]:
            try:
                await self._obs.delete(entry.name)
                deleted.append(entry.name)
            except nats.js.errors.NotFoundError:
                pass
        return deleted

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
        try:
            await self._kv.delete(LEASE_KEY, last=self._revision)
        except (nats.errors.Error, nats.js.errors.Error):
            pass
        self._revision = None
