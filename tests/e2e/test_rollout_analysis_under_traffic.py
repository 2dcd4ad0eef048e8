"""Issue 33's proof: a rollout judged by how the new revision serves, under steady traffic through
the real router, to real fake engines (runner processes on kwok's nodes), the operator's analysis
reading the router's per-fingerprint figures from the e2e Prometheus.

One PrfaasDeployment (1 PrfaaS prefill, 1 local prefill, 2 decode instances: two steps, and the
first retires an old decode) under the steady traffic of test_rollout_under_traffic.py, in turn:

1. a model revision whose engines are Ready but fail about 30% of the revision's attempts (each
   engine `--fault-error-ratio 0.163`; a pair fails 1 - (1 - 0.163)^2 = 30%);
2. a model revision whose engines are Ready but three times slower (`--fault-slowdown 3`);
3. a good revision (the next image).

The first two are halted within the first step (status.rollout.step stays 0 and no StatefulSet of
the old revision drops below its target until the Failed verdict; the verdict comes before the
first step could complete) and rolled back by themselves (phase Failed, AnalysisFailed, the new
StatefulSets at 0, the old at target). Measured for each: failed client requests and the lowest
served requests/s over 5 s windows against before. The third rolls to the end. A model revision
changes the KV fingerprint (planning/fingerprint.py) while the engines run the same program, and
the faults come through spec.model.extraArgs, which reach every role.

Values, and why: the analysis runs at its defaults (a 60 s window, 20 attempts a revision, +5%
error ratio at 99%, 2x latency): they are what a user gets. `minReadySeconds` is 50 s, so the
first step lasts the engines' load plus 50 s. At this traffic (4.25 requests/s, about half to the
new revision while it has one instance per role) a revision failing 30% is judged once its
observed ratio is clearly above +5%: after 20-30 attempts on a typical draw, 60 on a low one
(measured 13-32 s after the patch, the engines listening about 5 s after it), the slowed one after
32 s (its answers take longer, so fewer complete); the planner loop takes figures every 10 s. At the default 10 s the first step would
complete before the analysis could see enough (the revision would then be failed during the
second step, which still waits for a pass before retiring the old revision's last instances).
About 5 minutes on the testbed; -s prints the figures (docs/rollouts.md quotes them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from lightkube.resources.apps_v1 import StatefulSet
from live_traffic import (
    BackgroundTraffic,
    condition,
    cr_status,
    logs_hint,
    patched,
    rollout_over,
    served_per_window,
    steady,
)
from prfaas_testbed.pod_workloads import WorkloadKind
from prfaas_testbed.polling import eventually
from prfaas_testbed.system import LiveSystem, customise_cr, load_sample_cr
from prfaas_testbed.traffic import RequestResult

pytestmark = [pytest.mark.e2e, pytest.mark.testbed, pytest.mark.timeout(900)]

E2E_NAME = "prfaas-analysis"
CR_NAME = "analysed"
MODEL_LOAD_SECONDS = 10
TARGETS = {"prfaas-prefill": 1, "pd-prefill": 1, "pd-decode": 2}
MIN_READY_SECONDS = 50
ENGINE_ERROR_RATIO = 0.163
"""Each engine's; a prefill/decode pair of the revision fails 1 - (1 - 0.163)^2 = 30% of its attempts."""
SLOWDOWN = 3
GOOD_IMAGE = "lmsysorg/sglang:v0.5.24"
BEFORE_SECONDS = 30.0
FINGERPRINT = "prfaas.io/fingerprint"


@pytest.fixture(scope="module")
def deployment(live_system: LiveSystem) -> Iterator[LiveSystem]:
    assert live_system.prometheus is not None
    cr = customise_cr(
        load_sample_cr(),
        live_system.layout,
        name=CR_NAME,
        # Advisory: the planner loop runs (it takes the analysis's figures) and changes nothing
        planner={"mode": "Advisory", "intervalSeconds": 3600},
        prometheus_url=live_system.prometheus.url,
    )
    spec = cr["spec"]
    load = [{"name": "PRFAAS_FAKE_ENGINE_MODEL_LOAD_SECONDS", "value": str(MODEL_LOAD_SECONDS)}]
    spec["prefillCluster"].update(replicas=1, minReplicas=1, maxReplicas=2, env=load)
    spec["pdCluster"].update(
        instances=3,
        prefillInstances=1,
        decodeInstances=2,
        minPrefillInstances=1,
        minDecodeInstances=1,
        env=load,
    )
    spec["rollout"] = {
        "maxSurge": 1,
        "minReadySeconds": MIN_READY_SECONDS,
        "progressDeadlineSeconds": 300,
        "analysis": {},  # the defaults
    }
    live_system.apply(cr)
    live_system.wait_ready(240)
    yield live_system
    live_system.delete_cr()


