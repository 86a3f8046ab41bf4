"""The ingest's registry side and its start-up rules, against a real nats-server and real ZMQ publishers.

Liveness checks that create no server state, a clean stop that deregisters, a restart after a removal that
starts a new incarnation, message ids unique per ingest process, dp ranks validated, a fresh ingest that
replays the engine's buffer, and replay replies of another engine's topic refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import nats.js.errors
import pytest
from tests.pipeline import Pipeline, eventually, overlaps
from tests.test_ingest_faults import BS, T, U, blk, clean_pipeline, expect, stored

from kvmesh.client import RouteError
from kvmesh.core.events import EventsMessage, decode_message
from kvmesh.core.protocol import WorkerRecord
from kvmesh.core.wire import EngineBatch, encode_batch
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.service import IngestService
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect
from kvmesh.runtime.registry import (
    RegistrySettings,
    deregister,
    heartbeat,
    key_present,
    list_workers,
    open_registry,
    registry_keys,
)
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

ANY = "tcp://127.0.0.1:*"
W = "w"


@contextlib.asynccontextmanager
async def js_client(nats_url: str) -> Any:
    """A NATS connection's JetStream context for the test's own reads."""
    nc = await connect(nats_url, name="test-registry")
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


async def consumers(js: Any, stream: str) -> int:
    """Consumers of ``stream`` on the server right now."""
    return int((await js.stream_info(stream)).state.consumer_count)


async def last_seq(js: Any, stream: str) -> int:
    """Last sequence of ``stream``."""
    return int((await js.stream_info(stream)).state.last_seq)


async def stream_subjects(js: Any, stream: str) -> dict[str, int]:
    """Subject → message count of every subject of ``stream``."""
    info = await js.stream_info(stream, subjects_filter=">")
    return dict(info.state.subjects or {})


async def start(p: Pipeline, worker: str, pub: EventPublisher, **kw: Any) -> IngestService:
    """Start an ingest for ``worker`` on ``pub`` (block size 4) and keep its task on the service."""
    ing = await p.start_ingest(
        worker, pub.endpoint, kw.pop("replay", pub.replay_endpoint), block_size=BS, **kw
    )
    ing._task = p.tasks[-1]  # type: ignore[attr-defined]
    return ing


async def stop(p: Pipeline, worker: str, *, clean: bool = True) -> None:
    """Stop ``worker``'s ingest: `stop()` (clean), or cancel its task (as a crash leaves the registry)."""
    svc = p.ingests.pop(worker)
    task = svc._task  # type: ignore[attr-defined]
    p.tasks.remove(task)
    if clean:
        svc.stop()
    else:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 15)


async def route_or_error(p: Pipeline) -> dict[str, int] | str:
    """The overlaps of T, or the route error's code (a removed last worker leaves the model unknown)."""
    try:
        return overlaps(await p.route(list(T), explain=True))
    except RouteError as exc:
        return exc.code


def bucket_stream(p: Pipeline) -> str:
    """The stream behind the pipeline's registry bucket."""
    return f"KV_{subjects.registry_bucket(p.stream)}"


# ---------------------------------------------------------------------------------------------- 1. no leak


async def test_heartbeats_leave_the_registry_stream_without_consumers(nats_url: str, uid: str) -> None:
    """Two ingests heartbeating every 0.2 s for 40 heartbeats leave the registry stream with 0 consumers."""
    pubs = [EventPublisher(ANY), EventPublisher(ANY)]
    try:
        async with clean_pipeline(nats_url, uid) as p, js_client(nats_url) as js:
            for i, pub in enumerate(pubs):
                await start(p, f"w{i}", pub, worker_ttl_s=0.6)
            stream = bucket_stream(p)
            await eventually(lambda: last_seq(js, stream), lambda n: n >= 40, timeout_s=30)
            assert await consumers(js, stream) == 0
    finally:
        for pub in pubs:
            pub.close()


async def test_listing_workers_creates_no_consumer(nats_url: str, uid: str) -> None:
    """`list_workers` and `registry_keys`, called 20 times, return the 3 records exactly and leave 0 consumers."""
    bucket = f"T_{uid}_WORKERS"
    async with js_client(nats_url) as js:
        kv = await open_registry(js, RegistrySettings(bucket=bucket, ttl_s=60.0, memory=True))
        try:
            records = {
                w: WorkerRecord(worker_id=w, model="m", dp_ranks=1, block_size=4, incarnation=i)
                for i, w in enumerate(["a", "b", "c"])
            }
            for rec in records.values():
                await heartbeat(kv, rec)
            await heartbeat(
                kv, WorkerRecord(worker_id="gone", model="m", dp_ranks=1, block_size=4, incarnation=0)
            )
            await deregister(kv, "gone")
            for _ in range(10):
                assert await list_workers(kv) == records
                assert await registry_keys(kv) >= {subjects.kv_key(w) for w in records}
            assert await consumers(js, f"KV_{bucket}") == 0
        finally:
            await js.delete_key_value(bucket)


