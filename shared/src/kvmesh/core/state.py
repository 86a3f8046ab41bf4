"""The indexer's whole state: one `PrefixIndex` per (model, block size), fed stream messages in order.

Pure code. `IndexState.apply(stream_seq, message)` is the only way state changes, so two replicas that
applied the same stream up to the same sequence are equal (compare `digest()`).

Rules applied here, besides the index's own:

* Each (worker, dp_rank) has an engine incarnation (``epoch``). A message with a newer epoch clears that
  holder first (ingest also publishes a clear, this makes replay safe on its own); a message with an older
  epoch is stale and dropped.
* `WorkerRemoved` drops every dp rank of the worker; later messages of the removed incarnation (epoch ≤ the
  removed one) are dropped, a newer incarnation is accepted again. A WorkerRemoved that reaches the stream
  after the worker came back (every rank already at a newer epoch: the claimer of its expiry published late)
  removes nothing, nor does one of an epoch at or below the one already removed; both are counted in
  ``stale_removals``.
* `IndexReset` forgets everything (index and worker bookkeeping) and raises ``reset_epoch``.
* A Stored or Removed event's ``medium`` selects the holder's storage tier in the index (no medium: GPU);
  `match` reports each candidate's overlap per tier in `HolderMatch.tiers`.
* After a gap in the stream (`mark_gap`: the messages between a snapshot and the stream's first one are
  gone), every holder is *incomplete* until a Cleared (or a new engine epoch) rebuilds it from nothing.
* A worker id seen under another model than its current incarnation's is a **new incarnation** (a new
  ingest, whose epochs start again at 0 on new subjects): its old entries and bookkeeping are dropped and its
  epochs count afresh. A WorkerRemoved's ``stale_through`` applies only to messages of the removed
  incarnation's model, so a re-used id under another model is never dropped as stale; and a WorkerRemoved
  naming another model than the live incarnation's (the earlier incarnation's key expiring late) is ignored
  and counted (``stale_removals``).

Engine order per holder
-----------------------

Per (worker, dp_rank) and epoch, stream order must equal engine order. A message's position is its engine
sequence range ``first_seq..seq`` (``first_seq`` None: ``seq..seq``) and its ``part`` (parts 0..n of one
split batch share ``seq``). A message is an **engine message** when it carries a Stored, Placed or Removed event or
an engine ``Cleared("engine")``; the holder's *cursor* is the position of the last engine message applied.

* The first engine message of an epoch is applied whatever its sequence (an ingest may attach to an engine
  that already counted past 0).
* An engine message that continues the cursor is applied: ``first_seq == cursor + 1`` (a new batch, part 0)
  or the same ``seq`` with the next ``part``.
* An engine message past the cursor that does not continue it (``first_seq > cursor + 1``, a part skipped,
  or a new batch starting at a part above 0) means an earlier message is still to come: the ingest clears
  before it delivers past a gap it cannot heal, so a gap in the stream is a **re-ordered stream** (a publish
  that failed during a stream leader election and was re-sent after later ones landed). The message is
  **held** (``held_messages``; the holder reads ``"held"``) and applied, with everything held after it, as
  soon as the message it waits for arrives: the index ends exactly as if the stream were in engine order.
  An ingest Cleared voids the held messages up to its seq and releases the rest. When the missing message
  does not come within `HOLD_MAX_MESSAGES` held messages or `HOLD_MAX_STREAM_SEQS` stream messages (it was
  lost with a crashed ingest; the stream bound also expires the hold of a holder that sends nothing more),
  the hold is given up (``released_holds``): the held messages apply in engine
  order, each skip counted in ``sequence_gaps``, and the holder reads ``"gap"``. Held messages are part of
  the state (snapshots keep them), so every replica holds and releases at the same stream sequence.
* An engine message at or before the cursor is **refused** (nothing of it applies):

  - a repeat of exactly the cursor's ``(seq, part)``, or an older message while the holder has no gap since
    its last rebuild, is a **duplicate**: everything up to the cursor was applied (or voided by a later
    Cleared), so it is ignored and counted in ``duplicate_messages``; the holder stays exact (correctness
    does not depend on JetStream's duplicate window);
  - an older message at or after the first sequence missing since the last rebuild, or one whose range
    straddles the cursor (``first_seq <= cursor < seq``), is **out of order**: it is counted in
    ``out_of_order`` and the holder becomes incomplete with reason ``"out_of_order"`` (it may be the missing
    content, which can no longer be applied in engine order).

  Trailing parts of a split batch that never arrive cannot be seen (a message does not carry the part count).
* A message whose range runs backwards (``first_seq > seq``) is refused and counted in
  ``malformed_messages``.
* Ingest-made messages always apply, whatever their sequence. A hello (no events, ``seq`` the ingest's
  cursor, -1 before any batch) changes nothing but the cursor: a message without events at ``seq ≥ 0``
  moves it forward under the rules above (an engine batch whose events were all skipped is one too, so the
  batch after it is no gap). An ingest ``Cleared`` (reason other than ``"engine"``, ``seq`` the ingest's
  cursor, which may be at or past batches that follow it) empties the holder and is a **rebuild**: the
  cursor stays where it was (the ingest delivers only later batches after it) but the next engine message
  may skip ahead without being a gap. A rebuild, an engine ``Cleared``, or a new epoch makes the holder
  exact again.

`holder_health()` lists every live holder that is not exact, with its reason (``"stream_gap"`` for the
snapshot gap above, ``"held"``, ``"gap"``, ``"out_of_order"``); `match` reports it per candidate (`HolderMatch.health`).

Shared caches (backends)
------------------------

A holder whose messages name ``readers`` (`EventsMessage.readers`: an RFC #1527 ``backend_id`` that is no
routable instance, such as a per-node CPU/disk pool, published by ``kvmesh ingest --backend-of``) is a
**backend**: it is never a candidate, and `match` counts its blocks for every holder of each worker that
reads it (same model and block size), at the backend's tiers. A reader's overlap is the longest leading run
of prompt blocks held on any of its own tiers or by any backend it reads, each block on its fastest tier
among them (`HolderMatch.tiers`); its ``cached_blocks`` stay its own. The readers are the last ones the
backend's applied messages named; a replica restored from a snapshot learns them again from the backend's
next message (snapshots do not keep them: until then the backend's blocks count for no one, and it is not
excluded from the candidates of a match without a registry). Cost: one index lookup per prompt block of the
readers' combined run, on top of the match.

Block sizes
-----------

A model's workers normally share one block size. A worker whose events use another size is indexed under
that size, and `match` scores every holder in its own block size (`HolderMatch.block_size`,
``overlap_tokens``); `MatchResult.block_size` stays the size with the most holders.

`export()` copies the whole state cheaply (dict copies, no per-block Python work) and `from_export()`
rebuilds it; `kvmesh.core.snapshot` turns an export into bytes and back.
"""

from __future__ import annotations

import bisect
import heapq
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Final, cast

import msgspec
import xxhash

from kvmesh.core import tables
from kvmesh.core.errors import RequestError, UnknownModelError
from kvmesh.core.events import (
    Cleared,
    Event,
    EventsMessage,
    IndexReset,
    Message,
    Placed,
    Removed,
    Stored,
    StoredKeys,
    WorkerRemoved,
    decode_message,
    encode_message,
)
from kvmesh.core.hashing import (
    SEED,
    iter_prefix_keys,
    prefix_keys,
)
from kvmesh.core.index import DEFAULT_TIER, Holder, IndexExport, Overlap, PrefixIndex, tier_rank


