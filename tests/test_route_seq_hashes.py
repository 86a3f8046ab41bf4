"""Pre-hashed routing by standard sequence hashes: `IndexState.match_sequence_hashes`, and ``seq_hashes`` on
``kvmesh.route`` (JSON and ``seqhashes-u64le``) through a real NATS server and the real services, answering
exactly as token ids and local block hashes do; bad hashes get a ``bad_request`` naming them."""

from __future__ import annotations

import struct
from array import array
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import pytest
import xxhash
from tests.pipeline import Pipeline, eventually
from tests.test_ingest_faults import clean_pipeline, stored

from kvmesh.client import BadRequestError, Router
from kvmesh.core import protocol as p
from kvmesh.core.errors import RequestError, UnknownModelError
from kvmesh.core.events import Event, EventsMessage, Stored
from kvmesh.core.hashing import local_block_hashes
from kvmesh.core.state import IndexState
from kvmesh.sim.publisher import EventPublisher

BS = 16
PROMPT = list(range(7000, 7160))  # 10 blocks of 16


def std_local(tokens: list[int], bs: int) -> list[int]:
    """Dynamo's LocalBlockHash of each full block, computed here with xxhash alone."""
    return [
        xxhash.xxh3_64_intdigest(struct.pack(f"<{bs}I", *tokens[i : i + bs]), seed=1337)
        for i in range(0, len(tokens) - bs + 1, bs)
    ]


def std_seq(local: list[int]) -> list[int]:
    """Dynamo's SequenceHash chain: seq[0] = local[0], seq[i] = XXH3-64(le64(seq[i-1]) ‖ le64(local[i]), 1337)."""
    out: list[int] = []
    for h in local:
        out.append(h if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], h), seed=1337))
    return out


SEQ = std_seq(std_local(PROMPT, BS))


def test_the_standard_chain_in_this_file_matches_dynamos_published_vector() -> None:
    """The few lines of xxhash above give Dynamo's published local hashes for tokens 0..7, block size 4."""
    assert std_local(list(range(8)), 4) == [9143094415614847814, 12124091508212882195]
    assert std_seq([1, 2])[0] == 1


# ---------------------------------------------------------------------------------------- pure state

LOCAL = std_local(PROMPT, BS)


def _msg(worker: str, rank: int, events: list[Stored]) -> EventsMessage:
    return EventsMessage(
        worker_id=worker, dp_rank=rank, model="m", block_size=BS, epoch=1, seq=1, events=list[Event](events)
    )


def _state() -> IndexState:
    """w1/0 holds the prompt's first 6 blocks (4 on GPU, 2 more on CPU), w2/1 its first 3."""
    st = IndexState()
    st.apply(
        1, _msg("w1", 0, [Stored([10, 11, 12, 13], None, LOCAL[:4]), Stored([14, 15], 13, LOCAL[4:6], "CPU")])
    )
    st.apply(2, _msg("w2", 1, [Stored([20, 21, 22], None, LOCAL[:3])]))
    return st


def test_match_sequence_hashes_equals_match_and_match_local_hashes() -> None:
    """Sequence hashes, local hashes and token ids of one prompt give the same MatchResult, tiers included."""
    st = _state()
    by_seq = st.match_sequence_hashes("m", SEQ)
    assert by_seq == st.match_local_hashes("m", LOCAL)
    assert by_seq == st.match("m", PROMPT)
    assert (by_seq.block_size, by_seq.prompt_blocks, by_seq.index_seq) == (BS, 10, 2)
    assert [
        (c.worker_id, c.dp_rank, c.overlap_blocks, c.overlap_tokens, c.cached_blocks, c.tiers)
        for c in by_seq.candidates
    ] == [("w1", 0, 6, 96, 6, {"GPU": 4, "CPU": 2}), ("w2", 1, 3, 48, 3, None)]
    assert st.match_sequence_hashes("m", array("Q", SEQ)) == by_seq
    assert [c.overlap_blocks for c in st.match_sequence_hashes("m", SEQ[:2]).candidates] == [2, 2]
    # local hashes are not sequence hashes past block 0
    assert [c.overlap_blocks for c in st.match_sequence_hashes("m", LOCAL).candidates] == [1, 1]
    # another block size: holders of 16 count no overlap
    other = st.match_sequence_hashes("m", SEQ, block_size=32)
    assert (other.block_size, [c.overlap_blocks for c in other.candidates]) == (32, [0, 0])


