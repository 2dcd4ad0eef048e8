"""Status of a PrfaasDeployment from what one reconcile observed in both clusters (pure).

The reconcile gathers observations (workload counts, pods, or the reason a cluster could not
be looked at); this module turns them into the status subresource: per-role desired/ready
counts and the conditions Ready, PrefillClusterReady, PDClusterReady, RouterReady and
Degraded, each with a reason and a message a human can act on. Time is passed in.

Two deliberate choices:
- A cluster that could not be observed keeps its last observed ready counts (unknown is not
  zero) and says so in its condition; the router config meanwhile keeps the PrfaaS endpoints
  last observed for a bounded time, for the router to check (router_config_builder.keep_unobserved).
- The operator cannot test that decode pods reach PrfaaS prefill pod IPs across clusters (it
  has no foothold in either pod network); the routers see every offloaded attempt's KV handoff.
  When the PrfaaS cluster is a different cluster and its instances are ready, PrefillClusterReady's
  reason is the data path's verdict from the routers' figures (data_path.judge:
  `DataPathVerified`, `DataPathFailing`, `DataPathUnverified`, `DataPathUnknown`) instead of
  `InstancesReady`, and it and Ready carry the verdict's message.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from prfaas_core.vocabulary import (
    GPU_RESOURCE,
    LABEL_FINGERPRINT,
    LABEL_REVISION,
    LABEL_ROLE,
    LWS_WORKER_INDEX_LABEL,
    Role,
)
from pydantic import ValidationError

from prfaas_operator.api import (
    Allocation,
    Condition,
    ConditionType,
    PrfaasDeploymentStatus,
    RoleCounts,
    RolloutStatus,
    human_bytes,
)
from prfaas_operator.planning.data_path import NOT_LOOKED_AT, DataPath

# Reasons (CamelCase, stable: alerts and tests match on them).
INSTANCES_READY = "InstancesReady"
PROGRESSING = "Progressing"
INSUFFICIENT_GPU = "InsufficientGPU"
UNSCHEDULABLE = "Unschedulable"
NO_ENDPOINTS = "NoEndpoints"
ROUTER_READY = "RouterReady"
ALL_READY = "AllReady"
AS_EXPECTED = "AsExpected"
INVALID_PROFILE = "InvalidProfile"
INVALID_SPEC = "InvalidSpec"
REVISION_AVAILABLE = "RevisionAvailable"
ROLLOUT_IN_PROGRESS = "RolloutInProgress"
ROLLOUT_PAUSED = "RolloutPaused"
WAITING_FOR_CLUSTER = "WaitingForCluster"
"""A rollout held because a cluster it steps cannot be observed (rollout.decide holds unknown slots)."""
PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
ANALYSIS_FAILED = "AnalysisFailed"
POOL_READY = "PoolReady"
MASTER_NOT_READY = "MasterNotReady"
STORES_NOT_READY = "StoresNotReady"
PICKER_READY = "PickerReady"
LEFT_BEHIND = "LeftBehindNotCleaned"
"""A PrfaaS placement the CR moved out of still holds its objects (cannot be cleaned yet)."""

log = logging.getLogger("prfaas_operator.planning.status")


@dataclass(frozen=True)
class Problem:
    """Why something could not be done or observed, as a condition reason and message."""

    reason: str
    message: str


@dataclass(frozen=True)
class PodInfo:
    """The few facts about one engine or router pod the status and the router config need."""

    name: str
    role: str | None
    fingerprint: str | None
    ip: str | None
    ready: bool
    deleting: bool = False
    unschedulable: str | None = None  # the scheduler's message when PodScheduled is False
    revision: str | None = None  # prfaas.io/revision: the pod template it runs
    waiting: str | None = None  # why a container is not running, as the kubelet says (e.g. ErrImagePull)
    ready_since: datetime | None = None  # the Ready condition's last transition, while ready
    group_worker: bool = False
    """A node rank >= 1 of a multi-node instance: its leader stands for the group (the router
    lists leaders only, and a worker's readiness is only that of SGLang's dummy health server)."""

    @classmethod
    def from_manifest(cls, pod: Mapping[str, Any]) -> PodInfo:
        metadata = pod.get("metadata") or {}
        labels = metadata.get("labels") or {}
        status = pod.get("status") or {}
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        ready = (conditions.get("Ready") or {}).get("status") == "True"
        ready_since = (
            _parse_time((conditions.get("Ready") or {}).get("lastTransitionTime")) if ready else None
        )
        scheduled = conditions.get("PodScheduled") or {}
        unschedulable = None
        if scheduled.get("status") == "False":
            unschedulable = scheduled.get("message") or scheduled.get("reason") or "not scheduled"
        waiting = next(
            (
                f"{state['waiting'].get('reason', 'Waiting')}: {state['waiting'].get('message', '')}".rstrip(
                    ": "
                )
                for container in status.get("containerStatuses") or []
                if isinstance(state := container.get("state"), dict)
                and isinstance(state.get("waiting"), dict)
            ),
            None,
        )
        return cls(
            name=str(metadata.get("name", "")),
            role=labels.get(LABEL_ROLE),
            fingerprint=labels.get(LABEL_FINGERPRINT),
            ip=status.get("podIP") or None,
            ready=ready,
            deleting=metadata.get("deletionTimestamp") is not None,
            unschedulable=unschedulable,
            revision=labels.get(LABEL_REVISION),
            waiting=waiting,
            ready_since=ready_since,
            group_worker=labels.get(LWS_WORKER_INDEX_LABEL, "0") != "0",
        )


@dataclass(frozen=True)
class ClusterObservation:
    """What one reconcile saw in one cluster, or the problem that kept it from looking.

    `ready` maps a role to the ready count its workload reported (absent: not observed);
    `rolling` holds the roles whose workload is mid-rollout.
    `listing`: the cluster's cache has not finished its first list, so nothing is known yet;
    that is no problem, and no reason to believe the cluster is empty either.
    """

    problem: Problem | None = None
    ready: Mapping[str, int] = field(default_factory=dict)
    rolling: frozenset[str] = frozenset()
    pods: Sequence[PodInfo] = ()
    listing: bool = False

    @property
    def observed(self) -> bool:
        return self.problem is None and not self.listing


@dataclass(frozen=True)
class RouterConfigOutcome:
    """What became of the router config this reconcile: written or kept, and what it lists."""

    version: int
    endpoint_counts: Mapping[str, int]  # pool value -> endpoints listed
    problem: Problem | None = None  # e.g. InvalidProfile: the last good config was kept
    note: str | None = None  # e.g. an older KV fingerprint still serving during a rollout


@dataclass(frozen=True)
class CachePoolSeen:
    """One declared cache pool as a reconcile saw it: its StatefulSets' ready counts (None: its
    cluster was not observed, `problem` says why when it could not be)."""

    cluster: str  # "PrfaaS cluster" or "PD cluster"
    namespace: str
    stores: int
    segment_bytes: int
    master_ready: int | None
    stores_ready: int | None
    problem: Problem | None = None


@dataclass(frozen=True)
class ClaimBinding:
    """A shared pool's claim as the PrfaasDeployment tells it (condition PoolClaimBound): `ok` None
    while its status is unknown; `endpoints`: the pool's ready instances its status lists."""

    ok: bool | None
    reason: str
    message: str
    endpoints: int = 0


