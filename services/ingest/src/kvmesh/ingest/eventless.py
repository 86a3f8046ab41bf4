"""An ingest for an engine that publishes no KV events (``kvmesh ingest --no-kv-events``): heartbeats only.

The worker is registered like any other (`kvmesh.ingest.registration`), with ``kv_events`` false and the
block size and KV capacity it was given; routers then count the prompts they sent it as its cache, at most
``kv_capacity_blocks`` per rank, least recently used out first. Nothing touches ZMQ or the events stream:
no SUB or replay socket, no cursor recovery, no announcement, no stream is created or published to.

What still runs, as with events:

* the registry heartbeat, its re-registration after an expiry, and the clean-stop removal;
* engine liveness with ``--health-url`` (probed once a rank has been quiet for ``--engine-probe-after-s``,
  that is all the time: an engine without events is never heard from otherwise). Without ``--health-url``
  the ranks are unprobed and never stale: silence proves nothing;
* ``--metrics-url``: the engine's load on ``kvmesh.load.<worker>``. A sleep shown there clears nothing: the
  index holds nothing of the worker, and a clear would go through the stream;
* the status reply (each rank's endpoint reads `kvmesh.ingest.status.NO_KV_EVENTS`), the health file and
  the Prometheus metrics (per-rank counters stay at 0).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from kvmesh.ingest.liveness import EngineWatch, ProbeTarget
from kvmesh.ingest.probes import fetch_metrics
from kvmesh.runtime import subjects
from kvmesh.runtime.metrics import start_metrics
from kvmesh.runtime.nats import close_quietly, connect, connect_options
from kvmesh.runtime.runner import supervise
from kvmesh.runtime.vllm_metrics import MetricsLoadPublisher

if TYPE_CHECKING:
    from kvmesh.ingest.service import IngestService

log = logging.getLogger("kvmesh.ingest")


async def run_eventless(svc: IngestService) -> None:
    """Register ``svc``'s worker and heartbeat (with liveness, load and status) until `IngestService.stop`."""
    s = svc.settings
    svc._nc = nc = await connect(s.nats_url, name=f"kvmesh-ingest-{s.worker_id}", **connect_options(s))
    svc.metrics = await start_metrics("ingest", s.metrics_port, svc._declare_metrics)
    js = nc.jetstream()
    svc.registration.js = js
    with contextlib.suppress(Exception):  # the registry bucket gets the stream's replicas where it exists
        info = await js.stream_info(s.stream)
        svc.registration.stream_replicas = info.config.num_replicas or s.stream_replicas
    status_sub = await nc.subscribe(f"{subjects.STATUS_SUBJECT}.ingest", cb=svc._on_status)
    if s.engine_probe_after_s > 0:
        svc._watch = EngineWatch(
            svc._ctx,
            worker_id=s.worker_id,
            targets={r: ProbeTarget(None, s.health_url) for r in s.local_ranks()},
            policy=s.liveness_policy(),
            probe_timeout_s=s.engine_probe_timeout_s,
            on_change=svc.registration.on_engine_change,
        )
    svc.registration.watch = svc._watch
    loops: dict[str, Coroutine[Any, Any, None]] = {"registry heartbeat": svc.registration.run()}
    if svc._watch is not None:
        loops["engine liveness"] = svc._watch.run()
    if s.metrics_url:
        scraper = MetricsLoadPublisher(nc, url=s.metrics_url, worker_id=s.worker_id, fetch=fetch_metrics)
        loops["engine metrics"] = scraper.run()
    svc.ready.set()
    log.info(
        "ingest %s: model %s, %d rank(s), no KV events: registered with heartbeats only (block size %s, "
        "%s KV blocks per rank), liveness %s, nothing published to %s",
        s.worker_id,
        s.model,
        len(s.local_ranks()),
        s.block_size,
        s.kv_capacity_blocks,
        s.health_url or "not probed",
        s.stream,
        extra={"worker_id": s.worker_id, "kv_events": False},
    )
    try:
        await supervise(nc, loops, stop=svc._stop, name=f"ingest {s.worker_id}", health_file=s.health_file)
    finally:
        with contextlib.suppress(Exception):
            await status_sub.unsubscribe()
        if svc._stop.is_set():  # a clean stop: leave the registry now
            await svc.registration.deregister()
        await close_quietly(nc)
        svc._ctx.destroy(linger=0)
        if svc.metrics is not None:
            await svc.metrics.aclose()
