"""Exact-value tests of the router's sans-I/O policy (`kvmesh.router.answer`, `.health`, `.stats`): no NATS."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.errors import InternalError, NoWorkersError, ProtocolError, UnknownModelError
from kvmesh.core.events import Event, EventsMessage, Stored
from kvmesh.core.hashing import local_block_hashes
from kvmesh.core.index import Holder
from kvmesh.core.load import EngineLoads, LedgerStats, LoadLedger, Receipts
from kvmesh.core.protocol import (
    LedgerEntry,
    LedgerSnapshot,
    MatchHolder,
    MatchReply,
    Routed,
    RouteRequest,
    WorkerLoad,
    WorkerRecord,
    encode,
    error_reply,
)
from kvmesh.core.route import (
    Candidate,
    Policy,
    RankSet,
    RegisteredWorker,
    available_tokens,
    parse_route_request,
)
from kvmesh.core.state import IndexState
from kvmesh.router.answer import (
    MatchAnswer,
    RouteOutcome,
    match_answer,
    match_request,
    parse_match_reply,
    refuse_without_live_ranks,
    registered_block_size,
    route_answer,
    serves_unindexed,
)
from kvmesh.router.health import (
    MAX_HOLDERS_LISTED,
    IndexView,
    LagMeter,
    heartbeat_late_after,
    holder_state,
    holders_status,
    index_mode,
)
from kvmesh.router.stats import LatencyWindow, ReplicaFigures, index_stats, router_stats

BS = 4
TOKENS = list(range(16))  # 4 blocks of 4
LOCAL = local_block_hashes(TOKENS, BS)
EXACT: tuple[str, str | None] = ("exact", None)


def request(**kw: Any) -> RouteRequest:
    """A parsed route request for model "m" and `TOKENS`, with extra fields."""
    return parse_route_request(msgspec.json.encode({"model": "m", "token_ids": TOKENS, **kw}))


def cand(worker: str, overlap: int, cached: int, *, health: str | None = None) -> Candidate:
    """A rank-0 candidate of `BS`-token blocks."""
    return Candidate(
        worker_id=worker,
        dp_rank=0,
        overlap_blocks=overlap,
        cached_blocks=cached,
        health=health,
        block_size=BS,
    )


AB = MatchAnswer(index_seq=7, block_size=BS, candidates=(cand("a", 4, 10), cand("b", 0, 0)))


def record(worker: str, **kw: Any) -> WorkerRecord:
    """A registry record of model "m"."""
    return WorkerRecord(
        worker_id=worker,
        model="m",
        dp_ranks=kw.pop("dp_ranks", 1),
        block_size=kw.pop("block_size", BS),
        incarnation=0,
        **kw,
    )


def answer(
    parsed: RouteRequest,
    match: MatchAnswer = AB,
    ranks: RankSet | None = None,
    *,
    mode: tuple[str, str | None] = EXACT,
    engine_loads: EngineLoads | None = None,
    records: dict[str, WorkerRecord] | None = None,
    late_s: float = 0.0,
) -> RouteOutcome:
    """Route ``parsed`` at time 100 (wall 1100) with the default policy and an empty ledger."""
    return route_answer(
        parsed,
        msgspec.json.encode(msgspec.structs.replace(parsed, token_ids=list(parsed.token_ids))),
        match,
        ranks,
        index_mode=mode,
        policy=Policy(),
        max_candidates=1024,
        ledger=LoadLedger(),
        engine_loads=engine_loads or EngineLoads(),
        now=100.0,
        wall=1100.0,
        records=records,
        heartbeat_late_s=late_s,
    )


# ---------------------------------------------------------------------------------------- match answer


def _state() -> IndexState:
    """w1/0 holds the 4 blocks (the last two on CPU), w1/1 the first 2, w2/0 is held (seq 1 then 5)."""
    state = IndexState()

    def msg(worker: str, rank: int, seq: int, events: list[Event]) -> EventsMessage:
        return EventsMessage(
            worker_id=worker, dp_rank=rank, model="m", block_size=BS, epoch=1, seq=seq, events=events
        )

    state.apply(
        1, msg("w1", 0, 1, [Stored([11, 12], None, LOCAL[:2]), Stored([13, 14], 12, LOCAL[2:], "CPU")])
    )
    state.apply(2, msg("w1", 1, 1, [Stored([21, 22], None, LOCAL[:2])]))
    state.apply(3, msg("w2", 0, 1, [Stored([31], None, LOCAL[:1])]))
    state.apply(4, msg("w2", 0, 5, [Stored([35], 31, LOCAL[1:2])]))
    return state


def test_an_indexer_reply_parses_to_the_local_answer_for_the_same_index() -> None:
    """The local replica's match and an indexer's reply for the same index, as MatchReply or as the older
    rows that append health only when set, give the same answer, tiers and health included."""
    result = _state().match("m", TOKENS)
    local = match_answer(result.index_seq, result.block_size, result.candidates)
    assert local == MatchAnswer(
        index_seq=4,
        block_size=BS,
        candidates=(
            Candidate(
                worker_id="w1",
                dp_rank=0,
                overlap_blocks=4,
                cached_blocks=4,
                tiers={"GPU": 2, "CPU": 2},
                block_size=BS,
            ),
            Candidate(worker_id="w1", dp_rank=1, overlap_blocks=2, cached_blocks=2, block_size=BS),
            Candidate(
                worker_id="w2", dp_rank=0, overlap_blocks=1, cached_blocks=1, health="held", block_size=BS
            ),
        ),
    )
    reply = MatchReply(
        index_seq=result.index_seq,
        block_size=result.block_size,
        prompt_blocks=result.prompt_blocks,
        replica="i0",
        candidates=[
            MatchHolder(
                c.worker_id, c.dp_rank, c.overlap_blocks, c.cached_blocks, c.tiers, c.block_size, c.health
            )
            for c in result.candidates
        ],
    )
    assert parse_match_reply(encode(reply, format="msgpack")) == local
    rows = {
        "index_seq": result.index_seq,
        "block_size": result.block_size,
        "prompt_blocks": result.prompt_blocks,
        "replica": "i0",
        "candidates": [
            [c.worker_id, c.dp_rank, c.overlap_blocks, c.cached_blocks, c.tiers, c.block_size]
            + ([c.health] if c.health is not None else [])
            for c in result.candidates
        ],
    }
    assert parse_match_reply(msgspec.msgpack.encode(rows)) == local


def test_an_indexer_reply_of_four_element_rows_decodes_with_the_defaults() -> None:
    """Rows of an older indexer ([worker, rank, overlap, cached]) mean all on GPU, the model's block size."""
    data = msgspec.msgpack.encode(
        {"index_seq": 3, "block_size": 16, "prompt_blocks": 5, "candidates": [["a", 1, 4, 40]]}
    )
    assert parse_match_reply(data) == MatchAnswer(
        index_seq=3,
        block_size=16,
        candidates=(Candidate(worker_id="a", dp_rank=1, overlap_blocks=4, cached_blocks=40),),
    )


