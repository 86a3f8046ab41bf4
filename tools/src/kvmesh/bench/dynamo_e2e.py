"""``kvmesh bench dynamo``: kvmesh end to end against Dynamo's standalone indexer, on the same vLLM frames.

The simulated engines (`kvmesh.sim.blockpool.BlockPool`, one per worker, vLLM 0.33's prefix cache and its
eviction order) serve the first ``--requests`` requests of the packaged Mooncake excerpt round-robin; every
engine step's events are encoded once, as vLLM 0.33 sends them (`kvmesh.core.wire.encode_batch`), before
either system starts. Then each system runs **alone**, in the order of ``--order`` (``--rounds`` times,
alternating), fed the same frames by real ZMQ publishers (`kvmesh.sim.publisher.EventPublisher`) as fast as
they can be sent:

* **Dynamo**: ``python -m dynamo.indexer`` (the ``ai-dynamo-runtime`` wheel, the ``bench`` extra),
  subscribed to every engine's ZMQ socket by ``--workers``, no NATS (run by ``--dynamo-python``, an
  interpreter that has the wheel; default: this one); queried over HTTP ``POST /query``
  (``{"token_ids", "model_name"}`` → per-instance, per-rank scores), one kept-alive connection, the JSON
  bodies encoded before timing.
* **kvmesh**: a private ``nats-server`` (JetStream on disk), one ``kvmesh ingest`` per engine, one
  ``kvmesh indexer``, one ``kvmesh router``; queried with ``kvmesh.route`` (`kvmesh.client.Router.route`).
  The first frame is sent once every ingest is subscribed and the indexer (a match request) and the router
  (a route naming every engine) answer.

Figures per run:

* **block operations/s until queryable**: stored + removed blocks of every frame, divided by the time from
  the first frame sent to the moment the system answers the last prompt of every engine with the engines'
  own truth (polled every 20 ms; the probe is part of the cost). Each engine's last prompt is a sentinel
  of 4 fresh blocks (no parent, held by no other engine), so both systems can reach the truth on it;
* **CPU seconds per million block operations**: user + system time of every process of the system (for
  kvmesh the ingests, the indexer, the router and nats-server) over the same interval, from
  ``/proc/PID/stat``;
* **resident memory**: the sum of ``VmRSS`` of the same processes once queryable; and the **growth per
  indexed block** of the process that holds the index (Dynamo's indexer; kvmesh's indexer and router, each
  apart): its ``VmRSS`` once queryable minus its ``VmRSS`` just before the first frame (both ready and
  answering), divided by the blocks the engines hold at the end (stored minus removed). With
  ``--num-blocks`` above what an engine ever stores nothing is evicted, and the figure is each process's
  cost of the blocks that arrived (``--workers 8 --num-blocks 262144``: about 1M blocks);
* **query latency** p50/p99: ``--query-requests`` queries at concurrency 1 of ``--query-tokens``-token
  prompts (the first tokens of served prompts, picked at random);
* **exactness gap**: for ``--queries`` of those prompts, every worker's overlap in blocks as the system
  answers it against the truth the engines know (the leading run of the prompt's block hashes each pool
  still caches); off, over- and under-counted (worker, query) pairs. kvmesh's per-worker overlaps come
  from an explained route (``explain=True``), not timed.

Targets (issue 14): kvmesh's throughput ≥ 0.6× Dynamo's and its CPU per block operation ≤ 2× Dynamo's.
Without the ``bench`` extra the kvmesh side still runs and the Dynamo side is skipped with a message.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import importlib.util
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from kvmesh.bench.outputs import out_prefix
from kvmesh.bench.trace import percentile
from kvmesh.core.wire import BlockRemoved, BlockStored, EngineBatch, encode_batch
from kvmesh.sim.blockpool import BlockPool, PoolExhaustedError
from kvmesh.sim.publisher import EventPublisher
from kvmesh.sim.trace import default_trace_path, expand_tokens, load_trace

__all__ = [
    "Frames", "RunResult", "command", "dynamo_available", "dynamo_available_in", "make_frames", "memory_growth",
    "run_dynamo", "run_kvmesh",
]  # fmt: skip

MODEL: Final[str] = "bench-model"
BLOCK_SIZE: Final[int] = 16
THROUGHPUT_TARGET: Final[float] = 0.6
CPU_TARGET: Final[float] = 2.0
MEMORY_TARGET_B: Final[float] = 64.0
"""Target resident growth per indexed block of kvmesh's indexer process and of its router process, in bytes."""
DYNAMO: Final[str] = "dynamo"
KVMESH: Final[str] = "kvmesh"
SKIP_MESSAGE: Final[str] = (
    "Dynamo's standalone indexer (python -m dynamo.indexer, the ai-dynamo-runtime wheel) is not installed: "
    "the Dynamo side is skipped. Install the bench extra of kvmesh-tools "
    "(`uv sync --all-packages --extra bench`) to compare."
)
SENTINEL_TOKENS: Final[int] = 64
"""Tokens of the prompt each engine serves last (4 blocks no other prompt has): once a system answers it
for every engine, it has applied every frame before it (each engine's frames arrive in order)."""
_REPLAY_STEPS: Final[int] = 200_000
_HWM: Final[int] = 1_000_000
"""Send high-water mark of each engine socket, in frames: above every run's frame count, so nothing is
dropped on the sending side while a system falls behind."""


