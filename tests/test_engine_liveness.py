"""A dead or hung engine behind a live ingest: stale, then out of the registry and the index, then back.

Real nats-server, real ZMQ sockets (the simulated vLLM publisher with its replay ROUTER), the real ingest,
indexer and router as tasks. The engine "dies" by closing its sockets (a killed process does the same to its
peers) and "hangs" by reading replay requests without answering them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from tests.pipeline import Pipeline, eventually
from tests.test_ingest_faults import BS, T, U, blk, clean_pipeline, expect, stored
from tests.test_ingest_registry import route_or_error

from kvmesh.core.protocol import WorkerRecord
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.service import IngestService
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

W = "w"
FAST = {
    "engine_probe_after_s": 0.4,
    "engine_probe_every_s": 0.2,
    "engine_probe_timeout_s": 0.3,
    "engine_stale_after_failures": 2,
    "engine_remove_after_s": 1.5,
}


@contextlib.asynccontextmanager
async def registry(p: Pipeline) -> AsyncIterator[Any]:
    """A JetStream context and the name of the pipeline's registry bucket (the ingest creates it)."""
    nc = await connect(p.nats_url, name="test-liveness")
    try:
        yield nc.jetstream(), subjects.registry_bucket(p.stream)
    finally:
        await nc.close()


async def record(kv: Any) -> WorkerRecord | None:
    """The worker's registry record, or None when its key is gone."""
    js, bucket = kv
    try:
        entry = await (await js.key_value(bucket)).get(subjects.kv_key(W))
    except Exception:
        return None
    if entry.value is None or entry.operation is not None:
        return None
    return msgspec.json.decode(entry.value, type=WorkerRecord)


async def start(p: Pipeline, pub: EventPublisher) -> IngestService:
    return await p.start_ingest(W, pub.endpoint, pub.replay_endpoint, block_size=BS, **FAST)


async def test_a_dead_engine_goes_stale_then_leaves_then_rejoins_as_a_new_incarnation(
    nats_url: str, uid: str
) -> None:
    """Engine killed: its rank goes stale in the registry, then the worker leaves (no candidate, no blocks);
    an engine started again on the same ports is indexed afresh with exactly its new blocks."""
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    assert replay is not None
    async with clean_pipeline(nats_url, uid) as p, registry(p) as kv:
        ing = await start(p, pub)
        await pub.wait_for_subscribers(1)
        await p.start_indexer()
        await p.start_router()
        pub.publish([stored([1, 2, 3, 4], T)])
        await expect(p, [T], [{"w/0": 4}])
        first = await record(kv)
        assert first is not None and first.stale_ranks == {}

        pub.close()  # the engine dies
        stale = await eventually(lambda: record(kv), lambda r: r is not None and bool(r.stale_ranks))
        assert stale is not None and list(stale.stale_ranks) == [0]
        assert stale.stale_ranks[0].startswith("engine silent for ")
        assert f"replay socket {replay} did not answer within 0.3 s" in stale.stale_ranks[0]
        assert ing.status().ranks["0"].engine.state in ("stale", "gone")

        # Gone: the key is deleted, the indexer removes the worker, nothing routes to it.
        await eventually(lambda: record(kv), lambda r: r is None)
        await eventually(lambda: route_or_error(p), lambda r: isinstance(r, str))
        assert p.indexer is not None
        assert p.indexer.state.live_worker(W) is None
        assert ing.status().ranks["0"].engine.state == "gone"

        # The engine comes back on the same endpoints (its sequence starts again at 0).
        pub = EventPublisher(endpoint, replay)
        try:
            await pub.wait_for_subscribers(1)
            pub.publish([stored([11, 12], U)])
            await expect(p, [U, T], [{"w/0": 2}, {"w/0": 0}])
            back = await eventually(lambda: record(kv), lambda r: r is not None and not r.stale_ranks)
            assert back is not None and back.incarnation >= 1
            assert ing.status().ranks["0"].engine.state == "live"
        finally:
            pub.close()


async def test_a_hung_engine_is_stale_while_silent_and_live_when_it_answers(nats_url: str, uid: str) -> None:
    """An engine whose replay service stops answering turns stale (remove bound not reached) and live again
    as soon as it answers; its blocks are kept throughout (nothing was lost)."""
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        async with clean_pipeline(nats_url, uid) as p, registry(p) as kv:
            await p.start_ingest(
                W, pub.endpoint, pub.replay_endpoint, block_size=BS, **{**FAST, "engine_remove_after_s": 0.0}
            )
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            pub.publish([stored([1, 2], blk(T, 0, 2))])
            await expect(p, [T], [{"w/0": 2}])
            pub.replay_enabled = False
            await eventually(lambda: record(kv), lambda r: r is not None and list(r.stale_ranks) == [0])
            pub.replay_enabled = True
            await eventually(lambda: record(kv), lambda r: r is not None and r.stale_ranks == {})
            pub.publish([stored([3], blk(T, 2), parent=2)])
            await expect(p, [T], [{"w/0": 3}])
    finally:
        pub.close()


def test_liveness_settings_are_validated() -> None:
    """Bad probe bounds are configuration errors naming the flag; 0 turns probing off."""
    base: dict[str, Any] = {"worker_id": "w", "model": "m"}
    assert IngestSettings(**base, engine_probe_after_s=0).validate() == []
    assert IngestSettings(**base, engine_probe_after_s=-1).validate() == [
        "--engine-probe-after-s must be ≥ 0 (0: never probe)"
    ]
    assert IngestSettings(**base, engine_stale_after_failures=0, engine_probe_timeout_s=0).validate() == [
        "--engine-stale-after-failures must be ≥ 1 (got 0)",
        "--engine-probe-timeout-s must be > 0",
    ]


async def test_registry_watches_ask_the_server_to_drop_their_consumer_soon(nats_url: str, uid: str) -> None:
    """The indexer's and the router's registry watches create consumers with a 30 s inactive threshold (not
    nats-py's 300 s), so a killed watcher's consumer leaves the server within half a minute."""
    async with clean_pipeline(nats_url, uid) as p:
        pub = EventPublisher("tcp://127.0.0.1:*")
        try:
            await start(p, pub)
            await p.start_indexer()
            await p.start_router()
            nc = await connect(p.nats_url, name="test-consumers")
            try:
                js = nc.jetstream()
                stream = f"KV_{subjects.registry_bucket(p.stream)}"

                async def thresholds() -> list[float]:
                    infos = await js.consumers_info(stream)
                    return sorted(float(c.config.inactive_threshold or 0) for c in infos)

                got = await eventually(thresholds, lambda t: len(t) >= 2)
                assert got == [30.0] * len(got)
            finally:
                await nc.close()
        finally:
            pub.close()
