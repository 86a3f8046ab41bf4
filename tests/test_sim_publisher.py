"""Tests of the simulated engine's ZMQ publisher and worker over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import zmq
import zmq.asyncio

from kvmesh.core.wire import (
    SEQ_END,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    decode_batch,
    decode_replay_reply,
    decode_seq,
    encode_batch,
    encode_replay_request,
    encode_seq,
)
from kvmesh.sim.engine import SimWorker, output_tokens
from kvmesh.sim.publisher import EventPublisher, replay_includes_topic

pytestmark = pytest.mark.anyio

TS = 1700000000.25
TOPIC = b"kv-events"
END = encode_seq(SEQ_END)
ANY_PORT = "tcp://127.0.0.1:*"
RECV_TIMEOUT_S = 5.0
SILENCE_S = 0.3


@pytest.fixture
def anyio_backend() -> str:
    """Run this module's async tests on asyncio (zmq.asyncio needs it)."""
    return "asyncio"


@pytest.fixture
def actx() -> Iterator[zmq.asyncio.Context]:
    """An asyncio ZMQ context sharing the process-global context (so inproc endpoints are reachable)."""
    ctx = zmq.asyncio.Context(shadow=zmq.Context.instance())
    yield ctx


@pytest.fixture
def publisher() -> Iterator[EventPublisher]:
    """A vLLM 0.33.0 publisher on free 127.0.0.1 ports with topic "kv-events" and a fixed clock."""
    pub = EventPublisher(ANY_PORT, ANY_PORT, topic="kv-events", version="0.33.0", clock=lambda: TS)
    yield pub
    pub.close()


