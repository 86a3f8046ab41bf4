"""The ``kvmesh`` command: one entry point for every service and tool.

Services (``ingest``, ``indexer``, ``router``) are found through the ``kvmesh.commands`` entry points their
packages register, so this shared package never imports a service. Every service also runs as
``python -m kvmesh.<service>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import msgspec

from kvmesh.runtime import subjects
from kvmesh.runtime.nats import DEFAULT_NATS_URL, TransportError, connect

USAGE = """\
usage: kvmesh <command> [options]     (kvmesh <command> --help for each)

commands:
  up        run a whole kvmesh on this machine: NATS (embedded), simulated workers, ingests, indexer,
            router, and replay a request trace through it
  ingest    read one engine's KV events (ZMQ) and publish them to the events stream
  vllm      start vLLM with KV events on and an ingest attached (kvmesh vllm --worker-id W -- serve M)
  sglang    start SGLang with KV events on and an ingest attached (kvmesh sglang --worker-id W -- ...)
  indexer   rebuild the prefix index from the stream and answer match queries
  router    answer kvmesh.route requests: which worker holds the longest cached prefix
  route     send one route request and print the reply
  status    show the stream, indexer replicas and ingests
  sim       run simulated vLLM workers that publish real KV events
  bench     benchmarks: trace (routing policies on a Mooncake trace), index, ingest
"""


def _services() -> dict[str, Callable[..., int]]:
    found: dict[str, Callable[..., int]] = {}
    for ep in entry_points(group="kvmesh.commands"):
        found[ep.name] = ep.load()
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Run the kvmesh command line; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    builtin: dict[str, Callable[..., int]] = {"route": route_command, "status": status_command}
    if name in builtin:
        return builtin[name](rest)
    if name == "sim":
        from kvmesh.sim.serve import command as sim_command  # noqa: PLC0415 - keep start-up light

        return sim_command(rest)
    if name == "up":
        from kvmesh.up import command as up_command  # noqa: PLC0415 - keep start-up light

        return up_command(rest)
    if name == "bench":
        from kvmesh.bench.cli import command as bench_command  # noqa: PLC0415 - keep start-up light

        return bench_command(rest)
    services = _services()
    if name in services:
        return services[name](rest, prog=f"kvmesh {name}")
    print(f"kvmesh: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------- route


def route_command(argv: Sequence[str]) -> int:
    """``kvmesh route``: send one route request, print the reply JSON; exit 1 on an error reply."""
    parser = argparse.ArgumentParser(
        prog="kvmesh route",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Send one request to kvmesh.route and print the reply JSON (exit status 1 on an error reply).",
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
    parser.add_argument("--explain", action="store_true", help="include every candidate's score")
    parser.add_argument("--timeout-s", type=float, default=2.0, help="seconds to wait for a reply")
    parser.add_argument(
        "--nats-url",
        default=os.environ.get("KVMESH_NATS_URL", DEFAULT_NATS_URL),
        help="NATS URL [env KVMESH_NATS_URL]",
    )
    parser.add_argument("--subject", default=subjects.ROUTE_SUBJECT, help="route subject")
    a = parser.parse_args(argv)
    text = a.token_ids if a.token_ids is not None else a.token_ids_file.read_text()
    try:
        tokens = _parse_tokens(text)
    except ValueError as exc:
        parser.error(str(exc))
    body: dict[str, Any] = {"model": a.model, "token_ids": tokens}
    for key in ("lora_name", "cache_salt", "request_id"):
        if getattr(a, key) is not None:
            body[key] = getattr(a, key)
    if a.candidates is not None:
        body["candidates"] = [c for c in a.candidates.split(",") if c]
    if a.explain:
        body["explain"] = True

    async def go() -> bytes:
        from kvmesh.client import Router, UnavailableError  # noqa: PLC0415

        nc = await connect(a.nats_url, name="kvmesh-route", wait_s=3.0)
        try:
            try:
                return await Router(nc, subject=a.subject, timeout_s=a.timeout_s).request_raw(
                    msgspec.json.encode(body)
                )
            except UnavailableError as exc:
                return msgspec.json.encode({"error": {"code": "unavailable", "message": str(exc)}})
        finally:
            await nc.close()

    try:
        reply = asyncio.run(go())
    except TransportError as exc:
        print(f"kvmesh route: {exc}", file=sys.stderr)
        return 1
    decoded = json.loads(reply)
    print(json.dumps(decoded, indent=2))
    return 1 if "error" in decoded else 0


def _parse_tokens(text: str) -> list[int]:
    text = text.strip()
    values = json.loads(text) if text.startswith("[") else text.replace(",", " ").split()
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"token ids must be integers: {exc}") from exc


# ---------------------------------------------------------------------- status


async def gather_status(nc: Any, subject: str, wait_s: float) -> list[dict[str, Any]]:
    """Publish a status request and collect every reply that arrives within ``wait_s`` seconds."""
    inbox = nc.new_inbox()
    replies: list[dict[str, Any]] = []
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, b"", reply=inbox)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        try:
            msg = await sub.next_msg(timeout=remaining)
        except Exception:
            break
        if not msg.data:  # the server's "no responders" status message
            continue
        try:
            replies.append(json.loads(msg.data))
        except ValueError:
            continue
    await sub.unsubscribe()
    return replies


def status_command(argv: Sequence[str]) -> int:
    """``kvmesh status``: the stream, every indexer replica and every ingest, as JSON."""
    parser = argparse.ArgumentParser(
        prog="kvmesh status",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Show the events stream (messages, bytes, sequences), every indexer replica (applied "
        "sequence, lag, blocks, digest) and every ingest (per-rank cursors, gaps, replays, resyncs, rejected "
        "and dropped events) as JSON.",
    )
    parser.add_argument(
        "--nats-url",
        default=os.environ.get("KVMESH_NATS_URL", DEFAULT_NATS_URL),
        help="NATS URL [env KVMESH_NATS_URL]",
    )
    parser.add_argument("--stream", default=subjects.STREAM, help="stream name")
    parser.add_argument("--wait-s", type=float, default=0.5, help="seconds to collect replies")
    a = parser.parse_args(argv)

    async def go() -> dict[str, Any]:
        nc = await connect(a.nats_url, name="kvmesh-status", wait_s=3.0)
        try:
            out: dict[str, Any] = {}
            js = nc.jetstream()
            try:
                info = await js.stream_info(a.stream)
                out["stream"] = {
                    "name": a.stream,
                    "messages": info.state.messages,
                    "bytes": info.state.bytes,
                    "first_seq": info.state.first_seq,
                    "last_seq": info.state.last_seq,
                }
            except Exception as exc:
                out["stream"] = {"name": a.stream, "error": str(exc)}
            last = out["stream"].get("last_seq", 0)
            replicas, ingests = await asyncio.gather(
                gather_status(nc, subjects.STATUS_SUBJECT, a.wait_s),
                gather_status(nc, f"{subjects.STATUS_SUBJECT}.ingest", a.wait_s),
            )
            for r in replicas:
                r["lag"] = max(0, last - r.get("applied_seq", 0))
            out["replicas"] = sorted(replicas, key=lambda r: r.get("replica", ""))
            out["ingests"] = sorted(ingests, key=lambda r: r.get("worker_id", ""))
            return out
        finally:
            await nc.close()

    try:
        result = asyncio.run(go())
    except TransportError as exc:
        print(f"kvmesh status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
