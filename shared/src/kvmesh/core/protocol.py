"""Every payload that crosses a process boundary, as frozen msgspec Structs, and one way to decode them.

Producers encode these Structs and consumers decode them with `decode`; nothing between processes is an
unnamed dict. Each top-level message has a ``version`` (absent on the wire means 1, so version-1 bytes are the
same as before the field existed); `decode` refuses a later version than this build reads.

=================================  ========================================  ========  =====================
subject                            body                                      encoding  reply
=================================  ========================================  ========  =====================
``kvmesh.route``                   `RouteRequest`                            JSON      `RouteReply` or
                                                                                       `ErrorReply`
``kvmesh.route`` with header       token ids as packed LE uint32; the other  binary    the same
``Kvmesh-Body: tokens-u32le``      `RouteRequest` fields in ``Kvmesh-Route``
``kvmesh.route`` with header       local block hashes as packed LE uint64;   binary    the same
``Kvmesh-Body: hashes-u64le``      the other fields in ``Kvmesh-Route``
``kvmesh.route`` with header       sequence hashes as packed LE uint64;      binary    the same
``Kvmesh-Body: seqhashes-u64le``   the other fields in ``Kvmesh-Route``
``kvmesh.match`` (indexers)        `MatchRequest`                            msgpack   `MatchReply` or
                                                                                       `ErrorReply`
``kvmesh.status``                  (empty)                                   JSON      `IngestStatus`,
                                                                                       `IndexerStatus`
``$SRV.STATS.kvmesh-router``       (nats micro)                              JSON      `RouterStats` as the
                                                                                       endpoint's ``data``
``kvmesh.snapshot``                `SnapshotRequest`                         JSON      `SnapshotResult`
``kvmesh.requests.routed``         `Routed`                                  JSON      —
``kvmesh.requests.prefill_done``   `RequestRef`                              JSON      —
``kvmesh.requests.finished``       `RequestRef`                              JSON      —
``kvmesh.requests.noted``          `RouteNote`                               JSON      —
``kvmesh.requests.sync``           (empty)                                   JSON      `LedgerSnapshot`
``kvmesh.load.<worker>``           `WorkerLoad`                              JSON      —
registry KV value                  `WorkerRecord`                            JSON      —
``kvmesh.events.…`` (stream)       `EventsMessage`, `WorkerRemoved`,         msgpack   —
                                   `IndexReset` (`kvmesh.core.events`)
snapshot objects                   `kvmesh.core.snapshot` (binary format)    binary    —
=================================  ========================================  ========  =====================

Route request forms (`ROUTE_FORMS`; a router lists those it reads in its ``$SRV.INFO`` metadata,
``route_forms``). The JSON body stays the default; two more forms spare the router the JSON token list:

* ``Kvmesh-Body: tokens-u32le`` (`BODY_TOKENS_U32LE`): the body is the prompt's token ids packed as
  little-endian uint32 (4 bytes a token), and the ``Kvmesh-Route`` header (`FIELDS_HEADER`) holds the other
  `RouteRequest` fields as one JSON object (``{"model":"m","request_id":"r-1"}``; no ``token_ids`` or
  ``block_hashes`` in it).
* pre-hashed requests: `RouteRequest.block_hashes` instead of ``token_ids`` (JSON), or ``Kvmesh-Body:
  hashes-u64le`` (`BODY_HASHES_U64LE`) with the hashes packed as little-endian uint64 (8 bytes a block) and
  the fields in ``Kvmesh-Route``. They are Dynamo's *local block hashes*
  (`kvmesh.core.hashing.local_block_hashes`: XXH3-64, seed 1337, of each full block's tokens as LE uint32),
  one per full block from the prompt's first; the caller has mixed any LoRA adapter and cache salt in
  already, so a pre-hashed request carries neither ``lora_name`` nor ``cache_salt``.
* or their *sequence hashes*: `RouteRequest.seq_hashes` (JSON), or ``Kvmesh-Body: seqhashes-u64le``
  (`BODY_SEQHASHES_U64LE`, packed as above): the rolling hashes of the local ones
  (`kvmesh.core.hashing.sequence_hashes`: ``seq[0] = local[0]``, ``seq[i] = XXH3-64(le64(seq[i-1]) ‖
  le64(local[i]), seed 1337)``; Dynamo's ``SequenceHash``, RFC #1527's ``seq_hashes``), which the index is
  keyed by, so they are looked up as given.

A request carries exactly one of ``token_ids``, ``block_hashes`` and ``seq_hashes`` (`RequestError`). Without
a ``request_id`` the tie-break seed is the body's bytes, so the same prompt in two forms may break a tie
differently; with one, every form answers the same.

The stream messages and snapshots keep their own modules (they have their own schema versions and hot
decoders) and are re-exported here, so this module names every inter-process payload.

Errors: a request that does not decode raises `RequestError` (answered ``bad_request``); any other payload
raises `ProtocolError`; both name the field at fault when msgspec says which.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Final, Literal, NoReturn, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from kvmesh.core.errors import (
    ROUTE_ERRORS,
    ProtocolError,
    RequestError,
    route_error,
)
from kvmesh.core.events import EventsMessage, IndexReset, WorkerRemoved

__all__ = [
    "BODY_HASHES_U64LE",
    "BODY_HEADER",
    "BODY_JSON",
    "BODY_SEQHASHES_U64LE",
    "BODY_TOKENS_U32LE",
    "ERROR_STATUS",
    "FIELDS_HEADER",
    "FORMS_METADATA_KEY",
    "MAX_BLOCK_HASH",
    "MAX_TOKEN_ID",
    "PROTOCOL_VERSION",
    "ROUTE_FORMS",
    "SYNC_FROM_HEADER",
    "SYNC_PARTS_HEADER",
    "BlockHash",
    "EngineStatus",
    "ErrorBody",
    "ErrorReply",
    "EventsMessage",
    "HealthExplain",
    "HolderStatus",
    "IndexReset",
    "IndexerStatus",
    "IngestRankStatus",
    "IngestStatus",
    "LedgerEntry",
    "LedgerSnapshot",
    "LedgerStats",
    "LoadExplain",
    "MatchHolder",
    "MatchReply",
    "MatchRequest",
    "Message",
    "MicroEndpointStats",
    "MicroServiceStats",
    "PolicyOverride",
    "PredictedCache",
    "PredictedSnapshot",
    "RequestRef",
    "RouteNote",
    "RouteReceipts",
    "RouteReply",
    "RouteRequest",
    "Routed",
    "RouterIndexStats",
    "RouterStats",
    "ScoreExplain",
    "SelectionExplain",
    "SessionEntry",
    "SkippedCandidate",
    "SnapshotRequest",
    "SnapshotResult",
    "TokenId",
    "WorkerLoad",
    "WorkerRecord",
    "WorkerRemoved",
    "check_route_ids",
    "check_version",
    "decode",
    "encode",
    "error_field",
    "error_reply",
    "raise_for_error",
]

PROTOCOL_VERSION: Final[int] = 1
"""The highest ``version`` of every message below that this build reads and writes."""

MAX_TOKEN_ID: Final[int] = 2**32 - 1
MAX_BLOCK_HASH: Final[int] = 2**64 - 1

BODY_HEADER: Final[str] = "Kvmesh-Body"
"""NATS header naming a route request's body form (absent: `BODY_JSON`)."""
FIELDS_HEADER: Final[str] = "Kvmesh-Route"
"""NATS header of a binary route request: its other `RouteRequest` fields as one JSON object."""
BODY_JSON: Final[str] = "json"
"""A `RouteRequest` as JSON (the default form)."""
BODY_TOKENS_U32LE: Final[str] = "tokens-u32le"
"""The body is the prompt's token ids packed as little-endian uint32."""
BODY_HASHES_U64LE: Final[str] = "hashes-u64le"
"""The body is the prompt's local block hashes packed as little-endian uint64."""
BODY_SEQHASHES_U64LE: Final[str] = "seqhashes-u64le"
"""The body is the prompt's sequence hashes packed as little-endian uint64."""
ROUTE_FORMS: Final[tuple[str, ...]] = (BODY_JSON, BODY_TOKENS_U32LE, BODY_HASHES_U64LE, BODY_SEQHASHES_U64LE)
"""Every ``Kvmesh-Body`` value this build reads."""
FORMS_METADATA_KEY: Final[str] = "route_forms"
"""Key of a router's ``$SRV.INFO`` metadata listing the forms it reads, comma-separated."""
SYNC_PARTS_HEADER: Final[str] = "Kvmesh-Sync-Parts"
"""Header of ``kvmesh.requests.sync``. On the request: ``"1"`` when the asker takes a reply in several
messages (routers before multi-part sync send no header and get the `LedgerSnapshot` alone). On the first
reply: how many messages the reply has in all (the `LedgerSnapshot`, then `PredictedSnapshot` parts)."""
SYNC_FROM_HEADER: Final[str] = "Kvmesh-Sync-From"
"""Header of every part of a multi-part sync reply: the answering replica's id, so an asker that hears two
peers keeps one peer's parts."""

