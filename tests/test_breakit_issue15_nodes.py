"""Multi-node registry records under bad input: overlapping node ranks, a node under another model, a context
length that no prompt fits.

Real nats-server, real ZMQ sockets (one simulated vLLM publisher per global rank), the real ingests, indexer
and router as tasks; a node is killed by cancelling its ingest (its key ages out after the TTL).
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from tests.pipeline import eventually, overlaps
from tests.test_ingest_faults import BS, T, blk, clean_pipeline, stored
from tests.test_multinode_dp import DP, TTL_S, W, explained, kill, ranks_on_ports, start_node

from kvmesh.core import protocol
from kvmesh.core.protocol import WorkerRecord
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect
from kvmesh.runtime.registry import NO_NODE, RegistrySettings, open_registry, registry_key
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

ANY = "tcp://127.0.0.1:*"


async def test_a_departed_node_does_not_clear_a_rank_another_node_still_reads(
    nats_url: str, uid: str
) -> None:
    """Two nodes whose rank ranges overlap (A reads 0–2, B reads 2–3: rank 2 twice, a misconfiguration). A
    dies: ranks 0–1 leave routing and the index, rank 2, still read (and heartbeated) by B, keeps its blocks
    in the index (3) as in routing."""
    async with ranks_on_ports() as (events, replay, pubs), clean_pipeline(nats_url, uid) as p:
        node_a = await start_node(p, events, replay, 0, 3)
        await start_node(p, events, replay, 2, 2)
        for r, pub in enumerate(pubs):
            await pub.wait_for_subscribers(2 if r == 2 else 1)
        indexer = await p.start_indexer()
        await p.start_router()
        for r, pub in enumerate(pubs):
            pub.publish([stored(list(range(10 * r + 1, 10 * r + 2 + r)), blk(T, 0, r + 1))])
        want = {f"{W}/0": 1, f"{W}/1": 2, f"{W}/2": 3, f"{W}/3": 4}
        assert await eventually(lambda: explained(p, T), lambda o: o == want) == want
        await kill(p, node_a)
        left = {f"{W}/2": 3, f"{W}/3": 4}
        assert await eventually(lambda: explained(p, T), lambda o: o == left, timeout_s=30) == left
        # The node's key aged out: after the indexers' expiry grace, its ranks' Cleared messages are applied.
        state = await eventually(
            lambda: asyncio.sleep(0, indexer.state.workers()[W]), lambda s: s["blocks"] == 3 + 4, timeout_s=15
        )
        assert (state["blocks"], state["removed"]) == (3 + 4, False)
        assert await explained(p, T) == left


async def test_a_node_registered_under_another_model_is_not_routed_for_the_first(
    nats_url: str, uid: str
) -> None:
    """Node A of worker ``moe`` reads ranks 0–1 for the test model; node B (ranks 2–3) was started with another
    model name. A route for the test model must not pick B's ranks (their engine serves another model, and
    their events go to the other model's index): ranks 2–3 are skipped as having no node of this model."""
    async with ranks_on_ports() as (events, replay, pubs), clean_pipeline(nats_url, uid) as p:
        await start_node(p, events, replay, 0, 2)
        await p.start_ingest(
            W,
            events,
            replay,
            model="another-model",
            block_size=BS,
            data_parallel_size=DP,
            data_parallel_start_rank=2,
            data_parallel_size_local=2,
            worker_ttl_s=TTL_S,
        )
        for pub in pubs:
            await pub.wait_for_subscribers(1)
        await p.start_indexer()
        await p.start_router()
        pubs[0].publish([stored([1], blk(T, 0))])
        want = {f"{W}/0": 1, f"{W}/1": 0}
        assert await eventually(lambda: explained(p, T), lambda o: o == want) == want
        reply = await p.route(T, explain=True)
        assert reply.selection is not None
        assert [(s.dp_rank, s.reason) for s in reply.selection.skipped] == [
            (2, f"stale: {NO_NODE}"),
            (3, f"stale: {NO_NODE}"),
        ]
        for _ in range(20):  # load only decides between 1, 2 and 3 here: none may be B's
            assert (await p.route(T[4:])).dp_rank in (0, 1)


@pytest.mark.parametrize("bad", [0, -5])
async def test_a_record_with_a_context_length_no_prompt_fits_is_read_as_unknown(
    nats_url: str, uid: str, bad: int
) -> None:
    """A registry record (written by another build, or by hand) claiming context length 0 or -5: no prompt
    would ever fit, so every route would answer context_length_exceeded. It is read as unknown: the worker is
    routed to (T's 4 blocks matched)."""
    pub = EventPublisher(ANY, ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p:
            await p.start_ingest("w", pub.endpoint, pub.replay_endpoint, block_size=BS, worker_ttl_s=60.0)
            ingest = p.tasks[-1]
            await pub.wait_for_subscribers(1)
            await p.start_indexer()
            await p.start_router()
            pub.publish([stored([1, 2, 3, 4], blk(T, 0, 4))])
            assert await eventually(lambda: explained(p, T), lambda o: o == {"w/0": 4}) == {"w/0": 4}
            await kill(p, ingest)  # no heartbeat overwrites the record below; the key stays for its TTL
            nc = await connect(nats_url, name="test-breakit")
            try:
                kv = await open_registry(
                    nc.jetstream(), RegistrySettings(bucket=subjects.registry_bucket(p.stream), ttl_s=60.0)
                )
                entry = await kv.get(registry_key("w"))
                record = protocol.decode(entry.value, WorkerRecord)
                await kv.put(
                    registry_key("w"), protocol.encode(msgspec.structs.replace(record, context_length=bad))
                )
                await asyncio.sleep(0.5)
                reply = await eventually(lambda: p.route(T), lambda r: r is not None)
                assert (reply.worker_id, reply.dp_rank, reply.overlap_blocks) == ("w", 0, 4)
                assert overlaps(await p.route(T, explain=True)) == {"w/0": 4}
            finally:
                await nc.close()
    finally:
        pub.close()
