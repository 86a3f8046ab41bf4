"""The ``kvmesh`` command: one entry point for every service and tool.

Services (``ingest``, ``indexer``, ``router``) are found through the ``kvmesh.commands`` entry points their
packages register, so this shared package never imports a service. Every service also runs as
``python -m kvmesh.<service>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from kvmesh.core.errors import KvmeshError
from kvmesh.runtime import subjects
from kvmesh.runtime.cli import VERSION
from kvmesh.runtime.nats import DEFAULT_NATS_URL, TransportError, connect, redact_url

USAGE = """\
usage: kvmesh <command> [options]     (kvmesh <command> --help for each)

commands:
  up        run a whole kvmesh on this machine: NATS (embedded), simulated workers, ingests, indexer,
            router, and replay a request trace through it; --cluster 3 --chaos: kill -9 a random component
            every few seconds on a local 3-node cluster and show that nothing was lost
  ingest    read one engine's KV events (ZMQ) and publish them to the events stream
  vllm      start vLLM with KV events on and an ingest attached (kvmesh vllm --worker-id W -- serve M)
  sglang    start SGLang with KV events on and an ingest attached (kvmesh sglang --worker-id W -- ...)
  indexer   rebuild the prefix index from the stream and answer match queries
  router    answer kvmesh.route requests: which worker holds the longest cached prefix
  route     send one route request and print the reply
  finish    end routed requests by id at every router (their load stops counting; also --prefill-done)
  status    show the stream, indexer replicas, snapshots, workers and ingests
  snapshot  ask the index group's snapshot writer to write a snapshot now; print its stream sequence
  replay    rebuild an index offline from the stream (optionally from a snapshot): size, digest, time
  reset     start a new index epoch: every replica forgets its index at one point of the stream
  sim       run simulated vLLM workers that publish real KV events
  bench     benchmarks: trace (routing policies on a Mooncake trace), index, ingest, route, recovery,
            soak (N minutes of traffic with periodic kills: memory, consumers, connections, nothing lost)

options:
  -h, --help     show this list
  --version      print the kvmesh version
