"""Route receipts against a real nats-server and real router replicas (a stand-in indexer answers the match
queries with known overlaps): available, captured and delivered tokens per worker in the router's stats,
exactly, and each request's delivered count on one replica only."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvmesh.client import Router
from kvmesh.core import protocol
from kvmesh.core.protocol import MatchHolder, MatchReply, MatchRequest, RequestRef, RouteReceipts, WorkerLoad
from kvmesh.ops.replies import gather_replies
from kvmesh.ops.report import decode_router_service
from kvmesh.router.config import RouterSettings
from kvmesh.router.service import RouterService
from kvmesh.runtime.metrics import parse_exposition
from kvmesh.runtime.nats import connect
from kvmesh.runtime.vllm_metrics import publish_load

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

BS = 16
PROMPT = list(range(80))  # 5 blocks
HOLDERS = [MatchHolder("a", 0, 4, 40), MatchHolder("b", 0, 0, 0)]
"""a holds 4 blocks of the prompt (64 tokens), b nothing."""


class Replicas:
    """Router replicas (``--index remote``) sharing one stand-in indexer and one set of lifecycle subjects."""

    def __init__(self, nats_url: str, uid: str, nc: Any) -> None:
        self.nats_url = nats_url
        self.uid = uid
        self.nc = nc
        self.routers: list[RouterService] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def start_router(self, **kw: Any) -> Router:
        """Start one more replica on its own route subject (extra settings ``kw``); return a client of it."""
        i = len(self.routers)
        svc = RouterService(
            RouterSettings(
                nats_url=self.nats_url,
                route_subject=self.route_subject(i),
                match_subject=f"t{self.uid}.match",
                requests_prefix=f"t{self.uid}.requests",
                load_prefix=f"t{self.uid}.load",
                index="remote",
                use_registry=False,
                **kw,
            )
        )
        self.routers.append(svc)
        self.tasks.append(asyncio.create_task(svc.run()))
        await asyncio.wait_for(svc.ready.wait(), 10)
        return Router(
            self.nc, subject=self.route_subject(i), timeout_s=3.0, requests_prefix=f"t{self.uid}.requests"
        )

    def route_subject(self, i: int) -> str:
        return f"t{self.uid}.route.{i}"

    async def receipts(self, i: int) -> dict[str, RouteReceipts]:
        """Replica ``i``'s receipts as its ``$SRV.STATS`` reply carries them."""
        replies = await gather_replies(self.nc, "$SRV.STATS.kvmesh-router", b"", 0.5)
        for data in replies or []:
            service = decode_router_service(data)
            if service.stats.index.route_subject == self.route_subject(i):
                return service.stats.receipts
        raise AssertionError(f"replica {i} did not answer $SRV.STATS")

    async def stop(self) -> None:
        for r in self.routers:
            r.stop()
        for t in self.tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 10)


@contextlib.asynccontextmanager
async def replicas(nats_url: str, uid: str) -> AsyncIterator[Replicas]:
    """Yield `Replicas` with a connected client and a stand-in indexer answering `HOLDERS`."""
    nc = await connect(nats_url, name="test-receipts")
    f = Replicas(nats_url, uid, nc)

    async def on_match(msg: Any) -> None:
        protocol.decode(msg.data, MatchRequest, format="msgpack")
        reply = MatchReply(index_seq=7, block_size=BS, prompt_blocks=5, replica="fake", candidates=HOLDERS)
        await msg.respond(protocol.encode(reply, format="msgpack"))

    await nc.subscribe(f"t{uid}.match", cb=on_match)
    try:
        yield f
    finally:
        await f.stop()
        await nc.close()


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until ``check()`` is true."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def receipt(**kw: int) -> RouteReceipts:
    """A receipt with every counter not given at 0."""
    fields = dict.fromkeys(RouteReceipts.__struct_fields__, 0)
    fields.update(kw)
    return RouteReceipts(**fields)


