"""Load accounting: the request ledger, engine reports with a TTL, and vLLM's /metrics page (pure)."""

from __future__ import annotations

from kvmesh.core.load import (
    ActiveLoad,
    EngineLoads,
    LoadLedger,
    PrefixCounters,
    decode_prometheus_text,
    from_vllm_metrics,
)
from kvmesh.core.protocol import LedgerEntry, LedgerSnapshot, Routed, WorkerLoad


def routed(rid: str, w: str = "a", dp: int = 0, prefill: int = 100, blocks: int = 8) -> Routed:
    """A Routed event."""
    return Routed(request_id=rid, worker_id=w, dp_rank=dp, prefill_tokens=prefill, blocks=blocks)


def test_lifecycle_moves_prefill_then_blocks_off_the_worker() -> None:
    """Routed adds prefill tokens and blocks; prefill_done drops the tokens; finished drops the rest."""
    led = LoadLedger()
    assert led.routed(routed("r1"), 0.0) is True
    assert led.routed(routed("r2", prefill=20, blocks=3), 0.0) is True
    assert led.load("a", 0) == ActiveLoad(prefill_tokens=120, blocks=11, requests=2)
    assert led.prefill_done("r1") is True
    assert led.prefill_done("r1") is False
    assert led.load("a", 0) == ActiveLoad(prefill_tokens=20, blocks=11, requests=2)
    assert led.finished("r1") is True
    assert led.finished("r2") is True
    assert led.load("a", 0) == ActiveLoad()
    assert led.finished("r1") is False
    s = led.stats()
    assert (s.active, s.routed, s.prefill_done, s.finished, s.unknown) == (0, 2, 1, 2, 1)


def test_loaded_lists_the_pairs_with_requests_in_flight() -> None:
    """`loaded` names each (worker, dp rank) with work once, and forgets one whose last request finished."""
    led = LoadLedger()
    assert led.loaded() == []
    led.routed(routed("r1"), 0.0)
    led.routed(routed("r2"), 0.0)
    led.routed(routed("r3", w="b", dp=1), 0.0)
    assert sorted(led.loaded()) == [("a", 0), ("b", 1)]
    led.finished("r3")
    assert led.loaded() == [("a", 0)]


def test_routed_is_idempotent_and_moves_a_rerouted_request() -> None:
    """The same Routed twice counts once; a Routed to another worker moves the request there."""
    led = LoadLedger()
    led.routed(routed("r1"), 0.0)
    assert led.routed(routed("r1"), 1.0) is False
    assert led.load("a", 0).requests == 1
    assert led.routed(routed("r1", w="b", dp=1), 2.0) is True
    assert (led.load("a", 0), led.load("b", 1)) == (ActiveLoad(), ActiveLoad(100, 8, 1))


def test_load_excluding_a_request_leaves_out_its_own_share() -> None:
    """A request routed again is not weighed down by its own earlier routing."""
    led = LoadLedger()
    led.routed(routed("r1"), 0.0)
    led.routed(routed("r2", prefill=5, blocks=1), 0.0)
    assert led.load("a", 0, excluding="r1") == ActiveLoad(prefill_tokens=5, blocks=1, requests=1)
    assert led.load("a", 0, excluding="zz") == ActiveLoad(prefill_tokens=105, blocks=9, requests=2)
    led.finished("r2")
    assert led.load("a", 0, excluding="r1") == ActiveLoad()


def test_unfinished_requests_expire_after_the_ttl() -> None:
    """A request never finished stops counting ttl_s after it was routed."""
    led = LoadLedger(ttl_s=300.0)
    led.routed(routed("r1"), 0.0)
    led.routed(routed("r2"), 100.0)
    assert led.expire(299.0) == 0
    assert led.expire(300.0) == 1
    assert led.load("a", 0).requests == 1
    assert led.expire(400.0) == 1
    assert led.stats().expired == 2


