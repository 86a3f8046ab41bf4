"""kvmesh's own stream messages: what ingest publishes to JetStream and the indexer applies.

One `EventsMessage` carries one engine batch of one (worker, dp_rank) after normalization: per event the
engine block hashes (as 64-bit keys) and kvmesh's local hashes, never the token ids (10× larger, and the
indexer does not need them). `WorkerRemoved` takes a worker out of every replica's index at the same point
of the stream. Messages are msgpack-encoded msgspec Structs with a schema version ``v``.
"""

from __future__ import annotations

from typing import Final

import msgspec

from kvmesh.core.errors import MessageDecodeError

SCHEMA_VERSION: Final[int] = 1


class Stored(msgspec.Struct, tag="stored", array_like=True, frozen=True, gc=False):
    """Consecutive full blocks stored by a worker (a normalized BlockStored).

    Not tracked by the cycle collector (``gc=False``): it holds only lists of ints, an int and a string.
    """

    engine_hashes: list[int]
    """The engine's block hashes as unsigned 64-bit keys (`kvmesh.core.wire.engine_key`)."""
    parent: int | None
    """Engine key of the block before the first one, or None when the first block is block 0."""
    local_hashes: list[int]
    """kvmesh local hashes (`kvmesh.core.hashing`), one per engine hash."""
    medium: str | None = None
    """Storage tier as the engine named it ("GPU", "CPU", …), or None."""


class Removed(msgspec.Struct, tag="removed", array_like=True, frozen=True, gc=False):
    """Blocks evicted by a worker (a normalized BlockRemoved).

    Like `Stored`, not tracked by the cycle collector (``gc=False``): it holds only a list of ints and a
    string, so it can be in no reference cycle, and vLLM sends one per evicted block.
    """

    engine_hashes: list[int]
    medium: str | None = None


class Placed(msgspec.Struct, tag="placed", array_like=True, frozen=True):
    """Known blocks of a worker now also live on another tier (a tokenless BlockStored).

    vLLM < 0.24 with the OffloadingConnector reports each CPU copy as a BlockStored carrying the GPU blocks'
    hashes, ``token_ids: []`` and ``block_size: 0``: the copy has the chain position of the block it copies,
    which the index already knows (on another tier of the same holder). Readers built before this event kind
    refuse the message: upgrade indexers and routers before ingests.
    """

    engine_hashes: list[int]
    """The copied blocks' engine hashes as unsigned 64-bit keys, in the event's order."""
    medium: str | None = None
    """The tier the copies live on ("CPU", …)."""


class StoredKeys(msgspec.Struct, tag="stored_keys", array_like=True, frozen=True):
    """Consecutive blocks stored by a holder, named by their prefix keys (an RFC #1527 ``stored`` event that
    carries ``seq_hashes`` and no ``token_ids``: the Mooncake store master, any publisher of the standard hash).

    The prefix keys are the blocks' standard sequence hashes (`kvmesh.core.hashing.prefix_keys`), so the
    index stores them as given, whether or not it knows the parent. Readers built before this event kind
    refuse the message: upgrade indexers and routers before ingests.
    """

    prefix_keys: list[int]
    """The blocks' sequence hashes (unsigned 64-bit), in order."""
    parent: int | None
    """Engine key of the block before the first one (the event's ``parent_hash``), or None."""
    medium: str | None = None
    """Storage tier as the publisher named it ("gpu", "cpu", "disk", …), or None."""
    engine_hashes: list[int] | None = None
    """The blocks' engine keys when they differ from the prefix keys; None: the prefix keys name the blocks
    in removals too (an RFC publisher's ``seq_hashes`` are both)."""


class Cleared(msgspec.Struct, tag="cleared", array_like=True, frozen=True):
    """Every block of the (worker, dp_rank) is gone: AllBlocksCleared, or a resynchronisation by ingest."""

    reason: str = "engine"
    """"engine" (AllBlocksCleared), "gap", "restart", "malformed", "overflow" (ingest resynchronised)."""


Event = Stored | Removed | Placed | StoredKeys | Cleared


class EventsMessage(msgspec.Struct, tag="events", kw_only=True, frozen=True):
    """One normalized engine batch of one (worker, dp_rank)."""

    v: int = SCHEMA_VERSION
    worker_id: str
    dp_rank: int
    model: str
    block_size: int
    """Tokens per block of every Stored event in the message."""
    epoch: int
    """Engine incarnation as counted by ingest; rises when the engine's sequence goes backwards."""
    seq: int
    """Engine sequence of the batch (ZMQ frame 2); for ingest-made messages the last one seen, -1 before any.

    When several consecutive batches are coalesced into one message, the last one's sequence."""
    first_seq: int | None = None
    """First engine sequence of coalesced batches (``first_seq..seq``); None for a single batch."""
    part: int = 0
    """Index of this part when a batch was split to fit the server's max payload."""
    ts: float = 0.0
    """Engine timestamp of the batch (seconds since the epoch), 0 for ingest-made messages."""
    events: list[Event]
    readers: list[str] | None = None
    """Set when the holder is a shared cache, not a routable instance (an RFC #1527 ``backend_id``: a per-node
    CPU/disk pool, ``kvmesh ingest --backend-of``): the worker ids of the instances that read it, for which its
    blocks count (`kvmesh.core.state.IndexState.match`). None: an instance. Readers built before this field
    ignore it."""


class WorkerRemoved(msgspec.Struct, tag="worker_removed", kw_only=True, frozen=True):
    """A worker left the fleet: every replica drops all of its dp ranks here."""

    v: int = SCHEMA_VERSION
    worker_id: str
    model: str
    epoch: int | None = None
    """Later events of this worker with an epoch ≤ this one are dropped; None means the highest epoch known."""
    reason: str = "operator"


class IndexReset(msgspec.Struct, tag="index_reset", kw_only=True, frozen=True):
    """An operator reset (``kvmesh reset``): every replica forgets its whole index here and starts a new epoch.

    A marker in the stream rather than a purge, so running replicas follow it at the same point.
    """

    v: int = SCHEMA_VERSION
    epoch: int
    """The new reset epoch (the previous one + 1, as the operator tool saw it)."""
    reason: str = "operator"


Message = EventsMessage | WorkerRemoved | IndexReset

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode_message(message: Message) -> bytes:
    """Encode a stream message as msgpack bytes."""
    return _encoder.encode(message)


def decode_message(data: bytes) -> Message:
    """Decode a stream message.

    Raises:
        MessageDecodeError: the bytes are not a kvmesh message of a known schema.
    """
    try:
        msg = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageDecodeError(f"not a kvmesh stream message: {exc}") from exc
    except RecursionError as exc:  # msgspec recurses into nested maps before validating the shape
        raise MessageDecodeError("not a kvmesh stream message: nested too deeply") from exc
    if msg.v != SCHEMA_VERSION:
        raise MessageDecodeError(f"unsupported schema version {msg.v} (this build reads {SCHEMA_VERSION})")
    return msg
