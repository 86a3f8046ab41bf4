"""`/register` and `/unregister` of the RFC #1403 API: each registration runs one ``kvmesh ingest`` child
process of this router, which reads the publisher's ZMQ socket and publishes to the router's stream.

What a registration is here (the simplest honest behaviour): the HTTP process starts ``python -m
kvmesh.ingest`` for the endpoint, with worker id ``instance_id``, model ``modelname``, block size
``block_size`` and exactly the rank ``dp_rank`` (read on ``endpoint`` itself: the ingest's base port is the
endpoint's port minus the rank, vLLM's rule that rank *r* listens on port + *r*), on the router's NATS
server, credentials (through the environment, never the command line), stream and events prefix. The
instance then reaches every router and indexer of the fleet through the stream, like any other ingest's.
`/unregister` stops that child (SIGTERM: the ingest leaves the registry, so the worker leaves the
candidates). Children live as long as this router: registrations are not persisted, a restarted router
has none. A child that exits on its own shows ``"status": "exited"`` in ``/workers`` with its exit code.

Registrations are keyed ``(instance_id, tenant_id, dp_rank)``, as Mooncake's conductor keys them; a repeat
of a live key changes nothing and succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

from kvmesh.router.config import RouterSettings
from kvmesh.router.http_api import DEFAULT_TENANT, ApiError, RegisterBody, UnregisterBody
from kvmesh.runtime.config import AUTH_FIELDS

__all__ = ["PUBLISHER_TYPES", "Registration", "Registrations"]

log = logging.getLogger("kvmesh.router")

PUBLISHER_TYPES: Final[frozenset[str]] = frozenset({"vllm", "sglang", "mooncake"})
"""Publisher ``type`` values (any case) whose ZMQ batches ``kvmesh ingest`` reads."""
_STOP_S: Final[float] = 5.0


@dataclass(slots=True)
class Registration:
    """One registered publisher and its ingest child."""

    instance_id: str
    tenant_id: str
    dp_rank: int
    model: str
    block_size: int
    endpoint: str
    replay_endpoint: str | None
    type: str
    proc: asyncio.subprocess.Process | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        """``instance|tenant|rank``, as `/unregister` reports it."""
        return f"{self.instance_id}|{self.tenant_id}|{self.dp_rank}"

    def view(self) -> dict[str, Any]:
        """The registration as ``/workers`` lists it."""
        code = self.proc.returncode if self.proc is not None else None
        out: dict[str, Any] = {
            "instance_id": self.instance_id,
            "tenant_id": self.tenant_id,
            "dp_rank": self.dp_rank,
            "model_name": self.model,
            "block_size": self.block_size,
            "type": self.type,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "source": "register",
            "status": "active" if self.proc is not None and code is None else "exited",
        }
        if code is not None:
            out["exit_code"] = code
        return out


def _base_endpoint(endpoint: str, rank: int, name: str) -> str:
    """``endpoint`` with its port lowered by ``rank`` (the ingest reads rank r on its port + r).

    Raises:
        ApiError: 400 not a ``tcp://host:port`` endpoint, or a port below the rank.
    """
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or port is None or not parts.hostname:
        raise ApiError(400, f"{name} must be a ZMQ tcp://host:port endpoint, got {endpoint[:200]!r}")
    if port - rank < 1:
        raise ApiError(400, f"{name} port {port} is below dp_rank {rank}: rank r publishes on base port + r")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return urlunsplit(("tcp", f"{host}:{port - rank}", "", "", ""))


class Registrations:
    """The registrations of one router and their ingest children.

    Args:
        settings: the router's settings (NATS server, credentials, stream, events prefix, registry bucket).
        python: the interpreter the children run (default: this one).
    """

    def __init__(self, settings: RouterSettings, *, python: str = sys.executable) -> None:
        self._settings = settings
        self._python = python
        self.by_key: dict[str, Registration] = {}

    def tenants(self) -> dict[str, str]:
        """Instance id → tenant of every registration (an instance registered under several: the last)."""
        return {r.instance_id: r.tenant_id for r in self.by_key.values()}

    async def register(self, body: RegisterBody) -> dict[str, Any]:
        """Start an ingest for ``body``; the RFC's success reply.

        Raises:
            ApiError: 400 a missing or invalid field; 500 the child could not be started.
        """
        for name in ("endpoint", "type", "instance_id", "block_size", "dp_rank"):
            if getattr(body, name) is None or getattr(body, name) == "":
                raise ApiError(400, f"{name} is required")
        model = body.modelname or body.model_name
        if not model:
            raise ApiError(400, "modelname is required")
        assert body.endpoint is not None and body.type is not None and body.block_size is not None
        assert body.dp_rank is not None
        if body.type.lower() not in PUBLISHER_TYPES:
            raise ApiError(
                400, f"unsupported publisher type {body.type[:64]!r}: kvmesh reads vLLM, SGLang, Mooncake"
            )
        if body.block_size <= 0:
            raise ApiError(400, "block_size must be greater than zero")
        if body.dp_rank < 0:
            raise ApiError(400, "dp_rank must be non-negative")
        if body.additionalsalt:
            raise ApiError(
                400,
                "additionalsalt is not supported: kvmesh keys blocks by their tokens, LoRA adapter and the "
                "requests' cache_salt",
            )
        base = _base_endpoint(body.endpoint, body.dp_rank, "endpoint")
        replay = (
            _base_endpoint(body.replay_endpoint, body.dp_rank, "replay_endpoint")
            if body.replay_endpoint
            else None
        )
        reg = Registration(
            instance_id=str(body.instance_id),
            tenant_id=body.tenant_id or DEFAULT_TENANT,
            dp_rank=body.dp_rank,
            model=model,
            block_size=body.block_size,
            endpoint=body.endpoint,
            replay_endpoint=body.replay_endpoint,
            type=body.type,
        )
        live = self.by_key.get(reg.key)
        if live is not None and live.proc is not None and live.proc.returncode is None:
            return {"status": "registered successfully", "instance_id": reg.instance_id}
        try:
            reg.proc = await asyncio.create_subprocess_exec(
                *self._argv(reg, base, replay), env=self._env(), stdin=asyncio.subprocess.DEVNULL
            )
        except OSError as exc:
            raise ApiError(500, f"failed to start the ingest: {exc}") from None
        self.by_key[reg.key] = reg
        log.info(
            "http: registered %s (%s %s, rank %d): ingest pid %d",
            reg.instance_id,
            reg.type,
            reg.endpoint,
            reg.dp_rank,
            reg.proc.pid,
        )
        return {"status": "registered successfully", "instance_id": reg.instance_id}

    async def unregister(self, body: UnregisterBody) -> dict[str, Any]:
        """Stop the ingest of ``(instance_id, tenant_id, dp_rank)``; the RFC's success reply.

        Raises:
            ApiError: 400 no ``instance_id`` or ``dp_rank``; 404 nothing registered under that key.
        """
        if body.instance_id is None or body.instance_id == "":
            raise ApiError(400, "instance_id is required")
        if body.dp_rank is None:
            raise ApiError(400, "dp_rank is required")
        key = f"{body.instance_id}|{body.tenant_id or DEFAULT_TENANT}|{body.dp_rank}"
        reg = self.by_key.pop(key, None)
        if reg is None:
            raise ApiError(404, f"service not found: {key}")
        await _stop(reg)
        log.info("http: unregistered %s", key)
        return {"status": "unregistered successfully", "removed_instances": [key]}

    async def aclose(self) -> None:
        """Stop every child."""
        regs, self.by_key = list(self.by_key.values()), {}
        await asyncio.gather(*(_stop(r) for r in regs))

    def _argv(self, reg: Registration, base: str, replay: str | None) -> list[str]:
        s = self._settings
        argv = [
            self._python, "-m", "kvmesh.ingest", "--worker-id", reg.instance_id, "--model", reg.model,
            "--zmq-endpoint", base, "--block-size", str(reg.block_size),
            "--data-parallel-size", str(reg.dp_rank + 1), "--data-parallel-start-rank", str(reg.dp_rank),
            "--data-parallel-size-local", "1", "--stream", s.stream, "--events-prefix", s.events_prefix,
        ]  # fmt: skip
        if replay is not None:
            argv += ["--replay-endpoint", replay]
        if s.registry_bucket:
            argv += ["--registry-bucket", s.registry_bucket]
        return argv

    def _env(self) -> dict[str, str]:
        """This process's environment with the router's NATS server and credentials (``KVMESH_NATS_*``)."""
        s = self._settings
        env = dict(os.environ)
        env["KVMESH_NATS_URL"] = s.nats_url
        for name in AUTH_FIELDS:
            value = getattr(s, name)
            if value:
                env[f"KVMESH_{name.upper()}"] = str(value)
        return env


async def _stop(reg: Registration) -> None:
    proc = reg.proc
    if proc is None or proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), _STOP_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
