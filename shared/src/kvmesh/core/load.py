"""Load accounting for the router (pure): what each (worker, dp rank) is busy with.

Two sources, both keyed by (worker id, dp rank):

* `LoadLedger` — router-side accounting of the requests kvmesh routed. A request's lifecycle is three events
  (`Routed`, `PrefillDone`, `Finished`, published on ``kvmesh.requests.<event>`` by routers and clients);
  every router replica applies every event, keyed by ``request_id``, so all replicas hold the same ledger.
  While a request is routed and not prefilled its ``prefill_tokens`` (prompt tokens not cached on the
  worker) count as the worker's *active prefill tokens*; until it finishes its ``blocks`` (all KV blocks of
  the prompt, trailing partial block included) count as *active blocks*. A request never finished expires
  ``ttl_s`` after it was routed (default 300 s). Events are idempotent: a second `Routed` for the same id and
  worker is a no-op, one for another worker moves it; `PrefillDone`/`Finished` for an unknown id do nothing.
* `EngineLoads` — the engines' own reports (`WorkerLoad`, JSON on ``kvmesh.load.<worker>``): running and
  waiting requests, KV-cache usage (0–1) and prefix-cache hit rate. A report older than ``ttl_s`` is ignored.

`from_vllm_metrics` turns vLLM's Prometheus ``/metrics`` text into `WorkerLoad`s, one per DP rank (the
``engine`` label; absent means rank 0). It accepts ``vllm:kv_cache_usage_perc`` and the older
``vllm:gpu_cache_usage_perc``, and a hit rate either from ``vllm:gpu_prefix_cache_hit_rate`` (older
releases) or from the ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` counters (the
rate between two scrapes; the cumulative ratio on the first).

No clock is read here: every method that needs the time takes ``now_s`` (any monotonic seconds).
Costs: every ledger event is O(1); `LoadLedger.expire` is O(expired requests) amortised.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

import msgspec

DEFAULT_REQUEST_TTL_S: Final[float] = 300.0
DEFAULT_LOAD_TTL_S: Final[float] = 10.0

Key = tuple[str, int]
"""(worker id, dp rank)."""


# ---------------------------------------------------------------------------------------- wire messages


class WorkerLoad(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One engine's load report (JSON body on ``kvmesh.load.<worker>``); unknown fields are ignored."""

    worker_id: str
    dp_rank: int = 0
    model: str | None = None
    running: int | None = None
    """Requests the engine is running (decoding or prefilling)."""
    waiting: int | None = None
    """Requests queued in the engine, not yet scheduled."""
    kv_usage: float | None = None
    """Fraction of the engine's KV-cache blocks in use, 0–1."""
    prefix_hit_rate: float | None = None
    """Fraction of prompt tokens found in the prefix cache, 0–1 (informational)."""


class Routed(msgspec.Struct, kw_only=True, frozen=True):
    """A router sent ``request_id`` to (worker, dp rank); body of ``kvmesh.requests.routed``."""

    request_id: str
    worker_id: str
    dp_rank: int
    prefill_tokens: int
    """Prompt tokens the worker has to compute (prompt tokens − cached tokens), ≥ 0."""
    blocks: int
    """KV blocks the request occupies while it runs: ceil(prompt tokens / block size)."""


class RequestRef(msgspec.Struct, kw_only=True, frozen=True):
    """Body of ``kvmesh.requests.prefill_done`` and ``kvmesh.requests.finished``."""

    request_id: str


