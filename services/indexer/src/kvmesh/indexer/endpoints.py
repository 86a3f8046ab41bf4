"""The indexer's request-reply endpoints: match queries (NATS micro service) and ``kvmesh status``.

Match protocol (msgpack): request ``{"model", "token_ids", "lora_name", "cache_salt"}``, ``token_ids`` either
the token ids packed as little-endian uint32 (msgpack bin: what the router sends, no per-token work on either
side) or a msgpack array of ints; reply `kvmesh.indexer.policy.match_reply` or, with a NATS service error,
``{"error": {"code", "message"}}`` with codes ``bad_request`` (400) and ``unknown_model`` (404).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import msgspec
import nats.errors
from nats.micro.request import Request

from kvmesh.core.errors import RequestError, UnknownModelError, clip_echo
from kvmesh.core.state import IndexState
from kvmesh.indexer import policy
from kvmesh.runtime.replica import StreamReplica


class MatchRequest(msgspec.Struct, kw_only=True):
    """A match query from a router."""

    model: str
    token_ids: bytes | list[int]
    """Token ids packed as little-endian uint32, or as a list of ints."""
    lora_name: str | None = None
    cache_salt: str | None = None


class MatchEndpoint:
    """Answers match queries from the state a replica serves now.

    Args:
        replica: this replica's name (in every reply).
        state: returns the index state to match against (a replica replaces its state when it rebuilds).
    """

    def __init__(self, replica: str, state: Callable[[], IndexState]) -> None:
        self.replica = replica
        self._state = state
        self._decoder = msgspec.msgpack.Decoder(MatchRequest)
        self._encoder = msgspec.msgpack.Encoder()

    async def handle(self, req: Request) -> None:
        """Answer one match request (a bad one with ``bad_request``, an unserved model with ``unknown_model``)."""
        try:
            query = self._decoder.decode(req.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self._error(req, "bad_request", f"bad match request: {exc}", 400)
            return
        except RecursionError:  # msgspec gives up on input nested deeper than it can decode
            await self._error(req, "bad_request", "bad match request: nested too deeply to decode", 400)
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
            await self._error(req, "unknown_model", f"no worker serves model {query.model!r}", 404)
            return
        except RequestError as exc:
            await self._error(req, "bad_request", str(exc), 400)
            return
        await req.respond(self._encoder.encode(policy.match_reply(result, self.replica)))

    async def _error(self, req: Request, code: str, message: str, status: int) -> None:
        message = clip_echo(message)  # it may repeat the request's model name
        await req.respond_error(
            str(status),
            f"{code}: {message}",
            self._encoder.encode({"error": {"code": code, "message": message}}),
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
) -> dict[str, Any]:
    """A replica's ``kvmesh status`` reply: its sequence, size, digest, counters, recovery and snapshots.

    Args:
        reader: the replica's stream reader (None before `run()` connected: zero counters).
    """
    st = state
    return {
        "replica": replica,
        "stream": stream,
        "ready": ready,
        "applied_seq": st.applied_seq,
        "blocks": st.block_total(),
        "digest": f"{st.digest():016x}",
        "models": st.models(),
        "counters": asdict(st.counters)
        | {
            "decode_errors": reader.decode_errors if reader is not None else 0,
            "apply_errors": reader.apply_errors if reader is not None else 0,
        },
        "workers": st.workers(),
        "complete": st.gap_seq is None,
        "incomplete": [f"{w}/{r}" for w, r in st.incomplete()],
        "holder_health": {f"{w}/{r}": why for (w, r), why in st.holder_health().items()},
        "reset_epoch": st.reset_epoch,
        "read_messages": reader.read_messages if reader is not None else 0,
        "resubscribes": reader.resubscribes if reader is not None else 0,
        "stream_id": reader.stream_id if reader is not None else "",
        "rebuilds": reader.rebuilds if reader is not None else 0,
        "recovery": reader.recovery if reader is not None else {},
        "snapshots": snapshots,
        "snapshot_writer": snapshot_writer,
    }


def status_responder(status: Callable[[], dict[str, Any]]) -> Callable[[Any], Any]:
    """A ``kvmesh status`` subscription callback that replies ``status()`` as JSON (when asked for a reply)."""

    async def on_status(msg: Any) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(msgspec.json.encode(status()))

    return on_status