def engine_sets(system: LiveSystem) -> list[tuple[str, str, int]]:
    """(role, KV fingerprint of its pod template, replicas asked for) of each engine StatefulSet in
    both clusters (the fingerprint labels the pods, not the StatefulSet)."""
    found = []
    for client in (system.pd, system.prfaas):
        for sts in client.list(StatefulSet, namespace=system.layout.deployment_namespace):
            role = ((sts.metadata.labels if sts.metadata else None) or {}).get("prfaas.io/role", "")
            if role in TARGETS and sts.spec is not None:
                pod_labels = (sts.spec.template.metadata.labels if sts.spec.template.metadata else None) or {}
                found.append((role, pod_labels.get(FINGERPRINT, ""), sts.spec.replicas or 0))
    return found


def replicas_of(system: LiveSystem, fingerprint: str) -> dict[str, int]:
    """Instances each role's StatefulSets of this KV fingerprint ask for, in both clusters."""
    found = dict.fromkeys(TARGETS, 0)
    for role, of, replicas in engine_sets(system):
        if of == fingerprint:
            found[role] += replicas
    return found


def engines_running(system: LiveSystem) -> int:
    """Engine processes the runner still runs: the next revision waits until the failed one's are
    gone, since a pod that comes back under the same name gets the same IP, and until the old
    process there has stopped, the new pod's first probes and requests would reach it."""
    return len(
        system.runner_pods(kind=WorkloadKind.ENGINE.value, namespace=system.layout.deployment_namespace)
    )


class Judged:
    """Samples a judged rollout every second: the old revision's StatefulSets (never below target
    while the new one is judged), the step reached before the verdict, and the verdicts seen."""

    def __init__(self, system: LiveSystem, old: str) -> None:
        self.system = system
        self.old = old
        self.fewest_old = dict(TARGETS)
        self.steps: set[int] = set()
        self.verdicts: set[str] = set()

    def sample(self) -> dict[str, Any]:
        status = cr_status(self.system)
        rollout = status.get("rollout") or {}
        if rollout.get("phase") in ("Progressing", "Paused", "Stalled"):
            self.steps.add(int(rollout.get("step") or 0))
            self.verdicts.add((rollout.get("analysis") or {}).get("verdict", "none"))
        old = replicas_of(self.system, self.old)
        self.fewest_old = {role: min(self.fewest_old[role], old[role]) for role in TARGETS}
        return status

    def until(self, what: str, done: Callable[[dict[str, Any]], Any], timeout_s: float) -> float:
        """Sample every second until `done(status)`; the seconds it took."""
        started = time.monotonic()
        eventually(self.sample, timeout=timeout_s, interval=1.0, what=what, until=done, retry_on=())
        return time.monotonic() - started


def failed(results: list[RequestResult], start: float, end: float) -> list[RequestResult]:
    """Requests sent in [start, end) that the client did not get answered."""
    return [r for r in results if start <= r.sent_at < end and r.outcome not in ("ok", "cancelled")]


