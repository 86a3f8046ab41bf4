"""The router service against a real nats-server and a stand-in indexer: load, replicas, errors, discovery."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

from kvmesh.client import (
    BadRequestError,
    InternalError,
    NoWorkersError,
    Router,
    UnavailableError,
    UnknownModelError,
)
from kvmesh.core import protocol
from kvmesh.core.load import EngineLoads, LoadLedger
from kvmesh.core.protocol import (
    ErrorReply,
    MatchHolder,
    MatchReply,
    MatchRequest,
    MicroServiceStats,
    PolicyOverride,
    RouteReply,
    RouteRequest,
    RouterStats,
    WorkerLoad,
    error_reply,
)
from kvmesh.router.config import RouterSettings
from kvmesh.router.notes import LifecycleNotes
from kvmesh.router.service import RouterService
from kvmesh.runtime.nats import connect
from kvmesh.runtime.vllm_metrics import MetricsLoadPublisher, publish_load

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

BS = 16
HOT = list(range(80))  # 5 blocks


def answer(candidates: list[MatchHolder], *, prompt_blocks: int = 5) -> MatchReply:
    """A match answer as the indexer sends it."""
    return MatchReply(
        index_seq=7, block_size=BS, prompt_blocks=prompt_blocks, replica="fake", candidates=candidates
    )


HOT_ANSWER = answer([MatchHolder("a", 0, 4, 40), MatchHolder("b", 0, 0, 0)])

IndexerAnswer = MatchReply | ErrorReply | bytes | None
"""What the stand-in indexer answers a match request with: a reply, raw bytes, or None (no answer)."""


class Fleet:
    """Router replicas sharing one stand-in indexer and one set of lifecycle subjects."""

    def __init__(self, nats_url: str, uid: str) -> None:
        self.nats_url = nats_url
        self.uid = uid
        self.routers: list[RouterService] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.answer: Callable[[MatchRequest], IndexerAnswer] = lambda q: HOT_ANSWER
        self.nc: Any = None

    def settings(self, i: int, **kw: Any) -> RouterSettings:
        return RouterSettings(
            nats_url=self.nats_url,
            route_subject=f"t{self.uid}.route.{i}",
            match_subject=f"t{self.uid}.match",
            requests_prefix=f"t{self.uid}.requests",
            load_prefix=f"t{self.uid}.load",
            index=kw.pop("index", "remote"),  # these tests answer match queries themselves
            use_registry=kw.pop("use_registry", False),  # and pass their own registry when they need one
            **kw,
        )

    async def start_router(self, **kw: Any) -> RouterService:
        svc = RouterService(self.settings(len(self.routers), **kw))
        self.routers.append(svc)
        self.tasks.append(asyncio.create_task(svc.run()))
        await asyncio.wait_for(svc.ready.wait(), 10)
        return svc

    async def start_indexer(self) -> None:
        async def on_match(msg: Any) -> None:
            reply = self.answer(protocol.decode(msg.data, MatchRequest, format="msgpack"))
            if reply is None:
                return  # a hung indexer
            await msg.respond(reply if isinstance(reply, bytes) else protocol.encode(reply, format="msgpack"))

        await self.nc.subscribe(f"t{self.uid}.match", cb=on_match)

    def client(self, i: int = 0) -> Router:
        return Router(
            self.nc, subject=f"t{self.uid}.route.{i}", timeout_s=3.0, requests_prefix=f"t{self.uid}.requests"
        )

    async def stop(self) -> None:
        for r in self.routers:
            r.stop()
        for t in self.tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 10)


@contextlib.asynccontextmanager
async def fleet(nats_url: str, uid: str, *, indexer: bool = True) -> AsyncIterator[Fleet]:
    """Yield a `Fleet` with a connected client (and a stand-in indexer); stop everything on exit."""
    f = Fleet(nats_url, uid)
    f.nc = await connect(nats_url, name="test-router")
    try:
        if indexer:
            await f.start_indexer()
        yield f
    finally:
        await f.stop()
        await f.nc.close()


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until ``check()`` is true."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_two_replicas_answer_the_same_request_identically(nats_url: str, uid: str) -> None:
    """Replicas sharing the accounting give byte-identical replies, ties and temperature sampling included."""
    async with fleet(nats_url, uid) as f:
        f.answer = lambda q: answer(
            [MatchHolder(f"w{i}", r, 0, 0) for i in range(4) for r in range(2)], prompt_blocks=1
        )
        r0, r1 = await f.start_router(), await f.start_router()
        winners = set()
        for i in range(24):
            body = RouteRequest(
                model="m",
                token_ids=[i, 1, 2],
                explain=True,
                request_id=f"req-{i}" if i % 2 else None,
                policy=PolicyOverride(temperature=0.7) if i % 3 == 0 else None,
            )
            raw = protocol.encode(body)
            a = await f.nc.request(f"t{uid}.route.0", raw, timeout=3)
            await until(lambda: r0.ledger.stats().active == r1.ledger.stats().active)
            b = await f.nc.request(f"t{uid}.route.1", raw, timeout=3)
            assert a.data == b.data
            winners.add(protocol.decode(a.data, RouteReply).worker_id)
        assert len(winners) >= 3  # ties spread over workers instead of always the lowest id
        assert r0.ledger.stats().active == r1.ledger.stats().active == 12


async def test_hot_prefix_spreads_and_accounting_is_shared(nats_url: str, uid: str) -> None:
    """A hot prefix cached on A alone: requests alternate once A is busier; finish clears both replicas."""
    async with fleet(nats_url, uid) as f:
        # Dynamo's weights (decode 1.0), the worked example of tests/core/test_route_policy.py
        dynamo = {"decode_weight": 1.0}
        r0, r1 = await f.start_router(**dynamo), await f.start_router(**dynamo)
        c0, c1 = f.client(0), f.client(1)
        picks = []
        for i in range(8):
            client = c0 if i % 2 == 0 else c1  # alternate replicas: each must see the other's routes
            reply = await client.route("m", HOT, request_id=f"h{i}")
            picks.append(reply.worker_id)
            await until(lambda: r0.ledger.stats().active == r1.ledger.stats().active == len(picks))
        assert picks == ["a", "b", "a", "a", "b", "a", "b", "a"]
        assert r1.ledger.load("a", 0).blocks == r0.ledger.load("a", 0).blocks == 25
        explained = await c1.route("m", HOT, explain=True)
        assert [(s.worker_id, msgspec.to_builtins(s.load), s.cost) for s in explained.scores or []] == [
            ("a", {"active_prefill_tokens": 80, "active_blocks": 25, "active_requests": 5}, 31.0),
            ("b", {"active_prefill_tokens": 240, "active_blocks": 15, "active_requests": 3}, 35.0),
        ]
        for i in range(8):
            await c0.mark_prefill_done(f"h{i}")
        await until(
            lambda: r1.ledger.load("a", 0).prefill_tokens == 0 == r1.ledger.load("b", 0).prefill_tokens
        )
        for i in range(8):
            await c1.finish(f"h{i}")
        await until(lambda: r0.ledger.stats().active == 0 == r1.ledger.stats().active)
        assert (await c0.route("m", HOT)).worker_id == "a"


async def test_restarted_replica_loses_no_accounting_peers_hold(nats_url: str, uid: str) -> None:
    """A replica started after requests were routed gets them from a peer's snapshot."""
    async with fleet(nats_url, uid) as f:
        r0 = await f.start_router()
        for i in range(3):
            await f.client(0).route("m", HOT, request_id=f"s{i}")
        r1 = await f.start_router()
        assert r1.synced_requests == 3
        assert r1.ledger.load("a", 0) == r0.ledger.load("a", 0)
        assert r1.ledger.load("b", 0) == r0.ledger.load("b", 0)


