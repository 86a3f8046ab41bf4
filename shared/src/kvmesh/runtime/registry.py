"""The worker registry: one KV key per worker (per node of a multi-node worker), kept alive by heartbeats.

Bucket `kvmesh.runtime.subjects.registry_bucket(stream)`, max age = the worker TTL, with server-placed
delete markers on expiry (nats-server ≥ 2.11) so watchers see a worker go. Value JSON `WorkerRecord`.

Keys (`registry_key`, `parse_registry_key`):

* ``subjects.kv_key(worker_id)``: a worker whose one ingest reads every data-parallel rank (the only form
  before multi-node support; still read and written as it was);
* ``subjects.kv_key(worker_id) + ".dp<start>-<stop>"``: one node of a multi-node worker, whose ingest reads
  ranks ``[start, stop)`` (vLLM ``--data-parallel-start-rank`` / ``--data-parallel-size-local``). Two
  nodes of one worker never share a key, so they never overwrite each other. `kv_key` escapes ``.``, so a
  worker key never holds one.

Readers merge a worker's records into one (`merge_records`): its ranks are the union of its nodes' (a rank no
live node reads counts as stale with reason `NO_NODE`, so routes skip it), its heartbeat the oldest, its
context length the smallest.

Departures. When a worker's last key expires or is deleted, whoever notices first (every indexer replica
watches) publishes `WorkerRemoved` into the events stream on `subjects.control_subject(prefix)` with
``Nats-Msg-Id: removed:<worker>:<incarnation>``, so the copies published by other noticers within the
stream's duplicate window are dropped by the server, and every replica removes the worker at the same
stream sequence. When a node's key goes while other nodes of the worker stay (`node_departure`), its ranks
alone leave: one ingest-style ``Cleared("node_departed")`` per rank the index holds, at that rank's epoch,
on the same control subject (``Nats-Msg-Id: departed:<worker>:<rank>:<epoch>``; `publish_node_departure`),
so every replica empties those holders at one stream point while the worker's other ranks stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from kvmesh.core import protocol
from kvmesh.core.errors import ProtocolError
from kvmesh.core.events import Cleared, EventsMessage, WorkerRemoved, encode_message
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


NODE_TAG: Final[str] = ".dp"
"""What separates a worker's key from a node's rank range in a node record's key."""
NO_NODE: Final[str] = "no_node: no live node of the worker reads this rank"
"""Stale reason of a rank of a multi-node worker that none of its registered nodes reads."""
NODE_DEPARTED: Final[str] = "node_departed"
"""Reason of the Cleared that takes a departed node's ranks out of the index."""


def registry_key(worker_id: str, ranks: range | None = None) -> str:
    """Return the registry key of a worker (``ranks`` None) or of one node reading ``ranks`` of it."""
    key = subjects.kv_key(worker_id)
    return key if ranks is None else f"{key}{NODE_TAG}{ranks.start}-{ranks.stop}"


def parse_registry_key(key: str) -> tuple[str, range | None]:
    """Return ``(worker id, node ranks)`` of a registry key (ranks None for a whole-worker key).

    A key whose node part does not parse (``.dp`` not followed by ``start-stop``) is read as a whole-worker
    key of the unescaped text, as a reader before node keys did.
    """
    base, sep, node = key.partition(NODE_TAG)
    if sep:
        start, dash, stop = node.partition("-")
        if dash and start.isdecimal() and stop.isdecimal() and int(start) < int(stop):
            return subjects.from_kv_key(base), range(int(start), int(stop))
    return subjects.from_kv_key(key), None


def worker_of_key(key: str) -> str:
    """Return the worker id a registry key belongs to (its node's or its own)."""
    return parse_registry_key(key)[0]


def record_ranks(record: WorkerRecord) -> range:
    """Return the data-parallel ranks a record's ingest reads: ``[dp_rank_start, + dp_ranks_local)``, or
    every rank of the worker for a whole-worker record."""
    start = record.dp_rank_start
    local = record.dp_ranks_local if record.dp_ranks_local is not None else record.dp_ranks - start
    return range(start, start + max(local, 0))


def record_key(record: WorkerRecord) -> str:
    """Return the key a record is put under: a node key when it names its local ranks, else the worker's."""
    return registry_key(record.worker_id, record_ranks(record) if record.dp_ranks_local is not None else None)


