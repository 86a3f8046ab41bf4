"""The router's predicted cache entries: what it expects a worker to hold because it sent the prompt there.

Two sources of overlap beside the index, both `kvmesh.core.predicted.PredictedBlocks` keyed by the prompt's
prefix keys (the standard sequence hash of each full block, what the index stores):

* **Predicted entries** (``--predicted-ttl-s`` > 0; off by default, as Dynamo's ``--router-predicted-ttl-secs``
  and llm-d's speculative indexing): for that many seconds after a route, the chosen worker counts the
  prompt's blocks as held, so a follow-up arriving before the engine's BlockStored events does not look cold.
  A candidate's overlap is then the larger of the index's and the predicted one. docs/benchmarks.md
  (section 1, predicted entries) measured it: 2 – 7× the hits of a 0.19 s stale index on bursts of several
  new prefixes, no change on the Mooncake traces.
* **Workers without KV events** (`WorkerRecord.kv_events` false: `kvmesh ingest --no-kv-events`): the index
  knows nothing of them, so their overlap is only what the routers sent them, at most the worker's
  ``kv_capacity_blocks`` per rank (`DEFAULT_CAPACITY_BLOCKS` when the record does not say), least recently
  used out first: Dynamo's approximate mode. Always on for such workers. A rank the registry no longer
  lists as such (its worker left, or now publishes events) loses its predicted cache, as the indexers clear a
  departed worker's blocks.

Every replica keeps the same entries: the replica that routes sends the prompt's keys in its `Routed` note
(or a `RouteNote` for a request without a ``request_id``), and each replica adds them on receipt; a replica
started later restores a peer's entries (`Predictions.cache` there, `Predictions.restore` here) under the
ones the notes already gave it. No I/O and
no clock here: times are the caller's monotonic seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

from kvmesh.core import tables
from kvmesh.core.hashing import sequence_hashes
from kvmesh.core.index import Holder
from kvmesh.core.predicted import PredictedBlocks
from kvmesh.core.protocol import PredictedCache, RouteRequest
from kvmesh.core.route import Candidate, CandidateLike
from kvmesh.router.answer import MatchAnswer, match_answer
from kvmesh.router.health import RecordLike
from kvmesh.router.sync import note_problem

__all__ = ["DEFAULT_CAPACITY_BLOCKS", "NO_EVENTS", "TTL", "Predictions", "prompt_keys_of"]

DEFAULT_CAPACITY_BLOCKS: Final[int] = 16_384
"""Predicted-cache bound of a worker without KV events whose record gives no ``kv_capacity_blocks``."""
NO_EVENTS: Final[str] = "no_events"
"""`PredictedCache.kind` of a worker without KV events' predicted cache."""
TTL: Final[str] = "ttl"
"""`PredictedCache.kind` of predicted entries beside the KV events."""
_EXPIRE_EVERY_S: Final[float] = 1.0
_REREAD_S: Final[float] = 1.0
"""How long the set of workers without KV events is reused before the registry's records are read again."""


def prompt_keys_of(parsed: RouteRequest, block_size: int) -> list[int] | None:
    """Return the prefix keys of the request's full blocks at ``block_size`` (> 0), or None when the request's
    hashes were computed with another block size (they say nothing about this one).

    Token ids are hashed as the index hashes them (`kvmesh.core.tables.prompt_keys`, LoRA and salt mixed
    in); ``block_hashes`` are chained into sequence hashes; ``seq_hashes`` are the keys themselves.
    """
    if parsed.seq_hashes is None and parsed.block_hashes is None:
        tokens = tables.token_array(parsed.token_ids)
        keys = tables.prompt_keys(
            tokens, block_size, lora_name=parsed.lora_name, cache_salt=parsed.cache_salt
        )
        return [int(k) for k in keys.tolist()]
    if parsed.block_size is not None and parsed.block_size != block_size:
        return None
    if parsed.seq_hashes is not None:
        return list(parsed.seq_hashes)
    assert parsed.block_hashes is not None
    return sequence_hashes(list(parsed.block_hashes))