async def test_unfinished_requests_expire(nats_url: str, uid: str) -> None:
    """A request never finished stops counting after request_ttl_s."""
    async with fleet(nats_url, uid) as f:
        r0 = await f.start_router(request_ttl_s=0.2)
        await f.client(0).route("m", HOT, request_id="x")
        assert r0.ledger.stats().active == 1
        await asyncio.sleep(0.3)
        reply = await f.client(0).route("m", HOT, explain=True)
        assert reply.scores is not None and all(s.load.active_blocks == 0 for s in reply.scores)


METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 12.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.97
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 50.0
"""


async def test_engine_load_scraped_from_a_metrics_endpoint_makes_a_busy(nats_url: str, uid: str) -> None:
    """A stand-in vLLM /metrics shows A 97 % full: the publisher reports it and the router skips A."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = METRICS.encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with fleet(nats_url, uid) as f:
            r0 = await f.start_router()
            pub = MetricsLoadPublisher(
                f.nc, url=f"http://127.0.0.1:{port}/metrics", worker_id="a", model="m", prefix=f"t{uid}.load"
            )
            loads = await pub.scrape_once()
            assert loads == [
                WorkerLoad(
                    worker_id="a", model="m", running=12, waiting=1, kv_usage=0.97, prefix_hit_rate=0.25
                )
            ]
            await until(lambda: len(r0.engine_loads) == 1)
            reply = await f.client(0).route("m", HOT, explain=True)
            assert reply.worker_id == "b"
            a = next(s for s in reply.scores or [] if s.worker_id == "a")
            assert (a.busy, a.load.kv_usage, a.load.running, a.cost) == (
                True,
                0.97,
                12,
                1.0,
            )
            # A free worker again (a fresh report) gets its hot prefix back.
            await publish_load(f.nc, WorkerLoad(worker_id="a", kv_usage=0.1), prefix=f"t{uid}.load")
            await until(
                lambda: (
                    (r0.engine_loads.get("a", 0, time.monotonic()) or WorkerLoad(worker_id="a")).kv_usage
                    == 0.1
                )
            )
            assert (await f.client(0).route("m", HOT)).worker_id == "a"
    finally:
        server.close()
        await server.wait_closed()


