"""Snapshot encoding: an `IndexState` export as bytes with a format version and a checksum, and back.

Pure code: no I/O, no clock. The indexer copies its state with `IndexState.export()` (cheap), encodes the
copy here in a worker thread, and stores the bytes in a JetStream Object Store bucket.

Layout (little-endian)::

    offset  size  field
    0       8     magic b"KVMSNAP\\0"
    8       4     format version (`FORMAT_VERSION`)
    12      4     flags (0)
    16      8     stream sequence the state reflects (``applied_seq``)
    24      8     body length in bytes
    32      8     XXH3-64 (seed 1337) of the body
    40      …     body: msgpack of `_Body`

The body packs each holder's block map, per storage tier, as two arrays of unsigned 64-bit ints (engine
keys, prefix keys) in the map's own order, plus the few blocks stored more than once as ``[engine, count]``
pairs, the held orphans in hold order (with their tier), the index counters and every worker's epochs and
cursors: everything `IndexState.from_export` needs to continue exactly as the original would. About 17 bytes
per block.

Format versions: **4** (this build) keys prefixes by the standard 64-bit sequence hash
(`kvmesh.core.hashing.prefix_keys`); its body is laid out as format 3's. **3** added each holder's engine
order (cursor, gap, health; see `kvmesh.core.state`) and the removed incarnation's model, and keyed prefixes
by a 60-bit chain of kvmesh's own that cannot be turned into sequence hashes (the local hashes are not
kept): it is read with every holder's engine order, epochs, held messages and counters, but without its
blocks, and each holder that had blocks counts as incomplete (``stream_gap``, `IndexState.holder_health`)
until a Cleared or a new engine epoch rebuilds it — the index under-states, it never invents. **2** kept no
engine order: a state restored from it could not tell a duplicate or re-ordered message from a new one, so it
is refused. **1** stored 64-bit sequence hashes and raw engine hashes without engine order; refused as well.
A refused snapshot raises `SnapshotError` with reason ``"version"``, and recovery skips it like any unusable
snapshot, rebuilding from an older snapshot or the stream.

SnapshotError (KvmeshError, ValueError)   the bytes are not a whole, verified snapshot of a known format
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Final

import msgspec
import numpy as np
import xxhash

from kvmesh.core.errors import SnapshotError
from kvmesh.core.hashing import SEED
from kvmesh.core.index import Holder, HolderExport, IndexExport, TierExport
from kvmesh.core.state import StateExport, WorkerExport
from kvmesh.core.tables import U64

MAGIC: Final[bytes] = b"KVMSNAP\x00"
FORMAT_VERSION: Final[int] = 4
LEGACY_KEYS_FORMAT: Final[int] = 3
"""The format read without its blocks (60-bit prefix keys of kvmesh's own; see the module docstring)."""
_HEADER: Final[struct.Struct] = struct.Struct("<8sIIQQQ")
HEADER_SIZE: Final[int] = _HEADER.size
_OLD_FORMATS: Final[dict[int, str]] = {
    1: " (format 1 kept raw engine hashes and no engine order per holder)",
    2: " (format 2 kept no engine order per holder)",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotHeader:
    """The fixed-size header of an encoded snapshot."""

    format_version: int
    applied_seq: int
    """Stream sequence the state reflects: replay resumes at ``applied_seq + 1``."""
    body_bytes: int
    checksum: int
    """XXH3-64 (seed 1337) of the body."""


class _Tier(msgspec.Struct, array_like=True):
    medium: str
    engine: bytes
    seq: bytes
    counts: list[tuple[int, int]]


class _Holder(msgspec.Struct, array_like=True):
    worker_id: str
    dp_rank: int
    engine: bytes
    seq: bytes
    counts: list[tuple[int, int]]
    orphans: list[tuple[int, int, list[int], list[int], int, str | None]]
    orphan_serial: int
    tiers: list[_Tier]


class _Index(msgspec.Struct, array_like=True):
    model: str
    block_size: int
    max_orphans: int
    orphan_ttl_ops: int
    ops: int
    orphans_expired: int
    unknown_removals: int
    holders: list[_Holder]


class _Worker(msgspec.Struct, array_like=True):
    worker_id: str
    model: str
    block_size: int
    epochs: dict[int, int]
    last_seq: dict[int, int]
    last_ts: float
    removed_epoch: int | None
    stale_through: int | None
    stale_model: str | None
    seqs: dict[int, tuple[int | None, int, bool, int | None, str | None]]
    held: dict[int, tuple[int, list[bytes]]] = {}
    """dp_rank → (stream seq the hold began, held messages): absent in snapshots written before holds."""
    readers: list[str] = []
    """Workers reading this backend pool's blocks: absent in format 3 and for instances."""


class _Body(msgspec.Struct, array_like=True):
    applied_seq: int
    reset_epoch: int
    counters: dict[str, int]
    workers: list[_Worker]
    indexes: list[_Index]
    gap_seq: int | None
    healed: list[Holder]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Body)


def _pack(values: U64) -> bytes:
    """A uint64 array as little-endian bytes."""
    return values.astype("<u8", copy=False).tobytes()


def _unpack(data: bytes) -> U64:
    """Little-endian uint64 bytes as a native uint64 array (a copy).

    Raises:
        SnapshotError: the length is not a multiple of 8.
    """
    if len(data) % 8:
        raise SnapshotError("body", f"a packed key array of {len(data)} bytes is not a whole number of keys")
    return np.frombuffer(data, dtype="<u8").astype(np.uint64)


def encode_snapshot(export: StateExport) -> bytes:
    """Encode a state export with header, format version and checksum.

    O(total blocks), about 0.2 s per million blocks; touches only the export, so it may run in a thread
    while the live state keeps changing.
    """
    body = _Body(
        applied_seq=export.applied_seq,
        reset_epoch=export.reset_epoch,
        counters=dict(export.counters),
        workers=[
            _Worker(
                w.worker_id,
                w.model,
                w.block_size,
                w.epochs,
                w.last_seq,
                w.last_ts,
                w.removed_epoch,
                w.stale_through,
                w.stale_model,
                w.seqs,
                {r: (since, list(held)) for r, (since, held) in w.held.items()},
                list(w.readers),
            )
            for w in export.workers
        ],
        indexes=[
            _Index(
                model,
                bs,
                ix.max_orphans,
                ix.orphan_ttl_ops,
                ix.ops,
                ix.orphans_expired,
                ix.unknown_removals,
                [
                    _Holder(
                        h.holder[0],
                        h.holder[1],
                        _pack(h.engine),
                        _pack(h.prefixes),
                        sorted(h.counts.items()),
                        [(s, p, list(e), list(lo), op, m) for s, p, e, lo, op, m in h.orphans],
                        h.orphan_serial,
                        [
                            _Tier(
                                t.medium,
                                _pack(t.engine),
                                _pack(t.prefixes),
                                sorted(t.counts.items()),
                            )
                            for t in h.tiers
                        ],
                    )
                    for h in ix.holders
                ],
            )
            for model, bs, ix in export.indexes
        ],
        gap_seq=export.gap_seq,
        healed=list(export.healed),
    )
    data = _encoder.encode(body)
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, 0, export.applied_seq, len(data), xxhash.xxh3_64_intdigest(data, seed=SEED)
    )
    return header + data


