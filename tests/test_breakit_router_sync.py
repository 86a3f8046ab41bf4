"""Break-it regressions for the start-up sync of a router replica (ledger, sessions, predicted caches), each
failing before its fix: real router services on a real nats-server, and fake peers (plain NATS connections
answering on the sync subject) where a peer must misbehave in a set order."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from tests.test_router import fleet
from tests.test_router_predicted import Clock, P, start

from kvmesh.core.index import Holder
from kvmesh.core.protocol import (
    SYNC_FROM_HEADER,
    SYNC_PARTS_HEADER,
    LedgerEntry,
    LedgerSnapshot,
    PredictedCache,
    PredictedSnapshot,
    SessionEntry,
    encode,
)
from kvmesh.runtime.nats import connect

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def test_a_large_predicted_cache_does_not_delay_the_ledger_past_the_sync_timeout(
    nats_url: str, uid: str, caplog: Any
) -> None:
    """A peer used to build every predicted part before it sent the `LedgerSnapshot`: with a large cache (here
    1,000,000 entries; 4,000,000 in real processes took 0.53 s, past the default 0.5 s timeout) the first
    message came after the asker's timeout, and the asker lost the in-flight requests and sessions too,
    silently. Now the ledger goes first, at once, and the parts still missing at the timeout are logged."""
    caplog.set_level(logging.WARNING, logger="kvmesh.router")
    async with fleet(nats_url, uid) as f:
        clock = Clock()
        r0 = await start(f, clock, predicted_ttl_s=600.0)
        r0.notes.predictions.ttl.add(Holder("a", 0), range(1 << 63, (1 << 63) + 1_000_000), clock.now)  # type: ignore[union-attr]
        await f.client(0).route("m", P, request_id="r-1", session_id="s-1")
        late = await start(f, clock, predicted_ttl_s=600.0, sync_timeout_s=0.05)
        assert (late.notes.synced_requests, late.notes.synced_sessions) == (1, 1)
        assert any("accounting sync got" in r.getMessage() for r in caplog.records)


def _snap(request_id: str) -> bytes:
    return encode(
        LedgerSnapshot(
            entries=[
                LedgerEntry(
                    request_id=request_id, worker_id="a", dp_rank=0, prefill_tokens=8, blocks=1, age_s=0.1
                )
            ],
            sessions=[SessionEntry(session_id="s-1", worker_id="a", dp_rank=0, idle_s=0.1)],
        ),
        format="msgpack",
    )


async def _peer(nc: Any, subject: str, messages: list[tuple[bytes, dict[str, str]]], delay_s: float) -> None:
    """A peer answering every sync request with ``messages`` after ``delay_s``."""

    async def on(msg: Any) -> None:
        await asyncio.sleep(delay_s)
        for data, headers in messages:
            await nc.publish(msg.reply, data, headers=headers)
        await nc.flush()

    await nc.subscribe(subject, cb=on)
    await nc.flush()


@pytest.mark.parametrize(
    "first",
    [
        pytest.param([(b"\xc1", {SYNC_FROM_HEADER: "bad", SYNC_PARTS_HEADER: "1"})], id="undecodable"),
        pytest.param(
            [(_snap("r-0"), {SYNC_FROM_HEADER: "bad", SYNC_PARTS_HEADER: "3"})], id="stalled-after-1-of-3"
        ),
    ],
)
async def test_a_broken_first_answer_does_not_hide_a_good_one(
    nats_url: str, uid: str, first: list[tuple[bytes, dict[str, str]]]
) -> None:
    """Two peers answer; the first one's answer is undecodable, or stops after 1 of its 3 parts (a peer
    SIGSTOPped or SIGKILLed while sending). The second peer's complete answer (r-1) arrives 0.1 s later,
    within the sync timeout: the asker takes it (it used to commit to the first peer and discard it)."""
    async with fleet(nats_url, uid) as f:
        bad = await connect(nats_url, name="bad-peer")
        good = await connect(nats_url, name="good-peer")
        try:
            sync = f"t{uid}.requests.sync"
            await _peer(bad, sync, first, 0.0)
            await _peer(good, sync, [(_snap("r-1"), {SYNC_FROM_HEADER: "good", SYNC_PARTS_HEADER: "1"})], 0.1)
            late = await start(f, Clock(), sync_timeout_s=2.0)
            assert [e.request_id for e in late.notes.ledger.snapshot(1000.0).entries] == ["r-1"]
        finally:
            await bad.close()
            await good.close()


async def test_one_undecodable_predicted_part_loses_only_that_part(nats_url: str, uid: str) -> None:
    """A peer's `LedgerSnapshot` decodes but one of its `PredictedSnapshot` parts does not (a float key): only
    that part is skipped (the asker used to drop the whole answer, in-flight requests, sessions and the other
    parts' predicted caches included)."""
    import msgspec

    async with fleet(nats_url, uid) as f:
        peer = await connect(nats_url, name="peer")
        try:
            ok = encode(
                PredictedSnapshot(
                    caches=[
                        PredictedCache(
                            worker_id="a", dp_rank=0, kind="ttl", keys=[5, 6], remaining_s=[3.0, 3.0]
                        )
                    ]
                ),
                format="msgpack",
            )
            bad = msgspec.msgpack.encode({"caches": [["a", 0, "ttl", [1.5], [3.0], None]]})
            await _peer(
                peer,
                f"t{uid}.requests.sync",
                [
                    (_snap("r-1"), {SYNC_FROM_HEADER: "p", SYNC_PARTS_HEADER: "3"}),
                    (ok, {SYNC_FROM_HEADER: "p"}),
                    (bad, {SYNC_FROM_HEADER: "p"}),
                ],
                0.0,
            )
            late = await start(f, Clock(), predicted_ttl_s=5.0)
            assert (late.notes.synced_requests, late.notes.synced_sessions, late.notes.synced_predicted) == (
                1,
                1,
                2,
            )
        finally:
            await peer.close()


def test_parts_stay_within_the_limit_and_carry_the_newest_entries_first() -> None:
    """`plan_parts` from counts alone: every encoded part fits, each holder's newest keys go in the first
    part, consecutive slices cover each cache exactly once, and a small ``max_payload`` gives no empty
    parts (it used to send empty ones)."""
    from kvmesh.router.sync import plan_parts, slice_cache

    caches = [
        PredictedCache(
            worker_id="w" * 40, dp_rank=0, kind="no_events", keys=list(range(2**63, 2**63 + 5000))
        ),
        PredictedCache(
            worker_id="v", dp_rank=1, kind="ttl", keys=list(range(1, 301)), remaining_s=[1.5] * 300
        ),
        PredictedCache(worker_id="u", dp_rank=0, kind="no_events", keys=[7]),
    ]
    sizes = [(c.worker_id, len(c.keys), c.remaining_s is not None) for c in caches]
    for limit in (4096, 65_536, 512):
        plan = plan_parts(sizes, limit)
        assert all(plan)
        seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for slices in plan:
            part = PredictedSnapshot(caches=[slice_cache(caches[i], a, b) for i, a, b in slices])
            assert len(encode(part, format="msgpack")) <= limit
            for i, a, b in slices:
                seen[i] = list(range(a, b)) + seen[i]  # newest first: each slice is older than the last
        assert seen == {i: list(range(len(c.keys))) for i, c in enumerate(caches)}
        first = {i: b for i, _a, b in plan[0]}
        assert first[0] == 5000  # the first part starts with the first cache's newest key
    assert len(plan_parts(sizes, 65_536)) == 1  # 5,000 × 9 + 300 × 18 bytes: one part
    assert len(plan_parts(sizes, 4096)) == 13
    assert plan_parts([], 4096) == []
