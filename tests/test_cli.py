"""The `kvmesh` command line: route and status against a real server, clear errors without one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def kvmesh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `python -m kvmesh.cli ARGS` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.nats
def test_route_without_router_answers_unavailable(nats_url: str, uid: str) -> None:
    """`kvmesh route` prints an `unavailable` error reply and exits 1 when no router serves the subject."""
    proc = kvmesh(
        "route",
        "--model",
        "m",
        "--token-ids",
        "1,2",
        "--nats-url",
        nats_url,
        "--subject",
        f"t{uid}.route",
        "--timeout-s",
        "0.5",
    )
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["error"]["code"] == "unavailable"
    assert "Traceback" not in proc.stderr


@pytest.mark.nats
def test_status_reports_the_stream(nats_url: str, uid: str) -> None:
    """`kvmesh status --json` prints JSON naming the stream, with an error entry (and exit 1) when it does not exist."""
    proc = kvmesh("status", "--json", "--nats-url", nats_url, "--stream", f"NOPE_{uid}", "--wait-s", "0.2")
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["stream"]["name"] == f"NOPE_{uid}"
    assert "error" in out["stream"]
    assert out["replicas"] == [] or isinstance(out["replicas"], list)


def test_route_without_nats_fails_clearly() -> None:
    """`kvmesh route` against an unreachable server exits 1 with one line naming the URL, no traceback."""
    proc = kvmesh("route", "--model", "m", "--token-ids", "1,2", "--nats-url", "nats://127.0.0.1:1")
    assert proc.returncode == 1
    assert "cannot connect to NATS at nats://127.0.0.1:1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_route_rejects_non_integer_tokens() -> None:
    """A non-integer token id is a usage error (exit 2) naming the bad value."""
    proc = kvmesh("route", "--model", "m", "--token-ids", "1,2,a")
    assert proc.returncode == 2
    assert "token ids must be integers" in proc.stderr


def test_up_rejects_a_missing_trace() -> None:
    """`kvmesh up --trace` with a missing file exits 2 with a one-line error."""
    proc = kvmesh("up", "--trace", "/nonexistent/trace.jsonl")
    assert proc.returncode == 2
    assert "cannot read trace" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_command_prints_usage() -> None:
    """An unknown command exits 2 and lists the commands."""
    proc = kvmesh("bogus")
    assert proc.returncode == 2
    assert "unknown command 'bogus'" in proc.stderr
    assert "ingest" in proc.stderr
