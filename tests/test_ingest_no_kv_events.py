"""`kvmesh ingest --no-kv-events`: an engine without KV events, registered with heartbeats only.

Against the session's real nats-server: the ingest (in-process, and as a `python -m kvmesh.ingest` process)
registers the exact record (``kv_events`` false, block size, KV capacity, model, ranks), keeps heartbeating,
publishes nothing on the events stream's subjects, stays live through silence, still probes ``--health-url``
(stale, then gone and out of the registry, then back) and publishes the ``--metrics-url`` load, answers status
(``kvmesh status`` shows it), and leaves the registry on a clean stop; without a block size or a capacity it
does not start (exit 2, the reason named).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tests.pipeline import eventually
from tests.test_engine_sleep import ASLEEP, AWAKE, MetricsPage

from kvmesh.core import protocol
from kvmesh.core.errors import ConfigError
from kvmesh.core.protocol import EngineStatus, IngestRankStatus, IngestStatus, WorkerLoad, WorkerRecord
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.service import IngestService
from kvmesh.ingest.status import NO_KV_EVENTS
from kvmesh.ops import status as ops_status
from kvmesh.ops.view import render_status
from kvmesh.runtime import subjects
from kvmesh.runtime.config import load
from kvmesh.runtime.nats import StreamSettings, connect, ensure_stream
from kvmesh.runtime.registry import RegistrySettings, key_present, list_workers, open_registry

MODEL = "m-noev"
BS = 16
CAPACITY = 1000
MISSING_BOTH = (
    "--no-kv-events needs --block-size and --kv-capacity-blocks (missing: --block-size, --kv-capacity-blocks): "
    "routers hash prompts by the block size and bound the worker's predicted cache by its capacity"
)


def _settings(**kw: Any) -> IngestSettings:
    base: dict[str, Any] = {"worker_id": "w", "model": MODEL, "kv_events": False}
    return IngestSettings(**(base | kw))


# ------------------------------------------------------------------------------------------ settings


def test_without_kv_events_the_block_size_and_the_capacity_are_required() -> None:
    """Each missing one is named in one problem saying why; with both there is no problem."""
    assert _settings().validate() == [MISSING_BOTH]
    assert _settings(block_size=BS).validate() == [
        MISSING_BOTH.replace("--block-size, --kv-capacity-blocks", "--kv-capacity-blocks")
    ]
    assert _settings(kv_capacity_blocks=CAPACITY).validate() == [
        MISSING_BOTH.replace("--block-size, --kv-capacity-blocks", "--block-size")
    ]
    assert _settings(block_size=BS, kv_capacity_blocks=CAPACITY).validate() == []
    # with events the two stay optional, as before
    assert _settings(kv_events=True).validate() == []


def test_without_kv_events_the_engine_sockets_and_a_pool_are_refused() -> None:
    """A replay or snapshot endpoint has nothing to read, a shared pool nothing to report; the event
    endpoint (its default is always set) is not checked."""
    ok = {"block_size": BS, "kv_capacity_blocks": CAPACITY}
    assert _settings(**ok, replay_endpoint="tcp://h:5558", snapshot_endpoint="tcp://h:5559").validate() == [
        "--replay-endpoint with --no-kv-events: the engine publishes no KV events to read; drop it",
        "--snapshot-endpoint with --no-kv-events: the engine publishes no KV events to read; drop it",
    ]
    assert _settings(**ok, backend_of=["a"]).validate() == [
        "--backend-of with --no-kv-events: a shared pool without KV events reports nothing"
    ]
    assert _settings(**ok, zmq_endpoint="not-an-endpoint").validate() == []


def test_kv_events_is_read_from_the_environment_and_the_toml_file(tmp_path: Path) -> None:
    """``KVMESH_INGEST_KV_EVENTS=false`` and ``kv_events = false`` turn it off, like every boolean setting;
    the default is on; a missing capacity is a `ConfigError` naming it."""
    base = {"KVMESH_INGEST_WORKER_ID": "w", "KVMESH_INGEST_MODEL": MODEL, "KVMESH_INGEST_BLOCK_SIZE": "16"}
    env = base | {"KVMESH_INGEST_KV_EVENTS": "false", "KVMESH_INGEST_KV_CAPACITY_BLOCKS": "1000"}
    assert load(IngestSettings, service="ingest", environ=env).kv_events is False
    assert load(IngestSettings, service="ingest", environ=base).kv_events is True
    toml = tmp_path / "ingest.toml"
    toml.write_text("[ingest]\nkv_events = false\nkv_capacity_blocks = 1000\n")
    assert load(IngestSettings, service="ingest", environ=base, config_file=toml).kv_events is False
    with pytest.raises(ConfigError) as info:
        load(IngestSettings, service="ingest", environ=base | {"KVMESH_INGEST_KV_EVENTS": "false"})
    assert info.value.problems == [
        MISSING_BOTH.replace("--block-size, --kv-capacity-blocks", "--kv-capacity-blocks")
    ]


def test_the_command_without_a_block_size_exits_2_saying_why() -> None:
    """`python -m kvmesh.ingest --no-kv-events` with a capacity and no block size: exit 2, one problem."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.ingest", "--no-kv-events", "--worker-id", "w", "--model", MODEL,
         "--kv-capacity-blocks", "1000", "--nats-url", "nats://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        "python -m kvmesh.ingest: error: invalid configuration:\n  "
        + MISSING_BOTH.replace("--block-size, --kv-capacity-blocks", "--block-size")
        + "\n"
    )


