"""`kvmesh provision` (the index group's JetStream resources, made ahead of least-privilege services) and
`kvmesh health` / ``--health-file`` (what a container health check runs), with a real nats-server and a real
router process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest

from kvmesh.cli import health_command, provision_command
from kvmesh.runtime import subjects
from kvmesh.runtime.health import Health, check_health

pytestmark = [pytest.mark.anyio]


def _provision(capsys: pytest.CaptureFixture[str], url: str, *args: str) -> tuple[int, Any, str]:
    capsys.readouterr()
    code = provision_command(["--nats-url", url, *args])
    out = capsys.readouterr()
    return code, json.loads(out.out) if out.out.strip() else None, out.err


def _resources(out: Any) -> list[tuple[str, str, int, bool]]:
    return [(r["name"], r["kind"], r["replicas"], r["created"]) for r in out["resources"]]


@pytest.mark.nats
async def test_provision_creates_the_stream_and_buckets_once_and_reports_them(
    nats_url: str, uid: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A first run creates the stream and the three buckets with the services' settings; a second changes
    nothing and says so; asking another replica count of existing resources is exit 1, each one named."""
    stream = f"PROV_{uid}".upper()
    args = [
        "--stream",
        stream,
        "--events-prefix",
        f"prov.{uid}",
        "--memory",
        "--stream-max-bytes",
        str(64 * 2**20),
        "--worker-ttl-s",
        "9",
    ]
    code, out, err = await asyncio.to_thread(_provision, capsys, nats_url, *args)
    assert (code, err) == (0, "")
    names = [stream, f"{stream}_WORKERS", f"{stream}_LEASE", f"{stream}_SNAPSHOTS"]
    assert _resources(out) == [
        (names[0], "stream", 1, True),
        (names[1], "kv", 1, True),
        (names[2], "kv", 1, True),
        (names[3], "object_store", 1, True),
    ]
    assert (out["stream"], out["replicas"], out["mismatched"]) == (stream, 1, [])
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        assert (info.config.subjects, info.config.allow_direct) == ([f"prov.{uid}.>"], True)
        registry = await js.stream_info(f"KV_{subjects.registry_bucket(stream)}")
        assert registry.config.max_age == 9.0
        lease = await js.stream_info(f"KV_{subjects.lease_bucket(stream)}")
        assert lease.config.max_age == 30.0

        code, out, err = await asyncio.to_thread(_provision, capsys, nats_url, *args)
        assert (code, err) == (0, "")
        assert [r[3] for r in _resources(out)] == [False, False, False, False]

        code, out, err = await asyncio.to_thread(_provision, capsys, nats_url, *args, "--replicas", "3")
        assert code == 1
        assert out["mismatched"] == [
            f"stream {names[0]} exists with 1 replicas, not 3",
            f"kv {names[1]} exists with 1 replicas, not 3",
            f"kv {names[2]} exists with 1 replicas, not 3",
            f"object_store {names[3]} exists with 1 replicas, not 3",
        ]
        assert err.splitlines() == [f"kvmesh provision: {line}" for line in out["mismatched"]]
        for name in names:
            await js.delete_stream(name if name == stream else ("OBJ_" if "SNAP" in name else "KV_") + name)
    finally:
        await nc.close()


