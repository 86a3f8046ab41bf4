"""The ingest's Prometheus metrics, from its ``kvmesh status`` reply (sans I/O: no NATS, ZMQ, loop or clock).

`INSTRUMENTS` declares them (name, kind, unit, description: `kvmesh.runtime.metrics.ServiceMetrics.observe`
rows); `ingest_samples` gives their values from an `IngestStatus`, the counters the ingest already keeps.
Per-rank metrics carry ``worker_id`` and ``dp_rank`` labels, the ingest's own ones ``worker_id`` alone. The publish
latency histogram (`PUBLISH_LATENCY`) is recorded by `kvmesh.ingest.publish` (send → ack).
"""

from __future__ import annotations

from kvmesh.core.protocol import IngestStatus

Row = tuple[str, str, str, str]
Sample = tuple[dict[str, str], float]

PUBLISH_LATENCY = "kvmesh_ingest_publish_latency_seconds"
"""Histogram: seconds from handing a stream message to the client to its JetStream ack, per dp_rank."""

_PER_RANK: tuple[tuple[str, str, str, str], ...] = (
    # (metric, TrackerStats field, unit, description)
    ("kvmesh_ingest_batches", "delivered", "{batch}", "engine batches delivered in engine order"),
    ("kvmesh_ingest_gaps", "gaps", "{gap}", "engine sequence gaps seen"),
    ("kvmesh_ingest_missing_batches", "missing_batches", "{batch}", "engine batches missing in those gaps"),
    ("kvmesh_ingest_replays", "replays", "{replay}", "replays asked of the engine's replay socket"),
    ("kvmesh_ingest_replayed_batches", "replayed_batches", "{batch}", "batches the replays delivered"),
    ("kvmesh_ingest_resyncs", "resyncs", "{resync}", "holder resynchronisations (gap not replayable)"),
    ("kvmesh_ingest_engine_restarts", "restarts", "{restart}", "engine restarts seen (new epochs)"),
    ("kvmesh_ingest_duplicate_batches", "duplicates", "{batch}", "engine batches seen twice (ignored)"),
    ("kvmesh_ingest_snapshots", "snapshots", "{snapshot}", "snapshots asked of the engine's snapshot socket"),
    ("kvmesh_ingest_snapshot_rebuilds", "rebuilds", "{snapshot}", "holders rebuilt from an engine snapshot"),
    (
        "kvmesh_ingest_snapshot_failures",
        "snapshot_failures",
        "{snapshot}",
        "snapshots unavailable, short of the live stream or failed (replay or resync instead)",
    ),
    ("kvmesh_ingest_heartbeats", "heartbeats", "{batch}", "engine heartbeats (batches without events)"),
)

_REJECTED: tuple[tuple[str, str], ...] = (
    # (reason label, NormalizeStats field)
    ("block_size", "rejected_block_size"),
    ("alignment", "rejected_alignment"),
    ("tokens", "rejected_tokens"),
    ("malformed", "malformed_events"),
    ("unknown_type", "unknown_events"),
)

_COUNTERS: tuple[tuple[str, str, str, str], ...] = (
    # (metric, IngestCounters field, unit, description)
    ("kvmesh_ingest_published", "published", "{message}", "stream messages published and acknowledged"),
    ("kvmesh_ingest_publish_retries", "publish_retries", "{message}", "stream messages sent again"),
    ("kvmesh_ingest_split_batches", "split_batches", "{batch}", "batches split over the max payload"),
    ("kvmesh_ingest_reorders", "reorders", "{message}", "messages found stored out of engine order"),
    (
        "kvmesh_ingest_reordered_resends",
        "reordered_resends",
        "{message}",
        "messages deleted and sent again after an earlier one that failed",
    ),
)

INSTRUMENTS: tuple[Row, ...] = (
    *((name, "counter", unit, desc) for name, _f, unit, desc in _PER_RANK),
    ("kvmesh_ingest_events", "counter", "{event}", "events normalised into stream events, by kind"),
    ("kvmesh_ingest_blocks", "counter", "{block}", "blocks stored and removed by those events, by kind"),
    ("kvmesh_ingest_rejected_events", "counter", "{event}", "engine events rejected, by reason"),
    ("kvmesh_ingest_dropped_batches", "counter", "{batch}", "engine batches dropped, by reason"),
    *((name, "counter", unit, desc) for name, _f, unit, desc in _COUNTERS),
    ("kvmesh_ingest_nats_reconnects", "counter", "{reconnect}", "NATS reconnections"),
    ("kvmesh_ingest_epoch", "gauge", "{epoch}", "the rank's engine incarnation"),
    ("kvmesh_ingest_engine_seq", "gauge", "{batch}", "last engine sequence delivered (absent before any)"),
    ("kvmesh_ingest_replaying", "gauge", "1", "1 while the rank replays a gap"),
    (
        "kvmesh_ingest_replay_duration_seconds",
        "counter",
        "s",
        "seconds spent in replays (over kvmesh_ingest_replays_total: their mean duration)",
    ),
    ("kvmesh_ingest_outbox_messages", "gauge", "{message}", "stream messages not yet acknowledged"),
)
"""Every observed ingest metric."""


