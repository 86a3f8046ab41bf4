"""A match reuses each index's holders and their no-overlap answers until the state changes
(`IndexState._view`): every change a match can see — a store, a new worker, a removal, a lost stretch of the
stream — shows in the very next match, exactly."""

from __future__ import annotations

from kvmesh.core.events import Event, EventsMessage, Stored, WorkerRemoved
from kvmesh.core.hashing import local_block_hashes
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
