"""Exact-value unit tests of `kvmesh.core.index.PrefixIndex`."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvmesh.core.hashing import prefix_keys, sequence_hashes
from kvmesh.core.index import (
    Holder,
    IndexStats,
    Overlap,
    PrefixIndex,
    RemoveResult,
    StoreResult,
    engine_key60,
    tier_name,
)

A0 = Holder("worker-a", 0)
A1 = Holder("worker-a", 1)
B0 = Holder("worker-b", 0)

# Local hashes of a 4-block prompt and of a prompt that diverges from it after block 1.
LOCAL = [101, 102, 103, 104]
SEQ = prefix_keys(LOCAL)
OTHER_LOCAL = [101, 102, 903, 904]
OTHER_SEQ = prefix_keys(OTHER_LOCAL)
# Local hashes of a prompt sharing nothing with LOCAL.
DIFF_LOCAL = [201, 202, 203, 204]
DIFF_SEQ = prefix_keys(DIFF_LOCAL)

# Engine hashes: opaque per-holder keys.
E = [1001, 1002, 1003, 1004]
F = [2001, 2002, 2003, 2004]


def _stored(attached: int, duplicates: int = 0, held: bool = False, dropped: int = 0) -> StoreResult:
    return StoreResult(attached=attached, duplicates=duplicates, held=held, dropped_orphans=dropped)


def _removed(removed: int, decremented: int = 0, unknown: int = 0) -> RemoveResult:
    return RemoveResult(removed=removed, decremented=decremented, unknown=unknown)


# ---------------------------------------------------------------------------------------------- store / match


def test_store_chain_then_match_prefixes() -> None:
    """A stored chain matches every leading prefix of the prompt with its exact block count."""
    index = PrefixIndex()
    assert index.store(A0, E[:2], None, LOCAL[:2]) == _stored(2)
    assert index.store(A0, E[2:], E[1], LOCAL[2:]) == _stored(2)
    assert index.match(SEQ) == {A0: 4}
    assert index.match(SEQ[:3]) == {A0: 3}
    assert index.match(SEQ[:1]) == {A0: 1}
    assert index.match(OTHER_SEQ) == {A0: 2}
    assert index.match([*SEQ, 12345]) == {A0: 4}
    assert index.match([]) == {}
    assert index.match([12345, *SEQ[1:]]) == {}
    assert index.block_count(A0) == 4
    assert index.holds(A0, E[3]) is True
    assert index.holds(A0, 9999) is False
    assert index.holds(B0, E[0]) is False


def test_store_chains_local_hashes_onto_parent_sequence_hash() -> None:
    """A block stored under a parent gets the parent's prefix key chained with its local hash."""
    index = PrefixIndex()
    index.store(A0, [E[0]], None, [LOCAL[0]])
    index.store(A0, [E[1]], E[0], [LOCAL[1]])
    assert sorted(index.dump()) == [(A0, "GPU", E[0], SEQ[0], 1), (A0, "GPU", E[1], SEQ[1], 1)]


def test_store_rejects_mismatched_lengths() -> None:
    """Engine and local hash lists of different lengths are a ValueError and change nothing."""
    index = PrefixIndex()
    with pytest.raises(ValueError, match="2 engine hashes but 1 local hashes"):
        index.store(A0, E[:2], None, LOCAL[:1])
    assert index.stats() == IndexStats(
        holders=0, blocks=0, distinct_prefixes=0, held_orphans=0, orphans_expired=0, unknown_removals=0
    )


def test_match_counts_per_holder_overlap() -> None:
    """Holders sharing a prefix each score the length of their own leading run."""
    index = PrefixIndex()
    index.store(A0, E, None, LOCAL)
    index.store(A1, F[:2], None, LOCAL[:2])
    index.store(B0, F[:4], None, OTHER_LOCAL)
    assert index.match(SEQ) == {A0: 4, A1: 2, B0: 2}
    assert index.match(OTHER_SEQ) == {A0: 2, A1: 2, B0: 4}
    assert index.match(SEQ[:1]) == {A0: 1, A1: 1, B0: 1}


