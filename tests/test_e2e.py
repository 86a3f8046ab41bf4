"""End to end with real parts: simulated vLLM workers over real ZMQ → ingest → JetStream → indexer → router."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from tests.pipeline import eventually, overlaps, pipeline

from kvmesh.client import BadRequestError, UnknownModelError
from kvmesh.ops import decode_router_service, gather_replies, router_status
from kvmesh.sim.engine import SimWorker

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.e2e]

BS = 4
P1 = list(range(100, 116))  # 4 blocks
P2 = [*P1[:8], 900, 901, 902, 903]  # shares 2 blocks with P1, then 1 of its own
Q = list(range(2000, 2064))  # 16 distinct blocks: fills worker A's pool


@pytest.mark.parametrize("index", ["remote", "local"])
async def test_route_answers_exact_overlaps_through_evictions_and_clear(
    nats_url: str, uid: str, index: str
) -> None:
    """Two workers' events reach the router: exact overlaps before and after an eviction and a reset.

    With ``--index remote`` the router asks the indexer; with ``--index local`` it holds its own replica of the
    index, fed by the same stream: every answer must be the same.
    """
    a = SimWorker(
        "worker-a",
        num_blocks=16,
        block_size=BS,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        seed=1,
        version="0.9.1",
    )
    b = SimWorker(
        "worker-b",
        num_blocks=64,
        block_size=BS,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        seed=2,
        version="0.33.0",
    )
    try:
        async with pipeline(nats_url, uid) as p:
            for w in (a, b):
                await p.start_ingest(
                    w.worker_id, w.publisher.endpoint, w.publisher.replay_endpoint, block_size=BS
                )
                await w.publisher.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router(index)
            assert p.router_service is not None
            assert (p.router_service.replica is not None) == (index == "local")

            # Both workers announced themselves: nothing cached yet, both are candidates.
            first = await eventually(lambda: p.route(P1, explain=True), lambda r: len(r.scores or []) == 2)
            assert overlaps(first) == {"worker-a/0": 0, "worker-b/0": 0}

            assert (await a.serve_request(P1, 0))["cached_tokens"] == 0
            assert (await b.serve_request(P2, 0))["cached_tokens"] == 0
            r1 = await eventually(
                lambda: p.route(P1, explain=True, request_id="r-1"),
                lambda r: overlaps(r) == {"worker-a/0": 4, "worker-b/0": 2},
            )
            assert (r1.request_id, r1.worker_id, r1.dp_rank, r1.cached_tokens, r1.block_size) == (
                "r-1",
                "worker-a",
                0,
                16,
                BS,
            )
            assert overlaps(r1) == {"worker-a/0": 4, "worker-b/0": 2}
            # r-1 is accounted on worker-a until it finishes; finishing it leaves no load anywhere.
            assert p.router is not None
            await p.router.finish("r-1")
            r2 = await eventually(
                lambda: p.route(P2, explain=True),
                lambda r: all(s.load.active_blocks == 0 for s in r.scores or []),
            )
            assert (r2.worker_id, r2.overlap_blocks) == ("worker-b", 3)
            assert overlaps(r2) == {"worker-a/0": 2, "worker-b/0": 3}
            assert r2.scores is not None and [s.cost for s in r2.scores] == [0.0, 1.0]

            # Q fills A's 16-block pool: P1's four cached blocks are evicted (four BlockRemoved).
            assert (await a.serve_request(Q, 0))["cached_tokens"] == 0
            r3 = await eventually(
                lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"worker-a/0": 0, "worker-b/0": 2}
            )
            assert (r3.worker_id, r3.overlap_blocks) == ("worker-b", 2)
            rq = await p.route(Q, explain=True)
            assert overlaps(rq) == {"worker-a/0": 16, "worker-b/0": 0}

            # Resetting B's prefix cache (AllBlocksCleared) leaves nothing of P2 anywhere.
            assert await b.reset_prefix_cache() is True
            r4 = await eventually(
                lambda: p.route(P2, explain=True), lambda r: overlaps(r) == {"worker-a/0": 0, "worker-b/0": 0}
            )
            assert overlaps(r4) == {"worker-a/0": 0, "worker-b/0": 0}
            # Tie at zero overlap: the worker with the fewest cached blocks (B, now empty) wins.
            assert (r4.worker_id, r4.overlap_blocks) == ("worker-b", 0)

            # `kvmesh status` lists the router with its index mode (and a local index's sequence and lag).
            assert p.indexer is not None and p._nc is not None
            replies = await gather_replies(p._nc, "$SRV.STATS.kvmesh-router", b"", 0.5) or []
            stats = [decode_router_service(r) for r in replies]
            mine = [
                msgspec.to_builtins(router_status(s, p.indexer.state.applied_seq))
                for s in stats
                if s.stats.index.route_subject == p.route_subject
            ]
            assert len(mine) == 1 and mine[0]["mode"] == index
            if index == "local":
                assert (mine[0]["applied_seq"], mine[0]["lag"]) == (p.indexer.state.applied_seq, 0)
    finally:
        a.close()
        b.close()


async def test_route_errors_have_codes_and_service_headers(nats_url: str, uid: str) -> None:
    """Unknown model, empty token_ids, a non-integer token and a non-JSON body each get their error code."""
    w = SimWorker("worker-e", num_blocks=16, block_size=BS, endpoint="tcp://127.0.0.1:*", seed=3)
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest(w.worker_id, w.publisher.endpoint, block_size=BS)
            await w.publisher.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            await eventually(lambda: p.route(P1), lambda r: r.worker_id == "worker-e")

            with pytest.raises(UnknownModelError) as unknown:
                await p.route(P1, model="no-such-model")
            assert unknown.value.code == "unknown_model"

            nc = p._nc
            cases = [
                (
                    b'{"model": "test-model", "token_ids": []}',
                    "bad_request",
                    "400",
                    "token_ids must not be empty",
                ),
                (b'{"model": "test-model", "token_ids": [1, "x"]}', "bad_request", "400", "$.token_ids[1]"),
                (
                    b'{"model": "test-model", "token_ids": [1, 4294967296]}',
                    "bad_request",
                    "400",
                    "outside [0, 2^32)",
                ),
                (b"not json", "bad_request", "400", "not valid JSON"),
                (
                    b'{"model": "no-such-model", "token_ids": [1, 2, 3, 4]}',
                    "unknown_model",
                    "404",
                    "no-such-model",
                ),
            ]
            for body, code, status, text in cases:
                msg = await nc.request(p.route_subject, body, timeout=3)
                reply = json.loads(msg.data)
                assert reply["error"]["code"] == code, body
                assert text in reply["error"]["message"], (body, reply)
                assert msg.headers is not None
                assert msg.headers["Nats-Service-Error-Code"] == status
                assert msg.headers["Nats-Service-Error"].startswith(f"{code}: ")

            with pytest.raises(BadRequestError):
                await p.route([])
    finally:
        w.close()


async def test_match_accepts_packed_and_listed_token_ids_alike(nats_url: str, uid: str) -> None:
    """The indexer answers a packed-uint32 and a listed match query identically; a ragged packing is bad_request."""
    from array import array

    import msgspec

    from kvmesh.core import protocol
    from kvmesh.core.protocol import MatchRequest

    w = SimWorker("worker-m", num_blocks=16, block_size=BS, endpoint="tcp://127.0.0.1:*", seed=4)
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest(w.worker_id, w.publisher.endpoint, block_size=BS)
            await w.publisher.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            await w.serve_request(P1, 0)
            await eventually(lambda: p.route(P1), lambda r: r.overlap_blocks == 4)
            nc = p._nc

            async def match(token_ids: bytes | list[int]) -> dict[str, object]:
                body = protocol.encode(
                    MatchRequest(model="test-model", token_ids=token_ids), format="msgpack"
                )
                return dict(msgspec.msgpack.decode((await nc.request(p.match_subject, body, timeout=3)).data))

            packed = await match(array("I", P1).tobytes())
            listed = await match(P1)
            assert packed["candidates"] == listed["candidates"] == [["worker-m", 0, 4, 4, None, BS]]
            ragged = await match(array("I", P1).tobytes()[:-1])
            assert ragged["error"]["code"] == "bad_request"  # type: ignore[index]
            assert "4 bytes each" in ragged["error"]["message"]  # type: ignore[index]
    finally:
        w.close()


async def test_candidates_follow_the_worker_registry(nats_url: str, uid: str) -> None:
    """With no indexer (so no `WorkerRemoved` ever reaches the stream), the local-index router's candidates
    still follow the registry: a registered worker the index does not know joins with zero overlap on each
    of its DP ranks, and a worker whose key is gone leaves at once."""
    import msgspec

    from kvmesh.core.protocol import WorkerRecord
    from kvmesh.runtime import subjects
    from kvmesh.sim.publisher import EventPublisher

    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        async with pipeline(nats_url, uid) as p:
            # A long TTL: the ingest heartbeats every 100 s, so it does not re-register during the test.
            await p.start_ingest("w", pub.endpoint, pub.replay_endpoint, block_size=BS, worker_ttl_s=300.0)
            await pub.wait_for_subscribers(1)
            await p.start_router("local")
            first = await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w/0": 0})
            assert first.worker_id == "w"

            assert p._nc is not None
            kv = await p._nc.jetstream().key_value(subjects.registry_bucket(p.stream))
            ghost = WorkerRecord(worker_id="ghost", model=p.model, dp_ranks=2, block_size=BS, incarnation=0)
            await kv.put(subjects.kv_key("ghost"), msgspec.json.encode(ghost))
            other = WorkerRecord(
                worker_id="other", model="another-model", dp_ranks=1, block_size=BS, incarnation=0
            )
            await kv.put(subjects.kv_key("other"), msgspec.json.encode(other))
            await eventually(
                lambda: p.route(P1, explain=True),
                lambda r: overlaps(r) == {"w/0": 0, "ghost/0": 0, "ghost/1": 0},
            )

            await kv.delete(subjects.kv_key("w"))
            gone = await eventually(
                lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"ghost/0": 0, "ghost/1": 0}
            )
            assert gone.worker_id == "ghost"
            assert p.router_service is not None and p.router_service.replica is not None
            assert "w" in p.router_service.replica.state.workers()  # still indexed: only the registry moved
    finally:
        pub.close()


@pytest.mark.parametrize("index", ["local", "remote"])
async def test_requests_whose_errors_would_echo_past_the_max_payload_leave_the_router_serving(
    nats_url: str, uid: str, index: str
) -> None:
    """A 600,000-character model name or candidate (a 600 KB request under the 1 MiB max payload) gets an
    error that repeats it clipped; echoed in full, the reply (header and body) exceeded the max payload and
    the server closed the router's (or the indexer's) connection for good. Both keep serving."""
    from kvmesh.client import NoWorkersError

    pub_worker = SimWorker("w", num_blocks=16, block_size=BS, endpoint="tcp://127.0.0.1:*", seed=1)
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest("w", pub_worker.publisher.endpoint, block_size=BS)
            await pub_worker.publisher.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router(index)
            await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w/0": 0})
            with pytest.raises(UnknownModelError) as unknown:
                await p.route(P1, model="m" * 600_000)
            message = unknown.value.message
            assert message.startswith("no worker serves model 'mmm") and message.endswith(" characters)")
            assert len(message) < 700
            with pytest.raises(NoWorkersError) as none:
                await p.route(P1, candidates=["x" * 600_000])
            assert len(none.value.message) < 700
            assert (await p.route(P1)).worker_id == "w"  # still serving
    finally:
        pub_worker.close()


async def test_after_a_reset_registered_workers_still_take_requests(nats_url: str, uid: str) -> None:
    """`kvmesh reset` makes every replica forget every worker; the registry still knows them, so the model is
    routed among them with nothing cached instead of answering unknown_model until an engine stores again."""
    from kvmesh.core.events import IndexReset, encode_message
    from kvmesh.runtime import subjects

    worker = SimWorker("w", num_blocks=16, block_size=BS, endpoint="tcp://127.0.0.1:*", seed=1)
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest("w", worker.publisher.endpoint, block_size=BS)
            await worker.publisher.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router("local")
            assert (await worker.serve_request(P1, 0))["cached_tokens"] == 0
            await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w/0": 4})
            assert p._nc is not None and p.router_service is not None
            ack = await p._nc.jetstream().publish(
                subjects.control_subject(p.prefix), encode_message(IndexReset(epoch=1, reason="test"))
            )
            # The reply's own index_seq says whether it was answered after the reset (a check of the replica's
            # state after the reply could see a reset that came just after the answer).
            reply = await eventually(lambda: p.route(P1, explain=True), lambda r: r.index_seq >= ack.seq)
            assert (reply.worker_id, reply.overlap_blocks, reply.block_size) == ("w", 0, BS)
            assert overlaps(reply) == {"w/0": 0}
    finally:
        worker.close()


async def test_a_deleted_registry_bucket_voids_what_it_said(nats_url: str, uid: str) -> None:
    """Deleting the registry bucket under a running router drops the workers it listed from the candidates
    (a watch on a deleted bucket just goes quiet); the ingest re-creates the bucket at its next heartbeat
    and its worker comes back."""
    import msgspec

    from kvmesh.core.protocol import WorkerRecord
    from kvmesh.runtime import subjects

    worker = SimWorker("w", num_blocks=16, block_size=BS, endpoint="tcp://127.0.0.1:*", seed=1)
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest("w", worker.publisher.endpoint, block_size=BS, worker_ttl_s=3.0)
            await worker.publisher.wait_for_subscribers(1)
            await p.start_router("local")
            assert p._nc is not None and p.router_service is not None
            js = p._nc.jetstream()
            bucket = subjects.registry_bucket(p.stream)
            kv = await js.key_value(bucket)
            ghost = WorkerRecord(worker_id="ghost", model=p.model, dp_ranks=1, block_size=BS, incarnation=0)
            await kv.put(subjects.kv_key("ghost"), msgspec.json.encode(ghost))
            await eventually(
                lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w/0": 0, "ghost/0": 0}
            )
            await js.delete_key_value(bucket)
            # The ghost never heartbeats again: once the bucket is back (the ingest's heartbeat, every 1 s
            # here), only w is listed.
            await eventually(
                lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w/0": 0}, timeout_s=20
            )
            watcher = p.router_service.registry
            await eventually(
                lambda: asyncio.sleep(0, sorted(getattr(watcher, "workers", {}))), lambda w: w == ["w"]
            )
    finally:
        worker.close()
