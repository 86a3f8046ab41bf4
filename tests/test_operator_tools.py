"""Operator tools with a real NATS server: `kvmesh snapshot`, `kvmesh replay`, `kvmesh reset`, `kvmesh status`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from tests.indexers import MODEL, Group, group, wait_for

from kvmesh.cli import replay_command, reset_command, snapshot_command, status_command
from kvmesh.core.protocol import WorkerRecord
from kvmesh.runtime import subjects
from kvmesh.runtime.registry import RegistrySettings, heartbeat, open_registry
from kvmesh.runtime.snapshots import SnapshotStore, snapshot_name

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def _run(
    command: Callable[[Sequence[str]], int], g: Group, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, Any]:
    """Run a CLI command against the group's stream in a thread; return its exit code and parsed JSON output."""
    capsys.readouterr()
    code = await asyncio.to_thread(command, ["--nats-url", g.url, "--stream", g.stream, *args])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


async def _seqs(*replicas: Any) -> tuple[int, ...]:
    return tuple(r.state.applied_seq for r in replicas)


async def test_snapshot_command_has_the_lease_holder_write_at_its_applied_sequence(
    nats_url: str, uid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvmesh snapshot` makes the lease holder (only) write a snapshot at the sequence it applied and prints it."""
    async with group(nats_url, uid) as g:
        a = await g.start(f"{uid}-a")
        b = await g.start(f"{uid}-b")
        await g.publish(30)
        await wait_for(lambda: _seqs(a, b), lambda s: s == (30, 30))
        holder = await wait_for(
            lambda: asyncio.sleep(0, [r.replica for r in (a, b) if r.status()["snapshot_writer"]]),
            lambda h: len(h) == 1,
        )
        code, out = await _run(snapshot_command, g, capsys)
        assert code == 0
        store = await SnapshotStore.open(g.js, subjects.snapshot_bucket(g.stream))
        data = await store.get(snapshot_name(30))
        assert (
            out["written"],
            out["replica"],
            out["stream"],
            out["name"],
            out["applied_seq"],
            out["bytes"],
        ) == (
            True,
            holder[0],
            g.stream,
            snapshot_name(30),
            30,
            len(data),
        )
        assert [e.applied_seq for e in await store.list()] == [30]
        assert a.snapshots["written"] + b.snapshots["written"] == 1


async def test_snapshot_command_fails_clearly_without_replicas(
    nats_url: str, uid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no replica of the stream running, `kvmesh snapshot` prints nothing on stdout and exits 1."""
    async with group(nats_url, uid) as g:
        code, out = await _run(snapshot_command, g, capsys, "--timeout-s", "1")
        assert (code, out) == (1, None)


async def test_replay_command_rebuilds_the_replicas_state_from_the_stream_or_a_snapshot(
    nats_url: str, uid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvmesh replay` reproduces a replica's digest and size from the stream alone, from the latest snapshot or a named one, and up to a chosen sequence."""
    async with group(nats_url, uid) as g:
        a = await g.start(f"{uid}-a")
        await g.publish(50)
        await wait_for(lambda: _seqs(a), lambda s: s == (50,))
        assert (await a.snapshot())["applied_seq"] == 50
        await g.publish(20)
        await wait_for(lambda: _seqs(a), lambda s: s == (70,))
        digest = f"{a.state.digest():016x}"

        code, out = await _run(replay_command, g, capsys)
        assert code == 0
        assert {k: out[k] for k in ("snapshot", "start_seq", "applied_seq", "blocks", "messages_read")} == {
            "snapshot": None,
            "start_seq": 1,
            "applied_seq": 70,
            "blocks": 280,
            "messages_read": 70,
        }
        assert (out["digest"], out["complete"], out["gap"]) == (digest, True, None)
        assert out["seconds"] >= out["replay_s"] >= 0

        code, out = await _run(replay_command, g, capsys, "--from-snapshot", "latest")
        assert code == 0
        assert (
            out["snapshot_seq"],
            out["start_seq"],
            out["messages_read"],
            out["blocks"],
            out["digest"],
        ) == (
            50,
            51,
            20,
            280,
            digest,
        )

        code, out = await _run(replay_command, g, capsys, "--from-snapshot", "50", "--to-seq", "60")
        assert code == 0
        assert (out["snapshot_seq"], out["applied_seq"], out["messages_read"], out["blocks"]) == (
            50,
            60,
            10,
            240,
        )

        code, out = await _run(replay_command, g, capsys, "--from-snapshot", "49")
        assert (code, out) == (1, None)


async def test_replay_command_without_covering_snapshot_reports_the_gap(
    nats_url: str, uid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """After a purge that no snapshot covers, `kvmesh replay` says which messages are gone and which workers are incomplete."""
    async with group(nats_url, uid) as g:
        await g.publish(20, workers=2)
        await g.js.purge_stream(g.stream, seq=11)
        code, out = await _run(replay_command, g, capsys, "--from-snapshot", "latest")
        assert code == 0
        assert (out["complete"], out["gap"], out["incomplete"], out["messages_read"], out["applied_seq"]) == (
            False,
            [1, 10],
            ["w0/0", "w1/0"],
            10,
            20,
        )


async def test_reset_is_followed_by_running_replicas_and_by_restores_at_one_sequence(
    nats_url: str, uid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvmesh reset` puts one IndexReset into the stream: running replicas empty their index there, keep following, and a replica restored from an older snapshot ends equal."""
    async with group(nats_url, uid) as g:
        a = await g.start(f"{uid}-a")
        b = await g.start(f"{uid}-b")
        await g.publish(40)
        await wait_for(lambda: _seqs(a, b), lambda s: s == (40, 40))
        assert a.state.block_total() == 160
        assert (await a.snapshot())["applied_seq"] == 40

        code, out = await _run(reset_command, g, capsys, "--yes", "--reason", "test")
        assert code == 0
        assert (out["reset_epoch"], out["seq"], out["duplicate"]) == (1, 41, False)
        assert out["replicas"] == {
            r: {"applied": True, "applied_seq": 41, "reset_epoch": 1, "blocks": 0}
            for r in (f"{uid}-a", f"{uid}-b")
        }
        assert a.state.models() == b.state.models() == {}

        await g.publish(10)
        await wait_for(lambda: _seqs(a, b), lambda s: s == (51, 51))
        assert a.state.block_total() == b.state.block_total() == 20  # chains from before the reset are held
        assert a.state.digest() == b.state.digest()

        c = await g.start(f"{uid}-c")
        assert (c.recovery["snapshot_seq"], c.recovery["read_to_ready"]) == (40, 11)
        assert (c.state.reset_epoch, c.state.digest()) == (1, a.state.digest())

        code, out = await _run(reset_command, g, capsys, "--yes")
        assert (code, out["reset_epoch"], out["seq"]) == (0, 2, 52)


async def test_reset_needs_yes(nats_url: str, uid: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --yes, `kvmesh reset` refuses (usage error) and publishes nothing."""
    async with group(nats_url, uid) as g:
        with pytest.raises(SystemExit) as exc:
            await _run(reset_command, g, capsys)
        assert exc.value.code == 2
        assert (await g.js.stream_info(g.stream)).state.messages == 0


async def test_status_shows_snapshots_and_workers_with_last_event_and_incarnation(
    nats_url: str, uid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvmesh status` lists each snapshot (sequence, size, age) and each worker (model, dp ranks, block size, incarnation, heartbeat and last event time)."""
    async with group(nats_url, uid) as g:
        kv = await open_registry(
            g.js, RegistrySettings(bucket=subjects.registry_bucket(g.stream), ttl_s=60.0, memory=True)
        )
        beat = time.time()
        await heartbeat(
            kv,
            WorkerRecord(
                worker_id="w0", model=MODEL, dp_ranks=2, block_size=4, incarnation=3, heartbeat_ts=beat
            ),
        )
        a = await g.start(f"{uid}-a", worker_ttl_s=60.0)
        await g.publish(8, workers=2, ts=1_700_000_000.5)
        await wait_for(lambda: _seqs(a), lambda s: s == (8,))
        written = await a.snapshot()

        code, out = await _run(status_command, g, capsys, "--json")
        assert code == 0
        assert {k: out["stream"][k] for k in ("messages", "first_seq", "last_seq")} == {
            "messages": 8,
            "first_seq": 1,
            "last_seq": 8,
        }
        assert [(r["replica"], r["applied_seq"], r["lag"], r["blocks"]) for r in out["replicas"]] == [
            (f"{uid}-a", 8, 0, 32)
        ]
        [snap] = out["snapshots"]
        assert (snap["name"], snap["seq"], snap["bytes"]) == (snapshot_name(8), 8, written["bytes"])
        assert 0 <= snap["age_s"] < 30
        w0, w1 = out["workers"]["w0"], out["workers"]["w1"]
        assert 0 <= w0.pop("heartbeat_age_s") < 30
        assert w0.pop("last_event_age_s") > 0
        assert w0 == {
            "registered": True,
            "model": MODEL,
            "dp_ranks": 2,
            "block_size": 4,
            "incarnation": 3,
            "last_event_ts": 1_700_000_000.5,
        }
        w1.pop("last_event_age_s")
        assert w1 == {
            "registered": False,
            "model": MODEL,
            "dp_ranks": 1,
            "block_size": None,
            "incarnation": 0,
            "heartbeat_age_s": None,
            "last_event_ts": 1_700_000_000.5,
        }


def test_recovery_bench_runs_small_and_checks_its_restores(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvmesh.bench.recovery.main` on a small index reports every figure and equal digests after restore and replay."""
    from kvmesh.bench.recovery import main

    assert main(["--blocks", "20000", "--workers", "4", "--replay-messages", "500", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["indexed_blocks"], r["replay_messages"], r["replay_blocks"]) == (20_000, 500, 8_000)
    assert r["restored_digest_equal"] is r["replay_complete"] is r["replay_digest_equal"] is True
    assert r["snapshot_bytes"] > 20_000 * 16
    assert min(r["restore_s"], r["replay_blocks_per_s"], r["export_ms"]) > 0
