"""NATS plumbing shared by the services: connecting, the events stream, error mapping.

nats-py's exceptions become kvmesh's `TransportError` subtree here (drawn in `kvmesh.core.errors`, where the
classes live; they are re-exported from this module).

Every URL this module logs or puts in an error goes through `redact_url` first: credentials never reach logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import unquote, urlsplit

import nats
import nats.errors
import nats.js.errors
import nkeys
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from kvmesh.core.errors import (
    AuthorizationError,
    BadURLError,
    ConfigError,
    ConnectError,
    ConnectionClosedForGood,
    ConnectRefusedError,
    ConnectTimeoutError,
    NotNatsServerError,
    StreamUnavailableError,
    TLSError,
    TransportError,
    UnknownHostError,
)
from kvmesh.runtime import subjects
from kvmesh.runtime.config import NatsAuth, auth_problems
from kvmesh.runtime.snapshots import DEFAULT_STREAM_MAX_AGE_S, DEFAULT_STREAM_MAX_BYTES

__all__ = [
    "DEFAULT_NATS_URL",
    "NATS_ERRORS",
    "AuthorizationError",
    "BadURLError",
    "ConnectError",
    "ConnectRefusedError",
    "ConnectTimeoutError",
    "ConnectionClosedForGood",
    "NatsAuth",
    "NotNatsServerError",
    "StreamSettings",
    "StreamUnavailableError",
    "TLSError",
    "TransportError",
    "UnknownHostError",
    "bucket_stream",
    "close_quietly",
    "connect",
    "connect_options",
    "count_endpoint_error",
    "ensure_stream",
    "micro_endpoint",
    "redact_url",
    "split_servers",
    "transport_error",
    "wait_closed",
    "wait_for_stream",
    "withdraw_buffered_publishes",
]

log = logging.getLogger(__name__)

DEFAULT_NATS_URL: Final[str] = "nats://127.0.0.1:4222"


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


_SCHEMES: Final[frozenset[str]] = frozenset({"nats", "tls", "ws", "wss"})
_DEFAULT_PORTS: Final[dict[str, int]] = {"nats": 4222, "tls": 4222, "ws": 80, "wss": 443}


def _redact_one(server: str) -> str:
    head, sep, rest = server.partition("://")
    if not sep:
        head, rest = "", server
    end = len(rest)
    for ch in "/?#":
        pos = rest.find(ch)
        if pos != -1:
            end = min(end, pos)
    netloc, tail = rest[:end], rest[end:]
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    return f"{head}{sep}{netloc}{tail}"


def redact_url(url: str) -> str:
    """Return a NATS URL (or comma-separated list) with every user info replaced by ``***``.

    ``nats://alice:s3cret@host:4222,tls://t0ken@b:4222`` reads ``nats://***@host:4222,tls://***@b:4222``.
    """
    return ",".join(_redact_one(part.strip()) for part in url.split(","))


def split_servers(url: str) -> list[str]:
    """Split a NATS URL or a comma-separated server list into server URLs, each with a scheme.

    A server without a scheme (``host:4222``) is ``nats://``.

    Raises:
        BadURLError: empty, an unknown scheme (``http://``), no host, a bad port, or ws:// mixed with nats://.
    """
    shown = redact_url(url)
    parts = [p.strip() for p in url.split(",") if p.strip()]
    if not parts:
        raise BadURLError("no NATS server URL given", servers=shown)
    out: list[str] = []
    for part in parts:
        server = part if "://" in part else f"nats://{part}"
        scheme = server.partition("://")[0].lower()
        if scheme not in _SCHEMES:
            raise BadURLError(
                f"{_redact_one(part)} is not a NATS URL: scheme {scheme}:// (use nats://, tls://, ws:// or wss://)",
                servers=shown,
            )
        try:
            u = urlsplit(server)
            _ = u.port
        except ValueError as exc:
            raise BadURLError(f"{_redact_one(part)} is not a NATS URL: {exc}", servers=shown) from None
        if not u.hostname:
            raise BadURLError(f"{_redact_one(part)} is not a NATS URL: no host", servers=shown)
        out.append(server)
    if len({s.partition("://")[0].lower() in ("ws", "wss") for s in out}) > 1:
        raise BadURLError(f"{shown}: ws:// and wss:// cannot be mixed with nats:// or tls://", servers=shown)
    return out


def connect_options(auth: NatsAuth) -> dict[str, Any]:
    """The `nats.connect` options of a process's NATS credentials and TLS settings (`connect`'s ``**kwargs``).

    User and password, token, NKey seed file (``nkeys_seed``) or ``.creds`` file (``user_credentials``); a
    TLS context verifying the server against ``nats_tls_ca_file`` (the system CAs when not given) and
    presenting the client certificate, made when any TLS file or the server name is given; the reply-inbox
    prefix (``inbox_prefix``) when ``nats_inbox_prefix`` is set (a server granting each role only its own
    ``<prefix>.>`` keeps one role from reading another's replies).

    Raises:
        ConfigError: the settings contradict each other or name a missing file.
        TLSError: a certificate, key or CA file does not load (the message names the file, never its content).
    """
    problems = auth_problems(auth)
    if problems:
        raise ConfigError(problems)
    out: dict[str, Any] = {}
    if auth.nats_user:
        out["user"] = auth.nats_user
        out["password"] = auth.nats_password
    if auth.nats_token:
        out["token"] = auth.nats_token
    if auth.nats_nkey_seed_file:
        _check_seed(auth.nats_nkey_seed_file, "--nats-nkey-seed-file", creds=False)
        out["nkeys_seed"] = auth.nats_nkey_seed_file
    if auth.nats_creds_file:
        _check_seed(auth.nats_creds_file, "--nats-creds-file", creds=True)
        out["user_credentials"] = auth.nats_creds_file
    if auth.nats_inbox_prefix:
        out["inbox_prefix"] = auth.nats_inbox_prefix
    if auth.nats_tls_ca_file or auth.nats_tls_cert_file or auth.nats_tls_server_name:
        try:
            ctx = ssl.create_default_context(cafile=auth.nats_tls_ca_file or None)
            if auth.nats_tls_cert_file:
                ctx.load_cert_chain(auth.nats_tls_cert_file, auth.nats_tls_key_file or None)
        except (ssl.SSLError, OSError) as exc:
            files = ", ".join(
                f for f in (auth.nats_tls_ca_file, auth.nats_tls_cert_file, auth.nats_tls_key_file) if f
            )
            why = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or type(exc).__name__
            raise TLSError(f"cannot load the NATS TLS files ({files}): {why}") from None
        out["tls"] = ctx
        if auth.nats_tls_server_name:
            out["tls_hostname"] = auth.nats_tls_server_name
    return out


def _check_seed(path: str, flag: str, *, creds: bool) -> None:
    """Refuse an NKey seed file or ``.creds`` file whose seed (or, for .creds, user JWT) does not parse, before
    anything is sent; the error names the flag and the file, never what it holds."""
    try:
        lines = [line.strip() for line in Path(path).read_text(errors="replace").splitlines()]
    except OSError as exc:
        raise ConfigError([f"{flag}: cannot read {path}: {exc.strerror or exc}"]) from None
    if creds:
        marks = [
            i
            for i, line in enumerate(lines)
            if "BEGIN USER NKEY SEED" in line or "BEGIN NATS USER JWT" in line
        ]
        if len(marks) != 2 or any(i + 1 >= len(lines) or not lines[i + 1] for i in marks):
            raise ConfigError([f"{flag}: {path} is not a .creds file (a user JWT and an NKey seed)"])
        seeds = [lines[i + 1] for i in marks if "SEED" in lines[i]]
    else:
        seeds = [line for line in lines if line.startswith("S")][:1]
    try:
        nkeys.from_seed(bytearray(seeds[0].encode())).wipe()
    except (IndexError, nkeys.NkeysError, ValueError, TypeError):
        raise ConfigError([f"{flag}: {path} holds no valid NKey seed"]) from None


def _file_seeds(path: Any) -> list[str]:
    """The NKey seeds (``SU...``, ``SA...``, ``SO...``) and JWTs in an NKey seed or ``.creds`` file."""
    try:
        text = Path(str(path)).read_text(errors="replace")
    except OSError:
        return []
    return [w for line in text.splitlines() if len(w := line.strip()) >= 20 and w[:1] in "SeE"]


def _secrets(servers: Sequence[str], options: Mapping[str, Any]) -> list[str]:
    found: list[str] = []
    for s in servers:
        u = urlsplit(s)
        found += [unquote(x) for x in (u.username, u.password) if x]
        found += [x for x in (u.username, u.password) if x]
    found += [str(options[k]) for k in ("user", "password", "token", "nkeys_seed_str") if options.get(k)]
    for k in ("nkeys_seed", "user_credentials"):
        if isinstance(options.get(k), str | Path):
            found += _file_seeds(options[k])
    return sorted({x for x in found if len(x) >= 3}, key=len, reverse=True)


def _scrub(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def _host_port(server: str) -> tuple[str, int]:
    u = urlsplit(server)
    return u.hostname or "", u.port or _DEFAULT_PORTS[u.scheme.lower()]


async def _greeting(server: str, timeout_s: float) -> tuple[ConnectError | None, dict[str, Any] | None]:
    """Open a plain TCP connection to ``server`` and read its first line: (the failure it shows, or its INFO)."""
    host, port = _host_port(server)
    shown = _redact_one(server)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except socket.gaierror:
        return UnknownHostError(f"host {host!r} does not resolve", servers=shown), None
    except ConnectionRefusedError:
        return ConnectRefusedError(
            f"connection refused: nothing listens on {host}:{port}", servers=shown
        ), None
    except TimeoutError:
        return ConnectTimeoutError(
            f"no answer from {host}:{port} within {timeout_s:g} s", servers=shown
        ), None
    except OSError as exc:
        return ConnectError(f"{host}:{port}: {exc.strerror or exc}", servers=shown), None
    try:
        try:
            line = await asyncio.wait_for(reader.readline(), timeout_s)
        except (TimeoutError, OSError, ValueError):
            line = b""
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 0.5)
    if line.startswith(b"INFO "):
        with contextlib.suppress(ValueError):
            info = json.loads(line[5:])
            if isinstance(info, dict):
                return None, info
    return (
        NotNatsServerError(
            f"{host}:{port} accepts connections but is not a NATS client port (no INFO greeting within "
            f"{timeout_s:g} s; the monitoring port, 8222 by default, speaks HTTP)",
            servers=shown,
        ),
        None,
    )


def _definite(exc: BaseException, shown: str) -> ConnectError | None:
    """The `ConnectError` a nats-py connect error proves at once (no retry can help), or None."""
    text = str(exc).lower()
    if isinstance(exc, nats.errors.AuthorizationError) or "authorization" in text or "authentication" in text:
        return AuthorizationError(
            "the server refused the credentials (authorization violation)", servers=shown
        )
    if isinstance(exc, ssl.SSLError):
        reason = str(exc.reason or exc)
        hint = (
            " (the server's certificate is not signed by a CA this process trusts, or does not name the host: "
            "set --nats-tls-ca-file / KVMESH_NATS_TLS_CA_FILE to its CA, --nats-tls-server-name to its name)"
            if "CERTIFICATE_VERIFY_FAILED" in reason
            else ""
        )
        return TLSError(f"TLS handshake failed: {reason}{hint}", servers=shown)
    if "expecting info" in text or "info message" in text:
        return NotNatsServerError(
            "the server did not greet with NATS INFO: not a NATS client port", servers=shown
        )
    return None


async def _diagnose(servers: Sequence[str], timeout_s: float, last: BaseException | None) -> ConnectError:
    """Name why no server of the list could be reached: probe each, keep the most telling failure."""
    found = await asyncio.gather(*(_greeting(s, timeout_s) for s in servers))
    failures = [f for f, _ in found if f is not None]
    if len(failures) == len(servers):
        kinds = {type(f) for f in failures}
        if len(kinds) == 1:
            if len(failures) == 1:
                return failures[0]
            return failures[0].__class__("; ".join(str(f) for f in failures))
        return ConnectError("; ".join(f"{f.servers}: {f}" for f in failures))
    if last is not None and isinstance(last, TimeoutError | nats.errors.TimeoutError):
        return ConnectTimeoutError(f"the server did not complete the NATS handshake within {timeout_s:g} s")
    detail = f": {last}" if last is not None and str(last) else f": {type(last).__name__}" if last else ""
    return ConnectError(f"the NATS handshake failed{detail}")


def _with_context(exc: ConnectError, shown: str, secrets: Sequence[str], after: str) -> ConnectError:
    """Re-make ``exc`` with the message ``cannot connect to NATS at <servers>: <why>``, secrets scrubbed."""
    out = type(exc)(_scrub(f"cannot connect to NATS at {shown}: {exc}{after}", secrets), servers=shown)
    return out


async def connect(
    url: str,
    *,
    name: str,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    wait_s: float | None = None,
    connect_timeout_s: float = 2.0,
    **kwargs: Any,
) -> Client:
    """Connect to NATS; once connected, the client reconnects forever (services ride out server restarts).

    Args:
        url: a server URL, or a comma-separated list of them (``nats://a:4222,nats://b:4222``); schemes
            nats://, tls:// (TLS required: a server without TLS is refused before any credential is sent),
            ws://, wss://. Credentials in the URL never reach logs or error messages.
        name: connection name shown by the server.
        on_disconnect: awaited once per lost connection, before the client reconnects (and re-sends what
            it buffered).
        wait_s: give up on the first connection after this many seconds in all (tools, the client); None
            keeps trying, logging a warning with the reason every few seconds (services may start before
            the server).
        connect_timeout_s: seconds one attempt may take (TCP connect, INFO, handshake).
        **kwargs: further `nats.connect` options (``tls``, ``user``, ``password``, ``token``, ...).

    Raises:
        BadURLError: the URL cannot name a NATS server (raised at once).
        AuthorizationError, TLSError, NotNatsServerError: proved by the server's answer (raised at once
            when ``wait_s`` is given).
        UnknownHostError, ConnectRefusedError, ConnectTimeoutError, ConnectError: no connection within
            ``wait_s`` (the last failure names the cause).
    """
    servers = split_servers(url)
    shown = redact_url(url)
    secrets = _secrets(servers, kwargs)
    loop = asyncio.get_running_loop()
    deadline = None if wait_s is None else loop.time() + wait_s
    # Time kept at the end of wait_s to name the cause (one TCP connect and one read per server).
    probe_s = 1.0 if wait_s is None else min(1.0, max(0.1, wait_s / 4))
    attempt_timeout = connect_timeout_s if wait_s is None else max(0.1, min(connect_timeout_s, wait_s))
    if wait_s is not None:
        attempt_timeout = max(0.1, min(attempt_timeout, wait_s - 2 * probe_s))
    tls_servers = [s for s in servers if s.partition("://")[0].lower() == "tls"]
    if tls_servers:
        kwargs.setdefault("tls", ssl.create_default_context())
        for s in tls_servers:
            _, info = await _greeting(s, probe_s)
            if info is not None and not info.get("tls_required") and not kwargs.get("tls_handshake_first"):
                raise TLSError(
                    f"cannot connect to NATS at {shown}: tls:// asks for TLS but {_redact_one(s)} offers "
                    "none (its INFO says tls_required false); nothing was sent in plaintext",
                    servers=shown,
                )

    if kwargs.get("tls") is not None:
        _quiet_asyncio_tls_eof()

    current: list[Client] = []

    async def _disconnected() -> None:
        if current and (current[0].is_closed or current[0].is_draining):
            log.info("nats: connection to %s closed (%s)", shown, name)
        else:
            log.info("nats: disconnected from %s (%s); reconnecting", shown, name)
        if on_disconnect is not None:
            await on_disconnect()

    async def _reconnected() -> None:
        log.info("nats: reconnected to %s (%s)", shown, name)

    options: dict[str, Any] = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.5}
    options.update(kwargs)
    options["connect_timeout"] = attempt_timeout
    last: BaseException | None = None
    while True:
        window = 5.0 if deadline is None else deadline - loop.time() - 2 * probe_s
        if window <= 0:
            break
        attempt = _Attempt(shown=shown, name=name, secrets=secrets, definite=loop.create_future())
        nc = Client()
        current[:] = [nc]
        task: asyncio.Future[None] = asyncio.ensure_future(
            nc.connect(
                servers,
                name=name,
                disconnected_cb=_disconnected,
                reconnected_cb=_reconnected,
                error_cb=attempt.on_error,
                **options,
            )
        )
        waited: set[asyncio.Future[Any]] = {task, attempt.definite}
        done, _ = await asyncio.wait(waited, timeout=window, return_when=asyncio.FIRST_COMPLETED)
        if task in done and task.exception() is None:
            attempt.connected = True
            await _check_tls(nc, shown)
            return nc
        failure = attempt.definite.result() if attempt.definite in done else None
        raised = task.exception() if task.done() else None
        if raised is not None:
            attempt.last = raised
            failure = failure or _definite(raised, shown)
        last = attempt.last or last
        await _abandon(nc, task)
        if failure is not None and deadline is not None:
            raise _with_context(failure, shown, secrets, "") from None
        if deadline is None:
            why = failure or await _diagnose(servers, probe_s, last)
            log.warning(
                "nats: cannot connect to %s (%s): %s; still trying", shown, name, _scrub(str(why), secrets)
            )
            await asyncio.sleep(options["reconnect_time_wait"])
    why = await _diagnose(servers, probe_s, last)
    raise _with_context(why, shown, secrets, f" (gave up after {wait_s:g} s)") from None


async def _abandon(nc: Client, task: asyncio.Future[None]) -> None:
    """Stop a failed first-connection attempt and close every socket it opened.

    nats-py goes on to the next server after a failure, so the attempt may hold a fresh socket when it is
    stopped; a cancellation that lands as a connection completes can be swallowed (Python 3.11's wait_for), so
    it is repeated until the attempt ends; and `Client.close` does nothing once the client counts as closed,
    which it does between servers, so the transport is closed here as well.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.5)
    if not task.cancelled():
        task.exception()  # retrieved: the attempt's failure is reported by the caller
    with contextlib.suppress(Exception):
        await nc.close()
    transport = getattr(nc, "_transport", None)
    if transport is not None:
        # Not awaited: a writer whose TLS upgrade failed never resolves its close waiter.
        with contextlib.suppress(Exception):
            transport.close()
        await asyncio.sleep(0)


def _drop_tls_eof_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("returning true from eof_received() has no effect when using ssl")


def _quiet_asyncio_tls_eof() -> None:
    """Keep asyncio's warning about nats-py's reader on a TLS socket (harmless: the server closed it) out of
    every log and every command's stderr."""
    aio = logging.getLogger("asyncio")
    if _drop_tls_eof_warning not in aio.filters:
        aio.addFilter(_drop_tls_eof_warning)


@dataclass(slots=True, kw_only=True)
class _Attempt:
    """One first-connection attempt: nats-py reports its failures through the error callback."""

    shown: str
    name: str
    secrets: Sequence[str]
    definite: asyncio.Future[ConnectError]
    connected: bool = False
    last: BaseException | None = None
    refused: set[str] = field(default_factory=set)
    """Permission violations already logged (each distinct one once)."""

    async def on_error(self, exc: Exception) -> None:
        if not self.connected:
            self.last = exc
            found = _definite(exc, self.shown)
            if found is not None and not self.definite.done():
                self.definite.set_result(found)
        text = _scrub(str(exc), self.secrets)
        if "permissions violation" in text.lower():
            # The server drops what the credentials may not do and says so only here: a request then times
            # out and a subscription stays silent, so name it where an operator looks.
            if text not in self.refused and len(self.refused) < 32:
                self.refused.add(text)
                hint = (
                    "; the reply inbox is not permitted: set --nats-inbox-prefix / KVMESH_NATS_INBOX_PREFIX "
                    "to the role's own prefix"
                    if "_inbox" in text.lower() and "subscription" in text.lower()
                    else "; the credentials' role does not allow it"
                )
                log.warning("nats: %s: the server refused: %s%s", self.name, text, hint)
            return
        log.debug("nats: %s: %s", self.name, _scrub(repr(exc), self.secrets))


async def _check_tls(nc: Client, shown: str) -> None:
    """Refuse a connection made through a tls:// URL that did not turn into TLS."""
    url = nc.connected_url
    if url is None or url.scheme != "tls":
        return
    info: dict[str, Any] = getattr(nc, "_server_info", {}) or {}
    if not info.get("tls_required"):
        await close_quietly(nc)
        raise TLSError(
            f"cannot connect to NATS at {shown}: tls:// asks for TLS but the server offers none",
            servers=shown,
        )


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


async def wait_closed(nc: Client, *, poll_s: float = 1.0) -> None:
    """Return once ``nc`` is closed for good (not merely reconnecting)."""
    while not nc.is_closed:  # noqa: ASYNC110 - nats-py has no awaitable "closed"; its callback is set at connect
        await asyncio.sleep(poll_s)


# ---------------------------------------------------------------------------------------- error mapping


def transport_error(exc: BaseException, what: str) -> TransportError:
    """Map a nats-py exception to kvmesh's `TransportError` subtree (httpx's habit: one boundary).

    Args:
        exc: what nats-py raised.
        what: the operation, for the message (``"publish to kvmesh.events.m.w.0"``).

    Returns:
        `ConnectionClosedForGood` when the client closed for good, `StreamUnavailableError` when JetStream
        answered that the stream or the service is not there, else a plain `TransportError`; the message
        names the operation and the nats-py error (never credentials: nats-py errors carry none).
    """
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, nats.errors.ConnectionClosedError):
        return ConnectionClosedForGood(f"{what}: the NATS connection is closed for good ({detail})")
    if isinstance(exc, nats.js.errors.NotFoundError | nats.js.errors.ServiceUnavailableError):
        return StreamUnavailableError(f"{what}: {detail}")
    if isinstance(exc, nats.errors.NoRespondersError):
        return TransportError(f"{what}: no responders (is JetStream enabled, the service running?)")
    if isinstance(exc, nats.errors.TimeoutError | TimeoutError):
        return TransportError(f"{what}: timed out")
    return TransportError(f"{what}: {type(exc).__name__}: {detail}")


