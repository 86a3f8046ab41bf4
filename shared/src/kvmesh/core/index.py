"""The prefix index: which (worker, dp_rank) holds which cached prefix of one model, on which storage tier.

Pure code: no I/O, no clock, no logging. The indexer service feeds it the normalized events of the stream in
stream order; two indexes fed the same messages hold the same state and the same `digest()`.

Model of the data
-----------------

* A **holder** is one prefix cache: a (worker id, data-parallel rank) pair. Each holder has, per storage
  tier, its own map of engine block hashes (opaque keys, meaningful only inside that holder) to the block's
  prefix key and a store count.
* A BlockStored names its parent by the parent's engine hash in the same holder. The index resolves the
  parent's prefix key through the holder's map and chains the new blocks' local hashes onto it
  (`kvmesh.core.hashing.prefix_keys`), which gives every block its position-aware key. A BlockStored with
  no parent starts at block 0.
* A BlockStored whose parent is not known (yet) for that holder is **held** (bounded per holder) until the
  parent arrives — then it and its held descendants attach without a resend — or until it expires after
  ``orphan_ttl_ops`` further store operations on the index, or is pushed out by the bound. It is never
  attached under the root or under another holder's chain.
* vLLM can hold several physical copies of one block hash; it emits a BlockStored per copy and a
  BlockRemoved per eviction. A block stays indexed until removed as many times as it was stored (per tier).
* A removal of an unknown block is counted and ignored; the rest of the removal still applies.

Storage tiers (``medium`` of BlockStored / BlockRemoved, vLLM ≥ 0.10.2, SGLang ≥ 0.5.9)
-------------------------------------------------------------------------------------

* The medium is part of the holder's identity inside the index: every (worker, dp_rank, tier) has its own
  engine-hash map. Names are upper-cased; no medium (None or ``""``) and ``"GPU"`` are the **default tier**
  (`DEFAULT_TIER`). The default tier costs nothing extra: the other tiers' maps exist only once a block was
  stored on them.
* A BlockStored resolves its parent in its own tier first, then in the holder's other tiers (fastest first),
  so a CPU copy chained under a GPU block attaches. A held event waits for its parent on any tier.
* A BlockRemoved removes from the tier it names (no medium: the default tier). AllBlocksCleared (`clear`) and
  worker removal drop every tier.
* Matching (`match_tiers`): per holder the overlap is the longest leading run of prompt blocks held on *any*
  of its tiers; ``tiers`` counts how many of those blocks are on each tier, each block counted once, on its
  fastest tier in the fixed order **GPU, then CPU, then every other medium in alphabetical order**
  (`tier_rank`). ``tiers`` is None when every overlap block is on the default tier.

Keys and memory
---------------

Every int the index keeps is below ``2**60``, where a CPython int object takes 32 bytes instead of the 48
that a 64-bit value takes:

* **prefix keys** are the 60-bit chain of `kvmesh.core.hashing.prefix_keys` (collision bound there: about
  ``n² / 2**61`` for *n* distinct prefixes, 4.3·10⁻⁷ at 1M, 4.3·10⁻⁵ at 10M); the matching side hashes
  prompts with `kvmesh.core.hashing.prompt_prefix_keys`, the same rule.
* **engine hashes** are folded to 60 bits on the way in (`engine_key60`: modulo ``2**60 - 93``, the largest
  prime below ``2**60``). Values below that prime are kept as they are, so small or sequential engine ids
  never collide with each other. For uniformly random 64-bit engine hashes — what every engine kvmesh reads
  sends (vLLM: sha256 or Python ``hash()``, the last 8 bytes of a ``bin`` hash; SGLang: digest bytes) — two
  distinct blocks of *one* holder and tier fold together with probability about ``m² / 2**61`` for *m*
  blocks on that holder (1.6·10⁻⁸ at 125k blocks, 4.3·10⁻⁷ at 1M); the second would count as a duplicate
  copy of the first (that block's overlap answer off by one until it is removed). Two hashes collide only
  when they differ by a multiple of the prime, which no natural pattern does; keeping the low 60 bits, or
  xor-ing the top 4 bits down, would instead merge a tagged counter such as ``2**63 + i`` with the plain
  ``i`` (a fixture of the ingest tests does exactly this). The modulo costs ~20 ns more per block operation
  than a mask (about 4 % of the apply rate). `dump`, `export` and `holds` use the folded values.

Per stored block the index keeps two dict entries (engine key → prefix key in the holder's tier map, prefix
key → holders in a shared map) and two 32-byte ints: about 148 bytes of live objects at 1M blocks, 155 bytes
of resident memory (`kvmesh bench index --memory`). The shared map names a holder's tier by a small int id:
a prefix held once by one holder maps to that id itself (a shared int, no allocation), and only a second
holder, tier or copy promotes it to a ``{id: count}`` dict. The block maps and those small dicts hold ints
only, so the garbage collector does not track them (creating one adds no collection pressure). Going much
lower needs the hashes packed in arrays instead of dicts of Python ints (a native extension).

Complexity (n = blocks in an event, h = holders, q = blocks in a query):

| operation | cost |
|---|---|
| `store` | O(n) dict operations (+ held descendants that attach) |
| `remove` | O(n) |
| `clear` | O(blocks of that holder) |
| `match` | O(q · holders still matching) |
| `digest` | O(holders · tiers): kept incrementally, one hash per stored or removed block (`digest_from_scratch`: O(total blocks)) |
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import Final, NamedTuple, cast

import xxhash

from kvmesh.core.hashing import SEED, prefix_keys

DEFAULT_MAX_ORPHANS: Final[int] = 4096
"""Held BlockStored events per holder before the oldest is dropped."""
DEFAULT_ORPHAN_TTL_OPS: Final[int] = 100_000
"""Store operations on the index after which a held BlockStored expires."""
DEFAULT_TIER: Final[str] = "GPU"
"""Name of the default tier: events without a medium, and ``"GPU"``."""

ENGINE_KEY_PRIME: Final[int] = 2**60 - 93
"""The largest prime below ``2**60``: the index keeps engine hashes modulo it (`engine_key60`)."""

_MASK64: Final[int] = 2**64 - 1


class Holder(NamedTuple):
    """One prefix cache: a worker and its data-parallel rank."""

    worker_id: str
    dp_rank: int


class Overlap(NamedTuple):
    """One holder's overlap with a prompt (`PrefixIndex.match_tiers`)."""

    blocks: int
    """Leading prompt blocks held on any tier."""
    tiers: dict[str, int] | None
    """Those blocks per tier, each on its fastest tier (fastest first); None when all are on the default tier."""


