"""The indexer's shape holds: its policy module does no I/O, and every module that talks NATS is a thin shell."""

from __future__ import annotations

from pathlib import Path

from tests.test_layering import io_imports, shell_lines

INDEXER = Path(__file__).resolve().parent.parent / "services" / "indexer" / "src" / "kvmesh" / "indexer"
MAX_SHELL_LINES = 350


def test_indexer_policy_imports_no_io_event_loop_or_clock() -> None:
    """kvmesh.indexer.policy imports neither nats, asyncio, time, logging nor the runtime."""
    assert io_imports(INDEXER / "policy.py") == []


def test_every_indexer_module_that_imports_nats_is_at_most_350_lines() -> None:
    """Each indexer module importing nats has at most 350 lines."""
    shells = shell_lines(INDEXER, ("nats",))
    assert set(shells) == {"endpoints.py", "service.py", "writer.py"}
    assert {k: v for k, v in shells.items() if v > MAX_SHELL_LINES} == {}
