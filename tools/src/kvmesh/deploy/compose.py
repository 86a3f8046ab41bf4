"""``kvmesh cluster``: docker-compose.yml's services as local processes, without Docker.

`LocalStack` reads the compose file and runs what it describes on this machine:

* the ``nats`` services (image ``nats:…``) as the nodes of `kvmesh.deploy.nodes.LocalNodes`: the same
  ``cluster.conf`` (found through the file mounted at ``/etc/nats/cluster.conf``), TLS and NKey users, on free
  loopback ports;
* every other service's ``command`` as ``python -m kvmesh.cli <command>`` (the image's entry point is
  ``kvmesh``) with its ``environment``, in an order that honours ``depends_on``, each waiting for its
  dependencies' conditions: ``service_healthy`` runs the dependency's own ``healthcheck`` command until it
  passes (polled every half second; a ``wget`` of a URL is an HTTP GET made here), and
  ``service_completed_successfully`` waits for a one-shot service (``restart: "no"``) to exit 0.

What only a container network has is remapped in commands, environment and health checks: ``<service>:<port>``
becomes ``127.0.0.1:<local port>`` (a NATS node's client, cluster and monitoring ports; a free block of
ports per other service, so a simulated engine's events and replay ports keep their distance), as do
``localhost:<port>`` in a service's own health check and an environment variable ``…_PORT`` that holds one
of the service's ports; ``KVMESH_METRICS_PORT`` (the Prometheus endpoint, one port for every container)
becomes a free loopback port of its own per service; ``0.0.0.0`` becomes ``127.0.0.1``; ``/run/secrets/<name>`` becomes a directory per
service holding links to only the secrets the service lists (from ``--secrets``, by file name); ``/tmp/``
becomes a directory per service. Each child logs to ``<root>/logs/<service>.log``; a child that exits is
reported with the tail of its log and, as ``restart: unless-stopped`` says, started again.

Only services of a ``nats`` or ``kvmesh`` image (``kvmesh:local``, ``kvmesh-sim:local``, or a ``build`` of
this repository) run here; the others (Prometheus, Grafana) are skipped, with the services that depend on
them (`LocalStack.skipped`).

``kvmesh cluster`` brings the stack up, prints the NATS URLs, every service, the route example's answer and
how to run ``kvmesh status`` against the cluster (operator credentials), then runs until Ctrl-C;
``--once`` or ``--duration S`` also prints the status and stops. With no credentials in ``--secrets``
it makes them first (`kvmesh.deploy.creds.generate`, one ingest user per ingest's worker id).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import yaml

from kvmesh.core.errors import KvmeshError
from kvmesh.deploy import creds
from kvmesh.deploy.nodes import LocalNodes, die_with_parent
from kvmesh.harness.ports import free_block
from kvmesh.harness.server import ServerError

__all__ = [
    "ComposeError",
    "LocalStack",
    "OneShot",
    "Service",
    "command",
    "load_services",
    "start_order",
]

HEALTH_POLL_S: Final[float] = 0.5
"""Seconds between two runs of a health check while a dependent waits."""
UP_TIMEOUT_S: Final[float] = 120.0
"""Default bound on each wait of `LocalStack.up` (a health condition, a one-shot service)."""
_NATS_PORTS: Final[dict[int, str]] = {4222: "ports", 6222: "cluster_ports", 8222: "http_ports"}
_SECRETS: Final[str] = "/run/secrets/"
METRICS_PORT_ENV: Final[str] = "KVMESH_METRICS_PORT"
"""The variable of a service's Prometheus endpoint port, remapped to a free loopback port per service."""


class ComposeError(KvmeshError):
    """The compose file cannot be run as local processes, or a service did not come up."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Service:
    """One compose service, as `LocalStack` runs it (values as written, before any remapping)."""

    name: str
    nats: bool
    """A NATS node (image ``nats:…``), run by `kvmesh.deploy.nodes.LocalNodes`."""
    command: tuple[str, ...]
    environment: Mapping[str, str]
    depends_on: Mapping[str, str]
    """Dependency → condition (``service_started``, ``service_healthy``, ``service_completed_successfully``)."""
    healthcheck: tuple[str, ...] | None
    """The health check's ``test`` (``CMD …`` / ``CMD-SHELL …``), None when the service has none."""
    secrets: tuple[str, ...]
    oneshot: bool
    """``restart: "no"``: runs to its end once (provision, the route example)."""
    restart: bool
    """Started again when it exits (``restart: always``, ``unless-stopped``, ``on-failure`` after a failure)."""
    volumes: tuple[str, ...] = ()
    image: str = ""
    """The image as written (``""``: none, only a ``build``)."""
    local: bool = True
    """Runnable here: a NATS node or a kvmesh service (image ``kvmesh…``, or built from this repository)."""


