"""Tests of the benchmarks (`kvmesh.bench`): the trace replay end to end and the index workload."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench import trace as bench_trace
from kvmesh.sim.timing import TimingModel
from kvmesh.sim.trace import default_trace_path, load_trace


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_trace_200_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvmesh bench trace --requests 200` writes a 5-policy table; kvmesh beats round-robin on hits and TTFT.

    The oracle minimises each request's TTFT, not the fleet's hit ratio, so kvmesh may cache more than it
    (here it does: about 5.2 % against 4.5 %); kvmesh must reach at least 90 % of it. The in-process rows are
    deterministic and checked exactly.
    """
    out = tmp_path / "trace"
    assert bench_trace.command(["--requests", "200", "--speed", "20", "--out", str(out)]) == 0
    text = out.with_suffix(".md").read_text()
    lines = text.strip().splitlines()
    assert lines[0].startswith("| policy | requests | hit ratio |")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:]}
    # a harness that fell behind at 20× adds the oracle on the arrivals kvmesh's requests had, after kvmesh
    replayed = "oracle @ kvmesh's arrivals"
    assert [p for p in rows if p != replayed] == list(bench_trace.POLICIES)
    assert replayed not in rows or list(rows).index(replayed) == 1
    assert all(len(cells) == len(lines[0].split("|")) - 3 for cells in rows.values())
    assert all(cells[0] == "200" for cells in rows.values())
    hit = {p: float(re.sub(r"[^0-9.]", "", cells[1])) for p, cells in rows.items()}
    assert hit["kvmesh"] > hit["round-robin"], hit
    assert hit["kvmesh"] >= 0.9 * hit["oracle"], hit
    ttft_p50 = {p: float(cells[3]) for p, cells in rows.items()}
    assert ttft_p50["kvmesh"] < ttft_p50["round-robin"], ttft_p50
    assert [rows[p][1:4] for p in ("round-robin", "least-loaded", "oracle")] == [
        ["3.53 %", "0.780", "1.247"],
        ["3.53 %", "0.780", "1.337"],
        ["4.53 %", "1.000", "0.965"],
    ]
    assert re.fullmatch(r"\d+\.\d\d / \d+\.\d\d", rows["kvmesh"][6])  # route latency measured (ms)
    assert rows["oracle"][6] == "0 (in-process)"
    png = out.with_suffix(".png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_every_request_reaches_its_engine_after_its_routing_delay() -> None:
    """Sent with a 3 ms delay at 1.0 s, a 10-token prompt reaches worker 1 at 1.003 s: TTFT 3 ms + 100 ms.

    The lifecycle notes come when they happen in simulated time: prefill done at the first token (1.103 s),
    finished at the last (1.303 s, with the decode block that fills at that step).
    """
    timing = TimingModel(
        prefill_s_per_token=0.01, prefill_overhead_s=0.0, decode_s_per_token=0.1, max_batch=2
    )
    spec = bench_trace.FleetSpec(workers=2, num_blocks=64, block_size=4, timing=timing)
    result = bench_trace.PolicyResult(policy="t", per_worker=[0, 0])
    fleet = bench_trace._Fleet(spec, result)
    fleet.send(bench_trace._Prepared("r", 1.0, list(range(10)), [7, 8, 9]), 1, 0.003)
    assert fleet.next_time_s() == pytest.approx(1.003)
    assert fleet.advance(1.002) == []

    def seen(items: list[tuple[float, int, int, int, Any]]) -> list[tuple[float, int, int, object]]:
        """(time, worker, kind, request id or the batch's event count)."""
        return [
            (round(t, 9), k, kind, x if isinstance(x, str) else len(x.events)) for t, _, k, kind, x in items
        ]

    # kinds: 0 event batch (its event count), 1 prefill done, 2 finished (the request id)
    assert seen(fleet.advance(1.2)) == [(1.003, 1, 0, 1), (1.103, 1, 1, "r")]
    assert seen(fleet.advance(math.inf)) == [(1.303, 1, 0, 1), (1.303, 1, 2, "r")]
    assert fleet.next_time_s() is None
    fleet.close(0.0)
    assert result.ttft_s == [pytest.approx(0.103)]
    assert (result.requests, result.per_worker) == (1, [0, 1])
    assert result.makespan_s == pytest.approx(1.303)


def test_kvmesh_exact_and_the_baselines_on_the_excerpt() -> None:
    """First 200 requests of the packaged trace, 8 default workers: exact cached tokens and TTFT p50.

    kvmesh's decision on the true pools (default `Policy`: decode weight 0.1; the ledger's prefill progress
    estimate on, the router's default) caches 5.02 % of 2,782,179 prompt tokens here, 11 % more than the TTFT
    oracle's 4.53 %, at a TTFT p50 4 % above the oracle's. (Without the estimate it cached exactly the oracle's
    125,952 tokens at the same p50.)
    """
    trace = load_trace(default_trace_path(), limit=200)
    spec = bench_trace.FleetSpec()
    got = {}
    for policy in ("round-robin", "oracle", "kvmesh-exact"):
        r = bench_trace.simulate_policy(policy, trace, spec)
        assert (r.requests, r.prompt_tokens) == (200, 2_782_179)
        got[policy] = (r.cached_tokens, round(bench_trace.percentile(r.ttft_s, 0.5), 4))
    assert got == {
        "round-robin": (98_304, 1.2465),
        "oracle": (125_952, 0.9654),
        "kvmesh-exact": (139_776, 1.0038),
    }


def test_policies_are_deterministic() -> None:
    """The in-process policies give identical results on identical inputs."""
    trace = load_trace(default_trace_path(), limit=30)
    spec = bench_trace.FleetSpec(workers=3, num_blocks=4096)
    for policy in ("round-robin", "random", "least-loaded", "oracle", "kvmesh-exact"):
        a = bench_trace.simulate_policy(policy, trace, spec)
        b = bench_trace.simulate_policy(policy, trace, spec)
        assert (a.cached_tokens, a.ttft_s, a.per_worker) == (b.cached_tokens, b.ttft_s, b.per_worker)
        assert a.requests + a.rejected == 30


def test_oracle_hits_at_least_round_robin() -> None:
    """Knowing every cache gives at least round-robin's hit ratio on the packaged trace excerpt."""
    trace = load_trace(default_trace_path(), limit=120)
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


def test_memory_per_block_measures_each_index_in_its_own_process() -> None:
    """`memory_per_block` reports resident-set growth per block for kvmesh and the naive index: kvmesh's
    tables (at least the 16-byte blocks slot per block, under the naive index's two dict entries and ints),
    the naive index at least its two 32-byte ints and dict entries."""
    from kvmesh.bench import index as bench_index

    got = bench_index.memory_per_block(200_000, with_dynamo=False)
    assert list(got) == ["kvmesh PrefixIndex", "naive dict index"]
    assert 16 <= got["kvmesh PrefixIndex"] < 100, got
    assert 100 <= got["naive dict index"] < 400, got
    assert got["kvmesh PrefixIndex"] < got["naive dict index"] / 2, got


def test_bench_index_times_a_baseline_index_file(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvmesh bench index --baseline FILE` times another index module's apply in the same rounds."""
    from kvmesh.bench import index as bench_index
    from kvmesh.core import index as core_index

    argv = ["--ops", "20000", "--capacity", "2000", "--queries", "20", "--eviction", "tail", "--repeat", "1"]
    argv += ["--engine-hashes", "shared", "--no-dynamo", "--baseline", str(core_index.__file__)]
    assert bench_index.command(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert list(rows) == [
        "index",
        "kvmesh PrefixIndex",
        "kvmesh PrefixIndex (--baseline)",
        "naive dict index",
        "kvmesh PrefixIndex, incl. chaining",
    ]
    assert rows["kvmesh PrefixIndex (--baseline)"].endswith("| – | – | 0 |")
    assert "all indexes agree on every query" in out


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
