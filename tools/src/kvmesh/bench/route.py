"""``kvmesh bench route``: route latency and throughput through NATS, next to a bare request-reply echo in the same run.

Starts the real pipeline on a private ``nats-server`` (``kvmesh indexer``, ``kvmesh router``) and fills the
index in one of two ways:

* default: one ``kvmesh ingest`` per simulated engine, serving the first ``--fill`` requests of the packaged
  Mooncake excerpt on the engines' block pools;
* ``--blocks N``: no engines; kvmesh `EventsMessage` batches are published straight to the JetStream stream
  before the indexer starts: N stored blocks (block size 16) over ``--workers`` workers, each holding 8 of
  32 shared 512-token system prefixes and conversations that extend one of them to ``--tokens`` tokens, so
  a million blocks take seconds. A query extends a stored conversation's first k blocks (k uniform) with
  fresh tokens; one in ten shares nothing with the index.

Then it sends route requests of ``--tokens``-token prompts through `kvmesh.client.Router`:

* default: ``--requests`` requests one at a time (concurrency 1), interleaved with the echo;
* ``--rate R``: open loop, R requests/s for ``--duration`` seconds; latency counts from each request's
  scheduled send time, so a load generator that falls behind shows up as latency;
* ``--concurrency C``: closed loop, C requests in flight for ``--duration`` seconds; throughput in routes/s.

``--rate`` and ``--concurrency`` may be combined; each runs against the echo, then against kvmesh. The echo is
a child process that answers the same request bodies on another subject with a fixed reply: NATS
request-reply plus one Python process hop, without hashing, the router → indexer hop and the match.

``--form`` (repeatable; default ``json``) picks the route request forms measured, each against the echo of
its own bodies in the same run (`kvmesh.core.protocol`): ``json`` (the JSON `RouteRequest`), ``binary``
(token ids packed as little-endian uint32, ``Kvmesh-Body: tokens-u32le``) and ``hashed`` (the prompt's
local block hashes packed as little-endian uint64, ``Kvmesh-Body: hashes-u64le``, hashed before the run as
a gateway that hashes would; pre-hashed requests need ``--index local``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from kvmesh.bench.trace import MODEL, _Pipeline, _wait_ready, percentile
from kvmesh.sim.blockpool import BlockPool, PoolExhaustedError
from kvmesh.sim.trace import default_trace_path, expand_tokens, load_trace

__all__ = ["command"]

ECHO_SUBJECT: Final[str] = "bench.route.echo"
ECHO: Final[str] = "echo (NATS request-reply)"
ROUTE: Final[str] = "kvmesh route"
ROUTE_METRICS: Final[str] = "kvmesh route, metrics on"
ROUTE_TRACING: Final[str] = "kvmesh route, tracing on"
FORMS: Final[dict[str, str]] = {
    "json": "JSON",
    "binary": "tokens-u32le",
    "hashed": "pre-hashed, hashes-u64le",
}
"""``--form`` → how the table names it."""
OBSERVED: Final[dict[str, tuple[str, tuple[str, ...], dict[str, str]]]] = {
    # path → (route subject, router flags, router environment): the same router with one kind of
    # observability on (--observability), measured against the plain one in the same run.
    ROUTE_METRICS: ("bench.route.metrics", ("--metrics-port", "0"), {}),
    ROUTE_TRACING: ("bench.route.tracing", (), {"OTEL_TRACES_EXPORTER": "console"}),
}
_BLOCK_SIZE: Final[int] = 16
_PREFIXES: Final[int] = 32
"""Shared system prefixes of the ``--blocks`` fill."""
_PREFIX_BLOCKS: Final[int] = 32
_PREFIXES_PER_WORKER: Final[int] = 8
_EVENTS_PER_MESSAGE: Final[int] = 16

Payload = tuple[bytes, dict[str, str] | None]
"""A request's body and NATS headers (None: none)."""
Send = Callable[[Payload], Awaitable[bytes]]


@dataclass
class Phase:
    """One measured phase: a path (kvmesh or the echo) under one load mode."""

    path: str
    mode: str
    latencies: list[float]
    elapsed_s: float
    errors: int
    lag_s: float = 0.0
    """Open loop: the largest delay between a request's scheduled and actual send time."""
    form: str = "json"
    """The request form of the bodies sent (a key of `FORMS`)."""

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _tokens(seed: int, n: int) -> array[int]:
    """``n`` pseudo-random token ids below 65,536, reproducible from ``seed``."""
    return array("I", array("H", random.Random(seed).randbytes(2 * n)))


