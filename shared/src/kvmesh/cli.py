"""The ``kvmesh`` command: one entry point for every service and tool.

Services (``ingest``, ``indexer``, ``router``) and the tools (``sim``, ``up``, ``bench``) are found through
the ``kvmesh.commands`` entry points their packages register, so this shared package imports neither. Every
service also runs as ``python -m kvmesh.<service>``. The operator commands here only parse their flags, call
`kvmesh.ops` (or `kvmesh.client`) and print the typed result as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import json
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client

from kvmesh import ops
from kvmesh.core.errors import KvmeshError, RouteError
from kvmesh.core.protocol import RouteRequest, SnapshotResult, encode
from kvmesh.core.state import MAX_BLOCKS_LIMIT
from kvmesh.ops.view import render_status, route_rates
from kvmesh.runtime import subjects
from kvmesh.runtime.config import NatsAuth, add_fields, load
from kvmesh.runtime.health import DEFAULT_MAX_AGE_S, check_health
from kvmesh.runtime.nats import DEFAULT_NATS_URL, connect, connect_options, redact_url
from kvmesh.runtime.runner import VERSION

__all__ = [
    "finish_command",
    "health_command",
    "main",
    "provision_command",
    "replay_command",
    "reset_command",
    "route_command",
    "snapshot_command",
    "status_command",
]

T = TypeVar("T")

PROVIDED_BY: dict[str, tuple[str, str]] = {
    "up": ("kvmesh-tools", "tools"),
    "sim": ("kvmesh-tools", "tools"),
    "bench": ("kvmesh-tools", "tools"),
    "gen-creds": ("kvmesh-tools", "tools"),
    "cluster": ("kvmesh-tools", "tools"),
    "ingest": ("kvmesh-ingest", "services/ingest"),
    "vllm": ("kvmesh-ingest", "services/ingest"),
    "sglang": ("kvmesh-ingest", "services/ingest"),
    "trtllm": ("kvmesh-ingest", "services/ingest"),
    "indexer": ("kvmesh-indexer", "services/indexer"),
    "router": ("kvmesh-router", "services/router"),
    "http": ("kvmesh-router", "services/router"),
}
"""The commands other distributions add (``kvmesh.commands`` entry points): the distribution, its folder."""

USAGE = """\
usage: kvmesh <command> [options]     (kvmesh <command> --help for each)

commands:
  up        run a whole kvmesh on this machine: NATS (embedded), simulated workers, ingests, indexer,
            router, and replay a request trace through it; --cluster 3 --chaos: kill -9 a random component
            every few seconds on a local 3-node cluster and show that nothing was lost
  ingest    read one engine's KV events (ZMQ) and publish them to the events stream
  vllm      start vLLM with KV events on and an ingest attached (kvmesh vllm --worker-id W -- serve M)
  sglang    start SGLang with KV events on and an ingest attached (kvmesh sglang --worker-id W -- ...)
  trtllm    start trtllm-serve with KV events on and an ingest attached (kvmesh trtllm --worker-id W -- serve M)
  indexer   rebuild the prefix index from the stream and answer match queries
  router    answer kvmesh.route requests: which worker holds the longest cached prefix
  http      a router that also serves the RFC #1403 indexer API over HTTP (/query, /query_by_hash,
            /register, ...: Mooncake's conductor and Dynamo's standalone indexer API)
  route     send one route request and print the reply
  finish    end routed requests by id at every router (their load stops counting; also --prefill-done)
  status    show the stream, indexer replicas, snapshots, workers and ingests
  snapshot  ask the index group's snapshot writer to write a snapshot now; print its stream sequence
  replay    rebuild an index offline from the stream (optionally from a snapshot): size, digest, time
  reset     start a new index epoch: every replica forgets its index at one point of the stream
  provision create the events stream and the index group's buckets (at --replicas) before the services
  health    check a service's --health-file (a container health check; reads no NATS)
  sim       run simulated vLLM workers that publish real KV events
  gen-creds generate NKey users, certificates and the nats-server authorization for deploy/nats
  cluster   run docker-compose.yml's services as local processes (a secured 3-node NATS cluster)
  bench     benchmarks: trace (routing policies on a Mooncake trace), index, ingest, route, recovery,
            soak (N minutes of traffic with periodic kills: memory, consumers, connections, nothing lost)

