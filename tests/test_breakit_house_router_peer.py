"""A router with ``--index remote`` against hostile peers and oversize answers: an indexer answering garbage is
``internal``, counted, no traceback; a reply over the max payload is ``bad_request`` and leaves no load."""

from __future__ import annotations

import json
import logging

import pytest
from tests.test_router import HOT, HOT_ANSWER, IndexerAnswer, fleet, until

from kvmesh.core.protocol import MatchRequest

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def test_an_undecodable_indexer_reply_is_internal_without_a_traceback(
    nats_url: str, uid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A match reply that is not msgpack is answered ``internal`` naming the indexer's reply, counted in the
    router's errors, logged without a traceback; the next request with a good reply is routed."""
    caplog.set_level(logging.INFO)
    async with fleet(nats_url, uid) as f:

        def indexer(q: MatchRequest) -> IndexerAnswer:
            return b"\xc1" if q.model == "broken" else HOT_ANSWER

        f.answer = indexer
        svc = await f.start_router()
        msg = await f.nc.request(f"t{uid}.route.0", b'{"model": "broken", "token_ids": [1]}', timeout=3)
        error = json.loads(msg.data)["error"]
        assert error["code"] == "internal"
        assert error["message"].startswith(
            "undecodable match reply from an indexer: bad MatchReply: not msgpack"
        )
        assert msg.headers["Nats-Service-Error-Code"] == "500"
        assert svc.endpoint.errors == {"internal": 1}
        assert [r.getMessage() for r in caplog.records if r.exc_info and r.name.startswith("kvmesh")] == []
        reply = await f.client(0).route("m", HOT)
        assert reply.worker_id


async def test_a_route_whose_reply_would_exceed_the_max_payload_leaves_no_request_in_flight(
    nats_url: str, uid: str
) -> None:
    """A request whose explained reply would not fit the server's max payload (a request_id of nearly that
    size) is answered ``bad_request`` and counts on no worker, in this replica's ledger or in a peer's."""
    async with fleet(nats_url, uid) as f:
        first = await f.start_router()
        peer = await f.start_router()
        limit = f.nc.max_payload
        request_id = "r" * (limit - 4096 - 200)
        body = json.dumps(
            {"model": "m", "token_ids": HOT, "request_id": request_id, "explain": True}
        ).encode()
        assert len(body) < limit
        msg = await f.nc.request(f"t{uid}.route.0", body, timeout=5)
        error = json.loads(msg.data)["error"]
        assert error["code"] == "bad_request"
        assert "would exceed the server's max payload" in error["message"]
        ok = await f.client(0).route("m", HOT, request_id="small")
        await until(lambda: peer.ledger.stats().routed == 2)  # both notes, in order
        assert (ok.worker_id, first.ledger.stats().active, peer.ledger.stats().active) == ("a", 1, 1)
