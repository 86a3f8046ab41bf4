"""The route API's request parsing and the choice of a worker: affinity balanced against load (pure).

Request (JSON, subject ``kvmesh.route``): ``model`` (str, required), ``token_ids`` (array of int, each
0 ≤ id < 2³², required, non-empty, at most ``max_tokens``), ``lora_name``, ``cache_salt``, ``request_id``
(str or null), ``candidates`` (array of worker ids or null), ``explain`` (bool), ``policy`` (object or null:
per-request overrides of `Policy`, every key optional, unknown keys rejected). Unknown top-level fields are
ignored; a known field of the wrong type is a `RequestError` naming it (``policy.temperature``). Instead of
``token_ids`` a request may carry ``block_hashes`` (local block hashes, each 0 ≤ h < 2⁶⁴, at most
``max_tokens``; optional ``block_size`` and ``prompt_tokens``; no ``lora_name`` or ``cache_salt``: the
caller mixed them in) or ``seq_hashes`` (their standard sequence hashes, under the same rules), and every kind of ids may come packed in a binary body (`parse_route_message`; the
forms are `kvmesh.core.protocol`'s).

Cost of a candidate (NVIDIA Dynamo's documented form; lowest wins)::

    cost          = overlap_weight · prefill_blocks + decode_weight · decode_blocks
    prefill_blocks = (prompt_tokens − cached_tokens + active_prefill_tokens) / block_size
    decode_blocks  = active_blocks

``cached_tokens`` is the candidate's leading overlap in tokens, each block weighted by its storage tier
(`Policy.tier_weights`: GPU 1.0, CPU 0.5, DISK 0.25 by default; when the index reports no tiers every
overlapping block counts as GPU). ``active_prefill_tokens`` and ``active_blocks`` come from the router's
request ledger (`kvmesh.core.load.LoadLedger`); with ``LoadLedger.prefill_progress`` (the default) the worker's
oldest request still prefilling counts only its estimated remainder (elapsed time × the worker's learned
prefill throughput) and the ones queued behind it count whole. Dynamo adds the request's own new blocks to
``decode_blocks``; kvmesh does not know which of them are already active on a worker, so that term would be
the same for every candidate and is left out (it moves no winner and no normalised softmax). With no load
and no tiers the cost is ``prompt_blocks − overlap_blocks`` (for whole-block prompts), so the longest overlap
wins, as before load-awareness.

Default weights: ``overlap_weight`` 1.0 and ``decode_weight`` 0.1. Dynamo's form has no decode weight
(``w · prefill_blocks + decode_blocks``, ``w`` = ``--kv-overlap-score-weight``, default 1.0); at temperature
0, and at any temperature since costs are normalised, kvmesh's defaults choose exactly as Dynamo with
``w`` = 10 (Dynamo documents a higher ``w`` as better TTFT at some cost in ITL). At 1.0 a running request's
blocks weigh as much as prefilling them again: on the Mooncake conversation trace one ~7,000-token request
in flight (440 blocks) then outweighs all but the longest cached prefixes, so returning conversations lose
their cache to load balancing (kvmesh-exact: 82 % of the TTFT oracle's hit ratio at 1.0, 94–96 % at 0.1,
TTFT p50 1.11 s → 0.84 s; ``docs/benchmarks.md`` section 1). At 0.1 that request weighs 44 blocks (704
prompt tokens): equal overlaps still go to the less loaded worker, and queued prefill (the term a new
request actually waits for) keeps its full weight.

Choice: candidates whose fresh engine report shows them busy (``kv_usage ≥ busy_kv_usage`` or ``waiting ≥
busy_waiting``) are skipped while any other is free. With ``temperature == 0`` the lowest cost wins; ties go
to the fewest cached blocks, then to a *seeded* random order: ``xxh3_64(worker_id ‖ 0 ‖ dp_rank, seed)``
with the seed taken from the request (`route_seed`), so every router replica breaks the same tie the same
way while different requests spread over tied workers. With ``temperature > 0`` the winner is sampled with
probabilities ∝ ``exp(−normalised_cost / temperature)`` (costs scaled to 0–1 over the eligible candidates)
from `random.Random(seed)`, so replicas still agree. A request with a ``session_id`` stays on its session's
last (worker, dp rank) while that candidate is eligible and costs at most ``session_slack`` × the prompt's
blocks more than the lowest (`rank`'s ``session``; the table is `kvmesh.core.sessions`).

Cost: O(candidates) per decision, in plain floats and ints (`rank`: one pass for the costs, a scan for the
lowest; the seeded tiebreak is hashed only for candidates tied on cost and cached blocks, and a `Score` is
built only for the winner and for what explain lists); a sort of the candidates only with temperature > 0 or
explain. Nothing here touches the index.
"""

from __future__ import annotations

import bisect
import math
import random
import re
import sys
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Any, Final, Protocol

import msgspec
import xxhash

from kvmesh.core import tables
from kvmesh.core.errors import RequestError
from kvmesh.core.index import Holder
from kvmesh.core.load import ZERO_LOAD, ActiveLoad
from kvmesh.core.protocol import (
    BODY_HASHES_U64LE,
    BODY_HEADER,
    BODY_JSON,
    BODY_SEQHASHES_U64LE,
    BODY_TOKENS_U32LE,
    FIELDS_HEADER,
    MAX_BLOCK_HASH,
    ROUTE_FORMS,
    PolicyOverride,
    RouteRequest,
    WorkerLoad,
    check_route_ids,
    check_version,
    error_field,
)
from kvmesh.core.sessions import MAX_SESSION_ID_CHARS

DEFAULT_MAX_TOKENS: Final[int] = 1_048_576
GPU_TIER: Final[str] = "GPU"
UNKNOWN_TIER_WEIGHT: Final[float] = 0.5
"""Weight of a block on a tier missing from `Policy.tier_weights`."""
SESSION_SLACK: Final[float] = 0.25
"""Default `Policy.session_slack` (fraction of the prompt's blocks; see docs/benchmarks.md, session affinity)."""

