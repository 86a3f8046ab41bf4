"""Decode and encode the KV-cache event wire protocol of vLLM v1, SGLang and TensorRT-LLM (ZeroMQ + msgpack).

Handles every wire generation published by vLLM 0.9.0 – 0.33.0 (generations A–L) and SGLang
0.4.6.post5 – 0.5.23, and TensorRT-LLM's streaming events (KV cache manager V2: vLLM's map layout with
per-block ``mm_keys``; ``docs/wire-trtllm.md``). The rules come from the project's protocol notes
(``wire-protocol.md``: §1 message classes and layouts, §2 transport and replay, §5 SGLang, §6 consumer
guidance, and §7 TensorRT-LLM in ``docs/wire-trtllm.md``), which were checked against each release's own
``ZmqEventPublisher``; the captured frames in ``tests/data/frames`` are the regression reference.

Live messages are three ZMQ frames ``[topic, seq (8-byte big-endian unsigned), payload]``. The payload is one
msgpack ``KVEventBatch``: an array ``[ts, events]`` (vLLM 0.9.0.x, SGLang 0.4.6.x) or
``[ts, events, dp_rank]`` (every later release). Each event is either

* an **array** ``[tag, f1, f2, …]`` (vLLM 0.9.0 – 0.23.x, SGLang 0.4.6 – 0.5.19), decoded by position: a
  shorter array leaves the missing trailing fields None, a longer one has its extra elements ignored; an
  SGLang 0.5.18 – 0.5.19 salted ``BlockStored`` carries a trailing map ``{"cache_salt": s}`` as its 8th
  element; or
* a **map** ``{"type": tag, …}`` (vLLM ≥ 0.24, SGLang ≥ 0.5.20), decoded by name: key order is irrelevant,
  unknown keys (``locality``, ``ownership``, ``lookahead_token_ids``, …) are ignored; or
* an **RFC #1527 map** ``{"event_type": "stored" | "removed" | "cleared", …}`` (Mooncake's KV events API,
  written with Dynamo's router team; the Mooncake store master's ``KvEventPublisher``), recognised by its
  ``event_type`` key whether or not it also carries vLLM-style aliases (``type``, ``block_hashes``,
  ``parent_block_hash``: the master writes them by default, ``kv_events_emit_legacy_compat``); the RFC's own
  names win over the aliases. See `SequenceStored` and `decode_batch`.

Both shapes may be mixed within one batch. Block hashes are kept exactly as sent (msgpack int, signed or
unsigned up to uint64, or ``bin`` of any width); `engine_key` folds them into one 64-bit key space.

The module is pure: it imports only the standard library and msgspec, and does no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, TypeAlias

import msgspec

from kvmesh.core.errors import InvalidEventError, NotABatchError, PayloadDecodeError, WireError
from kvmesh.core.msgpack_spans import SpanError, array_spans, is_array, map_spans

__all__ = [
    "SEQ_END",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineBatch",
    "EngineHash",
    "KVEvent",
    "ReplayReply",
    "SequenceStored",
    "decode_batch",
    "decode_replay_reply",
    "decode_seq",
    "encode_batch",
    "encode_replay_request",
    "encode_rfc1527_batch",
    "encode_seq",
    "engine_key",
]

EngineHash: TypeAlias = int | bytes
"""A block hash exactly as sent: a msgpack int (signed int64 or unsigned uint64) or ``bin`` bytes of any
width (32 B for vLLM sha256, 16 B for xxhash, k×32 B for multi-group models)."""

_MASK64: Final[int] = (1 << 64) - 1
_INT_MIN: Final[int] = -(1 << 63)
_INT_END: Final[int] = 1 << 64

SEQ_END: Final[int] = _MASK64
"""Sequence number of the replay end marker (``ff`` × 8 on the wire, sent with an empty payload)."""

_SEQ_END_FRAME: Final[bytes] = b"\xff" * 8
_SEQ_EPOCH_FRAME: Final[int] = 24
"""Length of a sequence frame that carries a 16-byte publisher epoch after the 8-byte sequence."""


# --------------------------------------------------------------------------------------------------------
# Event types


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """Blocks that entered an engine's prefix cache (one event per request, KV group and step).

    Attributes:
        block_hashes: hashes of the stored blocks, in order, as sent (int or bytes).
        parent_block_hash: hash of the block preceding the first one, or None when the span starts at
            block 0 (it may name a block that was never announced).
        token_ids: the tokens of the stored blocks, flat (normally ``len(block_hashes) * block_size``).
        block_size: tokens per block of this event's KV group (SGLang: tokens of this page).
        lora_id: integer LoRA adapter id or None (vLLM all; SGLang always None).
        medium: where the blocks live, e.g. ``"GPU"``, ``"CPU"``, ``"STORAGE"``, ``"CPU_PINNED"``
            (vLLM ≥ 0.10.2, SGLang ≥ 0.5.9).
        lora_name: LoRA adapter name (vLLM ≥ 0.14, SGLang ≥ 0.5.22).
        extra_keys: one entry per block, None or a tuple of that block's extra hash keys (LoRA name,
            ``(mm_id, offset)``, cache salt, prompt-embeds digest); nested arrays become tuples
            (vLLM ≥ 0.17).
        group_idx: KV-cache group index (vLLM ≥ 0.20).
        kv_cache_spec_kind: the group's attention kind, e.g. ``"full_attention"`` (vLLM ≥ 0.22).
        kv_cache_spec_sliding_window: the group's sliding window in tokens (vLLM ≥ 0.22).
        cache_salt: SGLang cache salt (0.5.18 – 0.5.19 trailing ``{"cache_salt": s}`` map, 0.5.20+ map field).
        session_id: request session id (vLLM ≥ 0.30, SGLang ≥ 0.5.20).
    """

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    cache_salt: str | None = None
    session_id: str | None = None


_WireHash: TypeAlias = int | Annotated[bytes, msgspec.Meta(min_length=1)]
"""`EngineHash` as msgspec checks it while decoding: an int, or ``bin`` of at least one byte."""


class BlockRemoved(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    tag=True,
    tag_field="type",
    forbid_unknown_fields=True,
    gc=False,
):
    """Blocks evicted from an engine's prefix cache (vLLM: one hash per event; SGLang: many).

    A msgspec struct (immutable, untracked by the cyclic collector): vLLM ≥ 0.24's map form of the event,
    ``{"type": "BlockRemoved", "block_hashes": [...], "medium": ..., "group_idx": ...}``, decodes into it
    directly (`decode_batch`), one per evicted block on a busy engine. A map with any other key is refused
    by that decode (and taken by the general path, which ignores the key): a decode into a struct skips an
    unknown key's value unread, so a string in it that is not UTF-8 would go unnoticed.

    Attributes:
        block_hashes: hashes of the removed blocks, as sent.
        medium: the tier they were removed from (vLLM ≥ 0.10.2, SGLang ≥ 0.5.9).
        group_idx: KV-cache group index scoping the removal (vLLM ≥ 0.20).
    """

    block_hashes: tuple[_WireHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine's whole prefix cache was reset (e.g. ``POST /reset_prefix_cache``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceStored:
    """An RFC #1527 ``stored`` event: consecutive blocks named by their rolling sequence hashes.

    The RFC's hash is kvmesh's prefix key (`kvmesh.core.hashing.sequence_hashes`: XXH3-64 seed 1337,
    ``seq[0] = local[0]``, ``seq[i] = XXH3(le64(seq[i-1]) ‖ le64(local[i]))``). A publisher that does not use
    that hash sends ``token_ids`` as well, and kvmesh keys the blocks from the tokens
    (`kvmesh.core.normalize`). Removals and clears of the RFC decode as `BlockRemoved` (``block_hashes`` =
    ``seq_hashes``) and `AllBlocksCleared`.

    Attributes:
        seq_hashes: the blocks' sequence hashes, in order, as unsigned 64-bit ints (a signed int64 on the
            wire is read as the same 64 bits); empty when the publisher could not name them (the Mooncake
            master with an ``object_key`` that is no decimal or ``0x`` hash).
        parent_hash: sequence hash at depth ``base_block_idx - 1`` (unsigned 64-bit), None at the root or
            when not sent.
        base_block_idx: zero-based depth of the first block, or None.
        token_ids: the blocks' tokens, flat, or None (the publisher uses the standard hash).
        block_size: tokens per block, or None (the Mooncake master leaves it to the registration).
        medium: the tier (``"gpu"``, ``"cpu"``, ``"disk"``; the master: ``cpu`` or ``disk``), or None.
        lora_name: LoRA adapter name, or None for the base model.
        additional_salt: opaque deployment salt or namespace, or None.
        tenant_id: tenant or customer identity, or None.
        backend_id: the entity that owns the blocks (an engine worker or a decoupled cache daemon), or None.
        model_name: model identifier, or None.
        dp_rank: the event's data-parallel rank, or None.
        event_id: the publisher's event counter of the stream, or None.
    """

    seq_hashes: tuple[int, ...]
    parent_hash: int | None = None
    base_block_idx: int | None = None
    token_ids: tuple[int, ...] | None = None
    block_size: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    additional_salt: str | None = None
    tenant_id: str | None = None
    backend_id: str | None = None
    model_name: str | None = None
    dp_rank: int | None = None
    event_id: int | None = None


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared | SequenceStored
"""Any decoded KV-cache event."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineBatch:
    """One decoded ``KVEventBatch`` payload.

    Attributes:
        ts: publish time in seconds since the epoch (the engine's ``time.time()``).
        events: the decoded events, in wire order (unknown and invalid events left out).
        dp_rank: vLLM ``data_parallel_rank`` / SGLang ``attn_dp_rank``; None for 2-element batches
            (vLLM 0.9.0, SGLang 0.4.6) or when sent as nil.
        unknown_events: events whose type tag is a string kvmesh does not know; counted and skipped.
        errors: one `InvalidEventError` per event that failed to decode (wrong shape or field type),
            carrying its index and tag; the rest of the batch is still decoded.
    """

    ts: float
    events: tuple[KVEvent, ...]
    dp_rank: int | None
    unknown_events: int = 0
    errors: tuple[InvalidEventError, ...] = ()


