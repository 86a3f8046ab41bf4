"""``kvmesh bench soak``: the whole fleet under traffic for N minutes, a random component killed every S seconds.

Runs `kvmesh.bench.fleet.Fleet` (real processes): a local 3-node nats-server cluster (R3 events stream and
buckets), 2 simulated engines of 2 ranks making up their own traffic, an ingest each, 2 indexers, 2 routers,
and a client routing prompts all along. Every ``--kill-every-s`` seconds one component drawn at random
(``--seed``) is killed with SIGKILL and started again: an ingest, an indexer, a router, an engine (it comes
back as a new incarnation), a NATS node, or the node that leads the events stream.

Every ``--sample-s`` seconds it samples the resident memory (``VmRSS`` in ``/proc/<pid>/status``) of every
process, the JetStream consumers on the events stream and on the worker registry bucket's stream
(``consumer_count``) and the client connections of all nodes (``/varz`` ``connections``). At the end it
quiesces the fleet (traffic over, stream quiet, every replica applied all of it), compares every indexer
replica's digest with an index built from what the engines recorded they published (the engines' truth) and
checks per-rank stream order against engine order. It prints one table (start, end and max of each figure,
its trend per minute and whether it stayed flat), the kills done and the routes answered, and a last line
``nothing lost: digests equal the engines' truth (…)`` or ``LOST: …`` with what differs.

Exit status: 0 when nothing was lost and every route was answered; 1 otherwise; 130/143 when interrupted.
``kvmesh up --cluster 3 --chaos`` runs the same (`run`) for ``--duration`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvmesh.bench.fleet import (
    KINDS,
    Check,
    Fleet,
    Routes,
    conclude,
    connect_client,
    route_loop,
    stream_messages,
    wait_for,
)
from kvmesh.client import Router
from kvmesh.runtime import subjects
from kvmesh.up import cancel_on_signals

__all__ = ["SoakResult", "build_parser", "command", "run"]

STARTUP_S = 45.0
"""Traffic time the engines get on top of the soak for the fleet to start (their traffic clock starts at once)."""
RSS_SLACK_KIB = 10 * 1024
"""RSS may end this much (plus 20 %) above its start and still count as flat."""
COUNT_SLACK = 2
"""Consumer and connection counts may end this much above their start and still count as flat."""


def rss_kib(pid: int) -> int | None:
    """Return the resident set size of process ``pid`` in KiB (``VmRSS``), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class Sample:
    """One sample of the fleet: seconds since the soak began, and the figures of `ROWS` (None: unknown)."""

    t: float
    values: dict[str, float | None]


ROWS = (
    "rss engine (MiB)",
    "rss ingest (MiB)",
    "rss indexer (MiB)",
    "rss router (MiB)",
    "rss nats-server (MiB)",
    "consumers on the events stream",
    "consumers on the registry stream",
    "client connections (all nodes)",
)
"""The table's rows; an RSS row is the largest process of its kind at each sample."""


async def take_sample(fleet: Fleet, js: Any, t: float) -> Sample:
    """Sample RSS per process kind, consumers on both streams and the nodes' client connections."""
    values: dict[str, float | None] = {}
    groups = {
        kind: [p.popen.pid for p in procs if p.alive and p.popen]
        for kind, procs in fleet.procs_by_kind().items()
    }
    groups["nats-server"] = fleet.cluster.pids()
    for kind, pids in groups.items():
        sizes = [k for k in (rss_kib(pid) for pid in pids) if k is not None]
        values[f"rss {kind} (MiB)"] = max(sizes) / 1024 if sizes else None
    for row, stream in (
        ("consumers on the events stream", subjects.STREAM),
        ("consumers on the registry stream", "KV_" + subjects.registry_bucket(subjects.STREAM)),
    ):
        try:
            values[row] = float((await js.stream_info(stream)).state.consumer_count)
        except Exception:  # a node is down or the stream elects a leader: unknown this time
            values[row] = None
    varz = await asyncio.gather(
        *(asyncio.to_thread(fleet.cluster.varz, i) for i in range(len(fleet.cluster.ports)))
    )
    up = [v for v in varz if v is not None]
    values["client connections (all nodes)"] = (
        float(sum(int(v.get("connections", 0)) for v in up)) if len(up) == len(varz) else None
    )
    return Sample(t=t, values=values)


