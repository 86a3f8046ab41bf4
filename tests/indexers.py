"""Helpers for the recovery and replica tests: a stream fed directly, replicas in-process or as processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvmesh.core import protocol
from kvmesh.core.events import EventsMessage, Stored, encode_message
from kvmesh.core.index import Holder
from kvmesh.core.protocol import IndexerStatus, MatchReply, MatchRequest
from kvmesh.indexer.config import IndexerSettings
from kvmesh.indexer.service import IndexerService
from kvmesh.ops import gather
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import StreamSettings, connect, ensure_stream

MODEL = "m"
BS = 4


@dataclass
class Group:
    """One index group of a test: its stream, buckets, a feeder and the replicas started."""

    url: str
    uid: str
    nc: Any = None
    js: Any = None
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    replicas: list[IndexerService] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    chains: dict[Holder, int | None] = field(default_factory=dict)
    engine_seqs: dict[Holder, int] = field(default_factory=dict)
    """Last engine sequence published per holder: each publish continues it (a repeat would be refused)."""
    log_dir: Path | None = None
    """Where spawned replicas write their logs (a test's ``tmp_path``); None discards them."""
    memory: bool = True
    """Memory storage for the stream and buckets (False: file storage, as in production)."""
    replicas_n: int = 1
    """Stream and bucket replicas (3 on a cluster)."""

    @property
    def stream(self) -> str:
        return f"KVMESH_R_{self.uid}"

    @property
    def prefix(self) -> str:
        return f"r{self.uid}.events"

    def settings(self, replica: str, **kw: Any) -> IndexerSettings:
        return IndexerSettings(
            nats_url=kw.pop("nats_url", self.url),
            stream=self.stream,
            events_prefix=self.prefix,
            match_subject=kw.pop("match_subject", f"r{self.uid}.match"),
            replica_id=replica,
            buckets_memory=self.memory,
            buckets_replicas=self.replicas_n,
            buckets_max_bytes=16 * 2**20,
            snapshot_every_messages=kw.pop("snapshot_every_messages", 0),
            snapshot_every_s=kw.pop("snapshot_every_s", 0.0),
            **kw,
        )

    def args(self, replica: str, **kw: Any) -> list[str]:
        s = self.settings(replica, **kw)
        out = []
        for name in (
            "nats_url",
            "stream",
            "events_prefix",
            "match_subject",
            "replica_id",
            "buckets_max_bytes",
            "snapshot_every_messages",
            "snapshot_every_s",
            "lease_ttl_s",
            "worker_ttl_s",
            "buckets_replicas",
        ):
            out += [f"--{name.replace('_', '-')}", str(getattr(s, name))]
        return [*out, "--buckets-memory"] if s.buckets_memory else out

    async def start(self, replica: str, **kw: Any) -> IndexerService:
        svc = IndexerService(self.settings(replica, **kw))
        self.replicas.append(svc)
        self.tasks.append(asyncio.create_task(svc.run()))
        await asyncio.wait_for(svc.ready.wait(), 15)
        return svc

    async def stop_replica(self, svc: IndexerService) -> None:
        svc.stop()
        task = self.tasks[self.replicas.index(svc)]
        await asyncio.wait_for(task, 10)

    def spawn(self, replica: str, **kw: Any) -> subprocess.Popen[bytes]:
        if self.log_dir is None:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvmesh.indexer", *self.args(replica, **kw)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            with (self.log_dir / f"{replica}.log").open("ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "kvmesh.indexer", *self.args(replica, **kw)],
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
        self.procs.append(proc)
        return proc

    async def publish(self, n: int, workers: int = 4, blocks: int = 4, ts: float = 0.0) -> int:
        """Publish ``n`` batches of ``blocks`` stored blocks round-robin over workers; return the last seq.

        Each batch carries engine timestamp ``ts`` (0: none).
        """
        ack: Any = None
        for i in range(n):
            w = f"w{i % workers}"
            holder = Holder(w, 0)
            parent = self.chains.get(holder) if i % 5 else None
            engine = [self.rng.getrandbits(63) for _ in range(blocks)]
            local = [self.rng.getrandbits(64) for _ in range(blocks)]
            msg = EventsMessage(
                worker_id=w,
                dp_rank=0,
                model=MODEL,
                block_size=BS,
                epoch=0,
                seq=self.engine_seqs.get(holder, -1) + 1,
                ts=ts,
                events=[Stored(engine, parent, local)],
            )
            self.chains[holder] = engine[-1]
            self.engine_seqs[holder] = msg.seq
            ack = await self.js.publish(
                subjects.events_subject(self.prefix, MODEL, w, 0), encode_message(msg), stream=self.stream
            )
        return int(ack.seq) if ack is not None else 0

    async def status(self, wait_s: float = 0.5) -> dict[str, IndexerStatus]:
        """Collect every replica's status reply, by replica id (only this group's replicas)."""
        got = await gather(self.nc, subjects.STATUS_SUBJECT, IndexerStatus, wait_s)
        return {r.replica: r for r in got.replies if r.replica.startswith(self.uid)}

    async def match(self, subject: str, tokens: list[int]) -> MatchReply:
        """Ask the indexer on ``subject`` for ``tokens``' holders; the reply with its ``replica`` blanked (so
        two replicas' answers compare equal). An error reply raises its `kvmesh.core.errors.RouteError`."""
        request = protocol.encode(MatchRequest(model=MODEL, token_ids=tokens), format="msgpack")
        reply = await self.nc.request(subject, request, timeout=3)
        answer = protocol.decode_answer(reply.data, MatchReply, format="msgpack")
        return msgspec.structs.replace(answer, replica="")


async def wait_for(probe: Any, check: Any, timeout_s: float = 15.0) -> Any:
    """Await ``probe()`` until ``check`` accepts it; fail with the last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = None
    while loop.time() < deadline:
        with contextlib.suppress(Exception):
            last = await probe()
            if check(last):
                return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"not reached in {timeout_s} s; last: {json.dumps(last, default=str)[:2000]}")


@contextlib.asynccontextmanager
async def group(
    url: str, uid: str, *, log_dir: Path | None = None, memory: bool = True, replicas: int = 1
) -> AsyncIterator[Group]:
    """Yield a `Group` with its stream created; stop its replicas and delete its stream and buckets on exit."""
    g = Group(url, uid, log_dir=log_dir, memory=memory, replicas_n=replicas)
    g.nc = await connect(url, name="test-feeder")
    g.js = g.nc.jetstream()
    await ensure_stream(
        g.js,
        StreamSettings(
            name=g.stream, prefix=g.prefix, memory=memory, max_bytes=16 * 2**20, replicas=replicas
        ),
    )
    try:
        yield g
    finally:
        for svc in g.replicas:
            svc.stop()
        for t in g.tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 10)
        for p in g.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for name in (
            g.stream,
            f"OBJ_{subjects.snapshot_bucket(g.stream)}",
            f"KV_{subjects.lease_bucket(g.stream)}",
            f"KV_{subjects.registry_bucket(g.stream)}",
        ):
            with contextlib.suppress(Exception):
                await g.js.delete_stream(name)
        await g.nc.close()
