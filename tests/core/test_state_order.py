"""Exact-value tests of `kvmesh.core.state.IndexState`'s per-holder engine order, holder health, re-used
worker ids under another model, and scoring holders of one model with different block sizes."""

from __future__ import annotations

from kvmesh.core.events import Cleared, Event, EventsMessage, Removed, Stored, WorkerRemoved
from kvmesh.core.hashing import local_block_hashes
from kvmesh.core.snapshot import decode_snapshot, encode_snapshot
from kvmesh.core.state import HOLD_MAX_STREAM_SEQS, IndexState

MODEL = "llama"
BS = 4
TOKENS = list(range(32))  # 8 full blocks
LOCAL = local_block_hashes(TOKENS, BS)


def _msg(
    seq: int,
    events: list[Event],
    *,
    first_seq: int | None = None,
    part: int = 0,
    worker: str = "w1",
    rank: int = 0,
    epoch: int = 0,
    model: str = MODEL,
    bs: int = BS,
) -> EventsMessage:
    return EventsMessage(
        worker_id=worker,
        dp_rank=rank,
        model=model,
        block_size=bs,
        epoch=epoch,
        seq=seq,
        first_seq=first_seq,
        part=part,
        events=events,
    )


def _store(i: int) -> Stored:
    """Block i of the prompt, engine hash 100 + i, chained on block i - 1."""
    return Stored([100 + i], None if i == 0 else 100 + i - 1, LOCAL[i : i + 1])


def _feed(state: IndexState, messages: list[EventsMessage]) -> None:
    for m in messages:
        state.apply(state.applied_seq + 1, m)


def _overlap(state: IndexState, worker: str = "w1") -> int:
    return next(c.overlap_blocks for c in state.match(MODEL, TOKENS).candidates if c.worker_id == worker)


def _counts(state: IndexState) -> tuple[int, int, int]:
    c = state.counters
    return c.duplicate_messages, c.out_of_order, c.sequence_gaps


def test_reordered_batches_are_held_and_applied_in_engine_order() -> None:
    """Batches that land before earlier ones of their holder (the head of a publish window re-sent after a
    leader election) are held, the holder reads "held", and once the late ones arrive everything applies in
    engine order: the state equals one fed in order, and the holder is exact."""
    in_order = [
        _msg(0, [_store(0)]),
        _msg(1, [_store(1)]),
        _msg(3, [_store(2), _store(3)], first_seq=2),
        _msg(5, [_store(4), Removed([100])], first_seq=4),
        _msg(6, [_store(5)]),
    ]
    expected = IndexState()
    _feed(expected, in_order)
    state = IndexState()
    _feed(state, in_order[:2])
    _feed(state, [in_order[3], in_order[4]])  # engine seqs 4..6 land before 2..3
    assert state.counters.held_messages == 2
    assert state.holder_health() == {("w1", 0): "held"}
    assert _overlap(state) == 2  # the held blocks are not applied yet
    (cand,) = state.match(MODEL, TOKENS).candidates
    assert cand.health == "held"
    _feed(state, [in_order[2]])
    assert state.holder_health() == {}
    assert state.block_total() == expected.block_total() == 5
    assert state.digest() == expected.digest()
    assert state.workers()["w1"]["last_seq"] == {0: 6}
    assert _counts(state) == (0, 0, 0)
    # A repeat of a message that was held and applied is a duplicate.
    _feed(state, [in_order[3]])
    assert _counts(state) == (1, 0, 0)


def test_a_hold_survives_a_snapshot() -> None:
    """Held messages are part of the state: a restored replica applies them when the late message comes."""
    state = IndexState()
    _feed(state, [_msg(0, [_store(0)]), _msg(2, [_store(2)])])
    restored = IndexState.from_export(decode_snapshot(encode_snapshot(state.export())))
    assert restored.holder_health() == {("w1", 0): "held"}
    for s in (state, restored):
        s.apply(s.applied_seq + 1, _msg(1, [_store(1)]))
    assert restored.digest() == state.digest()
    assert restored.block_total() == state.block_total() == 3
    assert restored.holder_health() == state.holder_health() == {}


