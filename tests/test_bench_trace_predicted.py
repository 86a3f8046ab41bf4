"""`kvmesh bench trace`'s router-knowledge policies: ``kvmesh-lagged`` (a real index fed the engines' KV events
late, optionally with predicted entries), ``kvmesh-approx`` (no events: predicted entries bounded by the pool)
and the generated burst workload. All in-process and deterministic: exact values."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.bench import trace as bench_trace
from kvmesh.sim.trace import TraceRequest, default_trace_path, load_trace


def test_lagged_with_no_lag_makes_kvmesh_exacts_choices() -> None:
    """With lag 0 the index, fed through the wire encoder, decoder, normalizer and stream apply, holds what
    the pools hold at every decision (small pools: evictions included), so kvmesh-lagged routes every request
    as kvmesh-exact does; at the default 190 ms lag it misses 7 overlaps here (224 blocks) and sends some
    requests elsewhere, yet caches as many tokens on this stretch of the excerpt."""
    trace = load_trace(default_trace_path(), limit=80)  # 3 runs: about 3 s
    spec = bench_trace.FleetSpec(workers=3, num_blocks=2048)
    exact = bench_trace.simulate_policy("kvmesh-exact", trace, spec)
    lag0 = bench_trace.simulate_policy("kvmesh-lagged", trace, spec, event_lag_s=0.0)
    lagged = bench_trace.simulate_policy("kvmesh-lagged", trace, spec)
    assert (exact.cached_tokens, exact.per_worker, exact.extra["decode_overflows"]) == (
        36_864,
        [31, 18, 31],
        9,
    )
    assert (lag0.cached_tokens, lag0.per_worker, lag0.ttft_s) == (
        exact.cached_tokens,
        exact.per_worker,
        exact.ttft_s,
    )
    assert lag0.extra["overlap_exact"] == 80
    assert (lag0.extra["overlap_under"], lag0.extra["overlap_over"]) == (0, 0)
    assert lag0.captured_tokens == exact.captured_tokens
    assert (lagged.extra["overlap_under"], lagged.extra["overlap_missed_blocks"]) == (7, 224)
    assert (lagged.cached_tokens, lagged.per_worker) == (exact.cached_tokens, [25, 29, 26])


def test_approx_sends_a_repeated_prompt_to_the_same_worker() -> None:
    """Without any KV event, the router's own record of its decisions brings a prompt seen before back to its
    worker: 5 copies 10 s apart all go to one of 4 workers and hit 4 times; round-robin spreads them."""
    req = [
        TraceRequest(timestamp_ms=10_000 * i, input_length=1000, output_length=8, hash_ids=(1, 2))
        for i in range(5)
    ]
    spec = bench_trace.FleetSpec(workers=4, num_blocks=1024)
    approx = bench_trace.simulate_policy("kvmesh-approx", req, spec)
    assert sorted(approx.per_worker) == [0, 0, 0, 5]
    assert approx.cached_tokens == 4 * 992  # 62 full blocks of 16 tokens, each later time
    assert approx.extra["overlap_exact"] == 5
    rr = bench_trace.simulate_policy("round-robin", req, spec)
    assert (rr.per_worker, rr.cached_tokens) == ([2, 1, 1, 1], 992)


def test_approx_forgets_the_least_recently_used_past_the_pool_size() -> None:
    """The predicted cache is bounded by --num-blocks, least recently used out first, a prompt's tail before its
    head: with a 64-block pool, after a 62-block prompt and another 62-block one on the same worker, the first
    prompt's leading 2 blocks are still predicted (64 − 62) where the engine, which also holds each request's
    partial last block, kept its leading 1; with a 256-block pool both keep all 62."""
    prompts = [(1, 2), (3, 4), (1, 2)]
    req = [
        TraceRequest(timestamp_ms=10_000 * i, input_length=1000, output_length=8, hash_ids=h)
        for i, h in enumerate(prompts)
    ]
    small = bench_trace.simulate_policy("kvmesh-approx", req, bench_trace.FleetSpec(workers=1, num_blocks=64))
    assert (small.cached_tokens, small.captured_tokens) == (16, 32)
    assert (small.extra["overlap_over"], small.extra["overlap_phantom_blocks"]) == (1, 1)
    roomy = bench_trace.simulate_policy(
        "kvmesh-approx", req, bench_trace.FleetSpec(workers=1, num_blocks=256)
    )
    assert (roomy.cached_tokens, roomy.captured_tokens) == (992, 992)


def test_a_burst_spreads_when_the_index_lags_and_sticks_with_predicted_entries() -> None:
    """64 requests in 2 bursts of 32 within 100 ms, 4 prefixes of 2,048 tokens per burst, 4 workers. With an
    index that sees nothing in time (lag 1,000 s) the router balances load blindly (the hits of round-robin's
    order); with predicted entries (TTL 2 s) it sees every overlap it created and caches what kvmesh-exact
    does on the true pools; so does kvmesh-approx."""
    trace = bench_trace.burst_trace(64, prefixes=4, prefix_tokens=2048, gap_s=3.0)
    spec = bench_trace.FleetSpec(workers=4, num_blocks=4096)
    got = {}
    for policy, kw in [
        ("kvmesh-exact", {}),
        ("kvmesh-lagged", {"event_lag_s": 1000.0}),
        ("kvmesh-lagged", {"event_lag_s": 1000.0, "predicted_ttl_s": 2.0}),
        ("kvmesh-approx", {}),
        ("round-robin", {}),
    ]:
        r = bench_trace.simulate_policy(policy, trace, spec, **kw)  # type: ignore[arg-type]
        assert r.prompt_tokens == 147_456
        got[r.policy] = (r.cached_tokens, r.extra.get("overlap_exact"), r.extra.get("overlap_under"))
    assert got == {
        "kvmesh-exact": (100_352, None, None),
        "kvmesh-lagged": (69_632, 30, 34),
        "kvmesh-lagged +pred 2 s": (100_352, 64, 0),
        "kvmesh-approx": (100_352, 64, 0),
        "round-robin": (73_728, None, None),
    }


def test_burst_trace_shape() -> None:
    """Groups start gap_s apart, arrive within the window, share a prefix inside a group and nothing across."""
    t = bench_trace.burst_trace(70, size=32, prefix_tokens=1024, window_ms=100, gap_s=5.0, seed=3)
    assert len(t) == 70
    assert t == bench_trace.burst_trace(70, size=32, prefix_tokens=1024, window_ms=100, gap_s=5.0, seed=3)
    groups = [t[0:32], t[32:64], t[64:]]
    for g, reqs in enumerate(groups):
        times = [r.timestamp_ms for r in reqs]
        assert times == sorted(times)
        assert all(5000 * g <= x <= 5000 * g + 100 for x in times)
        assert {r.hash_ids[:2] for r in reqs} == {reqs[0].hash_ids[:2]}
        assert all(r.input_length == 1024 + 256 and r.output_length == 64 for r in reqs)
    assert len({r.hash_ids[2] for r in t}) == 70  # every suffix its own
    assert len({r.hash_ids[:2] for r in t}) == 3
    four = bench_trace.burst_trace(32, prefixes=4, prefix_tokens=512)
    assert len({r.hash_ids[:1] for r in four}) == 4
    with pytest.raises(ValueError, match="multiple of 512"):
        bench_trace.burst_trace(4, prefix_tokens=1000)
    with pytest.raises(ValueError, match="prefixes >= 1"):
        bench_trace.burst_trace(4, prefixes=0)


def test_predicted_ttl_is_a_kvmesh_lagged_option() -> None:
    trace = bench_trace.burst_trace(2)
    with pytest.raises(ValueError, match="kvmesh-lagged option"):
        bench_trace.simulate_policy(
            "kvmesh-exact", trace, bench_trace.FleetSpec(workers=2), predicted_ttl_s=1.0
        )


def test_command_on_the_burst_writes_one_row_per_predicted_ttl(tmp_path: Path) -> None:
    out = tmp_path / "burst"
    argv = [
        "--trace",
        "burst",
        "--requests",
        "40",
        "--burst-prefixes",
        "2",
        "--workers",
        "4",
        "--out",
        str(out),
    ]
    argv += ["--policies", "kvmesh-lagged,kvmesh-approx", "--predicted-ttl-s", "0,2", "--event-lag-s", "0.19"]
    assert bench_trace.command(argv) == 0
    rows = [line.split("|")[1].strip() for line in out.with_suffix(".md").read_text().splitlines()[2:]]
    assert rows == ["kvmesh-lagged", "kvmesh-lagged +pred 2 s", "kvmesh-approx"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--predicted-ttl-s", "x"], "not a list of numbers"),
        (["--predicted-ttl-s", "-1"], "finite seconds >= 0"),
        (["--event-lag-s", "-0.1"], "--event-lag-s must be >= 0"),
        (["--burst-prefix-tokens", "1000"], "positive multiple of 512"),
    ],
)
def test_bad_options_are_refused(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_trace.command(["--policies", "kvmesh-lagged", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
