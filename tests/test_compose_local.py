"""docker-compose.yml run as local processes (`kvmesh.deploy.compose.LocalStack`): TLS and NKey users on.

One stack for the module: the 3 NATS nodes of deploy/nats/cluster.conf with fresh credentials (`kvmesh
gen-creds`), provision at R3, sim-0/ingest-0 and sim-1/ingest-1, 2 indexers, 2 routers and the route example,
each with its compose command, environment and only its own secrets (the simulated engines' self-made traffic
shortened to `TRAFFIC_S` through the environment). The tests run in file order: the first kills a NATS node
while the engines' traffic runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvmesh.bench.fleet import wait_for
from kvmesh.client import Router
from kvmesh.deploy.compose import ComposeError, LocalStack, _lock_root
from kvmesh.runtime import subjects
from kvmesh.runtime.config import NatsAuth
from kvmesh.runtime.nats import connect, connect_options
from kvmesh.sim.traffic import prompt

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.nats,
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(180),
]

ROOT = Path(__file__).resolve().parent.parent
TRAFFIC_S = 30
"""Seconds of self-made traffic per simulated engine (the compose file's 120, shortened)."""
BS = 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The compose services up as local processes, with credentials made for them."""
    root = tmp_path_factory.mktemp("compose")
    s = LocalStack(
        ROOT / "docker-compose.yml",
        root,
        secrets_dir=root / "secrets",
        extra_env={"KVMESH_SIM_TRAFFIC_S": str(TRAFFIC_S)},
        timeout_s=90.0,
    )
    try:
        s.up()
        yield s
    finally:
        s.stop()


def _auth(env: dict[str, str]) -> tuple[str, NatsAuth]:
    """A service's NATS URL and credentials, from its local environment."""
    return env["KVMESH_NATS_URL"], NatsAuth(
        nats_nkey_seed_file=env["KVMESH_NATS_NKEY_SEED_FILE"],
        nats_tls_ca_file=env["KVMESH_NATS_TLS_CA_FILE"],
        nats_inbox_prefix=env["KVMESH_NATS_INBOX_PREFIX"],
    )


async def _connect(env: dict[str, str], name: str) -> Any:
    url, auth = _auth(env)
    return await connect(url, name=name, wait_s=10.0, **connect_options(auth))


def _operator(stack: LocalStack, *args: str) -> dict[str, Any]:
    """Run an operator command (``kvmesh status``, ``kvmesh replay``) with the operator's credentials."""
    env = {**stack.env("provision"), **stack.operator_env()}
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def _traffic_done(stack: LocalStack) -> list[str]:
    return [n for n in ("sim-0", "sim-1") if "traffic done" in (stack.logs / f"{n}.log").read_text()]


def test_kvmesh_cluster_once_prints_urls_route_answer_and_status(tmp_path: Path) -> None:
    """kvmesh cluster --once makes the credentials, brings the compose services up, prints the NATS URLs, the route example's answer, how to run kvmesh status and the status, and stops everything (exit 0)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "cluster",
            "--once",
            "--root",
            str(tmp_path / "root"),
            "--secrets",
            str(tmp_path / "secrets"),
            "--env",
            "KVMESH_SIM_TRAFFIC_S=5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "secrets" / "auth.conf").is_file()
    head, hint, rest = done.stdout.partition("kvmesh status against it (operator credentials):\n")
    assert hint, done.stdout
    for i in (1, 2, 3):
        assert re.search(
            rf"^  nats-{i} +tls://127\.0\.0\.1:\d+  monitoring http://127\.0\.0\.1:\d+$", head, re.M
        )
    for name in ("sim-0", "ingest-0", "sim-1", "ingest-1", "indexer-0", "indexer-1", "router-0", "router-1"):
        assert re.search(rf"^  {name} +pid \d+  kvmesh ", head, re.M), name
    route = json.loads(head.partition("route (exit 0):\n")[2])
    assert route["worker_id"] in ("sim-0", "sim-1")
    command_line, _, status_text = rest.partition("\n")
    kvmesh = shutil.which("kvmesh") or str(Path(sys.executable).with_name("kvmesh"))
    assert command_line.strip().endswith(f" {kvmesh} status")  # pastes into a shell without the venv
    assert "KVMESH_NATS_NKEY_SEED_FILE=" in command_line and "operator.nk" in command_line
    status = json.loads(status_text)
    assert sorted(r["replica"] for r in status["replicas"]) == ["indexer-0", "indexer-1"]
    assert status["convergence"]["converged"] is True
    for seed in (tmp_path / "secrets").glob("*.nk"):
        assert seed.read_text().strip() not in done.stdout + done.stderr
    assert {p.name for p in (tmp_path / "root" / "logs").glob("*.log")} >= {
        "provision.log",
        "route.log",
        "router-0.log",
    }


async def test_nats_node_killed_mid_traffic_loses_nothing(stack: LocalStack) -> None:
    """The stream leader's node killed -9 during the engines' traffic and restarted: at rest every indexer replica's digest equals an offline kvmesh replay of the stream, and kvmesh status calls every replica converged."""
    assert stack.nodes is not None
    nc = await _connect(stack.operator_env(), "compose-test-operator")
    try:
        js = nc.jetstream()

        async def messages() -> int:
            return int((await js.stream_info(subjects.STREAM)).state.messages)

        await wait_for(messages, lambda n: n >= 20, timeout_s=30, what="traffic in the stream")
        assert _traffic_done(stack) == [], "the traffic ended before the kill: the stack came up too slowly"
        info = await js.stream_info(subjects.STREAM)
        assert info.cluster is not None and info.cluster.leader is not None
        assert (info.config.num_replicas, len(info.cluster.replicas or [])) == (3, 2)
        node = stack.nodes.names.index(info.cluster.leader)
        stack.nodes.kill(node)
        await asyncio.sleep(3.0)
        stack.nodes.start_node(node)
        await wait_for(
            lambda: asyncio.sleep(0, _traffic_done(stack)),
            lambda done: len(done) == 2,
            timeout_s=TRAFFIC_S + 30,
            what="both engines' traffic done",
        )
    finally:
        await nc.close()

    previous: list[int] = [-1]

    async def settled() -> dict[str, Any]:
        status = await asyncio.to_thread(_operator, stack, "status", "--json", "--wait-s", "1.0")
        last = status["stream"]["last_seq"]
        status["_stable"] = last == previous[0]
        previous[0] = last
        return status

    status = await wait_for(
        settled,
        lambda s: s["_stable"] and s["convergence"]["converged"],
        timeout_s=60,
        what="a quiet stream that every replica applied",
    )
    replay = await asyncio.to_thread(_operator, stack, "replay")
    conv = status["convergence"]
    last = status["stream"]["last_seq"]
    assert (conv["indexers"], conv["routers"], conv["behind"]) == (2, 2, [])
    assert conv["digests"] == [replay["digest"]]
    assert (replay["applied_seq"], replay["complete"], replay["decode_errors"]) == (last, True, 0)
    assert [(r["replica"], r["applied_seq"], r["digest"], r["complete"]) for r in status["replicas"]] == [
        ("indexer-0", last, replay["digest"], True),
        ("indexer-1", last, replay["digest"], True),
    ]
    assert sorted(status["workers"]) == ["sim-0", "sim-1"]
    assert stack.dead() == []


async def _route_until_cached(stack: LocalStack, tokens: list[int], cached: int) -> Any:
    """Route ``tokens`` with the client's credentials (the route example's) until ``cached`` tokens show."""
    url, auth = _auth(stack.env("route"))
    async with await Router.connect(url, auth=auth) as router:
        return await wait_for(
            lambda: router.route("sim-model", tokens),
            lambda r: r.cached_tokens == cached,
            timeout_s=30,
            what=f"a route that sees {cached} cached tokens",
        )


async def test_sim_0_first_own_request_routes_back_to_it_exactly(stack: LocalStack) -> None:
    """The first prompt sim-0 made up itself (traffic seed 0) is routed, with the client's credentials, to sim-0 with every full block cached, mode exact."""
    tokens = prompt(random.Random("0:sim-0:0"), BS, seed=0)  # what kvmesh.sim.traffic.drive serves first
    full = len(tokens) // BS
    reply = await _route_until_cached(stack, tokens, full * BS)
    assert (reply.worker_id, reply.dp_rank, reply.overlap_blocks, reply.cached_tokens) == (
        "sim-0",
        0,
        full,
        full * BS,
    )
    assert (reply.block_size, reply.mode) == (BS, "exact")


async def test_a_prompt_sent_to_sim_0_routes_back_to_it_exactly(stack: LocalStack) -> None:
    """A prompt served by sim-0 through its NATS generate endpoint (sim credentials) is routed with the client's credentials to sim-0 with all its full blocks cached, mode exact."""
    tokens = [100_000 + k for k in range(5 * BS + 7)]  # 5 full blocks and a partial one
    nc = await _connect(stack.env("sim-0"), "compose-test-sim")
    try:
        msg = await nc.request(
            subjects.sim_subject("sim-0"),
            msgspec.msgpack.encode({"token_ids": tokens, "output_length": 0}),
            timeout=10,
        )
        served = msgspec.msgpack.decode(msg.data)
        assert (served["worker_id"], served["cached_tokens"], served["prompt_tokens"]) == (
            "sim-0",
            0,
            len(tokens),
        )
    finally:
        await nc.close()
    reply = await _route_until_cached(stack, tokens, 5 * BS)
    assert (reply.worker_id, reply.dp_rank, reply.overlap_blocks, reply.cached_tokens) == ("sim-0", 0, 5, 80)
    assert (reply.block_size, reply.mode) == (BS, "exact")


def test_route_example_answers_from_sim_0(stack: LocalStack) -> None:
    """The compose file's route example exited 0 with a reply at start; run again once the traffic is in, it routes sim-0's first system prompt to sim-0 with its 3 blocks cached."""
    first = stack.results["route"]
    assert first.returncode == 0, first.output
    assert json.loads(first.output)["worker_id"] in ("sim-0", "sim-1")
    again = stack.run_oneshot("route")
    assert again.returncode == 0, again.output
    reply = json.loads(again.output)
    assert (reply["worker_id"], reply["overlap_blocks"], reply["cached_tokens"], reply["mode"]) == (
        "sim-0",
        3,
        48,
        "exact",
    )
    assert [(s["worker_id"], s["overlap_blocks"]) for s in reply["scores"]] == [("sim-0", 3), ("sim-1", 0)]


def test_each_service_gets_only_its_own_secrets_and_needs_no_more(stack: LocalStack) -> None:
    """Each local service's /run/secrets holds exactly what the compose file grants it, and no service's NATS user was refused anything (no permissions violation in any node's log)."""
    for name in ("provision", "sim-0", "ingest-0", "ingest-1", "indexer-0", "router-1", "route"):
        got = sorted(p.name for p in (stack.root / "run" / name / "secrets").iterdir())
        assert got == sorted(stack.services[name].secrets), name
        assert len(got) == 2 and "ca.pem" in got
    assert stack.nodes is not None
    violations = [v for v in stack.nodes.violations() if "compose-test-" not in v]
    assert violations == [], "a service did something its role may not:\n" + "\n".join(violations)


def test_a_root_is_held_by_one_kvmesh_cluster_at_a_time(tmp_path: Path) -> None:
    """A second run on the same --root is refused naming the first's pid (their NATS stores would corrupt
    each other); once the first lets go, the root is free again."""
    first = _lock_root(tmp_path)
    with pytest.raises(ComposeError) as info:
        _lock_root(tmp_path)
    assert str(info.value) == (
        f"another kvmesh cluster (pid {os.getpid()}) uses {tmp_path}: give another --root, or stop that one"
    )
    first.close()
    _lock_root(tmp_path).close()


def test_container_tmp_paths_are_made_local_inside_arguments(stack: LocalStack) -> None:
    """/tmp/ is the container's own wherever it stands: alone, after '=', in a shell command."""
    tmp = stack.root / "run" / "router-0" / "tmp"
    assert stack._rewrite("/tmp/kvmesh.health", "router-0") == f"{tmp}/kvmesh.health"
    assert stack._rewrite("--health-file=/tmp/h", "router-0") == f"--health-file={tmp}/h"
    assert stack._rewrite("kvmesh health --file /tmp/h", "router-0") == f"kvmesh health --file {tmp}/h"
    assert stack._rewrite("/var/tmp/h", "router-0") == "/var/tmp/h"


def test_a_child_started_by_kvmesh_cluster_dies_with_it(tmp_path: Path) -> None:
    """A process started through die_with_parent gets SIGTERM when its parent is killed -9, so nothing
    outlives a killed kvmesh cluster."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "from kvmesh.deploy.nodes import die_with_parent\n"
            "p = subprocess.Popen(die_with_parent(['sleep', '60']))\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(60)\n",
        ]
    )
    try:
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        child = int(pid_file.read_text())
        time.sleep(0.3)  # the stub has exec'd sleep
        assert Path(f"/proc/{child}/comm").read_text().strip() == "sleep"
        parent.kill()
        parent.wait(10)
        for _ in range(100):
            if (
                not Path(f"/proc/{child}").exists()
                or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
            ):
                break
            time.sleep(0.05)
        gone = (
            not Path(f"/proc/{child}").exists() or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
        )
        assert gone
    finally:
        parent.kill()
