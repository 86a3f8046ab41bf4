"""Tests for kvmesh.core.wire: captured frames, every release generation, hash forms and bad input."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvmesh.core.errors import (
    InvalidEventError,
    KvmeshError,
    NotABatchError,
    PayloadDecodeError,
    WireError,
)
from kvmesh.core.wire import (
    SEQ_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    KVEvent,
    ReplayReply,
    decode_batch,
    decode_replay_reply,
    decode_seq,
    encode_batch,
    encode_replay_request,
    encode_seq,
    engine_key,
)

FRAMES_DIR = Path(__file__).resolve().parent.parent / "data" / "frames"
FRAME_FILES = sorted(p.name for p in FRAMES_DIR.glob("*.json"))
TS = 1700000000.25
TS_HEX = "cb41d954fc40100000"
END = b"\xff" * 8


def _enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


@cache
def _load(name: str) -> dict[str, Any]:
    return json.loads((FRAMES_DIR / name).read_text())  # type: ignore[no-any-return]


def _frames(hex_frames: list[str]) -> list[bytes]:
    return [bytes.fromhex(h) for h in hex_frames]


# ----------------------------------------------------------------------------------------------------------
# An independent converter from a file's generic `decoded` JSON to the expected dataclasses.

_STORED_BY_POSITION = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_BY_POSITION = ("block_hashes", "medium", "group_idx")
_STORED_NAMES = {f.name for f in fields(BlockStored)}
_REMOVED_NAMES = set(BlockRemoved.__struct_fields__)


def _json_hash(v: Any) -> Any:
    return bytes.fromhex(v["hex"]) if isinstance(v, dict) else v


def _deep_tuple(v: Any) -> Any:
    return tuple(_deep_tuple(x) for x in v) if isinstance(v, list) else v


def _event_from_json(ev: Any) -> KVEvent:
    if isinstance(ev, list):
        tag, values = ev[0], ev[1:]
        names = _STORED_BY_POSITION if tag == "BlockStored" else _REMOVED_BY_POSITION
        raw = dict(zip(names, values, strict=False))
        if tag == "BlockStored" and len(values) >= 7 and isinstance(values[6], dict):
            del raw["lora_name"]
            raw["cache_salt"] = values[6]["cache_salt"]
    else:
        tag = ev["type"]
        raw = {k: v for k, v in ev.items() if k != "type"}
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raw["block_hashes"] = tuple(_json_hash(h) for h in raw["block_hashes"])
    if tag == "BlockRemoved":
        return BlockRemoved(**{k: v for k, v in raw.items() if k in _REMOVED_NAMES})
    assert tag == "BlockStored"
    kept = {k: v for k, v in raw.items() if k in _STORED_NAMES}
    kept["parent_block_hash"] = _json_hash(kept["parent_block_hash"])
    kept["token_ids"] = tuple(kept["token_ids"])
    if kept.get("extra_keys") is not None:
        kept["extra_keys"] = _deep_tuple(kept["extra_keys"])
    return BlockStored(**kept)


def _batch_from_json(decoded: list[Any]) -> EngineBatch:
    dp = decoded[2] if len(decoded) == 3 else None
    return EngineBatch(ts=decoded[0], events=tuple(_event_from_json(e) for e in decoded[1]), dp_rank=dp)


# ----------------------------------------------------------------------------------------------------------
# Captured frames


def test_every_capture_is_present() -> None:
    """The copied capture set holds all eight producer/release files."""
    assert FRAME_FILES == [
        "sglang-0.5.22.json",
        "sglang-0.5.9.json",
        "vllm-0.10.2-bytes.json",
        "vllm-0.17.0.json",
        "vllm-0.24.0.json",
        "vllm-0.33.0-dp1.json",
        "vllm-0.33.0.json",
        "vllm-0.9.1.json",
    ]


@pytest.mark.parametrize("name", FRAME_FILES)
def test_captured_batches_decode_like_generic_json(name: str) -> None:
    """Every captured payload decodes to the events its generic JSON decode describes, with its seq."""
    data = _load(name)
    assert data["batches"]
    for batch in data["batches"]:
        topic, seq_frame, payload = _frames(batch["frames_hex"])
        assert topic == data["topic"].encode()
        assert decode_seq(seq_frame) == batch["seq"]
        got = decode_batch(payload)
        assert got == _batch_from_json(batch["decoded"]), batch["name"]
        assert got.dp_rank == data["dp_rank"]
        assert got.errors == ()
        assert got.unknown_events == 0


H_A = 1234605616436508552  # 0x1122334455667788
H_B = 17357386176853808775  # 0xf0e1d2c3b4a59687 (>= 2**63, msgpack uint64)
H_P = 72623859790382856  # 0x0102030405060708
H_SG = -1070935975390360081  # 0xf123456789abcdef as signed int64
BIN_A = bytes(range(32))
BIN_B = bytes(range(32, 64))
BIN_P = bytes(range(0xE0, 0x100))
EXTRA_FULL = (("my-lora", ("mm-hash-abc", 0), "salt-1"),)

HAND_EXPECTED: dict[str, tuple[int, EngineBatch]] = {
    "vllm-0.9.1.json": (
        5,
        EngineBatch(
            ts=TS,
            dp_rank=0,
            events=(
                BlockStored(
                    block_hashes=(-4242424242424242,),
                    parent_block_hash=1234567890123,
                    token_ids=(13, 14, 15, 16),
                    block_size=4,
                    lora_id=7,
                ),
                BlockRemoved(block_hashes=(-4242424242424242,)),
            ),
        ),
    ),
    "vllm-0.10.2-bytes.json": (
        4,
        EngineBatch(
            ts=TS,
            dp_rank=0,
            events=(
                BlockRemoved(block_hashes=(BIN_P,), medium="GPU"),
                BlockStored(
                    block_hashes=(BIN_B,),
                    parent_block_hash=None,
                    token_ids=(42, 43, 44, 45),
                    block_size=4,
                    lora_id=None,
                    medium="GPU",
                ),
                AllBlocksCleared(),
            ),
        ),
    ),
    "vllm-0.17.0.json": (
        5,
        EngineBatch(
            ts=TS,
            dp_rank=0,
            events=(
                BlockStored(
                    block_hashes=(H_A,),
                    parent_block_hash=H_P,
                    token_ids=(13, 14, 15, 16),
                    block_size=4,
                    lora_id=7,
                    medium="CPU",
                    lora_name="my-lora",
                    extra_keys=EXTRA_FULL,
                ),
                BlockRemoved(block_hashes=(H_A,), medium="CPU"),
            ),
        ),
    ),
    "vllm-0.24.0.json": (
        5,
        EngineBatch(
            ts=TS,
            dp_rank=0,
            events=(
                BlockStored(
                    block_hashes=(H_A,),
                    parent_block_hash=H_P,
                    token_ids=(13, 14, 15, 16),
                    block_size=4,
                    lora_id=7,
                    medium="CPU",
                    lora_name="my-lora",
                    extra_keys=EXTRA_FULL,
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=1024,
                ),
                BlockRemoved(block_hashes=(H_A,), medium="CPU", group_idx=1),
            ),
        ),
    ),
    "vllm-0.33.0.json": (
        0,
        EngineBatch(
            ts=TS,
            dp_rank=0,
            events=(
                BlockStored(
                    block_hashes=(H_A, H_B),
                    parent_block_hash=None,
                    token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
                    block_size=4,
                    medium="GPU",
                    extra_keys=(None, None),
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                ),
            ),
        ),
    ),
    "vllm-0.33.0-dp1.json": (
        5,
        EngineBatch(
            ts=TS,
            dp_rank=1,
            events=(
                BlockStored(
                    block_hashes=(H_A,),
                    parent_block_hash=H_P,
                    token_ids=(13, 14, 15, 16),
                    block_size=4,
                    lora_id=7,
                    medium="CPU",
                    lora_name="my-lora",
                    extra_keys=EXTRA_FULL,
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=1024,
                    session_id="sess-42",
                ),
                BlockRemoved(block_hashes=(H_A,), medium="CPU", group_idx=1),
            ),
        ),
    ),
    "sglang-0.5.9.json": (
        0,
        EngineBatch(
            ts=TS,
            dp_rank=0,
            events=(
                BlockStored(
                    block_hashes=(H_SG, H_A),
                    parent_block_hash=None,
                    token_ids=(1, 2, 3, 4),
                    block_size=2,
                    medium="GPU",
                ),
            ),
        ),
    ),
    "sglang-0.5.22.json": (
        4,
        EngineBatch(
            ts=TS,
            dp_rank=0,
            events=(
                BlockStored(
                    block_hashes=(H_SG,),
                    parent_block_hash=H_P,
                    token_ids=(1, 2),
                    block_size=2,
                    medium="CPU_PINNED",
                    cache_salt="tenant-a",
                    session_id="sess-1",
                    lora_name="my-lora",
                ),
            ),
        ),
    ),
}


@pytest.mark.parametrize("name", FRAME_FILES)
def test_captured_batch_matches_hand_written_values(name: str) -> None:
    """One batch per capture decodes to dataclass values written out by hand."""
    index, expected = HAND_EXPECTED[name]
    batch = _load(name)["batches"][index]
    assert batch["seq"] == index
    assert decode_batch(bytes.fromhex(batch["frames_hex"][2])) == expected


@pytest.mark.parametrize("name", FRAME_FILES)
def test_captured_batches_re_encode_byte_exact(name: str) -> None:
    """encode_batch reproduces the captured payload bytes unless the batch uses fields kvmesh drops."""
    data = _load(name)
    dropped = {"locality", "ownership", "lookahead_token_ids"}
    exact = 0
    for batch in data["batches"]:
        payload = bytes.fromhex(batch["frames_hex"][2])
        decoded = decode_batch(payload)
        again = encode_batch(
            decoded, producer=data["producer"], version=data["version"], hash_form=data["hash_form"]
        )
        if any(isinstance(e, dict) and dropped & e.keys() for e in batch["decoded"][1]):
            assert again != payload
            assert decode_batch(again) == decoded
        else:
            assert again == payload, batch["name"]
            exact += 1
    assert exact >= 4


def _has_replay_topic(producer: str, version: str) -> bool:
    major_minor_patch = tuple(int(x) for x in version.split(".")[:3])
    return major_minor_patch >= ((0, 26, 0) if producer == "vllm" else (0, 5, 22))


@pytest.mark.parametrize("name", FRAME_FILES)
def test_captured_replay_exchange(name: str) -> None:
    """The DEALER request matches encode_replay_request and every reply parses with seqs, topic and END."""
    data = _load(name)
    replay = data["replay"]
    assert replay["client"] == "DEALER"
    request = _frames(replay["request_frames_hex"])
    start = decode_seq(request[1])
    assert request == encode_replay_request(start)
    live = {b["seq"]: bytes.fromhex(b["frames_hex"][2]) for b in data["batches"]}
    replies = [decode_replay_reply(_frames(f)) for f in replay["reply_frames_hex"]]
    with_topic = _has_replay_topic(data["producer"], data["version"])
    expected_frames = 4 if with_topic else 3
    assert all(len(f) == expected_frames for f in replay["reply_frames_hex"])

    *batches, end = replies
    assert [r.seq for r in batches] == list(range(start, max(live) + 1))
    for reply in batches:
        assert not reply.is_end
        assert reply.topic == (data["topic"].encode() if with_topic else None)
        assert reply.payload == live[reply.seq]
        assert decode_batch(reply.payload).dp_rank == data["dp_rank"]
    assert end == ReplayReply(seq=SEQ_END, payload=b"", topic=b"" if with_topic else None, is_end=True)


# ----------------------------------------------------------------------------------------------------------
# Annotated bytes from the protocol notes (§1.5)

HEX_090 = (
    "92" + TS_HEX + "91" + "96" + "ab426c6f636b53746f726564"
    "92" + "d3fff0ed89a20b364e" + "cf001ba1d901961c71"
    "c0" + "980102030405060708" + "04" + "c0"
)
HEX_0220 = (
    "93" + TS_HEX + "91" + "9c" + "ab426c6f636b53746f726564"
    "92" + "cf1122334455667788" + "cff0e1d2c3b4a59687"
    "c0" + "980102030405060708" + "04" + "c0" + "a3475055" + "c0" + "92c0c0" + "00"
    "ae66756c6c5f617474656e74696f6e" + "c0" + "00"
)
HEX_0330_REMOVED = (
    "93" + TS_HEX + "91" + "84" + "a474797065" + "ac426c6f636b52656d6f766564"
    "ac626c6f636b5f686173686573" + "91" + "cff0e1d2c3b4a59687"
    "a66d656469756d" + "a3475055" + "a967726f75705f696478" + "00" + "00"
)


def test_annotated_bytes_vllm_0_9_0() -> None:
    """The notes' 0.9.0 BlockStored bytes decode exactly and encode_batch reproduces them."""
    expected = EngineBatch(
        ts=TS,
        dp_rank=None,
        events=(
            BlockStored(
                block_hashes=(-4242424242424242, 7777777777777777),
                parent_block_hash=None,
                token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
                block_size=4,
                lora_id=None,
            ),
        ),
    )
    payload = bytes.fromhex(HEX_090)
    assert decode_batch(payload) == expected
    assert encode_batch(expected, version="0.9.0") == payload


