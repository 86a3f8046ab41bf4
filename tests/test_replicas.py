"""Indexer replicas with a real NATS server: equal state at equal sequences, and worker departure."""

from __future__ import annotations

import time

import pytest
from tests.indexers import MODEL, group, wait_for

from kvmesh.core.protocol import WorkerRecord
from kvmesh.runtime import subjects
from kvmesh.runtime.registry import RegistrySettings, heartbeat, open_registry

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def test_replica_restarted_from_snapshot_equals_one_never_stopped(nats_url: str, uid: str) -> None:
    """A replica restarted from a snapshot reads only the stream after it and ends with the never-stopped replica's digest."""
    async with group(nats_url, uid) as g:
        a = await g.start(f"{uid}-a")
        b = await g.start(f"{uid}-b")
        await g.publish(120)
        await wait_for(lambda: _seqs(a, b), lambda s: s == (120, 120))
        await g.stop_replica(b)
        await g.publish(60)
        await wait_for(lambda: _seqs(a), lambda s: s == (180,))
        written = await a.snapshot()
        assert (written["written"], written["applied_seq"], written["name"]) == (
            True,
            180,
            f"snap-{180:020d}",
        )
        last = await g.publish(40)
        assert last == 220
        c = await g.start(f"{uid}-c")
        assert c.recovery["snapshot_seq"] == 180
        assert c.recovery["read_to_ready"] == 40
        await wait_for(lambda: _seqs(a, c), lambda s: s == (220, 220))
        assert c.state.digest() == a.state.digest()
        assert c.state.block_total() == a.state.block_total() == 880
        status = await g.status()
        assert sorted(status) == [f"{uid}-a", f"{uid}-c"]
        assert status[f"{uid}-a"].digest == status[f"{uid}-c"].digest
        assert [status[r].complete for r in sorted(status)] == [True, True]


async def _seqs(*replicas: object) -> tuple[int, ...]:
    return tuple(r.state.applied_seq for r in replicas)  # type: ignore[attr-defined]


async def test_worker_whose_heartbeat_stops_is_removed_by_every_replica_at_one_sequence(
    nats_url: str, uid: str
) -> None:
    """A worker's registry key expires: one WorkerRemoved enters the stream and both replicas drop the worker there."""
    async with group(nats_url, uid) as g:
        kv = await open_registry(
            g.js, RegistrySettings(bucket=subjects.registry_bucket(g.stream), ttl_s=1.0, memory=True)
        )
        a = await g.start(f"{uid}-a", worker_ttl_s=1.0)
        b = await g.start(f"{uid}-b", worker_ttl_s=1.0)
        for w in ("w0", "w1"):
            await heartbeat(
                kv, WorkerRecord(worker_id=w, model=MODEL, dp_ranks=1, block_size=4, incarnation=0)
            )
        await g.publish(40, workers=2)
        await wait_for(lambda: _seqs(a, b), lambda s: s == (40, 40))
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:  # w0 keeps beating, w1 stops
            await heartbeat(
                kv, WorkerRecord(worker_id="w0", model=MODEL, dp_ranks=1, block_size=4, incarnation=0)
            )
            await _sleep(0.3)
        await wait_for(lambda: _seqs(a, b), lambda s: s == (41, 41))
        removal = await g.js.get_last_msg(g.stream, subjects.control_subject(g.prefix))
        assert removal.seq == 41
        info = await g.js.stream_info(g.stream)
        assert info.state.messages == 41  # both replicas published; the server dropped the duplicate
        for r in (a, b):
            assert r.state.workers()["w1"]["removed"] is True
            assert r.state.workers()["w0"]["removed"] is False
            assert [c.worker_id for c in r.state.match(MODEL, list(range(8))).candidates] == ["w0"]
        assert a.state.digest() == b.state.digest()
        assert a.removals_published + b.removals_published == 2


async def _sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)
