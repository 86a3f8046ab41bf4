"""The simulated engine's record of what it published, and its self-made traffic's end-of-run report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.core.wire import BlockStored, decode_batch, engine_key
from kvmesh.sim.engine import SimWorker
from kvmesh.sim.publisher import EventPublisher, read_record
from kvmesh.sim.traffic import drive

pytestmark = pytest.mark.anyio


def _stored(h: int) -> BlockStored:
    return BlockStored(block_hashes=(h,), parent_block_hash=None, token_ids=tuple(range(4)), block_size=4)


def test_record_holds_every_batch_live_or_dropped_and_skips_a_cut_tail(tmp_path: Path) -> None:
    """Every batch taken by the publisher, dropped ones included, is recorded byte for byte; a cut-off tail is ignored."""
    path = tmp_path / "w.0.kv"
    with EventPublisher("tcp://127.0.0.1:*", record_path=path) as pub:
        pub.publish([_stored(11)])
        pub.drop_next(1)
        pub.publish([_stored(12)])
        pub.publish_raw(b"raw")
    records = read_record(path)
    assert [seq for seq, _ in records] == [0, 1, 2]
    assert [decode_batch(p).events[0].block_hashes for _, p in records[:2]] == [(11,), (12,)]  # type: ignore[union-attr]
    assert records[2] == (2, b"raw")
    with open(path, "ab") as f:
        f.write((3).to_bytes(8, "big") + (100).to_bytes(4, "big") + b"short")
    assert read_record(path) == records


async def test_traffic_report_lists_the_pool_cache_and_the_next_seq(tmp_path: Path) -> None:
    """After its traffic, a worker reports exactly its pool's cached engine keys and the seq of its next batch."""
    record = tmp_path / "w.0.kv"
    report = tmp_path / "w.0.kv.done"
    async with SimWorker(
        "w", num_blocks=24, block_size=4, endpoint="tcp://127.0.0.1:*", record_path=record
    ) as worker:
        await drive(worker, rps=400.0, duration_s=0.3, seed=3, report_path=report, subscriber_wait_s=0.0)
        body = json.loads(report.read_text())
        assert body["cached"] == sorted(engine_key(h) for h in worker.pool.cached_block_hashes())
        assert body["next_seq"] == worker.publisher.next_seq == len(read_record(record)) > 0
        assert body["served"] > 0 and body["refused"] == 0
