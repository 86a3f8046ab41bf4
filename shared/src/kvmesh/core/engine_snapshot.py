"""vLLM's KV-event snapshot protocol (open pull request vllm-project/vllm#57789): frames and replies.

Pure codec, no sockets. The protocol, as the pull request's current text has it (September 2026; it may still
change, so every reading below is kept tolerant):

* **Live sequence frame.** With a snapshot endpoint configured, the publisher appends a 16-byte *publisher
  epoch* (``uuid.uuid4().bytes``, drawn once per publisher lifetime) to the 8-byte big-endian sequence: the
  frame is 24 bytes. A new epoch means a new publisher (an engine restart), whatever the sequence does.
  Without a snapshot endpoint the frame stays 8 bytes (every release so far).
* **Heartbeats.** An idle publisher (nothing sent for 1 s) sends an empty ``KVEventBatch`` (``events`` ``[]``,
  its ``data_parallel_rank``) under the next sequence number, so a subscriber sees a lost tail as a gap and
  knows the engine is alive. A heartbeat is an ordinary batch on the wire; kvmesh tells it by its empty event
  list (vLLM publishes no empty batch otherwise).
* **Snapshot socket.** A ROUTER (``snapshot_endpoint``, port + rank like the others) answers any request of a
  REQ (or DEALER with an empty delimiter) with ``[cut, epoch, chunk, …]``: ``cut`` is an 8-byte big-endian
  *signed* sequence (the last live batch folded into the state; ``-1``: nothing yet, an empty state; ``≤ -2``:
  unavailable, no chunks), ``epoch`` the publisher epoch of the live frames, and each chunk a msgpack
  ``KVEventBatch`` (``[ts, events, data_parallel_rank]``, at most 256 events each). The request's content is
  not read by the publisher; kvmesh sends ``b"snapshot"`` as the pull request's tests do.
* **Chunk content.** The chunks are a *replay program* for an empty consumer index: the BlockStored events
  that are still needed (live blocks and the parents they were chained on), each intact and in its original
  order, then BlockRemoved events that take away what is resident too often (an evicted parent, one copy of a
  duplicate). Applied in order to an emptied holder they leave exactly the engine's state at ``cut``; live
  batches after ``cut`` then continue it.

Readings chosen where the text is open:

* The epoch frame of a reply is compared with the live frames' epoch byte for byte; a reply whose epoch
  differs is from another publisher (a restart in between) and is not used. An epoch of any length is accepted
  (only 16 bytes are sent).
* A cut below the live batches the subscriber holds (the publisher records a batch before sending it, so this
  should not happen) does not reach the live stream: the snapshot is not used.
* Chunks are decoded with kvmesh's tolerant batch decoder (`kvmesh.core.wire.decode_batch`): unknown fields
  and unknown event types are skipped as on the live socket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from kvmesh.core.errors import WireError
from kvmesh.core.wire import decode_seq

__all__ = [
    "EMPTY_CUT",
    "EPOCH_BYTES",
    "SNAPSHOT_REQUEST",
    "SnapshotReply",
    "decode_seq_frame",
    "decode_snapshot_reply",
    "encode_snapshot_reply",
]

EPOCH_BYTES: Final[int] = 16
"""Length of the publisher epoch after the sequence in a live frame (a UUID)."""
SNAPSHOT_REQUEST: Final[bytes] = b"snapshot"
"""The request kvmesh sends to a snapshot socket (its content is not read by the publisher)."""
EMPTY_CUT: Final[int] = -1
"""The cut of a snapshot taken before the publisher's first batch: an empty state."""
_SEQ_BYTES: Final[int] = 8


def decode_seq_frame(frame: bytes) -> tuple[int, bytes | None]:
    """Read a live sequence frame: the sequence and, in a 24-byte frame, the publisher epoch.

    Returns:
        ``(seq, epoch)``; ``epoch`` is None for an 8-byte frame (every release without snapshots).

    Raises:
        WireError: the frame is neither 8 nor 24 bytes long.
    """
    seq = decode_seq(frame)
    return seq, (bytes(frame[_SEQ_BYTES:]) if len(frame) > _SEQ_BYTES else None)


@dataclass(frozen=True, slots=True)
class SnapshotReply:
    """One decoded snapshot reply.

    Attributes:
        cut: the last engine sequence the state reflects; `EMPTY_CUT` (-1) for an empty state; ≤ -2 when
            the publisher cannot give a snapshot (its recorder overflowed or failed).
        epoch: the publisher epoch the reply names (compare it with the live frames').
        chunks: the msgpack ``KVEventBatch`` payloads, in order (empty when unavailable).
    """

    cut: int
    epoch: bytes
    chunks: tuple[bytes, ...]

    @property
    def available(self) -> bool:
        """Whether the reply carries a state (``cut ≥ -1``)."""
        return self.cut >= EMPTY_CUT


def decode_snapshot_reply(frames: Sequence[bytes]) -> SnapshotReply:
    """Read a snapshot reply ``[cut, epoch, chunk, …]`` (REQ side: the delimiter already stripped).

    Raises:
        WireError: fewer than two frames, or a cut frame that is not 8 bytes.
    """
    if len(frames) < 2:
        raise WireError(f"snapshot reply of {len(frames)} frame(s) (expected [cut, epoch, chunks…])")
    head = frames[0]
    if len(head) != _SEQ_BYTES:
        raise WireError(f"snapshot cut frame of {len(head)} bytes (expected {_SEQ_BYTES})")
    cut = int.from_bytes(head, "big", signed=True)
    chunks = tuple(bytes(f) for f in frames[2:]) if cut >= EMPTY_CUT else ()
    return SnapshotReply(cut=cut, epoch=bytes(frames[1]), chunks=chunks)


def encode_snapshot_reply(cut: int, epoch: bytes, chunks: Sequence[bytes] = ()) -> list[bytes]:
    """Write a snapshot reply's frames (for publishers and their stand-ins).

    Raises:
        OverflowError: ``cut`` does not fit a signed 64-bit integer.
    """
    return [cut.to_bytes(_SEQ_BYTES, "big", signed=True), epoch, *chunks]
