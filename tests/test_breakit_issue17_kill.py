"""Killed processes around session affinity and workers without KV events, on a real nats-server: two
``python -m kvmesh.router`` replicas and two ``python -m kvmesh.ingest --no-kv-events`` processes (a stand-in
indexer answers the match queries: it knows no model, as with engines that publish no events).

* a router replica killed with SIGKILL while routes with sessions flow, then restarted, gets the sessions
  and the predicted caches' owners back from its peer (sync): its first answer for a known session keeps it;
* an event-less ingest killed with SIGKILL leaves the registry after its TTL and is routed to no more; once
  restarted it is routed to again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvmesh.client import NoWorkersError, Router
from kvmesh.core import protocol
from kvmesh.core.protocol import error_reply
from kvmesh.runtime.nats import connect

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parent.parent
BS = 16
MODEL = "noev"


class Procs:
    def __init__(self, nats_url: str, uid: str, tmp: Path) -> None:
        self.url, self.uid, self.tmp = nats_url, uid, tmp
        self.stream = f"KVMESH_K17_{uid}"
        self.routers: dict[int, subprocess.Popen[bytes]] = {}
        self.ingests: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
        with (self.tmp / f"{name}.log").open("ab") as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def router(self, i: int) -> None:
        u = self.uid
        self.routers[i] = self._spawn(f"router{i}", [
            sys.executable, "-m", "kvmesh.router", "--nats-url", self.url, "--index", "remote",
            "--route-subject", f"t{u}.route.{i}", "--match-subject", f"t{u}.match",
            "--requests-prefix", f"t{u}.requests", "--load-prefix", f"t{u}.load", "--stream", self.stream,
            "--use-registry", "--sync-timeout-s", "2", "--log-format", "json",
        ])  # fmt: skip

    def ingest(self, w: str) -> None:
        self.ingests[w] = self._spawn(f"ingest-{w}", [
            sys.executable, "-m", "kvmesh.ingest", "--no-kv-events", "--worker-id", w, "--model", MODEL,
            "--block-size", str(BS), "--kv-capacity-blocks", "64", "--nats-url", self.url,
            "--stream", self.stream, "--events-prefix", f"t{self.uid}.events", "--stream-memory",
            "--worker-ttl-s", "1.5", "--log-format", "json",
        ])  # fmt: skip

    def kill(self, p: subprocess.Popen[bytes]) -> None:
        p.send_signal(signal.SIGKILL)
        p.wait(10)

    def stop(self) -> None:
        for p in [*self.routers.values(), *self.ingests.values()]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [*self.routers.values(), *self.ingests.values()]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@contextlib.asynccontextmanager
async def procs(nats_url: str, uid: str, tmp: Path) -> AsyncIterator[tuple[Procs, Any]]:
    nc = await connect(nats_url, name="test-k17")

    async def on_match(msg: Any) -> None:  # no model known to the index
        await msg.respond(protocol.encode(error_reply("unknown_model", "no such model"), format="msgpack"))

    await nc.subscribe(f"t{uid}.match", cb=on_match)
    p = Procs(nats_url, uid, tmp)
    try:
        yield p, nc
    finally:
        p.stop()
        await nc.close()


def client(nc: Any, uid: str, i: int) -> Router:
    return Router(nc, subject=f"t{uid}.route.{i}", timeout_s=3.0, requests_prefix=f"t{uid}.requests")


async def route_ok(r: Router, tokens: list[int], timeout_s: float = 30.0, **kw: Any) -> protocol.RouteReply:
    """Route until an answer comes (the processes start meanwhile)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return await r.route(MODEL, tokens, **kw)
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_a_killed_router_gets_its_sessions_back_from_a_peer(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    async with procs(nats_url, uid, tmp_path) as (p, nc):
        for w in ("x", "y"):
            p.ingest(w)
        for i in (0, 1):
            p.router(i)
        c0, c1 = client(nc, uid, 0), client(nc, uid, 1)
        # both workers registered on both replicas
        for c in (c0, c1):
            await route_ok(c, list(range(16)), candidates=["x"])
            await route_ok(c, list(range(16)), candidates=["y"])
        where: dict[str, str] = {}
        for i in range(40):
            prompt = list(range(i * 1000, i * 1000 + 64))
            rep = await (c0 if i % 2 else c1).route(MODEL, prompt, session_id=f"s-{i}", request_id=f"r-{i}")
            where[f"s-{i}"] = rep.worker_id
        p.kill(p.routers[1])
        p.router(1)
        # the restarted replica knows every session: a later request of each (a new prompt, a slack of a
        # whole prompt) stays where the session was
        for i in range(40):
            prompt = list(range(i * 1000 + 500, i * 1000 + 564))
            rep = await route_ok(c1, prompt, session_id=f"s-{i}", policy={"session_slack": 1.0})
            assert (rep.worker_id, rep.session) == (where[f"s-{i}"], "kept")


async def test_a_killed_event_less_ingest_leaves_and_comes_back(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    async with procs(nats_url, uid, tmp_path) as (p, nc):
        for w in ("x", "y"):
            p.ingest(w)
        p.router(0)
        c0 = client(nc, uid, 0)
        await route_ok(c0, list(range(16)), candidates=["x"])
        await route_ok(c0, list(range(16)), candidates=["y"])
        p.kill(p.ingests["y"])
        # within the TTL (1.5 s) and a little more, y is no candidate
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while True:
            try:
                await c0.route(MODEL, list(range(16)), candidates=["y"])
            except NoWorkersError:
                break
            assert loop.time() < deadline, "y still routed to after its ingest was killed"
            await asyncio.sleep(0.2)
        for i in range(10):
            assert (await c0.route(MODEL, list(range(i * 100, i * 100 + 32)))).worker_id == "x"
        p.ingest("y")
        back = await route_ok(c0, list(range(16)), candidates=["y"])
        assert back.worker_id == "y"
