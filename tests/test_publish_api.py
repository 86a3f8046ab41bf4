"""`kvmesh.publish`: an engine's events through the Python API, straight to JetStream or as vLLM ZMQ frames.

Both modes run the same scenario against a real nats-server, indexer and router and must give the same exact
overlaps; the JetStream publisher is also restarted after a kill -9 (a new epoch drops the old incarnation's
blocks) and kept from NATS until its outbox overflows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
import textwrap
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest
from tests.pipeline import Pipeline, eventually
from tests.test_ingest_faults import clean_pipeline
from tests.test_ingest_outage import (
    Restartable,
    file_pipeline,
    reindex,
    roots,
    start_indexer,
    stream_messages,
)
from tests.test_ingest_outage import expect as expect_within

import kvmesh.ops
import kvmesh.publish
from kvmesh.core.events import Cleared, EventsMessage, decode_message
from kvmesh.publish import JetStreamPublisher, PublishError, ZmqPublisher
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

BS = 4
W = "w"
T = list(range(100, 116))  # 4 blocks
U = list(range(200, 208))  # 2 blocks
V = list(range(300, 308))  # 2 blocks
WANT = [{"w/0": 4}, {"w/0": 1}, {"w/0": 0}]
"""T whole (two chained events), U's first block (its second removed), V stored then cleared on rank 0 …"""


class Sink(Protocol):
    def stored(
        self,
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        *,
        parent_block_hash: int | None = ...,
        medium: str | None = ...,
        lora_name: str | None = ...,
        dp_rank: int = ...,
    ) -> int: ...
    def removed(
        self, block_hashes: Sequence[int], *, medium: str | None = ..., dp_rank: int = ...
    ) -> int: ...
    def cleared(self, *, dp_rank: int = ...) -> int: ...


def scenario(pub: Sink) -> list[int]:
    """Report the scenario's events; return the sequence numbers the calls got."""
    return [
        pub.stored([1, 2], T[:8]),
        pub.stored([3, (1 << 64) - 1], T[8:], parent_block_hash=2),  # an unsigned 64-bit hash
        pub.stored([-5, 11], U),  # a signed one
        pub.removed([11]),
        pub.stored([20, 21], V, dp_rank=1),
        pub.cleared(dp_rank=1),
    ]


async def overlaps_of(p: Pipeline, prompts: list[list[int]]) -> list[dict[str, int]]:
    out = []
    for tokens in prompts:
        reply = await p.route(tokens, explain=True)
        assert reply.scores is not None
        out.append({f"{s.worker_id}/{s.dp_rank}": s.overlap_blocks for s in reply.scores if s.dp_rank == 0})
    return out


async def expect(p: Pipeline, prompts: list[list[int]], want: list[dict[str, int]]) -> None:
    got = await eventually(lambda: overlaps_of(p, prompts), lambda r: r == want, timeout_s=20)
    assert got == want


@contextlib.asynccontextmanager
async def jetstream(p: Pipeline, **kw: Any) -> AsyncIterator[JetStreamPublisher]:
    pub = await kvmesh.publish.open_jetstream(
        worker_id=W,
        model=p.model,
        block_size=BS,
        nats_url=p.nats_url,
        data_parallel_size=2,
        stream=p.stream,
        events_prefix=p.prefix,
        stream_memory=p.stream_memory,
        stream_max_bytes=64 * 2**20,
        **kw,
    )
    try:
        yield pub
    finally:
        await pub.aclose()


async def last_message(nats_url: str, p: Pipeline, dp_rank: int) -> EventsMessage:
    nc = await connect(nats_url, name="test-last")
    try:
        raw = await nc.jetstream().get_last_msg(
            p.stream, subjects.events_subject(p.prefix, p.model, W, dp_rank)
        )
        msg = decode_message(raw.data or b"")
        assert isinstance(msg, EventsMessage)
        return msg
    finally:
        await nc.close()


# ---------------------------------------------------------------------------------------------- both modes


