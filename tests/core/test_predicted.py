"""`kvmesh.core.predicted.PredictedBlocks`: exact cases and a property test against a plain reference model."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.index import Holder
from kvmesh.core.predicted import PredictedBlocks

A, B, C = Holder("a", 0), Holder("b", 0), Holder("a", 1)


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="need a ttl_s, a capacity_blocks or both"):
        PredictedBlocks(ttl_s=None)
    with pytest.raises(ValueError, match="ttl_s must be"):
        PredictedBlocks(ttl_s=0.0)
    with pytest.raises(ValueError, match="ttl_s must be"):
        PredictedBlocks(ttl_s=-1.0)
    with pytest.raises(ValueError, match="ttl_s must be"):
        PredictedBlocks(ttl_s=math.inf)
    with pytest.raises(ValueError, match="capacity_blocks must be >= 1"):
        PredictedBlocks(ttl_s=1.0, capacity_blocks=0)
    p = PredictedBlocks(ttl_s=None, capacity_blocks=4)
    with pytest.raises(ValueError, match="must be >= 1 block"):
        p.set_capacity(A, 0)
    assert (p.ttl_s, p.capacity(A)) == (None, 4)


def test_leading_run_per_holder_stops_at_the_first_miss() -> None:
    p = PredictedBlocks(ttl_s=2.0)
    p.add(A, [1, 2, 3, 4], 0.0)
    p.add(B, [1, 2, 9], 0.0)
    p.add(C, [2, 3, 4], 0.0)  # holds blocks 1.. of the prompt but not block 0: no leading run
    assert p.match([1, 2, 3, 4, 5], 0.5) == {B: 2, A: 4}
    assert p.match([1, 2, 3], 0.5) == {B: 2, A: 3}
    assert p.match([7, 1, 2], 0.5) == {}
    assert p.match([], 0.5) == {}
    assert (len(p), p.block_count(A), p.block_count(B), p.block_count(Holder("z", 0))) == (10, 4, 3, 0)


def test_entries_expire_ttl_after_their_last_add() -> None:
    p = PredictedBlocks(ttl_s=2.0)
    p.add(A, [1, 2, 3], 10.0)
    p.add(B, [1, 2], 11.0)
    assert p.match([1, 2, 3], 11.999) == {B: 2, A: 3}
    assert p.match([1, 2, 3], 12.0) == {B: 2}  # live while now < added + ttl
    p.add(B, [1], 12.5)  # refreshes block 0 only: block 1 still expires at 13
    assert p.match([1, 2, 3], 13.0) == {B: 1}
    assert p.expire(13.0) == 4  # A's 3 and B's block 1
    assert (p.block_count(A), p.block_count(B), p.holders()) == (0, 1, [B])
    assert p.expire(14.5) == 1
    assert len(p) == 0


def test_time_never_runs_backwards() -> None:
    """A time below the latest one given reads as the latest: an entry expired stays expired."""
    p = PredictedBlocks(ttl_s=1.0)
    p.add(A, [1], 0.0)
    assert p.match([1], 5.0) == {}
    assert p.match([1], 0.5) == {}
    p.add(B, [1], 0.0)  # dated 5.0: live until 6.0
    assert p.match([1], 5.9) == {B: 1}


def test_capacity_keeps_each_prompts_head_and_drops_the_oldest_tails_first() -> None:
    """Leading blocks of a prompt are its most recent entries; the least recently used leave first."""
    p = PredictedBlocks(ttl_s=None, capacity_blocks=5)
    p.add(A, [1, 2, 3], 0.0)
    p.add(A, [7, 8, 9], 1.0)  # 6 entries: the oldest prompt's tail (3) goes
    assert p.match([1, 2, 3], 2.0) == {A: 2}
    assert p.match([7, 8, 9], 2.0) == {A: 3}
    p.add(A, [1], 3.0)  # block 0 of the first prompt is touched again: 2 is now the oldest, then 9
    p.add(A, [4, 5], 4.0)
    assert p.block_count(A) == 5
    assert p.match([1, 2], 5.0) == {A: 1}
    assert p.match([7, 8, 9], 5.0) == {A: 2}
    assert p.match([4, 5], 5.0) == {A: 2}


def test_a_prompt_longer_than_the_capacity_keeps_its_leading_blocks() -> None:
    p = PredictedBlocks(ttl_s=None, capacity_blocks=3)
    p.add(A, [1, 2, 3, 4, 5], 0.0)
    assert p.match([1, 2, 3, 4, 5], 0.0) == {A: 3}
    assert p.block_count() == 3


def test_per_holder_capacity_overrides_the_default_and_trims_at_once() -> None:
    p = PredictedBlocks(ttl_s=60.0)  # no default capacity: only the TTL bounds a holder without its own
    p.add(A, list(range(10)), 0.0)
    p.add(B, list(range(10)), 0.0)
    p.set_capacity(A, 4)
    assert p.match(list(range(10)), 1.0) == {A: 4, B: 10}
    p.add(A, [100, 101], 1.0)
    assert p.match(list(range(10)), 1.0) == {A: 2, B: 10}
    p.set_capacity(A, None)
    assert p.capacity(A) is None
    p.add(A, list(range(10)), 2.0)
    assert p.match(list(range(10)), 2.0) == {A: 10, B: 10}


def test_forget_drops_a_holder_only() -> None:
    p = PredictedBlocks(ttl_s=5.0)
    p.add(A, [1, 2], 0.0)
    p.add(B, [1, 2], 0.0)
    assert p.forget(A) == 2
    assert p.forget(A) == 0
    assert p.match([1, 2], 1.0) == {B: 2}
    assert p.holders() == [B]


def test_entries_and_restore_carry_a_cache_to_another_replica_in_recency_order() -> None:
    """What a starting router replica does with a peer's sync: its own newer entries stay on top, the peer's go
    under them, oldest out first past the capacity."""
    peer = PredictedBlocks(ttl_s=None, capacity_blocks=6)
    peer.add(A, [1, 2, 3], 0.0)
    peer.add(A, [4, 5], 1.0)  # LRU order now: 3, 2, 1, 5, 4 (a prompt's head is its most recent)
    keys, left = peer.entries(A, 2.0)
    assert (keys, left) == ([3, 2, 1, 5, 4], None)
    assert peer.entries(B, 2.0) == ([], None)
    fresh = PredictedBlocks(ttl_s=None, capacity_blocks=5)
    fresh.add(A, [9, 4], 2.0)  # a note that arrived before the sync answer: newer than the peer's copy
    assert fresh.entries(A, 2.0) == ([4, 9], None)
    assert fresh.restore(A, keys, left, 2.0) == 3  # 4 is held already; room for 3 of the other 4
    assert fresh.entries(A, 2.0) == ([2, 1, 5, 4, 9], None)  # the peer's oldest, 3, did not fit
    assert (fresh.match([1], 3.0), fresh.match([3], 3.0), fresh.match([9, 4], 3.0)) == ({A: 1}, {}, {A: 2})
    assert fresh.restore(B, [], None, 2.0) == 0 and fresh.holders() == [A]
    with pytest.raises(ValueError, match="2 keys but 1 remaining times"):
        fresh.restore(A, [7, 8], [1.0], 2.0)


def test_restored_entries_keep_their_remaining_time_and_expire_under_the_newer_ones() -> None:
    peer = PredictedBlocks(ttl_s=10.0)
    peer.add(A, [1, 2], 0.0)
    peer.add(A, [3], 4.0)
    keys, left = peer.entries(A, 6.0)
    assert (keys, left) == ([2, 1, 3], [4.0, 4.0, 8.0])
    assert left is not None
    assert peer.entries(A, 10.0) == ([3], [4.0])  # expired ones are not sent
    fresh = PredictedBlocks(ttl_s=10.0)
    fresh.add(A, [5], 100.0)  # lives until 110
    # 3 had 8 s left, 1 and 2 had 4 s; one more entry claims 50 s (more than the TTL): capped at the one above
    assert fresh.restore(A, [*keys, 7], [*left, 50.0], 100.0) == 4
    got, remaining = fresh.entries(A, 100.0)
    assert (got, remaining) == ([2, 1, 3, 7, 5], [4.0, 4.0, 8.0, 10.0, 10.0])
    assert fresh.restore(A, [8, 9], [0.0, math.nan], 100.0) == 0  # expired or not a number: left out
    assert fresh.match([2], 104.0) == {} and fresh.match([3], 104.0) == {A: 1}
    assert fresh.expire(108.0) == 3
    assert fresh.entries(A, 108.0) == ([7, 5], [2.0, 2.0])


# ---------------------------------------------------------------------- against a reference model


class _Reference:
    """The same rules in the plainest form: per holder a list of [key, expiry], least recently used first."""

    def __init__(self, ttl_s: float | None, capacity: int | None) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self.own: dict[Holder, int] = {}
        self.held: dict[Holder, list[list[float]]] = {}
        self.now = -math.inf

    def clock(self, now_s: float) -> float:
        self.now = max(self.now, now_s)
        return self.now

    def cap(self, h: Holder) -> int | None:
        return self.own.get(h, self.capacity)

    def trim(self, h: Holder) -> None:
        cap, rows = self.cap(h), self.held.get(h, [])
        while cap is not None and len(rows) > cap:
            rows.pop(0)

    def add(self, h: Holder, keys: list[int], now_s: float) -> None:
        now = self.clock(now_s)
        rows = self.held.setdefault(h, [])
        rows[:] = [r for r in rows if r[1] > now]
        exp = math.inf if self.ttl_s is None else now + self.ttl_s
        for k in reversed(keys):
            rows[:] = [r for r in rows if r[0] != k]
            rows.append([k, exp])
        self.trim(h)

    def match(self, keys: list[int], now_s: float) -> dict[Holder, int]:
        now = self.clock(now_s)
        out = {}
        for h, rows in self.held.items():
            live = {int(k) for k, e in rows if e > now}
            n = 0
            while n < len(keys) and keys[n] in live:
                n += 1
            if n:
                out[h] = n
        return out

    def expire(self, now_s: float) -> int:
        now = self.clock(now_s)
        if self.ttl_s is None:
            return 0
        before = sum(len(r) for r in self.held.values())
        for rows in self.held.values():
            rows[:] = [r for r in rows if r[1] > now]
        return before - sum(len(r) for r in self.held.values())

    def count(self) -> int:
        return sum(len(r) for r in self.held.values())


_HOLDERS = [Holder("w0", 0), Holder("w1", 0), Holder("w1", 1)]
_keys = st.lists(st.integers(0, 7), max_size=6)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), _keys, st.floats(0, 1)),
        st.tuples(st.just("match"), st.just(0), _keys, st.floats(0, 1)),
        st.tuples(st.just("expire"), st.just(0), st.just([]), st.floats(0, 1)),
        st.tuples(st.just("forget"), st.integers(0, 2), st.just([]), st.just(0.0)),
        st.tuples(st.just("cap"), st.integers(0, 2), st.just([]), st.floats(0, 1)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(
    ttl=st.one_of(st.none(), st.floats(0.05, 2.0)),
    capacity=st.one_of(st.none(), st.integers(1, 6)),
    ops=_ops,
)
def test_matches_a_reference_model(
    ttl: float | None, capacity: int | None, ops: list[tuple[object, ...]]
) -> None:
    """Any sequence of adds (time moving forward by up to 1 s, sometimes backward), matches, expiries,
    forgets and capacity changes gives the reference model's answers, entry counts included."""
    if ttl is None and capacity is None:
        capacity = 3
    p, ref = PredictedBlocks(ttl_s=ttl, capacity_blocks=capacity), _Reference(ttl, capacity)
    now = 0.0
    for op, who, keys, step in ops:
        assert isinstance(who, int) and isinstance(keys, list) and isinstance(step, float)
        h = _HOLDERS[who]
        now += step - 0.1  # mostly forward; a small step goes back (clamped by both)
        if op == "add":
            p.add(h, keys, now)
            ref.add(h, keys, now)
        elif op == "match":
            got = p.match(keys, now)
            assert got == ref.match(keys, now)
            assert list(got.values()) == sorted(got.values())
        elif op == "expire":
            assert p.expire(now) == ref.expire(now)
        elif op == "forget":
            assert p.forget(h) == len(ref.held.pop(h, []))
        else:
            blocks = None if step < 0.3 else int(step * 8) + 1
            p.set_capacity(h, blocks)
            if blocks is None:
                ref.own.pop(h, None)
            else:
                ref.own[h] = blocks
            ref.trim(h)
        # expired entries linger in both until dropped, so counts agree exactly
        assert len(p) == ref.count()
        for hh in _HOLDERS:
            assert p.block_count(hh) == len(ref.held.get(hh, []))
