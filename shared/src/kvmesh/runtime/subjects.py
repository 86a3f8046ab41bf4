"""NATS subject and stream names: the only place they are spelled.

Model and worker names become subject tokens through `token()`, which keeps ``[A-Za-z0-9_-]`` and escapes
every other byte as ``~XX`` (hex), so ``meta-llama/Llama-3.1-8B`` is one token and never adds a level.
"""

from __future__ import annotations

from typing import Final

STREAM: Final[str] = "KVMESH_EVENTS"
EVENTS_PREFIX: Final[str] = "kvmesh.events"
ROUTE_SUBJECT: Final[str] = "kvmesh.route"
MATCH_SUBJECT: Final[str] = "kvmesh.index.match"
STATUS_SUBJECT: Final[str] = "kvmesh.index.status"
SIM_PREFIX: Final[str] = "kvmesh.sim"
ROUTER_QUEUE: Final[str] = "kvmesh-router"
INDEXER_QUEUE: Final[str] = "kvmesh-indexer"

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def token(name: str) -> str:
    """Escape a name into one subject token (reversible with `untoken`)."""
    raw = name.encode("utf-8")
    if raw and all(b in _SAFE for b in raw):
        return name
    return "".join(chr(b) if b in _SAFE else f"~{b:02X}" for b in raw) or "~"


def untoken(tok: str) -> str:
    """Reverse `token`."""
    if "~" not in tok:
        return tok
    out = bytearray()
    i = 0
    while i < len(tok):
        if tok[i] == "~":
            if tok[i + 1 : i + 3]:
                out.append(int(tok[i + 1 : i + 3], 16))
            i += 3
        else:
            out.append(ord(tok[i]))
            i += 1
    return out.decode("utf-8")


def events_subject(prefix: str, model: str, worker_id: str, dp_rank: int) -> str:
    """Subject of one (worker, dp_rank)'s events: ``<prefix>.<model>.<worker>.<dp_rank>``.

    The rank is its own token so an ingest can recover each rank's cursor with one last-message lookup.
    """
    return f"{prefix}.{token(model)}.{token(worker_id)}.{dp_rank}"


def events_wildcard(prefix: str) -> str:
    """Subject filter covering every events subject under ``prefix``."""
    return f"{prefix}.>"


def control_subject(prefix: str) -> str:
    """Subject of control messages (worker removal) inside the same stream."""
    return f"{prefix}._control"


def sim_subject(worker_id: str) -> str:
    """Request subject of a simulated worker's generate endpoint."""
    return f"{SIM_PREFIX}.{token(worker_id)}.generate"


REQUESTS_PREFIX: Final[str] = "kvmesh.requests"
"""Request lifecycle (router load accounting): ``<prefix>.routed|prefill_done|finished`` and ``<prefix>.sync``."""
LOAD_PREFIX: Final[str] = "kvmesh.load"
"""Engine-reported load: ``<prefix>.<worker>`` (JSON `kvmesh.core.load.WorkerLoad`)."""


def requests_subject(prefix: str, event: str) -> str:
    """Subject of one request lifecycle event (``routed``, ``prefill_done``, ``finished``, ``sync``)."""
    return f"{prefix}.{event}"


def load_subject(prefix: str, worker_id: str) -> str:
    """Subject on which one worker's engine load is published."""
    return f"{prefix}.{token(worker_id)}"


SNAPSHOT_SUBJECT: Final[str] = "kvmesh.index.snapshot"
"""Ask indexer replicas to write a snapshot now (`kvmesh snapshot`); the lease holder does."""


def snapshot_bucket(stream: str) -> str:
    """Object Store bucket of one index group's snapshots (the group is the events stream)."""
    return f"{stream}_SNAPSHOTS"


def lease_bucket(stream: str) -> str:
    """KV bucket holding the snapshot-writer lease of one index group."""
    return f"{stream}_LEASE"


def registry_bucket(stream: str) -> str:
    """KV bucket of the worker registry (one key per worker, TTL heartbeats)."""
    return f"{stream}_WORKERS"


def kv_key(name: str) -> str:
    """Escape a name into one KV key (`token` with ``=`` for ``~``, which KV keys do not allow)."""
    return token(name).replace("~", "=")


def from_kv_key(key: str) -> str:
    """Reverse `kv_key`."""
    return untoken(key.replace("=", "~"))