def test_an_ingest_cleared_voids_the_held_messages_before_it() -> None:
    """An ingest Cleared at seq X drops held messages up to X and applies the held ones after it."""
    state = IndexState()
    _feed(state, [_msg(0, [_store(0)]), _msg(3, [_store(1)]), _msg(6, [_store(0)])])
    assert state.counters.held_messages == 2
    _feed(state, [_msg(4, [Cleared("resync")])])
    assert state.holder_health() == {}
    assert state.workers()["w1"]["blocks"] == 1  # seq 6 re-stored block 0 after the clear; seq 3 void
    assert state.workers()["w1"]["last_seq"] == {0: 6}


def test_a_gap_that_never_fills_is_given_up_and_flagged() -> None:
    """When the missing messages do not come within the hold bounds, the held ones apply with the gap
    counted and the holder reads "gap" until a new epoch rebuilds it."""
    state = IndexState()
    _feed(state, [_msg(0, [_store(0)]), _msg(2, [_store(1)])])
    assert state.holder_health() == {("w1", 0): "held"}
    assert _overlap(state) == 1
    state.apply(state.applied_seq + HOLD_MAX_STREAM_SEQS + 1, _msg(3, [_store(2)]))
    assert state.counters.released_holds == 1
    assert _counts(state) == (0, 0, 1)
    assert _overlap(state) == 3
    assert state.holder_health() == {("w1", 0): "gap"}
    assert state.match(MODEL, TOKENS).candidates[0].health == "gap"
    _feed(state, [_msg(0, [_store(0)], epoch=1)])
    assert state.holder_health() == {}
    assert _overlap(state) == 1


def test_repeats_of_applied_messages_are_ignored_as_duplicates() -> None:
    """A repeat of the last message, or of an older one while the holder has no gap, is ignored, counted in
    duplicate_messages, and the holder stays exact with the same digest."""
    messages = [_msg(0, [_store(0)]), _msg(2, [_store(1), _store(2)], first_seq=1), _msg(3, [Removed([102])])]
    once, twice = IndexState(), IndexState()
    _feed(once, messages)
    _feed(twice, [*messages, messages[2], messages[0], messages[1]])
    assert _counts(twice) == (3, 0, 0)
    assert twice.holder_health() == {}
    assert twice.digest() == once.digest()
    assert twice.counters.stored_blocks == once.counters.stored_blocks == 3
    assert twice.counters.removed_blocks == 1
    assert twice.counters.duplicate_stores == 0
    assert _overlap(twice) == 2


def test_parts_of_a_split_batch_apply_in_order_and_their_repeats_are_duplicates() -> None:
    """Parts 0, 1 of one seq apply; a repeated part is a duplicate; a part past a skipped one waits for it."""
    state = IndexState()
    _feed(state, [_msg(7, [_store(0)], part=0), _msg(7, [_store(1)], part=1)])
    assert (_counts(state), _overlap(state)) == ((0, 0, 0), 2)
    _feed(state, [_msg(7, [_store(1)], part=1), _msg(7, [_store(0)], part=0)])
    assert _counts(state) == (2, 0, 0)
    _feed(state, [_msg(7, [_store(3)], part=3)])
    assert (_counts(state), state.counters.held_messages) == ((2, 0, 0), 1)
    assert state.holder_health() == {("w1", 0): "held"}
    _feed(state, [_msg(7, [_store(2)], part=2)])
    assert (_counts(state), state.holder_health(), _overlap(state)) == ((2, 0, 0), {}, 4)


