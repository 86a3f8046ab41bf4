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
