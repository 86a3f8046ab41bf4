"""Ingest fault handling end to end: exact events through a real EventPublisher → ingest → JetStream → indexer → router.

Every test builds its BlockStored/BlockRemoved/AllBlocksCleared events by hand (block size 4) and checks the
exact overlaps a route request returns once the asynchronous pipeline has caught up.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from tests.pipeline import Pipeline, eventually, overlaps, pipeline

from kvmesh.core.wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineBatch, encode_batch
from kvmesh.runtime.nats import StreamSettings, connect, ensure_stream
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

BS = 4
ANY = "tcp://127.0.0.1:*"
T = list(range(100, 116))  # 4 blocks
U = list(range(200, 208))  # 2 blocks
V = list(range(300, 308))  # 2 blocks
W = "w"


def stored(hashes: Sequence[Any], tokens: Sequence[int], parent: Any = None, **kw: Any) -> BlockStored:
    """A BlockStored of block size 4 with the given engine hashes and tokens."""
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=kw.pop("block_size", BS),
        **kw,
    )


def removed(*hashes: Any) -> BlockRemoved:
    """A BlockRemoved of the given engine hashes."""
    return BlockRemoved(block_hashes=tuple(hashes))


def blk(tokens: Sequence[int], i: int, n: int = 1) -> list[int]:
    """Tokens of blocks ``i`` .. ``i + n - 1`` of a prompt."""
    return list(tokens[i * BS : (i + n) * BS])


async def snapshot(p: Pipeline, prompts: Sequence[Sequence[int]], **kw: Any) -> list[dict[str, int]]:
    """The overlaps dict of each prompt, in order."""
    return [overlaps(await p.route(list(tokens), explain=True, **kw)) for tokens in prompts]


async def expect(
    p: Pipeline, prompts: Sequence[Sequence[int]], want: list[dict[str, int]], **kw: Any
) -> None:
    """Wait until the overlaps of ``prompts`` are exactly ``want``."""
    got = await eventually(lambda: snapshot(p, prompts, **kw), lambda r: r == want)
    assert got == want


@contextlib.asynccontextmanager
async def clean_pipeline(nats_url: str, uid: str) -> AsyncIterator[Pipeline]:
    """`tests.pipeline.pipeline` on a small stream created up front and deleted afterwards.

    The ingest would create a memory stream reserving 8 GiB (``StreamSettings.max_bytes``) of the server's
    JetStream memory, which runs out after two or three such streams in one session; it leaves an existing
    stream as it is, so the test creates a 64 MiB one first.
    """
    p = Pipeline(nats_url, uid)
    nc = await connect(nats_url, name="test-streams")
    try:
        js = nc.jetstream()
        await ensure_stream(
            js, StreamSettings(name=p.stream, prefix=p.prefix, memory=True, max_bytes=64 * 2**20)
        )
        try:
            async with pipeline(nats_url, uid) as p:
                yield p
        finally:
            with contextlib.suppress(Exception):
                await js.delete_stream(p.stream)
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def started(
    nats_url: str, uid: str, pubs: dict[str, EventPublisher], **ingest_kw: Any
) -> AsyncIterator[Pipeline]:
    """A pipeline with one ingest per publisher (worker id → publisher), an indexer and a router, all ready."""
    try:
        async with clean_pipeline(nats_url, uid) as p:
            for worker, pub in pubs.items():
                await p.start_ingest(
                    worker, pub.endpoint, pub.replay_endpoint, **{"block_size": BS, **ingest_kw}
                )
                await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            await expect(p, [T], [{f"{w}/0": 0 for w in pubs}])
            yield p
    finally:
        for pub in pubs.values():
            pub.close()


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


# ---------------------------------------------------------------------------------------------- 1. gaps


async def test_gap_is_healed_by_replay(nats_url: str, uid: str) -> None:
    """A batch dropped on the live socket is fetched by replay, so the blocks chained on it index too."""
    pub = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([1], blk(T, 0))])
        await expect(p, [T], [{"w/0": 1}])
        pub.drop_next(1)
        pub.publish([stored([2], blk(T, 1), parent=1)])  # dropped live
        pub.publish([stored([3], blk(T, 2), parent=2)])
        pub.publish([stored([4], blk(T, 3), parent=3)])
        await expect(p, [T], [{"w/0": 4}])
        seq = p.ingests[W].status().ranks["0"].sequence
        assert (seq["gaps"], seq["replays"], seq["healed"], seq["resyncs"], seq["replayed_batches"]) == (
            1,
            1,
            1,
            0,
            1,
        )


async def test_gap_with_silent_replay_resyncs_after_timeout(nats_url: str, uid: str) -> None:
    """A replay socket that never answers: after the replay timeout the worker is cleared and later batches index."""
    pub = EventPublisher(ANY, ANY)
    pub.replay_enabled = False
    async with started(nats_url, uid, {W: pub}, replay_timeout_s=0.5) as p:
        pub.publish([stored([1], blk(T, 0))])
        await expect(p, [T], [{"w/0": 1}])
        pub.drop_next(1)
        pub.publish([stored([2], blk(T, 1), parent=1)])  # dropped live, never replayed
        pub.publish([stored([3], blk(T, 2), parent=2)])  # parent lost: never attaches
        pub.publish([stored([10, 11], U)])
        await expect(p, [T, U], [{"w/0": 0}, {"w/0": 2}])
        seq = p.ingests[W].status().ranks["0"].sequence
        assert (seq["gaps"], seq["replays"], seq["healed"], seq["resyncs"]) == (1, 1, 0, 1)
        pub.publish([stored([1], blk(T, 0))])
        await expect(p, [T, U], [{"w/0": 1}, {"w/0": 2}])


async def test_gap_with_truncated_replay_resyncs(nats_url: str, uid: str) -> None:
    """A replay that returns fewer batches than missing clears the worker; the batches after the gap still apply."""
    pub = EventPublisher(ANY, ANY)
    pub.replay_truncate = 1
    async with started(nats_url, uid, {W: pub}, replay_timeout_s=5.0) as p:
        pub.publish([stored([1], blk(T, 0))])
        await expect(p, [T], [{"w/0": 1}])
        pub.drop_next(2)
        pub.publish([stored([2], blk(T, 1), parent=1)])  # dropped, replayed (truncate=1)
        pub.publish([stored([3], blk(T, 2), parent=2)])  # dropped, not replayed
        pub.publish([stored([10, 11], U)])
        await expect(p, [T, U], [{"w/0": 0}, {"w/0": 2}])
        seq = p.ingests[W].status().ranks["0"].sequence
        assert (seq["gaps"], seq["healed"], seq["resyncs"], seq["replayed_batches"]) == (1, 0, 1, 1)


# ---------------------------------------------------------------------------------------------- 2. restart


async def test_engine_restart_clears_and_reindexes(nats_url: str, uid: str) -> None:
    """After an engine restart (seq back to 0) the old blocks are cleared and the new ones, same hashes, index."""
    pub = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        pub.publish([stored([3], blk(T, 2), parent=2)])
        await expect(p, [T, U], [{"w/0": 3}, {"w/0": 0}])
        pub.restart()
        assert pub.publish([stored([1], blk(T, 0))]) == 0
        assert pub.publish([stored([10, 11], U)]) == 1
        await expect(p, [T, U], [{"w/0": 1}, {"w/0": 2}])
        st = p.ingests[W].status().ranks["0"]
        assert (st.epoch, st.last_seq, st.sequence["restarts"], st.sequence["duplicates"]) == (
            1,
            1,
            1,
            0,
        )


# ---------------------------------------------------------------------------------------------- 3. dp ranks


@pytest.mark.parametrize("block_size", [BS, None], ids=["configured-block-size", "first-seen-block-size"])
async def test_data_parallel_clear_on_one_rank_only(nats_url: str, uid: str, block_size: int | None) -> None:
    """AllBlocksCleared on rank 1 (publishers on ports p and p+1) leaves rank 0's blocks untouched."""
    port = free_port_pair()
    r0 = EventPublisher(f"tcp://127.0.0.1:{port}", dp_rank=0)
    r1 = EventPublisher(f"tcp://127.0.0.1:{port + 1}", dp_rank=1)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await p.start_ingest(W, r0.endpoint, data_parallel_size=2, block_size=block_size)
            await r0.wait_for_subscribers(1)
            await r1.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            r0.publish([stored([1, 2], blk(T, 0, 2))])
            r1.publish([stored([1, 2, 3, 4], T)])
            await expect(p, [T], [{"w/0": 2, "w/1": 4}])
            r1.publish([AllBlocksCleared()])
            await expect(p, [T], [{"w/0": 2, "w/1": 0}])
            r1.publish([stored([5], blk(T, 0))])
            await expect(p, [T], [{"w/0": 2, "w/1": 1}])
    finally:
        r0.close()
        r1.close()


