"""Kill -9 each kind of component of a real fleet during traffic; at the end the index equals the engines' truth.

Every test starts the whole system as processes (`tests.faults.Fleet`: a 3-node NATS cluster, an R3 events
stream and R3 buckets, 2 simulated engines of 2 ranks making up their own traffic, an ingest each, 2 indexers,
2 routers) and sends routes through `kvmesh.client.Router` all along. Once the stream holds traffic it kills
one component with SIGKILL, starts it again, lets the traffic end and waits until the stream is quiet and
every replica applied it all. Then:

(a) every indexer replica's digest equals the digest of an index built from what the engines published
    (their recorded batches, in engine order), and that truth matches the engines' final cache content;
(b) per (worker, dp_rank), stream order equals engine order (`tests.faults.Fleet.stream_order`);
(c) every route was answered (a route that timed out is sent again, up to 20 s; an error answer fails);
(d) routes at rest (with ``explain``) give every candidate the overlap and cache size of the truth's index.

Run them with ``make test-faults`` (or ``pytest tests/test_faults.py``); about 30–40 s each.
"""

from __future__ import annotations

import asyncio
import functools
import operator
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tests.faults import BS, ENGINES, MODEL, Fleet, Truth, connect_client, wait_for

from kvmesh.client import RouteError, Router, UnavailableError
from kvmesh.runtime import subjects
from kvmesh.sim.traffic import prompt

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.nats,
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.timeout(240),
]

DOWN_S = 1.5
"""How long a killed process stays down."""
NODE_DOWN_S = 3.0
"""How long a killed NATS node stays down."""
ROUTE_DEADLINE_S = 20.0
LEADER_KILLS = 2
"""Stream leader kills per test (each re-orders a rank's batches in some runs only)."""


@dataclass
class Routes:
    """Routes sent during a test and how they ended."""

    sent: int = 0
    answered: int = 0
    retries: int = 0
    failures: list[str] = field(default_factory=list)


async def _route_loop(client: Router, stop: asyncio.Event, routes: Routes) -> None:
    """Route prompts of the engines' own mix until ``stop``; retry a timed-out route until its deadline."""
    loop = asyncio.get_running_loop()
    rng = random.Random(7)
    while not stop.is_set():
        tokens = prompt(rng, BS, seed=rng.randrange(ENGINES))
        routes.sent += 1
        deadline = loop.time() + ROUTE_DEADLINE_S
        while True:
            try:
                await client.route(MODEL, tokens, request_id=f"faults-{routes.sent}")
                routes.answered += 1
                break
            except UnavailableError as exc:
                if loop.time() > deadline:
                    routes.failures.append(f"route {routes.sent}: no answer in {ROUTE_DEADLINE_S} s ({exc})")
                    break
                routes.retries += 1
            except RouteError as exc:
                routes.failures.append(f"route {routes.sent}: {type(exc).__name__}: {exc}")
                break
        await asyncio.sleep(0.05)


async def _stream_messages(js: Any) -> int:
    return int((await js.stream_info(subjects.STREAM)).state.messages)


def _all_peers_current(js: Any) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        info = await js.stream_info(subjects.STREAM)
        peers = info.cluster.replicas or [] if info.cluster is not None else []
        return (
            info.cluster is not None
            and info.cluster.leader is not None
            and len(peers) == 2
            and all(p.current and not p.offline for p in peers)
        )

    return probe


async def _inject(fleet: Fleet, js: Any, kind: str) -> str:
    """Kill one component of ``kind`` with SIGKILL, keep it down a moment, start it again; say what was done."""
    if kind == "stream_leader":
        killed = []
        for round_ in range(LEADER_KILLS):
            if round_:  # the next kill comes once the restarted node caught up, with more traffic in between
                await wait_for(
                    _all_peers_current(js), bool, timeout_s=30, what="every stream replica current"
                )
                floor = await _stream_messages(js) + 150
                await wait_for(
                    lambda: _stream_messages(js),
                    functools.partial(operator.le, floor),
                    timeout_s=30,
                    what=f"{floor} messages in the stream",
                )
                assert not fleet.engines_done(), "the traffic ended before the next leader kill"
            node = await fleet.stream_leader(js)
            fleet.cluster.kill(node)
            await asyncio.sleep(NODE_DOWN_S)
            fleet.cluster.start(node)
            killed.append(f"n{node}")
        return f"killed the stream leader {LEADER_KILLS} times ({', '.join(killed)}), {NODE_DOWN_S} s each"
    procs = {
        "ingest": fleet.ingests,
        "indexer": fleet.indexers,
        "router": fleet.routers,
        "engine": fleet.engines,
    }
    proc = procs[kind][0]
    proc.kill()
    await asyncio.sleep(DOWN_S)
    if kind == "engine":
        fleet.restart_engine(0)
    else:
        proc.start()
    return f"killed {proc.name} for {DOWN_S} s"


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
        got = {
            (s["worker_id"], s["dp_rank"]): (s["overlap_blocks"], s["cached_blocks"])
            for s in reply.scores or []
        }
        if got != want:
            out.append(
                f"prompt {i} (index seq {reply.index_seq}): (overlap, cached) router {got}, truth {want}"
            )
    return out


