"""How far the router's answers can be trusted, sans I/O: replica lag, route mode and each holder's health.

* `LagMeter` — the local replica's lag behind the stream, from the stream's last sequence as read every
  `kvmesh.router.local_index.LAG_CHECK_S` and the replica's applied sequence;
* `index_mode` — the router's own mode before any holder is chosen: ``exact``, ``degraded`` (the replica
  lags beyond the bounds) or ``load_only`` (the replica is catching up or rebuilding: overlaps are ignored);
* `holder_state` — one holder's state in explain: ``exact``, ``incomplete`` (its history was lost) or
  ``stale`` (the replica lags, or its worker's heartbeat is late);
* `holders_status` — every holder that is not exact, for the router's status.

Times are passed in: ``now`` is monotonic seconds, ``wall`` seconds since the epoch (heartbeat times are
the ingest's wall clock).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvmesh.core.index import Holder
from kvmesh.core.protocol import HolderStatus
from kvmesh.core.route import CandidateLike

MAX_HOLDERS_LISTED = 100
"""Non-exact holders listed by name in the router's status (the rest are counted)."""

HolderState = tuple[str, str | None]
"""A holder's state and why: ``("exact", None)``, ``("incomplete", reason)``, ``("stale", reason)`` or
``("predicted", reason)`` (a worker without KV events: its overlap is the routers' record of their routes)."""
PREDICTED_REASON = (
    "no_kv_events: the overlap is what the routers sent this worker (kvmesh ingest --no-kv-events)"
)


class RecordLike(Protocol):
    """A worker's registry record (`kvmesh.core.protocol.WorkerRecord`), as far as the router reads it."""

    @property
    def model(self) -> str: ...
    @property
    def dp_ranks(self) -> int: ...
    @property
    def block_size(self) -> int | None: ...
    @property
    def heartbeat_ts(self) -> float: ...
    @property
    def stale_ranks(self) -> Mapping[int, str]: ...
    @property
    def kv_capacity_blocks(self) -> int | None: ...
    @property
    def kv_events(self) -> bool: ...


class LagMeter:
    """The local replica's lag behind its stream.

    Cost: `note` is O(1); `lag` is amortised O(1) (each noted sequence is dropped once the replica passed it).
    At most 1,024 sequences are kept (the oldest first go; the lag in seconds is then a lower bound).
    """

    def __init__(self) -> None:
        self.stream_last_seq = 0
        """The stream's last sequence as last read."""
        self._polls: collections.deque[tuple[float, int]] = collections.deque(maxlen=1024)

    def note(self, last_seq: int, now: float) -> None:
        """Record that the stream's last sequence was ``last_seq`` at monotonic time ``now``."""
        self.stream_last_seq = last_seq
        if not self._polls or self._polls[-1][1] < last_seq:
            self._polls.append((now, last_seq))

    def lag(self, applied_seq: int, now: float) -> tuple[int, float]:
        """Return how far a replica that applied ``applied_seq`` is behind the stream: (messages, seconds).

        Messages: the stream's last sequence as last read minus ``applied_seq`` (0 when ahead, e.g. a
        re-created stream being rebuilt). Seconds: how long ago the stream was first seen holding a message
        the replica has still not applied (0.0 when none; precise to the interval between two `note` calls).
        """
        polls = self._polls
        while polls and polls[0][1] <= applied_seq:
            polls.popleft()
        seconds = max(0.0, now - polls[0][0]) if polls else 0.0
        return max(0, self.stream_last_seq - applied_seq), seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexView:
    """The local replica as the route mode sees it at one moment."""

    caught_up: bool
    """Whether it has applied the stream as far as it was when it (re)started."""
    rebuilding: bool
    """Whether it was rebuilt from a re-created stream at least once."""
    lag_messages: int
    lag_s: float