ERROR_STATUS: Final[dict[str, int]] = {cls.code: cls.status for cls in ROUTE_ERRORS}
"""Error code → the numeric ``Nats-Service-Error-Code`` it is sent with (from `kvmesh.core.errors`'s classes:
``bad_request`` 400, ``unknown_model`` 404, ``no_workers`` 404, ``context_length_exceeded`` 400,
``unavailable`` 503, ``internal`` 500)."""


class Message(msgspec.Struct, kw_only=True, frozen=True):
    """Base of every top-level message: the optional ``version`` (UNSET on the wire means 1)."""

    version: int | UnsetType = UNSET
    """Protocol version of the message; absent means 1 (`PROTOCOL_VERSION` is the newest this build reads)."""

    REQUEST: ClassVar[bool] = False
    """Whether a bad body is the sender's fault (`RequestError`, ``bad_request``) rather than a peer's."""


# ---------------------------------------------------------------------------------------- route API


TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
"""A token id, checked while decoding (in C: a 4,096-token prompt costs no Python-level pass)."""

BlockHash = Annotated[int, msgspec.Meta(ge=0)]
"""A local block hash: ≥ 0 checked while decoding, ≤ `MAX_BLOCK_HASH` by the route parser (msgspec bounds
stop at int64)."""


class PolicyOverride(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Per-request overrides of the router's `kvmesh.core.route.Policy` (the request's ``policy`` object);
    None keeps the router's value. Unknown keys are refused (`RequestError` naming ``policy.<key>``)."""

    overlap_weight: float | None = None
    decode_weight: float | None = None
    temperature: float | None = None
    tier_weights: dict[str, float] | None = None
    busy_kv_usage: float | None = None
    busy_waiting: int | None = None
    session_slack: float | None = None


