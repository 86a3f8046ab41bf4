"""`SeqTracker.rejoin`: a new incarnation chosen by the ingest keeps the cursor and only rises."""

from __future__ import annotations

import pytest

from kvmesh.core.sequencing import Deliver, SeqTracker


def test_rejoin_raises_the_epoch_and_keeps_the_cursor() -> None:
    """A tracker at epoch 2 seq 7 rejoining as epoch 5 delivers seq 8 next under epoch 5, no gap counted."""
    t = SeqTracker(epoch=2, last_seq=7)
    t.rejoin(5)
    assert (t.epoch, t.last_seq) == (5, 7)
    assert t.on_live(8, b"p") == [Deliver(8, b"p")]
    assert (t.epoch, t.stats.gaps, t.stats.restarts) == (5, 0, 0)


@pytest.mark.parametrize("epoch", [2, 1])
def test_rejoin_refuses_an_epoch_not_above_the_current_one(epoch: int) -> None:
    """Rejoining a tracker at epoch 2 as epoch 2 or 1 is a ValueError naming both, and the epoch stays 2."""
    t = SeqTracker(epoch=2, last_seq=7)
    with pytest.raises(ValueError, match=f"epoch {epoch} is not above the current epoch 2"):
        t.rejoin(epoch)
    assert t.epoch == 2
