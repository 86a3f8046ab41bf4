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
  *Prefill progress* (on by default, ``LoadLedger.prefill_progress``): a worker prefills its requests in
  arrival order, so only its oldest request not yet prefilled (the *head*) is being computed and the rest
  wait whole. The ledger counts only the head's estimated remaining tokens, ``max(prefill_tokens − rate ×
  (now − start), 0)`` with ``start = max(head routed, the worker's last prefill done)``, where ``rate`` is
  that worker's prefill throughput learned from its own lifecycle events (see `LoadLedger`). Without it a
  worker half-way through a 7,000-token prefill looks as loaded as one that has not started it, and
  returning conversations are diverted from their cache (``docs/benchmarks.md`` section 1).
  *Route receipts*: the replica that answered a route counts it for the chosen (worker, dp rank)
  (`LoadLedger.answered`: the available and captured tokens of the reply) and remembers the captured tokens
  of a request with a ``request_id`` (`LoadLedger.routed` with ``captured_tokens``); when that request's
  `Finished` carries the engine's own count of cached prompt tokens, that replica alone counts it as
  delivered (`LoadLedger.finished` with ``cached_tokens``). A peer's `Routed` for the same id (a retry it
  answered) takes the receipt over; entries restored from a peer's snapshot are never this replica's. So a
  request is delivered once across the replicas, and a finish without a count, after expiry, or after this
  replica restarted, delivers nothing. `Receipts` holds the token counters, never a mean of ratios.
* `EngineLoads` — the engines' own reports (`WorkerLoad`, JSON on ``kvmesh.load.<worker>``): running and
  waiting requests, KV-cache usage (0–1) and prefix-cache hit rate. A report older than ``ttl_s`` is ignored.

