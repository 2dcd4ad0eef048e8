"""The decisions of one reconcile pass, as pure functions (no client, no awaits; time passed in).

The executor (reconcile.Reconciler) reads the caches and the API, calls these steps and applies
what they say. A pass has three steps, because two reads sit between them and the status
depends on what the applies did:

1. ``plan_pd_engines``: from the spec, the last status and the live replica counts of the
   local workloads, the allocation in force, the KV fingerprint, the local drains and the
   PD cluster's engine and router children. The executor starts applying these at once, so a
   slow PrfaaS cluster never holds up the local side.
2. ``plan_router_and_prefill_cluster``: once the PrfaaS cluster was looked at (or found
   failing) and, after a restart, the router ConfigMap was read, the PrfaaS drain, the router
   config (written, kept while a cache is still listing, or recovered from the ConfigMap so
   its version never goes backwards), the router's children and the PrfaaS cluster's children.
3. ``conclude_pass``: once the applies are done, which drains advance or end, the status to
   write and how soon to come back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from prfaas_core.profiles import ProfileError
from prfaas_core.router_config import RouterConfig
from prfaas_core.vocabulary import LABEL_ROLE, Pool, Role
from pydantic import ValidationError

from prfaas_operator import RECONCILE_LOGGER
from prfaas_operator.api import (
    Condition,
    ConditionType,
    PrfaasDeploymentSpec,
    PrfaasDeploymentStatus,
    first_problem,
)
from prfaas_operator.planning import drain, rollout
from prfaas_operator.planning.allocation import AllocationChoice, effective_allocation
from prfaas_operator.planning.analysis import Observed, not_judged
from prfaas_operator.planning.cache_pool import (
    leftover_pool_objects,
    pool_manifests,
    pool_observations,
    router_cache_pools,
)
from prfaas_operator.planning.data_path import NOT_LOOKED_AT, DataPath
from prfaas_operator.planning.drain import Drain
from prfaas_operator.planning.fingerprint import kv_fingerprint
from prfaas_operator.planning.gateway import gateway_enabled, gateway_manifests, gateway_problem
from prfaas_operator.planning.manifests import (
    ROUTER_CONFIG_KEY,
    DesiredRevision,
    Names,
    Owner,
    desired_revisions,
    disruption_budget,
    rolled_engine_objects,
    router_access,
    router_configmap,
    router_deployment,
    router_service,
)
from prfaas_operator.planning.pool_claim import ClaimSeen, binding, cache_salt, claim_pools
from prfaas_operator.planning.rollout import RolePlan, RoleSeen, RolloutDecision, Slot
from prfaas_operator.planning.router_config_builder import (
    build_router_config,
    choose_pools,
    endpoint_counts,
    keep_unobserved,
)
from prfaas_operator.planning.status import (
    INVALID_PROFILE,
    INVALID_SPEC,
    ClaimBinding,
    ClusterObservation,
    GatewaySeen,
    PodInfo,
    Problem,
    RouterConfigOutcome,
    StatusInputs,
    compute_status,
    rfc3339,
)
from prfaas_operator.planning.workloads import ENGINE_WORKLOAD_KINDS

log = logging.getLogger(RECONCILE_LOGGER)

Manifest = dict[str, Any]


@dataclass(frozen=True)
class ReconcileOptions:
    """Timing of the reconcile loop (seconds)."""

    resync_seconds: float = 10.0
    """Period of passes once Ready (child events bring a pass forward at once)."""
    converge_seconds: float = 1.0
    """First period after a change while not Ready; it grows 1.25x per pass up to resync_seconds."""
    remote_backoff_seconds: float = 2.0
    """First retry delay after the PrfaaS cluster failed; doubles per failure."""
    remote_backoff_max_seconds: float = 30.0
    """Longest retry delay for a failing PrfaaS cluster."""
    remote_cleanup_timeout_seconds: float = 300.0
    """How long a deletion retries an unreachable PrfaaS cluster before releasing the CR."""
    drain_seconds: float = 30.0
    """How long an engine being scaled away stays out of the router config before its pod goes."""
    watch_namespaces: tuple[str, ...] = ()
    """The namespaces the operator watches (empty: all); the PD cluster's caches watch only these."""


@dataclass(frozen=True)
class Instant:
    """The moment a pass decides at, read once: monotonic seconds for the drain clocks, wall time
    for readiness, rollouts and status (formatted only when written into it)."""

    monotonic: float
    wall: datetime


