"""Indexer recovery with a real NATS server: SIGKILL and restart from a snapshot, corrupt snapshots, gaps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tests.indexers import group, wait_for

from kvmesh.core.snapshot import HEADER_SIZE
from kvmesh.runtime import subjects
from kvmesh.runtime.snapshots import SnapshotStore, snapshot_name

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

PROMPT = list(range(64))
SPAWN_S = 40.0


@pytest.mark.slow
async def test_sigkilled_indexer_restarts_from_its_snapshot_equal_to_a_live_replica(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    """A replica process killed with SIGKILL mid-stream restarts from its last snapshot, reads only what follows, and matches the live replica."""
    async with group(nats_url, uid, log_dir=tmp_path) as g:
        proc_kw = {"match_subject": f"r{uid}.proc", "snapshot_every_messages": 100}
        proc = g.spawn(f"{uid}-proc", **proc_kw)
        # A child process starts in about a second, much slower on a loaded machine: give it time.
        await wait_for(
            g.status, lambda s: f"{uid}-proc" in s and s[f"{uid}-proc"].snapshot_writer, timeout_s=SPAWN_S
        )
        live = await g.start(
            f"{uid}-live", match_subject=f"r{uid}.live"
        )  # not the lease holder: never writes
        await g.publish(250)
        # The first snapshot comes once 100 messages are read, at whatever sequence the snapshot loop sees
        # then (up to 250 on a loaded machine); a second one needs 100 more, which 250 may not leave.
        await wait_for(
            g.status,
            lambda s: (s[f"{uid}-proc"].snapshots["last"] or {}).get("applied_seq", 0) >= 100,
            timeout_s=SPAWN_S,
        )
        feeding = asyncio.create_task(g.publish(200))
        await asyncio.sleep(0.05)
        proc.kill()  # SIGKILL while messages flow
        proc.wait()
        last = await feeding
        assert last == 450
        store = await SnapshotStore.open(g.js, subjects.snapshot_bucket(g.stream))
        newest = (await store.list())[0]
        g.spawn(f"{uid}-proc", **proc_kw)
        st = await wait_for(
            g.status, lambda s: f"{uid}-proc" in s and s[f"{uid}-proc"].ready, timeout_s=SPAWN_S
        )
        restarted = st[f"{uid}-proc"]
        assert restarted.recovery["snapshot_seq"] == newest.applied_seq
        assert restarted.recovery["read_to_ready"] == 450 - newest.applied_seq
        st = await wait_for(
            g.status, lambda s: [s[r].applied_seq for r in sorted(s)] == [450, 450], timeout_s=SPAWN_S
        )
        assert st[f"{uid}-live"].digest == st[f"{uid}-proc"].digest
        assert st[f"{uid}-live"].blocks == st[f"{uid}-proc"].blocks == live.state.block_total()
        assert await g.match(f"r{uid}.live", PROMPT) == await g.match(f"r{uid}.proc", PROMPT)


async def test_corrupted_newest_snapshot_is_skipped_for_the_previous_one(nats_url: str, uid: str) -> None:
    """A newest snapshot whose body was altered fails its checksum; the replica starts from the one before."""
    async with group(nats_url, uid) as g:
        writer = await g.start(f"{uid}-w")
        await g.publish(30)
        await wait_for(lambda: _seq(writer), lambda s: s == 30)
        assert (await writer.snapshot())["applied_seq"] == 30
        await g.publish(20)
        await wait_for(lambda: _seq(writer), lambda s: s == 50)
        assert (await writer.snapshot())["applied_seq"] == 50
        store = await SnapshotStore.open(g.js, subjects.snapshot_bucket(g.stream))
        data = bytearray(await store.get(snapshot_name(50)))
        data[HEADER_SIZE + 100] ^= 0x55
        await store.put_raw(snapshot_name(50), bytes(data))
        fresh = await g.start(f"{uid}-f")
        assert fresh.recovery["snapshot"] == snapshot_name(30)
        assert fresh.recovery["skipped"] == [[snapshot_name(50), "checksum"]]
        assert fresh.recovery["read_to_ready"] == 20
        assert fresh.state.digest() == writer.state.digest()


async def test_stream_gap_without_covering_snapshot_marks_workers_incomplete(nats_url: str, uid: str) -> None:
    """Messages purged with no snapshot to cover them: the replica starts from what the stream holds and says it is incomplete."""
    async with group(nats_url, uid) as g:
        await g.publish(20, workers=2)
        await g.js.purge_stream(g.stream, seq=11)
        r = await g.start(f"{uid}-r")
        assert r.recovery["gap"] == [1, 10]
        assert r.recovery["read_to_ready"] == 10
        status = (await g.status())[f"{uid}-r"]
        assert (status.complete, status.incomplete) == (False, ["w0/0", "w1/0"])


async def _seq(svc: object) -> int:
    return int(svc.state.applied_seq)  # type: ignore[attr-defined]


async def test_replica_becomes_ready_when_the_last_message_was_deleted(nats_url: str, uid: str) -> None:
    """An operator deleted the stream's last message: a new replica still becomes ready on what is left."""
    async with group(nats_url, uid) as g:
        last = await g.publish(12, workers=2)
        await g.js.delete_msg(g.stream, last)
        r = await asyncio.wait_for(g.start(f"{uid}-r"), 20)
        assert r.ready.is_set()
        assert r.state.applied_seq == last - 1


