"""Ingest back-pressure and outages: oversized batches, NATS down and back, a full outbox, an ingest restart.

The outage tests run their own nats-server with file storage in a temporary directory, so they can kill it
and start it again on the same port and store while the engine keeps publishing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from tests.pipeline import Pipeline, eventually, pipeline
from tests.test_ingest_faults import ANY, BS, T, U, W, blk, clean_pipeline, removed, snapshot, stored

import kvmesh.ingest.publish
from kvmesh.core.wire import BlockStored
from kvmesh.harness.server import NatsServer
from kvmesh.ingest.service import IngestService
from kvmesh.runtime.nats import StreamSettings, connect, ensure_stream
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def expect(
    p: Pipeline,
    prompts: Sequence[Sequence[int]],
    want: list[dict[str, int]],
    timeout_s: float = 30.0,
    **kw: Any,
) -> None:
    """Wait until the overlaps of ``prompts`` (route options ``kw``) are exactly ``want``."""
    got = await eventually(lambda: snapshot(p, prompts, **kw), lambda r: r == want, timeout_s=timeout_s)
    assert got == want


def roots(n: int, base: int) -> list[list[int]]:
    """``n`` one-block prompts with distinct tokens (each a root block)."""
    return [list(range(base + BS * i, base + BS * (i + 1))) for i in range(n)]


async def stream_messages(nats_url: str, stream: str) -> int:
    """Messages in a stream right now."""
    nc = await connect(nats_url, name="test-count")
    try:
        info = await nc.jetstream().stream_info(stream)
        return int(info.state.messages)
    finally:
        await nc.close()


class Restartable:
    """A nats-server with file storage in ``store`` that a test can freeze, kill and start again on its port."""

    def __init__(self, store: Path, args: Sequence[str] = ()) -> None:
        self.store = store
        self.args = list(args)
        self.server = NatsServer(store_dir=store, args=self.args).start()
        self.up = True

    @property
    def url(self) -> str:
        """The client URL (the same after a restart)."""
        return self.server.url

    def freeze(self) -> None:
        """Stop the server process (SIGSTOP): connections stay open, nothing is read or answered."""
        assert self.server.pid is not None
        self.up = False
        os.kill(self.server.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """Kill the server (SIGKILL), keeping its store."""
        self.up = False
        self.server.kill()
        self.server.stop()  # closes its log pipe; the store is not a temporary one, so it stays

    def restart(self) -> None:
        """Start a server again on the same port and store."""
        self.kill()
        self.server = NatsServer(port=self.server.port, store_dir=self.store, args=self.args).start()
        self.up = True

    def stop(self) -> None:
        """Stop the server for good."""
        self.kill()


@contextlib.asynccontextmanager
async def file_pipeline(server: Restartable, uid: str) -> AsyncIterator[Pipeline]:
    """A pipeline on ``server`` whose 64 MiB stream has file storage, so it survives a server restart.

    A test that fails while the server is down gets it back before the pipeline stops (its services and
    the stream cleanup need it).
    """
    p = Pipeline(server.url, uid)
    nc = await connect(server.url, name="test-streams")
    try:
        await ensure_stream(
            nc.jetstream(), StreamSettings(name=p.stream, prefix=p.prefix, memory=False, max_bytes=64 * 2**20)
        )
    finally:
        await nc.close()
    async with pipeline(server.url, uid) as p:
        p.stream_memory = False  # the worker registry must survive the restart too, as in production
        try:
            yield p
        finally:
            if not server.up:
                server.restart()


async def wait_disconnected(ing: IngestService) -> None:
    """Wait until the ingest's NATS client noticed that the server is gone."""
    nc = ing._nc
    assert nc is not None
    await eventually(lambda: asyncio.sleep(0, not nc.is_connected), bool, timeout_s=30)


async def start_indexer(p: Pipeline) -> None:
    """Start an indexer replica, first stopping the running one (if any)."""
    old = p.indexer
    if old is not None:
        old.stop()
        task = old._task  # type: ignore[attr-defined]
        p.tasks.remove(task)
        await asyncio.wait_for(task, 10)
    svc = await p.start_indexer()
    svc._task = p.tasks[-1]  # type: ignore[attr-defined]


async def reindex(p: Pipeline) -> None:
    """Replace the indexer by a fresh replica that reads the stream from its start.

    The running replica's ordered consumer resumes only after its idle-heartbeat check notices the restarted
    server (about 20 s); what these tests check is what the ingest put on the stream.
    """
    await start_indexer(p)


# ---------------------------------------------------------------------------------------------- payload


