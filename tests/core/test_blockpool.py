"""Tests of the simulated vLLM block pool (`kvmesh.sim.blockpool`) and `kvmesh.core.endpoints`."""

from __future__ import annotations

import pytest

from kvmesh.core.endpoints import offset_endpoint
from kvmesh.core.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    decode_batch,
    encode_batch,
)
from kvmesh.sim.blockpool import Admission, BlockPool, PoolExhaustedError, PoolStats

BS = 4
PROMPT_A = [1, 2, 3, 4, 5, 6, 7, 8]


def stored(
    hashes: tuple[int | bytes, ...],
    parent: int | bytes | None,
    tokens: list[int],
    *,
    lora_name: str | None = None,
    extra_keys: tuple[tuple[str, ...] | None, ...] | None = None,
) -> BlockStored:
    """Build the BlockStored the pool is expected to emit (vLLM 0.33 field values)."""
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=BS,
        medium="GPU",
        lora_name=lora_name,
        extra_keys=extra_keys if extra_keys is not None else (None,) * len(hashes),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def removed(h: int | bytes) -> BlockRemoved:
    """Build the single-hash BlockRemoved vLLM emits for one evicted block."""
    return BlockRemoved(block_hashes=(h,), medium="GPU", group_idx=0)


def test_hashes_match_golden_vector() -> None:
    """Seed 0, block size 4, tokens 1..8 hash to fixed values, so runs on any machine agree."""
    pool = BlockPool(num_blocks=8, block_size=BS, seed=0)
    assert pool.compute_block_hashes(PROMPT_A) == (2223284349564965104, 13542791180373646546)


def test_first_request_stores_its_full_blocks_with_no_parent() -> None:
    """A cold prompt of 10 tokens stores blocks [h0, h1] with parent None and exactly their 8 tokens."""
    pool = BlockPool(num_blocks=8, block_size=BS)
    h0, h1 = pool.compute_block_hashes(PROMPT_A)
    adm = pool.start("a", [*PROMPT_A, 9, 10])
    assert adm == Admission(
        request_id="a",
        prompt_tokens=10,
        cached_tokens=0,
        num_cached_blocks=0,
        num_full_blocks=2,
        num_prompt_blocks=3,
        num_new_blocks=3,
        num_evicted=0,
        block_hashes=(h0, h1),
    )
    assert pool.take_events() == [stored((h0, h1), None, PROMPT_A)]
    assert pool.take_events() == []


def test_shared_prefix_hits_and_stores_only_the_new_block() -> None:
    """A second prompt with the same 8 tokens plus 4 more hits 8 tokens and stores [h2] with parent h1."""
    pool = BlockPool(num_blocks=8, block_size=BS)
    pool.start("a", PROMPT_A)
    pool.finish("a")
    pool.take_events()
    h0, h1, h2 = pool.compute_block_hashes([*PROMPT_A, 20, 21, 22, 23])
    adm = pool.start("b", [*PROMPT_A, 20, 21, 22, 23])
    assert (adm.cached_tokens, adm.num_cached_blocks, adm.num_new_blocks) == (8, 2, 1)
    assert adm.block_hashes == (h0, h1, h2)
    assert pool.take_events() == [stored((h2,), h1, [20, 21, 22, 23])]


def test_fully_cached_prompt_recomputes_and_restores_its_last_block() -> None:
    """Like vLLM, a fully cached 8-token prompt hits only 4 tokens and re-announces block 1 (parent h0)."""
    pool = BlockPool(num_blocks=8, block_size=BS)
    h0, h1 = pool.compute_block_hashes(PROMPT_A)
    pool.start("a", PROMPT_A)
    pool.finish("a")
    pool.take_events()
    assert pool.match_prefix(PROMPT_A) == 4
    adm = pool.start("b", PROMPT_A)
    assert adm.cached_tokens == 4
    assert pool.take_events() == [stored((h1,), h0, [5, 6, 7, 8])]
    assert pool.stats().cached_blocks == 3


