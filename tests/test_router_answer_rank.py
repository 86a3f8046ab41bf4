"""The router's answer decides as `kvmesh.core.route.decide` on the same candidates and loads: winner, explain's
scores in order, and the busy candidates passed over (sans I/O, no NATS)."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.index import Holder
from kvmesh.core.load import EngineLoads, LoadLedger
from kvmesh.core.protocol import Routed, WorkerLoad
from kvmesh.core.route import Policy, decide, parse_route_request, route_seed
from kvmesh.core.state import HolderMatch
from kvmesh.router.answer import MatchAnswer, route_answer

BS = 4
WORKERS = ("a", "b", "c", "d")

holder_st = st.builds(
    HolderMatch,
    worker_id=st.sampled_from(WORKERS),
    dp_rank=st.integers(0, 1),
    overlap_blocks=st.integers(0, 4),
    cached_blocks=st.integers(0, 3),
    tiers=st.none() | st.dictionaries(st.sampled_from(("GPU", "CPU")), st.integers(1, 2), min_size=1),
    block_size=st.just(BS),
).map(lambda h: msgspec.structs.replace(h, overlap_tokens=h.overlap_blocks * BS))
load_st = st.fixed_dictionaries(
    {
        "kv_usage": st.none() | st.sampled_from((0.2, 0.97)),
        "waiting": st.none() | st.integers(0, 9),
    }
)


@settings(max_examples=200, deadline=None)
@given(
    holders=st.lists(holder_st, max_size=8, unique_by=lambda h: (h.worker_id, h.dp_rank)),
    reports=st.dictionaries(st.tuples(st.sampled_from(WORKERS), st.integers(0, 1)), load_st, max_size=4),
    routed=st.lists(st.tuples(st.sampled_from(WORKERS), st.integers(0, 1), st.integers(0, 16)), max_size=4),
    fields=st.fixed_dictionaries(
        {
            "explain": st.booleans(),
            "request_id": st.none() | st.sampled_from(("r1", "r2")),
            "policy": st.none() | st.fixed_dictionaries({"temperature": st.sampled_from((0.0, 0.7))}),
            "candidates": st.none() | st.lists(st.sampled_from(WORKERS), min_size=1, max_size=2),
        }
    ),
)
def test_the_answer_decides_as_decide(
    holders: list[HolderMatch],
    reports: dict[tuple[str, int], dict[str, Any]],
    routed: list[tuple[str, int, int]],
    fields: dict[str, Any],
) -> None:
    """For index holders, engine reports (some busy) and requests in flight, the reply names `decide`'s
    winner, explain lists its scores in its order, and the busy candidates passed over are its busy tail."""
    body = msgspec.json.encode({"model": "m", "token_ids": list(range(16)), **fields})
    parsed = parse_route_request(body)
    engine_loads = EngineLoads()
    for (w, r), fields_ in reports.items():
        engine_loads.update(WorkerLoad(worker_id=w, dp_rank=r, **fields_), 99.0)
    ledger = LoadLedger()
    for i, (w, r, tokens) in enumerate(routed):
        ledger.routed(
            Routed(request_id=f"q{i}", worker_id=w, dp_rank=r, prefill_tokens=tokens, blocks=2), 99.0
        )
    out = route_answer(
        parsed,
        body,
        MatchAnswer(index_seq=7, block_size=BS, candidates=tuple(holders)),
        None,
        index_mode=("exact", None),
        policy=Policy(),
        max_candidates=1024,
        ledger=ledger,
        engine_loads=engine_loads,
        now=100.0,
        wall=1100.0,
        records=None,
        heartbeat_late_s=0.0,
    )
    active = {}
    engine = {}
    for h in holders:
        key = Holder(h.worker_id, h.dp_rank)
        a = ledger.load(h.worker_id, h.dp_rank, excluding=parsed.request_id, now_s=100.0)
        if a.requests:
            active[key] = a
        e = engine_loads.get(h.worker_id, h.dp_rank, 100.0)
        if e is not None:
            engine[key] = e
    want = decide(
        holders,
        prompt_tokens=16,
        block_size=BS,
        policy=Policy(temperature=fields["policy"]["temperature"]) if fields["policy"] else Policy(),
        active=active,
        engine=engine,
        seed=route_seed(parsed.request_id, body),
        allowed=parsed.candidates,
    )
    if want is None:
        assert out.reply is None and out.error is not None
        return
    reply = out.reply
    assert reply is not None
    assert (reply.worker_id, reply.dp_rank, reply.cached_tokens) == (
        want.winner.worker_id,
        want.winner.dp_rank,
        want.winner.overlap_tokens,
    )
    if fields["explain"]:
        assert reply.scores is not None
        got = [(s.worker_id, s.dp_rank, s.cost, s.busy, s.probability) for s in reply.scores]
        assert got == [(s.worker_id, s.dp_rank, s.cost, s.busy, s.probability) for s in want.scores]
    else:
        assert reply.scores is None
    tail = [] if want.winner.busy else [Holder(s.worker_id, s.dp_rank) for s in want.scores if s.busy]
    assert list(out.busy_skipped) == tail
