"""Async Python client of the route API (``kvmesh.route`` over NATS request-reply).

    RouteError (KvmeshError)         the router answered with an error reply
    ├── BadRequestError              code "bad_request" (``field`` names the culprit when known)
    ├── UnknownModelError            code "unknown_model"
    ├── NoWorkersError               code "no_workers"
    ├── UnavailableError             code "unavailable", or no router answered in time
    └── InternalError                code "internal"

    ConnectError (TransportError)    `Router.connect` could not connect (``reason`` says why)
    ├── BadURLError                  not a nats://, tls://, ws:// or wss:// URL (also ValueError)
    ├── UnknownHostError             the host name does not resolve
    ├── ConnectRefusedError          nothing listens on the port
    ├── ConnectTimeoutError          no answer within the connect timeout
    ├── NotNatsServerError           not a NATS client port (for example the monitoring port, 8222)
    ├── AuthorizationError           the server refused the credentials
    └── TLSError                     tls:// and the server offers no TLS, or the handshake failed

Error messages name the server with its credentials redacted (``nats://***@host:4222``).

Example::

    async with await Router.connect("nats://127.0.0.1:4222") as router:
        reply = await router.route("my-model", [1, 2, 3], request_id="r-1")
        print(reply.worker_id, reply.cached_tokens, reply.available_tokens)
        ...  # send the request to reply.worker_id
        await router.mark_prefill_done("r-1")  # first token out: its prompt no longer loads the worker
        # done: its KV blocks no longer count; the engine's cached prompt tokens (vLLM's
        # usage.prompt_tokens_details.cached_tokens) are the route's delivered reuse
        await router.finish("r-1", cached_tokens=usage.prompt_tokens_details.cached_tokens)

Load accounting: a route with a ``request_id`` counts on the chosen worker in every router replica (active
prefill tokens until `Router.mark_prefill_done`, active blocks until `Router.finish`, or until the routers'
request TTL, 300 s by default). Call both (or at least ``finish``) for every routed request.

Route receipts: each reply carries ``cached_tokens`` (what the router's choice *captured*) and
``available_tokens`` (the most any live candidate had cached); passing the engine's own count of cached
prompt tokens to `Router.finish` lets the router that answered count what was *delivered*, per worker, in
its stats (``kvmesh status``) and metrics.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client

from kvmesh.core.errors import (
    BadRequestError,
    InternalError,
    NoWorkersError,
    ProtocolError,
    RouteError,
    UnavailableError,
    UnknownModelError,
)
from kvmesh.core.protocol import PolicyOverride, RequestRef, RouteReply, RouteRequest, decode_answer, encode
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import (
    AuthorizationError,
    BadURLError,
    ConnectError,
    ConnectRefusedError,
    ConnectTimeoutError,
    NatsAuth,
    NotNatsServerError,
    TLSError,
    TransportError,
    UnknownHostError,
    connect,
    connect_options,
)
from kvmesh.runtime.tracing import context_headers

__all__ = [
    "AuthorizationError",
    "BadRequestError",
    "BadURLError",
    "ConnectError",
    "ConnectRefusedError",
    "ConnectTimeoutError",
    "InternalError",
    "NatsAuth",
    "NoWorkersError",
    "NotNatsServerError",
    "RouteError",
    "RouteReply",
    "Router",
    "TLSError",
    "TransportError",
    "UnavailableError",
    "UnknownHostError",
    "UnknownModelError",
]


def reply_from_json(data: bytes) -> RouteReply:
    """Turn a route reply body into a `RouteReply`, or raise the `RouteError` it carries.

    Raises:
        RouteError: the subclass for the reply's error code (`InternalError` for a code unknown here).
        InternalError: the reply is not a route reply at all (a `ProtocolError` underneath).
    """
    try:
        return decode_answer(data, RouteReply)
    except ProtocolError as exc:
        raise InternalError(f"router reply does not decode: {exc}") from exc


class Router:
    """Client of ``kvmesh.route`` on an existing NATS connection.

    Args:
        nc: a connected nats-py client.
        subject: the route subject.
        timeout_s: seconds to wait for a reply before raising `UnavailableError`.
    """

    def __init__(
        self,
        nc: Client,
        *,
        subject: str = subjects.ROUTE_SUBJECT,
        timeout_s: float = 2.0,
        requests_prefix: str = subjects.REQUESTS_PREFIX,
    ) -> None:
        self._nc = nc
        self._subject = subject
        self._timeout_s = timeout_s
        self._requests_prefix = requests_prefix
        self._owns = False

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        connect_timeout_s: float = 5.0,
        name: str = "kvmesh-client",
        tls: ssl.SSLContext | None = None,
        auth: NatsAuth | None = None,
        **kwargs: Any,
    ) -> Router:
        """Connect to NATS and return a client that closes the connection on `aclose`.

        Args:
            url: a NATS URL or a comma-separated list (``nats://a:4222,nats://b:4222``); ``tls://`` requires
                TLS; credentials may be in the URL (``nats://user:pass@host:4222``).
            connect_timeout_s: give up connecting after this many seconds in all (the call returns or
                raises within about this bound; it prints nothing).
            name: connection name shown by the server.
            tls: TLS context (a private CA, client certificates); the default verifies against the system CAs.
                It replaces the context ``auth``'s TLS files would make.
            auth: NATS credentials and TLS files (``NatsAuth(nats_user=..., nats_password=...)``,
                ``nats_token``, ``nats_nkey_seed_file``, ``nats_creds_file``, ``nats_tls_ca_file``,
                ``nats_tls_cert_file``, ``nats_tls_key_file``, ``nats_tls_server_name``); secrets never
                appear in its errors.
            **kwargs: `Router` options (``subject``, ``timeout_s`` — the per-request reply timeout, ...).

        Raises:
            ConnectError: the subclass naming why (`ConnectRefusedError`, `UnknownHostError`,
                `BadURLError`, `NotNatsServerError`, `AuthorizationError`, `TLSError`,
                `ConnectTimeoutError`); the message names the server without credentials.
        """
        options = {} if auth is None else connect_options(auth)
        if tls is not None:
            options["tls"] = tls
        nc = await connect(url, name=name, wait_s=connect_timeout_s, **options)
        router = cls(nc, **kwargs)
        router._owns = True
        return router

    async def route(
        self,
        model: str,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        candidates: Sequence[str] | None = None,
        request_id: str | None = None,
        explain: bool = False,
        policy: Mapping[str, Any] | None = None,
    ) -> RouteReply:
        """Ask which worker should serve a prompt.

        Args:
            model: the model name as the workers registered it.
            token_ids: the prompt's token ids.
            lora_name: the LoRA adapter, or None for the base model.
            cache_salt: the tenant salt as the engine receives it.
            candidates: restrict the choice to these worker ids.
            request_id: ties the request to load accounting (see `finish`); also seeds tie-breaking.
            explain: ask for every candidate's score in `RouteReply.scores`.
            policy: per-request overrides of the cost terms (``overlap_weight``, ``decode_weight``,
                ``temperature``, ``tier_weights``, ``busy_kv_usage``, ``busy_waiting``).

        Raises:
            RouteError: the subclass for the reply's error code; `UnavailableError` also when no router
                answered within the timeout.
        """
        try:
            overrides = None if policy is None else msgspec.convert(dict(policy), PolicyOverride)
        except msgspec.ValidationError as exc:
            raise BadRequestError(f"invalid policy: {exc}") from exc
        body = RouteRequest(
            model=model,
            token_ids=list(token_ids),
            lora_name=lora_name,
            cache_salt=cache_salt,
            candidates=list(candidates) if candidates is not None else None,
            request_id=request_id,
            explain=explain,
            policy=overrides,
        )
        return reply_from_json(await self.request_raw(encode(body)))

    async def request_raw(self, body: bytes) -> bytes:
        """Send a raw route request body and return the raw reply body.

        When a span is active in the caller's context (OpenTelemetry), its W3C trace context goes along in the
        request's ``traceparent`` and ``tracestate`` headers, and the router's span of the route is its child.

        Raises:
            UnavailableError: no router answered within the timeout.
            BadRequestError: the request is larger than the NATS server's max payload (nothing was sent).
        """
        try:
            msg = await self._nc.request(
                self._subject, body, timeout=self._timeout_s, headers=context_headers()
            )
        except nats.errors.MaxPayloadError as exc:
            raise BadRequestError(
                f"request of {len(body)} bytes exceeds the NATS server's max payload of "
                f"{self._nc.max_payload} bytes (a shorter prompt, or a larger max_payload on the server)"
            ) from exc
        except nats.errors.NoRespondersError as exc:
            raise UnavailableError("no router is serving " + self._subject) from exc
        except nats.errors.TimeoutError as exc:
            raise UnavailableError(f"no router answered within {self._timeout_s:g} s") from exc
        return bytes(msg.data)

    async def mark_prefill_done(self, request_id: str) -> None:
        """Tell every router that ``request_id``'s prompt is computed (its prefill tokens stop counting)."""
        await self._lifecycle("prefill_done", request_id)

    async def finish(self, request_id: str, *, cached_tokens: int | None = None) -> None:
        """Tell every router that ``request_id`` is over (its KV blocks stop counting).

        Args:
            request_id: the id the request was routed with.
            cached_tokens: the engine's own count of the request's prompt tokens served from its prefix cache
                (vLLM's and SGLang's ``usage.prompt_tokens_details.cached_tokens``), ≥ 0; the router that
                answered the route counts it as the worker's delivered tokens. None (default): not known,
                nothing is counted delivered.

        Raises:
            ValueError: ``cached_tokens`` is not an int ≥ 0 (nothing was sent).
            UnavailableError: the note could not be published.
        """
        if cached_tokens is not None and (
            isinstance(cached_tokens, bool) or not isinstance(cached_tokens, int) or cached_tokens < 0
        ):
            raise ValueError(f"cached_tokens must be an int >= 0, got {cached_tokens!r}")
        await self._lifecycle("finished", request_id, cached_tokens)

    async def _lifecycle(self, event: str, request_id: str, cached_tokens: int | None = None) -> None:
        try:
            await self._nc.publish(
                subjects.requests_subject(self._requests_prefix, event),
                encode(RequestRef(request_id=request_id, cached_tokens=cached_tokens)),
            )
        except nats.errors.Error as exc:
            raise UnavailableError(f"cannot publish {event} for {request_id!r}: {exc}") from exc

    async def aclose(self) -> None:
        """Close the NATS connection if this client opened it."""
        if self._owns:
            await self._nc.drain()

    async def __aenter__(self) -> Router:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
