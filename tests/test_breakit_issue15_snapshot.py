"""vLLM's snapshot wire (PR #57789) under bad input: lying snapshot replies and malformed sequence frames.

A stand-in publisher (`kvmesh.sim.publisher.EventPublisher`) whose snapshot replies a test rewrites, a real
ingest, indexer and router on a real nats-server. Each reply that cannot be right must leave the rank
indexing its later live batches (exact route overlaps), with the fallback counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from tests.pipeline import eventually
from tests.test_ingest_faults import ANY, T, U, V, W, blk, expect, removed, started, stored
from tests.test_vllm_snapshot_wire import index_digest, sequence, subject_messages, truth_digest

from kvmesh.core.wire import EngineBatch, encode_batch
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

Mangle = Callable[[list[bytes]], list[bytes]]


class MangledPublisher(EventPublisher):
    """A stand-in whose snapshot replies pass through ``mangle`` (a lying or broken engine)."""

    mangle: Mangle | None = None

    def snapshot_reply(self) -> list[bytes]:
        frames = super().snapshot_reply()
        return frames if self.mangle is None else self.mangle(frames)


def cut_frame(cut: int) -> bytes:
    return cut.to_bytes(8, "big", signed=True)


MANGLES: dict[str, Mangle] = {
    "cut_far_ahead": lambda f: [cut_frame(10**12), *f[1:]],
    "garbage_chunk": lambda f: [*f[:2], b"\xc1garbage"],
    "truncated_chunk": lambda f: [*f[:2], f[2][: len(f[2]) // 2], *f[3:]],
    "other_epoch": lambda f: [f[0], b"\x00" * 16, *f[2:]],
    "short_cut_frame": lambda f: [f[0][:7], *f[1:]],
    "one_frame": lambda f: f[:1],
}


@pytest.mark.parametrize("name", sorted(MANGLES))
async def test_a_snapshot_reply_that_cannot_be_right_is_not_used(nats_url: str, uid: str, name: str) -> None:
    """After a gap (one batch storing U lost, no replay socket) the snapshot reply is rewritten: a cut far
    past anything the rank's live stream reached (10**12), a chunk that is not msgpack, a chunk cut in half,
    another publisher epoch, a cut frame of 7 bytes, no epoch frame. None rebuilds the rank: it is cleared
    (T 0: its blocks before the loss go, U never indexes) and the live batches go on indexing (V 2), with one
    snapshot failure and one resync counted. A cut far ahead, used, would have made every later live batch a
    "duplicate" until the engine's sequence reached it: V would never index."""
    pub = MangledPublisher(ANY, snapshot_endpoint=ANY)
    pub.mangle = MANGLES[name]
    async with started(nats_url, uid, {W: pub}, snapshot_endpoint=pub.snapshot_endpoint) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        pub.drop_next(1)
        pub.publish([stored([11, 12], U)])  # seq 1, lost
        pub.publish([stored([3], blk(T, 2), parent=2)])  # seq 2, live: the gap shows
        await eventually(lambda: asyncio.sleep(0, sequence(p)), lambda s: s["snapshot_failures"] == 1)
        pub.publish([stored([21, 22], V)])  # seq 3
        await expect(p, [T, U, V], [{"w/0": 0}, {"w/0": 0}, {"w/0": 2}])
        seq = sequence(p)
        assert (seq["gaps"], seq["snapshots"], seq["snapshot_failures"], seq["rebuilds"]) == (1, 1, 1, 0)
        assert (seq["resyncs"], seq["duplicates"], pub.snapshot_requests) == (1, 0, 1)


@pytest.mark.parametrize("length", [0, 7, 16, 23, 25, 32])
async def test_a_sequence_frame_of_another_length_is_counted_and_dropped(
    nats_url: str, uid: str, length: int
) -> None:
    """A live message whose sequence frame is neither 8 nor 24 bytes is dropped and counted as a decode error;
    the rank is not restarted by it and the next good frame (seq 1) indexes."""
    pub = EventPublisher(ANY, publisher_epoch=True)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        payload = encode_batch(EngineBatch(ts=1.0, events=(stored([11, 12], U),), dp_rank=0))
        pub._pub.send_multipart(
            (pub.topic.encode(), b"\x00" * (length - 1) + b"\x01" if length else b"", payload)
        )
        await eventually(lambda: asyncio.sleep(0, p.ingests[W].counters.decode_errors), lambda n: n == 1)
        pub.publish([stored([21, 22], V)])
        await expect(p, [T, U, V], [{"w/0": 2}, {"w/0": 0}, {"w/0": 2}])
        seq = sequence(p)
        assert (seq["restarts"], seq["gaps"], seq["resyncs"], seq["delivered"]) == (0, 0, 0, 2)


