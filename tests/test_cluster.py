"""Failures of NATS itself: a node of a 3-node cluster dies (R3 stream), and a single file-storage server restarts.

Each test runs its own nats-server processes on loopback. Events are published the way ingest publishes them
(acknowledged, retried with the same ``Nats-Msg-Id`` until acknowledged), so "nothing lost" is exact: the
stream ends with exactly the published messages, and every replica applies all of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from tests.indexers import BS, MODEL, Group, group, wait_for

from kvmesh.bench.fleet import Cluster
from kvmesh.core.events import EventsMessage, Stored, encode_message
from kvmesh.core.state import IndexState
from kvmesh.harness.server import NatsServer
from kvmesh.indexer.service import IndexerService
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.slow]

WORKERS = 4
BLOCKS = 4
PROMPT = list(range(32))


def _message(i: int) -> tuple[str, EventsMessage]:
    """The i-th batch: worker i % WORKERS extends its own chain by BLOCKS blocks (deterministic)."""
    w = f"w{i % WORKERS}"
    rng = random.Random(i)
    k = i // WORKERS
    engine = [(i * BLOCKS + b) + 1 for b in range(BLOCKS)]
    parent = None if k == 0 else (i - WORKERS) * BLOCKS + BLOCKS
    local = [rng.getrandbits(64) for _ in range(BLOCKS)]
    msg = EventsMessage(
        worker_id=w,
        dp_rank=0,
        model=MODEL,
        block_size=BS,
        epoch=0,
        seq=k,
        events=[Stored(engine, parent, local)],
    )
    return w, msg


async def feed(g: Group, start: int, n: int, *, pace_s: float = 0.0) -> None:
    """Publish batches ``start .. start+n-1`` as ingest does: acknowledged, retried with the same message id."""
    for i in range(start, start + n):
        w, msg = _message(i)
        data = encode_message(msg)
        headers = {"Nats-Msg-Id": f"{w}:0:0:{msg.seq}"}
        while True:
            try:
                await g.js.publish(
                    subjects.events_subject(g.prefix, MODEL, w, 0),
                    data,
                    stream=g.stream,
                    headers=dict(headers),
                    timeout=2.0,
                )
                break
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError):
                await asyncio.sleep(0.2)
        if pace_s:
            await asyncio.sleep(pace_s)


def _expected(n: int) -> IndexState:
    state = IndexState()
    for i in range(n):
        state.apply(i + 1, _message(i)[1])
    return state


async def _until_js_ready(url: str, timeout_s: float = 30.0) -> None:
    """Wait until the cluster has a JetStream meta leader (stream creation works)."""
    nc = await connect(url, name="test-js-ready", wait_s=5.0)
    try:
        js = nc.jetstream()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                await js.account_info()
                return
            except Exception:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.25)
    finally:
        await nc.close()


async def _try_snapshot(replica: Any) -> dict[str, Any]:
    """Write a snapshot now; an error (a bucket still electing its leader) comes back as ``{"error": …}``."""
    try:
        result: dict[str, Any] = await replica.snapshot(force=True)
    except Exception as exc:
        return {"error": repr(exc)}
    return result


async def _replica_seqs(*replicas: Any) -> tuple[int, ...]:
    return tuple(r.state.applied_seq for r in replicas)


async def test_r3_stream_survives_a_killed_node_while_events_flow(cluster: Cluster, uid: str) -> None:
    """Kill one of three NATS nodes mid-stream: publishing, both replicas and match answers carry on; nothing is lost and digests agree."""
    await _until_js_ready(cluster.url(0))
    n = 300
    async with group(cluster.url(1), uid, memory=False, replicas=3) as g:
        a = await g.start(f"{uid}-a", nats_url=cluster.url(0), match_subject=f"r{uid}.a")
        b = await g.start(f"{uid}-b", nats_url=cluster.url(2), match_subject=f"r{uid}.b")
        await feed(g, 0, 100)
        await wait_for(lambda: _replica_seqs(a, b), lambda s: s == (100, 100))
        feeding = asyncio.create_task(feed(g, 100, n - 100, pace_s=0.005))
        await asyncio.sleep(0.3)
        cluster.kill(0)  # replica a's server: a must fail over to another node
        await asyncio.wait_for(feeding, 30)
        info = await g.js.stream_info(g.stream)
        assert (info.state.messages, info.state.first_seq, info.state.last_seq) == (n, 1, n)
        await wait_for(lambda: _replica_seqs(a, b), lambda s: s == (n, n), timeout_s=30)
        expected = _expected(n)
        assert a.state.digest() == b.state.digest() == expected.digest()
        assert a.state.block_total() == b.state.block_total() == n * BLOCKS
        assert await g.match(f"r{uid}.a", PROMPT) == await g.match(f"r{uid}.b", PROMPT)
        # The R3 snapshot bucket still takes writes (once its own leader election, if any, is over).
        written = await wait_for(lambda: _try_snapshot(a), lambda r: r.get("written") is True)
        assert written["applied_seq"] == n


async def test_nats_restart_with_file_storage_while_events_flow_loses_nothing(
    tmp_path: Path, uid: str
) -> None:
    """Kill and restart a file-storage nats-server while events flow: nothing is lost and both replicas converge on the full stream."""
    store = tmp_path / "js"
    server = NatsServer(store_dir=store).start()
    port = server.port
    n = 300
    try:
        async with group(server.url, uid, memory=False) as g:
            a = await g.start(f"{uid}-a")
            b = await g.start(f"{uid}-b")
            await feed(g, 0, 100)
            await wait_for(lambda: _replica_seqs(a, b), lambda s: s == (100, 100))
            feeding = asyncio.create_task(feed(g, 100, n - 100, pace_s=0.005))
            await asyncio.sleep(0.3)
            server.kill()
            server.stop()
            await asyncio.sleep(1.0)
            server = NatsServer(port=port, store_dir=store).start()
            await asyncio.wait_for(feeding, 30)
            info = await g.js.stream_info(g.stream)
            assert (info.state.messages, info.state.first_seq, info.state.last_seq) == (n, 1, n)
            await wait_for(lambda: _replica_seqs(a, b), lambda s: s == (n, n), timeout_s=30)
            assert a.state.digest() == b.state.digest() == _expected(n).digest()
            assert a.state.block_total() == b.state.block_total() == n * BLOCKS
    finally:
        server.stop()


async def test_indexer_creates_its_buckets_with_the_streams_replica_count(cluster: Cluster, uid: str) -> None:
    """With --buckets-replicas left at its default, an indexer on an R3 stream creates R3 snapshot, lease and
    registry buckets (an R1 registry would stop worker departures when its one node is lost)."""
    await _until_js_ready(cluster.url(0))
    async with group(cluster.url(0), uid, memory=False, replicas=3) as g:
        await feed(g, 0, 4)
        base = g.settings("r-default")
        svc = IndexerService(dataclasses.replace(base, buckets_replicas=0))
        task = asyncio.create_task(svc.run())
        try:
            await asyncio.wait_for(svc.ready.wait(), 60)
            got = [
                (await g.js.stream_info(name)).config.num_replicas
                for name in (
                    f"OBJ_{base.snapshot_bucket_name()}",
                    f"KV_{base.lease_bucket_name()}",
                    f"KV_{base.registry_bucket_name()}",
                )
            ]
            assert got == [3, 3, 3]
        finally:
            svc.stop()
            await asyncio.wait_for(task, 30)