def test_an_indexer_error_reply_raises_its_route_error_and_an_unknown_code_is_internal() -> None:
    """An error reply raises the route error of its code; a code the route API lacks becomes internal."""
    known = encode(error_reply("unknown_model", "no worker serves model 'x'"), format="msgpack")
    with pytest.raises(UnknownModelError) as exc:
        parse_match_reply(known)
    assert (exc.value.code, exc.value.message) == ("unknown_model", "no worker serves model 'x'")
    odd = encode(error_reply("exploded", "boom"), format="msgpack")
    with pytest.raises(InternalError) as internal:
        parse_match_reply(odd)
    assert (internal.value.code, internal.value.message) == ("internal", "boom")
    with pytest.raises(ProtocolError):
        parse_match_reply(b"\xc1 not msgpack")


def test_a_match_request_packs_the_token_ids_unless_that_would_not_fit() -> None:
    """The match query carries the token ids as little-endian uint32 when they fit the max payload with the
    rest of the query, else as a list; its msgpack bytes are the match API's (every field, None as nil)."""
    parsed = request(lora_name="ad", cache_salt=None)
    packed = b"".join(t.to_bytes(4, "little") for t in TOKENS)
    fits = match_request(parsed, 64 + 128 + 4 * 3)  # 64 packed bytes + the overhead bound of "m" and "ad"
    assert fits.token_ids == packed
    assert encode(fits, format="msgpack") == msgspec.msgpack.encode(
        {"model": "m", "token_ids": packed, "lora_name": "ad", "cache_salt": None}
    )
    too_big = match_request(parsed, 64 + 128 + 4 * 3 - 1)
    assert too_big.token_ids == TOKENS
    assert encode(too_big, format="msgpack") == msgspec.msgpack.encode(
        {"model": "m", "token_ids": TOKENS, "lora_name": "ad", "cache_salt": None}
    )


