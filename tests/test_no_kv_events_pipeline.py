"""Workers without KV events beside a worker with them, through the real pipeline: a real nats-server, a
simulated vLLM engine publishing on real ZMQ sockets through `kvmesh ingest`, two `kvmesh ingest
--no-kv-events` registering engines that publish nothing, an indexer and a local-index router. The router
answers the event-less model from its own routes and the other from the index."""

from __future__ import annotations

import pytest
from tests.pipeline import eventually, overlaps, pipeline

from kvmesh.router.health import PREDICTED_REASON
from kvmesh.sim.engine import SimWorker

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

BS = 4
P = list(range(100, 116))  # 4 blocks
Q = list(range(200, 216))
NOEV = "noev-model"


async def test_an_event_less_model_is_routed_from_the_routers_own_routes(nats_url: str, uid: str) -> None:
    worker = SimWorker("ev", num_blocks=64, block_size=BS, endpoint="tcp://127.0.0.1:*", seed=1)
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest("ev", worker.publisher.endpoint, block_size=BS)
            for w in ("x", "y"):
                await p.start_ingest(
                    w, "tcp://127.0.0.1:1", model=NOEV, kv_events=False, block_size=BS, kv_capacity_blocks=6
                )
            await worker.publisher.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            # both event-less workers registered: the first route is a tie between two empty caches
            first = await eventually(
                lambda: p.route(P, model=NOEV, explain=True), lambda r: set(overlaps(r)) == {"x/0", "y/0"}
            )
            assert overlaps(first) == {"x/0": 0, "y/0": 0}
            w = first.worker_id
            other = "y" if w == "x" else "x"
            again = await p.route(P, model=NOEV, explain=True)
            assert (again.worker_id, overlaps(again)) == (w, {f"{w}/0": 4, f"{other}/0": 0})
            assert again.mode == "exact"
            assert {(s.health.state, s.health.reason) for s in again.scores or [] if s.health} == {
                ("predicted", PREDICTED_REASON)
            }
            # a new prompt goes to the emptier worker; then Q on w too: 8 blocks > 6, P's tail goes first
            fresh = await p.route(Q, model=NOEV, explain=True)
            assert fresh.worker_id == other
            assert {(s.worker_id, s.overlap_blocks, s.cached_blocks) for s in fresh.scores or []} == {
                (w, 0, 4),  # the routers' record of w's cache counts for the tie
                (other, 0, 0),
            }
            await p.route(Q, model=NOEV, candidates=[w])
            after = await p.route(P, model=NOEV, candidates=[w])
            assert after.overlap_blocks == 2
            # the model with KV events is answered from the index as before
            assert (await worker.serve_request(P, 0))["cached_tokens"] == 0
            ev = await eventually(lambda: p.route(P), lambda r: r.overlap_blocks == 4)
            assert ev.worker_id == "ev"
            status = p.router_service.stats_message() if p.router_service else None
            assert status is not None and status.predicted_blocks == {"no_events": 10}
    finally:
        worker.close()
