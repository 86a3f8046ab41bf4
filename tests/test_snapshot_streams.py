"""Snapshots tied to their stream: a deleted and re-created stream, and objects planted beyond the stream."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from tests.indexers import Group, group, wait_for

from kvmesh.core.state import IndexState
from kvmesh.router.config import RouterSettings
from kvmesh.router.service import RouterService
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import StreamSettings, ensure_stream
from kvmesh.runtime.snapshots import SnapshotStore, replay_stream, snapshot_name, stream_id

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def _truth(g: Group) -> IndexState:
    """The state an index built from the stream as it is now holds."""
    info = await g.js.stream_info(g.stream)
    state = IndexState()
    await replay_stream(
        g.js, state, stream=g.stream, events_prefix=g.prefix, start_seq=1, to_seq=info.state.last_seq
    )
    return state


async def _view(r: Any) -> tuple[int, int]:
    return r.state.applied_seq, r.state.digest()


async def test_a_recreated_stream_is_followed_and_its_old_snapshots_are_never_used(
    nats_url: str, uid: str
) -> None:
    """Deleting and re-creating the events stream: a running indexer and a local-index router rebuild from the
    new stream on their own and hold its exact state; a replica started afterwards does not restore the old
    stream's snapshot, and the writer's prune drops the old stream's snapshots, not its new ones."""
    async with group(nats_url, uid) as g:
        writer = await g.start(f"{uid}-w")
        router = RouterService(
            RouterSettings(
                nats_url=nats_url,
                route_subject=f"r{uid}.route",
                requests_prefix=f"r{uid}.requests",
                index="local",
                stream=g.stream,
                events_prefix=g.prefix,
                use_registry=False,
                sync_timeout_s=0.1,
            )
        )
        task = asyncio.create_task(router.run())
        try:
            await asyncio.wait_for(router.ready.wait(), 15)
            await g.publish(20)
            await wait_for(lambda: _view(writer), lambda v: v[0] == 20)
            assert (await writer.snapshot())["applied_seq"] == 20
            old_id = stream_id(await g.js.stream_info(g.stream))
            await g.js.delete_stream(g.stream)
            await ensure_stream(
                g.js, StreamSettings(name=g.stream, prefix=g.prefix, memory=True, max_bytes=16 * 2**20)
            )
            new_id = stream_id(await g.js.stream_info(g.stream))
            assert new_id != old_id
            g.chains.clear()
            await g.publish(30)
            truth = await _truth(g)
            expected = (30, truth.digest())
            await wait_for(lambda: _view(writer), lambda v: v == expected, timeout_s=20)
            assert router.replica is not None
            await wait_for(lambda: _view(router.replica), lambda v: v == expected, timeout_s=20)
            assert router.replica.rebuilds == 1

            fresh = await g.start(f"{uid}-f")
            assert fresh.recovery["snapshot"] is None
            assert fresh.recovery["skipped"] == [
                [snapshot_name(20), "of another stream (deleted and re-created since)"]
            ]
            assert (fresh.state.applied_seq, fresh.state.digest()) == expected

            written = await writer.snapshot()
            assert (written["applied_seq"], written["deleted"]) == (30, [snapshot_name(20)])
            store = await SnapshotStore.open(g.js, subjects.snapshot_bucket(g.stream))
            assert [(e.name, e.stream_id) for e in await store.list()] == [(snapshot_name(30), new_id)]
        finally:
            router.stop()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)


async def test_snapshots_planted_beyond_the_stream_are_neither_kept_nor_purged_for(
    nats_url: str, uid: str
) -> None:
    """Objects named as snapshots far beyond the stream (10**15) do not count for prune or purge: the real
    snapshots stay, the purge cuts only what they cover, a new replica restores the newest real one complete,
    and a snapshot whose name disagrees with its header is skipped."""
    async with group(nats_url, uid) as g:
        writer = await g.start(f"{uid}-w")
        store = await SnapshotStore.open(g.js, subjects.snapshot_bucket(g.stream))
        await g.publish(10)
        await wait_for(lambda: _view(writer), lambda v: v[0] == 10)
        assert (await writer.snapshot())["applied_seq"] == 10
        real = await store.get(snapshot_name(10))
        identity = stream_id(await g.js.stream_info(g.stream))
        for k in range(3):
            await store.put_raw(snapshot_name(10**15 + k), real)
        await store.put(10**15 + 3, real, stream=identity)  # a described one beyond the stream
        for last in (20, 30):
            await g.publish(10)
            await wait_for(lambda: _view(writer), lambda v, last=last: v[0] == last)
            result = await writer.snapshot()
            assert result["applied_seq"] == last
            assert result["deleted"] == []
        assert result["purged_before"] == 11
        names = {e.name for e in await store.list()}
        assert {snapshot_name(s) for s in (10, 20, 30)} <= names
        await g.publish(10)
        await wait_for(lambda: _view(writer), lambda v: v[0] == 40)
        await store.put_raw(snapshot_name(35), await store.get(snapshot_name(30)))  # name says 35, header 30
        fresh = await g.start(f"{uid}-f")
        assert fresh.recovery["snapshot"] == snapshot_name(30)
        assert [snapshot_name(35), "name and content disagree"] in fresh.recovery["skipped"]
        assert fresh.state.gap_seq is None
        await wait_for(lambda: _view(fresh), lambda v: v == (40, writer.state.digest()))
