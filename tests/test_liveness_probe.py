"""Liveness probes against real sockets: a simulated engine's replay ROUTER and a local HTTP server."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio

from kvmesh.ingest.probes import probe_http, probe_replay
from kvmesh.sim.publisher import EventPublisher

pytestmark = pytest.mark.anyio


@pytest.fixture
def actx() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_replay_probe_answered_by_a_live_publisher(actx: zmq.asyncio.Context) -> None:
    """A live engine's replay socket answers the probe with its end marker."""
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        assert pub.replay_endpoint is not None
        assert await probe_replay(actx, pub.replay_endpoint, timeout_s=3.0) == (True, "")
    finally:
        pub.close()


async def test_replay_probe_fails_when_the_engine_is_gone(actx: zmq.asyncio.Context) -> None:
    """After the engine's process (its publisher) is gone, the probe reports no answer within the bound."""
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    endpoint = pub.replay_endpoint
    assert endpoint is not None
    pub.close()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    answered, why = await probe_replay(actx, endpoint, timeout_s=0.5)
    assert answered is False
    assert why == f"replay socket {endpoint} did not answer within 0.5 s"
    assert loop.time() - t0 < 2.0


async def test_replay_probe_fails_on_a_hung_replay_service(actx: zmq.asyncio.Context) -> None:
    """A publisher that reads replay requests but never answers (a hung engine) fails the probe."""
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    try:
        pub.replay_enabled = False
        assert pub.replay_endpoint is not None
        answered, _ = await probe_replay(actx, pub.replay_endpoint, timeout_s=0.5)
        assert answered is False
    finally:
        pub.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = 200 if self.path == "/health" else 503
        self.send_response(code)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


async def test_http_probe() -> None:
    """An HTTP answer below 500 is alive; 5xx and a closed port are not."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert await probe_http(f"http://127.0.0.1:{port}/health", timeout_s=2.0) == (True, "")
        assert await probe_http(f"http://127.0.0.1:{port}/other", timeout_s=2.0) == (
            False,
            f"http://127.0.0.1:{port}/other answered HTTP 503",
        )
    finally:
        server.shutdown()
        server.server_close()
    answered, why = await probe_http(f"http://127.0.0.1:{port}/health", timeout_s=1.0)
    assert answered is False
    assert why.startswith(f"http://127.0.0.1:{port}/health: ")