def test_missing_middle_block_cuts_the_leading_run() -> None:
    """A holder missing block i scores i even though it still holds the later blocks."""
    index = PrefixIndex()
    index.store(A0, E, None, LOCAL)
    index.store(B0, F, None, LOCAL)
    assert index.remove(A0, [E[1]]) == _removed(1)
    assert index.holds(A0, E[2]) is True
    assert index.holds(A0, E[3]) is True
    assert index.match(SEQ) == {A0: 1, B0: 4}
    assert index.match(SEQ[1:]) == {B0: 3}
    assert index.remove(B0, [F[0]]) == _removed(1)
    assert index.match(SEQ) == {A0: 1}
    assert index.match(SEQ[1:]) == {B0: 3}


def test_match_reads_keys_only_as_far_as_some_holder_matches() -> None:
    """With lazy keys, the match pulls them in chunks of 16, 32, 64, ... and stops after the chunk where the
    leading run ends (the rest is never hashed); the superset fast path (every live holder holds the next
    block) gives the same overlaps."""
    index = PrefixIndex()
    index.store(A0, E, None, LOCAL)
    index.store(B0, F[:3], None, LOCAL[:3])
    pulled: list[int] = []

    def lazy(keys: list[int]) -> Iterator[int]:
        for k in keys:
            pulled.append(k)
            yield k

    assert index.match(lazy([*OTHER_SEQ, 7, 8])) == {A0: 2, B0: 2}
    assert pulled == [*OTHER_SEQ, 7, 8]  # shorter than one chunk: all of it
    pulled.clear()
    assert index.match(lazy([*SEQ, *range(7, 107)])) == {A0: 4, B0: 3}
    assert pulled == [*SEQ, *range(7, 7 + 16 - len(SEQ))]  # the run ends in the first chunk of 16
    pulled.clear()
    assert index.match(lazy(DIFF_SEQ)) == {}
    assert pulled == DIFF_SEQ


def test_match_follows_a_run_across_chunks() -> None:
    """A holder whose chain spans several lookup chunks (16 + 32 + ...) matches its whole length, and the
    keys are pulled only up to the end of the chunk where the run stops."""
    index = PrefixIndex()
    n = 40
    engine = list(range(1000, 1000 + n))
    local = list(range(5000, 5000 + n))
    index.store(A0, engine, None, local)
    keys = prefix_keys(local)
    pulled: list[int] = []

    def lazy(ks: list[int]) -> Iterator[int]:
        for k in ks:
            pulled.append(k)
            yield k

    assert index.match(lazy([*keys, *range(1, 200)])) == {A0: n}
    assert len(pulled) == 16 + 32  # the run ends in the second chunk (keys 16 .. 47)


# ---------------------------------------------------------------------------------------- parent resolution


def test_parent_known_only_on_another_holder_is_held() -> None:
    """An event whose parent engine hash exists only on another holder is held, never attached."""
    index = PrefixIndex()
    index.store(A0, E[:2], None, LOCAL[:2])
    assert index.store(B0, [E[2]], E[1], [LOCAL[2]]) == _stored(0, held=True)
    assert index.holds(B0, E[2]) is False
    assert index.block_count(B0) == 0
    assert index.match(SEQ) == {A0: 2}
    # Not attached under the root either: its local hash as block 0 matches nothing.
    assert index.match(prefix_keys([LOCAL[2]])) == {}
    assert index.stats() == IndexStats(
        holders=2, blocks=2, distinct_prefixes=2, held_orphans=1, orphans_expired=0, unknown_removals=0
    )


