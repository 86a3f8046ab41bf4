"""`kvmesh trtllm`: the options file it writes, its refusals, and a TensorRT-LLM payload routed end to end.

The end-to-end test runs the real command with a stand-in ``trtllm-serve`` (a script written per test) that
reads the options file it is given and publishes, per attention-DP rank, batches built to TensorRT-LLM's
documented streaming layout (``tensorrt_llm/_torch/pyexecutor/kv_cache_events.py``: map events with
``lora_id``/``medium``/``lora_name`` always present, signed 64-bit hashes, ``[ts, events, rank]``) on a PUB
socket and a replay ROUTER answering in its framing; a real ingest, indexer and router answer the routes.
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

from kvmesh.ingest.engines import EngineArgsError
from kvmesh.ingest.trtllm import build_trtllm_command
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect

# ---------------------------------------------------------------------------------------------- arguments


def test_trtllm_command_completes_the_options_file(tmp_path: Path) -> None:
    """The user's options are kept; block reuse, manager V2 and the zmq events (PUB + replay) are set, and with
    attention DP each of the --tp_size ranks is read on port + r."""
    user = tmp_path / "opts.json"
    user.write_text(json.dumps({"enable_attention_dp": True, "kv_cache_config": {"tokens_per_block": 64}}))
    cmd = build_trtllm_command(
        ["serve", "Qwen/Qwen3-0.6B", "--tp_size", "2", "--extra_llm_api_options", str(user)],
        options_dir=tmp_path,
        events_port=6000,
        topic="kv",
    )
    written = tmp_path / "kvmesh-trtllm-options.json"
    assert cmd.argv == [
        "trtllm-serve",
        "serve",
        "Qwen/Qwen3-0.6B",
        "--tp_size",
        "2",
        "--extra_llm_api_options",
        str(written),
    ]
    assert json.loads(written.read_text()) == {
        "enable_attention_dp": True,
        "kv_cache_config": {
            "tokens_per_block": 64,
            "enable_block_reuse": True,
            "use_kv_cache_manager_v2": True,
            "kv_events_config": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": "tcp://*:6000",
                "replay_endpoint": "tcp://*:6002",
                "topic": "kv",
            },
        },
    }
    assert (cmd.model, cmd.data_parallel_size, cmd.block_size, cmd.topic) == ("Qwen/Qwen3-0.6B", 2, 64, "kv")
    assert (cmd.endpoint, cmd.replay_endpoint) == ("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6002")


def test_trtllm_max_seq_len_is_the_context_length(tmp_path: Path) -> None:
    """trtllm-serve's --max_seq_len is the worker's context length in the registry (none without it)."""
    with_len = build_trtllm_command(["serve", "m", "--max_seq_len", "4096"], options_dir=tmp_path)
    without = build_trtllm_command(["serve", "m"], options_dir=tmp_path)
    assert (with_len.context_length, without.context_length) == (4096, None)


def test_trtllm_command_reads_yaml_and_keeps_user_endpoints(tmp_path: Path) -> None:
    """A YAML options file (--config) with its own endpoints: ports read from them, one rank without attention DP."""
    user = tmp_path / "opts.yaml"
    user.write_text(
        "kv_cache_config:\n  kv_events_config:\n    endpoint: tcp://*:7100\n    replay_endpoint: tcp://*:7200\n"
    )
    cmd = build_trtllm_command(["m", "--tp_size", "4", f"--config={user}"], options_dir=tmp_path)
    assert cmd.argv[:3] == ["trtllm-serve", "serve", "m"]
    assert (cmd.data_parallel_size, cmd.endpoint, cmd.replay_endpoint) == (
        1,
        "tcp://127.0.0.1:7100",
        "tcp://127.0.0.1:7200",
    )


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ({"enable_block_reuse": False}, "enable_block_reuse is false"),
        ({"use_kv_cache_manager_v2": False}, "manager V2 only"),
        ({"kv_events_config": {"enable_kv_cache_events": False}}, "enable_kv_cache_events is false"),
        ({"kv_events_config": {"publisher": "null"}}, "reads the zmq publisher"),
        ({"tokens_per_block": 0}, "tokens_per_block must be a positive int"),
    ],
)
def test_trtllm_command_refuses_options_that_turn_events_off(
    tmp_path: Path, kv: dict[str, object], message: str
) -> None:
    """Options under which TensorRT-LLM would publish nothing kvmesh can read are refused, naming the field."""
    user = tmp_path / "opts.json"
    user.write_text(json.dumps({"kv_cache_config": kv}))
    with pytest.raises(EngineArgsError, match=message):
        build_trtllm_command(["serve", "m", "--extra_llm_api_options", str(user)], options_dir=tmp_path)
    with pytest.raises(EngineArgsError, match="no model"):
        build_trtllm_command(["serve", "--tp_size", "2"], options_dir=tmp_path)


# ---------------------------------------------------------------------------------------------- end to end

STAND_IN = """#!{python}
import json, signal, sys, time
import msgspec, zmq

