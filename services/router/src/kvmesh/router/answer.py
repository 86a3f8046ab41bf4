"""The router's answer, sans I/O: match answer → candidates → decision → reply and explain.

Nothing here touches NATS, the event loop or a clock. The service (`kvmesh.router.endpoint`) reads the time,
the registry and the index, passes what they say in, and carries out what comes back: it raises the error,
notes the candidate bound, counts the mode, records and publishes the `Routed` note, sends the reply.

One route, in order:

1. `refuse_without_live_ranks` — before any match: a model whose registered ranks are all stale or gone;
2. the match answer (`MatchAnswer`), built by `match_answer` from the local replica's `MatchResult`, from an
   indexer's reply (`parse_match_reply`), or empty for a registered model the index lacks
   (`serves_unindexed`);
3. `route_answer` — ``load_only`` zeroes the overlaps, workers whose registered context length the prompt
   exceeds leave the candidates (none left: ``context_length_exceeded``), the available reuse is taken over
   every live holder (`kvmesh.core.route.available_tokens`), the request's ``candidates`` narrow them, the
   bound chooses (`kvmesh.core.route.select_candidates`), `kvmesh.core.route.rank` picks (the decision of
   `kvmesh.core.route.decide` on plain numbers), the chosen holder's health
   (`kvmesh.router.health.holder_state`) may turn ``exact`` into ``degraded``, and the reply (with explain
   when asked) is shaped.

The holders of a match answer are read as the index gave them (no copy per holder), and a `Score`, a health
state and an explain row are built only for what the reply shows: the winner, and with explain every scored
candidate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.core.errors import (
    BadRequestError,
    ContextLengthExceededError,
    InternalError,
    NoWorkersError,
    RouteError,
)
from kvmesh.core.hashing import pack_tokens
from kvmesh.core.index import Holder
from kvmesh.core.load import ActiveLoad, EngineLoads, LoadLedger
from kvmesh.core.protocol import (
    ERROR_STATUS,
    HealthExplain,
    LoadExplain,
    MatchReply,
    MatchRequest,
    Routed,
    RouteReply,
    RouteRequest,
    ScoreExplain,
    SelectionExplain,
    SkippedCandidate,
    WorkerLoad,
    decode_answer,
)
from kvmesh.core.route import (
    Candidate,
    CandidateLike,
    Policy,
    RankSet,
    Score,
    Selection,
    apply_override,
    available_tokens,
    rank,
    route_seed,
    select_candidates,
)
from kvmesh.router.health import HolderState, RecordLike, holder_state

# ---------------------------------------------------------------------------------------- match answer


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class MatchAnswer:
    """What the index says about a prompt, whichever index answered.

    Two answers are equal when they say the same of the same holders, whatever objects carry it (`Candidate`,
    `kvmesh.core.state.HolderMatch` or an indexer's `kvmesh.core.protocol.MatchHolder`).
    """

    index_seq: int
    """Stream sequence the answering index had applied."""
    block_size: int
    """Tokens per block of the model's index (0: not known)."""
    candidates: Sequence[CandidateLike]
    """Every holder of the model the index knows, with its overlap, as the index gave it (not copied)."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MatchAnswer):
            return NotImplemented
        return (
            self.index_seq == other.index_seq
            and self.block_size == other.block_size
            and [as_candidate(c) for c in self.candidates] == [as_candidate(c) for c in other.candidates]
        )

    __hash__ = None  # type: ignore[assignment]  # holders carry dicts (tiers): not hashable


def as_candidate(c: CandidateLike) -> Candidate:
    """Return ``c`` as a `Candidate` (itself when it is one; else a copy of what the decision reads)."""
    if isinstance(c, Candidate):
        return c
    return Candidate(
        worker_id=c.worker_id,
        dp_rank=c.dp_rank,
        overlap_blocks=c.overlap_blocks,
        cached_blocks=c.cached_blocks,
        tiers=c.tiers,
        health=c.health,
        block_size=c.block_size,
    )


def match_answer(index_seq: int, block_size: int, holders: Iterable[CandidateLike]) -> MatchAnswer:
    """Return the match answer of an index at ``index_seq``; its holders are kept as they are (a tuple or list
    is not copied): the route reads each one's fields, and builds a `Score` only for what it reports."""
    kept = holders if isinstance(holders, tuple | list) else tuple(holders)
    return MatchAnswer(index_seq=index_seq, block_size=block_size, candidates=kept)


def parse_match_reply(data: bytes) -> MatchAnswer:
    """Return the match answer of an indexer's msgpack reply (`MatchReply`, or an `ErrorReply`).

    Raises:
        RouteError: the indexer answered an error (a code the route API does not know becomes `InternalError`).
        ProtocolError: the reply is neither (the caller answers ``internal``).
    """
    try:
        reply = decode_answer(data, MatchReply, format="msgpack")
    except RouteError as exc:
        if exc.code not in ERROR_STATUS:
            raise InternalError(exc.message) from exc
        raise
    return match_answer(reply.index_seq, reply.block_size, reply.candidates)


def match_request(parsed: RouteRequest, max_payload: int) -> MatchRequest:
    """Return the match query for ``parsed`` (``--index remote``): its token ids packed as little-endian
    uint32, which spares both ends per-token work, or as a list of ints when the packed form would not fit
    ``max_payload`` bytes (a msgpack list is smaller for ids below 128; the JSON request did fit).

    Raises:
        BadRequestError: a pre-hashed request: the indexers' match API takes token ids.
    """
    if parsed.block_hashes is not None or parsed.seq_hashes is not None:
        raise BadRequestError(
            "pre-hashed requests (block_hashes, seq_hashes) need a router with a local index (--index local): this one "
            "asks the indexers, whose match API takes token ids"
        )
    packed = pack_tokens(parsed.token_ids)  # the ids were checked by parse_route_request
    strings = (parsed.model, parsed.lora_name or "", parsed.cache_salt or "")
    overhead = 128 + sum(4 * len(x) for x in strings)  # an upper bound on the rest of the request
    return MatchRequest(
        model=parsed.model,
        token_ids=packed if len(packed) + overhead <= max_payload else list(parsed.token_ids),
        lora_name=parsed.lora_name,
        cache_salt=parsed.cache_salt,
    )


def prompt_tokens_of(parsed: RouteRequest, block_size: int) -> int:
    """Return the prompt's length in tokens: its token ids, or for a pre-hashed request its
    ``prompt_tokens`` (default: the hashes' count × block size, the full blocks' tokens)."""
    hashes = parsed.block_hashes if parsed.seq_hashes is None else parsed.seq_hashes
    if hashes is None:
        return len(parsed.token_ids)
    if parsed.prompt_tokens is not None:
        return parsed.prompt_tokens
    return len(hashes) * (parsed.block_size or block_size)


def serves_unindexed(exc: RouteError, ranks: RankSet | None) -> bool:
    """Whether a model the index does not know is routed anyway: live registered ranks, nothing cached.

    After `kvmesh reset` forgot every worker, heartbeating workers would otherwise be refused until an engine
    stores again.
    """
    return exc.code == "unknown_model" and ranks is not None and ranks.live_count > 0


def registered_block_size(records: Mapping[str, RecordLike] | None, model: str) -> int:
    """Return the block size the registry's workers of ``model`` report (0 when none does)."""
    for record in (records or {}).values():
        if record.model == model and record.block_size:
            return record.block_size
    return 0


# ---------------------------------------------------------------------------------------- refusals


def refuse_without_live_ranks(parsed: RouteRequest, ranks: RankSet | None) -> RouteError | None:
    """Return the ``no_workers`` refusal of a model with registered ranks none of which is live, else None.

    Only without ``candidates`` in the request (those are checked against the ranks they name).
    """
    if ranks is None or ranks.live_count != 0 or parsed.candidates:
        return None
    if ranks.stale_count:
        sw, sr, why = ranks.stale_listed[0]  # a registered rank (a record may name others)
        return NoWorkersError(
            f"no live workers: every registered rank of model {parsed.model!r} "
            f"({ranks.stale_count}) has a stale engine (e.g. {sw}/{sr}: {why})",
        )
    return NoWorkersError(
        f"every worker of model {parsed.model!r} has left the worker registry (heartbeats stopped)",
    )


def _context_refusal(parsed: RouteRequest, prompt_tokens: int, ranks: RankSet) -> ContextLengthExceededError:
    """The refusal of a prompt longer than the context length of every live worker of its model."""
    return ContextLengthExceededError(
        f"the prompt ({prompt_tokens} tokens) exceeds the context length of every worker of model "
        f"{parsed.model!r} (the longest is {ranks.longest_context()} tokens)"
    )


# ---------------------------------------------------------------------------------------- decision


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteOutcome:
    """What one route comes to; the service carries it out in this order.

    1. ``selection`` (when not None): note the candidate bound (`Selection.bounded`);
    2. ``error`` (when not None): answer it, nothing else;
    3. count ``mode``, record and publish ``routed`` (when not None), send ``reply``.
    """

    selection: Selection | None = None
    error: RouteError | None = None
    mode: str = "exact"
    reply: RouteReply | None = None
    routed: Routed | None = None
    """The lifecycle note of a request with a ``request_id``: record it, then tell every replica."""
    busy_skipped: tuple[Holder, ...] = ()
    """Candidates passed over because their engine reported them busy while another was free."""


def route_answer(
    parsed: RouteRequest,
    body: bytes,
    match: MatchAnswer,
    ranks: RankSet | None,
    *,
    index_mode: tuple[str, str | None],
    policy: Policy,
    max_candidates: int,
    ledger: LoadLedger,
    engine_loads: EngineLoads,
    now: float,
    wall: float,
    records: Mapping[str, RecordLike] | None,
    heartbeat_late_s: float,
    session: Holder | None = None,
) -> RouteOutcome:
    """Decide one route from what the router knows at ``now``.

    Args:
        parsed: the request; ``body``: its bytes (the seed when it has no ``request_id``).
        match: the index's answer for the prompt.
        ranks: the model's registered ranks, or None (no registry opinion: the index's holders as they are).
        index_mode: the router's own mode before a holder is chosen (`kvmesh.router.health.index_mode`).
        policy: the router's cost policy (the request's overrides are applied here).
        max_candidates: the most candidates scored.
        ledger, engine_loads: router-side and engine-reported load (read only; expire them before).
        now: monotonic seconds of the ledger and the engine loads; ``wall``: seconds since the epoch
            (heartbeat ages).
        records: the registry's worker records by worker id (heartbeats), or None.
        heartbeat_late_s: heartbeat age at which a holder is stale (0: off).
        session: where the request's session (``parsed.session_id``) was last routed, or None
            (`kvmesh.core.sessions.SessionTable`).
    """
    mode, mode_reason = index_mode
    indexed: Sequence[CandidateLike] = match.candidates
    if mode == "load_only":
        indexed = [
            Candidate(worker_id=c.worker_id, dp_rank=c.dp_rank, overlap_blocks=0, cached_blocks=0)
            for c in indexed
        ]
    seed = route_seed(parsed.request_id, body)
    block_size = match.block_size
    prompt_tokens = prompt_tokens_of(parsed, block_size)
    too_short: frozenset[str] = frozenset()
    if ranks is not None:  # workers whose context length the prompt exceeds are no candidates
        fitting = ranks.within_context(prompt_tokens)
        if fitting is not ranks:
            too_short = frozenset(w.worker_id for w in ranks.workers) - {w.worker_id for w in fitting.workers}
            if fitting.live_count == 0 and ranks.live_count > 0:
                return RouteOutcome(error=_context_refusal(parsed, prompt_tokens, ranks))
            indexed = [c for c in indexed if c.worker_id not in too_short]
            ranks = fitting
    available = available_tokens(indexed, ranks, block_size=match.block_size)

    def loaded(worker_id: str, dp_rank: int) -> bool:
        return (
            ledger.load(worker_id, dp_rank, now_s=now).requests > 0
            or engine_loads.get(worker_id, dp_rank, now) is not None
        )

    offered = bool(indexed) or (ranks is not None and ranks.live_count > 0)
    if parsed.candidates is not None:  # narrowed before the bound, so a requested worker is never cut
        allow = set(parsed.candidates)
        indexed = [c for c in indexed if c.worker_id in allow]
        ranks = ranks.only(parsed.candidates) if ranks is not None else None
        if ranks is not None and ranks.live_count == 0 and ranks.stale_count:
            sw, sr, why = ranks.stale_listed[0]
            return RouteOutcome(
                error=NoWorkersError(
                    f"no live workers among the candidates {parsed.candidates}: every registered rank of them "
                    f"({ranks.stale_count}) has a stale engine (e.g. {sw}/{sr}: {why})",
                )
            )
    selection = select_candidates(indexed, ranks, max_candidates=max_candidates, seed=seed, loaded=loaded)
    candidates = selection.candidates
    active, engine = _loads(candidates, ledger, engine_loads, now=now, excluding=parsed.request_id)
    ranking = rank(
        candidates,
        prompt_tokens=prompt_tokens,
        block_size=block_size,
        policy=apply_override(policy, parsed.policy),
        active=active,
        engine=engine,
        seed=seed,
        allowed=parsed.candidates,
        session=session,
    )
    if ranking is None:
        if parsed.candidates is not None and too_short.intersection(parsed.candidates):
            shorter = sorted(too_short.intersection(parsed.candidates))
            return RouteOutcome(
                selection=selection,
                error=ContextLengthExceededError(
                    f"the prompt ({prompt_tokens} tokens) exceeds the context length of the candidates "
                    f"{shorter}, and no other candidate of {parsed.candidates} serves {parsed.model!r}"
                ),
            )
        if parsed.candidates is not None and offered:
            message = f"none of the candidates {parsed.candidates} serves {parsed.model!r}"
        else:
            message = f"no worker serves model {parsed.model!r}"
        return RouteOutcome(selection=selection, error=NoWorkersError(message))
    lagging = mode == "degraded"
    beats = records if ranks is not None else None

    def state_of(c: CandidateLike) -> HolderState:
        return holder_state(c, lagging=lagging, records=beats, heartbeat_late_s=heartbeat_late_s, wall=wall)

    w = ranking.winner_score()
    state, holder_why = state_of(ranking.winner)
    if mode == "exact" and state not in ("exact", "predicted"):  # predicted is what such a worker can have
        mode = "degraded"
        mode_reason = f"the chosen holder {w.worker_id}/{w.dp_rank} is {state}: {holder_why}"
    routed = None
    if parsed.request_id is not None:
        routed = Routed(
            request_id=parsed.request_id,
            worker_id=w.worker_id,
            dp_rank=w.dp_rank,
            prefill_tokens=max(prompt_tokens - w.overlap_tokens, 0),
            blocks=-(-prompt_tokens // max(block_size, 1)),
            session_id=parsed.session_id,
        )
    explained = None
    if parsed.explain:
        states = {Holder(c.worker_id, c.dp_rank): state_of(c) for c in candidates}
        explained = [
            explain_score(s, states.get(Holder(s.worker_id, s.dp_rank), ("exact", None)))
            for s in ranking.scores()
        ]
    reply = route_reply(
        parsed,
        w,
        match,
        explained,
        mode=mode,
        degraded_reason=mode_reason,
        selection=explain_selection(selection) if parsed.explain else None,
        available_tokens=available,
        session=None if parsed.session_id is None else (ranking.session or "new"),
    )
    busy = () if w.busy else tuple(Holder(c.worker_id, c.dp_rank) for c in ranking.passed_over())
    return RouteOutcome(selection=selection, mode=mode, reply=reply, routed=routed, busy_skipped=busy)


def _loads(
    candidates: Sequence[CandidateLike],
    ledger: LoadLedger,
    engine_loads: EngineLoads,
    *,
    now: float,
    excluding: str | None,
) -> tuple[dict[Holder, ActiveLoad], dict[Holder, WorkerLoad]]:
    """Return the router-side load (leaving out ``excluding``'s own share) of every (worker, dp rank) with
    requests in flight — candidates or not: the decision looks up only its candidates — and the fresh engine
    report of each candidate that has one; a `Holder` is built only for those."""
    active: dict[Holder, ActiveLoad] = {}
    engine: dict[Holder, WorkerLoad] = {}
    load = ledger.load
    for key in ledger.loaded():
        a = load(key.worker_id, key.dp_rank, excluding=excluding, now_s=now)
        if a.requests:
            active[key] = a
    if len(engine_loads):
        get = engine_loads.get
        for c in candidates:
            e = get(c.worker_id, c.dp_rank, now)
            if e is not None:
                engine[Holder(c.worker_id, c.dp_rank)] = e
    return active, engine


# ---------------------------------------------------------------------------------------- reply


def route_reply(
    parsed: RouteRequest,
    winner: Score,
    match: MatchAnswer,
    scores: list[ScoreExplain] | None,
    *,
    mode: str,
    degraded_reason: str | None,
    selection: SelectionExplain | None,
    available_tokens: int = 0,
    session: str | None = None,
) -> RouteReply:
    """Return the reply: the winner, the available reuse (at least the winner's cached tokens), the mode and
    why not exact, and with explain each score (``scores``, in decision order) and the selection."""
    w = winner
    return RouteReply(
        request_id=parsed.request_id,
        worker_id=w.worker_id,
        dp_rank=w.dp_rank,
        overlap_blocks=w.overlap_blocks,
        cached_tokens=w.overlap_tokens,
        available_tokens=max(available_tokens, w.overlap_tokens),
        block_size=match.block_size,
        index_seq=match.index_seq,
        scores=scores if parsed.explain else None,
        mode=mode,
        degraded_reason=degraded_reason,
        selection=selection,
        session=session,
    )


def explain_score(s: Score, state: HolderState) -> ScoreExplain:
    """Return one scored candidate as explain lists it: affinity, load (the engine's report where one is
    fresh), cost and health."""
    e = s.engine
    load = LoadExplain(
        active_prefill_tokens=s.active.prefill_tokens,
        active_blocks=s.active.blocks,
        active_requests=s.active.requests,
        running=e.running if e is not None else None,
        waiting=e.waiting if e is not None else None,
        kv_usage=e.kv_usage if e is not None else None,
        prefix_hit_rate=e.prefix_hit_rate if e is not None else None,
    )
    return ScoreExplain(
        worker_id=s.worker_id,
        dp_rank=s.dp_rank,
        overlap_blocks=s.overlap_blocks,
        cached_tokens=s.overlap_tokens,
        cached_tokens_by_tier=dict(s.tier_tokens),
        weighted_cached_tokens=s.cached_tokens,
        cached_blocks=s.cached_blocks,
        load=load,
        prefill_blocks=s.prefill_blocks,
        decode_blocks=s.decode_blocks,
        busy=s.busy,
        cost=s.cost,
        health=HealthExplain(state=state[0], reason=state[1]),
        probability=s.probability,
    )


def explain_selection(selection: Selection) -> SelectionExplain:
    """Return explain's ``selection``: candidates worth scoring, scored, cut, and the stale ranks skipped."""
    return SelectionExplain(
        total=selection.total,
        considered=len(selection.candidates),
        cut=selection.cut,
        bounded=selection.bounded,
        skipped=[
            SkippedCandidate(worker_id=sw, dp_rank=sr, reason=f"stale: {sreason}")
            for sw, sr, sreason in selection.skipped
        ],
        skipped_total=selection.skipped_total,
    )
