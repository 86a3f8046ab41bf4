"""The indexer service: stream → `IndexState` → match queries over NATS request-reply.

On start its `kvmesh.runtime.replica.StreamReplica` loads the newest snapshot that verifies from the group's
Object Store bucket (falling back to older ones), then reads the events stream from the snapshot's sequence
+ 1 with an ordered push consumer (no durable consumer, so nothing is orphaned when a replica goes away) and
applies every message in stream order; the service joins the match queue group only once it has caught up with the stream's last sequence as of
its start — a replica that is behind never answers. When the stream no longer holds the messages after
every usable snapshot, it starts from what the stream holds, marks the state incomplete
(`IndexState.mark_gap`, shown by ``kvmesh status``) and logs it.

While running, the holder of the group's snapshot-writer lease writes a snapshot every
``snapshot_every_messages`` applied messages or ``snapshot_every_s`` seconds (and on ``kvmesh snapshot``):
the state is copied between two applied messages (`IndexState.export`, tens of ms per million blocks),
encoded in a thread, stored, the oldest snapshots beyond ``snapshot_keep`` deleted, and stream messages no
kept snapshot needs purged. Every replica also watches the worker registry and publishes `WorkerRemoved`
when a worker's key expires or is deleted (`kvmesh.runtime.registry`). Match and status endpoints are a
NATS micro service (``kvmesh-indexer``), so ``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS`` discover it.

Match protocol (msgpack): request ``{"model", "token_ids", "lora_name", "cache_salt"}``, ``token_ids`` either
the token ids packed as little-endian uint32 (msgpack bin: what the router sends, no per-token work on either
side) or a msgpack array of ints; reply
``{"index_seq", "block_size", "prompt_blocks", "candidates": [[worker_id, dp_rank, overlap_blocks,
cached_blocks, tiers, block_size(, health)], ...]}`` (``tiers``: overlap blocks per storage medium, nil when
all are on GPU; ``block_size``: the holder's own block size, which its blocks count in; ``health``: why the
holder's index is not exact, present only then) or ``{"error": {"code", "message"}}`` with codes ``bad_request`` and
``unknown_model``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
import time
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, ServiceConfig

from kvmesh.core.errors import RequestError, clip_echo
from kvmesh.core.snapshot import encode_snapshot
from kvmesh.core.state import IndexState, UnknownModelError
from kvmesh.indexer.config import IndexerSettings
from kvmesh.runtime import subjects
from kvmesh.runtime.cli import VERSION
from kvmesh.runtime.nats import (
    ConnectionClosedForGood,
    close_quietly,
    connect,
    wait_closed,
    wait_for_stream,
)
from kvmesh.runtime.registry import (
    WATCH_INACTIVE_S,
    RegistrySettings,
    WorkerRecord,
    open_registry,
    publish_removal,
)
from kvmesh.runtime.replica import StreamReplica, retry_start
from kvmesh.runtime.snapshots import (
    SnapshotLease,
    SnapshotStore,
    default_stream_max_age_s,
    open_kv,
    stream_id,
)

log = logging.getLogger("kvmesh.indexer")

_STOP_TIMEOUT_S = 5.0
"""Bound on each shutdown step, so a stuck call never keeps a stopping replica (and its connection) alive."""


T = TypeVar("T")


class _Stopped(Exception):
    """`stop()` was called during start-up."""


async def _true(aw: Awaitable[None]) -> bool:
    await aw
    return True


class MatchRequest(msgspec.Struct, kw_only=True):
    """A match query from a router."""

    model: str
    token_ids: bytes | list[int]
    """Token ids packed as little-endian uint32, or as a list of ints."""
    lora_name: str | None = None
    cache_salt: str | None = None


def _unpack_tokens(packed: bytes) -> array[int]:
    """Token ids from little-endian uint32 bytes.

    Raises:
        RequestError: the length is not a multiple of 4 (``field="token_ids"``).
    """
    if len(packed) % 4:
        raise RequestError(
            f"packed token_ids must be little-endian uint32 (4 bytes each), got {len(packed)} bytes",
            field="token_ids",
        )
    tokens = array("I")
    tokens.frombytes(packed)
    if sys.byteorder == "big":  # pragma: no cover
        tokens.byteswap()
    return tokens


class IndexerService:
    """One indexer replica."""

    def __init__(self, settings: IndexerSettings) -> None:
        self.settings = settings
        self.replica = settings.replica_name()
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._nc: Client | None = None
        self._replica: StreamReplica | None = None
        self._empty = IndexState()
        self._started = time.monotonic()
        self._decoder = msgspec.msgpack.Decoder(MatchRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._js: Any = None
        self._store: SnapshotStore | None = None
        self._lease: SnapshotLease | None = None
        self._registry_kv: Any = None
        self._registry: dict[str, WorkerRecord] = {}
        self._members: dict[str, str] = {}
        """Registry members (worker id → model), mirrored from the snapshot bucket."""
        self._snapshot_lock = asyncio.Lock()
        self._since_snapshot = 0
        self._last_snapshot_at = time.monotonic()
        self.snapshots: dict[str, Any] = {
            "written": 0,
            "last": None,
            "max_stall_ms": 0.0,
            "last_stall_ms": 0.0,
        }
        self.removals_published = 0

    # The replica's state and counters (an empty state until `run()` has connected).

    @property
    def state(self) -> IndexState:
        """The index state this replica serves."""
        return self._replica.state if self._replica is not None else self._empty

    @property
    def read_messages(self) -> int:
        """Stream messages this replica's consumer received."""
        return self._replica.read_messages if self._replica is not None else 0

    @property
    def decode_errors(self) -> int:
        """Stream messages that could not be decoded (skipped)."""
        return self._replica.decode_errors if self._replica is not None else 0

    @property
    def apply_errors(self) -> int:
        """Stream messages that failed to apply (skipped)."""
        return self._replica.apply_errors if self._replica is not None else 0

    @property
    def resubscribes(self) -> int:
        """Times the stream consumer stalled and was re-created (NATS restarts)."""
        return self._replica.resubscribes if self._replica is not None else 0

    @property
    def recovery(self) -> dict[str, Any]:
        """How this replica started: snapshot used, skipped ones, start sequence, messages read to ready."""
        return self._replica.recovery if self._replica is not None else {}

    async def run(self) -> None:
        """Catch up with the stream, then serve match queries until `stop()`."""
        s = self.settings
        self._nc = nc = await connect(s.nats_url, name=f"kvmesh-indexer-{self.replica}")
        try:
            await self._run(nc)
        finally:
            # Always close the connection, even when start-up failed or a task would not stop: a connection
            # left open outlives its event loop (and, in tests, surfaces as an unclosed socket elsewhere).
            await close_quietly(nc)

    async def _run(self, nc: Client) -> None:
        s = self.settings
        js = nc.jetstream()
        name = f"indexer {self.replica}"

        async def step(op: Callable[[], Awaitable[T]], what: str) -> T:
            # Every start-up call rides out timeouts while fresh R3 buckets and streams elect their leaders.
            out = await retry_start(op, what=what, name=name, stop=self._stop)
            if out is None or self._stop.is_set():
                raise _Stopped
            return out

        try:
            await step(
                lambda: _true(wait_for_stream(js, s.stream, stop=self._stop)), f"wait for stream {s.stream}"
            )
            self._js = js
            # Buckets as durable as the stream they index (0: the stream's own replica count).
            stream_config = (
                await step(lambda: js.stream_info(s.stream), f"read stream info of {s.stream}")
            ).config
            replicas = s.buckets_replicas or max(1, stream_config.num_replicas or 1)
            self._store = await step(
                lambda: SnapshotStore.open(
                    js,
                    s.snapshot_bucket_name(),
                    memory=s.buckets_memory,
                    max_bytes=s.buckets_max_bytes,
                    replicas=replicas,
                ),
                f"open snapshot bucket {s.snapshot_bucket_name()}",
            )
            lease_kv = await step(
                lambda: open_kv(
                    js,
                    s.lease_bucket_name(),
                    ttl_s=s.lease_ttl_s,
                    memory=s.buckets_memory,
                    replicas=replicas,
                ),
                f"open lease bucket {s.lease_bucket_name()}",
            )
            self._lease = SnapshotLease(lease_kv, self.replica)
            self._registry_kv = await step(
                lambda: open_registry(
                    js,
                    RegistrySettings(
                        bucket=s.registry_bucket_name(),
                        ttl_s=s.worker_ttl_s,
                        memory=s.buckets_memory,
                        replicas=replicas,
                    ),
                ),
                f"open registry bucket {s.registry_bucket_name()}",
            )
            info = await step(lambda: js.stream_info(s.stream), f"read stream info of {s.stream}")
            self._check_retention(info.config.max_age or 0.0)
            self._replica = replica = StreamReplica(
                js,
                stream=s.stream,
                events_prefix=s.events_prefix,
                store=self._store,
                name=name,
                stop=self._stop,
                on_message=self._count_message,
            )
            start_seq = await step(lambda: replica.recover(info), f"recover from the snapshots of {s.stream}")
        except _Stopped:
            return
        log.info(
            "indexer %s: reading %s from seq %d (%d messages, last seq %d)",
            self.replica,
            s.stream,
            start_seq,
            info.state.messages,
            info.state.last_seq,
        )
        consume = asyncio.create_task(replica.follow(start_seq))
        service = None
        tasks: list[asyncio.Task[None]] = [consume]
        subs: list[Any] = []
        try:
            await replica.wait_caught_up()
            if self._stop.is_set():
                return
            service = await add_service(
                nc,
                ServiceConfig(
                    name="kvmesh-indexer",
                    version=VERSION,
                    description="kvmesh prefix index replica",
                    metadata={"replica": self.replica},
                    queue_group=subjects.INDEXER_QUEUE,
                ),
            )
            await service.add_endpoint(
                EndpointConfig(name="match", subject=s.match_subject, handler=self._on_match)
            )
            subs.append(await nc.subscribe(subjects.STATUS_SUBJECT, cb=self._on_status))
            subs.append(await nc.subscribe(subjects.SNAPSHOT_SUBJECT, cb=self._on_snapshot))
            # The server must know every subscription before anyone is told we are ready. nats-py writes PING
            # straight to the socket but SUB through its pending buffer, so one flush can overtake the SUB.
            await nc.flush()
            await nc.flush()
            # Whatever the restore allocated is long-lived: keep it out of the cyclic collector's full passes
            # (the index's own maps hold only ints and are not tracked; a pass takes ~1 ms at a million blocks).
            gc.collect()
            gc.freeze()
            self.recovery["read_to_ready"] = self.read_messages
            self.recovery["ready_s"] = round(time.monotonic() - self._started, 3)
            self.ready.set()
            log.info(
                "indexer %s: ready at stream seq %d (%d blocks) after %.2f s, %d messages read",
                self.replica,
                self.state.applied_seq,
                self.state.block_total(),
                time.monotonic() - self._started,
                self.read_messages,
            )
            tasks += [
                asyncio.create_task(self._lease_loop()),
                asyncio.create_task(self._snapshot_loop()),
                asyncio.create_task(self._watch_registry()),
            ]
            stop_wait = asyncio.create_task(self._stop.wait())
            closed = asyncio.create_task(wait_closed(nc))
            await asyncio.wait({consume, stop_wait, closed}, return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
            closed.cancel()
            if consume.done() and not self._stop.is_set():
                consume.result()
            if closed.done() and not closed.cancelled() and not self._stop.is_set():
                raise ConnectionClosedForGood(
                    f"indexer {self.replica}: the NATS connection was closed for good; exiting"
                )
        finally:
            self._stop.set()  # background loops check it: nats-py may swallow a cancellation
            for t in tasks:
                t.cancel()
            _, stuck = await asyncio.wait(tasks, timeout=_STOP_TIMEOUT_S)
            if stuck:
                log.warning("indexer %s: %d tasks did not stop in time", self.replica, len(stuck))
            for sub_ in subs:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(sub_.unsubscribe(), _STOP_TIMEOUT_S)
            if self._lease is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._lease.release(), _STOP_TIMEOUT_S)
            if service is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(service.stop(), _STOP_TIMEOUT_S)

    def _check_retention(self, max_age_s: float) -> None:
        """Warn when the stream may age out messages that the kept snapshots still need."""
        s = self.settings
        if not s.snapshot_every_s or not max_age_s:
            return
        wanted = default_stream_max_age_s(s.snapshot_every_s, s.snapshot_keep)
        if max_age_s < wanted:
            log.warning(
                "indexer %s: stream %s keeps messages %.0f s, less than the %.0f s that snapshots every %.0f s "
                "with %d kept need (max(24 h, 4 × interval × keep)); a restart may find a gap",
                self.replica,
                s.stream,
                max_age_s,
                wanted,
                s.snapshot_every_s,
                s.snapshot_keep,
            )

    def stop(self) -> None:
        """Ask `run()` to finish."""
        self._stop.set()

    def _count_message(self) -> None:
        self._since_snapshot += 1

    # ------------------------------------------------------------------ snapshots

    async def snapshot(self, *, force: bool = False) -> dict[str, Any]:
        """Write a snapshot now if this replica holds (or can take) the writer lease.

        Returns:
            ``{"written": True, "name", "applied_seq", "bytes", "stall_ms", "encode_ms", "store_ms",
            "deleted", "purged_before"}`` or ``{"written": False, "reason"}``.
        """
        assert self._store is not None and self._lease is not None and self._replica is not None
        async with self._snapshot_lock:
            if not await self._lease.try_acquire():
                return {"written": False, "reason": f"lease held by {await self._lease.holder()}"}
            last = self.snapshots["last"]
            if (
                not force
                and last is not None
                and (last["applied_seq"], last.get("stream_id"))
                == (self.state.applied_seq, self._replica.stream_id)
            ):
                return {"written": False, "reason": "nothing new since the last snapshot"}
            info = await self._js.stream_info(self.settings.stream)
            identity = stream_id(info)
            if self._replica.stream_id and identity and identity != self._replica.stream_id:
                return {
                    "written": False,
                    "reason": "the stream was re-created; this replica is rebuilding from it",
                }
            t0 = time.perf_counter()
            export = self.state.export()
            t1 = time.perf_counter()
            taken, self._since_snapshot = self._since_snapshot, 0
            self._last_snapshot_at = time.monotonic()
            try:
                data = await asyncio.to_thread(encode_snapshot, export)
                t2 = time.perf_counter()
                entry = await self._store.put(export.applied_seq, data, stream=self._replica.stream_id)
            except BaseException:
                # Not written: what it would have covered still counts towards the next one (the snapshot
                # loop retries), instead of waiting for another --snapshot-every-messages.
                self._since_snapshot += taken
                raise
            t3 = time.perf_counter()
            info = await self._js.stream_info(self.settings.stream)
            deleted = await self._store.prune(
                self.settings.snapshot_keep, stream=stream_id(info), last_seq=info.state.last_seq
            )
            purged = await self._purge(info) if self.settings.purge_after_snapshot else None
            stall_ms = (t1 - t0) * 1e3
            result = {
                "written": True,
                "replica": self.replica,
                "name": entry.name,
                "stream_id": self._replica.stream_id,
                "applied_seq": export.applied_seq,
                "bytes": len(data),
                "stall_ms": round(stall_ms, 2),
                "encode_ms": round((t2 - t1) * 1e3, 1),
                "store_ms": round((t3 - t2) * 1e3, 1),
                "deleted": deleted,
                "purged_before": purged,
            }
            self.snapshots["written"] += 1
            self.snapshots["last"] = result
            self.snapshots["last_stall_ms"] = result["stall_ms"]
            self.snapshots["max_stall_ms"] = max(self.snapshots["max_stall_ms"], result["stall_ms"])
            log.info(
                "indexer %s: snapshot %s written (%d bytes, stall %.1f ms, encode %.0f ms, store %.0f ms)",
                self.replica,
                entry.name,
                len(data),
                stall_ms,
                (t2 - t1) * 1e3,
                (t3 - t2) * 1e3,
            )
            return result

    async def _purge(self, info: Any) -> int | None:
        """Purge stream messages before the oldest kept snapshot's next one, but never an ingest's last
        message on a live worker's rank subject (ingest resumes its cursor from it). Returns the cut.

        Only snapshots of the stream as of ``info`` (its identity, within its last sequence) count: objects
        planted beyond the stream or left from a deleted stream of the same name never allow a cut.
        """
        assert self._store is not None
        s = self.settings
        kept = await self._store.kept(stream=stream_id(info), last_seq=info.state.last_seq)
        if len(kept) < s.snapshot_keep:
            return None  # keep the stream whole until K snapshots exist
        cut = min(e.applied_seq for e in kept) + 1
        for model, worker, rank in self.state.live_holders():
            try:
                last = await self._js.get_last_msg(
                    s.stream, subjects.events_subject(s.events_prefix, model, worker, rank)
                )
            except nats.js.errors.NotFoundError:
                continue
            cut = min(cut, last.seq)
        info = await self._js.stream_info(s.stream)
        if cut <= info.state.first_seq:
            return None
        await self._js.purge_stream(s.stream, seq=cut)
        log.info("indexer %s: purged stream %s before seq %d", self.replica, s.stream, cut)
        return cut

    async def _snapshot_loop(self) -> None:
        s = self.settings
        failing = False
        while not self._stop.is_set():
            await asyncio.sleep(0.2)
            due = (s.snapshot_every_messages and self._since_snapshot >= s.snapshot_every_messages) or (
                s.snapshot_every_s
                and self._since_snapshot > 0
                and time.monotonic() - self._last_snapshot_at >= s.snapshot_every_s
            )
            if not due or self._lease is None or not self._lease.held:
                continue
            try:
                await self.snapshot()
                if failing:
                    log.info("indexer %s: snapshots work again", self.replica)
                failing = False
            except Exception as exc:
                if self._stop.is_set():
                    return
                if not failing:  # one warning per outage (a bucket without a leader fails every attempt)
                    log.warning("indexer %s: snapshot failed (%r); retrying quietly", self.replica, exc)
                failing = True
                self._last_snapshot_at = time.monotonic()

    async def _lease_loop(self) -> None:
        assert self._lease is not None
        while not self._stop.is_set():
            try:
                await self._lease.try_acquire()
            except Exception as exc:
                log.debug("indexer %s: lease renewal failed: %r", self.replica, exc)
            # Sleep on the stop event: a cancellation swallowed inside nats-py must not keep this loop alive.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.settings.lease_ttl_s / 3)

    async def _on_snapshot(self, msg: Any) -> None:
        """Answer `kvmesh snapshot`: ``{"stream": S}`` (or an empty body) asks the replicas of stream S."""
        try:
            wanted = msgspec.json.decode(msg.data or b"{}", type=dict[str, Any]).get("stream")
        except (msgspec.DecodeError, msgspec.ValidationError):
            wanted = None
        if wanted is not None and wanted != self.settings.stream:
            return  # another index group's request: its replicas answer
        try:
            result = await self.snapshot(force=True)
        except Exception as exc:
            log.warning("indexer %s: requested snapshot failed: %r", self.replica, exc)
            result = {
                "written": False,
                "reason": f"the snapshot could not be stored or the stream read ({type(exc).__name__}: "
                f"{exc or 'no detail'}); JetStream may be electing a leader, try again",
                "error": type(exc).__name__,
            }
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(
                    msgspec.json.encode({"replica": self.replica, "stream": self.settings.stream, **result})
                )

    # ------------------------------------------------------------------ worker registry

    async def _watch_registry(self) -> None:
        """Publish `WorkerRemoved` when a registered worker's key expires or is deleted, and reconcile once
        the watch has delivered the keys that exist (see `_reconcile`)."""
        kv = self._registry_kv
        while not self._stop.is_set():
            try:
                if self._store is not None:
                    self._members = await self._store.members()
                watcher = await kv.watchall(inactive_threshold=WATCH_INACTIVE_S)
                registered: set[str] = set()
                synced = False
                async for entry in watcher:
                    if entry is None:
                        if not synced:
                            synced = True
                            await self._reconcile(registered)
                        continue
                    if not synced:
                        worker = subjects.from_kv_key(entry.key)
                        if entry.operation is None and entry.value:
                            registered.add(worker)
                        else:
                            registered.discard(worker)
                    await self._on_registry(entry)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("indexer %s: registry watch failed (%r); restarting", self.replica, exc)
                await asyncio.sleep(1.0)

    async def _reconcile(self, registered: set[str]) -> None:
        """Remove every worker live in the index that is a registry member but has no key now.

        A worker is a registry member once any indexer saw its key (recorded durably as a ``member-<worker>``
        object in the snapshot bucket, which has no TTL): its heartbeats stopped while no replica watched, and
        its delete marker may have aged out too, so no delete entry will ever come. A worker that never
        heartbeated (a stream fed directly, without a registry) is no member and stays. Members that are
        neither registered nor live in the index are forgotten.
        """
        for worker, model in sorted(self._members.items()):
            if worker in registered:
                continue
            live = self.state.live_worker(worker)
            if live is None:
                if self._store is not None:
                    await self._store.delete_member(worker)
                self._members.pop(worker, None)
                continue
            indexed_model, epoch = live
            seq = await publish_removal(
                self._js,
                stream=self.settings.stream,
                events_prefix=self.settings.events_prefix,
                worker_id=worker,
                model=indexed_model or model,
                incarnation=epoch,
                reason="not registered",
            )
            self.removals_published += 1
            log.warning(
                "indexer %s: worker %s (a registry member) has no registry key: published its removal "
                "(incarnation %d) at seq %d",
                self.replica,
                worker,
                epoch,
                seq,
            )

    async def _on_registry(self, entry: Any) -> None:
        worker = subjects.from_kv_key(entry.key)
        if entry.operation is None:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                put = msgspec.json.decode(entry.value or b"", type=WorkerRecord)
                self._registry[worker] = put
                if worker not in self._members and self._store is not None:
                    await self._store.put_member(worker, put.model)
                    self._members[worker] = put.model
            return
        record = self._registry.pop(worker, None)
        live = self.state.live_worker(worker)
        if live is None:
            return  # never indexed, or already removed at an earlier stream point
        model, epoch = live
        incarnation = record.incarnation if record is not None else epoch
        reason = "expired" if entry.operation == "PURGE" else "deleted"
        seq = await publish_removal(
            self._js,
            stream=self.settings.stream,
            events_prefix=self.settings.events_prefix,
            worker_id=worker,
            model=record.model if record is not None else model,
            incarnation=incarnation,
            reason=reason,
        )
        self.removals_published += 1
        log.warning(
            "indexer %s: worker %s %s from the registry: published its removal (incarnation %d) at seq %d",
            self.replica,
            worker,
            reason,
            incarnation,
            seq,
        )

    # ------------------------------------------------------------------ endpoints

    async def _on_match(self, req: Request) -> None:
        try:
            query = self._decoder.decode(req.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self._error(req, "bad_request", f"bad match request: {exc}", 400)
            return
        except RecursionError:  # msgspec gives up on input nested deeper than it can decode
            await self._error(req, "bad_request", "bad match request: nested too deeply to decode", 400)
            return
        try:
            tokens = query.token_ids
            result = self.state.match(
                query.model,
                _unpack_tokens(tokens) if isinstance(tokens, bytes) else tokens,
                lora_name=query.lora_name,
                cache_salt=query.cache_salt,
            )
        except UnknownModelError:
            await self._error(req, "unknown_model", f"no worker serves model {query.model!r}", 404)
            return
        except RequestError as exc:
            await self._error(req, "bad_request", str(exc), 400)
            return
        await req.respond(
            self._encoder.encode(
                {
                    "index_seq": result.index_seq,
                    "block_size": result.block_size,
                    "prompt_blocks": result.prompt_blocks,
                    "replica": self.replica,
                    "candidates": [
                        [c.worker_id, c.dp_rank, c.overlap_blocks, c.cached_blocks, c.tiers, c.block_size]
                        + ([c.health] if c.health is not None else [])
                        for c in result.candidates
                    ],
                }
            )
        )

    async def _error(self, req: Request, code: str, message: str, status: int) -> None:
        message = clip_echo(message)  # it may repeat the request's model name
        await req.respond_error(
            str(status),
            f"{code}: {message}",
            self._encoder.encode({"error": {"code": code, "message": message}}),
        )

    def status(self) -> dict[str, Any]:
        """Return this replica's sequence, size, digest and counters (what `kvmesh status` shows)."""
        st = self.state
        return {
            "replica": self.replica,
            "stream": self.settings.stream,
            "ready": self.ready.is_set(),
            "applied_seq": st.applied_seq,
            "blocks": st.block_total(),
            "digest": f"{st.digest():016x}",
            "models": st.models(),
            "counters": asdict(st.counters)
            | {"decode_errors": self.decode_errors, "apply_errors": self.apply_errors},
            "workers": st.workers(),
            "complete": st.gap_seq is None,
            "incomplete": [f"{w}/{r}" for w, r in st.incomplete()],
            "holder_health": {f"{w}/{r}": why for (w, r), why in st.holder_health().items()},
            "reset_epoch": st.reset_epoch,
            "read_messages": self.read_messages,
            "resubscribes": self.resubscribes,
            "stream_id": self._replica.stream_id if self._replica is not None else "",
            "rebuilds": self._replica.rebuilds if self._replica is not None else 0,
            "recovery": self.recovery,
            "snapshots": self.snapshots,
            "snapshot_writer": self._lease is not None and self._lease.held,
        }

    async def _on_status(self, msg: Any) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(msgspec.json.encode(self.status()))