# --------------------------------------------------------------------------------------------------------
# Decoding

_DECODER: Final = msgspec.msgpack.Decoder()
_INT_TUPLE: Final = tuple[int, ...]
_CONVERT_MIN: Final[int] = 64  # from this many tokens on, msgspec.convert beats a Python loop

_STORED: Final[str] = "BlockStored"
_REMOVED: Final[str] = "BlockRemoved"
_CLEARED: Final[str] = "AllBlocksCleared"
_ALL_CLEARED: Final[AllBlocksCleared] = AllBlocksCleared()
_MISSING: Final[Any] = object()

_EVENT_TYPE: Final[str] = "event_type"
"""The key that makes a map an RFC #1527 event."""
RFC_STORED: Final[str] = "stored"
RFC_REMOVED: Final[str] = "removed"
RFC_CLEARED: Final[str] = "cleared"
_MS_TS_ABOVE: Final[float] = 1e11
"""An RFC batch ``ts`` above this is in milliseconds (the Mooncake master's ``CurrentUnixTimeMs``)."""


_UNSET: Final[Any] = msgspec.UNSET


class _StoredMap(
    msgspec.Struct, kw_only=True, tag="BlockStored", tag_field="type", forbid_unknown_fields=True
):
    """A map-form ``BlockStored`` as sent: every key `_from_map` reads, absent ones `msgspec.UNSET` (any
    other key: refused, for the general path, as for `BlockRemoved`)."""

    block_hashes: Any = _UNSET
    token_ids: Any = _UNSET
    block_size: Any = _UNSET
    parent_block_hash: Any = _UNSET
    lora_id: Any = _UNSET
    medium: Any = _UNSET
    lora_name: Any = _UNSET
    extra_keys: Any = _UNSET
    mm_keys: Any = _UNSET
    group_idx: Any = _UNSET
    kv_cache_spec_kind: Any = _UNSET
    kv_cache_spec_sliding_window: Any = _UNSET
    cache_salt: Any = _UNSET
    session_id: Any = _UNSET


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", forbid_unknown_fields=True):
    """A map-form ``AllBlocksCleared`` with no other key (one with more: the general path)."""


class _MapBatch(msgspec.Struct, array_like=True):
    """A ``KVEventBatch`` whose events are all vLLM ≥ 0.24 maps of the three known tags."""

    ts: float
    events: list[BlockRemoved | _StoredMap | _ClearedMap]
    dp_rank: int | None = None


_MAP_BATCH: Final = msgspec.msgpack.Decoder(_MapBatch)
_STORED_KEYS: Final[tuple[str, ...]] = _StoredMap.__struct_fields__
_BATCH_HEADS: Final[tuple[bytes, bytes]] = (b"\x92", b"\x93")
"""A batch's first byte when it is a 2- or 3-element array in msgpack's short form (what every publisher
sends): the typed decode cannot tell a longer array, whose extra elements it would ignore."""


def decode_batch(payload: bytes) -> EngineBatch:
    """Decode one ``KVEventBatch`` payload of any vLLM (0.9.0 – 0.33.0) or SGLang (0.4.6 – 0.5.23) release.

    Args:
        payload: the third frame of a live message (or the payload of a replay reply).

    RFC #1527 maps (an ``event_type`` key) decode as `SequenceStored`, `BlockRemoved` and `AllBlocksCleared`;
    the Mooncake master writes the batch time as integer milliseconds, so a batch with RFC events whose ``ts``
    is above ``1e11`` (no time in seconds reaches that before the year 5138) is read as milliseconds.

    Returns:
        The batch with its events decoded. Events with an unknown string tag are counted in
        ``unknown_events``; events of the wrong shape or field type, or holding a string that is not UTF-8,
        are reported in ``errors`` (index and tag) and left out, without affecting the other events.

    Raises:
        PayloadDecodeError: the bytes are not one complete msgpack value (malformed, truncated, trailing
            bytes, nested too deeply).
        NotABatchError: the value is not an array of 2 or 3 elements with an array second, ``ts`` is not a
            number, or ``dp_rank`` is neither an int nor nil.

    Cost: a batch of vLLM ≥ 0.24 maps of the three known tags (no RFC #1527 key anywhere in it) is decoded
    by msgspec into `BlockRemoved` structs directly, checked as the general path checks them (about 0.3 µs
    per one-block removal here, against 0.85 µs through Python maps); any other batch, or one that this
    typed decode refuses for any reason, takes the general path, which gives every error and count as always.
    """
    if type(payload) is bytes and payload[:1] in _BATCH_HEADS and b"event_type" not in payload:
        try:
            typed = _MAP_BATCH.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            pass  # anything unusual: the general path says what, event by event
        else:
            return _from_map_batch(typed)
    return _decode_general(payload)


def _from_map_batch(batch: _MapBatch) -> EngineBatch:
    """`decode_batch` of a batch the typed decode read: removals as decoded, stores through `_from_map`."""
    out: list[KVEvent] = []
    errors: list[InvalidEventError] | None = None
    for index, ev in enumerate(batch.events):
        if type(ev) is BlockRemoved:
            out.append(ev)
        elif type(ev) is _ClearedMap:
            out.append(_ALL_CLEARED)
        else:
            fields: dict[str, Any] = {"type": _STORED}
            for key in _STORED_KEYS:
                value = getattr(ev, key)
                if value is not _UNSET:
                    fields[key] = value
            try:
                decoded = _from_map(fields, index)
            except InvalidEventError as err:
                if errors is None:
                    errors = []
                errors.append(err)
                continue
            assert decoded is not None  # a BlockStored tag
            out.append(decoded)
    return EngineBatch(
        ts=batch.ts, events=tuple(out), dp_rank=batch.dp_rank, errors=() if errors is None else tuple(errors)
    )


