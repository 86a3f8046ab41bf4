"""The `kvmesh` command line fails with one clear line and a non-zero exit status, never a traceback."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import nats
import nats.js.errors
import pytest

from kvmesh.client import BadRequestError, Router

KVMESH = str(Path(sys.executable).parent / "kvmesh")
SECRET = "s3cret-pw-42"


def kvmesh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the installed `kvmesh ARGS` and capture its output."""
    return subprocess.run([KVMESH, *args], capture_output=True, text=True, timeout=timeout, check=False)


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """Assert ``proc`` failed with a one-line message on stderr and no traceback; return the line."""
    assert proc.returncode != 0, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [
        ln
        for ln in proc.stderr.splitlines()
        if ln.strip() and " INFO " not in ln and '"level": "INFO"' not in ln
    ]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_missing_token_ids_file_is_one_line(tmp_path: Path) -> None:
    """`kvmesh route --token-ids-file` naming a missing file exits 2 with one line naming it."""
    missing = tmp_path / "nope.json"
    proc = kvmesh(
        "route", "--model", "m", "--token-ids-file", str(missing), "--nats-url", "nats://127.0.0.1:1"
    )
    line = one_line_error(proc)
    assert proc.returncode == 2
    assert line == f"kvmesh route: error: cannot read --token-ids-file {missing}: No such file or directory"


@pytest.mark.nats
@pytest.mark.anyio
async def test_client_prompt_over_max_payload_is_bad_request(nats_url: str, uid: str) -> None:
    """A prompt too large for the server's max payload in either form (packed: 4 bytes a token) raises
    BadRequestError naming both sizes."""
    router = await Router.connect(nats_url, subject=f"t{uid}.route", timeout_s=1.0)
    try:
        with pytest.raises(BadRequestError) as info:
            await router.route("m", [123456] * 300_000)
        assert info.value.code == "bad_request"
        assert "exceeds the NATS server's max payload of 1048576 bytes" in info.value.message
    finally:
        await router.aclose()


@pytest.mark.nats
def test_cli_prompt_over_max_payload_is_bad_request(nats_url: str, uid: str, tmp_path: Path) -> None:
    """`kvmesh route` with a prompt over the max payload prints a bad_request reply and exits 1."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([123456] * 200_000))
    proc = kvmesh(
        "route", "--model", "m", "--token-ids-file", str(tokens), "--nats-url", nats_url,
        "--subject", f"t{uid}.route", "--timeout-s", "0.5",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout)["error"]["code"] == "bad_request"


def test_help_into_a_closed_pipe_is_quiet() -> None:
    """`kvmesh --help | head` with the reader gone prints no BrokenPipe traceback."""
    proc = subprocess.Popen([KVMESH, "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=30) == 141
    assert err == ""


@pytest.mark.nats
@pytest.mark.anyio
async def test_vllm_without_vllm_fails_before_starting_anything(nats_url: str, uid: str) -> None:
    """`kvmesh vllm` with no vllm binary exits 127 with one line, before the ingest creates its stream."""
    stream = f"KV_{uid}"
    proc = await asyncio.to_thread(
        kvmesh,
        "vllm", "--worker-id", f"w{uid}", "--nats-url", nats_url, "--stream", stream,
        "--events-prefix", f"t{uid}.kv", "--vllm-bin", f"/nonexistent/{uid}/vllm", "--", "serve", "m",
    )  # fmt: skip
    line = one_line_error(proc)
    assert proc.returncode == 127
    assert line == (
        f"kvmesh vllm: error: /nonexistent/{uid}/vllm not found (is vLLM installed? --vllm-bin names the "
        "executable)"
    )
    nc = await nats.connect(nats_url)
    try:
        with pytest.raises(nats.js.errors.NotFoundError):
            await nc.jetstream().stream_info(stream)
    finally:
        await nc.close()


@pytest.mark.nats
def test_sim_port_clash_is_one_line(nats_url: str) -> None:
    """`kvmesh sim` on a port already bound exits 1 with one line naming the endpoint and --base-port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        proc = kvmesh("sim", "--workers", "1", "--base-port", str(port), "--nats-url", nats_url, timeout=30)
    line = one_line_error(proc)
    assert proc.returncode == 1
    assert f"sim worker sim-0 rank 0 cannot bind tcp://127.0.0.1:{port}" in line
    assert "choose another --base-port" in line


