"""The RFC #1403 indexer API (``kvmesh http``, a router's ``--http-port``) through a real HTTP server on a real
pipeline: real nats-server, real ZMQ publishers, the real ingests, indexer and router; `/register` runs a real
``kvmesh ingest`` child. Every field of every reply is checked: tiers, DP ranks, cache_salt, LoRA, tenants, an
unknown model, malformed bodies; and `/query`, `/query_by_hash` (hashes computed here with xxhash) and
``kvmesh.route`` agree exactly on the same prompts."""

from __future__ import annotations

import asyncio
import json
import random
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import xxhash
from tests.pipeline import Pipeline, eventually
from tests.test_ingest_faults import clean_pipeline, stored

from kvmesh.core.endpoints import offset_endpoint
from kvmesh.harness.ports import free_block
from kvmesh.router.config import RouterSettings
from kvmesh.router.service import RouterService
from kvmesh.runtime.nats import connect
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

BS = 16
MODEL = "test-model"
PROMPT = list(range(3000, 3000 + 8 * BS))  # 8 blocks
LORA_PROMPT = list(range(6000, 6000 + 3 * BS))
ANY = "tcp://127.0.0.1:*"


def std_local(tokens: list[int], bs: int = BS) -> list[int]:
    """Dynamo's LocalBlockHash of each full block: XXH3-64 of the tokens as LE uint32, seed 1337."""
    return [
        xxhash.xxh3_64_intdigest(struct.pack(f"<{bs}I", *tokens[i : i + bs]), seed=1337)
        for i in range(0, len(tokens) - bs + 1, bs)
    ]


def std_seq(local: list[int]) -> list[int]:
    """The rolling sequence hashes: seq[0] = local[0], seq[i] = XXH3-64(le64(seq[i-1]) ‖ le64(local[i]))."""
    out: list[int] = []
    for h in local:
        out.append(h if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], h), seed=1337))
    return out


async def http(
    port: int, method: str, path: str, body: Any = None, *, raw: bytes | None = None
) -> tuple[int, dict[str, str], Any]:
    """One HTTP/1.1 request on a fresh connection; (status, headers, decoded JSON body or text)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
    writer.write(
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    reply = await reader.read()
    writer.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    assert int(headers["content-length"]) == len(payload)
    text = payload.decode()
    ctype = headers["content-type"]
    return int(lines[0].split(" ")[1]), headers, json.loads(text) if ctype == "application/json" else text


async def start_http_router(pipe: Pipeline) -> RouterService:
    svc = RouterService(
        RouterSettings(
            nats_url=pipe.nats_url,
            route_subject=pipe.route_subject,
            match_subject=pipe.match_subject,
            stream=pipe.stream,
            events_prefix=pipe.prefix,
            http_port=0,
        )
    )
    pipe.router_service = svc
    pipe.tasks.append(asyncio.create_task(svc.run()))
    await asyncio.wait_for(svc.ready.wait(), 10)
    from kvmesh.client import Router

    pipe._nc = await connect(pipe.nats_url, name="test-client")
    pipe.router = Router(pipe._nc, subject=pipe.route_subject, timeout_s=3.0)
    return svc


@asynccontextmanager
async def fleet(nats_url: str, uid: str) -> AsyncIterator[tuple[Pipeline, int, list[EventPublisher]]]:
    """w1 (2 DP ranks): rank 0 holds PROMPT's blocks 0-3 on GPU and 4-5 on CPU, rank 1 blocks 0-1; w2 holds
    blocks 0-1 on GPU and 2 on DISK; w3 holds LORA_PROMPT's 3 blocks under adapter "ad" and salt "t-a"."""
    base = free_block(2)
    events = f"tcp://127.0.0.1:{base}"
    w1 = [EventPublisher(offset_endpoint(events, r), dp_rank=r) for r in range(2)]
    w2, w3 = EventPublisher(ANY), EventPublisher(ANY)
    pubs = [*w1, w2, w3]
    try:
        async with clean_pipeline(nats_url, uid) as pipe:
            await pipe.start_ingest("w1", events, block_size=BS, data_parallel_size=2)
            await pipe.start_ingest("w2", w2.endpoint, block_size=BS)
            await pipe.start_ingest("w3", w3.endpoint, block_size=BS)
            for pub in pubs:
                await pub.wait_for_subscribers(1)
            await pipe.start_indexer()
            svc = await start_http_router(pipe)
            assert svc.http_port is not None
            w1[0].publish([stored(range(10, 14), PROMPT[: 4 * BS], block_size=BS)])
            w1[0].publish([stored(range(14, 16), PROMPT[4 * BS : 6 * BS], 13, block_size=BS, medium="CPU")])
            w1[1].publish([stored(range(20, 22), PROMPT[: 2 * BS], block_size=BS)])
            w2.publish([stored(range(30, 32), PROMPT[: 2 * BS], block_size=BS)])
            w2.publish([stored([32], PROMPT[2 * BS : 3 * BS], 31, block_size=BS, medium="DISK")])
            w3.publish(
                [
                    stored(
                        range(40, 43),
                        LORA_PROMPT,
                        block_size=BS,
                        lora_name="ad",
                        extra_keys=(("ad", "t-a"), ("ad",), ("ad",)),
                    )
                ]
            )

            async def settled() -> Any:
                return (await http(svc.http_port or 0, "POST", "/query", query(PROMPT)))[2]

            await eventually(settled, lambda r: r["default"]["w1"]["longest_matched"] == 96)
            await eventually(
                lambda: pipe.route(LORA_PROMPT, lora_name="ad", cache_salt="t-a"),
                lambda r: r.cached_tokens == 3 * BS,
            )
            yield pipe, svc.http_port, pubs
    finally:
        for pub in pubs:
            pub.close()