def test_held_event_attaches_with_descendants_when_parent_arrives() -> None:
    """A held event and its held descendants attach, without a resend, when the parent reaches its holder."""
    index = PrefixIndex()
    index.store(A0, E[:2], None, LOCAL[:2])
    assert index.store(B0, [E[2]], E[1], [LOCAL[2]]) == _stored(0, held=True)
    assert index.store(B0, [E[3]], E[2], [LOCAL[3]]) == _stored(0, held=True)
    assert index.stats().held_orphans == 2
    assert index.match(SEQ) == {A0: 2}
    # The parent arrives on B0 itself: 2 own blocks + 1 held child + 1 held grandchild.
    assert index.store(B0, E[:2], None, LOCAL[:2]) == _stored(4)
    assert index.match(SEQ) == {A0: 2, B0: 4}
    assert sorted(x for x in index.dump() if x[0] == B0) == [(B0, "GPU", E[i], SEQ[i], 1) for i in range(4)]
    assert index.stats() == IndexStats(
        holders=2, blocks=6, distinct_prefixes=4, held_orphans=0, orphans_expired=0, unknown_removals=0
    )


def test_held_events_attach_in_any_arrival_order() -> None:
    """A grandchild held before its child still attaches when the chain is completed."""
    index = PrefixIndex()
    assert index.store(A0, [E[3]], E[2], [LOCAL[3]]) == _stored(0, held=True)
    assert index.store(A0, [E[2]], E[1], [LOCAL[2]]) == _stored(0, held=True)
    assert index.store(A0, [E[1]], E[0], [LOCAL[1]]) == _stored(0, held=True)
    assert index.match(SEQ) == {}
    assert index.store(A0, [E[0]], None, [LOCAL[0]]) == _stored(4)
    assert index.match(SEQ) == {A0: 4}
    assert index.stats().held_orphans == 0


def test_orphan_bound_drops_oldest_and_counts_it() -> None:
    """Past max_orphans held events per holder, the oldest is dropped, counted, and never attaches."""
    index = PrefixIndex(max_orphans=2)
    assert index.store(A0, [E[1]], E[0], [LOCAL[1]]) == _stored(0, held=True)
    assert index.store(A0, [F[1]], F[0], [DIFF_LOCAL[1]]) == _stored(0, held=True)
    # The bound is per holder: B0's held event does not push A0's out.
    assert index.store(B0, [E[1]], E[0], [LOCAL[1]]) == _stored(0, held=True)
    assert index.store(A0, [F[3]], F[2], [DIFF_LOCAL[3]]) == _stored(0, held=True, dropped=1)
    assert index.stats() == IndexStats(
        holders=2, blocks=0, distinct_prefixes=0, held_orphans=3, orphans_expired=1, unknown_removals=0
    )
    # The dropped (oldest) event waited for E[0]: the parent arrives but nothing else attaches.
    assert index.store(A0, [E[0]], None, [LOCAL[0]]) == _stored(1)
    assert index.match(SEQ) == {A0: 1}
    # The kept one waited for F[0]: it attaches.
    assert index.store(A0, [F[0]], None, [DIFF_LOCAL[0]]) == _stored(2)
    assert index.match(DIFF_SEQ) == {A0: 2}
    assert index.stats().held_orphans == 2  # A0's F[3] child and B0's event
    assert index.stats().orphans_expired == 1


def test_orphan_survives_ttl_later_stores_then_attaches() -> None:
    """A held event still attaches when its parent arrives in the orphan_ttl_ops-th later store call."""
    index = PrefixIndex(orphan_ttl_ops=2)
    assert index.store(B0, [E[1]], E[0], [LOCAL[1]]) == _stored(0, held=True)  # op 1
    assert index.store(A0, [F[0]], None, [DIFF_LOCAL[0]]) == _stored(1)  # op 2: 1st later store
    assert index.store(B0, [E[0]], None, [LOCAL[0]]) == _stored(2)  # op 3: 2nd later store
    assert index.match(SEQ) == {B0: 2}
    assert index.stats().orphans_expired == 0


