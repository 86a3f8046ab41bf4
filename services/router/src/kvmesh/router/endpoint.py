"""The router's ``route`` endpoint: parse, match, carry out `kvmesh.router.answer.route_answer`, reply.

Every error reply carries ``{"error": {"code", "message"}}`` and the NATS service-error headers
(``Nats-Service-Error``: ``"<code>: <message>"``; ``Nats-Service-Error-Code``: 400/404/503/500); values the
request echoes are clipped so the reply fits the server's max payload.

With a local index a route is answered inline (nothing in it waits on the network); with ``--index remote``
each route runs in its own task, at most `MAX_IN_FLIGHT` at once, and asks the indexers' queue group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import nats.errors
from nats.aio.client import Client
from nats.micro.request import Request

from kvmesh.core.errors import (
    MAX_ECHO_CHARS,
    BadRequestError,
    InternalError,
    ProtocolError,
    RequestError,
    RouteError,
    UnavailableError,
    UnknownModelError,
    clip_echo,
)
from kvmesh.core.index import Holder
from kvmesh.core.load import EngineLoads, LoadLedger
from kvmesh.core.protocol import ERROR_STATUS, HolderStatus, RouteReply, RouteRequest, encode, error_reply
from kvmesh.core.route import Policy, RankSet, Selection, parse_route_message
from kvmesh.router.answer import (
    MatchAnswer,
    match_answer,
    match_request,
    parse_match_reply,
    refuse_without_live_ranks,
    registered_block_size,
    route_answer,
    serves_unindexed,
)
from kvmesh.router.config import RouterSettings
from kvmesh.router.hashed_match import match_request_locally
from kvmesh.router.health import RecordLike, heartbeat_late_after, holders_status, index_mode
from kvmesh.router.local_index import LocalIndex
from kvmesh.router.notes import LifecycleNotes
from kvmesh.router.route_metrics import RouteMetrics
from kvmesh.router.stats import LatencyWindow
from kvmesh.runtime import tracing
from kvmesh.runtime.metrics import ServiceMetrics
from kvmesh.runtime.nats import count_endpoint_error
from kvmesh.runtime.registry import RegistryWatcher

log = logging.getLogger("kvmesh.router")

MAX_IN_FLIGHT = 256
"""Route requests served at once by one replica (beyond it, requests wait in the subscription's queue)."""


class WorkerRegistry(Protocol):
    """Live (worker, dp rank)s per model (heartbeats); None means "no opinion, use the index's list"."""

    def live(self, model: str) -> Sequence[Holder] | None:
        """Return the live (worker id, dp rank)s registered for ``model``, or None."""
        ...


class RouteEndpoint:
    """Answers route requests; counts replies, errors per code, modes and candidates cut per model.

    Args:
        settings: the router's settings.
        policy: the router's cost policy.
        notes: the shared accounting (its ledger and engine loads are read; routed requests go through it).
        local: the in-process index, or None (``--index remote``).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        settings: RouterSettings,
        *,
        policy: Policy,
        notes: LifecycleNotes,
        local: LocalIndex | None,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.notes = notes
        self.ledger: LoadLedger = notes.ledger
        self.engine_loads: EngineLoads = notes.engine_loads
        self.local = local
        self.registry: WorkerRegistry | None = None
        self._clock = clock
        self._nc: Client | None = None
        self._pruned_s = 0.0
        self.micro_endpoint: Any = None
        """The micro service's route endpoint, whose error count `$SRV.STATS` reports."""
        self._in_flight: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self.routed = 0
        self.errors: dict[str, int] = {}
        self.modes: dict[str, int] = {"exact": 0, "degraded": 0, "load_only": 0}
        """Route replies per mode."""
        self.bounded: dict[str, int] = {}
        """Model → live candidates cut from its last route beyond ``--max-candidates`` (warned once each)."""
        self.latency = LatencyWindow()
        self.metrics: RouteMetrics | None = None
        """Per-route latency, candidates and busy skips (`use_metrics`); None: nothing is timed."""

    def bind(self, nc: Client) -> None:
        """Use ``nc`` for match queries and replies."""
        self._nc = nc

    def use_metrics(self, metrics: ServiceMetrics) -> None:
        """Record each route's stage latencies, candidates and busy skips in ``metrics``."""
        self.metrics = RouteMetrics(metrics)

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the routes being answered."""
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=timeout_s)

    # ------------------------------------------------------------------ what the router knows

    def ranks(self, model: str) -> RankSet | None:
        """The model's registered ranks (None: no registry opinion)."""
        if self.registry is None:
            return None
        ranks = getattr(self.registry, "ranks", None)
        if ranks is not None:
            out: RankSet | None = ranks(model)
            return out
        live = self.registry.live(model)
        return None if live is None else RankSet.from_pairs(live)

    def records(self) -> Mapping[str, RecordLike] | None:
        """The registry's worker records by id (None without a registry watcher)."""
        return self.registry.workers if isinstance(self.registry, RegistryWatcher) else None

    def heartbeat_late_s(self) -> float:
        """Seconds after which a worker's heartbeat is late (0: off or not known yet)."""
        return heartbeat_late_after(self.settings.heartbeat_late_s, getattr(self.registry, "ttl_s", None))

    def index_mode(self, now: float) -> tuple[str, str | None]:
        """The router's own mode before any holder is chosen: ``exact``, ``degraded`` (lag) or ``load_only``."""
        s = self.settings
        view = self.local.view(now) if self.local is not None else None
        return index_mode(view, max_lag_messages=s.max_lag_messages, max_lag_s=s.max_lag_s)

    def holders_status(self) -> tuple[dict[str, HolderStatus], int]:
        """Every holder that is not exact (`kvmesh.router.health.holders_status`)."""
        replica = self.local.replica if self.local is not None else None
        records = self.records()
        return holders_status(
            replica.state.holder_health() if replica is not None else None,
            sorted(records.items()) if records is not None else None,
            heartbeat_late_s=self.heartbeat_late_s(),
            wall=time.time(),
        )

    # ------------------------------------------------------------------ requests

    async def on_route(self, req: Request) -> None:
        """Serve a request: inline with a local index, else in its own task, at most `MAX_IN_FLIGHT` at once.

        nats-py awaits a subscription's handler before it delivers the next message, so a handler that awaited
        the indexer itself would serve one request per indexer round trip (about 1,000/s on one box). With a
        local index nothing in a route waits on the network, and a task per request would only add its cost.
        """
        if self.local is not None and self.local.replica is not None:
            await self._serve_route(req)
            return
        await self._slots.acquire()
        task = asyncio.create_task(self._serve_route(req))
        self._in_flight.add(task)
        task.add_done_callback(self._route_done)

    def _route_done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        self._slots.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("route: reply failed: %r", task.exception())

    async def _serve_route(self, req: Request) -> None:
        with tracing.server_span(tracing.ROUTE_SPAN, req.headers):  # the caller's span is its parent
            await self._serve(req)

    async def _serve(self, req: Request) -> None:
        request_id: str | None = None
        m, t0 = self.metrics, time.perf_counter()
        try:
            try:
                parsed = parse_route_message(
                    req.data, req.headers, max_tokens=self.settings.max_tokens, base_policy=self.policy
                )
            except RequestError as exc:
                raise BadRequestError(str(exc)) from exc
            if m is not None:
                m.lap("decode", t0)
            request_id = parsed.request_id
            reply = await self._route(parsed, req.data)
            tracing.note_route(parsed, reply)
        except RouteError as exc:
            await self._respond_error(req, exc.code, exc.message, request_id)
            return
        except Exception as exc:
            log.exception("route %s: internal error", clip_echo(request_id or "-"))
            await self._respond_error(req, "internal", str(exc), request_id)
            return
        data = encode(reply)
        if len(data) > self._reply_limit():
            if request_id is not None:  # recorded as routed: it must not count on the worker
                await self.notes.withdraw(request_id)
            await self._respond_error(
                req,
                "bad_request",
                f"the reply ({len(data):,} bytes) would exceed the server's max payload; "
                "ask without explain, with fewer candidates or a shorter request_id",
                None,
            )
            return
        self.routed += 1
        self.ledger.answered(
            reply.worker_id,
            reply.dp_rank,
            available_tokens=reply.available_tokens or 0,
            captured_tokens=reply.cached_tokens,
        )
        await req.respond(data)
        self.latency.add(time.perf_counter() - t0)
        if m is not None:
            m.lap("total", t0)

    def _reply_limit(self) -> int:
        """Largest reply body we send: the server closes a connection that publishes more than its max payload
        (and nats-py treats that as fatal), so a reply must leave room for the headers."""
        return (self._nc.max_payload if self._nc is not None else 1 << 20) - 4096

    async def _respond_error(self, req: Request, code: str, message: str, request_id: str | None) -> None:
        """Send an error reply; echoed request values are clipped so the reply always fits the max payload."""
        self.errors[code] = self.errors.get(code, 0) + 1
        tracing.note_error(code, request_id)
        message = clip_echo(message)
        echo = request_id if request_id is not None and len(request_id) <= MAX_ECHO_CHARS else None
        body = encode(error_reply(code, message, request_id=echo))
        log.info("route %s: %s: %s", clip_echo(request_id or "-", 64), code, message)
        endpoint = self.micro_endpoint
        if endpoint is not None:  # so $SRV.STATS counts what the router counted
            count_endpoint_error(endpoint, f"{code}: {message}")
        await req.respond_error(str(ERROR_STATUS[code]), f"{code}: {message}", body)

    async def _route(self, parsed: RouteRequest, body: bytes) -> RouteReply:
        ranks = self.ranks(parsed.model)
        refusal = refuse_without_live_ranks(parsed, ranks)
        if refusal is not None:
            raise refusal
        m, t = self.metrics, time.perf_counter()
        try:
            match = await self._match(parsed)
        except RouteError as exc:
            if not serves_unindexed(exc, ranks):
                raise
            replica = self.local.replica if self.local is not None else None
            index_seq = replica.state.applied_seq if replica is not None else 0
            match = match_answer(index_seq, registered_block_size(self.records(), parsed.model), ())
        if m is not None:
            t = m.lap("match", t)
        now = self._clock()
        match, keys = self.notes.predictions.overlay(parsed, match, now)
        mode = self.index_mode(now)
        self.ledger.expire(now)
        if now - self._pruned_s > self.settings.load_ttl_s:
            self.engine_loads.prune(now)
            self._pruned_s = now
        outcome = route_answer(
            parsed, body, match, ranks, index_mode=mode, policy=self.policy,
            max_candidates=self.settings.max_candidates, ledger=self.ledger, engine_loads=self.engine_loads,
            now=now, wall=time.time(), records=self.records(), heartbeat_late_s=self.heartbeat_late_s(),
            session=None if parsed.session_id is None else self.notes.sessions.get(parsed.session_id, now),
        )  # fmt: skip
        if m is not None:
            m.lap("decision", t)
            m.route(len(outcome.selection.candidates) if outcome.selection else 0, outcome.busy_skipped)
        if outcome.selection is not None:
            self._note_bound(parsed.model, outcome.selection)
        if outcome.error is not None:
            raise outcome.error
        assert outcome.reply is not None
        self.modes[outcome.mode] = self.modes.get(outcome.mode, 0) + 1
        await self.notes.record(outcome.routed, outcome.reply, parsed.session_id, keys)
        return outcome.reply

    def _note_bound(self, model: str, selection: Selection) -> None:
        """Warn once per model whose candidates worth scoring exceed ``--max-candidates``."""
        if not selection.bounded:
            return
        if model not in self.bounded:
            log.warning(
                "router: model %r has %d live candidates, more than --max-candidates %d: each route scores "
                "at most %d (holders with overlap first), %d cut from this one (warned once per model)",
                model,
                selection.total,
                self.settings.max_candidates,
                self.settings.max_candidates,
                selection.cut,
            )
        self.bounded[model] = selection.cut

    async def _match(self, parsed: RouteRequest) -> MatchAnswer:
        replica = self.local.replica if self.local is not None else None
        if replica is not None:
            try:
                result = match_request_locally(replica.state, parsed)
            except UnknownModelError as exc:
                raise UnknownModelError(f"no worker serves model {parsed.model!r}") from exc
            except RequestError as exc:
                raise BadRequestError(str(exc)) from exc
            return match_answer(result.index_seq, result.block_size, result.candidates)
        assert self._nc is not None
        query = encode(match_request(parsed, self._nc.max_payload), format="msgpack")
        timeout, headers = self.settings.match_timeout_s, tracing.context_headers()  # the route span's
        request = self._nc.request(self.settings.match_subject, query, timeout=timeout, headers=headers)
        try:
            msg = await asyncio.wait_for(request, timeout + 0.25)
        except nats.errors.NoRespondersError as exc:
            raise UnavailableError("no indexer is ready to answer") from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise UnavailableError(f"no indexer answered within {timeout:g} s") from exc
        try:
            return parse_match_reply(msg.data)
        except ProtocolError as exc:  # a peer's bad reply: answered and counted, not a traceback
            raise InternalError(f"undecodable match reply from an indexer: {exc}") from exc