@dataclass(frozen=True)
class PassInput:
    """What one pass decides from: the CR as it was read, and the moment."""

    spec: PrfaasDeploymentSpec
    owner: Owner
    generation: int | None
    previous: PrfaasDeploymentStatus
    now: Instant
    observed: Observed | None = None
    """The latest figures of the engines' revisions from Prometheus (rollout analysis; None: none taken)."""
    data_path: DataPath = NOT_LOOKED_AT
    """The latest verdict on KV reaching the decodes from the PrfaaS pool (the planner loop's)."""
    inference_pool_served: bool | None = None
    """Whether the PD cluster serves InferencePool (None: its cache has not said yet)."""


# ---- step 1: the allocation, the local drains and the PD cluster's children ----------------------


@dataclass(frozen=True)
class EnginePlan:
    """What the PD cluster gets before the PrfaaS cluster is even looked at."""

    choice: AllocationChoice
    fingerprint: str
    revisions: Mapping[str, DesiredRevision]
    """Each engine role's pod template and its revision, built once a pass: the rollout decides on
    them and the engine workloads of both steps carry them."""
    drains: Mapping[str, Drain]  # engine role -> its scale-down in progress
    manifests: Sequence[Manifest]  # local engines (held while draining), router Service, PDB, access
    rollout: RolloutDecision
    retire: Sequence[tuple[str, str, str]] = ()  # (kind, namespace, name): old slots at 0, to delete
    notes: Sequence[str] = ()  # worth a log line
    prune: Sequence[tuple[str, str, str]] = ()  # (kind, namespace, name): a removed cachePool's objects


def plan_pd_engines(
    pass_input: PassInput,
    drains: Mapping[str, Drain],
    slots: Mapping[str, Sequence[Slot] | None],
    options: ReconcileOptions,
    pool_objects_found: Sequence[tuple[str, str, str]] = (),
    gateway_objects_found: Sequence[tuple[str, str, str]] = (),
) -> EnginePlan:
    """Step 1. `slots`: each engine role's live StatefulSets (None: its cluster not looked at);
    `pool_objects_found`, `gateway_objects_found`: the PD cluster's cache-pool and gateway objects
    of this CR (kind, namespace, name); those no longer wanted are pruned (the gateway's are
    applied in step 2, with the router's Deployment: its picker carries the config's checksum).

    The rollout is decided here for the roles of both clusters (it steps them together); the
    PrfaaS cluster's share is applied in step 2. The PD cluster's cache pool goes with the local
    engines (it never waits for them, nor they for it); a removed one is pruned.
    """
    spec, owner, previous, now = pass_input.spec, pass_input.owner, pass_input.previous, pass_input.now
    choice = effective_allocation(spec, previous.allocation)
    fingerprint = kv_fingerprint(spec.model)
    revisions = desired_revisions(spec, owner, choice.allocation, fingerprint)
    if spec.pool_claim is not None:  # the shared pool's controller runs its prefills, not this CR
        revisions = {role: desired for role, desired in revisions.items() if role != Role.PRFAAS_PREFILL}
    rolled = decide_rollout(spec, revisions, previous, slots, now.wall, fingerprint, pass_input.observed)
    drains, notes = dict(drains), []
    local_roles = (Role.PD_PREFILL, Role.PD_DECODE)
    for role in local_roles:
        notes += drain_role(
            drains, owner, rolled.roles[role], slots.get(role), now.monotonic, options.drain_seconds
        )
    # a role whose StatefulSets could not be read has no slot to place its revision against: the
    # first slot may be the old revision's, and writing the new template there would roll its pods
    # in place (the apply can work while the read failed: an apiserver coming back, a 429 on one kind)
    local_engines = [
        manifest
        for role in local_roles
        if slots.get(role) is not None
        for manifest in rolled_engine_objects(spec, revisions[role], owner, rolled.roles[role])
    ]
    manifests = [
        *held(local_engines, drains),
        router_service(spec, owner),
        disruption_budget(
            spec, owner, Names.of(owner.name).router, owner.namespace, Role.ROUTER, remote=False
        ),
        *router_access(owner),
    ]
    pool = pool_manifests(spec, owner, remote=False)
    manifests += pool
    gateway = gateway_manifests(
        spec, owner, None, inference_pool_served=pass_input.inference_pool_served is True
    )
    prune = leftover_pool_objects(pool_objects_found, pool) + stale_children(gateway_objects_found, gateway)
    retire = retired(rolled, local_roles, owner.namespace)
    if rolled.event is not None:
        notes.append(f"{owner.key}: {rolled.event[0]}: {rolled.event[1]}")
    return EnginePlan(choice, fingerprint, revisions, drains, manifests, rolled, retire, notes, prune)


