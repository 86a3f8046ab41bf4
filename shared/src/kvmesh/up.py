"""kvmesh up: the whole system on one machine, driven by a request trace.

Starts (as child processes, each also runnable on its own): a private nats-server with JetStream in a
temporary directory (unless --nats-url names one), `kvmesh sim` with N simulated vLLM workers, one
`kvmesh ingest` per worker, a `kvmesh indexer` and a `kvmesh router`. Then it replays a Mooncake-format
trace: every request is routed through kvmesh.route and sent to the chosen simulated worker, which
reports how many prompt tokens it served from its prefix cache. At the end it prints a table per worker next
to what round-robin routing achieves on the same requests with the same pools (computed in-process).
Ctrl-C stops every process it started and removes the temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import msgspec

from kvmesh.client import RouteError, Router, UnavailableError
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import close_quietly, connect
from kvmesh.runtime.procs import ChildProcesses
from kvmesh.runtime.server import NatsServer
from kvmesh.sim.blockpool import BlockPool, PoolExhaustedError
from kvmesh.sim.engine import output_tokens
from kvmesh.sim.trace import TraceRequest, default_trace_path, expand_tokens, load_trace

MODEL = "sim-model"


@dataclass(slots=True)
class WorkerTally:
    """Per-worker results of one run."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class Tally:
    """Results of one policy over the run."""

    workers: dict[str, WorkerTally] = field(default_factory=dict)

    def add(self, worker: str, prompt: int, cached: int) -> None:
        """Count one served request."""
        t = self.workers.setdefault(worker, WorkerTally())
        t.requests += 1
        t.prompt_tokens += prompt
        t.cached_tokens += cached

    def totals(self) -> WorkerTally:
        """Sum over workers."""
        out = WorkerTally()
        for t in self.workers.values():
            out.requests += t.requests
            out.prompt_tokens += t.prompt_tokens
            out.cached_tokens += t.cached_tokens
        return out


def _ratio(cached: int, prompt: int) -> float:
    return cached / prompt if prompt else 0.0


def _free_base_port(span: int) -> int:
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - span)
        ok = True
        for port in range(base, base + span):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range found")


