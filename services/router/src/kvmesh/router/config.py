"""Settings of `kvmesh router` (flags, ``KVMESH_ROUTER_*`` variables, or a TOML file)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.route import DEFAULT_MAX_TOKENS
from kvmesh.runtime import subjects
from kvmesh.runtime.config import setting
from kvmesh.runtime.nats import DEFAULT_NATS_URL


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings:
    """How one router replica answers ``kvmesh.route``."""

    nats_url: str = setting(DEFAULT_NATS_URL, "NATS server URL")
    route_subject: str = setting(subjects.ROUTE_SUBJECT, "subject of route requests (queue group)")
    match_subject: str = setting(subjects.MATCH_SUBJECT, "subject of the indexers' match queries")
    match_timeout_s: float = setting(1.0, "seconds to wait for an indexer before answering unavailable")
    max_tokens: int = setting(DEFAULT_MAX_TOKENS, "longest prompt accepted, in tokens")
    log_level: str = setting("INFO", "log level")

    def validate(self) -> list[str]:
        """Return every problem with these settings."""
        problems = []
        if self.match_timeout_s <= 0:
            problems.append("--match-timeout-s must be > 0")
        if self.max_tokens < 1:
            problems.append("--max-tokens must be ≥ 1")
        return problems
