"""Session affinity: which (worker, dp rank) each session's last request was routed to (pure).

A route request may carry a ``session_id`` (a conversation, an agent's run: any string the caller keeps for
related requests). Every router replica records where each session's requests went, from its own answers
and from the ``routed`` / ``noted`` notes of the others, and the decision keeps a session on that
(worker, dp rank) while its cost is within `kvmesh.core.route.Policy.session_slack` of the best
(`kvmesh.core.route.rank`'s ``session``). SGLang's gateway and llm-d offer the same kind of stickiness; kvmesh
keeps it cost-bounded, so a loaded worker still sheds a session.

The table is bounded twice: a session not seen for ``ttl_s`` seconds is forgotten, and past ``max_sessions``
the least recently seen session goes first. Times are the caller's monotonic seconds (no clock is read here).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import Final

from kvmesh.core.index import Holder

__all__ = ["MAX_SESSIONS", "MAX_SESSION_ID_CHARS", "SESSION_TTL_S", "SessionTable"]

SESSION_TTL_S: Final[float] = 1800.0
"""Default idle time (seconds) after which a session's worker is forgotten."""
MAX_SESSIONS: Final[int] = 100_000
"""Default bound on the sessions a replica remembers (about 200 bytes each)."""
MAX_SESSION_ID_CHARS: Final[int] = 256
"""Longest ``session_id`` a route request may carry (longer ones are refused as bad requests)."""


class SessionTable:
    """``session_id`` → the (worker, dp rank) its last request was routed to, and when.

    Args:
        ttl_s: idle seconds after which a session is forgotten, > 0 (``math.inf``: never).
        max_sessions: sessions kept, ≥ 1; past it the least recently seen session is forgotten.

    Raises:
        ValueError: a bound out of range.
    """

    __slots__ = ("_seen", "max_sessions", "ttl_s")

    def __init__(self, *, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS) -> None:
        if not ttl_s > 0 or math.isnan(ttl_s):
            raise ValueError(f"session ttl_s must be > 0, got {ttl_s!r}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be ≥ 1, got {max_sessions!r}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._seen: OrderedDict[str, tuple[Holder, float]] = OrderedDict()
        """Least recently seen first: session → (holder, seen at)."""

    def __len__(self) -> int:
        return len(self._seen)

    def get(self, session_id: str, now_s: float) -> Holder | None:
        """Return where ``session_id`` was last routed, or None (unknown, or idle for ``ttl_s`` or more)."""
        entry = self._seen.get(session_id)
        if entry is None:
            return None
        holder, seen_s = entry
        if now_s - seen_s >= self.ttl_s:
            del self._seen[session_id]
            return None
        return holder

    def note(self, session_id: str, holder: Holder, now_s: float) -> None:
        """Record that ``session_id``'s latest request went to ``holder`` at ``now_s`` (the latest note wins,
        whichever replica sent it); forget the least recently seen session past ``max_sessions``."""
        seen = self._seen
        seen[session_id] = (holder, now_s)
        seen.move_to_end(session_id)
        while len(seen) > self.max_sessions:
            seen.popitem(last=False)

    def expire(self, now_s: float) -> int:
        """Forget the sessions idle for ``ttl_s`` or more; return how many.

        Sessions are kept in the order they were last noted, so this stops at the first fresh one (notes from
        another replica may arrive slightly out of time order: such a session is dropped on its next `get`).
        """
        seen, dropped = self._seen, 0
        while seen:
            _sid, (_h, seen_s) = next(iter(seen.items()))
            if now_s - seen_s < self.ttl_s:
                break
            seen.popitem(last=False)
            dropped += 1
        return dropped

    def forget_worker(self, worker_id: str) -> int:
        """Forget every session last routed to ``worker_id`` (the worker was removed); return how many."""
        gone = [sid for sid, (h, _t) in self._seen.items() if h.worker_id == worker_id]
        for sid in gone:
            del self._seen[sid]
        return len(gone)

    def entries(self, now_s: float) -> list[tuple[str, Holder, float]]:
        """Return every live session as (session id, holder, idle seconds), least recently seen first (what a
        starting replica is sent)."""
        return [(sid, h, now_s - t) for sid, (h, t) in self._seen.items() if now_s - t < self.ttl_s]

    def restore(self, entries: Iterable[tuple[str, Holder, float]], now_s: float) -> int:
        """Add a peer's sessions (session id, holder, idle seconds) this table does not know yet; return how
        many were added. Sessions already noted here (seen live since start-up) are kept as they are."""
        seen, added = self._seen, 0
        for sid, holder, idle_s in entries:
            if sid in seen or not 0 <= idle_s < self.ttl_s:
                continue
            seen[sid] = (holder, now_s - idle_s)
            added += 1
        if added:  # keep least recently seen first, then the bound
            self._seen = OrderedDict(sorted(seen.items(), key=lambda kv: kv[1][1]))
            while len(self._seen) > self.max_sessions:
                self._seen.popitem(last=False)
        return added
