"""Multi-node data parallelism: one worker's ranks read by one ingest per node, one registry record per node.

Real nats-server, real ZMQ sockets (one simulated vLLM publisher per global rank, bound on the base port +
its global rank as vLLM binds it on whichever node runs it), the real ingests, indexer and router as tasks.
A node is killed by cancelling its ingest (its heartbeats stop; nothing deregisters it), so its registry key
ages out after the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from tests.pipeline import Pipeline, eventually, overlaps
from tests.test_ingest_faults import BS, T, U, blk, clean_pipeline, stored

from kvmesh.client import NoWorkersError
from kvmesh.core.endpoints import offset_endpoint
from kvmesh.core.protocol import WorkerRecord
from kvmesh.harness.ports import free_block
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.engines import build_sglang_command, build_vllm_command
from kvmesh.ingest.service import IngestService
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect
from kvmesh.runtime.registry import (
    NO_NODE,
    RegistrySettings,
    RegistryWatcher,
    list_workers,
    open_registry,
    registry_key,
    registry_keys,
)
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

W = "moe"
DP = 4
TTL_S = 4.0


@contextlib.asynccontextmanager
async def ranks_on_ports() -> AsyncIterator[tuple[str, str, list[EventPublisher]]]:
    """Base events and replay endpoints and one publisher per global rank r on base + r."""
    base = free_block(2 * DP)
    events, replay = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + DP}"
    pubs = [
        EventPublisher(offset_endpoint(events, r), offset_endpoint(replay, r), dp_rank=r) for r in range(DP)
    ]
    try:
        yield events, replay, pubs
    finally:
        for pub in pubs:
            pub.close()


async def start_node(p: Pipeline, events: str, replay: str, start: int, local: int) -> asyncio.Task[None]:
    """Start the ingest of one node (ranks [start, start + local)); return its task (cancel = kill)."""
    await p.start_ingest(
        W,
        events,
        replay,
        block_size=BS,
        data_parallel_size=DP,
        data_parallel_start_rank=start,
        data_parallel_size_local=local,
        worker_ttl_s=TTL_S,
    )
    return p.tasks[-1]


async def kill(p: Pipeline, task: asyncio.Task[None]) -> None:
    """Kill a node's ingest: its heartbeats stop and nothing deregisters it."""
    p.tasks.remove(task)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def explained(p: Pipeline, tokens: list[int]) -> dict[str, int]:
    return overlaps(await p.route(tokens, explain=True))


