"""What the route endpoint records per route when the router serves metrics (a shell: it reads the clock).

The instruments are described in `kvmesh.router.metrics`; the endpoint checks one ``None`` when metrics are
off, so a route then pays two `time.perf_counter` calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvmesh.core.index import Holder
from kvmesh.router.metrics import Row, Sample
from kvmesh.runtime.metrics import ServiceMetrics

ROUTE_SECONDS = "kvmesh_router_route_seconds"
CANDIDATES_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Upper bounds of the candidates-per-route histogram (the default ``--max-candidates`` is 1,024)."""
ROUTE_INSTRUMENTS: tuple[Row, ...] = (
    (
        "kvmesh_router_busy_skips",
        "counter",
        "{candidate}",
        "candidates passed over because their engine reported them busy while another was free",
    ),
)
"""The observed metrics `RouteMetrics` declares."""

_STAGES = {stage: {"stage": stage} for stage in ("decode", "match", "decision", "total")}


class RouteMetrics:
    """What the route endpoint records per route (only when the router serves metrics).

    Args:
        metrics: the router's `ServiceMetrics` (its histograms are created here; ``kvmesh_router_busy_skips`` is
            observed from `busy_skips`).

    Cost per route, measured: see ``docs/benchmarks.md`` (route latency with metrics on and off).
    """

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._seconds = metrics.histogram(
            ROUTE_SECONDS, "route latency by stage: decode, match (hashing included), decision, total"
        )
        self._candidates = metrics.histogram(
            "kvmesh_router_route_candidates",
            "candidates scored per route",
            buckets=CANDIDATES_BUCKETS,
            unit="{candidate}",
        )
        self.busy_skips: dict[Holder, int] = {}
        """(worker, dp rank) → candidates passed over as busy."""
        metrics.observe(self.samples, ROUTE_INSTRUMENTS)

    def lap(self, stage: str, since: float) -> float:
        """Record a stage (``decode``, ``match``, ``decision`` or ``total``) that began at ``since``
        (`time.perf_counter` seconds); return the time now, where the next stage begins."""
        now = time.perf_counter()
        self._seconds.record(now - since, _STAGES[stage])
        return now

    def route(self, candidates: int, busy: Sequence[Holder]) -> None:
        """Record one decided route: the candidates it scored and those it skipped as busy."""
        self._candidates.record(candidates)
        for h in busy:
            self.busy_skips[h] = self.busy_skips.get(h, 0) + 1

    def samples(self) -> dict[str, list[Sample]]:
        """The values of `ROUTE_INSTRUMENTS`."""
        return {
            "kvmesh_router_busy_skips": [
                ({"worker_id": h.worker_id, "dp_rank": str(h.dp_rank)}, float(n))
                for h, n in sorted(self.busy_skips.items())
            ]
        }
