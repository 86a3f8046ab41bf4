"""`status`: what ``kvmesh status`` gathers, typed; and the pure parts that shape it (no NATS needed)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client

from kvmesh.core.errors import ProtocolError
from kvmesh.core.protocol import (
    IndexerStatus,
    IngestStatus,
    MicroServiceStats,
    RouteLatency,
    RouteReceipts,
    RouterIndexStats,
    RouterStats,
    WorkerRecord,
    decode,
)
from kvmesh.ops.replies import gather, gather_replies
from kvmesh.runtime import subjects
from kvmesh.runtime.registry import list_workers
from kvmesh.runtime.snapshots import SnapshotEntry, SnapshotStore

__all__ = [
    "STATUS_SCHEMA",
    "STREAM_NOT_FOUND",
    "STREAM_RECREATED",
    "ReplicaStatus",
    "RouterService",
    "RouterSummary",
    "SnapshotView",
    "StatusReport",
    "StreamState",
    "Unreadable",
    "WorkerView",
    "decode_router_service",
    "replica_status",
    "router_status",
    "snapshot_views",
    "status",
    "worker_views",
]

log = logging.getLogger(__name__)

STATUS_SCHEMA: Final[int] = 1
"""Version of `StatusReport`'s JSON (``kvmesh status --json``, its ``schema`` field): raised when a field is
removed, renamed or changes meaning; new fields may appear within a version."""

STREAM_NOT_FOUND: Final[str] = "stream not found"
"""`StreamState.error` when the server has no stream of that name."""

STREAM_RECREATED: Final[str] = (
    "applied sequence is past the stream's last one: the stream was deleted and created again; this "
    "replica's index no longer describes it, restart the replica"
)
"""The ``warning`` of a replica or local-index router whose applied sequence is past the stream's last one."""


class Unreadable(msgspec.Struct, frozen=True, kw_only=True):
    """A part of the status that could not be read: the error's text (or its class name when it has none)."""

    error: str


