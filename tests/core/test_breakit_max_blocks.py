"""Attacks on the block bound (``IndexState(max_blocks=N)``): replicas that must agree, a bound that must hold
after every stream message, and evictions as the only loss.

* A differential property test: random streams (stores with and without known parents, StoredKeys, Placed,
  removals, duplicate copies, tiers, engine and ingest clears, new epochs, worker removals, index resets,
  another model and another block size, messages delivered twice or swapped so that holders hold them) are
  applied to a bounded replica; a second replica is restored from the first one's encoded snapshot at random
  points and must end equal to it (blocks, store order as seen by later cuts, counters, digest). Before every
  message an unevicting copy of the pre-state (same store order, bound out of reach) applies the message too,
  and a plain reference of the rule (the highest common level that brings the total N/64 below N; each cache
  above it keeps its newest blocks) must give exactly the bounded replica's blocks.
* A message that fails half-way (a hostile or broken event after valid ones) must still leave the state within
  its bound, and a replica restored from a snapshot taken right then must not diverge.
* A held orphan whose block the engine removed must not come back when its parent is stored again (an
  over-count a bound makes routine: the parent of a new block is often an evicted one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.core.events import (
    Cleared,
    Event,
    EventsMessage,
    IndexReset,
    Message,
    Placed,
    Removed,
    Stored,
    StoredKeys,
    WorkerRemoved,
)
from kvmesh.core.hashing import local_block_hashes, prefix_keys
from kvmesh.core.index import Holder
from kvmesh.core.snapshot import decode_snapshot, encode_snapshot
from kvmesh.core.state import EVICT_SLACK, IndexState

BS = 4
CHAIN = 6
"""Nodes ``k`` with ``k % CHAIN == 0`` start a chain (block 0); the others follow node ``k - 1``."""
NODES = 24
LOCAL = local_block_hashes(list(range(4 * NODES)), BS)  # one local hash per node (its own tokens)

Cache = tuple[str, int, Holder, str]
"""(model, block size, holder, tier)."""


def _engine(node: int) -> int:
    """A node's engine hash: a function of its chain position, as a real engine's is (half of them above the
    index's folding prime)."""
    return node + 1 + (2**63 if node % 2 else 0)


def _prefix(node: int) -> int:
    root = node - node % CHAIN
    return prefix_keys(LOCAL[root : node + 1])[-1]


# ---------------------------------------------------------------------------------------- helpers


def _cache_blocks(state: IndexState) -> dict[Cache, set[tuple[int, int, int]]]:
    """(engine key, prefix key, store count) per cache."""
    out: dict[Cache, set[tuple[int, int, int]]] = {}
    for model, by_size in state._indexes.items():
        for bs, ix in by_size.items():
            for holder, tier, key, prefix, count in ix.dump():
                out.setdefault((model, bs, holder, tier), set()).add((key, prefix, count))
    return out


def _store_order(state: IndexState) -> dict[Cache, list[int]]:
    """Each cache's engine keys, least recently stored first (a keep-order state's export order)."""
    out: dict[Cache, list[int]] = {}
    for model, bs, ix in state.export().indexes:
        for h in ix.holders:
            if len(h.engine):
                out[(model, bs, h.holder, "GPU")] = h.engine.tolist()
            for t in h.tiers:
                if len(t.engine):
                    out[(model, bs, h.holder, t.medium)] = t.engine.tolist()
    return out


def _reference_cut(order: dict[Cache, list[int]], bound: int) -> dict[Cache, set[int]]:
    """The eviction rule, plainly: free down to ``bound − max(1, ⌊bound/64⌋)`` by cutting every cache above the
    highest common level that frees enough, each keeping its newest blocks."""
    total = sum(len(keys) for keys in order.values())
    if total <= bound:
        return {c: set(keys) for c, keys in order.items()}
    need = total - max(0, bound - max(1, int(bound * EVICT_SLACK)))
    level = max(len(keys) for keys in order.values())
    while level > 0 and sum(max(0, len(keys) - level) for keys in order.values()) < need:
        level -= 1
    kept = {c: set(keys[max(0, len(keys) - level) :]) for c, keys in order.items()}
    return {c: keys for c, keys in kept.items() if keys}


def _restore(state: IndexState, bound: int) -> IndexState:
    return IndexState.from_export(decode_snapshot(encode_snapshot(state.export())), max_blocks=bound)


def _apply(state: IndexState, seq: int, message: Message) -> None:
    """Apply as the stream reader does: a message that raises is skipped (`kvmesh.core.apply`)."""
    try:
        state.apply(seq, message)
    except Exception:
        state.skip(seq)


# ---------------------------------------------------------------------------------------- the stream

_WORKERS = {"a": ("m", BS), "b": ("m", BS), "c": ("m", 2 * BS), "d": ("lora", BS)}

_event = st.one_of(
    st.tuples(st.just("store"), st.integers(0, NODES - 1), st.integers(1, 4), st.just(None)),
    st.tuples(st.just("store"), st.integers(0, NODES - 1), st.integers(1, 3), st.sampled_from([None, "CPU", "disk"])),
    st.tuples(st.just("keys"), st.integers(0, NODES - 1), st.integers(1, 3), st.sampled_from([None, "CPU"])),
    st.tuples(st.just("place"), st.integers(0, NODES - 1), st.integers(1, 3), st.sampled_from(["CPU", "disk"])),
    st.tuples(st.just("remove"), st.integers(0, NODES - 1), st.integers(1, 3), st.sampled_from([None, None, "CPU"])),
    st.tuples(st.just("clear"), st.just(0), st.just(0), st.sampled_from(["engine", "gap"])),
)  # fmt: skip

_holder_events = st.tuples(
    st.just("events"),
    st.sampled_from(["a", "a", "a", "b", "c", "d"]),
    st.sampled_from([0, 0, 0, 1]),
    st.lists(_event, min_size=1, max_size=3),
)
_rare: st.SearchStrategy[tuple[str, str, int, list[tuple[str, int, int, str | None]]]] = st.one_of(
    st.tuples(st.just("epoch"), st.sampled_from(sorted(_WORKERS)), st.integers(0, 1), st.just([])),
    st.tuples(st.just("worker_removed"), st.sampled_from(sorted(_WORKERS)), st.just(0), st.just([])),
    st.tuples(st.just("reset"), st.just(""), st.just(0), st.just([])),
)
_step = st.one_of(
    _holder_events,
    _holder_events,
    _holder_events,
    _holder_events,
    st.tuples(st.sampled_from(["swap", "twice", "snapshot"]), st.just(""), st.just(0), st.just([])),
    _rare,
)


def _events(spec: Sequence[tuple[str, int, int, str | None]]) -> list[Event]:
    out: list[Event] = []
    for kind, node, n, medium in spec:
        nodes = list(range(node, min(node + n, node - node % CHAIN + CHAIN)))
        engine = [_engine(k) for k in nodes]
        parent = None if node % CHAIN == 0 else _engine(node - 1)
        if kind == "store":
            out.append(Stored(engine, parent, [LOCAL[k] for k in nodes], medium))
        elif kind == "keys":
            out.append(StoredKeys([_prefix(k) for k in nodes], parent, medium, engine))
        elif kind == "place":
            out.append(Placed(engine, medium))
        elif kind == "remove":
            out.append(Removed(engine, medium))
        else:
            assert medium is not None
            out.append(Cleared(medium))
    return out


def _stream(
    steps: list[tuple[str, str, int, list[tuple[str, int, int, str | None]]]],
) -> tuple[list[Message], set[int]]:
    """The stream's messages and the positions (0-based, before that message) where a snapshot is taken."""
    seqs: dict[tuple[str, int], int] = {}
    epochs: dict[tuple[str, int], int] = {}
    messages: list[Message] = []
    snaps: set[int] = set()
    reset = 0
    for kind, worker, rank, spec in steps:
        if kind in ("events", "epoch"):
            key = (worker, rank)
            if kind == "epoch":
                epochs[key] = epochs.get(key, 1) + 1
                seqs[key] = 0
            events = _events([("store", 0, 2, None)] if kind == "epoch" else spec)
            seq = seqs.get(key, 0)
            seqs[key] = seq + 1
            model, bs = _WORKERS[worker]
            messages.append(
                EventsMessage(
                    worker_id=worker,
                    dp_rank=rank,
                    model=model,
                    block_size=bs,
                    epoch=epochs.get(key, 1),
                    seq=seq,
                    events=events,
                )
            )
        elif kind == "worker_removed":
            messages.append(WorkerRemoved(worker_id=worker, model=_WORKERS[worker][0]))
        elif kind == "reset":
            reset += 1
            messages.append(IndexReset(epoch=reset))
        elif kind == "swap" and messages:
            # The last message and the previous one of its holder change places: a re-ordered stream.
            last = messages[-1]
            if isinstance(last, EventsMessage):
                for j in range(len(messages) - 2, -1, -1):
                    m = messages[j]
                    if isinstance(m, EventsMessage) and (m.worker_id, m.dp_rank) == (
                        last.worker_id,
                        last.dp_rank,
                    ):
                        messages[j], messages[-1] = last, m
                        break
        elif kind == "twice" and messages:
            messages.append(messages[-1])
        elif kind == "snapshot":
            snaps.add(len(messages))
    return messages, snaps


# ---------------------------------------------------------------------------------------- the property


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_step, min_size=10, max_size=60), st.integers(1, 12))
def test_bounded_replicas_agree_and_cut_exactly_as_the_reference_rule(
    steps: list[tuple[str, str, int, list[tuple[str, int, int, str | None]]]], bound: int
) -> None:
    messages, snaps = _stream(steps)
    whole = IndexState(max_blocks=bound)
    restored: IndexState | None = None
    for i, message in enumerate(messages):
        seq = i + 1
        if i in snaps:
            restored = _restore(whole, bound)
        # What the message does before any cut: an unevicting copy keeping the same store order.
        free = IndexState.from_export(whole.export(), max_blocks=10**12)
        _apply(free, seq, message)
        evicted = whole.counters.evicted_blocks
        _apply(whole, seq, message)
        if restored is not None:
            _apply(restored, seq, message)
        assert whole.block_total() <= bound
        expected = _reference_cut(_store_order(free), bound)
        got = {c: {k for k, _p, _n in blocks} for c, blocks in _cache_blocks(whole).items()}
        assert got == expected
        assert whole.counters.evicted_blocks - evicted == free.block_total() - whole.block_total()
        # Nothing but evictions: every kept block is the unevicting copy's, with its prefix and count.
        pre = _cache_blocks(free)
        for c, blocks in _cache_blocks(whole).items():
            assert blocks <= pre[c]
        assert whole.digest() == whole.digest_from_scratch()
    if restored is None:
        return
    assert _cache_blocks(restored) == _cache_blocks(whole)
    assert _store_order(restored) == _store_order(whole)
    assert restored.counters == whole.counters
    assert restored.digest() == whole.digest()
    assert restored.holder_health() == whole.holder_health()


