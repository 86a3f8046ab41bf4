"""An ingest process killed with SIGKILL while it waits for an engine snapshot (vLLM PR #57789).

A real ``python -m kvmesh.ingest`` process on a stand-in publisher with a snapshot socket, the indexer and
router as tasks, a real nats-server. The snapshot socket does not answer the first ingest, which is killed
-9 while it waits (the live batch it holds is lost with it); the engine goes on publishing; a second ingest
process rebuilds the rank from the snapshot, and the index equals the engine's state exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.pipeline import eventually
from tests.test_ingest_faults import ANY, BS, T, U, V, blk, clean_pipeline, removed, stored
from tests.test_ingest_outage import expect
from tests.test_vllm_snapshot_wire import index_digest, truth_digest

from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parent.parent


def ingest_process(
    log: Path, url: str, *, stream: str, prefix: str, model: str, pub: EventPublisher
) -> subprocess.Popen[bytes]:
    """``python -m kvmesh.ingest`` for worker ``w`` on ``pub`` (its snapshot socket, no replay socket)."""
    cmd = [
        sys.executable, "-m", "kvmesh.ingest",
        "--nats-url", url, "--stream", stream, "--events-prefix", prefix,
        "--worker-id", "w", "--model", model, "--block-size", str(BS),
        "--zmq-endpoint", pub.endpoint, "--snapshot-endpoint", str(pub.snapshot_endpoint),
        "--replay-timeout-s", "60", "--stream-memory", "--stream-max-bytes", str(64 * 2**20),
        "--max-coalesced-batches", "1",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def log_text(log: Path) -> str:
    return log.read_text() if log.exists() else ""


def line_count(log: Path, text: str) -> int:
    """JSON lines of ``log`` whose msg contains ``text``."""
    lines = log_text(log).splitlines()
    return sum(text in json.loads(ln).get("msg", "") for ln in lines if ln.startswith("{"))


async def wait_for_lines(
    log: Path, proc: subprocess.Popen[bytes], text: str, n: int = 1, timeout_s: float = 30.0
) -> None:
    """Wait until ``log`` holds ``n`` lines with ``text`` (the process must stay up meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if line_count(log, text) >= n:
            return
        assert proc.poll() is None, log_text(log)
        await asyncio.sleep(0.05)
    raise AssertionError(f"not {n} lines with {text!r}:\n{log_text(log)}")


async def test_an_ingest_killed_during_a_snapshot_wait_is_rebuilt_by_the_next(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    """T indexed; a gap; the first ingest asks for a snapshot that does not come and is killed -9; U's child,
    a removal and V come while no ingest reads; the second ingest (snapshot socket answering again) recovers
    its cursor, sees the gap, rebuilds: T 3 blocks, U 1, V 2, and the index digest equals the engine's."""
    record = tmp_path / "engine.rec"
    pub = EventPublisher(ANY, snapshot_endpoint=ANY, record_path=record)
    log = tmp_path / "ingest.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        async with clean_pipeline(nats_url, uid) as p:
            procs.append(
                ingest_process(log, nats_url, stream=p.stream, prefix=p.prefix, model=p.model, pub=pub)
            )
            await pub.wait_for_subscribers(1, timeout_s=30.0)
            await p.start_indexer()
            await p.start_router()
            pub.publish([stored([1, 2], blk(T, 0, 2))])
            pub.publish([stored([11, 12], U)])
            await expect(p, [T, U], [{"w/0": 2}, {"w/0": 2}])
            pub.snapshot_enabled = False
            pub.drop_next(1)
            pub.publish([stored([3], blk(T, 2), parent=2)])  # seq 2, lost
            pub.publish([removed(12)])  # seq 3, live: held while the snapshot is awaited
            await wait_for_lines(log, procs[0], "asking for a snapshot")
            procs[0].kill()
            procs[0].wait(timeout=10)
            pub.publish([stored([21, 22], V)])  # seq 4: no ingest reads
            pub.snapshot_enabled = True
            procs.append(
                ingest_process(log, nats_url, stream=p.stream, prefix=p.prefix, model=p.model, pub=pub)
            )
            await pub.wait_for_subscribers(2, timeout_s=30.0)  # the counter is cumulative: the second SUB
            await wait_for_lines(log, procs[1], "publishing to", 2)
            pub.publish([stored([4], blk(T, 3), parent=3), removed(4)])  # seq 5, live: the gap shows
            await expect(p, [T, U, V], [{"w/0": 3}, {"w/0": 1}, {"w/0": 2}], timeout_s=30)
            assert await eventually(
                lambda: asyncio.sleep(0, index_digest(p)), lambda d: d == truth_digest(record, p.model)
            )
            assert procs[1].poll() is None
            assert line_count(log, "rebuilding from the engine's snapshot at seq 5") == 1
            assert line_count(log, "asking for a snapshot") == 2
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=15)
        pub.close()