# ---------------------------------------------------------------------------------------- policy


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """The terms of the cost function and the busy thresholds (router settings; overridable per request)."""

    overlap_weight: float = 1.0
    """Weight ``w`` of the prefill term (Dynamo's ``overlap_score_weight``), ≥ 0."""
    decode_weight: float = 0.1
    """Weight of the decode term (active blocks), ≥ 0 (1.0 is Dynamo's form; see the module docstring)."""
    temperature: float = 0.0
    """0: lowest cost wins; > 0: softmax sampling over normalised costs."""
    tier_weights: Mapping[str, float] = field(default_factory=lambda: {"GPU": 1.0, "CPU": 0.5, "DISK": 0.25})
    """How much a cached block counts per storage tier (upper-case medium name), each 0–1."""
    busy_kv_usage: float = 0.95
    """A worker whose reported KV usage is at least this (0–1) is busy; > 1 disables the check."""
    busy_waiting: int = 8
    """A worker with at least this many waiting requests is busy; 0 disables the check."""
    session_slack: float = SESSION_SLACK
    """Session affinity (requests with a ``session_id``): the session's last (worker, dp rank) keeps the
    request while its cost is at most the lowest cost + ``session_slack`` × the prompt's blocks, ≥ 0 (0:
    only when it is as cheap as the best)."""

    def problems(self) -> list[str]:
        """Return every invalid value, each naming its field."""
        out = []
        for name in ("overlap_weight", "decode_weight", "temperature", "session_slack"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                out.append(f"{name} must be a finite number ≥ 0, got {v!r}")
        for tier, w in self.tier_weights.items():
            if not 0 <= w <= 1:
                out.append(f"tier_weights.{tier} must be within [0, 1], got {w!r}")
        if not self.busy_kv_usage > 0:
            out.append(f"busy_kv_usage must be > 0, got {self.busy_kv_usage!r}")
        if self.busy_waiting < 0:
            out.append(f"busy_waiting must be ≥ 0, got {self.busy_waiting!r}")
        return out

    def tier_weight(self, medium: str | None) -> float:
        """Weight of a block stored on ``medium`` (None is GPU)."""
        if medium is None:
            return self.tier_weights.get(GPU_TIER, 1.0)
        return self.tier_weights.get(medium.upper(), UNKNOWN_TIER_WEIGHT)


# ---------------------------------------------------------------------------------------- request


_decoder = msgspec.json.Decoder(RouteRequest)
_TOKEN_RANGE = re.compile(r"Expected `int` (?:>=|<=) \d+ - at `\$\.token_ids\[(\d+)\]`")
_HASH_RANGE = re.compile(r"Expected `int` >= 0 - at `\$\.(block_hashes|seq_hashes)\[(\d+)\]`")
_BIG_ENDIAN: Final[bool] = sys.byteorder == "big"


def parse_route_request(
    body: bytes, *, max_tokens: int = DEFAULT_MAX_TOKENS, base_policy: Policy | None = None
) -> RouteRequest:
    """Parse and check a JSON route request body.

    Args:
        body: the JSON request.
        max_tokens: the longest prompt accepted, in tokens (a pre-hashed one: at most this many blocks).
        base_policy: the router's policy, to check the request's overrides against (default `Policy()`).

    Returns:
        the request; its ``token_ids`` as an ``array('I')`` when they are a plain JSON array of integers
        (found and read in one compiled pass over the body, `kvmesh.core.tables.scan_body_token_ids`: about
        40 µs for 4,096 tokens here against 100 µs decoding them into Python ints, and the index reads the
        array without packing it again), else as msgspec decodes them (a list).

    Raises:
        RequestError: not JSON, not an object, a missing or mistyped field, an unknown ``policy`` key, an
            out-of-range policy value, an empty or too long ``token_ids`` (more than ``max_tokens``
            tokens), a token id outside ``[0, 2**32)``, both or neither of ``token_ids`` and
            ``block_hashes``, a block hash outside ``[0, 2**64)``, or a ``version`` later than
            `kvmesh.core.protocol.PROTOCOL_VERSION`; ``field`` names the culprit when there is one
            (``token_ids``, ``block_hashes``, ``policy.temperature``, ``version``).
    """
    req = _decode_scanned(body)
    if req is None:
        req = _decode_json(body, "request body")
    check_route_request(req, max_tokens=max_tokens, base_policy=base_policy)
    return req


def _decode_scanned(body: bytes) -> RouteRequest | None:
    """The request with its ``token_ids`` read by the compiled scan and the rest (``[]`` in their place) by
    msgspec; None when the scan refuses the body or the rest does not decode, so that `_decode_json` decodes
    the whole body and gives its values and errors exactly as before."""
    decoded = tables.decode_scanning_token_ids(body, _decoder)
    if decoded is None:
        return None
    rest, tokens = decoded
    ids = array("I")
    ids.frombytes(tokens.tobytes())  # native order on both sides
    return msgspec.structs.replace(rest, token_ids=ids)


def parse_route_message(
    body: bytes,
    headers: Mapping[str, str] | None,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    base_policy: Policy | None = None,
) -> RouteRequest:
    """Parse and check a route request in any of its forms (`kvmesh.core.protocol.ROUTE_FORMS`).

    Args:
        body: the message body: JSON, or packed ids as the ``Kvmesh-Body`` header says.
        headers: the message's NATS headers (None: none): ``Kvmesh-Body`` (absent or ``json``: a JSON body;
            ``tokens-u32le``: token ids as little-endian uint32; ``hashes-u64le``: local block hashes as
            little-endian uint64; ``seqhashes-u64le``: sequence hashes, the same way) and, with a binary body, ``Kvmesh-Route``: the other fields as one JSON
            object (``model`` required, no ``token_ids`` or ``block_hashes``).
        max_tokens, base_policy: as for `parse_route_request`.

    Returns:
        the request; a binary body's ids as an ``array`` (``'I'`` tokens, ``'Q'`` hashes), not copied to a
        list.

    Raises:
        RequestError: an unknown ``Kvmesh-Body`` (``field="Kvmesh-Body"``); a binary body without a
            ``Kvmesh-Route`` header, or one that does not decode or carries ids itself
            (``field="Kvmesh-Route"`` or the field at fault); a body whose length is not a whole number of
            ids (``token_ids``/``block_hashes``); anything `parse_route_request` refuses.
    """
    form = headers.get(BODY_HEADER) if headers else None
    if form is None or form == BODY_JSON:
        return parse_route_request(body, max_tokens=max_tokens, base_policy=base_policy)
    if form == BODY_TOKENS_U32LE:
        ids, name, width = array("I"), "token_ids", 4
    elif form == BODY_HASHES_U64LE:
        ids, name, width = array("Q"), "block_hashes", 8
    elif form == BODY_SEQHASHES_U64LE:
        ids, name, width = array("Q"), "seq_hashes", 8
    else:
        raise RequestError(
            f"unknown {BODY_HEADER} {form[:64]!r}: this router reads {', '.join(ROUTE_FORMS)}",
            field=BODY_HEADER,
        )
    raw = headers.get(FIELDS_HEADER) if headers else None
    if raw is None:
        raise RequestError(
            f"a {form} body needs the {FIELDS_HEADER} header (the request's other fields as a JSON object, "
            'at least {"model": ...})',
            field=FIELDS_HEADER,
        )
    fields = _decode_json(raw.encode(), f"{FIELDS_HEADER} header")
    if fields.token_ids or fields.block_hashes is not None or fields.seq_hashes is not None:
        raise RequestError(
            f"a {form} body carries the ids: the {FIELDS_HEADER} header must not carry token_ids, "
            "block_hashes or seq_hashes",
            field=FIELDS_HEADER,
        )
    if len(body) % width:
        raise RequestError(
            f"a {form} body is a whole number of {width}-byte ids: got {len(body):,} bytes "
            f"(truncated or not {form})",
            field=name,
        )
    if ids.itemsize != width:  # pragma: no cover - no supported platform has other widths
        raise RuntimeError(f"array({ids.typecode!r}) is not {8 * width}-bit here")
    ids.frombytes(body)
    if _BIG_ENDIAN:  # pragma: no cover
        ids.byteswap()
    req = msgspec.structs.replace(fields, **{name: ids})
    check_route_request(req, max_tokens=max_tokens, base_policy=base_policy)
    return req


def _decode_json(body: bytes, what: str) -> RouteRequest:
    try:
        req: RouteRequest = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        r = _TOKEN_RANGE.match(text)
        if r is not None:
            raise RequestError(f"token_ids[{r.group(1)}] is outside [0, 2^32)", field="token_ids") from exc
        r = _HASH_RANGE.match(text)
        if r is not None:
            raise RequestError(f"{r.group(1)}[{r.group(2)}] is outside [0, 2^64)", field=r.group(1)) from exc
        raise RequestError(f"invalid request: {text}", field=error_field(text)) from exc
    except msgspec.DecodeError as exc:
        raise RequestError(f"{what} is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # msgspec recurses into nested values of unknown fields
        raise RequestError(f"{what} is nested too deeply") from exc
    return req


def check_route_request(
    req: RouteRequest, *, max_tokens: int = DEFAULT_MAX_TOKENS, base_policy: Policy | None = None
) -> None:
    """Check a decoded route request (every form): its version, model, ids and policy overrides.

    Raises:
        RequestError: as `parse_route_request` says.
    """
    check_version(req, RequestError)
    if not req.model:
        raise RequestError("model must be a non-empty string", field="model")
    check_route_ids(req)
    if req.session_id is not None and not 0 < len(req.session_id) <= MAX_SESSION_ID_CHARS:
        raise RequestError(
            f"session_id must have 1 to {MAX_SESSION_ID_CHARS} characters, got {len(req.session_id)}",
            field="session_id",
        )
    hashes, kind = (
        (req.block_hashes, "block_hashes") if req.seq_hashes is None else (req.seq_hashes, "seq_hashes")
    )
    if hashes is None:
        if len(req.token_ids) > max_tokens:
            raise RequestError(
                f"token_ids has {len(req.token_ids)} tokens, more than the limit of {max_tokens}",
                field="token_ids",
            )
        for name in ("block_size", "prompt_tokens"):
            if getattr(req, name) is not None:
                raise RequestError(f"{name} goes with block_hashes or seq_hashes only", field=name)
    else:
        _check_hashed(req, hashes, max_tokens, kind)
    if req.policy is not None:
        problems = apply_override(base_policy or Policy(), req.policy).problems()
        if problems:
            first = problems[0].split(" ", 1)[0]
            raise RequestError("policy." + "; policy.".join(problems), field=f"policy.{first}")


def _check_hashed(req: RouteRequest, hashes: Sequence[int], max_tokens: int, kind: str) -> None:
    """Check a pre-hashed request's ``kind`` (``block_hashes`` or ``seq_hashes``) and its companions."""
    if not hashes:
        raise RequestError(f"{kind} must not be empty", field=kind)
    if len(hashes) > max_tokens:
        raise RequestError(
            f"{kind} has {len(hashes)} blocks, more than the limit of {max_tokens}",
            field=kind,
        )
    if max(hashes) > MAX_BLOCK_HASH:
        i = next(i for i, h in enumerate(hashes) if h > MAX_BLOCK_HASH)
        raise RequestError(f"{kind}[{i}] is outside [0, 2^64)", field=kind)
    for name in ("lora_name", "cache_salt"):
        if getattr(req, name) is not None:
            raise RequestError(
                f"{name} is mixed into {kind} by the caller: a pre-hashed request does not carry it",
                field=name,
            )
    if req.block_size is not None and req.block_size <= 0:
        raise RequestError(f"block_size must be positive, got {req.block_size}", field="block_size")
    if req.prompt_tokens is not None:
        full = len(hashes) * (req.block_size or 1)
        if req.prompt_tokens < full:
            raise RequestError(
                f"prompt_tokens ({req.prompt_tokens}) is less than the {len(hashes)} full blocks' "
                + (f"{full} tokens" if req.block_size else "block count"),
                field="prompt_tokens",
            )


def apply_override(base: Policy, override: PolicyOverride | None) -> Policy:
    """Return ``base`` with every non-None field of a request's ``policy`` set (tier weights merge into the
    base's, upper-cased)."""
    if override is None:
        return base
    changes: dict[str, Any] = {
        f: getattr(override, f) for f in override.__struct_fields__ if getattr(override, f) is not None
    }
    if "tier_weights" in changes:
        changes["tier_weights"] = {
            **base.tier_weights,
            **{k.upper(): v for k, v in changes["tier_weights"].items()},
        }
    return replace(base, **changes) if changes else base


def route_seed(request_id: str | None, body: bytes) -> int:
    """Return the 64-bit seed of a request's random choices: XXH3 of its ``request_id``, else of its body.

    Every router replica derives the same seed from the same request, so ties and temperature sampling agree.
    """
    return xxhash.xxh3_64_intdigest(request_id.encode() if request_id is not None else body)


# ---------------------------------------------------------------------------------------- decision


class CandidateLike(Protocol):
    """One candidate as the decision reads it: a `Candidate`, or a holder of an index's match answer as it
    comes (`kvmesh.core.state.HolderMatch`, an indexer's `kvmesh.core.protocol.MatchHolder`), not copied."""

    @property
    def worker_id(self) -> str: ...
    @property
    def dp_rank(self) -> int: ...
    @property
    def overlap_blocks(self) -> int: ...
    @property
    def cached_blocks(self) -> int: ...
    @property
    def tiers(self) -> Mapping[str, int] | None: ...
    @property
    def health(self) -> str | None: ...
    @property
    def block_size(self) -> int: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One (worker, dp rank) that may serve the request, with what the index knows of it."""

    worker_id: str
    dp_rank: int
    overlap_blocks: int
    """Leading full blocks of the prompt cached on this candidate (any tier)."""
    cached_blocks: int
    """All blocks indexed for this candidate (its cache size)."""
    tiers: Mapping[str, int] | None = None
    """Overlap blocks per storage medium (sum = ``overlap_blocks``), or None: all on GPU."""
    health: str | None = None
    """None when the index's picture of this holder is exact, else why not (``"out_of_order"``, ``"gap"``,
    ``"stream_gap"``: history lost, `kvmesh.core.state.IndexState.holder_health`)."""
    block_size: int = 0
    """Tokens per block of this candidate's own blocks (its engine's block size; 0: the model's)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Score:
    """One candidate's score: its affinity, its load and the resulting cost."""

    worker_id: str
    dp_rank: int
    overlap_blocks: int
    cached_blocks: int
    cached_tokens: float
    """Overlap in tokens, weighted by tier (equals ``overlap_blocks × block_size`` on GPU)."""
    tier_tokens: Mapping[str, int]
    """Unweighted overlap tokens per tier."""
    prefill_blocks: float
    decode_blocks: float
    active: ActiveLoad
    engine: WorkerLoad | None
    busy: bool
    cost: float
    probability: float | None = None
    """Chance of being sampled (only with temperature > 0 and when eligible)."""
    overlap_tokens: int = 0
    """Leading prompt tokens cached, unweighted: ``overlap_blocks`` × the candidate's own block size."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """The chosen candidate and every candidate's score (eligible ones first, best first)."""

    winner: Score
    scores: tuple[Score, ...]


def _tiebreak(seed: int, worker_id: str, dp_rank: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{worker_id}\0{dp_rank}".encode(), seed=seed)


def score(
    c: CandidateLike,
    *,
    prompt_tokens: int,
    block_size: int,
    policy: Policy,
    active: ActiveLoad = ZERO_LOAD,
    engine: WorkerLoad | None = None,
) -> Score:
    """Compute one candidate's cost (see the module docstring for the formula).

    A ``block_size`` of 0 (the model's block size is not known yet, so nothing is cached) counts in tokens.
    """
    block_size = max(block_size, 1)
    own = c.block_size if c.block_size > 0 else block_size  # a holder counts in its own blocks
    if c.tiers is None:
        tier_tokens = {GPU_TIER: c.overlap_blocks * own} if c.overlap_blocks else {}
        cached = float(c.overlap_blocks * own) * policy.tier_weight(None)
    else:
        tier_tokens = {m: n * own for m, n in c.tiers.items() if n}
        cached = float(sum(n * own * policy.tier_weight(m) for m, n in c.tiers.items()))
    prefill = (prompt_tokens - cached + active.prefill_tokens) / block_size
    decode = float(active.blocks)
    busy = engine is not None and (
        (engine.kv_usage is not None and engine.kv_usage >= policy.busy_kv_usage)
        or (policy.busy_waiting > 0 and engine.waiting is not None and engine.waiting >= policy.busy_waiting)
    )
    return Score(
        worker_id=c.worker_id,
        dp_rank=c.dp_rank,
        overlap_blocks=c.overlap_blocks,
        cached_blocks=c.cached_blocks,
        cached_tokens=cached,
        tier_tokens=tier_tokens,
        prefill_blocks=prefill,
        decode_blocks=decode,
        active=active,
        engine=engine,
        busy=busy,
        cost=policy.overlap_weight * prefill + policy.decode_weight * decode,
        overlap_tokens=c.overlap_blocks * own,
    )


def rank(
    candidates: Sequence[CandidateLike],
    *,
    prompt_tokens: int,
    block_size: int,
    policy: Policy | None = None,
    active: Mapping[Holder, ActiveLoad] | None = None,
    engine: Mapping[Holder, WorkerLoad] | None = None,
    seed: int = 0,
    allowed: Sequence[str] | None = None,
    session: Holder | None = None,
) -> Ranking | None:
    """Rank the candidates for a prompt: the decision of `decide`, with each `Score` built only when asked.

    Args:
        candidates, prompt_tokens, block_size, policy, active, engine, seed, allowed: as for `decide`.
        session: the (worker, dp rank) the request's session was last routed to, or None. When it is an
            eligible candidate (allowed, not skipped as busy) whose cost is at most the lowest eligible cost
            + ``policy.session_slack`` × the prompt's blocks, it wins (no sampling); `Ranking.session` says
            what happened.

    Returns:
        the ranking (`Ranking.winner` equals `decide`'s winner, `Ranking.scores` its scores), or None when no
        candidate is left.

    Cost: one pass over the candidates computing each one's cost as a float (a `Holder` and a load lookup
    only for workers named in ``active`` or ``engine``), then a scan for the lowest cost; the seeded
    tiebreak is hashed only for candidates tied on cost and cached blocks. With temperature > 0 the eligible
    candidates are sorted (O(n log n)); nothing else is sorted until `Ranking.scores` asks for the order.
    """
    pol = policy or Policy()
    act = active or {}
    eng = engine or {}
    allow = set(allowed) if allowed is not None else None
    bs = max(block_size, 1)
    gpu = pol.tier_weight(None)
    ow, dw = pol.overlap_weight, pol.decode_weight
    loaded = {h.worker_id for h in act}
    loaded.update(h.worker_id for h in eng)
    positions: Sequence[int]
    chosen: Sequence[CandidateLike]
    if allow is None:
        positions = range(len(candidates))
        chosen = candidates
    else:
        positions = [i for i, c in enumerate(candidates) if c.worker_id in allow]
        chosen = [candidates[i] for i in positions]
    if not positions:
        return None
    # Every cost as `score` computes it (the same operations in the same order, so the same floats), first
    # with no load; then the candidates of workers with load or an engine report are computed again.
    zero_prefill, zero_decode = ZERO_LOAD.prefill_tokens, float(ZERO_LOAD.blocks)
    cached: Sequence[float] | None = None
    size = chosen[0].block_size
    own = size if size > 0 else bs
    overlaps = [c.overlap_blocks for c in chosen if c.tiers is None and c.block_size == size]
    if len(overlaps) == len(chosen):  # no tiers, one block size: a cost per distinct overlap, then lookups
        cost_of = {
            o: ow * ((prompt_tokens - float(o * own) * gpu + zero_prefill) / bs) + dw * zero_decode
            for o in set(overlaps)
        }
        costs = list(map(cost_of.__getitem__, overlaps))
    else:
        cached = [
            float(c.overlap_blocks * (c.block_size if c.block_size > 0 else bs)) * gpu
            if c.tiers is None
            else _cached_tokens(c, bs, gpu, pol)
            for c in chosen
        ]
        cost_at = {x: ow * ((prompt_tokens - x + zero_prefill) / bs) + dw * zero_decode for x in set(cached)}
        costs = list(map(cost_at.__getitem__, cached))  # equal cached tokens, equal cost: each computed once
    busy: list[int] = []
    if loaded:
        for k, c in enumerate(chosen):
            if c.worker_id not in loaded:
                continue
            holder = Holder(c.worker_id, c.dp_rank)
            a = act.get(holder, ZERO_LOAD)
            x = cached[k] if cached is not None else float(overlaps[k] * own) * gpu
            costs[k] = ow * ((prompt_tokens - x + a.prefill_tokens) / bs) + dw * float(a.blocks)
            e = eng.get(holder)
            if e is not None and _busy(e, pol):
                busy.append(k)
    return Ranking(
        candidates, positions, costs, busy, seed=seed, policy=pol, prompt_tokens=prompt_tokens,
        block_size=block_size, active=act, engine=eng, session=session,
    )  # fmt: skip


def _cached_tokens(c: CandidateLike, block_size: int, gpu_weight: float, policy: Policy) -> float:
    """A candidate's overlap in tokens weighted by tier (`score`'s ``cached_tokens``; ``block_size`` ≥ 1)."""
    own = c.block_size if c.block_size > 0 else block_size
    if c.tiers is None:
        return float(c.overlap_blocks * own) * gpu_weight
    return float(sum(n * own * policy.tier_weight(m) for m, n in c.tiers.items()))


def _busy(engine: WorkerLoad, policy: Policy) -> bool:
    """Whether an engine report makes its worker busy under ``policy`` (`score`'s rule)."""
    return (engine.kv_usage is not None and engine.kv_usage >= policy.busy_kv_usage) or (
        policy.busy_waiting > 0 and engine.waiting is not None and engine.waiting >= policy.busy_waiting
    )


_TIE_MARGIN: Final[float] = 2e-9
"""Costs within this of the lowest may round (to 9 places) to the same value; only those are rounded."""


class Ranking:
    """The decision of one route over its candidates, held as plain numbers (built by `rank`).

    The order is `decide`'s: eligible candidates (not busy, unless all are) before busy ones, each by cost
    rounded to 9 places, then fewest cached blocks, then the seeded tiebreak ``xxh3_64(worker_id ‖ 0 ‖
    dp_rank, seed)``, then the candidates' own order. With temperature > 0 the winner is sampled over the
    eligible ones in that order, as `decide` says.

    Cost: `winner` is computed once by `rank` (O(candidates)); `winner_score` builds one `Score`;
    `passed_over` sorts the busy candidates only; `scores` sorts every candidate and builds a `Score` each
    (what explain shows).
    """

    __slots__ = (
        "_active",
        "_block_size",
        "_busy",
        "_candidates",
        "_costs",
        "_eligible",
        "_engine",
        "_policy",
        "_positions",
        "_probabilities",
        "_prompt_tokens",
        "_seed",
        "_winner",
        "session",
        "winner",
    )

    def __init__(
        self,
        candidates: Sequence[CandidateLike],
        positions: Sequence[int],
        costs: list[float],
        busy: list[int],
        *,
        seed: int,
        policy: Policy,
        prompt_tokens: int,
        block_size: int,
        active: Mapping[Holder, ActiveLoad],
        engine: Mapping[Holder, WorkerLoad],
        session: Holder | None = None,
    ) -> None:
        self._candidates = candidates
        self._positions = positions
        self._costs = costs
        self._seed = seed
        self._policy = policy
        self._prompt_tokens = prompt_tokens
        self._block_size = block_size
        self._active = active
        self._engine = engine
        n = len(positions)
        self._eligible: Sequence[int]
        if busy and len(busy) < n:  # busy ones are skipped while any other is free
            skip = set(busy)
            self._eligible = [k for k in range(n) if k not in skip]
            self._busy = busy
        else:
            self._eligible = range(n)
            self._busy = []
        self._probabilities: dict[int, float] | None = None
        eligible = self._eligible
        if policy.temperature <= 0 or len(eligible) == 1:
            best = self._best(eligible)
        else:
            order = self._sorted(eligible)
            probs = softmax_probabilities([costs[k] for k in order], policy.temperature)
            self._probabilities = dict(zip(order, probs, strict=True))
            r = random.Random(seed).random()
            acc = 0.0
            best = order[-1]
            for k, p in zip(order, probs, strict=True):
                acc += p or 0.0
                if r < acc:
                    best = k
                    break
        self.session: str | None = None
        """With a session: ``"kept"`` (its (worker, dp rank) won, on cost or by affinity), ``"moved"`` (it was
        no eligible candidate, or cost more than the slack allows); None without one."""
        if session is not None:
            best = self._keep_session(session, best, policy, prompt_tokens, block_size)
        self.winner: CandidateLike = candidates[positions[best]]
        """The chosen candidate."""
        self._winner = best

    def _keep_session(
        self, session: Holder, best: int, policy: Policy, prompt_tokens: int, block_size: int
    ) -> int:
        """Return the session's candidate when it is eligible and within the slack of the lowest cost, else
        ``best``; set `session`."""
        cands, pos, costs = self._candidates, self._positions, self._costs
        wid, rank_ = session
        mine = next(
            (k for k in self._eligible if cands[pos[k]].worker_id == wid and cands[pos[k]].dp_rank == rank_),
            None,
        )
        if mine is None:
            self.session = "moved"
            return best
        low = min(costs[k] for k in self._eligible)
        slack = policy.session_slack * (prompt_tokens / max(block_size, 1))
        if costs[mine] - low <= slack + _TIE_MARGIN or mine == best:
            self.session = "kept"
            return mine
        self.session = "moved"
        return best

    def _tiebreak_of(self, k: int) -> int:
        c = self._candidates[self._positions[k]]
        return _tiebreak(self._seed, c.worker_id, c.dp_rank)

    def _best(self, ks: Sequence[int]) -> int:
        """The first of ``ks`` in decision order (they are all eligible, or all busy)."""
        costs = self._costs
        if len(ks) == len(costs):  # every candidate: C-level scans, one hash per candidate only on a tie
            low = min(costs)
            rounded = round(low, 9)
            near = [v for v in set(costs) if v - low <= _TIE_MARGIN and round(v, 9) == rounded]
            if len(near) == 1 and costs.count(near[0]) == 1:
                return costs.index(near[0])
            tied = [k for k, v in enumerate(costs) if v in near]
        else:
            low = min(costs[k] for k in ks)
            rounded = round(low, 9)
            tied = [k for k in ks if costs[k] - low <= _TIE_MARGIN and round(costs[k], 9) == rounded]
        if len(tied) == 1:
            return tied[0]
        cands, pos = self._candidates, self._positions
        fewest = min(cands[pos[k]].cached_blocks for k in tied)
        tied = [k for k in tied if cands[pos[k]].cached_blocks == fewest]
        if len(tied) == 1:
            return tied[0]
        return min(tied, key=lambda k: (self._tiebreak_of(k), k))

    def _sorted(self, ks: Sequence[int]) -> list[int]:
        """``ks`` in decision order (all eligible, or all busy)."""
        costs, cands, pos = self._costs, self._candidates, self._positions
        keyed = sorted((round(costs[k], 9), cands[pos[k]].cached_blocks, k) for k in ks)
        out = [k for _, _, k in keyed]
        i, n = 0, len(keyed)
        while i < n:  # runs tied on cost and cached blocks: by the seeded tiebreak, then by position
            j = i + 1
            while j < n and keyed[j][:2] == keyed[i][:2]:
                j += 1
            if j - i > 1:
                out[i:j] = sorted(out[i:j], key=lambda k: (self._tiebreak_of(k), k))
            i = j
        return out

    def _score(self, k: int) -> Score:
        c = self._candidates[self._positions[k]]
        holder = Holder(c.worker_id, c.dp_rank)
        s = score(
            c,
            prompt_tokens=self._prompt_tokens,
            block_size=self._block_size,
            policy=self._policy,
            active=self._active.get(holder, ZERO_LOAD),
            engine=self._engine.get(holder),
        )
        probs = self._probabilities
        if probs is not None and k in probs:
            s = replace(s, probability=probs[k])
        return s

    def winner_score(self) -> Score:
        """Return the winner's `Score` (with its probability when sampled)."""
        return self._score(self._winner)

    def passed_over(self) -> list[CandidateLike]:
        """Return the candidates skipped as busy while another was free, in decision order (empty when none
        or all were busy)."""
        cands, pos = self._candidates, self._positions
        return [cands[pos[k]] for k in self._sorted(self._busy)] if self._busy else []

    def _order(self) -> list[int]:
        return self._sorted(self._eligible) + (self._sorted(self._busy) if self._busy else [])

    def scores(self) -> tuple[Score, ...]:
        """Return every candidate's `Score` in decision order: eligible ones first (best first), busy ones after."""
        return tuple(self._score(k) for k in self._order())

    def decision(self) -> Decision:
        """Return the full `Decision` (`decide`'s answer: the winner's `Score` and every candidate's)."""
        order = self._order()
        scores = tuple(self._score(k) for k in order)
        return Decision(winner=scores[order.index(self._winner)], scores=scores)


def decide(
    candidates: Sequence[CandidateLike],
    *,
    prompt_tokens: int,
    block_size: int,
    policy: Policy | None = None,
    active: Mapping[Holder, ActiveLoad] | None = None,
    engine: Mapping[Holder, WorkerLoad] | None = None,
    seed: int = 0,
    allowed: Sequence[str] | None = None,
    session: Holder | None = None,
) -> Decision | None:
    """Pick the (worker, dp rank) for a prompt, with every candidate's score (`rank`, all scores built).

    Args:
        candidates: every live (worker, dp rank) of the model with its overlap; see `merge_candidates`.
        prompt_tokens: tokens in the prompt.
        block_size: tokens per KV block of the model (0 when unknown: costs then count tokens).
        policy: the cost terms and thresholds (default `Policy()`).
        active: router-side load per (worker, dp rank); missing means none.
        engine: fresh engine reports per (worker, dp rank); missing means none (never busy).
        seed: the request's seed (`route_seed`), for ties and sampling.
        allowed: restrict the choice to these worker ids, or None for all.
        session: the (worker, dp rank) of the request's session, or None (`rank`).

    Returns:
        the decision, or None when no candidate is left.
    """
    ranking = rank(
        candidates, prompt_tokens=prompt_tokens, block_size=block_size, policy=policy, active=active,
        engine=engine, seed=seed, allowed=allowed, session=session,
    )  # fmt: skip
    return None if ranking is None else ranking.decision()


def softmax_probabilities(costs: Sequence[float], temperature: float) -> list[float]:
    """Return softmax probabilities of ``−normalised cost / temperature`` (costs scaled to [0, 1]).

    Equal costs give equal probabilities. ``temperature`` must be > 0.
    """
    lo, hi = min(costs), max(costs)
    span = hi - lo
    logits = [-((c - lo) / span if span > 0 else 0.0) / temperature for c in costs]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def available_tokens(candidates: Sequence[CandidateLike], ranks: RankSet | None, *, block_size: int) -> int:
    """Return the most leading prompt tokens any live candidate has cached (the route's *available* reuse).

    Args:
        candidates: the index's holders of the model with their overlaps (before a request's ``candidates``
            narrows them or the bound cuts them: reuse that a narrowed or bounded choice could not reach
            still counts as available).
        ranks: the model's registered ranks (a holder not live in it is not counted), or None (every holder
            counts).
        block_size: the model's block size (a holder with ``block_size`` 0 counts in it; 0 here counts 1).

    Returns:
        ``max(overlap_blocks × the holder's own block size)`` over those holders, 0 when none overlaps;
        unweighted by tier, the same measure as `Score.overlap_tokens`, so the winner's never exceeds it.

    Cost: O(candidates).
    """
    model_bs = max(block_size, 1)
    best = 0
    for c in candidates:
        if c.overlap_blocks <= 0:
            continue
        tokens = c.overlap_blocks * (c.block_size if c.block_size > 0 else model_bs)
        if tokens > best and (ranks is None or ranks.contains(c.worker_id, c.dp_rank)):
            best = tokens
    return best


def merge_candidates(indexed: Sequence[Candidate], live: Sequence[Holder] | None) -> list[Candidate]:
    """Combine the index's candidates with a worker registry's live (worker, dp rank) list.

    With ``live`` None (no registry), the index's candidates (every holder that announced itself) are
    used as they are. Otherwise only live ones are kept, and a live one the index does not know joins
    with zero overlap and zero cached blocks.
    """
    if live is None:
        return list(indexed)
    keep = set(live)
    out = [c for c in indexed if (c.worker_id, c.dp_rank) in keep]
    seen = {(c.worker_id, c.dp_rank) for c in out}
    out.extend(
        Candidate(worker_id=w, dp_rank=r, overlap_blocks=0, cached_blocks=0) for w, r in sorted(keep - seen)
    )
    return out


# ---------------------------------------------------------------------------------------- candidates


DEFAULT_MAX_CANDIDATES: Final[int] = 1024
"""Default bound on the candidates one route scores (`select_candidates`)."""
IDLE_CANDIDATES: Final[int] = 16
"""Registered ranks the index does not know (nothing cached) and with no load that one route scores at most.

They all cost the same (the whole prompt, nothing in flight), so a few stand for all of them; which few
depends on the request's seed, so replicas agree and different requests spread over them."""
MAX_SKIPPED_LISTED: Final[int] = 64
"""Skipped candidates listed by name in a selection (`Selection.skipped`); the rest are only counted."""


@dataclass(frozen=True, slots=True)
class RegisteredWorker:
    """One registered worker of a model as the router sees it (one object per worker, not per rank)."""

    worker_id: str
    dp_ranks: int
    """Ranks 0 … dp_ranks − 1 are registered."""
    stale: Mapping[int, str]
    """dp_rank → why its engine is stale (those ranks are not candidates)."""
    context_length: int | None = None
    """Longest prompt its engine accepts, in tokens (None: not known, any prompt is offered to it)."""


class RankSet:
    """The registered (worker, dp rank)s of one model, held per worker (never a Python object per rank).

    Args:
        workers: the model's registered workers (any order; kept sorted by worker id).

    Cost: `contains` and `stale_reason` are O(1); `walk` yields ranks lazily; building is O(workers +
    stale ranks), once per change of the registry.
    """

    __slots__ = (
        "_by_id",
        "_live",
        "_shortest",
        "_starts",
        "_total",
        "live_count",
        "stale_count",
        "stale_listed",
        "workers",
    )

    def __init__(self, workers: Sequence[RegisteredWorker]) -> None:
        self.workers: tuple[RegisteredWorker, ...] = tuple(sorted(workers, key=lambda w: w.worker_id))
        self._by_id = {w.worker_id: w for w in self.workers}
        starts = []
        live = []
        total = 0
        stale = 0
        for w in self.workers:
            starts.append(total)
            total += w.dp_ranks
            n = sum(1 for r in w.stale if 0 <= r < w.dp_ranks)
            stale += n
            live.append(w.dp_ranks - n)
        self._starts = starts
        self._live = live
        self._total = total
        listed: list[tuple[str, int, str]] = []
        for w in self.workers:
            for r, reason in sorted(w.stale.items()):
                if len(listed) < MAX_SKIPPED_LISTED and 0 <= r < w.dp_ranks:
                    listed.append((w.worker_id, r, reason))
        self.stale_listed: tuple[tuple[str, int, str], ...] = tuple(listed)
        """The first `MAX_SKIPPED_LISTED` stale ranks (worker, rank, reason), by worker then rank."""
        self.stale_count: int = stale
        """Registered ranks whose engine is stale."""
        self.live_count: int = total - stale
        """Registered ranks that are candidates (not stale)."""
        lengths = [w.context_length for w in self.workers if w.context_length is not None]
        self._shortest: int | None = min(lengths) if lengths else None

    @classmethod
    def from_pairs(cls, live: Sequence[Holder]) -> RankSet:
        """Build from a list of live (worker id, dp rank)s (a registry that lists ranks one by one)."""
        ranks: dict[str, set[int]] = {}
        for w, r in live:
            ranks.setdefault(w, set()).add(r)
        workers = []
        for w, rs in ranks.items():
            n = max(rs) + 1
            workers.append(RegisteredWorker(w, n, {r: "not registered" for r in range(n) if r not in rs}))
        return cls(workers)

    def only(self, worker_ids: Sequence[str]) -> RankSet:
        """Return the registered ranks of ``worker_ids`` only (a request's ``candidates``); O(len(worker_ids))."""
        return RankSet([w for w in (self._by_id.get(i) for i in set(worker_ids)) if w is not None])

    def within_context(self, prompt_tokens: int) -> RankSet:
        """Return the ranks of the workers whose context length admits a ``prompt_tokens``-token prompt.

        A worker with no registered context length admits any prompt; one whose length is below the prompt's
        is left out (vLLM refuses a prompt longer than ``--max-model-len``). Returns this set itself when
        every worker admits it (the common case: O(1)); else O(workers).
        """
        if self._shortest is None or prompt_tokens <= self._shortest:
            return self
        return RankSet(
            [w for w in self.workers if w.context_length is None or prompt_tokens <= w.context_length]
        )

    def longest_context(self) -> int | None:
        """Return the longest context length a worker of the set registered (None: none did)."""
        lengths = [w.context_length for w in self.workers if w.context_length is not None]
        return max(lengths) if lengths else None

    def worker(self, worker_id: str) -> RegisteredWorker | None:
        """Return a registered worker of the model, or None."""
        return self._by_id.get(worker_id)

    def registered(self, worker_id: str, dp_rank: int) -> bool:
        """Whether (worker, rank) is registered for the model (stale or not)."""
        w = self._by_id.get(worker_id)
        return w is not None and 0 <= dp_rank < w.dp_ranks

    def contains(self, worker_id: str, dp_rank: int) -> bool:
        """Whether (worker, rank) is registered and not stale."""
        w = self._by_id.get(worker_id)
        return w is not None and 0 <= dp_rank < w.dp_ranks and dp_rank not in w.stale

    def stale_reason(self, worker_id: str, dp_rank: int) -> str | None:
        """Why a registered rank is stale, or None (live, or not registered)."""
        w = self._by_id.get(worker_id)
        return w.stale.get(dp_rank) if w is not None and 0 <= dp_rank < w.dp_ranks else None

    def walk(self, seed: int) -> Iterator[Holder]:
        """Yield every live (not stale) registered rank once, from a position derived from ``seed``, wrapping.

        Workers whose every rank is stale are skipped whole.
        """
        total = self._total
        if total == 0 or self.live_count == 0:
            return
        pos = seed % total
        i = bisect.bisect_right(self._starts, pos) - 1
        first = pos - self._starts[i]
        n = len(self.workers)
        for k in range(n + 1):
            w = self.workers[(i + k) % n]
            if self._live[(i + k) % n] == 0:
                continue
            if k == 0:
                ranks: range = range(first, w.dp_ranks)
            elif k == n:
                ranks = range(0, first)
            else:
                ranks = range(w.dp_ranks)
            for r in ranks:
                if r not in w.stale:
                    yield Holder(w.worker_id, r)


@dataclass(frozen=True, slots=True, kw_only=True)
class Selection:
    """The candidates one route scores (`select_candidates`)."""

    candidates: list[CandidateLike]
    """The chosen candidates (the index's own holder objects, not copied): the index holders in the order of
    preference when there were more than the bound, else in their given order; then the registered ranks
    drawn."""
    total: int
    """Live candidates of the model: index holders kept by the registry plus registered ranks it lacks."""
    cut: int
    """Live candidates not scored (``total − len(candidates)``): beyond the bound, or idle registered ranks
    not drawn."""
    bounded: bool
    """True when the candidates worth scoring (all but the idle registered ranks) exceeded the bound."""
    skipped: list[tuple[str, int, str]]
    """Up to `MAX_SKIPPED_LISTED` (worker, rank, reason) left out as stale, index holders first."""
    skipped_total: int
    """Every stale registered rank of the model (held in the index or not)."""


_BY_CACHED_HOLDER: Final = attrgetter("cached_blocks", "worker_id", "dp_rank")
_BY_OVERLAP: Final = attrgetter("overlap_blocks")
_BY_CACHED: Final = attrgetter("cached_blocks")


def _tiebreak_runs(items: list[CandidateLike], seed: int) -> None:
    """Order each run of equal ``cached_blocks`` of a list sorted by them by the seeded tiebreak (stable):
    the list then stands sorted by (cached blocks, `_tiebreak`), hashing only candidates that tie."""
    i, n = 0, len(items)
    while i < n:
        cached = items[i].cached_blocks
        j = i + 1
        while j < n and items[j].cached_blocks == cached:
            j += 1
        if j - i > 1:
            items[i:j] = sorted(items[i:j], key=lambda c: _tiebreak(seed, c.worker_id, c.dp_rank))
        i = j


def select_candidates(
    indexed: Sequence[CandidateLike],
    ranks: RankSet | None,
    *,
    max_candidates: int = DEFAULT_MAX_CANDIDATES,
    seed: int = 0,
    loaded: Callable[[str, int], bool] = lambda w, r: False,
    idle_candidates: int = IDLE_CANDIDATES,
) -> Selection:
    """Choose, deterministically and at most ``max_candidates``, the candidates a route scores.

    Args:
        indexed: the index's holders of the model with their overlaps.
        ranks: the model's registered ranks, or None (no registry opinion: the index's holders as they are).
        max_candidates: the bound (≥ 1).
        seed: the request's seed (`route_seed`): which idle registered ranks are drawn.
        loaded: whether a (worker, rank) has load on the router (in-flight requests or an engine report).
        idle_candidates: idle registered ranks unknown to the index scored at most.

    Order of preference under the bound: holders with overlap (most first), then holders without
    (fewest cached blocks first, as ties go), then registered ranks the index lacks: up to
    ``idle_candidates`` without load, drawn by `RankSet.walk` from the seed, then ones with load. A rank
    with nothing cached is therefore never kept over a holder with overlap; one with load (it costs more
    than an idle one) only stands in for idle ones that are missing. When the bound cuts no index holder
    they are kept in their given order, unsorted: the decision (`rank`) orders by cost, cached blocks and
    the seeded tiebreak, not by position (a fleet of 1,024 holders saves two sorts per route).

    Cost: O(indexed + idle_candidates + loaded ranks met) per call, plus O(indexed log indexed) when the
    bound cuts index holders; independent of how many registered ranks hold nothing.
    """
    skipped: list[tuple[str, int, str]] = []
    if ranks is None:
        kept = list(indexed)
    else:
        kept = []
        by_id = ranks._by_id
        for c in indexed:
            w, r = by_id.get(c.worker_id), c.dp_rank
            if w is not None and 0 <= r < w.dp_ranks and r not in w.stale:  # `RankSet.contains`, inline
                kept.append(c)
                continue
            reason = ranks.stale_reason(c.worker_id, r)
            if reason is not None and len(skipped) < MAX_SKIPPED_LISTED:
                skipped.append((c.worker_id, r, reason))
    n_kept = len(kept)
    if n_kept <= max_candidates:  # none is cut: the decision does not depend on their order
        chosen = kept  # (extended below: count `kept` as `n_kept` from here)
    else:
        with_overlap = [c for c in kept if c.overlap_blocks > 0]
        without = [c for c in kept if c.overlap_blocks <= 0] if len(with_overlap) < len(kept) else []
        # (−overlap, cached, worker, rank) as two stable sorts on C-level keys
        with_overlap.sort(key=_BY_CACHED_HOLDER)
        with_overlap.sort(key=_BY_OVERLAP, reverse=True)
        # (cached, seeded tiebreak): the tiebreak hashed only within runs of equal cached blocks
        without.sort(key=_BY_CACHED)
        _tiebreak_runs(without, seed)
        chosen = (with_overlap + without)[:max_candidates]
    unindexed = 0
    keyed: set[tuple[str, int]] = set()
    if ranks is not None:
        keyed = {(c.worker_id, c.dp_rank) for c in kept}
        unindexed = ranks.live_count - len(keyed)
        held = {(w, r) for w, r, _ in skipped}
        skipped.extend(x for x in ranks.stale_listed if (x[0], x[1]) not in held)
        del skipped[MAX_SKIPPED_LISTED:]
    room = max_candidates - len(chosen)
    bounded = n_kept + min(unindexed, idle_candidates) > max_candidates
    if ranks is not None and room > 0 and unindexed > 0:
        idle: list[CandidateLike] = []
        busy: list[CandidateLike] = []
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
    total = n_kept + unindexed
    return Selection(
        candidates=chosen,
        total=total,
        cut=total - len(chosen),
        bounded=bounded,
        skipped=skipped,
        skipped_total=ranks.stale_count if ranks is not None else 0,
    )
