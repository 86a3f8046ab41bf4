"""A route request whose named candidates are all stale (real nats-server, real ingest and router as tasks,
registry records put as an ingest's heartbeat would)."""

from __future__ import annotations

import pytest
from tests.pipeline import eventually, overlaps, pipeline
from tests.test_router_candidates import start_router
from tests.test_router_degraded import BS, P1, SILENT, publish_batch, put_record

from kvmesh.client import NoWorkersError
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def test_a_request_naming_only_stale_candidates_is_refused_with_the_reason(
    nats_url: str, uid: str
) -> None:
    """Candidates whose every rank is stale are not routed to, even when one holds the prompt: the reply is
    no_workers naming the stale rank and why, not that the worker does not serve the model."""
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest("w", pub.endpoint, pub.replay_endpoint, block_size=BS, worker_ttl_s=300.0)
            await pub.wait_for_subscribers(1)
            await start_router(p)
            await publish_batch(p, "w", 0, P1)  # w/0 holds the prompt
            await put_record(p, "s", dp_ranks=1)
            await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w/0": 4, "s/0": 0})
            await put_record(p, "w", stale_ranks={0: SILENT})
            await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"s/0": 0})

            async def refused() -> str:
                try:
                    r = await p.route(P1, candidates=["w"])
                except NoWorkersError as exc:
                    return exc.message
                return f"routed to {r.worker_id}/{r.dp_rank}"

            message = await refused()
            assert message == (
                f"no live workers among the candidates ['w']: every registered rank of them (1) has a stale "
                f"engine (e.g. w/0: {SILENT})"
            )
    finally:
        pub.close()
