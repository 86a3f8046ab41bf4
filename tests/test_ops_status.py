"""The pure parts of `kvmesh.ops` status: router summaries, replica lag, workers and snapshots, without NATS."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import msgspec
import pytest
from nats.micro.service import EndpointStats, ServiceStats

from kvmesh.core.errors import ProtocolError
from kvmesh.core.protocol import (
    HolderStatus,
    IndexerStatus,
    LedgerStats,
    RouterIndexStats,
    RouterStats,
    WorkerRecord,
    encode,
)
from kvmesh.ops import (
    STREAM_RECREATED,
    Convergence,
    RouterService,
    StatusReport,
    StreamState,
    Unreadable,
    age_s,
    convergence,
    decode_router_service,
    replica_status,
    router_status,
    snapshot_views,
    worker_views,
)
from kvmesh.runtime.snapshots import SnapshotEntry

LEDGER = LedgerStats(routed=5, prefill_done=1, finished=2, expired=0, unknown=0)


def local_index(applied_seq: int) -> RouterIndexStats:
    """A local-index router's index stats at ``applied_seq``."""
    return RouterIndexStats(
        route_mode="exact",
        holders={},
        holders_not_exact=0,
        mode="local",
        route_subject="kvmesh.route",
        lag_messages=0,
        lag_s=0.0,
        stream="KVMESH",
        applied_seq=applied_seq,
        blocks=40,
        read_messages=186,
        decode_errors=0,
        apply_errors=0,
        recovery={"snapshot_seq": None},
    )


def router_stats(index: RouterIndexStats, routed: int = 3) -> RouterStats:
    """A router's route endpoint data."""
    return RouterStats(
        routed=routed,
        errors={"no_workers": 1},
        in_flight=2,
        ledger=LEDGER,
        engine_reports=0,
        modes={"exact": routed},
        candidates_cut={},
        index=index,
    )


def micro_reply(data: Any, *, endpoint: str = "route") -> bytes:
    """A ``$SRV.STATS`` reply as nats.micro encodes it (its own dataclasses and json.dumps), with ``data``."""
    stats = ServiceStats(
        id="r1",
        name="kvmesh-router",
        version="0.2.0",
        started=datetime(2026, 12, 1, 12, 0, 0),
        endpoints=[
            EndpointStats(
                name=endpoint,
                subject="kvmesh.route",
                queue_group="kvmesh-router",
                num_requests=3,
                num_errors=0,
                processing_time=10,
                average_processing_time=3,
                data=data,
            )
        ],
    )
    return json.dumps(stats.to_dict()).encode()


def test_router_status_flags_a_replica_past_the_stream() -> None:
    """A local-index router whose applied sequence is past the stream's last one (the stream was deleted and
    created again) is flagged in `kvmesh status`, not shown with lag 0 as if it were current."""
    service = decode_router_service(micro_reply(msgspec.to_builtins(router_stats(local_index(186)))))
    assert msgspec.to_builtins(router_status(service, 200)) == {
        "route_mode": "exact",
        "holders": {},
        "holders_not_exact": 0,
        "mode": "local",
        "route_subject": "kvmesh.route",
        "lag_messages": 0,
        "lag_s": 0.0,
        "stream": "KVMESH",
        "applied_seq": 186,
        "blocks": 40,
        "read_messages": 186,
        "decode_errors": 0,
        "apply_errors": 0,
        "recovery": {"snapshot_seq": None},
        "id": "r1",
        "version": "0.2.0",
        "lag": 14,
        "routed": 3,
        "errors": {"no_workers": 1},
        "in_flight": 2,
    }
    flagged = router_status(service, 58)
    assert (flagged.lag, flagged.warning) == (0, STREAM_RECREATED)


