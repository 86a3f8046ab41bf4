"""`snapshot`, `replay` and `reset`: the index group's operator actions, typed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any, Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client

from kvmesh.core.errors import (
    ProtocolError,
    SnapshotNotFoundError,
    StreamUnavailableError,
    TransportError,
)
from kvmesh.core.events import IndexReset, encode_message
from kvmesh.core.protocol import IndexerStatus, SnapshotRequest, SnapshotResult, decode, encode
from kvmesh.ops.replies import gather
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import transport_error
from kvmesh.runtime.snapshots import SnapshotStore, plan_recovery, replay_stream

__all__ = [
    "ReplayResult",
    "ReplicaReset",
    "ResetResult",
    "events_prefix",
    "replay",
    "reset",
    "snapshot",
]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _transport(what: str) -> Iterator[None]:
    """Raise nats-py's errors (and timeouts) inside as kvmesh's `TransportError`s naming ``what``
    (`kvmesh.runtime.nats.transport_error`)."""
    try:
        yield
    except (nats.errors.Error, TimeoutError) as exc:
        raise transport_error(exc, what) from exc


async def _stream_info(nc: Client, stream: str) -> Any:
    """The stream's `nats.js.api.StreamInfo`; `StreamUnavailableError` when it does not exist."""
    with _transport(f"stream info {stream}"):
        try:
            return await nc.jetstream().stream_info(stream)
        except nats.js.errors.NotFoundError as exc:
            raise StreamUnavailableError(f"stream {stream} does not exist") from exc


def events_prefix(info: Any, given: str | None) -> str:
    """The events subject prefix: ``given`` when set, else the stream's one ``<prefix>.>`` subject (``info``
    is its `nats.js.api.StreamInfo`), else the default ``kvmesh.events``."""
    if given:
        return str(given)
    subs = list(getattr(info.config, "subjects", None) or [])
    if len(subs) == 1 and subs[0].endswith(".>"):
        return str(subs[0][:-2])
    return subjects.EVENTS_PREFIX


# ---------------------------------------------------------------------------------------- snapshot


async def snapshot(
    nc: Client, *, stream: str = subjects.STREAM, timeout_s: float = 30.0
) -> list[SnapshotResult]:
    """Ask the replicas of ``stream`` to write a snapshot now (a `SnapshotRequest` on ``kvmesh.index.snapshot``).

    The holder of the snapshot-writer lease writes one; the others decline with a reason.

    Args:
        nc: an open connection.
        stream: the events stream (the index group); replicas of other streams ignore the request.
        timeout_s: seconds to wait for the written snapshot.

    Returns:
        The replies in arrival order, up to and including the first with ``written`` true (the last one, when
        a snapshot was written within ``timeout_s``; none of them otherwise). Replies that do not decode as
        `SnapshotResult` are logged and left out.

    Raises:
        TransportError: nothing is subscribed to the snapshot subject (no indexer runs), or the request
            could not be published.
    """
    body = encode(SnapshotRequest(stream=stream))
    replies = await _until_written(nc, body, timeout_s)
    if replies is None:
        raise TransportError(
            f"no indexer answered: nothing is subscribed to {subjects.SNAPSHOT_SUBJECT} "
            f"(is an indexer of stream {stream} running?)"
        )
    return replies


async def _until_written(nc: Client, body: bytes, timeout_s: float) -> list[SnapshotResult] | None:
    inbox = nc.new_inbox()
    out: list[SnapshotResult] = []
    with _transport(f"request on {subjects.SNAPSHOT_SUBJECT}"):
        sub = await nc.subscribe(inbox)
        await nc.publish(subjects.SNAPSHOT_SUBJECT, body, reply=inbox)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while (remaining := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=remaining)
            except (nats.errors.Error, TimeoutError):
                break
            if not msg.data:  # no responders: no replica is subscribed at all
                return out or None
            try:
                result = decode(msg.data, SnapshotResult)
            except ProtocolError as exc:
                log.warning("snapshot reply does not decode: %s", exc)
                continue
            out.append(result)
            if result.written:
                break
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
    return out