def query(tokens: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "block_size": BS, "token_ids": tokens, **kw}


def by_hash(tokens: list[int], **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "block_size": BS, "seq_hashes": std_seq(std_local(tokens)), **kw}


W1 = {"longest_matched": 96, "GPU": 64, "CPU": 96, "DISK": 96, "DP": {"0": 96, "1": 32}}
W2 = {"longest_matched": 48, "GPU": 32, "CPU": 32, "DISK": 48, "DP": {"0": 48}}
W3_NONE = {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {"0": 0}}


async def test_query_and_query_by_hash_answer_every_field(nats_url: str, uid: str) -> None:
    """/query and /query_by_hash give tenant → instance → longest_matched, cumulative GPU/CPU/DISK and per-rank
    DP tokens for every instance of the tenant; instance_id narrows; LoRA and cache_salt isolate; an unknown
    model is 404; /health, /workers, /dump and /metrics answer."""
    async with fleet(nats_url, uid) as (_pipe, port, _pubs):
        want = {"default": {"w1": W1, "w2": W2, "w3": W3_NONE}}
        assert await http(port, "POST", "/query", query(PROMPT)) == (
            200,
            {
                "content-type": "application/json",
                "content-length": str(len(json.dumps(want, separators=(",", ":")))),
                "connection": "close",
            },
            want,
        )
        assert (await http(port, "POST", "/query_by_hash", by_hash(PROMPT)))[::2] == (200, want)
        assert (
            await http(
                port,
                "POST",
                "/query_by_hash",
                {**by_hash(PROMPT), "block_hash": by_hash(PROMPT)["seq_hashes"], "seq_hashes": None},
            )
        )[::2] == (200, want)
        one = await http(port, "POST", "/query", query(PROMPT, instance_id="w2", tenant_id="default"))
        assert one[::2] == (200, {"default": {"w2": W2}})
        assert (await http(port, "POST", "/query", query(PROMPT, tenant_id="acme")))[::2] == (
            200,
            {"acme": {}},
        )
        assert (await http(port, "POST", "/query", query(PROMPT[: 2 * BS + 5])))[2]["default"]["w1"] == {
            "longest_matched": 32, "GPU": 32, "CPU": 32, "DISK": 32, "DP": {"0": 32, "1": 32},
        }  # fmt: skip
        # another block size: no instance of that size
        assert (await http(port, "POST", "/query", {**query(PROMPT), "block_size": 32}))[::2] == (
            200,
            {"default": {}},
        )
        # LoRA and cache salt: only w3 holds the adapter's salted blocks
        w3 = {"longest_matched": 48, "GPU": 48, "CPU": 48, "DISK": 48, "DP": {"0": 48}}
        lora = await http(port, "POST", "/query", query(LORA_PROMPT, lora_name="ad", cache_salt="t-a"))
        assert lora[2]["default"]["w3"] == w3
        assert lora[2]["default"]["w1"]["longest_matched"] == 0
        # the adapter's seed and the salt's tag are kvmesh's isolation rules (core/hashing.py)
        from kvmesh.core.hashing import local_block_hashes

        lora_seq = std_seq(local_block_hashes(LORA_PROMPT, BS, lora_name="ad", cache_salt="t-a"))
        lora_hash = await http(
            port, "POST", "/query_by_hash", {"model": MODEL, "block_size": BS, "seq_hashes": lora_seq}
        )
        assert lora_hash[2]["default"]["w3"] == w3
        no_salt = await http(port, "POST", "/query", query(LORA_PROMPT, lora_name="ad"))
        assert no_salt[2]["default"]["w3"]["longest_matched"] == 0
        no_lora = await http(port, "POST", "/query", query(LORA_PROMPT, cache_salt="t-a"))
        assert no_lora[2]["default"]["w3"]["longest_matched"] == 0
        # unknown model
        assert (await http(port, "POST", "/query", {**query(PROMPT), "model": "nope"}))[::2] == (
            404,
            {"error": "no indexer for model=nope"},
        )
        # health, workers, dump, metrics
        status, _, health = await http(port, "GET", "/health")
        assert status == 200 and health["status"] == "ok" and health["index_seq"] > 0
        status, _, workers = await http(port, "GET", "/workers")
        assert status == 200
        assert workers == [
            {"instance_id": w, "tenant_id": "default", "model_name": MODEL, "block_size": BS, "dp_ranks": r,
             "source": "fleet", "status": "active"}
            for w, r in (("w1", [0, 1]), ("w2", [0]), ("w3", [0]))
        ]  # fmt: skip
        status, _, dump = await http(port, "GET", "/dump")
        seq = std_seq(std_local(PROMPT))
        assert status == 200 and list(dump) == [f"{MODEL}:{BS}"]
        d = dump[f"{MODEL}:{BS}"]
        assert (d["model_name"], d["block_size"]) == (MODEL, BS)
        assert d["instances"]["w1"] == {
            "tenant_id": "default",
            "dp": {"0": {"GPU": sorted(seq[:4]), "CPU": sorted(seq[4:6])}, "1": {"GPU": sorted(seq[:2])}},
        }
        assert d["instances"]["w2"]["dp"] == {"0": {"GPU": sorted(seq[:2]), "DISK": [seq[2]]}}
        status, headers, metrics = await http(port, "GET", "/metrics")
        assert status == 200 and headers["content-type"] == "text/plain; version=0.0.4"
        assert 'kvmesh_router_http_requests_total{endpoint="/query",status="404"} 1' in metrics
        assert "kvmesh_router_http_registrations 0" in metrics


