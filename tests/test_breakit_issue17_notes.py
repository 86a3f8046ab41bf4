"""Hostile and oversized route notes on a real nats-server: a note that no router would send (a session id
past 256 characters, a negative rank, keys outside [0, 2⁶⁴)) is dropped and counted, predicted entries are
kept only for (worker, rank) pairs the registry lists, and a replica's start-up sync fits the server's
``max_payload`` however many sessions its peer knows."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from tests.test_router import HOT, answer, fleet, until
from tests.test_router_predicted import start

from kvmesh.core.index import Holder
from kvmesh.core.protocol import MatchHolder, WorkerRecord
from kvmesh.runtime.registry import RegistrySettings, heartbeat, open_registry

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

BS = 16


async def publish(nc: Any, subject: str, body: dict[str, Any]) -> None:
    await nc.publish(subject, json.dumps(body).encode())


async def test_notes_no_router_sends_are_dropped_and_counted(nats_url: str, uid: str) -> None:
    async with fleet(nats_url, uid) as f:
        r0 = await f.start_router(predicted_ttl_s=30.0)
        noted, routed = f"t{uid}.requests.noted", f"t{uid}.requests.routed"
        bad_notes: list[dict[str, Any]] = [
            {"worker_id": "a", "dp_rank": 0, "session_id": "x" * 500_000},
            {"worker_id": "a", "dp_rank": 0, "session_id": "s" * 257},
            {"worker_id": "a", "dp_rank": 0, "session_id": ""},
            {"worker_id": "a", "dp_rank": -1, "session_id": "neg"},
            {"worker_id": "a", "dp_rank": 0, "block_keys": [1, -1]},
            {"worker_id": "a", "dp_rank": 0, "block_keys": [2**64]},
            {"worker_id": "a", "dp_rank": 0, "block_keys": [3, 2**70]},
        ]
        for body in bad_notes:
            await publish(f.nc, noted, body)
        base = {"worker_id": "a", "dp_rank": 0, "prefill_tokens": 16, "blocks": 1}
        bad_routed: list[dict[str, Any]] = [
            {"session_id": "y" * 300},
            {"dp_rank": -2},
            {"block_keys": [-5]},
            {"block_keys": [2**64 + 1]},
        ]
        for i, extra in enumerate(bad_routed):
            await publish(f.nc, routed, {**base, "request_id": f"bad-{i}", **extra})
        # the notes a router sends still count
        await publish(
            f.nc, noted, {"worker_id": "a", "dp_rank": 0, "session_id": "s" * 256, "block_keys": [7]}
        )
        await publish(
            f.nc, routed, {**base, "request_id": "ok", "session_id": "u", "block_keys": [0, 2**64 - 1]}
        )
        await until(lambda: r0.ledger.stats().active == 1 and len(r0.notes.sessions) == 2)
        await asyncio.sleep(0.2)
        assert r0.notes.undecodable == 11
        assert {sid for sid, _h, _i in r0.notes.sessions.entries(r0.notes._clock())} == {"s" * 256, "u"}
        ttl = r0.notes.predictions.ttl
        assert ttl is not None and len(ttl) == 3
        assert r0.ledger.stats().active == 1
        # and the replica still answers
        assert (await f.client(0).route("m", HOT, session_id="later")).session == "new"


async def test_start_up_sync_fits_max_payload_with_many_sessions(nats_url: str, uid: str) -> None:
    """20,000 sessions of 100-character ids are ~2.4 MB of snapshot, over the server's 1 MiB: the peer sends
    the most recently seen ones that fit (and every in-flight request) instead of nothing."""
    async with fleet(nats_url, uid) as f:
        f.answer = lambda q: answer([MatchHolder("a", 0, 0, 0)])
        r0 = await f.start_router()
        for i in range(3):
            await f.client(0).route("m", HOT, request_id=f"r-{i}")
        now = r0.notes._clock()
        for i in range(20_000):
            r0.notes.sessions.note(f"{i:0100d}", Holder("a", 0), now)
        r1 = await f.start_router()
        assert r1.synced_requests == 3
        assert 5_000 < r1.notes.synced_sessions < 20_000
        got = {sid for sid, _h, _i in r1.notes.sessions.entries(r1.notes._clock())}
        assert f"{19_999:0100d}" in got and f"{0:0100d}" not in got


async def test_predicted_entries_only_for_registered_ranks(nats_url: str, uid: str) -> None:
    """Notes naming ranks the registry does not list (a rank past an event-less worker's ``dp_ranks``, a
    worker nobody registered) keep nothing, so a flood of them cannot grow a replica's memory; a worker's
    predicted entries stay within its ``kv_capacity_blocks``."""
    async with fleet(nats_url, uid) as f:
        bucket = f"T{uid}_WORKERS"
        kv = await open_registry(f.nc.jetstream(), RegistrySettings(bucket=bucket, ttl_s=30.0, memory=True))
        for w, events in (("x", False), ("e", True)):
            await heartbeat(
                kv,
                WorkerRecord(
                    worker_id=w, model="m", dp_ranks=2, block_size=BS, incarnation=0, kv_capacity_blocks=8,
                    kv_events=events,
                ),
            )  # fmt: skip
        r0 = await start(f, use_registry=True, registry_bucket=bucket, predicted_ttl_s=30.0)
        await until(lambda: r0.endpoint.ranks("m") is not None)
        noted = f"t{uid}.requests.noted"
        for rank in range(50):
            for w in ("x", "e", "ghost"):
                keys = list(range(rank * 100, rank * 100 + 20))
                await publish(f.nc, noted, {"worker_id": w, "dp_rank": rank, "block_keys": keys})
        await publish(f.nc, noted, {"worker_id": "x", "dp_rank": 1, "session_id": "done"})
        await until(lambda: len(r0.notes.sessions) == 1)
        approx, ttl = r0.notes.predictions.approx, r0.notes.predictions.ttl
        assert ttl is not None
        assert sorted(approx.holders()) == [Holder("x", 0), Holder("x", 1)]
        assert sorted(ttl.holders()) == [Holder("e", 0), Holder("e", 1)]
        assert (len(approx), len(ttl)) == (16, 16)


async def test_a_sync_answer_with_sessions_no_router_keeps_is_filtered(nats_url: str, uid: str) -> None:
    """A peer's snapshot passes the same checks as the notes: a session id past 256 characters or a negative
    rank is not restored."""
    from kvmesh.core.protocol import LedgerSnapshot, SessionEntry, encode

    async with fleet(nats_url, uid) as f:
        snap = LedgerSnapshot(
            entries=[],
            sessions=[
                SessionEntry(session_id="x" * 100_000, worker_id="a", dp_rank=0, idle_s=1.0),
                SessionEntry(session_id="neg", worker_id="a", dp_rank=-4, idle_s=1.0),
                SessionEntry(session_id="", worker_id="a", dp_rank=0, idle_s=1.0),
                SessionEntry(session_id="ok", worker_id="a", dp_rank=1, idle_s=1.0),
            ],
        )

        async def on_sync(msg: Any) -> None:
            await msg.respond(encode(snap, format="msgpack"))

        await f.nc.subscribe(f"t{uid}.requests.sync", cb=on_sync)
        r0 = await f.start_router()
        assert r0.notes.synced_sessions == 1
        assert [(sid, h) for sid, h, _i in r0.notes.sessions.entries(r0.notes._clock())] == [
            ("ok", Holder("a", 1))
        ]
