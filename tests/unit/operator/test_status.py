"""Pure status computation: conditions and counts from observations of both clusters."""

from __future__ import annotations

from typing import Any

from prfaas_operator.api import (
    Allocation,
    Condition,
    FailedRevision,
    PrfaasDeploymentStatus,
    RoleCounts,
    RoleRollout,
    RolloutAnalysis,
    RolloutStatus,
)
from prfaas_operator.planning.data_path import DataPath
from prfaas_operator.planning.status import (
    ClusterObservation,
    PodInfo,
    Problem,
    RouterConfigOutcome,
    StatusInputs,
    compute_status,
    status_changed,
    status_patch,
    warning_events,
)

ALLOCATION = Allocation(
    threshold_tokens=19456,
    prefill_cluster_replicas=4,
    pd_prefill_instances=3,
    pd_decode_instances=5,
    source="Spec",
    router_config_version=3,
)
ALL_READY_PD = ClusterObservation(ready={"pd-prefill": 3, "pd-decode": 5, "router": 1})
ALL_READY_PRFAAS = ClusterObservation(ready={"prfaas-prefill": 4})
CONFIG = RouterConfigOutcome(
    version=3, endpoint_counts={"prfaas_prefill": 4, "local_prefill": 3, "decode": 5}
)
GPU_SHORT = "0/7 nodes are available: 2 node(s) didn't match Pod's node affinity/selector, 5 Insufficient nvidia.com/gpu."
# a rollout's first step on pd-decode: one new instance, not ready yet; the old five still serving
DECODE_SURGE = RoleRollout(
    role="pd-decode",
    target=5,
    revision="r2",
    replicas=1,
    ready=0,
    old_revision="r1",
    old_replicas=5,
    old_ready=5,
)


def inputs(**changes: Any) -> StatusInputs:
    base: dict[str, Any] = {
        "generation": 2,
        "allocation": ALLOCATION,
        "fingerprint": "abc123",
        "router_replicas": 1,
        "prefill_namespace": "prfaas-demo",
        "prefill_cluster_is_remote": True,
        "prefill_cluster": ALL_READY_PRFAAS,
        "pd_cluster": ALL_READY_PD,
        "router_config": CONFIG,
        "previous": PrfaasDeploymentStatus(),
        "now": "2026-11-21T10:00:00Z",
    }
    base.update(changes)
    return StatusInputs(**base)


def condition(status: PrfaasDeploymentStatus, kind: str) -> Condition:
    return next(c for c in status.conditions if c.type == kind)


def test_everything_ready() -> None:
    status = compute_status(inputs())
    assert [c.status for c in status.conditions] == ["True", "True", "True", "True", "False", "True"]
    assert status.prefill_cluster == RoleCounts(desired=4, ready=4)
    assert status.pd_prefill == RoleCounts(desired=3, ready=3)
    assert status.pd_decode == RoleCounts(desired=5, ready=5)
    assert status.router == RoleCounts(desired=1, ready=1)
    assert status.observed_generation == 2
    assert status.allocation == ALLOCATION
    assert status.fingerprint == "abc123"
    assert all(c.observed_generation == 2 for c in status.conditions)


def test_a_remote_prfaas_cluster_carries_the_data_paths_verdict_and_its_own_cluster_does_not() -> None:
    unknown = compute_status(inputs())  # the planner loop has not looked yet
    prefill = condition(unknown, "PrefillClusterReady")
    assert (prefill.status, prefill.reason) == ("True", "DataPathUnknown")
    assert "not looked at since" in prefill.message and "4/4 PrfaaS prefill" in prefill.message
    failing = DataPath("DataPathFailing", "KV handoffs ... failed once in the last 300 s: bootstrap_failed")
    remote = compute_status(inputs(data_path=failing))
    prefill = condition(remote, "PrefillClusterReady")
    assert (prefill.status, prefill.reason) == ("True", "DataPathFailing")  # readiness is the instances'
    assert failing.message in prefill.message and failing.message in condition(remote, "Ready").message
    assert condition(remote, "Degraded").status == "False"
    own = compute_status(inputs(prefill_cluster_is_remote=False, data_path=failing))
    assert condition(own, "PrefillClusterReady").reason == "InstancesReady"
    assert failing.message not in condition(own, "Ready").message
    down = compute_status(inputs(prefill_cluster=ClusterObservation(Problem("Unreachable", "gone"))))
    assert condition(down, "PrefillClusterReady").reason == "Unreachable"  # a problem comes first


