"""The ingest's registry side: its worker's heartbeat, its start-up check, its clean-stop removal.

The worker's registry key is kept alive every TTL/3 with a `WorkerRecord` (ranks, incarnation, stale ranks,
block size, context length, KV capacity). An ingest that reads only some of its worker's ranks (one node of
a multi-node worker: ``--data-parallel-start-rank``, ``--data-parallel-size-local``) keeps its node's key
instead (`kvmesh.runtime.registry.registry_key` with its ranks), so the nodes of one worker never overwrite
each other; everything below applies to that key.
Each heartbeat is a conditional put over the revision last written (`Registration._beat`): a key that aged out
while the registry was out of reach is registered again with the same incarnation, unless an indexer claimed
the expiry first (then the worker was removed from the index, and a new incarnation starts on every rank).
When every engine rank is gone the ingest leaves the registry and rejoins, as a new incarnation, once the
engine answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.js import JetStreamContext

from kvmesh.core.liveness import LivenessChange
from kvmesh.core.protocol import WorkerRecord
from kvmesh.ingest.batches import Rank
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.liveness import EngineWatch
from kvmesh.runtime import subjects
from kvmesh.runtime.registry import (
    RegistrySettings,
    deregister,
    key_present,
    open_registry,
    put_record,
    read_key,
    registry_key,
    wrong_revision,
)

RETRY_S = 1.0
"""Seconds before a failed heartbeat is tried again (at most TTL/3)."""

log = logging.getLogger("kvmesh.ingest")

STOP_S = 2.0
"""Seconds a stopping ingest gives each registry call of its removal."""


class Registration:
    """One worker's registry key.

    Args:
        settings: worker, model, ranks, block size, TTL, bucket.
        ranks: endpoint rank → its state (epochs and holder dp_ranks for the record).
        rejoin: starts a new incarnation on every rank, called with the reason.
    """

    def __init__(
        self, settings: IngestSettings, ranks: dict[int, Rank], rejoin: Callable[[str], None]
    ) -> None:
        self.settings = settings
        self.ranks = ranks
        self.rejoin = rejoin
        self.js: JetStreamContext | None = None
        self.stream_replicas = settings.stream_replicas
        """Replicas of the events stream as it exists (what the registry bucket is created with)."""
        self.watch: EngineWatch | None = None
        """Engine liveness per rank (None with probing off)."""
        self._kv: Any = None
        self._beat_now = asyncio.Event()
        """Set to send a heartbeat at once (an engine rank changed liveness)."""
        self._left_for_dead = False
        """True while every engine rank is gone and this ingest took the worker out of the registry."""
        self._rejoined_live = False
        """The engine came back and this ingest rejoined: the next heartbeat puts the key it had deleted."""
        self._revision: int | None = None
        """The key's revision this ingest last wrote or read (None: not read yet)."""
        self._put_at = time.monotonic()
        """When the last heartbeat that reached the registry was sent (monotonic seconds)."""
        self.registered = False
        """True once this incarnation's key is in the registry (written, or found at start and resumed)."""
        self.node: range | None = settings.local_ranks() if settings.multi_node() else None
        """The ranks of this ingest's node key, or None: it reads every rank and keeps the worker's key."""

    async def _open(self) -> Any:
        """Open (creating when missing, with the stream's replica count) the registry bucket."""
        assert self.js is not None
        s = self.settings
        return await open_registry(
            self.js,
            RegistrySettings(
                bucket=s.registry_bucket or subjects.registry_bucket(s.stream),
                ttl_s=s.worker_ttl_s,
                memory=s.stream_memory,
                replicas=self.stream_replicas,
            ),
        )

    async def run(self) -> None:
        """Heartbeat until cancelled (see the module docstring).

        Each heartbeat is a conditional put (`_beat`); reading the key (a direct get) creates no consumer, and
        a timeout or an unreadable bucket leaves the worker as it is.
        """
        s = self.settings
        while True:
            try:
                if self._kv is None:
                    self._kv = await self._open()
                kv = self._kv
                if self.watch is not None and self.watch.all_gone():
                    if not self._left_for_dead:
                        # Routes to it would fail: leave now (watchers publish the removal) and rejoin as a
                        # new incarnation once the engine answers again.
                        self._left_for_dead = True
                        log.error(
                            "worker %s: every engine rank is gone; leaving the registry until it answers",
                            s.worker_id,
                            extra={"worker_id": s.worker_id},
                        )
                        await deregister(kv, s.worker_id, self.node)
                    await self._wait_beat()
                    continue
                await self._beat(kv)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Open (re-creating if needed) the bucket again next time: it may have been deleted.
                self._kv = None
                retry_s = min(RETRY_S, s.worker_ttl_s / 3)
                log.warning(
                    "worker %s: heartbeat failed (%r); retrying in %.1f s",
                    s.worker_id,
                    exc,
                    retry_s,
                    extra={"worker_id": s.worker_id},
                )
                # Soon, not a whole beat later: during a cluster failover the key's TTL keeps running, and
                # a worker whose entry expires loses its cache in every index until the engine stores again.
                await self._wait_beat(retry_s)
                continue
            await self._wait_beat()

    async def _beat(self, kv: Any) -> None:
        """Put this worker's record only over the revision this ingest last wrote (`put_record`).

        When the key changed since, its last message decides: an age-out marker (the registry was out of
        reach for a TTL, a cluster failover say) is written over with the same incarnation, which wins the
        race against the indexers' claim of the expiry (`kvmesh.runtime.registry.claim_expiry`), so nothing
        is removed and the index keeps the engine's cache (unless the last heartbeat that landed is two TTLs
        old: an indexer's claim may have aged out into the marker); a delete (an indexer claimed the expiry and
        removes the worker) or no message at all starts a new incarnation; a record (an acknowledgement
        lost in a timeout) is taken as the last revision.
        """
        s = self.settings
        ttl = s.worker_ttl_s
        for _ in range(3):
            if self._revision is not None:
                epochs = [r.tracker.epoch for r in self.ranks.values()]
                record = self.record(incarnation=max(epochs, default=0), now=time.time())
                sent_at = time.monotonic()
                try:
                    self._revision = await put_record(kv, record, last=self._revision)
                    self.registered, self._put_at = True, sent_at
                    return
                except Exception as exc:
                    if not wrong_revision(exc):
                        raise
            found = await read_key(kv, registry_key(s.worker_id, self.node))
            away = time.monotonic() - self._put_at
            # A marker two TTLs after the last heartbeat that landed may stand for an indexer's claim that
            # aged out too (a claim comes within a TTL of the first marker, and lives a TTL).
            removed = found.kind in ("deleted", "missing") or (found.kind == "expired" and away >= 2 * ttl)
            if self._rejoined_live:
                self._rejoined_live = False  # the key is deleted because this ingest deleted it: put it again
            elif self.registered and removed:
                log.warning(
                    "worker %s: registry entry %s %.1f s after the last heartbeat that reached it (an indexer "
                    "may have claimed its expiry and removed the worker); rejoining as a new incarnation",
                    s.worker_id,
                    "gone" if found.kind == "missing" else found.kind,
                    away,
                    extra={"worker_id": s.worker_id},
                )
                self.rejoin("rejoin")
            elif self.registered and found.kind == "expired":
                log.warning(
                    "worker %s: registry entry expired (no heartbeat reached the registry for %.1f s); "
                    "registering again with the same incarnation",
                    s.worker_id,
                    away,
                    extra={"worker_id": s.worker_id},
                )
            self._revision = found.revision
        raise RuntimeError("the registry key kept changing during one heartbeat")

    def record(self, *, incarnation: int, now: float) -> WorkerRecord:
        """This ingest's registry record: its worker's (or its node's) ranks, incarnation, stale ranks and
        the engine's block size, context length and KV capacity as configured, and whether it publishes KV
        events (``--no-kv-events``: no)."""
        s = self.settings
        ranks = s.local_ranks()
        return WorkerRecord(
            worker_id=s.worker_id,
            model=s.model,
            dp_ranks=s.data_parallel_size,
            block_size=s.block_size,
            incarnation=incarnation,
            heartbeat_ts=now,
            stale_ranks=self.stale_ranks(),
            dp_rank_start=ranks.start,
            dp_ranks_local=len(ranks) if self.node is not None else None,
            context_length=s.context_length,
            kv_capacity_blocks=s.kv_capacity_blocks,
            kv_events=s.kv_events,
        )

    def on_engine_change(self, _rank: int, change: LivenessChange) -> None:
        """An engine rank changed liveness: heartbeat at once. A worker that had left rejoins right away, as a
        new incarnation, before the batch that brought it back is applied (a later rejoin would clear it)."""
        if change.state == "live" and self._left_for_dead:
            self._left_for_dead = False
            self._rejoined_live = True
            log.warning(
                "worker %s: engine answers again; rejoining as a new incarnation",
                self.settings.worker_id,
                extra={"worker_id": self.settings.worker_id},
            )
            self.rejoin("rejoin")
        self._beat_now.set()

    async def _wait_beat(self, wait_s: float | None = None) -> None:
        """Sleep until the next heartbeat is due (``wait_s``, default TTL/3), or an engine rank changed
        liveness."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self._beat_now.wait(), self.settings.worker_ttl_s / 3 if wait_s is None else wait_s
            )
        self._beat_now.clear()

    def stale_ranks(self) -> dict[int, str]:
        """dp_rank → why its engine is stale, for the registry record (routers skip those ranks)."""
        if self.watch is None:
            return {}
        out = {}
        for r, reason in self.watch.stale_ranks().items():
            rank = self.ranks.get(r)
            out[rank.holder_rank if rank is not None and rank.holder_rank >= 0 else r] = reason
        return out

    async def still_registered(self) -> bool:
        """Whether this worker's registry key exists, asked at start before resuming a recovered cursor.

        An answer that is not definite (timeout, bucket unreadable) counts as "not registered": a new
        incarnation costs a clear and a replay, resuming a removed one loses every later message.
        """
        try:
            self._kv = await self._open()
            self.registered = await key_present(self._kv, self.settings.worker_id, self.node)
            return self.registered
        except Exception as exc:
            self._kv = None
            log.warning(
                "worker %s: cannot read its registry key (%r); starting a new incarnation",
                self.settings.worker_id,
                exc,
                extra={"worker_id": self.settings.worker_id},
            )
            return False

    async def deregister(self) -> None:
        """Delete this worker's registry key (a clean stop: watchers publish its removal at once)."""
        s = self.settings
        try:
            kv = self._kv or await asyncio.wait_for(self._open(), STOP_S)
            await asyncio.wait_for(deregister(kv, s.worker_id, self.node), STOP_S)
            log.info("worker %s: deregistered", s.worker_id, extra={"worker_id": s.worker_id})
        except Exception as exc:
            log.warning(
                "worker %s: could not delete its registry key (%r); it expires after %.1f s",
                s.worker_id,
                exc,
                s.worker_ttl_s,
                extra={"worker_id": s.worker_id},
            )