def engine_key60(engine_hash: int) -> int:
    """Fold an engine hash to the 60-bit key the index stores: ``h mod (2**60 - 93)`` (`ENGINE_KEY_PRIME`).

    Identity for values below the prime (see the module docstring for the collision bound).
    """
    return engine_hash % ENGINE_KEY_PRIME


def tier_name(medium: str | None) -> str | None:
    """Normalize a medium: None for the default tier (no medium, ``""`` or any case of ``"GPU"``), else the
    upper-cased name."""
    if not medium:
        return None
    name = medium.upper()
    return None if name == DEFAULT_TIER else name


def tier_rank(medium: str | None) -> tuple[int, str]:
    """Sort key of a (normalized) tier, fastest first: the default tier (GPU), CPU, then the others by name."""
    if medium is None or medium == DEFAULT_TIER:
        return (0, "")
    if medium == "CPU":
        return (1, "")
    return (2, medium)


@dataclass(slots=True)
class _Orphan:
    engine_hashes: tuple[int, ...]
    local_hashes: tuple[int, ...]
    op: int
    medium: str | None


@dataclass(slots=True, eq=False)
class _Cache:
    """One tier of one holder."""

    holder: Holder
    medium: str | None
    """Normalized tier name; None: the default tier."""
    cid: int
    """Small int naming this cache in `PrefixIndex._where` (ids are reused once a cache is gone)."""
    # engine key -> prefix key (ints only, so a snapshot copy is one C-level dict copy)
    blocks: dict[int, int] = field(default_factory=dict)
    # engine key -> store count, only for blocks stored more than once (vLLM duplicate copies)
    counts: dict[int, int] = field(default_factory=dict)
    dsum: int = 0
    """Sum (unbounded, not masked) of `_entry_hash` over the cache's blocks, kept while the index tracks its
    digest; exactly 0 when the cache is empty."""
    dtag: bytes = b""
    """The cache's prefix of every digest entry: ``worker\\0rank`` (and ``\\0TIER`` off the default tier)."""
    dpack: Callable[[bytes, int, int, int], bytes] = struct.pack
    """``dpack(dtag, engine_key, prefix_key, count)``: one digest entry's bytes (a `struct.Struct` pack)."""


@dataclass(slots=True, eq=False)
class _HolderState(_Cache):
    """A holder: its default tier (the inherited maps), its other tiers and its held events."""

    # other tiers by normalized name, fastest first; None until a block is stored on one
    tiers: dict[str, _Cache] | None = None
    # (parent engine key, serial) -> held BlockStored events waiting for it, oldest first
    orphans: OrderedDict[tuple[int, int], tuple[int, _Orphan]] = field(default_factory=OrderedDict)
    orphan_serial: int = 0

    def caches(self) -> Iterator[tuple[str | None, _Cache]]:
        """Every tier of the holder, fastest first (None: the default tier)."""
        yield None, self
        if self.tiers:
            yield from self.tiers.items()


class StoreResult(NamedTuple):
    """What one `PrefixIndex.store` did.

    Attributes:
        attached: blocks newly indexed (this event's and any held descendants that attached).
        duplicates: blocks of the event that were already indexed (store count raised).
        held: True when the event waits for its unknown parent.
        dropped_orphans: held events pushed out by the per-holder bound or expired.
    """

    attached: int
    duplicates: int
    held: bool
    dropped_orphans: int


