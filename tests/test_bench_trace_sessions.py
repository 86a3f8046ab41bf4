"""`kvmesh bench trace --sessions`: session affinity in the trace replay (a session id made of each request's
first two trace blocks; the kvmesh policies keep each session's last worker within ``session_slack``).
In-process and deterministic: exact values."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.bench import trace as bench_trace
from kvmesh.core.route import Policy
from kvmesh.sim.trace import TraceRequest

KVMESH_POLICIES = ("kvmesh-exact", "kvmesh-lagged", "kvmesh-approx")


def _req(at_ms: int, ids: tuple[int, ...], output_tokens: int) -> TraceRequest:
    return TraceRequest(
        timestamp_ms=at_ms, input_length=512 * len(ids), output_length=output_tokens, hash_ids=ids
    )


CONVERSATION = [
    _req(0, (1, 2), 500),  # session s-1-2, turn 1: 1,024 tokens, decodes 10 s
    _req(1000, (1, *range(50, 69)), 500),  # session s-1-50: 10,240 tokens sharing block 1, decodes 10 s
    _req(3000, (1, 2, 3), 8),  # s-1-2, turn 2
    _req(5000, (1, 2, 3, 4), 8),  # s-1-2, turn 3
]
"""Two workers, default weights. Turn 1 goes to worker 0; the long request follows it there for its shared
first block. At turn 2 worker 0 holds 704 active blocks (decode term 70.4) and the turn's 64 cached blocks
save 64: worker 0 costs 32 + 70.4 = 102.4, idle worker 1 costs 96, so without sessions the load term moves
the conversation (and turn 3 follows its cache to worker 1). With sessions worker 0 is 6.4 over the lowest,
within 0.25 × 96 blocks: the conversation stays."""


def _routes(
    monkeypatch: pytest.MonkeyPatch, policy: str, trace: list[TraceRequest], **kw: object
) -> tuple[list[int], bench_trace.PolicyResult]:
    """Run ``policy`` on a 2-worker fleet; return the worker of each request, in order, and the result."""
    sent: list[int] = []
    send = bench_trace._Fleet.send

    def record(self: bench_trace._Fleet, p: bench_trace._Prepared, worker: int, delay_s: float) -> None:
        sent.append(worker)
        send(self, p, worker, delay_s)

    spec = bench_trace.FleetSpec(workers=2, num_blocks=4096)
    with monkeypatch.context() as m:
        m.setattr(bench_trace._Fleet, "send", record)
        result = bench_trace.simulate_policy(policy, trace, spec, **kw)  # type: ignore[arg-type]
    return sent, result


def session_counts(result: bench_trace.PolicyResult) -> tuple[int, int, int]:
    return (result.extra["session_new"], result.extra["session_kept"], result.extra["session_moved"])


def test_session_of_is_the_first_two_trace_blocks() -> None:
    assert bench_trace.session_of(_req(0, (7, 8, 9), 1)) == "s-7-8"
    assert bench_trace.session_of(_req(0, (7, 8), 1)) == "s-7-8"
    assert bench_trace.session_of(_req(0, (7,), 1)) is None
    assert bench_trace.session_of(_req(0, (), 1)) is None


@pytest.mark.parametrize("policy", KVMESH_POLICIES)
def test_sessions_keep_a_conversation_the_load_term_would_move(
    monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """Without sessions turn 2 moves to the idle worker (its 1,024 cached tokens lost, 2,048 cached in all);
    with them the whole conversation stays on worker 0 (512 + 1,024 + 1,536 = 3,072 cached tokens). The
    three kvmesh policies see the same overlaps here (the index lag and the predicted cache lose nothing)."""
    plain, r = _routes(monkeypatch, policy, CONVERSATION)
    assert (plain, r.policy, r.cached_tokens) == ([0, 0, 1, 1], policy, 2048)
    assert not any(k.startswith("session_") for k in r.extra)
    kept, r = _routes(monkeypatch, policy, CONVERSATION, sessions=True)
    assert (kept, r.policy, r.cached_tokens) == ([0, 0, 0, 0], f"{policy} +sess 0.25", 3072)
    assert session_counts(r) == (2, 2, 0)  # new: both sessions' first requests; kept: turns 2 and 3


def test_slack_bounds_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slack 0: the session's worker keeps a request only when it is the cheapest, so turn 2 moves (counted)
    and turn 3 is kept on its new worker; slack 0.06 (5.76 blocks) is still short of the 6.4 needed, 0.07
    (6.72) enough."""
    got = {}
    for slack in (0.0, 0.06, 0.07):
        seq, r = _routes(
            monkeypatch,
            "kvmesh-exact",
            CONVERSATION,
            sessions=True,
            route_policy=Policy(session_slack=slack),
        )
        got[slack] = (seq, r.policy, session_counts(r))
    assert got == {
        0.0: ([0, 0, 1, 1], "kvmesh-exact +sess 0", (2, 1, 1)),
        0.06: ([0, 0, 1, 1], "kvmesh-exact +sess 0.06", (2, 1, 1)),
        0.07: ([0, 0, 0, 0], "kvmesh-exact +sess 0.07", (2, 2, 0)),
    }


def test_other_policies_ignore_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    seq, r = _routes(monkeypatch, "round-robin", CONVERSATION, sessions=True)
    assert (seq, r.policy) == ([0, 1, 0, 1], "round-robin")
    assert not any(k.startswith("session_") for k in r.extra)


def test_a_prompt_under_two_trace_blocks_has_no_session(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = [_req(0, (1,), 4), _req(1000, (1, 2), 4), _req(2000, (1,), 4)]
    _seq, r = _routes(monkeypatch, "kvmesh-exact", trace, sessions=True)
    assert session_counts(r) == (1, 0, 0)


def test_command_writes_one_row_per_session_slack(tmp_path: Path) -> None:
    out = tmp_path / "sessions"
    argv = ["--trace", "burst", "--requests", "24", "--burst-size", "8", "--workers", "3", "--out", str(out)]
    argv += ["--policies", "kvmesh-exact,round-robin,kvmesh-lagged", "--predicted-ttl-s", "0,2"]
    assert bench_trace.command([*argv, "--sessions", "--session-slack", "0,0.5"]) == 0
    rows = [line.split("|")[1].strip() for line in out.with_suffix(".md").read_text().splitlines()[2:]]
    assert rows == [
        "kvmesh-exact +sess 0",
        "kvmesh-exact +sess 0.5",
        "round-robin",
        "kvmesh-lagged +sess 0",
        "kvmesh-lagged +pred 2 s +sess 0",
        "kvmesh-lagged +sess 0.5",
        "kvmesh-lagged +pred 2 s +sess 0.5",
    ]
    assert bench_trace.command([*argv, "--sessions"]) == 0
    rows = [line.split("|")[1].strip() for line in out.with_suffix(".md").read_text().splitlines()[2:]]
    assert rows[:3] == ["kvmesh-exact +sess 0.25", "round-robin", "kvmesh-lagged +sess 0.25"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sessions", "--session-slack", "x"], "not a list of numbers"),
        (["--sessions", "--session-slack", "-0.1"], "finite fractions >= 0"),
        (["--session-slack", "0.5"], "--session-slack needs --sessions"),
    ],
)
def test_bad_session_options_are_refused(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_trace.command(["--policies", "kvmesh-exact", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
