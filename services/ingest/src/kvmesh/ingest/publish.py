"""The ingest's publish loop: the outbox to JetStream, in order, acked, with a bounded window.

The shell around `kvmesh.ingest.outbox`: `Outbox` and `AckWindow` decide what goes next, what was stored and
what must be sent again; this module makes the calls (publish, delete, wait) and logs what they decided.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from kvmesh.core.index import Holder
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.jetstream import delete_stored
from kvmesh.ingest.outbox import AckOutcome, AckWindow, MessageIds, Outbox, Outgoing
from kvmesh.ingest.status import IngestCounters
from kvmesh.runtime import tracing
from kvmesh.runtime.nats import withdraw_buffered_publishes

if TYPE_CHECKING:
    from opentelemetry.metrics import Histogram

log = logging.getLogger("kvmesh.ingest")

ACK_TIMEOUT_S = 5.0
"""Seconds to wait for a publish's ack on a live connection before re-sending from it on, in order."""
SETTLE_S = 2.0
"""Seconds a failed publish waits for the rest of the window's outcome before the unstored are re-sent."""


class Publisher:
    """Publishes the outbox in order; see `run`.

    Args:
        settings: window (``max_pending_acks``), outbox bound (``max_buffered_batches``), stream, worker.
        counters: published, retries, drops, reorders, re-sends.
        ids: message ids (a re-sent message gets a new one).
        make_clear: builds a holder's overflow clear (`Outbox.next`).
    """

    def __init__(
        self,
        settings: IngestSettings,
        counters: IngestCounters,
        ids: MessageIds,
        make_clear: Callable[[Holder, int, int], Outgoing],
    ) -> None:
        self.settings = settings
        self.counters = counters
        self.outbox = Outbox(settings.max_buffered_batches)
        self.window: AckWindow[asyncio.Future[Any]] = AckWindow()
        self._ids = ids
        self._make_clear = make_clear
        self._ready = asyncio.Event()
        self._connections = 0
        """Connections lost so far: in-flight messages of an earlier connection are re-sent."""
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.latency: Histogram | None = None
        """Send → ack seconds per dp_rank, recorded when metrics are on (None: nothing measured)."""

    @property
    def unacknowledged(self) -> int:
        """Messages in the outbox or the window (not yet acknowledged)."""
        return len(self.outbox) + len(self.window)

    @property
    def idle(self) -> bool:
        """True when nothing waits to be published or acknowledged."""
        return self.outbox.idle and not self.window

    def push(self, out: Outgoing) -> None:
        """Append to the outbox; when it is full, drop the oldest message and mark its holder for a resync."""
        for dropped, first in self.outbox.push(out):
            self.counters.dropped_batches += 1
            if first:
                log.error(
                    "worker %s: outbox full (%d batches, NATS unreachable?); dropping the oldest (%s) and "
                    "resynchronising dp rank %d",
                    self.settings.worker_id,
                    self.settings.max_buffered_batches,
                    dropped.msg_id,
                    dropped.holder[1],
                )
        self._ready.set()

    async def on_disconnect(self) -> None:
        """Take our unsent publishes out of the client's reconnect buffer (`withdraw_buffered_publishes`).

        The publish loop re-sends everything unacknowledged itself, in order (the server drops what did land
        by its Nats-Msg-Id).
        """
        self._connections += 1
        if self.nc is None or self.js is None:
            return
        withdrawn = withdraw_buffered_publishes(self.nc, self.js)
        if withdrawn:
            log.info(
                "worker %s: withdrew %d buffered publish(es) to re-send in order",
                self.settings.worker_id,
                withdrawn,
            )

    def _log_acks(self, got: AckOutcome) -> bool:
        """Count and log what `AckWindow.take_acks` found; True when the window must be re-sent."""
        self.counters.published += got.published
        for out, inv in got.inversions:
            # Every index replica holds the holder's later messages until the late one arrives and applies
            # them in engine order (`kvmesh.core.state`), so nothing is cleared here.
            self.counters.reorders += 1
            log.warning(
                "worker %s dp_rank %d: stream stored epoch %d engine seq %d at stream seq %d, after epoch %d "
                "engine seq %d at stream seq %d (a failed publish re-sent); index replicas apply them in "
                "engine order",
                out.holder[0],
                out.holder[1],
                *inv.earlier,
                *inv.later,
            )
        if got.failed is not None:
            out, exc = got.failed
            log.warning(
                "worker %s: publish of %s failed (%r); retrying in order",
                self.settings.worker_id,
                out.msg_id,
                exc,
            )
        elif got.overdue is not None:
            log.warning(
                "worker %s: publish of %s not acknowledged in %.0f s; retrying in order",
                self.settings.worker_id,
                got.overdue.msg_id,
                ACK_TIMEOUT_S,
            )
        return got.resend

    def _requeue(self) -> None:
        self.counters.publish_retries += self.window.requeue(self.outbox)

    async def _settle_window(self) -> None:
        """After a failed publish, wait (at most `SETTLE_S`) for the outcome of the rest of the window, so
        what was stored is known and only the rest is sent again."""
        pending = [fut for _, fut, _ in self.window.inflight if not fut.done()]
        if pending:
            await asyncio.wait(pending, timeout=SETTLE_S)

    async def _unstore_overtakers(self) -> None:
        """Keep each holder's stream order equal to engine order after a failed publish.

        A later message of the holder of a failed one that was stored meanwhile is deleted from the stream
        and sent again after it, under a new message id (`AckWindow.overtakers`). Index replicas that read it
        before the delete hold it and ignore the copy as a repeat. A delete that fails leaves it where it is;
        the replicas' hold still applies it in engine order.
        """
        loop = asyncio.get_running_loop()
        for i, out, stored in self.window.overtakers():
            if not await self._unstore(out, stored):
                continue
            log.warning(
                "worker %s dp_rank %d: engine seq %d was stored (stream seq %d) before an earlier one that "
                "failed; deleted, re-sending it after",
                out.holder[0],
                out.holder[1],
                out.seq,
                stored,
            )
            unsent: asyncio.Future[Any] = loop.create_future()
            unsent.cancel()  # the requeue sends it again
            self.window.unsent(i, unsent)

    async def _unstore(self, out: Outgoing, stored: int) -> bool:
        """Delete ``out`` (stored at stream seq ``stored``) so it can be sent again in order, under a new
        message id; False (logged) when the delete failed and it stays where it is."""
        assert self.js is not None and self.nc is not None
        try:
            await delete_stored(self.js, self.nc, self.settings.stream, stored)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning(
                "worker %s dp_rank %d: could not delete engine seq %d (stream seq %d) to re-send it in "
                "order (%r); index replicas will apply it in engine order",
                out.holder[0],
                out.holder[1],
                out.seq,
                stored,
                exc,
            )
            return False
        self.counters.reordered_resends += 1
        out.msg_id = self._ids.again(out.msg_id)
        return True

    async def _repair_overtaken(self) -> None:
        """Put messages whose ack showed them stored before an earlier one of their holder back in order:
        each is deleted and sent again with a new id, what is still in the window goes back behind them, and
        all of it is then sent one message at a time, so the repair converges."""
        repairs = self.window.take_repairs()
        await self._settle_window()
        await self._unstore_overtakers()
        waiting = len(self.window)
        self._requeue()
        for out, stored in reversed(repairs):
            if not await self._unstore(out, stored):
                self.counters.published += 1  # it stays where it is
                continue
            self.window.put_back(self.outbox, out)
        self.window.after_repair(len(repairs), waiting)

    async def _recover_window(self) -> None:
        """Keep engine order from the acks that did come, then send the rest of the window again."""
        await self._unstore_overtakers()
        self._requeue()

    async def run(self) -> None:
        """Publish the outbox in order with a bounded window of outstanding acks; retry in order on failure.

        Nothing is handed to the client while it is disconnected (it would buffer it and send it ahead of
        the messages the dead connection lost): on a disconnect, or an ack that fails or does not come
        within `ACK_TIMEOUT_S`, every unacknowledged message goes back to the front of the outbox and is
        re-sent, in order, once connected; ``Nats-Msg-Id`` makes the server drop those that had landed.
        Waiting for an ack never holds back a new batch while the window has room.
        """
        assert self.js is not None and self.nc is not None
        js, nc, window, outbox = self.js, self.nc, self.window, self.outbox
        loop = asyncio.get_running_loop()
        size = self.settings.max_pending_acks
        backoff = 0.1
        connection = self._connections
        me = asyncio.current_task()
        try:
            while True:
                if me is not None and me.cancelling():
                    # nats-py's publish_async can swallow a cancellation; without this check the loop would
                    # go on to wait for the next batch and never end (a stopping ingest left it behind).
                    raise asyncio.CancelledError
                if not nc.is_connected or connection != self._connections:
                    # A reconnect can be quicker than this loop: the connection count tells it happened.
                    while not nc.is_connected and not nc.is_closed:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                    if nc.is_closed:
                        return
                    await self._recover_window()
                    connection = self._connections
                    continue
                failed = self._log_acks(window.take_acks(loop.time(), ACK_TIMEOUT_S))
                if window.repairs and not failed and nc.is_connected:
                    await self._repair_overtaken()
                    continue
                while (
                    not failed
                    and len(window) < window.room(size)
                    and nc.is_connected
                    and connection == self._connections
                ):
                    out = outbox.next(self._make_clear)
                    if out is None:
                        break
                    if out.stored_seq is not None:  # stored by an earlier send: only its ack is taken
                        outbox.pop()
                        done: asyncio.Future[Any] = loop.create_future()
                        done.set_result(out.stored_seq)
                        window.sent(out, done, loop.time())
                        continue
                    headers = {"Nats-Msg-Id": out.msg_id}
                    span = tracing.start_publish(headers, out.subject, out.holder, out.epoch, out.seq)
                    try:
                        fut = await js.publish_async(out.subject, out.data, headers=headers, wait_stall=5.0)
                    except nats.errors.MaxPayloadError as exc:
                        tracing.fail_publish(span, exc)
                        # Permanent: retrying would block every later batch. Drop it and resynchronise.
                        outbox.drop_front()
                        self.counters.dropped_batches += 1
                        log.error(
                            "worker %s: message %s of %d bytes exceeds the server's max payload (%r); dropped, "
                            "resynchronising dp rank %d",
                            self.settings.worker_id,
                            out.msg_id,
                            len(out.data),
                            exc,
                            out.holder[1],
                        )
                        continue
                    except (TimeoutError, nats.errors.Error, OSError) as exc:
                        tracing.fail_publish(span, exc)
                        log.debug("publish of %s failed: %r", out.msg_id, exc)
                        failed = True
                        break
                    outbox.pop()
                    window.sent(out, fut, loop.time())
                    if span is not None:
                        fut.add_done_callback(tracing.on_ack(span))
                    if self.latency is not None:
                        fut.add_done_callback(self._timer(out.holder[1], loop.time()))
                if failed:
                    if nc.is_connected:
                        await self._settle_window()
                        await self._recover_window()
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, 2.0)
                    continue
                inflight = window.inflight
                if inflight and inflight[0][1].done():
                    backoff = 0.1
                    continue
                if not inflight and outbox.idle:
                    self._ready.clear()
                    await self._ready.wait()
                    continue
                # Wait for the oldest ack, or (window permitting) a new batch; wake up now and then to
                # notice a lost connection or an ack that is overdue.
                waits: list[asyncio.Future[Any]] = [inflight[0][1]] if inflight else []
                ready: asyncio.Task[Any] | None = None
                if len(inflight) < size and nc.is_connected:
                    self._ready.clear()
                    ready = asyncio.create_task(self._ready.wait())
                    waits.append(ready)
                await asyncio.wait(waits, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
                if ready is not None:
                    ready.cancel()
        finally:
            self._requeue()

    def _timer(self, dp_rank: int, sent: float) -> Callable[[asyncio.Future[Any]], None]:
        """A done callback recording the seconds from ``sent`` to a successful ack in `latency`."""
        hist, loop, labels = self.latency, asyncio.get_running_loop(), {"worker_id": self.settings.worker_id}
        attributes = {**labels, "dp_rank": str(dp_rank)}

        def acked(fut: asyncio.Future[Any]) -> None:
            if hist is not None and not fut.cancelled() and fut.exception() is None:
                hist.record(loop.time() - sent, attributes)

        return acked

    async def flush(self, timeout_s: float) -> None:
        """Publish what is buffered for at most ``timeout_s`` seconds (a stopping ingest)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        task = asyncio.create_task(self.run())
        # The outbox is a plain deque with no "emptied" event; poll it for at most `timeout_s`.
        while not self.idle and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