async def _fill_stream(nc: Any, a: argparse.Namespace) -> tuple[list[list[int]], int]:
    """Publish ``a.blocks`` stored blocks over ``a.workers`` workers to the stream; return (queries, messages)."""
    from kvmesh.core.events import EventsMessage, Stored, encode_message  # noqa: PLC0415
    from kvmesh.core.hashing import local_block_hashes  # noqa: PLC0415
    from kvmesh.runtime import subjects  # noqa: PLC0415
    from kvmesh.runtime.nats import StreamSettings, ensure_stream  # noqa: PLC0415

    js = nc.jetstream()
    await ensure_stream(js, StreamSettings())
    rng = random.Random(42)
    bs = _BLOCK_SIZE
    tail_blocks = a.tokens // bs - _PREFIX_BLOCKS
    if tail_blocks <= 0:
        raise SystemExit(f"--tokens must be at least {(_PREFIX_BLOCKS + 1) * bs} with --blocks")
    prefixes = [_tokens(10_000_000 + p, _PREFIX_BLOCKS * bs) for p in range(_PREFIXES)]
    prefix_local = [local_block_hashes(t, bs) for t in prefixes]
    per_worker = a.blocks // a.workers
    convs: list[tuple[int, int]] = []  # (prefix, tail seed) of every stored conversation
    messages = 0
    for w in range(a.workers):
        worker = f"w{w}"
        subject = subjects.events_subject(subjects.EVENTS_PREFIX, MODEL, worker, 0)
        held = rng.sample(range(_PREFIXES), _PREFIXES_PER_WORKER)
        events: list[Any] = []
        ends: dict[int, int] = {}
        for p in held:
            engine = [rng.getrandbits(63) for _ in range(_PREFIX_BLOCKS)]
            events.append(Stored(engine, None, prefix_local[p]))
            ends[p] = engine[-1]
        stored = _PREFIX_BLOCKS * len(held)
        seq = 0
        while events or stored < per_worker:
            if stored < per_worker:
                p = held[len(convs) % len(held)]
                n = min(tail_blocks, per_worker - stored)
                seed = len(convs)
                local = local_block_hashes(_tokens(seed, tail_blocks * bs)[: n * bs], bs)
                events.append(Stored([rng.getrandbits(63) for _ in range(n)], ends[p], local))
                convs.append((p, seed))
                stored += n
            if len(events) >= _EVENTS_PER_MESSAGE or (events and stored >= per_worker):
                msg = EventsMessage(
                    worker_id=worker, dp_rank=0, model=MODEL, block_size=bs, epoch=0, seq=seq, events=events
                )
                await js.publish(subject, encode_message(msg), stream=subjects.STREAM)
                seq += 1
                messages += 1
                events = []
    queries: list[list[int]] = []
    qrng = random.Random(7)
    for i in range(a.queries):
        if i % 10 == 9:
            queries.append(list(_tokens(20_000_000 + i, a.tokens)))
            continue
        p, seed = convs[qrng.randrange(len(convs))]
        tail = _tokens(seed, tail_blocks * bs)[: qrng.randint(0, tail_blocks) * bs]
        fresh = _tokens(30_000_000 + i, a.tokens - len(prefixes[p]) - len(tail))
        queries.append([*prefixes[p], *tail, *fresh])
    return queries, messages


