"""Prometheus metrics: each service's endpoint, scraped during an end-to-end run, moves by exactly what the test
caused; the pure mappings give exact samples; with metrics off no port is opened."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.test_ingest_faults import ANY, BS, T, U, blk, stored
from tests.test_layering import io_imports

from kvmesh.client import Router
from kvmesh.core import protocol
from kvmesh.core.protocol import (
    EngineStatus,
    IngestRankStatus,
    IngestStatus,
    LedgerStats,
    MatchRequest,
    RouterIndexStats,
    RouterStats,
)
from kvmesh.core.state import IndexState
from kvmesh.harness.procs import ChildProcesses
from kvmesh.indexer.metrics import IndexerFigures, indexer_samples
from kvmesh.ingest.metrics import INSTRUMENTS as INGEST_INSTRUMENTS
from kvmesh.ingest.metrics import ingest_samples
from kvmesh.router.metrics import router_samples
from kvmesh.runtime.metrics import ReplicaView, ServiceMetrics, parse_exposition, replica_samples
from kvmesh.runtime.nats import StreamSettings, connect, ensure_stream
from kvmesh.sim.publisher import EventPublisher

ROOT = Path(__file__).resolve().parent.parent
MODEL = "m"
W = "w"
_LISTENING = re.compile(r"metrics on http://[^:]+:(\d+)/metrics")


# ---------------------------------------------------------------------- pure mappings


def _ingest_status() -> IngestStatus:
    seq = {"delivered": 7, "gaps": 1, "missing_batches": 2, "replays": 1, "replayed_batches": 2}
    seq |= {"healed": 0, "resyncs": 0, "restarts": 0, "duplicates": 3}
    events = {"stored_events": 5, "stored_blocks": 9, "removed_events": 1, "removed_blocks": 2}
    events |= {"cleared_events": 0, "skipped_non_full": 0, "rejected_alignment": 0, "rejected_block_size": 1}
    events |= {"rejected_tokens": 0, "unknown_events": 0, "malformed_events": 1, "malformed_stored": 1}
    return IngestStatus(
        worker_id=W,
        model=MODEL,
        outbox=4,
        counters={"published": 6, "decode_errors": 3, "dropped_batches": 2, "bad_dp_rank_batches": 1},
        ranks={
            "0": IngestRankStatus(
                endpoint="tcp://e:1",
                epoch=2,
                last_seq=41,
                replaying=False,
                block_size=BS,
                sequence=seq,
                events=events,
                engine=EngineStatus(state="live", reason="", probes=0),
            )
        },
    )


def test_ingest_samples_map_the_status_counters_exactly() -> None:
    """Per rank and per worker, each metric is the status counter it names; undecodable batches are the
    decode errors less the ranks' malformed events."""
    got = ingest_samples(_ingest_status(), reconnects=5)
    rank = {"worker_id": W, "dp_rank": "0"}
    assert set(got) == {row[0] for row in INGEST_INSTRUMENTS}
    assert got["kvmesh_ingest_batches"] == [(rank, 7.0)]
    assert got["kvmesh_ingest_gaps"] == [(rank, 1.0)]
    assert got["kvmesh_ingest_replays"] == [(rank, 1.0)]
    assert got["kvmesh_ingest_duplicate_batches"] == [(rank, 3.0)]
    assert got["kvmesh_ingest_events"] == [
        ({**rank, "kind": "stored"}, 5.0),
        ({**rank, "kind": "removed"}, 1.0),
        ({**rank, "kind": "cleared"}, 0.0),
    ]
    assert got["kvmesh_ingest_rejected_events"] == [
        ({**rank, "reason": "block_size"}, 1.0),
        ({**rank, "reason": "alignment"}, 0.0),
        ({**rank, "reason": "tokens"}, 0.0),
        ({**rank, "reason": "malformed"}, 1.0),
        ({**rank, "reason": "unknown_type"}, 0.0),
    ]
    assert got["kvmesh_ingest_dropped_batches"] == [
        ({"worker_id": W, "reason": "outbox"}, 2.0),
        ({"worker_id": W, "reason": "bad_dp_rank"}, 1.0),
        ({"worker_id": W, "reason": "undecodable"}, 2.0),
        ({"worker_id": W, "reason": "bad_replay_topic"}, 0.0),
    ]
    assert got["kvmesh_ingest_published"] == [({"worker_id": W}, 6.0)]
    assert got["kvmesh_ingest_nats_reconnects"] == [({"worker_id": W}, 5.0)]
    assert got["kvmesh_ingest_outbox_messages"] == [({"worker_id": W}, 4.0)]
    assert got["kvmesh_ingest_epoch"] == [(rank, 2.0)]
    assert got["kvmesh_ingest_engine_seq"] == [(rank, 41.0)]