def record_problem(key: str, record: WorkerRecord) -> str | None:
    """Why a record read under ``key`` cannot be used (None when it can): ranks outside [1, `MAX_DP_RANKS`],
    node ranks outside the worker's, or a node key whose ranks are not the record's."""
    if not 1 <= record.dp_ranks <= MAX_DP_RANKS:
        return f"dp_ranks {record.dp_ranks} outside [1, {MAX_DP_RANKS}]"
    ranks = record_ranks(record)
    if not (ranks.start >= 0 and len(ranks) >= 1 and ranks.stop <= record.dp_ranks):
        return f"node ranks [{ranks.start}, {ranks.stop}) outside the worker's [0, {record.dp_ranks})"
    _, key_ranks = parse_registry_key(key)
    if key_ranks is not None and key_ranks != ranks:
        return (
            f"key names ranks [{key_ranks.start}, {key_ranks.stop}), the record [{ranks.start}, {ranks.stop})"
        )
    return None


def merge_records(records: Sequence[WorkerRecord]) -> WorkerRecord:
    """Return one record for a worker from the records of its nodes (a whole-worker record as it is).

    The merged record covers every rank ``[0, dp_ranks)`` (the largest size any node names); a rank no node
    reads is stale with reason `NO_NODE`, as are the nodes' own stale ranks with theirs. Its model is that of
    the node with the lowest start rank, and a node that names another model is left out (its ranks are
    `NO_NODE`: its engine serves another model). Its heartbeat is the oldest node's, its incarnation the
    highest, its context length and KV capacity the smallest any node reports (a value below 1, which no
    prompt or block fits, is read as unknown), its block size the first node's that knows one; it publishes
    KV events only when every node does (``kv_events``).

    Raises:
        ValueError: ``records`` is empty.
    """
    if not records:
        raise ValueError("merge_records needs at least one record")
    if len(records) == 1 and records[0].dp_ranks_local is None and records[0].dp_rank_start == 0:
        one = records[0]
        if _positive(one.context_length) == one.context_length and (
            _positive(one.kv_capacity_blocks) == one.kv_capacity_blocks
        ):
            return one
        return msgspec.structs.replace(
            one,
            context_length=_positive(one.context_length),
            kv_capacity_blocks=_positive(one.kv_capacity_blocks),
        )
    ordered = sorted(records, key=lambda r: (r.dp_rank_start, r.dp_ranks_local or 0))
    ordered = [r for r in ordered if r.model == ordered[0].model]
    size = max(r.dp_ranks for r in ordered)
    covered: set[int] = set()
    stale: dict[int, str] = {}
    for rec in ordered:
        own = record_ranks(rec)
        covered.update(own)
        stale.update((r, why) for r, why in rec.stale_ranks.items() if r in own)
    for r in range(size):
        if r not in covered:
            stale[r] = NO_NODE

    def smallest(values: Iterable[int | None]) -> int | None:
        known = [v for v in values if v is not None and v >= 1]
        return min(known) if known else None

    first = ordered[0]
    return WorkerRecord(
        worker_id=first.worker_id,
        model=first.model,
        dp_ranks=size,
        block_size=next((r.block_size for r in ordered if r.block_size is not None), None),
        incarnation=max(r.incarnation for r in ordered),
        heartbeat_ts=min(r.heartbeat_ts for r in ordered),
        stale_ranks=dict(sorted(stale.items())),
        context_length=smallest(r.context_length for r in ordered),
        kv_capacity_blocks=smallest(r.kv_capacity_blocks for r in ordered),
        kv_events=all(r.kv_events for r in ordered),
    )


def _positive(value: int | None) -> int | None:
    """``value`` when it is a positive count, else None (unknown)."""
    return value if value is not None and value >= 1 else None


def record_warnings(key: str, record: WorkerRecord) -> list[str]:
    """What a usable record read under ``key`` says that is read otherwise (for a warning): a context length
    or KV capacity below 1 (read as unknown)."""
    out = []
    if record.context_length is not None and record.context_length < 1:
        out.append(f"context_length {record.context_length} is read as unknown")
    if record.kv_capacity_blocks is not None and record.kv_capacity_blocks < 1:
        out.append(f"kv_capacity_blocks {record.kv_capacity_blocks} is read as unknown")
    return out


async def heartbeat(kv: Any, record: WorkerRecord) -> int:
    """Put one heartbeat (restarting the key's TTL) under `record_key`; returns the revision."""
    return int(await kv.put(record_key(record), protocol.encode(record)))


