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


if __name__ == "__main__":
    sys.exit(command(sys.argv[1:], prog="python -m kvmesh.router"))
