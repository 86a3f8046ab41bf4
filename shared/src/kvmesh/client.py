"""Async Python client of the route API (``kvmesh.route`` over NATS request-reply).

    RouteError (KvmeshError)         the router answered with an error reply
    ├── BadRequestError              code "bad_request" (``field`` names the culprit when known)
    ├── UnknownModelError            code "unknown_model"
    ├── NoWorkersError               code "no_workers"
    │   └── ContextLengthExceededError code "context_length_exceeded": the prompt is longer than every
    │                                  worker's context length
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

Request forms: `Router.route` sends the token ids packed as little-endian uint32 (``Kvmesh-Body:
tokens-u32le``, the other fields in the ``Kvmesh-Route`` header; `kvmesh.core.protocol`), which spares the
router the JSON token list; `Router.route_by_hash` sends Dynamo-compatible local block hashes
(``hashes-u64le``), which spares it the hashing too. Prompts shorter than `BINARY_MIN_BYTES` packed go as
JSON (as cheap to parse as the headers; no headers at all outside a trace). A router older than these forms refuses a binary body
as "not valid JSON": the client then resends that request as JSON and keeps to JSON for `JSON_RETRY_S`
seconds before trying the binary form again (so a fleet of mixed versions is served, and an upgraded one
gets the fast form back). ``form="json"`` keeps to JSON always.

Route receipts: each reply carries ``cached_tokens`` (what the router's choice *captured*) and
``available_tokens`` (the most any live candidate had cached); passing the engine's own count of cached
prompt tokens to `Router.finish` lets the router that answered count what was *delivered*, per worker, in
its stats (``kvmesh status``) and metrics.
"""

from __future__ import annotations

import math
import ssl
import time
from array import array
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Literal

import msgspec
import nats.errors
from nats.aio.client import Client

from kvmesh.core.errors import (
    BadRequestError,
    ContextLengthExceededError,
    InternalError,
    NoWorkersError,
    ProtocolError,
    RequestError,
    RouteError,
    UnavailableError,
    UnknownModelError,
)
from kvmesh.core.hashing import pack_tokens
from kvmesh.core.protocol import (
    BODY_HASHES_U64LE,
    BODY_HEADER,
    BODY_SEQHASHES_U64LE,
    BODY_TOKENS_U32LE,
    FIELDS_HEADER,
    MAX_BLOCK_HASH,
    PolicyOverride,
    RequestRef,
    RouteReply,
    RouteRequest,
    decode_answer,
    encode,
)
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
    "ContextLengthExceededError",
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


BINARY_MIN_BYTES: Final[int] = 512
"""Smallest packed body (128 tokens, 64 hashes) sent in a binary form: below it the JSON body costs the
router no more to parse than the two headers of a binary one (a few µs each way, measured)."""

_HEADER_ROOM: Final[int] = 4096
"""Bytes of a binary request's payload left for its headers (the ``Kvmesh-Route`` fields, trace context)."""

JSON_RETRY_S: Final[float] = 60.0
"""Seconds a `Router` keeps to JSON after a router refused a binary body (one older than the forms)."""

_OLD_ROUTER_REFUSALS: Final[tuple[str, ...]] = (
    "request body is not valid JSON",
    "invalid request: Expected `object`",
)
"""How a router that reads only JSON answers a binary body (a packed body that happens to be a JSON
scalar: the second)."""


def _refused_form(data: bytes, name: str) -> RouteReply:
    """The route reply in ``data``; an older router's refusal of pre-hashed ids (``name``) said plainly.

    Raises:
        BadRequestError: the router does not read ``name`` (it asked for token ids, or did not know the packed
            form), or refused the request.
        RouteError: the subclass for the reply's error code.
    """
    try:
        return reply_from_json(data)
    except BadRequestError as exc:
        older = (
            "missing required field `token_ids`" in exc.message
            or exc.message.startswith("token_ids must not be empty")
            or (name == "seq_hashes" and f"unknown {BODY_HEADER}" in exc.message)
        )
        if older:
            raise BadRequestError(
                f"the router does not read pre-hashed requests by {name}: it is older than kvmesh's route "
                "request forms that carry them; route with token ids"
                + (" or block_hashes" if name == "seq_hashes" else "")
            ) from exc
        raise


