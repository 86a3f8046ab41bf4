"""Stateful property test: `PrefixIndex` driven by random events on several storage tiers agrees with a naive
model, and its incrementally kept digest equals the one computed from scratch after every step."""

from __future__ import annotations

import numpy as np
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmesh.core import index as index_module
from kvmesh.core.hashing import local_block_hashes, prefix_keys
from kvmesh.core.index import (
    DEFAULT_TIER,
    Holder,
    IndexStats,
    Overlap,
    PrefixIndex,
    engine_key60,
    tier_name,
    tier_rank,
)

BLOCK_SIZE = 2
MAX_DEPTH = 4
"""Longest chain (in blocks) the machine builds, so that shared prefixes are frequent."""
MAX_ORPHANS = 2
WORKERS = ("w0", "w1", "w2")
HOLDERS = tuple(Holder(w, r) for w in WORKERS for r in (0, 1))
MEDIA = (None, None, None, "GPU", "CPU", "cpu", "DISK")
"""Media as events name them: mostly none (the default tier), spelled several ways."""
UNKNOWN_ENGINE_HASH = 0xDEAD_BEEF  # a key no store of the machine ever attaches

# Fixed queries over the two-token universe, checked at every step besides every stored path.
FIXED_QUERIES: tuple[tuple[int, ...], ...] = (
    (0, 0, 0, 0, 0, 0, 0, 0),
    (1, 1, 1, 1, 1, 1, 1, 1),
    (0, 1, 0, 1, 0, 1, 0, 1),
    (1, 0, 1, 0, 1, 0, 1, 0),
    (0, 0, 1, 1, 0, 0, 1, 1),
    (1, 1, 0, 0, 1, 1, 0, 0, 1),
)

Tiers = dict[str | None, dict[int, list[int]]]
"""tier (None: default) -> engine key -> [prefix key, store count]."""


def _engine_hash(holder: Holder, seq: int, copy: int) -> int:
    """Per-holder 64-bit engine hash of a block: same content on another holder gets another one; the same
    content on another tier of the holder gets the same one (as with vLLM's CPU offloading)."""
    return xxhash.xxh3_64_intdigest(f"{holder.worker_id}/{holder.dp_rank}/{copy}/{seq}".encode())


def _prompt_keys(tokens: tuple[int, ...]) -> list[int]:
    return prefix_keys(local_block_hashes(tokens, BLOCK_SIZE))


