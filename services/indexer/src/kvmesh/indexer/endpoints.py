"""The indexer's request-reply endpoints: match queries (NATS micro service) and ``kvmesh status``.

Match protocol (msgpack, `kvmesh.core.protocol`): request `MatchRequest` ``{"model", "token_ids", "lora_name",
"cache_salt"}``, ``token_ids`` either the token ids packed as little-endian uint32 (msgpack bin: what the router
sends, no per-token work on either side) or a msgpack array of ints; reply `kvmesh.indexer.policy.match_reply`
or, with a NATS service error (`protocol.ERROR_STATUS`), `ErrorReply` ``{"error": {"code", "message"}}`` with
codes ``bad_request`` (400) and ``unknown_model`` (404). Status: `IndexerStatus` (JSON).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import msgspec
import nats.errors
from nats.micro.request import Request

from kvmesh.core import protocol
from kvmesh.core.errors import RequestError, UnknownModelError, clip_echo
from kvmesh.core.protocol import ERROR_STATUS, IndexerStatus, MatchRequest
from kvmesh.core.state import IndexState
from kvmesh.indexer import policy
from kvmesh.runtime.replica import StreamReplica


class MatchEndpoint:
    """Answers match queries from the state a replica serves now.

    Args:
        replica: this replica's name (in every reply).
        state: returns the index state to match against (a replica replaces its state when it rebuilds).
    """

    def __init__(self, replica: str, state: Callable[[], IndexState]) -> None:
        self.replica = replica
        self._state = state
        self._encoder = msgspec.msgpack.Encoder()

    async def handle(self, req: Request) -> None:
        """Answer one match request (a bad one with ``bad_request``, an unserved model with ``unknown_model``)."""
        try:
            query = protocol.decode(req.data, MatchRequest, format="msgpack")
        except RequestError as exc:
            await self._error(req, "bad_request", str(exc))
            return
        try:
            tokens = query.token_ids
            result = self._state().match(
                query.model,
                policy.unpack_tokens(tokens) if isinstance(tokens, bytes) else tokens,
                lora_name=query.lora_name,
                cache_salt=query.cache_salt,
            )
        except UnknownModelError:
            await self._error(req, "unknown_model", f"no worker serves model {query.model!r}")
            return
        except RequestError as exc:
            await self._error(req, "bad_request", str(exc))
            return
        await req.respond(protocol.encode(policy.match_reply(result, self.replica), format="msgpack"))

    async def _error(self, req: Request, code: str, message: str) -> None:
        message = clip_echo(message)  # it may repeat the request's model name
        await req.respond_error(
            str(ERROR_STATUS[code]),
            f"{code}: {message}",
            protocol.encode(protocol.error_reply(code, message), format="msgpack"),
        )


def status_reply(
    *,
    replica: str,
    stream: str,
    ready: bool,
    state: IndexState,
    reader: StreamReplica | None,
    snapshots: dict[str, Any],
    snapshot_writer: bool,
) -> IndexerStatus:
    """A replica's ``kvmesh status`` reply: its sequence, size, digest, counters, recovery and snapshots.

    Args:
        reader: the replica's stream reader (None before `run()` connected: zero counters).
    """
    st = state
    return IndexerStatus(
        replica=replica,
        stream=stream,
        ready=ready,
        applied_seq=st.applied_seq,
        blocks=st.block_total(),
        digest=f"{st.digest():016x}",
        models=st.models(),
        counters=asdict(st.counters)
        | {
            "decode_errors": reader.decode_errors if reader is not None else 0,
            "apply_errors": reader.apply_errors if reader is not None else 0,
        },
        workers=st.workers(),
        complete=st.gap_seq is None,
        incomplete=[f"{w}/{r}" for w, r in st.incomplete()],
        holder_health={f"{w}/{r}": why for (w, r), why in st.holder_health().items()},
        reset_epoch=st.reset_epoch,
        read_messages=reader.read_messages if reader is not None else 0,
        resubscribes=reader.resubscribes if reader is not None else 0,
        stream_id=reader.stream_id if reader is not None else "",
        rebuilds=reader.rebuilds if reader is not None else 0,
        recovery=reader.recovery if reader is not None else {},
        snapshots=snapshots,
        snapshot_writer=snapshot_writer,
    )


def status_responder(status: Callable[[], IndexerStatus]) -> Callable[[Any], Awaitable[None]]:
    """A ``kvmesh status`` subscription callback that replies ``status()`` as JSON (when asked for a reply)."""

    async def on_status(msg: Any) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(protocol.encode(status()))

    return on_status
