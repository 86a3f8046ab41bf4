"""Compact hash tables of the prefix index: flat numpy arrays and compiled kernels over them.

Pure code: no I/O, no clock. The kernels are compiled by numba on first use and cached beside this module
(or under ``NUMBA_CACHE_DIR``); that cache is numba's own file, not state of kvmesh.

Two open-addressing tables with linear probing, both sized to any capacity (not a power of two: the slot of
a 64-bit mixed hash ``h`` is ``((h >> 32) * capacity) >> 32``), grown by 1.5× when an insert would take them
over 85 % full, and shrunk when they fall under 20 %:

* **blocks** — one slot per indexed (cache, engine key): ``b_key`` (uint64 engine key), ``b_cid`` (int32
  cache id; -1 marks an empty slot) and ``b_ps`` (uint32: the slot of the block's prefix key in the
  prefixes table). 16 bytes a slot. Deletion shifts later entries back, so the table has no tombstones.
* **prefixes** — one slot per distinct prefix key: ``p_key`` (uint64) and ``p_val`` (int32): a cache id when
  one block of one cache has the key, `SHARED` when more do (the caller keeps those in a dict), `TOMB` for a
  deleted slot, `EMPTY` for a free one. 12 bytes a slot. Slots never move except when the table is rebuilt,
  which rewrites every ``b_ps`` (`remap_ps`).

``meta`` is an int64 array ``[blocks in use, prefixes in use, prefix tombstones]``.

At the loads these tables run at (57 – 85 %), a block whose prefix key no other block has costs 33 – 49
bytes; a shared prefix costs one blocks slot per holder and one prefixes slot (plus the caller's dict).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Any, Final, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvmesh.core.hashing import SEED

U64 = npt.NDArray[np.uint64]
I32 = npt.NDArray[np.int32]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]

EMPTY: Final[int] = -3
"""``p_val`` of a free prefixes slot."""
TOMB: Final[int] = -2
"""``p_val`` of a deleted prefixes slot (probing continues past it)."""
SHARED: Final[int] = -1
"""``p_val`` of a prefix key that several blocks (of one or more caches) have."""

MAX_LOAD: Final[float] = 0.85
"""A table is rebuilt before an insert would take it above this fill (in use plus tombstones)."""
GROWTH: Final[float] = 1.5
"""A rebuilt table has room for this many times its entries at `MAX_LOAD`."""
MIN_LOAD: Final[float] = 0.2
"""A table above `MIN_CAPACITY` is rebuilt smaller once its entries fall below this fill."""
MIN_CAPACITY: Final[int] = 1024

# meta fields
B_LIVE: Final[int] = 0
P_LIVE: Final[int] = 1
P_TOMB: Final[int] = 2

# store codes (per block, in ``st``)
STORED_NEW: Final[int] = 0
"""Indexed; its prefix key was new (or held by no one)."""
STORED_PROMOTED: Final[int] = 1
"""Indexed; its prefix key was held once by cache ``aux``: the slot is now `SHARED`."""
STORED_SHARED: Final[int] = 2
"""Indexed; its prefix key was already `SHARED` (slot ``aux``)."""
STORED_DUPLICATE: Final[int] = 3
"""Already indexed for this cache: nothing changed (the caller raises its store count)."""
# remove codes
REMOVED: Final[int] = 0
"""Removed; its prefix slot was this cache's alone and is now a tombstone."""
REMOVED_UNKNOWN: Final[int] = 1
"""Not indexed for this cache."""
REMOVED_SHARED: Final[int] = 2
"""Removed; its prefix slot ``aux`` is `SHARED` (the caller drops one block of this cache from it)."""

F = TypeVar("F", bound=Callable[..., Any])

_KERNELS: list[str] = []
"""Names of the kernels, in definition order (`_materialize` compiles them)."""