def dynamo_available() -> bool:
    """Whether ``python -m dynamo.indexer`` can run here (the ``bench`` extra is installed)."""
    try:
        return importlib.util.find_spec("dynamo.indexer") is not None
    except (ImportError, ValueError):
        return False


def dynamo_available_in(python: str) -> bool:
    """Whether ``python -m dynamo.indexer`` can run with the interpreter ``python`` (a path or a name on
    ``PATH``); this interpreter is asked in process (`dynamo_available`)."""
    if python == sys.executable:
        return dynamo_available()
    try:
        done = subprocess.run(
            [python, "-c", "import dynamo.indexer"], capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@dataclass(slots=True)
class Frames:
    """Pre-encoded vLLM 0.33 frames of every engine, with what the engines hold at the end."""

    workers: int
    frames: list[list[bytes]] = field(default_factory=list)
    """Per engine, one encoded batch per engine step, in order."""
    block_ops: int = 0
    """Stored plus removed blocks over every frame."""
    stored_blocks: int = 0
    removed_blocks: int = 0
    served: int = 0
    """Requests the pools served (the rest did not fit a pool)."""
    probes: list[list[int]] = field(default_factory=list)
    """Per engine, the last prompt it served: its sentinel (`SENTINEL_TOKENS` fresh tokens)."""
    queries: list[list[int]] = field(default_factory=list)
    truth: list[list[int]] = field(default_factory=list)
    """Per query (then per probe, after the queries), every engine's overlap in blocks."""

    @property
    def held_blocks(self) -> int:
        """Blocks the engines hold after the last frame (stored minus removed, over every engine)."""
        return self.stored_blocks - self.removed_blocks

    @property
    def probe_truth(self) -> list[list[int]]:
        """Every probe's per-engine truth."""
        return self.truth[len(self.queries) :]


def _leading(hashes: Sequence[int], cached: set[int]) -> int:
    n = 0
    for h in hashes:
        if h not in cached:
            break
        n += 1
    return n


def make_frames(
    workers: int, requests: int, *, num_blocks: int = 16384, queries: int = 400, query_tokens: int = 4096,
    seed: int = 0,
) -> Frames:  # fmt: skip
    """Serve the first ``requests`` trace requests round-robin on ``workers`` pools of ``num_blocks`` blocks
    and encode every step's events; pick ``queries`` prompts (the first ``query_tokens`` tokens of served
    prompts) and compute every engine's true overlap for them and for each engine's last prompt.

    Raises:
        ValueError: ``workers`` or ``requests`` not positive.
    """
    if workers <= 0 or requests <= 0:
        raise ValueError("workers and requests must be positive")
    pools = [BlockPool(num_blocks=num_blocks, block_size=BLOCK_SIZE, seed=1000 + w) for w in range(workers)]
    out = Frames(workers=workers, frames=[[] for _ in range(workers)])
    prompts: list[list[int]] = []
    last: list[list[int]] = [[] for _ in range(workers)]
    for i, req in enumerate(load_trace(default_trace_path(), limit=requests)):
        tokens = expand_tokens(req)
        w = i % workers
        try:
            pools[w].start(f"r{i}", tokens)
        except PoolExhaustedError:
            continue
        pools[w].finish(f"r{i}")
        out.served += 1
        prompts.append(tokens)
        last[w] = tokens
        events = pools[w].take_events()
        for ev in events:
            if isinstance(ev, BlockStored):
                out.stored_blocks += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                out.removed_blocks += len(ev.block_hashes)
        if events:
            out.frames[w].append(encode_batch(EngineBatch(ts=float(i), events=tuple(events), dp_rank=0)))
    for w, pool in enumerate(pools):  # each engine's last frame: a short prompt no other engine holds
        sentinel = [
            int(t) for t in random.Random(f"sentinel-{seed}-{w}").choices(range(32000), k=SENTINEL_TOKENS)
        ]
        pool.start(f"sentinel-{w}", sentinel)
        pool.finish(f"sentinel-{w}")
        last[w] = sentinel
        events = pool.take_events()
        for ev in events:
            if isinstance(ev, BlockStored):
                out.stored_blocks += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                out.removed_blocks += len(ev.block_hashes)
        out.frames[w].append(
            encode_batch(EngineBatch(ts=float(requests + w), events=tuple(events), dp_rank=0))
        )
    out.block_ops = out.stored_blocks + out.removed_blocks
    rng = random.Random(seed)
    out.queries = [rng.choice(prompts)[:query_tokens] for _ in range(queries)] if prompts else []
    out.probes = last
    cached = [set(p.cached_block_hashes()) for p in pools]
    for q in [*out.queries, *out.probes]:
        out.truth.append(
            [_leading(p.compute_block_hashes(q), c) for p, c in zip(pools, cached, strict=True)]  # type: ignore[arg-type]
        )
    return out


# ---------------------------------------------------------------------- process accounting


_TICK: Final[float] = float(os.sysconf("SC_CLK_TCK"))


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of the processes (``/proc/PID/stat``; a gone process counts 0)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def rss_bytes(pids: Sequence[int]) -> int:
    """The sum of ``VmRSS`` of the processes, in bytes."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


@dataclass(slots=True)
class RunResult:
    """One system's run; times in seconds."""

    system: str
    block_ops: int
    queryable_s: float = 0.0
    settled: bool = False
    """Whether every probe reached the engines' truth (else ``queryable_s`` is the timeout)."""
    cpu_s: float = 0.0
    rss_bytes: int = 0
    processes: int = 0
    held_blocks: int = 0
    """Blocks the engines hold at the end (`Frames.held_blocks`)."""
    indexer_growth_bytes: int = 0
    """``VmRSS`` growth of the index's process (Dynamo's indexer, kvmesh's indexer) from just before the
    first frame to queryable."""
    router_growth_bytes: int = 0
    """The same for kvmesh's router (its local replica of the index); 0 for Dynamo."""
    cpu_by_process: dict[str, float] = field(default_factory=dict)
    """``cpu_s`` per kind of process (``"ingests"`` summed, ``"indexer"``, ``"router"``, ``"nats-server"``;
    ``"dynamo.indexer"``)."""
    query_latencies_ms: list[float] = field(default_factory=list)
    query_errors: int = 0
    exact_pairs: int = 0
    off_pairs: int = 0
    over_pairs: int = 0
    under_pairs: int = 0

    @property
    def ops_per_s(self) -> float:
        """Block operations per second until queryable."""
        return self.block_ops / self.queryable_s if self.queryable_s > 0 else 0.0

    @property
    def indexer_bytes_per_block(self) -> float:
        """``indexer_growth_bytes`` per held block."""
        return self.indexer_growth_bytes / self.held_blocks if self.held_blocks else 0.0

    @property
    def router_bytes_per_block(self) -> float:
        """``router_growth_bytes`` per held block."""
        return self.router_growth_bytes / self.held_blocks if self.held_blocks else 0.0

    @property
    def cpu_s_per_million(self) -> float:
        """CPU seconds per million block operations."""
        return self.cpu_s / self.block_ops * 1e6 if self.block_ops else 0.0

    def summary(self) -> dict[str, Any]:
        """The figures as a JSON-able dict (latency percentiles instead of every sample)."""
        d = asdict(self)
        lat = d.pop("query_latencies_ms")
        d |= {
            "ops_per_s": self.ops_per_s,
            "cpu_s_per_million_ops": self.cpu_s_per_million,
            "indexer_bytes_per_block": self.indexer_bytes_per_block,
            "router_bytes_per_block": self.router_bytes_per_block,
            "query_requests": len(lat),
            "query_p50_ms": percentile(lat, 0.5),
            "query_p99_ms": percentile(lat, 0.99),
        }
        return d


def _score(result: RunResult, answers: Sequence[Sequence[int]], truth: Sequence[Sequence[int]]) -> None:
    for got, want in zip(answers, truth, strict=True):
        for g, t in zip(got, want, strict=True):
            if g == t:
                result.exact_pairs += 1
            else:
                result.off_pairs += 1
                result.over_pairs += g > t
                result.under_pairs += g < t


def _publishers(workers: int) -> list[EventPublisher]:
    return [
        EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=_REPLAY_STEPS, hwm=_HWM)
        for _ in range(workers)
    ]


