"""Probes that an engine's own process must answer (the I/O half of `kvmesh.core.liveness`).

`probe_replay` asks a rank's replay ROUTER for batches from a sequence no engine reaches (2⁶³): a live
publisher answers with its end marker alone (vLLM ≥ 0.9 and SGLang ≥ 0.4.6: "a start seq past the newest
gets only END", ../wire-protocol §2.4), a dead one answers nothing. `probe_http` GETs a URL (the engine's
``/health`` or ``/metrics`` page) for engines without a replay socket. `fetch_metrics` reads the engine's
Prometheus page (`kvmesh.ingest.engine_sleep` looks for a sleep there).
"""

from __future__ import annotations

import asyncio
import http.client
import urllib.error
import urllib.request
from typing import Final

import zmq
import zmq.asyncio

from kvmesh.core import wire
from kvmesh.core.errors import WireError
from kvmesh.runtime.vllm_metrics import fetch_text

PROBE_SEQ: Final[int] = 2**63
"""The start sequence a replay probe asks for: past any engine's newest batch, so only END comes back."""
PROBE_MAX_MESSAGE_BYTES: Final[int] = 1 << 16
"""Largest frame a replay probe reads (ZMQ drops a peer that sends more)."""


async def probe_replay(ctx: zmq.asyncio.Context, endpoint: str, *, timeout_s: float) -> tuple[bool, str]:
    """Ask a replay ROUTER for nothing and wait for its end marker.

    Args:
        ctx: the ZMQ context to make the DEALER in.
        endpoint: the rank's replay endpoint (``tcp://host:5558``).
        timeout_s: seconds to wait for the end marker (> 0).

    Returns:
        ``(True, "")`` when the end marker (or any well-formed reply) came, else ``(False, why)``.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # The answer is an end marker of a few bytes; a peer sending megabytes is not an engine's replay socket.
    sock.setsockopt(zmq.MAXMSGSIZE, PROBE_MAX_MESSAGE_BYTES)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        sock.connect(endpoint)
        await sock.send_multipart(wire.encode_replay_request(PROBE_SEQ))
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0 or not await sock.poll(timeout=remaining * 1000):
                return False, f"replay socket {endpoint} did not answer within {timeout_s:g} s"
            frames = await sock.recv_multipart()
            try:
                reply = wire.decode_replay_reply(frames)
            except WireError:
                continue  # not a reply to us; keep waiting until the deadline
            return True, "" if reply.is_end else "answered with a batch"
    except zmq.ZMQError as exc:
        return False, f"replay socket {endpoint}: {exc}"
    finally:
        sock.close(linger=0)


def _get(url: str, timeout_s: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        status: int = resp.status
        return status


async def probe_http(url: str, *, timeout_s: float) -> tuple[bool, str]:
    """GET ``url``; any HTTP answer below 500 counts as alive (the process is serving).

    Returns:
        ``(True, "")`` or ``(False, why)``.
    """
    try:
        status = await asyncio.wait_for(asyncio.to_thread(_get, url, timeout_s), timeout_s + 1.0)
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the response's socket
        if exc.code < 500:
            return True, ""
        return False, f"{url} answered HTTP {exc.code}"
    except (OSError, TimeoutError, ValueError) as exc:
        return False, f"{url}: {exc}"
    # Not an OSError: a port that does not speak HTTP, or an answer cut off.
    except http.client.HTTPException as exc:
        return False, f"{url}: not an HTTP answer ({exc!r})"
    return (True, "") if status < 500 else (False, f"{url} answered HTTP {status}")


async def fetch_metrics(url: str, timeout_s: float) -> str:
    """GET the engine's Prometheus page and return its text (in a worker thread; at most ``timeout_s`` + 1 s).

    Raises:
        OSError: connection or HTTP failure (also `TimeoutError`).
        http.client.HTTPException: an answer that is not HTTP, or one cut off.
    """
    return await asyncio.wait_for(asyncio.to_thread(fetch_text, url, timeout_s), timeout_s + 1.0)
