"""Stale engines and degraded modes against a real nats-server, a real ingest and the real router: records and
stream messages are put directly where that is the simplest real input."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgspec
import pytest
from tests.pipeline import Pipeline, eventually, overlaps, pipeline
from tests.test_router_candidates import start_router

from kvmesh.client import NoWorkersError
from kvmesh.core.events import EventsMessage, Stored, encode_message
from kvmesh.core.hashing import local_block_hashes
from kvmesh.core.protocol import WorkerRecord
from kvmesh.ops import decode_router_service, router_status
from kvmesh.runtime import subjects
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

BS = 4
P1 = list(range(100, 116))  # 4 blocks
Q = list(range(3000, 3008))  # 2 other blocks
SILENT = "silent 30 s, liveness probe unanswered"


async def put_record(
    p: Pipeline, worker: str, *, model: str | None = None, dp_ranks: int = 1, **kw: Any
) -> None:
    """Put a registry record directly (as an ingest's heartbeat would)."""
    assert p._nc is not None
    kv = await p._nc.jetstream().key_value(subjects.registry_bucket(p.stream))
    rec = WorkerRecord(
        worker_id=worker, model=model or p.model, dp_ranks=dp_ranks, block_size=BS, incarnation=0, **kw
    )
    await kv.put(subjects.kv_key(worker), msgspec.json.encode(rec))


async def publish_batch(p: Pipeline, worker: str, seq: int, tokens: list[int]) -> None:
    """Publish one engine batch of ``worker``'s rank 0 storing ``tokens``' blocks, straight into the stream."""
    assert p._nc is not None
    local = local_block_hashes(tokens, BS)
    msg = EventsMessage(
        worker_id=worker,
        dp_rank=0,
        model=p.model,
        block_size=BS,
        epoch=0,
        seq=seq,
        events=[
            Stored(
                engine_hashes=[seq * 1000 + i + 1 for i in range(len(local))], parent=None, local_hashes=local
            )
        ],
    )
    await p._nc.jetstream().publish(
        subjects.events_subject(p.prefix, p.model, worker, 0), encode_message(msg), stream=p.stream
    )


async def status_of(p: Pipeline) -> dict[str, Any]:
    """The router's summary in `kvmesh status`, from its ``$SRV.STATS`` reply over NATS."""
    assert p._nc is not None
    msg = await p._nc.request("$SRV.STATS.kvmesh-router", b"", timeout=2.0)
    last = (await p._nc.jetstream().stream_info(p.stream)).state.last_seq
    summary: dict[str, Any] = msgspec.to_builtins(router_status(decode_router_service(msg.data), last))
    return summary


def health(reply: Any) -> dict[str, dict[str, str]]:
    """Map ``worker_id/dp_rank`` → health from an explained reply."""
    return {f"{s.worker_id}/{s.dp_rank}": msgspec.to_builtins(s.health) for s in reply.scores or []}


async def test_stale_ranks_are_skipped_and_a_model_of_stale_ranks_has_no_live_workers(
    nats_url: str, uid: str
) -> None:
    """A rank in its worker's stale_ranks is no candidate (explain lists it as skipped with the reason), even
    when it holds the prompt; a model whose every rank is stale answers no_workers "no live workers"."""
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        async with pipeline(nats_url, uid) as p:
            # The ingest heartbeats every 100 s: the records put below stay as they are during the test.
            await p.start_ingest("w", pub.endpoint, pub.replay_endpoint, block_size=BS, worker_ttl_s=300.0)
            await pub.wait_for_subscribers(1)
            await start_router(p)
            await publish_batch(p, "w", 0, P1)  # w/0 holds the prompt
            await put_record(p, "s", dp_ranks=2, stale_ranks={1: SILENT})
            r = await eventually(
                lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w/0": 4, "s/0": 0}
            )
            assert (r.worker_id, r.mode) == ("w", "exact")
            assert r.selection is not None
            assert msgspec.to_builtins(r.selection.skipped) == [
                {"worker_id": "s", "dp_rank": 1, "reason": f"stale: {SILENT}"}
            ]
            assert r.selection.skipped_total == 1

            await put_record(p, "w", stale_ranks={0: SILENT})
            r = await eventually(lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"s/0": 0})
            assert (r.worker_id, r.dp_rank, r.overlap_blocks, r.mode) == ("s", 0, 0, "exact")
            assert r.selection is not None
            assert msgspec.to_builtins(r.selection.skipped) == [
                {"worker_id": "w", "dp_rank": 0, "reason": f"stale: {SILENT}"},
                {"worker_id": "s", "dp_rank": 1, "reason": f"stale: {SILENT}"},
            ]
            status = await status_of(p)
            assert status["holders"] == {
                "s/1": {"state": "stale", "reason": f"engine_silent: {SILENT}"},
                "w/0": {"state": "stale", "reason": f"engine_silent: {SILENT}"},
            }

            await put_record(p, "t", model="other", dp_ranks=2, stale_ranks={0: SILENT, 1: SILENT})

            async def refused() -> str:
                try:
                    await p.route(P1, model="other")
                except NoWorkersError as exc:
                    return exc.message
                return "routed"

            message = await eventually(refused, lambda m: m.startswith("no live workers"), timeout_s=5.0)
            assert message == (
                f"no live workers: every registered rank of model 'other' (2) has a stale engine "
                f"(e.g. t/0: {SILENT})"
            )
    finally:
        pub.close()


