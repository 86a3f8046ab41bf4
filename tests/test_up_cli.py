"""`kvmesh up`: checks a given server first, keeps to a namespace of its own there, stops promptly."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg

from kvmesh.core import protocol
from kvmesh.core.protocol import RouteReply

KVMESH = str(Path(sys.executable).parent / "kvmesh")


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_up_with_an_unreachable_server_fails_before_starting_anything() -> None:
    """A KVMESH_NATS_URL nothing listens on: up names the URL and its source, starts nothing, exits 1."""
    port = free_port()
    env = dict(os.environ, KVMESH_NATS_URL=f"nats://alice:pw-9x@127.0.0.1:{port}")
    t0 = time.monotonic()
    proc = subprocess.run(
        [KVMESH, "up", "--requests", "2", "--workers", "1"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc
    assert time.monotonic() - t0 < 15
    assert (
        f"using the NATS server at nats://***@127.0.0.1:{port} (from KVMESH_NATS_URL in the environment)"
        in proc.stdout
    )
    assert "started" not in proc.stdout
    assert proc.stderr.strip() == (
        f"kvmesh up: cannot connect to NATS at nats://***@127.0.0.1:{port}: connection refused: nothing "
        f"listens on 127.0.0.1:{port} (gave up after 5 s)"
    )
    assert "pw-9x" not in proc.stdout + proc.stderr


@pytest.mark.nats
@pytest.mark.e2e
@pytest.mark.anyio
async def test_up_on_a_shared_server_ignores_another_router_and_cleans_up(nats_url: str) -> None:
    """On a shared server another fleet's router on kvmesh.route gets no request; up's stream and buckets go."""
    nc = await nats.connect(nats_url)
    decoy_hits = 0

    async def decoy(msg: Msg) -> None:
        nonlocal decoy_hits
        decoy_hits += 1
        reply = RouteReply(
            request_id=None, worker_id="decoy", dp_rank=0, overlap_blocks=0, cached_tokens=0, block_size=16,
            index_seq=0, mode="exact",
        )  # fmt: skip
        await msg.respond(protocol.encode(reply))

    sub = await nc.subscribe("kvmesh.route", queue="kvmesh-router", cb=decoy)
    try:
        proc = await asyncio.create_subprocess_exec(
            KVMESH, "up", "--nats-url", nats_url, "--requests", "6", "--workers", "2", "--num-blocks", "4096",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 100)
        text = out.decode()
        assert proc.returncode == 0, text + err.decode()
        assert "replayed 6 requests" in text and "(0 failed)" in text
        assert decoy_hits == 0
        receipts = [ln for ln in text.splitlines() if ln.startswith("route receipts, ")]
        assert [ln.split(":")[0] for ln in receipts] == [
            "route receipts, kvmesh",
            "route receipts, round-robin",
        ]
        for ln in receipts:  # token counts, each figure of the line read back
            assert re.fullmatch(
                r"route receipts, [a-z-]+: available [\d,]+ tokens, captured [\d,]+ \([\d.]+ % of available; "
                r"regret -?[\d,]+\), delivered [\d,]+ \([\d.]+ % of [\d,]+ prompt tokens\)",
                ln,
            ), ln
        run_stream = next(w for w in text.split() if w.startswith("KVMESH_UP_"))
        assert f"removed this run's stream {run_stream}" in text
        names = [str(info.config.name) for info in await nc.jetstream().streams_info()]
        assert [n for n in names if "KVMESH_UP_" in n] == []
    finally:
        await sub.unsubscribe()
        await nc.close()


@pytest.mark.e2e
def test_sigterm_stops_up_promptly() -> None:
    """SIGTERM during the replay stops every process within a few seconds, exit 143, no traceback."""
    proc = subprocess.Popen(
        [KVMESH, "up", "--workers", "1", "--num-blocks", "4096"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("replaying") or not line:
            break
    assert lines[-1].startswith("replaying"), "".join(lines) + proc.stderr.read()
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode == 143, out + err
    assert "interrupted; stopping every process" in out
    assert "Traceback" not in out + err
    assert took < 5, took


def test_a_failed_run_shows_each_childs_last_errors(tmp_path: Path) -> None:
    """What a failed `kvmesh up` prints before its temporary logs go: the last ERROR lines of each child's
    log (JSON or text), at most three per child, named by the log file."""
    from kvmesh.up import last_errors

    (tmp_path / "ingest-1.log").write_text(
        "\n".join(
            [
                '{"level": "INFO", "msg": "ready"}',
                *(f'{{"level": "ERROR", "msg": "engine stale {i}"}}' for i in range(5)),
            ]
        )
        + "\n"
    )
    (tmp_path / "router.log").write_text("2026-12-02 10:00:00 ERROR kvmesh.router: no stream\nplain line\n")
    (tmp_path / "sim.log").write_text('{"level": "WARNING", "msg": "slow"}\n')
    assert last_errors(tmp_path) == [
        "ingest-1: engine stale 2",
        "ingest-1: engine stale 3",
        "ingest-1: engine stale 4",
        "router: 2026-12-02 10:00:00 ERROR kvmesh.router: no stream",
    ]


@pytest.mark.e2e
def test_http_port_0_prints_the_address_the_router_serves() -> None:
    """``--http-port 0`` used to print ``http://127.0.0.1:0``; now the printed address answers ``/health``."""
    import json
    import urllib.request

    proc = subprocess.Popen(
        [KVMESH, "up", "--workers", "1", "--num-blocks", "4096", "--http-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    try:
        lines: list[str] = []
        while not lines or not (lines[-1].startswith("RFC #1403 indexer API") or not lines[-1]):
            lines.append(proc.stdout.readline())
        found = re.match(r"RFC #1403 indexer API: (http://127\.0\.0\.1:(\d+)) ", lines[-1])
        assert found is not None and int(found.group(2)) > 0, "".join(lines) + proc.stderr.read()
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(found.group(1) + "/health", timeout=2) as resp:
                    assert (resp.status, json.loads(resp.read())["status"]) == (200, "ok")
                    break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
