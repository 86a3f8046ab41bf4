"""ZeroMQ endpoint arithmetic shared by the simulated engine and the ingest (pure).

vLLM (and SGLang, which copied the design) runs one KV-event publisher per data-parallel rank. The
endpoints of rank ``r`` are derived from the configured base endpoints by `offset_endpoint`, which mirrors
vLLM's ``offset_endpoint_port`` (``vllm/distributed/kv_events.py``), applied to both the PUB endpoint
and the replay (ROUTER) endpoint.

This module does no I/O: it only rewrites strings.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_TCP_PORT", "offset_endpoint"]

MAX_TCP_PORT: Final[int] = 65535
"""Largest TCP port number; an offset that goes past it is an error."""


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Return the endpoint that data-parallel rank ``rank`` uses, given the configured base endpoint.

    The rule is vLLM's (``offset_endpoint_port``, 0.31+ behaviour for port 0):

    * rank 0 → ``endpoint`` unchanged;
    * ``"inproc"`` anywhere in the endpoint → ``f"{endpoint}_dp{rank}"``;
    * ``"tcp"`` anywhere in the endpoint → the number after the last ``:`` plus ``rank``
      (``tcp://127.0.0.1:51829``, rank 1 → ``tcp://127.0.0.1:51830``); port 0 (an OS-chosen port) is
      left alone, and an endpoint without a ``:`` is returned unchanged, as vLLM does;
    * anything else (``ipc://…``, …) → ValueError for rank > 0.

    Args:
        endpoint: base endpoint as configured (``--kv-events-config`` ``endpoint`` or ``replay_endpoint``).
        rank: data-parallel rank, >= 0.

    Returns:
        The endpoint of that rank.

    Raises:
        ValueError: ``rank`` is negative; the transport has no per-rank rule (e.g. ``ipc://``) and
            ``rank`` > 0; the tcp port is not a decimal number; or the offset port exceeds 65535.
    """
    if rank < 0:
        raise ValueError(f"data-parallel rank must be >= 0, got {rank}")
    if rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        base, sep, port_text = endpoint.rpartition(":")
        if not sep:
            return endpoint
        if not port_text.isdecimal():
            raise ValueError(f"invalid tcp endpoint {endpoint!r}: port {port_text!r} is not a number")
        port = int(port_text)
        if port == 0:
            return endpoint
        new_port = port + rank
        if new_port > MAX_TCP_PORT:
            raise ValueError(f"endpoint {endpoint!r} offset by rank {rank} gives port {new_port} > 65535")
        return f"{base}:{new_port}"
    raise ValueError(
        f"invalid endpoint {endpoint!r} for data-parallel rank {rank}: must contain 'inproc' or 'tcp'"
    )
