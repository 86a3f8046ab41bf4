"""An engine that sleeps says so on its ``/metrics`` page before it publishes AllBlocksCleared: the ingest clears it.

The pages are a real vLLM 0.32.0's (``tests/data/vllm-metrics/``, captured awake and asleep); a stand-in HTTP
endpoint serves them in place of the engine's ``/metrics``, next to a simulated engine publishing real KV
events over ZMQ, a real ingest (``--metrics-url``), indexer and router on the session's nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from tests.pipeline import Pipeline, eventually, overlaps, pipeline

from kvmesh.core.events import Cleared, EventsMessage, decode_message
from kvmesh.ingest.engine_sleep import SleepPolicy, sleeping_ranks
from kvmesh.ingest.metrics import SLEEP_CLEARS, sleep_samples
from kvmesh.ingest.service import IngestService
from kvmesh.runtime import subjects
from kvmesh.sim.engine import SimWorker

pytestmark = [pytest.mark.anyio]

PAGES = Path(__file__).parent / "data" / "vllm-metrics"
AWAKE = (PAGES / "vllm-0.32.0-awake.txt").read_text()
ASLEEP = (PAGES / "vllm-0.32.0-asleep.txt").read_text()
BS = 4
P1 = list(range(100, 116))  # 4 blocks
P2 = list(range(500, 508))  # 2 blocks


class MetricsPage:
    """A stand-in for an engine's ``/metrics``: an HTTP server answering ``text`` (``before`` runs first)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.before: Callable[[], Awaitable[None]] | None = None
        self.scrapes = 0
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/metrics"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # request line and headers
            # Read together, with no await between: a scrape answers the text that came with its hook.
            text, before, self.before = self.text, self.before, None
            if before is not None:
                await before()
            body = text.encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + body
            )
            await writer.drain()
            self.scrapes += 1
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def scraped(self, n: int = 2) -> None:
        """Wait until ``n`` more scrapes have been answered with the current text."""
        target = self.scrapes + n
        await eventually(lambda: _value(self.scrapes), lambda s: s >= target, timeout_s=10)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def _value(v: int) -> int:
    return v


@contextlib.asynccontextmanager
async def sleeping_fleet(
    nats_url: str, uid: str
) -> AsyncIterator[tuple[Pipeline, SimWorker, MetricsPage, IngestService]]:
    page = MetricsPage(AWAKE)
    await page.start()
    sim = SimWorker(
        "w-sleep",
        num_blocks=64,
        block_size=BS,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        seed=3,
        version="0.32.0",
    )
    try:
        async with pipeline(nats_url, uid) as p:
            ingest = await p.start_ingest(
                sim.worker_id,
                sim.publisher.endpoint,
                sim.publisher.replay_endpoint,
                block_size=BS,
                metrics_url=page.url,
            )
            await sim.publisher.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            yield p, sim, page, ingest
    finally:
        sim.close()
        await page.close()


async def _cleared_reasons(p: Pipeline, worker: str) -> list[str]:
    """The reasons of every Cleared on the worker's rank-0 subject, in stream order."""
    nc = p._nc
    js = nc.jetstream()
    last = (await js.stream_info(p.stream)).state.last_seq
    subject = subjects.events_subject(p.prefix, p.model, worker, 0)
    out: list[str] = []
    for seq in range(1, last + 1):
        msg = await js.get_msg(p.stream, seq=seq)
        if msg.subject != subject:
            continue
        decoded = decode_message(msg.data or b"")
        if isinstance(decoded, EventsMessage):
            out += [e.reason for e in decoded.events if isinstance(e, Cleared)]
    return out


def test_the_captured_pages_read_awake_and_asleep() -> None:
    """vLLM 0.32.0's own pages: engine 0 awake, then asleep (sleep level 1)."""
    assert sleeping_ranks(AWAKE) == {0: False}
    assert sleeping_ranks(ASLEEP) == {0: True}
    assert sleeping_ranks("# no sleep gauge on this page\nvllm:num_requests_running 0\n") == {}