def _pack_hashes(block_hashes: Sequence[int]) -> bytes:
    """Pack local block hashes (or sequence hashes) as little-endian uint64.

    Raises:
        BadRequestError: a hash is not an int in ``[0, 2**64)``.
    """
    try:
        packed = array("Q", block_hashes)
    except (OverflowError, TypeError) as exc:
        raise BadRequestError(f"block hashes must be integers in [0, 2^64): {exc}") from exc
    if packed.itemsize != 8:  # pragma: no cover - no supported platform has another width
        raise RuntimeError("array('Q') is not 64-bit here")
    if not _LITTLE_ENDIAN:  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


_LITTLE_ENDIAN: Final[bool] = array("H", [1]).tobytes() == b"\x01\x00"


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
        form: ``"auto"`` (default): binary bodies from `BINARY_MIN_BYTES`, JSON for `JSON_RETRY_S` after a
            router refused one;
            ``"json"``: JSON bodies only (a fleet known to be older than the binary forms).
    """

    def __init__(
        self,
        nc: Client,
        *,
        subject: str = subjects.ROUTE_SUBJECT,
        timeout_s: float = 2.0,
        requests_prefix: str = subjects.REQUESTS_PREFIX,
        form: Literal["auto", "json"] = "auto",
    ) -> None:
        if form not in ("auto", "json"):
            raise ValueError(f"form must be 'auto' or 'json', got {form!r}")
        self._nc = nc
        self._subject = subject
        self._timeout_s = timeout_s
        self._requests_prefix = requests_prefix
        self._owns = False
        self._form = form
        self._json_until = 0.0
        """Monotonic time until which requests go as JSON (a router refused a binary body)."""
        self.fallbacks = 0
        """Binary requests a router refused and that were resent as JSON."""

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
        session_id: str | None = None,
        explain: bool = False,
        policy: Mapping[str, Any] | None = None,
    ) -> RouteReply:
        """Ask which worker should serve a prompt.

        The ids go packed (``tokens-u32le``) from 128 tokens on, unless the router reads only JSON (see the
        module docstring).

        Args:
            model: the model name as the workers registered it.
            token_ids: the prompt's token ids, each in ``[0, 2**32)`` (a list, or an ``array('I')``: packed
                without a per-token pass).
            lora_name: the LoRA adapter, or None for the base model.
            cache_salt: the tenant salt as the engine receives it.
            candidates: restrict the choice to these worker ids.
            request_id: ties the request to load accounting (see `finish`); also seeds tie-breaking.
            session_id: session affinity (1 – 256 characters: a conversation, an agent run): the request
                stays on the (worker, dp rank) of the session's last route while that costs at most
                ``session_slack`` × the prompt's blocks more than the best (`RouteReply.session` says
                ``new``, ``kept`` or ``moved``); every router replica knows the session.
            explain: ask for every candidate's score in `RouteReply.scores`.
            policy: per-request overrides of the cost terms (``overlap_weight``, ``decode_weight``,
                ``temperature``, ``tier_weights``, ``busy_kv_usage``, ``busy_waiting``,
                ``session_slack``).

        Raises:
            BadRequestError: also before sending, for a token id outside ``[0, 2**32)`` or an invalid
                ``policy``.
            RouteError: the subclass for the reply's error code; `UnavailableError` also when no router
                answered within the timeout.
        """
        fields = self._fields(
            model,
            lora_name=lora_name,
            cache_salt=cache_salt,
            candidates=candidates,
            request_id=request_id,
            session_id=session_id,
            explain=explain,
            policy=policy,
        )
        # Packed unless too small to gain, or too large for the server where JSON of small ids may still fit.
        packed_size = 4 * len(token_ids)
        if BINARY_MIN_BYTES <= packed_size <= self._nc.max_payload - _HEADER_ROOM and self._binary():
            try:
                packed = pack_tokens(token_ids)
            except RequestError as exc:
                raise BadRequestError(str(exc)) from exc
            data = await self._binary_request(packed, BODY_TOKENS_U32LE, fields)
            if data is not None:
                return reply_from_json(data)
        body = msgspec.structs.replace(fields, token_ids=list(token_ids))
        return reply_from_json(await self.request_raw(encode(body)))

    async def route_by_hash(
        self,
        model: str,
        block_hashes: Sequence[int] | None = None,
        *,
        seq_hashes: Sequence[int] | None = None,
        block_size: int | None = None,
        prompt_tokens: int | None = None,
        candidates: Sequence[str] | None = None,
        request_id: str | None = None,
        session_id: str | None = None,
        explain: bool = False,
        policy: Mapping[str, Any] | None = None,
    ) -> RouteReply:
        """Ask which worker should serve a prompt given as its local block hashes or its sequence hashes (a
        gateway that hashes).

        The reply is the one `route` gives for the tokens the hashes came from. The hashes go packed
        (``hashes-u64le``, ``seqhashes-u64le``) unless the router reads only JSON; the router needs a local
        index (``--index local``, the default).

        Args:
            model: the model name as the workers registered it.
            block_hashes: the local hash of every full block of the prompt, block 0 first: Dynamo's
                ``LocalBlockHash`` (`kvmesh.core.hashing.local_block_hashes`: XXH3-64, seed 1337, of each
                block's token ids as little-endian uint32), each in ``[0, 2**64)``. A LoRA adapter or a
                cache salt is already mixed in by the caller (`kvmesh.core.hashing.local_block_hashes`'s
                ``lora_name`` and ``cache_salt``), so neither is passed here.
            seq_hashes: instead of ``block_hashes``: the sequence hash of every full block, block 0 first
                (`kvmesh.core.hashing.sequence_hashes` of the local hashes: ``seq[0] = local[0]``,
                ``seq[i] = XXH3-64(le64(seq[i-1]) ‖ le64(local[i]), seed 1337)``; Dynamo's
                ``SequenceHash``, RFC #1527's ``seq_hashes``), each in ``[0, 2**64)``.
            block_size: tokens per block of the hashes (None: the model's block size in the index).
            prompt_tokens: the prompt's length in tokens, a trailing partial block included (load
                accounting; None: the hashes' count × block size).
            candidates, request_id, session_id, explain, policy: as for `route`.

        Raises:
            BadRequestError: both or neither of ``block_hashes`` and ``seq_hashes``, a hash outside
                ``[0, 2**64)`` (before sending), the router refused the request, or the router is older than
                pre-hashed requests (sequence hashes: than ``seq_hashes``).
            RouteError: the subclass for the reply's error code; `UnavailableError` also when no router
                answered within the timeout.
        """
        fields = self._fields(
            model,
            candidates=candidates,
            request_id=request_id,
            session_id=session_id,
            explain=explain,
            policy=policy,
            block_size=block_size,
            prompt_tokens=prompt_tokens,
        )
        if (block_hashes is None) == (seq_hashes is None):
            raise BadRequestError("route_by_hash takes block_hashes or seq_hashes, exactly one of them")
        given = block_hashes if seq_hashes is None else seq_hashes
        assert given is not None
        name, form = (
            ("block_hashes", BODY_HASHES_U64LE)
            if seq_hashes is None
            else ("seq_hashes", BODY_SEQHASHES_U64LE)
        )
        if 8 * len(given) >= BINARY_MIN_BYTES and self._binary():
            data = await self._binary_request(_pack_hashes(given), form, fields)
            if data is not None:
                return _refused_form(data, name)
        hashes = list(given)
        if any(not isinstance(h, int) or not 0 <= h <= MAX_BLOCK_HASH for h in hashes):
            _pack_hashes(hashes)  # raises the error naming the hash
        body = msgspec.structs.replace(fields, **{name: hashes})
        return _refused_form(await self.request_raw(encode(body)), name)

    def _fields(
        self,
        model: str,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        candidates: Sequence[str] | None,
        request_id: str | None,
        explain: bool,
        policy: Mapping[str, Any] | None,
        session_id: str | None = None,
        block_size: int | None = None,
        prompt_tokens: int | None = None,
    ) -> RouteRequest:
        """The request without its ids (the ``Kvmesh-Route`` header of a binary request)."""
        try:
            overrides = None if policy is None else msgspec.convert(dict(policy), PolicyOverride)
        except msgspec.ValidationError as exc:
            raise BadRequestError(f"invalid policy: {exc}") from exc
        return RouteRequest(
            model=model,
            lora_name=lora_name,
            cache_salt=cache_salt,
            candidates=list(candidates) if candidates is not None else None,
            request_id=request_id,
            session_id=session_id,
            explain=explain,
            policy=overrides,
            block_size=block_size,
            prompt_tokens=prompt_tokens,
        )

    def _binary(self) -> bool:
        """Whether this request goes in a binary form."""
        return self._form == "auto" and time.monotonic() >= self._json_until

    async def _binary_request(self, packed: bytes, form: str, fields: RouteRequest) -> bytes | None:
        """Send a binary route request; return the reply body, or None when the router reads only JSON
        (then JSON is used for `JSON_RETRY_S`)."""
        headers = {BODY_HEADER: form, FIELDS_HEADER: encode(fields).decode()}
        data = await self.request_raw(packed, headers=headers)
        if data.startswith(b'{"error"') and data.find(b'"bad_request"', 0, 64) >= 0:
            try:
                reply_from_json(data)
            except BadRequestError as exc:
                if exc.message.startswith(_OLD_ROUTER_REFUSALS):
                    self._json_until = time.monotonic() + JSON_RETRY_S
                    self.fallbacks += 1
                    return None
            except RouteError:
                pass
        return data

    async def request_raw(self, body: bytes, *, headers: Mapping[str, str] | None = None) -> bytes:
        """Send a raw route request body (with ``headers``: e.g. a binary form's) and return the raw reply body.

        When a span is active in the caller's context (OpenTelemetry), its W3C trace context goes along in the
        request's ``traceparent`` and ``tracestate`` headers, and the router's span of the route is its child.

        Raises:
            UnavailableError: no router answered within the timeout.
            BadRequestError: the request is larger than the NATS server's max payload (nothing was sent).
        """
        try:
            msg = await self._nc.request(
                self._subject,
                body,
                timeout=self._timeout_s,
                headers=context_headers(dict(headers) if headers is not None else None),
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

    async def mark_prefill_done(self, request_id: str, *, at: float | None = None) -> None:
        """Tell every router that ``request_id``'s prompt is computed (its prefill tokens stop counting).

        Args:
            request_id: the id the request was routed with.
            at: when the first token was out, seconds since the epoch (``time.time()`` then); None (default):
                the routers date the note by its receipt. Give it when notes may wait on their way (a
                batching gateway): the routers learn each worker's prefill rate from these times.

        Raises:
            ValueError: ``at`` is not a finite number (nothing was sent).
            UnavailableError: the note could not be published.
        """
        await self._lifecycle("prefill_done", request_id, at=_checked_at(at))

    async def finish(
        self, request_id: str, *, cached_tokens: int | None = None, at: float | None = None
    ) -> None:
        """Tell every router that ``request_id`` is over (its KV blocks stop counting).

        Args:
            request_id: the id the request was routed with.
            cached_tokens: the engine's own count of the request's prompt tokens served from its prefix cache
                (vLLM's and SGLang's ``usage.prompt_tokens_details.cached_tokens``), ≥ 0; the router that
                answered the route counts it as the worker's delivered tokens. None (default): not known,
                nothing is counted delivered.
            at: when the last token was out, seconds since the epoch; None (default): the note's receipt.

        Raises:
            ValueError: ``cached_tokens`` is not an int ≥ 0 or ``at`` not a finite number (nothing was sent).
            UnavailableError: the note could not be published.
        """
        if cached_tokens is not None and (
            isinstance(cached_tokens, bool) or not isinstance(cached_tokens, int) or cached_tokens < 0
        ):
            raise ValueError(f"cached_tokens must be an int >= 0, got {cached_tokens!r}")
        await self._lifecycle("finished", request_id, cached_tokens, at=_checked_at(at))

    async def _lifecycle(
        self, event: str, request_id: str, cached_tokens: int | None = None, *, at: float | None = None
    ) -> None:
        try:
            await self._nc.publish(
                subjects.requests_subject(self._requests_prefix, event),
                encode(RequestRef(request_id=request_id, cached_tokens=cached_tokens, at=at)),
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


def _checked_at(at: float | None) -> float | None:
    """A lifecycle note's ``at`` as a float, or None; ValueError unless a finite number (bool is not one)."""
    if at is None:
        return None
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        raise ValueError(f"at must be a finite number of seconds since the epoch, got {at!r}")
    return float(at)
