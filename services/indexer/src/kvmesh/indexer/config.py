"""Settings of `kvmesh indexer` (flags, ``KVMESH_INDEXER_*`` variables, or a TOML file)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from kvmesh.runtime import subjects
from kvmesh.runtime.config import setting
from kvmesh.runtime.nats import DEFAULT_NATS_URL


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexerSettings:
    """How one indexer replica reads the stream and answers match queries."""

    nats_url: str = setting(DEFAULT_NATS_URL, "NATS server URL")
    stream: str = setting(subjects.STREAM, "JetStream stream name")
    events_prefix: str = setting(subjects.EVENTS_PREFIX, "subject prefix of the events stream")
    match_subject: str = setting(subjects.MATCH_SUBJECT, "subject of match queries (queue group)")
    replica_id: str = setting("", "this replica's name in `kvmesh status` (default: host-pid)")
    log_level: str = setting("INFO", "log level")

    def validate(self) -> list[str]:
        """Return every problem with these settings."""
        return [] if self.match_subject else ["--match-subject must not be empty"]

    def replica_name(self) -> str:
        """Return the replica id, or host-pid when none was set."""
        return self.replica_id or f"{socket.gethostname()}-{os.getpid()}"
