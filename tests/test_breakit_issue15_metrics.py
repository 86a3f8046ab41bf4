"""An engine's ``/metrics`` page that never finishes (a byte at a time) or is huge, read by an ingest with
``--metrics-url`` (the page's load and sleep state, `kvmesh.ingest.engine_sleep`).

A stand-in HTTP endpoint in the test, a simulated vLLM engine over real ZMQ sockets, a real ingest, indexer
and router on the session's nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from tests.pipeline import eventually, overlaps, pipeline
from tests.test_engine_sleep import ASLEEP, BS, P1

from kvmesh.ingest.probes import MAX_METRICS_BYTES, fetch_metrics
from kvmesh.sim.engine import SimWorker

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.e2e]


class DripPage:
    """An HTTP endpoint that announces a long body and sends it one byte every ``drip_s`` (``huge``: at once),
    or, once ``text`` is set, answers it whole."""

    def __init__(self, *, drip_s: float = 0.2, huge: int = 0) -> None:
        self.drip_s = drip_s
        self.huge = huge
        self.text: str | None = None
        self.open = 0
        self.most_open = 0
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/metrics"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self._writers.add(writer)
        self.most_open = max(self.most_open, self.open)
        try:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            if self.text is not None:
                body = self.text.encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                )
                writer.write(body)
                await writer.drain()
                return
            size = self.huge or 10**8
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % size)
            if self.huge:
                line = b"# filler\n" * 100_000
                for _ in range(0, size, len(line)):
                    writer.write(line)
                    await writer.drain()
                return
            while True:
                writer.write(b"#")
                await writer.drain()
                await asyncio.sleep(self.drip_s)
        except (ConnectionError, OSError):
            pass
        finally:
            self.open -= 1
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()


async def test_a_page_that_never_finishes_holds_no_more_than_one_scrape(nats_url: str, uid: str) -> None:
    """A page sending one byte every 0.2 s for ever: each scrape gives up within its timeout (2 s) and closes
    its connection, so at most 2 are open at once over 12 s of scrapes (each one left reading held a thread and
    a connection for good, and the default thread pool, the liveness probes' too, filled up); once the page
    answers again, its asleep state clears the worker at once."""
    page = DripPage()
    await page.start()
    sim = SimWorker(
        "w-drip", num_blocks=64, block_size=BS, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
        seed=3, version="0.32.0",
    )  # fmt: skip
    try:
        async with pipeline(nats_url, uid) as p:
            ingest = await p.start_ingest(
                sim.worker_id, sim.publisher.endpoint, sim.publisher.replay_endpoint, block_size=BS,
                metrics_url=page.url,
            )  # fmt: skip
            await sim.publisher.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            await sim.serve_request(P1, 0)
            await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w-drip/0": 4})
            await asyncio.sleep(12.0)
            assert page.most_open <= 2
            page.text = ASLEEP
            await eventually(
                lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w-drip/0": 0}, timeout_s=15
            )
            assert ingest.sleep_watch.clears == {0: 1}
    finally:
        sim.close()
        await page.close()


async def test_a_page_larger_than_the_bound_is_refused() -> None:
    """A page of 64 MiB (over `MAX_METRICS_BYTES`, 16 MiB) is refused with an error naming the bound, not
    read into memory; the connection is closed."""
    page = DripPage(huge=64 * 2**20)
    await page.start()
    try:
        with pytest.raises(OSError, match=f"over {MAX_METRICS_BYTES} bytes"):
            await fetch_metrics(page.url, 10.0)
        await eventually(lambda: asyncio.sleep(0, page.open), lambda n: n == 0)
    finally:
        await page.close()
