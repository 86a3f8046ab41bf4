"""vLLM's next wire change (open pull request vllm-project/vllm#57789, "KV events snapshot"), end to end.

A stand-in publisher (`kvmesh.sim.publisher.EventPublisher` with ``publisher_epoch`` / ``snapshot_endpoint``)
sends 24-byte sequence frames (the 8-byte sequence and a 16-byte publisher epoch), idle heartbeats (empty
batches) and answers snapshot requests with ``[cut, epoch, chunks…]``; a real ingest, indexer and router on a
real nats-server. Each test checks exact route overlaps, the exact messages on the rank's subject and, after a
rebuild, that the index's digest equals that of an index fed every batch the engine published.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from tests.pipeline import Pipeline, eventually
from tests.test_ingest_faults import ANY, BS, T, U, V, W, blk, expect, removed, started, stored
from tests.test_ingest_registry import js_client

from kvmesh.core.engine_snapshot import decode_seq_frame
from kvmesh.core.events import EventsMessage, Removed, Stored, decode_message
from kvmesh.core.normalize import Normalizer
from kvmesh.core.state import IndexState
from kvmesh.core.wire import decode_batch
from kvmesh.runtime import subjects
from kvmesh.sim.publisher import EventPublisher, read_record

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def subject_messages(p: Pipeline) -> list[tuple[int, int | None, int, list[Any]]]:
    """``(epoch, first_seq, seq, events)`` of every message on worker ``w`` rank 0's subject, in stream order."""
    subject = subjects.events_subject(p.prefix, p.model, W, 0)
    out = []
    async with js_client(p.nats_url) as js:
        info = await js.stream_info(p.stream)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            raw = await js.get_msg(p.stream, seq)
            if raw.subject != subject:
                continue
            msg = decode_message(raw.data)
            assert isinstance(msg, EventsMessage)
            out.append((msg.epoch, msg.first_seq, msg.seq, list(msg.events)))
    return out


def sequence(p: Pipeline) -> dict[str, int]:
    """The sequence counters of worker ``w`` rank 0 in its ingest's status."""
    return p.ingests[W].status().ranks["0"].sequence


def truth_digest(record: Path, model: str) -> int:
    """The index digest of every batch the engine published (dropped ones too), applied in order."""
    norm, state = Normalizer(block_size=BS), IndexState()
    for i, (seq, payload) in enumerate(read_record(record)):
        events = norm.normalize(decode_batch(payload)).events
        state.apply(
            i + 1,
            EventsMessage(
                worker_id=W, dp_rank=0, model=model, block_size=BS, epoch=0, seq=seq, events=events
            ),
        )
    return state._indexes[model][BS].digest()


def index_digest(p: Pipeline) -> int:
    """The indexer's index digest of the test model."""
    assert p.indexer is not None
    return p.indexer.state._indexes[p.model][BS].digest()


def shapes(events: list[Any]) -> list[tuple[str, int]]:
    """Each event's kind and block count."""
    out = []
    for e in events:
        if isinstance(e, Stored | Removed):
            out.append((type(e).__name__, len(e.engine_hashes)))
        else:
            out.append((repr(e), 0))
    return out


async def test_24_byte_frames_are_decoded_and_heartbeats_are_covered_not_published(
    nats_url: str, uid: str
) -> None:
    """Frames of 24 bytes (seq + publisher epoch) are decoded and published; two idle heartbeats between two
    batches make no message of their own: the next message covers them (first_seq 1, seq 3), and they count as
    heartbeats, not as batches or gaps."""
    pub = EventPublisher(ANY, publisher_epoch=True)
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(pub.endpoint)
    try:
        async with started(nats_url, uid, {W: pub}, max_coalesced_batches=64) as p:
            await pub.wait_for_subscribers(2)
            pub.publish([stored([1, 2], blk(T, 0, 2))])
            frames = await asyncio.wait_for(raw.recv_multipart(), 5)
            assert len(frames[1]) == 24
            assert decode_seq_frame(frames[1]) == (0, pub.publisher_epoch)
            await expect(p, [T], [{"w/0": 2}])
            pub.heartbeat()
            pub.heartbeat()
            await eventually(lambda: asyncio.sleep(0, sequence(p)), lambda s: s["delivered"] == 3)
            await asyncio.sleep(0.3)  # what a flush would have published has reached the stream
            assert [m[:3] for m in await subject_messages(p)] == [(0, None, -1), (0, None, 0)]
            pub.publish([stored([3], blk(T, 2), parent=2)])
            await expect(p, [T], [{"w/0": 3}])
            msgs = await subject_messages(p)
            assert [(e, f, s, shapes(ev)) for e, f, s, ev in msgs] == [
                (0, None, -1, []),
                (0, None, 0, [("Stored", 2)]),
                (0, 1, 3, [("Stored", 1)]),
            ]
            seq = sequence(p)
            assert (seq["delivered"], seq["heartbeats"], seq["gaps"], seq["restarts"]) == (4, 2, 0, 0)
            assert p.ingests[W].counters.batches == 2
    finally:
        raw.close(linger=0)
        ctx.destroy(linger=0)


