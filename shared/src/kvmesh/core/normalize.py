"""Turn decoded engine batches into kvmesh stream events (the ingest's pure middle).

For each event of a `kvmesh.core.wire.EngineBatch` this module checks, keys and converts:

* **BlockStored** → `Stored`: engine hashes become 64-bit keys (`wire.engine_key`, so int and ``bin`` forms
  of one hash agree); local hashes are computed from ``token_ids`` under the event's LoRA adapter, cache salt
  (block 0 only) and per-block multimodal keys (`kvmesh.core.hashing`). Rejected whole, never half-applied:
  a block size other than the configured (or first seen) one, and ``len(token_ids) != len(block_hashes) ×
  block_size`` (hybrid models skip null blocks, vLLM PR #44488). Events of KV-cache groups that are not
  full attention (``kv_cache_spec_kind`` sliding_window, mamba, …; vLLM ≥ 0.22) are skipped, and the group
  is remembered so that its BlockRemoved events (which carry only ``group_idx``) are skipped too.
* A **tokenless BlockStored** (``token_ids: []``, ``block_size: 0``, hashes of blocks the engine already
  reported: vLLM < 0.24's OffloadingConnector announcing CPU copies) → `Placed`: the index adds the tier to
  those blocks of the holder. It neither sets nor is checked against the block size.
* **BlockRemoved** → `Removed`; **AllBlocksCleared** → `Cleared("engine")`.

RFC #1527 events (`wire.SequenceStored`; their removals and clears decode as BlockRemoved and
AllBlocksCleared, naming blocks by their ``seq_hashes``). A publisher's ``seq_hashes`` are its engine hashes
(what its removals and ``parent_hash`` name) in both kinds:

* **with ``token_ids``** (the RFC sends them when the publisher does not use the standard hash) → `Stored`,
  keyed by kvmesh from the tokens exactly as a BlockStored (``lora_name`` seeds every block,
  ``additional_salt`` is the block-0 salt, i.e. the ``cache_salt`` a route request names). kvmesh's keys
  win: they are what every route request is hashed with. The event's own hashes are checked against
  them (`kvmesh.core.hashing.sequence_hashes` of kvmesh's local hashes from ``parent_hash``); a difference
  is counted (``seq_hash_mismatch``), and is expected from a publisher that sends token ids. The tokens
  start at block 0 when ``parent_hash`` is nil; nil with ``base_block_idx`` above 0 cannot be placed and is
  rejected (`UnplacedBlocksError`).
* **without ``token_ids``** (the Mooncake store master) → `StoredKeys` with the ``seq_hashes`` as prefix
  keys: the publisher already mixed its LoRA, salt and tenant into them, so there is nothing to add. An
  empty ``seq_hashes`` (the master's ``object_key`` was no hash) names nothing and is skipped and counted
  (``unkeyed_events``), as is a removal with none.

Either kind needs a block size: the event's (checked against the configured or first-seen one like a
BlockStored's), else the configured one (``--block-size``; the master leaves it to the registration);
with neither, the event is rejected (`BlockSizeUnknownError`). ``tenant_id`` is not a key: kvmesh keys by
content, which an engine reuses whoever asked, and tenants that must not share a cache are kept apart by
their salt. ``model_name``, ``backend_id`` (the holder is the ingest's worker), ``dp_rank`` (the batch's
rank is used, as for every producer) and ``event_id`` (the ZMQ sequence orders batches) are informational.

An event that fails to decode (`wire.EngineBatch.errors`: a field of the wrong type, such as a non-string
``medium``, a float or bool block hash) is rejected alone and counted (``malformed_events``); the batch's
other events are kept exactly. Only when the index could over-state afterwards does the result say
``lost`` (the caller then clears the holder, `NormalizeResult.lost`):

* a **BlockStored** that fails is just not indexed, whatever field failed (its hashes included): the index
  misses those blocks, a later BlockStored chained on them is held as an orphan and never attached, and a
  later BlockRemoved of them is an unknown removal. The index under-states, never invents: not lost.
* a **BlockRemoved** that fails is lost: the index would keep blocks the engine evicted.
* an event whose type cannot be read (not an array or map, a missing or non-string tag) is lost: it may
  have been a removal.

Extra keys (vLLM ≥ 0.17, one entry per block): the LoRA entry (its name, or ``lora_id`` before 0.13) is
dropped since the adapter already seeds every block; on block 0 of a sequence the last remaining string is
the ``cache_salt``; everything else (multimodal identifiers, prompt-embedding digests) is encoded into that
block's extra bytes. A vLLM < 0.24 multimodal hash on block 0 with no salt is taken as a salt: the key still
differs from every plain prompt, so the index under-states and never invents.

A ``cache_salt`` (SGLang's map field, or the trailing map of 0.5.18 – 0.5.19) seeds block 0 of a sequence
only: it is mixed in for an event without a parent, and ignored on a child event's keys (SGLang ≥ 0.5.20
repeats it on every BlockStored of a salted request). A child whose salt differs from the chain it extends is
counted (``salt_mismatch``), its keys still following the chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, cast

import msgspec
import xxhash

from kvmesh.core.errors import BlockAlignmentError, EventRejectedError, RequestError
from kvmesh.core.events import Cleared, Event, Placed, Removed, Stored, StoredKeys
from kvmesh.core.hashing import SEED, local_block_hashes, sequence_hashes
from kvmesh.core.wire import (
    RFC_STORED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    SequenceStored,
    engine_key,
)

_STORED_TAGS: Final[frozenset[str | None]] = frozenset({"BlockStored", RFC_STORED})
"""Tags of events whose decode failure loses nothing but their own blocks (module docstring)."""

_MASK64: Final[int] = (1 << 64) - 1

FULL_ATTENTION_KINDS: Final[frozenset[str | None]] = frozenset({None, "full_attention", "mla_attention"})
"""``kv_cache_spec_kind`` values whose blocks are prefix-cache keys."""

_encode = msgspec.msgpack.Encoder().encode

CHAIN_SALTS_KEPT: Final[int] = 65_536
"""Per (worker, dp_rank): how many chain ends (the last block of recent BlockStored events) keep the salt
their chain started with, to tell a child event whose salt differs (`NormalizeStats.salt_mismatch`)."""


class BlockSizeMismatchError(EventRejectedError):
    """An event's block size differs from the configured or first-seen one.

    Attributes:
        expected: the configured (or first-seen) block size in tokens.
        got: the event's block size in tokens.
    """

    def __init__(self, *, expected: int, got: int) -> None:
        super().__init__(f"event block_size {got} differs from the expected block size {expected}")
        self.expected = expected
        self.got = got


class BlockSizeUnknownError(EventRejectedError):
    """An RFC #1527 event without a block size, and none configured or seen yet (``--block-size``)."""

    def __init__(self) -> None:
        super().__init__(
            "RFC #1527 stored event without a block_size, and no block size is configured (--block-size)"
        )


