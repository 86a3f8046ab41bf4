"""The router's ``$SRV.STATS`` data (what `kvmesh status` shows), sans I/O: the shell gathers, this shapes."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.core import load
from kvmesh.core.index import Holder
from kvmesh.core.protocol import (
    HolderStatus,
    LedgerStats,
    RouteLatency,
    RouteReceipts,
    RouterIndexStats,
    RouterStats,
)


@dataclass(slots=True)
class LatencyWindow:
    """The latencies of the last ``size`` answered routes (seconds); percentiles only when stats are asked."""

    size: int = 1024
    _seconds: deque[float] = field(default_factory=deque)

    def add(self, seconds: float) -> None:
        """Record one answered route."""
        self._seconds.append(seconds)
        if len(self._seconds) > self.size:
            self._seconds.popleft()

    def figures(self) -> RouteLatency | None:
        """p50 and p99 in milliseconds (nearest rank, rounded to the microsecond) over the window; None when
        empty."""
        if not self._seconds:
            return None
        ordered = sorted(self._seconds)

        def at(q: float) -> float:
            return round(1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

        return RouteLatency(routes=len(ordered), p50_ms=at(0.5), p99_ms=at(0.99))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaFigures:
    """The local replica's figures at one moment (``--index local``)."""

    stream: str
    applied_seq: int
    blocks: int
    read_messages: int
    decode_errors: int
    apply_errors: int
    recovery: dict[str, Any]
    lag_messages: int
    lag_s: float
    max_blocks: int | None = None
    evicted_blocks: int = 0


def index_stats(
    route_mode: str,
    degraded_reason: str | None,
    holders: tuple[dict[str, HolderStatus], int],
    *,
    route_subject: str,
    match_subject: str,
    replica: ReplicaFigures | None,
) -> RouterIndexStats:
    """Return the stats' ``index``: the route mode, the non-exact holders and their count
    (`kvmesh.router.health.holders_status`), and where the overlaps come from (``mode`` ``remote``: the
    indexers on ``match_subject``; ``local``: the replica's sequence, size, counters and lag, seconds
    rounded to the millisecond)."""
    listed, total = holders
    if replica is None:
        return RouterIndexStats(
            route_mode=route_mode,
            holders=listed,
            holders_not_exact=total,
            mode="remote",
            route_subject=route_subject,
            degraded_reason=degraded_reason,
            match_subject=match_subject,
        )
    return RouterIndexStats(
        route_mode=route_mode,
        holders=listed,
        holders_not_exact=total,
        mode="local",
        route_subject=route_subject,
        degraded_reason=degraded_reason,
        lag_messages=replica.lag_messages,
        lag_s=round(replica.lag_s, 3),
        stream=replica.stream,
        applied_seq=replica.applied_seq,
        blocks=replica.blocks,
        read_messages=replica.read_messages,
        decode_errors=replica.decode_errors,
        apply_errors=replica.apply_errors,
        recovery=replica.recovery,
        max_blocks=replica.max_blocks,
        evicted_blocks=None if replica.max_blocks is None else replica.evicted_blocks,
    )


def router_stats(
    *,
    routed: int,
    errors: Mapping[str, int],
    ledger: load.LedgerStats,
    engine_reports: int,
    modes: Mapping[str, int],
    candidates_cut: Mapping[str, int],
    index: RouterIndexStats,
    latency: LatencyWindow | None = None,
    sessions: int = 0,
    predicted_blocks: Mapping[str, int] | None = None,
) -> RouterStats:
    """Return the route endpoint's stats: replies, error replies per code, the shared ledger's counters and
    in-flight requests, engine reports held, replies per mode, candidates cut per model, ``index``, and the
    route receipts of the routes this replica answered (`route_receipts`), the latency of the last ones, the
    sessions known and the predicted entries held."""
    return RouterStats(
        routed=routed,
        errors=dict(errors),
        in_flight=ledger.active,
        ledger=LedgerStats(
            routed=ledger.routed,
            prefill_done=ledger.prefill_done,
            finished=ledger.finished,
            expired=ledger.expired,
            unknown=ledger.unknown,
        ),
        engine_reports=engine_reports,
        modes=dict(modes),
        candidates_cut=dict(candidates_cut),
        index=index,
        receipts=route_receipts(ledger.receipts),
        latency=None if latency is None else latency.figures(),
        sessions=sessions,
        predicted_blocks=dict(predicted_blocks or {}),
    )


def route_receipts(receipts: Mapping[Holder, load.Receipts]) -> dict[str, RouteReceipts]:
    """Return the receipts keyed ``"worker/rank"`` (sorted), as `RouterStats.receipts` carries them."""
    return {
        f"{h.worker_id}/{h.dp_rank}": RouteReceipts(
            requests=r.requests,
            available_tokens=r.available_tokens,
            captured_tokens=r.captured_tokens,
            regret_tokens=r.regret_tokens,
            delivered_requests=r.delivered_requests,
            delivered_tokens=r.delivered_tokens,
            misprediction_tokens=r.misprediction_tokens,
            unpredicted_tokens=r.unpredicted_tokens,
        )
        for h, r in sorted(receipts.items())
    }
