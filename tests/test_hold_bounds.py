"""Bounds of the index's hold (messages past a gap in a holder's engine sequence) in a real replica fed from
a real JetStream stream: a hold that is given up costs linear time, and a hold whose holder goes quiet is
still given up once the stream moves on."""

from __future__ import annotations

import asyncio
import time

import pytest
from tests.indexers import BS, MODEL, group, wait_for

from kvmesh.core.events import Event, EventsMessage, Stored, encode_message
from kvmesh.core.state import HOLD_MAX_MESSAGES, IndexState
from kvmesh.indexer.service import IndexerService
from kvmesh.runtime import subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


def _msg(worker: str, seq: int, events: list[Event]) -> EventsMessage:
    return EventsMessage(
        worker_id=worker, dp_rank=0, model=MODEL, block_size=BS, epoch=0, seq=seq, events=events
    )


def _store(seq: int) -> list[Event]:
    return [Stored([1000 + seq], None, [5000 + seq])]


async def _catch_up(nats_url: str, uid: str, seqs: list[int]) -> tuple[float, IndexState]:
    """Store one holder's batches ``seqs`` in a fresh stream, then start a replica: (seconds it took to apply
    them all, its state)."""
    async with group(nats_url, uid) as g:
        subject = subjects.events_subject(g.prefix, MODEL, "h", 0)
        for chunk in range(0, len(seqs), 500):
            await asyncio.gather(
                *(
                    g.js.publish(subject, encode_message(_msg("h", s, _store(s))), stream=g.stream)
                    for s in seqs[chunk : chunk + 500]
                )
            )
        t0 = time.perf_counter()
        a: IndexerService = await g.start(f"{uid}-a")

        async def applied() -> int:
            return int(a.state.applied_seq)

        await wait_for(applied, lambda s: s == len(seqs), timeout_s=60)
        return time.perf_counter() - t0, a.state


async def test_a_hold_given_up_after_its_bound_costs_linear_time(nats_url: str, uid: str) -> None:
    """A holder whose engine seq 1 never lands holds the next HOLD_MAX_MESSAGES batches and then applies them
    with one gap; a replica works through that backlog in about the time of one without the gap (no cost
    per held message that grows with the hold)."""
    n = HOLD_MAX_MESSAGES + 50
    baseline, _ = await _catch_up(nats_url, f"{uid}b", list(range(n)))
    elapsed, state = await _catch_up(nats_url, uid, [0, *range(2, n + 1)])
    c = state.counters
    assert (c.held_messages, c.released_holds, c.sequence_gaps) == (HOLD_MAX_MESSAGES + 1, 1, 1)
    assert state.holder_health() == {("h", 0): "gap"}
    assert state.workers()["h"]["blocks"] == n  # seq 0 and seqs 2..n
    # Quadratic in the hold: about 4 s more than the baseline on an idle core; linear: a fraction of a second.
    assert elapsed < baseline + 1.5, f"{elapsed:.2f} s with the hold, {baseline:.2f} s without"


async def test_a_quiet_holders_hold_is_given_up_once_the_stream_moves_past_the_bound(
    nats_url: str, uid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder whose engine seq 1 never lands and that then goes quiet (its ingest killed -9 mid re-send)
    does not hold forever: once HOLD_MAX_STREAM_SEQS other messages pass, its held batch applies with the gap
    counted, the holder reads "gap", and no held message is left for snapshots to carry."""
    monkeypatch.setattr("kvmesh.core.state.HOLD_MAX_STREAM_SEQS", 200)
    async with group(nats_url, uid) as g:
        a = await g.start(f"{uid}-a")
        q = subjects.events_subject(g.prefix, MODEL, "q", 0)
        o = subjects.events_subject(g.prefix, MODEL, "o", 0)
        for seq in (0, 2):
            await g.js.publish(q, encode_message(_msg("q", seq, _store(seq))), stream=g.stream)

        async def applied() -> int:
            return int(a.state.applied_seq)

        await wait_for(applied, lambda s: s == 2)
        assert a.state.holder_health() == {("q", 0): "held"}
        await asyncio.gather(
            *(g.js.publish(o, encode_message(_msg("o", s, _store(s))), stream=g.stream) for s in range(250))
        )
        await wait_for(applied, lambda s: s == 252)
        c = a.state.counters
        assert (c.held_messages, c.released_holds, c.sequence_gaps) == (1, 1, 1)
        assert a.state.holder_health() == {("q", 0): "gap"}
        assert a.state.workers()["q"]["blocks"] == 2
        assert [w.held for w in a.state.export().workers] == [{}, {}]


async def test_a_message_whose_range_runs_backwards_is_refused_and_counted(nats_url: str, uid: str) -> None:
    """A stream message with ``first_seq`` above its ``seq`` (no ingest makes one) is refused and counted; it
    neither holds nor moves the holder's cursor, so the holder's real batches apply and it stays exact."""
    async with group(nats_url, uid) as g:
        a = await g.start(f"{uid}-a")
        subject = subjects.events_subject(g.prefix, MODEL, "x", 0)
        bad = EventsMessage(
            worker_id="x",
            dp_rank=0,
            model=MODEL,
            block_size=BS,
            epoch=0,
            seq=5,
            first_seq=10,
            events=_store(9),
        )
        stream = [_msg("x", 0, _store(0)), bad, *(_msg("x", s, _store(s)) for s in (1, 2, 3))]
        for m in stream:
            await g.js.publish(subject, encode_message(m), stream=g.stream)

        async def applied() -> int:
            return int(a.state.applied_seq)

        await wait_for(applied, lambda s: s == len(stream))
        assert a.state.holder_health() == {}
        assert a.state.workers()["x"]["blocks"] == 4
        c = a.state.counters
        assert (c.malformed_messages, c.held_messages, c.sequence_gaps) == (1, 0, 0)
