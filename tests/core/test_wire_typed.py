"""`kvmesh.core.wire.decode_batch`'s typed path (vLLM ≥ 0.24 maps decoded by msgspec straight into
`BlockRemoved`) gives exactly what the general path gives: the same events, counts and errors, on every
captured release and on generated batches with every kind of bad field."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.core import wire
from kvmesh.core.errors import NotABatchError
from kvmesh.core.wire import BlockRemoved, BlockStored, EngineBatch, decode_batch

FRAMES_DIR = Path(__file__).resolve().parent.parent / "data" / "frames"


def _outcome(payload: bytes, decode: Any) -> Any:
    """What a decode gives, comparable: the batch with its errors as (type, message, index, tag), or the
    exception's type and message."""
    try:
        b: EngineBatch = decode(payload)
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))
    errors = tuple((type(e).__name__, str(e), e.index, e.tag) for e in b.errors)
    return (b.ts, b.events, b.dp_rank, b.unknown_events, errors)


def _typed_takes(payload: bytes) -> bool:
    """Whether the typed decode reads this payload (rather than handing it to the general path)."""
    if payload[:1] not in wire._BATCH_HEADS or b"event_type" in payload:
        return False
    try:
        wire._MAP_BATCH.decode(payload)
    except msgspec.DecodeError:
        return False
    return True


def test_captured_frames_decode_the_same_both_ways() -> None:
    """Every payload of every captured release: the same outcome; the vLLM ≥ 0.24 ones take the typed path."""
    typed: dict[str, bool] = {}
    for path in sorted(FRAMES_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        for batch in data["batches"]:
            payload = bytes.fromhex(batch["frames_hex"][2])
            assert _outcome(payload, decode_batch) == _outcome(payload, wire._decode_general), batch["name"]
            typed[path.name] = typed.get(path.name, False) or _typed_takes(payload)
    assert typed == {
        "sglang-0.5.22.json": True,
        "sglang-0.5.9.json": False,
        "vllm-0.10.2-bytes.json": False,
        "vllm-0.17.0.json": False,
        "vllm-0.24.0.json": True,
        "vllm-0.33.0-dp1.json": True,
        "vllm-0.33.0.json": True,
        "vllm-0.9.1.json": False,
    }


def test_one_block_removals_decode_into_block_removed() -> None:
    """vLLM's removal maps, an int and a bin hash, come out as `BlockRemoved` with their exact fields."""
    payload = msgspec.msgpack.encode(
        [
            12.5,
            [
                {"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": "GPU", "group_idx": 0},
                {"block_hashes": [b"\x01\x02"], "type": "BlockRemoved"},
                {"type": "AllBlocksCleared"},
            ],
            3,
        ]
    )
    assert _typed_takes(payload)
    got = decode_batch(payload)
    assert got == EngineBatch(
        ts=12.5,
        events=(
            BlockRemoved(block_hashes=(2**64 - 1,), medium="GPU", group_idx=0),
            BlockRemoved(block_hashes=(b"\x01\x02",)),
            wire.AllBlocksCleared(),
        ),
        dp_rank=3,
    )


def test_a_longer_batch_array_is_refused_as_before() -> None:
    """Four elements: the typed decode would ignore the fourth, so it is not used; the batch is refused."""
    payload = msgspec.msgpack.encode([1.0, [], 0, "extra"])
    assert not _typed_takes(payload)
    with pytest.raises(NotABatchError, match="KVEventBatch array has 4 elements, expected 2 or 3"):
        decode_batch(payload)


def test_a_bad_store_among_removals_is_reported_alone() -> None:
    """A BlockStored without token_ids in a typed batch: its error at its index, the removals kept."""
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockRemoved", "block_hashes": [7]},
                {"type": "BlockStored", "block_hashes": [8], "block_size": 16},
                {"type": "BlockRemoved", "block_hashes": [9]},
            ],
        ]
    )
    assert _typed_takes(payload)
    got = decode_batch(payload)
    assert got.events == (BlockRemoved(block_hashes=(7,)), BlockRemoved(block_hashes=(9,)))
    assert [(str(e), e.index, e.tag) for e in got.errors] == [
        ("event 1 (BlockStored): BlockStored map lacks token_ids", 1, "BlockStored")
    ]
    assert got.dp_rank is None


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False),
    st.binary(max_size=3),
    st.text(max_size=3),
)
_values = st.one_of(
    _scalars, st.lists(_scalars, max_size=3), st.lists(st.lists(_scalars, max_size=2), max_size=2)
)
_keys = st.sampled_from(
    ["block_hashes", "medium", "group_idx", "token_ids", "block_size", "parent_block_hash", "lora_id",
     "lora_name", "extra_keys", "mm_keys", "kv_cache_spec_kind", "cache_salt", "session_id", "locality"]
)  # fmt: skip
_tags = st.one_of(st.sampled_from(["BlockRemoved", "BlockStored", "AllBlocksCleared", "Other"]), _scalars)


