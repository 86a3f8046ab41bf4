"""`kvmesh bench trace --sessions` through the real pipeline: the session id reaches the router (NATS,
ingests, indexer and router as child processes; a few seconds)."""

from __future__ import annotations

import asyncio

import pytest
from tests.test_bench_trace_sessions import CONVERSATION, session_counts

from kvmesh.bench import trace as bench_trace


@pytest.mark.e2e
@pytest.mark.slow
def test_the_pipeline_sends_the_session_to_the_router() -> None:
    """Through the real pipeline (NATS, ingests, indexer, router) the conversation stays on one worker and
    the router's replies count 2 new sessions and 2 kept routes."""
    spec = bench_trace.FleetSpec(workers=2, num_blocks=4096)
    r = asyncio.run(
        bench_trace.run_kvmesh(
            CONVERSATION, spec, speed=5.0, sessions=True, label="kvmesh +sess 0.25", say=lambda _: None
        )
    )
    assert r.policy == "kvmesh +sess 0.25"
    assert sorted(r.per_worker) == [0, 4]
    assert session_counts(r) == (2, 2, 0)