class UnplacedBlocksError(EventRejectedError):
    """RFC #1527 token ids that start past block 0 without a ``parent_hash`` to chain them from.

    Attributes:
        base_block_idx: the event's depth of its first block.
    """

    def __init__(self, *, base_block_idx: int) -> None:
        super().__init__(
            f"RFC #1527 stored event with token_ids at base_block_idx {base_block_idx} has no parent_hash "
            "(its blocks cannot be keyed)"
        )
        self.base_block_idx = base_block_idx


@dataclass(slots=True)
class NormalizeStats:
    """Counters of one (worker, dp_rank)'s normalization (cumulative)."""

    stored_events: int = 0
    stored_blocks: int = 0
    removed_events: int = 0
    removed_blocks: int = 0
    cleared_events: int = 0
    skipped_non_full: int = 0
    rejected_alignment: int = 0
    rejected_block_size: int = 0
    rejected_tokens: int = 0
    unknown_events: int = 0
    malformed_events: int = 0
    """Events that failed to decode (``batch.errors``), rejected alone."""
    malformed_stored: int = 0
    """Of those, BlockStored events: their blocks are not indexed, and the holder is not resynchronised."""
    placed_events: int = 0
    """Tokenless BlockStored events (``token_ids: []``, ``block_size: 0``: copies of known blocks on another
    tier, vLLM < 0.24's OffloadingConnector), published as `Placed`."""
    placed_blocks: int = 0
    salt_mismatch: int = 0
    """Child BlockStored events (``parent_block_hash`` set) whose ``cache_salt`` differs from the salt of the
    chain they extend (when that chain's last event is remembered, `CHAIN_SALTS_KEPT`); their keys follow
    the chain, since the salt seeds block 0 only."""
    sequence_events: int = 0
    """RFC #1527 stored events without token ids, published as `StoredKeys`."""
    sequence_blocks: int = 0
    seq_hash_mismatch: int = 0
    """RFC #1527 stored events with token ids whose ``seq_hashes`` differ from kvmesh's sequence hashes of
    their tokens (kvmesh's keys are used; expected from a publisher that does not use the standard hash)."""
    unkeyed_events: int = 0
    """RFC #1527 events with an empty ``seq_hashes`` (nothing to index or remove), skipped."""
    rejected_unplaced: int = 0
    """RFC #1527 stored events with token ids past block 0 and no ``parent_hash`` (`UnplacedBlocksError`)."""


