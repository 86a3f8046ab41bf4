"""The ZeroMQ side of a simulated engine: vLLM's ``ZmqEventPublisher`` (PUB + replay ROUTER), with faults.

`EventPublisher` puts KV-event batches on the wire exactly as a vLLM (or SGLang) publisher does (see
``docs/wire-protocol.md`` §2):

* live: ``[topic, seq (8-byte big-endian), payload]`` on a PUB socket, ``seq`` from 0 per publisher, +1 per
  batch, ``payload`` = msgpack ``KVEventBatch`` from `kvmesh.core.wire.encode_batch`;
* replay: a ROUTER socket answers a DEALER request ``[b"", start_seq]`` with every buffered batch of seq >=
  ``start_seq`` and then an END marker (seq ``ff×8``, empty payload); the reply framing depends on the
  release: vLLM < 0.26 / SGLang < 0.5.22 ``[b"", seq, payload]`` + END ``[b"", ff×8, b""]``, newer
  ``[b"", topic, seq, payload]`` + END ``[b"", b"", ff×8, b""]``; a request that is not exactly
  ``[identity, delimiter, start]`` gets nothing.

Threading: `publish` sends on the caller's thread (it never blocks: PUB drops at its high-water mark) and
must be called from one thread only, like the engine's scheduler; a daemon thread services the replay
socket, so an asyncio loop that calls `publish` is never blocked by a replay. The buffer is shared under a
lock.

Differences from vLLM, on purpose: the endpoints are always bound (vLLM *connects* a tcp endpoint without
``*``/``::``), the live socket is an XPUB so tests can `wait_for_subscribers` instead of sleeping (a SUB
peer sees no difference), batches are sent synchronously rather than through a queue, and fault-injection
hooks exist: `drop_next`, `restart`, `replay_enabled`, `replay_truncate`, `publish_raw`.

vLLM's coming snapshot protocol (open pull request #57789, `kvmesh.core.engine_snapshot`): with
``publisher_epoch=True`` (implied by ``snapshot_endpoint``) every live sequence frame is 24 bytes, the seq
followed by a 16-byte publisher epoch drawn anew by `restart`; `heartbeat` sends the empty batch an idle
publisher sends every second; a snapshot ROUTER (``snapshot_endpoint``) answers any request with ``[cut,
epoch, chunk…]`` from a `kvmesh.sim.snapshot.SnapshotRecorder` that folds every batch taken (dropped ones
too, as vLLM records before it sends), chunks of ``snapshot_chunk_events`` events. Faults:
`snapshot_available` (False: cut -2, no chunks), `snapshot_enabled` (False: requests get no reply).

Recording (``record_path``): every batch the publisher takes (sent live or dropped by `drop_next`) is appended
to a file as ``seq`` (8 bytes big-endian), payload length (4 bytes big-endian) and the payload, one unbuffered
write per batch, so the file survives a kill -9 of the process and holds exactly what the engine published;
`read_record` reads it back. This is the engine's truth the fault tests compare the index with.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from typing import BinaryIO, Final, Literal

import zmq

from kvmesh.core.engine_snapshot import encode_snapshot_reply
from kvmesh.core.wire import SEQ_END, EngineBatch, KVEvent, encode_batch, encode_seq
from kvmesh.sim.blockpool import HashForm
from kvmesh.sim.snapshot import Key, SnapshotRecorder

__all__ = ["EventPublisher", "read_record", "replay_includes_topic"]

DEFAULT_BUFFER_STEPS: Final[int] = 10_000
"""Batches kept for replay (vLLM's ``buffer_steps`` default)."""
DEFAULT_HWM: Final[int] = 100_000
"""PUB high-water mark (vLLM's ``hwm`` default)."""
END_SEQ_BYTES: Final[bytes] = encode_seq(SEQ_END)
"""The seq frame of a replay's END marker: ``ff×8``."""

_REPLAY_TOPIC_SINCE: Final[dict[str, tuple[int, ...]]] = {"vllm": (0, 26), "sglang": (0, 5, 22)}
_SUBSCRIBE: Final[int] = 1
_THREAD_JOIN_TIMEOUT_S: Final[float] = 5.0
_RECORD_HEAD: Final[int] = 12
"""Bytes before each recorded payload: seq (8) and payload length (4), both big-endian."""


def read_record(path: str | os.PathLike[str]) -> list[tuple[int, bytes]]:
    """Read a publisher's record file (see the module docstring).

    Args:
        path: the file `EventPublisher` wrote with ``record_path``.

    Returns:
        ``(seq, payload)`` of every complete record, in publish order; a record cut short by a kill at the
        end of the file is left out.
    """
    with open(path, "rb") as f:
        data = f.read()
    out: list[tuple[int, bytes]] = []
    pos = 0
    while pos + _RECORD_HEAD <= len(data):
        seq = int.from_bytes(data[pos : pos + 8], "big")
        size = int.from_bytes(data[pos + 8 : pos + _RECORD_HEAD], "big")
        end = pos + _RECORD_HEAD + size
        if end > len(data):
            break
        out.append((seq, data[pos + _RECORD_HEAD : end]))
        pos = end
    return out


def _parse_version(version: str) -> tuple[int, ...]:
    """Return the leading numeric components of a release (``"v0.24.0rc1"`` → ``(0, 24, 0)``)."""
    parts: list[int] = []
    for piece in version.strip().removeprefix("v").split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() != len(piece):
            break
    if not parts:
        raise ValueError(f"cannot parse release version {version!r}")
    return tuple(parts)


def replay_includes_topic(producer: str, version: str) -> bool:
    """Return whether a release's replay replies carry the topic frame.

    Args:
        producer: ``"vllm"`` or ``"sglang"``.
        version: the release, e.g. ``"0.33.0"``.

    Returns:
        True for vLLM >= 0.26 and SGLang >= 0.5.22.

    Raises:
        ValueError: an unknown producer or an unparsable version.
    """
    try:
        since = _REPLAY_TOPIC_SINCE[producer.lower()]
    except KeyError:
        raise ValueError(f"unknown producer {producer!r}; expected 'vllm' or 'sglang'") from None
    return _parse_version(version) >= since


class EventPublisher:
    """Publish KV-event batches like one vLLM DP rank's ``ZmqEventPublisher``, with fault injection.

    Owns a live XPUB socket, an optional replay ROUTER socket with its service thread, the seq counter and
    the replay buffer (the last ``buffer_steps`` encoded batches). Does not own the events (see
    `kvmesh.sim.blockpool.BlockPool`) nor the DP-rank port offset: ``endpoint`` is bound as given (apply
    `kvmesh.core.endpoints.offset_endpoint` first for rank > 0).

    Args:
        endpoint: live endpoint to bind, e.g. ``"tcp://127.0.0.1:5557"`` (``…:*`` or ``…:0`` pick a free
            port; read it back from `endpoint`).
        replay_endpoint: replay endpoint to bind, or None for no replay socket (vLLM's default).
        topic: topic frame of every live message (and of replay replies in the newer framing).
        dp_rank: data-parallel rank written into every batch.
        producer: ``"vllm"`` or ``"sglang"``; with ``version`` selects payload layout and replay framing.
        version: the release to imitate, e.g. ``"0.33.0"`` or ``"0.25.0"``.
        hash_form: the `kvmesh.sim.blockpool.HashForm` of the events: ``"int"`` and ``"signed"`` are sent as
            msgpack ints as they are, ``"bytes"`` as ``bin`` (vLLM >= 0.10.2 only).
        buffer_steps: batches kept for replay (> 0).
        hwm: live socket send high-water mark, in messages.
        clock: returns the batch timestamp ``ts`` in seconds since the epoch.
        context: ZMQ context; default the process-global ``zmq.Context.instance()`` (as vLLM).
        record_path: append every batch to this file (see the module docstring), or None.
        publisher_epoch: send 24-byte sequence frames with a publisher epoch (vLLM PR #57789).
        snapshot_endpoint: snapshot endpoint to bind (implies ``publisher_epoch``), or None.
        snapshot_chunk_events: events per snapshot chunk (vLLM's recorder: 256).

    Raises:
        OSError: ``record_path`` cannot be opened for appending.
        ValueError: bad ``buffer_steps``; a producer, version or hash form `kvmesh.core.wire.encode_batch`
            does not know (or ``"bytes"`` for a release that cannot send bin hashes).
        zmq.ZMQError: an endpoint cannot be bound (e.g. the port is in use).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        dp_rank: int = 0,
        producer: str = "vllm",
        version: str = "0.33.0",
        hash_form: HashForm = "int",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = DEFAULT_HWM,
        clock: Callable[[], float] = time.time,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        record_path: str | os.PathLike[str] | None = None,
        publisher_epoch: bool = False,
        snapshot_endpoint: str | None = None,
        snapshot_chunk_events: int = 256,
    ) -> None:
        if buffer_steps <= 0:
            raise ValueError(f"buffer_steps must be > 0, got {buffer_steps}")
        # The pool's "signed" form is plain ints on the wire; "bytes" needs a release that sends bin.
        self._wire_hash_form = "bytes" if hash_form == "bytes" else "int"
        encode_batch(  # fail fast on an unknown producer, version or hash form
            EngineBatch(ts=0.0, events=(), dp_rank=dp_rank),
            producer=producer,
            version=version,
            hash_form=self._wire_hash_form,
        )
        self._replay_topic = replay_includes_topic(producer, version)
        self._topic = topic.encode("utf-8")
        self._dp_rank = dp_rank
        self._producer = producer
        self._version = version
        self._clock = clock
        self._ctx = context if context is not None else zmq.Context.instance()
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._drop_remaining = 0
        self._subscriptions = 0
        self._closed = False
        self.replay_enabled: bool = True
        """When False, replay requests are read and ignored: no batch, no END (the client times out)."""
        self.replay_truncate: int | None = None
        """When set, a replay sends at most this many batches before its END marker (0: only END)."""
        self.snapshot_available: bool = True
        """When False, a snapshot request is answered as unavailable: cut -2 and no chunks."""
        self.snapshot_enabled: bool = True
        """When False, snapshot requests are read and ignored (the client times out)."""
        self.snapshot_requests: int = 0
        """Snapshot requests answered so far."""
        self._epoch_frames = publisher_epoch or snapshot_endpoint is not None
        self._epoch = uuid.uuid4().bytes if self._epoch_frames else b""
        # The engine's state for snapshot replies, kept only when a snapshot socket is served (it decodes
        # every batch it records).
        self._recorder = SnapshotRecorder() if snapshot_endpoint is not None else None
        self._chunk_events = max(1, snapshot_chunk_events)

        self._record: BinaryIO | None = None
        self._pub: zmq.Socket[bytes] = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.RCVHWM, hwm)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        try:
            self._pub.bind(endpoint)
        except zmq.ZMQError:
            self._pub.close(linger=0)
            raise
        self._endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

        self._replay_endpoint: str | None = None
        self._snapshot_endpoint: str | None = None
        self._ctl: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._snap_ctl: zmq.Socket[bytes] | None = None
        self._snap_thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self._start_replay(replay_endpoint, buffer_steps)
        if snapshot_endpoint is not None:
            self._start_snapshot(snapshot_endpoint)
        if record_path is not None:
            self._record = open(record_path, "ab", buffering=0)  # noqa: SIM115 (closed by close())

    # ------------------------------------------------------------------ properties

    @property
    def endpoint(self) -> str:
        """The bound live endpoint, with the actual port when a wildcard port was asked for."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The bound replay endpoint, or None without a replay socket."""
        return self._replay_endpoint

    @property
    def snapshot_endpoint(self) -> str | None:
        """The bound snapshot endpoint, or None without a snapshot socket."""
        return self._snapshot_endpoint

    @property
    def publisher_epoch(self) -> bytes | None:
        """The 16-byte epoch of the live frames (None: 8-byte frames)."""
        return self._epoch if self._epoch_frames else None

    @property
    def topic(self) -> str:
        """The topic frame as text."""
        return self._topic.decode("utf-8")

    @property
    def dp_rank(self) -> int:
        """The data-parallel rank stamped into every batch."""
        return self._dp_rank

    @property
    def next_seq(self) -> int:
        """The seq the next published batch will get."""
        return self._next_seq

    @property
    def buffered_seqs(self) -> tuple[int, ...]:
        """Seqs currently held for replay, oldest first."""
        with self._lock:
            return tuple(seq for seq, _ in self._buffer)

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    # ------------------------------------------------------------------ publishing

    def publish(self, events: Iterable[KVEvent]) -> int:
        """Encode one engine step's events as a batch, buffer it for replay and send it live.

        Args:
            events: the step's events in order (vLLM only publishes non-empty steps; empty is allowed).

        Returns:
            The batch's seq.

        Raises:
            RuntimeError: the publisher is closed.
        """
        batch = EngineBatch(ts=self._clock(), events=tuple(events), dp_rank=self._dp_rank)
        payload = encode_batch(
            batch, producer=self._producer, version=self._version, hash_form=self._wire_hash_form
        )
        return self.publish_raw(payload)

    def publish_raw(self, payload: bytes) -> int:
        """Publish an already encoded (possibly malformed, for fault tests) payload as the next batch.

        Args:
            payload: the third frame, sent and buffered byte for byte.

        Returns:
            The batch's seq.

        Raises:
            RuntimeError: the publisher is closed.
        """
        if self._closed:
            raise RuntimeError("publisher is closed")
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
            if self._recorder is not None:
                self._recorder.fold(seq, payload)  # recorded before it is sent, as vLLM's recorder
            if self._record is not None:
                self._record.write(seq.to_bytes(8, "big") + len(payload).to_bytes(4, "big") + payload)
            drop = self._drop_remaining > 0
            if drop:
                self._drop_remaining -= 1
        if not drop:
            self._pub.send_multipart((self._topic, encode_seq(seq) + self._epoch, payload), copy=False)
        self._drain_subscriptions()
        return seq

    # ------------------------------------------------------------------ fault injection

    def drop_next(self, n: int = 1) -> None:
        """Make the next ``n`` batches consume their seq and enter the replay buffer without going live.

        This is what a PUB high-water-mark drop looks like to a subscriber: a seq gap that replay fills.

        Args:
            n: batches to drop (>= 0); adds to any drops still pending.

        Raises:
            ValueError: ``n`` is negative.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._lock:
            self._drop_remaining += n

    def heartbeat(self) -> int:
        """Send the empty batch an idle vLLM publisher with snapshots sends every second; return its seq."""
        return self.publish(())

    def restart(self, *, keep_seq: bool = False) -> None:
        """Simulate an engine restart: seq starts again at 0 and the replay buffer is emptied.

        The sockets stay bound (a subscriber sees only the seq going backwards, as after a real restart);
        pending drops are cancelled. With epoch frames a new publisher epoch is drawn and the snapshot state
        starts empty; ``keep_seq`` keeps the seq counting on (a restart only the epoch shows).
        """
        with self._lock:
            if not keep_seq:
                self._next_seq = 0
            self._buffer.clear()
            self._drop_remaining = 0
            if self._recorder is not None:
                self._recorder.reset()
            if self._epoch_frames:
                self._epoch = uuid.uuid4().bytes

    # ------------------------------------------------------------------ subscribers

    @property
    def subscriptions(self) -> int:
        """Subscribe requests seen on the live socket so far (one per SUB ``subscribe`` call)."""
        self._drain_subscriptions()
        return self._subscriptions

    async def wait_for_subscribers(
        self, count: int = 1, *, timeout_s: float = 5.0, poll_s: float = 0.005
    ) -> None:
        """Wait until ``count`` subscriptions reached the live socket (no slow-joiner loss after that).

        Call it from the thread that publishes. The subscription of a SUB is counted once it has reached
        the publisher, so batches published afterwards are delivered to it.

        Args:
            count: total subscribe requests to wait for.
            timeout_s: give up after this many seconds.
            poll_s: polling interval in seconds.

        Raises:
            TimeoutError: fewer than ``count`` subscriptions arrived within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while self.subscriptions < count:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self._subscriptions} of {count} subscriptions after {timeout_s} s")
            await asyncio.sleep(poll_s)

    def _drain_subscriptions(self) -> None:
        """Read pending (un)subscribe messages from the XPUB socket without blocking."""
        if self._closed:
            return
        while True:
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == bytes((_SUBSCRIBE,)):
                self._subscriptions += 1

    # ------------------------------------------------------------------ replay

    def _start_replay(self, replay_endpoint: str, buffer_steps: int) -> None:
        router: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
        try:
            router.bind(replay_endpoint)
        except zmq.ZMQError:
            router.close(linger=0)
            self._pub.close(linger=0)
            raise
        self._replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ctl, self._thread = self._serve(router, self._service_replay, "replay")

    def _serve(
        self, router: zmq.Socket[bytes], answer: Callable[[zmq.Socket[bytes], list[bytes]], None], name: str
    ) -> tuple[zmq.Socket[bytes], threading.Thread]:
        """Answer ``router``'s requests with ``answer`` on a thread until told to stop through the returned
        control socket; the thread owns ``router`` (and closes it)."""
        ctl_address = f"inproc://kvmesh-sim-{name}-{uuid.uuid4().hex}"
        ctl_rx: zmq.Socket[bytes] = self._ctx.socket(zmq.PAIR)
        ctl_rx.setsockopt(zmq.LINGER, 0)
        ctl_rx.bind(ctl_address)
        ctl: zmq.Socket[bytes] = self._ctx.socket(zmq.PAIR)
        ctl.setsockopt(zmq.LINGER, 0)
        ctl.connect(ctl_address)
        thread = threading.Thread(
            target=_answer_loop, args=(router, ctl_rx, answer), name=f"kvmesh-sim-{name}", daemon=True
        )
        thread.start()
        return ctl, thread

    def _service_replay(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """Answer one replay request (vLLM's ``_service_replay``); invalid requests get nothing."""
        if len(frames) != 3 or not self.replay_enabled:
            return
        identity, _delimiter, start_frame = frames
        start_seq = int.from_bytes(start_frame, "big")
        with self._lock:
            items = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
        limit = self.replay_truncate
        if limit is not None:
            items = items[: max(limit, 0)]
        head: tuple[bytes, ...] = (identity, b"", self._topic) if self._replay_topic else (identity, b"")
        for seq, payload in items:
            router.send_multipart((*head, encode_seq(seq), payload), copy=False)
        if self._replay_topic:
            router.send_multipart((identity, b"", b"", END_SEQ_BYTES, b""))
        else:
            router.send_multipart((identity, b"", END_SEQ_BYTES, b""))

    # ------------------------------------------------------------------ snapshot

    def _start_snapshot(self, endpoint: str) -> None:
        router: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        try:
            router.bind(endpoint)
        except zmq.ZMQError:
            router.close(linger=0)
            self.close()
            raise
        self._snapshot_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._snap_ctl, self._snap_thread = self._serve(router, self._answer_snapshot, "snapshot")

    def _answer_snapshot(self, router: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """Answer one snapshot request (REQ or DEALER envelope) with `snapshot_reply`, when enabled."""
        if self.snapshot_enabled:
            envelope = frames[: frames.index(b"") + 1] if b"" in frames else frames[:1]
            router.send_multipart([*envelope, *self.snapshot_reply()])

    def snapshot_reply(self) -> list[bytes]:
        """The frames a snapshot request gets now: ``[cut, epoch, chunk…]`` (cut -2 and no chunk when
        unavailable)."""
        with self._lock:
            self.snapshot_requests += 1
            assert self._recorder is not None  # served only with a snapshot socket
            cut = self._recorder.reply_cut() if self.snapshot_available else -2
            if cut < -1:
                return encode_snapshot_reply(cut, self._epoch)
            events = self._recorder.program()
            chunks = [
                encode_batch(
                    EngineBatch(
                        ts=self._clock(),
                        events=tuple(events[i : i + self._chunk_events]),
                        dp_rank=self._dp_rank,
                    ),
                    producer=self._producer,
                    version=self._version,
                    hash_form=self._wire_hash_form,
                )
                for i in range(0, len(events), self._chunk_events)
            ]
            return encode_snapshot_reply(cut, self._epoch, chunks)

    def live_blocks(self) -> dict[Key, int]:
        """Resident copies per (medium, group, hash) as the snapshot state has them (the engine's truth).

        Raises:
            RuntimeError: the publisher serves no snapshot socket (it keeps no such state).
        """
        with self._lock:
            if self._recorder is None:
                raise RuntimeError("live_blocks needs a snapshot_endpoint (the state is kept only then)")
            return dict(self._recorder.live)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop the replay thread and close the sockets (linger 0); idempotent.

        Returns once the replay thread has exited (it wakes up at once, so this does not stall a loop).
        """
        if self._closed:
            return
        self._closed = True
        for ctl, thread in ((self._ctl, self._thread), (self._snap_ctl, self._snap_thread)):
            if ctl is not None:
                ctl.send(b"stop")
                if thread is not None:
                    thread.join(_THREAD_JOIN_TIMEOUT_S)
                ctl.close(linger=0)
        self._pub.close(linger=0)
        if self._record is not None:
            self._record.close()

    def __enter__(self) -> EventPublisher:
        """Return the publisher (already bound)."""
        return self

    def __exit__(self, *exc_info: object) -> Literal[False]:
        """Close the publisher; exceptions propagate."""
        self.close()
        return False


def _answer_loop(
    router: zmq.Socket[bytes],
    ctl_rx: zmq.Socket[bytes],
    answer: Callable[[zmq.Socket[bytes], list[bytes]], None],
) -> None:
    """Answer requests on ``router`` until ``ctl_rx`` says stop; closes both."""
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(ctl_rx, zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll())
            if ctl_rx in ready:
                return
            if router in ready:
                answer(router, router.recv_multipart())
    except zmq.ContextTerminated:
        return
    finally:
        router.close(linger=0)
        ctl_rx.close(linger=0)