@pytest.mark.parametrize(
    ("hashes", "message"),
    [
        ([1, -1], "seq_hashes[1] is not an int in [0, 2^64): -1"),
        ([2**64], "seq_hashes[0] is not an int in [0, 2^64): 18446744073709551616"),
        ([1, 2, "3"], "seq_hashes[2] is not an int in [0, 2^64): 3"),
        ([1.5], "seq_hashes[0] is not an int in [0, 2^64): 1.5"),
    ],
)
def test_match_sequence_hashes_refuses_a_bad_hash(hashes: list[Any], message: str) -> None:
    """A hash that is not an int in [0, 2**64) is a RequestError naming seq_hashes and its index."""
    with pytest.raises(RequestError) as info:
        _state().match_sequence_hashes("m", hashes)
    assert str(info.value) == message
    assert info.value.field == "seq_hashes"


def test_match_sequence_hashes_of_an_unknown_model() -> None:
    """A model no worker registered is UnknownModelError."""
    with pytest.raises(UnknownModelError):
        _state().match_sequence_hashes("no-such-model", SEQ)


# ---------------------------------------------------------------------------------------- over NATS

LONG = list(range(20_000, 20_000 + 64 * BS))  # 64 blocks: 512 bytes of hashes, sent packed by the client
LORA_PROMPT = list(range(9000, 9000 + 4 * BS))


@asynccontextmanager
async def fleet(nats_url: str, uid: str, index: str = "local") -> AsyncIterator[Pipeline]:
    """w1 holds PROMPT's first 6 blocks and LONG's first 40, w2 PROMPT's first 3 and LORA_PROMPT's 4 under the
    adapter "ad" with the salt "tenant-a"."""
    pubs = {"w1": EventPublisher("tcp://127.0.0.1:*"), "w2": EventPublisher("tcp://127.0.0.1:*")}
    try:
        async with clean_pipeline(nats_url, uid) as pipe:
            for worker, pub in pubs.items():
                await pipe.start_ingest(worker, pub.endpoint, block_size=BS)
                await pub.wait_for_subscribers(1)
            await pipe.start_indexer()
            await pipe.start_router(index=index)
            pubs["w1"].publish(
                [
                    stored(range(10, 16), PROMPT[: 6 * BS], block_size=BS),
                    stored(range(100, 140), LONG[: 40 * BS], block_size=BS),
                ]
            )
            pubs["w2"].publish(
                [
                    stored(range(20, 23), PROMPT[: 3 * BS], block_size=BS),
                    stored(
                        range(200, 204),
                        LORA_PROMPT,
                        block_size=BS,
                        lora_name="ad",
                        extra_keys=(("ad", "tenant-a"), ("ad",), ("ad",), ("ad",)),
                    ),
                ]
            )
            await eventually(lambda: pipe.route(LONG), lambda r: r.cached_tokens == 40 * BS)
            yield pipe
    finally:
        for pub in pubs.values():
            pub.close()


def fields(**kw: Any) -> str:
    return p.encode(p.RouteRequest(model="test-model", **kw)).decode()


async def _request(pipe: Pipeline, body: bytes, headers: dict[str, str] | None = None) -> Any:
    return await pipe._nc.request(pipe.route_subject, body, timeout=3, headers=headers)


