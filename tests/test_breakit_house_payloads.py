"""Hostile payloads on every subject the services read, against the real services on a real nats-server.

Each bad body must get a clear error reply where the subject has replies (``bad_request`` for the route and
match APIs), be dropped elsewhere, never log a traceback, and leave the service serving the next good request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import msgspec
import pytest
from tests.pipeline import Pipeline, eventually
from tests.test_ingest_faults import BS, T, clean_pipeline, expect, stored

from kvmesh.core.protocol import ErrorReply, MatchReply, MatchRequest, RouteReply, SnapshotResult, decode
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

MODEL = "test-model"
DEEP_JSON = b"[" * 200_000 + b"]" * 200_000
DEEP_MSGPACK = b"\x91" * 200_000 + b"\x00"

BAD_ROUTES: list[bytes] = [
    b"",
    b"not json",
    b"\xff\xfe\x00",
    b"null",
    b"[1, 2]",
    b'"a string"',
    DEEP_JSON,
    b'{"model": ' * 50_000 + b"1" + b"}" * 50_000,
    b'{"model": 5, "token_ids": "x"}',
    b'{"model": "test-model"}',
    b'{"model": "test-model", "token_ids": [1, -1]}',
    b'{"model": "test-model", "token_ids": [1, 4294967296]}',
    b'{"model": "test-model", "token_ids": [1.5]}',
    b'{"version": 2, "model": "test-model", "token_ids": [1, 2, 3]}',
    b'{"version": "x", "model": "test-model", "token_ids": [1, 2, 3]}',
    b'{"model": "test-model", "token_ids": [1], "policy": {"nope": 1}}',
    b'{"model": "test-model", "token_ids": [1], "candidates": "w"}',
]

BAD_MATCHES: list[bytes] = [
    b"",
    b"\xc1",
    b'{"model": "test-model", "token_ids": [1, 2, 3]}',
    DEEP_MSGPACK,
    msgspec.msgpack.encode({"model": MODEL, "token_ids": b"\x01\x02\x03"}),
    msgspec.msgpack.encode({"model": MODEL, "token_ids": b"\x01\x02\x03\x04\x05"}),
    msgspec.msgpack.encode({"model": MODEL, "token_ids": [1, -1]}),
    msgspec.msgpack.encode({"model": MODEL, "token_ids": [1, 2**40]}),
    msgspec.msgpack.encode({"model": MODEL, "token_ids": [1.5]}),
    msgspec.msgpack.encode({"model": MODEL, "token_ids": "x"}),
    msgspec.msgpack.encode({"version": 2, "model": MODEL, "token_ids": [1, 2, 3]}),
    msgspec.msgpack.encode({"version": "x", "model": MODEL, "token_ids": [1, 2, 3]}),
    msgspec.msgpack.encode([MODEL, [1, 2, 3]]),
]

GARBAGE_NOTES: list[bytes] = [
    b"",
    b"not json",
    DEEP_JSON,
    b'{"request_id": 5}',
    b'{"version": 2, "request_id": "r"}',
    b'{"version": "x", "request_id": "r"}',
    b'{"request_id": "r", "worker_id": "w", "dp_rank": "0", "prefill_tokens": 1, "blocks": 1}',
    b'{"request_id": "r", "worker_id": "w", "dp_rank": 0, "prefill_tokens": -5, "blocks": -5}',
    b'{"worker_id": "w", "kv_usage": "full"}',
    b'{"worker_id": "w", "dp_rank": -1, "kv_usage": 1e999, "waiting": -3}',
]


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    """kvmesh log records that carry a traceback (bad input must never log one)."""
    return [r.getMessage() for r in caplog.records if r.exc_info and r.name.startswith("kvmesh")]


async def good_route(nc: Any, p: Pipeline) -> RouteReply:
    """A valid route request, sent raw; its decoded reply."""
    body = json.dumps({"model": MODEL, "token_ids": T, "explain": True}).encode()
    msg = await nc.request(p.route_subject, body, timeout=5)
    return decode(msg.data, RouteReply)


async def good_match(nc: Any, p: Pipeline) -> MatchReply:
    """A valid match request (packed token ids), sent raw; its decoded reply."""
    body = msgspec.msgpack.encode(
        MatchRequest(model=MODEL, token_ids=b"".join(t.to_bytes(4, "little") for t in T))
    )
    msg = await nc.request(p.match_subject, body, timeout=5)
    return decode(msg.data, MatchReply, format="msgpack")


async def test_every_bad_route_request_gets_bad_request_and_the_router_keeps_serving(
    nats_url: str, uid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each hostile route body is answered with a ``bad_request`` error reply (service error code 400), with
    no traceback logged, and a good request after it is routed with its exact overlap."""
    caplog.set_level(logging.INFO)
    pub = EventPublisher("tcp://127.0.0.1:*", None)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await p.start_ingest("w", pub.endpoint, None, block_size=BS)
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            pub.publish([stored([1, 2, 3, 4], T)])
            await expect(p, [T], [{"w/0": 4}])
            nc = await connect(nats_url, name="test-hostile")
            try:
                for body in BAD_ROUTES:
                    msg = await nc.request(p.route_subject, body, timeout=5)
                    err = decode(msg.data, ErrorReply)
                    assert (err.error.code, (msg.headers or {}).get("Nats-Service-Error-Code")) == (
                        "bad_request",
                        "400",
                    ), (body[:80], err)
                    reply = await good_route(nc, p)
                    assert [(h.worker_id, h.dp_rank, h.overlap_blocks) for h in reply.scores or []] == [
                        ("w", 0, 4)
                    ], body[:80]
                # A valid request with a field this version does not know is routed (unknown fields are ignored).
                body = json.dumps(
                    {"model": MODEL, "token_ids": T, "explain": True, "future_field": [1]}
                ).encode()
                reply = decode((await nc.request(p.route_subject, body, timeout=5)).data, RouteReply)
                assert (reply.worker_id, reply.dp_rank) == ("w", 0)
            finally:
                await nc.close()
            assert tracebacks(caplog) == []
    finally:
        pub.close()