def test_annotated_bytes_vllm_0_22_0() -> None:
    """The notes' 0.22.0 (generation G) BlockStored bytes decode exactly and re-encode identically."""
    expected = EngineBatch(
        ts=TS,
        dp_rank=0,
        events=(
            BlockStored(
                block_hashes=(H_A, H_B),
                parent_block_hash=None,
                token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=(None, None),
                group_idx=0,
                kv_cache_spec_kind="full_attention",
                kv_cache_spec_sliding_window=None,
            ),
        ),
    )
    payload = bytes.fromhex(HEX_0220)
    assert decode_batch(payload) == expected
    assert encode_batch(expected, version="0.22.0") == payload


def test_annotated_bytes_vllm_0_33_0_removed() -> None:
    """The notes' 0.33.0 BlockRemoved map bytes decode exactly and re-encode identically."""
    expected = EngineBatch(
        ts=TS, dp_rank=0, events=(BlockRemoved(block_hashes=(H_B,), medium="GPU", group_idx=0),)
    )
    payload = bytes.fromhex(HEX_0330_REMOVED)
    assert decode_batch(payload) == expected
    assert encode_batch(expected, version="0.33.0") == payload


# ----------------------------------------------------------------------------------------------------------
# Every release generation, from payloads laid out by hand per the notes' tables (§1.4, §5)