async def test_two_nodes_of_one_worker_route_then_leave_node_by_node(nats_url: str, uid: str) -> None:
    """Two nodes of a DP-4 worker (ranks 0–1 and 2–3), each with its own ingest and registry key, are both
    routed to; killing the second takes ranks 2–3 out of routing and empties them in the index while ranks
    0–1 stay; killing the first removes the worker."""
    async with ranks_on_ports() as (events, replay, pubs), clean_pipeline(nats_url, uid) as p:
        node_a = await start_node(p, events, replay, 0, 2)
        node_b = await start_node(p, events, replay, 2, 2)
        for pub in pubs:
            await pub.wait_for_subscribers(1)
        indexer = await p.start_indexer()
        await p.start_router()
        # Rank r caches the first r + 1 blocks of T; rank 1 alone also caches U.
        for r, pub in enumerate(pubs):
            pub.publish([stored(list(range(10 * r + 1, 10 * r + 2 + r)), blk(T, 0, r + 1))])
        pubs[1].publish([stored([99, 98], U)])
        want = {f"{W}/0": 1, f"{W}/1": 2, f"{W}/2": 3, f"{W}/3": 4}
        assert await eventually(lambda: explained(p, T), lambda o: o == want) == want
        assert (await p.route(T)).worker_id == W and (await p.route(T)).dp_rank == 3  # node B
        on_u = await p.route(U)
        assert (on_u.dp_rank, on_u.overlap_blocks, on_u.cached_tokens) == (1, 2, 8)  # node A

        nc = await connect(nats_url, name="test-multinode")
        try:
            kv = await open_registry(
                nc.jetstream(), RegistrySettings(bucket=subjects.registry_bucket(p.stream), ttl_s=TTL_S)
            )
            # One key per node: they never overwrite each other; readers merge them into one worker.
            keys = {registry_key(W, range(0, 2)), registry_key(W, range(2, 4))}
            assert keys == {f"{W}.dp0-2", f"{W}.dp2-4"}
            assert await registry_keys(kv) == keys
            merged = (await list_workers(kv))[W]
            assert (merged.dp_ranks, merged.stale_ranks, merged.block_size) == (DP, {}, BS)

            await kill(p, node_b)
            left = {f"{W}/0": 1, f"{W}/1": 2}
            assert await eventually(lambda: explained(p, T), lambda o: o == left, timeout_s=30) == left
            reply = await p.route(T, explain=True)
            assert (reply.worker_id, reply.dp_rank, reply.overlap_blocks) == (W, 1, 2)
            assert reply.selection is not None and reply.selection.skipped_total == 2
            assert [(s.dp_rank, s.reason) for s in reply.selection.skipped] == [
                (2, f"stale: {NO_NODE}"),
                (3, f"stale: {NO_NODE}"),
            ]
            # The index empties node B's ranks at one stream point; the worker stays.
            state = await eventually(
                lambda: asyncio.sleep(0, indexer.state.workers()[W]),
                lambda w: w["blocks"] == 1 + 2 + 2,
            )
            assert state["removed"] is False

            merged = (await list_workers(kv))[W]
            assert merged.stale_ranks == {2: NO_NODE, 3: NO_NODE}

            await kill(p, node_a)

            async def no_workers() -> str:
                try:
                    await p.route(T)
                except NoWorkersError as exc:
                    return exc.message
                return "routed"

            message = await eventually(no_workers, lambda m: m != "routed", timeout_s=30)
            assert (
                message
                == f"every worker of model {p.model!r} has left the worker registry (heartbeats stopped)"
            )
            await eventually(
                lambda: asyncio.sleep(0, indexer.state.workers()[W]["removed"]), lambda r: r is True
            )
            assert indexer.state.workers()[W]["blocks"] == 0
        finally:
            await nc.close()


async def test_an_indexer_started_after_a_node_left_clears_that_nodes_ranks(nats_url: str, uid: str) -> None:
    """A node whose key aged out while no indexer ran: the next indexer, once its registry watch has synced,
    empties the ranks no node key reads (2–3) and keeps the worker with the other node's blocks."""
    async with ranks_on_ports() as (events, replay, pubs), clean_pipeline(nats_url, uid) as p:
        await start_node(p, events, replay, 0, 2)
        node_b = await start_node(p, events, replay, 2, 2)
        for pub in pubs:
            await pub.wait_for_subscribers(1)
        first = await p.start_indexer()
        for r, pub in enumerate(pubs):
            pub.publish([stored(list(range(10 * r + 1, 10 * r + 2 + r)), blk(T, 0, r + 1))])
        await eventually(
            lambda: asyncio.sleep(0, first.state.workers().get(W, {}).get("blocks")), lambda b: b == 10
        )
        first.stop()
        await p.tasks.pop()
        await kill(p, node_b)
        nc = await connect(nats_url, name="test-multinode")
        try:
            kv = await open_registry(
                nc.jetstream(), RegistrySettings(bucket=subjects.registry_bucket(p.stream), ttl_s=TTL_S)
            )
            await eventually(
                lambda: list_workers(kv), lambda w: w[W].stale_ranks == {2: NO_NODE, 3: NO_NODE}, timeout_s=30
            )
        finally:
            await nc.close()
        second = await p.start_indexer()
        state = await eventually(
            lambda: asyncio.sleep(0, second.state.workers()[W]), lambda w: w["blocks"] == 1 + 2, timeout_s=20
        )
        assert state["removed"] is False and state["epochs"] == {0: 0, 1: 0, 2: 0, 3: 0}


