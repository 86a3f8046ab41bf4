"""Pure pieces of the router's view of the fleet: `RegistryWatcher.apply`/`live` (entries fed, no server); the
`kvmesh status` summary of a router is tested with `kvmesh.ops` in tests/test_ops_status.py."""

from __future__ import annotations

from kvmesh.core import protocol
from kvmesh.core.protocol import WorkerRecord
from kvmesh.runtime import subjects
from kvmesh.runtime.registry import MAX_DP_RANKS, RegistryWatcher


def _put(w: RegistryWatcher, worker: str, model: str = "m", dp_ranks: int = 1) -> None:
    record = WorkerRecord(worker_id=worker, model=model, dp_ranks=dp_ranks, block_size=16, incarnation=0)
    w.apply(subjects.kv_key(worker), None, protocol.encode(record))


def test_live_ranks_per_model_after_sync_only() -> None:
    """Each registered worker gives one candidate per dp rank of its model; nothing is said before the sync."""
    w = RegistryWatcher(js=None, bucket="B")  # type: ignore[arg-type]
    _put(w, "a", dp_ranks=2)
    _put(w, "b")
    _put(w, "c", model="other")
    assert w.live("m") is None  # not synced yet: no opinion
    w.synced = True
    assert w.live("m") == [("a", 0), ("a", 1), ("b", 0)]
    assert w.live("other") == [("c", 0)]
    assert w.live("unknown") is None  # no registered worker of that model: the index decides
    w.apply(subjects.kv_key("a"), "DEL", None)
    w.apply(subjects.kv_key("b"), "PURGE", None)
    assert w.live("m") == []  # every worker of the model left: no candidates, not "no opinion"


def test_bad_records_are_ignored_and_drop_the_previous_one() -> None:
    """Undecodable values and dp_ranks outside [1, MAX_DP_RANKS] (a billion ranks would be a billion
    candidates) are logged and ignored; the worker's earlier record goes with them."""
    w = RegistryWatcher(js=None, bucket="B")  # type: ignore[arg-type]
    w.synced = True
    for bad in (0, -1, MAX_DP_RANKS + 1, 10**9):
        _put(w, "a", dp_ranks=2)
        assert w.live("m") == [("a", 0), ("a", 1)]
        _put(w, "a", dp_ranks=bad)
        assert w.live("m") == [], bad
    _put(w, "a", dp_ranks=MAX_DP_RANKS)
    assert len(w.live("m") or []) == MAX_DP_RANKS
    for garbage in (b"", b"{", b'{"worker_id": 1}', b"[]"):
        w.apply(subjects.kv_key("a"), None, garbage)
        assert w.live("m") == [], garbage


def test_a_record_of_a_later_protocol_version_is_ignored_as_the_indexer_ignores_it() -> None:
    """A registry value of a version this build does not read (`kvmesh.core.protocol.decode` refuses it, and the
    indexer's member watch skips it) is no candidate and drops the worker's earlier record."""
    w = RegistryWatcher(js=None, bucket="B")  # type: ignore[arg-type]
    w.synced = True
    _put(w, "a")
    assert w.live("m") == [("a", 0)]
    later = WorkerRecord(version=2, worker_id="a", model="m", dp_ranks=1, block_size=16, incarnation=0)
    w.apply(subjects.kv_key("a"), None, protocol.encode(later))
    assert w.live("m") == []
