"""The reconcile pass without a cluster: observations built by hand, the three pure steps chained.

Each case follows the sample PrfaasDeployment (examples/prfaasdeployment.yaml: 4 PrfaaS prefill
instances in a remote cluster, 3 local prefill + 5 decode) through one or more passes, the way
the executor (reconcile.Reconciler) runs them: plan the PD cluster's engines, then the router
config and the PrfaaS cluster's children, then conclude with what the applies did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prfaas_core.router_config import RouterConfig
from prfaas_core.vocabulary import Pool, Role
from prfaas_operator.adapters.kube import SECRET_NOT_FOUND, UNREACHABLE
from prfaas_operator.api import Allocation, PrfaasDeploymentSpec, PrfaasDeploymentStatus, RoleCounts
from prfaas_operator.planning import remote_backoff
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.analysis import Figures, Observed
from prfaas_operator.planning.drain import Drain
from prfaas_operator.planning.fingerprint import kv_fingerprint
from prfaas_operator.planning.manifests import Names, Owner, engine_roles, engine_workload, revision_of
from prfaas_operator.planning.reconcile_pass import (
    Applies,
    Conclusion,
    EnginePlan,
    Instant,
    PassInput,
    PassPlan,
    PrefillClusterSeen,
    ReconcileOptions,
    StoredRouterConfig,
    conclude_pass,
    needs_stored_router_config,
    pace,
    plan_pd_engines,
    plan_router_and_prefill_cluster,
    retired,
)
from prfaas_operator.planning.remote_backoff import RemoteBackoff
from prfaas_operator.planning.rollout import RolePlan, RolloutDecision, Slot
from prfaas_operator.planning.status import ClusterObservation, PodInfo, Problem
from support.sample_cr import spec

OWNER = Owner(name="kimi-linear", namespace="prfaas-demo", uid="uid-1")
NAMES = Names.of(OWNER.name)
OPTIONS = ReconcileOptions()
WALL_NOW = datetime(2026, 1, 1, tzinfo=UTC)


def pods(workload: str, role: str, count: int, fingerprint: str, *, ready: bool = True) -> list[PodInfo]:
    base = {Role.PRFAAS_PREFILL: 1, Role.PD_PREFILL: 2, Role.PD_DECODE: 3}[role]
    return [
        PodInfo(f"{workload}-{n}", role, fingerprint, f"10.{base}.0.{n + 1}", ready) for n in range(count)
    ]


def seen(pod_list: Sequence[PodInfo]) -> ClusterObservation:
    """A cluster observed with these pods, each role's ready count taken from them."""
    ready: dict[str, int] = {}
    for pod in pod_list:
        ready[pod.role or ""] = ready.get(pod.role or "", 0) + pod.ready
    return ClusterObservation(ready={**ready, Role.ROUTER: 1}, pods=pod_list)


def everything_ready(
    s: PrfaasDeploymentSpec, prfaas: int = 4, local_prefill: int = 3, decode: int = 5
) -> tuple[ClusterObservation, ClusterObservation]:
    fingerprint = kv_fingerprint(s.model)
    remote = pods(NAMES.prfaas_prefill, Role.PRFAAS_PREFILL, prfaas, fingerprint)
    local = [
        *pods(NAMES.pd_prefill, Role.PD_PREFILL, local_prefill, fingerprint),
        *pods(NAMES.pd_decode, Role.PD_DECODE, decode, fingerprint),
    ]
    return seen(remote), seen(local)


def settled_slots(s: PrfaasDeploymentSpec, live: Mapping[str, int | None]) -> dict[str, list[Slot] | None]:
    """Each role's one StatefulSet at `live` replicas (None: absent), all ready, running the spec's
    revision: no rollout in progress."""
    fingerprint = kv_fingerprint(s.model)
    slots: dict[str, list[Slot] | None] = {}
    for engine in engine_roles(s, OWNER, effective_allocation(s, None).allocation):
        manifest = engine_workload(s.model, engine, OWNER, fingerprint)
        replicas = live.get(engine.role)
        slots[engine.role] = (
            []
            if replicas is None
            else [Slot(engine.name, revision_of(manifest), replicas, replicas, live=manifest)]
        )
    return slots


@dataclass
class Memory:
    """What the executor keeps per CR between passes (only what the pure steps read)."""

    drains: Mapping[str, Drain]
    router_config: RouterConfig | None = None


@dataclass(frozen=True)
class Pass:
    engines: EnginePlan
    plan: PassPlan
    conclusion: Conclusion