def test_indexer_samples_report_the_last_snapshot_written() -> None:
    """Snapshot size and phase durations come from the last write; age only once this replica wrote one."""
    last = {"written": True, "bytes": 1234, "stall_ms": 2.0, "encode_ms": 30.0, "store_ms": 500.0}
    figures = IndexerFigures(
        replica="i",
        ready=True,
        snapshot_writer=True,
        snapshots={"written": 3, "last": last},
        snapshot_age_s=12.5,
        pending_messages=17,
        removals_published=2,
    )
    got = indexer_samples(figures)
    r = {"replica": "i"}
    assert got["kvmesh_indexer_snapshots_written"] == [(r, 3.0)]
    assert got["kvmesh_indexer_snapshot_size_bytes"] == [(r, 1234.0)]
    assert got["kvmesh_indexer_snapshot_age_seconds"] == [(r, 12.5)]
    assert got["kvmesh_indexer_snapshot_duration_seconds"] == [
        ({**r, "phase": "stall"}, 0.002),
        ({**r, "phase": "encode"}, 0.03),
        ({**r, "phase": "store"}, 0.5),
    ]
    assert got["kvmesh_indexer_snapshot_pending_messages"] == [(r, 17.0)]
    none = indexer_samples(
        IndexerFigures(
            replica="i",
            ready=False,
            snapshot_writer=False,
            snapshots={"written": 0, "last": None},
            snapshot_age_s=None,
            pending_messages=0,
            removals_published=0,
        )
    )
    assert none["kvmesh_indexer_snapshot_age_seconds"] == []
    assert none["kvmesh_indexer_snapshot_size_bytes"] == []
    assert none["kvmesh_indexer_ready"] == [(r, 0.0)]


def test_router_samples_map_the_stats() -> None:
    """Routes per mode (every mode present), errors per code, the ledger's events and the route mode now."""
    stats = RouterStats(
        routed=5,
        errors={"bad_request": 2},
        in_flight=1,
        ledger=LedgerStats(routed=5, prefill_done=1, finished=3, expired=0, unknown=1),
        engine_reports=2,
        modes={"exact": 4, "degraded": 1},
        candidates_cut={},
        index=RouterIndexStats(
            route_mode="degraded", holders={}, holders_not_exact=1, mode="remote", route_subject="r"
        ),
    )
    got = router_samples(stats)
    assert got["kvmesh_router_routes"] == [
        ({"mode": "degraded"}, 1.0),
        ({"mode": "exact"}, 4.0),
        ({"mode": "load_only"}, 0.0),
    ]
    assert got["kvmesh_router_errors"] == [({"code": "bad_request"}, 2.0)]
    assert got["kvmesh_router_ledger_events"][2] == ({"kind": "finished"}, 3.0)
    assert got["kvmesh_router_route_mode"] == [
        ({"mode": "exact"}, 0.0),
        ({"mode": "degraded"}, 1.0),
        ({"mode": "load_only"}, 0.0),
    ]


def test_replica_samples_count_blocks_per_worker_rank_and_tier() -> None:
    """An empty replica reports its sequence and lag, and no block sample."""
    view = ReplicaView(
        state=IndexState(),
        stream_last_seq=9,
        lag_messages=9,
        lag_s=1.5,
        read_messages=0,
        decode_errors=0,
        apply_errors=0,
        rebuilds=0,
        resubscribes=0,
    )
    got = replica_samples("kvmesh_indexer", view, {"replica": "i"})
    assert got["kvmesh_indexer_applied_seq"] == [({"replica": "i"}, 0.0)]
    assert got["kvmesh_indexer_lag_messages"] == [({"replica": "i"}, 9.0)]
    assert got["kvmesh_indexer_lag_seconds"] == [({"replica": "i"}, 1.5)]
    assert got["kvmesh_indexer_blocks"] == []
    assert got["kvmesh_indexer_held_orphans"] == [({"replica": "i"}, 0.0)]


def test_the_mapping_modules_import_no_io_event_loop_or_clock() -> None:
    """The ingest's, the indexer's and the router's metrics modules import neither nats, asyncio, time,
    logging nor the runtime."""
    for service in ("ingest", "indexer", "router"):
        path = ROOT / "services" / service / "src" / "kvmesh" / service / "metrics.py"
        assert io_imports(path) == [], service