TOK = [1, 2, 3, 4, 5, 6, 7, 8]
ALL_STORED: dict[str, Any] = {
    "token_ids": tuple(TOK),
    "block_size": 4,
    "lora_id": 3,
    "medium": "GPU",
    "lora_name": "ad-1",
    "extra_keys": (("ad-1",), None),
    "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 128,
    "cache_salt": "tenant-a",
    "session_id": "sess-1",
}
ALL_REMOVED: dict[str, Any] = {"medium": "GPU", "group_idx": 1}

# Hash families: vLLM < 0.10.2 Python hash() (signed), vLLM >= 0.10.2 uint64, SGLang signed int64.
HASHES_OLD = (-4242424242424242, 7777777777777777)
PARENT_OLD = 1234567890123
HASHES_NEW = (H_B, H_A)
HASHES_SG = (H_SG, H_A)


@dataclass(frozen=True)
class Row:
    """One row of a generation table: releases, hand-built payload and what decodes from it."""

    id: str
    producer: str
    versions: tuple[str, ...]
    hashes: tuple[int, ...]
    parent: int
    dp_rank: int | None
    stored_fields: tuple[str, ...]
    removed_fields: tuple[str, ...]
    wire: list[Any]  # the payload as plain msgpack values (msgspec.Raw where the header size matters)
    salted: bool = False


def _map16(d: dict[str, Any]) -> msgspec.Raw:
    """A map encoded with a map16 header, as msgspec writes structs with more than 15 fields."""
    body = _enc(d)
    assert body[0] == 0x80 | len(d)
    return msgspec.Raw(b"\xde" + len(d).to_bytes(2, "big") + body[1:])


