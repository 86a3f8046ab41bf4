"""The ingest's outbox policy, sans-I/O: what is published, in which order, and what is dropped.

No sockets, no event loop, no clock: times come in as arguments (seconds of a monotonic clock), acks as
objects with a future's ``done/cancelled/exception/result/cancel`` (`Ack`). The shell (`kvmesh.ingest.publish`)
carries out what these objects decide, as it carries out `SeqTracker`'s actions.

* `Coalescer`: the consecutive delivered batches of one rank read in one burst become one stream message
  (cut at ``--max-coalesced-batches`` engine batches or `COALESCE_MAX_EVENTS` events, and whenever the
  (dp_rank, epoch) changes).
* `encode_under` / `split_events`: a message above the server's max payload is cut into parts of similar size;
  a long Stored run is cut with its parent chain intact.
* `Outbox`: bounded; when full the oldest message is dropped and its holder marked for one overflow clear,
  emitted right before the holder's next message (or at once when none is left).
* `AckWindow`: the published messages awaiting their ack, in engine order; a failed or overdue ack sends
  everything unacknowledged back to the outbox front, in order (`AckWindow.requeue`); an ack whose stream
  sequence is below an earlier one of its holder is a repair (delete, send again); after a failure or a repair
  the backlog goes one message at a time (``serial``).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Generic, NamedTuple, Protocol, TypeVar

import msgspec

from kvmesh.core.events import Event, EventsMessage, Placed, Removed, Stored, StoredKeys, encode_message
from kvmesh.core.index import Holder
from kvmesh.core.sequencing import Inversion, StreamOrder

COALESCE_MAX_EVENTS: Final[int] = 1024
"""Events per coalesced stream message before it is cut (the max-payload split still applies after)."""
PAYLOAD_HEADROOM: Final[int] = 4096
"""Bytes kept free below the server's max payload (headers, subject)."""


@dataclass(slots=True)
class Outgoing:
    """One stream message to publish: its subject, ``Nats-Msg-Id``, bytes, holder and engine position."""

    subject: str
    msg_id: str
    data: bytes
    holder: Holder
    epoch: int = 0
    seq: int = 0
    stored_seq: int | None = None
    """Stream sequence of an earlier send's ack (it is not sent again, only checked in order)."""


# ---------------------------------------------------------------------------------------------- ids


@dataclass(slots=True)
class MessageIds:
    """``Nats-Msg-Id`` values, unique per ingest process thanks to ``nonce``.

    A re-used worker id (another model, a restart within the duplicate window) never collides with what an
    earlier process published. Ingest-made messages (clears, announcements) add a serial.
    """

    nonce: str
    serial: int = 0

    def batch(self, worker: str, dp_rank: int, epoch: int, seq: int) -> str:
        """Id of an engine batch message: ``worker:dp_rank:epoch:seq:nonce``."""
        return f"{worker}:{dp_rank}:{epoch}:{seq}:{self.nonce}"

    def unique(self, worker: str, dp_rank: int, epoch: int, last_seq: int | None, kind: str) -> str:
        """Id of an ingest-made message of ``kind`` (``hello``, a clear reason, ``overflow``)."""
        self.serial += 1
        return f"{worker}:{dp_rank}:{epoch}:{last_seq}:{kind}:{self.nonce}:{self.serial}"

    def again(self, msg_id: str) -> str:
        """A new id for a message deleted from the stream and sent again (the old one is a duplicate)."""
        self.serial += 1
        return f"{msg_id}:again{self.serial}"


# ---------------------------------------------------------------------------------------------- coalescing


class Coalesced(NamedTuple):
    """Consecutive batches of one (dp_rank, epoch): engine seqs ``first_seq``..``last_seq``, the last ts.

    A NamedTuple: one is made per stream message, and a frozen dataclass costs about twice as much to build.
    """

    dp_rank: int
    epoch: int
    first_seq: int
    last_seq: int
    ts: float
    events: list[Event]


