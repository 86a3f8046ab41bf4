"""``kvmesh vllm`` / ``kvmesh sglang``: start an engine with KV events on, and an ingest attached to it.

```
 kvmesh vllm --worker-id W -- serve MODEL [vllm args]
   ├── IngestService (this process, this event loop): SUB tcp://HOST:PORT+r, replay tcp://HOST:RPORT+r
   └── vllm serve MODEL [vllm args] --enable-prefix-caching \\
         --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                              "endpoint": "tcp://*:PORT", "replay_endpoint": "tcp://*:RPORT", ...}'
```

Argument building is pure (`build_vllm_command`, `build_sglang_command`): it reads the model, the served
name, the data-parallel size and the block size from the user's engine arguments, adds the KV-event
configuration, and refuses arguments that would turn the events off. `run_engine` is the process shell: it
starts the ingest first (its SUB sockets connect whenever the engine binds, before the engine can have
served anything), then the engine; it forwards SIGINT/SIGTERM to the engine, stops the ingest when the
engine exits (publishing what is buffered), stops the engine when the ingest fails, and returns the
engine's exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvmesh.core.errors import KvmeshError
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.service import IngestService
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import DEFAULT_NATS_URL
from kvmesh.runtime.runner import setup_logging

log = logging.getLogger("kvmesh.ingest.engines")

DEFAULT_EVENTS_PORT: Final[int] = 5557
"""vLLM's default KV-event PUB port."""
DEFAULT_VLLM_BIN: Final[str] = "vllm"
DEFAULT_SGLANG_BIN: Final[str] = "python -m sglang.launch_server"
_STOP_TIMEOUT_S: Final[float] = 30.0
"""Seconds the engine gets to exit after the forwarded signal before it is killed."""


class EngineArgsError(KvmeshError, ValueError):
    """The engine arguments cannot be used with kvmesh (events off, DP size unreadable, ports overlap, ...)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineCommand:
    """An engine command line with KV events on, and where its ingest reads them."""

    argv: list[str]
    """The engine's full command line."""
    model: str
    """Model name route requests use: the served model name, else the model."""
    data_parallel_size: int
    """Ranks publishing events; rank r on events port + r and replay port + r."""
    endpoint: str
    """Rank 0's PUB endpoint as the ingest connects to it."""
    replay_endpoint: str
    """Rank 0's replay endpoint as the ingest connects to it."""
    topic: str
    """ZMQ topic of the events."""
    block_size: int | None
    """Block size the engine was given (``--block-size`` / ``--page-size``), None when left to the engine."""
    data_parallel_start_rank: int = 0
    """First rank this node runs (vLLM ``--data-parallel-start-rank``; SGLang from ``--node-rank``)."""
    data_parallel_size_local: int | None = None
    """Ranks this node runs from the start rank (vLLM ``--data-parallel-size-local``); None: all of them."""
    context_length: int | None = None
    """Context length the engine was given (vLLM ``--max-model-len``, SGLang ``--context-length``)."""
    kv_capacity_blocks: int | None = None
    """KV blocks per rank the engine was given (vLLM ``--num-gpu-blocks-override``, SGLang
    ``--max-total-tokens`` / page size)."""


def _find(args: Sequence[str], names: Sequence[str]) -> tuple[int, str | None] | None:
    """Return (index, value) of the last ``--name value`` / ``--name=value`` in ``args``; value None if it has none."""
    found: tuple[int, str | None] | None = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name:
                found = (i, args[i + 1] if i + 1 < len(args) else None)
            elif arg.startswith(name + "="):
                found = (i, arg[len(name) + 1 :])
    return found


def _int_flag(
    args: Sequence[str], names: Sequence[str], default: int | None, *, minimum: int = 1
) -> int | None:
    """The last ``names[0]`` integer flag in ``args`` (≥ ``minimum``), or ``default`` when absent."""
    hit = _find(args, names)
    if hit is None:
        return default
    try:
        value = int(hit[1] or "")
    except ValueError:
        raise EngineArgsError(f"{names[0]} needs an integer, got {hit[1]!r}") from None
    if value < minimum:
        raise EngineArgsError(f"{names[0]} must be ≥ {minimum}, got {value}")
    return value