async def _fill_engines(pipe: _Pipeline, router: Any, a: argparse.Namespace) -> list[list[int]]:
    """Serve the first ``a.fill`` trace requests on simulated engines; return the queries."""
    trace = load_trace(default_trace_path(), limit=a.fill)
    pools = [BlockPool(num_blocks=a.num_blocks, block_size=16, seed=i) for i in range(a.workers)]
    prompts = []
    for i, req in enumerate(trace):
        tokens = expand_tokens(req)
        prompts.append(tokens)
        k = i % a.workers
        try:
            pools[k].start(f"r{i}", tokens)
            pools[k].finish(f"r{i}")
        except PoolExhaustedError:
            continue
        pipe.publishers[k].publish(pools[k].take_events())
        if i % 16 == 15:
            await asyncio.sleep(0)
    stored = sum(p.stats().cached_blocks for p in pools)
    # Wait until the index holds the last prompt the fill served.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        reply = await router.route(MODEL, prompts[-1])
        if reply.overlap_blocks > 0:
            break
        await asyncio.sleep(0.1)
    print(f"index filled: {len(prompts)} prompts, {stored:,} cached blocks on {a.workers} engines")
    return [(p * (a.tokens // len(p) + 1))[: a.tokens] for p in prompts]


@dataclass(frozen=True)
class Path:
    """One measured path: its name, the form of its bodies, and how a request is sent."""

    name: str
    form: str
    send: Send


def _path_name(base: str, form: str) -> str:
    return base if form == "json" else f"{base}, {FORMS[form]}"


async def _interleaved(paths: list[Path], payloads: dict[str, list[Payload]], n: int) -> list[Phase]:
    """Concurrency 1, the paths alternating request by request."""
    out = [Phase(path.name, "concurrency 1", [], 0.0, 0, form=path.form) for path in paths]
    perf = time.perf_counter
    for i in range(n):
        for path, phase in zip(paths, out, strict=True):
            bodies = payloads[path.form]
            t0 = perf()
            reply = await path.send(bodies[i % len(bodies)])
            dt = perf() - t0
            phase.latencies.append(dt)
            phase.elapsed_s += dt
            phase.errors += reply.startswith(b'{"error"')
    return out


async def _open_loop(path: Path, bodies: list[Payload], rate: float, duration_s: float) -> Phase:
    """Send at ``rate`` requests/s; each latency counts from the request's scheduled send time."""
    loop = asyncio.get_running_loop()
    send = path.send
    phase = Phase(path.name, f"open loop {rate:g}/s", [], 0.0, 0, form=path.form)
    n = max(1, int(rate * duration_s))
    start = loop.time() + 0.05
    pending: set[asyncio.Task[None]] = set()

    async def one(body: Payload, at: float) -> None:
        try:
            reply = await send(body)
        except Exception:
            phase.errors += 1
            return
        phase.latencies.append(loop.time() - at)
        phase.errors += reply.startswith(b'{"error"')

    for i in range(n):
        at = start + i / rate
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            phase.lag_s = max(phase.lag_s, -delay)
        t = asyncio.create_task(one(bodies[i % len(bodies)], at))
        pending.add(t)
        t.add_done_callback(pending.discard)
    if pending:
        await asyncio.wait(pending)
    phase.elapsed_s = loop.time() - start
    return phase


async def _closed_loop(path: Path, bodies: list[Payload], concurrency: int, duration_s: float) -> Phase:
    """Keep ``concurrency`` requests in flight for ``duration_s`` seconds."""
    loop = asyncio.get_running_loop()
    send = path.send
    phase = Phase(path.name, f"concurrency {concurrency}", [], 0.0, 0, form=path.form)
    start = loop.time()
    end = start + duration_s
    counter = iter(range(1 << 62))

    async def client() -> None:
        while loop.time() < end:
            body = bodies[next(counter) % len(bodies)]
            t0 = loop.time()
            try:
                reply = await send(body)
            except Exception:
                phase.errors += 1
                continue
            phase.latencies.append(loop.time() - t0)
            phase.errors += reply.startswith(b'{"error"')

    await asyncio.gather(*(client() for _ in range(concurrency)))
    phase.elapsed_s = loop.time() - start
    return phase


async def _run(a: argparse.Namespace) -> list[Phase]:
    from kvmesh.client import Router  # noqa: PLC0415
    from kvmesh.core import protocol  # noqa: PLC0415
    from kvmesh.harness.server import NatsServer  # noqa: PLC0415
    from kvmesh.ops import gather  # noqa: PLC0415
    from kvmesh.runtime import subjects  # noqa: PLC0415
    from kvmesh.runtime.nats import connect  # noqa: PLC0415

    synthetic = a.blocks > 0
    pipe = _Pipeline(0 if synthetic else a.workers, _BLOCK_SIZE, None)
    nc = None
    try:
        if synthetic:
            pipe.server = NatsServer(store_dir=pipe.tmp / "nats").start()
            url = str(pipe.server.url)
            nc = await connect(url, name="kvmesh-bench-route")
            t0 = time.perf_counter()
            queries, messages = await _fill_stream(nc, a)
            fill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            pipe._spawn("indexer", "kvmesh.indexer", "--nats-url", url)
            pipe._spawn("router", "kvmesh.router", "--nats-url", url)
        else:
            url = pipe.start(None)
            nc = await connect(url, name="kvmesh-bench-route")
        pipe._spawn("echo", "kvmesh.bench.route", "echo", url)
        router = Router(nc, timeout_s=5.0)
        observed: dict[str, Any] = {}
        for name, (subject, flags, env) in (OBSERVED if a.observability else {}).items():
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # the child copies this process's environment when it starts
            try:
                pipe._spawn(
                    "router-" + subject.rsplit(".", 1)[1],
                    "kvmesh.router",
                    "--nats-url",
                    url,
                    "--route-subject",
                    subject,
                    *flags,
                )
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            observed[name] = Router(nc, subject=subject, timeout_s=5.0)
        await _wait_ready(pipe, router)
        for other in observed.values():
            await _wait_ready(pipe, other)
        if synthetic:
            ready_s = time.perf_counter() - t0
            # A local-index router can be ready before the indexer, and an indexer is ready before it has
            # applied the whole stream: measure only once it has (an indexer still applying a million blocks
            # would take CPU from the measured processes).
            last_seq = (await nc.jetstream().stream_info(subjects.STREAM)).state.last_seq
            status = []
            for _ in range(240):
                status = (await gather(nc, subjects.STATUS_SUBJECT, protocol.IndexerStatus, 0.5)).replies
                if status and all(s.ready and s.applied_seq >= last_seq for s in status):
                    break
                await asyncio.sleep(0.25)
            blocks = sum(s.blocks for s in status)
            print(
                f"index filled: {blocks:,} blocks on {len(status[0].workers) if status else 0} workers "
                f"({messages} stream messages published in {fill_s:.1f} s; indexer and router ready "
                f"{ready_s:.1f} s after start)"
            )
        else:
            queries = await _fill_engines(pipe, router, a)
        payloads = {form: _payloads(form, queries) for form in {"json", *a.form}}

        async def echo(payload: Payload) -> bytes:
            body, headers = payload
            return bytes((await nc.request(ECHO_SUBJECT, body, timeout=5, headers=headers)).data)

        def sender(r: Router) -> Send:
            async def send(payload: Payload) -> bytes:
                return await r.request_raw(payload[0], headers=payload[1])

            return send

        groups: list[list[Path]] = []  # per form: its echo, then kvmesh
        for form in a.form:
            group = [
                Path(_path_name(ECHO, form), form, echo),
                Path(_path_name(ROUTE, form), form, sender(router)),
            ]
            if form == "json":
                group += [Path(name, "json", sender(r)) for name, r in observed.items()]
            groups.append(group)
        paths = [path for group in groups for path in group]
        for i in range(20):  # warm-up
            for path in paths:
                await path.send(payloads[path.form][i % len(queries)])
        out: list[Phase] = []
        if not a.rate and not a.concurrency:
            out += await _interleaved(paths, payloads, a.requests)
        for rate in a.rate:
            for path in paths:
                out.append(await _open_loop(path, payloads[path.form], rate, a.duration))
                await asyncio.sleep(0.5)
        for conc in a.concurrency:
            for path in paths:
                out.append(await _closed_loop(path, payloads[path.form], conc, a.duration))
                await asyncio.sleep(0.5)
        return out
    finally:
        if nc is not None:
            await nc.close()
        pipe.stop()


def _payloads(form: str, queries: Sequence[Sequence[int]]) -> list[Payload]:
    """The route request of every query in ``form`` (a key of `FORMS`), each with its ``request_id``."""
    from kvmesh.core import protocol  # noqa: PLC0415
    from kvmesh.core.hashing import local_block_hashes, pack_tokens  # noqa: PLC0415

    out: list[Payload] = []
    for i, q in enumerate(queries):
        if form == "json":
            req = protocol.RouteRequest(model=MODEL, token_ids=list(q), request_id=f"q{i}")
            out.append((protocol.encode(req), None))
            continue
        fields = protocol.encode(protocol.RouteRequest(model=MODEL, request_id=f"q{i}")).decode()
        if form == "binary":
            body, kind = pack_tokens(q), protocol.BODY_TOKENS_U32LE
        else:
            packed = array("Q", local_block_hashes(q, _BLOCK_SIZE))
            if sys.byteorder == "big":  # pragma: no cover
                packed.byteswap()
            body, kind = packed.tobytes(), protocol.BODY_HASHES_U64LE
        out.append((body, {protocol.BODY_HEADER: kind, protocol.FIELDS_HEADER: fields}))
    return out


def _table(phases: list[Phase]) -> str:
    lines = [
        "| mode | path | requests | routes/s | p50 (ms) | p99 (ms) | p50 vs echo | p99 vs echo | routes/s vs echo | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    echo = {(p.mode, p.form): p for p in phases if p.path.startswith(ECHO)}
    plain = {p.mode: p for p in phases if p.path == ROUTE}
    for p in phases:
        e = echo.get((p.mode, p.form))
        p50, p99 = percentile(p.latencies, 0.5), percentile(p.latencies, 0.99)
        r50 = r99 = rr = "–"
        if e is not None and e.latencies:
            r50 = f"{p50 / percentile(e.latencies, 0.5):.2f}"
            r99 = f"{p99 / percentile(e.latencies, 0.99):.2f}"
            rr = f"{p.rate / e.rate:.2f}" if e.rate else "–"
        lines.append(
            f"| {p.mode} | {p.path} | {len(p.latencies):,} | {p.rate:,.0f} | {1e3 * p50:.2f} | {1e3 * p99:.2f} "
            f"| {r50} | {r99} | {rr} | {p.errors} |"
        )
    for p in phases:
        base = plain.get(p.mode)
        if p.path in OBSERVED and base is not None and base.latencies and p.latencies:
            lines.append(
                f"\n{p.path}, {p.mode}: p50 {percentile(p.latencies, 0.5) / percentile(base.latencies, 0.5):.2f}× "
                f"and p99 {percentile(p.latencies, 0.99) / percentile(base.latencies, 0.99):.2f}× the plain router's "
                f"(+{1e6 * (percentile(p.latencies, 0.5) - percentile(base.latencies, 0.5)):.0f} µs at p50)"
            )
    lag = [p for p in phases if p.lag_s > 0.005]
    for p in lag:
        lines.append(f"\n{p.path}, {p.mode}: the load generator fell behind by up to {1e3 * p.lag_s:.1f} ms")
    return "\n".join(lines)


def command(argv: Sequence[str] | None = None) -> int:
    """Run ``kvmesh bench route``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench route", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=4, help="simulated engines / workers (default 4)")
    p.add_argument("--num-blocks", type=int, default=16384, help="KV blocks per engine (default 16384)")
    p.add_argument(
        "--fill", type=int, default=200, help="trace requests served to fill the index (default 200)"
    )
    p.add_argument(
        "--blocks",
        type=int,
        default=0,
        help="fill the index with this many blocks published straight to the stream instead (default: off)",
    )
    p.add_argument("--queries", type=int, default=512, help="distinct prompts with --blocks (default 512)")
    p.add_argument(
        "--tokens", type=int, default=4096, help="prompt length of each route request (default 4096)"
    )
    p.add_argument(
        "--requests", type=int, default=2000, help="route requests at concurrency 1 (default 2000)"
    )
    p.add_argument(
        "--rate",
        type=float,
        action="append",
        default=[],
        help="open loop at this many requests/s (repeatable)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        action="append",
        default=[],
        help="closed loop, requests in flight (repeatable)",
    )
    p.add_argument(
        "--duration", type=float, default=10.0, help="seconds per open/closed-loop phase (default 10)"
    )
    p.add_argument(
        "--index",
        choices=("remote", "local"),
        default=None,
        help="the router's --index: remote (ask the indexer) or local (in-process replica); "
        "default: the router's own default",
    )
    p.add_argument(
        "--form",
        choices=tuple(FORMS),
        action="append",
        default=[],
        help="route request form to measure, each against the echo of its own bodies (repeatable; default "
        "json): json, binary (tokens-u32le), hashed (local block hashes, hashes-u64le)",
    )
    p.add_argument(
        "--observability",
        action="store_true",
        help="also route through a router with --metrics-port on and one with OTEL_TRACES_EXPORTER=console "
        "(spans batched to its log), and report each against the plain router in the same run",
    )
    a = p.parse_args(argv)
    a.form = list(dict.fromkeys(a.form or ["json"]))
    if a.index is not None:
        os.environ["KVMESH_ROUTER_INDEX"] = a.index  # the spawned router reads its settings from there
    phases = asyncio.run(_run(a))
    index = a.index or os.environ.get("KVMESH_ROUTER_INDEX") or "default"
    print(
        f"\nprompts of {a.tokens} tokens, router --index {index}; each mode against the echo and kvmesh in the same run"
    )
    print(_table(phases))
    return 0


async def _echo(url: str) -> None:
    from kvmesh.runtime.nats import connect  # noqa: PLC0415

    nc = await connect(url, name="kvmesh-bench-echo")
    reply = msgspec.json.encode({"worker_id": "echo", "dp_rank": 0, "overlap_blocks": 0})

    async def handle(msg: Any) -> None:
        await msg.respond(reply)

    await nc.subscribe(ECHO_SUBJECT, cb=handle)
    await asyncio.Event().wait()


if __name__ == "__main__":
    if sys.argv[1:2] == ["echo"]:
        asyncio.run(_echo(sys.argv[2]))