def test_a_registered_model_the_index_lacks_is_routed_with_nothing_cached() -> None:
    """unknown_model with live registered ranks routes on them (block size from their records); else not."""
    live = RankSet.from_pairs([Holder("a", 0)])
    assert serves_unindexed(UnknownModelError("m"), live)
    assert not serves_unindexed(UnknownModelError("m"), None)
    assert not serves_unindexed(UnknownModelError("m"), RankSet([]))
    assert not serves_unindexed(NoWorkersError("gone"), live)
    records = {"x": record("x", block_size=None), "y": record("y", block_size=32)}
    assert registered_block_size(records, "m") == 32
    assert registered_block_size(records, "other") == 0
    assert registered_block_size(None, "m") == 0
    out = answer(request(request_id="r"), match_answer(9, 32, ()), live)
    assert out.reply is not None
    assert (out.reply.worker_id, out.reply.overlap_blocks, out.reply.block_size, out.reply.index_seq) == (
        "a",
        0,
        32,
        9,
    )
    assert out.routed == Routed(request_id="r", worker_id="a", dp_rank=0, prefill_tokens=16, blocks=1)


# ---------------------------------------------------------------------------------------- decision and reply


def test_a_reply_has_the_exact_bytes_of_the_route_api() -> None:
    """A plain reply is the winner's fields, the index sequence and mode, in the route API's order, and a
    request with an id comes with the Routed note to record and publish."""
    out = answer(request(request_id="r1"))
    assert out.error is None and out.reply is not None
    assert encode(out.reply) == (
        b'{"request_id":"r1","worker_id":"a","dp_rank":0,"overlap_blocks":4,"cached_tokens":16,'
        b'"available_tokens":16,"block_size":4,"index_seq":7,"mode":"exact"}'
    )
    assert out.mode == "exact"
    assert out.routed == Routed(request_id="r1", worker_id="a", dp_rank=0, prefill_tokens=0, blocks=4)
    anonymous = answer(request())
    assert anonymous.routed is None
    assert anonymous.reply is not None
    assert encode(anonymous.reply).startswith(b'{"request_id":null,"worker_id":"a"')


def test_an_explained_reply_has_every_score_load_health_and_the_selection() -> None:
    """With explain, each score lists affinity, load (engine fields only where reported), cost and health,
    and the selection counts the candidates: the exact bytes of the route API."""
    loads = EngineLoads()
    loads.update(WorkerLoad(worker_id="b", running=2, waiting=1, kv_usage=0.5), 99.0)
    out = answer(request(request_id="r1", explain=True), engine_loads=loads)
    assert out.reply is not None
    assert encode(out.reply) == (
        b'{"request_id":"r1","worker_id":"a","dp_rank":0,"overlap_blocks":4,"cached_tokens":16,'
        b'"available_tokens":16,"block_size":4,"index_seq":7,"scores":['
        b'{"worker_id":"a","dp_rank":0,"overlap_blocks":4,"cached_tokens":16,"cached_tokens_by_tier":{"GPU":16},'
        b'"weighted_cached_tokens":16.0,"cached_blocks":10,'
        b'"load":{"active_prefill_tokens":0,"active_blocks":0,"active_requests":0},'
        b'"prefill_blocks":0.0,"decode_blocks":0.0,"busy":false,"cost":0.0,"health":{"state":"exact"}},'
        b'{"worker_id":"b","dp_rank":0,"overlap_blocks":0,"cached_tokens":0,"cached_tokens_by_tier":{},'
        b'"weighted_cached_tokens":0.0,"cached_blocks":0,'
        b'"load":{"active_prefill_tokens":0,"active_blocks":0,"active_requests":0,"running":2,"waiting":1,'
        b'"kv_usage":0.5},"prefill_blocks":4.0,"decode_blocks":0.0,"busy":false,"cost":4.0,'
        b'"health":{"state":"exact"}}],'
        b'"mode":"exact",'
        b'"selection":{"total":2,"considered":2,"cut":0,"bounded":false,"skipped":[],"skipped_total":0}}'
    )


def test_a_chosen_incomplete_holder_makes_the_reply_degraded() -> None:
    """A winner whose history was lost turns exact into degraded, naming it; explain shows its health."""
    match = MatchAnswer(
        index_seq=7, block_size=BS, candidates=(cand("a", 4, 10, health="held"), cand("b", 0, 0))
    )
    out = answer(request(explain=True), match)
    assert out.reply is not None
    assert (out.mode, out.reply.mode, out.reply.degraded_reason) == (
        "degraded",
        "degraded",
        "the chosen holder a/0 is incomplete: held",
    )
    assert out.reply.scores is not None
    assert [(s.worker_id, s.health.state, s.health.reason) for s in out.reply.scores] == [
        ("a", "incomplete", "held"),
        ("b", "exact", None),
    ]


