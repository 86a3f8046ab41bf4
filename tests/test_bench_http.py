"""``kvmesh bench http``: without Dynamo it says so and runs the kvmesh side, whose answers equal the engines'
truth; the pair comparison counts equal, over and under."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench.indexer_api import command, compare_answers


def test_compare_answers_counts_pairs() -> None:
    """Every (prompt, engine) pair is equal, over or under."""
    assert compare_answers([[1, 2], [3, 0]], [[1, 1], [4, 0]]) == (4, 2, 1, 1)


@pytest.mark.nats
def test_bench_http_without_dynamo_runs_kvmesh_alone(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An interpreter without dynamo.indexer skips Dynamo's side with a message; kvmesh's side settles and
    answers every pair as the engines hold it (exit 0); ``--out`` in a folder not yet there writes its JSON
    (the folder used to be missing at the end of the run, and the run lost)."""
    out_prefix = tmp_path / "not" / "yet" / "run"
    code = command(
        ["--workers", "2", "--requests", "8", "--queries", "3", "--query-requests", "5",
         "--timeout-s", "30", "--dynamo-python", "/nonexistent/python", "--out", str(out_prefix)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "the Dynamo side is skipped" in out
    assert "| kvmesh | yes |" in out
    assert "of 12 (0 / 0) |" in out
    assert code == 0
    doc = json.loads(out_prefix.with_suffix(".json").read_text())
    assert [r["system"] for r in doc["runs"]] == ["kvmesh"]


def test_bench_out_in_a_folder_that_cannot_be_made_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--out`` under a regular file: argparse's usage error (exit 2) naming the folder, nothing run."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exc:
        command(["--out", str(blocker / "sub" / "run")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --out: cannot create the folder '{blocker / 'sub'}': Not a directory" in err