def run_pass(
    s: PrfaasDeploymentSpec,
    memory: Memory,
    now: float,
    *,
    live: Mapping[str, int | None] | None = None,
    prefill: ClusterObservation | None = None,
    pd: ClusterObservation | None = None,
    reachable: bool = True,
    previous: PrfaasDeploymentStatus | None = None,
    stored: StoredRouterConfig | None = None,
    applies: Applies | None = None,
    running: PrfaasDeploymentSpec | None = None,
    slots: Mapping[str, Sequence[Slot] | None] | None = None,
    wall: datetime = WALL_NOW,
) -> Pass:
    """One pass with everything applied as planned; memory is updated as the executor does.

    `running`: the spec the live StatefulSets were written from (default: `s`, nothing to roll);
    `slots`: each role's live StatefulSets (default: one per role, from `running` and `live`)."""
    previous = previous or PrfaasDeploymentStatus()
    default_prefill, default_pd = everything_ready(s)
    prefill = prefill or default_prefill
    pd = pd or default_pd
    live = live or {Role.PD_PREFILL: 3, Role.PD_DECODE: 5, Role.PRFAAS_PREFILL: 4}
    slots = slots if slots is not None else settled_slots(running or s, live)
    pass_input = PassInput(s, OWNER, 1, previous, Instant(now, wall))
    engines = plan_pd_engines(pass_input, memory.drains, slots, OPTIONS)
    remote = PrefillClusterSeen(prefill, reachable, slots[Role.PRFAAS_PREFILL] if reachable else None)
    plan = plan_router_and_prefill_cluster(
        pass_input, engines, remote, pd, memory.router_config, stored, OPTIONS
    )
    conclusion = conclude_pass(
        pass_input, engines, plan, (prefill, pd), applies or Applies(), memory.router_config, OPTIONS
    )
    memory.drains, memory.router_config = conclusion.drains, conclusion.router_config
    return Pass(engines, plan, conclusion)


def statefulset(manifests: Sequence[Mapping[str, Any]] | None, name: str) -> Mapping[str, Any]:
    assert manifests is not None, "nothing planned for that cluster"
    (found,) = [m for m in manifests if m["kind"] == "StatefulSet" and m["metadata"]["name"] == name]
    return found


def listed(config: RouterConfig | None, pool: Pool) -> list[str]:
    assert config is not None
    return [endpoint.name for endpoint in config.pools.of(pool)]


def condition(status: PrfaasDeploymentStatus, kind: str) -> tuple[str, str, str]:
    (found,) = [c for c in status.conditions if c.type == kind]
    return found.status, found.reason, found.message


# ---- a steady pass -----------------------------------------------------------------------------


def test_a_steady_pass_applies_the_spec_and_lists_every_ready_engine() -> None:
    s = spec()
    done = run_pass(s, Memory({}), 100.0)
    assert statefulset(done.engines.manifests, NAMES.pd_decode)["spec"]["replicas"] == 5
    assert statefulset(done.plan.prefill_cluster_manifests, NAMES.prfaas_prefill)["spec"]["replicas"] == 4
    assert [m["kind"] for m in done.plan.router_manifests] == ["Deployment", "ConfigMap"]
    assert done.plan.router_config.action == "build"
    config = done.plan.router_config.config
    assert config is not None and config.version == 1
    assert len(listed(config, Pool.PRFAAS_PREFILL)) == 4
    assert len(listed(config, Pool.DECODE)) == 5
    assert condition(done.conclusion.status, "Ready")[0] == "True"
    assert done.conclusion.router_config_written
    assert done.conclusion.come_back_within is None
    assert pace(done.conclusion.status, 1.0, OPTIONS).delay == OPTIONS.resync_seconds


def test_a_second_pass_with_nothing_new_keeps_the_config_version() -> None:
    s, memory = spec(), Memory({})
    first = run_pass(s, memory, 100.0)
    second = run_pass(s, memory, 101.0, previous=first.conclusion.status)
    assert second.plan.router_config.config == first.plan.router_config.config
    assert not second.conclusion.router_config_written


# ---- drain -------------------------------------------------------------------------------------


def test_scaling_decode_down_drains_first_then_shrinks_the_statefulset() -> None:
    s = spec(**{"pdCluster.prefillInstances": 5, "pdCluster.decodeInstances": 3})
    memory = Memory({})
    live = {Role.PD_PREFILL: 3, Role.PD_DECODE: 5, Role.PRFAAS_PREFILL: 4}

    started = run_pass(s, memory, 100.0, live=live)
    (decode_drain,) = [d for role, d in started.engines.drains.items() if role == Role.PD_DECODE]
    assert (decode_drain.held, decode_drain.target) == (5, 3)
    assert statefulset(started.engines.manifests, NAMES.pd_decode)["spec"]["replicas"] == 5, "held"
    assert statefulset(started.engines.manifests, NAMES.pd_prefill)["spec"]["replicas"] == 5, (
        "scale-up at once"
    )
    assert listed(started.plan.router_config.config, Pool.DECODE) == [
        f"{NAMES.pd_decode}-{n}" for n in range(3)
    ]
    assert memory.drains[Role.PD_DECODE].since == 100.0, "the clock starts once that config is written"
    assert started.conclusion.come_back_within == OPTIONS.drain_seconds
    assert any("draining" in note for note in started.engines.notes)

    holding = run_pass(s, memory, 100.0 + OPTIONS.drain_seconds / 2, live=live)
    assert statefulset(holding.engines.manifests, NAMES.pd_decode)["spec"]["replicas"] == 5
    assert holding.conclusion.come_back_within == pytest.approx(OPTIONS.drain_seconds / 2)

    released = run_pass(s, memory, 100.0 + OPTIONS.drain_seconds, live=live)
    assert statefulset(released.engines.manifests, NAMES.pd_decode)["spec"]["replicas"] == 3
    assert memory.drains[Role.PD_DECODE].released, "kept until the pods are gone"
    assert listed(released.plan.router_config.config, Pool.DECODE) == [
        f"{NAMES.pd_decode}-{n}" for n in range(3)
    ]

    _, shrunk = everything_ready(s, local_prefill=5, decode=3)
    finished = run_pass(s, memory, 200.0, live={**live, Role.PD_DECODE: 3}, pd=shrunk)
    assert Role.PD_DECODE not in memory.drains
    assert statefulset(finished.engines.manifests, NAMES.pd_decode)["spec"]["replicas"] == 3