def test_sleep_policy_reports_each_fall_once() -> None:
    """A rank is reported when first seen asleep and after each awake page, never twice in one sleep."""
    policy = SleepPolicy()
    falls = [policy.observe(s) for s in ({0: False}, {0: True}, {0: True}, {}, {0: False}, {0: True})]
    assert falls == [[], [0], [], [], [], [0]]
    assert SleepPolicy().observe({1: True, 0: True, 2: False}) == [0, 1]


def test_sleep_clears_metric_samples() -> None:
    assert sleep_samples("w", {1: 2, 0: 1}) == {
        SLEEP_CLEARS: [({"worker_id": "w", "dp_rank": "0"}, 1.0), ({"worker_id": "w", "dp_rank": "1"}, 2.0)]
    }


@pytest.mark.nats
@pytest.mark.e2e
async def test_an_engine_asleep_on_its_metrics_page_is_cleared(nats_url: str, uid: str) -> None:
    """The page turns asleep while the engine publishes nothing: the worker's blocks leave the index at once,
    through a Cleared("sleep") in the stream, once per sleep; a later sleep clears again."""
    async with sleeping_fleet(nats_url, uid) as (p, sim, page, ingest):
        await sim.serve_request(P1, 0)
        await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w-sleep/0": 4})
        await page.scraped()
        assert ingest.sleep_watch.clears == {}

        page.text = ASLEEP
        reply = await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w-sleep/0": 0})
        assert reply.scores is not None and reply.scores[0].cached_blocks == 0
        assert ingest.sleep_watch.clears == {0: 1}
        assert await _cleared_reasons(p, "w-sleep") == ["sleep"]

        # Still asleep on the next pages: no second clear (what the engine stores now stays indexed).
        await sim.serve_request(P2, 0)
        await eventually(lambda: p.route(P2, explain=True), lambda r: overlaps(r) == {"w-sleep/0": 2})
        await page.scraped()
        assert ingest.sleep_watch.clears == {0: 1}
        assert overlaps(await p.route(P2, explain=True)) == {"w-sleep/0": 2}

        # Awake, then asleep again: cleared again.
        page.text = AWAKE
        await page.scraped()
        page.text = ASLEEP
        await eventually(lambda: p.route(P2, explain=True), lambda r: overlaps(r) == {"w-sleep/0": 0})
        assert ingest.sleep_watch.clears == {0: 2}
        assert await _cleared_reasons(p, "w-sleep") == ["sleep", "sleep"]


@pytest.mark.nats
@pytest.mark.e2e
async def test_no_second_clear_when_the_engines_own_arrives_during_the_scrape(
    nats_url: str, uid: str
) -> None:
    """The engine's AllBlocksCleared reaches the ingest while the asleep page is on its way, and the engine
    stores again after it: a clear from the page now would drop those blocks, so none is made."""
    async with sleeping_fleet(nats_url, uid) as (p, sim, page, ingest):
        await sim.serve_request(P1, 0)
        await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w-sleep/0": 4})

        async def engine_clears_and_stores() -> None:
            await sim.reset_prefix_cache()
            await sim.serve_request(P2, 0)
            await eventually(
                lambda: _value(ingest.status().ranks["0"].events.get("stored_events", 0)),
                lambda n: n == 2,
            )

        page.before = engine_clears_and_stores
        page.text = ASLEEP
        await page.scraped()
        await eventually(lambda: p.route(P2, explain=True), lambda r: overlaps(r) == {"w-sleep/0": 2})
        await page.scraped()
        assert ingest.sleep_watch.clears == {}
        assert ingest.sleep_watch.skipped == {0: 1}
        assert overlaps(await p.route(P1, explain=True)) == {"w-sleep/0": 0}
        assert overlaps(await p.route(P2, explain=True)) == {"w-sleep/0": 2}
        assert await _cleared_reasons(p, "w-sleep") == ["engine"]