async def test_reported_cached_tokens_are_delivered_exactly(nats_url: str, uid: str) -> None:
    """Three routes with ids to a's 64 cached tokens, two finished with the engine's counts 16 and 32 and one
    without: a's receipts are 3 requests, 192 available and captured, 2 delivered requests of 48 tokens and
    80 tokens mispredicted."""
    async with replicas(nats_url, uid) as f:
        client = await f.start_router()
        svc = f.routers[0]
        for rid in ("r1", "r2", "r3"):
            reply = await client.route("m", PROMPT, request_id=rid)
            assert (reply.worker_id, reply.cached_tokens, reply.available_tokens) == ("a", 64, 64)
        await client.finish("r1", cached_tokens=16)
        await client.finish("r2", cached_tokens=32)
        await client.finish("r3")
        await until(lambda: svc.ledger.stats().finished == 3)
        assert await f.receipts(0) == {
            "a/0": receipt(
                requests=3,
                available_tokens=192,
                captured_tokens=192,
                delivered_requests=2,
                delivered_tokens=48,
                misprediction_tokens=80,
            )
        }


async def test_a_busy_or_excluded_best_holder_is_regret_exactly(nats_url: str, uid: str) -> None:
    """With a busy (KV usage 0.99) the route goes to b: 64 tokens available, none captured, 64 of regret; a
    request whose candidates leave a out adds the same; the engine's count 0 on finish mispredicts nothing."""
    async with replicas(nats_url, uid) as f:
        client = await f.start_router()
        svc = f.routers[0]
        await publish_load(f.nc, WorkerLoad(worker_id="a", kv_usage=0.99), prefix=f"t{uid}.load")
        await until(lambda: svc.engine_loads.get("a", 0, time.monotonic()) is not None)
        busy = await client.route("m", PROMPT, request_id="busy")
        assert (busy.worker_id, busy.cached_tokens, busy.available_tokens) == ("b", 0, 64)
        narrowed = await client.route("m", PROMPT, candidates=["b"])
        assert (narrowed.worker_id, narrowed.cached_tokens, narrowed.available_tokens) == ("b", 0, 64)
        await client.finish("busy", cached_tokens=0)
        await until(lambda: svc.ledger.stats().finished == 1)
        assert await f.receipts(0) == {
            "b/0": receipt(requests=2, available_tokens=128, regret_tokens=128, delivered_requests=1)
        }


async def test_two_replicas_count_a_receipt_once(nats_url: str, uid: str) -> None:
    """A request answered by replica 0 is delivered on replica 0 only, though both replicas see its finish; a
    retry of another request answered by replica 1 moves that receipt's delivery to replica 1."""
    async with replicas(nats_url, uid) as f:
        c0, c1 = await f.start_router(), await f.start_router()
        r0, r1 = f.routers
        await c0.route("m", PROMPT, request_id="once")
        await c0.route("m", PROMPT, request_id="retried")
        await until(lambda: r1.ledger.stats().active == 2)
        await c1.route("m", PROMPT, request_id="retried")  # the client gave up on replica 0's answer
        await until(lambda: r0.ledger.stats().routed == 2 and r1.ledger.stats().routed == 2)
        await c0.finish("once", cached_tokens=48)
        await c1.finish("retried", cached_tokens=64)
        await until(lambda: r0.ledger.stats().finished == r1.ledger.stats().finished == 2)
        assert await f.receipts(0) == {
            "a/0": receipt(
                requests=2,
                available_tokens=128,
                captured_tokens=128,
                delivered_requests=1,
                delivered_tokens=48,
                misprediction_tokens=16,
            )
        }
        assert await f.receipts(1) == {
            "a/0": receipt(
                requests=1, available_tokens=64, captured_tokens=64, delivered_requests=1, delivered_tokens=64
            )
        }