def decide_rollout(
    spec: PrfaasDeploymentSpec,
    revisions: Mapping[str, DesiredRevision],
    previous: PrfaasDeploymentStatus,
    slots: Mapping[str, Sequence[Slot] | None],
    wall_now: datetime,
    fingerprint: str,
    observed: Observed | None = None,
) -> RolloutDecision:
    """Each engine role's desired revision against its live slots: rollout.decide for all three,
    judged by `observed` where the spec lets the analysis judge."""
    seen = [
        RoleSeen(
            role=role,
            workload=desired.engine.name,
            target=desired.engine.replicas,
            revision=desired.revision,
            slots=tuple(slots.get(role) or ()),
            known=slots.get(role) is not None,
            fingerprint=fingerprint,
        )
        for role, desired in revisions.items()
    ]
    return rollout.decide(
        seen, spec.rollout, previous.rollout, wall_now, unjudged=not_judged(spec), observed=observed
    )


def drain_role(
    drains: dict[str, Drain],
    owner: Owner,
    plan: RolePlan,
    slots: Sequence[Slot] | None,
    now: float,
    drain_seconds: float,
) -> list[str]:
    """The drain of one role: of its old slot while it rolls, of its new slot while a rollback
    or a target lowered mid-rollout takes it down, else of its one StatefulSet. rollout.decide
    shrinks at most one slot of a role a pass, so one drain per role covers both."""
    live = next((slot.replicas for slot in slots or () if slot.name == plan.slot), None)
    if plan.old is not None and (
        live is None or plan.replicas >= live or plan.old_replicas < plan.old.replicas
    ):
        return step_drain(
            drains, owner, plan.role, plan.old.name, plan.old_replicas, plan.old.replicas, now, drain_seconds
        )
    return step_drain(drains, owner, plan.role, plan.slot, plan.replicas, live, now, drain_seconds)


def retired(rolled: RolloutDecision, roles: Sequence[str], namespace: str) -> list[tuple[str, str, str]]:
    """The old slots of `roles` that are down to 0 replicas: their workloads go."""
    return [
        (str(plan.old.live.get("kind") or "StatefulSet"), namespace, plan.old.name)
        for role in roles
        if (plan := rolled.roles[role]).retire and plan.old is not None
    ]


def step_drain(
    drains: dict[str, Drain],
    owner: Owner,
    role: str,
    workload: str,
    desired: int,
    live: int | None,
    now: float,
    drain_seconds: float,
) -> list[str]:
    """Start, keep, release or end the drain of one workload in `drains`; the log lines it is worth."""
    before = drains.get(role)
    planned = drain.plan(before, workload, desired, live)
    notes = []
    if planned is not None and drain.release_due(planned, now, drain_seconds):
        planned = dataclasses.replace(planned, released=True)
        notes.append(f"{owner.key}: drained {role}; scaling {planned.held} -> {planned.target}")
    if planned is None:
        drains.pop(role, None)
    else:
        if before is None or before.target != planned.target:
            notes.append(f"{owner.key}: draining {drain.describe(planned)}")
        drains[role] = planned
    return notes


def held(manifests: Sequence[Manifest], drains: Mapping[str, Drain]) -> list[Manifest]:
    """The manifests with each draining workload kept at its current replicas."""
    result = []
    for manifest in manifests:
        role = (manifest["metadata"].get("labels") or {}).get(LABEL_ROLE)
        planned = drains.get(role or "")
        if (
            manifest["kind"] in ENGINE_WORKLOAD_KINDS
            and planned is not None
            and planned.workload == manifest["metadata"]["name"]
        ):
            replicas = drain.replicas_to_apply(planned, manifest["spec"]["replicas"])
            manifest = {**manifest, "spec": {**manifest["spec"], "replicas": replicas}}
        result.append(manifest)
    return result


# ---- step 2: the PrfaaS drain, the router config and the remaining children ----------------------


