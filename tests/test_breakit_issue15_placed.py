"""Tokenless offload events (`Placed`) under bad input: one event naming a million hashes.

A real publisher (vLLM 0.23 layout), ingest, indexer and router on a real nats-server.
"""

from __future__ import annotations

import pytest
from tests.pipeline import eventually, overlaps
from tests.test_ingest_faults import ANY, clean_pipeline, stored
from tests.test_offload_placement import PROMPT, offloaded

from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

N = 1_000_000


async def test_a_placed_event_naming_a_million_hashes_is_split_and_counted(nats_url: str, uid: str) -> None:
    """CPU copies of 1M blocks the engine never reported plus the 4 it did, in one event (about 9 MB on the
    wire, 9 times the server's max payload): the ingest splits it under the max payload, the indexer adds the
    tier to the 4 and counts the 1M, and the rank goes on indexing (the next GPU store matches)."""
    pub = EventPublisher(ANY, ANY, version="0.23.0")
    try:
        async with clean_pipeline(nats_url, uid) as p:
            ingest = await p.start_ingest("w", pub.endpoint, pub.replay_endpoint)
            await pub.wait_for_subscribers(1)
            indexer = await p.start_indexer()
            await p.start_router()
            pub.publish([stored([1, 2, 3, 4], PROMPT[:16], medium="GPU")])
            await eventually(lambda: p.route(PROMPT, explain=True), lambda r: overlaps(r) == {"w/0": 4})
            pub.publish([offloaded(1, 2, 3, 4, *range(10**9, 10**9 + N))])
            c = indexer.state.counters
            await eventually(
                lambda: p.route(PROMPT, explain=True),
                lambda r: (c.placed_blocks, c.unknown_placements) == (4, N),
                timeout_s=60,
            )
            pub.publish([stored([5, 6], PROMPT[16:24], parent=4, medium="GPU")])
            await eventually(lambda: p.route(PROMPT, explain=True), lambda r: overlaps(r) == {"w/0": 6})
            (rank,) = ingest.status().ranks.values()
            assert (rank.events["placed_events"], rank.events["placed_blocks"]) == (1, N + 4)
            assert ingest.counters.split_batches == 1 and ingest.counters.decode_errors == 0
    finally:
        pub.close()