async def test_dynamo_dialect_answers_as_dynamos_indexer(nats_url: str, uid: str) -> None:
    """A body with model_name (Dynamo's standalone indexer's) gets Dynamo's reply: scores per instance and rank,
    frequencies, instances with lower-case cumulative media, holders with a match only; /query_by_hash takes
    Dynamo's local block_hashes (signed i64 too); a missing field is 422."""
    async with fleet(nats_url, uid) as (_pipe, port, _pubs):
        want = {
            "scores": {"w1": {"0": 96, "1": 32}, "w2": {"0": 48}},
            "frequencies": [],
            "instances": {
                "w1": {"longest_matched": 96, "gpu": 64, "dp": {"0": 96, "1": 32}, "cpu": 96, "disk": 96},
                "w2": {"longest_matched": 48, "gpu": 32, "dp": {"0": 48}, "cpu": 32, "disk": 48},
            },
        }
        body = {"token_ids": PROMPT, "model_name": MODEL}
        assert (await http(port, "POST", "/query", body))[::2] == (200, want)
        local = std_local(PROMPT)
        signed = [h - 2**64 if h >= 2**63 else h for h in local]
        assert (await http(port, "POST", "/query_by_hash", {"block_hashes": signed, "model_name": MODEL}))[
            ::2
        ] == (200, want)
        status, _, err = await http(port, "POST", "/query", {"model_name": MODEL})
        assert (status, err) == (422, {"error": "missing field `token_ids`"})
        status, _, err = await http(port, "POST", "/query", {"model_name": MODEL, "token_ids": "x"})
        assert (status, err["error"]) == (
            422,
            "Failed to deserialize the JSON body into the target type: Expected `array | null`, got `str` - at "
            "`$.token_ids`",
        )
        assert (await http(port, "POST", "/query", {"token_ids": PROMPT, "model_name": "nope"}))[::2] == (
            404,
            {"error": "no indexer for model=nope"},
        )


