"""The ingest's supervised loops ride out an engine's HTTP endpoint that answers with broken HTTP.

Since the ingest runs its loops under `kvmesh.runtime.runner.supervise`, a loop that raises ends the ingest
(exit 1). An engine killed mid-response, or a port that speaks something else than HTTP, makes urllib raise
`http.client.HTTPException` (not an `OSError`): the metrics scraper and the HTTP liveness probe must count it
as a failed scrape or probe and keep the ingest serving. Real nats-server, real ZMQ, the real ingest as a task.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from tests.pipeline import eventually
from tests.test_ingest_faults import BS, T, U, clean_pipeline, expect, stored

from kvmesh.core.protocol import WorkerLoad, decode
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

TRUNCATED = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 4096\r\n\r\n# HELP vllm:num_req"
"""An answer cut off mid-body (the engine died while sending it): urllib raises `http.client.IncompleteRead`."""

NOT_HTTP = b"SSH-2.0-OpenSSH_9.6\r\n"
"""A port that speaks another protocol: urllib raises `http.client.BadStatusLine`."""


@asynccontextmanager
async def broken_http(answer: bytes) -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server on 127.0.0.1 that sends ``answer`` to every connection and closes it; yields its URL and
    a one-element list counting the connections served."""
    served = [0]

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served[0] += 1
        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(answer)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/metrics", served
    finally:
        server.close()
        await server.wait_closed()


async def test_a_truncated_metrics_page_is_a_failed_scrape_and_the_ingest_keeps_running(
    nats_url: str, uid: str
) -> None:
    """A metrics page cut off mid-body counts as a failed scrape; the ingest keeps running and indexing."""
    pub = EventPublisher("tcp://127.0.0.1:*", None)
    try:
        async with broken_http(TRUNCATED) as (url, served), clean_pipeline(nats_url, uid) as p:
            await p.start_ingest(
                "w", pub.endpoint, None, block_size=BS, metrics_url=url, engine_probe_after_s=0
            )
            task = p.tasks[-1]
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            # Three scrapes served: the scraper met the broken page and scraped again (one a second).
            got = await eventually(
                lambda: asyncio.sleep(0, (served[0], task.done())), lambda r: r[0] >= 3 or r[1], timeout_s=15
            )
            assert got[0] >= 3 and not got[1], task.exception() if task.done() else got
            pub.publish([stored([1, 2, 3, 4], T)])
            await expect(p, [T], [{"w/0": 4}])
            assert not task.done()
    finally:
        pub.close()


async def test_a_health_url_that_is_not_http_is_a_failed_probe_and_the_ingest_keeps_running(
    nats_url: str, uid: str
) -> None:
    """A health URL whose port does not speak HTTP is an unanswered probe (the rank goes stale with the
    reason); the ingest keeps running and indexing."""
    pub = EventPublisher("tcp://127.0.0.1:*", None)
    try:
        async with broken_http(NOT_HTTP) as (url, served), clean_pipeline(nats_url, uid) as p:
            ing = await p.start_ingest(
                "w",
                pub.endpoint,
                None,
                block_size=BS,
                health_url=url,
                engine_probe_after_s=0.3,
                engine_probe_every_s=0.2,
                engine_probe_timeout_s=0.5,
                engine_stale_after_failures=2,
                engine_remove_after_s=60,
            )
            task = p.tasks[-1]
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            got = await eventually(
                lambda: asyncio.sleep(0, (served[0], task.done())), lambda r: r[0] >= 3 or r[1], timeout_s=15
            )
            assert got[0] >= 3 and not got[1], task.exception() if task.done() else got
            engine = await eventually(
                lambda: asyncio.sleep(0, ing.status().ranks["0"].engine),
                lambda e: e is not None and e.state == "stale",
                timeout_s=10,
            )
            assert engine is not None and engine.state == "stale"
            assert f"{url}: " in engine.reason and "BadStatusLine" in engine.reason
            assert not task.done()
    finally:
        pub.close()


def page(body: bytes) -> bytes:
    """An HTTP 200 answer carrying ``body`` as a Prometheus text page."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
    return head % len(body) + body


async def test_a_metrics_page_with_infinite_values_publishes_the_finite_ones_and_the_ingest_keeps_running(
    nats_url: str, uid: str
) -> None:
    """``+Inf`` running and ``1e400`` waiting requests on an engine's metrics page are skipped (an infinite
    count cannot be a load); the finite kv usage is published in each report and the ingest keeps running."""
    body = b"vllm:num_requests_running +Inf\nvllm:num_requests_waiting 1e400\nvllm:kv_cache_usage_perc 0.25\n"
    worker = f"w{uid}"
    pub = EventPublisher("tcp://127.0.0.1:*", None)
    nc = await connect(nats_url, name="test-loads")
    reports: list[WorkerLoad] = []

    async def on_load(msg: Any) -> None:
        reports.append(decode(msg.data, WorkerLoad))

    try:
        await nc.subscribe(subjects.load_subject(subjects.LOAD_PREFIX, worker), cb=on_load)
        await nc.flush()
        async with broken_http(page(body)) as (url, served), clean_pipeline(nats_url, uid) as p:
            await p.start_ingest(
                worker, pub.endpoint, None, block_size=BS, metrics_url=url, engine_probe_after_s=0
            )
            task = p.tasks[-1]
            got = await eventually(
                lambda: asyncio.sleep(0, (served[0], task.done())), lambda r: r[0] >= 3 or r[1], timeout_s=15
            )
            assert got[0] >= 3 and not got[1], task.exception() if task.done() else got
            await eventually(lambda: asyncio.sleep(0, len(reports)), lambda n: n >= 2)
            assert set(reports) == {WorkerLoad(worker_id=worker, dp_rank=0, kv_usage=0.25)}
    finally:
        await nc.close()
        pub.close()


async def test_deleting_the_registry_and_snapshot_buckets_under_running_services_ends_none_of_them(
    nats_url: str, uid: str
) -> None:
    """With the registry bucket and the snapshot bucket deleted under a running ingest, indexer and router,
    every service keeps running, the ingest registers its worker again (as a new incarnation), and what its
    engine stores next is routed with its exact overlap."""
    pub = EventPublisher("tcp://127.0.0.1:*", None)
    nc = await connect(nats_url, name="test-buckets")
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await p.start_ingest("w", pub.endpoint, None, block_size=BS, engine_probe_after_s=0)
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            pub.publish([stored([1, 2, 3, 4], T)])
            await expect(p, [T], [{"w/0": 4}])
            js = nc.jetstream()
            await js.delete_key_value(subjects.registry_bucket(p.stream))
            await js.delete_object_store(subjects.snapshot_bucket(p.stream))

            async def key_back() -> bool:
                try:
                    kv = await js.key_value(subjects.registry_bucket(p.stream))
                    entry = await kv.get(subjects.kv_key("w"))
                except Exception:
                    return False
                return entry.value is not None

            # The heartbeat re-creates the bucket and puts the key again (one beat: a few seconds).
            assert await eventually(key_back, lambda ok: ok, timeout_s=30)
            await asyncio.sleep(
                2.0
            )  # the indexer's member watch and snapshot writer meet the deleted buckets
            assert [t.done() for t in p.tasks] == [False, False, False], [
                t.exception() for t in p.tasks if t.done()
            ]
            # A missing key reads as "removed from the index": the worker rejoined as a new incarnation, so
            # only what its engine stores from now on is indexed.
            pub.publish([stored([5, 6], U)])
            await expect(p, [T, U], [{"w/0": 0}, {"w/0": 2}])
    finally:
        await nc.close()
        pub.close()
