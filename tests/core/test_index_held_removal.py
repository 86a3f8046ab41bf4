"""A BlockRemoved of a block that is held (in a BlockStored waiting for its parent), exactly.

The held event loses that block by being split there: the blocks before it keep waiting for the event's
parent, the blocks after it wait for the removed block itself. Without this, the parent arriving later would
attach a block the engine had already removed and a match would over-count it.
"""

from __future__ import annotations

from kvmesh.core.hashing import local_block_hashes, prefix_keys
from kvmesh.core.index import Holder, PrefixIndex

BS = 4
LOCAL = local_block_hashes(list(range(32)), BS)  # 8 blocks
KEYS = prefix_keys(LOCAL)
A = Holder("a", 0)


def _blocks(index: PrefixIndex) -> dict[int, int]:
    """Engine key → prefix key of A's default tier."""
    return {key: prefix for holder, tier, key, prefix, _count in index.dump() if (holder, tier) == (A, "GPU")}


def test_a_removed_held_block_splits_its_event_and_stays_out_when_the_parent_comes() -> None:
    """11, 12, 13 held under 10; 12 removed; 10 arrives: 11 attaches, 13 waits for 12; a match stops after 11.
    Then 12 arrives under 11: 13 attaches behind it, every block at its chain position."""
    index = PrefixIndex()
    assert index.store(A, [11, 12, 13], 10, LOCAL[1:4]).held is True
    assert index.remove(A, [12]) == (0, 0, 1)
    assert index.stats().held_orphans == 2
    assert index.store(A, [10], None, LOCAL[:1]).attached == 2
    assert _blocks(index) == {10: KEYS[0], 11: KEYS[1]}
    assert index.match(KEYS[:4]) == {A: 2}
    assert index.stats().held_orphans == 1
    assert index.store(A, [12], 11, LOCAL[2:3]).attached == 2
    assert _blocks(index) == {10: KEYS[0], 11: KEYS[1], 12: KEYS[2], 13: KEYS[3]}
    assert index.match(KEYS[:4]) == {A: 4}
    assert (index.stats().held_orphans, index.digest()) == (0, index.digest_from_scratch())


def test_removing_the_first_held_block_leaves_the_rest_waiting_for_it() -> None:
    index = PrefixIndex()
    index.store(A, [11, 12], 10, LOCAL[1:3])
    index.remove(A, [11])
    index.store(A, [10], None, LOCAL[:1])
    assert (_blocks(index), index.match(KEYS[:3])) == ({10: KEYS[0]}, {A: 1})
    index.store(A, [11], 10, LOCAL[1:2])
    assert (_blocks(index), index.match(KEYS[:3])) == ({10: KEYS[0], 11: KEYS[1], 12: KEYS[2]}, {A: 3})


def test_a_removal_takes_one_held_copy_and_only_on_its_own_tier() -> None:
    """Two held copies of 11 (two events); one removal takes the oldest only; a CPU removal leaves the
    default tier's held block alone; a removal of a block held nowhere changes nothing."""
    index = PrefixIndex()
    index.store(A, [11], 10, LOCAL[1:2])
    index.store(A, [11], 10, LOCAL[1:2])
    index.remove(A, [11], "CPU")
    index.remove(A, [99])
    assert index.stats().held_orphans == 2
    index.remove(A, [11])
    assert index.stats().held_orphans == 1
    index.store(A, [10], None, LOCAL[:1])
    assert [(k, c) for h, t, k, _p, c in index.dump()] == [(10, 1), (11, 1)]


def test_split_held_events_survive_an_export() -> None:
    """The split events are ordinary held events: an index rebuilt from the export attaches them the same."""
    index = PrefixIndex()
    index.store(A, [11, 12, 13], 10, LOCAL[1:4])
    index.remove(A, [12])
    restored = PrefixIndex.from_export(index.export())
    for ix in (index, restored):
        ix.store(A, [10], None, LOCAL[:1])
        ix.store(A, [12], 11, LOCAL[2:3])
    assert _blocks(restored) == _blocks(index) == {10: KEYS[0], 11: KEYS[1], 12: KEYS[2], 13: KEYS[3]}
    assert restored.digest() == index.digest()