options:
  -h, --help     show this list
  --version      print the kvmesh version
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the kvmesh command line; returns the exit code (141 when stdout's reader went away, as a shell
    reports SIGPIPE, silently: ``kvmesh --help | head``)."""
    try:
        code = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader of stdout is gone: say nothing more, and keep the interpreter's final flush quiet.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141
    return code


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(f"kvmesh {VERSION}")
        return 0
    name, rest = args[0], args[1:]
    builtin: dict[str, Callable[[Sequence[str]], int]] = {
        "route": route_command,
        "finish": finish_command,
        "status": status_command,
        "snapshot": snapshot_command,
        "replay": replay_command,
        "reset": reset_command,
        "provision": provision_command,
        "health": health_command,
    }
    if name in builtin:
        return builtin[name](rest)
    services = {ep.name: ep for ep in entry_points(group="kvmesh.commands")}  # the services' and tools'
    if name in services:
        command: Callable[..., int] = services[name].load()
        return command(rest, prog=f"kvmesh {name}")
    if name in PROVIDED_BY:  # a command of a distribution this installation lacks (the library alone)
        dist, folder = PROVIDED_BY[name]
        print(
            f"kvmesh {name}: part of {dist}, which is not installed here "
            f"(from a checkout: make install, or pip install ./{folder})",
            file=sys.stderr,
        )
        return 2
    known = sorted({*builtin, *services})
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    print(f"kvmesh: unknown command {name!r}{hint}\n\n{USAGE}", file=sys.stderr)
    return 2


def _parser(
    command: str, description: str, *, stream: bool = True, prefix: bool = False
) -> argparse.ArgumentParser:
    """The parser of ``kvmesh <command>`` with the shared NATS flags: ``--nats-url``, the credentials and TLS
    flags of `NatsAuth` (``--nats-user``, ``--nats-creds-file``, ``--nats-tls-ca-file``, ...; environment
    ``KVMESH_NATS_*``); for the index group's commands ``--stream``, and ``--events-prefix`` for those that
    read the stream's subjects."""
    parser = argparse.ArgumentParser(
        prog=f"kvmesh {command}",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description=description,
    )
    parser.add_argument(
        "--nats-url",
        default=os.environ.get("KVMESH_NATS_URL", DEFAULT_NATS_URL),
        help="NATS URL [env KVMESH_NATS_URL]",
    )
    group = parser.add_argument_group("NATS credentials and TLS")
    add_fields(group, NatsAuth, "nats")
    group.add_argument(
        "--config",
        dest="_config",
        type=Path,
        default=None,
        metavar="FILE",
        help="TOML file with the NATS credentials and TLS settings (a [nats] table or top-level keys)",
    )
    if stream:
        parser.add_argument("--stream", default=subjects.STREAM, help="events stream (the index group)")
    if prefix:
        parser.add_argument(
            "--events-prefix",
            default=None,
            help="subject prefix of the stream (when not given: taken from the stream's subjects)",
        )
    parser.set_defaults(command=command)
    return parser


def nats_auth(a: argparse.Namespace, environ: Mapping[str, str] | None = None) -> NatsAuth:
    """The NATS credentials and TLS settings of an operator command: its flags over ``KVMESH_NATS_*`` over the
    ``[nats]`` table of ``--config``.

    Raises:
        ConfigError: a value is wrong (two ways of authenticating, a missing file).
    """
    return load(NatsAuth, service="nats", environ=os.environ if environ is None else environ, args=a)


def _print_json(value: Any) -> int:
    """Print a result (a Struct, or plain data) as indented JSON; return exit status 0."""
    print(json.dumps(msgspec.to_builtins(value), indent=2))
    return 0


def _error(a: argparse.Namespace, text: str) -> int:
    """Print ``kvmesh <command>: <text>`` on stderr; return exit status 1."""
    print(f"kvmesh {a.command}: {text}", file=sys.stderr)
    return 1


