"""The indexer's replies built from `kvmesh.core.protocol` Structs are byte for byte what it sent as dicts."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import msgspec
import pytest

from kvmesh.core import protocol
from kvmesh.core.errors import RequestError
from kvmesh.core.events import EventsMessage, Stored
from kvmesh.core.protocol import MatchRequest, SnapshotRequest
from kvmesh.core.state import IndexState
from kvmesh.indexer.endpoints import status_reply


def _state() -> IndexState:
    state = IndexState()
    state.apply(
        3,
        EventsMessage(
            worker_id="w0",
            dp_rank=1,
            model="m",
            block_size=4,
            epoch=2,
            seq=0,
            events=[Stored([11, 12], None, [101, 102], "CPU")],
        ),
    )
    state.mark_gap(1)
    return state


def _dict_status(st: IndexState, snapshots: dict[str, Any]) -> dict[str, Any]:
    """The status reply as the indexer built it before the Struct (key order included)."""
    return {
        "replica": "r-1",
        "stream": "S",
        "ready": True,
        "applied_seq": st.applied_seq,
        "blocks": st.block_total(),
        "digest": f"{st.digest():016x}",
        "models": st.models(),
        "counters": asdict(st.counters) | {"decode_errors": 0, "apply_errors": 0},
        "workers": st.workers(),
        "complete": st.gap_seq is None,
        "incomplete": [f"{w}/{r}" for w, r in st.incomplete()],
        "holder_health": {f"{w}/{r}": why for (w, r), why in st.holder_health().items()},
        "reset_epoch": st.reset_epoch,
        "read_messages": 0,
        "resubscribes": 0,
        "stream_id": "",
        "rebuilds": 0,
        "recovery": {},
        "snapshots": snapshots,
        "snapshot_writer": False,
        "max_blocks": None,
    }


def test_the_status_reply_encodes_as_the_dict_it_replaces() -> None:
    """`IndexerStatus` from `status_reply` is the same JSON bytes as the former dict, key order included."""
    st = _state()
    snapshots = {"written": 1, "last": {"written": True, "deleted": ["snap-1"]}, "max_stall_ms": 0.5}
    reply = status_reply(
        replica="r-1",
        stream="S",
        ready=True,
        state=st,
        reader=None,
        snapshots=snapshots,
        snapshot_writer=False,
    )
    assert protocol.encode(reply) == msgspec.json.encode(_dict_status(st, snapshots))
    assert reply.holder_health == {"w0/1": "stream_gap"} and reply.incomplete == ["w0/1"]


@pytest.mark.parametrize(("code", "status"), [("bad_request", 400), ("unknown_model", 404)])
def test_the_match_error_reply_encodes_as_before(code: str, status: int) -> None:
    """A match error is ``{"error": {"code", "message"}}`` in msgpack, sent with the same service-error code."""
    body = protocol.encode(protocol.error_reply(code, "no worker serves model 'x'"), format="msgpack")
    assert body == msgspec.msgpack.encode({"error": {"code": code, "message": "no worker serves model 'x'"}})
    assert protocol.ERROR_STATUS[code] == status


def test_a_router_match_request_decodes() -> None:
    """The router's msgpack match request (packed token ids) decodes into `MatchRequest` unchanged."""
    data = msgspec.msgpack.encode({"model": "m", "token_ids": b"\x01\x00\x00\x00", "cache_salt": "s"})
    assert protocol.decode(data, MatchRequest, format="msgpack") == MatchRequest(
        model="m", token_ids=b"\x01\x00\x00\x00", cache_salt="s"
    )


def test_a_bad_match_request_is_a_request_error_naming_the_field() -> None:
    """A match request whose model is not a string is a `RequestError` naming ``model``."""
    with pytest.raises(RequestError) as err:
        protocol.decode(msgspec.msgpack.encode({"model": 5, "token_ids": []}), MatchRequest, format="msgpack")
    assert err.value.field == "model"


def test_a_snapshot_request_names_its_stream_or_none() -> None:
    """``kvmesh snapshot``'s body names a stream; an empty object asks every group; bad JSON is refused."""
    assert protocol.decode(b'{"stream": "S"}', SnapshotRequest).stream == "S"
    assert protocol.decode(b"{}", SnapshotRequest).stream is None
    with pytest.raises(RequestError):
        protocol.decode(b"{", SnapshotRequest)
