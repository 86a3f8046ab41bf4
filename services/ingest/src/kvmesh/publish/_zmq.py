"""`ZmqPublisher`: serve an engine's KV events as vLLM does, so an unchanged ingest attaches to it.

Per data-parallel rank r, on the endpoints' port + r (vLLM's rule):

* a PUB socket (an XPUB, which a SUB peer cannot tell apart) sending ``[topic, seq, payload]``: ``seq`` the
  8-byte big-endian batch number from 0, ``payload`` one msgpack ``KVEventBatch`` in vLLM ≥ 0.24's map layout
  (`kvmesh.core.wire.encode_batch`, the encoder the simulator uses);
* a replay ROUTER answering a DEALER's ``[b"", start_seq]`` with every buffered batch from ``start_seq`` as
  ``[b"", topic, seq, payload]``, then the end marker ``[b"", b"", ff×8, b""]`` (vLLM ≥ 0.26's framing).

A restarted process numbers from 0 again: the ingest sees the sequence go back and starts a new epoch.

Threading: the event methods send on the caller's thread under a lock (PUB never blocks: it drops at its
high-water mark, and the ingest then fills the gap from the replay socket); a daemon thread owns the replay
sockets.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final

import zmq

from kvmesh.core import wire
from kvmesh.core.endpoints import offset_endpoint
from kvmesh.publish._events import EventPublisherBase, PublishError, check_block_size, check_rank

DEFAULT_BUFFER_BATCHES: Final[int] = 10_000
"""Batches per rank kept for replay (vLLM's ``buffer_steps`` default)."""
DEFAULT_HWM: Final[int] = 100_000
"""PUB send high-water mark in messages (vLLM's ``hwm`` default)."""
WIRE_VERSION: Final[str] = "0.33.0"
"""The vLLM release whose payload layout is written (map events, ``[ts, events, dp_rank]``)."""
_END: Final[bytes] = wire.encode_seq(wire.SEQ_END)
_SUBSCRIBE: Final[int] = 1


@dataclass(slots=True)
class _Rank:
    pub: zmq.Socket[bytes]
    endpoint: str
    replay_endpoint: str | None
    router: zmq.Socket[bytes] | None
    buffer: deque[tuple[int, bytes]]
    next_seq: int = 0
    subscriptions: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class ZmqPublisher(EventPublisherBase):
    """Publish one engine's KV events on vLLM-format ZMQ sockets (see the module docstring).

    Args:
        endpoint: rank 0's PUB endpoint to bind, e.g. ``"tcp://*:5557"`` (``tcp://127.0.0.1:*`` picks a free
            port: read `endpoints`); rank r binds port + r.
        replay_endpoint: rank 0's replay endpoint to bind (None: no replay socket; the ingest then clears a
            rank on a gap instead of filling it).
        block_size: tokens per block of every stored event.
        data_parallel_size: ranks, each on its own pair of ports and with its own sequence.
        topic: topic frame of every message (the ingest's ``--topic``).
        buffer_batches: batches per rank kept for replay (> 0).
        hwm: PUB send high-water mark, in messages.

    Raises:
        PublishError: a bad block size or rank count.
        ValueError: an endpoint that has no per-rank form.
        zmq.ZMQError: an endpoint cannot be bound (a port in use).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        block_size: int,
        data_parallel_size: int = 1,
        topic: str = "",
        buffer_batches: int = DEFAULT_BUFFER_BATCHES,
        hwm: int = DEFAULT_HWM,
    ) -> None:
        self.block_size = check_block_size(block_size)
        if type(data_parallel_size) is not int or data_parallel_size < 1:
            raise PublishError(
                f"data_parallel_size {data_parallel_size!r} is not a positive int",
                argument="data_parallel_size",
            )
        if buffer_batches < 1:
            raise ValueError(f"buffer_batches must be > 0, got {buffer_batches}")
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._ranks: list[_Rank] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self._ctl: zmq.Socket[bytes] | None = None
        try:
            for r in range(data_parallel_size):
                self._ranks.append(self._bind(r, endpoint, replay_endpoint, buffer_batches, hwm))
        except BaseException:
            self.close()
            raise
        if replay_endpoint is not None:
            self._start_replay()

    def _bind(self, r: int, endpoint: str, replay: str | None, buffer_batches: int, hwm: int) -> _Rank:
        pub: zmq.Socket[bytes] = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, hwm)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        pub.bind(offset_endpoint(endpoint, r))
        router: zmq.Socket[bytes] | None = None
        if replay is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 2 * (buffer_batches + 1))
            router.bind(offset_endpoint(replay, r))
        return _Rank(
            pub,
            pub.getsockopt_string(zmq.LAST_ENDPOINT),
            None if router is None else router.getsockopt_string(zmq.LAST_ENDPOINT),
            router,
            deque(maxlen=buffer_batches),
        )

    # ------------------------------------------------------------------ properties

    @property
    def endpoints(self) -> list[tuple[str, str | None]]:
        """(PUB endpoint, replay endpoint or None) of each rank as bound (actual ports)."""
        return [(r.endpoint, r.replay_endpoint) for r in self._ranks]

    def next_seq(self, dp_rank: int = 0) -> int:
        """The sequence the rank's next batch gets."""
        return self._ranks[dp_rank].next_seq

    # ------------------------------------------------------------------ events

    def _check(self, dp_rank: int) -> None:
        check_rank(dp_rank, len(self._ranks))

    def _deliver(self, dp_rank: int, event: wire.KVEvent) -> int:
        if self._closed:
            raise RuntimeError("the publisher is closed")
        payload = wire.encode_batch(
            wire.EngineBatch(ts=time.time(), events=(event,), dp_rank=dp_rank), version=WIRE_VERSION
        )
        rank = self._ranks[dp_rank]
        with rank.lock:
            seq = rank.next_seq
            rank.next_seq += 1
            rank.buffer.append((seq, payload))
            rank.pub.send_multipart((self._topic, wire.encode_seq(seq), payload), copy=False)
            self._drain(rank)
        return seq

    # ------------------------------------------------------------------ subscribers

    def subscribers(self, dp_rank: int = 0) -> int:
        """Subscriptions that reached the rank's PUB socket so far (batches sent after one reach it)."""
        rank = self._ranks[dp_rank]
        with rank.lock:
            self._drain(rank)
            return rank.subscriptions

    def wait_for_subscribers(self, count: int = 1, *, timeout_s: float = 10.0) -> None:
        """Block until every rank has ``count`` subscriptions (an engine may skip this: replay fills what a
        slow joiner missed).

        Raises:
            TimeoutError: a rank had fewer after ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        for r in range(len(self._ranks)):
            while self.subscribers(r) < count:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"rank {r}: {self.subscribers(r)} of {count} subscriptions after {timeout_s} s"
                    )
                time.sleep(0.005)

    def _drain(self, rank: _Rank) -> None:
        while True:
            try:
                msg = rank.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == bytes((_SUBSCRIBE,)):
                rank.subscriptions += 1

    # ------------------------------------------------------------------ replay

    def _start_replay(self) -> None:
        address = f"inproc://kvmesh-publish-{uuid.uuid4().hex}"
        ctl_rx: zmq.Socket[bytes] = self._ctx.socket(zmq.PAIR)
        ctl_rx.setsockopt(zmq.LINGER, 0)
        ctl_rx.bind(address)
        self._ctl = self._ctx.socket(zmq.PAIR)
        self._ctl.setsockopt(zmq.LINGER, 0)
        self._ctl.connect(address)
        self._thread = threading.Thread(
            target=self._replay_loop, args=(ctl_rx,), name="kvmesh-publish-replay", daemon=True
        )
        self._thread.start()

    def _replay_loop(self, ctl_rx: zmq.Socket[bytes]) -> None:
        """Answer replay requests until told to stop (owns the ROUTER sockets and ``ctl_rx``)."""
        poller = zmq.Poller()
        poller.register(ctl_rx, zmq.POLLIN)
        routers = {r.router: r for r in self._ranks if r.router is not None}
        for sock in routers:
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if ctl_rx in ready:
                    return
                for sock, rank in routers.items():
                    if sock in ready:
                        self._serve_replay(rank, sock, sock.recv_multipart())
        except zmq.ContextTerminated:
            return
        finally:
            for sock in routers:
                sock.close(linger=0)
            ctl_rx.close(linger=0)

    def _serve_replay(self, rank: _Rank, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        """vLLM's ``_service_replay``: ``[identity, b"", start_seq]``; any other request gets nothing."""
        if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        with rank.lock:
            batches = [(seq, payload) for seq, payload in rank.buffer if seq >= start]
        for seq, payload in batches:
            sock.send_multipart((identity, b"", self._topic, wire.encode_seq(seq), payload), copy=False)
        sock.send_multipart((identity, b"", b"", _END, b""))

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Stop the replay thread and close every socket; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._ctl is not None:
            self._ctl.send(b"stop")
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._ctl is not None:
            self._ctl.close(linger=0)
        for r in self._ranks:
            with r.lock:
                r.pub.close(linger=0)
            if r.router is not None and self._thread is None:
                r.router.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> ZmqPublisher:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