class LedgerEntry(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """One in-flight request in a ledger snapshot (``kvmesh.requests.sync`` reply)."""

    request_id: str
    worker_id: str
    dp_rank: int
    prefill_tokens: int
    """Remaining active prefill tokens (0 once prefill is done)."""
    blocks: int
    age_s: float
    """Seconds since the request was routed, as seen by the replica that answered."""


class LedgerSnapshot(msgspec.Struct, kw_only=True, frozen=True):
    """Reply of ``kvmesh.requests.sync``: every in-flight request a replica holds."""

    entries: list[LedgerEntry]
    version: int = 1


# ---------------------------------------------------------------------------------------- ledger


@dataclass(frozen=True, slots=True)
class ActiveLoad:
    """Router-side load of one (worker, dp rank)."""

    prefill_tokens: int = 0
    """Prompt tokens of routed requests not yet prefilled."""
    blocks: int = 0
    """KV blocks of routed requests not yet finished."""
    requests: int = 0
    """Routed requests not yet finished."""


ZERO_LOAD: Final[ActiveLoad] = ActiveLoad()


@dataclass(slots=True)
class _Active:
    key: Key
    prefill_tokens: int
    blocks: int
    routed_s: float


@dataclass(slots=True)
class LedgerStats:
    """Counters of a `LoadLedger` (a snapshot)."""

    active: int = 0
    routed: int = 0
    prefill_done: int = 0
    finished: int = 0
    expired: int = 0
    unknown: int = 0
    """Lifecycle events for request ids the ledger does not hold (already finished, expired, or never seen)."""


@dataclass(slots=True)
class LoadLedger:
    """In-flight requests per (worker, dp rank), fed lifecycle events.

    Attributes:
        ttl_s: seconds after which a request never finished is dropped.
    """

    ttl_s: float = DEFAULT_REQUEST_TTL_S
    _requests: dict[str, _Active] = field(default_factory=dict)
    _totals: dict[Key, list[int]] = field(default_factory=dict)
    _stats: LedgerStats = field(default_factory=LedgerStats)

    def routed(self, event: Routed, now_s: float) -> bool:
        """Apply a `Routed` event; return False when it changed nothing (already held on that worker)."""
        key = (event.worker_id, event.dp_rank)
        old = self._requests.get(event.request_id)
        if old is not None:
            if old.key == key:
                return False
            self._remove(event.request_id)
        self._add(event.request_id, key, max(event.prefill_tokens, 0), max(event.blocks, 0), now_s)
        self._stats.routed += 1
        return True

    def prefill_done(self, request_id: str) -> bool:
        """The request's prompt is computed: its prefill tokens stop counting. False if unknown or done."""
        a = self._requests.get(request_id)
        if a is None:
            self._stats.unknown += 1
            return False
        if a.prefill_tokens == 0:
            return False
        self._totals[a.key][0] -= a.prefill_tokens
        a.prefill_tokens = 0
        self._stats.prefill_done += 1
        return True

    def finished(self, request_id: str) -> bool:
        """The request is over: drop it. False if unknown."""
        if request_id not in self._requests:
            self._stats.unknown += 1
            return False
        self._remove(request_id)
        self._stats.finished += 1
        return True

    def expire(self, now_s: float) -> int:
        """Drop requests routed more than ``ttl_s`` before ``now_s``; return how many."""
        limit = now_s - self.ttl_s
        dropped = 0
        reqs = self._requests
        while reqs:
            rid, a = next(iter(reqs.items()))
            if a.routed_s > limit:
                break
            self._remove(rid)
            dropped += 1
        self._stats.expired += dropped
        return dropped

    def load(self, worker_id: str, dp_rank: int, *, excluding: str | None = None) -> ActiveLoad:
        """Return the active load of one (worker, dp rank) (zero when none).

        Args:
            worker_id: the worker.
            dp_rank: its data-parallel rank.
            excluding: a request id whose own share is left out (a request routed again, e.g. a retry,
                must not be weighed down by itself).
        """
        t = self._totals.get((worker_id, dp_rank))
        if t is None:
            return ZERO_LOAD
        own = self._requests.get(excluding) if excluding is not None else None
        if own is not None and own.key == (worker_id, dp_rank):
            if t[2] == 1:
                return ZERO_LOAD
            return ActiveLoad(
                prefill_tokens=t[0] - own.prefill_tokens, blocks=t[1] - own.blocks, requests=t[2] - 1
            )
        return ActiveLoad(prefill_tokens=t[0], blocks=t[1], requests=t[2])

    def snapshot(self, now_s: float) -> LedgerSnapshot:
        """Return every in-flight request with its age (oldest first), for a peer that (re)starts."""
        return LedgerSnapshot(
            entries=[
                LedgerEntry(
                    request_id=rid,
                    worker_id=a.key[0],
                    dp_rank=a.key[1],
                    prefill_tokens=a.prefill_tokens,
                    blocks=a.blocks,
                    age_s=max(now_s - a.routed_s, 0.0),
                )
                for rid, a in self._requests.items()
            ]
        )

    def restore(self, snapshot: LedgerSnapshot, now_s: float) -> int:
        """Add a peer's in-flight requests this ledger does not hold yet; return how many were added.

        Entries are inserted oldest first so expiry order stays by routing time. Requests already held
        (seen live since start-up) are kept as they are.
        """
        added = 0
        for e in sorted(snapshot.entries, key=lambda e: -e.age_s):
            if e.request_id in self._requests or e.age_s >= self.ttl_s:
                continue
            self._add(e.request_id, (e.worker_id, e.dp_rank), e.prefill_tokens, e.blocks, now_s - e.age_s)
            added += 1
        if added:
            # Keep the dict ordered by routing time: live entries may be younger than restored ones.
            self._requests = dict(sorted(self._requests.items(), key=lambda kv: kv[1].routed_s))
        return added

    def stats(self) -> LedgerStats:
        """Return a copy of the counters (``active`` is the number of in-flight requests)."""
        s = self._stats
        return LedgerStats(
            active=len(self._requests),
            routed=s.routed,
            prefill_done=s.prefill_done,
            finished=s.finished,
            expired=s.expired,
            unknown=s.unknown,
        )

    def _add(self, rid: str, key: Key, prefill_tokens: int, blocks: int, routed_s: float) -> None:
        self._requests[rid] = _Active(key, prefill_tokens, blocks, routed_s)
        t = self._totals.get(key)
        if t is None:
            self._totals[key] = [prefill_tokens, blocks, 1]
        else:
            t[0] += prefill_tokens
            t[1] += blocks
            t[2] += 1

    def _remove(self, rid: str) -> None:
        a = self._requests.pop(rid)
        t = self._totals[a.key]
        t[0] -= a.prefill_tokens
        t[1] -= a.blocks
        t[2] -= 1
        if t[2] == 0:
            del self._totals[a.key]


# ---------------------------------------------------------------------------------------- engine reports


@dataclass(slots=True)
class EngineLoads:
    """The newest `WorkerLoad` per (worker, dp rank), each ignored once older than ``ttl_s``."""

    ttl_s: float = DEFAULT_LOAD_TTL_S
    _reports: dict[Key, tuple[WorkerLoad, float]] = field(default_factory=dict)

    def update(self, report: WorkerLoad, now_s: float) -> None:
        """Keep ``report`` as the newest for its (worker, dp rank), received at ``now_s``."""
        self._reports[(report.worker_id, report.dp_rank)] = (report, now_s)

    def get(self, worker_id: str, dp_rank: int, now_s: float) -> WorkerLoad | None:
        """Return the fresh report of one (worker, dp rank), or None (none, or stale)."""
        r = self._reports.get((worker_id, dp_rank))
        if r is None or now_s - r[1] > self.ttl_s:
            return None
        return r[0]

    def prune(self, now_s: float) -> int:
        """Forget stale reports; return how many."""
        stale = [k for k, (_, t) in self._reports.items() if now_s - t > self.ttl_s]
        for k in stale:
            del self._reports[k]
        return len(stale)

    def __len__(self) -> int:
        return len(self._reports)


# ---------------------------------------------------------------------------------------- Prometheus

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

VLLM_RUNNING: Final[str] = "vllm:num_requests_running"
VLLM_WAITING: Final[str] = "vllm:num_requests_waiting"
VLLM_KV_USAGE: Final[tuple[str, ...]] = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
VLLM_HIT_RATE: Final[str] = "vllm:gpu_prefix_cache_hit_rate"
VLLM_QUERIES: Final[tuple[str, ...]] = (
    "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total",
)
VLLM_HITS: Final[tuple[str, ...]] = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_WANTED: Final[frozenset[str]] = frozenset(
    {VLLM_RUNNING, VLLM_WAITING, VLLM_HIT_RATE, *VLLM_KV_USAGE, *VLLM_QUERIES, *VLLM_HITS}
)


def decode_prometheus_text(
    text: str, names: Iterable[str] | None = None
) -> list[tuple[str, dict[str, str], float]]:
    """Parse Prometheus text exposition into ``(metric, labels, value)`` samples.

    Comments, blank lines and unparsable lines are skipped; timestamps are ignored. With ``names``, only
    those metrics are kept (the rest are not label-parsed).
    """
    wanted = frozenset(names) if names is not None else None
    out: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name = m.group(1)
        if wanted is not None and name not in wanted:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2))) if m.group(2) else {}
        out.append((name, labels, value))
    return out


