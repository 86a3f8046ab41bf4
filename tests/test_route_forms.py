"""The route request forms through a real NATS server and the real services (ingest, indexer, router):
JSON, packed token ids and pre-hashed local block hashes answer alike; bad bodies get error replies and the
router keeps serving; the client falls back to JSON for a router that reads only JSON."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
from tests.pipeline import Pipeline, eventually
from tests.test_ingest_faults import clean_pipeline, stored

from kvmesh.client import JSON_RETRY_S, BadRequestError, Router
from kvmesh.core import protocol as p
from kvmesh.core.hashing import local_block_hashes
from kvmesh.runtime.nats import connect
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

BS = 16
PROMPT = list(range(5000, 5160))  # 160 tokens, 10 blocks: packed (640 bytes) by the client
HASHES = local_block_hashes(PROMPT, BS)


@asynccontextmanager
async def fleet(nats_url: str, uid: str, index: str = "local") -> AsyncIterator[Pipeline]:
    """w1 holds the prompt's first 6 blocks, w2 its first 3, then routes are exact."""
    pubs = {"w1": EventPublisher("tcp://127.0.0.1:*"), "w2": EventPublisher("tcp://127.0.0.1:*")}
    try:
        async with clean_pipeline(nats_url, uid) as pipe:
            for worker, pub in pubs.items():
                await pipe.start_ingest(worker, pub.endpoint, block_size=BS)
                await pub.wait_for_subscribers(1)
            await pipe.start_indexer()
            await pipe.start_router(index=index)
            pubs["w1"].publish([stored(range(10, 16), PROMPT[: 6 * BS], block_size=BS)])
            pubs["w2"].publish([stored(range(20, 23), PROMPT[: 3 * BS], block_size=BS)])
            await eventually(lambda: pipe.route(PROMPT), lambda r: r.cached_tokens == 6 * BS)
            yield pipe
    finally:
        for pub in pubs.values():
            pub.close()


def fields(**kw: Any) -> str:
    return p.encode(p.RouteRequest(model="test-model", **kw)).decode()


async def test_every_form_gets_the_same_reply_and_explain(nats_url: str, uid: str) -> None:
    """JSON, tokens-u32le and pre-hashed (JSON and hashes-u64le) requests of one prompt get equal replies,
    explain included; the client sent the long prompt packed."""
    async with fleet(nats_url, uid) as pipe:
        nc = pipe._nc
        seen: list[dict[str, str] | None] = []

        async def note(msg: Any) -> None:
            seen.append(msg.headers)

        spy = await nc.subscribe(pipe.route_subject, cb=note)
        await nc.flush()
        json_router = Router(nc, subject=pipe.route_subject, timeout_s=3.0, form="json")
        assert pipe.router is not None
        kw: dict[str, Any] = {"request_id": "r-1", "explain": True}
        by_json = await json_router.route("test-model", PROMPT, **kw)
        by_tokens = await pipe.router.route("test-model", PROMPT, **kw)
        by_hash = await pipe.router.route_by_hash("test-model", HASHES, **kw)
        raw = await nc.request(
            pipe.route_subject,
            struct.pack(f"<{len(HASHES)}Q", *HASHES),
            timeout=3,
            headers={p.BODY_HEADER: p.BODY_HASHES_U64LE, p.FIELDS_HEADER: fields(**kw, block_size=BS)},
        )
        by_packed_hash = p.decode(raw.data, p.RouteReply)
        await spy.unsubscribe()
        assert (by_json.worker_id, by_json.overlap_blocks, by_json.cached_tokens) == ("w1", 6, 96)
        assert (by_json.available_tokens, by_json.block_size, by_json.mode) == (96, BS, "exact")
        assert by_json.scores is not None
        assert [(s.worker_id, s.overlap_blocks, s.cached_tokens) for s in by_json.scores] == [
            ("w1", 6, 96),
            ("w2", 3, 48),
        ]
        assert by_tokens == by_json
        assert by_hash == by_json
        assert by_packed_hash == by_json
        assert seen[0] is None  # JSON
        assert seen[1] is not None
        assert seen[1][p.BODY_HEADER] == p.BODY_TOKENS_U32LE
        assert msgspec.json.decode(seen[1][p.FIELDS_HEADER]) == {
            "model": "test-model",
            "request_id": "r-1",
            "explain": True,
        }
        assert seen[2] is None  # 10 hashes (80 bytes) go as JSON: below BINARY_MIN_BYTES
        assert pipe.router.fallbacks == 0


