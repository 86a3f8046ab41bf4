"""Exact-value tests of `kvmesh.core.state.IndexState`: stream order, epochs, worker removal, matching."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import RequestError, UnknownModelError
from kvmesh.core.events import (
    Cleared,
    Event,
    EventsMessage,
    Removed,
    Stored,
    WorkerRemoved,
    decode_message,
    encode_message,
)
from kvmesh.core.hashing import local_block_hashes
from kvmesh.core.state import HolderMatch, IndexState, MatchResult

MODEL = "llama"
BS = 4
TOKENS = list(range(16))  # 4 full blocks
LOCAL = local_block_hashes(TOKENS, BS)
OTHER_TOKENS = list(range(100, 116))
OTHER_LOCAL = local_block_hashes(OTHER_TOKENS, BS)


def _msg(
    worker: str,
    rank: int,
    events: list[Event],
    *,
    epoch: int = 1,
    seq: int = 1,
    model: str = MODEL,
    bs: int = BS,
) -> EventsMessage:
    return EventsMessage(
        worker_id=worker, dp_rank=rank, model=model, block_size=bs, epoch=epoch, seq=seq, events=events
    )


def _hm(worker: str, rank: int, overlap: int, cached: int) -> HolderMatch:
    return HolderMatch(
        worker_id=worker,
        dp_rank=rank,
        overlap_blocks=overlap,
        cached_blocks=cached,
        block_size=BS,
        overlap_tokens=overlap * BS,
    )


def _candidates(state: IndexState, tokens: list[int] = TOKENS, **kw: str) -> tuple[HolderMatch, ...]:
    return state.match(MODEL, tokens, **kw).candidates


def _fleet() -> IndexState:
    """w1 rank 0 holds all 4 blocks, w1 rank 1 the first 2, w2 rank 0 one unrelated block."""
    state = IndexState()
    state.apply(1, _msg("w1", 0, [Stored([11, 12], None, LOCAL[:2]), Stored([13, 14], 12, LOCAL[2:])]))
    state.apply(2, _msg("w1", 1, [Stored([21, 22], None, LOCAL[:2])]))
    state.apply(3, _msg("w2", 0, [Stored([31], None, OTHER_LOCAL[:1])]))
    return state


def test_match_returns_every_holder_with_exact_overlap() -> None:
    """Match lists every holder of the model, zero overlap included, with exact counts and index_seq."""
    state = _fleet()
    assert state.match(MODEL, [*TOKENS, 99, 98]) == MatchResult(
        index_seq=3,
        block_size=BS,
        prompt_blocks=4,
        candidates=(_hm("w1", 0, 4, 4), _hm("w1", 1, 2, 2), _hm("w2", 0, 0, 1)),
    )
    assert _candidates(state, OTHER_TOKENS) == (_hm("w1", 0, 0, 4), _hm("w1", 1, 0, 2), _hm("w2", 0, 1, 1))
    assert _candidates(state, TOKENS[:7]) == (_hm("w1", 0, 1, 4), _hm("w1", 1, 1, 2), _hm("w2", 0, 0, 1))
    assert state.applied_seq == 3
    assert state.block_total() == 7
    assert state.models() == {MODEL: [BS]}
    assert state.counters.messages == 3
    assert state.counters.stored_blocks == 7


def test_removed_and_cleared_events_apply() -> None:
    """Removed cuts a holder's leading run and Cleared empties the holder, which stays a candidate."""
    state = _fleet()
    state.apply(4, _msg("w1", 0, [Removed([12, 999])], seq=2))
    assert _candidates(state) == (_hm("w1", 0, 1, 3), _hm("w1", 1, 2, 2), _hm("w2", 0, 0, 1))
    state.apply(5, _msg("w1", 1, [Cleared("engine")], seq=2))
    assert _candidates(state) == (_hm("w1", 0, 1, 3), _hm("w1", 1, 0, 0), _hm("w2", 0, 0, 1))
    assert (state.counters.removed_blocks, state.counters.unknown_removals, state.counters.clears) == (
        1,
        1,
        1,
    )


def test_older_stream_seq_is_ignored() -> None:
    """A message whose stream sequence is not above the applied one changes nothing."""
    state = _fleet()
    before = state.digest()
    state.apply(3, _msg("w1", 0, [Cleared("engine")], seq=2))
    state.apply(2, _msg("w1", 0, [Removed([11])], seq=3))
    assert state.applied_seq == 3
    assert state.counters.messages == 3
    assert state.digest() == before
    assert _candidates(state) == (_hm("w1", 0, 4, 4), _hm("w1", 1, 2, 2), _hm("w2", 0, 0, 1))
    state.apply(10, _msg("w1", 0, [Removed([11])], seq=2))
    assert state.applied_seq == 10
    assert _candidates(state) == (_hm("w1", 0, 0, 3), _hm("w1", 1, 2, 2), _hm("w2", 0, 0, 1))


