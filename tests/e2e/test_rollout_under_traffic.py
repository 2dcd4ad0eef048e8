"""Issue 20's proof: an image change rolls all three pools of both clusters under steady traffic.

One PrfaasDeployment (2 PrfaaS prefill, 2 local prefill, 2 decode instances; engines that load
their model for MODEL_LOAD_SECONDS before they listen) under steady traffic through the router,
short prompts prefilled locally and long ones in the PrfaaS cluster:

1. the image goes from v0.5.23 to v0.5.24 (a new KV fingerprint): the new revision comes up in
   each role's second StatefulSet, at most maxSurge (1) beyond each target, the roles step
   together, the router lists both layouts while it rolls and pairs within one. Measured: failed
   requests (target 0), the lowest served requests/s over 5 s windows against before the change
   (target at least 90%), KV handoffs between fingerprints counted by the decode engines (target
   0), the rollout's length;
2. then an image the testbed's registry does not hold: the rollout stalls at its deadline with
   the reason in status, traffic unaffected; setting the image back rolls back.

About 5 minutes on the testbed; -s prints the figures (docs/rollouts.md quotes them).
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from lightkube.resources.apps_v1 import StatefulSet
from live_traffic import (
    E2E_TIME_SCALE,
    BackgroundTraffic,
    condition,
    logs_hint,
    patched,
    served_per_window,
    steady,
)
from prfaas_testbed.pod_workloads import WorkloadKind
from prfaas_testbed.polling import eventually
from prfaas_testbed.system import LiveSystem, customise_cr, load_sample_cr

pytestmark = [pytest.mark.e2e, pytest.mark.testbed, pytest.mark.timeout(900)]

E2E_NAME = "prfaas-rollout"
CR_NAME = "rollout"
MODEL_LOAD_SECONDS = 10
"""What each new engine takes before it listens (real ones: minutes; the demo's deadline allows it)."""
TARGETS = {"prfaas-prefill": 2, "pd-prefill": 2, "pd-decode": 2}
OLD, NEW, MISSING = "lmsysorg/sglang:v0.5.23", "lmsysorg/sglang:v0.5.24", "lmsysorg/sglang:v0.5.99"
BEFORE_SECONDS = 30.0  # steady traffic before the change: the baseline's windows
DEADLINE_SECONDS = 30  # spec.rollout.progressDeadlineSeconds of the stalled rollout


@pytest.fixture(scope="module")
def deployment(live_system: LiveSystem) -> Iterator[LiveSystem]:
    cr = customise_cr(load_sample_cr(), live_system.layout, name=CR_NAME)
    spec = cr["spec"]
    load = [{"name": "PRFAAS_FAKE_ENGINE_MODEL_LOAD_SECONDS", "value": str(MODEL_LOAD_SECONDS)}]
    spec["prefillCluster"].update(replicas=2, minReplicas=1, maxReplicas=3, env=load)
    spec["pdCluster"].update(instances=4, prefillInstances=2, decodeInstances=2, env=load)
    spec["rollout"] = {"maxSurge": 1, "progressDeadlineSeconds": 300}
    live_system.apply(cr)
    live_system.wait_ready(240)
    yield live_system
    live_system.delete_cr()


class Watcher:
    """Samples what a rollout must keep: the StatefulSets' sizes, the layouts the router lists, and
    the decode engines' KV handoff counters (their pods go at the end, so they are read as it runs)."""

    def __init__(self, system: LiveSystem) -> None:
        self.system = system
        self.most: dict[str, int] = dict.fromkeys(TARGETS, 0)
        self.layouts_listed: set[frozenset[str]] = set()
        self.handoffs: dict[str, tuple[float, float]] = {}
        self.phases: set[str] = set()

    def sample(self) -> dict[str, Any]:
        system = self.system
        for role, client in (
            ("prfaas-prefill", system.prfaas),
            ("pd-prefill", system.pd),
            ("pd-decode", system.pd),
        ):
            found = client.list(
                StatefulSet, namespace=system.layout.deployment_namespace, labels={"prfaas.io/role": role}
            )
            size = sum(s.spec.replicas or 0 for s in found if s.spec is not None)
            self.most[role] = max(self.most[role], size)
        config = system.router_config() or {}
        listed = {e.get("fingerprint", "") for pool in (config.get("pools") or {}).values() for e in pool}
        self.layouts_listed.add(frozenset(listed))
        for pod in system.runner_pods(kind=WorkloadKind.ENGINE.value, role="pd-decode"):
            if pod["ready"]:
                counted = decode_handoffs(pod["ip"])
                if counted is not None:
                    self.handoffs[pod["pod"]] = counted
        status = (system.cr() or {}).get("status") or {}
        self.phases.add((status.get("rollout") or {}).get("phase", "none"))
        return status

    def until(self, what: str, done: Any, timeout_s: float) -> float:
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


def test_an_image_change_rolls_both_clusters_without_loss_and_a_bad_one_stalls_and_rolls_back(
    deployment: LiveSystem,
) -> None:
    system = deployment
    router = system.router_url()
    assert router is not None, logs_hint(system)
    watcher = Watcher(system)
    watcher.sample()
    before = set(watcher.handoffs)
    plan = steady(BEFORE_SECONDS + 200)
    with BackgroundTraffic(router, "kimi-linear", plan, timeout_s=60) as traffic:
        time.sleep(BEFORE_SECONDS)
        # 1. a new image: a new KV fingerprint in every role
        changed_at = time.monotonic()
        took = watcher.until("the rollout to v0.5.24", patched(system, {"model": {"image": NEW}}), 240)
        rolled_at = time.monotonic()
        # 2. an image nobody can pull: stalls at its deadline, then back to v0.5.24
        patched(
            system, {"model": {"image": MISSING}, "rollout": {"progressDeadlineSeconds": DEADLINE_SECONDS}}
        )
        stalled_in = watcher.until(
            "the stall", lambda s: (s.get("rollout") or {}).get("phase") == "Stalled", DEADLINE_SECONDS + 60
        )
        status = (system.cr() or {}).get("status") or {}
        stalled = condition(status, "RolloutProgressing")
        degraded = condition(status, "Degraded")
        back_in = watcher.until("the rollback to v0.5.24", patched(system, {"model": {"image": NEW}}), 120)
        traffic.stop()
        driver = traffic.wait(120)

    results = driver.results
    failed = [r for r in results if r.outcome != "ok" and r.outcome != "cancelled"]
    baseline = served_per_window(results, traffic.started_at + 10, changed_at)  # after the warm-up
    during = served_per_window(results, changed_at, rolled_at)
    baseline_rps = sum(baseline) / len(baseline)
    lowest, lowest_before = min(during), min(baseline)
    handoffs = sum(total for total, _ in watcher.handoffs.values())
    mismatched = sum(mismatch for _, mismatch in watcher.handoffs.values())
    print(
        f"rollout v0.5.23 -> v0.5.24: {took:.0f} s with engines loading {MODEL_LOAD_SECONDS} s (time scale "
        f"{E2E_TIME_SCALE:g}); served {baseline_rps:.2f} req/s before (lowest 5 s window {lowest_before:.2f}), "
        f"lowest 5 s window during {lowest:.2f} ({lowest / baseline_rps:.0%} of the mean, {lowest / lowest_before:.0%} "
        f"of the lowest before); failed {len(failed)} of {len(results)}; KV handoffs "
        f"across fingerprints {mismatched:.0f} of {handoffs:.0f} (decodes {sorted(watcher.handoffs)}); most "
        f"StatefulSet replicas per role {watcher.most}; stalled {stalled_in:.0f} s after the bad image "
        f"(deadline {DEADLINE_SECONDS} s), rolled back in {back_in:.0f} s"
    )
    assert not failed, [f"{r.phase} {r.status} {r.error}" for r in failed[:5]]
    # lowest against lowest: a 5 s window of about 20 answers gains or loses one as latencies move
    # answers across its edges, before the change as during it
    assert lowest >= 0.9 * lowest_before, (baseline, during)
    assert mismatched == 0 and handoffs > 0
    assert set(watcher.handoffs) - before, "no new decode was ever read"
    assert all(watcher.most[role] <= TARGETS[role] + 1 for role in TARGETS), watcher.most
    assert any(len(listed) == 2 for listed in watcher.layouts_listed), "the router never listed both layouts"
    assert "Progressing" in watcher.phases and "Stalled" in watcher.phases
    assert (stalled.get("status"), stalled.get("reason")) == ("False", "ProgressDeadlineExceeded"), stalled
    assert "ErrImagePull" in stalled.get("message", "") or "ImagePullBackOff" in stalled.get("message", ""), (
        stalled
    )
    assert (degraded.get("status"), degraded.get("reason")) == ("True", "ProgressDeadlineExceeded"), degraded
    reasons = {e.get("reason") for e in system.events()}
    assert {"RolloutStarted", "RolloutDone"} <= reasons, reasons
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
