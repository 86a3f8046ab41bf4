"""The router's start-up sync, its pure part: what a replica's answer holds and how an asker picks one.

A starting replica asks every peer on ``<requests_prefix>.sync`` (`kvmesh.router.peer_sync` does the I/O). A
peer answers with a `LedgerSnapshot` (its in-flight requests and sessions, cut to the server's
``max_payload``: `fitted_ledger`), then, to an asker that accepts parts (``Kvmesh-Sync-Parts: 1``), its
predicted entries as `PredictedSnapshot` parts (`plan_parts`, `slice_cache`), newest entries first. The asker
feeds every reply to a `SyncCollector`, which keeps the first peer whose answer is complete.

No I/O, no clock, no logging: the shell logs what these return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import msgspec

from kvmesh.core.errors import ProtocolError
from kvmesh.core.protocol import (
    SYNC_FROM_HEADER,
    SYNC_PARTS_HEADER,
    LedgerEntry,
    LedgerSnapshot,
    PredictedCache,
    SessionEntry,
    decode,
    encode,
)
from kvmesh.core.sessions import MAX_SESSION_ID_CHARS

__all__ = ["MAX_SYNC_PARTS", "SyncCollector", "fitted_ledger", "note_problem", "plan_parts", "slice_cache"]

MAX_SYNC_PARTS: Final[int] = 1 << 20
"""The most parts an asker waits for (a larger ``Kvmesh-Sync-Parts`` is read as this)."""
KEY_LIMIT: Final[int] = 1 << 64
_CACHE_BYTES: Final[int] = 64
"""Most msgpack bytes of a `PredictedCache` beside its keys, times and worker id."""


def note_problem(dp_rank: int, session_id: str | None, block_keys: list[int] | None) -> str | None:
    """What makes a `Routed` / `RouteNote` one no router sends (None: nothing): a negative rank, a session id
    outside 1 – 256 characters, a key outside [0, 2⁶⁴)."""
    if dp_rank < 0:
        return f"dp_rank {dp_rank} < 0"
    if session_id is not None and not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        return f"session_id of {len(session_id)} characters (1 to {MAX_SESSION_ID_CHARS})"
    if block_keys and not (min(block_keys) >= 0 and max(block_keys) < KEY_LIMIT):
        return "block_keys outside [0, 2**64)"
    return None


def fitted_ledger(
    entries: list[LedgerEntry], sessions: list[SessionEntry], limit: int
) -> tuple[bytes, tuple[int, int] | None]:
    """The snapshot of ``entries`` and ``sessions`` (least recently seen first) as msgpack, within ``limit``
    bytes (the server's ``max_payload``): past it, the least recently seen sessions are left out, then the
    oldest requests (a snapshot that does not fit would reach no one).

    Returns:
        the msgpack bytes, and (requests, sessions) kept when some were left out (None: all fit).
    """
    data = encode(LedgerSnapshot(entries=entries, sessions=sessions), format="msgpack")
    total = (len(entries), len(sessions))
    while len(data) > limit and (entries or sessions):
        keep = max(int(len(sessions if sessions else entries) * limit / len(data) * 0.95) - 1, 0)
        if sessions:
            sessions = sessions[len(sessions) - keep :]
        else:
            entries = entries[len(entries) - keep :]
        data = encode(LedgerSnapshot(entries=entries, sessions=sessions), format="msgpack")
    kept = (len(entries), len(sessions))
    return data, (kept if kept != total else None)


def plan_parts(sizes: list[tuple[str, int, bool]], limit: int) -> list[list[tuple[int, int, int]]]:
    """How predicted caches go into `PredictedSnapshot` parts of at most ``limit`` bytes each (the server's
    ``max_payload``), from each cache's ``(worker id, entries, with remaining times)``: per part,
    ``(cache index, start, end)`` slices of its keys. A cache too large for one part is cut into consecutive
    slices, its newest keys (the end of its list) in the first part, so an answer cut short keeps what is
    most likely still cached. Sizes come from the counts alone (at most 9 msgpack bytes a key and 9 a
    remaining time), so the plan is known before any entry is exported."""
    room = max(limit - 64, 1)
    plan: list[list[tuple[int, int, int]]] = []
    batch: list[tuple[int, int, int]] = []
    used = 0
    for i, (worker_id, count, timed) in enumerate(sizes):
        per_key = 18 if timed else 9
        fixed = _CACHE_BYTES + len(worker_id.encode())
        end = count
        while end > 0:
            if batch and used + fixed + per_key > room:
                plan.append(batch)
                batch, used = [], 0
            take = max(min(end, (room - used - fixed) // per_key), 1)
            batch.append((i, end - take, end))
            used += fixed + take * per_key
            end -= take
    if batch:
        plan.append(batch)
    return plan


def slice_cache(c: PredictedCache, start: int, end: int) -> PredictedCache:
    """``c`` with its keys (and remaining times) ``[start:end]``, bounds clamped to the keys it has."""
    start, end = max(start, 0), max(end, 0)
    if (start, end) == (0, len(c.keys)):
        return c
    return msgspec.structs.replace(
        c, keys=c.keys[start:end], remaining_s=None if c.remaining_s is None else c.remaining_s[start:end]
    )


@dataclass(slots=True)
class _Answer:
    snapshot: LedgerSnapshot
    expected: int
    parts: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class SyncCollector:
    """Every peer's replies to one sync request, until one peer's answer is complete.

    Every peer answers; the first whose answer is complete is taken. A peer whose first message does not
    decode as a `LedgerSnapshot` is ignored, so a broken or stalled peer does not hide a good one; at the
    timeout `most_complete` gives the best partial answer. A peer that sends one message without a
    ``Kvmesh-Sync-From`` header (a router before multi-part sync) gives a complete answer of one part.
    """

    heard: bool = False
    """Whether any reply came (a sync subject with subscribers that never answer stays False)."""
    undecodable: list[str] = field(default_factory=list)
    """Why each ignored peer's first message did not decode."""
    _answers: dict[str, _Answer] = field(default_factory=dict)
    _ignored: set[str] = field(default_factory=set)

    def no_responders(self, headers: dict[str, str]) -> bool:
        """Whether this reply is the server's "no responders" status (before any peer's reply)."""
        return not self.heard and SYNC_FROM_HEADER not in headers and headers.get("Status") == "503"

    def feed(self, headers: dict[str, str], data: bytes) -> tuple[LedgerSnapshot, list[bytes]] | None:
        """Take one reply; return ``(ledger, predicted part bodies)`` once its peer's answer is complete."""
        self.heard = True
        sender = headers.get(SYNC_FROM_HEADER, "")
        if sender in self._ignored:
            return None
        have = self._answers.get(sender)
        if have is not None:
            have.parts.append(data)
        else:
            try:
                snap = decode(data, LedgerSnapshot, format="msgpack")
            except ProtocolError as exc:
                self.undecodable.append(str(exc))
                if sender:  # a peer without an id sends one message: nothing more of it to ignore
                    self._ignored.add(sender)
                return None
            try:
                expected = min(max(int(headers.get(SYNC_PARTS_HEADER, "1")), 1), MAX_SYNC_PARTS)
            except ValueError:
                expected = 1
            have = self._answers[sender] = _Answer(snap, expected)
        if 1 + len(have.parts) >= have.expected:
            return have.snapshot, have.parts
        return None

    def most_complete(self) -> tuple[LedgerSnapshot, list[bytes], int] | None:
        """The answer with the most parts so far: ``(ledger, part bodies, parts expected in all)``; None when
        no peer's ledger decoded."""
        if not self._answers:
            return None
        best = max(self._answers.values(), key=lambda a: len(a.parts))
        return best.snapshot, best.parts, best.expected