NATS_ERRORS: Final[tuple[type[BaseException], ...]] = (nats.errors.Error,)
"""What `transport_error` maps: every nats-py error (JetStream errors derive from it)."""


# ---------------------------------------------------------------------------------------- nats-py internals
#
# The only place kvmesh touches nats-py's private attributes; tests/test_nats_internals.py fails loudly when a
# nats-py release renames any of them.


def withdraw_buffered_publishes(nc: Client, js: JetStreamContext) -> int:
    """Take this JetStream context's unsent publishes out of the client's reconnect buffer; returns how many.

    nats-py re-sends what it buffered as soon as it reconnects, before the caller learns of it; an ingest that
    re-sends its unacknowledged window itself, in order, must withdraw them or they land out of order. Only
    publishes whose reply subject is ``js``'s ack inbox are withdrawn (other traffic stays). nats-py has no
    public way to do this: it reads ``js._async_reply_prefix``, ``nc._pending`` and
    ``nc._pending_data_size``.
    """
    prefix = getattr(js, "_async_reply_prefix", None)
    if not prefix:
        return 0
    marker = b" " + bytes(prefix)
    pending: list[bytes] = nc._pending
    keep = [c for c in pending if not (c.startswith((b"HPUB ", b"PUB ")) and marker in c[: c.find(b"\r\n")])]
    if len(keep) != len(pending):
        nc._pending = keep
        nc._pending_data_size = sum(len(c) for c in keep)
    return len(pending) - len(keep)


def bucket_stream(kv: Any) -> tuple[JetStreamContext, str, str]:
    """(JetStream context, stream name, key subject prefix) of a nats-py ``KeyValue`` (no public accessor:
    ``kv._js``, ``kv._stream``, ``kv._pre``)."""
    return kv._js, kv._stream, kv._pre


def micro_endpoint(service: Any, name: str) -> Any:
    """The nats-py micro ``Endpoint`` object named ``name`` of a started service (``service._endpoints``)."""
    for endpoint in service._endpoints:
        if endpoint._name == name:
            return endpoint
    raise LookupError(f"the service has no endpoint {name!r}")


def count_endpoint_error(endpoint: Any, text: str) -> None:
    """Count an error on a nats-py micro endpoint, as ``$SRV.STATS`` shows it (``num_errors``, ``last_error``).

    nats.micro counts an error only when a handler raises; a service that answers its errors itself (the
    router) counts them here (``endpoint._num_errors``, ``endpoint._last_error``).
    """
    endpoint._num_errors += 1
    endpoint._last_error = text