def test_a_drain_clock_waits_for_the_router_config_to_be_written() -> None:
    s = spec(**{"pdCluster.prefillInstances": 5, "pdCluster.decodeInstances": 3})
    memory = Memory({})
    problem = Problem("Forbidden", "cannot apply the router ConfigMap")
    run_pass(
        s,
        memory,
        100.0,
        live={Role.PD_PREFILL: 3, Role.PD_DECODE: 5},
        applies=Applies(router_problem=problem),
    )
    assert memory.drains[Role.PD_DECODE].since is None
    assert memory.router_config is None


def test_scaling_the_prfaas_pool_down_drains_its_highest_ordinals() -> None:
    s = spec(**{"prefillCluster.replicas": 2})
    memory = Memory({})
    done = run_pass(s, memory, 100.0)
    assert statefulset(done.plan.prefill_cluster_manifests, NAMES.prfaas_prefill)["spec"]["replicas"] == 4
    assert listed(done.plan.router_config.config, Pool.PRFAAS_PREFILL) == [
        f"{NAMES.prfaas_prefill}-{n}" for n in range(2)
    ]


def test_a_target_lowered_mid_rollout_drains_the_old_slot_then_the_new_one() -> None:
    """pdCluster.decodeInstances lowered from 5 to 2 while the decodes roll (2 old, 4 new, all
    ready; the other roles done): the old slot leaves the router config and is held until the
    drain time has passed, the new slot held at 4 meanwhile (it shrank at once before); once the
    old slot is gone, the new one's two highest ordinals drain the same way."""
    args = ["--trust-remote-code", "--log-level", "debug"]  # a new revision, the same KV layout
    old_spec = spec()
    new_spec = spec(**{"model.extraArgs": args, "pdCluster.decodeInstances": 2})
    fingerprint = kv_fingerprint(new_spec.model)
    assert fingerprint == kv_fingerprint(old_spec.model)
    allocation = effective_allocation(new_spec, None).allocation
    old_decode, new_decode = (
        engine_workload(
            version.model,
            {e.role: e for e in engine_roles(version, OWNER, allocation)}[Role.PD_DECODE],
            OWNER,
            fingerprint,
        )
        for version in (old_spec, new_spec)
    )
    new_name = f"{NAMES.pd_decode}-b"
    prefill_pods = pods(NAMES.pd_prefill, Role.PD_PREFILL, 3, fingerprint)
    new_pods = [
        PodInfo(f"{new_name}-{n}", Role.PD_DECODE, fingerprint, f"10.3.1.{n + 1}", True) for n in range(4)
    ]

    def slots(old: int, new: int) -> dict[str, Sequence[Slot] | None]:
        found: dict[str, Sequence[Slot] | None] = dict(
            settled_slots(new_spec, {Role.PD_PREFILL: 3, Role.PRFAAS_PREFILL: 4})
        )
        found[Role.PD_DECODE] = [
            Slot(
                NAMES.pd_decode, revision_of(old_decode), old, old, live=old_decode, fingerprint=fingerprint
            ),
            Slot(new_name, revision_of(new_decode), new, new, live=new_decode, fingerprint=fingerprint),
        ]
        return found

    def decode_replicas(done: Pass) -> list[int]:
        """The replicas the old and the new slot get this pass."""
        return [
            statefulset(done.engines.manifests, name)["spec"]["replicas"]
            for name in (NAMES.pd_decode, new_name)
        ]

    memory = Memory({})
    both = seen([*prefill_pods, *pods(NAMES.pd_decode, Role.PD_DECODE, 2, fingerprint), *new_pods])
    first = run_pass(new_spec, memory, 100.0, pd=both, slots=slots(2, 4))
    assert first.engines.rollout.status is not None
    assert memory.drains[Role.PD_DECODE] == Drain(NAMES.pd_decode, 0, 2, since=100.0)
    assert decode_replicas(first) == [2, 4], "the old slot held while it drains, the new one held too"
    assert listed(first.plan.router_config.config, Pool.DECODE) == [p.name for p in new_pods]
    released = run_pass(new_spec, memory, 100.0 + OPTIONS.drain_seconds, pd=both, slots=slots(2, 4))
    assert decode_replicas(released) == [0, 4], "the old slot scaled away after the drain; the new one waits"

    new_only = seen([*prefill_pods, *new_pods])
    second = run_pass(new_spec, memory, 200.0, pd=new_only, slots=slots(0, 4))
    assert second.engines.retire == [("StatefulSet", OWNER.namespace, NAMES.pd_decode)], "the old slot goes"
    assert memory.drains[Role.PD_DECODE] == Drain(new_name, 2, 4, since=200.0)
    assert statefulset(second.engines.manifests, new_name)["spec"]["replicas"] == 4, "held while it drains"
    assert listed(second.plan.router_config.config, Pool.DECODE) == [p.name for p in new_pods[:2]]
    done = run_pass(new_spec, memory, 200.0 + OPTIONS.drain_seconds, pd=new_only, slots=slots(0, 4))
    assert statefulset(done.engines.manifests, new_name)["spec"]["replicas"] == 2