class Predictions:
    """A replica's predicted entries (workers with KV events, when enabled) and the predicted caches of
    workers without KV events.

    Args:
        ttl_s: seconds a route's blocks count as held beside the index (0: predicted entries off).
        records: the registry's worker records by id (None without a registry): which workers publish no KV
            events, and their capacity.
    """

    def __init__(self, ttl_s: float, records: Callable[[], Mapping[str, RecordLike] | None]) -> None:
        self.ttl: PredictedBlocks | None = PredictedBlocks(ttl_s=ttl_s) if ttl_s > 0 else None
        """Predicted entries beside the KV events (None: off)."""
        self.approx = PredictedBlocks(ttl_s=None, capacity_blocks=DEFAULT_CAPACITY_BLOCKS)
        """The predicted caches of workers without KV events."""
        self.records = records
        self._expired_s = 0.0
        self._read_s = -math.inf
        self._by_model: dict[str, frozenset[str]] = {}

    def _eventless_of(self, model: str, now_s: float) -> frozenset[str]:
        """The workers of ``model`` without KV events (the registry read at most once per `_REREAD_S`)."""
        if now_s - self._read_s >= _REREAD_S or now_s < self._read_s:
            recs = self.records()
            by_model: dict[str, set[str]] = {}
            for w, r in (recs or {}).items():
                if not r.kv_events:
                    by_model.setdefault(r.model, set()).add(w)
            self._by_model = {m: frozenset(ws) for m, ws in by_model.items()}
            self._read_s = now_s
            if recs is not None:
                self._forget_departed(recs)
        return self._by_model.get(model, frozenset())

    def _forget_departed(self, recs: Mapping[str, RecordLike]) -> None:
        """Forget the predicted caches of ranks the registry no longer lists as without KV events (the worker
        left, or now publishes events), as the indexers clear a departed worker's blocks."""
        for h in self.approx.holders():
            rec = recs.get(h.worker_id)
            if rec is None or rec.kv_events or not h.dp_rank < rec.dp_ranks:
                self.approx.forget(h)

    def _eventless(self, worker_id: str) -> RecordLike | None:
        """The worker's record when it publishes no KV events, else None."""
        recs = self.records()
        rec = recs.get(worker_id) if recs is not None else None
        return rec if rec is not None and not rec.kv_events else None

    def overlay(
        self, parsed: RouteRequest, match: MatchAnswer, now_s: float
    ) -> tuple[MatchAnswer, list[int] | None]:
        """Return the match with predicted overlaps applied, and the prompt's keys (None when nothing is
        predicted for this model: the match is returned as it is).

        A worker without KV events gets its predicted overlap and cached blocks (the index knows nothing of
        it); any other candidate the larger of the index's overlap and its predicted entries', counted on GPU.
        Holders with a predicted overlap the index does not list join as candidates (the registry still
        decides who is live).
        """
        eventless = self._eventless_of(parsed.model, now_s)
        bs = match.block_size
        if (self.ttl is None and not eventless) or bs <= 0:
            return match, None
        keys = prompt_keys_of(parsed, bs)
        if not keys:
            return match, keys
        if self.ttl is not None and now_s - self._expired_s >= _EXPIRE_EVERY_S:
            self.ttl.expire(now_s)
            self._expired_s = now_s
        ttl_hits = self.ttl.match(keys, now_s) if self.ttl is not None else {}
        approx_hits = self.approx.match(keys, now_s) if eventless else {}
        out: list[CandidateLike] = []
        seen: set[Holder] = set()
        for c in match.candidates:
            h = Holder(c.worker_id, c.dp_rank)
            seen.add(h)
            if c.worker_id in eventless:
                out.append(self._approx_candidate(h, approx_hits.get(h, 0), c.block_size))
            elif ttl_hits.get(h, 0) > c.overlap_blocks and c.block_size in (0, bs):
                out.append(_raised(c, ttl_hits[h]))
            else:
                out.append(c)
        for h in self.approx.holders():  # every event-less holder with its cached blocks (ties read them)
            if h not in seen and h.worker_id in eventless:
                out.append(self._approx_candidate(h, approx_hits.get(h, 0), 0))
        for h, n in ttl_hits.items():
            if h not in seen and h.worker_id not in eventless:
                out.append(
                    Candidate(worker_id=h.worker_id, dp_rank=h.dp_rank, overlap_blocks=n, cached_blocks=0)
                )
        return match_answer(match.index_seq, bs, out), keys

    def _approx_candidate(self, h: Holder, overlap: int, block_size: int) -> Candidate:
        return Candidate(
            worker_id=h.worker_id,
            dp_rank=h.dp_rank,
            overlap_blocks=overlap,
            cached_blocks=self.approx.block_count(h),
            block_size=block_size,
        )

    def held(self) -> dict[str, int]:
        """Entries held by kind: ``"ttl"`` (predicted entries, when on) and ``"no_events"`` (when any)."""
        out = {"ttl": len(self.ttl)} if self.ttl is not None else {}
        if len(self.approx):
            out["no_events"] = len(self.approx)
        return out

    def sizes(self, now_s: float) -> list[tuple[str, Holder, int]]:
        """``(kind, holder, entries)`` of every holder with entries, expired predicted entries dropped first: what
        a sync answer plans its parts by before it exports them (`cache`). O(holders + entries dropped)."""
        out: list[tuple[str, Holder, int]] = []
        for kind, blocks in ((NO_EVENTS, self.approx), (TTL, self.ttl)):
            if blocks is None:
                continue
            blocks.expire(now_s)
            out.extend((kind, h, blocks.block_count(h)) for h in blocks.holders())
        return out

    def cache(self, kind: str, holder: Holder, now_s: float) -> PredictedCache:
        """``holder``'s live entries of ``kind`` (`NO_EVENTS` or `TTL`) at ``now_s``, least recently used first,
        with its bound: what a starting replica restores from a peer (`restore`). O(the holder's entries)."""
        blocks = self.approx if kind == NO_EVENTS else self.ttl
        keys, left = blocks.entries(holder, now_s) if blocks is not None else ([], None)
        return PredictedCache(
            worker_id=holder.worker_id,
            dp_rank=holder.dp_rank,
            kind=kind,
            keys=keys,
            remaining_s=left,
            capacity_blocks=blocks.capacity(holder) if blocks is not None else None,
        )

    def restore(self, caches: Iterable[PredictedCache], now_s: float) -> tuple[int, int]:
        """Take a peer's predicted entries (`cache` there) under the ones this replica holds already.

        Each cache goes in under what the holder holds by then, so a holder's slices must come newest first
        (as a peer sends them). Predicted entries (kind ``ttl``) are taken only when they are on here too.
        The registry is not read: a holder it does not list as without KV events is forgotten at its next
        read, as any departed worker's cache.

        Returns:
            (entries restored, caches refused: an unknown kind, a negative rank, a key outside [0, 2⁶⁴),
            ``remaining_s`` not as long as ``keys``, or a bound below 1).
        """
        restored = refused = 0
        for c in caches:
            bad = (
                c.kind not in (NO_EVENTS, TTL)
                or note_problem(c.dp_rank, None, c.keys) is not None
                or (c.remaining_s is not None and len(c.remaining_s) != len(c.keys))
                or (c.capacity_blocks is not None and c.capacity_blocks < 1)
            )
            if bad:
                refused += 1
                continue
            blocks = self.approx if c.kind == NO_EVENTS else self.ttl
            if blocks is None:
                continue
            h = Holder(c.worker_id, c.dp_rank)
            if c.capacity_blocks is not None and blocks.capacity(h) != c.capacity_blocks:
                blocks.set_capacity(h, c.capacity_blocks)
            restored += blocks.restore(h, c.keys, c.remaining_s if blocks.ttl_s is not None else None, now_s)
        return restored, refused

    def keeps(self, holder: Holder) -> bool:
        """Whether a route to ``holder`` adds predicted entries (it publishes no KV events, or predicted entries
        are on)."""
        return self.ttl is not None or self._eventless(holder.worker_id) is not None

    def add(self, holder: Holder, keys: Sequence[int] | None, now_s: float) -> bool:
        """Count ``keys`` as held by ``holder`` (a route this replica or a peer sent there); return whether they
        were kept (False: no keys, a (worker, rank) the registry does not list, or predicted entries off and
        the worker publishes KV events). A holder keeps at most its worker's ``kv_capacity_blocks``."""
        if not keys:
            return False
        recs = self.records()
        rec = recs.get(holder.worker_id) if recs is not None else None
        if recs is not None and (rec is None or not 0 <= holder.dp_rank < rec.dp_ranks):
            return False  # a rank the registry does not list: nothing to predict (and no unbounded holders)
        cap = rec.kv_capacity_blocks if rec is not None else None
        cap = cap if cap is not None and cap >= 1 else None
        if rec is not None and not rec.kv_events:
            if self.approx.capacity(holder) != (cap or DEFAULT_CAPACITY_BLOCKS):
                self.approx.set_capacity(holder, cap)
            self.approx.add(holder, keys, now_s)
            return True
        if self.ttl is None:
            return False
        if cap is not None and self.ttl.capacity(holder) != cap:
            self.ttl.set_capacity(holder, cap)  # the engine holds no more than its KV capacity
        self.ttl.add(holder, keys, now_s)
        return True


def _raised(c: CandidateLike, overlap: int) -> Candidate:
    """``c`` with its overlap raised to a predicted ``overlap`` (all on GPU: the engine computed them there)."""
    return Candidate(
        worker_id=c.worker_id,
        dp_rank=c.dp_rank,
        overlap_blocks=overlap,
        cached_blocks=max(c.cached_blocks, overlap),
        health=c.health,
        block_size=c.block_size,
    )