def test_older_epoch_is_dropped_and_newer_epoch_clears_first() -> None:
    """An older engine epoch is stale; a newer one clears only that holder before its events apply."""
    state = IndexState()
    state.apply(1, _msg("w1", 0, [Stored([11, 12, 13, 14], None, LOCAL)], epoch=2))
    state.apply(2, _msg("w1", 1, [Stored([21, 22], None, LOCAL[:2])], epoch=2))
    state.apply(3, _msg("w1", 0, [Removed([11])], epoch=1, seq=9))
    assert state.counters.stale_messages == 1
    assert state.applied_seq == 3
    assert _candidates(state) == (_hm("w1", 0, 4, 4), _hm("w1", 1, 2, 2))
    state.apply(4, _msg("w1", 0, [Stored([51], None, LOCAL[:1])], epoch=3))
    assert _candidates(state) == (_hm("w1", 0, 1, 1), _hm("w1", 1, 2, 2))
    assert state.counters.clears == 1
    assert state.counters.stale_messages == 1
    assert state.workers()["w1"]["epochs"] == {0: 3, 1: 2}
    assert state.workers()["w1"]["blocks"] == 3


def test_worker_removed_drops_worker_until_newer_epoch() -> None:
    """WorkerRemoved drops every rank; later messages of that epoch are stale; a newer epoch is accepted."""
    state = _fleet()
    state.apply(4, WorkerRemoved(worker_id="w1", model=MODEL, epoch=1))
    assert _candidates(state) == (_hm("w2", 0, 0, 1),)
    assert state.block_total() == 1
    assert state.counters.workers_removed == 1
    assert state.workers()["w1"]["removed"] is True
    state.apply(5, _msg("w1", 0, [Stored([11], None, LOCAL[:1])], epoch=1, seq=5))
    assert state.counters.stale_messages == 1
    assert _candidates(state) == (_hm("w2", 0, 0, 1),)
    state.apply(6, _msg("w1", 0, [Stored([61, 62], None, LOCAL[:2])], epoch=2, seq=1))
    assert state.counters.stale_messages == 1
    assert state.workers()["w1"]["removed"] is False
    assert _candidates(state) == (_hm("w1", 0, 2, 2), _hm("w2", 0, 0, 1))


def test_late_message_of_removed_epoch_stays_dropped_after_rejoin() -> None:
    """After one rank rejoins with a newer epoch, a late message of the removed epoch is still stale."""
    state = _fleet()
    state.apply(4, WorkerRemoved(worker_id="w1", model=MODEL, epoch=1))
    state.apply(5, _msg("w1", 0, [Stored([61], None, LOCAL[:1])], epoch=2))
    state.apply(6, _msg("w1", 1, [Stored([21, 22], None, LOCAL[:2])], epoch=1, seq=7))
    assert state.counters.stale_messages == 1
    assert _candidates(state) == (_hm("w1", 0, 1, 1), _hm("w2", 0, 0, 1))


def test_a_removal_that_lands_after_the_worker_came_back_keeps_the_new_incarnation() -> None:
    """The claimer of an expired key published the removal of epoch 1 late: after the worker had registered
    again (epoch 2) and stored a block. The new incarnation's block stays; a late message of epoch 1 is stale.
    (Before: the whole worker was removed, and the engine's next blocks, chained to the lost one, were
    never indexed.)"""
    state = IndexState()
    state.apply(1, _msg("w1", 0, [Stored([11, 12], None, LOCAL[:2])], epoch=1))
    state.apply(2, _msg("w1", 0, [Cleared("rejoin")], epoch=2, seq=0))
    state.apply(3, _msg("w1", 0, [Stored([61], None, LOCAL[:1])], epoch=2))
    state.apply(4, WorkerRemoved(worker_id="w1", model=MODEL, epoch=1, reason="expired"))
    assert _candidates(state) == (_hm("w1", 0, 1, 1),)
    assert (state.counters.workers_removed, state.counters.stale_removals) == (0, 1)
    assert state.workers()["w1"]["removed"] is False
    state.apply(5, _msg("w1", 0, [Stored([62], 61, LOCAL[1:2])], epoch=2, seq=2))
    assert _candidates(state) == (_hm("w1", 0, 2, 2),)
    state.apply(6, _msg("w1", 0, [Stored([13], 12, LOCAL[2:3])], epoch=1, seq=2))
    assert state.counters.stale_messages == 1
    assert _candidates(state) == (_hm("w1", 0, 2, 2),)


