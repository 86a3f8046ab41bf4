"""Exact-value tests of `kvmesh.core.snapshot`: round trips, checksums, versions, continuation after restore."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from kvmesh.core.errors import SnapshotError
from kvmesh.core.events import Cleared, Event, EventsMessage, IndexReset, Removed, Stored, WorkerRemoved
from kvmesh.core.hashing import local_block_hashes
from kvmesh.core.snapshot import (
    FORMAT_VERSION,
    HEADER_SIZE,
    decode_snapshot,
    encode_snapshot,
    read_header,
)
from kvmesh.core.state import IndexState

BS = 4
LOCAL = local_block_hashes(list(range(32)), BS)  # 8 blocks


_SEQ: dict[tuple[str, int, int], itertools.count[int]] = {}


def _msg(worker: str, rank: int, events: list[Event], *, epoch: int = 1) -> EventsMessage:
    """An engine message; each holder's engine sequence continues from its last message (no gaps)."""
    seq = next(_SEQ.setdefault((worker, rank, epoch), itertools.count()))
    return EventsMessage(
        worker_id=worker, dp_rank=rank, model="m", block_size=BS, epoch=epoch, seq=seq, events=events
    )


def _history() -> list[EventsMessage | WorkerRemoved]:
    """Stores, a duplicate store, a held orphan, a removal and a removed worker."""
    return [
        _msg("a", 0, [Stored([1, 2], None, LOCAL[:2])]),
        _msg("a", 0, [Stored([2], 1, LOCAL[1:2])]),  # duplicate copy of block 2
        _msg("a", 1, [Stored([9], 77, LOCAL[5:6])]),  # parent 77 unknown: held
        _msg("b", 0, [Stored([5, 6, 7], None, LOCAL[:3])]),
        _msg("b", 0, [Removed([7])]),
        _msg("c", 0, [Stored([8], None, LOCAL[:1])]),
        WorkerRemoved(worker_id="c", model="m", epoch=1),
        _msg("b", 0, [Stored([5, 6, 7, 10], None, LOCAL[:4], "CPU")]),  # a CPU tier
        _msg("b", 0, [Stored([12], 11, LOCAL[5:6], "DISK")]),  # held on the DISK tier
    ]


def _continuation() -> list[EventsMessage]:
    """Messages that touch every restored detail: the orphan's parent, the duplicate, the removed worker, the
    tiers."""
    return [
        _msg("a", 1, [Stored([77], None, LOCAL[4:5])]),  # releases the held orphan... under another chain
        _msg("a", 0, [Removed([2])]),  # one copy of the duplicate: block 2 stays
        _msg("c", 0, [Stored([8], None, LOCAL[:1])]),  # removed incarnation: dropped
        _msg("b", 0, [Stored([11], 10, LOCAL[4:5], "CPU")]),  # releases the DISK orphan (parent on CPU)
        _msg("b", 0, [Removed([6], "CPU")]),
    ]


def _prompt() -> list[int]:
    return list(range(24))


def _state(
    messages: Sequence[EventsMessage | WorkerRemoved], start: int = 1, state: IndexState | None = None
) -> IndexState:
    state = state or IndexState()
    for i, m in enumerate(messages, start):
        state.apply(i, m)
    return state


def test_round_trip_keeps_digest_size_and_sequence() -> None:
    """Decoding an encoded state gives a state with the same sequence, blocks, digest and dump."""
    original = _state(_history())
    restored = IndexState.from_export(decode_snapshot(encode_snapshot(original.export())))
    assert restored.applied_seq == 9
    assert restored.block_total() == original.block_total() == 8
    assert restored.digest() == original.digest()
    assert restored.match("m", _prompt()) == original.match("m", _prompt())
    assert restored.workers() == original.workers()
    assert restored.counters == original.counters


def test_restored_state_continues_exactly_like_the_original() -> None:
    """A restored state applying the same later messages ends equal to the never-stopped one."""
    original = _state(_history())
    restored = IndexState.from_export(decode_snapshot(encode_snapshot(original.export())))
    later = _continuation()
    _state(later, 10, original)
    _state(later, 10, restored)
    assert restored.digest() == original.digest()
    assert restored.block_total() == original.block_total() == 11
    assert restored.counters == original.counters
    assert restored.match("m", _prompt()).candidates == original.match("m", _prompt()).candidates
    b0 = next(c for c in restored.match("m", _prompt()).candidates if c.worker_id == "b")
    assert (b0.overlap_blocks, b0.cached_blocks, b0.tiers) == (6, 7, {"GPU": 2, "CPU": 3, "DISK": 1})


def test_export_is_detached_from_the_live_state() -> None:
    """Changes after export() do not reach the export (it is safe to encode in another thread)."""
    state = _state(_history())
    export = state.export()
    before = encode_snapshot(export)
    _state(_continuation(), 10, state)
    assert encode_snapshot(export) == before


def test_header_carries_version_and_sequence() -> None:
    """The header names the format version and the stream sequence the state reflects."""
    data = encode_snapshot(_state(_history()).export())
    header = read_header(data)
    assert (header.format_version, header.applied_seq, header.body_bytes) == (
        FORMAT_VERSION,
        9,
        len(data) - HEADER_SIZE,
    )
    assert FORMAT_VERSION == 4


