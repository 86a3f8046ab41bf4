"""The RFC #1403 indexer API (Mooncake's conductor, Dynamo's standalone indexer) over a router's index: request
parsing and replies, pure (no sockets; `kvmesh.router.http_server` serves it).

Two dialects of one API, told apart by the body (both are served on the same paths):

* **RFC #1403** (Mooncake's ``docs/source/design/conductor/indexer-api-design.md``): ``/query`` takes
  ``model``, ``token_ids``, ``block_size`` and optional ``lora_name``, ``cache_salt``, ``tenant_id``
  (default ``"default"``), ``instance_id``; ``/query_by_hash`` takes ``seq_hashes`` (rolling sequence hashes,
  `kvmesh.core.hashing.sequence_hashes`; ``block_hash`` is the earlier drafts' alias) instead of
  ``token_ids``. The reply maps tenant → instance → ``{"longest_matched", "GPU", "CPU", "DISK", "DP"}``, in
  tokens.
* **Dynamo** (``python -m dynamo.indexer``): a body with ``model_name`` (and no ``model``). ``/query`` as
  above; ``/query_by_hash`` takes ``block_hashes``, Dynamo's *local* block hashes (signed or unsigned 64-bit).
  The reply is Dynamo's: ``{"scores": {instance: {dp_rank: tokens}}, "frequencies": [], "instances":
  {instance: {"longest_matched", "gpu", "cpu", "disk", "dp"}}}``, holders with a match only.

What the fields mean here:

* an **instance** is a kvmesh worker id, a **DP rank** its data-parallel rank; ``longest_matched`` is the
  longest leading run of the prompt's full blocks any rank of the instance holds, on any tier, in tokens;
  ``DP`` gives each rank's.
* the **media** are cumulative, as Dynamo reports them: ``GPU`` counts the leading run's blocks held on the
  GPU, ``CPU`` those on the GPU or on a CPU tier (``CPU``, ``CPU_PINNED``, ``HOST…``), ``DISK`` those on any
  tier (every other medium is a disk-class tier), so ``DISK`` equals ``longest_matched``; each in tokens, the
  best rank of the instance. Each block counts on its fastest tier (`kvmesh.core.state.HolderMatch.tiers`),
  so a GPU block behind a CPU-only block still counts for ``GPU``: the figures are tokens *available* per
  tier within the matched prefix, which equals the per-tier prefix whenever the faster tiers hold a prefix
  of what the slower ones hold (the usual offload layout).
* a **tenant** is a name a `/register` call gave an instance (``tenant_id``); every other instance is in
  ``"default"``. kvmesh isolates tenants' caches by ``cache_salt`` (mixed into the hashes), not by tenant.
* ``block_size`` scopes the query: only instances of that block size answer (others are not listed); the
  prompt is hashed at that size. Omitted (Dynamo): the model's most common block size.

Errors are ``{"error": "<message>"}`` (JSON) with the RFC implementations' statuses: 400 for a body that is
not JSON (Dynamo answers it in text; here JSON too) and, in the RFC dialect, for a missing or mistyped field;
422 for a missing or mistyped field in Dynamo's dialect (as Dynamo answers it); 404 for an unknown model
(``"no indexer for model=<m>"``, Dynamo's words), an unknown path, or an `/unregister` of nothing
registered; 405 for a wrong method; 503 while the index is not ready; 500 for anything unexpected.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final, TypeVar

import msgspec

from kvmesh.core import tables
from kvmesh.core.errors import RequestError, UnknownModelError
from kvmesh.core.state import HolderMatch, IndexState, MatchResult

__all__ = [
    "DEFAULT_TENANT",
    "ApiError",
    "QueryBody",
    "RegisterBody",
    "UnregisterBody",
    "answer_query",
    "decode_body",
    "decode_query",
    "media_tokens",
]

T = TypeVar("T")

DEFAULT_TENANT: Final[str] = "default"
MAX_U64: Final[int] = 2**64 - 1


class ApiError(Exception):
    """An error answer: HTTP ``status`` and the ``{"error": message}`` body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class QueryBody(msgspec.Struct, kw_only=True, frozen=True):
    """``/query`` and ``/query_by_hash`` (either dialect); unknown fields are ignored."""

    model: str | None = None
    model_name: str | None = None
    """Dynamo's name of ``model`` (its presence, without ``model``, selects Dynamo's reply)."""
    token_ids: list[int] | None = None
    seq_hashes: list[int] | None = None
    block_hash: list[int] | None = None
    """Earlier drafts' name of ``seq_hashes``."""
    block_hashes: list[int] | None = None
    """Dynamo's ``/query_by_hash``: local block hashes (i64 or u64)."""
    lora_name: str | None = None
    lora_id: int | None = None
    tenant_id: str | None = None
    instance_id: str | int | None = None
    block_size: int | None = None
    cache_salt: str | None = None


