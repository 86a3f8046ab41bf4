"""A whole kvmesh fleet as real OS processes on a 3-node NATS cluster, with kill -9 and the engines' truth.

The harness behind the fault suite (``tests/test_faults.py``), ``kvmesh bench soak`` and
``kvmesh up --cluster 3 --chaos`` (`kvmesh.bench.soak`).

`Fleet` starts, each as its own process: three clustered ``nats-server`` nodes (JetStream, file storage, an
HTTP monitoring port each; `Cluster`), ``ENGINES`` simulated vLLM engines (``kvmesh sim``, one worker of
``RANKS`` data-parallel ranks each, making up their own traffic and recording every batch they publish), one
``kvmesh ingest`` per engine (R3 events stream, provisioned first by `Fleet.provision_stream`), two
``kvmesh indexer`` replicas (R3 buckets) and two ``kvmesh router`` replicas. Every process is a `Proc`:
``kill()`` is SIGKILL, ``start()`` starts it again with the same arguments (`Fleet.restart_engine` starts a
new engine incarnation with the traffic time left); `Cluster.kill`/`Cluster.start` do the same for a node,
on the same ports and store, and `Fleet.stream_leader` names the node that leads the events stream.
`Fleet.kill_and_restart` does one such fault by kind; `Fleet.dead` lists processes that exited.

The checks made at quiescence (`Fleet.quiesce`: every engine reported the end of its traffic, the stream
stopped growing, every replica applied all of it; `conclude` runs them all):

* `Fleet.truth` — the engines' truth: each engine rank's recorded batches (latest incarnation), decoded,
  normalized and applied in engine order to a fresh `IndexState`, and each rank's final cache content (its
  end-of-traffic report); `Truth.problems` says where the two disagree (then the simulator is wrong, not
  kvmesh);
* `Fleet.replicas` / `Fleet.routers_status` / `Fleet.ingests_status` — the services' status replies
  (an indexer's digest, applied sequence and completeness; a router's local index sequence);
* `Fleet.stream_order` — per (worker, dp_rank), the engine sequences of the stream's messages in stream
  order: within an epoch every engine batch must follow the previous one (seq + 1) unless an ingest resync
  (a Cleared it made) came in between, an epoch starts at engine seq 0, every engine rank is in the stream,
  and the last epoch ends at the engine's last batch.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import nats.js.api

from kvmesh.client import RouteError, Router, UnavailableError
from kvmesh.core.events import Cleared, EventsMessage, Removed, Stored, decode_message
from kvmesh.core.index import Holder
from kvmesh.core.normalize import Normalizer
from kvmesh.core.state import IndexState
from kvmesh.core.wire import decode_batch
from kvmesh.harness.ports import free_block, free_port
from kvmesh.harness.server import NatsServer
from kvmesh.ops import gather_status
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import StreamSettings, connect, ensure_stream
from kvmesh.sim.publisher import read_record
from kvmesh.sim.traffic import prompt

MODEL = "fault-model"
BS = 16
ENGINES = 2
RANKS = 2
NODES = 3
DOWN_S = 1.5
"""How long a killed process stays down."""
NODE_DOWN_S = 3.0
"""How long a killed NATS node stays down."""
ROUTE_DEADLINE_S = 20.0
"""How long a route that timed out is sent again before it counts as not answered."""
KINDS = ("ingest", "indexer", "router", "engine", "nats", "stream_leader")
"""What `Fleet.kill_and_restart` can kill: a process kind, a random NATS node, or the events stream's leader."""

T = TypeVar("T")