argv = sys.argv[1:]
opts = json.load(open(argv[argv.index("--extra_llm_api_options") + 1]))
ev = opts["kv_cache_config"]["kv_events_config"]
assert ev["enable_kv_cache_events"] and ev["publisher"] == "zmq" and opts["kv_cache_config"]["use_kv_cache_manager_v2"]
bs = opts["kv_cache_config"]["tokens_per_block"]
ranks = int(argv[argv.index("--tp_size") + 1]) if opts.get("enable_attention_dp") else 1

def port(endpoint, r):
    host, _, p = endpoint.rpartition(":")
    return f"{{host}}:{{int(p) + r}}"

ctx = zmq.Context()
pubs, routers, buffers = [], [], []
for r in range(ranks):
    pub = ctx.socket(zmq.XPUB)  # a SUB cannot tell it from TensorRT-LLM's PUB; it lets us wait for the ingest
    pub.bind(port(ev["endpoint"], r))
    router = ctx.socket(zmq.ROUTER)
    router.bind(port(ev["replay_endpoint"], r))
    pubs.append(pub); routers.append(router); buffers.append([])

def stored(hashes, tokens, parent=None, mm_keys=None):
    e = {{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
         "block_size": bs, "lora_id": None, "medium": "GPU", "lora_name": None}}
    if mm_keys is not None:
        e["mm_keys"] = mm_keys
    return e

def publish(r, events):
    seq = len(buffers[r])
    payload = msgspec.msgpack.encode([time.time(), events, r])
    buffers[r].append(payload)
    pubs[r].send_multipart([ev.get("topic", "").encode(), seq.to_bytes(8, "big"), payload])

def serve_replays():
    for r, router in enumerate(routers):
        while router.poll(0):
            ident, _, start = router.recv_multipart()
            for seq, payload in enumerate(buffers[r]):
                if seq >= int.from_bytes(start, "big"):
                    router.send_multipart([ident, b"", ev.get("topic", "").encode(), seq.to_bytes(8, "big"), payload])
            router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

T = list(range(1000, 1000 + 3 * bs))
# rank 0, before any subscriber: only the replay socket can deliver it
publish(0, [stored([-(1 << 63), 7], T[: 2 * bs])])
for pub in pubs:
    while pub.poll(20000) and pub.recv()[:1] != b"\\x01":
        pass
publish(0, [stored([9], T[2 * bs :], parent=7), {{"type": "created", "num_blocks_per_cache_level": [64, 256]}}])
publish(0, [stored([11], list(range(5000, 5000 + bs)), mm_keys=[[{{"type": "mm_key", "hash": "ab" * 16, "start_offset": 0}}]])])
if ranks > 1:
    publish(1, [stored([-3, 4], list(range(2000, 2000 + 2 * bs)))])
    publish(1, [{{"type": "BlockRemoved", "block_hashes": [4], "medium": "GPU"}}])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
while not stop:
    serve_replays()
    time.sleep(0.01)
sys.exit(5)
"""

BS = 16
T = list(range(1000, 1000 + 3 * BS))
IMAGE_AS_TEXT = list(range(5000, 5000 + BS))
R1 = list(range(2000, 2000 + 2 * BS))


@contextlib.asynccontextmanager
async def trtllm_pair(
    nats_url: str, uid: str, tmp_path: Path, engine_args: list[str]
) -> AsyncIterator[tuple[Pipeline, asyncio.subprocess.Process]]:
    """`kvmesh trtllm` with the stand-in engine, next to an indexer and a router."""
    script = tmp_path / "fake-trtllm-serve"
    script.write_text(STAND_IN.format(python=sys.executable))
    script.chmod(0o755)
    events, replay = free_port_pair(), free_port_pair()
    async with clean_pipeline(nats_url, uid) as p:
        await p.start_indexer()
        await p.start_router()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvmesh.cli",
            "trtllm",
            "--worker-id",
            "w",
            "--nats-url",
            nats_url,
            "--stream",
            p.stream,
            "--events-prefix",
            p.prefix,
            "--trtllm-bin",
            str(script),
            "--events-port",
            str(events),
            "--replay-port",
            str(replay),
            "--",
            *engine_args,
        )
        try:
            yield p, proc
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
async def test_kvmesh_trtllm_routes_a_trtllm_payload_on_every_attention_dp_rank(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    """TensorRT-LLM batches on two attention-DP ranks (signed hashes, a replayed first batch, a ``created`` event
    ignored, an image block) give the exact overlaps; SIGTERM ends both with the engine's status."""
    opts = tmp_path / "opts.json"
    opts.write_text(json.dumps({"enable_attention_dp": True, "kv_cache_config": {"tokens_per_block": BS}}))
    args = ["serve", "my-model", "--tp_size", "2", "--extra_llm_api_options", str(opts)]
    async with trtllm_pair(nats_url, uid, tmp_path, args) as (p, proc):
        await expect(
            p,
            [T, R1, IMAGE_AS_TEXT],
            [{"w/0": 3, "w/1": 0}, {"w/0": 0, "w/1": 1}, {"w/0": 0, "w/1": 0}],
            model="my-model",
            timeout_s=30,
        )
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 5