async def deregister(kv: Any, worker_id: str, ranks: range | None = None) -> None:
    """Delete a worker's key, or one node's (``ranks``): a clean departure, watchers publish its removal."""
    await kv.delete(registry_key(worker_id, ranks))


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
    """Return every registered (live) worker: worker id → its last heartbeat record (its nodes' records
    merged, `merge_records`).

    Creates no server state (no consumer): the keys come from the bucket's stream info and each record from
    a direct get. Keys deleted, purged or aged out (a server marker) and undecodable records are skipped.
    """
    by_worker: dict[str, list[WorkerRecord]] = {}
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
            record = protocol.decode(entry.value, WorkerRecord)
        except ProtocolError:
            continue
        if record_problem(key, record) is None:
            by_worker.setdefault(worker_of_key(key), []).append(record)
    return {w: merge_records(recs) for w, recs in by_worker.items()}


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


async def key_present(kv: Any, worker_id: str, ranks: range | None = None) -> bool:
    """Whether ``worker_id``'s registry key (one node's, with ``ranks``) exists, by a direct get of that key
    (creates no server state).

    Returns False only on a definite answer: no message for the key, or its last one is a delete, a purge
    or an age-out marker. True when the key holds a record.

    Raises:
        nats.errors.Error, TimeoutError: no definite answer (timeout, no responders, bucket unreadable);
            callers must not treat the worker as gone.
    """
    return (await read_key(kv, registry_key(worker_id, ranks))).kind == "record"


WRONG_LAST_SEQUENCE: Final[int] = 10071
"""JetStream's error code for a write whose expected last subject sequence (KV revision) did not match."""

KeyKind = Literal["record", "expired", "deleted", "missing"]


@dataclass(frozen=True, slots=True)
class KeyState:
    """The last message on one registry key, read by a direct get (`read_key`).

    ``kind``: ``"record"`` (a heartbeat's record), ``"expired"`` (the server's age-out marker: no heartbeat
    within the TTL, and no indexer has claimed the expiry yet), ``"deleted"`` (a delete: a clean stop, or an
    indexer's claim of an expiry, `claim_expiry`, after which the worker is removed from the index) or
    ``"missing"`` (no message at all: never registered, or its marker aged out too). ``revision``: that
    message's stream sequence (0 when missing), what a conditional write names as the last revision.
    """

    kind: KeyKind
    revision: int


def wrong_revision(exc: BaseException) -> bool:
    """True for a conditional write refused because the key changed (nats-py raises it as
    ``KeyWrongLastSequenceError`` from ``update`` and as a plain API error from ``delete``)."""
    if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError):
        return True
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code == WRONG_LAST_SEQUENCE


async def read_key(kv: Any, key: str) -> KeyState:
    """The last message on registry ``key`` (`KeyState`), by a direct get (no consumer).

    Raises:
        nats.errors.Error, TimeoutError: no definite answer (timeout, no responders, bucket gone).
    """
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError as exc:
        found = getattr(exc, "entry", None)
        if found is not None:  # a delete or purge marker
            return KeyState("deleted", int(found.revision))
        js, stream, _ = bucket_stream(kv)
        await js.stream_info(stream)  # raises NotFoundError if the bucket itself is gone
        return KeyState("missing", 0)
    return KeyState("record" if entry.value else "expired", int(entry.revision))


async def put_record(kv: Any, record: WorkerRecord, *, last: int) -> int:
    """Put ``record`` under `record_key` only if the key's last revision is still ``last`` (0: no message);
    returns the new revision.

    Raises:
        nats.js.errors.KeyWrongLastSequenceError: the key changed since (`wrong_revision`).
    """
    return int(await kv.update(record_key(record), protocol.encode(record), last=last))


async def claim_expiry(kv: Any, key: str, revision: int) -> KeyState:
    """Claim an aged-out key for removal: a delete that holds only while the age-out marker at ``revision``
    is still the key's last message, so it races the worker's own re-registration (`put_record` with the
    marker's revision) and exactly one of the two wins.

    Returns:
        ``deleted`` when the key is deleted now (by this claim, revision 0: not read back, or by another
        replica's: publish the removal),
        ``record`` when the worker registered again first (keep it), ``expired`` at a later revision (a
        newer expiry, claimed by its own watch event) or ``missing``.

    Raises:
        nats.errors.Error, TimeoutError: no definite answer.
    """
    try:
        await kv.delete(key, last=revision)
        return KeyState("deleted", 0)
    except Exception as exc:
        if not wrong_revision(exc):
            raise
    return await read_key(kv, key)


