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
  entries, after it subscribed to the notes (`kvmesh.router.peer_sync`);
* ``<load_prefix>.<worker>`` — engine load reports (`WorkerLoad`, JSON).

An undecodable note is logged (a load report at debug level) and dropped; nothing else is lost. Undecodable
lifecycle notes are counted (`LifecycleNotes.undecodable`), and so are ``routed`` / ``noted`` notes that no
router sends (a negative rank, a session id outside 1 – 256 characters, a key outside [0, 2⁶⁴)), dropped
whole.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
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
    MAX_NOTE_AGE_S,
    RequestRef,
    Routed,
    RouteNote,
    RouteReply,
    WorkerLoad,
    decode,
    encode,
)
from kvmesh.core.sessions import SessionTable
from kvmesh.router import peer_sync
from kvmesh.router.config import RouterSettings
from kvmesh.router.predictions import Predictions
from kvmesh.router.sync import note_problem
from kvmesh.runtime import subjects

log = logging.getLogger("kvmesh.router")
_N = TypeVar("_N", Routed, RouteNote)


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
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.engine_loads = engine_loads
        self._clock = clock
        self._wall = wall
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
        self.replica_id = uuid.uuid4().hex
        """This replica's id in the headers of its sync answers."""
        self.undecodable = 0
        """Lifecycle notes (routed, prefill_done, finished) dropped because they did not decode."""
        self._warned: set[str] = set()
        """Kinds of note already warned about as undecodable (later ones of a kind log at DEBUG)."""

    @property
    def nc(self) -> Client | None:
        """The connection (None before `subscribe`)."""
        return self._nc

    def clock(self) -> float:
        """Monotonic seconds, this replica's clock."""
        return self._clock()

    def subject(self, event: str) -> str:
        """The lifecycle subject of ``event`` (``routed``, ``sync``, ...)."""
        return self._subject(event)

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
        peer's answer (`kvmesh.router.peer_sync`; none answering is fine: the first replica)."""
        await peer_sync.sync_from_peers(self, nc)

    async def serve_sync(self, nc: Client) -> Subscription:
        """Answer later replicas' sync requests with this replica's ledger; return the subscription."""
        return await nc.subscribe(self._subject("sync"), cb=self._on_sync)

    async def _on_sync(self, msg: Msg) -> None:
        await peer_sync.answer_sync(self, msg)

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
        problem = note_problem(note.dp_rank, note.session_id, note.block_keys)
        if problem is not None:
            self.undecodable += 1
            self._undecodable(name, f"router: {name} note dropped (%s) on %s", problem, msg.subject)
            return None
        return note

    async def _on_prefill_done(self, msg: Msg) -> None:
        ref = self._ref(msg, "prefill_done")
        if ref is not None:
            self.ledger.prefill_done(ref.request_id, self._dated(ref.at))

    async def _on_finished(self, msg: Msg) -> None:
        ref = self._ref(msg, "finished")
        if ref is not None:
            self.ledger.finished(ref.request_id, self._dated(ref.at), cached_tokens=ref.cached_tokens)

    def _dated(self, at: float | None) -> float:
        """This replica's monotonic time of a note stamped ``at`` (epoch seconds, or None: now)."""
        now = self._clock()
        if at is None or not math.isfinite(at):
            return now
        return now - min(max(self._wall() - at, 0.0), MAX_NOTE_AGE_S)

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