def test_ingest_made_messages_apply_whatever_their_sequence() -> None:
    """A hello (-1 or the cursor) and an ingest Cleared whose cursor is past the batches after it always
    apply; after the Cleared the next batch may skip ahead, and older batches are duplicates."""
    state = IndexState()
    _feed(state, [_msg(-1, []), _msg(5, [_store(0)]), _msg(5, []), _msg(6, [_store(1)])])
    assert (_counts(state), _overlap(state)) == ((0, 0, 0), 2)
    # The ingest cleared after a replay it could not finish, with its cursor already at 12.
    _feed(state, [_msg(12, [Cleared("replay_incomplete")]), _msg(9, [_store(0)]), _msg(10, [_store(1)])])
    assert (_counts(state), _overlap(state), state.holder_health()) == ((0, 0, 0), 2, {})
    _feed(state, [_msg(6, [_store(2)]), _msg(3, [Cleared("malformed")])])
    assert _counts(state) == (1, 0, 0)
    assert _overlap(state) == 0
    _feed(state, [_msg(10, [_store(5)]), _msg(11, [_store(0)])])
    assert (_counts(state), _overlap(state)) == ((2, 0, 0), 1)


def test_an_empty_batch_moves_the_cursor_so_the_next_is_no_gap() -> None:
    """A message whose events were all skipped moves the cursor on; the batch after it is in order."""
    state = IndexState()
    _feed(state, [_msg(0, [_store(0)]), _msg(1, []), _msg(2, [_store(1)])])
    assert (_counts(state), state.holder_health()) == ((0, 0, 0), {})
    _feed(state, [_msg(4, [])])
    assert (_counts(state), state.holder_health()) == ((0, 0, 0), {("w1", 0): "held"})
    _feed(state, [_msg(3, [])])
    assert (_counts(state), state.holder_health()) == ((0, 0, 0), {})


def test_engine_cleared_is_ordered_and_makes_the_holder_exact() -> None:
    """An engine AllBlocksCleared is an engine message, ordered like the others (one that lands late is held
    for), and rebuilds the holder."""
    state = IndexState()
    _feed(state, [_msg(0, [_store(0)]), _msg(2, [_store(1)])])
    assert state.holder_health() == {("w1", 0): "held"}
    _feed(state, [_msg(1, [Cleared("engine")])])
    assert _counts(state) == (0, 0, 0)
    assert (_overlap(state), state.holder_health()) == (0, {})  # block 1's parent was cleared before it
    _feed(state, [_msg(3, [Cleared("engine")]), _msg(4, [_store(0)])])
    assert (state.holder_health(), _overlap(state)) == ({}, 1)


def test_engine_order_survives_a_snapshot() -> None:
    """A restored state keeps each holder's cursor: it ignores the same repeats as the original and applies
    the same next message."""
    state = IndexState()
    _feed(state, [_msg(0, [_store(0)]), _msg(1, [_store(1)]), _msg(3, [_store(3)], worker="w2")])
    _feed(state, [_msg(5, [_store(3)], worker="w2"), _msg(4, [_store(2)], worker="w2")])
    restored = IndexState.from_export(decode_snapshot(encode_snapshot(state.export())))
    assert restored.holder_health() == state.holder_health() == {}
    for s in (state, restored):
        _feed(s, [_msg(1, [_store(1)]), _msg(2, [_store(2)], worker="w2"), _msg(2, [_store(2)])])
    assert _counts(restored) == _counts(state) == (2, 0, 0)
    assert restored.digest() == state.digest()
    assert _overlap(restored) == 3


def test_stream_gap_shows_in_holder_health_and_match() -> None:
    """After mark_gap every live holder reads "stream_gap" until a Cleared rebuilds it."""
    state = IndexState()
    _feed(state, [_msg(0, [_store(0)]), _msg(0, [_store(0)], worker="w2")])
    state.mark_gap(2)
    assert state.holder_health() == {("w1", 0): "stream_gap", ("w2", 0): "stream_gap"}
    _feed(state, [_msg(0, [Cleared("gap")], worker="w2")])
    assert state.holder_health() == {("w1", 0): "stream_gap"}
    assert [c.health for c in state.match(MODEL, TOKENS).candidates] == ["stream_gap", None]