def _rank_flag(args: Sequence[str], names: Sequence[str], default: int) -> int:
    """An integer ≥ 0 flag (a start rank or a node rank)."""
    value = _int_flag(args, names, default, minimum=0)
    assert value is not None
    return value


def _vllm_node(args: Sequence[str], dp: int) -> tuple[int, int | None]:
    """The ranks of this vLLM node: ``(start, local)`` (local None: every rank, one node).

    vLLM runs ranks ``[--data-parallel-start-rank, + --data-parallel-size-local)`` on a node of a multi-node
    deployment, or the one rank ``--data-parallel-rank`` (external load balancing); each binds its KV-event
    sockets on the configured port + its global rank (``ZmqEventPublisher.offset_endpoint_port`` with
    ``data_parallel_rank``), wherever it runs.
    """
    local = _int_flag(args, ["--data-parallel-size-local", "-dpl"], None)
    start = _rank_flag(args, ["--data-parallel-start-rank", "-dpr"], 0)
    one = _find(args, ["--data-parallel-rank", "-dpn"])
    if one is not None:
        start, local = _rank_flag(args, ["--data-parallel-rank", "-dpn"], 0), 1
    if local is None and start == 0:
        return 0, None
    if local is None:
        local = dp - start
    if not (start < dp and 1 <= local <= dp - start):
        raise EngineArgsError(
            f"this node's data-parallel ranks [{start}, {start + local}) are not within "
            f"--data-parallel-size {dp}"
        )
    return start, (None if local == dp else local)


def _sglang_node(args: Sequence[str], dp: int) -> tuple[int, int | None]:
    """The DP ranks whose KV events this SGLang node publishes: ``(start, local)`` (local None: all).

    SGLang lays tensor-parallel ranks out node by node (node k holds tp ranks ``[k·tp/nnodes, (k+1)·tp/nnodes)``)
    and numbers a scheduler's KV-event publisher by its attention-DP rank ``tp_rank // (tp/dp)`` (its DP rank
    without DP attention; ``select_kv_publisher_dp_rank``), offsetting the port by it. So node k of n
    publishes ranks ``[k·dp/n, (k+1)·dp/n)`` when n divides dp, and when a DP group spans n/dp nodes only its
    first node (the one with attention-TP rank 0) publishes it.

    Raises:
        EngineArgsError: a node rank outside ``--nnodes``, DP size and node count that do not divide, or a
            node that publishes no events (a DP group's later node).
    """
    nnodes = _int_flag(args, ["--nnodes"], 1)
    assert nnodes is not None
    node = _rank_flag(args, ["--node-rank"], 0)
    if nnodes == 1:
        return 0, None
    if node >= nnodes:
        raise EngineArgsError(f"--node-rank {node} is not below --nnodes {nnodes}")
    if dp % nnodes == 0:
        local = dp // nnodes
        return node * local, local
    if nnodes % dp == 0:
        per_rank = nnodes // dp
        if node % per_rank:
            raise EngineArgsError(
                f"node {node} of {nnodes} publishes no KV events: each of the {dp} DP rank(s) spans {per_rank} "
                f"nodes and only its first node (node rank a multiple of {per_rank}) publishes them; run the "
                "engine here without kvmesh"
            )
        return node // per_rank, 1
    raise EngineArgsError(
        f"--dp-size {dp} and --nnodes {nnodes}: one must divide the other to tell which DP ranks a node runs"
    )