def _decode_general(payload: bytes) -> EngineBatch:
    """`decode_batch` of any payload: msgspec into Python values, then every event checked in Python."""
    try:
        obj = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        if "UTF-8" not in str(exc):
            raise PayloadDecodeError(f"payload is not msgpack: {exc}") from exc
        obj = _decode_events_apart(payload, exc)  # one event's bad string must not cost the others
    except RecursionError as exc:
        raise PayloadDecodeError(f"payload is not msgpack: {exc}") from exc
    if type(obj) is not list:
        raise NotABatchError(f"payload is a msgpack {_kind(obj)}, not a KVEventBatch array")
    n = len(obj)
    if n == 3:
        ts, events, dp_rank = obj
        if dp_rank is not None and type(dp_rank) is not int:
            raise NotABatchError(f"dp_rank is a {_kind(dp_rank)}, expected an int or nil")
    elif n == 2:
        ts, events = obj
        dp_rank = None
    else:
        raise NotABatchError(f"KVEventBatch array has {n} elements, expected 2 or 3")
    tts = type(ts)
    if tts is int:
        ts = float(ts)
    elif tts is not float:
        raise NotABatchError(f"ts is a {_kind(ts)}, expected a number")
    if type(events) is not list:
        raise NotABatchError(f"events is a {_kind(events)}, expected an array")

    out: list[KVEvent] = []
    errors: list[InvalidEventError] | None = None
    unknown = 0
    rfc = False
    removed = BlockRemoved
    for index, ev in enumerate(events):
        if type(ev) is dict and ev.get("type") == _REMOVED and _EVENT_TYPE not in ev:
            # vLLM's one removal per evicted block, the bulk of a busy engine's events: `_from_map`'s checks
            # inline (anything it would refuse goes on to it, which raises the same error as always).
            hashes = ev.get("block_hashes")
            medium = ev.get("medium")
            group = ev.get("group_idx")
            if (
                type(hashes) is list
                and (medium is None or type(medium) is str)
                and (group is None or type(group) is int)
                and (
                    (len(hashes) == 1 and type(hashes[0]) is int)
                    or all(type(h) is int or (type(h) is bytes and h) for h in hashes)
                )
            ):
                out.append(removed(block_hashes=tuple(hashes), medium=medium, group_idx=group))
                continue
        try:
            tev = type(ev)
            if tev is _Undecodable:
                rfc = rfc or ev.rfc
                raise InvalidEventError(f"event does not decode: {ev.reason}", index=index, tag=ev.tag)
            if tev is list:
                decoded = _from_array(ev, index)
            elif tev is dict:
                if _EVENT_TYPE in ev:
                    rfc = True
                    decoded = _from_rfc_map(ev, index)
                else:
                    decoded = _from_map(ev, index)
            else:
                raise InvalidEventError(f"event is a {_kind(ev)}, expected an array or a map", index=index)
        except InvalidEventError as err:
            if errors is None:
                errors = []
            errors.append(err)
            continue
        if decoded is None:
            unknown += 1
        else:
            out.append(decoded)
    if rfc and ts > _MS_TS_ABOVE:
        ts /= 1000.0
    return EngineBatch(
        ts=ts,
        events=tuple(out),
        dp_rank=dp_rank,
        unknown_events=unknown,
        errors=() if errors is None else tuple(errors),
    )


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """An event whose bytes do not decode (a string that is not UTF-8), with its tag when it could be read."""

    tag: str | None
    reason: str
    rfc: bool


def _decode_events_apart(payload: bytes, exc: msgspec.DecodeError) -> list[Any]:
    """Decode ``[ts, events, dp_rank]`` event by event (`kvmesh.core.msgpack_spans`): an event that does not
    decode becomes an `_Undecodable`. The batch's own fields must decode.

    Raises:
        PayloadDecodeError: the payload is not a well-formed batch array, or ``ts`` or ``dp_rank`` does not
            decode (``exc`` is named).
    """
    try:
        items, end = array_spans(payload)
        if end != len(payload) or len(items) not in (2, 3) or not is_array(payload, items[1][0]):
            raise SpanError("not a batch array")
        outer = [_DECODER.decode(payload[a:b]) for a, b in (items[0], *items[2:])]
        event_spans, _ = array_spans(payload, items[1][0])
    except (SpanError, msgspec.DecodeError, RecursionError):
        raise PayloadDecodeError(f"payload is not msgpack: {exc}") from exc
    events: list[Any] = []
    for a, b in event_spans:
        raw = payload[a:b]
        try:
            events.append(_DECODER.decode(raw))
        except (msgspec.DecodeError, RecursionError) as err:
            tag, rfc = _peek_tag(raw)
            events.append(_Undecodable(tag, str(err), rfc))
    return [outer[0], events, *outer[1:]]


def _peek_tag(raw: bytes) -> tuple[str | None, bool]:
    """(the tag of an undecodable event, whether it is an RFC #1527 map): an array's first item, or a map's
    ``type`` / ``event_type`` value; (None, False) when that cannot be read either."""
    try:
        if is_array(raw, 0):
            spans, _ = array_spans(raw)
            first = _DECODER.decode(raw[spans[0][0] : spans[0][1]]) if spans else None
            return (first, False) if type(first) is str else (None, False)
        for (ka, kb), (va, vb) in map_spans(raw, 0):
            try:
                key = _DECODER.decode(raw[ka:kb])
            except msgspec.DecodeError:
                continue
            if key in ("type", _EVENT_TYPE):
                value = _DECODER.decode(raw[va:vb])
                if type(value) is str:
                    return value, key == _EVENT_TYPE
    except (SpanError, msgspec.DecodeError, RecursionError):
        pass
    return None, False


def _from_array(ev: list[Any], index: int) -> KVEvent | None:
    """Decode a position-based event ``[tag, f1, …]``; None for an unknown string tag."""
    if not ev:
        raise InvalidEventError("event is an empty array", index=index)
    tag = ev[0]
    n = len(ev)
    if tag == _STORED:
        if n < 5:
            raise InvalidEventError(
                f"BlockStored array has {n} elements, needs at least 5 "
                "(tag, block_hashes, parent_block_hash, token_ids, block_size)",
                index=index,
                tag=tag,
            )
        hashes = _hashes(ev[1], "block_hashes", index, tag)
        parent = _opt_hash(ev[2], index, tag)
        tokens = _tokens(ev[3], index, tag)
        block_size = _block_size(ev[4], index, tag, tokens)
        lora_id = _opt_int(ev[5], "lora_id", index, tag) if n > 5 else None
        medium = _opt_str(ev[6], "medium", index, tag) if n > 6 else None
        lora_name = extra_keys = group_idx = kind = window = cache_salt = None
        if n > 7:
            eighth = ev[7]
            if type(eighth) is dict:  # SGLang 0.5.18-0.5.19 BlockStoredWithMetadata
                cache_salt = _opt_str(eighth.get("cache_salt"), "cache_salt", index, tag)
            else:
                lora_name = _opt_str(eighth, "lora_name", index, tag)
                if n > 8:
                    extra_keys = _extra_keys(ev[8], index, tag)
                    if n > 9:
                        group_idx = _opt_int(ev[9], "group_idx", index, tag)
                        if n > 10:
                            kind = _opt_str(ev[10], "kv_cache_spec_kind", index, tag)
                            if n > 11:
                                window = _opt_int(ev[11], "kv_cache_spec_sliding_window", index, tag)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=block_size,
            lora_id=lora_id,
            medium=medium,
            lora_name=lora_name,
            extra_keys=extra_keys,
            group_idx=group_idx,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            cache_salt=cache_salt,
        )
    if tag == _REMOVED:
        if n < 2:
            raise InvalidEventError("BlockRemoved array has no block_hashes", index=index, tag=tag)
        return BlockRemoved(
            block_hashes=_hashes(ev[1], "block_hashes", index, tag),
            medium=_opt_str(ev[2], "medium", index, tag) if n > 2 else None,
            group_idx=_opt_int(ev[3], "group_idx", index, tag) if n > 3 else None,
        )
    if tag == _CLEARED:
        return _ALL_CLEARED
    if type(tag) is str:
        return None
    raise InvalidEventError(f"event tag is a {_kind(tag)}, expected a string", index=index)