async def test_data_parallel_rank_cleared_before_storing_keeps_other_rank(nats_url: str, uid: str) -> None:
    """Without --block-size, a rank that clears before it ever stored does not wipe the other rank."""
    port = free_port_pair()
    r0 = EventPublisher(f"tcp://127.0.0.1:{port}", dp_rank=0)
    r1 = EventPublisher(f"tcp://127.0.0.1:{port + 1}", dp_rank=1)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await p.start_ingest(W, r0.endpoint, data_parallel_size=2)
            await r0.wait_for_subscribers(1)
            await r1.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            r0.publish([stored([1, 2], blk(T, 0, 2))])
            await expect(p, [T], [{"w/0": 2, "w/1": 0}])
            r1.publish([AllBlocksCleared()])
            r0.publish([stored([10], blk(U, 0))])
            await expect(p, [T, U], [{"w/0": 2, "w/1": 0}, {"w/0": 1, "w/1": 0}])
    finally:
        r0.close()
        r1.close()


# ---------------------------------------------------------------------------------------------- 4. duplicates


async def test_duplicate_stores_need_as_many_removals(nats_url: str, uid: str) -> None:
    """A block stored twice stays until removed twice; an unknown removal does not stop the rest of its batch."""
    pub = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2)), stored([1], blk(T, 0))])
        await expect(p, [T], [{"w/0": 2}])
        pub.publish([removed(1), stored([10], blk(U, 0))])
        await expect(p, [T, U], [{"w/0": 2}, {"w/0": 1}])
        pub.publish([removed(999), removed(1), removed(998, 10), stored([20], blk(V, 0))])
        await expect(p, [T, U, V], [{"w/0": 0}, {"w/0": 0}, {"w/0": 1}])


