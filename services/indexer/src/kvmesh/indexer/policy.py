"""The indexer's decisions, sans-I/O: what may be purged, when to snapshot, whom to remove, what to answer.

The service's asyncio shells (`kvmesh.indexer.writer`, `kvmesh.indexer.members`, `kvmesh.indexer.endpoints`)
gather the facts (stream info, the kept snapshots, registry entries, the clock) and carry out what these
functions return; nothing here touches NATS, a clock or a log.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvmesh.core.errors import RequestError
from kvmesh.core.protocol import MatchHolder, MatchReply
from kvmesh.core.state import MatchResult

# ---------------------------------------------------------------------------------------------- retention


def retention_floor(kept_seqs: Sequence[int], keep: int) -> int | None:
    """The first stream sequence the kept snapshots still need, or None while the stream must stay whole.

    Args:
        kept_seqs: ``applied_seq`` of every kept snapshot of the stream as it is now
            (`kvmesh.runtime.snapshots.SnapshotStore.kept`).
        keep: ``--snapshot-keep``; fewer kept snapshots than that keep the whole stream.

    Returns:
        ``min(kept_seqs) + 1`` (the message after the oldest kept snapshot), or None.
    """
    if len(kept_seqs) < keep or not kept_seqs:
        return None
    return min(kept_seqs) + 1


def purge_cut(floor: int, ingest_cursors: Iterable[int], first_seq: int) -> int | None:
    """The stream sequence to purge before, or None when nothing may go.

    Args:
        floor: `retention_floor`.
        ingest_cursors: stream sequence of the last message on each live holder's rank subject (an ingest
            resumes its cursor from it, so it is never purged).
        first_seq: the stream's first sequence now.

    Returns:
        ``min(floor, *ingest_cursors)`` when above ``first_seq`` (purge removes sequences below it), else None.
    """
    cut = min([floor, *ingest_cursors])
    return cut if cut > first_seq else None


# ---------------------------------------------------------------------------------------------- snapshots

NOTHING_NEW = "nothing new since the last snapshot"
"""Why a snapshot that was not forced was not written: the last one holds the same sequence of the stream."""
REBUILDING = "the stream was re-created; this replica is rebuilding from it"
"""Why no snapshot was written: the stream is another one than the state was read from."""


class SnapshotSchedule:
    """When the snapshot writer writes: every ``every_messages`` messages read or ``every_s`` seconds.

    Times are monotonic seconds passed in by the caller (no clock is read here).

    Args:
        every_messages: ``--snapshot-every-messages`` (0: no count trigger).
        every_s: ``--snapshot-every-s`` (0: no time trigger); only with at least one message since the last.
        now: the time the schedule starts at (the first timed snapshot is due ``every_s`` after it).
    """

    __slots__ = ("every_messages", "every_s", "last_at", "since")

    def __init__(self, *, every_messages: int, every_s: float, now: float) -> None:
        self.every_messages = every_messages
        self.every_s = every_s
        self.since = 0
        """Messages read since the last snapshot attempt began (plus those of failed uploads)."""
        self.last_at = now
        """When the last attempt began or failed."""

    def count(self, n: int = 1) -> None:
        """Count ``n`` stream messages read."""
        self.since += n

    def due(self, now: float) -> bool:
        """True when a snapshot should be written at ``now``."""
        if self.every_messages and self.since >= self.every_messages:
            return True
        return bool(self.every_s and self.since > 0 and now - self.last_at >= self.every_s)

    def begin(self, now: float) -> int:
        """A snapshot's state was copied at ``now``: restart both triggers; returns the messages it covers."""
        taken, self.since = self.since, 0
        self.last_at = now
        return taken

    def upload_failed(self, taken: int) -> None:
        """The snapshot begun with `begin` was not stored: its ``taken`` messages count towards the next one,
        so the loop retries at once instead of after another ``every_messages``."""
        self.since += taken

    def attempt_failed(self, now: float) -> None:
        """A snapshot attempt failed at ``now``: the time trigger waits a full interval before the next."""
        self.last_at = now


def nothing_new(*, force: bool, last: Mapping[str, Any] | None, applied_seq: int, stream_id: str) -> bool:
    """True when a snapshot not ``force``d would repeat ``last`` (the same ``applied_seq`` of the same stream).

    Args:
        last: the last written snapshot's result (``"applied_seq"``, ``"stream_id"``), or None before any.
    """
    if force or last is None:
        return False
    return (last["applied_seq"], last.get("stream_id")) == (applied_seq, stream_id)


