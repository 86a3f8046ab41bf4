"""Stateful property test: `PrefixIndex` driven by random events agrees with a naive model."""

from __future__ import annotations

import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmesh.core.hashing import local_block_hashes, sequence_hashes
from kvmesh.core.index import Holder, IndexStats, PrefixIndex

BLOCK_SIZE = 2
MAX_DEPTH = 4
"""Longest chain (in blocks) the machine builds, so that shared prefixes are frequent."""
MAX_ORPHANS = 2
WORKERS = ("w0", "w1", "w2")
HOLDERS = tuple(Holder(w, r) for w in WORKERS for r in (0, 1))
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


def _engine_hash(holder: Holder, seq: int, copy: int) -> int:
    """Per-holder engine key of a block: same content on another holder gets another key."""
    return xxhash.xxh3_64_intdigest(f"{holder.worker_id}/{holder.dp_rank}/{copy}/{seq}".encode())


def _prompt_seq(tokens: tuple[int, ...]) -> list[int]:
    return sequence_hashes(local_block_hashes(tokens, BLOCK_SIZE))


class PrefixIndexMachine(RuleBasedStateMachine):
    """Random stores, removals, clears and worker removals against a dictionary model."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(max_orphans=MAX_ORPHANS)
        # holder -> engine hash -> [sequence hash, store count]
        self.model: dict[Holder, dict[int, list[int]]] = {}
        # sequence hash -> tokens of the whole prefix up to that block (content, independent of holder)
        self.paths: dict[int, tuple[int, ...]] = {}
        # engine hash -> the copy number it was derived with
        self.copies: dict[int, int] = {}
        self.live_holders: set[Holder] = set()
        self.orphans: dict[Holder, int] = {}
        self.orphans_dropped = 0
        self.unknown_removals = 0
        self.orphan_serial = 0

    # ------------------------------------------------------------------ rules

    @rule(data=st.data())
    def store_chain(self, data: st.DataObject) -> None:
        """Store a chain from block 0 or under a parent this holder is known to hold."""
        holder = data.draw(st.sampled_from(HOLDERS), label="holder")
        copy = data.draw(st.integers(0, 1), label="copy")
        blocks = self.model.get(holder, {})
        parents = sorted(
            h for h, (seq, _c) in blocks.items() if len(self.paths[seq]) < MAX_DEPTH * BLOCK_SIZE
        )
        parent: int | None = None
        prefix: tuple[int, ...] = ()
        parent_seq: int | None = None
        if parents and data.draw(st.booleans(), label="with_parent"):
            parent = data.draw(st.sampled_from(parents), label="parent")
            parent_seq = blocks[parent][0]
            prefix = self.paths[parent_seq]
        room = MAX_DEPTH - len(prefix) // BLOCK_SIZE
        n_new = data.draw(st.integers(1, room), label="n_new")
        tokens = tuple(
            data.draw(st.lists(st.integers(0, 1), min_size=n_new * BLOCK_SIZE, max_size=n_new * BLOCK_SIZE))
        )
        self._store(holder, copy, parent, parent_seq, prefix=prefix, tokens=tokens)

    @precondition(lambda self: any(self.model.values()))
    @rule(data=st.data())
    def store_again(self, data: st.DataObject) -> None:
        """Store again, from block 0, the whole prefix of a block a holder holds (another physical copy)."""
        holders = sorted(h for h, b in self.model.items() if b)
        holder = data.draw(st.sampled_from(holders), label="holder")
        engine_hash = data.draw(st.sampled_from(sorted(self.model[holder])), label="block")
        seq, _count = self.model[holder][engine_hash]
        self._store(holder, self.copies[engine_hash], None, None, prefix=(), tokens=self.paths[seq])

    def _store(
        self,
        holder: Holder,
        copy: int,
        parent: int | None,
        parent_seq: int | None,
        *,
        prefix: tuple[int, ...],
        tokens: tuple[int, ...],
    ) -> None:
        local = local_block_hashes(tokens, BLOCK_SIZE)
        seqs = sequence_hashes(local, parent_seq)
        engine = [_engine_hash(holder, s, copy) for s in seqs]

        result = self.index.store(holder, engine, parent, local)

        self.live_holders.add(holder)
        model_blocks = self.model.setdefault(holder, {})
        attached = duplicates = 0
        for i, (eh, seq) in enumerate(zip(engine, seqs, strict=True)):
            self.paths[seq] = prefix + tokens[: (i + 1) * BLOCK_SIZE]
            self.copies[eh] = copy
            entry = model_blocks.get(eh)
            if entry is None:
                model_blocks[eh] = [seq, 1]
                attached += 1
            else:
                assert entry[0] == seq
                entry[1] += 1
                duplicates += 1
        assert result.held is False
        assert result.attached == attached
        assert result.duplicates == duplicates
        assert result.dropped_orphans == 0

    @rule(holder=st.sampled_from(HOLDERS), n_blocks=st.integers(1, 2))
    def store_under_unknown_parent(self, holder: Holder, n_blocks: int) -> None:
        """Store under a parent that never arrives: the event is held and matches nothing."""
        self.orphan_serial += 1
        parent = UNKNOWN_ENGINE_HASH + self.orphan_serial
        engine = [UNKNOWN_ENGINE_HASH - 1000 * self.orphan_serial - i for i in range(n_blocks)]
        result = self.index.store(holder, engine, parent, [7] * n_blocks)
        self.live_holders.add(holder)
        held = self.orphans.get(holder, 0) + 1
        dropped = max(0, held - MAX_ORPHANS)
        self.orphans[holder] = held - dropped
        self.orphans_dropped += dropped
        assert result.held is True
        assert result.attached == 0
        assert result.duplicates == 0
        assert result.dropped_orphans == dropped

    @rule(data=st.data())
    def remove_blocks(self, data: st.DataObject) -> None:
        """Remove one copy each of a few engine hashes, known or not, from one holder."""
        holding = sorted(h for h, b in self.model.items() if b)
        pool = holding if holding and data.draw(st.booleans(), label="holding") else list(HOLDERS)
        holder = data.draw(st.sampled_from(pool), label="holder")
        known = sorted(self.model.get(holder, {}))
        choices = st.sampled_from([*known, UNKNOWN_ENGINE_HASH]) if known else st.just(UNKNOWN_ENGINE_HASH)
        hashes = data.draw(st.lists(choices, min_size=1, max_size=3), label="hashes")

        result = self.index.remove(holder, hashes)

        removed = decremented = unknown = 0
        blocks = self.model.get(holder, {})
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
        """Clear one (worker, dp_rank): its blocks and held events go, the holder stays known."""
        expected = len(self.model.pop(holder, {}))
        self.orphans.pop(holder, None)
        assert self.index.clear(holder) == expected

    @rule(worker=st.sampled_from(WORKERS))
    def remove_worker(self, worker: str) -> None:
        """Remove every dp rank of one worker: blocks, held events and the holders themselves go."""
        expected = 0
        for holder in [h for h in HOLDERS if h.worker_id == worker]:
            expected += len(self.model.pop(holder, {}))
            self.live_holders.discard(holder)
            self.orphans.pop(holder, None)
        assert self.index.remove_worker(worker) == expected

    # ------------------------------------------------------------------ invariants

    def _naive_match(self, seq_hashes: list[int]) -> dict[Holder, int]:
        out: dict[Holder, int] = {}
        for holder, blocks in self.model.items():
            present = {seq for seq, count in blocks.values() if count > 0}
            overlap = 0
            for s in seq_hashes:
                if s not in present:
                    break
                overlap += 1
            if overlap:
                out[holder] = overlap
        return out

    @invariant()
    def match_agrees_with_model(self) -> None:
        """Every stored prefix, and a few fixed prompts, match exactly as the model says."""
        queries = set(self.paths.values()) | set(FIXED_QUERIES)
        for tokens in sorted(queries):
            seq = _prompt_seq(tokens)
            assert self.index.match(seq) == self._naive_match(seq), tokens

    @invariant()
    def stats_agree_with_model(self) -> None:
        """Holder, block, prefix, orphan and unknown-removal counts equal the model's."""
        assert self.index.stats() == IndexStats(
            holders=len(self.live_holders),
            blocks=sum(len(b) for b in self.model.values()),
            distinct_prefixes=len({seq for b in self.model.values() for seq, _c in b.values()}),
            held_orphans=sum(self.orphans.values()),
            orphans_expired=self.orphans_dropped,
            unknown_removals=self.unknown_removals,
        )
        assert self.index.holders() == sorted(self.live_holders)
        for holder in HOLDERS:
            assert self.index.block_count(holder) == len(self.model.get(holder, {}))

    @invariant()
    def digest_equals_rebuilt_model(self) -> None:
        """An index rebuilt from the model's entries has the same digest and dump."""
        rebuilt = PrefixIndex()
        for holder, blocks in self.model.items():
            for eh, (seq, count) in blocks.items():
                for _ in range(count):
                    rebuilt.store(holder, [eh], None, [seq])
        assert rebuilt.digest() == self.index.digest()
        assert sorted(rebuilt.dump()) == sorted(self.index.dump())


PrefixIndexMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, database=None, derandomize=False
)
test_prefix_index_matches_naive_model = PrefixIndexMachine.TestCase
test_prefix_index_matches_naive_model.__doc__ = (
    "PrefixIndex agrees with a naive per-holder model on every step."
)