async def test_a_holder_that_lost_history_makes_the_reply_degraded(nats_url: str, uid: str) -> None:
    """A holder whose engine sequence skipped ahead (a re-ordered stream: later batches first) holds them and
    is incomplete: a reply choosing it says mode "degraded" with the reason, explain and the router's status
    show its health; once the late batches arrive everything applies in engine order and the reply is
    "exact" again, with the held blocks counted."""
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest("w", pub.endpoint, pub.replay_endpoint, block_size=BS, worker_ttl_s=300.0)
            await pub.wait_for_subscribers(1)
            await start_router(p)
            await put_record(p, "d")
            await publish_batch(p, "d", 0, P1)
            exact = await eventually(
                lambda: p.route(P1, explain=True), lambda r: overlaps(r) == {"w/0": 0, "d/0": 4}
            )
            assert (exact.worker_id, exact.mode, exact.degraded_reason) == ("d", "exact", None)
            assert health(exact) == {"d/0": {"state": "exact"}, "w/0": {"state": "exact"}}

            await publish_batch(p, "d", 5, Q)  # seqs 1-4 are still to come: held
            held = await eventually(lambda: p.route(P1, explain=True), lambda r: r.mode != "exact")
            assert (held.worker_id, held.overlap_blocks, held.mode) == ("d", 4, "degraded")
            assert held.degraded_reason == "the chosen holder d/0 is incomplete: held"
            assert health(held) == {
                "d/0": {"state": "incomplete", "reason": "held"},
                "w/0": {"state": "exact"},
            }
            status = await status_of(p)
            assert (status["route_mode"], status["holders"], status["holders_not_exact"]) == (
                "exact",
                {"d/0": {"state": "incomplete", "reason": "held"}},
                1,
            )

            for seq in (3, 1, 4, 2):  # the late batches, themselves out of order
                await publish_batch(p, "d", seq, P1)
            back = await eventually(lambda: p.route(Q, explain=True), lambda r: r.mode == "exact")
            assert (back.worker_id, back.overlap_blocks) == ("d", 2)  # seq 5's blocks, applied last
            assert health(back)["d/0"] == {"state": "exact"}
    finally:
        pub.close()


async def _pause_consumers(p: Pipeline, until: str | None) -> int:
    """Pause (``until`` an RFC 3339 time) or resume (None) every consumer of the pipeline's stream."""
    assert p._nc is not None
    js = p._nc.jetstream()
    consumers = await js.consumers_info(p.stream)
    for c in consumers:
        body = json.dumps({"pause_until": until} if until else {}).encode()
        reply = await p._nc.request(f"$JS.API.CONSUMER.PAUSE.{p.stream}.{c.name}", body, timeout=2.0)
        assert "error" not in json.loads(reply.data), reply.data
    return len(consumers)


