"""A holder's messages stored out of engine order, or twice, in a real JetStream stream: a real indexer replica
refuses them, keeps the engine's picture, and says which holder is no longer exact."""

from __future__ import annotations

import pytest
from tests.indexers import BS, MODEL, group, wait_for

from kvmesh.core.events import Event, EventsMessage, Removed, Stored, encode_message
from kvmesh.core.hashing import local_block_hashes
from kvmesh.core.protocol import MatchHolder
from kvmesh.runtime import subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

TOKENS = list(range(500, 516))  # 4 blocks
LOCAL = local_block_hashes(TOKENS, BS)


def _store(i: int) -> Stored:
    return Stored([10 + i], None if i == 0 else 10 + i - 1, LOCAL[i : i + 1])


def _msg(worker: str, seq: int, events: list[Event]) -> EventsMessage:
    return EventsMessage(
        worker_id=worker, dp_rank=0, model=MODEL, block_size=BS, epoch=0, seq=seq, events=events
    )


async def test_reordered_and_repeated_messages_are_refused_by_a_replica(nats_url: str, uid: str) -> None:
    """Engine seqs landing after later ones (a failover re-send) are held and applied in engine order, and a
    repeat beyond the duplicate window is ignored: the replica's overlaps equal the engine's, both exact."""
    # "r": the engine stored blocks 0 and 1, then evicted block 1 (truth: 1 block); its seq 1 is stored
    # after seq 2, as a publish re-sent after a stream leader election lands.
    # "d": the engine stored 0 and 1, evicted 1, stored 1 again (truth: 2 blocks); its seq 2 is stored again
    # at the end under another message id (an outage longer than the duplicate window).
    engine: dict[str, list[list[Event]]] = {
        "r": [[_store(0)], [_store(1)], [Removed([11])]],
        "d": [[_store(0)], [_store(1)], [Removed([11])], [_store(1)]],
    }
    stream = [("r", 0), ("r", 2), ("r", 1), ("d", 0), ("d", 1), ("d", 2), ("d", 3), ("d", 2)]
    async with group(nats_url, uid) as g:
        a = await g.start(f"{uid}-a")
        for worker, seq in stream:
            await g.js.publish(
                subjects.events_subject(g.prefix, MODEL, worker, 0),
                encode_message(_msg(worker, seq, engine[worker][seq])),
                stream=g.stream,
            )

        async def applied() -> int:
            return int(a.state.applied_seq)

        await wait_for(applied, lambda s: s == len(stream))
        reply = await g.match(f"r{uid}.match", TOKENS)
        assert reply.candidates == [MatchHolder("d", 0, 2, 2, None, 4), MatchHolder("r", 0, 1, 1, None, 4)]
        assert a.state.holder_health() == {}
        assert a.status()["holder_health"] == {}
        c = a.state.counters
        assert (c.held_messages, c.out_of_order, c.duplicate_messages, c.sequence_gaps) == (1, 0, 1, 0)
