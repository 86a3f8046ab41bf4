"""The ledger's prefill progress estimate: only the head request is prefilling, at a learned rate (pure).

Worked examples with explicit times (`kvmesh.core.load.LoadLedger`, "Prefill progress"):

    start     = max(head routed at, the worker's last prefill end)
    remaining = max(head prefill_tokens − rate × (now − start), 0)
    rate      = EW(tokens) / EW(seconds) over the worker's PrefillDone samples, alpha 0.2
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvmesh.core.load import ActiveLoad, LoadLedger
from kvmesh.core.protocol import Routed


def routed(rid: str, w: str = "a", prefill: int = 100, blocks: int = 8) -> Routed:
    """A Routed event on (w, rank 0)."""
    return Routed(request_id=rid, worker_id=w, dp_rank=0, prefill_tokens=prefill, blocks=blocks)


def test_head_progress_at_the_learned_rate_later_requests_wait_whole() -> None:
    """Worker a: r1 (1,000 tokens) at 10.0, r2 (600) at 10.1, r3 (500) at 10.3; r1 done at 10.25.

    Before any sample nothing is assumed done. r1's sample: 1,000 / 0.25 s = 4,000 tokens/s. r2 starts
    when r1 ends (10.25, not when it was routed): at 10.35 it has 600 − 4,000 × 0.1 = 200 left, r3 waits
    whole (700 in all); at 10.5 r2 is estimated done (never below 0). r2 done at 10.45: sample 600 / 0.2 s;
    EW sums 1,000 + 0.2 × (600 − 1,000) = 920 tokens, 0.25 + 0.2 × (0.2 − 0.25) = 0.24 s: 3,833.3 tokens/s.
    r3 starts at 10.45: at 10.51 it has 500 − round(3,833.3 × 0.06) = 500 − 230 = 270 left.
    """
    led = LoadLedger(prefill_progress=True)
    led.routed(routed("r1", prefill=1000, blocks=63), 10.0)
    led.routed(routed("r2", prefill=600, blocks=38), 10.1)
    assert led.prefill_rate("a", 0) == 0.0
    assert led.load("a", 0, now_s=10.2) == ActiveLoad(prefill_tokens=1600, blocks=101, requests=2)
    assert led.prefill_done("r1", 10.25) is True
    assert led.prefill_rate("a", 0) == pytest.approx(4000.0)
    led.routed(routed("r3", prefill=500, blocks=32), 10.3)
    assert led.load("a", 0, now_s=10.35).prefill_tokens == 200 + 500
    assert led.load("a", 0, now_s=10.5).prefill_tokens == 0 + 500
    assert led.prefill_done("r2", 10.45) is True
    assert led.prefill_rate("a", 0) == pytest.approx(920 / 0.24)
    assert led.load("a", 0, now_s=10.51) == ActiveLoad(prefill_tokens=270, blocks=133, requests=3)
    # The request just routed at the estimate's time has made no progress yet.
    assert led.load("a", 0, now_s=10.45).prefill_tokens == 500


def test_disabled_or_without_a_sample_the_whole_prefill_counts() -> None:
    """prefill_progress=False is the former accounting; a prior rate applies until the first sample."""
    off = LoadLedger(prefill_progress=False)
    assert LoadLedger().prefill_progress is True  # the default
    on = LoadLedger()
    prior = LoadLedger(prefill_progress=True, prefill_rate_prior=1000.0)
    for led in (off, on, prior):
        led.routed(routed("r1", prefill=1000), 0.0)
        led.routed(routed("r2", prefill=400), 0.0)
        led.routed(routed("b1", w="b", prefill=500), 0.0)
    # Without a sample: whole for the default ledger; the prior's 1,000 tokens/s × 0.3 s off the head.
    assert (off.load("a", 0, now_s=0.3).prefill_tokens, on.load("a", 0, now_s=0.3).prefill_tokens) == (
        1400,
        1400,
    )
    assert prior.load("a", 0, now_s=0.3).prefill_tokens == 1400 - 300
    for led in (off, on):
        led.prefill_done("r1", 0.5)  # a's sample: 2,000 tokens/s; b has none
    assert off.load("a", 0, now_s=0.6).prefill_tokens == 400
    assert on.load("a", 0, now_s=0.6).prefill_tokens == 400 - 200
    assert on.load("b", 0, now_s=0.6).prefill_tokens == 500
    assert on.prefill_rate("b", 0) == 0.0


def test_the_estimate_takes_the_latest_time_given_when_none_is_passed() -> None:
    """load() and prefill_done() without now_s use the latest time of any call (expire, routed, ...)."""
    led = LoadLedger(prefill_progress=True)
    led.routed(routed("r1", prefill=1000), 0.0)
    led.routed(routed("r2", prefill=1000), 0.1)
    led.expire(0.5)
    assert led.prefill_done("r1") is True  # dated 0.5: 1,000 tokens / 0.5 s
    assert led.prefill_rate("a", 0) == pytest.approx(2000.0)
    led.expire(0.75)
    assert led.load("a", 0).prefill_tokens == 1000 - 500
    # An earlier now_s does not move the ledger's latest time back.
    assert led.load("a", 0, now_s=0.6).prefill_tokens == 1000 - 200
    assert led.load("a", 0).prefill_tokens == 1000 - 500


def test_excluding_the_head_makes_the_next_request_the_head() -> None:
    """A request routed again is left out; the next one is then being prefilled."""
    led = LoadLedger(prefill_progress=True, prefill_rate_prior=1000.0)
    led.routed(routed("r1", prefill=800), 1.0)
    led.routed(routed("r2", prefill=300), 1.2)
    assert led.load("a", 0, now_s=1.4).prefill_tokens == 800 - 400 + 300
    assert led.load("a", 0, now_s=1.4, excluding="r1").prefill_tokens == 300 - 200
    assert led.load("a", 0, now_s=1.4, excluding="r2").prefill_tokens == 800 - 400


def test_a_prefilling_request_that_finishes_ends_the_prefill_without_a_sample() -> None:
    """An aborted head (finished before prefill_done) frees the unit at its finish; the rate is unchanged."""
    led = LoadLedger(prefill_progress=True, prefill_rate_prior=1000.0)
    led.routed(routed("r1", prefill=800), 0.0)
    led.routed(routed("r2", prefill=300), 0.0)
    assert led.finished("r1", 0.2) is True
    assert led.prefill_rate("a", 0) == 1000.0
    assert led.load("a", 0, now_s=0.3).prefill_tokens == 300 - 100


def test_fully_cached_requests_are_never_the_head_and_no_time_gives_no_sample() -> None:
    """A request with nothing to prefill does not block the queue; a zero interval is not a sample."""
    led = LoadLedger(prefill_progress=True)
    led.routed(routed("c", prefill=0), 0.0)
    led.routed(routed("r1", prefill=600), 0.0)
    assert led.prefill_done("r1", 0.0) is True
    assert led.prefill_rate("a", 0) == 0.0
    led.routed(routed("r2", prefill=600), 1.0)
    assert led.prefill_done("r2", 1.3) is True  # 600 / 0.3 s
    led.routed(routed("r3", prefill=600), 2.0)
    assert led.load("a", 0, now_s=2.1) == ActiveLoad(prefill_tokens=400, blocks=32, requests=4)


def test_replicas_fed_the_same_events_agree_and_a_restored_one_waits_for_samples() -> None:
    """Two ledgers given the same events at the same times estimate the same; rates are not in snapshots."""
    a, b = LoadLedger(prefill_progress=True), LoadLedger(prefill_progress=True)
    for led in (a, b):
        led.routed(routed("r1", prefill=1000), 0.0)
        led.routed(routed("r2", prefill=1000), 0.0)
        led.prefill_done("r1", 0.25)
    assert a.load("a", 0, now_s=0.4) == b.load("a", 0, now_s=0.4) == ActiveLoad(400, 16, 2)
    c = LoadLedger(prefill_progress=True)
    assert c.restore(a.snapshot(0.4), 100.0) == 2
    assert c.load("a", 0, now_s=100.0).prefill_tokens == 1000


@pytest.mark.parametrize(
    "kw", [{"prefill_rate_alpha": 0.0}, {"prefill_rate_alpha": 1.5}, {"prefill_rate_prior": -1.0}]
)
def test_invalid_settings_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LoadLedger(**kw)


def test_a_queued_request_that_leaves_does_not_restart_the_heads_progress() -> None:
    """Rate 1,000 tokens/s; h (10,000 tokens) and q (100) routed at 10.0. At 15.0 h has 5,000 left. q finishing,
    or moving to worker b, does not end h's prefill: the load is h's remainder, and h's sample at 20.0 is
    10,000 tokens over 10 s. (Before: q's leaving restarted h's estimate at 15.0, the load rose to 10,000, and
    h's sample read 10,000 tokens over 5 s.)"""
    for leave in ("finished", "moved"):
        led = LoadLedger(prefill_progress=True, prefill_rate_prior=1000.0)
        led.routed(routed("h", prefill=10_000, blocks=625), 10.0)
        led.routed(routed("q", prefill=100, blocks=7), 10.0)
        assert led.load("a", 0, now_s=15.0) == ActiveLoad(prefill_tokens=5_100, blocks=632, requests=2)
        if leave == "finished":
            led.finished("q", now_s=15.0)
        else:
            led.routed(routed("q", w="b", prefill=100, blocks=7), 15.0)
        assert led.load("a", 0, now_s=15.0) == ActiveLoad(prefill_tokens=5_000, blocks=625, requests=1)
        led.prefill_done("h", 20.0)
        assert led.prefill_rate("a", 0) == pytest.approx(1000.0)


def test_the_head_leaving_ends_its_prefill_for_the_next() -> None:
    """The head finishing before its PrefillDone (cancelled) ends the worker's current prefill: the request
    behind it starts then, not when it was routed."""
    led = LoadLedger(prefill_progress=True, prefill_rate_prior=1000.0)
    led.routed(routed("h", prefill=10_000), 10.0)
    led.routed(routed("q", prefill=3_000), 10.0)
    led.finished("h", now_s=12.0)
    assert led.load("a", 0, now_s=13.0).prefill_tokens == 2_000


@pytest.mark.parametrize(
    ("age_s", "prefill", "blocks", "want"),
    [
        (float("nan"), 500, 8, None),
        (float("inf"), 500, 8, None),
        (-2.0, 500, 8, ActiveLoad(prefill_tokens=500, blocks=8, requests=1)),
        (1.0, -10, -1, ActiveLoad(prefill_tokens=0, blocks=0, requests=1)),
    ],
)
def test_a_peers_snapshot_with_odd_values_restores_nothing_odd(
    age_s: float, prefill: int, blocks: int, want: ActiveLoad | None
) -> None:
    """A peer's entry whose age is not finite is skipped (NaN used to reach the progress estimate, whose
    ``round`` raised on every later `load`); a negative age counts as 0 and negative counts as 0."""
    from kvmesh.core.protocol import LedgerEntry, LedgerSnapshot

    led = LoadLedger(prefill_progress=True, prefill_rate_prior=1000.0)
    entry = LedgerEntry(
        request_id="r", worker_id="a", dp_rank=0, prefill_tokens=prefill, blocks=blocks, age_s=age_s
    )
    assert led.restore(LedgerSnapshot(entries=[entry]), 100.0) == (0 if want is None else 1)
    got = led.load("a", 0, now_s=100.0)
    assert got == (ActiveLoad(prefill_tokens=0, blocks=0, requests=0) if want is None else want)
    assert led.load("a", 0, now_s=math.inf).prefill_tokens == 0
