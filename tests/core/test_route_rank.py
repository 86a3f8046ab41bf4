"""`kvmesh.core.route.rank` and the selection decide exactly as the reference rule: one `Score` per candidate,
sorted by (busy, rounded cost, cached blocks, seeded tiebreak), sampled over the eligible ones (pure)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.index import Holder
from kvmesh.core.load import ZERO_LOAD, ActiveLoad
from kvmesh.core.protocol import WorkerLoad
from kvmesh.core.route import (
    MAX_SKIPPED_LISTED,
    Candidate,
    Decision,
    Policy,
    RankSet,
    RegisteredWorker,
    Score,
    decide,
    rank,
    score,
    select_candidates,
    softmax_probabilities,
)
from kvmesh.core.state import HolderMatch

WORKERS = ("a", "b", "c", "d", "e")
TIERS = ("GPU", "CPU", "DISK", "NVME")


def tiebreak(seed: int, worker_id: str, dp_rank: int) -> int:
    """The documented seeded tiebreak: XXH3-64 of ``worker_id ‖ 0 ‖ dp_rank`` under the seed."""
    return xxhash.xxh3_64_intdigest(f"{worker_id}\0{dp_rank}".encode(), seed=seed)


def reference_decide(
    candidates: Sequence[Candidate],
    *,
    prompt_tokens: int,
    block_size: int,
    policy: Policy,
    active: Mapping[Holder, ActiveLoad],
    engine: Mapping[Holder, WorkerLoad],
    seed: int,
    allowed: Sequence[str] | None,
) -> Decision | None:
    """The rule as written before `rank`: a `Score` for every candidate, one sort on the full key."""
    allow = set(allowed) if allowed is not None else None
    scores: list[Score] = []
    for c in candidates:
        if allow is not None and c.worker_id not in allow:
            continue
        holder = Holder(c.worker_id, c.dp_rank)
        scores.append(
            score(
                c,
                prompt_tokens=prompt_tokens,
                block_size=block_size,
                policy=policy,
                active=active.get(holder, ZERO_LOAD),
                engine=engine.get(holder),
            )
        )
    if not scores:
        return None
    all_busy = all(s.busy for s in scores)
    scores.sort(
        key=lambda s: (
            s.busy and not all_busy,
            round(s.cost, 9),
            s.cached_blocks,
            tiebreak(seed, s.worker_id, s.dp_rank),
        )
    )
    eligible = [s for s in scores if all_busy or not s.busy]
    if policy.temperature <= 0 or len(eligible) == 1:
        return Decision(winner=scores[0], scores=tuple(scores))
    probs = softmax_probabilities([s.cost for s in eligible], policy.temperature)
    with_p = [replace(s, probability=p) for s, p in zip(eligible, probs, strict=True)]
    r = random.Random(seed).random()
    acc = 0.0
    winner = with_p[-1]
    for s in with_p:
        acc += s.probability or 0.0
        if r < acc:
            winner = s
            break
    return Decision(winner=winner, scores=(*with_p, *scores[len(eligible) :]))


tiers_st = st.none() | st.dictionaries(st.sampled_from(TIERS), st.integers(0, 4), max_size=3)
candidate_st = st.builds(
    Candidate,
    worker_id=st.sampled_from(WORKERS),
    dp_rank=st.integers(0, 2),
    overlap_blocks=st.integers(0, 6),
    cached_blocks=st.integers(0, 4),
    tiers=tiers_st,
    block_size=st.sampled_from((0, 4, 8)),
)
policy_st = st.builds(
    Policy,
    overlap_weight=st.sampled_from((0.0, 1 / 3, 0.5, 1.0, 10.0)),
    decode_weight=st.sampled_from((0.0, 0.1, 1.0)),
    temperature=st.sampled_from((0.0, 0.0, 0.3, 1.0, 5.0)),
    tier_weights=st.sampled_from(({"GPU": 1.0, "CPU": 0.5, "DISK": 0.25}, {"GPU": 0.7, "CPU": 0.1 + 0.2})),
    busy_kv_usage=st.sampled_from((0.5, 0.95, 2.0)),
    busy_waiting=st.sampled_from((0, 2, 8)),
)
holder_st = st.tuples(st.sampled_from(WORKERS), st.integers(0, 2)).map(lambda t: Holder(*t))
active_st = st.dictionaries(
    holder_st,
    st.builds(
        ActiveLoad, prefill_tokens=st.integers(0, 64), blocks=st.integers(0, 8), requests=st.integers(1, 3)
    ),
    max_size=4,
)
engine_st = st.dictionaries(
    holder_st,
    st.builds(
        WorkerLoad,
        worker_id=st.just("x"),
        waiting=st.none() | st.integers(0, 10),
        kv_usage=st.none() | st.sampled_from((0.1, 0.5, 0.96, 1.0)),
    ),
    max_size=4,
)
allowed_st = st.none() | st.lists(st.sampled_from((*WORKERS, "z")), max_size=3)
rank_kw_st = st.fixed_dictionaries(
    {
        "prompt_tokens": st.integers(0, 64),
        "block_size": st.sampled_from((0, 1, 4, 16)),
        "policy": policy_st,
        "active": active_st,
        "engine": engine_st,
        "seed": st.integers(0, 2**64 - 1),
        "allowed": allowed_st,
    }
)


@settings(max_examples=600, deadline=None)
@given(
    candidates=st.lists(candidate_st, max_size=12),
    kw=rank_kw_st,
)
def test_rank_decides_as_the_reference_rule(candidates: list[Candidate], kw: dict[str, Any]) -> None:
    """On any candidates (ties, duplicates, busy workers, tiers, load, temperature > 0, ``allowed``) `decide`
    equals the reference rule, and `rank`'s winner, scores and busy candidates passed over agree with it."""
    want = reference_decide(candidates, **kw)
    assert decide(candidates, **kw) == want
    ranking = rank(candidates, **kw)
    if want is None:
        assert ranking is None
        return
    assert ranking is not None
    assert ranking.winner_score() == want.winner
    assert (ranking.winner.worker_id, ranking.winner.dp_rank) == (want.winner.worker_id, want.winner.dp_rank)
    assert ranking.scores() == want.scores
    busy_tail = [] if want.winner.busy else [(s.worker_id, s.dp_rank) for s in want.scores if s.busy]
    assert [(c.worker_id, c.dp_rank) for c in ranking.passed_over()] == busy_tail