def _from_map(ev: dict[Any, Any], index: int) -> KVEvent | None:
    """Decode a name-based event ``{"type": tag, …}``; None for an unknown string tag."""
    tag = ev.get("type", _MISSING)
    get = ev.get
    if tag == _STORED:
        hashes = get("block_hashes", _MISSING)
        tokens = get("token_ids", _MISSING)
        block_size = get("block_size", _MISSING)
        if hashes is _MISSING or tokens is _MISSING or block_size is _MISSING:
            missing = [
                k
                for k, v in (("block_hashes", hashes), ("token_ids", tokens), ("block_size", block_size))
                if v is _MISSING
            ]
            raise InvalidEventError(f"BlockStored map lacks {', '.join(missing)}", index=index, tag=tag)
        return BlockStored(
            block_hashes=_hashes(hashes, "block_hashes", index, tag),
            parent_block_hash=_opt_hash(get("parent_block_hash"), index, tag),
            token_ids=_tokens(tokens, index, tag),
            block_size=_block_size(block_size, index, tag, tokens),
            lora_id=_opt_int(get("lora_id"), "lora_id", index, tag),
            medium=_opt_str(get("medium"), "medium", index, tag),
            lora_name=_opt_str(get("lora_name"), "lora_name", index, tag),
            extra_keys=_extra_keys(get("extra_keys"), index, tag)
            if get("mm_keys") is None
            else _mm_keys(get("mm_keys"), get("extra_keys"), index, tag),
            group_idx=_opt_int(get("group_idx"), "group_idx", index, tag),
            kv_cache_spec_kind=_opt_str(get("kv_cache_spec_kind"), "kv_cache_spec_kind", index, tag),
            kv_cache_spec_sliding_window=_opt_int(
                get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window", index, tag
            ),
            cache_salt=_opt_str(get("cache_salt"), "cache_salt", index, tag),
            session_id=_opt_str(get("session_id"), "session_id", index, tag),
        )
    if tag == _REMOVED:
        hashes = get("block_hashes", _MISSING)
        if hashes is _MISSING:
            raise InvalidEventError("BlockRemoved map lacks block_hashes", index=index, tag=tag)
        return BlockRemoved(
            block_hashes=_hashes(hashes, "block_hashes", index, tag),
            medium=_opt_str(get("medium"), "medium", index, tag),
            group_idx=_opt_int(get("group_idx"), "group_idx", index, tag),
        )
    if tag == _CLEARED:
        return _ALL_CLEARED
    if type(tag) is str:
        return None
    if tag is _MISSING:
        raise InvalidEventError('event map has no "type" key', index=index)
    raise InvalidEventError(f'event "type" is a {_kind(tag)}, expected a string', index=index)


def _from_rfc_map(ev: dict[Any, Any], index: int) -> KVEvent | None:
    """Decode an RFC #1527 event map; None for an unknown string ``event_type``.

    The RFC's names are read and its aliases ignored (``type``, ``block_hashes``, ``parent_block_hash``:
    the Mooncake master's ``block_hashes`` are its ``seq_hashes`` cast to int64); unknown keys
    (``timestamp``, ``group_id``, ``object_key``, …) are ignored. Errors carry the RFC's tag (``"stored"``,
    ``"removed"``, ``"cleared"``).
    """
    tag = ev[_EVENT_TYPE]
    if type(tag) is not str:
        raise InvalidEventError(f'event "event_type" is a {_kind(tag)}, expected a string', index=index)
    get = ev.get
    if tag in (RFC_STORED, RFC_REMOVED):
        hashes = get("seq_hashes", _MISSING)
        if hashes is _MISSING:
            raise InvalidEventError(f"RFC #1527 {tag} event lacks seq_hashes", index=index, tag=tag)
        seq = _seq_hashes(hashes, index, tag)
        medium = _opt_str(get("medium"), "medium", index, tag)
        base = get("base_block_idx")
        if base is not None and (type(base) is not int or base < 0):
            raise InvalidEventError(
                f"base_block_idx is {_describe(base)}, expected a non-negative int or nil",
                index=index,
                tag=tag,
            )
        if tag == RFC_REMOVED:
            return BlockRemoved(block_hashes=seq, medium=medium)
        parent = get("parent_hash")
        if parent is not None:
            if type(parent) is not int or not _INT_MIN <= parent < _INT_END:
                raise InvalidEventError(
                    f"parent_hash is {_describe(parent)}, expected a 64-bit int or nil", index=index, tag=tag
                )
            parent &= _MASK64
        tokens = get("token_ids")
        block_size = get("block_size")
        if block_size is not None and (type(block_size) is not int or block_size <= 0):
            raise InvalidEventError(
                f"block_size is {_describe(block_size)}, expected a positive int or nil", index=index, tag=tag
            )
        return SequenceStored(
            seq_hashes=seq,
            parent_hash=parent,
            base_block_idx=base,
            token_ids=None if tokens is None else _tokens(tokens, index, tag),
            block_size=block_size,
            medium=medium,
            lora_name=_opt_str(get("lora_name"), "lora_name", index, tag),
            additional_salt=_opt_str(get("additional_salt"), "additional_salt", index, tag),
            tenant_id=_opt_str(get("tenant_id"), "tenant_id", index, tag),
            backend_id=_opt_str(get("backend_id"), "backend_id", index, tag),
            model_name=_opt_str(get("model_name"), "model_name", index, tag),
            dp_rank=_opt_int(get("dp_rank"), "dp_rank", index, tag),
            event_id=_opt_int(get("event_id"), "event_id", index, tag),
        )
    if tag == RFC_CLEARED:
        return _ALL_CLEARED
    return None


def _seq_hashes(v: Any, index: int, tag: str) -> tuple[int, ...]:
    """Validate RFC #1527 ``seq_hashes``: an array of 64-bit ints, returned as unsigned values."""
    if type(v) is not list:
        raise InvalidEventError(f"seq_hashes is a {_kind(v)}, expected an array", index=index, tag=tag)
    for h in v:
        if type(h) is not int or not _INT_MIN <= h < _INT_END:
            raise InvalidEventError(
                f"seq_hashes holds {_describe(h)} (a sequence hash is a 64-bit int)", index=index, tag=tag
            )
    return tuple(h & _MASK64 for h in v)


def _describe(v: Any) -> str:
    """A value for an error message: ints by value, anything else by its msgpack kind."""
    return str(v) if type(v) is int else f"a {_kind(v)}"


def _hashes(v: Any, field: str, index: int, tag: str) -> tuple[EngineHash, ...]:
    """Validate a list of block hashes (int or non-empty bytes) and return it as a tuple."""
    if type(v) is not list:
        raise InvalidEventError(f"{field} is a {_kind(v)}, expected an array", index=index, tag=tag)
    for h in v:
        th = type(h)
        if th is not int and (th is not bytes or not h):
            raise InvalidEventError(f"{field} holds {_hash_problem(h)}", index=index, tag=tag)
    return tuple(v)


def _opt_hash(v: Any, index: int, tag: str) -> EngineHash | None:
    """Validate ``parent_block_hash``: nil, an int or non-empty bytes."""
    if v is None:
        return None
    tv = type(v)
    if tv is int or (tv is bytes and v):
        return v  # type: ignore[no-any-return]
    raise InvalidEventError(f"parent_block_hash is {_hash_problem(v)}", index=index, tag=tag)