@pytest.mark.anyio
async def test_the_exposition_names_counters_total_and_keeps_unit_suffixes() -> None:
    """A counter is exported as ``<name>_total``, a gauge in seconds and a histogram keep their names; one
    scrape reads the service's state once."""
    metrics = ServiceMetrics("ingest")
    reads: list[int] = []

    def read() -> dict[str, list[tuple[dict[str, str], float]]]:
        reads.append(1)
        return {"kvmesh_x_gaps": [({"worker_id": W}, 2.0)], "kvmesh_x_lag_seconds": [({}, 0.25)]}

    metrics.observe(
        read, [("kvmesh_x_gaps", "counter", "{gap}", "g"), ("kvmesh_x_lag_seconds", "gauge", "s", "l")]
    )
    metrics.histogram("kvmesh_x_latency_seconds", "h").record(0.003, {"worker_id": W})
    port = await metrics.serve(0, "127.0.0.1")
    try:
        text = await asyncio.to_thread(_get, port)
    finally:
        await metrics.aclose()
    values = parse_exposition(text)
    assert values['kvmesh_x_gaps_total{worker_id="w"}'] == 2.0
    assert values["kvmesh_x_lag_seconds"] == 0.25
    assert values['kvmesh_x_latency_seconds_bucket{le="0.005",worker_id="w"}'] == 1.0
    assert values['kvmesh_x_latency_seconds_bucket{le="0.0025",worker_id="w"}'] == 0.0
    assert len(reads) == 1


# ---------------------------------------------------------------------- end to end, real processes


