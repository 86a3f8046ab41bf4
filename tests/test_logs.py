"""Structured logs: the exact JSON and text lines of `kvmesh.runtime.logs`, and a real ingest's JSON lines (a
forced gap as one line with its fields; no password or NKey seed anywhere in them)."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys
import pytest
from opentelemetry.sdk.trace import TracerProvider
from tests.test_ingest_faults import ANY, BS, T, U, blk, stored

from kvmesh.core.load import EngineLoads, LoadLedger
from kvmesh.harness.server import NatsServer
from kvmesh.router.config import RouterSettings
from kvmesh.router.notes import LifecycleNotes
from kvmesh.runtime.logs import JsonFormatter, TextFormatter, resolve_format, setup_logging
from kvmesh.sim.publisher import EventPublisher

CREATED = 1_750_000_000.25
"""A fixed record time: 2025-06-15T15:06:40.250Z."""


def record(msg: str, *args: Any, extra: dict[str, Any] | None = None, exc: bool = False) -> logging.LogRecord:
    """A WARNING record of logger ``kvmesh.ingest`` created at `CREATED` (with the current exception)."""
    rec = logging.getLogger("kvmesh.ingest").makeRecord(
        "kvmesh.ingest",
        logging.WARNING,
        "reader.py",
        1,
        msg,
        args,
        sys.exc_info() if exc else None,
        extra=extra,
    )
    rec.created, rec.msecs = CREATED, 250.0
    return rec


GAP = {"worker_id": "w", "dp_rank": 0, "seq": 5, "epoch": 2, "from_seq": 4}


def test_json_line_has_the_fields_in_order() -> None:
    """A record with extras is one JSON object: ts, level, logger, service, msg, then the known fields in
    their order and the others by name."""
    line = JsonFormatter("ingest").format(record("worker %s rank %d: gap", "w", 0, extra=GAP))
    assert line == (
        '{"ts": "2025-06-15T15:06:40.250Z", "level": "WARNING", "logger": "kvmesh.ingest", "service": "ingest", '
        '"msg": "worker w rank 0: gap", "worker_id": "w", "dp_rank": 0, "epoch": 2, "seq": 5, "from_seq": 4}'
    )


def test_json_line_carries_the_current_span() -> None:
    """Inside an active span the line carries its trace and span ids as 32 and 16 hex digits."""
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("apply") as span:
        ctx = span.get_span_context()
        got = json.loads(JsonFormatter("indexer").format(record("applied", extra={"stream_seq": 9})))
    assert got == {
        "ts": "2025-06-15T15:06:40.250Z",
        "level": "WARNING",
        "logger": "kvmesh.ingest",
        "service": "indexer",
        "msg": "applied",
        "stream_seq": 9,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
    }
    assert "trace_id" not in json.loads(JsonFormatter("indexer").format(record("applied")))


def test_json_line_puts_an_exception_in_exc() -> None:
    """An exception becomes ``exc``: its type, message and the whole traceback as one string."""
    try:
        raise ValueError("bad frame")
    except ValueError as err:
        rec = record("replay failed", exc=True)
        want_tb = "".join(traceback.format_exception(err)).rstrip("\n")
    got = json.loads(JsonFormatter("ingest").format(rec))
    assert got["exc"] == {"type": "ValueError", "message": "bad frame", "traceback": want_tb}
    assert want_tb.startswith("Traceback (most recent call last):") and want_tb.endswith(
        "ValueError: bad frame"
    )


def test_text_line_is_readable() -> None:
    """On a terminal: local ``HH:MM:SS LEVEL service: msg key=value``, values with spaces quoted."""
    clock = time.strftime("%H:%M:%S", time.localtime(CREATED))
    rec = record("worker %s rank %d: gap", "w", 0, extra={"worker_id": "w", "dp_rank": 0, "reason": "a b"})
    assert TextFormatter("ingest").format(rec) == (
        f'{clock} WARNING ingest: worker w rank 0: gap worker_id=w dp_rank=0 reason="a b"'
    )


def test_auto_is_json_on_a_pipe_and_text_on_a_terminal() -> None:
    """``auto`` means JSON on a pipe or file and text on a terminal; an unknown format is refused."""
    r, w = os.pipe()
    with os.fdopen(r), os.fdopen(w, "w") as wf:
        assert resolve_format("auto", wf) == "json"
        assert resolve_format("text", wf) == "text"
    leader, follower = os.openpty()
    with os.fdopen(leader), os.fdopen(follower, "w") as ff:
        assert resolve_format("auto", ff) == "text"
        assert resolve_format("json", ff) == "json"
    with pytest.raises(ValueError, match="log format must be one of auto, json, text, got 'xml'"):
        resolve_format("xml", io.StringIO())


def test_setup_logging_replaces_the_handlers() -> None:
    """`setup_logging` leaves one handler that writes JSON lines at the given level."""
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    out = io.StringIO()
    try:
        setup_logging("warning", "router", "auto", stream=out)
        logging.getLogger("kvmesh.router").info("hidden")
        logging.getLogger("kvmesh.router").warning("shown", extra={"request_id": "r1"})
        assert len(root.handlers) == 1
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
    (line,) = out.getvalue().splitlines()
    got = json.loads(line)
    assert (got["service"], got["msg"], got["request_id"], got["level"]) == (
        "router",
        "shown",
        "r1",
        "WARNING",
    )


# ---------------------------------------------------------------------- a real ingest


ROOT = Path(__file__).resolve().parent.parent


def _ingest(
    log: Path, url: str, uid: str, pub: EventPublisher, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """Start ``python -m kvmesh.ingest`` on ``pub`` with its stderr in ``log`` (a file: JSON by default)."""
    args = [
        "--stream",
        f"KVMESH_L_{uid}",
        "--events-prefix",
        f"l{uid}.events",
        "--registry-bucket",
        f"L_{uid}_W",
    ]
    cmd = [
        sys.executable,
        "-m",
        "kvmesh.ingest",
        "--nats-url",
        url,
        *args,
        "--worker-id",
        "w",
        "--model",
        "m",
    ]
    cmd += [
        "--block-size",
        str(BS),
        "--zmq-endpoint",
        pub.endpoint,
        "--replay-endpoint",
        str(pub.replay_endpoint),
    ]
    cmd += [
        "--stream-memory",
        "--stream-max-bytes",
        str(64 * 2**20),
        "--max-coalesced-batches",
        "1",
        "--log-level",
        "DEBUG",
    ]
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=base | env, cwd=ROOT)


def _lines(log: Path) -> list[dict[str, Any]]:
    """Every line of ``log`` as JSON (each must be one object)."""
    return [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()]


def _wait_for(log: Path, proc: subprocess.Popen[bytes], text: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The first JSON line of ``log`` whose msg contains ``text``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in _lines(log) if log.exists() else []:
            if text in line["msg"]:
                return line
        assert proc.poll() is None, log.read_text()
        time.sleep(0.05)
    raise AssertionError(f"no line with {text!r}:\n{log.read_text()}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def publisher() -> Iterator[EventPublisher]:
    pub = EventPublisher(ANY, ANY)
    try:
        yield pub
    finally:
        pub.close()


@pytest.mark.anyio
@pytest.mark.nats
@pytest.mark.e2e
async def test_a_forced_gap_is_one_json_line_with_its_fields(
    nats_url: str, uid: str, tmp_path: Path, publisher: EventPublisher
) -> None:
    """A batch the engine dropped is one WARNING line from the ingest with worker_id, dp_rank, epoch and the
    seq of the gap, and a replay-done line; every line the ingest wrote is one JSON object."""
    log = tmp_path / "ingest.log"
    proc = _ingest(log, nats_url, uid, publisher, {})
    try:
        await publisher.wait_for_subscribers(1, timeout_s=20.0)
        publisher.publish([stored([10], blk(T, 0))])
        publisher.drop_next(1)
        publisher.publish([stored([20], blk(U, 0))])  # dropped: the next batch reveals the gap
        publisher.publish([stored([21], blk(U, 1), parent=20)])
        gap = _wait_for(log, proc, "sequence gap")
        done = _wait_for(log, proc, "replay done")
    finally:
        _stop(proc)
    assert {k: v for k, v in gap.items() if k != "ts"} == {
        "level": "WARNING",
        "logger": "kvmesh.ingest",
        "service": "ingest",
        "msg": "worker w rank 0: sequence gap before seq 2 (last 0); replaying from 1",
        "worker_id": "w",
        "dp_rank": 0,
        "seq": 2,
        "from_seq": 1,
        "last_seq": 0,
    }
    assert (done["worker_id"], done["dp_rank"], done["healed"]) == ("w", 0, True)
    assert len(_lines(log)) > 2


PASSWORD = "pw-Zq81-never-logged"
WRONG = "pw-Wx07-never-logged"


@pytest.mark.nats
@pytest.mark.e2e
def test_no_password_or_seed_in_a_services_json_logs(
    tmp_path: Path, uid: str, publisher: EventPublisher
) -> None:
    """An ingest given a password in its URL, a wrong one, or an NKey seed file logs JSON lines (DEBUG) that
    never contain the password or the seed; the URL shows ``***``."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    (tmp_path / "user.nk").write_bytes(seed + b"\n")
    conf = tmp_path / "server.conf"
    conf.write_text(
        f'authorization {{ users: [ {{ user: alice, password: "{PASSWORD}" }}, {{ nkey: "{public}" }} ] }}\n'
    )
    secrets = [PASSWORD, WRONG, seed.decode()]
    with NatsServer(args=["-c", str(conf)]) as server:
        host = f"127.0.0.1:{server.port}"
        runs = [
            ("good", f"nats://alice:{PASSWORD}@{host}", {}, "publishing to"),
            ("wrong", f"nats://alice:{WRONG}@{host}", {}, "still trying"),
            ("seed", server.url, {"KVMESH_NATS_NKEY_SEED_FILE": str(tmp_path / "user.nk")}, "publishing to"),
        ]
        for name, url, env, until in runs:
            log = tmp_path / f"{name}.log"
            proc = _ingest(log, url, f"{uid}{name}", publisher, env)
            try:
                _wait_for(log, proc, until)
            finally:
                _stop(proc)
            text = log.read_text()
            assert [s for s in secrets if s in text] == [], name
            assert all(line["service"] == "ingest" for line in _lines(log))
            if name == "wrong":
                assert f"nats://***@{host}" in text


@dataclass
class _Msg:
    subject: str
    data: bytes


@pytest.mark.anyio
async def test_an_undecodable_note_warns_once_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    """Three bad notes of each kind log one WARNING per kind (with ``kind`` and ``subject`` fields) and
    DEBUG lines for the rest; every one is counted."""
    caplog.set_level(logging.DEBUG, logger="kvmesh.router")
    notes = LifecycleNotes(RouterSettings(), LoadLedger(), EngineLoads(), clock=time.monotonic)
    handlers = {"routed": notes._on_routed, "finished": notes._on_finished, "load": notes._on_load}
    for _ in range(3):
        for kind, on in handlers.items():
            await on(_Msg(f"x.{kind}", b"{"))  # type: ignore[arg-type]
    warned = [(r.levelname, r.__dict__["kind"], r.__dict__["subject"]) for r in caplog.records]
    assert sorted(w for w in warned if w[0] == "WARNING") == [
        ("WARNING", "finished", "x.finished"),
        ("WARNING", "load", "x.load"),
        ("WARNING", "routed", "x.routed"),
    ]
    assert sum(1 for w in warned if w[0] == "DEBUG") == 6
    assert notes.undecodable == 6