def _hash_problem(h: Any) -> str:
    if type(h) is bytes:
        return "an empty bin (a hash needs at least one byte)"
    return f"a {_kind(h)} (a hash must be an int or bin)"


def _tokens(v: Any, index: int, tag: str) -> tuple[int, ...]:
    """Validate ``token_ids`` (a flat array of ints) and return it as a tuple."""
    if type(v) is list:
        if len(v) >= _CONVERT_MIN:
            try:
                return msgspec.convert(v, _INT_TUPLE)
            except msgspec.ValidationError:
                pass
        else:
            for t in v:
                if type(t) is not int:
                    break
            else:
                return tuple(v)
        for t in v:
            if type(t) is list:
                raise InvalidEventError(
                    "token_ids are [a, b] pairs (SGLang EAGLE bigram keys); bigram keys are not supported",
                    index=index,
                    tag=tag,
                )
        bad = next(t for t in v if type(t) is not int)
        raise InvalidEventError(f"token_ids holds a {_kind(bad)}, expected ints", index=index, tag=tag)
    raise InvalidEventError(f"token_ids is a {_kind(v)}, expected an array", index=index, tag=tag)


def _block_size(v: Any, index: int, tag: str, tokens: Any) -> int:
    """A BlockStored's block size: positive, or 0 with no token ids (a tokenless copy of known blocks, as
    vLLM < 0.24's OffloadingConnector reports CPU copies)."""
    if type(v) is not int:
        raise InvalidEventError(f"block_size is a {_kind(v)}, expected an int", index=index, tag=tag)
    if v < 0 or (v == 0 and tokens):
        raise InvalidEventError(f"block_size is {v}, expected a positive int", index=index, tag=tag)
    return v


def _opt_int(v: Any, field: str, index: int, tag: str) -> int | None:
    if v is None or type(v) is int:
        return v
    raise InvalidEventError(f"{field} is a {_kind(v)}, expected an int or nil", index=index, tag=tag)


def _opt_str(v: Any, field: str, index: int, tag: str) -> str | None:
    if v is None or type(v) is str:
        return v
    raise InvalidEventError(f"{field} is a {_kind(v)}, expected a string or nil", index=index, tag=tag)


def _extra_keys(v: Any, index: int, tag: str) -> tuple[Any, ...] | None:
    """Validate ``extra_keys`` (nil, or an array of nil / array per block); nested arrays become tuples."""
    if v is None:
        return None
    if type(v) is not list:
        raise InvalidEventError(f"extra_keys is a {_kind(v)}, expected an array or nil", index=index, tag=tag)
    out: list[tuple[Any, ...] | None] = []
    for entry in v:
        if entry is None:
            out.append(None)
        elif type(entry) is list:
            out.append(_freeze(entry))
        else:
            raise InvalidEventError(
                f"extra_keys entry is a {_kind(entry)}, expected an array or nil", index=index, tag=tag
            )
    return tuple(out)


def _mm_keys(v: Any, extra: Any, index: int, tag: str) -> tuple[Any, ...] | None:
    """TensorRT-LLM's ``mm_keys`` as `BlockStored.extra_keys` (``docs/wire-trtllm.md`` §7.3).

    ``mm_keys`` holds one array per block of ``{"type": "mm_key", "hash": hex, "start_offset": n, "uuid": s?}``
    maps (the multimodal segments in that block); each becomes the extra key ``(hash, start_offset)``, the
    ``(mm_id, offset)`` pair vLLM writes into ``extra_keys``, so an image block never matches a text prompt.
    Entries are appended to the block's ``extra_keys`` entry when both are sent.
    """
    if type(v) is not list:
        raise InvalidEventError(f"mm_keys is a {_kind(v)}, expected an array or nil", index=index, tag=tag)
    base = _extra_keys(extra, index, tag)
    out: list[tuple[Any, ...] | None] = []
    for i, block in enumerate(v):
        if block is not None and type(block) is not list:
            raise InvalidEventError(
                f"mm_keys entry is a {_kind(block)}, expected an array or nil", index=index, tag=tag
            )
        keys: list[Any] = list(base[i] or ()) if base is not None and i < len(base) else []
        for key in block or ():
            if (
                type(key) is not dict
                or type(key.get("hash")) is not str
                or type(key.get("start_offset")) is not int
            ):
                raise InvalidEventError(
                    "mm_keys holds an entry that is not a {hash: string, start_offset: int} map",
                    index=index,
                    tag=tag,
                )
            keys.append((key["hash"], key["start_offset"]))
        out.append(tuple(keys) if keys else None)
    if base is not None and len(base) > len(v):
        out.extend(base[len(v) :])
    return tuple(out)


def _freeze(v: list[Any]) -> tuple[Any, ...]:
    return tuple(_freeze(x) if type(x) is list else x for x in v)


_KINDS: Final[dict[type, str]] = {
    type(None): "nil",
    bool: "bool",
    int: "int",
    float: "float",
    str: "string",
    bytes: "bin",
    list: "array",
    dict: "map",
}


def _kind(v: Any) -> str:
    """The msgpack kind of a generically decoded value, for error messages."""
    return _KINDS.get(type(v), type(v).__name__)


# --------------------------------------------------------------------------------------------------------
# Hash keys and sequence numbers


def engine_key(h: EngineHash) -> int:
    """Fold a wire block hash into an opaque unsigned 64-bit key (meaningful within one worker's stream).

    ``int`` → ``h & (2**64 - 1)``, so the signed and unsigned forms of one 64-bit value agree.
    ``bytes`` (any width) → ``int.from_bytes(h, "big") & (2**64 - 1)``, i.e. the last 8 bytes big-endian —
    exactly vLLM's ``maybe_convert_block_hash`` (0.10.2+), so a block published as ``bin`` and one published
    as int give the same key.

    Args:
        h: a block hash as decoded (`EngineHash`).

    Returns:
        An int in ``[0, 2**64)``.

    Raises:
        WireError: ``h`` is empty bytes or neither an int nor bytes (bools are rejected).
    """
    if type(h) is int:
        return h & _MASK64
    if type(h) is bytes and h:
        return int.from_bytes(h[-8:], "big")
    raise WireError(f"cannot make an engine key from {_hash_problem(h)}")


def decode_seq(frame: bytes) -> int:
    """Read a sequence-number frame: 8 bytes, big-endian unsigned (every vLLM and SGLang release).

    A 24-byte frame is read as its first 8 bytes: vLLM's coming snapshot protocol appends a 16-byte publisher
    epoch to the sequence, which this build does not use yet. Any other length (an empty frame included) is
    no sequence number: read leniently, as vLLM's own ``int.from_bytes(frame, "big")`` does, an empty frame
    would be seq 0 and look like an engine restart.

    Returns:
        The sequence number (`SEQ_END` for the replay end marker).

    Raises:
        WireError: the frame is not 8 or 24 bytes long.
    """
    n = len(frame)
    if n == 8:
        return int.from_bytes(frame, "big")
    if n == _SEQ_EPOCH_FRAME:
        return int.from_bytes(frame[:8], "big")
    raise WireError(f"sequence frame of {n} bytes (expected 8, or {_SEQ_EPOCH_FRAME} with a publisher epoch)")


def encode_seq(seq: int) -> bytes:
    """Write a sequence number as the 8-byte big-endian frame vLLM and SGLang use.

    Raises:
        WireError: ``seq`` is outside ``[0, 2**64)``.
    """
    if not 0 <= seq <= _MASK64:
        raise WireError(f"sequence number {seq} does not fit in 8 unsigned bytes")
    return seq.to_bytes(8, "big")


def encode_replay_request(start_seq: int) -> list[bytes]:
    """Frames a DEALER sends to a publisher's ROUTER replay socket: ``[b"", start_seq as 8 bytes BE]``.

    The publisher answers with every buffered batch whose seq ≥ ``start_seq``, then the end marker
    (see `decode_replay_reply`). A REQ socket would receive only the first reply, so use a DEALER.

    Raises:
        WireError: ``start_seq`` is outside ``[0, 2**64)``.
    """
    return [b"", encode_seq(start_seq)]


