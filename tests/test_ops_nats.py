"""`kvmesh.ops` against a real nats-server and real indexer replicas: typed results, errors by class."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
from tests.indexers import MODEL, group, wait_for

from kvmesh import ops
from kvmesh.core.errors import SnapshotNotFoundError, StreamUnavailableError, TransportError
from kvmesh.core.protocol import IngestStatus, RequestRef, SnapshotResult, decode
from kvmesh.runtime import subjects
from kvmesh.runtime.snapshots import snapshot_name

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def test_status_returns_typed_replicas_snapshots_and_stream(nats_url: str, uid: str) -> None:
    """`ops.status` decodes each replica's reply as a ReplicaStatus with its lag, lists the snapshot written,
    reads an empty registry as no workers registered, and reports no undecodable reply."""
    async with group(nats_url, uid) as g:
        a = await g.start(f"{uid}-a")
        await g.publish(12, workers=1)
        await wait_for(lambda: asyncio.sleep(0, a.state.applied_seq), lambda s: s == 12)
        written = await a.snapshot()
        await g.publish(3, workers=1)
        await wait_for(lambda: asyncio.sleep(0, a.state.applied_seq), lambda s: s == 15)

        report = await ops.status(g.nc, stream=g.stream, wait_s=0.5)
        assert report.stream == ops.StreamState(
            name=g.stream, messages=15, bytes=report.stream.bytes, first_seq=1, last_seq=15
        )
        [replica] = report.replicas
        assert isinstance(replica, ops.ReplicaStatus)
        assert (replica.replica, replica.applied_seq, replica.lag, replica.blocks) == (f"{uid}-a", 15, 0, 60)
        assert replica.warning is msgspec.UNSET
        assert replica.digest == f"{a.state.digest():016x}"
        assert isinstance(report.snapshots, list)
        assert [(s.name, s.seq, s.bytes) for s in report.snapshots] == [
            (snapshot_name(12), 12, written["bytes"])
        ]
        assert isinstance(report.workers, dict)
        assert sorted(report.workers) == ["w0"]
        assert (report.workers["w0"].registered, report.workers["w0"].model) == (False, MODEL)
        assert report.undecodable == []


async def test_status_lists_a_reply_that_does_not_decode_and_keeps_the_others(
    nats_url: str, uid: str
) -> None:
    """An ingest status reply of the wrong shape is named in ``undecodable`` (with the field at fault) while
    a well-formed one on the same subject is returned as an IngestStatus."""
    async with group(nats_url, uid) as g:
        good = IngestStatus(worker_id=f"{uid}-ok", model=MODEL, outbox=0, counters={"batches": 2}, ranks={})

        async def answer(msg: Any) -> None:
            await msg.respond(msgspec.json.encode(good))

        async def garbage(msg: Any) -> None:
            await msg.respond(b'{"worker_id": 7}')

        subs = [
            await g.nc.subscribe(f"{subjects.STATUS_SUBJECT}.ingest", cb=answer),
            await g.nc.subscribe(f"{subjects.STATUS_SUBJECT}.ingest", cb=garbage),
        ]
        await g.nc.flush()
        try:
            report = await ops.status(g.nc, stream=g.stream, wait_s=0.5)
        finally:
            for sub in subs:
                await sub.unsubscribe()
        assert [i for i in report.ingests if i.worker_id.startswith(uid)] == [good]
        assert report.undecodable == [
            "kvmesh.index.status.ingest: bad IngestStatus: Expected `str`, got `int` - at `$.worker_id`"
        ]


async def test_status_of_a_missing_stream_is_reported_not_raised(nats_url: str, uid: str) -> None:
    """For a stream that does not exist, `ops.status` returns the stream's name with STREAM_NOT_FOUND and no
    replicas, snapshots or workers of it."""
    async with group(nats_url, uid) as g:
        report = await ops.status(g.nc, stream=f"NOPE_{uid}", wait_s=0.2)
        assert report.stream == ops.StreamState(name=f"NOPE_{uid}", error=ops.STREAM_NOT_FOUND)
        assert (report.replicas, report.snapshots, report.workers) == ([], [], {})


async def test_snapshot_returns_the_written_result(nats_url: str, uid: str) -> None:
    """`ops.snapshot` returns the replies up to the written one: the lease holder's, at its applied sequence,
    with the names of the snapshots it deleted."""
    async with group(nats_url, uid) as g:
        a = await g.start(f"{uid}-a")
        await g.publish(20)
        await wait_for(lambda: asyncio.sleep(0, a.state.applied_seq), lambda s: s == 20)
        [result] = await ops.snapshot(g.nc, stream=g.stream, timeout_s=10)
        assert isinstance(result, SnapshotResult)
        assert (result.written, result.replica, result.stream, result.name, result.applied_seq) == (
            True,
            f"{uid}-a",
            g.stream,
            snapshot_name(20),
            20,
        )
        assert (result.deleted, result.reason) == ([], msgspec.UNSET)


async def test_snapshot_without_indexers_raises_transport_error(nats_url: str, uid: str) -> None:
    """With nothing subscribed to the snapshot subject, `ops.snapshot` raises TransportError at once, naming
    the subject and the stream."""
    async with group(nats_url, uid) as g:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TransportError) as info:
            await ops.snapshot(g.nc, stream=g.stream, timeout_s=20)
        assert loop.time() - t0 < 10
        assert str(info.value) == (
            "no indexer answered: nothing is subscribed to kvmesh.index.snapshot "
            f"(is an indexer of stream {g.stream} running?)"
        )


async def test_replay_returns_the_replicas_digest_and_raises_by_class(nats_url: str, uid: str) -> None:
    """`ops.replay` rebuilds the replica's index (same digest and size); a missing stream raises
    StreamUnavailableError and a sequence without a snapshot a SnapshotNotFoundError."""
    async with group(nats_url, uid) as g:
        a = await g.start(f"{uid}-a")
        await g.publish(25)
        await wait_for(lambda: asyncio.sleep(0, a.state.applied_seq), lambda s: s == 25)
        result = await ops.replay(g.nc, stream=g.stream)
        assert isinstance(result, ops.ReplayResult)
        assert (result.applied_seq, result.blocks, result.messages_read, result.digest, result.snapshot) == (
            25,
            100,
            25,
            f"{a.state.digest():016x}",
            None,
        )
        with pytest.raises(StreamUnavailableError) as missing:
            await ops.replay(g.nc, stream=f"NOPE_{uid}")
        assert str(missing.value) == f"stream NOPE_{uid} does not exist"
        with pytest.raises(SnapshotNotFoundError) as none:
            await ops.replay(g.nc, stream=g.stream, from_snapshot=7)
        assert str(none.value) == "no usable snapshot at seq 7 (skipped: not found)"


async def test_reset_returns_each_replica_applied(nats_url: str, uid: str) -> None:
    """`ops.reset` publishes epoch 1 after the stream's messages and returns every replica as having applied
    it, with an empty index."""
    async with group(nats_url, uid) as g:
        a = await g.start(f"{uid}-a")
        await g.publish(5)
        await wait_for(lambda: asyncio.sleep(0, a.state.applied_seq), lambda s: s == 5)
        result = await ops.reset(g.nc, stream=g.stream, reason="test", wait_s=10)
        assert result == ops.ResetResult(
            stream=g.stream,
            reset_epoch=1,
            seq=6,
            duplicate=False,
            replicas={f"{uid}-a": ops.ReplicaReset(applied=True, applied_seq=6, reset_epoch=1, blocks=0)},
        )
        assert result.applied


async def test_finish_publishes_one_note_per_request(nats_url: str, uid: str) -> None:
    """`ops.finish` publishes a RequestRef per request id on the finished subject (prefill_done on its own),
    flushed before it returns."""
    async with group(nats_url, uid) as g:
        prefix = f"t{uid}.requests"
        finished = await g.nc.subscribe(subjects.requests_subject(prefix, "finished"))
        prefill = await g.nc.subscribe(subjects.requests_subject(prefix, "prefill_done"))
        await g.nc.flush()
        await ops.finish(g.nc, ["r1", "r2"], requests_prefix=prefix)
        await ops.finish(g.nc, ["r3"], prefill_done=True, requests_prefix=prefix)
        got = [decode((await finished.next_msg(timeout=5)).data, RequestRef).request_id for _ in range(2)]
        assert got == ["r1", "r2"]
        assert decode((await prefill.next_msg(timeout=5)).data, RequestRef).request_id == "r3"


async def test_gather_replies_says_no_responders(nats_url: str, uid: str) -> None:
    """`gather_replies` on a subject nobody serves returns None at once instead of waiting out the window."""
    async with group(nats_url, uid) as g:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await ops.gather_replies(g.nc, f"t{uid}.nobody", b"", 20) is None
        assert loop.time() - t0 < 10
