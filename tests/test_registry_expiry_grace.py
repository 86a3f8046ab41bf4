"""A worker whose heartbeats stop reaching the registry for longer than its TTL, while its engine keeps its
cache (a registry failover on a cluster; here its ingest process frozen with SIGSTOP, which the server sees
the same way: no put lands), and then reach it again.

* Back within the indexers' grace (``--expiry-grace-s``): the ingest writes its key over the age-out marker with
  the same incarnation, no indexer removes the worker, and every block it held stays in the index. (Before the
  grace, the ingest found its key gone and started a new incarnation with a Cleared, and the indexers published
  its removal at once: the index lost the whole cache, which the engine still held.)
* Back after the grace: an indexer has claimed the expiry (a delete that holds only over the marker) and
  published exactly one removal; the ingest sees the delete and rejoins as a new incarnation, and what the
  engine stores next is indexed again.

Real nats-server, real ZMQ publisher (`kvmesh.sim.publisher.EventPublisher`), a real ``python -m kvmesh.ingest``
process, and the real indexer and router services in process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tests.pipeline import Pipeline, eventually
from tests.test_ingest_faults import BS, T, blk, clean_pipeline, expect, stored

from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect
from kvmesh.runtime.registry import RegistrySettings, open_registry, read_key
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.e2e]

W = "w"
TTL_S = 3.0
GRACE_S = 2.0


def spawn_ingest(
    p: Pipeline, endpoint: str, log: Path, *extra: str, worker: str = W
) -> subprocess.Popen[bytes]:
    """A ``python -m kvmesh.ingest`` process of ``worker`` on ``endpoint`` (``extra``: more flags), TTL `TTL_S`,
    engine probes off, one stream message per batch, its output appended to ``log``."""
    argv = [
        sys.executable, "-m", "kvmesh.ingest", "--worker-id", worker, "--model", p.model,
        "--block-size", str(BS), "--zmq-endpoint", endpoint, "--nats-url", p.nats_url,
        "--stream", p.stream, "--events-prefix", p.prefix, "--stream-memory",
        "--worker-ttl-s", str(TTL_S), "--engine-probe-after-s", "0", "--max-coalesced-batches", "1",
        "--log-format", "json", *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


@contextlib.asynccontextmanager
async def fleet(nats_url: str, uid: str, tmp: Path) -> AsyncIterator[tuple[Pipeline, Any, Any]]:
    """A pipeline whose ingest is a process; yields it, the ingest process and the registry bucket."""
    pub = EventPublisher("tcp://127.0.0.1:*", None)
    proc: subprocess.Popen[bytes] | None = None
    nc = await connect(nats_url, name="test-expiry-grace")
    try:
        async with clean_pipeline(nats_url, uid) as p:
            proc = spawn_ingest(p, pub.endpoint, tmp / "ingest.log")
            kv = await open_registry(
                nc.jetstream(),
                RegistrySettings(bucket=subjects.registry_bucket(p.stream), ttl_s=TTL_S, memory=True),
            )
            await eventually(lambda: read_key(kv, W), lambda k: k.kind == "record", timeout_s=20.0)
            await pub.wait_for_subscribers(1, timeout_s=20.0)
            await p.start_indexer(worker_ttl_s=TTL_S, expiry_grace_s=GRACE_S, buckets_memory=True)
            await p.start_router()
            p.publisher = pub  # type: ignore[attr-defined]
            yield p, proc, kv
    finally:
        if proc is not None:
            stop_ingest(proc)
        pub.close()
        await nc.close()


def stop_ingest(proc: subprocess.Popen[bytes]) -> None:
    """Stop an ingest process that may be frozen (SIGSTOP): wake it, SIGTERM, SIGKILL after 10 s."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


async def index_two_blocks(p: Pipeline, pub: EventPublisher) -> None:
    """The engine stores the first two blocks of `T`, and the pipeline indexes them for worker `W`."""
    pub.publish([stored([1], blk(T, 0))])
    pub.publish([stored([2], blk(T, 1), parent=1)])
    await expect(p, [T], [{"w/0": 2}])


def ingest_log(tmp: Path) -> str:
    return (tmp / "ingest.log").read_text()


async def rejoined(p: Pipeline, kv: Any, pub: EventPublisher, indexer: Any, tmp: Path) -> None:
    """The worker, removed once, registered again as a new incarnation: its old blocks are gone from the
    index and what its engine stores next is indexed."""
    await eventually(lambda: read_key(kv, W), lambda k: k.kind == "record", timeout_s=10)
    await expect(p, [T], [{"w/0": 0}])
    pub.publish([stored([4], blk(T, 0))])
    await expect(p, [T], [{"w/0": 1}])
    assert indexer.removals_published == 1
    assert "rejoining as a new incarnation" in ingest_log(tmp)


async def freeze_until_expired(proc: subprocess.Popen[bytes], kv: Any, hold_s: float) -> float:
    """SIGSTOP the ingest until its key has aged out (the server's marker) and ``hold_s`` more have passed;
    SIGCONT it. Returns the seconds it stayed frozen after the marker."""
    loop = asyncio.get_running_loop()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        await eventually(lambda: read_key(kv, W), lambda k: k.kind == "expired", timeout_s=TTL_S + 10)
        marker_at = loop.time()
        await asyncio.sleep(hold_s)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    return loop.time() - marker_at


