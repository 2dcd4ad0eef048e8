"""Issues 20 and 33's proof: rollouts of both clusters under steady traffic, judged by how the new
revision serves.

One PrfaasDeployment (2 PrfaaS prefill, 2 local prefill, 2 decode instances; engines that load
their model for MODEL_LOAD_SECONDS before they listen) under steady traffic through the real
router to real fake engines (runner processes on kwok's nodes), short prompts prefilled locally
and long ones in the PrfaaS cluster, the rollout analysis on at its defaults (a 60 s window, 20
attempts a revision, +5% error ratio at 99%, 2x latency: what a user gets), the operator reading
the router's per-fingerprint figures from the e2e Prometheus:

1. the image goes from v0.5.23 to v0.5.24 (a new KV fingerprint): the new revision comes up in
   each role's second StatefulSet, at most maxSurge (1) beyond each target, the roles step
   together, the router lists both layouts while it rolls and pairs within one, the analysis
   judges the new revision Pass (the last step waits for it) and never halts it. Measured:
   failed requests (target 0), the lowest served requests/s over 5 s windows against before the
   change (target at least 90%), KV handoffs between fingerprints counted by the decode engines
   (target 0), the rollout's length;
2. a model revision whose engines are Ready but fail about 30% of the revision's attempts (each
   engine `--fault-error-ratio 0.163`; a pair fails 1 - (1 - 0.163)^2 = 30%), then one whose
   engines are three times slower (`--fault-slowdown 3`): each is halted within the first step
   (status.rollout.step stays 0 and no StatefulSet of the old revision drops below its target)
   and rolled back by itself (phase Failed, AnalysisFailed, the new StatefulSets at 0, the old
   at target). Measured for each: failed client requests and the lowest 5 s window against
   before. A model revision changes the KV fingerprint (planning/fingerprint.py) while the
   engines run the same program; the faults come through spec.model.extraArgs, which reach
   every role;
3. then an image the testbed's registry does not hold: the rollout stalls at its deadline with
   the reason in status, traffic unaffected; setting the image back rolls back (the analysis finds
   it Inconclusive once the unpullable revision has served nothing over a whole window).

Values, and why: the image change keeps the default minReadySeconds (10 s a step). The faulty
revisions come with minReadySeconds 90 s, so that their first step outlasts the judgement (it
ends at the verdict, so the 90 s cost nothing): at this traffic (4.25 requests/s, about a third
to the new revision while it has one of three instances per role) a revision failing 30% is
judged once its observed ratio is clearly above +5%, after 20-30 attempts on a typical draw, 60
on a low one; the slowed one once its answers (fewer complete) reach 20; the planner loop takes
figures every 10 s. At 10 s the first step could complete before the analysis has seen enough
(the revision would then be failed during the second step, which still waits for a pass before
retiring the old revision's last instances). About 5 minutes on the testbed; -s prints the
figures (docs/rollouts.md quotes them).
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from lightkube.resources.apps_v1 import StatefulSet
from live_traffic import (
    E2E_TIME_SCALE,
    BackgroundTraffic,
    condition,
    cr_status,
    logs_hint,
    patched,
    served_per_window,
    steady,
)
from prfaas_testbed.pod_workloads import WorkloadKind
from prfaas_testbed.polling import eventually
from prfaas_testbed.system import LiveSystem, customise_cr, load_sample_cr
from prfaas_testbed.traffic import RequestResult

pytestmark = [pytest.mark.e2e, pytest.mark.testbed, pytest.mark.timeout(900)]

E2E_NAME = "prfaas-rollout"
CR_NAME = "rollout"
MODEL_LOAD_SECONDS = 10
"""What each new engine takes before it listens (real ones: minutes; the demo's deadline allows it)."""
TARGETS = {"prfaas-prefill": 2, "pd-prefill": 2, "pd-decode": 2}
OLD, NEW, MISSING = "lmsysorg/sglang:v0.5.23", "lmsysorg/sglang:v0.5.24", "lmsysorg/sglang:v0.5.99"
BEFORE_SECONDS = 30.0  # steady traffic before the change: the baseline's windows
DEADLINE_SECONDS = 30  # spec.rollout.progressDeadlineSeconds of the stalled rollout
JUDGED_MIN_READY_SECONDS = 90  # spec.rollout.minReadySeconds of the faulty revisions (see above)
ENGINE_ERROR_RATIO = 0.163
"""Each engine's; a prefill/decode pair of the revision fails 1 - (1 - 0.163)^2 = 30% of its attempts."""
SLOWDOWN = 3
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
    spec["prefillCluster"].update(replicas=2, minReplicas=1, maxReplicas=3, env=load)
    spec["pdCluster"].update(instances=4, prefillInstances=2, decodeInstances=2, env=load)
    spec["rollout"] = {"maxSurge": 1, "progressDeadlineSeconds": 300, "analysis": {}}  # its defaults
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
    """Engine processes the runner still runs: the next revision waits until the previous one's
    are gone, since a pod that comes back under the same name gets the same IP, and until the old
    process there has stopped, the new pod's first probes and requests would reach it."""
    return len(
        system.runner_pods(kind=WorkloadKind.ENGINE.value, namespace=system.layout.deployment_namespace)
    )


class Watcher:
    """Samples what a rollout must keep: the StatefulSets' sizes, the layouts the router lists, the
    decode engines' KV handoff counters (their pods go at the end, so they are read as it runs),
    and of the rollout being judged the old revision's StatefulSets (never below target while the
    new one is judged), the steps reached and the verdicts seen."""

    def __init__(self, system: LiveSystem) -> None:
        self.system = system
        self.most: dict[str, int] = dict.fromkeys(TARGETS, 0)
        self.layouts_listed: set[frozenset[str]] = set()
        self.handoffs: dict[str, tuple[float, float]] = {}
        self.phases: set[str] = set()
        self.judge("")

    def judge(self, old: str) -> None:
        """From now on, judge a rollout away from the `old` fingerprint: its steps, verdicts and
        the fewest old instances start afresh."""
        self.old = old
        self.fewest_old = dict(TARGETS)
        self.steps: set[int] = set()
        self.verdicts: set[str] = set()

    def sample(self) -> dict[str, Any]:
        system = self.system
        sets = engine_sets(system)
        for role in TARGETS:
            self.most[role] = max(self.most[role], sum(n for r, _, n in sets if r == role))
            old = sum(n for r, fingerprint, n in sets if r == role and fingerprint == self.old)
            self.fewest_old[role] = min(self.fewest_old[role], old)
        config = system.router_config() or {}
        listed = {e.get("fingerprint", "") for pool in (config.get("pools") or {}).values() for e in pool}
        self.layouts_listed.add(frozenset(listed))
        for pod in system.runner_pods(kind=WorkloadKind.ENGINE.value, role="pd-decode"):
            if pod["ready"]:
                counted = decode_handoffs(pod["ip"])
                if counted is not None:
                    self.handoffs[pod["pod"]] = counted
        status = cr_status(system)
        rollout = status.get("rollout") or {}
        self.phases.add(rollout.get("phase", "none"))
        if rollout.get("phase") in ("Progressing", "Paused", "Stalled"):
            self.steps.add(int(rollout.get("step") or 0))
            self.verdicts.add((rollout.get("analysis") or {}).get("verdict", "none"))
        return status

    def until(self, what: str, done: Callable[[dict[str, Any]], Any], timeout_s: float) -> float:
        """Sample every second until `done(status)`; the seconds it took."""
        started = time.monotonic()
        eventually(self.sample, timeout=timeout_s, interval=1.0, what=what, until=done, retry_on=())
        return time.monotonic() - started


def decode_handoffs(ip: str) -> tuple[float, float] | None:
    """(KV handoffs, of which from another fingerprint) a decode engine counted so far."""
    try:
        with urllib.request.urlopen(f"http://{ip}:30000/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return None

    def value(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE))

    return value("prfaas_fake_engine_kv_handoffs_total"), value(
        "prfaas_fake_engine_kv_mismatched_handoffs_total"
    )


def failed(results: list[RequestResult], start: float, end: float) -> list[RequestResult]:
    """Requests sent in [start, end) that the client did not get answered."""
    return [r for r in results if start <= r.sent_at < end and r.outcome not in ("ok", "cancelled")]


def test_an_image_change_rolls_both_clusters_without_loss_bad_revisions_roll_back_and_a_stall_too(
    deployment: LiveSystem,
) -> None:
    system = deployment
    router = system.router_url()
    assert router is not None, logs_hint(system)
    base_model = (system.cr() or {})["spec"]["model"]
    base_args = list(base_model.get("extraArgs") or [])
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
    watcher = Watcher(system)
    watcher.sample()
    before = set(watcher.handoffs)
    plan = steady(BEFORE_SECONDS + 600)
    with BackgroundTraffic(router, "kimi-linear", plan, timeout_s=60) as traffic:
        time.sleep(BEFORE_SECONDS)
        # 1. a new image: a new KV fingerprint in every role, judged by the analysis
        watcher.judge(old)
        changed_at = time.monotonic()
        took = watcher.until("the rollout to v0.5.24", patched(system, {"model": {"image": NEW}}), 240)
        rolled_at = time.monotonic()
        good_phases, good_verdicts = set(watcher.phases), set(watcher.verdicts)
        (good,) = {fingerprint for _, fingerprint, n in engine_sets(system) if n > 0}
        # the old revision's engines gone: the first faulty one comes up in their slot, under their names
        watcher.until(
            "v0.5.23's engines gone", lambda _: engines_running(system) == sum(TARGETS.values()), 60
        )
        # 2. faulty revisions, each halted in its first step and rolled back by the analysis
        for label, (model, reason) in bad.items():
            watcher.judge(good)
            started = time.monotonic()
            failed_in = watcher.until(
                f"the {label} revision failed by the analysis",
                patched(
                    system,
                    {"model": model, "rollout": {"minReadySeconds": JUDGED_MIN_READY_SECONDS}},
                    lambda s: (s.get("rollout") or {}).get("phase") == "Failed",
                ),
                240,
            )
            rollout = cr_status(system)["rollout"]
            new = rollout["failed"]["fingerprint"]
            steps_before, fewest_before = set(watcher.steps), dict(watcher.fewest_old)

            def rolled_back(_: dict[str, Any], new: str = new) -> bool:
                return (
                    replicas_of(system, new) == dict.fromkeys(TARGETS, 0)
                    and replicas_of(system, good) == TARGETS
                    and engines_running(system) == sum(TARGETS.values())
                )

            back_in = watcher.until(f"the {label} revision rolled back", rolled_back, 120)
            periods[label] = (started, time.monotonic())
            figures[label] = {
                "failed_in": failed_in,
                "back_in": back_in,
                "rollout": rollout,
                "new": new,
                "steps": steps_before,
                "fewest_old": fewest_before,
                "fewest_old_through_rollback": dict(watcher.fewest_old),
                "reason": reason,
                "condition": condition(cr_status(system), "RolloutProgressing"),
            }
        # 3. an image nobody can pull (the model as before): stalls at its deadline, then back to
        # v0.5.24: a rollout whose old revision (the unpullable one) never served, which the analysis
        # finds Inconclusive once it has served nothing over a whole window
        patched(
            system,
            {
                "model": {"image": MISSING, "revision": base_model["revision"], "extraArgs": base_args},
                "rollout": {"progressDeadlineSeconds": DEADLINE_SECONDS},
            },
        )
        stalled_in = watcher.until(
            "the stall", lambda s: (s.get("rollout") or {}).get("phase") == "Stalled", DEADLINE_SECONDS + 60
        )
        status = cr_status(system)
        stalled = condition(status, "RolloutProgressing")
        degraded = condition(status, "Degraded")
        back_in = watcher.until("the rollback to v0.5.24", patched(system, {"model": {"image": NEW}}), 180)
        traffic.stop()
        driver = traffic.wait(120)

    results = driver.results
    lost = [r for r in results if r.outcome != "ok" and r.outcome != "cancelled"]
    baseline = served_per_window(results, traffic.started_at + 10, changed_at)  # after the warm-up
    during = served_per_window(results, changed_at, rolled_at)
    baseline_rps = sum(baseline) / len(baseline)
    lowest, lowest_before = min(during), min(baseline)
    handoffs = sum(total for total, _ in watcher.handoffs.values())
    mismatched = sum(mismatch for _, mismatch in watcher.handoffs.values())
    report = [
        f"rollout v0.5.23 -> v0.5.24: {took:.0f} s with engines loading {MODEL_LOAD_SECONDS} s (time scale "
        f"{E2E_TIME_SCALE:g}), verdicts seen {sorted(good_verdicts)}; served {baseline_rps:.2f} req/s "
        f"before (lowest 5 s window {lowest_before:.2f}), lowest 5 s window during {lowest:.2f} "
        f"({lowest / baseline_rps:.0%} of the mean, {lowest / lowest_before:.0%} of the lowest before); "
        f"failed {len(failed(results, changed_at, rolled_at))} of "
        f"{sum(1 for r in results if changed_at <= r.sent_at < rolled_at)}"
    ]
    for label, (start, end) in periods.items():
        f = figures[label]
        window = served_per_window(results, start, end)
        sent = sum(1 for r in results if start <= r.sent_at < end)
        f["lowest"], f["failed"] = min(window), failed(results, start, end)
        report.append(
            f"{label}: Failed {f['failed_in']:.0f} s after the patch (step {f['rollout']['step']} of "
            f"{f['rollout']['steps']}; {f['rollout']['failed']['reason']}), rolled back {f['back_in']:.0f} s "
            f"later; failed {len(f['failed'])} of {sent} requests; lowest 5 s window {f['lowest']:.2f} req/s "
            f"({f['lowest'] / lowest_before:.0%} of the lowest before)"
        )
    report.append(
        f"all: failed {len(lost)} of {len(results)}; KV handoffs across fingerprints {mismatched:.0f} of "
        f"{handoffs:.0f} (decodes {sorted(watcher.handoffs)}); most StatefulSet replicas per role "
        f"{watcher.most}; stalled {stalled_in:.0f} s after the bad image (deadline {DEADLINE_SECONDS} s), "
        f"rolled back in {back_in:.0f} s"
    )
    print("\n".join(report))

    assert not lost, [f"{r.phase} {r.status} {r.error}" for r in lost[:5]]
    # the image change: judged Pass by the analysis, never halted
    assert "Pass" in good_verdicts and "Fail" not in good_verdicts, good_verdicts
    assert good_phases <= {"none", "Progressing"} and "Progressing" in good_phases, good_phases
    # lowest against lowest: a 5 s window of about 20 answers gains or loses one as latencies move
    # answers across its edges, before the change as during it
    assert lowest >= 0.9 * lowest_before, (baseline, during)
    # the faulty revisions
    for label, f in figures.items():
        rollout = f["rollout"]
        assert rollout["phase"] == "Failed" and f["reason"] in rollout["failed"]["reason"], (label, rollout)
        assert (rollout.get("analysis") or {}).get("verdict") == "Fail", (label, rollout)
        assert (f["condition"].get("status"), f["condition"].get("reason")) == ("False", "AnalysisFailed"), f
        # within the first step: no step completed and no old instance asked away until the verdict
        assert f["steps"] <= {0} and rollout["step"] == 0, (label, f["steps"], rollout)
        assert f["fewest_old_through_rollback"] == TARGETS, (label, f["fewest_old_through_rollback"])
        # the fake engine fails before its first byte, so every failed attempt is retried without the
        # engine blamed; two exclusions leave the new revision (1 PrfaaS prefill, 1 local prefill,
        # 1 decode in the first step) no pair, so a request's third attempt (the router's limit) is
        # on the old revision, which does not fail
        assert not f["failed"], [(r.phase, r.status, r.error) for r in f["failed"][:5]]
        # lowest against lowest, as above; a retried attempt or the slowed revision's answer (about
        # 1 s later) moves a few across its edges, none is lost: 4 of 20
        assert f["lowest"] >= 0.8 * lowest_before, (label, f["lowest"], lowest_before)
    assert len({f["new"] for f in figures.values()} | {old, good}) == len(figures) + 2  # all different
    # all along: no KV across fingerprints, within maxSurge, both layouts listed
    assert mismatched == 0 and handoffs > 0
    assert set(watcher.handoffs) - before, "no new decode was ever read"
    assert all(watcher.most[role] <= TARGETS[role] + 1 for role in TARGETS), watcher.most
    assert any(len(listed) == 2 for listed in watcher.layouts_listed), "the router never listed both layouts"
    # the stall
    assert "Stalled" in watcher.phases
    assert (stalled.get("status"), stalled.get("reason")) == ("False", "ProgressDeadlineExceeded"), stalled
    assert "ErrImagePull" in stalled.get("message", "") or "ImagePullBackOff" in stalled.get("message", ""), (
        stalled
    )
    assert (degraded.get("status"), degraded.get("reason")) == ("True", "ProgressDeadlineExceeded"), degraded
    reasons = {e.get("reason") for e in system.events()}
    assert {"RolloutStarted", "RolloutDone", "AnalysisFailed", "RolledBack"} <= reasons, reasons
    images = {
        (s.spec.template.spec.containers[0].image if s.spec and s.spec.template.spec else None)
        for client in (system.pd, system.prfaas)
        for s in client.list(
            StatefulSet,
            namespace=system.layout.deployment_namespace,
            labels={"app.kubernetes.io/instance": CR_NAME},
        )
        if "prfaas.io/role" in (s.metadata.labels or {}) and s.metadata.labels["prfaas.io/role"] in TARGETS
    }
    assert images == {NEW}, images
    assert replicas_of(system, good) == TARGETS
