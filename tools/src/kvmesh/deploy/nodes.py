"""The NATS cluster of ``deploy/nats/cluster.conf`` as local ``nats-server`` processes, ports remapped.

Every node runs the committed ``cluster.conf`` unchanged, from a directory of its own holding a copy of it and
``secrets`` (a link to the credentials that ``kvmesh gen-creds`` wrote), the way compose runs it from
``/etc/nats``. Command-line flags override what only a container can have: the client, cluster and monitoring
ports (free loopback ports, kept across restarts), the routes (``nats-<k>:6222`` rewritten to the loopback
cluster port of node ``k``) and the server name (``NATS_SERVER_NAME``, as compose sets it); the copy's
JetStream ``store_dir`` (``/data`` in a container) becomes ``<root>/<node>/data`` (nats-server refuses
``-sd`` next to a configured store). TLS on client and route connections and the NKey users of
``secrets/auth.conf`` stay as configured.

`LocalNodes.start` starts every node and waits until JetStream has a meta leader; `LocalNodes.kill` SIGKILLs
one node, `LocalNodes.start_node` starts it again on the same ports and store. Each node logs to
``<root>/<node>.log``; `LocalNodes.violations` returns the permissions violation lines
(``Publish Violation``, ``Subscription Violation``) of all of them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final

from kvmesh.deploy.creds import inbox_prefix
from kvmesh.harness.ports import free_port
from kvmesh.harness.server import ServerError, server_binary

CONFIG: Final[str] = "cluster.conf"
_ROUTE = re.compile(r"nats-route://([A-Za-z0-9_.-]+):(\d+)")
_STORE = re.compile(r'(\bstore_dir:\s*)"[^"]*"')
_READY: Final[str] = "Server is ready"
VIOLATION: Final = re.compile(r"(Publish|Subscription) Violation")


def default_config_dir() -> Path:
    """``deploy/nats`` of the current directory when it has ``cluster.conf``, else of this source checkout.

    Raises:
        ServerError: neither has one.
    """
    for candidate in (
        Path.cwd() / "deploy" / "nats",
        Path(__file__).resolve().parents[4] / "deploy" / "nats",
    ):
        if (candidate / CONFIG).is_file():
            return candidate
    raise ServerError(f"no deploy/nats/{CONFIG} here: run from the kvmesh checkout or pass the directory")


def node_names(config: Path) -> list[str]:
    """The node host names of ``config``'s cluster routes, in order (``nats-1``, ``nats-2``, ``nats-3``).

    Raises:
        ServerError: the file has no ``nats-route://host:port`` route.
    """
    names = list(dict.fromkeys(m.group(1) for m in _ROUTE.finditer(config.read_text())))
    if not names:
        raise ServerError(f"{config} names no nats-route://host:port route")
    return names


_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, 15)\n"  # PR_SET_PDEATHSIG: SIGTERM
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


def die_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that Linux sends the process SIGTERM when its parent dies (even by SIGKILL): no node or
    service outlives the command that started it. A small Python stub sets it and execs ``argv`` (the same
    pid); on other systems ``argv`` unchanged."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _DIE_WITH_PARENT, *argv]


class LocalNodes:
    """The cluster of ``config_dir/cluster.conf`` on loopback (see the module docstring).

    Args:
        root: a directory for the nodes' configuration copies, stores and logs (created when missing).
        secrets_dir: what ``kvmesh gen-creds`` wrote (default ``config_dir/secrets``).
        config_dir: the directory holding ``cluster.conf`` (default `default_config_dir`).
    """

    def __init__(
        self, root: Path, *, secrets_dir: Path | None = None, config_dir: Path | None = None
    ) -> None:
        self.config_dir = config_dir or default_config_dir()
        self.secrets_dir = (secrets_dir or self.config_dir / "secrets").resolve()
        if not (self.secrets_dir / "auth.conf").is_file():
            raise ServerError(f"{self.secrets_dir} has no auth.conf: run kvmesh gen-creds first")
        self.root = root
        self.names = node_names(self.config_dir / CONFIG)
        n = len(self.names)
        self.ports = [free_port() for _ in range(n)]
        self.cluster_ports = [free_port() for _ in range(n)]
        self.http_ports = [free_port() for _ in range(n)]
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self._logs: list[IO[bytes] | None] = [None] * n

    # ------------------------------------------------------------------ addresses

    def __len__(self) -> int:
        return len(self.names)

    def url(self, i: int) -> str:
        """Client URL of node ``i``: ``tls://127.0.0.1:<port>``."""
        return f"tls://127.0.0.1:{self.ports[i]}"

    @property
    def urls(self) -> str:
        """Every node's client URL, comma-separated (a ``KVMESH_NATS_URL``)."""
        return ",".join(self.url(i) for i in range(len(self)))

    @property
    def ca_file(self) -> Path:
        """The CA certificate clients verify the nodes with."""
        return self.secrets_dir / "ca.pem"

    def seed_file(self, role: str) -> Path:
        """The NKey seed file of ``role`` (``operator``, ``ingest-<worker>``, ...)."""
        return self.secrets_dir / f"{role}.nk"

    def env(self, role: str) -> dict[str, str]:
        """The ``KVMESH_NATS_*`` variables a service of ``role`` connects with."""
        return {
            "KVMESH_NATS_URL": self.urls,
            "KVMESH_NATS_NKEY_SEED_FILE": str(self.seed_file(role)),
            "KVMESH_NATS_TLS_CA_FILE": str(self.ca_file),
            "KVMESH_NATS_INBOX_PREFIX": inbox_prefix(role),
        }

    def log_path(self, i: int) -> Path:
        """Node ``i``'s log (all its starts)."""
        return self.root / f"{self.names[i]}.log"

    # ------------------------------------------------------------------ processes

    def _argv(self, i: int) -> list[str]:
        routes = ",".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(self.cluster_ports) if j != i)
        return [
            server_binary(),
            "-c",
            CONFIG,
            "-a",
            "127.0.0.1",
            "-p",
            str(self.ports[i]),
            "-m",
            str(self.http_ports[i]),
            "--cluster",
            f"nats://127.0.0.1:{self.cluster_ports[i]}",
            "--routes",
            routes,
            "--server_name",
            self.names[i],
        ]

    def _etc(self, i: int) -> Path:
        """Node ``i``'s working directory: a copy of cluster.conf and a ``secrets`` link."""
        etc = self.root / self.names[i] / "etc"
        etc.mkdir(parents=True, exist_ok=True)
        text = (self.config_dir / CONFIG).read_text()
        store = json.dumps(str((self.root / self.names[i] / "data").resolve()))
        local, found = _STORE.subn(lambda m: m.group(1) + store, text, count=1)
        if not found:
            raise ServerError(f"{self.config_dir / CONFIG} has no jetstream store_dir to remap")
        (etc / CONFIG).write_text(local)
        link = etc / "secrets"
        if not link.is_symlink():
            link.symlink_to(self.secrets_dir, target_is_directory=True)
        return etc

    def alive(self, i: int) -> bool:
        """Whether node ``i`` runs."""
        proc = self._procs[i]
        return proc is not None and proc.poll() is None

    def start_node(self, i: int, timeout_s: float = 15.0) -> None:
        """Start (or restart) node ``i`` and wait for its "Server is ready" line.

        Raises:
            ServerError: it exited or was not ready in time (the message holds its last log lines).
        """
        if self.alive(i):
            return
        self.root.mkdir(parents=True, exist_ok=True)
        etc = self._etc(i)
        path = self.log_path(i)
        offset = path.stat().st_size if path.exists() else 0
        log = open(path, "ab")  # noqa: SIM115 (closed by kill/stop)
        env = dict(os.environ, NATS_SERVER_NAME=self.names[i])
        self._logs[i] = log
        self._procs[i] = subprocess.Popen(
            die_with_parent(self._argv(i)),
            cwd=etc,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self._read_log(i, offset)
            if _READY in text:
                return
            if not self.alive(i):
                break
            time.sleep(0.05)
        tail = "\n".join(self._read_log(i, offset).splitlines()[-20:])
        self.kill(i)
        raise ServerError(f"nats-server {self.names[i]} did not start:\n{tail}")

    def _read_log(self, i: int, offset: int = 0) -> str:
        try:
            with open(self.log_path(i), "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def start(self, timeout_s: float = 30.0) -> LocalNodes:
        """Start every node, then wait until JetStream has a meta leader (`wait_js_ready`)."""
        try:
            for i in range(len(self)):
                self.start_node(i)
            self.wait_js_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (its store stays for a restart)."""
        proc = self._procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._close(i)

    def stop_node(self, i: int) -> None:
        """Stop node ``i``: SIGTERM (lame duck), SIGKILL after 10 s."""
        proc = self._procs[i]
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._close(i)

    def _close(self, i: int) -> None:
        self._procs[i] = None
        log = self._logs[i]
        if log is not None:
            log.close()
            self._logs[i] = None

    def stop(self) -> None:
        """Stop every node (the stores stay)."""
        for i in range(len(self)):
            self.stop_node(i)

    def pid(self, i: int) -> int | None:
        """Process id of node ``i``, None when down."""
        proc = self._procs[i]
        return proc.pid if proc is not None and proc.poll() is None else None

    # ------------------------------------------------------------------ state

    def monitor(self, i: int, path: str, timeout_s: float = 1.0) -> dict[str, Any] | None:
        """Node ``i``'s monitoring document at ``path`` (``/varz``, ``/jsz``, ``/routez``), None when down."""
        if not self.alive(i):
            return None
        try:
            url = f"http://127.0.0.1:{self.http_ports[i]}{path}"
            with urllib.request.urlopen(url, timeout=timeout_s) as reply:
                doc: dict[str, Any] = json.loads(reply.read())
        except (OSError, ValueError):
            return None
        return doc

    def meta_leader(self) -> str | None:
        """The JetStream meta leader's name as a running node sees it, None when there is none."""
        for i in range(len(self)):
            doc = self.monitor(i, "/jsz")
            leader = ((doc or {}).get("meta_cluster") or {}).get("leader")
            if leader:
                return str(leader)
        return None

    def wait_js_ready(self, timeout_s: float = 30.0) -> str:
        """Wait until the running nodes route to each other and JetStream has a meta leader; return its name.

        Raises:
            ServerError: not in time.
        """
        deadline = time.monotonic() + timeout_s
        running = [i for i in range(len(self)) if self.alive(i)]
        while time.monotonic() < deadline:
            routed = all(
                len({r.get("remote_name") for r in ((self.monitor(i, "/routez") or {}).get("routes") or [])})
                >= len(running) - 1
                for i in running
            )
            leader = self.meta_leader()
            if routed and leader:
                return leader
            time.sleep(0.2)
        tls = sorted(
            {
                line.split("]", 2)[-1].strip()
                for i in range(len(self))
                for line in self._read_log(i).splitlines()
                if "TLS route handshake error" in line or "bad certificate" in line
            }
        )[:3]
        hint = (
            "; the nodes refuse each other's certificates ("
            + "; ".join(tls)
            + "): are server.pem and ca.pem "
            "from the same kvmesh gen-creds run?"
            if tls
            else ""
        )
        raise ServerError(f"no JetStream meta leader after {timeout_s:.0f} s{hint}; logs under {self.root}")

    def log(self, i: int) -> str:
        """Node ``i``'s whole log."""
        return self._read_log(i)

    def violations(self) -> list[str]:
        """Every permissions violation line (publish or subscription) logged by any node so far."""
        return [
            line
            for i in range(len(self))
            for line in self._read_log(i).splitlines()
            if VIOLATION.search(line)
        ]

    def __enter__(self) -> LocalNodes:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
