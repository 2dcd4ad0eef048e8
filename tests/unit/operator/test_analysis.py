"""Rollout analysis verdicts (operator/prfaas_operator/planning/analysis.py): figures in, verdict out."""

from __future__ import annotations

import copy
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml
from prfaas_core import metrics_contract as contract
from prfaas_operator import crd
from prfaas_operator.api import PrfaasDeploymentSpec, RolloutAnalysisSpec
from prfaas_operator.planning import analysis
from prfaas_operator.planning.analysis import Figures, Observed, Verdict, assess, judge

SPEC = RolloutAnalysisSpec()
SAMPLE: dict[str, Any] = yaml.safe_load(
    (crd.repository_root() / "examples/prfaasdeployment.yaml").read_text()
)
T0 = datetime(2026, 12, 7, 9, 0, tzinfo=UTC)
OLD, NEW = "aaaaaaaaaaaa", "bbbbbbbbbbbb"


def serving(attempts: float, errors: float = 0.0, ttft: float = 0.2, tpot: float = 0.02) -> Figures:
    """A revision whose answered attempts all had these mean latencies."""
    answered = attempts - errors
    return Figures(attempts, errors, ttft * answered, answered, tpot * answered, answered)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def observed(new: Figures, old: Figures, *, seconds: float = 120, window: float = 60) -> Observed:
    return Observed(at(seconds), window, {NEW: new, OLD: old})


def test_equal_revisions_pass() -> None:
    verdict, reason = judge(SPEC, serving(100), serving(40), whole_window=True)
    assert verdict is Verdict.PASS, reason
    assert "error ratio 0.0% vs 0.0%" in reason and "mean TTFT 200ms vs 200ms (1.00x" in reason


def test_thirty_percent_errors_fail_with_the_figures() -> None:
    verdict, reason = judge(SPEC, serving(100, errors=1), serving(40, errors=12), whole_window=True)
    assert verdict is Verdict.FAIL
    assert "error ratio 30.0% (12/40) vs 1.0% (1/100)" in reason and "limit +5.0%" in reason


def test_a_higher_error_ratio_not_yet_clear_waits() -> None:
    """+15% over 20 attempts is within chance of +5%: not a Fail, not a Pass."""
    verdict, reason = judge(SPEC, serving(20), serving(20, errors=3), whole_window=True)
    assert verdict is Verdict.WAIT and "not yet clearly" in reason


def test_three_times_slower_fails_on_ttft_and_tpot() -> None:
    verdict, reason = judge(SPEC, serving(60), serving(30, ttft=0.6, tpot=0.06), whole_window=True)
    assert verdict is Verdict.FAIL
    assert "mean TTFT 600ms vs 200ms (3.00x, limit 2x)" in reason and "mean TPOT 60ms vs 20ms" in reason


def test_slower_within_the_ratio_passes() -> None:
    verdict, _ = judge(SPEC, serving(60), serving(30, ttft=0.38, tpot=0.039), whole_window=True)
    assert verdict is Verdict.PASS


def test_latencies_below_the_first_bucket_are_not_compared_as_ratios() -> None:
    """1 ms against 3 ms TTFT is noise, not a slower revision: both count as the 10 ms floor."""
    verdict, reason = judge(SPEC, serving(60, ttft=0.001), serving(30, ttft=0.003), whole_window=True)
    assert verdict is Verdict.PASS, reason


def test_too_few_attempts_of_one_revision_waits() -> None:
    verdict, reason = judge(SPEC, serving(100), serving(19, errors=19), whole_window=True)
    assert verdict is Verdict.WAIT and "new revision had 19 attempts, fewer than minAttempts 20" in reason
    verdict, reason = judge(SPEC, serving(5), serving(100), whole_window=True)
    assert verdict is Verdict.WAIT and "old revision had 5" in reason


def test_no_traffic_over_a_whole_window_is_inconclusive() -> None:
    verdict, reason = judge(SPEC, serving(3), serving(0), whole_window=True)
    assert verdict is Verdict.INCONCLUSIVE and "no traffic" in reason


