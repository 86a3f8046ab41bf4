"""`kvmesh bench soak` and `kvmesh up --cluster 3 --chaos`: real processes, periodic kill -9, nothing lost."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from kvmesh.bench.soak import Sample, SoakResult, trend_per_min

KVMESH = str(Path(sys.executable).parent / "kvmesh")
FINAL = "nothing lost: digests equal the engines' truth ("


def _run(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVMESH, *args], capture_output=True, text=True, timeout=timeout_s, check=False)


def test_trend_is_the_least_squares_slope_per_minute() -> None:
    """Points rising 1 per 30 s have a trend of +2 per minute; a single point or one instant has none."""
    assert trend_per_min([(0.0, 10.0), (30.0, 11.0), (60.0, 12.0)]) == 2.0
    assert trend_per_min([(5.0, 3.0)]) == 0.0
    assert trend_per_min([(5.0, 3.0), (5.0, 9.0)]) == 0.0


def test_a_row_is_flat_within_its_slack_and_grew_beyond_it() -> None:
    """RSS may end 10 MiB + 20 % above its start, a count 2 above it; unknown samples are skipped."""
    rss, consumers = "rss router (MiB)", "consumers on the events stream"
    result = SoakResult(
        samples=[
            Sample(0.0, {rss: 50.0, consumers: 4.0}),
            Sample(30.0, {rss: None, consumers: None}),
            Sample(60.0, {rss: 70.0, consumers: 6.0}),
        ]
    )
    assert result.flat(rss) == (50.0, 70.0, 70.0, 20.0, True)
    assert result.flat(consumers) == (4.0, 6.0, 6.0, 2.0, True)
    result.samples.append(Sample(90.0, {rss: 70.1, consumers: 7.0}))
    assert result.flat(rss)[-1] is False  # type: ignore[index]
    assert result.flat(consumers)[-1] is False  # type: ignore[index]
    assert result.flat("client connections (all nodes)") is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cluster", "3"], "kvmesh up: --cluster runs only with --chaos: add --chaos"),
        (["--chaos"], "kvmesh up: --chaos needs --cluster 3 (the R3 stream and buckets need three nodes)"),
        (["--cluster", "3", "--chaos", "--nats-url", "nats://127.0.0.1:4222"], "drop --nats-url"),
        (["--cluster", "3", "--chaos", "--chaos-every-s", "1"], "--chaos-every-s must be ≥ 5"),
    ],
)
def test_up_refuses_cluster_and_chaos_flags_it_cannot_honour(args: list[str], message: str) -> None:
    """`kvmesh up` with --cluster but no --chaos, --chaos without --cluster 3, or a bad value exits 2 and says why."""
    proc = _run("up", *args, timeout_s=30)
    assert proc.returncode == 2, proc
    assert message in proc.stderr
    assert proc.stdout == ""


F = TypeVar("F", bound=Callable[..., None])


def slow_e2e(test: F) -> F:
    """Mark a test that runs the fleet as processes (nats, e2e, slow, 240 s)."""
    for mark in (pytest.mark.nats, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)):
        test = mark(test)
    return test


def _soaked(*args: str) -> tuple[list[str], list[str]]:
    """Run ``kvmesh ARGS``; check it exits 0 and ends with the "nothing lost" line; return its lines and kills."""
    proc = _run(*args, timeout_s=220)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith(FINAL), lines[-1]
    return lines, [line.split("] ", 1)[1] for line in lines if line.endswith(", restarted")]


@slow_e2e
def test_bench_soak_half_a_minute_with_kills_loses_nothing() -> None:
    """A 30 s soak with a kill every 8 s kills 3 components, answers every route and ends with nothing lost."""
    lines, kills = _soaked("bench", "soak", "--minutes", "0.5", "--kill-every-s", "8", "--seed", "3")
    # seed 3 draws an indexer, a router and the stream leader (whichever node leads it then)
    assert kills[:2] == ["killed indexer-1 for 1.5 s, restarted", "killed router-1 for 1.5 s, restarted"], (
        kills
    )
    assert len(kills) == 3 and kills[2].startswith("killed the stream leader n"), kills
    assert any(line.startswith("kills done: 3 in ") for line in lines), lines
    answered = next(line for line in lines if line.startswith("routes answered: "))
    sent = answered.split(" of ")[1].split(" sent")[0]
    assert answered.startswith(f"routes answered: {sent} of {sent} sent"), answered
    for row in ("rss indexer (MiB)", "consumers on the events stream", "client connections (all nodes)"):
        assert any(line.startswith(row) for line in lines), (row, lines)


@slow_e2e
def test_up_cluster_chaos_prints_each_kill_and_ends_with_nothing_lost() -> None:
    """`kvmesh up --cluster 3 --chaos --duration 20` kills a component every 5 s, prints each kill, exits 0 with the line."""
    _, kills = _soaked("up", "--cluster", "3", "--chaos", "--duration", "20", "--chaos-seed", "0")
    # seed 0 draws an engine, an ingest, a node, at 5, 10 and 15 s; none in the last second before 20 s
    assert kills == [
        "killed engine-1 for 1.5 s, restarted",
        "killed ingest-0 for 1.5 s, restarted",
        "killed NATS node n0 for 3.0 s, restarted",
    ]
