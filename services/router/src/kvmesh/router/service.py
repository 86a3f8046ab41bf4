"""The router service: ``kvmesh.route`` requests → indexer match → choice → JSON reply.

A NATS micro service (``kvmesh-router``, queue group ``kvmesh-router``) with one endpoint, ``route``. Every
error reply carries ``{"error": {"code", "message"}}`` and the NATS service-error headers
(``Nats-Service-Error``: ``"<code>: <message>"``; ``Nats-Service-Error-Code``: 400/404/503/500).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, ServiceConfig

from kvmesh.core.errors import RequestError
from kvmesh.core.route import ERROR_STATUS, Decision, decide, error_body, parse_route_request
from kvmesh.core.state import HolderMatch
from kvmesh.router.config import RouterSettings
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect

log = logging.getLogger("kvmesh.router")

VERSION = "0.1.0"


class RouteError(Exception):
    """An error reply of the route API (internal to this module)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RouterService:
    """One router replica."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self._stop = asyncio.Event()
        self._nc: Client | None = None
        self._enc = msgspec.msgpack.Encoder()
        self._json = msgspec.json.Encoder()
        self.ready = asyncio.Event()
        self.routed = 0
        self.errors: dict[str, int] = {}

    async def run(self) -> None:
        """Serve route requests until `stop()`."""
        s = self.settings
        self._nc = nc = await connect(s.nats_url, name="kvmesh-router")
        service = await add_service(
            nc,
            ServiceConfig(
                name="kvmesh-router",
                version=VERSION,
                description="kvmesh KV-cache-aware router",
                queue_group=subjects.ROUTER_QUEUE,
            ),
        )
        await service.add_endpoint(
            EndpointConfig(name="route", subject=s.route_subject, handler=self._on_route)
        )
        self.ready.set()
        log.info("router: serving %s (indexers on %s)", s.route_subject, s.match_subject)
        try:
            await self._stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await service.stop()
            with contextlib.suppress(Exception):
                await nc.drain()

    def stop(self) -> None:
        """Ask `run()` to finish."""
        self._stop.set()

    async def _on_route(self, req: Request) -> None:
        request_id: str | None = None
        try:
            try:
                parsed = parse_route_request(req.data, max_tokens=self.settings.max_tokens)
            except RequestError as exc:
                raise RouteError("bad_request", str(exc)) from exc
            request_id = parsed.request_id
            reply = await self._route(parsed)
        except RouteError as exc:
            self.errors[exc.code] = self.errors.get(exc.code, 0) + 1
            body = error_body(exc.code, exc.message)
            if request_id is not None:
                body["request_id"] = request_id
            log.info("route %s: %s: %s", request_id or "-", exc.code, exc.message)
            await req.respond_error(
                str(ERROR_STATUS[exc.code]), f"{exc.code}: {exc.message}", self._json.encode(body)
            )
            return
        except Exception as exc:
            log.exception("route %s: internal error", request_id or "-")
            self.errors["internal"] = self.errors.get("internal", 0) + 1
            await req.respond_error(
                "500", f"internal: {exc}", self._json.encode(error_body("internal", str(exc)))
            )
            return
        self.routed += 1
        await req.respond(self._json.encode(reply))

    async def _route(self, parsed: Any) -> dict[str, Any]:
        assert self._nc is not None
        query = self._enc.encode(
            {
                "model": parsed.model,
                "token_ids": parsed.token_ids,
                "lora_name": parsed.lora_name,
                "cache_salt": parsed.cache_salt,
            }
        )
        try:
            msg = await self._nc.request(
                self.settings.match_subject, query, timeout=self.settings.match_timeout_s
            )
        except nats.errors.NoRespondersError as exc:
            raise RouteError("unavailable", "no indexer is ready to answer") from exc
        except (TimeoutError, nats.errors.TimeoutError) as exc:
            raise RouteError(
                "unavailable", f"no indexer answered within {self.settings.match_timeout_s:g} s"
            ) from exc
        answer = msgspec.msgpack.decode(msg.data)
        if "error" in answer:
            code = answer["error"].get("code", "internal")
            raise RouteError(code if code in ERROR_STATUS else "internal", answer["error"].get("message", ""))
        candidates = [
            HolderMatch(worker_id=w, dp_rank=r, overlap_blocks=o, cached_blocks=c)
            for w, r, o, c in answer["candidates"]
        ]
        decision = decide(candidates, prompt_blocks=answer["prompt_blocks"], allowed=parsed.candidates)
        if decision is None:
            if parsed.candidates is not None and candidates:
                raise RouteError(
                    "no_workers", f"none of the candidates {parsed.candidates} serves {parsed.model!r}"
                )
            raise RouteError("no_workers", f"no worker serves model {parsed.model!r}")
        return _reply(parsed, decision, answer)


def _reply(parsed: Any, decision: Decision, answer: dict[str, Any]) -> dict[str, Any]:
    w = decision.winner
    block_size = answer["block_size"]
    out: dict[str, Any] = {
        "request_id": parsed.request_id,
        "worker_id": w.worker_id,
        "dp_rank": w.dp_rank,
        "overlap_blocks": w.overlap_blocks,
        "cached_tokens": w.overlap_blocks * block_size,
        "block_size": block_size,
        "index_seq": answer["index_seq"],
    }
    if parsed.explain:
        out["scores"] = [
            {
                "worker_id": s.worker_id,
                "dp_rank": s.dp_rank,
                "overlap_blocks": s.overlap_blocks,
                "cached_tokens": s.overlap_blocks * block_size,
                "cached_blocks": s.cached_blocks,
                "load": {},
                "cost": s.cost,
            }
            for s in decision.scores
        ]
    return out
