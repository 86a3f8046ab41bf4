"""Break-it: three indexer replicas racing one expiry claim, with a real ingest process frozen by SIGSTOP.

* ``--expiry-grace-s 0`` and three replicas: the worker is removed exactly once (one removal in the stream,
  whichever replica's claim won), the ingest rejoins as a new incarnation and is indexed on every replica.
* three replicas, the ingest back within the grace: no replica removes anything.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from tests.pipeline import eventually
from tests.test_ingest_faults import T, blk, clean_pipeline, expect, stored
from tests.test_registry_expiry_grace import W, spawn_ingest, stop_ingest

from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect
from kvmesh.runtime.registry import RegistrySettings, open_registry, read_key
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.e2e]


async def blocks_of(replica: Any) -> Any:
    return replica.state.workers().get(W, {}).get("blocks")


async def worker_of(replica: Any) -> Any:
    return replica.state.workers()[W]


TTL_S = 3.0  # spawn_ingest's


async def run_fleet(nats_url: str, uid: str, tmp: Path, grace: float, hold_until: str) -> None:
    pub = EventPublisher("tcp://127.0.0.1:*", None)
    nc = await connect(nats_url, name="test-breakit-replicas")
    proc = None
    try:
        async with clean_pipeline(nats_url, uid) as p:
            proc = spawn_ingest(p, pub.endpoint, tmp / "ingest.log")
            js = nc.jetstream()
            kv = await open_registry(
                js, RegistrySettings(bucket=subjects.registry_bucket(p.stream), ttl_s=TTL_S, memory=True)
            )
            await eventually(lambda: read_key(kv, W), lambda k: k.kind == "record", timeout_s=20)
            await pub.wait_for_subscribers(1, timeout_s=20)
            reps = [
                await p.start_indexer(worker_ttl_s=TTL_S, expiry_grace_s=grace, buckets_memory=True)
                for _ in range(3)
            ]
            await p.start_router()
            pub.publish([stored([1], blk(T, 0))])
            await expect(p, [T], [{"w/0": 1}])
            for r in reps:
                await eventually(functools.partial(blocks_of, r), lambda b: b == 1)
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                await eventually(
                    lambda: read_key(kv, W), lambda k: k.kind == hold_until, timeout_s=TTL_S + 10
                )
                if hold_until == "deleted":
                    await asyncio.sleep(1.0)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            await eventually(lambda: read_key(kv, W), lambda k: k.kind == "record", timeout_s=10)
            await asyncio.sleep(grace + 1.5)
            log = (tmp / "ingest.log").read_text()
            # WorkerRemoved messages in the stream (the control subject), deduplicated by the server.
            sub = await js.subscribe(f"{p.prefix}.>", ordered_consumer=True)
            removals = 0
            while True:
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except Exception:
                    break
                if (
                    b"WorkerRemoved" in msg.data
                    or b"worker_removed" in msg.data
                    or b"removed" in (msg.headers or {}).get("Nats-Msg-Id", "").encode()
                ):
                    removals += 1
            await sub.unsubscribe()
            if hold_until == "deleted":
                assert removals == 1, f"{removals} removals in the stream"
                assert "rejoining as a new incarnation" in log
                pub.publish([stored([4], blk(T, 0))])
                for r in reps:
                    await eventually(
                        functools.partial(worker_of, r),
                        lambda w: (w["blocks"], w["removed"]) == (1, False),
                        timeout_s=10,
                    )
            else:
                assert removals == 0 and [r.removals_published for r in reps] == [0, 0, 0]
                assert "rejoining as a new incarnation" not in log
                pub.publish([stored([2], blk(T, 1), parent=1)])
                for r in reps:
                    await eventually(
                        functools.partial(worker_of, r),
                        lambda w: (w["blocks"], w["removed"]) == (2, False),
                        timeout_s=10,
                    )
    finally:
        if proc is not None:
            stop_ingest(proc)
        pub.close()
        await nc.close()


async def test_three_replicas_grace_zero_remove_once_and_the_worker_rejoins(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    await run_fleet(nats_url, uid, tmp_path, 0.0, "deleted")


async def test_three_replicas_worker_back_within_grace_nothing_removed(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    await run_fleet(nats_url, uid, tmp_path, 2.0, "expired")
