"""`TrtllmEvents`: TensorRT-LLM's polled KV-cache events (``LLM.get_kv_cache_events()``) onto a publisher.

TensorRT-LLM engines that do not run KV cache manager V2's streaming publisher (``kvmesh trtllm``) hand their
events out in-process as dicts (``tensorrt_llm._utils.KVCacheEventSerializer``)::

    {"event_id": int, "window_size": int, "attention_dp_rank": int?,
     "data": {"type": "created", "num_blocks_per_cache_level": [int, …]}
           | {"type": "stored", "parent_hash": int | None,
              "blocks": [{"type": "stored_block", "block_hash": int,
                          "tokens": [{"type": "unique_token", "token_id": int, "token_extra_id": int}, …],
                          "cache_level": int, "priority": int, "mm_keys": [{"hash": hex, "start_offset": int}]?}]}
           | {"type": "removed", "block_hashes": [int, …]}
           | {"type": "updated", "block_hash": int, "cache_level": {…}, "priority": {…}}}

The rules are those of Dynamo's TensorRT-LLM publisher (``components/src/dynamo/trtllm/publisher.py``): only
the largest attention window's events count (the ``created`` events at start name the windows); a stored
event is cut at its first partial block, whose later removal is then not reported; ``created`` and
``updated`` carry no cache contents and are only counted. Tiers are not told apart (``cache_level`` moves are
``updated`` events): every block is on the publisher's default tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvmesh.publish._events import PublishError, check_block_size


class EventSink(Protocol):
    """What `TrtllmEvents` publishes to: `JetStreamPublisher` or `ZmqPublisher`."""

    def stored(
        self,
        block_hashes: Sequence[int],
        token_ids: Sequence[int],
        *,
        parent_block_hash: int | None = ...,
        extra_keys: Sequence[Sequence[Any] | None] | None = ...,
        dp_rank: int = ...,
    ) -> int: ...

    def removed(self, block_hashes: Sequence[int], *, dp_rank: int = ...) -> int: ...


@dataclass(slots=True)
class TrtllmEventStats:
    """Counters of one `TrtllmEvents` (cumulative)."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    partial_blocks: int = 0
    """Trailing partial blocks left out of a stored event (and later removals of them skipped)."""
    created_ignored: int = 0
    updated_ignored: int = 0
    other_window_ignored: int = 0
    """Events of a smaller attention window (sliding-window layers), not routable on."""
    malformed: int = 0
    """Events that are not one of the shapes above (or a block with more tokens than a block holds)."""


class TrtllmEvents:
    """Translate polled TensorRT-LLM KV-cache events and publish them (see the module docstring).

    Args:
        sink: the publisher (its ``dp_rank`` is the event's ``attention_dp_rank``, 0 when absent).
        block_size: ``tokens_per_block`` of the engine (the publisher's block size).

    Raises:
        PublishError: a bad block size.
    """

    def __init__(self, sink: EventSink, *, block_size: int) -> None:
        self.sink = sink
        self.block_size = check_block_size(block_size)
        self.stats = TrtllmEventStats()
        self._window: int | None = None
        self._initial = True
        self._partial: set[int] = set()

    def publish_all(self, events: Iterable[Mapping[str, Any]]) -> None:
        """`publish` each event, in order."""
        for event in events:
            self.publish(event)

    def publish(self, event: Mapping[str, Any]) -> None:
        """Publish one event dict (a ``stored`` or ``removed`` one); count the others.

        Raises:
            PublishError: the publisher refused the translated event (a hash or token out of range).
        """
        data = event.get("data") if isinstance(event, Mapping) else None
        kind = data.get("type") if isinstance(data, Mapping) else None
        window = event.get("window_size") if isinstance(event, Mapping) else None
        if kind == "created":
            self.stats.created_ignored += 1
            if self._initial and isinstance(window, int):
                self._window = window if self._window is None else max(self._window, window)
            return
        if kind == "updated":
            self.stats.updated_ignored += 1
            return
        if kind not in ("stored", "removed"):
            self.stats.malformed += 1
            return
        self._initial = False
        assert isinstance(data, Mapping)
        if isinstance(window, int) and self._window is not None and window != self._window:
            self.stats.other_window_ignored += 1
            return
        rank = event.get("attention_dp_rank") or 0
        try:
            if kind == "stored":
                self._stored(data, rank)
            else:
                self._removed(data, rank)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, PublishError):
                raise
            self.stats.malformed += 1

    def _stored(self, data: Mapping[str, Any], rank: int) -> None:
        hashes: list[int] = []
        tokens: list[int] = []
        keys: list[tuple[Any, ...] | None] = []
        for block in data["blocks"]:
            block_tokens = [int(t["token_id"]) for t in block["tokens"]]
            if len(block_tokens) > self.block_size:
                raise ValueError("a block holds more tokens than tokens_per_block")
            if len(block_tokens) < self.block_size:
                self._partial.add(block["block_hash"])
                self.stats.partial_blocks += 1
                break
            hashes.append(block["block_hash"])
            tokens += block_tokens
            mm = [(k["hash"], k["start_offset"]) for k in block.get("mm_keys") or () if k.get("hash")]
            keys.append(tuple(mm) if mm else None)
        if not hashes:
            return
        self.sink.stored(
            hashes,
            tokens,
            parent_block_hash=data.get("parent_hash"),
            extra_keys=keys if any(k is not None for k in keys) else None,
            dp_rank=rank,
        )
        self.stats.stored_blocks += len(hashes)

    def _removed(self, data: Mapping[str, Any], rank: int) -> None:
        hashes = []
        for h in data["block_hashes"]:
            if h in self._partial:
                self._partial.discard(h)
                continue
            hashes.append(h)
        if hashes:
            self.sink.removed(hashes, dp_rank=rank)
            self.stats.removed_blocks += len(hashes)