def _digest_report(reps: list[dict[str, Any]], truth: Truth) -> str:
    lines = [
        f"truth digest {truth.state.digest():016x}, {truth.state.block_total()} blocks, {truth.batches} batches"
    ]
    blocks = {w: info["blocks"] for w, info in truth.state.workers().items()}
    lines.append(f"truth blocks per worker {blocks}")
    for r in reps:
        per_worker = {w: info.get("blocks") for w, info in (r.get("workers") or {}).items()}
        lines.append(f"replica {r.get('replica')}: blocks per worker {per_worker}")
        lines.append(
            f"replica {r.get('replica')}: digest {r.get('digest')}, {r.get('blocks')} blocks, applied "
            f"{r.get('applied_seq')}, complete {r.get('complete')}, incomplete {r.get('incomplete')}, "
            f"counters {r.get('counters')}"
        )
    return "\n".join(lines)


async def _run(tmp_path: Path, kind: str) -> None:
    fleet = Fleet(tmp_path, traffic_s=30.0 if kind == "stream_leader" else 20.0)
    nc = None
    try:
        await fleet.start()
        nc = await connect_client(fleet.cluster.url(0))
        js = nc.jetstream()
        client = Router(nc, timeout_s=2.0)
        await wait_for(
            lambda: fleet.replicas(nc),
            lambda r: (len(r) == 2 and all(x.get("ready") for x in r)) or bool(fleet.dead()),
            timeout_s=60,
            what="two ready indexer replicas",
        )
        await wait_for(
            lambda: fleet.routers_status(nc),
            lambda r: len(r) == 2 or bool(fleet.dead()),
            timeout_s=60,
            what="two routers",
        )
        await fleet.until_ingests_ready(nc)
        await wait_for(
            lambda: client.route(MODEL, list(range(3 * BS))),
            lambda r: True,
            timeout_s=60,
            what="a first route",
        )
        stop = asyncio.Event()
        routes = Routes()
        router_task = asyncio.create_task(_route_loop(client, stop, routes))
        await wait_for(
            lambda: _stream_messages(js), lambda n: n >= 150, timeout_s=30, what="traffic in the stream"
        )
        assert not fleet.engines_done(), "the traffic ended before the fault: the fleet started too slowly"
        done = await _inject(fleet, js, kind)
        last, reps = await fleet.quiesce(nc)
        stop.set()
        await router_task
        routers = await wait_for(
            lambda: fleet.routers_status(nc),
            lambda rs: len(rs) == 2 and all(r.get("applied_seq") == last for r in rs),
            timeout_s=30,
            what=f"both routers' local index at stream seq {last}",
        )
        assert fleet.dead() == [], "a process died:\n" + "\n".join(fleet.dead())
        truth = fleet.truth()
        order = await fleet.stream_order(nc, truth)

        context = (
            f"{done}; stream last seq {last}, {order.messages} messages; resyncs {order.resyncs}; "
            f"routes sent {routes.sent}, answered {routes.answered}, retried {routes.retries}; "
            f"routers {[(r.get('id'), r.get('applied_seq'), r.get('blocks')) for r in routers]}"
        )
        assert truth.problems() == [], f"the simulator's events do not describe its pools: {truth.problems()}"
        failures = []
        # (a) every replica's digest equals the engines' truth, and no replica calls itself incomplete
        want = f"{truth.state.digest():016x}"
        if [r.get("digest") for r in reps] != [want, want] or [r.get("complete") for r in reps] != [
            True,
            True,
        ]:
            failures.append("(a) replica digests != the engines' truth:\n" + _digest_report(reps, truth))
        # (b) per-rank stream order equals engine order
        if order.violations:
            failures.append("(b) stream order != engine order:\n" + "\n".join(order.violations))
        # (d) routes at rest see the engines' truth: every candidate's overlap and cache size
        mismatches = await _route_mismatches(client, truth)
        if mismatches:
            failures.append("(d) routes at rest != the engines' truth:\n" + "\n".join(mismatches[:20]))
        # (c) every route answered
        if routes.failures or routes.answered != routes.sent or routes.sent == 0:
            failures.append("(c) routes not answered:\n" + "\n".join(routes.failures[:20]))
        print(context + "\n" + _digest_report(reps, truth))
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
