"""Mooncake request traces: load them and turn requests into token ids (pure apart from reading a file).

A Mooncake trace (kvcache-ai/Mooncake, FAST'25 release) is JSON Lines, one request per line:
``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [id, …]}`` where each
id stands for one 512-token block of the prompt, remapped for privacy so that two requests share a prefix
exactly when their ``hash_ids`` share a leading run. `expand_tokens` maps every id to 512 deterministic
token ids, so equal ids give equal tokens and shared id prefixes give shared token prefixes.

The package ships the first 1,000 requests of the conversation trace (`default_trace_path`; see
``kvmesh/sim/data/README.md``).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Final

import msgspec
import xxhash

from kvmesh.core.errors import KvmeshError

__all__ = [
    "DEFAULT_TRACE_NAME",
    "TRACE_BLOCK_TOKENS",
    "VOCAB_SIZE",
    "TraceFormatError",
    "TraceRequest",
    "default_trace_path",
    "expand_tokens",
    "load_trace",
]

TRACE_BLOCK_TOKENS: Final[int] = 512
"""Tokens per Mooncake ``hash_ids`` entry."""

VOCAB_SIZE: Final[int] = 32000
"""Token ids produced by `expand_tokens` lie in ``[0, VOCAB_SIZE)``."""

DEFAULT_TRACE_NAME: Final[str] = "mooncake_conversation_1000.jsonl"
"""File name of the shipped trace inside ``kvmesh/sim/data``."""

_U64_MAX: Final[int] = 2**64 - 1
_TOKENS_PER_DIGEST: Final[int] = 4
"""One xxh3-128 digest yields four little-endian uint32 words, one token each."""
_PACK_KEY: Final = struct.Struct("<QQQ").pack


class TraceFormatError(KvmeshError, ValueError):
    """A trace line that is not a valid Mooncake request.

    Attributes:
        path: the trace file.
        line: 1-based line number.
        reason: what was wrong.
    """

    def __init__(self, path: Path, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    """One request of a Mooncake trace."""

    timestamp_ms: int
    """Arrival time in milliseconds from the start of the trace."""
    input_length: int
    """Prompt length in tokens."""
    output_length: int
    """Generated tokens."""
    hash_ids: tuple[int, ...]
    """One id per 512-token prompt block; the last block may be partial."""


class _Row(msgspec.Struct, forbid_unknown_fields=False):
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


_decode_row = msgspec.json.Decoder(_Row).decode


def default_trace_path() -> Path:
    """Return the path of the shipped trace (first 1,000 requests of Mooncake's conversation trace).

    Returns:
        A filesystem path to ``kvmesh/sim/data/mooncake_conversation_1000.jsonl``.
    """
    resource = resources.files("kvmesh.sim").joinpath("data").joinpath(DEFAULT_TRACE_NAME)
    return Path(str(resource))


def load_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSON Lines trace.

    Blank lines are skipped; unknown fields are ignored.

    Args:
        path: the ``.jsonl`` file.
        limit: read at most this many requests (None: all).

    Returns:
        The requests in file order.

    Raises:
        TraceFormatError: a line is not JSON, misses a field, has a wrong type, a negative length, or an
            ``input_length`` that does not fit in ``len(hash_ids)`` 512-token blocks.
        OSError: the file cannot be read.
    """
    path = Path(path)
    out: list[TraceRequest] = []
    if limit is not None and limit <= 0:
        return out
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = _decode_row(raw)
            except msgspec.DecodeError as exc:
                raise TraceFormatError(path, lineno, str(exc)) from exc
            if row.input_length < 0 or row.output_length < 0:
                raise TraceFormatError(path, lineno, "negative input_length or output_length")
            if row.input_length > len(row.hash_ids) * TRACE_BLOCK_TOKENS:
                raise TraceFormatError(
                    path,
                    lineno,
                    f"input_length {row.input_length} exceeds {len(row.hash_ids)} blocks of "
                    f"{TRACE_BLOCK_TOKENS} tokens",
                )
            out.append(
                TraceRequest(
                    timestamp_ms=row.timestamp,
                    input_length=row.input_length,
                    output_length=row.output_length,
                    hash_ids=tuple(row.hash_ids),
                )
            )
            if limit is not None and len(out) >= limit:
                break
    return out


def expand_tokens(
    req: TraceRequest, *, trace_block_tokens: int = TRACE_BLOCK_TOKENS, seed: int = 0
) -> list[int]:
    """Turn a trace request into its prompt's token ids.

    Each hash id becomes ``trace_block_tokens`` token ids that depend only on ``(seed, hash id)``:
    token ``j`` of id ``h`` is word ``j % 4`` of ``xxh3_128(pack("<QQQ", seed, h, j // 4))`` (little-endian
    uint32) modulo 32,000, so the expansion is the same in every process, platform and Python version.
    The concatenation is cut to ``input_length`` tokens (the last block may be partial).

    Args:
        req: the request.
        trace_block_tokens: tokens per hash id (512 in Mooncake traces).
        seed: expansion seed in [0, 2**64); different seeds give unrelated token ids.

    Returns:
        ``input_length`` token ids in ``[0, 32000)``.

    Raises:
        ValueError: ``trace_block_tokens`` <= 0, ``seed`` or a hash id outside [0, 2**64), or
            ``input_length`` larger than ``len(hash_ids) × trace_block_tokens``.
    """
    if trace_block_tokens <= 0:
        raise ValueError(f"trace_block_tokens must be > 0, got {trace_block_tokens}")
    if not 0 <= seed <= _U64_MAX:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    capacity = len(req.hash_ids) * trace_block_tokens
    if req.input_length > capacity:
        raise ValueError(
            f"input_length {req.input_length} exceeds {len(req.hash_ids)} blocks "
            f"of {trace_block_tokens} tokens"
        )
    tokens: list[int] = []
    remaining = req.input_length
    for hash_id in req.hash_ids:
        if remaining <= 0:
            break
        block = _block_tokens(seed, hash_id, trace_block_tokens)
        tokens.extend(block[:remaining] if remaining < trace_block_tokens else block)
        remaining -= trace_block_tokens
    return tokens


@functools.lru_cache(maxsize=16384)
def _block_tokens(seed: int, hash_id: int, n: int) -> tuple[int, ...]:
    """Return the ``n`` token ids of one trace block (cached: ids repeat across requests)."""
    if not 0 <= hash_id <= _U64_MAX:
        raise ValueError(f"hash id must be in [0, 2**64), got {hash_id}")
    digest = xxhash.xxh3_128_digest
    raw = b"".join([digest(_PACK_KEY(seed, hash_id, chunk)) for chunk in range(-(-n // _TOKENS_PER_DIGEST))])
    return tuple([word % VOCAB_SIZE for word in struct.unpack_from(f"<{n}I", raw)])
