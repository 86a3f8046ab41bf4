"""A timing model for simulated engines: queueing, prefill and decode in virtual time (pure).

`TimedWorker` drives one `kvmesh.sim.blockpool.BlockPool` like a vLLM engine's scheduler would, on a clock it
is handed (seconds of *simulated* time; it never reads a real clock):

* **batch limit**: at most ``max_batch`` requests run at once; others wait in FIFO order. A request whose
  prompt does not fit in the pool (every free block is held) waits until a running request finishes; one
  that does not fit even in an idle pool is rejected (`RequestTiming.rejected`).
* **admission** happens when a slot is free: the prefix-cache hit is taken *then* (as vLLM's
  ``get_computed_blocks`` at schedule time), the ``BlockRemoved``/``BlockStored`` events of the prompt are
  emitted as one step.
* **prefill** runs one request at a time per worker (compute-bound), taking ``prefill_overhead_s +
  uncached_tokens × prefill_s_per_token``; the first token is out when it ends, so
  ``ttft = routing delay + queueing + prefill wait + prefill`` (the routing delay is ``received_s −
  arrival_s`` of `TimedWorker.submit`).
* **decode** produces one token per ``decode_s_per_token`` for each running request, concurrently (a decode
  step's cost does not grow with the batch in this model). A decode block's ``BlockStored`` is emitted at the
  step that fills it; the request finishes (blocks freed, no event) at its last token.

Events are produced with exactly the `BlockPool` rules (one BlockStored per step for the newly full blocks
with the parent chain, lazy single-hash BlockRemoved); appending a decode block's tokens in one call instead
of one per step emits the same events, since only the step that fills a block emits anything.

Deterministic: equal inputs give equal outputs (ties in time are broken by submission order).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from kvmesh.core.wire import KVEvent
from kvmesh.sim.blockpool import BlockPool, PoolExhaustedError

__all__ = ["RequestTiming", "StepBatch", "TimedWorker", "TimingModel"]

_DECODE: Final[int] = 0
_FINISH: Final[int] = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class TimingModel:
    """Costs of one simulated engine, in seconds of simulated time.

    The defaults are a mid-size model on one modern GPU: 10,000 prefill tokens/s, 50 decode tokens/s per
    request, 32 requests in a batch.
    """

    prefill_s_per_token: float = 1e-4
    """Prefill time per prompt token not served from the prefix cache."""
    prefill_overhead_s: float = 0.005
    """Fixed cost of every prefill (scheduling, the last token's logits)."""
    decode_s_per_token: float = 0.02
    """Time between two output tokens of a running request."""
    max_batch: int = 32
    """Requests running at once (vLLM's ``max_num_seqs``); more wait in a FIFO queue."""

    def __post_init__(self) -> None:
        """Reject negative costs and a batch limit below 1."""
        if min(self.prefill_s_per_token, self.prefill_overhead_s, self.decode_s_per_token) < 0:
            raise ValueError("timing costs must be >= 0")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")

    def prefill_s(self, uncached_tokens: int) -> float:
        """Return the prefill time of a prompt with ``uncached_tokens`` tokens to compute."""
        return self.prefill_overhead_s + uncached_tokens * self.prefill_s_per_token


@dataclass(slots=True, kw_only=True)
class RequestTiming:
    """One request's life in simulated time (seconds); fields fill in as it progresses."""

    request_id: str
    arrival_s: float
    """When the client sent it: TTFT counts from here."""
    prompt_tokens: int
    output_tokens: int
    received_s: float | None = None
    """When it reached the engine (``arrival_s`` + the routing delay); None means at ``arrival_s``."""
    admitted_s: float | None = None
    """When it got a batch slot and blocks (the prefix hit is taken then)."""
    first_token_s: float | None = None
    """End of its prefill."""
    finished_s: float | None = None
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at admission."""
    rejected: bool = False
    """True when the prompt does not fit even in an idle pool (never served)."""

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: routing delay + queueing + waiting for the prefill unit + prefill."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The events of one engine step, at the simulated time they were emitted."""

    time_s: float
    events: list[KVEvent]


@dataclass(slots=True)
class _Running:
    timing: RequestTiming
    outputs: list[int]
    """Output tokens whose KV gets computed (all but the last sampled one)."""
    finish_s: float = 0.0
    """When its last token is out."""
    fed: int = 0
    """How many of ``outputs`` were appended so far."""


@dataclass(slots=True)
class _Waiting:
    timing: RequestTiming
    token_ids: list[int]
    outputs: list[int]
    lora_name: str | None
    cache_salt: str | None


@dataclass(slots=True)
class _Heap:
    items: list[tuple[float, int, int, str]] = field(default_factory=list)
    serial: int = 0

    def push(self, time_s: float, kind: int, request_id: str) -> None:
        heapq.heappush(self.items, (time_s, self.serial, kind, request_id))
        self.serial += 1


class TimedWorker:
    """One simulated engine's scheduler in virtual time, around a `BlockPool`.

    Owns the waiting queue, the running set, the prefill unit and a timeline of future decode and finish
    steps. Does not own a clock or transport: the caller `submit`s requests at their arrival time,
    `advance`s the worker to a time and publishes the returned `StepBatch` list in order.

    Args:
        pool: the worker's block pool (owned from now on: drive it only through this object).
        timing: the cost model.
    """

    def __init__(self, pool: BlockPool, timing: TimingModel | None = None) -> None:
        self.pool = pool
        """The worker's block pool (read it for ground truth)."""
        self.timing = timing if timing is not None else TimingModel()
        """The cost model."""
        self._waiting: deque[_Waiting] = deque()
        self._running: dict[str, _Running] = {}
        self._heap = _Heap()
        self._prefill_free_s = 0.0
        self._now_s = 0.0
        self._batches: list[StepBatch] = []
        self._done: list[RequestTiming] = []
        self._first_tokens: list[RequestTiming] = []
        self.decode_overflows = 0
        """Requests whose decode tail found no free block and was not cached (vLLM would preempt)."""

    # ------------------------------------------------------------------ queries

    @property
    def now_s(self) -> float:
        """The simulated time the worker was last advanced to."""
        return self._now_s

    @property
    def active(self) -> int:
        """Requests waiting or running (the load a least-loaded router sees)."""
        return len(self._waiting) + len(self._running)

    @property
    def running(self) -> int:
        """Requests holding a batch slot."""
        return len(self._running)

    def next_time_s(self) -> float | None:
        """Return the simulated time of the next scheduled step, or None when idle."""
        return self._heap.items[0][0] if self._heap.items else None

    def estimate_ttft_s(self, uncached_tokens: int, now_s: float) -> float:
        """Estimate the TTFT of a request submitted now with ``uncached_tokens`` to prefill (an oracle's view).

        Waiting requests are assumed to hit nothing; a full batch adds the wait for the running request
        that frees the needed slot. Pool exhaustion is ignored.
        """
        t = self.timing
        wait = max(0.0, self._prefill_free_s - now_s)
        wait += sum(t.prefill_s(len(w.token_ids)) for w in self._waiting)
        ahead = len(self._waiting) - (t.max_batch - len(self._running))
        if ahead >= 0:
            finishes = sorted(r.finish_s for r in self._running.values())
            slot_s = finishes[min(ahead, len(finishes) - 1)] - now_s if finishes else 0.0
            wait = max(wait, slot_s)
        return wait + t.prefill_s(uncached_tokens)

    # ------------------------------------------------------------------ driving

    def submit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        *,
        arrival_s: float,
        received_s: float | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestTiming:
        """Queue a request reaching the engine at ``received_s`` (advance to that time first); admit what fits.

        Args:
            request_id: unique among running requests.
            token_ids: the prompt (non-empty).
            output_token_ids: the tokens it will generate (``len`` = output length).
            arrival_s: when the client sent it (its TTFT counts from here).
            received_s: when it reaches this engine, ≥ ``arrival_s`` (the difference is the routing
                delay); must not be before the worker's current time. None: at ``arrival_s``.
            lora_name: LoRA adapter name.
            cache_salt: cache salt.

        Returns:
            The request's timing record, filled in as the worker advances.

        Raises:
            ValueError: an empty prompt, a receipt in the worker's past or before the arrival.
        """
        if not token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        at_s = arrival_s if received_s is None else received_s
        if at_s < arrival_s:
            raise ValueError(f"request {request_id!r} received at {at_s}, before its arrival {arrival_s}")
        if at_s < self._now_s:
            raise ValueError(f"arrival {at_s} is before the worker's time {self._now_s}")
        self._now_s = at_s
        timing = RequestTiming(
            request_id=request_id,
            arrival_s=arrival_s,
            prompt_tokens=len(token_ids),
            output_tokens=len(output_token_ids),
            received_s=at_s,
        )
        self._waiting.append(
            _Waiting(timing, list(token_ids), list(output_token_ids[:-1]), lora_name, cache_salt)
        )
        self._admit(at_s)
        return timing

    def advance(self, until_s: float) -> list[StepBatch]:
        """Run every step scheduled at or before ``until_s``; return the event batches they emitted.

        Returns:
            Non-empty batches in simulated-time order (including those of `submit` calls since the last
            `advance`).
        """
        heap = self._heap.items
        while heap and heap[0][0] <= until_s:
            time_s, _serial, kind, request_id = heapq.heappop(heap)
            self._now_s = max(self._now_s, time_s)
            run = self._running[request_id]
            if kind == _DECODE:
                self._feed_block(run)
                self._flush(time_s)
            else:
                self._feed(run, len(run.outputs))
                self._flush(time_s)
                self.pool.finish(request_id)
                del self._running[request_id]
                run.timing.finished_s = time_s
                self._done.append(run.timing)
                self._admit(time_s)
        self._now_s = max(self._now_s, until_s)
        batches, self._batches = self._batches, []
        return batches

    def take_finished(self) -> list[RequestTiming]:
        """Return the requests finished (or rejected) since the last call."""
        done, self._done = self._done, []
        return done

    def take_first_tokens(self) -> list[RequestTiming]:
        """Return the requests admitted since the last call (their ``first_token_s`` is now known)."""
        out, self._first_tokens = self._first_tokens, []
        return out

    # ------------------------------------------------------------------ internals

    def _admit(self, now_s: float) -> None:
        t = self.timing
        while self._waiting and len(self._running) < t.max_batch:
            w = self._waiting[0]
            rid = w.timing.request_id
            try:
                adm = self.pool.start(rid, w.token_ids, lora_name=w.lora_name, cache_salt=w.cache_salt)
            except PoolExhaustedError:
                if self._running:
                    return  # wait for a running request to free blocks
                self._waiting.popleft()
                w.timing.rejected = True
                self._done.append(w.timing)
                continue
            self._waiting.popleft()
            self._flush(now_s)
            timing = w.timing
            timing.admitted_s = now_s
            timing.cached_tokens = adm.cached_tokens
            start_s = max(now_s, self._prefill_free_s)
            first_s = start_s + t.prefill_s(adm.prompt_tokens - adm.cached_tokens)
            self._prefill_free_s = first_s
            timing.first_token_s = first_s
            self._first_tokens.append(timing)
            run = _Running(timing, w.outputs, first_s + len(w.outputs) * t.decode_s_per_token)
            self._running[rid] = run
            # Output token j (of those fed back) has its KV computed at first_s + (j + 1) × decode.
            bs = self.pool.block_size
            dec = t.decode_s_per_token
            done_tokens = len(w.token_ids)
            for j in range(len(w.outputs)):
                if (done_tokens + j + 1) % bs == 0:
                    self._heap.push(first_s + (j + 1) * dec, _DECODE, rid)
            self._heap.push(first_s + len(w.outputs) * dec, _FINISH, rid)

    def _feed_block(self, run: _Running) -> None:
        """Append this request's tokens up to and including the one that fills its next block."""
        bs = self.pool.block_size
        total = run.timing.prompt_tokens + run.fed
        self._feed(run, run.fed + (bs - total % bs))

    def _feed(self, run: _Running, upto: int) -> None:
        upto = min(upto, len(run.outputs))
        if upto > run.fed:
            try:
                self.pool.append(run.timing.request_id, run.outputs[run.fed : upto])
            except PoolExhaustedError:
                # No free block for the decode tail (vLLM would preempt): keep decoding, cache no more.
                self.decode_overflows += 1
                upto = len(run.outputs)
            run.fed = upto

    def _flush(self, time_s: float) -> None:
        events = self.pool.take_events()
        if events:
            self._batches.append(StepBatch(time_s, events))
