"""Per-holder stream order: a publish that fails while later ones land is detected from the acks and resynced.

Real nats-server, real ZMQ publisher, real `IngestService`. The single-server test makes the head publish of
a window fail (as `NoStreamResponseError` does during an R3 leader election) while later ones are stored; the
cluster test kills the leader of an R3 stream under traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from tests.pipeline import Pipeline, eventually
from tests.test_ingest_faults import BS, blk, clean_pipeline, stored

from kvmesh.bench.fleet import Cluster
from kvmesh.core.events import Cleared, EventsMessage, decode_message
from kvmesh.core.state import IndexState
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.service import IngestService
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import StreamSettings, connect, ensure_stream
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

T = TypeVar("T")

ANY = "tcp://127.0.0.1:*"
W = "w"
TOKENS = list(range(1000, 1000 + 4 * 64))


async def _settled(call: Callable[[], Awaitable[T]], timeout_s: float = 30.0) -> T:
    """``call()``, again while a cluster that just lost its stream leader answers JetStream requests with
    timeouts or 503s (the test's own reads, not the ingest, wait out the election)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def subject_messages(js: Any, stream: str, subject: str) -> list[EventsMessage]:
    """Every events message of ``subject``, in stream order (an ephemeral pull consumer, deleted after)."""
    info = await _settled(lambda: js.stream_info(stream, subjects_filter=subject))
    total = int((info.state.subjects or {}).get(subject, 0))
    sub = await _settled(
        lambda: js.pull_subscribe(subject, stream=stream, config=ConsumerConfig(ack_policy=AckPolicy.NONE))
    )
    out: list[EventsMessage] = []
    try:
        unavailable = 0
        while len(out) < total:
            try:
                batch = await sub.fetch(batch=min(500, total - len(out)), timeout=10)
            except nats.js.errors.ServiceUnavailableError:
                # A consumer of an R3 stream whose leader was just killed answers 503 until it has a leader
                # of its own again: the test's read, not the ingest, waits for it.
                unavailable += 1
                assert unavailable < 60, "the consumer had no leader for 30 s"
                await asyncio.sleep(0.5)
                continue
            for raw in batch:
                msg = decode_message(raw.data or b"")
                assert isinstance(msg, EventsMessage)
                out.append(msg)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return out


def inversions(msgs: list[EventsMessage]) -> list[tuple[int, int]]:
    """(epoch, seq) of every message that arrives below an earlier one of its subject."""
    bad: list[tuple[int, int]] = []
    top: tuple[int, int] | None = None
    for m in msgs:
        here = (m.epoch, m.seq)
        if top is not None and here < top:
            bad.append(here)
        else:
            top = here
    return bad


def replayed(msgs: list[EventsMessage]) -> IndexState:
    """An index replica's state after reading ``msgs`` in the order given."""
    state = IndexState()
    for k, m in enumerate(msgs):
        state.apply(k + 1, m)
    return state


def in_engine_order(msgs: list[EventsMessage]) -> list[EventsMessage]:
    """``msgs`` sorted by engine position (stable: ingest-made messages keep their place among equals)."""
    return sorted(msgs, key=lambda m: (m.epoch, m.seq if m.first_seq is None else m.first_seq, m.part))


async def test_duplicate_publish_ack_carries_the_original_stream_sequence(nats_url: str, uid: str) -> None:
    """A re-sent message id is acknowledged as a duplicate with the original's stream sequence (3, not 4)."""
    nc = await connect(nats_url, name="test-dup")
    js = nc.jetstream()
    stream = f"KVMESH_T_{uid}"
    try:
        await ensure_stream(js, StreamSettings(name=stream, prefix=f"t{uid}", memory=True, max_bytes=2**20))
        subject = f"t{uid}.x"
        for i in range(3):
            await js.publish(subject, b"%d" % i, headers={"Nats-Msg-Id": f"id{i}"})
        first = await js.publish(subject, b"again", headers={"Nats-Msg-Id": "id2"})
        assert (first.seq, first.duplicate) == (3, True)
        fut = await js.publish_async(subject, b"again", headers={"Nats-Msg-Id": "id1"})
        ack = await fut
        assert (ack.seq, ack.duplicate) == (2, True)
    finally:
        with contextlib.suppress(Exception):
            await js.delete_stream(stream)
        await nc.close()


def fail_once(ing: IngestService, match: str, delay_s: float) -> list[str]:
    """Make the first publish whose message id starts with ``match`` fail after ``delay_s`` without reaching
    the server (what a publish lost in a stream leader election looks like); returns the ids it failed."""
    js = ing._js
    assert js is not None
    real = js.publish_async
    failed: list[str] = []

    async def publish_async(subject: str, payload: bytes = b"", **kw: Any) -> asyncio.Future[Any]:
        msg_id = kw.get("headers", {}).get("Nats-Msg-Id", "")
        if msg_id.startswith(match) and not failed:
            failed.append(msg_id)
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[Any] = loop.create_future()
            loop.call_later(delay_s, fut.set_exception, nats.js.errors.NoStreamResponseError())
            return fut
        return await real(subject, payload, **kw)

    js.publish_async = publish_async  # type: ignore[method-assign,assignment]
    return failed


async def test_head_publish_failing_after_later_ones_landed_keeps_engine_order(
    nats_url: str, uid: str
) -> None:
    """Engine seq 5 fails while 6-9 land: the ingest deletes 6-9 and sends them again after 5, so the stream
    reads 0-10 in engine order (no inversion, no clear), and a replica reading it is exact."""
    pub = EventPublisher(ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            ing = await p.start_ingest(W, pub.endpoint, block_size=BS)
            await pub.wait_for_subscribers(1)
            await eventually(lambda: asyncio.sleep(0, ing.counters.published), lambda n: n == 1)  # hello
            live = await p.start_indexer()  # reads 6-9 before they are deleted: holds them, then repeats
            failed = fail_once(ing, f"{W}:0:0:5:", delay_s=0.5)
            for i in range(10):
                pub.publish([stored([i + 1], blk(TOKENS, i), parent=i or None)])
            await eventually(lambda: asyncio.sleep(0, ing.counters.reordered_resends), lambda n: n == 4)
            pub.publish([stored([11], blk(TOKENS, 10), parent=10)])
            await eventually(lambda: asyncio.sleep(0, ing.counters.published), lambda n: n == 12)
            assert len(failed) == 1
            nc = await connect(nats_url, name="test-read")
            try:
                msgs = await subject_messages(
                    nc.jetstream(), p.stream, subjects.events_subject(p.prefix, p.model, W, 0)
                )
            finally:
                await nc.close()
            kinds = [(m.seq, [type(e).__name__ for e in m.events]) for m in msgs]
            assert kinds == [(-1, []), *[(i, ["Stored"]) for i in range(11)]]
            assert inversions(msgs) == []
            c = ing.counters
            assert (c.reorders, c.reordered_resends, c.published, c.publish_retries) == (0, 4, 12, 5)
            await eventually(lambda: asyncio.sleep(0, live.state.block_total()), lambda n: n == 11)
            assert live.state.holder_health() == {}
            assert live.state.digest() == replayed(msgs).digest()
            held, repeats = live.state.counters.held_messages, live.state.counters.duplicate_messages
            assert held == repeats and held in (0, 4)
            fresh = replayed(msgs)  # what a replica started now reads: in order, nothing held
            assert (fresh.counters.held_messages, fresh.holder_health(), fresh.block_total()) == (0, {}, 11)
    finally:
        pub.close()


# ---------------------------------------------------------------------------------------------- cluster


async def _leader(js: Any, stream: str) -> str:
    return str((await js.stream_info(stream)).cluster.leader)


@pytest.mark.slow
async def test_r3_leader_killed_under_traffic_keeps_every_rank_in_engine_order(
    cluster: Cluster, uid: str
) -> None:
    """Stream leader killed under 4 ingests' traffic: per rank, a replica reading the stream ends with the
    index of the engine's order, exact, whatever inversions the failover made; nothing published is missing."""
    c = cluster
    p = Pipeline(c.url(0), uid)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:  # the cluster elects its meta leader
        try:
            nc = await connect(c.url(0), name="test-cluster")
            js = nc.jetstream()
            await ensure_stream(
                js,
                StreamSettings(
                    name=p.stream, prefix=p.prefix, replicas=3, memory=False, max_bytes=256 * 2**20
                ),
            )
            break
        except Exception:
            with contextlib.suppress(Exception):
                await nc.close()
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.5)
    leader = await _leader(js, p.stream)
    victim = int(leader.removeprefix("n"))
    home = next(i for i in range(3) if i != victim)  # the ingests stay connected through the kill
    await nc.close()
    nc = await connect(c.url(home), name="test-cluster")
    js = nc.jetstream()
    pubs = [EventPublisher(ANY) for _ in range(4)]
    ingests = [
        IngestService(
            IngestSettings(
                worker_id=f"w{i}",
                model=p.model,
                zmq_endpoint=pub.endpoint,
                nats_url=c.url(home),
                stream=p.stream,
                events_prefix=p.prefix,
                stream_replicas=3,
                max_coalesced_batches=1,
                block_size=BS,
            )
        )
        for i, pub in enumerate(pubs)
    ]
    tasks = [asyncio.create_task(ing.run()) for ing in ingests]
    per_engine = 1500
    try:
        for ing in ingests:
            await asyncio.wait_for(ing.ready.wait(), 30)
        for pub in pubs:
            await pub.wait_for_subscribers(1)
        stop = threading.Event()

        def engines() -> None:
            for k in range(per_engine):
                if stop.is_set():
                    return
                for pub in pubs:
                    pub.publish([stored([k + 1], blk(TOKENS, k % 64), parent=k or None)])
                time.sleep(0.004)  # about 250 batches/s per engine

        thread = threading.Thread(target=engines, daemon=True)
        thread.start()
        await asyncio.sleep(1.5)
        c.kill(victim)
        await asyncio.to_thread(thread.join, 60)
        await eventually(
            lambda: asyncio.sleep(0, [ing.counters.batches for ing in ingests]),
            lambda b: b == [per_engine] * 4,
            timeout_s=60,
        )
        await eventually(
            lambda: asyncio.sleep(0, [ing.publisher.unacknowledged for ing in ingests]),
            lambda q: q == [0] * 4,
            timeout_s=60,
        )
        bucket = f"KV_{subjects.registry_bucket(p.stream)}"
        info = await _settled(lambda: js.stream_info(bucket))
        assert info.config.num_replicas == 3  # the stream's replica count
        for i, ing in enumerate(ingests):
            msgs = await subject_messages(
                js, p.stream, subjects.events_subject(p.prefix, p.model, f"w{i}", 0)
            )
            got = replayed(msgs)
            why = f"w{i}: {len(inversions(msgs))} inversion(s), reorders counted {ing.counters.reorders}"
            assert got.holder_health() == {}, why
            assert got.digest() == replayed(in_engine_order(msgs)).digest(), why
            seqs = {m.seq for m in msgs if m.events and not isinstance(m.events[0], Cleared)}
            assert seqs == set(range(per_engine)), f"w{i}: {per_engine - len(seqs)} missing, {ing.status()}"
    finally:
        for ing in ingests:
            ing.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pub in pubs:
            pub.close()
        await nc.close()


def fail_and_delay(ing: IngestService, fail: str, late: str, *, fail_s: float, late_s: float) -> None:
    """Make the first publish of ``fail`` fail after ``fail_s`` without reaching the server, and hold back the
    ack of the first publish of ``late`` (which is stored at once) for ``late_s``: its outcome is unknown when
    the window settles after the failure."""
    js = ing._js
    assert js is not None
    real = js.publish_async
    done: set[str] = set()

    async def publish_async(subject: str, payload: bytes = b"", **kw: Any) -> asyncio.Future[Any]:
        msg_id = kw.get("headers", {}).get("Nats-Msg-Id", "")
        loop = asyncio.get_running_loop()
        if msg_id.startswith(fail) and fail not in done:
            done.add(fail)
            fut: asyncio.Future[Any] = loop.create_future()
            loop.call_later(fail_s, fut.set_exception, nats.js.errors.NoStreamResponseError())
            return fut
        ack = await real(subject, payload, **kw)
        if msg_id.startswith(late) and late not in done:
            done.add(late)
            slow: asyncio.Future[Any] = loop.create_future()

            def settle(f: asyncio.Future[Any]) -> None:
                if not slow.done():
                    slow.set_result(f.result())

            def relay(f: asyncio.Future[Any]) -> None:
                loop.call_later(late_s, settle, f)

            ack.add_done_callback(relay)
            return slow
        return ack

    js.publish_async = publish_async  # type: ignore[method-assign,assignment]


async def test_a_message_stored_while_its_ack_was_late_is_moved_after_the_failed_one(
    nats_url: str, uid: str
) -> None:
    """Engine seq 5 fails while 6 is stored with its ack late beyond the settle wait: 6's repeat is
    acknowledged below 5's new place, so the ingest deletes it and sends it again; the stream ends in engine
    order and a replica is exact."""
    pub = EventPublisher(ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            ing = await p.start_ingest(W, pub.endpoint, block_size=BS)
            await pub.wait_for_subscribers(1)
            await eventually(lambda: asyncio.sleep(0, ing.counters.published), lambda n: n == 1)  # hello
            fail_and_delay(ing, f"{W}:0:0:5:", f"{W}:0:0:6:", fail_s=0.3, late_s=3.0)
            for i in range(10):
                pub.publish([stored([i + 1], blk(TOKENS, i), parent=i or None)])
            await eventually(
                lambda: asyncio.sleep(0, ing.counters.published), lambda n: n == 11, timeout_s=20
            )
            nc = await connect(nats_url, name="test-read")
            try:
                msgs = await subject_messages(
                    nc.jetstream(), p.stream, subjects.events_subject(p.prefix, p.model, W, 0)
                )
            finally:
                await nc.close()
            assert [m.seq for m in msgs] == [-1, *range(10)]
            assert inversions(msgs) == []
            assert ing.counters.reordered_resends >= 4
            fresh = replayed(msgs)
            assert (fresh.holder_health(), fresh.block_total()) == ({}, 10)
    finally:
        pub.close()
