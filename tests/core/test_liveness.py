"""The engine liveness policy: probes only after silence, stale after unanswered probes, then gone."""

from __future__ import annotations

from kvmesh.core.liveness import EngineLiveness, LivenessChange, LivenessPolicy

POLICY = LivenessPolicy(probe_after_s=5.0, probe_every_s=2.0, stale_after_failures=2, remove_after_s=30.0)


def test_no_probe_while_events_arrive() -> None:
    """An engine heard from within probe_after_s is never probed."""
    live = EngineLiveness(POLICY, now=0.0)
    for t in range(0, 100, 4):
        live.on_heard(float(t))
        assert live.probe_due(t + 4.9) is False
    assert live.probes == 0
    assert live.state == "live"


def test_probes_after_silence_at_the_interval() -> None:
    """A silent engine is probed after probe_after_s, then every probe_every_s, one probe at a time."""
    live = EngineLiveness(POLICY, now=0.0)
    assert live.probe_due(4.99) is False
    assert live.probe_due(5.0) is True
    assert live.probe_due(5.1) is False  # one in flight
    assert live.on_probe_result(5.5, answered=True) is None
    assert live.probe_due(6.0) is False  # heard at 5.5
    assert live.probe_due(10.5) is True
    assert live.on_probe_result(10.75, answered=False) is None
    assert live.probe_due(12.0) is False  # probe_every_s not yet
    assert live.probe_due(12.5) is True
    assert live.probes == 3


def test_stale_then_gone_then_live_again() -> None:
    """Two unanswered probes make it stale, 30 s stale make it gone, an answer makes it live."""
    live = EngineLiveness(POLICY, now=0.0)
    assert live.probe_due(5.0)
    assert live.on_probe_result(6.0, answered=False) is None
    assert live.probe_due(7.0)
    change = live.on_probe_result(8.0, answered=False, detail="replay socket timed out")
    assert change == LivenessChange(
        "stale", "live", "engine silent for 8.0 s and 2 probe(s) unanswered (replay socket timed out)"
    )
    assert live.tick(37.9) is None
    gone = live.tick(38.0)
    assert gone is not None and gone.state == "gone" and gone.previous == "stale"
    assert live.state == "gone"
    assert live.tick(100.0) is None  # gone is final until heard from
    back = live.on_heard(101.0)
    assert back == LivenessChange("live", "gone", "the engine answered")
    assert (live.state, live.failures, live.reason) == ("live", 0, "")


def test_remove_after_zero_never_removes() -> None:
    """remove_after_s = 0 keeps a stale engine stale."""
    live = EngineLiveness(LivenessPolicy(stale_after_failures=1, remove_after_s=0.0), now=0.0)
    assert live.probe_due(5.0)
    change = live.on_probe_result(5.5, answered=False)
    assert change is not None and change.state == "stale"
    assert live.tick(10_000.0) is None
    assert live.state == "stale"


def test_policy_problems() -> None:
    """Invalid bounds are each named."""
    bad = LivenessPolicy(probe_after_s=0, probe_every_s=-1, stale_after_failures=0, remove_after_s=-2)
    assert bad.problems() == [
        "probe_after_s must be > 0 (got 0)",
        "probe_every_s must be > 0 (got -1)",
        "stale_after_failures must be ≥ 1 (got 0)",
        "remove_after_s must be ≥ 0 (got -2)",
    ]
    assert POLICY.problems() == []
