"""The ingest's outbox policy without sockets or an event loop: coalescing, splitting, the bounded outbox with
drop-oldest and its overflow clear, the ack window and the re-send order."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest

from kvmesh.core.events import (
    Cleared,
    Event,
    EventsMessage,
    Placed,
    Removed,
    Stored,
    decode_message,
    encode_message,
)
from kvmesh.core.index import Holder
from kvmesh.core.sequencing import Inversion
from kvmesh.ingest.outbox import (
    PAYLOAD_HEADROOM,
    AckWindow,
    Coalesced,
    Coalescer,
    MessageIds,
    Outbox,
    Outgoing,
    ack_seq,
    encode_under,
    split_events,
)

A = Holder("w", 0)
H = 2**60
"""Hashes from here encode in 9 bytes each."""
B = Holder("w", 1)


@dataclass
class FakeAck:
    """A settled or pending publish ack: ``seq`` a stream sequence, ``error`` a failure, neither: pending."""

    seq: int | None = None
    error: BaseException | None = None
    was_cancelled: bool = False

    def done(self) -> bool:
        return self.was_cancelled or self.seq is not None or self.error is not None

    def cancelled(self) -> bool:
        return self.was_cancelled

    def exception(self) -> BaseException | None:
        return self.error

    def result(self) -> Any:
        assert self.seq is not None
        return self.seq

    def cancel(self) -> bool:
        if self.done():
            return False
        self.was_cancelled = True
        return True


def out(holder: Holder, seq: int, epoch: int = 0) -> Outgoing:
    """A message of ``holder`` at engine seq ``seq`` (id ``holder-dp:seq``)."""
    return Outgoing("s", f"{holder[1]}:{seq}", b"x", holder, epoch, seq)


def clear_of(holder: Holder, epoch: int, seq: int) -> Outgoing:
    """The overflow clear `Outbox.next` is given to build."""
    return Outgoing("s", f"clear {holder[1]}:{seq}", b"c", holder, epoch, seq)


def ids(box: Outbox) -> list[str]:
    return [o.msg_id for o in box.queue]


# ---------------------------------------------------------------------------------------------- coalescing


def test_consecutive_batches_of_one_rank_coalesce_until_the_batch_bound() -> None:
    """With --max-coalesced-batches 3, engine seqs 0-4 become one message of seqs 0-2 and a pending 3-4."""
    c = Coalescer(max_batches=3)
    ev: list[Event] = [Cleared("engine")]
    assert [c.add(0, 0, seq, ev, ts=float(seq)) for seq in range(3)] == [None, None, None]
    assert c.add(0, 0, 3, ev, ts=3.0) == Coalesced(0, 0, 0, 2, 2.0, ev * 3)
    assert c.add(0, 0, 4, [], ts=4.0) is None
    assert c.take() == Coalesced(0, 0, 3, 4, 4.0, ev)
    assert (c.take(), c.key, c.events) == (None, None, [])


def test_a_new_epoch_or_dp_rank_cuts_the_coalesced_message() -> None:
    """A batch under another epoch, then another dp_rank, each cut what is pending before it."""
    c = Coalescer(max_batches=64)
    assert c.add(0, 0, 5, [], ts=1.0) is None
    assert c.add(0, 1, 0, [], ts=2.0) == Coalesced(0, 0, 5, 5, 1.0, [])
    assert c.add(1, 1, 1, [], ts=3.0) == Coalesced(0, 1, 0, 0, 2.0, [])
    assert c.take() == Coalesced(1, 1, 1, 1, 3.0, [])


def test_the_event_bound_cuts_the_coalesced_message() -> None:
    """With 4 events at most, a third 2-event batch starts a new message after the first two batches."""
    c = Coalescer(max_batches=64, max_events=4)
    ev: list[Event] = [Removed([1]), Removed([2])]
    assert c.add(0, 0, 0, ev, ts=0.0) is None
    assert c.add(0, 0, 1, ev, ts=0.0) is None
    assert c.add(0, 0, 2, ev, ts=0.0) == Coalesced(0, 0, 0, 1, 0.0, ev * 2)


# ---------------------------------------------------------------------------------------------- splitting


def test_split_cuts_long_removals_and_stored_runs_within_the_bound() -> None:
    """A 150,000-hash BlockRemoved and a 5,000-block BlockStored split into parts, the chain intact."""
    stored_ev = Stored(list(range(5000)), None, list(range(10_000, 15_000)))
    removed_ev = Removed(list(range(20_000, 170_000)))
    parts = split_events([stored_ev, removed_ev], 10)
    flat = [e for part in parts for e in part]
    assert sum(len(e.engine_hashes) for e in flat if isinstance(e, Removed)) == 150_000
    stores = [e for e in flat if isinstance(e, Stored)]
    assert [h for e in stores for h in e.engine_hashes] == list(range(5000))
    assert all(b.parent == a.engine_hashes[-1] for a, b in itertools.pairwise(stores))
    assert stores[0].parent is None
    weights = [
        sum(
            2 * len(e.engine_hashes) if isinstance(e, Stored) else len(e.engine_hashes)
            for e in part
            if isinstance(e, Stored | Removed)
        )
        for part in parts
    ]
    assert max(weights) <= -(-160_000 // 10)
    assert len(parts) == 11  # "about" parts: the stored run fills the first part exactly, then 10 of removals


def msg(events: list[Any]) -> EventsMessage:
    return EventsMessage(worker_id="w", dp_rank=0, model="m", block_size=4, epoch=2, seq=9, events=events)


def test_a_message_that_fits_is_encoded_whole_under_its_id() -> None:
    """A 3-block Stored under a 1 MiB payload is one part, id unchanged, not split."""
    m = msg([Stored([1, 2, 3], None, [4, 5, 6])])
    assert encode_under(m, "id", 1 << 20) == ([("id", encode_message(m))], False)


def test_split_cuts_long_placements_on_their_tier() -> None:
    """A 30,000-hash Placed (CPU copies) splits into Placed pieces of 3,000 on the CPU tier, in order."""
    parts = split_events([Placed(list(range(30_000)), "CPU")], 10)
    flat = [e for part in parts for e in part if isinstance(e, Placed)]
    assert len(flat) == sum(len(part) for part in parts) and all(e.medium == "CPU" for e in flat)
    assert [len(e.engine_hashes) for e in flat] == [3000] * 10
    assert [h for e in flat for h in e.engine_hashes] == list(range(30_000))


def test_an_oversized_message_is_split_into_parts_that_fit_with_the_chain_intact() -> None:
    """A 4,000-block Stored (72,122 bytes) under a 40 KiB payload becomes parts 0-3 with ids id:0-3, each within
    the payload less the headroom, holding all 4,000 blocks in order, each part's parent the previous part's last
    block."""
    m = msg([Stored([H + i for i in range(4000)], 77, [H + i for i in range(5000, 9000)])])
    parts, split = encode_under(m, "id", 40 * 1024 + PAYLOAD_HEADROOM)
    assert (split, len(parts)) == (
        True,
        4,
    )  # ceil(72,122 / 40,960) + 1 = 3 target parts of 2,667: 1,333 blocks
    decoded = [decode_message(data) for _, data in parts]
    assert [i for i, _ in parts] == [f"id:{n}" for n in range(len(parts))]
    assert all(len(data) <= 40 * 1024 for _, data in parts)
    assert all(
        isinstance(d, EventsMessage) and (d.part, d.epoch, d.seq) == (n, 2, 9) for n, d in enumerate(decoded)
    )
    stores = [e for d in decoded if isinstance(d, EventsMessage) for e in d.events if isinstance(e, Stored)]
    assert [h for e in stores for h in e.engine_hashes] == [H + i for i in range(4000)]
    assert [len(e.engine_hashes) for e in stores] == [1333, 1333, 1333, 1]
    assert [e.parent for e in stores] == [77] + [e.engine_hashes[-1] for e in stores[:-1]]


# ---------------------------------------------------------------------------------------------- ids


def test_message_ids_carry_the_nonce_and_a_serial_for_ingest_made_messages() -> None:
    """Batch ids are worker:dp:epoch:seq:nonce; ingest-made and re-sent ids add a serial that rises."""
    m = MessageIds("ab12")
    assert m.batch("w", 1, 2, 3) == "w:1:2:3:ab12"
    assert m.unique("w", 1, 2, None, "hello") == "w:1:2:None:hello:ab12:1"
    assert m.again("w:1:2:3:ab12") == "w:1:2:3:ab12:again2"
    assert m.unique("w", 0, 0, 5, "overflow") == "w:0:0:5:overflow:ab12:3"


# ---------------------------------------------------------------------------------------------- outbox


def test_a_full_outbox_drops_the_oldest_and_reports_the_first_drop_per_holder() -> None:
    """Limit 2: pushing A0 A1 B0 B1 drops A0 (first of A), A1 (not first), keeps B0 B1, marks A at seq 1."""
    box = Outbox(limit=2)
    assert box.push(out(A, 0)) == []
    assert box.push(out(A, 1)) == []
    assert [(o.msg_id, first) for o, first in box.push(out(B, 0))] == [("0:0", True)]
    assert [(o.msg_id, first) for o, first in box.push(out(B, 1))] == [("0:1", False)]
    assert ids(box) == ["1:0", "1:1"]
    assert (box.overflowed, box.queued[A], box.queued[B]) == ({A: (0, 1)}, 0, 2)


def test_the_overflow_clear_goes_out_at_once_when_none_of_the_holders_messages_is_left() -> None:
    """A dropped entirely: `next` puts A's one overflow clear (at A's last dropped seq) before B's messages."""
    box = Outbox(limit=2)
    for o in (out(A, 0), out(A, 1), out(B, 0), out(B, 1)):
        box.push(o)
    first = box.next(clear_of)
    assert first is not None and first.msg_id == "clear 0:1"
    assert (ids(box), box.overflowed, box.queued[A]) == (["clear 0:1", "1:0", "1:1"], {}, 1)
    box.pop()
    nxt = box.next(clear_of)
    assert nxt is not None and nxt.msg_id == "1:0"  # one clear only


