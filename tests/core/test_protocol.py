"""Every inter-process payload of `kvmesh.core.protocol` round-trips, and bad input gets a clear error."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.core import protocol as p
from kvmesh.core.errors import (
    BadRequestError,
    InternalError,
    NoWorkersError,
    ProtocolError,
    RequestError,
    RouteError,
    UnavailableError,
    UnknownModelError,
)

SCORE = p.ScoreExplain(
    worker_id="w",
    dp_rank=1,
    overlap_blocks=3,
    cached_tokens=48,
    cached_tokens_by_tier={"GPU": 32, "CPU": 16},
    weighted_cached_tokens=40.0,
    cached_blocks=9,
    load=p.LoadExplain(active_prefill_tokens=10, active_blocks=2, active_requests=1, kv_usage=0.5),
    prefill_blocks=1.5,
    decode_blocks=2.0,
    busy=False,
    cost=1.7,
    health=p.HealthExplain(state="stale", reason="engine_silent: no answer"),
    probability=0.25,
)

SAMPLES: list[tuple[msgspec.Struct, str]] = [
    (
        p.RouteRequest(
            model="m",
            token_ids=[1, 2, 2**32 - 1],
            lora_name="l",
            cache_salt="s",
            candidates=["a"],
            request_id="r",
            explain=True,
            policy=p.PolicyOverride(temperature=0.5, tier_weights={"CPU": 1.0}),
        ),
        "json",
    ),
    (
        p.RouteReply(
            request_id="r",
            worker_id="w",
            dp_rank=1,
            overlap_blocks=3,
            cached_tokens=48,
            block_size=16,
            index_seq=7,
            scores=[SCORE],
            mode="degraded",
            degraded_reason="lag",
            selection=p.SelectionExplain(
                total=3,
                considered=2,
                cut=1,
                bounded=False,
                skipped=[p.SkippedCandidate(worker_id="s", dp_rank=0, reason="stale: x")],
                skipped_total=1,
            ),
        ),
        "json",
    ),
    (p.error_reply("no_workers", "none left", request_id="r"), "json"),
    (p.MatchRequest(model="m", token_ids=b"\x01\x00\x00\x00", lora_name=None, cache_salt="s"), "msgpack"),
    (
        p.MatchReply(
            index_seq=5,
            block_size=16,
            prompt_blocks=4,
            replica="i-0",
            candidates=[p.MatchHolder("w", 0, 2, 8, {"CPU": 2}, 16, "gap"), p.MatchHolder("v", 1, 0, 3)],
        ),
        "msgpack",
    ),
    (
        p.IngestStatus(
            worker_id="w",
            model="m",
            outbox=2,
            counters={"published": 3},
            ranks={
                "0": p.IngestRankStatus(
                    endpoint="tcp://e:5557",
                    epoch=1,
                    last_seq=9,
                    replaying=False,
                    block_size=16,
                    sequence={"delivered": 9},
                    events={"stored_events": 4},
                    engine=p.EngineStatus(state="live", reason="", probes=0),
                )
            },
        ),
        "json",
    ),
    (
        p.IndexerStatus(
            replica="i-0",
            stream="KV",
            ready=True,
            applied_seq=10,
            blocks=4,
            digest="00000000000000ff",
            models={"m": [16]},
            counters={"stored": 4},
            workers={"w": {"model": "m"}},
            complete=True,
            incomplete=[],
            holder_health={},
            reset_epoch=0,
            read_messages=10,
            resubscribes=0,
            stream_id="abc",
            rebuilds=0,
            recovery={"snapshot": None},
            snapshots={"written": 1},
            snapshot_writer=True,
        ),
        "json",
    ),
    (
        p.RouterStats(
            routed=3,
            errors={"bad_request": 1},
            in_flight=0,
            ledger=p.LedgerStats(routed=3, prefill_done=1, finished=1, expired=0, unknown=0),
            engine_reports=0,
            modes={"exact": 3},
            candidates_cut={},
            index=p.RouterIndexStats(
                route_mode="exact",
                holders={"w/0": p.HolderStatus(state="stale", reason="x")},
                holders_not_exact=1,
                mode="local",
                route_subject="kvmesh.route",
                lag_messages=0,
                lag_s=0.0,
            ),
        ),
        "json",
    ),
    (p.SnapshotRequest(stream="KV"), "json"),
    (
        p.MicroServiceStats(
            id="abc",
            name="kvmesh-router",
            version="0.1.0",
            endpoints=[p.MicroEndpointStats(name="route", data=msgspec.Raw(b'{"routed":1}'), num_errors=2)],
        ),
        "json",
    ),
    (
        p.SnapshotResult(
            replica="i-0", stream="KV", written=True, name="s-1", deleted=["s-0"], purged_before=None
        ),
        "json",
    ),
    (p.Routed(request_id="r", worker_id="w", dp_rank=0, prefill_tokens=10, blocks=2), "json"),
    (
        p.Routed(request_id="r", worker_id="w", dp_rank=0, prefill_tokens=10, blocks=2, session_id="s"),
        "json",
    ),
    (p.RouteNote(worker_id="w", dp_rank=1, session_id="s", block_keys=[1, 2**64 - 1]), "json"),
    (
        p.Routed(
            request_id="r", worker_id="w", dp_rank=0, prefill_tokens=10, blocks=2, block_keys=[0, 2**64 - 1]
        ),
        "json",
    ),
    (p.RequestRef(request_id="r"), "json"),
    (
        p.LedgerSnapshot(
            entries=[
                p.LedgerEntry(
                    request_id="r", worker_id="w", dp_rank=0, prefill_tokens=10, blocks=2, age_s=1.5
                )
            ],
            sessions=[p.SessionEntry(session_id="s", worker_id="w", dp_rank=0, idle_s=2.5)],
        ),
        "msgpack",
    ),
    (
        p.PredictedSnapshot(
            caches=[
                p.PredictedCache(
                    worker_id="w", dp_rank=0, kind="no_events", keys=[1, 2**64 - 1], capacity_blocks=8
                ),
                p.PredictedCache(worker_id="v", dp_rank=1, kind="ttl", keys=[3], remaining_s=[1.5]),
            ]
        ),
        "msgpack",
    ),
    (p.WorkerLoad(worker_id="w", dp_rank=1, running=2, kv_usage=0.3), "json"),
    (
        p.WorkerRecord(
            worker_id="w", model="m", dp_ranks=2, block_size=16, incarnation=3, stale_ranks={1: "silent"}
        ),
        "json",
    ),
    (
        p.WorkerRecord(
            worker_id="w",
            model="m",
            dp_ranks=1,
            block_size=16,
            incarnation=0,
            kv_capacity_blocks=8,
            kv_events=False,
        ),
        "json",
    ),
]


@pytest.mark.parametrize(("msg", "fmt"), SAMPLES, ids=[type(m).__name__ for m, _ in SAMPLES])
def test_every_message_round_trips(msg: msgspec.Struct, fmt: str) -> None:
    """Encoding a message and decoding it as its type gives an equal message."""
    data = p.encode(msg, format=fmt)  # type: ignore[arg-type]
    assert p.decode(data, type(msg), format=fmt) == msg  # type: ignore[arg-type]


def test_every_message_type_has_a_round_trip_sample() -> None:
    """Each Struct the protocol module exports at top level is in SAMPLES (a new message needs a sample)."""
    nested = {
        "PolicyOverride",
        "ScoreExplain",
        "LoadExplain",
        "HealthExplain",
        "SelectionExplain",
        "SkippedCandidate",
        "ErrorBody",
        "MatchHolder",
        "IngestRankStatus",
        "EngineStatus",
        "HolderStatus",
        "RouterIndexStats",
        "RouteReceipts",
        "LedgerStats",
        "LedgerEntry",
        "SessionEntry",
        "PredictedCache",
        "Message",
        "MicroEndpointStats",
        # stream messages: round-tripped with their own codec in tests/core/test_events*.py / test_state.py
        "EventsMessage",
        "WorkerRemoved",
        "IndexReset",
    }
    structs = {
        name
        for name in p.__all__
        if isinstance(getattr(p, name), type) and issubclass(getattr(p, name), msgspec.Struct)
    }
    assert structs - nested == {type(m).__name__ for m, _ in SAMPLES}


def test_version_1_is_not_on_the_wire_and_a_later_version_is_refused() -> None:
    """A version-1 message carries no version field; a message of version 2 raises ProtocolError naming it."""
    ref = p.RequestRef(request_id="r")
    assert p.encode(ref) == b'{"request_id":"r"}'
    with pytest.raises(ProtocolError) as info:
        p.decode(b'{"request_id":"r","version":2}', p.RequestRef)
    assert info.value.field == "version"
    assert str(info.value) == "RequestRef of version 2: this kvmesh reads up to version 1"
    assert p.decode(b'{"request_id":"r","version":1}', p.RequestRef) == p.RequestRef(
        request_id="r", version=1
    )


def test_a_bad_request_is_a_request_error_naming_the_field() -> None:
    """A request that does not decode raises RequestError (bad_request) with the field at fault."""
    with pytest.raises(RequestError) as info:
        p.decode(b'{"model": 3, "token_ids": [1]}', p.RouteRequest)
    assert info.value.field == "model"
    with pytest.raises(RequestError) as info:
        p.decode(b'{"model": "m", "token_ids": [1], "policy": {"nope": 1}}', p.RouteRequest)
    assert info.value.field == "policy.nope"
    with pytest.raises(RequestError) as info:
        p.decode(b'{"model": "m"}', p.RouteRequest)
    assert info.value.field == "token_ids"
    with pytest.raises(RequestError, match="not JSON"):
        p.decode(b"{", p.SnapshotRequest)
    with pytest.raises(RequestError, match="not msgpack"):
        p.decode(b"\xc1", p.MatchRequest, format="msgpack")


def test_a_bad_reply_is_a_protocol_error_not_a_request_error() -> None:
    """A reply, status or record that does not decode raises ProtocolError (not the sender's bad_request)."""
    with pytest.raises(ProtocolError) as info:
        p.decode(b'{"worker_id": "w"}', p.WorkerRecord)
    assert type(info.value) is ProtocolError
    assert info.value.field == "model"
    with pytest.raises(ProtocolError, match="nested too deeply"):
        p.decode(b'{"recovery": {"x": ' + b"[" * 100_000, p.IndexerStatus)


def test_a_match_holder_row_has_6_elements_without_health_and_7_with() -> None:
    """encode writes a holder with no health as the 6-element row indexers always sent, one with health as 7."""
    reply = p.MatchReply(
        index_seq=5,
        block_size=16,
        prompt_blocks=4,
        replica="i-0",
        candidates=[
            p.MatchHolder("w", 0, 2, 8, None, 16),
            p.MatchHolder("v", 1, 0, 3, {"CPU": 1}, 32, "gap"),
        ],
    )
    assert msgspec.msgpack.decode(p.encode(reply, format="msgpack")) == {
        "index_seq": 5,
        "block_size": 16,
        "prompt_blocks": 4,
        "replica": "i-0",
        "candidates": [["w", 0, 2, 8, None, 16], ["v", 1, 0, 3, {"CPU": 1}, 32, "gap"]],
    }


def test_match_holders_of_older_indexers_decode_with_defaults() -> None:
    """A 4-element holder row (an older indexer) decodes with no tiers, the model's block size and no health."""
    row = msgspec.msgpack.encode(
        {"index_seq": 1, "block_size": 16, "prompt_blocks": 2, "candidates": [["w", 0, 1, 5]]}
    )
    reply = p.decode(row, p.MatchReply, format="msgpack")
    assert reply.candidates == [p.MatchHolder("w", 0, 1, 5, None, 0, None)]
    assert reply.replica == ""


def test_the_error_table_is_the_error_classes() -> None:
    """ERROR_STATUS maps each route error code to its NATS service-error code, from the classes themselves."""
    assert p.ERROR_STATUS == {
        "bad_request": 400,
        "unknown_model": 404,
        "no_workers": 404,
        "context_length_exceeded": 400,
        "unavailable": 503,
        "internal": 500,
    }


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("bad_request", BadRequestError),
        ("unknown_model", UnknownModelError),
        ("no_workers", NoWorkersError),
        ("unavailable", UnavailableError),
        ("internal", InternalError),
        ("from_the_future", InternalError),
    ],
)
def test_an_error_reply_raises_its_route_error(code: str, cls: type[RouteError]) -> None:
    """decode_answer raises the RouteError subclass of an error reply's code, keeping code and message."""
    data = p.encode(p.error_reply(code, "why"))
    with pytest.raises(cls) as info:
        p.decode_answer(data, p.RouteReply)
    assert (info.value.code, info.value.message, str(info.value)) == (code, "why", "why")


