"""The compiled prompt path: XXH3-64 of token blocks in every length class, the prompt's prefix keys in one
call, and the scan of a JSON token-id array; each checked against ``xxhash``, the pure-Python chain and
msgspec."""

from __future__ import annotations

import random
import struct
from array import array

import msgspec
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core import tables
from kvmesh.core.errors import RequestError
from kvmesh.core.hashing import SEED, lora_seed, prompt_prefix_keys

# Words per block that reach each XXH3 length class: 4 – 8 bytes, 9 – 16, 17 – 128, 129 – 240, and the long
# path (> 240 bytes) with 1, 2 and 3 1,024-byte blocks, its stripe edges and partial last stripes.
WORDS = [
    1,
    2,
    3,
    4,
    5,
    8,
    9,
    16,
    17,
    24,
    25,
    32,
    33,
    48,
    59,
    60,
    61,
    64,
    65,
    128,
    255,
    256,
    257,
    300,
    512,
    769,
]
SEEDS = [0, 1, SEED, 2**63, 2**64 - 1, lora_seed("sql-adapter")]


def _local(tokens: np.ndarray, seed: int) -> int:
    sec, derived = tables.secret_table(seed)
    out = np.zeros(1, dtype=np.uint64)
    tables.block_locals(tokens, tokens.shape[0], np.uint64(seed), sec, derived, out)
    return int(out[0])


@pytest.mark.parametrize("seed", SEEDS)
def test_block_hash_is_xxhash_xxh3_64_in_every_length_class(seed: int) -> None:
    rng = random.Random(seed % 1000)
    for n in WORDS:
        for _ in range(3):
            tokens = np.array([rng.getrandbits(32) for _ in range(n)], dtype=np.uint32)
            want = xxhash.xxh3_64_intdigest(struct.pack(f"<{n}I", *tokens.tolist()), seed=seed)
            assert _local(tokens, seed) == want, (seed, n)


def test_block_hash_gives_dynamos_published_local_hashes() -> None:
    """Dynamo's ``LocalBlockHash`` of tokens 0..7 in blocks of 4."""
    tokens = np.arange(8, dtype=np.uint32)
    assert [_local(tokens[:4], SEED), _local(tokens[4:], SEED)] == [9143094415614847814, 12124091508212882195]


@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 64, 100, 512])
def test_prompt_keys_equal_the_pure_python_chain(block_size: int) -> None:
    rng = random.Random(block_size)
    ids = [rng.randrange(2**32) for _ in range(2 * 1024 + 5)]
    tokens = tables.token_array(ids)
    for lora, salt in [(None, None), ("sql-adapter", None), (None, "tenant-a"), ("sql-adapter", "tenant-a")]:
        got = tables.prompt_keys(tokens, block_size, lora_name=lora, cache_salt=salt)
        want = prompt_prefix_keys(ids, block_size, lora_name=lora, cache_salt=salt)
        assert got.dtype == np.uint64
        assert got.tolist() == want, (block_size, lora, salt)


def test_prompt_keys_of_a_prompt_shorter_than_a_block_are_empty() -> None:
    assert tables.prompt_keys(tables.token_array([1, 2, 3]), 4).tolist() == []
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        tables.prompt_keys(tables.token_array([1]), 0)


def test_token_array_takes_lists_arrays_and_uint32_arrays_and_checks_the_range() -> None:
    assert tables.token_array([0, 7, 2**32 - 1]).tolist() == [0, 7, 2**32 - 1]
    packed = array("I", [5, 6])
    view = tables.token_array(packed)
    assert view.tolist() == [5, 6]
    assert np.shares_memory(view, np.frombuffer(packed, dtype=np.uint32))
    ready = np.array([1, 2], dtype=np.uint32)
    assert tables.token_array(ready) is ready
    with pytest.raises(RequestError, match="token ids must be integers"):
        tables.token_array([1, -1])
    with pytest.raises(RequestError, match="token ids must be integers"):
        tables.token_array([2**32])


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (b"[]", []),
        (b"[ ]", []),
        (b"[1,2,3]", [1, 2, 3]),
        (b" [ 1 , 2 ,3 ] ", [1, 2, 3]),
        (b"[\n1,\t2\r]", [1, 2]),
        (b"[0]", [0]),
        (b"[0,0]", [0, 0]),
        (b"[4294967295]", [4294967295]),
    ],
)
def test_scan_reads_plain_arrays_of_token_ids(raw: bytes, want: list[int]) -> None:
    got = tables.scan_token_ids(raw)
    assert got is not None
    assert got.dtype == np.uint32
    assert got.tolist() == want == msgspec.json.decode(raw, type=list[int])