def test_the_overflow_clear_waits_until_the_holders_next_message_is_at_the_front() -> None:
    """Limit 3, A0 B0 A1 B1: A0 is dropped; the clear waits behind B0 and goes right before A1."""
    box = Outbox(limit=3)
    for o in (out(A, 0), out(B, 0), out(A, 1), out(B, 1)):
        box.push(o)
    first = box.next(clear_of)
    assert first is not None and first.msg_id == "1:0"
    box.pop()
    second = box.next(clear_of)
    assert second is not None and second.msg_id == "clear 0:0"
    assert ids(box) == ["clear 0:0", "0:1", "1:1"]


def test_a_message_dropped_at_the_front_marks_its_holder_for_a_clear() -> None:
    """`drop_front` (a payload the server refuses) takes A3 for good and marks A at (epoch 1, seq 3)."""
    box = Outbox(limit=4)
    box.push(out(A, 3, epoch=1))
    box.push(out(B, 0))
    assert box.drop_front().msg_id == "0:3"
    assert (box.overflowed, box.queued[A], len(box), box.idle) == ({A: (1, 3)}, 0, 1, False)
    box.pop()
    assert not box.idle  # the clear is still due
    assert box.next(clear_of) is not None and box.overflowed == {}


# ---------------------------------------------------------------------------------------------- acks


