"""Salted SGLang chains under bad input: salts of hundreds of KiB, a salt that is not UTF-8.

A real SGLang-layout publisher (`kvmesh.sim.publisher.EventPublisher`), ingest, indexer and router on a real
nats-server.
"""

from __future__ import annotations

import asyncio

import pytest
from tests.pipeline import eventually
from tests.test_ingest_faults import T, U, V, W, blk, expect, started, stored

from kvmesh.core.wire import EngineBatch, encode_batch
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

ANY = "tcp://127.0.0.1:*"
P = list(range(500, 516))  # 4 blocks of 4 tokens
BIG = 128 * 1024
SALTS = 160


def big_salt(i: int) -> str:
    return f"{i:08d}" * (BIG // 8)


async def test_a_large_salted_chain_matches_on_both_events(nats_url: str, uid: str) -> None:
    """A salt of 128 KiB on a root event and its child: the salted prompt matches all 3 blocks, the unsalted
    one none, and nothing is counted as a mismatch."""
    pub = EventPublisher(ANY, ANY, producer="sglang", version="0.5.22")
    salt = big_salt(7)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([11, 12], blk(P, 0, 2), cache_salt=salt)])
        pub.publish([stored([13], blk(P, 2), parent=12, cache_salt=salt)])
        await expect(p, [P], [{"w/0": 3}], cache_salt=salt)
        await expect(p, [P], [{"w/0": 0}])
        (rank,) = p.ingests[W].status().ranks.values()
        assert rank.events["salt_mismatch"] == 0


async def test_the_salts_an_ingest_remembers_are_bounded_in_bytes(nats_url: str, uid: str) -> None:
    """160 salted conversations, each with its own 128 KiB salt (20 MiB of salts): once they are indexed the
    rank's normalizer holds digests of them, no salt text (it needs to tell salts apart, not to keep them)."""
    pub = EventPublisher(ANY, ANY, producer="sglang", version="0.5.22")
    async with started(nats_url, uid, {W: pub}) as p:
        for i in range(SALTS):
            pub.publish([stored([1000 + i], blk(P, 0), cache_salt=big_salt(i))])
        await eventually(
            lambda: asyncio.sleep(0, p.ingests[W].status().ranks["0"].sequence["delivered"]),
            lambda n: n == SALTS,
            timeout_s=30,
        )
        norm = p.ingests[W]._ranks[0].normalizer
        # each remembered salt is an 8-byte digest, not the text
        assert all(s is None or (type(s) is int and 0 <= s < 2**64) for s in norm.chain_salts.values())
        assert len(norm.chain_salts) == SALTS


async def test_a_salt_that_is_not_utf8_rejects_its_event_alone(nats_url: str, uid: str) -> None:
    """A batch of two events, U plain and V salted with bytes that are not UTF-8: V is rejected and counted,
    U indexes, and T (indexed before) is not cleared."""
    pub = EventPublisher(ANY, ANY, producer="sglang", version="0.5.22")
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        batch = EngineBatch(
            ts=1.0, events=(stored([11, 12], U), stored([21, 22], V, cache_salt="QQQQQQQQ")), dp_rank=0
        )
        payload = encode_batch(batch, producer="sglang", version="0.5.22")
        assert payload.count(b"QQQQQQQQ") == 1
        pub.publish_raw(payload.replace(b"QQQQQQQQ", b"\xff\xfe\xfd\xfc" * 2))
        await eventually(lambda: asyncio.sleep(0, p.ingests[W].counters.decode_errors), lambda n: n == 1)
        await expect(p, [T, U, V], [{"w/0": 2}, {"w/0": 2}, {"w/0": 0}])
