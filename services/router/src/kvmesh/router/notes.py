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
from kvmesh.router.predictions import TTL, Predictions
from kvmesh.runtime import subjects

log = logging.getLogger("kvmesh.router")
_N = TypeVar("_N", Routed, RouteNote)

_KEY_LIMIT = 1 << 64
_FLUSH_EVERY_BYTES = 4 << 20
_MAX_SYNC_PARTS = 1 << 20
"""The most parts an asker waits for (a larger ``Kvmesh-Sync-Parts`` is read as this)."""
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


def _plan_parts(sizes: list[tuple[str, int, bool]], limit: int) -> list[list[tuple[int, int, int]]]:
    """How predicted caches go into `PredictedSnapshot` parts of at most ``limit`` bytes each (the server's
    ``max_payload``), from each cache's ``(worker id, entries, with remaining times)``: per part,
    ``(cache index, start, end)`` slices of its keys. A cache too large for one part is cut into consecutive
    slices, its newest keys (the end of its list) in the first part, so an answer cut short keeps what is
    most likely still cached. Sizes come from the counts alone (at most 9 msgpack bytes a key and 9 a
    remaining time), so the plan is known before any entry is exported."""
    room = max(limit - 64, 1)
    plan: list[list[tuple[int, int, int]]] = []
    batch: list[tuple[int, int, int]] = []
    used = 0
    for i, (worker_id, count, timed) in enumerate(sizes):
        per_key = 18 if timed else 9
        fixed = _CACHE_BYTES + len(worker_id.encode())
        end = count
        while end > 0:
            if batch and used + fixed + per_key > room:
                plan.append(batch)
                batch, used = [], 0
            take = max(min(end, (room - used - fixed) // per_key), 1)
            batch.append((i, end - take, end))
            used += fixed + take * per_key
            end -= take
    if batch:
        plan.append(batch)
    return plan


def _slice(c: PredictedCache, start: int, end: int) -> PredictedCache:
    """``c`` with its keys (and remaining times) ``[start:end]``, bounds clamped to the keys it has."""
    start, end = max(start, 0), max(end, 0)
    if (start, end) == (0, len(c.keys)):
        return c
    return msgspec.structs.replace(
        c, keys=c.keys[start:end], remaining_s=None if c.remaining_s is None else c.remaining_s[start:end]
    )


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
        """Ask the peer replicas for their in-flight requests, sessions and predicted entries, and take one
        peer's answer (none answering is fine: the first replica).

        The answer may come in several messages (`_collect_sync`): the ledger and sessions first, then the
        predicted parts, newest entries first. A part that does not decode is skipped alone; parts missing
        after the sync timeout are logged and what arrived is kept.
        """
        s = self.settings
        if s.sync_timeout_s <= 0:
            return
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            await nc.publish(self._subject("sync"), b"", reply=inbox, headers={SYNC_PARTS_HEADER: "1"})
            answer = await self._collect_sync(sub, s.sync_timeout_s)
        except nats.errors.Error as exc:
            log.warning("router: accounting sync failed: %s", exc, extra={"kind": "sync"})
            return
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        if answer is None:
            return
        snap, parts = answer
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
            restored, bad = self.predictions.restore(part.caches, self._clock())
            self.synced_predicted += restored
            refused += bad
            await asyncio.sleep(0)  # let the notes that arrive meanwhile in
        if undecodable or refused:
            log.warning(
                "router: from a peer's sync answer, %d undecodable predicted parts and %d malformed predicted "
                "caches were skipped; the rest was kept",
                undecodable, refused, extra={"kind": "sync"},
            )  # fmt: skip

    async def _collect_sync(
        self, sub: Subscription, timeout_s: float
    ) -> tuple[LedgerSnapshot, list[bytes]] | None:
        """One peer's sync answer: its decoded `LedgerSnapshot` and the bodies of its predicted parts, in order;
        None when no peer answered.

        Every peer answers; the first whose answer is complete is taken. A peer whose first message does not
        decode is ignored (logged), so a broken or stalled peer does not hide a good one; at the timeout the
        most complete answer is kept (logged). A peer that sends one message (a router before multi-part
        sync) gives a complete answer of one part.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        answers: dict[str, tuple[LedgerSnapshot, int, list[bytes]]] = {}
        ignored: set[str] = set()
        heard = False
        while True:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            headers = msg.headers or {}
            sender = headers.get(SYNC_FROM_HEADER, "")
            if not heard and not sender and headers.get("Status") == "503":
                return None  # no responders: the first replica
            heard = True
            if sender in ignored:
                continue
            have = answers.get(sender)
            if have is not None:
                have[2].append(msg.data)
            else:
                try:
                    snap = decode(msg.data, LedgerSnapshot, format="msgpack")
                except ProtocolError as exc:
                    log.warning(
                        "router: undecodable accounting snapshot from a peer, waiting for another: %s",
                        exc, extra={"kind": "sync"},
                    )  # fmt: skip
                    if sender:  # a peer without an id sends one message: nothing more of it to ignore
                        ignored.add(sender)
                    continue
                try:
                    expected = min(max(int(headers.get(SYNC_PARTS_HEADER, "1")), 1), _MAX_SYNC_PARTS)
                except ValueError:
                    expected = 1
                have = answers[sender] = (snap, expected, [])
            if 1 + len(have[2]) >= have[1]:
                return have[0], have[2]
        if not answers:
            if heard:
                log.warning(
                    "router: no peer's accounting snapshot decoded within %.1f s; starting without one",
                    timeout_s, extra={"kind": "sync"},
                )  # fmt: skip
            else:
                log.warning(
                    "router: the sync subject has subscribers but none answered within %.1f s; starting "
                    "without a peer's ledger (raise --sync-timeout-s if peers are slow to answer)",
                    timeout_s, extra={"kind": "sync"},
                )  # fmt: skip
            return None
        snap, expected, parts = max(answers.values(), key=lambda a: len(a[2]))
        log.warning(
            "router: accounting sync got %d of %d parts from a peer within %.1f s; kept what arrived",
            1 + len(parts), expected, timeout_s, extra={"kind": "sync"},
        )  # fmt: skip
        return snap, parts

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
            max_payload = nc.max_payload if nc is not None else 1 << 20
            limit = max(max_payload - 1024, max_payload // 2)
            first = _fitted(snap.entries, sessions, limit)
            if nc is None or (msg.headers or {}).get(SYNC_PARTS_HEADER) != "1":
                await msg.respond(first)  # an asker that takes one message
                return
            sizes = self.predictions.sizes(now)
            plan = _plan_parts([(h.worker_id, n, kind == TTL) for kind, h, n in sizes], limit)
            headers = {SYNC_FROM_HEADER: self._id}
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
                        c = exported[i] = self.predictions.cache(kind, h, now)
                    shift = len(c.keys) - n  # slices count from the newest end
                    part.append(_slice(c, shift + start, shift + end))
                data = encode(PredictedSnapshot(caches=part), format="msgpack")
                await nc.publish(msg.reply, data, headers=headers)
                sent += len(data)
                if sent >= _FLUSH_EVERY_BYTES:  # stay within the client's outgoing buffer
                    await nc.flush()
                    sent = 0
                await asyncio.sleep(0)  # a large answer does not hold up this replica's routes

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
