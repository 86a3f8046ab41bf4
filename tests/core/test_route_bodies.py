"""Exact-value tests of the route request forms: JSON, packed token ids, pre-hashed local block hashes
(`kvmesh.core.route.parse_route_message`), and the pre-hashed match (`kvmesh.router.hashed_match`)."""

from __future__ import annotations

import json
import struct
from array import array
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core import protocol as p
from kvmesh.core import route as route_module
from kvmesh.core.errors import RequestError, UnknownModelError
from kvmesh.core.events import Event, EventsMessage, Stored
from kvmesh.core.hashing import local_block_hashes, prefix_keys, prompt_prefix_keys
from kvmesh.core.protocol import PolicyOverride, RouteRequest
from kvmesh.core.route import parse_route_message, parse_route_request
from kvmesh.core.state import HolderMatch, IndexState, MatchResult
from kvmesh.router.hashed_match import iter_prefix_keys_of, match_local_hashes

TOKENS = [0, 1, 2, 3, 4, 5, 6, 7]
LOCAL = [9143094415614847814, 12124091508212882195]  # hashing's golden vector: tokens 0..7, block size 4
FIELDS = '{"model":"m","request_id":"r-1","candidates":["w1"],"explain":true,"policy":{"temperature":0.5}}'


def tokens_headers(fields: str = FIELDS) -> dict[str, str]:
    return {p.BODY_HEADER: p.BODY_TOKENS_U32LE, p.FIELDS_HEADER: fields}


def hashes_headers(fields: str = FIELDS) -> dict[str, str]:
    return {p.BODY_HEADER: p.BODY_HASHES_U64LE, p.FIELDS_HEADER: fields}


def bad(body: bytes, headers: dict[str, str] | None) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_route_message(body, headers)
    return info.value


def test_golden_local_hashes_are_the_ones_the_forms_carry() -> None:
    """The pre-hashed form carries exactly `local_block_hashes`'s values (Dynamo's LocalBlockHash)."""
    assert local_block_hashes(TOKENS, 4) == LOCAL