@pytest.mark.anyio
@pytest.mark.nats
async def test_seq_hashes_get_the_reply_and_explain_of_the_token_ids(nats_url: str, uid: str) -> None:
    """seq_hashes as JSON, as a seqhashes-u64le body and through Router.route_by_hash(seq_hashes=...) answer
    exactly as token_ids and block_hashes do, explain included; the client packs 64 hashes."""
    async with fleet(nats_url, uid) as pipe:
        assert pipe.router is not None
        kw: dict[str, Any] = {"request_id": "r-1", "explain": True}
        by_tokens = await pipe.route(PROMPT, **kw)
        assert (by_tokens.worker_id, by_tokens.overlap_blocks, by_tokens.cached_tokens) == ("w1", 6, 96)
        assert by_tokens.scores is not None
        assert [(s.worker_id, s.overlap_blocks) for s in by_tokens.scores] == [("w1", 6), ("w2", 3)]
        by_local = await pipe.router.route_by_hash("test-model", local_block_hashes(PROMPT, BS), **kw)
        by_seq = await pipe.router.route_by_hash("test-model", seq_hashes=SEQ, **kw)
        raw_json = await _request(pipe, p.encode(p.RouteRequest(model="test-model", seq_hashes=SEQ, **kw)))
        raw_packed = await _request(
            pipe,
            struct.pack(f"<{len(SEQ)}Q", *SEQ),
            {p.BODY_HEADER: p.BODY_SEQHASHES_U64LE, p.FIELDS_HEADER: fields(**kw, block_size=BS)},
        )
        assert by_local == by_tokens
        assert by_seq == by_tokens
        assert p.decode(raw_json.data, p.RouteReply) == by_tokens
        assert p.decode(raw_packed.data, p.RouteReply) == by_tokens

        seen: list[dict[str, str] | None] = []

        async def note(msg: Any) -> None:
            seen.append(msg.headers)

        spy = await pipe._nc.subscribe(pipe.route_subject, cb=note)
        await pipe._nc.flush()
        long_seq = std_seq(std_local(LONG, BS))
        long_reply = await pipe.router.route_by_hash(
            "test-model", seq_hashes=long_seq, request_id="r-2", prompt_tokens=len(LONG) + 5
        )
        await spy.unsubscribe()
        assert seen[0] is not None and seen[0][p.BODY_HEADER] == p.BODY_SEQHASHES_U64LE
        assert long_reply == await pipe.route([*LONG, 1, 2, 3, 4, 5], request_id="r-2")
        assert (long_reply.worker_id, long_reply.cached_tokens) == ("w1", 40 * BS)

        # LoRA and cache salt are in the hashes the caller chained
        salted = std_seq(local_block_hashes(LORA_PROMPT, BS, lora_name="ad", cache_salt="tenant-a"))
        lora = await pipe.router.route_by_hash("test-model", seq_hashes=salted, explain=True)
        assert lora == await pipe.route(LORA_PROMPT, lora_name="ad", cache_salt="tenant-a", explain=True)
        assert (lora.worker_id, lora.overlap_blocks) == ("w2", 4)
        unsalted = std_seq(local_block_hashes(LORA_PROMPT, BS, lora_name="ad"))
        assert (await pipe.router.route_by_hash("test-model", seq_hashes=unsalted)).overlap_blocks == 0


