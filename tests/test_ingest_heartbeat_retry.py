"""A failed registry heartbeat is tried again within a second, not a whole beat (TTL/3) later: during a
cluster failover the key's TTL keeps running, and a worker whose entry expires loses its cache in every
index until its engine stores the blocks again (a stream-leader kill in the fault suite once cost a worker
its whole cache this way: two failed puts 5 s apart and the 15 s TTL ran out). Against a real nats-server;
the failures are injected into the put (a failover cannot be timed here)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from kvmesh.ingest import registration as reg
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.registration import RETRY_S, Registration
from kvmesh.runtime import registry, subjects
from kvmesh.runtime.nats import connect
from kvmesh.runtime.registry import key_present

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def test_a_failed_heartbeat_is_retried_within_a_second(
    nats_url: str, uid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = IngestSettings(
        worker_id="w",
        model="m",
        nats_url=nats_url,
        stream=f"KVMESH_T_{uid}",
        stream_memory=True,
        worker_ttl_s=15.0,
    )
    real = registry.put_record
    attempts: list[float] = []
    third = asyncio.Event()

    async def flaky(kv: Any, record: Any, *, last: int) -> int:
        attempts.append(time.monotonic())
        if len(attempts) == 3:
            third.set()
        if len(attempts) <= 2:
            raise TimeoutError  # what nats-py raises while the bucket's stream has no leader
        return await real(kv, record, last=last)

    monkeypatch.setattr(reg, "put_record", flaky)
    nc = await connect(nats_url, name="test-heartbeat")
    r = Registration(settings, {}, lambda _why: None)
    r.js = nc.jetstream()
    task = asyncio.create_task(r.run())
    try:
        bucket = subjects.registry_bucket(settings.stream)
        await asyncio.wait_for(third.wait(), 4.5)  # two failures and a success inside one beat (5 s)
        gaps = [b - a for a, b in itertools.pairwise(attempts[:3])]
        assert all(g >= RETRY_S - 0.05 for g in gaps), gaps  # and no busy loop
        kv = await nc.jetstream().key_value(bucket)
        assert await key_present(kv, subjects.kv_key("w")) is True
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await nc.jetstream().delete_key_value(subjects.registry_bucket(settings.stream))
        await nc.close()
