"""A stand-in for vLLM's KV-event snapshot recorder (open pull request vllm-project/vllm#57789), for tests.

`SnapshotRecorder` folds every batch a publisher sends and answers a snapshot request the way the pull
request describes its reply (`kvmesh.core.engine_snapshot`): the cut (the last folded sequence; -1 before the
first batch; -2 once it failed) and a *replay program* for an empty index: the BlockStored events still
needed — each one that holds a resident copy, and each one a needed store is chained on (its parent, or, for
a tokenless store, the store with tokens of the same hash) — intact and in publish order, then BlockRemoved
events for what that leaves resident too often. A payload that does not decode fails the recorder for the
publisher's lifetime ("fails closed"), as the pull request's does.

This is kvmesh's own reading of the described behaviour, not vLLM's code: it keeps the whole history of the
incarnation and recomputes the program on each request (O(history)), which is fine for tests. Residency is
counted per (medium, group, hash): a hash stored twice needs two removals; AllBlocksCleared empties the GPU
tier (medium GPU or unset) only.
"""

from __future__ import annotations

from collections import Counter
from typing import Final, TypeAlias

from kvmesh.core.errors import WireError
from kvmesh.core.wire import BlockRemoved, BlockStored, EngineHash, KVEvent, decode_batch

__all__ = ["SnapshotRecorder"]

Key: TypeAlias = tuple[str | None, int | None, EngineHash]
"""A residency key: (medium, group_idx, engine hash)."""
_GPU_TIERS: Final[frozenset[str | None]] = frozenset({None, "GPU"})
UNAVAILABLE_CUT: Final[int] = -2


def _keys(ev: BlockStored | BlockRemoved) -> list[Key]:
    return [(ev.medium, ev.group_idx, h) for h in ev.block_hashes]


class SnapshotRecorder:
    """The state of one publisher incarnation, folded batch by batch (not thread-safe: the caller locks)."""

    def __init__(self) -> None:
        self.cut = -1
        """The last sequence folded (-1: none)."""
        self.failed = False
        """A batch failed to fold: every reply is unavailable from now on (until `reset`)."""
        self._stores: list[BlockStored] = []
        self._live: Counter[Key] = Counter()

    def reset(self) -> None:
        """Forget everything (a new publisher incarnation)."""
        self.cut, self.failed = -1, False
        self._stores.clear()
        self._live.clear()

    def fold(self, seq: int, payload: bytes) -> None:
        """Fold the batch ``seq`` (its msgpack payload); a payload that does not decode fails the recorder."""
        if self.failed:
            return
        try:
            batch = decode_batch(payload)
        except WireError:
            self.failed = True
            return
        if batch.errors:
            self.failed = True
            return
        for ev in batch.events:
            self._apply(ev)
        self.cut = seq

    def _apply(self, ev: KVEvent) -> None:
        if isinstance(ev, BlockStored):
            if ev.block_hashes:
                self._stores.append(ev)
                self._live.update(_keys(ev))
        elif isinstance(ev, BlockRemoved):
            live = self._live
            for key in _keys(ev):
                count = live.get(key, 0)
                if count > 1:
                    live[key] = count - 1
                elif count:
                    del live[key]
        else:  # AllBlocksCleared
            for key in [k for k in self._live if k[0] in _GPU_TIERS]:
                del self._live[key]

    @property
    def live(self) -> Counter[Key]:
        """Resident copies per (medium, group, hash) now."""
        return Counter(self._live)

    def program(self) -> list[KVEvent]:
        """The replay program of the current state: needed stores in order, then the excess removals."""
        want = Counter(self._live)
        parents: set[EngineHash] = set()
        needed: list[BlockStored] = []
        for ev in reversed(self._stores):
            keys = _keys(ev)
            if not any(want[k] > 0 for k in keys) and not parents.intersection(ev.block_hashes):
                continue
            needed.append(ev)
            for k in keys:
                if want[k] > 0:
                    want[k] -= 1
            if ev.token_ids:
                parents.difference_update(ev.block_hashes)
                if ev.parent_block_hash is not None:
                    parents.add(ev.parent_block_hash)
            else:  # a tokenless (offload) store needs the store with tokens of its hashes
                parents.update(ev.block_hashes)
        needed.reverse()
        emitted: Counter[Key] = Counter()
        for ev in needed:
            emitted.update(_keys(ev))
        removals: dict[tuple[str | None, int | None], list[EngineHash]] = {}
        for key, count in emitted.items():
            for _ in range(count - self._live[key]):
                removals.setdefault(key[:2], []).append(key[2])
        out: list[KVEvent] = list(needed)
        for (medium, group), hashes in removals.items():
            out.append(BlockRemoved(block_hashes=tuple(hashes), medium=medium, group_idx=group))
        return out

    def reply_cut(self) -> int:
        """The cut a reply names now: -2 once failed, else the last folded sequence."""
        return UNAVAILABLE_CUT if self.failed else self.cut
