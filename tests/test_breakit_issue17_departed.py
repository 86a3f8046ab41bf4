"""A worker without KV events that leaves the registry takes its predicted cache with it (real router
replicas, a real registry bucket on a real nats-server): as the indexers clear a departed worker's blocks, a
router forgets the prompts it sent a departed event-less worker, so once it rejoins (its engine may have
restarted) it is not credited with a cache from before, and a fleet whose workers come and go does not keep
every departed worker's predicted cache."""

from __future__ import annotations

import asyncio

import pytest
from tests.test_router import fleet, until
from tests.test_router_predicted import P, start

from kvmesh.core.index import Holder
from kvmesh.core.protocol import WorkerRecord, error_reply
from kvmesh.runtime.registry import RegistrySettings, deregister, heartbeat, open_registry

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

BS = 16


def record(w: str) -> WorkerRecord:
    return WorkerRecord(
        worker_id=w,
        model="m",
        dp_ranks=1,
        block_size=BS,
        incarnation=0,
        kv_capacity_blocks=64,
        kv_events=False,
    )


async def test_a_departed_event_less_worker_loses_its_predicted_cache(nats_url: str, uid: str) -> None:
    async with fleet(nats_url, uid) as f:
        bucket = f"T{uid}_WORKERS"
        kv = await open_registry(f.nc.jetstream(), RegistrySettings(bucket=bucket, ttl_s=30.0, memory=True))
        for w in ("x", "y"):
            await heartbeat(kv, record(w))
        f.answer = lambda q: error_reply("unknown_model", "no worker serves model 'm'")
        r0 = await start(f, use_registry=True, registry_bucket=bucket)
        await until(lambda: r0.endpoint.ranks("m") is not None)
        await f.client(0).route("m", P, candidates=["y"])
        assert (await f.client(0).route("m", P, candidates=["y"])).overlap_blocks == 5
        approx = r0.notes.predictions.approx
        await deregister(kv, "y")
        await until(lambda: "y" not in (r0.endpoint.records() or {}))
        await asyncio.sleep(1.1)  # the routers read the registry's event-less workers once a second
        await f.client(0).route("m", P)
        assert (approx.block_count(Holder("y", 0)), approx.block_count(Holder("x", 0))) == (0, 5)
        await heartbeat(kv, record("y"))
        await until(lambda: "y" in (r0.endpoint.records() or {}))
        back = await f.client(0).route("m", P, candidates=["y"])
        assert (back.worker_id, back.overlap_blocks) == ("y", 0)
