"""Session affinity, pure: the session table's bounds and the decision's slack rule (`kvmesh.core.route.rank`)."""

from __future__ import annotations

import math

import pytest

from kvmesh.core.errors import RequestError
from kvmesh.core.index import Holder
from kvmesh.core.load import ActiveLoad
from kvmesh.core.protocol import PolicyOverride, RouteRequest, WorkerLoad
from kvmesh.core.route import Candidate, Policy, apply_override, check_route_request, decide, rank
from kvmesh.core.sessions import SessionTable

A, B, C = Holder("a", 0), Holder("b", 0), Holder("c", 1)


def test_table_remembers_the_latest_holder_until_idle_for_ttl() -> None:
    t = SessionTable(ttl_s=10.0, max_sessions=8)
    assert t.get("s", 0.0) is None
    t.note("s", A, 1.0)
    t.note("s", B, 2.0)  # the latest note wins
    assert t.get("s", 11.9) == B
    assert t.get("s", 12.0) is None  # idle exactly ttl_s: forgotten
    assert len(t) == 0


def test_table_forgets_the_least_recently_seen_past_its_bound() -> None:
    t = SessionTable(ttl_s=math.inf, max_sessions=2)
    t.note("s1", A, 1.0)
    t.note("s2", B, 2.0)
    t.note("s1", A, 3.0)  # s1 seen again: s2 is now the least recent
    t.note("s3", C, 4.0)
    assert [t.get(s, 5.0) for s in ("s1", "s2", "s3")] == [A, None, C]


def test_expire_forget_worker_entries_and_restore() -> None:
    t = SessionTable(ttl_s=10.0, max_sessions=4)
    t.note("old", A, 0.0)
    t.note("mid", B, 5.0)
    t.note("new", A, 9.0)
    assert t.expire(12.0) == 1
    assert t.entries(12.0) == [("mid", B, 7.0), ("new", A, 3.0)]
    assert t.forget_worker("a") == 1
    assert t.entries(12.0) == [("mid", B, 7.0)]
    # a peer's sessions: unknown ones added (an idle one beyond ttl refused), a known one kept as it is
    fresh = SessionTable(ttl_s=10.0, max_sessions=4)
    fresh.note("mid", C, 20.0)
    assert fresh.restore([("mid", B, 1.0), ("p1", A, 4.0), ("p2", B, 10.0), ("p3", C, 2.0)], 20.0) == 2
    assert fresh.entries(20.0) == [("p1", A, 4.0), ("p3", C, 2.0), ("mid", C, 0.0)]


@pytest.mark.parametrize("kw", [{"ttl_s": 0.0}, {"ttl_s": math.nan}, {"max_sessions": 0}])
def test_table_refuses_bounds_out_of_range(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        SessionTable(**kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the decision
# A 160-token prompt (10 blocks of 16). "a" holds 6 blocks, "b" 8: with no load b costs 2 blocks, a 4.
CANDS = [
    Candidate(worker_id="a", dp_rank=0, overlap_blocks=6, cached_blocks=100),
    Candidate(worker_id="b", dp_rank=0, overlap_blocks=8, cached_blocks=100),
]


def _winner(
    session: Holder | None,
    slack: float,
    *,
    active: dict[Holder, ActiveLoad] | None = None,
    engine: dict[Holder, WorkerLoad] | None = None,
    allowed: list[str] | None = None,
) -> tuple[str, str | None]:
    r = rank(
        CANDS, prompt_tokens=160, block_size=16, policy=Policy(session_slack=slack), session=session,
        active=active, engine=engine, allowed=allowed,
    )  # fmt: skip
    assert r is not None
    return r.winner.worker_id, r.session


def test_the_session_keeps_its_worker_within_the_slack_only() -> None:
    assert _winner(None, 0.25) == ("b", None)
    # a costs 2 blocks more than b; the slack is 0.25 × 10 = 2.5 blocks: kept
    assert _winner(A, 0.25) == ("a", "kept")
    # 0.19 × 10 = 1.9 blocks < 2: moved to b
    assert _winner(A, 0.19) == ("b", "moved")
    # the session's worker is the best anyway: kept at any slack
    assert _winner(B, 0.0) == ("b", "kept")
    # a session worker that is no candidate (gone, or not serving the model)
    assert _winner(Holder("z", 0), 1.0) == ("b", "moved")
    assert _winner(Holder("a", 1), 1.0) == ("b", "moved")  # same worker, another rank


def test_load_counts_against_the_session_worker() -> None:
    # 3 queued prefill blocks on a: 4 + 3 = 7 against b's 2; 5 blocks over, the slack of 0.25 allows 2.5
    active = {A: ActiveLoad(prefill_tokens=48, blocks=0, requests=1)}
    assert _winner(A, 0.25, active=active) == ("b", "moved")
    assert _winner(A, 0.5, active=active) == ("a", "kept")


def test_a_busy_session_worker_is_passed_over_and_candidates_narrow_it() -> None:
    engine = {A: WorkerLoad(worker_id="a", dp_rank=0, waiting=50)}
    assert _winner(A, 1.0, engine=engine) == ("b", "moved")
    assert _winner(A, 1.0, allowed=["b"]) == ("b", "moved")


def test_decide_and_temperature_sampling_respect_the_session() -> None:
    d = decide(CANDS, prompt_tokens=160, block_size=16, policy=Policy(session_slack=0.25), session=A)
    assert d is not None and d.winner.worker_id == "a"
    # sampling would pick among both; the session wins outright while within the slack
    hot = Policy(session_slack=0.25, temperature=5.0)
    picks = {
        rank(CANDS, prompt_tokens=160, block_size=16, policy=hot, seed=s, session=A).winner.worker_id  # type: ignore[union-attr]
        for s in range(20)
    }
    assert picks == {"a"}


def test_session_id_and_slack_are_checked() -> None:
    check_route_request(RouteRequest(model="m", token_ids=[1], session_id="x" * 256))
    for bad in ("", "x" * 257):
        with pytest.raises(RequestError, match="session_id must have 1 to 256 characters") as e:
            check_route_request(RouteRequest(model="m", token_ids=[1], session_id=bad))
        assert e.value.field == "session_id"
    with pytest.raises(RequestError, match="session_slack must be a finite number") as e:
        check_route_request(RouteRequest(model="m", token_ids=[1], policy=PolicyOverride(session_slack=-1.0)))
    assert apply_override(Policy(), PolicyOverride(session_slack=0.5)).session_slack == 0.5
