"""The ingest's engine watch: probes silent engine ranks and reports which are stale or gone.

The async shell around `kvmesh.core.liveness`: the ingest calls `EngineWatch.heard` whenever a rank's
sockets deliver something (a live burst, a replay reply); `EngineWatch.run` probes a rank once it has been
silent for the policy's bound (its replay socket with `kvmesh.ingest.probes.probe_replay`, or the
engine's HTTP page with `probe_http` when it has no replay socket) and calls ``on_change`` on every change
of state. A rank with neither probe target is never judged: silence alone proves nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq.asyncio

from kvmesh.core.liveness import EngineLiveness, LivenessChange, LivenessPolicy
from kvmesh.ingest.probes import probe_http, probe_replay

log = logging.getLogger("kvmesh.ingest")


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    """Where a rank's liveness is probed: its replay ROUTER, else an HTTP URL (None: not probed)."""

    replay_endpoint: str | None
    http_url: str | None


class EngineWatch:
    """Liveness of every rank of one engine.

    Args:
        ctx: ZMQ context for the replay probes.
        worker_id: the worker, for log lines.
        targets: endpoint rank → where to probe it.
        policy: the bounds (`kvmesh.core.liveness.LivenessPolicy`).
        probe_timeout_s: seconds one probe may take.
        on_change: called with (rank, change) on every change of a rank's state.
        clock: monotonic seconds (the event loop's clock by default).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        worker_id: str,
        targets: dict[int, ProbeTarget],
        policy: LivenessPolicy,
        probe_timeout_s: float,
        on_change: Callable[[int, LivenessChange], None],
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._ctx = ctx
        self._worker_id = worker_id
        self._targets = {r: t for r, t in targets.items() if t.replay_endpoint or t.http_url}
        self._policy = policy
        self._timeout_s = probe_timeout_s
        self._on_change = on_change
        self._clock = clock or asyncio.get_running_loop().time
        now = self._clock()
        self.ranks = {r: EngineLiveness(policy, now) for r in self._targets}
        """Endpoint rank → its liveness (only ranks that can be probed)."""

    def heard(self, rank: int) -> None:
        """Record that the rank's engine delivered something just now (cheap; call once per burst)."""
        live = self.ranks.get(rank)
        if live is not None:
            self._report(rank, live.on_heard(self._clock()))

    def stale_ranks(self) -> dict[int, str]:
        """Endpoint rank → why, for every rank that is stale or gone."""
        return {r: live.reason for r, live in self.ranks.items() if live.state != "live"}

    def all_gone(self) -> bool:
        """True when there are probed ranks and every one of them is gone."""
        return bool(self.ranks) and all(live.state == "gone" for live in self.ranks.values())

    def _report(self, rank: int, change: LivenessChange | None) -> None:
        if change is None:
            return
        at = {"worker_id": self._worker_id, "dp_rank": rank, "state": change.state}
        if change.state == "live":
            log.warning(
                "worker %s rank %d: engine answers again (was %s)",
                self._worker_id,
                rank,
                change.previous,
                extra=at | {"was": change.previous},
            )
        elif change.state == "stale":
            msg = "worker %s rank %d: engine stale: %s"
            log.error(msg, self._worker_id, rank, change.reason, extra=at | {"reason": change.reason})
        else:
            msg = "worker %s rank %d: engine gone: %s"
            log.error(msg, self._worker_id, rank, change.reason, extra=at | {"reason": change.reason})
        self._on_change(rank, change)

    async def _probe(self, rank: int) -> tuple[bool, str]:
        target = self._targets[rank]
        if target.replay_endpoint is not None:
            return await probe_replay(self._ctx, target.replay_endpoint, timeout_s=self._timeout_s)
        assert target.http_url is not None
        return await probe_http(target.http_url, timeout_s=self._timeout_s)

    async def run(self) -> None:
        """Probe silent ranks until cancelled."""
        if not self.ranks:
            return
        step = min(0.5, self._policy.probe_every_s / 2, self._policy.probe_after_s / 2)
        while True:
            await asyncio.sleep(step)
            now = self._clock()
            due = [r for r, live in self.ranks.items() if live.probe_due(now)]
            for r, live in self.ranks.items():
                if r not in due:
                    self._report(r, live.tick(now))
            if not due:
                continue
            results = await asyncio.gather(*(self._probe(r) for r in due))
            now = self._clock()
            for r, (answered, detail) in zip(due, results, strict=True):
                self._report(r, self.ranks[r].on_probe_result(now, answered=answered, detail=detail))
