"""``kvmesh sim``: simulated vLLM workers that speak the real KV-event wire protocol.

Each worker is a `SimWorker` (block pool with prefix caching + ZMQ PUB and replay ROUTER). Requests reach
them over NATS request-reply, standing in for the engine's HTTP API: subject ``kvmesh.sim.<worker>.generate``
with a msgpack body ``{"token_ids": [...], "output_length": n, "lora_name": ..., "cache_salt": ...}``, reply
``{"cached_tokens", "prompt_tokens", "worker_id", "dp_rank"}`` (``cached_tokens`` counted as an engine counts
it, vLLM's ``usage.prompt_tokens_details.cached_tokens``: whole blocks, never the prompt's last token; what
a caller passes to ``Router.finish(..., cached_tokens=...)``; plus the simulated ``queue_s`` and ``ttft_s``
with ``--speed`` > 0, which turns on the `kvmesh.sim.timing.TimingModel`: concurrent requests up to
``--max-batch``, prefill and decode delays scaled by ``--speed``) or ``{"error": "..."}``; and
``kvmesh.sim.<worker>.reset`` (reset the prefix cache: AllBlocksCleared).

Self-made traffic (``--traffic-rps`` > 0): each rank also serves requests it makes up itself
(`kvmesh.sim.traffic`) for ``--traffic-s`` seconds, independent of NATS. Recording (``--record-dir``): each
rank appends every batch it publishes to ``<dir>/<worker>.<rank>.<start ns>.kv``
(`kvmesh.sim.publisher.read_record`) and, when its traffic ends, writes its cache content to ``….kv.done``.

Worker ids are ``<--worker-prefix><i>``, or ``--worker-id`` exactly for a single worker (one engine per
container, as docker-compose.yml runs them). Ports: worker *i* publishes on ``--base-port + 20·i`` and replays on ``--base-port + 20·i + 10``; its
data-parallel rank *r* adds *r* to both (vLLM's rule), so up to 10 ranks per worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvmesh.core.errors import KvmeshError
from kvmesh.runtime import subjects
from kvmesh.runtime.config import NatsAuth, add_arguments, load, setting, to_dict
from kvmesh.runtime.nats import DEFAULT_NATS_URL, close_quietly, connect, connect_options
from kvmesh.runtime.runner import run_async, setup_logging
from kvmesh.sim.engine import SimWorker
from kvmesh.sim.timing import TimingModel
from kvmesh.sim.traffic import drive

log = logging.getLogger("kvmesh.sim")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimSettings(NatsAuth):
    """A simulated fleet."""

    workers: int = setting(2, "simulated workers")
    worker_prefix: str = setting("sim-", "worker ids are <prefix><i>")
    worker_id: str = setting("", "the one worker's id exactly, instead of <prefix>0 (with --workers 1)")
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
    traffic_rps: float = setting(0.0, "requests per second each rank makes up itself (0: none)")
    traffic_s: float = setting(60.0, "seconds of self-made traffic (with --traffic-rps)")
    traffic_seed: int = setting(0, "seed of the self-made prompts")
    record_dir: str = setting("", "append every published batch to a file per rank in this directory")
    nats_url: str = setting(DEFAULT_NATS_URL, "NATS server for the generate endpoints")
    log_level: str = setting("INFO", "log level")
    log_format: str = setting("auto", "log lines: json, text, or auto (json unless stderr is a terminal)")

    def worker_name(self, i: int) -> str:
        """Return worker ``i``'s id: ``--worker-id`` for the one worker when given, else ``<prefix><i>``."""
        return self.worker_id or f"{self.worker_prefix}{i}"

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
        if self.log_format not in ("auto", "json", "text"):
            problems.append(f"--log-format must be auto, json or text, got {self.log_format!r}")
        if self.worker_id and self.workers != 1:
            problems.append("--worker-id names one worker: it needs --workers 1")
        if not 1 <= self.data_parallel_size <= 10:
            problems.append("--data-parallel-size must be between 1 and 10")
        if self.hash_form not in ("int", "signed", "bytes"):
            problems.append("--hash-form must be int, signed or bytes")
        if self.speed < 0 or self.max_batch < 1:
            problems.append("--speed must be >= 0 and --max-batch >= 1")
        if self.traffic_rps < 0 or self.traffic_s < 0:
            problems.append("--traffic-rps and --traffic-s must be >= 0")
        return problems


class _Request(msgspec.Struct):
    token_ids: list[int]
    output_length: int = 0
    lora_name: str | None = None
    cache_salt: str | None = None
    dp_rank: int = 0


class SimPortError(KvmeshError):
    """A simulated worker's ZMQ port is already taken."""


class SimFleet:
    """Run the simulated workers and their NATS endpoints until stopped."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.workers: dict[str, list[SimWorker]] = {}
        self._stop = asyncio.Event()
        self._started_ns = time.time_ns()

    async def run(self) -> None:
        """Bind every worker's sockets, serve requests until `stop()`."""
        s = self.settings
        nc = await connect(s.nats_url, name="kvmesh-sim", **connect_options(s))
        subs = []
        traffic: list[asyncio.Task[None]] = []
        started_ns = self._started_ns = time.time_ns()
        try:
            for i in range(s.workers):
                wid = s.worker_name(i)
                pub, replay = s.endpoints(i)
                ranks = self._bind(wid, i)
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
            if s.traffic_rps > 0:
                for ranks in self.workers.values():
                    for w in ranks:
                        path = self._record_path(w.worker_id, w.dp_rank, started_ns)
                        report = None if path is None else path.with_name(path.name + ".done")
                        traffic.append(
                            asyncio.create_task(
                                drive(
                                    w,
                                    rps=s.traffic_rps,
                                    duration_s=s.traffic_s,
                                    seed=s.traffic_seed,
                                    report_path=report,
                                )
                            )
                        )
            await self._stop.wait()
        finally:
            for t in traffic:
                t.cancel()
            await asyncio.gather(*traffic, return_exceptions=True)
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            for ranks in self.workers.values():
                for w in ranks:
                    w.close()
            await close_quietly(nc)

    def _bind(self, wid: str, i: int) -> list[SimWorker]:
        """Make worker ``i``'s ranks, binding their ZMQ sockets.

        Raises:
            SimPortError: a port is taken (one clear line instead of a ZMQ traceback).
        """
        s = self.settings
        pub, replay = s.endpoints(i)
        started_ns = self._started_ns
        ranks: list[SimWorker] = []
        try:
            for r in range(s.data_parallel_size):
                ranks.append(
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
                        record_path=self._record_path(wid, r, started_ns),
                    )
                )
        except zmq.ZMQError as exc:
            for w in ranks:
                w.close()
            where = f"{pub} (or its replay port {replay})" if replay else pub
            raise SimPortError(
                f"sim worker {wid} rank {len(ranks)} cannot bind {where}: {exc.strerror}; choose another "
                "--base-port (worker i uses base + 20·i and base + 20·i + 10, plus its rank)"
            ) from None
        return ranks

    def _record_path(self, worker_id: str, dp_rank: int, started_ns: int) -> Path | None:
        """Return a rank's record file (``--record-dir``), or None when not recording."""
        if not self.settings.record_dir:
            return None
        return Path(self.settings.record_dir) / f"{worker_id}.{dp_rank}.{started_ns}.kv"

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
    if args._print_config:
        print(json.dumps(to_dict(settings), indent=2, default=str))
        return 0
    setup_logging(settings.log_level, "sim", settings.log_format)
    return run_async(SimFleet(settings))