async def test_a_node_at_lower_epochs_rejoins_after_the_worker_left(nats_url: str, uid: str) -> None:
    """Node B's engine restarted (its ranks at epoch 1, node A's at 0); A leaves, then B, the last node, so
    the worker is removed. Node A's ingest started again rejoins one epoch above its own (1) and is indexed:
    the removal names the worker's lowest rank epoch, not B's."""
    async with ranks_on_ports() as (events, replay, pubs), clean_pipeline(nats_url, uid) as p:
        node_a = await start_node(p, events, replay, 0, 2)
        node_b = await start_node(p, events, replay, 2, 2)
        for pub in pubs:
            await pub.wait_for_subscribers(1)
        indexer = await p.start_indexer()
        await p.start_router()
        for r, pub in enumerate(pubs):
            pub.publish([stored(list(range(10 * r + 1, 10 * r + 2 + r)), blk(T, 0, r + 1))])
        for r in (2, 3):
            pubs[r].restart()
            pubs[r].publish([stored(list(range(10 * r + 1, 10 * r + 2 + r)), blk(T, 0, r + 1))])
        await eventually(
            lambda: asyncio.sleep(0, indexer.state.workers()[W]),
            lambda w: w["epochs"] == {0: 0, 1: 0, 2: 1, 3: 1} and w["blocks"] == 10,
        )
        await kill(p, node_a)
        left = {f"{W}/2": 3, f"{W}/3": 4}
        assert await eventually(lambda: explained(p, T), lambda o: o == left, timeout_s=30) == left
        await kill(p, node_b)
        await eventually(
            lambda: asyncio.sleep(0, indexer.state.workers()[W]["removed"]), lambda r: r is True, timeout_s=30
        )
        await start_node(p, events, replay, 0, 2)
        await pubs[0].wait_for_subscribers(2)
        pubs[0].publish([stored([77, 78], U)])
        want = {f"{W}/0": 2, f"{W}/1": 0}
        assert await eventually(lambda: explained(p, U), lambda o: o == want, timeout_s=20) == want
        assert indexer.state.workers()[W]["epochs"] == {0: 1, 1: 1, 2: 1, 3: 1}


def test_watcher_merges_node_records_and_reads_old_whole_worker_records() -> None:
    """A router's registry view merges a worker's node records (a rank no node reads is not live), keeps
    reading the single whole-worker record every ingest wrote before nodes existed, and drops a node's ranks
    when its key goes."""
    watcher = RegistryWatcher(js=None, bucket="b")  # type: ignore[arg-type]
    watcher.synced = True
    old = b'{"worker_id":"w","model":"m","dp_ranks":2,"block_size":16,"incarnation":3}'
    watcher.apply("w", None, old)
    node = WorkerRecord(
        worker_id="x", model="m", dp_ranks=4, block_size=16, incarnation=1, dp_rank_start=2, dp_ranks_local=2
    )
    from kvmesh.core import protocol

    watcher.apply("x.dp2-4", None, protocol.encode(node))
    assert [tuple(h) for h in watcher.live("m") or []] == [("w", 0), ("w", 1), ("x", 2), ("x", 3)]
    other = WorkerRecord(
        worker_id="x", model="m", dp_ranks=4, block_size=16, incarnation=2, dp_rank_start=0, dp_ranks_local=2
    )
    watcher.apply("x.dp0-2", None, protocol.encode(other))
    ranks = watcher.ranks("m")
    assert ranks is not None and (ranks.live_count, ranks.stale_count) == (6, 0)
    assert watcher.workers["x"].incarnation == 2
    watcher.apply("x.dp2-4", "PURGE", None)
    ranks = watcher.ranks("m")
    assert ranks is not None and (ranks.live_count, ranks.stale_count) == (4, 2)
    assert ranks.stale_reason("x", 3) == NO_NODE and ranks.contains("x", 1)
    # A node record under another node's key is refused, not merged.
    watcher.apply("x.dp2-4", None, protocol.encode(other))
    assert "x.dp2-4" not in watcher.records
    watcher.apply("x.dp0-2", "DEL", None)
    assert "x" not in watcher.workers and watcher.live("m") == [("w", 0), ("w", 1)]


