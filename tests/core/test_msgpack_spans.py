"""`kvmesh.core.msgpack_spans` against msgspec's encoder, and `decode_batch` setting apart an event whose
string is not UTF-8."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.core.errors import PayloadDecodeError
from kvmesh.core.msgpack_spans import MAX_DEPTH, SpanError, array_spans, map_spans, value_end
from kvmesh.core.wire import BlockRemoved, BlockStored, EngineBatch, decode_batch, encode_batch

_enc = msgspec.msgpack.Encoder().encode
_ext = msgspec.msgpack.Ext
values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=300)
    | st.binary(max_size=300)
    | st.builds(_ext, st.integers(0, 127), st.sampled_from([0, 1, 2, 3, 4, 8, 16, 17, 300]).map(bytes)),
    lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=5), inner, max_size=20),
    max_leaves=60,
)


@given(items=st.lists(values, max_size=20))
def test_spans_cut_an_array_exactly_where_its_items_lie(items: list[Any]) -> None:
    data = _enc(items)
    spans, end = array_spans(data)
    assert end == len(data)
    assert [data[a:b] for a, b in spans] == [_enc(x) for x in items]
    assert value_end(data, 0) == len(data)


def test_map_spans_and_large_widths() -> None:
    """Keys and values of a map; str 16/32, bin 32, array 16 and map 16 headers."""
    big = {"k" * 300: b"x" * 70000, "n": list(range(20)), "m": {str(i): i for i in range(20)}}
    data = _enc(big)
    pairs = map_spans(data, 0)
    assert [msgspec.msgpack.decode(data[a:b]) for (a, b), _ in pairs] == list(big)
    assert [msgspec.msgpack.decode(data[a:b]) for _, (a, b) in pairs] == list(big.values())


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x92\x01", "truncated"),
        (b"\xda\x00\x10ab", "truncated"),
        (b"\x91\xc1", "unused msgpack marker 0xc1"),
        (b"\x91" * (MAX_DEPTH + 2) + b"\x00", "nested deeper"),
    ],
)
def test_malformed_bytes_raise(data: bytes, why: str) -> None:
    with pytest.raises(SpanError, match=why):
        value_end(data, 0)


def _two_events(salt: str = "QQQQQQQQ") -> bytes:
    batch = EngineBatch(
        ts=1.0,
        events=(
            BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(1, 2), block_size=2),
            BlockStored(
                block_hashes=(2,), parent_block_hash=None, token_ids=(3, 4), block_size=2, cache_salt=salt
            ),
            BlockRemoved(block_hashes=(9,)),
        ),
        dp_rank=0,
    )
    return encode_batch(batch, producer="sglang", version="0.5.22")


def test_an_event_with_a_string_that_is_not_utf8_is_rejected_alone_with_its_tag() -> None:
    """The other events decode exactly; the bad one is an error at its index, tagged BlockStored (so the
    ingest under-states, and does not clear the rank)."""
    payload = _two_events().replace(b"QQQQQQQQ", b"\xff\xfe\xfd\xfc" * 2)
    batch = decode_batch(payload)
    assert batch.events == (
        BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(1, 2), block_size=2),
        BlockRemoved(block_hashes=(9,)),
    )
    (err,) = batch.errors
    assert (err.index, err.tag) == (1, "BlockStored")
    assert "Invalid UTF-8" in err.reason
    assert (batch.ts, batch.dp_rank) == (1.0, 0)


def test_a_bad_string_outside_the_events_still_fails_the_batch() -> None:
    """Only events are set apart: a batch with trailing bytes, or whose own fields do not decode, is still
    refused whole."""
    payload = _two_events().replace(b"QQQQQQQQ", b"\xff\xfe\xfd\xfc" * 2)
    with pytest.raises(PayloadDecodeError, match="UTF-8"):
        decode_batch(payload + b"\x00")  # trailing bytes
    with pytest.raises(PayloadDecodeError, match="UTF-8"):
        decode_batch(b"\x93\xa2\xff\xfe\x90\x00")  # ts is a string that is not UTF-8