def _events_config(args: Sequence[str], *, vllm: bool) -> tuple[dict[str, Any], list[str]]:
    """Return the user's ``--kv-events-config`` (empty if none) and ``args`` without it.

    Raises:
        EngineArgsError: the config is not a JSON object, or it turns the events off.
    """
    hit = _find(args, ["--kv-events-config"])
    if hit is None:
        return {}, list(args)
    i, text = hit
    rest = list(args[:i]) + list(args[i + (1 if "=" in args[i] else 2) :])
    try:
        config = json.loads(text or "")
    except json.JSONDecodeError as exc:
        raise EngineArgsError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise EngineArgsError("--kv-events-config must be a JSON object")
    if vllm and config.get("enable_kv_cache_events") is not True:
        raise EngineArgsError(
            "--kv-events-config has enable_kv_cache_events off: kvmesh needs the engine's KV events; "
            "drop the option (kvmesh sets it) or set it to true"
        )
    if config.get("publisher", "zmq") != "zmq":
        raise EngineArgsError(
            f"--kv-events-config publisher is {config.get('publisher')!r}: kvmesh reads the zmq publisher; "
            'drop the option or set "publisher": "zmq"'
        )
    return config, rest


def _port_of(endpoint: str) -> int:
    _, _, port = endpoint.rpartition(":")
    if not port.isdecimal():
        raise EngineArgsError(f"KV-event endpoint {endpoint!r} needs a tcp port")
    return int(port)


def _finish(
    argv: list[str],
    config: dict[str, Any],
    *,
    model: str,
    dp: int,
    host: str,
    events_port: int,
    replay_port: int | None,
    topic: str | None,
    block_size: int | None,
    node: tuple[int, int | None] = (0, None),
    context_length: int | None = None,
    kv_capacity_blocks: int | None = None,
) -> EngineCommand:
    """Fill in the endpoints and topic, check the port ranges, and append the config to ``argv``.

    Every node of a multi-node engine is given the same base ports: its rank r binds port + r (its global
    rank), so the ranges of all ``dp`` ranks are checked.
    """
    if "endpoint" in config:
        events_port = _port_of(str(config["endpoint"]))
    if config.get("replay_endpoint"):
        replay_port = _port_of(str(config["replay_endpoint"]))
    if replay_port is None:
        replay_port = events_port + dp
    if events_port < replay_port + dp and replay_port < events_port + dp:
        raise EngineArgsError(
            f"events ports {events_port}…{events_port + dp - 1} and replay ports {replay_port}…"
            f"{replay_port + dp - 1} overlap ({dp} data-parallel ranks take one port each)"
        )
    if events_port + dp - 1 > 65535 or replay_port + dp - 1 > 65535:
        raise EngineArgsError("KV-event ports past 65535")
    config.setdefault("endpoint", f"tcp://*:{events_port}")
    config["replay_endpoint"] = config.get("replay_endpoint") or f"tcp://*:{replay_port}"
    if topic is not None:
        config["topic"] = topic
    argv += ["--kv-events-config", json.dumps(config)]
    return EngineCommand(
        argv=argv,
        model=model,
        data_parallel_size=dp,
        endpoint=f"tcp://{host}:{events_port}",
        replay_endpoint=f"tcp://{host}:{replay_port}",
        topic=str(config.get("topic", "")),
        block_size=block_size,
        data_parallel_start_rank=node[0],
        data_parallel_size_local=node[1],
        context_length=context_length,
        kv_capacity_blocks=kv_capacity_blocks,
    )


