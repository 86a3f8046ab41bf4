"""Scatter-gather over NATS core: one request on a subject, every reply that arrives within a window."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client

from kvmesh.core.errors import ProtocolError, TransportError
from kvmesh.core.protocol import decode

__all__ = ["Gathered", "gather", "gather_replies", "gather_status"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=msgspec.Struct)


async def gather_replies(nc: Client, subject: str, body: bytes, wait_s: float) -> list[bytes] | None:
    """Publish ``body`` on ``subject`` with a private reply inbox; return every non-empty reply body that
    arrives within ``wait_s`` seconds, in arrival order.

    Returns:
        The reply bodies, or None when the server answered "no responders" first (nothing is subscribed to
        ``subject``; the answer comes at once, so the window is not waited out).

    Raises:
        TransportError: the request could not be published (the connection is closed).
    """
    inbox = nc.new_inbox()
    replies: list[bytes] = []
    try:
        sub = await nc.subscribe(inbox)
        await nc.publish(subject, body, reply=inbox)
    except nats.errors.Error as exc:
        raise TransportError(f"request on {subject}: {type(exc).__name__}: {exc}") from exc
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    try:
        while (remaining := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=remaining)
            except (nats.errors.Error, TimeoutError):  # the window is over, or the connection closed
                break
            if not msg.data:  # the server's "no responders" status message
                if not replies:
                    return None
                continue
            replies.append(bytes(msg.data))
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error as exc:  # the connection closed under us: the subscription went with it
            log.debug("unsubscribe %s: %r", inbox, exc)
    return replies


@dataclass(frozen=True, slots=True)
class Gathered(Generic[M]):
    """Replies of one kind, decoded, and the ones that did not decode."""

    replies: list[M]
    undecodable: list[str]
    """``"<subject>: <error>"`` per reply that did not decode."""


async def gather(
    nc: Client,
    subject: str,
    kind: type[M],
    wait_s: float,
    *,
    body: bytes = b"",
    format: Literal["json", "msgpack"] = "json",
) -> Gathered[M]:
    """Like `gather_replies`, each reply decoded as ``kind`` (a `kvmesh.core.protocol` Struct).

    A reply that does not decode is logged and listed in ``undecodable`` with its `ProtocolError`; the others
    are kept. No responders gives an empty result.

    Raises:
        TransportError: the request could not be published.
    """
    out: list[M] = []
    bad: list[str] = []
    for data in await gather_replies(nc, subject, body, wait_s) or []:
        try:
            out.append(decode(data, kind, format=format))
        except ProtocolError as exc:
            log.warning("reply on %s does not decode as %s: %s", subject, kind.__name__, exc)
            bad.append(f"{subject}: {exc}")
    return Gathered(out, bad)


async def gather_status(nc: Client, subject: str, wait_s: float) -> list[dict[str, Any]]:
    """Publish an empty request on ``subject`` and return every JSON object reply within ``wait_s`` seconds,
    undecoded (the test and benchmark harnesses read raw status replies; operators want `kvmesh.ops.status`).
    Replies that are not JSON objects are skipped."""
    out: list[dict[str, Any]] = []
    for data in await gather_replies(nc, subject, b"", wait_s) or []:
        try:
            value = json.loads(data)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out