class StreamState(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The events stream: its message count, size in bytes and first/last sequence, or ``error`` alone
    (`STREAM_NOT_FOUND`, or the server's answer) when it could not be read."""

    name: str
    messages: int | None = None
    bytes: int | None = None
    first_seq: int | None = None
    last_seq: int | None = None
    error: str | None = None


class ReplicaStatus(IndexerStatus, frozen=True, kw_only=True):
    """An indexer replica's `IndexerStatus` with its lag behind the stream (messages, ≥ 0) and, when its
    applied sequence is past the stream's last one, `STREAM_RECREATED` as ``warning``."""

    lag: int
    warning: str | msgspec.UnsetType = msgspec.UNSET


class SnapshotView(msgspec.Struct, frozen=True, kw_only=True):
    """One stored snapshot: object name, stream sequence, size in bytes, age in seconds (None: unknown)."""

    name: str
    seq: int
    bytes: int
    age_s: float | None


class WorkerView(msgspec.Struct, frozen=True, kw_only=True):
    """One worker as the registry (``registered``) and the replicas see it.

    Registered: model, dp ranks, block size and incarnation from its record, heartbeat age in seconds. Not
    registered (indexed by a replica, gone from the registry): model, ranks and highest epoch from the
    replicas, no block size or heartbeat. ``last_event_ts`` is the newest engine timestamp any replica
    applied (seconds since the epoch; None: none), ``last_event_age_s`` its age.
    """

    registered: bool
    model: str | None
    dp_ranks: int
    block_size: int | None
    incarnation: int
    heartbeat_age_s: float | None
    last_event_ts: float | None
    last_event_age_s: float | None


class RouterService(msgspec.Struct, frozen=True, kw_only=True):
    """A router's ``$SRV.STATS`` reply: its nats micro instance id and version, and its route endpoint's
    `RouterStats`."""

    id: str
    version: str
    stats: RouterStats


class RouterSummary(RouterIndexStats, frozen=True, kw_only=True, omit_defaults=True):
    """One router in ``kvmesh status``: its `RouterIndexStats` fields, its id and version, the requests it
    routed, its error replies per code, its in-flight requests and its route receipts; a local index also its ``lag`` behind the
    stream (messages) and, when past the stream's end, `STREAM_RECREATED` as ``warning``."""

    id: str
    version: str
    lag: int | None = None
    warning: str | None = None
    routed: int
    errors: dict[str, int]
    in_flight: int
    receipts: dict[str, RouteReceipts] = msgspec.field(default_factory=dict)
    """``"worker/rank"`` → the route receipts of the requests this router answered (absent when none)."""
    latency: RouteLatency | None = None
    """p50/p99 route latency over its last answered routes (absent when none)."""


class Convergence(msgspec.Struct, frozen=True, kw_only=True):
    """Whether every index replica of the stream has caught up and agrees.

    ``converged``: at least one indexer replica answered, every indexer replica and every local-index
    router has applied the stream's last sequence, and the indexer replicas' digests are equal (routers
    report no digest; their applied sequence is compared). ``behind`` names each replica that has not (with
    its lag in messages), ``digests`` lists the distinct indexer digests (one when they agree).
    """

    converged: bool
    stream_last_seq: int
    indexers: int
    routers: int
    """Local-index routers counted (``--index remote`` routers hold no replica)."""
    digests: list[str]
    behind: list[str]


class StatusReport(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Everything ``kvmesh status`` shows, for one stream; ``kvmesh status --json`` prints it as
    ``msgspec.to_builtins(report)``, the schema scripts read: ``schema`` is its version (`STATUS_SCHEMA`).

    Replicas are sorted by replica id, ingests by worker id, routers by id; only replicas of the stream and
    routers whose local index follows it (or that ask the indexers) are listed. ``undecodable`` lists the
    replies that did not decode (absent when none).
    """

    schema: int = msgspec.field(default_factory=lambda: STATUS_SCHEMA)
    """`STATUS_SCHEMA` (always encoded: a factory default is not omitted)."""
    stream: StreamState
    replicas: list[ReplicaStatus]
    snapshots: list[SnapshotView] | Unreadable
    workers: dict[str, WorkerView] | Unreadable
    ingests: list[IngestStatus]
    routers: list[RouterSummary]
    convergence: Convergence
    undecodable: list[str] = msgspec.field(default_factory=list)


def convergence(
    replicas: Sequence[ReplicaStatus], routers: Sequence[RouterSummary], stream_last_seq: int
) -> Convergence:
    """Summarise whether the replicas of one stream converged (see `Convergence`)."""
    behind = [f"indexer {r.replica}: lag {r.lag}" for r in replicas if r.applied_seq != stream_last_seq]
    local = [r for r in routers if r.applied_seq is not None]
    behind += [f"router {r.id}: lag {r.lag}" for r in local if r.applied_seq != stream_last_seq]
    digests = sorted({r.digest for r in replicas})
    return Convergence(
        converged=bool(replicas) and not behind and len(digests) == 1,
        stream_last_seq=stream_last_seq,
        indexers=len(replicas),
        routers=len(local),
        digests=digests,
        behind=behind,
    )


# ---------------------------------------------------------------------------------------- pure parts


def _lag(applied_seq: int, stream_last_seq: int) -> tuple[int, str | None]:
    return max(0, stream_last_seq - applied_seq), STREAM_RECREATED if applied_seq > stream_last_seq else None


def replica_status(reply: IndexerStatus, stream_last_seq: int) -> ReplicaStatus:
    """Return ``reply`` with its lag behind ``stream_last_seq`` (and the recreated-stream warning)."""
    lag, warning = _lag(reply.applied_seq, stream_last_seq)
    fields = msgspec.structs.asdict(reply)
    return ReplicaStatus(**fields, lag=lag, warning=msgspec.UNSET if warning is None else warning)


def decode_router_service(data: bytes) -> RouterService:
    """Decode a router's ``$SRV.STATS`` reply (JSON).

    Raises:
        ProtocolError: not a stats reply, no ``route`` endpoint, or its ``data`` is not `RouterStats`.
    """
    envelope = decode(data, MicroServiceStats)
    for endpoint in envelope.endpoints:
        if endpoint.name == "route":
            data = bytes(endpoint.data)
            if data == b"null":
                raise ProtocolError(f"router {envelope.id}: its route endpoint carries no stats data")
            return RouterService(id=envelope.id, version=envelope.version, stats=decode(data, RouterStats))
    raise ProtocolError(f"router {envelope.id}: its $SRV.STATS reply has no route endpoint")


def router_status(service: RouterService, stream_last_seq: int) -> RouterSummary:
    """Summarise one router for ``kvmesh status``: its index fields, id, version, counters, and for a local
    index its lag behind ``stream_last_seq`` (flagged when the replica is past the stream's end)."""
    index = service.stats.index
    lag, warning = (None, None) if index.applied_seq is None else _lag(index.applied_seq, stream_last_seq)
    return RouterSummary(
        **msgspec.structs.asdict(index),
        id=service.id,
        version=service.version,
        lag=lag,
        warning=warning,
        routed=service.stats.routed,
        errors=service.stats.errors,
        in_flight=service.stats.in_flight,
        receipts=service.stats.receipts,
        latency=service.stats.latency,
    )


def age_s(mtime: str, now: float) -> float | None:
    """Seconds (rounded to the millisecond) from an Object Store mtime (RFC 3339, possibly with nanoseconds)
    to ``now`` (seconds since the epoch); None when it is empty or does not parse."""
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


def snapshot_views(entries: Sequence[SnapshotEntry], now: float) -> list[SnapshotView]:
    """The stored snapshots as ``kvmesh status`` lists them (in the order given: the store's, newest first)."""
    return [
        SnapshotView(name=e.name, seq=e.applied_seq, bytes=e.size_bytes, age_s=age_s(e.mtime, now))
        for e in entries
    ]


def worker_views(
    records: Mapping[str, WorkerRecord], replicas: Sequence[IndexerStatus], now: float
) -> dict[str, WorkerView]:
    """Every worker of the registry ``records`` or indexed (not removed) by a replica, by worker id, sorted.

    Args:
        records: worker id → its registry record.
        replicas: the replicas' status replies (their ``workers`` bookkeeping: model, epochs, last_ts).
        now: the wall clock, seconds since the epoch (ages are rounded to the millisecond).
    """
    seen: dict[str, tuple[str | None, float, dict[str, Any]]] = {}
    for r in replicas:
        for w, info in r.workers.items():
            if info.get("removed"):
                continue
            model, last, epochs = seen.get(w, (info.get("model"), 0.0, {}))
            seen[w] = (model, max(last, float(info.get("last_ts") or 0.0)), info.get("epochs") or epochs)
    out: dict[str, WorkerView] = {}
    for w in sorted({*records, *seen}):
        rec, idx = records.get(w), seen.get(w)
        last_ts = idx[1] if idx is not None and idx[1] > 0 else None
        last_age = round(now - last_ts, 3) if last_ts is not None else None
        if rec is not None:
            out[w] = WorkerView(
                registered=True,
                model=rec.model,
                dp_ranks=rec.dp_ranks,
                block_size=rec.block_size,
                incarnation=rec.incarnation,
                heartbeat_age_s=round(now - rec.heartbeat_ts, 3) if rec.heartbeat_ts else None,
                last_event_ts=last_ts,
                last_event_age_s=last_age,
            )
            continue
        assert idx is not None
        epochs = {int(k): int(v) for k, v in idx[2].items()}
        out[w] = WorkerView(
            registered=False,
            model=idx[0],
            dp_ranks=len(epochs),
            block_size=None,
            incarnation=max(epochs.values(), default=0),
            heartbeat_age_s=None,
            last_event_ts=last_ts,
            last_event_age_s=last_age,
        )
    return out


# ---------------------------------------------------------------------------------------- over NATS


async def _stream_state(nc: Client, stream: str) -> StreamState:
    try:
        info = await nc.jetstream().stream_info(stream)
    except nats.js.errors.NotFoundError:
        return StreamState(name=stream, error=STREAM_NOT_FOUND)
    except (nats.errors.Error, TimeoutError) as exc:
        return StreamState(name=stream, error=str(exc) or type(exc).__name__)
    s = info.state
    return StreamState(
        name=stream, messages=s.messages, bytes=s.bytes, first_seq=s.first_seq, last_seq=s.last_seq
    )


async def _snapshots(nc: Client, stream: str, now: float) -> list[SnapshotView] | Unreadable:
    try:
        store = await SnapshotStore.open(nc.jetstream(), subjects.snapshot_bucket(stream), create=False)
        entries = await store.list()
    except nats.js.errors.BucketNotFoundError:
        return []
    except (nats.errors.Error, TimeoutError) as exc:
        return Unreadable(error=str(exc) or type(exc).__name__)
    return snapshot_views(entries, now)


async def _workers(
    nc: Client, stream: str, replicas: Sequence[IndexerStatus], now: float
) -> dict[str, WorkerView] | Unreadable:
    try:
        kv = await nc.jetstream().key_value(subjects.registry_bucket(stream))
        records = await list_workers(kv)
    except nats.js.errors.BucketNotFoundError:
        records = {}
    except (nats.errors.Error, TimeoutError) as exc:
        return Unreadable(error=str(exc) or type(exc).__name__)
    return worker_views(records, replicas, now)


async def _routers(nc: Client, wait_s: float) -> tuple[list[RouterService], list[str]]:
    subject = f"$SRV.STATS.{subjects.ROUTER_QUEUE}"
    out: list[RouterService] = []
    bad: list[str] = []
    for data in await gather_replies(nc, subject, b"", wait_s) or []:
        try:
            out.append(decode_router_service(data))
        except ProtocolError as exc:
            log.warning("reply on %s does not decode as router stats: %s", subject, exc)
            bad.append(f"{subject}: {exc}")
    return out, bad


async def status(nc: Client, *, stream: str = subjects.STREAM, wait_s: float = 0.5) -> StatusReport:
    """Gather ``kvmesh status`` for one stream: its state, every indexer replica, stored snapshot, worker,
    ingest and router.

    Args:
        nc: an open connection.
        stream: the events stream (the index group).
        wait_s: seconds to collect status replies (indexers on ``kvmesh.index.status``, ingests on
            ``kvmesh.index.status.ingest``, routers on ``$SRV.STATS.kvmesh-router``; asked at once).

    Returns:
        The `StatusReport`. A stream, snapshot bucket or registry that cannot be read is reported in it
        (`StreamState.error`, `Unreadable`), never raised; a missing snapshot bucket or registry reads empty.

    Raises:
        TransportError: the status requests could not be published (the connection is closed).
    """
    state = await _stream_state(nc, stream)
    last = state.last_seq or 0
    indexers, ingests, (routers, bad_routers) = await asyncio.gather(
        gather(nc, subjects.STATUS_SUBJECT, IndexerStatus, wait_s),
        gather(nc, f"{subjects.STATUS_SUBJECT}.ingest", IngestStatus, wait_s),
        _routers(nc, wait_s),
    )
    mine = sorted((r for r in indexers.replies if r.stream == stream), key=lambda r: r.replica)
    now = time.time()
    summaries = (router_status(r, last) for r in routers)
    replicas = [replica_status(r, last) for r in mine]
    # A local-index router of another stream reports against that stream, not this one.
    ours = sorted((r for r in summaries if r.stream in (None, stream)), key=lambda r: r.id)
    return StatusReport(
        stream=state,
        replicas=replicas,
        snapshots=await _snapshots(nc, stream, now),
        workers=await _workers(nc, stream, mine, now),
        ingests=sorted(ingests.replies, key=lambda r: r.worker_id),
        routers=ours,
        convergence=convergence(replicas, ours, last),
        undecodable=[*indexers.undecodable, *ingests.undecodable, *bad_routers],
    )