def _vllm_rows() -> list[Row]:
    h, p = list(HASHES_NEW), H_P
    ho, po = list(HASHES_OLD), PARENT_OLD
    base = ("lora_id",)
    c, d, e = (*base, "medium"), (*base, "medium", "lora_name"), (*base, "medium", "lora_name", "extra_keys")
    f = (*e, "group_idx")
    g = (*f, "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
    k = (*g, "session_id")
    sparse_map = {
        "type": "BlockStored",
        "block_hashes": h[:1],
        "parent_block_hash": None,
        "token_ids": TOK[:4],
        "block_size": 4,
        "lora_id": None,
        "medium": None,
        "lora_name": None,
    }
    full_map_h = {
        "type": "BlockStored",
        "block_hashes": h,
        "parent_block_hash": p,
        "token_ids": TOK,
        "block_size": 4,
        "lora_id": 3,
        "medium": "GPU",
        "lora_name": "ad-1",
        "extra_keys": [["ad-1"], None],
        "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 128,
    }
    full_map_k = {**full_map_h, "session_id": "sess-1"}
    removed_map = {"type": "BlockRemoved", "block_hashes": h[:1], "medium": "GPU", "group_idx": 1}
    cleared_map = {"type": "AllBlocksCleared"}
    bs = "BlockStored"
    rows = [
        Row("vllm-A", "vllm", ("0.9.0", "0.9.0.1"), HASHES_OLD, po, None, base, (),
            [TS, [[bs, ho, po, TOK, 4, 3], [bs, ho[:1], None, TOK[:4], 4, None],
                  ["BlockRemoved", ho[:1]], ["AllBlocksCleared"]]]),
        Row("vllm-B", "vllm", ("0.9.1", "0.10.1.1"), HASHES_OLD, po, 2, base, (),
            [TS, [[bs, ho, po, TOK, 4, 3], [bs, ho[:1], None, TOK[:4], 4, None],
                  ["BlockRemoved", ho[:1]], ["AllBlocksCleared"]], 2]),
        Row("vllm-C", "vllm", ("0.10.2", "0.11.0", "0.13.0"), HASHES_NEW, p, 2, c, ("medium",),
            [TS, [[bs, h, p, TOK, 4, 3, "GPU"], [bs, h[:1], None, TOK[:4], 4, None, None],
                  ["BlockRemoved", h[:1], "GPU"], ["AllBlocksCleared"]], 2]),
        Row("vllm-D", "vllm", ("0.14.0", "0.16.0"), HASHES_NEW, p, 2, d, ("medium",),
            [TS, [[bs, h, p, TOK, 4, 3, "GPU", "ad-1"], [bs, h[:1], None, TOK[:4], 4, None, None, None],
                  ["BlockRemoved", h[:1], "GPU"], ["AllBlocksCleared"]], 2]),
        Row("vllm-E", "vllm", ("0.17.0", "0.19.1"), HASHES_NEW, p, 2, e, ("medium",),
            [TS, [[bs, h, p, TOK, 4, 3, "GPU", "ad-1", [["ad-1"], None]],
                  [bs, h[:1], None, TOK[:4], 4, None, None, None, None],
                  ["BlockRemoved", h[:1], "GPU"], ["AllBlocksCleared"]], 2]),
        Row("vllm-F", "vllm", ("0.20.0", "0.21.0"), HASHES_NEW, p, 2, f, ("medium", "group_idx"),
            [TS, [[bs, h, p, TOK, 4, 3, "GPU", "ad-1", [["ad-1"], None], 1],
                  [bs, h[:1], None, TOK[:4], 4, None, None, None, None, None],
                  ["BlockRemoved", h[:1], "GPU", 1], ["AllBlocksCleared"]], 2]),
        Row("vllm-G", "vllm", ("0.22.0", "0.23.0"), HASHES_NEW, p, 2, g, ("medium", "group_idx"),
            [TS, [[bs, h, p, TOK, 4, 3, "GPU", "ad-1", [["ad-1"], None], 1, "sliding_window", 128],
                  [bs, h[:1], None, TOK[:4], 4, None, None, None, None, None, None, None],
                  ["BlockRemoved", h[:1], "GPU", 1], ["AllBlocksCleared"]], 2]),
        Row("vllm-H", "vllm", ("0.24.0", "0.25.1"), HASHES_NEW, p, 2, g, ("medium", "group_idx"),
            [TS, [full_map_h, sparse_map, removed_map, cleared_map], 2]),
        Row("vllm-I", "vllm", ("0.26.0", "0.28.0"), HASHES_NEW, p, 2, g, ("medium", "group_idx"),
            [TS, [full_map_h, sparse_map, removed_map, cleared_map], 2]),
        Row("vllm-J", "vllm", ("0.29.0",), HASHES_NEW, p, 2, g, ("medium", "group_idx"),
            [TS, [full_map_h, sparse_map, removed_map, cleared_map], 2]),
        Row("vllm-K", "vllm", ("0.30.0", "0.32.0"), HASHES_NEW, p, 2, k, ("medium", "group_idx"),
            [TS, [full_map_k, sparse_map, removed_map, cleared_map], 2]),
        Row("vllm-L", "vllm", ("0.33.0",), HASHES_NEW, p, 2, k, ("medium", "group_idx"),
            [TS, [_map16(full_map_k), _map16(sparse_map), removed_map, cleared_map], 2]),
    ]  # fmt: skip
    return rows


def _sglang_rows() -> list[Row]:
    h, p = list(HASHES_SG), H_P
    bs = "BlockStored"
    base = ("lora_id",)
    med = (*base, "medium")
    arr5 = [[bs, h, p, TOK, 4, 3], [bs, h[:1], None, TOK[:4], 4, None],
            ["BlockRemoved", h], ["AllBlocksCleared"]]  # fmt: skip
    arr6 = [[bs, h, p, TOK, 4, 3, "GPU"], [bs, h[:1], None, TOK[:4], 4, None, None],
            ["BlockRemoved", h, "GPU"], ["AllBlocksCleared"]]  # fmt: skip
    salted = [[bs, h, p, TOK, 4, 3, "GPU", {"cache_salt": "tenant-a"}],
              [bs, h[:1], None, TOK[:4], 4, None, None],
              ["BlockRemoved", h, "GPU"], ["AllBlocksCleared"]]  # fmt: skip
    map_full = {
        "type": bs,
        "block_hashes": h,
        "parent_block_hash": p,
        "token_ids": TOK,
        "block_size": 4,
        "lora_id": 3,
        "medium": "GPU",
        "cache_salt": "tenant-a",
        "session_id": "sess-1",
    }
    map_sparse = {
        "type": bs,
        "block_hashes": h[:1],
        "parent_block_hash": None,
        "token_ids": TOK[:4],
        "block_size": 4,
        "lora_id": None,
    }
    removed_map = {"type": "BlockRemoved", "block_hashes": h, "medium": "GPU"}
    cleared_map = {"type": "AllBlocksCleared"}
    map20 = (*med, "cache_salt", "session_id")
    return [
        Row("sglang-0.4.6.post5", "sglang", ("0.4.6.post5", "0.4.6"), HASHES_SG, p, None, base, (),
            [TS, arr5]),
        Row("sglang-0.4.7..0.5.8", "sglang", ("0.4.7", "0.5.0", "0.5.8"), HASHES_SG, p, 2, base, (),
            [TS, arr5, 2]),
        Row("sglang-0.5.9..0.5.17", "sglang", ("0.5.9", "0.5.17"), HASHES_SG, p, 2, med, ("medium",),
            [TS, arr6, 2]),
        Row("sglang-0.5.18..0.5.19-unsalted", "sglang", ("0.5.18", "0.5.19"), HASHES_SG, p, 2, med,
            ("medium",), [TS, arr6, 2]),
        Row("sglang-0.5.18..0.5.19-salted", "sglang", ("0.5.18", "0.5.19"), HASHES_SG, p, 2,
            (*med, "cache_salt"), ("medium",), [TS, salted, 2], salted=True),
        Row("sglang-0.5.20..0.5.21", "sglang", ("0.5.20", "0.5.21"), HASHES_SG, p, 2, map20, ("medium",),
            [TS, [map_full, map_sparse, removed_map, cleared_map], 2]),
        Row("sglang-0.5.22..0.5.23", "sglang", ("0.5.22", "0.5.23"), HASHES_SG, p, 2, (*map20, "lora_name"),
            ("medium",), [TS, [{**map_full, "lora_name": "ad-1"}, map_sparse, removed_map, cleared_map], 2]),
    ]  # fmt: skip


ROWS = _vllm_rows() + _sglang_rows()


def _row_expected(row: Row) -> EngineBatch:
    """The batch a row's payload carries: the full event set reduced to the row's fields."""
    stored = BlockStored(
        block_hashes=row.hashes,
        parent_block_hash=row.parent,
        **{k: ALL_STORED[k] for k in ("token_ids", "block_size", *row.stored_fields)},
    )
    sparse = BlockStored(
        block_hashes=row.hashes[:1], parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=4
    )
    removed_hashes = row.hashes if row.producer == "sglang" else row.hashes[:1]
    removed = BlockRemoved(block_hashes=removed_hashes, **{k: ALL_REMOVED[k] for k in row.removed_fields})
    return EngineBatch(ts=TS, events=(stored, sparse, removed, AllBlocksCleared()), dp_rank=row.dp_rank)


def _row_input(row: Row) -> EngineBatch:
    """The row's batch with every optional field set, including ones the release cannot carry."""
    expected = _row_expected(row)
    stored, sparse, removed, cleared = expected.events
    assert isinstance(stored, BlockStored)
    assert isinstance(removed, BlockRemoved)
    salt = {"cache_salt": None} if row.id.endswith("-unsalted") else {}
    full = BlockStored(
        block_hashes=stored.block_hashes, parent_block_hash=stored.parent_block_hash, **{**ALL_STORED, **salt}
    )
    full_removed = BlockRemoved(block_hashes=removed.block_hashes, **ALL_REMOVED)
    return EngineBatch(ts=TS, events=(full, sparse, full_removed, cleared), dp_rank=2)


def _row_params() -> list[Any]:
    return [pytest.param(r, v, id=f"{r.id}@{v}") for r in ROWS for v in r.versions]


def test_generation_rows_cover_the_tables() -> None:
    """The rows cover vLLM generations A–L and the SGLang table, with and without salt."""
    assert [r.id for r in ROWS if r.producer == "vllm"] == [f"vllm-{g}" for g in "ABCDEFGHIJKL"]
    assert sum(r.producer == "sglang" for r in ROWS) == 7


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_generation_hand_built_payload_decodes(row: Row) -> None:
    """A payload laid out by hand per the release's table decodes to the exact events."""
    assert decode_batch(_enc(row.wire)) == _row_expected(row)


@pytest.mark.parametrize(("row", "version"), _row_params())
def test_generation_encode_round_trip(row: Row, version: str) -> None:
    """decode_batch(encode_batch(b, version=v)) returns b reduced to the fields that release carries."""
    payload = encode_batch(_row_input(row), producer=row.producer, version=version)
    assert decode_batch(payload) == _row_expected(row)


@pytest.mark.parametrize(("row", "version"), _row_params())
def test_generation_encode_matches_hand_built_bytes(row: Row, version: str) -> None:
    """encode_batch writes the same bytes as the hand-built payload of the release's table row."""
    assert encode_batch(_row_input(row), producer=row.producer, version=version) == _enc(row.wire)


def test_vllm_0_33_stored_uses_map16_header() -> None:
    """vLLM 0.33's BlockStored map has a map16 header even with few entries; 0.32's uses fixmap."""
    batch = EngineBatch(
        ts=TS,
        dp_rank=0,
        events=(BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(1,), block_size=1),),
    )
    assert encode_batch(batch, version="0.33.0")[11:14] == b"\xde\x00\x08"
    assert encode_batch(batch, version="0.32.0")[11] == 0x88