@st.composite
def _event(draw: st.DrawFn) -> Any:
    ev: dict[Any, Any] = draw(st.dictionaries(_keys, _values, max_size=5))
    if draw(st.booleans()):  # mostly well-formed removals and stores, as engines send them
        kind = draw(st.sampled_from(["removed", "stored"]))
        if kind == "removed":
            ev = {
                "type": "BlockRemoved",
                "block_hashes": draw(st.lists(st.integers(0, 2**64 - 1), max_size=2)),
            }
        else:
            ev = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 2,
                  "parent_block_hash": draw(st.one_of(st.none(), st.integers(0, 9)))}  # fmt: skip
        ev.update(draw(st.dictionaries(_keys, _values, max_size=1)))
    if draw(st.integers(0, 9)) > 0:
        ev["type"] = draw(_tags)
    if draw(st.integers(0, 19)) == 0:
        ev["event_type"] = "removed"
    if draw(st.integers(0, 19)) == 0:
        return draw(_values)  # not a map at all
    return ev


@st.composite
def _payload(draw: st.DrawFn) -> bytes:
    ts = draw(st.one_of(st.floats(allow_nan=False), st.integers(-(2**63), 2**64 - 1), _scalars))
    events = draw(st.lists(_event(), max_size=5))
    batch: list[Any] = [ts, events]
    n = draw(st.integers(0, 9))
    if n > 1:
        batch.append(draw(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), _scalars)))
    if n == 9:
        batch.append(1)
    return msgspec.msgpack.encode(batch)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_payload())
def test_generated_batches_decode_the_same_both_ways(payload: bytes) -> None:
    """Any batch (good and bad fields, unknown tags, RFC keys, non-maps, odd ts and dp_rank, extra array
    elements): `decode_batch` and the general path give the same outcome."""
    assert _outcome(payload, decode_batch) == _outcome(payload, wire._decode_general)


@st.composite
def _known_tag_payload(draw: st.DrawFn) -> bytes:
    """A batch the typed decode reads unless a field's type stops it: known tags, any field values."""
    events = []
    for _ in range(draw(st.integers(1, 6))):
        ev: dict[str, Any] = draw(st.dictionaries(_keys, _values, max_size=4))
        if draw(st.booleans()):
            ev["block_hashes"] = draw(st.lists(st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=2))))
        ev["type"] = draw(
            st.sampled_from(["BlockRemoved", "BlockRemoved", "BlockStored", "AllBlocksCleared"])
        )
        events.append(ev)
    ts = draw(st.one_of(st.floats(allow_nan=False), st.integers(0, 2**64 - 1)))
    dp = draw(st.lists(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)), max_size=1))
    return msgspec.msgpack.encode([ts, events, *dp])


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_known_tag_payload())
def test_generated_map_batches_decode_the_same_both_ways(payload: bytes) -> None:
    """Batches of the three known tags with any field values (the typed decode's own checks, and its stores
    handed to the general rules): the same outcome as the general path."""
    assert _outcome(payload, decode_batch) == _outcome(payload, wire._decode_general)