def test_worker_id_reused_under_another_model_is_a_new_incarnation() -> None:
    """After WorkerRemoved, the same worker id under another model (epochs from 0) is accepted, not stale;
    late messages of the removed model's incarnation stay dropped."""
    state = IndexState()
    _feed(state, [_msg(0, [_store(0)], epoch=3), _msg(1, [_store(1)], epoch=3)])
    state.apply(state.applied_seq + 1, WorkerRemoved(worker_id="w1", model=MODEL, epoch=3))
    _feed(state, [_msg(-1, [], model="qwen"), _msg(0, [_store(0)], model="qwen")])
    assert state.counters.stale_messages == 0
    assert state.counters.incarnations == 1
    assert state.live_worker("w1") == ("qwen", 0)
    assert state.workers()["w1"]["epochs"] == {0: 0}
    assert [(c.worker_id, c.overlap_blocks) for c in state.match("qwen", TOKENS).candidates] == [("w1", 1)]
    _feed(state, [_msg(2, [_store(2)], epoch=2)])
    assert state.counters.stale_messages == 1
    assert state.live_worker("w1") == ("qwen", 0)
    assert state.models()[MODEL] == [BS]
    assert [(c.worker_id, c.overlap_blocks) for c in state.match("qwen", TOKENS).candidates] == [("w1", 1)]


def test_a_removal_of_the_earlier_incarnation_under_another_model_keeps_the_live_one() -> None:
    """A WorkerRemoved naming the model of an earlier incarnation (its key expired after the id was re-used
    under another model) leaves the live incarnation and its blocks alone, and is counted."""
    state = IndexState()
    _feed(state, [_msg(0, [_store(0)], epoch=0)])
    _feed(state, [_msg(-1, [], model="qwen"), _msg(0, [_store(0)], model="qwen")])
    state.apply(state.applied_seq + 1, WorkerRemoved(worker_id="w1", model=MODEL, epoch=0))
    assert (state.counters.stale_removals, state.counters.workers_removed) == (1, 0)
    assert state.live_worker("w1") == ("qwen", 0)
    assert [(c.worker_id, c.overlap_blocks) for c in state.match("qwen", TOKENS).candidates] == [("w1", 1)]
    state.apply(state.applied_seq + 1, WorkerRemoved(worker_id="w1", model="qwen", epoch=0))
    assert state.live_worker("w1") is None


def test_holders_are_scored_in_their_own_block_size() -> None:
    """Workers of one model with block sizes 16 and 32 each get their exact overlap in their own blocks and in
    tokens; the result's block size stays the majority one (16)."""
    prompt = list(range(1000, 1100))  # 6 blocks of 16, 3 of 32
    l16 = local_block_hashes(prompt[:64], 16)
    l32 = local_block_hashes(prompt[:64], 32)
    state = IndexState()
    _feed(
        state,
        [
            _msg(0, [Stored([1, 2, 3], None, l16[:3])], worker="a", bs=16),
            _msg(0, [Stored([1, 2, 3, 4], None, l16[:4])], worker="b", bs=16),
            _msg(0, [Stored([7, 8], None, l32[:2])], worker="c", bs=32),
        ],
    )
    result = state.match(MODEL, prompt)
    assert (result.block_size, result.prompt_blocks) == (16, 6)
    assert [
        (c.worker_id, c.block_size, c.overlap_blocks, c.overlap_tokens, c.cached_blocks)
        for c in result.candidates
    ] == [("a", 16, 3, 48, 3), ("b", 16, 4, 64, 4), ("c", 32, 2, 64, 2)]
    assert [c.overlap_tokens for c in state.match(MODEL, prompt[:40]).candidates] == [32, 32, 32]


def test_an_empty_batch_after_an_ingest_cleared_may_skip_ahead() -> None:
    """After an ingest Cleared the first message may skip ahead even when it is empty; the next one is checked."""
    state = IndexState()
    _feed(state, [_msg(0, [_store(0)]), _msg(0, [Cleared("gap")]), _msg(5, []), _msg(6, [_store(0)])])
    assert (_counts(state), state.holder_health(), _overlap(state)) == ((0, 0, 0), {}, 1)
    _feed(state, [_msg(8, [])])
    assert (_counts(state), state.holder_health()) == ((0, 0, 0), {("w1", 0): "held"})