def test_a_multi_node_workers_last_removal_names_its_lowest_epoch_and_removes_every_rank() -> None:
    """Node A (rank 0) at incarnation 1, node B (rank 1) at 3: the removal for the last node names the lowest
    rank epoch (`kvmesh.runtime.registry.last_node_incarnation`), and every rank goes, B's too. (A rule that
    kept every rank above the removed epoch kept B's.)"""
    state = IndexState()
    state.apply(1, _msg("w1", 0, [Stored([11], None, LOCAL[:1])], epoch=1))
    state.apply(2, _msg("w1", 1, [Stored([21, 22], None, LOCAL[:2])], epoch=3))
    state.apply(3, WorkerRemoved(worker_id="w1", model=MODEL, epoch=1))
    assert state.workers()["w1"]["removed"] is True
    assert (state.counters.workers_removed, state.counters.stale_removals) == (1, 0)
    assert state.block_total() == 0


def test_an_older_removal_after_a_removal_does_not_lower_the_stale_bound() -> None:
    """Removed at epoch 5, then a late removal of epoch 3 (another claimer's): epoch 4 stays dropped."""
    state = IndexState()
    state.apply(1, _msg("w1", 0, [Stored([11], None, LOCAL[:1])], epoch=5))
    state.apply(2, _msg("w2", 0, [Stored([31], None, OTHER_LOCAL[:1])]))
    state.apply(3, WorkerRemoved(worker_id="w1", model=MODEL, epoch=5))
    state.apply(4, WorkerRemoved(worker_id="w1", model=MODEL, epoch=3))
    assert (state.counters.workers_removed, state.counters.stale_removals) == (1, 1)
    state.apply(5, _msg("w1", 1, [Stored([12], None, LOCAL[:1])], epoch=4))
    assert state.counters.stale_messages == 1
    assert _candidates(state) == (_hm("w2", 0, 0, 1),)


def test_removing_the_only_worker_makes_model_unknown() -> None:
    """When every worker of a model is removed, matching that model raises UnknownModelError."""
    state = IndexState()
    state.apply(1, _msg("w1", 0, [Stored([11], None, LOCAL[:1])]))
    state.apply(2, WorkerRemoved(worker_id="w1", model=MODEL, epoch=1))
    with pytest.raises(UnknownModelError):
        state.match(MODEL, TOKENS)


def test_unknown_model_raises() -> None:
    """Matching a model no worker registered raises UnknownModelError, a KeyError."""
    state = _fleet()
    with pytest.raises(UnknownModelError) as info:
        state.match("no-such-model", TOKENS)
    assert isinstance(info.value, KeyError)
    assert info.value.args == ("no-such-model",)
    with pytest.raises(UnknownModelError):
        IndexState().match(MODEL, TOKENS)


def test_match_rejects_bad_tokens() -> None:
    """A token id outside [0, 2**32) in a match request raises RequestError on token_ids."""
    state = _fleet()
    with pytest.raises(RequestError) as info:
        state.match(MODEL, [0, 1, 2, -3])
    assert info.value.field == "token_ids"


def test_same_messages_give_equal_digests() -> None:
    """States fed the same messages (one via encode/decode) have equal digests; missing one differs."""
    messages = [
        _msg("w1", 0, [Stored([11, 12], None, LOCAL[:2]), Stored([13], 12, LOCAL[2:3])]),
        _msg("w1", 1, [Stored([21, 22], None, LOCAL[:2]), Stored([21], None, LOCAL[:1])]),
        _msg("w2", 0, [Stored([33], 32, OTHER_LOCAL[2:3]), Stored([31, 32], None, OTHER_LOCAL[:2])]),
        _msg("w1", 0, [Removed([12, 77])], seq=2),
        _msg("w3", 0, [Stored([41, 42], None, OTHER_LOCAL[:2])], model="other", bs=8),
    ]
    first, second, partial = IndexState(), IndexState(), IndexState()
    for i, m in enumerate(messages, start=1):
        first.apply(i, m)
        second.apply(i, decode_message(encode_message(m)))
        if i != 4:
            partial.apply(i, m)
    assert first.digest() == second.digest()
    assert first.digest() != partial.digest()
    assert first.block_total() == second.block_total() == 9
    assert partial.block_total() == 10
    assert first.models() == {MODEL: [BS], "other": [8]}
    assert _candidates(first, OTHER_TOKENS) == (_hm("w1", 0, 0, 2), _hm("w1", 1, 0, 2), _hm("w2", 0, 3, 3))