def test_snapshot_restores_into_a_fresh_ledger_with_ages() -> None:
    """A peer's snapshot restores every in-flight request with its remaining time to live."""
    peer = LoadLedger(ttl_s=300.0)
    peer.routed(routed("r1"), 10.0)
    peer.routed(routed("r2", w="b"), 50.0)
    peer.prefill_done("r2")
    snap = peer.snapshot(60.0)
    assert snap.entries == [
        LedgerEntry(request_id="r1", worker_id="a", dp_rank=0, prefill_tokens=100, blocks=8, age_s=50.0),
        LedgerEntry(request_id="r2", worker_id="b", dp_rank=0, prefill_tokens=0, blocks=8, age_s=10.0),
    ]
    fresh = LoadLedger(ttl_s=300.0)
    fresh.routed(routed("r3"), 1000.0)
    assert fresh.restore(snap, 1000.0) == 2
    assert fresh.restore(snap, 1000.0) == 0
    assert fresh.load("a", 0) == ActiveLoad(prefill_tokens=200, blocks=16, requests=2)
    assert fresh.expire(1250.0) == 1  # r1 was routed at 950 on the fresh clock
    assert fresh.expire(1290.0) == 1  # r2 at 990
    assert fresh.stats().active == 1
    old = LedgerSnapshot(
        entries=[
            LedgerEntry(request_id="x", worker_id="a", dp_rank=0, prefill_tokens=1, blocks=1, age_s=301.0)
        ]
    )
    assert LoadLedger(ttl_s=300.0).restore(old, 0.0) == 0


def test_engine_reports_go_stale_after_the_ttl() -> None:
    """The newest report per (worker, rank) is used until ttl_s old, then ignored and pruned."""
    loads = EngineLoads(ttl_s=10.0)
    loads.update(WorkerLoad(worker_id="a", running=3), 0.0)
    loads.update(WorkerLoad(worker_id="a", running=5), 4.0)
    loads.update(WorkerLoad(worker_id="a", dp_rank=1, waiting=2), 0.0)
    assert loads.get("a", 0, 14.0) == WorkerLoad(worker_id="a", running=5)
    assert loads.get("a", 1, 14.0) is None
    assert loads.get("a", 0, 14.5) is None
    assert loads.prune(14.0) == 1
    assert len(loads) == 1


METRICS_NEW = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e+09
vllm:num_requests_running{engine="0",model_name="other"} 7.0
"""

METRICS_OLD = """\
vllm:num_requests_running{model_name="m"} 4.0
vllm:num_requests_waiting{model_name="m"} 9.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.96
vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.125
"""


def test_vllm_v1_metrics_give_one_load_per_engine() -> None:
    """Current names, per-engine labels, another model ignored; hit rate from counters."""
    loads, counters = from_vllm_metrics(METRICS_NEW, worker_id="w", model="m")
    assert loads == [
        WorkerLoad(
            worker_id="w", dp_rank=0, model="m", running=3, waiting=2, kv_usage=0.5, prefix_hit_rate=0.4
        ),
        WorkerLoad(worker_id="w", dp_rank=1, model="m", running=1, waiting=0, kv_usage=0.25),
    ]
    assert counters == {0: PrefixCounters(queries=1000.0, hits=400.0)}
    later = METRICS_NEW.replace("1000.0", "1100.0").replace("400.0", "490.0")
    loads2, _ = from_vllm_metrics(later, worker_id="w", model="m", previous=counters)
    assert loads2[0].prefix_hit_rate == 0.9


def test_vllm_old_metric_names() -> None:
    """gpu_cache_usage_perc and gpu_prefix_cache_hit_rate (older releases) are read too; no engine label is rank 0."""
    loads, counters = from_vllm_metrics(METRICS_OLD, worker_id="w")
    assert loads == [
        WorkerLoad(worker_id="w", dp_rank=0, running=4, waiting=9, kv_usage=0.96, prefix_hit_rate=0.125)
    ]
    assert counters == {}


def test_prometheus_text_skips_comments_and_garbage() -> None:
    """Comments, blank and malformed lines are skipped; labels with escaped quotes parse."""
    text = '# x\n\nfoo{a="x\\"y",b="2"} 1.5 1700000000\nbad line\nbar NaNx\nbaz 2\n'
    assert decode_prometheus_text(text) == [("foo", {"a": 'x\\"y', "b": "2"}, 1.5), ("baz", {}, 2.0)]
