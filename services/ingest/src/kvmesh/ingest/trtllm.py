"""``kvmesh trtllm``: start ``trtllm-serve`` with its streaming KV events on, and an ingest attached to it.

```
 kvmesh trtllm --worker-id W -- serve MODEL [trtllm-serve args]
   ├── IngestService (this process): SUB tcp://HOST:PORT+r, replay tcp://HOST:RPORT+r
   └── trtllm-serve serve MODEL [args] --extra_llm_api_options <options file>
         kv_cache_config: {enable_block_reuse: true, use_kv_cache_manager_v2: true, tokens_per_block: …,
                           kv_events_config: {enable_kv_cache_events: true, publisher: zmq,
                                              endpoint: tcp://*:PORT, replay_endpoint: tcp://*:RPORT}}
```

TensorRT-LLM's KV cache manager V2 publishes vLLM-compatible batches over ZMQ
(``tensorrt_llm/_torch/pyexecutor/kv_cache_events.py``; the payload is in ``docs/wire-trtllm.md``): one
PUB and one replay ROUTER per attention-DP rank on base port + rank. Its options live in the LLM-API options
file (``--extra_llm_api_options``, ``--config`` in newer releases): the user's file, when given, is read
(JSON, or YAML when PyYAML is installed), completed, and written next to it as JSON (which YAML reads).
Ranks: ``--tp_size`` with ``enable_attention_dp``, else one (tensor-parallel ranks share one cache). The
process shell is `kvmesh.ingest.engines.run_engine`, as for ``kvmesh vllm``.
"""

from __future__ import annotations

import json
import shlex
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from kvmesh.ingest.engines import (
    DEFAULT_EVENTS_PORT,
    EngineArgsError,
    EngineCommand,
    _find,
    _int_flag,
    launch_wrapped,
    split_wrapper_args,
    wrapper_parser,
    wrapper_settings,
)

DEFAULT_TRTLLM_BIN: Final[str] = "trtllm-serve"
OPTIONS_FLAGS: Final[tuple[str, ...]] = ("--extra_llm_api_options", "--config")
"""trtllm-serve's LLM-API options file flag (``--config`` is its newer name)."""
OPTIONS_FILE: Final[str] = "kvmesh-trtllm-options.json"


