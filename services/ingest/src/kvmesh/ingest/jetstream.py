"""The ingest's two JetStream calls outside nats-py's public API use: withdrawing buffered publishes, deleting
one stored message for an in-order re-send."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext


def withdraw_buffered_publishes(nc: Client | None, js: JetStreamContext | None) -> int:
    """Take this JetStream context's publishes out of the client's reconnect buffer; return how many.

    nats-py re-sends what it buffered as soon as it reconnects, before the ingest learns of it; those would
    land ahead of the in-flight messages the dead connection lost, out of order. nats-py has no way to
    withdraw buffered publishes, so this edits its private pending buffer: the ``PUB``/``HPUB`` commands
    whose reply subject starts with the context's async-reply prefix.
    """
    prefix = getattr(js, "_async_reply_prefix", None)
    if nc is None or not prefix:
        return 0
    marker = b" " + bytes(prefix)
    pending: list[bytes] = nc._pending  # private: see the docstring
    keep = [c for c in pending if not (c.startswith((b"HPUB ", b"PUB ")) and marker in c[: c.find(b"\r\n")])]
    if len(keep) != len(pending):
        nc._pending = keep
        nc._pending_data_size = sum(len(c) for c in keep)
    return len(pending) - len(keep)


async def delete_stored(js: JetStreamContext, nc: Client, stream: str, stream_seq: int) -> None:
    """Delete one message from ``stream``, riding out a leader election (about 8 s at most); a message that
    is already gone (a delete whose answer was lost, aged out, purged) counts as deleted.

    Raises:
        TimeoutError, nats.errors.Error: it could not be deleted.
    """
    pause = 0.25
    for attempt in range(5):
        try:
            await js.delete_msg(stream, stream_seq)
            return
        except nats.js.errors.NotFoundError:
            return
        except (TimeoutError, nats.errors.Error):
            if attempt == 4 or nc.is_closed:
                raise
        await asyncio.sleep(pause)
        pause *= 2
