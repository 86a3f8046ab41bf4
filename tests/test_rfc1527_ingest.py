"""RFC #1527 events end to end: a real ZMQ publisher → ingest → JetStream → indexer → router, exact overlaps.

The publisher sends, byte for byte, the payloads the Mooncake store master's ``KvEventPublisher`` writes (one
map per object key, ``seq_hashes`` only, ``[ts_ms, events, 0]``, with or without its vLLM-style aliases),
and those of an RFC publisher that sends ``token_ids`` with its own hashes. The routed prompts' sequence
hashes are computed here with xxhash from the RFC's definition, not with kvmesh's hashing module.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest
import xxhash
from tests.pipeline import overlaps
from tests.test_ingest_faults import ANY, BS, T, U, clean_pipeline, expect, started, stored

from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

POOL = "node-1-pool"


def seq_hashes(tokens: list[int]) -> list[int]:
    """RFC #1527 rolling sequence hashes of the full blocks (XXH3-64, seed 1337, little-endian)."""
    out: list[int] = []
    for i in range(len(tokens) // BS):
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{BS}I", *tokens[i * BS : (i + 1) * BS]), seed=1337)
        out.append(
            local if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], local), seed=1337)
        )
    return out


def master_event(kind: str, seq_hash: int, *, medium: str = "cpu", aliases: bool = True) -> dict[str, Any]:
    """One event map as the Mooncake master packs it (a stored or removed object key that is a seq hash)."""
    ev: dict[str, Any] = {"event_id": 1, "timestamp": 1_739_145_600_000, "event_type": kind}
    if aliases:
        ev["type"] = "BlockStored" if kind == "stored" else "BlockRemoved"
    ev.update(
        model_name=None,
        block_size=None,
        additional_salt=None,
        lora_name=None,
        tenant_id="default",
        backend_id=POOL,
        group_id=None,
        medium=medium,
        dp_rank=None,
        object_key=str(seq_hash),
        seq_hashes=[seq_hash],
    )
    if aliases:
        ev["block_hashes"] = [seq_hash - (1 << 64) if seq_hash >= 1 << 63 else seq_hash]
    if kind == "stored":
        ev.update(base_block_idx=0, parent_hash=None, token_ids=None)
        if aliases:
            ev["parent_block_hash"] = None
    else:
        ev["base_block_idx"] = None
    return ev


def batch(events: list[Any]) -> bytes:
    return msgspec.msgpack.encode([1_739_145_600_000, events, 0])


ST = seq_hashes(T)
SU = seq_hashes(U)


@pytest.mark.parametrize("aliases", [True, False])
async def test_store_master_seq_hashes_route_the_prompts_they_hash(
    nats_url: str, uid: str, aliases: bool
) -> None:
    """The master's stored keys index under their sequence hashes on their tier: the prompt whose tokens hash
    to them overlaps exactly; a removal and an RFC clear take blocks out, with or without the aliases."""
    pub = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {POOL: pub}) as p:
        pub.publish_raw(batch([master_event("stored", h, aliases=aliases) for h in [*ST, SU[0]]]))
        await expect(p, [T, U], [{f"{POOL}/0": 4}, {f"{POOL}/0": 1}])
        reply = await p.route(T, explain=True)
        assert reply.scores is not None
        assert [(s.cached_tokens, s.cached_tokens_by_tier) for s in reply.scores] == [
            (4 * BS, {"CPU": 4 * BS})
        ]
        pub.publish_raw(batch([master_event("removed", ST[2], aliases=aliases)]))
        await expect(p, [T, U], [{f"{POOL}/0": 2}, {f"{POOL}/0": 1}])
        pub.publish_raw(
            batch([{"event_id": 9, "event_type": "cleared", "backend_id": POOL, "medium": "cpu"}])
        )
        await expect(p, [T, U], [{f"{POOL}/0": 0}, {f"{POOL}/0": 0}])
        pub.publish_raw(batch([master_event("stored", ST[0], medium="disk", aliases=aliases)]))
        await expect(p, [T], [{f"{POOL}/0": 1}])
        events = p.ingests[POOL].status().ranks["0"].events
        assert (events["sequence_events"], events["removed_events"], events["cleared_events"]) == (6, 1, 1)


