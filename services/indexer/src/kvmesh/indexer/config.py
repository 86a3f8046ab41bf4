"""Settings of `kvmesh indexer` (flags, ``KVMESH_INDEXER_*`` variables, or a TOML file)."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

from kvmesh.core.state import MAX_BLOCKS_LIMIT
from kvmesh.runtime import subjects
from kvmesh.runtime.config import NatsAuth, setting
from kvmesh.runtime.logs import LOG_FORMATS
from kvmesh.runtime.nats import DEFAULT_NATS_URL
from kvmesh.runtime.snapshots import DEFAULT_SNAPSHOT_EVERY_S, DEFAULT_SNAPSHOT_KEEP


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexerSettings(NatsAuth):
    """How one indexer replica reads the stream and answers match queries."""

    nats_url: str = setting(DEFAULT_NATS_URL, "NATS server URL")
    stream: str = setting(subjects.STREAM, "JetStream stream name")
    events_prefix: str = setting(subjects.EVENTS_PREFIX, "subject prefix of the events stream")
    match_subject: str = setting(subjects.MATCH_SUBJECT, "subject of match queries (queue group)")
    replica_id: str = setting("", "this replica's name in `kvmesh status` (default: host-pid)")
    snapshot_bucket: str = setting("", "Object Store bucket of snapshots (default: <stream>_SNAPSHOTS)")
    snapshot_every_messages: int = setting(
        100_000, "write a snapshot after this many applied messages (0: off)"
    )
    snapshot_every_s: float = setting(
        DEFAULT_SNAPSHOT_EVERY_S, "write a snapshot when the last one is this old, in seconds (0: off)"
    )
    snapshot_keep: int = setting(DEFAULT_SNAPSHOT_KEEP, "snapshots kept; older ones are deleted")
    lease_bucket: str = setting("", "KV bucket of the snapshot-writer lease (default: <stream>_LEASE)")
    lease_ttl_s: float = setting(30.0, "seconds a snapshot-writer lease lives without renewal")
    registry_bucket: str = setting("", "KV bucket of the worker registry (default: <stream>_WORKERS)")
    worker_ttl_s: float = setting(
        15.0, "worker registry TTL in seconds (when this replica creates the bucket)"
    )
    expiry_grace_s: float = setting(
        5.0,
        "seconds an expired worker may register again before this replica removes it from the index "
        "(a registry failover can outlast the worker TTL; at most 2/3 of the registry's TTL is used; 0: claim at once)",
    )
    purge_after_snapshot: bool = setting(
        True, "after a snapshot, purge stream messages no kept snapshot needs (never an ingest's last cursor)"
    )
    buckets_memory: bool = setting(
        False, "create snapshot, lease and registry buckets in memory (tests, demos)"
    )
    buckets_replicas: int = setting(
        0, "replicas of the snapshot, lease and registry buckets it creates (0: the events stream's)"
    )
    buckets_max_bytes: int = setting(-1, "size bound of the snapshot bucket in bytes (-1: none)")
    max_blocks: int | None = setting(
        None,
        "bound on the blocks this replica's index holds, every model together: past it, the largest worker "
        "caches lose their least recently stored blocks (counted as evicted_blocks in `kvmesh status`); give "
        "every indexer and router the same bound (KVMESH_MAX_BLOCKS) or their digests differ (none: no bound)",
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

    def validate(self) -> list[str]:
        """Return every problem with these settings."""
        problems = [] if self.match_subject else ["--match-subject must not be empty"]
        if self.snapshot_keep < 1:
            problems.append("--snapshot-keep must be ≥ 1")
        if self.snapshot_every_messages < 0 or self.snapshot_every_s < 0:
            problems.append("--snapshot-every-messages and --snapshot-every-s must be ≥ 0")
        ttls_ok = all(math.isfinite(t) and t > 0 for t in (self.lease_ttl_s, self.worker_ttl_s))
        if not ttls_ok:
            problems.append(
                f"--lease-ttl-s and --worker-ttl-s must be numbers of seconds > 0, "
                f"got {self.lease_ttl_s} and {self.worker_ttl_s}"
            )
        if not (math.isfinite(self.expiry_grace_s) and self.expiry_grace_s >= 0):
            problems.append(f"--expiry-grace-s must be a number of seconds ≥ 0, got {self.expiry_grace_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            problems.append(f"--metrics-port must be in [0, 65535] (0: a free port), got {self.metrics_port}")
        if self.max_blocks is not None and self.max_blocks < 1:
            problems.append(f"--max-blocks must be ≥ 1 (none: no bound), got {self.max_blocks}")
        if self.max_blocks is not None and self.max_blocks > MAX_BLOCKS_LIMIT:
            problems.append(f"--max-blocks must be ≤ {MAX_BLOCKS_LIMIT}, got {self.max_blocks}")
        if self.log_format not in LOG_FORMATS:
            problems.append(f"--log-format must be auto, json or text, got {self.log_format!r}")
        return problems

    def snapshot_bucket_name(self) -> str:
        """Return the snapshot bucket, derived from the stream when unset."""
        return self.snapshot_bucket or subjects.snapshot_bucket(self.stream)

    def lease_bucket_name(self) -> str:
        """Return the lease bucket, derived from the stream when unset."""
        return self.lease_bucket or subjects.lease_bucket(self.stream)

    def registry_bucket_name(self) -> str:
        """Return the registry bucket, derived from the stream when unset."""
        return self.registry_bucket or subjects.registry_bucket(self.stream)

    def replica_name(self) -> str:
        """Return the replica id, or host-pid when none was set."""
        return self.replica_id or f"{socket.gethostname()}-{os.getpid()}"
