"""The indexer's own Prometheus metrics (sans I/O: no NATS, loop or clock): snapshots, readiness, removals.

`INSTRUMENTS` declares them (name, kind, unit, description: `kvmesh.runtime.metrics.ServiceMetrics.observe`
rows) and `indexer_samples` gives their values from what the replica keeps for ``kvmesh status``. The
replica's stream figures (``kvmesh_indexer_applied_seq``, lag, blocks per worker and tier, held orphans) are
`kvmesh.runtime.metrics.replica_instruments`, shared with a local-index router; the match latency histogram
(`MATCH_LATENCY`) is recorded by `kvmesh.indexer.endpoints.MatchEndpoint`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Row = tuple[str, str, str, str]
Sample = tuple[dict[str, str], float]

PREFIX = "kvmesh_indexer"
"""Name prefix of every indexer metric."""
MATCH_LATENCY = "kvmesh_indexer_match_latency_seconds"
"""Histogram: seconds from a match request's arrival to its reply being sent, by outcome."""

INSTRUMENTS: tuple[Row, ...] = (
    ("kvmesh_indexer_ready", "gauge", "1", "1 once the replica caught up and answers match queries"),
    ("kvmesh_indexer_snapshot_writer", "gauge", "1", "1 while this replica holds the snapshot-writer lease"),
    ("kvmesh_indexer_snapshots_written", "counter", "{snapshot}", "snapshots this replica wrote"),
    (
        "kvmesh_indexer_snapshot_age_seconds",
        "gauge",
        "s",
        "seconds since this replica last wrote a snapshot (absent before its first)",
    ),
    ("kvmesh_indexer_snapshot_size_bytes", "gauge", "By", "size of the last snapshot this replica wrote"),
    (
        "kvmesh_indexer_snapshot_duration_seconds",
        "gauge",
        "s",
        "phases of the last snapshot written: stall (state copied), encode, store",
    ),
    (
        "kvmesh_indexer_snapshot_pending_messages",
        "gauge",
        "{message}",
        "stream messages read since the last snapshot began",
    ),
    (
        "kvmesh_indexer_worker_removals",
        "counter",
        "{message}",
        "WorkerRemoved messages this replica published",
    ),
)
"""The indexer's own observed metrics."""


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexerFigures:
    """What `indexer_samples` reads of one replica at one moment."""

    replica: str
    ready: bool
    snapshot_writer: bool
    snapshots: Mapping[str, Any]
    """`kvmesh.indexer.writer.new_stats`: ``written``, ``last`` (the last write's result), stall times."""
    snapshot_age_s: float | None
    """Seconds since this replica last wrote one (None: not since it started)."""
    pending_messages: int
    removals_published: int


def indexer_samples(f: IndexerFigures) -> dict[str, list[Sample]]:
    """The values of `INSTRUMENTS` (each labelled ``replica``)."""
    base = {"replica": f.replica}
    last = f.snapshots.get("last") or {}
    out: dict[str, list[Sample]] = {
        "kvmesh_indexer_ready": [(base, 1.0 if f.ready else 0.0)],
        "kvmesh_indexer_snapshot_writer": [(base, 1.0 if f.snapshot_writer else 0.0)],
        "kvmesh_indexer_snapshots_written": [(base, float(f.snapshots.get("written", 0)))],
        "kvmesh_indexer_snapshot_age_seconds": [],
        "kvmesh_indexer_snapshot_size_bytes": [],
        "kvmesh_indexer_snapshot_duration_seconds": [],
        "kvmesh_indexer_snapshot_pending_messages": [(base, float(f.pending_messages))],
        "kvmesh_indexer_worker_removals": [(base, float(f.removals_published))],
    }
    if f.snapshot_age_s is not None:
        out["kvmesh_indexer_snapshot_age_seconds"].append((base, round(f.snapshot_age_s, 3)))
    if last.get("written"):
        out["kvmesh_indexer_snapshot_size_bytes"].append((base, float(last.get("bytes", 0))))
        out["kvmesh_indexer_snapshot_duration_seconds"] = [
            ({**base, "phase": phase}, float(last.get(f"{phase}_ms", 0.0)) / 1e3)
            for phase in ("stall", "encode", "store")
        ]
    return out