# ---------------------------------------------------------------------------------------------- 2. definite


async def test_key_present_never_reports_a_re_put_key_gone(nats_url: str, uid: str) -> None:
    """A key re-put every 0.1 s with TTL 1 s reads present 300 times in a row; deleted or never put reads gone."""
    bucket = f"T_{uid}_WORKERS"
    async with js_client(nats_url) as js:
        kv = await open_registry(js, RegistrySettings(bucket=bucket, ttl_s=1.0, memory=True))
        rec = WorkerRecord(worker_id="w", model="m", dp_ranks=1, block_size=4, incarnation=0)

        async def keep_alive() -> None:
            while True:
                await heartbeat(kv, rec)
                await asyncio.sleep(0.1)

        await heartbeat(kv, rec)
        task = asyncio.create_task(keep_alive())
        try:
            answers = [await key_present(kv, "w") for _ in range(300)]
            assert answers.count(False) == 0
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        try:
            await deregister(kv, "w")
            assert await key_present(kv, "w") is False
            assert await key_present(kv, "never") is False
            await heartbeat(kv, rec)
            assert await key_present(kv, "w") is True
            # Aged out: the server leaves a marker (an empty value) or nothing.
            await eventually(lambda: key_present(kv, "w"), lambda present: present is False, timeout_s=15)
            assert await consumers(js, f"KV_{bucket}") == 0
        finally:
            await js.delete_key_value(bucket)


async def test_key_present_on_a_deleted_bucket_is_no_answer(nats_url: str, uid: str) -> None:
    """A check against a bucket deleted under it raises (no definite answer) rather than reporting the key gone."""
    bucket = f"T_{uid}_WORKERS"
    async with js_client(nats_url) as js:
        kv = await open_registry(js, RegistrySettings(bucket=bucket, ttl_s=60.0, memory=True))
        await heartbeat(kv, WorkerRecord(worker_id="w", model="m", dp_ranks=1, block_size=4, incarnation=0))
        await js.delete_key_value(bucket)
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await key_present(kv, "w")


# ---------------------------------------------------------------------------------------------- 4. clean stop


