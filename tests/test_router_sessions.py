"""Session affinity through real router replicas on a real nats-server (a stand-in indexer answers the
match queries, as in tests/test_router.py): replicas share where each session went, by ``routed`` notes,
``session`` notes and the start-up sync."""

from __future__ import annotations

import pytest
from tests.test_router import HOT, answer, fleet, until

from kvmesh.core.index import Holder
from kvmesh.core.protocol import MatchHolder
from kvmesh.router.service import RouterService

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


def sessions(router: RouterService) -> dict[str, Holder]:
    """Session → holder as the replica knows it."""
    return {sid: h for sid, h, _idle in router.notes.sessions.entries(0.0)}


async def test_replicas_keep_a_session_on_its_worker_while_the_cost_allows(nats_url: str, uid: str) -> None:
    async with fleet(nats_url, uid) as f:
        r0, r1 = await f.start_router(), await f.start_router()
        c0, c1 = f.client(0), f.client(1)
        # HOT is 5 blocks; a holds 4, b none: a wins, a session nobody knew yet
        f.answer = lambda q: answer([MatchHolder("a", 0, 4, 40), MatchHolder("b", 0, 0, 0)])
        first = await c0.route("m", HOT, session_id="conv-1")
        assert (first.worker_id, first.session) == ("a", "new")
        # no request_id: a route note tells the other replica
        await until(lambda: len(r1.notes.sessions) == 1)
        # now b holds 4 and a 3: a costs 1 block more, within the default slack (0.25 × 5 blocks)
        f.answer = lambda q: answer([MatchHolder("a", 0, 3, 40), MatchHolder("b", 0, 4, 40)])
        kept = await c1.route("m", HOT, session_id="conv-1")
        assert (kept.worker_id, kept.session) == ("a", "kept")
        plain = await c1.route("m", HOT)
        assert (plain.worker_id, plain.session) == ("b", None)
        # a holds nothing: 4 blocks more than b is beyond the slack, the session moves to b ...
        f.answer = lambda q: answer([MatchHolder("a", 0, 0, 40), MatchHolder("b", 0, 4, 40)])
        moved = await c1.route("m", HOT, session_id="conv-1", request_id="r-1")
        assert (moved.worker_id, moved.session) == ("b", "moved")
        # ... and the routed note carries the session to replica 0
        await until(lambda: r0.ledger.stats().active == 1)
        # a holds 3 blocks (cost 2), b 4 but r-1 in flight there (1 prefill block + 0.1 × 5 active: 2.5);
        # without the session a wins, with it b keeps it
        f.answer = lambda q: answer([MatchHolder("a", 0, 3, 40), MatchHolder("b", 0, 4, 40)])
        assert (await c0.route("m", HOT)).worker_id == "a"
        back = await c0.route("m", HOT, session_id="conv-1")
        assert (back.worker_id, back.session) == ("b", "kept")
        # a per-request slack of 0 keeps the session only where it is the cheapest
        strict = await c0.route("m", HOT, session_id="conv-1", policy={"session_slack": 0.0})
        assert (strict.worker_id, strict.session) == ("a", "moved")
        await until(lambda: sessions(r1) == sessions(r0) == {"conv-1": Holder("a", 0)})
        # a replica started now gets the sessions from a peer
        await c0.route("m", HOT, session_id="conv-2", request_id="r-2")
        await until(lambda: len(r1.notes.sessions) == 2)
        r2 = await f.start_router()
        assert (r2.notes.synced_sessions, r2.synced_requests) == (2, 2)
        assert r2.stats_message().sessions == 2
        # (r-2 now loads a: 4.5 against b's 2.5, so a slack of a whole prompt keeps it there)
        again = await f.client(2).route("m", HOT, session_id="conv-1", policy={"session_slack": 1.0})
        assert (again.worker_id, again.session) == ("a", "kept")


async def test_bad_session_ids_are_refused_and_change_nothing(nats_url: str, uid: str) -> None:
    from kvmesh.client import BadRequestError

    async with fleet(nats_url, uid) as f:
        r0 = await f.start_router()
        for bad in ("", "s" * 257):
            with pytest.raises(BadRequestError, match="session_id must have 1 to 256 characters"):
                await f.client(0).route("m", HOT, session_id=bad)
        assert len(r0.notes.sessions) == 0
        ok = await f.client(0).route("m", HOT, session_id="s" * 256)
        assert ok.session == "new"
