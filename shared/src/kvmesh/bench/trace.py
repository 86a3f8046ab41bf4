"""``kvmesh bench trace``: replay a Mooncake trace against a simulated fleet, once per routing policy.

Every policy serves the same requests on the same fleet: N `kvmesh.sim.timing.TimedWorker` engines (vLLM-like
block pools with a timing model), in simulated time. Per policy it reports the prefix-cache hit ratio, the
simulated time to first token (p50/p99), the simulated request rate, and, for kvmesh, the router latency.

* ``kvmesh`` runs through the real pipeline: each engine publishes its KV events on a real ZMQ PUB + replay
  socket at the wall time matching their simulated time (simulated time = wall time × ``--speed``), one
  ``kvmesh ingest`` process per engine puts them on JetStream, a ``kvmesh indexer`` and a ``kvmesh router``
  (child processes, on a private ``nats-server``) answer each request through `kvmesh.client.Router`.
  The router only ever knows what the events told it, with the pipeline's real lag.
* ``round-robin``, ``random`` and ``least-loaded`` (fewest waiting + running requests) are computed
  in-process, as fast as the CPU allows (they do not read the caches).
* ``oracle`` knows every pool and queue instantly: the worker with the lowest estimated TTFT
  (`kvmesh.sim.timing.TimedWorker.estimate_ttft_s` of the prompt's tokens not hit in that worker's pool, by
  `kvmesh.sim.blockpool.BlockPool.match_prefix`).
* ``longest-prefix`` (only with ``--policies``): the worker with the longest real prefix hit, ties to the
  fewest active requests. On Mooncake traces every prompt starts with the same block, so it sends nearly
  everything to one worker: it shows why a cache-aware router must weigh load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvmesh.bench.chart import write_bar_charts
from kvmesh.runtime.procs import ChildProcesses
from kvmesh.sim.blockpool import BlockPool
from kvmesh.sim.engine import output_tokens
from kvmesh.sim.publisher import EventPublisher
from kvmesh.sim.timing import RequestTiming, StepBatch, TimedWorker, TimingModel
from kvmesh.sim.trace import TraceRequest, default_trace_path, expand_tokens, load_trace

__all__ = ["POLICIES", "PolicyResult", "command", "run_bench", "simulate_policy"]

POLICIES: Final[tuple[str, ...]] = ("kvmesh", "round-robin", "random", "least-loaded", "oracle")
"""The policies run by default."""
EXTRA_POLICIES: Final[tuple[str, ...]] = ("longest-prefix",)
"""Policies run only when asked for with ``--policies``."""
MODEL: Final[str] = "bench-model"
_REPLAY_STEPS: Final[int] = 2000
"""Batches each engine keeps for replay (a prompt's batch carries its token ids: ~20 KB)."""
_LATE_S: Final[float] = 0.010
"""A batch published more than this many wall seconds after its time counts as late."""


@dataclass(slots=True, kw_only=True)
class PolicyResult:
    """The outcome of one policy on the trace."""

    policy: str
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    makespan_s: float = 0.0
    """Simulated time from the first arrival to the last finish."""
    wall_s: float = 0.0
    route_latency_s: list[float] = field(default_factory=list)
    per_worker: list[int] = field(default_factory=list)
    """Requests served per worker."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        """Cached prompt tokens over prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_s(self) -> float:
        """Served requests per second of simulated time."""
        return self.requests / self.makespan_s if self.makespan_s > 0 else 0.0

    def add(self, t: RequestTiming) -> None:
        """Count one finished (or rejected) request."""
        if t.rejected:
            self.rejected += 1
            return
        self.requests += 1
        self.prompt_tokens += t.prompt_tokens
        self.cached_tokens += t.cached_tokens
        if t.ttft_s is not None:
            self.ttft_s.append(t.ttft_s)


def percentile(values: Sequence[float], q: float) -> float:
    """Return the ``q`` quantile (0..1) of ``values`` by the nearest-rank rule (nan when empty)."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


# ---------------------------------------------------------------------- the simulated fleet


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetSpec:
    """Shape of the simulated fleet."""

    workers: int = 8
    num_blocks: int = 16384
    block_size: int = 16
    seed: int = 0
    timing: TimingModel = field(default_factory=TimingModel)

    def build(self) -> list[TimedWorker]:
        """Return fresh workers (worker i's pool has hash seed ``seed + i``, as `kvmesh sim`)."""
        return [
            TimedWorker(
                BlockPool(num_blocks=self.num_blocks, block_size=self.block_size, seed=self.seed + i),
                self.timing,
            )
            for i in range(self.workers)
        ]


@dataclass(slots=True)
class _Prepared:
    request_id: str
    arrival_s: float
    tokens: list[int]
    outputs: list[int]


def _prepare(req: TraceRequest, i: int, t0_ms: int) -> _Prepared:
    tokens = expand_tokens(req)
    return _Prepared(
        f"req-{i}", (req.timestamp_ms - t0_ms) / 1000.0, tokens, output_tokens(tokens, req.output_length)
    )


def _choose(policy: str, workers: list[TimedWorker], i: int, tokens: list[int], rng: random.Random) -> int:
    n = len(workers)
    if policy == "round-robin":
        return i % n
    if policy == "random":
        return rng.randrange(n)
    if policy == "least-loaded":
        return min(range(n), key=lambda k: (workers[k].active, k))
    if policy == "longest-prefix":
        return min(range(n), key=lambda k: (-workers[k].pool.match_prefix(tokens), workers[k].active, k))
    if policy == "oracle":
        now = max(w.now_s for w in workers)
        return min(
            range(n),
            key=lambda k: (
                workers[k].estimate_ttft_s(len(tokens) - workers[k].pool.match_prefix(tokens), now),
                k,
            ),
        )
    raise ValueError(f"unknown policy {policy!r}")


def simulate_policy(policy: str, trace: Sequence[TraceRequest], spec: FleetSpec) -> PolicyResult:
    """Serve ``trace`` on a fresh fleet with an in-process policy (not ``kvmesh``), in simulated time."""
    workers = spec.build()
    rng = random.Random(spec.seed)
    result = PolicyResult(policy=policy, per_worker=[0] * spec.workers)
    t0_ms = trace[0].timestamp_ms if trace else 0
    start = time.perf_counter()
    for i, req in enumerate(trace):
        p = _prepare(req, i, t0_ms)
        for w in workers:
            w.advance(p.arrival_s)
        k = _choose(policy, workers, i, p.tokens, rng)
        result.per_worker[k] += 1
        workers[k].submit(p.request_id, p.tokens, p.outputs, arrival_s=p.arrival_s)
    _finish(workers, result, trace, t0_ms)
    result.wall_s = time.perf_counter() - start
    return result


def _finish(
    workers: list[TimedWorker], result: PolicyResult, trace: Sequence[TraceRequest], t0_ms: int
) -> None:
    last = 0.0
    for w in workers:
        w.advance(math.inf)
        for t in w.take_finished():
            result.add(t)
            if t.finished_s is not None:
                last = max(last, t.finished_s)
        result.extra["decode_overflows"] = result.extra.get("decode_overflows", 0) + w.decode_overflows
    result.makespan_s = last - ((trace[0].timestamp_ms - t0_ms) / 1000.0 if trace else 0.0)


# ---------------------------------------------------------------------- the real pipeline


class _Pipeline:
    """A private nats-server, one ingest per engine, an indexer and a router, as child processes."""

    def __init__(self, workers: int, block_size: int, log_dir: Path | None) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-"))
        self.log_dir = log_dir or self.tmp / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers = workers
        self.block_size = block_size
        self.children = ChildProcesses(self.log_dir)
        self.server: Any = None
        self.publishers: list[EventPublisher] = []

    def start(self, nats_url: str | None) -> str:
        from kvmesh.runtime.server import NatsServer  # noqa: PLC0415 - only the kvmesh policy needs it

        if nats_url is None:
            self.server = NatsServer(store_dir=self.tmp / "nats").start()
            nats_url = str(self.server.url)
        for i in range(self.workers):
            pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=_REPLAY_STEPS)
            self.publishers.append(pub)
            self._spawn(
                f"ingest-{i}", "kvmesh.ingest", "--nats-url", nats_url, "--worker-id", f"sim-{i}",
                "--model", MODEL, "--zmq-endpoint", pub.endpoint, "--replay-endpoint", str(pub.replay_endpoint),
                "--block-size", str(self.block_size),
            )  # fmt: skip
        self._spawn("indexer", "kvmesh.indexer", "--nats-url", nats_url)
        self._spawn("router", "kvmesh.router", "--nats-url", nats_url)
        return nats_url

    def _spawn(self, name: str, module: str, *argv: str) -> None:
        self.children.spawn(name, "-m", module, *argv)

    def check(self) -> None:
        self.children.check()

    def stop(self) -> None:
        for pub in self.publishers:
            pub.close()
        self.children.stop()
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


async def _wait_ready(pipe: _Pipeline, router: Any, timeout_s: float = 90.0) -> None:
    from kvmesh.client import RouteError  # noqa: PLC0415

    for pub in pipe.publishers:
        while pub.subscriptions < 1:
            pipe.check()
            await asyncio.sleep(0.05)
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        pipe.check()
        try:
            reply = await router.route(MODEL, [0] * pipe.block_size, explain=True)
            if reply.scores is not None and len(reply.scores) >= pipe.workers:
                return
            last = f"router knows {len(reply.scores or [])} of {pipe.workers} workers"
        except RouteError as exc:
            last = f"{exc.code}: {exc.message}"
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the pipeline did not become ready in {timeout_s:g} s ({last})")


async def run_kvmesh(
    trace: Sequence[TraceRequest], spec: FleetSpec, *, speed: float, nats_url: str | None = None,
    log_dir: Path | None = None, say: Callable[[str], None] = print,
) -> PolicyResult:  # fmt: skip
    """Serve ``trace`` routed by the real kvmesh pipeline, simulated time running ``speed`` × wall time."""
    from kvmesh.client import RouteError, Router  # noqa: PLC0415
    from kvmesh.runtime.nats import connect  # noqa: PLC0415

    workers = spec.build()
    result = PolicyResult(policy="kvmesh", per_worker=[0] * spec.workers)
    pipe = _Pipeline(spec.workers, spec.block_size, log_dir)
    loop = asyncio.get_running_loop()
    try:
        url = pipe.start(nats_url)
        nc = await connect(url, name="kvmesh-bench")
        router = Router(nc, timeout_s=5.0)
        notify = [m for m in ("mark_prefill_done", "finish") if callable(getattr(router, m, None))]
        try:
            await _wait_ready(pipe, router)
            say(f"  pipeline ready ({spec.workers} ingests, indexer, router); replaying at speed {speed:g}×")
            t0_ms = trace[0].timestamp_ms if trace else 0
            wall0 = loop.time()
            late: list[float] = []
            tasks: set[asyncio.Task[Any]] = set()

            async def publish_until(until_s: float) -> None:
                merged: list[tuple[float, int, StepBatch]] = []
                for k, w in enumerate(workers):
                    merged.extend((b.time_s, k, b) for b in w.advance(until_s))
                merged.sort(key=lambda x: (x[0], x[1]))
                for time_s, k, batch in merged:
                    delay = wall0 + time_s / speed - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    elif delay < -_LATE_S:
                        late.append(-delay)
                    pipe.publishers[k].publish(batch.events)
                if notify:
                    for w in workers:
                        for t in w.take_first_tokens():
                            _fire(tasks, router, "mark_prefill_done", t.request_id, notify)
                await asyncio.sleep(0)

            last_finish = 0.0

            def collect() -> None:
                nonlocal last_finish
                for w in workers:
                    for t in w.take_finished():
                        result.add(t)
                        if t.finished_s is not None:
                            last_finish = max(last_finish, t.finished_s)
                            _fire(tasks, router, "finish", t.request_id, notify)

            start = time.perf_counter()
            for i, req in enumerate(trace):
                p = _prepare(req, i, t0_ms)
                await publish_until(p.arrival_s)
                collect()
                delay = wall0 + p.arrival_s / speed - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                t_route = time.perf_counter()
                try:
                    reply = await router.route(MODEL, p.tokens, request_id=p.request_id)
                    k = int(reply.worker_id.removeprefix("sim-"))
                except RouteError as exc:
                    result.extra["route_errors"] = result.extra.get("route_errors", 0) + 1
                    say(
                        f"  {p.request_id}: route failed ({exc.code}: {exc.message}); sent to worker {i % spec.workers}"
                    )
                    k = i % spec.workers
                result.route_latency_s.append(time.perf_counter() - t_route)
                result.per_worker[k] += 1
                workers[k].submit(p.request_id, p.tokens, p.outputs, arrival_s=p.arrival_s)
                await publish_until(p.arrival_s)
                collect()
                if (i + 1) % max(1, len(trace) // 10) == 0:
                    say(
                        f"  [{i + 1}/{len(trace)}] simulated {p.arrival_s:.1f} s, wall {loop.time() - wall0:.1f} s"
                    )
            # Let the fleet drain: publish every remaining step at its time.
            while any(w.next_time_s() is not None for w in workers):
                nxt = min(t for w in workers if (t := w.next_time_s()) is not None)
                await publish_until(nxt)
                collect()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            result.wall_s = time.perf_counter() - start
            result.makespan_s = last_finish - (trace[0].timestamp_ms - t0_ms) / 1000.0 if trace else 0.0
            result.extra["batches_late_over_10ms"] = len(late)
            result.extra["max_late_ms"] = round(1e3 * max(late, default=0.0), 1)
            result.extra["decode_overflows"] = sum(w.decode_overflows for w in workers)
        finally:
            await nc.close()
        return result
    finally:
        pipe.stop()


def _fire(
    tasks: set[asyncio.Task[Any]], router: Any, method: str, request_id: str, notify: list[str]
) -> None:
    if method not in notify:
        return
    task = asyncio.ensure_future(getattr(router, method)(request_id))
    tasks.add(task)
    task.add_done_callback(tasks.discard)


# ---------------------------------------------------------------------- report


def table(results: Sequence[PolicyResult]) -> str:
    """Return the per-policy Markdown table."""
    rows = [
        "| policy | requests | hit ratio | vs oracle | TTFT p50 (s) | TTFT p99 (s) | requests/s (simulated) | router p50 / p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    oracle = next((r for r in results if r.policy == "oracle"), None)
    for r in results:
        vs = f"{r.hit_ratio / oracle.hit_ratio:.3f}" if oracle and oracle.hit_ratio else "–"
        lat = (
            f"{1e3 * percentile(r.route_latency_s, 0.5):.2f} / {1e3 * percentile(r.route_latency_s, 0.99):.2f}"
            if r.route_latency_s
            else "–"
        )
        rows.append(
            f"| {r.policy} | {r.requests} | {100 * r.hit_ratio:.1f} % | {vs} | {percentile(r.ttft_s, 0.5):.3f} | "
            f"{percentile(r.ttft_s, 0.99):.3f} | {r.requests_per_s:.2f} | {lat} |"
        )
    return "\n".join(rows)


async def run_bench(args: argparse.Namespace, say: Callable[[str], None] = print) -> list[PolicyResult]:
    """Run every selected policy on the trace; return the results in `POLICIES` order."""
    trace = load_trace(args.trace, limit=args.requests)
    spec = FleetSpec(
        workers=args.workers,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        seed=args.seed,
        timing=TimingModel(
            prefill_s_per_token=args.prefill_ms_per_1k_tokens / 1e6,
            prefill_overhead_s=args.prefill_overhead_ms / 1e3,
            decode_s_per_token=args.decode_ms_per_token / 1e3,
            max_batch=args.max_batch,
        ),
    )
    span = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1e3 if trace else 0.0
    say(
        f"kvmesh bench trace: {len(trace)} requests from {args.trace} ({span:.0f} s of arrivals), {spec.workers} workers"
    )
    results: list[PolicyResult] = []
    for policy in args.policies:
        say(f"policy {policy}")
        if policy == "kvmesh":
            r = await run_kvmesh(
                trace, spec, speed=args.speed, nats_url=args.nats_url, log_dir=args.log_dir, say=say
            )
        else:
            r = simulate_policy(policy, trace, spec)
        say(
            f"  hit ratio {100 * r.hit_ratio:.1f} %, TTFT p50 {percentile(r.ttft_s, 0.5):.3f} s, "
            f"p99 {percentile(r.ttft_s, 0.99):.3f} s, {r.wall_s:.1f} s wall"
        )
        results.append(r)
    return results


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``kvmesh bench trace``."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench trace", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_trace = default_trace_path()
    p.add_argument(
        "--trace",
        type=Path,
        default=default_trace,
        help="Mooncake JSONL trace, such as the full conversation_trace.jsonl of the Mooncake release "
        "(default: the packaged 1,000-request excerpt)",
    )
    p.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--workers", type=int, default=8, help="simulated engines (default 8)")
    p.add_argument("--num-blocks", type=int, default=16384, help="KV blocks per engine (default 16384)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument(
        "--speed", type=float, default=10.0, help="simulated seconds per wall second for kvmesh (default 10)"
    )
    p.add_argument(
        "--prefill-ms-per-1k-tokens",
        type=float,
        default=100.0,
        help="prefill cost of 1,000 uncached tokens (default 100 ms)",
    )
    p.add_argument(
        "--prefill-overhead-ms", type=float, default=5.0, help="fixed cost of a prefill (default 5 ms)"
    )
    p.add_argument(
        "--decode-ms-per-token", type=float, default=20.0, help="time per output token (default 20 ms)"
    )
    p.add_argument("--max-batch", type=int, default=32, help="running requests per engine (default 32)")
    p.add_argument("--seed", type=int, default=0, help="hash seed base and random policy seed")
    p.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated subset of " + ", ".join(POLICIES)
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-trace"),
        help="write <out>.md and <out>.png (default bench-trace)",
    )
    p.add_argument("--nats-url", default=None, help="use this NATS server instead of a private one")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the child processes' logs here")
    return p


def command(argv: Sequence[str] | None = None) -> int:
    """Run ``kvmesh bench trace``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in args.policies if p not in POLICIES + EXTRA_POLICIES]
    if unknown or args.workers < 1 or args.speed <= 0:
        parser.error(f"unknown policies {unknown}" if unknown else "--workers must be >= 1 and --speed > 0")
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    results = asyncio.run(run_bench(args))
    text = table(results)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    md = args.out.with_suffix(".md")
    png = args.out.with_suffix(".png")
    md.write_text(text + "\n")
    backend = write_bar_charts(
        png,
        f"Mooncake trace, {args.workers} simulated workers, {len(results[0].ttft_s) if results else 0} requests",
        [r.policy for r in results],
        [
            ("prefix-cache hit ratio (%)", [100 * r.hit_ratio for r in results]),
            ("TTFT p50 (s)", [percentile(r.ttft_s, 0.5) for r in results]),
            ("TTFT p99 (s)", [percentile(r.ttft_s, 0.99) for r in results]),
        ],
    )
    print(f"\nwrote {md} and {png} ({backend})")
    for r in results:
        if r.extra:
            print(f"{r.policy}: {r.extra}")
    return 0
