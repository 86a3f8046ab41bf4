"""Settings of `kvmesh ingest` (flags, ``KVMESH_INGEST_*`` variables, or a TOML file)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvmesh.core.endpoints import offset_endpoint
from kvmesh.core.liveness import (
    DEFAULT_PROBE_AFTER_S,
    DEFAULT_PROBE_EVERY_S,
    DEFAULT_REMOVE_AFTER_S,
    DEFAULT_STALE_AFTER_FAILURES,
    LivenessPolicy,
)
from kvmesh.core.state import MAX_BLOCKS_LIMIT
from kvmesh.runtime import subjects
from kvmesh.runtime.config import NatsAuth, setting
from kvmesh.runtime.logs import LOG_FORMATS
from kvmesh.runtime.nats import DEFAULT_NATS_URL
from kvmesh.runtime.registry import MAX_DP_RANKS
from kvmesh.runtime.snapshots import DEFAULT_STREAM_MAX_AGE_S, DEFAULT_STREAM_MAX_BYTES

_ZMQ_ENDPOINT = re.compile(r"^(?:tcp://[^\s]+:\d+|(?:ipc|inproc)://\S+)$")
"""The endpoints an ingest can connect to: ``tcp://host:port``, ``ipc://path``, ``inproc://name``."""


def endpoint_problems(flag: str, endpoint: str, ranks: int) -> list[str]:
    """Problems with a ZMQ endpoint to connect to (one of `_ZMQ_ENDPOINT`'s forms, a per-rank endpoint for
    each of ``ranks`` data-parallel ranks); ``flag`` names it in each problem."""
    if not _ZMQ_ENDPOINT.match(endpoint):
        return [f"{flag} {endpoint!r} is not a ZMQ endpoint (tcp://host:port, ipc://path)"]
    try:
        for rank in range(1, ranks):
            offset_endpoint(endpoint, rank)
    except ValueError as exc:
        return [f"{flag}: {exc}"]
    return []


