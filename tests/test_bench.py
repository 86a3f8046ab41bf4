"""Tests of the benchmarks (`kvmesh.bench`): the trace replay end to end and the index workload."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvmesh.bench import trace as bench_trace


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_trace_200_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvmesh bench trace --requests 200` writes a 5-policy table; oracle ≥ kvmesh ≥ round-robin on hits."""
    out = tmp_path / "trace"
    assert bench_trace.command(["--requests", "200", "--speed", "20", "--out", str(out)]) == 0
    text = out.with_suffix(".md").read_text()
    lines = text.strip().splitlines()
    assert lines[0].startswith("| policy | requests | hit ratio |")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:]}
    assert list(rows) == list(bench_trace.POLICIES)
    assert all(len(cells) == len(lines[0].split("|")) - 3 for cells in rows.values())
    assert all(cells[0] == "200" for cells in rows.values())
    hit = {p: float(re.sub(r"[^0-9.]", "", cells[1])) for p, cells in rows.items()}
    assert hit["oracle"] >= hit["kvmesh"] >= hit["round-robin"], hit
    assert rows["kvmesh"][6] != "–"  # router latency measured
    png = out.with_suffix(".png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_policies_are_deterministic() -> None:
    """The in-process policies give identical results on identical inputs."""
    trace = bench_trace.load_trace(bench_trace.default_trace_path(), limit=30)
    spec = bench_trace.FleetSpec(workers=3, num_blocks=4096)
    for policy in ("round-robin", "random", "least-loaded", "oracle"):
        a = bench_trace.simulate_policy(policy, trace, spec)
        b = bench_trace.simulate_policy(policy, trace, spec)
        assert (a.cached_tokens, a.ttft_s, a.per_worker) == (b.cached_tokens, b.ttft_s, b.per_worker)
        assert a.requests + a.rejected == 30


def test_oracle_hits_at_least_round_robin() -> None:
    """Knowing every cache gives at least round-robin's hit ratio on the packaged trace excerpt."""
    trace = bench_trace.load_trace(bench_trace.default_trace_path(), limit=120)
    spec = bench_trace.FleetSpec(workers=4, num_blocks=8192)
    rr = bench_trace.simulate_policy("round-robin", trace, spec)
    oracle = bench_trace.simulate_policy("oracle", trace, spec)
    assert oracle.hit_ratio >= rr.hit_ratio


@pytest.mark.parametrize("eviction", ["tail", "random"])
def test_index_workload_kvmesh_agrees_with_naive(eviction: str) -> None:
    """On the index benchmark's workload (with evictions) kvmesh's index answers every query like the naive one."""
    from kvmesh.bench import index as bench_index

    wl = bench_index.make_workload(target_ops=40_000, workers=4, capacity=2000, eviction=eviction, queries=50)
    assert wl.removed_blocks > 0
    sides = bench_index.run_index(wl, with_dynamo=False, repeat=1, say=lambda _s: None)
    assert bench_index.disagreements(sides[:-1], wl) == []
    assert len(sides[0].match_us) == 50


def test_index_workload_is_deterministic() -> None:
    """The same seed gives the same events and queries."""
    from kvmesh.bench import index as bench_index

    a = bench_index.make_workload(target_ops=5000, capacity=500, queries=5, eviction="random")
    b = bench_index.make_workload(target_ops=5000, capacity=500, queries=5, eviction="random")
    assert a.events == b.events and a.queries == b.queries


def test_chart_without_matplotlib_writes_a_valid_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib the chart falls back to the pure-Python PNG writer, and the file decodes."""
    import struct
    import sys
    import zlib

    from kvmesh.bench.chart import write_bar_charts

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = tmp_path / "c.png"
    assert write_bar_charts(path, "t", ["a", "b"], [("x", [1.0, 2.0]), ("y", [0.5, 0.0])]) == "plain"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat_len = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41 : 41 + idat_len])
    assert len(raw) == height * (1 + 3 * width)
