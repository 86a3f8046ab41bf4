"""kvmesh up: the whole system on one machine, driven by a request trace.

Starts (as child processes, each also runnable on its own): a private nats-server with JetStream in a
temporary directory (unless --nats-url or KVMESH_NATS_URL names one), `kvmesh sim` with N simulated vLLM
workers, one `kvmesh ingest` per worker, a `kvmesh indexer` and a `kvmesh router`. Then it replays a
Mooncake-format trace: every request is routed through kvmesh.route and sent to the chosen simulated worker,
which reports how many prompt tokens it served from its prefix cache. At the end it prints a table per
worker next to what round-robin routing achieves on the same requests with the same pools (computed
in-process). Ctrl-C or SIGTERM stops every process it started and removes the temporary directory.

On a server of your own (--nats-url, or KVMESH_NATS_URL from the environment: its start-up lines say which),
the connection is checked before anything starts, and the run keeps to a namespace of its own: stream
KVMESH_UP_<run>, subjects kvmesh.up.<run>.*, workers sim-<run>-<i>, so another fleet's router or workers on
that server never answer it. That stream and its buckets are deleted when the run ends.

``--cluster 3 --chaos`` runs something else: the fleet of the fault suite on a local 3-node nats-server
cluster (R3 stream and buckets; 2 simulated engines of 2 ranks making up their own traffic, an ingest each,
2 indexers, 2 routers, a client routing all along) for ``--duration`` seconds (default 60), killing a random
component with SIGKILL every ``--chaos-every-s`` seconds (an ingest, an indexer, a router, an engine, a NATS
node or the stream leader) and starting it again, printing each kill. It ends with a table of memory,
consumers and connections and the line ``nothing lost: digests equal the engines' truth (…)`` (exit 0), or
``LOST: …`` with what differs (exit 1). It is ``kvmesh bench soak`` of a fixed length.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import msgspec
from nats.aio.client import Client

from kvmesh.client import RouteError, Router, UnavailableError
from kvmesh.core.errors import ConfigError, KvmeshError
from kvmesh.harness.procs import ChildProcesses
from kvmesh.harness.server import NatsServer
from kvmesh.runtime import subjects
from kvmesh.runtime.config import NatsAuth, add_fields, auth_environ, load
from kvmesh.runtime.nats import TransportError, close_quietly, connect, connect_options, redact_url
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
    """Delivered: the prompt tokens the engine served from its cache."""
    available_tokens: int = 0
    """The most any candidate had cached, as the router saw it (route receipts)."""
    captured_tokens: int = 0
    """The chosen worker's cached tokens, as the router saw it."""


@dataclass(slots=True)
class Tally:
    """Results of one policy over the run."""

    workers: dict[str, WorkerTally] = field(default_factory=dict)

    def add(self, worker: str, prompt: int, cached: int, *, available: int = 0, captured: int = 0) -> None:
        """Count one served request (``cached``: delivered by the engine; ``available``/``captured``: the
        route reply's ``available_tokens``/``cached_tokens``)."""
        t = self.workers.setdefault(worker, WorkerTally())
        t.requests += 1
        t.prompt_tokens += prompt
        t.cached_tokens += cached
        t.available_tokens += available
        t.captured_tokens += captured

    def totals(self) -> WorkerTally:
        """Sum over workers."""
        out = WorkerTally()
        for t in self.workers.values():
            out.requests += t.requests
            out.prompt_tokens += t.prompt_tokens
            out.cached_tokens += t.cached_tokens
            out.available_tokens += t.available_tokens
            out.captured_tokens += t.captured_tokens
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


