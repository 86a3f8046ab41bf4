"""Match a route request against the router's local index replica: by its local block hashes (a pre-hashed
request, `kvmesh.core.state.IndexState.match_local_hashes`), by its sequence hashes
(`IndexState.match_sequence_hashes`) or by its token ids (`IndexState.match`).

The pre-hashed answer is the same `MatchResult` as `IndexState.match` gives for the tokens those hashes came
from, for the holders of the hashes' block size; holders of any other block size count no overlap.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final

from kvmesh.core.hashing import iter_prefix_keys
from kvmesh.core.protocol import RouteRequest
from kvmesh.core.state import IndexState, MatchResult

__all__ = ["CHAIN_CHUNK", "iter_prefix_keys_of", "match_local_hashes", "match_request_locally"]

CHAIN_CHUNK: Final[int] = 16
"""Local hashes chained into prefix keys per call of `kvmesh.core.hashing.prefix_keys`."""


def iter_prefix_keys_of(local_hashes: Sequence[int], chunk: int = CHAIN_CHUNK) -> Iterator[int]:
    """`kvmesh.core.hashing.iter_prefix_keys` (the index prefix keys of ``local_hashes``, ``chunk`` at a time)."""
    return iter_prefix_keys(local_hashes, chunk)


def match_local_hashes(
    state: IndexState, model: str, local_hashes: Sequence[int], *, block_size: int | None = None
) -> MatchResult:
    """`IndexState.match_local_hashes` of a replica's state.

    Raises:
        UnknownModelError: no worker of that model is known.
    """
    return state.match_local_hashes(model, local_hashes, block_size=block_size)


def match_request_locally(state: IndexState, parsed: RouteRequest) -> MatchResult:
    """Match a route request against a local index: its sequence hashes (`IndexState.match_sequence_hashes`),
    its local block hashes (`match_local_hashes`) or its token ids (`IndexState.match`, which hashes them under the request's LoRA and salt).

    Raises:
        UnknownModelError: no worker of the model is known.
        RequestError: a token id is out of range.
    """
    if parsed.seq_hashes is not None:
        return state.match_sequence_hashes(parsed.model, parsed.seq_hashes, block_size=parsed.block_size)
    if parsed.block_hashes is not None:
        return match_local_hashes(state, parsed.model, parsed.block_hashes, block_size=parsed.block_size)
    return state.match(
        parsed.model, parsed.token_ids, lora_name=parsed.lora_name, cache_salt=parsed.cache_salt
    )
