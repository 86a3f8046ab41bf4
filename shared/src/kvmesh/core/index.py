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
* A removal of an unknown block is counted and ignored; the rest of the removal still applies. If the block
  is held (in a BlockStored waiting for its parent), the held copy goes: the held event is split there, the
  blocks after it waiting for the removed block, so a parent that arrives later never brings back a block the
  engine removed.

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

The index keeps two kinds of key (the key scheme of snapshot format 4):

* **prefix keys** are the standard 64-bit sequence hashes, `kvmesh.core.hashing.prefix_keys` (Dynamo's
  ``SequenceHash``; collision bound there: about ``n² / 2**65`` for *n* distinct prefixes, 2.7·10⁻⁸ at 1M,
  2.7·10⁻⁶ at 10M); the matching side hashes prompts with `kvmesh.core.tables.prompt_keys` (the rule of
  `kvmesh.core.hashing.prompt_prefix_keys`, compiled), or takes a caller's sequence hashes as they are; a
  match takes its keys as any iterable of ints or as one uint64 array (looked up in one compiled call).
* **engine hashes** are folded to 60 bits on the way in (`engine_key60`: modulo ``2**60 - 93``, the largest
  prime below ``2**60``). Values below that prime are kept as they are, so small or sequential engine ids
  never collide with each other. For uniformly random 64-bit engine hashes — what every engine kvmesh reads
  sends (vLLM: sha256 or Python ``hash()``, the last 8 bytes of a ``bin`` hash; SGLang: digest bytes) — two
  distinct blocks of *one* holder and tier fold together with probability about ``m² / 2**61`` for *m*
  blocks on that holder (1.6·10⁻⁸ at 125k blocks, 4.3·10⁻⁷ at 1M); the second would count as a duplicate
  copy of the first (that block's overlap answer off by one until it is removed). Two hashes collide only
  when they differ by a multiple of the prime, which no natural pattern does; keeping the low 60 bits, or
  xor-ing the top 4 bits down, would instead merge a tagged counter such as ``2**63 + i`` with the plain
  ``i`` (a fixture of the ingest tests does exactly this). `dump`, `export` and `holds` use the folded values.

Per stored block the index keeps one slot of a blocks table (engine key, cache id, the slot of its prefix
key: 16 bytes) and, for a prefix key no other block has, one slot of a prefixes table (prefix key and the
cache holding it: 12 bytes): flat numpy arrays with compiled kernels (`kvmesh.core.tables`), filled to 57 –
85 %, so 33 – 49 bytes of resident memory per block (`kvmesh bench index --memory`). A prefix key held by
more than one block (other holders, tiers or copies) is marked shared in its slot and its holders are kept
in a Python map: a tuple of cache ids while each of up to `SHARED_TUPLE_MAX` caches holds it once (the usual
case; one tuple for a whole run of such keys, where a dict per key took 224 bytes), else ``{cache id:
blocks}``;
store counts above one are kept per cache in a dict too. No Python object
exists per block, so the garbage collector has nothing to traverse.

Complexity (n = blocks in an event, h = holders, q = blocks in a query):

| operation | cost |
|---|---|
| `store` | O(n) table operations in one compiled call (+ held descendants that attach) |
| `store_sequence` | O(n), the same compiled call with the prefix keys given |
| `remove` | O(n) |
| `clear` | O(blocks in the index): one compiled scan of the blocks table, then O(blocks of that holder) |
| `match` | O(q) lookups in one compiled call, then O(q · holders still matching) |
| `digest` | O(blocks in the index) in one compiled scan (a few ms per million blocks) |
| `export` | O(blocks in the index): one compiled scan into per-cache arrays |
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Final, NamedTuple, TypeAlias

import numpy as np
import xxhash

from kvmesh.core import tables
from kvmesh.core.hashing import SEED
from kvmesh.core.tables import I32, U64

DEFAULT_MAX_ORPHANS: Final[int] = 4096
"""Held BlockStored events per holder before the oldest is dropped."""
DEFAULT_ORPHAN_TTL_OPS: Final[int] = 100_000
"""Store operations on the index after which a held BlockStored expires."""
DEFAULT_TIER: Final[str] = "GPU"
"""Name of the default tier: events without a medium, and ``"GPU"``."""

ENGINE_KEY_PRIME: Final[int] = 2**60 - 93
"""The largest prime below ``2**60``: the index keeps engine hashes modulo it (`engine_key60`)."""

_MASK64: Final[int] = 2**64 - 1
_SHARED: Final[int] = tables.SHARED
SHARED_TUPLE_MAX: Final[int] = 4096
"""The most caches a shared prefix key keeps as a tuple of cache ids (one block each); more, or a second
block of one cache, and its holders are a ``{cache id: blocks}`` dict. A run of keys that the same caches
hold shares one tuple (`PrefixIndex._hold`), so a prefix that a whole fleet holds costs one tuple, and a
match passes each of its keys in O(1) (1,024 workers: 0.87 → 0.35 ms per match, docs/benchmarks.md)."""
_Holders: TypeAlias = "tuple[int, ...] | dict[int, int]"
_FIRST_CHUNK: Final[int] = 16
"""Prompt keys looked up in the first compiled call of a match; each further call takes twice as many."""


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
    """One tier of one holder: its blocks live in the index's tables under `cid`."""

    holder: Holder
    medium: str | None
    """Normalized tier name; None: the default tier."""
    cid: int
    """Small int naming this cache in the tables (ids are reused once a cache is gone)."""
    n: int = 0
    """Blocks indexed (each engine key once, whatever its store count)."""
    # engine key -> store count, only for blocks stored more than once (vLLM duplicate copies)
    counts: dict[int, int] = field(default_factory=dict)
    tag: int = 0
    """The cache's digest tag: XXH3-64 (seed 1337) of ``worker\\0rank`` (and ``\\0TIER`` off the default tier)."""
    order: U64 | None = None
    """Store order (an index that keeps it, `PrefixIndex` ``keep_order``): engine keys in the order they were
    newly indexed, live in ``order[head:tail]``, plus entries of keys removed since (``gone``)."""
    head: int = 0
    tail: int = 0
    gone: array[int] | None = None
    """Engine keys removed since the last compaction of ``order``, once per removal (``array('Q')``): each
    cancels the oldest entry of its key in ``order``."""


@dataclass(slots=True, eq=False)
class _HolderState(_Cache):
    """A holder: its default tier (the inherited fields), its other tiers and its held events."""

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


class PlaceResult(NamedTuple):
    """What one `PrefixIndex.place` did.

    Attributes:
        placed: blocks newly indexed on the tier.
        duplicates: blocks already on that tier (store count raised, as for a repeated BlockStored).
        unknown: hashes the holder has on no tier (ignored: their chain position is unknown).
    """

    placed: int
    duplicates: int
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


class TierCount(NamedTuple):
    """One tier of one holder in `PrefixIndex.tier_counts`."""

    holder: Holder
    tier: str
    """Normalized medium (`DEFAULT_TIER` for the default one)."""
    blocks: int
    held_orphans: int
    """The holder's held events (reported on its default tier only; 0 on the others)."""


def _empty_keys() -> U64:
    return np.zeros(0, dtype=np.uint64)


@dataclass(frozen=True, slots=True, kw_only=True)
class TierExport:
    """One non-default tier of a holder (see `HolderExport`)."""

    medium: str
    """Normalized (upper-case) medium name."""
    engine: U64
    """Engine keys of the tier's blocks (uint64, one per block; least recently stored first when the index
    keeps store order, else in no particular order)."""
    prefixes: U64
    """The prefix key of each of those blocks (same length)."""
    counts: dict[int, int]

    @property
    def blocks(self) -> dict[int, int]:
        """Engine key → prefix key, as a new dict (O(blocks): for tests and small exports)."""
        return dict(zip(self.engine.tolist(), self.prefixes.tolist(), strict=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class HolderExport:
    """One holder's complete state, detached from the live index (see `PrefixIndex.export`).

    Attributes:
        holder: the (worker, dp_rank).
        engine: engine keys of every block on the default tier (uint64 array, a private copy; least recently
            stored first when the index keeps store order, else in no particular order).
        prefixes: the prefix key of each of those blocks (uint64 array, same length).
        counts: engine key → store count, only for default-tier blocks stored more than once.
        orphans: held BlockStored events in hold order, each ``(serial, parent, engine_keys, local_hashes,
            op, medium)`` where ``op`` is the index's store counter when it was held and ``medium`` the
            normalized tier (None: default).
        orphan_serial: the last hold serial handed out.
        tiers: the holder's other tiers, fastest first.
    """

    holder: Holder
    engine: U64 = field(default_factory=_empty_keys)
    prefixes: U64 = field(default_factory=_empty_keys)
    counts: dict[int, int] = field(default_factory=dict)
    orphans: tuple[tuple[int, int, tuple[int, ...], tuple[int, ...], int, str | None], ...] = ()
    orphan_serial: int = 0
    tiers: tuple[TierExport, ...] = ()

    @property
    def blocks(self) -> dict[int, int]:
        """Engine key → prefix key of the default tier, as a new dict (O(blocks): for tests and small
        exports)."""
        return dict(zip(self.engine.tolist(), self.prefixes.tolist(), strict=True))


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


def as_keys(values: Iterable[int], *, fold: bool = True) -> U64:
    """Engine hashes (unsigned 64-bit ints, any iterable) as a uint64 array, folded to the index's engine keys
    (`engine_key60`) unless ``fold`` is false.

    Raises:
        ValueError: a value is negative or not below ``2**64``.
    """
    try:
        arr = np.array(
            values if type(values) in _SEQUENCES or isinstance(values, np.ndarray) else list(values),
            dtype=np.uint64,
        )
    except OverflowError:
        raise ValueError("engine hashes must be unsigned 64-bit ints") from None
    if fold:
        tables.fold(arr)
    return arr


_NO_KEYS: Final[U64] = np.zeros(0, dtype=np.uint64)


class PrefixIndex:
    """Index of cached prefixes for one model and block size.

    Args:
        max_orphans: bound on held BlockStored events per holder (oldest dropped first).
        orphan_ttl_ops: a held event expires after this many later `store` (or `place`) calls on the index.
        track_digest: accepted for compatibility; the digest is computed on demand (`digest`).
        keep_order: keep each cache's store order (8 – 10 bytes more per block), which `evict_to` needs; an
            index with a block bound (`kvmesh.core.state.IndexState` ``max_blocks``) keeps it.
    """

    def __init__(
        self,
        *,
        max_orphans: int = DEFAULT_MAX_ORPHANS,
        orphan_ttl_ops: int = DEFAULT_ORPHAN_TTL_OPS,
        track_digest: bool = False,
        keep_order: bool = False,
    ) -> None:
        del track_digest
        self._keep_order = keep_order
        self._max_orphans = max_orphans
        self._orphan_ttl_ops = orphan_ttl_ops
        self._holders: dict[Holder, _HolderState] = {}
        self._sorted_holders: tuple[Holder, ...] | None = None
        """`holders`, kept until a holder comes or goes (every match lists them)."""
        self._bk, self._bc, self._bp = tables.new_blocks(tables.MIN_CAPACITY)
        self._pk, self._pv = tables.new_prefixes(tables.MIN_CAPACITY)
        self._meta = np.zeros(3, dtype=np.int64)
        self._b_limit = int(tables.MIN_CAPACITY * tables.MAX_LOAD)
        self._p_limit = self._b_limit
        self._b_low = -1
        """Blocks below which the blocks table is rebuilt smaller (-1: at its minimum size)."""
        self._nb = 0
        """Blocks in the blocks table (the sum of every cache's `_Cache.n`)."""
        # prefix key -> its holders, for keys whose slot is SHARED: a tuple of distinct cids, one block each
        # (2 to SHARED_TUPLE_MAX of them), or {cid: blocks of that cache with the key}
        self._shared: dict[int, _Holders] = {}
        self._st = np.zeros(64, dtype=np.int32)
        self._aux = np.zeros(64, dtype=np.int32)
        self._caches: list[_Cache | None] = []
        """cid -> cache; None for a free id."""
        self._free_cids: list[int] = []
        self._tiered = 0
        """Non-default tier caches in the index; 0 lets `match` skip the per-tier bookkeeping."""
        self._ops = 0
        self._orphans_expired = 0
        self._unknown_removals = 0
        self._digest: int | None = None
        """`digest`'s last value, until the next store or removal."""

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
            ValueError: the two hash lists differ in length, or an engine hash is not an unsigned 64-bit int.
        """
        if len(engine_hashes) != len(local_hashes):
            raise ValueError(f"{len(engine_hashes)} engine hashes but {len(local_hashes)} local hashes")
        keys = as_keys(engine_hashes, fold=False)  # folded by the store kernel
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
        if parent is None:
            parent_key: int | None = None
        else:
            parent %= ENGINE_KEY_PRIME
            parent_key = self._prefix_of(cache, parent) if cache is not None else None
            if parent_key is None and (cache is not state or state.tiers):
                parent_key = self._find_parent(state, parent)
            if parent_key is None:
                held = tuple(h % ENGINE_KEY_PRIME for h in keys.tolist())
                dropped += self._hold(state, parent, held, tuple(local_hashes), name)
                return StoreResult(0, 0, True, dropped)
        if not len(keys):
            return StoreResult(0, 0, False, dropped)
        if cache is None:
            assert name is not None
            cache = self._tier(state, name)
        attached, dups = self._attach(cache, keys, None, local_hashes, parent_key)
        if state.orphans:
            more, more_dups = self._attach_held(state, keys.tolist())
            attached += more
            dups += more_dups
        return StoreResult(attached, dups, False, dropped)

    def place(self, holder: Holder, engine_hashes: Iterable[int], medium: str | None) -> PlaceResult:
        """Index copies of a holder's known blocks on tier ``medium`` (a tokenless BlockStored, `Placed`).

        Each copy takes the chain position (prefix key) of the block it copies, found on the holder's other
        tiers, fastest first; a block the holder has on no tier is counted as unknown and skipped. Held
        events waiting for one of the blocks as their parent attach afterwards, as after a store.

        Args:
            holder: the (worker, dp_rank) whose blocks were copied.
            engine_hashes: the blocks' engine hashes (unsigned 64-bit ints), in order.
            medium: the tier of the copies (None or "GPU": the default tier).

        Raises:
            ValueError: an engine hash is not an unsigned 64-bit int.
        """
        keys = as_keys(engine_hashes).tolist()
        state = self._holders.get(holder)
        if state is None:
            return PlaceResult(0, 0, len(keys))
        self._ops += 1
        name = tier_name(medium)
        target: _Cache | None = state if name is None else (state.tiers or {}).get(name)
        found: list[int] = []
        prefixes: list[int] = []
        for key in keys:
            prefix = None
            for _tier, cache in state.caches():
                if cache is not target:
                    prefix = self._prefix_of(cache, key)
                    if prefix is not None:
                        break
            if prefix is None and target is not None:
                prefix = self._prefix_of(target, key)  # on the target tier only: a repeated copy
            if prefix is not None:
                found.append(key)
                prefixes.append(prefix)
        unknown = len(keys) - len(found)
        if not found:
            return PlaceResult(0, 0, unknown)
        if target is None:
            assert name is not None
            target = self._tier(state, name)
        placed, dups = self._attach(
            target, np.array(found, dtype=np.uint64), np.array(prefixes, dtype=np.uint64)
        )
        if state.orphans:
            more, more_dups = self._attach_held(state, found)
            placed += more
            dups += more_dups
        return PlaceResult(placed, dups, unknown)

    def store_sequence(
        self,
        holder: Holder,
        engine_hashes: Sequence[int],
        prefix_keys: Sequence[int],
        medium: str | None = None,
    ) -> StoreResult:
        """Index consecutive blocks of one holder under prefix keys it was given (`StoredKeys`: an RFC #1527
        ``stored`` event with ``seq_hashes`` and no token ids).

        The keys are standard sequence hashes, positions of their own: nothing is chained and nothing waits
        for a parent, so the event's parent is not needed (a block whose parent the holder lacks is never
        reached by a match, which stops at the first prompt block the holder does not have). Held BlockStored
        events waiting for one of these blocks as their parent attach afterwards, as after `store`; the call
        counts as a store for orphan expiry.

        Args:
            holder: the (worker, dp_rank) that stored the blocks.
            engine_hashes: the blocks' engine hashes as unsigned 64-bit keys (what removals name), in order.
            prefix_keys: their prefix keys (sequence hashes, unsigned 64-bit), same length.
            medium: the storage tier (None or "GPU": the default tier).

        Raises:
            ValueError: the two lists differ in length, or a value is not an unsigned 64-bit int.
        """
        if len(engine_hashes) != len(prefix_keys):
            raise ValueError(f"{len(engine_hashes)} engine hashes but {len(prefix_keys)} prefix keys")
        keys = as_keys(engine_hashes)
        prefixes = as_keys(prefix_keys, fold=False)
        self._ops += 1
        state = self._holders.get(holder)
        if state is None:
            state = self._new_holder(holder)
        dropped = self._expire(state) if state.orphans else 0
        if not len(keys):
            return StoreResult(0, 0, False, dropped)
        name = tier_name(medium)
        cache = state if name is None else self._tier(state, name)
        attached, dups = self._attach(cache, keys, prefixes)
        if state.orphans:
            more, more_dups = self._attach_held(state, keys.tolist())
            attached += more
            dups += more_dups
        return StoreResult(attached, dups, False, dropped)

    def remove(self, holder: Holder, engine_hashes: Iterable[int], medium: str | None = None) -> RemoveResult:
        """Remove one copy of each block (a BlockRemoved) from one tier; unknown hashes are counted and skipped.

        Args:
            holder: the (worker, dp_rank).
            engine_hashes: the engine's block hashes.
            medium: the tier to remove from (None or "GPU": the default tier).

        Raises:
            ValueError: an engine hash is not an unsigned 64-bit int.
        """
        self._digest = None
        cache: _Cache | None = self._holders.get(holder)
        if cache is not None and medium is not None:
            name = tier_name(medium)
            if name is not None:
                tiers = self._holders[holder].tiers
                cache = tiers.get(name) if tiers else None
        if (
            cache is not None
            and not cache.counts
            and type(engine_hashes) in _SEQUENCES
            and len(engine_hashes) == 1  # type: ignore[arg-type]  # a list or tuple here
        ):
            # One block (vLLM sends one BlockRemoved per evicted block): one compiled call, no arrays.
            h = engine_hashes[0]  # type: ignore[index]
            if not 0 <= h <= _MASK64:
                raise ValueError("engine hashes must be unsigned 64-bit ints")
            slot = tables.remove_one(
                self._bk, self._bc, self._bp, self._pv, self._meta, cache.cid, np.uint64(h % ENGINE_KEY_PRIME)
            )
            if slot == -2:
                self._unknown_removals += 1
                held = self._holders[holder]
                if held.orphans:
                    self._cancel_held(held, cache.medium, [h % ENGINE_KEY_PRIME])
                return _UNKNOWN_ONE
            if slot >= 0:
                self._unshare(slot, cache.cid)
            cache.n -= 1
            self._nb -= 1
            if self._keep_order:
                self._order_gone(cache, h % ENGINE_KEY_PRIME)
            if not cache.n:
                self._emptied(cache)
            elif self._nb < self._b_low:
                self._shrink()
            return _REMOVED_ONE
        keys = as_keys(engine_hashes)
        if cache is None:
            self._unknown_removals += len(keys)
            known = self._holders.get(holder)
            if known is not None and known.orphans and len(keys):
                self._cancel_held(known, tier_name(medium), keys.tolist())
            return RemoveResult(0, 0, len(keys)) if len(keys) else _REMOVED_NONE
        decremented = 0
        counts = cache.counts
        if counts:
            klist = keys.tolist()
            if not counts.keys().isdisjoint(klist):
                rest = []
                for h in klist:
                    count = counts.get(h)
                    if count is None:
                        rest.append(h)
                    else:
                        if count > 2:
                            counts[h] = count - 1
                        else:
                            del counts[h]
                        decremented += 1
                keys = np.array(rest, dtype=np.uint64)
        removed, codes = self._drop(cache, keys)
        unknown = len(keys) - removed
        if removed and self._keep_order:
            self._order_gone(cache, keys[codes != tables.REMOVED_UNKNOWN])
        if unknown:
            self._unknown_removals += unknown
            held = self._holders[holder]
            if held.orphans:
                self._cancel_held(held, cache.medium, keys[codes == tables.REMOVED_UNKNOWN].tolist())
        if not cache.n:
            self._emptied(cache)
        elif self._nb < self._b_low:
            self._shrink()
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
            if cache.n:
                keys = np.zeros(cache.n, dtype=np.uint64)
                got = tables.collect_one(self._bk, self._bc, cache.cid, keys)
                assert got == cache.n, (got, cache.n)
                cache.counts.clear()  # every copy goes: no store count to lower first
                n += self.remove(cache.holder, keys, cache.medium).removed
            if (
                cache is not state
                and cache.medium is not None
                and state.tiers
                and cache.medium in state.tiers
            ):
                self._drop_tier(cache)
        state.orphans.clear()
        return n

    def remove_worker(self, worker_id: str) -> int:
        """Forget every holder (all dp ranks, all tiers) of a worker. Returns blocks dropped."""
        gone = [h for h in self._holders if h.worker_id == worker_id]
        n = sum(self.clear(h) for h in gone)
        for h in gone:
            self._release(self._holders.pop(h))
        if gone:
            self._sorted_holders = None
        return n

    # ------------------------------------------------------------------ the block bound

    @property
    def block_total(self) -> int:
        """Indexed (holder, tier, block) entries, duplicates counted once (O(1))."""
        return self._nb

    def cache_sizes(self) -> list[int]:
        """Blocks of every (holder, tier) cache that has any, in no particular order (O(caches))."""
        return [c.n for c in self._caches if c is not None and c.n]

    def evict_to(self, level: int) -> int:
        """Cut every (holder, tier) cache with more than ``level`` blocks down to ``level``, dropping its least
        recently stored blocks first (every store count of each, as a removal of all its copies would).

        The order is the order the blocks were newly indexed in (a repeated store of an indexed block does not
        refresh it; a block removed and stored again counts from its new store), so every index fed the same
        messages, or restored from the same export, drops the same blocks. A block dropped here and later
        named by a BlockRemoved is an unknown removal; a BlockStored naming it as parent is held, as for any
        unknown parent. Dropping never adds to a match: the leading run of a prompt can only get shorter.

        Args:
            level: blocks each cache keeps at most (≥ 0).

        Returns:
            the blocks dropped.

        Raises:
            ValueError: the index does not keep store order (``keep_order``), or ``level`` is negative.
        """
        if not self._keep_order:
            raise ValueError("evict_to needs an index that keeps store order (keep_order=True)")
        if level < 0:
            raise ValueError(f"level must be >= 0, got {level}")
        dropped = 0
        for cache in [c for c in self._caches if c is not None and c.n > level]:
            self._compact_order(cache)
            assert cache.order is not None
            cut = cache.n - level
            keys = cache.order[cache.head : cache.head + cut].copy()
            cache.head += cut
            if cache.counts:
                for h in keys.tolist():
                    cache.counts.pop(h, None)
            dropped += self._drop(cache, keys)[0]
            if not cache.n:
                self._order_reset(cache)
                self._emptied(cache)
        if dropped:
            self._digest = None
            if self._nb < self._b_low:
                self._shrink()
        return dropped

    # ------------------------------------------------------------------ queries

    def match(self, prompt_keys: Iterable[int]) -> dict[Holder, int]:
        """Count, per holder, how many leading blocks of a prompt it holds (on any tier).

        Args:
            prompt_keys: the prompt's prefix keys (`kvmesh.core.hashing.prompt_prefix_keys`, or the lazy
                `kvmesh.core.hashing.iter_prompt_prefix_keys`: consumed in growing chunks, only as far as
                some holder matches).

        Returns:
            ``{holder: overlap_blocks}`` for holders with at least one leading block; others are absent.
            A holder missing block *i* scores *i* even if it holds later blocks.
        """
        if self._tiered:
            return {h: o.blocks for h, o in self._match_tiered(prompt_keys).items()}
        return self._match_default(prompt_keys)

    def match_common(self, prompt_keys: np.ndarray) -> tuple[int, dict[Holder, int]]:
        """`match` for an index with every block on the default tier, answered as ``(common, others)``: every
        holder absent from ``others`` has ``common`` leading blocks. When every holder holds the prompt's first
        block (a fleet-wide system prompt), ``common`` is the overlap most holders share and ``others`` holds
        the rest, so a match of a fleet of 1,024 workers builds a dict of the few that differ; otherwise
        ``common`` is 0 and ``others`` is `match`'s answer.

        Args:
            prompt_keys: the prompt's prefix keys, all computed (a uint64 array).

        Raises:
            ValueError: the index has blocks off the default tier (`tiered`).
        """
        if self._tiered:
            raise ValueError("match_common takes an index with every block on the default tier")
        groups: list[tuple[int, Collection[int]]] = []
        result = self._match_default(prompt_keys, groups)
        common, most = 0, None
        if groups and sum(map(len, (g for _d, g in groups))) == len(self._holders):
            common, most = max(groups, key=lambda g: len(g[1]))  # every holder is in some group
        caches = self._caches
        for depth, cids in groups:
            if cids is not most:
                for cid in cids:
                    result[caches[cid].holder] = depth  # type: ignore[union-attr]
        return common, result

    def match_tiers(self, prompt_keys: Iterable[int]) -> dict[Holder, Overlap]:
        """Like `match`, with each holder's overlap blocks per tier (see the module docstring).

        Returns:
            ``{holder: Overlap(blocks, tiers)}`` for holders with at least one leading block.
        """
        if self._tiered:
            return self._match_tiered(prompt_keys)
        return {h: Overlap(n, None) for h, n in self._match_default(prompt_keys).items()}

    @property
    def tiered(self) -> bool:
        """Whether some holder has blocks off the default tier (`match_tiers` then splits overlaps per tier)."""
        return self._tiered > 0

    def holders(self) -> list[Holder]:
        """Return every holder with indexed blocks or held events, sorted."""
        return list(self.sorted_holders())

    def sorted_holders(self) -> tuple[Holder, ...]:
        """Every holder, sorted, as one tuple kept until a holder is added or forgotten: the same object while
        the set of holders is unchanged (a caller may compare it by identity)."""
        if self._sorted_holders is None:
            self._sorted_holders = tuple(sorted(self._holders))
        return self._sorted_holders

    def block_count(self, holder: Holder) -> int:
        """Return the number of blocks indexed for a holder, over every tier (one per tier a block is on)."""
        state = self._holders.get(holder)
        if state is None:
            return 0
        return state.n + (sum(c.n for c in state.tiers.values()) if state.tiers else 0)

    def tier_counts(self) -> Iterator[TierCount]:
        """Every holder's tiers with their block counts, fastest tier first (O(holders · tiers))."""
        for holder, state in self._holders.items():
            for name, cache in state.caches():
                yield TierCount(
                    holder,
                    DEFAULT_TIER if name is None else name,
                    cache.n,
                    len(state.orphans) if name is None else 0,
                )

    def holds(self, holder: Holder, engine_hash: int, medium: str | None = None) -> bool:
        """Tell whether a holder has the block with this engine hash indexed on a tier (default: GPU)."""
        state = self._holders.get(holder)
        if state is None:
            return False
        name = tier_name(medium)
        cache = state if name is None else (state.tiers or {}).get(name)
        return cache is not None and self._prefix_of(cache, engine_key60(engine_hash)) is not None

    def stats(self) -> IndexStats:
        """Return a snapshot of sizes and counters."""
        return IndexStats(
            holders=len(self._holders),
            blocks=self._nb,
            distinct_prefixes=int(self._meta[tables.P_LIVE]),
            held_orphans=sum(len(s.orphans) for s in self._holders.values()),
            orphans_expired=self._orphans_expired,
            unknown_removals=self._unknown_removals,
        )

    def memory_bytes(self) -> int:
        """Bytes held by the index's tables (their arrays; the dicts of shared prefixes and counts excluded)."""
        return int(self._bk.nbytes + self._bc.nbytes + self._bp.nbytes + self._pk.nbytes + self._pv.nbytes)

    def digest(self) -> int:
        """Return an order-independent 64-bit digest of the indexed content.

        Two indexes that hold the same (holder, tier, engine key, prefix key, store count) entries have the
        same digest, whatever order the events came in. Held orphans are not included. The value is the sum
        modulo ``2**64`` of one `kvmesh.core.tables.entry_hash` per entry (a 64-bit mix of the cache's tag —
        XXH3-64, seed 1337, of ``worker\\0rank[\\0TIER]`` —, the engine key, the prefix key and the store
        count); `digest_from_scratch` computes the same value in plain Python.

        O(blocks in the index), one compiled scan (about 10 – 20 ms per million blocks here), then kept until
        the next store or removal.
        """
        if self._digest is not None:
            return self._digest
        tags = np.zeros(max(1, len(self._caches)), dtype=np.uint64)
        for cache in self._caches:
            if cache is not None:
                tags[cache.cid] = cache.tag
        total = int(tables.digest_sum(self._bk, self._bc, self._bp, self._pk, tags))
        for cache in self._caches:
            if cache is not None and cache.counts:
                tag = np.uint64(cache.tag)
                for h, count in cache.counts.items():
                    key = self._prefix_of(cache, h)
                    assert key is not None
                    k, p = np.uint64(h), np.uint64(key)
                    total += int(tables.entry_hash(tag, k, p, count)) - int(tables.entry_hash(tag, k, p, 1))
        self._digest = total & _MASK64
        return self._digest

    def track_digest(self) -> None:
        """Nothing to do: the digest is computed on demand (kept for callers of the incremental digest)."""

    def digest_from_scratch(self) -> int:
        """Return `digest`'s value computed in plain Python from `dump` (a check of the compiled one)."""
        total = 0
        for holder, tier, h, key, count in self.dump():
            tag = _tag(holder, None if tier == DEFAULT_TIER else tier)
            total += _py_entry_hash(tag, h, key, count)
        return total & _MASK64

    def dump(self) -> Iterator[tuple[Holder, str, int, int, int]]:
        """Yield ``(holder, tier, engine_key, prefix_key, store_count)`` for every indexed block; ``tier`` is
        the normalized medium (`DEFAULT_TIER` for the default one)."""
        export = self.export()
        for h in export.holders:
            for tier, engine, prefixes, counts in (
                (DEFAULT_TIER, h.engine, h.prefixes, h.counts),
                *((t.medium, t.engine, t.prefixes, t.counts) for t in h.tiers),
            ):
                for e, p in zip(engine.tolist(), prefixes.tolist(), strict=True):
                    yield h.holder, tier, e, p, counts.get(e, 1)

    # ------------------------------------------------------------------ snapshots

    def export(self) -> IndexExport:
        """Copy the complete state out of the index, cheaply enough to do between two applied messages.

        One compiled scan of the blocks table writes every cache's blocks into its own arrays (a few
        milliseconds per million blocks); everything else is small. The export shares nothing mutable with
        the index, so it can be encoded in another thread while the index keeps changing.
        """
        ncid = len(self._caches)
        sizes = np.zeros(ncid, dtype=np.int64)
        for cache in self._caches:
            if cache is not None:
                sizes[cache.cid] = cache.n
        start = np.zeros(ncid, dtype=np.int64)
        if ncid:
            np.cumsum(sizes[:-1], out=start[1:])
        begin = start.copy()
        engine = np.zeros(self._nb, dtype=np.uint64)
        prefixes = np.zeros(self._nb, dtype=np.uint64)
        tables.collect(self._bk, self._bc, self._bp, self._pk, start, engine, prefixes)

        def part(cache: _Cache) -> tuple[U64, U64]:
            a, b = int(begin[cache.cid]), int(begin[cache.cid] + cache.n)
            e, p = engine[a:b], prefixes[a:b]
            if not self._keep_order or not cache.n:
                return e, p
            self._compact_order(cache)  # changes nothing a later eviction would see
            assert cache.order is not None
            order = cache.order[cache.head : cache.tail]
            by_key = np.argsort(e)
            at = by_key[np.searchsorted(e, order, sorter=by_key)]
            return e[at], p[at]  # least recently stored first: what `from_export` re-stores in order

        holders = []
        for holder, state in self._holders.items():
            e, p = part(state)
            holders.append(
                HolderExport(
                    holder=holder,
                    engine=e,
                    prefixes=p,
                    counts=state.counts.copy(),
                    orphans=tuple(
                        (serial, parent, o.engine_hashes, o.local_hashes, o.op, o.medium)
                        for (_p, serial), (parent, o) in state.orphans.items()
                    ),
                    orphan_serial=state.orphan_serial,
                    tiers=tuple(
                        TierExport(medium=name, engine=te, prefixes=tp, counts=c.counts.copy())
                        for name, c in (state.tiers or {}).items()
                        for te, tp in (part(c),)
                    ),
                )
            )
        return IndexExport(
            max_orphans=self._max_orphans,
            orphan_ttl_ops=self._orphan_ttl_ops,
            ops=self._ops,
            orphans_expired=self._orphans_expired,
            unknown_removals=self._unknown_removals,
            holders=tuple(holders),
        )

    @classmethod
    def from_export(
        cls, export: IndexExport, *, track_digest: bool = False, keep_order: bool = False
    ) -> PrefixIndex:
        """Rebuild an index from `export()` (O(total blocks), compiled inserts; the export is not modified).

        With ``keep_order`` each cache's blocks count as stored in the export's order: the store order of an
        index that kept it, any order of one that did not (format-4 snapshots)."""
        del track_digest
        index = cls(
            max_orphans=export.max_orphans, orphan_ttl_ops=export.orphan_ttl_ops, keep_order=keep_order
        )
        index._ops = export.ops
        index._orphans_expired = export.orphans_expired
        index._unknown_removals = export.unknown_removals
        total = sum(len(h.engine) + sum(len(t.engine) for t in h.tiers) for h in export.holders)
        index._room(total)
        for h in export.holders:
            state = index._new_holder(Holder(h.holder[0], h.holder[1]))
            if len(h.engine):
                index._attach(
                    state, np.array(h.engine, dtype=np.uint64), np.array(h.prefixes, dtype=np.uint64)
                )
            state.counts = dict(h.counts)
            state.orphan_serial = h.orphan_serial
            for serial, parent, engine, local, op, medium in h.orphans:
                state.orphans[(parent, serial)] = (parent, _Orphan(tuple(engine), tuple(local), op, medium))
            for t in h.tiers:
                if len(t.engine):
                    cache = index._tier(state, t.medium)
                    index._attach(
                        cache, np.array(t.engine, dtype=np.uint64), np.array(t.prefixes, dtype=np.uint64)
                    )
                    cache.counts = dict(t.counts)
        return index

    # ------------------------------------------------------------------ internals

    def _scratch(self, n: int) -> tuple[I32, I32]:
        if len(self._st) < n:
            size = max(n, 2 * len(self._st))
            self._st = np.zeros(size, dtype=np.int32)
            self._aux = np.zeros(size, dtype=np.int32)
        return self._st, self._aux

    def _room(self, n: int) -> None:
        """Make room for ``n`` more blocks and prefix keys (rebuilding a table that would pass `MAX_LOAD`)."""
        if self._nb + n > self._b_limit:
            self._rebuild_blocks(self._nb + n)
        meta = self._meta
        if int(meta[tables.P_LIVE]) + int(meta[tables.P_TOMB]) + n > self._p_limit:
            self._rebuild_prefixes(int(meta[tables.P_LIVE]) + n)

    def _rebuild_blocks(self, entries: int) -> None:
        cap = tables.capacity_for(entries)
        new = tables.new_blocks(cap)
        tables.rebuild_blocks(self._bk, self._bc, self._bp, *new)
        self._bk, self._bc, self._bp = new
        self._b_limit = int(cap * tables.MAX_LOAD)
        self._b_low = int(cap * tables.MIN_LOAD) if cap > tables.MIN_CAPACITY else -1

    def _rebuild_prefixes(self, entries: int) -> None:
        cap = tables.capacity_for(entries)
        pk, pv = tables.new_prefixes(cap)
        remap = np.zeros(len(self._pk), dtype=np.uint32)
        live = tables.rebuild_prefixes(self._pk, self._pv, pk, pv, remap)
        tables.remap_ps(self._bc, self._bp, remap)
        self._pk, self._pv = pk, pv
        self._meta[tables.P_LIVE] = live
        self._meta[tables.P_TOMB] = 0
        self._p_limit = int(cap * tables.MAX_LOAD)

    def _shrink(self) -> None:
        """Rebuild tables that fell below `MIN_LOAD` (after removals) to their `GROWTH` size."""
        bcap = len(self._bk)
        if bcap > tables.MIN_CAPACITY and self._nb < bcap * tables.MIN_LOAD:
            self._rebuild_blocks(self._nb)
        pcap = len(self._pk)
        live = int(self._meta[tables.P_LIVE])
        if pcap > tables.MIN_CAPACITY and live < pcap * tables.MIN_LOAD:
            self._rebuild_prefixes(live)

    def _prefix_of(self, cache: _Cache, key: int) -> int | None:
        """The prefix key of a cache's block (by engine key), or None."""
        slot = tables.prefix_slot(self._bk, self._bc, self._bp, cache.cid, np.uint64(key))
        return None if slot < 0 else int(self._pk[slot])

    def _find_parent(self, state: _HolderState, parent: int, first: str | None = None) -> int | None:
        """A parent's prefix key on tier ``first``, else on any tier of the holder, fastest tier first."""
        if first is not None and state.tiers and first in state.tiers:
            key = self._prefix_of(state.tiers[first], parent)
            if key is not None:
                return key
        for _name, cache in state.caches():
            key = self._prefix_of(cache, parent)
            if key is not None:
                return key
        return None

    def _attach(
        self,
        cache: _Cache,
        keys: U64,
        prefixes: U64 | None,
        local_hashes: Sequence[int] | None = None,
        parent_key: int | None = None,
    ) -> tuple[int, int]:
        """Index engine keys in one cache with their prefix keys: ``prefixes``, or (None) the chain of
        ``local_hashes`` from ``parent_key`` (None: from block 0), computed by the store kernel. Returns
        (attached, duplicates)."""
        self._digest = None
        n = len(keys)
        self._room(n)
        st, aux = self._scratch(n)
        cid = cache.cid
        if prefixes is None:
            assert local_hashes is not None
            local = np.array(local_hashes, dtype=np.uint64)
            prefixes = np.zeros(n, dtype=np.uint64)
            mode = 1 if parent_key is None else 2
        else:
            local, mode = _NO_KEYS, 0
        special = tables.store(
            self._bk,
            self._bc,
            self._bp,
            self._pk,
            self._pv,
            self._meta,
            cid,
            keys,
            prefixes,
            local,
            np.uint64(parent_key or 0),
            mode,
            st,
            aux,
        )
        dups = 0
        if special:
            shared = self._shared
            nz = np.flatnonzero(st[:n])
            # A run of blocks that other caches hold too gets the same holders tuple at every key: the tuple
            # made for one key is reused for the next that had the same one (memory, and `_match_default`
            # passes a key whose holders are the previous key's object in O(1)).
            grown_from: tuple[int, ...] | None = None
            grown_to: tuple[int, ...] = ()
            pair: tuple[int, int] = (-1, -1)
            for code, old, p, h in zip(
                st[nz].tolist(), aux[nz].tolist(), prefixes[nz].tolist(), keys[nz].tolist(), strict=True
            ):
                if code == tables.STORED_SHARED:
                    holders = shared[p]
                    if isinstance(holders, tuple):
                        if holders is grown_from:
                            shared[p] = grown_to
                        elif cid in holders or len(holders) >= SHARED_TUPLE_MAX:
                            grown = dict.fromkeys(holders, 1)
                            grown[cid] = grown.get(cid, 0) + 1
                            shared[p] = grown
                        else:
                            grown_from, grown_to = holders, (*holders, cid)
                            shared[p] = grown_to
                    else:
                        holders[cid] = holders.get(cid, 0) + 1
                elif code == tables.STORED_DUPLICATE:
                    cache.counts[h] = cache.counts.get(h, 1) + 1
                    dups += 1
                elif old == cid:  # STORED_PROMOTED: a second block of the one cache holding the key
                    shared[p] = {old: 2}
                else:  # STORED_PROMOTED: a second cache
                    if pair[0] != old or pair[1] != cid:
                        pair = (old, cid)
                    shared[p] = pair
        attached = n - dups
        cache.n += attached
        self._nb += attached
        if self._keep_order and attached:
            self._order_add(cache, keys if not dups else keys[st[:n] != tables.STORED_DUPLICATE])
        return attached, dups

    def _drop(self, cache: _Cache, keys: U64) -> tuple[int, I32]:
        """Take engine keys (one copy each) out of a cache's tables: returns how many were indexed and the
        remove code of each key (`tables.REMOVED` …, a view of the scratch array: read it before the next
        table call)."""
        n = len(keys)
        st, aux = self._scratch(n)
        removed = tables.remove(self._bk, self._bc, self._bp, self._pv, self._meta, cache.cid, keys, st, aux)
        codes = st[:n]
        if removed:
            if np.count_nonzero(codes == tables.REMOVED_SHARED):
                slots = aux[:n][codes == tables.REMOVED_SHARED]
                self._unshare_many(
                    slots.tolist(), self._pk[slots].tolist(), self._pv[slots].tolist(), cache.cid
                )
            cache.n -= removed
            self._nb -= removed
        return removed, codes

    def _order_add(self, cache: _Cache, keys: U64) -> None:
        """Append newly indexed engine keys to a cache's store order (grown by a quarter when full)."""
        m = len(keys)
        order = cache.order
        if order is None or cache.tail + m > len(order):
            live = 0 if order is None else cache.tail - cache.head
            size = max(16, (live + m) * 5 // 4)
            grown = np.empty(size, dtype=np.uint64)
            if order is not None:
                grown[:live] = order[cache.head : cache.tail]
            cache.order, cache.head, cache.tail = grown, 0, live
            order = grown
        order[cache.tail : cache.tail + m] = keys
        cache.tail += m

    def _order_gone(self, cache: _Cache, keys: U64 | int) -> None:
        """Note engine keys that left a cache (each cancels the oldest entry of its key in the store order);
        compact the order once they are more than a quarter of its blocks."""
        if not cache.n:
            self._order_reset(cache)
            return
        if cache.gone is None:
            cache.gone = array("Q")
        if isinstance(keys, int):
            cache.gone.append(keys)
        else:
            cache.gone.frombytes(keys.astype(np.uint64, copy=False).tobytes())
        if len(cache.gone) > cache.n // 4 + 64:
            self._compact_order(cache)

    def _order_reset(self, cache: _Cache) -> None:
        cache.order, cache.head, cache.tail, cache.gone = None, 0, 0, None

    def _compact_order(self, cache: _Cache) -> None:
        """Drop the store-order entries that removals cancelled: afterwards ``order[head:tail]`` holds each of
        the cache's engine keys once, least recently stored first.

        Each removed key cancels the oldest of its entries, as many as it was removed: numpy only (the
        candidate entries grouped by key in position order, each group's first ``removals`` dropped)."""
        gone = cache.gone
        if not gone or cache.order is None:
            return
        live = cache.order[cache.head : cache.tail]
        removed, times = np.unique(np.frombuffer(gone, dtype=np.uint64), return_counts=True)
        pos = np.flatnonzero(np.isin(live, removed))
        keep = np.ones(len(live), dtype=np.bool_)
        if len(pos):
            by_key = np.argsort(live[pos], kind="stable")  # grouped by key, each group in position order
            keys = live[pos][by_key]
            first = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
            rank = np.arange(len(keys)) - np.repeat(first, np.diff(np.append(first, len(keys))))
            cancelled = rank < times[np.searchsorted(removed, keys)]
            keep[pos[by_key[cancelled]]] = False
        kept = live[keep]
        size = max(16, len(kept) * 5 // 4)
        order = np.empty(size, dtype=np.uint64)
        order[: len(kept)] = kept
        cache.order, cache.head, cache.tail, cache.gone = order, 0, len(kept), None

    def _unshare_many(self, slots: list[int], keys: list[int], vals: list[int], cid: int) -> None:
        """`_unshare` of several slots (``keys`` and ``vals``: their prefix keys and ``p_val``s, read at once)."""
        shared = self._shared
        pv = self._pv
        gone = 0
        cut_from: tuple[int, ...] | None = None  # as in `_hold`: one tuple for a run that had one
        cut_to: tuple[int, ...] = ()
        for slot, key, val in zip(slots, keys, vals, strict=True):
            holders = shared.get(key) if val == _SHARED else None
            if holders is None:  # demoted to this cache by an earlier block of this removal: its last one
                pv[slot] = tables.TOMB
                gone += 1
                continue
            if isinstance(holders, tuple):  # each holds one block: cid's goes
                if holders is cut_from:
                    rest = cut_to
                else:
                    at = holders.index(cid)
                    rest = holders[:at] + holders[at + 1 :]
                    cut_from, cut_to = holders, rest
                if len(rest) > 1:
                    shared[key] = rest
                else:
                    del shared[key]
                    pv[slot] = rest[0]
                continue
            count = holders[cid] - 1
            if count:
                holders[cid] = count
            else:
                del holders[cid]
            if not holders:
                del shared[key]
                pv[slot] = tables.TOMB
                gone += 1
            elif len(holders) == 1:
                ((only, count),) = holders.items()
                if count == 1:
                    del shared[key]
                    pv[slot] = only
        if gone:
            self._meta[tables.P_LIVE] -= gone
            self._meta[tables.P_TOMB] += gone

    def _unshare(self, slot: int, cid: int) -> None:
        """One block of cache ``cid`` fewer on a SHARED prefix slot (demoting or freeing the slot)."""
        self._unshare_many([slot], [int(self._pk[slot])], [int(self._pv[slot])], cid)

    def _emptied(self, cache: _Cache) -> None:
        """A cache's last block went: forget an emptied non-default tier, shrink the tables if they are sparse."""
        if cache.medium is not None and not cache.counts:
            self._drop_tier(cache)
        if self._nb < self._b_low:
            self._shrink()

    def _new_cid(self, cache: _Cache) -> None:
        cache.tag = _tag(cache.holder, cache.medium)
        if self._free_cids:
            cache.cid = self._free_cids.pop()
            self._caches[cache.cid] = cache
        else:
            cache.cid = len(self._caches)
            self._caches.append(cache)

    def _release(self, cache: _Cache) -> None:
        """Give a cache's id back (the cache holds nothing, so the tables no longer name it)."""
        self._caches[cache.cid] = None
        self._free_cids.append(cache.cid)

    def _new_holder(self, holder: Holder) -> _HolderState:
        state = self._holders[holder] = _HolderState(holder, None, -1)
        self._sorted_holders = None
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

    def _array_run(self, keys: np.ndarray) -> tuple[tuple[list[int], list[int]], ...]:
        """`_chunks` of keys all computed already (an array): one compiled lookup of the whole run, as one
        chunk (a tuple, not a generator: the common case of a route, a few µs less per match)."""
        if keys.dtype != np.uint64:
            keys = keys.astype(np.uint64)
        if not keys.shape[0]:
            return ()
        out = self._st if len(self._st) >= keys.shape[0] else self._scratch(keys.shape[0])[0]
        found = tables.lookup_run(self._pk, self._pv, keys, out)
        return ((keys[:found].tolist(), out[:found].tolist()),) if found else ()

    def _chunks(self, keys: Iterable[int]) -> Iterator[tuple[list[int], list[int]]]:
        """The prompt's leading run of indexed keys, in chunks: (keys, their ``p_val``s) per compiled lookup
        of 16, 32, 64, ... keys, taking keys from a lazy iterator only as far as the run goes. A ``p_val`` is
        a cache id, or `tables.SHARED` (the key's holders are in ``_shared``)."""
        if isinstance(keys, np.ndarray):  # every key already computed: one compiled lookup of the whole run
            yield from self._array_run(keys)
            return
        it = iter(keys)
        size = _FIRST_CHUNK
        out = self._st
        while True:
            chunk = (
                keys
                if size == _FIRST_CHUNK and type(keys) is list and len(keys) <= size
                else list(islice(it, size))
            )
            if not chunk:
                return
            if len(out) < len(chunk):
                out = self._scratch(len(chunk))[0]
            try:
                arr = np.array(chunk, dtype=np.uint64)
            except OverflowError:
                return  # not an unsigned 64-bit int: a key no index holds
            found = tables.lookup_run(self._pk, self._pv, arr, out)
            if found:
                yield (chunk if found == len(chunk) else chunk[:found]), out[:found].tolist()
            if found < len(chunk) or chunk is keys:
                return
            size *= 2

    def _lookup(self, keys: Iterable[int]) -> Iterator[tuple[int, int | _Holders]]:
        """Yield (prefix key, holders) for the prompt's leading run of indexed keys (see `_chunks`): holders is
        a cache id, or for a shared key a tuple of cache ids or ``{cid: blocks}`` (iterating either gives the
        cache ids)."""
        shared = self._shared
        for chunk, vals in self._chunks(keys):
            for k, v in zip(chunk, vals, strict=True):
                yield k, (shared[k] if v == _SHARED else v)

    def _match_default(
        self, keys: Iterable[int], groups: list[tuple[int, Collection[int]]] | None = None
    ) -> dict[Holder, int]:
        """`match` when every block is on the default tier: each cache id is a whole holder. With ``groups``,
        the holders that stop matching together are appended to it as ``(depth, cache ids)`` instead of
        entering the answer one by one (`match_common`)."""
        caches = self._caches
        shared = self._shared
        result: dict[Holder, int] = {}
        alive: set[int] | None = None
        only = -9  # the one cache still matching, while exactly one is (-9: none or several)
        seen: object = None  # a holders tuple every cache in `alive` is in (they only ever leave `alive`)
        depth = 0
        for chunk, vals in self._array_run(keys) if isinstance(keys, np.ndarray) else self._chunks(keys):
            for k, v in zip(chunk, vals, strict=True):
                if v == only:
                    depth += 1
                    continue
                here: int | _Holders = shared[k] if v == _SHARED else v
                if here is seen:  # the tuple of a key before: every cache still matching holds this one too
                    depth += 1
                    continue
                if alive is None:
                    alive = {here} if isinstance(here, int) else set(here)
                    only = next(iter(alive)) if len(alive) == 1 else -9
                    seen = here if type(here) is tuple else None
                    depth = 1
                    continue
                if type(here) is dict:
                    if here.keys() >= alive:  # every holder still matching holds this block too (no new set)
                        depth += 1
                        continue
                    nxt = alive.intersection(here)
                elif type(here) is tuple:
                    seen = here  # `alive` is within it from here on
                    nxt = alive.intersection(here)
                    if len(nxt) == len(alive):  # every holder still matching holds this block too
                        depth += 1
                        continue
                else:
                    nxt = {here} if here in alive else set()
                if len(nxt) != len(alive):
                    if groups is not None:
                        groups.append((depth, alive - nxt))
                    else:
                        for gone in alive - nxt:
                            result[caches[gone].holder] = depth  # type: ignore[union-attr]
                    if not nxt:
                        return result
                    only = next(iter(nxt)) if len(nxt) == 1 else -9
                alive = nxt
                depth += 1
        if groups is not None:
            if alive:
                groups.append((depth, alive))
            return result
        for cid in alive or ():
            result[caches[cid].holder] = depth  # type: ignore[union-attr]
        return result

    def _match_tiered(self, keys: Iterable[int]) -> dict[Holder, Overlap]:
        """`match_tiers` when some holder has blocks off the default tier."""
        caches = self._caches
        result: dict[Holder, Overlap] = {}
        # holder -> overlap blocks per tier so far (None: default tier)
        alive: dict[Holder, dict[str | None, int]] = {}
        depth = 0
        for _k, entry in self._lookup(keys):
            best: dict[Holder, str | None] = {}
            for cid in (entry,) if isinstance(entry, int) else entry:
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
        return self._trim_held(state)

    def _trim_held(self, state: _HolderState) -> int:
        """Drop the oldest held events past the per-holder bound (counted as expired); returns how many."""
        dropped = 0
        while len(state.orphans) > self._max_orphans:
            state.orphans.popitem(last=False)
            dropped += 1
        self._orphans_expired += dropped
        return dropped

    def _cancel_held(self, state: _HolderState, medium: str | None, keys: list[int]) -> None:
        """Removals of blocks that are not indexed but held (in a BlockStored waiting for its parent, on tier
        ``medium``): each takes one held copy of its block out, first in hold order. A held event loses the
        block by being split there: the blocks before it stay held under the event's parent, those after it
        are held under the removed block, so they attach only once the engine stores that block again (until
        then no match could reach them). Without this, a parent stored later would bring back blocks the
        engine had already removed, and a match would count them.

        O(held blocks of the holder), only for removals of blocks the index does not have."""
        wanted: dict[int, int] = {}
        for k in keys:
            wanted[k] = wanted.get(k, 0) + 1
        for okey in list(state.orphans):
            parent, orphan = state.orphans[okey]
            hashes = orphan.engine_hashes
            if orphan.medium != medium or wanted.keys().isdisjoint(hashes):
                continue
            pieces: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
            start, under = 0, parent
            for i, h in enumerate(hashes):
                if wanted.get(h):
                    wanted[h] -= 1
                    pieces.append((under, hashes[start:i], orphan.local_hashes[start:i]))
                    start, under = i + 1, h
            pieces.append((under, hashes[start:], orphan.local_hashes[start:]))
            first = pieces[0]
            if first[1]:  # the blocks before the first removed one keep the event's place in hold order
                state.orphans[okey] = (parent, _Orphan(first[1], first[2], orphan.op, medium))
            else:
                del state.orphans[okey]
            for under, part, local in pieces[1:]:
                if part:
                    state.orphan_serial += 1
                    state.orphans[(under, state.orphan_serial)] = (
                        under,
                        _Orphan(part, local, orphan.op, medium),
                    )
            if not any(wanted.values()):
                break
        self._trim_held(state)

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
                parent_key = self._find_parent(state, parent, orphan.medium)
                if parent_key is None:  # removed again in the meantime; keep waiting
                    state.orphans[key] = (parent, orphan)
                    continue
                if not orphan.engine_hashes:
                    continue
                cache = state if orphan.medium is None else self._tier(state, orphan.medium)
                a, d = self._attach(
                    cache,
                    np.array(orphan.engine_hashes, dtype=np.uint64),
                    None,
                    orphan.local_hashes,
                    parent_key,
                )
                attached += a
                dups += d
                frontier.extend(orphan.engine_hashes)
        return attached, dups


def _tag(holder: Holder, medium: str | None) -> int:
    """A cache's digest tag (see `PrefixIndex.digest`)."""
    tag = f"{holder.worker_id}\x00{holder.dp_rank}".encode()
    if medium is not None:
        tag += b"\x00" + medium.encode()
    return xxhash.xxh3_64_intdigest(tag, seed=SEED)


def _py_mix(x: int) -> int:
    """`kvmesh.core.tables`' 64-bit mix in plain Python (for `PrefixIndex.digest_from_scratch`)."""
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK64
    x ^= x >> 33
    return x


def _py_entry_hash(tag: int, key: int, prefix: int, count: int) -> int:
    return _py_mix(tag ^ _py_mix(key ^ _py_mix((prefix + count * 0x9E3779B97F4A7C15) & _MASK64)))


def _overlap(blocks: int, per_tier: dict[str | None, int]) -> Overlap:
    if per_tier.keys() == {None}:
        return Overlap(blocks, None)
    ordered = sorted(per_tier.items(), key=lambda kv: tier_rank(kv[0]))
    return Overlap(blocks, {DEFAULT_TIER if m is None else m: n for m, n in ordered})
