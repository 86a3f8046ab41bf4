"""Workers whose heartbeats stopped while no indexer or router watched: a restarted one must not route to them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

import pytest
from tests.indexers import BS, MODEL, group, wait_for

from kvmesh.client import NoWorkersError, Router
from kvmesh.core import protocol
from kvmesh.core.protocol import ErrorReply, WorkerRecord
from kvmesh.router.config import RouterSettings
from kvmesh.router.service import RouterService
from kvmesh.runtime import subjects
from kvmesh.runtime.registry import RegistrySettings, heartbeat, open_registry, registry_keys
from kvmesh.runtime.snapshots import SnapshotStore

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

TTL_S = 2.0


def _record(worker: str) -> WorkerRecord:
    return WorkerRecord(worker_id=worker, model=MODEL, dp_ranks=1, block_size=BS, incarnation=0)


async def _beat(kv: object, workers: Iterable[str]) -> None:
    while True:
        for w in workers:
            await heartbeat(kv, _record(w))
        await asyncio.sleep(TTL_S / 4)


async def test_restarted_indexer_removes_a_member_whose_key_and_marker_are_gone(
    nats_url: str, uid: str
) -> None:
    """An indexer started after a registered worker's key expired and its delete marker aged out publishes
    the worker's removal once its registry watch has synced; the worker is no longer a candidate."""
    async with group(nats_url, uid) as g:
        bucket = subjects.registry_bucket(g.stream)
        kv = await open_registry(g.js, RegistrySettings(bucket=bucket, ttl_s=TTL_S, memory=True))
        both = asyncio.create_task(_beat(kv, ["w0", "w1"]))
        only_w0: asyncio.Task[None] | None = None
        try:
            a = await g.start(f"{uid}-a", worker_ttl_s=TTL_S)
            await g.publish(20, workers=2)
            store = await SnapshotStore.open(g.js, subjects.snapshot_bucket(g.stream))
            await wait_for(store.members, lambda m: m == {"w0": MODEL, "w1": MODEL})
            await g.stop_replica(a)
            both.cancel()
            only_w0 = asyncio.create_task(_beat(kv, ["w0"]))
            await wait_for(lambda: registry_keys(kv), lambda k: k == {subjects.kv_key("w0")}, timeout_s=20)
            b = await g.start(f"{uid}-b", worker_ttl_s=TTL_S)
            await wait_for(lambda: asyncio.sleep(0, b.state.applied_seq), lambda s: s == 21)
            assert b.state.workers()["w1"]["removed"] is True
            assert b.state.workers()["w0"]["removed"] is False
            assert [c.worker_id for c in b.state.match(MODEL, list(range(8))).candidates] == ["w0"]
            assert b.removals_published == 1
        finally:
            for t in (both, only_w0):
                if t is not None:
                    t.cancel()


async def test_restarted_router_does_not_route_to_the_dead_only_worker_of_a_model(
    nats_url: str, uid: str
) -> None:
    """A local-index router started after the only worker of a model stopped heartbeating (no indexer ran to
    remove it) answers no_workers instead of routing to the dead worker."""
    async with group(nats_url, uid) as g:
        bucket = subjects.registry_bucket(g.stream)
        kv = await open_registry(g.js, RegistrySettings(bucket=bucket, ttl_s=TTL_S, memory=True))
        beating = asyncio.create_task(_beat(kv, ["w0"]))
        try:
            a = await g.start(f"{uid}-a", worker_ttl_s=TTL_S)
            await g.publish(10, workers=1)
            store = await SnapshotStore.open(g.js, subjects.snapshot_bucket(g.stream))
            await wait_for(store.members, lambda m: m == {"w0": MODEL})
            await g.stop_replica(a)
        finally:
            beating.cancel()
        await wait_for(lambda: registry_keys(kv), lambda k: k == set(), timeout_s=20)
        router = RouterService(
            RouterSettings(
                nats_url=nats_url,
                route_subject=f"r{uid}.route",
                requests_prefix=f"r{uid}.requests",
                index="local",
                stream=g.stream,
                events_prefix=g.prefix,
                sync_timeout_s=0.1,
            )
        )
        task = asyncio.create_task(router.run())
        try:
            await asyncio.wait_for(router.ready.wait(), 15)
            assert router.replica is not None and router.replica.state.live_worker("w0") is not None
            watcher = router.registry
            await wait_for(lambda: asyncio.sleep(0, getattr(watcher, "synced", False)), lambda s: s is True)
            with pytest.raises(NoWorkersError) as err:
                await Router(g.nc, subject=f"r{uid}.route", timeout_s=3.0).route(MODEL, list(range(8)))
            assert "left the worker registry" in err.value.message
        finally:
            router.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)


async def test_match_on_deeply_nested_msgpack_answers_bad_request(nats_url: str, uid: str) -> None:
    """A match request nested 50,000 maps deep gets a bad_request error reply, and the indexer keeps serving."""
    async with group(nats_url, uid) as g:
        await g.start(f"{uid}-a")
        reply = await g.nc.request(f"r{uid}.match", b"\x81\xa1a" * 50_000 + b"\x01", timeout=3)
        body = protocol.decode(reply.data, ErrorReply, format="msgpack")
        assert body.error.code == "bad_request"
        assert "nested too deeply" in body.error.message
        await g.publish(2, workers=1)
        answer = await wait_for(lambda: g.match(f"r{uid}.match", list(range(8))), lambda a: a is not None)
        assert [c.worker_id for c in answer.candidates] == ["w0"]  # still serving


async def test_restarted_indexer_keeps_a_live_member_its_watch_did_not_list(
    nats_url: str, uid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry watch's end of initial values can arrive before a key it should list (seen in the fault
    suite on an R3 bucket): a restarted indexer then reads the member's key itself and, finding it present,
    publishes no removal; the live worker keeps its blocks."""
    from kvmesh.indexer import policy

    class EarlyEnd(policy.RegistrySync):
        """A watch whose initial values end before any key arrives."""

        def end_of_initial(self) -> bool:
            self.registered.clear()
            return super().end_of_initial()

    async with group(nats_url, uid) as g:
        bucket = subjects.registry_bucket(g.stream)
        kv = await open_registry(g.js, RegistrySettings(bucket=bucket, ttl_s=TTL_S, memory=True))
        beating = asyncio.create_task(_beat(kv, ["w0"]))
        try:
            a = await g.start(f"{uid}-a", worker_ttl_s=TTL_S)
            await g.publish(10, workers=1)
            store = await SnapshotStore.open(g.js, subjects.snapshot_bucket(g.stream))
            await wait_for(store.members, lambda m: m == {"w0": MODEL})
            await g.stop_replica(a)
            monkeypatch.setattr(policy, "RegistrySync", EarlyEnd)
            b = await g.start(f"{uid}-b", worker_ttl_s=TTL_S)
            await wait_for(lambda: asyncio.sleep(0, b.state.applied_seq), lambda s: s == 10)
            await asyncio.sleep(1.0)  # the watch's initial values ended and were reconciled
            assert b.removals_published == 0
            assert b.state.workers()["w0"]["removed"] is False
            assert [c.worker_id for c in b.state.match(MODEL, list(range(8))).candidates] == ["w0"]
        finally:
            beating.cancel()
