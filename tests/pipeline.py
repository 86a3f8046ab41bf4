"""An in-process kvmesh for tests: real ZMQ sockets, a real NATS server, the real services as tasks.

Each `Pipeline` uses its own stream, subject prefix and route/match subjects, so tests share one server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from kvmesh.client import RouteError, Router, RouteReply
from kvmesh.indexer.config import IndexerSettings
from kvmesh.indexer.service import IndexerService
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.service import IngestService
from kvmesh.router.config import RouterSettings
from kvmesh.router.service import RouterService
from kvmesh.runtime.nats import connect

T = TypeVar("T")


@dataclass
class Pipeline:
    """Handles on the running services of one test."""

    nats_url: str
    uid: str
    model: str = "test-model"
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    ingests: dict[str, IngestService] = field(default_factory=dict)
    indexer: IndexerService | None = None
    router_service: RouterService | None = None
    router: Router | None = None
    stream_memory: bool = True
    """Memory storage for the stream and the registry bucket the ingests create (False: they must survive a
    server restart)."""
    _nc: Any = None

    @property
    def stream(self) -> str:
        return f"KVMESH_T_{self.uid}"

    @property
    def prefix(self) -> str:
        return f"t{self.uid}.events"

    @property
    def route_subject(self) -> str:
        return f"t{self.uid}.route"

    @property
    def match_subject(self) -> str:
        return f"t{self.uid}.match"

    async def start_ingest(
        self, worker_id: str, endpoint: str, replay: str | None = None, **kw: Any
    ) -> IngestService:
        settings = IngestSettings(
            worker_id=worker_id,
            model=kw.pop("model", self.model),
            zmq_endpoint=endpoint,
            replay_endpoint=replay,
            nats_url=self.nats_url,
            stream=self.stream,
            events_prefix=self.prefix,
            stream_memory=self.stream_memory,
            stream_max_bytes=64 * 2**20,
            # One stream message per engine batch keeps message counts exact in tests; coalescing is
            # tested on its own.
            max_coalesced_batches=kw.pop("max_coalesced_batches", 1),
            **kw,
        )
        svc = IngestService(settings)
        self.ingests[worker_id] = svc
        self.tasks.append(asyncio.create_task(svc.run()))
        await asyncio.wait_for(svc.ready.wait(), 10)
        return svc

    async def start_indexer(self, **kw: Any) -> IndexerService:
        svc = IndexerService(
            IndexerSettings(
                nats_url=self.nats_url,
                stream=self.stream,
                events_prefix=self.prefix,
                match_subject=self.match_subject,
                replica_id=f"replica-{len(self.tasks)}",
                **kw,
            )
        )
        self.indexer = svc
        self.tasks.append(asyncio.create_task(svc.run()))
        await asyncio.wait_for(svc.ready.wait(), 10)
        return svc

    async def start_router(self, index: str = "local", **kw: Any) -> Router:
        svc = RouterService(
            RouterSettings(
                nats_url=self.nats_url,
                route_subject=self.route_subject,
                match_subject=self.match_subject,
                index=index,
                stream=self.stream,
                events_prefix=self.prefix,
                **kw,
            )
        )
        self.router_service = svc
        self.tasks.append(asyncio.create_task(svc.run()))
        await asyncio.wait_for(svc.ready.wait(), 10)
        self._nc = await connect(self.nats_url, name="test-client")
        self.router = Router(self._nc, subject=self.route_subject, timeout_s=3.0)
        return self.router

    async def route(self, tokens: list[int], **kw: Any) -> RouteReply:
        assert self.router is not None
        return await self.router.route(kw.pop("model", self.model), tokens, **kw)

    async def stop(self) -> None:
        for svc in [*self.ingests.values(), self.indexer, self.router_service]:
            if svc is not None:
                svc.stop()
        for t in self.tasks:
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(t, 10)
        if self._nc is not None:
            await self._nc.close()
        # Memory streams reserve their max_bytes on the shared server: delete ours.
        nc = await connect(self.nats_url, name="test-cleanup")
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_stream(self.stream)
        await nc.close()


@contextlib.asynccontextmanager
async def pipeline(nats_url: str, uid: str) -> AsyncIterator[Pipeline]:
    """Yield a `Pipeline`; stop every service it started on exit."""
    p = Pipeline(nats_url, uid)
    try:
        yield p
    finally:
        await p.stop()


async def eventually(
    probe: Callable[[], Awaitable[T]], check: Callable[[T], bool], *, timeout_s: float = 10.0
) -> T:
    """Call ``probe`` until ``check`` accepts its result; return that result or fail with the last one seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: Any = None
    while True:
        try:
            last = await probe()
            if check(last):
                return cast(T, last)
        except RouteError as exc:
            last = exc
        if loop.time() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s; last value: {last!r}")
        await asyncio.sleep(0.05)


def overlaps(reply: RouteReply) -> dict[str, int]:
    """Map ``worker_id/dp_rank`` → overlap_blocks from an explained reply."""
    assert reply.scores is not None
    return {f"{s.worker_id}/{s.dp_rank}": s.overlap_blocks for s in reply.scores}