def stored_event(i: int) -> BlockStored:
    """A one-block BlockStored whose hash and tokens depend on ``i``."""
    return BlockStored(
        block_hashes=(1000 + i,),
        parent_block_hash=None if i == 0 else 999 + i,
        token_ids=(i, i + 1, i + 2, i + 3),
        block_size=4,
        medium="GPU",
        extra_keys=(None,),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def payload(i: int, *, version: str = "0.33.0", dp_rank: int = 0) -> bytes:
    """The payload bytes the publisher sends for ``[stored_event(i)]``."""
    return encode_batch(EngineBatch(ts=TS, events=(stored_event(i),), dp_rank=dp_rank), version=version)


@pytest.fixture
async def sub(actx: zmq.asyncio.Context, publisher: EventPublisher) -> AsyncIterator[zmq.asyncio.Socket]:
    """A SUB socket subscribed to everything and connected to ``publisher`` (subscription delivered)."""
    sock = actx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(publisher.endpoint)
    await publisher.wait_for_subscribers(1)
    yield sock
    sock.close(linger=0)


@pytest.fixture
def dealer(actx: zmq.asyncio.Context, publisher: EventPublisher) -> Iterator[zmq.asyncio.Socket]:
    """A DEALER socket connected to ``publisher``'s replay endpoint."""
    assert publisher.replay_endpoint is not None
    sock = actx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(publisher.replay_endpoint)
    yield sock
    sock.close(linger=0)


async def recv(sock: zmq.asyncio.Socket) -> list[bytes]:
    """Receive one multipart message or fail after RECV_TIMEOUT_S."""
    return await asyncio.wait_for(sock.recv_multipart(), RECV_TIMEOUT_S)


async def assert_silent(sock: zmq.asyncio.Socket) -> None:
    """Assert that nothing arrives on ``sock`` within SILENCE_S."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(sock.recv_multipart(), SILENCE_S)


async def replay(dealer: zmq.asyncio.Socket, start_seq: int) -> list[list[bytes]]:
    """Request a replay from ``start_seq`` and return every reply up to and including the END marker."""
    await dealer.send_multipart(encode_replay_request(start_seq))
    replies: list[list[bytes]] = []
    while True:
        frames = await recv(dealer)
        replies.append(frames)
        if decode_replay_reply(frames).is_end:
            return replies


async def test_live_batches_arrive_with_seq_from_zero_and_decode(
    publisher: EventPublisher, sub: zmq.asyncio.Socket
) -> None:
    """Three published batches arrive as [topic, seq 0/1/2, payload] and decode to the published events."""
    assert [publisher.publish([stored_event(i)]) for i in range(3)] == [0, 1, 2]
    for i in range(3):
        topic, seq, data = await recv(sub)
        assert (topic, decode_seq(seq), data) == (TOPIC, i, payload(i))
        assert decode_batch(data) == EngineBatch(ts=TS, events=(stored_event(i),), dp_rank=0)
    await assert_silent(sub)


@pytest.mark.parametrize("version", ["0.25.0", "0.33.0"])
async def test_replay_sends_buffered_batches_then_end_in_the_release_framing(
    actx: zmq.asyncio.Context, version: str
) -> None:
    """Replay from 1 returns seqs 1 and 2 then END, without the topic frame before 0.26 and with it after."""
    with EventPublisher(ANY_PORT, ANY_PORT, topic="kv-events", version=version, clock=lambda: TS) as pub:
        assert pub.replay_endpoint is not None
        dealer = actx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        try:
            for i in range(3):
                pub.publish([stored_event(i)])
            replies = await replay(dealer, 1)
        finally:
            dealer.close(linger=0)
    if version == "0.25.0":
        assert replies == [
            [b"", encode_seq(1), payload(1, version=version)],
            [b"", encode_seq(2), payload(2, version=version)],
            [b"", END, b""],
        ]
    else:
        assert replies == [
            [b"", TOPIC, encode_seq(1), payload(1, version=version)],
            [b"", TOPIC, encode_seq(2), payload(2, version=version)],
            [b"", b"", END, b""],
        ]


async def test_drop_next_leaves_a_live_gap_that_replay_fills(
    publisher: EventPublisher, sub: zmq.asyncio.Socket, dealer: zmq.asyncio.Socket
) -> None:
    """A dropped batch consumes seq 1 live (SUB sees 0 then 2) but is replayed byte for byte."""
    publisher.publish([stored_event(0)])
    publisher.drop_next(1)
    assert publisher.publish([stored_event(1)]) == 1
    publisher.publish([stored_event(2)])
    assert [decode_seq((await recv(sub))[1]) for _ in range(2)] == [0, 2]
    await assert_silent(sub)
    assert await replay(dealer, 1) == [
        [b"", TOPIC, encode_seq(1), payload(1)],
        [b"", TOPIC, encode_seq(2), payload(2)],
        [b"", b"", END, b""],
    ]


async def test_invalid_replay_request_gets_nothing(
    publisher: EventPublisher, dealer: zmq.asyncio.Socket
) -> None:
    """A request that is not [identity, b"", start] gets no reply; the next valid one is served."""
    publisher.publish([stored_event(0)])
    await dealer.send_multipart([b"", encode_seq(0), b"extra"])
    await assert_silent(dealer)
    assert await replay(dealer, 0) == [[b"", TOPIC, encode_seq(0), payload(0)], [b"", b"", END, b""]]


async def test_replay_past_the_newest_batch_returns_only_end(
    publisher: EventPublisher, dealer: zmq.asyncio.Socket
) -> None:
    """A start seq after the newest buffered batch is answered with the END marker alone."""
    publisher.publish([stored_event(0)])
    assert await replay(dealer, 5) == [[b"", b"", END, b""]]


async def test_replay_can_be_disabled_or_truncated(
    publisher: EventPublisher, dealer: zmq.asyncio.Socket
) -> None:
    """replay_enabled=False answers nothing; replay_truncate=1 sends one batch then END."""
    for i in range(3):
        publisher.publish([stored_event(i)])
    publisher.replay_enabled = False
    await dealer.send_multipart(encode_replay_request(0))
    await assert_silent(dealer)
    publisher.replay_enabled = True
    publisher.replay_truncate = 1
    assert await replay(dealer, 0) == [[b"", TOPIC, encode_seq(0), payload(0)], [b"", b"", END, b""]]
    publisher.replay_truncate = 0
    assert await replay(dealer, 0) == [[b"", b"", END, b""]]


async def test_restart_resets_seq_and_empties_the_buffer(
    publisher: EventPublisher, sub: zmq.asyncio.Socket, dealer: zmq.asyncio.Socket
) -> None:
    """After restart() the next batch has seq 0 again and replay holds only post-restart batches."""
    publisher.publish([stored_event(0)])
    publisher.publish([stored_event(1)])
    publisher.restart()
    assert publisher.publish([stored_event(5)]) == 0
    assert [decode_seq((await recv(sub))[1]) for _ in range(3)] == [0, 1, 0]
    assert await replay(dealer, 0) == [[b"", TOPIC, encode_seq(0), payload(5)], [b"", b"", END, b""]]


async def test_buffer_keeps_only_the_last_buffer_steps_batches(actx: zmq.asyncio.Context) -> None:
    """With buffer_steps=3 and 5 batches published, a replay from 0 returns seqs 2, 3, 4."""
    with EventPublisher(ANY_PORT, ANY_PORT, buffer_steps=3, clock=lambda: TS) as pub:
        assert pub.replay_endpoint is not None
        dealer = actx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        try:
            for i in range(5):
                pub.publish([stored_event(i)])
            assert pub.buffered_seqs == (2, 3, 4)
            replies = await replay(dealer, 0)
        finally:
            dealer.close(linger=0)
    assert [decode_replay_reply(r).seq for r in replies] == [2, 3, 4, SEQ_END]


@pytest.mark.parametrize(
    ("producer", "version", "expected"),
    [
        ("vllm", "0.10.1.1", False),
        ("vllm", "0.25.1", False),
        ("vllm", "0.26.0", True),
        ("vllm", "0.33.0", True),
        ("sglang", "0.5.21", False),
        ("sglang", "0.5.22", True),
    ],
)
async def test_replay_topic_frame_starts_at_vllm_026_and_sglang_0522(
    producer: str, version: str, expected: bool
) -> None:
    """replay_includes_topic is True from vLLM 0.26 and SGLang 0.5.22 on."""
    assert replay_includes_topic(producer, version) is expected


async def test_publisher_rejects_an_unknown_release() -> None:
    """A version the wire encoder does not know is refused at construction."""
    with pytest.raises(ValueError):
        EventPublisher(ANY_PORT, version="9.0.0")


async def test_sim_worker_publishes_prefill_and_decode_blocks(actx: zmq.asyncio.Context) -> None:
    """A worker publishes one batch for the prompt's full blocks and one per decode-completed block."""
    async with SimWorker(
        "w0", num_blocks=64, block_size=4, endpoint=ANY_PORT, replay_endpoint=ANY_PORT, seed=7
    ) as worker:
        sock = actx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(worker.publisher.endpoint)
        try:
            await worker.publisher.wait_for_subscribers(1)
            prompt = list(range(1, 11))
            result = await worker.serve_request(prompt, 4)
            assert result == {"cached_tokens": 0, "prompt_tokens": 10, "worker_id": "w0", "dp_rank": 0}
            out = output_tokens(prompt, 4, seed=7)
            h0, h1, h2 = worker.pool.compute_block_hashes([*prompt, *out[:2]])
            batches = [
                (decode_seq(seq), decode_batch(data)) for _, seq, data in [await recv(sock) for _ in range(2)]
            ]
            assert [(seq, b.dp_rank, b.events) for seq, b in batches] == [
                (
                    0,
                    0,
                    (
                        BlockStored(
                            block_hashes=(h0, h1),
                            parent_block_hash=None,
                            token_ids=tuple(prompt[:8]),
                            block_size=4,
                            medium="GPU",
                            extra_keys=(None, None),
                            group_idx=0,
                            kv_cache_spec_kind="full_attention",
                        ),
                    ),
                ),
                (
                    1,
                    0,
                    (
                        BlockStored(
                            block_hashes=(h2,),
                            parent_block_hash=h1,
                            token_ids=(9, 10, out[0], out[1]),
                            block_size=4,
                            medium="GPU",
                            extra_keys=(None,),
                            group_idx=0,
                            kv_cache_spec_kind="full_attention",
                        ),
                    ),
                ),
            ]
            await assert_silent(sock)
            again = await worker.serve_request([*prompt[:8], 50, 51, 52, 53, 54], 1)
            assert again["cached_tokens"] == 8
        finally:
            sock.close(linger=0)


async def test_sim_worker_serves_concurrent_requests_one_at_a_time(actx: zmq.asyncio.Context) -> None:
    """Two concurrent requests on one worker publish their batches in order, without interleaving."""
    async with SimWorker(
        "w1", num_blocks=64, block_size=4, endpoint=ANY_PORT, replay_endpoint=ANY_PORT
    ) as worker:
        assert worker.publisher.replay_endpoint is not None
        a, b = list(range(100, 109)), list(range(200, 209))
        results = await asyncio.gather(worker.serve_request(a, 6), worker.serve_request(b, 6))
        assert [r["prompt_tokens"] for r in results] == [9, 9]
        dealer = actx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(worker.publisher.replay_endpoint)
        try:
            replies = await replay(dealer, 0)
        finally:
            dealer.close(linger=0)
    firsts = []
    for reply in replies[:-1]:
        (event,) = decode_batch(decode_replay_reply(reply).payload).events
        assert isinstance(event, BlockStored)
        firsts.append(event.token_ids[0])
    assert firsts == [100, 108, 200, 208]


async def test_sim_worker_dp_rank_offsets_the_endpoints_and_tags_batches(actx: zmq.asyncio.Context) -> None:
    """A rank-1 worker binds the base inproc endpoints with _dp1 and stamps dp_rank 1 into its batches."""
    base = f"inproc://kvmesh-test-{uuid.uuid4().hex}"
    async with SimWorker(
        "w2", num_blocks=8, block_size=4, endpoint=base, replay_endpoint=f"{base}-replay", dp_rank=1
    ) as worker:
        assert (worker.publisher.endpoint, worker.publisher.replay_endpoint) == (
            f"{base}_dp1",
            f"{base}-replay_dp1",
        )
        sock = actx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(f"{base}_dp1")
        try:
            await worker.publisher.wait_for_subscribers(1)
            result = await worker.serve_request([1, 2, 3, 4, 5], 1)
            assert result == {"cached_tokens": 0, "prompt_tokens": 5, "worker_id": "w2", "dp_rank": 1}
            _, seq, data = await recv(sock)
            assert (decode_seq(seq), decode_batch(data).dp_rank) == (0, 1)
        finally:
            sock.close(linger=0)


def test_only_a_publisher_with_a_snapshot_socket_keeps_the_engine_state() -> None:
    """Without a snapshot socket the publisher keeps no snapshot state (decoding and folding every batch made
    a long `kvmesh up` run slow down until the engine looked dead); with one, removals count down exactly."""
    plain = EventPublisher("tcp://127.0.0.1:*", None)
    try:
        plain.publish(
            [BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(1, 2), block_size=2)]
        )
        with pytest.raises(RuntimeError, match="needs a snapshot_endpoint"):
            plain.live_blocks()
    finally:
        plain.close()
    snap = EventPublisher("tcp://127.0.0.1:*", None, snapshot_endpoint="tcp://127.0.0.1:*")
    try:
        stored = BlockStored(
            block_hashes=(1, 2), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=2
        )
        snap.publish([stored, stored])
        snap.publish([BlockRemoved(block_hashes=(1, 2)), BlockRemoved(block_hashes=(2, 3))])
        assert sorted(snap.live_blocks().values()) == [1]
        assert [key[-1] for key in snap.live_blocks()] == [1]
    finally:
        snap.close()
