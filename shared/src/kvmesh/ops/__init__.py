"""The operator API: what ``kvmesh status``, ``snapshot``, ``replay``, ``reset`` and ``finish`` do, as async
functions that take an open nats-py connection and return typed results (frozen msgspec Structs, built from
`kvmesh.core.protocol`'s). The CLI only parses its flags, calls these and prints the result as JSON
(``msgspec.to_builtins``); scripts and dashboards call them directly::

    nc = await kvmesh.runtime.nats.connect(url, name="my-tool", wait_s=3.0)
    report = await kvmesh.ops.status(nc, stream="KVMESH_EVENTS")
    lagging = [r.replica for r in report.replicas if r.lag > 100]

=========================  =============================================  ===========================================
function                   result                                         raises
=========================  =============================================  ===========================================
`status`                   `StatusReport`: `StreamState`, replicas        `TransportError` (requests not published);
                           (`ReplicaStatus`), `SnapshotView`s,            unreadable parts are reported in the result
                           `WorkerView`s, ingests (`IngestStatus`),
                           routers (`RouterSummary`)
`snapshot`                 the replicas' `SnapshotResult`s                `TransportError` (no indexer subscribed)
`replay`                   `ReplayResult` (size, digest, times)           `StreamUnavailableError`, `TransportError`,
                                                                          `SnapshotNotFoundError` (no such snapshot)
`reset`                    `ResetResult` (epoch, sequence, replicas)      `StreamUnavailableError`, `TransportError`
`finish`                   None                                           `UnavailableError`, `TransportError`
=========================  =============================================  ===========================================

The pure parts of the status (`router_status`, `replica_status`, `worker_views`, `snapshot_views`) take
decoded replies and a clock reading and need no NATS. nats-py's errors never leave these functions raw: they
are caught by class and raised as `kvmesh.core.errors`' `TransportError` subtree.
"""

from kvmesh.ops.index import (
    ReplayResult,
    ReplicaReset,
    ResetResult,
    events_prefix,
    replay,
    reset,
    snapshot,
)
from kvmesh.ops.provision import ProvisionResult, Resource, provision
from kvmesh.ops.replies import Gathered, gather, gather_replies, gather_status
from kvmesh.ops.report import (
    STREAM_NOT_FOUND,
    STREAM_RECREATED,
    Convergence,
    ReplicaStatus,
    RouterService,
    RouterSummary,
    SnapshotView,
    StatusReport,
    StreamState,
    Unreadable,
    WorkerView,
    age_s,
    convergence,
    decode_router_service,
    replica_status,
    router_status,
    snapshot_views,
    status,
    worker_views,
)
from kvmesh.ops.requests import finish
from kvmesh.runtime.snapshots import DEFAULT_STREAM_MAX_AGE_S, DEFAULT_STREAM_MAX_BYTES

__all__ = [
    "DEFAULT_STREAM_MAX_AGE_S",
    "DEFAULT_STREAM_MAX_BYTES",
    "STREAM_NOT_FOUND",
    "STREAM_RECREATED",
    "Convergence",
    "Gathered",
    "ProvisionResult",
    "ReplayResult",
    "ReplicaReset",
    "ReplicaStatus",
    "ResetResult",
    "Resource",
    "RouterService",
    "RouterSummary",
    "SnapshotView",
    "StatusReport",
    "StreamState",
    "Unreadable",
    "WorkerView",
    "age_s",
    "convergence",
    "decode_router_service",
    "events_prefix",
    "finish",
    "gather",
    "gather_replies",
    "gather_status",
    "provision",
    "replay",
    "replica_status",
    "reset",
    "router_status",
    "snapshot",
    "snapshot_views",
    "status",
    "worker_views",
]
