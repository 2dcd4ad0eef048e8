"""Rollout analysis (pure; time passed in): does the new revision serve as well as the old one?

A rollout that changes the KV fingerprint runs both revisions side by side, and the router counts
every attempt of a prefill/decode pair by the pair's fingerprint (metrics_contract.REVISION_*).
Over the same window (spec.rollout.analysis.windowSeconds, never from before the rollout
started) the new revision's error ratio, mean TTFT and mean TPOT are compared with the old's:

- Fail: its error ratio exceeds the old's by more than maxErrorRatioIncrease, beyond what chance
  explains at the attempts seen (a one-sided 99% bound on the difference, Agresti-Caffo), or a
  mean latency exceeds the old's by more than maxLatencyRatio. The rollout is rolled back.
- Wait: a revision has fewer than minAttempts attempts, the error ratio is higher but not yet
  clearly so, a latency cannot be compared yet, or the figures are unknown (Prometheus
  unreachable, answering garbage, figures older than the rollout or stale): never zero, never Pass.
- Inconclusive: neither revision had minAttempts over a whole window (no traffic), or the old
  revision served nothing over a whole window (nothing to compare with: a rollback from a revision
  that never became ready); the rollout proceeds unjudged.
- Pass: none of that.
- NotJudged: the analysis does not apply (disabled, no Prometheus, planner Off, or a rollout that
  keeps the fingerprint, whose revisions the router cannot tell apart): readiness only.

Attempts a client ended (metrics_contract.CLIENT_OUTCOMES) say nothing about the engines: they
count neither as attempts nor as errors. Every other outcome but OUTCOME_OK is an error.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from prfaas_core import metrics_contract as contract

from prfaas_operator.api import PlannerMode, PrfaasDeploymentSpec, RolloutAnalysisSpec

ERROR_BOUND_Z = 2.33
"""One-sided 99%: a rollout is looked at every few seconds over overlapping windows, so a bound
this strict keeps a revision equal to the old from ever failing by chance."""
TTFT_FLOOR_SECONDS = contract.TTFT_BUCKETS[0]
TPOT_FLOOR_SECONDS = contract.TPOT_BUCKETS[0]
"""A mean latency below its histogram's first bucket counts as that much: below it, a ratio is noise."""
MAX_FIGURES_AGE_SECONDS = 45.0
"""Figures older than this are not used: the executor looks every 10 s, with a 10 s query timeout."""


class Verdict(enum.StrEnum):
    PASS = "Pass"
    FAIL = "Fail"
    WAIT = "Wait"
    INCONCLUSIVE = "Inconclusive"
    NOT_JUDGED = "NotJudged"


GATE_OPEN = frozenset({Verdict.PASS, Verdict.INCONCLUSIVE, Verdict.NOT_JUDGED})
"""Verdicts that let a rollout retire the old revision's last instances."""


@dataclass(frozen=True)
class Figures:
    """How one revision served over a window: judged attempts (client-ended ones left out), the
    failed ones, and the sums and counts of the TTFT and TPOT histograms."""

    attempts: float = 0.0
    errors: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: float = 0.0

    @property
    def error_ratio(self) -> float | None:
        return self.errors / self.attempts if self.attempts > 0 else None

    @property
    def ttft_mean(self) -> float | None:
        return self.ttft_sum / self.ttft_count if self.ttft_count > 0 else None

    @property
    def tpot_mean(self) -> float | None:
        return self.tpot_sum / self.tpot_count if self.tpot_count > 0 else None


def figures_by_fingerprint(
    attempts: Mapping[tuple[str, str], float],
    ttft: Mapping[str, tuple[float, float]],
    tpot: Mapping[str, tuple[float, float]],
) -> dict[str, Figures]:
    """Each fingerprint's figures from the router's counters over a window: `attempts` by
    (fingerprint, outcome); `ttft` and `tpot` by fingerprint as (sum, count)."""
    fingerprints = {fingerprint for fingerprint, _ in attempts} | set(ttft) | set(tpot)
    figures = {}
    for fingerprint in sorted(fingerprints):
        mine = {outcome: n for (fp, outcome), n in attempts.items() if fp == fingerprint}
        judged = {o: n for o, n in mine.items() if o not in contract.CLIENT_OUTCOMES}
        errors = sum(n for o, n in judged.items() if o != contract.OUTCOME_OK)
        figures[fingerprint] = Figures(
            attempts=sum(judged.values()),
            errors=errors,
            ttft_sum=ttft.get(fingerprint, (0.0, 0.0))[0],
            ttft_count=ttft.get(fingerprint, (0.0, 0.0))[1],
            tpot_sum=tpot.get(fingerprint, (0.0, 0.0))[0],
            tpot_count=tpot.get(fingerprint, (0.0, 0.0))[1],
        )
    return figures