async def worker_present(kv: Any, worker_id: str) -> bool:
    """Whether any registry key of ``worker_id`` exists: its own or one of its nodes' (`key_present` each).

    Raises:
        nats.errors.Error, TimeoutError: no definite answer; callers must not treat the worker as gone.
    """
    if await key_present(kv, worker_id):
        return True
    js, stream, prefix = bucket_stream(kv)
    node_prefix = f"{prefix}{subjects.kv_key(worker_id)}{NODE_TAG}"
    info = await js.stream_info(stream, subjects_filter=f"{prefix}{subjects.kv_key(worker_id)}.>")
    for subject in sorted(info.state.subjects or {}):
        if not subject.startswith(node_prefix):
            continue
        worker, ranks = parse_registry_key(subject[len(prefix) :])
        if worker == worker_id and ranks is not None and await key_present(kv, worker_id, ranks):
            return True
    return False


async def node_records(kv: Any, worker_id: str) -> dict[str, WorkerRecord]:
    """Return the node records of ``worker_id`` that exist now (node key → record), by direct gets of the
    node keys its bucket's stream lists; creates no server state. Undecodable or unusable records count as
    absent.

    Raises:
        nats.errors.Error, TimeoutError: the bucket's stream or a key cannot be read (no definite answer).
    """
    js, stream, prefix = bucket_stream(kv)
    base = subjects.kv_key(worker_id)
    info = await js.stream_info(stream, subjects_filter=f"{prefix}{base}.>")
    out: dict[str, WorkerRecord] = {}
    for subject in sorted(info.state.subjects or {}):
        key = subject[len(prefix) :]
        worker, ranks = parse_registry_key(key)
        if worker != worker_id or ranks is None:
            continue
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue
        if not entry.value:
            continue
        with contextlib.suppress(ProtocolError):
            record = protocol.decode(entry.value, WorkerRecord)
            if record_problem(key, record) is None:
                out[key] = record
    return out


def uncovered_ranks(held: Iterable[int], records: Iterable[WorkerRecord]) -> tuple[int, ...]:
    """Return the ranks in ``held`` (a worker's ranks in the index) that none of ``records`` reads, sorted."""
    covered: set[int] = set()
    for record in records:
        covered.update(record_ranks(record))
    return tuple(sorted(set(held) - covered))


@dataclass(frozen=True, slots=True)
class NodeDeparture:
    """One node of a multi-node worker left while others stay: its ranks leave, the worker does not."""

    worker_id: str
    ranks: Sequence[int]
    """The node's ranks (a ``range`` from its key; the uncovered ranks found by a reconcile)."""
    model: str | None
    """The model its last record named (None: not seen; the index's then)."""


def node_departure(key: str, record: WorkerRecord | None, remaining: Iterable[str]) -> NodeDeparture | None:
    """Return the departure of the node whose key ``key`` went, or None when the key is a whole worker's or
    the worker has no other key in ``remaining`` (its last node: the worker itself leaves).

    Args:
        key: the registry key deleted or aged out.
        record: its last record seen, or None.
        remaining: the registry keys that still exist.
    """
    worker, ranks = parse_registry_key(key)
    if ranks is None or not any(worker_of_key(k) == worker for k in remaining if k != key):
        return None
    return NodeDeparture(worker, ranks, record.model if record is not None else None)


def last_node_incarnation(epochs: Mapping[int, int], incarnation: int) -> int:
    """The epoch a multi-node worker's removal (its last node gone) names: the lowest of its ranks' epochs
    in the index (``epochs``; ``incarnation`` when it holds none).

    A removal drops later messages of an epoch at or below it on every rank. The last node's incarnation is
    the highest epoch of *its* ranks only: another node, whose ranks are at lower epochs, rejoins one above
    its own highest and would be dropped as stale. The lowest epoch is below every node's next incarnation.
    """
    return min(epochs.values(), default=incarnation)


def departure_msg_id(worker_id: str, dp_rank: int, epoch: int) -> str:
    """The ``Nats-Msg-Id`` of one rank's node-departure Cleared: equal for every noticer of one departure."""
    return f"departed:{worker_id}:{dp_rank}:{epoch}"