@settings(max_examples=300, deadline=None)
@given(
    candidates=st.lists(candidate_st, max_size=12, unique_by=lambda c: (c.worker_id, c.dp_rank)),
    kw=rank_kw_st,
    shuffle_seed=st.integers(0, 2**32),
)
def test_decision_does_not_depend_on_the_candidates_order(
    candidates: list[Candidate], kw: dict[str, Any], shuffle_seed: int
) -> None:
    """Distinct (worker, rank) candidates in any order get the same winner and the same scores in the same
    order: what lets `select_candidates` leave them unsorted when the bound cuts none."""
    shuffled = list(candidates)
    random.Random(shuffle_seed).shuffle(shuffled)
    a, b = rank(candidates, **kw), rank(shuffled, **kw)
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.winner_score() == b.winner_score()
    assert a.scores() == b.scores()
    assert a.passed_over() == b.passed_over()


def test_rank_reads_index_holders_as_they_come() -> None:
    """A `HolderMatch` (the local index's answer) decides as the `Candidate` with the same fields."""
    holders = [
        HolderMatch(worker_id="a", dp_rank=0, overlap_blocks=2, cached_blocks=9, block_size=4),
        HolderMatch(
            worker_id="b", dp_rank=1, overlap_blocks=3, cached_blocks=5, tiers={"CPU": 3}, block_size=4
        ),
        HolderMatch(worker_id="c", dp_rank=0, overlap_blocks=2, cached_blocks=9, block_size=4),
    ]
    as_candidates = [
        Candidate(
            worker_id=h.worker_id,
            dp_rank=h.dp_rank,
            overlap_blocks=h.overlap_blocks,
            cached_blocks=h.cached_blocks,
            tiers=h.tiers,
            block_size=h.block_size,
        )
        for h in holders
    ]
    for seed in range(8):
        assert decide(holders, prompt_tokens=32, block_size=4, seed=seed) == decide(
            as_candidates, prompt_tokens=32, block_size=4, seed=seed
        )
    d = decide(holders, prompt_tokens=32, block_size=4, seed=0)
    assert d is not None
    assert [(s.worker_id, s.cost) for s in d.scores][2] == ("b", 6.5)  # 3 CPU blocks at 0.5: 6 tokens cached


def test_near_costs_tie_only_when_they_round_alike() -> None:
    """Costs 1e-10 apart tie (they round to the same 9 places), so the fewer cached blocks win over the lower
    raw cost; 2e-9 apart they do not tie, and the lower cost wins."""
    cands = [
        Candidate(worker_id="a", dp_rank=0, overlap_blocks=0, cached_blocks=1),
        Candidate(worker_id="b", dp_rank=0, overlap_blocks=0, cached_blocks=5),
    ]
    on_a = {Holder("a", 0): ActiveLoad(blocks=1, requests=1)}
    for weight, winner in ((1e-10, "a"), (2e-9, "b")):
        pol = Policy(decode_weight=weight)
        d = decide(cands, prompt_tokens=8, block_size=1, policy=pol, active=on_a)
        assert d is not None and d.winner.worker_id == winner
        assert [s.cost for s in d.scores] == ([8.0000000001, 8.0] if winner == "a" else [8.0, 8.000000002])


