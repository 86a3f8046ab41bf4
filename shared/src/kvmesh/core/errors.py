"""Errors raised by kvmesh's pure core.

Every error kvmesh raises on purpose derives from `KvmeshError`; where a built-in fits, the error also
derives from it, so callers that only know the standard library still catch it sensibly.

    KvmeshError
    ├── WireError (ValueError)             a ZMQ KV-event payload we cannot use
    │   ├── PayloadDecodeError             the bytes are not msgpack at all
    │   ├── NotABatchError                 msgpack, but not a 2- or 3-element KVEventBatch array
    │   └── InvalidEventError              one event inside a batch has the wrong shape or field type
    ├── EventRejectedError (ValueError)    a well-formed event that kvmesh refuses to index
    │   └── BlockAlignmentError            len(token_ids) != len(block_hashes) × block_size
    ├── MessageDecodeError (ValueError)    a kvmesh stream message that does not decode
    └── RequestError (ValueError)          a route or match request that is invalid; `field` names the culprit

The services map these to log lines, counters and error replies; the core itself never logs.
"""

from __future__ import annotations


class KvmeshError(Exception):
    """Base class of every error kvmesh raises on purpose."""


class WireError(KvmeshError, ValueError):
    """A ZMQ KV-event payload that kvmesh cannot use."""


class PayloadDecodeError(WireError):
    """The payload bytes are not valid msgpack."""


class NotABatchError(WireError):
    """The payload is msgpack but not a KVEventBatch (an array of 2 or 3 elements, events second)."""


class InvalidEventError(WireError):
    """One event of a batch has an unknown shape or a field of the wrong type.

    Attributes:
        index: position of the event in its batch (0-based).
        tag: the event's type tag when it could be read (``"BlockStored"``), else None.
        reason: what was wrong, in words.
    """

    def __init__(self, reason: str, *, index: int = -1, tag: str | None = None) -> None:
        super().__init__(f"event {index} ({tag or 'untagged'}): {reason}")
        self.index = index
        self.tag = tag
        self.reason = reason


class EventRejectedError(KvmeshError, ValueError):
    """A well-formed event that kvmesh refuses to index (the whole event is dropped, never half-applied)."""


class BlockAlignmentError(EventRejectedError):
    """``len(token_ids)`` differs from ``len(block_hashes) × block_size``.

    Attributes:
        tokens: number of token ids in the event.
        blocks: number of block hashes in the event.
        block_size: the event's block size in tokens.
    """

    def __init__(self, *, tokens: int, blocks: int, block_size: int) -> None:
        super().__init__(
            f"{tokens} token ids do not fill {blocks} blocks of {block_size} tokens "
            f"(expected {blocks * block_size})"
        )
        self.tokens = tokens
        self.blocks = blocks
        self.block_size = block_size


class MessageDecodeError(KvmeshError, ValueError):
    """A kvmesh stream message (JetStream payload) that does not decode."""


class RequestError(KvmeshError, ValueError):
    """An invalid route or match request.

    Attributes:
        field: the request field at fault (``"token_ids"``), or None when the body itself is bad.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


MAX_ECHO_CHARS = 512
"""Characters of a request's own values (model, candidates, request id) an error reply repeats."""


def clip_echo(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """Return ``text`` cut to ``limit`` characters, saying how long it was.

    Error replies repeat parts of the request; unclipped, a request near the server's max payload gets a
    reply over it, and the server closes the replying connection.
    """
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"
