"""``/query`` bodies whose ``token_ids`` are scanned in one compiled pass (`kvmesh.router.http_api.decode_query`)
answer exactly as the same prompt decoded by msgspec into Python ints, and every body the scan refuses keeps
the answer or the error it had before (pure: an `IndexState` fed stored events, no server)."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.events import Event, EventsMessage, Stored
from kvmesh.core.hashing import local_block_hashes
from kvmesh.core.state import IndexState
from kvmesh.router.http_api import (
    ApiError,
    QueryBody,
    _check_query,
    _match,
    answer_query,
    decode_body,
    decode_query,
)

BS = 16
RNG = random.Random(3)
PROMPTS = [[RNG.randrange(150_000) for _ in range(40 * BS + 7)] for _ in range(6)]


def _state() -> IndexState:
    """Three workers; each holds a different leading part of every prompt (w2 under a salt for prompt 0)."""
    state = IndexState()
    stream_seq = 0
    for p, tokens in enumerate(PROMPTS):
        for w, n in enumerate((40, 25, 9)):
            salt = "tenant-a" if (p, w) == (0, 2) else None
            local = local_block_hashes(tokens[: n * BS], BS, cache_salt=salt)
            stream_seq += 1
            events = list[Event]([Stored([10_000 * p + 100 * w + i for i in range(n)], None, local)])
            state.apply(
                stream_seq,
                EventsMessage(
                    worker_id=f"w{w}", dp_rank=w, model="m", block_size=BS, epoch=1, seq=p + 1, events=events
                ),
            )
    return state


STATE = _state()


def _slow(body: bytes) -> dict[str, object]:
    """The answer with the token ids decoded by msgspec into Python ints (the path before the scan)."""
    q = decode_body(body, QueryBody)
    assert q.token_ids is not None
    result = STATE.match("m", q.token_ids, cache_salt=q.cache_salt)
    return {
        "default": {
            c.worker_id: {
                "longest_matched": c.overlap_blocks * BS,
                "GPU": c.overlap_blocks * BS,
                "CPU": c.overlap_blocks * BS,
                "DISK": c.overlap_blocks * BS,
                "DP": {str(c.dp_rank): c.overlap_blocks * BS},
            }
            for c in result.candidates
        }
    }


@pytest.mark.parametrize("p", range(len(PROMPTS)))
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_scanned_token_ids_answer_as_decoded_ones(p: int, salt: str | None) -> None:
    body = msgspec.json.encode({"model": "m", "block_size": BS, "token_ids": PROMPTS[p], "cache_salt": salt})
    q, tokens = decode_query(body)
    assert tokens is not None
    assert q.token_ids == []
    assert tokens.tolist() == PROMPTS[p]
    got = answer_query(STATE, body, by_hash=False, tenants={})
    assert got == _slow(body)
    w0 = got["default"]["w0"]
    assert isinstance(w0, dict)
    assert w0["longest_matched"] == (0 if salt else 40 * BS)


def test_the_expected_overlaps_of_the_state() -> None:
    body = msgspec.json.encode({"model": "m", "block_size": BS, "token_ids": PROMPTS[1]})
    got = answer_query(STATE, body, by_hash=False, tenants={})
    assert {w: v["longest_matched"] for w, v in got["default"].items()} == {"w0": 640, "w1": 400, "w2": 144}
    salted = msgspec.json.encode(
        {"model": "m", "block_size": BS, "token_ids": PROMPTS[0], "cache_salt": "tenant-a"}
    )
    got = answer_query(STATE, salted, by_hash=False, tenants={})
    assert {w: v["longest_matched"] for w, v in got["default"].items()} == {"w0": 0, "w1": 0, "w2": 144}


@pytest.mark.parametrize(
    ("ids", "status", "message"),
    [
        (
            b"[1, -1]",
            400,
            "token ids must be integers in [0, 2^32): can't convert negative value to unsigned int",
        ),
        (
            b"[1, 4294967296]",
            400,
            "token ids must be integers in [0, 2^32): unsigned int is greater than maximum",
        ),
        (
            b"[1.5]",
            400,
            "Failed to deserialize the JSON body into the target type: Expected `int`, got `float`",
        ),
        (
            b'["7"]',
            400,
            "Failed to deserialize the JSON body into the target type: Expected `int`, got `str`",
        ),
        (b"[1,]", 400, "Failed to parse the request body as JSON: "),
        (b"[01]", 400, "Failed to parse the request body as JSON: "),
        (
            b"7",
            400,
            "Failed to deserialize the JSON body into the target type: Expected `array | null`, got `int`",
        ),
    ],
)
def test_bodies_the_scan_refuses_keep_their_errors(ids: bytes, status: int, message: str) -> None:
    body = b'{"model": "m", "block_size": 16, "token_ids": ' + ids + b"}"
    with pytest.raises(ApiError) as err:
        answer_query(STATE, body, by_hash=False, tenants={})
    assert err.value.status == status
    assert err.value.message.startswith(message), err.value.message


def test_a_null_or_missing_token_ids_is_the_missing_field_error() -> None:
    for body in (b'{"model": "m", "block_size": 16, "token_ids": null}', b'{"model": "m", "block_size": 16}'):
        with pytest.raises(ApiError) as err:
            answer_query(STATE, body, by_hash=False, tenants={})
        assert (err.value.status, err.value.message) == (400, "missing field `token_ids`")


def test_an_exponent_that_msgspec_reads_as_an_int_still_answers() -> None:
    """The scan refuses ``[1e2]``-like forms; whatever msgspec makes of them is the answer (here: refused)."""
    body = b'{"model": "m", "block_size": 16, "token_ids": [1e2]}'
    with pytest.raises(ApiError) as err:
        answer_query(STATE, body, by_hash=False, tenants={})
    assert err.value.status == 400


@pytest.mark.parametrize(
    "body",
    [
        # given twice (msgspec keeps the last), under an escaped name, and among members of every kind
        b'{"model": "m", "block_size": 16, "token_ids": [1, 2], "token_ids": '
        + msgspec.json.encode(PROMPTS[2])
        + b"}",
        b'{"model": "m", "block_size": 16, "token\\u005fids": ' + msgspec.json.encode(PROMPTS[2]) + b"}",
        b'{"tenant_id": "default", "model": "m", "x": {"y": ["}", 1.5]}, "token_ids": '
        + msgspec.json.encode(PROMPTS[2])
        + b', "block_size": 16, "cache_salt": null}',
    ],
)
def test_odd_but_valid_bodies_answer_as_msgspec_decodes_them(body: bytes) -> None:
    got = answer_query(STATE, body, by_hash=False, tenants={})
    assert got == _slow(body)
    assert {w: v["longest_matched"] for w, v in got["default"].items()} == {"w0": 640, "w1": 400, "w2": 144}


def _outcome(body: bytes, *, scanned: bool) -> tuple[object, ...]:
    """The match (or the error) of a body by the scanning path or by msgspec alone."""
    try:
        if scanned:
            q, tokens = decode_query(body)
        else:
            q, tokens = decode_body(body, QueryBody), None
        spec = _check_query(q, by_hash=False)
        return ("ok", _match(STATE, q, spec, by_hash=False, tokens=tokens))
    except ApiError as exc:
        return ("error", exc.status, exc.message)


_BASES = [
    msgspec.json.encode({"model": "m", "block_size": BS, "token_ids": PROMPTS[0][:40], "cache_salt": None}),
    b'{"x": {"y": ["}", 1.5]}, "token_ids": [1, 2, 3], "model": "m", "block_size": 16}',
]


@settings(max_examples=400, deadline=None)
@given(
    base=st.sampled_from(_BASES),
    edits=st.lists(
        st.tuples(
            st.integers(0, 3), st.integers(0, 10_000), st.sampled_from(list(b' \t\n[]{}",:\\0159-.eEtn'))
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_any_mangled_body_answers_or_fails_as_msgspec_alone_would(
    base: bytes, edits: list[tuple[int, int, int]]
) -> None:
    """Bytes deleted, inserted or replaced anywhere in a body: the scanning path gives the same match or the
    same error (status and message) as decoding it with msgspec alone."""
    body = bytearray(base)
    for op, pos, byte in edits:
        i = pos % (len(body) + 1)
        if op == 0 and body:
            del body[min(i, len(body) - 1)]
        elif op == 1:
            body.insert(i, byte)
        elif body:
            body[min(i, len(body) - 1)] = byte
    assert _outcome(bytes(body), scanned=True) == _outcome(bytes(body), scanned=False)
