"""``kvmesh bench scale``: how match, route, memory and snapshots grow with the fleet and the index.

Sweeps ``--workers`` (default 8, 64, 256, 1024) × ``--blocks`` (default 1M, 10M) with the worst realistic
sharing: one hot prefix of ``--hot-blocks`` blocks (default 32, the system prompt every conversation of the
Mooncake traces starts with) held by **every** worker, plus per-worker conversations of up to 224 blocks
chained onto it (block size 16), until each worker holds ``blocks / workers`` blocks. Every engine hash is a
distinct random 63-bit value (each worker hashes its own copy of the hot prefix).

Per point (workers, blocks):

* **match** p50/p99 in µs: in-process `kvmesh.core.index.PrefixIndex.match` and ``match_tiers`` on the
  prefix keys of 4,096-token prompts (256 blocks) that share the hot prefix and continue into the first k
  blocks of one worker's conversation (k uniform), then fresh tokens; every answer is checked against the
  truth (that worker: hot + k blocks, every other worker: the hot prefix).
* **route** p50/p99 in ms through NATS: the stored messages are published to a private ``nats-server``'s
  JetStream stream, then one ``kvmesh indexer`` and one ``kvmesh router --index local`` start and replay
  it; the same prompts go through `kvmesh.client.Router.route` at concurrency 1. ``to longest`` counts the
  replies naming the worker with the longest overlap. **Under events**: the same routes again, each 2 ms
  after one events message (a new block of the next worker) is published to the stream, so the router
  applies a message between every two routes, as under a live fleet's KV events.
* **memory** per block: resident-set growth of a fresh process storing that many blocks over that many
  workers (the method of ``kvmesh bench index --memory``, `kvmesh.bench.index.memory_per_block`).
* **snapshot** size and **restore** time: `kvmesh.core.state.IndexState.export` encoded with
  `kvmesh.core.snapshot.encode_snapshot`; restore = `decode_snapshot` (verify + decode) + ``from_export``
  (rebuild), in-process, no Object Store.

Prints a table with the targets of issue 14 beside it (route p50 at the most workers ≤ 2× that at the
fewest, still and under events; memory per block flat from the fewest to the most blocks, here: within 10 %), writes
``PREFIX.json`` and, with matplotlib, ``PREFIX.png`` (``--out PREFIX``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvmesh.bench.outputs import out_prefix
from kvmesh.bench.trace import percentile
from kvmesh.core.events import EventsMessage, Stored, encode_message
from kvmesh.core.hashing import local_block_hashes, prompt_prefix_keys
from kvmesh.core.index import Holder, PrefixIndex
from kvmesh.core.snapshot import decode_snapshot, encode_snapshot
from kvmesh.core.state import IndexState

__all__ = ["ScalePoint", "ScaleWorkload", "command", "make_workload", "measure_point", "parse_count"]

MODEL: Final[str] = "bench-model"
BLOCK_SIZE: Final[int] = 16
HOT_BLOCKS: Final[int] = 32
CONV_BLOCKS: Final[int] = 224
"""Blocks of one conversation after the hot prefix: 32 + 224 = 256 blocks = a 4,096-token prompt."""
PROMPT_TOKENS: Final[int] = (HOT_BLOCKS + CONV_BLOCKS) * BLOCK_SIZE
EVENTS_PER_MESSAGE: Final[int] = 16
ROUTE_TARGET_RATIO: Final[float] = 2.0
MEMORY_FLAT_RATIO: Final[float] = 1.10
DEFAULT_WORKERS: Final[str] = "8,64,256,1024"
DEFAULT_BLOCKS: Final[str] = "1M,10M"


def parse_count(text: str) -> int:
    """``"100000"``, ``"100k"``, ``"1M"``, ``"1.5M"`` → an int (k = 10³, M = 10⁶).

    Raises:
        ValueError: not a positive count.
    """
    t = text.strip().replace("_", "").replace(",", "")
    scale = {"k": 1_000, "K": 1_000, "m": 1_000_000, "M": 1_000_000}.get(t[-1:], 1)
    n = int(float(t[:-1]) * scale) if scale > 1 else int(t)
    if n <= 0:
        raise ValueError(f"not a positive count: {text!r}")
    return n


def _tokens(seed: int, n: int) -> array[int]:
    """``n`` pseudo-random token ids below 65,536, reproducible from ``seed``."""
    return array("I", array("H", random.Random(seed).randbytes(2 * n)))


@dataclass(slots=True)
class ScaleWorkload:
    """The stream messages of one point and the prompts to ask after them."""

    workers: int
    messages: list[EventsMessage] = field(default_factory=list)
    hot_tokens: list[int] = field(default_factory=list)
    conversations: list[tuple[int, int, int]] = field(default_factory=list)
    """(worker, token seed, blocks) of every stored conversation."""
    stored_blocks: int = 0
    queries: list[list[int]] = field(default_factory=list)
    """4,096-token prompts."""
    expected: list[tuple[int, int]] = field(default_factory=list)
    """Per query: (the conversation's worker, its overlap in blocks); every other worker: `HOT_BLOCKS`."""

    def conversation_tokens(self, index: int) -> array[int]:
        """Token ids of conversation ``index`` after the hot prefix."""
        _w, seed, n = self.conversations[index]
        return _tokens(seed, n * BLOCK_SIZE)


def worker_id(w: int) -> str:
    """The worker id of worker number ``w``."""
    return f"w{w}"


def make_workload(workers: int, blocks: int, *, queries: int = 200, seed: int = 0) -> ScaleWorkload:
    """Build the messages of ``blocks`` stored blocks over ``workers`` workers, hot prefix first.

    Each worker stores the hot prefix (`HOT_BLOCKS` blocks, no parent) and then conversations of up to
    `CONV_BLOCKS` blocks, each a `Stored` whose parent is the worker's last hot block, until it holds
    ``max(HOT_BLOCKS, blocks // workers)`` blocks; `EVENTS_PER_MESSAGE` events per message.

    Raises:
        ValueError: ``workers`` or ``queries`` not positive.
    """
    if workers <= 0 or queries <= 0:
        raise ValueError("workers and queries must be positive")
    rng = random.Random(seed)
    wl = ScaleWorkload(workers=workers)
    hot = _tokens(1_000_003 + seed, HOT_BLOCKS * BLOCK_SIZE)
    wl.hot_tokens = list(hot)
    hot_local = local_block_hashes(hot, BLOCK_SIZE)
    per_worker = max(HOT_BLOCKS, blocks // workers)
    for w in range(workers):
        hot_engine = [rng.getrandbits(63) for _ in range(HOT_BLOCKS)]
        events: list[Any] = [Stored(hot_engine, None, list(hot_local))]
        stored = HOT_BLOCKS
        msg_seq = 0
        while events or stored < per_worker:
            if stored < per_worker:
                n = min(CONV_BLOCKS, per_worker - stored)
                conv_seed = 2_000_000 + seed * 10_000_000 + len(wl.conversations)
                local = local_block_hashes(_tokens(conv_seed, n * BLOCK_SIZE), BLOCK_SIZE)
                events.append(Stored([rng.getrandbits(63) for _ in range(n)], hot_engine[-1], local))
                wl.conversations.append((w, conv_seed, n))
                stored += n
            if len(events) >= EVENTS_PER_MESSAGE or stored >= per_worker:
                wl.messages.append(
                    EventsMessage(
                        worker_id=worker_id(w), dp_rank=0, model=MODEL, block_size=BLOCK_SIZE, epoch=0,
                        seq=msg_seq, events=events,
                    )
                )  # fmt: skip
                msg_seq += 1
                events = []
        wl.stored_blocks += stored
    qrng = random.Random(seed + 7)
    for i in range(queries):
        c = qrng.randrange(len(wl.conversations)) if wl.conversations else -1
        if c < 0:
            tail: list[int] = []
            w, k = 0, 0
        else:
            w, _s, n = wl.conversations[c]
            k = qrng.randint(0, n)
            tail = list(wl.conversation_tokens(c)[: k * BLOCK_SIZE])
        fresh = _tokens(50_000_000 + seed * 1_000_000 + i, PROMPT_TOKENS - len(hot) - len(tail))
        wl.queries.append([*wl.hot_tokens, *tail, *fresh])
        wl.expected.append((w, HOT_BLOCKS + k))
    return wl


def expected_overlaps(wl: ScaleWorkload, i: int) -> dict[str, int]:
    """Query ``i``'s true overlap per worker id (every worker holds the hot prefix)."""
    out = {worker_id(w): HOT_BLOCKS for w in range(wl.workers)}
    w, n = wl.expected[i]
    out[worker_id(w)] = n
    return out


@dataclass(slots=True)
class ScalePoint:
    """The figures of one (workers, blocks) point; times in seconds unless the name says otherwise."""

    workers: int
    blocks: int
    """Blocks asked for."""
    stored_blocks: int = 0
    conversations: int = 0
    messages: int = 0
    build_s: float = 0.0
    """In-process `IndexState.apply` of every message."""
    queries: int = 0
    match_p50_us: float = 0.0
    match_p99_us: float = 0.0
    match_tiers_p50_us: float = 0.0
    match_tiers_p99_us: float = 0.0
    match_wrong: int = 0
    """Queries where `PrefixIndex.match` or ``match_tiers`` differs from the truth."""
    snapshot_bytes: int = 0
    snapshot_encode_s: float = 0.0
    restore_decode_s: float = 0.0
    restore_rebuild_s: float = 0.0
    restore_s: float = 0.0
    restored_equal: bool = False
    """The restored state's digest equals the original's."""
    memory_bytes_per_block: float | None = None
    route_requests: int = 0
    route_p50_ms: float | None = None
    route_p99_ms: float | None = None
    route_errors: int = 0
    route_to_longest: int = 0
    """Replies naming the worker with the longest overlap."""
    route_ready_s: float | None = None
    """From the indexer's and router's start to the router answering from the whole stream."""
    route_live_p50_ms: float | None = None
    route_live_p99_ms: float | None = None
    """The same routes with one events message (a new block of the next worker) published before each: the
    router applies a message between every two routes, as under a fleet's stream of KV events."""


def _time_match(fn: Callable[[list[int]], dict[Holder, Any]], keys: list[list[int]]) -> tuple[list[float], list[dict[Holder, Any]]]:  # fmt: skip
    perf = time.perf_counter
    times: list[float] = []
    answers: list[dict[Holder, Any]] = []
    for q in keys:
        t0 = perf()
        answer = fn(q)
        times.append((perf() - t0) * 1e6)
        answers.append(answer)
    return times, answers


def measure_inprocess(wl: ScaleWorkload, point: ScalePoint, *, repeat: int = 3) -> None:
    """Build the index in-process, time matches (best of ``repeat`` passes per query), check every answer,
    and measure the snapshot; fills ``point``."""
    state = IndexState()
    t0 = time.perf_counter()
    for seq, m in enumerate(wl.messages, 1):
        state.apply(seq, m)
    point.build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    data = encode_snapshot(state.export())
    point.snapshot_encode_s = time.perf_counter() - t0
    point.snapshot_bytes = len(data)
    digest = state.digest()
    del state
    t0 = time.perf_counter()
    export = decode_snapshot(data)
    t1 = time.perf_counter()
    restored = IndexState.from_export(export)
    t2 = time.perf_counter()
    point.restore_decode_s, point.restore_rebuild_s, point.restore_s = t1 - t0, t2 - t1, t2 - t0
    point.restored_equal = restored.digest() == digest
    del restored, export
    (model, _bs, ix) = decode_snapshot(data).indexes[0]
    assert model == MODEL
    index = PrefixIndex.from_export(ix)
    del data
    keys = [prompt_prefix_keys(q, BLOCK_SIZE) for q in wl.queries]
    best_match: list[float] = []
    best_tiers: list[float] = []
    for r in range(max(1, repeat)):
        t_match, a_match = _time_match(index.match, keys)
        t_tiers, a_tiers = _time_match(index.match_tiers, keys)
        best_match = t_match if not r else [min(a, b) for a, b in zip(best_match, t_match, strict=True)]
        best_tiers = t_tiers if not r else [min(a, b) for a, b in zip(best_tiers, t_tiers, strict=True)]
    wrong = 0
    for i, (plain, tiered) in enumerate(zip(a_match, a_tiers, strict=True)):
        truth = expected_overlaps(wl, i)
        got = {h.worker_id: n for h, n in plain.items()}
        got_tiers = {h.worker_id: o.blocks for h, o in tiered.items()}
        wrong += got != truth or got_tiers != truth
    point.queries = len(keys)
    point.match_p50_us, point.match_p99_us = percentile(best_match, 0.5), percentile(best_match, 0.99)
    point.match_tiers_p50_us = percentile(best_tiers, 0.5)
    point.match_tiers_p99_us = percentile(best_tiers, 0.99)
    point.match_wrong = wrong


def memory_bytes_per_block(blocks: int, workers: int) -> float:
    """Resident growth per stored block of a fresh process holding ``blocks`` blocks over ``workers`` workers
    in a `PrefixIndex` (the kvmesh side of `kvmesh.bench.index.memory_per_block`, in bytes)."""
    code = f"from kvmesh.bench.index import _memory_child; _memory_child('kvmesh', {blocks}, {workers}, 0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return float(result["rss_growth"]) / float(result["blocks"])


async def measure_route(wl: ScaleWorkload, point: ScalePoint, requests: int, *, timeout_s: float = 600.0) -> None:  # fmt: skip
    """Publish the messages to a private nats-server, start one indexer and one local-index router, and
    route ``requests`` prompts at concurrency 1; fills the route figures of ``point``."""
    from kvmesh.client import RouteError, Router  # noqa: PLC0415
    from kvmesh.harness.procs import ChildProcesses  # noqa: PLC0415
    from kvmesh.harness.server import NatsServer  # noqa: PLC0415
    from kvmesh.runtime import subjects  # noqa: PLC0415
    from kvmesh.runtime.nats import StreamSettings, connect, ensure_stream  # noqa: PLC0415

    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-scale-"))
    (tmp / "logs").mkdir()
    server = NatsServer(store_dir=tmp / "nats").start()
    children = ChildProcesses(tmp / "logs", env={"KVMESH_ROUTER_INDEX": "local"})
    nc = None
    try:
        url = str(server.url)
        nc = await connect(url, name="kvmesh-bench-scale")
        js = nc.jetstream()
        await ensure_stream(js, StreamSettings())
        pending = []
        for m in wl.messages:
            subject = subjects.events_subject(subjects.EVENTS_PREFIX, MODEL, m.worker_id, m.dp_rank)
            pending.append(await js.publish_async(subject, encode_message(m), stream=subjects.STREAM))
            if len(pending) >= 256:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
        last_seq = len(wl.messages)
        t0 = time.perf_counter()
        children.spawn("indexer", "-m", "kvmesh.indexer", "--nats-url", url)
        children.spawn("router", "-m", "kvmesh.router", "--nats-url", url)
        router = Router(nc, timeout_s=10.0)
        deadline = time.monotonic() + timeout_s
        probe = wl.queries[0]
        while True:
            children.check()
            try:
                reply = await router.route(MODEL, probe)
                if reply.index_seq >= last_seq and reply.mode == "exact":
                    break
            except RouteError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router did not apply {last_seq} messages in {timeout_s:g} s")
            await asyncio.sleep(0.1)
        point.route_ready_s = time.perf_counter() - t0
        for prompt in wl.queries[:20]:  # warm-up
            await router.route(MODEL, prompt)
        latencies: list[float] = []
        perf = time.perf_counter
        for i in range(requests):
            qi = i % len(wl.queries)
            t1 = perf()
            try:
                reply = await router.route(MODEL, wl.queries[qi])
            except RouteError:
                point.route_errors += 1
                continue
            latencies.append((perf() - t1) * 1e3)
            w, n = wl.expected[qi]
            point.route_to_longest += reply.overlap_blocks == n and (
                n == HOT_BLOCKS or reply.worker_id == worker_id(w)
            )
        point.route_requests = requests
        point.route_p50_ms = percentile(latencies, 0.5)
        point.route_p99_ms = percentile(latencies, 0.99)
        live = await _routes_under_events(js, router, wl, requests)
        if live:
            point.route_live_p50_ms = percentile(live, 0.5)
            point.route_live_p99_ms = percentile(live, 0.99)
    finally:
        if nc is not None:
            await nc.close()
        children.stop()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


async def _routes_under_events(js: Any, router: Any, wl: ScaleWorkload, requests: int) -> list[float]:
    """Route ``requests`` prompts, each after publishing one events message to the stream (one new block of
    the next worker, at its next engine sequence); the latencies in ms (route errors left out)."""
    from kvmesh.client import RouteError  # noqa: PLC0415
    from kvmesh.runtime import subjects  # noqa: PLC0415

    next_seq = {m.worker_id: m.seq + 1 for m in wl.messages}  # the messages are in order per worker
    rng = random.Random(11)
    latencies: list[float] = []
    pending = []
    perf = time.perf_counter
    for i in range(requests):
        wid = worker_id(i % wl.workers)
        engine, local = rng.getrandbits(63), rng.getrandbits(63)
        msg = EventsMessage(
            worker_id=wid, dp_rank=0, model=MODEL, block_size=BLOCK_SIZE, epoch=0, seq=next_seq[wid],
            events=[Stored([engine], None, [local])],
        )  # fmt: skip
        next_seq[wid] += 1
        subject = subjects.events_subject(subjects.EVENTS_PREFIX, MODEL, wid, 0)
        pending.append(await js.publish_async(subject, encode_message(msg), stream=subjects.STREAM))
        await asyncio.sleep(0.002)  # the router applies it before the route, as a message well before would
        t1 = perf()
        try:
            await router.route(MODEL, wl.queries[i % len(wl.queries)])
        except RouteError:
            continue
        latencies.append((perf() - t1) * 1e3)
    await asyncio.gather(*pending)
    return latencies


def measure_point(
    workers: int, blocks: int, *, queries: int = 200, route_requests: int = 500, memory: bool = True,
    say: Callable[[str], None] = print,
) -> tuple[ScalePoint, ScaleWorkload]:  # fmt: skip
    """Measure one (workers, blocks) point: in-process match and snapshot, route through NATS (skipped when
    ``route_requests`` is 0), memory per block (skipped without ``memory``)."""
    t0 = time.perf_counter()
    wl = make_workload(workers, blocks, queries=queries)
    point = ScalePoint(
        workers=workers, blocks=blocks, stored_blocks=wl.stored_blocks, conversations=len(wl.conversations),
        messages=len(wl.messages),
    )  # fmt: skip
    say(
        f"{workers} workers × {blocks:,} blocks: {wl.stored_blocks:,} stored in {len(wl.messages):,} messages "
        f"(generated in {time.perf_counter() - t0:.1f} s)"
    )
    measure_inprocess(wl, point)
    if memory:
        point.memory_bytes_per_block = memory_bytes_per_block(wl.stored_blocks, workers)
    if route_requests > 0:
        asyncio.run(measure_route(wl, point, route_requests))
    return point, wl


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def table(points: Sequence[ScalePoint]) -> str:
    """The Markdown table of the points."""
    lines = [
        "| workers | blocks | match p50/p99 (µs) | match_tiers p50/p99 (µs) | wrong | route p50/p99 (ms) "
        "| under events p50/p99 (ms) | to longest | memory (B/block) | snapshot (MB) | restore (s) | build (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        route = f"{_fmt(p.route_p50_ms, '.3f')} / {_fmt(p.route_p99_ms, '.3f')}" if p.route_requests else "–"
        live = f"{_fmt(p.route_live_p50_ms, '.3f')} / {_fmt(p.route_live_p99_ms, '.3f')}"
        longest = f"{p.route_to_longest}/{p.route_requests}" if p.route_requests else "–"
        lines.append(
            f"| {p.workers:,} | {p.stored_blocks:,} | {p.match_p50_us:.1f} / {p.match_p99_us:.1f} "
            f"| {p.match_tiers_p50_us:.1f} / {p.match_tiers_p99_us:.1f} | {p.match_wrong} | {route} | {live} "
            f"| {longest} "
            f"| {_fmt(p.memory_bytes_per_block, '.1f')} | {p.snapshot_bytes / 1e6:.2f} "
            f"| {p.restore_s:.3f} | {p.build_s:.2f} |"
        )
    return "\n".join(lines)


def targets(points: Sequence[ScalePoint]) -> list[dict[str, Any]]:
    """The issue-14 target checks the points allow: route p50 at the most vs the fewest workers (per block
    count) and memory per block at the most vs the fewest blocks (per worker count)."""
    out: list[dict[str, Any]] = []
    for blocks in sorted({p.blocks for p in points}):
        for attr, what in (("route_p50_ms", "route p50"), ("route_live_p50_ms", "route p50 under events")):
            row = sorted(
                (p for p in points if p.blocks == blocks and getattr(p, attr)), key=lambda p: p.workers
            )
            if len(row) >= 2:
                ratio = getattr(row[-1], attr) / getattr(row[0], attr)
                out.append({
                    "target": f"{what} at {row[-1].workers} workers ≤ {ROUTE_TARGET_RATIO:g}× at "
                    f"{row[0].workers} ({blocks:,} blocks)",
                    "blocks": blocks, "ratio": ratio, "met": ratio <= ROUTE_TARGET_RATIO,
                })  # fmt: skip
    for workers in sorted({p.workers for p in points}):
        col = sorted(
            (p for p in points if p.workers == workers and p.memory_bytes_per_block), key=lambda p: p.blocks
        )
        if len(col) >= 2 and col[0].memory_bytes_per_block:
            ratio = (col[-1].memory_bytes_per_block or 0.0) / col[0].memory_bytes_per_block
            out.append({
                "target": f"memory per block flat from {col[0].blocks:,} to {col[-1].blocks:,} blocks "
                f"(≤ {MEMORY_FLAT_RATIO:.2f}×, {workers} workers)",
                "workers": workers, "ratio": ratio, "met": ratio <= MEMORY_FLAT_RATIO,
            })  # fmt: skip
    return out


def plot(path: Path, points: Sequence[ScalePoint]) -> bool:
    """Line charts against the worker count, one line per block count; False when matplotlib is missing."""
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency (bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    panels: list[tuple[str, Callable[[ScalePoint], float | None]]] = [
        ("match p50 (µs)", lambda p: p.match_p50_us),
        ("route p50 (ms)", lambda p: p.route_p50_ms),
        ("memory (bytes/block)", lambda p: p.memory_bytes_per_block),
        ("restore (s)", lambda p: p.restore_s),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (name, get) in zip(axes, panels, strict=True):
        for blocks in sorted({p.blocks for p in points}):
            row = [(p.workers, get(p)) for p in sorted(points, key=lambda p: p.workers) if p.blocks == blocks]
            xs = [x for x, y in row if y is not None]
            ys = [y for _x, y in row if y is not None]
            if xs:
                ax.plot(xs, ys, marker="o", label=f"{blocks:,} blocks")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers sharing the hot prefix")
        ax.set_title(name, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle("kvmesh bench scale", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(points: Sequence[ScalePoint], config: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: ``{"config", "points": [ScalePoint fields], "targets"}``."""
    from dataclasses import asdict  # noqa: PLC0415

    return {"config": config, "points": [asdict(p) for p in points], "targets": targets(points)}


def command(argv: Sequence[str] | None = None) -> int:
    """Run ``kvmesh bench scale``; returns the exit code (1 when a match answer or a restore is wrong)."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench scale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", default=DEFAULT_WORKERS, help=f"worker counts (default {DEFAULT_WORKERS})")
    p.add_argument(
        "--blocks",
        default=DEFAULT_BLOCKS,
        help=f"block counts, k/M suffixes allowed (default {DEFAULT_BLOCKS})",
    )
    p.add_argument("--queries", type=int, default=200, help="distinct 4,096-token prompts (default 200)")
    p.add_argument(
        "--route-requests", type=int, default=500, help="route requests per point, 0: skip NATS (default 500)"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory-per-block processes")
    p.add_argument(
        "--out", metavar="PREFIX", type=out_prefix, help="write PREFIX.json (and PREFIX.png with matplotlib)"
    )
    a = p.parse_args(argv)
    try:
        workers = [parse_count(x) for x in a.workers.split(",") if x.strip()]
        blocks = [parse_count(x) for x in a.blocks.split(",") if x.strip()]
    except ValueError as exc:
        p.error(str(exc))
    if a.queries <= 0 or a.route_requests < 0:
        p.error("--queries must be positive and --route-requests not negative")
    points: list[ScalePoint] = []
    for b in blocks:
        for w in workers:
            point, _wl = measure_point(
                w, b, queries=a.queries, route_requests=a.route_requests, memory=not a.no_memory
            )
            points.append(point)
    config = {
        "workers": workers, "blocks": blocks, "queries": a.queries, "route_requests": a.route_requests,
        "block_size": BLOCK_SIZE, "hot_blocks": HOT_BLOCKS, "conversation_blocks": CONV_BLOCKS,
        "prompt_tokens": PROMPT_TOKENS, "python": sys.version.split()[0], "cpus": os.cpu_count(),
    }  # fmt: skip
    doc = report(points, config)
    print(
        f"\nkvmesh bench scale: hot prefix of {HOT_BLOCKS} blocks on every worker, conversations of up to "
        f"{CONV_BLOCKS} blocks, prompts of {PROMPT_TOKENS} tokens, block size {BLOCK_SIZE}; router --index local"
    )
    print(table(points))
    print("\ntargets (issue 14):")
    for t in doc["targets"]:
        print(f"- {t['target']}: {t['ratio']:.2f}× — {'meets' if t['met'] else 'MISSES'}")
    if not doc["targets"]:
        print("- need at least two worker counts (route) or two block counts (memory) to check")
    if a.out:
        Path(f"{a.out}.json").write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {a.out}.json")
        if plot(Path(f"{a.out}.png"), points):
            print(f"wrote {a.out}.png")
        else:
            print("matplotlib is not installed (the bench extra): no plot")
    bad = [p for p in points if p.match_wrong or not p.restored_equal]
    for bp in bad:
        print(
            f"kvmesh bench scale: {bp.workers} workers × {bp.blocks:,} blocks: {bp.match_wrong} wrong match "
            f"answers, restored digest equal: {bp.restored_equal}",
            file=sys.stderr,
        )
    return 1 if bad else 0
