"""`kvmesh vllm` / `kvmesh sglang`: engine command lines with KV events on, and the engine + ingest process pair.

The end-to-end tests run the real command with a stand-in engine (a script written per test) that checks the
arguments it receives and runs simulated workers publishing on the endpoints it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.pipeline import Pipeline
from tests.test_ingest_faults import clean_pipeline, free_port_pair
from tests.test_ingest_outage import expect

from kvmesh.ingest.engines import EngineArgsError, build_sglang_command, build_vllm_command
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect

# ---------------------------------------------------------------------------------------------- vllm args


def test_vllm_command_adds_events_config_and_prefix_caching() -> None:
    """`serve M --data-parallel-size 2` gets the zmq events config (PUB and replay), prefix caching, and DP 2."""
    cmd = build_vllm_command(
        ["serve", "my-model", "--data-parallel-size", "2", "--block-size", "32"],
        events_port=6000,
        topic="kv",
    )
    assert cmd.argv == [
        "vllm",
        "serve",
        "my-model",
        "--data-parallel-size",
        "2",
        "--block-size",
        "32",
        "--enable-prefix-caching",
        "--kv-events-config",
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": "tcp://*:6000",
                "replay_endpoint": "tcp://*:6002",
                "topic": "kv",
            }
        ),
    ]
    assert (cmd.model, cmd.data_parallel_size, cmd.block_size, cmd.topic) == ("my-model", 2, 32, "kv")
    assert (cmd.endpoint, cmd.replay_endpoint) == ("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6002")


def test_vllm_command_reads_short_flags_model_option_and_served_name() -> None:
    """`-dp=4`, `--model M` without `serve`, and `--served-model-name N` give DP 4 and route model N."""
    cmd = build_vllm_command(
        ["--model=org/m", "-dp=4", "--served-model-name", "m-chat", "--enable-prefix-caching"],
        vllm_bin="/opt/bin/vllm",
        events_port=7000,
        replay_port=7100,
    )
    assert cmd.argv[:6] == [
        "/opt/bin/vllm",
        "serve",
        "--model=org/m",
        "-dp=4",
        "--served-model-name",
        "m-chat",
    ]
    assert cmd.argv.count("--enable-prefix-caching") == 1
    assert (cmd.model, cmd.data_parallel_size, cmd.block_size) == ("m-chat", 4, None)
    assert (cmd.endpoint, cmd.replay_endpoint) == ("tcp://127.0.0.1:7000", "tcp://127.0.0.1:7100")


def test_vllm_command_keeps_an_enabled_user_config_and_adds_replay() -> None:
    """A user config with events on keeps its endpoint and buffer; the ingest reads its port and gets a replay socket."""
    user = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5600", "buffer_steps": 500}
    cmd = build_vllm_command(["serve", "m", "--kv-events-config", json.dumps(user)])
    i = cmd.argv.index("--kv-events-config")
    assert cmd.argv.count("--kv-events-config") == 1
    assert json.loads(cmd.argv[i + 1]) == {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://*:5600",
        "buffer_steps": 500,
        "publisher": "zmq",
        "replay_endpoint": "tcp://*:5601",
    }
    assert (cmd.endpoint, cmd.replay_endpoint, cmd.model) == (
        "tcp://127.0.0.1:5600",
        "tcp://127.0.0.1:5601",
        "m",
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["serve", "m", "--kv-events-config", '{"enable_kv_cache_events": false}'],
            "enable_kv_cache_events off",
        ),
        (["serve", "m", "--kv-events-config={}"], "enable_kv_cache_events off"),
        (
            ["serve", "m", "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}'],
            "publisher is 'null'",
        ),
        (["serve", "m", "--no-enable-prefix-caching"], "no KV events without prefix caching"),
        (["serve", "--port", "8000"], "no model"),
        (["serve", "m", "--data-parallel-size", "two"], "needs an integer"),
        (["serve", "m", "-dp", "0"], "must be ≥ 1"),
    ],
    ids=[
        "events-off",
        "events-unset",
        "null-publisher",
        "no-prefix-caching",
        "no-model",
        "bad-dp",
        "zero-dp",
    ],
)
def test_vllm_command_refuses_arguments_that_lose_events(args: list[str], message: str) -> None:
    """Arguments that turn the events off (or are unreadable) are refused with a message naming the problem."""
    with pytest.raises(EngineArgsError, match=message):
        build_vllm_command(args)


def test_vllm_command_refuses_overlapping_ports() -> None:
    """With DP 3, a replay port inside the 3 events ports is refused."""
    with pytest.raises(EngineArgsError, match=r"events ports 5557…5559 and replay ports 5559…5561 overlap"):
        build_vllm_command(["serve", "m", "-dp", "3"], replay_port=5559)


# ---------------------------------------------------------------------------------------------- sglang args


def test_sglang_command_adds_events_config_with_dp_attention() -> None:
    """`--model-path M --dp-size 2 --enable-dp-attention --page-size 16` gets a zmq events config, DP 2 and block size 16."""
    cmd = build_sglang_command(
        ["--model-path", "org/m", "--dp-size", "2", "--enable-dp-attention", "--page-size", "16"],
        events_port=6100,
        replay_port=6200,
    )
    assert cmd.argv == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "org/m",
        "--dp-size",
        "2",
        "--enable-dp-attention",
        "--page-size",
        "16",
        "--kv-events-config",
        json.dumps({"publisher": "zmq", "endpoint": "tcp://*:6100", "replay_endpoint": "tcp://*:6200"}),
    ]
    assert (cmd.model, cmd.data_parallel_size, cmd.block_size, cmd.topic) == ("org/m", 2, 16, "")


def test_sglang_command_refuses_null_publisher_and_missing_model() -> None:
    """SGLang with publisher "null" or without --model-path is refused."""
    with pytest.raises(EngineArgsError, match="publisher is 'null'"):
        build_sglang_command(["--model-path", "m", "--kv-events-config", '{"publisher": "null"}'])
    with pytest.raises(EngineArgsError, match="no model"):
        build_sglang_command(["--dp-size", "2"])


# ---------------------------------------------------------------------------------------------- end to end

STAND_IN = '''#!{python}
"""Stand-in engine: checks its arguments, runs simulated ranks on the configured endpoints, serves requests."""
import asyncio, json, os, signal, sys

from kvmesh.sim.engine import SimWorker

argv = sys.argv[1:]
with open({record!r}, "w") as f:
    json.dump(argv, f)
flavour = {flavour!r}
cfg = json.loads(argv[argv.index("--kv-events-config") + 1])
assert cfg["publisher"] == "zmq", cfg
if flavour == "vllm":
    assert argv[:2] == ["serve", "my-model"], argv
    assert cfg["enable_kv_cache_events"] is True, cfg
    assert "--enable-prefix-caching" in argv, argv
    dp = int(argv[argv.index("--data-parallel-size") + 1])
else:
    assert argv[argv.index("--model-path") + 1] == "my-model", argv
    dp = int(argv[argv.index("--dp-size") + 1])


async def main() -> int:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    workers = [
        SimWorker("stand-in", num_blocks=64, block_size=16, endpoint=cfg["endpoint"],
                  replay_endpoint=cfg["replay_endpoint"], dp_rank=r)
        for r in range(dp)
    ]
    for w in workers:
        await w.publisher.wait_for_subscribers(1, timeout_s=20)
    for r, w in enumerate(workers):
        await w.serve_request(list(range(1000 * (r + 1), 1000 * (r + 1) + 16 * (r + 2))), 1)
    exit_code = {exit_code!r}
    if exit_code is not None:
        while not os.path.exists({release!r}):  # the test lets it exit once it has checked the index
            await asyncio.sleep(0.05)
        return exit_code
    await stop.wait()
    for w in workers:
        w.close()
    return 7


sys.exit(asyncio.run(main()))
'''


def stand_in(tmp_path: Path, flavour: str, exit_code: int | None = None) -> tuple[Path, Path]:
    """Write the stand-in engine script; return it and the file it records its arguments in."""
    record = tmp_path / "argv.json"
    script = tmp_path / f"fake-{flavour}"
    script.write_text(
        STAND_IN.format(
            python=sys.executable,
            record=str(record),
            flavour=flavour,
            exit_code=exit_code,
            release=str(tmp_path / "release"),
        )
    )
    script.chmod(0o755)
    return script, record


RANK0 = list(range(1000, 1032))  # 2 blocks of 16, served on rank 0
RANK1 = list(range(2000, 2048))  # 3 blocks of 16, served on rank 1


@contextlib.asynccontextmanager
async def engine_pair(
    nats_url: str,
    uid: str,
    tmp_path: Path,
    flavour: str,
    engine_args: list[str],
    *,
    exit_code: int | None = None,
) -> AsyncIterator[tuple[Pipeline, asyncio.subprocess.Process, Path]]:
    """Run `kvmesh <flavour>` with a stand-in engine next to an indexer and a router; yield them and the record file."""
    script, record = stand_in(tmp_path, flavour, exit_code)
    events, replay = free_port_pair(), free_port_pair()
    async with clean_pipeline(nats_url, uid) as p:
        await p.start_indexer()
        await p.start_router()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvmesh.cli",
            flavour,
            "--worker-id",
            "w",
            "--nats-url",
            nats_url,
            "--stream",
            p.stream,
            "--events-prefix",
            p.prefix,
            f"--{flavour}-bin",
            str(script),
            "--events-port",
            str(events),
            "--replay-port",
            str(replay),
            "--",
            *engine_args,
        )
        try:
            yield p, proc, record
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            nc = await connect(nats_url, name="test-cleanup")
            with contextlib.suppress(Exception):
                await nc.jetstream().delete_stream(f"KV_{subjects.registry_bucket(p.stream)}")
            await nc.close()


@pytest.mark.anyio
@pytest.mark.nats
async def test_kvmesh_vllm_runs_engine_and_ingest_for_every_rank(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    """`kvmesh vllm -- serve my-model --data-parallel-size 2` indexes both ranks' blocks and exits with the engine's status on SIGTERM."""
    args = ["serve", "my-model", "--data-parallel-size", "2", "--block-size", "16"]
    async with engine_pair(nats_url, uid, tmp_path, "vllm", args) as (p, proc, record):
        await expect(
            p, [RANK0, RANK1], [{"w/0": 2, "w/1": 0}, {"w/0": 0, "w/1": 3}], model="my-model", timeout_s=30
        )
        argv = json.loads(record.read_text())
        assert argv[:6] == ["serve", "my-model", "--data-parallel-size", "2", "--block-size", "16"]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 7


@pytest.mark.anyio
@pytest.mark.nats
async def test_kvmesh_sglang_stops_when_the_engine_exits(nats_url: str, uid: str, tmp_path: Path) -> None:
    """`kvmesh sglang -- --model-path my-model --dp-size 2` indexes both ranks and exits with status 3 when the engine does."""
    args = ["--model-path", "my-model", "--dp-size", "2", "--enable-dp-attention", "--page-size", "16"]
    async with engine_pair(nats_url, uid, tmp_path, "sglang", args, exit_code=3) as (p, proc, _):
        await expect(
            p, [RANK0, RANK1], [{"w/0": 2, "w/1": 0}, {"w/0": 0, "w/1": 3}], model="my-model", timeout_s=30
        )
        (tmp_path / "release").touch()
        assert await asyncio.wait_for(proc.wait(), 20) == 3


@pytest.mark.anyio
async def test_kvmesh_vllm_starts_the_engine_when_nats_is_unreachable(tmp_path: Path) -> None:
    """With NATS unreachable the engine still starts after --ingest-wait-s, and its exit status 4 is returned."""
    script = tmp_path / "fake-vllm"
    script.write_text("#!/bin/sh\nexit 4\n")
    script.chmod(0o755)
    events, replay = free_port_pair(), free_port_pair()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvmesh.cli",
        "vllm",
        "--worker-id",
        "w",
        "--nats-url",
        f"nats://127.0.0.1:{free_port_pair()}",
        "--vllm-bin",
        str(script),
        "--events-port",
        str(events),
        "--replay-port",
        str(replay),
        "--ingest-wait-s",
        "0.5",
        "--",
        "serve",
        "my-model",
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 4
    assert b"ingest not ready after 0.5 s" in err
