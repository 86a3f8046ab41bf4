"""The worker registry: one KV key per worker, kept alive by its ingest's heartbeats.

Bucket `kvmesh.runtime.subjects.registry_bucket(stream)`, max age = the worker TTL, with server-placed
delete markers on expiry (nats-server ≥ 2.11) so watchers see a worker go. Key `subjects.kv_key(worker_id)`,
value JSON `WorkerRecord`.

When a key expires or is deleted, whoever notices first (every indexer replica watches) publishes
`WorkerRemoved` into the events stream on `subjects.control_subject(prefix)` with
``Nats-Msg-Id: removed:<worker>:<incarnation>``, so the copies published by other noticers within the
stream's duplicate window are dropped by the server, and every replica removes the worker at the same
stream sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from kvmesh.core import protocol
from kvmesh.core.errors import ProtocolError
from kvmesh.core.events import WorkerRemoved, encode_message
from kvmesh.core.index import Holder
from kvmesh.core.protocol import WorkerRecord
from kvmesh.core.route import RankSet, RegisteredWorker
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import bucket_stream
from kvmesh.runtime.snapshots import open_kv

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistrySettings:
    """Where the registry lives and how long an entry lives without a heartbeat."""

    bucket: str
    ttl_s: float = 15.0
    memory: bool = False
    replicas: int = 1


async def open_registry(js: JetStreamContext, settings: RegistrySettings) -> Any:
    """Open (creating when missing) the registry KV bucket."""
    return await open_kv(
        js,
        settings.bucket,
        ttl_s=settings.ttl_s,
        memory=settings.memory,
        replicas=settings.replicas,
        markers=True,
    )


async def heartbeat(kv: Any, record: WorkerRecord) -> int:
    """Put one heartbeat (restarting the key's TTL); returns the revision."""
    return int(await kv.put(subjects.kv_key(record.worker_id), protocol.encode(record)))


async def deregister(kv: Any, worker_id: str) -> None:
    """Delete a worker's key (a clean departure: watchers publish its removal)."""
    await kv.delete(subjects.kv_key(worker_id))


def removal_msg_id(worker_id: str, incarnation: int | None) -> str:
    """The ``Nats-Msg-Id`` of a worker-removed message: equal for every noticer of one departure."""
    return f"removed:{worker_id}:{incarnation if incarnation is not None else 'latest'}"


async def publish_removal(
    js: JetStreamContext,
    *,
    stream: str,
    events_prefix: str,
    worker_id: str,
    model: str,
    incarnation: int | None,
    reason: str,
) -> int:
    """Publish `WorkerRemoved` into the events stream; returns its stream sequence (duplicates: the first's)."""
    ack = await js.publish(
        subjects.control_subject(events_prefix),
        encode_message(WorkerRemoved(worker_id=worker_id, model=model, epoch=incarnation, reason=reason)),
        stream=stream,
        headers={"Nats-Msg-Id": removal_msg_id(worker_id, incarnation)},
    )
    return int(ack.seq)


async def list_workers(kv: Any) -> dict[str, WorkerRecord]:
    """Return every registered (live) worker: worker id → its last heartbeat record.

    Creates no server state (no consumer): the keys come from the bucket's stream info and each record from
    a direct get. Keys deleted, purged or aged out (a server marker) and undecodable records are skipped.
    """
    out: dict[str, WorkerRecord] = {}
    for key in sorted(await registry_keys(kv)):
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue
        except nats.errors.Error:
            continue
        if not entry.value:  # an age-out marker
            continue
        try:
            out[subjects.from_kv_key(key)] = protocol.decode(entry.value, WorkerRecord)
        except ProtocolError:
            continue
    return out


async def registry_keys(kv: Any) -> set[str]:
    """Return the keys with a message in the bucket (empty when none); creates no consumer.

    A key listed here may have just been deleted or aged out (its last message is then a delete marker):
    read it with ``kv.get`` (as `list_workers` and `key_present` do) before trusting it.

    Raises:
        nats.errors.Error: the bucket's stream cannot be read (timeout, no responders, deleted).
    """
    js, stream, prefix = bucket_stream(kv)
    info = await js.stream_info(stream, subjects_filter=f"{prefix}>")
    return {subject[len(prefix) :] for subject in (info.state.subjects or {}) if subject.startswith(prefix)}


async def key_present(kv: Any, worker_id: str) -> bool:
    """Whether ``worker_id``'s registry key exists, by a direct get of that key (creates no server state).

    Returns False only on a definite answer: no message for the key, or its last one is a delete, a purge
    or an age-out marker. True when the key holds a record.

    Raises:
        nats.errors.Error, TimeoutError: no definite answer (timeout, no responders, bucket unreadable);
            callers must not treat the worker as gone.
    """
    try:
        entry = await kv.get(subjects.kv_key(worker_id))
    except nats.js.errors.KeyNotFoundError as exc:
        if isinstance(exc, nats.js.errors.KeyDeletedError) or getattr(exc, "op", None) is not None:
            return False
        # A 404 from the server (no message on the key's subject); nats-py also maps a missing stream
        # to this error on a non-direct get, which is no answer about the key: check the stream is there.
        js, stream, _ = bucket_stream(kv)
        await js.stream_info(stream)  # raises NotFoundError if the bucket itself is gone
        return False
    return bool(entry.value)  # an empty value is a server marker (the key aged out)


WATCH_INACTIVE_S: Final[float] = 30.0
"""Seconds the server keeps a registry watch's consumer after its watcher is gone (nats-py's default is 300 s:
every killed router or indexer would leave one behind for five minutes)."""

MAX_DP_RANKS: Final[int] = 4096
"""Largest ``dp_ranks`` a registry record may claim (each rank becomes a route candidate)."""


class RegistryWatcher:
    """The live workers of a registry bucket, kept current by a KV watch (what a router narrows candidates by).

    `live` answers from memory; `run` opens the bucket (waiting for it to exist: ingests create it) and
    applies every put, delete and expiry until cancelled, re-watching after an error.

    Args:
        js: a JetStream context.
        bucket: the registry bucket (`kvmesh.runtime.subjects.registry_bucket` of the stream by default).
        retry_s: seconds between attempts to open or re-watch the bucket.
        members: loads the registry members recorded by the indexers (worker id → model; the snapshot
            bucket's ``member-<worker>`` objects), awaited at each sync; None: only keys seen here count.
    """

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        *,
        retry_s: float = 2.0,
        members: Callable[[], Awaitable[dict[str, str]]] | None = None,
    ) -> None:
        self.workers: dict[str, WorkerRecord] = {}
        """Worker id → its last heartbeat record, for every worker whose key exists."""
        self.known: dict[str, str] = {}
        """Worker id → model of every worker known to heartbeat (key seen here, or a recorded member)."""
        self._members = members
        self.synced = False
        """True once the watch has delivered every key that existed when it started."""
        self._js = js
        self._bucket = bucket
        self._retry_s = retry_s
        self._ranks: dict[str, RankSet | None] = {}
        self._ranks_of: tuple[int, int, int] = (0, 0, 0)
        self.changes = 0
        """Changes of the registered ranks (puts that change a record's model, ranks or stale ranks, deletes,
        resets): each invalidates the per-model `ranks` views; a plain heartbeat does not."""
        self.ttl_s: float | None = None
        """The bucket's max age (the worker TTL: ingests heartbeat every third of it), once opened."""

    async def _until_bucket_gone(self, created: Any) -> None:
        """Return once the bucket no longer exists, or was deleted and created again (its stream's creation
        time changed): a watch on a deleted bucket just goes quiet."""
        while True:
            await asyncio.sleep(self._retry_s)
            try:
                info = await self._js.stream_info(f"KV_{self._bucket}")
            except nats.js.errors.NotFoundError:
                return
            except Exception as exc:  # NATS unreachable: the watch itself reconnects
                log.debug("registry: cannot check %s: %r", self._bucket, exc)
                continue
            if info.created != created:
                return

    def live(self, model: str) -> list[Holder] | None:
        """Return the live (worker id, dp rank)s registered for ``model``, sorted.

        None ("no opinion": use the index's candidates as they are) until the first sync, and when no worker
        of the model is registered and none ever was (`known`): workers that publish without heartbeats (a
        stream fed directly) stay routable. An empty list when every known worker of the model has left (its
        key expired or was deleted, seen here or recorded as a member by an indexer): routing to them would
        send requests to dead engines.
        """
        if not self.synced:
            return None
        out = [
            Holder(w, r)
            for w, rec in self.workers.items()
            if rec.model == model
            for r in range(max(rec.dp_ranks, 1))
        ]
        if out:
            return sorted(out)
        return [] if model in self.known.values() else None

    def ranks(self, model: str) -> RankSet | None:
        """Return the registered ranks of ``model`` with their stale ranks (`WorkerRecord.stale_ranks`).

        None exactly when `live` is None (no opinion). Built once per change of the registry (O(workers)),
        not per call: a route looks ranks up in it without a Python object per rank.
        """
        if not self.synced:
            return None
        version = (self.changes, len(self.workers), len(self.known))
        if version != self._ranks_of:
            self._ranks.clear()
            self._ranks_of = version
        if model in self._ranks:
            return self._ranks[model]
        workers = [
            RegisteredWorker(w, max(rec.dp_ranks, 1), dict(rec.stale_ranks))
            for w, rec in self.workers.items()
            if rec.model == model
        ]
        known = model in self.known.values()
        out = RankSet(workers) if workers or known else None
        self._ranks[model] = out
        return out

    def apply(self, key: str, operation: str | None, value: bytes | None) -> None:
        """Apply one KV entry: a put (``operation`` None) records the worker, a delete or purge drops it."""
        worker = subjects.from_kv_key(key)
        before = self.workers.get(worker)
        self.changes += 1
        if operation is not None:
            self.workers.pop(worker, None)
            return
        try:
            record = protocol.decode(value or b"", WorkerRecord)
        except ProtocolError as exc:
            log.warning("registry: undecodable record for worker %s ignored: %s", worker, exc)
            self.workers.pop(worker, None)
            return
        if not 1 <= record.dp_ranks <= MAX_DP_RANKS:
            log.warning(
                "registry: record for worker %s ignored: dp_ranks %d outside [1, %d]",
                worker,
                record.dp_ranks,
                MAX_DP_RANKS,
            )
            self.workers.pop(worker, None)
            return
        if before is not None and (before.model, before.dp_ranks, before.stale_ranks) == (
            record.model,
            record.dp_ranks,
            record.stale_ranks,
        ):
            self.changes -= 1  # a plain heartbeat: the per-model views stay valid
        self.workers[worker] = record
        self.known[worker] = record.model

    async def _load_members(self) -> None:
        """Add the indexers' recorded registry members to `known` (kept as they are when unreadable)."""
        if self._members is None:
            return
        try:
            self.known.update(await self._members())
            self.changes += 1
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("registry: cannot read the recorded registry members: %r", exc)

    async def run(self) -> None:
        """Watch the bucket until cancelled."""
        while True:
            try:
                kv = await self._js.key_value(self._bucket)
            except nats.js.errors.BucketNotFoundError:
                await asyncio.sleep(self._retry_s)
                continue
            except (nats.errors.Error, TimeoutError) as exc:
                log.debug("registry: cannot open %s yet: %r", self._bucket, exc)
                await asyncio.sleep(self._retry_s)
                continue
            try:
                info = await self._js.stream_info(f"KV_{self._bucket}")
                created = info.created
                self.ttl_s = info.config.max_age or None
                watcher = await kv.watchall(inactive_threshold=WATCH_INACTIVE_S)
                self.workers.clear()
                self.changes += 1
                check = asyncio.create_task(self._until_bucket_gone(created))
                try:
                    async for entry in _until(watcher, check):
                        if entry is None:  # every existing key delivered
                            await self._load_members()
                            self.synced = True
                            continue
                        self.apply(entry.key, entry.operation, entry.value)
                finally:
                    check.cancel()
                    with contextlib.suppress(Exception):
                        await watcher.stop()  # type: ignore[no-untyped-call]
                # The bucket was deleted: what it said is void (its workers are not known to be live).
                log.warning("registry: bucket %s was deleted; watching it again once it exists", self._bucket)
                self.workers.clear()
                self.changes += 1
                self.synced = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("registry: watch of %s failed (%r); watching again", self._bucket, exc)
                self.synced = False
                await asyncio.sleep(self._retry_s)


async def _next_entry(watcher: Any) -> tuple[bool, Any]:
    """``(True, entry)`` for the watcher's next entry, ``(False, None)`` once it has ended."""
    try:
        return True, await watcher.__anext__()
    except StopAsyncIteration:
        return False, None


async def _until(watcher: Any, stop: asyncio.Task[None]) -> AsyncIterator[Any]:
    """Yield the watcher's entries (None marks the end of the initial values) until ``stop`` finishes or the
    watcher ends."""
    while True:
        nxt = asyncio.ensure_future(_next_entry(watcher))
        done, _ = await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
        if nxt not in done:
            nxt.cancel()
            return
        more, entry = nxt.result()
        if not more:
            return
        yield entry