def test_engine_flags_give_the_node_its_ranks() -> None:
    """`kvmesh vllm` reads --data-parallel-size-local / --data-parallel-start-rank (and --data-parallel-rank),
    `kvmesh sglang` --nnodes / --node-rank with --dp-size, into the ingest's node ranks; every node keeps the
    base ports (rank r on port + r)."""
    cmd = build_vllm_command(
        ["serve", "m", "--data-parallel-size", "16", "-dpl", "8", "--data-parallel-start-rank", "8"],
        events_port=6000,
    )
    assert (cmd.data_parallel_size, cmd.data_parallel_start_rank, cmd.data_parallel_size_local) == (16, 8, 8)
    assert (cmd.endpoint, cmd.replay_endpoint) == ("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6016")
    settings = IngestSettings(
        worker_id="w",
        model=cmd.model,
        zmq_endpoint=cmd.endpoint,
        data_parallel_size=16,
        data_parallel_start_rank=cmd.data_parallel_start_rank,
        data_parallel_size_local=cmd.data_parallel_size_local,
    )
    assert settings.validate() == [] and settings.local_ranks() == range(8, 16) and settings.multi_node()
    one = build_vllm_command(["serve", "m", "-dp", "4", "--data-parallel-rank", "2"])
    assert (one.data_parallel_start_rank, one.data_parallel_size_local) == (2, 1)
    whole = build_vllm_command(["serve", "m", "-dp", "4", "-dpl", "4"])
    assert (whole.data_parallel_start_rank, whole.data_parallel_size_local) == (0, None)
    sg = build_sglang_command(["--model-path", "m", "--dp-size", "8", "--nnodes", "2", "--node-rank", "1"])
    assert (sg.data_parallel_start_rank, sg.data_parallel_size_local) == (4, 4)
    spans = build_sglang_command(["--model-path", "m", "--dp-size", "2", "--nnodes", "4", "--node-rank", "2"])
    assert (spans.data_parallel_start_rank, spans.data_parallel_size_local) == (1, 1)
    bad = IngestSettings(
        worker_id="w", model="m", data_parallel_size=4, data_parallel_start_rank=3, data_parallel_size_local=2
    )
    assert bad.validate() == [
        "--data-parallel-size-local must be in [1, 1] with start rank 3 and --data-parallel-size 4 (got 2)"
    ]


async def test_a_node_ingest_rejects_batches_of_another_nodes_ranks(nats_url: str, uid: str) -> None:
    """An ingest of ranks 2–3 indexes a batch stamped rank 2 and rejects one stamped rank 0 (another node's)."""
    async with ranks_on_ports() as (events, replay, pubs), clean_pipeline(nats_url, uid) as p:
        await start_node(p, events, replay, 2, 2)
        ing: IngestService = p.ingests[W]
        await pubs[2].wait_for_subscribers(1)
        await p.start_indexer()
        await p.start_router()
        pubs[2].publish([stored([1], blk(T, 0))])
        want = {f"{W}/2": 1, f"{W}/3": 0}
        assert await eventually(lambda: explained(p, T), lambda o: o == want) == want
        pubs[2]._dp_rank = 0  # a mis-stamped batch
        pubs[2].publish([stored([2], blk(T, 1), parent=1)])
        await eventually(lambda: asyncio.sleep(0, ing.counters.bad_dp_rank_batches), lambda n: n == 1)
        assert await explained(p, T) == want