"""


def _services() -> dict[str, Callable[..., int]]:
    found: dict[str, Callable[..., int]] = {}
    for ep in entry_points(group="kvmesh.commands"):
        found[ep.name] = ep.load()
    return found


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
    builtin: dict[str, Callable[..., int]] = {
        "route": route_command,
        "finish": finish_command,
        "status": status_command,
        "snapshot": snapshot_command,
        "replay": replay_command,
        "reset": reset_command,
    }
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
    known = sorted({*builtin, "sim", "up", "bench", *services})
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    print(f"kvmesh: unknown command {name!r}{hint}\n\n{USAGE}", file=sys.stderr)
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
    body: dict[str, Any] = {"model": a.model, "token_ids": tokens}
    for key in ("lora_name", "cache_salt", "request_id"):
        if getattr(a, key) is not None:
            body[key] = getattr(a, key)
    if a.candidates is not None:
        body["candidates"] = [c for c in a.candidates.split(",") if c]
    if a.explain:
        body["explain"] = True

    async def go() -> bytes:
        from kvmesh.client import RouteError, Router  # noqa: PLC0415

        nc = await connect(a.nats_url, name="kvmesh-route", wait_s=3.0)
        try:
            try:
                return await Router(nc, subject=a.subject, timeout_s=a.timeout_s).request_raw(
                    msgspec.json.encode(body)
                )
            except RouteError as exc:  # no router answered, or the request cannot be sent
                return msgspec.json.encode({"error": {"code": exc.code, "message": exc.message}})
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


def finish_command(argv: Sequence[str]) -> int:
    """``kvmesh finish``: tell every router that requests are over (or their prefill is done)."""
    parser = argparse.ArgumentParser(
        prog="kvmesh finish",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="End requests that were routed with a request id (`kvmesh route --request-id`, "
        "Router.route(request_id=...)): every router stops counting their KV blocks as load on the chosen "
        "worker at once, instead of after its request TTL (300 s by default). With --prefill-done only their "
        "prompt tokens stop counting (the first token is out). Prints one line per request id.",
    )
    parser.add_argument(
        "--request-id", action="append", required=True, help="the request id (repeat for several)"
    )
    parser.add_argument(
        "--prefill-done", action="store_true", help="mark the prefill done instead of finishing the request"
    )
    parser.add_argument(
        "--nats-url",
        default=os.environ.get("KVMESH_NATS_URL", DEFAULT_NATS_URL),
        help="NATS URL [env KVMESH_NATS_URL]",
    )
    parser.add_argument(
        "--requests-prefix", default=subjects.REQUESTS_PREFIX, help="the routers' request lifecycle prefix"
    )
    a = parser.parse_args(argv)

    async def go() -> None:
        from kvmesh.client import Router  # noqa: PLC0415

        nc = await connect(a.nats_url, name="kvmesh-finish", wait_s=3.0)
        try:
            router = Router(nc, requests_prefix=a.requests_prefix)
            for rid in a.request_id:
                if a.prefill_done:
                    await router.mark_prefill_done(rid)
                else:
                    await router.finish(rid)
            await nc.flush(timeout=3)
        finally:
            await nc.close()

    try:
        asyncio.run(go())
    except (KvmeshError, nats.errors.Error) as exc:  # no connection, or the publish did not get through
        print(f"kvmesh finish: {exc}", file=sys.stderr)
        return 1
    done = "prefill done" if a.prefill_done else "finished"
    for rid in a.request_id:
        print(f"{done} {rid}")
    return 0


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
        "sequence, lag, blocks, digest), the stored snapshots (sequence, size, age), the workers (model, dp "
        "ranks, block size, incarnation, last heartbeat and event), every ingest (per-rank cursors, gaps, "
        "replays, resyncs, rejected and dropped events) and every router (index mode, applied sequence and "
        "lag of a local index, routed requests, errors) as JSON.",
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
            except nats.js.errors.NotFoundError:
                out["stream"] = {"name": a.stream, "error": "stream not found"}
            except Exception as exc:
                out["stream"] = {"name": a.stream, "error": str(exc) or type(exc).__name__}
            last = out["stream"].get("last_seq", 0)
            replicas, ingests, routers = await asyncio.gather(
                gather_status(nc, subjects.STATUS_SUBJECT, a.wait_s),
                gather_status(nc, f"{subjects.STATUS_SUBJECT}.ingest", a.wait_s),
                gather_status(nc, f"$SRV.STATS.{subjects.ROUTER_QUEUE}", a.wait_s),
            )
            replicas = [r for r in replicas if r.get("stream", a.stream) == a.stream]
            for r in replicas:
                r["lag"] = max(0, last - r.get("applied_seq", 0))
                if r.get("applied_seq", 0) > last:
                    r["warning"] = STREAM_RECREATED
            out["replicas"] = sorted(replicas, key=lambda r: r.get("replica", ""))
            out["snapshots"] = await status_snapshots(js, a.stream)
            out["workers"] = await status_workers(js, a.stream, out["replicas"])
            out["ingests"] = sorted(ingests, key=lambda r: r.get("worker_id", ""))
            summaries = [router_status(r, last) for r in routers]
            # A local-index router of another stream reports against that stream, not this one.
            out["routers"] = sorted(
                (r for r in summaries if r.get("stream", a.stream) == a.stream),
                key=lambda r: str(r.get("id", "")),
            )
            return out
        finally:
            await nc.close()

    try:
        result = asyncio.run(go())
    except TransportError as exc:
        print(f"kvmesh status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str))
    error = result["stream"].get("error")
    if error == "stream not found":
        print(f"kvmesh status: stream {a.stream} does not exist on {redact_url(a.nats_url)}", file=sys.stderr)
        return 1
    if error:
        print(f"kvmesh status: cannot read stream {a.stream}: {error}", file=sys.stderr)
        return 1
    return 0


STREAM_RECREATED = (
    "applied sequence is past the stream's last one: the stream was deleted and created again; this "
    "replica's index no longer describes it, restart the replica"
)


def router_status(stats: dict[str, Any], stream_last_seq: int) -> dict[str, Any]:
    """Summarise one router's ``$SRV.STATS`` reply: id, index mode, applied sequence and lag, counters."""
    data: dict[str, Any] = {}
    for endpoint in stats.get("endpoints") or []:
        if endpoint.get("name") == "route":
            data = endpoint.get("data") or {}
    index = dict(data.get("index") or {})
    out: dict[str, Any] = {"id": stats.get("id"), "version": stats.get("version"), **index}
    if "applied_seq" in index:
        out["lag"] = max(0, stream_last_seq - int(index["applied_seq"]))
        if int(index["applied_seq"]) > stream_last_seq:
            out["warning"] = STREAM_RECREATED
    for key in ("routed", "errors", "in_flight"):
        if key in data:
            out[key] = data[key]
    return out


