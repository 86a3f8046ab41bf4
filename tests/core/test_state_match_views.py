"""A match reuses each index's holders and their no-overlap answers until the state changes
(`IndexState._view`): every change a match can see — a store, a new worker, a removal, a lost stretch of the
stream — shows in the very next match, exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.errors import UnknownModelError
from kvmesh.core.events import Cleared, Event, EventsMessage, Message, Removed, Stored, WorkerRemoved
from kvmesh.core.hashing import local_block_hashes, prefix_keys
from kvmesh.core.index import Holder
from kvmesh.core.state import HolderMatch, IndexState

BS = 4
PROMPT = list(range(100, 100 + 6 * BS))
LOCAL = local_block_hashes(PROMPT, BS)


def _stored(worker: str, seq: int, n: int, first_engine: int) -> EventsMessage:
    engine = list(range(first_engine, first_engine + n))
    return EventsMessage(
        worker_id=worker,
        dp_rank=0,
        model="m",
        block_size=BS,
        epoch=1,
        seq=seq,
        events=list[Event]([Stored(engine, None, LOCAL[:n])]),
    )


def _row(worker: str, overlap: int, cached: int, health: str | None = None) -> HolderMatch:
    return HolderMatch(
        worker_id=worker,
        dp_rank=0,
        overlap_blocks=overlap,
        cached_blocks=cached,
        block_size=BS,
        overlap_tokens=overlap * BS,
        health=health,
    )


def test_every_change_shows_in_the_next_match() -> None:
    st = IndexState()
    st.apply(1, _stored("a", 1, 3, 10))
    st.apply(2, _stored("b", 1, 1, 20))
    assert st.match("m", PROMPT).candidates == (_row("a", 3, 3), _row("b", 1, 1))
    assert st.match("m", PROMPT[:BS]).candidates == (_row("a", 1, 3), _row("b", 1, 1))  # the same view again

    st.apply(3, _stored("c", 1, 2, 30))  # a new worker
    assert st.match("m", PROMPT).candidates == (_row("a", 3, 3), _row("b", 1, 1), _row("c", 2, 2))
    assert st.match("m", [9] * (2 * BS)).candidates == (_row("a", 0, 3), _row("b", 0, 1), _row("c", 0, 2))

    st.apply(4, _stored("b", 2, 5, 40))  # b stores a second, longer copy: 6 blocks cached
    assert st.match("m", [9] * BS).candidates == (_row("a", 0, 3), _row("b", 0, 6), _row("c", 0, 2))

    st.mark_gap(4)  # a lost stretch of the stream: every holder is flagged
    assert st.match("m", PROMPT).candidates == (
        _row("a", 3, 3, "stream_gap"),
        _row("b", 5, 6, "stream_gap"),
        _row("c", 2, 2, "stream_gap"),
    )

    st.apply(5, WorkerRemoved(worker_id="a", model="m"))
    assert [c.worker_id for c in st.match("m", PROMPT).candidates] == ["b", "c"]
    assert st.match("m", [9] * BS).candidates == (
        _row("b", 0, 6, "stream_gap"),
        _row("c", 0, 2, "stream_gap"),
    )


def test_pre_hashed_matches_share_the_views_and_see_changes_too() -> None:
    st = IndexState()
    st.apply(1, _stored("a", 1, 2, 10))
    assert st.match_local_hashes("m", LOCAL).candidates == (_row("a", 2, 2),)
    st.apply(2, _stored("a", 2, 4, 20))
    assert st.match_local_hashes("m", LOCAL).candidates == (_row("a", 4, 6),)
    assert st.match_local_hashes("m", LOCAL[1:]).candidates == (_row("a", 0, 6),)


# ---------------------------------------------------------------------------------------- views kept up to date

WORKERS = ("a", "b", "c", "pool")
TOKENS = list(range(500, 500 + 8 * BS))
LOCAL8 = local_block_hashes(TOKENS, BS)


def _action(data: st.DataObject, seqs: dict[tuple[str, int], int]) -> Message | str:
    """One random stream message (or ``"gap"``): stores, removals and clears of a few workers, engine sequences
    that skip, repeat or go back (holds, refusals), new epochs, removals of workers, another model, another
    block size, backend readers."""
    kind = data.draw(
        st.sampled_from(("store", "store", "store", "remove", "clear", "removed", "model", "size", "gap")),
        label="kind",
    )
    worker = data.draw(st.sampled_from(WORKERS), label="worker")
    rank = data.draw(st.integers(0, 1), label="rank")
    if kind == "gap":
        return "gap"
    if kind == "removed":
        return WorkerRemoved(worker_id=worker, model="m", epoch=data.draw(st.none() | st.integers(0, 2)))
    step = data.draw(st.sampled_from((1, 1, 1, 2, 0, -1)), label="seq step")
    seq = seqs[(worker, rank)] = max(0, seqs.get((worker, rank), 0) + step)
    n = data.draw(st.integers(1, 8), label="blocks")
    base = data.draw(st.sampled_from((0, 1000)), label="engine hashes")  # equal or different engine hashes
    events: list[Event]
    if kind == "store":
        events = [Stored([base + i for i in range(n)], None, LOCAL8[:n])]
    elif kind == "remove":
        events = [Removed([base + i for i in range(n - 1, 8)])]
    else:
        events = [Cleared()]
    readers = ["a", "b"] if worker == "pool" and data.draw(st.booleans(), label="readers") else None
    return EventsMessage(
        worker_id=worker,
        dp_rank=rank,
        model="m2" if kind == "model" else "m",
        block_size=BS * 2 if kind == "size" else BS,
        epoch=data.draw(st.integers(1, 2), label="epoch"),
        seq=seq,
        events=events,
        readers=readers,
    )


@settings(max_examples=300, deadline=None)
@given(data=st.data(), max_blocks=st.none() | st.integers(4, 24))
def test_kept_views_answer_as_views_built_afresh(data: st.DataObject, max_blocks: int | None) -> None:
    """After every message, a match through the views kept and updated holder by holder equals the match
    through views built from nothing (`IndexState._fresh_views`): no holder's cached blocks or health is ever
    stale, whatever the message did (holds, refusals, clears, removals, evictions, new models or sizes)."""
    st_ = IndexState(max_blocks=max_blocks)
    seqs: dict[tuple[str, int], int] = {}
    prompts = (TOKENS, TOKENS[: 3 * BS], [7] * (4 * BS))
    for stream_seq in range(1, data.draw(st.integers(1, 40), label="messages") + 1):
        msg = _action(data, seqs)
        if msg == "gap":
            st_.mark_gap(stream_seq - 1)
        else:
            assert not isinstance(msg, str)
            st_.apply(stream_seq, msg)
        for model in ("m", "m2"):
            for prompt in prompts:
                try:
                    kept = st_.match(model, prompt)
                except UnknownModelError:
                    kept = None
                st_._views.clear()  # the reference: every view built again from the state
                try:
                    fresh = st_.match(model, prompt)
                except UnknownModelError:
                    fresh = None
                assert kept == fresh, (stream_seq, model, msg)


def test_an_eviction_shows_on_every_cut_holder_in_the_next_match() -> None:
    """A message of one holder that brings the state over its bound cuts the other holders too: their cached
    blocks change without a message of theirs, and the next match shows it."""
    st_ = IndexState(max_blocks=10)

    def stored(worker: str, seq: int, n: int, base: int) -> EventsMessage:
        return EventsMessage(worker_id=worker, dp_rank=0, model="m", block_size=BS, epoch=1, seq=seq,
                             events=list[Event]([Stored([base + i for i in range(n)], None, LOCAL8[:n])]))  # fmt: skip

    st_.apply(1, stored("a", 1, 8, 0))
    st_.apply(2, stored("b", 1, 1, 1000))
    assert [c.cached_blocks for c in st_.match("m", TOKENS).candidates] == [8, 1]
    st_.apply(3, stored("b", 2, 8, 2000))  # 17 blocks: both caches cut to a common level, `a` with no message
    assert [c.cached_blocks for c in st_.match("m", TOKENS).candidates] == [4, 4]


def test_a_backend_that_stops_naming_readers_counts_for_no_one_in_the_next_match() -> None:
    """Backend readers change with a message of the backend alone: the next match of a reader no longer
    counts the backend's blocks, and the backend becomes a candidate of its own."""

    def msg(worker: str, seq: int, n: int, base: int, readers: list[str] | None) -> EventsMessage:
        return EventsMessage(worker_id=worker, dp_rank=0, model="m", block_size=BS, epoch=1, seq=seq,
                             events=list[Event]([Stored([base + i for i in range(n)], None, LOCAL8[:n])]),
                             readers=readers)  # fmt: skip

    st_ = IndexState()
    st_.apply(1, msg("a", 1, 1, 0, None))
    st_.apply(2, msg("pool", 1, 6, 1000, ["a"]))
    assert [(c.worker_id, c.overlap_blocks) for c in st_.match("m", TOKENS).candidates] == [("a", 6)]
    st_.apply(
        3, EventsMessage(worker_id="pool", dp_rank=0, model="m", block_size=BS, epoch=1, seq=2, events=[])
    )
    assert [(c.worker_id, c.overlap_blocks) for c in st_.match("m", TOKENS).candidates] == [
        ("a", 1),
        ("pool", 6),
    ]


