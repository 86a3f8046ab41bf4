"""``kvmesh bench``: dispatch to the benchmarks."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from importlib import import_module

USAGE = """\
usage: kvmesh bench <benchmark> [options]     (kvmesh bench <benchmark> --help for each)

benchmarks:
  trace     replay a Mooncake trace on a simulated fleet once per routing policy (kvmesh through the real
            pipeline, round-robin, random, least-loaded, oracle): hit ratio, simulated TTFT, router latency
  index     prefix index apply rate and match latency vs Dynamo's RadixTree bindings and a naive dict index,
            with a differential check of every query; memory per stored block
  ingest    simulated engines → ingest → JetStream → consumer, block events/s with zero loss, vs a
            hand-written ZMQ → nats-py pipe
  route     route latency through NATS (concurrency 1) vs a bare NATS request-reply echo, same run
  recovery  1M-block index: snapshot write and apply-loop stall, restore to ready, replay rate through NATS
  scale     8 → 1,024 workers sharing one hot prefix, 1M → 10M blocks: match and route p50/p99, memory per
            block, snapshot size and restore time; JSON and line plots
  dynamo    end to end vs Dynamo's standalone indexer (python -m dynamo.indexer) on the same vLLM ZMQ frames:
            block operations/s until queryable, CPU s per million operations, RSS, query latency, exactness
  http      kvmesh http's RFC #1403 /query vs Dynamo's standalone indexer's on the same vLLM ZMQ frames: every
            answer compared, p50/p99 latency of short and 4,096-token prompts
  soak      the fleet on a local 3-node cluster for N minutes, a random component killed -9 every S seconds:
            memory, consumers and connections over time, and whether the index still equals the engines' truth
"""

_COMMANDS: dict[str, str] = {
    "trace": "kvmesh.bench.trace",
    "index": "kvmesh.bench.index",
    "ingest": "kvmesh.bench.ingest",
    "route": "kvmesh.bench.route",
    "recovery": "kvmesh.bench.recovery",
    "soak": "kvmesh.bench.soak",
    "scale": "kvmesh.bench.scale",
    "dynamo": "kvmesh.bench.dynamo_e2e",
    "http": "kvmesh.bench.indexer_api",
}


def command(argv: Sequence[str] | None = None, prog: str = "kvmesh bench") -> int:
    """Run ``kvmesh bench <benchmark>`` (the ``bench`` entry point of ``kvmesh.commands``); returns the exit
    code. ``prog`` names the command in the unknown-benchmark error."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    module = _COMMANDS.get(args[0])
    if module is None:
        print(f"{prog}: unknown benchmark {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    run: Callable[[Sequence[str]], int] = import_module(module).command
    return run(args[1:])
