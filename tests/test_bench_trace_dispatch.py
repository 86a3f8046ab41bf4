"""`kvmesh bench trace`: a request the harness routes late arrives when it is routed, so the simulated engines'
clock stays the router's clock × ``--speed`` (the pipeline test runs NATS, ingests, an indexer and a router as
child processes; a few seconds)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.bench import trace as bench_trace
from kvmesh.sim.trace import TraceRequest


def test_an_on_time_request_keeps_its_arrival_and_a_late_one_arrives_when_routed() -> None:
    p = bench_trace._prepare(
        TraceRequest(timestamp_ms=1500, input_length=512, output_length=4, hash_ids=(7,)), 3, 0
    )
    assert p.arrival_s == 1.5
    assert bench_trace.dispatched(p, 1.5) is p
    assert bench_trace.dispatched(p, 1.25) is p
    late = bench_trace.dispatched(p, 2.75)
    assert (late.request_id, late.arrival_s, late.tokens, late.outputs) == (
        "req-3",
        2.75,
        p.tokens,
        p.outputs,
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_requests_the_harness_routes_late_do_not_queue_behind_each_other_in_the_past() -> None:
    """Six distinct 4,096-token prompts, all at t = 0, two workers, 1 ms of wall time = 2 s of simulated time.
    The harness routes them one after another, each a route's round trip (≥ 0.1 ms wall, ≥ 0.2 s simulated)
    after the one before: they reach the engines that far apart, as they reached the router, so none waits
    behind another's prefill (0.4146 s each). Kept at t = 0 (the harness before), three queued on each
    engine and the last waited two prefills more (TTFT ≥ 1.2 s)."""
    trace = [
        TraceRequest(
            timestamp_ms=0, input_length=4096, output_length=2, hash_ids=tuple(range(10 * i, 10 * i + 8))
        )
        for i in range(6)
    ]
    spec = bench_trace.FleetSpec(workers=2, num_blocks=4096)
    r = asyncio.run(bench_trace.run_kvmesh(trace, spec, speed=2000.0, say=lambda _: None))
    prefill = spec.timing.prefill_s(4096)
    assert prefill == pytest.approx(0.4146)
    assert r.requests == 6
    assert r.cached_tokens == 0
    assert r.route_latency_s and len(r.route_latency_s) == 6
    # TTFT = the route's own latency (real seconds, < 0.1 s) + its prefill, never another's
    assert max(r.ttft_s) < prefill + 0.1
    assert r.extra["route_late_p50_ms"] > 0
    # the oracle on the same arrivals: the reference for the workload the pipeline had
    assert len(r.arrivals_ms) == 6
    assert r.arrivals_ms == sorted(r.arrivals_ms)
    assert r.arrivals_ms[-1] - r.arrivals_ms[0] >= 5 * 200  # each route ≥ 0.1 ms wall after the one before
    o = bench_trace.on_arrivals("oracle", trace, spec, r)
    assert o is not None
    assert (o.policy, o.requests, o.cached_tokens) == ("oracle @ kvmesh's arrivals", 6, 0)
    assert o.extra["arrivals_moved"] == sum(1 for a in r.arrivals_ms if a != 0)
    assert o.extra["max_moved_ms"] == r.arrivals_ms[-1]
    assert max(o.ttft_s) == pytest.approx(prefill)  # in process: no routing delay, and nobody queues


def test_no_oracle_row_when_no_arrival_moved() -> None:
    trace = [
        TraceRequest(timestamp_ms=t, input_length=512, output_length=2, hash_ids=(t,)) for t in (0, 250, 900)
    ]
    spec = bench_trace.FleetSpec(workers=2, num_blocks=64)
    on_time = bench_trace.PolicyResult(policy="kvmesh", arrivals_ms=[0, 250, 900])
    assert bench_trace.on_arrivals("oracle", trace, spec, on_time) is None
    moved = bench_trace.PolicyResult(policy="kvmesh", arrivals_ms=[0, 300, 900])
    o = bench_trace.on_arrivals("kvmesh-exact", trace, spec, moved)
    assert o is not None
    assert (o.policy, o.requests, o.extra["arrivals_moved"], o.extra["max_moved_ms"]) == (
        "kvmesh-exact @ kvmesh's arrivals",
        3,
        1,
        50,
    )