def test_a_lagging_index_makes_every_holder_stale_and_keeps_its_reason() -> None:
    """In degraded mode (replica lag) the reply keeps the lag's reason and every holder is stale."""
    out = answer(request(explain=True), mode=("degraded", "replica_lag: far behind"))
    assert out.reply is not None
    assert (out.reply.worker_id, out.reply.mode, out.reply.degraded_reason) == (
        "a",
        "degraded",
        "replica_lag: far behind",
    )
    assert out.reply.scores is not None
    assert [(s.health.state, s.health.reason) for s in out.reply.scores] == [
        ("stale", "replica_lag"),
        ("stale", "replica_lag"),
    ]


def test_load_only_ignores_the_overlaps() -> None:
    """In load_only mode every overlap counts as 0 (the winner has none) and the reply says why."""
    out = answer(request(explain=True), mode=("load_only", "no trustworthy index"))
    assert out.reply is not None and out.reply.scores is not None
    assert (out.reply.overlap_blocks, out.reply.cached_tokens, out.reply.mode, out.reply.degraded_reason) == (
        0,
        0,
        "load_only",
        "no trustworthy index",
    )
    assert sorted((s.worker_id, s.overlap_blocks, s.cached_blocks, s.cost) for s in out.reply.scores) == [
        ("a", 0, 0, 4.0),
        ("b", 0, 0, 4.0),
    ]


def test_a_chosen_holder_whose_heartbeat_is_late_is_stale() -> None:
    """With registered ranks, a winner whose record's heartbeat is older than the bound is stale: degraded."""
    ranks = RankSet.from_pairs([Holder("a", 0), Holder("b", 0)])
    records = {"a": record("a", heartbeat_ts=1000.0), "b": record("b", heartbeat_ts=1090.0)}
    out = answer(request(explain=True), ranks=ranks, records=records, late_s=50.0)
    assert out.reply is not None and out.reply.scores is not None
    assert (
        out.reply.degraded_reason
        == "the chosen holder a/0 is stale: heartbeat_late: last heartbeat 100.0 s ago"
    )
    assert [(s.worker_id, s.health.state) for s in out.reply.scores] == [("a", "stale"), ("b", "exact")]
    off = answer(request(), ranks=ranks, records=records, late_s=0.0)
    assert off.mode == "exact"
    unregistered = answer(request(), records=records, late_s=50.0)  # no registry opinion: no heartbeat check
    assert unregistered.mode == "exact"


def test_refusals_name_the_model_and_a_stale_rank() -> None:
    """A model of only stale ranks, or whose workers all left, is refused before the match (not with named
    candidates); named candidates of only stale ranks, none serving, or no worker at all are refused after."""
    stale = RankSet([RegisteredWorker("s", 2, {0: "silent", 1: "silent"})])
    refusal = refuse_without_live_ranks(request(), stale)
    assert isinstance(refusal, NoWorkersError)
    assert refusal.message == (
        "no live workers: every registered rank of model 'm' (2) has a stale engine (e.g. s/0: silent)"
    )
    gone = refuse_without_live_ranks(request(), RankSet([]))
    assert gone is not None and gone.message == (
        "every worker of model 'm' has left the worker registry (heartbeats stopped)"
    )
    assert refuse_without_live_ranks(request(candidates=["s"]), stale) is None
    assert refuse_without_live_ranks(request(), None) is None
    assert refuse_without_live_ranks(request(), RankSet.from_pairs([Holder("a", 0)])) is None

    mixed = RankSet([RegisteredWorker("s", 2, {0: "silent", 1: "silent"}), RegisteredWorker("a", 1, {})])
    named = answer(request(candidates=["s"]), ranks=mixed)
    assert named.selection is None and named.reply is None
    assert isinstance(named.error, NoWorkersError)
    assert named.error.message == (
        "no live workers among the candidates ['s']: every registered rank of them (2) has a stale engine "
        "(e.g. s/0: silent)"
    )
    none = answer(request(candidates=["zzz"]))
    assert none.selection is not None  # the bound is still noted
    assert none.error is not None and none.error.message == "none of the candidates ['zzz'] serves 'm'"
    empty = answer(request(), MatchAnswer(index_seq=0, block_size=0, candidates=()))
    assert empty.error is not None and empty.error.message == "no worker serves model 'm'"