@dataclass(slots=True)
class Coalescer:
    """The delivered batches of one rank not yet enqueued.

    Args:
        max_batches: engine batches per message at most (``--max-coalesced-batches``, ≥ 1).
        max_events: events per message before it is cut.
    """

    max_batches: int
    max_events: int = COALESCE_MAX_EVENTS
    events: list[Event] = field(default_factory=list)
    key: tuple[int, int] | None = None
    """(dp_rank, epoch) of the pending batches, None when there are none."""
    first: int = -1
    last: int = -1
    ts: float = 0.0

    def add(self, dp_rank: int, epoch: int, seq: int, events: list[Event], ts: float) -> Coalesced | None:
        """Add one delivered batch; return the pending message to enqueue first when it had to be cut."""
        key = (dp_rank, epoch)
        out = None
        if (
            self.key != key
            or len(self.events) >= self.max_events
            or (self.key is not None and seq - self.first >= self.max_batches)
        ):
            out = self.take()
        if self.key is None:
            self.key = key
            self.first = seq
        self.events.extend(events)
        self.last = seq
        self.ts = ts
        return out

    def take(self) -> Coalesced | None:
        """The pending batches as one message (None when there are none); nothing is pending after."""
        if self.key is None:
            return None
        (dp_rank, epoch), events = self.key, self.events
        self.events, self.key = [], None
        return Coalesced(dp_rank, epoch, self.first, self.last, self.ts, events)


# ---------------------------------------------------------------------------------------------- splitting