async def test_new_epoch_with_continuing_sequence_is_a_restart(nats_url: str, uid: str) -> None:
    """A publisher restarted with a new epoch whose sequence goes on rising (seq 1 after seq 0) is a new
    incarnation: its old blocks are cleared (T scores 0) and its new ones index under epoch 1."""
    pub = EventPublisher(ANY, publisher_epoch=True)
    async with started(nats_url, uid, {W: pub}) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        old = pub.publisher_epoch
        pub.restart(keep_seq=True)
        assert pub.publisher_epoch != old and pub.next_seq == 1
        pub.publish([stored([11, 12], U)])
        await expect(p, [T, U], [{"w/0": 0}, {"w/0": 2}])
        assert [(e, f, s, shapes(ev)) for e, f, s, ev in await subject_messages(p)] == [
            (0, None, -1, []),
            (0, None, 0, [("Stored", 2)]),
            (1, None, 0, [("Cleared(reason='restart')", 0)]),
            (1, None, 1, [("Stored", 2)]),
        ]
        st = p.ingests[W].status().ranks["0"]
        assert (st.epoch, st.last_seq, st.sequence["restarts"], st.sequence["gaps"]) == (1, 1, 1, 0)


async def test_snapshot_rebuilds_the_rank_after_a_gap(nats_url: str, uid: str, tmp_path: Path) -> None:
    """Three batches lost live (a child of T, the removal of U's second block, V stored with its first block
    evicted) and no replay socket: the ingest asks the snapshot socket, clears the rank, publishes the snapshot
    at its cut, and the index equals the engine's state exactly (T 4, U 1, V 0; same digest as every batch
    applied) with nothing it held before the gap lost."""
    record = tmp_path / "engine.rec"
    pub = EventPublisher(ANY, snapshot_endpoint=ANY, record_path=record)
    async with started(nats_url, uid, {W: pub}, snapshot_endpoint=pub.snapshot_endpoint) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        pub.publish([stored([11, 12], U)])
        await expect(p, [T, U], [{"w/0": 2}, {"w/0": 2}])
        pub.drop_next(3)
        pub.publish([stored([3], blk(T, 2), parent=2)])
        pub.publish([removed(12)])
        pub.publish([stored([21, 22], V), removed(21)])
        pub.publish([stored([4], blk(T, 3), parent=3)])  # seq 5, live: the gap shows
        await expect(p, [T, U, V], [{"w/0": 4}, {"w/0": 1}, {"w/0": 0}])
        assert await eventually(
            lambda: asyncio.sleep(0, index_digest(p)), lambda d: d == truth_digest(record, p.model)
        )
        msgs = await subject_messages(p)
        assert [(e, f, s, shapes(ev)) for e, f, s, ev in msgs] == [
            (0, None, -1, []),
            (0, None, 0, [("Stored", 2)]),
            (0, None, 1, [("Stored", 2)]),
            (0, None, 1, [("Cleared(reason='snapshot')", 0)]),
            (
                0,
                None,
                5,
                [("Stored", 2), ("Stored", 2), ("Stored", 1), ("Stored", 2), ("Stored", 1), ("Removed", 2)],
            ),
        ]
        seq = sequence(p)
        assert (seq["gaps"], seq["snapshots"], seq["rebuilds"], seq["snapshot_failures"]) == (1, 1, 1, 0)
        assert (seq["replays"], seq["resyncs"], pub.snapshot_requests) == (0, 0, 1)
        pub.publish([stored([31, 32], blk(T, 0, 2))])  # seq 6 goes on after the cut (a duplicate copy of T)
        await expect(p, [T, U], [{"w/0": 4}, {"w/0": 1}])
        assert (await subject_messages(p))[-1][:3] == (0, None, 6)