class _Lazy:
    """A kernel before numba is loaded: the first call of any kernel replaces every one of them in this
    module by its numba dispatcher (`_materialize`), so a process that never touches an index (``kvmesh
    status``, an ingest) never imports numba (about a second of start-up)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        _materialize()
        return globals()[self.fn.__name__](*args)


def _jit(fn: F) -> F:
    _KERNELS.append(fn.__name__)
    return cast("F", _Lazy(fn))


def _materialize() -> None:
    """Replace every `_Lazy` kernel of this module by ``numba.njit(cache=True, nogil=True)`` of it (compiled
    on first call, or loaded from numba's cache). Kernels calling kernels resolve to the dispatchers."""
    import numba  # noqa: PLC0415 - loaded on first use of a kernel

    module = globals()
    for name in _KERNELS:
        lazy = module[name]
        if isinstance(lazy, _Lazy):
            module[name] = numba.njit(cache=True, nogil=True)(lazy.fn)


_C1 = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_S32 = np.uint64(32)
_ONE = np.uint64(1)
_PRIME = np.uint64(2**60 - 93)


@_jit
def _mix(x: np.uint64) -> np.uint64:
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


@_jit
def _slot(h: np.uint64, cap: int) -> int:
    return np.int64(((h >> _S32) * np.uint64(cap)) >> _S32)  # type: ignore[return-value]  # an int64 in compiled code


@_jit
def _b_home(key: np.uint64, cid: int, cap: int) -> int:
    return _slot(_mix(key ^ (np.uint64(cid + 1) * _C1)), cap)


@_jit
def _b_probe(b_key: U64, b_cid: I32, cid: int, key: np.uint64) -> int:
    """The slot of cache ``cid``'s block ``key``, or else the empty slot where it would go."""
    cap = b_key.shape[0]
    i = _b_home(key, cid, cap)
    while True:
        c = b_cid[i]
        if c == -1 or (c == cid and b_key[i] == key):
            return i
        i += 1
        if i == cap:
            i = 0


@_jit
def _b_find(b_key: U64, b_cid: I32, cid: int, key: np.uint64) -> int:
    """The slot of cache ``cid``'s block ``key``, or -1."""
    i = _b_probe(b_key, b_cid, cid, key)
    return -1 if b_cid[i] == -1 else i


@_jit
def _b_delete(b_key: U64, b_cid: I32, b_ps: U32, i: int) -> None:
    """Empty slot ``i`` and shift the entries after it back (no tombstones)."""
    cap = b_key.shape[0]
    j = i
    while True:
        j += 1
        if j == cap:
            j = 0
        c = b_cid[j]
        if c == -1:
            break
        k = _b_home(b_key[j], c, cap)
        # entry j may move to i unless its home lies cyclically in (i, j]
        stays = i < k <= j if i <= j else k > i or k <= j
        if not stays:
            b_key[i] = b_key[j]
            b_cid[i] = c
            b_ps[i] = b_ps[j]
            i = j
    b_cid[i] = -1


@_jit
def _p_find(p_key: U64, p_val: I32, key: np.uint64) -> int:
    cap = p_key.shape[0]
    i = _slot(_mix(key), cap)
    while True:
        v = p_val[i]
        if v == EMPTY:
            return -1
        if v != TOMB and p_key[i] == key:
            return i
        i += 1
        if i == cap:
            i = 0


# XXH3-64 of a 16-byte input (two little-endian uint64), the length-9-to-16 path of the XXH3 specification:
# the bit flips are the default secret's 64-bit words at offsets 24, 32, 40 and 48 combined with the seed.
_SECRET_24_56 = bytes.fromhex("7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221b8084674f743248e")
_W = [int.from_bytes(_SECRET_24_56[i : i + 8], "little") for i in range(0, 32, 8)]
_BITFLIP1 = np.uint64(((_W[0] ^ _W[1]) + SEED) & 0xFFFFFFFFFFFFFFFF)
_BITFLIP2 = np.uint64(((_W[2] ^ _W[3]) - SEED) & 0xFFFFFFFFFFFFFFFF)
_M32 = np.uint64(0xFFFFFFFF)
_MX1 = np.uint64(0x165667919E3779F9)
_S37 = np.uint64(37)
_SIXTEEN = np.uint64(16)


@_jit
def _swap64(x: np.uint64) -> np.uint64:
    x = ((x & np.uint64(0x00FF00FF00FF00FF)) << np.uint64(8)) | (
        (x >> np.uint64(8)) & np.uint64(0x00FF00FF00FF00FF)
    )
    x = ((x & np.uint64(0x0000FFFF0000FFFF)) << _SIXTEEN) | ((x >> _SIXTEEN) & np.uint64(0x0000FFFF0000FFFF))
    return (x << _S32) | (x >> _S32)


@_jit
def _mul128_fold64(a: np.uint64, b: np.uint64) -> np.uint64:
    a_lo, a_hi = a & _M32, a >> _S32
    b_lo, b_hi = b & _M32, b >> _S32
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    lo_hi = a_lo * b_hi
    hi_hi = a_hi * b_hi
    cross = (lo_lo >> _S32) + (hi_lo & _M32) + lo_hi
    upper = (hi_lo >> _S32) + (cross >> _S32) + hi_hi
    lower = (cross << _S32) | (lo_lo & _M32)
    return lower ^ upper


@_jit
def xxh3_pair(first: np.uint64, second: np.uint64) -> np.uint64:
    """XXH3-64 (seed 1337) of ``le64(first) ‖ le64(second)``: ``xxhash.xxh3_64_intdigest`` of those 16 bytes."""
    lo = first ^ _BITFLIP1
    hi = second ^ _BITFLIP2
    acc = _SIXTEEN + _swap64(lo) + hi + _mul128_fold64(lo, hi)
    acc ^= acc >> _S37
    acc *= _MX1
    acc ^= acc >> _S32
    return acc


@_jit
def chain(local: U64, parent: np.uint64, has_parent: bool, out: U64) -> None:
    """`kvmesh.core.hashing.prefix_keys` of ``local`` (from ``parent`` when ``has_parent``) into ``out``."""
    if local.shape[0] == 0:
        return
    prev = xxh3_pair(parent, local[0]) if has_parent else local[0]
    out[0] = prev
    for i in range(1, local.shape[0]):
        prev = xxh3_pair(prev, local[i])
        out[i] = prev


@_jit
def fold(keys: U64) -> None:
    """Fold engine hashes in place to the index's 60-bit engine keys (``h mod (2**60 - 93)``)."""
    for i in range(keys.shape[0]):
        keys[i] = keys[i] % _PRIME


@_jit
def store(  # noqa: PLR0917 - compiled kernels take their arrays positionally
    b_key: U64,
    b_cid: I32,
    b_ps: U32,
    p_key: U64,
    p_val: I32,
    meta: I64,
    cid: int,
    keys: U64,
    prefixes: U64,
    local: U64,
    parent: np.uint64,
    mode: int,
    st: I32,
    aux: I32,
) -> int:
    """Index blocks ``keys[i]`` (engine hashes, folded here in place to engine keys, see `fold`) with
    ``prefixes[i]`` for cache ``cid``, in order.

    ``mode`` 0: ``prefixes`` are given; 1: they are computed here by `chain` of ``local`` from block 0; 2: by
    `chain` of ``local`` from the prefix key ``parent``. The caller has made room for ``len(keys)`` more
    entries in both tables. Writes a store code per block into ``st`` (and the code's slot or cache id into
    ``aux``). Returns the number of blocks whose code is not `STORED_NEW`.
    """
    for n in range(keys.shape[0]):
        keys[n] = keys[n] % _PRIME
    if mode:
        chain(local, parent, mode == 2, prefixes)
    pcap = p_key.shape[0]
    special = 0
    for n in range(keys.shape[0]):
        key = keys[n]
        i = _b_probe(b_key, b_cid, cid, key)
        if b_cid[i] != -1:
            st[n] = STORED_DUPLICATE
            special += 1
            continue
        pk = prefixes[n]
        j = _slot(_mix(pk), pcap)
        free = -1
        while True:
            v = p_val[j]
            if v == EMPTY:
                break
            if v == TOMB:
                if free < 0:
                    free = j
            elif p_key[j] == pk:
                break
            j += 1
            if j == pcap:
                j = 0
        v = p_val[j]
        if v == EMPTY:
            if free >= 0:
                j = free
                meta[P_TOMB] -= 1
            p_key[j] = pk
            p_val[j] = cid
            meta[P_LIVE] += 1
            st[n] = STORED_NEW
        elif v == SHARED:
            st[n] = STORED_SHARED
            aux[n] = j
            special += 1
        else:
            p_val[j] = SHARED
            st[n] = STORED_PROMOTED
            aux[n] = v
            special += 1
        b_key[i] = key
        b_cid[i] = cid
        b_ps[i] = np.uint32(j)
        meta[B_LIVE] += 1
    return special


@_jit
def remove(  # noqa: PLR0917 - compiled kernels take their arrays positionally
    b_key: U64,
    b_cid: I32,
    b_ps: U32,
    p_val: I32,
    meta: I64,
    cid: int,
    keys: U64,
    st: I32,
    aux: I32,
) -> int:
    """Remove blocks ``keys[i]`` (engine keys) of cache ``cid``; writes a remove code per block into ``st``.

    Returns the number of blocks removed.
    """
    removed = 0
    for n in range(keys.shape[0]):
        i = _b_find(b_key, b_cid, cid, keys[n])
        if i < 0:
            st[n] = REMOVED_UNKNOWN
            continue
        j = np.int64(b_ps[i])
        _b_delete(b_key, b_cid, b_ps, i)
        meta[B_LIVE] -= 1
        removed += 1
        if p_val[j] == cid:
            p_val[j] = TOMB
            meta[P_LIVE] -= 1
            meta[P_TOMB] += 1
            st[n] = REMOVED
        else:
            st[n] = REMOVED_SHARED
            aux[n] = j
    return removed


@_jit
def remove_one(b_key: U64, b_cid: I32, b_ps: U32, p_val: I32, meta: I64, cid: int, key: np.uint64) -> int:  # noqa: PLR0917 - compiled kernels take their arrays positionally
    """`remove` of one block: -2 when not indexed, -1 when removed and its prefix slot was this cache's alone,
    else the `SHARED` prefix slot to fix."""
    i = _b_find(b_key, b_cid, cid, key)
    if i < 0:
        return -2
    j = np.int64(b_ps[i])
    _b_delete(b_key, b_cid, b_ps, i)
    meta[B_LIVE] -= 1
    if p_val[j] == cid:
        p_val[j] = TOMB
        meta[P_LIVE] -= 1
        meta[P_TOMB] += 1
        return -1
    return j  # type: ignore[return-value]  # an int64 in compiled code


@_jit
def prefix_slot(b_key: U64, b_cid: I32, b_ps: U32, cid: int, key: np.uint64) -> int:
    """The prefixes slot of cache ``cid``'s block with engine key ``key``; -1 when not indexed."""
    i = _b_find(b_key, b_cid, cid, key)
    if i < 0:
        return -1
    return np.int64(b_ps[i])  # type: ignore[return-value]  # an int64 in compiled code


@_jit
def lookup_run(p_key: U64, p_val: I32, keys: U64, out: I32) -> int:
    """``out[i]`` = the ``p_val`` of ``keys[i]`` for the leading run of keys that are indexed; returns its
    length."""
    for n in range(keys.shape[0]):
        j = _p_find(p_key, p_val, keys[n])
        if j < 0:
            return n
        out[n] = p_val[j]
    return keys.shape[0]  # type: ignore[no-any-return]  # an int64 in compiled code


@_jit
def collect(b_key: U64, b_cid: I32, b_ps: U32, p_key: U64, start: I64, out_key: U64, out_prefix: U64) -> None:  # noqa: PLR0917 - compiled kernels take their arrays positionally
    """Every block's (engine key, prefix key), grouped by cache: cache ``c``'s blocks go to
    ``out[start[c]:...]`` (``start`` is advanced; the caller sizes it from its per-cache counts)."""
    for i in range(b_key.shape[0]):
        c = b_cid[i]
        if c >= 0:
            n = start[c]
            out_key[n] = b_key[i]
            out_prefix[n] = p_key[b_ps[i]]
            start[c] = n + 1


@_jit
def collect_one(b_key: U64, b_cid: I32, cid: int, out_key: U64) -> int:
    """The engine keys of one cache's blocks; returns how many."""
    n = 0
    for i in range(b_key.shape[0]):
        if b_cid[i] == cid:
            out_key[n] = b_key[i]
            n += 1
    return n


@_jit
def rebuild_blocks(old_key: U64, old_cid: I32, old_ps: U32, b_key: U64, b_cid: I32, b_ps: U32) -> None:  # noqa: PLR0917 - compiled kernels take their arrays positionally
    """Insert every entry of the old blocks table into the new (empty) one."""
    cap = b_key.shape[0]
    for n in range(old_key.shape[0]):
        c = old_cid[n]
        if c < 0:
            continue
        key = old_key[n]
        i = _b_home(key, c, cap)
        while b_cid[i] != -1:
            i += 1
            if i == cap:
                i = 0
        b_key[i] = key
        b_cid[i] = c
        b_ps[i] = old_ps[n]


@_jit
def rebuild_prefixes(old_key: U64, old_val: I32, p_key: U64, p_val: I32, remap: U32) -> int:
    """Insert every live entry of the old prefixes table into the new (empty) one; ``remap[old slot]`` = new
    slot. Returns the live entries."""
    cap = p_key.shape[0]
    live = 0
    for n in range(old_key.shape[0]):
        v = old_val[n]
        if v in (EMPTY, TOMB):
            continue
        key = old_key[n]
        i = _slot(_mix(key), cap)
        while p_val[i] != EMPTY:
            i += 1
            if i == cap:
                i = 0
        p_key[i] = key
        p_val[i] = v
        remap[n] = np.uint32(i)
        live += 1
    return live


@_jit
def remap_ps(b_cid: I32, b_ps: U32, remap: U32) -> None:
    """Point every block at its prefix key's slot in the rebuilt prefixes table."""
    for i in range(b_cid.shape[0]):
        if b_cid[i] >= 0:
            b_ps[i] = remap[b_ps[i]]


@_jit
def entry_hash(tag: np.uint64, key: np.uint64, prefix: np.uint64, count: int) -> np.uint64:
    """One digest entry: a 64-bit mix of the cache's tag hash, engine key, prefix key and store count."""
    return _mix(tag ^ _mix(key ^ _mix(prefix + np.uint64(count) * _C1)))


@_jit
def digest_sum(b_key: U64, b_cid: I32, b_ps: U32, p_key: U64, tags: U64) -> np.uint64:
    """Sum (modulo 2**64) of `entry_hash` with count 1 over every block (cache ``c``'s tag: ``tags[c]``)."""
    total = np.uint64(0)
    for i in range(b_key.shape[0]):
        c = b_cid[i]
        if c >= 0:
            total += entry_hash(tags[c], b_key[i], p_key[b_ps[i]], 1)
    return total


MMAP_BYTES: Final[int] = 1 << 20
"""Arrays of at least this size are anonymous memory maps, given back to the system when dropped (from the
allocator's heap, the old table of every rebuild would stay resident as free space)."""


def _array(capacity: int, dtype: type[np.generic], fill: int) -> Any:
    size = capacity * np.dtype(dtype).itemsize
    if size < MMAP_BYTES:
        return np.full(capacity, fill, dtype=dtype)
    arr = np.frombuffer(mmap.mmap(-1, size), dtype=dtype)  # zero pages until written; unmapped with the array
    if fill:
        arr.fill(fill)
    return arr


def new_blocks(capacity: int) -> tuple[U64, I32, U32]:
    """An empty blocks table."""
    return _array(capacity, np.uint64, 0), _array(capacity, np.int32, -1), _array(capacity, np.uint32, 0)


def new_prefixes(capacity: int) -> tuple[U64, I32]:
    """An empty prefixes table."""
    return _array(capacity, np.uint64, 0), _array(capacity, np.int32, EMPTY)


def capacity_for(entries: int) -> int:
    """The capacity a table is rebuilt to for ``entries`` entries (`GROWTH` × room at `MAX_LOAD`)."""
    return max(MIN_CAPACITY, int(entries * GROWTH / MAX_LOAD) + 1)


def compile_all() -> None:
    """Load (or compile, the first time on a machine: a few seconds) every kernel of the index, so the first
    event a service applies does not pay it. A `PrefixIndex` calls the same kernels with the same types."""
    from kvmesh.core.index import Holder, PrefixIndex  # noqa: PLC0415 - the index imports this module

    index = PrefixIndex()
    a, b = Holder("a", 0), Holder("b", 0)
    index.store(a, [1, 2], None, [3, 4])
    index.store(b, [5], None, [3])
    index.store(a, [6], 2, [7])
    index.match([3, 4])
    index.holds(a, 1)
    index.digest()
    PrefixIndex.from_export(index.export())
    index.remove(a, [1, 2])
    index.remove(b, [5])
    index.clear(a)
