"""``kvmesh bench route``: route latency through NATS, next to a bare request-reply echo in the same run.

Starts the real pipeline (private ``nats-server``, one ``kvmesh ingest`` per simulated engine, ``kvmesh
indexer``, ``kvmesh router``), fills the index by serving the first requests of the packaged Mooncake excerpt
on the engines' block pools, then sends ``--requests`` route requests of ``--tokens``-token prompts one at a
time (concurrency 1) through `kvmesh.client.Router`. The baseline is a child process that answers the same
JSON request bodies on another subject with a fixed reply: NATS request-reply plus one Python process hop,
without hashing, the router → indexer hop and the match.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from kvmesh.bench.trace import MODEL, _Pipeline, _wait_ready, percentile
from kvmesh.sim.blockpool import BlockPool, PoolExhaustedError
from kvmesh.sim.trace import default_trace_path, expand_tokens, load_trace

__all__ = ["command"]

ECHO_SUBJECT: Final[str] = "bench.route.echo"


async def _run(a: argparse.Namespace) -> dict[str, list[float]]:
    from kvmesh.client import Router  # noqa: PLC0415
    from kvmesh.runtime.nats import connect  # noqa: PLC0415

    pipe = _Pipeline(a.workers, 16, None)
    try:
        url = pipe.start(None)
        pipe._spawn("echo", "kvmesh.bench.route", "echo", url)
        nc = await connect(url, name="kvmesh-bench-route")
        router = Router(nc, timeout_s=5.0)
        try:
            await _wait_ready(pipe, router)
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
            queries = [(p * (a.tokens // len(p) + 1))[: a.tokens] for p in prompts]
            bodies = [
                msgspec.json.encode({"model": MODEL, "token_ids": q, "request_id": f"q{i}"})
                for i, q in enumerate(queries)
            ]
            out: dict[str, list[float]] = {"kvmesh route": [], "echo (NATS request-reply)": []}
            for _ in range(5):  # warm-up
                await router.request_raw(bodies[0])
                await nc.request(ECHO_SUBJECT, bodies[0], timeout=5)
            perf = time.perf_counter
            for i in range(a.requests):
                body = bodies[i % len(bodies)]
                t0 = perf()
                await router.request_raw(body)
                out["kvmesh route"].append(perf() - t0)
                t0 = perf()
                await nc.request(ECHO_SUBJECT, body, timeout=5)
                out["echo (NATS request-reply)"].append(perf() - t0)
            return out
        finally:
            await nc.close()
    finally:
        pipe.stop()


def command(argv: Sequence[str] | None = None) -> int:
    """Run ``kvmesh bench route``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench route", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=4, help="simulated engines (default 4)")
    p.add_argument("--num-blocks", type=int, default=16384, help="KV blocks per engine (default 16384)")
    p.add_argument(
        "--fill", type=int, default=200, help="trace requests served to fill the index (default 200)"
    )
    p.add_argument(
        "--tokens", type=int, default=4096, help="prompt length of each route request (default 4096)"
    )
    p.add_argument("--requests", type=int, default=2000, help="route requests, concurrency 1 (default 2000)")
    a = p.parse_args(argv)
    res = asyncio.run(_run(a))
    print(f"\n{a.requests} requests of {a.tokens} tokens, concurrency 1, interleaved")
    print("| path | p50 (ms) | p99 (ms) | p50 vs echo |")
    print("|---|---:|---:|---:|")
    echo = percentile(res["echo (NATS request-reply)"], 0.5)
    for name, lat in res.items():
        p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
        print(f"| {name} | {1e3 * p50:.2f} | {1e3 * p99:.2f} | {p50 / echo:.2f} |")
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
