"""The block bound: `PrefixIndex.evict_to` (least recently stored first) and `IndexState` ``max_blocks``.

Exact-value cases, a property test of the store order against a plain reference model (an insertion-ordered
dict per cache), and the replica property: a bounded state restored from a snapshot in the middle of a stream
drops the same blocks afterwards as one that applied the whole stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.events import Cleared, Event, EventsMessage, Removed, Stored
from kvmesh.core.hashing import local_block_hashes
from kvmesh.core.index import Holder, PrefixIndex
from kvmesh.core.snapshot import decode_snapshot, encode_snapshot
from kvmesh.core.state import IndexState, _cut_level

BS = 4
LOCAL = local_block_hashes(list(range(64)), BS)  # 16 blocks
A, B = Holder("a", 0), Holder("b", 0)


def _keys(index: PrefixIndex) -> dict[tuple[Holder, str], dict[int, int]]:
    """Engine key → store count per (holder, tier)."""
    out: dict[tuple[Holder, str], dict[int, int]] = {}
    for holder, tier, key, _prefix, count in index.dump():
        out.setdefault((holder, tier), {})[key] = count
    return out


# ---------------------------------------------------------------------------------------- the cut level


@pytest.mark.parametrize(
    ("sizes", "need", "level"),
    [
        ([10, 4, 2], 1, 9),  # the largest alone pays
        ([10, 4, 2], 6, 4),  # down to the next one exactly
        ([10, 4, 2], 7, 3),  # both cut to 3: 7 + 1 freed
        ([10, 4, 2], 8, 3),
        ([10, 4, 2], 9, 2),
        ([10, 4, 2], 16, 0),
        ([5, 5, 5], 2, 4),  # three at 4 free 3 (at least 2)
        ([7], 7, 0),
    ],
)
def test_the_cut_level_is_the_highest_that_frees_enough(sizes: list[int], need: int, level: int) -> None:
    assert _cut_level(sizes, need) == level
    assert sum(max(0, n - level) for n in sizes) >= need
    assert sum(max(0, n - level - 1) for n in sizes) < need


# ---------------------------------------------------------------------------------------- evict_to


def test_evict_to_drops_each_cache_s_least_recently_stored_blocks() -> None:
    """a stores 1, 2, 3 then 4 under 3; b stores 5. Cut to 2: a keeps 3 and 4, b keeps 5; a's match of the
    prompt is then 0 (its block 0 went), b's 1."""
    index = PrefixIndex(keep_order=True)
    index.store(A, [1, 2, 3], None, LOCAL[:3])
    index.store(A, [4], 3, LOCAL[3:4])
    index.store(B, [5], None, LOCAL[:1])
    assert index.evict_to(2) == 2
    assert _keys(index) == {(A, "GPU"): {3: 1, 4: 1}, (B, "GPU"): {5: 1}}
    assert index.block_total == 3
    keys = index.export()
    assert [h.engine.tolist() for h in keys.holders] == [[3, 4], [5]]
    from kvmesh.core.hashing import prefix_keys

    assert index.match(prefix_keys(LOCAL[:4])) == {B: 1}


def test_a_block_removed_and_stored_again_counts_from_its_new_store() -> None:
    index = PrefixIndex(keep_order=True)
    index.store(A, [1, 2, 3], None, LOCAL[:3])
    index.remove(A, [1])
    index.store(A, [1], None, LOCAL[:1])
    assert index.evict_to(1) == 2
    assert _keys(index) == {(A, "GPU"): {1: 1}}


def test_a_repeated_store_does_not_refresh_and_eviction_drops_every_copy() -> None:
    """Block 1 stored twice (two copies), then 2: 1 is still the oldest; cutting to 1 drops both copies, and a
    later BlockRemoved of it is an unknown removal."""
    index = PrefixIndex(keep_order=True)
    index.store(A, [1], None, LOCAL[:1])
    index.store(A, [2], 1, LOCAL[1:2])
    index.store(A, [1], None, LOCAL[:1])
    assert _keys(index) == {(A, "GPU"): {1: 2, 2: 1}}
    assert index.evict_to(1) == 1
    assert _keys(index) == {(A, "GPU"): {2: 1}}
    assert index.remove(A, [1]) == (0, 0, 1)
    assert index.digest() == index.digest_from_scratch()


