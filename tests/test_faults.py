"""Kill -9 each kind of component of a real fleet during traffic; at the end the index equals the engines' truth.

Every test starts the whole system as processes (`kvmesh.bench.fleet.Fleet`: a 3-node NATS cluster, an R3 events
stream and R3 buckets, 2 simulated engines of 2 ranks making up their own traffic, an ingest each, 2 indexers,
2 routers) and sends routes through `kvmesh.client.Router` all along. Once the stream holds traffic it kills
one component with SIGKILL, starts it again, lets the traffic end and waits until the stream is quiet and
every replica applied it all. Then:

(a) every indexer replica's digest equals the digest of an index built from what the engines published
    (their recorded batches, in engine order), and that truth matches the engines' final cache content;
(b) per (worker, dp_rank), stream order equals engine order (`kvmesh.bench.fleet.Fleet.stream_order`);
(c) every route was answered (a route that timed out is sent again, up to 20 s; an error answer fails);
(d) routes at rest (with ``explain``) give every candidate the overlap and cache size of the truth's index.

Run them with ``make test-faults`` (or ``pytest tests/test_faults.py``); about 30–40 s each.
"""

from __future__ import annotations

import asyncio
import functools
import operator
import random
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench.fleet import (
    BS,
    ENGINES,
    MODEL,
    Fleet,
    Routes,
    Truth,
    all_peers_current,
    conclude,
    connect_client,
    digest_report,
    route_loop,
    stream_messages,
    wait_for,
)
from kvmesh.client import Router
from kvmesh.sim.traffic import prompt

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.nats,
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.timeout(240),
]

LEADER_KILLS = 2
"""Stream leader kills per test (each re-orders a rank's batches in some runs only)."""


async def _inject(fleet: Fleet, js: Any, kind: str) -> str:
    """Kill one component of ``kind`` with SIGKILL, keep it down a moment, start it again; say what was done."""
    if kind != "stream_leader":
        return await fleet.kill_and_restart(kind, js)
    killed = []
    for round_ in range(LEADER_KILLS):
        if round_:  # the next kill comes once the restarted node caught up, with more traffic in between
            await wait_for(all_peers_current(js), bool, timeout_s=30, what="every stream replica current")
            floor = await stream_messages(js) + 150
            await wait_for(
                lambda: stream_messages(js),
                functools.partial(operator.le, floor),
                timeout_s=30,
                what=f"{floor} messages in the stream",
            )
            assert not fleet.engines_done(), "the traffic ended before the next leader kill"
        killed.append(await fleet.kill_and_restart(kind, js))
    return "; ".join(killed)


async def _route_mismatches(client: Router, truth: Truth, n: int = 20) -> list[str]:
    """Route ``n`` prompts of the traffic mix with ``explain``; list every candidate whose overlap or cache size
    differs from the truth's index."""
    rng = random.Random(11)
    out = []
    overlaps = 0
    for i in range(n):
        tokens = prompt(rng, BS, seed=rng.randrange(ENGINES))
        want = {
            (c.worker_id, c.dp_rank): (c.overlap_blocks, c.cached_blocks)
            for c in truth.state.match(MODEL, tokens).candidates
        }
        overlaps += sum(o for o, _ in want.values())
        reply = await client.route(MODEL, tokens, explain=True)
        got = {(s.worker_id, s.dp_rank): (s.overlap_blocks, s.cached_blocks) for s in reply.scores or []}
        if got != want:
            out.append(
                f"prompt {i} (index seq {reply.index_seq}): (overlap, cached) router {got}, truth {want}"
            )
    return out


async def _run(tmp_path: Path, kind: str) -> None:
    fleet = Fleet(tmp_path, traffic_s=30.0 if kind == "stream_leader" else 20.0)
    nc = None
    try:
        await fleet.start()
        nc = await connect_client(fleet.cluster.url(0))
        js = nc.jetstream()
        client = Router(nc, timeout_s=2.0)
        await fleet.until_ready(nc, client)
        stop = asyncio.Event()
        routes = Routes()
        router_task = asyncio.create_task(route_loop(client, stop, routes))
        await wait_for(
            lambda: stream_messages(js), lambda n: n >= 150, timeout_s=30, what="traffic in the stream"
        )
        assert not fleet.engines_done(), "the traffic ended before the fault: the fleet started too slowly"
        done = await _inject(fleet, js, kind)
        check = await conclude(fleet, nc, routes, stop, router_task)
        assert check.dead == [], "a process died:\n" + "\n".join(check.dead)
        truth = check.truth
        context = f"{done}; {check.context(routes)}"
        assert truth.problems() == [], f"the simulator's events do not describe its pools: {truth.problems()}"
        # (a) digests and (b) stream order; (c) every route answered
        failures = [*check.lost, *check.unanswered]
        # (d) routes at rest see the engines' truth: every candidate's overlap and cache size
        mismatches = await _route_mismatches(client, truth)
        if mismatches:
            failures.append("(d) routes at rest != the engines' truth:\n" + "\n".join(mismatches[:20]))
        print(context + "\n" + digest_report(check.replicas, truth))
        assert failures == [], "\n".join(failures) + f"\n{context}"
    except BaseException:
        print(fleet.logs_tail())
        raise
    finally:
        if nc is not None:
            await nc.close()
        fleet.stop()


@pytest.mark.parametrize(
    "kind",
    ["ingest", "indexer", "router", "engine", "stream_leader"],
)
async def test_kill_during_traffic_index_equals_engines_truth(tmp_path: Path, kind: str) -> None:
    """After a kill -9 of one component during traffic, every replica's digest equals the engines' truth, per-rank stream order equals engine order, and every route is answered."""
    await _run(tmp_path, kind)


async def test_ingest_started_while_the_stream_has_no_leader_comes_up_when_it_gets_one(
    tmp_path: Path,
) -> None:
    """An ingest started while the R3 stream has lost its quorum waits, and recovers its cursors once the nodes are back."""
    fleet = Fleet(tmp_path)
    nc = None
    try:
        for i in range(3):
            fleet.cluster.start(i)
        await fleet.until_js_ready()
        await fleet.provision_stream()
        fleet.cluster.kill(1)
        fleet.cluster.kill(2)  # no quorum: the stream has no leader, JetStream requests time out
        ingest = fleet.add_ingest("q0-0", fleet.engine_ports[0], 0).start()
        await asyncio.sleep(8.0)  # the outage outlasts a JetStream API request's timeout (5 s)
        fleet.cluster.start(1)
        fleet.cluster.start(2)
        nc = await connect_client(fleet.cluster.url(0))
        await fleet.until_ingests_ready(nc)
        assert ingest.alive
    finally:
        if nc is not None:
            await nc.close()
        fleet.stop()