@dataclass(frozen=True, slots=True)
class PrefixCounters:
    """Cumulative prefix-cache queries and hits of one DP rank (tokens), kept between scrapes."""

    queries: float
    hits: float


def from_vllm_metrics(
    text: str,
    *,
    worker_id: str,
    model: str | None = None,
    previous: Mapping[int, PrefixCounters] | None = None,
) -> tuple[list[WorkerLoad], dict[int, PrefixCounters]]:
    """Turn a vLLM ``/metrics`` page into one `WorkerLoad` per DP rank (sorted by rank).

    Args:
        text: Prometheus text exposition.
        worker_id: the worker the page belongs to.
        model: when given, only samples whose ``model_name`` label is absent or equal are used.
        previous: the counters returned by the previous call, for a hit rate between two scrapes.

    Returns:
        the loads, and the prefix-cache counters to pass as ``previous`` next time. Values summed over
        label sets of the same rank (several ``model_name`` or ``finished_reason`` labels); a rank with no
        recognised metric gives no load.
    """
    ranks: dict[int, dict[str, float]] = {}
    prios: dict[tuple[int, str], int] = {}
    for name, labels, value in decode_prometheus_text(text, _WANTED):
        if model is not None and labels.get("model_name", model) != model:
            continue
        if math.isnan(value):
            continue
        try:
            rank = int(labels.get("engine", "0"))
        except ValueError:
            rank = 0
        vals = ranks.setdefault(rank, {})
        for group, names_ in (("kv", VLLM_KV_USAGE), ("queries", VLLM_QUERIES), ("hits", VLLM_HITS)):
            if name in names_:
                prio = names_.index(name)  # the current name wins over an older one exported alongside
                cur = prios.get((rank, group))
                if cur is None or prio < cur:
                    vals[group] = value
                    prios[(rank, group)] = prio
                elif prio == cur:
                    vals[group] = max(vals[group], value) if group == "kv" else vals[group] + value
                break
        else:
            vals[name] = vals.get(name, 0.0) + value if name != VLLM_HIT_RATE else value
    loads: list[WorkerLoad] = []
    counters: dict[int, PrefixCounters] = {}
    for rank in sorted(ranks):
        v = ranks[rank]
        hit_rate = v.get(VLLM_HIT_RATE)
        if "queries" in v and "hits" in v:
            now = PrefixCounters(queries=v["queries"], hits=v["hits"])
            counters[rank] = now
            prev = (previous or {}).get(rank)
            dq, dh = (now.queries - prev.queries, now.hits - prev.hits) if prev else (now.queries, now.hits)
            if dq < 0 or dh < 0:  # counters reset (engine restart): use the new totals
                dq, dh = now.queries, now.hits
            if dq > 0:
                hit_rate = min(max(dh / dq, 0.0), 1.0)
        loads.append(
            WorkerLoad(
                worker_id=worker_id,
                dp_rank=rank,
                model=model,
                running=int(v[VLLM_RUNNING]) if VLLM_RUNNING in v else None,
                waiting=int(v[VLLM_WAITING]) if VLLM_WAITING in v else None,
                kv_usage=v.get("kv"),
                prefix_hit_rate=hit_rate,
            )
        )
    return loads, counters
