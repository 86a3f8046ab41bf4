"""A worker's removal that reaches the stream after the worker registered again must not remove it.

The indexer that claims an aged-out key (a delete that holds only over the server's marker) publishes the
worker's `WorkerRemoved` next. If that publish is slow (retried through a stream leader election, a paused
host), or the claimer dies and a replica that was paused publishes it, the ingest can see the delete, rejoin as
a new incarnation (Cleared at epoch 1) and store blocks before the removal of epoch 0 lands. The stream then
reads: epoch 1's Cleared, epoch 1's Stored, removal of epoch 0. Every indexer used to remove the whole worker
there, whatever its epoch: the live worker lost its new blocks, and the blocks its engine chained to them were
never indexed (found by a break-it pass with a claimer held inside its publish).

Real nats-server, real ZMQ publisher, a real ``python -m kvmesh.ingest`` process frozen with SIGSTOP until its
key ages out. The test itself plays the claimer: it claims the expiry with `claim_expiry`, as an indexer does,
and publishes the removal with `publish_removal` once the worker is back, as that indexer's late publish would.
The indexer and router that read the stream start afterwards, so they apply the exact order a late publish
leaves (no indexer runs meanwhile: a running one would publish the removal itself on seeing the delete).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
from tests.pipeline import eventually
from tests.test_ingest_faults import BS, T, blk, clean_pipeline, expect, stored
from tests.test_registry_expiry_grace import TTL_S, W, ingest_log, spawn_ingest, stop_ingest

from kvmesh.core.events import EventsMessage, WorkerRemoved, decode_message
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect
from kvmesh.runtime.registry import (
    RegistrySettings,
    claim_expiry,
    open_registry,
    publish_removal,
    read_key,
)
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.e2e]


async def test_a_removal_published_after_the_rejoin_keeps_the_new_incarnation(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    pub = EventPublisher("tcp://127.0.0.1:*", None)
    nc = await connect(nats_url, name="test-late-removal")
    proc = None
    try:
        async with clean_pipeline(nats_url, uid) as p:
            js = nc.jetstream()
            proc = spawn_ingest(p, pub.endpoint, tmp_path / "ingest.log")
            kv = await open_registry(
                js, RegistrySettings(bucket=subjects.registry_bucket(p.stream), ttl_s=TTL_S, memory=True)
            )
            await eventually(lambda: read_key(kv, W), lambda k: k.kind == "record", timeout_s=20.0)
            await pub.wait_for_subscribers(1, timeout_s=20.0)
            pub.publish([stored([1], blk(T, 0))])
            pub.publish([stored([2], blk(T, 1), parent=1)])

            os.kill(proc.pid, signal.SIGSTOP)  # its heartbeats stop landing: the key ages out
            try:
                marker = await eventually(
                    lambda: read_key(kv, W), lambda k: k.kind == "expired", timeout_s=TTL_S + 10
                )
                claim = await claim_expiry(kv, W, marker.revision)
                assert claim.kind == "deleted"
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            await eventually(lambda: read_key(kv, W), lambda k: k.kind == "record", timeout_s=10.0)
            pub.publish([stored([3], blk(T, 0))])  # the new incarnation's first block

            sub = await js.pull_subscribe(f"{p.prefix}.>", stream=p.stream)
            kinds: list[str] = []

            async def stream_kinds() -> list[str]:
                with contextlib.suppress(TimeoutError):
                    for m in await sub.fetch(100, timeout=0.5):
                        msg = decode_message(m.data)
                        if isinstance(msg, WorkerRemoved):
                            kinds.append(f"removed e{msg.epoch}")
                        elif isinstance(msg, EventsMessage) and msg.events:
                            kinds.append(f"e{msg.epoch} {type(msg.events[0]).__name__}")
                return kinds

            await eventually(stream_kinds, lambda k: "e1 Stored" in k, timeout_s=10.0)
            seq = await publish_removal(
                js,
                stream=p.stream,
                events_prefix=p.prefix,
                worker_id=W,
                model=p.model,
                incarnation=0,
                reason="expired",
            )
            assert kinds[-1] == "e1 Stored"
            assert "e1 Cleared" in kinds and seq > 0

            indexer = await p.start_indexer(worker_ttl_s=TTL_S, buckets_memory=True)
            await p.start_router()
            await expect(p, [T], [{"w/0": 1}])
            assert indexer.state.counters.stale_removals == 1
            assert indexer.state.workers()[W]["removed"] is False
            assert indexer.removals_published == 0
            pub.publish([stored([4], blk(T, 1), parent=3)])  # the engine goes on from the kept block
            await expect(p, [T], [{"w/0": 2}])
            assert "rejoining as a new incarnation" in ingest_log(tmp_path)
    finally:
        if proc is not None:
            stop_ingest(proc)
        pub.close()
        await nc.close()


assert BS == 4  # the blocks above are of the ingest's block size