# ---------------------------------------------------------------------------------------------- 5. parents


async def test_unknown_parent_is_held_until_it_arrives(nats_url: str, uid: str) -> None:
    """A child stored before its parent waits and attaches, with its own held child, once the parent arrives."""
    pub = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish(
            [stored([3], blk(T, 2), parent=2), stored([2], blk(T, 1), parent=1), stored([10], blk(U, 0))]
        )
        await expect(p, [T, U], [{"w/0": 0}, {"w/0": 1}])
        pub.publish([stored([1], blk(T, 0))])
        await expect(p, [T, U], [{"w/0": 3}, {"w/0": 1}])


async def test_parent_on_another_worker_never_attaches(nats_url: str, uid: str) -> None:
    """A child whose parent hash is known only on another worker stays held on its own worker."""
    a = EventPublisher(ANY, ANY)
    b = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {"a": a, "b": b}) as p:
        a.publish([stored([2], blk(T, 1), parent=1), stored([10], blk(U, 0))])
        await expect(p, [T, U], [{"a/0": 0, "b/0": 0}, {"a/0": 1, "b/0": 0}])
        b.publish([stored([1], blk(T, 0))])
        a.publish([stored([11], blk(U, 1), parent=10)])
        await expect(p, [T, U], [{"a/0": 0, "b/0": 1}, {"a/0": 2, "b/0": 0}])


