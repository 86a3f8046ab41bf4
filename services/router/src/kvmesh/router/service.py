"""The router service: ``kvmesh.route`` requests → indexer match → cost over affinity and load → JSON reply.

A NATS micro service (``kvmesh-router``, queue group ``kvmesh-router``) with one endpoint, ``route``, so
``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS`` find it (the endpoint's stats ``data`` carries the ledger's
counters). Every error reply carries ``{"error": {"code", "message"}}`` and the NATS service-error headers
(``Nats-Service-Error``: ``"<code>: <message>"``; ``Nats-Service-Error-Code``: 400/404/503/500).

Load, shared by every replica (plain subscriptions, no queue group, so each replica sees every event):

* ``<requests_prefix>.routed`` — published by the replica that routed a request with a ``request_id``
  (before it replies, after recording it itself), applied by every other replica (the connection does not
  echo a replica's own messages back to it);
* ``<requests_prefix>.prefill_done`` / ``.finished`` — published by clients (`kvmesh.client.Router`);
* ``<requests_prefix>.sync`` — a starting replica asks its peers for their ledger (`LedgerSnapshot`), so a
  restart loses nothing other replicas hold; it subscribes to the lifecycle events first, so nothing falls
  between the snapshot and the live events;
* ``<load_prefix>.<worker>`` — engine load reports (`WorkerLoad`, JSON), kept ``load_ttl_s``.

Requests without a ``request_id`` are routed but not accounted (nobody could finish them).

Candidates are what the index holds for the model (every worker that announced itself, nothing cached
included, until the registry's `WorkerRemoved` reaches the stream), narrowed and completed by the worker
registry (``--use-registry``, on by default): a `kvmesh.runtime.registry.RegistryWatcher` follows the
registry bucket, so a worker whose heartbeats stopped leaves the candidates at once, and a registered
worker the index does not know yet joins them with zero overlap. A model with no registered worker at all
(workers fed without heartbeats) keeps the index's candidates. A rank its worker's record lists in
``stale_ranks`` (engine silent) is no candidate; a model whose every rank is stale answers ``no_workers``,
as does a request whose named ``candidates`` have only stale ranks (naming one and why).
Each route scores at most ``--max-candidates`` (`kvmesh.core.route.select_candidates`: holders with overlap
first, and only a few idle registered ranks the index lacks), so its cost does not grow with empty ranks.

Every reply carries ``mode``: ``exact``; ``degraded`` with ``degraded_reason`` (the local replica lags the
stream beyond ``--max-lag-messages`` / ``--max-lag-s``, measured against the stream's last sequence read
every `LAG_CHECK_S`, or the chosen holder is incomplete, its history lost, or stale, its heartbeat late);
``load_only`` (the local replica is rebuilding: overlaps are ignored). Explain gives each scored holder's
``health``; the endpoint's stats carry the non-exact holders and the lag (``kvmesh status``).

Where the overlaps come from (``--index``):

* ``local`` (default): the router holds its own `kvmesh.runtime.replica.StreamReplica` (the indexers' newest
  snapshot, then the stream), joins the route queue group only once it has caught up, and matches in
  process: one NATS round trip per route, at the memory of one index per router. The answer's
  ``index_seq`` is this router's applied sequence. The indexers still write the snapshots and publish
  worker removals. This halves route latency (docs/benchmarks.md).
* ``remote``: a match query to the indexers' queue group per route (msgpack, token ids packed as uint32).
  Routers hold no index; a route costs two NATS round trips.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, EndpointStats, ServiceConfig

from kvmesh.core.errors import MAX_ECHO_CHARS, RequestError, clip_echo
from kvmesh.core.hashing import pack_tokens
from kvmesh.core.load import (
    ActiveLoad,
    EngineLoads,
    LedgerSnapshot,
    LoadLedger,
    RequestRef,
    Routed,
    WorkerLoad,
)
from kvmesh.core.route import (
    ERROR_STATUS,
    Candidate,
    Decision,
    RankSet,
    RouteRequest,
    Selection,
    decide,
    error_body,
    parse_route_request,
    route_seed,
    select_candidates,
)
from kvmesh.core.state import MatchResult, UnknownModelError
from kvmesh.router.config import RouterSettings
from kvmesh.runtime import subjects
from kvmesh.runtime.cli import VERSION
from kvmesh.runtime.nats import ConnectionClosedForGood, connect, wait_closed, wait_for_stream
from kvmesh.runtime.registry import RegistryWatcher
from kvmesh.runtime.replica import StreamReplica, retry_start
from kvmesh.runtime.snapshots import SnapshotStore

log = logging.getLogger("kvmesh.router")

LAG_CHECK_S = 0.5
"""Seconds between two reads of the stream's last sequence (the local replica's lag, ``--index local``)."""
MAX_HOLDERS_LISTED = 100
"""Non-exact holders listed by name in the router's status (the rest are counted)."""
MAX_IN_FLIGHT = 256
"""Route requests served at once by one replica (beyond it, requests wait in the subscription's queue)."""
_STOP_TIMEOUT_S = 5.0


