"""Golden vectors and isolation rules of kvmesh's local and sequence hashes."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.core.errors import RequestError
from kvmesh.core.hashing import (
    SEED,
    chain_hash,
    local_block_hashes,
    lora_seed,
    pack_tokens,
    prefix_keys,
    prompt_prefix_keys,
    prompt_sequence_hashes,
    sequence_hashes,
)

TOKENS_0_7 = list(range(8))
LOCAL_0_7 = [9143094415614847814, 12124091508212882195]
SEQ_0_7 = [9143094415614847814, 9510318385840434533]
OLD_KEYS_0_7 = [1072643883366918982, 120589544870907004]
"""Snapshot format 3's 60-bit prefix keys of tokens 0..7 in blocks of 4 (no longer the index's keys)."""


def test_xxh3_golden_vector() -> None:
    """The xxhash binding computes the reference XXH3-64 of b"test data" with seed 1337."""
    assert SEED == 1337
    assert xxhash.xxh3_64_intdigest(b"test data", seed=1337) == 13226331709069118873


def test_pack_tokens_is_little_endian_u32() -> None:
    """Token ids are packed as 4-byte little-endian unsigned integers."""
    assert pack_tokens([1, 0x01020304, 2**32 - 1]) == b"\x01\x00\x00\x00\x04\x03\x02\x01\xff\xff\xff\xff"
    assert pack_tokens([]) == b""


def test_local_hashes_golden_vector() -> None:
    """Tokens 0..7 in blocks of 4 give Dynamo's two LocalBlockHash values."""
    assert local_block_hashes(TOKENS_0_7, 4) == LOCAL_0_7


def test_local_hash_is_xxh3_of_packed_block() -> None:
    """Each local hash is XXH3-64(seed 1337) over that block's packed tokens alone."""
    assert local_block_hashes(TOKENS_0_7, 4) == [
        xxhash.xxh3_64_intdigest(pack_tokens([0, 1, 2, 3]), seed=1337),
        xxhash.xxh3_64_intdigest(pack_tokens([4, 5, 6, 7]), seed=1337),
    ]


def test_sequence_hashes_golden_vector() -> None:
    """Chaining the golden local hashes gives Dynamo's two SequenceHash values."""
    assert sequence_hashes(LOCAL_0_7) == SEQ_0_7
    assert prompt_sequence_hashes(TOKENS_0_7, 4) == SEQ_0_7


def test_chain_hash_matches_sequence_hashes() -> None:
    """chain_hash(parent, local) is the sequence-hash step: XXH3(le64(parent) ‖ le64(local), 1337)."""
    expected = xxhash.xxh3_64_intdigest(
        LOCAL_0_7[0].to_bytes(8, "little") + LOCAL_0_7[1].to_bytes(8, "little"), seed=1337
    )
    assert chain_hash(LOCAL_0_7[0], LOCAL_0_7[1]) == expected == SEQ_0_7[1]


def test_trailing_partial_block_is_dropped() -> None:
    """Tokens that do not fill a whole block produce no key."""
    assert local_block_hashes([*TOKENS_0_7, 8, 9, 10], 4) == LOCAL_0_7
    assert prompt_sequence_hashes([*TOKENS_0_7, 8], 4) == SEQ_0_7
    assert local_block_hashes([0, 1, 2], 4) == []
    assert prompt_sequence_hashes([], 4) == []


def test_lora_isolation() -> None:
    """Base model and two adapters give pairwise-different keys; the same adapter twice gives equal keys."""
    base = local_block_hashes(TOKENS_0_7, 4)
    a = local_block_hashes(TOKENS_0_7, 4, lora_name="adapter-a")
    b = local_block_hashes(TOKENS_0_7, 4, lora_name="adapter-b")
    a_again = local_block_hashes(TOKENS_0_7, 4, lora_name="adapter-a")
    assert base == LOCAL_0_7
    assert a == a_again
    assert len({base[0], a[0], b[0]}) == 3
    assert len({base[1], a[1], b[1]}) == 3
    assert lora_seed(None) == 1337
    assert lora_seed("adapter-a") == xxhash.xxh3_64_intdigest(b"kvmesh-lora\x00adapter-a", seed=1337)
    assert a == [
        xxhash.xxh3_64_intdigest(pack_tokens([0, 1, 2, 3]), seed=lora_seed("adapter-a")),
        xxhash.xxh3_64_intdigest(pack_tokens([4, 5, 6, 7]), seed=lora_seed("adapter-a")),
    ]
    seq_base = prompt_sequence_hashes(TOKENS_0_7, 4)
    seq_a = prompt_sequence_hashes(TOKENS_0_7, 4, lora_name="adapter-a")
    assert seq_a == sequence_hashes(a)
    assert set(seq_base).isdisjoint(seq_a)