def test_the_node_records_of_a_worker_without_kv_events_merge_into_one_without() -> None:
    """The two node records of an ingest per node (`Registration.record`) merge into one whole-worker record
    with ``kv_events`` false, the block size and the smallest capacity; one node with events does not make
    the worker one with events."""
    from kvmesh.ingest.registration import Registration
    from kvmesh.runtime.registry import merge_records

    def node(start: int, capacity: int, *, kv_events: bool = False) -> WorkerRecord:
        s = _settings(
            block_size=BS,
            kv_capacity_blocks=capacity,
            data_parallel_size=4,
            data_parallel_start_rank=start,
            data_parallel_size_local=2,
            kv_events=kv_events,
        )
        return Registration(s, {}, lambda _why: None).record(incarnation=0, now=100.0 + start)

    merged = merge_records([node(0, 900), node(2, 800)])
    assert merged == WorkerRecord(
        worker_id="w",
        model=MODEL,
        dp_ranks=4,
        block_size=BS,
        incarnation=0,
        heartbeat_ts=100.0,
        kv_capacity_blocks=800,
        kv_events=False,
    )
    assert merge_records([node(0, 900, kv_events=True), node(2, 800)]).kv_events is False
    assert merge_records([node(0, 900, kv_events=True), node(2, 800, kv_events=True)]).kv_events is True


# ------------------------------------------------------------------------------------------ with NATS


class Fleet:
    """A memory events stream created up front (so its count can be read), a core subscription on every
    events subject, and the registry bucket; all deleted at the end."""

    def __init__(self, nats_url: str, uid: str) -> None:
        self.nats_url = nats_url
        self.stream = f"KVMESH_NOEV_{uid}"
        self.prefix = f"noev{uid}.events"
        self.worker = f"w-noev-{uid}"
        self.seen: list[str] = []
        self.nc: Any = None
        self.js: Any = None
        self.kv: Any = None

    def settings(self, **kw: Any) -> IngestSettings:
        base: dict[str, Any] = {
            "worker_id": self.worker,
            "model": MODEL,
            "kv_events": False,
            "block_size": BS,
            "kv_capacity_blocks": CAPACITY,
            "nats_url": self.nats_url,
            "stream": self.stream,
            "events_prefix": self.prefix,
            "stream_memory": True,
            "worker_ttl_s": 0.6,  # a heartbeat every 0.2 s
        }
        return IngestSettings(**(base | kw))

    def args(self) -> list[str]:
        """The same settings as command-line flags."""
        return [
            "--no-kv-events", "--worker-id", self.worker, "--model", MODEL, "--block-size", str(BS),
            "--kv-capacity-blocks", str(CAPACITY), "--nats-url", self.nats_url, "--stream", self.stream,
            "--events-prefix", self.prefix, "--stream-memory", "--worker-ttl-s", "0.6",
        ]  # fmt: skip

    async def messages(self) -> int:
        """Messages in the events stream."""
        return int((await self.js.stream_info(self.stream)).state.messages)

    async def record(self) -> WorkerRecord | None:
        return (await list_workers(self.kv)).get(self.worker)

    async def present(self) -> bool:
        return bool(await key_present(self.kv, self.worker))


@contextlib.asynccontextmanager
async def fleet(nats_url: str, uid: str) -> AsyncIterator[Fleet]:
    f = Fleet(nats_url, uid)
    f.nc = await connect(nats_url, name="test-no-kv-events")
    f.js = f.nc.jetstream()
    bucket = subjects.registry_bucket(f.stream)
    try:
        await ensure_stream(
            f.js, StreamSettings(name=f.stream, prefix=f.prefix, memory=True, max_bytes=16 * 2**20)
        )

        async def seen(msg: Any) -> None:
            f.seen.append(msg.subject)

        await f.nc.subscribe(f"{f.prefix}.>", cb=seen)
        f.kv = await open_registry(f.js, RegistrySettings(bucket=bucket, ttl_s=0.6, memory=True))
        yield f
    finally:
        for op in (f.js.delete_stream(f.stream), f.js.delete_key_value(bucket)):
            with contextlib.suppress(Exception):
                await op
        await f.nc.close()


