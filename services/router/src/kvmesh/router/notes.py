"""The router's shared accounting: request lifecycle notes, engine load reports and the start-up sync.

Plain subscriptions (no queue group), so every replica sees every note:

* ``<requests_prefix>.routed`` — `Routed`, published by the replica that routed a request with a
  ``request_id`` (after recording it itself, before it replies: `LifecycleNotes.routed`);
* ``<requests_prefix>.prefill_done`` / ``.finished`` — `RequestRef`, published by clients; a ``finished``
  note's ``cached_tokens`` (the engine's count) is counted as delivered by the replica that answered the
  request only (`kvmesh.core.load.LoadLedger.finished`), so a request is delivered once across replicas;
* ``<requests_prefix>.noted`` — `RouteNote`, published by the replica that routed a request without a
  ``request_id`` that the others must know about (one with a ``request_id`` says the same in its ``routed``
  note): where its ``session_id`` went (`kvmesh.core.sessions.SessionTable`) and its blocks for predicted
  entries (`kvmesh.router.predictions`);
* ``<requests_prefix>.sync`` — a starting replica asks its peers for their ledger, sessions and predicted
  entries; it subscribes to the notes first, so nothing falls between the snapshot and the live notes. The
  answer is a `LedgerSnapshot` (msgpack), then, to an asker that sends ``Kvmesh-Sync-Parts: 1``, as many
  `PredictedSnapshot` parts as the predicted caches need, each within the server's ``max_payload`` (the
  first message's ``Kvmesh-Sync-Parts`` header gives the count; every part's ``Kvmesh-Sync-From`` names the
  peer, so the asker keeps one peer's answer when several reply). An asker without the header (a router
  before multi-part sync) gets the `LedgerSnapshot` alone;
* ``<load_prefix>.<worker>`` — engine load reports (`WorkerLoad`, JSON).

An undecodable note is logged (a load report at debug level) and dropped; nothing else is lost. Undecodable
lifecycle notes are counted (`LifecycleNotes.undecodable`), and so are ``routed`` / ``noted`` notes that no
router sends (a negative rank, a session id outside 1 – 256 characters, a key outside [0, 2⁶⁴)), dropped
whole. A sync answer's `LedgerSnapshot` is cut to the server's ``max_payload`` (least recently seen sessions
out first); predicted entries are never cut, only split over parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvmesh.core.errors import ProtocolError
from kvmesh.core.index import Holder
from kvmesh.core.load import EngineLoads, LoadLedger
from kvmesh.core.protocol import (
    SYNC_FROM_HEADER,
    SYNC_PARTS_HEADER,
    LedgerEntry,
    LedgerSnapshot,
    PredictedCache,
    PredictedSnapshot,
    RequestRef,
    Routed,
    RouteNote,
    RouteReply,
    SessionEntry,
    WorkerLoad,
    decode,
    encode,
)
from kvmesh.core.sessions import MAX_SESSION_ID_CHARS, SessionTable
from kvmesh.router.config import RouterSettings
from kvmesh.router.predictions import Predictions
from kvmesh.runtime import subjects

log = logging.getLogger("kvmesh.router")
_N = TypeVar("_N", Routed, RouteNote)

_KEY_LIMIT = 1 << 64
_FLUSH_EVERY_BYTES = 4 << 20
_KEY_BYTES = 18
"""Most msgpack bytes a predicted entry takes: its key (uint64, 9) and its remaining time (float64, 9)."""
_CACHE_BYTES = 64
"""Most msgpack bytes of a `PredictedCache` beside its keys, times and worker id."""


def _problem(dp_rank: int, session_id: str | None, block_keys: list[int] | None) -> str | None:
    """What makes a `Routed` / `RouteNote` one no router sends (None: nothing): a negative rank, a session id
    outside 1 – 256 characters, a key outside [0, 2⁶⁴)."""
    if dp_rank < 0:
        return f"dp_rank {dp_rank} < 0"
    if session_id is not None and not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        return f"session_id of {len(session_id)} characters (1 to {MAX_SESSION_ID_CHARS})"
    if block_keys and not (min(block_keys) >= 0 and max(block_keys) < _KEY_LIMIT):
        return "block_keys outside [0, 2**64)"
    return None


def _fitted(entries: list[LedgerEntry], sessions: list[SessionEntry], limit: int) -> bytes:
    """The snapshot of ``entries`` and ``sessions`` (least recently seen first) as msgpack, within ``limit``
    bytes (the server's ``max_payload``): past it, the least recently seen sessions are left out, then the
    oldest requests (a snapshot that does not fit would reach no one)."""
    data = encode(LedgerSnapshot(entries=entries, sessions=sessions), format="msgpack")
    total = (len(entries), len(sessions))
    while len(data) > limit and (entries or sessions):
        keep = max(int(len(sessions if sessions else entries) * limit / len(data) * 0.95) - 1, 0)
        if sessions:
            sessions = sessions[len(sessions) - keep :]
        else:
            entries = entries[len(entries) - keep :]
        data = encode(LedgerSnapshot(entries=entries, sessions=sessions), format="msgpack")
    if (len(entries), len(sessions)) != total:
        log.warning(
            "router: accounting snapshot cut to %d of %d requests and %d of %d sessions to fit %d bytes",
            len(entries), total[0], len(sessions), total[1], limit, extra={"kind": "sync"},
        )  # fmt: skip
    return data


def _sync_parts(caches: list[PredictedCache], limit: int) -> list[bytes]:
    """``caches`` as `PredictedSnapshot` parts (msgpack) of at most ``limit`` bytes each (the server's
    ``max_payload``), a holder's keys cut into consecutive slices where they do not fit one part."""
    room = limit - 64
    parts: list[bytes] = []
    batch: list[PredictedCache] = []
    used = 0
    for c in caches:
        start = 0
        while start < len(c.keys):
            fixed = _CACHE_BYTES + len(c.worker_id.encode())
            if used + fixed + _KEY_BYTES > room:
                parts.append(encode(PredictedSnapshot(caches=batch), format="msgpack"))
                batch, used = [], 0
            take = max(min(len(c.keys) - start, (room - used - fixed) // _KEY_BYTES), 1)
            end = start + take
            batch.append(
                c
                if (start, end) == (0, len(c.keys))
                else msgspec.structs.replace(
                    c,
                    keys=c.keys[start:end],
                    remaining_s=None if c.remaining_s is None else c.remaining_s[start:end],
                )
            )
            used += fixed + take * _KEY_BYTES
            start = end
    if batch:
        parts.append(encode(PredictedSnapshot(caches=batch), format="msgpack"))
    return parts


class LifecycleNotes:
    """Keeps a replica's ledger and engine loads in step with every other replica's.

    Args:
        settings: the router's settings (subject prefixes, sync timeout, session bounds).
        ledger: the replica's ledger of routed requests.
        engine_loads: the engines' load reports.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        settings: RouterSettings,
        ledger: LoadLedger,
        engine_loads: EngineLoads,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.engine_loads = engine_loads
        self._clock = clock
        self.sessions = SessionTable(ttl_s=settings.session_ttl_s, max_sessions=settings.max_sessions)
        """Where each session's last request went (this replica's answers and every peer's notes)."""
        self.predictions = Predictions(settings.predicted_ttl_s, lambda: None)
        """Predicted entries and the predicted caches of workers without KV events (its ``records`` is set to
        the registry's by the service)."""
        self._nc: Client | None = None
        self.synced_sessions = 0
        """Sessions restored from a peer at start-up."""
        self.synced_requests = 0
        """In-flight requests restored from a peer's ledger at start-up."""
        self.synced_predicted = 0
        """Predicted entries restored from a peer at start-up."""
        self._id = uuid.uuid4().hex
        """This replica's id in the headers of its sync answers."""
        self.undecodable = 0
        """Lifecycle notes (routed, prefill_done, finished) dropped because they did not decode."""
        self._warned: set[str] = set()
        """Kinds of note already warned about as undecodable (later ones of a kind log at DEBUG)."""

    def _subject(self, event: str) -> str:
        return subjects.requests_subject(self.settings.requests_prefix, event)

    async def subscribe(self, nc: Client) -> list[Subscription]:
        """Subscribe to the lifecycle notes and the load reports; return the subscriptions."""
        self._nc = nc
        return [
            await nc.subscribe(self._subject("routed"), cb=self._on_routed),
            await nc.subscribe(self._subject("prefill_done"), cb=self._on_prefill_done),
            await nc.subscribe(self._subject("finished"), cb=self._on_finished),
            await nc.subscribe(self._subject("noted"), cb=self._on_noted),
            await nc.subscribe(f"{self.settings.load_prefix}.>", cb=self._on_load),
        ]

    async def sync_from_peers(self, nc: Client) -> None:
        """Ask the peer replicas for their in-flight requests, sessions and predicted entries; take the first
        peer's answer (none answering is fine: the first replica).

        The answer may come in several messages (`_sync_parts`); parts missing after the sync timeout are
        logged and what arrived is kept.
        """
        s = self.settings
        if s.sync_timeout_s <= 0:
            return
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            await nc.publish(self._subject("sync"), b"", reply=inbox, headers={SYNC_PARTS_HEADER: "1"})
            parts = await self._collect_sync(sub, s.sync_timeout_s)
        except nats.errors.Error as exc:
            log.warning("router: accounting sync failed: %s", exc, extra={"kind": "sync"})
            return
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        if not parts:
            return
        try:
            snap = decode(parts[0], LedgerSnapshot, format="msgpack")
            later = [decode(p, PredictedSnapshot, format="msgpack") for p in parts[1:]]
        except ProtocolError as exc:
            log.warning(
                "router: undecodable accounting snapshot from a peer: %s", exc, extra={"kind": "sync"}
            )
            return
        now = self._clock()
        self.synced_requests = self.ledger.restore(snap, now)
        self.synced_sessions = self.sessions.restore(
            (
                (e.session_id, Holder(e.worker_id, e.dp_rank), e.idle_s)
                for e in snap.sessions
                if _problem(e.dp_rank, e.session_id, None) is None
            ),
            now,
        )
        restored, refused = self.predictions.restore((c for part in later for c in part.caches), now)
        self.synced_predicted = restored
        if refused:
            log.warning(
                "router: %d predicted caches from a peer refused (malformed)", refused, extra={"kind": "sync"}
            )

    async def _collect_sync(self, sub: Subscription, timeout_s: float) -> list[bytes]:
        """The bodies of one peer's sync answer, in order (empty: no peer answered within ``timeout_s``).

        A peer that sends one message (a router before multi-part sync) gives a one-part answer; parts of a
        second peer are ignored.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        parts: list[bytes] = []
        sender: str | None = None
        expected = 1
        while len(parts) < expected:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            headers = msg.headers or {}
            if headers.get("Status") == "503":
                return []  # no responders: the first replica
            if not parts:
                sender = headers.get(SYNC_FROM_HEADER)
                try:
                    expected = max(int(headers.get(SYNC_PARTS_HEADER, "1")), 1)
                except ValueError:
                    expected = 1
            elif headers.get(SYNC_FROM_HEADER) != sender:
                continue  # another peer answered too
            parts.append(msg.data)
        if parts and len(parts) < expected:
            log.warning(
                "router: accounting sync got %d of %d parts from a peer within %.1f s; kept what arrived",
                len(parts), expected, timeout_s, extra={"kind": "sync"},
            )  # fmt: skip
        return parts

    async def serve_sync(self, nc: Client) -> Subscription:
        """Answer later replicas' sync requests with this replica's ledger; return the subscription."""
        return await nc.subscribe(self._subject("sync"), cb=self._on_sync)

    async def routed(self, event: Routed, *, captured_tokens: int) -> None:
        """Record a request this replica routed and tell every replica (before the client hears back).

        ``captured_tokens`` (the reply's ``cached_tokens``) makes the request's receipt this replica's: its
        ``finished`` note's delivered count is compared with it here.
        """
        now = self._clock()
        self.ledger.routed(event, now, captured_tokens=captured_tokens)
        self._note(Holder(event.worker_id, event.dp_rank), event.session_id, event.block_keys, now)
        if self._nc is None:
            return
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(self._subject("routed"), encode(event))

    async def record(
        self, routed: Routed | None, reply: RouteReply, session_id: str | None, block_keys: list[int] | None
    ) -> None:
        """Record a route this replica answered and tell every replica: its `Routed` note (a request with a
        ``request_id``), else a `RouteNote` when it has a session or predicted blocks. The prompt's keys go
        along only when the replicas keep predicted entries for the chosen worker."""
        holder = Holder(reply.worker_id, reply.dp_rank)
        keys = block_keys if block_keys and self.predictions.keeps(holder) else None
        if routed is not None:
            event = routed if keys is None else msgspec.structs.replace(routed, block_keys=keys)
            await self.routed(event, captured_tokens=reply.cached_tokens)
        else:
            await self.noted(holder, session_id, keys)

    async def noted(self, holder: Holder, session_id: str | None, block_keys: list[int] | None) -> None:
        """Note where a request without a ``request_id`` went (its session, its predicted blocks) and tell
        every replica; nothing when there is neither."""
        if session_id is None and block_keys is None:
            return
        self._note(holder, session_id, block_keys, self._clock())
        if self._nc is None:
            return
        note = RouteNote(
            worker_id=holder.worker_id, dp_rank=holder.dp_rank, session_id=session_id, block_keys=block_keys
        )
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(self._subject("noted"), encode(note))

    def _note(self, holder: Holder, session_id: str | None, block_keys: list[int] | None, now: float) -> None:
        if session_id is not None:
            self.sessions.note(session_id, holder, now)
        if block_keys:
            self.predictions.add(holder, block_keys, now)

    async def withdraw(self, request_id: str) -> None:
        """Take back a request this replica recorded but could not answer (its reply would not fit): it is
        finished here and a ``finished`` note tells every other replica."""
        self.ledger.finished(request_id, self._clock())
        if self._nc is None:
            return
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(self._subject("finished"), encode(RequestRef(request_id=request_id)))

    async def _on_sync(self, msg: Msg) -> None:
        if not msg.reply:
            return
        now = self._clock()
        self.ledger.expire(now)
        with contextlib.suppress(nats.errors.Error):
            self.sessions.expire(now)
            snap = self.ledger.snapshot(now)
            sessions = [
                SessionEntry(session_id=sid, worker_id=h.worker_id, dp_rank=h.dp_rank, idle_s=idle)
                for sid, h, idle in self.sessions.entries(now)
            ]
            nc = self._nc
            limit = (nc.max_payload if nc is not None else 1 << 20) - 1024
            first = _fitted(snap.entries, sessions, limit)
            if nc is None or (msg.headers or {}).get(SYNC_PARTS_HEADER) != "1":
                await msg.respond(first)  # an asker that takes one message
                return
            parts = _sync_parts(self.predictions.caches(now), limit)
            headers = {SYNC_FROM_HEADER: self._id}
            await nc.publish(msg.reply, first, headers={**headers, SYNC_PARTS_HEADER: str(1 + len(parts))})
            sent = len(first)
            for part in parts:
                await nc.publish(msg.reply, part, headers=headers)
                sent += len(part)
                if sent >= _FLUSH_EVERY_BYTES:  # stay within the client's outgoing buffer
                    await nc.flush()
                    sent = 0

    async def _on_routed(self, msg: Msg) -> None:
        event = self._checked(msg, Routed, "routed")
        if event is not None:
            now = self._clock()
            self.ledger.routed(event, now)
            self._note(Holder(event.worker_id, event.dp_rank), event.session_id, event.block_keys, now)

    async def _on_noted(self, msg: Msg) -> None:
        note = self._checked(msg, RouteNote, "noted")
        if note is not None:
            self._note(Holder(note.worker_id, note.dp_rank), note.session_id, note.block_keys, self._clock())

    def _checked(self, msg: Msg, kind: type[_N], name: str) -> _N | None:
        """The note, or None (logged, counted in `undecodable`) when it does not decode or says what no router
        sends (`_problem`)."""
        try:
            note = decode(msg.data, kind)
        except ProtocolError:
            self.undecodable += 1
            self._undecodable(name, f"router: undecodable {name} note on %s", msg.subject)
            return None
        problem = _problem(note.dp_rank, note.session_id, note.block_keys)
        if problem is not None:
            self.undecodable += 1
            self._undecodable(name, f"router: {name} note dropped (%s) on %s", problem, msg.subject)
            return None
        return note

    async def _on_prefill_done(self, msg: Msg) -> None:
        ref = self._ref(msg, "prefill_done")
        if ref is not None:
            self.ledger.prefill_done(ref.request_id, self._clock())

    async def _on_finished(self, msg: Msg) -> None:
        ref = self._ref(msg, "finished")
        if ref is not None:
            self.ledger.finished(ref.request_id, self._clock(), cached_tokens=ref.cached_tokens)

    def _ref(self, msg: Msg, event: str) -> RequestRef | None:
        """The note's `RequestRef`, or None (logged, counted in `undecodable`) when it does not decode."""
        try:
            return decode(msg.data, RequestRef)
        except ProtocolError:
            self.undecodable += 1
            self._undecodable(event, "router: undecodable %s note on %s", event, msg.subject)
            return None

    async def _on_load(self, msg: Msg) -> None:
        try:
            report = decode(msg.data, WorkerLoad)
        except ProtocolError:
            self._undecodable("load", "router: undecodable load report on %s", msg.subject)
            return
        self.engine_loads.update(report, self._clock())

    def _undecodable(self, kind: str, msg: str, *args: object) -> None:
        """Log a note that did not decode: the first of its kind as a WARNING, later ones at DEBUG (a peer
        of another version would otherwise log one line per message)."""
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        log.log(level, msg, *args, extra={"kind": kind, "subject": args[-1]})