# ---- remote backoff ----------------------------------------------------------------------------


def test_backoff_doubles_up_to_its_cap_and_reports_when_it_retries() -> None:
    problem = Problem(UNREACHABLE, "the PrfaaS cluster does not answer")
    backoff, now, delays = RemoteBackoff(), 0.0, []
    for _ in range(6):
        assert remote_backoff.waiting(backoff, now) is None, "a try is due"
        backoff = remote_backoff.failed(
            backoff, problem, now, OPTIONS.remote_backoff_seconds, OPTIONS.remote_backoff_max_seconds
        )
        delays.append(backoff.retry_at - now)
        now = backoff.retry_at
    assert delays == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    backoff = remote_backoff.failed(backoff, problem, 100.0, 2.0, 30.0)
    waiting = remote_backoff.waiting(backoff, 110.0)
    assert waiting is not None and waiting.reason == UNREACHABLE
    assert waiting.message.endswith("(next retry in 20s)")
    assert remote_backoff.waiting(remote_backoff.try_now(backoff), 110.0) is None, "a new spec tries now"
    assert remote_backoff.succeeded(backoff).failures == 0


def test_an_unreachable_prfaas_cluster_keeps_its_last_counts_and_its_endpoints_for_a_bounded_time() -> None:
    s, memory = spec(), Memory({})
    before = run_pass(s, memory, 100.0)
    assert listed(before.plan.router_config.config, Pool.PRFAAS_PREFILL)
    first = before.plan.router_config.config
    assert first is not None and all(e.unobserved_since is None for e in first.pools.prfaas_prefill)
    problem = Problem(UNREACHABLE, "the PrfaaS cluster does not answer")

    def cut_at(seconds: float, previous: PrfaasDeploymentStatus) -> Pass:
        return run_pass(
            s,
            memory,
            100.0 + seconds,
            prefill=ClusterObservation(problem),
            reachable=False,
            previous=previous,
            wall=WALL_NOW + timedelta(seconds=seconds),
        )

    cut = cut_at(10, before.conclusion.status)
    status = cut.conclusion.status
    assert status.prefill_cluster == RoleCounts(desired=4, ready=4), "unknown is not zero"
    ok, reason, message = condition(status, "PrefillClusterReady")
    assert (ok, reason) == ("False", UNREACHABLE)
    assert "ready counts are the last observed" in message
    assert condition(status, "Degraded")[:2] == ("True", UNREACHABLE)
    kept = cut.plan.router_config.config
    assert kept is not None
    assert [e.model_copy(update={"unobserved_since": None}) for e in kept.pools.prfaas_prefill] == (
        first.pools.prfaas_prefill
    ), "the engines keep serving while their apiserver is away"
    since = (WALL_NOW + timedelta(seconds=10)).timestamp()
    assert {e.unobserved_since for e in kept.pools.prfaas_prefill} == {since}, "the router checks them"
    assert kept.version == first.version + 1
    assert "not observed: 4 PrfaaS prefill endpoint(s) kept" in condition(status, "RouterReady")[2]

    later = cut_at(300, status)
    assert later.plan.router_config.config == kept, "the bound counts from the first pass without them"
    message = condition(later.conclusion.status, "RouterReady")[2]
    assert "kept from the last observation 290s ago, for at most 300s" in message
    gone = cut_at(310, later.conclusion.status).plan.router_config.config
    assert listed(gone, Pool.PRFAAS_PREFILL) == []
    assert len(listed(gone, Pool.LOCAL_PREFILL)) == 3, "traffic stays local"
    assert gone is not None and gone.version == kept.version + 1
    back = run_pass(s, memory, 500.0, previous=status).plan.router_config.config
    assert back is not None and [e.unobserved_since for e in back.pools.prfaas_prefill] == [None] * 4


def test_with_no_time_to_keep_them_the_unobserved_prfaas_endpoints_leave_at_once() -> None:
    s, memory = spec(**{"prefillCluster.keepUnobservedEndpointsSeconds": 0}), Memory({})
    before = run_pass(s, memory, 100.0)
    problem = Problem(UNREACHABLE, "the PrfaaS cluster does not answer")
    cut = run_pass(
        s,
        memory,
        110.0,
        prefill=ClusterObservation(problem),
        reachable=False,
        previous=before.conclusion.status,
    )
    assert listed(cut.plan.router_config.config, Pool.PRFAAS_PREFILL) == []
    assert len(listed(cut.plan.router_config.config, Pool.LOCAL_PREFILL)) == 3


