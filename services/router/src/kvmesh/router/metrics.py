"""The router's Prometheus metrics, from its ``$SRV.STATS`` data (sans I/O: no NATS, loop or clock).

`INSTRUMENTS` declares them (name, kind, unit, description: `kvmesh.runtime.metrics.ServiceMetrics.observe`
rows); `router_samples` gives their values from a `RouterStats`, the counters the route endpoint already keeps.
The local replica's metrics (``--index local``: ``kvmesh_router_replica_*``, applied sequence, lag, blocks
per worker and tier) are `kvmesh.runtime.metrics.replica_instruments`, shared with the indexer.
"""

from __future__ import annotations

from kvmesh.core.protocol import RouterStats

Row = tuple[str, str, str, str]
Sample = tuple[dict[str, str], float]

REPLICA_PREFIX = "kvmesh_router_replica"
"""Name prefix of the local replica's metrics."""

INSTRUMENTS: tuple[Row, ...] = (
    ("kvmesh_router_routes", "counter", "{request}", "route replies naming a worker, by mode"),
    ("kvmesh_router_errors", "counter", "{request}", "error replies, by code"),
    ("kvmesh_router_in_flight_requests", "gauge", "{request}", "requests counted as load now"),
    ("kvmesh_router_ledger_events", "counter", "{event}", "load ledger events, by kind"),
    ("kvmesh_router_engine_reports", "gauge", "{report}", "engine load reports held"),
    ("kvmesh_router_candidates_cut", "gauge", "{candidate}", "candidates cut from the last bounded route"),
    ("kvmesh_router_route_mode", "gauge", "1", "1 for the mode a route would get now"),
    ("kvmesh_router_holders_not_exact", "gauge", "{holder}", "holders stale or incomplete"),
)
"""Every observed router metric (besides the local replica's)."""

_MODES = ("exact", "degraded", "load_only")


def router_samples(stats: RouterStats) -> dict[str, list[Sample]]:
    """The values of `INSTRUMENTS` for one router's stats."""
    ledger = stats.ledger
    modes = {m: 0 for m in _MODES} | stats.modes
    return {
        "kvmesh_router_routes": [({"mode": m}, float(n)) for m, n in sorted(modes.items())],
        "kvmesh_router_errors": [({"code": c}, float(n)) for c, n in sorted(stats.errors.items())],
        "kvmesh_router_in_flight_requests": [({}, float(stats.in_flight))],
        "kvmesh_router_ledger_events": [
            ({"kind": "routed"}, float(ledger.routed)),
            ({"kind": "prefill_done"}, float(ledger.prefill_done)),
            ({"kind": "finished"}, float(ledger.finished)),
            ({"kind": "expired"}, float(ledger.expired)),
            ({"kind": "unknown"}, float(ledger.unknown)),
        ],
        "kvmesh_router_engine_reports": [({}, float(stats.engine_reports))],
        "kvmesh_router_candidates_cut": [
            ({"model": m}, float(n)) for m, n in sorted(stats.candidates_cut.items())
        ],
        "kvmesh_router_route_mode": [
            ({"mode": m}, 1.0 if stats.index.route_mode == m else 0.0) for m in _MODES
        ],
        "kvmesh_router_holders_not_exact": [({}, float(stats.index.holders_not_exact))],
    }