# ----------------------------------------------------------------------------------------------------------
# Hash forms and engine keys


def _removed_payload(hash_hex: str) -> bytes:
    return bytes.fromhex("93" + TS_HEX + "91" + "92" + "ac426c6f636b52656d6f766564" + "91" + hash_hex + "00")


@pytest.mark.parametrize(
    ("hash_hex", "expected"),
    [
        pytest.param("d3fff0ed89a20b364e", -4242424242424242, id="int64-d3"),
        pytest.param("d38000000000000000", -(2**63), id="int64-min"),
        pytest.param("cff0e1d2c3b4a59687", H_B, id="uint64-cf"),
        pytest.param("cfffffffffffffffff", 2**64 - 1, id="uint64-max"),
        pytest.param("05", 5, id="fixint"),
        pytest.param("c420" + BIN_A.hex(), BIN_A, id="bin32"),
        pytest.param("c410" + bytes(range(16)).hex(), bytes(range(16)), id="bin16"),
        pytest.param("c408" + "0102030405060708", bytes(range(1, 9)), id="bin8"),
        pytest.param("c401" + "ab", b"\xab", id="bin1"),
    ],
)
def test_hash_forms_decode_as_sent(hash_hex: str, expected: int | bytes) -> None:
    """Hashes decode exactly as sent: signed and unsigned 64-bit ints and bin of any width."""
    batch = decode_batch(_removed_payload(hash_hex))
    assert batch.events == (BlockRemoved(block_hashes=(expected,)),)
    event = batch.events[0]
    assert isinstance(event, BlockRemoved)
    assert type(event.block_hashes[0]) is type(expected)


def test_engine_key_folds_signed_and_unsigned() -> None:
    """Signed and unsigned forms of one 64-bit value give the same key."""
    assert engine_key(-1) == engine_key(2**64 - 1) == 2**64 - 1
    assert engine_key(-4242424242424242) == (-4242424242424242) % 2**64
    assert engine_key(H_SG) == 0xF123456789ABCDEF
    assert engine_key(0) == 0
    assert engine_key(H_B) == H_B


def test_engine_key_of_bytes_is_vllms_int_form() -> None:
    """A bin hash of any width keys like its last 8 bytes big-endian, i.e. vLLM's int form."""
    digest = bytes.fromhex("52a7f141" + "00" * 20) + (0x1A1EB4E3EDD9361A).to_bytes(8, "big")
    assert len(digest) == 32
    assert engine_key(digest) == 1882140585328457242 == engine_key(1882140585328457242)
    assert engine_key(BIN_A) == int.from_bytes(BIN_A[-8:], "big") == int.from_bytes(BIN_A, "big") % 2**64
    assert engine_key(bytes(range(16))) == int.from_bytes(bytes(range(8, 16)), "big")
    assert engine_key(b"\x01\x02") == 0x0102
    assert engine_key(b"\xff" * 8) == engine_key(-1)


@pytest.mark.parametrize("bad", [b"", True, 1.5, "ab", None])
def test_engine_key_rejects_non_hashes(bad: Any) -> None:
    """Empty bytes and non-hash types raise WireError (a ValueError)."""
    with pytest.raises(WireError):
        engine_key(bad)