@dataclass(frozen=True, slots=True)
class Namespace:
    """The stream, subjects and worker ids of one run (defaults on the private server, unique on a shared one)."""

    stream: str = subjects.STREAM
    events_prefix: str = subjects.EVENTS_PREFIX
    route_subject: str = subjects.ROUTE_SUBJECT
    match_subject: str = subjects.MATCH_SUBJECT
    requests_prefix: str = subjects.REQUESTS_PREFIX
    load_prefix: str = subjects.LOAD_PREFIX
    worker_prefix: str = "sim-"
    own: bool = False
    """True: a namespace of this run only, deleted (stream and buckets) when it ends."""

    @classmethod
    def unique(cls) -> Namespace:
        """A namespace no other run uses."""
        run = uuid.uuid4().hex[:8]
        base = f"kvmesh.up.{run}"
        return cls(
            stream=f"KVMESH_UP_{run.upper()}",
            events_prefix=f"{base}.events",
            route_subject=f"{base}.route",
            match_subject=f"{base}.match",
            requests_prefix=f"{base}.requests",
            load_prefix=f"{base}.load",
            worker_prefix=f"sim-{run}-",
            own=True,
        )

    def service_args(self) -> list[str]:
        """The flags that put a router (and, less the router's own, the others) in this namespace."""
        return ["--stream", self.stream, "--events-prefix", self.events_prefix]


