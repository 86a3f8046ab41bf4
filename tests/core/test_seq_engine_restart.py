"""`SeqTracker.on_engine_restarted`: a replay showing another batch at the cursor starts a new epoch from 0."""

from __future__ import annotations

from kvmesh.core.sequencing import Deliver, NewEpoch, ReplayDone, SeqTracker, StartReplay


def test_engine_restart_found_by_replay_replays_the_new_incarnation_from_zero() -> None:
    """Cursor (0, 1), live seq 3 → replay; restart found → epoch 1, replay 0-2, then live 3, healed."""
    t = SeqTracker(epoch=0, last_seq=1)
    assert t.on_live(3, b"l3") == [StartReplay(2)]
    assert t.on_engine_restarted() == [NewEpoch(1, 0), StartReplay(0)]
    assert (t.epoch, t.last_seq, t.replaying, t.stats.restarts) == (1, -1, True, 1)
    got = [a for seq in range(3) for a in t.on_replay(seq, b"r%d" % seq)]
    assert got == [
        Deliver(0, b"r0"),
        Deliver(1, b"r1"),
        Deliver(2, b"r2"),
        Deliver(3, b"l3"),
        ReplayDone(True),
    ]
    assert (t.epoch, t.last_seq, t.replaying) == (1, 3, False)