def test_lora_and_salt_match_only_their_own_blocks() -> None:
    """lora_name and cache_salt in a match find only blocks whose local hashes used the same rule."""
    base = LOCAL
    lora = local_block_hashes(TOKENS, BS, lora_name="adapter-1")
    salted = local_block_hashes(TOKENS, BS, cache_salt="tenant-1")
    state = IndexState()
    state.apply(1, _msg("base", 0, [Stored([1, 2, 3, 4], None, base)]))
    state.apply(2, _msg("lora", 0, [Stored([1, 2, 3, 4], None, lora)]))
    state.apply(3, _msg("salt", 0, [Stored([1, 2, 3, 4], None, salted)]))
    assert _candidates(state) == (_hm("base", 0, 4, 4), _hm("lora", 0, 0, 4), _hm("salt", 0, 0, 4))
    assert _candidates(state, lora_name="adapter-1") == (
        _hm("base", 0, 0, 4),
        _hm("lora", 0, 4, 4),
        _hm("salt", 0, 0, 4),
    )
    assert _candidates(state, cache_salt="tenant-1") == (
        _hm("base", 0, 0, 4),
        _hm("lora", 0, 0, 4),
        _hm("salt", 0, 4, 4),
    )
    assert _candidates(state, lora_name="adapter-2") == (
        _hm("base", 0, 0, 4),
        _hm("lora", 0, 0, 4),
        _hm("salt", 0, 0, 4),
    )
    assert _candidates(state, cache_salt="tenant-2") == (
        _hm("base", 0, 0, 4),
        _hm("lora", 0, 0, 4),
        _hm("salt", 0, 0, 4),
    )


def test_deeply_nested_stream_message_is_a_decode_error() -> None:
    """A message nested 50,000 maps deep raises MessageDecodeError, not RecursionError."""
    from kvmesh.core.errors import MessageDecodeError
    from kvmesh.core.events import decode_message

    with pytest.raises(MessageDecodeError, match="nested too deeply"):
        decode_message(b"\x81\xa1a" * 50_000 + b"\x01")


def test_match_reports_overlap_per_tier() -> None:
    """Stored/Removed media reach the index: a CPU copy extends the overlap and `tiers` counts each block once,
    on its fastest tier; removal names the tier; a Cleared drops every tier."""
    state = IndexState()
    state.apply(1, _msg("w1", 0, [Stored([11, 12], None, LOCAL[:2], "GPU")]))
    state.apply(2, _msg("w1", 0, [Stored([11, 12, 13, 14], None, LOCAL, "CPU")], seq=2))
    state.apply(3, _msg("w2", 0, [Stored([31, 32, 33], None, LOCAL[:3])]))
    assert _candidates(state) == (
        HolderMatch(
            worker_id="w1",
            dp_rank=0,
            overlap_blocks=4,
            cached_blocks=6,
            tiers={"GPU": 2, "CPU": 2},
            block_size=BS,
            overlap_tokens=4 * BS,
        ),
        _hm("w2", 0, 3, 3),
    )
    state.apply(4, _msg("w1", 0, [Removed([13], "CPU"), Removed([12])], seq=3))
    assert _candidates(state) == (
        HolderMatch(
            worker_id="w1",
            dp_rank=0,
            overlap_blocks=2,
            cached_blocks=4,
            tiers={"GPU": 1, "CPU": 1},
            block_size=BS,
            overlap_tokens=2 * BS,
        ),
        _hm("w2", 0, 3, 3),
    )
    assert state.counters.removed_blocks == 2
    state.apply(5, _msg("w1", 0, [Cleared()], seq=4))
    assert _candidates(state) == (_hm("w1", 0, 0, 0), _hm("w2", 0, 3, 3))


def test_consecutive_removals_of_a_message_apply_as_one_per_tier() -> None:
    """One BlockRemoved per block (vLLM's wire) applies the same as one event per tier run: a block removed
    twice is unknown the second time, a CPU removal in between takes only the CPU copy, a stored block twice
    (two copies) needs two removals."""
    state = IndexState()
    state.apply(
        1, _msg("w1", 0, [Stored([11, 12, 13, 14], None, LOCAL), Stored([11, 12], None, LOCAL[:2], "CPU")])
    )
    state.apply(2, _msg("w1", 0, [Stored([14], 13, LOCAL[3:])], seq=2))  # a second copy of block 3
    removals: list[Event] = [
        Removed([14]),
        Removed([13]),
        Removed([13]),
        Removed([12], "CPU"),
        Removed([12]),
        Removed([14]),
    ]
    state.apply(3, _msg("w1", 0, removals, seq=3))
    assert (state.counters.removed_blocks, state.counters.unknown_removals) == (4, 1)
    assert _candidates(state) == (_hm("w1", 0, 1, 2),)  # block 0 on GPU and CPU: its fastest tier only