def test_unreachable_prefill_cluster_is_degraded_and_keeps_the_last_counts() -> None:
    previous = PrfaasDeploymentStatus(prefill_cluster=RoleCounts(desired=4, ready=3))
    problem = Problem(
        "Unreachable", "cannot reach the PrfaaS cluster at https://127.0.0.1:1: connection refused"
    )
    status = compute_status(inputs(prefill_cluster=ClusterObservation(problem), previous=previous))
    prefill = condition(status, "PrefillClusterReady")
    assert (prefill.status, prefill.reason) == ("False", "Unreachable")
    assert "https://127.0.0.1:1" in prefill.message and "last observed" in prefill.message
    assert status.prefill_cluster.ready == 3, "unknown is not zero: the last observed count stays"
    ready = condition(status, "Ready")
    assert (ready.status, ready.reason) == ("False", "PrefillClusterNotReady")
    degraded = condition(status, "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "Unreachable")
    assert "PrfaaS cluster: cannot reach" in degraded.message
    assert condition(status, "PDClusterReady").status == "True", "the local side is judged on its own"


def test_pods_short_of_gpus_say_insufficient_gpu() -> None:
    stuck = PodInfo(
        name="x-pd-decode-4",
        role="pd-decode",
        fingerprint="abc123",
        ip=None,
        ready=False,
        unschedulable=GPU_SHORT,
    )
    pd = ClusterObservation(ready={"pd-prefill": 3, "pd-decode": 4, "router": 1}, pods=[stuck])
    status = compute_status(inputs(pd_cluster=pd))
    pd_ready = condition(status, "PDClusterReady")
    assert (pd_ready.status, pd_ready.reason) == ("False", "InsufficientGPU")
    assert "4/5 decode" in pd_ready.message and "Insufficient nvidia.com/gpu" in pd_ready.message
    assert condition(status, "Degraded").reason == "InsufficientGPU"


def test_not_yet_ready_is_progressing_not_degraded() -> None:
    pd = ClusterObservation(ready={"pd-prefill": 1, "pd-decode": 5, "router": 1})
    status = compute_status(inputs(pd_cluster=pd))
    assert condition(status, "PDClusterReady").reason == "Progressing"
    assert condition(status, "Degraded").status == "False"


def test_a_router_config_without_decode_endpoints_is_not_ready() -> None:
    config = RouterConfigOutcome(
        version=1, endpoint_counts={"prfaas_prefill": 0, "local_prefill": 0, "decode": 0}
    )
    status = compute_status(inputs(router_config=config))
    router = condition(status, "RouterReady")
    assert (router.status, router.reason) == ("False", "NoEndpoints")


def test_an_invalid_profile_degrades_but_the_kept_config_still_serves() -> None:
    kept = RouterConfigOutcome(
        3, CONFIG.endpoint_counts, problem=Problem("InvalidProfile", "prefill profile refused")
    )
    status = compute_status(inputs(router_config=kept))
    assert condition(status, "RouterReady").status == "True"
    assert condition(status, "Degraded").reason == "InvalidProfile"


def test_transition_times_move_only_on_a_flip() -> None:
    first = compute_status(inputs())
    later = compute_status(inputs(previous=first, now="2026-11-21T10:05:00Z"))
    assert not status_changed(first, later), "an unchanged world writes nothing"
    flipped = compute_status(
        inputs(
            previous=first,
            now="2026-11-21T10:06:00Z",
            prefill_cluster=ClusterObservation(Problem("Forbidden", "no")),
        )
    )
    assert condition(flipped, "PrefillClusterReady").last_transition_time == "2026-11-21T10:06:00Z"
    assert condition(flipped, "PDClusterReady").last_transition_time == "2026-11-21T10:00:00Z"


def test_warning_events_fire_on_degradation_and_on_a_new_reason_only() -> None:
    healthy = compute_status(inputs())
    broken = compute_status(
        inputs(prefill_cluster=ClusterObservation(Problem("SecretNotFound", "Secret x/y not found")))
    )
    assert [w.reason for w in warning_events(healthy.conditions, broken.conditions)] == ["SecretNotFound"]
    assert warning_events(broken.conditions, broken.conditions) == []
    other = compute_status(inputs(prefill_cluster=ClusterObservation(Problem("Unreachable", "down"))))
    assert [w.reason for w in warning_events(broken.conditions, other.conditions)] == ["Unreachable"]
    assert warning_events(broken.conditions, healthy.conditions) == []


def test_pod_info_from_a_manifest() -> None:
    manifest = {
        "metadata": {"name": "a-0", "labels": {"prfaas.io/role": "pd-decode", "prfaas.io/fingerprint": "f"}},
        "status": {
            "podIP": "127.200.1.9",
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}],
        },
    }
    assert PodInfo.from_manifest(manifest) == PodInfo("a-0", "pd-decode", "f", "127.200.1.9", ready=True)
    pending = {
        "metadata": {"name": "a-1", "deletionTimestamp": "2026-11-21T10:00:00Z"},
        "status": {"conditions": [{"type": "PodScheduled", "status": "False", "message": GPU_SHORT}]},
    }
    info = PodInfo.from_manifest(pending)
    assert (info.ready, info.ip, info.deleting, info.unschedulable) == (False, None, True, GPU_SHORT)


