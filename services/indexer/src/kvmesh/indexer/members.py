"""The indexer's registry watch: publish `WorkerRemoved` when a worker's key goes, reconcile the members.

Every replica watches the worker registry (`kvmesh.runtime.registry`). When a registered worker's key expires
or is deleted it publishes the worker's removal (`kvmesh.indexer.policy.removal_on_delete`). A worker whose
key any replica saw is recorded durably as a ``member-<worker>`` object in the snapshot bucket; once the
watch has delivered the keys that exist, every member without a key that is still live in the index is
removed, and one that is not is forgotten (`policy.reconcile_member`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any

from kvmesh.core import protocol
from kvmesh.core.errors import ProtocolError
from kvmesh.core.protocol import WorkerRecord
from kvmesh.indexer import policy
from kvmesh.indexer.config import IndexerSettings
from kvmesh.runtime.registry import (
    WATCH_INACTIVE_S,
    NodeDeparture,
    claim_expiry,
    last_node_incarnation,
    node_departure,
    node_records,
    parse_registry_key,
    publish_node_departure,
    publish_removal,
    uncovered_ranks,
    worker_of_key,
    worker_present,
)
from kvmesh.runtime.replica import StreamReplica
from kvmesh.runtime.snapshots import SnapshotStore

log = logging.getLogger("kvmesh.indexer")

RETRY_S = 1.0
"""Pause before a failed registry watch is started again (seconds)."""


class RegistryWatch:
    """One replica's watch of the worker registry.

    Args:
        settings: the replica's settings (stream, events prefix).
        replica: this replica's name (log lines).
        js: a JetStream context (removals are published into the events stream).
        kv: the registry KV bucket.
        store: the snapshot bucket holding the ``member-<worker>`` objects.
        stream: the replica whose index says which workers are live.
        stop: set by the owner; ends `run`.
    """

    def __init__(
        self,
        settings: IndexerSettings,
        replica: str,
        *,
        js: Any,
        kv: Any,
        store: SnapshotStore,
        stream: StreamReplica,
        stop: asyncio.Event,
    ) -> None:
        self.settings = settings
        self.replica = replica
        self.removals_published = 0
        """`WorkerRemoved` messages this replica published."""
        self._js = js
        self._kv = kv
        self._store = store
        self._stream = stream
        self._stop = stop
        self._registry: dict[str, WorkerRecord] = {}
        self._members: dict[str, str] = {}
        """Registry members (worker id → model), mirrored from the snapshot bucket."""
        self._expiring: dict[str, asyncio.Task[None]] = {}
        """Aged-out registry key → the task that claims its expiry once the grace is over."""
        self._expired: dict[str, WorkerRecord] = {}
        """Aged-out registry key → its last record (what its removal names)."""
        self.grace_s = settings.expiry_grace_s
        """The expiry grace in use (`_fit_grace`)."""
        self._claimed: dict[str, int] = {}
        """Registry key → the revision of the expiry this replica claimed (its delete is still to come back)."""

    async def run(self) -> None:
        """Watch until stopped; a failed watch is logged and started again after `RETRY_S`."""
        try:
            await self._watch()
        finally:
            for task in self._expiring.values():
                task.cancel()

    async def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                await self._fit_grace()
                self._members = await self._store.members()
                watcher = await self._kv.watchall(inactive_threshold=WATCH_INACTIVE_S)
                sync = policy.RegistrySync()
                async for entry in watcher:
                    if entry is None:
                        if sync.end_of_initial():  # a worker is registered while any key of it is
                            await self._reconcile({worker_of_key(k) for k in sync.registered})
                        continue
                    sync.seen(entry.key, present=entry.operation is None and bool(entry.value))
                    await self._on_entry(entry, synced=sync.synced)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning(
                    "indexer %s: registry watch failed (%r); restarting",
                    self.replica,
                    exc,
                    extra={"replica": self.replica},
                )
                await asyncio.sleep(RETRY_S)

    async def _fit_grace(self) -> None:
        """Cap the expiry grace at two thirds of the registry's marker lifetime (its TTL): a claim made after
        the marker aged out would find nothing left to race the worker's own put over."""
        status = await self._kv.status()
        lives = status.marker_ttl or status.ttl
        wanted = self.settings.expiry_grace_s
        self.grace_s = min(wanted, lives * 2 / 3) if lives else wanted
        if self.grace_s < wanted:
            log.warning(
                "indexer %s: the registry's markers live %.1f s: expiry grace %.1f s instead of %.1f s",
                self.replica,
                lives,
                self.grace_s,
                wanted,
                extra={"replica": self.replica},
            )

    async def _reconcile(self, registered: set[str]) -> None:
        """Remove every member live in the index that has no key now; forget those that are not live.

        A worker that never heartbeated (a stream fed directly, without a registry) is no member and stays.
        A multi-node worker that still has node keys loses the ranks no node key reads (`_reconcile_nodes`).
        """
        await self._reconcile_nodes()
        claiming = {worker_of_key(k) for k in self._expiring}
        for worker, model in sorted(self._members.items()):
            if worker in claiming:
                continue  # an aged-out key whose claim is pending decides (`_claim_later`)
            action = policy.reconcile_member(worker, model, registered, self._stream.state.live_worker)
            if isinstance(action, policy.Forget):
                await self._store.delete_member(worker)
                self._members.pop(worker, None)
            elif action is not None:
                # The watch's end of initial values can come before a key it should have listed (a clustered
                # bucket's consumer not yet caught up): read the key itself before removing a live worker.
                # Without a definite "gone" the worker stays: routes take candidates from the registry anyway,
                # and a wrong removal would drop a live worker's whole cache from the index.
                try:
                    present = await worker_present(self._kv, worker)
                except Exception as exc:
                    log.warning(
                        "indexer %s: worker %s: cannot read its registry key (%r): not removed now",
                        self.replica,
                        worker,
                        exc,
                        extra={"replica": self.replica, "worker_id": worker},
                    )
                    continue
                if present:
                    log.info(
                        "indexer %s: worker %s's key is present though the registry watch did not list it: kept",
                        self.replica,
                        worker,
                        extra={"replica": self.replica, "worker_id": worker},
                    )
                    continue
                seq = await self._publish(action)
                log.warning(
                    "indexer %s: worker %s (a registry member) has no registry key: published its removal "
                    "(incarnation %d) at seq %d",
                    self.replica,
                    worker,
                    action.incarnation,
                    seq,
                    extra={
                        "replica": self.replica,
                        "worker_id": worker,
                        "epoch": action.incarnation,
                        "stream_seq": seq,
                    },
                )

    async def _reconcile_nodes(self) -> None:
        """Take out the index's ranks of each multi-node worker that none of its node keys reads now (a node
        whose key aged out while no replica watched), read from the keys themselves before anything goes."""
        nodes = {worker_of_key(k) for k, rec in self._registry.items() if rec.dp_ranks_local is not None}
        for worker in sorted(nodes - {worker_of_key(k) for k in self._expiring}):
            info = self._stream.state.workers().get(worker)
            if info is None or info["removed"]:
                continue
            epochs: dict[int, int] = info["epochs"]  # type: ignore[assignment]
            try:
                records = await node_records(self._kv, worker)
            except Exception as exc:
                log.warning(
                    "indexer %s: worker %s: cannot read its node keys (%r): no node ranks removed now",
                    self.replica,
                    worker,
                    exc,
                    extra={"replica": self.replica, "worker_id": worker},
                )
                continue
            gone = uncovered_ranks(epochs, records.values())
            if not records or not gone:
                continue  # no node key at all: the member reconcile removes the worker
            departure = NodeDeparture(worker, gone, next(iter(records.values())).model)
            await self._clear_ranks(departure, info, "have no registry node")

    async def _clear_ranks(self, departure: NodeDeparture, info: dict[str, object], why: str) -> None:
        """Publish the Cleared of each rank of a departed node (at the rank's epoch) and log it."""
        epochs: dict[int, int] = info["epochs"]  # type: ignore[assignment]
        seqs = await publish_node_departure(
            self._js,
            stream=self.settings.stream,
            events_prefix=self.settings.events_prefix,
            departure=departure,
            model=departure.model or str(info["model"]),
            epochs=epochs,
        )
        log.warning(
            "indexer %s: worker %s: ranks %s %s: cleared at seqs %s",
            self.replica,
            departure.worker_id,
            list(departure.ranks),
            why,
            seqs,
            extra={"replica": self.replica, "worker_id": departure.worker_id},
        )

    async def _on_entry(self, entry: Any, *, synced: bool = True) -> None:
        worker = worker_of_key(entry.key)
        if entry.operation is None:
            self._claimed.pop(entry.key, None)
            self._expired.pop(entry.key, None)
            pending = self._expiring.pop(entry.key, None)
            if pending is not None:  # registered again before its expiry was claimed: nothing is removed
                pending.cancel()
                log.warning(
                    "indexer %s: worker %s registered again after its registry key aged out: kept",
                    self.replica,
                    entry.key,
                    extra={"replica": self.replica, "worker_id": worker},
                )
            with contextlib.suppress(ProtocolError):  # not a record this build reads: ignored
                put = protocol.decode(entry.value or b"", WorkerRecord)
                self._registry[entry.key] = put
                if worker not in self._members:
                    await self._store.put_member(worker, put.model)
                    self._members[worker] = put.model
            return
        if entry.operation != "PURGE":
            if self._claimed.pop(entry.key, None) is not None:
                return  # the delete of an expiry claim this replica saw through: its removal is published
            pending = self._expiring.pop(entry.key, None)
            if pending is not None:  # another replica claimed the expiry (or the worker stopped): removed now
                pending.cancel()
                await self._departed(entry.key, self._expired.pop(entry.key, None), "PURGE")
                return
        elif entry.key in self._expiring:
            return  # the same expiry again (a restarted watch): its claim is pending
        record = self._registry.pop(entry.key, None)
        if entry.operation == "PURGE":
            # Aged out: the registry may have been out of reach (a failover) while the worker lives. It has
            # `expiry_grace_s` to register again before this replica claims the expiry; nothing is removed
            # for an expiry without a claim (the worker would keep its incarnation over an unclaimed marker).
            if record is None and (synced or self._stream.state.live_worker(worker) is None):
                return  # a delete's own age-out (its departure was handled), or a worker no longer indexed
            if record is not None:
                self._expired[entry.key] = record
            self._expiring[entry.key] = asyncio.create_task(self._claim_later(entry.key, int(entry.revision)))
            return
        if not synced and parse_registry_key(entry.key)[1] is not None:
            # A node's delete among the initial values: its worker's other keys may come after it. The
            # reconcile at the end of the initial values decides (`_reconcile_nodes`, then the members').
            return
        await self._departed(entry.key, record, entry.operation)

    async def _claim_later(self, key: str, revision: int) -> None:
        """After the grace, claim ``key``'s expiry (`claim_expiry`) and remove its worker unless it came back.

        No definite answer (registry out of reach) is tried again every `RETRY_S`: the worker stays meanwhile.
        """
        me = asyncio.current_task()
        await asyncio.sleep(self.grace_s)
        while True:
            try:
                found = await claim_expiry(self._kv, key, revision)
                break
            except Exception as exc:
                log.warning(
                    "indexer %s: cannot claim the expiry of registry key %s (%r); trying again",
                    self.replica,
                    key,
                    exc,
                    extra={"replica": self.replica, "worker_id": worker_of_key(key)},
                )
                await asyncio.sleep(RETRY_S)
        if self._expiring.get(key) is not me:
            return  # the watch saw the worker come back, or the delete, during the claim: it decided
        del self._expiring[key]
        record = self._expired.pop(key, None)
        if found.kind == "record":
            return  # registered again: its put reaches the watch and keeps the record
        if found.kind == "expired":
            return  # expired again at a later revision: that marker's own watch event decides
        if found.kind == "deleted":
            self._claimed[key] = revision  # the claim's delete comes back through the watch: handled here
        try:
            await self._departed(key, record, "PURGE")
        except Exception as exc:  # the reconcile of the next watch removes a member without a key
            log.error(
                "indexer %s: could not publish the removal for registry key %s (%r)",
                self.replica,
                key,
                exc,
                extra={"replica": self.replica, "worker_id": worker_of_key(key)},
            )

    async def _departed(self, key: str, record: WorkerRecord | None, operation: str) -> None:
        """Publish what the departure of registry ``key`` takes out of the index (a node's ranks, or the
        worker), with its last record seen here (None: the index's model and epoch)."""
        worker = worker_of_key(key)
        # A key whose expiry claim is pending still counts: its node may register again within the grace and
        # keep its incarnation, which a removal of the whole worker would make stale.
        pending = {k: self._expired.get(k) for k in self._expiring if k != key}
        departure = node_departure(key, record, [*self._registry, *pending])
        if departure is not None:  # one node of a multi-node worker left; the others stay
            info = self._stream.state.workers().get(worker)
            if info is None or info["removed"]:
                return
            # A rank another node key still reads (node ranges that overlap) is that node's: it stays.
            keys = [*self._registry.items(), *((k, rec) for k, rec in pending.items() if rec is not None)]
            others = [rec for k, rec in keys if worker_of_key(k) == worker]
            gone = uncovered_ranks(departure.ranks, others)
            if len(gone) != len(departure.ranks):
                log.warning(
                    "indexer %s: worker %s: node %s left, but ranks %s of it are still read by another node "
                    "(overlapping node ranks): kept",
                    self.replica,
                    worker,
                    key,
                    sorted(set(departure.ranks) - set(gone)),
                    extra={"replica": self.replica, "worker_id": worker},
                )
                if not gone:
                    return
                departure = dataclasses.replace(departure, ranks=gone)
            await self._clear_ranks(departure, info, "left the registry with their node")
            return
        removal = policy.removal_on_delete(worker, operation, record, self._stream.state.live_worker)
        if removal is None:
            return
        if parse_registry_key(key)[1] is not None:  # the last node of a multi-node worker
            held = self._stream.state.workers().get(worker) or {}
            rank_epochs: dict[int, int] = held.get("epochs") or {}  # type: ignore[assignment]
            removal = dataclasses.replace(
                removal, incarnation=last_node_incarnation(rank_epochs, removal.incarnation)
            )
        seq = await self._publish(removal)
        log.warning(
            "indexer %s: worker %s %s from the registry: published its removal (incarnation %d) at seq %d",
            self.replica,
            worker,
            removal.reason,
            removal.incarnation,
            seq,
            extra={
                "replica": self.replica,
                "worker_id": worker,
                "epoch": removal.incarnation,
                "stream_seq": seq,
                "reason": removal.reason,
            },
        )

    async def _publish(self, removal: policy.Removal) -> int:
        seq = await publish_removal(
            self._js,
            stream=self.settings.stream,
            events_prefix=self.settings.events_prefix,
            worker_id=removal.worker_id,
            model=removal.model,
            incarnation=removal.incarnation,
            reason=removal.reason,
        )
        self.removals_published += 1
        return seq