def test_int_form_encoding_converts_bytes_like_vllm() -> None:
    """vLLM ≥ 0.10.2 int form turns bin hashes into their engine key; the bytes form keeps them as bin."""
    stored = BlockStored(block_hashes=(BIN_A, BIN_B), parent_block_hash=BIN_P, token_ids=(1, 2), block_size=1)
    batch = EngineBatch(ts=TS, dp_rank=0, events=(stored,))
    as_int = decode_batch(encode_batch(batch, version="0.10.2")).events[0]
    assert isinstance(as_int, BlockStored)
    assert as_int.block_hashes == (engine_key(BIN_A), engine_key(BIN_B))
    assert as_int.parent_block_hash == engine_key(BIN_P)
    payload = encode_batch(batch, version="0.10.2", hash_form="bytes")
    assert bytes.fromhex("c420") + BIN_A in payload
    assert decode_batch(payload).events == (stored,)


# ----------------------------------------------------------------------------------------------------------
# Tolerance


def test_shorter_and_longer_arrays_are_tolerated() -> None:
    """Missing trailing array fields become None and extra trailing elements are ignored."""
    bs = "BlockStored"
    payload = _enc(
        [
            TS,
            [
                [bs, [1], None, [1, 2], 2],
                [bs, [2], 1, [3, 4], 2, 5, "GPU", "ad", None, 0, "full_attention", None, "extra", 99],
                ["BlockRemoved", [3], "CPU", 1, "LOCAL", "tier-2"],
                ["AllBlocksCleared", "junk"],
            ],
            0,
        ]
    )
    assert decode_batch(payload).events == (
        BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(1, 2), block_size=2),
        BlockStored(
            block_hashes=(2,),
            parent_block_hash=1,
            token_ids=(3, 4),
            block_size=2,
            lora_id=5,
            medium="GPU",
            lora_name="ad",
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockRemoved(block_hashes=(3,), medium="CPU", group_idx=1),
        AllBlocksCleared(),
    )


def test_map_events_ignore_order_and_unknown_keys() -> None:
    """Map events decode by name: key order does not matter and unknown keys are ignored."""
    payload = _enc(
        [
            TS,
            [
                {
                    "future_field": [1, 2],
                    "block_size": 2,
                    "token_ids": [1, 2],
                    "medium": "GPU",
                    "locality": "REMOTE",
                    "block_hashes": [7],
                    "type": "BlockStored",
                    "lookahead_token_ids": [[3]],
                },
                {"medium": "CPU", "block_hashes": [7], "ownership": "t", "type": "BlockRemoved"},
            ],
            3,
        ]
    )
    batch = decode_batch(payload)
    assert batch.events == (
        BlockStored(block_hashes=(7,), parent_block_hash=None, token_ids=(1, 2), block_size=2, medium="GPU"),
        BlockRemoved(block_hashes=(7,), medium="CPU"),
    )
    assert batch.dp_rank == 3


def test_array_and_map_events_mix_in_one_batch() -> None:
    """A batch may mix array events and map events (e.g. from a gateway merging streams)."""
    payload = _enc(
        [
            TS,
            [
                ["BlockRemoved", [1], "GPU"],
                {"type": "BlockRemoved", "block_hashes": [b"\x01\x02"], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )
    assert decode_batch(payload).events == (
        BlockRemoved(block_hashes=(1,), medium="GPU"),
        BlockRemoved(block_hashes=(b"\x01\x02",), medium="GPU"),
        AllBlocksCleared(),
    )


def test_long_token_lists_decode() -> None:
    """Long token lists (the bulk-validated path) decode and still reject a bad element."""
    tokens = list(range(1000, 1512))
    good = decode_batch(_enc([TS, [["BlockStored", [1], None, tokens, 512]], 0]))
    assert good.events[0] == BlockStored(
        block_hashes=(1,), parent_block_hash=None, token_ids=tuple(tokens), block_size=512
    )
    bad = decode_batch(_enc([TS, [["BlockStored", [1], None, [*tokens[:-1], True], 512]], 0]))
    assert bad.events == ()
    assert "token_ids" in bad.errors[0].reason


def test_int_ts_and_nil_dp_rank_are_accepted() -> None:
    """An integer ts becomes a float and a nil dp_rank becomes None."""
    batch = decode_batch(_enc([1700000000, [], None]))
    assert batch == EngineBatch(ts=1700000000.0, events=(), dp_rank=None)
    assert type(batch.ts) is float


def test_unknown_tags_are_counted_and_skipped() -> None:
    """Events with an unknown string tag (array or map) are counted, and the others decode."""
    payload = _enc(
        [
            TS,
            [
                ["BlockUpdated", [1]],
                ["AllBlocksCleared"],
                {"type": "Heartbeat", "at": 1},
                ["BlockRemoved", [2]],
            ],
            0,
        ]
    )
    batch = decode_batch(payload)
    assert batch.unknown_events == 2
    assert batch.errors == ()
    assert batch.events == (AllBlocksCleared(), BlockRemoved(block_hashes=(2,)))


# ----------------------------------------------------------------------------------------------------------
# Bad input


def _good_stored() -> list[Any]:
    return ["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, "GPU"]


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"\xc1", id="invalid-opcode"),
        pytest.param(b"", id="empty"),
        pytest.param(_enc([TS, [], 0]) + b"\x00", id="trailing-byte"),
        pytest.param(_enc([TS, [], 0]) + b"garbage", id="trailing-garbage"),
        pytest.param(_enc([TS, [_good_stored()], 0])[:-3], id="truncated"),
        pytest.param(b"\x91" * 5000 + b"\x90", id="too-deep"),
    ],
)
def test_non_msgpack_payload_raises_payload_decode_error(payload: bytes) -> None:
    """Bytes that are not exactly one msgpack value raise PayloadDecodeError."""
    with pytest.raises(PayloadDecodeError) as info:
        decode_batch(payload)
    assert isinstance(info.value, WireError)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KvmeshError)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param({"ts": TS, "events": [], "data_parallel_rank": 0}, id="map"),
        pytest.param(TS, id="float"),
        pytest.param([], id="empty-array"),
        pytest.param([TS], id="array-1"),
        pytest.param([TS, [], 0, 0], id="array-4"),
        pytest.param([TS, {"type": "AllBlocksCleared"}, 0], id="events-map"),
        pytest.param([TS, None, 0], id="events-nil"),
        pytest.param([TS, "events"], id="events-string"),
        pytest.param(["1700000000", [], 0], id="ts-string"),
        pytest.param([None, [], 0], id="ts-nil"),
        pytest.param([True, [], 0], id="ts-bool"),
        pytest.param([TS, [], "0"], id="dp-string"),
        pytest.param([TS, [], 1.0], id="dp-float"),
        pytest.param([TS, [], False], id="dp-bool"),
    ],
)
def test_non_batch_msgpack_raises_not_a_batch_error(value: Any) -> None:
    """Msgpack that is not a 2- or 3-element batch with an events array raises NotABatchError."""
    with pytest.raises(NotABatchError) as info:
        decode_batch(_enc(value))
    assert isinstance(info.value, WireError)