def test_provision_on_a_server_without_jetstream_says_so_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server without JetStream has no responders for the JetStream API: provision says so within a
    second instead of waiting out its timeout."""
    import socket

    from kvmesh.harness.server import server_binary

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with (tmp_path / "ns.log").open("w") as out:
        server = subprocess.Popen(
            [server_binary(), "-a", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        t0 = time.monotonic()
        code = provision_command(["--nats-url", f"nats://127.0.0.1:{port}", "--timeout-s", "30"])
        took = time.monotonic() - t0
    finally:
        server.terminate()
        server.wait(10)
    assert code == 1
    assert capsys.readouterr().err == (
        "kvmesh provision: JetStream is not enabled on the NATS server (start it with -js, or jetstream {} in "
        "its configuration)\n"
    )
    assert took < 10


def test_provision_refuses_a_replica_count_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        provision_command(["--replicas", "0"])
    assert exc.value.code == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err


def test_provision_without_a_server_is_one_line_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code = provision_command(["--nats-url", "nats://127.0.0.1:1"])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.startswith("kvmesh provision: cannot connect to NATS at nats://127.0.0.1:1"), err
    assert len(err.splitlines()) == 1


def _health_file(path: Path, *, written_at: float, connected: bool = True) -> None:
    health = Health(service="router", pid=4242, written_at=written_at, connected=connected)
    path.write_bytes(msgspec.json.encode(health))


def test_check_health_names_why_a_service_is_not_healthy(tmp_path: Path) -> None:
    """Fresh and connected passes; missing, stale, disconnected and garbled files each say why."""
    f = tmp_path / "h.json"
    assert check_health(f, now=100.0) == f"{f} does not exist (the service has not started, or has stopped)"
    _health_file(f, written_at=90.0)
    assert check_health(f, now=100.0) is None
    assert check_health(f, now=110.5) == f"router (pid 4242) last wrote {f} 20 s ago (bound 20 s)"
    assert check_health(f, max_age_s=30, now=110.5) is None
    _health_file(f, written_at=99.0, connected=False)
    assert check_health(f, now=100.0) == "router (pid 4242) is not connected to NATS"
    f.write_text("{}")
    assert (
        check_health(f, now=100.0)
        == f"{f} is not a kvmesh health file: Object missing required field `service`"
    )


def test_check_health_refuses_what_is_not_a_fresh_health_file(tmp_path: Path) -> None:
    """A file written far in the future, a timestamp that is not a number, a FIFO (which would block) and
    an oversized file are each unhealthy with the reason."""
    f = tmp_path / "h.json"
    _health_file(f, written_at=1e9)
    assert (
        check_health(f, now=1e9 - 1e6)
        == f"{f} was written 1000000 s in the future (a clock set back, or not a health file)"
    )
    f.write_bytes(b'{"service": "r", "pid": 1, "written_at": NaN, "connected": true}')
    assert check_health(f, now=100.0) is not None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert check_health(fifo, now=100.0) == f"{fifo} is not a regular file"
    big = tmp_path / "big"
    big.write_bytes(b" " * 5000)
    assert check_health(big, now=100.0) == f"{big} is not a kvmesh health file: larger than 4096 bytes"


def test_health_command_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "h.json"
    _health_file(f, written_at=time.time())
    assert health_command(["--file", str(f)]) == 0
    _health_file(f, written_at=time.time() - 60)
    assert health_command(["--file", str(f)]) == 1
    assert capsys.readouterr().err.startswith("kvmesh health: router (pid 4242) last wrote")


@pytest.mark.nats
@pytest.mark.e2e
def test_a_router_keeps_its_health_file_fresh_and_removes_it_on_stop(nats_url: str, tmp_path: Path) -> None:
    """A real router started with KVMESH_HEALTH_FILE writes it once serving, `kvmesh health` passes on it,
    and SIGTERM removes it (a stopped service is not healthy)."""
    f = tmp_path / "router.health"
    env = {**os.environ, "KVMESH_HEALTH_FILE": str(f), "KVMESH_NATS_URL": nats_url}
    cmd = [
        sys.executable,
        "-m",
        "kvmesh.cli",
        "router",
        "--index",
        "remote",
        "--route-subject",
        f"h.{os.getpid()}",
    ]
    log = tmp_path / "router.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not f.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert f.exists(), log.read_text()
        health = msgspec.json.decode(f.read_bytes(), type=Health)
        assert (health.service, health.pid, health.connected) == ("router", proc.pid, True)
        check = subprocess.run(
            [sys.executable, "-m", "kvmesh.cli", "health", "--file", str(f)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert (check.returncode, check.stderr) == (0, "")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert not f.exists()
