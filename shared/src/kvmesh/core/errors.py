"""Every error kvmesh raises on purpose, in one tree.

Every class derives from `KvmeshError`; where a built-in fits, the error also derives from it, so callers that
only know the standard library still catch it sensibly. Classes are defined here unless named with a module;
those modules import the tree from here.

    KvmeshError
    ├── DecodeError (ValueError)           bytes from another process that do not decode into what they claim
    │   ├── WireError                      a ZMQ KV-event payload we cannot use (vLLM, SGLang publishers)
    │   │   ├── PayloadDecodeError         the bytes are not msgpack at all
    │   │   ├── NotABatchError             msgpack, but not a 2- or 3-element KVEventBatch array
    │   │   └── InvalidEventError          one event inside a batch has the wrong shape or field type
    │   ├── MessageDecodeError             a kvmesh stream message (JetStream payload) that does not decode
    │   ├── SnapshotError                  an object that is not a whole, verified snapshot (`reason`)
    │   └── ProtocolError                  a kvmesh request, reply, status, note or record that does not decode
    │       └── RequestError               an invalid route or match request; `field` names the culprit
    ├── EventRejectedError (ValueError)    a well-formed event that kvmesh refuses to index
    │   └── BlockAlignmentError            len(token_ids) != len(block_hashes) × block_size
    │       BlockSizeMismatchError         (kvmesh.core.normalize) the event's block size is not the rank's
    ├── RouteError                         an error answer of the route API; `code` is its wire code
    │   ├── BadRequestError (ValueError)   ``bad_request``
    │   ├── UnknownModelError (KeyError)   ``unknown_model``: no worker of the model is indexed or registered
    │   ├── NoWorkersError (LookupError)   ``no_workers``: no candidate worker is left
    │   │   └── ContextLengthExceededError ``context_length_exceeded``: the prompt is longer than every
    │   │                                  candidate's context length
    │   ├── UnavailableError               ``unavailable``: no router or indexer answered in time
    │   └── InternalError                  ``internal``: the router or indexer failed
    ├── SnapshotNotFoundError (LookupError)  no usable snapshot where one was asked for (``kvmesh replay``)
    ├── ConfigError (ValueError)           settings that cannot be used; `problems` lists each
    └── TransportError                     something between kvmesh and NATS (or an engine socket) failed
        ├── ConnectError                   the first connection could not be made (`reason` says why)
        │   ├── BadURLError (ValueError)   the URL is not nats://, tls://, ws:// or wss://
        │   ├── UnknownHostError           the host name does not resolve
        │   ├── ConnectRefusedError        nothing listens on the port
        │   ├── ConnectTimeoutError        no answer in time (a firewall, a host that is down)
        │   ├── NotNatsServerError         something answers that is not a NATS client port
        │   ├── AuthorizationError         the server refused the credentials
        │   └── TLSError                   tls:// asked for TLS and the server offers none, or the handshake failed
        ├── ConnectionClosedForGood        the client closed its connection and will not reconnect
        └── StreamUnavailableError         the events stream does not exist (yet) or JetStream is off

Outside the library, the ingest's `EngineArgsError` (bad engine arguments for ``kvmesh vllm``/``sglang``) and
the tools' errors (trace format, simulator, nats-server launcher) derive from `KvmeshError` as well.

`RouteError` subclasses carry their wire ``code`` and the numeric NATS service-error ``status`` they are sent
with (`kvmesh.core.protocol.ERROR_STATUS` is built from them: the one table). The services map errors to log
lines, counters and error replies at their boundary (`kvmesh.runtime.nats` maps nats-py's exceptions to the
`TransportError` subtree); the core itself never logs.
"""

from __future__ import annotations

from collections.abc import Sequence


class KvmeshError(Exception):
    """Base class of every error kvmesh raises on purpose."""


class DecodeError(KvmeshError, ValueError):
    """Bytes from another process (an engine, the stream, a peer service) that do not decode."""


class WireError(DecodeError):
    """A ZMQ KV-event payload that kvmesh cannot use."""


class PayloadDecodeError(WireError):
    """The payload bytes are not valid msgpack."""


class NotABatchError(WireError):
    """The payload is msgpack but not a KVEventBatch (an array of 2 or 3 elements, events second)."""


class InvalidEventError(WireError):
    """One event of a batch has an unknown shape or a field of the wrong type.

    Attributes:
        index: position of the event in its batch (0-based).
        tag: the event's type tag when it could be read (``"BlockStored"``), else None.
        reason: what was wrong, in words.
    """

    def __init__(self, reason: str, *, index: int = -1, tag: str | None = None) -> None:
        super().__init__(f"event {index} ({tag or 'untagged'}): {reason}")
        self.index = index
        self.tag = tag
        self.reason = reason


class EventRejectedError(KvmeshError, ValueError):
    """A well-formed event that kvmesh refuses to index (the whole event is dropped, never half-applied)."""


class BlockAlignmentError(EventRejectedError):
    """``len(token_ids)`` differs from ``len(block_hashes) × block_size``.

    Attributes:
        tokens: number of token ids in the event.
        blocks: number of block hashes in the event.
        block_size: the event's block size in tokens.
    """

    def __init__(self, *, tokens: int, blocks: int, block_size: int) -> None:
        super().__init__(
            f"{tokens} token ids do not fill {blocks} blocks of {block_size} tokens "
            f"(expected {blocks * block_size})"
        )
        self.tokens = tokens
        self.blocks = blocks
        self.block_size = block_size


class MessageDecodeError(DecodeError):
    """A kvmesh stream message (JetStream payload) that does not decode."""


