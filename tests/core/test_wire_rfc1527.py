"""RFC #1527 KV events (Mooncake's standardized event maps): decoding, normalization and indexing.

The maps are written here by hand, field for field as the Mooncake store master's ``KvEventPublisher``
(``mooncake-store/src/kv_event/kv_event_publisher.cpp``) packs them: the batch ``[ts_ms, events, 0]``, the
envelope with ``group_id``, ``object_key``, ``seq_hashes`` and, with its default
``emit_legacy_compat_fields``, the aliases ``type``, ``block_hashes`` (int64) and ``parent_block_hash``.
Standard sequence hashes are computed with xxhash directly, not with kvmesh's hashing module.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest
import xxhash

from kvmesh.core import wire
from kvmesh.core.events import EventsMessage, Removed, Stored, StoredKeys, decode_message, encode_message
from kvmesh.core.hashing import local_block_hashes
from kvmesh.core.index import Holder, Overlap, PrefixIndex
from kvmesh.core.normalize import (
    BlockSizeMismatchError,
    BlockSizeUnknownError,
    Normalizer,
    UnplacedBlocksError,
)
from kvmesh.core.state import IndexState

BS = 4
TS_MS = 1_739_145_600_250


def seq_hashes(tokens: list[int], block_size: int = BS) -> list[int]:
    """RFC #1527's rolling sequence hashes, from the RFC's own definition (XXH3-64, seed 1337)."""
    out: list[int] = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *block), seed=1337)
        out.append(
            local if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], local), seed=1337)
        )
    return out


