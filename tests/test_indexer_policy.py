"""Exact-value tests of the indexer's pure policy (`kvmesh.indexer.policy`): purge cut, snapshot schedule,
member reconcile, registry removals and the match reply; no NATS."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.core import protocol
from kvmesh.core.errors import RequestError
from kvmesh.core.state import HolderMatch, MatchResult
from kvmesh.indexer import policy
from kvmesh.indexer.policy import Forget, Removal, SnapshotSchedule


class _Record:
    def __init__(self, model: str, incarnation: int) -> None:
        self.model = model
        self.incarnation = incarnation


# ------------------------------------------------------------------------------------------------- retention


def test_the_stream_stays_whole_until_keep_snapshots_exist() -> None:
    """With fewer kept snapshots than --snapshot-keep, nothing may be purged."""
    assert policy.retention_floor([], 3) is None
    assert policy.retention_floor([200, 100], 3) is None


def test_the_floor_is_the_message_after_the_oldest_kept_snapshot() -> None:
    """With keep snapshots (or more) kept, the floor is the oldest one's sequence + 1."""
    assert policy.retention_floor([300, 200, 100], 3) == 101
    assert policy.retention_floor([400, 300, 200, 100], 3) == 101
    assert policy.retention_floor([50], 1) == 51


def test_the_cut_never_passes_an_ingest_cursor() -> None:
    """The cut is the lowest of the floor and every live holder's last message on its rank subject."""
    assert policy.purge_cut(101, [], 1) == 101
    assert policy.purge_cut(101, [150, 90, 120], 1) == 90
    assert policy.purge_cut(101, [150], 1) == 101


def test_no_cut_at_or_below_the_first_sequence() -> None:
    """A cut that would purge nothing (at or below the stream's first sequence) is None."""
    assert policy.purge_cut(101, [], 101) is None
    assert policy.purge_cut(101, [], 150) is None
    assert policy.purge_cut(101, [40], 40) is None
    assert policy.purge_cut(101, [41], 40) == 41


# ------------------------------------------------------------------------------------------------- schedule


def test_a_snapshot_is_due_after_every_messages() -> None:
    """The count trigger fires at exactly every_messages messages, whatever the time."""
    s = SnapshotSchedule(every_messages=100, every_s=0.0, now=0.0)
    s.count(99)
    assert not s.due(1e9)
    s.count()
    assert (s.since, s.due(0.0)) == (100, True)


def test_a_snapshot_is_due_after_every_s_only_with_a_message() -> None:
    """The time trigger fires every_s after the last attempt, and only when a message was read since."""
    s = SnapshotSchedule(every_messages=0, every_s=300.0, now=1000.0)
    assert not s.due(5000.0)  # nothing new
    s.count()
    assert not s.due(1299.9)
    assert s.due(1300.0)


def test_both_triggers_off_never_snapshot() -> None:
    """every_messages 0 and every_s 0: never due."""
    s = SnapshotSchedule(every_messages=0, every_s=0.0, now=0.0)
    s.count(10**6)
    assert not s.due(1e12)


def test_begin_resets_both_triggers() -> None:
    """An attempt takes the messages counted so far and restarts the clock from its start."""
    s = SnapshotSchedule(every_messages=100, every_s=60.0, now=0.0)
    s.count(120)
    assert s.begin(10.0) == 120
    assert (s.since, s.last_at) == (0, 10.0)
    s.count()
    assert not s.due(69.9)
    assert s.due(70.0)


def test_a_failed_upload_restores_its_messages() -> None:
    """A snapshot not stored gives its 120 messages back, so the count trigger is due again at once."""
    s = SnapshotSchedule(every_messages=100, every_s=0.0, now=0.0)
    s.count(120)
    taken = s.begin(1.0)
    s.count(3)  # read while encoding and storing
    s.upload_failed(taken)
    assert (s.since, s.due(1.0)) == (123, True)


def test_a_failed_attempt_delays_the_time_trigger() -> None:
    """A failed attempt at t=500 makes the next timed snapshot due at t=800, not at once."""
    s = SnapshotSchedule(every_messages=0, every_s=300.0, now=0.0)
    s.count()
    s.attempt_failed(500.0)
    assert not s.due(799.0)
    assert s.due(800.0)


def test_nothing_new_compares_sequence_and_stream() -> None:
    """A snapshot repeats the last one only at the same applied_seq of the same stream, and never when forced."""
    last = {"applied_seq": 120, "stream_id": "2026-01-01T00:00:00"}
    assert policy.nothing_new(force=False, last=last, applied_seq=120, stream_id="2026-01-01T00:00:00")
    assert not policy.nothing_new(force=True, last=last, applied_seq=120, stream_id="2026-01-01T00:00:00")
    assert not policy.nothing_new(force=False, last=last, applied_seq=121, stream_id="2026-01-01T00:00:00")
    assert not policy.nothing_new(force=False, last=last, applied_seq=120, stream_id="2026-02-01T00:00:00")
    assert not policy.nothing_new(force=False, last=None, applied_seq=0, stream_id="")