class WorkerRegistry(Protocol):
    """Live (worker, dp rank)s per model (heartbeats); None means "no opinion, use the index's list"."""

    def live(self, model: str) -> Sequence[tuple[str, int]] | None:
        """Return the live (worker id, dp rank)s registered for ``model``, or None."""
        ...


class RouteError(Exception):
    """An error reply of the route API (internal to this module)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_routed_dec = msgspec.json.Decoder(Routed)
_ref_dec = msgspec.json.Decoder(RequestRef)
_load_dec = msgspec.json.Decoder(WorkerLoad)
_snap_dec = msgspec.msgpack.Decoder(LedgerSnapshot)


class RouterService:
    """One router replica.

    Args:
        settings: the replica's settings.
        registry: live workers per model; None uses the indexer's candidates as they are.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(
        self,
        settings: RouterSettings,
        *,
        registry: WorkerRegistry | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.settings = settings
        self.policy = settings.policy()
        self.registry = registry
        self.ledger = LoadLedger(ttl_s=settings.request_ttl_s, prefill_progress=settings.prefill_progress)
        self.engine_loads = EngineLoads(ttl_s=settings.load_ttl_s)
        self.synced_requests = 0
        self._clock = clock
        self._stop = asyncio.Event()
        self._nc: Client | None = None
        self._enc = msgspec.msgpack.Encoder()
        self._json = msgspec.json.Encoder()
        self._pruned_s = 0.0
        self.ready = asyncio.Event()
        self.routed = 0
        self.errors: dict[str, int] = {}
        self._route_endpoint: Any = None
        """The micro service's route endpoint, whose error count `$SRV.STATS` reports."""
        self._in_flight: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self.replica: StreamReplica | None = None
        """The in-process index (``--index local``), else None."""
        self.stream_last_seq = 0
        """The stream's last sequence as last read (``--index local``; every `LAG_CHECK_S`)."""
        self._lag_polls: collections.deque[tuple[float, int]] = collections.deque(maxlen=1024)
        self.bounded: dict[str, int] = {}
        """Model → live candidates cut from its last route beyond ``--max-candidates`` (warned once each)."""
        self.modes: dict[str, int] = {"exact": 0, "degraded": 0, "load_only": 0}
        """Route replies per mode."""

    async def run(self) -> None:
        """Join the shared accounting, then serve route requests until `stop()`."""
        s = self.settings
        # no_echo: the replica records what it routed before publishing it; its own lifecycle events coming
        # back would only be decoded and applied a second time (idempotently) on every route.
        self._nc = nc = await connect(s.nats_url, name="kvmesh-router", no_echo=True)
        follow: asyncio.Task[None] | None = None
        watch: asyncio.Task[None] | None = None
        lag: asyncio.Task[None] | None = None
        if self.registry is None and s.use_registry:
            js = nc.jetstream()

            async def members() -> dict[str, str]:
                try:
                    store = await SnapshotStore.open(js, s.snapshot_bucket_name(), create=False)
                except nats.js.errors.BucketNotFoundError:
                    return {}
                return await store.members()

            watcher = RegistryWatcher(js, s.registry_bucket_name(), members=members)
            self.registry = watcher
            watch = asyncio.create_task(watcher.run())
        try:
            if s.index == "local":
                follow = await self._start_replica(nc)
                if follow is None:
                    return  # stopped while catching up
                lag = asyncio.create_task(self._watch_lag(nc))
            await self._serve(nc, follow)
        finally:
            background = {t for t in (follow, watch, lag) if t is not None}
            for t in background:
                t.cancel()
            if background:
                await asyncio.wait(background, timeout=_STOP_TIMEOUT_S)
            with contextlib.suppress(Exception):
                await nc.drain()

    async def _start_replica(self, nc: Client) -> asyncio.Task[None] | None:
        """Restore the index from the newest snapshot and the stream; return the following task once caught
        up (None when stopped first)."""
        s = self.settings
        js = nc.jetstream()

        async def step(op: Callable[[], Awaitable[Any]], what: str) -> Any:
            # Every start-up call rides out timeouts while fresh R3 buckets and streams elect their leaders.
            return await retry_start(op, what=what, name="router", stop=self._stop)

        async def waited() -> bool:
            await wait_for_stream(js, s.stream, stop=self._stop)
            return True

        async def open_store() -> SnapshotStore | bool:
            try:
                return await SnapshotStore.open(js, s.snapshot_bucket_name(), create=False)
            except nats.js.errors.BucketNotFoundError:
                # No indexer has written a snapshot yet, so none has purged the stream either: it is whole.
                return False

        if await step(waited, f"wait for stream {s.stream}") is None or self._stop.is_set():
            return None
        opened = await step(open_store, f"open snapshot bucket {s.snapshot_bucket_name()}")
        if opened is None:
            return None
        store: SnapshotStore | None = opened or None
        self.replica = replica = StreamReplica(
            js, stream=s.stream, events_prefix=s.events_prefix, store=store, name="router", stop=self._stop
        )
        info = await step(lambda: js.stream_info(s.stream), f"read stream info of {s.stream}")
        start_seq = (
            None if info is None else await step(lambda: replica.recover(info), "recover from snapshots")
        )
        if start_seq is None:
            return None
        follow = asyncio.create_task(replica.follow(start_seq))
        await replica.wait_caught_up()
        if follow.done():
            follow.result()  # the consumer failed: fail the router
        if self._stop.is_set():
            follow.cancel()
            return None
        # Whatever the restore allocated is long-lived: keep it out of the cyclic collector's full passes
        # (the index's own maps hold only ints and are not tracked; a pass takes ~1 ms at a million blocks).
        gc.collect()
        gc.freeze()
        log.info(
            "router: index replica caught up at stream seq %d (%d blocks, %d messages read)",
            replica.state.applied_seq,
            replica.state.block_total(),
            replica.read_messages,
        )
        return follow

    async def _serve(self, nc: Client, follow: asyncio.Task[None] | None) -> None:
        s = self.settings
        subs = [
            await nc.subscribe(subjects.requests_subject(s.requests_prefix, "routed"), cb=self._on_routed),
            await nc.subscribe(
                subjects.requests_subject(s.requests_prefix, "prefill_done"), cb=self._on_prefill_done
            ),
            await nc.subscribe(
                subjects.requests_subject(s.requests_prefix, "finished"), cb=self._on_finished
            ),
            await nc.subscribe(f"{s.load_prefix}.>", cb=self._on_load),
        ]
        await nc.flush()
        await nc.flush()  # see below: subscribed for live events before asking peers for their snapshot
        await self._sync_from_peers()
        subs.append(
            await nc.subscribe(subjects.requests_subject(s.requests_prefix, "sync"), cb=self._on_sync)
        )
        service = await add_service(
            nc,
            ServiceConfig(
                name="kvmesh-router",
                version=VERSION,
                description="kvmesh KV-cache-aware router (affinity balanced against load)",
                queue_group=subjects.ROUTER_QUEUE,
                stats_handler=self._stats,
            ),
        )
        await service.add_endpoint(
            EndpointConfig(name="route", subject=s.route_subject, handler=self._on_route)
        )
        # nats.micro counts an error only when a handler raises; the router answers its errors itself.
        self._route_endpoint = service._endpoints[-1]  # private: nats-py has no public way to count them
        # The server must know every subscription before anyone is told we are ready. nats-py writes PING
        # straight to the socket but SUB through its pending buffer, so one flush can overtake the SUB.
        await nc.flush()
        await nc.flush()
        self.ready.set()
        log.info(
            "router: serving %s (%s, %d in-flight requests from peers)",
            s.route_subject,
            "local index" if self.replica is not None else f"indexers on {s.match_subject}",
            self.synced_requests,
        )
        try:
            stop_wait = asyncio.create_task(self._stop.wait())
            closed = asyncio.create_task(wait_closed(nc))
            await asyncio.wait(
                {stop_wait, closed} | ({follow} if follow else set()), return_when=asyncio.FIRST_COMPLETED
            )
            stop_wait.cancel()
            closed.cancel()
            if follow is not None and follow.done() and not self._stop.is_set():
                follow.result()  # the index replica failed: fail the router rather than serve a stale index
            if closed.done() and not closed.cancelled() and not self._stop.is_set():
                raise ConnectionClosedForGood("router: the NATS connection was closed for good; exiting")
        finally:
            with contextlib.suppress(Exception):
                await service.stop()
            if self._in_flight:  # answer what was accepted before the connection drains
                await asyncio.wait(set(self._in_flight), timeout=_STOP_TIMEOUT_S)
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    def stop(self) -> None:
        """Ask `run()` to finish."""
        self._stop.set()

    # ------------------------------------------------------------------ degraded modes

    async def _watch_lag(self, nc: Client) -> None:
        """Read the stream's last sequence every `LAG_CHECK_S` (what `lag` measures the replica against)."""
        js = nc.jetstream()
        while True:
            try:
                info = await js.stream_info(self.settings.stream)
            except Exception as exc:  # NATS unreachable or the stream re-created: the replica handles it
                log.debug("router: cannot read stream %s: %r", self.settings.stream, exc)
            else:
                self.note_stream_seq(int(info.state.last_seq), self._clock())
            await asyncio.sleep(LAG_CHECK_S)

    def note_stream_seq(self, last_seq: int, now: float) -> None:
        """Record that the stream's last sequence was ``last_seq`` at monotonic time ``now``."""
        self.stream_last_seq = last_seq
        if not self._lag_polls or self._lag_polls[-1][1] < last_seq:
            self._lag_polls.append((now, last_seq))

    def lag(self, now: float) -> tuple[int, float]:
        """Return how far the local replica is behind the stream: (messages, seconds).

        Messages: the stream's last sequence as last read minus the applied sequence (0 when ahead, e.g. a
        re-created stream being rebuilt). Seconds: how long ago the stream was first seen holding a message
        the replica has still not applied (0 when none; precise to `LAG_CHECK_S`). (0, 0.0) without a
        local replica.
        """
        if self.replica is None:
            return 0, 0.0
        applied = self.replica.state.applied_seq
        polls = self._lag_polls
        while polls and polls[0][1] <= applied:
            polls.popleft()
        seconds = max(0.0, now - polls[0][0]) if polls else 0.0
        return max(0, self.stream_last_seq - applied), seconds

    def _index_mode(self, now: float) -> tuple[str, str | None]:
        """The router's own mode before any holder is chosen: ``exact``, ``degraded`` (lag) or ``load_only``."""
        if self.replica is None:
            return "exact", None
        if not self.replica.caught_up:
            why = (
                "rebuilding the index (the stream was re-created)" if self.replica.rebuilds else "catching up"
            )
            return "load_only", f"no trustworthy index: the local replica is {why}; routing on load alone"
        messages, seconds = self.lag(now)
        s = self.settings
        if messages > s.max_lag_messages or seconds > s.max_lag_s:
            return "degraded", (
                f"replica_lag: the local index lags the stream by {messages} messages and {seconds:.1f} s "
                f"(bounds {s.max_lag_messages} messages, {s.max_lag_s:g} s)"
            )
        return "exact", None

    def _heartbeat_late_s(self) -> float:
        """Seconds after which a worker's heartbeat is late (0: off or not known yet)."""
        late = self.settings.heartbeat_late_s
        if late != 0:
            return max(late, 0.0)
        ttl = getattr(self.registry, "ttl_s", None)
        return 2 * ttl / 3 if isinstance(ttl, float | int) and ttl > 0 else 0.0

    def holder_state(
        self, c: Candidate, ranks: RankSet | None, lagging: bool, wall: float
    ) -> tuple[str, str | None]:
        """One holder's state: ``("exact", None)``, ``("incomplete", reason)`` (history lost) or
        ``("stale", reason)`` (events late: the replica lags, the worker's heartbeat is late)."""
        if c.health is not None:
            return "incomplete", c.health
        if lagging:
            return "stale", "replica_lag"
        late = self._heartbeat_late_s()
        if late > 0 and ranks is not None and isinstance(self.registry, RegistryWatcher):
            rec = self.registry.workers.get(c.worker_id)
            if rec is not None and rec.heartbeat_ts > 0 and wall - rec.heartbeat_ts > late:
                return "stale", f"heartbeat_late: last heartbeat {wall - rec.heartbeat_ts:.1f} s ago"
        return "exact", None

    def _holders_status(self) -> dict[str, Any]:
        """Every holder that is not exact, ``"worker/rank"`` → ``{"state", "reason"}`` (at most
        `MAX_HOLDERS_LISTED`), and how many there are in all."""
        out: dict[str, dict[str, str]] = {}
        total = 0

        def add(worker: str, rank: int | str, state: str, reason: str) -> None:
            nonlocal total
            key = f"{worker}/{rank}"
            if key in out:
                return
            total += 1
            if len(out) < MAX_HOLDERS_LISTED:
                out[key] = {"state": state, "reason": reason}

        if self.replica is not None:
            for (w, r), reason in self.replica.state.holder_health().items():
                add(w, r, "incomplete", reason)
        if isinstance(self.registry, RegistryWatcher):
            wall = time.time()
            late = self._heartbeat_late_s()
            for w, rec in sorted(self.registry.workers.items()):
                for r, reason in sorted(rec.stale_ranks.items()):
                    if 0 <= r < rec.dp_ranks:
                        add(w, r, "stale", f"engine_silent: {reason}")
                if late > 0 and rec.heartbeat_ts > 0 and wall - rec.heartbeat_ts > late:
                    add(
                        w, "*", "stale", f"heartbeat_late: last heartbeat {wall - rec.heartbeat_ts:.1f} s ago"
                    )
        return {"holders": out, "holders_not_exact": total}

    # ------------------------------------------------------------------ shared accounting

    async def _sync_from_peers(self) -> None:
        """Ask one peer replica for its in-flight requests (none answering is fine: first replica)."""
        assert self._nc is not None
        s = self.settings
        if s.sync_timeout_s <= 0:
            return
        try:
            msg = await self._nc.request(
                subjects.requests_subject(s.requests_prefix, "sync"), b"", timeout=s.sync_timeout_s
            )
            snap = _snap_dec.decode(msg.data)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
            return
        except msgspec.DecodeError as exc:
            log.warning("router: undecodable accounting snapshot from a peer: %s", exc)
            return
        self.synced_requests = self.ledger.restore(snap, self._clock())

    async def _on_sync(self, msg: Msg) -> None:
        if msg.reply:
            now = self._clock()
            self.ledger.expire(now)
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(self._enc.encode(self.ledger.snapshot(now)))

    async def _on_routed(self, msg: Msg) -> None:
        try:
            event = _routed_dec.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("router: undecodable routed event on %s", msg.subject)
            return
        self.ledger.routed(event, self._clock())

    async def _on_prefill_done(self, msg: Msg) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            self.ledger.prefill_done(_ref_dec.decode(msg.data).request_id, self._clock())

    async def _on_finished(self, msg: Msg) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            self.ledger.finished(_ref_dec.decode(msg.data).request_id, self._clock())

    async def _on_load(self, msg: Msg) -> None:
        try:
            report = _load_dec.decode(msg.data)
        except msgspec.DecodeError:
            log.debug("router: undecodable load report on %s", msg.subject)
            return
        self.engine_loads.update(report, self._clock())

    def _stats(self, _endpoint: EndpointStats) -> dict[str, Any]:
        st = self.ledger.stats()
        return {
            "routed": self.routed,
            "errors": dict(self.errors),
            "in_flight": st.active,
            "ledger": {
                "routed": st.routed,
                "prefill_done": st.prefill_done,
                "finished": st.finished,
                "expired": st.expired,
                "unknown": st.unknown,
            },
            "engine_reports": len(self.engine_loads),
            "modes": dict(self.modes),
            "candidates_cut": dict(self.bounded),
            "index": self._index_stats(),
        }

    def _index_stats(self) -> dict[str, Any]:
        now = self._clock()
        route_mode, reason = self._index_mode(now)
        health: dict[str, Any] = {"route_mode": route_mode, **self._holders_status()}
        if reason is not None:
            health["degraded_reason"] = reason
        if self.replica is None:
            return {
                "mode": "remote",
                "match_subject": self.settings.match_subject,
                "route_subject": self.settings.route_subject,
                **health,
            }
        st = self.replica.state
        messages, seconds = self.lag(now)
        return {
            **health,
            "lag_messages": messages,
            "lag_s": round(seconds, 3),
            "mode": "local",
            "route_subject": self.settings.route_subject,
            "stream": self.settings.stream,
            "applied_seq": st.applied_seq,
            "blocks": st.block_total(),
            "read_messages": self.replica.read_messages,
            "decode_errors": self.replica.decode_errors,
            "apply_errors": self.replica.apply_errors,
            "recovery": self.replica.recovery,
        }

    # ------------------------------------------------------------------ route

    async def _on_route(self, req: Request) -> None:
        """Serve a request: inline with a local index, else in its own task, at most `MAX_IN_FLIGHT` at once.

        nats-py awaits a subscription's handler before it delivers the next message, so a handler that awaited
        the indexer itself would serve one request per indexer round trip (about 1,000/s on one box). With a
        local index nothing in a route waits on the network, and a task per request would only add its cost.
        """
        if self.replica is not None:
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
        request_id: str | None = None
        try:
            try:
                parsed = parse_route_request(
                    req.data, max_tokens=self.settings.max_tokens, base_policy=self.policy
                )
            except RequestError as exc:
                raise RouteError("bad_request", str(exc)) from exc
            request_id = parsed.request_id
            reply = await self._route(parsed, req.data)
        except RouteError as exc:
            await self._respond_error(req, exc.code, exc.message, request_id)
            return
        except Exception as exc:
            log.exception("route %s: internal error", clip_echo(request_id or "-"))
            await self._respond_error(req, "internal", str(exc), request_id)
            return
        data = self._json.encode(reply)
        if len(data) > self._reply_limit():
            await self._respond_error(
                req,
                "bad_request",
                f"the reply ({len(data):,} bytes) would exceed the server's max payload; "
                "ask without explain, with fewer candidates or a shorter request_id",
                None,
            )
            return
        self.routed += 1
        await req.respond(data)

    def _reply_limit(self) -> int:
        """Largest reply body we send: the server closes a connection that publishes more than its max payload
        (and nats-py treats that as fatal), so a reply must leave room for the headers."""
        return (self._nc.max_payload if self._nc is not None else 1 << 20) - 4096

    async def _respond_error(self, req: Request, code: str, message: str, request_id: str | None) -> None:
        """Send an error reply; echoed request values are clipped so the reply always fits the max payload."""
        self.errors[code] = self.errors.get(code, 0) + 1
        message = clip_echo(message)
        body = error_body(code, message)
        if request_id is not None and len(request_id) <= MAX_ECHO_CHARS:
            body["request_id"] = request_id
        log.info("route %s: %s: %s", clip_echo(request_id or "-", 64), code, message)
        endpoint = self._route_endpoint
        if endpoint is not None:  # so $SRV.STATS counts what the router counted
            endpoint._num_errors += 1
            endpoint._last_error = f"{code}: {message}"
        await req.respond_error(str(ERROR_STATUS[code]), f"{code}: {message}", self._json.encode(body))

    def _match_local(self, parsed: RouteRequest) -> dict[str, Any]:
        """Match against the in-process replica (``--index local``); same answer shape as an indexer's."""
        assert self.replica is not None
        try:
            result: MatchResult = self.replica.state.match(
                parsed.model, parsed.token_ids, lora_name=parsed.lora_name, cache_salt=parsed.cache_salt
            )
        except UnknownModelError as exc:
            raise RouteError("unknown_model", f"no worker serves model {parsed.model!r}") from exc
        except RequestError as exc:
            raise RouteError("bad_request", str(exc)) from exc
        return {
            "index_seq": result.index_seq,
            "block_size": result.block_size,
            "prompt_blocks": result.prompt_blocks,
            "candidates": [
                Candidate(
                    worker_id=c.worker_id,
                    dp_rank=c.dp_rank,
                    overlap_blocks=c.overlap_blocks,
                    cached_blocks=c.cached_blocks,
                    tiers=c.tiers,
                    health=c.health,
                    block_size=c.block_size,
                )
                for c in result.candidates
            ],
        }

    async def _match(self, parsed: RouteRequest) -> dict[str, Any]:
        if self.replica is not None:
            return self._match_local(parsed)
        assert self._nc is not None
        # Packed uint32 spares both ends per-token work; a msgpack list is smaller for ids below 128 and is sent
        # when the packed form would not fit the server's max payload (the JSON request did).
        packed = pack_tokens(parsed.token_ids)  # the ids were checked by parse_route_request
        tokens: bytes | list[int] = (
            packed if len(packed) + _match_overhead(parsed) <= self._nc.max_payload else parsed.token_ids
        )
        query = self._enc.encode(
            {
                "model": parsed.model,
                "token_ids": tokens,
                "lora_name": parsed.lora_name,
                "cache_salt": parsed.cache_salt,
            }
        )
        timeout = self.settings.match_timeout_s
        try:
            msg = await asyncio.wait_for(
                self._nc.request(self.settings.match_subject, query, timeout=timeout), timeout + 0.25
            )
        except nats.errors.NoRespondersError as exc:
            raise RouteError("unavailable", "no indexer is ready to answer") from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise RouteError("unavailable", f"no indexer answered within {timeout:g} s") from exc
        answer: dict[str, Any] = msgspec.msgpack.decode(msg.data)
        if "error" in answer:
            code = answer["error"].get("code", "internal")
            raise RouteError(code if code in ERROR_STATUS else "internal", answer["error"].get("message", ""))
        answer["candidates"] = [
            Candidate(
                worker_id=c[0],
                dp_rank=c[1],
                overlap_blocks=c[2],
                cached_blocks=c[3],
                tiers=c[4] if len(c) > 4 else None,
                block_size=c[5] if len(c) > 5 else 0,
                health=c[6] if len(c) > 6 else None,
            )
            for c in answer["candidates"]
        ]
        return answer

    def _ranks(self, model: str) -> RankSet | None:
        """The model's registered ranks (None: no registry opinion)."""
        if self.registry is None:
            return None
        ranks = getattr(self.registry, "ranks", None)
        if ranks is not None:
            out: RankSet | None = ranks(model)
            return out
        live = self.registry.live(model)
        return None if live is None else RankSet.from_pairs(live)

    async def _route(self, parsed: RouteRequest, body: bytes) -> dict[str, Any]:
        ranks = self._ranks(parsed.model)
        if ranks is not None and ranks.live_count == 0 and not parsed.candidates:
            if ranks.stale_count:
                sw, sr, why = ranks.stale_listed[0]  # a registered rank (a record may name others)
                raise RouteError(
                    "no_workers",
                    f"no live workers: every registered rank of model {parsed.model!r} "
                    f"({ranks.stale_count}) has a stale engine (e.g. {sw}/{sr}: {why})",
                )
            raise RouteError(
                "no_workers",
                f"every worker of model {parsed.model!r} has left the worker registry (heartbeats stopped)",
            )
        try:
            answer = await self._match(parsed)
        except RouteError as exc:
            if exc.code != "unknown_model" or ranks is None or ranks.live_count == 0:
                raise
            # Registered (heartbeating) but not in the index, e.g. after `kvmesh reset` forgot every worker:
            # route among them with nothing cached rather than refuse the model until an engine stores again.
            answer = {
                "index_seq": self.replica.state.applied_seq if self.replica is not None else 0,
                "block_size": self._registered_block_size(parsed.model),
                "candidates": [],
            }
        now = self._clock()
        mode, mode_reason = self._index_mode(now)
        indexed: list[Candidate] = answer["candidates"]
        if mode == "load_only":
            indexed = [
                Candidate(worker_id=c.worker_id, dp_rank=c.dp_rank, overlap_blocks=0, cached_blocks=0)
                for c in indexed
            ]
        self.ledger.expire(now)
        if now - self._pruned_s > self.settings.load_ttl_s:
            self.engine_loads.prune(now)
            self._pruned_s = now
        seed = route_seed(parsed.request_id, body)

        def loaded(worker_id: str, dp_rank: int) -> bool:
            return (
                self.ledger.load(worker_id, dp_rank, now_s=now).requests > 0
                or self.engine_loads.get(worker_id, dp_rank, now) is not None
            )

        offered = bool(indexed) or (ranks is not None and ranks.live_count > 0)
        if parsed.candidates is not None:  # narrowed before the bound, so a requested worker is never cut
            allow = set(parsed.candidates)
            indexed = [c for c in indexed if c.worker_id in allow]
            ranks = ranks.only(parsed.candidates) if ranks is not None else None
            if ranks is not None and ranks.live_count == 0 and ranks.stale_count:
                sw, sr, why = ranks.stale_listed[0]
                raise RouteError(
                    "no_workers",
                    f"no live workers among the candidates {parsed.candidates}: every registered rank of them "
                    f"({ranks.stale_count}) has a stale engine (e.g. {sw}/{sr}: {why})",
                )
        selection = select_candidates(
            indexed, ranks, max_candidates=self.settings.max_candidates, seed=seed, loaded=loaded
        )
        self._note_bound(parsed.model, selection)
        candidates = selection.candidates
        active: dict[tuple[str, int], ActiveLoad] = {}
        engine: dict[tuple[str, int], WorkerLoad] = {}
        for c in candidates:
            a = self.ledger.load(c.worker_id, c.dp_rank, excluding=parsed.request_id, now_s=now)
            if a.requests:
                active[(c.worker_id, c.dp_rank)] = a
            e = self.engine_loads.get(c.worker_id, c.dp_rank, now)
            if e is not None:
                engine[(c.worker_id, c.dp_rank)] = e
        block_size = answer["block_size"]
        prompt_tokens = len(parsed.token_ids)
        decision = decide(
            candidates,
            prompt_tokens=prompt_tokens,
            block_size=block_size,
            policy=parsed.policy.apply(self.policy) if parsed.policy is not None else self.policy,
            active=active,
            engine=engine,
            seed=seed,
            allowed=parsed.candidates,
        )
        if decision is None:
            if parsed.candidates is not None and offered:
                raise RouteError(
                    "no_workers", f"none of the candidates {parsed.candidates} serves {parsed.model!r}"
                )
            raise RouteError("no_workers", f"no worker serves model {parsed.model!r}")
        wall = time.time()
        lagging = mode == "degraded"
        states = {(c.worker_id, c.dp_rank): self.holder_state(c, ranks, lagging, wall) for c in candidates}
        w = decision.winner
        state, holder_why = states[(w.worker_id, w.dp_rank)]
        if mode == "exact" and state != "exact":
            mode = "degraded"
            mode_reason = f"the chosen holder {w.worker_id}/{w.dp_rank} is {state}: {holder_why}"
        self.modes[mode] = self.modes.get(mode, 0) + 1
        if parsed.request_id is not None:
            await self._account(parsed.request_id, decision, prompt_tokens, block_size)
        out = _reply(parsed, decision, answer, states)
        out["mode"] = mode
        if mode_reason is not None:
            out["degraded_reason"] = mode_reason
        if parsed.explain:
            out["selection"] = {
                "total": selection.total,
                "considered": len(selection.candidates),
                "cut": selection.cut,
                "bounded": selection.bounded,
                "skipped": [
                    {"worker_id": sw, "dp_rank": sr, "reason": f"stale: {sreason}"}
                    for sw, sr, sreason in selection.skipped
                ],
                "skipped_total": selection.skipped_total,
            }
        return out

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

    def _registered_block_size(self, model: str) -> int:
        """Block size the registry's workers of ``model`` report (0 when none does)."""
        if isinstance(self.registry, RegistryWatcher):
            for record in self.registry.workers.values():
                if record.model == model and record.block_size:
                    return record.block_size
        return 0

    async def _account(
        self, request_id: str, decision: Decision, prompt_tokens: int, block_size: int
    ) -> None:
        """Record the routed request locally and tell every replica (before the client hears back)."""
        assert self._nc is not None
        w = decision.winner
        event = Routed(
            request_id=request_id,
            worker_id=w.worker_id,
            dp_rank=w.dp_rank,
            prefill_tokens=max(prompt_tokens - w.overlap_tokens, 0),
            blocks=-(-prompt_tokens // max(block_size, 1)),
        )
        self.ledger.routed(event, self._clock())
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(
                subjects.requests_subject(self.settings.requests_prefix, "routed"), self._json.encode(event)
            )


def _match_overhead(parsed: RouteRequest) -> int:
    """An upper bound on the bytes of a match request besides its token ids."""
    strings = (parsed.model, parsed.lora_name or "", parsed.cache_salt or "")
    return 128 + sum(4 * len(x) for x in strings)


def _reply(
    parsed: RouteRequest,
    decision: Decision,
    answer: dict[str, Any],
    states: dict[tuple[str, int], tuple[str, str | None]],
) -> dict[str, Any]:
    w = decision.winner
    block_size = answer["block_size"]
    out: dict[str, Any] = {
        "request_id": parsed.request_id,
        "worker_id": w.worker_id,
        "dp_rank": w.dp_rank,
        "overlap_blocks": w.overlap_blocks,
        "cached_tokens": w.overlap_tokens,
        "block_size": block_size,
        "index_seq": answer["index_seq"],
    }
    if parsed.explain:
        out["scores"] = [
            _explain(s, block_size, states.get((s.worker_id, s.dp_rank), ("exact", None)))
            for s in decision.scores
        ]
    return out


def _explain(s: Any, block_size: int, state: tuple[str, str | None]) -> dict[str, Any]:
    e = s.engine
    load: dict[str, Any] = {
        "active_prefill_tokens": s.active.prefill_tokens,
        "active_blocks": s.active.blocks,
        "active_requests": s.active.requests,
    }
    if e is not None:
        for k in ("running", "waiting", "kv_usage", "prefix_hit_rate"):
            v = getattr(e, k)
            if v is not None:
                load[k] = v
    entry: dict[str, Any] = {
        "worker_id": s.worker_id,
        "dp_rank": s.dp_rank,
        "overlap_blocks": s.overlap_blocks,
        "cached_tokens": s.overlap_tokens,
        "cached_tokens_by_tier": dict(s.tier_tokens),
        "weighted_cached_tokens": s.cached_tokens,
        "cached_blocks": s.cached_blocks,
        "load": load,
        "prefill_blocks": s.prefill_blocks,
        "decode_blocks": s.decode_blocks,
        "busy": s.busy,
        "cost": s.cost,
        "health": {"state": state[0]} if state[1] is None else {"state": state[0], "reason": state[1]},
    }
    if s.probability is not None:
        entry["probability"] = s.probability
    return entry