@dataclass(frozen=True)
class Observed:
    """What Prometheus said of every revision over one window ending at `at`: figures by
    fingerprint (a fingerprint absent served nothing), or why they are unknown (`problem`)."""

    at: datetime
    window_seconds: float
    revisions: Mapping[str, Figures]
    problem: str | None = None


@dataclass(frozen=True)
class Judgement:
    """A verdict on the new revision against the old, with its reason and the figures it used."""

    verdict: Verdict
    reason: str
    new_fingerprint: str | None = None
    old_fingerprint: str | None = None
    new: Figures | None = None
    old: Figures | None = None
    at: datetime | None = None
    window_seconds: float | None = None


def not_judged(spec: PrfaasDeploymentSpec) -> str | None:
    """Why the spec keeps rollouts from being judged (None: they are judged)."""
    if not spec.rollout.analysis.enabled:
        return "spec.rollout.analysis.enabled is false: readiness only"
    if spec.planner.prometheus_url is None:
        return "no spec.planner.prometheusUrl to read the revisions' figures from: readiness only"
    if spec.planner.mode == PlannerMode.OFF:
        return "spec.planner.mode is Off (no Prometheus reads): readiness only"
    return None


def query_window(
    spec: RolloutAnalysisSpec, started_at: datetime, now: datetime, known_since: datetime | None = None
) -> float:
    """The window to take the figures over: windowSeconds, or less so that it reaches back neither
    before the rollout started nor before `known_since`, when the figures were first known again
    after being unknown (Prometheus down or answering errors, the router not scraped: its data has
    a hole there, and a window over a hole would read as no traffic). At least a second."""
    since = started_at if known_since is None else max(started_at, known_since)
    return max(1.0, min(float(spec.window_seconds), (now - since).total_seconds()))


def assess(
    spec: RolloutAnalysisSpec,
    old_fingerprint: str | None,
    new_fingerprint: str,
    observed: Observed | None,
    started_at: datetime,
    now: datetime,
) -> Judgement:
    """The verdict on the new revision from the latest figures (None: none taken yet)."""

    def wait(reason: str, taken: Observed | None = None) -> Judgement:
        at, window = (taken.at, taken.window_seconds) if taken is not None else (None, None)
        return Judgement(Verdict.WAIT, reason, new_fingerprint, old_fingerprint, at=at, window_seconds=window)

    if old_fingerprint is None:
        return wait("the old revision's KV fingerprint is not known yet")
    if old_fingerprint == new_fingerprint:
        reason = (
            f"the KV fingerprint stays {new_fingerprint}: the router cannot tell the revisions apart; "
            "readiness only"
        )
        return Judgement(Verdict.NOT_JUDGED, reason, new_fingerprint, old_fingerprint)
    if observed is None:
        return wait("no figures taken yet")
    if observed.problem is not None:
        return wait(f"figures unknown: {observed.problem}", observed)
    if observed.at - timedelta(seconds=observed.window_seconds) < started_at - timedelta(seconds=1):
        return wait("the last figures reach back before the rollout started")
    age = (now - observed.at).total_seconds()
    if age > MAX_FIGURES_AGE_SECONDS:
        return wait(f"the last figures are {age:.0f}s old", observed)
    if not observed.revisions:  # the router exports each revision it routes to from zero
        return wait(
            "no revision's series in the window: Prometheus holds too few samples of the router's there "
            "(started again, or the router not scraped over it)",
            observed,
        )
    new = observed.revisions.get(new_fingerprint, Figures())
    old = observed.revisions.get(old_fingerprint, Figures())
    whole = observed.window_seconds >= spec.window_seconds
    verdict, reason = judge(spec, old, new, whole_window=whole)
    return Judgement(
        verdict, reason, new_fingerprint, old_fingerprint, new, old, observed.at, observed.window_seconds
    )