async def test_a_deeply_nested_message_is_skipped_not_fatal(nats_url: str, uid: str) -> None:
    """A stream message nested 50,000 maps deep is counted and skipped; the replica applies what follows."""
    async with group(nats_url, uid) as g:
        await g.publish(4, workers=2)
        await g.js.publish(f"{g.prefix}.x.y.0", b"\x81\xa1a" * 50_000 + b"\x01")
        last = await g.publish(4, workers=2)
        r = await g.start(f"{uid}-r")
        assert r.ready.is_set()
        await wait_for(lambda: _seq(r), lambda s: s == last)
        assert r.decode_errors == 1
        assert r.state.block_total() == 8 * 4


async def test_local_index_router_restores_from_the_indexers_snapshot_and_follows(
    nats_url: str, uid: str
) -> None:
    """``kvmesh router --index local`` after the stream was purged behind a snapshot: the router's replica
    starts from the indexer's snapshot, reads exactly the messages after it, follows new ones, and holds the
    indexer's digest; its route answers match the indexer's overlaps."""
    from kvmesh.client import Router
    from kvmesh.router.config import RouterSettings
    from kvmesh.router.service import RouterService

    async with group(nats_url, uid) as g:
        writer = await g.start(f"{uid}-w")
        await g.publish(40)
        await wait_for(lambda: _seq(writer), lambda s: s == 40)
        assert (await writer.snapshot())["applied_seq"] == 40
        await g.js.purge_stream(g.stream, seq=41)  # only the snapshot knows messages 1-40 now
        await g.publish(12)
        await wait_for(lambda: _seq(writer), lambda s: s == 52)
        assert (await g.js.stream_info(g.stream)).state.first_seq == 41

        router = RouterService(
            RouterSettings(
                nats_url=nats_url,
                route_subject=f"r{uid}.route",
                index="local",
                stream=g.stream,
                events_prefix=g.prefix,
            )
        )
        task = asyncio.create_task(router.run())
        try:
            await asyncio.wait_for(router.ready.wait(), 15)
            replica = router.replica
            assert replica is not None
            assert (replica.recovery["snapshot"], replica.recovery["start_seq"]) == (snapshot_name(40), 41)
            assert (replica.read_messages, replica.state.applied_seq) == (12, 52)
            assert replica.state.digest() == writer.state.digest()
            await g.publish(3)
            await wait_for(lambda: _seq(router.replica), lambda s: s == 55)
            await wait_for(lambda: _seq(writer), lambda s: s == 55)
            assert replica.state.digest() == writer.state.digest()

            client = Router(g.nc, subject=f"r{uid}.route", timeout_s=3.0)
            reply = await client.route("m", PROMPT, explain=True)
            remote = await g.match(f"r{uid}.match", PROMPT)
            assert reply.index_seq == remote.index_seq == 55
            assert reply.scores is not None
            assert {(s.worker_id, s.overlap_blocks) for s in reply.scores} == {
                (c.worker_id, c.overlap_blocks) for c in remote.candidates
            }
        finally:
            router.stop()
            await asyncio.wait_for(task, 10)
