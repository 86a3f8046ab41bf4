"""The indexer's shape holds: its policy module does no I/O, and every module that talks NATS is a thin shell."""

from __future__ import annotations

from pathlib import Path

from tests.test_layering import imports_of

INDEXER = Path(__file__).resolve().parent.parent / "services" / "indexer" / "src" / "kvmesh" / "indexer"
MAX_SHELL_LINES = 350


def test_indexer_policy_imports_no_io_event_loop_or_clock() -> None:
    """kvmesh.indexer.policy imports neither nats, asyncio, time, logging nor the runtime."""
    banned = {"nats", "asyncio", "time", "logging", "socket", "zmq"}
    found = imports_of(INDEXER / "policy.py")
    assert sorted(m for m in found if m.split(".")[0] in banned or m.startswith("kvmesh.runtime")) == []


def test_every_indexer_module_that_imports_nats_is_at_most_350_lines() -> None:
    """Each indexer module importing nats has at most 350 lines."""
    shells = {
        f.name: len(f.read_text().splitlines())
        for f in sorted(INDEXER.glob("*.py"))
        if any(m.split(".")[0] == "nats" for m in imports_of(f))
    }
    assert set(shells) == {"endpoints.py", "service.py", "writer.py"}
    assert {k: v for k, v in shells.items() if v > MAX_SHELL_LINES} == {}
