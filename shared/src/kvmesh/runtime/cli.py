"""The common shell of every service command: parse, load settings, configure logging, run until signalled."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final, Protocol, TypeVar

from kvmesh.core.errors import ConfigError, KvmeshError
from kvmesh.runtime.config import add_arguments, load, to_dict

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


def setup_logging(level: str, service: str) -> None:
    """Log one line per record to stderr: time, level, service, logger, message."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


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
    args = parser.parse_args(argv)
    try:
        settings = load(cls, service=service, environ=environ, args=args)
    except ConfigError as exc:
        parser.error(str(exc))
    if args._print_config:
        print(json.dumps(to_dict(settings), indent=2, default=str))
        return 0
    setup_logging(str(getattr(settings, "log_level", "INFO")), service)
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
        with contextlib.suppress(asyncio.CancelledError):
            await svc.run()

    try:
        asyncio.run(main())
    except KvmeshError as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


def print_json(obj: Any) -> None:
    """Print a JSON document to stdout."""
    print(json.dumps(obj, indent=2, default=str))
