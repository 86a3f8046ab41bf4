"""`kvmesh status`: the stream and every ingest's per-rank cursors and fault counters, exactly."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
from tests.pipeline import eventually
from tests.test_ingest_faults import ANY, BS, T, U, blk, stored
from tests.test_ingest_outage import Restartable, file_pipeline, roots, stream_messages, wait_disconnected

from kvmesh.cli import status_command
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def test_status_shows_exact_ingest_cursors_and_counters(
    tmp_path: Path, uid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """After a healed gap, a malformed batch, an unhealed gap, a rejected event, an overflowing outage and an engine restart, `kvmesh status` reports each count exactly."""
    store = tmp_path / "js"
    server = Restartable(store)
    pub = EventPublisher(ANY, ANY)
    worker = f"s-{uid}"
    try:
        async with file_pipeline(server, uid) as p:
            ing = await p.start_ingest(
                worker,
                pub.endpoint,
                pub.replay_endpoint,
                block_size=BS,
                max_buffered_batches=2,
                replay_timeout_s=0.5,
            )
            await pub.wait_for_subscribers(1)

            async def rank0() -> dict[str, object]:
                return msgspec.structs.asdict(ing.status().ranks["0"])

            async def drained() -> None:
                # The outbox holds only 2 batches: let each step's batches out before the next step.
                await eventually(
                    lambda: asyncio.sleep(0, ing.status().outbox), lambda n: n == 0, timeout_s=30
                )

            await drained()

            pub.publish([stored([1], blk(T, 0))])  # seq 0
            await eventually(rank0, lambda r: r["last_seq"] == 0, timeout_s=30)
            await drained()
            pub.drop_next(1)
            pub.publish([stored([2], blk(T, 1), parent=1)])  # seq 1: dropped live, replayed
            pub.publish([stored([3], blk(T, 2), parent=2)])  # seq 2
            await eventually(rank0, lambda r: r["last_seq"] == 2 and not r["replaying"], timeout_s=30)
            await drained()
            pub.publish_raw(b"\xc1garbage")  # seq 3: undecodable
            await eventually(rank0, lambda r: r["last_seq"] == 3, timeout_s=30)
            await drained()
            pub.replay_enabled = False
            pub.drop_next(1)
            pub.publish([stored([4], blk(T, 3), parent=3)])  # seq 4: dropped, never replayed
            pub.publish([stored([10], blk(U, 0))])  # seq 5: after the replay times out, a resync
            await eventually(rank0, lambda r: r["last_seq"] == 5 and not r["replaying"], timeout_s=30)
            await drained()
            pub.publish([stored([11, 12], U[:7])])  # seq 6: 7 tokens for 2 blocks, rejected
            await eventually(rank0, lambda r: r["last_seq"] == 6, timeout_s=30)
            await drained()

            server.kill()
            await wait_disconnected(ing)
            for i, prompt in enumerate(roots(4, 5000)):  # seq 7 … 10: the outbox keeps the last 2
                pub.publish([stored([100 + i], prompt)])
            await eventually(rank0, lambda r: r["last_seq"] == 10, timeout_s=30)
            server.restart()
            await drained()
            pub.restart()
            pub.publish([stored([1], blk(T, 0))])  # seq 0 of the engine's next incarnation
            await eventually(rank0, lambda r: (r["epoch"], r["last_seq"]) == (1, 0), timeout_s=30)
            await drained()
            # hello, seq 0-2, malformed clear, gap clear, seq 5-6, overflow clear, seq 9-10, restart clear, seq 0
            assert await stream_messages(server.url, p.stream) == 13

            capsys.readouterr()
            code = await asyncio.to_thread(
                status_command, ["--json", "--nats-url", server.url, "--stream", p.stream, "--wait-s", "0.5"]
            )
            assert code == 0
            out = json.loads(capsys.readouterr().out)
            assert (out["stream"]["name"], out["stream"]["messages"]) == (p.stream, 13)
            [st] = [i for i in out["ingests"] if i["worker_id"] == worker]
            assert (st["model"], st["outbox"]) == ("test-model", 0)
            c = st["counters"]
            assert {k: c[k] for k in ("batches", "published", "decode_errors", "rejected_events")} == {
                "batches": 11,
                "published": 13,
                "decode_errors": 1,
                "rejected_events": 1,
            }
            assert (c["dropped_batches"], c["split_batches"]) == (2, 0)
            r = st["ranks"]["0"]
            assert (r["epoch"], r["last_seq"], r["replaying"], r["block_size"]) == (1, 0, False, BS)
            assert r["sequence"] == {
                "delivered": 11,
                "gaps": 2,
                "missing_batches": 2,
                "replays": 2,
                "replayed_batches": 1,
                "healed": 1,
                "resyncs": 1,
                "restarts": 1,
                "duplicates": 0,
                "snapshots": 0,
                "rebuilds": 0,
                "snapshot_failures": 0,
                "heartbeats": 0,
            }
            assert r["events"]["rejected_alignment"] == 1
    finally:
        pub.close()
        server.stop()