# ---------------------------------------------------------------------------------------- failing messages


def _msg(seq: int, events: list[Event], worker: str = "a") -> EventsMessage:
    return EventsMessage(
        worker_id=worker, dp_rank=0, model="m", block_size=BS, epoch=1, seq=seq, events=events
    )


def test_a_message_that_fails_half_way_still_leaves_the_state_within_its_bound() -> None:
    """Bound 8: a message stores 20 blocks, then carries a broken Stored (one engine hash, no local hash). The
    apply raises (the reader skips the message), but the 20 blocks are in: the state must be cut all the same
    (to 7: the 7 newest)."""
    state = IndexState(max_blocks=8)
    with contextlib.suppress(ValueError):
        state.apply(1, _msg(0, [Stored(list(range(1, 21)), None, LOCAL[:20]), Stored([99], None, [])]))
    state.skip(1)
    assert state.block_total() == 7
    assert state.counters.evicted_blocks == 13
    assert {k for _h, _t, k, _p, _c in state._indexes["m"][BS].dump()} == set(range(14, 21))


def test_a_replica_restored_right_after_a_failed_message_does_not_diverge() -> None:
    """The same failed message, a snapshot right after it, then a removal of a's newest block. The replica that
    applied everything and the one restored from the snapshot must hold the same blocks."""
    whole = IndexState(max_blocks=8)
    _apply(whole, 1, _msg(0, [Stored(list(range(1, 21)), None, LOCAL[:20]), Stored([99], None, [])]))
    restored = _restore(whole, 8)
    for s in (whole, restored):
        _apply(s, 2, _msg(1, [Removed([20])]))
    assert _cache_blocks(restored) == _cache_blocks(whole)
    assert restored.digest() == whole.digest()


