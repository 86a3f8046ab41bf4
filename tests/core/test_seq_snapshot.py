"""The sequence tracker with vLLM's publisher epochs and snapshot socket (PR #57789), and its frame codec."""

from __future__ import annotations

import uuid

import pytest

from kvmesh.core.engine_snapshot import (
    SnapshotReply,
    decode_seq_frame,
    decode_snapshot_reply,
    encode_snapshot_reply,
)
from kvmesh.core.errors import WireError
from kvmesh.core.sequencing import (
    Deliver,
    NewEpoch,
    Rebuild,
    ReplayDone,
    Resync,
    SeqTracker,
    StartReplay,
    StartSnapshot,
)

A, B = uuid.UUID(int=1).bytes, uuid.UUID(int=2).bytes


def test_seq_frames_of_8_and_24_bytes_decode_and_others_are_refused() -> None:
    """An 8-byte frame has no epoch; a 24-byte one carries its last 16 bytes; 0, 16 or 25 bytes are errors."""
    assert decode_seq_frame((7).to_bytes(8, "big")) == (7, None)
    assert decode_seq_frame((2**64 - 2).to_bytes(8, "big") + A) == (2**64 - 2, A)
    for n in (0, 16, 25):
        with pytest.raises(WireError):
            decode_seq_frame(b"\x00" * n)


def test_snapshot_replies_decode_cut_epoch_and_chunks() -> None:
    """A reply round-trips; -1 is an empty state; ≤ -2 is unavailable with its chunks dropped; a short or
    malformed reply is a WireError."""
    assert decode_snapshot_reply(encode_snapshot_reply(5, A, [b"c1", b"c2"])) == SnapshotReply(
        5, A, (b"c1", b"c2")
    )
    empty = decode_snapshot_reply(encode_snapshot_reply(-1, A))
    assert (empty.cut, empty.available, empty.chunks) == (-1, True, ())
    gone = decode_snapshot_reply(encode_snapshot_reply(-2, A, [b"junk"]))
    assert (gone.cut, gone.available, gone.chunks) == (-2, False, ())
    with pytest.raises(WireError):
        decode_snapshot_reply([(1).to_bytes(8, "big")])
    with pytest.raises(WireError):
        decode_snapshot_reply([b"\x01", A])


def test_a_new_epoch_is_a_restart_even_when_the_sequence_rises() -> None:
    """Epoch A seqs 0, 1; epoch B seq 2 → new epoch 1, delivered as its first batch; the same epoch again
    continues; an 8-byte frame after a 24-byte one is another publisher too."""
    t = SeqTracker()
    assert t.on_live(0, b"a0", A) == [Deliver(0, b"a0")]
    assert t.on_live(1, b"a1", A) == [Deliver(1, b"a1")]
    assert t.on_live(2, b"b2", B) == [NewEpoch(1, 2), Deliver(2, b"b2")]
    assert t.on_live(3, b"b3", B) == [Deliver(3, b"b3")]
    assert t.on_live(4, b"n4") == [NewEpoch(2, 4), Deliver(4, b"n4")]
    assert (t.epoch, t.stats.restarts, t.stats.gaps) == (2, 2, 0)


def test_a_gap_with_a_snapshot_socket_rebuilds_and_delivers_what_follows_the_cut() -> None:
    """Cursor 1, live 4 → snapshot; live 5 and 6 wait; cut 5 → rebuild at 5 after 1, then 6 is delivered; a
    stale token's answer is ignored."""
    t = SeqTracker(last_seq=1, snapshot=True, replay=True)
    assert t.on_live(4, b"l4", A) == [StartSnapshot(1)]
    assert t.on_live(5, b"l5", A) == []
    assert t.on_live(6, b"l6", A) == []
    assert t.on_snapshot(0, 9) == []  # an earlier request's answer
    assert t.on_snapshot(1, 5) == [Rebuild(5, 1), Deliver(6, b"l6")]
    assert (t.last_seq, t.snapshotting, t.pending) == (6, False, {})
    assert (t.stats.gaps, t.stats.snapshots, t.stats.rebuilds, t.stats.replays, t.stats.resyncs) == (
        1,
        1,
        1,
        0,
        0,
    )
    assert t.on_live(7, b"l7", A) == [Deliver(7, b"l7")]


def test_an_unusable_snapshot_falls_back_to_replay_or_to_a_resync() -> None:
    """Unavailable (-2) with a replay socket → replay from the cursor; a cut short of the waiting batch without
    one → resync after the cursor and the waiting batch delivered."""
    t = SeqTracker(last_seq=1, snapshot=True, replay=True)
    assert t.on_live(4, b"l4") == [StartSnapshot(1)]
    assert t.on_snapshot(1, -2) == [StartReplay(2)]
    assert [a for s in (2, 3) for a in t.on_replay(s, b"r%d" % s)] == [
        Deliver(2, b"r2"),
        Deliver(3, b"r3"),
        Deliver(4, b"l4"),
        ReplayDone(True),
    ]
    assert (t.stats.snapshot_failures, t.stats.replays, t.stats.resyncs) == (1, 1, 0)

    u = SeqTracker(last_seq=1, snapshot=True, replay=False)
    assert u.on_live(4, b"l4") == [StartSnapshot(1)]
    assert u.on_snapshot(1, 2) == [Resync("snapshot_behind", 1), Deliver(4, b"l4"), ReplayDone(False)]
    assert u.on_snapshot_failed(1, "snapshot_timeout") == []  # already answered
    assert (u.stats.snapshot_failures, u.stats.resyncs, u.last_seq) == (1, 1, 4)


def test_a_restart_past_seq_0_rebuilds_from_the_snapshot_and_one_at_0_does_not() -> None:
    """Epoch A up to seq 3, then epoch B first seen at seq 2 → new epoch and a snapshot (cut 2: rebuild, nothing
    before it); a failed one replays the new incarnation from 0. A restart seen at seq 0 only delivers."""
    t = SeqTracker(snapshot=True, replay=True)
    for s in range(4):
        t.on_live(s, b"a", A)
    assert t.on_live(2, b"b2", B) == [NewEpoch(1, 2), StartSnapshot(1)]
    assert t.on_snapshot(1, 2) == [Rebuild(2, None)]
    assert (t.epoch, t.last_seq) == (1, 2)

    u = SeqTracker(snapshot=True, replay=True)
    u.on_live(0, b"a", A)
    assert u.on_live(3, b"b3", B) == [NewEpoch(1, 3), StartSnapshot(1)]
    assert u.on_snapshot_failed(1, "snapshot_timeout") == [StartReplay(0)]
    assert (u.last_seq, u.replaying) == (-1, True)

    v = SeqTracker(snapshot=True)
    v.on_live(0, b"a", A)
    assert v.on_live(0, b"b0", B) == [NewEpoch(1, 0), Deliver(0, b"b0")]
