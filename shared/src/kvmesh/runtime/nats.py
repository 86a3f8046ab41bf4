"""NATS plumbing shared by the services: connecting, the events stream, error mapping.

TransportError (KvmeshError)       something between us and NATS failed
 └ ConnectionClosedForGood          the client closed its connection and will not reconnect
└── StreamUnavailableError         the events stream does not exist (yet) or JetStream is off
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from kvmesh.core.errors import KvmeshError
from kvmesh.runtime import subjects
from kvmesh.runtime.snapshots import DEFAULT_STREAM_MAX_AGE_S, DEFAULT_STREAM_MAX_BYTES

log = logging.getLogger(__name__)

DEFAULT_NATS_URL: Final[str] = "nats://127.0.0.1:4222"


class TransportError(KvmeshError):
    """A NATS or ZMQ operation failed."""


class StreamUnavailableError(TransportError):
    """The events stream does not exist (yet), or JetStream is not enabled on the server."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamSettings:
    """How the events stream is created when it is missing."""

    name: str = subjects.STREAM
    prefix: str = subjects.EVENTS_PREFIX
    replicas: int = 1
    """R1 on one server, R3 on a cluster."""
    max_age_s: float = DEFAULT_STREAM_MAX_AGE_S
    """Messages older than this are dropped (seconds); the rule is `default_stream_max_age_s`."""
    max_bytes: int = DEFAULT_STREAM_MAX_BYTES
    """Stream size bound in bytes (oldest dropped first)."""
    duplicate_window_s: float = 120.0
    """Window in which a repeated ``Nats-Msg-Id`` is dropped by the server (seconds)."""
    memory: bool = False
    """Memory storage instead of file storage (tests, demos)."""


async def connect(
    url: str,
    *,
    name: str,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    wait_s: float | None = None,
    **kwargs: Any,
) -> Client:
    """Connect to NATS, retrying forever on disconnects (services must ride out server restarts).

    Args:
        url: server URL.
        name: connection name shown by the server.
        on_disconnect: awaited once per lost connection, before the client reconnects (and re-sends what
            it buffered).
        wait_s: give up on the first connection after this many seconds (tools); None keeps trying,
            logging a warning every few seconds (services may start before the server).
        **kwargs: further `nats.connect` options.

    Raises:
        TransportError: the first connection could not be made within ``wait_s``.
    """

    async def _disconnected() -> None:
        log.info("nats: disconnected from %s (%s); reconnecting", url, name)
        if on_disconnect is not None:
            await on_disconnect()

    async def _reconnected() -> None:
        log.info("nats: reconnected to %s (%s)", url, name)

    async def _error(exc: Exception) -> None:
        log.debug("nats: %s: %r", name, exc)

    options: dict[str, Any] = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.5, "connect_timeout": 2}
    options.update(kwargs)
    loop = asyncio.get_running_loop()
    deadline = None if wait_s is None else loop.time() + wait_s
    attempt_s = 5.0 if wait_s is None else max(0.1, wait_s)
    last: BaseException | None = None
    while deadline is None or loop.time() < deadline:
        try:
            # nats-py retries a failed first connection forever with max_reconnect_attempts=-1; bound each
            # attempt so the caller hears about an unreachable server.
            return await asyncio.wait_for(
                nats.connect(
                    url,
                    name=name,
                    disconnected_cb=_disconnected,
                    reconnected_cb=_reconnected,
                    error_cb=_error,
                    **options,
                ),
                timeout=attempt_s if deadline is None else max(0.1, deadline - loop.time()),
            )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            last = exc
            if deadline is None:
                log.warning("nats: cannot reach %s (%s); still trying", url, name)
    raise TransportError(f"cannot connect to NATS at {url} within {wait_s:g} s: {last!r}")


async def ensure_stream(js: JetStreamContext, settings: StreamSettings) -> None:
    """Create the events stream if it is missing; leave an existing one as it is.

    Raises:
        StreamUnavailableError: JetStream is not enabled, or the stream cannot be created.
    """
    try:
        await js.stream_info(settings.name)
        return
    except nats.js.errors.NotFoundError:
        pass
    except nats.errors.NoRespondersError as exc:
        raise StreamUnavailableError(
            "JetStream is not enabled on the NATS server (start it with -js)"
        ) from exc
    config = StreamConfig(
        name=settings.name,
        subjects=[subjects.events_wildcard(settings.prefix)],
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.OLD,
        storage=StorageType.MEMORY if settings.memory else StorageType.FILE,
        num_replicas=settings.replicas,
        max_age=settings.max_age_s,
        max_bytes=settings.max_bytes,
        duplicate_window=settings.duplicate_window_s,
        allow_direct=True,
    )
    try:
        await js.add_stream(config)
        log.info("created stream %s on %s.>", settings.name, settings.prefix)
    except nats.js.errors.BadRequestError as exc:
        # Another component created it between our lookup and our create: fine if it exists now.
        try:
            await js.stream_info(settings.name)
        except nats.js.errors.NotFoundError:
            raise StreamUnavailableError(f"cannot create stream {settings.name}: {exc}") from exc


async def wait_for_stream(
    js: JetStreamContext,
    name: str,
    *,
    stop: asyncio.Event | None = None,
    interval_s: float = 1.0,
    on_wait: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Wait until the stream exists (services may start before any ingest created it)."""
    warned = False
    while stop is None or not stop.is_set():
        try:
            await js.stream_info(name)
            return
        except (nats.js.errors.NotFoundError, nats.errors.NoRespondersError, nats.errors.TimeoutError):
            if not warned:
                log.info("waiting for stream %s to exist", name)
                warned = True
            if on_wait is not None:
                await on_wait()
            await asyncio.sleep(interval_s)


async def close_quietly(nc: Client, *, timeout_s: float = 2.0) -> None:
    """Drain a connection for at most ``timeout_s`` seconds, then close it; never raises (shutdown path)."""
    with contextlib.suppress(TimeoutError, nats.errors.Error, OSError):
        await asyncio.wait_for(nc.drain(), timeout=timeout_s)
    if not nc.is_closed:
        with contextlib.suppress(Exception):
            await nc.close()


class ConnectionClosedForGood(TransportError):
    """The NATS client closed its connection and will not reconnect (nats-py does this on some server errors,
    e.g. a publish over the max payload); a service raises it so its supervisor restarts the process."""


async def wait_closed(nc: Client, *, poll_s: float = 1.0) -> None:
    """Return once ``nc`` is closed for good (not merely reconnecting)."""
    while not nc.is_closed:  # noqa: ASYNC110 - nats-py has no awaitable "closed"; its callback is set at connect
        await asyncio.sleep(poll_s)
