"""``kvmesh bench http``: ``kvmesh http``'s RFC #1403 ``/query`` against Dynamo's standalone indexer's, on the
same vLLM ZMQ frames: every answer compared, and the query latency p50/p99 of both in the same run.

The frames are `kvmesh.bench.dynamo_e2e`'s (simulated vLLM 0.33 engines serving the packaged Mooncake
excerpt round-robin, every engine step encoded once). Each system runs alone, fed the frames by real ZMQ
publishers, then is polled until it answers every engine's last prompt with the engines' truth:

* **Dynamo**: ``python -m dynamo.indexer`` (``--dynamo-python``: the interpreter that has the
  ``ai-dynamo-runtime`` wheel, default this one), subscribed to every engine by ``--workers``; queried with
  its own body ``{"token_ids", "model_name"}``; an engine's overlap is its instance's ``longest_matched``.
* **kvmesh**: a private ``nats-server``, one ``kvmesh ingest`` per engine, a ``kvmesh indexer`` and a router
  with ``--http-port``; queried with the RFC body ``{"model", "block_size", "token_ids"}``; an engine's
  overlap is ``longest_matched`` of its instance under tenant ``default``.

Then, on one kept-alive connection at concurrency 1 with bodies encoded before timing: ``--queries``
prompts of ``--query-tokens`` tokens and as many of ``--short-tokens`` (each answer recorded for the
comparison), and ``--query-requests`` timed requests of each length. Reported per system: p50/p99 of each
length; per (prompt, engine) pair: whether the two systems agree, and each against the engines' truth.
Without Dynamo the kvmesh side runs alone and says so.

``--in-process`` measures only the match path of ``/query`` inside one process, no HTTP: the body decoded,
the prompt hashed and `kvmesh.core.index.PrefixIndex.match_tiers` walked, by the compiled path (the body
scan and `kvmesh.core.tables.prompt_keys`) against the Python reference in the same run (msgspec into
ints and `kvmesh.core.hashing.iter_prompt_prefix_keys`), interleaved call by call, with the whole
`kvmesh.router.http_api.answer_query` beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvmesh.bench.dynamo_e2e import (
    BLOCK_SIZE,
    MODEL,
    Frames,
    _free_port,
    _publishers,
    _send_all,
    _Settle,
    _wait_subscribed,
    make_frames,
)
from kvmesh.bench.outputs import out_prefix
from kvmesh.bench.trace import percentile
from kvmesh.core import tables
from kvmesh.core.events import EventsMessage, Stored
from kvmesh.core.hashing import iter_prompt_prefix_keys, local_block_hashes
from kvmesh.core.index import Holder, PrefixIndex
from kvmesh.core.state import IndexState
from kvmesh.router.http_api import QueryBody, answer_query, decode_body, decode_query

__all__ = ["HttpRun", "command", "compare_answers"]

SKIP: Final[str] = (
    "Dynamo's standalone indexer (python -m dynamo.indexer, the ai-dynamo-runtime wheel) is not importable by "
    "{python}: the Dynamo side is skipped. Install the bench extra of kvmesh-tools "
    "(`uv sync --all-packages --extra bench`), or pass --dynamo-python an interpreter that has it."
)


@dataclass(slots=True)
class HttpRun:
    """One system's answers and latencies."""

    system: str
    settled: bool = False
    queryable_s: float = 0.0
    answers: list[list[int]] = field(default_factory=list)
    """Per prompt (long ones, then short ones), every engine's overlap in blocks."""
    long_ms: list[float] = field(default_factory=list)
    short_ms: list[float] = field(default_factory=list)
    errors: int = 0


class _Client:
    def __init__(self, port: int) -> None:
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def post(self, body: bytes) -> dict[str, Any]:
        self._conn.request("POST", "/query", body, {"Content-Type": "application/json"})
        resp = self._conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"/query: HTTP {resp.status}: {data[:200]!r}")
        out: dict[str, Any] = json.loads(data)
        return out

    def close(self) -> None:
        self._conn.close()


