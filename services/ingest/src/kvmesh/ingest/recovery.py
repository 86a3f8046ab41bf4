"""Recover one rank's cursor at start from the last message on its subject (the JetStream side).

The cursor (epoch, last engine seq) of a (worker, dp_rank) is the last `EventsMessage` on its subject. A last
message that does not decode (one written by a newer version before a rollback) is logged with its stream
sequence, counted and skipped: the cursor comes from the message before it on the same subject, found by
walking back over windows of stream sequences (``next_by_subj`` reads inside each window). When no message of
the subject decodes, the rank is resynchronised: a fresh tracker under epoch 1, announced by a
``Cleared("resync")``, so the index rebuilds the holder from nothing instead of trusting a cursor it cannot
read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext

from kvmesh.core.errors import MessageDecodeError
from kvmesh.core.events import EventsMessage, Message, decode_message
from kvmesh.core.sequencing import SeqTracker
from kvmesh.runtime.replica import retry_start
from kvmesh.runtime.subjects import untoken

log = logging.getLogger("kvmesh.ingest")

RESYNC_EPOCH = 1
"""Epoch of a rank whose subject holds messages but none that decodes (above the 0 of a first start)."""
_FIRST_WINDOW = 64
"""Stream sequences the first walk-back window spans (each next window is 4× wider)."""


def subject_fields(subject: str) -> dict[str, Any]:
    """The log fields of a rank's events subject (``<prefix>.<model>.<worker>.<dp_rank>``): ``worker_id`` and
    ``dp_rank``; empty when ``subject`` does not end in a worker token and a rank."""
    *_, worker, rank = ["", "", *subject.split(".")]
    return {"worker_id": untoken(worker), "dp_rank": int(rank)} if rank.isdigit() and worker else {}


@dataclass(frozen=True, slots=True)
class RankCursor:
    """What a rank resumes from.

    Attributes:
        tracker: the rank's sequence tracker.
        found: True when a decodable cursor was recovered from the stream.
        resync: True when the rank's subject held only undecodable messages: announce it with a Cleared.
        verify: (engine seq, batch ts) of the recovered batch, checked against the engine's replay (or None).
    """

    tracker: SeqTracker
    found: bool
    resync: bool = False
    verify: tuple[int, float] | None = None


def fresh_tracker(has_replay: bool, epoch: int = 0, *, has_snapshot: bool = False) -> SeqTracker:
    """A tracker with no stored cursor: with a replay (or snapshot) socket the next batch due is the engine's
    seq 0, so a first live sequence above 0 replays what the engine still holds (or rebuilds the rank from the
    engine's snapshot) before going live."""
    recoverable = has_replay or has_snapshot
    return SeqTracker(
        epoch=epoch, last_seq=-1 if recoverable else None, replay=has_replay, snapshot=has_snapshot
    )


def cursor_from(last: Message, has_replay: bool, *, has_snapshot: bool = False) -> RankCursor:
    """The cursor a decoded last message gives: resume after an `EventsMessage`, else start fresh."""
    if not isinstance(last, EventsMessage):
        return RankCursor(fresh_tracker(has_replay, has_snapshot=has_snapshot), False)
    # seq -1: the ingest announced the rank but saw no batch of the epoch; the next one due is 0. The
    # engine's batch `last.seq` carried `last.ts`: a replay handing back that seq with another ts comes from
    # a restarted engine.
    verify = (last.seq, last.ts) if has_replay and last.seq >= 0 and last.ts > 0 else None
    tracker = SeqTracker(
        epoch=last.epoch, last_seq=max(last.seq, -1), replay=has_replay, snapshot=has_snapshot
    )
    return RankCursor(tracker, True, verify=verify)


async def walk_back(
    js: JetStreamContext,
    stream: str,
    subject: str,
    before: int,
    on_undecodable: Callable[[int, MessageDecodeError], None],
) -> tuple[int, Message] | None:
    """The last decodable message on ``subject`` stored below stream seq ``before``, with its stream seq.

    Each undecodable message met on the way is passed to ``on_undecodable(stream_seq, error)``. None when no
    message of the subject below ``before`` decodes.

    Raises:
        nats.errors.Error, TimeoutError: the stream could not be read.
    """
    first = int((await js.stream_info(stream)).state.first_seq or 1)
    span = _FIRST_WINDOW
    while before > first:
        start = max(first, before - span)
        found: tuple[int, Message] | None = None
        at = start
        while True:
            try:
                raw = await js.get_msg(stream, seq=at, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                break
            if raw.seq is None or raw.seq >= before:
                break
            try:
                found = (raw.seq, decode_message(raw.data or b""))
            except MessageDecodeError as exc:
                on_undecodable(raw.seq, exc)
            at = raw.seq + 1
        if found is not None:
            return found
        before, span = start, span * 4
    return None


async def recover_rank(
    js: JetStreamContext,
    *,
    stream: str,
    subject: str,
    who: str,
    has_replay: bool,
    stop: asyncio.Event,
    on_undecodable: Callable[[int, MessageDecodeError], None],
    has_snapshot: bool = False,
) -> RankCursor:
    """Read the rank's cursor from the last message on ``subject`` (see the module docstring).

    Start-up reads ride out a stream without a leader (`retry_start`); ``stop`` interrupts them (the rank then
    starts fresh, as the ingest is stopping).
    """
    try:
        raw: Any = await retry_start(
            lambda: js.get_last_msg(stream, subject),
            what=f"read the last message on {subject}",
            name=who,
            stop=stop,
        )
    except nats.js.errors.NotFoundError:
        return RankCursor(fresh_tracker(has_replay, has_snapshot=has_snapshot), False)
    if raw is None:  # stopping
        return RankCursor(fresh_tracker(has_replay, has_snapshot=has_snapshot), False)
    at: int = raw.seq
    try:
        last: Message = decode_message(raw.data or b"")
    except MessageDecodeError as exc:
        on_undecodable(at, exc)
        before = at
        try:
            prev = await retry_start(
                lambda: walk_back(js, stream, subject, before, on_undecodable),
                what=f"walk back on {subject} from stream seq {before}",
                name=who,
                stop=stop,
            )
        except nats.js.errors.NotFoundError:  # the stream went away under the walk
            prev = None
        if prev is None:
            log.warning(
                "%s: no message on %s decodes; resynchronising the rank under epoch %d",
                who,
                subject,
                RESYNC_EPOCH,
                extra={**subject_fields(subject), "epoch": RESYNC_EPOCH},
            )
            tracker = fresh_tracker(has_replay, RESYNC_EPOCH, has_snapshot=has_snapshot)
            return RankCursor(tracker, False, resync=True)
        at, last = prev
    cursor = cursor_from(last, has_replay, has_snapshot=has_snapshot)
    if cursor.found:
        log.info(
            "%s: resuming %s after epoch %d seq %d (from stream seq %d)",
            who,
            subject,
            cursor.tracker.epoch,
            cursor.tracker.last_seq,
            at,
            extra={
                **subject_fields(subject),
                "epoch": cursor.tracker.epoch,
                "seq": cursor.tracker.last_seq,
                "stream_seq": at,
            },
        )
    return cursor