@dataclass(frozen=True, slots=True)
class ReplayReply:
    """One reply of a replay exchange, as received by a DEALER.

    Attributes:
        seq: the batch's sequence number (`SEQ_END` for the end marker).
        payload: the batch payload, byte-identical to the live one (empty for the end marker).
        topic: the topic frame (vLLM ≥ 0.26, SGLang ≥ 0.5.22; empty in their end marker), or None for the
            older 3-frame replies.
        is_end: True for the end marker (seq ``ff`` × 8 with an empty payload).
    """

    seq: int
    payload: bytes
    topic: bytes | None
    is_end: bool


def decode_replay_reply(frames: Sequence[bytes]) -> ReplayReply:
    """Parse one replay reply as a DEALER receives it.

    Shapes: ``[b"", seq8, payload]`` (vLLM ≤ 0.25, SGLang ≤ 0.5.21) or ``[b"", topic, seq8, payload]``
    (vLLM ≥ 0.26, SGLang ≥ 0.5.22). The end marker is seq ``ff`` × 8 with an empty payload
    (``[b"", END, b""]`` / ``[b"", b"", END, b""]``).

    Raises:
        WireError: a different frame count, a non-empty delimiter frame, a seq frame that is not 8 bytes,
            or the end seq with a non-empty payload.
    """
    n = len(frames)
    if n == 3:
        delimiter, seq_frame, payload = frames
        topic: bytes | None = None
    elif n == 4:
        delimiter, topic, seq_frame, payload = frames
        topic = bytes(topic)
    else:
        raise WireError(f"replay reply has {n} frames, expected 3 or 4 (delimiter first)")
    if len(delimiter) != 0:
        raise WireError("replay reply does not start with the empty delimiter frame")
    if len(seq_frame) != 8:
        raise WireError(f"replay reply seq frame has {len(seq_frame)} bytes, expected 8")
    seq = int.from_bytes(seq_frame, "big")
    payload = bytes(payload)
    if seq == SEQ_END:
        if payload:
            raise WireError("replay end marker carries a non-empty payload")
        return ReplayReply(seq=seq, payload=payload, topic=topic, is_end=True)
    return ReplayReply(seq=seq, payload=payload, topic=topic, is_end=False)


# --------------------------------------------------------------------------------------------------------
# Encoding (what each release's publisher puts on the wire)

_StructFactory: TypeAlias = Callable[..., msgspec.Struct]

_R: Final[object] = object()  # marks a field without default (always written)


@dataclass(frozen=True, slots=True)
class _Layout:
    """How one release generation encodes a batch."""

    name: str
    batch: _StructFactory
    has_dp_rank: bool
    stored: _StructFactory
    stored_fields: tuple[str, ...]  # BlockStored attributes this generation carries
    removed: _StructFactory
    removed_fields: tuple[str, ...]
    cleared: _StructFactory
    salted: _StructFactory | None = None  # SGLang 0.5.18-0.5.19 BlockStoredWithMetadata
    bytes_hashes: bool = False  # may publish hashes as bin (vLLM >= 0.10.2)
    int_from_bytes: bool = False  # converts bytes hashes to ints like maybe_convert_block_hash
    mm_keys: bool = False  # writes multimodal extra keys as TensorRT-LLM's per-block mm_keys


def _struct(
    name: str, fields: Sequence[tuple[str, object]], *, array_like: bool, tag: bool
) -> _StructFactory:
    """A msgspec struct with the publisher's options (``omit_defaults=True, gc=False``, tag = class name)."""
    spec = [(f, Any) if default is _R else (f, Any, None) for f, default in fields]
    return msgspec.defstruct(
        name,
        spec,
        array_like=array_like,
        omit_defaults=True,
        gc=False,
        tag=name if tag else None,
    )


# vLLM field tables: (field, R or None default, first generation letter).
_VLLM_STORED: Final = (
    ("block_hashes", _R, "A"),
    ("parent_block_hash", _R, "A"),
    ("token_ids", _R, "A"),
    ("block_size", _R, "A"),
    ("lora_id", _R, "A"),
    ("medium", _R, "C"),
    ("lora_name", _R, "D"),
    ("extra_keys", None, "E"),
    ("group_idx", None, "F"),
    ("kv_cache_spec_kind", None, "G"),
    ("kv_cache_spec_sliding_window", None, "G"),
    ("locality", None, "I"),
    ("ownership", None, "J"),
    ("session_id", None, "K"),
    ("lookahead_token_ids", None, "L"),
)
_VLLM_REMOVED: Final = (
    ("block_hashes", _R, "A"),
    ("medium", _R, "C"),
    ("group_idx", None, "F"),
    ("locality", None, "I"),
    ("ownership", None, "J"),
)
# (generation, first release); each generation runs up to the next one's first release.
_VLLM_GENERATIONS: Final = (
    ("A", (0, 9, 0)),
    ("B", (0, 9, 1)),
    ("C", (0, 10, 2)),
    ("D", (0, 14, 0)),
    ("E", (0, 17, 0)),
    ("F", (0, 20, 0)),
    ("G", (0, 22, 0)),
    ("H", (0, 24, 0)),
    ("I", (0, 26, 0)),
    ("J", (0, 29, 0)),
    ("K", (0, 30, 0)),
    ("L", (0, 33, 0)),
)
_VLLM_AFTER_LAST: Final = (0, 34, 0)
_SGLANG_AFTER_LAST: Final = (0, 5, 24)

_STORED_ATTRS: Final = frozenset(BlockStored.__dataclass_fields__)
_REMOVED_ATTRS: Final = frozenset(BlockRemoved.__struct_fields__)


def _vllm_layout(gen: str) -> _Layout:
    maps = gen >= "H"
    stored = [(f, d) for f, d, since in _VLLM_STORED if since <= gen]
    removed = [(f, d) for f, d, since in _VLLM_REMOVED if since <= gen]
    batch: list[tuple[str, object]] = [("ts", _R), ("events", _R)]
    if gen >= "B":
        batch.append(("data_parallel_rank", None))
    return _Layout(
        name=f"vLLM generation {gen}",
        batch=_struct("KVEventBatch", batch, array_like=True, tag=False),
        has_dp_rank=gen >= "B",
        stored=_struct(_STORED, stored, array_like=not maps, tag=True),
        stored_fields=tuple(f for f, _ in stored if f in _STORED_ATTRS),
        removed=_struct(_REMOVED, removed, array_like=not maps, tag=True),
        removed_fields=tuple(f for f, _ in removed if f in _REMOVED_ATTRS),
        cleared=_struct(_CLEARED, (), array_like=not maps, tag=True),
        bytes_hashes=gen >= "C",
        int_from_bytes=gen >= "C",
    )


_SG_BASE: Final[tuple[tuple[str, object], ...]] = (
    ("block_hashes", _R),
    ("parent_block_hash", _R),
    ("token_ids", _R),
    ("block_size", _R),
    ("lora_id", _R),
)


