"""Exact-value tests of the one apply path for encoded stream messages (`kvmesh.core.apply`), no NATS."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.core.apply import Skipped, StreamApplier
from kvmesh.core.errors import MessageDecodeError
from kvmesh.core.events import EventsMessage, Stored, WorkerRemoved, encode_message
from kvmesh.core.state import IndexState


def _stored(worker: str, seq: int, hashes: list[int]) -> bytes:
    return encode_message(
        EventsMessage(
            worker_id=worker,
            dp_rank=0,
            model="m",
            block_size=4,
            epoch=0,
            seq=seq,
            events=[Stored(hashes, None, [h + 1000 for h in hashes])],
        )
    )


def test_applied_messages_change_the_state_and_count() -> None:
    """Two encoded batches and a removal apply at their stream sequences; the counters say 3 read, 0 skipped."""
    state, applier = IndexState(), StreamApplier()
    assert applier.apply(state, 1, _stored("w0", 0, [1, 2])) is None
    assert applier.apply(state, 2, _stored("w1", 0, [3])) is None
    assert (state.applied_seq, state.block_total()) == (2, 3)
    assert applier.apply(state, 3, encode_message(WorkerRemoved(worker_id="w1", model="m"))) is None
    assert (state.applied_seq, state.block_total(), state.counters.messages) == (3, 2, 3)
    assert (applier.messages, applier.decode_errors, applier.apply_errors) == (3, 0, 0)


def test_an_undecodable_message_is_skipped_at_its_sequence() -> None:
    """Bytes that are no kvmesh message are counted as a decode error and skipped, with applied_seq past them."""
    state, applier = IndexState(), StreamApplier()
    applier.apply(state, 1, _stored("w0", 0, [1]))
    skipped = applier.apply(state, 5, b"\xc1not msgpack")
    assert isinstance(skipped, Skipped)
    assert (skipped.seq, skipped.kind, type(skipped.error)) == (5, "undecodable", MessageDecodeError)
    assert (state.applied_seq, state.counters.messages, state.block_total()) == (5, 1, 1)
    assert (applier.messages, applier.decode_errors, applier.apply_errors) == (2, 1, 0)
    assert applier.apply(state, 6, _stored("w0", 1, [2])) is None
    assert (state.applied_seq, state.block_total()) == (6, 2)


def test_a_newer_schema_version_is_an_undecodable_message() -> None:
    """A message of schema version 2 is refused as undecodable (a rollback reading a newer writer's message)."""
    state, applier = IndexState(), StreamApplier()
    data = msgspec.msgpack.encode({"type": "worker_removed", "v": 2, "worker_id": "w", "model": "m"})
    skipped = applier.apply(state, 1, data)
    assert skipped is not None and skipped.kind == "undecodable"
    assert "unsupported schema version 2" in str(skipped.error)
    assert (state.applied_seq, applier.decode_errors) == (1, 1)


def test_a_message_that_fails_to_apply_is_skipped_at_its_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoded message whose apply raises counts as an apply error; applied_seq still moves past it."""
    state, applier = IndexState(), StreamApplier()

    def boom(seq: int, message: object) -> None:
        raise ValueError("bug")

    monkeypatch.setattr(state, "apply", boom)
    skipped = applier.apply(state, 7, _stored("w0", 0, [1]))
    assert skipped is not None
    assert (skipped.seq, skipped.kind, str(skipped.error)) == (7, "failed", "bug")
    assert state.applied_seq == 7
    assert (applier.messages, applier.decode_errors, applier.apply_errors) == (1, 0, 1)


def test_a_skipped_message_never_moves_the_sequence_back() -> None:
    """An undecodable message redelivered below applied_seq leaves applied_seq where it was."""
    state, applier = IndexState(), StreamApplier()
    applier.apply(state, 10, _stored("w0", 0, [1]))
    applier.apply(state, 4, b"")
    assert (state.applied_seq, applier.decode_errors) == (10, 1)