async def _ingest_status(f: Fleet) -> IngestStatus:
    """The ingest's status reply, asked on the status subject as `kvmesh status` asks it."""
    inbox = f.nc.new_inbox()
    sub = await f.nc.subscribe(inbox)
    try:
        await f.nc.publish(f"{subjects.STATUS_SUBJECT}.ingest", b"", reply=inbox)
        while True:
            msg = await sub.next_msg(timeout=5)
            reply = protocol.decode(msg.data, IngestStatus)
            if reply.worker_id == f.worker:
                return reply
    finally:
        await sub.unsubscribe()


async def _value(v: Any) -> Any:
    return v


@pytest.mark.anyio
@pytest.mark.nats
async def test_registered_with_heartbeats_only_and_nothing_on_the_stream(nats_url: str, uid: str) -> None:
    """Two ranks, a context length, probing on without a health URL: the exact record; heartbeats go on (the
    record's time rises); silence far past the probe bound leaves every rank live; status says no KV events;
    no message reaches the stream or its subjects; a clean stop deletes the key within the stop's time."""
    async with fleet(nats_url, uid) as f:
        svc = IngestService(
            f.settings(
                data_parallel_size=2, context_length=4096, engine_probe_after_s=0.2, engine_probe_every_s=0.2
            )
        )
        task = asyncio.create_task(svc.run())
        try:
            await asyncio.wait_for(svc.ready.wait(), 10)
            first = await eventually(f.record, lambda r: r is not None, timeout_s=10)
            assert first is not None
            assert first == WorkerRecord(
                worker_id=f.worker,
                model=MODEL,
                dp_ranks=2,
                block_size=BS,
                incarnation=0,
                heartbeat_ts=first.heartbeat_ts,
                stale_ranks={},
                dp_rank_start=0,
                dp_ranks_local=None,
                context_length=4096,
                kv_capacity_blocks=CAPACITY,
                kv_events=False,
            )
            later = await eventually(
                f.record, lambda r: r is not None and r.heartbeat_ts >= first.heartbeat_ts + 1.0, timeout_s=10
            )
            assert later is not None
            assert later.stale_ranks == {}  # 1 s of silence, five times the probe bound
            assert later == msgspec.structs.replace(first, heartbeat_ts=later.heartbeat_ts)

            reply = await _ingest_status(f)
            unprobed = EngineStatus(state="unprobed", reason="", probes=0)
            rank = IngestRankStatus(
                endpoint=NO_KV_EVENTS,
                epoch=0,
                last_seq=None,
                replaying=False,
                block_size=BS,
                sequence={},
                events={},
                engine=unprobed,
            )
            assert reply.ranks == {"0": rank, "1": rank}
            assert (reply.model, reply.outbox, reply.counters["published"], reply.kv_events) == (
                MODEL,
                0,
                0,
                False,
            )
            text = render_status(await ops_status(f.nc, stream=f.stream))
            assert [line.split()[:4] for line in text.splitlines() if f.worker in line] == [
                [f.worker, MODEL, "2", "16"],  # the workers table: model, ranks, block size
                [f.worker, "0", "unprobed,", "no"],  # the ingests table: rank 0's engine
            ]
            assert "unprobed, no KV events" in text

            assert await f.messages() == 0
            assert f.seen == []
        finally:
            svc.stop()
            await asyncio.wait_for(task, 10)
        assert await f.present() is False  # deregistered by the clean stop, not left to expire
        await f.nc.flush()
        assert (await f.messages(), f.seen) == (0, [])