def build_vllm_command(
    user_args: Sequence[str],
    *,
    vllm_bin: str = DEFAULT_VLLM_BIN,
    host: str = "127.0.0.1",
    events_port: int = DEFAULT_EVENTS_PORT,
    replay_port: int | None = None,
    topic: str | None = None,
    model_name: str | None = None,
) -> EngineCommand:
    """Build a ``vllm serve`` command line with KV events on (PUB + replay, every DP rank).

    Adds ``--kv-events-config`` (``enable_kv_cache_events`` true, publisher ``zmq``, ``endpoint``
    ``tcp://*:<events_port>``, ``replay_endpoint`` ``tcp://*:<replay_port>``, the topic) and
    ``--enable-prefix-caching`` when missing. A ``--kv-events-config`` the user gave with events on is kept
    (its endpoints too, ports read from them) and completed with a replay endpoint.

    Args:
        user_args: the arguments after ``--``: ``serve MODEL ...`` (``serve`` is added when missing).
        vllm_bin: the vllm executable (split like a shell word list).
        host: address the ingest connects to (the engine binds ``*``).
        events_port: rank 0's PUB port; rank r uses + r.
        replay_port: rank 0's replay port; default events_port + DP size.
        topic: ZMQ topic to set (None: the user's, else empty).
        model_name: model name route requests use; default ``--served-model-name``, else the model.

    Raises:
        EngineArgsError: no model, events or prefix caching turned off, a bad DP size, or overlapping ports.
    """
    args = list(user_args)
    if not args or args[0] != "serve":
        args.insert(0, "serve")
    config, args = _events_config(args, vllm=True)
    if _find(args, ["--no-enable-prefix-caching"]) is not None:
        raise EngineArgsError("--no-enable-prefix-caching: vLLM emits no KV events without prefix caching")
    model_hit = _find(args, ["--model"])
    if len(args) > 1 and not args[1].startswith("-"):
        model = args[1]
    elif model_hit is not None and model_hit[1]:
        model = model_hit[1]
    else:
        raise EngineArgsError("no model: give it as `serve MODEL` or --model MODEL")
    served = _find(args, ["--served-model-name"])
    dp = _int_flag(args, ["--data-parallel-size", "-dp"], 1)
    assert dp is not None
    block_size = _int_flag(args, ["--block-size"], None)
    node = _vllm_node(args, dp)
    if _find(args, ["--enable-prefix-caching"]) is None:
        args.append("--enable-prefix-caching")
    config["enable_kv_cache_events"] = True
    config["publisher"] = "zmq"
    return _finish(
        [*shlex.split(vllm_bin), *args],
        config,
        model=model_name or (served[1] if served and served[1] else model),
        dp=dp,
        host=host,
        events_port=events_port,
        replay_port=replay_port,
        topic=topic,
        block_size=block_size,
        node=node,
        context_length=_context_flag(args, ["--max-model-len"]),
        kv_capacity_blocks=_int_flag(args, ["--num-gpu-blocks-override"], None),
    )


def _context_flag(args: Sequence[str], names: Sequence[str]) -> int | None:
    """A context length flag: an integer, or vLLM's human form (``32k``, ``1M``: ×1000 / ×1,000,000;
    ``32K``, ``1m``… binary ×1024 as vLLM reads them); ``-1``/``auto`` (the model's own): None."""
    hit = _find(args, names)
    if hit is None or hit[1] in (None, "-1", "auto"):
        return None
    text = hit[1]
    factors = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}
    try:
        value = int(float(text[:-1]) * factors[text[-1]]) if text[-1:] in factors else int(text)
    except ValueError:
        raise EngineArgsError(f"{names[0]} needs a token count, got {text!r}") from None
    if value < 1:
        raise EngineArgsError(f"{names[0]} must be ≥ 1, got {value}")
    return value