class PrefixIndexMachine(RuleBasedStateMachine):
    """Random stores, removals, clears and worker removals on several tiers against a dictionary model."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(max_orphans=MAX_ORPHANS, track_digest=True)
        self.model: dict[Holder, Tiers] = {}
        # prefix key -> tokens of the whole prefix up to that block (content, independent of holder)
        self.paths: dict[int, tuple[int, ...]] = {}
        # engine key -> the copy number it was derived with
        self.copies: dict[int, int] = {}
        self.live_holders: set[Holder] = set()
        self.orphans: dict[Holder, int] = {}
        self.orphans_dropped = 0
        self.unknown_removals = 0
        self.orphan_serial = 0

    def _blocks(self, holder: Holder) -> dict[int, int]:
        """Engine key -> prefix key over every tier of a holder (a key means the same on every tier)."""
        return {h: e[0] for tier in self.model.get(holder, {}).values() for h, e in tier.items()}

    # ------------------------------------------------------------------ rules

    @rule(data=st.data())
    def store_chain(self, data: st.DataObject) -> None:
        """Store a chain from block 0 or under a parent this holder holds on some tier."""
        holder = data.draw(st.sampled_from(HOLDERS), label="holder")
        medium = data.draw(st.sampled_from(MEDIA), label="medium")
        copy = data.draw(st.integers(0, 1), label="copy")
        blocks = self._blocks(holder)
        parents = sorted(h for h, key in blocks.items() if len(self.paths[key]) < MAX_DEPTH * BLOCK_SIZE)
        parent: int | None = None
        prefix: tuple[int, ...] = ()
        parent_key: int | None = None
        with_parent: bool = bool(parents) and data.draw(st.booleans(), label="with_parent")
        if with_parent:
            parent = data.draw(st.sampled_from(parents), label="parent")
            parent_key = blocks[parent]
            prefix = self.paths[parent_key]
        room = MAX_DEPTH - len(prefix) // BLOCK_SIZE
        n_new = data.draw(st.integers(1, room), label="n_new")
        tokens = tuple(
            data.draw(st.lists(st.integers(0, 1), min_size=n_new * BLOCK_SIZE, max_size=n_new * BLOCK_SIZE))
        )
        by_keys = data.draw(st.booleans(), label="by_keys")  # an RFC #1527 seq_hashes event: store_sequence
        self._store(holder, medium, copy, parent, parent_key, prefix=prefix, tokens=tokens, by_keys=by_keys)

    @precondition(lambda self: any(any(t.values()) for t in self.model.values()))
    @rule(data=st.data())
    def store_again(self, data: st.DataObject) -> None:
        """Store again, from block 0 and on any tier, the whole prefix of a block a holder holds."""
        holders = sorted(h for h in self.model if self._blocks(h))
        holder = data.draw(st.sampled_from(holders), label="holder")
        medium = data.draw(st.sampled_from(MEDIA), label="medium")
        blocks = self._blocks(holder)
        engine_hash = data.draw(st.sampled_from(sorted(blocks)), label="block")
        key = blocks[engine_hash]
        self._store(holder, medium, self.copies[engine_hash], None, None, prefix=(), tokens=self.paths[key])

    def _store(
        self,
        holder: Holder,
        medium: str | None,
        copy: int,
        parent: int | None,
        parent_key: int | None,
        *,
        prefix: tuple[int, ...],
        tokens: tuple[int, ...],
        by_keys: bool = False,
    ) -> None:
        local = local_block_hashes(tokens, BLOCK_SIZE)
        keys = prefix_keys(local, parent_key)
        engine = [_engine_hash(holder, k, copy) for k in keys]

        if by_keys:  # the prefix keys given (StoredKeys), so no parent is needed
            result = self.index.store_sequence(holder, engine, keys, medium)
        else:
            result = self.index.store(holder, engine, parent, local, medium)

        self.live_holders.add(holder)
        tier_blocks = self.model.setdefault(holder, {}).setdefault(tier_name(medium), {})
        attached = duplicates = 0
        for i, (eh, key) in enumerate(zip(engine, keys, strict=True)):
            ek = engine_key60(eh)
            self.paths[key] = prefix + tokens[: (i + 1) * BLOCK_SIZE]
            self.copies[ek] = copy
            entry = tier_blocks.get(ek)
            if entry is None:
                tier_blocks[ek] = [key, 1]
                attached += 1
            else:
                assert entry[0] == key
                entry[1] += 1
                duplicates += 1
        assert result.held is False
        assert result.attached == attached
        assert result.duplicates == duplicates
        assert result.dropped_orphans == 0

    @rule(data=st.data())
    def store_child_first(self, data: st.DataObject) -> None:
        """Store a chain's tail before its head: the tail is held, then attaches when the head arrives."""
        holder = data.draw(st.sampled_from(HOLDERS), label="holder")
        head_medium = data.draw(st.sampled_from(MEDIA), label="head_medium")
        tail_medium = data.draw(st.sampled_from(MEDIA), label="tail_medium")
        copy = data.draw(st.integers(0, 1), label="copy")
        n_head = data.draw(st.integers(1, MAX_DEPTH - 1), label="n_head")
        n_tail = data.draw(st.integers(1, MAX_DEPTH - n_head), label="n_tail")
        bits = st.integers(0, 1)
        head = tuple(data.draw(st.lists(bits, min_size=n_head * BLOCK_SIZE, max_size=n_head * BLOCK_SIZE)))
        tail = tuple(data.draw(st.lists(bits, min_size=n_tail * BLOCK_SIZE, max_size=n_tail * BLOCK_SIZE)))
        head_local = local_block_hashes(head, BLOCK_SIZE)
        head_keys = prefix_keys(head_local)
        head_engine = [_engine_hash(holder, k, copy) for k in head_keys]
        parent = engine_key60(head_engine[-1])
        if parent in self._blocks(holder):  # the head is there already: the tail would attach at once
            return
        tail_local = local_block_hashes(tail, BLOCK_SIZE)
        tail_keys = prefix_keys(tail_local, head_keys[-1])
        tail_engine = [_engine_hash(holder, k, copy) for k in tail_keys]

        held = self.index.store(holder, tail_engine, head_engine[-1], tail_local, tail_medium)
        self.live_holders.add(holder)
        waiting = self.orphans.get(holder, 0) + 1
        dropped = max(0, waiting - MAX_ORPHANS)  # the oldest go, never the one just held
        self.orphans[holder] = waiting - 1 - dropped  # the tail attaches below
        self.orphans_dropped += dropped
        assert (held.held, held.attached, held.dropped_orphans) == (True, 0, dropped)

        result = self.index.store(holder, head_engine, None, head_local, head_medium)
        attached = duplicates = 0
        for medium, engine, keys, tokens in (
            (head_medium, head_engine, head_keys, head),
            (tail_medium, tail_engine, tail_keys, head + tail),
        ):
            tier_blocks = self.model.setdefault(holder, {}).setdefault(tier_name(medium), {})
            start = 0 if tokens is head else len(head)
            for i, (eh, key) in enumerate(zip(engine, keys, strict=True)):
                ek = engine_key60(eh)
                self.paths[key] = tokens[: start + (i + 1) * BLOCK_SIZE]
                self.copies[ek] = copy
                entry = tier_blocks.get(ek)
                if entry is None:
                    tier_blocks[ek] = [key, 1]
                    attached += 1
                else:
                    entry[1] += 1
                    duplicates += 1
        assert (result.held, result.attached, result.duplicates) == (False, attached, duplicates)

    @rule(data=st.data())
    def restore_from_export(self, data: st.DataObject) -> None:
        """Continue on an index restored from an export (a snapshot), tracking its digest from the start or
        from its first `digest` call."""
        track = data.draw(st.booleans(), label="track_digest")
        self.index = PrefixIndex.from_export(self.index.export(), track_digest=track)

    @rule(holder=st.sampled_from(HOLDERS), n_blocks=st.integers(1, 2), medium=st.sampled_from(MEDIA))
    def store_under_unknown_parent(self, holder: Holder, n_blocks: int, medium: str | None) -> None:
        """Store under a parent that never arrives: the event is held and matches nothing."""
        self.orphan_serial += 1
        parent = UNKNOWN_ENGINE_HASH + self.orphan_serial
        engine = [UNKNOWN_ENGINE_HASH - 1000 * self.orphan_serial - i for i in range(n_blocks)]
        result = self.index.store(holder, engine, parent, [7] * n_blocks, medium)
        self.live_holders.add(holder)
        held = self.orphans.get(holder, 0) + 1
        dropped = max(0, held - MAX_ORPHANS)
        self.orphans[holder] = held - dropped
        self.orphans_dropped += dropped
        assert result.held is True
        assert result.attached == 0
        assert result.duplicates == 0
        assert result.dropped_orphans == dropped

    @precondition(lambda self: any(any(t.values()) for t in self.model.values()))
    @rule(data=st.data())
    def place_copies(self, data: st.DataObject) -> None:
        """Copy a few of a holder's blocks (and an unknown hash) onto one tier (a tokenless BlockStored): each
        copy takes its block's prefix key; a copy already on that tier raises its count."""
        holder = data.draw(st.sampled_from(sorted(h for h in self.model if self._blocks(h))), label="holder")
        medium = data.draw(st.sampled_from(MEDIA), label="medium")
        blocks = self._blocks(holder)
        choices = st.sampled_from([*sorted(blocks), UNKNOWN_ENGINE_HASH])
        hashes = data.draw(st.lists(choices, min_size=1, max_size=4), label="hashes")

        result = self.index.place(holder, hashes, medium)

        tier_blocks = self.model[holder].setdefault(tier_name(medium), {})
        placed = duplicates = unknown = 0
        for h in hashes:
            if h not in blocks:
                unknown += 1
            elif h in tier_blocks:
                tier_blocks[h][1] += 1
                duplicates += 1
            else:
                tier_blocks[h] = [blocks[h], 1]
                placed += 1
        assert (result.placed, result.duplicates, result.unknown) == (placed, duplicates, unknown)

    @rule(data=st.data())
    def remove_blocks(self, data: st.DataObject) -> None:
        """Remove one copy each of a few engine hashes, known or not, from one tier of one holder."""
        holding = sorted(h for h in self.model if self._blocks(h))
        use_holding: bool = bool(holding) and data.draw(st.booleans(), label="holding")
        pool = holding if use_holding else list(HOLDERS)
        holder = data.draw(st.sampled_from(pool), label="holder")
        medium = data.draw(st.sampled_from(MEDIA), label="medium")
        known = sorted(self._blocks(holder))
        choices = st.sampled_from([*known, UNKNOWN_ENGINE_HASH]) if known else st.just(UNKNOWN_ENGINE_HASH)
        hashes = data.draw(st.lists(choices, min_size=1, max_size=3), label="hashes")

        result = self.index.remove(holder, hashes, medium)

        removed = decremented = unknown = 0
        blocks = self.model.get(holder, {}).get(tier_name(medium), {})
        for h in hashes:
            entry = blocks.get(h)
            if entry is None:
                unknown += 1
            elif entry[1] > 1:
                entry[1] -= 1
                decremented += 1
            else:
                del blocks[h]
                removed += 1
        self.unknown_removals += unknown
        assert (result.removed, result.decremented, result.unknown) == (removed, decremented, unknown)

    @rule(holder=st.sampled_from(HOLDERS))
    def clear_holder(self, holder: Holder) -> None:
        """Clear one (worker, dp_rank): its blocks on every tier and its held events go, the holder stays."""
        expected = sum(len(t) for t in self.model.pop(holder, {}).values())
        self.orphans.pop(holder, None)
        assert self.index.clear(holder) == expected

    @rule(worker=st.sampled_from(WORKERS))
    def remove_worker(self, worker: str) -> None:
        """Remove every dp rank of one worker: blocks, held events and the holders themselves go."""
        expected = 0
        for holder in [h for h in HOLDERS if h.worker_id == worker]:
            expected += sum(len(t) for t in self.model.pop(holder, {}).values())
            self.live_holders.discard(holder)
            self.orphans.pop(holder, None)
        assert self.index.remove_worker(worker) == expected

    # ------------------------------------------------------------------ invariants

    def _naive_match(self, keys: list[int]) -> dict[Holder, Overlap]:
        out: dict[Holder, Overlap] = {}
        for holder, tiers in self.model.items():
            present = {
                tier: {key for key, count in blocks.values() if count > 0} for tier, blocks in tiers.items()
            }
            per_tier: dict[str, int] = {}
            overlap = 0
            for k in keys:
                on = sorted((t for t, held in present.items() if k in held), key=tier_rank)
                if not on:
                    break
                fastest = on[0] or DEFAULT_TIER
                per_tier[fastest] = per_tier.get(fastest, 0) + 1
                overlap += 1
            if overlap:
                ordered = {t: per_tier[t] for t in sorted(per_tier, key=tier_rank)}
                out[holder] = Overlap(overlap, None if list(ordered) == [DEFAULT_TIER] else ordered)
        return out

    @invariant()
    def match_agrees_with_model(self) -> None:
        """Every stored prefix, and a few fixed prompts, match exactly as the model says, per tier too."""
        queries = set(self.paths.values()) | set(FIXED_QUERIES)
        for tokens in sorted(queries):
            keys = _prompt_keys(tokens)
            expected = self._naive_match(keys)
            got = self.index.match_tiers(keys)
            assert got == expected, tokens
            assert {h: list(o.tiers or {}) for h, o in got.items()} == {  # fastest tier first
                h: list(o.tiers or {}) for h, o in expected.items()
            }
            assert self.index.match(keys) == {h: o.blocks for h, o in expected.items()}, tokens
            if not self.index.tiered:  # every holder absent from `others` has `common` blocks
                common, others = self.index.match_common(np.array(keys, dtype=np.uint64))
                whole = {h: others.get(h, common) for h in self.index.holders()}
                assert {h: n for h, n in whole.items() if n} == {h: o.blocks for h, o in expected.items()}

    @invariant()
    def stats_agree_with_model(self) -> None:
        """Holder, block, prefix, orphan and unknown-removal counts equal the model's."""
        assert self.index.stats() == IndexStats(
            holders=len(self.live_holders),
            blocks=sum(len(b) for t in self.model.values() for b in t.values()),
            distinct_prefixes=len(
                {e[0] for t in self.model.values() for b in t.values() for e in b.values()}
            ),
            held_orphans=sum(self.orphans.values()),
            orphans_expired=self.orphans_dropped,
            unknown_removals=self.unknown_removals,
        )
        assert self.index.holders() == sorted(self.live_holders)
        for holder in HOLDERS:
            expected = sum(len(b) for b in self.model.get(holder, {}).values())
            assert self.index.block_count(holder) == expected

    @invariant()
    def digest_kept_equals_from_scratch(self) -> None:
        """The digest kept incrementally equals the one computed from the block maps."""
        assert self.index.digest() == self.index.digest_from_scratch()

    @invariant()
    def digest_equals_rebuilt_model(self) -> None:
        """An index rebuilt from the model's entries, and one restored from an export, equal this one; every key
        is an engine key below 2**60 or a 64-bit sequence hash."""
        rebuilt = PrefixIndex()
        for holder, tiers in self.model.items():
            for tier, blocks in tiers.items():
                for eh, (key, count) in blocks.items():
                    for _ in range(count):
                        rebuilt.store(holder, [eh], None, [key], tier)
        assert rebuilt.digest() == self.index.digest()
        dumped = sorted(self.index.dump())
        assert sorted(rebuilt.dump()) == dumped
        assert all(eh < 2**60 and key < 2**64 for _h, _t, eh, key, _c in dumped)
        restored = PrefixIndex.from_export(self.index.export())
        assert restored.digest() == self.index.digest()
        assert restored.stats() == self.index.stats()
        for tokens in FIXED_QUERIES:
            assert restored.match_tiers(_prompt_keys(tokens)) == self.index.match_tiers(_prompt_keys(tokens))


PrefixIndexMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, database=None, derandomize=False
)
test_prefix_index_matches_naive_model = PrefixIndexMachine.TestCase
test_prefix_index_matches_naive_model.__doc__ = (
    "PrefixIndex agrees with a naive per-holder, per-tier model on every step."
)


class SmallTupleMachine(PrefixIndexMachine):
    """The same machine with a shared prefix key's holders kept as a tuple of at most 2 caches (the index
    keeps up to `kvmesh.core.index.SHARED_TUPLE_MAX`), so they change between a tuple and a dict at nearly
    every shared store and removal."""

    def __init__(self) -> None:
        self._tuple_max = index_module.SHARED_TUPLE_MAX
        setattr(index_module, "SHARED_TUPLE_MAX", 2)  # noqa: B010 - a Final of the module, patched for the run
        super().__init__()

    def teardown(self) -> None:
        setattr(index_module, "SHARED_TUPLE_MAX", self._tuple_max)  # noqa: B010
        super().teardown()


SmallTupleMachine.TestCase.settings = PrefixIndexMachine.TestCase.settings
test_prefix_index_with_small_holder_tuples_matches_naive_model = SmallTupleMachine.TestCase