def test_stream_recreated_needs_both_identities() -> None:
    """Only two known, different stream identities mean the stream was re-created."""
    assert policy.stream_recreated("a", "b")
    assert not policy.stream_recreated("a", "a")
    assert not policy.stream_recreated("", "b")
    assert not policy.stream_recreated("a", "")


# ------------------------------------------------------------------------------------------------- members


def _live(table: dict[str, tuple[str, int]]) -> policy.LiveWorker:
    return table.get


def test_a_registered_member_is_left_alone() -> None:
    """A member with a registry key needs nothing."""
    assert policy.reconcile_member("w1", "m", {"w1"}, _live({"w1": ("m", 3)})) is None


def test_a_member_without_a_key_live_in_the_index_is_removed() -> None:
    """A member with no key but live in the index is removed with the index's model and highest epoch."""
    assert policy.reconcile_member("w1", "old", set(), _live({"w1": ("m", 3)})) == Removal(
        "w1", "m", 3, "not registered"
    )
    assert policy.reconcile_member("w1", "old", set(), _live({"w1": ("", 0)})) == Removal(
        "w1", "old", 0, "not registered"
    )


def test_a_member_without_a_key_not_in_the_index_is_forgotten() -> None:
    """A member neither registered nor live in the index is forgotten."""
    assert policy.reconcile_member("w1", "m", {"w2"}, _live({})) == Forget("w1")


def test_a_deleted_key_removes_the_worker_with_its_last_record() -> None:
    """A deleted key publishes the removal with the last record's model and incarnation; an aged-out one
    says expired."""
    live = _live({"w1": ("m-index", 2)})
    assert policy.removal_on_delete("w1", "DEL", _Record("m", 5), live) == Removal("w1", "m", 5, "deleted")
    assert policy.removal_on_delete("w1", "PURGE", _Record("m", 5), live) == Removal("w1", "m", 5, "expired")
    assert policy.removal_on_delete("w1", "PURGE", None, live) == Removal("w1", "m-index", 2, "expired")


def test_a_deleted_key_of_a_worker_not_live_publishes_nothing() -> None:
    """A worker never indexed, or already removed, needs no removal."""
    assert policy.removal_on_delete("w9", "DEL", _Record("m", 1), _live({})) is None


def test_registry_sync_tracks_keys_until_the_end_marker() -> None:
    """Keys put and deleted before the end-of-initial marker make the registered set; later ones do not."""
    sync = policy.RegistrySync()
    sync.seen("a", present=True)
    sync.seen("b", present=True)
    sync.seen("a", present=False)
    assert sync.end_of_initial() is True
    sync.seen("c", present=True)
    sync.seen("b", present=False)
    assert sync.end_of_initial() is False
    assert sync.registered == {"b"}


# ------------------------------------------------------------------------------------------------- match


def test_packed_tokens_unpack_as_little_endian_uint32() -> None:
    """Bytes of little-endian uint32 give the token ids; a length not a multiple of 4 is a bad request."""
    assert list(policy.unpack_tokens(bytes([1, 0, 0, 0, 0, 1, 0, 0, 255, 255, 255, 255]))) == [
        1,
        256,
        2**32 - 1,
    ]
    assert list(policy.unpack_tokens(b"")) == []
    with pytest.raises(RequestError) as err:
        policy.unpack_tokens(b"\x01\x02\x03")
    assert err.value.field == "token_ids"
    assert "got 3 bytes" in str(err.value)


def test_the_match_reply_rows_carry_health_only_when_set() -> None:
    """Each candidate is [worker, rank, overlap, cached, tiers, block_size] plus health only when not exact."""
    result = MatchResult(
        index_seq=9,
        block_size=4,
        prompt_blocks=3,
        candidates=(
            HolderMatch(worker_id="a", dp_rank=0, overlap_blocks=3, cached_blocks=5, block_size=4),
            HolderMatch(
                worker_id="b",
                dp_rank=1,
                overlap_blocks=1,
                cached_blocks=2,
                tiers={"CPU": 1},
                block_size=4,
                health="gap",
            ),
        ),
    )
    wire = protocol.encode(policy.match_reply(result, "r1"), format="msgpack")
    assert msgspec.msgpack.decode(wire) == {
        "index_seq": 9,
        "block_size": 4,
        "prompt_blocks": 3,
        "replica": "r1",
        "candidates": [["a", 0, 3, 5, None, 4], ["b", 1, 1, 2, {"CPU": 1}, 4, "gap"]],
    }
