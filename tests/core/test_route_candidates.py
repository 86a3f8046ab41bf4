"""`kvmesh.core.route.select_candidates` and `RankSet`: the bounded, deterministic choice of what a route scores."""

from __future__ import annotations

from kvmesh.core.route import (
    IDLE_CANDIDATES,
    Candidate,
    RankSet,
    RegisteredWorker,
    select_candidates,
)


def cand(w: str, r: int, overlap: int = 0, cached: int = 0) -> Candidate:
    return Candidate(worker_id=w, dp_rank=r, overlap_blocks=overlap, cached_blocks=cached)


def test_walk_yields_every_live_rank_once_from_the_seed() -> None:
    """`RankSet.walk` yields each non-stale registered rank exactly once, starting where the seed says,
    and skips a worker whose every rank is stale."""
    ranks = RankSet(
        [
            RegisteredWorker("b", 3, {1: "silent"}),
            RegisteredWorker("a", 2, {}),
            RegisteredWorker("c", 2, {0: "silent", 1: "silent"}),
        ]
    )
    assert (ranks.live_count, ranks.stale_count) == (4, 3)
    for seed in range(10):
        walked = list(ranks.walk(seed))
        assert sorted(walked) == [("a", 0), ("a", 1), ("b", 0), ("b", 2)], seed
    assert next(ranks.walk(2)) == ("b", 0)  # position 2 of a0 a1 b0 b1 b2 c0 c1
    assert next(ranks.walk(3)) == ("b", 2)  # b/1 is stale: the next live one
    assert next(ranks.walk(5)) == ("a", 0)  # every rank of c is stale: wrapped around
    assert list(RankSet([RegisteredWorker("c", 1, {0: "x"})]).walk(0)) == []


def test_holders_with_overlap_come_first_and_idle_ranks_are_few() -> None:
    """Under the bound, holders with overlap are kept before holders without and before registered ranks the
    index lacks; of those only `IDLE_CANDIDATES` idle ones are drawn, so 10,000 empty ranks cost 16."""
    ranks = RankSet([RegisteredWorker("h", 2, {}), RegisteredWorker("e", 10_000, {7: "silent"})])
    indexed = [cand("h", 0, overlap=3, cached=9), cand("h", 1, cached=1), cand("gone", 0, overlap=5)]
    sel = select_candidates(indexed, ranks, max_candidates=1024, seed=42)
    assert [(c.worker_id, c.dp_rank) for c in sel.candidates[:2]] == [("h", 0), ("h", 1)]
    assert len(sel.candidates) == 2 + IDLE_CANDIDATES
    assert all(c.worker_id == "e" and c.overlap_blocks == 0 for c in sel.candidates[2:])
    assert (sel.total, sel.cut, sel.bounded) == (10_001, 10_001 - 2 - IDLE_CANDIDATES, False)
    assert (sel.skipped, sel.skipped_total) == ([("e", 7, "silent")], 1)
    again = select_candidates(indexed, ranks, max_candidates=1024, seed=42)
    assert again.candidates == sel.candidates  # every replica draws the same ranks for the same request
    other = select_candidates(indexed, ranks, max_candidates=1024, seed=43)
    assert other.candidates[2:] != sel.candidates[2:]  # another request, other idle ranks

    tight = select_candidates(indexed, ranks, max_candidates=2, seed=42)
    assert [(c.worker_id, c.dp_rank) for c in tight.candidates] == [("h", 0), ("h", 1)]
    assert tight.bounded and tight.cut == 10_001 - 2


def test_loaded_ranks_are_drawn_only_when_idle_ones_run_out() -> None:
    """A registered rank with load on the router is scored only after every idle one was drawn (an idle
    empty rank always costs less)."""
    ranks = RankSet([RegisteredWorker("e", 4, {})])
    sel = select_candidates([], ranks, seed=0, loaded=lambda w, r: r in (0, 1), idle_candidates=2)
    assert sorted(c.dp_rank for c in sel.candidates) == [2, 3]
    sel = select_candidates([], ranks, seed=0, loaded=lambda w, r: r != 3, idle_candidates=2)
    assert [c.dp_rank for c in sel.candidates] == [3, 0]  # the one idle rank, then a loaded one


def test_a_stale_holder_is_skipped_with_its_reason() -> None:
    """An index holder whose rank is stale in the registry is not a candidate and is listed first as skipped."""
    ranks = RankSet([RegisteredWorker("h", 2, {0: "engine silent"})])
    sel = select_candidates([cand("h", 0, overlap=4), cand("h", 1)], ranks, seed=1)
    assert [(c.worker_id, c.dp_rank) for c in sel.candidates] == [("h", 1)]
    assert (sel.skipped, sel.skipped_total, sel.total) == ([("h", 0, "engine silent")], 1, 1)
    assert select_candidates([cand("x", 0, overlap=1)], None).candidates == [cand("x", 0, overlap=1)]