@dataclass(slots=True)
class Normalizer:
    """Per-(worker, dp_rank) normalization state.

    Args:
        block_size: configured block size in tokens, or None to take the first event's.
    """

    block_size: int | None = None
    non_full_groups: set[int] = field(default_factory=set)
    stats: NormalizeStats = field(default_factory=NormalizeStats)
    chain_salts: dict[int, int | None] = field(default_factory=dict)
    """Engine key of a recent event's last block → the XXH3-64 digest of its chain's salt (None: unsalted;
    oldest first, `CHAIN_SALTS_KEPT`): salts come from requests and may be long, a digest tells them apart."""

    def normalize(self, batch: EngineBatch) -> NormalizeResult:
        """Convert one decoded batch.

        Returns:
            the stream events in order (consecutive BlockRemoved events of one medium as one `Removed`, keys in
            engine order: the index removes one copy per key either way), and every rejection (the event and
            why), so the caller can log and count them. ``lost`` is True when an event that failed to decode
            (``batch.errors``) may have removed blocks (a BlockRemoved, or an event of unknown type): the holder may now over-state and
            should be resynchronised. A BlockStored that failed to decode is not lost (module docstring).
        """
        out: list[Event] = []
        rejections: list[EventRejectedError | RequestError] = []
        st = self.stats
        st.unknown_events += batch.unknown_events
        st.malformed_events += len(batch.errors)
        non_full = self.non_full_groups
        # The last `Removed` put out (its keys list and tier): the next removal of the same tier extends it
        # while it is still the last event of ``out``. Counters are kept in locals meanwhile.
        run: list[int] = []
        run_event: Removed | None = None
        run_medium: str | None = None
        removed_events = removed_blocks = 0
        try:
            for ev in batch.events:
                # The common case first: vLLM sends one BlockRemoved per evicted block.
                if type(ev) is BlockRemoved or isinstance(ev, BlockRemoved):
                    group = ev.group_idx
                    if group is not None and group in non_full:
                        st.skipped_non_full += 1
                        continue
                    hashes = ev.block_hashes
                    if not hashes:
                        st.unkeyed_events += 1
                        continue
                    removed_events += 1
                    medium = ev.medium
                    if run_event is None or out[-1] is not run_event or run_medium != medium:
                        # consecutive removals of one tier are one stream event (the index removes a copy per
                        # key either way): vLLM sends one BlockRemoved per evicted block
                        run, run_medium = [], medium
                        run_event = Removed(run, medium)
                        out.append(run_event)
                    removed_blocks += len(hashes)
                    if len(hashes) == 1 and type(hashes[0]) is int:
                        run.append(hashes[0] & _MASK64)  # engine_key of an int
                    else:
                        run.extend([engine_key(h) for h in hashes])
                    continue
                if isinstance(ev, BlockStored | SequenceStored):
                    try:
                        stored = self._stored(ev) if isinstance(ev, BlockStored) else self._sequence(ev)
                    except (EventRejectedError, RequestError) as exc:
                        rejections.append(exc)
                        continue
                    if stored is not None:
                        out.append(stored)
                elif isinstance(ev, AllBlocksCleared):
                    st.cleared_events += 1
                    out.append(Cleared("engine"))
        finally:  # counted as they went, even when an event raises
            st.removed_events += removed_events
            st.removed_blocks += removed_blocks
        lost = False
        for err in batch.errors:
            if err.tag in _STORED_TAGS:
                st.malformed_stored += 1
            else:
                lost = True
        return NormalizeResult(events=out, rejections=rejections, lost=lost)

    def _stored(self, ev: BlockStored) -> Stored | Placed | None:
        st = self.stats
        if ev.block_size == 0:
            if ev.token_ids:
                st.rejected_alignment += 1
                raise BlockAlignmentError(tokens=len(ev.token_ids), blocks=len(ev.block_hashes), block_size=0)
            if not ev.block_hashes:
                return None
            # A copy of known blocks on another tier (vLLM < 0.24's OffloadingConnector): no tokens to key.
            st.placed_events += 1
            st.placed_blocks += len(ev.block_hashes)
            return Placed([engine_key(h) for h in ev.block_hashes], ev.medium)
        if ev.kv_cache_spec_kind not in FULL_ATTENTION_KINDS:
            if ev.group_idx is not None:
                self.non_full_groups.add(ev.group_idx)
            st.skipped_non_full += 1
            return None
        if self.block_size is None:
            self.block_size = ev.block_size
        elif ev.block_size != self.block_size:
            st.rejected_block_size += 1
            raise BlockSizeMismatchError(expected=self.block_size, got=ev.block_size)
        n = len(ev.block_hashes)
        if len(ev.token_ids) != n * ev.block_size:
            st.rejected_alignment += 1
            raise BlockAlignmentError(tokens=len(ev.token_ids), blocks=n, block_size=ev.block_size)
        lora = ev.lora_name or (f"lora-id:{ev.lora_id}" if ev.lora_id is not None else None)
        first_block = ev.parent_block_hash is None
        salt, extras = _split_extra_keys(ev, first_block=first_block)
        try:
            local = local_block_hashes(
                ev.token_ids, ev.block_size, lora_name=lora, cache_salt=salt, block_extras=extras
            )
        except RequestError:
            st.rejected_tokens += 1
            raise
        st.stored_events += 1
        st.stored_blocks += n
        parent = engine_key(ev.parent_block_hash) if ev.parent_block_hash is not None else None
        hashes = ev.block_hashes
        if all(type(h) is int for h in hashes):  # engine_key of an int, in one comprehension
            keys = [h & _MASK64 for h in cast("tuple[int, ...]", hashes)]
        else:
            keys = [engine_key(h) for h in hashes]
        chain_salt = (
            _salt_digest(salt) if first_block else self._chain_salt(parent, _salt_digest(ev.cache_salt))
        )
        if keys:
            self._remember(keys[-1], chain_salt)
        return Stored(keys, parent, local, ev.medium)

    def _sequence(self, ev: SequenceStored) -> Stored | StoredKeys | None:
        """An RFC #1527 stored event (module docstring)."""
        st = self.stats
        if not ev.seq_hashes:
            st.unkeyed_events += 1
            return None
        block_size = self._rfc_block_size(ev.block_size)
        parent = ev.parent_hash
        if ev.token_ids is None:
            st.sequence_events += 1
            st.sequence_blocks += len(ev.seq_hashes)
            return StoredKeys(list(ev.seq_hashes), parent, ev.medium)
        n = len(ev.seq_hashes)
        if len(ev.token_ids) != n * block_size:
            st.rejected_alignment += 1
            raise BlockAlignmentError(tokens=len(ev.token_ids), blocks=n, block_size=block_size)
        if parent is None and ev.base_block_idx:
            st.rejected_unplaced += 1
            raise UnplacedBlocksError(base_block_idx=ev.base_block_idx)
        salt = ev.additional_salt if parent is None else None
        try:
            local = local_block_hashes(ev.token_ids, block_size, lora_name=ev.lora_name, cache_salt=salt)
        except RequestError:
            st.rejected_tokens += 1
            raise
        if sequence_hashes(local, parent) != list(ev.seq_hashes):
            st.seq_hash_mismatch += 1
        st.stored_events += 1
        st.stored_blocks += n
        return Stored(list(ev.seq_hashes), parent, local, ev.medium)

    def _rfc_block_size(self, size: int | None) -> int:
        """An RFC event's block size: its own (checked like a BlockStored's), else the configured one."""
        if size is None:
            if self.block_size is None:
                self.stats.rejected_block_size += 1
                raise BlockSizeUnknownError
            return self.block_size
        if self.block_size is None:
            self.block_size = size
        elif size != self.block_size:
            self.stats.rejected_block_size += 1
            raise BlockSizeMismatchError(expected=self.block_size, got=size)
        return size

    def _chain_salt(self, parent: int | None, salt: int | None) -> int | None:
        """The salt of the chain a child event extends; counts a child whose own salt differs from it."""
        if parent is None or parent not in self.chain_salts:
            return salt  # the chain's start is not remembered: take the event's word for it
        known = self.chain_salts[parent]
        if salt is not None and salt != known:
            self.stats.salt_mismatch += 1
        return known

    def _remember(self, key: int, salt: int | None) -> None:
        salts = self.chain_salts
        salts.pop(key, None)
        salts[key] = salt
        if len(salts) > CHAIN_SALTS_KEPT:
            del salts[next(iter(salts))]