def test_orphan_expires_after_ttl_store_operations() -> None:
    """A held event expires once more than orphan_ttl_ops later store calls (on any holder) have run."""
    index = PrefixIndex(orphan_ttl_ops=2)
    assert index.store(B0, [E[1]], E[0], [LOCAL[1]]) == _stored(0, held=True)  # op 1
    assert index.store(A0, [F[0]], None, [DIFF_LOCAL[0]]) == _stored(1)  # op 2
    assert index.store(A0, [F[1]], F[0], [DIFF_LOCAL[1]]) == _stored(1)  # op 3
    assert index.stats().held_orphans == 1
    assert index.store(B0, [E[0]], None, [LOCAL[0]]) == _stored(1, dropped=1)  # op 4: expired first
    assert index.match(SEQ) == {B0: 1}
    assert index.holds(B0, E[1]) is False
    assert index.stats() == IndexStats(
        holders=2, blocks=3, distinct_prefixes=3, held_orphans=0, orphans_expired=1, unknown_removals=0
    )


# ----------------------------------------------------------------------------------- duplicates / removal


def test_duplicate_store_needs_two_removes() -> None:
    """A block stored twice stays matched after one removal and disappears after the second."""
    index = PrefixIndex()
    assert index.store(A0, E[:2], None, LOCAL[:2]) == _stored(2)
    assert index.store(A0, E[:2], None, LOCAL[:2]) == _stored(0, duplicates=2)
    assert sorted(index.dump()) == [(A0, "GPU", E[0], SEQ[0], 2), (A0, "GPU", E[1], SEQ[1], 2)]
    assert index.remove(A0, [E[1]]) == _removed(0, decremented=1)
    assert index.match(SEQ) == {A0: 2}
    assert index.remove(A0, [E[1]]) == _removed(1)
    assert index.match(SEQ) == {A0: 1}
    assert index.block_count(A0) == 1
    assert index.stats().blocks == 1


def test_unknown_removal_is_counted_and_rest_applies() -> None:
    """Unknown hashes in a removal are counted and skipped; the known ones are still removed."""
    index = PrefixIndex()
    index.store(A0, E, None, LOCAL)
    assert index.remove(A0, [E[3], 9999, E[2], 8888]) == _removed(2, unknown=2)
    assert index.match(SEQ) == {A0: 2}
    assert index.remove(B0, [E[0]]) == _removed(0, unknown=1)
    assert index.remove(A0, [E[3]]) == _removed(0, unknown=1)
    assert index.stats() == IndexStats(
        holders=1, blocks=2, distinct_prefixes=2, held_orphans=0, orphans_expired=0, unknown_removals=4
    )


def test_two_engine_hashes_with_same_content_on_one_holder() -> None:
    """Two engine blocks with equal content on one holder count separately; the prefix stays until both go."""
    index = PrefixIndex()
    assert index.store(A0, [E[0]], None, [LOCAL[0]]) == _stored(1)
    assert index.store(A0, [F[0]], None, [LOCAL[0]]) == _stored(1)
    assert index.block_count(A0) == 2
    assert index.stats() == IndexStats(
        holders=1, blocks=2, distinct_prefixes=1, held_orphans=0, orphans_expired=0, unknown_removals=0
    )
    assert index.remove(A0, [E[0]]) == _removed(1)
    assert index.match(SEQ) == {A0: 1}
    assert index.remove(A0, [F[0]]) == _removed(1)
    assert index.match(SEQ) == {}
    assert index.stats().distinct_prefixes == 0


# ------------------------------------------------------------------------------------ clear / remove_worker


def test_clear_one_holder_leaves_other_dp_rank() -> None:
    """Clearing (worker-a, 0) empties it but keeps it known, and leaves (worker-a, 1) untouched."""
    index = PrefixIndex()
    index.store(A0, E[:3], None, LOCAL[:3])
    index.store(A1, F[:2], None, LOCAL[:2])
    assert index.store(A0, [E[3]], 7777, [LOCAL[3]]).held is True  # held on A0, dropped by the clear
    assert index.clear(A0) == 3
    assert index.match(SEQ) == {A1: 2}
    assert index.holders() == [A0, A1]
    assert index.block_count(A0) == 0
    assert index.block_count(A1) == 2
    assert index.clear(A0) == 0
    assert index.clear(B0) == 0
    assert index.holders() == [A0, A1]
    assert index.stats() == IndexStats(
        holders=2, blocks=2, distinct_prefixes=2, held_orphans=0, orphans_expired=0, unknown_removals=0
    )