async def test_every_bad_match_request_gets_bad_request_and_the_indexer_keeps_serving(
    nats_url: str, uid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each hostile match body (msgpack garbage, JSON, packed token ids of odd length, nested too deep, bad
    versions) is answered with a ``bad_request`` error reply, no traceback is logged, and a good match after
    it answers the holder's exact overlap."""
    caplog.set_level(logging.INFO)
    pub = EventPublisher("tcp://127.0.0.1:*", None)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await p.start_ingest("w", pub.endpoint, None, block_size=BS)
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            pub.publish([stored([1, 2, 3, 4], T)])
            await expect(p, [T], [{"w/0": 4}])
            nc = await connect(nats_url, name="test-hostile")
            try:
                for body in BAD_MATCHES:
                    msg = await nc.request(p.match_subject, body, timeout=5)
                    err = decode(msg.data, ErrorReply, format="msgpack")
                    assert (err.error.code, (msg.headers or {}).get("Nats-Service-Error-Code")) == (
                        "bad_request",
                        "400",
                    ), (body[:80], err)
                    reply = await good_match(nc, p)
                    assert [(h.worker_id, h.dp_rank, h.overlap_blocks) for h in reply.candidates] == [
                        ("w", 0, 4)
                    ], body[:80]
            finally:
                await nc.close()
            assert tracebacks(caplog) == []
    finally:
        pub.close()


async def test_garbage_notes_loads_status_snapshot_and_registry_values_leave_every_service_serving(
    nats_url: str, uid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Garbage lifecycle notes, load reports, status and snapshot requests (an unreadable snapshot request asks
    every group, so a snapshot is written), and undecodable or later-version registry values are dropped
    without a traceback; the router still routes with the exact overlap, counts
    no request in flight from them, and the indexer still answers its status."""
    caplog.set_level(logging.INFO)
    pub = EventPublisher("tcp://127.0.0.1:*", None)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await p.start_ingest("w", pub.endpoint, None, block_size=BS)
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            pub.publish([stored([1, 2, 3, 4], T)])
            await expect(p, [T], [{"w/0": 4}])
            nc = await connect(nats_url, name="test-hostile")
            try:
                prefix = subjects.REQUESTS_PREFIX
                for body in GARBAGE_NOTES:
                    for event in ("routed", "prefill_done", "finished"):
                        await nc.publish(f"{prefix}.{event}", body)
                    await nc.publish(f"{subjects.LOAD_PREFIX}.w", body)
                    sync = await nc.request(f"{prefix}.sync", body, timeout=5)
                    assert sync.data  # the ledger snapshot, whatever the body
                    for subject in (subjects.STATUS_SUBJECT, f"{subjects.STATUS_SUBJECT}.ingest"):
                        status = await nc.request(subject, body, timeout=5)
                        assert json.loads(status.data)
                # An unreadable snapshot request asks every index group: this one's replica answers it.
                for body in (b"not json", DEEP_JSON, b'{"stream": 5}', b'{"version": 2, "stream": "x"}'):
                    answer = decode(
                        (await nc.request(subjects.SNAPSHOT_SUBJECT, body, timeout=10)).data, SnapshotResult
                    )
                    assert (answer.stream, answer.written) == (p.stream, True), (body[:40], answer)
                kv = await nc.jetstream().key_value(subjects.registry_bucket(p.stream))
                await kv.put(subjects.kv_key("junk"), b"\x00garbage")
                await kv.put(subjects.kv_key("deep"), DEEP_JSON)
                later = {"version": 2, "worker_id": "later", "model": MODEL, "dp_ranks": 1, "block_size": BS}
                await kv.put(subjects.kv_key("later"), json.dumps(later).encode())
                strv = {**later, "version": "x", "worker_id": "strv"}
                await kv.put(subjects.kv_key("strv"), json.dumps(strv).encode())
                await nc.flush()
                reply = await good_route(nc, p)
                assert [(h.worker_id, h.dp_rank, h.overlap_blocks) for h in reply.scores or []] == [
                    ("w", 0, 4)
                ]
                assert p.router_service is not None
                # Only the good route above is in flight (no request id: none counted).
                assert p.router_service.ledger.stats().active == 0
                status = json.loads((await nc.request(subjects.STATUS_SUBJECT, b"", timeout=5)).data)
                assert status["applied_seq"] >= 1
            finally:
                await nc.close()
            assert tracebacks(caplog) == []
            assert all(not t.done() for t in p.tasks)
    finally:
        pub.close()


async def test_an_undecodable_prefill_done_or_finished_note_is_logged_and_counted(
    nats_url: str, uid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A prefill_done or finished note that does not decode is logged with its subject and counted (as a
    routed note is), and the router still routes."""
    caplog.set_level(logging.INFO, logger="kvmesh.router")
    async with clean_pipeline(nats_url, uid) as p:
        await p.start_router()
        svc = p.router_service
        assert svc is not None
        nc = await connect(nats_url, name="test-hostile")
        try:
            prefix = subjects.REQUESTS_PREFIX
            for event in ("routed", "prefill_done", "finished"):
                await nc.publish(f"{prefix}.{event}", b'{"request_id": 5}')
            await nc.flush()
            await eventually(lambda: asyncio.sleep(0, svc.notes.undecodable), lambda n: n == 3)
        finally:
            await nc.close()
        warned = sorted(r.getMessage() for r in caplog.records if "undecodable" in r.getMessage())
        assert warned == [
            f"router: undecodable finished note on {prefix}.finished",
            f"router: undecodable prefill_done note on {prefix}.prefill_done",
            f"router: undecodable routed note on {prefix}.routed",
        ]
        assert svc.notes.undecodable == 3