async def status_snapshots(js: Any, stream: str) -> list[dict[str, Any]] | dict[str, str]:
    """The index group's stored snapshots, newest first: name, stream sequence, size and age in seconds."""
    from kvmesh.runtime.snapshots import SnapshotStore  # noqa: PLC0415 - keep start-up light

    try:
        store = await SnapshotStore.open(js, subjects.snapshot_bucket(stream), create=False)
        entries = await store.list()
    except Exception as exc:
        if type(exc).__name__ == "BucketNotFoundError":
            return []
        return {"error": str(exc) or type(exc).__name__}
    now = time.time()
    return [
        {
            "name": e.name,
            "seq": e.applied_seq,
            "bytes": e.size_bytes,
            "age_s": _age_s(e.mtime, now),
        }
        for e in entries
    ]


async def status_workers(
    js: Any, stream: str, replicas: Sequence[dict[str, Any]]
) -> dict[str, dict[str, Any]] | dict[str, str]:
    """Every worker from the registry (model, dp ranks, block size, incarnation, heartbeat age) with its last
    event time as the replicas saw it; workers the replicas index but the registry no longer lists show
    ``registered: false``."""
    from kvmesh.runtime.registry import list_workers  # noqa: PLC0415 - keep start-up light

    try:
        kv = await js.key_value(subjects.registry_bucket(stream))
        records = await list_workers(kv)
    except Exception as exc:
        if type(exc).__name__ != "BucketNotFoundError":
            return {"error": str(exc) or type(exc).__name__}
        records = {}
    now = time.time()
    seen: dict[str, dict[str, Any]] = {}
    for r in replicas:
        for w, info in (r.get("workers") or {}).items():
            if info.get("removed"):
                continue
            mine = seen.setdefault(w, {"model": info.get("model"), "last_event_ts": 0.0, "epochs": {}})
            mine["last_event_ts"] = max(mine["last_event_ts"], float(info.get("last_ts") or 0.0))
            mine["epochs"] = info.get("epochs") or mine["epochs"]
    out: dict[str, dict[str, Any]] = {}
    for w in sorted({*records, *seen}):
        rec, idx = records.get(w), seen.get(w)
        last_ts = idx["last_event_ts"] if idx is not None and idx["last_event_ts"] > 0 else None
        if rec is not None:
            entry: dict[str, Any] = {
                "registered": True,
                "model": rec.model,
                "dp_ranks": rec.dp_ranks,
                "block_size": rec.block_size,
                "incarnation": rec.incarnation,
                "heartbeat_age_s": round(now - rec.heartbeat_ts, 3) if rec.heartbeat_ts else None,
            }
        else:
            assert idx is not None
            epochs = {int(k): int(v) for k, v in idx["epochs"].items()}
            entry = {
                "registered": False,
                "model": idx["model"],
                "dp_ranks": len(epochs),
                "block_size": None,
                "incarnation": max(epochs.values(), default=0),
                "heartbeat_age_s": None,
            }
        entry["last_event_ts"] = last_ts
        entry["last_event_age_s"] = round(now - last_ts, 3) if last_ts is not None else None
        out[w] = entry
    return out


def _age_s(mtime: str, now: float) -> float | None:
    """Seconds since an Object Store mtime (RFC 3339, possibly with nanoseconds), or None."""
    if not mtime:
        return None
    text = mtime.replace("Z", "+00:00")
    head, dot, rest = text.partition(".")
    if dot:  # Python parses at most 6 fractional digits
        frac = "".join(itertools.takewhile(str.isdigit, rest))
        text = f"{head}.{frac[:6]}{rest[len(frac) :]}"
    try:
        return round(now - datetime.fromisoformat(text).timestamp(), 3)
    except ValueError:
        return None


def _events_prefix(info: Any, given: str | None) -> str:
    """The events prefix: as given, else the stream's one ``<prefix>.>`` subject, else the default."""
    if given:
        return str(given)
    subs = list(getattr(info.config, "subjects", None) or [])
    if len(subs) == 1 and subs[0].endswith(".>"):
        return str(subs[0][:-2])
    return subjects.EVENTS_PREFIX


def _nats_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats-url",
        default=os.environ.get("KVMESH_NATS_URL", DEFAULT_NATS_URL),
        help="NATS URL [env KVMESH_NATS_URL]",
    )
    parser.add_argument("--stream", default=subjects.STREAM, help="events stream (the index group)")


# ---------------------------------------------------------------------- snapshot