async def wait_for(
    probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool], *, timeout_s: float, what: str
) -> T:
    """Poll ``probe`` until ``ok`` holds for its value; raise `AssertionError` naming ``what`` and the last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: Any = None
    while True:
        try:
            value = await probe()
        except Exception as exc:  # a probe may fail while the fleet starts or a node is down
            last = exc
        else:
            last = value
            if ok(value):
                return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last: {last!r}")
        await asyncio.sleep(0.2)


class Proc:
    """One kvmesh service as an OS process (own session), logging to ``<logs>/<name>.log``."""

    def __init__(self, name: str, argv: list[str], logs: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = logs / f"{name}.log"
        self.popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.starts = 0

    def start(self, argv: list[str] | None = None) -> Proc:
        """Start the process (again), with ``argv`` instead of the original arguments when given."""
        assert not self.alive, f"{self.name} is running"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed on kill/stop)
        self._log.write(f"----- start {self.starts} at {time.time():.3f}\n".encode())
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("KVMESH_NATS_URL", None)
        self.popen = subprocess.Popen(
            argv or self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.starts += 1
        return self

    @property
    def alive(self) -> bool:
        """Whether the process runs."""
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL the process and reap it."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait()
        self._close_log()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def tail(self, lines: int = 30) -> str:
        """Return the last lines of the log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Cluster:
    """``size`` nats-server processes with JetStream (file storage), routed to each other on loopback.

    A killed node restarts on the same client port, monitoring port and storage directory.
    """

    def __init__(self, root: Path, size: int = NODES) -> None:
        self.root = root
        self.cluster_ports = [free_port() for _ in range(size)]
        self.http_ports = [free_port() for _ in range(size)]
        self.ports = [0] * size
        self.servers: list[NatsServer | None] = [None] * size

    def start(self, i: int) -> None:
        """Start (or restart) node ``i``."""
        routes = ",".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(self.cluster_ports) if j != i)
        args = ["--cluster", f"nats://127.0.0.1:{self.cluster_ports[i]}", "--routes", routes]
        args += ["--cluster_name", "kvmesh-faults", "-m", str(self.http_ports[i])]
        server = NatsServer(port=self.ports[i], store_dir=self.root / f"n{i}", args=args, name=f"n{i}")
        server.start()
        self.ports[i] = server.port
        self.servers[i] = server

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``."""
        server = self.servers[i]
        assert server is not None
        server.kill()
        server.stop()
        self.servers[i] = None

    def url(self, i: int) -> str:
        """Client URL of node ``i``."""
        return f"nats://127.0.0.1:{self.ports[i]}"

    def varz(self, i: int, timeout_s: float = 1.0) -> dict[str, Any] | None:
        """Return node ``i``'s monitoring ``/varz`` document (blocking), or None when it is down or silent."""
        if self.servers[i] is None:
            return None
        try:
            url = f"http://127.0.0.1:{self.http_ports[i]}/varz"
            with urllib.request.urlopen(url, timeout=timeout_s) as reply:
                doc: dict[str, Any] = json.loads(reply.read())
        except (OSError, ValueError):
            return None
        return doc

    def pids(self) -> list[int]:
        """Process ids of the running nodes."""
        return [s.pid for s in self.servers if s is not None and s.pid is not None]

    def stop(self) -> None:
        """Stop every node."""
        for server in self.servers:
            if server is not None:
                server.stop()


@dataclass
class Truth:
    """What the engines published (latest incarnation of each rank) and what they cache at the end."""

    state: IndexState
    """A fresh index fed every recorded batch in engine order."""
    last_seq: dict[Holder, int]
    """Per (worker, dp_rank): the engine seq of its last recorded batch (-1: none)."""
    cached: dict[Holder, set[int]]
    """Per (worker, dp_rank): engine keys its pool caches at the end (its report)."""
    replayed: dict[Holder, set[int]]
    """Per (worker, dp_rank): engine keys held after replaying its events with store counts."""
    batches: int = 0

    def problems(self) -> list[str]:
        """Return every rank whose events do not describe its final cache (a simulator fault)."""
        out = []
        for holder, cached in sorted(self.cached.items()):
            got = self.replayed.get(holder, set())
            if got != cached:
                out.append(f"{_name(holder)}: events leave {len(got)} blocks, the pool caches {len(cached)}")
        return out


