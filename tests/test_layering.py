"""The layering rules hold: the pure core does no I/O, and services never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "shared" / "src" / "kvmesh" / "core"
SERVICES = {
    name: ROOT / "services" / name / "src" / "kvmesh" / name for name in ("ingest", "indexer", "router")
}
FORBIDDEN_IN_CORE = {
    "nats",
    "zmq",
    "anyio",
    "asyncio",
    "socket",
    "subprocess",
    "threading",
    "time",
    "os",
    "logging",
}


def imports_of(path: Path) -> set[str]:
    """Return every module a Python file imports (absolute names)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


POLICY_FORBIDDEN = {"nats", "zmq", "asyncio", "time", "logging", "socket"}
"""What a service's sans-I/O policy module never imports (besides `kvmesh.runtime`)."""


def io_imports(path: Path) -> list[str]:
    """Return the modules a policy file imports that do I/O, run an event loop or read a clock, sorted."""
    return sorted(
        m for m in imports_of(path) if m.split(".")[0] in POLICY_FORBIDDEN or m.startswith("kvmesh.runtime")
    )


def shell_lines(package: Path, libraries: tuple[str, ...]) -> dict[str, int]:
    """Return file name → line count of every module of ``package`` that imports one of ``libraries``."""
    return {
        f.name: len(f.read_text().splitlines())
        for f in sorted(package.glob("*.py"))
        if any(m.split(".")[0] in libraries for m in imports_of(f))
    }


def test_core_imports_no_io_or_event_loop() -> None:
    """No module of kvmesh.core imports nats, zmq, anyio, asyncio, sockets, threads, clocks, os or logging."""
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 8
    offenders = {
        f.name: sorted(m for m in imports_of(f) if m.split(".")[0] in FORBIDDEN_IN_CORE) for f in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_core_imports_only_core() -> None:
    """kvmesh.core never imports the runtime, tools or services."""
    for f in CORE.glob("*.py"):
        kvmesh = {m for m in imports_of(f) if m.startswith("kvmesh.")}
        assert all(m.startswith("kvmesh.core") for m in kvmesh), (f.name, kvmesh)


def test_services_never_import_each_other() -> None:
    """A service imports kvmesh.core and kvmesh.runtime, never another service."""
    for name, root in SERVICES.items():
        files = list(root.glob("*.py"))
        assert files, name
        for f in files:
            for m in imports_of(f):
                for other in SERVICES:
                    if other != name:
                        assert not m.startswith(f"kvmesh.{other}"), (f, m)


def test_shared_package_never_imports_a_service() -> None:
    """The shared package (core, runtime, client, CLI) finds services through entry points only."""
    shared = ROOT / "shared" / "src" / "kvmesh"
    for f in shared.rglob("*.py"):
        for m in imports_of(f):
            assert not any(m.startswith(f"kvmesh.{s}") for s in SERVICES), (f, m)


TOOLS_TIER = ("kvmesh.sim", "kvmesh.bench", "kvmesh.up", "kvmesh.harness", "kvmesh.deploy")


def test_library_and_services_never_import_the_tools_tier() -> None:
    """No module of kvmesh-shared or of a service imports the simulator, benchmarks, kvmesh up or the harness
    (the kvmesh command finds them as kvmesh-tools' entry points), and none of those lives in shared/."""
    shared = ROOT / "shared" / "src" / "kvmesh"
    assert not (shared / "sim").exists()
    assert not (shared / "bench").exists()
    assert not (shared / "up.py").exists()
    library = [*shared.rglob("*.py"), *(f for root in SERVICES.values() for f in root.rglob("*.py"))]
    offenders = {
        str(f.relative_to(ROOT)): sorted(
            m for m in imports_of(f) if any(m == t or m.startswith(t + ".") for t in TOOLS_TIER)
        )
        for f in library
    }
    assert {k: v for k, v in offenders.items() if v} == {}
