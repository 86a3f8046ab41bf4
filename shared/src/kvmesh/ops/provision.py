"""``kvmesh provision``: create an index group's JetStream resources ahead of the services.

A deployment with least-privilege credentials (``deploy/nats/``) lets no service create streams or buckets:
an operator (or a one-shot job, as in ``docker-compose.yml``) creates them once, at the replica count the
cluster should keep (R3 on a 3-node cluster), with the settings the services would have used:

- the events stream (``KVMESH_EVENTS``; subjects ``<prefix>.>``, the ingest's `StreamSettings` defaults);
- the worker registry KV bucket (``<stream>_WORKERS``, max age = the worker TTL, expiry markers on);
- the snapshot-writer lease KV bucket (``<stream>_LEASE``, max age = the lease TTL);
- the snapshot Object Store (``<stream>_SNAPSHOTS``).

What already exists is left as it is and reported (``created: false``); a resource whose replica count is not
the one asked for is listed in ``mismatched`` (scaling an existing stream is the operator's decision).
"""

from __future__ import annotations

import asyncio
from typing import Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client

from kvmesh.core.errors import StreamUnavailableError, TransportError
from kvmesh.runtime import subjects
from kvmesh.runtime.nats import StreamSettings, ensure_stream, transport_error
from kvmesh.runtime.registry import RegistrySettings, open_registry
from kvmesh.runtime.snapshots import (
    DEFAULT_STREAM_MAX_AGE_S,
    DEFAULT_STREAM_MAX_BYTES,
    SnapshotStore,
    open_kv,
)

__all__ = ["ProvisionResult", "Resource", "provision"]

Kind = Literal["stream", "kv", "object_store"]


class Resource(msgspec.Struct, frozen=True, kw_only=True):
    """One JetStream resource of the index group after provisioning."""

    name: str
    """Its name: the stream, or the bucket (its backing stream is ``KV_<name>`` / ``OBJ_<name>``)."""
    kind: Kind
    replicas: int
    """Replica count the server reports for it."""
    created: bool
    """True when this call created it; false when it already existed."""


class ProvisionResult(msgspec.Struct, frozen=True, kw_only=True):
    """What ``kvmesh provision`` found or created."""

    stream: str
    replicas: int
    """The replica count asked for."""
    resources: tuple[Resource, ...]
    mismatched: tuple[str, ...] = ()
    """One line per existing resource whose replica count differs from ``replicas``."""


def _backing_stream(name: str, kind: Kind) -> str:
    return {"stream": name, "kv": f"KV_{name}", "object_store": f"OBJ_{name}"}[kind]


async def _replicas(nc: Client, stream: str) -> int | None:
    """The replica count of ``stream``, or None when it does not exist."""
    try:
        info = await nc.jetstream().stream_info(stream)
    except nats.js.errors.NotFoundError:
        return None
    return int(info.config.num_replicas or 1)


async def _until_jetstream(nc: Client, timeout_s: float) -> None:
    """Wait until JetStream answers (a cluster's meta leader is elected); bounded by ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            await nc.jetstream().account_info()
            return
        except (nats.errors.Error, TimeoutError) as exc:
            # No responders (nats-py reports them as a 503 without a code): no server runs JetStream, and
            # waiting will not change that; a cluster electing its meta leader answers with a coded 503.
            if isinstance(exc, nats.errors.NoRespondersError) or (
                isinstance(exc, nats.js.errors.ServiceUnavailableError) and exc.code is None
            ):
                raise StreamUnavailableError(
                    "JetStream is not enabled on the NATS server (start it with -js, or jetstream {} in its "
                    "configuration)"
                ) from exc
            if loop.time() >= deadline:
                raise transport_error(exc, f"JetStream did not answer within {timeout_s:g} s") from exc
            await asyncio.sleep(0.5)


async def provision(
    nc: Client,
    *,
    stream: str = subjects.STREAM,
    events_prefix: str = subjects.EVENTS_PREFIX,
    replicas: int = 1,
    stream_max_age_s: float = DEFAULT_STREAM_MAX_AGE_S,
    stream_max_bytes: int = DEFAULT_STREAM_MAX_BYTES,
    worker_ttl_s: float = 15.0,
    lease_ttl_s: float = 30.0,
    snapshot_max_bytes: int = -1,
    memory: bool = False,
    timeout_s: float = 60.0,
) -> ProvisionResult:
    """Create the events stream and the index group's buckets where missing, at ``replicas`` replicas.

    Args:
        nc: an open connection (operator credentials: it creates streams).
        stream: the events stream; the buckets are named after it (`kvmesh.runtime.subjects`).
        events_prefix: the stream's subject prefix (``<prefix>.>``).
        replicas: replica count of everything created (1 on one server, 3 on a 3-node cluster).
        stream_max_age_s, stream_max_bytes: the stream's retention bounds (seconds, bytes), as the ingest's
            ``--stream-max-age-s`` / ``--stream-max-bytes``.
        worker_ttl_s: registry TTL in seconds (the services' ``--worker-ttl-s``).
        lease_ttl_s: snapshot-writer lease TTL in seconds (the indexer's ``--lease-ttl-s``).
        snapshot_max_bytes: size bound of the snapshot Object Store (-1: none).
        memory: memory storage instead of file storage (tests, demos).
        timeout_s: how long to wait for JetStream to answer at all (a cluster electing its meta leader).

    Raises:
        TransportError: JetStream did not answer within ``timeout_s``, or a create was refused (for instance
            by the credentials' permissions: the request then times out).
        StreamUnavailableError: the stream cannot be created.
    """
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    await _until_jetstream(nc, timeout_s)
    js = nc.jetstream()
    wanted: list[tuple[str, Kind]] = [
        (stream, "stream"),
        (subjects.registry_bucket(stream), "kv"),
        (subjects.lease_bucket(stream), "kv"),
        (subjects.snapshot_bucket(stream), "object_store"),
    ]
    before: dict[str, int | None] = {}
    try:
        for name, kind in wanted:
            before[name] = await _replicas(nc, _backing_stream(name, kind))
        await ensure_stream(
            js,
            StreamSettings(
                name=stream,
                prefix=events_prefix,
                replicas=replicas,
                max_age_s=stream_max_age_s,
                max_bytes=stream_max_bytes,
                memory=memory,
            ),
        )
        registry = RegistrySettings(
            bucket=subjects.registry_bucket(stream), ttl_s=worker_ttl_s, memory=memory, replicas=replicas
        )
        await open_registry(js, registry)
        await open_kv(js, subjects.lease_bucket(stream), ttl_s=lease_ttl_s, memory=memory, replicas=replicas)
        await SnapshotStore.open(
            js,
            subjects.snapshot_bucket(stream),
            memory=memory,
            max_bytes=snapshot_max_bytes,
            replicas=replicas,
        )
        resources: list[Resource] = []
        mismatched: list[str] = []
        for name, kind in wanted:
            now = await _replicas(nc, _backing_stream(name, kind))
            if now is None:
                raise TransportError(f"provision: {kind} {name} does not exist after its create")
            resources.append(Resource(name=name, kind=kind, replicas=now, created=before[name] is None))
            if now != replicas:
                mismatched.append(f"{kind} {name} exists with {now} replicas, not {replicas}")
    except (nats.errors.Error, TimeoutError) as exc:
        raise transport_error(exc, f"provision of {stream}") from exc
    return ProvisionResult(
        stream=stream, replicas=replicas, resources=tuple(resources), mismatched=tuple(mismatched)
    )