@dataclass(frozen=True)
class GatewaySeen:
    """The gateway side, while spec.gateway asks for it: the InferencePool and the picker's names,
    its replicas, and why the pool could not be written (None: it could, or not known yet)."""

    inference_pool: str
    picker: str
    grpc_port: int
    replicas: int
    inference_pool_served: bool | None
    problem: Problem | None = None


@dataclass(frozen=True)
class StatusInputs:
    """Everything compute_status needs, gathered by the reconcile."""

    generation: int | None
    allocation: Allocation
    fingerprint: str
    router_replicas: int
    prefill_namespace: str
    prefill_cluster_is_remote: bool
    prefill_cluster: ClusterObservation
    pd_cluster: ClusterObservation
    router_config: RouterConfigOutcome | None
    previous: PrfaasDeploymentStatus
    now: str  # RFC 3339, passed in
    extra_problems: Sequence[Problem] = ()
    rollout: RolloutStatus | None = None
    cache_pools: Sequence[CachePoolSeen] = ()
    data_path: DataPath = NOT_LOOKED_AT
    """The verdict on KV reaching the decodes from the PrfaaS pool (used for a remote PrfaaS cluster)."""
    gateway: GatewaySeen | None = None
    pool_claim: ClaimBinding | None = None
    """spec.poolClaim's claim: the PrfaaS prefill is the shared pool's, not a fleet of this CR's."""