def test_remove_worker_drops_all_ranks() -> None:
    """remove_worker drops every dp rank of the worker and nothing of other workers."""
    index = PrefixIndex()
    index.store(A0, E[:3], None, LOCAL[:3])
    index.store(A1, F[:2], None, LOCAL[:2])
    index.store(B0, F, None, LOCAL)
    assert index.remove_worker("worker-a") == 5
    assert index.holders() == [B0]
    assert index.match(SEQ) == {B0: 4}
    assert index.remove_worker("worker-a") == 0
    assert index.remove_worker("worker-b") == 4
    assert index.holders() == []
    assert index.match(SEQ) == {}
    assert index.stats().distinct_prefixes == 0


# ------------------------------------------------------------------------------------------ digest / dump


def _events() -> list[tuple[Holder, list[int], int | None, list[int]]]:
    return [
        (A0, E[:2], None, LOCAL[:2]),
        (A0, E[2:], E[1], LOCAL[2:]),
        (A1, F[:2], None, LOCAL[:2]),
        (A1, F[:2], None, LOCAL[:2]),
        (B0, [F[2], F[3]], E[1], OTHER_LOCAL[2:]),
        (B0, E[:2], None, OTHER_LOCAL[:2]),
    ]


def _build(order: list[int]) -> PrefixIndex:
    index = PrefixIndex()
    events = _events()
    for i in order:
        index.store(*events[i])
    return index


def test_digest_is_order_independent() -> None:
    """Indexes fed the same events in different orders have equal digests and dumps."""
    first = _build([0, 1, 2, 3, 4, 5])
    second = _build([5, 3, 1, 2, 4, 0])
    assert first.digest() == second.digest()
    assert sorted(first.dump()) == sorted(second.dump())
    assert first.match(SEQ) == second.match(SEQ) == {A0: 4, A1: 2, B0: 2}
    assert first.match(OTHER_SEQ) == {A0: 2, A1: 2, B0: 4}
    assert PrefixIndex().digest() == 0


def test_digest_changes_after_any_change() -> None:
    """Removing, decrementing, adding, or clearing anything changes the digest."""
    base = _build([0, 1, 2, 3, 4, 5]).digest()
    changes: dict[str, Callable[[PrefixIndex], object]] = {
        "remove-last": lambda ix: ix.remove(A0, [E[3]]),
        "decrement-duplicate": lambda ix: ix.remove(A1, [F[0]]),
        "duplicate": lambda ix: ix.store(A0, [E[0]], None, [LOCAL[0]]),
        "new-block": lambda ix: ix.store(A1, [F[2]], F[1], [LOCAL[2]]),
        "same-block-other-rank": lambda ix: ix.store(Holder("worker-b", 1), [E[0]], None, [LOCAL[0]]),
        "clear": lambda ix: ix.clear(B0),
    }
    digests = {}
    for name, change in changes.items():
        index = _build([0, 1, 2, 3, 4, 5])
        change(index)
        digests[name] = index.digest()
    assert base not in digests.values()
    assert len(set(digests.values())) == len(changes)


def test_digest_ignores_held_orphans() -> None:
    """A held event does not change the digest until it attaches."""
    index = _build([0, 1, 2, 3, 4, 5])
    before = index.digest()
    assert index.store(A0, [7001], 7000, [LOCAL[0]]).held is True
    assert index.digest() == before


def test_dump_replays_into_equal_index() -> None:
    """Re-storing each dumped block as a root whose local hash is its prefix key rebuilds the index."""
    original = _build([0, 1, 2, 3, 4, 5])
    dumped = sorted(original.dump())
    assert len(dumped) == 10
    replica = PrefixIndex()
    for holder, tier, engine_hash, seq, count in dumped:
        for _ in range(count):
            # With no parent, a block's prefix key is its local hash: prefix_keys([x]) == [x] for x < 2**60.
            replica.store(holder, [engine_hash], None, [seq], tier)
    assert replica.digest() == original.digest()
    assert sorted(replica.dump()) == dumped
    assert replica.match(SEQ) == original.match(SEQ)
    assert replica.stats() == original.stats()


