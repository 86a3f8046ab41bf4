"""A salted conversation whose cache spans several BlockStored events matches on all of them, for every SGLang
release layout that sends a salt, through a real publisher → ingest → JetStream → indexer → router.

SGLang ≥ 0.5.20 puts ``cache_salt`` on every BlockStored of a salted request, the children of a chain
included; the salt seeds block 0 of the sequence only, so a child event's salt must not change its keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.test_ingest_faults import W, blk, expect, started, stored

from kvmesh.core.normalize import CHAIN_SALTS_KEPT, Normalizer
from kvmesh.core.wire import BlockStored, EngineBatch, decode_batch
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

ANY = "tcp://127.0.0.1:*"
P = list(range(500, 516))  # 4 blocks of 4 tokens
CAPTURE = Path(__file__).parent / "data" / "frames" / "sglang-0.5.22.json"

SALTED_RELEASES = [
    ("0.5.18", "trailing {cache_salt} map"),
    ("0.5.20", "map field"),
    ("0.5.22", "map field, with lora_name"),
]


@pytest.mark.parametrize("version", [v for v, _ in SALTED_RELEASES])
async def test_a_salted_chain_of_two_events_matches_on_both(nats_url: str, uid: str, version: str) -> None:
    """Root event (blocks 0–1) and its child (block 2) both carry the salt: a salted prompt of 4 blocks
    matches 3, the unsalted prompt and another salt match none."""
    pub = EventPublisher(ANY, ANY, producer="sglang", version=version)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([11, 12], blk(P, 0, 2), cache_salt="tenant-a")])
        pub.publish([stored([13], blk(P, 2), parent=12, cache_salt="tenant-a")])
        await expect(p, [P], [{"w/0": 3}], cache_salt="tenant-a")
        await expect(p, [P], [{"w/0": 0}])
        await expect(p, [P], [{"w/0": 0}], cache_salt="tenant-b")
        (rank,) = p.ingests[W].status().ranks.values()
        assert rank.events["salt_mismatch"] == 0


async def test_a_child_whose_salt_differs_from_its_chain_is_counted_and_follows_the_chain(
    nats_url: str, uid: str
) -> None:
    """A child salted "tenant-b" on a "tenant-a" chain keeps the chain's keys (its block matches under
    tenant-a) and is counted once."""
    pub = EventPublisher(ANY, ANY, producer="sglang", version="0.5.22")
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([21, 22], blk(P, 0, 2), cache_salt="tenant-a")])
        pub.publish([stored([23], blk(P, 2), parent=22, cache_salt="tenant-b")])
        await expect(p, [P], [{"w/0": 3}], cache_salt="tenant-a")
        await expect(p, [P], [{"w/0": 0}], cache_salt="tenant-b")
        (rank,) = p.ingests[W].status().ranks.values()
        assert rank.events["salt_mismatch"] == 1


async def test_the_captured_salted_child_extends_its_salted_chain(nats_url: str, uid: str) -> None:
    """SGLang 0.5.22's captured ``block_stored_all_optional`` (a child of 0x0102030405060708 with
    ``cache_salt: "tenant-a"``, LoRA ``my-lora``, medium ``CPU_PINNED``, block size 2), sent byte for byte
    after a root event that ends in that parent under the same salt and LoRA: the salted prompt matches the
    root's blocks and the child's."""
    capture = json.loads(CAPTURE.read_text())
    (frame,) = [b for b in capture["batches"] if b["name"] == "block_stored_all_optional"]
    payload = bytes.fromhex(frame["frames_hex"][2])
    (child,) = decode_batch(payload).events
    assert isinstance(child, BlockStored)
    assert child.cache_salt == "tenant-a" and child.parent_block_hash == 0x0102030405060708
    assert child.token_ids == (1, 2) and child.block_size == 2
    root_tokens = [7, 8, 9, 10]
    pub = EventPublisher(ANY, ANY, producer="sglang", version="0.5.22")
    async with started(nats_url, uid, {W: pub}, block_size=2) as p:
        pub.publish(
            [
                stored(
                    [31, 0x0102030405060708],
                    root_tokens,
                    block_size=2,
                    cache_salt="tenant-a",
                    lora_name="my-lora",
                    medium="CPU_PINNED",
                )
            ]
        )
        pub.publish_raw(payload)
        prompt = [*root_tokens, 1, 2, 3, 4]
        await expect(p, [prompt], [{"w/0": 3}], cache_salt="tenant-a", lora_name="my-lora")
        await expect(p, [prompt], [{"w/0": 0}], lora_name="my-lora")
        (rank,) = p.ingests[W].status().ranks.values()
        assert rank.events["salt_mismatch"] == 0
        assert rank.block_size == 2


def test_the_remembered_chain_salts_are_bounded() -> None:
    """The normalizer keeps the salt of at most `CHAIN_SALTS_KEPT` chain ends, forgetting the oldest: a child
    of a forgotten chain is taken at its word (not counted)."""
    n = Normalizer(block_size=1)
    for i in range(CHAIN_SALTS_KEPT + 1):
        n.normalize(EngineBatch(ts=0.0, dp_rank=0, events=(stored([i], [i], block_size=1, cache_salt="a"),)))
    assert len(n.chain_salts) == CHAIN_SALTS_KEPT and 0 not in n.chain_salts and 1 in n.chain_salts
    n.normalize(
        EngineBatch(ts=0.0, dp_rank=0, events=(stored([-1], [7], parent=1, block_size=1, cache_salt="b"),))
    )
    n.normalize(
        EngineBatch(ts=0.0, dp_rank=0, events=(stored([-2], [7], parent=0, block_size=1, cache_salt="b"),))
    )
    assert n.stats.salt_mismatch == 1