@pytest.mark.anyio
@pytest.mark.nats
async def test_bad_seq_hashes_get_bad_request_and_the_router_keeps_serving(nats_url: str, uid: str) -> None:
    """Out-of-range, mixed and malformed seq_hashes requests each get a 400 bad_request naming the problem;
    an unknown model is unknown_model; the client refuses both kinds at once; then routes succeed."""
    async with fleet(nats_url, uid) as pipe:
        seq = {p.BODY_HEADER: p.BODY_SEQHASHES_U64LE, p.FIELDS_HEADER: fields()}
        cases: list[tuple[bytes, dict[str, str] | None, str, str]] = [
            (
                b'{"model":"test-model","seq_hashes":[1,-1]}',
                None,
                "seq_hashes[1] is outside [0, 2^64)",
                "400",
            ),
            (
                b'{"model":"test-model","seq_hashes":[18446744073709551616]}',
                None,
                "seq_hashes[0] is outside [0, 2^64)",
                "400",
            ),
            (b'{"model":"test-model","seq_hashes":["a"]}', None, "Expected `int`, got `str`", "400"),
            (b'{"model":"test-model","seq_hashes":[]}', None, "seq_hashes must not be empty", "400"),
            (
                b'{"model":"test-model","token_ids":[1],"seq_hashes":[2]}',
                None,
                "carries one of token_ids, block_hashes and seq_hashes, not more",
                "400",
            ),
            (
                b'{"model":"test-model","block_hashes":[1],"seq_hashes":[2]}',
                None,
                "carries one of token_ids, block_hashes and seq_hashes, not more",
                "400",
            ),
            (
                b'{"model":"test-model","seq_hashes":[1],"lora_name":"ad"}',
                None,
                "lora_name is mixed into seq_hashes by the caller",
                "400",
            ),
            (
                b"\x00" * 12,
                seq,
                "a seqhashes-u64le body is a whole number of 8-byte ids: got 12 bytes",
                "400",
            ),
            (
                b"\x00" * 8,
                {**seq, p.FIELDS_HEADER: fields(seq_hashes=[1])},
                "must not carry token_ids, block_hashes or seq_hashes",
                "400",
            ),
            (b'{"model":"nope","seq_hashes":[1]}', None, "nope", "404"),
        ]
        for body, headers, message, status in cases:
            msg = await _request(pipe, body, headers)
            assert msg.headers is not None
            assert msg.headers["Nats-Service-Error-Code"] == status, msg.data
            err = p.decode(msg.data, p.ErrorReply)
            assert err.error.code == ("bad_request" if status == "400" else "unknown_model")
            assert message in err.error.message, err.error.message
        assert pipe.router is not None
        with pytest.raises(BadRequestError, match="exactly one of them"):
            await pipe.router.route_by_hash("test-model", [1], seq_hashes=[1])
        with pytest.raises(BadRequestError, match="exactly one of them"):
            await pipe.router.route_by_hash("test-model")
        with pytest.raises(BadRequestError, match="integers in"):
            await pipe.router.route_by_hash("test-model", seq_hashes=[2**64])
        reply = await pipe.router.route_by_hash("test-model", seq_hashes=SEQ[:4], prompt_tokens=70)
        assert (reply.worker_id, reply.overlap_blocks, reply.cached_tokens) == ("w1", 4, 64)


@pytest.mark.anyio
@pytest.mark.nats
async def test_the_router_announces_seqhashes_and_remote_refuses_them(nats_url: str, uid: str) -> None:
    """$SRV.INFO route_forms lists seqhashes-u64le; a router that asks the indexers refuses seq_hashes."""
    async with fleet(nats_url, uid, index="remote") as pipe:
        msg = await pipe._nc.request("$SRV.INFO.kvmesh-router", b"", timeout=3)
        info = msgspec.json.decode(msg.data)
        assert info["metadata"] == {"route_forms": "json,tokens-u32le,hashes-u64le,seqhashes-u64le"}
        assert pipe.router is not None
        with pytest.raises(BadRequestError, match="need a router with a local index"):
            await pipe.router.route_by_hash("test-model", seq_hashes=SEQ)


@pytest.mark.anyio
async def test_an_older_router_is_named_for_seq_hashes(nats_url: str, uid: str) -> None:
    """A router that reads block_hashes but not seq_hashes (it answers 'unknown Kvmesh-Body' to the packed
    form and 'token_ids must not be empty' to JSON) is named as older by the client."""
    from kvmesh.runtime.nats import connect

    nc = await connect(nats_url, name="test-old-router")
    subject = f"t{uid}.old-route"

    async def old_router(msg: Any) -> None:
        headers = msg.headers or {}
        text = (
            "unknown Kvmesh-Body 'seqhashes-u64le': this router reads json, tokens-u32le, hashes-u64le"
            if headers.get(p.BODY_HEADER) == p.BODY_SEQHASHES_U64LE
            else "token_ids must not be empty (or send block_hashes)"
        )
        await msg.respond(p.encode(p.error_reply("bad_request", text)))

    try:
        await nc.subscribe(subject, cb=old_router)
        await nc.flush()
        router = Router(nc, subject=subject, timeout_s=3.0)
        for hashes in (SEQ, std_seq(std_local(LONG, BS))):
            with pytest.raises(BadRequestError, match="does not read pre-hashed requests by seq_hashes"):
                await router.route_by_hash("m", seq_hashes=hashes)
    finally:
        await nc.close()
