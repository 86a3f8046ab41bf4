"""An engine metrics page with non-finite samples gives loads from its finite samples only (no I/O)."""

from __future__ import annotations

from kvmesh.core.load import from_vllm_metrics
from kvmesh.core.protocol import WorkerLoad


def test_non_finite_samples_are_skipped_and_the_finite_ones_kept() -> None:
    """``+Inf``, ``-Inf``, ``NaN`` and ``1e400`` samples are skipped; rank 1's finite running count stays."""
    text = (
        "vllm:num_requests_running +Inf\n"
        "vllm:num_requests_waiting 1e400\n"
        "vllm:kv_cache_usage_perc -Inf\n"
        "vllm:gpu_prefix_cache_hit_rate NaN\n"
        'vllm:num_requests_running{engine="1"} 2\n'
    )
    loads, counters = from_vllm_metrics(text, worker_id="w")
    assert loads == [WorkerLoad(worker_id="w", dp_rank=1, running=2)]
    assert counters == {}