async def test_token_id_events_are_keyed_from_their_tokens(nats_url: str, uid: str) -> None:
    """An RFC publisher that sends token ids with hashes of its own is indexed by kvmesh's keys of the tokens;
    its hashes name the blocks (a child's parent_hash, a removal); each mismatch is counted."""
    pub = EventPublisher(ANY, ANY)

    def stored_tokens(hashes: list[int], tokens: list[int], parent: int | None) -> dict[str, Any]:
        return {
            "event_id": 3,
            "event_type": "stored",
            "block_size": BS,
            "tenant_id": "default",
            "backend_id": "w",
            "medium": "gpu",
            "seq_hashes": hashes,
            "parent_hash": parent,
            "base_block_idx": 0 if parent is None else 2,
            "token_ids": tokens,
        }

    async with started(nats_url, uid, {"w": pub}) as p:
        pub.publish_raw(batch([stored_tokens([11, 12], T[: 2 * BS], None)]))
        pub.publish_raw(batch([stored_tokens([13, 14], T[2 * BS :], 12)]))
        await expect(p, [T], [{"w/0": 4}])
        pub.publish_raw(batch([{"event_type": "removed", "seq_hashes": [12], "medium": "gpu"}]))
        await expect(p, [T], [{"w/0": 1}])
        events = p.ingests["w"].status().ranks["0"].events
        assert (events["stored_events"], events["seq_hash_mismatch"], events["sequence_events"]) == (2, 2, 0)


async def test_a_malformed_rfc_event_is_rejected_alone(nats_url: str, uid: str) -> None:
    """A stored event whose seq_hashes is not an array is counted and dropped; the other events of its batch
    are indexed and the holder is not cleared."""
    pub = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {POOL: pub}) as p:
        pub.publish_raw(batch([master_event("stored", ST[0])]))
        await expect(p, [T], [{f"{POOL}/0": 1}])
        bad = {**master_event("stored", SU[0]), "seq_hashes": "0x1234"}
        pub.publish_raw(batch([master_event("stored", ST[1]), bad, master_event("stored", ST[2])]))
        await expect(p, [T, U], [{f"{POOL}/0": 3}, {f"{POOL}/0": 0}])
        ing = p.ingests[POOL]
        assert ing.counters.decode_errors == 1
        assert ing.status().ranks["0"].epoch == 0


async def test_a_backend_pool_counts_for_each_instance_that_reads_it(nats_url: str, uid: str) -> None:
    """A Mooncake pool published under its own holder with --backend-of a,b is no candidate; its blocks count
    for both instances at its tier, joined with an instance's own blocks into one run (per tier)."""
    a, b, pool = EventPublisher(ANY, ANY), EventPublisher(ANY, ANY), EventPublisher(ANY, ANY)
    async with clean_pipeline(nats_url, uid) as p:
        for worker, pub, kw in (
            ("a", a, {}),
            ("b", b, {}),
            (POOL, pool, {"backend_of": ["a", "b"]}),
        ):
            await p.start_ingest(worker, pub.endpoint, pub.replay_endpoint, block_size=BS, **kw)
            await pub.wait_for_subscribers(1)
        await p.start_indexer()
        await p.start_router()
        a.publish([stored([1, 2], T[: 2 * BS])])  # a's own GPU blocks 0-1
        pool.publish_raw(batch([master_event("stored", h) for h in ST]))  # the pool: blocks 0-3 on CPU
        await expect(p, [T, U], [{"a/0": 4, "b/0": 4}, {"a/0": 0, "b/0": 0}])
        reply = await p.route(T, explain=True)
        assert reply.scores is not None
        tiers = {s.worker_id: s.cached_tokens_by_tier for s in reply.scores}
        assert tiers == {"a": {"GPU": 2 * BS, "CPU": 2 * BS}, "b": {"CPU": 4 * BS}}
        pool.publish_raw(batch([master_event("removed", ST[0])]))
        # a: its own blocks 0-1, then the pool's 2-3; b reads only the pool, which lacks block 0 now.
        await expect(p, [T], [{"a/0": 4, "b/0": 0}])
        assert p.indexer is not None
        match = p.indexer.state.match(p.model, T)
        assert [(c.worker_id, c.overlap_blocks, c.tiers, c.cached_blocks) for c in match.candidates] == [
            ("a", 4, {"GPU": 2, "CPU": 2}, 2),
            ("b", 0, None, 0),
        ]
        reply = await p.route(T, explain=True)
        assert sorted(overlaps(reply)) == ["a/0", "b/0"]