def test_cache_salt_changes_block0_local_and_every_sequence_hash() -> None:
    """A cache salt changes only block 0's local hash, and through the chain every sequence hash."""
    salted = local_block_hashes(TOKENS_0_7, 4, cache_salt="tenant-1")
    other = local_block_hashes(TOKENS_0_7, 4, cache_salt="tenant-2")
    assert salted[0] != LOCAL_0_7[0]
    assert salted[1] == LOCAL_0_7[1]
    assert other[0] not in (salted[0], LOCAL_0_7[0])
    assert other[1] == LOCAL_0_7[1]
    assert salted[0] == xxhash.xxh3_64_intdigest(
        pack_tokens([0, 1, 2, 3]) + b"\x00kvmesh-salt\x00tenant-1", seed=1337
    )
    seq_salted = prompt_sequence_hashes(TOKENS_0_7, 4, cache_salt="tenant-1")
    assert seq_salted == sequence_hashes(salted)
    assert seq_salted[0] != SEQ_0_7[0]
    assert seq_salted[1] != SEQ_0_7[1]


def test_block_extras_change_only_their_block() -> None:
    """Multimodal extra bytes change exactly the local hash of the block they belong to."""
    tokens = list(range(12))
    plain = local_block_hashes(tokens, 4)
    extra1 = local_block_hashes(tokens, 4, block_extras=[None, b"image-1"])
    extra1b = local_block_hashes(tokens, 4, block_extras=[None, b"image-2", None])
    assert extra1[0] == plain[0]
    assert extra1[1] != plain[1]
    assert extra1[2] == plain[2]
    assert extra1b[1] not in (plain[1], extra1[1])
    assert [extra1b[0], extra1b[2]] == [plain[0], plain[2]]
    assert extra1[1] == xxhash.xxh3_64_intdigest(
        pack_tokens([4, 5, 6, 7]) + b"\x00kvmesh-mm\x00image-1", seed=1337
    )
    assert local_block_hashes(tokens, 4, block_extras=[None, None, None]) == plain


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([0, 1, 2, 2**32], id="too-large"),
        pytest.param([0, -1, 2, 3], id="negative"),
        pytest.param([0, 1.5, 2, 3], id="float"),
        pytest.param([0, "1", 2, 3], id="str"),
        pytest.param([0, None, 2, 3], id="none"),
    ],
)
def test_invalid_token_raises_request_error(bad: list[object]) -> None:
    """A token id that is not an int in [0, 2**32) raises RequestError naming the token_ids field."""
    with pytest.raises(RequestError) as info:
        local_block_hashes(bad, 4)  # type: ignore[arg-type]
    assert info.value.field == "token_ids"
    with pytest.raises(RequestError) as info2:
        prompt_sequence_hashes(bad, 4)  # type: ignore[arg-type]
    assert info2.value.field == "token_ids"


@pytest.mark.parametrize("bad_token", [-1, 2**32, 0.5])
def test_invalid_token_in_partial_block_raises_request_error(bad_token: object) -> None:
    """A bad token id is rejected even when it sits in the dropped trailing partial block."""
    with pytest.raises(RequestError) as info:
        prompt_sequence_hashes([0, 1, 2, 3, 4, bad_token], 4)  # type: ignore[list-item]
    assert info.value.field == "token_ids"