def test_tiers_are_cut_as_caches_of_their_own_and_an_emptied_tier_goes() -> None:
    index = PrefixIndex(keep_order=True)
    index.store(A, [1, 2, 3], None, LOCAL[:3])
    index.store(A, [11], None, LOCAL[:1], "CPU")
    assert sorted(index.cache_sizes()) == [1, 3]
    assert index.evict_to(0) == 4
    assert (_keys(index), index.block_total, index.cache_sizes()) == ({}, 0, [])
    assert index.match([LOCAL[0]]) == {}


def test_evict_to_needs_store_order() -> None:
    with pytest.raises(ValueError, match="keep_order=True"):
        PrefixIndex().evict_to(1)
    with pytest.raises(ValueError, match="level must be >= 0, got -1"):
        PrefixIndex(keep_order=True).evict_to(-1)


# A random history of stores (new or repeated), removals, clears and cuts on two holders and two tiers,
# against a reference: per cache an insertion-ordered dict of engine key -> store count.
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.sampled_from([A, B]), st.sampled_from([None, "CPU"]), st.lists(
            st.integers(0, 40), min_size=1, max_size=6)),
        st.tuples(st.just("remove"), st.sampled_from([A, B]), st.sampled_from([None, "CPU"]), st.lists(
            st.integers(0, 40), min_size=1, max_size=6)),
        st.tuples(st.just("clear"), st.sampled_from([A, B]), st.none(), st.just([])),
        st.tuples(st.just("cut"), st.none(), st.none(), st.lists(st.integers(0, 12), min_size=1, max_size=1)),
        st.tuples(st.just("restore"), st.none(), st.none(), st.just([])),
    ),
    max_size=60,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_store_order_matches_the_reference_model(
    ops: list[tuple[str, Holder | None, str | None, list[int]]],
) -> None:
    """Whatever the history (removals compacting the order on the way, restores from an export in between),
    `evict_to` drops exactly what the reference's ordered dicts drop, and the digest stays exact."""
    index = PrefixIndex(keep_order=True)
    ref: dict[tuple[Holder, str], dict[int, int]] = {}
    for op, holder, medium, keys in ops:
        tier = medium or "GPU"
        if op == "store":
            assert holder is not None
            index.store_sequence(holder, keys, [k + 1000 for k in keys], medium)
            cache = ref.setdefault((holder, tier), {})
            for k in keys:
                cache[k] = cache.get(k, 0) + 1
        elif op == "remove":
            assert holder is not None
            index.remove(holder, keys, medium)
            cache = ref.get((holder, tier), {})
            for k in keys:
                if k in cache:
                    cache[k] -= 1
                    if not cache[k]:
                        del cache[k]
        elif op == "clear":
            assert holder is not None
            index.clear(holder)
            for t in ("GPU", "CPU"):
                ref.pop((holder, t), None)
        elif op == "cut":
            (level,) = keys
            expected = sum(max(0, len(c) - level) for c in ref.values())
            assert index.evict_to(level) == expected
            for name, cache in ref.items():
                ref[name] = dict(list(cache.items())[max(0, len(cache) - level) :])
        else:
            index = PrefixIndex.from_export(index.export(), keep_order=True)
        ref = {name: cache for name, cache in ref.items() if cache}
        assert _keys(index) == ref
    assert index.digest() == index.digest_from_scratch()


# ---------------------------------------------------------------------------------------- IndexState


_SEQ: dict[tuple[str, int], itertools.count[int]] = {}


def _msg(worker: str, events: list[Event], *, rank: int = 0) -> EventsMessage:
    seq = next(_SEQ.setdefault((worker, rank), itertools.count()))
    return EventsMessage(
        worker_id=worker, dp_rank=rank, model="m", block_size=BS, epoch=1, seq=seq, events=events
    )


def _apply(state: IndexState, messages: Sequence[EventsMessage], first_seq: int) -> None:
    for i, m in enumerate(messages):
        state.apply(first_seq + i, m)


def test_a_flood_is_paid_by_the_flooding_cache() -> None:
    """Bound 64 (slack 1): b holds 8 blocks; a floods 60 one-block chains. Each time a message takes the state
    to 65 the largest cache (a's) is cut to bring it to 63: b keeps all 8, a its 56 newest, and every eviction
    is counted."""
    _SEQ.clear()
    state = IndexState(max_blocks=64)
    msgs = [_msg("b", [Stored(list(range(100, 108)), None, LOCAL[:8])])]
    msgs += [_msg("a", [Stored([k], None, LOCAL[k % 16 : k % 16 + 1])]) for k in range(1, 61)]
    _apply(state, msgs, 1)
    assert state.block_total() == 64
    assert state.counters.evicted_blocks == 4  # 2 at a's 57th block, 2 at its 59th
    blocks = {(w, k) for (w, _r), _t, k, _p, _c in _dump(state)}
    assert {k for w, k in blocks if w == "b"} == set(range(100, 108))
    assert {k for w, k in blocks if w == "a"} == set(range(5, 61))