@dataclass(frozen=True)
class PrefillClusterSeen:
    """What the executor found of the PrfaaS cluster: an observation, and its StatefulSets.

    `reachable` False: its client or its watches failed (or it is backing off); nothing was
    looked at and nothing will be applied there this pass. `slots` None: its StatefulSets were
    not known when step 1 decided the rollout, so none is applied there this pass.
    """

    observation: ClusterObservation
    reachable: bool
    slots: Sequence[Slot] | None = None
    claim: ClaimSeen | None = None
    """spec.poolClaim's claim as read back this pass (None: no poolClaim)."""


@dataclass(frozen=True)
class StoredRouterConfig:
    """The router ConfigMap as read after a restart: its config (None: absent or unreadable) or why not."""

    config: RouterConfig | None = None
    problem: Problem | None = None


def needs_stored_router_config(last: RouterConfig | None, previous: PrfaasDeploymentStatus) -> bool:
    """Restarted with a config recorded in status but none in memory: read the ConfigMap first."""
    return last is None and previous.allocation is not None


@dataclass(frozen=True)
class RouterConfigDecision:
    """The router config this pass serves, and why: built from the endpoints, kept, or not known."""

    action: Literal["build", "keep", "unknown"]
    """build: from the ready endpoints (the ConfigMap is written when its version is new); keep: the
    last one stays (a cache still listing, or a refused profile fit); unknown: its ConfigMap could
    not be read after a restart."""
    config: RouterConfig | None
    outcome: RouterConfigOutcome
    problem: Problem | None = None  # unknown: why the ConfigMap could not be read


def decide_router_config(
    spec: PrfaasDeploymentSpec,
    owner: Owner,
    previous: PrfaasDeploymentStatus,
    engines: EnginePlan,
    drains: Mapping[str, Drain],
    prefill_seen: ClusterObservation,
    pd_seen: ClusterObservation,
    last_config: RouterConfig | None,
    stored: StoredRouterConfig | None,
    now: datetime,
    claim: ClaimSeen | None = None,
) -> RouterConfigDecision:
    """`last_config`: the config this process last wrote; `stored`: the ConfigMap's, when read.

    Endpoints of a PrfaaS cluster that could not be observed are kept from the last config for a
    bounded time (keep_unobserved), then left out, so traffic stays local. While a
    cache is still listing (just after a restart) the last config is kept: one built from it
    would drop endpoints that are working. A refused profile fit keeps the last good config.
    The version never falls below the one recorded in status. With spec.poolClaim, the PrfaaS
    endpoints and the share are the claim's (pool_claim.claim_pools), and its cache salt is set.
    """
    min_version = previous.allocation.router_config_version if previous.allocation is not None else 0
    last = last_config
    if stored is not None:  # restarted: continue the router's versions
        if stored.problem is not None:
            return RouterConfigDecision("unknown", None, RouterConfigOutcome(0, {}), stored.problem)
        last = stored.config
    if prefill_seen.listing or pd_seen.listing:
        return RouterConfigDecision("keep", last, kept(last, min_version))
    keep_seconds = spec.prefill_cluster.keep_unobserved_endpoints_seconds
    remote_pods = leaving(prefill_seen.pods, drains) if prefill_seen.observed else None
    salt, share = None, None
    if spec.pool_claim is not None and claim is not None:
        remote_pods, salt = [], cache_salt(spec.pool_claim, owner)
        choice = choose_pools(spec, engines.fingerprint, [], leaving(pd_seen.pods, drains))
        choice, share = claim_pools(choice, claim, last, now.timestamp(), keep_seconds)
    else:
        choice = choose_pools(spec, engines.fingerprint, remote_pods, leaving(pd_seen.pods, drains))
        if remote_pods is None:
            choice = keep_unobserved(choice, last, now.timestamp(), keep_seconds)
    cache_pools = router_cache_pools(spec, owner, remote_pods, pd_seen.pods)
    try:
        config = build_router_config(
            spec,
            engines.choice.allocation,
            choice,
            last,
            min_version=min_version,
            measured_output_tokens=planner_input(previous, "meanOutputTokens"),
            measured_output_cv=planner_input(previous, "outputTokensCv"),
            cache_pools=cache_pools,
            cache_salt=salt,
            pool_share=share,
        )
    except ProfileError as err:
        keeps = f"the router keeps config v{last.version}" if last is not None else "no router config yet"
        problem = Problem(INVALID_PROFILE, f"prefill profile refused ({err}); {keeps}")
        return RouterConfigDecision("keep", last, kept(last, min_version, problem))
    outcome = RouterConfigOutcome(config.version, endpoint_counts(config), note=choice.note)
    return RouterConfigDecision("build", config, outcome)


