"""``kvmesh ingest`` / ``python -m kvmesh.ingest``: attach to one engine's KV events and publish them."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.service import IngestService
from kvmesh.runtime.runner import run_service

DESCRIPTION = """\
Read one engine's KV cache events (vLLM or SGLang ZMQ PUB socket, every data-parallel rank), check and
normalize them, and publish them to the kvmesh events stream on NATS JetStream. Gaps in the engine's
sequence are filled from its replay socket; an engine restart or an unrecoverable gap clears that worker's
entries so the index never invents cached blocks.

example: kvmesh ingest --worker-id vllm-0 --model meta-llama/Llama-3.1-8B \\
             --zmq-endpoint tcp://10.0.0.5:5557 --replay-endpoint tcp://10.0.0.5:5558

An engine without KV events (--no-kv-events) is only registered, with heartbeats: no ZMQ socket is opened
and nothing goes to the stream; routers then count the prompts they send it as its cache, at most
--kv-capacity-blocks per rank, least recently used out first. It needs --block-size and
--kv-capacity-blocks. --metrics-url still publishes its load, --health-url still probes its liveness (without
it the ranks are never stale: silence proves nothing), and `kvmesh status` lists it with the endpoint
"none (no KV events)". A sleep shown on --metrics-url clears nothing (the index holds nothing of it).

example: kvmesh ingest --no-kv-events --worker-id trt-0 --model meta-llama/Llama-3.1-8B \\
             --block-size 16 --kv-capacity-blocks 40000 --health-url http://10.0.0.6:8000/health
"""


def command(argv: Sequence[str] | None = None, prog: str = "kvmesh ingest") -> int:
    """Run the ingest service; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return run_service(
        parser,
        IngestSettings,
        service="ingest",
        argv=argv,
        environ=os.environ,
        build=IngestService,
    )


if __name__ == "__main__":
    sys.exit(command(sys.argv[1:], prog="python -m kvmesh.ingest"))