async def test_a_router_whose_replica_lags_the_stream_says_degraded(
    nats_url: str, uid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With its replica's consumer paused while 3 messages arrive (bound: 1 message), the router answers mode
    "degraded" naming the lag, every holder shows stale (replica_lag), and its status says so; resumed, the
    replies are "exact" again."""
    # The replica re-subscribes when nothing was applied for STALL_S while the stream has more: that would
    # replace the paused consumer, at any moment within STALL_S of the pause.
    monkeypatch.setattr("kvmesh.runtime.replica.STALL_S", 60.0)
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest("w", pub.endpoint, pub.replay_endpoint, block_size=BS, worker_ttl_s=300.0)
            await pub.wait_for_subscribers(1)
            await start_router(p, max_lag_messages=1, max_lag_s=60.0)
            svc = p.router_service
            assert svc is not None and svc.replica is not None
            await put_record(p, "d")
            await publish_batch(p, "d", 0, P1)
            first = await eventually(lambda: p.route(P1), lambda r: r.overlap_blocks == 4)
            assert first.mode == "exact"

            assert await _pause_consumers(p, "2099-01-01T00:00:00Z") == 1  # the router's replica only
            applied = svc.replica.state.applied_seq
            for seq in (1, 2, 3):
                await publish_batch(p, "d", seq, [*Q, seq, seq, seq, seq])
            lagging = await eventually(lambda: p.route(P1, explain=True), lambda r: r.mode != "exact")
            assert svc.replica.state.applied_seq == applied  # nothing was applied: the lag is real
            assert (lagging.worker_id, lagging.mode) == ("d", "degraded")
            assert lagging.degraded_reason is not None
            assert lagging.degraded_reason.startswith(
                "replica_lag: the local index lags the stream by 3 messages and "
            ), lagging.degraded_reason
            assert lagging.degraded_reason.endswith("(bounds 1 messages, 60 s)")
            assert health(lagging) == {
                "d/0": {"state": "stale", "reason": "replica_lag"},
                "w/0": {"state": "stale", "reason": "replica_lag"},
            }
            status = await status_of(p)
            assert (status["route_mode"], status["lag_messages"], status["lag"]) == ("degraded", 3, 3)

            await _pause_consumers(p, None)
            # The server resumes delivery within a heartbeat interval (about 5 s).
            back = await eventually(lambda: p.route(P1), lambda r: r.mode == "exact", timeout_s=20.0)
            assert (back.worker_id, back.degraded_reason) == ("d", None)
            assert svc.replica.state.applied_seq == applied + 3
    finally:
        pub.close()


async def test_a_holder_whose_heartbeat_is_late_is_stale(nats_url: str, uid: str) -> None:
    """A holder whose last registry heartbeat is older than two heartbeat intervals (2/3 of the bucket's
    TTL, here 200 s) is stale: a reply choosing it says "degraded", explain and the status name it."""
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        async with pipeline(nats_url, uid) as p:
            await p.start_ingest("w", pub.endpoint, pub.replay_endpoint, block_size=BS, worker_ttl_s=300.0)
            await pub.wait_for_subscribers(1)
            await start_router(p)
            await put_record(p, "d", heartbeat_ts=time.time() - 1000.0)
            # The router learns of the record through its registry watch, apart from the stream: wait for it.
            assert p.router_service is not None
            svc = p.router_service
            await eventually(
                lambda: asyncio.sleep(0, getattr(svc.registry, "workers", {})), lambda w: "d" in w
            )
            await publish_batch(p, "d", 0, P1)
            r = await eventually(lambda: p.route(P1, explain=True), lambda r: r.overlap_blocks == 4)
            assert (r.worker_id, r.mode) == ("d", "degraded")
            assert r.degraded_reason is not None
            assert r.degraded_reason.startswith(
                "the chosen holder d/0 is stale: heartbeat_late: last heartbeat 1"
            )
            assert health(r)["d/0"]["state"] == "stale"
            assert health(r)["w/0"] == {"state": "exact"}
            status = await status_of(p)
            assert list(status["holders"]) == ["d/*"]
            assert status["holders"]["d/*"]["reason"].startswith("heartbeat_late: last heartbeat 1")
    finally:
        pub.close()
