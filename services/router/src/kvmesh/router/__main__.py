"""``kvmesh router`` / ``python -m kvmesh.router``: answer ``kvmesh.route`` requests."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvmesh.router.config import RouterSettings
from kvmesh.router.service import RouterService
from kvmesh.runtime.runner import run_service

DESCRIPTION = """\
Answer "which worker for these tokens?" on kvmesh.route (NATS request-reply, JSON): the worker holding the
longest cached prefix of the prompt wins. Run several replicas; they share a queue group.

example: kvmesh router --nats-url nats://nats:4222
         nats req kvmesh.route '{"model": "m", "token_ids": [1, 2, 3]}'
"""


def command(argv: Sequence[str] | None = None, prog: str = "kvmesh router") -> int:
    """Run the router service; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return run_service(
        parser, RouterSettings, service="router", argv=argv, environ=os.environ, build=RouterService
    )


HTTP_DESCRIPTION = """\
Serve the RFC #1403 indexer API (Mooncake's conductor, Dynamo's standalone indexer) over HTTP: a router
replica with --http-port (default 8090) that also answers kvmesh.route. POST /query, /query_by_hash,
/register (starts an ingest for the publisher), /unregister; GET /workers, /dump, /health, /metrics.

example: kvmesh http --nats-url nats://nats:4222 --http-host 0.0.0.0
         curl -s localhost:8090/query -d '{"model": "m", "block_size": 16, "token_ids": [1, 2, 3]}'
"""

DEFAULT_HTTP_PORT = 8090
"""``kvmesh http``'s port when neither ``--http-port`` nor ``KVMESH_ROUTER_HTTP_PORT`` names one (Dynamo's)."""


def http_command(argv: Sequence[str] | None = None, prog: str = "kvmesh http") -> int:
    """Run a router replica with the RFC #1403 HTTP API on; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    named = any(a == "--http-port" or a.startswith("--http-port=") for a in args)
    if not named and "KVMESH_ROUTER_HTTP_PORT" not in os.environ:
        args = ["--http-port", str(DEFAULT_HTTP_PORT), *args]
    parser = argparse.ArgumentParser(
        prog=prog, description=HTTP_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return run_service(
        parser, RouterSettings, service="router", argv=args, environ=os.environ, build=RouterService
    )


if __name__ == "__main__":
    sys.exit(command(sys.argv[1:], prog="python -m kvmesh.router"))
