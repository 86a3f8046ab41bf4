"""An indexer process SIGKILLed while it writes a requested snapshot restarts ready and equal to a live replica
(real nats-server, the real indexer as a process and in-process)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from tests.indexers import group, wait_for

from kvmesh.runtime import subjects

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

SPAWN_S = 40.0
PROMPT = list(range(64))


async def test_an_indexer_killed_during_snapshots_restarts_equal_to_a_live_replica(
    nats_url: str, uid: str, tmp_path: Path
) -> None:
    """Killed 0, 20 and 60 ms after a snapshot was asked of it, the writer replica restarts each time, reads
    the stream to its last sequence and matches the live replica's digest and blocks; no traceback is logged."""
    async with group(nats_url, uid, log_dir=tmp_path) as g:
        kw = {"match_subject": f"r{uid}.proc"}
        name = f"{uid}-proc"
        proc = g.spawn(name, **kw)
        await wait_for(g.status, lambda s: name in s and s[name].snapshot_writer, timeout_s=SPAWN_S)
        live = await g.start(f"{uid}-live", match_subject=f"r{uid}.live")
        last = await g.publish(1500, workers=8, blocks=16)
        for delay_s in (0.0, 0.02, 0.06):
            await wait_for(g.status, lambda s, last=last: s[name].applied_seq == last, timeout_s=SPAWN_S)
            asked = asyncio.create_task(
                g.nc.request(subjects.SNAPSHOT_SUBJECT, json.dumps({"stream": g.stream}).encode(), timeout=5)
            )
            await asyncio.sleep(delay_s)
            proc.kill()
            proc.wait()
            asked.cancel()
            last = await g.publish(50, workers=8, blocks=16)
            proc = g.spawn(name, **kw)
            st = await wait_for(
                g.status,
                lambda s, last=last: name in s and s[name].ready and s[name].applied_seq == last,
                timeout_s=SPAWN_S,
            )
            assert st[f"{uid}-live"].applied_seq == last
            assert st[name].digest == st[f"{uid}-live"].digest
            assert st[name].blocks == st[f"{uid}-live"].blocks == live.state.block_total()
            assert await g.match(f"r{uid}.proc", PROMPT) == await g.match(f"r{uid}.live", PROMPT)
        log = (tmp_path / f"{name}.log").read_text()
        assert "Traceback" not in log
