"""``kvmesh sim``: simulated vLLM workers that speak the real KV-event wire protocol.

Each worker is a `SimWorker` (block pool with prefix caching + ZMQ PUB and replay ROUTER). Requests reach
them over NATS request-reply, standing in for the engine's HTTP API: subject ``kvmesh.sim.<worker>.generate``
with a msgpack body ``{"token_ids": [...], "output_length": n, "lora_name": ..., "cache_salt": ...}``, reply
``{"cached_tokens", "prompt_tokens", "worker_id", "dp_rank"}`` (plus the simulated ``queue_s`` and ``ttft_s``
with ``--speed`` > 0, which turns on the `kvmesh.sim.timing.TimingModel`: concurrent requests up to
``--max-batch``, prefill and decode delays scaled by ``--speed``) or ``{"error": "..."}``; and
``kvmesh.sim.<worker>.reset`` (reset the prefix cache: AllBlocksCleared).

Ports: worker *i* publishes on ``--base-port + 20·i`` and replays on ``--base-port + 20·i + 10``; its
data-parallel rank *r* adds *r* to both (vLLM's rule), so up to 10 ranks per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvmesh.runtime import subjects
from kvmesh.runtime.cli import run_async, setup_logging
from kvmesh.runtime.config import add_arguments, load, setting
from kvmesh.runtime.nats import DEFAULT_NATS_URL, close_quietly, connect
from kvmesh.sim.engine import SimWorker
from kvmesh.sim.timing import TimingModel

log = logging.getLogger("kvmesh.sim")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimSettings:
    """A simulated fleet."""

    workers: int = setting(2, "simulated workers")
    worker_prefix: str = setting("sim-", "worker ids are <prefix><i>")
    host: str = setting("127.0.0.1", "address to bind the ZMQ sockets on")
    base_port: int = setting(5557, "worker i publishes on base+20i, replays on base+20i+10")
    data_parallel_size: int = setting(1, "data-parallel ranks per worker (ports + rank)")
    num_blocks: int = setting(16384, "KV blocks per worker (per rank)")
    block_size: int = setting(16, "tokens per block")
    version: str = setting("0.33.0", "vLLM release whose wire format to speak (0.9.0 … 0.33.0)")
    hash_form: str = setting("int", "block hashes as int (uint64), signed (int64) or bytes")
    topic: str = setting("", "ZMQ topic of every message")
    seed: int = setting(0, "hash seed base; worker i uses seed + i (engines' hashes differ per process)")
    speed: float = setting(
        0.0, "timing model: simulated seconds per real second (0: no timing, one request at a time)"
    )
    prefill_ms_per_1k_tokens: float = setting(
        100.0, "timing model: prefill time per 1,000 uncached prompt tokens"
    )
    decode_ms_per_token: float = setting(20.0, "timing model: time per output token")
    max_batch: int = setting(32, "timing model: requests running at once per worker (rank)")
    nats_url: str = setting(DEFAULT_NATS_URL, "NATS server for the generate endpoints")
    log_level: str = setting("INFO", "log level")

    def endpoints(self, i: int) -> tuple[str, str]:
        """Return worker ``i``'s base PUB and replay endpoints."""
        port = self.base_port + 20 * i
        return f"tcp://{self.host}:{port}", f"tcp://{self.host}:{port + 10}"

    def timing(self) -> TimingModel | None:
        """Return the timing model, or None when ``speed`` is 0."""
        if not self.speed:
            return None
        return TimingModel(
            prefill_s_per_token=self.prefill_ms_per_1k_tokens / 1e6,
            decode_s_per_token=self.decode_ms_per_token / 1e3,
            max_batch=self.max_batch,
        )

    def validate(self) -> list[str]:
        """Return every problem with these settings."""
        problems = []
        if self.workers < 1:
            problems.append("--workers must be ≥ 1")
        if not 1 <= self.data_parallel_size <= 10:
            problems.append("--data-parallel-size must be between 1 and 10")
        if self.hash_form not in ("int", "signed", "bytes"):
            problems.append("--hash-form must be int, signed or bytes")
        if self.speed < 0 or self.max_batch < 1:
            problems.append("--speed must be >= 0 and --max-batch >= 1")
        return problems


class _Request(msgspec.Struct):
    token_ids: list[int]
    output_length: int = 0
    lora_name: str | None = None
    cache_salt: str | None = None
    dp_rank: int = 0


class SimFleet:
    """Run the simulated workers and their NATS endpoints until stopped."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.workers: dict[str, list[SimWorker]] = {}
        self._stop = asyncio.Event()

    async def run(self) -> None:
        """Bind every worker's sockets, serve requests until `stop()`."""
        s = self.settings
        nc = await connect(s.nats_url, name="kvmesh-sim")
        subs = []
        try:
            for i in range(s.workers):
                wid = f"{s.worker_prefix}{i}"
                pub, replay = s.endpoints(i)
                ranks = [
                    SimWorker(
                        wid,
                        num_blocks=s.num_blocks,
                        block_size=s.block_size,
                        endpoint=pub,
                        replay_endpoint=replay,
                        dp_rank=r,
                        topic=s.topic,
                        version=s.version,
                        hash_form=s.hash_form,  # type: ignore[arg-type]
                        seed=s.seed + i,
                        timing=s.timing(),
                        speed=s.speed or 1.0,
                    )
                    for r in range(s.data_parallel_size)
                ]
                self.workers[wid] = ranks
                subs.append(await nc.subscribe(subjects.sim_subject(wid), cb=self._generate_handler(ranks)))
                subs.append(
                    await nc.subscribe(
                        subjects.sim_subject(wid).replace(".generate", ".reset"),
                        cb=self._reset_handler(ranks),
                    )
                )
                log.info(
                    "sim worker %s: events on %s, replay on %s (%d rank(s))", wid, pub, replay, len(ranks)
                )
            await self._stop.wait()
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            for ranks in self.workers.values():
                for w in ranks:
                    w.close()
            await close_quietly(nc)

    def stop(self) -> None:
        """Ask `run()` to finish."""
        self._stop.set()

    def _generate_handler(self, ranks: list[SimWorker]) -> Any:
        async def handle(msg: Any) -> None:
            try:
                req = msgspec.msgpack.decode(msg.data, type=_Request)
                worker = ranks[req.dp_rank % len(ranks)]
                result: Any = await worker.serve_request(
                    req.token_ids, req.output_length, lora_name=req.lora_name, cache_salt=req.cache_salt
                )
                result = dict(result)
            except Exception as exc:
                result = {"error": f"{type(exc).__name__}: {exc}"}
            if msg.reply:
                await msg.respond(msgspec.msgpack.encode(result))

        return handle

    def _reset_handler(self, ranks: list[SimWorker]) -> Any:
        async def handle(msg: Any) -> None:
            ok = all([await w.reset_prefix_cache() for w in ranks])
            if msg.reply:
                await msg.respond(msgspec.msgpack.encode({"reset": ok}))

        return handle


def command(argv: Sequence[str] | None = None, prog: str = "kvmesh sim") -> int:
    """Run a simulated fleet; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser, SimSettings, "sim")
    args = parser.parse_args(argv)
    try:
        settings = load(SimSettings, service="sim", environ=os.environ, args=args)
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(settings.log_level, "sim")
    return run_async(SimFleet(settings))
