"""The RFC #1403 indexer API over HTTP (``--http-port``): a small HTTP/1.1 server on asyncio's own transport,
answering from the router's local index replica (`kvmesh.router.http_api`) and running `/register`'s ingests
(`kvmesh.router.http_ingests`).

Endpoints: ``POST /query``, ``POST /query_by_hash``, ``POST /register``, ``POST /unregister``, ``GET
/workers``, ``GET /dump``, ``GET /health``, ``GET /metrics``. Requests are HTTP/1.1 (or 1.0) with a
``Content-Length`` body (no chunked bodies: 411), kept alive unless the client says ``Connection: close``;
bodies are limited to ``max_body_bytes`` (413). A bad request gets its error reply and the connection (and
the router) keeps serving.

No HTTP library: the API is eight fixed routes with JSON bodies, and a parser on `asyncio.Protocol` answers
a short ``/query`` in tens of microseconds, which a framework would multiply (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Final, cast

import msgspec

from kvmesh.core.state import IndexState
from kvmesh.router.http_api import ApiError, RegisterBody, UnregisterBody, answer_query, decode_body
from kvmesh.router.http_ingests import Registrations

__all__ = ["DEFAULT_MAX_BODY_BYTES", "HttpApi", "serve_http"]

log = logging.getLogger("kvmesh.router")

DEFAULT_MAX_BODY_BYTES: Final[int] = 64 * 2**20
_REASONS: Final[dict[int, str]] = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
    413: "Payload Too Large", 422: "Unprocessable Entity", 500: "Internal Server Error",
    503: "Service Unavailable",
}  # fmt: skip
_ROUTES: Final[dict[str, str]] = {
    "/query": "POST", "/query_by_hash": "POST", "/register": "POST", "/unregister": "POST",
    "/workers": "GET", "/dump": "GET", "/health": "GET", "/metrics": "GET",
}  # fmt: skip
_ASYNC: Final[frozenset[str]] = frozenset({"/register", "/unregister"})
_JSON: Final[bytes] = b"application/json"
_encode = msgspec.json.Encoder().encode


class HttpApi:
    """The API's handlers over one router's index.

    Args:
        state: returns the router's index replica's state (None while it is not open).
        registrations: `/register`'s ingests.
        ready: whether the replica has caught up (`/health`, and the queries answer 503 before).
    """

    def __init__(
        self,
        state: Callable[[], IndexState | None],
        registrations: Registrations,
        ready: Callable[[], bool],
    ) -> None:
        self._state = state
        self.registrations = registrations
        self._ready = ready
        self.requests: Counter[tuple[str, int]] = Counter()
        """(path, status) → requests answered."""
        self.seconds: dict[str, float] = {}
        """path → seconds spent answering."""

    def respond(self, method: str, path: str, body: bytes) -> tuple[int, bytes, bytes] | None:
        """Answer one request at once: ``(status, content type, body)``; None for `/register` and
        `/unregister`, which `arespond` answers."""
        path = path.split("?", 1)[0]
        want = _ROUTES.get(path)
        if want is not None and method == want and path in _ASYNC:
            return None
        t0 = time.perf_counter()
        if want is None:
            status, ctype, out = 404, _JSON, _encode({"error": f"no such endpoint: {path[:200]}"})
            path = "other"
        elif method != want:
            status, ctype, out = 405, _JSON, _encode({"error": f"{path} takes {want}, not {method[:16]}"})
        else:
            try:
                status, ctype, out = 200, _JSON, self._answer(path, body)
                if path == "/metrics":
                    ctype = b"text/plain; version=0.0.4"
            except ApiError as exc:
                status, ctype, out = exc.status, _JSON, _encode({"error": exc.message})
            except Exception as exc:  # a bug answers 500 and never stops the router
                log.exception("http: %s failed", path)
                status, ctype, out = 500, _JSON, _encode({"error": f"internal error: {type(exc).__name__}"})
        self.requests[(path, status)] += 1
        self.seconds[path] = self.seconds.get(path, 0.0) + time.perf_counter() - t0
        return status, ctype, out

    async def arespond(self, path: str, body: bytes) -> tuple[int, bytes, bytes]:
        """Answer a `/register` or `/unregister` (``path``)."""
        t0 = time.perf_counter()
        path = path.split("?", 1)[0]
        try:
            if path == "/register":
                reply = await self.registrations.register(decode_body(body, RegisterBody))
            else:
                reply = await self.registrations.unregister(decode_body(body, UnregisterBody))
            status, out = 200, _encode(reply)
        except ApiError as exc:
            status, out = exc.status, _encode({"error": exc.message})
        except Exception as exc:  # a bug answers 500 and never stops the router
            log.exception("http: %s failed", path)
            status, out = 500, _encode({"error": f"internal error: {type(exc).__name__}"})
        self.requests[(path, status)] += 1
        self.seconds[path] = self.seconds.get(path, 0.0) + time.perf_counter() - t0
        return status, _JSON, out

    def _answer(self, path: str, body: bytes) -> bytes:
        if path in {"/query", "/query_by_hash"}:
            return _encode(
                answer_query(
                    self._live(), body, by_hash=path == "/query_by_hash", tenants=self.registrations.tenants()
                )
            )
        if path == "/workers":
            return _encode(self._workers())
        if path == "/dump":
            return _encode(_dump(self._live(), self.registrations.tenants()))
        if path == "/health":
            state = self._state()
            if state is None or not self._ready():
                raise ApiError(503, "the index replica is starting")
            return _encode({"status": "ok", "index_seq": state.applied_seq})
        return self._metrics().encode()

    def _live(self) -> IndexState:
        state = self._state()
        if state is None or not self._ready():
            raise ApiError(503, "the index replica is starting")
        return state

    def _workers(self) -> list[dict[str, Any]]:
        """Registered publishers, then every other (instance, model) the index holds."""
        out = [r.view() for r in sorted(self.registrations.by_key.values(), key=lambda r: r.key)]
        registered = {(r.instance_id, r.dp_rank) for r in self.registrations.by_key.values()}
        state = self._state()
        if state is None:
            return out
        fleet: dict[tuple[str, str], list[int]] = {}
        for model, worker, rank in state.live_holders():
            if (worker, rank) not in registered:
                fleet.setdefault((worker, model), []).append(rank)
        info = state.workers()
        for (worker, model), ranks in sorted(fleet.items()):
            out.append(
                {
                    "instance_id": worker,
                    "tenant_id": "default",
                    "model_name": model,
                    "block_size": info.get(worker, {}).get("block_size"),
                    "dp_ranks": ranks,
                    "source": "fleet",
                    "status": "active",
                }
            )
        return out

    def _metrics(self) -> str:
        lines = [
            "# HELP kvmesh_router_http_requests_total RFC #1403 API requests answered",
            "# TYPE kvmesh_router_http_requests_total counter",
        ]
        for (path, status), n in sorted(self.requests.items()):
            lines.append(f'kvmesh_router_http_requests_total{{endpoint="{path}",status="{status}"}} {n}')
        lines += [
            "# HELP kvmesh_router_http_request_seconds_total seconds spent answering RFC #1403 API requests",
            "# TYPE kvmesh_router_http_request_seconds_total counter",
        ]
        for path, s in sorted(self.seconds.items()):
            lines.append(f'kvmesh_router_http_request_seconds_total{{endpoint="{path}"}} {s:.6f}')
        state = self._state()
        lines += [
            "# HELP kvmesh_router_http_registrations publishers registered through /register",
            "# TYPE kvmesh_router_http_registrations gauge",
            f"kvmesh_router_http_registrations {len(self.registrations.by_key)}",
            "# HELP kvmesh_router_http_index_seq stream sequence the router's index replica has applied",
            "# TYPE kvmesh_router_http_index_seq gauge",
            f"kvmesh_router_http_index_seq {state.applied_seq if state is not None else 0}",
        ]
        return "\n".join(lines) + "\n"


def _dump(state: IndexState, tenants: dict[str, str]) -> dict[str, Any]:
    """Every indexed block: ``{"<model>:<block size>": {"model_name", "block_size", "instances": {instance:
    {"tenant_id", "dp": {rank: {tier: [sequence hash, ...]}}}}}}``, hashes sorted."""
    out: dict[str, Any] = {}
    for model, bs, index in state.export().indexes:
        instances: dict[str, Any] = {}
        for h in index.holders:
            ranks = instances.setdefault(
                h.holder.worker_id, {"tenant_id": tenants.get(h.holder.worker_id, "default"), "dp": {}}
            )["dp"]
            tiers = {"GPU": sorted(h.prefixes.tolist())} if len(h.prefixes) else {}
            for t in h.tiers:
                tiers[t.medium] = sorted(t.prefixes.tolist())
            ranks[str(h.holder.dp_rank)] = tiers
        out[f"{model}:{bs}"] = {"model_name": model, "block_size": bs, "instances": instances}
    return out


_RECV_BYTES: Final[int] = 65536
"""Bytes one read of a connection takes at most (its receive buffer, allocated once per connection)."""


class _Connection(asyncio.BufferedProtocol):
    """One client connection: requests parsed as they arrive, answered in order.

    A `asyncio.BufferedProtocol`: the transport reads into this connection's own buffer. A plain
    `asyncio.Protocol` is handed a new ``bytes`` per read, which asyncio allocates at 256 KiB and shrinks: about
    45 µs per request on this API's short queries (docs/benchmarks.md, section 8), a fifth of a whole answer.
    """

    def __init__(self, api: HttpApi, limit: int) -> None:
        self._api = api
        self._limit = limit
        self._buf = bytearray()
        self._recv = memoryview(bytearray(_RECV_BYTES))
        self._transport: asyncio.Transport | None = None
        self._busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast("asyncio.Transport", transport)  # a stream transport (uvloop's is no subclass)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._recv

    def buffer_updated(self, nbytes: int) -> None:
        self._buf += self._recv[:nbytes]
        if not self._busy:
            self._next()

    def _next(self) -> None:
        while self._transport is not None:
            buf = self._buf
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    self._reply(431, b"request header too large", close=True)
                return
            head = bytes(buf[:end]).decode("latin-1")
            lines = head.split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                self._reply(400, b"malformed request line", close=True)
                return
            method, path, version = parts
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self._reply(411, b"send the body with Content-Length", close=True)
                return
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                self._reply(400, b"bad Content-Length", close=True)
                return
            if length < 0 or length > self._limit:
                self._reply(413, f"body over {self._limit} bytes".encode(), close=True)
                return
            start = end + 4
            if len(buf) < start + length:
                return
            body = bytes(buf[start : start + length])
            del buf[: start + length]
            conn = headers.get("connection", "").lower()
            close = conn == "close" or (version == "HTTP/1.0" and conn != "keep-alive")
            answer = self._api.respond(method, path, body)
            if answer is not None:
                self._send(*answer, close=close)
                continue
            self._busy = True
            fut = asyncio.ensure_future(self._api.arespond(path, body))
            fut.add_done_callback(functools.partial(self._done, close=close))
            return

    def _done(self, fut: asyncio.Future[tuple[int, bytes, bytes]], *, close: bool) -> None:
        self._busy = False
        if fut.cancelled() or self._transport is None:
            return
        exc = fut.exception()
        if exc is not None:
            status, ctype, body = 500, _JSON, _encode({"error": "internal error"})
        else:
            status, ctype, body = fut.result()
        self._send(status, ctype, body, close=close)
        if not close:
            self._next()

    def _reply(self, status: int, message: bytes, *, close: bool) -> None:
        self._send(status, _JSON, _encode({"error": message.decode()}), close=close)

    def _send(self, status: int, ctype: bytes, body: bytes, *, close: bool) -> None:
        t = self._transport
        if t is None:
            return
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: ".encode()
            + ctype
            + f"\r\nContent-Length: {len(body)}\r\n".encode()
            + (b"Connection: close\r\n\r\n" if close else b"\r\n")
        )
        t.write(head + body)
        if close:
            t.close()
            self._transport = None


async def serve_http(
    api: HttpApi, host: str, port: int, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> asyncio.Server:
    """Listen for the API on ``host:port`` (0: a free port; `asyncio.Server.sockets` names it)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Connection(api, max_body_bytes), host, port)