class Up:
    """One `kvmesh up` run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="kvmesh-up-"))
        self.log_dir = Path(args.log_dir) if args.log_dir else self.tmp / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children = ChildProcesses(self.log_dir)
        self.server: NatsServer | None = None
        self.out: TextIO = sys.stdout

    # ------------------------------------------------------------------ processes

    def stop(self) -> None:
        """Stop every child (SIGTERM, then SIGKILL), the embedded server, and remove the temporary directory.

        Further Ctrl-C presses are ignored while this runs, so nothing is left behind.
        """
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.children.stop()
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def start(self) -> str:
        """Start NATS (unless given) and every kvmesh process; return the NATS URL."""
        a = self.args
        if a.nats_url:
            url = str(a.nats_url)
        else:
            self.server = NatsServer(store_dir=self.tmp / "nats").start()
            url = self.server.url
            self.say(f"started nats-server with JetStream at {url} (store in a temporary directory)")
        base = a.base_port or _free_base_port(20 * a.workers + 11)
        self.children.spawn(
            "sim",
            "-m",
            "kvmesh.cli",
            "sim",
            "--nats-url",
            url,
            "--workers",
            str(a.workers),
            "--base-port",
            str(base),
            "--num-blocks",
            str(a.num_blocks),
            "--block-size",
            str(a.block_size),
            "--version",
            a.version,
            "--worker-prefix",
            "sim-",
        )
        for i in range(a.workers):
            port = base + 20 * i
            self.children.spawn(
                f"ingest-{i}",
                "-m",
                "kvmesh.ingest",
                "--nats-url",
                url,
                "--worker-id",
                f"sim-{i}",
                "--model",
                MODEL,
                "--zmq-endpoint",
                f"tcp://127.0.0.1:{port}",
                "--replay-endpoint",
                f"tcp://127.0.0.1:{port + 10}",
                "--block-size",
                str(a.block_size),
            )
        self.children.spawn("indexer", "-m", "kvmesh.indexer", "--nats-url", url)
        self.children.spawn("router", "-m", "kvmesh.router", "--nats-url", url)
        self.say(
            f"started {a.workers} simulated workers, {a.workers} ingests, an indexer and a router "
            f"(logs in {self.log_dir if a.log_dir else 'a temporary directory'})"
        )
        return url

    def say(self, text: str) -> None:
        """Print a status line."""
        print(text, file=self.out, flush=True)

    # ------------------------------------------------------------------ the run

    async def wait_ready(self, router: Router, workers: int, timeout_s: float = 60.0) -> None:
        """Wait until the router answers and knows every worker."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            self.children.check()
            try:
                reply = await router.route(MODEL, [0] * self.args.block_size, explain=True)
                if reply.scores is not None and len(reply.scores) >= workers:
                    return
                last = f"router knows {len(reply.scores or [])} of {workers} workers"
            except (RouteError, UnavailableError) as exc:
                last = f"{exc.code}: {exc.message}"
            await asyncio.sleep(0.2)
        raise RuntimeError(f"kvmesh did not become ready in {timeout_s:g} s ({last})")

    async def replay(self, url: str, trace: list[TraceRequest]) -> tuple[Tally, int, float, list[float]]:
        """Route and serve every request; return the tally, failures, seconds taken and route latencies."""
        a = self.args
        nc = await connect(url, name="kvmesh-up", wait_s=10.0)
        router = Router(nc, timeout_s=5.0)
        tally = Tally()
        failures = 0
        latencies: list[float] = []
        try:
            await self.wait_ready(router, a.workers)
            self.say(f"replaying {len(trace)} requests (concurrency {a.concurrency})")
            start = time.monotonic()
            queue: asyncio.Queue[tuple[int, TraceRequest]] = asyncio.Queue()
            for item in enumerate(trace):
                queue.put_nowait(item)
            done = 0
            deadline = start + a.duration if a.duration else None

            async def worker() -> None:
                nonlocal done, failures
                while not queue.empty():
                    if deadline is not None and time.monotonic() > deadline:
                        return
                    i, req = queue.get_nowait()
                    tokens = expand_tokens(req)
                    t0 = time.perf_counter()
                    try:
                        reply = await router.route(MODEL, tokens, request_id=f"req-{i}")
                    except RouteError as exc:
                        failures += 1
                        self.say(f"\nrequest {i}: route failed: {exc.code}: {exc.message}")
                        continue
                    latencies.append(time.perf_counter() - t0)
                    msg = await nc.request(
                        subjects.sim_subject(reply.worker_id),
                        msgspec.msgpack.encode(
                            {
                                "token_ids": tokens,
                                "output_length": req.output_length,
                                "dp_rank": reply.dp_rank,
                            }
                        ),
                        timeout=60,
                    )
                    result = msgspec.msgpack.decode(msg.data)
                    # The simulated worker served the request to completion: release its load at the routers.
                    await router.finish(f"req-{i}")
                    if "error" in result:
                        failures += 1
                        self.say(f"\nrequest {i}: worker {reply.worker_id} failed: {result['error']}")
                        continue
                    tally.add(reply.worker_id, result["prompt_tokens"], result["cached_tokens"])
                    done += 1
                    self.progress(done, len(trace), tally, start)

            await asyncio.gather(*(worker() for _ in range(a.concurrency)))
            elapsed = time.monotonic() - start
            self.progress(done, len(trace), tally, start, final=True)
            return tally, failures, elapsed, latencies
        finally:
            await close_quietly(nc)

    def progress(self, done: int, total: int, tally: Tally, start: float, *, final: bool = False) -> None:
        """Print the live progress line (every request on a terminal, every 10 % otherwise)."""
        tty = self.out.isatty()
        step = max(1, total // 10)
        if not (final or tty or done % step == 0):
            return
        t = tally.totals()
        rate = done / max(1e-9, time.monotonic() - start)
        line = (
            f"[{done:>5}/{total}] hit ratio {100 * _ratio(t.cached_tokens, t.prompt_tokens):5.1f}%  "
            f"cached {t.cached_tokens:,} of {t.prompt_tokens:,} prompt tokens  {rate:6.1f} req/s"
        )
        if tty:
            print("\r" + line, end="\n" if final else "", file=self.out, flush=True)
        elif not final:
            print(line, file=self.out, flush=True)


def round_robin(trace: Sequence[TraceRequest], args: argparse.Namespace) -> Tally:
    """Serve the same requests round-robin on in-process pools of the same size (the baseline)."""
    pools = [
        BlockPool(num_blocks=args.num_blocks, block_size=args.block_size, seed=i) for i in range(args.workers)
    ]
    tally = Tally()
    for i, req in enumerate(trace):
        w = i % args.workers
        pool = pools[w]
        tokens = expand_tokens(req)
        try:
            adm = pool.start(f"r{i}", tokens)
        except PoolExhaustedError:
            continue
        for tok in output_tokens(tokens, req.output_length, seed=w)[:-1]:
            pool.append(f"r{i}", (tok,))
        pool.finish(f"r{i}")
        pool.take_events()
        tally.add(f"sim-{w}", adm.prompt_tokens, adm.cached_tokens)
    return tally


def print_table(out: TextIO, kv: Tally, rr: Tally, workers: int) -> None:
    """Print the per-worker table: kvmesh next to round-robin."""
    head = f"{'worker':<10} {'requests':>9} {'cached tokens':>14} {'hit ratio':>10} │ {'rr requests':>11} {'rr cached':>12} {'rr hit':>8}"
    print(head, file=out)
    print("─" * len(head), file=out)
    for i in range(workers):
        w = f"sim-{i}"
        k = kv.workers.get(w, WorkerTally())
        r = rr.workers.get(w, WorkerTally())
        print(
            f"{w:<10} {k.requests:>9} {k.cached_tokens:>14,} {100 * _ratio(k.cached_tokens, k.prompt_tokens):>9.1f}% │ "
            f"{r.requests:>11} {r.cached_tokens:>12,} {100 * _ratio(r.cached_tokens, r.prompt_tokens):>7.1f}%",
            file=out,
        )
    k, r = kv.totals(), rr.totals()
    print("─" * len(head), file=out)
    print(
        f"{'total':<10} {k.requests:>9} {k.cached_tokens:>14,} {100 * _ratio(k.cached_tokens, k.prompt_tokens):>9.1f}% │ "
        f"{r.requests:>11} {r.cached_tokens:>12,} {100 * _ratio(r.cached_tokens, r.prompt_tokens):>7.1f}%",
        file=out,
    )


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``kvmesh up``."""
    p = argparse.ArgumentParser(
        prog="kvmesh up", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    env = os.environ.get
    p.add_argument(
        "--nats-url",
        default=env("KVMESH_NATS_URL"),
        help="use this NATS server (with JetStream) instead of starting one [env KVMESH_NATS_URL]",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="Mooncake-format trace (JSONL); default: the bundled 1,000-request excerpt",
    )
    p.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--duration", type=float, default=None, help="stop replaying after S seconds")
    p.add_argument("--workers", type=int, default=4, help="simulated workers (default 4)")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=131072,
        help="KV blocks per simulated worker (default 131072: 2M tokens at block size 16)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16, vLLM's)")
    p.add_argument(
        "--version",
        default="0.33.0",
        help="vLLM release whose wire format the simulated workers speak, 0.9.0 … 0.33.0 (default 0.33.0)",
    )
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument(
        "--base-port",
        type=int,
        default=0,
        help="first ZMQ port of the simulated workers (default: a free range)",
    )
    p.add_argument(
        "--log-dir",
        default=None,
        help="keep the processes' logs here (default: a temporary directory, removed)",
    )
    return p


def command(argv: Sequence[str] | None = None) -> int:
    """Run ``kvmesh up``; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.workers < 1 or args.concurrency < 1:
        print("kvmesh up: --workers and --concurrency must be ≥ 1", file=sys.stderr)
        return 2
    if args.requests is not None and args.requests < 1:
        print("kvmesh up: --requests must be ≥ 1", file=sys.stderr)
        return 2
    trace_path = args.trace or default_trace_path()
    try:
        trace = load_trace(trace_path, limit=args.requests)
    except (OSError, ValueError) as exc:
        print(f"kvmesh up: cannot read trace {trace_path}: {exc}", file=sys.stderr)
        return 2
    up = Up(args)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        up.say(f"kvmesh up: {len(trace)} requests from {Path(trace_path).name}, {args.workers} workers")
        url = up.start()
        tally, failures, elapsed, latencies = asyncio.run(up.replay(url, trace))
        up.say("replay done; stopping every process")
    except KeyboardInterrupt:
        up.say("\ninterrupted; stopping every process")
        return 130
    except Exception as exc:
        up.say(f"\nkvmesh up failed: {exc}")
        return 1
    finally:
        up.stop()
    served = tally.totals().requests
    up.say(f"\nreplayed {served} requests in {elapsed:.1f} s ({failures} failed)")
    if latencies:
        latencies.sort()
        p50 = latencies[len(latencies) // 2] * 1e3
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3
        up.say(f"route latency through NATS: p50 {p50:.2f} ms, p99 {p99:.2f} ms\n")
    up.say("computing the round-robin baseline on the same requests…")
    rr = round_robin(trace[:served] if served < len(trace) else trace, args)
    print_table(sys.stdout, tally, rr, args.workers)
    return 0 if failures == 0 else 1
