"""Deleting one stored message for an in-order re-send (withdrawing buffered publishes, which needs nats-py's
internals, is `kvmesh.runtime.nats.withdraw_buffered_publishes`)."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext


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