def _send_all(pubs: Sequence[EventPublisher], frames: Sequence[Sequence[bytes]]) -> None:
    n = max((len(f) for f in frames), default=0)
    for i in range(n):
        for pub, batches in zip(pubs, frames, strict=True):
            if i < len(batches):
                pub.publish_raw(batches[i])


def _wait_subscribed(pubs: Sequence[EventPublisher], check: Callable[[], None], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for pub in pubs:
        while pub.subscriptions < 1:
            check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"no subscriber on {pub.endpoint} after {timeout_s:g} s")
            time.sleep(0.02)


class _Settle:
    """Queryable once the probe answers equal the engines' truth (or past the timeout); ``cpu_s`` is the
    processes' CPU time at that moment."""

    def __init__(self, truth: list[list[int]], pids: Sequence[int], timeout_s: float) -> None:
        self.truth = truth
        self.pids = list(pids)
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + timeout_s
        self.cpu_s = cpu_seconds(self.pids)
        self.queryable_s = 0.0
        self.settled = False

    def done(self, answers: list[list[int]]) -> bool:
        """Record one poll's answers; True once queryable (or past the timeout)."""
        now = time.perf_counter()
        self.settled = answers == self.truth
        if self.settled or now > self.deadline:
            self.queryable_s, self.cpu_s = now - self.t0, cpu_seconds(self.pids)
            return True
        return False