async def test_clean_stop_deletes_the_registry_key(nats_url: str, uid: str) -> None:
    """Right after a clean `stop()` the worker's registry key is deleted; a crash (cancel) leaves it."""
    pub = EventPublisher(ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p, js_client(nats_url) as js:
            kv = await open_registry(
                js, RegistrySettings(bucket=subjects.registry_bucket(p.stream), ttl_s=15.0, memory=True)
            )
            await start(p, W, pub)
            await start(p, "crashed", pub)
            await eventually(lambda: key_present(kv, W), bool)
            await eventually(lambda: key_present(kv, "crashed"), bool)
            await stop(p, W)
            assert await key_present(kv, W) is False
            await stop(p, "crashed", clean=False)
            assert await key_present(kv, "crashed") is True
    finally:
        pub.close()


# ---------------------------------------------------------------------------------------------- 5. msg ids


async def test_reused_worker_id_under_another_model_is_stored_in_full(nats_url: str, uid: str) -> None:
    """Ingest B re-using worker id w under another model within the duplicate window has all 4 messages stored."""
    a, b = EventPublisher(ANY), EventPublisher(ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p, js_client(nats_url) as js:
            await start(p, W, a, model="m1")
            await a.wait_for_subscribers(1)
            for i in range(3):
                a.publish([stored([i + 1], blk(T, i), parent=i or None)])
            await eventually(lambda: last_seq(js, p.stream), lambda n: n == 4)  # hello + 3
            await stop(p, W)
            await start(p, W, b, model="m2")
            await b.wait_for_subscribers(1)
            for i in range(3):  # engine seqs 0, 1, 2 again
                b.publish([stored([i + 1], blk(T, i), parent=i or None)])
            m2 = subjects.events_subject(p.prefix, "m2", W, 0)
            await eventually(lambda: stream_subjects(js, p.stream), lambda s: s.get(m2, 0) >= 4, timeout_s=5)
            assert (await js.stream_info(p.stream)).state.messages == 8
            assert (await stream_subjects(js, p.stream))[m2] == 4
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------------------------------------- 6. rejoin


async def test_ingest_restarted_after_its_worker_was_removed_is_routable_again(
    nats_url: str, uid: str
) -> None:
    """An ingest restarted after its worker's removal starts a new incarnation, replays, and routes 4 blocks."""
    pub = EventPublisher(ANY, ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p, js_client(nats_url) as js:
            await start(p, W, pub, worker_ttl_s=60.0)
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            pub.publish([stored([1], blk(T, 0))])
            pub.publish([stored([2], blk(T, 1), parent=1)])
            await expect(p, [T], [{"w/0": 2}])
            await stop(p, W, clean=False)  # a crash: the key stays until it is deleted below
            kv = await js.key_value(subjects.registry_bucket(p.stream))
            await deregister(kv, W)
            await eventually(lambda: route_or_error(p), lambda r: r in ("unknown_model", "no_workers", {}))
            pub.publish([stored([3], blk(T, 2), parent=2)])  # missed live
            ing = await start(p, W, pub, worker_ttl_s=60.0)
            await pub.wait_for_subscribers(2)
            pub.publish([stored([4], blk(T, 3), parent=3)])
            await expect(p, [T, U], [{"w/0": 4}, {"w/0": 0}])
            st = ing.status().ranks["0"]
            assert (st.epoch, st.last_seq, st.sequence["replayed_batches"]) == (1, 3, 3)
    finally:
        pub.close()


async def test_cleanly_restarted_ingest_rejoins_and_replays_the_engine_buffer(
    nats_url: str, uid: str
) -> None:
    """A clean stop removes the worker; the restarted ingest starts incarnation 1 and replays all 5 batches."""
    pub = EventPublisher(ANY, ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p, js_client(nats_url) as js:
            await start(p, W, pub)
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            pub.publish([stored([1], blk(T, 0))])
            pub.publish([stored([2], blk(T, 1), parent=1)])
            await expect(p, [T], [{"w/0": 2}])
            await stop(p, W)
            await eventually(lambda: route_or_error(p), lambda r: r in ("unknown_model", "no_workers", {}))
            pub.publish([stored([3], blk(T, 2), parent=2)])  # nobody reads these live
            pub.publish([stored([10, 11], U)])
            ing = await start(p, W, pub)
            await pub.wait_for_subscribers(2)
            pub.publish([stored([4], blk(T, 3), parent=3)])
            await expect(p, [T, U], [{"w/0": 4}, {"w/0": 2}])
            # hello + 2, the removal, the rejoin hello (a Cleared), seqs 0-3 replayed, seq 4 live
            assert (await js.stream_info(p.stream)).state.messages == 10
            st = ing.status().ranks["0"]
            assert (st.epoch, st.last_seq, st.sequence["replayed_batches"]) == (1, 4, 4)
    finally:
        pub.close()


# ---------------------------------------------------------------------------------------------- 8. dp ranks


def _batch(dp_rank: int, hashes: list[int], tokens: list[int]) -> bytes:
    return encode_batch(
        EngineBatch(ts=time.time(), events=(stored(hashes, tokens),), dp_rank=dp_rank),
        producer="vllm",
        version="0.33.0",
        hash_form="int",
    )


async def test_batches_with_dp_ranks_this_ingest_does_not_read_are_rejected(nats_url: str, uid: str) -> None:
    """Ranks -5, 2**62 and 7 on a one-rank ingest make no subject; 3 batches and 3 events are counted rejected,
    and their seqs are still covered (empty messages), so the index sees no gap in rank 0's sequence."""
    pub = EventPublisher(ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p, js_client(nats_url) as js:
            ing = await start(p, W, pub)
            await pub.wait_for_subscribers(1)
            for i, rank in enumerate([-5, 2**62, 7]):
                pub.publish_raw(_batch(rank, [10 + i], blk(U, 0)))
            pub.publish([stored([1], blk(T, 0))])
            rank0 = subjects.events_subject(p.prefix, p.model, W, 0)
            await eventually(lambda: stream_subjects(js, p.stream), lambda s: s.get(rank0, 0) == 5)
            # hello, three empty messages covering seqs 0-2, the rank-0 batch (seq 3)
            assert await stream_subjects(js, p.stream) == {rank0: 5}
            c = ing.counters
            assert (c.bad_dp_rank_batches, c.rejected_events, c.batches, c.published) == (3, 3, 4, 5)
            indexer = await p.start_indexer()
            assert indexer.state.holder_health() == {}
            assert indexer.state.counters.sequence_gaps == 0
    finally:
        pub.close()


def test_data_parallel_size_is_bounded() -> None:
    """--data-parallel-size 4097 (and 0) is a configuration error naming the bound; 4096 is accepted."""
    base = {"worker_id": "w", "model": "m"}
    assert IngestSettings(**base, data_parallel_size=4096).validate() == []  # type: ignore[arg-type]
    for bad in (0, 4097):
        (problem,) = IngestSettings(**base, data_parallel_size=bad).validate()  # type: ignore[arg-type]
        assert "--data-parallel-size must be in [1, 4096]" in problem


# ---------------------------------------------------------------------------------------------- 9. fresh


async def test_fresh_ingest_replays_what_the_engine_published_before_it(nats_url: str, uid: str) -> None:
    """An ingest with no cursor whose first live batch is seq 3 replays seqs 0-2 first: the route sees 4 blocks."""
    pub = EventPublisher(ANY, ANY)
    try:
        for i in range(3):  # nobody subscribed: only the replay buffer has them
            pub.publish([stored([i + 1], blk(T, i), parent=i or None)])
        async with clean_pipeline(nats_url, uid) as p:
            ing = await start(p, W, pub)
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            pub.publish([stored([4], blk(T, 3), parent=3)])
            await expect(p, [T], [{"w/0": 4}])
            seq = ing.status().ranks["0"].sequence
            assert (seq["replays"], seq["replayed_batches"], seq["healed"], seq["resyncs"]) == (1, 3, 1, 0)
    finally:
        pub.close()


# ---------------------------------------------------------------------------------------------- 15. restart


async def test_engine_restarted_while_its_ingest_was_down_is_a_new_epoch(nats_url: str, uid: str) -> None:
    """An engine restarted (seqs 0-4 again) while its ingest was down: the old blocks go, the new ones index."""
    pub = EventPublisher(ANY, ANY)
    v = list(range(300, 308))
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await start(p, W, pub)
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            pub.publish([stored([1], blk(T, 0))])
            pub.publish([stored([2], blk(T, 1), parent=1)])
            await expect(p, [T], [{"w/0": 2}])
            await stop(p, W, clean=False)  # a crash: the worker stays registered
            pub.restart()
            pub.publish([stored([10], blk(U, 0))])  # seq 0 of the new incarnation
            pub.publish([stored([11], blk(U, 1), parent=10)])  # seq 1: the stream's cursor, another batch
            pub.publish([stored([20], blk(v, 0))])
            ing = await start(p, W, pub)
            await pub.wait_for_subscribers(2)
            pub.publish([stored([21], blk(v, 1), parent=20)])  # seq 3: a gap after the cursor
            await expect(p, [T, U, v], [{"w/0": 0}, {"w/0": 2}, {"w/0": 2}])
            st = ing.status().ranks["0"]
            assert (st.epoch, st.last_seq, st.sequence["restarts"]) == (1, 3, 1)
    finally:
        pub.close()


# ---------------------------------------------------------------------------------------------- 19. topic


async def test_replay_replies_of_another_topic_are_refused(nats_url: str, uid: str) -> None:
    """A replay endpoint answering with topic "engB" to an "engA" ingest: its 2 replies are refused and counted."""
    live = EventPublisher(ANY, topic="engA")
    other = EventPublisher(ANY, ANY, topic="engB")
    try:
        for i in range(3):
            other.publish([stored([100 + i], blk(U, 0))])
        async with clean_pipeline(nats_url, uid) as p, js_client(nats_url) as js:
            ing = await start(p, W, live, replay=other.replay_endpoint, topic="engA")
            await live.wait_for_subscribers(1)
            live.publish([stored([1], blk(T, 0))])  # seq 0 live
            await eventually(lambda: asyncio.sleep(0, ing.counters.published), lambda n: n == 2)
            live.drop_next(1)
            live.publish([stored([2], blk(T, 1), parent=1)])  # seq 1, lost live
            live.publish([stored([3], blk(T, 2), parent=2)])  # seq 2: gap, replay asks "engB" from 1
            await eventually(
                lambda: asyncio.sleep(0, ing.status().ranks["0"]),
                lambda r: r.sequence["replays"] == 1 and not r.replaying,
            )
            assert ing.counters.bad_replay_topics == 2
            seq = ing.status().ranks["0"].sequence
            assert (seq["replayed_batches"], seq["resyncs"], seq["healed"]) == (0, 1, 0)
            msgs = [await js.get_msg(p.stream, seq=s) for s in range(1, await last_seq(js, p.stream) + 1)]
            decoded = [decode_message(m.data or b"") for m in msgs]
            assert [
                (m.seq, [type(e).__name__ for e in m.events]) for m in decoded if isinstance(m, EventsMessage)
            ] == [
                (-1, []),
                (0, ["Stored"]),
                (0, ["Cleared"]),
                (2, ["Stored"]),
            ]
    finally:
        live.close()
        other.close()
