"""Content keys of KV blocks: local block hashes and position-aware sequence hashes.

kvmesh never matches on engine block hashes (they are seeded per process in vLLM before 0.29 and take
different digest bytes in SGLang). It computes its own keys from the ``token_ids`` of each BlockStored:

* **local block hash** — XXH3-64 over the block's token ids packed as little-endian uint32, seed 1337.
  This is NVIDIA Dynamo's ``LocalBlockHash``, so keys interoperate: ``tokens 0..7``, block size 4 →
  ``[9143094415614847814, 12124091508212882195]``.
* **sequence hash** — ``seq[0] = local[0]``, ``seq[i] = XXH3-64(le_u64(seq[i-1]) ‖ le_u64(local[i]), seed 1337)``:
  a key for the whole prefix up to and including block *i* (Dynamo's ``SequenceHash``).

Isolation rules (what changes the KV cache must change the key):

* **LoRA** — the adapter name replaces the seed of every block's local hash:
  ``seed = XXH3-64(b"kvmesh-lora\\x00" + name, seed=1337)``; the base model keeps 1337, so base-model keys
  stay Dynamo-compatible. Engines that send only a numeric ``lora_id`` (vLLM < 0.14) are keyed by the name
  ``"lora-id:<n>"``, which never equals a real adapter name a route request could carry.
* **cache_salt** — mixed into the local hash of block 0 only (``tokens ‖ b"\\x00kvmesh-salt\\x00" ‖ salt``),
  as vLLM puts the salt in block 0's extra keys; the chain carries it into every later sequence hash.
* **multimodal inputs** — per-block extra bytes (the engine's multimodal identifiers, encoded by the caller)
  are appended to that block's token bytes, so different images behind the same placeholder tokens differ.

Only full blocks are keys: a trailing partial block is ignored.

This module is the reference, in Python over ``xxhash``; a router hashes prompts with the compiled
equivalent, `kvmesh.core.tables.prompt_keys` (every XXH3 length class, checked against this module and
``xxhash`` in ``tests/core/test_prompt_kernels.py``).

**Index prefix keys** (`prefix_keys`, `prompt_prefix_keys`) — what `kvmesh.core.index.PrefixIndex` stores
and looks up — are exactly the sequence hashes above, full 64 bits: a gateway, a Dynamo component or a
Mooncake RFC #1527 publisher that hands kvmesh a standard sequence hash names the same prefix the index
holds. (Snapshot formats 2 and 3 kept a 60-bit chain of kvmesh's own, ``key[i] = XXH3(key[i-1] ‖ local[i])
& (2**60 - 1)``, to keep keys small Python ints; the compact index holds keys in uint64 arrays, so nothing
is gained by it any more.) Collisions: with *n* distinct prefixes indexed, the chance that any two share a
key is about ``n² / 2**65`` (2.7·10⁻⁸ at 1M prefixes, 2.7·10⁻⁶ at 10M); the chance that one looked-up prompt
block falsely matches some indexed prefix is ``n / 2**64``.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Final, NewType

import xxhash

from kvmesh.core.errors import RequestError

LocalBlockHash = NewType("LocalBlockHash", int)
SequenceHash = NewType("SequenceHash", int)

SEED: Final[int] = 1337
"""XXH3 seed of the base model, as in NVIDIA Dynamo."""

MAX_TOKEN_ID: Final[int] = 2**32 - 1

_xxh3 = xxhash.xxh3_64_intdigest
_SALT_TAG: Final[bytes] = b"\x00kvmesh-salt\x00"
_LORA_TAG: Final[bytes] = b"kvmesh-lora\x00"
_BIG_ENDIAN: Final[bool] = sys.byteorder == "big"
_pack_pair = struct.Struct("<QQ").pack
"""``le_u64(a) ‖ le_u64(b)``: the chaining input (one call instead of two ``to_bytes`` and a concatenation)."""

KEY_BITS: Final[int] = 64
"""Bits of an index prefix key (`prefix_keys`: the standard sequence hash)."""


def lora_seed(lora_name: str | None) -> int:
    """Return the XXH3 seed for blocks computed under a LoRA adapter.

    Args:
        lora_name: the adapter name as the engine reports it (``lora_name``), or None for the base model.

    Returns:
        1337 for the base model, else a 64-bit seed derived from the name.
    """
    if not lora_name:
        return SEED
    return _xxh3(_LORA_TAG + lora_name.encode("utf-8"), seed=SEED)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as little-endian uint32.

    Raises:
        RequestError: a token id is not an int in ``[0, 2**32)`` (``field="token_ids"``).
    """
    try:
        packed = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise RequestError(f"token ids must be integers in [0, 2^32): {exc}", field="token_ids") from exc
    if packed.itemsize != 4:  # pragma: no cover - no supported platform has a 2- or 8-byte unsigned int
        raise RuntimeError("array('I') is not 32-bit here")
    if _BIG_ENDIAN:  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def local_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    block_extras: Sequence[bytes | None] | None = None,
) -> list[int]:
    """Compute the local hash of every full block of ``token_ids``.

    Args:
        token_ids: token ids, each in ``[0, 2**32)``; length in tokens.
        block_size: tokens per block (> 0).
        lora_name: LoRA adapter name (seeds every block), or None for the base model.
        cache_salt: tenant salt, mixed into block 0 only; pass it only when ``token_ids`` starts at the
            first block of the sequence.
        block_extras: per-block extra bytes (multimodal identifiers), one entry per full block or shorter;
            None entries add nothing.

    Returns:
        ``len(token_ids) // block_size`` 64-bit local hashes; a trailing partial block is dropped.

    Raises:
        RequestError: a token id is out of range or not an int.
        ValueError: ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    data = pack_tokens(token_ids)  # every token is validated, the dropped partial block's too
    seed = lora_seed(lora_name)
    step = block_size * 4
    view = memoryview(data)
    out = [_xxh3(view[i * step : (i + 1) * step], seed=seed) for i in range(n_blocks)]
    if n_blocks and (cache_salt or block_extras):
        for i in range(n_blocks):
            extra = block_extras[i] if block_extras is not None and i < len(block_extras) else None
            salt = cache_salt if i == 0 else None
            if extra is None and not salt:
                continue
            buf = bytes(view[i * step : (i + 1) * step])
            if salt:
                buf += _SALT_TAG + salt.encode("utf-8")
            if extra is not None:
                buf += b"\x00kvmesh-mm\x00" + extra
            out[i] = _xxh3(buf, seed=seed)
    return out


def chain_hash(parent: int, local: int) -> int:
    """Return the sequence hash of a block whose parent's sequence hash is ``parent``."""
    return _xxh3(_pack_pair(parent, local), seed=SEED)


