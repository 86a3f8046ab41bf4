"""The one lifecycle of every service: parse, load settings, configure logging (`kvmesh.runtime.logs`), run until
signalled.

`run_service` parses a service's settings and calls `run_async`, which runs the service on a fresh event loop:
SIGINT/SIGTERM ask it to stop (a grace period, then cancellation; a second signal cancels at once), and a
`KvmeshError` or a stray nats-py error ends the process with exit code 1 and one log line (mapped through
`kvmesh.runtime.nats.transport_error`), never a raw traceback. Inside the service, `supervise` runs its
background loops in one `asyncio.TaskGroup` until the service is asked to stop, a loop fails, or the NATS
connection is closed for good (`ConnectionClosedForGood`: a supervisor restarts the process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final, Protocol, TypeVar

from nats.aio.client import Client

from kvmesh.core.errors import ConfigError, ConnectionClosedForGood, KvmeshError
from kvmesh.runtime import logs, tracing
from kvmesh.runtime.config import add_arguments, load, to_dict
from kvmesh.runtime.health import write_health
from kvmesh.runtime.nats import NATS_ERRORS, transport_error, wait_closed

S = TypeVar("S")


def package_version() -> str:
    """The installed kvmesh version (of the ``kvmesh-shared`` distribution), e.g. ``"0.1.0"``."""
    try:
        return version("kvmesh-shared")
    except PackageNotFoundError:
        return "0.0.0+unknown"


VERSION: Final[str] = package_version()
"""The one version every kvmesh command and service reports (``kvmesh --version``, NATS micro service info)."""


class Service(Protocol):
    """What `run_service` drives: an async `run()` that returns after `stop()`."""

    async def run(self) -> None: ...

    def stop(self) -> None: ...


def setup_logging(level: str, service: str, fmt: str = "auto") -> None:
    """Log every record at ``level`` or above to stderr as ``fmt`` says (`kvmesh.runtime.logs.setup_logging`:
    JSON lines when stderr is not a terminal, one readable line when it is).

    Raises:
        ValueError: ``fmt`` is not ``"auto"``, ``"json"`` or ``"text"``.
    """
    logs.setup_logging(level, service, fmt)


def run_service(
    parser: argparse.ArgumentParser,
    cls: type[S],
    *,
    service: str,
    argv: Sequence[str] | None,
    environ: Mapping[str, str],
    build: Callable[[S], Service],
) -> int:
    """Parse arguments into settings, then run the service until SIGINT or SIGTERM.

    Returns:
        0 on a clean stop, 2 on bad settings, 1 when the service failed.
    """
    add_arguments(parser, cls, service)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {VERSION}", help="print the version"
    )
    args = parser.parse_args(argv)
    try:
        settings = load(cls, service=service, environ=environ, args=args)
    except ConfigError as exc:  # a value, not the command line's shape: the problems alone, no usage
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if args._print_config:
        print(json.dumps(to_dict(settings), indent=2, default=str))
        return 0
    setup_logging(
        str(getattr(settings, "log_level", "INFO")), service, str(getattr(settings, "log_format", "auto"))
    )
    try:
        tracing.configure(service, environ)  # OTEL_TRACES_EXPORTER: off unless it names an exporter
    except ConfigError as exc:
        parser.error(str(exc))
    return run_async(build(settings))


STOP_GRACE_S = 10.0
"""Seconds a service gets to finish after SIGINT/SIGTERM before its task is cancelled (a second signal: at once)."""


def run_async(svc: Service) -> int:
    """Run a service on a fresh event loop; SIGINT/SIGTERM call `stop()`, then cancel after a grace period."""
    log = logging.getLogger("kvmesh")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        signals = 0

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            svc.stop()
            ready = getattr(svc, "ready", None)
            if signals > 1 or (isinstance(ready, asyncio.Event) and not ready.is_set()):
                task.cancel()  # a second signal, or still starting (e.g. waiting for NATS): stop now
            else:
                loop.call_later(STOP_GRACE_S, task.cancel)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        # What start-up allocated (the modules, the settings) lives as long as the process: keep it out of the
        # cyclic collector's passes, which a busy ingest triggers every few thousand decoded events (about a
        # fifth of its decode time otherwise). The indexer and the router do the same again once recovered.
        gc.collect()
        gc.freeze()
        with contextlib.suppress(asyncio.CancelledError):
            await svc.run()

    try:
        asyncio.run(main())
    except KvmeshError as exc:
        log.error("%s", exc)
        return 1
    except NATS_ERRORS as exc:  # one the service did not map itself: still one line, still exit 1
        log.error("%s", transport_error(exc, "NATS"))
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


async def _bounded(aw: Awaitable[None], name: str, grace_s: float) -> None:
    """Await ``aw``; when cancelled, cancel it and give it at most ``grace_s`` seconds to end (nats-py can
    swallow a cancellation inside a subscription or a request, and a task group would wait on it forever)."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        task.cancel()
        _, stuck = await asyncio.wait({task}, timeout=grace_s)
        if stuck:
            logging.getLogger("kvmesh").warning("%s did not stop within %g s; left behind", name, grace_s)
        raise


async def supervise(
    nc: Client,
    loops: Mapping[str, Awaitable[None]],
    *,
    stop: asyncio.Event,
    name: str,
    closed_poll_s: float = 1.0,
    stop_grace_s: float = 5.0,
    health_file: str = "",
) -> None:
    """Run a service's background loops in one `asyncio.TaskGroup` until ``stop`` is set.

    Args:
        nc: the service's NATS connection, watched for being closed for good.
        loops: loop name → coroutine (or a task the service started); a loop that returns is done, one that
            raises fails the service.
        stop: set by the service's ``stop()``; every loop still running is then cancelled.
        name: the service as logs name it (``"indexer i-0"``).
        closed_poll_s: how often the connection is checked for being closed for good, in seconds.
        stop_grace_s: seconds a cancelled loop gets to end before it is left behind (and logged).
        health_file: when set, rewritten every few seconds while the loops run and removed at the end
            (`kvmesh.runtime.health`; the service's ``--health-file``).

    Raises:
        ConnectionClosedForGood: ``nc`` was closed for good (not merely reconnecting) before ``stop``.
        Exception: the first exception a loop raised (the other loops are cancelled), unwrapped from the
            task group's exception group when it is the only one.
    """

    async def closed() -> None:
        await wait_closed(nc, poll_s=closed_poll_s)
        if not stop.is_set():
            raise ConnectionClosedForGood(f"{name}: the NATS connection was closed for good; exiting")

    async def until_stopped(tasks: list[asyncio.Task[None]]) -> None:
        await stop.wait()
        for t in tasks:
            t.cancel()

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(_bounded(aw, f"{name}: {loop}", stop_grace_s), name=f"{name}: {loop}")
                for loop, aw in loops.items()
            ]
            tasks.append(tg.create_task(closed(), name=f"{name}: connection"))
            if health_file:
                health = write_health(health_file, nc, service=name)
                tasks.append(tg.create_task(health, name=f"{name}: health file"))
            tg.create_task(until_stopped(tasks), name=f"{name}: stop")
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


def print_json(obj: Any) -> None:
    """Print a JSON document to stdout."""
    print(json.dumps(obj, indent=2, default=str))