def window_of(*entries: tuple[Outgoing, FakeAck]) -> AckWindow[FakeAck]:
    w: AckWindow[FakeAck] = AckWindow()
    for i, (o, a) in enumerate(entries):
        w.sent(o, a, now=float(i))
    return w


def test_ack_seq_reads_a_settled_publish_only() -> None:
    """Stream seq 7 of a settled ack; None while pending, failed or cancelled; a PubAck-like's ``seq``."""

    @dataclass
    class PubAck:
        seq: int

    assert ack_seq(FakeAck(7)) == 7
    assert ack_seq(FakeAck()) is None
    assert ack_seq(FakeAck(error=TimeoutError())) is None
    assert ack_seq(FakeAck(was_cancelled=True)) is None
    settled = FakeAck()
    settled.seq = 0
    assert ack_seq(settled) == 0

    class Wrapped(FakeAck):
        def result(self) -> Any:
            return PubAck(11)

    assert ack_seq(Wrapped(1)) == 11


def test_acks_in_order_count_published_and_stop_at_a_pending_one() -> None:
    """Acks 10, 11, then a pending one: 2 published, the pending one stays at the front, nothing to re-send."""
    w = window_of((out(A, 0), FakeAck(10)), (out(A, 1), FakeAck(11)), (out(A, 2), FakeAck()))
    got = w.take_acks(now=2.5, ack_timeout_s=5.0)
    assert (got.published, got.inversions, got.failed, got.overdue, got.resend) == (2, [], None, None, False)
    assert [o.seq for o, _, _ in w.inflight] == [2]


def test_an_ack_overdue_past_the_timeout_asks_for_a_resend() -> None:
    """The front message sent at t=0 is overdue at t=5.01 with a 5 s timeout, not at t=5.0."""
    w = window_of((out(A, 0), FakeAck()))
    assert w.take_acks(now=5.0, ack_timeout_s=5.0).overdue is None
    got = w.take_acks(now=5.01, ack_timeout_s=5.0)
    assert got.overdue is not None and got.overdue.seq == 0 and got.resend


def test_a_failed_ack_stops_the_take_and_stays_at_the_front() -> None:
    """Ack 10, a failure, ack 12: 1 published, the failure reported with its error, two left in the window."""
    err = TimeoutError("lost")
    w = window_of((out(A, 0), FakeAck(10)), (out(A, 1), FakeAck(error=err)), (out(A, 2), FakeAck(12)))
    got = w.take_acks(now=0.0, ack_timeout_s=5.0)
    assert got.published == 1 and got.failed is not None
    assert (got.failed[0].seq, got.failed[1], got.resend) == (1, err, True)
    assert [o.seq for o, _, _ in w.inflight] == [1, 2]


