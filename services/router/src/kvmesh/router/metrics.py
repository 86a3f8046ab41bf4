"""The router's Prometheus metrics, from its ``$SRV.STATS`` data (no NATS or event loop).

`INSTRUMENTS` declares them (name, kind, unit, description: `kvmesh.runtime.metrics.ServiceMetrics.observe`
rows); `router_samples` gives their values from a `RouterStats`, the counters the route endpoint already keeps.
The local replica's metrics (``--index local``: ``kvmesh_router_replica_*``, applied sequence, lag, blocks
per worker and tier) are `kvmesh.runtime.metrics.replica_instruments`, shared with the indexer.

Route receipts (`RouterStats.receipts`, the routes this replica answered), per ``worker_id`` and ``dp_rank``,
as token counters (the exporter adds ``_total``): ``kvmesh_router_available_tokens``, ``…_captured_tokens``,
``…_regret_tokens`` (available − captured), ``…_delivered_tokens`` (the engines' counts reported with
``Router.finish(..., cached_tokens=...)``), ``…_misprediction_tokens`` (captured beyond delivered, over the
requests with a delivered count), ``…_unpredicted_tokens`` (delivered beyond captured), and the requests:
``kvmesh_router_chosen_requests`` (routes answered with the worker) and ``kvmesh_router_delivered_requests``.
A hit ratio is a ratio of two of these counters' rates, never a mean of ratios.

What is recorded per route when metrics are on (`kvmesh.router.route_metrics.RouteMetrics`, a shell: it
reads the clock): the latency histogram ``kvmesh_router_route_seconds`` by ``stage`` (``decode``: parsing the
request; ``match``: the index's answer, prompt hashing included, since the index hashes lazily while it
matches, or the indexers' round trip with ``--index remote``; ``decision``: candidates, costs and the reply;
``total``: from the request's arrival to its reply being sent), ``kvmesh_router_route_candidates`` (candidates
scored per route) and ``kvmesh_router_busy_skips`` (per ``worker_id``, ``dp_rank``: candidates passed over
because their engine reported them busy while another was free).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.core.protocol import RouterStats

if TYPE_CHECKING:
    pass

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
    ("kvmesh_router_sessions", "gauge", "{session}", "sessions this replica knows (session affinity)"),
    (
        "kvmesh_router_predicted_blocks",
        "gauge",
        "{block}",
        "predicted entries held, by kind: ttl (--predicted-ttl-s), no_events (workers without KV events)",
    ),
    ("kvmesh_router_chosen_requests", "counter", "{request}", "routes answered with this worker"),
    (
        "kvmesh_router_available_tokens",
        "counter",
        "{token}",
        "most prompt tokens any live candidate had cached, summed over the routes answered with this worker",
    ),
    (
        "kvmesh_router_captured_tokens",
        "counter",
        "{token}",
        "prompt tokens cached on the chosen worker as the index saw them, summed over its routes",
    ),
    (
        "kvmesh_router_regret_tokens",
        "counter",
        "{token}",
        "available minus captured tokens: reuse given up by the choice",
    ),
    (
        "kvmesh_router_delivered_requests",
        "counter",
        "{request}",
        "routed requests finished with the engine's count of cached prompt tokens",
    ),
    (
        "kvmesh_router_delivered_tokens",
        "counter",
        "{token}",
        "cached prompt tokens the engine reported for those requests",
    ),
    (
        "kvmesh_router_misprediction_tokens",
        "counter",
        "{token}",
        "captured tokens the engine did not deliver, over the requests with a delivered count",
    ),
    (
        "kvmesh_router_unpredicted_tokens",
        "counter",
        "{token}",
        "delivered tokens beyond the captured ones, over the requests with a delivered count",
    ),
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
        "kvmesh_router_sessions": [({}, float(stats.sessions))],
        "kvmesh_router_predicted_blocks": [
            ({"kind": k}, float(n)) for k, n in sorted(stats.predicted_blocks.items())
        ],
        **receipt_samples(stats),
    }


_RECEIPTS: tuple[tuple[str, str], ...] = (
    ("kvmesh_router_chosen_requests", "requests"),
    ("kvmesh_router_available_tokens", "available_tokens"),
    ("kvmesh_router_captured_tokens", "captured_tokens"),
    ("kvmesh_router_regret_tokens", "regret_tokens"),
    ("kvmesh_router_delivered_requests", "delivered_requests"),
    ("kvmesh_router_delivered_tokens", "delivered_tokens"),
    ("kvmesh_router_misprediction_tokens", "misprediction_tokens"),
    ("kvmesh_router_unpredicted_tokens", "unpredicted_tokens"),
)


def receipt_samples(stats: RouterStats) -> dict[str, list[Sample]]:
    """The route receipts' counters per ``worker_id`` and ``dp_rank`` (from ``"worker/rank"`` keys)."""
    out: dict[str, list[Sample]] = {name: [] for name, _ in _RECEIPTS}
    for key, r in stats.receipts.items():
        worker, _, rank = key.rpartition("/")
        labels = {"worker_id": worker, "dp_rank": rank}
        for name, field in _RECEIPTS:
            out[name].append((labels, float(getattr(r, field))))
    return out