def test_packed_tokens_decode_to_the_json_request() -> None:
    """A tokens-u32le body with its fields header is the same request as the JSON one, ids in an array."""
    body = struct.pack("<8I", *TOKENS)
    assert body[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    req = parse_route_message(body, tokens_headers())
    assert isinstance(req.token_ids, array)
    assert req.token_ids.typecode == "I"
    assert list(req.token_ids) == TOKENS
    from_json = parse_route_request(
        b'{"model":"m","token_ids":[0,1,2,3,4,5,6,7],"request_id":"r-1","candidates":["w1"],'
        b'"explain":true,"policy":{"temperature":0.5}}'
    )
    assert (req.model, req.request_id, req.candidates, req.explain, req.policy) == (
        "m",
        "r-1",
        ["w1"],
        True,
        PolicyOverride(temperature=0.5),
    )
    # A plain JSON array is scanned into an array('I') too (the compiled scan), the same ids.
    assert isinstance(from_json.token_ids, array) and from_json.token_ids.typecode == "I"
    as_list = [msgspec.structs.replace(r, token_ids=list(r.token_ids)) for r in (req, from_json)]
    assert p.encode(as_list[0]) == p.encode(as_list[1])
    # The largest token id survives the packing: 0xFFFFFFFF.
    top = parse_route_message(b"\xff\xff\xff\xff", tokens_headers('{"model":"m"}'))
    assert list(top.token_ids) == [2**32 - 1]


def test_json_and_absent_body_header_are_the_default_form() -> None:
    """No headers, or Kvmesh-Body: json, parse the body as JSON."""
    body = b'{"model":"m","token_ids":[5,6]}'
    for headers in (None, {}, {p.BODY_HEADER: p.BODY_JSON}, {"traceparent": "00-x"}):
        got = parse_route_message(body, headers)
        assert msgspec.structs.replace(got, token_ids=list(got.token_ids)) == RouteRequest(
            model="m", token_ids=[5, 6]
        )


def test_pre_hashed_requests_decode_from_json_and_from_packed_u64() -> None:
    """block_hashes in JSON and a hashes-u64le body give the same hashes; 2**64 − 1 is a valid hash."""
    top = 2**64 - 1
    req = parse_route_request(
        b'{"model":"m","block_hashes":[9143094415614847814,18446744073709551615],"block_size":4,'
        b'"prompt_tokens":11}'
    )
    assert (req.block_hashes, req.block_size, req.prompt_tokens, req.token_ids) == (
        [LOCAL[0], top],
        4,
        11,
        (),
    )
    packed = struct.pack("<2Q", LOCAL[0], top)
    binary = parse_route_message(packed, hashes_headers('{"model":"m","block_size":4,"prompt_tokens":11}'))
    assert isinstance(binary.block_hashes, array)
    assert list(binary.block_hashes) == [LOCAL[0], top]
    assert (binary.block_size, binary.prompt_tokens, binary.token_ids) == (4, 11, ())


@pytest.mark.parametrize(
    ("body", "headers", "field", "message"),
    [
        (b"\x01\x00\x00\x00\x02", tokens_headers(), "token_ids", "whole number of 4-byte ids: got 5 bytes"),
        (b"\x01\x00\x00", tokens_headers(), "token_ids", "got 3 bytes"),
        (b"", tokens_headers(), "token_ids", "token_ids must not be empty"),
        (b"\x00" * 12, hashes_headers(), "block_hashes", "whole number of 8-byte ids: got 12 bytes"),
        (b"", hashes_headers(), "block_hashes", "block_hashes must not be empty"),
        (b"\x00" * 4, {p.BODY_HEADER: p.BODY_TOKENS_U32LE}, "Kvmesh-Route", "needs the Kvmesh-Route header"),
        (b"\x00" * 4, {p.BODY_HEADER: "tokens-u16le"}, "Kvmesh-Body", "unknown Kvmesh-Body 'tokens-u16le'"),
        (b"\x00" * 4, tokens_headers("{"), None, "Kvmesh-Route header is not valid JSON"),
        (b"\x00" * 4, tokens_headers('{"model":7}'), "model", "Expected `str`, got `int`"),
        (b"\x00" * 4, tokens_headers('{"token_ids":[1]}'), "model", "missing required field `model`"),
        (b"\x00" * 4, tokens_headers('{"model":"m","token_ids":[1]}'), "Kvmesh-Route", "must not carry"),
        (b"\x00" * 8, hashes_headers('{"model":"m","block_hashes":[1]}'), "Kvmesh-Route", "must not carry"),
        (b"\x00" * 8, hashes_headers('{"model":"m","cache_salt":"t"}'), "cache_salt", "mixed into"),
        (b"\x00" * 8, hashes_headers('{"model":"m","lora_name":"a"}'), "lora_name", "mixed into"),
        (b"\x00" * 8, hashes_headers('{"model":"m","block_size":0}'), "block_size", "must be positive"),
        (
            b"\x00" * 8,
            tokens_headers('{"model":"m","block_size":4}'),
            "block_size",
            "with block_hashes or seq_hashes only",
        ),
        (
            b"\x00" * 16,
            hashes_headers('{"model":"m","block_size":4,"prompt_tokens":7}'),
            "prompt_tokens",
            "8",
        ),
        (
            b'{"model":"m"}',
            None,
            "token_ids",
            "token_ids must not be empty (or send block_hashes or seq_hashes)",
        ),
        (b'{"model":"m","token_ids":[1],"block_hashes":[2]}', None, "block_hashes", "not more"),
        (
            b'{"model":"m","block_hashes":[1,18446744073709551616]}',
            None,
            "block_hashes",
            "block_hashes[1] is",
        ),
        (
            b'{"model":"m","block_hashes":[3,4,-1]}',
            None,
            "block_hashes",
            "block_hashes[2] is outside [0, 2^64)",
        ),
        (b'{"model":"m","block_hashes":[1.5]}', None, "block_hashes", "Expected `int`, got `float`"),
        (b'{"model":"m","block_hashes":[]}', None, "block_hashes", "block_hashes must not be empty"),
    ],
)
def test_bad_bodies_are_request_errors_naming_the_field(
    body: bytes, headers: dict[str, str] | None, field: str | None, message: str
) -> None:
    """Truncated or odd-length bodies, missing or bad field headers, both or neither ids, hashes out of
    range, and salt or LoRA beside pre-hashed ids: each a RequestError (answered bad_request) naming the field."""
    err = bad(body, headers)
    assert err.field == field
    assert message in str(err)


def test_the_prompt_limit_counts_tokens_or_blocks() -> None:
    """max_tokens bounds the packed tokens and the number of hashes alike."""
    with pytest.raises(RequestError, match="token_ids has 3 tokens, more than the limit of 2"):
        parse_route_message(b"\x00" * 12, tokens_headers('{"model":"m"}'), max_tokens=2)
    with pytest.raises(RequestError, match="block_hashes has 3 blocks, more than the limit of 2"):
        parse_route_message(b"\x00" * 24, hashes_headers('{"model":"m"}'), max_tokens=2)


def test_protocol_decode_refuses_a_request_without_ids() -> None:
    """`protocol.decode` (every decoder of RouteRequest) refuses neither ids and both, naming the field."""
    with pytest.raises(RequestError) as info:
        p.decode(b'{"model":"m","block_hashes":[1],"token_ids":[1]}', RouteRequest)
    assert info.value.field == "block_hashes"
    assert p.decode(b'{"model":"m","block_hashes":[1]}', RouteRequest) == RouteRequest(
        model="m", block_hashes=[1]
    )


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 40])
def test_chunked_prefix_keys_are_the_hashing_modules(n: int) -> None:
    """The pre-hashed match's lazily chunked chain yields exactly `prefix_keys` of the same hashes."""
    hashes = local_block_hashes(list(range(4 * n)), 4)
    assert list(iter_prefix_keys_of(hashes)) == prefix_keys(hashes)
    assert list(iter_prefix_keys_of(hashes, chunk=3)) == prompt_prefix_keys(list(range(4 * n)), 4)