# ---------------------------------------------------------------------------------------- health


def test_lag_is_messages_behind_and_seconds_since_first_seen_unapplied() -> None:
    """The lag counts messages past the applied sequence and seconds since the oldest unapplied one was seen."""
    m = LagMeter()
    assert m.lag(0, 10.0) == (0, 0.0)
    m.note(5, 1.0)
    m.note(5, 2.0)  # the same last sequence: still first seen at 1.0
    m.note(8, 3.0)
    assert m.stream_last_seq == 8
    assert m.lag(4, 4.0) == (4, 3.0)
    assert m.lag(5, 4.0) == (3, 1.0)
    assert m.lag(8, 9.0) == (0, 0.0)
    assert m.lag(10, 9.0) == (0, 0.0)  # ahead of the stream as last read (a re-created stream)


def test_index_mode_under_rebuilding_catching_up_and_lag() -> None:
    """No replica is exact; one not caught up is load_only (rebuilding or catching up); one lagging beyond
    either bound (strictly) is degraded with both figures and bounds; within them exact."""
    bounds: dict[str, Any] = {"max_lag_messages": 1, "max_lag_s": 60.0}
    assert index_mode(None, **bounds) == EXACT
    catching = IndexView(caught_up=False, rebuilding=False, lag_messages=0, lag_s=0.0)
    assert index_mode(catching, **bounds) == (
        "load_only",
        "no trustworthy index: the local replica is catching up; routing on load alone",
    )
    rebuilding = IndexView(caught_up=False, rebuilding=True, lag_messages=9, lag_s=9.0)
    assert index_mode(rebuilding, **bounds) == (
        "load_only",
        "no trustworthy index: the local replica is rebuilding the index (the stream was re-created); "
        "routing on load alone",
    )
    behind = IndexView(caught_up=True, rebuilding=False, lag_messages=3, lag_s=0.5)
    assert index_mode(behind, **bounds) == (
        "degraded",
        "replica_lag: the local index lags the stream by 3 messages and 0.5 s (bounds 1 messages, 60 s)",
    )
    slow = IndexView(caught_up=True, rebuilding=True, lag_messages=1, lag_s=2.5)
    assert index_mode(slow, max_lag_messages=10, max_lag_s=2.0) == (
        "degraded",
        "replica_lag: the local index lags the stream by 1 messages and 2.5 s (bounds 10 messages, 2 s)",
    )
    at_bounds = IndexView(caught_up=True, rebuilding=False, lag_messages=1, lag_s=2.0)
    assert index_mode(at_bounds, max_lag_messages=1, max_lag_s=2.0) == EXACT


def test_heartbeat_bound_and_holder_state() -> None:
    """The heartbeat bound is the setting, off below 0, else 2/3 of the registry TTL; a holder is incomplete,
    stale (lag, then a late heartbeat) or exact, in that order."""
    assert heartbeat_late_after(5.0, None) == 5.0
    assert heartbeat_late_after(-1.0, 15.0) == 0.0
    assert heartbeat_late_after(0.0, 15.0) == 10.0
    assert heartbeat_late_after(0.0, None) == 0.0
    assert heartbeat_late_after(0.0, 0) == 0.0
    records = {"a": record("a", heartbeat_ts=100.0), "n": record("n")}
    kw: dict[str, Any] = {"records": records, "heartbeat_late_s": 10.0, "wall": 130.0}
    assert holder_state(cand("a", 1, 1, health="gap"), lagging=True, **kw) == ("incomplete", "gap")
    assert holder_state(cand("a", 1, 1), lagging=True, **kw) == ("stale", "replica_lag")
    assert holder_state(cand("a", 1, 1), lagging=False, **kw) == (
        "stale",
        "heartbeat_late: last heartbeat 30.0 s ago",
    )
    assert holder_state(cand("n", 1, 1), lagging=False, **kw) == EXACT  # no heartbeat time yet
    assert holder_state(cand("x", 1, 1), lagging=False, **kw) == EXACT  # no record
    assert (
        holder_state(cand("a", 1, 1), lagging=False, records=None, heartbeat_late_s=10.0, wall=130.0) == EXACT
    )