class HolderMatch(msgspec.Struct, frozen=True, kw_only=True):
    """One candidate in a match answer (immutable; a msgspec struct, built in about a tenth of a frozen
    dataclass's time: a match of a fleet of 1,024 workers builds 1,024 of them)."""

    worker_id: str
    dp_rank: int
    overlap_blocks: int
    """Leading full blocks of the prompt this holder has cached."""
    cached_blocks: int
    """All blocks indexed for this holder, one per tier a block is on (its cache size, a load proxy for ties)."""
    tiers: dict[str, int] | None = None
    """The overlap blocks per storage tier (``{"GPU": 4, "CPU": 4}``), each block on its fastest tier (GPU, CPU,
    then the others by name; `kvmesh.core.index`); None when they are all on the default tier (GPU)."""
    block_size: int = 0
    """Tokens per block of this holder: ``overlap_blocks`` and ``cached_blocks`` count blocks of this size
    (0 while its block size is not known: then it has nothing cached)."""
    overlap_tokens: int = 0
    """Leading prompt tokens this holder has cached (``overlap_blocks × block_size``)."""
    health: str | None = None
    """None when the holder's index is exact, else why it may not be (`IndexState.holder_health`)."""


class MatchResult(msgspec.Struct, frozen=True, kw_only=True):
    """Answer of `IndexState.match` (immutable; a msgspec struct, as `HolderMatch`: built once per route).

    Attributes:
        index_seq: stream sequence the state had applied.
        block_size: tokens per block of the model's index, the size with the most holders (0 when no holder's
            size is known). Each candidate's own size is `HolderMatch.block_size`.
        prompt_blocks: full blocks of ``block_size`` in the prompt.
        candidates: every known holder of the model, zero overlap included, sorted by (worker, rank).
    """

    index_seq: int
    block_size: int
    prompt_blocks: int
    candidates: tuple[HolderMatch, ...]


@dataclass(slots=True)
class _Counters:
    messages: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    duplicate_stores: int = 0
    unknown_removals: int = 0
    held_events: int = 0
    dropped_orphans: int = 0
    stale_messages: int = 0
    clears: int = 0
    workers_removed: int = 0
    stale_removals: int = 0
    """WorkerRemoved messages that did not remove the worker: they named another model than its live incarnation,
    an epoch below all of its ranks' (it came back before the removal landed), or one already removed."""
    duplicate_messages: int = 0
    """Engine messages refused as repeats of what a holder already applied."""
    out_of_order: int = 0
    """Engine messages refused because they came after later ones of their holder."""
    sequence_gaps: int = 0
    """Engine messages applied after a holder's engine sequence skipped ahead (given up waiting)."""
    held_messages: int = 0
    """Engine messages held because they came before earlier ones of their holder (a re-ordered stream)."""
    released_holds: int = 0
    """Holds given up (the missing messages did not come within the bounds): applied with a gap."""
    incarnations: int = 0
    """Workers seen again under another model (a new incarnation)."""
    evicted_blocks: int = 0
    """Blocks dropped to keep the state within its ``max_blocks`` bound (`IndexState`)."""
    malformed_messages: int = 0
    """Messages refused as impossible for an ingest to make (``first_seq`` above ``seq``)."""
    placed_blocks: int = 0
    """Copies of known blocks indexed on another tier (`Placed`: tokenless BlockStored events)."""
    unknown_placements: int = 0
    """Copies of blocks their holder had on no tier (ignored)."""


@dataclass(slots=True)
class _WorkerInfo:
    model: str
    block_size: int
    epochs: dict[int, int] = field(default_factory=dict)
    last_seq: dict[int, int] = field(default_factory=dict)
    last_ts: float = 0.0
    removed_epoch: int | None = None
    stale_through: int | None = None
    """Epoch of the last WorkerRemoved: messages with an epoch ≤ it stay dropped even after a rejoin."""
    stale_model: str | None = None
    """Model of the removed incarnation: ``stale_through`` applies to messages of this model only."""
    seqs: dict[int, HolderSeq] = field(default_factory=dict)
    """dp_rank → engine order of the current epoch."""
    readers: tuple[str, ...] = ()
    """Workers that read this one's blocks (it is a backend: `EventsMessage.readers`); empty: an instance."""


@dataclass(slots=True)
class HolderSeq:
    """Engine order of one holder within its epoch (see the module docstring)."""

    seq: int | None = None
    """Engine sequence of the last engine message applied, None before the first of the epoch."""
    part: int = 0
    """Its part (split batches)."""
    free: bool = True
    """The next engine message may skip ahead (the epoch's first, or the first after an ingest Cleared)."""
    gap_from: int | None = None
    """First engine sequence missing since the last rebuild, or None."""
    health: str | None = None
    """Why the holder is not exact (``"gap"``, ``"out_of_order"``), or None."""
    held: list[EventsMessage] = field(default_factory=list)
    """Messages that came past a gap in the engine sequence, in engine order, waiting for the missing ones."""
    held_since: int = 0
    """Stream sequence at which the oldest held message arrived."""

    def rebuilt(self) -> None:
        """The holder was emptied: it is exact again."""
        self.gap_from = None
        self.health = None

    def flag(self, reason: str) -> None:
        """Mark the holder incomplete; ``"out_of_order"`` (the cause found) overrides ``"gap"``."""
        if self.health is None or reason == "out_of_order":
            self.health = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerExport:
    """One worker's bookkeeping, detached from the live state (see `IndexState.export`)."""

    worker_id: str
    model: str
    block_size: int
    epochs: dict[int, int]
    """dp_rank → engine epoch."""
    last_seq: dict[int, int]
    """dp_rank → last engine sequence."""
    last_ts: float
    removed_epoch: int | None
    stale_through: int | None
    stale_model: str | None = None
    seqs: dict[int, tuple[int | None, int, bool, int | None, str | None]] = field(default_factory=dict)
    """dp_rank → engine order ``(seq, part, free, gap_from, health)`` (`HolderSeq`)."""
    held: dict[int, tuple[int, tuple[bytes, ...]]] = field(default_factory=dict)
    """dp_rank → (stream seq the hold began, held messages encoded with `encode_message`), held ranks only."""
    readers: tuple[str, ...] = ()
    """Workers that read this one's blocks (a backend pool, `EventsMessage.readers`); empty: an instance."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StateExport:
    """An `IndexState`'s complete state as of ``applied_seq`` (what a snapshot holds)."""

    applied_seq: int
    reset_epoch: int
    counters: dict[str, int]
    workers: tuple[WorkerExport, ...]
    indexes: tuple[tuple[str, int, IndexExport], ...]
    """``(model, block_size, index)`` in the state's own order."""
    gap_seq: int | None
    """Stream sequence after which messages were lost (see `IndexState.mark_gap`), or None."""
    healed: tuple[Holder, ...]
    """Holders rebuilt from nothing since the gap."""


@dataclass(frozen=True, slots=True)
class _IndexView:
    """`IndexState._view`: what a match of one index needs besides the overlaps, as of one state version."""

    zeros: list[tuple[Holder, HolderMatch]]
    """The index's holders of workers not removed, sorted, each with its match of no leading block (entries
    replaced in place when only some holders changed: `IndexState._fresh_views`)."""
    backends: dict[Holder, tuple[str, ...]]
    """Holders that are backends (cache pools) → the workers that read them."""
    holders: tuple[Holder, ...]
    """`PrefixIndex.sorted_holders` when the view was built: another object means the set of holders changed."""
    at: dict[Holder, int]
    """Holder → its position in ``zeros``."""
    block_size: int
    depths: dict[int, list[HolderMatch]] = field(default_factory=dict)
    """Overlap → every holder's answer at that overlap, in ``zeros``' order (`_candidates`; kept in step
    with ``zeros``)."""