async def test_malformed_requests_get_errors_and_the_server_keeps_serving(nats_url: str, uid: str) -> None:
    """Bad JSON, mistyped and missing fields, hashes out of range, wrong paths and methods each get their
    status and a JSON error; then a query succeeds on the same server."""
    async with fleet(nats_url, uid) as (_pipe, port, _pubs):
        cases: list[tuple[str, str, Any, bytes | None, int, str]] = [
            ("POST", "/query", None, b"{bad", 400, "Failed to parse the request body as JSON: "),
            ("POST", "/query", None, b"[1, 2]", 400, "Failed to deserialize the JSON body into the target type: Expected `object`"),
            ("POST", "/query", {"model": MODEL, "token_ids": [1]}, None, 400, "missing field `block_size`"),
            ("POST", "/query", {"block_size": BS, "token_ids": [1]}, None, 400, "missing field `model` (or `model_name`)"),
            ("POST", "/query", {**query([1]), "block_size": 0}, None, 400, "block_size must be greater than zero, got 0"),
            ("POST", "/query", {**query([-1])}, None, 400, "token ids must be integers in [0, 2^32)"),
            ("POST", "/query", {**query([1]), "lora_id": 3}, None, 400, "lora_id is not supported: send lora_name"),
            ("POST", "/query", {**query([1]), "seq_hashes": [1]}, None, 400, "/query takes token_ids, not hashes (use /query_by_hash)"),
            ("POST", "/query_by_hash", {"model": MODEL, "block_size": BS}, None, 400, "missing field `seq_hashes`"),
            ("POST", "/query_by_hash", {"model": MODEL, "block_size": BS, "seq_hashes": [1, -1]}, None, 400, "seq_hashes[1] is not an int in [0, 2^64): -1"),
            ("POST", "/query_by_hash", {"model": MODEL, "block_size": BS, "seq_hashes": [2**64]}, None, 400, "seq_hashes[0] is not an int in [0, 2^64)"),
            ("POST", "/query_by_hash", {"model": MODEL, "block_size": BS, "seq_hashes": [1], "block_hash": [1]}, None, 400, "send one of seq_hashes, block_hash, not more"),
            ("GET", "/query", None, None, 405, "/query takes POST, not GET"),
            ("POST", "/health", None, None, 405, "/health takes GET, not POST"),
            ("GET", "/nope", None, None, 404, "no such endpoint: /nope"),
            ("POST", "/register", {"type": "vLLM"}, None, 400, "endpoint is required"),
            ("POST", "/register", {"endpoint": "tcp://127.0.0.1:9", "type": "TGI", "modelname": "m", "instance_id": "i", "block_size": 16, "dp_rank": 0}, None, 400, "unsupported publisher type 'TGI'"),
            ("POST", "/register", {"endpoint": "ipc:///x", "type": "vLLM", "modelname": "m", "instance_id": "i", "block_size": 16, "dp_rank": 0}, None, 400, "endpoint must be a ZMQ tcp://host:port endpoint"),
            ("POST", "/register", {"endpoint": "tcp://h:5557", "type": "vLLM", "modelname": "m", "instance_id": "i", "block_size": 16, "dp_rank": 0, "additionalsalt": "w8a8"}, None, 400, "additionalsalt is not supported"),
            ("POST", "/unregister", {"instance_id": "nobody", "dp_rank": 0}, None, 404, "service not found: nobody|default|0"),
        ]  # fmt: skip
        for method, path, body, raw, status, message in cases:
            got, headers, err = await http(port, method, path, body, raw=raw)
            assert (got, headers["content-type"]) == (status, "application/json"), (path, body, err)
            assert list(err) == ["error"] and err["error"].startswith(message), (path, body, err)
        # a keep-alive connection: two requests, one after the other, then a malformed request line
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = json.dumps(query(PROMPT)).encode()
        request = f"POST /query HTTP/1.1\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload
        writer.write(request + request + b"NONSENSE\r\n\r\n")
        await writer.drain()
        replies = (await reader.read()).split(b"HTTP/1.1 ")
        writer.close()
        assert [r.split(b" ", 1)[0] for r in replies[1:]] == [b"200", b"200", b"400"]
        assert (await http(port, "POST", "/query", query(PROMPT)))[2]["default"]["w1"] == W1


