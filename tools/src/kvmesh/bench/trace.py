"""``kvmesh bench trace``: replay a Mooncake trace against a simulated fleet, once per routing policy.

Every policy serves the same requests on the same fleet: N `kvmesh.sim.timing.TimedWorker` engines (vLLM-like
block pools with a timing model), in simulated time. Per policy it reports the prefix-cache hit ratio, the
simulated time to first token (p50/p99), the simulated request rate, for kvmesh the route latency, and the
route receipts in tokens: *available* (the most any worker had cached), *captured* (the chosen worker's, as
the policy saw it) and *delivered* (the engine's own count; kvmesh passes it to ``Router.finish``).

Timing rule (the same dispatch path for every policy, `_Fleet`): a request's TTFT counts from its trace
arrival time. At that simulated time the policy decides, seeing the fleet as it is then; the request reaches
its engine at *arrival + routing delay* and queues there. The routing delay is the decision's real latency
in seconds, **not** multiplied by ``--speed``: for ``kvmesh`` the measured round trip of
`kvmesh.client.Router.route` through NATS (a few ms), for the in-process policies 0 (they read the
simulated fleet directly, as a router in the engine's process would). Requests routed and not yet delivered
are already in kvmesh's load accounting (the router records a request when it answers), as in a real fleet.
Lifecycle notes are sent when they happen in simulated time: ``mark_prefill_done`` when a request's first
token is out, ``finish`` at its last token, each stamped (``at``) with the wall time of its simulated time, as
a gateway stamps the engine's first and last token. For ``kvmesh`` the harness may fall behind its wall-time schedule
(the pipeline's processes share the cores with it): a request it routes late *arrives* when it was routed
(`dispatched`), so the engines' simulated clock and the router's clock stay in step (``route_late_p50_ms`` /
``route_late_p99_ms`` say by how much, wall time). Kept at the trace's arrival instead, a late request would
reach an engine whose state the router saw up to that lateness × ``--speed`` later, and the router's
estimate of prefill progress (learned and applied on its own clock) would run ahead of the engines.

* ``kvmesh`` runs through the real pipeline: each engine publishes its KV events on a real ZMQ PUB + replay
  socket at the wall time matching their simulated time (simulated time = wall time × ``--speed``), one
  ``kvmesh ingest`` process per engine puts them on JetStream, a ``kvmesh indexer`` and a ``kvmesh router``
  (child processes, on a private ``nats-server``) answer each request through `kvmesh.client.Router`.
  The router only ever knows what the events and lifecycle notes told it. The pipeline's own lag (event
  published → indexed) is real time and so *is* scaled by ``--speed`` in simulated time: a pessimistic
  view of index staleness (``batches_late_over_10ms`` counts batches the harness published late; the
  ``overlap_*`` counters compare the router's overlap for its chosen worker with that pool's truth).
* ``round-robin``, ``random`` and ``least-loaded`` (fewest waiting + running requests) are computed
  in-process (they do not read the caches).
* ``oracle``, the TTFT reference: per request, the worker with the lowest estimated TTFT for *that*
  request, ties to the lowest worker index. It knows, at the decision instant and exactly, each pool's
  prefix hit for the prompt (`kvmesh.sim.blockpool.BlockPool.match_prefix`) and each engine's queue
  (`kvmesh.sim.timing.TimedWorker.estimate_ttft_s`: when its prefill unit is free, the prompt lengths of
  its waiting requests, and when a batch slot frees if the batch is full). It does not know, so does not
  optimise: the hits of the requests already waiting (counted as none), what its choice does to later
  requests (the blocks it evicts, the queue it builds), decode load (free in this fleet), or pool eviction
  before admission. It is greedy, not an optimum: a policy can beat it on hits or TTFT.
* ``kvmesh-exact`` (only with ``--policies``): kvmesh's decision (`kvmesh.core.route.decide` with a
  `kvmesh.core.load.LoadLedger` fed the same lifecycle notes, each dated at its simulated time) on exact,
  instant state: each pool's true
  overlap, no pipeline, no route latency. kvmesh against kvmesh-exact is what the pipeline costs; kvmesh-exact
  against the oracle is what the cost function costs.
* ``longest-prefix`` (only with ``--policies``), the hits reference: per request, the worker with the
  longest true prefix hit at the decision (`BlockPool.match_prefix`), whatever its load; ties to the fewest
  waiting + running requests, then the lowest worker index. It maximises each request's hit as routed
  (greedy: the hit the engine finally delivers can be less, as the pool may evict while the request
  queues). Where every prompt shares a first block (the Mooncake conversation trace) it sends nearly
  everything to one worker: it shows what hits cost when load is ignored. ``oracle`` and
  ``longest-prefix`` are the two ends a load-aware router sits between.

* ``kvmesh-lagged`` (only with ``--policies``): kvmesh's decision (as ``kvmesh-exact``: `decide` and a
  `LoadLedger` fed the lifecycle notes) on what a router's index would know: a real
  `kvmesh.core.state.IndexState` fed each engine's KV event batches through the real decode path (the
  simulated publisher's encoder, the ingest's `kvmesh.core.wire.decode_batch` and
  `kvmesh.core.normalize.Normalizer`, one encoded stream message per batch applied by
  `kvmesh.core.apply.StreamApplier`) only once they are ``--event-lag-s`` simulated seconds old (default
  0.19 s: a real vLLM engine's publish delay measured on a loaded 2-core machine); overlaps from
  `IndexState.match`. With ``--predicted-ttl-s T`` (> 0) the router's *predicted entries* are on (Dynamo's
  ``--router-predicted-ttl-secs``, llm-d's speculative indexing): each decision counts the prompt's blocks
  as held by the chosen worker for ``T`` seconds (`kvmesh.core.predicted.PredictedBlocks`, keyed by the
  index's own prefix keys, `kvmesh.core.tables.prompt_keys`), and each candidate's overlap is the larger of
  the indexed and the predicted one. ``--predicted-ttl-s 0,0.5,2`` runs it three times (0: without them),
  one row each (``kvmesh-lagged +pred 2 s``). With lag 0 the index holds what the pools hold: its overlaps
  are kvmesh-exact's except where a whole block-aligned prompt is cached (the index counts its last block;
  an engine serves at most the prompt less one token).
* ``kvmesh-approx`` (only with ``--policies``): kvmesh's decision for engines that publish no KV events
  (Dynamo's capacity-bounded approximate mode): overlaps only from the router's own decisions, a
  `PredictedBlocks` without TTL bounded per worker by the pool's size (``--num-blocks``), least recently
  used out first.

  For these two, *captured* tokens are the chosen worker's overlap as the policy saw it, and ``extra``
  counts, as for ``kvmesh``, the routes whose overlap was exact, under or over the pool's true hit
  (``overlap_missed_blocks``: blocks it did not see; ``overlap_phantom_blocks``: blocks it wrongly credited).

``--trace burst`` replays a generated workload instead of a file (`burst_trace`): bursts of ``--burst-size``
requests (default 32) arriving at seeded uniform times within ``--burst-window-ms`` (default 100 ms), one
burst every ``--burst-gap-s`` (default 5 s); each burst has ``--burst-prefixes`` new prefixes (default 1) of
``--burst-prefix-tokens`` (default 4,096), each request one of them plus its own 256-token suffix, 64 output
tokens. ``--requests`` requests in all (default 20 bursts); deterministic from ``--seed``.

``--sessions`` gives each request a session id (session affinity, `kvmesh.core.sessions`): the Mooncake traces
carry none, so a conversation is recognised by its first two trace blocks (`session_of`: requests whose
``hash_ids`` start with the same two ids are one session; a prompt with fewer than 2 trace blocks gets no
session). ``kvmesh`` sends it as ``Router.route(..., session_id=...)``; the ``kvmesh-*`` policies keep a
`kvmesh.core.sessions.SessionTable` (no TTL) noted with each decision and pass the session's last worker to
`kvmesh.core.route.rank` (``session=``). ``--session-slack S`` sets ``Policy.session_slack`` for all kvmesh
policies (default: the router's, `kvmesh.core.route.SESSION_SLACK`); ``--session-slack 0,0.25,1`` runs each
kvmesh policy once per value, one row each (``kvmesh-exact +sess 0.25``). ``extra`` counts the routes whose
session was ``session_new`` (no worker known yet), ``session_kept`` and ``session_moved``.

``--overlap-weight`` / ``--decode-weight`` set the router's cost weights for ``kvmesh`` and the ``kvmesh-*`` policies
(default: the router's defaults, `kvmesh.core.route.Policy`); ``--prefill-progress`` /
``--no-prefill-progress`` set the load ledger's prefill progress estimate for both (default: the router's
default, `kvmesh.core.load.LoadLedger`); ``--router-arg`` passes any other flag to the router (predicted
entries are a bench-only policy here: the router service does not have them).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import heapq
import math
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from kvmesh.bench.chart import write_bar_charts
from kvmesh.core import tables
from kvmesh.core.apply import StreamApplier
from kvmesh.core.errors import UnknownModelError
from kvmesh.core.events import EventsMessage, encode_message
from kvmesh.core.index import Holder
from kvmesh.core.load import ActiveLoad, LoadLedger
from kvmesh.core.normalize import Normalizer
from kvmesh.core.predicted import PredictedBlocks
from kvmesh.core.protocol import Routed
from kvmesh.core.route import Candidate, Policy, rank, route_seed
from kvmesh.core.sessions import SessionTable
from kvmesh.core.state import IndexState
from kvmesh.core.wire import EngineBatch, decode_batch, encode_batch
from kvmesh.harness.procs import ChildProcesses
from kvmesh.sim.blockpool import BlockPool
from kvmesh.sim.engine import output_tokens
from kvmesh.sim.publisher import EventPublisher
from kvmesh.sim.timing import RequestTiming, StepBatch, TimedWorker, TimingModel
from kvmesh.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest, default_trace_path, expand_tokens, load_trace

__all__ = ["POLICIES", "PolicyResult", "burst_trace", "command", "run_bench", "session_of", "simulate_policy"]

POLICIES: Final[tuple[str, ...]] = ("kvmesh", "round-robin", "random", "least-loaded", "oracle")
"""The policies run by default."""
EXTRA_POLICIES: Final[tuple[str, ...]] = ("kvmesh-exact", "longest-prefix", "kvmesh-lagged", "kvmesh-approx")
"""Policies run only when asked for with ``--policies``."""
MODEL: Final[str] = "bench-model"
_REPLAY_STEPS: Final[int] = 2000
"""Batches each engine keeps for replay (a prompt's batch carries its token ids: ~20 KB)."""
_LATE_S: Final[float] = 0.010
"""A batch published more than this many wall seconds after its time counts as late."""
DEFAULT_EVENT_LAG_S: Final[float] = 0.19
"""``--event-lag-s``: how late ``kvmesh-lagged``'s index sees a KV event batch (a real vLLM engine on a loaded
2-core machine published a request's events up to ~190 ms after the router's reply)."""
SESSION_BLOCKS: Final[int] = 2
"""``--sessions``: a request's session is its first this many trace blocks (`session_of`)."""
BURST_TRACE: Final[str] = "burst"
"""``--trace burst``: the generated burst workload (`burst_trace`) instead of a file."""


@dataclass(slots=True, kw_only=True)
class PolicyResult:
    """The outcome of one policy on the trace."""

    policy: str
    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    makespan_s: float = 0.0
    """Simulated time from the first arrival to the last finish."""
    wall_s: float = 0.0
    route_latency_s: list[float] = field(default_factory=list)
    per_worker: list[int] = field(default_factory=list)
    """Requests served per worker."""
    busiest_running: list[int] = field(default_factory=list)
    """At each arrival, the running requests of the fleet's busiest worker (the decode batch a skewed policy
    builds: in a real engine a larger batch means slower tokens for every request in it)."""
    extra: dict[str, Any] = field(default_factory=dict)
    available_tokens: int = 0
    """Route receipts: the most prompt tokens any worker had cached, summed over the requests (for ``kvmesh``
    the router's ``available_tokens``; in-process policies: the pools' truth at the decision)."""
    arrivals_ms: list[int] = field(default_factory=list)
    """``kvmesh``: each request's arrival as the harness dispatched it (`dispatched`), in the trace's
    milliseconds: the schedule `on_arrivals` replays."""
    captured_tokens: int = 0
    """The chosen worker's cached tokens as the policy saw them (``kvmesh``: the reply's ``cached_tokens``).
    Delivered tokens are ``cached_tokens``: the engines' own count, which ``kvmesh`` reports to the router
    with ``Router.finish(..., cached_tokens=...)``."""

    @property
    def hit_ratio(self) -> float:
        """Cached prompt tokens over prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def requests_per_s(self) -> float:
        """Served requests per second of simulated time."""
        return self.requests / self.makespan_s if self.makespan_s > 0 else 0.0

    def add(self, t: RequestTiming) -> None:
        """Count one finished (or rejected) request."""
        if t.rejected:
            self.rejected += 1
            return
        self.requests += 1
        self.prompt_tokens += t.prompt_tokens
        self.cached_tokens += t.cached_tokens
        if t.ttft_s is not None:
            self.ttft_s.append(t.ttft_s)


def percentile(values: Sequence[float], q: float) -> float:
    """Return the ``q`` quantile (0..1) of ``values`` by the nearest-rank rule (nan when empty)."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


# ---------------------------------------------------------------------- the simulated fleet


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetSpec:
    """Shape of the simulated fleet."""

    workers: int = 8
    num_blocks: int = 16384
    block_size: int = 16
    seed: int = 0
    timing: TimingModel = field(default_factory=TimingModel)

    def build(self) -> list[TimedWorker]:
        """Return fresh workers (worker i's pool has hash seed ``seed + i``, as `kvmesh sim`)."""
        return [
            TimedWorker(
                BlockPool(num_blocks=self.num_blocks, block_size=self.block_size, seed=self.seed + i),
                self.timing,
            )
            for i in range(self.workers)
        ]


def session_of(req: TraceRequest) -> str | None:
    """Return the session id ``--sessions`` gives a request: its first two trace blocks (``"s-<id>-<id>"``),
    or None when its prompt has fewer than 2 trace blocks.

    The Mooncake traces carry no session ids; a conversation's requests repeat its earlier turns, so they
    start with the same trace blocks (conversation trace, 12,031 requests: 7,373 such sessions, 6,917 requests
    in sessions of more than one; synthetic trace, 3,993 requests: 1,138 sessions, 2,133 in sessions of more
    than one).
    """
    if len(req.hash_ids) < SESSION_BLOCKS:
        return None
    return "s-" + "-".join(str(h) for h in req.hash_ids[:SESSION_BLOCKS])


@dataclass(slots=True)
class _Prepared:
    request_id: str
    arrival_s: float
    tokens: list[int]
    outputs: list[int]
    session_id: str | None = None


def _prepare(req: TraceRequest, i: int, t0_ms: int, *, sessions: bool = False) -> _Prepared:
    tokens = expand_tokens(req)
    return _Prepared(
        f"req-{i}",
        (req.timestamp_ms - t0_ms) / 1000.0,
        tokens,
        output_tokens(tokens, req.output_length),
        session_of(req) if sessions else None,
    )


def dispatched(p: _Prepared, now_s: float) -> _Prepared:
    """Return ``p`` as the harness sends it at simulated time ``now_s``: unchanged when on time, else arriving
    at ``now_s`` (a request the harness routes late reaches its engine, and has its TTFT counted, from when it
    was routed, so the simulated engines' clock stays the router's clock × ``--speed``)."""
    return p if now_s <= p.arrival_s else replace(p, arrival_s=now_s)


def _count_session(result: PolicyResult, outcome: str | None) -> None:
    """Add a route's session outcome (``new``, ``kept``, ``moved``) to ``result.extra``."""
    if outcome is not None:
        key = f"session_{outcome}"
        result.extra[key] = result.extra.get(key, 0) + 1


_EVENTS: Final[int] = 0
_PREFILL_DONE: Final[int] = 1
_FINISHED: Final[int] = 2
_Item = tuple[float, int, int, int, Any]
"""What happened in the fleet: (simulated time, serial, worker, kind, `StepBatch` or request id)."""


class _Fleet:
    """The simulated fleet and the dispatch path every policy shares.

    A request is `send`-ed to a worker with its routing delay; it reaches the worker's engine at its arrival
    time + that delay (`TimedWorker.submit` with ``received_s``), so its TTFT includes the delay. `advance`
    runs every worker up to a time and returns, in time order, the event batches the engines emitted and
    the lifecycle notes a client would send (prefill done when the first token is out, finished at the last).
    """

    def __init__(self, spec: FleetSpec, result: PolicyResult) -> None:
        self.workers = spec.build()
        self.result = result
        self.last_finish_s = 0.0
        self._pending: list[tuple[float, int, int, _Prepared]] = []
        self._notes: list[tuple[float, int, int, int, str]] = []
        self._serial = 0
        self.delivered: dict[str, int] = {}
        """Request id → the engine's cached prompt tokens, once the request finished (what ``finish`` reports)."""

    def _next_serial(self) -> int:
        self._serial += 1
        return self._serial

    def sample(self) -> None:
        """Record the busiest worker's running requests now (call at each arrival, after `advance`)."""
        self.result.busiest_running.append(max(w.running for w in self.workers))

    def send(self, p: _Prepared, worker: int, delay_s: float) -> None:
        """Route ``p`` to ``worker``: it reaches the engine ``delay_s`` simulated seconds after its arrival."""
        self.result.per_worker[worker] += 1
        heapq.heappush(self._pending, (p.arrival_s + max(delay_s, 0.0), self._next_serial(), worker, p))

    def next_time_s(self) -> float | None:
        """Return the simulated time of the next thing to happen, or None when the fleet is idle."""
        times = [t for w in self.workers if (t := w.next_time_s()) is not None]
        if self._pending:
            times.append(self._pending[0][0])
        if self._notes:
            times.append(self._notes[0][0])
        return min(times, default=None)

    def advance(self, until_s: float) -> list[_Item]:
        """Deliver the requests due by ``until_s``, run every worker to it; return what happened, in time order."""
        out: list[_Item] = []
        while self._pending and self._pending[0][0] <= until_s:
            at_s, _serial, k, p = heapq.heappop(self._pending)
            self._run(k, at_s, out)
            self.workers[k].submit(p.request_id, p.tokens, p.outputs, arrival_s=p.arrival_s, received_s=at_s)
            self._collect(k, at_s)
        for k in range(len(self.workers)):
            self._run(k, until_s, out)
        while self._notes and self._notes[0][0] <= until_s:
            out.append(heapq.heappop(self._notes))
        out.sort(key=lambda x: (x[0], x[1]))
        return out

    def _run(self, k: int, until_s: float, out: list[_Item]) -> None:
        out.extend((b.time_s, self._next_serial(), k, _EVENTS, b) for b in self.workers[k].advance(until_s))
        self._collect(k, until_s)

    def _collect(self, k: int, now_s: float) -> None:
        w = self.workers[k]
        for t in w.take_first_tokens():
            if t.first_token_s is not None:
                heapq.heappush(
                    self._notes, (t.first_token_s, self._next_serial(), k, _PREFILL_DONE, t.request_id)
                )
        for t in w.take_finished():
            self.result.add(t)
            self.delivered[t.request_id] = t.cached_tokens
            if t.finished_s is not None:
                self.last_finish_s = max(self.last_finish_s, t.finished_s)
            at_s = t.finished_s if t.finished_s is not None else now_s
            heapq.heappush(self._notes, (at_s, self._next_serial(), k, _FINISHED, t.request_id))

    def close(self, first_arrival_s: float) -> None:
        """Record the makespan and the engines' counters (after the last `advance`)."""
        self.result.makespan_s = self.last_finish_s - first_arrival_s if self.result.requests else 0.0
        self.result.extra["decode_overflows"] = sum(w.decode_overflows for w in self.workers)


class _LaggedIndex:
    """What a kvmesh router's index knows of the fleet: the engines' KV event batches, ``lag_s`` late.

    Each batch goes through the path a real one takes: the simulated publisher's encoder
    (`kvmesh.core.wire.encode_batch`, vLLM 0.33.0's layout, as `kvmesh.sim.publisher.EventPublisher`), the
    ingest's decoder and normalizer (`kvmesh.core.wire.decode_batch`, `kvmesh.core.normalize.Normalizer`), one
    stream message per batch (`kvmesh.core.events.EventsMessage`, encoded), applied by the readers' apply path
    (`kvmesh.core.apply.StreamApplier`) to a real `kvmesh.core.state.IndexState`. A batch emitted at simulated
    time ``t`` is applied at the first decision at or after ``t + lag_s``. Every worker starts with an ingest
    hello (no events, seq -1), so it is a candidate before its first batch.
    """

    def __init__(self, workers: int, block_size: int, lag_s: float) -> None:
        self.state = IndexState()
        self.applier = StreamApplier()
        self.block_size = block_size
        self.lag_s = lag_s
        self._normalizers = [Normalizer(block_size=block_size) for _ in range(workers)]
        self._seqs = [-1] * workers
        self._stream_seq = 0
        self._queue: collections.deque[tuple[float, int, StepBatch]] = collections.deque()
        self.rejections = 0
        """Events the normalizer refused (expected 0: the simulated engines publish well-formed events)."""
        for k in range(workers):
            self._apply(k, 0.0, [])

    def push(self, items: Sequence[_Item]) -> None:
        """Queue the event batches of ``items`` (in time order, as `_Fleet.advance` returns them)."""
        self._queue.extend((t, k, payload) for t, _serial, k, kind, payload in items if kind == _EVENTS)

    def catch_up(self, now_s: float) -> None:
        """Apply every queued batch at least ``lag_s`` old at ``now_s``."""
        q = self._queue
        while q and q[0][0] + self.lag_s <= now_s:
            time_s, k, batch = q.popleft()
            payload = encode_batch(
                EngineBatch(ts=time_s, events=tuple(batch.events), dp_rank=0),
                producer="vllm",
                version="0.33.0",
            )
            result = self._normalizers[k].normalize(decode_batch(payload))
            self.rejections += len(result.rejections)
            self._seqs[k] += 1
            self._apply(k, time_s, result.events)

    def _apply(self, k: int, ts: float, events: list[Any]) -> None:
        msg = EventsMessage(
            worker_id=f"sim-{k}", dp_rank=0, model=MODEL, block_size=self.block_size, epoch=0,
            seq=self._seqs[k], ts=ts, events=events,
        )  # fmt: skip
        self._stream_seq += 1
        skipped = self.applier.apply(self.state, self._stream_seq, encode_message(msg))
        if skipped is not None:
            raise RuntimeError(f"the index refused a stream message of sim-{k}: {skipped}")

    def overlaps(self, tokens: Sequence[int]) -> dict[str, tuple[int, int]]:
        """Worker id → (overlap blocks, cached blocks) from `IndexState.match`."""
        try:
            m = self.state.match(MODEL, tokens)
        except UnknownModelError:
            return {}
        return {c.worker_id: (c.overlap_blocks, c.cached_blocks) for c in m.candidates}


class _Chooser:
    """An in-process policy: picks a worker from the fleet's exact, current state (or, for ``kvmesh-lagged``
    and ``kvmesh-approx``, from what a router would know of it)."""

    def __init__(
        self,
        policy: str,
        fleet: _Fleet,
        spec: FleetSpec,
        route_policy: Policy,
        prefill_progress: bool | None,
        *,
        event_lag_s: float = DEFAULT_EVENT_LAG_S,
        predicted_ttl_s: float | None = None,
    ) -> None:
        if policy not in POLICIES + EXTRA_POLICIES or policy == "kvmesh":
            raise ValueError(f"unknown policy {policy!r}")
        if predicted_ttl_s is not None and policy != "kvmesh-lagged":
            raise ValueError(f"predicted entries with a TTL are a kvmesh-lagged option, not {policy!r}'s")
        self.policy = policy
        self.workers = fleet.workers
        self.rng = random.Random(spec.seed)
        self.block_size = spec.block_size
        self.route_policy = route_policy
        self.ledger = (
            LoadLedger(ttl_s=math.inf)
            if prefill_progress is None
            else LoadLedger(ttl_s=math.inf, prefill_progress=prefill_progress)
        )
        self.index = (
            _LaggedIndex(spec.workers, spec.block_size, event_lag_s) if policy == "kvmesh-lagged" else None
        )
        self.predicted: PredictedBlocks | None = None
        if policy == "kvmesh-approx":
            self.predicted = PredictedBlocks(ttl_s=None, capacity_blocks=spec.num_blocks)
        elif predicted_ttl_s is not None:
            self.predicted = PredictedBlocks(ttl_s=predicted_ttl_s)
        self.seen_blocks = 0
        """The overlap the last `choose` saw for the worker it chose (kvmesh policies), in blocks."""
        self.sessions = SessionTable(ttl_s=math.inf)
        """Session → the worker of its last route (kvmesh policies, requests with a session id)."""
        self.session_outcome: str | None = None
        """The last `choose`'s session outcome (``new``, ``kept``, ``moved``), None without a session."""

    def observe(self, items: Sequence[_Item]) -> None:
        """Apply the lifecycle notes to the ledger (the kvmesh policies); queue event batches for the index."""
        if not self.policy.startswith("kvmesh-"):
            return
        if self.index is not None:
            self.index.push(items)
        for time_s, _serial, _k, kind, payload in items:
            if kind == _PREFILL_DONE:
                self.ledger.prefill_done(payload, time_s)
            elif kind == _FINISHED:
                self.ledger.finished(payload, time_s)

    def choose(self, i: int, p: _Prepared) -> int:
        """Return the worker for request ``i``."""
        workers, tokens, n = self.workers, p.tokens, len(self.workers)
        policy = self.policy
        if policy == "round-robin":
            return i % n
        if policy == "random":
            return self.rng.randrange(n)
        if policy == "least-loaded":
            return min(range(n), key=lambda k: (workers[k].active, k))
        if policy == "longest-prefix":
            return min(range(n), key=lambda k: (-workers[k].pool.match_prefix(tokens), workers[k].active, k))
        if policy == "oracle":
            now = max(w.now_s for w in workers)
            return min(
                range(n),
                key=lambda k: (
                    workers[k].estimate_ttft_s(len(tokens) - workers[k].pool.match_prefix(tokens), now),
                    k,
                ),
            )
        if policy == "kvmesh-exact":
            bs = self.block_size
            return self._kvmesh(
                p, [(w.pool.match_prefix(tokens) // bs, w.pool.cached_hashes) for w in self.workers]
            )
        return self._kvmesh_known(p)

    def _kvmesh_known(self, p: _Prepared) -> int:
        """``kvmesh-lagged`` / ``kvmesh-approx``: overlaps from the lagged index and/or the predicted entries."""
        now, n, bs = p.arrival_s, len(self.workers), self.block_size
        seen = [(0, 0)] * n
        if self.index is not None:
            self.index.catch_up(now)
            indexed = self.index.overlaps(p.tokens)
            seen = [indexed.get(f"sim-{k}", (0, 0)) for k in range(n)]
        keys: list[int] = []
        pred = self.predicted
        if pred is not None:
            keys = tables.prompt_keys(tables.token_array(p.tokens), bs).tolist()
            if pred.ttl_s is not None:
                pred.expire(now)
            guessed = pred.match(keys, now)
            seen = [
                (
                    max(seen[k][0], guessed.get(Holder(f"sim-{k}", 0), 0)),
                    seen[k][1] if self.index is not None else pred.block_count(Holder(f"sim-{k}", 0)),
                )
                for k in range(n)
            ]
        k = self._kvmesh(p, seen)
        if pred is not None:
            pred.add(Holder(f"sim-{k}", 0), keys, now)
        return k

    def _kvmesh(self, p: _Prepared, seen: Sequence[tuple[int, int]]) -> int:
        """kvmesh's decision given each worker's (overlap blocks, cached blocks); the ledger records it."""
        bs = self.block_size
        cands = [
            Candidate(worker_id=f"sim-{k}", dp_rank=0, overlap_blocks=o, cached_blocks=c)
            for k, (o, c) in enumerate(seen)
        ]
        active: dict[Holder, ActiveLoad] = {}
        for c in cands:
            a = self.ledger.load(c.worker_id, 0, excluding=p.request_id, now_s=p.arrival_s)
            if a.requests:
                active[Holder(c.worker_id, 0)] = a
        sid = p.session_id
        session = None if sid is None else self.sessions.get(sid, p.arrival_s)
        ranking = rank(
            cands,
            prompt_tokens=len(p.tokens),
            block_size=bs,
            policy=self.route_policy,
            active=active,
            seed=route_seed(p.request_id, b""),
            session=session,
        )
        assert ranking is not None
        w = ranking.winner
        self.session_outcome = None if sid is None else (ranking.session or "new")
        if sid is not None:
            self.sessions.note(sid, Holder(w.worker_id, 0), p.arrival_s)
        self.ledger.routed(
            Routed(
                request_id=p.request_id,
                worker_id=w.worker_id,
                dp_rank=0,
                prefill_tokens=max(len(p.tokens) - w.overlap_blocks * bs, 0),
                blocks=-(-len(p.tokens) // bs),
            ),
            p.arrival_s,
        )
        self.seen_blocks = w.overlap_blocks
        return int(w.worker_id.removeprefix("sim-"))


def policy_label(
    policy: str, predicted_ttl_s: float | None = None, session_slack: float | None = None
) -> str:
    """The row name of a policy: ``kvmesh-lagged`` with predicted entries reads ``kvmesh-lagged +pred 2 s``; a
    kvmesh policy with sessions (``--sessions``) adds ``+sess <slack>``: ``kvmesh-exact +sess 0.25``."""
    label = policy if predicted_ttl_s is None else f"{policy} +pred {predicted_ttl_s:g} s"
    return label if session_slack is None else f"{label} +sess {session_slack:g}"


def simulate_policy(
    policy: str,
    trace: Sequence[TraceRequest],
    spec: FleetSpec,
    *,
    route_policy: Policy | None = None,
    prefill_progress: bool | None = None,
    event_lag_s: float = DEFAULT_EVENT_LAG_S,
    predicted_ttl_s: float | None = None,
    sessions: bool = False,
) -> PolicyResult:
    """Serve ``trace`` on a fresh fleet with an in-process policy (not ``kvmesh``), in simulated time.

    The decision is taken in the harness from the fleet's state at the request's arrival and costs no
    simulated time (routing delay 0). ``route_policy`` is the cost policy of the kvmesh policies
    (``kvmesh-exact``, ``kvmesh-lagged``, ``kvmesh-approx``; default `Policy()`, the router's defaults);
    ``prefill_progress`` their ledger's prefill progress estimate (None: `LoadLedger`'s default, the
    router's). ``event_lag_s`` is how late ``kvmesh-lagged``'s index sees the engines' KV events;
    ``predicted_ttl_s`` (``kvmesh-lagged`` only) turns its predicted entries on with that TTL. With
    ``sessions`` each request carries its `session_of` id: the kvmesh policies keep each session's last worker
    (a `SessionTable` without TTL), pass it to `kvmesh.core.route.rank` (affinity within
    ``route_policy.session_slack``), label their row ``+sess <slack>`` and count ``session_new`` /
    ``session_kept`` / ``session_moved`` in ``extra``; the other policies ignore it.

    Route receipts: *available* is the pools' truth at the decision; *captured* is the chosen worker's
    overlap as the policy saw it (the truth for the policies that read the pools). For the kvmesh policies
    ``extra`` counts, as for ``kvmesh``, the routes whose seen overlap (capped at the prompt's blocks less
    its last token, as an engine serves) was exact, under or over the chosen pool's true hit.

    Raises:
        ValueError: an unknown policy, or ``predicted_ttl_s`` for another policy than ``kvmesh-lagged``.
    """
    pol = route_policy or Policy()
    sessions = sessions and policy.startswith("kvmesh-")
    label = policy_label(policy, predicted_ttl_s, pol.session_slack if sessions else None)
    result = PolicyResult(policy=label, per_worker=[0] * spec.workers)
    fleet = _Fleet(spec, result)
    chooser = _Chooser(
        policy, fleet, spec, pol, prefill_progress, event_lag_s=event_lag_s, predicted_ttl_s=predicted_ttl_s
    )
    seen_by_kvmesh = policy in ("kvmesh-lagged", "kvmesh-approx")
    overlap: list[int] = []
    t0_ms = trace[0].timestamp_ms if trace else 0
    start = time.perf_counter()
    if sessions:
        result.extra.update(session_new=0, session_kept=0, session_moved=0)
    for i, req in enumerate(trace):
        p = _prepare(req, i, t0_ms, sessions=sessions)
        chooser.observe(fleet.advance(p.arrival_s))
        fleet.sample()
        k = chooser.choose(i, p)
        _count_session(result, chooser.session_outcome)
        hits = [w.pool.match_prefix(p.tokens) for w in fleet.workers]
        result.available_tokens += max(hits, default=0)
        if seen_by_kvmesh:
            bs = spec.block_size
            result.captured_tokens += chooser.seen_blocks * bs
            overlap.append(min(chooser.seen_blocks, (len(p.tokens) - 1) // bs) - hits[k] // bs)
        else:
            result.captured_tokens += hits[k]
        fleet.send(p, k, 0.0)
    fleet.advance(math.inf)
    fleet.close(0.0)
    result.wall_s = time.perf_counter() - start
    if seen_by_kvmesh:
        result.extra["overlap_exact"] = sum(1 for d in overlap if d == 0)
        result.extra["overlap_under"] = sum(1 for d in overlap if d < 0)
        result.extra["overlap_over"] = sum(1 for d in overlap if d > 0)
        result.extra["overlap_missed_blocks"] = -sum(d for d in overlap if d < 0)
        result.extra["overlap_phantom_blocks"] = sum(d for d in overlap if d > 0)
    if chooser.index is not None and chooser.index.rejections:
        result.extra["normalize_rejections"] = chooser.index.rejections
    return result


def burst_trace(
    requests: int,
    *,
    size: int = 32,
    prefix_tokens: int = 4096,
    suffix_tokens: int = 256,
    window_ms: int = 100,
    gap_s: float = 5.0,
    output_tokens: int = 64,
    prefixes: int = 1,
    seed: int = 0,
) -> list[TraceRequest]:
    """Return a generated burst workload: groups of requests sharing new prefixes, arriving together.

    Group ``g`` (0, 1, …) starts at ``g × gap_s``; its ``size`` requests arrive at seeded uniform times within
    ``window_ms`` of that start (sorted). The group has ``prefixes`` prefixes of its own (``prefix_tokens``
    each, whole 512-token trace blocks, seen in no other group); each request takes one of them, drawn
    uniformly (with one prefix: all the same), followed by a suffix of ``suffix_tokens`` that no other request
    shares. Deterministic from ``seed``. The last group is cut to reach exactly ``requests``.

    Raises:
        ValueError: a count or length below 1 (``suffix_tokens`` may be 0), ``prefix_tokens`` not a multiple of
            512, or a negative ``window_ms`` / ``gap_s``.
    """
    if min(size, prefix_tokens, output_tokens, prefixes) < 1 or requests < 0 or suffix_tokens < 0:
        raise ValueError(
            "burst: requests >= 0, size, prefix_tokens, output_tokens, prefixes >= 1 and suffix_tokens >= 0"
        )
    if prefix_tokens % TRACE_BLOCK_TOKENS:
        raise ValueError(
            f"burst: prefix_tokens must be a multiple of {TRACE_BLOCK_TOKENS}, got {prefix_tokens}"
        )
    if window_ms < 0 or gap_s < 0:
        raise ValueError("burst: window_ms and gap_s must be >= 0")
    rng = random.Random(seed)
    prefix_ids = prefix_tokens // TRACE_BLOCK_TOKENS
    suffix_ids = -(-suffix_tokens // TRACE_BLOCK_TOKENS)
    out: list[TraceRequest] = []
    g = 0
    next_id = 0
    while len(out) < requests:
        group = [
            list(range(next_id + j * prefix_ids, next_id + (j + 1) * prefix_ids)) for j in range(prefixes)
        ]
        next_id += prefixes * prefix_ids
        t0_ms = round(g * gap_s * 1000)
        for at_ms in sorted(rng.randrange(window_ms + 1) for _ in range(min(size, requests - len(out)))):
            prefix = group[rng.randrange(prefixes)] if prefixes > 1 else group[0]
            suffix = [next_id + j for j in range(suffix_ids)]
            next_id += suffix_ids
            out.append(
                TraceRequest(
                    timestamp_ms=t0_ms + at_ms,
                    input_length=prefix_tokens + suffix_tokens,
                    output_length=output_tokens,
                    hash_ids=tuple(prefix + suffix),
                )
            )
        g += 1
    return out


# ---------------------------------------------------------------------- the real pipeline


class _Pipeline:
    """A private nats-server, one ingest per engine, an indexer and a router, as child processes."""

    def __init__(
        self, workers: int, block_size: int, log_dir: Path | None, router_args: Sequence[str] = ()
    ) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-"))
        self.log_dir = log_dir or self.tmp / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers = workers
        self.block_size = block_size
        self.router_args = list(router_args)
        self.children = ChildProcesses(self.log_dir)
        self.server: Any = None
        self.publishers: list[EventPublisher] = []

    def start(self, nats_url: str | None) -> str:
        from kvmesh.harness.server import NatsServer  # noqa: PLC0415 - only the kvmesh policy needs it

        if nats_url is None:
            self.server = NatsServer(store_dir=self.tmp / "nats").start()
            nats_url = str(self.server.url)
        for i in range(self.workers):
            pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=_REPLAY_STEPS)
            self.publishers.append(pub)
            self._spawn(
                f"ingest-{i}", "kvmesh.ingest", "--nats-url", nats_url, "--worker-id", f"sim-{i}",
                "--model", MODEL, "--zmq-endpoint", pub.endpoint, "--replay-endpoint", str(pub.replay_endpoint),
                "--block-size", str(self.block_size),
            )  # fmt: skip
        self._spawn("indexer", "kvmesh.indexer", "--nats-url", nats_url)
        self._spawn("router", "kvmesh.router", "--nats-url", nats_url, *self.router_args)
        return nats_url

    def _spawn(self, name: str, module: str, *argv: str) -> None:
        self.children.spawn(name, "-m", module, *argv)

    def check(self) -> None:
        self.children.check()

    def stop(self) -> None:
        for pub in self.publishers:
            pub.close()
        self.children.stop()
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


async def _wait_ready(pipe: _Pipeline, router: Any, timeout_s: float = 90.0) -> None:
    from kvmesh.client import RouteError  # noqa: PLC0415

    for pub in pipe.publishers:
        while pub.subscriptions < 1:
            pipe.check()
            await asyncio.sleep(0.05)
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        pipe.check()
        try:
            reply = await router.route(MODEL, [0] * pipe.block_size, explain=True)
            if reply.scores is not None and len(reply.scores) >= pipe.workers:
                return
            last = f"router knows {len(reply.scores or [])} of {pipe.workers} workers"
        except RouteError as exc:
            last = f"{exc.code}: {exc.message}"
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the pipeline did not become ready in {timeout_s:g} s ({last})")


async def run_kvmesh(
    trace: Sequence[TraceRequest], spec: FleetSpec, *, speed: float, nats_url: str | None = None,
    log_dir: Path | None = None, router_args: Sequence[str] = (), say: Callable[[str], None] = print,
    sessions: bool = False, label: str = "kvmesh",
) -> PolicyResult:  # fmt: skip
    """Serve ``trace`` routed by the real kvmesh pipeline, simulated time running ``speed`` × wall time.

    Each request is routed at the wall time of its arrival and reaches its engine at its simulated arrival
    + the measured route latency (real seconds, not multiplied by ``speed``). With ``sessions`` each route
    carries the request's `session_of` id (``session_id=``) and ``extra`` counts the replies' ``session``
    (``session_new`` / ``session_kept`` / ``session_moved``); ``label`` names the row.
    """
    from kvmesh.client import RouteError, Router  # noqa: PLC0415
    from kvmesh.runtime.nats import connect  # noqa: PLC0415

    result = PolicyResult(policy=label, per_worker=[0] * spec.workers)
    if sessions:
        result.extra.update(session_new=0, session_kept=0, session_moved=0)
    fleet = _Fleet(spec, result)
    pipe = _Pipeline(spec.workers, spec.block_size, log_dir, router_args)
    loop = asyncio.get_running_loop()
    try:
        url = pipe.start(nats_url)
        nc = await connect(url, name="kvmesh-bench")
        router = Router(nc, timeout_s=5.0)
        try:
            await _wait_ready(pipe, router)
            say(f"  pipeline ready ({spec.workers} ingests, indexer, router); replaying at speed {speed:g}×")
            t0_ms = trace[0].timestamp_ms if trace else 0
            wall0 = loop.time()
            epoch0 = time.time()  # the epoch time of wall0: a note's ``at`` is its scheduled wall time
            late: list[float] = []
            dispatch_late: list[float] = []
            """Per route: wall seconds the harness sent it after its scheduled time (0 when on time)."""
            overlap: list[int] = []
            """Per route: the router's overlap for its chosen worker minus that pool's true hit, in blocks."""
            tasks: set[asyncio.Task[Any]] = set()

            async def play(items: Sequence[_Item]) -> None:
                """Publish each batch and send each lifecycle note at the wall time of its simulated time."""
                for time_s, _serial, k, kind, payload in items:
                    delay = wall0 + time_s / speed - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    elif delay < -_LATE_S and kind == _EVENTS:
                        late.append(-delay)
                    if kind == _EVENTS:
                        pipe.publishers[k].publish(payload.events)
                    elif kind == _PREFILL_DONE:
                        _fire(tasks, router.mark_prefill_done(payload, at=epoch0 + time_s / speed))
                    else:  # the engine's count of cached prompt tokens: the route's delivered reuse
                        cached = fleet.delivered.pop(payload, None)
                        _fire(tasks, router.finish(payload, cached_tokens=cached, at=epoch0 + time_s / speed))
                await asyncio.sleep(0)

            start = time.perf_counter()
            for i, req in enumerate(trace):
                p = _prepare(req, i, t0_ms, sessions=sessions)
                await play(fleet.advance(p.arrival_s))
                delay = wall0 + p.arrival_s / speed - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:  # late: the fleet runs to now first, and the request arrives now
                    now_s = (loop.time() - wall0) * speed
                    await play(fleet.advance(now_s))
                    p = dispatched(p, now_s)
                dispatch_late.append(max(-delay, 0.0))
                result.arrivals_ms.append(t0_ms + round(p.arrival_s * 1000))
                fleet.sample()
                t_route = time.perf_counter()
                try:
                    reply = await router.route(
                        MODEL, p.tokens, request_id=p.request_id, session_id=p.session_id
                    )
                    k = int(reply.worker_id.removeprefix("sim-"))
                    _count_session(result, reply.session)
                    result.available_tokens += reply.available_tokens or 0
                    result.captured_tokens += reply.cached_tokens
                    seen = min(reply.overlap_blocks, (len(p.tokens) - 1) // spec.block_size)
                    overlap.append(seen - fleet.workers[k].pool.match_prefix(p.tokens) // spec.block_size)
                except RouteError as exc:
                    result.extra["route_errors"] = result.extra.get("route_errors", 0) + 1
                    say(
                        f"  {p.request_id}: route failed ({exc.code}: {exc.message}); sent to worker {i % spec.workers}"
                    )
                    k = i % spec.workers
                latency_s = time.perf_counter() - t_route
                result.route_latency_s.append(latency_s)
                fleet.send(p, k, latency_s)
                if (i + 1) % max(1, len(trace) // 10) == 0:
                    say(
                        f"  [{i + 1}/{len(trace)}] simulated {p.arrival_s:.1f} s, wall {loop.time() - wall0:.1f} s"
                    )
            # Let the fleet drain: deliver, publish and notify everything left at its time.
            while (nxt := fleet.next_time_s()) is not None:
                await play(fleet.advance(nxt))
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            result.wall_s = time.perf_counter() - start
            fleet.close(0.0)
            result.extra["batches_late_over_10ms"] = len(late)
            result.extra["max_late_ms"] = round(1e3 * max(late, default=0.0), 1)
            result.extra["routes_late_over_10ms"] = sum(1 for d in dispatch_late if d > _LATE_S)
            result.extra["route_late_p50_ms"] = round(1e3 * percentile(dispatch_late or [0.0], 0.5), 1)
            result.extra["route_late_p99_ms"] = round(1e3 * percentile(dispatch_late or [0.0], 0.99), 1)
            result.extra["overlap_exact"] = sum(1 for d in overlap if d == 0)
            result.extra["overlap_under"] = sum(1 for d in overlap if d < 0)
            result.extra["overlap_over"] = sum(1 for d in overlap if d > 0)
            result.extra["overlap_missed_blocks"] = -sum(d for d in overlap if d < 0)
        finally:
            await nc.close()
        return result
    finally:
        pipe.stop()


def _fire(tasks: set[asyncio.Task[Any]], note: Any) -> None:
    task = asyncio.ensure_future(note)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


# ---------------------------------------------------------------------- report


def table(results: Sequence[PolicyResult]) -> str:
    """Return the per-policy Markdown table."""
    rows = [
        "| policy | requests | hit ratio | vs oracle | TTFT p50 (s) | TTFT p99 (s) | requests/s (simulated) "
        "| routing delay p50 / p99 (ms) | busiest worker's running requests p50 / p99 "
        "| available / captured / delivered tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    oracle = next((r for r in results if r.policy == "oracle"), None)
    for r in results:
        vs = f"{r.hit_ratio / oracle.hit_ratio:.3f}" if oracle and oracle.hit_ratio else "–"
        lat = (
            f"{1e3 * percentile(r.route_latency_s, 0.5):.2f} / {1e3 * percentile(r.route_latency_s, 0.99):.2f}"
            if r.route_latency_s
            else "0 (in-process)"
        )
        busy = (
            f"{percentile(r.busiest_running, 0.5):.0f} / {percentile(r.busiest_running, 0.99):.0f}"
            if r.busiest_running
            else "–"
        )
        rows.append(
            f"| {r.policy} | {r.requests} | {100 * r.hit_ratio:.2f} % | {vs} | {percentile(r.ttft_s, 0.5):.3f} | "
            f"{percentile(r.ttft_s, 0.99):.3f} | {r.requests_per_s:.2f} | {lat} | {busy} "
            f"| {r.available_tokens:,} / {r.captured_tokens:,} / {r.cached_tokens:,} |"
        )
    return "\n".join(rows)


async def run_bench(args: argparse.Namespace, say: Callable[[str], None] = print) -> list[PolicyResult]:
    """Run every selected policy on the trace; return the results in the order of ``args.policies``."""
    if str(args.trace) == BURST_TRACE and not args.trace.exists():
        trace = burst_trace(
            args.requests if args.requests is not None else 20 * args.burst_size,
            size=args.burst_size,
            prefix_tokens=args.burst_prefix_tokens,
            window_ms=args.burst_window_ms,
            gap_s=args.burst_gap_s,
            prefixes=args.burst_prefixes,
            seed=args.seed,
        )
    else:
        trace = load_trace(args.trace, limit=args.requests)
    spec = FleetSpec(
        workers=args.workers,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        seed=args.seed,
        timing=TimingModel(
            prefill_s_per_token=args.prefill_ms_per_1k_tokens / 1e6,
            prefill_overhead_s=args.prefill_overhead_ms / 1e3,
            decode_s_per_token=args.decode_ms_per_token / 1e3,
            max_batch=args.max_batch,
        ),
    )
    span = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1e3 if trace else 0.0
    say(
        f"kvmesh bench trace: {len(trace)} requests from {args.trace} ({span:.0f} s of arrivals), {spec.workers} workers"
    )
    weights = {"overlap_weight": args.overlap_weight, "decode_weight": args.decode_weight}
    base_policy = replace(Policy(), **{k: v for k, v in weights.items() if v is not None})
    progress: bool | None = args.prefill_progress
    sessions: bool = getattr(args, "sessions", False)
    slacks: list[float | None] = list(getattr(args, "session_slack", None) or [None])
    results: list[PolicyResult] = []
    for policy in args.policies:
        kvmesh_policy = policy == "kvmesh" or policy.startswith("kvmesh-")
        # each kvmesh policy runs once per --session-slack value (None: the router's default)
        for slack in slacks if kvmesh_policy else [None]:
            route_policy = base_policy if slack is None else replace(base_policy, session_slack=slack)
            shown = route_policy.session_slack if sessions and kvmesh_policy else None
            if policy == "kvmesh":
                router_args = [
                    *(a for k, v in weights.items() if v is not None for a in (f"--{k.replace('_', '-')}", repr(v))),
                    *(() if slack is None else ("--session-slack", repr(slack))),
                    *(() if progress is None else ("--prefill-progress" if progress else "--no-prefill-progress",)),
                    *args.router_arg,
                ]  # fmt: skip
                say(f"policy {policy_label(policy, None, shown)}")
                r = await run_kvmesh(
                    trace, spec, speed=args.speed, nats_url=args.nats_url, log_dir=args.log_dir,
                    router_args=router_args, say=say, sessions=sessions, label=policy_label(policy, None, shown),
                )  # fmt: skip
                results.append(_report(r, say))
                for ref in ("kvmesh-exact", "oracle"):
                    if ref not in args.policies or sessions:
                        continue
                    o = on_arrivals(ref, trace, spec, r, route_policy=route_policy, prefill_progress=progress)
                    if o is not None:
                        say(f"policy {o.policy}")
                        results.append(_report(o, say))
                continue
            # kvmesh-lagged runs once per --predicted-ttl-s value (0: without predicted entries)
            for ttl in args.predicted_ttl_s if policy == "kvmesh-lagged" else [0.0]:
                say(f"policy {policy_label(policy, ttl or None, shown)}")
                r = simulate_policy(
                    policy, trace, spec, route_policy=route_policy, prefill_progress=progress,
                    event_lag_s=args.event_lag_s, predicted_ttl_s=ttl or None, sessions=sessions,
                )  # fmt: skip
                results.append(_report(r, say))
    return results


def on_arrivals(
    policy: str,
    trace: Sequence[TraceRequest],
    spec: FleetSpec,
    kvmesh: PolicyResult,
    *,
    route_policy: Policy | None = None,
    prefill_progress: bool | None = None,
) -> PolicyResult | None:
    """An in-process ``policy`` (``oracle``, ``kvmesh-exact``) on the arrivals the pipeline's requests actually
    had (``kvmesh.arrivals_ms``), or None when none was moved: a harness that fell behind its schedule gave
    ``kvmesh`` a slightly different workload than the in-process policies, and this row is the reference on
    that same workload (``<policy> @ kvmesh's arrivals``; its ``extra`` gives how many arrivals moved and by
    how much at most, in simulated ms)."""
    arrivals = kvmesh.arrivals_ms
    if len(arrivals) != len(trace):
        return None
    moved = [a - r.timestamp_ms for r, a in zip(trace, arrivals, strict=True)]
    if not any(moved):
        return None
    shifted = [replace(r, timestamp_ms=a) for r, a in zip(trace, arrivals, strict=True)]
    r = simulate_policy(policy, shifted, spec, route_policy=route_policy, prefill_progress=prefill_progress)
    r.policy = f"{policy} @ kvmesh's arrivals"
    r.extra.update(arrivals_moved=sum(1 for m in moved if m), max_moved_ms=max(moved))
    return r


def _report(r: PolicyResult, say: Callable[[str], None]) -> PolicyResult:
    """Print one policy's summary line; return it."""
    lat = (
        f", route p50 {1e3 * percentile(r.route_latency_s, 0.5):.2f} ms"
        f" p99 {1e3 * percentile(r.route_latency_s, 0.99):.2f} ms"
        if r.route_latency_s
        else ""
    )
    say(
        f"  hit ratio {100 * r.hit_ratio:.2f} %, TTFT p50 {percentile(r.ttft_s, 0.5):.3f} s, "
        f"p99 {percentile(r.ttft_s, 0.99):.3f} s{lat}, {r.wall_s:.1f} s wall; tokens available "
        f"{r.available_tokens:,}, captured {r.captured_tokens:,}, delivered {r.cached_tokens:,}"
    )
    return r


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``kvmesh bench trace``."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench trace", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_trace = default_trace_path()
    p.add_argument(
        "--trace",
        type=Path,
        default=default_trace,
        help="Mooncake JSONL trace, such as the full conversation_trace.jsonl of the Mooncake release "
        "(default: the packaged 1,000-request excerpt), or the word 'burst' for the generated burst workload "
        "(see --burst-size; --requests requests, default 20 bursts)",
    )
    p.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--workers", type=int, default=8, help="simulated engines (default 8)")
    p.add_argument("--num-blocks", type=int, default=16384, help="KV blocks per engine (default 16384)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument(
        "--speed", type=float, default=10.0, help="simulated seconds per wall second for kvmesh (default 10)"
    )
    p.add_argument(
        "--prefill-ms-per-1k-tokens",
        type=float,
        default=100.0,
        help="prefill cost of 1,000 uncached tokens (default 100 ms)",
    )
    p.add_argument(
        "--prefill-overhead-ms", type=float, default=5.0, help="fixed cost of a prefill (default 5 ms)"
    )
    p.add_argument(
        "--decode-ms-per-token", type=float, default=20.0, help="time per output token (default 20 ms)"
    )
    p.add_argument("--max-batch", type=int, default=32, help="running requests per engine (default 32)")
    p.add_argument("--seed", type=int, default=0, help="hash seed base and random policy seed")
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated list of "
        + ", ".join(POLICIES + EXTRA_POLICIES)
        + " (default: all but the last four). kvmesh-lagged: kvmesh's decision on a real index fed the "
        "engines' KV events --event-lag-s late (with predicted entries for each --predicted-ttl-s > 0); "
        "kvmesh-approx: no KV events, only the router's own decisions in a predicted cache bounded by "
        "--num-blocks per worker, least recently used out first (Dynamo's approximate mode)",
    )
    p.add_argument(
        "--event-lag-s",
        type=float,
        default=DEFAULT_EVENT_LAG_S,
        help="kvmesh-lagged: simulated seconds between an engine emitting a KV event batch and the router's "
        f"index applying it (default {DEFAULT_EVENT_LAG_S:g}: a real vLLM engine's publish delay measured on "
        "a loaded 2-core machine; 0: the index sees the pools as they are)",
    )
    p.add_argument(
        "--predicted-ttl-s",
        default="0",
        metavar="T[,T...]",
        help="kvmesh-lagged: the router's predicted entries (Dynamo's --router-predicted-ttl-secs): on each "
        "decision the chosen worker counts the prompt's blocks as held for T simulated seconds, each "
        "candidate's overlap the larger of the index's and the predicted one. Comma-separated: one "
        "kvmesh-lagged row per value, 0 without predicted entries (default 0)",
    )
    p.add_argument(
        "--sessions",
        action="store_true",
        help="session affinity: each request carries a session id made of its first two trace blocks (the "
        "Mooncake traces carry no session ids; a conversation's turns start with the same blocks; a prompt "
        "with fewer than 2 trace blocks gets none). kvmesh sends it to the router; the kvmesh-* policies keep "
        "each session's last worker and pass it to the decision (off by default)",
    )
    p.add_argument(
        "--session-slack",
        default=None,
        metavar="S[,S...]",
        help="Policy.session_slack of kvmesh and the kvmesh-* policies: a session keeps its worker while that "
        "costs at most the lowest cost + S x the prompt's blocks (default: the router's default, "
        f"{Policy().session_slack:g}). Comma-separated: one row per value for each kvmesh policy",
    )
    p.add_argument(
        "--burst-size",
        type=int,
        default=32,
        help="--trace burst: requests per burst, each taking one of the burst's new prefixes (no other burst "
        "has them) plus its own 256-token suffix, 64 output tokens (default 32)",
    )
    p.add_argument(
        "--burst-prefix-tokens",
        type=int,
        default=4096,
        help="--trace burst: tokens of each burst's shared prefix, a multiple of 512 (default 4096)",
    )
    p.add_argument(
        "--burst-prefixes",
        type=int,
        default=1,
        help="--trace burst: new prefixes per burst, each request taking one drawn at random (default 1)",
    )
    p.add_argument(
        "--burst-window-ms",
        type=int,
        default=100,
        help="--trace burst: a burst's requests arrive at seeded uniform times within this window (default 100)",
    )
    p.add_argument(
        "--burst-gap-s",
        type=float,
        default=5.0,
        help="--trace burst: seconds between burst starts (default 5)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-trace"),
        help="write <out>.md and <out>.png (default bench-trace)",
    )
    p.add_argument(
        "--overlap-weight",
        type=float,
        default=None,
        help="the router's overlap_weight (kvmesh and the kvmesh-* policies; default: the router's default)",
    )
    p.add_argument(
        "--decode-weight",
        type=float,
        default=None,
        help="the router's decode_weight (kvmesh and the kvmesh-* policies; default: the router's default)",
    )
    p.add_argument(
        "--prefill-progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the load ledger's prefill progress estimate (kvmesh and the kvmesh-* policies; default: the "
        "router's default)",
    )
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to the kvmesh router (repeat for several: --router-arg=--index --router-arg=local)",
    )
    p.add_argument("--nats-url", default=None, help="use this NATS server instead of a private one")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the child processes' logs here")
    return p


def command(argv: Sequence[str] | None = None) -> int:
    """Run ``kvmesh bench trace``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in args.policies if p not in POLICIES + EXTRA_POLICIES]
    if unknown or args.workers < 1 or args.speed <= 0:
        parser.error(f"unknown policies {unknown}" if unknown else "--workers must be >= 1 and --speed > 0")
    try:
        args.predicted_ttl_s = [float(t) for t in args.predicted_ttl_s.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--predicted-ttl-s: not a list of numbers: {args.predicted_ttl_s!r}")
    if not args.predicted_ttl_s or any(not (0 <= t < math.inf) for t in args.predicted_ttl_s):
        parser.error("--predicted-ttl-s: one or more finite seconds >= 0 (0: without predicted entries)")
    if not args.event_lag_s >= 0:
        parser.error("--event-lag-s must be >= 0")
    if args.session_slack is not None:
        try:
            args.session_slack = [float(s) for s in args.session_slack.split(",") if s.strip()]
        except ValueError:
            parser.error(f"--session-slack: not a list of numbers: {args.session_slack!r}")
        if not args.session_slack or any(not (0 <= s < math.inf) for s in args.session_slack):
            parser.error("--session-slack: one or more finite fractions >= 0")
        if not args.sessions:
            parser.error("--session-slack needs --sessions")
    if (
        min(args.burst_size, args.burst_prefixes) < 1
        or args.burst_prefix_tokens % 512
        or args.burst_prefix_tokens < 512
    ):
        parser.error(
            "--burst-size and --burst-prefixes must be >= 1, --burst-prefix-tokens a positive multiple of 512"
        )
    if args.burst_window_ms < 0 or not args.burst_gap_s >= 0:
        parser.error("--burst-window-ms and --burst-gap-s must be >= 0")
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    results = asyncio.run(run_bench(args))
    text = table(results)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    md = args.out.with_suffix(".md")
    png = args.out.with_suffix(".png")
    md.write_text(text + "\n")
    backend = write_bar_charts(
        png,
        f"Mooncake trace, {args.workers} simulated workers, {len(results[0].ttft_s) if results else 0} requests",
        [r.policy for r in results],
        [
            ("prefix-cache hit ratio (%)", [100 * r.hit_ratio for r in results]),
            ("TTFT p50 (s)", [percentile(r.ttft_s, 0.5) for r in results]),
            ("TTFT p99 (s)", [percentile(r.ttft_s, 0.99) for r in results]),
        ],
    )
    print(f"\nwrote {md} and {png} ({backend})")
    for r in results:
        if r.extra:
            print(f"{r.policy}: {r.extra}")
    return 0