def test_holders_status_names_each_holder_not_exact_once_up_to_the_bound() -> None:
    """Status lists incomplete holders, stale ranks within the record and late workers ("w/*"), each once,
    at most MAX_HOLDERS_LISTED by name, and counts them all."""
    records = [
        ("s", record("s", dp_ranks=2, stale_ranks={1: "silent", 5: "beyond the ranks"})),
        ("t", record("t", heartbeat_ts=100.0)),
    ]
    listed, total = holders_status({Holder("d", 0): "held"}, records, heartbeat_late_s=200.0, wall=400.0)
    assert {k: (v.state, v.reason) for k, v in listed.items()} == {
        "d/0": ("incomplete", "held"),
        "s/1": ("stale", "engine_silent: silent"),
        "t/*": ("stale", "heartbeat_late: last heartbeat 300.0 s ago"),
    }
    assert total == 3
    many = {Holder(f"w{i:03d}", 0): "gap" for i in range(MAX_HOLDERS_LISTED + 50)}
    listed, total = holders_status(many, None, heartbeat_late_s=0.0, wall=0.0)
    assert (len(listed), total) == (MAX_HOLDERS_LISTED, MAX_HOLDERS_LISTED + 50)


# ---------------------------------------------------------------------------------------- stats


def test_router_stats_shape_for_a_remote_and_a_local_index() -> None:
    """The stats carry the counters and the index part: remote names the match subject, local the replica's
    figures with the lag in seconds rounded to the millisecond."""
    holders = holders_status({Holder("d", 0): "held"}, None, heartbeat_late_s=0.0, wall=0.0)
    remote = index_stats("exact", None, holders, route_subject="r", match_subject="mt", replica=None)
    window = LatencyWindow(size=100)
    for ms in range(1, 201):  # the last 100 stay: 101..200 ms
        window.add(ms / 1e3)
    stats = router_stats(
        routed=5,
        errors={"no_workers": 1},
        ledger=LedgerStats(active=2, routed=3, prefill_done=1, finished=1, expired=0, unknown=4),
        engine_reports=1,
        modes={"exact": 5, "degraded": 0, "load_only": 0},
        candidates_cut={"m": 7},
        index=remote,
        latency=window,
        sessions=3,
        predicted_blocks={"ttl": 12},
    )
    assert msgspec.to_builtins(stats) == {
        "routed": 5,
        "errors": {"no_workers": 1},
        "in_flight": 2,
        "ledger": {"routed": 3, "prefill_done": 1, "finished": 1, "expired": 0, "unknown": 4},
        "engine_reports": 1,
        "modes": {"exact": 5, "degraded": 0, "load_only": 0},
        "candidates_cut": {"m": 7},
        "index": {
            "route_mode": "exact",
            "holders": {"d/0": {"state": "incomplete", "reason": "held"}},
            "holders_not_exact": 1,
            "mode": "remote",
            "route_subject": "r",
            "match_subject": "mt",
        },
        "receipts": {},
        "latency": {"routes": 100, "p50_ms": 151.0, "p99_ms": 200.0},
        "sessions": 3,
        "predicted_blocks": {"ttl": 12},
    }
    assert LatencyWindow().figures() is None
    figures = ReplicaFigures(
        stream="S",
        applied_seq=9,
        blocks=40,
        read_messages=10,
        decode_errors=1,
        apply_errors=0,
        recovery={"snapshot": None},
        lag_messages=3,
        lag_s=1.23456,
    )
    local = index_stats(
        "degraded", "replica_lag: x", ({}, 0), route_subject="r", match_subject="mt", replica=figures
    )
    assert msgspec.to_builtins(local) == {
        "route_mode": "degraded",
        "holders": {},
        "holders_not_exact": 0,
        "mode": "local",
        "route_subject": "r",
        "degraded_reason": "replica_lag: x",
        "lag_messages": 3,
        "lag_s": 1.235,
        "stream": "S",
        "applied_seq": 9,
        "blocks": 40,
        "read_messages": 10,
        "decode_errors": 1,
        "apply_errors": 0,
        "recovery": {"snapshot": None},
    }


# ---------------------------------------------------------------------------------------- route receipts