def test_decode_append_stores_the_completed_block_with_the_last_prompt_block_as_parent() -> None:
    """Decode tokens that complete a block emit one BlockStored whose parent is the last prompt block."""
    pool = BlockPool(num_blocks=8, block_size=BS)
    prompt = [1, 2, 3, 4, 5, 6]
    (h0,) = pool.compute_block_hashes(prompt)
    pool.start("a", prompt)
    assert pool.take_events() == [stored((h0,), None, [1, 2, 3, 4])]
    assert pool.append("a", [70]) == 0
    assert pool.take_events() == []
    assert pool.append("a", [71]) == 1
    _, h1 = pool.compute_block_hashes([*prompt, 70, 71])
    assert pool.take_events() == [stored((h1,), h0, [5, 6, 70, 71])]
    assert pool.append("a", [72]) == 0
    assert pool.take_events() == []


def test_multi_token_step_stores_all_completed_blocks_in_one_event() -> None:
    """One append of 8 tokens (one engine step) completes two blocks and announces both in one event."""
    pool = BlockPool(num_blocks=8, block_size=BS)
    pool.start("a", [1, 2])
    assert pool.take_events() == []
    assert pool.append("a", [3, 4, 5, 6, 7, 8, 9]) == 2
    h0, h1 = pool.compute_block_hashes(PROMPT_A)
    assert pool.take_events() == [stored((h0, h1), None, PROMPT_A)]


def test_eviction_is_lazy_lru_and_emits_one_removal_per_hash_at_reallocation() -> None:
    """Freed blocks stay cached; the least recently freed ones are evicted, tail first, when reallocated."""
    pool = BlockPool(num_blocks=4, block_size=BS)
    prompt_b = [11, 12, 13, 14, 15, 16, 17, 18]
    prompt_c = [21, 22, 23, 24, 25, 26, 27, 28]
    a0, a1 = pool.compute_block_hashes(PROMPT_A)
    b0, b1 = pool.compute_block_hashes(prompt_b)
    c0, c1 = pool.compute_block_hashes(prompt_c)
    pool.start("a", PROMPT_A)
    pool.finish("a")
    pool.start("b", prompt_b)
    pool.finish("b")
    assert pool.take_events() == [stored((a0, a1), None, PROMPT_A), stored((b0, b1), None, prompt_b)]
    assert pool.stats().cached_free_blocks == 4

    adm = pool.start("c", prompt_c)
    assert adm.num_evicted == 2
    assert pool.take_events() == [removed(a1), removed(a0), stored((c0, c1), None, prompt_c)]
    assert pool.match_prefix([*prompt_b, 0]) == 8
    assert pool.match_prefix([*PROMPT_A, 0]) == 0


def test_partial_tail_block_is_reused_before_any_cached_block() -> None:
    """A freed partial block goes to the free-queue head, so the next allocation evicts one block less."""
    pool = BlockPool(num_blocks=4, block_size=BS)
    _, a1 = pool.compute_block_hashes(PROMPT_A)
    prompt_b = list(range(100, 112))
    pool.start("a", [*PROMPT_A, 9, 10])
    pool.finish("a")
    pool.take_events()
    pool.start("b", prompt_b)
    assert pool.take_events() == [removed(a1), stored(pool.compute_block_hashes(prompt_b), None, prompt_b)]
    assert pool.match_prefix([*PROMPT_A, 0]) == 4


def test_hit_on_a_free_cached_block_protects_it_from_eviction() -> None:
    """Hit blocks leave the free queue before new blocks are taken, and do not count as available."""
    pool = BlockPool(num_blocks=3, block_size=BS)
    pool.start("a", PROMPT_A)
    pool.finish("a")
    pool.take_events()
    with pytest.raises(PoolExhaustedError) as info:
        pool.start("b", [*PROMPT_A, 9, 10, 11, 12, 13])
    assert (info.value.needed_blocks, info.value.available_blocks) == (2, 1)
    adm = pool.start("c", [*PROMPT_A, 9, 10, 11, 12])
    assert (adm.cached_tokens, adm.num_new_blocks, adm.num_evicted) == (8, 1, 0)


