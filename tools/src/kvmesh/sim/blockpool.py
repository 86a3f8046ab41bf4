"""A model of vLLM v1's prefix-caching KV block pool that emits KV events exactly as vLLM does (pure).

`BlockPool` reproduces what ``vllm/v1/core/block_pool.py`` (``BlockPool``) and
``vllm/v1/core/kv_cache_manager.py`` (``KVCacheManager``) do for a single full-attention KV-cache group
with prefix caching and KV events enabled, as of vLLM 0.33:

* a fixed number of blocks of ``block_size`` tokens; free blocks sit in an LRU *free queue*: allocation
  pops from the head; freeing a request walks its blocks in reverse order, puts blocks that carry no hash
  (the trailing partial block) at the head and cached blocks at the tail, so the last blocks of a prompt
  are evicted before its first ones;
* block hashes are chained: the hash of block ``i`` covers the hash of block ``i-1`` (a per-pool random
  ``NONE_HASH`` for block 0), the block's tokens and its extra keys (LoRA name on every block, cache salt
  on block 0 only), so a different ``seed`` (vLLM: a different process without ``PYTHONHASHSEED``), LoRA or
  salt gives different hashes for the same tokens;
* a prompt hits the leading run of full blocks whose hashes are cached, but never its last token (vLLM
  recomputes at least one token to get logits, so a fully cached prompt of ``n`` full blocks hits
  ``n - 1``);
* events: ``BlockStored`` once per step for the blocks that became full in that step, ``BlockRemoved``
  (one hash each) lazily when a free-but-cached block is reallocated, ``AllBlocksCleared`` on a successful
  prefix-cache reset; freeing a request emits nothing. `BlockPool.take_events` drains them (one engine
  step = one batch).

Like vLLM, the cache does not deduplicate: when a fully cached prompt recomputes its last block, the new
physical block gets the same hash and a second ``BlockStored`` for that hash is emitted; when either copy
is later evicted a ``BlockRemoved`` for the hash is emitted although the other copy may still be cached.

Hashes: internally a 32-byte digest per block (two seeded xxh3-128 digests, standing in for vLLM's
SHA-256); on the wire (`HashForm`) ``"int"`` = the low 64 bits big-endian as an unsigned int (vLLM 0.10.2+
default, ``int.from_bytes(digest, "big") & (2**64 - 1)``), ``"bytes"`` = the 32-byte digest
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), ``"signed"`` = the same 64 bits as a signed int64 (vLLM <
0.10.2's builtin ``hash()``).

Not modelled: the null block (all ``num_blocks`` are usable), sliding-window / Mamba / hybrid KV-cache
groups, multimodal or prompt-embeds extra keys, chunked prefill, scheduling, preemption and recompute,
speculative decoding, KV connectors and offloading, ``kv_cache_report_mode="full"``, watermarks. Events
leave ``lora_id`` (vLLM: the adapter's int id), ``session_id`` and the SGLang-only ``cache_salt`` field
None. The pool has no clock and does no I/O.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

import xxhash

from kvmesh.core.errors import KvmeshError
from kvmesh.core.wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, KVEvent

__all__ = [
    "MEDIUM_GPU",
    "Admission",
    "BlockPool",
    "ExternalBlockHash",
    "HashForm",
    "KVEvent",
    "PoolExhaustedError",
    "PoolStats",
]

HashForm: TypeAlias = Literal["int", "bytes", "signed"]
"""How block hashes appear in events: unsigned 64-bit int, 32-byte digest, or signed 64-bit int."""

ExternalBlockHash: TypeAlias = EngineHash
"""A block hash as it appears in an event (vLLM's ``ExternalBlockHash``): an int or 32 bytes."""

MEDIUM_GPU: Final[str] = "GPU"
"""The ``medium`` of every event of the GPU block pool (vLLM's ``MEDIUM_GPU``)."""

KV_CACHE_SPEC_KIND: Final[str] = "full_attention"
"""``kv_cache_spec_kind`` of every BlockStored (the only KV-cache group kind modelled)."""

GROUP_IDX: Final[int] = 0
"""``group_idx`` of every event (one KV-cache group)."""

_U64_MASK: Final[int] = 2**64 - 1
_DIGEST_SALT: Final[int] = 0x9E3779B97F4A7C15
"""Seed offset of the second xxh3-128 half of a 32-byte digest."""
_NONE_HASH_INPUT: Final[bytes] = b"kvmesh-sim-none-hash"
_TAG_LORA: Final[bytes] = b"L"
_TAG_SALT: Final[bytes] = b"S"
_HASH_FORMS: Final[frozenset[str]] = frozenset({"int", "bytes", "signed"})


class PoolExhaustedError(KvmeshError, RuntimeError):
    """The pool has too few free (or evictable) blocks for a request; nothing was changed.

    vLLM would leave such a request waiting in its queue; the simulator raises instead.

    Attributes:
        request_id: the request that did not fit.
        needed_blocks: blocks the operation would have had to take from the free queue.
        available_blocks: blocks that could be taken (free, not hit by the request itself).
    """

    def __init__(self, request_id: str, *, needed_blocks: int, available_blocks: int) -> None:
        super().__init__(
            f"request {request_id!r} needs {needed_blocks} new KV blocks but only {available_blocks} "
            "are free or evictable"
        )
        self.request_id = request_id
        self.needed_blocks = needed_blocks
        self.available_blocks = available_blocks


@dataclass(frozen=True, slots=True, kw_only=True)
class Admission:
    """What `BlockPool.start` did for one request's prompt."""

    request_id: str
    """The request's id."""
    prompt_tokens: int
    """Prompt length in tokens."""
    cached_tokens: int
    """Prompt tokens served from the prefix cache: ``num_cached_blocks × block_size``."""
    num_cached_blocks: int
    """Leading full blocks that hit the cache (at most ``(prompt_tokens - 1) // block_size``)."""
    num_full_blocks: int
    """Full blocks of the prompt: ``prompt_tokens // block_size``; the partial tail is not counted."""
    num_prompt_blocks: int
    """Blocks the prompt occupies including a partial tail: ``ceil(prompt_tokens / block_size)``."""
    num_new_blocks: int
    """Blocks taken from the free queue: ``num_prompt_blocks - num_cached_blocks``."""
    num_evicted: int
    """Cached blocks evicted to make room (one ``BlockRemoved`` each)."""
    block_hashes: tuple[ExternalBlockHash, ...]
    """Engine hashes of the prompt's full blocks, in the pool's `HashForm`; length ``num_full_blocks``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolStats:
    """A snapshot of a `BlockPool`'s occupancy and lifetime counters."""

    num_blocks: int
    """Blocks in the pool."""
    block_size: int
    """Tokens per block."""
    free_blocks: int
    """Blocks in the free queue (unused, possibly still cached)."""
    cached_blocks: int
    """Blocks that carry a hash (in use or free); a hash may be held by more than one block."""
    cached_free_blocks: int
    """Free blocks that still carry a hash (evictable cache)."""
    running_requests: int
    """Requests started and not finished."""
    requests: int
    """Requests started since creation."""
    prompt_tokens: int
    """Prompt tokens of all started requests."""
    hit_tokens: int
    """Prompt tokens served from the cache, summed over started requests."""
    hit_blocks: int
    """Prompt blocks served from the cache, summed over started requests."""
    stored_blocks: int
    """Block hashes announced in BlockStored events."""
    evictions: int
    """Cached blocks evicted (BlockRemoved events)."""
    resets: int
    """Successful prefix-cache resets (AllBlocksCleared events)."""


@dataclass(slots=True, kw_only=True)
class _Request:
    request_id: str
    token_ids: list[int]
    lora_name: str | None
    cache_salt: str | None
    digests: list[bytes]
    """Internal digests of every full block of ``token_ids`` (vLLM's ``request.block_hashes``)."""
    blocks: list[int] = field(default_factory=list)
    """Block ids, one per ``block_size`` tokens (the last may be partial)."""
    num_cached_blocks: int = 0
    """Leading blocks already hashed and in the cache (vLLM's ``num_cached_block[request_id]``)."""


class BlockPool:
    """A vLLM-v1-style prefix-caching KV block pool for one engine (one DP rank), emitting KV events.

    Owns the blocks, the free queue, the hash → block cache, the running requests and the pending event
    queue. Does not own scheduling, timing or transport: a caller drives requests through `start`,
    `append` and `finish`, and publishes `take_events` once per simulated engine step.

    Complexity: `start` and `append` are O(tokens) (hashing) plus O(1) per block allocated, hit or
    evicted; `finish` is O(blocks of the request); the free queue is an ordered dict (O(1) pop, push and
    removal).

    Args:
        num_blocks: KV blocks in the pool (> 0).
        block_size: tokens per block (> 0).
        seed: per-pool hash seed in [0, 2**64) standing in for vLLM's per-process ``NONE_HASH``; pools with
            different seeds give different hashes for the same tokens.
        hash_form: how hashes appear in events and `Admission.block_hashes`.

    Raises:
        ValueError: a non-positive size, a seed outside [0, 2**64), or an unknown ``hash_form``.
    """

    def __init__(
        self, *, num_blocks: int, block_size: int, seed: int = 0, hash_form: HashForm = "int"
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if not 0 <= seed <= _U64_MASK:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        if hash_form not in _HASH_FORMS:
            raise ValueError(f"hash_form must be 'int', 'bytes' or 'signed', got {hash_form!r}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._seed = seed
        self._seed2 = (seed + _DIGEST_SALT) & _U64_MASK
        self._hash_form: HashForm = hash_form
        self._pack_block = struct.Struct(f"<{block_size}q").pack
        self._none_hash = self._digest(_NONE_HASH_INPUT)
        self._ref_cnt: list[int] = [0] * num_blocks
        self._block_digest: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cache: dict[bytes, dict[int, None]] = {}
        self._requests: dict[str, _Request] = {}
        self._events: list[KVEvent] = []
        self._n_requests = 0
        self._n_prompt_tokens = 0
        self._n_hit_blocks = 0
        self._n_stored = 0
        self._n_evictions = 0
        self._n_resets = 0

    # ------------------------------------------------------------------ properties

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def seed(self) -> int:
        """The pool's hash seed."""
        return self._seed

    @property
    def hash_form(self) -> HashForm:
        """How hashes appear in events."""
        return self._hash_form

    @property
    def running(self) -> frozenset[str]:
        """Ids of the requests started and not finished."""
        return frozenset(self._requests)

    @property
    def cached_hashes(self) -> int:
        """Distinct block hashes cached now (in use or free): the blocks an index of this pool's events holds."""
        return len(self._cache)

    def cached_block_hashes(self) -> list[ExternalBlockHash]:
        """Return the hash of every block cached now (in use or free), in the pool's `HashForm`, sorted.

        This is the engine's cache content: what an exact index of this pool's events holds for it.
        """
        return sorted(self._external(d) for d in self._cache)

    # ------------------------------------------------------------------ pure queries

    def compute_block_hashes(
        self, token_ids: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> tuple[ExternalBlockHash, ...]:
        """Return the engine hashes this pool gives the full blocks of ``token_ids``; no state changes.

        Args:
            token_ids: a prompt (or any token sequence starting at position 0).
            lora_name: LoRA adapter name, an extra key of every block.
            cache_salt: cache salt, an extra key of block 0 only.

        Returns:
            One hash per full block (``len(token_ids) // block_size``), in the pool's `HashForm`.
        """
        digests = self._hash_blocks(list(token_ids), [], lora_name=lora_name, cache_salt=cache_salt)
        return tuple(self._external(d) for d in digests)

    def match_prefix(
        self, token_ids: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> int:
        """Return how many tokens of ``token_ids`` `start` would serve from the cache now; no state changes.

        This is the ground truth a router's overlap estimate can be checked against.

        Args:
            token_ids: a prompt.
            lora_name: LoRA adapter name.
            cache_salt: cache salt.

        Returns:
            Cached tokens, a multiple of ``block_size``, at most ``len(token_ids) - 1``.
        """
        tokens = list(token_ids)
        digests = self._hash_blocks(tokens, [], lora_name=lora_name, cache_salt=cache_salt)
        return len(self._find_hits(tokens, digests)) * self._block_size

    def stats(self) -> PoolStats:
        """Return a snapshot of occupancy and lifetime counters."""
        cached_free = sum(1 for b in self._free if self._block_digest[b] is not None)
        cached = sum(1 for d in self._block_digest if d is not None)
        return PoolStats(
            num_blocks=self._num_blocks,
            block_size=self._block_size,
            free_blocks=len(self._free),
            cached_blocks=cached,
            cached_free_blocks=cached_free,
            running_requests=len(self._requests),
            requests=self._n_requests,
            prompt_tokens=self._n_prompt_tokens,
            hit_tokens=self._n_hit_blocks * self._block_size,
            hit_blocks=self._n_hit_blocks,
            stored_blocks=self._n_stored,
            evictions=self._n_evictions,
            resets=self._n_resets,
        )

    # ------------------------------------------------------------------ request lifecycle

    def start(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> Admission:
        """Admit a request: hit the cached prefix, allocate blocks for the rest, store the full blocks.

        Models ``KVCacheManager.get_computed_blocks`` + ``allocate_slots`` for a whole prompt in one step
        (no chunked prefill). Emits, in this order: one ``BlockRemoved`` per evicted cached block (as the
        free queue hands it out), then one ``BlockStored`` for the prompt's full blocks after the hit,
        ``[num_cached_blocks, num_full_blocks)`` (none if that span is empty). The trailing partial block
        is allocated but never stored.

        Args:
            request_id: unique among running requests.
            token_ids: the prompt, at least one token.
            lora_name: LoRA adapter name (an extra key of every block; carried as ``lora_name``).
            cache_salt: cache salt (an extra key of block 0 only).

        Returns:
            What was hit, allocated and evicted.

        Raises:
            ValueError: ``request_id`` is already running or the prompt is empty.
            PoolExhaustedError: the free queue, minus the hit blocks it holds, has fewer blocks than the
                prompt needs; the pool is left unchanged and no event is emitted.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        tokens = list(token_ids)
        if not tokens:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        bs = self._block_size
        digests = self._hash_blocks(tokens, [], lora_name=lora_name, cache_salt=cache_salt)
        hits = self._find_hits(tokens, digests)
        num_cached = len(hits)
        num_full = len(tokens) // bs
        num_prompt_blocks = -(-len(tokens) // bs)
        num_new = num_prompt_blocks - num_cached
        evictable_hits = sum(1 for b in hits if self._ref_cnt[b] == 0)
        available = len(self._free) - evictable_hits
        if num_new > available:
            raise PoolExhaustedError(request_id, needed_blocks=num_new, available_blocks=available)

        # touch(): hit blocks leave the free queue and gain a reference.
        for b in hits:
            if self._ref_cnt[b] == 0:
                del self._free[b]
            self._ref_cnt[b] += 1
        evictions_before = self._n_evictions
        new_blocks = self._get_new_blocks(num_new)
        req = _Request(
            request_id=request_id,
            token_ids=tokens,
            lora_name=lora_name,
            cache_salt=cache_salt,
            digests=digests,
            blocks=hits + new_blocks,
            num_cached_blocks=num_cached,
        )
        self._requests[request_id] = req
        self._cache_full_blocks(req, num_full)

        self._n_requests += 1
        self._n_prompt_tokens += len(tokens)
        self._n_hit_blocks += num_cached
        return Admission(
            request_id=request_id,
            prompt_tokens=len(tokens),
            cached_tokens=num_cached * bs,
            num_cached_blocks=num_cached,
            num_full_blocks=num_full,
            num_prompt_blocks=num_prompt_blocks,
            num_new_blocks=num_new,
            num_evicted=self._n_evictions - evictions_before,
            block_hashes=tuple(self._external(d) for d in digests),
        )

    def append(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Append tokens whose KV was computed in one engine step (normally one decode token).

        Models a decode (or speculative / chunked) step of ``allocate_slots``: allocates blocks for the new
        tokens (a reallocated cached block emits its ``BlockRemoved``), then emits one ``BlockStored`` for
        the blocks that became full in this step, with ``parent_block_hash`` = the hash of the block before
        them. Call it once per token to get vLLM's one-event-per-completed-block decode pattern. Note that
        in vLLM a request's final sampled token is never fed back, so its KV is never computed: a request
        with ``n`` output tokens appends ``n - 1``.

        Args:
            request_id: a running request.
            token_ids: the tokens, in order; empty is a no-op.

        Returns:
            Number of blocks that became full (and were announced) in this step.

        Raises:
            ValueError: ``request_id`` is not running.
            PoolExhaustedError: not enough free blocks for the new tokens; nothing was changed.
        """
        req = self._get_request(request_id)
        new_tokens = list(token_ids)
        if not new_tokens:
            return 0
        bs = self._block_size
        total = len(req.token_ids) + len(new_tokens)
        needed = -(-total // bs) - len(req.blocks)
        if needed > len(self._free):
            raise PoolExhaustedError(request_id, needed_blocks=needed, available_blocks=len(self._free))
        req.token_ids.extend(new_tokens)
        req.digests = self._hash_blocks(
            req.token_ids, req.digests, lora_name=req.lora_name, cache_salt=req.cache_salt
        )
        req.blocks.extend(self._get_new_blocks(needed))
        before = req.num_cached_blocks
        self._cache_full_blocks(req, total // bs)
        return req.num_cached_blocks - before

    def finish(self, request_id: str) -> None:
        """Free a finished (or aborted) request's blocks; emits nothing.

        Models ``KVCacheManager.free``: blocks are released in reverse order; those no other request holds
        go back to the free queue, hash-less ones (the partial tail) at the head, cached ones at the tail
        (most recently used last), so they stay cached until reallocated.

        Args:
            request_id: a running request.

        Raises:
            ValueError: ``request_id`` is not running.
        """
        req = self._get_request(request_id)
        del self._requests[request_id]
        fresh: list[int] = []
        cached: list[int] = []
        for b in reversed(req.blocks):
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                (cached if self._block_digest[b] is not None else fresh).append(b)
        for b in reversed(fresh):
            self._free[b] = None
            self._free.move_to_end(b, last=False)
        for b in cached:
            self._free[b] = None

    def reset(self) -> bool:
        """Drop every cached hash (``BlockPool.reset_prefix_cache``) and emit ``AllBlocksCleared``.

        Returns:
            True on success; False (and nothing emitted) while any request is running.
        """
        if self._requests:
            return False
        self._cache.clear()
        self._block_digest = [None] * self._num_blocks
        self._events.append(AllBlocksCleared())
        self._n_resets += 1
        return True

    def take_events(self) -> list[KVEvent]:
        """Return the pending events in emission order and clear the queue (vLLM's ``take_events``)."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ internals

    def _get_request(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise ValueError(f"request {request_id!r} is not running") from None

    def _digest(self, data: bytes) -> bytes:
        return xxhash.xxh3_128_digest(data, seed=self._seed) + xxhash.xxh3_128_digest(data, seed=self._seed2)

    def _hash_blocks(
        self,
        tokens: list[int],
        digests: list[bytes],
        *,
        lora_name: str | None,
        cache_salt: str | None,
    ) -> list[bytes]:
        """Extend ``digests`` (a prefix of the answer, reused as is) to one digest per full block."""
        bs = self._block_size
        out = list(digests)
        lora_key = b"" if lora_name is None else _encode_key(_TAG_LORA, lora_name)
        for i in range(len(out), len(tokens) // bs):
            parent = out[i - 1] if i else self._none_hash
            extra = lora_key
            if i == 0 and cache_salt is not None:
                extra += _encode_key(_TAG_SALT, cache_salt)
            out.append(self._digest(parent + self._pack_block(*tokens[i * bs : (i + 1) * bs]) + extra))
        return out

    def _find_hits(self, tokens: list[int], digests: list[bytes]) -> list[int]:
        """Return the blocks of the longest cached prefix, capped at ``(len(tokens) - 1) // block_size``."""
        max_blocks = (len(tokens) - 1) // self._block_size
        hits: list[int] = []
        for d in digests[:max_blocks]:
            holders = self._cache.get(d)
            if not holders:
                break
            hits.append(next(iter(holders)))
        return hits

    def _get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the free-queue head, evicting (and announcing) cached ones."""
        blocks: list[int] = []
        for _ in range(n):
            b, _unused = self._free.popitem(last=False)
            digest = self._block_digest[b]
            if digest is not None:
                holders = self._cache[digest]
                del holders[b]
                if not holders:
                    del self._cache[digest]
                self._block_digest[b] = None
                self._events.append(
                    BlockRemoved(
                        block_hashes=(self._external(digest),), medium=MEDIUM_GPU, group_idx=GROUP_IDX
                    )
                )
                self._n_evictions += 1
            self._ref_cnt[b] = 1
            blocks.append(b)
        return blocks

    def _cache_full_blocks(self, req: _Request, num_full: int) -> None:
        """Hash blocks ``[req.num_cached_blocks, num_full)`` into the cache and emit one BlockStored."""
        start = req.num_cached_blocks
        if start >= num_full:
            return
        bs = self._block_size
        hashes: list[ExternalBlockHash] = []
        extra_keys: list[tuple[str, ...] | None] = []
        for i in range(start, num_full):
            b = req.blocks[i]
            digest = req.digests[i]
            self._block_digest[b] = digest
            self._cache.setdefault(digest, {})[b] = None
            hashes.append(self._external(digest))
            keys = tuple(k for k in (req.lora_name, req.cache_salt if i == 0 else None) if k is not None)
            extra_keys.append(keys or None)
        self._events.append(
            BlockStored(
                block_hashes=tuple(hashes),
                parent_block_hash=self._external(req.digests[start - 1]) if start else None,
                token_ids=tuple(req.token_ids[start * bs : num_full * bs]),
                block_size=bs,
                medium=MEDIUM_GPU,
                lora_name=req.lora_name,
                extra_keys=tuple(extra_keys),
                group_idx=GROUP_IDX,
                kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
            )
        )
        req.num_cached_blocks = num_full
        self._n_stored += num_full - start

    def _external(self, digest: bytes) -> ExternalBlockHash:
        """Convert an internal 32-byte digest to the pool's `HashForm`."""
        if self._hash_form == "bytes":
            return digest
        value = int.from_bytes(digest[-8:], "big")
        if self._hash_form == "signed" and value >= 2**63:
            value -= 2**64
        return value


def _encode_key(tag: bytes, value: str) -> bytes:
    """Encode one extra key unambiguously: tag, 4-byte little-endian length, UTF-8 bytes."""
    raw = value.encode("utf-8")
    return tag + len(raw).to_bytes(4, "little") + raw
