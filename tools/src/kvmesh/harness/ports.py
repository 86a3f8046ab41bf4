"""Free loopback ports for the processes the tools start (nats-server nodes, simulated engines, services)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """Return a loopback TCP port that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_block(span: int) -> int:
    """Return a base port such that ``base .. base + span - 1`` are all free on 127.0.0.1 now.

    Raises:
        RuntimeError: no such block was found in 200 tries.
    """
    for _ in range(200):
        base = free_port()
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