# ---------------------------------------------------------------------------------------------- 6. hash forms


async def test_int_and_bin_hashes_are_one_key(nats_url: str, uid: str) -> None:
    """A hash sent as 32-byte bin, as 8-byte bin and as int is one block: stored as bin, removed as int."""
    pub = EventPublisher(ANY, ANY, version="0.10.2", hash_form="bytes")
    h1, h2 = 0x1122334455667788, 0xF0E0D0C0B0A09080  # h2 >= 2**63: an unsigned msgpack int

    def as_bin(h: int, width: int) -> bytes:
        return b"\xab" * (width - 8) + h.to_bytes(8, "big")

    def as_int(events: list[Any]) -> bytes:
        return encode_batch(
            EngineBatch(ts=0.0, events=tuple(events), dp_rank=0), version="0.10.2", hash_form="int"
        )

    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([as_bin(h1, 32)], blk(T, 0))])
        pub.publish([stored([as_bin(h2, 32)], blk(T, 1), parent=as_bin(h1, 8))])
        pub.publish_raw(as_int([stored([3], blk(T, 2), parent=h2)]))
        await expect(p, [T], [{"w/0": 3}])
        pub.publish_raw(as_int([removed(h2)]))
        await expect(p, [T], [{"w/0": 1}])
        pub.publish_raw(as_int([removed(h1)]))
        await expect(p, [T], [{"w/0": 0}])
        assert p.ingests[W].counters.decode_errors == 0


# ---------------------------------------------------------------------------------------------- 7. alignment


async def test_misaligned_wrong_size_and_sliding_window_events_are_not_indexed(
    nats_url: str, uid: str
) -> None:
    """Misaligned, wrong-block-size and sliding-window BlockStored events index nothing; the rest applies."""
    pub = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish(
            [
                stored([1, 2], T[:7]),  # 7 tokens for 2 blocks of 4
                stored([1], T[:8]),  # 8 tokens for 1 block of 4
                stored([10], blk(U, 0)),
                stored([3], T[:8], block_size=8),  # aligned, but not the configured block size
                stored(
                    [4, 5],
                    T[:8],
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=8,
                ),
                stored([11], blk(U, 1), parent=10),
            ]
        )
        await expect(p, [T, U], [{"w/0": 0}, {"w/0": 2}])
        ing = p.ingests[W]
        assert ing.counters.rejected_events == 3
        ev = ing.status().ranks["0"].events
        assert (
            ev["rejected_alignment"],
            ev["rejected_block_size"],
            ev["skipped_non_full"],
            ev["stored_blocks"],
        ) == (
            2,
            1,
            1,
            2,
        )
        # The sliding-window group's removals are skipped too; full-attention blocks still index.
        pub.publish(
            [BlockRemoved(block_hashes=(10,), group_idx=1), stored([1, 2], blk(T, 0, 2), group_idx=0)]
        )
        await expect(p, [T, U], [{"w/0": 2}, {"w/0": 2}])


# ---------------------------------------------------------------------------------------------- 8. lora / salt


async def test_lora_and_cache_salt_scope_matches(nats_url: str, uid: str) -> None:
    """Blocks of LoRA "a" match only lora_name "a"; blocks salted "salt1" match only cache_salt "salt1"."""
    pub = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish(
            [
                stored([1, 2], blk(T, 0, 2), lora_id=7, lora_name="a", extra_keys=(("a",), ("a",))),
                stored([10, 11], U, extra_keys=(("salt1",), None)),
            ]
        )
        await expect(p, [T, U], [{"w/0": 2}, {"w/0": 0}], lora_name="a")
        await expect(p, [T, U], [{"w/0": 0}, {"w/0": 0}])
        await expect(p, [T, U], [{"w/0": 0}, {"w/0": 0}], lora_name="b")
        await expect(p, [T, U], [{"w/0": 0}, {"w/0": 2}], cache_salt="salt1")
        await expect(p, [T, U], [{"w/0": 0}, {"w/0": 0}], cache_salt="salt2")
        # A salted request never matches unsalted blocks, LoRA or not.
        await expect(p, [T, U], [{"w/0": 0}, {"w/0": 0}], lora_name="a", cache_salt="salt1")