def snapshot_command(argv: Sequence[str]) -> int:
    """``kvmesh snapshot``: have the index group's snapshot writer write a snapshot now; print it as JSON."""
    parser = argparse.ArgumentParser(
        prog="kvmesh snapshot",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Ask the indexer replicas of one stream to write a snapshot now. The holder of the "
        "snapshot-writer lease writes it (the others decline); prints the written snapshot (name, stream "
        "sequence, bytes, apply-loop stall) as JSON. Exit status 1 when no replica wrote one.",
    )
    _nats_args(parser)
    parser.add_argument("--timeout-s", type=float, default=30.0, help="seconds to wait for the snapshot")
    a = parser.parse_args(argv)

    async def go() -> tuple[dict[str, Any] | None, list[dict[str, Any]] | None]:
        """Return (the written snapshot, or None; the replicas that declined, or None when none answered)."""
        nc = await connect(a.nats_url, name="kvmesh-snapshot", wait_s=3.0)
        try:
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish(
                subjects.SNAPSHOT_SUBJECT, json.dumps({"stream": a.stream}).encode(), reply=inbox
            )
            loop = asyncio.get_running_loop()
            deadline = loop.time() + a.timeout_s
            declined: list[dict[str, Any]] = []
            while (remaining := deadline - loop.time()) > 0:
                try:
                    msg = await sub.next_msg(timeout=remaining)
                except Exception:
                    break
                if not msg.data:  # no responders: no replica is subscribed at all
                    return None, None
                reply = json.loads(msg.data)
                if reply.get("written"):
                    return reply, declined
                declined.append(reply)
            return None, declined
        finally:
            await nc.close()

    try:
        written, declined = asyncio.run(go())
    except TransportError as exc:
        print(f"kvmesh snapshot: {exc}", file=sys.stderr)
        return 1
    if declined is None:
        print(
            f"kvmesh snapshot: no indexer answered: nothing is subscribed to {subjects.SNAPSHOT_SUBJECT} "
            f"(is an indexer of stream {a.stream} running?)",
            file=sys.stderr,
        )
        return 1
    if written is None:
        why = "; ".join(f"{d.get('replica')}: {d.get('reason')}" for d in declined) or "no indexer answered"
        print(f"kvmesh snapshot: no snapshot written within {a.timeout_s:g} s ({why})", file=sys.stderr)
        return 1
    print(json.dumps(written, indent=2))
    return 0


# ---------------------------------------------------------------------- replay


