"""Match a pre-hashed route request (its local block hashes) against the router's local index replica.

`kvmesh.core.state.IndexState.match` takes token ids and hashes them itself; a pre-hashed request
(`kvmesh.core.protocol.RouteRequest.block_hashes`) arrives with Dynamo's local block hashes already made,
so the router only chains them into the index's prefix keys (`kvmesh.core.hashing.prefix_keys`, a chunk at
a time so the chain stops soon after the first block no holder has) and walks the index.

The answer is the same `MatchResult` as `IndexState.match` gives for the tokens those hashes came from,
for the holders of the hashes' block size; holders of any other block size count no overlap (their keys
are of other blocks).

This reads `IndexState`'s per-model indexes and holder health (its private ``_indexes``,
``_is_removed``, ``_holder_health``): `IndexState` has no match by local hashes yet; once it has one, this
module should call it instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final

from kvmesh.core.errors import UnknownModelError
from kvmesh.core.hashing import prefix_keys
from kvmesh.core.index import Holder, PrefixIndex
from kvmesh.core.protocol import RouteRequest
from kvmesh.core.state import HolderMatch, IndexState, MatchResult

__all__ = ["CHAIN_CHUNK", "iter_prefix_keys_of", "match_local_hashes", "match_request_locally"]

CHAIN_CHUNK: Final[int] = 16
"""Local hashes chained into prefix keys per call of `kvmesh.core.hashing.prefix_keys`."""


def iter_prefix_keys_of(local_hashes: Sequence[int], chunk: int = CHAIN_CHUNK) -> Iterator[int]:
    """Yield the index prefix keys of ``local_hashes`` (block 0 first), computed ``chunk`` blocks at a time.

    The keys are `kvmesh.core.hashing.prefix_keys` ``(local_hashes)``'s, each chunk chained from the last key
    of the one before (its ``parent``); a match that stops early leaves the later chunks unhashed.
    """
    parent: int | None = None
    for i in range(0, len(local_hashes), chunk):
        keys = prefix_keys(local_hashes[i : i + chunk], parent)
        yield from keys
        parent = keys[-1]


def match_local_hashes(
    state: IndexState, model: str, local_hashes: Sequence[int], *, block_size: int | None = None
) -> MatchResult:
    """Compute every holder's overlap with a prompt given as its local block hashes.

    Args:
        state: the index state (a router's local replica).
        model: model name as the workers registered it.
        local_hashes: the local hash of each full block of the prompt, block 0 first (LoRA and cache salt
            mixed in by the caller), each in ``[0, 2**64)``.
        block_size: the tokens per block the hashes were computed with; None: the model's block size with
            the most holders (as `IndexState.match` chooses it).

    Returns:
        every live holder of the model, sorted by (worker, rank): the holders of ``block_size`` with their
        overlap, the others with none; ``block_size`` of the result is the hashes' (0 when None was given and
        no holder's size is known), ``prompt_blocks`` is ``len(local_hashes)``.

    Raises:
        UnknownModelError: no worker of that model is known.
    """
    by_size = state._indexes.get(model)
    live: dict[int, PrefixIndex] = {
        bs: ix
        for bs, ix in (by_size or {}).items()
        if any(not state._is_removed(h.worker_id) for h in ix.holders())
    }
    if not live:
        raise UnknownModelError(model)
    sized = {bs: ix for bs, ix in live.items() if bs}
    if block_size is None:
        block_size = max(sized.items(), key=lambda kv: (len(kv[1].holders()), -kv[0]))[0] if sized else 0
    found: dict[Holder, HolderMatch] = {}
    index = sized.get(block_size)
    if index is not None:
        overlaps = index.match_tiers(iter_prefix_keys_of(local_hashes))
        for h in index.holders():
            if state._is_removed(h.worker_id):
                continue
            o = overlaps.get(h)
            blocks = o.blocks if o is not None else 0
            found[h] = HolderMatch(
                worker_id=h.worker_id,
                dp_rank=h.dp_rank,
                overlap_blocks=blocks,
                cached_blocks=index.block_count(h),
                tiers=o.tiers if o is not None else None,
                block_size=block_size,
                overlap_tokens=blocks * block_size,
                health=state._holder_health(h),
            )
    for bs, other in sorted(live.items()):
        if other is index:
            continue
        for h in other.holders():
            if h not in found and not state._is_removed(h.worker_id):
                found[h] = HolderMatch(
                    worker_id=h.worker_id,
                    dp_rank=h.dp_rank,
                    overlap_blocks=0,
                    cached_blocks=other.block_count(h) if bs else 0,
                    block_size=bs,
                    health=state._holder_health(h),
                )
    return MatchResult(
        index_seq=state.applied_seq,
        block_size=block_size,
        prompt_blocks=len(local_hashes),
        candidates=tuple(found[h] for h in sorted(found)),
    )


def match_request_locally(state: IndexState, parsed: RouteRequest) -> MatchResult:
    """Match a route request against a local index: its local block hashes (`match_local_hashes`) or its
    token ids (`IndexState.match`, which hashes them under the request's LoRA and salt).

    Raises:
        UnknownModelError: no worker of the model is known.
        RequestError: a token id is out of range.
    """
    if parsed.block_hashes is not None:
        return match_local_hashes(state, parsed.model, parsed.block_hashes, block_size=parsed.block_size)
    return state.match(
        parsed.model, parsed.token_ids, lora_name=parsed.lora_name, cache_salt=parsed.cache_salt
    )
