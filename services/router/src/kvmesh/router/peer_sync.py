"""The router's start-up sync, its I/O: a starting replica asks its peers on ``<requests_prefix>.sync`` and
every replica answers (`kvmesh.router.notes.LifecycleNotes` calls these; what an answer holds and how one is
picked is `kvmesh.router.sync`, pure).

The asker subscribes to the notes before it asks, so nothing falls between the snapshot and the live notes.
The answer is a `LedgerSnapshot` (msgpack), then, to an asker that sends ``Kvmesh-Sync-Parts: 1``, as many
`PredictedSnapshot` parts as the predicted caches need, each within the server's ``max_payload``, a holder's
newest entries first (the first message's ``Kvmesh-Sync-Parts`` header gives the count; every part's
``Kvmesh-Sync-From`` names the peer, so the asker keeps one peer's answer when several reply). An asker
without the header (a router before multi-part sync) gets the `LedgerSnapshot` alone. The `LedgerSnapshot`
is cut to the server's ``max_payload`` (least recently seen sessions out first); predicted entries are never
cut, only split over parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvmesh.core.errors import ProtocolError
from kvmesh.core.index import Holder
from kvmesh.core.protocol import (
    SYNC_FROM_HEADER,
    SYNC_PARTS_HEADER,
    LedgerSnapshot,
    PredictedCache,
    PredictedSnapshot,
    SessionEntry,
    decode,
    encode,
)
from kvmesh.router.predictions import TTL
from kvmesh.router.sync import SyncCollector, fitted_ledger, note_problem, plan_parts, slice_cache

if TYPE_CHECKING:
    from kvmesh.router.notes import LifecycleNotes

__all__ = ["answer_sync", "sync_from_peers"]

log = logging.getLogger("kvmesh.router")

_FLUSH_EVERY_BYTES = 4 << 20


async def sync_from_peers(notes: LifecycleNotes, nc: Client) -> None:
    """Ask the peer replicas for their in-flight requests, sessions and predicted entries, and take one
    peer's answer (none answering is fine: the first replica).

    The answer may come in several messages (`_collect_sync`): the ledger and sessions first, then the
    predicted parts, newest entries first. A part that does not decode is skipped alone; parts missing
    after the sync timeout are logged and what arrived is kept.
    """
    s = notes.settings
    if s.sync_timeout_s <= 0:
        return
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(notes.subject("sync"), b"", reply=inbox, headers={SYNC_PARTS_HEADER: "1"})
        answer = await _collect_sync(sub, s.sync_timeout_s)
    except nats.errors.Error as exc:
        log.warning("router: accounting sync failed: %s", exc, extra={"kind": "sync"})
        return
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
    if answer is None:
        return
    snap, parts = answer
    now = notes.clock()
    notes.synced_requests = notes.ledger.restore(snap, now)
    notes.synced_sessions = notes.sessions.restore(
        (
            (e.session_id, Holder(e.worker_id, e.dp_rank), e.idle_s)
            for e in snap.sessions
            if note_problem(e.dp_rank, e.session_id, None) is None
        ),
        now,
    )
    undecodable = refused = 0
    for data in parts:
        try:
            part = decode(data, PredictedSnapshot, format="msgpack")
        except ProtocolError as exc:
            if not undecodable:
                log.warning(
                    "router: undecodable predicted part from a peer, skipped: %s",
                    exc,
                    extra={"kind": "sync"},
                )
            undecodable += 1
            continue
        restored, bad = notes.predictions.restore(part.caches, notes.clock())
        notes.synced_predicted += restored
        refused += bad
        await asyncio.sleep(0)  # let the notes that arrive meanwhile in
    if undecodable or refused:
        log.warning(
            "router: from a peer's sync answer, %d undecodable predicted parts and %d malformed predicted "
            "caches were skipped; the rest was kept",
            undecodable, refused, extra={"kind": "sync"},
        )  # fmt: skip


async def _collect_sync(sub: Subscription, timeout_s: float) -> tuple[LedgerSnapshot, list[bytes]] | None:
    """One peer's sync answer (`kvmesh.router.sync.SyncCollector`): its decoded `LedgerSnapshot` and the
    bodies of its predicted parts, in order; None when no peer answered."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    got = SyncCollector()
    while (left := deadline - loop.time()) > 0:
        try:
            msg = await sub.next_msg(timeout=left)
        except nats.errors.TimeoutError:
            break
        headers = msg.headers or {}
        if got.no_responders(headers):
            return None  # the first replica
        n = len(got.undecodable)
        done = got.feed(headers, msg.data)
        if len(got.undecodable) > n:
            log.warning(
                "router: undecodable accounting snapshot from a peer, waiting for another: %s",
                got.undecodable[-1], extra={"kind": "sync"},
            )  # fmt: skip
        if done is not None:
            return done
    partial = got.most_complete()
    if partial is None:
        log.warning(
            "router: %s within %.1f s; starting without a peer's ledger (raise --sync-timeout-s if peers "
            "are slow to answer)",
            "no peer's accounting snapshot decoded" if got.heard else "the sync subject has subscribers "
            "but none answered", timeout_s, extra={"kind": "sync"},
        )  # fmt: skip
        return None
    snap, parts, expected = partial
    log.warning(
        "router: accounting sync got %d of %d parts from a peer within %.1f s; kept what arrived",
        1 + len(parts), expected, timeout_s, extra={"kind": "sync"},
    )  # fmt: skip
    return snap, parts