@dataclass(frozen=True, slots=True)
class OneShot:
    """How a one-shot service ended: exit status and its whole output."""

    returncode: int
    output: str


def _env_map(raw: Any, name: str) -> dict[str, str]:
    if raw is None:
        return {}
    if isinstance(raw, list):
        out = {}
        for item in raw:
            key, sep, value = str(item).partition("=")
            if not sep:
                raise ComposeError(f"service {name}: environment entry {item!r} has no value")
            out[key] = value
        return out
    if isinstance(raw, dict):
        return {str(k): "" if v is None else str(v) for k, v in raw.items()}
    raise ComposeError(f"service {name}: environment must be a mapping or a list")


def _depends(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if isinstance(raw, list):
        return {str(d): "service_started" for d in raw}
    return {str(k): str((v or {}).get("condition", "service_started")) for k, v in raw.items()}


def _command(raw: Any, name: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return tuple(raw.split())
    if not isinstance(raw, list):
        raise ComposeError(f"service {name}: command must be a list or a string")
    return tuple(str(a) for a in raw)


def _runs_here(image: str, *, has_build: bool) -> bool:
    """Whether `LocalStack` can run a service of ``image``: a NATS node, or a kvmesh image (its repository's
    last path part ``kvmesh`` or ``kvmesh-…``), or no image but a ``build``."""
    if not image:
        return has_build
    repository = image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
    return repository in ("nats", "kvmesh") or repository.startswith("kvmesh-")


def load_services(path: Path) -> dict[str, Service]:
    """Read the services of a compose file (YAML anchors and merge keys resolved).

    Raises:
        ComposeError: the file does not parse, has no services, or a service is malformed.
    """
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ComposeError(f"{path}: {exc}") from None
    raw = (doc or {}).get("services")
    if not isinstance(raw, dict) or not raw:
        raise ComposeError(f"{path}: no services")
    out: dict[str, Service] = {}
    for name, svc in raw.items():
        image = str(svc.get("image", ""))
        health = svc.get("healthcheck") or {}
        test = None if health.get("disable") else health.get("test")
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        if test is not None and test[:1] == ["NONE"]:
            test = None
        restart = str(svc.get("restart", "no"))
        out[name] = Service(
            name=name,
            nats=image.startswith("nats:") or image == "nats",
            command=_command(svc.get("command"), name),
            environment=_env_map(svc.get("environment"), name),
            depends_on=_depends(svc.get("depends_on")),
            healthcheck=None if test is None else tuple(str(t) for t in test),
            secrets=tuple(str(s if isinstance(s, str) else s["source"]) for s in svc.get("secrets") or []),
            oneshot=restart == "no",
            restart=restart in ("always", "unless-stopped", "on-failure"),
            volumes=tuple(str(v) for v in svc.get("volumes") or [] if isinstance(v, str)),
            image=image,
            local=_runs_here(image, has_build="build" in svc),
        )
    for svc in out.values():
        for dep in svc.depends_on:
            if dep not in out:
                raise ComposeError(f"service {svc.name} depends on {dep}, which the file does not define")
    return out


def start_order(services: Mapping[str, Service]) -> list[str]:
    """The services in an order where each comes after its dependencies (file order among equals).

    Raises:
        ComposeError: the dependencies form a cycle.
    """
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(name: str, path: tuple[str, ...]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise ComposeError("depends_on forms a cycle: " + " -> ".join((*path, name)))
        state[name] = 1
        for dep in services[name].depends_on:
            visit(dep, (*path, name))
        state[name] = 2
        order.append(name)

    for name in services:
        visit(name, ())
    return order


_CONTAINER_TMP = re.compile(r"(^|[\s=:'\"])/tmp/")
QUICK_EXIT_S = 10.0
"""A child that exits this soon after its start is crash-looping: its restarts back off."""
MAX_BACKOFF_S = 30.0


class _Child:
    """A long-running service's process (own session), logging to its file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
        self.name, self.argv, self.env, self.cwd, self.log_path = name, argv, env, cwd, log
        self.popen: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.starts = 0
        self.started_at = 0.0
        self.quick_exits = 0
        """Exits in a row within `QUICK_EXIT_S` of their start (a crash loop backs off)."""
        self.restart_at = 0.0

    def start(self) -> None:
        self._close()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed by stop)
        self._log.write(f"----- kvmesh cluster: start {self.starts} at {time.time():.3f}\n".encode())
        self._log.flush()
        self.popen = subprocess.Popen(
            die_with_parent(self.argv),
            env=self.env,
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.starts += 1
        self.started_at = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop_signal(self) -> None:
        if self.alive:
            assert self.popen is not None
            self.popen.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout=max(0.1, timeout_s))
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self._close()

    def _close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class LocalStack:
    """A compose file's services as local processes (see the module docstring).

    Args:
        compose: the compose file.
        root: directory for logs, the NATS stores and each service's ``/run/secrets`` and ``/tmp``.
        secrets_dir: where the compose file's secrets are read from, by file name (what ``kvmesh gen-creds``
            wrote); made with `kvmesh.deploy.creds.generate` when it holds no ``auth.conf``.
        extra_env: variables set for every kvmesh service after its own (``KVMESH_SIM_TRAFFIC_S=20``).
        timeout_s: bound on each wait while coming up.

    Raises:
        ComposeError: the file cannot be run here (no NATS service, no cluster.conf mount, a cycle, ...).
    """

    def __init__(
        self,
        compose: Path,
        root: Path,
        *,
        secrets_dir: Path,
        extra_env: Mapping[str, str] | None = None,
        timeout_s: float = UP_TIMEOUT_S,
    ) -> None:
        self.compose = compose.resolve()
        every = load_services(self.compose)
        self.skipped: dict[str, str] = _skipped(every)
        """Services not run here → why (``image prom/prometheus:v3.5.0``, ``depends on grafana``), file order."""
        self.services = {name: svc for name, svc in every.items() if name not in self.skipped}
        self.order = start_order(self.services)
        self.root = root.resolve()
        self.logs = self.root / "logs"
        self.secrets_dir = secrets_dir.resolve()
        self.extra_env = dict(extra_env or {})
        self.timeout_s = timeout_s
        self.results: dict[str, OneShot] = {}
        self.children: dict[str, _Child] = {}
        self.notes: list[str] = []
        self.exits: dict[str, int] = {}
        """Long-running service → times it exited while supervised."""
        self.last_health: dict[str, str] = {}
        """Service → what its last failing health check printed."""
        """What happened while running: children that exited and were started again."""
        nats = [s for s in self.services.values() if s.nats]
        if not nats:
            raise ComposeError(f"{self.compose}: no nats service (image nats:…)")
        self._config_dir = self._cluster_conf_dir(nats[0])
        self._nats_names = [s.environment.get("NATS_SERVER_NAME", s.name) for s in nats]
        self._nats_service = {s.name: s.environment.get("NATS_SERVER_NAME", s.name) for s in nats}
        self.nodes: LocalNodes | None = None
        self._ports: dict[str, dict[int, int]] = {}
        self.metrics_ports: dict[str, int] = {}
        """Service → the loopback port of its Prometheus endpoint (those that set ``KVMESH_METRICS_PORT``),
        once `up` allocated them."""
        self._host_re = re.compile(
            r"\b("
            + "|".join(re.escape(n) for n in sorted(self.services, key=len, reverse=True))
            + r"):(\d+)\b"
        )

    # ------------------------------------------------------------------ preparation

    def _cluster_conf_dir(self, svc: Service) -> Path:
        for volume in svc.volumes:
            source, _, rest = volume.partition(":")
            target = rest.split(":")[0]
            if target.endswith("/cluster.conf"):
                return (self.compose.parent / source).resolve().parent
        raise ComposeError(f"service {svc.name}: no file mounted at /etc/nats/cluster.conf")

    def ingest_workers(self) -> list[str]:
        """The worker ids of the ingest services (``KVMESH_INGEST_WORKER_ID``), in file order."""
        return [
            s.environment["KVMESH_INGEST_WORKER_ID"]
            for s in self.services.values()
            if s.command[:1] == ("ingest",) and "KVMESH_INGEST_WORKER_ID" in s.environment
        ]

    def ensure_secrets(self) -> bool:
        """Make the credentials with `kvmesh.deploy.creds.generate` when ``secrets_dir`` has no auth.conf.

        Returns:
            Whether they were made now.

        Raises:
            ComposeError: a secret a service lists is missing (the message says how to make it).
        """
        made = False
        if not (self.secrets_dir / "auth.conf").is_file():
            try:
                creds.generate(self.secrets_dir, workers=self.ingest_workers(), hosts=self._nats_names)
            except creds.CredsError as exc:
                raise ComposeError(f"cannot make the credentials in {self.secrets_dir}: {exc}") from None
            made = True
        missing = sorted(
            {n for s in self.services.values() for n in s.secrets if not (self.secrets_dir / n).is_file()}
        )
        if missing:
            raise ComposeError(
                f"{self.secrets_dir} lacks {', '.join(missing)}: make them with kvmesh gen-creds --out "
                f"{self.secrets_dir} --workers {','.join(self.ingest_workers())} --force"
            )
        return made

    def _allocate_ports(self) -> None:
        """Map every ``<service>:<port>`` the file mentions (and each service's own ports) to loopback ports."""
        assert self.nodes is not None
        wanted: dict[str, set[int]] = {}
        for svc in self.services.values():
            texts = [*svc.command, *svc.environment.values(), *(svc.healthcheck or ())]
            for text in texts:
                for m in self._host_re.finditer(text):
                    wanted.setdefault(m.group(1), set()).add(int(m.group(2)))
            for text in svc.healthcheck or ():
                for m in re.finditer(r"\b(?:localhost|127\.0\.0\.1):(\d+)\b", text):
                    wanted.setdefault(svc.name, set()).add(int(m.group(1)))
            for key, value in svc.environment.items():
                if key == METRICS_PORT_ENV:
                    if value.isdigit() and int(value) > 0:
                        self.metrics_ports[svc.name] = free_block(1)
                elif key.endswith("_PORT") and value.isdigit():
                    wanted.setdefault(svc.name, set()).add(int(value))
        for name, ports in wanted.items():
            if name in self._nats_service:
                i = self.nodes.names.index(self._nats_service[name])
                self._ports[name] = {
                    p: getattr(self.nodes, attr)[i] for p, attr in _NATS_PORTS.items() if p in ports
                }
                continue
            lo, hi = min(ports), max(ports)
            base = free_block(hi - lo + 1)
            self._ports[name] = {p: base + p - lo for p in range(lo, hi + 1)}

    def _rewrite(self, text: str, service: str) -> str:
        """``text`` with the container names, ports and paths of ``service`` made local."""

        def host(m: re.Match[str]) -> str:
            port = self._ports.get(m.group(1), {}).get(int(m.group(2)))
            return m.group(0) if port is None else f"127.0.0.1:{port}"

        def own(m: re.Match[str]) -> str:
            port = self._ports.get(service, {}).get(int(m.group(1)))
            return m.group(0) if port is None else f"127.0.0.1:{port}"

        text = self._host_re.sub(host, text)
        text = re.sub(r"\b(?:localhost|127\.0\.0\.1):(\d+)\b", own, text)
        if text == "0.0.0.0":
            text = "127.0.0.1"
        run = self.root / "run" / service
        # A path in the container's own /tmp, alone or inside an argument (--health-file=/tmp/x, a shell
        # health check), before anything below puts a local path (itself perhaps under /tmp) in the text.
        text = _CONTAINER_TMP.sub(lambda m: f"{m.group(1)}{run / 'tmp'}/", text)
        return text.replace(_SECRETS, f"{run / 'secrets'}/")

    def env(self, service: str) -> dict[str, str]:
        """The environment ``service`` runs with here: this process's, without its ``KVMESH_*`` variables, plus
        the service's own (remapped) and ``extra_env``."""
        svc = self.services[service]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
        for key, value in svc.environment.items():
            local = self._rewrite(value, service)
            if key == METRICS_PORT_ENV:
                local = str(self.metrics_ports.get(service, value))
            elif key.endswith("_PORT") and value.isdigit():
                local = str(self._ports.get(service, {}).get(int(value), value))
            env[key] = local
        env.update(self.extra_env)
        env["PYTHONUNBUFFERED"] = "1"
        # The image's `kvmesh` (and `python`) for a shell health check: this interpreter's.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return env

    def argv(self, service: str) -> list[str]:
        """The local command line of a kvmesh service (the image's entry point is ``kvmesh``)."""
        svc = self.services[service]
        return [sys.executable, "-m", "kvmesh.cli", *(self._rewrite(a, service) for a in svc.command)]

    def _prepare_dirs(self, service: str) -> Path:
        run = self.root / "run" / service
        (run / "tmp").mkdir(parents=True, exist_ok=True)
        secrets = run / "secrets"
        shutil.rmtree(secrets, ignore_errors=True)
        secrets.mkdir(mode=0o700)
        for name in self.services[service].secrets:
            (secrets / name).symlink_to(self.secrets_dir / name)
        return run

    # ------------------------------------------------------------------ health

    def health_argv(self, service: str) -> list[str] | None:
        """The local form of ``service``'s health check command (None: none, or an in-process HTTP check)."""
        test = self.services[service].healthcheck
        if test is None:
            return None
        if test[0] == "CMD-SHELL":
            return ["sh", "-c", self._rewrite(" ".join(test[1:]), service)]
        argv = [self._rewrite(a, service) for a in test[1:]]
        if argv[0] == "kvmesh":
            return [sys.executable, "-m", "kvmesh.cli", *argv[1:]]
        if argv[0] in ("python", "python3"):
            return [sys.executable, *argv[1:]]
        return argv

    def healthy(self, service: str) -> bool:
        """Run ``service``'s health check once: True when it passes (a service without one: when running)."""
        svc = self.services[service]
        argv = self.health_argv(service)
        if argv is None:
            return svc.nats or (service in self.children and self.children[service].alive)
        if argv[0] == "wget":
            url = next((a for a in argv if a.startswith("http")), None)
            if url is None:
                raise ComposeError(f"service {service}: its wget health check names no URL")
            try:
                with urllib.request.urlopen(url, timeout=3) as reply:
                    return bool(reply.status == 200)
            except (OSError, urllib.error.URLError):
                return False
        try:
            done = subprocess.run(
                argv,
                env=self.env(service),
                cwd=self.root / "run" / service,
                capture_output=True,
                timeout=10,
                check=False,
            )
        except subprocess.TimeoutExpired:
            self.last_health[service] = "the health check ran over 10 s"
            return False
        said = (done.stdout + done.stderr).decode(errors="replace").strip()
        self.last_health[service] = "\n".join(said.splitlines()[-5:]) or f"exit status {done.returncode}"
        return done.returncode == 0

    # ------------------------------------------------------------------ running

    def up(self) -> None:
        """Start everything in dependency order, waiting on each dependency's condition; run the one-shots.

        Raises:
            ComposeError: a service exited, failed its condition or did not become healthy in time (the
                message carries the tail of its log).
            ServerError: a NATS node did not start.
        """
        self.logs.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self.ensure_secrets()
        self.nodes = LocalNodes(self.root / "nats", secrets_dir=self.secrets_dir, config_dir=self._config_dir)
        self._allocate_ports()
        self.nodes.start(timeout_s=self.timeout_s)
        for name in self.order:
            svc = self.services[name]
            for dep, condition in svc.depends_on.items():
                self._wait_condition(name, dep, condition)
            if svc.nats:
                continue
            run = self._prepare_dirs(name)
            if svc.oneshot:
                self.results[name] = self.run_oneshot(name)
            else:
                child = _Child(name, self.argv(name), self.env(name), run, self.logs / f"{name}.log")
                self.children[name] = child
                child.start()

    def _wait_condition(self, service: str, dep: str, condition: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        if condition == "service_completed_successfully":
            result = self.results.get(dep)
            if result is None or result.returncode != 0:
                tail = "" if result is None else "\n".join(result.output.splitlines()[-15:])
                raise ComposeError(f"{service} needs {dep} to complete successfully; it did not:\n{tail}")
            return
        while True:
            child = self.children.get(dep)
            if child is not None and not child.alive:
                raise ComposeError(
                    f"{dep} exited with status {child.popen.returncode if child.popen else None} before "
                    f"{service} could start:\n{_tail(child.log_path)}"
                )
            if condition != "service_healthy" or self.healthy(dep):
                return
            if time.monotonic() > deadline:
                where = _tail(child.log_path) if child is not None else ""
                check = self.last_health.get(dep)
                said = f"its health check said: {check}\n" if check else ""
                raise ComposeError(
                    f"{dep} was not healthy within {self.timeout_s:.0f} s ({service} waits for it); "
                    f"{said}last lines of its log:\n{where}"
                )
            time.sleep(HEALTH_POLL_S)

    def run_oneshot(self, service: str) -> OneShot:
        """Run a one-shot service to its end (bounded by ``timeout_s``); its output also goes to its log."""
        self._prepare_dirs(service)
        try:
            done = subprocess.run(
                self.argv(service),
                env=self.env(service),
                cwd=self.root / "run" / service,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=self.timeout_s,
                check=False,
            )
            result = OneShot(done.returncode, done.stdout.decode(errors="replace"))
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
            result = OneShot(124, out + f"\n(no end within {self.timeout_s:.0f} s)")
        with open(self.logs / f"{service}.log", "a") as log:
            log.write(result.output)
        return result

    def dead(self) -> list[str]:
        """Describe every long-running child that is not running (exit status and log tail)."""
        return [
            f"{name} exited with status {c.popen.returncode if c.popen else None}:\n{_tail(c.log_path)}"
            for name, c in self.children.items()
            if not c.alive
        ]

    def supervise(self) -> list[str]:
        """Start again every child that exited and should restart; return a report of each (with its log tail)."""
        reports = []
        now = time.monotonic()
        if self.nodes is not None:
            for i, node in enumerate(self.nodes.names):
                if not self.nodes.alive(i):
                    report = f"NATS node {node} is not running; last lines of its log:\n{_tail(self.nodes.log_path(i))}"
                    try:
                        self.nodes.start_node(i, timeout_s=self.timeout_s)
                        report += f"\n{node} started again (restart: unless-stopped)"
                    except ServerError as exc:
                        report += f"\n{node} did not start again: {exc}"
                    reports.append(report)
                    self.notes.append(report)
        for name, child in self.children.items():
            if child.alive or child.popen is None:
                continue
            if child.restart_at:  # exited and waiting out its backoff
                if now >= child.restart_at:
                    child.restart_at = 0.0
                    child.start()
                continue
            code = child.popen.returncode
            self.exits[name] = self.exits.get(name, 0) + 1
            report = (
                f"{name} exited with status {code}; last lines of {child.log_path}:\n{_tail(child.log_path)}"
            )
            if self.services[name].restart:
                child.quick_exits = child.quick_exits + 1 if now - child.started_at < QUICK_EXIT_S else 0
                delay = min(MAX_BACKOFF_S, 2.0 ** (child.quick_exits - 1)) if child.quick_exits else 0.0
                if delay:
                    child.restart_at = now + delay
                    report += (
                        f"\n{name} starts again in {delay:g} s (restart: unless-stopped; it keeps exiting)"
                    )
                else:
                    child.start()
                    report += f"\n{name} started again (restart: unless-stopped)"
            reports.append(report)
            self.notes.append(report)
        return reports

    def operator_env(self) -> dict[str, str]:
        """The ``KVMESH_NATS_*`` variables of an operator command against this cluster (operator credentials)."""
        assert self.nodes is not None
        return self.nodes.env("operator")

    def status(self) -> dict[str, Any]:
        """``kvmesh status`` against the cluster with the operator's credentials, as JSON.

        Raises:
            ComposeError: it exited non-zero or printed no JSON.
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")} | self.operator_env()
        done = subprocess.run(
            [sys.executable, "-m", "kvmesh.cli", "status", "--json", "--wait-s", "1.0"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise ComposeError(f"kvmesh status exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        try:
            doc: dict[str, Any] = json.loads(done.stdout)
        except ValueError:
            raise ComposeError(f"kvmesh status printed no JSON: {done.stdout[:500]}") from None
        return doc

    def stop(self, grace_s: float = 8.0) -> None:
        """Stop every child (the last started first: SIGTERM, SIGKILL after ``grace_s``), then the nodes.
        Interrupts (a second Ctrl-C, SIGTERM, SIGHUP) are held off until everything is stopped."""
        held = {
            sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }
        try:
            self._stop(grace_s)
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)

    def _stop(self, grace_s: float) -> None:
        children = list(self.children.values())
        for child in reversed(children):
            child.stop_signal()
        deadline = time.monotonic() + grace_s
        for child in reversed(children):
            child.wait(deadline - time.monotonic())
        if self.nodes is not None:
            self.nodes.stop()

    def describe(self) -> str:
        """The NATS URLs and every service (pid, local command), for the console."""
        assert self.nodes is not None
        lines = []
        for i, name in enumerate(self.nodes.names):
            lines.append(
                f"  {name:<11} {self.nodes.url(i)}  monitoring http://127.0.0.1:{self.nodes.http_ports[i]}"
            )
        for name, child in self.children.items():
            pid = child.popen.pid if child.popen is not None else None
            line = f"  {name:<11} pid {pid}  kvmesh {' '.join(self.services[name].command)}"
            if name in self.metrics_ports:
                line += f"  metrics {self.metrics_url(name)}"
            lines.append(line)
        for name, result in self.results.items():
            lines.append(
                f"  {name:<11} exited {result.returncode}  kvmesh {' '.join(self.services[name].command)}"
            )
        return "\n".join(lines)

    def metrics_url(self, service: str) -> str:
        """The URL of ``service``'s Prometheus endpoint here.

        Raises:
            KeyError: the service sets no ``KVMESH_METRICS_PORT`` (or `up` has not run).
        """
        return f"http://127.0.0.1:{self.metrics_ports[service]}/metrics"

    def skipped_line(self) -> str | None:
        """One line naming the services not run here and why (None: every service runs)."""
        if not self.skipped:
            return None
        return "not run here (only nats and kvmesh images run as local processes): " + ", ".join(
            f"{name} ({why})" for name, why in self.skipped.items()
        )

    def status_hint(self) -> str:
        """How to run ``kvmesh status`` against this cluster from a shell."""
        env = self.operator_env()
        kvmesh = shutil.which("kvmesh") or str(Path(sys.executable).with_name("kvmesh"))
        return " ".join(f"{k}={v}" for k, v in sorted(env.items())) + f" {kvmesh} status"

    def until_converged(self, timeout_s: float) -> dict[str, Any]:
        """``kvmesh status`` (`status`), repeated about every second until it says every replica converged
        or ``timeout_s`` passed; the last one."""
        deadline = time.monotonic() + timeout_s
        while True:
            doc = self.status()
            if (doc.get("convergence") or {}).get("converged") or time.monotonic() >= deadline:
                return doc
            time.sleep(1.0)


def _skipped(services: Mapping[str, Service]) -> dict[str, str]:
    """The services `LocalStack` does not run → why: their image is neither nats nor kvmesh, or they depend
    (through any chain) on such a service; in file order."""
    why = {name: f"image {svc.image}" for name, svc in services.items() if not svc.local}
    changed = True
    while changed:
        changed = False
        for name, svc in services.items():
            if name in why:
                continue
            blocked = sorted(dep for dep in svc.depends_on if dep in why)
            if blocked:
                why[name] = "depends on " + ", ".join(blocked)
                changed = True
    return {name: why[name] for name in services if name in why}


HELP = """\
Run docker-compose.yml's services as local processes, without Docker: the NATS nodes from the same
deploy/nats/cluster.conf (TLS, one NKey user per role) on free loopback ports, then every other service's
command with its environment, in depends_on order, each waiting until its dependencies are healthy (their
own health checks) or, for one-shot services, exited 0. <service>:<port> and /run/secrets/<name> are remapped
(each service sees only its own secrets), KVMESH_METRICS_PORT to a free port per service (its /metrics URL
is printed); a child that exits is reported with its log tail and restarted. Services of other images
(Prometheus, Grafana) are skipped, with one line naming them.

It makes the credentials when the secrets directory has none, prints the node URLs, every service, the route
example's answer and the kvmesh status command (operator credentials), then runs until Ctrl-C or SIGTERM.
--once (or --duration S) waits until every replica converged, prints the status and stops: exit 0 when they
converged, 1 when not.
"""


def _why(exc: BaseException) -> str:
    """One line for an error: an OS error names its file and reason, not a traceback."""
    if isinstance(exc, OSError) and not isinstance(exc, KvmeshError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}"
    return str(exc)


def _lock_root(root: Path) -> IO[str]:
    """Hold ``root`` for this run (an advisory lock on ``root/.lock``, released when the process ends).

    Raises:
        ComposeError: another ``kvmesh cluster`` holds it (its NATS stores would be shared and corrupted).
        OSError: the root cannot be made or the lock file written.
    """
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / ".lock", "a+")  # noqa: SIM115 (held for the run)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        pid = lock.read().strip() or "?"
        lock.close()
        raise ComposeError(
            f"another kvmesh cluster (pid {pid}) uses {root}: give another --root, or stop that one"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ComposeError(f"--env {item!r}: give NAME=VALUE")
        out[key] = value
    return out


def command(argv: Sequence[str] | None = None, prog: str = "kvmesh cluster") -> int:
    """``kvmesh cluster``: 0 after --once/--duration with every replica converged, 1 when the stack did not
    come up or did not converge, 130 on Ctrl-C and 143 on SIGTERM (after stopping everything)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compose", default="docker-compose.yml", help="compose file (default %(default)s)")
    parser.add_argument(
        "--secrets",
        default=creds.DEFAULT_OUT,
        help="the credentials (kvmesh gen-creds; made when missing) (default %(default)s)",
    )
    parser.add_argument(
        "--root",
        default="",
        help="directory kept for the logs (<root>/logs/<service>.log) and the NATS data, which a later run "
        "with the same --root reuses (default: a temporary one, removed after a clean stop)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a variable for every kvmesh service after the file's own (repeatable)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=UP_TIMEOUT_S,
        help="bound on each wait while coming up, and on the wait for convergence (default %(default)s)",
    )
    stop_at = parser.add_mutually_exclusive_group()
    stop_at.add_argument("--once", action="store_true", help="bring up, route, print the status, stop")
    stop_at.add_argument(
        "--duration", type=float, default=None, metavar="S", help="run S seconds, then as --once"
    )
    args = parser.parse_args(argv)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="kvmesh-cluster-"))
    try:
        lock = _lock_root(root)
        stack = LocalStack(
            Path(args.compose),
            root,
            secrets_dir=Path(args.secrets),
            extra_env=_parse_env(args.env),
            timeout_s=args.timeout_s,
        )
    except (ComposeError, OSError) as exc:
        print(f"{prog}: {_why(exc)}", file=sys.stderr)
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
        return 1
    interrupted: list[int] = []

    def on_term(signum: int, _frame: Any) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_term) for sig in (signal.SIGTERM, signal.SIGHUP)}
    print(f"{prog}: {stack.compose.name} as local processes; logs in {stack.logs}", flush=True)
    skipped = stack.skipped_line()
    if skipped:
        print(f"{prog}: {skipped}", flush=True)
    try:
        if stack.ensure_secrets():
            print(f"{prog}: made new credentials in {stack.secrets_dir} (kvmesh gen-creds)", flush=True)
        stack.up()
        print(f"{prog}: up\n{stack.describe()}", flush=True)
        for name, result in stack.results.items():
            if stack.services[name].command[:1] == ("route",):
                print(f"{name} (exit {result.returncode}):\n{result.output.rstrip()}", flush=True)
        print(f"kvmesh status against it (operator credentials):\n  {stack.status_hint()}", flush=True)
        end = None if args.duration is None and not args.once else time.monotonic() + (args.duration or 0.0)
        if end is None:
            print(f"{prog}: running; Ctrl-C (or SIGTERM) stops everything", flush=True)
        while end is None or time.monotonic() < end:
            for report in stack.supervise():
                print(f"{prog}: {report}", file=sys.stderr, flush=True)
            time.sleep(1.0 if end is None else max(0.0, min(1.0, end - time.monotonic())))
        status = stack.until_converged(args.timeout_s)
        print(json.dumps(status, indent=2), flush=True)
        converged = bool((status.get("convergence") or {}).get("converged"))
        if not converged:
            print(f"{prog}: the replicas did not converge within {args.timeout_s:g} s", file=sys.stderr)
        if stack.exits:
            exits = ", ".join(f"{name} {n}×" for name, n in sorted(stack.exits.items()))
            print(f"{prog}: services exited during the run: {exits}", file=sys.stderr)
        ok = converged and not stack.exits and all(r.returncode == 0 for r in stack.results.values())
        code = 0 if ok else 1
    except (ComposeError, ServerError, OSError) as exc:
        print(f"{prog}: {_why(exc)}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 128 + (interrupted[0] if interrupted else signal.SIGINT)
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        lock.close()
    if code >= 128:
        print(f"{prog}: stopped", file=sys.stderr)
    if not args.root and code in (0, 130, 143):
        shutil.rmtree(root, ignore_errors=True)  # a temporary root goes with a clean stop
    elif not args.root:
        print(f"{prog}: logs kept in {stack.logs}", file=sys.stderr)
    return code
