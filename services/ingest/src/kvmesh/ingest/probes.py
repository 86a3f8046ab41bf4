"""Probes that an engine's own process must answer (the I/O half of `kvmesh.core.liveness`).

`probe_replay` asks a rank's replay ROUTER for batches from a sequence no engine reaches (2⁶³): a live
publisher answers with its end marker alone (vLLM ≥ 0.9 and SGLang ≥ 0.4.6: "a start seq past the newest
gets only END", ../wire-protocol §2.4), a dead one answers nothing. `probe_http` GETs a URL (the engine's
``/health`` or ``/metrics`` page) for engines without a replay socket. `fetch_metrics` reads the engine's
Prometheus page (`kvmesh.ingest.engine_sleep` looks for a sleep there) on the event loop itself, so a page
that never finishes (a byte at a time) or is huge costs one connection for at most its timeout and at most
`MAX_METRICS_BYTES`, never a thread left reading.
"""

from __future__ import annotations

import asyncio
import http.client
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Final

import zmq
import zmq.asyncio

from kvmesh.core import wire
from kvmesh.core.errors import WireError

PROBE_SEQ: Final[int] = 2**63
"""The start sequence a replay probe asks for: past any engine's newest batch, so only END comes back."""
PROBE_MAX_MESSAGE_BYTES: Final[int] = 1 << 16
"""Largest frame a replay probe reads (ZMQ drops a peer that sends more)."""
MAX_METRICS_BYTES: Final[int] = 16 * 2**20
"""Largest metrics page `fetch_metrics` reads (vLLM's is tens of KiB; a larger one is refused)."""


async def probe_replay(ctx: zmq.asyncio.Context, endpoint: str, *, timeout_s: float) -> tuple[bool, str]:
    """Ask a replay ROUTER for nothing and wait for its end marker.

    Args:
        ctx: the ZMQ context to make the DEALER in.
        endpoint: the rank's replay endpoint (``tcp://host:5558``).
        timeout_s: seconds to wait for the end marker (> 0).

    Returns:
        ``(True, "")`` when the end marker (or any well-formed reply) came, else ``(False, why)``.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # The answer is an end marker of a few bytes; a peer sending megabytes is not an engine's replay socket.
    sock.setsockopt(zmq.MAXMSGSIZE, PROBE_MAX_MESSAGE_BYTES)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        sock.connect(endpoint)
        await sock.send_multipart(wire.encode_replay_request(PROBE_SEQ))
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or not await sock.poll(timeout=remaining * 1000):
                return False, f"replay socket {endpoint} did not answer within {timeout_s:g} s"
            frames = await sock.recv_multipart()
            try:
                reply = wire.decode_replay_reply(frames)
            except WireError:
                continue  # not a reply to us; keep waiting until the deadline
            return True, "" if reply.is_end else "answered with a batch"
    except zmq.ZMQError as exc:
        return False, f"replay socket {endpoint}: {exc}"
    finally:
        sock.close(linger=0)


def _get(url: str, timeout_s: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        status: int = resp.status
        return status


async def probe_http(url: str, *, timeout_s: float) -> tuple[bool, str]:
    """GET ``url``; any HTTP answer below 500 counts as alive (the process is serving).

    Returns:
        ``(True, "")`` or ``(False, why)``.
    """
    try:
        status = await asyncio.wait_for(asyncio.to_thread(_get, url, timeout_s), timeout_s + 1.0)
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the response's socket
        if exc.code < 500:
            return True, ""
        return False, f"{url} answered HTTP {exc.code}"
    except (OSError, TimeoutError, ValueError) as exc:
        return False, f"{url}: {exc}"
    # Not an OSError: a port that does not speak HTTP, or an answer cut off.
    except http.client.HTTPException as exc:
        return False, f"{url}: not an HTTP answer ({exc!r})"
    return (True, "") if status < 500 else (False, f"{url} answered HTTP {status}")


async def fetch_metrics(url: str, timeout_s: float, *, max_bytes: int = MAX_METRICS_BYTES) -> str:
    """GET the engine's Prometheus page (``http://`` or ``https://``) and return its text, all of it within
    ``timeout_s`` seconds (connecting included) and ``max_bytes`` bytes; the connection is closed either way.

    Raises:
        OSError: connection or HTTP failure (an HTTP status of 400 or more, a page over ``max_bytes``); also
            `TimeoutError` when the whole page did not come within ``timeout_s``.
        http.client.HTTPException: an answer that is not HTTP, or one cut off.
    """
    try:
        return await asyncio.wait_for(_get_text(url, timeout_s, max_bytes), timeout_s)
    except TimeoutError:
        raise TimeoutError(f"{url}: the page did not come whole within {timeout_s} s") from None


async def _get_text(url: str, timeout_s: float, max_bytes: int) -> str:
    """One HTTP/1.1 GET of ``url`` read to its end (Content-Length, chunked, or until the server closes)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OSError(f"{url}: not an http(s) URL")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    reader, writer = await asyncio.open_connection(
        parts.hostname, port, ssl=ssl.create_default_context() if tls else None, limit=1 << 16
    )
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        writer.write(
            f"GET {target} HTTP/1.1\r\nHost: {host}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        status_line = await reader.readline()
        fields = status_line.split(None, 2)
        if len(fields) < 2 or not fields[0].startswith(b"HTTP/") or not fields[1].isdigit():
            raise http.client.BadStatusLine(status_line[:80].decode("latin-1"))
        status = int(fields[1])
        headers: dict[str, str] = {}
        for _ in range(100):
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        else:
            raise http.client.HTTPException(f"{url}: more than 100 header lines")
        if status >= 400:
            raise OSError(f"{url} answered HTTP {status}")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await _read_chunked(reader, url, max_bytes)
        elif "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError:
                raise http.client.HTTPException(f"{url}: bad Content-Length") from None
            if length > max_bytes:
                raise OSError(f"{url}: page over {max_bytes} bytes ({length})")
            try:
                body = await reader.readexactly(length)
            except asyncio.IncompleteReadError as exc:
                raise http.client.IncompleteRead(exc.partial, length - len(exc.partial)) from None
        else:
            body = await reader.read(max_bytes + 1)
            while len(body) <= max_bytes:
                more = await reader.read(max_bytes + 1 - len(body))
                if not more:
                    break
                body += more
            if len(body) > max_bytes:
                raise OSError(f"{url}: page over {max_bytes} bytes")
        return body.decode("utf-8", "replace")
    finally:
        writer.close()  # not awaited: a timeout's cancellation must not wait on the peer


async def _read_chunked(reader: asyncio.StreamReader, url: str, max_bytes: int) -> bytes:
    """A chunked HTTP body, at most ``max_bytes`` of it."""
    body = bytearray()
    while True:
        size_line = (await reader.readline()).split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise http.client.HTTPException(f"{url}: bad chunk size {size_line[:20]!r}") from None
        if size == 0:
            return bytes(body)
        if len(body) + size > max_bytes:
            raise OSError(f"{url}: page over {max_bytes} bytes")
        try:
            body += await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
        except asyncio.IncompleteReadError as exc:
            raise http.client.IncompleteRead(exc.partial) from None
