"""Tokenless offload events end to end (real publisher → ingest → JetStream → indexer → router).

vLLM < 0.24 with the OffloadingConnector reports each CPU copy of GPU blocks as a BlockStored carrying the GPU
blocks' hashes, ``token_ids: []`` and ``block_size: 0``. kvmesh reads it as "these known blocks now also live
on the CPU": a prompt whose GPU copies were evicted still matches on the CPU.
"""

from __future__ import annotations

import pytest
from tests.pipeline import eventually, overlaps
from tests.test_ingest_faults import ANY, BS, clean_pipeline, stored

from kvmesh.core.wire import BlockRemoved, BlockStored
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

PROMPT = list(range(700, 724))  # 6 blocks of 4 tokens


def offloaded(*hashes: int, medium: str = "CPU") -> BlockStored:
    """The OffloadingConnector's BlockStored for CPU copies of known blocks."""
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=(), block_size=0, medium=medium)


@pytest.mark.parametrize("index", ["local", "remote"])
async def test_cpu_copies_of_known_blocks_match_once_the_gpu_copies_are_evicted(
    nats_url: str, uid: str, index: str
) -> None:
    """GPU blocks 1–6, then CPU copies of 1–4 and of a block the engine never reported (99): the prompt
    matches 6 blocks on GPU; once the GPU copies are evicted it matches the 4 CPU copies; the unknown copy is
    counted and indexed nowhere; the block size stays the GPU events' 4."""
    pub = EventPublisher(ANY, ANY, version="0.23.0")
    try:
        async with clean_pipeline(nats_url, uid) as p:
            ingest = await p.start_ingest("w", pub.endpoint, pub.replay_endpoint)
            await pub.wait_for_subscribers(1)
            indexer = await p.start_indexer()
            await p.start_router(index)
            pub.publish([stored([1, 2, 3, 4, 5, 6], PROMPT, medium="GPU")])
            pub.publish([offloaded(1, 2, 3, 4, 99)])
            await eventually(
                lambda: p.route(PROMPT, explain=True),
                lambda r: overlaps(r) == {"w/0": 6} and indexer.state.counters.placed_blocks == 4,
            )
            pub.publish([BlockRemoved(block_hashes=(1, 2, 3, 4, 5, 6), medium="GPU")])
            r = await eventually(lambda: p.route(PROMPT, explain=True), lambda r: overlaps(r) == {"w/0": 4})
            assert r.scores is not None
            (score,) = r.scores
            assert (score.cached_tokens_by_tier, score.cached_blocks) == ({"CPU": 16}, 4)
            c = indexer.state.counters
            assert (c.placed_blocks, c.unknown_placements, c.stored_blocks, c.removed_blocks) == (4, 1, 6, 6)
            (rank,) = ingest.status().ranks.values()
            assert (rank.block_size, rank.events["placed_events"], rank.events["placed_blocks"]) == (BS, 1, 5)
            assert rank.events["rejected_block_size"] == 0 and rank.events["malformed_events"] == 0
    finally:
        pub.close()


async def test_a_tokenless_event_first_does_not_set_the_block_size(nats_url: str, uid: str) -> None:
    """An ingest without --block-size that sees the CPU copies first (its GPU events came before it attached)
    still learns the block size from the next real BlockStored, which is not rejected."""
    pub = EventPublisher(ANY, ANY, version="0.23.0")
    try:
        async with clean_pipeline(nats_url, uid) as p:
            ingest = await p.start_ingest("w", pub.endpoint, pub.replay_endpoint)
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            pub.publish([offloaded(41, 42)])
            pub.publish([stored([1, 2], PROMPT[:8], medium="GPU")])
            await eventually(lambda: p.route(PROMPT, explain=True), lambda r: overlaps(r) == {"w/0": 2})
            (rank,) = ingest.status().ranks.values()
            assert (rank.block_size, rank.events["rejected_block_size"], rank.events["placed_blocks"]) == (
                BS,
                0,
                2,
            )
    finally:
        pub.close()
