"""Free loopback ports for the processes the tools start (nats-server nodes, simulated engines, services)."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """Return a loopback TCP port that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LISTEN_LOW = 10_000
"""Lowest base port `free_block` picks (above the well-known and most registered service ports)."""


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take their ports from it), or
    32768 where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_block(span: int) -> int:
    """Return a base port such that ``base .. base + span - 1`` are all free on 127.0.0.1 now.

    The block lies below the kernel's ephemeral range when there is room: a port in that range can be taken by
    any outgoing connection between this check and the bind of the process it is meant for.

    Raises:
        RuntimeError: no such block was found in 200 tries.
    """
    low, high = _LISTEN_LOW, _ephemeral_low() - span
    rng = random.Random()
    for attempt in range(200):
        base = rng.randrange(low, high) if high > low and attempt < 150 else free_port()
        if base + span >= 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + span):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {span} consecutive free ports")