def _sglang_layouts() -> tuple[tuple[tuple[int, int, int], _Layout], ...]:
    """SGLang rows of the generation table (wire-protocol notes §5)."""
    batch2 = _struct("KVEventBatch", [("ts", _R), ("events", _R)], array_like=True, tag=False)
    batch3 = _struct(
        "KVEventBatch", [("ts", _R), ("events", _R), ("attn_dp_rank", None)], array_like=True, tag=False
    )
    cleared_a = _struct(_CLEARED, (), array_like=True, tag=True)
    cleared_m = _struct(_CLEARED, (), array_like=False, tag=True)
    base_fields = tuple(f for f, _ in _SG_BASE)
    stored_a5 = _struct(_STORED, _SG_BASE, array_like=True, tag=True)
    removed_a1 = _struct(_REMOVED, [("block_hashes", _R)], array_like=True, tag=True)
    stored_a6 = _struct(_STORED, [*_SG_BASE, ("medium", None)], array_like=True, tag=True)
    removed_a2 = _struct(_REMOVED, [("block_hashes", _R), ("medium", None)], array_like=True, tag=True)
    salted = _struct(_STORED, [*_SG_BASE, ("medium", None), ("metadata", None)], array_like=True, tag=True)
    map_fields = [*_SG_BASE, ("medium", None), ("cache_salt", None), ("session_id", None)]
    stored_m = _struct(_STORED, map_fields, array_like=False, tag=True)
    stored_m_lora = _struct(_STORED, [*map_fields, ("lora_name", None)], array_like=False, tag=True)
    removed_m = _struct(_REMOVED, [("block_hashes", _R), ("medium", None)], array_like=False, tag=True)

    def row(name: str, **kw: Any) -> _Layout:
        return _Layout(name=f"SGLang {name}", **kw)

    return (
        ((0, 4, 6), row("0.4.6.post5", batch=batch2, has_dp_rank=False, stored=stored_a5,
                        stored_fields=base_fields, removed=removed_a1, removed_fields=("block_hashes",),
                        cleared=cleared_a)),
        ((0, 4, 7), row("0.4.7-0.5.8", batch=batch3, has_dp_rank=True, stored=stored_a5,
                        stored_fields=base_fields, removed=removed_a1, removed_fields=("block_hashes",),
                        cleared=cleared_a)),
        ((0, 5, 9), row("0.5.9-0.5.17", batch=batch3, has_dp_rank=True, stored=stored_a6,
                        stored_fields=(*base_fields, "medium"), removed=removed_a2,
                        removed_fields=("block_hashes", "medium"), cleared=cleared_a)),
        ((0, 5, 18), row("0.5.18-0.5.19", batch=batch3, has_dp_rank=True, stored=stored_a6,
                         stored_fields=(*base_fields, "medium"), removed=removed_a2,
                         removed_fields=("block_hashes", "medium"), cleared=cleared_a, salted=salted)),
        ((0, 5, 20), row("0.5.20-0.5.21", batch=batch3, has_dp_rank=True, stored=stored_m,
                         stored_fields=(*base_fields, "medium", "cache_salt", "session_id"),
                         removed=removed_m, removed_fields=("block_hashes", "medium"), cleared=cleared_m)),
        ((0, 5, 22), row("0.5.22-0.5.23", batch=batch3, has_dp_rank=True, stored=stored_m_lora,
                         stored_fields=(*base_fields, "medium", "cache_salt", "session_id", "lora_name"),
                         removed=removed_m, removed_fields=("block_hashes", "medium"), cleared=cleared_m)),
    )  # fmt: skip