@dataclass(frozen=True, slots=True, kw_only=True)
class IngestSettings(NatsAuth):
    """How one ingest attaches to one engine (all of its data-parallel ranks) and to NATS."""

    worker_id: str = setting("", "worker id, as route replies name it (required)")
    model: str = setting("", "model name the engine serves, as route requests name it (required)")
    zmq_endpoint: str = setting(
        "tcp://127.0.0.1:5557",
        "engine's KV-event PUB endpoint to connect to (vLLM's tcp://*:5557 on its host); rank r, on whichever "
        "node, is read on its port + r, as vLLM and SGLang bind it",
    )
    replay_endpoint: str | None = setting(
        None, "engine's replay ROUTER endpoint; used to fill sequence gaps (none: gaps resynchronise)"
    )
    snapshot_endpoint: str | None = setting(
        None,
        "engine's KV-event snapshot ROUTER endpoint (vLLM PR #57789; rank r on port + r): a gap or an engine "
        "restart rebuilds the rank from the engine's state, falling back to replay, then to a resync (none: off)",
    )
    data_parallel_size: int = setting(
        1, "data-parallel ranks of the worker (all nodes); rank r is read on port + r (vLLM's rule)"
    )
    data_parallel_start_rank: int = setting(
        0,
        "first rank this ingest reads: one ingest per node of a multi-node worker "
        "(vLLM --data-parallel-start-rank); its ranks are [start, start + local)",
    )
    data_parallel_size_local: int | None = setting(
        None,
        "ranks this ingest reads from the start rank (vLLM --data-parallel-size-local; none: every rank "
        "from the start rank on)",
    )
    topic: str = setting("", "ZMQ topic prefix to subscribe to (vLLM's kv-events-config topic)")
    block_size: int | None = setting(
        None, "expected block size in tokens; events with another size are rejected (none: first event's)"
    )
    backend_of: list[str] = setting(  # noqa: RUF009 - setting() copies the list per instance
        [],
        "the endpoint is a shared cache, not a routable instance (an RFC #1527 backend_id such as a Mooncake "
        "master's CPU/disk pool): the worker ids of the instances that read it, comma-separated; its blocks "
        "count for each of them at its tiers, --worker-id names the pool, and it takes no registry key",
    )
    context_length: int | None = setting(
        None,
        "engine's context length in tokens (vLLM --max-model-len), registered so routers send it no longer "
        "prompt (none: not checked)",
    )
    kv_capacity_blocks: int | None = setting(
        None,
        "KV-cache blocks of one rank's engine (vLLM --num-gpu-blocks-override), registered (none: unknown)",
    )
    kv_events: bool = setting(
        True,
        "the engine publishes KV events; --no-kv-events: it publishes none, and the ingest only registers the "
        "worker (kv_events false) and heartbeats: no ZMQ socket, nothing on the stream; needs --block-size and "
        "--kv-capacity-blocks (routers count the prompts they send it as its cache, at most that many blocks "
        "per rank, least recently used out first). --metrics-url, --health-url probes and the status reply "
        "work as with events; silence never makes a rank stale",
    )
    nats_url: str = setting(DEFAULT_NATS_URL, "NATS server URL")
    stream: str = setting(subjects.STREAM, "JetStream stream name")
    events_prefix: str = setting(subjects.EVENTS_PREFIX, "subject prefix of the events stream")
    stream_replicas: int = setting(1, "replicas when this ingest creates the stream (3 on a cluster)")
    stream_memory: bool = setting(False, "create the stream with memory storage (tests, demos)")
    stream_max_bytes: int = setting(
        DEFAULT_STREAM_MAX_BYTES, "size bound in bytes when this ingest creates the stream"
    )
    stream_max_age_s: float = setting(
        DEFAULT_STREAM_MAX_AGE_S,
        "age bound in seconds when this ingest creates the stream (rule: max(24 h, 4 × snapshot interval × kept))",
    )
    max_coalesced_batches: int = setting(
        64,
        "consecutive engine batches of one rank read in one burst that share a stream message (1: one each)",
    )
    max_pending_acks: int = setting(256, "JetStream publishes awaiting their ack at once")
    replay_timeout_s: float = setting(5.0, "seconds to wait for missing batches from the replay socket")
    max_buffered_batches: int = setting(100_000, "batches buffered while NATS is unreachable; oldest dropped")
    registry_bucket: str = setting("", "KV bucket of the worker registry (default: <stream>_WORKERS)")
    worker_ttl_s: float = setting(
        15.0,
        "registry TTL in seconds (a heartbeat every TTL/3): the worker leaves the routes this long after its "
        "last heartbeat, and the index one indexer --expiry-grace-s later unless it heartbeats again",
    )
    metrics_url: str | None = setting(
        None,
        "engine's Prometheus /metrics URL: its load is published on kvmesh.load.<worker> every second, and a "
        "rank the page shows asleep (vLLM's vllm:engine_sleep_state) is cleared",
    )
    engine_probe_after_s: float = setting(
        DEFAULT_PROBE_AFTER_S,
        "seconds a rank may be silent before its engine is probed (replay socket, else --health-url); 0: never",
    )
    engine_probe_every_s: float = setting(DEFAULT_PROBE_EVERY_S, "seconds between probes of a silent engine")
    engine_probe_timeout_s: float = setting(2.0, "seconds one liveness probe may take")
    engine_stale_after_failures: int = setting(
        DEFAULT_STALE_AFTER_FAILURES,
        "unanswered probes in a row after which the rank is stale (routers skip it)",
    )
    engine_remove_after_s: float = setting(
        DEFAULT_REMOVE_AFTER_S,
        "seconds stale before the engine counts as gone: once every rank is, the worker leaves the registry "
        "(it rejoins as a new incarnation when the engine answers); 0: never",
    )
    health_url: str | None = setting(
        None,
        "engine HTTP URL probed for liveness when there is no replay socket (vLLM's /health; none: not probed)",
    )
    log_level: str = setting("INFO", "log level")
    log_format: str = setting(
        "auto", "log lines: json, text, or auto (JSON when stderr is not a terminal, else text)"
    )
    health_file: str = setting(
        "", "file rewritten every 5 s while running and connected, for `kvmesh health --file` (none: off)"
    )
    metrics_port: int | None = setting(
        None, "port of the Prometheus /metrics endpoint on every interface (0: a free one, logged; none: off)"
    )

    def local_ranks(self) -> range:
        """The data-parallel ranks this ingest reads: ``[start, start + local)`` (every rank on one node)."""
        start = self.data_parallel_start_rank
        local = self.data_parallel_size_local
        if local is None:
            local = self.data_parallel_size - start
        return range(start, start + max(local, 0))

    def multi_node(self) -> bool:
        """Whether this ingest reads only some of the worker's ranks (one node of several): its registry
        record is then a node record (`kvmesh.runtime.registry.registry_key`)."""
        return len(self.local_ranks()) != self.data_parallel_size

    def liveness_policy(self) -> LivenessPolicy:
        """The engine liveness bounds these settings give."""
        return LivenessPolicy(
            probe_after_s=self.engine_probe_after_s,
            probe_every_s=self.engine_probe_every_s,
            stale_after_failures=self.engine_stale_after_failures,
            remove_after_s=self.engine_remove_after_s,
        )

    def eventless_problems(self) -> list[str]:
        """Problems of a worker without KV events (``--no-kv-events``): the routers need its block size and KV
        capacity, and the settings that read engine sockets or a shared pool's events have nothing to read."""
        problems = []
        missing = [
            flag
            for flag, value in (
                ("--block-size", self.block_size),
                ("--kv-capacity-blocks", self.kv_capacity_blocks),
            )
            if value is None
        ]
        if missing:
            problems.append(
                f"--no-kv-events needs --block-size and --kv-capacity-blocks (missing: {', '.join(missing)}): "
                "routers hash prompts by the block size and bound the worker's predicted cache by its capacity"
            )
        for flag, value in (
            ("--replay-endpoint", self.replay_endpoint),
            ("--snapshot-endpoint", self.snapshot_endpoint),
        ):
            if value is not None:
                problems.append(
                    f"{flag} with --no-kv-events: the engine publishes no KV events to read; drop it"
                )
        if self.backend_of:
            problems.append(
                "--backend-of with --no-kv-events: a shared pool without KV events reports nothing"
            )
        return problems

    def validate(self) -> list[str]:
        """Return every problem with these settings."""
        problems = []
        if not self.worker_id:
            problems.append("--worker-id / KVMESH_INGEST_WORKER_ID is required")
        if not (math.isfinite(self.worker_ttl_s) and self.worker_ttl_s > 0):
            problems.append(f"--worker-ttl-s must be a number of seconds > 0, got {self.worker_ttl_s}")
        if not self.model:
            problems.append("--model / KVMESH_INGEST_MODEL is required")
        if not 1 <= self.data_parallel_size <= MAX_DP_RANKS:
            problems.append(
                f"--data-parallel-size must be in [1, {MAX_DP_RANKS}] (got {self.data_parallel_size}): "
                "one per engine DP rank, read on port + rank"
            )
        size = max(1, min(self.data_parallel_size, MAX_DP_RANKS))
        start, local = self.data_parallel_start_rank, self.data_parallel_size_local
        if not 0 <= start < size:
            problems.append(
                f"--data-parallel-start-rank must be in [0, --data-parallel-size) = [0, {size}) (got {start})"
            )
        elif local is not None and not 1 <= local <= size - start:
            problems.append(
                f"--data-parallel-size-local must be in [1, {size - start}] with start rank {start} and "
                f"--data-parallel-size {size} (got {local})"
            )
        ranks = self.local_ranks() if not problems else range(size)
        if not self.kv_events:
            problems += self.eventless_problems()
        else:
            problems += endpoint_problems("--zmq-endpoint", self.zmq_endpoint, ranks.stop)
        if self.replay_endpoint is not None and self.kv_events:
            problems += endpoint_problems("--replay-endpoint", self.replay_endpoint, ranks.stop)
        if self.snapshot_endpoint is not None and self.kv_events:
            problems += endpoint_problems("--snapshot-endpoint", self.snapshot_endpoint, ranks.stop)
        if self.block_size is not None and self.block_size < 1:
            problems.append("--block-size must be ≥ 1")
        if self.worker_id and self.worker_id in self.backend_of:
            problems.append(
                f"--backend-of names the pool itself ({self.worker_id}): list the instances that read it"
            )
        if self.context_length is not None and self.context_length < 1:
            problems.append("--context-length must be ≥ 1")
        if self.kv_capacity_blocks is not None and not 1 <= self.kv_capacity_blocks <= MAX_BLOCKS_LIMIT:
            problems.append(
                f"--kv-capacity-blocks must be within [1, {MAX_BLOCKS_LIMIT}], got {self.kv_capacity_blocks}"
            )
        if self.max_pending_acks < 1:
            problems.append("--max-pending-acks must be ≥ 1")
        if self.replay_timeout_s <= 0:
            problems.append("--replay-timeout-s must be > 0")
        if self.engine_probe_after_s < 0:
            problems.append("--engine-probe-after-s must be ≥ 0 (0: never probe)")
        elif self.engine_probe_after_s > 0:
            flags = {
                "probe_after_s": "--engine-probe-after-s",
                "probe_every_s": "--engine-probe-every-s",
                "stale_after_failures": "--engine-stale-after-failures",
                "remove_after_s": "--engine-remove-after-s",
            }
            for problem in self.liveness_policy().problems():
                field = problem.split(" ", 1)[0]
                problems.append(problem.replace(field, flags.get(field, field), 1))
            if self.engine_probe_timeout_s <= 0:
                problems.append("--engine-probe-timeout-s must be > 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            problems.append(f"--metrics-port must be in [0, 65535] (0: a free port), got {self.metrics_port}")
        if self.log_format not in LOG_FORMATS:
            problems.append(f"--log-format must be auto, json or text, got {self.log_format!r}")
        return problems
