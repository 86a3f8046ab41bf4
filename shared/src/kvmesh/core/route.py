"""The route API's request parsing and the choice of a worker (pure).

Request (JSON, subject ``kvmesh.route``): ``model`` (str, required), ``token_ids`` (array of int, each
0 ≤ id < 2³², required, non-empty), ``lora_name``, ``cache_salt``, ``request_id`` (str or null),
``candidates`` (array of worker ids or null), ``explain`` (bool). Unknown fields are ignored; a known field of
the wrong type is a `RequestError` naming it.

Choice (this release): the candidate with the longest overlap wins; ties go to the one with the fewest cached
blocks (the emptier cache), then to the lowest (worker id, dp rank), so every router replica gives the same
answer for the same index state. ``cost`` is the blocks the winner still has to prefill
(``prompt_blocks − overlap_blocks``), the prefill term of the load-aware cost to come.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from kvmesh.core.errors import RequestError
from kvmesh.core.state import HolderMatch

DEFAULT_MAX_TOKENS: Final[int] = 1_048_576
MAX_TOKEN_ID: Final[int] = 2**32 - 1

ERROR_STATUS: Final[dict[str, int]] = {
    "bad_request": 400,
    "unknown_model": 404,
    "no_workers": 404,
    "unavailable": 503,
    "internal": 500,
}
"""Route error codes and the numeric ``Nats-Service-Error-Code`` each is sent with."""


class RouteRequest(msgspec.Struct, kw_only=True):
    """A parsed route request."""

    model: str
    token_ids: list[int]
    lora_name: str | None = None
    cache_salt: str | None = None
    candidates: list[str] | None = None
    request_id: str | None = None
    explain: bool = False


_decoder = msgspec.json.Decoder(RouteRequest)
_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")
_MISSING = re.compile(r"missing required field `([A-Za-z_]+)`")


def parse_route_request(body: bytes, *, max_tokens: int = DEFAULT_MAX_TOKENS) -> RouteRequest:
    """Parse and check a route request body.

    Raises:
        RequestError: not JSON, not an object, a missing or mistyped field, an empty or too long
            ``token_ids`` (more than ``max_tokens`` tokens), or a token id outside ``[0, 2**32)``;
            ``field`` names the culprit when there is one.
    """
    try:
        req = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _PATH.search(text) or _MISSING.search(text)
        raise RequestError(f"invalid request: {text}", field=m.group(1) if m else None) from exc
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not req.model:
        raise RequestError("model must be a non-empty string", field="model")
    if not req.token_ids:
        raise RequestError("token_ids must not be empty", field="token_ids")
    if len(req.token_ids) > max_tokens:
        raise RequestError(
            f"token_ids has {len(req.token_ids)} tokens, more than the limit of {max_tokens}",
            field="token_ids",
        )
    lo, hi = min(req.token_ids), max(req.token_ids)
    if lo < 0 or hi > MAX_TOKEN_ID:
        bad = lo if lo < 0 else hi
        raise RequestError(f"token id {bad} is outside [0, 2^32)", field="token_ids")
    return req


@dataclass(frozen=True, slots=True, kw_only=True)
class Score:
    """One candidate's score."""

    worker_id: str
    dp_rank: int
    overlap_blocks: int
    cached_blocks: int
    cost: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """The chosen worker and every candidate's score (best first)."""

    winner: Score
    scores: tuple[Score, ...]


def decide(
    candidates: Sequence[HolderMatch], *, prompt_blocks: int, allowed: Sequence[str] | None = None
) -> Decision | None:
    """Pick the worker for a prompt.

    Args:
        candidates: every holder of the model with its overlap (`IndexState.match`).
        prompt_blocks: full blocks in the prompt.
        allowed: restrict the choice to these worker ids, or None for all.

    Returns:
        the decision, or None when no candidate is left.
    """
    allow = set(allowed) if allowed is not None else None
    scores = [
        Score(
            worker_id=c.worker_id,
            dp_rank=c.dp_rank,
            overlap_blocks=c.overlap_blocks,
            cached_blocks=c.cached_blocks,
            cost=float(prompt_blocks - c.overlap_blocks),
        )
        for c in candidates
        if allow is None or c.worker_id in allow
    ]
    if not scores:
        return None
    scores.sort(key=lambda s: (s.cost, s.cached_blocks, s.worker_id, s.dp_rank))
    return Decision(winner=scores[0], scores=tuple(scores))


def error_body(code: str, message: str) -> dict[str, Any]:
    """Return the JSON error reply of the route API."""
    return {"error": {"code": code, "message": message}}