@pytest.mark.parametrize(
    "raw",
    [
        b"[4294967296]",  # 2**32
        b"[99999999999]",
        b"[184467440737095516160]",  # wraps an int64 accumulator
        b"[01]",
        b"[00]",
        b"[-1]",
        b"[-0]",
        b"[1.0]",
        b"[1e2]",
        b"[1E2]",
        b"[1,]",
        b"[,1]",
        b"[,]",
        b"[1 2]",
        b"[1]]",
        b"[[1]]",
        b'["1"]',
        b"[true]",
        b"[null]",
        b"[",
        b"[1",
        b"[1,",
        b"",
        b"1",
        b"null",
        b"[1] x",
        b"[1]\x00",
        b"[\xa01]",  # a non-breaking space is not JSON whitespace
    ],
)
def test_scan_refuses_everything_else(raw: bytes) -> None:
    """The scan never decides an error: a refused form goes to the full decoder, which accepts what JSON and
    the field's type allow and names what they refuse."""
    assert tables.scan_token_ids(raw) is None


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    spaces=st.lists(st.sampled_from(["", " ", "\n", "\t", "\r", "  "]), min_size=4, max_size=4),
)
def test_scan_equals_msgspec_on_any_spacing(ids: list[int], spaces: list[str]) -> None:
    a, b, c, d = spaces
    raw = (a + "[" + b + (c + "," + d).join(str(i) for i in ids) + c + "]" + a).encode()
    got = tables.scan_token_ids(raw)
    assert got is not None
    assert got.tolist() == msgspec.json.decode(raw, type=list[int]) == ids


@pytest.mark.parametrize(
    "body",
    [
        b'{"token_ids": [1, 2]}',
        b' { "model" : "m" , "token_ids" : [1,2] } ',
        b'{"model": "a \\" } ] [ { \\\\", "token_ids": [1, 2], "block_size": 16}',
        b'{"x": {"y": [1, {"z": "}"}], "w": []}, "token_ids": [1, 2], "n": null, "t": true, "f": -1.5e3}',
        b'{"x": [[[]]], "token_ids": [1,2], "y": {}}',
        b'{"token_idsx": [9], "token_ids": [1, 2], "token_id": [8]}',
    ],
)
def test_body_scan_finds_token_ids_among_any_members(body: bytes) -> None:
    got = tables.scan_body_token_ids(body)
    assert got is not None
    ids, start, end = got
    assert ids.tolist() == [1, 2] == msgspec.json.decode(body)["token_ids"]
    assert msgspec.json.decode(body[start:end]) == [1, 2]
    assert body[start : start + 1] == b"["
    assert body[end - 1 : end] == b"]"


@pytest.mark.parametrize(
    "body",
    [
        b'{"token_ids": [1], "token_ids": [2]}',  # given twice: the full decoder decides which counts
        b'{"token\\u005fids": [1]}',  # an escaped name could spell the key
        b'{"model": "m", "token\\u005fids": [2], "token_ids": [1]}',
        b'{"model": "m"}',
        b"{}",
        b"[1, 2]",
        b'{"token_ids": [1.5]}',
        b'{"token_ids": "1"}',
        b'{"token_ids": null}',
        b'{"token_ids": [1]',
        b'{"token_ids": [1]} x',
        b'{"token_ids" [1]}',
        b'{"model": "m" "token_ids": [1]}',
        b'{"model": "unterminated, "token_ids": [1]}',
        b'{"x": [1, "token_ids": [1]}',
        b'{model: "m", "token_ids": [1]}',
        b"",
    ],
)
def test_body_scan_refuses_what_the_full_decoder_must_decide(body: bytes) -> None:
    assert tables.scan_body_token_ids(body) is None


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    others=st.dictionaries(st.text(max_size=10).filter(lambda k: k != "token_ids"), _json_values, max_size=4),
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=30),
    at=st.integers(0, 4),
)
def test_body_scan_equals_msgspec_on_any_object(others: dict[str, object], ids: list[int], at: int) -> None:
    items = list(others.items())
    items.insert(min(at, len(items)), ("token_ids", ids))
    body = b"{" + b", ".join(msgspec.json.encode(k) + b": " + msgspec.json.encode(v) for k, v in items) + b"}"
    got = tables.scan_body_token_ids(body)
    if any("\\" in msgspec.json.encode(k).decode() for k in others):
        assert got is None  # an escaped member name: left to the full decoder
        return
    assert got is not None
    scanned, start, end = got
    assert scanned.tolist() == ids
    rest = msgspec.json.decode(body[:start] + b"[]" + body[end:])
    assert rest == {**dict(items), "token_ids": []}