def _dump(state: IndexState) -> list[tuple[Holder, str, int, int, int]]:
    return [row for by_size in state._indexes.values() for ix in by_size.values() for row in ix.dump()]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from(["store", "store", "store", "remove", "clear"]),
            st.lists(st.integers(0, 15), min_size=1, max_size=8),
        ),
        min_size=1,
        max_size=50,
    ),
    st.integers(1, 49),
    st.integers(4, 40),
)
def test_a_replica_restored_mid_stream_drops_the_same_blocks(
    script: list[tuple[str, str, list[int]]], cut: int, bound: int
) -> None:
    """Two replicas with the same bound: one applies the whole stream, the other is restored from the first's
    snapshot (encoded and decoded) at message ``cut`` and applies the rest. They hold the same blocks and the
    same counters at the end; neither ever holds more than the bound after a message."""
    _SEQ.clear()
    messages = []
    for worker, kind, blocks in script:
        keys = [hash((worker, b)) % 2**32 for b in blocks]
        if kind == "store":
            events: list[Event] = [Stored(keys, None, [LOCAL[b] for b in blocks])]
        elif kind == "remove":
            events = [Removed(keys)]
        else:
            events = [Cleared("engine")]
        messages.append(_msg(worker, events))
    whole = IndexState(max_blocks=bound)
    restored: IndexState | None = None
    for i, m in enumerate(messages, start=1):
        whole.apply(i, m)
        assert whole.block_total() <= bound
        if restored is not None:
            restored.apply(i, m)
        if i == cut:
            restored = IndexState.from_export(
                decode_snapshot(encode_snapshot(whole.export())), max_blocks=bound
            )
    if restored is None:
        return
    assert sorted(_dump(restored)) == sorted(_dump(whole))
    assert restored.digest() == whole.digest()
    assert restored.counters == whole.counters


def test_restoring_an_unbounded_snapshot_under_a_bound_cuts_at_once() -> None:
    _SEQ.clear()
    free = IndexState()
    _apply(
        free,
        [
            _msg("a", [Stored(list(range(1, 11)), None, LOCAL[:10])]),
            _msg("b", [Stored([50], None, LOCAL[:1])]),
        ],
        1,
    )
    bounded = IndexState.from_export(free.export(), max_blocks=6)
    assert bounded.block_total() == 5  # 6 − slack 1
    assert bounded.counters.evicted_blocks == 6
    kept = sorted((w, k) for (w, _r), _t, k, _p, _c in _dump(bounded))
    # a cut to 4 of its 10 (an unbounded state keeps no store order: which 4 is the export's order), b whole
    assert (len([k for w, k in kept if w == "a"]), [k for w, k in kept if w == "b"]) == (4, [50])


def test_a_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_blocks must be positive, got 0"):
        IndexState(max_blocks=0)


def test_a_long_history_compacts_the_order_on_the_way_and_still_cuts_exactly() -> None:
    """20,000 seeded stores and removals over 300 keys on one cache (the order is compacted whenever its
    cancelled entries pass a quarter of the blocks), cut every 1,000 operations: always the reference's cut."""
    import random

    rng = random.Random(7)
    index = PrefixIndex(keep_order=True)
    ref: dict[int, int] = {}
    for i in range(1, 20_001):
        keys = [rng.randrange(300) for _ in range(rng.randrange(1, 5))]
        if rng.random() < 0.55:
            index.store_sequence(A, keys, [k + 5000 for k in keys])
            for k in keys:
                ref[k] = ref.get(k, 0) + 1
        else:
            index.remove(A, keys)
            for k in keys:
                if k in ref:
                    ref[k] -= 1
                    if not ref[k]:
                        del ref[k]
        if i % 1000 == 0:
            level = len(ref) * 3 // 4
            assert index.evict_to(level) == len(ref) - level
            ref = dict(list(ref.items())[len(ref) - level :])
        if i % 50 == 0:
            assert _keys(index).get((A, "GPU"), {}) == ref