def _wait_http(port: int, check: Callable[[], None], probe: bytes, timeout_s: float) -> _Client:
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        client = _Client(port)
        try:
            client.post(probe)
            return client
        except (OSError, RuntimeError, http.client.HTTPException):
            client.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _measure(
    run: HttpRun,
    client: _Client,
    bodies: tuple[list[bytes], list[bytes]],
    overlaps: Callable[[dict[str, Any]], list[int]],
    requests: int,
) -> None:
    long_bodies, short_bodies = bodies
    run.answers = [overlaps(client.post(b)) for b in [*long_bodies, *short_bodies]]
    perf = time.perf_counter
    for series, out in ((long_bodies, run.long_ms), (short_bodies, run.short_ms)):
        for b in series[:20]:
            client.post(b)
        for i in range(requests):
            b = series[i % len(series)]
            t1 = perf()
            try:
                client.post(b)
            except (OSError, RuntimeError, http.client.HTTPException):
                run.errors += 1
                continue
            out.append((perf() - t1) * 1e3)


def _settle(fr: Frames, client: _Client, probes: list[bytes], overlaps: Callable[[dict[str, Any]], list[int]], *,
            check: Callable[[], None], timeout_s: float) -> _Settle:  # fmt: skip
    settle = _Settle(fr.probe_truth, [], timeout_s)
    while not settle.done([overlaps(client.post(p)) for p in probes]):
        check()
        time.sleep(0.02)
    return settle


def run_dynamo(fr: Frames, bodies: tuple[list[bytes], list[bytes]], *, python: str, requests: int,
               timeout_s: float, log_dir: Path) -> HttpRun:  # fmt: skip
    """Dynamo's standalone indexer on the frames, queried with its own ``/query`` body."""
    run = HttpRun(system="dynamo")
    pubs = _publishers(fr.workers)
    port = _free_port()
    workers = ",".join(f"{w + 1}={pub.endpoint}" for w, pub in enumerate(pubs))
    argv = [python, "-m", "dynamo.indexer", "--block-size", str(BLOCK_SIZE), "--port", str(port),
            "--model-name", MODEL, "--workers", workers]  # fmt: skip
    log = open(log_dir / "dynamo-indexer.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client: _Client | None = None

    def check() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"dynamo.indexer exited with {proc.returncode} (log in {log_dir})")

    def overlaps(reply: dict[str, Any]) -> list[int]:
        inst = reply.get("instances") or {}
        return [
            int((inst.get(str(w + 1)) or {}).get("longest_matched", 0)) // BLOCK_SIZE
            for w in range(fr.workers)
        ]

    def dynamo_body(tokens: Sequence[int]) -> bytes:
        return json.dumps({"token_ids": list(tokens), "model_name": MODEL}).encode()

    try:
        _wait_subscribed(pubs, check, 60.0)
        client = _wait_http(port, check, dynamo_body([0] * BLOCK_SIZE), 60.0)
        t0 = time.perf_counter()
        _send_all(pubs, fr.frames)
        settle = _settle(
            fr, client, [dynamo_body(p) for p in fr.probes], overlaps, check=check, timeout_s=timeout_s
        )
        run.settled, run.queryable_s = settle.settled, time.perf_counter() - t0
        _measure(run, client, bodies, overlaps, requests)
    finally:
        if client is not None:
            client.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for pub in pubs:
            pub.close()
    return run


