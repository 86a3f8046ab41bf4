"""Cache losses an engine shows on its Prometheus page before it publishes them: vLLM's sleep.

vLLM drops its whole prefix cache when it goes to sleep (``POST /sleep``, level ≥ 1, and
``release_kv_cache_memory``) but publishes the AllBlocksCleared only at its next engine step, after it wakes
up: while it sleeps, and for as long as it stays idle after, the index offers the routers blocks the engine no
longer holds. vLLM 0.32 exports the state on ``/metrics`` as the gauge

```
vllm:engine_sleep_state{engine="0",model_name="M",sleep_state="awake"} 0.0              (1.0 awake)
vllm:engine_sleep_state{engine="0",model_name="M",sleep_state="weights_offloaded"} 1.0  (level 1)
vllm:engine_sleep_state{engine="0",model_name="M",sleep_state="discard_all"} 0.0        (level 2)
```

one set per engine core (``engine`` is its data-parallel rank). With ``--metrics-url`` the ingest already
scrapes that page every second for the engine's load (`kvmesh.runtime.vllm_metrics.MetricsLoadPublisher`);
`SleepWatch` reads the same text: a rank seen asleep (on the first scrape, or after being seen awake) is
cleared as an AllBlocksCleared would clear it, with a Cleared("sleep") through the stream, counted per rank
(`kvmesh_ingest_engine_sleep_clears_total`) and logged with the worker and rank. A rank whose engine
published an AllBlocksCleared while the page was being fetched is left alone: that clear is the engine's own,
and one made after it would also drop the blocks the engine stored since.

Not visible there: ``POST /reset_prefix_cache`` changes no metric in vLLM 0.32 (``vllm:prefix_cache_queries``
and ``hits`` keep counting; ``PrefixCacheStats.reset`` only restarts the logger's local hit rate), so a reset is
seen through the AllBlocksCleared of the engine's next step alone. SGLang's metrics
(``sglang/srt/metrics/collector.py``) have no sleep or cache-flush series: neither ``/flush_cache`` nor
``/release_memory_occupation`` shows on its ``/metrics``.

`sleeping_ranks` and `SleepPolicy` are pure; `SleepWatch` touches the ingest's ranks and `fetch` does the I/O.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from kvmesh.core.load import decode_prometheus_text
from kvmesh.ingest.batches import Rank
from kvmesh.ingest.probes import fetch_metrics

log = logging.getLogger("kvmesh.ingest")

VLLM_SLEEP_STATE: Final[str] = "vllm:engine_sleep_state"
"""vLLM's sleep gauge; its ``sleep_state="awake"`` sample is 1 while the engine is awake, 0 while it sleeps."""
SLEEP_REASON: Final[str] = "sleep"
"""The reason of the Cleared an engine's sleep publishes."""


def sleeping_ranks(text: str) -> dict[int, bool]:
    """Engine rank → asleep, from a vLLM ``/metrics`` page (ranks without the gauge are absent).

    Args:
        text: Prometheus text exposition.

    Returns:
        ``{rank: True}`` for each ``engine`` label whose ``sleep_state="awake"`` sample is 0, ``False`` where it
        is not; a sample without an ``engine`` label is rank 0; one with a label that is not an integer, or a
        value that is not finite, is skipped.
    """
    out: dict[int, bool] = {}
    for _name, labels, value in decode_prometheus_text(text, (VLLM_SLEEP_STATE,)):
        if labels.get("sleep_state") != "awake" or not math.isfinite(value):
            continue
        try:
            rank = int(labels.get("engine", "0"))
        except ValueError:
            continue
        out[rank] = out.get(rank, False) or value < 0.5
    return out


class SleepPolicy:
    """Which engine ranks fell asleep since the last page (pure: fed pages' `sleeping_ranks`)."""

    def __init__(self) -> None:
        self.asleep: dict[int, bool] = {}
        """Engine rank → asleep, as the last page that reported it said."""

    def observe(self, states: Mapping[int, bool]) -> list[int]:
        """Record one page's states; return the ranks (sorted) seen asleep now and not on the page before.

        A rank first seen asleep counts: its engine slept before this ingest read the page, and its cache is
        empty whatever the index holds.
        """
        fell = sorted(r for r, asleep in states.items() if asleep and not self.asleep.get(r, False))
        self.asleep.update(states)
        return fell


class SleepWatch:
    """Clears the ranks an engine's metrics page shows asleep.

    Args:
        worker_id: the worker, for log lines.
        ranks: endpoint rank → `Rank`, the ingest's own map (read when a page arrives).
        clear: ``clear(rank, reason)``, the ingest's `kvmesh.ingest.batches.Batches.enqueue_clear`.
        fetch: ``async (url, timeout_s) -> text``; `kvmesh.ingest.probes.fetch_metrics` by default.
    """

    def __init__(
        self,
        *,
        worker_id: str,
        ranks: Mapping[int, Rank],
        clear: Callable[[Rank, str], None],
        fetch: Callable[[str, float], Awaitable[str]] = fetch_metrics,
    ) -> None:
        self.worker_id = worker_id
        self._ranks = ranks
        self._clear = clear
        self._fetch = fetch
        self.policy = SleepPolicy()
        self.clears: dict[int, int] = {}
        """Holder dp_rank → Cleared("sleep") messages enqueued."""
        self.skipped: dict[int, int] = {}
        """Holder dp_rank → sleeps not cleared because the engine's own AllBlocksCleared came meanwhile."""

    def _cleared_events(self) -> dict[int, int]:
        return {r.holder: r.normalizer.stats.cleared_events for r in self._ranks.values()}

    async def fetch(self, url: str, timeout_s: float) -> str:
        """Fetch the page (for `MetricsLoadPublisher`, whose ``fetch`` this is), act on it, return its text.

        Raises:
            OSError, TimeoutError, http.client.HTTPException: as `kvmesh.ingest.probes.fetch_metrics`.
        """
        before = self._cleared_events()
        text = await self._fetch(url, timeout_s)
        self.on_page(text, before)
        return text

    def on_page(self, text: str, before: Mapping[int, int] | None = None) -> list[int]:
        """Act on one page: clear every rank newly seen asleep; return the holder ranks cleared.

        ``before`` holds each holder's count of engine AllBlocksCleared when the page was asked for; a rank whose
        count grew since is not cleared again (see the module docstring).
        """
        fell = self.policy.observe(sleeping_ranks(text))
        if not fell:
            return []
        now = self._cleared_events()
        by_holder = {r.holder: r for r in self._ranks.values()}
        done: list[int] = []
        for holder in fell:
            rank = by_holder.get(holder)
            if rank is None:
                log.warning(
                    "worker %s: metrics report engine rank %d asleep, a rank this ingest does not read",
                    self.worker_id,
                    holder,
                    extra={"worker_id": self.worker_id, "dp_rank": holder},
                )
                continue
            at = {"worker_id": self.worker_id, "dp_rank": holder, "reason": SLEEP_REASON}
            if before is not None and now.get(holder, 0) > before.get(holder, 0):
                self.skipped[holder] = self.skipped.get(holder, 0) + 1
                log.info(
                    "worker %s rank %d: engine asleep; its own AllBlocksCleared already came",
                    self.worker_id,
                    holder,
                    extra=at,
                )
                continue
            self._clear(rank, SLEEP_REASON)
            self.clears[holder] = self.clears.get(holder, 0) + 1
            done.append(holder)
            log.warning(
                "worker %s rank %d: engine went to sleep (its metrics say so) and dropped its cache; "
                "worker rank cleared",
                self.worker_id,
                holder,
                extra=at,
            )
        return done