def int64(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def master_event(
    kind: str, seq_hash: int | None, *, medium: str = "cpu", aliases: bool = True
) -> dict[str, Any]:
    """One event map as the Mooncake master packs it (one object key = one block)."""
    ev: dict[str, Any] = {"event_id": 7, "timestamp": TS_MS, "event_type": kind}
    if aliases:
        ev["type"] = "BlockStored" if kind == "stored" else "BlockRemoved"
    ev.update(
        model_name=None,
        block_size=None,
        additional_salt=None,
        lora_name=None,
        tenant_id="default",
        backend_id="node-1-pool",
        group_id=None,
        medium=medium,
        dp_rank=None,
        object_key=str(seq_hash) if seq_hash is not None else "sha256-opaque",
        seq_hashes=[] if seq_hash is None else [seq_hash],
    )
    if aliases:
        ev["block_hashes"] = [] if seq_hash is None else [int64(seq_hash)]
    if kind == "stored":
        ev.update(base_block_idx=0, parent_hash=None, token_ids=None)
        if aliases:
            ev["parent_block_hash"] = None
    else:
        ev["base_block_idx"] = None
    return ev


def payload(events: list[Any], ts: float | int = TS_MS) -> bytes:
    return msgspec.msgpack.encode([ts, events, 0])


PROMPT = list(range(104, 104 + 3 * BS))
SEQ = seq_hashes(PROMPT)


def test_golden_sequence_hashes() -> None:
    """The test's own sequence hashes are the design's golden vectors (tokens 0..7, block size 4)."""
    assert seq_hashes(list(range(8))) == [9143094415614847814, 9510318385840434533]
    assert max(SEQ) >= 1 << 63  # one of the prompt's hashes needs the full 64 bits (a negative int64 alias)


@pytest.mark.parametrize("aliases", [True, False])
def test_master_maps_decode_with_and_without_aliases(aliases: bool) -> None:
    """The master's stored and removed maps decode as SequenceStored / BlockRemoved by the RFC's names; its
    millisecond batch time is read in seconds; the aliases change nothing."""
    batch = wire.decode_batch(
        payload([*(master_event("stored", h, aliases=aliases) for h in SEQ), master_event("removed", SEQ[2])])
    )
    assert batch.ts == TS_MS / 1000
    assert batch.dp_rank == 0
    assert (batch.errors, batch.unknown_events) == ((), 0)
    assert batch.events == (
        *(
            wire.SequenceStored(
                seq_hashes=(h,),
                base_block_idx=0,
                medium="cpu",
                tenant_id="default",
                backend_id="node-1-pool",
                event_id=7,
            )
            for h in SEQ
        ),
        wire.BlockRemoved(block_hashes=(SEQ[2],), medium="cpu"),
    )


def test_rfc_example_events_decode() -> None:
    """The RFC's own examples (a stored run with parent and depth, a removal, a clear) decode field by field;
    an unknown event_type is counted, a float ts in seconds is kept."""
    stored = {
        "event_id": 42,
        "timestamp": 1739145600000,
        "event_type": "stored",
        "model_name": "llama-3.1-8b",
        "block_size": 64,
        "additional_salt": None,
        "lora_name": None,
        "tenant_id": "default",
        "backend_id": "worker-0",
        "medium": "gpu",
        "dp_rank": 0,
        "seq_hashes": [1234567890, 9876543210, 1122334455],
        "base_block_idx": 5,
        "parent_hash": 9999999999,
        "token_ids": None,
        "some_future_field": {"x": 1},
    }
    removed = {"event_id": 43, "event_type": "removed", "seq_hashes": [1122334455], "base_block_idx": 7}
    cleared = {"event_id": 44, "event_type": "cleared", "backend_id": "worker-0"}
    batch = wire.decode_batch(payload([stored, removed, cleared, {"event_type": "touched"}], ts=1739145600.5))
    assert batch.ts == 1739145600.5
    assert batch.unknown_events == 1
    assert batch.events == (
        wire.SequenceStored(
            seq_hashes=(1234567890, 9876543210, 1122334455),
            parent_hash=9999999999,
            base_block_idx=5,
            block_size=64,
            medium="gpu",
            tenant_id="default",
            backend_id="worker-0",
            model_name="llama-3.1-8b",
            dp_rank=0,
            event_id=42,
        ),
        wire.BlockRemoved(block_hashes=(1122334455,)),
        wire.AllBlocksCleared(),
    )


def test_a_malformed_rfc_event_is_rejected_alone() -> None:
    """Each malformed RFC event is reported with its index, tag and reason; the others decode."""
    good = master_event("stored", SEQ[0])
    bad: list[dict[str, Any]] = [
        {**good, "seq_hashes": "0x12"},
        {**good, "seq_hashes": [1.5]},
        {k: v for k, v in good.items() if k != "seq_hashes"},
        {**good, "event_type": 3},
        {**good, "base_block_idx": -1},
        {**good, "parent_hash": b"\x01"},
        {**good, "block_size": 0},
        {**good, "token_ids": ["a"]},
        {**master_event("removed", SEQ[0]), "medium": 5},
    ]
    batch = wire.decode_batch(payload([*bad, good]))
    assert [(e.index, e.tag, e.reason) for e in batch.errors] == [
        (0, "stored", "seq_hashes is a string, expected an array"),
        (1, "stored", "seq_hashes holds a float (a sequence hash is a 64-bit int)"),
        (2, "stored", "RFC #1527 stored event lacks seq_hashes"),
        (3, None, 'event "event_type" is a int, expected a string'),
        (4, "stored", "base_block_idx is -1, expected a non-negative int or nil"),
        (5, "stored", "parent_hash is a bin, expected a 64-bit int or nil"),
        (6, "stored", "block_size is 0, expected a positive int or nil"),
        (7, "stored", "token_ids holds a string, expected ints"),
        (8, "removed", "medium is a int, expected a string or nil"),
    ]
    assert batch.events == (wire.decode_batch(payload([good])).events[0],)
    result = Normalizer(block_size=BS).normalize(batch)
    assert result.events == [StoredKeys([SEQ[0]], None, "cpu")]
    assert result.lost  # the removal and the untyped event may have removed blocks: the holder is resynced
    only_stored = Normalizer(block_size=BS).normalize(wire.decode_batch(payload([*bad[:3], good])))
    assert not only_stored.lost  # a failed stored event loses only its own blocks


def test_encoder_writes_what_the_master_writes() -> None:
    """`encode_rfc1527_batch` (and ``producer="mooncake"``) gives the master's maps, aliases on or off."""
    events: tuple[wire.KVEvent, ...] = (
        *(
            wire.SequenceStored(seq_hashes=(h,), base_block_idx=0, medium="cpu", backend_id="node-1-pool")
            for h in SEQ[:2]
        ),
        wire.BlockRemoved(block_hashes=(SEQ[0],), medium="cpu"),
    )
    batch = wire.EngineBatch(ts=TS_MS / 1000, events=events, dp_rank=None)
    for aliases in (True, False):
        want = [master_event("stored", h, aliases=aliases) for h in SEQ[:2]] + [
            master_event("removed", SEQ[0], aliases=aliases)
        ]
        for i, ev in enumerate(want):
            del ev["object_key"]
            ev["event_id"] = i
        got = msgspec.msgpack.decode(
            wire.encode_rfc1527_batch(batch, aliases=aliases, backend_id="node-1-pool")
        )
        assert got == [TS_MS, want, 0]
    assert wire.encode_batch(batch, producer="mooncake") == wire.encode_rfc1527_batch(batch)
    assert wire.decode_batch(wire.encode_batch(batch, producer="mooncake")).events[2] == events[2]


# ---------------------------------------------------------------------------------------------- normalize


def test_seq_hashes_only_become_stored_keys() -> None:
    """Without token ids the event's seq_hashes are the prefix keys (and the engine hashes); an empty
    seq_hashes (an object key that is no hash) names nothing and is skipped, its removal too."""
    n = Normalizer(block_size=BS)
    batch = wire.decode_batch(
        payload(
            [
                *(master_event("stored", h) for h in SEQ),
                master_event("stored", None),
                master_event("removed", None),
            ]
        )
    )
    result = n.normalize(batch)
    assert result.events == [StoredKeys([h], None, "cpu") for h in SEQ]
    assert (n.stats.sequence_events, n.stats.sequence_blocks, n.stats.unkeyed_events) == (3, 3, 2)
    assert result.rejections == []


def test_block_size_comes_from_the_event_or_the_configuration() -> None:
    """An event without block_size needs a configured one; one with a size is checked against it."""
    ev = master_event("stored", SEQ[0])
    unknown = Normalizer().normalize(wire.decode_batch(payload([ev])))
    assert [type(r) for r in unknown.rejections] == [BlockSizeUnknownError]
    assert str(unknown.rejections[0]) == (
        "RFC #1527 stored event without a block_size, and no block size is configured (--block-size)"
    )
    n = Normalizer(block_size=BS)
    other = n.normalize(wire.decode_batch(payload([{**ev, "block_size": 2 * BS}, {**ev, "block_size": BS}])))
    assert [type(r) for r in other.rejections] == [BlockSizeMismatchError]
    assert other.events == [StoredKeys([SEQ[0]], None, "cpu")]
    learned = Normalizer()
    learned.normalize(wire.decode_batch(payload([{**ev, "block_size": BS}])))
    assert learned.block_size == BS


def token_event(tokens: list[int], hashes: list[int], parent: int | None, **kw: Any) -> dict[str, Any]:
    return {
        "event_type": "stored",
        "seq_hashes": hashes,
        "parent_hash": parent,
        "base_block_idx": kw.pop("base_block_idx", 0 if parent is None else 1),
        "token_ids": tokens,
        "block_size": BS,
        **kw,
    }


def test_token_events_are_keyed_by_kvmesh_and_checked() -> None:
    """With token ids the event is a Stored keyed from the tokens, engine hashes = seq_hashes; standard hashes
    pass the check, a publisher's own hashes are counted as a mismatch and kept as engine hashes only."""
    n = Normalizer(block_size=BS)
    standard = n.normalize(
        wire.decode_batch(
            payload(
                [
                    token_event(PROMPT[: 2 * BS], SEQ[:2], None),
                    token_event(PROMPT[2 * BS :], SEQ[2:], SEQ[1], base_block_idx=2),
                ]
            )
        )
    )
    local = local_block_hashes(PROMPT, BS)
    assert standard.events == [
        Stored(SEQ[:2], None, local[:2], None),
        Stored(SEQ[2:], SEQ[1], local[2:], None),
    ]
    assert n.stats.seq_hash_mismatch == 0
    own = n.normalize(wire.decode_batch(payload([token_event(PROMPT[:BS], [77], None, medium="gpu")])))
    assert own.events == [Stored([77], None, local[:1], "gpu")]
    assert (n.stats.seq_hash_mismatch, n.stats.stored_events) == (1, 3)


def test_salt_and_lora_key_token_events_as_route_requests_name_them() -> None:
    """additional_salt is the block-0 salt (a route's cache_salt), lora_name seeds every block; a child event's
    salt adds nothing (the chain carries it)."""
    n = Normalizer(block_size=BS)
    result = n.normalize(
        wire.decode_batch(
            payload(
                [
                    token_event(PROMPT[:BS], [1], None, additional_salt="tenant-a", lora_name="sql"),
                    token_event(PROMPT[BS : 2 * BS], [2], 1, additional_salt="tenant-a", lora_name="sql"),
                ]
            )
        )
    )
    want = local_block_hashes(PROMPT[: 2 * BS], BS, lora_name="sql", cache_salt="tenant-a")
    assert [e.local_hashes for e in result.events if isinstance(e, Stored)] == [want[:1], want[1:]]


def test_token_events_that_cannot_be_placed_or_aligned_are_rejected() -> None:
    """Tokens past block 0 without parent_hash cannot be keyed; tokens that do not fill the blocks neither."""
    n = Normalizer(block_size=BS)
    result = n.normalize(
        wire.decode_batch(
            payload(
                [
                    token_event(PROMPT[:BS], [1], None, base_block_idx=3),
                    token_event(PROMPT[: BS + 1], [1], None),
                    token_event(PROMPT[:BS], [5], None),
                ]
            )
        )
    )
    assert [type(r) for r in result.rejections[:1]] == [UnplacedBlocksError]
    assert [str(r) for r in result.rejections] == [
        "RFC #1527 stored event with token_ids at base_block_idx 3 has no parent_hash (its blocks cannot be keyed)",
        "5 token ids do not fill 1 blocks of 4 tokens (expected 4)",
    ]
    assert len(result.events) == 1
    assert (n.stats.rejected_unplaced, n.stats.rejected_alignment) == (1, 1)


# ---------------------------------------------------------------------------------------------- the index


def test_store_sequence_indexes_the_given_keys() -> None:
    """Blocks stored by their sequence hashes match a prompt of those tokens, per tier, whatever their parent,
    and release a held child of one of them; removals name the same hashes."""
    index = PrefixIndex()
    pool = Holder("pool", 0)
    result = index.store_sequence(pool, [SEQ[0]], [SEQ[0]], "cpu")
    assert (result.attached, result.duplicates, result.held) == (1, 0, False)
    held = index.store(pool, [55], SEQ[1], local_block_hashes(PROMPT[2 * BS :], BS), "cpu")
    assert held.held
    third = index.store_sequence(pool, [SEQ[2]], [SEQ[2]], "disk")  # no parent known: stored all the same
    assert third.attached == 1
    assert index.match_tiers(SEQ) == {pool: Overlap(1, {"CPU": 1})}  # the run stops at the missing block 1
    second = index.store_sequence(pool, [SEQ[1]], [SEQ[1]], "cpu")
    assert (second.attached, index.stats().held_orphans) == (2, 0)  # the held child attached under it
    assert index.holds(pool, 55, "cpu")
    assert index.match_tiers(SEQ) == {pool: Overlap(3, {"CPU": 3})}
    assert index.store_sequence(pool, [SEQ[1]], [SEQ[1]], "cpu").duplicates == 1
    index.remove(pool, [SEQ[1]], "cpu")
    index.remove(pool, [SEQ[1]], "cpu")
    assert index.match_tiers(SEQ) == {pool: Overlap(1, {"CPU": 1})}
    assert index.digest() == index.digest_from_scratch()
    with pytest.raises(ValueError, match="2 engine hashes but 1 prefix keys"):
        index.store_sequence(pool, [1, 2], [1])


def test_state_applies_stored_keys_messages() -> None:
    """A StoredKeys message survives the stream codec and is applied: token and hash matches agree."""
    msg = EventsMessage(
        worker_id="pool",
        dp_rank=0,
        model="m",
        block_size=BS,
        epoch=0,
        seq=0,
        events=[StoredKeys(SEQ, None, "cpu"), Removed([SEQ[2]], "cpu")],
    )
    assert decode_message(encode_message(msg)) == msg
    state = IndexState()
    state.apply(1, msg)
    by_tokens = state.match("m", PROMPT).candidates
    assert [(c.worker_id, c.overlap_blocks, c.tiers) for c in by_tokens] == [("pool", 2, {"CPU": 2})]
    assert state.counters.stored_blocks == 3
    assert state.digest() == state.digest_from_scratch()