def test_an_old_revision_that_served_nothing_over_a_whole_window_is_inconclusive() -> None:
    """A rollback from a revision that never became ready (an unpullable image): nothing to compare
    the restored revision with, so the gate opens; over part of a window it still waits."""
    verdict, reason = judge(SPEC, Figures(), serving(100), whole_window=True)
    assert verdict is Verdict.INCONCLUSIVE and "old revision served nothing over 60s" in reason
    verdict, reason = judge(SPEC, Figures(), serving(100), whole_window=False)
    assert verdict is Verdict.WAIT and "old revision had 0 attempts" in reason


def test_no_traffic_over_part_of_a_window_waits() -> None:
    """A rollout younger than the window may not have been scraped yet: no traffic is not concluded."""
    verdict, _ = judge(SPEC, Figures(), Figures(), whole_window=False)
    assert verdict is Verdict.WAIT


def test_a_latency_measured_on_one_side_only_waits() -> None:
    new = Figures(attempts=40, errors=0, ttft_sum=8, ttft_count=40)  # no TPOT measured yet
    old = serving(40)
    verdict, reason = judge(SPEC, old, new, whole_window=True)
    assert verdict is Verdict.WAIT and "TPOT measured 0 new, 40 old" in reason


def test_a_latency_measured_on_neither_side_is_not_compared() -> None:
    """One-token answers have no TPOT: that must not hold a rollout."""
    new, old = (Figures(attempts=n, ttft_sum=0.2 * n, ttft_count=n) for n in (40, 60))
    verdict, reason = judge(SPEC, old, new, whole_window=True)
    assert verdict is Verdict.PASS and "TPOT not compared" in reason


def test_a_fail_outweighs_a_wait() -> None:
    new = Figures(attempts=40, errors=0, ttft_sum=40, ttft_count=40)  # 1 s TTFT, no TPOT yet
    verdict, reason = judge(SPEC, serving(40), new, whole_window=True)
    assert verdict is Verdict.FAIL and "TTFT" in reason


def test_noise_between_equal_revisions_never_fails_and_mostly_passes() -> None:
    """Two revisions that serve alike (2% errors, latencies jittered by up to 30% each way, traffic
    split unevenly): over many windows none fails, and nearly all pass (the rest wait)."""
    rng = random.Random(33)
    verdicts = []
    for _ in range(2000):
        sides = []
        for share in (rng.uniform(0.2, 0.8), 1.0):
            attempts = rng.randint(20, 120) * share // 1 + 20
            errors = sum(rng.random() < 0.02 for _ in range(int(attempts)))
            sides.append(
                serving(attempts, errors, ttft=0.2 * rng.uniform(0.7, 1.3), tpot=0.02 * rng.uniform(0.7, 1.3))
            )
        verdicts.append(judge(SPEC, sides[1], sides[0], whole_window=True)[0])
    assert Verdict.FAIL not in verdicts
    assert verdicts.count(Verdict.PASS) / len(verdicts) > 0.9


def test_outcomes_are_counted_per_attempt_and_client_outcomes_are_not_errors() -> None:
    attempts = {
        (NEW, contract.OUTCOME_OK): 30.0,
        (NEW, "prefill_failed"): 6.0,
        (NEW, "decode_failed"): 4.0,
        **{(NEW, outcome): 50.0 for outcome in contract.CLIENT_OUTCOMES},
        (OLD, contract.OUTCOME_OK): 10.0,
    }
    figures = analysis.figures_by_fingerprint(attempts, {NEW: (6.0, 30.0)}, {OLD: (0.2, 10.0)})
    assert figures[NEW].attempts == 40 and figures[NEW].errors == 10 and figures[NEW].error_ratio == 0.25
    assert figures[NEW].ttft_mean == pytest.approx(0.2) and figures[NEW].tpot_mean is None
    assert figures[OLD] == Figures(10.0, 0.0, 0.0, 0.0, 0.2, 10.0)


# ---- assess: what comes before the comparison -----------------------------------------------


def test_assess_judges_fresh_figures_of_both_fingerprints() -> None:
    judged = assess(SPEC, OLD, NEW, observed(serving(40, errors=20), serving(40)), T0, at(125))
    assert judged.verdict is Verdict.FAIL
    assert judged.new == serving(40, errors=20) and judged.at == at(120) and judged.window_seconds == 60


def test_a_revision_absent_from_the_figures_served_nothing() -> None:
    judged = assess(SPEC, OLD, NEW, Observed(at(120), 60, {OLD: serving(40)}), T0, at(121))
    assert judged.verdict is Verdict.WAIT and "new revision had 0 attempts" in judged.reason


