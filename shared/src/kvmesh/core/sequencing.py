"""Engine sequence tracking for one (worker, dp_rank): gaps, replays, restarts, duplicates.

Pure state machine, fed by the ingest shell. Each engine publisher numbers its batches from 0, +1 per batch
(frame 2 of every ZMQ message; vLLM and SGLang alike). The tracker turns what arrives — live messages from
the SUB socket and replayed ones from the engine's replay ROUTER — into an ordered list of `Action`s:

* `Deliver(seq, payload)`: publish this batch now; deliveries come in strictly rising sequence order.
* `StartReplay(from_seq)`: a gap was seen; ask the replay socket for everything from ``from_seq``.
* `Resync(reason)`: events were lost for good; clear this (worker, dp_rank) in the index so it under-states
  rather than invents, then go on.
* `NewEpoch(epoch)`: the engine restarted (its sequence went backwards); clear, then deliver under the new
  incarnation number.
* `ReplayDone(healed)`: the replay is over; ``healed`` is False when it ended in a resync.
* `StartSnapshot(token)`: a gap or a restart, with a snapshot socket (vLLM PR #57789,
  `kvmesh.core.engine_snapshot`): ask it for the engine's whole state; answer with `SeqTracker.on_snapshot`
  or `SeqTracker.on_snapshot_failed` under the same ``token``.
* `Rebuild(cut, after_seq)`: the snapshot is good: clear the holder, publish the snapshot's events as engine
  seq ``cut``, then the deliveries that follow (live batches after the cut).

`StreamOrder` checks the other end: that the stream stored each holder's messages in engine order (from the
publish acks' stream sequences).

Rules (from vLLM's publisher, ``vllm/distributed/kv_events.py``, see docs/wire-protocol):

* The live SUB stream of one incarnation only rises. A live sequence at or below the highest live sequence
  seen is a new incarnation. A live sequence in (highest live, last delivered] was already delivered by a
  replay and is dropped as a duplicate.
* While a replay runs, live messages wait their turn (bounded by ``max_pending``).
* An engine that restarted while no ingest read it can continue above the stored cursor: the ingest asks the
  first replay for the cursor's own batch too, and when its ts differs from the stream's copy it calls
  `SeqTracker.on_engine_restarted` (new epoch, replay from 0). Without a replay socket, or once the engine's
  buffer no longer holds the cursor's batch, this cannot be told (a gap still resynchronises).
* A gap is healed once every missing sequence has arrived, even if the end marker never comes. If the replay
  ends (end marker, timeout) with sequences still missing, or the first replayed sequence is past the one
  asked for (the engine's buffer no longer reaches back), the tracker resynchronises.
* A live frame may carry a publisher epoch (vLLM's 24-byte frame): an epoch other than the last one seen is a
  new incarnation even when the sequence goes on rising. The first epoch seen after a start is adopted (the
  stream does not record it).
* With a snapshot socket (``snapshot=True``), a gap, or a restart first seen past seq 0 (the new
  incarnation's first batches were missed), asks for a snapshot instead of a replay or a clear; live batches
  wait as during a replay. A snapshot whose cut reaches the first held batch (``cut ≥ gap_end - 1``) rebuilds
  the holder (`Rebuild`) and the held batches after the cut follow. An unavailable snapshot (cut ≤ -2), one
  that does not reach the held batches, one whose cut is more than ``max_pending`` past the live stream, or a
  failed request falls back to a replay (from the cursor, or from
  0 after a restart) when there is a replay socket, else to a resync. A restart seen at seq 0 needs no
  snapshot: the new incarnation's state is its batches from 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from kvmesh.core.index import Holder

DEFAULT_MAX_PENDING: Final[int] = 100_000
"""Live batches held while a replay runs before the tracker gives up and resynchronises."""


@dataclass(frozen=True, slots=True)
class Deliver:
    """Publish this batch now."""

    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class StartReplay:
    """Ask the engine's replay socket for every batch from ``from_seq`` on."""

    from_seq: int


@dataclass(frozen=True, slots=True)
class Resync:
    """Clear the holder: events between ``after_seq`` and the next delivery are lost."""

    reason: str
    after_seq: int | None


@dataclass(frozen=True, slots=True)
class NewEpoch:
    """The engine restarted; ``epoch`` is its new incarnation number."""

    epoch: int
    first_seq: int