def test_a_bad_revision_is_halted_in_its_first_step_and_rolled_back_and_a_good_one_rolls(
    deployment: LiveSystem,
) -> None:
    system = deployment
    router = system.router_url()
    assert router is not None, logs_hint(system)
    spec = (system.cr() or {})["spec"]
    base_args = list(spec["model"].get("extraArgs") or [])
    (old,) = {fingerprint for _, fingerprint, _ in engine_sets(system)}
    bad = {
        "30% errors": (
            {
                "revision": "bad-errors",
                "extraArgs": [*base_args, "--fault-error-ratio", str(ENGINE_ERROR_RATIO)],
            },
            "error ratio",
        ),
        f"{SLOWDOWN}x slower": (
            {"revision": "bad-slow", "extraArgs": [*base_args, "--fault-slowdown", str(SLOWDOWN)]},
            "mean T",  # mean TTFT or mean TPOT
        ),
    }
    periods: dict[str, tuple[float, float]] = {}
    figures: dict[str, dict[str, Any]] = {}
    judged = Judged(system, old)
    plan = steady(BEFORE_SECONDS + 600)
    with BackgroundTraffic(router, "kimi-linear", plan, timeout_s=60) as traffic:
        time.sleep(BEFORE_SECONDS)
        for label, (model, reason) in bad.items():
            judged.steps.clear()
            judged.fewest_old = dict(TARGETS)
            started = time.monotonic()
            failed_in = judged.until(
                f"the {label} revision failed by the analysis",
                patched(
                    system, {"model": model}, lambda s: (s.get("rollout") or {}).get("phase") == "Failed"
                ),
                240,
            )
            rollout = cr_status(system)["rollout"]
            new = rollout["failed"]["fingerprint"]
            steps_before, fewest_before = set(judged.steps), dict(judged.fewest_old)
            back_in = judged.until(
                f"the {label} revision rolled back",
                lambda _, new=new: (
                    replicas_of(system, new) == dict.fromkeys(TARGETS, 0)
                    and replicas_of(system, old) == TARGETS
                    and engines_running(system) == sum(TARGETS.values())
                ),
                120,
            )
            periods[label] = (started, time.monotonic())
            figures[label] = {
                "failed_in": failed_in,
                "back_in": back_in,
                "rollout": rollout,
                "new": new,
                "steps": steps_before,
                "fewest_old": fewest_before,
                "fewest_old_through_rollback": dict(judged.fewest_old),
                "reason": reason,
                "condition": condition(cr_status(system), "RolloutProgressing"),
            }
        # a good revision: the next image, the engines as before
        judged.verdicts.clear()
        good_started = time.monotonic()
        good_in = judged.until(
            "the good revision rolled to the end",
            patched(system, {"model": {"image": GOOD_IMAGE, "revision": "main", "extraArgs": base_args}}),
            300,
        )
        good_period = (good_started, time.monotonic())
        good_status = cr_status(system)
        traffic.stop()
        driver = traffic.wait(120)

    results = driver.results
    first = min(started for started, _ in periods.values())
    baseline = served_per_window(results, traffic.started_at + 10, first)  # after the warm-up
    lowest_before = min(baseline)
    report = [
        f"before: {sum(baseline) / len(baseline):.2f} req/s served, lowest 5 s window {lowest_before:.2f}, "
        f"failed {len(failed(results, traffic.started_at, first))} of "
        f"{sum(1 for r in results if r.sent_at < first)}"
    ]
    for label, (start, end) in periods.items():
        f = figures[label]
        during = served_per_window(results, start, end)
        sent = sum(1 for r in results if start <= r.sent_at < end)
        f["lowest"], f["failed"] = min(during), failed(results, start, end)
        report.append(
            f"{label}: Failed {f['failed_in']:.0f} s after the patch (step {f['rollout']['step']} of "
            f"{f['rollout']['steps']}; {f['rollout']['failed']['reason']}), rolled back {f['back_in']:.0f} s "
            f"later; failed {len(f['failed'])} of {sent} requests; lowest 5 s window {f['lowest']:.2f} req/s "
            f"({f['lowest'] / lowest_before:.0%} of the lowest before)"
        )
    during_good = served_per_window(results, *good_period)
    report.append(
        f"good: rolled to the end in {good_in:.0f} s (verdicts seen {sorted(judged.verdicts)}); failed "
        f"{len(failed(results, *good_period))}; lowest 5 s window {min(during_good):.2f} req/s"
    )
    print("\n".join(report))

    for label, f in figures.items():
        rollout = f["rollout"]
        assert rollout["phase"] == "Failed" and f["reason"] in rollout["failed"]["reason"], (label, rollout)
        assert f["new"] != old and (rollout.get("analysis") or {}).get("verdict") == "Fail", (label, rollout)
        assert (f["condition"].get("status"), f["condition"].get("reason")) == ("False", "AnalysisFailed"), f
        # within the first step: no step completed and no old instance asked away until the verdict
        assert f["steps"] <= {0} and rollout["step"] == 0, (label, f["steps"], rollout)
        assert f["fewest_old_through_rollback"] == TARGETS, (label, f["fewest_old_through_rollback"])
        # the fake engine fails before its first byte, so every failed attempt is retried without the
        # engine blamed; two exclusions leave the new revision (1 PrfaaS prefill, 1 local prefill,
        # 1 decode) no pair, so a request's third attempt (the router's limit) is on the old
        # revision, which does not fail
        assert not f["failed"], [(r.phase, r.status, r.error) for r in f["failed"][:5]]
        # lowest against lowest, as in test_rollout_under_traffic.py: a window holds about 20 answers;
        # a retried attempt or the slowed revision's answer (about 1 s later) moves a few across its
        # edges, none is lost: 4 of 20
        assert f["lowest"] >= 0.8 * lowest_before, (label, f["lowest"], lowest_before)
    assert len({f["new"] for f in figures.values()}) == len(figures)
    assert rollout_over(good_status) and "Pass" in judged.verdicts and "Fail" not in judged.verdicts
    assert not failed(results, *good_period)
    assert replicas_of(system, old) == dict.fromkeys(TARGETS, 0)
    reasons = {e.get("reason") for e in system.events()}
    assert {"AnalysisFailed", "RolledBack", "RolloutDone"} <= reasons, reasons
