"""A block removed while it waits for its parent stays removed, through the real pipeline (nats-server, a ZMQ
publisher, an ingest, an indexer and a local-index router; the services run as tasks).

The engine stores block 2 under block 1, which the index does not have yet, so block 2 is held; the engine
then evicts block 2 and stores block 1. The engine holds block 1 only: every replica must answer 1 block for
the prompt, not 2 (the held block 2 used to attach with its parent and be counted).
"""

from __future__ import annotations

import pytest
from tests.pipeline import eventually
from tests.test_ingest_faults import ANY, BS, T, blk, clean_pipeline, removed, snapshot, stored

from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.e2e]


async def test_a_held_block_the_engine_removed_does_not_come_back_with_its_parent(
    nats_url: str, uid: str
) -> None:
    pub = EventPublisher(ANY, ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await p.start_ingest("w", pub.endpoint, pub.replay_endpoint, block_size=BS)
            await pub.wait_for_subscribers(1)
            indexer = await p.start_indexer()
            await p.start_router()
            pub.publish([stored([2], blk(T, 1), parent=1)])  # held: block 1 is not indexed
            pub.publish([removed(2)])
            pub.publish([stored([1], blk(T, 0))])
            got = await eventually(lambda: snapshot(p, [T]), lambda r: r == [{"w/0": 1}], timeout_s=30)
            assert got == [{"w/0": 1}]
            assert (indexer.state.block_total(), indexer.state.counters.unknown_removals) == (1, 1)
    finally:
        pub.close()