async def answer_sync(notes: LifecycleNotes, msg: Msg) -> None:
    """Answer one sync request with ``notes``' ledger, sessions and (to an asker that takes parts) predicted
    entries: the ledger first and flushed, then the parts, yielding to the event loop between them."""
    if not msg.reply:
        return
    now = notes.clock()
    notes.ledger.expire(now)
    with contextlib.suppress(nats.errors.Error):
        notes.sessions.expire(now)
        snap = notes.ledger.snapshot(now)
        sessions = [
            SessionEntry(session_id=sid, worker_id=h.worker_id, dp_rank=h.dp_rank, idle_s=idle)
            for sid, h, idle in notes.sessions.entries(now)
        ]
        nc = notes.nc
        max_payload = nc.max_payload if nc is not None else 1 << 20
        limit = max(max_payload - 1024, max_payload // 2)
        first, kept = fitted_ledger(snap.entries, sessions, limit)
        if kept is not None:
            log.warning(
                "router: accounting snapshot cut to %d of %d requests and %d of %d sessions to fit %d bytes",
                kept[0], len(snap.entries), kept[1], len(sessions), limit, extra={"kind": "sync"},
            )  # fmt: skip
        if nc is None or (msg.headers or {}).get(SYNC_PARTS_HEADER) != "1":
            await msg.respond(first)  # an asker that takes one message
            return
        sizes = notes.predictions.sizes(now)
        plan = plan_parts([(h.worker_id, n, kind == TTL) for kind, h, n in sizes], limit)
        headers = {SYNC_FROM_HEADER: notes.replica_id}
        # the ledger first and at once: the asker's timeout is short, and its in-flight requests matter most
        await nc.publish(msg.reply, first, headers={**headers, SYNC_PARTS_HEADER: str(1 + len(plan))})
        await nc.flush()
        exported: dict[int, PredictedCache] = {}
        sent = 0
        for slices in plan:
            part = []
            for i, start, end in slices:
                kind, h, n = sizes[i]
                c = exported.get(i)
                if c is None:  # exported at its first slice: notes may have changed it since the plan
                    c = exported[i] = notes.predictions.cache(kind, h, now)
                shift = len(c.keys) - n  # slices count from the newest end
                part.append(slice_cache(c, shift + start, shift + end))
            data = encode(PredictedSnapshot(caches=part), format="msgpack")
            await nc.publish(msg.reply, data, headers=headers)
            sent += len(data)
            if sent >= _FLUSH_EVERY_BYTES:  # stay within the client's outgoing buffer
                await nc.flush()
                sent = 0
            await asyncio.sleep(0)  # a large answer does not hold up this replica's routes