@dataclass
class Order:
    """Per-rank stream order against engine order (see the module docstring)."""

    messages: int = 0
    violations: list[str] = field(default_factory=list)
    resyncs: list[str] = field(default_factory=list)
    last: dict[Holder, tuple[int, int]] = field(default_factory=dict)
    """Per (worker, dp_rank): (epoch, last engine seq) at the stream's end."""


class Fleet:
    """The whole system as processes; see the module docstring.

    Args:
        root: a fresh directory (stores, logs, engine records).
        traffic_s: seconds of self-made traffic per engine incarnation.
        rps: requests per second per engine rank.
        num_blocks: KV blocks per engine rank (small, so evictions happen).
    """

    def __init__(
        self, root: Path, *, traffic_s: float = 20.0, rps: float = 15.0, num_blocks: int = 160
    ) -> None:
        self.root = root
        self.logs = root / "logs"
        self.records = root / "records"
        self.logs.mkdir(parents=True)
        self.records.mkdir()
        self.cluster = Cluster(root)
        self.traffic_s = traffic_s
        self.rps = rps
        self.num_blocks = num_blocks
        self.py = sys.executable
        self.engine_ports = [free_block(12) for _ in range(ENGINES)]
        self.traffic_end = 0.0
        self.engines: list[Proc] = []
        self.ingests: list[Proc] = []
        self.indexers: list[Proc] = []
        self.routers: list[Proc] = []

    # ------------------------------------------------------------------ processes

    def worker_id(self, i: int) -> str:
        """Worker id of engine ``i`` (the sim names it ``<prefix>0``)."""
        return f"e{i}-0"

    def _kvmesh(self, *args: str) -> list[str]:
        return [self.py, "-m", "kvmesh.cli", *args]

    def _engine_argv(self, i: int, traffic_s: float) -> list[str]:
        return self._kvmesh(
            "sim",
            "--workers=1",
            f"--worker-prefix=e{i}-",
            f"--base-port={self.engine_ports[i]}",
            f"--data-parallel-size={RANKS}",
            f"--num-blocks={self.num_blocks}",
            f"--block-size={BS}",
            f"--seed={100 * i}",
            f"--traffic-rps={self.rps}",
            f"--traffic-s={traffic_s:.2f}",
            f"--traffic-seed={i}",
            f"--record-dir={self.records}",
            f"--nats-url={self.cluster.url(i % NODES)}",
        )

    async def start(self, *, provision: bool = True) -> None:
        """Start the cluster, wait for its JetStream meta leader, then the ingests, the indexers and the routers.

        With ``provision`` the harness creates the R3 events stream first, as an operator would, and waits
        until it has a leader; without, the ingests create it as they start. The engines start first; their
        traffic begins once their ingest subscribed.
        """
        for i in range(NODES):
            self.cluster.start(i)
        await self.until_js_ready()
        if provision:
            await self.provision_stream()
        self.start_engines()  # engines first, as a deployment starts vLLM before its ingest
        for i in range(ENGINES):
            self.add_ingest(self.worker_id(i), self.engine_ports[i], i % NODES).start()
        for j in range(2):
            argv = self._kvmesh(
                "indexer",
                f"--replica-id=ix{j}",
                "--buckets-replicas=3",
                f"--nats-url={self.cluster.url(j % NODES)}",
            )
            self.indexers.append(Proc(f"indexer-{j}", argv, self.logs).start())
        for j in range(2):
            argv = self._kvmesh("router", f"--nats-url={self.cluster.url((j + 1) % NODES)}")
            self.routers.append(Proc(f"router-{j}", argv, self.logs).start())

    def add_ingest(self, worker_id: str, port: int, node: int) -> Proc:
        """Add (not start) an ingest of ``worker_id`` reading the engine on ``port`` (replay ``port + 10``)."""
        argv = self._kvmesh(
            "ingest",
            f"--worker-id={worker_id}",
            f"--model={MODEL}",
            f"--zmq-endpoint=tcp://127.0.0.1:{port}",
            f"--replay-endpoint=tcp://127.0.0.1:{port + 10}",
            f"--data-parallel-size={RANKS}",
            f"--block-size={BS}",
            "--stream-replicas=3",
            f"--nats-url={self.cluster.url(node)}",
        )
        proc = Proc(f"ingest-{len(self.ingests)}", argv, self.logs)
        self.ingests.append(proc)
        return proc

    async def until_ingests_ready(self, nc: Any, timeout_s: float = 60.0) -> None:
        """Wait until every ingest answers status with every rank's cursor recovered; fail if one died."""
        await wait_for(
            lambda: self.ingests_status(nc),
            lambda r: (
                (len(r) == len(self.ingests) and all(len(x.get("ranks") or {}) == RANKS for x in r))
                or bool(self.dead())
            ),
            timeout_s=timeout_s,
            what=f"{len(self.ingests)} ingests with their ranks' cursors recovered",
        )
        assert self.dead() == [], "a process died at start:\n" + "\n".join(self.dead())

    async def provision_stream(self, timeout_s: float = 30.0) -> None:
        """Create the R3 events stream with the ingest's settings and wait until it has a leader."""
        nc = await connect_client(self.cluster.url(0))
        try:
            js = nc.jetstream()
            await ensure_stream(js, StreamSettings(replicas=3))

            async def leader() -> str | None:
                info = await js.stream_info(subjects.STREAM)
                return None if info.cluster is None else info.cluster.leader

            await wait_for(leader, lambda name: name is not None, timeout_s=timeout_s, what="a stream leader")
        finally:
            await nc.close()

    async def until_js_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the cluster answers JetStream API requests (a meta leader is elected)."""
        nc = await connect_client(self.cluster.url(0))
        try:
            js = nc.jetstream()
            await wait_for(
                js.account_info, lambda _: True, timeout_s=timeout_s, what="a JetStream meta leader"
            )
        finally:
            await nc.close()

    def start_engines(self) -> None:
        """Start every engine with ``traffic_s`` of traffic."""
        self.traffic_end = time.monotonic() + self.traffic_s
        for i in range(ENGINES):
            self.engines.append(Proc(f"engine-{i}", self._engine_argv(i, self.traffic_s), self.logs).start())

    def restart_engine(self, i: int) -> None:
        """Start engine ``i`` again (a new incarnation) with the traffic time that is left (at least 2 s)."""
        left = max(2.0, self.traffic_end - time.monotonic())
        self.engines[i].start(self._engine_argv(i, left))

    def procs(self) -> list[Proc]:
        """Every kvmesh process."""
        return [*self.engines, *self.ingests, *self.indexers, *self.routers]

    def procs_by_kind(self) -> dict[str, list[Proc]]:
        """The kvmesh processes per kind: ``engine``, ``ingest``, ``indexer``, ``router``."""
        return {
            "engine": self.engines,
            "ingest": self.ingests,
            "indexer": self.indexers,
            "router": self.routers,
        }

    async def kill_and_restart(self, kind: str, js: Any, index: int = 0) -> str:
        """SIGKILL one component, keep it down a moment, start it again; return what was done.

        Args:
            kind: one of `KINDS`.
            js: a JetStream context (to find the stream leader and its replicas' state).
            index: which process of the kind (or which node for ``nats``).

        A process stays down `DOWN_S`, a node `NODE_DOWN_S`; a node is killed only once every stream replica
        is current, so one kill never takes the quorum away. A killed engine starts as a new incarnation.

        Raises:
            ValueError: an unknown kind.
            AssertionError: the stream's replicas did not all become current within 30 s.
        """
        if kind in ("nats", "stream_leader"):
            await wait_for(all_peers_current(js), bool, timeout_s=30, what="every stream replica current")
            node = await self.stream_leader(js) if kind == "stream_leader" else index % NODES
            self.cluster.kill(node)
            await asyncio.sleep(NODE_DOWN_S)
            self.cluster.start(node)
            what = "the stream leader" if kind == "stream_leader" else "NATS node"
            return f"killed {what} n{node} for {NODE_DOWN_S} s"
        procs = self.procs_by_kind().get(kind)
        if procs is None:
            raise ValueError(f"unknown component kind {kind!r}; one of {', '.join(KINDS)}")
        proc = procs[index % len(procs)]
        proc.kill()
        await asyncio.sleep(DOWN_S)
        if kind == "engine":
            self.restart_engine(index % len(procs))
        else:
            proc.start()
        return f"killed {proc.name} for {DOWN_S} s"

    async def until_ready(self, nc: Any, client: Router) -> None:
        """Wait until both replicas are ready, both routers and every ingest answer, and a route is answered.

        Raises:
            AssertionError: a condition did not hold within 60 s, or a process died.
        """
        await wait_for(
            lambda: self.replicas(nc),
            lambda r: (len(r) == 2 and all(x.get("ready") for x in r)) or bool(self.dead()),
            timeout_s=60,
            what="two ready indexer replicas",
        )
        await wait_for(
            lambda: self.routers_status(nc),
            lambda r: len(r) == 2 or bool(self.dead()),
            timeout_s=60,
            what="two routers",
        )
        await self.until_ingests_ready(nc)
        await wait_for(
            lambda: client.route(MODEL, list(range(3 * BS))),
            lambda r: True,
            timeout_s=60,
            what="a first route",
        )

    def stop(self) -> None:
        """Stop every process and node."""
        for p in self.procs():
            p.kill()
        self.cluster.stop()

    def logs_tail(self, lines: int = 15) -> str:
        """Return the tail of every process's log (for a failure message)."""
        return "\n".join(f"=== {p.name} (alive={p.alive})\n{p.tail(lines)}" for p in self.procs())

    # ------------------------------------------------------------------ NATS views

    async def stream_leader(self, js: Any) -> int:
        """Return the index of the node that leads the events stream."""
        info = await js.stream_info(subjects.STREAM)
        assert info.cluster is not None and info.cluster.leader is not None, info
        return int(info.cluster.leader.removeprefix("n"))

    async def routers_status(self, nc: Any) -> list[dict[str, Any]]:
        """Return every router's ``route`` endpoint data (its local index: applied sequence, blocks)."""
        replies = await gather_status(nc, f"$SRV.STATS.{subjects.ROUTER_QUEUE}", 1.0)
        out = []
        for r in replies:
            for endpoint in r.get("endpoints") or []:
                if endpoint.get("name") == "route":
                    out.append({"id": r.get("id"), **((endpoint.get("data") or {}).get("index") or {})})
        return sorted(out, key=lambda r: str(r.get("id")))

    async def ingests_status(self, nc: Any) -> list[dict[str, Any]]:
        """Return every ingest's status reply, sorted by worker id."""
        replies = await gather_status(nc, f"{subjects.STATUS_SUBJECT}.ingest", 1.0)
        return sorted(replies, key=lambda r: str(r.get("worker_id", "")))

    def dead(self) -> list[str]:
        """Describe every process that is not running although it should (with its exit status and log tail)."""
        return [
            f"{p.name} exited with status {p.popen.returncode if p.popen else None}:\n{p.tail(12)}"
            for p in self.procs()
            if p.starts and not p.alive
        ]

    async def replicas(self, nc: Any) -> list[dict[str, Any]]:
        """Return every indexer replica's status reply, sorted by replica id."""
        replies = await gather_status(nc, subjects.STATUS_SUBJECT, 1.0)
        return sorted(replies, key=lambda r: str(r.get("replica", "")))

    def engines_done(self) -> bool:
        """Whether every engine rank's latest incarnation has written its end-of-traffic report."""
        latest = self._latest_records()
        if len(latest) < ENGINES * RANKS:
            return False
        return all(p.with_name(p.name + ".done").exists() for p in latest.values())

    async def quiesce(self, nc: Any, *, timeout_s: float = 45.0) -> tuple[int, list[dict[str, Any]]]:
        """Wait until traffic ended, the stream stopped growing and every replica applied all of it.

        Returns:
            The stream's last sequence and the replicas' status replies.
        """
        js = nc.jetstream()
        await wait_for(
            lambda: asyncio.sleep(0, self.engines_done()), bool, timeout_s=timeout_s, what="engines' reports"
        )
        previous: list[int] = [-1]

        async def probe() -> tuple[int, list[dict[str, Any]], bool]:
            last = (await js.stream_info(subjects.STREAM)).state.last_seq
            stable = last == previous[0]
            previous[0] = last
            reps = await self.replicas(nc)
            return last, reps, stable

        def settled(v: tuple[int, list[dict[str, Any]], bool]) -> bool:
            last, reps, stable = v
            return stable and len(reps) == 2 and all(r.get("applied_seq") == last for r in reps)

        last, reps, _ = await wait_for(
            probe, settled, timeout_s=timeout_s, what="a quiet, fully applied stream"
        )
        return last, reps

    # ------------------------------------------------------------------ the engines' truth

    def _latest_records(self) -> dict[Holder, Path]:
        latest: dict[Holder, tuple[int, Path]] = {}
        for path in self.records.glob("*.kv"):
            worker, rank, started = path.name.removesuffix(".kv").rsplit(".", 2)
            key = Holder(worker, int(rank))
            if key not in latest or int(started) > latest[key][0]:
                latest[key] = (int(started), path)
        return {k: p for k, (_, p) in latest.items()}

    def truth(self) -> Truth:
        """Build the engines' truth from the latest incarnation's records and reports."""
        state = IndexState()
        truth = Truth(state=state, last_seq={}, cached={}, replayed={})
        stream_seq = 0
        for holder, path in sorted(self._latest_records().items()):
            worker, rank = holder
            normalizer = Normalizer(block_size=BS)
            counts: dict[int, int] = {}
            last = -1
            for seq, payload in read_record(path):
                batch = decode_batch(payload)
                result = normalizer.normalize(batch)
                assert not result.rejections and not result.lost, (worker, rank, seq, result)
                stream_seq += 1
                msg = EventsMessage(
                    worker_id=worker,
                    dp_rank=rank,
                    model=MODEL,
                    block_size=BS,
                    epoch=0,
                    seq=seq,
                    ts=batch.ts,
                    events=result.events,
                )
                state.apply(stream_seq, msg)
                last = seq
                for ev in result.events:
                    if isinstance(ev, Stored):
                        for h in ev.engine_hashes:
                            counts[h] = counts.get(h, 0) + 1
                    elif isinstance(ev, Removed):
                        for h in ev.engine_hashes:
                            if counts.get(h, 0) > 1:
                                counts[h] -= 1
                            else:
                                counts.pop(h, None)
                    elif isinstance(ev, Cleared):
                        counts.clear()
            truth.last_seq[holder] = last
            truth.replayed[holder] = set(counts)
            report = json.loads(path.with_name(path.name + ".done").read_text())
            truth.cached[holder] = set(report["cached"])
        truth.batches = stream_seq
        return truth

    # ------------------------------------------------------------------ stream order

    async def stream_order(self, nc: Any, truth: Truth) -> Order:
        """Read the whole events stream and check per-rank order against engine order (module docstring)."""
        js = nc.jetstream()
        info = await js.stream_info(subjects.STREAM)
        last_seq, total = info.state.last_seq, info.state.messages
        sub = await js.subscribe(
            f"{subjects.EVENTS_PREFIX}.>",
            ordered_consumer=True,
            deliver_policy=nats.js.api.DeliverPolicy.ALL,
        )
        order = Order()
        # per holder: epoch, last engine seq (None before the epoch's first engine batch), resync seen since
        cursor: dict[Holder, tuple[int, int | None, bool]] = {}
        runs: list[tuple[Holder, int, int, int, int, int | None, int]] = []
        try:
            seen = 0
            while seen < last_seq:
                msg = await sub.next_msg(timeout=10)
                sseq = msg.metadata.sequence.stream
                seen = sseq
                order.messages += 1
                m = decode_message(msg.data)
                if not isinstance(m, EventsMessage):
                    continue
                holder = Holder(m.worker_id, m.dp_rank)
                epoch, last, resync = cursor.get(holder, (m.epoch, None, False))
                if m.epoch < epoch:
                    order.violations.append(
                        f"{_name(holder)} stream seq {sseq}: epoch {m.epoch} after epoch {epoch}"
                    )
                    continue
                if m.epoch > epoch:
                    epoch, last, resync = m.epoch, None, False
                if m.ts == 0.0:  # made by the ingest: a hello, or a resync Cleared
                    if any(isinstance(e, Cleared) and e.reason != "engine" for e in m.events):
                        reasons = [e.reason for e in m.events if isinstance(e, Cleared)]
                        order.resyncs.append(f"{_name(holder)} stream seq {sseq} epoch {epoch}: {reasons}")
                        resync = True
                    cursor[holder] = (epoch, last, resync)
                    continue
                lo = m.first_seq if m.first_seq is not None else m.seq
                if m.part > 0:
                    if m.seq != last:
                        order.violations.append(
                            f"{_name(holder)} stream seq {sseq}: part {m.part} of engine seq {m.seq} after {last}"
                        )
                    continue
                expected = 0 if last is None else last + 1
                if lo != expected and not (resync and lo > expected):
                    runs.append((holder, epoch, sseq, lo, m.seq, last, expected))
                if last is None or m.seq > last:
                    last = m.seq
                cursor[holder] = (epoch, last, False)
        finally:
            await sub.unsubscribe()
        assert order.messages == total, (order.messages, total)
        order.violations += _merge_runs(runs)
        for holder in sorted(set(truth.last_seq) - set(cursor)):
            order.violations.append(
                f"{_name(holder)}: no message in the stream; the engine published up to seq {truth.last_seq[holder]}"
            )
        for holder, (epoch, last, _) in sorted(cursor.items()):
            order.last[holder] = (epoch, -1 if last is None else last)
            want = truth.last_seq.get(holder)
            if want is not None and last != want:
                order.violations.append(
                    f"{_name(holder)}: the stream ends at engine seq {last} (epoch {epoch}), the engine at {want}"
                )
        return order


def _name(holder: Holder) -> str:
    """Name a holder as kvmesh status does: ``worker/rank``."""
    return f"{holder.worker_id}/{holder.dp_rank}"


def _merge_runs(runs: list[tuple[Holder, int, int, int, int, int | None, int]]) -> list[str]:
    """Describe out-of-order messages, merging a rank's consecutive ones that follow each other in engine order."""
    merged: list[list[Any]] = []
    open_run: dict[Holder, list[Any]] = {}
    for holder, epoch, sseq, lo, hi, last, expected in runs:
        run = open_run.get(holder)
        if run is not None and run[1] == epoch and run[5] + 1 == lo and run[6] == last:
            run[3], run[5], run[7] = sseq, hi, run[7] + 1
            continue
        run = [holder, epoch, sseq, sseq, lo, hi, last, 1, expected]
        open_run[holder] = run
        merged.append(run)
    return [
        f"{_name(holder)} epoch {epoch}: stream seqs {s0}..{s1} ({n} messages) carry engine seqs {lo}..{hi} "
        f"after engine seq {last} (expected {expected} next)"
        for holder, epoch, s0, s1, lo, hi, last, n, expected in merged
    ]


async def connect_client(url: str) -> Any:
    """Connect a test client that rides out node kills."""
    return await connect(url, name="kvmesh-faults", wait_s=10.0)


async def stream_messages(js: Any) -> int:
    """Return the number of messages in the events stream."""
    return int((await js.stream_info(subjects.STREAM)).state.messages)


def all_peers_current(js: Any) -> Callable[[], Awaitable[bool]]:
    """Return a probe: whether the events stream has a leader and both other replicas are online and current."""

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


@dataclass
class Routes:
    """Routes sent during a run and how they ended."""

    sent: int = 0
    answered: int = 0
    retries: int = 0
    failures: list[str] = field(default_factory=list)


async def route_loop(client: Router, stop: asyncio.Event, routes: Routes) -> None:
    """Route prompts of the engines' own mix until ``stop``; retry a timed-out route for `ROUTE_DEADLINE_S`."""
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


def digest_report(reps: list[dict[str, Any]], truth: Truth) -> str:
    """Describe the truth's digest and blocks per worker next to every replica's (for a failure message)."""
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


@dataclass
class Check:
    """What `conclude` found at quiescence."""

    last: int
    """The events stream's last sequence."""
    replicas: list[dict[str, Any]]
    routers: list[dict[str, Any]]
    truth: Truth
    order: Order
    dead: list[str]
    """Processes that had exited (`Fleet.dead`)."""
    lost: list[str] = field(default_factory=list)
    """(a) replica digests that differ from the engines' truth, (b) stream order that differs from engine order."""
    unanswered: list[str] = field(default_factory=list)
    """(c) routes not answered."""

    def context(self, routes: Routes) -> str:
        """One line of figures for a report."""
        return (
            f"stream last seq {self.last}, {self.order.messages} messages; resyncs {self.order.resyncs}; "
            f"routes sent {routes.sent}, answered {routes.answered}, retried {routes.retries}; routers "
            f"{[(r.get('id'), r.get('applied_seq'), r.get('blocks')) for r in self.routers]}"
        )

    def verdict(self) -> str:
        """The final line: ``nothing lost: digests equal the engines' truth (…)``, or what differs."""
        problems = [*self.truth.problems(), *self.lost, *self.dead]
        if problems:
            return "LOST: " + "; ".join(p.splitlines()[0] for p in problems)
        digest = f"{self.truth.state.digest():016x}"
        return (
            f"nothing lost: digests equal the engines' truth ({len(self.replicas)} replicas at {digest}, "
            f"{self.truth.state.block_total()} blocks from {self.truth.batches} engine batches of "
            f"{len(self.truth.last_seq)} ranks; per-rank stream order equals engine order)"
        )


async def conclude(fleet: Fleet, nc: Any, routes: Routes, stop: asyncio.Event, route_task: Any) -> Check:
    """Quiesce the fleet, end the route loop, and check (a) digests, (b) stream order, (c) routes answered.

    Raises:
        AssertionError: the fleet did not quiesce, or the routers did not reach the stream's end, in time.
    """
    last, reps = await fleet.quiesce(nc)
    stop.set()
    await route_task
    routers = await wait_for(
        lambda: fleet.routers_status(nc),
        lambda rs: len(rs) == 2 and all(r.get("applied_seq") == last for r in rs),
        timeout_s=30,
        what=f"both routers' local index at stream seq {last}",
    )
    dead = fleet.dead()
    truth = fleet.truth()
    order = await fleet.stream_order(nc, truth)
    check = Check(last=last, replicas=reps, routers=routers, truth=truth, order=order, dead=dead)
    # (a) every replica's digest equals the engines' truth, and no replica calls itself incomplete
    want = f"{truth.state.digest():016x}"
    if [r.get("digest") for r in reps] != [want, want] or [r.get("complete") for r in reps] != [True, True]:
        check.lost.append("(a) replica digests != the engines' truth:\n" + digest_report(reps, truth))
    # (b) per-rank stream order equals engine order
    if order.violations:
        check.lost.append("(b) stream order != engine order:\n" + "\n".join(order.violations))
    # (c) every route answered
    if routes.failures or routes.answered != routes.sent or routes.sent == 0:
        check.unanswered.append("(c) routes not answered:\n" + "\n".join(routes.failures[:20]))
    return check
