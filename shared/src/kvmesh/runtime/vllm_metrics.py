"""Engine load from Prometheus ``/metrics`` to NATS: scrape vLLM, publish ``kvmesh.load.<worker>``.

`MetricsLoadPublisher` fetches a vLLM metrics page every ``interval_s`` seconds, turns it into one
`kvmesh.core.load.WorkerLoad` per DP rank (`kvmesh.core.load.from_vllm_metrics`: running and waiting
requests, KV-cache usage, prefix-cache hit rate) and publishes each as JSON on
``<load_prefix>.<worker>``, where every router replica keeps it for its load TTL. Any process can publish
there (an ingest with ``--metrics-url``, a sidecar, the engine itself); `publish_load` is the one-shot form.

A failed scrape (connection refused, HTTP error, timeout) is counted and logged once per failure streak; the
loop keeps going and routers simply stop seeing the worker's load once it is stale. The HTTP fetch uses the
standard library in a worker thread (one request per interval; no extra dependency).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.aio.client import Client

from kvmesh.core.load import PrefixCounters, from_vllm_metrics
from kvmesh.core.protocol import WorkerLoad
from kvmesh.runtime import subjects

log = logging.getLogger("kvmesh.runtime.vllm_metrics")

_json = msgspec.json.Encoder()


async def publish_load(nc: Client, load: WorkerLoad, *, prefix: str = subjects.LOAD_PREFIX) -> None:
    """Publish one engine load report on ``<prefix>.<worker>``."""
    await nc.publish(subjects.load_subject(prefix, load.worker_id), _json.encode(load))


def fetch_text(url: str, timeout_s: float) -> str:
    """GET ``url`` and return its body as text (blocking; run it in a thread).

    Raises:
        OSError: connection or HTTP failure (``urllib.error.URLError`` is an OSError).
        http.client.HTTPException: an answer that is not HTTP, or one cut off (``IncompleteRead``).
    """
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        body: bytes = resp.read()
    return body.decode("utf-8", "replace")


@dataclass(slots=True)
class ScrapeStats:
    """Counters of a `MetricsLoadPublisher`."""

    scrapes: int = 0
    failures: int = 0
    published: int = 0


class MetricsLoadPublisher:
    """Scrape one engine's Prometheus endpoint and publish its load, every ``interval_s`` seconds.

    Args:
        nc: a connected NATS client.
        url: the engine's metrics URL (``http://host:8000/metrics``).
        worker_id: the worker the engine is (the load subject's last token).
        model: only samples labelled with this ``model_name`` (or unlabelled) count; None for all.
        interval_s: seconds between scrapes (> 0); keep it well below the routers' load TTL (10 s).
        timeout_s: seconds one scrape may take.
        prefix: the load subject prefix.
        fetch: ``async (url, timeout_s) -> text``; the default GETs with urllib in a thread (tests swap it).
    """

    def __init__(
        self,
        nc: Client,
        *,
        url: str,
        worker_id: str,
        model: str | None = None,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        prefix: str = subjects.LOAD_PREFIX,
        fetch: Callable[[str, float], Awaitable[str]] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self._nc = nc
        self.url = url
        self.worker_id = worker_id
        self.model = model
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.prefix = prefix
        self._fetch = fetch or self._default_fetch
        self._counters: dict[int, PrefixCounters] = {}
        self.stats = ScrapeStats()
        self.last: list[WorkerLoad] = []

    @staticmethod
    async def _default_fetch(url: str, timeout_s: float) -> str:
        return await asyncio.to_thread(fetch_text, url, timeout_s)

    async def scrape_once(self) -> list[WorkerLoad]:
        """Scrape the page once and publish every rank's load; return the loads published.

        Raises:
            OSError: the page could not be fetched (also `TimeoutError`).
            http.client.HTTPException: the answer was not HTTP or was cut off (``IncompleteRead``).
        """
        text = await asyncio.wait_for(self._fetch(self.url, self.timeout_s), self.timeout_s + 1.0)
        self.stats.scrapes += 1
        loads, self._counters = from_vllm_metrics(
            text, worker_id=self.worker_id, model=self.model, previous=self._counters
        )
        for load in loads:
            await publish_load(self._nc, load, prefix=self.prefix)
        self.stats.published += len(loads)
        self.last = loads
        return loads

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Scrape and publish until ``stop`` is set (or the task is cancelled); never raises on a bad scrape."""
        stop = stop or asyncio.Event()
        failing = False
        while not stop.is_set():
            try:
                await self.scrape_once()
                if failing:
                    log.info("metrics %s: scraping again", self.url)
                failing = False
            except (OSError, TimeoutError, ValueError, http.client.HTTPException, nats.errors.Error) as exc:
                # HTTPException: a page cut off mid-body or a port that does not speak HTTP (not an OSError)
                self.stats.failures += 1
                if not failing:
                    log.warning("metrics %s: scrape failed: %s", self.url, exc)
                failing = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
