"""A simulated vLLM worker (one DP rank): a `BlockPool` that publishes its KV events through ZMQ.

`SimWorker` serves requests one at a time: admit the prompt (prefix hit, allocation, ``BlockStored`` for
the new full prompt blocks) and publish that step's batch, then run the decode steps one token at a time,
publishing a batch for each step that emitted events (a block became full or a cached block was evicted),
then free the request. It has no timing model (no prefill/decode latency, no concurrency inside a worker)
and no scheduler: every step is executed as soon as the previous one is published.

With a `kvmesh.sim.timing.TimingModel` (``timing=``) it serves requests concurrently in scaled real time
instead: up to ``max_batch`` at once (others queue; a prompt that needs blocks held by running requests waits
for one to finish), prefills one at a time taking ``prefill_s(uncached tokens) / speed`` seconds, then
decodes, publishing each decode block's ``BlockStored`` at the step that fills it (``decode_s_per_token /
speed`` per token); `ServeResult` then carries the simulated ``queue_s`` and ``ttft_s``.
"""

from __future__ import annotations

import asyncio
import os
import struct
import time
from collections.abc import Callable, Sequence
from typing import Final, NotRequired, TypedDict

import xxhash

from kvmesh.core.endpoints import offset_endpoint
from kvmesh.sim.blockpool import BlockPool, HashForm, PoolExhaustedError
from kvmesh.sim.publisher import DEFAULT_BUFFER_STEPS, EventPublisher
from kvmesh.sim.timing import TimingModel

__all__ = ["ServeResult", "SimWorker", "output_tokens"]

VOCAB_SIZE: Final[int] = 32000
"""Generated token ids lie in ``[0, VOCAB_SIZE)``."""

_PACK_INDEX: Final = struct.Struct("<Q").pack


class ServeResult(TypedDict):
    """What `SimWorker.serve_request` reports for one request."""

    cached_tokens: int
    """Prompt tokens served from the worker's prefix cache (a multiple of the block size)."""
    prompt_tokens: int
    """Prompt length in tokens."""
    worker_id: str
    """The worker that served the request."""
    dp_rank: int
    """The worker's data-parallel rank."""
    queue_s: NotRequired[float]
    """With a timing model: simulated seconds waiting for a batch slot and free blocks."""
    ttft_s: NotRequired[float]
    """With a timing model: simulated time to first token (queueing + waiting to prefill + prefill)."""


def output_tokens(prompt: Sequence[int], n: int, *, seed: int = 0) -> list[int]:
    """Return ``n`` deterministic "generated" token ids for a prompt (a stand-in for greedy decoding).

    Equal prompts (and seeds) give equal outputs, so a repeated request also repeats its decode blocks.

    Args:
        prompt: the prompt's token ids.
        n: tokens to generate (>= 0).
        seed: seed in [0, 2**64).

    Returns:
        ``n`` token ids in ``[0, 32000)``.
    """
    base = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(prompt)}q", *prompt), seed=seed)
    return [xxhash.xxh3_64_intdigest(_PACK_INDEX(i), seed=base) % VOCAB_SIZE for i in range(n)]


