"""Predicted entries and workers without KV events through real router replicas on a real nats-server (a
stand-in indexer answers the match queries, as in tests/test_router.py; the registry is a real KV bucket
holding the records an ingest would heartbeat)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tests.test_router import Fleet, answer, fleet, until

from kvmesh.core.index import Holder
from kvmesh.core.protocol import MatchHolder, RouteRequest, WorkerRecord, error_reply
from kvmesh.router.predictions import prompt_keys_of
from kvmesh.router.service import RouterService
from kvmesh.runtime.registry import RegistrySettings, heartbeat, open_registry

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

BS = 16
P = list(range(80))  # 5 blocks
Q = list(range(1000, 1080))
R = list(range(2000, 2080))


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def start(f: Fleet, clock: Clock | None = None, **kw: Any) -> RouterService:
    """Start a replica of the fleet with extra settings (and a test clock)."""
    settings = f.settings(len(f.routers), **kw)
    svc = RouterService(settings) if clock is None else RouterService(settings, clock=clock)
    f.routers.append(svc)
    f.tasks.append(asyncio.create_task(svc.run()))
    await asyncio.wait_for(svc.ready.wait(), 10)
    return svc


async def test_predicted_entries_make_a_stale_index_see_the_last_route(nats_url: str, uid: str) -> None:
    """The index never learns of the prompt (its events are late); with --predicted-ttl-s the routers count
    it on the worker they sent it to, every replica alike, until the TTL passes."""
    async with fleet(nats_url, uid) as f:
        f.answer = lambda q: answer([MatchHolder("a", 0, 0, 0), MatchHolder("b", 0, 0, 0)])
        clock = Clock()
        r0 = await start(f, clock, predicted_ttl_s=2.0)
        r1 = await start(f, clock, predicted_ttl_s=2.0)
        off = await start(f, clock)
        first = await f.client(0).route("m", P)
        assert first.overlap_blocks == 0
        w = first.worker_id
        # a RouteNote (no request_id) carries the prompt's 5 keys to the other replicas
        await until(lambda: r1.notes.predictions.ttl is not None and len(r1.notes.predictions.ttl) == 5)
        assert r0.notes.predictions.ttl is not None and len(r0.notes.predictions.ttl) == 5
        assert (r0.stats_message().predicted_blocks, off.stats_message().predicted_blocks) == ({"ttl": 5}, {})
        for i in (0, 1):
            again = await f.client(i).route("m", P, explain=True)
            assert (again.worker_id, again.overlap_blocks, again.cached_tokens) == (w, 5, 80)
        # a longer prompt sharing the first 3 blocks
        longer = await f.client(1).route("m", P[:48] + Q)
        assert (longer.worker_id, longer.overlap_blocks) == (w, 3)
        # a replica without predicted entries sees what the index says
        assert (await f.client(2).route("m", P)).overlap_blocks == 0
        assert off.notes.predictions.ttl is None and len(off.notes.predictions.approx) == 0
        # routed notes carry the keys too, and the TTL ends them
        rid = await f.client(0).route("m", R, request_id="r-1")
        await until(lambda: r1.ledger.stats().active == 1)
        # (r-1 loads its worker: 5.5 blocks against the other's 5, so the other wins, with 80 tokens available)
        loaded = await f.client(1).route("m", R)
        assert (loaded.worker_id != rid.worker_id, loaded.overlap_blocks, loaded.available_tokens) == (
            True,
            0,
            80,
        )
        pinned = await f.client(1).route("m", R, candidates=[rid.worker_id])
        assert pinned.overlap_blocks == 5
        clock.now += 2.0
        after = await f.client(1).route("m", P)
        assert (after.overlap_blocks, after.available_tokens) == (0, 0)


async def test_workers_without_kv_events_are_routed_from_the_routers_own_decisions(
    nats_url: str, uid: str
) -> None:
    """Two workers registered with kv_events false (capacity 8 blocks each): the index knows nothing of the
    model; the routers count what they sent each worker, at most its capacity, least recently used out."""
    async with fleet(nats_url, uid) as f:
        bucket = f"T{uid}_WORKERS"
        kv = await open_registry(f.nc.jetstream(), RegistrySettings(bucket=bucket, ttl_s=30.0, memory=True))
        for w in ("x", "y"):
            await heartbeat(
                kv,
                WorkerRecord(
                    worker_id=w, model="m", dp_ranks=1, block_size=BS, incarnation=0, kv_capacity_blocks=8,
                    kv_events=False,
                ),
            )  # fmt: skip
        f.answer = lambda q: error_reply("unknown_model", "no worker serves model 'm'")
        r0 = await start(f, use_registry=True, registry_bucket=bucket)
        r1 = await start(f, use_registry=True, registry_bucket=bucket)
        await until(lambda: r0.endpoint.ranks("m") is not None and r1.endpoint.ranks("m") is not None)
        first = await f.client(0).route("m", P)
        w, other = first.worker_id, ({"x", "y"} - {first.worker_id}).pop()
        assert first.overlap_blocks == 0
        await until(lambda: len(r1.notes.predictions.approx) == 5)
        again = await f.client(1).route("m", P, explain=True)
        assert (again.worker_id, again.overlap_blocks) == (w, 5)
        scores = {(s.worker_id, s.overlap_blocks, s.cached_blocks) for s in again.scores or []}
        assert scores == {(w, 5, 5), (other, 0, 0)}
        # a new prompt goes to the emptier worker (ties: fewest cached blocks)
        assert (await f.client(0).route("m", Q)).worker_id == other
        # two more prompts on w: 15 blocks > 8, so P (least recently used) leaves it
        for prompt in (Q, R):
            await f.client(0).route("m", prompt, candidates=[w])
        await until(lambda: r1.notes.predictions.approx.block_count(Holder(w, 0)) == 8)
        assert r0.notes.predictions.approx.block_count(Holder(w, 0)) == 8
        assert r0.stats_message().predicted_blocks == {"no_events": 13}  # 8 on w, Q's 5 on the other
        held = await f.client(1).route("m", R, candidates=[w])
        assert held.overlap_blocks == 5
        lost = await f.client(1).route("m", P, candidates=[w])  # and now P is its newest, Q's head its oldest
        assert lost.overlap_blocks == 0
        keys = prompt_keys_of(RouteRequest(model="m", token_ids=P + Q), BS)
        assert keys is not None and len(keys) == 10
        await until(lambda: r0.notes.predictions.approx.match(keys, 0.0) == {Holder(w, 0): 5})
        # the keys of a prompt that went to a worker with events are not kept (no --predicted-ttl-s)
        assert r0.notes.predictions.ttl is None


def test_every_request_form_gives_the_same_prompt_keys() -> None:
    """Token ids, local block hashes and sequence hashes of one prompt name the same predicted entries; hashes
    of another block size name none."""
    from kvmesh.core.hashing import local_block_hashes, sequence_hashes

    tokens = list(range(7, 7 + 5 * BS + 3))  # 5 full blocks and a partial one
    local = local_block_hashes(tokens, BS)
    keys = prompt_keys_of(RouteRequest(model="m", token_ids=tokens), BS)
    assert keys == sequence_hashes(local) and len(keys) == 5
    assert prompt_keys_of(RouteRequest(model="m", block_hashes=local), BS) == keys
    assert prompt_keys_of(RouteRequest(model="m", seq_hashes=keys, block_size=BS), BS) == keys
    assert prompt_keys_of(RouteRequest(model="m", seq_hashes=keys, block_size=32), BS) is None
    salted = prompt_keys_of(RouteRequest(model="m", token_ids=tokens, cache_salt="t"), BS)
    assert salted is not None and salted[0] != keys[0] and len(salted) == 5


async def test_a_replica_started_later_takes_its_peers_predicted_caches(nats_url: str, uid: str) -> None:
    """Before multi-part sync a replica started later knew nothing of the event-less workers' predicted caches
    (the sync answer carried only the ledger and sessions) and routed the model cold; predicted entries beside
    the KV events were lost the same way. Now the answer comes in as many messages as the caches need (here a
    150,000-entry cache: 2.7 MB, three times the server's 1 MB ``max_payload``), from one peer though two
    answer, in the peer's recency order."""
    async with fleet(nats_url, uid) as f:
        bucket = f"T{uid}_WORKERS"
        kv = await open_registry(f.nc.jetstream(), RegistrySettings(bucket=bucket, ttl_s=30.0, memory=True))
        for w, cap in (("x", 8), ("y", 200_000)):
            await heartbeat(
                kv,
                WorkerRecord(
                    worker_id=w, model="m", dp_ranks=1, block_size=BS, incarnation=0, kv_capacity_blocks=cap,
                    kv_events=False,
                ),
            )  # fmt: skip
        f.answer = lambda q: answer([MatchHolder("a", 0, 0, 0)])
        clock = Clock()
        kw: dict[str, Any] = {"use_registry": True, "registry_bucket": bucket, "predicted_ttl_s": 5.0}
        r0 = await start(f, clock, **kw)
        r1 = await start(f, clock, **kw)
        await until(lambda: r0.endpoint.ranks("m") is not None and r1.endpoint.ranks("m") is not None)
        assert (await f.client(0).route("m", P, candidates=["x"])).worker_id == "x"
        await until(lambda: len(r1.notes.predictions.approx) == 5)
        big = list(range(1, 150_001))
        for r in (r0, r1):  # the same large cache on both peers: both answer the sync, one is kept
            assert r.notes.predictions.add(Holder("y", 0), big, clock.now)
        # predicted entries beside the KV events: worker a (not in the registry: a stand-in indexer's holder)
        for r in (r0, r1):
            r.notes.predictions.ttl.add(Holder("a", 0), [11, 12, 13], clock.now)  # type: ignore[union-attr]
        clock.now += 1.0
        late = await start(f, clock, **kw)
        assert late.notes.synced_predicted == 5 + 150_000 + 3
        for h in (Holder("x", 0), Holder("y", 0)):
            assert late.notes.predictions.approx.entries(h, clock.now) == r0.notes.predictions.approx.entries(
                h, clock.now
            )
        assert late.notes.predictions.approx.capacity(Holder("y", 0)) == 200_000
        assert late.notes.predictions.ttl.entries(Holder("a", 0), clock.now) == (  # type: ignore[union-attr]
            [13, 12, 11],
            [4.0, 4.0, 4.0],  # added 1 s before the restore: 4 of its 5 s left
        )
        await until(lambda: late.endpoint.ranks("m") is not None)
        again = await f.client(2).route("m", P, explain=True)
        assert (again.worker_id, again.overlap_blocks) == ("x", 5)
        assert {(s.worker_id, s.overlap_blocks, s.cached_blocks) for s in again.scores or []} == {
            ("x", 5, 5),
            ("y", 0, 150_000),
        }


async def test_a_sync_request_without_the_parts_header_gets_the_ledger_alone(nats_url: str, uid: str) -> None:
    """A router from before multi-part sync asks without ``Kvmesh-Sync-Parts``: it gets one message, the
    `LedgerSnapshot` it decodes, and no predicted parts it would misread."""
    from kvmesh.core.protocol import LedgerSnapshot, decode

    async with fleet(nats_url, uid) as f:
        clock = Clock()
        r0 = await start(f, clock, predicted_ttl_s=5.0)
        r0.notes.predictions.ttl.add(Holder("a", 0), [1, 2], clock.now)  # type: ignore[union-attr]
        await f.client(0).route("m", P, request_id="r-1")
        inbox = f.nc.new_inbox()
        sub = await f.nc.subscribe(inbox)
        await f.nc.publish(f"t{uid}.requests.sync", b"", reply=inbox)
        msg = await sub.next_msg(timeout=3.0)
        snap = decode(msg.data, LedgerSnapshot, format="msgpack")
        assert ([e.request_id for e in snap.entries], msg.headers) == (["r-1"], None)
        with pytest.raises(Exception, match="timeout"):
            await sub.next_msg(timeout=0.5)