# ---------------------------------------------------------------------------------------------- 9. clear


async def test_all_blocks_cleared_clears_only_that_worker(nats_url: str, uid: str) -> None:
    """AllBlocksCleared empties exactly its own (worker, dp_rank); later events rebuild it."""
    a = EventPublisher(ANY, ANY)
    b = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {"a": a, "b": b}) as p:
        a.publish([stored([1, 2, 3, 4], T)])
        b.publish([stored([1, 2, 3, 4], T)])
        await expect(p, [T], [{"a/0": 4, "b/0": 4}])
        a.publish([stored([10], blk(U, 0)), AllBlocksCleared(), stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T, U], [{"a/0": 2, "b/0": 4}, {"a/0": 0, "b/0": 0}])
        a.publish([stored([3], blk(T, 2), parent=2)])
        await expect(p, [T, U], [{"a/0": 3, "b/0": 4}, {"a/0": 0, "b/0": 0}])


# ---------------------------------------------------------------------------------------------- 10. malformed


async def test_malformed_payload_is_counted_and_later_batches_apply(nats_url: str, uid: str) -> None:
    """An undecodable batch is counted, resynchronises the worker (its events are lost), and later batches apply."""
    pub = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        pub.publish_raw(b"\xc1garbage")
        pub.publish([stored([10, 11], U)])
        await expect(p, [T, U], [{"w/0": 0}, {"w/0": 2}])
        ing = p.ingests[W]
        assert ing.counters.decode_errors == 1
        assert ing.status().counters["decode_errors"] == 1
        assert ing.status().ranks["0"].last_seq == 2


# ---------------------------------------------------------------------------------------------- unsized