def test_a_fleet_wide_prefix_is_answered_from_the_overlap_most_holders_share() -> None:
    """Every holder holds the prompt's first blocks: `PrefixIndex.match_common` names the overlap most share
    and only the others; the state's answers at that overlap are kept per view and follow each holder's own
    changes (its cached blocks) in the next match."""
    st_ = IndexState()

    def stored(worker: str, seq: int, n: int, base: int) -> EventsMessage:
        return EventsMessage(worker_id=worker, dp_rank=0, model="m", block_size=BS, epoch=1, seq=seq,
                             events=list[Event]([Stored([base + i for i in range(n)], None, LOCAL8[:n])]))  # fmt: skip

    for i, w in enumerate(("a", "b", "c", "d")):
        st_.apply(i + 1, stored(w, 1, 5 if w == "c" else 2, 100 * i))
    index = st_._live_indexes("m")[BS]
    keys = np.array(prefix_keys(LOCAL8), dtype=np.uint64)
    assert index.match_common(keys) == (2, {Holder("c", 0): 5})
    want = (_row_at("a", 2, 2), _row_at("b", 2, 2), _row_at("c", 5, 5), _row_at("d", 2, 2))
    assert st_.match("m", TOKENS).candidates == want
    assert st_.match("m", TOKENS).candidates == want  # the kept answers at overlap 2, copied
    st_.apply(5, stored("d", 2, 1, 900))  # d caches one more block (a new chain): only d's answers change
    assert st_.match("m", TOKENS).candidates == (*want[:3], _row_at("d", 2, 3))
    st_.apply(6, stored("e", 1, 1, 1000))  # e holds the first block only
    assert index.match_common(keys) == (2, {Holder("c", 0): 5, Holder("e", 0): 1})
    st_.apply(7, EventsMessage(worker_id="f", dp_rank=0, model="m", block_size=BS, epoch=1, seq=1, events=[]))
    common, others = index.match_common(keys)  # f holds nothing: no overlap every holder shares
    assert (common, others[Holder("a", 0)], Holder("f", 0) in others) == (0, 2, False)
    assert [c.overlap_blocks for c in st_.match("m", TOKENS).candidates] == [2, 2, 5, 2, 1, 0]


def _row_at(worker: str, overlap: int, cached: int) -> HolderMatch:
    return _row(worker, overlap, cached)