class UnregisterBody(msgspec.Struct, kw_only=True, frozen=True):
    """``/unregister``: removes the registration of ``(instance_id, tenant_id, dp_rank)``."""

    type: str | None = None
    modelname: str | None = None
    model_name: str | None = None
    lora_name: str | None = None
    tenant_id: str | None = None
    instance_id: str | int | None = None
    block_size: int | None = None
    dp_rank: int | None = None


class RegisterBody(UnregisterBody, kw_only=True, frozen=True):
    """``/register``: a KV event publisher to ingest (RFC #1403; Dynamo's ``model_name`` accepted): the
    fields naming a registration, plus where its events are."""

    endpoint: str | None = None
    replay_endpoint: str | None = None
    additionalsalt: str | None = None


_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {
    t: msgspec.json.Decoder(t) for t in (QueryBody, RegisterBody, UnregisterBody)
}


def decode_query(body: bytes) -> tuple[QueryBody, tables.U32 | None]:
    """Decode a ``/query`` or ``/query_by_hash`` body: the body (its ``token_ids`` empty when returned apart) and
    its token ids as a uint32 array when they are a plain JSON array of integers.

    The ``token_ids`` member is found and its ids scanned in one compiled pass over the body
    (`kvmesh.core.tables.json_member_token_ids`: about 30 µs for a 4,096-token prompt here, where decoding them
    into Python ints took 85 – 95 µs); the rest of the body, with ``[]`` in the array's place, is decoded by
    msgspec as before. Any other form (or a body the scan refuses) is decoded whole by `decode_body`, which
    gives the same values and the same errors.

    Raises:
        ApiError: as `decode_body`.
    """
    decoded = tables.decode_scanning_token_ids(body, _decoders[QueryBody])
    if decoded is not None:
        return decoded
    return decode_body(body, QueryBody), None  # the whole body again, for its values or its error


def decode_body(body: bytes, kind: type[T], *, dynamo: bool | None = None) -> T:
    """Decode a JSON request body.

    Args:
        body: the request body.
        kind: `QueryBody`, `RegisterBody` or `UnregisterBody`.
        dynamo: whether a field error is answered as Dynamo does (422); None: decided by the body (a
            ``model_name`` field without ``model``).

    Raises:
        ApiError: 400 not JSON (or not an object); 400 (RFC) or 422 (Dynamo) a mistyped field.
    """
    try:
        out: T = _decoders[kind].decode(body)
    except msgspec.ValidationError as exc:
        if dynamo is None:
            dynamo = b'"model_name"' in body and b'"model"' not in body
        raise ApiError(
            422 if dynamo else 400, f"Failed to deserialize the JSON body into the target type: {exc}"
        ) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"Failed to parse the request body as JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "Failed to parse the request body as JSON: nested too deeply") from None
    return out


def _instance(value: str | int | None) -> str | None:
    return None if value is None else str(value)


class _Query(msgspec.Struct, frozen=True):
    model: str
    dynamo: bool
    tenant: str
    instance: str | None
    block_size: int | None


def _check_query(q: QueryBody, *, by_hash: bool) -> _Query:
    dynamo = q.model is None and q.model_name is not None
    status = 422 if dynamo else 400
    model = q.model if q.model is not None else q.model_name
    if not model:
        raise ApiError(status, "missing field `model`" + (" (or `model_name`)" if not dynamo else ""))
    if q.block_size is not None and q.block_size <= 0:
        raise ApiError(status, f"block_size must be greater than zero, got {q.block_size}")
    if q.block_size is None and not dynamo:
        raise ApiError(status, "missing field `block_size`")
    if q.lora_id is not None and q.lora_name is not None:
        raise ApiError(status, "lora_id is deprecated and cannot be used together with lora_name")
    if q.lora_id is not None:
        raise ApiError(status, "lora_id is not supported: send lora_name")
    if by_hash:
        given = [n for n in ("seq_hashes", "block_hash", "block_hashes") if getattr(q, n) is not None]
        if not given:
            raise ApiError(status, "missing field `block_hashes`" if dynamo else "missing field `seq_hashes`")
        if len(given) > 1:
            raise ApiError(status, f"send one of {', '.join(given)}, not more")
        if q.token_ids is not None:
            raise ApiError(status, "/query_by_hash takes hashes, not token_ids (use /query)")
    else:
        if q.token_ids is None:
            raise ApiError(status, "missing field `token_ids`")
        if any(getattr(q, n) is not None for n in ("seq_hashes", "block_hash", "block_hashes")):
            raise ApiError(status, "/query takes token_ids, not hashes (use /query_by_hash)")
    tenant = q.tenant_id or DEFAULT_TENANT
    return _Query(model, dynamo, tenant, _instance(q.instance_id), q.block_size)