def test_an_ack_below_its_holders_top_is_a_repair_and_is_not_counted() -> None:
    """A's seq 1 stored at stream seq 20, seq 2 at 15: an inversion is reported, seq 2 goes to repairs."""
    w = window_of((out(A, 1), FakeAck(20)), (out(B, 0), FakeAck(21)), (out(A, 2), FakeAck(15)))
    got = w.take_acks(now=0.0, ack_timeout_s=5.0)
    assert got.published == 2
    assert [(o.seq, inv) for o, inv in got.inversions] == [
        (2, Inversion(earlier=(0, 1, 20), later=(0, 2, 15)))
    ]
    assert [(o.seq, s) for o, s in w.take_repairs()] == [(2, 15)]
    assert w.repairs == []


def test_serial_mode_allows_one_outstanding_message_and_counts_down_with_acks() -> None:
    """After a requeue of 2, the window room is 1 until two acks came; then it is the configured window."""
    w = window_of((out(A, 0), FakeAck()), (out(A, 1), FakeAck()))
    w.requeue(Outbox(limit=10))
    assert (w.serial, w.room(64)) == (2, 1)
    w.sent(out(A, 0), FakeAck(5), now=0.0)
    w.take_acks(now=0.0, ack_timeout_s=5.0)
    w.sent(out(A, 1), FakeAck(6), now=0.0)
    w.take_acks(now=0.0, ack_timeout_s=5.0)
    assert (w.serial, w.room(64)) == (0, 64)


def test_requeue_puts_the_window_back_in_order_keeping_what_was_stored() -> None:
    """Window A0 (stored 10), A1 (pending), B0 (failed) before an outbox holding A2: the outbox becomes
    A0 A1 B0 A2; A0 keeps stream seq 10, A1's ack is cancelled, 2 messages go out again."""
    box = Outbox(limit=10)
    box.push(out(A, 2))
    pending = FakeAck()
    w = window_of((out(A, 0), FakeAck(10)), (out(A, 1), pending), (out(B, 0), FakeAck(error=OSError())))
    assert w.requeue(box) == 2
    assert ids(box) == ["0:0", "0:1", "1:0", "0:2"]
    assert [o.stored_seq for o in box.queue] == [10, None, None, None]
    assert (pending.was_cancelled, len(w), w.serial, box.queued[A], box.queued[B]) == (True, 0, 3, 3, 1)


def test_overtakers_are_the_stored_messages_after_an_unstored_one_of_their_holder() -> None:
    """A0 failed, B0 stored, A1 stored, A2 pending, A3 stored: A1 (index 2) and A3 (index 4) overtook A0."""
    w = window_of(
        (out(A, 0), FakeAck(error=OSError())),
        (out(B, 0), FakeAck(30)),
        (out(A, 1), FakeAck(31)),
        (out(A, 2), FakeAck()),
        (out(A, 3), FakeAck(33)),
    )
    assert [(i, o.seq, s) for i, o, s in w.overtakers()] == [(2, 1, 31), (4, 3, 33)]


def test_an_overtaker_marked_unsent_is_sent_again_after_the_failed_one() -> None:
    """A0 failed, A1 stored at 31 then deleted (marked unsent): the requeue sends both again, A0 first."""
    w = window_of((out(A, 0), FakeAck(error=OSError())), (out(A, 1), FakeAck(31)))
    for i, _, _ in list(w.overtakers()):
        w.unsent(i, FakeAck(was_cancelled=True))
    box = Outbox(limit=10)
    assert w.requeue(box) == 2
    assert [(o.msg_id, o.stored_seq) for o in box.queue] == [("0:0", None), ("0:1", None)]


def test_repaired_messages_go_back_first_in_engine_order_and_serially() -> None:
    """Repairs A2, A3 put back (in reverse) ahead of 1 requeued message: order A2 A3 then it; serial 3."""
    box = Outbox(limit=10)
    box.push(out(B, 0))
    w: AckWindow[FakeAck] = AckWindow()
    a2, a3 = out(A, 2), out(A, 3)
    a2.stored_seq, a3.stored_seq = 40, 41
    for o in (a3, a2):
        w.put_back(box, o)
    w.after_repair(repairs=2, waiting=1)
    assert [(o.msg_id, o.stored_seq) for o in box.queue] == [("0:2", None), ("0:3", None), ("1:0", None)]
    assert w.serial == 3


@pytest.mark.parametrize("window", [1, 8])
def test_room_is_the_configured_window_when_not_serial(window: int) -> None:
    """A fresh window's room is --max-pending-acks (1 or 8)."""
    assert AckWindow[FakeAck]().room(window) == window
