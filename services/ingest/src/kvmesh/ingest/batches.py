"""From a rank's delivered engine batches to stream messages in the outbox (no sockets).

`Batches.deliver` decodes an engine batch (`kvmesh.core.wire`), checks its dp_rank, turns its events into
index keys (`kvmesh.core.normalize`), coalesces it with the rank's other batches of the same burst
(`kvmesh.ingest.outbox.Coalescer`) and, when the burst ends, encodes the message under the server's max
payload (`encode_under`) and hands it to the publisher. Clears (resync, restart, malformed, rejoin) go out
after what is pending, under the rank's holder dp_rank.

A batch without events (vLLM's idle heartbeat, `kvmesh.core.engine_snapshot`) is no event and makes no
message of its own: at the end of a burst a pending message of heartbeats only stays pending, so the next
message's engine range (``first_seq..seq``) covers it; only ``--max-coalesced-batches`` of them in a row
make an empty message, which keeps the stream's cursor of an idle engine recent. A snapshot rebuild
(`Batches.rebuild`) is a Cleared("snapshot") and then the snapshot's events as one message at the cut.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.core import wire
from kvmesh.core.errors import WireError
from kvmesh.core.events import Cleared, Event, EventsMessage, encode_message
from kvmesh.core.index import Holder
from kvmesh.core.normalize import BlockSizeMismatchError, Normalizer
from kvmesh.core.sequencing import SeqTracker
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.outbox import Coalesced, Coalescer, MessageIds, Outgoing, encode_under
from kvmesh.ingest.status import IngestCounters
from kvmesh.runtime import subjects

log = logging.getLogger("kvmesh.ingest")


@dataclass(slots=True)
class Rank:
    """State of one data-parallel rank's subscription."""

    rank: int
    endpoint: str
    replay_endpoint: str | None
    tracker: SeqTracker
    normalizer: Normalizer
    coalescer: Coalescer
    """Events of consecutive delivered batches not yet enqueued (coalesced into one stream message)."""
    warned_block_size: bool = False
    holder_rank: int = -1
    """dp_rank the engine's batches carry (vLLM data_parallel_rank / SGLang attn_dp_rank); -1 until known."""
    verify: tuple[int, float] | None = None
    """(engine seq, batch ts) of the last batch the stream holds from before this ingest started: the first
    replay asks for it too, and another ts there means the engine restarted while no ingest read it."""
    replay_task: asyncio.Task[None] | None = None
    replay_seconds: float = 0.0
    """Seconds spent in replays (each from its request to its end, healed or not)."""
    snapshot_endpoint: str | None = None
    """The engine's snapshot ROUTER for this rank (vLLM PR #57789), or None."""
    snapshot_task: asyncio.Task[None] | None = None
    snapshot_events: list[Event] | None = None
    """The decoded events of the snapshot being applied (set just before its `Rebuild` is carried out)."""
    heartbeats_only: bool = False
    """The batches pending in ``coalescer`` are all heartbeats (empty batches): left pending at a burst's end."""

    @property
    def holder(self) -> int:
        """The dp_rank its messages go under: the batches' own, else the endpoint rank."""
        return self.holder_rank if self.holder_rank >= 0 else self.rank


def cursor(tracker: SeqTracker) -> int:
    """Engine seq an ingest-made message records: the last one delivered, or -1 before any of the epoch.

    A restarted ingest resumes after it (`kvmesh.ingest.recovery`), so a message made before the engine's
    first batch must not claim seq 0, or that batch would never be replayed.
    """
    return -1 if tracker.last_seq is None else tracker.last_seq