def stream_recreated(replica_stream_id: str, stream_id_now: str) -> bool:
    """True when the stream now is another than the one the state was read from (both identities known)."""
    return bool(replica_stream_id and stream_id_now and stream_id_now != replica_stream_id)


# ---------------------------------------------------------------------------------------------- members

LiveWorker = Callable[[str], "tuple[str, int] | None"]
"""`kvmesh.core.state.IndexState.live_worker`: worker id → (model, epoch) while live in the index."""


class _Record(Protocol):
    @property
    def model(self) -> str: ...
    @property
    def incarnation(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Removal:
    """Publish `kvmesh.core.events.WorkerRemoved` for this worker."""

    worker_id: str
    model: str
    incarnation: int
    reason: str
    """``"expired"``, ``"deleted"`` (its registry key went) or ``"not registered"`` (a member without a key)."""


@dataclass(frozen=True, slots=True)
class Forget:
    """Delete this worker's ``member-<worker>`` object: it has no key and is not live in the index."""

    worker_id: str


def reconcile_member(
    worker_id: str, model: str, registered: Container[str], live: LiveWorker
) -> Removal | Forget | None:
    """What to do about one registry member once the watch delivered the keys that exist.

    A member (a worker whose key any indexer saw) that has no key now stopped heartbeating while no replica
    watched, and its delete marker may have aged out: it is removed when still live in the index, else
    forgotten. None for a registered member.

    Args:
        model: the model its member object records (used when the index does not name one).
        registered: worker ids with a key now.
        live: `IndexState.live_worker`.
    """
    if worker_id in registered:
        return None
    found = live(worker_id)
    if found is None:
        return Forget(worker_id)
    indexed_model, epoch = found
    return Removal(worker_id, indexed_model or model, epoch, "not registered")


def removal_on_delete(
    worker_id: str, operation: str, record: _Record | None, live: LiveWorker
) -> Removal | None:
    """The removal to publish when a worker's registry key goes, or None when it is not live in the index.

    Args:
        operation: the KV entry's operation, ``"PURGE"`` (aged out: ``"expired"``) or ``"DEL"``
            (``"deleted"``).
        record: its last registry record seen by this replica, or None (the index's model and epoch then).
        live: `IndexState.live_worker`.
    """
    found = live(worker_id)
    if found is None:
        return None  # never indexed, or already removed at an earlier stream point
    model, epoch = found
    return Removal(
        worker_id,
        record.model if record is not None else model,
        record.incarnation if record is not None else epoch,
        "expired" if operation == "PURGE" else "deleted",
    )


class RegistrySync:
    """The registry keys that exist, as one watch delivers them before its end-of-initial-values marker."""

    __slots__ = ("registered", "synced")

    def __init__(self) -> None:
        self.registered: set[str] = set()
        self.synced = False

    def seen(self, worker_id: str, *, present: bool) -> None:
        """A key's entry (``present``: a put with a value); ignored once synced."""
        if self.synced:
            return
        if present:
            self.registered.add(worker_id)
        else:
            self.registered.discard(worker_id)

    def end_of_initial(self) -> bool:
        """The watch's end marker (None entry): True the first time (reconcile now), False after."""
        first, self.synced = not self.synced, True
        return first


# ---------------------------------------------------------------------------------------------- match


def unpack_tokens(packed: bytes) -> array[int]:
    """Token ids from little-endian uint32 bytes.

    Raises:
        RequestError: the length is not a multiple of 4 (``field="token_ids"``).
    """
    if len(packed) % 4:
        raise RequestError(
            f"packed token_ids must be little-endian uint32 (4 bytes each), got {len(packed)} bytes",
            field="token_ids",
        )
    tokens = array("I")
    tokens.frombytes(packed)
    if sys.byteorder == "big":  # pragma: no cover
        tokens.byteswap()
    return tokens


def match_reply(result: MatchResult, replica: str) -> MatchReply:
    """The match reply: the index sequence, the model's block size, the prompt's blocks and one
    `kvmesh.core.protocol.MatchHolder` per holder (its ``health`` only when the holder's index is not exact)."""
    return MatchReply(
        index_seq=result.index_seq,
        block_size=result.block_size,
        prompt_blocks=result.prompt_blocks,
        replica=replica,
        candidates=[
            MatchHolder(
                c.worker_id, c.dp_rank, c.overlap_blocks, c.cached_blocks, c.tiers, c.block_size, c.health
            )
            for c in result.candidates
        ],
    )