def test_a_prfaas_cluster_that_fails_while_applying_replaces_its_observation() -> None:
    s = spec()
    problem = Problem("Forbidden", "statefulsets is forbidden")
    done = run_pass(s, Memory({}), 100.0, applies=Applies(prefill_cluster_seen=ClusterObservation(problem)))
    assert condition(done.conclusion.status, "PrefillClusterReady")[:2] == ("False", "Forbidden")


def test_an_unreachable_prfaas_cluster_at_creation_serves_locally_and_says_why() -> None:
    s = spec()
    problem = Problem(SECRET_NOT_FOUND, "Secret prfaas-demo/prfaas-cluster-kubeconfig not found")
    done = run_pass(s, Memory({}), 100.0, prefill=ClusterObservation(problem), reachable=False)
    status = done.conclusion.status
    assert status.prefill_cluster == RoleCounts(desired=4, ready=0)
    assert condition(status, "PrefillClusterReady")[:2] == ("False", SECRET_NOT_FOUND)
    assert condition(status, "Ready")[0] == "False"
    assert condition(status, "PDClusterReady")[0] == "True"
    assert Role.PRFAAS_PREFILL not in done.plan.drains, "nothing was looked at there"
    assert listed(done.plan.router_config.config, Pool.PRFAAS_PREFILL) == []
    assert len(listed(done.plan.router_config.config, Pool.DECODE)) == 5
    assert pace(status, 1.0, OPTIONS).delay == 1.0, "not Ready: converging"


# ---- restart recovery --------------------------------------------------------------------------


def _restarted(version: int) -> tuple[PrfaasDeploymentSpec, PrfaasDeploymentStatus, RouterConfig]:
    """What a restarted operator finds: a status recording `version`, and that config in the ConfigMap."""
    s, memory = spec(), Memory({})
    first = run_pass(s, memory, 100.0)
    assert first.plan.router_config.config is not None
    config = first.plan.router_config.config.model_copy(update={"version": version})
    status = first.conclusion.status
    assert status.allocation is not None
    allocation = status.allocation.model_copy(update={"router_config_version": version})
    return s, status.model_copy(update={"allocation": allocation}), config


def test_a_restart_reads_the_router_config_in_force_and_keeps_its_version() -> None:
    s, previous, stored = _restarted(7)
    assert needs_stored_router_config(None, previous)
    assert not needs_stored_router_config(stored, previous), "memory knows it: no read"
    assert not needs_stored_router_config(None, PrfaasDeploymentStatus()), "never written: nothing to read"
    done = run_pass(s, Memory({}), 5.0, previous=previous, stored=StoredRouterConfig(stored))
    assert (done.plan.router_config.action, done.plan.router_config.config) == ("build", stored)
    assert done.conclusion.status.allocation is not None
    assert done.conclusion.status.allocation.router_config_version == 7


def test_after_a_restart_the_version_never_goes_backwards() -> None:
    s, previous, stored = _restarted(7)
    lost = run_pass(s, Memory({}), 5.0, previous=previous, stored=StoredRouterConfig(None))
    assert lost.plan.router_config.config is not None and lost.plan.router_config.config.version == 8, (
        "ConfigMap gone: above the status"
    )
    changed = StoredRouterConfig(stored.model_copy(update={"threshold_tokens": 1}))
    moved = run_pass(s, Memory({}), 5.0, previous=previous, stored=changed)
    assert moved.plan.router_config.config is not None and moved.plan.router_config.config.version == 8


def test_after_a_restart_a_listing_cache_keeps_the_config_in_force() -> None:
    s, previous, stored = _restarted(7)
    done = run_pass(
        s,
        Memory({}),
        5.0,
        previous=previous,
        stored=StoredRouterConfig(stored),
        prefill=ClusterObservation(listing=True),
        pd=ClusterObservation(listing=True),
    )
    decision = done.plan.router_config
    assert (decision.action, decision.config) == ("keep", stored), "not one built from an empty cache"
    assert done.conclusion.come_back_within == OPTIONS.converge_seconds
    assert done.conclusion.status.prefill_cluster.ready == previous.prefill_cluster.ready


def test_a_router_configmap_that_cannot_be_read_after_a_restart_fails_the_pd_side() -> None:
    s, previous, _ = _restarted(7)
    problem = Problem(UNREACHABLE, "get ConfigMap: connection refused")
    done = run_pass(s, Memory({}), 5.0, previous=previous, stored=StoredRouterConfig(problem=problem))
    assert (done.plan.router_config.action, done.plan.router_config.config) == ("unknown", None)
    assert [m["kind"] for m in done.plan.router_manifests] == ["Deployment"]
    status = done.conclusion.status
    assert condition(status, "PDClusterReady")[:2] == ("False", UNREACHABLE)
    assert status.allocation is not None and status.allocation.router_config_version == 7