class Up:
    """One `kvmesh up` run."""

    def __init__(
        self, args: argparse.Namespace, ns: Namespace | None = None, auth: NatsAuth | None = None
    ) -> None:
        self.args = args
        self.ns = ns or Namespace()
        self.auth = auth or NatsAuth()
        self.nats_options: dict[str, Any] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="kvmesh-up-"))
        self.log_dir = Path(args.log_dir) if args.log_dir else self.tmp / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children = ChildProcesses(self.log_dir, env=auth_environ(self.auth))
        self.server: NatsServer | None = None
        self.out: TextIO = sys.stdout

    # ------------------------------------------------------------------ processes

    def stop(self) -> None:
        """Stop every child (SIGTERM, then SIGKILL), the embedded server, and remove the temporary directory.

        Further Ctrl-C presses are ignored while this runs, so nothing is left behind.
        """
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.children.stop(grace_s=STOP_GRACE_S)
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    async def remove_namespace(self, url: str) -> None:
        """Delete this run's stream and buckets from a shared server (only a namespace of its own)."""
        if not self.ns.own:
            return
        try:
            nc = await connect(url, name="kvmesh-up-cleanup", wait_s=3.0, **self.nats_options)
        except TransportError as exc:
            self.say(f"cannot remove stream {self.ns.stream} and its buckets: {exc}")
            return
        removed: list[str] = []
        try:
            js = nc.jetstream()
            stream = self.ns.stream
            for kind, name, delete in (
                ("stream", stream, js.delete_stream),
                ("bucket", subjects.registry_bucket(stream), js.delete_key_value),
                ("bucket", subjects.lease_bucket(stream), js.delete_key_value),
                ("bucket", subjects.snapshot_bucket(stream), js.delete_object_store),
            ):
                try:
                    await delete(name)
                    removed.append(f"{kind} {name}")
                except Exception as exc:
                    if type(exc).__name__ not in ("NotFoundError", "BucketNotFoundError"):
                        self.say(f"cannot remove {kind} {name}: {exc}")
        finally:
            await close_quietly(nc)
        if removed:
            self.say(f"removed this run's {', '.join(removed)} from {redact_url(url)}")

    async def connect_checked(self, url: str) -> Client:
        """Connect to a given server and check it has JetStream, before anything is started.

        Raises:
            TransportError: no connection within 5 s (the reason named), or JetStream is not enabled.
        """
        nc = await connect(url, name="kvmesh-up", wait_s=5.0, **self.nats_options)
        try:
            await nc.jetstream().account_info()
        except Exception as exc:
            await close_quietly(nc)
            raise TransportError(
                f"{redact_url(url)} does not answer JetStream requests ({type(exc).__name__}): kvmesh needs a "
                "server started with JetStream (nats-server -js)"
            ) from None
        return nc

    def start(self, url: str | None) -> str:
        """Start NATS (unless ``url`` names a server) and every kvmesh process; return the NATS URL."""
        a = self.args
        ns = self.ns
        if url is None:
            self.server = NatsServer(store_dir=self.tmp / "nats").start()
            url = self.server.url
            self.say(f"started nats-server with JetStream at {url} (store in a temporary directory)")
        base = a.base_port or _free_base_port(20 * a.workers + 14 + a.workers)
        metrics = base + 20 * a.workers + 11  # one Prometheus port per service after the engines' ports
        ports = {"indexer": metrics, "router": metrics + 1} | {
            f"ingest-{i}": metrics + 2 + i for i in range(a.workers)
        }
        # --http-port 0: the port after those, so the address printed below is the one served
        http_port = metrics + 2 + a.workers if a.http_port == 0 else a.http_port
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
            ns.worker_prefix,
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
                f"{ns.worker_prefix}{i}",
                "--model",
                MODEL,
                "--zmq-endpoint",
                f"tcp://127.0.0.1:{port}",
                "--replay-endpoint",
                f"tcp://127.0.0.1:{port + 10}",
                "--block-size",
                str(a.block_size),
                "--metrics-port",
                str(ports[f"ingest-{i}"]),
                *ns.service_args(),
            )
        self.children.spawn(
            "indexer", "-m", "kvmesh.indexer", "--nats-url", url, *ns.service_args(),
            "--match-subject", ns.match_subject, "--metrics-port", str(ports["indexer"]),
        )  # fmt: skip
        self.children.spawn(
            "router", "-m", "kvmesh.router", "--nats-url", url, *ns.service_args(),
            "--match-subject", ns.match_subject, "--route-subject", ns.route_subject,
            "--requests-prefix", ns.requests_prefix, "--load-prefix", ns.load_prefix,
            "--metrics-port", str(ports["router"]),
            *(["--http-port", str(http_port)] if http_port is not None else []),
        )  # fmt: skip
        if http_port is not None:
            self.say(
                f"RFC #1403 indexer API: http://127.0.0.1:{http_port} (POST /query with "
                f'{{"model": "{MODEL}", "block_size": {a.block_size}, "token_ids": [...]}})'
            )
        self.say(
            f"started {a.workers} simulated workers, {a.workers} ingests, an indexer and a router "
            f"(logs in {self.log_dir if a.log_dir else 'a temporary directory'})"
        )
        self.say(
            "metrics (Prometheus): "
            + ", ".join(f"{name} http://127.0.0.1:{port}/metrics" for name, port in ports.items())
        )
        return url

    def say(self, text: str, *, err: bool = False) -> None:
        """Print a status line (to stderr with ``err``)."""
        print(text, file=sys.stderr if err else self.out, flush=True)

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

    async def replay(
        self, url: str, trace: list[TraceRequest], nc: Client | None = None
    ) -> tuple[Tally, int, float, list[float]]:
        """Route and serve every request; return the tally, failures, seconds taken and route latencies."""
        a = self.args
        if nc is None:
            nc = await connect(url, name="kvmesh-up", wait_s=10.0, **self.nats_options)
        router = Router(
            nc,
            timeout_s=5.0,
            subject=self.ns.route_subject,
            requests_prefix=self.ns.requests_prefix,
        )
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
                    # The simulated worker served the request to completion: release its load at the routers
                    # and report what its cache delivered, as a gateway does with vLLM's usage.
                    delivered = result.get("cached_tokens")
                    await router.finish(
                        f"req-{i}", cached_tokens=delivered if isinstance(delivered, int) else None
                    )
                    if "error" in result:
                        failures += 1
                        self.say(f"\nrequest {i}: worker {reply.worker_id} failed: {result['error']}")
                        continue
                    shown = "sim-" + reply.worker_id.removeprefix(self.ns.worker_prefix)
                    tally.add(
                        shown,
                        result["prompt_tokens"],
                        result["cached_tokens"],
                        available=reply.available_tokens or 0,
                        captured=reply.cached_tokens,
                    )
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


STOP_GRACE_S = 5.0
"""Seconds the children get, in all, to exit after SIGTERM before they are killed."""


@dataclass(slots=True)
class Outcome:
    """How `_run` ended: an exit code to return at once, or the replay's result."""

    code: int | None = None
    url: str | None = None
    """The server the run's namespace lives on, once the connection was checked."""
    result: tuple[Tally, int, float, list[float]] | None = None