def test_max_token_id_is_accepted() -> None:
    """The largest uint32 token id is valid and hashes like any other."""
    assert local_block_hashes([2**32 - 1] * 4, 4) == [xxhash.xxh3_64_intdigest(b"\xff" * 16, seed=1337)]


@pytest.mark.parametrize("block_size", [0, -4])
def test_non_positive_block_size_raises_value_error(block_size: int) -> None:
    """A block size of zero or less is a ValueError."""
    with pytest.raises(ValueError, match="block_size must be positive") as info:
        local_block_hashes(TOKENS_0_7, block_size)
    assert not isinstance(info.value, RequestError)


def test_sequence_hashes_continue_from_parent() -> None:
    """Chaining a suffix onto its parent's sequence hash equals the suffix of the full chain."""
    tokens = list(range(100, 124))
    local = local_block_hashes(tokens, 4)
    full = sequence_hashes(local)
    assert len(full) == 6
    for k in range(1, 6):
        assert sequence_hashes(local[k:], full[k - 1]) == full[k:]
    assert sequence_hashes([], full[0]) == []


def test_prefix_keys_are_the_standard_sequence_hashes() -> None:
    """The index's keys are Dynamo's SequenceHash values, full 64 bits: block 0 is its local hash, then
    XXH3-64(le64(seq) ‖ le64(local), seed 1337), computed here with xxhash alone."""
    assert SEQ_0_7[0] == LOCAL_0_7[0]
    assert SEQ_0_7[1] == xxhash.xxh3_64_intdigest(
        SEQ_0_7[0].to_bytes(8, "little") + LOCAL_0_7[1].to_bytes(8, "little"), seed=1337
    )
    assert prefix_keys(LOCAL_0_7) == SEQ_0_7
    assert prompt_prefix_keys(TOKENS_0_7, 4) == SEQ_0_7
    assert prompt_prefix_keys([*TOKENS_0_7, 8], 4) == SEQ_0_7
    assert prefix_keys([]) == prompt_prefix_keys([], 4) == []
    assert OLD_KEYS_0_7 != SEQ_0_7  # the 60-bit chain of snapshot format 3 names other keys


def test_prefix_keys_continue_from_a_stored_parent_and_use_all_64_bits() -> None:
    """Chaining a suffix onto its parent's key equals the suffix of the full chain; keys are not cut to 60
    bits (of 16 keys, some are at or above 2**60)."""
    tokens = list(range(100, 164))
    local = local_block_hashes(tokens, 4, lora_name="adapter-a", cache_salt="tenant-1")
    full = prefix_keys(local)
    assert len(full) == 16
    assert all(0 <= k < 2**64 for k in full) and any(k >= 2**60 for k in full)
    assert full == sequence_hashes(local)
    for k in range(1, 16):
        assert prefix_keys(local[k:], full[k - 1]) == full[k:]
    assert prompt_prefix_keys(tokens, 4, lora_name="adapter-a", cache_salt="tenant-1") == full
    assert prompt_prefix_keys(tokens, 4) != full


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    block_size=st.sampled_from([1, 3, 4, 16]),
    lora=st.sampled_from([None, "adapter-a"]),
    salt=st.sampled_from([None, "", "tenant-1"]),
)
def test_lazy_prefix_keys_equal_the_eager_ones(
    tokens: list[int], block_size: int, lora: str | None, salt: str | None
) -> None:
    """`iter_prompt_prefix_keys` yields exactly `prompt_prefix_keys`, LoRA and salt included."""
    from kvmesh.core.hashing import iter_prompt_prefix_keys, prompt_prefix_keys

    lazy = iter_prompt_prefix_keys(tokens, block_size, lora_name=lora, cache_salt=salt)
    assert list(lazy) == prompt_prefix_keys(tokens, block_size, lora_name=lora, cache_salt=salt)


def test_lazy_prefix_keys_check_every_token_before_hashing() -> None:
    """A bad token id anywhere fails the call itself, not some later step of the iteration."""
    from kvmesh.core.hashing import iter_prompt_prefix_keys

    with pytest.raises(RequestError) as err:
        iter_prompt_prefix_keys([1, 2, 3, 4, 5, 2**32], 4)
    assert err.value.field == "token_ids"
