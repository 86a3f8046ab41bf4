"""An engine that comes back on the same ports right after its ingest gave it up for gone: what it stores
before the ingest notices it answers must stay indexed (real nats-server, real ZMQ, real ingest, indexer and
router as tasks)."""

from __future__ import annotations

import pytest
from tests.pipeline import Pipeline, eventually
from tests.test_engine_liveness import W, record, registry, start
from tests.test_ingest_faults import T, U, clean_pipeline, expect, snapshot, stored

from kvmesh.runtime.nats import connect
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def test_blocks_stored_by_an_engine_back_from_gone_survive_the_rejoin(nats_url: str, uid: str) -> None:
    """The first batch of an engine restarted on the same ports lands before the ingest's rejoin: once the
    rejoin (a new incarnation, announced by a Cleared) is applied, the index still holds that batch's blocks."""
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    assert replay is not None
    async with clean_pipeline(nats_url, uid) as p, registry(p) as kv:
        ing = await start(p, pub)
        await pub.wait_for_subscribers(1)
        await p.start_indexer()
        await p.start_router()
        pub.publish([stored([1, 2, 3, 4], T)])
        await expect(p, [T], [{f"{W}/0": 4}])
        pub.close()  # the engine dies
        await eventually(lambda: record(kv), lambda r: r is None)  # gone: the worker left
        assert p.indexer is not None
        await eventually(lambda: _live(p), lambda live: live is None)

        pub = EventPublisher(endpoint, replay)
        try:
            await pub.wait_for_subscribers(1)
            pub.publish([stored([11, 12], U)])  # before any probe found the engine answering again
            back = await eventually(lambda: record(kv), lambda r: r is not None and not r.stale_ranks)
            assert back is not None
            assert ing.status().ranks["0"].engine.state == "live"
            await eventually(lambda: _settled(p), lambda ok: ok)
            assert await snapshot(p, [U, T]) == [{f"{W}/0": 2}, {f"{W}/0": 0}]
        finally:
            pub.close()


async def _live(p: Pipeline) -> tuple[str, int] | None:
    assert p.indexer is not None
    return p.indexer.state.live_worker(W)


async def _settled(p: Pipeline) -> bool:
    """Whether the indexer applied the whole stream and the ingest has nothing left to publish."""
    assert p.indexer is not None
    nc = await connect(p.nats_url, name="test-settled")
    try:
        info = await nc.jetstream().stream_info(p.stream)
    finally:
        await nc.close()
    return bool(p.indexer.state.applied_seq == info.state.last_seq and info.state.last_seq > 0)