async def test_an_epoch_flapping_between_two_values_stays_read_and_ends_rebuilt(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    """Live frames whose publisher epoch flips between two values on every batch (two publishers answering on
    one port, or a broken one): every flip is a restart (counted), the ingest keeps reading, and once the
    epoch settles the rank is rebuilt from the snapshot: T's 3 blocks, U's 2 and the one V block the flips left
    stored (119) match, and the index digest equals the engine's."""
    record = tmp_path / "engine.rec"
    pub = EventPublisher(ANY, snapshot_endpoint=ANY, record_path=record)
    epochs = [pub._epoch, b"\x01" * 16]
    async with started(nats_url, uid, {W: pub}, snapshot_endpoint=pub.snapshot_endpoint) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        flips = 20
        for i in range(flips):
            pub._epoch = epochs[(i + 1) % 2]
            pub.publish([stored([100 + i], blk(V, 0))] if i % 2 else [removed(100 + i - 1)])
        pub._epoch = epochs[0]
        pub.publish([stored([3], blk(T, 2), parent=2)])
        pub.publish([stored([11, 12], U)])
        await expect(p, [T, U, V], [{"w/0": 3}, {"w/0": 2}, {"w/0": 1}])
        assert await eventually(
            lambda: asyncio.sleep(0, index_digest(p)), lambda d: d == truth_digest(record, p.model)
        )
        seq = sequence(p)
        assert seq["restarts"] == flips
        assert p.ingests[W].counters.decode_errors == 0


def filler_chunks(n_chunks: int, first_hash: int) -> list[bytes]:
    """``n_chunks`` snapshot chunks of 256 one-block root BlockStored events each (distinct hashes and tokens)."""
    chunks = []
    h = first_hash
    for _ in range(n_chunks):
        events = []
        for _ in range(256):
            events.append(stored([h], [h % 2**31, 1, 2, 3]))
            h += 1
        chunks.append(encode_batch(EngineBatch(ts=1.0, events=tuple(events), dp_rank=0)))
    return chunks


async def test_a_large_snapshot_does_not_stall_the_ingest(nats_url: str, uid: str) -> None:
    """A snapshot of 102,400 blocks (400 chunks) is decoded, normalised and enqueued without holding the
    event loop for more than 0.5 s at a time (it held it for the whole snapshot: the registry heartbeats, every other
    rank and the publish loop waited, and a snapshot longer than the registry TTL took the worker out), and
    the rebuilt rank matches T and the filler blocks."""
    pub = MangledPublisher(ANY, snapshot_endpoint=ANY)
    extra = filler_chunks(400, 10**6)
    pub.mangle = lambda f: [*f, *extra]
    async with started(nats_url, uid, {W: pub}, snapshot_endpoint=pub.snapshot_endpoint) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        loop = asyncio.get_running_loop()
        lags: list[float] = []
        done = asyncio.Event()

        async def watch() -> None:  # until the rebuild is enqueued (the indexer's apply is not timed)
            while not done.is_set() and sequence(p)["rebuilds"] == 0:
                t = loop.time()
                await asyncio.sleep(0.05)
                lags.append(loop.time() - t - 0.05)

        watcher = asyncio.create_task(watch())
        try:
            pub.drop_next(1)
            pub.publish([stored([3], blk(T, 2), parent=2)])
            pub.publish([stored([4], blk(T, 3), parent=3)])  # seq 2, live: the gap shows
            await eventually(
                lambda: asyncio.sleep(0, sequence(p)), lambda s: s["rebuilds"] == 1, timeout_s=60
            )
        finally:
            done.set()
            await watcher
        assert max(lags) < 0.5
        await expect(p, [T, [10**6 % 2**31, 1, 2, 3]], [{"w/0": 4}, {"w/0": 1}])


async def test_heartbeats_alone_make_one_empty_message_per_coalescing_bound(nats_url: str, uid: str) -> None:
    """An engine that sends nothing but heartbeats (200 of them, coalescing bound 64): no events are invented,
    the stream gets one empty message per 64 heartbeats (seqs 63, 127, 191: the cursor stays recent) and the 8
    after the last wait, covered by the next message; nothing counts as a batch, a gap or a restart."""
    pub = EventPublisher(ANY, publisher_epoch=True)
    async with started(nats_url, uid, {W: pub}, max_coalesced_batches=64) as p:
        for _ in range(200):
            pub.heartbeat()
        await eventually(lambda: asyncio.sleep(0, sequence(p)), lambda s: s["delivered"] == 200)
        await asyncio.sleep(0.3)
        msgs = await subject_messages(p)
        assert [(f, s, ev) for _e, f, s, ev in msgs] == [
            (None, -1, []),
            (0, 63, []),
            (64, 127, []),
            (128, 191, []),
        ]
        seq = sequence(p)
        assert (seq["heartbeats"], seq["gaps"], seq["restarts"]) == (200, 0, 0)
        assert p.ingests[W].counters.batches == 0
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        assert [(f, s) for _e, f, s, _ev in await subject_messages(p)][-1] == (192, 200)