@contextlib.contextmanager
def cancel_on_signals() -> Iterator[list[int]]:
    """Within the block, SIGINT and SIGTERM cancel the running task; yields the list of signals received."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    got: list[int] = []

    def on_signal(sig: int) -> None:
        got.append(sig)
        task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield got
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def last_errors(log_dir: Path, per_file: int = 3) -> list[str]:
    """The last ERROR lines of each child's log in ``log_dir`` (``name: message``), oldest file first: what
    a failed run shows before its temporary logs are removed."""
    out: list[str] = []
    for path in sorted(log_dir.glob("*.log")):
        found: list[str] = []
        with contextlib.suppress(OSError):
            for raw in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(raw)
                except ValueError:
                    if " ERROR " in raw:
                        found.append(raw.strip())
                    continue
                if isinstance(record, dict) and record.get("level") == "ERROR":
                    found.append(str(record.get("msg", "")))
        out.extend(f"{path.stem}: {msg}" for msg in found[-per_file:])
    return out


async def _run(up: Up, url: str | None, trace: list[TraceRequest], outcome: Outcome) -> None:
    """Check the server, start everything, replay; SIGINT and SIGTERM end it at once (exit 130 and 143)."""
    nc: Client | None = None
    with cancel_on_signals() as got:
        try:
            if url is not None:
                nc = await up.connect_checked(url)
                outcome.url = url
            started = up.start(url)
            outcome.result = await up.replay(started, trace, nc)
            up.say("replay done; stopping every process")
        except asyncio.CancelledError:
            if not got:
                raise
            up.say("\ninterrupted; stopping every process")
            outcome.code = 128 + got[0]
        except TransportError as exc:
            up.say(f"kvmesh up: {exc}", err=True)
            outcome.code = 1
        except Exception as exc:
            up.say(f"\nkvmesh up failed: {type(exc).__name__}: {exc}", err=True)
            for line in last_errors(up.log_dir):
                up.say(f"  {line}", err=True)
            if not up.args.log_dir:
                up.say("  (--log-dir DIR keeps every process's log after the run)", err=True)
            outcome.code = 1
        finally:
            if nc is not None:
                await close_quietly(nc, timeout_s=1.0)


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
        available = max(p.match_prefix(tokens) for p in pools)  # the fleet's best, as a router would see it
        captured = pool.match_prefix(tokens)
        try:
            adm = pool.start(f"r{i}", tokens)
        except PoolExhaustedError:
            continue
        for tok in output_tokens(tokens, req.output_length, seed=w)[:-1]:
            pool.append(f"r{i}", (tok,))
        pool.finish(f"r{i}")
        pool.take_events()
        tally.add(f"sim-{w}", adm.prompt_tokens, adm.cached_tokens, available=available, captured=captured)
    return tally


def print_receipts(out: TextIO, tally: Tally, policy: str = "kvmesh") -> None:
    """Print one policy's route receipts: reuse available in the fleet, captured by the choices and
    delivered by the engines, in prompt tokens (the same counters the router exports)."""
    t = tally.totals()
    print(
        f"route receipts, {policy}: available {t.available_tokens:,} tokens, captured {t.captured_tokens:,} "
        f"({100 * _ratio(t.captured_tokens, t.available_tokens):.1f} % of available; regret "
        f"{t.available_tokens - t.captured_tokens:,}), delivered {t.cached_tokens:,} "
        f"({100 * _ratio(t.cached_tokens, t.prompt_tokens):.1f} % of {t.prompt_tokens:,} prompt tokens)",
        file=out,
    )


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


def build_parser(prog: str = "kvmesh up") -> argparse.ArgumentParser:
    """Return the argument parser of ``kvmesh up`` (``prog`` names it in usage and errors)."""
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--nats-url",
        default=None,
        help="use this NATS server (with JetStream; a comma-separated list of servers is fine) instead of "
        "starting one; the run keeps to a stream and subjects of its own there and deletes them at the end "
        "[env KVMESH_NATS_URL]",
    )
    add_fields(p.add_argument_group("NATS credentials and TLS (with --nats-url)"), NatsAuth, "nats")
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
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the RFC #1403 indexer API (Mooncake's conductor, Dynamo's standalone indexer: POST /query, "
        "/query_by_hash, /register, ...) from the router on 127.0.0.1:PORT (0: a free one, printed; default: "
        "off)",
    )
    p.add_argument(
        "--cluster",
        type=int,
        default=None,
        metavar="N",
        help="run on a local cluster of N nats-server nodes; only 3, and only with --chaos",
    )
    p.add_argument(
        "--chaos",
        action="store_true",
        help="with --cluster 3: kill a random component every --chaos-every-s seconds for --duration seconds "
        "(default 60) and end with whether anything was lost (see above)",
    )
    p.add_argument(
        "--chaos-every-s",
        type=float,
        default=5.0,
        help="seconds between two kills with --chaos (default 5; at least 5)",
    )
    p.add_argument(
        "--chaos-seed", type=int, default=None, help="seed of which component --chaos kills (default: random)"
    )
    return p


def chaos_command(args: argparse.Namespace) -> int:
    """Run ``kvmesh up --cluster 3 --chaos`` (`kvmesh.bench.soak.run`); returns the exit code."""
    if not args.chaos:
        print(
            "kvmesh up: --cluster runs only with --chaos: add --chaos for a chaos run on a local 3-node cluster, "
            "or drop --cluster for the trace replay on one embedded server",
            file=sys.stderr,
        )
        return 2
    if args.cluster != 3:
        print(
            "kvmesh up: --chaos needs --cluster 3 (the R3 stream and buckets need three nodes)",
            file=sys.stderr,
        )
        return 2
    if args.nats_url:
        print("kvmesh up: --chaos starts and kills a cluster of its own; drop --nats-url", file=sys.stderr)
        return 2
    if args.chaos_every_s < 5 or (args.duration is not None and args.duration <= 0):
        print("kvmesh up: --chaos-every-s must be ≥ 5 and --duration > 0", file=sys.stderr)
        return 2
    from kvmesh.bench.soak import run  # noqa: PLC0415 - the fleet harness only for a chaos run

    work_dir = Path(args.log_dir) / "chaos" if args.log_dir else None
    return run(args.duration or 60.0, args.chaos_every_s, seed=args.chaos_seed, work_dir=work_dir)


def command(argv: Sequence[str] | None = None, prog: str = "kvmesh up") -> int:
    """Run ``kvmesh up`` (the ``up`` entry point of ``kvmesh.commands``); returns the exit code."""
    args = build_parser(prog).parse_args(argv)
    if args.cluster is not None or args.chaos:
        return chaos_command(args)
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
    if args.nats_url:
        url: str | None = str(args.nats_url)
        source = "--nats-url"
    elif os.environ.get("KVMESH_NATS_URL"):
        url = os.environ["KVMESH_NATS_URL"]
        source = "KVMESH_NATS_URL in the environment"
    else:
        url, source = None, ""
    try:
        auth = load(NatsAuth, service="nats", environ=os.environ, args=args)
        if auth != NatsAuth() and url is None:
            raise ConfigError(
                ["NATS credentials and TLS settings need --nats-url (the embedded server has none)"]
            )
        options = connect_options(auth)
    except KvmeshError as exc:
        print(f"kvmesh up: {exc}", file=sys.stderr)
        return 2
    up = Up(args, Namespace.unique() if url is not None else None, auth)
    up.nats_options = options
    up.say(f"kvmesh up: {len(trace)} requests from {Path(trace_path).name}, {args.workers} workers")
    if url is not None:
        up.say(f"using the NATS server at {redact_url(url)} (from {source}); stream {up.ns.stream}")
    outcome = Outcome()
    try:
        asyncio.run(_run(up, url, trace, outcome))
    finally:
        up.stop()
        if outcome.url is not None:
            asyncio.run(up.remove_namespace(outcome.url))
    if outcome.code is not None:
        return outcome.code
    assert outcome.result is not None
    tally, failures, elapsed, latencies = outcome.result
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
    print_receipts(sys.stdout, tally)
    print_receipts(sys.stdout, rr, "round-robin")
    return 0 if failures == 0 else 1