@pytest.mark.parametrize(
    ("version", "why"),
    [
        (1, "format 1 kept raw engine hashes and no engine order per holder"),
        (2, "format 2 kept no engine order per holder"),
    ],
)
def test_older_format_snapshot_is_refused_by_version(version: int, why: str) -> None:
    """A format-1 or format-2 snapshot is refused with reason "version" and says why."""
    data = encode_snapshot(_state(_history()).export())
    old = data[:8] + version.to_bytes(4, "little") + data[12:]
    with pytest.raises(SnapshotError) as info:
        decode_snapshot(old)
    assert info.value.reason == "version"
    assert str(info.value) == (
        f"snapshot format {version} ({why}); this build reads formats 3 (without its blocks) and 4"
    )


def test_a_format_3_snapshot_is_read_without_its_blocks_and_its_holders_incomplete() -> None:
    """Format 3 keyed prefixes by a 60-bit chain that cannot be turned into sequence hashes: its state comes
    back with every worker, cursor, counter and held message, no blocks, and each holder that had blocks
    incomplete (``stream_gap``) until rebuilt; a holder that had none (a's rank 1, only an orphan) is exact. The
    later messages then apply as on any state, and a Cleared makes its holder exact again."""
    original = _state(_history())
    data = encode_snapshot(original.export())
    old = data[:8] + (3).to_bytes(4, "little") + data[12:]
    restored = IndexState.from_export(decode_snapshot(old))
    assert (restored.applied_seq, restored.block_total()) == (9, 0)
    assert restored.workers() == {w: {**info, "blocks": 0} for w, info in original.workers().items()}
    assert restored.counters == original.counters
    assert restored.holder_health() == {
        ("a", 0): "stream_gap",
        ("b", 0): "stream_gap",
    }
    assert restored.incomplete() == [("a", 0), ("b", 0)]
    assert {
        (c.worker_id, c.dp_rank, c.overlap_blocks, c.health)
        for c in restored.match("m", _prompt()).candidates
    } == {
        ("a", 0, 0, "stream_gap"),
        ("a", 1, 0, None),
        ("b", 0, 0, "stream_gap"),
    }
    _state([_msg("a", 0, [Cleared("engine")]), _msg("a", 0, [Stored([1, 2], None, LOCAL[:2])])], 10, restored)
    assert restored.holder_health() == {("b", 0): "stream_gap"}
    (a0,) = [c for c in restored.match("m", _prompt()).candidates if c.worker_id == "a" and c.dp_rank == 0]
    assert a0.overlap_blocks == 2


def test_flipped_body_byte_fails_the_checksum() -> None:
    """One changed body byte is caught by the checksum."""
    data = bytearray(encode_snapshot(_state(_history()).export()))
    data[HEADER_SIZE + 10] ^= 0xFF
    with pytest.raises(SnapshotError) as info:
        decode_snapshot(bytes(data))
    assert info.value.reason == "checksum"


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda d: d[:20], "truncated"),
        (lambda d: d[:-1], "truncated"),
        (lambda d: b"XXXXXXXX" + d[8:], "magic"),
        (lambda d: d[:8] + (99).to_bytes(4, "little") + d[12:], "version"),
    ],
)
def test_bad_snapshots_are_refused_with_a_reason(mutate: object, reason: str) -> None:
    """Truncated, foreign and future-format bytes are refused, each with its reason."""
    data = encode_snapshot(_state(_history()).export())
    with pytest.raises(SnapshotError) as info:
        decode_snapshot(mutate(data))  # type: ignore[operator]
    assert info.value.reason == reason


def test_gap_marks_holders_incomplete_until_cleared() -> None:
    """After a gap every live holder is incomplete until a Cleared rebuilds it, and the mark survives a snapshot."""
    state = _state(_history())
    state.mark_gap(9)
    assert state.incomplete() == [("a", 0), ("a", 1), ("b", 0)]
    state.apply(10, _msg("b", 0, [Cleared()]))
    restored = IndexState.from_export(decode_snapshot(encode_snapshot(state.export())))
    assert restored.incomplete() == [("a", 0), ("a", 1)]
    assert restored.gap_seq == 9


def test_reset_forgets_everything_and_raises_the_epoch() -> None:
    """An IndexReset empties the index, forgets the workers and raises reset_epoch."""
    state = _state(_history())
    state.apply(10, IndexReset(epoch=1))
    assert (state.block_total(), state.workers(), state.reset_epoch, state.applied_seq) == (0, {}, 1, 10)
    state.apply(11, _msg("c", 0, [Stored([8], None, LOCAL[:1])]))  # the removed incarnation is accepted again
    assert state.block_total() == 1


def test_a_backend_pools_readers_survive_a_snapshot() -> None:
    """A backend pool's readers (`EventsMessage.readers`) are in the snapshot: a restored state counts the
    pool's blocks for its reader at once, as the original does."""
    pool = EventsMessage(
        worker_id="pool",
        dp_rank=0,
        model="m",
        block_size=BS,
        epoch=1,
        seq=0,
        events=[Stored([41, 42], None, LOCAL[:2], "CPU")],
        readers=["a"],
    )
    original = _state([_msg("a", 0, [Stored([1], None, LOCAL[:1])]), pool])
    restored = IndexState.from_export(decode_snapshot(encode_snapshot(original.export())))
    for state in (original, restored):
        (a0,) = state.match("m", _prompt()).candidates
        assert (a0.worker_id, a0.overlap_blocks, a0.cached_blocks) == ("a", 2, 1)
