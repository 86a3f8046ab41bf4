"""Tests of the simulated engines' timing model (`kvmesh.sim.timing`)."""

from __future__ import annotations

import pytest

from kvmesh.core.wire import BlockRemoved, BlockStored
from kvmesh.sim.blockpool import BlockPool
from kvmesh.sim.timing import TimedWorker, TimingModel

BS = 4
MODEL = TimingModel(prefill_s_per_token=0.01, prefill_overhead_s=0.0, decode_s_per_token=0.1, max_batch=2)


def worker(num_blocks: int = 64, timing: TimingModel = MODEL) -> TimedWorker:
    return TimedWorker(BlockPool(num_blocks=num_blocks, block_size=BS), timing)


def test_ttft_is_prefill_of_uncached_tokens() -> None:
    """A lone request's first token comes after its uncached tokens' prefill; a repeat hits and is faster."""
    w = worker()
    a = w.submit("a", list(range(10)), [1, 2, 3], arrival_s=0.0)
    assert a.ttft_s == pytest.approx(0.10)
    w.advance(10.0)
    assert a.finished_s == pytest.approx(0.10 + 2 * 0.1)
    b = w.submit("b", list(range(10)), [1, 2, 3], arrival_s=10.0)
    assert b.cached_tokens == 8
    assert b.ttft_s == pytest.approx(0.02)


def test_routing_delay_counts_in_ttft() -> None:
    """Received 0.25 s after its arrival, a 10-token prompt has its first token at 0.35 s: TTFT 0.35 s."""
    w = worker()
    a = w.submit("a", list(range(10)), [1, 2, 3], arrival_s=0.0, received_s=0.25)
    assert (a.arrival_s, a.received_s, a.admitted_s) == (0.0, 0.25, 0.25)
    assert a.first_token_s == pytest.approx(0.35)
    assert a.ttft_s == pytest.approx(0.35)
    w.advance(10.0)
    assert a.finished_s == pytest.approx(0.35 + 2 * 0.1)
    with pytest.raises(ValueError, match="before its arrival"):
        w.submit("b", [1], [1], arrival_s=11.0, received_s=10.5)
    with pytest.raises(ValueError, match="before the worker's time"):
        w.submit("c", [1], [1], arrival_s=9.0, received_s=9.5)


def test_prefill_is_serial_and_batch_limit_queues() -> None:
    """Prefills run one at a time; a third request waits for a batch slot."""
    w = worker()
    r = [w.submit(f"r{i}", [100 * i + j for j in range(10)], [7] * 11, arrival_s=0.0) for i in range(3)]
    assert r[0].first_token_s == pytest.approx(0.1)
    assert r[1].first_token_s == pytest.approx(0.2)
    assert r[2].admitted_s is None
    w.advance(100.0)
    assert r[2].admitted_s == pytest.approx(r[0].finished_s)
    assert r[0].finished_s is not None
    assert r[2].first_token_s == pytest.approx(r[0].finished_s + 0.1)
    assert all(x.finished_s is not None for x in r)


def test_decode_blocks_stored_at_the_step_that_fills_them() -> None:
    """Each decode block is one BlockStored, chained to its parent, at the time its last token is computed."""
    w = worker()
    w.submit("a", list(range(6)), list(range(50, 58)), arrival_s=0.0)
    batches = w.advance(100.0)
    times = [b.time_s for b in batches]
    assert times == pytest.approx([0.0, 0.06 + 2 * 0.1, 0.06 + 6 * 0.1])
    prompt, d1, d2 = (b.events[0] for b in batches)
    assert isinstance(prompt, BlockStored) and isinstance(d1, BlockStored) and isinstance(d2, BlockStored)
    assert d1.parent_block_hash == prompt.block_hashes[-1]
    assert d1.token_ids == (4, 5, 50, 51)
    assert d2.parent_block_hash == d1.block_hashes[0]
    assert d2.token_ids == (52, 53, 54, 55)


def test_full_pool_waits_then_evicts() -> None:
    """A prompt that needs blocks held by a running request waits, then evicts the freed blocks lazily."""
    w = worker(num_blocks=4)
    a = w.submit("a", list(range(12)), [1, 2], arrival_s=0.0)
    b = w.submit("b", list(range(100, 112)), [1, 2], arrival_s=0.0)
    assert a.admitted_s == 0.0 and b.admitted_s is None
    batches = w.advance(100.0)
    assert b.admitted_s == pytest.approx(a.finished_s)
    removed = [e for batch in batches for e in batch.events if isinstance(e, BlockRemoved)]
    assert len(removed) == 3


def test_too_large_prompt_is_rejected() -> None:
    """A prompt larger than the whole pool is rejected, not queued forever."""
    w = worker(num_blocks=2)
    r = w.submit("big", list(range(40)), [1], arrival_s=0.0)
    assert r.rejected
    assert [t.request_id for t in w.take_finished()] == ["big"]


def test_deterministic() -> None:
    """Two workers fed the same requests emit the same batches at the same times."""
    runs = []
    for _ in range(2):
        w = worker(num_blocks=16)
        for i in range(6):
            w.submit(f"r{i}", [j % 5 for j in range(9 + i)], [3] * 9, arrival_s=0.05 * i)
        runs.append([(b.time_s, b.events) for b in w.advance(100.0)])
    assert runs[0] == runs[1]


def test_bad_model_rejected() -> None:
    """A batch limit below one is refused."""
    with pytest.raises(ValueError):
        TimingModel(max_batch=0)


@pytest.mark.anyio
async def test_sim_worker_timed_mode_reports_ttft_and_queues() -> None:
    """A timed SimWorker serves concurrently up to its batch limit and reports simulated queueing and TTFT."""
    from kvmesh.sim.engine import SimWorker

    timing = TimingModel(
        prefill_s_per_token=0.01, prefill_overhead_s=0.0, decode_s_per_token=0.01, max_batch=1
    )
    w = SimWorker("t", num_blocks=64, block_size=BS, endpoint="tcp://127.0.0.1:*", timing=timing, speed=20.0)
    try:
        import asyncio

        a, b = await asyncio.gather(w.serve_request(list(range(10)), 3), w.serve_request(list(range(10)), 3))
        assert a["ttft_s"] == pytest.approx(0.10, abs=0.06)
        assert b["queue_s"] >= 0.1  # waited for the single batch slot
        assert b["cached_tokens"] == 8
        assert b["ttft_s"] >= b["queue_s"]
        assert not w.pool.running
    finally:
        w.close()