async def test_stale_engine_reports_are_ignored(nats_url: str, uid: str) -> None:
    """A busy report older than load_ttl_s no longer keeps A from winning."""
    async with fleet(nats_url, uid) as f:
        r0 = await f.start_router(load_ttl_s=0.2)
        await publish_load(f.nc, WorkerLoad(worker_id="a", waiting=100), prefix=f"t{uid}.load")
        await until(lambda: len(r0.engine_loads) == 1)
        assert (await f.client(0).route("m", HOT)).worker_id == "b"
        await asyncio.sleep(0.3)
        assert (await f.client(0).route("m", HOT)).worker_id == "a"


async def test_no_indexer_is_unavailable_within_the_deadline(nats_url: str, uid: str) -> None:
    """No indexer at all, or one that never answers: `unavailable` within match_timeout_s, never a hang."""
    async with fleet(nats_url, uid, indexer=False) as f:
        await f.start_router(match_timeout_s=0.3)
        start = time.monotonic()
        with pytest.raises(UnavailableError, match="no indexer"):
            await f.client(0).route("m", HOT)
        assert time.monotonic() - start < 0.3
        f.answer = lambda q: None
        await f.start_indexer()
        start = time.monotonic()
        with pytest.raises(UnavailableError, match=r"within 0.3 s"):
            await f.client(0).route("m", HOT)
        assert 0.25 < time.monotonic() - start < 1.0