# ---- KV fingerprint rollout --------------------------------------------------------------------


def test_a_layout_rollout_lists_each_layout_that_can_serve_with_its_fingerprint() -> None:
    old_spec = spec()
    new_spec = spec(**{"model.image": "lmsysorg/sglang:v0.5.24"})
    old, new = kv_fingerprint(old_spec.model), kv_fingerprint(new_spec.model)
    assert old != new
    memory = Memory({})
    remote = pods(NAMES.prfaas_prefill, Role.PRFAAS_PREFILL, 4, old)
    local_old = [
        *pods(NAMES.pd_prefill, Role.PD_PREFILL, 3, old),
        *pods(NAMES.pd_decode, Role.PD_DECODE, 4, old),
    ]
    new_decode = [PodInfo(f"{NAMES.pd_decode}-b-0", Role.PD_DECODE, new, "10.3.0.9", True)]
    rolling = run_pass(new_spec, memory, 100.0, prefill=seen(remote), pd=seen([*local_old, *new_decode]))
    config = rolling.plan.router_config.config
    assert config is not None and config.fingerprint == new
    assert f"{NAMES.pd_decode}-b-0" not in listed(config, Pool.DECODE), "a new decode and no new prefill: no"
    assert {e.fingerprint for pool in Pool for e in config.pools.of(pool)} == {old}
    assert (
        rolling.plan.router_config.outcome.note is not None
        and "rollout" in rolling.plan.router_config.outcome.note
    )

    new_prefill = [PodInfo(f"{NAMES.pd_prefill}-b-0", Role.PD_PREFILL, new, "10.2.0.9", True)]
    both = run_pass(
        new_spec, memory, 101.0, prefill=seen(remote), pd=seen([*local_old, *new_prefill, *new_decode])
    )
    config = both.plan.router_config.config
    assert config is not None
    tagged = {(e.name, e.fingerprint) for pool in Pool for e in config.pools.of(pool)}
    assert (f"{NAMES.pd_decode}-b-0", new) in tagged and (f"{NAMES.pd_prefill}-b-0", new) in tagged
    assert (f"{NAMES.pd_decode}-0", old) in tagged and (f"{NAMES.prfaas_prefill}-0", old) in tagged
    assert len(tagged) == 4 + 3 + 4 + 2


def test_a_new_image_comes_up_in_each_roles_second_statefulset_beside_the_old_one() -> None:
    old_spec = spec()
    new_spec = spec(**{"model.image": "lmsysorg/sglang:v0.5.24"})
    first = run_pass(new_spec, Memory({}), 100.0, running=old_spec)
    for manifests, workload, target in (
        (first.plan.prefill_cluster_manifests, NAMES.prfaas_prefill, 4),
        (first.engines.manifests, NAMES.pd_prefill, 3),
        (first.engines.manifests, NAMES.pd_decode, 5),
    ):
        new, old = statefulset(manifests, f"{workload}-b"), statefulset(manifests, workload)
        assert new["spec"]["replicas"] == 1, "one new instance per role at a time (maxSurge 1)"
        assert new["spec"]["selector"]["matchLabels"]["prfaas.io/slot"] == "b"
        assert new["spec"]["template"]["metadata"]["labels"]["prfaas.io/fingerprint"] == kv_fingerprint(
            new_spec.model
        )
        assert old["spec"]["replicas"] == target, "the old revision keeps serving at full size"
        assert old["spec"]["template"]["spec"]["containers"][0]["image"] == "lmsysorg/sglang:v0.5.23"
        assert "prfaas.io/slot" not in old["spec"]["selector"]["matchLabels"]
    status = first.conclusion.status
    assert status.rollout is not None and status.rollout.phase == "Progressing"
    assert status.rollout.steps == 5  # the largest role (5 decodes) one at a time
    assert condition(status, "RolloutProgressing")[:2] == ("True", "RolloutInProgress")
    assert status.pd_decode.rolling and status.pd_prefill.rolling and status.prefill_cluster.rolling
    assert first.engines.rollout.event is not None and first.engines.rollout.event[0] == "RolloutStarted"


def test_the_prfaas_cluster_is_left_alone_while_its_statefulsets_are_unknown() -> None:
    """Just after a restart step 1 has no cache of the PrfaaS cluster yet: applying there (or
    pruning against what it plans) could undo a rollout, so nothing is planned there that pass."""
    s = spec()
    slots = settled_slots(s, {Role.PD_PREFILL: 3, Role.PD_DECODE: 5})
    slots[Role.PRFAAS_PREFILL] = None
    pass_input = PassInput(s, OWNER, 1, PrfaasDeploymentStatus(), Instant(1.0, WALL_NOW))
    engines = plan_pd_engines(pass_input, {}, slots, OPTIONS)
    prefill, pd = everything_ready(s)
    plan = plan_router_and_prefill_cluster(
        pass_input, engines, PrefillClusterSeen(prefill, True, None), pd, None, None, OPTIONS
    )
    assert plan.prefill_cluster_manifests is None and plan.prefill_cluster_retire == ()
    assert plan.router_config.config is not None and listed(plan.router_config.config, Pool.PRFAAS_PREFILL)