def _parse_time(value: object) -> datetime | None:
    """An RFC 3339 time from the API server; None when absent or unreadable."""
    try:
        return datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None


def rfc3339(moment: datetime) -> str:
    """A status time: RFC 3339 in UTC, whole seconds (as Kubernetes writes its own)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _counts(
    desired: int,
    role: str,
    seen: ClusterObservation,
    previous: RoleCounts,
    rollout: RolloutStatus | None = None,
) -> RoleCounts:
    ready = seen.ready.get(role)
    if ready is None:  # not observed: as last seen
        return RoleCounts(desired=desired, ready=previous.ready, rolling=previous.rolling)
    # a rolled-back rollout (Failed) holds until the spec changes: the planner need not wait for it
    in_rollout = (
        rollout is not None and rollout.phase != "Failed" and any(r.role == role for r in rollout.roles)
    )
    return RoleCounts(desired=desired, ready=ready, rolling=in_rollout or role in seen.rolling)


def scheduling_problem(pods: Iterable[PodInfo], what: str) -> Problem | None:
    """InsufficientGPU when the scheduler says so for any pod, else Unschedulable, else None."""
    stuck = [pod for pod in pods if pod.unschedulable and not pod.deleting]
    if not stuck:
        return None
    gpu_short = [pod for pod in stuck if f"Insufficient {GPU_RESOURCE}" in (pod.unschedulable or "")]
    first = (gpu_short or stuck)[0]
    reason = INSUFFICIENT_GPU if gpu_short else UNSCHEDULABLE
    return Problem(
        reason, f"{len(stuck)} {what} pod(s) cannot be scheduled, e.g. {first.name}: {first.unschedulable}"
    )


def condition(
    kind: str,
    ok: bool | None,
    reason: str,
    message: str,
    *,
    previous: Sequence[Condition],
    generation: int | None,
    now: str,
) -> Condition:
    """A condition whose lastTransitionTime moves only when its status does (any kind's status);
    `ok` None: Unknown."""
    status: Literal["True", "False", "Unknown"] = "Unknown" if ok is None else "True" if ok else "False"
    before = next((c for c in previous if c.type == kind), None)
    since = before.last_transition_time if before is not None and before.status == status else None
    return Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since or now,
        observed_generation=generation,
    )


def _condition(
    kind: ConditionType, ok: bool | None, reason: str, message: str, inputs: StatusInputs
) -> Condition:
    return condition(
        kind.value,
        ok,
        reason,
        message,
        previous=inputs.previous.conditions,
        generation=inputs.generation,
        now=inputs.now,
    )


def _workload_condition(
    kind: ConditionType,
    seen: ClusterObservation,
    roles: Sequence[tuple[str, str, RoleCounts]],
    ready_reason: str,
    ready_suffix: str,
    inputs: StatusInputs,
) -> Condition:
    """One cluster's readiness: a problem first, then unschedulable pods, then counts."""
    summary = ", ".join(f"{counts.ready}/{counts.desired} {label}" for _, label, counts in roles)
    if seen.problem is not None:
        message = f"{seen.problem.message} (ready counts are the last observed: {summary})"
        return _condition(kind, False, seen.problem.reason, message, inputs)
    if all(counts.ready >= counts.desired for _, _, counts in roles):
        return _condition(kind, True, ready_reason, f"{summary} ready. {ready_suffix}".strip(), inputs)
    stuck = scheduling_problem((p for p in seen.pods if p.role in {r for r, _, _ in roles}), "engine")
    if stuck is not None:
        return _condition(kind, False, stuck.reason, f"{summary} ready; {stuck.message}", inputs)
    return _condition(kind, False, PROGRESSING, f"{summary} ready", inputs)


def _router_condition(counts: RoleCounts, inputs: StatusInputs) -> Condition:
    kind = ConditionType.ROUTER_READY
    config = inputs.router_config
    if inputs.pd_cluster.problem is not None:
        return _condition(
            kind, False, inputs.pd_cluster.problem.reason, inputs.pd_cluster.problem.message, inputs
        )
    if config is None:
        return _condition(kind, False, PROGRESSING, "the router config has not been written yet", inputs)
    listed = ", ".join(f"{n} {pool}" for pool, n in config.endpoint_counts.items())
    prefill = config.endpoint_counts.get("prfaas_prefill", 0) + config.endpoint_counts.get("local_prefill", 0)
    if counts.ready < counts.desired:
        return _condition(
            kind, False, PROGRESSING, f"{counts.ready}/{counts.desired} router replicas ready", inputs
        )
    if config.endpoint_counts.get("decode", 0) == 0 or prefill == 0:
        message = f"router config v{config.version} lists {listed}: it needs a decode and a prefill endpoint"
        return _condition(kind, False, NO_ENDPOINTS, message, inputs)
    message = (
        f"{counts.ready}/{counts.desired} router replicas ready; config v{config.version} lists {listed}"
    )
    if config.note:
        message += f"; {config.note}"
    return _condition(kind, True, ROUTER_READY, message, inputs)


def _rollout_condition(inputs: StatusInputs) -> Condition:
    """RolloutProgressing: True while stepping or when done; False paused or past its deadline."""
    kind, rollout = ConditionType.ROLLOUT_PROGRESSING, inputs.rollout
    if rollout is None:
        return _condition(
            kind, True, REVISION_AVAILABLE, "every engine role runs its desired revision", inputs
        )
    counts = "; ".join(
        f"{r.role}: {r.ready}/{r.target} of revision {r.revision} ready ({r.replicas} asked), "
        f"{r.old_ready}/{r.old_replicas} of {r.old_revision or 'the old revision'}"
        for r in rollout.roles
    )
    progress = f"step {rollout.step}/{rollout.steps}: {counts}"
    pods = [p for p in (*inputs.prefill_cluster.pods, *inputs.pd_cluster.pods) if not p.deleting]
    new_pods = [p for p in pods if any(p.role == r.role and p.revision == r.revision for r in rollout.roles)]
    stuck = scheduling_problem(new_pods, "new-revision")
    waiting = next((f"{p.name} waits: {p.waiting}" for p in new_pods if p.waiting and not p.ready), None)
    why = "; ".join(text for text in (stuck.message if stuck else None, waiting) if text)
    if rollout.phase == "Failed" and rollout.failed is not None:
        message = (
            f"the analysis failed the new revision (KV fingerprint {rollout.failed.fingerprint}) at "
            f"{rollout.failed.time}: {rollout.failed.reason}; rolled back: the old revision is scaled back to "
            f"its target and the new one drained and scaled to 0, until the spec asks for another revision. "
            f"{counts}"
        )
        return _condition(kind, False, ANALYSIS_FAILED, message, inputs)
    if rollout.phase == "Stalled":
        judged = rollout.analysis
        behind = ", ".join(r.role for r in rollout.roles if r.ready < r.replicas) or (
            f"the analysis of the new revision to retire the old one ({judged.verdict}: {judged.reason})"
            if judged is not None and judged.verdict not in ("Pass", "Inconclusive", "NotJudged")
            else "the old revision's drain"
        )
        message = (
            f"no progress since {rollout.last_progress_at} (spec.rollout.progressDeadlineSeconds); waiting for "
            f"{behind}{f' ({why})' if why else ''}; the old revision keeps serving; set the changed field back "
            f"to roll back. {progress}"
        )
        return _condition(kind, False, PROGRESS_DEADLINE_EXCEEDED, message, inputs)
    if rollout.phase == "Paused":
        return _condition(kind, False, ROLLOUT_PAUSED, f"paused (spec.rollout.paused) at {progress}", inputs)
    unobserved = [
        f"the {label} ({seen.problem.message})"
        for label, seen in (("PrfaaS cluster", inputs.prefill_cluster), ("PD cluster", inputs.pd_cluster))
        if seen.problem is not None
    ]
    if unobserved:
        message = (
            f"waiting for {' and '.join(unobserved)}: the step holds where it is, nothing is scaled or retired "
            f"in either cluster until the operator can observe it again; the old revision keeps serving. "
            f"{progress} (a role of a cluster not observed: its counts as last observed)"
        )
        return _condition(kind, True, WAITING_FOR_CLUSTER, message, inputs)
    if rollout.analysis is not None:
        progress += f"; analysis {rollout.analysis.verdict}: {rollout.analysis.reason}"
    return _condition(kind, True, ROLLOUT_IN_PROGRESS, f"{progress}{f'; {why}' if why else ''}", inputs)


def _cache_pool_condition(inputs: StatusInputs) -> Condition | None:
    """CachePoolReady, while any cachePool is declared: True when every declared pool's master and
    all its stores are ready. Never part of Ready or Degraded: a pool that is down costs prefill
    compute, not service (SGLang computes what it cannot fetch, the router stops counting pool hits)."""
    if not inputs.cache_pools:
        return None
    kind = ConditionType.CACHE_POOL_READY
    parts, reasons = [], []
    for pool in inputs.cache_pools:
        where = f"{pool.cluster} (namespace {pool.namespace})"
        total = human_bytes(pool.stores * pool.segment_bytes)
        if pool.master_ready is None or pool.stores_ready is None:
            why = pool.problem.message if pool.problem is not None else "its cache is still listing"
            parts.append(f"{where}: not observed ({why})")
            reasons.append(pool.problem.reason if pool.problem is not None else PROGRESSING)
            continue
        stores = min(pool.stores_ready, pool.stores)
        figures = f"{stores}/{pool.stores} stores ready, capacity {human_bytes(stores * pool.segment_bytes)} of {total}"
        if pool.master_ready < 1:
            parts.append(f"{where}: master not ready, {figures}; its prefills compute what they would fetch")
            reasons.append(MASTER_NOT_READY)
        elif stores < pool.stores:
            parts.append(f"{where}: master ready, {figures}")
            reasons.append(STORES_NOT_READY)
        else:
            parts.append(f"{where}: master ready, {figures}")
    ok = not reasons
    return _condition(kind, ok, POOL_READY if ok else reasons[0], "; ".join(parts), inputs)


def _gateway_condition(inputs: StatusInputs) -> Condition | None:
    """GatewayReady, while spec.gateway asks for an InferencePool: True once the pool is written and
    every picker replica is ready. Never part of Ready: the router Service serves either way; a
    pool the cluster cannot hold makes Degraded too (the spec asks for what cannot be)."""
    gateway = inputs.gateway
    if gateway is None:
        return None
    kind = ConditionType.GATEWAY_READY
    seen = inputs.pd_cluster
    ready = seen.ready.get(Role.PICKER)
    pickers = f"{'?' if ready is None else ready}/{gateway.replicas} picker replicas ready"
    if gateway.problem is not None:
        return _condition(
            kind, False, gateway.problem.reason, f"{gateway.problem.message}; {pickers}", inputs
        )
    if seen.problem is not None:
        return _condition(kind, False, seen.problem.reason, seen.problem.message, inputs)
    if gateway.inference_pool_served is None:
        message = (
            "the PD cluster's InferencePools are not listed yet (a failed list is retried every 30 s and "
            f"logged: a Forbidden one needs the chart's RBAC for inferencepools); {pickers}"
        )
        return _condition(kind, False, PROGRESSING, message, inputs)
    if ready is None or ready < gateway.replicas:
        return _condition(kind, False, PROGRESSING, pickers, inputs)
    message = (
        f"InferencePool {gateway.inference_pool} names the picker Service "
        f"{gateway.picker}:{gateway.grpc_port}; {pickers}"
    )
    return _condition(kind, True, PICKER_READY, message, inputs)


def _pool_prefill_condition(claim: ClaimBinding, note: str, inputs: StatusInputs) -> Condition:
    """PrefillClusterReady of a deployment on a shared pool: the pool's instances its claim lists."""
    kind = ConditionType.PREFILL_CLUSTER_READY
    if not claim.ok:
        return _condition(kind, False, claim.reason, claim.message, inputs)
    if claim.endpoints == 0:
        message = "the claim is bound and lists no ready instance of the pool yet; prompts prefill locally"
        return _condition(kind, False, NO_ENDPOINTS, message, inputs)
    message = f"{claim.endpoints} ready instance(s) of the shared pool listed by the claim. {note}".strip()
    return _condition(kind, True, inputs.data_path.reason, message, inputs)


def _problems(inputs: StatusInputs, parts: Sequence[Condition]) -> list[Problem]:
    problems: list[Problem] = list(inputs.extra_problems)
    claim = inputs.pool_claim
    if claim is not None and claim.ok is False and claim.reason != PROGRESSING:
        problems.append(Problem(claim.reason, f"PrfaasPoolClaim: {claim.message}"))
    if inputs.gateway is not None and inputs.gateway.problem is not None:
        problems.append(inputs.gateway.problem)
    for label, seen in (("PrfaaS cluster", inputs.prefill_cluster), ("PD cluster", inputs.pd_cluster)):
        if seen.problem is not None:
            problems.append(Problem(seen.problem.reason, f"{label}: {seen.problem.message}"))
    if inputs.router_config is not None and inputs.router_config.problem is not None:
        problems.append(inputs.router_config.problem)
    for condition in parts:
        if condition.reason in (INSUFFICIENT_GPU, UNSCHEDULABLE, PROGRESS_DEADLINE_EXCEEDED):
            problems.append(Problem(condition.reason, f"{condition.type}: {condition.message}"))
    return problems


def compute_status(inputs: StatusInputs) -> PrfaasDeploymentStatus:
    """The status subresource for one reconcile (status.planner is the planner's and left out)."""
    allocation = inputs.allocation
    previous = inputs.previous
    prfaas = _counts(
        allocation.prefill_cluster_replicas,
        Role.PRFAAS_PREFILL,
        inputs.prefill_cluster,
        previous.prefill_cluster,
        inputs.rollout,
    )
    pd_prefill = _counts(
        allocation.pd_prefill_instances,
        Role.PD_PREFILL,
        inputs.pd_cluster,
        previous.pd_prefill,
        inputs.rollout,
    )
    decode = _counts(
        allocation.pd_decode_instances, Role.PD_DECODE, inputs.pd_cluster, previous.pd_decode, inputs.rollout
    )
    router = _counts(inputs.router_replicas, Role.ROUTER, inputs.pd_cluster, previous.router)

    remote = inputs.prefill_cluster_is_remote
    note = inputs.data_path.message if remote else ""
    claim = inputs.pool_claim
    optional: list[Condition] = []
    if claim is not None:
        prfaas = RoleCounts(desired=claim.endpoints, ready=claim.endpoints)
        prefill_ready = _pool_prefill_condition(claim, note, inputs)
        bound = ConditionType.POOL_CLAIM_BOUND
        optional.append(_condition(bound, claim.ok, claim.reason, claim.message, inputs))
    else:
        prefill_ready = _workload_condition(
            ConditionType.PREFILL_CLUSTER_READY,
            inputs.prefill_cluster,
            [(Role.PRFAAS_PREFILL, f"PrfaaS prefill in namespace {inputs.prefill_namespace}", prfaas)],
            inputs.data_path.reason if remote else INSTANCES_READY,
            note,
            inputs,
        )
    pd_ready = _workload_condition(
        ConditionType.PD_CLUSTER_READY,
        inputs.pd_cluster,
        [(Role.PD_PREFILL, "local prefill", pd_prefill), (Role.PD_DECODE, "decode", decode)],
        INSTANCES_READY,
        "",
        inputs,
    )
    router_ready = _router_condition(router, inputs)
    rollout = _rollout_condition(inputs)
    parts = [prefill_ready, pd_ready, router_ready]

    blocking = next((c for c in parts if c.status != "True"), None)
    if blocking is None:
        ready = _condition(ConditionType.READY, True, ALL_READY, f"All parts ready. {note}".strip(), inputs)
    else:
        message = f"{blocking.type} is False ({blocking.reason}): {blocking.message}"
        ready = _condition(
            ConditionType.READY, False, f"{blocking.type.removesuffix('Ready')}NotReady", message, inputs
        )

    optional += [c for c in (_cache_pool_condition(inputs), _gateway_condition(inputs)) if c is not None]
    problems = _problems(inputs, [*parts, rollout])
    if problems:
        degraded = _condition(
            ConditionType.DEGRADED, True, problems[0].reason, "; ".join(p.message for p in problems), inputs
        )
    else:
        degraded = _condition(ConditionType.DEGRADED, False, AS_EXPECTED, "", inputs)

    return PrfaasDeploymentStatus(
        observed_generation=inputs.generation,
        conditions=[ready, prefill_ready, pd_ready, router_ready, degraded, rollout, *optional],
        prefill_cluster=prfaas,
        pd_prefill=pd_prefill,
        pd_decode=decode,
        router=router,
        allocation=allocation,
        fingerprint=inputs.fingerprint,
        planner=previous.planner,
        rollout=inputs.rollout,
    )


def warning_events(before: Sequence[Condition], after: Sequence[Condition]) -> list[Problem]:
    """Warnings worth an Event: Degraded turning True, or turning to a new reason."""
    old = next((c for c in before if c.type == ConditionType.DEGRADED.value), None)
    new = next((c for c in after if c.type == ConditionType.DEGRADED.value), None)
    if new is None or new.status != "True":
        return []
    if old is not None and old.status == "True" and old.reason == new.reason:
        return []
    return [Problem(new.reason, new.message)]


def status_changed(before: PrfaasDeploymentStatus, after: PrfaasDeploymentStatus) -> bool:
    """Whether writing `after` changes anything (transition times are carried over, so equality works)."""
    return before.model_dump() != after.model_dump()


def status_patch(previous: PrfaasDeploymentStatus, status: PrfaasDeploymentStatus) -> dict[str, Any]:
    """The merge patch that writes `status` (status.planner is the planner's): a field that is gone
    since `previous` (a finished rollout, a rollout's failed record) is sent as null, which is how a
    merge patch removes it."""
    document = status.model_dump(by_alias=True, mode="json", exclude_none=True, exclude={"planner"})
    before = previous.model_dump(by_alias=True, mode="json", exclude_none=True, exclude={"planner"})
    return replacing(document, before)


def replacing(new: Mapping[str, Any], old: Any) -> dict[str, Any]:
    """A merge-patch value that leaves exactly `new`: keys only in `old` are set to null (deleted),
    in nested objects too (lists are replaced whole)."""
    patch = dict(new)
    if isinstance(old, Mapping):
        for key, value in old.items():
            if key not in new:
                patch[key] = None
            elif isinstance(value, Mapping) and isinstance(new[key], Mapping):
                patch[key] = replacing(new[key], value)
    return patch


def read_status(raw: Any) -> PrfaasDeploymentStatus:
    """The status subresource as last written; an unreadable one reads as empty (the reconcile rewrites it)."""
    try:
        return PrfaasDeploymentStatus.model_validate(raw or {})
    except ValidationError:
        log.warning("ignoring an unreadable status; it will be rewritten")
        return PrfaasDeploymentStatus()
