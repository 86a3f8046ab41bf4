"""A service's health file: what a container health check (``kvmesh health --file F``) reads.

A service started with ``--health-file PATH`` (``KVMESH_HEALTH_FILE``) rewrites the file every
`HEALTH_INTERVAL_S` seconds from the moment it is started (its loops run under
`kvmesh.runtime.runner.supervise`) until it stops, which removes it. The file is one JSON object, `Health`:
the service, its pid, the wall-clock time of the write and whether the NATS connection was up. A check passes
when the file is younger than its bound and the connection was up; a process that hangs stops rewriting it,
so the file ages out. The check reads no NATS and needs no credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

import msgspec
from nats.aio.client import Client

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_AGE_S", "HEALTH_INTERVAL_S", "Health", "check_health", "write_health"]

HEALTH_INTERVAL_S = 5.0
"""Seconds between two writes of the health file."""
_MAX_BYTES = 4096
"""A health file is one small JSON object."""
DEFAULT_MAX_AGE_S = 20.0
"""Age in seconds past which `check_health` calls a health file stale (four missed writes)."""


class Health(msgspec.Struct, frozen=True, kw_only=True):
    """The content of a health file."""

    service: str
    """The service as its logs name it (``"router"``, ``"ingest vllm-0"``)."""
    pid: int
    written_at: float
    """Wall-clock time of the write (seconds since the epoch)."""
    connected: bool
    """Whether the service's NATS connection was up at the write."""


def _write(path: Path, health: Health) -> None:
    """Replace ``path`` atomically (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.encode(health))
    tmp.replace(path)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


async def write_health(
    path: str | os.PathLike[str], nc: Client, *, service: str, interval_s: float = HEALTH_INTERVAL_S
) -> None:
    """Rewrite the health file every ``interval_s`` seconds until cancelled, then remove it.

    A write that fails (a full or read-only disk) is retried at the next interval; the service goes on.
    """
    target = Path(path)
    failing = False
    try:
        while True:
            try:
                _write(
                    target,
                    Health(
                        service=service, pid=os.getpid(), written_at=time.time(), connected=nc.is_connected
                    ),
                )
                failing = False
            except OSError as exc:
                if not failing:  # once per run of failures: the check will say the file is missing or old
                    log.warning(
                        "%s: cannot write the health file %s: %s", service, target, exc.strerror or exc
                    )
                failing = True
            await asyncio.sleep(interval_s)
    finally:
        _remove(target)


def check_health(
    path: str | os.PathLike[str], *, max_age_s: float = DEFAULT_MAX_AGE_S, now: float
) -> str | None:
    """Why the service behind ``path`` is not healthy, or None when it is.

    Args:
        path: the service's ``--health-file``.
        max_age_s: the oldest write that still counts, in seconds.
        now: the current wall-clock time (seconds since the epoch).
    """
    target = Path(path)
    try:
        if not target.is_file():  # a FIFO or a device would block or never end
            if not target.exists():
                return f"{path} does not exist (the service has not started, or has stopped)"
            return f"{path} is not a regular file"
        with target.open("rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    if len(raw) > _MAX_BYTES:
        return f"{path} is not a kvmesh health file: larger than {_MAX_BYTES} bytes"
    try:
        health = msgspec.json.decode(raw, type=Health)
    except msgspec.DecodeError as exc:
        return f"{path} is not a kvmesh health file: {exc}"
    age = now - health.written_at
    if age < -max_age_s:
        return f"{path} was written {-age:.0f} s in the future (a clock set back, or not a health file)"
    if not age <= max_age_s:  # NaN too
        return (
            f"{health.service} (pid {health.pid}) last wrote {path} {age:.0f} s ago (bound {max_age_s:g} s)"
        )
    if not health.connected:
        return f"{health.service} (pid {health.pid}) is not connected to NATS"
    return None