S = "BlockStored"


@pytest.mark.parametrize(
    ("event", "tag", "reason_part"),
    [
        pytest.param([S, [1], None, [1, 2], "2"], S, "block_size", id="block-size-str"),
        pytest.param([S, [1], None, [1, 2], 0], S, "block_size", id="block-size-0"),
        pytest.param([S, [1], None, [1, 2], True], S, "block_size", id="block-size-bool"),
        pytest.param([S, [1], None, "12", 2], S, "token_ids", id="tokens-str"),
        pytest.param([S, [1], None, [1, "2"], 2], S, "token_ids", id="token-str"),
        pytest.param([S, [1], None, [1, 2.0], 2], S, "token_ids", id="token-float"),
        pytest.param([S, [1], None, [[1, 2], [3, 4]], 2], S, "bigram", id="bigram"),
        pytest.param([S, 1, None, [1, 2], 2], S, "block_hashes", id="hashes-int"),
        pytest.param([S, [1.5], None, [1, 2], 2], S, "block_hashes", id="hash-float"),
        pytest.param([S, [None], None, [1, 2], 2], S, "block_hashes", id="hash-nil"),
        pytest.param([S, [True], None, [1, 2], 2], S, "block_hashes", id="hash-bool"),
        pytest.param([S, ["ab"], None, [1, 2], 2], S, "block_hashes", id="hash-str"),
        pytest.param([S, [b""], None, [1, 2], 2], S, "empty bin", id="hash-empty-bin"),
        pytest.param([S, [1], "p", [1, 2], 2], S, "parent_block_hash", id="parent-str"),
        pytest.param([S, [1], None, [1, 2], 2, "3"], S, "lora_id", id="lora-id-str"),
        pytest.param([S, [1], None, [1, 2], 2, None, 1], S, "medium", id="medium-int"),
        pytest.param([S, [1], None, [1, 2], 2, None, None, 5], S, "lora_name", id="lora-name-int"),
        pytest.param([S, [1], None, [1, 2], 2, None, None, None, "x"], S, "extra_keys", id="extra-keys-str"),
        pytest.param([S, [1], None, [1, 2], 2, None, None, None, ["x"]], S,
                     "extra_keys entry", id="extra-keys-entry-str"),
        pytest.param([S, [1], None, [1, 2], 2, None, None, None, None, "0"], S,
                     "group_idx", id="group-idx-str"),
        pytest.param([S, [1], None, [1, 2], 2, None, None, {"cache_salt": 5}], S,
                     "cache_salt", id="salt-int"),
        pytest.param([S, [1], None, [1, 2]], S, "at least 5", id="stored-too-short"),
        pytest.param(["BlockRemoved"], "BlockRemoved", "block_hashes", id="removed-too-short"),
        pytest.param(["BlockRemoved", [1], "GPU", "0"], "BlockRemoved", "group_idx", id="removed-group-str"),
        pytest.param({"type": S, "block_hashes": [1], "token_ids": [1]}, S,
                     "block_size", id="map-missing-block-size"),
        pytest.param({"type": S, "block_hashes": [1], "token_ids": [1], "block_size": 1,
                      "session_id": 3}, S, "session_id", id="map-session-int"),
        pytest.param({"type": "BlockRemoved", "medium": "GPU"}, "BlockRemoved", "block_hashes",
                     id="map-removed-missing-hashes"),
        pytest.param({"block_hashes": [1]}, None, '"type"', id="map-no-type"),
        pytest.param({"type": 1}, None, '"type"', id="map-type-int"),
        pytest.param([], None, "empty", id="empty-array"),
        pytest.param([1, [1]], None, "tag", id="tag-int"),
        pytest.param(7, None, "array or a map", id="event-int"),
        pytest.param(None, None, "array or a map", id="event-nil"),
    ],
)  # fmt: skip
def test_one_bad_event_is_reported_and_the_rest_decode(event: Any, tag: str | None, reason_part: str) -> None:
    """A malformed event lands in errors with its index and tag while the surrounding events decode."""
    payload = _enc([TS, [_good_stored(), event, ["BlockRemoved", [1], "GPU"]], 0])
    batch = decode_batch(payload)
    assert batch.events == (
        BlockStored(
            block_hashes=(1, 2), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=2, medium="GPU"
        ),
        BlockRemoved(block_hashes=(1,), medium="GPU"),
    )
    assert batch.unknown_events == 0
    assert len(batch.errors) == 1
    err = batch.errors[0]
    assert isinstance(err, InvalidEventError)
    assert err.index == 1
    assert err.tag == tag
    assert reason_part in err.reason


def test_bigram_reason_names_the_limitation() -> None:
    """SGLang EAGLE bigram token ids are rejected with a reason saying bigram keys are not supported."""
    payload = _enc([TS, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                           "token_ids": [[1, 2], [2, 3]], "block_size": 2, "lora_id": None}], 0])  # fmt: skip
    (err,) = decode_batch(payload).errors
    assert err.tag == "BlockStored"
    assert "bigram keys are not supported" in err.reason


# ----------------------------------------------------------------------------------------------------------
# Sequence numbers and replay framing


def test_seq_round_trip() -> None:
    """Seq frames are 8-byte big-endian and round-trip through encode_seq and decode_seq."""
    assert encode_seq(0) == b"\x00" * 8
    assert encode_seq(258) == b"\x00" * 6 + b"\x01\x02"
    assert encode_seq(SEQ_END) == END
    for seq in (0, 1, 255, 2**32, 2**63, SEQ_END):
        assert decode_seq(encode_seq(seq)) == seq
    assert SEQ_END == 2**64 - 1


@pytest.mark.parametrize("length", [0, 1, 4, 7, 9, 16, 23, 25])
def test_decode_seq_rejects_frames_of_other_lengths(length: int) -> None:
    """A seq frame that is not 8 or 24 bytes (an empty one included, which read leniently would be seq 0 and
    look like an engine restart) is a WireError naming its length."""
    with pytest.raises(WireError, match=f"sequence frame of {length} bytes"):
        decode_seq(b"\x01" * length)


