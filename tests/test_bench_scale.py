"""Tests of `kvmesh bench scale` (`kvmesh.bench.scale`): the hot-prefix workload, its match answers, and a tiny
sweep through the real services."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench import scale
from kvmesh.bench.cli import command as bench_command
from kvmesh.core.events import Stored
from kvmesh.core.hashing import prompt_prefix_keys
from kvmesh.core.index import Holder, PrefixIndex


def _index(wl: scale.ScaleWorkload) -> PrefixIndex:
    index = PrefixIndex()
    for m in wl.messages:
        for ev in m.events:
            assert isinstance(ev, Stored)
            index.store(Holder(m.worker_id, m.dp_rank), ev.engine_hashes, ev.parent, ev.local_hashes)
    return index


def test_parse_count() -> None:
    """Counts accept plain digits, separators and k/M suffixes; zero and junk are refused."""
    assert [scale.parse_count(t) for t in ("2000", "100k", "1M", "1.5M", "10_000")] == [
        2000,
        100_000,
        1_000_000,
        1_500_000,
        10_000,
    ]
    for bad in ("0", "M", "x"):
        with pytest.raises(ValueError):
            scale.parse_count(bad)


def test_workload_shape() -> None:
    """8 workers × 2,000 blocks: each worker holds the 32-block hot prefix and one 218-block conversation."""
    wl = scale.make_workload(8, 2000, queries=10)
    assert wl.stored_blocks == 2000
    assert [(w, n) for w, _seed, n in wl.conversations] == [(w, 218) for w in range(8)]
    assert len(wl.messages) == 8
    assert [m.worker_id for m in wl.messages] == [f"w{w}" for w in range(8)]
    for m in wl.messages:
        hot, conv = m.events
        assert isinstance(hot, Stored) and isinstance(conv, Stored)
        assert hot.parent is None and len(hot.engine_hashes) == 32
        assert conv.parent == hot.engine_hashes[-1] and len(conv.engine_hashes) == 218
    assert all(len(q) == 4096 for q in wl.queries)
    # 8 workers × 100,000 blocks: 12,500 each, the hot prefix and 56 conversations (55 of 224 blocks, one of
    # 148) in 4 messages of at most 16 events.
    many = scale.make_workload(8, 100_000, queries=1)
    assert (many.stored_blocks, len(many.conversations), len(many.messages)) == (100_000, 448, 32)
    assert [n for w, _s, n in many.conversations if w == 0] == [224] * 55 + [148]
    assert [len(m.events) for m in many.messages[:4]] == [16, 16, 16, 9]
    # 1,024 workers × 100,000 blocks: 97 blocks each, the hot prefix plus a 65-block conversation.
    big = scale.make_workload(1024, 100_000, queries=1)
    assert big.stored_blocks == 1024 * 97
    assert {n for _w, _s, n in big.conversations} == {65}


def test_match_answers() -> None:
    """Every worker matches the hot prefix; the conversation's worker matches it plus the blocks it continues."""
    wl = scale.make_workload(16, 2000, queries=30)
    index = _index(wl)
    for i, q in enumerate(wl.queries):
        got = {h.worker_id: n for h, n in index.match(prompt_prefix_keys(q, scale.BLOCK_SIZE)).items()}
        assert got == scale.expected_overlaps(wl, i)
    # By hand: the hot prefix and the first 10 blocks of worker 3's conversation, then fresh tokens.
    prompt = [*wl.hot_tokens, *wl.conversation_tokens(3)[:160], *([7] * 320)]
    got = {h.worker_id: n for h, n in index.match(prompt_prefix_keys(prompt, 16)).items()}
    assert got == {f"w{w}": 42 if w == 3 else 32 for w in range(16)}
    # Five blocks of the hot prefix alone: every worker scores 5.
    got = {h.worker_id: n for h, n in index.match(prompt_prefix_keys(wl.hot_tokens[:80], 16)).items()}
    assert got == {f"w{w}": 5 for w in range(16)}
    tiers = index.match_tiers(prompt_prefix_keys(prompt, 16))
    assert {h.worker_id: (o.blocks, o.tiers) for h, o in tiers.items()} == {
        f"w{w}": (42 if w == 3 else 32, None) for w in range(16)
    }


@pytest.mark.e2e
def test_tiny_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvmesh bench scale --workers 8,16 --blocks 2000` through nats-server, an indexer and a local-index
    router: every match and route answer exact, the JSON holds one point per worker count, a plot."""
    out = tmp_path / "scale"
    argv = ["scale", "--workers", "8,16", "--blocks", "2000", "--queries", "20", "--route-requests", "30"]
    assert bench_command([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["config"]["workers"] == [8, 16]
    assert doc["config"]["blocks"] == [2000]
    assert (doc["config"]["hot_blocks"], doc["config"]["prompt_tokens"]) == (32, 4096)
    points = doc["points"]
    assert [(p["workers"], p["blocks"], p["stored_blocks"]) for p in points] == [
        (8, 2000, 2000),
        (16, 2000, 2000),
    ]
    assert [(p["conversations"], p["messages"], p["queries"]) for p in points] == [(8, 8, 20), (16, 16, 20)]
    for p in points:
        assert p["match_wrong"] == 0
        assert p["restored_equal"] is True
        assert p["snapshot_bytes"] > 0
        assert p["route_requests"] == 30
        assert p["route_errors"] == 0
        assert p["route_to_longest"] == 30
        assert 0 < p["match_p50_us"] <= p["match_p99_us"]
        assert 0 < p["route_p50_ms"] <= p["route_p99_ms"]
        assert 0 < p["route_live_p50_ms"] <= p["route_live_p99_ms"]
        assert p["memory_bytes_per_block"] > 0
    still, live = doc["targets"]
    assert still["target"] == "route p50 at 16 workers ≤ 2× at 8 (2,000 blocks)"
    assert still["ratio"] == pytest.approx(points[1]["route_p50_ms"] / points[0]["route_p50_ms"])
    assert live["target"] == "route p50 under events at 16 workers ≤ 2× at 8 (2,000 blocks)"
    assert live["ratio"] == pytest.approx(points[1]["route_live_p50_ms"] / points[0]["route_live_p50_ms"])
    text = capsys.readouterr().out
    assert "| workers | blocks | match p50/p99 (µs) |" in text
    assert "| under events p50/p99 (ms) |" in text
    assert "route p50 at 16 workers ≤ 2× at 8 (2,000 blocks):" in text
    png = out.with_suffix(".png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in text and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