def judge(
    spec: RolloutAnalysisSpec, old: Figures, new: Figures, *, whole_window: bool
) -> tuple[Verdict, str]:
    """The comparison itself: the new revision's figures against the old's over the same window.
    `whole_window`: the window is windowSeconds long (only then does no traffic conclude)."""
    need = spec.min_attempts
    if new.attempts < need and old.attempts < need:
        counts = f"new {new.attempts:.0f}, old {old.attempts:.0f} attempts (minAttempts {need})"
        if whole_window:
            return Verdict.INCONCLUSIVE, f"no traffic to judge by over {spec.window_seconds}s: {counts}"
        return Verdict.WAIT, f"too few attempts yet: {counts}"
    if old.attempts == 0 and whole_window:
        return (
            Verdict.INCONCLUSIVE,
            f"the old revision served nothing over {spec.window_seconds}s (new {new.attempts:.0f} "
            "attempts): nothing to compare with, e.g. a rollback from a revision that never became ready",
        )
    if new.attempts < need or old.attempts < need:
        which, few = ("new", new) if new.attempts < need else ("old", old)
        return (
            Verdict.WAIT,
            f"the {which} revision had {few.attempts:.0f} attempts, fewer than minAttempts {need}",
        )
    failed: list[str] = []
    waits: list[str] = []
    passed: list[str] = []
    errors = _errors(spec, old, new)
    (failed if errors[0] is Verdict.FAIL else waits if errors[0] is Verdict.WAIT else passed).append(
        errors[1]
    )
    floor_need = math.ceil(need / 2)
    for name, floor, mean_new, mean_old, n_new, n_old in (
        ("TTFT", TTFT_FLOOR_SECONDS, new.ttft_mean, old.ttft_mean, new.ttft_count, old.ttft_count),
        ("TPOT", TPOT_FLOOR_SECONDS, new.tpot_mean, old.tpot_mean, new.tpot_count, old.tpot_count),
    ):
        if n_new < floor_need and n_old < floor_need:
            passed.append(f"{name} not compared (fewer than {floor_need} measured of either)")
            continue
        if mean_new is None or mean_old is None or n_new < floor_need or n_old < floor_need:
            waits.append(
                f"{name} measured {n_new:.0f} new, {n_old:.0f} old: too few to compare (need {floor_need})"
            )
            continue
        ratio = max(mean_new, floor) / max(mean_old, floor)
        text = f"mean {name} {_ms(mean_new)} vs {_ms(mean_old)} ({ratio:.2f}x, limit {spec.max_latency_ratio:g}x)"
        (failed if ratio > spec.max_latency_ratio else passed).append(text)
    if failed:
        return Verdict.FAIL, "; ".join(failed)
    if waits:
        return Verdict.WAIT, "; ".join(waits + passed)
    return Verdict.PASS, "; ".join(passed)


def _errors(spec: RolloutAnalysisSpec, old: Figures, new: Figures) -> tuple[Verdict, str]:
    """Fail when the error ratio is higher by more than allowed with 99% confidence; Wait when it
    is higher by more than allowed but not yet clearly; else fine."""
    ratio_new, ratio_old = new.errors / new.attempts, old.errors / old.attempts
    increase = spec.max_error_ratio_increase
    # Agresti-Caffo: one error and one success added to each side keeps the bound sane at 0% and 100%
    p_new, p_old = (new.errors + 1) / (new.attempts + 2), (old.errors + 1) / (old.attempts + 2)
    spread = math.sqrt(p_new * (1 - p_new) / (new.attempts + 2) + p_old * (1 - p_old) / (old.attempts + 2))
    lower = p_new - p_old - ERROR_BOUND_Z * spread
    text = (
        f"error ratio {ratio_new:.1%} ({new.errors:.0f}/{new.attempts:.0f}) vs {ratio_old:.1%} "
        f"({old.errors:.0f}/{old.attempts:.0f}), at least {max(0.0, lower):.1%} higher "
        f"(limit +{increase:.1%})"
    )
    if lower > increase:
        return Verdict.FAIL, text
    if ratio_new - ratio_old > increase:
        return Verdict.WAIT, f"{text}: higher, not yet clearly"
    return Verdict.PASS, f"error ratio {ratio_new:.1%} vs {ratio_old:.1%} (limit +{increase:.1%})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms" if seconds >= 0.01 else f"{seconds * 1000:.2f}ms"