def split_events(events: list[Event], parts: int) -> list[list[Event]]:
    """Split events into about ``parts`` lists of similar encoded size.

    Long Stored runs are cut without breaking the parent chain (each piece's parent is the previous piece's
    last block); long Removed, Placed and StoredKeys lists are cut into several (a StoredKeys piece keeps the
    event's parent: its prefix keys need none). A stored block weighs two hashes (engine
    and local), a removed or placed block one.
    """

    def weight(e: Event) -> int:
        if isinstance(e, Stored):
            return 2 * len(e.engine_hashes)
        if isinstance(e, Removed | Placed):
            return len(e.engine_hashes)
        if isinstance(e, StoredKeys):
            return len(e.prefix_keys) * (1 if e.engine_hashes is None else 2)
        return 1

    per_part = max(2, math.ceil(sum(weight(e) for e in events) / parts))
    out: list[list[Event]] = [[]]
    size = 0

    def add(e: Event) -> None:
        nonlocal size
        n = weight(e)
        if size + n > per_part and out[-1]:
            out.append([])
            size = 0
        out[-1].append(e)
        size += n

    for e in events:
        if isinstance(e, Stored) and weight(e) > per_part:
            step = max(1, per_part // 2)
            parent = e.parent
            for i in range(0, len(e.engine_hashes), step):
                chunk = Stored(e.engine_hashes[i : i + step], parent, e.local_hashes[i : i + step], e.medium)
                parent = chunk.engine_hashes[-1]
                add(chunk)
        elif isinstance(e, StoredKeys) and weight(e) > per_part:
            step = max(1, per_part // 2)
            for i in range(0, len(e.prefix_keys), step):
                engine = None if e.engine_hashes is None else e.engine_hashes[i : i + step]
                add(StoredKeys(e.prefix_keys[i : i + step], e.parent, e.medium, engine))
        elif isinstance(e, Removed | Placed) and weight(e) > per_part:
            for i in range(0, len(e.engine_hashes), per_part):
                add(type(e)(e.engine_hashes[i : i + per_part], e.medium))
        else:
            add(e)
    return out


def encode_under(msg: EventsMessage, msg_id: str, max_payload: int) -> tuple[list[tuple[str, bytes]], bool]:
    """Encode ``msg`` as (``Nats-Msg-Id``, bytes) parts that each fit ``max_payload`` less `PAYLOAD_HEADROOM`.

    Returns:
        ``([(msg_id, data)], False)`` when it fits whole, else the parts (``part`` 0, 1, ...; ids
        ``msg_id:0``, ``msg_id:1``, ...) and True.
    """
    data = encode_message(msg)
    limit = max_payload - PAYLOAD_HEADROOM
    if len(data) <= limit:
        return [(msg_id, data)], False
    parts = split_events(msg.events, math.ceil(len(data) / limit) + 1)
    return [
        (f"{msg_id}:{i}", encode_message(msgspec.structs.replace(msg, part=i, events=part)))
        for i, part in enumerate(parts)
    ], True


# ---------------------------------------------------------------------------------------------- outbox


@dataclass(slots=True)
class Outbox:
    """Messages waiting to be published, oldest first, at most ``limit`` (``--max-buffered-batches``).

    A full outbox drops its oldest message (`push` returns it) and marks the holder overflowed: its one
    overflow clear is emitted by `next` right before the holder's next message, or at once when none of its
    messages is left, so any number of drops of one holder costs one clear.
    """

    limit: int
    queue: deque[Outgoing] = field(default_factory=deque)
    queued: Counter[Holder] = field(default_factory=Counter)
    """Messages per holder in the queue."""
    overflowed: dict[Holder, tuple[int, int]] = field(default_factory=dict)
    """Holder → (epoch, engine seq) of its last dropped message, until its overflow clear is emitted."""

    def __len__(self) -> int:
        return len(self.queue)

    @property
    def idle(self) -> bool:
        """True when nothing is queued and no overflow clear is due."""
        return not self.queue and not self.overflowed

    def push(self, out: Outgoing) -> list[tuple[Outgoing, bool]]:
        """Append ``out``; return what was dropped to make room, each with True when it is the first drop
        of its holder since the last overflow clear (the one to log)."""
        dropped: list[tuple[Outgoing, bool]] = []
        while len(self.queue) >= self.limit:
            old = self.queue.popleft()
            self.queued[old.holder] -= 1
            dropped.append((old, old.holder not in self.overflowed))
            self.overflowed[old.holder] = (old.epoch, old.seq)
        self.queue.append(out)
        self.queued[out.holder] += 1
        return dropped

    def push_front(self, out: Outgoing) -> None:
        """Put ``out`` back at the front (a re-send goes before everything newer)."""
        self.queue.appendleft(out)
        self.queued[out.holder] += 1

    def pop(self) -> Outgoing:
        """Take the front message (the one `next` returned)."""
        out = self.queue.popleft()
        self.queued[out.holder] -= 1
        return out

    def drop_front(self) -> Outgoing:
        """Take the front message for good (it can never be published) and mark its holder overflowed."""
        out = self.pop()
        self.overflowed[out.holder] = (out.epoch, out.seq)
        return out

    def next(self, make_clear: Callable[[Holder, int, int], Outgoing]) -> Outgoing | None:
        """The next message to publish (left in the queue), emitting one due overflow clear first.

        ``make_clear(holder, epoch, seq)`` builds a holder's overflow clear at the engine position of its last
        dropped message.
        """
        for holder, (epoch, seq) in list(self.overflowed.items()):
            if self.queued[holder] == 0 or (self.queue and self.queue[0].holder == holder):
                del self.overflowed[holder]
                self.push_front(make_clear(holder, epoch, seq))
                break
        return self.queue[0] if self.queue else None


# ---------------------------------------------------------------------------------------------- acks


class Ack(Protocol):
    """A publish's pending ack (an `asyncio.Future` of a PubAck, or of the int stream seq of an earlier send)."""

    def done(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def exception(self) -> BaseException | None: ...
    def result(self) -> Any: ...
    def cancel(self) -> bool: ...


A = TypeVar("A", bound=Ack)


def ack_seq(fut: Ack) -> int | None:
    """Stream sequence of a settled publish (a PubAck's ``seq``, or the int of an earlier send), else None."""
    if not fut.done() or fut.cancelled() or fut.exception() is not None:
        return None
    res = fut.result()
    return res if isinstance(res, int) else int(res.seq)


class AckOutcome(NamedTuple):
    """What `AckWindow.take_acks` found at the front of the window (one per turn of the publish loop, hence a
    NamedTuple rather than a frozen dataclass, which costs about twice as much to build).

    Attributes:
        published: messages acknowledged in order and counted as published.
        inversions: (message, inversion) for each holder found stored against engine order (to log).
        failed: the message whose publish failed, with the error (None: cancelled), if one did.
        overdue: the oldest message when its ack did not come within the timeout.
    """

    published: int
    inversions: list[tuple[Outgoing, Inversion]]
    failed: tuple[Outgoing, BaseException | None] | None = None
    overdue: Outgoing | None = None

    @property
    def resend(self) -> bool:
        """True when the window must be re-sent from its front (a failure or an overdue ack)."""
        return self.failed is not None or self.overdue is not None


@dataclass(slots=True)
class AckWindow(Generic[A]):
    """Published messages awaiting their ack, in engine order: (message, ack, time sent)."""

    inflight: deque[tuple[Outgoing, A, float]] = field(default_factory=deque)
    order: StreamOrder = field(default_factory=StreamOrder)
    """Checks each holder's acks rise in engine order."""
    repairs: list[tuple[Outgoing, int]] = field(default_factory=list)
    """Messages whose ack showed them stored before an earlier one of their holder (to delete, re-send)."""
    serial: int = 0
    """Messages still to publish one at a time after a failure or a repair."""

    def __len__(self) -> int:
        return len(self.inflight)

    def room(self, window: int) -> int:
        """Messages that may be outstanding now: 1 while serial, else ``window`` (``--max-pending-acks``)."""
        return 1 if self.serial else window

    def sent(self, out: Outgoing, ack: A, now: float) -> None:
        """Record that ``out`` was handed to the server at ``now``."""
        self.inflight.append((out, ack, now))

    def take_acks(self, now: float, ack_timeout_s: float) -> AckOutcome:
        """Take the settled acks at the front of the window, in order (see `AckOutcome`).

        An ack whose stream sequence is below the highest of its holder's so far goes to ``repairs`` (it is
        not counted published). Stops at the first failed ack, which stays at the front.
        """
        published = 0
        inversions: list[tuple[Outgoing, Inversion]] = []
        inflight = self.inflight
        while inflight and inflight[0][1].done():
            out, fut, _ = inflight[0]
            exc = None if fut.cancelled() else fut.exception()
            if fut.cancelled() or exc is not None:
                return AckOutcome(published, inversions, failed=(out, exc))
            inflight.popleft()
            if self.serial:
                self.serial -= 1
            stream_seq = ack_seq(fut)
            if stream_seq is not None:
                top = self.order.high.get(out.holder)
                inv = self.order.on_ack(out.holder, out.epoch, out.seq, stream_seq)
                if inv is not None:
                    inversions.append((out, inv))
                if top is not None and stream_seq < top[2]:
                    # Stored before an earlier message of its holder: delete it and send it again after.
                    self.repairs.append((out, stream_seq))
                    continue
            published += 1
        overdue = inflight[0][0] if inflight and now - inflight[0][2] > ack_timeout_s else None
        return AckOutcome(published, inversions, overdue=overdue)

    def overtakers(self) -> Iterator[tuple[int, Outgoing, int]]:
        """(index, message, stream seq) of each stored message of the window that sits after an unstored one
        of its holder; read lazily, so acks that settle between steps count.

        These are deleted from the stream by the shell and marked with `unsent`, to be sent again after the
        failed one: the holder's stream order then equals engine order.
        """
        failed: set[Holder] = set()
        for i in range(len(self.inflight)):
            out, fut, _ = self.inflight[i]
            stored = ack_seq(fut)
            if stored is None:
                failed.add(out.holder)
            elif out.holder in failed:
                yield i, out, stored

    def unsent(self, index: int, ack: A) -> None:
        """Replace the ack of the message at ``index`` (deleted from the stream) by ``ack``, a cancelled one,
        so `requeue` sends it again."""
        out, _, sent = self.inflight[index]
        self.inflight[index] = (out, ack, sent)

    def requeue(self, outbox: Outbox) -> int:
        """Put every message of the window back at the front of ``outbox``, in order; return how many go out
        again (their acks are cancelled, which frees the client's pending-ack slot; a late ack is ignored).

        Those already acknowledged keep their stream sequence (`Outgoing.stored_seq`): they are not sent again,
        only taken in order, so the ack check sees every holder's stream sequences. What follows goes one
        message at a time (``serial``), so each outcome is known before the next.
        """
        retries = 0
        self.serial = max(self.serial, len(self.inflight))
        while self.inflight:
            out, fut, _ = self.inflight.pop()
            stored = ack_seq(fut)
            if stored is not None:
                out.stored_seq = stored
            else:
                fut.cancel()
                retries += 1
            outbox.push_front(out)
        return retries

    def take_repairs(self) -> list[tuple[Outgoing, int]]:
        """The messages to repair (delete, send again in order), leaving none."""
        repairs, self.repairs = self.repairs, []
        return repairs

    def put_back(self, outbox: Outbox, out: Outgoing) -> None:
        """Put a repaired message that was deleted from the stream at the front of ``outbox``, to be sent
        again (call in reverse engine order, as `requeue` does)."""
        out.stored_seq = None
        outbox.push_front(out)

    def after_repair(self, repairs: int, waiting: int) -> None:
        """Send the ``repairs`` repaired messages and the ``waiting`` ones requeued behind them one at a time."""
        self.serial = max(self.serial, repairs + waiting)
