"""A malformed event is rejected alone: the rest of its batch is kept exactly, and only an event that may have
removed blocks asks for a resync (`NormalizeResult.lost`)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvmesh.core.events import Cleared, Removed, Stored
from kvmesh.core.hashing import local_block_hashes
from kvmesh.core.normalize import Normalizer
from kvmesh.core.wire import decode_batch

TS = 1700000000.25
BS = 4
TOKENS = list(range(8))
PARENT_TOKENS = list(range(8, 12))
VALID_STORED = ["BlockStored", [11, 12], None, TOKENS, BS, None, "GPU"]
VALID_MAP = {"type": "BlockStored", "block_hashes": [13], "parent_block_hash": 12, "token_ids": PARENT_TOKENS,
             "block_size": BS, "medium": "CPU"}  # fmt: skip
VALID_REMOVED = ["BlockRemoved", [2**64 - 1], "GPU"]
KEPT = [
    Stored([11, 12], None, local_block_hashes(TOKENS, BS), "GPU"),
    Removed([2**64 - 1], "GPU"),
    Stored([13], 12, local_block_hashes(PARENT_TOKENS, BS), "CPU"),
    Cleared("engine"),
]


def _batch(bad: Any) -> bytes:
    """A batch with the bad event between valid ones (array and map forms, a removal, a clear)."""
    return msgspec.msgpack.encode(
        [TS, [VALID_STORED, bad, VALID_REMOVED, VALID_MAP, ["AllBlocksCleared"]], 0]
    )


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (["BlockStored", [21], None, [0, 1, 2, 3], BS, None, 7], "medium is a int, expected a string or nil"),
        (["BlockStored", [1.5], None, [0, 1, 2, 3], BS], "block_hashes holds a float (a hash must be an int or bin)"),
        (["BlockStored", [True], None, [0, 1, 2, 3], BS], "block_hashes holds a bool (a hash must be an int or bin)"),
        ({"type": "BlockStored", "block_hashes": [21], "token_ids": [0, 1, 2, 3], "block_size": BS, "medium": 1.0},
         "medium is a float, expected a string or nil"),
        (["BlockStored", [21], 2.5, [0, 1, 2, 3], BS], "parent_block_hash is a float (a hash must be an int or bin)"),
    ],
)  # fmt: skip
def test_malformed_block_stored_is_rejected_alone(bad: Any, reason: str) -> None:
    """A BlockStored with a non-string medium, a float or bool hash is one counted error; every other event of
    the batch is kept exactly and the holder is not resynchronised."""
    batch = decode_batch(_batch(bad))
    assert [(e.index, e.tag, e.reason) for e in batch.errors] == [(1, "BlockStored", reason)]
    norm = Normalizer()
    result = norm.normalize(batch)
    assert result.events == KEPT
    assert result.rejections == []
    assert result.lost is False
    assert (norm.stats.malformed_events, norm.stats.malformed_stored, norm.stats.stored_events) == (1, 1, 2)


@pytest.mark.parametrize(
    "bad",
    [
        ["BlockRemoved", [1.5]],
        ["BlockRemoved", [7], 3],
        {"type": "BlockRemoved", "block_hashes": [False]},
        42,
        [7, [1]],
        {"block_hashes": [1]},
    ],
)
def test_malformed_removal_or_untyped_event_still_asks_for_a_resync(bad: Any) -> None:
    """A BlockRemoved that fails, or an event whose type cannot be read, is lost (the index could keep blocks
    the engine evicted); the valid events are still returned in order."""
    batch = decode_batch(_batch(bad))
    assert len(batch.errors) == 1
    norm = Normalizer()
    result = norm.normalize(batch)
    assert result.events == KEPT
    assert result.lost is True
    assert (norm.stats.malformed_events, norm.stats.malformed_stored) == (1, 0)
