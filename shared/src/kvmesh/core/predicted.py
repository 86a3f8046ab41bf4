"""Predicted cache entries (pure): the prefixes a router expects a worker to hold because it sent them there.

A router learns what a worker caches from the engine's KV events, which arrive some time after its answer
(a real vLLM engine here published a request's BlockStored up to ~190 ms after the reply, on a loaded 2-core
machine). A follow-up routed in that window sees a stale picture: a burst of requests sharing one new prefix
is spread as if no worker held it. `PredictedBlocks` is the router's own record of its decisions: when it
sends a prompt to a holder it counts the prompt's full blocks as provisionally held there.

Two uses, one structure:

* **Predicted entries beside the KV events** (Dynamo's ``--router-predicted-ttl-secs``, llm-d's speculative
  indexing; both off by default): ``PredictedBlocks(ttl_s=T)``. An entry counts for ``T`` seconds after the
  decision that added (or last refreshed) it, until the engine's BlockStored has had time to confirm it; a
  candidate's overlap is then ``max(indexed overlap, predicted overlap)``.
* **Engines without KV events** (Dynamo's capacity-bounded approximate mode): ``PredictedBlocks(ttl_s=None,
  capacity_blocks=C)``. The decisions are the only source; each holder keeps at most its KV capacity in
  blocks (``WorkerRecord.kv_capacity_blocks`` from the registry, `set_capacity`), least recently used out
  first, as the engine's own LRU would.

Keys are the prompt's *prefix keys*: the sequence hash of each full block, block 0 first, exactly what the
index stores and matches (`kvmesh.core.tables.prompt_keys` for token ids; `kvmesh.core.hashing`), so
predicted and indexed overlaps are in the same units (blocks of the model's block size) and comparable.

Recency order within a prompt: `add` touches the prompt's keys **last block first**, so the prompt's leading
blocks end up the most recent and its tail the least. An engine's LRU frees a finished request's blocks tail
first (vLLM appends them to its free queue in reverse order), so under pressure a chain loses its tail and
keeps its head; the head is also what every later prompt with the same prefix reuses. Evicting the head first
would leave a tail that no leading-run match can reach.

Time: every method that needs it takes ``now_s`` (any monotonic seconds; this module reads no clock). An entry
added at ``t`` is live while ``now_s < t + ttl_s``. Time never runs backwards here: a ``now_s`` below the
latest one given is read as that latest time, which keeps the expiry order of each holder's entries equal to
its recency order (so `expire` pops from the old end and stops at the first live entry).

Costs: `add` is O(prompt blocks + entries evicted); `match` is O(prompt blocks + Σ matched blocks over the
holders matched), never O(all holders × blocks); `expire` is O(holders + entries dropped); `forget`,
`entries` and `restore` are O(the holder's entries).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.core.index import Holder

__all__ = ["PredictedBlocks"]


class PredictedBlocks:
    """Per holder, the prefix keys a router predicts that holder now caches, with expiry and an LRU bound.

    Owns, per `Holder`, an ordered map prefix key → expiry time (least recently used first) and a global map
    prefix key → holders that hold it (entries of every holder, expired ones included until dropped).

    Args:
        ttl_s: seconds an entry counts after the decision that added or refreshed it (> 0), or None: entries
            never expire (only the capacity bound drops them).
        capacity_blocks: the most entries a holder keeps (≥ 1), least recently used out first; None: no
            bound unless `set_capacity` gives the holder one.

    Raises:
        ValueError: ``ttl_s`` is not > 0 (nor None), ``capacity_blocks`` is below 1, or both are None (the
            entries would grow without bound).
    """

    __slots__ = ("_by_key", "_capacity", "_capacity_of", "_held", "_now_s", "_ttl_s")

    def __init__(self, *, ttl_s: float | None, capacity_blocks: int | None = None) -> None:
        if ttl_s is not None and not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError(f"ttl_s must be a finite number of seconds > 0, or None; got {ttl_s!r}")
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, or None; got {capacity_blocks!r}")
        if ttl_s is None and capacity_blocks is None:
            raise ValueError(
                "predicted entries need a ttl_s, a capacity_blocks or both: with neither they never leave"
            )
        self._ttl_s = ttl_s
        self._capacity = capacity_blocks
        self._capacity_of: dict[Holder, int] = {}
        self._held: dict[Holder, OrderedDict[int, float]] = {}
        self._by_key: dict[int, dict[Holder, None]] = {}
        self._now_s = -math.inf

    # ------------------------------------------------------------------ configuration

    @property
    def ttl_s(self) -> float | None:
        """Seconds an entry counts after its last `add` (None: until evicted)."""
        return self._ttl_s

    def capacity(self, holder: Holder) -> int | None:
        """The most entries ``holder`` keeps (its own capacity, else the default; None: unbounded)."""
        return self._capacity_of.get(holder, self._capacity)

    def set_capacity(self, holder: Holder, blocks: int | None) -> None:
        """Give ``holder`` its own capacity (its worker's ``kv_capacity_blocks``), or None: the default again.

        Entries past the new capacity are dropped at once, least recently used first.

        Raises:
            ValueError: ``blocks`` is below 1.
        """
        if blocks is None:  # the constructor refused neither TTL nor default: something still bounds it
            self._capacity_of.pop(holder, None)
        else:
            if blocks < 1:
                raise ValueError(f"capacity of {holder} must be >= 1 block, got {blocks}")
            self._capacity_of[holder] = blocks
        entries = self._held.get(holder)
        if entries is not None:
            self._trim(holder, entries)

    # ------------------------------------------------------------------ changes

    def add(self, holder: Holder, keys: Sequence[int], now_s: float) -> None:
        """Record that ``holder`` was sent a prompt with these prefix keys at ``now_s``.

        Each key becomes (or is refreshed as) one of the holder's most recently used entries, expiring at
        ``now_s + ttl_s``; the leading keys end up the most recent (module docstring). Past the holder's
        capacity the least recently used entries are dropped (a prompt longer than the capacity keeps only
        its leading ``capacity`` keys). The holder's expired entries are dropped on the way.

        Args:
            holder: the (worker, dp rank) chosen.
            keys: the prompt's prefix keys, block 0 first (unsigned 64-bit ints).
            now_s: the decision's time, in seconds.
        """
        now = self._clock(now_s)
        entries = self._held.get(holder)
        if entries is None:
            entries = self._held[holder] = OrderedDict()
        self._drop_expired(holder, entries, now)
        expiry = math.inf if self._ttl_s is None else now + self._ttl_s
        by_key = self._by_key
        for key in reversed(keys):
            if key in entries:
                entries.move_to_end(key)
                entries[key] = expiry
            else:
                entries[key] = expiry
                holders = by_key.get(key)
                if holders is None:
                    by_key[key] = {holder: None}
                else:
                    holders[holder] = None
        self._trim(holder, entries)

    def forget(self, holder: Holder) -> int:
        """Drop every entry of ``holder`` (its worker left, or its engine cleared its cache).

        Its own capacity (`set_capacity`) stays. Returns the number of entries dropped.
        """
        entries = self._held.pop(holder, None)
        if entries is None:
            return 0
        for key in entries:
            self._unindex(key, holder)
        return len(entries)

    def expire(self, now_s: float) -> int:
        """Drop every entry expired at ``now_s``; return how many were dropped."""
        now = self._clock(now_s)
        if self._ttl_s is None:
            return 0
        dropped = 0
        for holder in list(self._held):
            dropped += self._drop_expired(holder, self._held[holder], now)
        return dropped

    def restore(
        self, holder: Holder, keys: Sequence[int], remaining_s: Sequence[float] | None, now_s: float
    ) -> int:
        """Take a peer's entries of ``holder`` (`entries`) as entries older than any already held.

        A starting router replica subscribes to the notes before it asks a peer for its entries, so what it
        holds already is newer than the peer's copy: ``keys`` go in *under* it (least recently used end) and a
        key already held keeps its place and expiry. Each restored entry expires ``remaining_s`` after
        ``now_s`` (never later than the entry above it, so expiry order stays recency order); ``remaining_s``
        None or a structure without TTL: entries that never expire. Past the holder's capacity the oldest go.

        Args:
            holder: the (worker, dp rank).
            keys: its entries, least recently used first (as `entries` gives them).
            remaining_s: seconds each entry still had to live at the peer (same length as ``keys``), or None.
            now_s: the time of the restore, in seconds.

        Returns:
            the number of entries added (keys already held, expired ones, and ones past the capacity left out).

        Raises:
            ValueError: ``remaining_s`` is not as long as ``keys``.
        """
        if remaining_s is not None and len(remaining_s) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(remaining_s)} remaining times")
        now = self._clock(now_s)
        entries = self._held.get(holder)
        if entries is None:
            entries = self._held[holder] = OrderedDict()
        cap = self.capacity(holder)
        room = math.inf if cap is None else cap - len(entries)
        ceiling = next(iter(entries.values())) if entries else math.inf
        added = 0
        by_key = self._by_key
        for i in range(len(keys) - 1, -1, -1):  # newest first, each one under the last
            if added >= room:
                break
            key = keys[i]
            if key in entries:
                continue
            if self._ttl_s is None:
                expiry = math.inf
            else:
                left = remaining_s[i] if remaining_s is not None else self._ttl_s
                if not left > 0:
                    continue  # expired (or not a number)
                expiry = min(now + min(left, self._ttl_s), ceiling)
                ceiling = expiry
            entries[key] = expiry
            entries.move_to_end(key, last=False)
            holders = by_key.get(key)
            if holders is None:
                by_key[key] = {holder: None}
            else:
                holders[holder] = None
            added += 1
        if not entries:
            del self._held[holder]
        return added

    # ------------------------------------------------------------------ queries

    def entries(self, holder: Holder, now_s: float) -> tuple[list[int], list[float] | None]:
        """Return ``holder``'s live entries, least recently used first, and the seconds each has left to live
        at ``now_s`` (None when entries never expire): what `restore` takes on another replica."""
        now = self._clock(now_s)
        held = self._held.get(holder)
        if not held:
            return [], None
        if self._ttl_s is None:
            return list(held), None
        keys: list[int] = []
        left: list[float] = []
        for key, expiry in held.items():
            if expiry > now:
                keys.append(key)
                left.append(expiry - now)
        return keys, left

    def match(self, keys: Sequence[int], now_s: float) -> dict[Holder, int]:
        """Return, per holder, how many leading keys of a prompt it holds live at ``now_s``.

        Args:
            keys: the prompt's prefix keys, block 0 first.
            now_s: the time of the question, in seconds (expired entries do not count).

        Returns:
            holder → the length of its leading run of ``keys`` (it stops at the first key the holder does not
            hold live); holders with a run of 0 are left out. Insertion order: by run length, shortest first.
        """
        now = self._clock(now_s)
        by_key, held = self._by_key, self._held
        out: dict[Holder, int] = {}
        live: list[Holder] = []
        for i, key in enumerate(keys):
            holders = by_key.get(key)
            if i == 0:
                live = [] if holders is None else [h for h in holders if held[h][key] > now]
            else:
                nxt: list[Holder] = []
                for h in live:
                    exp = held[h].get(key) if holders is not None and h in holders else None
                    if exp is not None and exp > now:
                        nxt.append(h)
                    else:
                        out[h] = i
                live = nxt
            if not live:
                return out
        for h in live:
            out[h] = len(keys)
        return out

    def block_count(self, holder: Holder | None = None) -> int:
        """Entries held by ``holder`` (None: by every holder), expired ones not yet dropped included."""
        if holder is not None:
            entries = self._held.get(holder)
            return 0 if entries is None else len(entries)
        return sum(len(e) for e in self._held.values())

    def holders(self) -> list[Holder]:
        """The holders with at least one entry, in the order they first got one."""
        return [h for h, e in self._held.items() if e]

    def __len__(self) -> int:
        """Entries held by every holder (`block_count`)."""
        return self.block_count()

    # ------------------------------------------------------------------ internals

    def _clock(self, now_s: float) -> float:
        self._now_s = max(self._now_s, now_s)
        return self._now_s

    def _trim(self, holder: Holder, entries: OrderedDict[int, float]) -> None:
        cap = self.capacity(holder)
        if cap is None:
            return
        while len(entries) > cap:
            key, _ = entries.popitem(last=False)
            self._unindex(key, holder)

    def _drop_expired(self, holder: Holder, entries: OrderedDict[int, float], now: float) -> int:
        dropped = 0
        while entries:
            key = next(iter(entries))
            if entries[key] > now:
                break
            del entries[key]
            self._unindex(key, holder)
            dropped += 1
        return dropped

    def _unindex(self, key: int, holder: Holder) -> None:
        holders = self._by_key[key]
        del holders[holder]
        if not holders:
            del self._by_key[key]