# ---------------------------------------------------------------------------------------- over-count


def test_an_orphan_whose_block_was_removed_does_not_come_back_with_its_parent() -> None:
    """Bound 4 (slack 1): a stores P then four other chains; the cut (to 3) drops P and the next oldest. The
    engine then stores C under P (held: P is not indexed), removes C (the held copy goes), drops P and
    recomputes it. The engine holds P and not C: a match of P + C is 1, not 2, and the state holds 4 blocks
    (C never attached, so nothing more is cut)."""
    p, c = 1000, 1001
    messages = [_msg(0, [Stored([p], None, LOCAL[:1])])]
    messages += [_msg(i + 1, [Stored([2000 + i], None, [LOCAL[10 + i]])]) for i in range(4)]
    messages += [
        _msg(5, [Stored([c], p, LOCAL[1:2])]),
        _msg(6, [Removed([c])]),
        _msg(7, [Removed([p])]),
        _msg(8, [Stored([p], None, LOCAL[:1])]),
    ]
    state = IndexState(max_blocks=4)
    for seq, m in enumerate(messages, start=1):
        state.apply(seq, m)
    assert (state.counters.evicted_blocks, state.block_total()) == (2, 4)
    (only,) = state.match_local_hashes("m", LOCAL[:2]).candidates
    assert only.overlap_blocks == 1