def read_header(data: bytes) -> SnapshotHeader:
    """Read and check the header only (magic, version, length), not the checksum.

    Raises:
        SnapshotError: too short, wrong magic, unknown version, or a body of the wrong length.
    """
    if len(data) < HEADER_SIZE:
        raise SnapshotError("truncated", f"snapshot of {len(data)} bytes is shorter than its header")
    magic, version, _flags, seq, length, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError("magic", "not a kvmesh snapshot (bad magic)")
    if version not in (FORMAT_VERSION, LEGACY_KEYS_FORMAT):
        why = _OLD_FORMATS.get(version, "")
        raise SnapshotError(
            "version",
            f"snapshot format {version}{why}; this build reads formats {LEGACY_KEYS_FORMAT} (without its "
            f"blocks) and {FORMAT_VERSION}",
        )
    if len(data) - HEADER_SIZE != length:
        raise SnapshotError(
            "truncated", f"snapshot body is {len(data) - HEADER_SIZE} bytes, header says {length}"
        )
    return SnapshotHeader(format_version=version, applied_seq=seq, body_bytes=length, checksum=checksum)


def decode_snapshot(data: bytes) -> StateExport:
    """Verify and decode a snapshot into a state export (`IndexState.from_export` rebuilds the state).

    Raises:
        SnapshotError: the header is bad, the checksum does not match, or the body does not decode.
    """
    header = read_header(data)
    body_view = memoryview(data)[HEADER_SIZE:]
    got = xxhash.xxh3_64_intdigest(body_view, seed=SEED)
    if got != header.checksum:
        raise SnapshotError(
            "checksum", f"snapshot checksum {got:016x} does not match its header {header.checksum:016x}"
        )
    try:
        body = _decoder.decode(body_view)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SnapshotError("body", f"snapshot body does not decode: {exc}") from exc
    if body.applied_seq != header.applied_seq:
        raise SnapshotError(
            "body", f"body sequence {body.applied_seq} differs from header {header.applied_seq}"
        )
    export = StateExport(
        applied_seq=body.applied_seq,
        reset_epoch=body.reset_epoch,
        counters=body.counters,
        workers=tuple(
            WorkerExport(
                worker_id=w.worker_id,
                model=w.model,
                block_size=w.block_size,
                epochs=w.epochs,
                last_seq=w.last_seq,
                last_ts=w.last_ts,
                removed_epoch=w.removed_epoch,
                stale_through=w.stale_through,
                stale_model=w.stale_model,
                seqs=w.seqs,
                held={r: (since, tuple(held)) for r, (since, held) in w.held.items()},
                readers=tuple(w.readers),
            )
            for w in body.workers
        ),
        indexes=tuple(
            (
                ix.model,
                ix.block_size,
                IndexExport(
                    max_orphans=ix.max_orphans,
                    orphan_ttl_ops=ix.orphan_ttl_ops,
                    ops=ix.ops,
                    orphans_expired=ix.orphans_expired,
                    unknown_removals=ix.unknown_removals,
                    holders=tuple(
                        HolderExport(
                            holder=Holder(h.worker_id, h.dp_rank),
                            engine=_unpack(h.engine),
                            prefixes=_unpack(h.seq),
                            counts=dict(h.counts),
                            orphans=tuple(
                                (s, p, tuple(e), tuple(lo), op, m) for s, p, e, lo, op, m in h.orphans
                            ),
                            orphan_serial=h.orphan_serial,
                            tiers=tuple(
                                TierExport(
                                    medium=t.medium,
                                    engine=_unpack(t.engine),
                                    prefixes=_unpack(t.seq),
                                    counts=dict(t.counts),
                                )
                                for t in h.tiers
                            ),
                        )
                        for h in ix.holders
                    ),
                ),
            )
            for ix in body.indexes
        ),
        gap_seq=body.gap_seq,
        healed=tuple(body.healed),
    )
    return export if header.format_version == FORMAT_VERSION else _without_blocks(export)


