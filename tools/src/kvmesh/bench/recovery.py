"""``kvmesh bench recovery``: snapshot write, apply-loop stall, restore to ready, and stream replay rate.

One invocation, one machine, a private ``nats-server`` (file storage in a temporary directory):

1. **Build** an index of ``--blocks`` blocks over ``--workers`` workers in this process (batches of
   ``--blocks-per-event`` chained blocks), timing the in-process apply: the baseline for the replay rate.
2. **Snapshot write**, as the indexer's lease holder does it: `IndexState.export` between two applied
   messages (the only synchronous part), `encode_snapshot` in a thread, upload to the JetStream Object Store.
   The **apply-loop stall** is measured two ways: the export's duration, and the longest gap a 1 ms ticker
   coroutine sees on the event loop during the whole write (export + threaded encode + upload).
3. **Restore to ready**, as a restarting indexer does: download from the Object Store, verify and decode,
   rebuild the state (`IndexState.from_export`).
4. **Replay through NATS**: ``--replay-messages`` batches published to a stream, then read back from
   sequence 1 with the indexer's reader (ordered consumer, decode, apply: `kvmesh.runtime.snapshots.
   replay_stream`), in block events per second; same-run baselines: the same messages decoded and applied
   without NATS, and an ordered consumer that only counts messages.

Targets (docs/recovery.md): restore to ready ≤ 3 s for 1,000,000 blocks, replay ≥ 200,000 block events/s,
stall ≤ 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from kvmesh.core.events import EventsMessage, Stored, decode_message, encode_message
from kvmesh.core.snapshot import decode_snapshot, encode_snapshot
from kvmesh.core.state import IndexState

__all__ = ["command", "main"]

MODEL: Final[str] = "bench-model"
BLOCK_SIZE: Final[int] = 16
STREAM: Final[str] = "BENCH_RECOVERY"
PREFIX: Final[str] = "bench.recovery"
RESTORE_TARGET_S: Final[float] = 3.0
REPLAY_TARGET_PER_S: Final[float] = 200_000.0
STALL_TARGET_MS: Final[float] = 50.0


def make_messages(blocks: int, workers: int, per_event: int, *, seed: int = 7) -> list[EventsMessage]:
    """Batches of ``per_event`` stored blocks, round-robin over workers, each chained onto its worker's last
    block (a new root every 64 batches), all engine hashes distinct: ``blocks`` blocks in all."""
    rng = random.Random(seed)
    out = []
    last: dict[str, int] = {}
    for i in range(-(-blocks // per_event)):
        w = f"worker-{i % workers}"
        n = min(per_event, blocks - i * per_event)
        engine = [i * per_event + b + 1 for b in range(n)]
        parent = last.get(w) if (i // workers) % 64 else None
        local = [rng.getrandbits(64) for _ in range(n)]
        out.append(
            EventsMessage(
                worker_id=w,
                dp_rank=0,
                model=MODEL,
                block_size=BLOCK_SIZE,
                epoch=0,
                seq=i // workers,
                events=[Stored(engine, parent, local)],
            )
        )
        last[w] = engine[-1]
    return out


class _Ticker:
    """A coroutine that wakes every millisecond and records the longest gap between wake-ups."""

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s = period_s
        self.max_gap_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(self.period_s)
            now = loop.time()
            self.max_gap_s = max(self.max_gap_s, now - last - self.period_s)
            last = now

    def __enter__(self) -> _Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


async def _run(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from kvmesh.harness.server import NatsServer  # noqa: PLC0415
    from kvmesh.runtime import subjects  # noqa: PLC0415 - keep `--help` light
    from kvmesh.runtime.nats import StreamSettings, connect, ensure_stream  # noqa: PLC0415
    from kvmesh.runtime.snapshots import SnapshotStore, replay_stream  # noqa: PLC0415

    r: dict[str, Any] = {"blocks": a.blocks, "workers": a.workers, "blocks_per_event": a.blocks_per_event}

    def say(text: str) -> None:
        if not a.json:
            print(text)

    say(f"building {a.blocks:,} blocks over {a.workers} workers ...")
    messages = make_messages(a.blocks, a.workers, a.blocks_per_event)
    state = IndexState()
    t0 = time.perf_counter()
    for seq, m in enumerate(messages, 1):
        state.apply(seq, m)
    r["apply_s"] = time.perf_counter() - t0
    r["apply_blocks_per_s"] = a.blocks / r["apply_s"]
    r["indexed_blocks"] = state.block_total()

    server = NatsServer(store_dir=tmp / "nats").start()
    try:
        nc = await connect(server.url, name="kvmesh-bench-recovery", wait_s=5.0)
        js = nc.jetstream()
        store = await SnapshotStore.open(js, "BENCH_SNAPSHOTS", max_bytes=-1)

        # -- snapshot write, as the lease holder does it
        say("writing a snapshot ...")
        with _Ticker() as ticker:
            await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            export = state.export()
            t1 = time.perf_counter()
            data = await asyncio.to_thread(encode_snapshot, export)
            t2 = time.perf_counter()
            entry = await store.put(export.applied_seq, data)
            t3 = time.perf_counter()
            await asyncio.sleep(0.01)
        del export
        r |= {
            "export_ms": (t1 - t0) * 1e3,
            "encode_s": t2 - t1,
            "upload_s": t3 - t2,
            "snapshot_write_s": t3 - t0,
            "snapshot_bytes": len(data),
            "loop_max_gap_ms": ticker.max_gap_s * 1e3,
        }

        # -- restore to ready, as a restarting indexer does it
        say("restoring it ...")
        digest = state.digest()
        del data
        t0 = time.perf_counter()
        got = await store.get(entry.name, timeout_s=60.0)
        t1 = time.perf_counter()
        restored_export = decode_snapshot(got)
        t2 = time.perf_counter()
        restored = IndexState.from_export(restored_export)
        t3 = time.perf_counter()
        r |= {
            "download_s": t1 - t0,
            "decode_verify_s": t2 - t1,
            "rebuild_s": t3 - t2,
            "restore_s": t3 - t0,
        }
        del got, restored_export
        t0 = time.perf_counter()
        r["restored_digest_equal"] = restored.digest() == digest
        r["digest_s"] = time.perf_counter() - t0
        del restored

        # -- replay through NATS
        n = min(a.replay_messages, len(messages))
        say(f"publishing {n:,} messages and replaying them ...")
        await ensure_stream(
            js, StreamSettings(name=STREAM, prefix=PREFIX, memory=False, max_bytes=-1, max_age_s=0)
        )
        payloads = [encode_message(m) for m in messages[:n]]
        subject_of = {
            m.worker_id: subjects.events_subject(PREFIX, MODEL, m.worker_id, 0) for m in messages[:n]
        }
        pending = []
        for m, p in zip(messages[:n], payloads, strict=True):
            pending.append(await js.publish_async(subject_of[m.worker_id], p, stream=STREAM))
            if len(pending) >= 512:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
        replay_blocks = sum(
            len(e.engine_hashes) for m in messages[:n] for e in m.events if isinstance(e, Stored)
        )

        fresh = IndexState()
        stats = await replay_stream(
            js, fresh, stream=STREAM, events_prefix=PREFIX, start_seq=1, to_seq=n, timeout_s=30.0
        )
        r |= {
            "replay_messages": n,
            "replay_blocks": replay_blocks,
            "replay_s": stats.seconds,
            "replay_blocks_per_s": replay_blocks / stats.seconds,
            "replay_complete": fresh.applied_seq == n and stats.decode_errors == stats.apply_errors == 0,
        }
        baseline = IndexState()
        t0 = time.perf_counter()
        for seq, p in enumerate(payloads, 1):
            baseline.apply(seq, decode_message(p))
        r["inproc_replay_blocks_per_s"] = replay_blocks / (time.perf_counter() - t0)
        r["replay_digest_equal"] = baseline.digest() == fresh.digest()

        # raw reader: the same ordered consumer that only counts messages
        count = 0
        done = asyncio.Event()

        async def on_msg(_msg: Any) -> None:
            nonlocal count
            count += 1
            if count >= n:
                done.set()

        t0 = time.perf_counter()
        sub = await js.subscribe(
            f"{PREFIX}.>",
            stream=STREAM,
            cb=on_msg,
            ordered_consumer=True,
            pending_msgs_limit=1 << 20,
            pending_bytes_limit=1 << 30,
        )
        await asyncio.wait_for(done.wait(), 60)
        r["raw_read_blocks_per_s"] = replay_blocks / (time.perf_counter() - t0)
        await sub.unsubscribe()
        await nc.close()
    finally:
        server.stop()
    return r


def _report(r: dict[str, Any]) -> str:
    def ok(good: bool) -> str:
        return "meets" if good else "MISSES"

    rows = [
        ("in-process apply (build)", f"{r['apply_blocks_per_s']:,.0f} blocks/s", "", ""),
        (
            "snapshot write (export + encode + upload)",
            f"{r['snapshot_write_s']:.2f} s, {r['snapshot_bytes'] / 1e6:.1f} MB",
            "",
            f"encode {r['encode_s']:.2f} s, upload {r['upload_s']:.2f} s",
        ),
        (
            "apply-loop stall: export()",
            f"{r['export_ms']:.1f} ms",
            f"≤ {STALL_TARGET_MS:.0f} ms: {ok(r['export_ms'] <= STALL_TARGET_MS)}",
            "",
        ),
        (
            "apply-loop stall: longest loop gap during the write",
            f"{r['loop_max_gap_ms']:.1f} ms",
            f"≤ {STALL_TARGET_MS:.0f} ms: {ok(r['loop_max_gap_ms'] <= STALL_TARGET_MS)}",
            "",
        ),
        (
            "restore to ready (download + verify + rebuild)",
            f"{r['restore_s']:.2f} s",
            f"≤ {RESTORE_TARGET_S:.0f} s: {ok(r['restore_s'] <= RESTORE_TARGET_S)}",
            f"download {r['download_s']:.2f} s, decode+verify {r['decode_verify_s']:.2f} s, "
            f"rebuild {r['rebuild_s']:.2f} s; digest equal: {r['restored_digest_equal']}",
        ),
        (
            "replay through NATS (ordered consumer + decode + apply)",
            f"{r['replay_blocks_per_s']:,.0f} block events/s",
            f"≥ {REPLAY_TARGET_PER_S:,.0f}/s: {ok(r['replay_blocks_per_s'] >= REPLAY_TARGET_PER_S)}",
            f"{r['replay_blocks_per_s'] / r['inproc_replay_blocks_per_s']:.2f}× in-process decode+apply "
            f"({r['inproc_replay_blocks_per_s']:,.0f}/s), "
            f"{r['replay_blocks_per_s'] / r['raw_read_blocks_per_s']:.2f}× a count-only reader "
            f"({r['raw_read_blocks_per_s']:,.0f}/s)",
        ),
    ]
    head = (
        f"kvmesh bench recovery: {r['blocks']:,} blocks over {r['workers']} workers, "
        f"{r['blocks_per_event']} blocks per event; replay of {r['replay_messages']:,} messages "
        f"({r['replay_blocks']:,} block events); Python {platform.python_version()}"
    )
    lines = [head, ""]
    lines += [f"{'figure':<58} {'measured':<26} {'target':<22} notes"]
    lines += [f"{a:<58} {b:<26} {c:<22} {d}" for a, b, c, d in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvmesh bench recovery``; returns the exit code (1 when a result is wrong, not when slow)."""
    parser = argparse.ArgumentParser(
        prog="kvmesh bench recovery",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Snapshot write time (with the Object Store upload), apply-loop stall, restore to ready "
        "(download + verify + rebuild) and replay rate through NATS, on a private nats-server, with the "
        "targets and same-run baselines.",
    )
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks in the index")
    parser.add_argument("--workers", type=int, default=8, help="workers holding them")
    parser.add_argument("--blocks-per-event", type=int, default=16, help="blocks per BlockStored")
    parser.add_argument(
        "--replay-messages", type=int, default=20_000, help="stream messages replayed through NATS"
    )
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    a = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.blocks < 1 or a.workers < 1 or a.blocks_per_event < 1 or a.replay_messages < 1:
        parser.error("--blocks, --workers, --blocks-per-event and --replay-messages must be ≥ 1")
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-recovery-"))
    try:
        r = asyncio.run(_run(a, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(r, indent=2) if a.json else _report(r))
    whole = r["restored_digest_equal"] and r["replay_complete"] and r["replay_digest_equal"]
    if not whole:
        print(
            "kvmesh bench recovery: a restored or replayed index differs from the original", file=sys.stderr
        )
    return 0 if whole else 1


command = main
"""Alias for the ``kvmesh bench`` dispatcher, which calls each benchmark module's ``command``."""