@dataclass(frozen=True, slots=True, kw_only=True)
class NormalizeResult:
    """Output of `Normalizer.normalize`."""

    events: list[Event]
    rejections: list[EventRejectedError | RequestError]
    lost: bool
    """An event that may have removed blocks failed to decode: clear the holder (its index may over-state)."""


def _salt_digest(salt: str | None) -> int | None:
    """XXH3-64 (seed 1337) of a salt's UTF-8 bytes; None for no salt."""
    return (
        None if salt is None else xxhash.xxh3_64_intdigest(salt.encode("utf-8", "surrogatepass"), seed=SEED)
    )


def _split_extra_keys(ev: BlockStored, *, first_block: bool) -> tuple[str | None, list[bytes | None] | None]:
    """(the salt that seeds block 0, or None when the event does not start a sequence; per-block extras).

    SGLang ≥ 0.5.20 repeats ``cache_salt`` on every BlockStored of a salted request, children included: only
    an event that starts the sequence (no parent) mixes it in.
    """
    salt = ev.cache_salt if first_block else None
    keys = ev.extra_keys
    if not keys or not any(keys):  # vLLM ≥ 0.17 sends one entry per block, nearly always None
        return salt, None
    lora_entries: set[Any] = {x for x in (ev.lora_name, ev.lora_id) if x is not None}
    extras: list[bytes | None] = []
    any_extra = False
    for i, entry in enumerate(keys):
        if not entry:
            extras.append(None)
            continue
        items = [
            x
            for x in entry
            if not (isinstance(x, str | int) and not isinstance(x, bool) and x in lora_entries)
        ]
        if i == 0 and first_block and salt is None:
            for j in range(len(items) - 1, -1, -1):
                if isinstance(items[j], str):
                    salt = items.pop(j)
                    break
        if items:
            extras.append(_encode(items))
            any_extra = True
        else:
            extras.append(None)
    return salt, extras if any_extra else None