def test_pool_exhausted_raises_and_changes_nothing() -> None:
    """A prompt that needs more blocks than are free raises PoolExhaustedError with no event or change."""
    pool = BlockPool(num_blocks=2, block_size=BS)
    pool.start("a", PROMPT_A)
    pool.take_events()
    before = pool.stats()
    with pytest.raises(PoolExhaustedError) as info:
        pool.start("b", [9, 10, 11])
    assert (info.value.request_id, info.value.needed_blocks, info.value.available_blocks) == ("b", 1, 0)
    with pytest.raises(PoolExhaustedError):
        pool.append("a", [9])
    assert pool.stats() == before
    assert pool.take_events() == []
    assert pool.running == frozenset({"a"})


def test_reset_clears_everything_only_when_idle() -> None:
    """reset() is refused while a request runs and otherwise emits AllBlocksCleared and drops all hits."""
    pool = BlockPool(num_blocks=4, block_size=BS)
    pool.start("a", PROMPT_A)
    pool.take_events()
    assert pool.reset() is False
    assert pool.take_events() == []
    pool.finish("a")
    assert pool.reset() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.match_prefix([*PROMPT_A, 0]) == 0
    pool.start("b", [*PROMPT_A, 0])
    assert pool.take_events()[0] == stored(pool.compute_block_hashes(PROMPT_A), None, PROMPT_A)


def test_different_seeds_give_different_hashes_for_the_same_tokens() -> None:
    """Two pools with different seeds announce the same tokens under different block hashes."""
    p0 = BlockPool(num_blocks=4, block_size=BS, seed=0)
    p1 = BlockPool(num_blocks=4, block_size=BS, seed=1)
    p0.start("a", PROMPT_A)
    p1.start("a", PROMPT_A)
    (e0,) = p0.take_events()
    (e1,) = p1.take_events()
    assert isinstance(e0, BlockStored)
    assert isinstance(e1, BlockStored)
    assert e0.token_ids == e1.token_ids == tuple(PROMPT_A)
    assert set(e0.block_hashes).isdisjoint(e1.block_hashes)


def test_lora_and_cache_salt_change_hashes_and_are_carried() -> None:
    """LoRA name (all blocks) and cache salt (block 0) change hashes and appear in lora_name/extra_keys."""
    pool = BlockPool(num_blocks=16, block_size=BS)
    plain = pool.compute_block_hashes(PROMPT_A)
    lora = pool.compute_block_hashes(PROMPT_A, lora_name="adapter-a")
    salt = pool.compute_block_hashes(PROMPT_A, cache_salt="s1")
    both = pool.compute_block_hashes(PROMPT_A, lora_name="adapter-a", cache_salt="s1")
    assert len({*plain, *lora, *salt, *both}) == 8

    pool.start("plain", [*PROMPT_A, 0])
    assert pool.start("lora", [*PROMPT_A, 0], lora_name="adapter-a").cached_tokens == 0
    assert pool.start("salt", [*PROMPT_A, 0], cache_salt="s1").cached_tokens == 0
    assert pool.start("both", [*PROMPT_A, 0], lora_name="adapter-a", cache_salt="s1").cached_tokens == 0
    assert pool.take_events() == [
        stored(plain, None, PROMPT_A),
        stored(lora, None, PROMPT_A, lora_name="adapter-a", extra_keys=(("adapter-a",), ("adapter-a",))),
        stored(salt, None, PROMPT_A, extra_keys=(("s1",), None)),
        stored(both, None, PROMPT_A, lora_name="adapter-a", extra_keys=(("adapter-a", "s1"), ("adapter-a",))),
    ]
    assert pool.match_prefix([*PROMPT_A, 0], cache_salt="s1") == 8


