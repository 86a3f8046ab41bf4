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

The same compiled layer serves the match side: `prompt_keys` hashes a prompt's blocks (XXH3-64 of each
block's token ids in every length class of the specification, then the sequence-hash chain) in one call, and
`json_member_token_ids` reads a request body's ``token_ids`` straight into a uint32 array; both are exact
equivalents of the Python reference (`kvmesh.core.hashing`, msgspec), which handles whatever they refuse.

At the loads these tables run at (57 – 85 %), a block whose prefix key no other block has costs 33 – 49
bytes; a shared prefix costs one blocks slot per holder and one prefixes slot (plus the caller's dict).
"""

from __future__ import annotations

import mmap
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar, cast

import msgspec
import numpy as np
import numpy.typing as npt

from kvmesh.core.hashing import SEED, local_block_hashes, lora_seed, pack_tokens

U64 = npt.NDArray[np.uint64]
I32 = npt.NDArray[np.int32]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

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
_KSECRET: Final[bytes] = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
"""XXH3's default 192-byte secret (``kSecret`` of the specification)."""
_W = [int.from_bytes(_KSECRET[i : i + 8], "little") for i in range(24, 56, 8)]
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


# XXH3-64 of any input of whole 32-bit words (a block's token ids), with a seed: every length class of the XXH3
# specification that a block of 1 or more tokens reaches (4 – 8, 9 – 16, 17 – 128, 129 – 240 bytes and the long
# path), computed over the uint32 words so every read is at a 4-byte offset. The secret is read at byte offsets
# that are not multiples of 8 (3, 7, 11, …), so it is given as a table ``sec[o]`` = the little-endian uint64
# at byte ``o`` (`secret_table`). `tests/core/test_tables.py` checks every length class against ``xxhash``.
_P32_1 = np.uint64(0x9E3779B1)
_P32_2 = np.uint64(0x85EBCA77)
_P32_3 = np.uint64(0xC2B2AE3D)
_P64_1 = np.uint64(0x9E3779B185EBCA87)
_P64_2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P64_3 = np.uint64(0x165667B19E3779F9)
_P64_4 = np.uint64(0x85EBCA77C2B2AE63)
_P64_5 = np.uint64(0x27D4EB2F165667C5)
_MX2 = np.uint64(0x9FB21C651E98DF25)
_S28, _S35, _S47 = np.uint64(28), np.uint64(35), np.uint64(47)
_S24, _S49, _S40, _S15 = np.uint64(24), np.uint64(49), np.uint64(40), np.uint64(15)


def secret_table(seed: int) -> tuple[U64, U64]:
    """The secrets an XXH3-64 with ``seed`` reads, as byte-offset tables (see the comment above): the default
    secret (the paths up to 240 bytes mix the seed in as they read it) and the secret derived from the seed
    (the long path: each 16 bytes ``(lo + seed, hi - seed)``)."""
    mask = 2**64 - 1
    derived = bytearray()
    for i in range(0, len(_KSECRET), 16):
        lo = int.from_bytes(_KSECRET[i : i + 8], "little")
        hi = int.from_bytes(_KSECRET[i + 8 : i + 16], "little")
        derived += ((lo + seed) & mask).to_bytes(8, "little") + ((hi - seed) & mask).to_bytes(8, "little")

    def table(secret: bytes) -> U64:
        return np.array(
            [int.from_bytes(secret[o : o + 8], "little") for o in range(len(secret) - 7)], dtype=np.uint64
        )

    return table(_KSECRET), table(bytes(derived))


@_jit
def _rd64(w: U32, i: int) -> np.uint64:
    """The little-endian uint64 of the two words at ``i``."""
    return np.uint64(w[i]) | (np.uint64(w[i + 1]) << _S32)


@_jit
def _avalanche(h: np.uint64) -> np.uint64:
    h ^= h >> _S37
    h *= _MX1
    h ^= h >> _S32
    return h


@_jit
def _mix16(w: U32, i: int, sec: U64, o: int, seed: np.uint64) -> np.uint64:
    return _mul128_fold64(_rd64(w, i) ^ (sec[o] + seed), _rd64(w, i + 2) ^ (sec[o + 8] - seed))


@_jit
def _swap32(x: np.uint64) -> np.uint64:
    return (
        ((x << _S24) & np.uint64(0xFF000000))
        | ((x << np.uint64(8)) & np.uint64(0x00FF0000))
        | ((x >> np.uint64(8)) & np.uint64(0x0000FF00))
        | ((x >> _S24) & np.uint64(0x000000FF))
    )


@_jit
def _xxh3_words(w: U32, s: int, n: int, seed: np.uint64, sec: U64, derived: U64) -> np.uint64:  # noqa: PLR0917 - compiled kernels take their arrays positionally
    """XXH3-64 with ``seed`` of the ``n`` ≥ 1 little-endian words ``w[s : s + n]`` (``4 n`` bytes); ``sec`` and
    ``derived`` are `secret_table` ``(seed)``."""
    nbytes = 4 * n
    length = np.uint64(nbytes)
    if nbytes <= 8:  # 4 – 8 bytes
        seed2 = seed ^ (_swap32(seed & _M32) << _S32)
        h = (np.uint64(w[s + n - 1]) + (np.uint64(w[s]) << _S32)) ^ ((sec[8] ^ sec[16]) - seed2)
        h ^= ((h << _S49) | (h >> _S15)) ^ ((h << _S24) | (h >> _S40))
        h *= _MX2
        h ^= (h >> _S35) + length
        h *= _MX2
        h ^= h >> _S28
        return h  # type: ignore[no-any-return]  # a uint64 in compiled code
    if nbytes <= 16:  # 9 – 16 bytes
        lo = _rd64(w, s) ^ ((sec[24] ^ sec[32]) + seed)
        hi = _rd64(w, s + n - 2) ^ ((sec[40] ^ sec[48]) - seed)
        return _avalanche(length + _swap64(lo) + hi + _mul128_fold64(lo, hi))
    if nbytes <= 128:  # 17 – 128 bytes: pairs of 16-byte lanes from both ends
        acc = length * _P64_1
        e = s + n  # one past the last word
        if nbytes > 32:
            if nbytes > 64:
                if nbytes > 96:
                    acc += _mix16(w, s + 12, sec, 96, seed)
                    acc += _mix16(w, e - 16, sec, 112, seed)
                acc += _mix16(w, s + 8, sec, 64, seed)
                acc += _mix16(w, e - 12, sec, 80, seed)
            acc += _mix16(w, s + 4, sec, 32, seed)
            acc += _mix16(w, e - 8, sec, 48, seed)
        acc += _mix16(w, s, sec, 0, seed)
        acc += _mix16(w, e - 4, sec, 16, seed)
        return _avalanche(acc)
    if nbytes <= 240:  # 129 – 240 bytes
        acc = length * _P64_1
        rounds = nbytes // 16
        for i in range(8):
            acc += _mix16(w, s + 4 * i, sec, 16 * i, seed)
        acc = _avalanche(acc)
        for i in range(8, rounds):
            acc += _mix16(w, s + 4 * i, sec, 16 * (i - 8) + 3, seed)
        acc += _mix16(w, s + n - 4, sec, 136 - 17, seed)
        return _avalanche(acc)
    return _xxh3_long(w, s, n, derived)


@_jit
def _stripe(acc: U64, w: U32, i: int, sec: U64, o: int) -> None:
    """Accumulate the 64-byte stripe at word ``i`` with the secret at byte ``o``."""
    for j in range(8):
        value = _rd64(w, i + 2 * j)
        key = value ^ sec[o + 8 * j]
        acc[j ^ 1] += value
        acc[j] += (key & _M32) * (key >> _S32)


@_jit
def _xxh3_long(w: U32, s: int, n: int, sec: U64) -> np.uint64:
    """The long path (> 240 bytes) over the derived secret ``sec`` (192 bytes: 16 stripes per 1,024-byte block)."""
    nbytes = 4 * n
    acc = np.empty(8, dtype=np.uint64)
    acc[0], acc[1], acc[2], acc[3] = _P32_3, _P64_1, _P64_2, _P64_3
    acc[4], acc[5], acc[6], acc[7] = _P64_4, _P32_2, _P64_5, _P32_1
    blocks = (nbytes - 1) // 1024
    for b in range(blocks):
        base = s + 256 * b
        for k in range(16):
            _stripe(acc, w, base + 16 * k, sec, 8 * k)
        for j in range(8):  # scramble with the secret's last 64 bytes
            a = acc[j]
            a ^= a >> _S47
            a ^= sec[128 + 8 * j]
            acc[j] = a * _P32_1
    base = s + 256 * blocks
    for k in range(((nbytes - 1) - 1024 * blocks) // 64):
        _stripe(acc, w, base + 16 * k, sec, 8 * k)
    _stripe(acc, w, s + n - 16, sec, 192 - 64 - 7)
    result = np.uint64(nbytes) * _P64_1
    for j in range(4):
        result += _mul128_fold64(acc[2 * j] ^ sec[11 + 16 * j], acc[2 * j + 1] ^ sec[11 + 16 * j + 8])
    return _avalanche(result)


@_jit
def block_keys(  # noqa: PLR0917 - compiled kernels take their arrays positionally
    tokens: U32,
    block_size: int,
    seed: np.uint64,
    sec: U64,
    derived: U64,
    first: np.uint64,
    has_first: bool,
    out: U64,
) -> None:
    """The prefix keys (standard sequence hashes) of every full block of ``tokens`` into ``out`` (one per
    block): each block's local hash (XXH3-64 of its token ids as little-endian uint32, with ``seed``), chained
    (`chain`). ``first``, when ``has_first``, replaces block 0's local hash (a salted block 0)."""
    prev = np.uint64(0)
    for b in range(out.shape[0]):
        local = (
            first
            if b == 0 and has_first
            else _xxh3_words(tokens, b * block_size, block_size, seed, sec, derived)
        )
        prev = local if b == 0 else xxh3_pair(prev, local)
        out[b] = prev


@_jit
def block_locals(tokens: U32, block_size: int, seed: np.uint64, sec: U64, derived: U64, out: U64) -> None:  # noqa: PLR0917 - compiled kernels take their arrays positionally
    """The local hash of every full block of ``tokens`` into ``out`` (one per block), as `block_keys` hashes them."""
    for b in range(out.shape[0]):
        out[b] = _xxh3_words(tokens, b * block_size, block_size, seed, sec, derived)


@_jit
def _is_ws(c: int | np.integer[Any]) -> bool:
    return c == 32 or c == 10 or c == 13 or c == 9  # noqa: PLR1714 - JSON whitespace (no tuple: compiled)


@_jit
def _skip_ws(raw: U8, i: int) -> int:
    n = raw.shape[0]
    while i < n and _is_ws(raw[i]):
        i += 1
    return i


@_jit
def _scan_ids(raw: U8, i: int, out: U32, span: I64) -> int:
    """Scan the JSON array of token ids that starts at ``raw[i]`` (``[``) into ``out``: returns their count and
    sets ``span[1]`` one past its ``]``; -1 for any other form (see `json_token_ids`)."""
    # states: 1 after "[", 2 in a number, 3 after a number, 4 after ","
    if i >= raw.shape[0] or raw[i] != 91:  # "["
        return -1
    state = 1
    count = 0
    value = np.int64(0)
    width = 0
    for j in range(i + 1, raw.shape[0]):
        c = np.int64(raw[j])
        if state == 2:
            if 48 <= c <= 57:  # the bytes "0" to "9"
                if width == 1 and value == 0:
                    return -1  # a leading zero
                value = value * 10 + (c - 48)
                width += 1
                if width > 10:  # 2**32 has 10 digits
                    return -1
                continue
            if value > 4294967295:  # 2**32 - 1
                return -1
            out[count] = value
            count += 1
            state = 3
        if _is_ws(c):
            continue
        if state == 1 or state == 4:  # noqa: PLR1714
            if 48 <= c <= 57:
                value = c - 48
                width = 1
                state = 2
            elif c == 93 and state == 1:  # "]": an empty array
                span[1] = j + 1
                return count
            else:
                return -1
        elif c == 44:  # ","
            state = 4
        elif c == 93:  # "]"
            span[1] = j + 1
            return count
        else:
            return -1
    return -1


@_jit
def json_token_ids(raw: U8, out: U32) -> int:
    """Scan a JSON array of token ids (``[1, 2, 3]``: decimal integers in ``[0, 2**32)``, JSON whitespace
    anywhere between tokens) into ``out`` (at least ``(len(raw) + 1) // 2`` long); returns their count.

    Returns -1 for anything else (a sign, a fraction or exponent, a leading zero, a value of 2**32 or more,
    a string, a nested value, a missing or extra comma, bytes after the closing bracket): the caller then
    decodes the array with a full JSON decoder, which accepts what JSON allows and names what it refuses.
    """
    span = np.zeros(2, dtype=np.int64)
    count = _scan_ids(raw, _skip_ws(raw, 0), out, span)
    if count < 0 or _skip_ws(raw, span[1]) != raw.shape[0]:
        return -1
    return count


@_jit
def _skip_string(raw: U8, i: int) -> int:
    """One past the closing quote of the JSON string opening at ``raw[i]``; -1 if it does not close."""
    j = i + 1
    while j < raw.shape[0]:
        c = raw[j]
        if c == 92:  # a backslash: the next byte is escaped
            j += 2
            continue
        if c == 34:  # '"'
            return j + 1
        j += 1
    return -1


@_jit
def _skip_value(raw: U8, i: int) -> int:
    """One past the JSON value starting at ``raw[i]`` (strings and nesting followed, nothing validated: the
    full decoder checks the value later); -1 if it runs off the end."""
    n = raw.shape[0]
    c = raw[i]
    if c == 34:  # a string
        return _skip_string(raw, i)
    if c == 123 or c == 91:  # noqa: PLR1714 - "{" or "["
        depth = 0
        j = i
        while j < n:
            c = raw[j]
            if c == 34:
                j = _skip_string(raw, j)
                if j < 0:
                    return -1
                continue
            if c == 123 or c == 91:  # noqa: PLR1714
                depth += 1
            elif c == 125 or c == 93:  # noqa: PLR1714 - "}" or "]"
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return -1
    j = i  # a number or a literal: up to the next separator
    while j < n and not _is_ws(raw[j]) and raw[j] != 44 and raw[j] != 125 and raw[j] != 93:
        j += 1
    return j if j > i else -1


@_jit
def json_member_token_ids(raw: U8, key: U8, out: U32, span: I64) -> int:
    """Find member ``key`` of the JSON object ``raw`` and scan its value as `json_token_ids` does, in one pass
    over the body: returns the count and sets ``span`` to the value's ``[start, end)`` bytes.

    Returns -1 when the body is not an object, the member is absent or given twice, any member name holds an
    escape (it could spell ``key``), or the value is not the plain array form: the caller then decodes the
    whole body with a full JSON decoder. Members other than ``key`` are skipped, not validated.
    """
    n = raw.shape[0]
    k = key.shape[0]
    i = _skip_ws(raw, 0)
    if i >= n or raw[i] != 123:  # "{"
        return -1
    i = _skip_ws(raw, i + 1)
    count = -1
    if i < n and raw[i] == 125:  # "{}"
        return -1
    while i < n:
        if raw[i] != 34:  # a member name
            return -1
        end = _skip_string(raw, i)
        if end < 0:
            return -1
        for j in range(i + 1, end - 1):
            if raw[j] == 92:  # an escaped name
                return -1
        is_key = end - i - 2 == k
        if is_key:
            for j in range(k):
                if raw[i + 1 + j] != key[j]:
                    is_key = False
                    break
        i = _skip_ws(raw, end)
        if i >= n or raw[i] != 58:  # ":"
            return -1
        i = _skip_ws(raw, i + 1)
        if i >= n:
            return -1
        if is_key:
            if count >= 0:
                return -1  # given twice
            span[0] = i
            count = _scan_ids(raw, i, out, span)
            if count < 0:
                return -1
            i = span[1]
        else:
            i = _skip_value(raw, i)
            if i < 0:
                return -1
        i = _skip_ws(raw, i)
        if i >= n:
            return -1
        if raw[i] == 125:  # "}"
            return count if _skip_ws(raw, i + 1) == n else -1
        if raw[i] != 44:  # ","
            return -1
        i = _skip_ws(raw, i + 1)
    return -1


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


_SECRETS: dict[int, tuple[U64, U64]] = {}
"""`secret_table` per seed (the base model's and each LoRA adapter's seen so far; at most `_MAX_SECRETS`)."""
_MAX_SECRETS: Final[int] = 256


def token_array(token_ids: Sequence[int] | U32) -> U32:
    """The token ids as a uint32 array (no copy for an ``array("I")`` or a uint32 array).

    Raises:
        RequestError: a token id is not an int in ``[0, 2**32)`` (``field="token_ids"``).
    """
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype == np.uint32:
            return token_ids
        ids: Sequence[int] = token_ids.tolist()  # other dtypes are range-checked as ints
    else:
        ids = token_ids
    if isinstance(ids, array) and ids.typecode == "I" and ids.itemsize == 4:
        return np.frombuffer(ids, dtype=np.uint32)
    return np.frombuffer(pack_tokens(ids), dtype="<u4").astype(np.uint32, copy=False)


def scan_token_ids(raw: bytes) -> U32 | None:
    """The token ids of a JSON array (`json_token_ids`), or None when it is not the plain form that scan reads
    (decode it with a full JSON decoder then)."""
    out = np.empty((len(raw) + 1) // 2, dtype=np.uint32)
    count = json_token_ids(np.frombuffer(raw, dtype=np.uint8), out)
    return None if count < 0 else out[:count]


_TOKEN_IDS_KEY: Final = np.frombuffer(b"token_ids", dtype=np.uint8)


def scan_body_token_ids(body: bytes) -> tuple[U32, int, int] | None:
    """The ``token_ids`` member of a JSON object body, scanned in one pass (`json_member_token_ids`): the ids
    and the ``[start, end)`` bytes of the array in ``body``; None when the body is not that plain form (decode
    it with a full JSON decoder then)."""
    out = np.empty((len(body) + 1) // 2, dtype=np.uint32)
    span = np.zeros(2, dtype=np.int64)
    count = json_member_token_ids(np.frombuffer(body, dtype=np.uint8), _TOKEN_IDS_KEY, out, span)
    return None if count < 0 else (out[:count], int(span[0]), int(span[1]))


S = TypeVar("S")


def decode_scanning_token_ids(body: bytes, decoder: msgspec.json.Decoder[S]) -> tuple[S, U32] | None:
    """Decode a JSON object body whose ``token_ids`` are read by `scan_body_token_ids` and the rest by
    ``decoder`` (``[]`` in the array's place): the decoded body (its ``token_ids`` empty) and the ids.

    None when the scan refuses the body or the rest does not decode: the caller then decodes the whole body
    with its full decoder, which gives the values and errors a whole decode gives (the scan's refusals: a
    sign, a fraction, a value of 2**32 or more, an escaped or duplicate member name, anything else).
    """
    scanned = scan_body_token_ids(body)
    if scanned is None:
        return None
    tokens, start, end = scanned
    try:
        rest = decoder.decode(body[:start] + b"[]" + body[end:])
    except (msgspec.MsgspecError, RecursionError):
        return None
    if getattr(rest, "token_ids", None) != []:  # pragma: no cover - the scan found the one member
        return None
    return rest, tokens


def prompt_keys(
    tokens: U32, block_size: int, *, lora_name: str | None = None, cache_salt: str | None = None
) -> U64:
    """The index prefix keys of a prompt's full blocks in one compiled call: the same values as
    `kvmesh.core.hashing.prompt_prefix_keys` (the standard sequence hashes), 5 – 7 µs for 4,096 tokens where
    the pure-Python chain takes 30 – 130 µs (section 8 of docs/benchmarks.md).

    Args:
        tokens: token ids (`token_array`).
        block_size: tokens per block (> 0).
        lora_name: LoRA adapter (seeds every block), or None for the base model.
        cache_salt: tenant salt, mixed into block 0 (`kvmesh.core.hashing.local_block_hashes`).

    Returns:
        ``len(tokens) // block_size`` uint64 keys; a trailing partial block is dropped.

    Raises:
        ValueError: ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = tokens.shape[0] // block_size
    out = np.empty(n_blocks, dtype=np.uint64)
    if not n_blocks:
        return out
    seed = lora_seed(lora_name)
    secrets = _SECRETS.get(seed)
    if secrets is None:
        if len(_SECRETS) >= _MAX_SECRETS:
            _SECRETS.clear()
        secrets = _SECRETS[seed] = secret_table(seed)
    first = 0
    if cache_salt:  # block 0 carries the salt: its local hash from the one place that rule lives
        first = local_block_hashes(
            tokens[:block_size].tolist(), block_size, lora_name=lora_name, cache_salt=cache_salt
        )[0]
    block_keys(
        tokens, block_size, np.uint64(seed), secrets[0], secrets[1], np.uint64(first), bool(cache_salt), out
    )
    return out


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
    index.match(prompt_keys(token_array([1, 2, 3, 4]), 2, cache_salt="s"))
    scan_body_token_ids(b'{"a": [{"b": "c\\""}], "token_ids": [1]}')
    index.holds(a, 1)
    index.digest()
    PrefixIndex.from_export(index.export())
    index.remove(a, [1, 2])
    index.remove(b, [5])
    index.clear(a)