async def test_an_older_finish_note_without_cached_tokens_still_finishes(nats_url: str, uid: str) -> None:
    """A finished note as older clients send it (no cached_tokens) ends the request and delivers nothing; the
    new note's bytes differ from it only by the field."""
    assert protocol.encode(RequestRef(request_id="x")) == b'{"request_id":"x"}'
    assert (
        protocol.encode(RequestRef(request_id="x", cached_tokens=16))
        == b'{"request_id":"x","cached_tokens":16}'
    )
    async with replicas(nats_url, uid) as f:
        client = await f.start_router()
        svc = f.routers[0]
        await client.route("m", PROMPT, request_id="old")
        await f.nc.publish(f"t{uid}.requests.finished", b'{"request_id":"old"}')
        await until(lambda: svc.ledger.stats().finished == 1)
        assert (await f.receipts(0))["a/0"].delivered_requests == 0
        with pytest.raises(ValueError, match="cached_tokens must be an int >= 0"):
            await client.finish("old", cached_tokens=-1)


# ---------------------------------------------------------------------------------------- metrics


async def scrape(port: int) -> dict[str, float]:
    """The router's Prometheus exposition, parsed (`kvmesh.runtime.metrics.parse_exposition`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return parse_exposition(body.decode())


async def test_routes_and_receipts_move_the_router_metrics_by_exactly_what_was_done(
    nats_url: str, uid: str
) -> None:
    """Scraped from the router's --metrics-port: n routes raise the route counter by n and each stage's
    latency count by n; the receipts' counters hold the delivered 48 tokens of 2 requests, the regret of a busy
    best holder, and the busy skip."""
    async with replicas(nats_url, uid) as f:
        client = await f.start_router(metrics_port=0)
        svc = f.routers[0]
        assert svc.metrics is not None and svc.metrics.port is not None
        assert svc.endpoint.metrics is not None  # the service records per route when it serves metrics
        before = await scrape(svc.metrics.port)
        for rid in ("m1", "m2", "m3"):
            await client.route("m", PROMPT, request_id=rid)
        await client.finish("m1", cached_tokens=16)
        await client.finish("m2", cached_tokens=32)
        await publish_load(f.nc, WorkerLoad(worker_id="a", kv_usage=0.99), prefix=f"t{uid}.load")
        await until(lambda: svc.engine_loads.get("a", 0, time.monotonic()) is not None)
        await until(lambda: svc.ledger.stats().finished == 2)
        await client.route("m", PROMPT)  # to b: a is busy
        after = await scrape(svc.metrics.port)
    a, b = 'dp_rank="0",worker_id="a"', 'dp_rank="0",worker_id="b"'

    def moved(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved('kvmesh_router_routes_total{mode="exact"}') == 4
    for stage in ("decode", "match", "decision", "total"):
        assert moved(f'kvmesh_router_route_seconds_count{{stage="{stage}"}}') == 4
    assert moved("kvmesh_router_route_candidates_count") == 4
    assert {k: after[k] for k in after if "_tokens_total" in k or "_requests_total" in k} == {
        f"kvmesh_router_chosen_requests_total{{{a}}}": 3,
        f"kvmesh_router_available_tokens_total{{{a}}}": 192,
        f"kvmesh_router_captured_tokens_total{{{a}}}": 192,
        f"kvmesh_router_regret_tokens_total{{{a}}}": 0,
        f"kvmesh_router_delivered_requests_total{{{a}}}": 2,
        f"kvmesh_router_delivered_tokens_total{{{a}}}": 48,
        f"kvmesh_router_misprediction_tokens_total{{{a}}}": 80,
        f"kvmesh_router_unpredicted_tokens_total{{{a}}}": 0,
        f"kvmesh_router_chosen_requests_total{{{b}}}": 1,
        f"kvmesh_router_available_tokens_total{{{b}}}": 64,
        f"kvmesh_router_captured_tokens_total{{{b}}}": 0,
        f"kvmesh_router_regret_tokens_total{{{b}}}": 64,
        f"kvmesh_router_delivered_requests_total{{{b}}}": 0,
        f"kvmesh_router_delivered_tokens_total{{{b}}}": 0,
        f"kvmesh_router_misprediction_tokens_total{{{b}}}": 0,
        f"kvmesh_router_unpredicted_tokens_total{{{b}}}": 0,
    }
    assert after[f"kvmesh_router_busy_skips_total{{{a}}}"] == 1
