"""A router with ``--index remote`` whose indexer answers garbage: ``internal``, counted, no traceback."""

from __future__ import annotations

import json
import logging

import pytest
from tests.test_router import HOT, HOT_ANSWER, IndexerAnswer, fleet

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