def test_unknown_figures_wait_never_pass() -> None:
    unknown = Observed(at(120), 60, {}, problem="Prometheus at http://prom:9090 is unreachable")
    judged = assess(SPEC, OLD, NEW, unknown, T0, at(121))
    assert judged.verdict is Verdict.WAIT and "unreachable" in judged.reason
    assert assess(SPEC, OLD, NEW, None, T0, at(121)).verdict is Verdict.WAIT


def test_stale_figures_wait() -> None:
    judged = assess(SPEC, OLD, NEW, observed(serving(40), serving(40)), T0, at(120 + 46))
    assert judged.verdict is Verdict.WAIT and "46s old" in judged.reason


def test_figures_from_before_the_rollout_started_wait() -> None:
    """Figures of an earlier rollout (or a window reaching back before this one) are not this rollout's."""
    judged = assess(SPEC, OLD, NEW, observed(serving(40), serving(40), seconds=100), at(60), at(101))
    assert judged.verdict is Verdict.WAIT and "before the rollout started" in judged.reason


def test_a_window_shorter_than_windowseconds_never_concludes_no_traffic() -> None:
    judged = assess(SPEC, OLD, NEW, observed(Figures(), Figures(), seconds=30, window=30), T0, at(31))
    assert judged.verdict is Verdict.WAIT
    judged = assess(SPEC, OLD, NEW, observed(Figures(), Figures(), seconds=90, window=60), T0, at(91))
    assert judged.verdict is Verdict.INCONCLUSIVE


def test_same_fingerprint_is_not_judged_and_unknown_old_fingerprint_waits() -> None:
    judged = assess(SPEC, NEW, NEW, None, T0, at(1))
    assert judged.verdict is Verdict.NOT_JUDGED and "cannot tell the revisions apart" in judged.reason
    assert assess(SPEC, None, NEW, None, T0, at(1)).verdict is Verdict.WAIT


def test_query_window_never_reaches_before_the_rollout() -> None:
    assert analysis.query_window(SPEC, T0, at(25)) == 25
    assert analysis.query_window(SPEC, T0, at(600)) == 60
    assert analysis.query_window(SPEC, T0, at(0)) == 1


def test_query_window_never_reaches_back_over_figures_that_were_unknown() -> None:
    """Prometheus back (or the router scraped again) at 100 s after an outage: its data has a hole
    before that, which a whole window would read as no traffic (Inconclusive, the gate open)."""
    assert analysis.query_window(SPEC, T0, at(100), known_since=at(100)) == 1
    assert analysis.query_window(SPEC, T0, at(130), known_since=at(100)) == 30
    assert analysis.query_window(SPEC, T0, at(600), known_since=at(100)) == 60
    assert analysis.query_window(SPEC, at(120), at(130), known_since=at(100)) == 10
    thin = Observed(at(130), 30, {})
    assert assess(SPEC, OLD, NEW, thin, T0, at(130)).verdict is Verdict.WAIT


def test_a_whole_window_without_any_revision_series_waits_not_inconclusive() -> None:
    """Empty vectors (Prometheus started again after an outage, the router unscraped over the
    window): the router exports each revision it routes to from zero, so none at all is a hole."""
    judged = assess(SPEC, OLD, NEW, Observed(at(90), 60, {}), T0, at(91))
    assert judged.verdict is Verdict.WAIT and "no revision's series in the window" in judged.reason


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"rollout": {"analysis": {"enabled": False}}}, "enabled is false"),
        ({"planner": {"mode": "Off", "prometheusUrl": None}}, "no spec.planner.prometheusUrl"),
        ({"planner": {"mode": "Off"}}, "mode is Off"),
    ],
)
def test_what_keeps_the_spec_from_judging(change: dict[str, dict[str, object]], says: str) -> None:
    base = copy.deepcopy(SAMPLE["spec"])
    base["planner"] = {"mode": "Advisory", "prometheusUrl": "http://prometheus:9090"}
    assert analysis.not_judged(PrfaasDeploymentSpec.model_validate(base)) is None
    for key, value in change.items():
        base[key] = {k: v for k, v in {**(base.get(key) or {}), **value}.items() if v is not None}
    assert says in (analysis.not_judged(PrfaasDeploymentSpec.model_validate(base)) or "")