@dataclass(frozen=True, slots=True)
class ReplayDone:
    """The replay is over; ``healed`` tells whether every missing batch arrived."""

    healed: bool


@dataclass(frozen=True, slots=True)
class StartSnapshot:
    """Ask the engine's snapshot socket for its whole state; answer under ``token``."""

    token: int


@dataclass(frozen=True, slots=True)
class Rebuild:
    """Clear the holder (recording ``after_seq``, the last batch delivered before, or None) and publish the
    snapshot's events as engine seq ``cut``; later deliveries continue after it."""

    cut: int
    after_seq: int | None


Action = Deliver | StartReplay | Resync | NewEpoch | ReplayDone | StartSnapshot | Rebuild


@dataclass(slots=True)
class TrackerStats:
    """Counters of one tracker (cumulative)."""

    delivered: int = 0
    gaps: int = 0
    missing_batches: int = 0
    replays: int = 0
    replayed_batches: int = 0
    healed: int = 0
    resyncs: int = 0
    restarts: int = 0
    duplicates: int = 0
    snapshots: int = 0
    """Snapshots asked for (a gap or a restart with a snapshot socket)."""
    rebuilds: int = 0
    """Snapshots applied: the holder rebuilt from the engine's state."""
    snapshot_failures: int = 0
    """Snapshots unavailable (cut ≤ -2), short of the live stream, or failed; a replay or a resync followed."""
    heartbeats: int = 0
    """Delivered batches without events (vLLM's idle heartbeats; counted by the ingest, which publishes no
    message for them alone)."""