def run_kvmesh(fr: Frames, bodies: tuple[list[bytes], list[bytes]], *, requests: int, timeout_s: float,
               log_dir: Path) -> HttpRun:  # fmt: skip
    """The kvmesh pipeline on the frames, queried on the router's RFC #1403 ``/query``."""
    from kvmesh.harness.procs import ChildProcesses  # noqa: PLC0415
    from kvmesh.harness.server import NatsServer  # noqa: PLC0415

    run = HttpRun(system="kvmesh")
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-http-"))
    server = NatsServer(store_dir=tmp / "nats").start()
    children = ChildProcesses(log_dir)
    pubs = _publishers(fr.workers)
    port = _free_port()
    names = [f"sim-{w}" for w in range(fr.workers)]
    client: _Client | None = None

    def overlaps(reply: dict[str, Any]) -> list[int]:
        inst = reply.get("default") or {}
        return [int((inst.get(n) or {}).get("longest_matched", 0)) // BLOCK_SIZE for n in names]

    try:
        url = str(server.url)
        for w, pub in enumerate(pubs):
            children.spawn(
                f"ingest-{w}", "-m", "kvmesh.ingest", "--nats-url", url, "--worker-id", names[w], "--model", MODEL,
                "--zmq-endpoint", pub.endpoint, "--replay-endpoint", str(pub.replay_endpoint),
                "--block-size", str(BLOCK_SIZE),
            )  # fmt: skip
        children.spawn("indexer", "-m", "kvmesh.indexer", "--nats-url", url)
        children.spawn("router", "-m", "kvmesh.router", "--nats-url", url, "--http-port", str(port))
        _wait_subscribed(pubs, children.check, 90.0)
        probe = kvmesh_body([0] * BLOCK_SIZE)
        deadline = time.monotonic() + 90.0
        client = _wait_http(port, children.check, probe, 90.0)
        while len(client.post(probe).get("default", {})) < fr.workers:  # every ingest announced
            children.check()
            if time.monotonic() > deadline:
                raise RuntimeError("the kvmesh pipeline did not know every engine in 90 s")
            time.sleep(0.05)
        t0 = time.perf_counter()
        _send_all(pubs, fr.frames)
        settle = _settle(
            fr,
            client,
            [kvmesh_body(p) for p in fr.probes],
            overlaps,
            check=children.check,
            timeout_s=timeout_s,
        )
        run.settled, run.queryable_s = settle.settled, time.perf_counter() - t0
        _measure(run, client, bodies, overlaps, requests)
    finally:
        if client is not None:
            client.close()
        children.stop()
        for pub in pubs:
            pub.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return run


def kvmesh_body(tokens: Sequence[int]) -> bytes:
    """The RFC #1403 ``/query`` body of ``tokens``."""
    return json.dumps({"model": MODEL, "block_size": BLOCK_SIZE, "token_ids": list(tokens)}).encode()


def compare_answers(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> tuple[int, int, int, int]:
    """(pairs, equal, a over b, a under b) over every (prompt, engine) pair."""
    pairs = equal = over = under = 0
    for x, y in zip(a, b, strict=True):
        for i, j in zip(x, y, strict=True):
            pairs += 1
            equal += i == j
            over += i > j
            under += i < j
    return pairs, equal, over, under


def _has_dynamo(python: str) -> bool:
    try:
        done = subprocess.run(
            [python, "-c", "import dynamo.indexer"], capture_output=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def in_process(
    *, prompts: int = 30, tokens: Sequence[int] = (64, 4096), calls: int = 6000
) -> dict[int, dict[str, float]]:
    """The ``--in-process`` comparison: 4 workers each holding a random leading part (64 – 255 blocks of 16) of
    every one of ``prompts`` random 4,096-token prompts; per prompt length, the median µs of each path over
    ``calls`` interleaved calls. Raises AssertionError if the two paths ever answer differently."""
    rng = random.Random(1)
    st = IndexState()
    index = PrefixIndex()  # the same blocks, for the two match paths alone
    texts = [[rng.randrange(50_000) for _ in range(4096)] for _ in range(prompts)]
    for p, toks in enumerate(texts):
        local = local_block_hashes(toks, BLOCK_SIZE)
        for w in range(4):
            n = rng.randrange(64, 256)
            engine = [p * 1000 + i + w * 10**7 for i in range(n)]
            msg = EventsMessage(worker_id=f"w{w}", dp_rank=0, model=MODEL, block_size=BLOCK_SIZE, epoch=1,
                                seq=p + 1, events=[Stored(engine, None, local[:n])])  # fmt: skip
            st.apply(p * 4 + w + 1, msg)
            index.store(Holder(f"w{w}", 0), engine, None, local[:n])

    def reference(body: bytes) -> object:
        q = decode_body(body, QueryBody)
        assert q.token_ids is not None
        return index.match_tiers(iter_prompt_prefix_keys(q.token_ids, BLOCK_SIZE))

    def compiled(body: bytes) -> object:
        q, ids = decode_query(body)
        tokens = tables.token_array(ids if ids is not None else q.token_ids or [])
        return index.match_tiers(tables.prompt_keys(tokens, BLOCK_SIZE))

    def whole(body: bytes) -> object:
        return answer_query(st, body, by_hash=False, tenants={})

    paths: dict[str, Callable[[bytes], object]] = {
        "reference": reference,
        "compiled": compiled,
        "answer_query": whole,
    }
    out: dict[int, dict[str, float]] = {}
    for n in tokens:
        bodies = [
            json.dumps({"model": MODEL, "block_size": BLOCK_SIZE, "token_ids": t[:n]}).encode() for t in texts
        ]
        assert all(reference(b) == compiled(b) for b in bodies), "the compiled path answered differently"
        times: dict[str, list[int]] = {k: [] for k in paths}
        for i in range(calls):
            b = bodies[i % len(bodies)]
            for k, f in paths.items():
                t0 = time.perf_counter_ns()
                f(b)
                times[k].append(time.perf_counter_ns() - t0)
        out[n] = {k: sorted(v)[len(v) // 2] / 1000 for k, v in times.items()}
    return out


def _pooled(runs: Sequence[HttpRun]) -> HttpRun | None:
    """One system's rounds as one run: latencies pooled, settled only if every round settled, the first
    round's answers (each round is checked against the truth the same way)."""
    if not runs:
        return None
    return dataclasses.replace(
        runs[0],
        settled=all(r.settled for r in runs),
        queryable_s=max(r.queryable_s for r in runs),
        short_ms=[x for r in runs for x in r.short_ms],
        long_ms=[x for r in runs for x in r.long_ms],
        errors=sum(r.errors for r in runs),
    )


def command(argv: Sequence[str] | None = None) -> int:
    """Run ``kvmesh bench http``; returns the exit code (1 when kvmesh did not become queryable or answered
    a pair differently from the engines' truth)."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench http", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=4, help="simulated engines (default 4)")
    p.add_argument("--requests", type=int, default=1000, help="trace requests served (default 1000, all)")
    p.add_argument("--num-blocks", type=int, default=16384, help="KV blocks per engine (default 16384)")
    p.add_argument("--queries", type=int, default=200, help="prompts compared, per length (default 200)")
    p.add_argument("--query-tokens", type=int, default=4096, help="tokens of a long prompt (default 4096)")
    p.add_argument("--short-tokens", type=int, default=64, help="tokens of a short prompt (default 64)")
    p.add_argument("--query-requests", type=int, default=1000, help="timed queries per length (default 1000)")
    p.add_argument("--dynamo-python", default=sys.executable, help="interpreter with ai-dynamo-runtime")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="give up waiting for the engines' truth on every engine's last prompt (default 300; Dynamo's tree may "
        "never reach it: then it is queried as it stands after this long)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the systems this many times each, alternating (Dynamo, kvmesh, Dynamo, ...), and report each "
        "round's kvmesh/Dynamo p50 ratio beside the table (default 1; on a shared machine the load moves between "
        "runs, so a ratio within one round is the fairer figure)",
    )
    p.add_argument("--log-dir", default=None, help="keep the child processes' logs here")
    p.add_argument("--out", metavar="PREFIX", type=out_prefix, help="write PREFIX.json")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="measure only the match path of /query in this process, compiled against the Python reference "
        "(no servers; see above)",
    )
    a = p.parse_args(argv)
    if a.in_process:
        print("| prompt | reference (µs) | compiled (µs) | compiled / reference | whole answer_query (µs) |")
        print("|---|---:|---:|---:|---:|")
        for n, med in in_process().items():
            print(f"| {n:,} tokens | {med['reference']:.1f} | {med['compiled']:.1f} "
                  f"| {med['compiled'] / med['reference']:.2f}× | {med['answer_query']:.1f} |")  # fmt: skip
        return 0
    if min(a.workers, a.requests, a.queries, a.query_tokens, a.short_tokens, a.query_requests, a.rounds) <= 0:
        p.error("every count must be positive")
    fr = make_frames(
        a.workers, a.requests, num_blocks=a.num_blocks, queries=a.queries, query_tokens=a.query_tokens
    )
    shorts = [q[: a.short_tokens] for q in fr.queries]
    print(
        f"kvmesh bench http: {fr.served} requests on {a.workers} engines, {fr.block_ops:,} block operations; "
        f"{len(fr.queries)} prompts of ≤ {a.query_tokens} and of {a.short_tokens} tokens",
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-http-logs-"))
    log_dir = Path(a.log_dir) if a.log_dir else tmp
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: list[HttpRun] = []
    rounds: list[tuple[HttpRun | None, HttpRun]] = []
    try:
        has_dynamo = _has_dynamo(a.dynamo_python)
        if not has_dynamo:
            print(SKIP.format(python=a.dynamo_python))
        dyn_bodies = (
            [json.dumps({"token_ids": q, "model_name": MODEL}).encode() for q in fr.queries],
            [json.dumps({"token_ids": q, "model_name": MODEL}).encode() for q in shorts],
        )
        bodies = ([kvmesh_body(q) for q in fr.queries], [kvmesh_body(q) for q in shorts])
        for _ in range(a.rounds):
            dyn = (
                run_dynamo(
                    fr,
                    dyn_bodies,
                    python=a.dynamo_python,
                    requests=a.query_requests,
                    timeout_s=a.timeout_s,
                    log_dir=log_dir,
                )
                if has_dynamo
                else None
            )
            mine = run_kvmesh(fr, bodies, requests=a.query_requests, timeout_s=a.timeout_s, log_dir=log_dir)
            rounds.append((dyn, mine))
            for r in (dyn, mine):
                if r is not None:
                    print(
                        f"{r.system}: {'settled' if r.settled else 'NOT settled'} after {r.queryable_s:.1f} s",
                        flush=True,
                    )
        # every round's samples pooled per system for the table
        pooled = (_pooled([r for r, _ in rounds if r is not None]), _pooled([m for _, m in rounds]))
        runs = [r for r in pooled if r is not None]
    finally:
        if not a.log_dir:
            shutil.rmtree(tmp, ignore_errors=True)
    truth = fr.truth[: len(fr.queries)]
    truth = [*truth, *[[min(n, a.short_tokens // BLOCK_SIZE) for n in t] for t in truth]]
    print(
        "\n| system | settled | /query p50 short (ms) | p99 short | p50 long (ms) | p99 long | errors "
        "| pairs equal to the engines' truth (over / under) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    doc: dict[str, Any] = {"config": vars(a) | {"served": fr.served, "block_ops": fr.block_ops}, "runs": []}
    for r in runs:
        pairs, eq, over, under = compare_answers(r.answers, truth)
        print(
            f"| {r.system} | {'yes' if r.settled else 'NO'} | {percentile(r.short_ms, 0.5):.3f} "
            f"| {percentile(r.short_ms, 0.99):.3f} | {percentile(r.long_ms, 0.5):.3f} "
            f"| {percentile(r.long_ms, 0.99):.3f} | {r.errors} | {eq} of {pairs} ({over} / {under}) |"
        )
        doc["runs"].append(
            {
                "system": r.system, "settled": r.settled, "queryable_s": r.queryable_s,
                "short_p50_ms": percentile(r.short_ms, 0.5), "short_p99_ms": percentile(r.short_ms, 0.99),
                "long_p50_ms": percentile(r.long_ms, 0.5), "long_p99_ms": percentile(r.long_ms, 0.99),
                "truth_pairs": pairs, "truth_equal": eq, "truth_over": over, "truth_under": under,
            }
        )  # fmt: skip
    if len(runs) == 2:
        pairs, eq, over, under = compare_answers(runs[1].answers, runs[0].answers)
        print(
            f"\nkvmesh vs Dynamo: {eq} of {pairs} (prompt, engine) answers equal; kvmesh higher on {over}, lower on {under}"
        )
        doc["agreement"] = {"pairs": pairs, "equal": eq, "kvmesh_over": over, "kvmesh_under": under}
        for name, i in (("short", "short_p50_ms"), ("long", "long_p50_ms")):
            k, d = doc["runs"][1][i], doc["runs"][0][i]
            print(
                f"- /query p50, {name} prompts: kvmesh {k:.3f} ms, Dynamo {d:.3f} ms — {'meets' if k <= d else 'MISSES'}"
            )
    if has_dynamo and a.rounds > 1:
        print("\n| round | kvmesh/Dynamo p50 short | p50 long |")
        print("|---:|---:|---:|")
        doc["rounds"] = []
        for n, (dyn, mine) in enumerate(rounds, 1):
            assert dyn is not None
            short = percentile(mine.short_ms, 0.5) / percentile(dyn.short_ms, 0.5)
            long = percentile(mine.long_ms, 0.5) / percentile(dyn.long_ms, 0.5)
            print(f"| {n} | {short:.2f}× | {long:.2f}× |")
            doc["rounds"].append({"short_ratio": short, "long_ratio": long})
    if a.out:
        Path(f"{a.out}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"wrote {a.out}.json")
    exact = all(
        compare_answers(m.answers, truth)[1] == compare_answers(m.answers, truth)[0] for _, m in rounds
    )
    return 0 if runs[-1].settled and exact else 1


if __name__ == "__main__":
    sys.exit(command())
