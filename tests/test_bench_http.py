"""``kvmesh bench http``: without Dynamo it says so and runs the kvmesh side, whose answers equal the engines'
truth; the pair comparison counts equal, over and under."""

from __future__ import annotations

import pytest

from kvmesh.bench.indexer_api import command, compare_answers


def test_compare_answers_counts_pairs() -> None:
    """Every (prompt, engine) pair is equal, over or under."""
    assert compare_answers([[1, 2], [3, 0]], [[1, 1], [4, 0]]) == (4, 2, 1, 1)


@pytest.mark.nats
def test_bench_http_without_dynamo_runs_kvmesh_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """An interpreter without dynamo.indexer skips Dynamo's side with a message; kvmesh's side settles and
    answers every pair as the engines hold it (exit 0)."""
    code = command(
        ["--workers", "2", "--requests", "8", "--queries", "3", "--query-requests", "5",
         "--timeout-s", "30", "--dynamo-python", "/nonexistent/python"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "the Dynamo side is skipped" in out
    assert "| kvmesh | yes |" in out
    assert "of 12 (0 / 0) |" in out
    assert code == 0
