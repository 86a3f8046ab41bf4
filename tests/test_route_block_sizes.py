"""Workers of one model with different block sizes are each scored in their own blocks, through a real
ingest, indexer and router (local and remote index)."""

from __future__ import annotations

import pytest
from tests.pipeline import eventually
from tests.test_ingest_faults import clean_pipeline, stored

from kvmesh.client import RouteReply
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

PROMPT = list(range(1000, 1064))  # 64 tokens: 4 blocks of 16, 2 of 32


@pytest.mark.parametrize("index", ["local", "remote"])
async def test_holders_of_two_block_sizes_report_their_own_cached_tokens(
    nats_url: str, uid: str, index: str
) -> None:
    """A 16-token worker holding 3 blocks (48 tokens) beats a 32-token worker holding 1 (32 tokens), and each
    one's cached tokens are exact in explain."""
    small = EventPublisher("tcp://127.0.0.1:*")
    large = EventPublisher("tcp://127.0.0.1:*")
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await p.start_ingest("w16", small.endpoint, block_size=16)
            await p.start_ingest("w32", large.endpoint, block_size=32)
            await small.wait_for_subscribers(1)
            await large.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router(index=index)
            small.publish([stored([1, 2, 3], PROMPT[:48], block_size=16)])
            large.publish([stored([9], PROMPT[:32], block_size=32)])

            async def probe() -> RouteReply:
                return await p.route(PROMPT, explain=True)

            def cached(r: RouteReply) -> dict[str, int]:
                assert r.scores is not None
                return {s.worker_id: s.cached_tokens for s in r.scores}

            reply = await eventually(probe, lambda r: cached(r) == {"w16": 48, "w32": 32})
            assert (reply.worker_id, reply.cached_tokens) == ("w16", 48)
            assert reply.scores is not None
            assert {s.worker_id: s.overlap_blocks for s in reply.scores} == {"w16": 3, "w32": 1}
    finally:
        small.close()
        large.close()