# ------------------------------------------------------------------------------------------- 60-bit keys


def test_engine_hashes_fold_to_60_bits() -> None:
    """Engine hashes below the prime 2**60 - 93 are kept; larger ones are taken modulo it, so a counter with a
    tag in its top bits does not collide with the plain counter."""
    assert engine_key60(1001) == 1001
    assert engine_key60(2**60 - 94) == 2**60 - 94
    assert engine_key60(2**60 - 93) == 0
    assert engine_key60(2**60) == 93
    assert engine_key60(2**64 - 1) == 1487
    assert engine_key60(0xF000_0000_0000_0005) == 1400
    assert [engine_key60(2**63 + i) for i in range(3)] == [744, 745, 746]


def test_engine_keys_are_folded_and_prefix_keys_are_full_64_bit_sequence_hashes() -> None:
    """64-bit engine hashes go in folded below 2**60 (`engine_key60`) and still resolve parents, removals and
    `holds`; prefix keys are the standard sequence hashes, kept whole (here all at or above 2**60)."""
    big = [0xF0E1D2C3B4A59687 + i for i in range(4)]  # 64-bit (>= 2**63), all fold to distinct keys
    local = [2**64 - 7 - i for i in range(4)]
    keys = prefix_keys(local)
    assert keys == sequence_hashes(local) and all(k >= 2**60 for k in keys)
    index = PrefixIndex()
    assert index.store(A0, big[:2], None, local[:2]) == _stored(2)
    assert index.store(A0, big[2:], big[1], local[2:]) == _stored(2)
    assert sorted(index.dump()) == sorted(
        (A0, "GPU", engine_key60(h), k, 1) for h, k in zip(big, keys, strict=True)
    )
    assert all(h < 2**60 for _holder, _tier, h, _k, _count in index.dump())
    assert index.match(keys) == {A0: 4}
    assert index.holds(A0, big[3]) is True
    assert index.remove(A0, [big[3]]) == _removed(1)
    assert index.match(keys) == {A0: 3}


# ------------------------------------------------------------------------------------------ storage tiers

LOCAL8 = [101, 102, 103, 104, 105, 106, 107, 108]
KEYS8 = prefix_keys(LOCAL8)
E8 = [1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008]


def _gpu4_cpu8() -> PrefixIndex:
    index = PrefixIndex()
    assert index.store(A0, E8[:4], None, LOCAL8[:4]) == _stored(4)
    assert index.store(A0, E8, None, LOCAL8, "CPU") == _stored(8)
    return index


def test_tier_names_normalize() -> None:
    """No medium, "" and any case of GPU are the default tier; other names are upper-cased."""
    assert [tier_name(m) for m in (None, "", "GPU", "gpu", "cpu", "CPU", "Disk")] == [
        None, None, None, None, "CPU", "CPU", "DISK",
    ]  # fmt: skip


def test_gpu_prefix_with_longer_cpu_copy() -> None:
    """4 blocks on GPU and a CPU copy of all 8: overlap 8, four counted on GPU (fastest) and four on CPU."""
    index = _gpu4_cpu8()
    assert index.match(KEYS8) == {A0: 8}
    assert index.match_tiers(KEYS8) == {A0: Overlap(8, {"GPU": 4, "CPU": 4})}
    assert index.match_tiers(KEYS8[:4]) == {A0: Overlap(4, None)}
    assert index.block_count(A0) == 12
    assert index.holds(A0, E8[5]) is False
    assert index.holds(A0, E8[5], "CPU") is True
    assert index.stats() == IndexStats(
        holders=1, blocks=12, distinct_prefixes=8, held_orphans=0, orphans_expired=0, unknown_removals=0
    )