@dataclass(frozen=True)
class PassPlan:
    """Step 2's decisions: what to apply in both clusters and the router config they carry."""

    drains: Mapping[str, Drain]
    router_config: RouterConfigDecision
    router_manifests: Sequence[Manifest]  # the router Deployment, and its ConfigMap when a config exists
    prefill_cluster_manifests: Sequence[Manifest] | None
    """Held while draining; applied only when reachable. None: the rollout decision could not see
    the PrfaaS cluster's StatefulSets (a new cache, just after a restart): nothing is applied or
    pruned there this pass."""
    prefill_cluster_retire: Sequence[tuple[str, str, str]] = ()  # (kind, namespace, name) to delete there
    notes: Sequence[str] = ()
    pool_claim: ClaimBinding | None = None  # spec.poolClaim's claim, for the status


def plan_router_and_prefill_cluster(
    pass_input: PassInput,
    engines: EnginePlan,
    prefill_seen: PrefillClusterSeen,
    pd_seen: ClusterObservation,
    last_config: RouterConfig | None,
    stored: StoredRouterConfig | None,
    options: ReconcileOptions,
) -> PassPlan:
    """Step 2: the PrfaaS drain (when that cluster could be looked at), then the router config."""
    spec, owner, previous = pass_input.spec, pass_input.owner, pass_input.previous
    drains, notes = dict(engines.drains), []
    plan = engines.rollout.roles.get(Role.PRFAAS_PREFILL)
    if prefill_seen.reachable and prefill_seen.slots is not None and plan is not None:
        notes += drain_role(
            drains, owner, plan, prefill_seen.slots, pass_input.now.monotonic, options.drain_seconds
        )
    decision = decide_router_config(
        spec,
        owner,
        previous,
        engines,
        drains,
        prefill_seen.observation,
        pd_seen,
        last_config,
        stored,
        pass_input.now.wall,
        prefill_seen.claim,
    )
    claimed = binding(prefill_seen.claim) if prefill_seen.claim is not None else None
    config = decision.config
    router = [router_deployment(spec, owner, config.to_json() if config else None)]
    router += [router_configmap(owner, config)] if config is not None else []
    router += gateway_manifests(
        spec,
        owner,
        config.to_json() if config else None,
        inference_pool_served=pass_input.inference_pool_served is True,
    )
    if prefill_seen.slots is None or plan is None:  # not seen, or a shared pool's: nothing there
        return PassPlan(drains, decision, router, None, (), notes, claimed)
    remote = held(rolled_engine_objects(spec, engines.revisions[Role.PRFAAS_PREFILL], owner, plan), drains)
    remote += pool_manifests(spec, owner, remote=True)  # pruned with the rest when its cachePool goes
    retire = retired(engines.rollout, (Role.PRFAAS_PREFILL,), spec.prefill_cluster.namespace)
    return PassPlan(drains, decision, router, remote, retire, notes, claimed)


def leaving(pods: Sequence[PodInfo], drains: Mapping[str, Drain]) -> list[PodInfo]:
    """The pods, with those on their way out marked as deleting (no router config lists them)."""
    return [
        dataclasses.replace(pod, deleting=True)
        if drain.draining(drains.get(pod.role or ""), pod.name)
        else pod
        for pod in pods
    ]


def planner_input(status: PrfaasDeploymentStatus, key: str) -> float | None:
    """A number the planner last observed (status.planner.inputs: the mean output length, its
    coefficient of variation), if any."""
    text = (status.planner.inputs.get(key) if status.planner is not None else None) or ""
    try:
        return float(text)
    except ValueError:
        return None


def kept(last: RouterConfig | None, min_version: int, problem: Problem | None = None) -> RouterConfigOutcome:
    """The outcome when the router keeps the config it has (or still has none)."""
    if last is None:
        return RouterConfigOutcome(min_version, {}, problem)
    return RouterConfigOutcome(last.version, endpoint_counts(last), problem)