def test_available_tokens_is_the_longest_overlap_of_a_live_holder_in_its_own_block_size() -> None:
    """Available reuse is the most overlap tokens of any holder the registry lists as live (each in its own
    block size, the model's when it has none); stale and unregistered holders do not count; no overlap is 0."""
    holders = [
        Candidate(worker_id="a", dp_rank=0, overlap_blocks=3, cached_blocks=9, block_size=4),  # 12 tokens
        Candidate(worker_id="b", dp_rank=0, overlap_blocks=2, cached_blocks=2, block_size=16),  # 32
        Candidate(worker_id="c", dp_rank=0, overlap_blocks=5, cached_blocks=5),  # 5 × the model's 8 = 40
        Candidate(worker_id="s", dp_rank=1, overlap_blocks=9, cached_blocks=9, block_size=16),  # stale: 144
    ]
    assert available_tokens(holders, None, block_size=8) == 144
    ranks = RankSet(
        [
            RegisteredWorker("a", 1, {}),
            RegisteredWorker("b", 1, {}),
            RegisteredWorker("s", 2, {1: "silent"}),
        ]
    )
    assert available_tokens(holders, ranks, block_size=8) == 32  # c is not registered, s/1 is stale
    assert available_tokens(holders, ranks.only(["a"]), block_size=8) == 12
    assert available_tokens([cand("z", 0, 5)], None, block_size=8) == 0
    assert available_tokens([], ranks, block_size=0) == 0
    no_bs = Candidate(worker_id="a", dp_rank=0, overlap_blocks=3, cached_blocks=3)
    assert available_tokens([no_bs], None, block_size=0) == 3  # unknown block size: counts tokens


@settings(max_examples=400, deadline=None)
@given(
    holders=st.lists(
        st.builds(
            Candidate,
            worker_id=st.sampled_from(("a", "b", "c", "s")),
            dp_rank=st.integers(0, 2),
            overlap_blocks=st.integers(0, 6),
            cached_blocks=st.just(0),
            block_size=st.sampled_from((0, 8, 8, 8, 16)),
        ),
        max_size=12,
    ),
    registered=st.none()
    | st.lists(
        st.builds(
            RegisteredWorker,
            st.sampled_from(("a", "b", "s")),
            st.integers(1, 3),
            st.dictionaries(st.integers(0, 2), st.just("silent"), max_size=2),
        ),
        max_size=3,
        unique_by=lambda w: w.worker_id,
    ),
    block_size=st.sampled_from((0, 8)),
)
def test_available_tokens_equals_the_per_holder_rule(
    holders: list[Candidate], registered: list[RegisteredWorker] | None, block_size: int
) -> None:
    """The passes over one block size answer exactly as the rule read holder by holder: the most
    ``overlap_blocks × own block size`` of a holder the registry lists as live."""
    ranks = RankSet(registered) if registered is not None else None
    own = max(block_size, 1)
    want = max(
        (
            c.overlap_blocks * (c.block_size if c.block_size > 0 else own)
            for c in holders
            if ranks is None or ranks.contains(c.worker_id, c.dp_rank)
        ),
        default=0,
    )
    assert available_tokens(holders, ranks, block_size=block_size) == want


def test_a_reply_carries_the_available_tokens_beyond_what_the_choice_captured() -> None:
    """The best holder left out by ``candidates``, or skipped as busy, still counts as available, so the reply's
    available_tokens exceeds its cached_tokens by the regret; load_only has nothing available."""
    narrowed = answer(request(request_id="r1", candidates=["b"]))
    assert narrowed.reply is not None
    assert (narrowed.reply.worker_id, narrowed.reply.cached_tokens, narrowed.reply.available_tokens) == (
        "b",
        0,
        16,
    )
    busy = EngineLoads()
    busy.update(WorkerLoad(worker_id="a", kv_usage=0.99), 99.0)
    skipped = answer(request(), engine_loads=busy)
    assert skipped.reply is not None
    assert (skipped.reply.worker_id, skipped.reply.cached_tokens, skipped.reply.available_tokens) == (
        "b",
        0,
        16,
    )
    three = MatchAnswer(index_seq=7, block_size=BS, candidates=(cand("a", 4, 10), cand("b", 2, 2)))
    partial = answer(request(candidates=["b"]), three)
    assert partial.reply is not None
    assert (partial.reply.cached_tokens, partial.reply.available_tokens) == (8, 16)
    rebuilding = answer(request(), mode=("load_only", "rebuilding"))
    assert rebuilding.reply is not None
    assert (rebuilding.reply.cached_tokens, rebuilding.reply.available_tokens) == (0, 0)


def test_a_stale_best_holder_is_not_available() -> None:
    """A holder whose engine is stale is no candidate, so its overlap is not available reuse either."""
    ranks = RankSet([RegisteredWorker("a", 1, {0: "silent"}), RegisteredWorker("b", 1, {})])
    three = MatchAnswer(index_seq=7, block_size=BS, candidates=(cand("a", 4, 10), cand("b", 1, 2)))
    out = answer(request(), three, ranks)
    assert out.reply is not None
    assert (out.reply.worker_id, out.reply.cached_tokens, out.reply.available_tokens) == ("b", 4, 4)


