"""Context length in the registry: a prompt longer than a worker's context length is not routed there.

Real nats-server, real ZMQ sockets (simulated vLLM publishers), the real ingests, indexer and router as tasks.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from tests.pipeline import eventually, overlaps
from tests.test_ingest_faults import BS, T, blk, clean_pipeline, stored

from kvmesh.client import ContextLengthExceededError, NoWorkersError
from kvmesh.core.errors import route_error
from kvmesh.ingest.config import IngestSettings
from kvmesh.ingest.engines import build_sglang_command, build_vllm_command
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import connect
from kvmesh.runtime.registry import RegistrySettings, list_workers, open_registry
from kvmesh.sim.publisher import EventPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

ANY = "tcp://127.0.0.1:*"
LONG_PROMPT = [*T, *range(500, 508)]  # 24 tokens: T's 4 blocks and 2 more


@contextlib.asynccontextmanager
async def publishers(*pubs: EventPublisher) -> AsyncIterator[None]:
    try:
        yield
    finally:
        for pub in pubs:
            pub.close()


async def test_a_prompt_longer_than_a_workers_context_goes_to_another_and_longer_than_all_is_refused(
    nats_url: str, uid: str
) -> None:
    """Worker ``short`` (context 16) caches all of T, ``long`` (context 32) nothing: a 16-token prompt goes
    to ``short`` (its cache), a 24-token one to ``long`` (``short`` is no candidate at all), a 40-token one is
    refused with context_length_exceeded, and so is a 24-token one limited to ``short``."""
    short, long_ = EventPublisher(ANY, ANY), EventPublisher(ANY, ANY)
    async with publishers(short, long_), clean_pipeline(nats_url, uid) as p:
        for name, pub, ctx in (("short", short, 16), ("long", long_, 32)):
            await p.start_ingest(
                name,
                pub.endpoint,
                pub.replay_endpoint,
                block_size=BS,
                context_length=ctx,
                kv_capacity_blocks=64,
            )
            await pub.wait_for_subscribers(1)
        await p.start_indexer()
        await p.start_router()
        short.publish([stored([1, 2, 3, 4], blk(T, 0, 4))])

        nc = await connect(nats_url, name="test-context")
        try:
            kv = await open_registry(
                nc.jetstream(), RegistrySettings(bucket=subjects.registry_bucket(p.stream))
            )
            records = await eventually(
                lambda: list_workers(kv),
                lambda r: {w: rec.context_length for w, rec in r.items()} == {"short": 16, "long": 32},
            )
            assert {w: rec.kv_capacity_blocks for w, rec in records.items()} == {"short": 64, "long": 64}
        finally:
            await nc.close()

        want = {"short/0": 4, "long/0": 0}
        assert await eventually(lambda: p.route(T, explain=True), lambda r: overlaps(r) == want)
        fits = await p.route(T)
        assert (fits.worker_id, fits.overlap_blocks, fits.cached_tokens) == ("short", 4, 16)

        longer = await p.route(LONG_PROMPT, explain=True)
        assert (longer.worker_id, longer.overlap_blocks, longer.cached_tokens) == ("long", 0, 0)
        assert overlaps(longer) == {"long/0": 0}
        assert longer.available_tokens == 0  # short's cache is no reuse a 24-token prompt could have
        assert longer.selection is not None and longer.selection.total == 1

        with pytest.raises(ContextLengthExceededError) as err:
            await p.route([*LONG_PROMPT, *range(600, 616)])
        assert err.value.code == "context_length_exceeded"
        assert err.value.message == (
            "the prompt (40 tokens) exceeds the context length of every worker of model 'test-model' "
            "(the longest is 32 tokens)"
        )
        assert isinstance(err.value, NoWorkersError)

        with pytest.raises(ContextLengthExceededError) as only_short:
            await p.route(LONG_PROMPT, candidates=["short"])
        assert only_short.value.message == (
            "the prompt (24 tokens) exceeds the context length of the candidates ['short'], and no other "
            "candidate of ['short'] serves 'test-model'"
        )
        # The router keeps serving.
        assert (await p.route(T)).worker_id == "short"


def test_the_error_code_maps_to_its_exception() -> None:
    """An error reply with code context_length_exceeded becomes a ContextLengthExceededError (a NoWorkersError)."""
    exc = route_error("context_length_exceeded", "too long")
    assert type(exc) is ContextLengthExceededError and exc.status == 400 and isinstance(exc, NoWorkersError)


def test_engine_flags_give_the_registry_its_context_length_block_size_and_capacity() -> None:
    """`kvmesh vllm` reads --max-model-len (32k = 32,000, as vLLM reads it), --block-size and
    --num-gpu-blocks-override; `kvmesh sglang` --context-length, --page-size and --max-total-tokens."""
    cmd = build_vllm_command(
        ["serve", "m", "--max-model-len", "32k", "--block-size", "32", "--num-gpu-blocks-override=512"]
    )
    assert (cmd.context_length, cmd.block_size, cmd.kv_capacity_blocks) == (32000, 32, 512)
    assert build_vllm_command(["serve", "m", "--max-model-len", "4K"]).context_length == 4096
    assert build_vllm_command(["serve", "m"]).context_length is None
    sg = build_sglang_command(
        ["--model-path", "m", "--context-length", "8192", "--page-size", "16", "--max-total-tokens", "65536"]
    )
    assert (sg.context_length, sg.block_size, sg.kv_capacity_blocks) == (8192, 16, 4096)
    bad = IngestSettings(worker_id="w", model="m", context_length=0, kv_capacity_blocks=0)
    assert bad.validate() == [
        "--context-length must be ≥ 1",
        "--kv-capacity-blocks must be within [1, 9223372036854775807], got 0",
    ]
    huge = IngestSettings(worker_id="w", model="m", kv_capacity_blocks=10**23)
    assert huge.validate() == [
        "--kv-capacity-blocks must be within [1, 9223372036854775807], got 100000000000000000000000"
    ]
