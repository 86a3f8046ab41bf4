"""The readable ``kvmesh status``: a `StatusReport` as text tables, and the route rate between two reports.

Pure code: no NATS, no clock, no terminal. ``kvmesh status`` prints `render_status` of one report;
``kvmesh status --watch`` redraws it every second with each router's route rate (`route_rates`, from the
``routed`` counters of two successive reports). ``kvmesh status --json`` prints the report itself
(`msgspec.to_builtins`), the versioned schema scripts should read (`kvmesh.ops.report.STATUS_SCHEMA`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvmesh.core.protocol import IngestStatus
from kvmesh.ops.report import (
    ReplicaStatus,
    RouterSummary,
    SnapshotView,
    StatusReport,
    Unreadable,
    WorkerView,
)

__all__ = ["render_status", "route_rates"]

_NONE = "-"


def route_rates(previous: StatusReport, current: StatusReport, elapsed_s: float) -> dict[str, float]:
    """Routes per second of every router in both reports, by router id: the rise of its ``routed`` counter
    over ``elapsed_s`` seconds (0.0 when the counter went down: the router restarted).

    Raises:
        ValueError: ``elapsed_s`` is not positive.
    """
    if elapsed_s <= 0:
        raise ValueError(f"elapsed_s must be positive, got {elapsed_s}")
    before = {r.id: r.routed for r in previous.routers}
    return {r.id: max(0, r.routed - before[r.id]) / elapsed_s for r in current.routers if r.id in before}


def render_status(report: StatusReport, *, rates: Mapping[str, float] | None = None) -> str:
    """Render a report as text: the stream and convergence lines, then a table each for the replicas,
    snapshots, workers, ingests and routers (a ``rate/s`` column when ``rates`` is given), and the replies
    that did not decode. Numbers are right-aligned with thousands separators; ``-`` is an absent value.

    Returns:
        The text, ending with a newline.
    """
    out: list[str] = [_stream_line(report), _convergence_line(report)]
    out += _section("replicas", _replicas(report.replicas))
    out += _section("snapshots", _snapshots(report.snapshots))
    out += _section("workers", _workers(report.workers))
    out += _section("ingests", _ingests(report.ingests))
    out += _section("routers", _routers(report.routers, rates))
    out += _section("route receipts (tokens)", _receipts(report.routers))
    if report.undecodable:
        out += ["", "undecodable replies"]
        out += [f"  {line}" for line in report.undecodable]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------- lines


def _stream_line(report: StatusReport) -> str:
    s = report.stream
    if s.error is not None:
        return f"stream {s.name}: {s.error}"
    return (
        f"stream {s.name}: {_num(s.messages)} messages, {_bytes(s.bytes)}, "
        f"sequences {_num(s.first_seq)}..{_num(s.last_seq)}"
    )


def _convergence_line(report: StatusReport) -> str:
    c = report.convergence
    state = "converged" if c.converged else "not converged"
    digests = ", ".join(c.digests) or _NONE
    line = (
        f"convergence: {state} at sequence {_num(c.stream_last_seq)} "
        f"({_plural(c.indexers, 'indexer')}, {_plural(c.routers, 'local-index router')}; "
        f"digests {digests})"
    )
    if c.behind:
        line += "; behind: " + ", ".join(c.behind)
    return line


def _section(title: str, table: list[str] | str) -> list[str]:
    if isinstance(table, str):
        return ["", f"{title}: {table}"]
    return ["", title, *table] if table else ["", f"{title}: none"]


# ---------------------------------------------------------------------------------------- tables


def _replicas(replicas: Sequence[ReplicaStatus]) -> list[str]:
    rows = [
        [
            r.replica,
            _yes(r.ready),
            _num(r.applied_seq),
            _num(r.lag),
            _blocks(r.blocks, r.max_blocks, r.counters.get("evicted_blocks", 0)),
            r.digest,
            _yes(r.complete),
            "writer" if r.snapshot_writer else "",
            r.warning if isinstance(r.warning, str) else "",
        ]
        for r in replicas
    ]
    return _table(
        ["replica", "ready", "applied", "lag", "blocks", "digest", "complete", "snapshots", "warning"],
        rows,
        right={2, 3, 4},
    )


def _snapshots(snapshots: Sequence[SnapshotView] | Unreadable) -> list[str] | str:
    if isinstance(snapshots, Unreadable):
        return f"unreadable ({snapshots.error})"
    rows = [[s.name, _num(s.seq), _bytes(s.bytes), _age(s.age_s)] for s in snapshots]
    return _table(["name", "sequence", "size", "age"], rows, right={1, 2, 3})


def _workers(workers: Mapping[str, WorkerView] | Unreadable) -> list[str] | str:
    if isinstance(workers, Unreadable):
        return f"unreadable ({workers.error})"
    rows = [
        [
            w,
            v.model or _NONE,
            _num(v.dp_ranks),
            _num(v.block_size),
            _num(v.incarnation),
            _yes(v.registered),
            _age(v.heartbeat_age_s),
            _age(v.last_event_age_s),
        ]
        for w, v in workers.items()
    ]
    return _table(
        ["worker", "model", "ranks", "block size", "incarnation", "registered", "heartbeat", "last event"],
        rows,
        right={2, 3, 4, 6, 7},
    )


def _ingests(ingests: Sequence[IngestStatus]) -> list[str]:
    rows: list[list[str]] = []
    for ing in ingests:
        c = ing.counters
        first = True
        for rank in sorted(ing.ranks, key=_rank_order):
            r = ing.ranks[rank]
            seq = r.sequence
            rows.append(
                [
                    ing.worker_id if first else "",
                    rank,
                    f"{r.engine.state}"
                    + (f" ({r.engine.reason})" if r.engine.reason else "")
                    + ("" if ing.kv_events else ", no KV events"),
                    _num(r.epoch),
                    _num(r.last_seq),
                    _num(seq.get("gaps")),
                    _num(seq.get("replays")),
                    _num(seq.get("resyncs")),
                    _num(c.get("published")) if first else "",
                    _num(ing.outbox) if first else "",
                    _num(c.get("rejected_events")) if first else "",
                    _num(c.get("dropped_batches")) if first else "",
                ]
            )
            first = False
        if first:  # an ingest with no rank yet
            totals = [c.get("published"), ing.outbox, c.get("rejected_events"), c.get("dropped_batches")]
            rows.append([ing.worker_id, *[_NONE] * 7, *map(_num, totals)])
    return _table(
        [
            "worker",
            "rank",
            "engine",
            "epoch",
            "last seq",
            "gaps",
            "replays",
            "resyncs",
            "published",
            "outbox",
            "rejected",
            "dropped",
        ],
        rows,
        right=set(range(3, 12)),
    )


def _routers(routers: Sequence[RouterSummary], rates: Mapping[str, float] | None) -> list[str]:
    rows: list[list[str]] = []
    for r in routers:
        errors = ", ".join(f"{code} {n:,}" for code, n in sorted(r.errors.items()) if n) or _NONE
        row = [
            r.id,
            r.mode,
            r.route_mode + (f" ({r.degraded_reason})" if r.degraded_reason else ""),
            _num(r.applied_seq),
            _num(r.lag),
            _blocks(r.blocks, r.max_blocks, r.evicted_blocks or 0),
            _num(r.routed),
        ]
        if rates is not None:
            rate = rates.get(r.id)
            row.append(_NONE if rate is None else f"{rate:,.1f}")
        p99 = _NONE if r.latency is None else f"{r.latency.p99_ms:,.2f}"
        row += [p99, _num(r.in_flight), errors, r.warning or ""]
        rows.append(row)
    headers = ["router", "index", "route mode", "applied", "lag", "blocks", "routed"]
    if rates is not None:
        headers.append("rate/s")
    headers += ["p99 ms", "in flight", "errors", "warning"]
    return _table(headers, rows, right=set(range(3, len(headers) - 2)))


def _receipts(routers: Sequence[RouterSummary]) -> list[str]:
    """Per router and (worker, rank): the reuse available, captured by the choice and delivered by the engine
    (token counters), with the regret and the misprediction."""
    rows: list[list[str]] = []
    for r in routers:
        for holder, t in sorted(r.receipts.items()):
            rows.append(
                [
                    r.id,
                    holder,
                    _num(t.requests),
                    _num(t.available_tokens),
                    _num(t.captured_tokens),
                    _num(t.regret_tokens),
                    _num(t.delivered_requests),
                    _num(t.delivered_tokens),
                    _num(t.misprediction_tokens),
                ]
            )
    headers = [
        "router",
        "worker/rank",
        "requests",
        "available",
        "captured",
        "regret",
        "reported",
        "delivered",
    ]
    headers.append("mispredicted")
    return _table(headers, rows, right=set(range(2, len(headers))))


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: set[int]) -> list[str]:
    """Rows under a header, two spaces between columns, indented by two; trailing blanks trimmed."""
    if not rows:
        return []
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return ("  " + "  ".join(parts)).rstrip()

    return [line(headers), *(line(row) for row in rows)]


# ---------------------------------------------------------------------------------------- cells


def _blocks(blocks: int | None, bound: int | None, evicted: int) -> str:
    """A replica's blocks, with its bound and evictions when it has a bound: ``"63 of 64, 4 evicted"``."""
    if bound is None:
        return _num(blocks)
    return f"{_num(blocks)} of {bound:,}" + (f", {evicted:,} evicted" if evicted else "")


def _num(value: int | None) -> str:
    return _NONE if value is None else f"{value:,}"


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _bytes(n: int | None) -> str:
    if n is None:
        return _NONE
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:,.1f} {unit}"


def _age(age_s: float | None) -> str:
    if age_s is None:
        return _NONE
    if age_s < 60:
        return f"{age_s:.1f} s"
    if age_s < 3600:
        return f"{age_s / 60:.1f} min"
    return f"{age_s / 3600:.1f} h"


def _rank_order(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 30, rank)
