"""`kvmesh.core.sequencing.StreamOrder`: a holder's publish acks, taken in engine order, must rise."""

from __future__ import annotations

from kvmesh.core.index import Holder
from kvmesh.core.sequencing import Inversion, StreamOrder

A = Holder("w", 0)
B = Holder("w", 1)


def test_rising_acks_and_duplicates_of_the_same_sequence_need_no_resync() -> None:
    """Acks 1, 2, 2 (a duplicate carries the original's stream seq), 5 of one holder reveal nothing."""
    order = StreamOrder()
    assert order.holders_to_resync([(A, 0, 0, 1), (A, 0, 1, 2), (A, 0, 1, 2), (A, 0, 2, 5)]) == []


def test_a_head_stored_after_later_messages_is_an_inversion_reported_once() -> None:
    """Engine seqs 5..9 of A stored as 14, 10, 11, 12, 13 (5 re-sent last): one inversion, only A resyncs."""
    order = StreamOrder()
    acks = [
        (A, 0, 4, 9),
        (B, 0, 0, 3),
        (A, 0, 5, 14),
        (A, 0, 6, 10),
        (B, 0, 1, 4),
        (A, 0, 7, 11),
        (A, 0, 8, 12),
    ]
    assert order.holders_to_resync(acks) == [A]
    assert order.on_ack(A, 0, 9, 13) is None  # same incident: below the same top
    assert order.on_ack(A, 0, 9, 15) is None  # the resync lands above everything: in order again
    assert order.on_ack(A, 0, 10, 15) is None
    assert order.on_ack(A, 0, 11, 7) == Inversion(earlier=(0, 10, 15), later=(0, 11, 7))


def test_inversion_names_both_messages() -> None:
    """The inversion gives (epoch, engine seq, stream seq) of the earlier message and of the later one."""
    order = StreamOrder()
    assert order.on_ack(A, 2, 1522, 900) is None
    assert order.on_ack(A, 2, 1581, 100) == Inversion(earlier=(2, 1522, 900), later=(2, 1581, 100))
