"""Child processes of the tools that run a whole system (`kvmesh up`, the benchmarks)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Sequence
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
