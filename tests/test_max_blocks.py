"""``--max-blocks`` through the real pipeline: a flooding engine's BlockStored events against a bounded indexer
and a bounded router replica (real nats-server, real ZMQ publishers and ingests; the services run as tasks).

Engine ``s`` caches one 4-block prompt, then engine ``f`` stores 100 one-block prefixes without ever removing
one. With a bound of 64 blocks (slack 1) every message that takes a replica to 65 cuts the largest cache —
f's — by 2: 20 cuts at f's 61st, 63rd, … 99th block, 40 blocks evicted, 64 left, of them f's 60 newest and all
of s's. The indexer, the router's replica and a second indexer restored from the first one's snapshot agree
block for block, and keep agreeing as more floods in.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from tests.pipeline import Pipeline, eventually
from tests.test_ingest_faults import ANY, BS, T, clean_pipeline, snapshot, stored

import kvmesh.runtime.replica
from kvmesh.cli import replay_command
from kvmesh.ops.view import _blocks
from kvmesh.runtime.metrics import ReplicaView, replica_samples
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats, pytest.mark.e2e]

BOUND = 64


def flood_tokens(k: int) -> list[int]:
    """The tokens of f's ``k``-th one-block prefix (1-based)."""
    return list(range(10_000 + BS * k, 10_000 + BS * (k + 1)))


def figures(p: Pipeline, *indexers: Any) -> list[tuple[int, int, int, int]]:
    """(applied seq, blocks, evicted blocks, digest) of each indexer and of the router's replica."""
    assert p.router_service is not None and p.router_service.local is not None
    replica = p.router_service.local.replica
    assert replica is not None
    states = [ix.state for ix in indexers] + [replica.state]
    return [(s.applied_seq, s.block_total(), s.counters.evicted_blocks, s.digest()) for s in states]


async def test_a_flood_is_bounded_and_every_replica_drops_the_same_blocks(
    nats_url: str,
    uid: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger="kvmesh")
    monkeypatch.setattr(kvmesh.runtime.replica, "EVICTION_LOG_INTERVAL_S", 3600.0)  # one warning per replica
    s_pub, f_pub = EventPublisher(ANY, ANY), EventPublisher(ANY, ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            for worker, pub in (("s", s_pub), ("f", f_pub)):
                await p.start_ingest(worker, pub.endpoint, pub.replay_endpoint, block_size=BS)
                await pub.wait_for_subscribers(1)
            indexer = await p.start_indexer(max_blocks=BOUND)
            await p.start_router(max_blocks=BOUND)
            s_pub.publish([stored([1, 2, 3, 4], T)])
            assert await eventually(lambda: snapshot(p, [T]), lambda r: r == [{"s/0": 4, "f/0": 0}])
            for k in range(1, 101):
                f_pub.publish([stored([1000 + k], flood_tokens(k))])

            def settled(rows: list[tuple[int, int, int, int]]) -> bool:
                return len({r for r in rows}) == 1 and rows[0][1:3] == (BOUND, 40)

            rows = await eventually(lambda: asyncio.sleep(0, figures(p, indexer)), settled, timeout_s=30)
            assert rows[0][1:3] == (BOUND, 40)

            # s keeps its prompt; f keeps its 60 newest prefixes (41 … 100), not the 40 oldest.
            got = await snapshot(p, [T, flood_tokens(40), flood_tokens(41), flood_tokens(100)])
            assert got == [
                {"s/0": 4, "f/0": 0},
                {"s/0": 0, "f/0": 0},
                {"s/0": 0, "f/0": 1},
                {"s/0": 0, "f/0": 1},
            ]
            view = ReplicaView(
                state=indexer.state, stream_last_seq=0, lag_messages=0, lag_s=0.0, read_messages=0,
                decode_errors=0, apply_errors=0, rebuilds=0, resubscribes=0,
            )  # fmt: skip
            assert replica_samples("k", view, {})["k_evicted_blocks"] == [({}, 40.0)]
            status = indexer.status_message()
            assert (status.max_blocks, status.blocks, status.counters["evicted_blocks"]) == (BOUND, 64, 40)
            router_index = p.router_service.stats_message().index if p.router_service else None
            assert router_index is not None
            assert (router_index.max_blocks, router_index.blocks, router_index.evicted_blocks) == (
                BOUND,
                64,
                40,
            )

            # A second indexer restored from the first one's snapshot drops what the others drop from then on.
            await indexer.snapshot(force=True)
            second = await p.start_indexer(max_blocks=BOUND)
            assert second.state.block_total() == BOUND
            for k in range(101, 111):
                f_pub.publish([stored([1000 + k], flood_tokens(k))])

            def settled_again(rows: list[tuple[int, int, int, int]]) -> bool:
                return len({r for r in rows}) == 1 and rows[0][1:3] == (BOUND, 50)

            rows = await eventually(
                lambda: asyncio.sleep(0, figures(p, indexer, second)), settled_again, timeout_s=30
            )
            assert rows[0][1:3] == (BOUND, 50)
            # `kvmesh replay --max-blocks` rebuilds the same bounded index offline: the same digest.
            for args, same in (([], False), (["--max-blocks", str(BOUND)], True)):
                capsys.readouterr()
                argv = ["--nats-url", nats_url, "--stream", p.stream, "--events-prefix", p.prefix, *args]
                assert await asyncio.to_thread(replay_command, argv) == 0
                replayed = json.loads(capsys.readouterr().out)
                assert (replayed["digest"] == f"{indexer.state.digest():016x}") is same, replayed
            # Each replica said so: the bound at start, the first eviction with the sequence and count.
            said = [r.getMessage() for r in caplog.records]
            assert sum("index bounded at 64 blocks (--max-blocks)" in m for m in said) == 3, said
            # (each once: the first indexer, the router, and the second indexer at its first cut)
            assert sum("reached its bound of 64 blocks at stream seq" in m for m in said) == 3, said
            assert (await snapshot(p, [flood_tokens(50), flood_tokens(51)])) == [
                {"s/0": 0, "f/0": 0},
                {"s/0": 0, "f/0": 1},
            ]
    finally:
        s_pub.close()
        f_pub.close()


def test_status_shows_the_bound_and_the_evictions() -> None:
    assert (_blocks(64, 64, 40), _blocks(12, 64, 0), _blocks(12, None, 0)) == (
        "64 of 64, 40 evicted",
        "12 of 64",
        "12",
    )