def _read_options(path: str) -> dict[str, Any]:
    """The user's options file as a dict (JSON, else YAML through PyYAML).

    Raises:
        EngineArgsError: unreadable, not a mapping, or YAML without PyYAML installed.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise EngineArgsError(f"cannot read the options file {path}: {exc.strerror}") from None
    try:
        data: Any = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        try:
            import yaml  # noqa: PLC0415 (optional: only YAML option files need it)
        except ImportError:
            raise EngineArgsError(
                f"{path} is not JSON; reading YAML needs PyYAML (pip install pyyaml), or give the options as JSON"
            ) from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise EngineArgsError(f"{path} is not YAML: {exc}") from None
    if not isinstance(data, dict):
        raise EngineArgsError(f"{path} must hold a mapping of LLM-API options")
    return data


def _events_options(kv: dict[str, Any]) -> dict[str, Any]:
    """``kv_cache_config.kv_events_config``, checked: events on (or unset), the zmq publisher.

    Raises:
        EngineArgsError: the user turned the events, block reuse or KV cache manager V2 off.
    """
    if kv.get("enable_block_reuse") is False:
        raise EngineArgsError(
            "kv_cache_config.enable_block_reuse is false: TensorRT-LLM emits no KV events then"
        )
    if kv.get("use_kv_cache_manager_v2") is False:
        raise EngineArgsError(
            "kv_cache_config.use_kv_cache_manager_v2 is false: TensorRT-LLM streams KV events from manager V2 only"
        )
    events = kv.get("kv_events_config") or {}
    if not isinstance(events, dict):
        raise EngineArgsError("kv_cache_config.kv_events_config must be a mapping")
    if events.get("enable_kv_cache_events") is False:
        raise EngineArgsError(
            "kv_events_config.enable_kv_cache_events is false: kvmesh needs the engine's KV events"
        )
    if events.get("publisher", "zmq") != "zmq":
        raise EngineArgsError(
            f"kv_events_config.publisher is {events.get('publisher')!r}: kvmesh reads the zmq publisher"
        )
    return dict(events)


def _port(endpoint: Any, what: str) -> int:
    _, _, port = str(endpoint).rpartition(":")
    if not port.isdecimal():
        raise EngineArgsError(f"{what} {endpoint!r} needs a tcp port")
    return int(port)


def build_trtllm_command(
    user_args: Sequence[str],
    *,
    options_dir: Path,
    trtllm_bin: str = DEFAULT_TRTLLM_BIN,
    host: str = "127.0.0.1",
    events_port: int = DEFAULT_EVENTS_PORT,
    replay_port: int | None = None,
    topic: str | None = None,
    model_name: str | None = None,
) -> EngineCommand:
    """Build a ``trtllm-serve serve`` command line with streaming KV events on (PUB + replay, every rank).

    Writes the options file ``options_dir/kvmesh-trtllm-options.json``: the user's options (the file of
    ``--extra_llm_api_options`` / ``--config``, when given) with ``kv_cache_config.enable_block_reuse`` and
    ``use_kv_cache_manager_v2`` true and ``kv_events_config`` set (events on, zmq, ``endpoint``
    ``tcp://*:<events_port>``, ``replay_endpoint`` ``tcp://*:<replay_port>``, the topic); endpoints the user
    set are kept and their ports read.

    Args:
        user_args: the arguments after ``--``: ``serve MODEL ...`` (``serve`` is added when missing).
        options_dir: where the completed options file is written.
        trtllm_bin: the trtllm-serve executable (split like a shell word list).
        host: address the ingest connects to (the engine binds ``*``).
        events_port: rank 0's PUB port; rank r uses + r.
        replay_port: rank 0's replay port; default events_port + ranks.
        topic: ZMQ topic to set (None: the user's, else empty).
        model_name: model name route requests use; default the model argument.

    Raises:
        EngineArgsError: no model, events / block reuse / manager V2 turned off, a bad options file or
            ``--tp_size``, overlapping ports.
    """
    args = list(user_args)
    if not args or args[0] != "serve":
        args.insert(0, "serve")
    if len(args) < 2 or args[1].startswith("-"):
        raise EngineArgsError("no model: give it as `serve MODEL`")
    model = args[1]
    hit = _find(args, OPTIONS_FLAGS)
    options: dict[str, Any] = {}
    if hit is not None:
        i, given = hit
        if not given:
            raise EngineArgsError(f"{args[i]} needs a file")
        options = _read_options(given)
        del args[i : i + (1 if "=" in args[i] else 2)]
    kv = options.get("kv_cache_config") or {}
    if not isinstance(kv, dict):
        raise EngineArgsError("kv_cache_config must be a mapping")
    events = _events_options(kv)
    attention_dp = (
        bool(options.get("enable_attention_dp")) or _find(args, ["--enable_attention_dp"]) is not None
    )
    tp = _int_flag(args, ["--tp_size"], 1)
    assert tp is not None
    dp = tp if attention_dp else 1
    if "endpoint" in events:
        events_port = _port(events["endpoint"], "kv_events_config.endpoint")
    if events.get("replay_endpoint"):
        replay_port = _port(events["replay_endpoint"], "kv_events_config.replay_endpoint")
    if replay_port is None:
        replay_port = events_port + dp
    if events_port < replay_port + dp and replay_port < events_port + dp:
        raise EngineArgsError(
            f"events ports {events_port}…{events_port + dp - 1} and replay ports {replay_port}…"
            f"{replay_port + dp - 1} overlap ({dp} attention-DP ranks take one port each)"
        )
    if max(events_port, replay_port) + dp - 1 > 65535:
        raise EngineArgsError("KV-event ports past 65535")
    events.update(enable_kv_cache_events=True, publisher="zmq")
    events.setdefault("endpoint", f"tcp://*:{events_port}")
    events["replay_endpoint"] = events.get("replay_endpoint") or f"tcp://*:{replay_port}"
    if topic is not None:
        events["topic"] = topic
    block_size = kv.get("tokens_per_block")
    if block_size is not None and (type(block_size) is not int or block_size < 1):
        raise EngineArgsError(f"kv_cache_config.tokens_per_block must be a positive int, got {block_size!r}")
    options["kv_cache_config"] = {
        **kv,
        "enable_block_reuse": True,
        "use_kv_cache_manager_v2": True,
        "kv_events_config": events,
    }
    written = options_dir / OPTIONS_FILE
    written.write_text(json.dumps(options, indent=2) + "\n")
    return EngineCommand(
        argv=[*shlex.split(trtllm_bin), *args, OPTIONS_FLAGS[0], str(written)],
        model=model_name or model,
        data_parallel_size=dp,
        endpoint=f"tcp://{host}:{events_port}",
        replay_endpoint=f"tcp://{host}:{replay_port}",
        topic=str(events.get("topic", "")),
        block_size=block_size,
        context_length=_int_flag(args, ("--max_seq_len",), None),
    )


def trtllm_command(argv: Sequence[str] | None = None, prog: str = "kvmesh trtllm") -> int:
    """``kvmesh trtllm [options] -- serve MODEL [trtllm-serve args]``; returns the engine's exit status."""
    ours, engine_args = split_wrapper_args(argv)
    parser = wrapper_parser(
        prog,
        "Start trtllm-serve with streaming KV-cache events on (KV cache manager V2; PUB and replay sockets on "
        "every attention-DP rank) and a kvmesh ingest attached to it; stop both together and exit with the "
        "engine's status. Everything after `--` goes to trtllm-serve; kvmesh completes the LLM-API options "
        "file (--extra_llm_api_options).\n\nexample: kvmesh trtllm --worker-id w0 -- serve "
        "Qwen/Qwen3-0.6B --tp_size 2 --extra_llm_api_options opts.yaml",
        bin_flag="--trtllm-bin",
        bin_default=DEFAULT_TRTLLM_BIN,
        bin_help="trtllm-serve executable (default %(default)s)",
        model_help="model name route requests use (default: the model)",
        replay_help="rank 0's replay port (default events + ranks)",
        topic_help="ZMQ topic (default: the options file's, else none)",
    )
    a = parser.parse_args(ours)
    if not engine_args:
        parser.error("give trtllm-serve's arguments after `--`")
    with tempfile.TemporaryDirectory(prefix="kvmesh-trtllm-") as tmp:
        try:
            cmd = build_trtllm_command(
                engine_args,
                options_dir=Path(tmp),
                trtllm_bin=a.engine_bin,
                host=a.host,
                events_port=a.events_port,
                replay_port=a.replay_port,
                topic=a.topic,
                model_name=a.model_name,
            )
        except EngineArgsError as exc:
            parser.error(str(exc))
        settings = wrapper_settings(cmd, a, parser)
        return launch_wrapped(cmd, settings, a, prog=prog, engine="trtllm", label="TensorRT-LLM")