async def test_restart_first_seen_past_seq_0_rebuilds_from_the_snapshot(nats_url: str, uid: str) -> None:
    """An engine restart whose first two batches were lost (the new incarnation first seen at seq 2): new
    epoch, then the snapshot gives back what those batches stored (U and V), where a clear alone lost them."""
    pub = EventPublisher(ANY, snapshot_endpoint=ANY)
    async with started(nats_url, uid, {W: pub}, snapshot_endpoint=pub.snapshot_endpoint) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        pub.restart()
        pub.drop_next(2)
        pub.publish([stored([11, 12], U)])
        pub.publish([stored([21, 22], V)])
        pub.publish([stored([3], blk(U, 0), parent=None)])  # seq 2 of the new epoch, live
        await expect(p, [T, U, V], [{"w/0": 0}, {"w/0": 2}, {"w/0": 2}])
        epochs = [(e, s, shapes(ev)) for e, _f, s, ev in await subject_messages(p)]
        assert epochs[2:] == [
            (1, 1, [("Cleared(reason='restart')", 0)]),
            (1, -1, [("Cleared(reason='snapshot')", 0)]),
            (1, 2, [("Stored", 2), ("Stored", 2), ("Stored", 1)]),
        ]
        seq = sequence(p)
        assert (seq["restarts"], seq["snapshots"], seq["rebuilds"], seq["resyncs"]) == (1, 1, 1, 0)


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
async def test_unavailable_snapshot_falls_back_to_replay_then_to_clear(
    nats_url: str, uid: str, replay: bool
) -> None:
    """A snapshot answered unavailable (cut -2) after a gap: with a replay socket the replay heals the gap
    (T 4, no resync); without one the rank is cleared (Cleared "snapshot_unavailable") and goes on from the live
    batch (T 0: its blocks before the loss are gone, V then indexes)."""
    pub = EventPublisher(ANY, ANY if replay else None, snapshot_endpoint=ANY)
    pub.snapshot_available = False
    async with started(nats_url, uid, {W: pub}, snapshot_endpoint=pub.snapshot_endpoint) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        pub.drop_next(1)
        pub.publish([stored([3], blk(T, 2), parent=2)])
        pub.publish([stored([4], blk(T, 3), parent=3)])  # seq 2, live: the gap shows
        if replay:
            await expect(p, [T], [{"w/0": 4}])
        else:
            await eventually(lambda: asyncio.sleep(0, sequence(p)), lambda s: s["delivered"] == 2)
            pub.publish([stored([21, 22], V)])
            await expect(p, [T, V], [{"w/0": 0}, {"w/0": 2}])
        assert pub.snapshot_requests == 1
        seq = sequence(p)
        assert (seq["gaps"], seq["snapshots"], seq["snapshot_failures"], seq["rebuilds"]) == (1, 1, 1, 0)
        assert (seq["replays"], seq["healed"], seq["resyncs"]) == ((1, 1, 0) if replay else (0, 0, 1))
        msgs = [(s, shapes(ev)) for _e, _f, s, ev in await subject_messages(p)]
        if replay:
            assert msgs == [(-1, []), (0, [("Stored", 2)]), (1, [("Stored", 1)]), (2, [("Stored", 1)])]
        else:
            assert msgs == [
                (-1, []),
                (0, [("Stored", 2)]),
                (0, [("Cleared(reason='snapshot_unavailable')", 0)]),
                (2, [("Stored", 1)]),
                (3, [("Stored", 2)]),
            ]


async def test_unanswered_snapshot_request_falls_back_to_replay(nats_url: str, uid: str) -> None:
    """A snapshot socket that never answers: after --replay-timeout-s the ingest replays the gap instead (T 4,
    healed, no resync) and its REQ socket does not block the rank's next gap."""
    pub = EventPublisher(ANY, ANY, snapshot_endpoint=ANY)
    pub.snapshot_enabled = False
    async with started(
        nats_url, uid, {W: pub}, snapshot_endpoint=pub.snapshot_endpoint, replay_timeout_s=0.5
    ) as p:
        pub.publish([stored([1, 2], blk(T, 0, 2))])
        await expect(p, [T], [{"w/0": 2}])
        pub.drop_next(1)
        pub.publish([stored([3], blk(T, 2), parent=2)])
        pub.publish([stored([4], blk(T, 3), parent=3)])
        await expect(p, [T], [{"w/0": 4}])
        pub.snapshot_enabled = True
        pub.drop_next(1)
        pub.publish([stored([11, 12], U)])
        pub.publish([stored([13], blk(U, 0), parent=None)])  # seq 4, live: a second gap, answered this time
        await expect(p, [T, U], [{"w/0": 4}, {"w/0": 2}])
        seq = sequence(p)
        assert (seq["gaps"], seq["snapshots"], seq["snapshot_failures"], seq["rebuilds"]) == (2, 2, 1, 1)
        assert (seq["replays"], seq["healed"], seq["resyncs"], pub.snapshot_requests) == (1, 1, 0, 1)