class SnapshotError(DecodeError):
    """The bytes are not a whole, verified snapshot of a format this build reads.

    Attributes:
        reason: ``"truncated"``, ``"magic"``, ``"version"``, ``"checksum"`` or ``"body"``.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ProtocolError(DecodeError):
    """A kvmesh payload between processes (request, reply, status, note, record) that does not decode into its
    `kvmesh.core.protocol` Struct, or comes in a version this build does not read.

    Attributes:
        field: the field at fault (``"token_ids"``, ``"policy.temperature"``), or None when the body itself
            is bad.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class RequestError(ProtocolError):
    """An invalid route or match request (answered with ``bad_request``); `field` names the culprit."""


# ---------------------------------------------------------------------------------------- route API


class RouteError(KvmeshError):
    """An error answer of the route (or match) API.

    Attributes:
        code: the wire code (``"bad_request"``, ``"unknown_model"``, ``"no_workers"``,
            ``"context_length_exceeded"``, ``"unavailable"``, ``"internal"``).
        status: the numeric NATS service-error code the answer is sent with (400, 404, 503, 500).
        message: the human-readable text.
    """

    code: str = "internal"
    status: int = 500

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:  # KeyError's own __str__ would quote the message
        return self.message


class BadRequestError(RouteError, ValueError):
    """The request was invalid (``bad_request``)."""

    code = "bad_request"
    status = 400


class UnknownModelError(RouteError, KeyError):
    """No worker serves the model (``unknown_model``): the index holds none of its workers, or the router's
    registry knows none. `kvmesh.core.state.IndexState.match` raises it with the model name as its message."""

    code = "unknown_model"
    status = 404


class NoWorkersError(RouteError, LookupError):
    """No candidate worker is left (``no_workers``): every one left, is stale, or was excluded."""

    code = "no_workers"
    status = 404


class ContextLengthExceededError(NoWorkersError):
    """The prompt is longer than the context length of every worker that could take it
    (``context_length_exceeded``, sent with 400: the request, not the fleet, has to change).

    A `NoWorkersError`, so callers that handle "no worker left" handle it too; the code is OpenAI's for the
    same refusal. Workers register their context length (`kvmesh.core.protocol.WorkerRecord.context_length`);
    one that registers none takes any prompt.
    """

    code = "context_length_exceeded"
    status = 400


class UnavailableError(RouteError):
    """No router or indexer could answer in time (``unavailable``)."""

    code = "unavailable"
    status = 503


class InternalError(RouteError):
    """The router or indexer failed (``internal``)."""

    code = "internal"
    status = 500


ROUTE_ERRORS: tuple[type[RouteError], ...] = (
    BadRequestError,
    UnknownModelError,
    NoWorkersError,
    ContextLengthExceededError,
    UnavailableError,
    InternalError,
)
"""Every route API error class, one per wire code."""


def route_error(code: str, message: str) -> RouteError:
    """Return the `RouteError` subclass instance for a wire ``code`` (`InternalError` for a code unknown here,
    keeping the code)."""
    for cls in ROUTE_ERRORS:
        if cls.code == code:
            return cls(message)
    return InternalError(message, code=code)


class SnapshotNotFoundError(KvmeshError, LookupError):
    """No usable snapshot where one was asked for (``kvmesh replay --snapshot-seq N``: none at that sequence,
    or every one there was skipped as unusable)."""


# ---------------------------------------------------------------------------------------- settings


class ConfigError(KvmeshError, ValueError):
    """Settings that cannot be used; ``problems`` lists every one found."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))
        self.problems = list(problems)


# ---------------------------------------------------------------------------------------- transport


class TransportError(KvmeshError):
    """A NATS or ZMQ operation failed."""


class StreamUnavailableError(TransportError):
    """The events stream does not exist (yet), or JetStream is not enabled on the server."""


class ConnectionClosedForGood(TransportError):
    """The NATS client closed its connection and will not reconnect (nats-py does this on some server errors,
    e.g. a publish over the max payload); a service raises it so its supervisor restarts the process."""


class ConnectError(TransportError):
    """The first connection to NATS could not be made.

    Attributes:
        reason: a short code: ``bad_url``, ``unknown_host``, ``refused``, ``timeout``, ``not_nats``,
            ``authorization``, ``tls`` or ``unreachable`` (anything else).
        servers: the server URL(s) as given, credentials redacted.
    """

    reason = "unreachable"

    def __init__(self, message: str, *, servers: str = "") -> None:
        super().__init__(message)
        self.servers = servers


class BadURLError(ConnectError, ValueError):
    """The URL cannot name a NATS server (a scheme other than nats://, tls://, ws://, wss://, no host)."""

    reason = "bad_url"


class UnknownHostError(ConnectError):
    """The server's host name does not resolve."""

    reason = "unknown_host"


class ConnectRefusedError(ConnectError):
    """Nothing listens on the server's port (connection refused)."""

    reason = "refused"


class ConnectTimeoutError(ConnectError):
    """The server did not answer within the connect timeout (a firewall that drops, a host that is down)."""

    reason = "timeout"


class NotNatsServerError(ConnectError):
    """Something answers on the port but it is not a NATS client port (for example the HTTP monitoring port)."""

    reason = "not_nats"


class AuthorizationError(ConnectError):
    """The server refused the credentials (user and password, token, nkey or creds file)."""

    reason = "authorization"


class TLSError(ConnectError):
    """A tls:// URL asked for TLS and the server offers none, or the TLS handshake failed."""

    reason = "tls"


MAX_ECHO_CHARS = 512
"""Characters of a request's own values (model, candidates, request id) an error reply repeats."""


def clip_echo(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """Return ``text`` cut to ``limit`` characters, saying how long it was.

    Error replies repeat parts of the request; unclipped, a request near the server's max payload gets a
    reply over it, and the server closes the replying connection.
    """
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"