class RouteRequest(Message, kw_only=True, frozen=True, omit_defaults=True):
    """Body of ``kvmesh.route``: which worker for these tokens?"""

    REQUEST: ClassVar[bool] = True

    model: str
    token_ids: Sequence[TokenId] = ()
    """The prompt's token ids, each in ``[0, 2**32)`` (a list from JSON, an ``array('I')`` from a
    ``tokens-u32le`` body); empty when the request carries ``block_hashes``."""
    block_hashes: Sequence[BlockHash] | None = None
    """Instead of ``token_ids``: the local block hash of every full block of the prompt, from the first
    (`kvmesh.core.hashing.local_block_hashes`, each in ``[0, 2**64)``), LoRA and salt already mixed in."""
    seq_hashes: Sequence[BlockHash] | None = None
    """Instead of ``token_ids``: the sequence hash of every full block of the prompt, from the first
    (`kvmesh.core.hashing.sequence_hashes` of the local block hashes, each in ``[0, 2**64)``)."""
    block_size: int | None = None
    """With ``block_hashes`` or ``seq_hashes``: the tokens per block they were computed with (None: the
    model's block size); holders of another block size count no overlap."""
    prompt_tokens: int | None = None
    """With ``block_hashes`` or ``seq_hashes``: the prompt's length in tokens, a trailing partial block included (load
    accounting; None: the full blocks' tokens)."""
    lora_name: str | None = None
    cache_salt: str | None = None
    candidates: list[str] | None = None
    """Worker ids to choose among (None: every worker of the model)."""
    request_id: str | None = None
    """Load accounting: the route counts on the chosen worker until `RequestRef` notes end it."""
    session_id: str | None = None
    """Session affinity: requests with the same ``session_id`` (1 – 256 characters; a conversation, an agent
    run) stay on the (worker, dp rank) the session's last one was routed to while its cost is within
    ``policy.session_slack`` of the best (`kvmesh.core.sessions`); every router replica knows it."""
    explain: bool = False
    policy: PolicyOverride | None = None


