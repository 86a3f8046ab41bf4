"""Engine liveness as an ingest sees it: live, stale (silent and not answering), then gone.

Pure code: every method takes the caller's clock reading ``now`` (seconds, monotonic), and the policy
returns what changed; the ingest carries it out (probes the engine, marks its registry record stale,
deregisters the worker, starts a new incarnation when the engine answers again).

A KV-event publisher is quiet whenever its cache does not change, so silence alone proves nothing. What
does: a probe that the engine's own process must answer. The ingest probes the rank's replay socket (a
ROUTER inside the engine process in every vLLM and SGLang release with replay; a request for a sequence past
the last one seen is answered with the end marker only), or, without one, the engine's metrics page. A
probe is sent once the rank has been silent for ``probe_after_s``, then every ``probe_every_s``:

```
 live ── silent ≥ probe_after_s ──▶ probing ── failures ≥ stale_after_failures ──▶ stale
  ▲                                    │                                           │
  └──────── any event, any answer ─────┴───────────────────────────────────────────┤
                                                         stale ≥ remove_after_s ──▶ gone
```

``gone`` is final for the incarnation: the ingest removes the worker (its routes would fail) and, should
the engine answer again, rejoins as a new incarnation (its old entries are void).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

LivenessState = Literal["live", "stale", "gone"]

DEFAULT_PROBE_AFTER_S: Final[float] = 5.0
DEFAULT_PROBE_EVERY_S: Final[float] = 2.0
DEFAULT_STALE_AFTER_FAILURES: Final[int] = 2
DEFAULT_REMOVE_AFTER_S: Final[float] = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class LivenessPolicy:
    """When to probe a silent engine, and when an unanswering one is stale and then gone.

    Attributes:
        probe_after_s: seconds of silence (no live batch, no answered probe) before the first probe.
        probe_every_s: seconds between probes while silent.
        stale_after_failures: consecutive unanswered probes that make the engine stale.
        remove_after_s: seconds stale before the engine counts as gone; 0 never removes it.
    """

    probe_after_s: float = DEFAULT_PROBE_AFTER_S
    probe_every_s: float = DEFAULT_PROBE_EVERY_S
    stale_after_failures: int = DEFAULT_STALE_AFTER_FAILURES
    remove_after_s: float = DEFAULT_REMOVE_AFTER_S

    def problems(self) -> list[str]:
        """Return what is wrong with these values, in words (empty when valid)."""
        out = []
        if self.probe_after_s <= 0:
            out.append(f"probe_after_s must be > 0 (got {self.probe_after_s})")
        if self.probe_every_s <= 0:
            out.append(f"probe_every_s must be > 0 (got {self.probe_every_s})")
        if self.stale_after_failures < 1:
            out.append(f"stale_after_failures must be ≥ 1 (got {self.stale_after_failures})")
        if self.remove_after_s < 0:
            out.append(f"remove_after_s must be ≥ 0 (got {self.remove_after_s})")
        return out


@dataclass(frozen=True, slots=True)
class LivenessChange:
    """A change of state, with why (for logs, the registry record and status)."""

    state: LivenessState
    previous: LivenessState
    reason: str


class EngineLiveness:
    """The liveness of one engine rank.

    Args:
        policy: the bounds.
        now: the clock reading at start (the engine counts as heard from then).
    """

    def __init__(self, policy: LivenessPolicy, now: float) -> None:
        self.policy = policy
        self.state: LivenessState = "live"
        self.reason = ""
        self.heard_at = now
        """Clock reading of the last event or answered probe."""
        self.failures = 0
        """Consecutive unanswered probes."""
        self.probes = 0
        """Probes sent so far."""
        self._stale_since: float | None = None
        self._last_probe: float | None = None
        self._probing = False

    def on_heard(self, now: float) -> LivenessChange | None:
        """Record an event (live or replayed batch) or an answered probe; the engine is live."""
        self.heard_at = now
        self.failures = 0
        self._probing = False
        self._last_probe = None
        if self.state == "live":
            return None
        previous = self.state
        self.state, self.reason, self._stale_since = "live", "", None
        return LivenessChange("live", previous, "the engine answered")

    def probe_due(self, now: float) -> bool:
        """Tell whether to send a probe now (marks it sent: call `on_probe_result` with its outcome)."""
        if self._probing or now - self.heard_at < self.policy.probe_after_s:
            return False
        if self._last_probe is not None and now - self._last_probe < self.policy.probe_every_s:
            return False
        self._probing = True
        self._last_probe = now
        self.probes += 1
        return True

    def on_probe_result(self, now: float, *, answered: bool, detail: str = "") -> LivenessChange | None:
        """Record a probe's outcome; return the change it causes, if any."""
        self._probing = False
        if answered:
            return self.on_heard(now)
        self.failures += 1
        if self.state == "live" and self.failures >= self.policy.stale_after_failures:
            self.state, self._stale_since = "stale", now
            silent = now - self.heard_at
            self.reason = f"engine silent for {silent:.1f} s and {self.failures} probe(s) unanswered"
            if detail:
                self.reason += f" ({detail})"
            return LivenessChange("stale", "live", self.reason)
        return self.tick(now)

    def tick(self, now: float) -> LivenessChange | None:
        """Advance time: a stale engine becomes gone after ``remove_after_s``."""
        if (
            self.state == "stale"
            and self.policy.remove_after_s > 0
            and self._stale_since is not None
            and now - self._stale_since >= self.policy.remove_after_s
        ):
            self.state = "gone"
            self.reason = f"engine stale for {now - self._stale_since:.1f} s: {self.reason}"
            return LivenessChange("gone", "stale", self.reason)
        return None