def test_router_status_of_a_remote_index_has_no_lag() -> None:
    """A router asking the indexers shows its match subject and non-exact holders, and no lag or warning."""
    index = RouterIndexStats(
        route_mode="degraded",
        holders={"w0/0": HolderStatus(state="stale", reason="engine silent")},
        holders_not_exact=1,
        mode="remote",
        route_subject="kvmesh.route",
        degraded_reason="holder w0/0 is stale",
        match_subject="kvmesh.match",
    )
    service = RouterService(id="r2", version="0.2.0", stats=router_stats(index, routed=0))
    assert msgspec.to_builtins(router_status(service, 500)) == {
        "route_mode": "degraded",
        "holders": {"w0/0": {"state": "stale", "reason": "engine silent"}},
        "holders_not_exact": 1,
        "mode": "remote",
        "route_subject": "kvmesh.route",
        "degraded_reason": "holder w0/0 is stale",
        "match_subject": "kvmesh.match",
        "id": "r2",
        "version": "0.2.0",
        "routed": 0,
        "errors": {"no_workers": 1},
        "in_flight": 2,
    }


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (micro_reply(None), "router r1: its route endpoint carries no stats data"),
        (
            micro_reply({"routed": 1}, endpoint="other"),
            "router r1: its $SRV.STATS reply has no route endpoint",
        ),
        (b"[1, 2]", "bad MicroServiceStats: Expected `object`, got `array`"),
    ],
)
def test_a_router_stats_reply_without_usable_data_is_a_protocol_error(reply: bytes, message: str) -> None:
    """A stats reply with no route endpoint, no data, or not an object at all raises ProtocolError saying which."""
    with pytest.raises(ProtocolError) as info:
        decode_router_service(reply)
    assert str(info.value) == message


def test_router_stats_of_another_shape_name_the_field() -> None:
    """Route endpoint data that is not RouterStats raises ProtocolError naming the first field missing."""
    with pytest.raises(ProtocolError) as info:
        decode_router_service(micro_reply({"routed": 3, "index": {"mode": "local", "applied_seq": 186}}))
    assert info.value.field == "index.route_mode"


def indexer_status(applied_seq: int, workers: dict[str, dict[str, Any]] | None = None) -> IndexerStatus:
    """A replica's status reply at ``applied_seq``."""
    return IndexerStatus(
        replica="a",
        stream="KVMESH",
        ready=True,
        applied_seq=applied_seq,
        blocks=32,
        digest="00000000000000ff",
        models={"m": [4]},
        counters={"messages": applied_seq},
        workers=workers or {},
        complete=True,
        incomplete=[],
        holder_health={},
        reset_epoch=0,
        read_messages=applied_seq,
        resubscribes=0,
        stream_id="2026-12-01T12:00:00+00:00",
        rebuilds=0,
        recovery={},
        snapshots={"written": 0},
        snapshot_writer=False,
    )


def test_replica_status_adds_the_lag_and_warns_only_past_the_stream() -> None:
    """A replica's JSON in `kvmesh status` is its status reply plus ``lag``; ``warning`` appears only when its
    applied sequence is past the stream's last one."""
    reply = indexer_status(8)
    behind = msgspec.to_builtins(replica_status(reply, 10))
    assert behind == {**msgspec.to_builtins(reply), "lag": 2}
    assert list(behind)[-1] == "lag"
    past = replica_status(reply, 5)
    assert (past.lag, past.warning) == (0, STREAM_RECREATED)


def test_worker_views_join_the_registry_and_the_replicas() -> None:
    """A registered worker shows its record and heartbeat age; one only the replicas index shows its model,
    ranks and highest epoch; a removed one is left out; ages are measured from the given clock."""
    now = 1_700_000_100.0
    record = WorkerRecord(
        worker_id="w0", model="m", dp_ranks=2, block_size=4, incarnation=3, heartbeat_ts=now - 2.5
    )
    seen = {
        "w0": {"model": "m", "epochs": {"0": 3}, "last_ts": now - 10.0, "removed": False},
        "w1": {"model": "m", "epochs": {"0": 1, "1": 2}, "last_ts": now - 20.0, "removed": False},
        "w2": {"model": "m", "epochs": {"0": 0}, "last_ts": now - 30.0, "removed": True},
    }
    views = worker_views({"w0": record}, [indexer_status(8, seen)], now)
    assert msgspec.to_builtins(views) == {
        "w0": {
            "registered": True,
            "model": "m",
            "dp_ranks": 2,
            "block_size": 4,
            "incarnation": 3,
            "heartbeat_age_s": 2.5,
            "last_event_ts": now - 10.0,
            "last_event_age_s": 10.0,
        },
        "w1": {
            "registered": False,
            "model": "m",
            "dp_ranks": 2,
            "block_size": None,
            "incarnation": 2,
            "heartbeat_age_s": None,
            "last_event_ts": now - 20.0,
            "last_event_age_s": 20.0,
        },
    }