def index_mode(view: IndexView | None, *, max_lag_messages: int, max_lag_s: float) -> tuple[str, str | None]:
    """Return the router's own mode and why (None when exact); ``view`` None: no local replica (exact)."""
    if view is None:
        return "exact", None
    if not view.caught_up:
        why = "rebuilding the index (the stream was re-created)" if view.rebuilding else "catching up"
        return "load_only", f"no trustworthy index: the local replica is {why}; routing on load alone"
    messages, seconds = view.lag_messages, view.lag_s
    if messages > max_lag_messages or seconds > max_lag_s:
        return "degraded", (
            f"replica_lag: the local index lags the stream by {messages} messages and {seconds:.1f} s "
            f"(bounds {max_lag_messages} messages, {max_lag_s:g} s)"
        )
    return "exact", None


def heartbeat_late_after(setting_s: float, registry_ttl_s: Any) -> float:
    """Return the heartbeat age in seconds at which a holder is stale (0: off or not known yet).

    ``setting_s`` is ``--heartbeat-late-s``: > 0 as it is, < 0 off, 0 two heartbeat intervals (2/3 of the
    registry bucket's TTL ``registry_ttl_s``, when that is a positive number).
    """
    if setting_s != 0:
        return max(setting_s, 0.0)
    ttl = registry_ttl_s
    return 2 * ttl / 3 if isinstance(ttl, float | int) and ttl > 0 else 0.0


def holder_state(
    c: CandidateLike,
    *,
    lagging: bool,
    records: Mapping[str, RecordLike] | None,
    heartbeat_late_s: float,
    wall: float,
) -> HolderState:
    """Return one holder's state: incomplete (the index lost its history: `Candidate.health`), stale (the
    replica lags: ``lagging``; or its worker's heartbeat in ``records`` is older than ``heartbeat_late_s``),
    predicted (its worker publishes no KV events), else exact."""
    if c.health is not None:
        return "incomplete", c.health
    if lagging:
        return "stale", "replica_lag"
    if heartbeat_late_s > 0 and records is not None:
        rec = records.get(c.worker_id)
        if rec is not None and rec.heartbeat_ts > 0 and wall - rec.heartbeat_ts > heartbeat_late_s:
            return "stale", f"heartbeat_late: last heartbeat {wall - rec.heartbeat_ts:.1f} s ago"
    if records is not None:
        rec = records.get(c.worker_id)
        if rec is not None and not rec.kv_events:
            return "predicted", PREDICTED_REASON
    return "exact", None


def holders_status(
    holder_health: Mapping[Holder, str] | None,
    records: Iterable[tuple[str, RecordLike]] | None,
    *,
    heartbeat_late_s: float,
    wall: float,
) -> tuple[dict[str, HolderStatus], int]:
    """Return every holder that is not exact and how many there are.

    Args:
        holder_health: the local index's incomplete holders and why (None: no local index).
        records: the registry's (worker id, record)s, sorted by worker id (None: no registry watcher).
        heartbeat_late_s: heartbeat age at which a worker's holders are stale (0: off).
        wall: seconds since the epoch.

    Returns:
        ``"worker/rank"`` → state and reason, at most `MAX_HOLDERS_LISTED` (a worker whose heartbeat is late
        is ``"worker/*"``), each once; and how many there are in all.
    """
    out: dict[str, HolderStatus] = {}
    total = 0

    def add(worker: str, rank: int | str, state: str, reason: str) -> None:
        nonlocal total
        key = f"{worker}/{rank}"
        if key in out:
            return
        total += 1
        if len(out) < MAX_HOLDERS_LISTED:
            out[key] = HolderStatus(state=state, reason=reason)

    for (w, r), reason in (holder_health or {}).items():
        add(w, r, "incomplete", reason)
    for w, rec in records or ():
        for r, reason in sorted(rec.stale_ranks.items()):
            if 0 <= r < rec.dp_ranks:
                add(w, r, "stale", f"engine_silent: {reason}")
        if heartbeat_late_s > 0 and rec.heartbeat_ts > 0 and wall - rec.heartbeat_ts > heartbeat_late_s:
            add(w, "*", "stale", f"heartbeat_late: last heartbeat {wall - rec.heartbeat_ts:.1f} s ago")
    return out, total