async def test_bad_bodies_get_error_replies_and_the_router_keeps_serving(nats_url: str, uid: str) -> None:
    """A truncated packed body, an odd-length hashes body, a hash out of range, both forms at once, neither,
    and salt beside pre-hashed ids each get a bad_request reply (400) naming the problem; then a route
    succeeds."""
    async with fleet(nats_url, uid) as pipe:
        nc = pipe._nc
        tokens = {p.BODY_HEADER: p.BODY_TOKENS_U32LE, p.FIELDS_HEADER: fields()}
        hashes = {p.BODY_HEADER: p.BODY_HASHES_U64LE, p.FIELDS_HEADER: fields()}
        cases: list[tuple[bytes, dict[str, str] | None, str]] = [
            (
                b"\x01\x00\x00\x00\x02\x00",
                tokens,
                "a tokens-u32le body is a whole number of 4-byte ids: got 6",
            ),
            (b"\x00" * 20, hashes, "a hashes-u64le body is a whole number of 8-byte ids: got 20 bytes"),
            (
                b'{"model":"test-model","block_hashes":[1,18446744073709551616]}',
                None,
                "block_hashes[1] is outside",
            ),
            (b'{"model":"test-model","token_ids":[1],"block_hashes":[2]}', None, "not more"),
            (
                b'{"model":"test-model"}',
                None,
                "token_ids must not be empty (or send block_hashes or seq_hashes)",
            ),
            (b"\x00" * 8, {**hashes, p.FIELDS_HEADER: fields(cache_salt="t")}, "cache_salt is mixed into"),
            (b"\x00" * 8, {p.BODY_HEADER: p.BODY_HASHES_U64LE}, "needs the Kvmesh-Route header"),
            (b"\x00" * 8, {p.BODY_HEADER: "protobuf"}, "unknown Kvmesh-Body 'protobuf'"),
        ]
        for body, headers, message in cases:
            msg = await nc.request(pipe.route_subject, body, timeout=3, headers=headers)
            assert msg.headers is not None
            assert msg.headers["Nats-Service-Error-Code"] == "400"
            err = p.decode(msg.data, p.ErrorReply)
            assert err.error.code == "bad_request"
            assert message in err.error.message, err.error.message
        assert pipe.router_service is not None
        assert pipe.router_service.endpoint.errors == {"bad_request": len(cases)}
        reply = await pipe.route(PROMPT)
        assert (reply.worker_id, reply.cached_tokens) == ("w1", 96)
        assert pipe.router is not None
        by_hash = await pipe.router.route_by_hash("test-model", HASHES[:4], prompt_tokens=70)
        assert (by_hash.worker_id, by_hash.overlap_blocks, by_hash.cached_tokens) == ("w1", 4, 64)


async def test_pre_hashed_requests_need_a_local_index(nats_url: str, uid: str) -> None:
    """A router that asks the indexers refuses pre-hashed requests with bad_request; packed tokens work."""
    async with fleet(nats_url, uid, index="remote") as pipe:
        assert pipe.router is not None
        with pytest.raises(BadRequestError, match="need a router with a local index"):
            await pipe.router.route_by_hash("test-model", HASHES)
        reply = await pipe.router.route("test-model", PROMPT)
        assert (reply.worker_id, reply.cached_tokens) == ("w1", 96)


async def test_the_router_announces_its_forms(nats_url: str, uid: str) -> None:
    """$SRV.INFO of the router lists the forms it reads in its metadata."""
    async with fleet(nats_url, uid) as pipe:
        msg = await pipe._nc.request("$SRV.INFO.kvmesh-router", b"", timeout=3)
        info = msgspec.json.decode(msg.data)
        assert info["metadata"] == {"route_forms": "json,tokens-u32le,hashes-u64le,seqhashes-u64le"}


class _OldRequest(msgspec.Struct):
    model: str
    token_ids: list[int]


async def test_the_client_falls_back_to_json_for_a_router_that_reads_only_json(
    nats_url: str, uid: str
) -> None:
    """A router older than the forms answers a packed body as kvmesh 0.1 did ("not valid JSON"): the client
    resends as JSON, keeps to JSON, and explains a pre-hashed request it cannot serve."""
    nc = await connect(nats_url, name="test-old-router")
    subject = f"t{uid}.old-route"
    seen: list[dict[str, str] | None] = []
    ok = p.RouteReply(
        request_id=None,
        worker_id="w-old",
        dp_rank=0,
        overlap_blocks=0,
        cached_tokens=0,
        block_size=16,
        index_seq=1,
        mode="exact",
    )

    async def old_router(msg: Any) -> None:  # parse_route_request before the forms, and its error replies
        seen.append(msg.headers)
        try:
            req = msgspec.json.decode(msg.data, type=_OldRequest)
        except msgspec.ValidationError as exc:
            text = f"invalid request: {exc}"
        except msgspec.DecodeError as exc:
            text = f"request body is not valid JSON: {exc}"
        else:
            await msg.respond(p.encode(msgspec.structs.replace(ok, overlap_blocks=len(req.token_ids))))
            return
        await msg.respond(p.encode(p.error_reply("bad_request", text)))

    try:
        await nc.subscribe(subject, cb=old_router)
        await nc.flush()
        router = Router(nc, subject=subject, timeout_s=3.0)
        reply = await router.route("m", PROMPT)
        assert (reply.worker_id, reply.overlap_blocks) == ("w-old", 160)
        assert router.fallbacks == 1
        assert [h is not None and h[p.BODY_HEADER] for h in seen] == [p.BODY_TOKENS_U32LE, False]
        seen.clear()
        again = await router.route("m", PROMPT)
        assert again.overlap_blocks == 160
        assert seen == [None]  # JSON straight away for JSON_RETRY_S
        assert JSON_RETRY_S == 60.0
        with pytest.raises(BadRequestError, match="does not read pre-hashed requests"):
            await router.route_by_hash("m", HASHES)
        router._json_until = 0.0  # the retry window is over: the packed form is tried again
        seen.clear()
        assert (await router.route("m", PROMPT)).overlap_blocks == 160
        assert [h is not None and h[p.BODY_HEADER] for h in seen] == [p.BODY_TOKENS_U32LE, False]
        assert router.fallbacks == 2
    finally:
        await nc.close()