def test_snapshot_views_and_ages_from_object_store_mtimes() -> None:
    """Snapshots keep the store's order; ages parse RFC 3339 with nanoseconds, and are None when unreadable."""
    now = datetime.fromisoformat("2026-12-01T12:00:10+00:00").timestamp()
    entries = [
        SnapshotEntry(name="seq-20", applied_seq=20, size_bytes=300, mtime="2026-12-01T12:00:07.123456789Z"),
        SnapshotEntry(name="seq-10", applied_seq=10, size_bytes=200, mtime=""),
    ]
    assert msgspec.to_builtins(snapshot_views(entries, now)) == [
        {"name": "seq-20", "seq": 20, "bytes": 300, "age_s": 2.877},
        {"name": "seq-10", "seq": 10, "bytes": 200, "age_s": None},
    ]
    assert age_s("not a time", now) is None
    assert age_s("2026-12-01T12:00:00Z", now) == 10.0


def test_a_status_report_prints_only_what_was_read() -> None:
    """An unreadable stream is its name and error alone, unreadable parts are their error, and the
    ``undecodable`` list appears only when a reply did not decode."""
    report = StatusReport(
        stream=StreamState(name="S", error="stream not found"),
        replicas=[],
        snapshots=Unreadable(error="timeout"),
        workers={},
        ingests=[],
        routers=[],
        convergence=convergence([], [], 0),
    )
    assert msgspec.to_builtins(report) == {
        "schema": 1,
        "stream": {"name": "S", "error": "stream not found"},
        "replicas": [],
        "snapshots": {"error": "timeout"},
        "workers": {},
        "ingests": [],
        "routers": [],
        "convergence": {
            "converged": False,
            "stream_last_seq": 0,
            "indexers": 0,
            "routers": 0,
            "digests": [],
            "behind": [],
        },
    }
    bad = msgspec.structs.replace(report, undecodable=["kvmesh.index.status: bad IndexerStatus"])
    assert json.loads(encode(bad))["undecodable"] == ["kvmesh.index.status: bad IndexerStatus"]


def test_convergence_needs_every_replica_at_the_last_sequence_with_one_digest() -> None:
    """Indexers at the stream's last sequence with equal digests and local routers at it converge; a lagging
    replica, a differing digest or no indexer at all does not, and remote routers are not counted."""
    a = replica_status(indexer_status(200), 200)
    b = replica_status(msgspec.structs.replace(indexer_status(200), replica="b"), 200)
    local = router_status(
        decode_router_service(micro_reply(msgspec.to_builtins(router_stats(local_index(200))))), 200
    )
    remote_index = RouterIndexStats(
        route_mode="exact", holders={}, holders_not_exact=0, mode="remote", route_subject="kvmesh.route"
    )
    remote = router_status(RouterService(id="r9", version="0.2.0", stats=router_stats(remote_index)), 200)
    assert convergence([a, b], [local, remote], 200) == Convergence(
        converged=True, stream_last_seq=200, indexers=2, routers=1, digests=["00000000000000ff"], behind=[]
    )
    late = router_status(
        decode_router_service(micro_reply(msgspec.to_builtins(router_stats(local_index(186))))), 200
    )
    other = replica_status(
        msgspec.structs.replace(indexer_status(200), replica="c", digest="0000000000000001"), 200
    )
    lagging = replica_status(msgspec.structs.replace(indexer_status(190), replica="d"), 200)
    got = convergence([a, other, lagging], [late], 200)
    assert (got.converged, got.digests, got.behind) == (
        False,
        ["0000000000000001", "00000000000000ff"],
        ["indexer d: lag 10", "router r1: lag 14"],
    )
    assert convergence([a, other], [], 200).converged is False
    assert convergence([], [local], 200).converged is False