def test_removal_from_cpu_only() -> None:
    """A removal names its tier: removing from CPU leaves the GPU copy, and a removal without a medium is GPU's."""
    index = _gpu4_cpu8()
    assert index.remove(A0, [E8[5]], "CPU") == _removed(1)
    assert index.match_tiers(KEYS8) == {A0: Overlap(5, {"GPU": 4, "CPU": 1})}
    assert index.remove(A0, [E8[6]]) == _removed(0, unknown=1)  # not on GPU
    assert index.remove(A0, [E8[6]], "DISK") == _removed(0, unknown=1)  # no such tier
    assert index.remove(A0, [E8[0]], "cpu") == _removed(1)  # block 0 still on GPU
    assert index.match_tiers(KEYS8) == {A0: Overlap(5, {"GPU": 4, "CPU": 1})}
    assert index.remove(A0, [E8[1]], "GPU") == _removed(1)  # block 1 now on CPU only
    assert index.match_tiers(KEYS8) == {A0: Overlap(5, {"GPU": 3, "CPU": 2})}
    assert index.remove(A0, [E8[1]], "CPU") == _removed(1)  # block 1 gone from both tiers
    assert index.match_tiers(KEYS8) == {A0: Overlap(1, None)}
    assert index.block_count(A0) == 8
    assert index.stats().unknown_removals == 2


def test_cpu_only_block_in_the_middle_of_a_gpu_run() -> None:
    """A block held only on CPU continues the run; it counts on CPU, the others on GPU."""
    index = _gpu4_cpu8()
    assert index.remove(A0, [E8[1]]) == _removed(1)
    assert index.match_tiers(KEYS8) == {A0: Overlap(8, {"GPU": 3, "CPU": 5})}


def test_emptied_tier_goes_back_to_the_default_answer() -> None:
    """Removing the last CPU block leaves an all-GPU index whose answers carry no tiers."""
    index = _gpu4_cpu8()
    assert index.remove(A0, E8, "CPU") == _removed(8)
    assert index.match_tiers(KEYS8) == {A0: Overlap(4, None)}
    assert index.export().holders[0].tiers == ()


def test_clear_and_worker_removal_drop_every_tier() -> None:
    """AllBlocksCleared and worker removal drop the holder's blocks on every tier."""
    index = _gpu4_cpu8()
    index.store(A1, E8[:2], None, LOCAL8[:2], "DISK")
    assert index.clear(A0) == 12
    assert index.match_tiers(KEYS8) == {A1: Overlap(2, {"DISK": 2})}
    assert index.holders() == [A0, A1]
    assert index.remove_worker("worker-a") == 2
    assert index.match_tiers(KEYS8) == {}
    assert index.stats() == IndexStats(
        holders=0, blocks=0, distinct_prefixes=0, held_orphans=0, orphans_expired=0, unknown_removals=0
    )


def test_parent_resolved_across_tiers() -> None:
    """A CPU event whose parent is only on the holder's GPU attaches on CPU, chained from the GPU block's key."""
    index = PrefixIndex()
    index.store(A0, E8[:2], None, LOCAL8[:2])
    assert index.store(A0, E8[2:4], E8[1], LOCAL8[2:4], "CPU") == _stored(2)
    assert index.match_tiers(KEYS8) == {A0: Overlap(4, {"GPU": 2, "CPU": 2})}
    # ... and a GPU event under a CPU-only parent attaches on GPU.
    assert index.store(A0, [E8[4]], E8[3], [LOCAL8[4]]) == _stored(1)
    assert index.match_tiers(KEYS8) == {A0: Overlap(5, {"GPU": 3, "CPU": 2})}
    # Another holder's tiers are never used.
    assert index.store(B0, [E8[2]], E8[1], [LOCAL8[2]], "CPU") == _stored(0, held=True)


def test_held_cpu_event_attaches_when_its_parent_arrives_on_gpu() -> None:
    """An event held on one tier waits for its parent on any tier of the holder."""
    index = PrefixIndex()
    assert index.store(A0, E8[2:4], E8[1], LOCAL8[2:4], "CPU") == _stored(0, held=True)
    assert index.match_tiers(KEYS8) == {}
    assert index.store(A0, E8[:2], None, LOCAL8[:2]) == _stored(4)
    assert index.match_tiers(KEYS8) == {A0: Overlap(4, {"GPU": 2, "CPU": 2})}
    assert index.holds(A0, E8[3], "CPU") is True


