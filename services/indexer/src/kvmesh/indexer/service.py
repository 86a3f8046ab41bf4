"""The indexer service: stream → `IndexState` → match queries over NATS request-reply.

Reads the events stream from its start with an ordered push consumer (no durable consumer, so nothing is
orphaned when a replica goes away), applies every message in stream order, and joins the match queue group
only once it has caught up with the stream's last sequence as of its start — a replica that is behind never
answers. Match and status endpoints are a NATS micro service (``kvmesh-indexer``), so ``$SRV.PING``,
``$SRV.INFO`` and ``$SRV.STATS`` discover it.

Match protocol (msgpack): request ``{"model", "token_ids", "lora_name", "cache_salt"}``; reply
``{"index_seq", "block_size", "prompt_blocks", "candidates": [[worker_id, dp_rank, overlap_blocks,
cached_blocks], ...]}`` or ``{"error": {"code", "message"}}`` with codes ``bad_request`` and
``unknown_model``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, ServiceConfig

from kvmesh.core.errors import MessageDecodeError, RequestError
from kvmesh.core.events import decode_message
from kvmesh.core.state import IndexState, UnknownModelError
from kvmesh.indexer.config import IndexerSettings
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect, wait_for_stream

log = logging.getLogger("kvmesh.indexer")

VERSION = "0.1.0"


class MatchRequest(msgspec.Struct, kw_only=True):
    """A match query from a router."""

    model: str
    token_ids: list[int]
    lora_name: str | None = None
    cache_salt: str | None = None


class IndexerService:
    """One indexer replica."""

    def __init__(self, settings: IndexerSettings) -> None:
        self.settings = settings
        self.state = IndexState()
        self.replica = settings.replica_name()
        self.ready = asyncio.Event()
        self.decode_errors = 0
        self.apply_errors = 0
        self._stop = asyncio.Event()
        self._nc: Client | None = None
        self._target_seq = 0
        self._caught_up = asyncio.Event()
        self._stream_last_seq = 0
        self._started = time.monotonic()
        self._decoder = msgspec.msgpack.Decoder(MatchRequest)
        self._encoder = msgspec.msgpack.Encoder()

    async def run(self) -> None:
        """Catch up with the stream, then serve match queries until `stop()`."""
        s = self.settings
        self._nc = nc = await connect(s.nats_url, name=f"kvmesh-indexer-{self.replica}")
        js = nc.jetstream()
        await wait_for_stream(js, s.stream, stop=self._stop)
        if self._stop.is_set():
            await nc.drain()
            return
        info = await js.stream_info(s.stream)
        self._target_seq = info.state.last_seq
        log.info(
            "indexer %s: reading %s (%d messages, last seq %d)",
            self.replica,
            s.stream,
            info.state.messages,
            info.state.last_seq,
        )
        sub = await js.subscribe(
            subjects.events_wildcard(s.events_prefix),
            stream=s.stream,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
        )
        consume = asyncio.create_task(self._consume(sub))
        service = None
        try:
            await self._wait_caught_up()
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
            status_sub = await nc.subscribe(subjects.STATUS_SUBJECT, cb=self._on_status)
            self.ready.set()
            log.info(
                "indexer %s: ready at stream seq %d (%d blocks) after %.2f s",
                self.replica,
                self.state.applied_seq,
                self.state.block_total(),
                time.monotonic() - self._started,
            )
            stop_wait = asyncio.create_task(self._stop.wait())
            await asyncio.wait({consume, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            stop_wait.cancel()
            if consume.done() and not self._stop.is_set():
                consume.result()
            with contextlib.suppress(Exception):
                await status_sub.unsubscribe()
        finally:
            consume.cancel()
            await asyncio.gather(consume, return_exceptions=True)
            if service is not None:
                with contextlib.suppress(Exception):
                    await service.stop()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await nc.drain()

    def stop(self) -> None:
        """Ask `run()` to finish."""
        self._stop.set()

    async def _wait_caught_up(self) -> None:
        """Return once the consumer applied the stream's last sequence as of start-up (or on stop)."""
        if self.state.applied_seq >= self._target_seq:
            return
        stop_wait = asyncio.create_task(self._stop.wait())
        caught = asyncio.create_task(self._caught_up.wait())
        await asyncio.wait({stop_wait, caught}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        caught.cancel()

    async def _consume(self, sub: Any) -> None:
        state = self.state
        async for msg in sub.messages:
            seq = msg.metadata.sequence.stream
            if seq >= self._target_seq:
                # Waiters wake only at our next await, after this message has been applied below.
                self._caught_up.set()
            try:
                message = decode_message(msg.data)
            except MessageDecodeError as exc:
                self.decode_errors += 1
                state.applied_seq = max(state.applied_seq, seq)
                log.warning(
                    "indexer %s: stream seq %d (%s) undecodable, skipped: %s",
                    self.replica,
                    seq,
                    msg.subject,
                    exc,
                )
                continue
            try:
                state.apply(seq, message)
            except Exception:
                self.apply_errors += 1
                state.applied_seq = max(state.applied_seq, seq)
                log.exception(
                    "indexer %s: stream seq %d (%s) failed to apply, skipped", self.replica, seq, msg.subject
                )

    # ------------------------------------------------------------------ endpoints

    async def _on_match(self, req: Request) -> None:
        try:
            query = self._decoder.decode(req.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self._error(req, "bad_request", f"bad match request: {exc}", 400)
            return
        try:
            result = self.state.match(
                query.model, query.token_ids, lora_name=query.lora_name, cache_salt=query.cache_salt
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
                        [c.worker_id, c.dp_rank, c.overlap_blocks, c.cached_blocks] for c in result.candidates
                    ],
                }
            )
        )

    async def _error(self, req: Request, code: str, message: str, status: int) -> None:
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
            "ready": self.ready.is_set(),
            "applied_seq": st.applied_seq,
            "blocks": st.block_total(),
            "digest": f"{st.digest():016x}",
            "models": st.models(),
            "counters": asdict(st.counters)
            | {"decode_errors": self.decode_errors, "apply_errors": self.apply_errors},
            "workers": st.workers(),
        }

    async def _on_status(self, msg: Any) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(msgspec.json.encode(self.status()))