class SimWorker:
    """One simulated engine (one DP rank): owns a `BlockPool` and an `EventPublisher`.

    The publisher binds ``offset_endpoint(endpoint, dp_rank)`` and, when given,
    ``offset_endpoint(replay_endpoint, dp_rank)``, as vLLM derives a DP rank's endpoints from its
    ``--kv-events-config``. Requests are served strictly one at a time (an `asyncio.Lock`), so each
    worker's batches are published in step order.

    Args:
        worker_id: the worker's name, reported back in `ServeResult`.
        num_blocks: KV blocks in the pool.
        block_size: tokens per block.
        endpoint: base live endpoint (before the DP-rank offset).
        replay_endpoint: base replay endpoint, or None for no replay socket.
        dp_rank: data-parallel rank.
        topic: topic frame of every message.
        producer: ``"vllm"`` or ``"sglang"`` (wire layout).
        version: engine release to imitate on the wire, e.g. ``"0.33.0"``.
        hash_form: how block hashes appear (``"int"``, ``"bytes"``, ``"signed"``); imitate vLLM < 0.10.2
            (builtin ``hash()``) with ``"signed"``, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` with
            ``"bytes"``.
        seed: the pool's hash seed (equal seeds give equal hashes for equal tokens, as vLLM >= 0.29 with
            sha256 does across processes).
        buffer_steps: batches kept for replay.
        clock: batch timestamp source in seconds since the epoch.
        timing: serve concurrently with this cost model (None: one request at a time, no delays).
        speed: simulated seconds per real second when ``timing`` is set (> 0).
        record_path: append every published batch to this file (`kvmesh.sim.publisher.read_record`).

    Raises:
        ValueError: invalid pool parameters or an endpoint without a rule for ``dp_rank`` > 0.
        zmq.ZMQError: an endpoint cannot be bound.
        OSError: ``record_path`` cannot be opened.
    """

    def __init__(
        self,
        worker_id: str,
        *,
        num_blocks: int,
        block_size: int,
        endpoint: str,
        replay_endpoint: str | None = None,
        dp_rank: int = 0,
        topic: str = "",
        producer: str = "vllm",
        version: str = "0.33.0",
        hash_form: HashForm = "int",
        seed: int = 0,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        clock: Callable[[], float] = time.time,
        timing: TimingModel | None = None,
        speed: float = 1.0,
        record_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self._worker_id = worker_id
        self._dp_rank = dp_rank
        self._seed = seed
        self.pool = BlockPool(num_blocks=num_blocks, block_size=block_size, seed=seed, hash_form=hash_form)
        """The worker's block pool (read it for ground truth; mutate only through the worker)."""
        self.publisher = EventPublisher(
            offset_endpoint(endpoint, dp_rank),
            None if replay_endpoint is None else offset_endpoint(replay_endpoint, dp_rank),
            topic=topic,
            dp_rank=dp_rank,
            producer=producer,
            version=version,
            hash_form=hash_form,
            buffer_steps=buffer_steps,
            clock=clock,
            record_path=record_path,
        )
        """The worker's publisher (its fault-injection hooks are fair game in tests)."""
        self._lock = asyncio.Lock()
        self._next_request = 0
        self.timing = timing
        """The cost model, or None for the untimed one-at-a-time mode."""
        self._speed = speed
        self._slots = asyncio.Semaphore(timing.max_batch if timing is not None else 1)
        self._prefill = asyncio.Lock()
        self._freed = asyncio.Condition()

    @property
    def worker_id(self) -> str:
        """The worker's name."""
        return self._worker_id

    @property
    def dp_rank(self) -> int:
        """The worker's data-parallel rank."""
        return self._dp_rank

    async def serve_request(
        self,
        token_ids: Sequence[int],
        output_length: int,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        *,
        output_token_ids: Sequence[int] | None = None,
    ) -> ServeResult:
        """Serve one request to completion, publishing one batch per engine step that emitted events.

        Steps: prefill (``BlockRemoved`` for evicted blocks, ``BlockStored`` for the new full prompt
        blocks) → decode, one token per step, feeding output tokens ``0 … output_length - 2`` (the last
        sampled token is never fed back, as in vLLM, so its KV is never cached) → free (no event).

        Args:
            token_ids: the prompt, at least one token.
            output_length: tokens to generate (>= 0).
            lora_name: LoRA adapter name (changes hashes, carried in BlockStored).
            cache_salt: cache salt (changes hashes from block 0 on).
            output_token_ids: the generated tokens to use instead of `output_tokens`; at least
                ``output_length`` of them.

        Returns:
            Cached and prompt token counts, worker id and DP rank.

        Raises:
            ValueError: an empty prompt, negative ``output_length`` or too few ``output_token_ids``.
            kvmesh.sim.blockpool.PoolExhaustedError: the prompt (or its decode) does not fit in the pool;
                the request is freed and the events of completed steps are published.
        """
        if output_length < 0:
            raise ValueError(f"output_length must be >= 0, got {output_length}")
        if output_token_ids is None:
            outputs = output_tokens(token_ids, output_length, seed=self._seed)
        else:
            outputs = list(output_token_ids[:output_length])
            if len(outputs) < output_length:
                raise ValueError(f"{len(outputs)} output_token_ids for output_length {output_length}")
        if self.timing is not None:
            return await self._serve_timed(list(token_ids), outputs, lora_name, cache_salt)
        async with self._lock:
            request_id = f"{self._worker_id}-{self._next_request}"
            self._next_request += 1
            admission = self.pool.start(request_id, token_ids, lora_name=lora_name, cache_salt=cache_salt)
            try:
                await self._publish_step()
                for token in outputs[:-1]:
                    self.pool.append(request_id, (token,))
                    await self._publish_step()
            finally:
                self.pool.finish(request_id)
                await self._publish_step()
        return ServeResult(
            cached_tokens=admission.cached_tokens,
            prompt_tokens=admission.prompt_tokens,
            worker_id=self._worker_id,
            dp_rank=self._dp_rank,
        )

    async def _serve_timed(
        self, tokens: list[int], outputs: list[int], lora_name: str | None, cache_salt: str | None
    ) -> ServeResult:
        """Serve one request under the timing model (see the module docstring)."""
        timing = self.timing
        assert timing is not None
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        request_id = f"{self._worker_id}-{self._next_request}"
        self._next_request += 1
        async with self._slots:
            async with self._freed:
                while True:
                    try:
                        admission = self.pool.start(
                            request_id, tokens, lora_name=lora_name, cache_salt=cache_salt
                        )
                        break
                    except PoolExhaustedError:
                        if not self.pool.running:
                            raise
                        await self._freed.wait()
            queue_s = (loop.time() - arrival) * self._speed
            try:
                await self._publish_step()
                async with self._prefill:
                    prefill = timing.prefill_s(admission.prompt_tokens - admission.cached_tokens)
                    await asyncio.sleep(prefill / self._speed)
                ttft_s = (loop.time() - arrival) * self._speed
                bs = self.pool.block_size
                fed = 0
                fed_target = len(outputs) - 1  # the last sampled token is never fed back
                while fed < fed_target:
                    total = len(tokens) + fed
                    chunk = min(fed_target - fed, bs - total % bs)
                    await asyncio.sleep(chunk * timing.decode_s_per_token / self._speed)
                    try:
                        self.pool.append(request_id, outputs[fed : fed + chunk])
                    except PoolExhaustedError:
                        # No free block for the decode tail (vLLM would preempt): decode on, cache no more.
                        rest = fed_target - fed - chunk
                        await asyncio.sleep(rest * timing.decode_s_per_token / self._speed)
                        break
                    fed += chunk
                    await self._publish_step()
            finally:
                self.pool.finish(request_id)
                await self._publish_step()
                async with self._freed:
                    self._freed.notify_all()
        return ServeResult(
            cached_tokens=admission.cached_tokens,
            prompt_tokens=admission.prompt_tokens,
            worker_id=self._worker_id,
            dp_rank=self._dp_rank,
            queue_s=queue_s,
            ttft_s=ttft_s,
        )

    async def reset_prefix_cache(self) -> bool:
        """Reset the prefix cache (``POST /reset_prefix_cache``) and publish ``AllBlocksCleared``.

        Returns:
            True when reset (no request was running), else False and nothing is published.
        """
        async with self._lock:
            ok = self.pool.reset()
            await self._publish_step()
            return ok

    async def _publish_step(self) -> None:
        """Publish the pool's pending events as one batch (if any) and let other tasks run."""
        events = self.pool.take_events()
        if events:
            self.publisher.publish(events)
        await asyncio.sleep(0)

    def close(self) -> None:
        """Close the publisher's sockets; idempotent."""
        self.publisher.close()

    async def __aenter__(self) -> SimWorker:
        """Return the worker (its sockets are already bound)."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Close the worker's publisher."""
        self.close()