@pytest.mark.anyio
@pytest.mark.nats
async def test_liveness_still_probes_the_health_url_and_load_still_flows(nats_url: str, uid: str) -> None:
    """With ``--health-url`` the silent engine is probed: live while the page answers, stale (in the record)
    once it does not. ``--metrics-url`` publishes the page's load; a page showing the engine asleep clears
    nothing (the stream stays empty)."""
    page = MetricsPage(AWAKE)
    await page.start()
    try:
        async with fleet(nats_url, uid) as f:
            loads: list[WorkerLoad] = []

            async def on_load(msg: Any) -> None:
                loads.append(protocol.decode(msg.data, WorkerLoad))

            await f.nc.subscribe(subjects.load_subject(subjects.LOAD_PREFIX, f.worker), cb=on_load)
            svc = IngestService(
                f.settings(
                    health_url=page.url,
                    metrics_url=page.url,
                    engine_probe_after_s=0.2,
                    engine_probe_every_s=0.2,
                    engine_probe_timeout_s=0.5,
                    engine_remove_after_s=0,
                )
            )
            task = asyncio.create_task(svc.run())
            try:
                await asyncio.wait_for(svc.ready.wait(), 10)
                await eventually(lambda: _value(len(loads)), lambda n: n >= 1, timeout_s=10)
                assert loads[0] == WorkerLoad(
                    worker_id=f.worker,
                    dp_rank=0,
                    running=0,
                    waiting=0,
                    kv_usage=0.0,
                    prefix_hit_rate=96 / 268,
                )
                probed = await eventually(
                    lambda: _ingest_status(f), lambda s: s.ranks["0"].engine.probes >= 3, timeout_s=10
                )
                assert probed.ranks["0"].engine.state == "live"
                record = await f.record()
                assert record is not None and record.stale_ranks == {}

                page.text = ASLEEP
                await page.scraped(3)
                assert svc.sleep_watch.clears == {}

                await page.close()  # the engine stops answering
                stale = await eventually(
                    f.record, lambda r: r is not None and r.stale_ranks != {}, timeout_s=10
                )
                assert stale is not None
                assert list(stale.stale_ranks) == [0]
                unanswered = (
                    rf"engine silent for [0-9.]+ s and 2 probe\(s\) unanswered \({re.escape(page.url)}: .+\)"
                )
                assert re.fullmatch(unanswered, stale.stale_ranks[0]), stale.stale_ranks
                assert (stale.kv_events, stale.block_size, stale.kv_capacity_blocks) == (False, BS, CAPACITY)
                assert (await _ingest_status(f)).ranks["0"].engine.state == "stale"
                assert (await f.messages(), f.seen) == (0, [])
            finally:
                svc.stop()
                await asyncio.wait_for(task, 10)
            assert await f.present() is False
    finally:
        await page.close()


@pytest.mark.anyio
@pytest.mark.nats
async def test_an_engine_gone_leaves_the_registry_and_rejoins_when_it_answers(
    nats_url: str, uid: str
) -> None:
    """Unanswered ``--health-url`` probes past ``--engine-remove-after-s``: the worker leaves the registry; the
    page answering again on the same port brings the record back as it was, stale ranks empty."""
    page = MetricsPage(AWAKE)
    await page.start()
    port = int(page.url.split(":")[2].split("/")[0])
    back = MetricsPage(AWAKE)
    try:
        async with fleet(nats_url, uid) as f:
            svc = IngestService(
                f.settings(
                    health_url=page.url,
                    engine_probe_after_s=0.2,
                    engine_probe_every_s=0.2,
                    engine_probe_timeout_s=0.5,
                    engine_remove_after_s=0.5,
                )
            )
            task = asyncio.create_task(svc.run())
            try:
                await asyncio.wait_for(svc.ready.wait(), 10)
                first = await eventually(f.record, lambda r: r is not None, timeout_s=10)
                assert first is not None and first.stale_ranks == {}
                await page.close()
                await eventually(f.present, lambda present: present is False, timeout_s=15)
                assert (await _ingest_status(f)).ranks["0"].engine.state == "gone"
                back._server = await asyncio.start_server(back._serve, "127.0.0.1", port)
                again = await eventually(f.record, lambda r: r is not None, timeout_s=15)
                assert again is not None
                assert again == msgspec.structs.replace(first, heartbeat_ts=again.heartbeat_ts)
                assert (await _ingest_status(f)).ranks["0"].engine.state == "live"
                assert (await f.messages(), f.seen) == (0, [])
            finally:
                svc.stop()
                await asyncio.wait_for(task, 10)
    finally:
        await page.close()
        await back.close()


@pytest.mark.anyio
@pytest.mark.nats
async def test_the_process_registers_and_stops_cleanly_on_sigterm(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    """`python -m kvmesh.ingest --no-kv-events` as a process: its record, a fresh health file, nothing on the
    stream; SIGTERM ends it with status 0, its key deleted, no error logged."""
    async with fleet(nats_url, uid) as f:
        health = tmp_path / "health.json"
        log = (tmp_path / "ingest.log").open("w")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvmesh.ingest", *f.args(), "--health-file", str(health), "--log-format", "json",
            stdout=log, stderr=log,
        )  # fmt: skip
        try:
            record = await eventually(f.record, lambda r: r is not None, timeout_s=30)
            assert record is not None
            assert (record.kv_events, record.block_size, record.kv_capacity_blocks) == (False, BS, CAPACITY)
            assert (record.model, record.dp_ranks, record.stale_ranks) == (MODEL, 1, {})
            await eventually(lambda: _value(health.exists()), bool, timeout_s=15)
            from kvmesh.cli import main

            assert main(["health", "--file", str(health)]) == 0
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 20) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            log.close()
        assert await f.present() is False
        assert (await f.messages(), f.seen) == (0, [])
        lines = (tmp_path / "ingest.log").read_text().splitlines()
        assert [line for line in lines if '"level": "ERROR"' in line or "Traceback" in line] == []
        assert any("no KV events: registered with heartbeats only" in line for line in lines)