def _match(
    state: IndexState, q: QueryBody, spec: _Query, *, by_hash: bool, tokens: tables.U32 | None = None
) -> MatchResult:
    try:
        if not by_hash:
            ids = tokens if tokens is not None else q.token_ids
            assert ids is not None
            return state.match(spec.model, ids, lora_name=q.lora_name, cache_salt=q.cache_salt)
        if q.block_hashes is not None:  # Dynamo: local hashes, i64 or u64
            local = _u64(q.block_hashes, "block_hashes", 422 if spec.dynamo else 400)
            return state.match_local_hashes(spec.model, local, block_size=spec.block_size)
        seq = q.seq_hashes if q.seq_hashes is not None else q.block_hash
        assert seq is not None
        return state.match_sequence_hashes(spec.model, seq, block_size=spec.block_size)
    except UnknownModelError:
        raise ApiError(404, f"no indexer for model={spec.model}") from None
    except RequestError as exc:
        raise ApiError(422 if spec.dynamo else 400, str(exc)) from None


def _u64(values: Sequence[int], name: str, status: int) -> list[int]:
    out = []
    for i, v in enumerate(values):
        if not -(2**63) <= v <= MAX_U64:
            raise ApiError(status, f"{name}[{i}] is not a 64-bit integer: {v}")
        out.append(v & MAX_U64)
    return out


def media_tokens(c: HolderMatch) -> tuple[int, int, int]:
    """The cumulative ``(GPU, CPU, DISK)`` tokens of one holder's match (see the module docstring)."""
    bs = c.block_size
    if c.tiers is None:
        n = c.overlap_blocks * bs
        return n, n, n
    gpu = cpu = 0
    for tier, blocks in c.tiers.items():
        if tier == "GPU":
            gpu += blocks
        elif tier.startswith(("CPU", "HOST")):
            cpu += blocks
    return gpu * bs, (gpu + cpu) * bs, c.overlap_blocks * bs


def answer_query(
    state: IndexState,
    body: bytes,
    *,
    by_hash: bool,
    tenants: dict[str, str],
) -> dict[str, Any]:
    """Answer a ``/query`` (``by_hash`` False) or ``/query_by_hash`` body from ``state``.

    Args:
        state: the router's index replica.
        body: the JSON request body.
        by_hash: whether it is ``/query_by_hash``.
        tenants: instance id → tenant for instances `/register` named a tenant for (others: ``"default"``).

    Returns:
        the reply object (RFC: ``{tenant: {instance: {...}}}``; Dynamo: ``{"scores", "frequencies",
        "instances"}``).

    Raises:
        ApiError: 400/422 a bad body, 404 an unknown model.
    """
    q, scanned = decode_query(body)
    spec = _check_query(q, by_hash=by_hash)
    result = _match(state, q, spec, by_hash=by_hash, tokens=scanned)
    bs = spec.block_size if spec.block_size is not None else result.block_size
    tenant, instance = spec.tenant, spec.instance
    cands = [
        c
        for c in result.candidates
        if c.block_size == bs
        and (instance is None or c.worker_id == instance)
        and (tenants.get(c.worker_id, DEFAULT_TENANT) if tenants else DEFAULT_TENANT) == tenant
    ]
    if spec.dynamo:
        return _dynamo_reply(cands)
    instances: dict[str, dict[str, Any]] = {}
    for c in cands:
        tokens = c.overlap_blocks * c.block_size
        gpu, cpu, disk = (tokens, tokens, tokens) if c.tiers is None else media_tokens(c)
        entry = instances.get(c.worker_id)
        if entry is None:
            instances[c.worker_id] = {
                "longest_matched": tokens,
                "GPU": gpu,
                "CPU": cpu,
                "DISK": disk,
                "DP": {str(c.dp_rank): tokens},
            }
            continue
        entry["DP"][str(c.dp_rank)] = tokens
        entry["longest_matched"] = max(entry["longest_matched"], tokens)
        entry["GPU"] = max(entry["GPU"], gpu)
        entry["CPU"] = max(entry["CPU"], cpu)
        entry["DISK"] = max(entry["DISK"], disk)
    return {tenant: instances}


def _dynamo_reply(cands: Iterable[HolderMatch]) -> dict[str, Any]:
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict[str, Any]] = {}
    for c in cands:
        if not c.overlap_blocks:
            continue
        tokens = c.overlap_blocks * c.block_size
        scores.setdefault(c.worker_id, {})[str(c.dp_rank)] = tokens
        entry = instances.get(c.worker_id)
        if entry is None:
            entry = instances[c.worker_id] = {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0}
        entry["dp"][str(c.dp_rank)] = tokens
        entry["longest_matched"] = max(entry["longest_matched"], tokens)
        for name, n in zip(("gpu", "cpu", "disk"), media_tokens(c), strict=True):
            entry[name] = max(entry[name], n)
    return {"scores": scores, "frequencies": [], "instances": instances}
