"""Bounded route candidates against a real nats-server, a real ingest and the real router: registered ranks
that hold nothing cost a route nothing per rank, and never beat a holder with overlap."""

from __future__ import annotations

import asyncio
import logging
import re
import statistics
import time
from typing import Any

import msgspec
import pytest
from tests.pipeline import Pipeline, eventually, overlaps, pipeline

from kvmesh.client import Router
from kvmesh.core.protocol import WorkerRecord
from kvmesh.core.route import IDLE_CANDIDATES
from kvmesh.router.config import RouterSettings
from kvmesh.router.service import RouterService
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect
from kvmesh.runtime.registry import MAX_DP_RANKS, RegistryWatcher
from kvmesh.sim.engine import SimWorker

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

BS = 4
P1 = list(range(100, 116))  # 4 blocks
EMPTY_RECORDS = 64


async def start_router(p: Pipeline, **kw: Any) -> Router:
    """Start a local-index router for the pipeline with extra settings (the pipeline stops it)."""
    svc = RouterService(
        RouterSettings(
            nats_url=p.nats_url,
            route_subject=p.route_subject,
            match_subject=p.match_subject,
            index="local",
            stream=p.stream,
            events_prefix=p.prefix,
            **kw,
        )
    )
    p.router_service = svc
    p.tasks.append(asyncio.create_task(svc.run()))
    await asyncio.wait_for(svc.ready.wait(), 10)
    p._nc = await connect(p.nats_url, name="test-client")
    p.router = Router(p._nc, subject=p.route_subject, timeout_s=3.0)
    return p.router


async def register_empty(p: Pipeline, records: int, ranks: int) -> None:
    """Put ``records`` registry records of ``ranks`` ranks each (workers that never store a block)."""
    assert p._nc is not None
    kv = await p._nc.jetstream().key_value(subjects.registry_bucket(p.stream))
    for i in range(records):
        rec = WorkerRecord(
            worker_id=f"empty-{i:02d}", model=p.model, dp_ranks=ranks, block_size=BS, incarnation=0
        )
        await kv.put(subjects.kv_key(rec.worker_id), msgspec.json.encode(rec))