async def test_every_error_code_has_its_headers_and_exception(nats_url: str, uid: str) -> None:
    """bad_request, unknown_model, no_workers, unavailable and internal: body, headers and client exception."""
    async with fleet(nats_url, uid) as f:

        def indexer(q: MatchRequest) -> IndexerAnswer:
            if q.model == "gone":
                return error_reply("unknown_model", "no worker serves model 'gone'")
            if q.model == "empty":
                return answer([])
            if q.model == "broken":
                return b"\xc1"  # never valid msgpack
            return HOT_ANSWER

        f.answer = indexer
        await f.start_router(max_tokens=100)
        cases = [
            (b'{"model": "m", "token_ids": [1, "x"]}', "bad_request", "400", "token_ids"),
            (
                b'{"model": "m", "token_ids": ' + json.dumps(list(range(101))).encode() + b"}",
                "bad_request",
                "400",
                "limit of 100",
            ),
            (
                b'{"model": "m", "token_ids": [1], "policy": {"temprature": 1}}',
                "bad_request",
                "400",
                "temprature",
            ),
            (b'{"model": "m", "token_ids": [1], "candidates": "a"}', "bad_request", "400", "$.candidates"),
            (b'{"model": "gone", "token_ids": [1]}', "unknown_model", "404", "gone"),
            (b'{"model": "empty", "token_ids": [1]}', "no_workers", "404", "no worker serves model 'empty'"),
            (b'{"model": "m", "token_ids": [1], "candidates": ["zz"]}', "no_workers", "404", "zz"),
            (b'{"model": "broken", "token_ids": [1]}', "internal", "500", ""),
        ]
        for body, code, status, text in cases:
            msg = await f.nc.request(f"t{uid}.route.0", body, timeout=3)
            reply = json.loads(msg.data)
            assert reply["error"]["code"] == code, body
            assert text in reply["error"]["message"], (body, reply)
            assert msg.headers["Nats-Service-Error-Code"] == status
            assert msg.headers["Nats-Service-Error"].startswith(f"{code}: ")
        c = f.client(0)
        for model, exc in (("gone", UnknownModelError), ("empty", NoWorkersError), ("broken", InternalError)):
            with pytest.raises(exc):
                await c.route(model, [1])
        with pytest.raises(BadRequestError):
            await c.route("m", [1], policy={"temperature": -1})
        with pytest.raises(UnavailableError):
            await Router(f.nc, subject=f"t{uid}.nobody", timeout_s=0.2).route("m", [1])


async def micro_stats(nc: Any) -> MicroServiceStats:
    """The kvmesh-router's ``$SRV.STATS`` reply (one router running)."""
    msg = await nc.request("$SRV.STATS.kvmesh-router", b"", timeout=2)
    return protocol.decode(msg.data, MicroServiceStats)


async def test_router_is_a_discoverable_micro_service(nats_url: str, uid: str) -> None:
    """$SRV.PING, $SRV.INFO and $SRV.STATS answer for kvmesh-router, with routed counts in the stats."""
    async with fleet(nats_url, uid) as f:
        await f.start_router()
        await f.client(0).route("m", HOT, request_id="d1")
        ping = json.loads((await f.nc.request("$SRV.PING.kvmesh-router", b"", timeout=2)).data)
        assert ping["name"] == "kvmesh-router"
        info = json.loads((await f.nc.request("$SRV.INFO.kvmesh-router", b"", timeout=2)).data)
        assert [e["subject"] for e in info["endpoints"]] == [f"t{uid}.route.0"]
        stats = await micro_stats(f.nc)
        ep = stats.endpoints[0]
        data = protocol.decode(ep.data, RouterStats)
        assert (ep.num_requests, data.routed, data.in_flight) == (1, 1, 1)
        assert (ep.num_errors, ep.last_error) == (0, "")
        for _ in range(3):
            with pytest.raises(BadRequestError):
                await f.client(0).route("m", HOT, policy={"temperature": -1})
        ep = (await micro_stats(f.nc)).endpoints[0]
        assert ep.num_errors == 3  # the error replies the router answers itself count too
        assert ep.last_error.startswith("bad_request: ")


