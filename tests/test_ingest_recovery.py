"""The ingest's cursor recovery at start, against a real nats-server and a real ZMQ publisher.

An undecodable last message on a rank's subject (one written by a newer version before a rollback) must not
stop the ingest: it is logged with its stream sequence and skipped; the cursor comes from the message before
it on the same subject, or the rank is resynchronised when there is none.
"""

from __future__ import annotations

import logging
from typing import Any

import nats.js.errors
import pytest
from tests.pipeline import eventually
from tests.test_ingest_faults import BS, T, blk, clean_pipeline, stored
from tests.test_ingest_registry import ANY, W, js_client, start, stop

from kvmesh.core.events import Cleared, EventsMessage, decode_message, encode_message
from kvmesh.ingest.recovery import walk_back
from kvmesh.runtime import subjects
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

GARBAGE = b"\xc1 written by a newer kvmesh"
"""Bytes no kvmesh stream message decodes from (0xc1 is never valid msgpack)."""


async def last_on(js: Any, stream: str, subject: str) -> tuple[int, EventsMessage]:
    """(stream seq, decoded message) of the last message on ``subject``; (0, an empty message) while that is
    one of the test's undecodable ones, or while there is none."""
    try:
        raw = await js.get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:
        raw = None
    if raw is None or raw.data.startswith(GARBAGE):
        return 0, EventsMessage(worker_id="", dp_rank=0, model="", block_size=0, epoch=-1, seq=-2, events=[])
    msg = decode_message(raw.data)
    assert isinstance(msg, EventsMessage)
    return int(raw.seq), msg


async def test_undecodable_last_message_recovers_from_the_one_before(
    nats_url: str, uid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Garbage after engine seq 1 on rank 0's subject: the ingest starts, logs the garbage's stream seq, resumes
    at epoch 0 seq 1, and publishes the engine's seq 2 next with no gap, replay or resync."""
    caplog.set_level(logging.WARNING, logger="kvmesh.ingest")
    pub = EventPublisher(ANY, ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p, js_client(nats_url) as js:
            subject = subjects.events_subject(p.prefix, p.model, W, 0)
            ing = await start(p, W, pub)
            await pub.wait_for_subscribers(1)
            pub.publish([stored([1], blk(T, 0))])
            pub.publish([stored([2], blk(T, 1), parent=1)])
            await eventually(lambda: last_on(js, p.stream, subject), lambda r: r[1].seq == 1)
            await stop(p, W, clean=False)  # a crash: the worker stays registered
            garbage_seq = (await js.publish(subject, GARBAGE)).seq
            ing = await start(p, W, pub)
            assert f"rank 0: undecodable message at stream seq {garbage_seq} on {subject}" in caplog.text
            st = ing.status().ranks["0"]
            assert (st.epoch, st.last_seq) == (0, 1)
            await pub.wait_for_subscribers(2)
            pub.publish([stored([3], blk(T, 2), parent=2)])
            at, msg = await eventually(lambda: last_on(js, p.stream, subject), lambda r: r[1].seq == 2)
            assert (at, msg.epoch, msg.first_seq, msg.block_size) == (garbage_seq + 2, 0, None, BS)
            seq = ing.status().ranks["0"].sequence
            assert (seq["gaps"], seq["replays"], seq["resyncs"], seq["restarts"]) == (0, 0, 0, 0)
            assert ing.counters.undecodable_stream_messages == 1
    finally:
        pub.close()


async def test_only_undecodable_messages_resynchronise_the_rank(
    nats_url: str, uid: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two garbage messages and nothing else on rank 0's subject: the ingest starts, logs both stream seqs, and
    resynchronises the rank with a Cleared("resync") under epoch 1 at seq -1 before its first batch."""
    caplog.set_level(logging.WARNING, logger="kvmesh.ingest")
    pub = EventPublisher(ANY, ANY)
    try:
        async with clean_pipeline(nats_url, uid) as p, js_client(nats_url) as js:
            subject = subjects.events_subject(p.prefix, p.model, W, 0)
            first = (await js.publish(subject, GARBAGE)).seq
            second = (await js.publish(subject, GARBAGE + b"!")).seq
            ing = await start(p, W, pub)
            for at in (second, first):  # walked back from the last
                assert f"rank 0: undecodable message at stream seq {at} on {subject}" in caplog.text
            assert caplog.text.index(f"stream seq {second} on") < caplog.text.index(f"stream seq {first} on")
            at, hello = await eventually(lambda: last_on(js, p.stream, subject), lambda r: r[0] > second)
            assert (at, hello.epoch, hello.seq, hello.events) == (second + 1, 1, -1, [Cleared("resync")])
            st = ing.status().ranks["0"]
            assert (st.epoch, st.last_seq) == (1, -1)
            await pub.wait_for_subscribers(1)
            pub.publish([stored([1], blk(T, 0))])
            _, msg = await eventually(lambda: last_on(js, p.stream, subject), lambda r: r[1].seq == 0)
            assert (msg.epoch, len(msg.events)) == (1, 1)
            assert ing.counters.undecodable_stream_messages == 2
    finally:
        pub.close()


async def test_walk_back_finds_the_last_decodable_message_past_other_subjects(
    nats_url: str, uid: str
) -> None:
    """Rank 0's seq 7 at stream seq 1, 100 messages of rank 1, then garbage and a newer-version message on
    rank 0: the walk back from the garbage returns stream seq 1 (two windows wide) and logs the one garbage."""
    async with clean_pipeline(nats_url, uid) as p, js_client(nats_url) as js:
        rank0 = subjects.events_subject(p.prefix, p.model, W, 0)
        rank1 = subjects.events_subject(p.prefix, p.model, W, 1)
        good = EventsMessage(worker_id=W, dp_rank=0, model=p.model, block_size=BS, epoch=3, seq=7, events=[])
        assert (await js.publish(rank0, encode_message(good))).seq == 1
        for _ in range(100):
            await js.publish(rank1, encode_message(good))
        assert (await js.publish(rank0, GARBAGE)).seq == 102
        assert (await js.publish(rank0, GARBAGE + b"!")).seq == 103
        met: list[int] = []
        found = await walk_back(js, p.stream, rank0, 103, lambda seq, _exc: met.append(seq))
        assert found == (1, good)
        assert met == [102]