def build_sglang_command(
    user_args: Sequence[str],
    *,
    sglang_bin: str = DEFAULT_SGLANG_BIN,
    host: str = "127.0.0.1",
    events_port: int = DEFAULT_EVENTS_PORT,
    replay_port: int | None = None,
    topic: str | None = None,
    model_name: str | None = None,
) -> EngineCommand:
    """Build a ``python -m sglang.launch_server`` command line with KV events on.

    Adds ``--kv-events-config`` (publisher ``zmq``, ``endpoint``, ``replay_endpoint``, the topic). The
    data-parallel size is ``--dp-size`` (``--dp``); SGLang publishes one stream per DP rank, or per
    attention-DP rank with ``--enable-dp-attention``, which is then the same count.

    Args:
        user_args: the launch_server arguments after ``--`` (``--model-path M ...``).
        sglang_bin: the launcher (split like a shell word list).
        host: address the ingest connects to (the engine binds ``*``).
        events_port: rank 0's PUB port; rank r uses + r.
        replay_port: rank 0's replay port; default events_port + DP size.
        topic: ZMQ topic to set (None: the user's, else empty).
        model_name: model name route requests use; default ``--served-model-name``, else the model path.

    Raises:
        EngineArgsError: no model, events turned off, a bad DP size, or overlapping ports.
    """
    config, args = _events_config(user_args, vllm=False)
    model_hit = _find(args, ["--model-path", "--model"])
    if model_hit is None or not model_hit[1]:
        raise EngineArgsError("no model: give --model-path MODEL")
    served = _find(args, ["--served-model-name"])
    dp = _int_flag(args, ["--dp-size", "--dp"], 1)
    assert dp is not None
    node = _sglang_node(args, dp)
    page = _int_flag(args, ["--page-size"], None)
    total_tokens = _int_flag(args, ["--max-total-tokens"], None)
    config["publisher"] = "zmq"
    return _finish(
        [*shlex.split(sglang_bin), *args],
        config,
        model=model_name or (served[1] if served and served[1] else model_hit[1]),
        dp=dp,
        host=host,
        events_port=events_port,
        replay_port=replay_port,
        topic=topic,
        block_size=page,
        node=node,
        context_length=_int_flag(args, ["--context-length"], None),
        kv_capacity_blocks=total_tokens // (page or 1) if total_tokens is not None else None,
    )


# ---------------------------------------------------------------------- process shell


async def run_engine(
    cmd: EngineCommand,
    settings: IngestSettings,
    *,
    env: Mapping[str, str] | None = None,
    ingest_wait_s: float = 30.0,
) -> int:
    """Run the ingest, then the engine; stop both together; return the engine's exit status.

    The engine starts once the ingest is ready (connected, cursors recovered, sockets connecting), or after
    ``ingest_wait_s`` seconds at the latest: the engine never waits on NATS for long. SIGINT and SIGTERM are
    forwarded to the engine; when it exits the ingest publishes what it buffered and
    stops. If the ingest fails, the engine is stopped (SIGTERM, SIGKILL after 30 s) and 1 is returned.
    A signal that ended the engine is returned as 128 + its number, as a shell does.
    """
    loop = asyncio.get_running_loop()
    ingest = IngestService(settings)
    ingest_task = asyncio.create_task(ingest.run())
    ready = asyncio.create_task(ingest.ready.wait())
    await asyncio.wait([ingest_task, ready], timeout=ingest_wait_s, return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    if ingest_task.done():
        ingest_task.result()  # raises the ingest's error
        return 1
    if not ingest.ready.is_set():
        log.warning(
            "ingest not ready after %g s (NATS unreachable?); starting the engine anyway: the ingest attaches "
            "when it can, and batches the engine publishes before that are not indexed",
            ingest_wait_s,
        )
    log.info("starting engine: %s", shlex.join(cmd.argv))
    proc = await asyncio.create_subprocess_exec(*cmd.argv, env=dict(env) if env is not None else None)
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, _forward, proc, sig)
    engine = asyncio.create_task(proc.wait())
    failed = False
    try:
        await asyncio.wait([engine, ingest_task], return_when=asyncio.FIRST_COMPLETED)
        failed = ingest_task.done()
        if failed:
            exc = ingest_task.exception() if not ingest_task.cancelled() else None
            log.error("ingest stopped (%r); stopping the engine", exc)
            _forward(proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(engine), _STOP_TIMEOUT_S)
            except TimeoutError:
                proc.kill()
                await engine
        code = engine.result()
        log.info("engine exited with status %d; stopping the ingest", code)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        ingest.stop()
        if not ingest.ready.is_set():
            ingest_task.cancel()  # still waiting for NATS: nothing to publish
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(ingest_task, _STOP_TIMEOUT_S)
    if failed:
        return 1
    return 128 - code if code < 0 else code


def _forward(proc: asyncio.subprocess.Process, sig: int) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


# ---------------------------------------------------------------------- command line

