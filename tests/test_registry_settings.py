"""Registry timings given on the command line: a TTL that is not a positive number of seconds, or an expiry
grace that is not a number of seconds ≥ 0, is refused with exit 2 and one clear line, before anything
connects. (A grace longer than 2/3 of the registry's TTL is capped by the indexer at start, with a warning.)"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("service", "args", "message"),
    [
        ("ingest", ["--worker-ttl-s", "0"], "--worker-ttl-s must be a number of seconds > 0, got 0.0"),
        ("ingest", ["--worker-ttl-s", "nan"], "--worker-ttl-s must be a number of seconds > 0, got nan"),
        ("ingest", ["--worker-ttl-s", "-1"], "--worker-ttl-s must be a number of seconds > 0, got -1.0"),
        (
            "indexer",
            ["--worker-ttl-s", "nan"],
            "--lease-ttl-s and --worker-ttl-s must be numbers of seconds > 0, got 30.0 and nan",
        ),
        ("indexer", ["--expiry-grace-s", "nan"], "--expiry-grace-s must be a number of seconds ≥ 0, got nan"),
        ("indexer", ["--expiry-grace-s", "-1"], "--expiry-grace-s must be a number of seconds ≥ 0, got -1.0"),
    ],
)
def test_bad_registry_timings_exit_2_naming_the_flag(service: str, args: list[str], message: str) -> None:
    base = ["--worker-id", "w", "--model", "m"] if service == "ingest" else []
    done = subprocess.run(
        [sys.executable, "-m", f"kvmesh.{service}", *base, *args, "--nats-url", "nats://127.0.0.1:1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr.splitlines()[-1], done.stderr
    assert "Traceback" not in done.stderr