def test_a_route_reply_omits_what_is_none_and_keeps_request_id() -> None:
    """A plain route reply's JSON has request_id (even null) and mode, and no scores or selection."""
    reply = p.RouteReply(
        request_id=None,
        worker_id="w",
        dp_rank=0,
        overlap_blocks=1,
        cached_tokens=16,
        block_size=16,
        index_seq=3,
        mode="exact",
    )
    assert msgspec.json.decode(p.encode(reply)) == {
        "request_id": None,
        "worker_id": "w",
        "dp_rank": 0,
        "overlap_blocks": 1,
        "cached_tokens": 16,
        "block_size": 16,
        "index_seq": 3,
        "mode": "exact",
    }
    assert p.decode_answer(p.encode(reply), p.RouteReply) == reply


def test_the_index_unknown_model_error_is_a_key_error_and_a_route_error() -> None:
    """The index's UnknownModelError is the route API's (code unknown_model) and still a KeyError."""
    exc = UnknownModelError("m")
    assert isinstance(exc, KeyError) and isinstance(exc, RouteError)
    assert (exc.code, exc.status, exc.args, str(exc)) == ("unknown_model", 404, ("m",), "m")


def test_a_micro_stats_reply_with_a_version_string_is_not_a_protocol_version() -> None:
    """nats.micro's $SRV.STATS carries the service's version string; decoding it checks no protocol version."""
    data = b'{"id":"x","name":"kvmesh-router","version":"9.9.9","endpoints":[{"name":"route","data":null}]}'
    stats = p.decode(data, p.MicroServiceStats)
    assert (stats.version, stats.endpoints[0].name, bytes(stats.endpoints[0].data)) == (
        "9.9.9",
        "route",
        b"null",
    )


def test_a_ledger_snapshot_without_sessions_still_decodes() -> None:
    """A replica older than session affinity sends no ``sessions``: it decodes as none."""
    old = msgspec.msgpack.encode({"entries": [["r", "w", 0, 10, 2, 1.5]], "version": 1})
    snap = p.decode(old, p.LedgerSnapshot, format="msgpack")
    assert snap.sessions == [] and snap.entries[0].request_id == "r"
    routed = p.decode(
        b'{"request_id":"r","worker_id":"w","dp_rank":0,"prefill_tokens":1,"blocks":1}', p.Routed
    )
    assert routed.session_id is None