_DEPTHS_KEPT: Final[int] = 8
"""Overlaps whose every-holder answers a view keeps (`_IndexView.depths`); more, and it starts again."""


def _candidates(index: PrefixIndex, view: _IndexView, keys: tables.U64) -> tuple[HolderMatch, ...]:
    """Every holder's `HolderMatch` of an untiered index without backends, in the view's order. When every
    holder holds the prompt's first block, the answers at the overlap most of them share are the view's kept
    list for that overlap (`_IndexView.depths`), copied, and only the holders that differ are built."""
    common, others = index.match_common(keys)
    zeros, bs, with_blocks = view.zeros, view.block_size, msgspec.structs.replace
    if common:
        kept = view.depths.get(common)
        if kept is None:
            if len(view.depths) >= _DEPTHS_KEPT:
                view.depths.clear()
            kept = view.depths[common] = [
                with_blocks(zero, overlap_blocks=common, overlap_tokens=common * bs) for _h, zero in zeros
            ]
        out = list(kept)
        at = view.at
        for h, depth in others.items():
            k = at.get(h)  # a holder outside the view (a removed worker's) is no candidate, as below
            if k is not None:
                out[k] = with_blocks(zeros[k][1], overlap_blocks=depth, overlap_tokens=depth * bs)
        return tuple(out)
    get = others.get
    return tuple(
        [
            zero if (n := get(h)) is None else with_blocks(zero, overlap_blocks=n, overlap_tokens=n * bs)
            for h, zero in zeros
        ]
    )


