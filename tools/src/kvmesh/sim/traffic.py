"""Requests a simulated engine makes up for itself (``kvmesh sim --traffic-rps``), and its end-of-run report.

Traffic that does not come over NATS keeps the engines publishing KV events while NATS nodes, ingests,
indexers and routers are killed around them: the fault tests drive their fleet this way. Prompts are drawn
from a seeded mix that makes both prefix hits and evictions common: one of `SHARED_PREFIXES` system prompts
(3 blocks), one of `DOCUMENTS` documents (2–6 blocks) and a unique tail (1–20 tokens), with 0–24 output tokens.

At the end of its traffic a worker writes a report next to its record file (``<record>.done``, JSON): the
engine keys (`kvmesh.core.wire.engine_key`) of every block its pool caches then (``cached``, sorted ints), requests served and refused, and the seq its
next batch would get. Written to a temporary name and renamed, so a reader sees it whole or not at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from pathlib import Path
from typing import Final

from kvmesh.core.wire import engine_key
from kvmesh.sim.blockpool import PoolExhaustedError
from kvmesh.sim.engine import SimWorker

__all__ = ["DOCUMENTS", "SHARED_PREFIXES", "drive", "prompt"]

log = logging.getLogger("kvmesh.sim")

SHARED_PREFIXES: Final[int] = 6
"""System prompts shared by all requests of a worker."""
DOCUMENTS: Final[int] = 30
"""Documents a request quotes after its system prompt."""
_VOCAB: Final[int] = 32000
_SUBSCRIBER_WAIT_S: Final[float] = 30.0


def prompt(rng: random.Random, block_size: int, *, seed: int = 0) -> list[int]:
    """Return one prompt of the traffic mix (see the module docstring).

    Args:
        rng: draws which system prompt, document and tail.
        block_size: tokens per block (sizes the parts).
        seed: seeds the fixed system prompts and documents (equal seeds give equal parts).

    Returns:
        The token ids, ``5 × block_size + 1`` to ``9 × block_size + 20`` of them.
    """
    p = rng.randrange(SHARED_PREFIXES)
    d = rng.randrange(DOCUMENTS)
    system = random.Random(f"{seed}:system:{p}")
    doc = random.Random(f"{seed}:doc:{d}")
    tokens = [system.randrange(_VOCAB) for _ in range(3 * block_size)]
    tokens += [doc.randrange(_VOCAB) for _ in range((2 + d % 5) * block_size)]
    tokens += [rng.randrange(_VOCAB) for _ in range(rng.randint(1, 20))]
    return tokens


async def drive(
    worker: SimWorker,
    *,
    rps: float,
    duration_s: float,
    seed: int,
    report_path: Path | None,
    subscriber_wait_s: float = _SUBSCRIBER_WAIT_S,
) -> None:
    """Serve made-up requests on ``worker`` at about ``rps`` per second for ``duration_s`` seconds.

    Waits (up to ``subscriber_wait_s``) for a subscriber on the worker's live socket first, so an ingest that is starting
    sees the first batch live. Then writes the report (module docstring) to ``report_path`` when given.

    Args:
        worker: the engine rank to load.
        rps: requests per second (> 0).
        duration_s: seconds of traffic (0: none, only the report).
        seed: seeds the prompt mix and the request sequence.
        report_path: where to write the end-of-run report, or None.
        subscriber_wait_s: seconds to wait for a subscriber before the traffic starts anyway.
    """
    loop = asyncio.get_running_loop()
    try:
        await worker.publisher.wait_for_subscribers(1, timeout_s=subscriber_wait_s)
    except TimeoutError:
        log.warning(
            "sim worker %s/%d: no subscriber; traffic starts anyway", worker.worker_id, worker.dp_rank
        )
    rng = random.Random(f"{seed}:{worker.worker_id}:{worker.dp_rank}")
    served = refused = 0
    end = loop.time() + duration_s
    next_at = loop.time()
    while loop.time() < end:
        tokens = prompt(rng, worker.pool.block_size, seed=seed)
        try:
            await worker.serve_request(tokens, rng.randint(0, 24))
            served += 1
        except PoolExhaustedError:
            refused += 1
        next_at += rng.expovariate(rps)
        await asyncio.sleep(max(0.0, next_at - loop.time()))
    log.info(
        "sim worker %s/%d: traffic done, %d requests served, %d refused, next seq %d",
        worker.worker_id,
        worker.dp_rank,
        served,
        refused,
        worker.publisher.next_seq,
    )
    if report_path is not None:
        report = {
            "worker_id": worker.worker_id,
            "dp_rank": worker.dp_rank,
            "cached": sorted(engine_key(h) for h in worker.pool.cached_block_hashes()),
            "served": served,
            "refused": refused,
            "next_seq": worker.publisher.next_seq,
        }
        tmp = report_path.with_name(report_path.name + ".tmp")
        tmp.write_text(json.dumps(report))
        os.replace(tmp, report_path)