def replay_command(argv: Sequence[str]) -> int:
    """``kvmesh replay``: rebuild an index offline from the stream (and a snapshot); print size and digest."""
    parser = argparse.ArgumentParser(
        prog="kvmesh replay",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Rebuild an index in this process from the events stream, optionally starting from a "
        "stored snapshot, and print its applied sequence, blocks, digest, messages read and seconds taken "
        "as JSON: compare with a replica's digest in `kvmesh status` at the same sequence. Reads with an "
        "ordered consumer; changes nothing.",
    )
    _nats_args(parser)
    parser.add_argument(
        "--events-prefix",
        default=None,
        help="subject prefix of the stream (when not given: taken from the stream's subjects)",
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
    a = parser.parse_args(argv)
    spec = a.from_snapshot.strip().lower()
    if spec not in ("none", "latest") and not spec.isdigit():
        parser.error("--from-snapshot must be none, latest or a stream sequence")

    async def go() -> dict[str, Any]:
        from kvmesh.runtime.snapshots import SnapshotStore, plan_recovery, replay_stream  # noqa: PLC0415

        nc = await connect(a.nats_url, name="kvmesh-replay", wait_s=3.0)
        try:
            js = nc.jetstream()
            info = await js.stream_info(a.stream)
            last = info.state.last_seq if a.to_seq <= 0 else min(a.to_seq, info.state.last_seq)
            store = None
            if spec != "none":
                try:
                    store = await SnapshotStore.open(js, subjects.snapshot_bucket(a.stream), create=False)
                except Exception as exc:
                    if type(exc).__name__ != "BucketNotFoundError":
                        raise
            only = int(spec) if spec.isdigit() else None
            plan = await plan_recovery(
                store, first_seq=info.state.first_seq, last_seq=last, only_seq=only, name="kvmesh replay"
            )
            if only is not None and plan.snapshot_seq != only:
                raise ValueError(f"no usable snapshot at seq {only} (skipped: {plan.skipped or 'not found'})")
            t0 = time.perf_counter()
            state = plan.state()
            restore_s = time.perf_counter() - t0
            stats = await replay_stream(
                js,
                state,
                stream=a.stream,
                events_prefix=_events_prefix(info, a.events_prefix),
                start_seq=plan.start_seq,
                to_seq=last,
                timeout_s=a.timeout_s,
            )
            t1 = time.perf_counter()
            digest = state.digest()
            return {
                "stream": a.stream,
                "snapshot": plan.snapshot,
                "snapshot_seq": plan.snapshot_seq,
                "skipped": plan.skipped,
                "start_seq": plan.start_seq,
                "applied_seq": state.applied_seq,
                "blocks": state.block_total(),
                "digest": f"{digest:016x}",
                "models": state.models(),
                "reset_epoch": state.reset_epoch,
                "messages_read": stats.messages,
                "decode_errors": stats.decode_errors,
                "apply_errors": stats.apply_errors,
                "complete": state.gap_seq is None,
                "gap": plan.gap,
                "incomplete": [f"{w}/{r}" for w, r in state.incomplete()],
                "holder_health": {f"{w}/{r}": why for (w, r), why in state.holder_health().items()},
                "seconds": round(time.perf_counter() - t0, 3),
                "restore_s": round(restore_s, 3),
                "replay_s": round(stats.seconds, 3),
                "digest_s": round(time.perf_counter() - t1, 3),
            }
        finally:
            await nc.close()

    try:
        result = asyncio.run(go())
    except (TransportError, TimeoutError, ValueError) as exc:
        print(f"kvmesh replay: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a missing stream and other server answers
        print(f"kvmesh replay: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


# ---------------------------------------------------------------------- reset


def reset_command(argv: Sequence[str]) -> int:
    """``kvmesh reset``: publish an `IndexReset` into the stream; every replica forgets its index there."""
    parser = argparse.ArgumentParser(
        prog="kvmesh reset",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Start a new index epoch: publish an IndexReset message into the events stream, so every "
        "running replica (and every later replay) forgets its whole index at that one stream sequence and "
        "rebuilds from the events that follow. Nothing is purged under a running reader; the messages before "
        "the reset go with the normal snapshot-and-purge cycle. Prints the reset's epoch and sequence and the "
        "replicas that applied it.",
    )
    _nats_args(parser)
    parser.add_argument(
        "--events-prefix",
        default=None,
        help="subject prefix of the stream (when not given: taken from the stream's subjects)",
    )
    parser.add_argument("--reason", default="operator", help="recorded in the reset message")
    parser.add_argument("--wait-s", type=float, default=10.0, help="seconds to wait for replicas to apply it")
    parser.add_argument("--yes", action="store_true", help="really reset (required)")
    a = parser.parse_args(argv)
    if not a.yes:
        parser.error("a reset empties every replica's index: pass --yes")

    async def go() -> dict[str, Any]:
        from kvmesh.core.events import IndexReset, encode_message  # noqa: PLC0415

        nc = await connect(a.nats_url, name="kvmesh-reset", wait_s=3.0)
        try:
            js = nc.jetstream()
            prefix = _events_prefix(await js.stream_info(a.stream), a.events_prefix)

            async def replicas() -> list[dict[str, Any]]:
                return [
                    r
                    for r in await gather_status(nc, subjects.STATUS_SUBJECT, 0.5)
                    if r.get("stream") == a.stream
                ]

            epoch = max((int(r.get("reset_epoch", 0)) for r in await replicas()), default=0) + 1
            ack = await js.publish(
                subjects.control_subject(prefix),
                encode_message(IndexReset(epoch=epoch, reason=a.reason)),
                stream=a.stream,
                headers={"Nats-Msg-Id": f"reset:{epoch}"},
            )
            loop = asyncio.get_running_loop()
            deadline = loop.time() + a.wait_s
            seen = await replicas()
            while any(r.get("applied_seq", 0) < ack.seq for r in seen) and loop.time() < deadline:
                await asyncio.sleep(0.2)
                seen = await replicas()
            return {
                "stream": a.stream,
                "reset_epoch": epoch,
                "seq": ack.seq,
                "duplicate": bool(ack.duplicate),
                "replicas": {
                    r["replica"]: {
                        "applied": r.get("applied_seq", 0) >= ack.seq,
                        "applied_seq": r.get("applied_seq", 0),
                        "reset_epoch": r.get("reset_epoch", 0),
                        "blocks": r.get("blocks", 0),
                    }
                    for r in sorted(seen, key=lambda r: r.get("replica", ""))
                },
            }
        finally:
            await nc.close()

    try:
        result = asyncio.run(go())
    except TransportError as exc:
        print(f"kvmesh reset: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a missing stream and other server answers
        print(f"kvmesh reset: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0 if all(r["applied"] for r in result["replicas"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