async def test_thousands_of_empty_ranks_neither_slow_routes_nor_beat_the_holder(
    nats_url: str, uid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With 64 registry records of 4,096 empty ranks each beside one real worker holding the prompt, a route
    scores the holder and 16 drawn empty ranks (262,128 cut), picks the holder with its exact overlap, and
    50 routes take a p50 far below the 23 ms that 4,096 such ranks used to cost."""
    worker = SimWorker("w", num_blocks=64, block_size=BS, endpoint="tcp://127.0.0.1:*", seed=1)
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest("w", worker.publisher.endpoint, block_size=BS)
            await worker.publisher.wait_for_subscribers(1)
            await start_router(p)
            await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w/0": 0})
            assert (await worker.serve_request(P1, 0))["cached_tokens"] == 0
            await eventually(lambda: p.route(P1), lambda r: r.overlap_blocks == 4)

            await register_empty(p, EMPTY_RECORDS, MAX_DP_RANKS)
            total = EMPTY_RECORDS * MAX_DP_RANKS + 1
            first = await eventually(
                lambda: p.route(P1, explain=True),
                lambda r: r.selection is not None and r.selection.total == total,
            )
            assert (first.worker_id, first.dp_rank, first.overlap_blocks, first.cached_tokens) == (
                "w",
                0,
                4,
                16,
            )
            assert first.mode == "exact" and first.degraded_reason is None
            assert msgspec.to_builtins(first.selection) == {
                "total": total,
                "considered": 1 + IDLE_CANDIDATES,
                "cut": total - 1 - IDLE_CANDIDATES,
                "bounded": False,
                "skipped": [],
                "skipped_total": 0,
            }
            assert first.scores is not None and len(first.scores) == 1 + IDLE_CANDIDATES
            assert first.scores[0].worker_id == "w"
            assert all(s.overlap_blocks == 0 for s in first.scores[1:])

            # A prompt nobody holds: the known worker and the drawn empty ranks tie on cost; the tie still
            # answers at once (which rank wins is the seeded tie-break's).
            cold = await p.route(list(range(5000, 5016)), explain=True)
            assert cold.selection is not None and cold.selection.considered == 1 + IDLE_CANDIDATES

            took = []
            for i in range(50):
                t0 = time.perf_counter()
                r = await p.route(P1, request_id=f"r-{i}")
                took.append(time.perf_counter() - t0)
                assert (r.worker_id, r.overlap_blocks) == ("w", 4)
                assert p.router is not None
                await p.router.finish(f"r-{i}")
            assert statistics.median(took) < 0.25, took
            assert not [r for r in caplog.records if "--max-candidates" in r.getMessage()]
    finally:
        worker.close()


async def test_candidates_beyond_the_bound_are_cut_holders_first_and_warned_once(
    nats_url: str, uid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With --max-candidates 8, a route scores the holder with overlap and 7 empty ranks, says it was
    bounded, and the router warns once for the model, naming how many were cut, however many routes follow."""
    worker = SimWorker("w", num_blocks=64, block_size=BS, endpoint="tcp://127.0.0.1:*", seed=1)
    caplog.set_level(logging.WARNING, logger="kvmesh.router")
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest("w", worker.publisher.endpoint, block_size=BS)
            await worker.publisher.wait_for_subscribers(1)
            await start_router(p, max_candidates=8)
            await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w/0": 0})
            assert (await worker.serve_request(P1, 0))["cached_tokens"] == 0
            await register_empty(p, 2, 100)
            r = await eventually(
                lambda: p.route(P1, explain=True),
                lambda r: r.overlap_blocks == 4 and r.selection is not None and r.selection.total == 201,
            )
            assert r.worker_id == "w"
            assert r.selection is not None
            assert (r.selection.considered, r.selection.cut, r.selection.bounded) == (8, 193, True)
            for _ in range(5):
                await p.route(P1)
            warned = [x.getMessage() for x in caplog.records if "--max-candidates" in x.getMessage()]
            assert len(warned) == 1, warned
            # The first bounded route may have seen one record only (101 candidates): the warning names what
            # that route saw.
            m = re.search(r"has (\d+) live candidates, more than --max-candidates 8: .* (\d+) cut", warned[0])
            assert m is not None, warned[0]
            assert int(m.group(1)) in (101, 201) and int(m.group(2)) == int(m.group(1)) - 8
            assert p.router_service is not None
            assert p.router_service._stats(None)["candidates_cut"] == {p.model: 193}  # type: ignore[arg-type]
    finally:
        worker.close()


async def test_a_requested_candidate_among_many_empty_ranks_is_always_considered(
    nats_url: str, uid: str
) -> None:
    """A request's ``candidates`` naming one registered worker the index does not know is routed to it, even
    when thousands of other empty ranks leave it out of the few idle ranks a route would draw."""
    worker = SimWorker("w", num_blocks=64, block_size=BS, endpoint="tcp://127.0.0.1:*", seed=1)
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest("w", worker.publisher.endpoint, block_size=BS)
            await worker.publisher.wait_for_subscribers(1)
            await start_router(p)
            await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w/0": 0})
            await register_empty(p, 8, 512)
            await eventually(
                lambda: p.route(P1, explain=True),
                lambda r: r.selection is not None and r.selection.total == 8 * 512 + 1,
            )
            for i in range(8):
                r = await p.route(P1, candidates=[f"empty-{i:02d}"], explain=True)
                assert r.worker_id == f"empty-{i:02d}"
                assert r.selection is not None
                assert (r.selection.total, r.selection.considered) == (512, IDLE_CANDIDATES)
    finally:
        worker.close()


def test_registry_ranks_view_is_rebuilt_only_when_ranks_change() -> None:
    """`RegistryWatcher.ranks` keeps one view per model across plain heartbeats (a route never rebuilds it
    per request) and rebuilds it when a record's ranks or stale ranks change, or a worker leaves."""
    w = RegistryWatcher(js=None, bucket="B")  # type: ignore[arg-type]

    def put(ts: float, **kw: Any) -> None:
        rec = WorkerRecord(worker_id="a", model="m", block_size=BS, incarnation=0, heartbeat_ts=ts, **kw)
        w.apply(subjects.kv_key("a"), None, msgspec.json.encode(rec))

    put(1.0, dp_ranks=4096)
    assert w.ranks("m") is None  # not synced: no opinion
    w.synced = True
    view = w.ranks("m")
    assert view is not None and (view.live_count, view.stale_count) == (4096, 0)
    put(2.0, dp_ranks=4096)  # a heartbeat
    assert w.ranks("m") is view
    put(3.0, dp_ranks=4096, stale_ranks={5: "silent"})
    stale = w.ranks("m")
    assert stale is not view and stale is not None
    assert (stale.live_count, stale.stale_count, stale.stale_listed) == (4095, 1, (("a", 5, "silent"),))
    w.apply(subjects.kv_key("a"), "DEL", None)
    gone = w.ranks("m")
    assert gone is not None and (gone.live_count, gone.stale_count) == (0, 0)  # left: no candidates
    assert w.ranks("other") is None