def sequence_hashes(local_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """Chain local hashes into sequence hashes.

    Args:
        local_hashes: local hashes of consecutive blocks.
        parent: sequence hash of the block before the first one, or None when the first is block 0.

    Returns:
        one sequence hash per local hash.
    """
    out: list[int] = []
    if not local_hashes:
        return out
    append = out.append
    locals_ = iter(local_hashes)
    prev = next(locals_) if parent is None else _xxh3(_pack_pair(parent, next(locals_)), seed=SEED)
    append(prev)
    for local in locals_:
        prev = _xxh3(_pack_pair(prev, local), seed=SEED)
        append(prev)
    return out


def prompt_sequence_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Return the sequence hashes of a prompt's full blocks, as a router looks them up.

    Raises:
        RequestError: a token id is out of range or not an int.
    """
    return sequence_hashes(
        local_block_hashes(token_ids, block_size, lora_name=lora_name, cache_salt=cache_salt)
    )


def prefix_keys(local_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """Chain local hashes into the index's prefix keys: the standard sequence hashes (`sequence_hashes`).

    Args:
        local_hashes: local hashes of consecutive blocks.
        parent: prefix key (sequence hash) of the block before the first one, or None when the first is
            block 0.

    Returns:
        one unsigned 64-bit key per local hash.
    """
    return sequence_hashes(local_hashes, parent)


def iter_prefix_keys(local_hashes: Sequence[int], chunk: int = 16) -> Iterator[int]:
    """Yield `prefix_keys` ``(local_hashes)``, computed ``chunk`` blocks at a time (each chunk chained from the
    last key of the one before), so a match that stops early leaves the later chunks unhashed.

    Args:
        local_hashes: local hashes of a prompt's full blocks, block 0 first (Dynamo's ``LocalBlockHash``).
        chunk: blocks hashed per call of `prefix_keys`.
    """
    parent: int | None = None
    for i in range(0, len(local_hashes), chunk):
        keys = prefix_keys(local_hashes[i : i + chunk], parent)
        yield from keys
        parent = keys[-1]


def prompt_prefix_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Return the index prefix keys of a prompt's full blocks, as the index looks them up.

    Raises:
        RequestError: a token id is out of range or not an int.
        ValueError: ``block_size`` is not positive.
    """
    return prefix_keys(local_block_hashes(token_ids, block_size, lora_name=lora_name, cache_salt=cache_salt))


def iter_prompt_prefix_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> Iterator[int]:
    """Yield the same keys as `prompt_prefix_keys`, one block at a time.

    A match walks the prompt block by block and stops at the first block no holder has; hashing lazily
    spares the blocks after it (for a prompt whose cached prefix ends early, most of the hashing). Every
    token id is still checked, eagerly, when this is called.

    Raises:
        RequestError: a token id is out of range or not an int.
        ValueError: ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = pack_tokens(token_ids)  # checks every token id now
    n_blocks = len(token_ids) // block_size
    if not n_blocks:
        return iter(())
    # Block 0 carries the salt: take its local hash from `local_block_hashes`, the one place that rule lives.
    first = local_block_hashes(token_ids[:block_size], block_size, lora_name=lora_name, cache_salt=cache_salt)
    return _iter_prefix_keys(memoryview(data), n_blocks, block_size * 4, lora_seed(lora_name), first[0])


def _iter_prefix_keys(view: memoryview, n_blocks: int, step: int, seed: int, first: int) -> Iterator[int]:
    xxh3, pack, chain_seed = _xxh3, _pack_pair, SEED
    prev = first
    yield prev
    for i in range(1, n_blocks):
        prev = xxh3(pack(prev, xxh3(view[i * step : (i + 1) * step], seed)), chain_seed)
        yield prev
