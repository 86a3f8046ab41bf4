"""The ingest's shape holds: its outbox policy does no I/O, and every module that talks NATS or ZMQ stays a thin
shell."""

from __future__ import annotations

from pathlib import Path

from tests.test_layering import io_imports, shell_lines

INGEST = Path(__file__).resolve().parent.parent / "services" / "ingest" / "src" / "kvmesh" / "ingest"
MAX_SHELL_LINES = 350


def test_the_outbox_policy_imports_no_io_event_loop_or_clock() -> None:
    """kvmesh.ingest.outbox imports neither nats, zmq, asyncio, time, logging, socket nor the runtime."""
    assert io_imports(INGEST / "outbox.py") == []


def test_every_ingest_module_that_imports_nats_or_zmq_is_at_most_350_lines() -> None:
    """Each ingest module importing nats or zmq has at most 350 lines; the pure ones import neither."""
    shells = shell_lines(INGEST, ("nats", "zmq"))
    assert set(shells) == {
        "jetstream.py",
        "liveness.py",
        "probes.py",
        "publish.py",
        "reader.py",
        "recovery.py",
        "registration.py",
        "resync.py",
        "service.py",
    }
    assert {k: v for k, v in shells.items() if v > MAX_SHELL_LINES} == {}
