"""``kvmesh indexer`` / ``python -m kvmesh.indexer``: one replica of the prefix index."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvmesh.indexer.config import IndexerSettings
from kvmesh.indexer.service import IndexerService
from kvmesh.runtime.runner import run_service

DESCRIPTION = """\
Rebuild the prefix index from the kvmesh events stream and answer match queries from routers. Run as many
replicas as you like: each reads the whole stream with its own ordered consumer, joins the match queue
group only once caught up, and holds the same state as every other replica at the same stream sequence.

example: kvmesh indexer --nats-url nats://nats:4222
"""


def command(argv: Sequence[str] | None = None, prog: str = "kvmesh indexer") -> int:
    """Run the indexer service; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return run_service(
        parser, IndexerSettings, service="indexer", argv=argv, environ=os.environ, build=IndexerService
    )


if __name__ == "__main__":
    sys.exit(command(sys.argv[1:], prog="python -m kvmesh.indexer"))