def test_block_removed_is_still_a_plain_event() -> None:
    """The event type as code builds it: keyword construction, defaults, equality, hashing, immutability."""
    a = BlockRemoved(block_hashes=(1, b"\x02"), medium="CPU")
    assert (a.block_hashes, a.medium, a.group_idx) == ((1, b"\x02"), "CPU", None)
    assert a == BlockRemoved(block_hashes=(1, b"\x02"), medium="CPU", group_idx=None)
    assert a != BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(), block_size=0)  # type: ignore[comparison-overlap]
    assert len({a, BlockRemoved(block_hashes=(1, b"\x02"), medium="CPU")}) == 1
    with pytest.raises(AttributeError):
        a.medium = "GPU"  # type: ignore[misc]


def _fixstr(raw: bytes) -> bytes:
    return bytes([0xA0 | len(raw)]) + raw


def _removal_with(key: bytes, value: bytes) -> bytes:
    """A one-block removal map (hash 1) with one more key, built byte by byte (msgspec writes only UTF-8)."""
    return (
        b"\x83"
        + _fixstr(b"type") + _fixstr(b"BlockRemoved")
        + _fixstr(b"block_hashes") + b"\x91\x01"
        + key + value
    )  # fmt: skip


@pytest.mark.parametrize(
    ("key", "value", "expect"),
    [
        (_fixstr(b"locality"), b"\xa2\xff\xfe", "event 0 (BlockRemoved): event does not decode"),
        (b"\xa2\xff\xfe", b"\x01", "event 0 (BlockRemoved): event does not decode"),
        (_fixstr(b"locality"), b"\xd7\xff" + b"\xff" * 8, "raised"),
        (_fixstr(b"locality"), b"\xa1x", None),
    ],
    ids=["bad-utf8-value", "bad-utf8-key", "bad-timestamp", "plain-extra-key"],
)
def test_an_unknown_key_is_read_as_the_general_path_reads_it(
    key: bytes, value: bytes, expect: str | None
) -> None:
    """A key the typed decode does not know sends the batch down the general path, which reads its value:
    a string that is not UTF-8 makes the event an error there (a struct decode would skip it unread and
    keep the removal), a broken timestamp refuses the batch, a plain extra key is ignored."""
    payload = b"\x93\xcb" + struct.pack(">d", 1.0) + b"\x91" + _removal_with(key, value) + b"\x00"
    assert not _typed_takes(payload)
    got = _outcome(payload, decode_batch)
    assert got == _outcome(payload, wire._decode_general)
    if expect == "raised":
        assert got[:2] == ("raised", "PayloadDecodeError")
    elif expect is None:
        assert got == (1.0, (BlockRemoved(block_hashes=(1,)),), 0, 0, ())
    else:
        assert got[1] == () and got[4][0][1].startswith(expect)


def test_a_memoryview_payload_is_decoded_by_the_general_path() -> None:
    """An RFC #1527 batch with vLLM aliases handed over as a memoryview (whose ``in`` cannot find the RFC
    key): the same batch as from bytes, its millisecond ts and unsigned hashes read the RFC way."""
    payload = msgspec.msgpack.encode(
        [1_700_000_000_000, [{"event_type": "removed", "type": "BlockRemoved", "seq_hashes": [2**64 - 1],
                              "block_hashes": [-1]}], 0]
    )  # fmt: skip
    from_bytes = decode_batch(payload)
    assert decode_batch(memoryview(payload)) == from_bytes  # type: ignore[arg-type]
    assert (from_bytes.ts, from_bytes.events) == (1_700_000_000.0, (BlockRemoved(block_hashes=(2**64 - 1,)),))
