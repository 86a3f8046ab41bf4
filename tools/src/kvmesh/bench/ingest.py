"""``kvmesh bench ingest``: block events/s from simulated engines to an applied index, with zero loss.

Two pipelines run in the same invocation on a private ``nats-server`` (file storage), fed the same
pre-encoded vLLM 0.33 batches by the same simulated engines (`kvmesh.sim.publisher.EventPublisher`, real
ZMQ PUB + replay sockets), as fast as the engines can send:

* **kvmesh**: one ``kvmesh ingest`` process per engine (decode, check, hash token ids, JetStream publish with
  pipelined acks) → stream → one ``kvmesh indexer`` process (ordered consumer, index apply). Done when the
  indexer's status reports every block stored.
* **hand-written pipe**: per engine a process that forwards each ZMQ payload untouched to JetStream with
  ``publish_async`` (≤ 256 acks pending) → one consumer process (ordered push consumer, msgpack decode,
  count the blocks of every BlockStored). Done when it has counted every block. No hashing, no checks, no
  replay: the floor a reader would write first.

Every batch carries one BlockStored of ``--blocks`` blocks with their token ids, chained per engine, all
hashes distinct, so "every block stored" is an exact zero-loss check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from kvmesh.core.wire import BlockStored, EngineBatch, encode_batch
from kvmesh.harness.procs import ChildProcesses
from kvmesh.sim.publisher import EventPublisher

__all__ = ["command"]

MODEL: Final[str] = "bench-model"
BLOCK_SIZE: Final[int] = 16
PIPE_STREAM: Final[str] = "BENCH_PIPE"
PIPE_SUBJECT: Final[str] = "bench.pipe"
PIPE_COUNT_SUBJECT: Final[str] = "bench.pipe.count"


def make_batches(engine: int, batches: int, blocks: int) -> list[bytes]:
    """Return ``batches`` encoded vLLM 0.33 batches of one BlockStored each, chained, distinct hashes."""
    out = []
    parent: int | None = None
    base = (engine + 1) << 40
    for b in range(batches):
        hashes = tuple(base + b * blocks + i for i in range(blocks))
        tokens = tuple(
            (engine * 7919 + b * blocks * BLOCK_SIZE + i) % 32000 for i in range(blocks * BLOCK_SIZE)
        )
        ev = BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=BLOCK_SIZE,
            medium="GPU",
            lora_name=None,
            extra_keys=(None,) * blocks,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        out.append(encode_batch(EngineBatch(ts=0.0, events=(ev,), dp_rank=0)))
        parent = hashes[-1]
    return out


async def _request_json(nc: Any, subject: str) -> dict[str, Any] | None:
    try:
        msg = await nc.request(subject, b"", timeout=1.0)
    except Exception:
        return None
    decoded: dict[str, Any] = msgspec.json.decode(msg.data)
    return decoded


async def _indexer_blocks(nc: Any) -> int:
    """Blocks the indexer holds for the bench model: the sum of ``cached_blocks`` in a match reply (0 while it
    answers an error, e.g. before the model's first block)."""
    from kvmesh.core import protocol  # noqa: PLC0415
    from kvmesh.core.errors import ProtocolError  # noqa: PLC0415
    from kvmesh.runtime import subjects  # noqa: PLC0415

    body = protocol.encode(protocol.MatchRequest(model=MODEL, token_ids=[0] * BLOCK_SIZE), format="msgpack")
    try:
        msg = await nc.request(subjects.MATCH_SUBJECT, body, timeout=1.0)
    except Exception:
        return 0
    try:
        reply = protocol.decode(msg.data, protocol.MatchReply, format="msgpack")
    except ProtocolError:  # an error reply, or not a match reply at all
        return 0
    return sum(c.cached_blocks for c in reply.candidates)


async def _drive(
    pubs: list[EventPublisher], payloads: list[list[bytes]], probe: Callable[[], Awaitable[int]], *,
    total: int, procs: ChildProcesses, timeout_s: float,
) -> tuple[float, int]:  # fmt: skip
    """Publish every batch, then wait until ``probe()`` (blocks applied) reaches ``total``."""
    t0 = time.perf_counter()
    n = max(len(p) for p in payloads)
    for i in range(n):
        for pub, batches in zip(pubs, payloads, strict=True):
            if i < len(batches):
                pub.publish_raw(batches[i])
        if i % 64 == 63:
            await asyncio.sleep(0)
    deadline = time.monotonic() + timeout_s
    seen = 0
    while time.monotonic() < deadline:
        procs.check()
        seen = await probe()
        if seen >= total:
            return time.perf_counter() - t0, seen
        await asyncio.sleep(0.02)
    return time.perf_counter() - t0, seen


async def _run(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    from kvmesh.harness.server import NatsServer  # noqa: PLC0415
    from kvmesh.runtime import subjects  # noqa: PLC0415
    from kvmesh.runtime.nats import connect  # noqa: PLC0415

    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-ingest-"))
    log_dir = Path(a.log_dir) if a.log_dir else tmp / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    payloads = [make_batches(e, a.batches, a.blocks) for e in range(a.engines)]
    total = a.engines * a.batches * a.blocks
    results: dict[str, dict[str, Any]] = {}
    server = NatsServer(store_dir=tmp / "nats").start()
    try:
        nc = await connect(server.url, name="kvmesh-bench-ingest")
        for which in a.order:
            procs = ChildProcesses(log_dir)
            pubs = [
                EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=a.batches + 10)
                for _ in range(a.engines)
            ]
            try:
                if which == "kvmesh":
                    for e, pub in enumerate(pubs):
                        procs.spawn(
                            f"ingest-{e}", "-m", "kvmesh.ingest", "--nats-url", server.url, "--worker-id",
                            f"sim-{e}", "--model", MODEL, "--zmq-endpoint", pub.endpoint, "--replay-endpoint",
                            str(pub.replay_endpoint), "--block-size", str(BLOCK_SIZE),
                        )  # fmt: skip
                    procs.spawn("indexer", "-m", "kvmesh.indexer", "--nats-url", server.url)
                    subject = subjects.STATUS_SUBJECT
                else:
                    for e, pub in enumerate(pubs):
                        procs.spawn(
                            f"pipe-{e}",
                            "-m",
                            "kvmesh.bench.ingest",
                            "pipe-forward",
                            server.url,
                            pub.endpoint,
                            str(e),
                        )
                    procs.spawn("pipe-consumer", "-m", "kvmesh.bench.ingest", "pipe-consume", server.url)
                    subject = PIPE_COUNT_SUBJECT
                deadline = time.monotonic() + 60
                for pub in pubs:
                    while pub.subscriptions < 1:
                        procs.check()
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{which}: no subscriber after 60 s")
                        await asyncio.sleep(0.05)
                while True:
                    procs.check()
                    r = await _request_json(nc, subject)
                    if r is not None and r.get("ready"):
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{which}: consumer not ready after 60 s")
                    await asyncio.sleep(0.1)
                if which == "kvmesh":
                    # Not the status endpoint: its digest is O(blocks) and would slow the indexer down.
                    async def probe() -> int:
                        return await _indexer_blocks(nc)
                else:

                    async def probe() -> int:
                        r = await _request_json(nc, PIPE_COUNT_SUBJECT)
                        return int(r.get("blocks", 0)) if r else 0

                elapsed, seen = await _drive(
                    pubs, payloads, probe, total=total, procs=procs, timeout_s=a.timeout_s
                )
                results[which] = {
                    "seconds": elapsed,
                    "blocks": seen,
                    "rate": seen / elapsed,
                    "lost": total - seen,
                }
                if which == "kvmesh":
                    ing = []
                    with contextlib.suppress(Exception):
                        from kvmesh.ops import gather_status  # noqa: PLC0415

                        ing = await gather_status(nc, f"{subjects.STATUS_SUBJECT}.ingest", 0.5)
                    results[which]["ingest_status"] = ing
                print(
                    f"{which}: {seen:,} of {total:,} blocks in {elapsed:.2f} s = {seen / elapsed:,.0f} block events/s",
                    flush=True,
                )
            finally:
                procs.stop()
                for pub in pubs:
                    pub.close()
        await nc.close()
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def command(argv: Sequence[str] | None = None) -> int:
    """Run ``kvmesh bench ingest``; exit 1 when kvmesh lost a block."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench ingest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--engines", type=int, default=2, help="simulated engines, one ingest (or pipe) each (default 2)"
    )
    p.add_argument("--batches", type=int, default=10000, help="batches per engine (default 10000)")
    p.add_argument("--blocks", type=int, default=16, help="blocks per batch (default 16)")
    p.add_argument("--order", default="pipe,kvmesh", help="which pipelines, in order (default pipe,kvmesh)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="give up waiting after this many seconds")
    p.add_argument("--log-dir", default=None, help="keep the child processes' logs here")
    a = p.parse_args(argv)
    a.order = [x for x in a.order.split(",") if x]
    total = a.engines * a.batches * a.blocks
    print(
        f"kvmesh bench ingest: {a.engines} engines × {a.batches} batches × {a.blocks} blocks = {total:,} block events"
    )
    results = asyncio.run(_run(a))
    print("\n| pipeline | block events/s | seconds | lost | vs hand-written pipe |")
    print("|---|---:|---:|---:|---:|")
    pipe_rate = results.get("pipe", {}).get("rate")
    for name, r in results.items():
        ratio = f"{r['rate'] / pipe_rate:.2f}" if pipe_rate else "–"
        label = (
            "kvmesh (ingest → JetStream → indexer)"
            if name == "kvmesh"
            else "hand-written ZMQ → nats-py → consumer"
        )
        print(f"| {label} | {r['rate']:,.0f} | {r['seconds']:.2f} | {r['lost']} | {ratio} |")
    for st in results.get("kvmesh", {}).get("ingest_status", []):
        print(f"ingest {st.get('worker_id')}: {msgspec.json.encode(st.get('counters', st)).decode()[:300]}")
    return 1 if results.get("kvmesh", {}).get("lost", 0) else 0


# ---------------------------------------------------------------------- the hand-written pipe


async def _pipe_forward(url: str, endpoint: str, engine: str) -> None:
    import nats  # noqa: PLC0415
    import zmq  # noqa: PLC0415
    import zmq.asyncio  # noqa: PLC0415

    nc = await nats.connect(url)
    js = nc.jetstream()
    with contextlib.suppress(Exception):
        await js.add_stream(name=PIPE_STREAM, subjects=[f"{PIPE_SUBJECT}.events.>"])
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 100_000)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    subject = f"{PIPE_SUBJECT}.events.{engine}"
    pending: list[Any] = []
    while True:
        _topic, _seq, payload = await sub.recv_multipart()
        pending.append(await js.publish_async(subject, payload, wait_stall=5.0))
        # Wait for the acks when the window is full or nothing more is queued on the socket.
        if len(pending) >= 256 or not int(sub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            await asyncio.gather(*pending)
            pending.clear()


async def _pipe_consume(url: str) -> None:
    import nats  # noqa: PLC0415

    nc = await nats.connect(url)
    js = nc.jetstream()
    with contextlib.suppress(Exception):
        await js.add_stream(name=PIPE_STREAM, subjects=[f"{PIPE_SUBJECT}.events.>"])
    count = 0
    decode = msgspec.msgpack.decode

    async def on_msg(msg: Any) -> None:
        nonlocal count
        batch = decode(msg.data)
        for ev in batch[1]:
            if isinstance(ev, dict):
                if ev.get("type") == "BlockStored":
                    count += len(ev["block_hashes"])
            elif ev and ev[0] == "BlockStored":
                count += len(ev[1])

    async def on_count(msg: Any) -> None:
        await msg.respond(msgspec.json.encode({"ready": True, "blocks": count}))

    await js.subscribe(f"{PIPE_SUBJECT}.events.>", cb=on_msg, ordered_consumer=True)
    await nc.subscribe(PIPE_COUNT_SUBJECT, cb=on_count)
    await asyncio.Event().wait()


def _pipe_main(argv: Sequence[str]) -> int:
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if argv[0] == "pipe-forward":
        asyncio.run(_pipe_forward(argv[1], argv[2], argv[3]))
    elif argv[0] == "pipe-consume":
        asyncio.run(_pipe_consume(argv[1]))
    else:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_pipe_main(sys.argv[1:]))