async def test_a_worker_back_within_the_grace_keeps_its_cache(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    async with fleet(nats_url, uid, tmp_path) as (p, proc, kv):
        pub: EventPublisher = p.publisher  # type: ignore[attr-defined]
        await index_two_blocks(p, pub)
        frozen = await freeze_until_expired(proc, kv, hold_s=0.5)
        assert frozen < GRACE_S - 0.5, f"frozen {frozen:.1f} s past the marker: too close to the grace"
        back = await eventually(lambda: read_key(kv, W), lambda k: k.kind == "record", timeout_s=GRACE_S)
        assert back.kind == "record"
        await asyncio.sleep(GRACE_S + 1.0)  # past the claim the indexer would have made
        assert p.indexer is not None
        assert p.indexer.removals_published == 0
        assert (await read_key(kv, W)).kind == "record"
        await expect(p, [T], [{"w/0": 2}])
        pub.publish([stored([3], blk(T, 2), parent=2)])  # the same incarnation goes on
        await expect(p, [T], [{"w/0": 3}])
        log = ingest_log(tmp_path)
        assert "registering again with the same incarnation" in log
        assert "rejoining as a new incarnation" not in log


async def test_a_worker_back_after_the_grace_rejoins_as_a_new_incarnation(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    async with fleet(nats_url, uid, tmp_path) as (p, proc, kv):
        pub: EventPublisher = p.publisher  # type: ignore[attr-defined]
        await index_two_blocks(p, pub)
        assert p.indexer is not None
        indexer = p.indexer
        await freeze_until_expired(proc, kv, hold_s=0.0)
        os.kill(proc.pid, signal.SIGSTOP)  # frozen again until an indexer has claimed the expiry
        try:
            await eventually(lambda: read_key(kv, W), lambda k: k.kind == "deleted", timeout_s=GRACE_S + 10)
            await eventually(
                lambda: asyncio.sleep(0, indexer.removals_published), lambda n: n == 1, timeout_s=10
            )
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        await rejoined(p, kv, pub, indexer, tmp_path)


async def test_a_worker_back_after_its_removal_aged_out_still_rejoins(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    """Frozen until the indexer's claim (a delete) has aged out into a marker of its own: the key then looks
    like a plain expiry, but the worker was removed, so the ingest must not keep its incarnation (the index
    would drop everything it sends as stale)."""
    async with fleet(nats_url, uid, tmp_path) as (p, proc, kv):
        pub: EventPublisher = p.publisher  # type: ignore[attr-defined]
        pub.publish([stored([1], blk(T, 0))])
        await expect(p, [T], [{"w/0": 1}])
        assert p.indexer is not None
        indexer = p.indexer
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            await eventually(lambda: read_key(kv, W), lambda k: k.kind == "deleted", timeout_s=3 * TTL_S + 5)
            await eventually(lambda: read_key(kv, W), lambda k: k.kind == "expired", timeout_s=TTL_S + 5)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        await rejoined(p, kv, pub, indexer, tmp_path)


async def test_an_indexer_started_during_the_outage_claims_before_it_removes(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    """An indexer that starts while the worker's key is an age-out marker (its watch delivers the marker
    among the initial values, with no record seen before it) gives the worker the same grace: back within
    it, nothing is removed, by it or by its reconcile of the registry members."""
    async with fleet(nats_url, uid, tmp_path) as (p, proc, kv):
        pub: EventPublisher = p.publisher  # type: ignore[attr-defined]
        await index_two_blocks(p, pub)
        first = p.indexer
        assert first is not None
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            first.stop()
            await eventually(lambda: read_key(kv, W), lambda k: k.kind == "expired", timeout_s=TTL_S + 10)
            second = await p.start_indexer(worker_ttl_s=TTL_S, expiry_grace_s=GRACE_S, buckets_memory=True)
            await asyncio.sleep(0.5)  # its watch has delivered the marker
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        await eventually(lambda: read_key(kv, W), lambda k: k.kind == "record", timeout_s=GRACE_S)
        await asyncio.sleep(GRACE_S + 1.0)
        assert (first.removals_published, second.removals_published) == (0, 0)
        assert (await read_key(kv, W)).kind == "record"
        held = second.state.workers()[W]
        assert (held["blocks"], held["removed"]) == (2, False)
        assert "rejoining as a new incarnation" not in ingest_log(tmp_path)


async def test_a_grace_longer_than_the_markers_live_is_capped(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    """The registry's markers live one TTL (3 s here): a claim after that finds nothing to race, so a 5 s
    grace is used as 2 s."""
    async with fleet(nats_url, uid, tmp_path) as (p, _proc, _kv):
        capped = await p.start_indexer(worker_ttl_s=TTL_S, expiry_grace_s=5.0, buckets_memory=True)
        got = await eventually(lambda: asyncio.sleep(0, capped.expiry_grace_s), lambda g: g != 5.0)
        assert got == 2.0
