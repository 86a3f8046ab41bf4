"""Settings of `kvmesh router` (flags, ``KVMESH_ROUTER_*`` variables, or a TOML file)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.core.load import DEFAULT_LOAD_TTL_S, DEFAULT_REQUEST_TTL_S
from kvmesh.core.route import DEFAULT_MAX_CANDIDATES, DEFAULT_MAX_TOKENS, IDLE_CANDIDATES, Policy
from kvmesh.core.sessions import MAX_SESSIONS, SESSION_TTL_S
from kvmesh.core.state import MAX_BLOCKS_LIMIT
from kvmesh.runtime import subjects
from kvmesh.runtime.config import NatsAuth, setting
from kvmesh.runtime.logs import LOG_FORMATS
from kvmesh.runtime.nats import DEFAULT_NATS_URL

_DEFAULT = Policy()


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings(NatsAuth):
    """How one router replica answers ``kvmesh.route`` and weighs affinity against load."""

    nats_url: str = setting(DEFAULT_NATS_URL, "NATS server URL")
    route_subject: str = setting(subjects.ROUTE_SUBJECT, "subject of route requests (queue group)")
    index: str = setting(
        "local",
        "where overlaps come from: 'local' keeps a replica of the index in this process, restored from the "
        "indexers' snapshots and the stream (one NATS round trip per route, the memory of one index); "
        "'remote' asks the indexers on --match-subject (a second round trip per route, no index here)",
    )
    match_subject: str = setting(subjects.MATCH_SUBJECT, "subject of the indexers' match queries")
    stream: str = setting(subjects.STREAM, "JetStream stream of the events (--index local)")
    events_prefix: str = setting(subjects.EVENTS_PREFIX, "subject prefix of the events (--index local)")
    snapshot_bucket: str = setting(
        "", "Object Store bucket of the indexers' snapshots (--index local; default: <stream>_SNAPSHOTS)"
    )
    registry_bucket: str = setting(
        "",
        "KV bucket of the worker registry whose live workers are the candidates (default: <stream>_WORKERS)",
    )
    use_registry: bool = setting(
        True,
        "narrow candidates to the workers with a live registry entry (heartbeats) and add registered "
        "workers the index does not know yet",
    )
    requests_prefix: str = setting(
        subjects.REQUESTS_PREFIX,
        "subject prefix of request lifecycle events (routed, prefill_done, finished, sync)",
    )
    load_prefix: str = setting(
        subjects.LOAD_PREFIX, "subject prefix of engine load reports (<prefix>.<worker>)"
    )
    match_timeout_s: float = setting(1.0, "seconds to wait for an indexer before answering unavailable")
    max_tokens: int = setting(DEFAULT_MAX_TOKENS, "longest prompt accepted, in tokens")
    overlap_weight: float = setting(_DEFAULT.overlap_weight, "weight of the prefill term of the cost")
    decode_weight: float = setting(
        _DEFAULT.decode_weight, "weight of the decode (active blocks) term of the cost"
    )
    temperature: float = setting(
        _DEFAULT.temperature, "0: lowest cost wins; > 0: softmax sampling over costs"
    )
    tier_weights: dict[str, float] = setting(  # noqa: RUF009 - setting() copies the dict per instance
        dict(_DEFAULT.tier_weights), "weight of a cached block per storage tier (JSON object, 0-1 each)"
    )
    busy_kv_usage: float = setting(
        _DEFAULT.busy_kv_usage, "KV usage (0-1) at which a worker is busy (>1: off)"
    )
    busy_waiting: int = setting(_DEFAULT.busy_waiting, "waiting requests at which a worker is busy (0: off)")
    predicted_ttl_s: float = setting(
        0.0,
        "seconds a routed prompt's blocks count as held by the chosen worker before its KV events confirm "
        "them, so a follow-up within the events' delay is not routed as cold (0: off; Dynamo's "
        "--router-predicted-ttl-secs; docs/benchmarks.md section 1)",
    )
    session_slack: float = setting(
        _DEFAULT.session_slack,
        "session affinity (requests with a session_id): the session's last worker keeps the request while its "
        "cost is at most the lowest cost + this fraction of the prompt's blocks (0: only when as cheap as the "
        "best)",
    )
    session_ttl_s: float = setting(
        SESSION_TTL_S, "idle seconds after which a session's worker is forgotten (session affinity)"
    )
    max_sessions: int = setting(
        MAX_SESSIONS, "sessions each replica remembers (least recently seen forgotten first)"
    )
    request_ttl_s: float = setting(
        DEFAULT_REQUEST_TTL_S, "seconds after which an unfinished request stops counting"
    )
    load_ttl_s: float = setting(DEFAULT_LOAD_TTL_S, "seconds after which an engine load report is ignored")
    prefill_progress: bool = setting(
        True,
        "count only the estimated remainder of each worker's oldest unfinished prefill, at a rate learned "
        "from its routed -> prefill_done intervals (a worker without prefill_done notes counts whole); "
        "--no-prefill-progress counts every routed prefill whole until its prefill_done "
        "(docs/benchmarks.md section 1)",
    )
    sync_timeout_s: float = setting(
        0.5,
        "seconds to wait at start-up for a peer's accounting snapshot (ledger and sessions first, then the "
        "predicted entries; what has not arrived by then is left out, with a warning; 0: no sync)",
    )
    max_candidates: int = setting(
        DEFAULT_MAX_CANDIDATES,
        "most candidates one route scores per model: holders with overlap first, then holders without "
        f"(fewest cached blocks first), then at most {IDLE_CANDIDATES} registered ranks the index lacks and "
        "with no load, drawn by the request's seed; the rest are cut (warned once per model)",
    )
    max_lag_messages: int = setting(
        10_000,
        "stream messages the local index replica may lag behind the stream before route replies say "
        "mode 'degraded' (--index local)",
    )
    max_lag_s: float = setting(
        2.0,
        "seconds the local index replica may stay behind a stream message before route replies say mode "
        "'degraded' (--index local)",
    )
    heartbeat_late_s: float = setting(
        0.0,
        "seconds after a worker's last registry heartbeat (wall clock of its ingest) at which its holders "
        "count as stale in explain and status, and a reply choosing one says mode 'degraded' (0: two "
        "heartbeat intervals, 2/3 of the registry bucket's TTL; < 0: off)",
    )
    max_blocks: int | None = setting(
        None,
        "bound on the blocks the local index replica holds (--index local), every model together: past it, "
        "the largest worker caches lose their least recently stored blocks (counted as evicted_blocks in "
        "`kvmesh status`); give every indexer and router the same bound (KVMESH_MAX_BLOCKS) or their digests "
        "differ (none: no bound)",
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

    http_port: int | None = setting(
        None,
        "port of the RFC #1403 indexer API (HTTP: /query, /query_by_hash, /register, /unregister, /workers, "
        "/dump, /health, /metrics) over this router's local index (0: a free one, logged; none: off)",
    )
    http_host: str = setting(
        "127.0.0.1",
        "interface of --http-port (0.0.0.0: every one; /register starts ingest processes, so expose it only "
        "where its callers are trusted)",
    )

    def registry_bucket_name(self) -> str:
        """Return the registry bucket, derived from the stream when unset."""
        return self.registry_bucket or subjects.registry_bucket(self.stream)

    def snapshot_bucket_name(self) -> str:
        """Return the snapshot bucket, derived from the stream when unset."""
        return self.snapshot_bucket or subjects.snapshot_bucket(self.stream)

    def policy(self) -> Policy:
        """Return the cost policy these settings describe."""
        return Policy(
            overlap_weight=self.overlap_weight,
            decode_weight=self.decode_weight,
            temperature=self.temperature,
            tier_weights={k.upper(): v for k, v in self.tier_weights.items()},
            busy_kv_usage=self.busy_kv_usage,
            busy_waiting=self.busy_waiting,
            session_slack=self.session_slack,
        )

    def validate(self) -> list[str]:
        """Return every problem with these settings."""
        problems = []
        if self.index not in ("remote", "local"):
            problems.append(f"--index must be 'remote' or 'local', got {self.index!r}")
        if self.match_timeout_s <= 0:
            problems.append("--match-timeout-s must be > 0")
        if self.max_tokens < 1:
            problems.append("--max-tokens must be ≥ 1")
        if self.request_ttl_s <= 0:
            problems.append("--request-ttl-s must be > 0")
        if self.load_ttl_s <= 0:
            problems.append("--load-ttl-s must be > 0")
        if not (self.predicted_ttl_s >= 0 and math.isfinite(self.predicted_ttl_s)):
            problems.append(
                f"--predicted-ttl-s must be a finite number ≥ 0 (0: off), got {self.predicted_ttl_s}"
            )
        if not self.session_ttl_s > 0:
            problems.append(f"--session-ttl-s must be > 0, got {self.session_ttl_s}")
        if self.max_sessions < 1:
            problems.append(f"--max-sessions must be ≥ 1, got {self.max_sessions}")
        if self.sync_timeout_s < 0:
            problems.append("--sync-timeout-s must be ≥ 0")
        if self.max_candidates < 1:
            problems.append("--max-candidates must be ≥ 1")
        if self.max_blocks is not None and self.max_blocks < 1:
            problems.append(f"--max-blocks must be ≥ 1 (none: no bound), got {self.max_blocks}")
        if self.max_blocks is not None and self.max_blocks > MAX_BLOCKS_LIMIT:
            problems.append(f"--max-blocks must be ≤ {MAX_BLOCKS_LIMIT}, got {self.max_blocks}")
        if self.max_lag_messages < 0:
            problems.append("--max-lag-messages must be ≥ 0")
        if not self.max_lag_s >= 0:
            problems.append("--max-lag-s must be ≥ 0")
        if not math.isfinite(self.heartbeat_late_s):
            problems.append("--heartbeat-late-s must be a finite number")
        for p in self.policy().problems():
            flag = p.split(" ", 1)[0].split(".", 1)[0].replace("_", "-")
            problems.append(f"--{flag}: {p}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            problems.append(f"--metrics-port must be in [0, 65535] (0: a free port), got {self.metrics_port}")
        if self.http_port is not None:
            if not 0 <= self.http_port <= 65535:
                problems.append(f"--http-port must be in [0, 65535] (0: a free port), got {self.http_port}")
            if self.index != "local":
                problems.append("--http-port needs --index local (the API answers from the local index)")
        if self.log_format not in LOG_FORMATS:
            problems.append(f"--log-format must be auto, json or text, got {self.log_format!r}")
        return problems
