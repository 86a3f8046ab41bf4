"""What the publishers share: argument checks and the vLLM wire events they turn into (no I/O)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Final

from kvmesh.core import wire
from kvmesh.core.errors import KvmeshError

_HASH_MIN: Final[int] = -(1 << 63)
_HASH_END: Final[int] = 1 << 64
_TOKEN_END: Final[int] = 1 << 32


class PublishError(KvmeshError, ValueError):
    """An event given to a publisher cannot be published (the message names the argument); nothing was sent.

    Attributes:
        argument: the offending argument (``block_hashes``, ``token_ids``, ``dp_rank``, …).
    """

    def __init__(self, message: str, *, argument: str) -> None:
        super().__init__(message)
        self.argument = argument


def check_rank(dp_rank: int, ranks: int) -> None:
    """Raise `PublishError` unless ``0 <= dp_rank < ranks``."""
    if type(dp_rank) is not int or not 0 <= dp_rank < ranks:
        raise PublishError(f"dp_rank {dp_rank!r} is not in [0, {ranks})", argument="dp_rank")


def check_hashes(hashes: Sequence[int], argument: str) -> tuple[int, ...]:
    """The hashes as a tuple; each must be an int in ``[-2**63, 2**64)`` (signed or unsigned 64-bit)."""
    out = tuple(hashes)
    for h in out:
        if type(h) is not int or not _HASH_MIN <= h < _HASH_END:
            raise PublishError(
                f"{argument} holds {h!r}; a block hash is an int in [-2**63, 2**64)", argument=argument
            )
    return out


def stored_event(
    block_hashes: Sequence[int],
    token_ids: Sequence[int],
    *,
    block_size: int,
    parent_block_hash: int | None,
    medium: str | None,
    lora_name: str | None,
    extra_keys: Sequence[Sequence[Any] | None] | None = None,
) -> wire.BlockStored:
    """A checked BlockStored: one hash per full block of ``token_ids``.

    Raises:
        PublishError: no blocks, a hash that is not a 64-bit int, a token id outside ``[0, 2**32)``,
            ``len(token_ids) != len(block_hashes) * block_size``, or ``extra_keys`` not one entry per block.
    """
    hashes = check_hashes(block_hashes, "block_hashes")
    if not hashes:
        raise PublishError(
            "block_hashes is empty: a stored event names at least one block", argument="block_hashes"
        )
    tokens = tuple(token_ids)
    if len(tokens) != len(hashes) * block_size:
        raise PublishError(
            f"{len(tokens)} token ids for {len(hashes)} block(s) of {block_size} tokens (expected "
            f"{len(hashes) * block_size}; publish full blocks only)",
            argument="token_ids",
        )
    for t in tokens:
        if type(t) is not int or not 0 <= t < _TOKEN_END:
            raise PublishError(
                f"token_ids holds {t!r}; a token id is an int in [0, 2**32)", argument="token_ids"
            )
    parent = None if parent_block_hash is None else check_hashes((parent_block_hash,), "parent_block_hash")[0]
    keys = None
    if extra_keys is not None:
        keys = tuple(None if k is None else tuple(k) for k in extra_keys)
        if len(keys) != len(hashes):
            raise PublishError(
                f"{len(keys)} extra_keys entries for {len(hashes)} block(s) (one per block, None for none)",
                argument="extra_keys",
            )
    return wire.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        medium=medium,
        lora_name=lora_name,
        extra_keys=keys,
    )


def removed_event(block_hashes: Sequence[int], *, medium: str | None) -> wire.BlockRemoved:
    """A checked BlockRemoved.

    Raises:
        PublishError: no hashes, or a hash that is not a 64-bit int.
    """
    hashes = check_hashes(block_hashes, "block_hashes")
    if not hashes:
        raise PublishError(
            "block_hashes is empty: a removed event names at least one block", argument="block_hashes"
        )
    return wire.BlockRemoved(block_hashes=hashes, medium=medium)


def check_block_size(block_size: int) -> int:
    """Raise `PublishError` unless ``block_size`` is a positive int."""
    if type(block_size) is not int or block_size < 1:
        raise PublishError(f"block_size {block_size!r} is not a positive int", argument="block_size")
    return block_size


class EventPublisherBase(ABC):
    """The event calls both publishers offer; a subclass checks its state and delivers one wire event."""

    block_size: int
    """Tokens per block of every stored event."""

    def stored(
        self,
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        *,
        parent_block_hash: int | None = None,
        medium: str | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
        dp_rank: int = 0,
    ) -> int:
        """Report full blocks that entered the cache (vLLM's BlockStored).

        Args:
            block_hashes: the engine's hash of each block, in order (signed or unsigned 64-bit ints; any
                stable per-engine hash: kvmesh keys blocks by its own hash of the tokens).
            token_ids: the blocks' tokens, flat: exactly ``len(block_hashes) * block_size`` ids.
            parent_block_hash: hash of the block before the first one, None when the first is block 0.
            medium: the tier the blocks live on (``"GPU"``, ``"CPU"``, …; None: the default tier).
            lora_name: the LoRA adapter the blocks were computed with (None: the base model).
            extra_keys: per block, None or that block's extra hash keys (vLLM's ``extra_keys``: a
                multimodal segment as ``(hash, start_offset)``, …): blocks with keys never match prompts
                without them. None: no block has any.
            dp_rank: the data-parallel rank whose cache this is.

        Returns:
            The engine sequence this batch got (0, 1, … per rank in this epoch).

        Raises:
            PublishError: a bad argument (named); nothing was published.
            RuntimeError: the publisher is not started or is closed (or, for JetStream, called from
                another thread).
        """
        self._check(dp_rank)
        ev = stored_event(
            block_hashes,
            token_ids,
            block_size=self.block_size,
            parent_block_hash=parent_block_hash,
            medium=medium,
            lora_name=lora_name,
            extra_keys=extra_keys,
        )
        return self._deliver(dp_rank, ev)

    def removed(self, block_hashes: Sequence[int], *, medium: str | None = None, dp_rank: int = 0) -> int:
        """Report blocks evicted from the cache (from ``medium``, or the default tier); returns the sequence.

        Raises:
            PublishError: a bad argument (named); nothing was published.
            RuntimeError: as for `stored`.
        """
        self._check(dp_rank)
        return self._deliver(dp_rank, removed_event(block_hashes, medium=medium))

    def cleared(self, *, dp_rank: int = 0) -> int:
        """Report that the rank's whole cache was emptied (a prefix-cache reset); returns the sequence.

        Raises:
            PublishError: a bad ``dp_rank``.
            RuntimeError: as for `stored`.
        """
        self._check(dp_rank)
        return self._deliver(dp_rank, wire.AllBlocksCleared())

    @abstractmethod
    def _check(self, dp_rank: int) -> None:
        """Raise unless an event of ``dp_rank`` can be delivered now."""

    @abstractmethod
    def _deliver(self, dp_rank: int, event: wire.KVEvent) -> int:
        """Publish one event as the rank's next batch; return its sequence."""
