"""An ingest given an endpoint ZMQ cannot connect to stops at its settings (exit 2, one line naming the flag),
not with a traceback out of a supervised rank reader after it has registered its worker."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmesh.ingest.config import IngestSettings


@pytest.mark.parametrize(
    ("flag", "value", "want"),
    [
        (
            "--zmq-endpoint",
            "bogus",
            "--zmq-endpoint 'bogus' is not a ZMQ endpoint (tcp://host:port, ipc://path)",
        ),
        (
            "--zmq-endpoint",
            "tcp://foo",
            "--zmq-endpoint 'tcp://foo' is not a ZMQ endpoint (tcp://host:port, ipc://path)",
        ),
        (
            "--replay-endpoint",
            "tcp://h:x",
            "--replay-endpoint 'tcp://h:x' is not a ZMQ endpoint (tcp://host:port, ipc://path)",
        ),
    ],
)
def test_an_endpoint_zmq_cannot_connect_to_exits_2_naming_the_flag(flag: str, value: str, want: str) -> None:
    """``kvmesh.ingest`` with such an endpoint exits 2 before connecting to NATS, its stderr naming the flag
    and value, without a traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.ingest",
            "--worker-id=w",
            "--model=m",
            "--nats-url=nats://127.0.0.1:1",
            f"{flag}={value}",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert want in proc.stderr
    assert "Traceback" not in proc.stderr


def test_valid_endpoints_and_per_rank_rules_are_checked_by_validate() -> None:
    """tcp, ipc and inproc endpoints pass; an ipc endpoint with two dp ranks has no per-rank rule and fails."""
    for ep in ("tcp://127.0.0.1:5557", "tcp://engine-0.svc:5557", "ipc:///tmp/kv.sock", "inproc://kv"):
        assert IngestSettings(worker_id="w", model="m", zmq_endpoint=ep).validate() == [], ep
    problems = IngestSettings(
        worker_id="w", model="m", zmq_endpoint="ipc:///tmp/kv.sock", data_parallel_size=2
    ).validate()
    assert problems == [
        "--zmq-endpoint: invalid endpoint 'ipc:///tmp/kv.sock' for data-parallel rank 1: must contain 'inproc' "
        "or 'tcp'"
    ]