class HealthExplain(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A holder's state in an explained reply: ``exact``, ``stale`` or ``incomplete``, and why when not exact."""

    state: str
    reason: str | None = None


class LoadExplain(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A candidate's load in an explained reply: the routers' own accounting, plus the engine's last report
    (each engine field absent when the engine did not report it)."""

    active_prefill_tokens: int
    active_blocks: int
    active_requests: int
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    prefix_hit_rate: float | None = None


class ScoreExplain(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One candidate's score in an explained reply (eligible candidates first, best first)."""

    worker_id: str
    dp_rank: int
    overlap_blocks: int
    cached_tokens: int
    """Leading prompt tokens cached, unweighted (``overlap_blocks`` × the candidate's block size)."""
    cached_tokens_by_tier: dict[str, int]
    weighted_cached_tokens: float
    """``cached_tokens`` weighted by storage tier (the policy's ``tier_weights``)."""
    cached_blocks: int
    """All blocks indexed for the candidate (its cache size)."""
    load: LoadExplain
    prefill_blocks: float
    decode_blocks: float
    busy: bool
    cost: float
    health: HealthExplain
    probability: float | None = None
    """Chance of being sampled (temperature > 0, eligible candidates only)."""


class SkippedCandidate(msgspec.Struct, kw_only=True, frozen=True):
    """A registered rank the route did not consider, and why (``"stale: …"``)."""

    worker_id: str
    dp_rank: int
    reason: str


class SelectionExplain(msgspec.Struct, kw_only=True, frozen=True):
    """How the candidates were bounded (explained replies): ``total`` worth scoring, ``considered``, ``cut``."""

    total: int
    considered: int
    cut: int
    bounded: bool
    skipped: list[SkippedCandidate]
    skipped_total: int


class RouteReply(Message, kw_only=True, frozen=True, omit_defaults=True):
    """A successful route answer (``scores``, ``degraded_reason`` and ``selection`` are absent on the wire when
    None)."""

    request_id: str | None
    worker_id: str
    dp_rank: int
    overlap_blocks: int
    cached_tokens: int
    """Leading prompt tokens the chosen worker has cached, as the index sees them (the *captured* reuse)."""
    available_tokens: int | None = None
    """The most leading prompt tokens any live candidate of the model has cached (the *available* reuse):
    holders the request's ``candidates`` left out and busy holders included, stale ranks not; 0 in
    ``load_only`` mode. ``available_tokens − cached_tokens`` is what the choice gave up for load. None from a
    router older than this field."""
    block_size: int
    index_seq: int
    """Stream sequence the answering index had applied."""
    scores: list[ScoreExplain] | None = None
    """With ``explain``: every candidate's score."""
    mode: str
    """``"exact"``; ``"degraded"`` (the index lags the stream beyond the router's bound, or the chosen holder is
    stale or incomplete: see ``degraded_reason``); ``"load_only"`` (no trustworthy index: routed on load
    alone)."""
    degraded_reason: str | None = None
    """Why the mode is not ``"exact"``."""
    selection: SelectionExplain | None = None
    """With ``explain``: how the candidates were bounded and which stale ranks were skipped."""
    session: str | None = None
    """With a ``session_id``: ``"new"`` (no (worker, dp rank) known for it), ``"kept"`` (routed to the
    session's last one) or ``"moved"`` (it was no candidate, busy, or cost more than the slack allows)."""


class ErrorBody(msgspec.Struct, kw_only=True, frozen=True):
    """The ``error`` object of an error reply: one of `ERROR_STATUS`'s codes and a message."""

    code: str
    message: str


class ErrorReply(Message, kw_only=True, frozen=True, omit_defaults=True):
    """An error reply of the route or match API (sent with ``Nats-Service-Error-Code`` = ``ERROR_STATUS[code]``)."""

    error: ErrorBody
    request_id: str | None = None
    """The request's id, when it had one short enough to repeat (absent otherwise)."""


def error_reply(code: str, message: str, *, request_id: str | None = None) -> ErrorReply:
    """Return the error reply for ``code`` (a key of `ERROR_STATUS`)."""
    return ErrorReply(error=ErrorBody(code=code, message=message), request_id=request_id)


def raise_for_error(reply: ErrorReply) -> NoReturn:
    """Raise the `RouteError` subclass an error reply carries (`InternalError` for a code unknown here)."""
    raise route_error(reply.error.code, reply.error.message)


# ---------------------------------------------------------------------------------------- match API


class MatchRequest(Message, kw_only=True, frozen=True):
    """Body of an indexer's match subject (msgpack), sent by routers with ``--index remote``."""

    REQUEST: ClassVar[bool] = True

    model: str
    token_ids: bytes | list[int]
    """Token ids packed as little-endian uint32, or as a list of ints (when the packed form would not fit)."""
    lora_name: str | None = None
    cache_salt: str | None = None


class MatchHolder(msgspec.Struct, frozen=True, array_like=True):
    """One holder of a match reply, as an array ``[worker_id, dp_rank, overlap_blocks, cached_blocks, tiers,
    block_size, health]``; indexers before kvmesh 0.1 sent 4 to 6 elements, which decode with the defaults."""

    worker_id: str
    dp_rank: int
    overlap_blocks: int
    cached_blocks: int
    tiers: dict[str, int] | None = None
    """Overlap blocks per storage medium, or None: all on GPU."""
    block_size: int = 0
    """The holder's own block size (0: the model's)."""
    health: str | None = None
    """None when the index's picture of the holder is exact, else why not."""


class MatchReply(Message, kw_only=True, frozen=True):
    """An indexer's match answer (msgpack)."""

    index_seq: int
    block_size: int
    prompt_blocks: int
    replica: str = ""
    candidates: list[MatchHolder] = msgspec.field(default_factory=list)


# ---------------------------------------------------------------------------------------- status


class EngineStatus(msgspec.Struct, kw_only=True, frozen=True):
    """An ingest rank's engine liveness: ``live``, ``stale``, ``gone`` or ``unprobed``; why; probes sent."""

    state: str
    reason: str
    probes: int


class IngestRankStatus(msgspec.Struct, kw_only=True, frozen=True):
    """One dp_rank of an ingest: its ZMQ endpoint, engine epoch and sequence, and counters."""

    endpoint: str
    epoch: int
    last_seq: int | None
    replaying: bool
    block_size: int | None
    sequence: dict[str, int]
    """`kvmesh.core.sequencing.TrackerStats` fields."""
    events: dict[str, int]
    """`kvmesh.core.normalize.NormalizeStats` fields."""
    engine: EngineStatus
    replay_seconds: float = 0.0
    """Seconds spent in replays since the ingest started (with ``sequence["replays"]``: their mean)."""


class IngestStatus(Message, kw_only=True, frozen=True):
    """An ingest's answer on ``kvmesh.status``."""

    worker_id: str
    model: str
    outbox: int
    """Messages waiting for, or in, the publish window."""
    counters: dict[str, int]
    ranks: dict[str, IngestRankStatus]
    """dp_rank (as a string: JSON keys) → its status."""
    kv_events: bool = True
    """False: the ingest registers its worker with heartbeats only (``--no-kv-events``) and reads no KV
    events (its ranks' endpoints read ``none (no KV events)``)."""


class IndexerStatus(Message, kw_only=True, frozen=True):
    """An indexer replica's answer on ``kvmesh.status``."""

    replica: str
    stream: str
    ready: bool
    applied_seq: int
    blocks: int
    digest: str
    """The index's order-independent digest, 16 hex digits (equal digests: equal indexes)."""
    models: dict[str, list[int]]
    """Model → its block sizes."""
    counters: dict[str, int]
    workers: dict[str, dict[str, Any]]
    complete: bool
    incomplete: list[str]
    holder_health: dict[str, str]
    reset_epoch: int
    read_messages: int
    resubscribes: int
    stream_id: str
    rebuilds: int
    recovery: dict[str, Any]
    snapshots: dict[str, Any]
    snapshot_writer: bool
    max_blocks: int | None = None
    """The replica's block bound (``--max-blocks``), None without one; its evictions are
    ``counters["evicted_blocks"]``."""


class HolderStatus(msgspec.Struct, kw_only=True, frozen=True):
    """A holder that is not exact in a router's view: ``stale`` or ``incomplete``, and why."""

    state: str
    reason: str


class RouterIndexStats(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """The index part of a router's stats (``mode`` ``local``: its replica; ``remote``: the indexers); fields of
    the other mode are absent."""

    route_mode: str
    """The mode a route would get now (``exact``, ``degraded``, ``load_only``)."""
    holders: dict[str, HolderStatus]
    """``"worker/rank"`` → state, for holders that are not exact (at most 100 listed, the router's
    ``MAX_HOLDERS_LISTED``)."""
    holders_not_exact: int
    mode: str
    route_subject: str
    degraded_reason: str | None = None
    match_subject: str | None = None
    lag_messages: int | None = None
    lag_s: float | None = None
    stream: str | None = None
    applied_seq: int | None = None
    blocks: int | None = None
    read_messages: int | None = None
    decode_errors: int | None = None
    apply_errors: int | None = None
    recovery: dict[str, Any] | None = None
    max_blocks: int | None = None
    """The local replica's block bound (``--max-blocks``); absent without one."""
    evicted_blocks: int | None = None
    """Blocks the local replica dropped to stay within ``max_blocks``; absent without a bound."""


class LedgerStats(msgspec.Struct, kw_only=True, frozen=True):
    """Request lifecycle notes a router has counted."""

    routed: int
    prefill_done: int
    finished: int
    expired: int
    unknown: int


class RouteLatency(msgspec.Struct, kw_only=True, frozen=True):
    """Route latency in milliseconds, from a request's arrival to its reply, over the last ``routes`` answered
    routes of one router replica (a window, not since start)."""

    routes: int
    p50_ms: float
    p99_ms: float


class RouteReceipts(msgspec.Struct, kw_only=True, frozen=True):
    """One (worker, dp rank)'s route receipts on the router replica that answered its requests: token counters
    since the replica started (sums, never ratios; a ratio of two counters is the caller's to take).

    Each answered route adds its ``available_tokens`` and the chosen worker's ``cached_tokens`` (captured) to
    the chosen worker; a ``finished`` note with the engine's own count of cached prompt tokens
    (`RequestRef.cached_tokens`) adds it as delivered, on the replica that answered the request only.
    ``captured_tokens`` over the requests with a delivered count = ``delivered_tokens`` +
    ``misprediction_tokens`` − ``unpredicted_tokens``.
    """

    requests: int
    """Routes answered with this worker."""
    available_tokens: int
    """Sum over those routes of the most tokens any live candidate had cached."""
    captured_tokens: int
    """Sum over those routes of this worker's cached tokens as the index saw them."""
    regret_tokens: int
    """``available_tokens − captured_tokens``: reuse given up by the choice (for load, or by ``candidates``)."""
    delivered_requests: int
    """Routed requests finished with the engine's count of cached prompt tokens."""
    delivered_tokens: int
    """Sum of the engines' counts over those requests."""
    misprediction_tokens: int
    """Sum over those requests of ``max(captured − delivered, 0)``: tokens the index promised that the engine
    did not have (an evicted block, a lagging index, the engine recomputing a fully cached prompt's last
    block)."""
    unpredicted_tokens: int
    """Sum over those requests of ``max(delivered − captured, 0)``: tokens the engine had that the index did
    not know of."""


class RouterStats(Message, kw_only=True, frozen=True):
    """The ``data`` of a router's route endpoint in ``$SRV.STATS`` (what `kvmesh status` shows)."""

    routed: int
    errors: dict[str, int]
    in_flight: int
    ledger: LedgerStats
    engine_reports: int
    modes: dict[str, int]
    candidates_cut: dict[str, int]
    index: RouterIndexStats
    receipts: dict[str, RouteReceipts] = msgspec.field(default_factory=dict)
    """``"worker/rank"`` → the route receipts of the requests this replica answered (empty from a router older
    than route receipts)."""
    latency: RouteLatency | None = None
    """Route latency over the last answered routes (None: none yet, or a router older than the field)."""
    sessions: int = 0
    """Sessions this replica knows (session affinity); 0 from a router older than the field."""
    predicted_blocks: dict[str, int] = msgspec.field(default_factory=dict)
    """Predicted entries held: ``"ttl"`` (``--predicted-ttl-s``) and ``"no_events"`` (workers without KV
    events), each present only when in use."""


class MicroEndpointStats(msgspec.Struct, frozen=True):
    """One endpoint in a nats.micro ``$SRV.STATS`` reply: its name and its ``data`` undecoded (a
    `RouterStats` for a router's ``route`` endpoint; JSON null when the endpoint has none)."""

    name: str
    data: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"null"))
    num_requests: int = 0
    num_errors: int = 0
    last_error: str = ""


class MicroServiceStats(msgspec.Struct, frozen=True):
    """A nats.micro ``$SRV.STATS`` reply (nats.micro's own format, not versioned by kvmesh): the service's
    instance id, its version string and its endpoints; other fields are ignored."""

    id: str
    name: str = ""
    version: str = ""
    """The service's version (the kvmesh release, e.g. ``"0.1.0"``)."""
    endpoints: list[MicroEndpointStats] = msgspec.field(default_factory=list)


# ---------------------------------------------------------------------------------------- snapshots


class SnapshotRequest(Message, kw_only=True, frozen=True):
    """Body of ``kvmesh.snapshot`` (``kvmesh snapshot``): the stream whose replicas should write one (None: all)."""

    REQUEST: ClassVar[bool] = True

    stream: str | None = None


class SnapshotResult(Message, kw_only=True, frozen=True):
    """One replica's answer to a snapshot request: written (with its costs) or not (with the reason)."""

    replica: str
    stream: str
    written: bool
    reason: str | UnsetType = UNSET
    """Why nothing was written."""
    error: str | UnsetType = UNSET
    """The failure's exception name, when writing failed."""
    name: str | UnsetType = UNSET
    """The snapshot object's name."""
    stream_id: str | UnsetType = UNSET
    applied_seq: int | UnsetType = UNSET
    bytes: int | UnsetType = UNSET
    stall_ms: float | UnsetType = UNSET
    """Milliseconds the index was held to export it."""
    encode_ms: float | UnsetType = UNSET
    store_ms: float | UnsetType = UNSET
    deleted: list[str] | UnsetType = UNSET
    """Names of the older snapshots deleted (beyond ``--snapshot-keep``)."""
    purged_before: int | UnsetType | None = UNSET
    """Stream sequence before which messages were purged (None: no purge)."""


# ---------------------------------------------------------------------------------------- lifecycle and load


class Routed(Message, kw_only=True, frozen=True):
    """A router sent ``request_id`` to (worker, dp_rank); body of ``kvmesh.requests.routed``."""

    request_id: str
    worker_id: str
    dp_rank: int
    prefill_tokens: int
    """Prompt tokens the worker has to compute (prompt tokens − cached tokens), ≥ 0."""
    blocks: int
    """KV blocks the request occupies while it runs: ceil(prompt tokens / block size)."""
    session_id: str | None = None
    """The request's ``session_id``: every replica notes the session's (worker, dp rank)."""
    block_keys: list[int] | None = None
    """The prompt's prefix keys (the standard sequence hash of each full block, block 0 first), sent when
    the replicas keep predicted entries for the chosen worker (``--predicted-ttl-s``, or a worker without KV
    events); None otherwise."""


class RouteNote(Message, kw_only=True, frozen=True, omit_defaults=True):
    """A router sent a request without a ``request_id`` to (worker, dp_rank), and the other replicas need to
    know (its session, or its blocks for predicted entries); body of ``kvmesh.requests.noted`` (a request with
    a ``request_id`` says the same in its `Routed` note)."""

    worker_id: str
    dp_rank: int
    session_id: str | None = None
    block_keys: list[int] | None = None
    """As `Routed.block_keys`."""


class SessionEntry(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """One session in a ledger snapshot: where its last request went, and how long ago."""

    session_id: str
    worker_id: str
    dp_rank: int
    idle_s: float


class RequestRef(Message, kw_only=True, frozen=True, omit_defaults=True):
    """Body of ``kvmesh.requests.prefill_done`` and ``kvmesh.requests.finished``."""

    request_id: str
    cached_tokens: int | None = None
    """``finished`` only: the engine's own count of the request's cached prompt tokens (vLLM's
    ``usage.prompt_tokens_details.cached_tokens``), ≥ 0, which the router that answered the request counts as
    delivered; absent (None) when the caller does not know it (nothing is counted delivered). A negative
    value is ignored."""
    at: float | None = None
    """When it happened on the caller's clock, seconds since the epoch (the first token for ``prefill_done``,
    the last for ``finished``); absent: when the router receives the note. A router dates the note that many
    seconds before its receipt (at most `MAX_NOTE_AGE_S`; a time ahead of the router's clock counts as the
    receipt), so a note held up on its way (a busy gateway, a batching client) still gives the worker's
    prefill rate its true duration."""


MAX_NOTE_AGE_S: Final[float] = 60.0
"""The most seconds before its receipt a lifecycle note's ``at`` dates it (an older time counts as that)."""


class LedgerEntry(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """One in-flight request in a ledger snapshot (``kvmesh.requests.sync`` reply)."""

    request_id: str
    worker_id: str
    dp_rank: int
    prefill_tokens: int
    """Remaining active prefill tokens (0 once prefill is done)."""
    blocks: int
    age_s: float
    """Seconds since the request was routed, as seen by the replica that answered."""


class LedgerSnapshot(msgspec.Struct, kw_only=True, frozen=True):
    """Reply of ``kvmesh.requests.sync``: every in-flight request a router replica holds."""

    entries: list[LedgerEntry]
    version: int = 1
    sessions: list[SessionEntry] = msgspec.field(default_factory=list)
    """Every session the replica knows (absent from replicas before session affinity)."""


class PredictedCache(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """One holder's predicted entries in a sync part (`PredictedSnapshot`), or a slice of them."""

    worker_id: str
    dp_rank: int
    kind: str
    """``"no_events"`` (the predicted cache of a worker without KV events) or ``"ttl"`` (predicted entries
    beside the KV events, ``--predicted-ttl-s``); another kind is skipped by the receiver."""
    keys: list[int]
    """Prefix keys, least recently used first (a holder split over several parts: each part continues the
    previous one's order, newer keys later)."""
    remaining_s: list[float] | None = None
    """``"ttl"``: seconds each key still had to live at the sender (as long as ``keys``); None otherwise."""
    capacity_blocks: int | None = None
    """The holder's bound at the sender (its worker's ``kv_capacity_blocks``), None: the default."""


class PredictedSnapshot(msgspec.Struct, kw_only=True, frozen=True):
    """A later part of a multi-part ``kvmesh.requests.sync`` reply (msgpack): predicted entries."""

    caches: list[PredictedCache]
    version: int = 1


class WorkerLoad(Message, kw_only=True, frozen=True, omit_defaults=True):
    """One engine's load report (JSON body on ``kvmesh.load.<worker>``); unknown fields are ignored."""

    worker_id: str
    dp_rank: int = 0
    model: str | None = None
    running: int | None = None
    """Requests the engine is running (decoding or prefilling)."""
    waiting: int | None = None
    """Requests queued in the engine, not yet scheduled."""
    kv_usage: float | None = None
    """Fraction of the engine's KV-cache blocks in use, 0–1."""
    prefix_hit_rate: float | None = None
    """Fraction of prompt tokens found in the prefix cache, 0–1 (informational)."""


class WorkerRecord(Message, kw_only=True, frozen=True):
    """What an ingest registers for its worker (the registry KV value, JSON)."""

    worker_id: str
    model: str
    dp_ranks: int
    """Data-parallel ranks the ingest reads."""
    block_size: int | None
    incarnation: int
    """Highest engine epoch of the worker's ranks when this heartbeat was sent."""
    heartbeat_ts: float = 0.0
    """Wall-clock time of the heartbeat (seconds since the epoch)."""
    stale_ranks: dict[int, str] = msgspec.field(default_factory=dict)
    """dp_rank → why its engine is stale (silent and not answering liveness probes; `kvmesh.core.liveness`).
    Routers do not route to a stale rank; empty when every rank is live."""
    dp_rank_start: int = 0
    """First data-parallel rank this record's node reads (multi-node data parallelism; 0 on one node)."""
    dp_ranks_local: int | None = None
    """Ranks this node reads, ``[dp_rank_start, dp_rank_start + dp_ranks_local)``; None: all ``dp_ranks``
    (one node, the record of every ingest before multi-node support)."""
    context_length: int | None = None
    """Longest prompt plus output the engine accepts, in tokens (vLLM ``--max-model-len``, SGLang
    ``--context-length``); None: not known (routes do not check it)."""
    kv_capacity_blocks: int | None = None
    """KV-cache blocks of one rank's engine (vLLM ``--num-gpu-blocks-override``, SGLang
    ``--max-total-tokens`` / page size); None: not known."""
    kv_events: bool = True
    """False: the engine publishes no KV events (the worker is registered with heartbeats only, `kvmesh ingest
    --no-kv-events`); routers then count as its cache the prompts they sent it, at most
    ``kv_capacity_blocks`` per rank, least recently used out first (`kvmesh.core.predicted`)."""


# ---------------------------------------------------------------------------------------- codec

M = TypeVar("M", bound=msgspec.Struct)

_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()
_decoders: dict[tuple[type[Any], str], msgspec.json.Decoder[Any] | msgspec.msgpack.Decoder[Any]] = {}
_PATH = re.compile(r"at `\$\.([A-Za-z_][A-Za-z_.]*)")
_MISSING = re.compile(r"missing required field `([A-Za-z_]+)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")


def encode(msg: msgspec.Struct, *, format: Literal["json", "msgpack"] = "json") -> bytes:
    """Encode a message of this module as JSON (default) or msgpack.

    A `MatchReply`'s holder rows end after ``block_size`` when their ``health`` is None (6 elements, as
    indexers have always sent them), else carry it (7).
    """
    if isinstance(msg, MatchReply):
        body: Any = _match_reply_body(msg)
        return _json.encode(body) if format == "json" else _msgpack.encode(body)
    return _json.encode(msg) if format == "json" else _msgpack.encode(msg)


def _match_reply_body(reply: MatchReply) -> dict[str, Any]:
    out: dict[str, Any] = {} if reply.version is UNSET else {"version": reply.version}
    out.update(
        index_seq=reply.index_seq,
        block_size=reply.block_size,
        prompt_blocks=reply.prompt_blocks,
        replica=reply.replica,
        candidates=[
            [c.worker_id, c.dp_rank, c.overlap_blocks, c.cached_blocks, c.tiers, c.block_size]
            if c.health is None
            else [c.worker_id, c.dp_rank, c.overlap_blocks, c.cached_blocks, c.tiers, c.block_size, c.health]
            for c in reply.candidates
        ],
    )
    return out


def _decoder(kind: type[Any], format: str) -> msgspec.json.Decoder[Any] | msgspec.msgpack.Decoder[Any]:
    dec = _decoders.get((kind, format))
    if dec is None:
        dec = msgspec.json.Decoder(kind) if format == "json" else msgspec.msgpack.Decoder(kind)
        _decoders[(kind, format)] = dec
    return dec


def error_field(text: str) -> str | None:
    """The field a msgspec validation message points at (``policy.temperature``; an array element names its
    array: ``token_ids``), a nested unknown or missing key joined to its path, or None."""
    m = _PATH.search(text)
    name = m.group(1) if m else None
    u = _UNKNOWN.search(text)
    if u is not None:
        return f"{name}.{u.group(1)}" if name else u.group(1)
    missing = _MISSING.search(text)
    if missing is not None:
        return f"{name}.{missing.group(1)}" if name else missing.group(1)
    return name


def decode(data: bytes, kind: type[M], *, format: Literal["json", "msgpack"] = "json") -> M:
    """Decode ``data`` into the message type ``kind``.

    Args:
        data: the payload as received.
        kind: a message Struct of this module (`RouteRequest`, `MatchReply`, …).
        format: ``"json"`` or ``"msgpack"`` (see the module table for each subject's encoding).

    Raises:
        RequestError: ``kind`` is a request (`RouteRequest`, `MatchRequest`, `SnapshotRequest`) and ``data``
            does not decode into it (``field`` names the culprit when msgspec says which).
        ProtocolError: the same for any other message, or its ``version`` is later than `PROTOCOL_VERSION`.
    """
    error = RequestError if getattr(kind, "REQUEST", False) else ProtocolError
    try:
        msg: M = _decoder(kind, format).decode(data)
    except msgspec.ValidationError as exc:
        raise error(f"bad {kind.__name__}: {exc}", field=error_field(str(exc))) from exc
    except msgspec.DecodeError as exc:
        what = "JSON" if format == "json" else "msgpack"
        raise error(f"bad {kind.__name__}: not {what}: {exc}") from exc
    except RecursionError as exc:  # msgspec gives up on input nested deeper than it can decode
        raise error(f"bad {kind.__name__}: nested too deeply to decode") from exc
    check_version(msg, error)
    if isinstance(msg, RouteRequest):
        check_route_ids(msg)
    return msg


def check_route_ids(req: RouteRequest) -> None:
    """Refuse a route request with none of ``token_ids``, ``block_hashes`` and ``seq_hashes``, or with more
    than one.

    Raises:
        RequestError: naming ``token_ids`` (none) or the second kind of ids (more than one).
    """
    if req.block_hashes is None and req.seq_hashes is None:
        if not req.token_ids:
            raise RequestError(
                "token_ids must not be empty (or send block_hashes or seq_hashes)", field="token_ids"
            )
    elif req.token_ids or (req.block_hashes is not None and req.seq_hashes is not None):
        name = "seq_hashes" if req.seq_hashes is not None else "block_hashes"
        raise RequestError(
            "a route request carries one of token_ids, block_hashes and seq_hashes, not more", field=name
        )


def check_version(msg: msgspec.Struct, error: type[ProtocolError] = ProtocolError) -> None:
    """Refuse a kvmesh message whose ``version`` is later than `PROTOCOL_VERSION` (other Structs pass).

    Raises:
        ProtocolError: ``error`` (or the subclass given, e.g. `RequestError`) naming ``version``.
    """
    version = msg.version if isinstance(msg, Message | LedgerSnapshot) else UNSET
    if isinstance(version, int) and version > PROTOCOL_VERSION:
        raise error(
            f"{type(msg).__name__} of version {version}: this kvmesh reads up to version {PROTOCOL_VERSION}",
            field="version",
        )


def decode_answer(data: bytes, kind: type[M], *, format: Literal["json", "msgpack"] = "json") -> M:
    """Decode a reply that is either ``kind`` or an `ErrorReply`.

    Raises:
        RouteError: the subclass for the error reply's code.
        ProtocolError: the reply is neither.
    """
    try:
        return decode(data, kind, format=format)
    except ProtocolError as not_kind:  # one decode on the answer's path; an error reply is the rare case
        try:
            error = decode(data, ErrorReply, format=format)
        except ProtocolError:
            raise not_kind from None
    raise_for_error(error)