`from_vllm_metrics` turns vLLM's Prometheus ``/metrics`` text into `WorkerLoad`s, one per DP rank (the
``engine`` label; absent means rank 0). It accepts ``vllm:kv_cache_usage_perc`` and the older
``vllm:gpu_cache_usage_perc``, and a hit rate either from ``vllm:gpu_prefix_cache_hit_rate`` (older
releases) or from the ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` counters (the
rate between two scrapes; the cumulative ratio on the first).

No clock is read here: every method that needs the time takes ``now_s`` (any monotonic seconds); where it
is optional (`LoadLedger.prefill_done`, `LoadLedger.load`) the latest time the ledger was given stands in.
Costs: every ledger event is O(1); `LoadLedger.expire` is O(expired requests) amortised.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from kvmesh.core.index import Holder
from kvmesh.core.protocol import LedgerEntry, LedgerSnapshot, Routed, WorkerLoad

DEFAULT_REQUEST_TTL_S: Final[float] = 300.0
DEFAULT_LOAD_TTL_S: Final[float] = 10.0

# ---------------------------------------------------------------------------------------- wire messages


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


DEFAULT_PREFILL_RATE_ALPHA: Final[float] = 0.2
"""Weight of the newest sample in a worker's learned prefill throughput (exponentially weighted)."""


@dataclass(slots=True)
class _Active:
    key: Holder
    prefill_tokens: int
    blocks: int
    routed_s: float
    captured: int = -1
    """The chosen worker's cached tokens when this replica answered the request, else −1 (not its receipt)."""


@dataclass(slots=True)
class _Worker:
    """Per (worker, dp rank): totals, requests still prefilling (routing order), last prefill end."""

    prefill_tokens: int = 0
    blocks: int = 0
    requests: int = 0
    pending: dict[str, _Active] = field(default_factory=dict)
    """Requests routed here and not yet prefilled, oldest first (the first is the head)."""
    last_done_s: float = -math.inf
    """When this worker's latest prefill ended (a `PrefillDone`, or a prefilling request finished)."""


@dataclass(slots=True)
class _Rate:
    """Exponentially weighted sums of one worker's prefill samples: tokens and seconds."""

    tokens: float
    seconds: float

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(slots=True)
class Receipts:
    """Route receipts of one (worker, dp rank) on the replica that answered its routes (token counters, each
    only ever growing; see `kvmesh.core.protocol.RouteReceipts` for each one's meaning)."""

    requests: int = 0
    available_tokens: int = 0
    captured_tokens: int = 0
    regret_tokens: int = 0
    delivered_requests: int = 0
    delivered_tokens: int = 0
    misprediction_tokens: int = 0
    unpredicted_tokens: int = 0

    def copy(self) -> Receipts:
        """Return a copy (a snapshot of the counters)."""
        return Receipts(
            requests=self.requests,
            available_tokens=self.available_tokens,
            captured_tokens=self.captured_tokens,
            regret_tokens=self.regret_tokens,
            delivered_requests=self.delivered_requests,
            delivered_tokens=self.delivered_tokens,
            misprediction_tokens=self.misprediction_tokens,
            unpredicted_tokens=self.unpredicted_tokens,
        )


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
    receipts: dict[Holder, Receipts] = field(default_factory=dict)
    """Route receipts per (worker, dp rank) of the routes this replica answered (copies)."""


@dataclass(slots=True)
class LoadLedger:
    """In-flight requests per (worker, dp rank), fed lifecycle events.

    Prefill progress (``prefill_progress``, on by default). A worker prefills its requests in arrival order,
    so of its requests not yet prefilled only the oldest, the *head*, is being computed; the others wait whole.
    `load` counts the head's remaining tokens only::

        start     = max(head routed at, the worker's last prefill end)
        remaining = max(head prefill_tokens − rate × (now − start), 0)

    ``rate`` is the worker's prefill throughput (tokens/s), learned from its own lifecycle events, which
    every replica sees: when a `PrefillDone` ends a request's prefill, the sample is its prefill tokens over
    ``done − start`` (its start as above: a request waits for the one before it). Samples are combined as an
    exponentially weighted ratio of sums (tokens and seconds each weighted by ``prefill_rate_alpha`` for the
    newest), so a large prefill weighs more than a cached one and its fixed overhead averages out. Before a
    worker's first sample its rate is ``prefill_rate_prior`` (default 0: no progress is assumed, the whole
    prefill counts, as with ``prefill_progress=False``). The learned rates are per replica and not in the
    snapshot: a replica that restarts assumes no progress until each worker's first new sample.

    Measured (``docs/benchmarks.md`` section 1): on the fleet's own clock (``kvmesh-exact``, first 2,000
    requests of each Mooncake trace, 8 and 16 workers, two pool sizes) it raises the hit ratio in six shapes
    of eight (the synthetic trace at 8 workers and default pools: 0.64 → 0.87 of the TTFT oracle's) and costs
    under 1 % in two; through the real pipeline at a simulated speed the harness keeps (4×), the synthetic
    trace at 8 workers goes from 4.21 % to 6.06 % of prompt tokens cached, TTFT p50 0.426 → 0.402 s. A
    worker whose requests get no `PrefillDone` (a gateway that sends no ``prefill_done`` notes) has no rate,
    so its whole prefill counts, as with ``prefill_progress=False``.

    Attributes:
        ttl_s: seconds after which a request never finished is dropped.
        prefill_progress: estimate the head request's progress (True, the default; False: every routed
            request's whole prefill counts until its `PrefillDone`).
        prefill_rate_prior: prefill tokens/s assumed for a worker with no sample yet, ≥ 0 (0: none).
        prefill_rate_alpha: weight of the newest sample, 0 < alpha ≤ 1.
    """

    ttl_s: float = DEFAULT_REQUEST_TTL_S
    prefill_progress: bool = True
    prefill_rate_prior: float = 0.0
    prefill_rate_alpha: float = DEFAULT_PREFILL_RATE_ALPHA
    _requests: dict[str, _Active] = field(default_factory=dict)
    _workers: dict[Holder, _Worker] = field(default_factory=dict)
    _rates: dict[Holder, _Rate] = field(default_factory=dict)
    _now_s: float = -math.inf
    _stats: LedgerStats = field(default_factory=LedgerStats)
    _receipts: dict[Holder, Receipts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.prefill_rate_alpha <= 1:
            raise ValueError(f"prefill_rate_alpha must be within (0, 1], got {self.prefill_rate_alpha!r}")
        if not (self.prefill_rate_prior >= 0 and math.isfinite(self.prefill_rate_prior)):
            raise ValueError(
                f"prefill_rate_prior must be a finite number ≥ 0, got {self.prefill_rate_prior!r}"
            )

    def _clock(self, now_s: float | None) -> float:
        if now_s is None:
            return self._now_s
        self._now_s = max(self._now_s, now_s)
        return now_s

    def routed(self, event: Routed, now_s: float, *, captured_tokens: int | None = None) -> bool:
        """Apply a `Routed` event; return False when it changed no load (already held on that worker).

        Args:
            event: the note.
            now_s: when it was routed (or received).
            captured_tokens: given by the replica that answered the request (its own route): the chosen
                worker's cached tokens, kept so that the request's `finished` counts its delivered tokens here;
                None for a peer's note, which takes the receipt away from this replica (the peer answered it
                last).
        """
        self._clock(now_s)
        key = Holder(event.worker_id, event.dp_rank)
        captured = max(captured_tokens, 0) if captured_tokens is not None else -1
        old = self._requests.get(event.request_id)
        if old is not None:
            if old.key == key:
                old.captured = captured
                return False
            self._remove(event.request_id, now_s)
        self._add(event.request_id, key, max(event.prefill_tokens, 0), max(event.blocks, 0), now_s)
        self._requests[event.request_id].captured = captured
        self._stats.routed += 1
        return True

    def answered(self, worker_id: str, dp_rank: int, *, available_tokens: int, captured_tokens: int) -> None:
        """Count one route this replica answered with (worker, dp rank) in that holder's receipts.

        Args:
            worker_id: the chosen worker; ``dp_rank``: its rank.
            available_tokens: the most tokens any live candidate had cached (the reply's ``available_tokens``).
            captured_tokens: the chosen worker's cached tokens (the reply's ``cached_tokens``); regret grows by
                ``available_tokens − captured_tokens`` (never below 0).

        Cost: O(1).
        """
        key = Holder(worker_id, dp_rank)
        r = self._receipts.get(key)
        if r is None:
            r = self._receipts[key] = Receipts()
        available = max(available_tokens, 0)
        captured = max(captured_tokens, 0)
        r.requests += 1
        r.available_tokens += available
        r.captured_tokens += captured
        r.regret_tokens += max(available - captured, 0)

    def receipts(self) -> dict[Holder, Receipts]:
        """Return a copy of the route receipts per (worker, dp rank) (see `answered` and `finished`)."""
        return {k: r.copy() for k, r in self._receipts.items()}

    def prefill_done(self, request_id: str, now_s: float | None = None) -> bool:
        """The request's prompt is computed: its prefill tokens stop counting. False if unknown or done.

        ``now_s`` (default: the latest time the ledger was given) dates the end of the prefill, for the
        worker's throughput sample and its next head's start.
        """
        now = self._clock(now_s)
        a = self._requests.get(request_id)
        if a is None:
            self._stats.unknown += 1
            return False
        if a.prefill_tokens == 0:
            return False
        w = self._workers[a.key]
        self._sample(a.key, w, a, now)
        w.prefill_tokens -= a.prefill_tokens
        a.prefill_tokens = 0
        del w.pending[request_id]
        self._stats.prefill_done += 1
        return True

    def finished(
        self, request_id: str, now_s: float | None = None, *, cached_tokens: int | None = None
    ) -> bool:
        """The request is over: drop it. False if unknown.

        ``cached_tokens`` (the engine's own count of the request's cached prompt tokens, ≥ 0; None or negative:
        not known) is counted as delivered in the chosen worker's receipts when this replica answered the
        request (`routed` with ``captured_tokens``), once: the entry is gone afterwards.
        """
        a = self._requests.get(request_id)
        if a is None:
            self._stats.unknown += 1
            return False
        if cached_tokens is not None and cached_tokens >= 0 and a.captured >= 0:
            r = self._receipts.get(a.key)
            if r is None:
                r = self._receipts[a.key] = Receipts()
            r.delivered_requests += 1
            r.delivered_tokens += cached_tokens
            r.misprediction_tokens += max(a.captured - cached_tokens, 0)
            r.unpredicted_tokens += max(cached_tokens - a.captured, 0)
        self._remove(request_id, self._clock(now_s))
        self._stats.finished += 1
        return True

    def expire(self, now_s: float) -> int:
        """Drop requests routed more than ``ttl_s`` before ``now_s``; return how many."""
        self._clock(now_s)
        limit = now_s - self.ttl_s
        dropped = 0
        reqs = self._requests
        while reqs:
            rid, a = next(iter(reqs.items()))
            if a.routed_s > limit:
                break
            self._remove(rid, None)
            dropped += 1
        self._stats.expired += dropped
        return dropped

    def prefill_rate(self, worker_id: str, dp_rank: int) -> float:
        """Return the prefill throughput (tokens/s) the ledger assumes for one (worker, dp rank)."""
        r = self._rates.get(Holder(worker_id, dp_rank))
        return r.per_s if r is not None else self.prefill_rate_prior

    def loaded(self) -> list[Holder]:
        """Return the (worker, dp rank) pairs with requests in flight, each once, in no particular order: the
        only ones `load` can find non-zero (O(pairs with load), not O(fleet))."""
        return list(self._workers)

    def load(
        self, worker_id: str, dp_rank: int, *, excluding: str | None = None, now_s: float | None = None
    ) -> ActiveLoad:
        """Return the active load of one (worker, dp rank) (zero when none).

        Args:
            worker_id: the worker.
            dp_rank: its data-parallel rank.
            excluding: a request id whose own share is left out (a request routed again, e.g. a retry,
                must not be weighed down by itself).
            now_s: the time of the estimate (default: the latest time the ledger was given).
        """
        key = Holder(worker_id, dp_rank)
        w = self._workers.get(key)
        if w is None:
            return ZERO_LOAD
        prefill, blocks, requests = w.prefill_tokens, w.blocks, w.requests
        own = self._requests.get(excluding) if excluding is not None else None
        if own is not None and own.key == key:
            if requests == 1:
                return ZERO_LOAD
            prefill, blocks, requests = prefill - own.prefill_tokens, blocks - own.blocks, requests - 1
        if self.prefill_progress and w.pending:
            prefill -= self._progress(key, w, self._clock(now_s), excluding)
        return ActiveLoad(prefill_tokens=prefill, blocks=blocks, requests=requests)

    def _progress(self, key: Holder, w: _Worker, now: float, excluding: str | None) -> int:
        """Tokens of the head's prefill estimated done by ``now`` (0 with no rate or no head)."""
        rate = self.prefill_rate(*key)
        if rate <= 0:
            return 0
        it = iter(w.pending.items())
        rid, head = next(it)
        if rid == excluding:
            nxt = next(it, None)
            if nxt is None:
                return 0
            head = nxt[1]
        elapsed = now - max(head.routed_s, w.last_done_s)
        if not elapsed > 0:  # also NaN
            return 0
        done = rate * elapsed
        if not math.isfinite(done):
            return head.prefill_tokens
        return min(head.prefill_tokens, round(done))

    def _sample(self, key: Holder, w: _Worker, a: _Active, now: float) -> None:
        """Learn from a request whose prefill ended at ``now``; it ends the worker's current prefill."""
        seconds = now - max(a.routed_s, w.last_done_s)
        if seconds > 0:
            alpha = self.prefill_rate_alpha
            r = self._rates.get(key)
            if r is None:
                self._rates[key] = _Rate(float(a.prefill_tokens), seconds)
            else:
                r.tokens += alpha * (a.prefill_tokens - r.tokens)
                r.seconds += alpha * (seconds - r.seconds)
        w.last_done_s = max(w.last_done_s, now)

    def snapshot(self, now_s: float) -> LedgerSnapshot:
        """Return every in-flight request with its age (oldest first), for a peer that (re)starts."""
        self._clock(now_s)
        return LedgerSnapshot(
            entries=[
                LedgerEntry(
                    request_id=rid,
                    worker_id=a.key.worker_id,
                    dp_rank=a.key.dp_rank,
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
        (seen live since start-up) are kept as they are. An entry whose age is not a finite number is skipped
        (a negative age counts as 0); negative token or block counts count as 0 (as a `Routed` note's do).
        """
        self._clock(now_s)
        added = 0
        aged = [(max(e.age_s, 0.0), e) for e in snapshot.entries if math.isfinite(e.age_s)]
        for age_s, e in sorted(aged, key=lambda x: -x[0]):
            if e.request_id in self._requests or age_s >= self.ttl_s:
                continue
            self._add(
                e.request_id,
                Holder(e.worker_id, e.dp_rank),
                max(e.prefill_tokens, 0),
                max(e.blocks, 0),
                now_s - age_s,
            )
            added += 1
        if added:
            # Keep the dicts ordered by routing time: live entries may be younger than restored ones.
            self._requests = dict(sorted(self._requests.items(), key=lambda kv: kv[1].routed_s))
            for w in self._workers.values():
                w.pending = dict(sorted(w.pending.items(), key=lambda kv: kv[1].routed_s))
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
            receipts=self.receipts(),
        )

    def _add(self, rid: str, key: Holder, prefill_tokens: int, blocks: int, routed_s: float) -> None:
        a = _Active(key, prefill_tokens, blocks, routed_s)
        self._requests[rid] = a
        w = self._workers.get(key)
        if w is None:
            w = self._workers[key] = _Worker()
        w.prefill_tokens += prefill_tokens
        w.blocks += blocks
        w.requests += 1
        if prefill_tokens:
            w.pending[rid] = a

    def _remove(self, rid: str, now_s: float | None) -> None:
        """Drop a request. If it was its worker's head (the oldest still prefilling), the worker's current
        prefill ends at ``now_s`` (if given); one queued behind the head leaves without moving the head's start
        (the head is still being computed: its estimated progress must not restart)."""
        a = self._requests.pop(rid)
        w = self._workers[a.key]
        w.prefill_tokens -= a.prefill_tokens
        w.blocks -= a.blocks
        w.requests -= 1
        head = next(iter(w.pending), None) == rid
        if w.pending.pop(rid, None) is not None and head and now_s is not None:
            w.last_done_s = max(w.last_done_s, now_s)
        if w.requests == 0:
            del self._workers[a.key]


# ---------------------------------------------------------------------------------------- engine reports


@dataclass(slots=True)
class EngineLoads:
    """The newest `WorkerLoad` per (worker, dp rank), each ignored once older than ``ttl_s``."""

    ttl_s: float = DEFAULT_LOAD_TTL_S
    _reports: dict[Holder, tuple[WorkerLoad, float]] = field(default_factory=dict)

    def update(self, report: WorkerLoad, now_s: float) -> None:
        """Keep ``report`` as the newest for its (worker, dp rank), received at ``now_s``."""
        self._reports[Holder(report.worker_id, report.dp_rank)] = (report, now_s)

    def get(self, worker_id: str, dp_rank: int, now_s: float) -> WorkerLoad | None:
        """Return the fresh report of one (worker, dp rank), or None (none, or stale)."""
        r = self._reports.get(Holder(worker_id, dp_rank))
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
        label sets of the same rank (several ``model_name`` or ``finished_reason`` labels); a sample that is
        not finite (NaN, ``+Inf``, ``1e400``) is skipped; a rank with no recognised metric gives no load.
    """
    ranks: dict[int, dict[str, float]] = {}
    prios: dict[tuple[int, str], int] = {}
    for name, labels, value in decode_prometheus_text(text, _WANTED):
        if model is not None and labels.get("model_name", model) != model:
            continue
        if not math.isfinite(value):  # NaN, or ±Inf (also a literal too large for a float): no load to report
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