def test_sim_print_config_prints_and_exits() -> None:
    """`kvmesh sim --print-config` prints the settings as JSON and exits 0 without starting workers."""
    t0 = time.monotonic()
    proc = kvmesh("sim", "--workers", "3", "--nats-url", "nats://127.0.0.1:1", "--print-config", timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["workers"] == 3
    assert time.monotonic() - t0 < 20


def test_print_config_redacts_the_nats_password() -> None:
    """`--print-config` shows the NATS URL with its credentials redacted."""
    proc = kvmesh("router", "--nats-url", f"nats://alice:{SECRET}@h:4222", "--print-config", timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["nats_url"] == "nats://***@h:4222"
    assert SECRET not in proc.stdout


@pytest.mark.nats
def test_status_accepts_a_server_list(nats_url: str, uid: str) -> None:
    """`kvmesh status` with a comma-separated server list (a dead one first) connects through the live one."""
    url = f"nats://127.0.0.1:{free_port()},{nats_url}"
    proc = kvmesh("status", "--nats-url", url, "--stream", f"LIST_{uid}", "--wait-s", "0.2")
    assert "Traceback" not in proc.stderr
    assert f"LIST_{uid}" in proc.stdout + proc.stderr


@pytest.mark.nats
def test_status_of_a_missing_stream_exits_1(nats_url: str, uid: str) -> None:
    """`kvmesh status --json` for a stream that does not exist prints its JSON but exits 1 with one line saying so."""
    proc = kvmesh("status", "--json", "--nats-url", nats_url, "--stream", f"NOPE_{uid}", "--wait-s", "0.2")
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["stream"] == {"name": f"NOPE_{uid}", "error": "stream not found"}
    assert proc.stderr.strip() == f"kvmesh status: stream NOPE_{uid} does not exist on {nats_url}"


@pytest.mark.nats
def test_snapshot_without_an_indexer_says_none_answered(nats_url: str, uid: str) -> None:
    """`kvmesh snapshot` with no indexer subscribed exits 1 at once saying no indexer answered."""
    t0 = time.monotonic()
    proc = kvmesh("snapshot", "--nats-url", nats_url, "--stream", f"NOPE_{uid}")
    assert time.monotonic() - t0 < 15
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"kvmesh snapshot: no indexer answered: nothing is subscribed to kvmesh.index.snapshot "
        f"(is an indexer of stream NOPE_{uid} running?)"
    )


def test_version_flag_prints_the_package_version() -> None:
    """`kvmesh --version` prints the installed version and exits 0."""
    from importlib.metadata import version

    proc = kvmesh("--version")
    assert proc.returncode == 0
    assert proc.stdout == f"kvmesh {version('kvmesh-shared')}\n"


def test_the_indexer_reports_the_package_version() -> None:
    """The indexer's NATS micro service version is the one package version (the router's: test_cli_finish)."""
    from importlib.metadata import version

    from kvmesh.indexer import service as indexer

    assert vars(indexer)["VERSION"] == version("kvmesh-shared")


def test_a_typo_suggests_the_command() -> None:
    """`kvmesh stauts` exits 2 and suggests `status`."""
    proc = kvmesh("stauts")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == "kvmesh: unknown command 'stauts' (did you mean 'status'?)"


@pytest.mark.nats
@pytest.mark.parametrize("command", [["replay"], ["reset", "--yes"]])
def test_replay_and_reset_of_a_missing_stream_are_one_line(
    nats_url: str, uid: str, command: list[str]
) -> None:
    """`kvmesh replay` and `kvmesh reset --yes` on a stream that does not exist exit 1 with one line naming it."""
    proc = kvmesh(*command, "--nats-url", nats_url, "--stream", f"NOPE_{uid}")
    line = one_line_error(proc)
    assert proc.returncode == 1
    assert line == f"kvmesh {command[0]}: stream NOPE_{uid} does not exist"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1,,2", "token ids must be integers separated by commas or spaces"),
        ("[true, 1]", "--token-ids is not a JSON array of integers"),
        ("[1.5]", "--token-ids is not a JSON array of integers"),
        ("[1, 2", "--token-ids is not a JSON array of integers: Expecting ',' delimiter"),
    ],
)
def test_a_malformed_token_list_is_refused_before_sending(
    text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty element, a bool or float in a JSON array, or broken JSON is a usage error naming --token-ids."""
    from kvmesh.cli import main

    with pytest.raises(SystemExit) as info:
        main(["route", "--nats-url", "nats://127.0.0.1:1", "--model", "m", f"--token-ids={text}"])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_command_of_a_distribution_not_installed_says_which(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With only the library installed (no kvmesh.commands entry points), `kvmesh up` names kvmesh-tools."""
    import kvmesh.cli

    monkeypatch.setattr(kvmesh.cli, "entry_points", lambda group: [])
    assert kvmesh.cli.main(["up"]) == 2
    assert capsys.readouterr().err == (
        "kvmesh up: part of kvmesh-tools, which is not installed here "
        "(from a checkout: make install, or pip install ./tools)\n"
    )
    assert kvmesh.cli.main(["router"]) == 2
    assert "kvmesh router: part of kvmesh-router, which is not installed here" in capsys.readouterr().err
