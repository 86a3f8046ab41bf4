"""vLLM's one BlockRemoved per evicted block: consecutive removals of one tier become one stream event.

The index removes one copy per key whichever way the keys come, so the merged event is the same change; the
engine events are still counted one by one.
"""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.core.events import EventsMessage, Removed, Stored
from kvmesh.core.hashing import local_block_hashes
from kvmesh.core.normalize import Normalizer
from kvmesh.core.state import IndexState
from kvmesh.core.wire import decode_batch

BS = 4
TOKENS = list(range(8))


def _removal(h: int, medium: str | None = None) -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium}


def test_consecutive_removals_of_one_tier_are_one_event_in_engine_order() -> None:
    """Two default-tier removals, one naming GPU, a CPU one, a store, then two more: four Removed events
    around the store, keys in engine order, six removals (seven blocks) counted."""
    payload = msgspec.msgpack.encode(
        [
            0.0,
            [
                _removal(1), _removal(2), _removal(2, "GPU"), _removal(3, "CPU"),
                ["BlockStored", [11, 12], None, TOKENS, BS],
                _removal(4), ["BlockRemoved", [5, 6]],
            ],
            0,
        ]
    )  # fmt: skip
    norm = Normalizer()
    result = norm.normalize(decode_batch(payload))
    assert result.events == [
        Removed([1, 2], None),
        Removed([2], "GPU"),  # the medium as the engine named it: a merge never changes it
        Removed([3], "CPU"),
        Stored([11, 12], None, local_block_hashes(TOKENS, BS)),
        Removed([4, 5, 6], None),
    ]
    assert (norm.stats.removed_events, norm.stats.removed_blocks) == (6, 7)


def test_a_merged_removal_changes_the_index_as_the_separate_ones_do() -> None:
    """Block 11 stored twice (two copies) and 12 once; removals 11, 11, 12, 12 one by one or as one event:
    the same index, the same counters (one unknown removal either way)."""
    stored = Stored([11, 12], None, local_block_hashes(TOKENS, BS))
    copy = Stored([11], None, local_block_hashes(TOKENS[:4], BS))
    states = []
    for removals in (
        [Removed([11]), Removed([11]), Removed([12]), Removed([12])],
        [Removed([11, 11, 12, 12])],
    ):
        state = IndexState()
        msg = EventsMessage(
            worker_id="w",
            dp_rank=0,
            model="m",
            block_size=BS,
            epoch=1,
            seq=0,
            events=[stored, copy, *removals],
        )
        state.apply(1, msg)
        states.append(state)
    one, merged = states
    assert (one.digest(), one.block_total(), one.counters) == (
        merged.digest(),
        merged.block_total(),
        merged.counters,
    )
    assert (merged.block_total(), merged.counters.unknown_removals) == (0, 1)


def test_events_that_put_nothing_out_do_not_split_a_run() -> None:
    """A rejected store, an unknown tag, an empty removal and a removal of a non-full-attention group put
    nothing out, so the removals around them stay one event; a clear splits the run. Counters exact."""
    payload = msgspec.msgpack.encode(
        [
            0.0,
            [
                {"type": "BlockStored", "block_hashes": [20], "parent_block_hash": None, "token_ids": TOKENS,
                 "block_size": BS, "kv_cache_spec_kind": "sliding_window", "group_idx": 1},
                _removal(1),
                {"type": "BlockStored", "block_hashes": [21], "parent_block_hash": None, "token_ids": [1, 2, 3],
                 "block_size": BS},
                {"type": "SomethingNew"},
                _removal(2),
                {"type": "BlockRemoved", "block_hashes": []},
                {"type": "BlockRemoved", "block_hashes": [99], "group_idx": 1},
                {"type": "BlockRemoved", "block_hashes": [2**64 + 3 - 2**64, b"\x00\x07"]},
                {"type": "AllBlocksCleared"},
                _removal(4),
            ],
        ]
    )  # fmt: skip
    norm = Normalizer()
    result = norm.normalize(decode_batch(payload))
    assert result.events[0] == Removed([1, 2, 3, 7], None)
    assert result.events[2:] == [Removed([4], None)]
    assert type(result.events[1]).__name__ == "Cleared"
    assert [type(r).__name__ for r in result.rejections] == ["BlockAlignmentError"]
    s = norm.stats
    assert (s.removed_events, s.removed_blocks, s.unkeyed_events, s.skipped_non_full, s.unknown_events) == (
        4, 5, 1, 2, 1,
    )  # fmt: skip


def test_hashes_the_wire_never_gives_are_refused_and_the_removals_before_stay_counted() -> None:
    """Events built in code (the wire decoder never yields these): a bool block hash in a BlockStored is
    refused as `engine_key` refuses it, and a removal whose hash is a str raises after the removals before
    it in the batch were counted (as they always were: the counters are not lost with the exception)."""
    from kvmesh.core.errors import WireError
    from kvmesh.core.wire import BlockRemoved, BlockStored, EngineBatch

    norm = Normalizer()
    stored = BlockStored(
        block_hashes=(True,), parent_block_hash=None, token_ids=tuple(range(BS)), block_size=BS
    )
    with pytest.raises(WireError):
        norm.normalize(EngineBatch(ts=0.0, events=(stored,), dp_rank=None))
    bad = EngineBatch(
        ts=0.0,
        dp_rank=None,
        events=(
            BlockRemoved(block_hashes=(1,)),
            BlockRemoved(block_hashes=(2, 3)),
            BlockRemoved(block_hashes=("x",)),  # type: ignore[arg-type]
        ),
    )
    with pytest.raises(WireError):
        norm.normalize(bad)
    assert (norm.stats.removed_events, norm.stats.removed_blocks) == (3, 4)
