"""Break-it: a two-node worker (DP 4, nodes 0-2 and 2-4) whose node keys both age out, node A's a little
before node B's. Node A stays frozen (dead); node B comes back after A's expiry was claimed but within its
own grace, so it writes its key over its marker and keeps its incarnation. The indexer must not publish a
whole-worker `WorkerRemoved` for the incarnation B keeps publishing at: B's later events must be indexed.

Real nats-server, one real ``python -m kvmesh.ingest`` process per node (frozen with SIGSTOP), real ZMQ
publishers (one per global rank, base port + rank), the real indexer and router in process.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from tests.pipeline import Pipeline, eventually, overlaps
from tests.test_ingest_faults import T, U, blk, clean_pipeline, stored
from tests.test_registry_expiry_grace import spawn_ingest, stop_ingest

from kvmesh.client import RouteReply
from kvmesh.core.endpoints import offset_endpoint
from kvmesh.harness.ports import free_block
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect
from kvmesh.runtime.registry import RegistrySettings, open_registry, read_key, registry_key
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.e2e]

W = "moe"
DP = 4
TTL_S = 3.0
GRACE_S = 2.0
KEY_A, KEY_B = registry_key(W, range(0, 2)), registry_key(W, range(2, 4))


def spawn_node(p: Pipeline, base: str, start: int, log: Path) -> subprocess.Popen[bytes]:
    """One node's ingest: ranks ``[start, start + 2)`` of the worker's `DP`."""
    return spawn_ingest(
        p, base, log, "--data-parallel-size", str(DP), "--data-parallel-start-rank", str(start),
        "--data-parallel-size-local", "2", worker=W,
    )  # fmt: skip


def held(reply: RouteReply) -> dict[str, int]:
    """The ranks that hold any of the prompt's blocks (overlap > 0)."""
    return {k: v for k, v in overlaps(reply).items() if v}


async def freeze_after_beat(proc: subprocess.Popen[bytes], kv: Any, key: str) -> None:
    """SIGSTOP ``proc`` right after its heartbeat lands (its key's revision changes)."""
    first = (await read_key(kv, key)).revision
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (await read_key(kv, key)).revision == first:
        assert loop.time() < deadline, f"no heartbeat on {key}"
        await asyncio.sleep(0.01)
    os.kill(proc.pid, signal.SIGSTOP)


async def test_a_node_back_within_its_grace_after_the_other_nodes_claim_keeps_being_indexed(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    base_port = free_block(DP)
    base = f"tcp://127.0.0.1:{base_port}"
    pubs = [EventPublisher(offset_endpoint(base, r), None, dp_rank=r) for r in range(DP)]
    procs: list[subprocess.Popen[bytes]] = []
    nc = await connect(nats_url, name="test-breakit-multinode")
    try:
        async with clean_pipeline(nats_url, uid) as p:
            a = spawn_node(p, base, 0, tmp_path / "a.log")
            b = spawn_node(p, base, 2, tmp_path / "b.log")
            procs += [a, b]
            kv = await open_registry(
                nc.jetstream(),
                RegistrySettings(bucket=subjects.registry_bucket(p.stream), ttl_s=TTL_S, memory=True),
            )
            for key in (KEY_A, KEY_B):
                await eventually(
                    functools.partial(read_key, kv, key), lambda s: s.kind == "record", timeout_s=20
                )
            for pub in pubs:
                await pub.wait_for_subscribers(1, timeout_s=20)
            indexer = await p.start_indexer(worker_ttl_s=TTL_S, expiry_grace_s=GRACE_S, buckets_memory=True)
            await p.start_router()
            pubs[0].publish([stored([1], blk(T, 0))])
            pubs[2].publish([stored([21], blk(T, 0)), stored([22], blk(T, 1), parent=21)])
            want = {f"{W}/0": 1, f"{W}/2": 2}
            got = await eventually(lambda: p.route(T, explain=True), lambda r: held(r) == want)
            assert held(got) == want

            loop = asyncio.get_running_loop()
            await freeze_after_beat(a, kv, KEY_A)
            frozen_a = loop.time()
            await asyncio.sleep(0.3)
            await freeze_after_beat(b, kv, KEY_B)
            assert loop.time() - frozen_a < GRACE_S - 0.3  # B's marker comes within A's grace
            try:
                await eventually(
                    lambda: read_key(kv, KEY_A), lambda k: k.kind == "deleted", timeout_s=TTL_S + GRACE_S + 5
                )
                state_b = await read_key(kv, KEY_B)
                assert state_b.kind == "expired", f"scenario timing missed: node B's key is {state_b}"
            finally:
                os.kill(b.pid, signal.SIGCONT)
            # Node B writes its record over its marker before its own claim: it keeps its incarnation.
            await eventually(lambda: read_key(kv, KEY_B), lambda k: k.kind == "record", timeout_s=GRACE_S)
            await asyncio.sleep(GRACE_S + 1.0)  # past B's claim
            assert (await read_key(kv, KEY_B)).kind == "record"
            blog = (tmp_path / "b.log").read_text()
            assert "registering again with the same incarnation" in blog
            assert "rejoining as a new incarnation" not in blog

            # Node B's engine goes on storing: it must be indexed (not dropped as a removed incarnation's).
            pubs[2].publish([stored([23], blk(U, 0))])
            await asyncio.sleep(2 * TTL_S)  # several more heartbeats of node B at the same incarnation
            pubs[2].publish([stored([24], blk(U, 1), parent=23)])
            await asyncio.sleep(1.0)
            held_now = held(await p.route(U, explain=True))
            state = indexer.state.workers()[W]
            assert (held_now, state["removed"], indexer.removals_published) == ({f"{W}/2": 2}, False, 0), (
                f"node B (alive, same incarnation) is dropped: index {state}"
            )
    finally:
        for proc in procs:
            stop_ingest(proc)
        for pub in pubs:
            pub.close()
        await nc.close()