async def test_tiers_reported_by_the_index_are_weighted(nats_url: str, uid: str) -> None:
    """An index answer with a per-tier breakdown: A's 4 CPU blocks count half, so B's 3 GPU blocks win."""
    async with fleet(nats_url, uid) as f:
        f.answer = lambda q: answer(
            [MatchHolder("a", 0, 4, 4, {"CPU": 4}), MatchHolder("b", 0, 3, 3, {"GPU": 3})], prompt_blocks=4
        )
        await f.start_router()
        reply = await f.client(0).route("m", list(range(64)), explain=True)
        assert reply.worker_id == "b"
        assert [
            (s.worker_id, s.cached_tokens_by_tier, s.weighted_cached_tokens, s.cost)
            for s in reply.scores or []
        ] == [
            ("b", {"GPU": 48}, 48.0, 1.0),
            ("a", {"CPU": 64}, 32.0, 2.0),
        ]
        full = await f.client(0).route("m", list(range(64)), policy={"tier_weights": {"CPU": 1.0}})
        assert full.worker_id == "a"


async def test_prefill_progress_flag_reaches_the_ledger(nats_url: str, uid: str) -> None:
    """The ledger's estimate is on by default; ``--no-prefill-progress`` turns it off."""
    async with fleet(nats_url, uid) as f:
        on = await f.start_router()
        off = await f.start_router(prefill_progress=False)
        assert (on.ledger.prefill_progress, off.ledger.prefill_progress) == (True, False)


async def test_a_router_whose_connection_is_closed_for_good_exits(nats_url: str, uid: str) -> None:
    """nats-py closes a client for good on some server errors (a publish over the max payload); the router
    then raises `ConnectionClosedForGood` (exit status 1 from the command) instead of living on unreachable."""
    from kvmesh.runtime.nats import ConnectionClosedForGood

    f = Fleet(nats_url, uid)
    svc = RouterService(f.settings(0))
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 10)
    assert svc._nc is not None
    await svc._nc.close()
    with pytest.raises(ConnectionClosedForGood):
        await asyncio.wait_for(task, 10)


async def test_a_stamped_prefill_done_dates_the_prefill_by_the_callers_clock(nats_url: str, uid: str) -> None:
    """`mark_prefill_done(at=...)`: the router learns the worker's prefill rate from the stamped time (0.2 s
    after the route's reply), not from when the note arrived (0.6 s after it)."""
    async with fleet(nats_url, uid) as f:
        r0 = await f.start_router()
        c = f.client(0)
        await c.route("m", HOT)  # warm: the first route loads the compiled kernels
        t_sent = time.time()
        reply = await c.route("m", HOT, request_id="p0")
        t_reply = time.time()  # the router received the route between t_sent and t_reply
        tokens = r0.ledger.load(reply.worker_id, 0).prefill_tokens
        assert tokens > 0
        await asyncio.sleep(0.6)
        await c.mark_prefill_done("p0", at=t_reply + 0.2)
        await until(lambda: r0.ledger.load(reply.worker_id, 0).prefill_tokens == 0)
        rate = r0.ledger.prefill_rate(reply.worker_id, 0)
        assert tokens / (0.2 + (t_reply - t_sent)) * 0.98 <= rate <= tokens / 0.2 * 1.02
        with pytest.raises(ValueError, match="at must be a finite number"):
            await c.mark_prefill_done("p0", at=math.nan)
        with pytest.raises(ValueError, match="at must be a finite number"):
            await c.finish("p0", at=True)


def test_a_notes_stamp_is_clamped_to_the_last_minute_before_its_receipt() -> None:
    notes = LifecycleNotes(
        RouterSettings(), LoadLedger(), EngineLoads(), clock=lambda: 100.0, wall=lambda: 1000.0
    )
    dated = [notes._dated(at) for at in (None, 999.5, 1000.0, 1005.0, 0.0, math.nan, math.inf)]
    assert dated == [100.0, 99.5, 100.0, 100.0, 40.0, 100.0, 100.0]
