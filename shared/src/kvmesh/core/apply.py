"""The one apply path for encoded stream messages: bytes and a stream sequence in, the index state changed.

Every reader of the events stream (the indexer's and a local-index router's `kvmesh.runtime.replica.
StreamReplica`, ``kvmesh replay`` and the recovery benchmark through `kvmesh.runtime.snapshots.replay_stream`)
hands each delivered message to `StreamApplier.apply`. A message that does not decode, or that fails to
apply, is counted and skipped: the state's ``applied_seq`` still moves past it, so the replicas that skip it
stay at the same sequence (and digest) as every other replica. The caller logs what `apply` returns with the
message's sequence and subject; this module does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvmesh.core.events import decode_message
from kvmesh.core.state import IndexState


@dataclass(frozen=True, slots=True)
class Skipped:
    """A stream message that was not applied (its sequence still counts as applied)."""

    seq: int
    """Its stream sequence."""
    kind: Literal["undecodable", "failed"]
    """``"undecodable"``: `decode_message` refused the bytes; ``"failed"``: `IndexState.apply` raised."""
    error: Exception
    """What was raised (a `kvmesh.core.errors.MessageDecodeError` for a message of an unknown schema)."""


class StreamApplier:
    """Decode-and-apply of stream messages, with the counters every reader reports.

    One instance per reader; the state is passed per call because a replica replaces its state when it
    recovers from a snapshot.
    """

    __slots__ = ("apply_errors", "decode_errors", "messages")

    def __init__(self) -> None:
        self.messages = 0
        """Stream messages handed to `apply`."""
        self.decode_errors = 0
        """Messages that did not decode (skipped)."""
        self.apply_errors = 0
        """Messages that decoded but failed to apply (skipped)."""

    def apply(self, state: IndexState, seq: int, data: bytes) -> Skipped | None:
        """Decode one stream message and apply it to ``state`` at stream sequence ``seq``.

        Args:
            state: the index state to change.
            seq: the message's JetStream stream sequence (≥ 1; one at or below ``state.applied_seq`` is
                ignored by `IndexState.apply`).
            data: the message's bytes (a `kvmesh.core.events` encoding).

        Returns:
            None when applied; a `Skipped` naming why not. Either way ``state.applied_seq`` is at least ``seq``
            afterwards. Any exception the bytes provoke is caught (a hostile payload never stops a reader).
        """
        self.messages += 1
        try:
            message = decode_message(data)
        except Exception as exc:  # MessageDecodeError, or anything a hostile payload provokes
            self.decode_errors += 1
            state.skip(seq)
            return Skipped(seq, "undecodable", exc)
        try:
            state.apply(seq, message)
        except Exception as exc:
            self.apply_errors += 1
            state.skip(seq)
            return Skipped(seq, "failed", exc)
        return None