class Batches:
    """Turns delivered batches and clears of every rank into outbox messages.

    Args:
        settings: the ingest's settings (worker, model, subjects, data-parallel size, coalescing).
        counters: the ingest's counters (batches, decode errors, rejected events, splits).
        ranks: endpoint rank → its state (filled by the service before anything is delivered).
        ids: message ids of this ingest process.
        push: hands one message to the publisher's outbox.
    """

    def __init__(
        self,
        settings: IngestSettings,
        counters: IngestCounters,
        ranks: dict[int, Rank],
        ids: MessageIds,
        push: Callable[[Outgoing], None],
    ) -> None:
        self.settings = settings
        self.counters = counters
        self.ranks = ranks
        self.ids = ids
        self.push = push
        self.max_payload = 1024 * 1024
        """The server's max payload in bytes (set from the connection)."""
        self._targets: dict[int, tuple[str, Holder]] = {}
        """dp_rank → (events subject, holder), made once per rank rather than per message."""

    def deliver(self, rank: Rank, seq: int, payload: bytes) -> None:
        """Take the engine batch ``seq`` the rank's tracker delivered."""
        s = self.settings
        try:
            batch = wire.decode_batch(payload)
        except WireError as exc:
            self.counters.decode_errors += 1
            log.warning(
                "worker %s rank %d seq %d: undecodable batch dropped: %s",
                s.worker_id,
                rank.rank,
                seq,
                exc,
                extra={"worker_id": s.worker_id, "dp_rank": rank.rank, "seq": seq},
            )
            self.counters.batches += 1
            self.enqueue_clear(rank, "malformed")
            return
        heartbeat = not batch.events and not batch.errors and not batch.unknown_events
        if heartbeat:
            rank.tracker.stats.heartbeats += 1  # an idle heartbeat: covered by the next message's range
        else:
            self.counters.batches += 1
        dp_rank = batch.dp_rank if batch.dp_rank is not None else rank.rank
        ranks = s.local_ranks()
        if dp_rank not in ranks:
            # Not a rank this ingest reads (vLLM and SGLang stamp rank r on the publisher of port + r): a
            # new holder and subject per bad value would be invented. The events go, nothing else does.
            self.counters.bad_dp_rank_batches += 1
            self.counters.rejected_events += len(batch.events)
            log.error(
                "worker %s endpoint rank %d seq %d: batch carries dp_rank %d outside [%d, %d); its %d "
                "event(s) rejected",
                s.worker_id,
                rank.rank,
                seq,
                dp_rank,
                ranks.start,
                ranks.stop,
                len(batch.events),
                extra={
                    "worker_id": s.worker_id,
                    "dp_rank": rank.rank,
                    "seq": seq,
                    "batch_dp_rank": dp_rank,
                    "events": len(batch.events),
                },
            )
            # The seq is still this endpoint's: cover it with no events, so its holder's engine sequence
            # in the stream has no gap (the index would flag one).
            self._append(rank, rank.holder, seq, [], batch.ts)
            return
        salt_mismatches = rank.normalizer.stats.salt_mismatch
        result = rank.normalizer.normalize(batch)
        if salt_mismatches == 0 and rank.normalizer.stats.salt_mismatch:
            log.warning(
                "worker %s rank %d seq %d: a BlockStored extends a chain started under another cache_salt; "
                "its keys follow the chain (the salt seeds block 0 only); counted as salt_mismatch",
                s.worker_id,
                rank.rank,
                seq,
                extra={"worker_id": s.worker_id, "dp_rank": rank.rank, "seq": seq, "reason": "salt_mismatch"},
            )
        for err in batch.errors:
            self.counters.decode_errors += 1
            log.warning(
                "worker %s rank %d seq %d: malformed event dropped: %s",
                s.worker_id,
                rank.rank,
                seq,
                err,
                extra={"worker_id": s.worker_id, "dp_rank": rank.rank, "seq": seq},
            )
        for rej in result.rejections:
            self.counters.rejected_events += 1
            if isinstance(rej, BlockSizeMismatchError):
                if not rank.warned_block_size:
                    rank.warned_block_size = True
                    log.error(
                        "worker %s rank %d seq %d: events have block size %d but %d is expected; "
                        "rejecting them (set --block-size to the engine's block size)",
                        s.worker_id,
                        rank.rank,
                        seq,
                        rej.got,
                        rej.expected,
                        extra={
                            "worker_id": s.worker_id,
                            "dp_rank": rank.rank,
                            "seq": seq,
                            "reason": "block_size",
                            "block_size": rej.got,
                            "expected": rej.expected,
                        },
                    )
            else:
                log.warning(
                    "worker %s rank %d seq %d: event rejected: %s",
                    s.worker_id,
                    rank.rank,
                    seq,
                    rej,
                    extra={"worker_id": s.worker_id, "dp_rank": rank.rank, "seq": seq},
                )
        if batch.unknown_events:
            log.info(
                "worker %s rank %d seq %d: %d unknown event(s) skipped",
                s.worker_id,
                rank.rank,
                seq,
                batch.unknown_events,
                extra={
                    "worker_id": s.worker_id,
                    "dp_rank": rank.rank,
                    "seq": seq,
                    "events": batch.unknown_events,
                },
            )
        if dp_rank != rank.holder_rank and rank.holder_rank >= 0:
            log.warning(
                "worker %s endpoint rank %d seq %d: batches now carry dp_rank %d (was %d)",
                s.worker_id,
                rank.rank,
                seq,
                dp_rank,
                rank.holder_rank,
                extra={
                    "worker_id": s.worker_id,
                    "dp_rank": rank.rank,
                    "seq": seq,
                    "batch_dp_rank": dp_rank,
                    "was": rank.holder_rank,
                },
            )
        rank.holder_rank = dp_rank
        self._append(rank, dp_rank, seq, result.events, batch.ts, heartbeat=heartbeat)
        if result.lost:
            self.enqueue_clear(rank, "malformed")

    def _append(
        self, rank: Rank, dp_rank: int, seq: int, events: list[Event], ts: float, *, heartbeat: bool = False
    ) -> None:
        """Add one delivered batch's events to the rank's coalesced message (enqueueing it first when cut)."""
        alone = rank.coalescer.key is None
        cut = rank.coalescer.add(dp_rank, rank.tracker.epoch, seq, events, ts)
        if cut is not None:  # most batches join the pending message: no call for them
            self._enqueue_coalesced(cut)
        rank.heartbeats_only = heartbeat and (rank.heartbeats_only or alone or cut is not None)

    def flush(self, rank: Rank) -> None:
        """Enqueue the coalesced batches of a rank as one stream message (in order, before anything newer)."""
        batch = rank.coalescer.take()
        if batch is not None:
            self._enqueue_coalesced(batch)

    def end_burst(self, rank: Rank) -> None:
        """A burst of the rank's batches ended: flush, unless what is pending is heartbeats only, which the
        next message's engine range will cover."""
        if not (rank.heartbeats_only and rank.coalescer.key is not None):
            self.flush(rank)

    def snapshot_events(self, rank: Rank, chunks: Sequence[bytes], *, start: int = 0) -> list[Event]:
        """Decode and normalise a snapshot's chunks (each a ``KVEventBatch``; the first is chunk ``start`` of
        the reply, for errors) into the rank's stream events.

        Raises:
            WireError: a chunk does not decode, or one of its events may have removed blocks and failed to
                decode (the rebuilt holder could over-state): the snapshot is not to be used.
        """
        events: list[Event] = []
        for i, chunk in enumerate(chunks, start):
            batch = wire.decode_batch(chunk)
            result = rank.normalizer.normalize(batch)
            if result.lost:
                raise WireError(f"snapshot chunk {i}: an event that may remove blocks failed to decode")
            self.counters.decode_errors += len(batch.errors)
            self.counters.rejected_events += len(result.rejections)
            events.extend(result.events)
        return events

    def rebuild(self, rank: Rank, cut: int, after_seq: int | None, events: list[Event]) -> None:
        """Clear the rank's holder, then publish a snapshot's ``events`` as engine seq ``cut`` (nothing for an
        empty cut, -1) in one message, split under the max payload."""
        self.enqueue_clear(rank, "snapshot", seq=-1 if after_seq is None else after_seq)
        if cut < 0:
            return
        t = rank.tracker
        msg_id = self.ids.unique(self.settings.worker_id, rank.holder, t.epoch, cut, "snapshot")
        self.enqueue(rank.holder, t.epoch, cut, events, msg_id=msg_id)

    def _enqueue_coalesced(self, batch: Coalesced) -> None:
        self.enqueue(
            batch.dp_rank,
            batch.epoch,
            batch.last_seq,
            batch.events,
            ts=batch.ts,
            first_seq=batch.first_seq,
        )

    def hello(self, rank: Rank, events: list[Event]) -> None:
        """Announce the rank (so routers see the worker before it caches anything), with ``events``."""
        t = rank.tracker
        self.enqueue(
            rank.rank,
            t.epoch,
            cursor(t),
            events,
            msg_id=self.ids.unique(self.settings.worker_id, rank.rank, t.epoch, t.last_seq, "hello"),
        )

    def enqueue_clear(self, rank: Rank, reason: str, *, seq: int | None = None) -> None:
        """Enqueue a Cleared for the rank's holder after what is pending.

        ``seq`` is the engine seq the clear records (default the tracker's cursor); a resync passes the
        last batch delivered before the loss, so the holder's seqs in the stream never go back.
        """
        self.flush(rank)
        t = rank.tracker
        holder = rank.holder
        at = cursor(t) if seq is None else seq
        msg_id = self.ids.unique(self.settings.worker_id, holder, t.epoch, t.last_seq, reason)
        self.enqueue(holder, t.epoch, at, [Cleared(reason)], msg_id=msg_id)

    def enqueue(
        self,
        dp_rank: int,
        epoch: int,
        seq: int,
        events: list[Event],
        *,
        ts: float = 0.0,
        msg_id: str | None = None,
        first_seq: int | None = None,
    ) -> None:
        """Encode one message of holder ``dp_rank`` (split under the max payload) and push its parts."""
        s = self.settings
        subject, holder = self._target(dp_rank)
        msg = EventsMessage(
            worker_id=s.worker_id,
            dp_rank=dp_rank,
            model=s.model,
            block_size=self.block_size(dp_rank),
            epoch=epoch,
            seq=seq,
            first_seq=first_seq if first_seq is not None and first_seq != seq else None,
            ts=ts,
            events=events,
            readers=s.backend_of or None,
        )
        base_id = msg_id or self.ids.batch(s.worker_id, dp_rank, epoch, seq)
        parts, split = encode_under(msg, base_id, self.max_payload)
        if split:
            self.counters.split_batches += 1
        for part_id, data in parts:
            self.push(Outgoing(subject, part_id, data, holder, epoch, seq))

    def _target(self, dp_rank: int) -> tuple[str, Holder]:
        """The events subject and holder of ``dp_rank``'s messages (escaping the subject's tokens costs a few
        microseconds: it is done once per rank)."""
        target = self._targets.get(dp_rank)
        if target is None:
            s = self.settings
            subject = subjects.events_subject(s.events_prefix, s.model, s.worker_id, dp_rank)
            target = self._targets[dp_rank] = (subject, Holder(s.worker_id, dp_rank))
        return target

    def overflow_clear(self, holder: Holder, epoch: int, seq: int) -> Outgoing:
        """The Cleared("overflow") that resynchronises ``holder`` after its dropped messages."""
        s = self.settings
        clear = EventsMessage(
            worker_id=holder[0],
            dp_rank=holder[1],
            model=s.model,
            block_size=self.block_size(holder[1]),
            epoch=epoch,
            seq=seq,
            events=[Cleared("overflow")],
            readers=s.backend_of or None,
        )
        msg_id = self.ids.unique(holder[0], holder[1], epoch, seq, "overflow")
        subject = subjects.events_subject(s.events_prefix, s.model, holder[0], holder[1])
        return Outgoing(subject, msg_id, encode_message(clear), holder, epoch, seq)

    def block_size(self, dp_rank: int) -> int:
        """The block size a holder's messages carry: its normalizer's, else the configured one, else 0."""
        rank = self.ranks.get(dp_rank)
        if rank is not None and rank.normalizer.block_size is not None:
            return rank.normalizer.block_size
        return self.settings.block_size or 0