def _get(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body: bytes = resp.read()
    return body.decode()


async def _scrape(port: int) -> dict[str, float]:
    return parse_exposition(await asyncio.to_thread(_get, port))


def _port_of(log: Path, procs: ChildProcesses, timeout_s: float = 30.0) -> int:
    """The metrics port a child logged (it was started with ``--metrics-port 0``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = _LISTENING.search(log.read_text(errors="replace")) if log.exists() else None
        if found:
            return int(found.group(1))
        procs.check()
        time.sleep(0.1)
    raise AssertionError(f"{log.name}: no metrics port logged")


async def _until(port: int, key: str, want: float, timeout_s: float = 20.0) -> dict[str, float]:
    """Scrape until ``key`` reads ``want``; return that scrape."""
    deadline = time.monotonic() + timeout_s
    got: dict[str, float] = {}
    while time.monotonic() < deadline:
        got = await _scrape(port)
        if got.get(key) == want:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"{key} = {got.get(key)}, wanted {want}")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ChildProcesses]:
    children = ChildProcesses(tmp_path)
    try:
        yield children
    finally:
        children.stop()


def _shared(nats_url: str, uid: str) -> list[str]:
    return ["--nats-url", nats_url, "--stream", f"KVMESH_M_{uid}", "--events-prefix", f"m{uid}.events"]


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.e2e
@pytest.mark.slow
async def test_counters_move_by_exactly_what_the_run_caused(
    nats_url: str, uid: str, procs: ChildProcesses, tmp_path: Path
) -> None:
    """Scraped during a run: 3 batches raise published by 3; a dropped engine batch raises gaps and replays by
    one each (and published by the 2 batches it and the next one make); an event of another block size
    raises rejected{block_size} by one; the indexer's and the router's applied sequence equal the stream's
    last; one match and one route each count once."""
    shared = _shared(nats_url, uid)
    match_subject, route_subject = f"m{uid}.match", f"m{uid}.route"
    pub = EventPublisher(ANY, ANY)
    try:
        procs.spawn(
            "indexer", "-m", "kvmesh.indexer", *shared, "--replica-id", "idx", "--match-subject", match_subject,
            "--buckets-memory", "--metrics-port", "0", "--registry-bucket", f"M_{uid}_W",
        )  # fmt: skip
        procs.spawn(
            "ingest", "-m", "kvmesh.ingest", *shared, "--worker-id", W, "--model", MODEL, "--block-size", str(BS),
            "--zmq-endpoint", pub.endpoint, "--replay-endpoint", str(pub.replay_endpoint), "--stream-memory", "--stream-max-bytes", str(64 * 2**20),
            "--max-coalesced-batches", "1", "--registry-bucket", f"M_{uid}_W", "--metrics-port", "0",
        )  # fmt: skip
        ingest = _port_of(tmp_path / "ingest.log", procs)
        indexer = _port_of(tmp_path / "indexer.log", procs)
        procs.spawn(
            "router", "-m", "kvmesh.router", *shared, "--route-subject", route_subject,
            "--registry-bucket", f"M_{uid}_W", "--metrics-port", "0",
        )  # fmt: skip
        router = _port_of(tmp_path / "router.log", procs)
        await pub.wait_for_subscribers(1, timeout_s=20.0)
        key = 'kvmesh_ingest_published_total{worker_id="w"}'
        base = await _until(ingest, key, 1.0)  # the rank's announcement
        for i in range(3):
            pub.publish([stored([10 + i], blk(T, i), parent=(10 + i - 1) if i else None)])
        got = await _until(ingest, key, base[key] + 3)
        assert got['kvmesh_ingest_batches_total{dp_rank="0",worker_id="w"}'] == 3.0
        assert got['kvmesh_ingest_events_total{dp_rank="0",kind="stored",worker_id="w"}'] == 3.0
        gaps, replays = (f'kvmesh_ingest_{n}_total{{dp_rank="0",worker_id="w"}}' for n in ("gaps", "replays"))
        assert (got[gaps], got[replays]) == (0.0, 0.0)
        pub.drop_next(1)
        pub.publish([stored([20], blk(U, 0))])  # dropped: a gap the next batch reveals
        pub.publish([stored([21], blk(U, 1), parent=20)])
        after_gap = await _until(ingest, key, got[key] + 2)
        assert (after_gap[gaps], after_gap[replays]) == (1.0, 1.0)
        took = 'kvmesh_ingest_replay_duration_seconds_total{dp_rank="0",worker_id="w"}'
        assert got[took] == 0.0
        assert 0.0 < after_gap[took] < 10.0  # the one replay's time, within the replay timeout
        assert after_gap['kvmesh_ingest_resyncs_total{dp_rank="0",worker_id="w"}'] == 0.0
        rejected = 'kvmesh_ingest_rejected_events_total{dp_rank="0",reason="block_size",worker_id="w"}'
        assert after_gap[rejected] == 0.0
        pub.publish([stored([30], list(range(500, 508)), block_size=2 * BS)])
        after_reject = await _until(ingest, rejected, 1.0)
        assert after_reject['kvmesh_ingest_engine_seq{dp_rank="0",worker_id="w"}'] == 5.0  # seqs 0-5
        nc = await connect(nats_url, name="test-metrics")
        try:
            js = nc.jetstream()
            await _until(ingest, key, after_gap[key] + 1)
            last = int((await js.stream_info(f"KVMESH_M_{uid}")).state.last_seq)
            idx = await _until(indexer, 'kvmesh_indexer_applied_seq{replica="idx"}', float(last))
            assert idx['kvmesh_indexer_blocks{dp_rank="0",replica="idx",tier="gpu",worker_id="w"}'] == 5.0
            assert idx['kvmesh_indexer_ready{replica="idx"}'] == 1.0
            await _until(indexer, 'kvmesh_indexer_lag_messages{replica="idx"}', 0.0)
            await _until(router, "kvmesh_router_replica_applied_seq", float(last))
            request = MatchRequest(model=MODEL, token_ids=list(T))
            await nc.request(match_subject, protocol.encode(request, format="msgpack"), timeout=5)
            matched = await _scrape(indexer)
            assert matched['kvmesh_indexer_match_latency_seconds_count{outcome="ok"}'] == 1.0
        finally:
            await nc.close()
        async with await Router.connect(nats_url, subject=route_subject) as client:
            reply = await client.route(MODEL, list(T))
        assert reply.worker_id == W
        routed = await _until(router, 'kvmesh_router_routes_total{mode="exact"}', 1.0)
        assert routed['kvmesh_router_replica_blocks{dp_rank="0",tier="gpu",worker_id="w"}'] == 5.0
    finally:
        pub.close()


def _listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on (Linux: its socket inodes matched against /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_metrics_off_opens_no_port(
    nats_url: str, uid: str, procs: ChildProcesses, tmp_path: Path
) -> None:
    """An indexer started without --metrics-port listens on no TCP port and logs no metrics endpoint."""
    proc: subprocess.Popen[Any] = procs.spawn(
        "indexer", "-m", "kvmesh.indexer", *_shared(nats_url, uid), "--replica-id", "off", "--buckets-memory",
        "--registry-bucket", f"M_{uid}_W",
    )  # fmt: skip
    nc = await connect(nats_url, name="test-metrics-off")
    try:
        await ensure_stream(
            nc.jetstream(),
            StreamSettings(
                name=f"KVMESH_M_{uid}", prefix=f"m{uid}.events", memory=True, max_bytes=64 * 2**20
            ),
        )
    finally:
        await nc.close()
    log = tmp_path / "indexer.log"
    deadline = time.monotonic() + 30
    while "ready at stream seq" not in (log.read_text(errors="replace") if log.exists() else ""):
        procs.check()
        assert time.monotonic() < deadline, "indexer not ready"
        await asyncio.sleep(0.1)
    assert _listening_ports(proc.pid) == set()
    assert "metrics on" not in log.read_text()