# ---------------------------------------------------------------------------------------- selection


def _preference(kept: Sequence[Candidate], seed: int) -> tuple[list[Candidate], list[Candidate]]:
    """Holders with overlap (most first, then fewest cached, worker, rank), then those without (fewest
    cached, then the seeded tiebreak)."""
    with_overlap = sorted(
        (c for c in kept if c.overlap_blocks > 0),
        key=lambda c: (-c.overlap_blocks, c.cached_blocks, c.worker_id, c.dp_rank),
    )
    without = sorted(
        (c for c in kept if c.overlap_blocks <= 0),
        key=lambda c: (c.cached_blocks, tiebreak(seed, c.worker_id, c.dp_rank)),
    )
    return with_overlap, without


def reference_select(
    indexed: Sequence[Candidate],
    ranks: RankSet | None,
    *,
    max_candidates: int,
    seed: int,
    loaded: Callable[[str, int], bool],
    idle_candidates: int,
) -> tuple[list[Candidate], int, int, bool, list[tuple[str, int, str]], int]:
    """The selection as written before: a key lambda with the seeded tiebreak for every holder without overlap."""
    skipped: list[tuple[str, int, str]] = []
    if ranks is None:
        kept = list(indexed)
    else:
        kept = []
        for c in indexed:
            if ranks.contains(c.worker_id, c.dp_rank):
                kept.append(c)
                continue
            reason = ranks.stale_reason(c.worker_id, c.dp_rank)
            if reason is not None and len(skipped) < MAX_SKIPPED_LISTED:
                skipped.append((c.worker_id, c.dp_rank, reason))
    keyed = {(c.worker_id, c.dp_rank) for c in kept}
    if len(kept) <= max_candidates:  # none cut: kept in the given order (the decision orders them itself)
        chosen = list(kept)
    else:
        with_overlap, without = _preference(kept, seed)
        chosen = (with_overlap + without)[:max_candidates]
    unindexed = 0
    if ranks is not None:
        unindexed = ranks.live_count - len(keyed)
        held = {(w, r) for w, r, _ in skipped}
        skipped.extend(x for x in ranks.stale_listed if (x[0], x[1]) not in held)
        del skipped[MAX_SKIPPED_LISTED:]
    room = max_candidates - len(chosen)
    bounded = len(kept) + min(unindexed, idle_candidates) > max_candidates
    if ranks is not None and room > 0 and unindexed > 0:
        idle: list[Candidate] = []
        busy: list[Candidate] = []
        want_idle = min(room, idle_candidates)
        for wid, r in ranks.walk(seed):
            if (wid, r) in keyed:
                continue
            c = Candidate(worker_id=wid, dp_rank=r, overlap_blocks=0, cached_blocks=0)
            if loaded(wid, r):
                if len(busy) < want_idle:
                    busy.append(c)
            else:
                idle.append(c)
                if len(idle) >= want_idle:
                    break
        chosen.extend(idle + busy[: max(0, want_idle - len(idle))])
    total = len(kept) + unindexed
    stale = ranks.stale_count if ranks is not None else 0
    return chosen, total, total - len(chosen), bounded, skipped, stale


registered_st = st.none() | st.lists(
    st.builds(
        RegisteredWorker,
        st.sampled_from((*WORKERS, "f", "g")),
        st.integers(1, 4),
        st.dictionaries(st.integers(0, 4), st.sampled_from(("silent", "gone")), max_size=2),
    ),
    max_size=6,
    unique_by=lambda w: w.worker_id,
)


@settings(max_examples=400, deadline=None)
@given(
    indexed=st.lists(candidate_st, max_size=14),
    registered=registered_st,
    loaded_workers=st.frozensets(st.sampled_from((*WORKERS, "f", "g"))),
    bounds=st.fixed_dictionaries(
        {
            "max_candidates": st.integers(1, 16),
            "seed": st.integers(0, 2**64 - 1),
            "idle_candidates": st.integers(0, 4),
        }
    ),
)
def test_selection_chooses_as_the_reference_rule(
    indexed: list[Candidate],
    registered: list[RegisteredWorker] | None,
    loaded_workers: frozenset[str],
    bounds: dict[str, int],
) -> None:
    """`select_candidates` keeps, orders, cuts and counts exactly as the reference rule (ties on cached blocks
    broken by the seeded tiebreak, stale ranks listed, idle registered ranks drawn)."""
    ranks = RankSet(registered) if registered is not None else None

    def loaded(w: str, r: int) -> bool:
        return w in loaded_workers

    kw: dict[str, Any] = {**bounds, "loaded": loaded}
    sel = select_candidates(indexed, ranks, **kw)
    got = (sel.candidates, sel.total, sel.cut, sel.bounded, sel.skipped, sel.skipped_total)
    assert got == reference_select(indexed, ranks, **kw)
