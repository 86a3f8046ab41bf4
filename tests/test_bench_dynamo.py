"""Tests of `kvmesh bench dynamo` (`kvmesh.bench.dynamo_e2e`): the frames and their truth, the kvmesh side
through the real services, and the comparison with Dynamo's standalone indexer where it is installed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench import dynamo_e2e
from kvmesh.bench.cli import command as bench_command
from kvmesh.core.wire import decode_batch


def test_frames_and_truth() -> None:
    """10 trace requests on 2 pools of 1,024 blocks, then a sentinel each: every event counted, the truth."""
    fr = dynamo_e2e.make_frames(2, 10, num_blocks=1024, queries=5)
    assert (fr.served, fr.stored_blocks, fr.removed_blocks, fr.block_ops) == (7, 2702, 836, 3538)
    assert [len(f) for f in fr.frames] == [5, 4]  # the requests' steps, then each engine's sentinel
    assert [len(p) for p in fr.probes] == [64, 64]
    assert fr.probe_truth == [[4, 0], [0, 4]]
    assert fr.truth[:5] == [[256, 32], [32, 143], [256, 32], [32, 143], [32, 32]]
    assert [len(q) for q in fr.queries] == [4096, 2290, 4096, 2290, 4096]  # the first 4,096 tokens or fewer
    # The frames are vLLM 0.33 batches whose events add up to the same block operations.
    ops = 0
    for frames in fr.frames:
        for raw in frames:
            batch = decode_batch(raw)
            ops += sum(len(getattr(ev, "block_hashes", ())) for ev in batch.events)
    assert ops == fr.block_ops


def test_settle_rule() -> None:
    """Queryable once the answers equal the truth; past the timeout, queryable but not settled."""
    s = dynamo_e2e._Settle([[4, 0]], [os.getpid()], timeout_s=60.0)
    assert not s.done([[0, 0]])
    assert not s.done([[3, 0]])
    assert s.done([[4, 0]]) and s.settled
    s = dynamo_e2e._Settle([[4, 0]], [os.getpid()], timeout_s=0.0)
    assert s.done([[0, 0]]) and not s.settled


def _run(tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "dyn"
    argv = ["dynamo", "--workers", "4", "--requests", "40", "--num-blocks", "2048", "--queries", "20"]
    assert (
        bench_command([*argv, "--query-requests", "50", "--timeout-s", "60", "--out", str(out), *extra]) == 0
    )
    doc: dict[str, Any] = json.loads(out.with_suffix(".json").read_text())
    return doc


@pytest.mark.e2e
def test_skip_message_without_dynamo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the bench extra the Dynamo side is skipped with the message; kvmesh still runs, exact."""
    monkeypatch.setattr(dynamo_e2e, "dynamo_available", lambda: False)
    doc = _run(tmp_path)
    text = capsys.readouterr().out
    assert dynamo_e2e.SKIP_MESSAGE in text
    assert "targets (issue 14): not checked, Dynamo's side was skipped" in text
    config = doc["config"]
    assert (config["dynamo"], config["order"], config["block_ops"]) == (False, ["kvmesh"], 36278)
    [run] = doc["runs"]
    assert run["system"] == "kvmesh"
    assert (run["settled"], run["off_pairs"], run["exact_pairs"]) == (True, 0, 80)
    assert (run["query_requests"], run["query_errors"], run["processes"]) == (50, 0, 7)
    assert run["block_ops"] == 36278 and run["ops_per_s"] > 0 and run["rss_bytes"] > 0
    assert doc["targets"] == {}


@pytest.mark.e2e
def test_against_dynamo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With Dynamo's standalone indexer installed: both systems run on the same frames, kvmesh exact."""
    if not dynamo_e2e.dynamo_available():
        pytest.skip(dynamo_e2e.SKIP_MESSAGE)
    doc = _run(tmp_path)
    runs = doc["runs"]
    assert [r["system"] for r in runs] == ["dynamo", "kvmesh"]
    for r in runs:
        assert r["block_ops"] == 36278
        assert r["exact_pairs"] + r["off_pairs"] == 80
        assert (r["query_requests"], r["query_errors"]) == (50, 0)
        assert r["cpu_s"] > 0 and r["rss_bytes"] > 0
    dyn, kv = runs
    assert (dyn["processes"], dyn["settled"]) == (1, True)
    assert (kv["settled"], kv["off_pairs"]) == (True, 0)
    targets = doc["targets"]
    assert set(targets) == {"throughput_ratio", "throughput_met", "cpu_ratio", "cpu_met"}
    assert targets["throughput_ratio"] == pytest.approx(kv["ops_per_s"] / dyn["ops_per_s"])
    text = capsys.readouterr().out
    assert "- throughput ≥ 0.6× Dynamo's:" in text and "- CPU per block operation ≤ 2× Dynamo's:" in text


def test_memory_growth_per_held_block() -> None:
    """Growth per held block: kvmesh's indexer and router apart (the larger over runs) against 64 B, Dynamo beside."""
    fr = dynamo_e2e.make_frames(2, 10, num_blocks=1024, queries=1)
    assert fr.held_blocks == 2702 - 836
    kv = dynamo_e2e.RunResult(
        system="kvmesh",
        block_ops=10,
        held_blocks=1000,
        indexer_growth_bytes=40_000,
        router_growth_bytes=64_000,
    )
    kv2 = dynamo_e2e.RunResult(system="kvmesh", block_ops=10, held_blocks=1000, indexer_growth_bytes=50_000)
    dyn = dynamo_e2e.RunResult(system="dynamo", block_ops=10, held_blocks=1000, indexer_growth_bytes=90_000)
    assert (kv.indexer_bytes_per_block, kv.router_bytes_per_block) == (40.0, 64.0)
    assert dynamo_e2e.memory_growth([kv, kv2]) == {
        "indexer_bytes_per_block": 50.0,
        "router_bytes_per_block": 64.0,
        "met": True,
    }
    kv3 = dynamo_e2e.RunResult(system="kvmesh", block_ops=10, held_blocks=1000, router_growth_bytes=64_001)
    assert dynamo_e2e.memory_growth([dyn, kv3]) == {
        "indexer_bytes_per_block": 0.0,
        "router_bytes_per_block": 64.001,
        "met": False,
        "dynamo_bytes_per_block": 90.0,
    }
    assert dynamo_e2e.memory_growth([dyn]) == {}
    assert kv.summary()["router_bytes_per_block"] == 64.0