class IndexState:
    """Every model's prefix index plus per-worker bookkeeping, as of one stream sequence.

    Args:
        max_blocks: bound on indexed blocks over every model (`block_total`), or None for no bound. After a
            message takes the state above it, the largest (holder, tier) caches lose their least recently
            stored blocks until the state is `EVICT_SLACK` below it (`PrefixIndex.evict_to`; counted in
            ``counters.evicted_blocks``). Every replica fed the same stream with the same bound drops the
            same blocks.

    Raises:
        ValueError: ``max_blocks`` is not positive, or above `MAX_BLOCKS_LIMIT`.
    """

    def __init__(self, *, max_blocks: int | None = None) -> None:
        if max_blocks is not None and max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        if max_blocks is not None and max_blocks > MAX_BLOCKS_LIMIT:
            raise ValueError(f"max_blocks must be at most {MAX_BLOCKS_LIMIT}, got {max_blocks}")
        self.max_blocks = max_blocks
        self._indexes: dict[str, dict[int, PrefixIndex]] = {}
        self._workers: dict[str, _WorkerInfo] = {}
        self.applied_seq = 0
        """Last stream sequence applied (0 before any)."""
        self.counters = _Counters()
        self.reset_epoch = 0
        """Operator resets applied so far (`IndexReset`)."""
        self.gap_seq: int | None = None
        """Stream sequence after which messages were lost, or None when the state is whole."""
        self._healed: set[Holder] = set()
        self._digest: tuple[tuple[int, int, int], int] | None = None
        self._track_digest = False
        """Whether the indexes keep their digests incrementally (on since the first `digest` call)."""
        self._holds: list[tuple[int, str, int]] = []
        """Heap of (stream seq a hold began, worker, rank), stale entries included: where holds expire."""
        self._version = 0
        """Raised by every change (`apply`, `mark_gap`): what `_views` are valid for."""
        self._views: dict[PrefixIndex, _IndexView] = {}
        self._lives: dict[str, dict[int, PrefixIndex]] = {}
        """model → `_live_indexes`' answer, as of ``_views_version`` (never handed out: callers get a copy)."""
        self._views_version = -1
        self._touched: set[Holder] = set()
        """Holders whose messages were applied since ``_views_version``: the only holders whose cached block
        count or health can have changed, unless ``_restructured``."""
        self._restructured = False
        """Whether anything but the ``_touched`` holders' own messages changed the state since
        ``_views_version`` (a worker removed or moved, a hold given up, an eviction, a gap, backend readers):
        every view is rebuilt then."""

    # ------------------------------------------------------------------ apply

    def apply(self, stream_seq: int, message: Message) -> None:
        """Apply one stream message.

        Args:
            stream_seq: the JetStream sequence of the message (must rise; older ones are ignored).
            message: the decoded message.
        """
        if stream_seq <= self.applied_seq:
            return
        self._version += 1
        self.applied_seq = stream_seq
        self.counters.messages += 1
        try:
            if isinstance(message, WorkerRemoved):
                self._restructured = True
                self._remove_worker(message)
            elif isinstance(message, IndexReset):
                self._restructured = True
                self._reset(message)
            else:
                self._apply_events(message)
            self._release_overdue()
        except BaseException:
            self._restructured = True  # half applied: nothing assumed about what changed
            raise
        finally:
            # Also after a message that failed half-way (the reader skips it, its first events stay applied):
            # the bound holds after every stream message, and a replica restored from a snapshot taken now
            # does not cut at another point of the stream than this one.
            if self.max_blocks is not None and self.block_total() > self.max_blocks:
                self._restructured = True
                self._evict(self.max_blocks)

    def skip(self, stream_seq: int) -> None:
        """Pass over a stream message that cannot be applied (undecodable, or its apply failed): the applied
        sequence moves to ``stream_seq`` (never back), nothing else changes."""
        self.applied_seq = max(self.applied_seq, stream_seq)

    def mark_gap(self, after_seq: int) -> None:
        """Record that messages after ``after_seq`` were lost (the stream no longer holds them).

        Every holder known now or seen later counts as incomplete until a Cleared or a new engine epoch
        rebuilds it from nothing; `incomplete()` lists them. The index itself is unchanged.
        """
        self._version += 1
        self._restructured = True
        self.gap_seq = after_seq
        self._healed.clear()

    def incomplete(self) -> list[Holder]:
        """Return the (worker, dp_rank) holders whose index may miss events since a gap, sorted."""
        if self.gap_seq is None:
            return []
        return sorted(
            Holder(w, r)
            for w, info in self._workers.items()
            if info.removed_epoch is None
            for r in info.epochs
            if Holder(w, r) not in self._healed
        )

    def holder_health(self) -> dict[Holder, str]:
        """Return every live (worker, dp_rank) holder whose index is not exact, with the reason, sorted.

        Reasons: ``"stream_gap"`` (messages lost between a snapshot and the stream, see `mark_gap`),
        ``"gap"`` (its engine sequence skipped ahead), ``"out_of_order"`` (a message came after later ones
        and was refused). A holder missing from the answer is exact. Each lasts until a Cleared or a new
        engine epoch rebuilds the holder.
        """
        out: dict[Holder, str] = {}
        for w, info in sorted(self._workers.items()):
            if info.removed_epoch is not None:
                continue
            for r in sorted(info.epochs):
                reason = self._health(w, info, r)
                if reason is not None:
                    out[Holder(w, r)] = reason
        return out

    def _health(self, worker_id: str, info: _WorkerInfo, rank: int) -> str | None:
        hs = info.seqs.get(rank)
        if hs is not None and hs.held:
            return "held"
        if hs is not None and hs.health is not None:
            return hs.health
        if self.gap_seq is not None and Holder(worker_id, rank) not in self._healed:
            return "stream_gap"
        return None

    def _reset(self, msg: IndexReset) -> None:
        self._indexes.clear()
        self._workers.clear()
        self.reset_epoch = max(self.reset_epoch + 1, msg.epoch)
        self.gap_seq = None
        self._healed.clear()
        self._holds.clear()

    def _index(self, model: str, block_size: int) -> PrefixIndex:
        by_size = self._indexes.setdefault(model, {})
        index = by_size.get(block_size)
        if index is None:
            index = by_size[block_size] = PrefixIndex(
                track_digest=self._track_digest, keep_order=self.max_blocks is not None
            )
        return index

    def _apply_events(self, msg: EventsMessage) -> None:
        self._apply_one(msg, held=False)
        # The message may be the one a re-ordered stream delivered late: apply what waited for it.
        while True:
            info = self._workers.get(msg.worker_id)
            hs = info.seqs.get(msg.dp_rank) if info is not None else None
            if hs is None or not hs.held:
                return
            over = len(hs.held) > HOLD_MAX_MESSAGES or self.applied_seq - hs.held_since > HOLD_MAX_STREAM_SEQS
            if over:
                self._release(hs)
                return
            if not (hs.free or _continues(hs, hs.held[0])):
                return
            self._apply_one(hs.held.pop(0), held=True)

    def _release(self, hs: HolderSeq) -> None:
        """Give a hold up: the missing messages are not coming (lost with a crashed ingest); apply the held
        ones in engine order, each gap counted and the holder flagged."""
        self.counters.released_holds += 1
        self._restructured = True  # the holder may be another than the message's
        held, hs.held = hs.held, []
        for m in held:
            self._apply_one(m, held=True)

    def _release_overdue(self) -> None:
        """Give up every hold older than `HOLD_MAX_STREAM_SEQS` stream messages, also those of a holder that
        sends nothing more (its ingest died with the missing message): no hold lasts forever."""
        while self._holds and self.applied_seq - self._holds[0][0] > HOLD_MAX_STREAM_SEQS:
            since, worker_id, rank = heapq.heappop(self._holds)
            info = self._workers.get(worker_id)
            hs = info.seqs.get(rank) if info is not None else None
            if hs is not None and hs.held and hs.held_since == since:
                self._release(hs)

    def _hold(self, hs: HolderSeq, msg: EventsMessage) -> None:
        """Keep ``msg`` until the engine sequence before it arrives (sorted, one copy per position)."""
        # O(log n) per message: a hold given up after `HOLD_MAX_MESSAGES` must not cost quadratic time.
        i = bisect.bisect_left(hs.held, _position(msg), key=_position)
        if i < len(hs.held) and _position(hs.held[i]) == _position(msg):
            self.counters.duplicate_messages += 1
            return
        if not hs.held:
            hs.held_since = self.applied_seq
            heapq.heappush(self._holds, (self.applied_seq, msg.worker_id, msg.dp_rank))
        hs.held.insert(i, msg)
        self.counters.held_messages += 1

    def _apply_one(self, msg: EventsMessage, *, held: bool) -> None:
        self._touched.add(Holder(msg.worker_id, msg.dp_rank))
        info = self._workers.get(msg.worker_id)
        if info is None:
            info = self._workers[msg.worker_id] = _WorkerInfo(msg.model, msg.block_size)
        if (
            info.stale_through is not None
            and msg.epoch <= info.stale_through
            and msg.model == info.stale_model
        ):
            self.counters.stale_messages += 1
            return
        if info.model != msg.model:
            # Another model: a new incarnation of the worker id (a new ingest, epochs from 0 again). The old
            # one's entries are meaningless now, and so are its epochs and engine cursors.
            self._restructured = True
            for by_size in self._indexes.get(info.model, {}).values():
                by_size.remove_worker(msg.worker_id)
            info = self._workers[msg.worker_id] = _WorkerInfo(
                msg.model,
                msg.block_size,
                stale_through=info.stale_through,
                stale_model=info.stale_model,
            )
            self.counters.incarnations += 1
        holder = Holder(msg.worker_id, msg.dp_rank)
        # Block size 0 means the ingest has not learned it yet (no --block-size and no BlockStored seen on
        # that rank: its hello, clears, removals, or any message after an ingest restart). It says nothing
        # about the worker, so it must not move the worker: that would drop every other rank's blocks.
        block_size = msg.block_size or info.block_size
        epoch = info.epochs.get(msg.dp_rank)
        if epoch is not None and msg.epoch < epoch:
            self.counters.stale_messages += 1
            return
        new_epoch = epoch is None or msg.epoch > epoch
        hs = info.seqs.get(msg.dp_rank)
        if hs is None or new_epoch:
            hs = info.seqs[msg.dp_rank] = HolderSeq()
        verdict = self._in_engine_order(hs, msg, held=held)
        if verdict == "hold":
            self._hold(hs, msg)
            return
        if verdict == "refuse":
            return
        readers = tuple(msg.readers) if msg.readers else ()
        if info.removed_epoch is not None or readers != info.readers:
            self._restructured = True
        info.removed_epoch = None
        info.readers = readers
        index = self._index(msg.model, block_size)
        if info.block_size != block_size:
            self._restructured = True
            # The worker moved to another block size: its old entries are meaningless now.
            self._index(info.model, info.block_size).remove_worker(msg.worker_id)
            info.block_size = block_size
            # Its ranks stay known (with nothing cached) under the new size, as they were under the old.
            for rank in info.epochs:
                index.touch(Holder(msg.worker_id, rank))
        if epoch is not None and msg.epoch > epoch:
            index.clear(holder)
            self.counters.clears += 1
            if self.gap_seq is not None:
                self._healed.add(holder)
        index.touch(holder)
        info.epochs[msg.dp_rank] = msg.epoch
        info.last_seq[msg.dp_rank] = msg.seq
        info.last_ts = max(info.last_ts, msg.ts)
        c = self.counters
        events = msg.events
        n = len(events)
        i = 0
        while i < n:
            event = events[i]
            i += 1
            if isinstance(event, Removed) and _same_tier_removal(events, i, event.medium):
                # Consecutive removals on one tier (vLLM sends a BlockRemoved per evicted block): one call.
                hashes = list(event.engine_hashes)
                while _same_tier_removal(events, i, event.medium):
                    hashes.extend(cast("Removed", events[i]).engine_hashes)
                    i += 1
                rr = index.remove(holder, hashes, event.medium)
                c.removed_blocks += rr.removed
                c.unknown_removals += rr.unknown
                continue
            if isinstance(event, Stored):
                r = index.store(holder, event.engine_hashes, event.parent, event.local_hashes, event.medium)
                c.stored_blocks += r.attached
                c.duplicate_stores += r.duplicates
                c.held_events += int(r.held)
                c.dropped_orphans += r.dropped_orphans
            elif isinstance(event, StoredKeys):
                engine = event.prefix_keys if event.engine_hashes is None else event.engine_hashes
                r = index.store_sequence(holder, engine, event.prefix_keys, event.medium)
                c.stored_blocks += r.attached
                c.duplicate_stores += r.duplicates
                c.dropped_orphans += r.dropped_orphans
            elif isinstance(event, Placed):
                pr = index.place(holder, event.engine_hashes, event.medium)
                c.placed_blocks += pr.placed
                c.duplicate_stores += pr.duplicates
                c.unknown_placements += pr.unknown
            elif isinstance(event, Removed):
                rr = index.remove(holder, event.engine_hashes, event.medium)
                c.removed_blocks += rr.removed
                c.unknown_removals += rr.unknown
            elif isinstance(event, Cleared):
                index.clear(holder)
                c.clears += 1
                hs.rebuilt()
                if event.reason != "engine":
                    hs.free = True
                    # Held messages the ingest's clear comes after are void; later ones apply next.
                    hs.held = [m for m in hs.held if _first(m) > msg.seq]
                if self.gap_seq is not None:
                    self._healed.add(holder)

    def _in_engine_order(self, hs: HolderSeq, msg: EventsMessage, *, held: bool) -> str:
        """Check ``msg`` against its holder's engine cursor (same epoch); move the cursor when it applies.

        Returns ``"apply"``, ``"hold"`` (it comes past a gap: kept until the missing messages arrive) or
        ``"refuse"`` (a duplicate or out of order, counted); see the module docstring. A message taken from
        the hold (``held``) past a gap is applied with the gap counted (the hold was given up).
        """
        first = _first(msg)
        if first > msg.seq:
            # A range running backwards: no ingest makes one. Applying it would move the cursor back and hold
            # every later batch of the holder as if one were missing.
            self.counters.malformed_messages += 1
            return "refuse"
        engine = any(not isinstance(e, Cleared) or e.reason == "engine" for e in msg.events)
        if not engine:
            # Hello, ingest Cleared, or an engine batch whose events were all skipped: always applies. Only
            # an empty message moves the cursor (forward), so that it is no gap for the next one.
            if not msg.events and msg.seq >= 0 and (hs.seq is None or first > hs.seq):
                if hs.seq is None or hs.free:
                    hs.seq, hs.part, hs.free = msg.seq, msg.part, False
                elif _continues(hs, msg) or held:
                    self._advance(hs, msg, first)
                else:
                    return "hold"
            return "apply"
        if hs.seq is None or hs.free:
            if hs.seq is not None and (msg.seq < hs.seq or (msg.seq == hs.seq and msg.part <= hs.part)):
                self.counters.duplicate_messages += 1  # voided by the Cleared that came after it
                return "refuse"
            hs.seq, hs.part, hs.free = msg.seq, msg.part, False
            return "apply"
        if first > hs.seq or (msg.seq == hs.seq and msg.part > hs.part):
            if not (_continues(hs, msg) or held):
                return "hold"  # some earlier message of this holder is still to come
            self._advance(hs, msg, first)  # a later batch, or a later part of the cursor's batch
            return "apply"
        if first <= hs.seq < msg.seq:
            self._refuse_out_of_order(hs)  # straddles the cursor: partly applied, partly not
            return "refuse"
        if (msg.seq, msg.part) == (hs.seq, hs.part):
            self.counters.duplicate_messages += 1
            return "refuse"
        if hs.gap_from is not None and msg.seq >= hs.gap_from:
            self._refuse_out_of_order(hs)
            return "refuse"
        self.counters.duplicate_messages += 1
        return "refuse"

    def _advance(self, hs: HolderSeq, msg: EventsMessage, first: int) -> None:
        assert hs.seq is not None
        if msg.seq == hs.seq:
            skipped = msg.part > hs.part + 1
            missing = hs.seq
        else:
            skipped = first > hs.seq + 1 or msg.part != 0
            missing = hs.seq + 1
        if skipped:
            self.counters.sequence_gaps += 1
            if hs.gap_from is None:
                hs.gap_from = missing
            hs.flag("gap")
        hs.seq, hs.part = msg.seq, msg.part

    def _refuse_out_of_order(self, hs: HolderSeq) -> None:
        self.counters.out_of_order += 1
        hs.flag("out_of_order")

    def _remove_worker(self, msg: WorkerRemoved) -> None:
        info = self._workers.get(msg.worker_id)
        if info is not None and msg.model and msg.model != info.model:
            # The removal of an earlier incarnation under another model (its key expired after the worker id
            # was re-used): the live incarnation is not the one that left.
            self.counters.stale_removals += 1
            return
        if info is not None and msg.epoch is not None:
            if info.removed_epoch is not None and msg.epoch <= info.removed_epoch:
                self.counters.stale_removals += 1  # that departure again, or an older one: already removed
                return
            if info.removed_epoch is None and info.epochs and min(info.epochs.values()) > msg.epoch:
                # The removal of an earlier incarnation that reached the stream after every rank of the worker
                # registered again (the claimer of its expiry published late, or died and a paused replica
                # published it): the new incarnation stays. (A multi-node worker's last node names the lowest
                # of its ranks' epochs, `last_node_incarnation`, so some rank is always at it.)
                self.counters.stale_removals += 1
                self._raise_stale_bound(info, msg.epoch)
                return
        for by_size in self._indexes.values():
            for index in by_size.values():
                index.remove_worker(msg.worker_id)
        self.counters.workers_removed += 1
        if info is not None:
            epoch = msg.epoch if msg.epoch is not None else max(info.epochs.values(), default=0)
            info.removed_epoch = max(epoch, info.removed_epoch or 0)
            self._raise_stale_bound(info, info.removed_epoch)

    @staticmethod
    def _raise_stale_bound(info: _WorkerInfo, epoch: int) -> None:
        """Drop the worker's later messages of ``epoch`` or older (of its model; a bound of another model's
        incarnation is replaced); a bound only rises within one model."""
        if info.stale_through is not None and info.stale_model == info.model:
            epoch = max(epoch, info.stale_through)
        info.stale_through = epoch
        info.stale_model = info.model

    # ------------------------------------------------------------------ queries

    def models(self) -> dict[str, list[int]]:
        """Return each known model with its block sizes."""
        return {m: sorted(s) for m, s in self._indexes.items()}

    def match(
        self,
        model: str,
        token_ids: Sequence[int] | tables.U32,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> MatchResult:
        """Compute every holder's overlap with a prompt.

        Args:
            model: model name as the workers registered it.
            token_ids: prompt token ids, each in ``[0, 2**32)`` (a sequence of ints, an ``array("I")`` or a
                uint32 array: `kvmesh.core.tables.token_array`).
            lora_name: adapter, or None for the base model.
            cache_salt: tenant salt as the engine received it, or None.

        Returns:
            every holder's overlap in its own block size (`HolderMatch.block_size`, ``overlap_tokens``);
            ``block_size`` and ``prompt_blocks`` of the result are those of the size with the most holders
            when workers of one model disagree. A holder's overlap is its leading run over all its storage
            tiers, split per tier in `HolderMatch.tiers`; `HolderMatch.health` says when it may be inexact.

        Raises:
            UnknownModelError: no worker of that model is known.
            RequestError: a token id is out of range.
        """
        live = self._live_indexes(model)
        # Block size 0 holds workers that announced themselves before their block size was known: they have
        # nothing cached. They are zero-overlap candidates, but 0 is never the size a prompt is hashed with
        # (hashing needs a positive block size; choosing it used to crash the match).
        unsized = live.pop(0, None)
        # Every holder is scored in its own block size (a worker whose engine uses another size than the
        # rest of its model still gets its exact overlap); the result's block size is the majority one.
        found: dict[Holder, HolderMatch] = {}
        block_size = prompt_blocks = 0
        if live:
            block_size = _majority_size(live)
            prompt_blocks = len(token_ids) // block_size
            tokens = tables.token_array(token_ids)  # validates every token id
            for bs, index in sorted(live.items()):
                # Every block hashed in one compiled call (5 – 7 µs for 4,096 tokens): cheaper than hashing
                # lazily in Python only as far as some holder matches.
                keys = tables.prompt_keys(tokens, bs, lora_name=lora_name, cache_salt=cache_salt)
                view = self._view(index, bs)
                if index.tiered:
                    overlaps = index.match_tiers(keys)
                    for h, zero in view.zeros:
                        if h not in found:
                            o = overlaps.get(h)
                            found[h] = zero if o is None else _with_overlap(zero, o)
                else:  # every block on the default tier: plain counts, no `Overlap` per holder
                    if len(live) == 1 and unsized is None and not view.backends:
                        # one view, nothing to merge: its holders in order, built in one pass (1,024 of
                        # them for a fleet-wide prefix: a function call and a dict entry each saved)
                        return MatchResult(
                            index_seq=self.applied_seq,
                            block_size=block_size,
                            prompt_blocks=prompt_blocks,
                            candidates=_candidates(index, view, keys),
                        )
                    counts = index.match(keys)
                    for h, zero in view.zeros:
                        if h not in found:
                            n = counts.get(h)
                            found[h] = zero if n is None else _with_blocks(zero, n)
                self._add_backends(index, view.backends, keys.tolist, found)
        else:
            tables.token_array(token_ids)  # still validate the token ids
        if unsized is not None:
            for h in unsized.holders():
                if h not in found and not self._is_removed(h.worker_id):
                    found[h] = HolderMatch(
                        worker_id=h.worker_id,
                        dp_rank=h.dp_rank,
                        overlap_blocks=0,
                        cached_blocks=0,
                        health=self._holder_health(h),
                    )
        ordered = len(live) == 1 and unsized is None  # one view's holders, already sorted
        return MatchResult(
            index_seq=self.applied_seq,
            block_size=block_size,
            prompt_blocks=prompt_blocks,
            candidates=tuple(found.values()) if ordered else tuple(found[h] for h in sorted(found)),
        )

    def match_local_hashes(
        self, model: str, local_hashes: Sequence[int], *, block_size: int | None = None
    ) -> MatchResult:
        """Compute every holder's overlap with a prompt given as its local block hashes (a pre-hashed route).

        Args:
            model: model name as the workers registered it.
            local_hashes: the local hash of each full block of the prompt, block 0 first (LoRA and cache salt
                mixed in by the caller: `kvmesh.core.hashing.local_block_hashes`), each in ``[0, 2**64)``.
            block_size: the tokens per block the hashes were computed with; None: the model's block size with
                the most holders (as `match` chooses it).

        Returns:
            every live holder of the model, sorted by (worker, rank): the holders of ``block_size`` with their
            overlap, the others with none; ``block_size`` of the result is the hashes' (0 when None was given
            and no holder's size is known), ``prompt_blocks`` is ``len(local_hashes)``.

        Raises:
            UnknownModelError: no worker of that model is known.
        """
        return self._match_keys(
            model,
            iter_prefix_keys(local_hashes),
            lambda: prefix_keys(local_hashes),
            len(local_hashes),
            block_size,
        )

    def match_sequence_hashes(
        self, model: str, seq_hashes: Sequence[int], *, block_size: int | None = None
    ) -> MatchResult:
        """Compute every holder's overlap with a prompt given as its sequence hashes (a pre-hashed route or
        an RFC #1403 ``query_by_hash``).

        The index keys prefixes by these very hashes (`kvmesh.core.hashing.sequence_hashes`: ``seq[0] =
        local[0]``, ``seq[i] = XXH3-64(le64(seq[i-1]) ‖ le64(local[i]), seed 1337)``; Dynamo's
        ``SequenceHash``, RFC #1527's ``seq_hashes``), so they are looked up as given, without hashing.

        Args:
            model: model name as the workers registered it.
            seq_hashes: the sequence hash of each full block of the prompt, block 0 first (LoRA and cache salt
                mixed into the local hashes they chain), each an int in ``[0, 2**64)``.
            block_size: as for `match_local_hashes`.

        Returns:
            as `match_local_hashes` gives for the local hashes these were chained from.

        Raises:
            RequestError: a hash is not an int in ``[0, 2**64)`` (``field="seq_hashes"``, naming its index).
            UnknownModelError: no worker of that model is known.
        """
        keys = _checked_seq_hashes(seq_hashes)
        return self._match_keys(model, keys, lambda: keys, len(keys), block_size)

    def _match_keys(
        self,
        model: str,
        keys: Iterable[int],
        all_keys: Callable[[], Sequence[int]],
        prompt_blocks: int,
        block_size: int | None,
    ) -> MatchResult:
        """The match of a prompt given as its prefix keys (``keys``, consumed lazily; ``all_keys`` gives them
        all, for the backend pools) in one block size: `match_local_hashes` and `match_sequence_hashes`."""
        live = self._live_indexes(model)
        sized = {bs: ix for bs, ix in live.items() if bs}
        if block_size is None:
            block_size = _majority_size(sized) if sized else 0
        found: dict[Holder, HolderMatch] = {}
        index = sized.get(block_size)
        if index is not None:
            overlaps = index.match_tiers(keys)
            view = self._view(index, block_size)
            for h, zero in view.zeros:
                o = overlaps.get(h)
                found[h] = zero if o is None else _with_overlap(zero, o)
            self._add_backends(index, view.backends, all_keys, found)
        for bs, other in sorted(live.items()):
            if other is index:
                continue
            for h in other.holders():
                if h not in found and not self._is_removed(h.worker_id):
                    found[h] = HolderMatch(
                        worker_id=h.worker_id,
                        dp_rank=h.dp_rank,
                        overlap_blocks=0,
                        cached_blocks=other.block_count(h) if bs else 0,
                        block_size=bs,
                        health=self._holder_health(h),
                    )
        return MatchResult(
            index_seq=self.applied_seq,
            block_size=block_size,
            prompt_blocks=prompt_blocks,
            candidates=tuple(found[h] for h in sorted(found)),
        )

    def _live_indexes(self, model: str) -> dict[int, PrefixIndex]:
        """The model's indexes by block size that hold at least one live worker.

        Raises:
            UnknownModelError: none does.
        """
        self._fresh_views()
        live = self._lives.get(model)
        if live is None:
            live = self._lives[model] = {
                bs: ix
                for bs, ix in self._indexes.get(model, {}).items()
                if any(not self._is_removed(h.worker_id) for h in ix.holders())
            }
        if not live:
            raise UnknownModelError(model)
        return dict(live)

    def _fresh_views(self) -> None:
        """Bring the cached views and live indexes up to the state's version: the live indexes recomputed, each
        view rebuilt when the state was restructured or its index's holders changed, else only its touched
        holders' entries (a fleet of 1,024 workers under a stream of events: one entry per applied message's
        holder, not 1,024 per route)."""
        if self._views_version == self._version:
            return
        self._lives.clear()
        if self._restructured:
            self._views.clear()
        elif self._touched:
            for index, view in list(self._views.items()):
                if not self._refresh(index, view):
                    del self._views[index]
        self._touched.clear()
        self._restructured = False
        self._views_version = self._version

    def _refresh(self, index: PrefixIndex, view: _IndexView) -> bool:
        """Replace the entries of the touched holders in ``view``; False when it must be rebuilt instead (the
        index's holders changed). A touched holder not in the view is another index's, or a removed worker's
        (it stays removed: a removal or a return restructures)."""
        if index.sorted_holders() is not view.holders:
            return False
        at, zeros, bs = view.at, view.zeros, view.block_size
        for h in self._touched:
            k = at.get(h)
            if k is not None:
                zero = self._zero_match(index, h, bs)
                zeros[k] = (h, zero)
                for depth, kept in view.depths.items():
                    kept[k] = msgspec.structs.replace(zero, overlap_blocks=depth, overlap_tokens=depth * bs)
        return True

    def _zero_match(self, index: PrefixIndex, h: Holder, bs: int) -> HolderMatch:
        """A holder's `HolderMatch` of no leading block in its block size ``bs`` (`_with_overlap` adds one)."""
        return HolderMatch(
            worker_id=h.worker_id,
            dp_rank=h.dp_rank,
            overlap_blocks=0,
            cached_blocks=index.block_count(h),
            block_size=bs,
            health=self._holder_health(h),
        )

    def _view(self, index: PrefixIndex, bs: int) -> _IndexView:
        """The index's live holders with their no-overlap `HolderMatch` and its backends, kept across matches
        and brought up to date by `_fresh_views` (a match of a fleet of 1,024 workers used to build 1,024 of
        them per prompt)."""
        self._fresh_views()
        view = self._views.get(index)
        if view is None:
            zeros: list[tuple[Holder, HolderMatch]] = []
            backends: dict[Holder, tuple[str, ...]] = {}
            holders = index.sorted_holders()
            for h in holders:
                info = self._workers.get(h.worker_id)
                if info is not None and info.readers:
                    backends[h] = info.readers
                if not self._is_removed(h.worker_id):
                    zeros.append((h, self._zero_match(index, h, bs)))
            at = {h: k for k, (h, _zero) in enumerate(zeros)}
            view = self._views[index] = _IndexView(zeros, backends, holders, at, bs)
        return view

    def _add_backends(
        self,
        index: PrefixIndex,
        backends: dict[Holder, tuple[str, ...]],
        keys: Callable[[], Sequence[int]],
        found: dict[Holder, HolderMatch],
    ) -> None:
        """Take the index's backends (holder → the workers that read it) out of ``found`` and count their blocks
        for their readers' holders (module docstring, "Shared caches"); ``keys`` gives the prompt's prefix
        keys, called only when some holder of the index reads a backend."""
        if not backends:
            return
        for h in backends:
            found.pop(h, None)
        reads: dict[Holder, list[Holder]] = {}
        for h in found:
            pools = [b for b, readers in backends.items() if h.worker_id in readers]
            if pools:
                reads[h] = pools
        if not reads:
            return
        per_tier: dict[Holder, dict[str, int]] = {h: {} for h in reads}
        depth = {h: 0 for h in reads}
        alive = set(reads)
        for key in keys():
            here = index.match_tiers([key])
            for h in list(alive):
                best: str | None = None
                for member in (h, *reads[h]):
                    o = here.get(member)
                    if o is not None:
                        tier = DEFAULT_TIER if o.tiers is None else next(iter(o.tiers))
                        if best is None or tier_rank(tier) < tier_rank(best):
                            best = tier
                if best is None:
                    alive.discard(h)
                else:
                    depth[h] += 1
                    per_tier[h][best] = per_tier[h].get(best, 0) + 1
            if not alive:
                break
        for h, blocks in depth.items():
            tiers = per_tier[h]
            m = found[h]
            found[h] = msgspec.structs.replace(
                m,
                overlap_blocks=blocks,
                overlap_tokens=blocks * m.block_size,
                tiers=None
                if tiers.keys() <= {DEFAULT_TIER}
                else dict(sorted(tiers.items(), key=lambda kv: tier_rank(kv[0]))),
            )

    def _holder_health(self, holder: Holder) -> str | None:
        info = self._workers.get(holder.worker_id)
        return None if info is None else self._health(holder.worker_id, info, holder.dp_rank)

    def _is_removed(self, worker_id: str) -> bool:
        info = self._workers.get(worker_id)
        return info is not None and info.removed_epoch is not None

    def digest(self) -> int:
        """Return an order-independent digest over every model's index content: the XOR over (model, block
        size) of ``XXH3-64(f"{model}\\0{block_size}\\0{PrefixIndex.digest()}", seed 1337)``.

        O(indexes · holders · tiers): each index keeps its digest incrementally (`PrefixIndex.digest`). The
        first call computes them once (O(total blocks), about 0.35 s per million blocks) and turns tracking
        on for every index, including those created later; the value is cached until the next applied
        message.
        """
        key = (self.applied_seq, self.counters.messages, self.reset_epoch)
        if self._digest is not None and self._digest[0] == key:
            return self._digest[1]
        self._track_digest = True
        total = _combine(
            (m, bs, ix.digest()) for m, by_size in self._indexes.items() for bs, ix in by_size.items()
        )
        self._digest = (key, total)
        return total

    def track_digest(self) -> None:
        """Keep every index's digest up to date from now on (O(total blocks) once), so that even the first
        `digest` call is cheap."""
        self._track_digest = True
        for by_size in self._indexes.values():
            for index in by_size.values():
                index.track_digest()

    def digest_from_scratch(self) -> int:
        """Return `digest`'s value computed from the block maps alone (`PrefixIndex.digest_from_scratch`),
        O(total blocks); caches nothing."""
        return _combine(
            (m, bs, ix.digest_from_scratch())
            for m, by_size in self._indexes.items()
            for bs, ix in by_size.items()
        )

    def workers(self) -> dict[str, dict[str, object]]:
        """Return per-worker bookkeeping: model, block size, epochs, last engine seq and timestamp."""
        return {
            w: {
                "model": i.model,
                "block_size": i.block_size,
                "epochs": dict(i.epochs),
                "last_seq": dict(i.last_seq),
                "last_ts": i.last_ts,
                "removed": i.removed_epoch is not None,
                "blocks": sum(
                    ix.block_count(Holder(w, r))
                    for ix in self._indexes.get(i.model, {}).values()
                    for r in i.epochs
                ),
            }
            for w, i in sorted(self._workers.items())
        }

    def live_worker(self, worker_id: str) -> tuple[str, int] | None:
        """Return a known, not removed worker's (model, highest epoch), or None."""
        info = self._workers.get(worker_id)
        if info is None or info.removed_epoch is not None:
            return None
        return info.model, max(info.epochs.values(), default=0)

    def live_holders(self) -> list[tuple[str, str, int]]:
        """Return ``(model, worker_id, dp_rank)`` of every rank of every worker not removed, sorted."""
        return sorted(
            (i.model, w, r) for w, i in self._workers.items() if i.removed_epoch is None for r in i.epochs
        )

    def block_total(self) -> int:
        """Return the number of indexed (holder, block) entries over all models (O(indexes))."""
        return sum(ix.block_total for by_size in self._indexes.values() for ix in by_size.values())

    def _evict(self, bound: int) -> None:
        """Bring the state down to ``bound − EVICT_SLACK`` blocks (at least one below the bound, never below
        0): every cache above a common level is cut to it, the highest level that frees enough (the flood of
        one misbehaving engine is paid by its own cache; caches under the level keep everything)."""
        indexes = [ix for by_size in self._indexes.values() for ix in by_size.values()]
        need = self.block_total() - max(0, bound - max(1, int(bound * EVICT_SLACK)))
        if need <= 0:
            return
        sizes = sorted((n for ix in indexes for n in ix.cache_sizes()), reverse=True)
        level = _cut_level(sizes, need)
        dropped = sum(ix.evict_to(level) for ix in indexes)
        self.counters.evicted_blocks += dropped

    # ------------------------------------------------------------------ snapshots

    def export(self) -> StateExport:
        """Copy the complete state out (index block maps, engine-hash maps, held orphans, duplicate counts,
        worker epochs and cursors, counters), sharing nothing mutable with the live state.

        Cheap: C-level dict copies, about 10–20 ms per million blocks; do it between two applied messages
        and encode the result elsewhere (`kvmesh.core.snapshot.encode_snapshot`).
        """
        return StateExport(
            applied_seq=self.applied_seq,
            reset_epoch=self.reset_epoch,
            counters=asdict(self.counters),
            workers=tuple(
                WorkerExport(
                    worker_id=w,
                    model=i.model,
                    block_size=i.block_size,
                    epochs=dict(i.epochs),
                    last_seq=dict(i.last_seq),
                    last_ts=i.last_ts,
                    removed_epoch=i.removed_epoch,
                    stale_through=i.stale_through,
                    stale_model=i.stale_model,
                    seqs={r: (h.seq, h.part, h.free, h.gap_from, h.health) for r, h in i.seqs.items()},
                    held={
                        r: (h.held_since, tuple(encode_message(m) for m in h.held))
                        for r, h in i.seqs.items()
                        if h.held
                    },
                    readers=i.readers,
                )
                for w, i in self._workers.items()
            ),
            indexes=tuple(
                (model, bs, index.export())
                for model, by_size in self._indexes.items()
                for bs, index in by_size.items()
            ),
            gap_seq=self.gap_seq,
            healed=tuple(sorted(self._healed)),
        )

    @classmethod
    def from_export(
        cls, export: StateExport, *, track_digest: bool = False, max_blocks: int | None = None
    ) -> IndexState:
        """Rebuild a state from `export()` (taking ownership of its dicts); O(total blocks). With
        ``track_digest`` the digests are computed during the rebuild (`track_digest`), else by the first
        `digest` call. ``max_blocks`` bounds the rebuilt state as the constructor's does; an export above it
        (taken without a bound, or with a larger one) is brought under it at once, each cache's blocks
        counting as stored in the export's order.

        Raises:
            ValueError: ``max_blocks`` is not positive.
        """
        state = cls(max_blocks=max_blocks)
        state._track_digest = track_digest
        state.applied_seq = export.applied_seq
        state.reset_epoch = export.reset_epoch
        known = _Counters.__dataclass_fields__
        state.counters = _Counters(**{k: v for k, v in export.counters.items() if k in known})
        for w in export.workers:
            state._workers[w.worker_id] = _WorkerInfo(
                w.model,
                w.block_size,
                dict(w.epochs),
                dict(w.last_seq),
                w.last_ts,
                w.removed_epoch,
                w.stale_through,
                w.stale_model,
                {r: HolderSeq(*t) for r, t in w.seqs.items()},
                readers=w.readers,
            )
            for r, (since, held) in w.held.items():
                hs = state._workers[w.worker_id].seqs.setdefault(r, HolderSeq())
                hs.held_since = since
                hs.held = [m for m in map(decode_message, held) if isinstance(m, EventsMessage)]
                if hs.held:
                    heapq.heappush(state._holds, (since, w.worker_id, r))
        for model, bs, ix in export.indexes:
            state._indexes.setdefault(model, {})[bs] = PrefixIndex.from_export(
                ix, track_digest=track_digest, keep_order=max_blocks is not None
            )
        state.gap_seq = export.gap_seq
        state._healed = {Holder(w, r) for w, r in export.healed}
        if max_blocks is not None and state.block_total() > max_blocks:
            state._evict(max_blocks)
        return state


MAX_BLOCKS_LIMIT: Final[int] = 2**63 - 1
"""The largest ``max_blocks`` accepted: a replica reports its bound in its status replies (msgpack, whose
ints stop at 2^64 − 1); any larger bound is no bound anyway."""

EVICT_SLACK: Final[float] = 1 / 64
"""Share of ``max_blocks`` freed below the bound by one eviction, so a state at its bound does not evict on
every message (at least one block)."""


def _cut_level(sizes: Sequence[int], need: int) -> int:
    """The highest level L such that cutting every size above L down to L frees at least ``need`` blocks.

    Args:
        sizes: the caches' block counts, largest first.
        need: blocks to free (> 0, at most ``sum(sizes)``).

    Returns:
        L ≥ 0 (0 when only emptying every cache frees enough).
    """
    freed_above = 0  # blocks freed by cutting sizes[:i] down to sizes[i]
    for i in range(1, len(sizes) + 1):
        nxt = sizes[i] if i < len(sizes) else 0
        freed = freed_above + i * (sizes[i - 1] - nxt)
        if freed >= need:
            # between nxt and sizes[i-1]: cutting the i largest to L frees freed_above + i·(sizes[i-1] − L)
            return max(nxt, sizes[i - 1] - (need - freed_above + i - 1) // i)
        freed_above = freed
    return 0


HOLD_MAX_MESSAGES: Final[int] = 4096
"""Messages one holder may hold while waiting for an earlier one; past it the hold is given up."""
HOLD_MAX_STREAM_SEQS: Final[int] = 100_000
"""Stream messages a hold may wait for the missing ones; past it the hold is given up."""


def _checked_seq_hashes(seq_hashes: Sequence[int]) -> Sequence[int]:
    """``seq_hashes`` when each is an int in ``[0, 2**64)`` (an ``array('Q')`` is taken as it is).

    Raises:
        RequestError: the first hash that is not, named by index (``field="seq_hashes"``).
    """
    if isinstance(seq_hashes, array) and seq_hashes.typecode == "Q":
        return seq_hashes
    try:
        checked = array("Q", seq_hashes)
    except (OverflowError, TypeError):
        for i, h in enumerate(seq_hashes):
            if type(h) is not int or not 0 <= h < 2**64:
                raise RequestError(
                    f"seq_hashes[{i}] is not an int in [0, 2^64): {str(h)[:32]}", field="seq_hashes"
                ) from None
        raise
    return seq_hashes if type(seq_hashes) is list else checked  # a short list takes the index's fast path


def _combine(digests: Iterable[tuple[str, int, int]]) -> int:
    """`IndexState.digest` from each index's (model, block size, digest); order-independent (XOR)."""
    total = 0
    for model, bs, digest in digests:
        total ^= xxhash.xxh3_64_intdigest(f"{model}\x00{bs}\x00{digest}".encode(), seed=SEED)
    return total


def _first(msg: EventsMessage) -> int:
    """First engine sequence a message covers."""
    return msg.seq if msg.first_seq is None else msg.first_seq


def _position(msg: EventsMessage) -> tuple[int, int]:
    """A message's place in its holder's engine order: (first engine sequence, part)."""
    return _first(msg), msg.part


def _continues(hs: HolderSeq, msg: EventsMessage) -> bool:
    """Whether ``msg`` comes right after the holder's cursor: the next batch (part 0) or the next part."""
    if hs.seq is None:
        return True
    if msg.seq == hs.seq:
        return msg.part == hs.part + 1
    return _first(msg) == hs.seq + 1 and msg.part == 0


def _same_tier_removal(events: Sequence[Event], i: int, medium: str | None) -> bool:
    """Whether ``events[i]`` exists and is a removal on tier ``medium``."""
    if i >= len(events):
        return False
    event = events[i]
    return type(event) is Removed and event.medium == medium


def _with_overlap(zero: HolderMatch, o: Overlap) -> HolderMatch:
    """A holder's match with overlap ``o``, from its match of no leading block (`IndexState._view`)."""
    return msgspec.structs.replace(
        zero, overlap_blocks=o.blocks, tiers=o.tiers, overlap_tokens=o.blocks * zero.block_size
    )


def _with_blocks(zero: HolderMatch, blocks: int) -> HolderMatch:
    """A holder's match with ``blocks`` leading blocks, all on the default tier (`_with_overlap`)."""
    return msgspec.structs.replace(zero, overlap_blocks=blocks, overlap_tokens=blocks * zero.block_size)


def _majority_size(indexes: dict[int, PrefixIndex]) -> int:
    """The block size with the most holders (the smaller one on a tie)."""
    return max(indexes.items(), key=lambda kv: (len(kv[1].holders()), -kv[0]))[0]