async def test_batch_larger_than_max_payload_is_split_with_its_chain_intact(tmp_path: Path, uid: str) -> None:
    """One BlockStored of 5,000 blocks on a server with a 64 KiB max payload is split into 3 parts that index whole."""
    conf = tmp_path / "nats.conf"
    conf.write_text("max_payload: 65536\n")
    n = 5000
    tokens = [(i * 7 + i // BS) % 10 for i in range(n * BS)]  # one-digit ids keep the route request small
    hashes = [(1 << 63) + i for i in range(n)]  # 9-byte msgpack ints
    pub = EventPublisher(ANY, ANY)
    server = Restartable(tmp_path / "js", ["-c", str(conf)])
    try:
        async with file_pipeline(server, uid) as p:
            ing = await p.start_ingest(W, pub.endpoint, pub.replay_endpoint, block_size=BS)
            await pub.wait_for_subscribers(1)
            assert ing.batches.max_payload == 65536
            await start_indexer(p)
            await p.start_router()
            pub.publish(
                [
                    BlockStored(
                        block_hashes=tuple(hashes),
                        parent_block_hash=None,
                        token_ids=tuple(tokens),
                        block_size=BS,
                    )
                ]
            )
            # Wait for the big batch alone, so the small one is not coalesced into its message.
            await expect(p, [tokens], [{"w/0": n}])
            pub.publish([stored([7], blk(U, 0))])
            await expect(p, [tokens, U, tokens[: 100 * BS]], [{"w/0": n}, {"w/0": 1}, {"w/0": 100}])
            assert ing.counters.split_batches == 1
            assert ing.counters.published == 5  # hello, 3 parts, the small batch
            assert await stream_messages(server.url, p.stream) == 5
    finally:
        pub.close()
        server.stop()


# ---------------------------------------------------------------------------------------------- outage


async def test_nats_outage_buffers_and_publishes_everything_in_order(
    tmp_path: Path, uid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NATS frozen, killed with publishes in flight and restarted: the engine never waits and every store and removal lands once, in order."""
    # The 20 publishes sent while NATS is frozen must still be in flight when it is killed: on a loaded
    # machine the check could come after the 5 s ack timeout had already sent them back to the outbox.
    monkeypatch.setattr(kvmesh.ingest.publish, "ACK_TIMEOUT_S", 120.0)
    store = tmp_path / "js"
    server = Restartable(store)
    pub = EventPublisher(ANY, ANY)
    chain_tokens = list(range(1000, 1000 + BS * 30))
    chain = [((1 << 40) + i, blk(chain_tokens, i)) for i in range(30)]
    transient = roots(10, 5000)

    publish_s = 0.0

    def publish(events: list[Any]) -> None:
        nonlocal publish_s
        t0 = time.monotonic()
        pub.publish(events)
        publish_s += time.monotonic() - t0

    def grow(i: int) -> None:
        publish([stored([chain[i][0]], chain[i][1], parent=chain[i - 1][0] if i else None)])

    try:
        async with file_pipeline(server, uid) as p:
            ing = await p.start_ingest(W, pub.endpoint, pub.replay_endpoint, block_size=BS)
            await pub.wait_for_subscribers(1)
            await start_indexer(p)
            await p.start_router()
            pub.publish([stored([1, 2, 3, 4], T)])
            for i in range(10):
                grow(i)
            await expect(p, [T, chain_tokens], [{"w/0": 4}, {"w/0": 10}])
            server.freeze()  # what the ingest sends now is never acknowledged
            publish_s = 0.0
            for i in range(10, 20):
                grow(i)
                publish([stored([(1 << 50) + i], transient[i - 10])])
            await eventually(lambda: asyncio.sleep(0, ing.counters.batches), lambda b: b == 31, timeout_s=30)
            # sent, never acknowledged:
            await eventually(
                lambda: asyncio.sleep(0, len(ing.publisher.window)), lambda n: n == 20, timeout_s=30
            )
            server.kill()  # the in-flight publishes die with it
            await wait_disconnected(ing)
            for i in range(20, 30):
                grow(i)
                publish([removed((1 << 50) + i - 10)])  # applied before its store, a removal is lost
            publish([removed(4)])
            assert publish_s < 0.5  # 41 engine publishes: none waited for NATS
            await eventually(lambda: asyncio.sleep(0, ing.counters.batches), lambda b: b == 52, timeout_s=30)
            assert ing.status().ranks["0"].last_seq == 51  # ZMQ read on while NATS was down
            assert ing.status().outbox == 41
            server.restart()
            await reindex(p)
            await expect(p, [T, chain_tokens, *transient], [{"w/0": 3}, {"w/0": 30}] + [{"w/0": 0}] * 10)
            assert ing.counters.dropped_batches == 0
            assert ing.counters.published == 1 + 52
            assert ing.counters.publish_retries == 20
            assert await stream_messages(server.url, p.stream) == 1 + 52
            seq = ing.status().ranks["0"].sequence
            assert (seq["gaps"], seq["resyncs"], seq["restarts"]) == (0, 0, 0)
    finally:
        pub.close()
        server.stop()


async def test_outbox_overflow_drops_oldest_and_resynchronises(tmp_path: Path, uid: str) -> None:
    """With room for 3 batches, 7 batches during an outage drop the oldest 4 and clear the worker once; the last 3 index."""
    store = tmp_path / "js"
    server = Restartable(store)
    pub = EventPublisher(ANY, ANY)
    prompts = roots(7, 5000)
    try:
        async with file_pipeline(server, uid) as p:
            ing = await p.start_ingest(
                W, pub.endpoint, pub.replay_endpoint, block_size=BS, max_buffered_batches=3
            )
            await pub.wait_for_subscribers(1)
            await start_indexer(p)
            await p.start_router()
            pub.publish([stored([1, 2, 3, 4], T)])
            await expect(p, [T], [{"w/0": 4}])
            server.kill()
            await wait_disconnected(ing)
            for i, prompt in enumerate(prompts):
                pub.publish([stored([100 + i], prompt)])
            await eventually(lambda: asyncio.sleep(0, ing.counters.batches), lambda b: b == 8, timeout_s=30)
            assert ing.counters.dropped_batches == 4
            assert ing.status().outbox == 3
            server.restart()
            await reindex(p)
            await expect(p, [T, *prompts], [{"w/0": 0}] * 5 + [{"w/0": 1}] * 3, timeout_s=20)
            assert ing.counters.dropped_batches == 4
            # hello, T, the overflow clear, the 3 kept batches
            assert await stream_messages(server.url, p.stream) == 6
            pub.publish([stored([1, 2], blk(T, 0, 2))])
            await expect(p, [T], [{"w/0": 2}])
    finally:
        pub.close()
        server.stop()


# ---------------------------------------------------------------------------------------------- ingest restart


async def _stop_ingest(p: Pipeline, worker: str) -> None:
    """Stop worker's ingest as a crash does (its registry key stays until the TTL) and wait until it has
    finished; a clean `stop()` deregisters, so a restart is a new incarnation (tests/test_ingest_registry.py)."""
    svc = p.ingests.pop(worker)
    task = svc._task  # type: ignore[attr-defined]
    p.tasks.remove(task)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)


async def restartable_ingest(p: Pipeline, pub: EventPublisher, subscribers: int) -> IngestService:
    """Start an ingest for worker W on ``pub`` and wait for its subscription (the ``subscribers``-th)."""
    ing = await p.start_ingest(W, pub.endpoint, pub.replay_endpoint, block_size=BS)
    ing._task = p.tasks[-1]  # type: ignore[attr-defined]
    await pub.wait_for_subscribers(subscribers)
    return ing


async def test_restarted_ingest_resumes_without_republishing_or_losing(nats_url: str, uid: str) -> None:
    """A new ingest for the same worker resumes after the stream's last batch and replays what it missed."""
    pub = EventPublisher(ANY, ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await restartable_ingest(p, pub, 1)
            await start_indexer(p)
            await p.start_router()
            pub.publish([stored([1], blk(T, 0))])
            pub.publish([stored([2], blk(T, 1), parent=1)])
            await expect(p, [T], [{"w/0": 2}])
            assert await stream_messages(nats_url, p.stream) == 3  # hello + 2
            await _stop_ingest(p, W)
            pub.publish([stored([3], blk(T, 2), parent=2)])  # nobody reads these live
            pub.publish([stored([10, 11], U)])
            ing = await restartable_ingest(p, pub, 2)
            pub.publish([stored([4], blk(T, 3), parent=3)])
            await expect(p, [T, U], [{"w/0": 4}, {"w/0": 2}])
            assert await stream_messages(nats_url, p.stream) == 7  # + hello + 3
            st = ing.status().ranks["0"]
            assert (st.epoch, st.last_seq) == (0, 4)
            seq = st.sequence
            assert (seq["gaps"], seq["replays"], seq["healed"], seq["replayed_batches"], seq["resyncs"]) == (
                1,
                1,
                1,
                2,
                0,
            )
    finally:
        pub.close()


async def test_ingest_restarted_before_any_batch_loses_nothing(nats_url: str, uid: str) -> None:
    """An ingest stopped before its engine published anything, then restarted, still replays the engine's batch 0."""
    pub = EventPublisher(ANY, ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await restartable_ingest(p, pub, 1)
            await start_indexer(p)
            await p.start_router()
            await expect(p, [T], [{"w/0": 0}])
            await _stop_ingest(p, W)
            pub.publish([stored([1], blk(T, 0))])  # seq 0, missed live
            pub.publish([stored([2], blk(T, 1), parent=1)])  # seq 1, missed live
            ing = await restartable_ingest(p, pub, 2)
            pub.publish([stored([3], blk(T, 2), parent=2)])
            await expect(p, [T], [{"w/0": 3}])
            st = ing.status().ranks["0"]
            assert (st.epoch, st.last_seq, st.sequence["replayed_batches"]) == (0, 2, 2)
    finally:
        pub.close()
