"""The compiled kernels of the index's tables: the in-kernel XXH3 pair hash and chain, growth and shrinking."""

from __future__ import annotations

import random
import struct

import numpy as np
import xxhash

from kvmesh.core import tables
from kvmesh.core.hashing import SEED, prefix_keys
from kvmesh.core.index import Holder, PrefixIndex


def test_xxh3_pair_is_xxhash_of_the_two_little_endian_words() -> None:
    rng = random.Random(7)
    pairs = [(0, 0), (2**64 - 1, 2**64 - 1), (1, 2**63)] + [
        (rng.getrandbits(64), rng.getrandbits(64)) for _ in range(500)
    ]
    for a, b in pairs:
        want = xxhash.xxh3_64_intdigest(struct.pack("<QQ", a, b), seed=SEED)
        assert int(tables.xxh3_pair(np.uint64(a), np.uint64(b))) == want, (a, b)


def test_chain_is_prefix_keys_from_the_root_and_from_a_parent() -> None:
    rng = random.Random(8)
    local = [rng.getrandbits(64) for _ in range(40)]
    out = np.zeros(40, dtype=np.uint64)
    tables.chain(np.array(local, dtype=np.uint64), np.uint64(0), False, out)
    assert out.tolist() == prefix_keys(local)
    tables.chain(np.array(local, dtype=np.uint64), np.uint64(2**60 - 5), True, out)
    assert out.tolist() == prefix_keys(local, 2**60 - 5)


def test_tables_grow_past_their_load_and_shrink_back_when_emptied() -> None:
    """100k blocks over two holders: the tables grow by 1.5× at 85 % fill (large ones as anonymous maps),
    every block matches, and removing all but one block shrinks them back to the minimum."""
    index = PrefixIndex()
    a, b = Holder("a", 0), Holder("b", 0)
    n = 50_000
    local = list(range(1, n + 1))
    index.store(a, list(range(10**6, 10**6 + n)), None, local)
    index.store(b, list(range(2 * 10**6, 2 * 10**6 + n)), None, local)
    stats = index.stats()
    assert (stats.blocks, stats.distinct_prefixes) == (2 * n, n)
    cap = len(index._bk)
    assert 2 * n / tables.MAX_LOAD <= cap <= 2 * n * tables.GROWTH / tables.MAX_LOAD + 1
    assert index.memory_bytes() == 16 * len(index._bk) + 12 * len(index._pk)
    assert index.match(prefix_keys(local)) == {a: n, b: n}
    index.remove(a, list(range(10**6, 10**6 + n)))
    index.remove(b, list(range(2 * 10**6 + 1, 2 * 10**6 + n)))
    assert index.match(prefix_keys(local)) == {b: 1}
    assert (len(index._bk), len(index._pk)) == (tables.MIN_CAPACITY, tables.MIN_CAPACITY)
    assert index.stats().distinct_prefixes == 1
