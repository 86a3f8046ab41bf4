"""The router's shape holds: its policy modules do no I/O, and every module that talks NATS stays a thin shell."""

from __future__ import annotations

from pathlib import Path

from tests.test_layering import io_imports, shell_lines

ROUTER = Path(__file__).resolve().parent.parent / "services" / "router" / "src" / "kvmesh" / "router"
PURE = ("answer.py", "health.py", "stats.py", "sync.py")
MAX_SHELL_LINES = 350


def test_router_policy_modules_import_no_io_event_loop_or_clock() -> None:
    """The answer, health, stats and sync modules import neither nats, asyncio, time, logging nor the runtime."""
    for name in PURE:
        assert io_imports(ROUTER / name) == [], name


def test_every_router_module_that_imports_nats_is_at_most_350_lines() -> None:
    """Each router module importing nats has at most 350 lines; the policy modules import none of it."""
    shells = shell_lines(ROUTER, ("nats",))
    assert set(shells) == {"endpoint.py", "local_index.py", "notes.py", "peer_sync.py", "service.py"}
    assert {k: v for k, v in shells.items() if v > MAX_SHELL_LINES} == {}