class RemoveResult(NamedTuple):
    """What one `PrefixIndex.remove` did.

    Attributes:
        removed: blocks no longer indexed (store count reached zero).
        decremented: blocks whose store count went down but stay indexed (duplicates).
        unknown: hashes that were not indexed for the holder and tier (ignored).
    """

    removed: int
    decremented: int
    unknown: int


_REMOVED_NONE: Final[RemoveResult] = RemoveResult(0, 0, 0)
_REMOVED_ONE: Final[RemoveResult] = RemoveResult(1, 0, 0)
_UNKNOWN_ONE: Final[RemoveResult] = RemoveResult(0, 0, 1)
_SEQUENCES: Final[frozenset[type]] = frozenset((list, tuple))


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexStats:
    """A snapshot of the index's size and counters."""

    holders: int
    blocks: int
    """Indexed (holder, tier, block) entries, duplicates counted once."""
    distinct_prefixes: int
    """Distinct prefix keys held by at least one holder on some tier."""
    held_orphans: int
    orphans_expired: int
    unknown_removals: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TierExport:
    """One non-default tier of a holder (see `HolderExport`)."""

    medium: str
    """Normalized (upper-case) medium name."""
    blocks: dict[int, int]
    counts: dict[int, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class HolderExport:
    """One holder's complete state, detached from the live index (see `PrefixIndex.export`).

    Attributes:
        holder: the (worker, dp_rank).
        blocks: engine key → prefix key of every block on the default tier (a private copy).
        counts: engine key → store count, only for default-tier blocks stored more than once.
        orphans: held BlockStored events in hold order, each ``(serial, parent, engine_keys, local_hashes,
            op, medium)`` where ``op`` is the index's store counter when it was held and ``medium`` the
            normalized tier (None: default).
        orphan_serial: the last hold serial handed out.
        tiers: the holder's other tiers, fastest first.
    """

    holder: Holder
    blocks: dict[int, int]
    counts: dict[int, int]
    orphans: tuple[tuple[int, int, tuple[int, ...], tuple[int, ...], int, str | None], ...]
    orphan_serial: int
    tiers: tuple[TierExport, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexExport:
    """A `PrefixIndex`'s complete state: everything `PrefixIndex.from_export` needs to continue identically."""

    max_orphans: int
    orphan_ttl_ops: int
    ops: int
    """Store operations so far (the clock of orphan expiry)."""
    orphans_expired: int
    unknown_removals: int
    holders: tuple[HolderExport, ...]
    """In the index's own order."""


class PrefixIndex:
    """Index of cached prefixes for one model and block size.

    Args:
        max_orphans: bound on held BlockStored events per holder (oldest dropped first).
        orphan_ttl_ops: a held event expires after this many later `store` calls on the index.
        track_digest: keep the digest up to date from the start (`track_digest`); otherwise the first
            `digest` call computes it once and turns tracking on.
    """

    def __init__(
        self,
        *,
        max_orphans: int = DEFAULT_MAX_ORPHANS,
        orphan_ttl_ops: int = DEFAULT_ORPHAN_TTL_OPS,
        track_digest: bool = False,
    ) -> None:
        self._track = track_digest
        """Whether every change updates the caches' `_Cache.dsum` (see `digest`)."""
        self._max_orphans = max_orphans
        self._orphan_ttl_ops = orphan_ttl_ops
        self._holders: dict[Holder, _HolderState] = {}
        # prefix key -> the caches (a holder's tier, by `_Cache.cid`) with a block of that key. Most prefixes
        # have one cache with one block: the value is then the cache's id itself (a shared small int), else a
        # {cid: number of that cache's engine blocks with this prefix key} dict. Ints only, so the garbage
        # collector never traverses this map (nor the block maps).
        self._where: dict[int, int | dict[int, int]] = {}
        self._caches: list[_Cache | None] = []
        """cid -> cache; None for a free id."""
        self._free_cids: list[int] = []
        self._tiered = 0
        """Non-default tier caches in the index; 0 lets `match` skip the per-tier bookkeeping."""
        self._ops = 0
        self._orphans_expired = 0
        self._unknown_removals = 0

    # ------------------------------------------------------------------ updates

    def store(
        self,
        holder: Holder,
        engine_hashes: Sequence[int],
        parent: int | None,
        local_hashes: Sequence[int],
        medium: str | None = None,
    ) -> StoreResult:
        """Index consecutive full blocks of one holder (a BlockStored).

        Args:
            holder: the (worker, dp_rank) that stored the blocks.
            engine_hashes: the engine's block hashes as unsigned 64-bit keys, in order.
            parent: engine hash of the block before the first one, or None when the first is block 0.
            local_hashes: kvmesh local hashes of the same blocks (same length as ``engine_hashes``).
            medium: the storage tier (None or "GPU": the default tier).

        Raises:
            ValueError: the two hash lists differ in length.
        """
        if len(engine_hashes) != len(local_hashes):
            raise ValueError(f"{len(engine_hashes)} engine hashes but {len(local_hashes)} local hashes")
        self._ops += 1
        state = self._holders.get(holder)
        if state is None:
            state = self._new_holder(holder)
        dropped = self._expire(state) if state.orphans else 0
        cache: _Cache | None = state
        name = None
        if medium is not None:
            name = tier_name(medium)
            if name is not None:  # created below, once something attaches
                cache = state.tiers.get(name) if state.tiers else None
        prime = ENGINE_KEY_PRIME
        keys = [h % prime for h in engine_hashes]
        if parent is None:
            parent_key: int | None = None
        else:
            parent %= prime
            parent_key = cache.blocks.get(parent) if cache is not None else None
            if parent_key is None and (cache is not state or state.tiers):
                parent_key = _find_parent(state, parent)
            if parent_key is None:
                dropped += self._hold(state, parent, tuple(keys), tuple(local_hashes), name)
                return StoreResult(0, 0, True, dropped)
        if cache is None:
            if not keys:
                return StoreResult(0, 0, False, dropped)
            assert name is not None
            cache = self._tier(state, name)
        attached, dups = self._attach(cache, keys, prefix_keys(local_hashes, parent_key))
        if state.orphans and keys:
            more, more_dups = self._attach_held(state, keys)
            attached += more
            dups += more_dups
        return StoreResult(attached, dups, False, dropped)

    def remove(self, holder: Holder, engine_hashes: Iterable[int], medium: str | None = None) -> RemoveResult:
        """Remove one copy of each block (a BlockRemoved) from one tier; unknown hashes are counted and skipped.

        Args:
            holder: the (worker, dp_rank).
            engine_hashes: the engine's block hashes.
            medium: the tier to remove from (None or "GPU": the default tier).
        """
        cache: _Cache | None = self._holders.get(holder)
        if cache is not None and medium is not None:
            name = tier_name(medium)
            if name is not None:
                tiers = self._holders[holder].tiers
                cache = tiers.get(name) if tiers else None
        prime = ENGINE_KEY_PRIME
        if (
            cache is not None
            and not cache.counts
            and type(engine_hashes) in _SEQUENCES
            and len(engine_hashes) == 1  # type: ignore[arg-type]  # a list or tuple here
        ):
            # One block (vLLM sends one BlockRemoved per evicted block): no list work.
            blocks = cache.blocks
            key = engine_hashes[0] % prime  # type: ignore[index]
            prefix = blocks.pop(key, None)
            if prefix is None:
                self._unknown_removals += 1
                return _UNKNOWN_ONE
            if self._track:
                cache.dsum -= _xxh3(cache.dpack(cache.dtag, key, prefix, 1), SEED)
            where = self._where
            old = where.pop(prefix)
            if old != cache.cid:  # held by several caches (or twice by this one)
                where[prefix] = old
                self._unwhere(prefix, cache.cid)
            if cache.medium is not None and not blocks:
                self._drop_tier(cache)
            return _REMOVED_ONE
        keys = [h % prime for h in engine_hashes]
        if cache is None:
            self._unknown_removals += len(keys)
            return RemoveResult(0, 0, len(keys)) if keys else _REMOVED_NONE
        blocks = cache.blocks
        counts = cache.counts
        where = self._where
        cid = cache.cid
        removed = decremented = unknown = 0
        if not counts or counts.keys().isdisjoint(keys):
            found = list(map(blocks.pop, keys, repeat(None)))
            unknown = found.count(None)
            prefixes = [p for p in found if p is not None] if unknown else cast("list[int]", found)
            self._unwhere_many(prefixes, cid)
            removed = len(prefixes)
            if self._track and prefixes:
                gone = list(compress(keys, [p is not None for p in found])) if unknown else keys
                cache.dsum -= _entries_sum(cache, gone, prefixes)
        else:
            pop = blocks.pop
            track = self._track
            for h in keys:
                if h in counts:
                    count = counts[h]
                    if count > 2:
                        counts[h] = count - 1
                    else:
                        del counts[h]
                    if track:
                        p = blocks[h]
                        cache.dsum += _entry_hash(cache, h, p, count - 1) - _entry_hash(cache, h, p, count)
                    decremented += 1
                    continue
                prefix = pop(h, None)
                if prefix is None:
                    unknown += 1
                    continue
                if track:
                    cache.dsum -= _entry_hash(cache, h, prefix, 1)
                # Inline fast path of `_unwhere`: the prefix held once by this cache alone.
                if where.get(prefix) == cid:
                    del where[prefix]
                else:
                    self._unwhere(prefix, cid)
                removed += 1
        self._unknown_removals += unknown
        if cache.medium is not None and not blocks and not counts:
            self._drop_tier(cache)
        return RemoveResult(removed, decremented, unknown)

    def touch(self, holder: Holder) -> None:
        """Make a holder known with nothing cached (a worker that announced itself)."""
        if holder not in self._holders:
            self._new_holder(holder)

    def clear(self, holder: Holder) -> int:
        """Drop every block (on every tier) and held event of one holder (AllBlocksCleared); the holder stays
        known.

        Returns:
            the number of blocks dropped.
        """
        state = self._holders.get(holder)
        if state is None:
            return 0
        n = 0
        for _name, cache in list(state.caches()):
            self._unwhere_many(list(cache.blocks.values()), cache.cid)
            n += len(cache.blocks)
            cache.blocks.clear()
            cache.counts.clear()
            cache.dsum = 0
            if cache is not state:
                self._drop_tier(cache)
        state.orphans.clear()
        return n

    def remove_worker(self, worker_id: str) -> int:
        """Forget every holder (all dp ranks, all tiers) of a worker. Returns blocks dropped."""
        gone = [h for h in self._holders if h.worker_id == worker_id]
        n = sum(self.clear(h) for h in gone)
        for h in gone:
            self._release(self._holders.pop(h))
        return n

    # ------------------------------------------------------------------ queries

    def match(self, prompt_keys: Iterable[int]) -> dict[Holder, int]:
        """Count, per holder, how many leading blocks of a prompt it holds (on any tier).

        Args:
            prompt_keys: the prompt's prefix keys (`kvmesh.core.hashing.prompt_prefix_keys`, or the lazy
                `kvmesh.core.hashing.iter_prompt_prefix_keys`: consumed only as far as some holder matches).

        Returns:
            ``{holder: overlap_blocks}`` for holders with at least one leading block; others are absent.
            A holder missing block *i* scores *i* even if it holds later blocks.
        """
        if self._tiered:
            return {h: o.blocks for h, o in self._match_tiered(prompt_keys).items()}
        return self._match_default(prompt_keys)

    def match_tiers(self, prompt_keys: Iterable[int]) -> dict[Holder, Overlap]:
        """Like `match`, with each holder's overlap blocks per tier (see the module docstring).

        Returns:
            ``{holder: Overlap(blocks, tiers)}`` for holders with at least one leading block.
        """
        if self._tiered:
            return self._match_tiered(prompt_keys)
        return {h: Overlap(n, None) for h, n in self._match_default(prompt_keys).items()}

    def holders(self) -> list[Holder]:
        """Return every holder with indexed blocks or held events, sorted."""
        return sorted(self._holders)

    def block_count(self, holder: Holder) -> int:
        """Return the number of blocks indexed for a holder, over every tier (one per tier a block is on)."""
        state = self._holders.get(holder)
        if state is None:
            return 0
        return len(state.blocks) + (sum(len(c.blocks) for c in state.tiers.values()) if state.tiers else 0)

    def holds(self, holder: Holder, engine_hash: int, medium: str | None = None) -> bool:
        """Tell whether a holder has the block with this engine hash indexed on a tier (default: GPU)."""
        state = self._holders.get(holder)
        if state is None:
            return False
        name = tier_name(medium)
        cache = state if name is None else (state.tiers or {}).get(name)
        return cache is not None and engine_key60(engine_hash) in cache.blocks

    def stats(self) -> IndexStats:
        """Return a snapshot of sizes and counters."""
        return IndexStats(
            holders=len(self._holders),
            blocks=sum(len(c.blocks) for s in self._holders.values() for _n, c in s.caches()),
            distinct_prefixes=len(self._where),
            held_orphans=sum(len(s.orphans) for s in self._holders.values()),
            orphans_expired=self._orphans_expired,
            unknown_removals=self._unknown_removals,
        )

    def digest(self) -> int:
        """Return an order-independent 64-bit digest of the indexed content.

        Two indexes that hold the same (holder, tier, engine key, prefix key, store count) entries have the
        same digest, whatever order the events came in. Held orphans are not included. The value is
        `digest_from_scratch`'s: the sum modulo ``2**64`` of one XXH3-64 (seed 1337) per entry, over
        ``worker\\0rank[\\0TIER] ‖ le64(engine key) ‖ le64(prefix key) ‖ le32(store count)``.

        O(caches) (one per holder and tier in use): every change keeps a per-cache sum up to date. The first
        call on an index built without ``track_digest`` computes those sums once (O(total blocks)) and turns
        tracking on; from then on a stored or removed block costs one more hash (about 150 ns).
        """
        if not self._track:
            self.track_digest()
        total = 0
        for cache in self._caches:
            if cache is not None:
                total += cache.dsum
        return total & _MASK64

    def track_digest(self) -> None:
        """Keep the digest up to date from now on: compute every cache's sum once (O(total blocks)).

        Idempotent: does nothing when the index already tracks it.
        """
        if self._track:
            return
        for state in self._holders.values():
            for _name, cache in state.caches():
                counts = cache.counts
                if not counts:
                    cache.dsum = _entries_sum(cache, list(cache.blocks), list(cache.blocks.values()))
                    continue
                cache.dsum = sum(
                    _entry_hash(cache, h, key, counts.get(h, 1)) for h, key in cache.blocks.items()
                )
        self._track = True

    def digest_from_scratch(self) -> int:
        """Return `digest`'s value computed from the block maps alone, O(total blocks) (a check of the
        incrementally kept one)."""
        total = 0
        for holder, state in self._holders.items():
            for name, cache in state.caches():
                tag = f"{holder.worker_id}\x00{holder.dp_rank}".encode()
                if name is not None:
                    tag += b"\x00" + name.encode()
                counts = cache.counts
                for h, key in cache.blocks.items():
                    count = counts.get(h, 1)
                    total = (
                        total
                        + xxhash.xxh3_64_intdigest(
                            tag
                            + h.to_bytes(8, "little")
                            + key.to_bytes(8, "little")
                            + count.to_bytes(4, "little"),
                            seed=SEED,
                        )
                    ) & _MASK64
        return total

    def dump(self) -> Iterator[tuple[Holder, str, int, int, int]]:
        """Yield ``(holder, tier, engine_key, prefix_key, store_count)`` for every indexed block; ``tier`` is
        the normalized medium (`DEFAULT_TIER` for the default one)."""
        for holder, state in self._holders.items():
            for name, cache in state.caches():
                counts = cache.counts
                tier = DEFAULT_TIER if name is None else name
                for h, key in cache.blocks.items():
                    yield holder, tier, h, key, counts.get(h, 1)

    # ------------------------------------------------------------------ snapshots

    def export(self) -> IndexExport:
        """Copy the complete state out of the index, cheaply enough to do between two applied messages.

        The block maps are copied with ``dict.copy()`` (a C loop over int keys and values: about 10 ms per
        million blocks on these machines); everything else is small. The export shares nothing mutable
        with the index, so it can be encoded in another thread while the index keeps changing.
        """
        return IndexExport(
            max_orphans=self._max_orphans,
            orphan_ttl_ops=self._orphan_ttl_ops,
            ops=self._ops,
            orphans_expired=self._orphans_expired,
            unknown_removals=self._unknown_removals,
            holders=tuple(
                HolderExport(
                    holder=holder,
                    blocks=state.blocks.copy(),
                    counts=state.counts.copy(),
                    orphans=tuple(
                        (serial, parent, o.engine_hashes, o.local_hashes, o.op, o.medium)
                        for (_p, serial), (parent, o) in state.orphans.items()
                    ),
                    orphan_serial=state.orphan_serial,
                    tiers=tuple(
                        TierExport(medium=name, blocks=c.blocks.copy(), counts=c.counts.copy())
                        for name, c in (state.tiers or {}).items()
                    ),
                )
                for holder, state in self._holders.items()
            ),
        )

    @classmethod
    def from_export(cls, export: IndexExport, *, track_digest: bool = False) -> PrefixIndex:
        """Rebuild an index from `export()`; it takes ownership of the export's dicts.

        O(total blocks): the prefix key → holders map is rebuilt from the block maps; with ``track_digest``
        the digest's sums too (`track_digest`), else the first `digest` call computes them.
        """
        index = cls(max_orphans=export.max_orphans, orphan_ttl_ops=export.orphan_ttl_ops)
        index._ops = export.ops
        index._orphans_expired = export.orphans_expired
        index._unknown_removals = export.unknown_removals
        for h in export.holders:
            state = index._new_holder(Holder(h.holder[0], h.holder[1]))
            state.blocks, state.counts = h.blocks, h.counts
            state.orphan_serial = h.orphan_serial
            for serial, parent, engine, local, op, medium in h.orphans:
                state.orphans[(parent, serial)] = (parent, _Orphan(tuple(engine), tuple(local), op, medium))
            for t in h.tiers:
                if t.blocks or t.counts:
                    cache = index._tier(state, t.medium)
                    cache.blocks, cache.counts = t.blocks, t.counts
            for _name, cache in state.caches():
                for key in cache.blocks.values():
                    index._where_add(key, cache.cid)
        if track_digest:
            index.track_digest()
        return index

    # ------------------------------------------------------------------ internals

    def _new_cid(self, cache: _Cache) -> None:
        tag = f"{cache.holder.worker_id}\x00{cache.holder.dp_rank}".encode()
        if cache.medium is not None:
            tag += b"\x00" + cache.medium.encode()
        cache.dtag = tag
        cache.dpack = struct.Struct(f"<{len(tag)}sQQI").pack
        if self._free_cids:
            cache.cid = self._free_cids.pop()
            self._caches[cache.cid] = cache
        else:
            cache.cid = len(self._caches)
            self._caches.append(cache)

    def _release(self, cache: _Cache) -> None:
        """Give a cache's id back (the cache holds nothing, so `_where` no longer names it)."""
        self._caches[cache.cid] = None
        self._free_cids.append(cache.cid)

    def _new_holder(self, holder: Holder) -> _HolderState:
        state = self._holders[holder] = _HolderState(holder, None, -1)
        self._new_cid(state)
        return state

    def _tier(self, state: _HolderState, name: str) -> _Cache:
        """The holder's cache of a (normalized, non-default) tier, created on first use."""
        tiers = state.tiers
        cache = tiers.get(name) if tiers else None
        if cache is None:
            cache = _Cache(state.holder, name, -1)
            self._new_cid(cache)
            merged = {**(tiers or {}), name: cache}
            state.tiers = {n: merged[n] for n in sorted(merged, key=tier_rank)}
            self._tiered += 1
        return cache

    def _drop_tier(self, cache: _Cache) -> None:
        """Forget an emptied non-default tier cache (so an all-GPU index matches on the fast path again)."""
        state = self._holders[cache.holder]
        assert state.tiers is not None and cache.medium is not None
        del state.tiers[cache.medium]
        if not state.tiers:
            state.tiers = None
        self._tiered -= 1
        self._release(cache)

    def _match_default(self, keys: Iterable[int]) -> dict[Holder, int]:
        """`match` when every block is on the default tier: each cache id in `_where` is a whole holder.

        ``keys`` is consumed only up to the first block no holder has (a lazy iterator hashes no further).
        """
        it = iter(keys)
        where = self._where
        first = where.get(next(it, -1))  # -1 is no key: keys are ≥ 0
        if first is None:
            return {}
        caches = self._caches
        result: dict[Holder, int] = {}
        alive: set[int] = set(first) if isinstance(first, dict) else {first}
        depth = 1
        for h in it:
            here = where.get(h)
            if here is None:
                break
            if type(here) is dict:
                if here.keys() >= alive:  # every holder still matching holds this block too (no new set)
                    depth += 1
                    continue
                nxt = alive.intersection(here)
            else:
                nxt = {here} if here in alive else set()
            if len(nxt) != len(alive):
                for gone in alive - nxt:
                    result[caches[gone].holder] = depth  # type: ignore[union-attr]
                if not nxt:
                    alive = nxt
                    break
            alive = nxt
            depth += 1
        for cid in alive:
            result[caches[cid].holder] = depth  # type: ignore[union-attr]
        return result

    def _match_tiered(self, keys: Iterable[int]) -> dict[Holder, Overlap]:
        """`match_tiers` when some holder has blocks off the default tier."""
        where = self._where
        caches = self._caches
        result: dict[Holder, Overlap] = {}
        # holder -> overlap blocks per tier so far (None: default tier)
        alive: dict[Holder, dict[str | None, int]] = {}
        depth = 0
        for k in keys:
            entry = where.get(k)
            if entry is None:
                break
            best: dict[Holder, str | None] = {}
            for cid in entry if isinstance(entry, dict) else (entry,):
                cache = caches[cid]
                assert cache is not None
                holder, medium = cache.holder, cache.medium
                if depth and holder not in alive:
                    continue
                if holder not in best or tier_rank(medium) < tier_rank(best[holder]):
                    best[holder] = medium
            if depth:
                if len(best) != len(alive):
                    for gone in [h for h in alive if h not in best]:
                        result[gone] = _overlap(depth, alive.pop(gone))
                if not best:
                    break
            else:
                alive = {h: {} for h in best}
            for holder, medium in best.items():
                per_tier = alive[holder]
                per_tier[medium] = per_tier.get(medium, 0) + 1
            depth += 1
        for holder, per_tier in alive.items():
            result[holder] = _overlap(depth, per_tier)
        return result

    def _attach(self, cache: _Cache, keys: list[int], prefixes: list[int]) -> tuple[int, int]:
        """Index engine keys with their prefix keys in one cache; returns (attached, duplicates)."""
        blocks = cache.blocks
        where = self._where
        cid = cache.cid
        n = len(keys)
        if n > 1 and blocks.keys().isdisjoint(keys):
            # All new to this cache (the common case): C-level dict updates instead of a loop per block.
            before = len(blocks)
            blocks.update(zip(keys, prefixes, strict=True))
            if len(blocks) - before == n:
                if self._track:
                    cache.dsum += _entries_sum(cache, keys, prefixes)
                if where.keys().isdisjoint(prefixes):
                    before = len(where)
                    where.update(zip(prefixes, repeat(cid)))
                    if len(where) - before == n:
                        return n, 0
                    for p in prefixes:  # a prefix key twice in this event: undo, then one by one
                        where.pop(p, None)
                get = where.get
                for p in prefixes:
                    here = get(p)
                    if here is None:
                        where[p] = cid
                    elif isinstance(here, dict):
                        here[cid] = here.get(cid, 0) + 1
                    else:
                        where[p] = {here: 2} if here == cid else {here: 1, cid: 1}
                return n, 0
            for h in keys:  # an engine hash twice in this event: undo, then one by one
                blocks.pop(h, None)
        attached = dups = 0
        counts = cache.counts
        track = self._track
        for h, p in zip(keys, prefixes, strict=True):
            if h in blocks:
                count = counts.get(h, 1)
                counts[h] = count + 1
                if track:
                    key = blocks[h]
                    cache.dsum += _entry_hash(cache, h, key, count + 1) - _entry_hash(cache, h, key, count)
                dups += 1
                continue
            blocks[h] = p
            if track:
                cache.dsum += _entry_hash(cache, h, p, 1)
            here = where.get(p)
            if here is None:
                where[p] = cid
            elif isinstance(here, dict):
                here[cid] = here.get(cid, 0) + 1
            else:
                where[p] = {here: 2} if here == cid else {here: 1, cid: 1}
            attached += 1
        return attached, dups

    def _where_add(self, key: int, cid: int) -> None:
        where = self._where
        here = where.get(key)
        if here is None:
            where[key] = cid
        elif isinstance(here, dict):
            here[cid] = here.get(cid, 0) + 1
        else:
            where[key] = {here: 2} if here == cid else {here: 1, cid: 1}

    def _unwhere_many(self, prefixes: list[int], cid: int) -> None:
        """Drop one block of cache ``cid`` for each prefix key (keys may repeat)."""
        where = self._where
        olds = list(map(where.pop, prefixes, repeat(None)))
        if olds.count(cid) == len(olds):
            return  # every key was held once, by this cache alone: popping was all there was to do
        for p, old in zip(prefixes, olds, strict=True):
            if old == cid:  # held once, by this cache alone: popped, done
                continue
            if old is None:  # a repeated key, popped by its first occurrence (restored by then)
                self._unwhere(p, cid)
            elif isinstance(old, dict):  # held by several caches: one block fewer for this one
                n = old[cid] - 1
                if n:
                    old[cid] = n
                else:
                    del old[cid]
                if len(old) > 1:
                    where[p] = old
                elif old:
                    ((only, count),) = old.items()
                    where[p] = only if count == 1 else old

    def _unwhere(self, key: int, cid: int) -> None:
        where = self._where
        here = where[key]
        if not isinstance(here, dict):
            del where[key]
            return
        n = here[cid] - 1
        if n:
            here[cid] = n
        else:
            del here[cid]
        if not here:
            del where[key]
        elif len(here) == 1:
            ((only, count),) = here.items()
            if count == 1:
                where[key] = only

    def _hold(
        self,
        state: _HolderState,
        parent: int,
        engine_keys: tuple[int, ...],
        local: tuple[int, ...],
        medium: str | None,
    ) -> int:
        state.orphan_serial += 1
        state.orphans[(parent, state.orphan_serial)] = (
            parent,
            _Orphan(engine_keys, local, self._ops, medium),
        )
        dropped = 0
        while len(state.orphans) > self._max_orphans:
            state.orphans.popitem(last=False)
            dropped += 1
        self._orphans_expired += dropped
        return dropped

    def _expire(self, state: _HolderState) -> int:
        dropped = 0
        limit = self._ops - self._orphan_ttl_ops
        while state.orphans:
            key, (_parent, orphan) = next(iter(state.orphans.items()))
            if orphan.op >= limit:  # still inside its orphan_ttl_ops later stores
                break
            del state.orphans[key]
            dropped += 1
        self._orphans_expired += dropped
        return dropped

    def _attach_held(self, state: _HolderState, new_keys: Sequence[int]) -> tuple[int, int]:
        attached = dups = 0
        frontier = list(new_keys)
        while frontier and state.orphans:
            ready = set(frontier)
            frontier = []
            for key in [k for k, (p, _o) in state.orphans.items() if p in ready]:
                parent, orphan = state.orphans.pop(key)
                parent_key = _find_parent(state, parent, orphan.medium)
                if parent_key is None:  # removed again in the meantime; keep waiting
                    state.orphans[key] = (parent, orphan)
                    continue
                cache = state if orphan.medium is None else self._tier(state, orphan.medium)
                prefixes = prefix_keys(orphan.local_hashes, parent_key)
                a, d = self._attach(cache, list(orphan.engine_hashes), prefixes)
                attached += a
                dups += d
                frontier.extend(orphan.engine_hashes)
        return attached, dups


_xxh3: Final = xxhash.xxh3_64_intdigest


def _entry_hash(cache: _Cache, engine_key: int, prefix_key: int, count: int) -> int:
    """One digest entry of a cache's block (see `PrefixIndex.digest`)."""
    return _xxh3(cache.dpack(cache.dtag, engine_key, prefix_key, count), SEED)


def _entries_sum(cache: _Cache, engine_keys: Iterable[int], prefixes: Iterable[int]) -> int:
    """The digest entries of blocks stored once, summed (not masked); C-level loops, no bytecode per block."""
    return sum(
        map(_xxh3, map(cache.dpack, repeat(cache.dtag), engine_keys, prefixes, repeat(1)), repeat(SEED))
    )


def _find_parent(state: _HolderState, parent: int, first: str | None = None) -> int | None:
    """A parent's prefix key on tier ``first``, else on any tier of the holder, fastest tier first."""
    if first is not None and state.tiers and first in state.tiers:
        key = state.tiers[first].blocks.get(parent)
        if key is not None:
            return key
    for _name, cache in state.caches():
        key = cache.blocks.get(parent)
        if key is not None:
            return key
    return None


def _overlap(blocks: int, per_tier: dict[str | None, int]) -> Overlap:
    if per_tier.keys() == {None}:
        return Overlap(blocks, None)
    ordered = sorted(per_tier.items(), key=lambda kv: tier_rank(kv[0]))
    return Overlap(blocks, {DEFAULT_TIER if m is None else m: n for m, n in ordered})
