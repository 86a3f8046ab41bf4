"""The ingest's counters and its answer on ``kvmesh.status.ingest`` (what `kvmesh status` shows)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvmesh.core.protocol import EngineStatus, IngestRankStatus, IngestStatus

if TYPE_CHECKING:
    from kvmesh.core.liveness import EngineLiveness
    from kvmesh.ingest.batches import Rank
    from kvmesh.ingest.config import IngestSettings


NO_KV_EVENTS = "none (no KV events)"
"""The endpoint a rank's status gives when the engine publishes no KV events (``kvmesh ingest --no-kv-events``)."""


@dataclass(slots=True)
class IngestCounters:
    """Counters of one ingest (cumulative), shown by `kvmesh status`."""

    batches: int = 0
    published: int = 0
    publish_retries: int = 0
    decode_errors: int = 0
    rejected_events: int = 0
    dropped_batches: int = 0
    split_batches: int = 0
    bad_dp_rank_batches: int = 0
    """Engine batches whose dp_rank is not one this ingest reads (`IngestSettings.local_ranks`): their events are
    rejected."""
    reorders: int = 0
    """Holders found stored out of engine order in the stream (acks not rising)."""
    reordered_resends: int = 0
    """Messages deleted from the stream and sent again after an earlier one that failed (engine order kept)."""
    bad_replay_topics: int = 0
    """Replay replies whose topic is not the configured one (another engine's), ignored."""
    undecodable_stream_messages: int = 0
    """Messages on this worker's subjects that did not decode at start (skipped by cursor recovery)."""


def engine_status(live: EngineLiveness | None) -> EngineStatus:
    """A rank's engine liveness: state (live, stale, gone or unprobed), why, probes sent."""
    if live is None:
        return EngineStatus(state="unprobed", reason="", probes=0)
    return EngineStatus(state=live.state, reason=live.reason, probes=live.probes)


def ingest_status(
    settings: IngestSettings,
    counters: IngestCounters,
    outbox: int,
    ranks: dict[int, Rank],
    engines: dict[int, EngineLiveness],
) -> IngestStatus:
    """The status reply: worker, model, messages not yet acknowledged (``outbox``), counters, and per rank
    its endpoint, cursor (epoch, last_seq), replaying, block size, sequence and event counters, engine.

    An ingest without KV events (``--no-kv-events``) reads no rank: each of its ranks reads `NO_KV_EVENTS` as
    its endpoint, no cursor, the configured block size, no counters, and its engine's liveness."""
    if not settings.kv_events:
        per_rank = {
            str(r): IngestRankStatus(
                endpoint=NO_KV_EVENTS,
                epoch=0,
                last_seq=None,
                replaying=False,
                block_size=settings.block_size,
                sequence={},
                events={},
                engine=engine_status(engines.get(r)),
            )
            for r in settings.local_ranks()
        }
    else:
        per_rank = {
            str(r.rank): IngestRankStatus(
                endpoint=r.endpoint,
                epoch=r.tracker.epoch,
                last_seq=r.tracker.last_seq,
                replaying=r.tracker.replaying,
                block_size=r.normalizer.block_size,
                sequence=asdict(r.tracker.stats),
                events=asdict(r.normalizer.stats),
                engine=engine_status(engines.get(r.rank)),
                replay_seconds=round(r.replay_seconds, 6),
            )
            for r in ranks.values()
        }
    return IngestStatus(
        worker_id=settings.worker_id,
        model=settings.model,
        outbox=outbox,
        counters=asdict(counters),
        ranks=per_rank,
        kv_events=settings.kv_events,
    )