async def publish_node_departure(
    js: JetStreamContext,
    *,
    stream: str,
    events_prefix: str,
    departure: NodeDeparture,
    model: str,
    epochs: Mapping[int, int],
) -> list[int]:
    """Take a departed node's ranks out of the index: one ``Cleared(NODE_DEPARTED)`` per rank of it that the
    index holds (``epochs``: dp_rank → its epoch in the index), at that epoch, so it empties the holder
    without starting an epoch (a node that rejoins starts a higher one). Returns their stream sequences."""
    seqs = []
    for r in departure.ranks:
        epoch = epochs.get(r)
        if epoch is None:
            continue
        msg = EventsMessage(
            worker_id=departure.worker_id,
            dp_rank=r,
            model=model,
            block_size=0,  # says nothing about the worker's block size
            epoch=epoch,
            seq=-1,
            events=[Cleared(NODE_DEPARTED)],
        )
        ack = await js.publish(
            subjects.control_subject(events_prefix),
            encode_message(msg),
            stream=stream,
            headers={"Nats-Msg-Id": departure_msg_id(departure.worker_id, r, epoch)},
        )
        seqs.append(int(ack.seq))
    return seqs


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
        """Worker id → its last heartbeat record (its nodes' merged, `merge_records`), for every worker with
        a key."""
        self.records: dict[str, WorkerRecord] = {}
        """Registry key → its last record (one per node of a multi-node worker)."""
        self._keys: dict[str, set[str]] = {}
        """Worker id → its keys in `records`."""
        self.known: dict[str, str] = {}
        """Worker id → model of every worker known to heartbeat (key seen here, or a recorded member)."""
        self._mismatched: set[str] = set()
        """Node keys whose record names another model than their worker's merged record (warned once)."""
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
            if rec.stale_ranks.get(r) != NO_NODE
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
            RegisteredWorker(w, max(rec.dp_ranks, 1), dict(rec.stale_ranks), rec.context_length)
            for w, rec in self.workers.items()
            if rec.model == model
        ]
        known = model in self.known.values()
        out = RankSet(workers) if workers or known else None
        self._ranks[model] = out
        return out

    def apply(self, key: str, operation: str | None, value: bytes | None) -> None:
        """Apply one KV entry: a put (``operation`` None) records the worker's (or its node's) record, a delete
        or purge drops it; the worker's merged record follows (it goes with its last key)."""
        worker = worker_of_key(key)
        self.changes += 1
        if operation is not None:
            self.records.pop(key, None)
            self._merge(worker)
            return
        try:
            record = protocol.decode(value or b"", WorkerRecord)
        except ProtocolError as exc:
            log.warning("registry: undecodable record for worker %s ignored: %s", worker, exc)
            self.records.pop(key, None)
            self._merge(worker)
            return
        problem = record_problem(key, record)
        if problem is not None:
            log.warning("registry: record for worker %s ignored: %s", worker, problem)
            self.records.pop(key, None)
            self._merge(worker)
            return
        before = self.workers.get(worker)
        prev = self.records.get(key)
        if prev is None or (prev.context_length, prev.kv_capacity_blocks) != (
            record.context_length,
            record.kv_capacity_blocks,
        ):
            for why in record_warnings(key, record):
                log.warning("registry: record %s of worker %s: %s", key, worker, why)
        self.records[key] = record
        self._keys.setdefault(worker, set()).add(key)
        self._merge(worker)
        merged = self.workers[worker]
        if merged.model == record.model:
            self._mismatched.discard(key)
        elif key not in self._mismatched:
            self._mismatched.add(key)
            log.warning(
                "registry: node %s of worker %s names model %r, its other nodes %r: its ranks are not routed",
                key,
                worker,
                record.model,
                merged.model,
            )
        after = self.workers[worker]
        if before is not None and _routing_view(before) == _routing_view(after):
            self.changes -= 1  # a plain heartbeat: the per-model views stay valid
        self.known[worker] = record.model

    def _merge(self, worker: str) -> None:
        """Rebuild ``worker``'s merged record from its keys' records (drop it when none is left)."""
        keys = self._keys.setdefault(worker, set())
        keys.intersection_update(self.records)
        own = [self.records[k] for k in sorted(keys)]
        if own:
            self.workers[worker] = merge_records(own)
        else:
            self.workers.pop(worker, None)
            del self._keys[worker]

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
                self.records.clear()
                self._keys.clear()
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
                self.records.clear()
                self._keys.clear()
                self.changes += 1
                self.synced = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("registry: watch of %s failed (%r); watching again", self._bucket, exc)
                self.synced = False
                await asyncio.sleep(self._retry_s)


def _routing_view(record: WorkerRecord) -> tuple[object, ...]:
    """What routes read of a merged record: a heartbeat that changes none of it changes no route."""
    return (record.model, record.dp_ranks, record.stale_ranks, record.context_length)


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