def test_decode_seq_reads_the_sequence_of_a_frame_with_a_publisher_epoch() -> None:
    """A 24-byte frame (8-byte seq, then a 16-byte publisher epoch) reads as its first 8 bytes."""
    assert decode_seq(encode_seq(258) + b"\xab" * 16) == 258
    assert decode_seq(END + b"\x00" * 16) == SEQ_END


@pytest.mark.parametrize("seq", [-1, 2**64])
def test_encode_seq_rejects_out_of_range(seq: int) -> None:
    """Sequence numbers outside [0, 2**64) raise WireError."""
    with pytest.raises(WireError):
        encode_seq(seq)
    with pytest.raises(WireError):
        encode_replay_request(seq)


def test_replay_request_frames() -> None:
    """A DEALER replay request is the empty delimiter then the 8-byte start seq."""
    assert encode_replay_request(10) == [b"", b"\x00" * 7 + b"\x0a"]


def test_replay_reply_both_framings() -> None:
    """Replies parse in the 3-frame (older) and 4-frame (with topic) framings, END included."""
    assert decode_replay_reply([b"", encode_seq(7), b"\x93"]) == ReplayReply(7, b"\x93", None, False)
    assert decode_replay_reply([b"", b"kv", encode_seq(7), b"\x93"]) == ReplayReply(7, b"\x93", b"kv", False)
    assert decode_replay_reply([b"", END, b""]) == ReplayReply(SEQ_END, b"", None, True)
    assert decode_replay_reply([b"", b"", END, b""]) == ReplayReply(SEQ_END, b"", b"", True)


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([b"", encode_seq(1)], id="2-frames"),
        pytest.param([b"", b"t", b"x", encode_seq(1), b"p"], id="5-frames"),
        pytest.param([], id="no-frames"),
        pytest.param([b"id", encode_seq(1), b"p"], id="non-empty-delimiter"),
        pytest.param([b"", b"\x01", b"p"], id="short-seq"),
        pytest.param([b"", b"t", b"\x00" * 9, b"p"], id="long-seq"),
        pytest.param([b"", END, b"\x90"], id="end-with-payload"),
    ],
)
def test_replay_reply_rejects_other_shapes(frames: list[bytes]) -> None:
    """Any other replay reply shape raises WireError."""
    with pytest.raises(WireError):
        decode_replay_reply(frames)


# ----------------------------------------------------------------------------------------------------------
# encode_batch arguments


def _tiny(*hashes: int | bytes) -> EngineBatch:
    return EngineBatch(ts=TS, dp_rank=0, events=(BlockRemoved(block_hashes=hashes),))


@pytest.mark.parametrize(
    ("producer", "version"),
    [
        ("trtllm", "1.0.0"),
        ("vllm", "0.8.5"),
        ("vllm", "0.34.0"),
        ("vllm", "1.0.0"),
        ("vllm", "banana"),
        ("vllm", ""),
        ("sglang", "0.4.5"),
        ("sglang", "0.5.24"),
        ("sglang", "0.6.0"),
    ],
)
def test_encode_rejects_unknown_producer_or_version(producer: str, version: str) -> None:
    """Producers and versions outside the known tables raise ValueError."""
    with pytest.raises(ValueError):
        encode_batch(_tiny(1), producer=producer, version=version)


@pytest.mark.parametrize(
    ("version", "batch_header", "removed_len"),
    [
        ("0.9.0.1", 0x92, 2),
        ("0.10.1.1", 0x93, 2),
        ("0.10.2+cu128", 0x93, 3),
        ("0.13.0", 0x93, 3),
        ("0.23.1", 0x93, 4),
    ],
)
def test_encode_maps_release_strings_to_generations(
    version: str, batch_header: int, removed_len: int
) -> None:
    """Release strings with extra parts map to their generation's batch and event lengths."""
    payload = encode_batch(_tiny(1), version=version)
    assert payload[0] == batch_header
    assert payload[11] == 0x90 | removed_len


def test_encode_sglang_post_release() -> None:
    """SGLang 0.4.6.post5 maps to the 2-element batch row."""
    assert encode_batch(_tiny(-1), producer="sglang", version="0.4.6.post5")[0] == 0x92


@pytest.mark.parametrize(
    ("producer", "version", "hash_form", "hashes"),
    [
        pytest.param("vllm", "0.33.0", "hex", (1,), id="unknown-form"),
        pytest.param("vllm", "0.10.1", "bytes", (b"\x01",), id="bytes-before-0.10.2"),
        pytest.param("sglang", "0.5.23", "bytes", (b"\x01",), id="bytes-sglang"),
        pytest.param("vllm", "0.33.0", "bytes", (1,), id="int-in-bytes-form"),
        pytest.param("vllm", "0.9.1", "int", (b"\x01",), id="bytes-hash-before-0.10.2"),
        pytest.param("sglang", "0.5.9", "int", (b"\x01",), id="bytes-hash-sglang"),
        pytest.param("vllm", "0.33.0", "int", (2**64,), id="int-too-big"),
        pytest.param("vllm", "0.33.0", "int", (-(2**63) - 1,), id="int-too-small"),
        pytest.param("vllm", "0.33.0", "int", (b"",), id="empty-bytes"),
        pytest.param("vllm", "0.33.0", "int", (True,), id="bool"),
    ],
)
def test_encode_rejects_impossible_hash_forms(
    producer: str, version: str, hash_form: str, hashes: tuple[Any, ...]
) -> None:
    """Hash forms and hashes a release could not publish raise ValueError."""
    with pytest.raises(ValueError):
        encode_batch(_tiny(*hashes), producer=producer, version=version, hash_form=hash_form)


def test_encode_rejects_out_of_range_fields() -> None:
    """A non-hash int that does not fit msgpack raises ValueError, not OverflowError."""
    stored = BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(2**64,), block_size=1)
    with pytest.raises(ValueError):
        encode_batch(EngineBatch(ts=TS, dp_rank=0, events=(stored,)))


def test_decode_seq_rejects_frames_longer_than_eight_bytes() -> None:
    """A 20-byte sequence frame (no publisher sends one; it cannot fit a uint64) is a WireError."""
    assert decode_seq(b"\xff" * 8) == 2**64 - 1
    with pytest.raises(WireError, match="20 bytes"):
        decode_seq((2**100 + 1).to_bytes(20, "big"))
