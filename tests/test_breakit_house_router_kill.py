"""A router process killed with SIGKILL while requests are in flight: the other replica keeps answering, and a
router process started again syncs the in-flight requests from it (real nats-server, real processes)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from tests.pipeline import eventually
from tests.test_ingest_faults import BS, T, clean_pipeline, expect, stored

from kvmesh.client import Router, UnavailableError
from kvmesh.core.protocol import MicroServiceStats, RouterStats, decode
from kvmesh.runtime.nats import connect
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

MODEL = "test-model"


def spawn_router(
    nats_url: str, route_subject: str, stream: str, prefix: str, log: Path
) -> subprocess.Popen[bytes]:
    """A router process with a local index of ``stream``, logging to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvmesh.router",
                f"--nats-url={nats_url}",
                f"--route-subject={route_subject}",
                f"--stream={stream}",
                f"--events-prefix={prefix}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=out,
        )


async def test_a_router_killed_with_requests_in_flight_leaves_the_other_serving_and_its_restart_syncs(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    """Routes sent while one of two router replicas is SIGKILLed are each answered or unavailable (nothing
    else); afterwards every route is answered with the exact overlap, and a router process started again
    holds the survivor's 20 in-flight requests once the survivor stops."""
    pub = EventPublisher("tcp://127.0.0.1:*", None)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await p.start_ingest("w", pub.endpoint, None, block_size=BS)
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            pub.publish([stored([1, 2, 3, 4], T)])
            log = tmp_path / "router.log"
            procs.append(spawn_router(nats_url, p.route_subject, p.stream, p.prefix, log))
            nc = await connect(nats_url, name="test-router-kill")
            client = Router(nc, subject=p.route_subject, timeout_s=2.0)
            try:
                first = await eventually(
                    lambda: client.route(MODEL, T), lambda r: r.overlap_blocks == 4, timeout_s=40
                )
                assert (first.worker_id, first.dp_rank) == ("w", 0)
                for i in range(20):  # in flight on the process replica (never finished)
                    await client.route(MODEL, T, request_id=f"r{i}")
                survivor = await p.start_router()  # syncs the 20 from the process replica
                assert p.router_service is not None
                svc = p.router_service
                assert svc.ledger.stats().active == 20
                await expect(p, [T], [{"w/0": 4}])

                async def one(i: int) -> str:
                    try:
                        reply = await client.route(MODEL, T)
                    except UnavailableError:
                        return "unavailable"
                    return f"{reply.worker_id}/{reply.dp_rank}:{reply.overlap_blocks}"

                burst = [asyncio.create_task(one(i)) for i in range(60)]
                await asyncio.sleep(0.01)
                procs[0].kill()  # SIGKILL with routes in flight
                procs[0].wait()
                outcomes = await asyncio.gather(*burst)
                assert set(outcomes) <= {"w/0:4", "unavailable"}, outcomes
                after = [await one(i) for i in range(20)]
                assert after == ["w/0:4"] * 20
                assert (await survivor.route(MODEL, T)).overlap_blocks == 4

                procs.append(spawn_router(nats_url, p.route_subject, p.stream, p.prefix, log))
                await eventually(
                    lambda: asyncio.sleep(0, log.read_text().count("router: serving")),
                    lambda n: n == 2,
                    timeout_s=40,
                )
                svc.stop()
                await asyncio.wait_for(p.tasks[-1], 15)
                msg = await nc.request("$SRV.STATS.kvmesh-router", b"", timeout=5)
                stats = decode(decode(msg.data, MicroServiceStats).endpoints[0].data, RouterStats)
                assert stats.in_flight == 20
                assert (await client.route(MODEL, T)).overlap_blocks == 4
            finally:
                await nc.close()
            assert "Traceback" not in log.read_text()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        pub.close()
