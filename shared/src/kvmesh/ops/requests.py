"""`finish`: end routed requests at every router (the request lifecycle notes)."""

from __future__ import annotations

from collections.abc import Sequence

import nats.errors
from nats.aio.client import Client

from kvmesh.client import Router
from kvmesh.core.errors import TransportError
from kvmesh.runtime import subjects

__all__ = ["finish"]


async def finish(
    nc: Client,
    request_ids: Sequence[str],
    *,
    prefill_done: bool = False,
    cached_tokens: int | None = None,
    requests_prefix: str = subjects.REQUESTS_PREFIX,
    flush_s: int = 3,
) -> None:
    """Tell every router that requests routed with these ids are over: their KV blocks stop counting as load
    on the chosen worker at once (instead of after the routers' request TTL). With ``prefill_done`` only their
    prompt tokens stop counting (``<prefix>.prefill_done`` instead of ``<prefix>.finished``).
    ``cached_tokens``: the engine's count of cached prompt tokens of a finished request (one id only), which
    the router that answered it counts as delivered (route receipts).

    Returns once the notes are flushed to the server (within ``flush_s`` seconds); fire-and-forget beyond
    that: a router that is down learns nothing (its TTL ends the requests).

    Raises:
        ValueError: ``cached_tokens`` with several ids, with ``prefill_done``, or below 0.
        UnavailableError: a note could not be published (the connection is closed).
        TransportError: the server did not confirm the flush within ``flush_s``.
    """
    if cached_tokens is not None and (len(request_ids) != 1 or prefill_done or cached_tokens < 0):
        raise ValueError("cached_tokens goes with one finished request id and is >= 0")
    router = Router(nc, requests_prefix=requests_prefix)
    for rid in request_ids:
        if prefill_done:
            await router.mark_prefill_done(rid)
        else:
            await router.finish(rid, cached_tokens=cached_tokens)
    try:
        await nc.flush(timeout=flush_s)
    except (nats.errors.Error, TimeoutError) as exc:
        raise TransportError(
            f"flush of {len(request_ids)} request notes: {type(exc).__name__}: {exc}"
        ) from exc