def trend_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(seconds, value)`` points, per minute (0 with fewer than two distinct times)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return 60.0 * sum((t - mt) * (v - mv) for t, v in points) / var


@dataclass
class SoakResult:
    """What one soak did and found."""

    seconds: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    kills: list[str] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    routes: Routes = field(default_factory=Routes)
    check: Check | None = None
    error: str | None = None
    """Why the soak could not finish (the fleet did not start or quiesce); then nothing was checked."""

    def flat(self, row: str) -> tuple[float, float, float, float, bool] | None:
        """Return (start, end, max, trend per minute, flat) of one row, or None without two known values."""
        points = [(s.t, v) for s in self.samples if (v := s.values.get(row)) is not None]
        if len(points) < 2:
            return None
        start, end = points[0][1], points[-1][1]
        top = max(v for _, v in points)
        slack = RSS_SLACK_KIB / 1024 + 0.2 * start if row.startswith("rss") else COUNT_SLACK
        return start, end, top, trend_per_min(points), end <= start + slack

    def ok(self) -> bool:
        """Whether nothing was lost, no process died and every route was answered."""
        c = self.check
        return (
            self.error is None
            and c is not None
            and not (c.lost or c.dead or c.unanswered or c.truth.problems())
        )

    def print(self, out: TextIO) -> None:
        """Print the table, the kills, the routes and the final line."""
        head = f"{'':<34} {'start':>9} {'end':>9} {'max':>9} {'trend/min':>10}  verdict"
        print(head, file=out)
        print("─" * len(head), file=out)
        for row in ROWS:
            got = self.flat(row)
            if got is None:
                print(f"{row:<34} {'n/a':>9}", file=out)
                continue
            start, end, top, slope, flat = got
            fmt = "{:>9.1f}" if row.startswith("rss") else "{:>9.0f}"
            print(
                f"{row:<34} {fmt.format(start)} {fmt.format(end)} {fmt.format(top)} {slope:>+10.2f}  "
                f"{'flat' if flat else 'GREW'}",
                file=out,
            )
        print("─" * len(head), file=out)
        by_kind = ", ".join(f"{k} {self.kinds[k]}" for k in KINDS if self.kinds[k])
        print(f"kills done: {len(self.kills)} in {self.seconds:.0f} s ({by_kind or 'none'})", file=out)
        r = self.routes
        print(
            f"routes answered: {r.answered:,} of {r.sent:,} sent ({r.retries} retried after a timeout)",
            file=out,
        )
        if self.error is not None:
            print(f"LOST: the soak did not finish, nothing was checked: {self.error}", file=out)
            return
        c = self.check
        assert c is not None
        print(
            f"samples: {len(self.samples)}; events stream last seq {c.last:,}; ingest resyncs {len(c.order.resyncs)}",
            file=out,
        )
        for problem in [*c.dead, *c.unanswered]:
            print(problem, file=out)
        for problem in c.lost:
            print(problem, file=out)
        print(c.verdict(), file=out)


