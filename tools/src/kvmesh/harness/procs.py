"""Child processes of the tools that run a whole system (`kvmesh up`, the benchmarks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def stop_processes(procs: Sequence[subprocess.Popen[Any]], *, grace_s: float = 8.0) -> None:
    """Stop processes in reverse start order: SIGTERM to all, then SIGKILL what is left after ``grace_s``.

    Args:
        procs: processes in the order they were started (the last started is stopped first).
        grace_s: seconds, in all, that the processes get to exit on their own.
    """
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in reversed(procs):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ChildProcesses:
    """Python child processes with their output in ``<log_dir>/<name>.log``.

    Each child runs in a session of its own, so a terminal Ctrl-C reaches only the parent, which then stops
    the children in order with `stop` (the last started first) instead of all of them racing each other.

    Args:
        log_dir: directory for the children's logs (must exist).
        env: variables added to this process's environment for every child (NATS credentials).
    """

    def __init__(self, log_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = dict(env or {})
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start ``python ARGS`` (e.g. ``"-m", "kvmesh.indexer", ...``) as child ``name``."""
        env = dict(os.environ, **self.env, PYTHONUNBUFFERED="1")
        with open(self.log_dir / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.procs.append((name, proc))
        return proc

    def check(self, *, tail_lines: int = 15) -> None:
        """Raise if a child exited, with the tail of its log.

        Raises:
            RuntimeError: a child is no longer running.
        """
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-tail_lines:]
                raise RuntimeError(f"{name} exited with status {proc.returncode}:\n  " + "\n  ".join(tail))

    def stop(self, *, grace_s: float = 8.0) -> None:
        """Stop every child (`stop_processes`) and forget them."""
        stop_processes([proc for _name, proc in self.procs], grace_s=grace_s)
        self.procs.clear()