async def test_worker_without_block_size_is_a_candidate_before_it_stores(nats_url: str, uid: str) -> None:
    """A worker ingested without --block-size is a zero-overlap candidate until it stores, then matches."""
    a = EventPublisher(ANY, ANY)
    b = EventPublisher(ANY, ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await p.start_ingest("a", a.endpoint, a.replay_endpoint)  # block size: the first event's
            await a.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            await expect(p, [T], [{"a/0": 0}])
            await p.start_ingest("b", b.endpoint, b.replay_endpoint, block_size=BS)
            await b.wait_for_subscribers(1)
            b.publish([stored([1, 2], blk(T, 0, 2))])
            await expect(p, [T], [{"a/0": 0, "b/0": 2}])
            a.publish([stored([1, 2, 3], blk(T, 0, 3))])
            await expect(p, [T], [{"a/0": 3, "b/0": 2}])
    finally:
        a.close()
        b.close()


async def test_consecutive_batches_coalesce_into_fewer_messages(nats_url: str, uid: str) -> None:
    """Forty chained batches read in bursts share stream messages and still index as one 40-block chain."""
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    tokens = list(range(3000, 3000 + 40 * 4))
    try:
        async with pipeline(nats_url, uid) as p:
            ing = await p.start_ingest(
                "w", pub.endpoint, pub.replay_endpoint, block_size=4, max_coalesced_batches=64
            )
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            for i in range(40):
                pub.publish(
                    [
                        BlockStored(
                            block_hashes=(5000 + i,),
                            parent_block_hash=None if i == 0 else 5000 + i - 1,
                            token_ids=tuple(tokens[4 * i : 4 * i + 4]),
                            block_size=4,
                        )
                    ]
                )
            reply = await eventually(
                lambda: p.route(tokens, explain=True), lambda r: overlaps(r) == {"w/0": 40}
            )
            assert reply.overlap_blocks == 40
            assert ing.counters.batches == 40
            assert ing.counters.published < 41  # the announcement plus fewer than one message per batch
            assert ing.status().ranks["0"].last_seq == 39
    finally:
        pub.close()


async def test_overlong_sequence_frame_is_dropped_and_reading_goes_on(nats_url: str, uid: str) -> None:
    """A 20-byte sequence frame is counted and dropped; the reader keeps going and later batches index."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with clean_pipeline(nats_url, uid) as p:
            ing = await p.start_ingest(W, f"tcp://127.0.0.1:{port}", None, block_size=BS)
            await p.start_indexer()
            await p.start_router()
            await expect(p, [T], [{"w/0": 0}])
            good = encode_batch(EngineBatch(ts=1.0, events=(stored([1, 2, 3, 4], T),), dp_rank=0))
            for _ in range(50):  # the SUB may join late: repeat until the ingest has read a frame
                await pub.send_multipart([b"", (2**100 + 1).to_bytes(20, "big"), good])
                await asyncio.sleep(0.02)
                if ing.counters.decode_errors:
                    break
            assert ing.counters.decode_errors >= 1
            await pub.send_multipart([b"", (0).to_bytes(8, "big"), good])
            await expect(p, [T], [{"w/0": 4}])
            assert ing.counters.batches == 1
    finally:
        pub.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------------------------------------- tiers


@pytest.mark.parametrize("index", ["local", "remote"])
async def test_blocks_on_slower_tiers_count_with_their_weight(nats_url: str, uid: str, index: str) -> None:
    """vLLM ≥ 0.10.2 names each BlockStored's medium: 4 blocks on GPU plus an 8-block CPU copy of the same
    prompt give an overlap of 8 blocks, 4 per tier, weighted 16 × 1.0 + 16 × 0.5 = 24 cached tokens; removing
    the CPU copy leaves the GPU 4; the GPU worker with 4 blocks beats a CPU-only worker with 5."""
    pub, other = EventPublisher(ANY, ANY), EventPublisher(ANY, ANY)
    prompt = list(range(500, 532))  # 8 blocks
    try:
        async with clean_pipeline(nats_url, uid) as p:
            for worker, pb in (("g", pub), ("c", other)):
                await p.start_ingest(worker, pb.endpoint, pb.replay_endpoint, block_size=BS)
                await pb.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router(index)
            pub.publish([stored([1, 2, 3, 4], prompt[:16], medium="GPU")])
            pub.publish([stored([11, 12, 13, 14, 15, 16, 17, 18], prompt, medium="CPU")])
            other.publish([stored([21, 22, 23, 24, 25], prompt[:20], medium="CPU")])
            r = await eventually(
                lambda: p.route(prompt, explain=True), lambda r: overlaps(r) == {"g/0": 8, "c/0": 5}
            )
            assert r.scores is not None
            by = {s.worker_id: s for s in r.scores}
            assert (by["g"].cached_tokens_by_tier, by["g"].weighted_cached_tokens) == (
                {"GPU": 16, "CPU": 16},
                24.0,
            )
            assert (by["c"].cached_tokens_by_tier, by["c"].weighted_cached_tokens) == (
                {"CPU": 20},
                10.0,
            )
            assert (r.worker_id, r.overlap_blocks, r.cached_tokens) == ("g", 8, 32)

            pub.publish([BlockRemoved(block_hashes=(11, 12, 13, 14, 15, 16, 17, 18), medium="CPU")])
            r = await eventually(
                lambda: p.route(prompt, explain=True), lambda r: overlaps(r) == {"g/0": 4, "c/0": 5}
            )
            assert r.scores is not None
            by = {s.worker_id: s for s in r.scores}
            assert (by["g"].cached_tokens_by_tier, by["g"].weighted_cached_tokens) == (
                {"GPU": 16},
                16.0,
            )
            assert r.worker_id == "g"  # 16 weighted tokens on GPU beat 10 from 20 on CPU
    finally:
        pub.close()
        other.close()