# ---------------------------------------------------------------------- Dynamo


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _DynamoClient:
    """``POST /query`` on one kept-alive HTTP connection."""

    def __init__(self, port: int) -> None:
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    @staticmethod
    def body(tokens: Sequence[int]) -> bytes:
        """The JSON body of a ``/query`` for ``tokens``."""
        return json.dumps({"token_ids": list(tokens), "model_name": MODEL}).encode()

    def query(self, tokens: Sequence[int] | bytes) -> dict[str, Any]:
        """``POST /query`` with the prompt's tokens or a body from `body`; the decoded reply.

        Raises:
            RuntimeError: a status other than 200.
        """
        body = tokens if isinstance(tokens, bytes) else self.body(tokens)
        self._conn.request("POST", "/query", body, {"Content-Type": "application/json"})
        resp = self._conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"/query: HTTP {resp.status}: {data[:200]!r}")
        out: dict[str, Any] = json.loads(data)
        return out

    def overlaps(self, tokens: Sequence[int], workers: int) -> list[int]:
        """Every engine's overlap in blocks (instance ``w + 1``, rank 0). Replies with ``instances`` (1.6)
        score in tokens, older ones in blocks."""
        reply = self.query(tokens)
        scores = reply.get("scores") or {}
        unit = BLOCK_SIZE if "instances" in reply else 1
        return [int((scores.get(str(w + 1)) or {}).get("0", 0)) // unit for w in range(workers)]

    def close(self) -> None:
        self._conn.close()


def run_dynamo(
    fr: Frames, *, query_requests: int, threads: int | None, timeout_s: float, log_dir: Path,
    python: str = sys.executable,
) -> RunResult:  # fmt: skip
    """One run of Dynamo's standalone indexer on the frames, with the interpreter ``python`` (see the module
    docstring)."""
    result = RunResult(system=DYNAMO, block_ops=fr.block_ops, held_blocks=fr.held_blocks)
    pubs = _publishers(fr.workers)
    port = _free_port()
    workers = ",".join(f"{w + 1}={pub.endpoint}" for w, pub in enumerate(pubs))
    argv = [
        python, "-m", "dynamo.indexer", "--block-size", str(BLOCK_SIZE), "--port", str(port),
        "--model-name", MODEL, "--workers", workers,
    ]  # fmt: skip
    if threads is not None:
        argv += ["--threads", str(threads)]
    log = open(log_dir / "dynamo-indexer.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client: _DynamoClient | None = None

    def check() -> None:
        if proc.poll() is not None:
            raise RuntimeError(
                f"dynamo.indexer exited with {proc.returncode}: "
                + (log_dir / "dynamo-indexer.log").read_text(errors="replace")[-2000:]
            )

    try:
        _wait_subscribed(pubs, check, 60.0)
        deadline = time.monotonic() + 60.0
        while True:  # HTTP up
            check()
            try:
                client = _DynamoClient(port)
                client.query([0] * BLOCK_SIZE)
                break
            except (OSError, RuntimeError, http.client.HTTPException):
                if client is not None:
                    client.close()
                client = None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        pids = [proc.pid]
        rss0 = rss_bytes(pids)
        cpu0 = cpu_seconds(pids)
        settle = _Settle(fr.probe_truth, pids, timeout_s)
        _send_all(pubs, fr.frames)
        while not settle.done([client.overlaps(p, fr.workers) for p in fr.probes]):
            check()
            time.sleep(0.02)
        result.queryable_s, result.settled = settle.queryable_s, settle.settled
        result.cpu_s = settle.cpu_s - cpu0
        result.cpu_by_process = {"dynamo.indexer": result.cpu_s}
        result.rss_bytes = rss_bytes(pids)
        result.indexer_growth_bytes = result.rss_bytes - rss0
        result.processes = len(pids)
        _score(result, [client.overlaps(q, fr.workers) for q in fr.queries], fr.truth[: len(fr.queries)])
        perf = time.perf_counter
        bodies = [client.body(q) for q in fr.queries]  # encoded before timing, as kvmesh's are packed cheaply
        for b in bodies[:20]:
            client.query(b)
        for i in range(query_requests):
            b = bodies[i % len(bodies)]
            t1 = perf()
            try:
                client.query(b)
            except (OSError, RuntimeError, http.client.HTTPException):
                result.query_errors += 1
                client.close()
                client = _DynamoClient(port)
                continue
            result.query_latencies_ms.append((perf() - t1) * 1e3)
    finally:
        if client is not None:
            client.close()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        for pub in pubs:
            pub.close()
    return result


# ---------------------------------------------------------------------- kvmesh


async def _kvmesh(
    fr: Frames, result: RunResult, *, query_requests: int, timeout_s: float, log_dir: Path
) -> None:  # fmt: skip
    from kvmesh.client import RouteError, Router  # noqa: PLC0415
    from kvmesh.core import protocol  # noqa: PLC0415
    from kvmesh.harness.procs import ChildProcesses  # noqa: PLC0415
    from kvmesh.harness.server import NatsServer  # noqa: PLC0415
    from kvmesh.runtime import subjects  # noqa: PLC0415
    from kvmesh.runtime.nats import connect  # noqa: PLC0415

    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-dynamo-"))
    server = NatsServer(store_dir=tmp / "nats").start()
    children = ChildProcesses(log_dir)
    pubs = _publishers(fr.workers)
    nc = None
    names = [f"sim-{w}" for w in range(fr.workers)]
    try:
        url = str(server.url)
        for w, pub in enumerate(pubs):
            children.spawn(
                f"ingest-{w}", "-m", "kvmesh.ingest", "--nats-url", url, "--worker-id", names[w], "--model", MODEL,
                "--zmq-endpoint", pub.endpoint, "--replay-endpoint", str(pub.replay_endpoint),
                "--block-size", str(BLOCK_SIZE),
            )  # fmt: skip
        children.spawn("indexer", "-m", "kvmesh.indexer", "--nats-url", url)
        children.spawn("router", "-m", "kvmesh.router", "--nats-url", url)
        nc = await connect(url, name="kvmesh-bench-dynamo")
        router = Router(nc, timeout_s=10.0)
        match_body = protocol.encode(
            protocol.MatchRequest(model=MODEL, token_ids=[0] * BLOCK_SIZE), format="msgpack"
        )
        indexer_ready = False
        deadline = time.monotonic() + 90.0
        while True:  # every ingest subscribed and announced, the indexer and the router answering
            children.check()
            if not indexer_ready:
                try:  # any reply: its match endpoint is up, so it has recovered (its kernels loaded)
                    await nc.request(subjects.MATCH_SUBJECT, match_body, timeout=1.0)
                    indexer_ready = True
                except Exception:  # no responders or a timeout: not ready yet
                    pass
            if indexer_ready and all(p.subscriptions >= 1 for p in pubs):
                try:
                    reply = await router.route(MODEL, [0] * BLOCK_SIZE, explain=True)
                    if reply.scores is not None and len(reply.scores) >= fr.workers:
                        break
                except RouteError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError("the kvmesh pipeline did not become ready in 90 s")
            await asyncio.sleep(0.05)

        async def overlaps(tokens: Sequence[int]) -> list[int]:
            reply = await router.route(MODEL, tokens, explain=True)
            got = {s.worker_id: s.overlap_blocks for s in reply.scores or []}
            return [got.get(n, 0) for n in names]

        pids = [p.pid for _name, p in children.procs]
        if server.pid is not None:
            pids.append(server.pid)
        index_pids = {name: p.pid for name, p in children.procs if name in ("indexer", "router")}
        rss0 = {name: rss_bytes([pid]) for name, pid in index_pids.items()}
        kinds: dict[str, list[int]] = {
            "ingests": [p.pid for name, p in children.procs if name.startswith("ingest-")],
            **{name: [pid] for name, pid in index_pids.items()},
            "nats-server": [] if server.pid is None else [server.pid],
        }
        cpu0_by = {kind: cpu_seconds(kpids) for kind, kpids in kinds.items()}
        cpu0 = cpu_seconds(pids)
        settle = _Settle(fr.probe_truth, pids, timeout_s)
        _send_all(pubs, fr.frames)
        while True:
            children.check()
            try:
                answers = [await overlaps(p) for p in fr.probes]
            except RouteError:
                answers = []
            if settle.done(answers):
                break
            await asyncio.sleep(0.02)
        result.queryable_s, result.settled = settle.queryable_s, settle.settled
        result.cpu_s = settle.cpu_s - cpu0
        result.cpu_by_process = {kind: cpu_seconds(kpids) - cpu0_by[kind] for kind, kpids in kinds.items()}
        result.rss_bytes = rss_bytes(pids)
        result.indexer_growth_bytes = rss_bytes([index_pids["indexer"]]) - rss0["indexer"]
        result.router_growth_bytes = rss_bytes([index_pids["router"]]) - rss0["router"]
        result.processes = len(pids)
        _score(result, [await overlaps(q) for q in fr.queries], fr.truth[: len(fr.queries)])
        for q in fr.queries[:20]:
            await router.route(MODEL, q)
        perf = time.perf_counter
        for i in range(query_requests):
            q = fr.queries[i % len(fr.queries)]
            t1 = perf()
            try:
                await router.route(MODEL, q)
            except RouteError:
                result.query_errors += 1
                continue
            result.query_latencies_ms.append((perf() - t1) * 1e3)
    finally:
        if nc is not None:
            await nc.close()
        children.stop()
        for pub in pubs:
            pub.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def run_kvmesh(fr: Frames, *, query_requests: int, timeout_s: float, log_dir: Path) -> RunResult:
    """One run of the kvmesh pipeline on the frames (see the module docstring)."""
    result = RunResult(system=KVMESH, block_ops=fr.block_ops, held_blocks=fr.held_blocks)
    asyncio.run(_kvmesh(fr, result, query_requests=query_requests, timeout_s=timeout_s, log_dir=log_dir))
    return result


# ---------------------------------------------------------------------- report


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def compare(runs: Sequence[RunResult]) -> dict[str, Any]:
    """kvmesh against Dynamo over the runs (each figure: the mean over a system's runs): the ratios and the
    two targets; empty without a run of each."""
    by = {s: [r for r in runs if r.system == s] for s in (DYNAMO, KVMESH)}
    if not by[DYNAMO] or not by[KVMESH]:
        return {}
    rate = {s: _mean([r.ops_per_s for r in rs]) for s, rs in by.items()}
    cpu = {s: _mean([r.cpu_s_per_million for r in rs]) for s, rs in by.items()}
    throughput = rate[KVMESH] / rate[DYNAMO] if rate[DYNAMO] else 0.0
    cpu_ratio = cpu[KVMESH] / cpu[DYNAMO] if cpu[DYNAMO] else float("inf")
    return {
        "throughput_ratio": throughput,
        "throughput_met": throughput >= THROUGHPUT_TARGET,
        "cpu_ratio": cpu_ratio,
        "cpu_met": cpu_ratio <= CPU_TARGET,
    }


def memory_growth(runs: Sequence[RunResult]) -> dict[str, Any]:
    """kvmesh's indexer and router resident growth per held block (the largest over its runs) against
    `MEMORY_TARGET_B`, with Dynamo's indexer beside it where it ran; empty without a kvmesh run."""
    kv = [r for r in runs if r.system == KVMESH]
    if not kv:
        return {}
    indexer = max(r.indexer_bytes_per_block for r in kv)
    router = max(r.router_bytes_per_block for r in kv)
    out: dict[str, Any] = {
        "indexer_bytes_per_block": indexer,
        "router_bytes_per_block": router,
        "met": max(indexer, router) <= MEMORY_TARGET_B,
    }
    dyn = [r.indexer_bytes_per_block for r in runs if r.system == DYNAMO]
    if dyn:
        out["dynamo_bytes_per_block"] = max(dyn)
    return out


def table(runs: Sequence[RunResult]) -> str:
    """The Markdown table, one row per run."""
    lines = [
        "| run | system | block ops/s until queryable | settled | CPU s / M ops | RSS (MB) | processes "
        "| query p50 (ms) | query p99 (ms) | off / over / under (of pairs) | indexer / router growth (B per "
        "held block) |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(runs, 1):
        lat = r.query_latencies_ms
        pairs = r.exact_pairs + r.off_pairs
        lines.append(
            f"| {i} | {r.system} | {r.ops_per_s:,.0f} | {'yes' if r.settled else 'NO'} | {r.cpu_s_per_million:.2f} "
            f"| {r.rss_bytes / 1e6:.0f} | {r.processes} | {percentile(lat, 0.5):.3f} | {percentile(lat, 0.99):.3f} "
            f"| {r.off_pairs} / {r.over_pairs} / {r.under_pairs} (of {pairs}) "
            f"| {r.indexer_bytes_per_block:.1f} / {'–' if r.system == DYNAMO else f'{r.router_bytes_per_block:.1f}'} |"
        )
    return "\n".join(lines)


def command(argv: Sequence[str] | None = None) -> int:
    """Run ``kvmesh bench dynamo``; returns the exit code (1 when kvmesh answered a pair wrong or never
    became queryable)."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench dynamo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=4, help="simulated engines (default 4)")
    p.add_argument("--requests", type=int, default=1000, help="trace requests served (default 1000, all)")
    p.add_argument("--num-blocks", type=int, default=16384, help="KV blocks per engine (default 16384)")
    p.add_argument("--queries", type=int, default=400, help="prompts of the exactness check (default 400)")
    p.add_argument("--query-tokens", type=int, default=4096, help="tokens per query prompt (default 4096)")
    p.add_argument(
        "--query-requests", type=int, default=1000, help="timed queries per run, concurrency 1 (default 1000)"
    )
    p.add_argument("--order", default="dynamo,kvmesh", help="systems in run order (default dynamo,kvmesh)")
    p.add_argument("--rounds", type=int, default=1, help="times the order is run (default 1)")
    p.add_argument(
        "--dynamo-python",
        default=sys.executable,
        help="interpreter with ai-dynamo-runtime (default: this one)",
    )
    p.add_argument(
        "--dynamo-threads", type=int, default=None, help="dynamo.indexer --threads (default: its own, 4)"
    )
    p.add_argument(
        "--timeout-s", type=float, default=300.0, help="give up waiting to be queryable (default 300)"
    )
    p.add_argument("--log-dir", default=None, help="keep the child processes' logs here")
    p.add_argument("--out", metavar="PREFIX", type=out_prefix, help="write PREFIX.json")
    a = p.parse_args(argv)
    order = [s for s in a.order.split(",") if s]
    if not order or any(s not in (DYNAMO, KVMESH) for s in order):
        p.error("--order takes dynamo and kvmesh, comma-separated")
    if min(a.workers, a.requests, a.queries, a.query_tokens, a.rounds) <= 0 or a.query_requests < 0:
        p.error("--workers, --requests, --queries, --query-tokens and --rounds must be positive")
    have_dynamo = dynamo_available_in(a.dynamo_python)
    if not have_dynamo:
        print(SKIP_MESSAGE)
        order = [s for s in order if s != DYNAMO]
        if not order:
            return 0
    t0 = time.perf_counter()
    fr = make_frames(
        a.workers, a.requests, num_blocks=a.num_blocks, queries=a.queries, query_tokens=a.query_tokens
    )
    print(
        f"kvmesh bench dynamo: {fr.served} requests on {a.workers} engines of {a.num_blocks} blocks: "
        f"{sum(len(f) for f in fr.frames):,} vLLM 0.33 frames, {fr.stored_blocks:,} stored + "
        f"{fr.removed_blocks:,} removed = {fr.block_ops:,} block operations, {fr.held_blocks:,} held at the "
        f"end (generated in "
        f"{time.perf_counter() - t0:.1f} s)",
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-dynamo-logs-"))
    log_dir = Path(a.log_dir) if a.log_dir else tmp
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: list[RunResult] = []
    try:
        for _ in range(a.rounds):
            for system in order:
                if system == DYNAMO:
                    r = run_dynamo(
                        fr, query_requests=a.query_requests, threads=a.dynamo_threads, timeout_s=a.timeout_s,
                        log_dir=log_dir, python=a.dynamo_python,
                    )  # fmt: skip
                else:
                    r = run_kvmesh(
                        fr, query_requests=a.query_requests, timeout_s=a.timeout_s, log_dir=log_dir,
                    )  # fmt: skip
                runs.append(r)
                print(
                    f"{system}: {r.ops_per_s:,.0f} block ops/s until queryable ({r.queryable_s:.2f} s), "
                    f"{r.cpu_s:.2f} CPU s, {r.rss_bytes / 1e6:.0f} MB; growth per held block: indexer "
                    f"{r.indexer_bytes_per_block:.1f} B"
                    + (f", router {r.router_bytes_per_block:.1f} B" if system == KVMESH else "")
                    + "; CPU s by process: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in r.cpu_by_process.items()),
                    flush=True,
                )
    finally:
        if not a.log_dir:
            shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"\neach system alone, in the order {','.join(order)} × {a.rounds}; queries: {a.query_requests} at "
        f"concurrency 1 of {a.query_tokens}-token prompts; exactness over {len(fr.queries)} prompts × "
        f"{a.workers} workers against the engines' truth"
    )
    print(table(runs))
    cmp = compare(runs)
    if cmp:
        print("\ntargets (issue 14, kvmesh vs Dynamo, means over the runs):")
        print(
            f"- throughput ≥ {THROUGHPUT_TARGET:g}× Dynamo's: {cmp['throughput_ratio']:.2f}× — "
            f"{'meets' if cmp['throughput_met'] else 'MISSES'}"
        )
        print(
            f"- CPU per block operation ≤ {CPU_TARGET:g}× Dynamo's: {cmp['cpu_ratio']:.2f}× — "
            f"{'meets' if cmp['cpu_met'] else 'MISSES'}"
        )
    elif not have_dynamo:
        print("\ntargets (issue 14): not checked, Dynamo's side was skipped")
    mem = memory_growth(runs)
    if mem:
        print(
            f"- resident growth per held block ≤ {MEMORY_TARGET_B:g} B ({fr.held_blocks:,} blocks held): "
            f"indexer {mem['indexer_bytes_per_block']:.1f} B, router {mem['router_bytes_per_block']:.1f} B — "
            f"{'meets' if mem['met'] else 'MISSES'}"
            + (
                f" (Dynamo's indexer {mem['dynamo_bytes_per_block']:.1f} B)"
                if "dynamo_bytes_per_block" in mem
                else ""
            )
        )
    if a.out:
        doc = {
            "config": {
                "workers": a.workers, "requests": a.requests, "served": fr.served, "num_blocks": a.num_blocks,
                "queries": a.queries, "query_tokens": a.query_tokens, "query_requests": a.query_requests,
                "order": order, "rounds": a.rounds, "block_ops": fr.block_ops, "stored_blocks": fr.stored_blocks,
                "removed_blocks": fr.removed_blocks, "dynamo": have_dynamo,
            },
            "runs": [r.summary() for r in runs],
            "targets": cmp,
            "memory": mem,
        }  # fmt: skip
        Path(f"{a.out}.json").write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {a.out}.json")
    bad = [r for r in runs if r.system == KVMESH and (r.off_pairs or not r.settled)]
    return 1 if bad else 0