def test_the_status_patch_removes_a_finished_rollout_with_null() -> None:
    rolling = compute_status(inputs()).model_copy(
        update={
            "rollout": RolloutStatus(
                phase="Progressing",
                step=0,
                steps=1,
                started_at="2026-01-01T00:00:00Z",
                last_progress_at="2026-01-01T00:00:00Z",
            )
        }
    )
    done = compute_status(inputs())
    assert status_patch(rolling, done)["rollout"] is None  # a merge patch without the key keeps it
    assert "rollout" not in status_patch(done, done)
    assert status_patch(done, rolling)["rollout"]["phase"] == "Progressing"


def test_the_status_patch_removes_a_rollouts_failed_record_with_null() -> None:
    """A fresh rollout after a failed one: the nested record goes too (a merge patch keeps what it omits)."""
    at = "2026-01-01T00:00:00Z"
    fresh = RolloutStatus(phase="Progressing", step=0, steps=1, started_at=at, last_progress_at=at)
    failed = fresh.model_copy(
        update={
            "phase": "Failed",
            "failed": FailedRevision(
                fingerprint="bbb", revisions={"pd-decode": "r2"}, reason="errors", time=at
            ),
        }
    )
    before = compute_status(inputs()).model_copy(update={"rollout": failed})
    after = compute_status(inputs()).model_copy(update={"rollout": fresh})
    patch = status_patch(before, after)["rollout"]
    assert patch["failed"] is None and patch["phase"] == "Progressing"


def test_a_rollout_waiting_for_the_analysis_past_its_deadline_says_so() -> None:
    at = "2026-11-21T09:00:00Z"
    done = DECODE_SURGE.model_copy(update={"ready": DECODE_SURGE.replicas})
    waiting = RolloutAnalysis(
        verdict="Wait", reason="the old revision had 5 attempts, fewer than minAttempts 20"
    )
    rollout = RolloutStatus(
        phase="Stalled", step=1, steps=1, started_at=at, last_progress_at=at, roles=[done], analysis=waiting
    )
    rolling = condition(compute_status(inputs(rollout=rollout)), "RolloutProgressing")
    assert (rolling.status, rolling.reason) == ("False", "ProgressDeadlineExceeded")
    assert (
        "waiting for the analysis of the new revision to retire the old one (Wait: the old revision had 5"
        in (rolling.message)
    )