_DESCRIPTION = """\
Start {engine} with KV-cache events on (PUB and replay sockets, every data-parallel rank) and a kvmesh
ingest attached to it; stop both together and exit with the engine's status. Everything after `--` goes to
the engine; kvmesh adds --kv-events-config{extra}.

Read from the engine's own flags (after `--`): {read}. Every node of a
multi-node deployment gets the same --events-port; rank r is read on port + r (the engine offsets by the
global rank), and each node's ingest reads only its own ranks.

example: kvmesh {name} --worker-id w0 --nats-url nats://nats:4222 -- {example}
"""
_VLLM_READS = (
    "the model and --served-model-name, --data-parallel-size, --data-parallel-size-local (-dpl), "
    "--data-parallel-start-rank (-dpr), --data-parallel-rank, --block-size, --max-model-len (context "
    "length), --num-gpu-blocks-override (KV capacity)"
)
_SGLANG_READS = (
    "--model-path and --served-model-name, --dp-size, --nnodes and --node-rank (this node's ranks), "
    "--page-size, --context-length, --max-total-tokens (KV capacity)"
)


def split_wrapper_args(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """(kvmesh's options, the engine's arguments after ``--``) of an engine wrapper's command line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        return args, []
    cut = args.index("--")
    return args[:cut], args[cut + 1 :]


def wrapper_parser(
    prog: str,
    description: str,
    *,
    bin_flag: str,
    bin_default: str,
    bin_help: str,
    model_help: str,
    replay_help: str,
    topic_help: str,
) -> argparse.ArgumentParser:
    """The options every engine wrapper (`kvmesh vllm`, `kvmesh sglang`, `kvmesh trtllm`) takes; the engine's
    executable flag is ``bin_flag`` (e.g. ``--vllm-bin``)."""
    environ = os.environ
    parser = argparse.ArgumentParser(
        prog=prog,
        description="\n\n".join(
            textwrap.fill(" ".join(p.split()), 108, break_on_hyphens=False) for p in description.split("\n\n")
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--worker-id", required=True, help="worker id, as route replies name it")
    parser.add_argument("--model-name", default=None, help=model_help)
    parser.add_argument(
        "--nats-url",
        default=environ.get("KVMESH_NATS_URL", DEFAULT_NATS_URL),
        help="NATS URL [env KVMESH_NATS_URL]",
    )
    parser.add_argument(bin_flag, dest="engine_bin", metavar="PATH", default=bin_default, help=bin_help)
    parser.add_argument(
        "--events-port",
        type=int,
        default=DEFAULT_EVENTS_PORT,
        help="rank 0's PUB port; rank r on port + r (default %(default)s)",
    )
    parser.add_argument("--replay-port", type=int, default=None, help=replay_help)
    parser.add_argument("--host", default="127.0.0.1", help="address the ingest reaches the engine on")
    parser.add_argument("--topic", default=None, help=topic_help)
    parser.add_argument("--stream", default=subjects.STREAM, help="JetStream stream name")
    parser.add_argument(
        "--events-prefix", default=subjects.EVENTS_PREFIX, help="subject prefix of the stream"
    )
    parser.add_argument(
        "--ingest-wait-s",
        type=float,
        default=30.0,
        help="start the engine after this long even if the ingest cannot reach NATS yet (default %(default)s)",
    )
    parser.add_argument("--log-level", default=environ.get("KVMESH_LOG_LEVEL", "INFO"), help="log level")
    parser.add_argument(
        "--metrics-url",
        default=environ.get("KVMESH_INGEST_METRICS_URL"),
        help="the engine's Prometheus /metrics URL: its load is published for the routers, and a sleep it "
        "reports there clears the worker (default: off) [env KVMESH_INGEST_METRICS_URL]",
    )
    return parser


def wrapper_settings(
    cmd: EngineCommand, a: argparse.Namespace, parser: argparse.ArgumentParser
) -> IngestSettings:
    """The ingest settings of a wrapped engine: where `cmd` publishes, plus the wrapper's NATS options; a
    problem with them exits through ``parser.error``."""
    settings = IngestSettings(
        worker_id=a.worker_id,
        model=cmd.model,
        zmq_endpoint=cmd.endpoint,
        replay_endpoint=cmd.replay_endpoint,
        data_parallel_size=cmd.data_parallel_size,
        data_parallel_start_rank=cmd.data_parallel_start_rank,
        data_parallel_size_local=cmd.data_parallel_size_local,
        topic=cmd.topic,
        block_size=cmd.block_size,
        context_length=cmd.context_length,
        kv_capacity_blocks=cmd.kv_capacity_blocks,
        nats_url=a.nats_url,
        stream=a.stream,
        events_prefix=a.events_prefix,
        log_level=a.log_level,
        metrics_url=a.metrics_url,
    )
    problems = settings.validate()
    if problems:
        parser.error("; ".join(problems))
    return settings


def launch_wrapped(
    cmd: EngineCommand, settings: IngestSettings, a: argparse.Namespace, *, prog: str, engine: str, label: str
) -> int:
    """Run a wrapped engine and its ingest until the engine exits (its status; 127 when the executable is
    missing, 1 on a kvmesh error, 130 on Ctrl-C). ``engine`` names the wrapper (``trtllm``), ``label`` the
    product (``TensorRT-LLM``)."""
    if shutil.which(cmd.argv[0]) is None:  # before the ingest registers anything
        print(
            f"{prog}: error: {cmd.argv[0]} not found (is {label} installed? --{engine}-bin names the executable)",
            file=sys.stderr,
        )
        return 127
    setup_logging(a.log_level, engine)
    try:
        return asyncio.run(run_engine(cmd, settings, ingest_wait_s=a.ingest_wait_s))
    except KvmeshError as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130


def _command(argv: Sequence[str] | None, prog: str, *, engine: str) -> int:
    ours, engine_args = split_wrapper_args(argv)
    vllm = engine == "vllm"
    parser = wrapper_parser(
        prog,
        _DESCRIPTION.format(
            engine="vLLM" if vllm else "SGLang",
            name=engine,
            extra=" and --enable-prefix-caching" if vllm else "",
            read=_VLLM_READS if vllm else _SGLANG_READS,
            example="serve meta-llama/Llama-3.1-8B --data-parallel-size 2"
            if vllm
            else "--model-path meta-llama/Llama-3.1-8B --dp-size 2 --enable-dp-attention",
        ),
        bin_flag=f"--{engine}-bin",
        bin_default=DEFAULT_VLLM_BIN if vllm else DEFAULT_SGLANG_BIN,
        bin_help="vllm executable (default %(default)s)" if vllm else "launcher (default %(default)s)",
        model_help="model name route requests use (default: the served name)",
        replay_help="rank 0's replay port (default events + DP size)",
        topic_help="ZMQ topic (default: the engine config's, else none)",
    )
    a = parser.parse_args(ours)
    if not engine_args:
        parser.error("give the engine's arguments after `--`")
    where = {
        "host": a.host,
        "events_port": a.events_port,
        "replay_port": a.replay_port,
        "topic": a.topic,
        "model_name": a.model_name,
    }
    try:
        if vllm:
            cmd = build_vllm_command(engine_args, vllm_bin=a.engine_bin, **where)
        else:
            cmd = build_sglang_command(engine_args, sglang_bin=a.engine_bin, **where)
    except EngineArgsError as exc:
        parser.error(str(exc))
    settings = wrapper_settings(cmd, a, parser)
    return launch_wrapped(cmd, settings, a, prog=prog, engine=engine, label="vLLM" if vllm else "SGLang")


def vllm_command(argv: Sequence[str] | None = None, prog: str = "kvmesh vllm") -> int:
    """``kvmesh vllm [options] -- serve MODEL [vllm args]``; returns the engine's exit status."""
    return _command(argv, prog, engine="vllm")


def sglang_command(argv: Sequence[str] | None = None, prog: str = "kvmesh sglang") -> int:
    """``kvmesh sglang [options] -- --model-path MODEL [sglang args]``; returns the engine's exit status."""
    return _command(argv, prog, engine="sglang")
