"""TensorRT-LLM's streaming KV events (KV cache manager V2): decoded exactly, encoded byte for byte.

The reference payload is built here with msgspec structs declared to TensorRT-LLM's documented layout
(``tensorrt_llm/_torch/pyexecutor/kv_cache_events.py``: map events tagged by class name, ``omit_defaults``,
fields without a default always written, the positional ``[ts, events, data_parallel_rank]`` envelope), not
with kvmesh's encoder, so the decoder is checked against the producer's shape.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvmesh.core import wire
from kvmesh.core.normalize import Normalizer


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _MmKey(msgspec.Struct, omit_defaults=True, gc=False, tag="mm_key"):
    hash: str
    start_offset: int
    uuid: str | None = None


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int | str]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    mm_keys: list[list[_MmKey]] | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(_Event):
    pass


BS = 32
TOKENS = list(range(100, 100 + 2 * BS))
H0, H1, H2 = 0x1111_2222_3333_4444, (1 << 64) - 5, 0x0102_0304_0506_0708


def _reference(mm: bool = False) -> bytes:
    events: list[Any] = [
        BlockStored([H0, H1], None, list(TOKENS), BS, None, "GPU", None),
        BlockStored(
            [H2],
            H1,
            list(range(500, 500 + BS)),
            BS,
            None,
            "GPU",
            None,
            mm_keys=[[_MmKey("9f" * 16, 4, "img-1")]] if mm else None,
        ),
        BlockRemoved([H0], "GPU"),
        AllBlocksCleared(),
    ]
    return msgspec.msgpack.encode(_Batch(1700000000.25, events, 3))


def test_trtllm_batch_decodes_exactly() -> None:
    """Every event TensorRT-LLM's streaming source emits decodes field for field, rank and medium included."""
    batch = wire.decode_batch(_reference(mm=True))
    assert batch.ts == 1700000000.25
    assert batch.dp_rank == 3
    assert (batch.unknown_events, batch.errors) == (0, ())
    assert batch.events == (
        wire.BlockStored(
            block_hashes=(H0, H1),
            parent_block_hash=None,
            token_ids=tuple(TOKENS),
            block_size=BS,
            medium="GPU",
        ),
        wire.BlockStored(
            block_hashes=(H2,),
            parent_block_hash=H1,
            token_ids=tuple(range(500, 500 + BS)),
            block_size=BS,
            medium="GPU",
            extra_keys=((("9f" * 16, 4),),),
        ),
        wire.BlockRemoved(block_hashes=(H0,), medium="GPU"),
        wire.AllBlocksCleared(),
    )


def test_trtllm_encoder_writes_the_reference_bytes() -> None:
    """`encode_batch(producer="trtllm")` writes exactly the bytes TensorRT-LLM's structs write (mm keys aside:
    the reference's optional uuid is not kept)."""
    batch = wire.decode_batch(_reference())
    assert wire.encode_batch(batch, producer="trtllm", version="1.3.0rc21") == _reference()
    with pytest.raises(ValueError, match="outside the releases"):
        wire.encode_batch(batch, producer="trtllm", version="1.2.0")


def test_trtllm_multimodal_blocks_do_not_match_text_blocks() -> None:
    """A block with an image segment (``mm_keys``) gets another local hash than the same token ids as text."""
    text = Normalizer(block_size=BS).normalize(wire.decode_batch(_reference(mm=False)))
    image = Normalizer(block_size=BS).normalize(wire.decode_batch(_reference(mm=True)))
    assert text.events[0] == image.events[0]  # the text-only first event is the same
    assert text.events[1].local_hashes != image.events[1].local_hashes  # type: ignore[union-attr]
    assert text.events[1].engine_hashes == image.events[1].engine_hashes == [H2]  # type: ignore[union-attr]


def test_trtllm_pull_api_events_and_bad_mm_keys_are_counted_not_applied() -> None:
    """The pull API's ``created`` / ``updated`` event maps carry no cache contents: counted as unknown and
    skipped; a malformed ``mm_keys`` drops that event alone with its index."""
    created = {"type": "created", "num_blocks_per_cache_level": [1024, 4096]}
    updated = {"type": "updated", "block_hash": H0, "cache_level": {"old_value": 0, "new_value": 1}}
    bad = {
        "type": "BlockStored",
        "block_hashes": [H2],
        "parent_block_hash": None,
        "token_ids": list(range(BS)),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "mm_keys": [[{"type": "mm_key", "hash": 7, "start_offset": 0}]],
    }
    good = msgspec.msgpack.decode(_reference(mm=True))[1][1]
    batch = wire.decode_batch(msgspec.msgpack.encode([2.0, [created, updated, bad, good], 0]))
    assert batch.unknown_events == 2
    assert [(e.index, str(e)) for e in batch.errors] == [
        (
            2,
            "event 2 (BlockStored): mm_keys holds an entry that is not a {hash: string, start_offset: int} map",
        )
    ]
    assert len(batch.events) == 1 and batch.events[0].extra_keys == ((("9f" * 16, 4),),)  # type: ignore[union-attr]