# ---------------------------------------------------------------------------------------- replay


class ReplayResult(msgspec.Struct, frozen=True, kw_only=True):
    """An index rebuilt offline by `replay`: where it started, what it holds, what it read, what it cost.

    ``digest`` is the index's order-independent digest (16 hex digits): equal to a replica's in
    ``kvmesh status`` at the same ``applied_seq`` when both hold the same index. Times are seconds, rounded
    to the millisecond: ``seconds`` in all, ``restore_s`` building the start state, ``replay_s`` reading and
    applying, ``digest_s`` the digest.
    """

    stream: str
    snapshot: str | None
    """The snapshot object started from (None: the stream alone)."""
    snapshot_seq: int | None
    skipped: list[list[str]]
    """``[name, reason]`` of newer snapshots not used."""
    start_seq: int
    applied_seq: int
    blocks: int
    digest: str
    models: dict[str, list[int]]
    reset_epoch: int
    messages_read: int
    decode_errors: int
    apply_errors: int
    complete: bool
    """False when stream messages are gone that no snapshot covers (see ``gap``)."""
    gap: list[int] | None
    """``[first, last]`` stream sequences missing, or None."""
    incomplete: list[str]
    """``"worker/rank"`` of holders the gap leaves incomplete."""
    holder_health: dict[str, str]
    seconds: float
    restore_s: float
    replay_s: float
    digest_s: float


async def replay(
    nc: Client,
    *,
    stream: str = subjects.STREAM,
    from_snapshot: Literal["none", "latest"] | int = "none",
    to_seq: int = 0,
    prefix: str | None = None,
    timeout_s: float = 30.0,
    max_blocks: int | None = None,
) -> ReplayResult:
    """Rebuild an index in this process from the stream (with an ordered consumer: changes nothing).

    Args:
        nc: an open connection.
        stream: the events stream.
        from_snapshot: ``"none"`` (the stream alone), ``"latest"`` (the newest snapshot that verifies and the
            stream still continues) or a snapshot's stream sequence.
        to_seq: stop at this stream sequence (0, or past the stream's last: the last).
        prefix: the stream's events subject prefix (None: `events_prefix` of the stream).
        timeout_s: give up when no message arrives for this many seconds.
        max_blocks: the block bound of the replicas to compare with (`kvmesh.core.state.IndexState`), or None.

    Raises:
        StreamUnavailableError: the stream does not exist.
        SnapshotNotFoundError: ``from_snapshot`` names a sequence with no usable snapshot.
        TransportError: the stream stalled for ``timeout_s``, or a NATS request failed.
    """
    info = await _stream_info(nc, stream)
    js = nc.jetstream()
    last = info.state.last_seq if to_seq <= 0 else min(to_seq, info.state.last_seq)
    store = None
    if from_snapshot != "none":
        with _transport("snapshot bucket"), contextlib.suppress(nats.js.errors.BucketNotFoundError):
            store = await SnapshotStore.open(js, subjects.snapshot_bucket(stream), create=False)
    only = from_snapshot if isinstance(from_snapshot, int) else None
    with _transport("snapshots"):
        plan = await plan_recovery(
            store, first_seq=info.state.first_seq, last_seq=last, only_seq=only, name="kvmesh replay"
        )
    if only is not None and plan.snapshot_seq != only:
        raise SnapshotNotFoundError(
            f"no usable snapshot at seq {only} (skipped: {plan.skipped or 'not found'})"
        )
    t0 = time.perf_counter()
    state = plan.state(max_blocks=max_blocks)
    restore_s = time.perf_counter() - t0
    with _transport(f"replay of stream {stream}"):
        stats = await replay_stream(
            js,
            state,
            stream=stream,
            events_prefix=events_prefix(info, prefix),
            start_seq=plan.start_seq,
            to_seq=last,
            timeout_s=timeout_s,
        )
    t1 = time.perf_counter()
    digest = state.digest()
    return ReplayResult(
        stream=stream,
        snapshot=plan.snapshot,
        snapshot_seq=plan.snapshot_seq,
        skipped=plan.skipped,
        start_seq=plan.start_seq,
        applied_seq=state.applied_seq,
        blocks=state.block_total(),
        digest=f"{digest:016x}",
        models=state.models(),
        reset_epoch=state.reset_epoch,
        messages_read=stats.messages,
        decode_errors=stats.decode_errors,
        apply_errors=stats.apply_errors,
        complete=state.gap_seq is None,
        gap=plan.gap,
        incomplete=[f"{w}/{r}" for w, r in state.incomplete()],
        holder_health={f"{w}/{r}": why for (w, r), why in state.holder_health().items()},
        seconds=round(time.perf_counter() - t0, 3),
        restore_s=round(restore_s, 3),
        replay_s=round(stats.seconds, 3),
        digest_s=round(time.perf_counter() - t1, 3),
    )