async def test_register_runs_an_ingest_for_the_publisher_under_its_tenant(nats_url: str, uid: str) -> None:
    """/register (the RFC's example body, adapted) starts an ingest for the endpoint: the publisher's blocks are
    answered under its tenant and not under "default"; /workers lists it; a repeat succeeds; /unregister stops
    it and names the key."""
    async with fleet(nats_url, uid) as (pipe, port, _pubs):
        base = free_block(2)
        pub = EventPublisher(f"tcp://127.0.0.1:{base + 1}", dp_rank=1)
        try:
            reg = {
                "endpoint": f"tcp://127.0.0.1:{base + 1}", "type": "vLLM", "modelname": MODEL,
                "lora_name": None, "tenant_id": "acme", "instance_id": "vllm-prefill-node1", "block_size": BS,
                "dp_rank": 1, "additionalsalt": "",
            }  # fmt: skip
            ok = {"status": "registered successfully", "instance_id": "vllm-prefill-node1"}
            assert (await http(port, "POST", "/register", reg))[::2] == (200, ok)
            assert (await http(port, "POST", "/register", reg))[::2] == (200, ok)
            await pub.wait_for_subscribers(1, timeout_s=30)
            pub.publish([stored(range(50, 55), PROMPT[: 5 * BS], block_size=BS)])
            acme = {"longest_matched": 80, "GPU": 80, "CPU": 80, "DISK": 80, "DP": {"1": 80}}

            async def ask() -> Any:
                return (await http(port, "POST", "/query", query(PROMPT, tenant_id="acme")))[2]

            assert await eventually(ask, lambda r: r == {"acme": {"vllm-prefill-node1": acme}}, timeout_s=30)
            default = (await http(port, "POST", "/query", query(PROMPT)))[2]["default"]
            assert sorted(default) == ["w1", "w2", "w3"]
            route = await pipe.route(PROMPT, explain=True)
            assert route.scores is not None
            assert ("vllm-prefill-node1", 1, 5) in [
                (s.worker_id, s.dp_rank, s.overlap_blocks) for s in route.scores
            ]
            workers = (await http(port, "GET", "/workers"))[2]
            assert workers[0] == {
                "instance_id": "vllm-prefill-node1", "tenant_id": "acme", "dp_rank": 1, "model_name": MODEL,
                "block_size": BS, "type": "vLLM", "endpoint": reg["endpoint"], "replay_endpoint": None,
                "source": "register", "status": "active",
            }  # fmt: skip
            assert [w["instance_id"] for w in workers[1:]] == ["w1", "w2", "w3"]
            metrics = (await http(port, "GET", "/metrics"))[2]
            assert "kvmesh_router_http_registrations 1" in metrics
            gone = await http(port, "POST", "/unregister", {**reg, "endpoint": None})
            assert gone[::2] == (
                200,
                {"status": "unregistered successfully", "removed_instances": ["vllm-prefill-node1|acme|1"]},
            )
            assert (await http(port, "GET", "/workers"))[2][0]["instance_id"] == "w1"
        finally:
            pub.close()


async def test_query_query_by_hash_and_route_agree_on_random_prompts(nats_url: str, uid: str) -> None:
    """On 40 prompts sharing prefixes with the fleet's caches, every (instance, rank)'s matched tokens from
    /query, from /query_by_hash (sequence hashes computed here with xxhash) and from an explained kvmesh.route
    are equal."""
    async with fleet(nats_url, uid) as (pipe, port, _pubs):
        rng = random.Random(7)
        prompts = []
        for _ in range(40):
            cut = rng.randrange(0, 8 * BS + 1)
            prompts.append(PROMPT[:cut] + [rng.randrange(100_000) for _ in range(rng.randrange(0, 3 * BS))])
        prompts = [p for p in prompts if len(p) >= BS]
        assert len(prompts) >= 30
        for p in prompts:
            q = (await http(port, "POST", "/query", query(p)))[2]["default"]
            h = (await http(port, "POST", "/query_by_hash", by_hash(p)))[2]["default"]
            reply = await pipe.route(p, explain=True)
            assert reply.scores is not None
            routed = {(s.worker_id, str(s.dp_rank)): s.overlap_blocks * BS for s in reply.scores}
            from_query = {(w, r): n for w, e in q.items() for r, n in e["DP"].items()}
            assert q == h
            assert from_query == routed