def _without_blocks(export: StateExport) -> StateExport:
    """A format-3 state without its blocks (their prefix keys are of the old scheme), each holder that had
    some marked incomplete from the snapshot's sequence on; everything else as it was."""
    emptied: set[Holder] = set()
    indexes = []
    for model, block_size, ix in export.indexes:
        holders = []
        for h in ix.holders:
            if len(h.engine) or any(len(t.engine) for t in h.tiers):
                emptied.add(h.holder)
            holders.append(
                HolderExport(
                    holder=h.holder,
                    engine=_unpack(b""),
                    prefixes=_unpack(b""),
                    counts={},
                    orphans=h.orphans,
                    orphan_serial=h.orphan_serial,
                    tiers=(),
                )
            )
        indexes.append((model, block_size, dataclasses.replace(ix, holders=tuple(holders))))
    if export.gap_seq is None:
        live = {Holder(w.worker_id, r) for w in export.workers if w.removed_epoch is None for r in w.epochs}
        healed = tuple(sorted(live - emptied))
        gap_seq: int | None = export.applied_seq if emptied else None
    else:
        healed = tuple(h for h in export.healed if Holder(*h) not in emptied)
        gap_seq = export.gap_seq
    return dataclasses.replace(export, indexes=tuple(indexes), gap_seq=gap_seq, healed=healed)