def _state() -> IndexState:
    """w1 holds blocks 0–3 of PROMPT, w2 blocks 0–1, w3 (block size 8) block 0; w4 salted blocks 0-1."""
    local = local_block_hashes(PROMPT, 4)
    salted = local_block_hashes(PROMPT, 4, cache_salt="tenant")
    state = IndexState()

    def msg(worker: str, events: list[Event], bs: int = 4) -> EventsMessage:
        return EventsMessage(
            worker_id=worker, dp_rank=0, model="m", block_size=bs, epoch=1, seq=1, events=events
        )

    state.apply(1, msg("w1", [Stored([11, 12, 13, 14], None, local[:4])]))
    state.apply(2, msg("w2", [Stored([21, 22], None, local[:2])]))
    state.apply(3, msg("w3", [Stored([31], None, local_block_hashes(PROMPT, 8)[:1])], bs=8))
    state.apply(4, msg("w4", [Stored([41, 42], None, salted[:2])]))
    return state


PROMPT = list(range(1000, 1020))  # 5 blocks of 4, 2 full blocks of 8


def _hm(worker: str, overlap: int, cached: int, bs: int = 4) -> HolderMatch:
    return HolderMatch(
        worker_id=worker,
        dp_rank=0,
        overlap_blocks=overlap,
        cached_blocks=cached,
        block_size=bs,
        overlap_tokens=overlap * bs,
    )


