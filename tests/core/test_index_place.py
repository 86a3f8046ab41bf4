"""Exact-value tests of `PrefixIndex.place`: copies of a holder's known blocks on another tier (a tokenless
BlockStored of vLLM < 0.24's OffloadingConnector)."""

from __future__ import annotations

from kvmesh.core.hashing import prefix_keys
from kvmesh.core.index import Holder, Overlap, PlaceResult, PrefixIndex

A0 = Holder("worker-a", 0)
B0 = Holder("worker-b", 0)
LOCAL = [101, 102, 103, 104]
SEQ = prefix_keys(LOCAL)
E = [1001, 1002, 1003, 1004]


def test_copies_take_the_chain_position_of_the_blocks_they_copy() -> None:
    """CPU copies of blocks 0–2 keep matching once the GPU blocks are gone; the 4th block, never copied, does
    not; a copy of a block the holder lacks is counted as unknown, and another holder's block does not count."""
    index = PrefixIndex()
    index.store(A0, E, None, LOCAL)
    index.store(B0, [7], None, [555])
    assert index.place(A0, [E[0], E[1], E[2], 7, 42], "cpu") == PlaceResult(placed=3, duplicates=0, unknown=2)
    assert index.match_tiers(SEQ) == {A0: Overlap(4, None)}  # all on the default tier
    index.remove(A0, E, None)
    assert index.match_tiers(SEQ) == {A0: Overlap(3, {"CPU": 3})}
    assert index.block_count(A0) == 3


def test_a_repeated_copy_is_a_duplicate_and_needs_two_removals() -> None:
    """Copying a block onto a tier it is already on raises its store count, as a repeated BlockStored does."""
    index = PrefixIndex()
    index.store(A0, E[:2], None, LOCAL[:2])
    assert index.place(A0, E[:2], "CPU") == PlaceResult(2, 0, 0)
    index.remove(A0, E[:2], None)
    assert index.place(A0, E[:1], "CPU") == PlaceResult(0, 1, 0)  # found on the CPU tier only
    index.remove(A0, E[:1], "CPU")
    assert index.match(SEQ) == {A0: 2}
    index.remove(A0, E[:1], "CPU")
    assert index.match(SEQ) == {}


def test_a_placement_for_an_unknown_holder_counts_everything_unknown() -> None:
    index = PrefixIndex()
    assert index.place(A0, E, "CPU") == PlaceResult(0, 0, 4)
    assert index.holders() == []


def test_a_held_child_attaches_when_its_parent_is_copied_to_its_tier() -> None:
    """A CPU BlockStored whose parent is on no tier is held; once the parent block exists (stored on GPU, then
    copied to CPU), the held child attaches on CPU with the right chain."""
    index = PrefixIndex()
    assert index.store(A0, E[2:], E[1], LOCAL[2:], "CPU").held is True
    index.store(A0, E[:2], None, LOCAL[:2])  # the parent arrives on GPU: the child attaches (any tier)
    assert index.match_tiers(SEQ) == {A0: Overlap(4, {"GPU": 2, "CPU": 2})}
    assert index.place(A0, E[:2], "CPU") == PlaceResult(2, 0, 0)
    index.remove(A0, E[:2], None)
    assert index.match_tiers(SEQ) == {A0: Overlap(4, {"CPU": 4})}


def test_placements_survive_export_and_keep_the_digest() -> None:
    """The placed tier is exported and restored like a stored one: same matches, same digest."""
    index = PrefixIndex()
    index.store(A0, E, None, LOCAL)
    index.place(A0, E[:3], "CPU")
    index.remove(A0, E[1:], None)
    restored = PrefixIndex.from_export(index.export())
    assert restored.match_tiers(SEQ) == index.match_tiers(SEQ) == {A0: Overlap(3, {"GPU": 1, "CPU": 2})}
    assert restored.digest() == index.digest() == index.digest_from_scratch()
