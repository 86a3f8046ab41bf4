"""The indexer's whole state: one `PrefixIndex` per (model, block size), fed stream messages in order.

Pure code. `IndexState.apply(stream_seq, message)` is the only way state changes, so two replicas that
applied the same stream up to the same sequence are equal (compare `digest()`).

Rules applied here, besides the index's own:

* Each (worker, dp_rank) has an engine incarnation (``epoch``). A message with a newer epoch clears that
  holder first (ingest also publishes a clear, this makes replay safe on its own); a message with an older
  epoch is stale and dropped.
* `WorkerRemoved` drops every dp rank of the worker; later messages of the removed incarnation (epoch ≤ the
  removed one) are dropped, a newer incarnation is accepted again.
* `IndexReset` forgets everything (index and worker bookkeeping) and raises ``reset_epoch``.
* A Stored or Removed event's ``medium`` selects the holder's storage tier in the index (no medium: GPU);
  `match` reports each candidate's overlap per tier in `HolderMatch.tiers`.
* After a gap in the stream (`mark_gap`: the messages between a snapshot and the stream's first one are
  gone), every holder is *incomplete* until a Cleared (or a new engine epoch) rebuilds it from nothing.

`export()` copies the whole state cheaply (dict copies, no per-block Python work) and `from_export()`
rebuilds it; `kvmesh.core.snapshot` turns an export into bytes and back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import xxhash

from kvmesh.core.events import Cleared, EventsMessage, IndexReset, Message, Removed, Stored, WorkerRemoved
from kvmesh.core.hashing import SEED, iter_prompt_prefix_keys, pack_tokens
from kvmesh.core.index import Holder, IndexExport, PrefixIndex


@dataclass(frozen=True, slots=True, kw_only=True)
class HolderMatch:
    """One candidate in a match answer."""

    worker_id: str
    dp_rank: int
    overlap_blocks: int
    """Leading full blocks of the prompt this holder has cached."""
    cached_blocks: int
    """All blocks indexed for this holder, one per tier a block is on (its cache size, a load proxy for ties)."""
    tiers: dict[str, int] | None = None
    """The overlap blocks per storage tier (``{"GPU": 4, "CPU": 4}``), each block on its fastest tier (GPU, CPU,
    then the others by name; `kvmesh.core.index`); None when they are all on the default tier (GPU)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MatchResult:
    """Answer of `IndexState.match`.

    Attributes:
        index_seq: stream sequence the state had applied.
        block_size: tokens per block of the model's index (0 when the model is unknown).
        prompt_blocks: full blocks in the prompt.
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
    healed: tuple[tuple[str, int], ...]
    """Holders rebuilt from nothing since the gap."""


class UnknownModelError(KeyError):
    """The model has no worker in the index."""


class IndexState:
    """Every model's prefix index plus per-worker bookkeeping, as of one stream sequence."""

    def __init__(self) -> None:
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

    # ------------------------------------------------------------------ apply

    def apply(self, stream_seq: int, message: Message) -> None:
        """Apply one stream message.

        Args:
            stream_seq: the JetStream sequence of the message (must rise; older ones are ignored).
            message: the decoded message.
        """
        if stream_seq <= self.applied_seq:
            return
        self.applied_seq = stream_seq
        self.counters.messages += 1
        if isinstance(message, WorkerRemoved):
            self._remove_worker(message)
            return
        if isinstance(message, IndexReset):
            self._reset(message)
            return
        self._apply_events(message)

    def mark_gap(self, after_seq: int) -> None:
        """Record that messages after ``after_seq`` were lost (the stream no longer holds them).

        Every holder known now or seen later counts as incomplete until a Cleared or a new engine epoch
        rebuilds it from nothing; `incomplete()` lists them. The index itself is unchanged.
        """
        self.gap_seq = after_seq
        self._healed.clear()

    def incomplete(self) -> list[tuple[str, int]]:
        """Return the (worker, dp_rank) holders whose index may miss events since a gap, sorted."""
        if self.gap_seq is None:
            return []
        return sorted(
            (w, r)
            for w, info in self._workers.items()
            if info.removed_epoch is None
            for r in info.epochs
            if Holder(w, r) not in self._healed
        )

    def _reset(self, msg: IndexReset) -> None:
        self._indexes.clear()
        self._workers.clear()
        self.reset_epoch = max(self.reset_epoch + 1, msg.epoch)
        self.gap_seq = None
        self._healed.clear()

    def _index(self, model: str, block_size: int) -> PrefixIndex:
        by_size = self._indexes.setdefault(model, {})
        index = by_size.get(block_size)
        if index is None:
            index = by_size[block_size] = PrefixIndex()
        return index

    def _apply_events(self, msg: EventsMessage) -> None:
        info = self._workers.get(msg.worker_id)
        if info is None:
            info = self._workers[msg.worker_id] = _WorkerInfo(msg.model, msg.block_size)
        if info.stale_through is not None and msg.epoch <= info.stale_through:
            self.counters.stale_messages += 1
            return
        info.removed_epoch = None
        holder = Holder(msg.worker_id, msg.dp_rank)
        # Block size 0 means the ingest has not learned it yet (no --block-size and no BlockStored seen on
        # that rank: its hello, clears, removals, or any message after an ingest restart). It says nothing
        # about the worker, so it must not move the worker: that would drop every other rank's blocks.
        block_size = msg.block_size or info.block_size
        index = self._index(msg.model, block_size)
        if info.model != msg.model or info.block_size != block_size:
            # The worker moved to another model or block size: its old entries are meaningless now.
            self._index(info.model, info.block_size).remove_worker(msg.worker_id)
            info.model, info.block_size = msg.model, block_size
            # Its ranks stay known (with nothing cached) under the new size, as they were under the old.
            for rank in info.epochs:
                index.touch(Holder(msg.worker_id, rank))
        epoch = info.epochs.get(msg.dp_rank)
        if epoch is not None and msg.epoch < epoch:
            self.counters.stale_messages += 1
            return
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
        for event in msg.events:
            if isinstance(event, Stored):
                r = index.store(holder, event.engine_hashes, event.parent, event.local_hashes, event.medium)
                c.stored_blocks += r.attached
                c.duplicate_stores += r.duplicates
                c.held_events += int(r.held)
                c.dropped_orphans += r.dropped_orphans
            elif isinstance(event, Removed):
                rr = index.remove(holder, event.engine_hashes, event.medium)
                c.removed_blocks += rr.removed
                c.unknown_removals += rr.unknown
            elif isinstance(event, Cleared):
                index.clear(holder)
                c.clears += 1
                if self.gap_seq is not None:
                    self._healed.add(holder)

    def _remove_worker(self, msg: WorkerRemoved) -> None:
        info = self._workers.get(msg.worker_id)
        for by_size in self._indexes.values():
            for index in by_size.values():
                index.remove_worker(msg.worker_id)
        self.counters.workers_removed += 1
        if info is not None:
            info.removed_epoch = msg.epoch if msg.epoch is not None else max(info.epochs.values(), default=0)
            info.stale_through = info.removed_epoch

    # ------------------------------------------------------------------ queries

    def models(self) -> dict[str, list[int]]:
        """Return each known model with its block sizes."""
        return {m: sorted(s) for m, s in self._indexes.items()}

    def match(
        self,
        model: str,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> MatchResult:
        """Compute every holder's overlap with a prompt.

        Args:
            model: model name as the workers registered it.
            token_ids: prompt token ids, each in ``[0, 2**32)``.
            lora_name: adapter, or None for the base model.
            cache_salt: tenant salt as the engine received it, or None.

        Returns:
            the overlaps under the model's block size (the size with the most holders when workers of one
            model disagree); a holder's overlap is its leading run over all its storage tiers, split per tier
            in `HolderMatch.tiers`.

        Raises:
            UnknownModelError: no worker of that model is known.
            RequestError: a token id is out of range.
        """
        by_size = self._indexes.get(model)
        live = {
            bs: ix
            for bs, ix in (by_size or {}).items()
            if any(not self._is_removed(h.worker_id) for h in ix.holders())
        }
        if not live:
            raise UnknownModelError(model)
        # Block size 0 holds workers that announced themselves before their block size was known: they have
        # nothing cached. They are zero-overlap candidates, but 0 is never the size a prompt is hashed with
        # (hashing needs a positive block size; choosing it used to crash the match).
        unsized = live.pop(0, None)
        if live:
            block_size, index = max(live.items(), key=lambda kv: (len(kv[1].holders()), -kv[0]))
            prompt_blocks = len(token_ids) // block_size
            keys = iter_prompt_prefix_keys(token_ids, block_size, lora_name=lora_name, cache_salt=cache_salt)
            overlaps = index.match_tiers(keys)  # hashes only as far as some holder matches
            holders = index.holders()
        else:
            pack_tokens(token_ids)  # still validate the token ids
            block_size, index, prompt_blocks, overlaps, holders = 0, PrefixIndex(), 0, {}, []
        if unsized is not None:
            holders = sorted({*holders, *unsized.holders()})
        candidates = tuple(
            HolderMatch(
                worker_id=h.worker_id,
                dp_rank=h.dp_rank,
                overlap_blocks=o.blocks if (o := overlaps.get(h)) is not None else 0,
                cached_blocks=index.block_count(h),
                tiers=o.tiers if o is not None else None,
            )
            for h in holders
            if not self._is_removed(h.worker_id)
        )
        return MatchResult(
            index_seq=self.applied_seq,
            block_size=block_size,
            prompt_blocks=prompt_blocks,
            candidates=candidates,
        )

    def _is_removed(self, worker_id: str) -> bool:
        info = self._workers.get(worker_id)
        return info is not None and info.removed_epoch is not None

    def digest(self) -> int:
        """Return an order-independent digest over every model's index content.

        O(total blocks) (about 1 s per million blocks); the last value is cached until the next applied
        message, so repeated status calls on an idle replica are free.
        """
        key = (self.applied_seq, self.counters.messages, self.reset_epoch)
        if self._digest is not None and self._digest[0] == key:
            return self._digest[1]
        total = 0
        for model, by_size in sorted(self._indexes.items()):
            for bs, index in sorted(by_size.items()):
                total ^= xxhash.xxh3_64_intdigest(f"{model}\x00{bs}\x00{index.digest()}".encode(), seed=SEED)
        self._digest = (key, total)
        return total

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
        """Return the number of indexed (holder, block) entries over all models."""
        return sum(ix.stats().blocks for by_size in self._indexes.values() for ix in by_size.values())

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
                )
                for w, i in self._workers.items()
            ),
            indexes=tuple(
                (model, bs, index.export())
                for model, by_size in self._indexes.items()
                for bs, index in by_size.items()
            ),
            gap_seq=self.gap_seq,
            healed=tuple(sorted((h.worker_id, h.dp_rank) for h in self._healed)),
        )

    @classmethod
    def from_export(cls, export: StateExport) -> IndexState:
        """Rebuild a state from `export()` (taking ownership of its dicts); O(total blocks)."""
        state = cls()
        state.applied_seq = export.applied_seq
        state.reset_epoch = export.reset_epoch
        state.counters = _Counters(**export.counters)
        for w in export.workers:
            state._workers[w.worker_id] = _WorkerInfo(
                w.model,
                w.block_size,
                dict(w.epochs),
                dict(w.last_seq),
                w.last_ts,
                w.removed_epoch,
                w.stale_through,
            )
        for model, bs, ix in export.indexes:
            state._indexes.setdefault(model, {})[bs] = PrefixIndex.from_export(ix)
        state.gap_seq = export.gap_seq
        state._healed = {Holder(w, r) for w, r in export.healed}
        return state