def test_the_pre_hashed_match_equals_the_token_match_for_the_hashes_block_size() -> None:
    """Matching local hashes gives the token match's overlaps for holders of their block size; a holder of
    another size counts none; salt mixed in by the caller finds the salted blocks."""
    state = _state()
    by_tokens = state.match("m", PROMPT)
    assert by_tokens == MatchResult(
        index_seq=4,
        block_size=4,
        prompt_blocks=5,
        candidates=(_hm("w1", 4, 4), _hm("w2", 2, 2), _hm("w3", 1, 1, 8), _hm("w4", 0, 2)),
    )
    hashes = local_block_hashes(PROMPT, 4)
    assert match_local_hashes(state, "m", hashes) == MatchResult(
        index_seq=4,
        block_size=4,
        prompt_blocks=5,
        candidates=(_hm("w1", 4, 4), _hm("w2", 2, 2), _hm("w3", 0, 1, 8), _hm("w4", 0, 2)),
    )
    assert match_local_hashes(state, "m", hashes, block_size=4) == match_local_hashes(state, "m", hashes)
    by8 = match_local_hashes(state, "m", local_block_hashes(PROMPT, 8), block_size=8)
    assert by8.block_size == 8
    assert by8.prompt_blocks == 2
    assert by8.candidates == (_hm("w1", 0, 4), _hm("w2", 0, 2), _hm("w3", 1, 1, 8), _hm("w4", 0, 2))
    salted = match_local_hashes(state, "m", local_block_hashes(PROMPT, 4, cache_salt="tenant"))
    assert salted.candidates == state.match("m", PROMPT, cache_salt="tenant").candidates
    assert [c.overlap_blocks for c in salted.candidates] == [0, 0, 0, 2]
    unsized = match_local_hashes(state, "m", hashes, block_size=16)
    assert (unsized.block_size, [c.overlap_blocks for c in unsized.candidates]) == (16, [0, 0, 0, 0])
    with pytest.raises(UnknownModelError):
        match_local_hashes(state, "other", hashes)


def _parsed_or_error(parse: Any, body: bytes) -> Any:
    try:
        req = parse(body)
    except RequestError as exc:
        return ("error", str(exc), exc.field)
    return msgspec.structs.replace(req, token_ids=list(req.token_ids))


def _whole_json(body: bytes) -> RouteRequest:
    """The route body decoded whole by msgspec, as before the compiled scan (then the same checks)."""
    req = route_module._decode_json(body, "request body")
    route_module.check_route_request(req)
    return req


_token = st.one_of(
    st.integers(0, 2**32 - 1), st.integers(2**32, 2**33), st.integers(-5, -1), st.floats(allow_nan=False),
    st.just("7"), st.booleans(), st.none(),
)  # fmt: skip


@st.composite
def _route_body(draw: st.DrawFn) -> bytes:
    tokens = draw(st.lists(st.integers(0, 2**32 - 1) if draw(st.booleans()) else _token, max_size=6))
    fields: dict[str, Any] = {"model": draw(st.sampled_from(["m", "m", "m", 3, None])), "token_ids": tokens}
    if draw(st.booleans()):
        fields["request_id"] = draw(st.sampled_from(["r-1", "", 5]))
    if draw(st.booleans()):
        fields["block_hashes"] = draw(st.lists(st.integers(0, 9), max_size=2))
    if draw(st.booleans()):
        fields["policy"] = draw(st.sampled_from([None, {"temperature": 0.5}, {"temperature": -1}, {"x": 1}]))
    text = json.dumps(fields)
    spaces = draw(st.sampled_from(["", " ", "\n\t "]))
    text = text.replace(", ", "," + spaces).replace("[", "[" + spaces)
    if draw(st.integers(0, 9)) == 0:
        text = text.replace('"token_ids"', '"token_\\u0069ds"')  # an escaped member name: not scanned
    if draw(st.integers(0, 9)) == 0:
        text = text[: draw(st.integers(0, len(text)))]  # truncated
    return text.encode()


@settings(max_examples=500, deadline=None)
@given(_route_body())
def test_scanned_route_bodies_parse_as_the_whole_json_decode(body: bytes) -> None:
    """`parse_route_request` (token ids by the compiled scan when they are a plain array) gives the same
    request, or the same error and field, as decoding the whole body with msgspec."""
    assert _parsed_or_error(parse_route_request, body) == _parsed_or_error(_whole_json, body)