def ingest_samples(status: IngestStatus, *, reconnects: int) -> dict[str, list[Sample]]:
    """The values of `INSTRUMENTS` for one ingest's status (``reconnects``: the NATS client's count).

    ``kvmesh_ingest_dropped_batches`` reasons: ``outbox`` (outbox full, or a message over the server's max
    payload), ``bad_dp_rank`` (a dp_rank this ingest does not read), ``undecodable`` (the batch did not
    decode: the ingest's decode errors less the ranks' malformed events), ``bad_replay_topic``.
    """
    worker = {"worker_id": status.worker_id}
    c = status.counters
    out: dict[str, list[Sample]] = {row[0]: [] for row in INSTRUMENTS}
    malformed = 0
    for rank_key, r in sorted(status.ranks.items(), key=lambda kv: int(kv[0])):
        labels = {"worker_id": status.worker_id, "dp_rank": rank_key}
        for name, fld, _u, _d in _PER_RANK:
            out[name].append((labels, float(r.sequence.get(fld, 0))))
        ev = r.events
        for kind in ("stored", "removed", "cleared"):
            out["kvmesh_ingest_events"].append(({**labels, "kind": kind}, float(ev.get(f"{kind}_events", 0))))
        for kind in ("stored", "removed"):
            out["kvmesh_ingest_blocks"].append(({**labels, "kind": kind}, float(ev.get(f"{kind}_blocks", 0))))
        for reason, fld in _REJECTED:
            out["kvmesh_ingest_rejected_events"].append(({**labels, "reason": reason}, float(ev.get(fld, 0))))
        malformed += ev.get("malformed_events", 0)
        out["kvmesh_ingest_epoch"].append((labels, float(r.epoch)))
        if r.last_seq is not None:
            out["kvmesh_ingest_engine_seq"].append((labels, float(r.last_seq)))
        out["kvmesh_ingest_replaying"].append((labels, 1.0 if r.replaying else 0.0))
        out["kvmesh_ingest_replay_duration_seconds"].append((labels, r.replay_seconds))
    dropped = (
        ("outbox", c.get("dropped_batches", 0)),
        ("bad_dp_rank", c.get("bad_dp_rank_batches", 0)),
        ("undecodable", max(0, c.get("decode_errors", 0) - malformed)),
        ("bad_replay_topic", c.get("bad_replay_topics", 0)),
    )
    out["kvmesh_ingest_dropped_batches"] = [({**worker, "reason": why}, float(n)) for why, n in dropped]
    for name, fld, _u, _d in _COUNTERS:
        out[name] = [(worker, float(c.get(fld, 0)))]
    out["kvmesh_ingest_nats_reconnects"] = [(worker, float(reconnects))]
    out["kvmesh_ingest_outbox_messages"] = [(worker, float(status.outbox))]
    return out


SLEEP_CLEARS = "kvmesh_ingest_engine_sleep_clears"
"""Counter: worker ranks cleared because the engine's metrics showed it asleep (`kvmesh.ingest.engine_sleep`)."""

SLEEP_INSTRUMENTS: tuple[Row, ...] = (
    (
        SLEEP_CLEARS,
        "counter",
        "{clear}",
        "ranks cleared because the engine's /metrics showed it asleep (its cache dropped, no AllBlocksCleared yet)",
    ),
)
"""The ingest's metrics of `kvmesh.ingest.engine_sleep` (observed only with ``--metrics-url``)."""


def sleep_samples(worker_id: str, clears: dict[int, int]) -> dict[str, list[Sample]]:
    """The values of `SLEEP_INSTRUMENTS`: ``clears`` is `SleepWatch.clears` (holder dp_rank → count)."""
    return {
        SLEEP_CLEARS: [
            ({"worker_id": worker_id, "dp_rank": str(r)}, float(n)) for r, n in sorted(clears.items())
        ]
    }
