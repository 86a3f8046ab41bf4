"""One bad field or frame through a real EventPublisher → ingest → JetStream → indexer → router: the bad event or
message is dropped and counted, and nothing else of the worker is lost."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from tests.test_ingest_faults import ANY, BS, T, U, W, blk, expect, started, stored

from kvmesh.core.wire import AllBlocksCleared, EngineBatch, encode_batch
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


def _stored_map(hashes: list[Any], parent: Any, tokens: list[int], **fields: Any) -> dict[str, Any]:
    """A vLLM ≥ 0.24 BlockStored map, built by hand so that any field may have the wrong type."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        **fields,
    }


async def test_malformed_block_stored_fields_drop_only_their_event(nats_url: str, uid: str) -> None:
    """A BlockStored with a non-string medium and one with a float block hash are counted and dropped; the
    valid events of the same batch are indexed and the worker is not cleared."""
    pub = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        pub.publish_raw(
            msgspec.msgpack.encode(
                [
                    1.0,
                    [
                        _stored_map([10, 11], None, U, medium=7),
                        _stored_map([3], 2, blk(T, 2)),
                        _stored_map([1.5], None, blk(U, 0)),
                        _stored_map([4], 3, blk(T, 3), medium="GPU"),
                    ],
                    0,
                ]
            )
        )
        await expect(p, [T, U], [{"w/0": 4}, {"w/0": 0}])
        ing = p.ingests[W]
        assert ing.counters.decode_errors == 2
        assert ing.status().ranks["0"].epoch == 0
        # Nothing was cleared: a Cleared now would empty the worker, then block 0 of U indexes alone.
        pub.publish([AllBlocksCleared(), stored([10], blk(U, 0))])
        await expect(p, [T, U], [{"w/0": 0}, {"w/0": 1}])


async def test_empty_sequence_frame_is_dropped_not_an_engine_restart(nats_url: str, uid: str) -> None:
    """A live message whose sequence frame is empty is counted and dropped; it does not read as seq 0 (an
    engine restart that would clear the worker)."""
    pub = EventPublisher(ANY, ANY)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        payload = encode_batch(EngineBatch(ts=1.0, events=(stored([10, 11], U),), dp_rank=0))
        pub._pub.send_multipart((pub.topic.encode(), b"", payload))
        pub.publish([stored([3], blk(T, 2), parent=2)])
        await expect(p, [T, U], [{"w/0": 3}, {"w/0": 0}])
        ing = p.ingests[W]
        assert ing.counters.decode_errors == 1
        st = ing.status().ranks["0"]
        assert (st.epoch, st.last_seq, st.sequence["restarts"]) == (0, 1, 0)