def test_a_stalled_rollout_says_which_role_it_waits_for_and_why_and_degrades() -> None:
    pulled = {
        "metadata": {
            "name": "demo-pd-decode-b-0",
            "labels": {"prfaas.io/role": "pd-decode", "prfaas.io/revision": "r2"},
        },
        "status": {
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [
                {"name": "sglang", "state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}}}
            ],
        },
    }
    at = "2026-11-21T09:00:00Z"
    rollout = RolloutStatus(
        phase="Stalled", step=0, steps=1, started_at=at, last_progress_at=at, roles=[DECODE_SURGE]
    )
    pd = ClusterObservation(ready=ALL_READY_PD.ready, pods=[PodInfo.from_manifest(pulled)])
    status = compute_status(inputs(pd_cluster=pd, rollout=rollout))
    rolling = condition(status, "RolloutProgressing")
    assert (rolling.status, rolling.reason) == ("False", "ProgressDeadlineExceeded")
    assert "waiting for pd-decode" in rolling.message and "ErrImagePull: not found" in rolling.message
    assert "old revision keeps serving" in rolling.message
    degraded = condition(status, "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "ProgressDeadlineExceeded")
    assert status.pd_decode.rolling and not status.pd_prefill.rolling


def test_a_rollout_whose_surge_cannot_be_placed_says_so() -> None:
    pending = PodInfo(
        "demo-pd-decode-b-0", "pd-decode", "fp2", None, False, unschedulable=GPU_SHORT, revision="r2"
    )
    at = "2026-11-21T09:59:00Z"
    rollout = RolloutStatus(
        phase="Progressing", step=0, steps=5, started_at=at, last_progress_at=at, roles=[DECODE_SURGE]
    )
    pd = ClusterObservation(ready=ALL_READY_PD.ready, pods=[pending])
    rolling = condition(compute_status(inputs(pd_cluster=pd, rollout=rollout)), "RolloutProgressing")
    assert (rolling.status, rolling.reason) == ("True", "RolloutInProgress")
    assert (
        "1 new-revision pod(s) cannot be scheduled" in rolling.message
        and "Insufficient nvidia.com/gpu" in rolling.message
    )


def test_a_rollout_held_by_an_unobservable_cluster_says_which_and_why() -> None:
    at = "2026-11-21T09:59:00Z"
    rollout = RolloutStatus(
        phase="Progressing", step=0, steps=5, started_at=at, last_progress_at=at, roles=[DECODE_SURGE]
    )
    refused = Problem(
        "Unreachable", "cannot reach the PrfaaS cluster at https://127.0.0.1:1: connection refused"
    )
    status = compute_status(inputs(prefill_cluster=ClusterObservation(refused), rollout=rollout))
    rolling = condition(status, "RolloutProgressing")
    assert (rolling.status, rolling.reason) == ("True", "WaitingForCluster")
    assert rolling.message.startswith(f"waiting for the PrfaaS cluster ({refused.message}): the step holds")
    assert "old revision keeps serving" in rolling.message and "step 0/5" in rolling.message
    assert rolling.message.endswith("(a role of a cluster not observed: its counts as last observed)")
    observed = compute_status(inputs(rollout=rollout))
    assert condition(observed, "RolloutProgressing").reason == "RolloutInProgress"
    paused = compute_status(
        inputs(
            prefill_cluster=ClusterObservation(refused),
            rollout=rollout.model_copy(update={"phase": "Paused"}),
        )
    )
    assert condition(paused, "RolloutProgressing").reason == "RolloutPaused", "paused says paused first"