@dataclass(slots=True)
class SeqTracker:
    """Sequence cursor of one (worker, dp_rank).

    Args:
        epoch: current engine incarnation (recovered from the stream on ingest restart, else 0).
        last_seq: last sequence delivered in this epoch, or None before the first.
        replay: whether the engine has a replay socket; without one a gap resynchronises at once.
        max_pending: live batches buffered during a replay before giving up.
        snapshot: whether the engine has a snapshot socket (gaps and restarts past seq 0 rebuild from it).
    """

    epoch: int = 0
    last_seq: int | None = None
    replay: bool = True
    max_pending: int = DEFAULT_MAX_PENDING
    live_high: int | None = None
    replaying: bool = False
    gap_end: int = 0
    """First live sequence after the gap (the gap is ``[last_seq + 1, gap_end)``)."""
    pending: dict[int, bytes] = field(default_factory=dict)
    stats: TrackerStats = field(default_factory=TrackerStats)
    snapshot: bool = False
    snapshotting: bool = False
    """A snapshot was asked for and not answered yet (live batches wait in ``pending``)."""
    snapshot_token: int = 0
    """Token of the last snapshot asked for; answers under another token are stale and ignored."""
    publisher: bytes | None = None
    """Publisher epoch of the last live frame (None: an 8-byte frame, or none seen yet)."""
    publisher_seen: bool = False

    def __post_init__(self) -> None:
        if self.live_high is None:
            self.live_high = self.last_seq

    # ------------------------------------------------------------------ live

    def on_live(self, seq: int, payload: bytes, publisher: bytes | None = None) -> list[Action]:
        """Take one live message from the SUB socket (``publisher``: the frame's publisher epoch, if any)."""
        actions: list[Action] = []
        new_publisher = self.publisher_seen and publisher != self.publisher
        self.publisher, self.publisher_seen = publisher, True
        if new_publisher or (self.live_high is not None and seq <= self.live_high):
            if self.replaying or self.snapshotting:
                self._abandon_replay(actions, "restart")
            self.epoch += 1
            self.stats.restarts += 1
            self.last_seq = None
            self.live_high = seq
            actions.append(NewEpoch(self.epoch, seq))
            if self.snapshot and seq > 0:
                self._start_snapshot(seq, payload, actions)
            else:
                self._deliver(seq, payload, actions)
            return actions
        self.live_high = seq
        if self.last_seq is not None and seq <= self.last_seq:
            self.stats.duplicates += 1  # already delivered by a replay
            return actions
        if self.replaying or self.snapshotting:
            self.pending[seq] = payload
            if len(self.pending) > self.max_pending:
                self._abandon_replay(actions, "replay_overflow")
            return actions
        if self.last_seq is None or seq == self.last_seq + 1:
            self._deliver(seq, payload, actions)
            return actions
        # A gap: [last_seq + 1, seq) is missing.
        missing = seq - self.last_seq - 1
        self.stats.gaps += 1
        self.stats.missing_batches += missing
        if self.snapshot:
            self._start_snapshot(seq, payload, actions)
            return actions
        if not self.replay:
            self.stats.resyncs += 1
            actions.append(Resync("gap", self.last_seq))
            self._deliver(seq, payload, actions)
            return actions
        self.replaying = True
        self.gap_end = seq
        self.pending[seq] = payload
        self.stats.replays += 1
        actions.append(StartReplay(self.last_seq + 1))
        return actions

    # ------------------------------------------------------------------ replay

    def on_replay(self, seq: int, payload: bytes) -> list[Action]:
        """Take one batch from the replay socket (never the end marker)."""
        actions: list[Action] = []
        if not self.replaying:
            return actions
        assert self.last_seq is not None
        if seq <= self.last_seq:
            self.stats.duplicates += 1
            return actions
        if seq > self.last_seq + 1:
            # The engine's buffer no longer reaches back to what we miss.
            self.stats.resyncs += 1
            actions.append(Resync("replay_truncated", self.last_seq))
            self.last_seq = seq - 1
        self.stats.replayed_batches += 1
        self.pending.pop(seq, None)
        self._deliver(seq, payload, actions)
        self._flush_contiguous(actions)
        if self.last_seq is not None and self.last_seq >= self.gap_end:
            self._finish(actions, healed=not any(isinstance(a, Resync) for a in actions))
        return actions

    # ------------------------------------------------------------------ snapshot

    def on_snapshot(self, token: int, cut: int) -> list[Action]:
        """The snapshot asked for under ``token`` answered with ``cut`` (its state decoded and ready).

        A cut that reaches the first held live batch rebuilds the holder and delivers the held batches after
        it; an unavailable one (≤ -2), one short of the held batches, or one more than ``max_pending`` past the
        highest live sequence seen (no batch can be that far in flight: a lying or broken publisher) falls
        back (`on_snapshot_failed`).
        """
        if not self.snapshotting or token != self.snapshot_token:
            return []
        if cut < -1:
            return self._snapshot_fallback("snapshot_unavailable")
        if cut < self.gap_end - 1:
            return self._snapshot_fallback("snapshot_behind")
        if self.live_high is not None and cut > self.live_high + self.max_pending:
            # Past anything in flight (more than a held buffer's worth beyond the live stream): used, every
            # live batch up to the cut would be dropped as a duplicate.
            return self._snapshot_fallback("snapshot_ahead")
        actions: list[Action] = [Rebuild(cut, self.last_seq)]
        self.snapshotting = False
        self.stats.rebuilds += 1
        self.last_seq = cut
        for seq in [s for s in self.pending if s <= cut]:
            del self.pending[seq]  # in the snapshot's state already
        self._flush_contiguous(actions)
        if self.pending:  # live batches lost again while the snapshot was taken
            self._abandon_replay(actions, "gap_after_snapshot")
        return actions

    def on_snapshot_failed(self, token: int, reason: str) -> list[Action]:
        """The snapshot asked for under ``token`` could not be had (timeout, bad reply, another publisher)."""
        if not self.snapshotting or token != self.snapshot_token:
            return []
        return self._snapshot_fallback(reason)

    def _start_snapshot(self, seq: int, payload: bytes, actions: list[Action]) -> None:
        self.snapshotting = True
        self.snapshot_token += 1
        self.gap_end = seq
        self.pending[seq] = payload
        self.stats.snapshots += 1
        actions.append(StartSnapshot(self.snapshot_token))

    def _snapshot_fallback(self, reason: str) -> list[Action]:
        """No usable snapshot: replay what is missing (from 0 after a restart) or resynchronise."""
        actions: list[Action] = []
        self.snapshotting = False
        self.stats.snapshot_failures += 1
        if self.replay:
            if self.last_seq is None:  # a restart: the new incarnation's batches from 0
                self.last_seq = -1
            self.replaying = True
            self.stats.replays += 1
            actions.append(StartReplay(self.last_seq + 1))
            return actions
        self._abandon_replay(actions, reason)
        return actions

    def on_engine_restarted(self) -> list[Action]:
        """The replay showed the engine restarted since the cursor (its batch at the cursor is another one):
        start a new epoch and replay the new incarnation from seq 0; live batches held so far stay held."""
        self.epoch += 1
        self.stats.restarts += 1
        self.last_seq = -1
        if not self.replaying:
            self.replaying = True
            self.gap_end = self.live_high if self.live_high is not None else 0
        return [NewEpoch(self.epoch, 0), StartReplay(0)]

    def rejoin(self, epoch: int) -> None:
        """Continue under incarnation ``epoch`` with the cursor kept: the ingest started a new incarnation of
        its worker (a rejoin after the worker left the registry), announced by its own Cleared.

        Raises:
            ValueError: ``epoch`` is not above the current epoch (incarnations only rise).
        """
        if epoch <= self.epoch:
            raise ValueError(f"epoch {epoch} is not above the current epoch {self.epoch}")
        self.epoch = epoch

    def on_replay_end(self, reason: str = "replay_incomplete") -> list[Action]:
        """The replay ended (end marker, timeout, or error) — resynchronise if anything is still missing."""
        actions: list[Action] = []
        if not self.replaying:
            return actions
        self._abandon_replay(actions, reason)
        return actions

    # ------------------------------------------------------------------ internals

    def _deliver(self, seq: int, payload: bytes, actions: list[Action]) -> None:
        self.last_seq = seq
        self.stats.delivered += 1
        actions.append(Deliver(seq, payload))

    def _flush_contiguous(self, actions: list[Action]) -> None:
        while self.last_seq is not None and (self.last_seq + 1) in self.pending:
            nxt = self.last_seq + 1
            self._deliver(nxt, self.pending.pop(nxt), actions)

    def _abandon_replay(self, actions: list[Action], reason: str) -> None:
        self.snapshotting = False
        self._flush_contiguous(actions)
        if self.pending:
            self.stats.resyncs += 1
            actions.append(Resync(reason, self.last_seq))
            for seq in sorted(self.pending):
                self._deliver(seq, self.pending[seq], actions)
            self.pending.clear()
            self._finish(actions, healed=False)
        else:
            self._finish(actions, healed=True)

    def _finish(self, actions: list[Action], *, healed: bool) -> None:
        self.replaying = False
        self.pending.clear()
        if healed:
            self.stats.healed += 1
        actions.append(ReplayDone(healed))