def _trtllm_layout() -> _Layout:
    """TensorRT-LLM's streaming publisher (``tensorrt_llm/_torch/pyexecutor/kv_cache_events.py``, KV cache
    manager V2; ``docs/wire-trtllm.md``): map events whose fields without a default are always written (nil
    when None), the ``[ts, events, data_parallel_rank]`` envelope, int hashes only."""
    required = (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    )
    optional = (
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "mm_keys",
    )
    stored = [(f, _R) for f in required] + [(f, None) for f in optional]
    removed: list[tuple[str, object]] = [
        ("block_hashes", _R),
        ("medium", _R),
        ("group_idx", None),
        ("locality", None),
    ]
    return _Layout(
        name="TensorRT-LLM streaming",
        batch=_struct(
            "KVEventBatch",
            [("ts", _R), ("events", _R), ("data_parallel_rank", None)],
            array_like=True,
            tag=False,
        ),
        has_dp_rank=True,
        stored=_struct(_STORED, stored, array_like=False, tag=True),
        stored_fields=(*required, "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
        removed=_struct(_REMOVED, removed, array_like=False, tag=True),
        removed_fields=("block_hashes", "medium", "group_idx"),
        cleared=_struct(_CLEARED, (), array_like=False, tag=True),
        mm_keys=True,
    )


_TRTLLM_FIRST: Final = (1, 3, 0)
_TRTLLM_AFTER_LAST: Final = (1, 4, 0)

_LAYOUTS: Final[dict[str, tuple[tuple[tuple[int, int, int], _Layout], ...]]] = {
    "vllm": tuple((first, _vllm_layout(gen)) for gen, first in _VLLM_GENERATIONS),
    "sglang": _sglang_layouts(),
    "trtllm": ((_TRTLLM_FIRST, _trtllm_layout()),),
}
_AFTER_LAST: Final[dict[str, tuple[int, int, int]]] = {
    "vllm": _VLLM_AFTER_LAST,
    "sglang": _SGLANG_AFTER_LAST,
    "trtllm": _TRTLLM_AFTER_LAST,
}

_VERSION_RE: Final = re.compile(
    r"v?(\d+)\.(\d+)(?:\.(\d+))?"  # major.minor[.patch]
    r"(?:\.\d+)*"  # 0.9.0.1, 0.10.1.1
    r"(?:[.-]?(?:post|rc|a|b|dev)\d*)*"  # 0.4.6.post5, 0.24.0rc1, 0.5.0.dev3
    r"(?:\+[0-9A-Za-z.]+)?"  # local tags: 0.10.2+cu128
)
_ENCODER: Final = msgspec.msgpack.Encoder()


def _layout(producer: str, version: str) -> _Layout:
    table = _LAYOUTS.get(producer.lower())
    if table is None:
        raise ValueError(f"unknown producer {producer!r}; expected 'vllm', 'sglang' or 'trtllm'")
    m = _VERSION_RE.fullmatch(version.strip())
    if m is None:
        raise ValueError(f"cannot read version {version!r}")
    v = (int(m[1]), int(m[2]), int(m[3] or 0))
    if v >= _AFTER_LAST[producer.lower()] or v < table[0][0]:
        raise ValueError(f"{producer} {version} is outside the releases kvmesh knows the wire format of")
    chosen = table[0][1]
    for first, layout in table:
        if v >= first:
            chosen = layout
    return chosen


def encode_batch(
    batch: EngineBatch, *, producer: str = "vllm", version: str = "0.33.0", hash_form: str = "int"
) -> bytes:
    """Encode a batch exactly as the given release's ``ZmqEventPublisher`` would.

    Array events with the release's full field count before vLLM 0.24 / SGLang 0.5.20 (msgspec ignores
    ``omit_defaults`` for array-like structs); maps afterwards, with required fields always present (nil when
    None) and optional ones only when not None, header sized as msgspec does (``map16`` for vLLM 0.33's
    16-field BlockStored). ``[ts, events]`` for vLLM 0.9.0.x / SGLang 0.4.6.x, else ``[ts, events, dp_rank]``.
    SGLang 0.5.18 – 0.5.19 writes a salted BlockStored as 8 elements ending in ``{"cache_salt": s}``.
    TensorRT-LLM (1.3, streaming events of KV cache manager V2) writes maps with ``lora_id``, ``medium`` and
    ``lora_name`` always present and the ``(hash, start_offset)`` pairs of ``extra_keys`` as ``mm_keys``.
    Fields the release does not carry are dropped, as are ``unknown_events`` and ``errors``; ``ts`` is
    written as float64. ``producer="mooncake"`` writes RFC #1527 maps as the Mooncake store master does
    (`encode_rfc1527_batch` with its defaults; ``version`` is not used).

    Args:
        batch: the batch to encode.
        producer: ``"vllm"``, ``"sglang"``, ``"trtllm"`` or ``"mooncake"``.
        version: a release such as ``"0.10.2"``, ``"0.9.0.1"``, ``"0.4.6.post5"``, ``"1.3.0rc21"``; any
            release of a generation maps to that generation.
        hash_form: ``"int"`` (ints are written as they are; bytes hashes are converted like vLLM's
            ``maybe_convert_block_hash`` on vLLM ≥ 0.10.2 and rejected elsewhere) or ``"bytes"``
            (vLLM ≥ 0.10.2 with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; every hash must be bytes).

    Returns:
        The msgpack payload.

    Raises:
        ValueError: unknown producer, version or hash form; ``"bytes"`` for a release that cannot send bin
            hashes; a hash that the chosen form cannot carry (wrong type, empty bytes, int outside
            ``[-2**63, 2**64)``).
    """
    if producer.lower() == "mooncake":
        del version
        if hash_form != "int":
            raise ValueError("the Mooncake master publishes int sequence hashes only")
        return encode_rfc1527_batch(batch)
    layout = _layout(producer, version)
    if hash_form not in ("int", "bytes"):
        raise ValueError(f"unknown hash_form {hash_form!r}; expected 'int' or 'bytes'")
    if hash_form == "bytes" and not layout.bytes_hashes:
        raise ValueError(f"{layout.name} ({producer} {version}) cannot publish hashes as bytes")
    want_bytes = hash_form == "bytes"

    def wire_hash(h: Any) -> EngineHash:
        th = type(h)
        if want_bytes:
            if th is bytes and h:
                return h  # type: ignore[no-any-return]
            raise ValueError(f"hash_form='bytes' needs non-empty bytes hashes, got {h!r}")
        if th is int:
            if _INT_MIN <= h < _INT_END:
                return h  # type: ignore[no-any-return]
            raise ValueError(f"hash {h} does not fit in msgpack int64/uint64")
        if th is bytes and h and layout.int_from_bytes:
            return int.from_bytes(h[-8:], "big")
        raise ValueError(f"{layout.name} publishes int hashes; cannot send {h!r}")

    events: list[msgspec.Struct] = []
    for ev in batch.events:
        if type(ev) is BlockStored:
            kw = {f: getattr(ev, f) for f in layout.stored_fields}
            kw["block_hashes"] = tuple(wire_hash(h) for h in ev.block_hashes)
            parent = ev.parent_block_hash
            kw["parent_block_hash"] = None if parent is None else wire_hash(parent)
            if layout.mm_keys and ev.extra_keys is not None:
                kw["mm_keys"] = [
                    [{"type": "mm_key", "hash": k[0], "start_offset": k[1]} for k in entry or ()]
                    for entry in ev.extra_keys
                ]
            if layout.salted is not None and ev.cache_salt is not None:
                events.append(layout.salted(**kw, metadata={"cache_salt": ev.cache_salt}))
            else:
                events.append(layout.stored(**kw))
        elif type(ev) is BlockRemoved:
            kw = {f: getattr(ev, f) for f in layout.removed_fields}
            kw["block_hashes"] = tuple(wire_hash(h) for h in ev.block_hashes)
            events.append(layout.removed(**kw))
        elif type(ev) is AllBlocksCleared:
            events.append(layout.cleared())
        else:
            raise ValueError(f"not a KV event: {ev!r}")
    ts = float(batch.ts)
    out = layout.batch(ts, events, batch.dp_rank) if layout.has_dp_rank else layout.batch(ts, events)
    try:
        return _ENCODER.encode(out)
    except OverflowError as exc:
        raise ValueError(f"a field does not fit in a msgpack int: {exc}") from exc


def encode_rfc1527_batch(
    batch: EngineBatch,
    *,
    aliases: bool = True,
    backend_id: str = "mooncake",
    tenant_id: str = "default",
    first_event_id: int = 0,
) -> bytes:
    """Encode a batch of RFC #1527 event maps the way the Mooncake store master's ``KvEventPublisher`` does.

    The payload is ``[ts_ms (int), events, dp_rank (0 when None)]``; each event a map with the envelope
    (``event_id``, ``timestamp``, ``event_type``, ``model_name``, ``block_size``, ``additional_salt``,
    ``lora_name``, ``tenant_id``, ``backend_id``, ``group_id`` nil, ``medium``, ``dp_rank``) and, for
    ``stored``, ``seq_hashes``, ``base_block_idx``, ``parent_hash`` and ``token_ids``; ``removed`` carries
    ``seq_hashes`` and ``base_block_idx`` nil, ``cleared`` the envelope alone. With ``aliases`` (the
    master's default ``emit_legacy_compat_fields``) every map also has ``type`` (``BlockStored``,
    ``BlockRemoved``, ``AllBlocksCleared``), ``block_hashes`` (the sequence hashes as int64) and, on stored
    events, ``parent_block_hash``. Envelope fields a `SequenceStored` carries are written from it, the
    others from the arguments; ``event_id`` is the event's own or ``first_event_id`` + its position.

    Args:
        batch: `SequenceStored`, `BlockRemoved` (int hashes, written as ``seq_hashes``) and
            `AllBlocksCleared` events.
        aliases: also write the vLLM-style aliases.
        backend_id: the cache owner named in events that do not carry one.
        tenant_id: the tenant named in events that do not carry one.
        first_event_id: ``event_id`` of the batch's first event (when the event carries none).

    Returns:
        The msgpack payload.

    Raises:
        ValueError: an event of another type, or a hash that is not an int in ``[-2**63, 2**64)``.
    """
    ts_ms = int(batch.ts * 1000)

    def u64(h: Any) -> int:
        if type(h) is not int or not _INT_MIN <= h < _INT_END:
            raise ValueError(f"RFC #1527 hashes are 64-bit ints; cannot send {h!r}")
        return h & _MASK64

    def signed(h: int) -> int:
        return h - (1 << 64) if h >= 1 << 63 else h

    events: list[dict[str, Any]] = []
    for i, ev in enumerate(batch.events):
        stored = ev if type(ev) is SequenceStored else None
        m: dict[str, Any] = {
            "event_id": stored.event_id if stored and stored.event_id is not None else first_event_id + i,
            "timestamp": ts_ms,
        }
        if type(ev) is SequenceStored:
            m["event_type"], legacy = RFC_STORED, _STORED
        elif type(ev) is BlockRemoved:
            m["event_type"], legacy = RFC_REMOVED, _REMOVED
        elif type(ev) is AllBlocksCleared:
            m["event_type"], legacy = RFC_CLEARED, _CLEARED
        else:
            raise ValueError(f"not an RFC #1527 event: {ev!r}")
        if aliases:
            m["type"] = legacy
        m["model_name"] = stored.model_name if stored else None
        m["block_size"] = stored.block_size if stored else None
        m["additional_salt"] = stored.additional_salt if stored else None
        m["lora_name"] = stored.lora_name if stored else None
        m["tenant_id"] = stored.tenant_id if stored and stored.tenant_id is not None else tenant_id
        m["backend_id"] = stored.backend_id if stored and stored.backend_id is not None else backend_id
        m["group_id"] = None
        m["medium"] = ev.medium if type(ev) is not AllBlocksCleared else None  # type: ignore[union-attr]
        m["dp_rank"] = stored.dp_rank if stored else None
        if type(ev) is AllBlocksCleared:
            events.append(m)
            continue
        hashes = [u64(h) for h in (ev.seq_hashes if stored else ev.block_hashes)]  # type: ignore[union-attr]
        m["seq_hashes"] = hashes
        if aliases:
            m["block_hashes"] = [signed(h) for h in hashes]
        if stored is not None:
            m["base_block_idx"] = stored.base_block_idx
            m["parent_hash"] = None if stored.parent_hash is None else u64(stored.parent_hash)
            m["token_ids"] = None if stored.token_ids is None else list(stored.token_ids)
            if aliases:
                m["parent_block_hash"] = (
                    None if stored.parent_hash is None else signed(u64(stored.parent_hash))
                )
        else:
            m["base_block_idx"] = None
        events.append(m)
    return _ENCODER.encode([ts_ms, events, 0 if batch.dp_rank is None else batch.dp_rank])