# ---- the planner's allocation ------------------------------------------------------------------


def test_the_planners_allocation_in_auto_is_what_gets_applied() -> None:
    s = spec(**{"planner.mode": "Auto", "planner.prometheusUrl": "http://prometheus:9090"})
    planned = Allocation(
        threshold_tokens=19456,
        prefill_cluster_replicas=4,
        pd_prefill_instances=2,
        pd_decode_instances=6,
        source="Planner",
        router_config_version=3,
    )
    done = run_pass(s, Memory({}), 100.0, previous=PrfaasDeploymentStatus(allocation=planned))
    assert done.engines.choice.allocation.source == "Planner"
    assert statefulset(done.engines.manifests, NAMES.pd_decode)["spec"]["replicas"] == 6
    assert done.plan.router_config.config is not None and done.plan.router_config.config.version == 4


def test_a_deletion_retries_an_unreachable_prfaas_cluster_for_a_bounded_time() -> None:
    delays = [remote_backoff.cleanup_retry_delay(10.0, retry, 2.0, 30.0, 300.0) for retry in range(6)]
    assert delays == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert remote_backoff.cleanup_retry_delay(300.0, 1, 2.0, 30.0, 300.0) is None, "then it gives up"


# ---- multi-node pools (LeaderWorkerSets) ---------------------------------------------------------

MULTI_NODE = {"prefillCluster.gpusPerInstance": 16, "prefillCluster.nodesPerInstance": 2}


def leader_worker_set(manifests: Sequence[Mapping[str, Any]] | None, name: str) -> Mapping[str, Any]:
    assert manifests is not None, "nothing planned for that cluster"
    (found,) = [m for m in manifests if m["kind"] == "LeaderWorkerSet" and m["metadata"]["name"] == name]
    return found


def test_scaling_a_multi_node_pool_down_holds_its_groups_while_their_leaders_drain() -> None:
    s = spec(**{**MULTI_NODE, "prefillCluster.replicas": 2})
    done = run_pass(s, Memory({}), 100.0, running=spec(**MULTI_NODE))
    assert (
        leader_worker_set(done.plan.prefill_cluster_manifests, NAMES.prfaas_prefill)["spec"]["replicas"] == 4
    )
    assert listed(done.plan.router_config.config, Pool.PRFAAS_PREFILL) == [
        f"{NAMES.prfaas_prefill}-{n}" for n in range(2)
    ]