async def test_jetstream_publisher_end_to_end(nats_url: str, uid: str) -> None:
    """Straight to JetStream: the router answers the exact overlaps, every message acknowledged, epoch 0."""
    async with clean_pipeline(nats_url, uid) as p:
        await p.start_indexer()
        await p.start_router()
        async with jetstream(p) as pub:
            assert pub.epoch == 0
            assert scenario(pub) == [0, 1, 2, 3, 0, 1]
            await expect(p, [T, U, V], WANT)
            assert await pub.flush(5.0)
            assert (pub.counters.dropped_batches, pub.counters.rejected_events) == (0, 0)
            assert pub.status().worker_id == W
            nc = await connect(nats_url, name="test-status")
            try:
                report = await kvmesh.ops.status(nc, stream=p.stream)
            finally:
                await nc.close()
            assert [(i.worker_id, i.outbox) for i in report.ingests if i.model == p.model] == [(W, 0)]
            last = await last_message(nats_url, p, 1)
            # rank 1's two calls share one stream message (made in one turn of the loop)
            assert (last.epoch, last.first_seq, last.seq, last.events[-1]) == (0, 0, 1, Cleared("engine"))


async def test_aclose_stops_the_publish_loop_at_once(
    nats_url: str, uid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """After publishing, `aclose` stops the publish loop when asked: nats-py's publish can swallow the
    cancellation, and the loop then waited for the next batch until the supervisor left it behind (a
    warning "publish loop did not stop within 5 s" at every close)."""
    async with clean_pipeline(nats_url, uid) as p:
        with caplog.at_level(logging.WARNING, logger="kvmesh"):
            async with jetstream(p) as pub:
                scenario(pub)  # closed at once, with the batches still buffered
        assert [r.getMessage() for r in caplog.records if "did not stop" in r.getMessage()] == []
        last = await last_message(nats_url, p, 1)  # and what was buffered was published
        assert (last.epoch, last.seq, last.events[-1]) == (0, 1, Cleared("engine"))


async def test_zmq_publisher_feeds_an_unchanged_ingest(nats_url: str, uid: str) -> None:
    """vLLM frames on PUB + replay ROUTER: a real ingest attaches unchanged (two ranks, port + r), replays the
    batches published before it connected, and the router gives the same overlaps as the JetStream mode."""
    events = _free_ports(4)
    pub = ZmqPublisher(
        f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{events + 2}", block_size=BS, data_parallel_size=2
    )
    try:
        assert pub.endpoints == [
            (f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{events + 2}"),
            (f"tcp://127.0.0.1:{events + 1}", f"tcp://127.0.0.1:{events + 3}"),
        ]
        # before any ingest: only the replay socket can deliver these
        assert [pub.stored([1, 2], T[:8]), pub.stored([3, (1 << 64) - 1], T[8:], parent_block_hash=2)] == [
            0,
            1,
        ]
        async with clean_pipeline(nats_url, uid) as p:
            await p.start_indexer()
            await p.start_router()
            await p.start_ingest(
                W,
                f"tcp://127.0.0.1:{events}",
                f"tcp://127.0.0.1:{events + 2}",
                block_size=BS,
                data_parallel_size=2,
            )
            await eventually(lambda: asyncio.sleep(0, pub.subscribers(0) * pub.subscribers(1)), bool)
            assert [
                pub.stored([-5, 11], U),
                pub.removed([11]),
                pub.stored([20, 21], V, dp_rank=1),
                pub.cleared(dp_rank=1),
            ] == [2, 3, 0, 1]
            await expect(p, [T, U, V], WANT)
            ing = p.ingests[W]
            assert ing.counters.decode_errors == 0
            assert ing.status().ranks["0"].last_seq == 3
    finally:
        pub.close()


def _free_ports(n: int) -> int:
    """A port p with p … p + n - 1 all free on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        socks = []
        try:
            for i in range(n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + i))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return base
    raise RuntimeError("no free port range")


# ---------------------------------------------------------------------------------------------- restart


CRASHING = """
import asyncio, json, sys
import kvmesh.ops
import kvmesh.publish

async def main():
    pub = await kvmesh.publish.open_jetstream(
        worker_id={w!r}, model={model!r}, block_size={bs}, nats_url={url!r}, stream={stream!r},
        events_prefix={prefix!r}, stream_memory=True, stream_max_bytes=64 * 2**20)
    pub.stored([1, 2], {t!r}[:8])
    pub.stored([3, 4], {t!r}[8:], parent_block_hash=2)
    pub.stored([10, 11], {u!r})
    assert await pub.flush(10)
    print(json.dumps({{"epoch": pub.epoch}}), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_restarted_publisher_starts_a_new_epoch(nats_url: str, uid: str, tmp_path: Path) -> None:
    """A publisher killed with -9 and started again publishes under epoch 1: the index drops what the old
    incarnation reported (T) and keeps only what the new one reports (U)."""
    async with clean_pipeline(nats_url, uid) as p:
        await p.start_indexer()
        await p.start_router()
        script = tmp_path / "engine.py"
        script.write_text(
            textwrap.dedent(
                CRASHING.format(
                    w=W, model=p.model, bs=BS, url=nats_url, stream=p.stream, prefix=p.prefix, t=T, u=U
                )
            )
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), stdout=asyncio.subprocess.PIPE
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert json.loads(line) == {"epoch": 0}
            await expect(p, [T, U], [{"w/0": 4}, {"w/0": 2}])
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        async with jetstream(p) as pub:
            assert pub.epoch == 1
            pub.stored([10, 11], U)
            await expect(p, [T, U], [{"w/0": 0}, {"w/0": 2}])
            first = await last_message(nats_url, p, 1)
            assert (first.epoch, first.seq, first.events) == (1, -1, [Cleared("restart")])


# ---------------------------------------------------------------------------------------------- outbox bound


async def test_outbox_bound_drops_oldest_and_clears_the_rank(tmp_path: Path, uid: str) -> None:
    """With room for 3 messages, 7 stores while NATS is down drop the oldest 4 and clear the rank once: after
    NATS is back only the last 3 index, and the calls never waited."""
    server = Restartable(tmp_path / "js")
    prompts = roots(7, 5000)
    try:
        async with file_pipeline(server, uid) as p:
            await start_indexer(p)
            await p.start_router()
            async with jetstream(p, max_buffered_batches=3) as pub:
                pub.stored([1, 2, 3, 4], T)
                await expect_within(p, [T], [{"w/0": 4, "w/1": 0}])
                server.kill()
                nc = pub._nc
                assert nc is not None
                await eventually(lambda: asyncio.sleep(0, not nc.is_connected), bool, timeout_s=30)
                loop = asyncio.get_running_loop()
                began = loop.time()
                for i, prompt in enumerate(prompts):
                    pub.stored([100 + i], prompt)
                    await asyncio.sleep(0)  # one stream message per call
                assert loop.time() - began < 1.0
                assert pub.counters.dropped_batches == 4
                assert pub.status().outbox == 3
                server.restart()
                await reindex(p)
                await expect_within(
                    p, [T, *prompts], [{"w/0": 0, "w/1": 0}] * 5 + [{"w/0": 1, "w/1": 0}] * 3, timeout_s=20
                )
                # 2 hellos, T, the overflow clear, the 3 kept
                assert await stream_messages(server.url, p.stream) == 7
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------- bad input


async def test_bad_events_raise_and_publish_nothing(nats_url: str, uid: str) -> None:
    """Misaligned tokens, a hash past 64 bits, an unknown rank and an empty removal raise PublishError naming
    the argument; nothing reaches the stream and the publisher goes on."""
    async with clean_pipeline(nats_url, uid) as p, jetstream(p) as pub:
        cases: list[tuple[str, Any]] = [
            ("token_ids", lambda: pub.stored([1, 2], T[:7])),
            ("block_hashes", lambda: pub.stored([1 << 64], T[:4])),
            ("parent_block_hash", lambda: pub.stored([1], T[:4], parent_block_hash=-(1 << 63) - 1)),
            ("dp_rank", lambda: pub.stored([1], T[:4], dp_rank=2)),
            ("block_hashes", lambda: pub.removed([])),
            ("token_ids", lambda: pub.stored([1], [*T[:3], -1])),
        ]
        for argument, call in cases:
            with pytest.raises(PublishError) as info:
                call()
            assert info.value.argument == argument
        assert await pub.flush(5.0)
        assert pub.counters.published == 2  # the two hellos
        assert pub.stored([1], T[:4]) == 0
        with ZmqPublisher("tcp://127.0.0.1:*", block_size=BS) as zpub, pytest.raises(PublishError):
            zpub.stored([1, 2], T[:5])


# ---------------------------------------------------------------------------------------------- TensorRT-LLM


def _block(h: int, tokens: list[int], mm: str | None = None) -> dict[str, Any]:
    """A ``stored_block`` as ``KVCacheEventSerializer`` writes it."""
    out: dict[str, Any] = {
        "type": "stored_block",
        "block_hash": h,
        "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
        "cache_level": 0,
        "priority": 35,
    }
    if mm is not None:
        out["mm_keys"] = [{"type": "mm_key", "hash": mm, "start_offset": 0}]
    return out


async def test_trtllm_polled_events_publish_through_the_api(nats_url: str, uid: str) -> None:
    """`LLM.get_kv_cache_events()` dicts: the largest window's stored/removed events publish (a trailing
    partial block and its removal left out, an image block kept apart from text), created / updated / other
    windows are counted, attention_dp_rank picks the rank."""
    window = {"window_size": 64}
    events: list[dict[str, Any]] = [
        {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [64, 256]}, **window},
        {
            "event_id": 1,
            "data": {"type": "created", "num_blocks_per_cache_level": [64, 256]},
            "window_size": 16,
        },
        {
            "event_id": 2,
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [*(_block(1 + i, T[i * BS : (i + 1) * BS]) for i in range(4)), _block(99, [1, 2])],
            },
            **window,
            "attention_dp_rank": 0,
        },
        {
            "event_id": 3,
            "data": {"type": "stored", "parent_hash": None, "blocks": [_block(7, T[:BS])]},
            "window_size": 16,
        },
        {
            "event_id": 4,
            "data": {
                "type": "updated",
                "block_hash": 1,
                "cache_level": {"type": "event_diff", "old_value": 0, "new_value": 1},
            },
            **window,
        },
        {"event_id": 5, "data": {"type": "removed", "block_hashes": [99, 4]}, **window},
        {
            "event_id": 6,
            "data": {"type": "stored", "parent_hash": None, "blocks": [_block(8, U[:BS], mm="ab" * 16)]},
            **window,
        },
        {
            "event_id": 7,
            "data": {
                "type": "stored",
                "parent_hash": None,
                "blocks": [_block(20, V[:BS]), _block(21, V[BS:])],
            },
            **window,
            "attention_dp_rank": 1,
        },
    ]
    async with clean_pipeline(nats_url, uid) as p:
        await p.start_indexer()
        await p.start_router()
        async with jetstream(p) as pub:
            adapter = kvmesh.publish.TrtllmEvents(pub, block_size=BS)
            adapter.publish_all(events)
            assert adapter.stats == kvmesh.publish.TrtllmEventStats(
                stored_blocks=7, removed_blocks=1, partial_blocks=1, created_ignored=2, updated_ignored=1,
                other_window_ignored=1,
            )  # fmt: skip
            await expect_within(
                p, [T, U[:BS], V], [{"w/0": 3, "w/1": 0}, {"w/0": 0, "w/1": 0}, {"w/0": 0, "w/1": 2}]
            )


async def test_restarted_zmq_publisher_is_a_new_epoch_for_the_ingest(nats_url: str, uid: str) -> None:
    """A ZmqPublisher closed and started again on the same ports numbers from 0: the ingest starts a new epoch,
    clears what the old one reported (T) and indexes what the new one does (U)."""
    events = _free_ports(2)
    endpoints = (f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{events + 1}")
    async with clean_pipeline(nats_url, uid) as p:
        await p.start_indexer()
        await p.start_router()
        pub = ZmqPublisher(*endpoints, block_size=BS)
        try:
            ing = await p.start_ingest(W, *endpoints, block_size=BS)
            await eventually(lambda: asyncio.sleep(0, pub.subscribers()), bool)
            for i in range(3):
                pub.stored([1 + i], T[i * BS : (i + 1) * BS], parent_block_hash=i or None)
            await expect_within(p, [T, U], [{"w/0": 3}, {"w/0": 0}])
        finally:
            pub.close()
        pub = ZmqPublisher(*endpoints, block_size=BS)
        try:
            await eventually(lambda: asyncio.sleep(0, pub.subscribers()), bool, timeout_s=20)
            assert pub.stored([10, 11], U) == 0
            await expect_within(p, [T, U], [{"w/0": 0}, {"w/0": 2}])
            assert ing.status().ranks["0"].epoch == 1
        finally:
            pub.close()