@dataclass(frozen=True, slots=True)
class Inversion:
    """Two messages of one holder stored in the stream against their engine order.

    ``earlier`` was published first (engine order) but stored under the higher stream sequence; both are
    ``(epoch, engine seq, stream seq)``.
    """

    earlier: tuple[int, int, int]
    later: tuple[int, int, int]


@dataclass(slots=True)
class StreamOrder:
    """Checks, per holder (worker, dp_rank), that the stream stored its messages in engine order.

    Feed it the publish acks in engine order (the order the messages were handed to JetStream): a JetStream
    PubAck carries the message's stream sequence (for a duplicate, the original's), so a holder's stream
    sequences must rise. One that does not means a message published before it was stored after it (a
    publish that failed while later ones landed, then re-sent): the stream holds that holder's messages out
    of order, and only a resync after them repairs the index.
    """

    high: dict[Holder, tuple[int, int, int]] = field(default_factory=dict)
    """Holder → (epoch, engine seq, stream seq) of its message with the highest stream sequence so far."""

    reported: dict[Holder, int] = field(default_factory=dict)
    """Holder → stream sequence of the top an inversion was last reported against (reported once)."""

    def on_ack(self, holder: Holder, epoch: int, seq: int, stream_seq: int) -> Inversion | None:
        """Take the ack of ``holder``'s next message in engine order; return the inversion it reveals.

        Further messages stored below the same top are the same incident and return None: one resync
        published after them covers them all.
        """
        top = self.high.get(holder)
        here = (epoch, seq, stream_seq)
        if top is not None and stream_seq < top[2]:
            if self.reported.get(holder) == top[2]:
                return None
            self.reported[holder] = top[2]
            return Inversion(earlier=top, later=here)
        self.high[holder] = here
        return None

    def holders_to_resync(self, acks: list[tuple[Holder, int, int, int]]) -> list[Holder]:
        """Take acks ``(holder, epoch, seq, stream_seq)`` in engine order; return the holders found out of
        order, each once, in the order found."""
        out: list[Holder] = []
        for holder, epoch, seq, stream_seq in acks:
            if self.on_ack(holder, epoch, seq, stream_seq) is not None and holder not in out:
                out.append(holder)
        return out