def test_a_new_shape_rolls_a_pool_from_its_statefulset_to_a_leader_worker_set_beside_it() -> None:
    """nodesPerInstance 1 -> 2 is a new pod template: the groups come up in the second slot while
    the old StatefulSet serves at full size, kept as it runs; once drained it is retired as such."""
    first = run_pass(spec(**MULTI_NODE), Memory({}), 100.0, running=spec())
    manifests = first.plan.prefill_cluster_manifests
    new = leader_worker_set(manifests, f"{NAMES.prfaas_prefill}-b")
    assert new["spec"]["replicas"] == 1 and new["spec"]["leaderWorkerTemplate"]["size"] == 2
    old = statefulset(manifests, NAMES.prfaas_prefill)
    assert old["spec"]["replicas"] == 4, "the old revision keeps serving at full size"
    assert old["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == 8
    old_slot = Slot(NAMES.prfaas_prefill, "old", 0, 0, live={"kind": "StatefulSet", "metadata": {}})
    plan = RolePlan(Role.PRFAAS_PREFILL, f"{NAMES.prfaas_prefill}-b", 4, old=old_slot, retire=True)
    decision = RolloutDecision(roles={Role.PRFAAS_PREFILL: plan}, status=None)
    assert retired(decision, [Role.PRFAAS_PREFILL], "ns") == [("StatefulSet", "ns", NAMES.prfaas_prefill)]


# ---- rollout analysis: a failed revision rolled back through the drain ------------------------


def test_a_failed_revision_leaves_the_router_config_before_its_statefulsets_shrink_to_0() -> None:
    """The pass after the analysis failed the new revision: each role's new slot is held at its
    replicas while the router config lists none of its pods (the drain), and the old slot is
    scaled back to its target; the spec is left as it is."""
    analysed = {"planner.mode": "Advisory", "planner.prometheusUrl": "http://127.0.0.1:9090"}
    old_spec, new_spec = spec(**analysed), spec(**analysed, **{"model.image": "lmsysorg/sglang:v0.5.24"})
    old_fp, new_fp = kv_fingerprint(old_spec.model), kv_fingerprint(new_spec.model)
    allocation = effective_allocation(new_spec, None).allocation
    old_roles = {e.role: e for e in engine_roles(old_spec, OWNER, allocation)}
    slots: dict[str, Sequence[Slot] | None] = {}
    remote, local = [], []
    for engine in engine_roles(new_spec, OWNER, allocation):
        old_live = engine_workload(old_spec.model, old_roles[engine.role], OWNER, old_fp)
        new_live = engine_workload(new_spec.model, engine, OWNER, new_fp)
        n = engine.replicas
        slots[engine.role] = [
            Slot(engine.name, revision_of(old_live), n - 1, n - 1, live=old_live, fingerprint=old_fp),
            Slot(f"{engine.name}-b", revision_of(new_live), 1, 1, live=new_live, fingerprint=new_fp),
        ]
        base = {Role.PRFAAS_PREFILL: 1, Role.PD_PREFILL: 2, Role.PD_DECODE: 3}[engine.role]
        found = [
            *pods(engine.name, engine.role, n - 1, old_fp),
            PodInfo(f"{engine.name}-b-0", engine.role, new_fp, f"10.{base}.1.1", True),
        ]
        (remote if engine.role == Role.PRFAAS_PREFILL else local).extend(found)
    memory = Memory({})
    wall = datetime(2026, 1, 1, tzinfo=UTC)
    first = plan_pd_engines(
        PassInput(new_spec, OWNER, 1, PrfaasDeploymentStatus(), Instant(100.0, wall)), {}, slots, OPTIONS
    )
    assert first.rollout.status is not None and first.rollout.status.phase == "Progressing"
    previous = PrfaasDeploymentStatus(rollout=first.rollout.status)
    later = wall + timedelta(seconds=40)
    broken = Observed(later, 40, {new_fp: Figures(40, 20, 4, 20), old_fp: Figures(80, 0, 16, 80)})
    pass_input = PassInput(new_spec, OWNER, 1, previous, Instant(140.0, later), broken)
    engines = plan_pd_engines(pass_input, memory.drains, slots, OPTIONS)
    assert engines.rollout.status is not None and engines.rollout.status.phase == "Failed"
    assert engines.rollout.warning is not None and engines.rollout.warning[0] == "AnalysisFailed"
    for workload, target in ((NAMES.pd_prefill, 3), (NAMES.pd_decode, 5)):
        assert statefulset(engines.manifests, f"{workload}-b")["spec"]["replicas"] == 1, "held while draining"
        assert statefulset(engines.manifests, workload)["spec"]["replicas"] == target
        assert engines.drains[
            {NAMES.pd_prefill: Role.PD_PREFILL, NAMES.pd_decode: Role.PD_DECODE}[workload]
        ] == Drain(f"{workload}-b", 0, 1)
    remote_seen = PrefillClusterSeen(seen(remote), True, slots[Role.PRFAAS_PREFILL])
    plan = plan_router_and_prefill_cluster(pass_input, engines, remote_seen, seen(local), None, None, OPTIONS)
    assert plan.drains[Role.PRFAAS_PREFILL] == Drain(f"{NAMES.prfaas_prefill}-b", 0, 1)
    assert statefulset(plan.prefill_cluster_manifests, NAMES.prfaas_prefill)["spec"]["replicas"] == 4
    config = plan.router_config.config
    assert config is not None
    assert {e.fingerprint for pool in Pool for e in config.pools.of(pool)} == {old_fp}
    conclusion = conclude_pass(
        pass_input, engines, plan, (seen(remote), seen(local)), Applies(), None, OPTIONS
    )
    status, reason, message = condition(conclusion.status, "RolloutProgressing")
    assert (status, reason) == ("False", "AnalysisFailed")
    assert "error ratio 50.0% (20/40) vs 0.0% (0/80)" in message and new_fp in message
    assert not conclusion.status.pd_decode.rolling, "a rolled-back rollout does not hold the planner"


def test_a_local_role_whose_statefulsets_could_not_be_read_is_left_alone_mid_rollout() -> None:
    """The PD apiserver coming back mid-rollout: a pass that could not read pd-prefill's slots
    must not write the new template into its first slot, the old revision's (on the testbed the
    old slot was rolled in place and the new one retired as 'old'); the others hold."""
    old_spec, new_spec = spec(), spec(**{"model.image": "lmsysorg/sglang:v0.5.24"})
    first = run_pass(new_spec, Memory({}), 100.0, running=old_spec)
    assert statefulset(first.engines.manifests, f"{NAMES.pd_prefill}-b")["spec"]["replicas"] == 1
    slots = settled_slots(old_spec, {Role.PD_PREFILL: 3, Role.PD_DECODE: 5, Role.PRFAAS_PREFILL: 4})
    slots[Role.PD_PREFILL] = None
    unread = run_pass(
        new_spec, Memory({}), 105.0, running=old_spec, slots=slots, previous=first.conclusion.status
    )
    names = {m["metadata"]["name"] for m in unread.engines.manifests if m["kind"] == "StatefulSet"}
    assert not names & {NAMES.pd_prefill, f"{NAMES.pd_prefill}-b"}, names
    decode = statefulset(unread.engines.manifests, NAMES.pd_decode)
    assert decode["spec"]["replicas"] == 5
    assert decode["spec"]["template"]["spec"]["containers"][0]["image"] == "lmsysorg/sglang:v0.5.23"
    assert unread.engines.retire == []