def parse_router_config(configmap: Mapping[str, Any] | None) -> RouterConfig | None:
    """The config in the ConfigMap, or None when absent or unreadable (it is then rewritten)."""
    text = ((configmap or {}).get("data") or {}).get(ROUTER_CONFIG_KEY)
    if text is None:
        return None
    try:
        return RouterConfig.from_json(text)
    except ValidationError:
        log.warning("the router config in the ConfigMap is unreadable; it will be rewritten")
        return None


# ---- step 3: after the applies: drains, status, when to come back -----------------------------


@dataclass(frozen=True)
class Applies:
    """What became of the applies of step 1 and 2 (None: done, or not tried)."""

    engines_problem: Problem | None = None
    router_problem: Problem | None = None
    prefill_cluster_seen: ClusterObservation | None = None  # replaces the observation when its apply failed
    prefill_cluster_problems: Sequence[Problem] = ()  # e.g. PruneFailed
    finished_at: float | None = None
    """Monotonic seconds when the applies ended (None: the pass's instant): a drain's clock starts
    once the config without its instances was written, not when the pass began."""


@dataclass(frozen=True)
class Conclusion:
    """Step 3's decisions: the drains to remember, the status, and the earliest reason to come back."""

    drains: Mapping[str, Drain]
    router_config: RouterConfig | None  # the config in force now (what memory keeps)
    router_config_written: bool  # a new version reached the ConfigMap (worth a log line and a metric)
    status: PrfaasDeploymentStatus
    come_back_within: float | None  # a drain clock or a cache still listing; the status adds its own
    notes: Sequence[str] = ()


def conclude_pass(
    pass_input: PassInput,
    engines: EnginePlan,
    plan: PassPlan,
    seen: tuple[ClusterObservation, ClusterObservation],
    applies: Applies,
    last_config: RouterConfig | None,
    options: ReconcileOptions,
) -> Conclusion:
    """Step 3. `seen`: the PrfaaS and the PD cluster's observations; `last_config`: the config
    memory held before this pass."""
    spec, owner, previous, wall_now = (
        pass_input.spec,
        pass_input.owner,
        pass_input.previous,
        pass_input.now.wall,
    )
    prefill_seen, pd_seen = seen
    now = applies.finished_at if applies.finished_at is not None else pass_input.now.monotonic
    written = plan.router_config.config if applies.router_problem is None else None
    new_version = written is not None and (last_config is None or last_config.version != written.version)
    notes = [f"{owner.key}: router config v{written.version}"] if new_version and written is not None else []
    if written is not None:
        last_config = written
    drains, drain_delay, drain_notes = follow_drains(
        owner, plan.drains, written, prefill_seen, pd_seen, now, options
    )
    notes += drain_notes
    if applies.prefill_cluster_seen is not None:
        prefill_seen = applies.prefill_cluster_seen
    router_outcome: RouterConfigOutcome | None = plan.router_config.outcome
    local_problem = applies.engines_problem or applies.router_problem or plan.router_config.problem
    if local_problem is not None:
        pd_seen, router_outcome = ClusterObservation(local_problem), None
    listing = prefill_seen.listing or pd_seen.listing  # the router config waits for their first lists
    allocation = engines.choice.allocation  # carries the last recorded config version when none was decided
    if router_outcome is not None:
        allocation = allocation.model_copy(update={"router_config_version": router_outcome.version})
    status = compute_status(
        StatusInputs(
            generation=pass_input.generation,
            allocation=allocation,
            fingerprint=engines.fingerprint,
            router_replicas=spec.router.replicas,
            prefill_namespace=spec.prefill_cluster.namespace,
            prefill_cluster_is_remote=spec.prefill_cluster.is_remote,
            prefill_cluster=prefill_seen,
            pd_cluster=pd_seen,
            router_config=router_outcome,
            previous=previous,
            now=rfc3339(wall_now),
            extra_problems=applies.prefill_cluster_problems,
            rollout=engines.rollout.status,
            cache_pools=pool_observations(spec, owner, prefill_seen, pd_seen),
            data_path=pass_input.data_path,
            gateway=gateway_seen(pass_input),
            pool_claim=plan.pool_claim,
        )
    )
    settling = engines.rollout.come_back_at  # a new instance about to count for the rollout's step
    settle_delay = max(1.0, (settling - wall_now).total_seconds()) if settling is not None else None
    soon = [
        delay
        for delay in (drain_delay, options.converge_seconds if listing else None, settle_delay)
        if delay is not None
    ]
    return Conclusion(drains, last_config, new_version, status, min(soon, default=None), notes)


