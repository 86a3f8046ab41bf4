"""``kvmesh bench index``: the prefix index against Dynamo's Rust RadixTree and a naive dict index.

One deterministic workload (`make_workload`) of block events over 8 workers is generated first, then fed, in
the same process and run, to:

* kvmesh's `kvmesh.core.index.PrefixIndex` through ``store``/``remove`` (what the indexer calls);
* NVIDIA Dynamo's ``RadixTree`` (``ai-dynamo-runtime``, the ``bench`` extra) through ``apply_event`` with
  pre-encoded JSON events (encoding is not timed);
* `NaiveIndex`, a plain dict-of-sets index, the baseline a reader would write first.

Figures: apply rate in block operations/s (a stored or removed block = one operation), match latency
p50/p99 in µs for 4,096-token prompts (256 blocks of 16), and, on every query, whether all three agree.
Eviction order: ``tail`` evicts the least recently used blocks, a prompt's last blocks first (vLLM's free
queue; every worker's cache stays prefix-closed), ``random`` evicts a random block among the 64 least recently
used (a cache with holes). ``kvmesh bench index --memory`` measures bytes per stored block at 1M blocks
(`memory_per_block`: resident-set growth of a fresh process per index).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import xxhash

from kvmesh.bench.trace import percentile
from kvmesh.core.hashing import SEED, prefix_keys, sequence_hashes
from kvmesh.core.index import Holder, PrefixIndex

__all__ = ["NaiveIndex", "Workload", "command", "make_workload"]

PROMPT_BLOCKS: Final[int] = 256
"""Blocks of a 4,096-token prompt at block size 16."""
_MASK64: Final[int] = 2**64 - 1

Store = tuple[int, tuple[int, ...], int | None, tuple[int, ...]]
"""(worker, engine hashes, parent engine hash, local hashes)."""
Remove = tuple[int, tuple[int, ...]]
"""(worker, engine hashes)."""


@dataclass(slots=True)
class Workload:
    """A deterministic stream of block events and the queries to ask after it."""

    workers: int
    events: list[Store | Remove] = field(default_factory=list)
    queries: list[list[int]] = field(default_factory=list)
    """Each query: the local hashes of a 256-block prompt."""
    stored_blocks: int = 0
    removed_blocks: int = 0

    @property
    def block_ops(self) -> int:
        """Stored plus removed blocks."""
        return self.stored_blocks + self.removed_blocks


def make_workload(
    *, target_ops: int = 1_000_000, workers: int = 8, capacity: int = 16384, eviction: str = "tail",
    merge_removals: bool = True, queries: int = 2000, seed: int = 0, engine_hashes: str = "shared",
) -> Workload:  # fmt: skip
    """Generate conversations over shared system prompts, served with 80 % worker affinity, until
    ``target_ops`` block operations; each worker caches ``capacity`` blocks.

    Args:
        target_ops: stop once stored + removed blocks reach this.
        workers: workers (one dp rank each).
        capacity: blocks a worker caches before evicting.
        eviction: ``"tail"`` (LRU, a prompt's tail first) or ``"random"`` (random among the 64 oldest).
        merge_removals: one removal event per request (an engine step's batch) instead of one per block.
        queries: prompts to query afterwards (continuations of live conversations and fresh ones).
        seed: the generator's seed.
        engine_hashes: ``"shared"``: equal prefixes get equal engine hashes on every worker (vLLM >= 0.29
            with sha256, or a fixed ``PYTHONHASHSEED``); ``"per-worker"``: every worker hashes differently
            (vLLM's builtin ``hash()`` without ``PYTHONHASHSEED``, or different seeds).
    """
    rng = random.Random(seed)
    bits = rng.getrandbits
    systems = [[bits(64) for _ in range(32)] for _ in range(16)]
    convs: list[tuple[list[int], list[int], int]] = []  # (local hashes, sequence hashes, home worker)
    caches: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(workers)]  # seq -> engine hash
    wl = Workload(workers=workers)
    salts = [
        xxhash.xxh3_64_intdigest(f"worker-{w}".encode()) if engine_hashes == "per-worker" else 0x5BD1E995
        for w in range(workers)
    ]

    def engine_hash(w: int, seq: int) -> int:
        return (seq * 0x9E3779B97F4A7C15 + salts[w]) & _MASK64 or 1

    def new_conv() -> tuple[list[int], list[int], int]:
        local = list(systems[rng.randrange(len(systems))])
        return local, sequence_hashes(local), rng.randrange(workers)

    def serve(w: int, local: list[int], seqs: list[int]) -> None:
        cache = caches[w]
        n = len(seqs)
        i = 0
        while i < n:
            if seqs[i] in cache:
                i += 1
                continue
            j = i
            while j < n and seqs[j] not in cache:
                j += 1
            hashes = tuple(engine_hash(w, s) for s in seqs[i:j])
            parent = cache[seqs[i - 1]] if i else None
            wl.events.append((w, hashes, parent, tuple(local[i:j])))
            wl.stored_blocks += j - i
            for s, h in zip(seqs[i:j], hashes, strict=True):
                cache[s] = h
            i = j
        for s in reversed(seqs):  # the tail ends up least recently used
            cache.move_to_end(s)
        removed: list[int] = []
        while len(cache) > capacity:
            if eviction == "tail":
                _s, h = cache.popitem(last=False)
            else:
                k = rng.randrange(min(64, len(cache)))
                victim = next(s for idx, s in enumerate(cache) if idx == k)
                h = cache.pop(victim)
            removed.append(h)
        if removed:
            wl.removed_blocks += len(removed)
            if merge_removals:
                wl.events.append((w, tuple(removed)))
            else:
                wl.events.extend((w, (h,)) for h in removed)

    while wl.block_ops < target_ops:
        if convs and rng.random() < 0.7:
            c = len(convs) - 1 - min(len(convs) - 1, int(rng.expovariate(1 / 50)))
        else:
            convs.append(new_conv())
            c = len(convs) - 1
        local, seqs, home = convs[c]
        extra = [bits(64) for _ in range(rng.randint(8, 48))]
        seqs.extend(sequence_hashes(extra, seqs[-1]))
        local.extend(extra)
        w = home if rng.random() < 0.8 else rng.randrange(workers)
        serve(w, local[:PROMPT_BLOCKS], seqs[:PROMPT_BLOCKS])
        if len(local) >= PROMPT_BLOCKS:
            convs.pop(c)
    for _ in range(queries):
        if convs and rng.random() < 0.8:
            local = convs[rng.randrange(len(convs))][0]
            q = local[:PROMPT_BLOCKS] + [bits(64) for _ in range(max(0, PROMPT_BLOCKS - len(local)))]
        else:
            q = list(systems[rng.randrange(len(systems))]) + [bits(64) for _ in range(PROMPT_BLOCKS - 32)]
        wl.queries.append(q)
    return wl


class NaiveIndex:
    """The index a reader writes first: per worker a dict engine hash → sequence hash and a set of sequence
    hashes; a match walks every worker's set."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[int, int]] = {}
        self.held: dict[int, set[int]] = {}

    def store(self, w: int, hashes: Sequence[int], parent: int | None, local: Sequence[int]) -> None:
        """Index a BlockStored (an unknown parent drops the event)."""
        blocks = self.blocks.setdefault(w, {})
        held = self.held.setdefault(w, set())
        if parent is None:
            prev = None
        else:
            prev = blocks.get(parent)
            if prev is None:
                return
        for h, seq in zip(hashes, sequence_hashes(local, prev), strict=True):
            blocks[h] = seq
            held.add(seq)

    def remove(self, w: int, hashes: Sequence[int]) -> None:
        """Apply a BlockRemoved."""
        blocks = self.blocks.get(w, {})
        for h in hashes:
            seq = blocks.pop(h, None)
            if seq is not None:
                self.held[w].discard(seq)

    def match(self, seqs: Sequence[int]) -> dict[int, int]:
        """Leading blocks held per worker (workers with zero left out)."""
        out = {}
        for w, held in self.held.items():
            n = 0
            for s in seqs:
                if s not in held:
                    break
                n += 1
            if n:
                out[w] = n
        return out


def _load_dynamo() -> Any:
    os.environ.setdefault("DYN_LOG", "error")  # one warning per rejected event otherwise
    os.environ.setdefault("RUST_LOG", "error")
    try:
        from dynamo._core import RadixTree  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415 - optional extra
    except ImportError:
        return None
    return RadixTree


def _dynamo_events(wl: Workload) -> list[tuple[int, bytes]]:
    enc = msgspec.json.encode
    out = []
    for i, ev in enumerate(wl.events):
        if len(ev) == 4:
            w, hashes, parent, local = ev
            data: Any = {
                "stored": {
                    "parent_hash": parent,
                    "blocks": [
                        {"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, local, strict=True)
                    ],
                }
            }
        else:
            w, hashes = ev
            data = {"removed": {"block_hashes": list(hashes)}}
        out.append((w, enc({"event_id": i, "dp_rank": 0, "data": data})))
    return out


@dataclass(slots=True)
class Side:
    """One index's figures."""

    name: str
    apply_s: float = 0.0
    match_us: list[float] = field(default_factory=list)
    results: list[dict[int, int]] = field(default_factory=list)
    errors: int = 0


def _time_matches(side: Side, queries: Sequence[Any], fn: Callable[[Any], dict[int, int]]) -> None:
    perf = time.perf_counter
    for q in queries:
        t0 = perf()
        r = fn(q)
        side.match_us.append(1e6 * (perf() - t0))
        side.results.append(r)


KVMESH: Final[str] = "kvmesh PrefixIndex"
BASELINE: Final[str] = "kvmesh PrefixIndex (--baseline)"
ORDERED: Final[str] = "kvmesh PrefixIndex keeping store order (--max-blocks)"
DYNAMO: Final[str] = "Dynamo RadixTree (ai-dynamo-runtime)"
NAIVE: Final[str] = "naive dict index"


def load_index_module(path: str) -> Any:
    """Import another version of ``kvmesh/core/index.py`` (e.g. from ``git show``) for ``--baseline``."""
    spec = importlib.util.spec_from_file_location("kvmesh_bench_baseline_index", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


def run_index(
    wl: Workload,
    *,
    with_dynamo: bool = True,
    repeat: int = 3,
    say: Callable[[str], None] = print,
    baseline: Any = None,
    keep_order: bool = False,
) -> list[Side]:
    """Feed the workload to every index, time apply and match, and collect every query's answer.

    ``keep_order``: also time kvmesh's index keeping each cache's store order (what ``--max-blocks`` needs;
    no bound is reached here, so it measures the bookkeeping alone), on apply only, in the same rounds.

    ``baseline``: another version of the index module (`load_index_module`), timed on apply only, in the same
    interleaved rounds (its keys may differ from this version's, so its matches are not compared).

    Apply is timed ``repeat`` times per index on a fresh index, the indexes interleaved round by round so
    that noise from other processes hits all of them alike; the best round counts. Matches are timed on the
    last round's indexes. Each round of kvmesh and of the naive index gets the events freshly decoded from
    msgpack (not timed), as the indexer decodes them from the stream: every hash is a new int object, so no
    index finds a removed block's hash by object identity with the one it stored (which a reused workload
    would allow and production never does). The decoded events are frozen out of the garbage collector's
    generations while timed, so their collection cost stays the harness's.
    """
    holders = [Holder(f"w{w}", 0) for w in range(wl.workers)]
    back = {h: w for w, h in enumerate(holders)}
    radix_tree = _load_dynamo() if with_dynamo else None
    if radix_tree is None and with_dynamo:
        say("  Dynamo's RadixTree is not installed (`uv sync --all-packages --extra bench`): skipped")
    payloads = _dynamo_events(wl) if radix_tree is not None else []
    encoded = msgspec.msgpack.encode(wl.events)
    events: list[Any] = []

    def apply_ordered() -> tuple[PrefixIndex, int]:
        return apply_kvmesh(ordered=True)

    def apply_kvmesh(*, ordered: bool = False) -> tuple[PrefixIndex, int]:
        # As `kvmesh.core.state.IndexState.apply` does with a stream message: consecutive removals of one
        # worker (one engine step's BlockRemoved per block) in one call.
        index = PrefixIndex(keep_order=ordered)
        store, remove = index.store, index.remove
        pending: list[int] = []
        who = -1
        for ev in events:
            if len(ev) == 4:
                if pending:
                    remove(holders[who], pending)
                    pending = []
                store(holders[ev[0]], ev[1], ev[2], ev[3])
            else:
                if pending and ev[0] != who:
                    remove(holders[who], pending)
                    pending = []
                who = ev[0]
                pending.extend(ev[1])
        if pending:
            remove(holders[who], pending)
        return index, 0

    def apply_dynamo() -> tuple[Any, int]:
        assert radix_tree is not None
        tree = radix_tree()
        apply = tree.apply_event
        errors = 0
        for w, payload in payloads:
            try:
                apply(w, payload)
            except (RuntimeError, ValueError):
                errors += 1
        return tree, errors

    def apply_naive() -> tuple[NaiveIndex, int]:
        ni = NaiveIndex()
        for ev in events:
            if len(ev) == 4:
                ni.store(*ev)
            else:
                ni.remove(*ev)
        return ni, 0

    def apply_baseline() -> tuple[Any, int]:
        index = baseline.PrefixIndex()
        store, remove = index.store, index.remove
        for ev in events:
            if len(ev) == 4:
                store(base_holders[ev[0]], ev[1], ev[2], ev[3])
            else:
                remove(base_holders[ev[0]], ev[1])
        return index, 0

    runners: list[tuple[Side, Callable[[], tuple[Any, int]]]] = [(Side(KVMESH), apply_kvmesh)]
    if keep_order:
        runners.append((Side(ORDERED), apply_ordered))
    if baseline is not None:
        base_holders = [baseline.Holder(f"w{w}", 0) for w in range(wl.workers)]
        runners.append((Side(BASELINE), apply_baseline))
    if radix_tree is not None:
        runners.append((Side(DYNAMO), apply_dynamo))
    runners.append((Side(NAIVE), apply_naive))
    built: dict[str, Any] = {}
    for r in range(max(1, repeat)):
        order = runners[r % len(runners) :] + runners[: r % len(runners)]
        for side, fn in order:
            built.pop(side.name, None)
            events = msgspec.msgpack.decode(encoded) if fn is not apply_dynamo else []
            gc.collect()
            gc.freeze()
            t0 = time.perf_counter()
            obj, errors = fn()
            elapsed = time.perf_counter() - t0
            gc.unfreeze()
            events = []
            side.apply_s = elapsed if not side.apply_s else min(side.apply_s, elapsed)
            side.errors = errors
            built[side.name] = obj

    seq_queries = [sequence_hashes(q) for q in wl.queries]  # the naive index's keys (Dynamo's chain)
    key_queries = [prefix_keys(q) for q in wl.queries]  # kvmesh's 60-bit prefix keys
    sides = [side for side, _fn in runners]
    by_name = {side.name: side for side in sides}
    index = built[KVMESH]
    _time_matches(by_name[KVMESH], key_queries, lambda q: {back[h]: n for h, n in index.match(q).items()})
    if radix_tree is not None:
        tree = built[DYNAMO]
        _time_matches(
            by_name[DYNAMO],
            wl.queries,
            lambda q: {wk[0]: n for wk, n in tree.find_matches(q, early_exit=False).scores.items() if n},
        )
    _time_matches(by_name[NAIVE], seq_queries, built[NAIVE].match)
    hashed = Side("kvmesh PrefixIndex, incl. chaining")
    _time_matches(hashed, wl.queries, lambda q: {back[h]: n for h, n in index.match(prefix_keys(q)).items()})
    return [*sides, hashed]


def disagreements(sides: Sequence[Side], wl: Workload) -> list[str]:
    """Compare every query's answer against the naive index; describe each difference."""
    ref = next(s for s in sides if s.name == NAIVE)
    out = []
    for s in sides:
        if s is ref or not s.results:
            continue
        bad = [i for i, (a, b) in enumerate(zip(s.results, ref.results, strict=True)) if a != b]
        if bad:
            i = bad[0]
            under = sum(1 for k in bad if sum(s.results[k].values()) < sum(ref.results[k].values()))
            out.append(
                f"{s.name}: {len(bad)} of {len(ref.results)} queries differ from the naive index "
                f"({under} under-count); first: query {i}: {dict(sorted(s.results[i].items()))} vs "
                f"{dict(sorted(ref.results[i].items()))}"
            )
    return out


MEMORY_INDEXES: Final[dict[str, str]] = {
    "kvmesh": "kvmesh PrefixIndex",
    "kvmesh-ordered": "kvmesh PrefixIndex keeping store order (--max-blocks)",
    "naive": "naive dict index",
    "dynamo": "Dynamo RadixTree",
}


def memory_per_block(
    blocks: int = 1_000_000,
    workers: int = 8,
    seed: int = 0,
    *,
    with_dynamo: bool = True,
    with_order: bool = False,
) -> dict[str, float]:
    """Bytes per stored block with ``blocks`` blocks indexed (chains of 256 blocks from block 0, 8 workers).

    Method, the same for every index: a **fresh Python process per index** generates the chains one at a
    time (64-bit engine and local hashes, as lists like a decoded stream message carries them), stores each
    and drops it, and reports the growth of its resident set (``/proc/self/statm``) from just before the
    first store to after the last, divided by the blocks stored. So the figure is what the index really
    costs: pymalloc's 16-byte size classes (a 64-bit int asks for 36 bytes and takes 48; tracemalloc
    reports the 36), dict tables at their real fill, and the ints the index keeps from the events it was
    given (the engine hashes become its dict keys), which a measurement over pre-built inputs would not
    count. Dynamo's tree lives in Rust memory, which only this method sees. ``with_order`` adds kvmesh's
    index keeping each cache's store order, what a ``--max-blocks`` bound needs.
    """
    names = ["kvmesh", *(["kvmesh-ordered"] if with_order else []), "naive"]
    if with_dynamo and _load_dynamo() is not None:
        names.append("dynamo")
    out: dict[str, float] = {}
    for name in names:
        code = f"from kvmesh.bench.index import _memory_child; _memory_child({name!r}, {blocks}, {workers}, {seed})"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        out[MEMORY_INDEXES[name]] = result["rss_growth"] / result["blocks"]
    return out


def _memory_child(name: str, blocks: int, workers: int, seed: int) -> None:
    """One index of `memory_per_block`, in a process of its own; prints ``{"rss_growth", "blocks"}``."""
    rng = random.Random(seed)
    bits = rng.getrandbits
    holders = [Holder(f"w{w}", 0) for w in range(workers)]
    add: Callable[[int, list[int], list[int]], object]
    if name.startswith("kvmesh"):
        index = PrefixIndex(keep_order=name == "kvmesh-ordered")
        add = lambda w, hashes, local: index.store(holders[w], hashes, None, local)  # noqa: E731
    elif name == "naive":
        naive = NaiveIndex()
        add = lambda w, hashes, local: naive.store(w, hashes, None, local)  # noqa: E731
    else:
        tree = _load_dynamo()()
        enc = msgspec.json.encode
        serial = iter(range(1 << 62))

        def add(w: int, hashes: list[int], local: list[int]) -> None:
            stored = [{"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, local, strict=True)]
            data = {"stored": {"parent_hash": None, "blocks": stored}}
            tree.apply_event(w, enc({"event_id": next(serial), "dp_rank": 0, "data": data}))

    # One-time process costs (loading the compiled kernels of kvmesh's tables, Dynamo's first event) are not
    # per block: a throwaway instance pays them before the measurement starts.
    if name.startswith("kvmesh"):
        warm = PrefixIndex(keep_order=True)
        warm.store(holders[0], [1, 2], None, [3, 4])
        warm.match([3])
        warm.remove(holders[0], [1, 2])
        warm.remove(holders[0], [9])
        warm.export()
        del warm
    gc.collect()
    rss0 = _rss_bytes()
    n = 0
    while n < blocks:
        w = rng.randrange(workers)
        local = [bits(64) for _ in range(min(PROMPT_BLOCKS, blocks - n))]
        hashes = [bits(64) | 1 for _ in local]
        add(w, hashes, local)
        n += len(local)
    del local, hashes
    gc.collect()
    if name == "dynamo":
        time.sleep(0.2)  # its background thread applies the last events
    print(json.dumps({"rss_growth": _rss_bytes() - rss0, "blocks": n}))


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def command(argv: Sequence[str] | None = None) -> int:
    """Run ``kvmesh bench index``; returns the exit code (1 when kvmesh disagrees with the naive index)."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench index", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ops", type=int, default=1_000_000, help="block operations in the workload (default 1M)")
    p.add_argument("--workers", type=int, default=8, help="workers (default 8)")
    p.add_argument("--capacity", type=int, default=16384, help="blocks each worker caches (default 16384)")
    p.add_argument("--queries", type=int, default=2000, help="4,096-token match queries (default 2000)")
    p.add_argument(
        "--eviction", choices=("tail", "random", "both"), default="both", help="eviction order (default both)"
    )
    p.add_argument(
        "--per-block-removals",
        action="store_true",
        help="one removal event per block (vLLM's wire) instead of one per request",
    )
    p.add_argument("--no-dynamo", action="store_true", help="skip Dynamo's RadixTree")
    p.add_argument("--repeat", type=int, default=3, help="apply rounds per index, best counts (default 3)")
    p.add_argument("--memory", action="store_true", help="also measure bytes per stored block at 1M blocks")
    p.add_argument(
        "--engine-hashes", choices=("shared", "per-worker", "both"), default="both",
        help="engine hashes equal across workers (vLLM >= 0.29 sha256) or different per worker (default both)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--keep-order", action="store_true",
        help="also time the index keeping store order (what --max-blocks needs), apply only",
    )  # fmt: skip
    p.add_argument(
        "--baseline", metavar="PATH",
        help="another version of kvmesh/core/index.py (e.g. `git show REV:shared/src/kvmesh/core/index.py`) "
        "to time on apply in the same rounds, for before/after figures",
    )  # fmt: skip
    a = p.parse_args(argv)
    baseline = load_index_module(a.baseline) if a.baseline else None
    status = 0
    print(
        f"SEED={SEED}; workload: {a.ops:,} block ops over {a.workers} workers, capacity {a.capacity} blocks each"
    )
    evictions = ("tail", "random") if a.eviction == "both" else (a.eviction,)
    hash_modes = ("shared", "per-worker") if a.engine_hashes == "both" else (a.engine_hashes,)
    for eviction, hashes in [(e, h) for h in hash_modes for e in evictions]:
        t0 = time.perf_counter()
        wl = make_workload(
            target_ops=a.ops, workers=a.workers, capacity=a.capacity, eviction=eviction,
            merge_removals=not a.per_block_removals, queries=a.queries, seed=a.seed, engine_hashes=hashes,
        )  # fmt: skip
        print(
            f"\n## eviction {eviction}, engine hashes {hashes}: {len(wl.events):,} events, {wl.stored_blocks:,} stored + "
            f"{wl.removed_blocks:,} removed blocks (generated in {time.perf_counter() - t0:.1f} s)"
        )
        sides = run_index(
            wl, with_dynamo=not a.no_dynamo, repeat=a.repeat, baseline=baseline, keep_order=a.keep_order
        )
        kv = sides[0]
        print(f"(apply: best of {a.repeat} interleaved rounds)")
        print("| index | apply (block ops/s) | vs kvmesh | match p50 (µs) | match p99 (µs) | apply errors |")
        print("|---|---:|---:|---:|---:|---:|")
        for s in sides:
            rate = f"{wl.block_ops / s.apply_s:,.0f}" if s.apply_s else "–"
            ratio = f"{kv.apply_s / s.apply_s:.2f}" if s.apply_s else "–"
            p50, p99 = (
                (f"{percentile(s.match_us, 0.5):.1f}", f"{percentile(s.match_us, 0.99):.1f}")
                if s.match_us
                else ("–", "–")
            )
            print(f"| {s.name} | {rate} | {ratio} | {p50} | {p99} | {s.errors} |")
        diffs = disagreements(sides[:-1], wl)
        print("agreement: " + ("all indexes agree on every query" if not diffs else ""))
        for d in diffs:
            print("  - " + d)
            if d.startswith("kvmesh"):
                status = 1
    if a.memory:
        print(
            "\n## memory per stored block at 1,000,000 blocks (resident-set growth, a fresh process per index)"
        )
        for name, b in memory_per_block(seed=a.seed, with_dynamo=not a.no_dynamo, with_order=True).items():
            print(f"- {name}: {b:.1f} bytes/block")
    return status