def test_fastest_tier_order_and_other_holders() -> None:
    """Per holder, each block counts on its fastest tier: GPU, CPU, then the others by name."""
    index = PrefixIndex()
    index.store(A0, E8[:3], None, LOCAL8[:3], "STORAGE")
    index.store(A0, E8[:2], None, LOCAL8[:2], "DISK")
    index.store(A0, E8[:1], None, LOCAL8[:1], "CPU")
    index.store(B0, F[:2], None, LOCAL8[:2])
    assert index.match_tiers(KEYS8) == {
        A0: Overlap(3, {"CPU": 1, "DISK": 1, "STORAGE": 1}),
        B0: Overlap(2, None),
    }
    assert list(index.match_tiers(KEYS8)[A0].tiers or {}) == ["CPU", "DISK", "STORAGE"]
    assert index.match(KEYS8) == {A0: 3, B0: 2}


def test_tier_is_part_of_digest_dump_and_export() -> None:
    """The same block on GPU and on CPU digests differently; dump and export name the tier."""
    gpu, cpu = PrefixIndex(), PrefixIndex()
    gpu.store(A0, E8[:2], None, LOCAL8[:2], "GPU")
    cpu.store(A0, E8[:2], None, LOCAL8[:2], "CPU")
    assert gpu.digest() != cpu.digest()
    assert sorted(cpu.dump()) == [(A0, "CPU", E8[0], KEYS8[0], 1), (A0, "CPU", E8[1], KEYS8[1], 1)]
    replica = PrefixIndex.from_export(cpu.export())
    assert replica.digest() == cpu.digest()
    assert replica.match_tiers(KEYS8) == {A0: Overlap(2, {"CPU": 2})}
    assert replica.remove(A0, [E8[1]], "CPU") == _removed(1)


def test_duplicate_copies_count_per_tier() -> None:
    """Store counts are per tier: a block stored twice on CPU needs two CPU removals; GPU is separate."""
    index = PrefixIndex()
    index.store(A0, E8[:2], None, LOCAL8[:2], "CPU")
    assert index.store(A0, E8[:2], None, LOCAL8[:2], "CPU") == _stored(0, duplicates=2)
    assert index.store(A0, E8[:2], None, LOCAL8[:2]) == _stored(2)
    assert index.remove(A0, E8[:2], "CPU") == _removed(0, decremented=2)
    assert index.remove(A0, E8[:2]) == _removed(2)
    assert index.match_tiers(KEYS8) == {A0: Overlap(2, {"CPU": 2})}
    assert index.remove(A0, E8[:2], "CPU") == _removed(2)
    assert index.match_tiers(KEYS8) == {}


def test_two_blocks_of_one_holder_with_one_prefix_key_are_removed_in_one_event() -> None:
    """Two engine blocks of one holder with the same prefix key (same tokens under two engine hashes), removed
    together: the key's shared entry is demoted by the first and dropped by the second (a KeyError once)."""
    index = PrefixIndex()
    index.store(A0, [11], None, [LOCAL[0]])
    index.store(A0, [12], None, [LOCAL[0]])
    index.store(B0, [13], None, [LOCAL[0]])
    assert index.match(SEQ[:1]) == {A0: 1, B0: 1}
    assert index.remove(A0, [11, 12]) == RemoveResult(2, 0, 0)
    assert index.match(SEQ[:1]) == {B0: 1}
    index.store(A0, [11], None, [LOCAL[0]])
    index.store(A0, [12], None, [LOCAL[0]])
    assert index.remove(B0, [13]) == RemoveResult(1, 0, 0)  # A0 alone holds the key, twice
    assert index.clear(A0) == 2
    assert index.match(SEQ[:1]) == {}
    assert index.stats().distinct_prefixes == 0