def test_hash_forms_share_the_low_64_bits() -> None:
    """bytes hashes are 32 bytes whose low 8 bytes big-endian equal the int form; signed is its int64."""
    forms = {
        form: BlockPool(num_blocks=4, block_size=BS, hash_form=form).compute_block_hashes(PROMPT_A)
        for form in ("int", "bytes", "signed")
    }
    assert forms["int"] == (2223284349564965104, 13542791180373646546)
    assert [len(h) for h in forms["bytes"] if isinstance(h, bytes)] == [32, 32]
    assert tuple(int.from_bytes(h, "big") & (2**64 - 1) for h in forms["bytes"] if isinstance(h, bytes)) == (
        2223284349564965104,
        13542791180373646546,
    )
    assert forms["signed"] == (2223284349564965104, 13542791180373646546 - 2**64)


def test_pool_events_survive_the_wire_encoding() -> None:
    """Events of a LoRA + salt request encode as vLLM 0.33.0 and decode back to equal events."""
    pool = BlockPool(num_blocks=8, block_size=BS)
    pool.start("a", [*PROMPT_A, 0], lora_name="adapter-a", cache_salt="s1")
    pool.finish("a")
    events = tuple(pool.take_events())
    batch = EngineBatch(ts=1700000000.25, events=events, dp_rank=0)
    assert decode_batch(encode_batch(batch, version="0.33.0")) == batch


def test_stats_count_requests_hits_stores_and_evictions() -> None:
    """stats() reports occupancy and lifetime counters exactly."""
    pool = BlockPool(num_blocks=4, block_size=BS)
    pool.start("a", [*PROMPT_A, 9])
    pool.finish("a")
    pool.start("b", [*PROMPT_A, 9, 10, 11, 12])
    assert pool.stats() == PoolStats(
        num_blocks=4,
        block_size=BS,
        free_blocks=1,
        cached_blocks=3,
        cached_free_blocks=0,
        running_requests=1,
        requests=2,
        prompt_tokens=21,
        hit_tokens=8,
        hit_blocks=2,
        stored_blocks=3,
        evictions=0,
        resets=0,
    )


def test_request_id_misuse_raises_value_error() -> None:
    """Starting a running id, an empty prompt, or touching an unknown id raises ValueError."""
    pool = BlockPool(num_blocks=4, block_size=BS)
    pool.start("a", [1])
    with pytest.raises(ValueError, match="already running"):
        pool.start("a", [1])
    with pytest.raises(ValueError, match="empty prompt"):
        pool.start("b", [])
    with pytest.raises(ValueError, match="not running"):
        pool.append("x", [1])
    with pytest.raises(ValueError, match="not running"):
        pool.finish("x")


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://127.0.0.1:51829", 0, "tcp://127.0.0.1:51829"),
        ("tcp://127.0.0.1:51829", 1, "tcp://127.0.0.1:51830"),
        ("tcp://127.0.0.1:49849", 1, "tcp://127.0.0.1:49850"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://[::1]:5557", 2, "tcp://[::1]:5559"),
        ("tcp://*:0", 2, "tcp://*:0"),
        ("inproc://test-5557", 1, "inproc://test-5557_dp1"),
        ("ipc:///tmp/kv.sock", 0, "ipc:///tmp/kv.sock"),
    ],
)
def test_offset_endpoint_follows_vllm(endpoint: str, rank: int, expected: str) -> None:
    """offset_endpoint adds the rank to a tcp port, suffixes inproc with _dp{rank}, and keeps rank 0."""
    assert offset_endpoint(endpoint, rank) == expected


@pytest.mark.parametrize(
    ("endpoint", "rank"),
    [("ipc:///tmp/kv.sock", 1), ("tcp://127.0.0.1:65535", 1), ("tcp://127.0.0.1:x", 1), ("tcp://h:1", -1)],
)
def test_offset_endpoint_rejects_what_has_no_rule(endpoint: str, rank: int) -> None:
    """ipc with rank > 0, a port overflow, a non-numeric port or a negative rank raise ValueError."""
    with pytest.raises(ValueError):
        offset_endpoint(endpoint, rank)
