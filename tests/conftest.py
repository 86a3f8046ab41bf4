"""Shared fixtures: a real nats-server with JetStream per test session, isolation per test.

Set ``KVMESH_TEST_NATS_URL`` to run the NATS tests against an existing server (with JetStream) instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.bench.fleet import Cluster
from kvmesh.harness.server import NatsServer


@pytest.fixture
def anyio_backend() -> str:
    """nats-py and zmq.asyncio are asyncio-only."""
    return "asyncio"


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """URL of a nats-server with JetStream for the whole session (started on a free port)."""
    external = os.environ.get("KVMESH_TEST_NATS_URL")
    if external:
        yield external
        return
    with NatsServer() as server:
        yield server.url


@pytest.fixture
def uid() -> str:
    """A unique token per test, for stream names and subject prefixes."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A 3-node NATS cluster with JetStream (file storage under tmp_path)."""
    c = Cluster(tmp_path)
    try:
        for i in range(3):
            c.start(i)
        yield c
    finally:
        c.stop()