def _routed(rid: str, worker: str = "a") -> Routed:
    return Routed(request_id=rid, worker_id=worker, dp_rank=0, prefill_tokens=10, blocks=4)


def test_the_ledger_counts_receipts_as_token_counters_and_delivers_once() -> None:
    """Answered routes add available, captured and regret; a finish with the engine's count adds delivered,
    the shortfall against captured (misprediction) and the surplus, once; a finish without a count, of a peer's
    request, of a restored entry or with a negative count delivers nothing."""
    led = LoadLedger()
    for rid, captured in (("r1", 16), ("r2", 32), ("r3", 48)):
        led.answered("a", 0, available_tokens=48, captured_tokens=captured)
        led.routed(_routed(rid), 1.0, captured_tokens=captured)
    led.answered("b", 0, available_tokens=48, captured_tokens=0)  # a route without a request id
    assert led.finished("r1", 2.0, cached_tokens=16)
    assert led.finished("r2", 2.0, cached_tokens=16)  # 16 promised tokens not there
    assert not led.finished("r2", 2.0, cached_tokens=32)  # a second finish: unknown, not counted again
    assert led.finished("r3", 2.0)  # no count: nothing delivered
    assert led.receipts() == {
        Holder("a", 0): Receipts(
            requests=3,
            available_tokens=144,
            captured_tokens=96,
            regret_tokens=48,
            delivered_requests=2,
            delivered_tokens=32,
            misprediction_tokens=16,
            unpredicted_tokens=0,
        ),
        Holder("b", 0): Receipts(requests=1, available_tokens=48, captured_tokens=0, regret_tokens=48),
    }
    led.routed(_routed("p1"), 3.0)  # a peer answered it: its receipt, not ours
    led.routed(_routed("m1"), 3.0, captured_tokens=0)
    led.routed(_routed("m1"), 3.5)  # a retry a peer answered takes the receipt over
    led.routed(_routed("u1"), 3.0, captured_tokens=0)
    led.restore(
        LedgerSnapshot(
            entries=[
                LedgerEntry(request_id="s1", worker_id="a", dp_rank=0, prefill_tokens=0, blocks=1, age_s=0.5)
            ]
        ),
        4.0,
    )
    for rid in ("p1", "m1", "s1"):
        assert led.finished(rid, 5.0, cached_tokens=64)
    assert led.finished("u1", 5.0, cached_tokens=-1) and led.finished("x", 5.0, cached_tokens=8) is False
    assert led.receipts()[Holder("a", 0)].delivered_requests == 2
    led.routed(_routed("u2"), 6.0, captured_tokens=8)
    assert led.finished("u2", 6.0, cached_tokens=24)  # the engine had more than the index knew
    got = led.stats().receipts[Holder("a", 0)]
    assert (
        got.delivered_requests,
        got.delivered_tokens,
        got.misprediction_tokens,
        got.unpredicted_tokens,
    ) == (
        3,
        56,
        16,
        16,
    )


def test_router_stats_carry_the_receipts_per_worker_and_rank() -> None:
    """The stats list each holder's receipts under "worker/rank", sorted, with every counter."""
    remote = index_stats("exact", None, ({}, 0), route_subject="r", match_subject="mt", replica=None)
    receipts = {
        Holder("b", 1): Receipts(requests=1, available_tokens=16, captured_tokens=0, regret_tokens=16),
        Holder("a", 0): Receipts(
            requests=2,
            available_tokens=32,
            captured_tokens=32,
            delivered_requests=1,
            delivered_tokens=12,
            misprediction_tokens=4,
        ),
    }
    stats = router_stats(
        routed=3,
        errors={},
        ledger=LedgerStats(receipts=receipts),
        engine_reports=0,
        modes={},
        candidates_cut={},
        index=remote,
    )
    got = msgspec.to_builtins(stats)["receipts"]
    assert list(got) == ["a/0", "b/1"]
    assert got["a/0"] == {
        "requests": 2,
        "available_tokens": 32,
        "captured_tokens": 32,
        "regret_tokens": 0,
        "delivered_requests": 1,
        "delivered_tokens": 12,
        "misprediction_tokens": 4,
        "unpredicted_tokens": 0,
    }
    assert got["b/1"]["regret_tokens"] == 16