def _run(
    a: argparse.Namespace, work: Callable[[Client], Awaitable[T]], show: Callable[[T], int] = _print_json
) -> int:
    """Connect to ``--nats-url``, await ``work`` on the connection, close it, and return ``show(result)``;
    a `KvmeshError` (no connection, a transport failure, a missing stream) is one line on stderr, exit 1."""

    try:
        options = connect_options(nats_auth(a))
    except KvmeshError as exc:
        return _error(a, str(exc))

    async def go() -> T:
        nc = await connect(a.nats_url, name=f"kvmesh-{a.command}", wait_s=3.0, **options)
        try:
            return await work(nc)
        finally:
            await nc.close()

    try:
        result = asyncio.run(go())
    except KvmeshError as exc:
        return _error(a, str(exc))
    return show(result)


def route_command(argv: Sequence[str]) -> int:
    """``kvmesh route``: send one route request, print the reply JSON; exit 1 on an error reply."""
    parser = _parser(
        "route",
        "Send one request to kvmesh.route and print the reply JSON (exit status 1 on an error reply).",
        stream=False,
    )
    parser.add_argument("--model", required=True, help="model name as the workers registered it")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--token-ids", help="comma-separated token ids, e.g. 1,2,3")
    group.add_argument(
        "--token-ids-file", type=Path, help="file with token ids (JSON array, or comma/space separated)"
    )
    parser.add_argument("--lora-name", default=None, help="LoRA adapter name")
    parser.add_argument("--cache-salt", default=None, help="cache salt, as the engine received it")
    parser.add_argument("--candidates", default=None, help="comma-separated worker ids to choose from")
    parser.add_argument("--request-id", default=None, help="request id to echo back")
    parser.add_argument(
        "--session-id",
        default=None,
        help="session affinity: keep requests of this session on the worker of its last route while the "
        "cost allows (the reply's 'session' says new, kept or moved)",
    )
    parser.add_argument("--explain", action="store_true", help="include every candidate's score")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="seconds to wait for a reply")
    parser.add_argument("--subject", default=subjects.ROUTE_SUBJECT, help="route subject")
    a = parser.parse_args(argv)
    try:
        text = a.token_ids if a.token_ids is not None else a.token_ids_file.read_text()
    except OSError as exc:
        print(
            f"kvmesh route: error: cannot read --token-ids-file {a.token_ids_file}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    try:
        tokens = _parse_tokens(text)
    except ValueError as exc:
        parser.error(str(exc))
    request = RouteRequest(
        model=a.model,
        token_ids=tokens,
        lora_name=a.lora_name,
        cache_salt=a.cache_salt,
        candidates=None if a.candidates is None else [c for c in a.candidates.split(",") if c],
        request_id=a.request_id,
        session_id=a.session_id,
        explain=a.explain,
    )

    async def work(nc: Client) -> Any:
        from kvmesh.client import Router  # noqa: PLC0415 - keep start-up light

        try:
            reply = await Router(nc, subject=a.subject, timeout_s=a.timeout_s).request_raw(encode(request))
        except RouteError as exc:  # no router answered, or the request cannot be sent
            return {"error": {"code": exc.code, "message": exc.message}}
        return json.loads(reply)

    def show(reply: Any) -> int:
        _print_json(reply)
        return 1 if "error" in reply else 0

    return _run(a, work, show)


def _parse_tokens(text: str) -> list[int]:
    """Token ids from ``1,2,3``, ``"1 2 3"`` or a JSON array ``[1, 2, 3]``.

    Raises:
        ValueError: not a JSON array of integers, an empty element (``1,,2``), or an element that is not an
            integer (``x``, ``1.5``, ``true``); range and emptiness are the router's to check.
    """
    text = text.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--token-ids is not a JSON array of integers: {exc}") from exc
        if not isinstance(values, list) or not all(type(v) is int for v in values):
            raise ValueError("--token-ids is not a JSON array of integers")
        return values
    parts = re.split(r"\s*,\s*|\s+", text) if text else []
    try:
        return [int(p) for p in parts]
    except ValueError as exc:
        raise ValueError(f"token ids must be integers separated by commas or spaces: {exc}") from exc


def finish_command(argv: Sequence[str]) -> int:
    """``kvmesh finish``: tell every router that requests are over (or their prefill is done)."""
    parser = _parser(
        "finish",
        "End requests that were routed with a request id (`kvmesh route --request-id`, "
        "Router.route(request_id=...)): every router stops counting their KV blocks as load on the chosen "
        "worker at once, instead of after its request TTL (300 s by default). With --prefill-done only their "
        "prompt tokens stop counting (the first token is out). Prints one line per request id.",
        stream=False,
    )
    parser.add_argument(
        "--request-id", action="append", required=True, help="the request id (repeat for several)"
    )
    parser.add_argument(
        "--prefill-done", action="store_true", help="mark the prefill done instead of finishing the request"
    )
    parser.add_argument(
        "--cached-tokens",
        type=int,
        default=None,
        help="the engine's count of cached prompt tokens (vLLM: usage.prompt_tokens_details.cached_tokens) "
        "of the one finished request: the router that answered it counts them as delivered",
    )
    parser.add_argument(
        "--requests-prefix", default=subjects.REQUESTS_PREFIX, help="the routers' request lifecycle prefix"
    )
    a = parser.parse_args(argv)
    if a.cached_tokens is not None and (len(a.request_id) != 1 or a.prefill_done or a.cached_tokens < 0):
        parser.error("--cached-tokens goes with one --request-id, without --prefill-done, and is >= 0")

    def show(_: None) -> int:
        done = "prefill done" if a.prefill_done else "finished"
        for rid in a.request_id:
            print(f"{done} {rid}")
        return 0

    return _run(
        a,
        lambda nc: ops.finish(
            nc,
            a.request_id,
            prefill_done=a.prefill_done,
            cached_tokens=a.cached_tokens,
            requests_prefix=a.requests_prefix,
        ),
        show,
    )


def status_command(argv: Sequence[str]) -> int:
    """``kvmesh status``: the stream, every indexer replica, snapshot, worker, ingest and router, as tables
    (``--json``: the `StatusReport` JSON; ``--watch``: redrawn every second with route rates)."""
    parser = _parser(
        "status",
        "Show the events stream (messages, bytes, sequences), every indexer replica (applied "
        "sequence, lag, blocks, digest), the stored snapshots (sequence, size, age), the workers (model, dp "
        "ranks, block size, incarnation, last heartbeat and event), every ingest (per-rank cursors, gaps, "
        "replays, resyncs, rejected and dropped events) and every router (index mode, applied sequence and "
        "lag of a local index, routed requests, errors) as tables. --json prints the same data as JSON (a "
        "versioned schema: its `schema` field); --watch redraws the tables every --interval-s with each "
        "router's routes per second. Exit status 1 when the stream does not exist (--watch: keeps going).",
    )
    parser.add_argument("--wait-s", type=float, default=0.5, help="seconds to collect replies")
    parser.add_argument("--json", action="store_true", help="print the status as JSON (for scripts)")
    parser.add_argument(
        "--watch", action="store_true", help="redraw every --interval-s until Ctrl-C, with route rates"
    )
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between --watch refreshes")
    parser.add_argument(
        "--count", type=int, default=0, help="with --watch: stop after this many refreshes (0: never)"
    )
    a = parser.parse_args(argv)
    if a.json and a.watch:
        parser.error("--json and --watch exclude each other")
    if a.interval_s <= 0:
        parser.error("--interval-s must be positive")

    def show(report: ops.StatusReport) -> int:
        if a.json:
            _print_json(report)
        else:
            print(render_status(report), end="")
        error = report.stream.error
        if error == ops.STREAM_NOT_FOUND:
            return _error(a, f"stream {a.stream} does not exist on {redact_url(a.nats_url)}")
        return _error(a, f"cannot read stream {a.stream}: {error}") if error else 0

    if not a.watch:
        return _run(a, lambda nc: ops.status(nc, stream=a.stream, wait_s=a.wait_s), show)

    async def watch(nc: Client) -> None:
        clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
        previous: tuple[ops.StatusReport, float] | None = None
        shown = 0
        while not a.count or shown < a.count:
            started = time.monotonic()
            report = await ops.status(nc, stream=a.stream, wait_s=min(a.wait_s, a.interval_s))
            now = time.monotonic()
            rates = route_rates(previous[0], report, now - previous[1]) if previous else {}
            previous = (report, now)
            frame = render_status(report, rates=rates)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            print(f"{clear}kvmesh status --watch, every {a.interval_s:g} s, {stamp}\n\n{frame}", flush=True)
            if not clear:
                print(flush=True)  # frames apart when stdout is not a terminal
            shown += 1
            if not a.count or shown < a.count:
                await asyncio.sleep(max(0.0, a.interval_s - (time.monotonic() - started)))

    try:
        return _run(a, watch, lambda _: 0)
    except KeyboardInterrupt:
        return 0


def snapshot_command(argv: Sequence[str]) -> int:
    """``kvmesh snapshot``: have the index group's snapshot writer write a snapshot now; print it as JSON."""
    parser = _parser(
        "snapshot",
        "Ask the indexer replicas of one stream to write a snapshot now. The holder of the "
        "snapshot-writer lease writes it (the others decline); prints the written snapshot (name, stream "
        "sequence, bytes, apply-loop stall) as JSON. Exit status 1 when no replica wrote one.",
    )
    parser.add_argument("--timeout-s", type=float, default=30.0, help="seconds to wait for the snapshot")
    a = parser.parse_args(argv)

    def show(replies: list[SnapshotResult]) -> int:
        if replies and replies[-1].written:
            return _print_json(replies[-1])
        why = "; ".join(f"{d.replica}: {d.reason or 'no reason given'}" for d in replies)
        return _error(a, f"no snapshot written within {a.timeout_s:g} s ({why or 'no indexer answered'})")

    return _run(a, lambda nc: ops.snapshot(nc, stream=a.stream, timeout_s=a.timeout_s), show)


def replay_command(argv: Sequence[str]) -> int:
    """``kvmesh replay``: rebuild an index offline from the stream (and a snapshot); print size and digest."""
    parser = _parser(
        "replay",
        "Rebuild an index in this process from the events stream, optionally starting from a "
        "stored snapshot, and print its applied sequence, blocks, digest, messages read and seconds taken "
        "as JSON: compare with a replica's digest in `kvmesh status` at the same sequence. Reads with an "
        "ordered consumer; changes nothing.",
        prefix=True,
    )
    parser.add_argument(
        "--from-snapshot",
        default="none",
        help="'none' (the stream alone), 'latest' (the newest snapshot that verifies and the stream still "
        "continues) or a snapshot's stream sequence",
    )
    parser.add_argument("--to-seq", type=int, default=0, help="stop at this stream sequence (0: the last)")
    parser.add_argument(
        "--timeout-s", type=float, default=30.0, help="give up when the stream stalls this long"
    )
    parser.add_argument(
        "--max-blocks",
        type=int,
        default=None,
        help="the replicas' block bound (their --max-blocks), so the digest compares with theirs (default: none)",
    )
    a = parser.parse_args(argv)
    if a.max_blocks is not None and a.max_blocks < 1:
        parser.error(f"--max-blocks must be ≥ 1, got {a.max_blocks}")
    if a.max_blocks is not None and a.max_blocks > MAX_BLOCKS_LIMIT:
        parser.error(f"--max-blocks must be ≤ {MAX_BLOCKS_LIMIT}, got {a.max_blocks}")
    spec = a.from_snapshot.strip().lower()
    if spec not in ("none", "latest") and not spec.isdigit():
        parser.error("--from-snapshot must be none, latest or a stream sequence")
    start = int(spec) if spec.isdigit() else spec

    return _run(
        a,
        lambda nc: ops.replay(
            nc,
            stream=a.stream,
            from_snapshot=start,
            to_seq=a.to_seq,
            prefix=a.events_prefix,
            timeout_s=a.timeout_s,
            max_blocks=a.max_blocks,
        ),
    )


def reset_command(argv: Sequence[str]) -> int:
    """``kvmesh reset``: publish an `IndexReset` into the stream; every replica forgets its index there."""
    parser = _parser(
        "reset",
        "Start a new index epoch: publish an IndexReset message into the events stream, so every "
        "running replica (and every later replay) forgets its whole index at that one stream sequence and "
        "rebuilds from the events that follow. Nothing is purged under a running reader; the messages before "
        "the reset go with the normal snapshot-and-purge cycle. Prints the reset's epoch and sequence and the "
        "replicas that applied it.",
        prefix=True,
    )
    parser.add_argument("--reason", default="operator", help="recorded in the reset message")
    parser.add_argument("--wait-s", type=float, default=10.0, help="seconds to wait for replicas to apply it")
    parser.add_argument("--yes", action="store_true", help="really reset (required)")
    a = parser.parse_args(argv)
    if not a.yes:
        parser.error("a reset empties every replica's index: pass --yes")

    def show(result: ops.ResetResult) -> int:
        _print_json(result)
        return 0 if result.applied else 1

    return _run(
        a,
        lambda nc: ops.reset(nc, stream=a.stream, reason=a.reason, prefix=a.events_prefix, wait_s=a.wait_s),
        show,
    )


def provision_command(argv: Sequence[str]) -> int:
    """``kvmesh provision``: create the events stream and the index group's buckets; print what exists."""
    parser = _parser(
        "provision",
        "Create the events stream, the worker registry and snapshot-lease KV buckets and the snapshot "
        "Object Store of one index group where they are missing, at --replicas replicas, with the settings "
        "the services would use; leave existing ones as they are. Needed where the services' credentials "
        "may not create streams (deploy/nats); run it once with operator credentials before the services. "
        "Prints each resource (replicas, created) as JSON; exit status 1 when an existing one has another "
        "replica count than --replicas.",
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="replicas of everything created (3 on a cluster)"
    )
    parser.add_argument(
        "--events-prefix", default=subjects.EVENTS_PREFIX, help="subject prefix of the stream"
    )
    parser.add_argument(
        "--stream-max-age-s", type=float, default=ops.DEFAULT_STREAM_MAX_AGE_S, help="stream message max age"
    )
    parser.add_argument(
        "--stream-max-bytes", type=int, default=ops.DEFAULT_STREAM_MAX_BYTES, help="stream size bound"
    )
    parser.add_argument("--worker-ttl-s", type=float, default=15.0, help="worker registry TTL (seconds)")
    parser.add_argument("--lease-ttl-s", type=float, default=30.0, help="snapshot-writer lease TTL (seconds)")
    parser.add_argument(
        "--snapshot-max-bytes", type=int, default=-1, help="size bound of the snapshot bucket (-1: none)"
    )
    parser.add_argument("--memory", action="store_true", help="memory storage (tests, demos)")
    parser.add_argument(
        "--timeout-s", type=float, default=60.0, help="seconds to wait for JetStream to answer at all"
    )
    a = parser.parse_args(argv)
    if a.replicas < 1:
        parser.error("--replicas must be >= 1")
    if a.worker_ttl_s <= 0 or a.lease_ttl_s <= 0:
        parser.error("--worker-ttl-s and --lease-ttl-s must be > 0")

    def show(result: ops.ProvisionResult) -> int:
        _print_json(result)
        for line in result.mismatched:
            print(f"kvmesh provision: {line}", file=sys.stderr)
        return 1 if result.mismatched else 0

    return _run(
        a,
        lambda nc: ops.provision(
            nc,
            stream=a.stream,
            events_prefix=a.events_prefix,
            replicas=a.replicas,
            stream_max_age_s=a.stream_max_age_s,
            stream_max_bytes=a.stream_max_bytes,
            worker_ttl_s=a.worker_ttl_s,
            lease_ttl_s=a.lease_ttl_s,
            snapshot_max_bytes=a.snapshot_max_bytes,
            memory=a.memory,
            timeout_s=a.timeout_s,
        ),
        show,
    )


def health_command(argv: Sequence[str]) -> int:
    """``kvmesh health``: exit 0 when a service's health file is fresh and says it is connected, else 1."""
    parser = argparse.ArgumentParser(
        prog="kvmesh health",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Check the health file that a service started with --health-file (KVMESH_HEALTH_FILE) "
        "rewrites every few seconds: exit 0 when it is younger than --max-age-s and the service was "
        "connected to NATS, else print why and exit 1. Reads no NATS: a container health check.",
    )
    parser.add_argument(
        "--file",
        default=os.environ.get("KVMESH_HEALTH_FILE", ""),
        help="the service's health file [env KVMESH_HEALTH_FILE]",
    )
    parser.add_argument("--max-age-s", type=float, default=DEFAULT_MAX_AGE_S, help="oldest write that counts")
    a = parser.parse_args(argv)
    if not a.file:
        parser.error("give --file (or KVMESH_HEALTH_FILE)")
    problem = check_health(a.file, max_age_s=a.max_age_s, now=time.time())
    if problem is not None:
        print(f"kvmesh health: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