# ---------------------------------------------------------------------------------------- reset


class ReplicaReset(msgspec.Struct, frozen=True, kw_only=True):
    """One replica after a reset: whether it applied it, its applied sequence, reset epoch and blocks."""

    applied: bool
    applied_seq: int
    reset_epoch: int
    blocks: int


class ResetResult(msgspec.Struct, frozen=True, kw_only=True):
    """A reset published by `reset`: its epoch, stream sequence, whether the server dropped it as a duplicate
    (``Nats-Msg-Id`` ``reset:<epoch>`` seen within the duplicate window), and each replica by id."""

    stream: str
    reset_epoch: int
    seq: int
    duplicate: bool
    replicas: dict[str, ReplicaReset]

    @property
    def applied(self) -> bool:
        """Every replica that answered applied the reset."""
        return all(r.applied for r in self.replicas.values())


async def _replicas(nc: Client, stream: str) -> list[IndexerStatus]:
    found = await gather(nc, subjects.STATUS_SUBJECT, IndexerStatus, 0.5)
    return sorted((r for r in found.replies if r.stream == stream), key=lambda r: r.replica)


async def reset(
    nc: Client,
    *,
    stream: str = subjects.STREAM,
    reason: str = "operator",
    prefix: str | None = None,
    wait_s: float = 10.0,
) -> ResetResult:
    """Start a new index epoch: publish an `IndexReset` (epoch = the replicas' highest + 1) into the stream, so
    every replica (and every later replay) forgets its whole index at that one sequence; then wait up to
    ``wait_s`` seconds for the running replicas to apply it.

    Args:
        nc: an open connection.
        stream: the events stream.
        reason: recorded in the reset message.
        prefix: the stream's events subject prefix (None: `events_prefix` of the stream); the reset goes to
            ``<prefix>._control``.
        wait_s: seconds to wait for the replicas (polled every 0.2 s).

    Raises:
        StreamUnavailableError: the stream does not exist.
        TransportError: the publish was not acknowledged, or a NATS request failed.
    """
    info = await _stream_info(nc, stream)
    epoch = max((r.reset_epoch for r in await _replicas(nc, stream)), default=0) + 1
    with _transport(f"publish of the reset to stream {stream}"):
        ack = await nc.jetstream().publish(
            subjects.control_subject(events_prefix(info, prefix)),
            encode_message(IndexReset(epoch=epoch, reason=reason)),
            stream=stream,
            headers={"Nats-Msg-Id": f"reset:{epoch}"},
        )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    seen = await _replicas(nc, stream)
    while any(r.applied_seq < ack.seq for r in seen) and loop.time() < deadline:
        await asyncio.sleep(0.2)
        seen = await _replicas(nc, stream)
    return ResetResult(
        stream=stream,
        reset_epoch=epoch,
        seq=ack.seq,
        duplicate=bool(ack.duplicate),
        replicas={
            r.replica: ReplicaReset(
                applied=r.applied_seq >= ack.seq,
                applied_seq=r.applied_seq,
                reset_epoch=r.reset_epoch,
                blocks=r.blocks,
            )
            for r in seen
        },
    )