async def _sampler(
    fleet: Fleet, js: Any, *, t0: float, every_s: float, result: SoakResult, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        result.samples.append(await take_sample(fleet, js, time.monotonic() - t0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def _soak(
    fleet: Fleet,
    *,
    seconds: float,
    kill_every_s: float,
    seed: int,
    sample_s: float,
    out: TextIO,
    result: SoakResult,
) -> None:
    rng = random.Random(seed)
    started = time.monotonic()
    await fleet.start()
    nc = await connect_client(fleet.cluster.url(0))
    try:
        js = nc.jetstream()
        client = Router(nc, timeout_s=2.0)
        await fleet.until_ready(nc, client)
        await wait_for(
            lambda: stream_messages(js), lambda n: n > 0, timeout_s=30, what="traffic in the stream"
        )
        t0 = time.monotonic()
        end = min(t0 + seconds, fleet.traffic_end - 2.0)
        print(
            f"[{0.0:6.1f} s] fleet ready in {t0 - started:.0f} s: traffic for {end - t0:.0f} s more, a kill every "
            f"{kill_every_s:g} s",
            file=out,
            flush=True,
        )
        stop_routes, stop_samples = asyncio.Event(), asyncio.Event()
        routes_task = asyncio.create_task(route_loop(client, stop_routes, result.routes))
        sampler = asyncio.create_task(
            _sampler(fleet, js, t0=t0, every_s=sample_s, result=result, stop=stop_samples)
        )
        next_kill = t0 + kill_every_s
        while next_kill < end - 1.0:
            await asyncio.sleep(max(0.0, next_kill - time.monotonic()))
            kind = rng.choice(KINDS)
            what = await fleet.kill_and_restart(kind, js, rng.randrange(4))
            result.kills.append(what)
            result.kinds[kind] += 1
            print(f"[{time.monotonic() - t0:6.1f} s] {what}, restarted", file=out, flush=True)
            next_kill = max(next_kill + kill_every_s, time.monotonic() + 1.0)
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        result.seconds = time.monotonic() - t0
        print(
            f"[{result.seconds:6.1f} s] traffic ending; quiescing and checking against the engines' truth",
            file=out,
            flush=True,
        )
        stop_samples.set()
        await sampler
        result.check = await conclude(fleet, nc, result.routes, stop_routes, routes_task)
        # the end sample: everything up again and quiet
        await asyncio.sleep(sample_s)
        result.samples.append(await take_sample(fleet, js, time.monotonic() - t0))
    finally:
        await nc.close()


def run(
    seconds: float,
    kill_every_s: float,
    *,
    seed: int | None = None,
    sample_s: float = 5.0,
    work_dir: Path | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Soak the fleet for ``seconds`` with a kill every ``kill_every_s``; print the report; return the exit status.

    Args:
        seconds: traffic and kills, counted from the fleet being ready.
        kill_every_s: seconds between kills (≥ 5: a node stays down 3 s).
        seed: draws of the killed components (None: a random seed, printed).
        sample_s: seconds between samples.
        work_dir: keep stores, logs and engine records here (None: a temporary directory, removed).
        out: where the report goes.
    """
    seed = random.randrange(1 << 30) if seed is None else seed
    root = Path(tempfile.mkdtemp(prefix="kvmesh-soak-")) if work_dir is None else work_dir
    print(
        f"soak: {seconds:g} s of traffic on a 3-node cluster, a random kill -9 every {kill_every_s:g} s "
        f"(seed {seed}); files in {root if work_dir else 'a temporary directory'}",
        file=out,
        flush=True,
    )
    fleet = Fleet(root / "fleet", traffic_s=seconds + STARTUP_S)
    result = SoakResult()

    async def main() -> int | None:
        with cancel_on_signals() as got:
            try:
                await _soak(
                    fleet,
                    seconds=seconds,
                    kill_every_s=kill_every_s,
                    seed=seed,
                    sample_s=sample_s,
                    out=out,
                    result=result,
                )
            except asyncio.CancelledError:
                if not got:
                    raise
                return 128 + got[0]
            except Exception as exc:  # AssertionError included: the fleet did not start or quiesce in time
                result.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                print(f"the soak failed: {exc}\n{fleet.logs_tail(8)}", file=out)
        return None

    try:
        interrupted = asyncio.run(main())
    finally:
        fleet.stop()
        if work_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if interrupted is not None:
        print("interrupted; every process stopped", file=out)
        return interrupted
    result.print(out)
    return 0 if result.ok() else 1


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``kvmesh bench soak``."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, required=True, help="minutes of traffic and kills (0.5 is fine)")
    p.add_argument(
        "--kill-every-s", type=float, default=15.0, help="seconds between two kills (default 15; at least 5)"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="seed of which component is killed (default: random)"
    )
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between two samples (default 5)")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keep the stores, logs and engine records in this new directory (default: a temporary one, removed)",
    )
    return p


def command(argv: Sequence[str] | None = None) -> int:
    """Run ``kvmesh bench soak``; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.minutes <= 0 or args.kill_every_s < 5 or args.sample_s <= 0:
        print("kvmesh bench soak: --minutes and --sample-s must be > 0, --kill-every-s ≥ 5", file=sys.stderr)
        return 2
    if args.work_dir is not None and args.work_dir.exists():
        print(f"kvmesh bench soak: --work-dir {args.work_dir} exists; name a new directory", file=sys.stderr)
        return 2
    return run(
        args.minutes * 60.0, args.kill_every_s, seed=args.seed, sample_s=args.sample_s, work_dir=args.work_dir
    )
