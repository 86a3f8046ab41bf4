"""Index replicas and local-index routers starting while JetStream cannot answer yet (3-node cluster, R3)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from tests.indexers import BS, MODEL, Group, group, wait_for
from tests.test_cluster import _expected, _until_js_ready, feed

from kvmesh.bench.fleet import Cluster
from kvmesh.client import Router
from kvmesh.indexer.service import IndexerService
from kvmesh.router.config import RouterSettings
from kvmesh.router.service import RouterService

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.slow]


def _router(g: Group, url: str) -> RouterService:
    return RouterService(
        RouterSettings(
            nats_url=url,
            route_subject=f"r{g.uid}.route",
            requests_prefix=f"r{g.uid}.requests",
            load_prefix=f"r{g.uid}.load",
            index="local",
            stream=g.stream,
            events_prefix=g.prefix,
            sync_timeout_s=0.1,
        )
    )


async def _seq(svc: IndexerService | RouterService) -> int:
    replica = svc.replica if isinstance(svc, RouterService) else svc
    if isinstance(replica, IndexerService):
        return replica.state.applied_seq
    return replica.state.applied_seq if replica is not None else -1


async def test_indexer_and_router_started_without_jetstream_quorum_become_ready(
    cluster: Cluster, uid: str
) -> None:
    """An indexer (creating R3 buckets) and a local-index router started while two of three nodes are down
    keep retrying their start-up calls instead of exiting, and both become ready with the whole stream once
    the nodes are back."""
    await _until_js_ready(cluster.url(0))
    n = 40
    async with group(cluster.url(0), uid, memory=False, replicas=3) as g:
        await feed(g, 0, n)
        cluster.kill(1)
        cluster.kill(2)  # no quorum: the stream has no leader and R3 buckets cannot be created
        indexer = IndexerService(g.settings(f"{uid}-a", nats_url=cluster.url(0)))
        router = _router(g, cluster.url(0))
        tasks = [asyncio.create_task(indexer.run()), asyncio.create_task(router.run())]
        try:
            await asyncio.sleep(3.0)
            assert [t.done() for t in tasks] == [False, False], [t.exception() for t in tasks if t.done()]
            assert not indexer.ready.is_set() and not router.ready.is_set()
            cluster.start(1)
            cluster.start(2)
            await asyncio.wait_for(indexer.ready.wait(), 60)
            await asyncio.wait_for(router.ready.wait(), 60)
            await wait_for(lambda: _seq(indexer), lambda s: s == n, timeout_s=30)
            await wait_for(lambda: _seq(router), lambda s: s == n, timeout_s=30)
            assert router.replica is not None
            assert indexer.state.digest() == router.replica.state.digest() == _expected(n).digest()
            reply = await Router(g.nc, subject=f"r{uid}.route", timeout_s=5.0).route(
                MODEL, list(range(BS * 2))
            )
            assert reply.index_seq == n
        finally:
            indexer.stop()
            router.stop()
            for t in tasks:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(t, 15)


async def test_indexer_and_router_start_right_after_the_cluster_with_r3_buckets(
    cluster: Cluster, uid: str
) -> None:
    """An indexer creating fresh R3 buckets and a local-index router started at once on a fresh cluster
    both become ready (their start-up calls retry while the buckets elect leaders)."""
    await _until_js_ready(cluster.url(1))
    async with group(cluster.url(1), uid, memory=False, replicas=3) as g:
        await feed(g, 0, 8)
        indexer = IndexerService(g.settings(f"{uid}-a", nats_url=cluster.url(2)))
        router = _router(g, cluster.url(0))
        tasks = [asyncio.create_task(indexer.run()), asyncio.create_task(router.run())]
        try:
            await asyncio.wait_for(indexer.ready.wait(), 60)
            await asyncio.wait_for(router.ready.wait(), 60)
            await wait_for(lambda: _seq(router), lambda s: s == 8, timeout_s=30)
            assert [t.done() for t in tasks] == [False, False]
        finally:
            indexer.stop()
            router.stop()
            for t in tasks:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(t, 15)