def gateway_seen(pass_input: PassInput) -> GatewaySeen | None:
    """The gateway side for the status, while the spec asks for it."""
    spec = pass_input.spec
    if not gateway_enabled(spec):
        return None
    names = Names.of(pass_input.owner.name)
    return GatewaySeen(
        inference_pool=names.inference_pool,
        picker=names.picker,
        grpc_port=spec.gateway.picker.grpc_port,
        replicas=spec.gateway.picker.replicas,
        inference_pool_served=pass_input.inference_pool_served,
        problem=gateway_problem(spec, pass_input.inference_pool_served),
    )


def follow_drains(
    owner: Owner,
    drains: Mapping[str, Drain],
    config: RouterConfig | None,
    prefill_seen: ClusterObservation,
    pd_seen: ClusterObservation,
    now: float,
    options: ReconcileOptions,
) -> tuple[dict[str, Drain], float | None, list[str]]:
    """After the applies: start the drain clocks the written config allows, end finished drains.

    Returns the drains still in progress, the seconds until one is due, and the log lines.
    """
    listed = (
        [endpoint.name for pool in Pool for endpoint in config.pools.of(pool)] if config is not None else None
    )
    wake: float | None = None
    following: dict[str, Drain] = {}
    notes = []
    for role, planned in drains.items():
        seen = prefill_seen if role == Role.PRFAAS_PREFILL else pd_seen
        pods = [pod.name for pod in seen.pods if pod.role == role]
        live = seen.ready.get(role)  # only a hint; finished() also needs the pods gone
        if listed is not None:
            planned = drain.after_config_written(planned, listed, now)
        if seen.observed and planned.released and drain.finished(planned, planned.target, pods):
            notes.append(f"{owner.key}: {role} is at {planned.target} replicas (ready {live})")
            continue
        following[role] = planned
        left = drain.seconds_left(planned, now, options.drain_seconds)
        if left is not None:
            wake = left if wake is None else min(wake, left)
    return following, wake, notes


@dataclass(frozen=True)
class Pace:
    """How soon the next pass comes, and the converging period after it."""

    delay: float
    converge_delay: float
    result: str  # ready, progressing, degraded


def pace(status: PrfaasDeploymentStatus, converge_delay: float, options: ReconcileOptions) -> Pace:
    """Every resync period once Ready; while not, a period that starts short and grows 1.25x per pass."""
    ready = condition_true(status.conditions, ConditionType.READY)
    degraded = condition_true(status.conditions, ConditionType.DEGRADED)
    result = "ready" if ready else "degraded" if degraded else "progressing"
    if ready:
        return Pace(options.resync_seconds, options.converge_seconds, result)
    return Pace(converge_delay, min(options.resync_seconds, converge_delay * 1.25), result)


def condition_true(conditions: Sequence[Condition], kind: ConditionType) -> bool:
    return any(c.type == kind.value and c.status == "True" for c in conditions)


# ---- an invalid spec ---------------------------------------------------------------------------


def invalid_spec_status(
    previous: PrfaasDeploymentStatus, generation: int | None, err: ValidationError, wall_now: datetime
) -> tuple[PrfaasDeploymentStatus, Problem]:
    """The status that says why the spec cannot be reconciled (the rest of the last status stays)."""
    problem = Problem(INVALID_SPEC, f"{first_problem(err, 'spec')} ({err.error_count()} error(s))")
    conditions = [
        Condition(
            type=kind.value,
            status=value,
            reason=INVALID_SPEC,
            message=problem.message,
            last_transition_time=rfc3339(wall_now),
            observed_generation=generation,
        )
        for kind, value in ((ConditionType.READY, "False"), (ConditionType.DEGRADED, "True"))
    ]
    status = previous.model_copy(update={"observed_generation": generation, "conditions": conditions})
    return status, problem


# ---- pruning the PrfaaS cluster ------------------------------------------------------------------


def stale_children(
    found: Sequence[tuple[str, str, str]], wanted: Sequence[Manifest]
) -> list[tuple[str, str, str]]:
    """The (kind, namespace, name) of this CR's remote children that are no longer desired."""
    keep = {(o["kind"], o["metadata"]["namespace"], o["metadata"]["name"]) for o in wanted}
    return [child for child in found if child not in keep]
