"""A PrfaasPool and its PrfaasPoolClaims: which claims bind, each one's share, both statuses (pure).

A claim binds as a PersistentVolumeClaim binds a volume: the pool's controller accepts it or
refuses it with a reason, and a binding holds while the claim lives, so a newer claim never takes
an older one's place. What refuses a claim:
- PoolNotFound: no PrfaasPool of its poolName beside it;
- KvLayoutMismatch: its decodes' KV layout differs from the pool's engines' (the message names the
  first field that differs): a prefill of the pool could not hand them its KV;
- GuaranteesOverCapacity: its guarantee, with those of the claims already accepted, exceeds what the
  pool prefills at its minimum replicas (the fewest the planner keeps), so a guarantee holds however
  the pool is scaled. A bound claim is never refused for capacity: when the pool's minimum is
  lowered under the guarantees already given, the pool says so (GuaranteesFit False) and the
  division keeps each guarantee's part (shares.divide).

The bound claims divide the ready instances' capacity by weighted max-min (prfaas_core.shares);
a claim whose demand is unknown asks for all it may (unknown is not zero). Statuses carry whole
tokens per second, rounded down, so the published shares never add up to more than the pool.

The pool's prefill fleet (fleet_objects) is built by the same builders as a PrfaasDeployment's
PrfaaS side (manifests.prefill_fleet_role, desired_revision, engine_objects), owned by the pool
(an ownerReference: deleting the pool takes them); what runs feeds its status (fleet_seen).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prfaas_core import shares
from prfaas_core.vocabulary import CLAIM_PLURAL, GROUP, POOL_KIND, Role

from prfaas_operator.api import (
    Condition,
    PoolClaimSpec,
    PoolClaimStatus,
    PoolConsumer,
    PoolEndpoint,
    PrfaasPool,
    PrfaasPoolClaim,
    PrfaasPoolSpec,
    PrfaasPoolStatus,
    ProfilePoint,
    RefusedClaim,
)
from prfaas_operator.planning import workloads
from prfaas_operator.planning.fingerprint import kv_fingerprint, kv_layout, layout_difference
from prfaas_operator.planning.manifests import (
    Manifest,
    Names,
    Owner,
    desired_revision,
    engine_objects,
    prefill_fleet_role,
)
from prfaas_operator.planning.router_config_builder import ready_endpoints
from prfaas_operator.planning.status import PodInfo, condition

BOUND = "Bound"
"""The claim's condition, and its reason when the pool serves it."""
POOL_NOT_FOUND = "PoolNotFound"
KV_LAYOUT_MISMATCH = "KvLayoutMismatch"
GUARANTEES_OVER_CAPACITY = "GuaranteesOverCapacity"
READY = "Ready"
CAPACITY_FROM_PROFILE = "CapacityFromProfile"
"""Ready's reason while no instance of the pool is ready (or its StatefulSet is not observed yet): its
capacity is assumed from its profile at minReplicas."""
GUARANTEES_FIT = "GuaranteesFit"
DELETION_HELD = "DeletionHeld"
"""The pool's condition while its deletion waits for its bound claims (its finalizer stays)."""


@dataclass(frozen=True)
class ClaimSeen:
    """One PrfaasPoolClaim as the pool's controller lists it."""

    name: str
    spec: PoolClaimSpec
    created: str
    """Its creationTimestamp (RFC 3339): earlier claims bind first."""
    bound: bool = False
    """Its Bound condition was True: the binding holds (claims are bound first, in that order)."""


@dataclass(frozen=True)
class Binding:
    """One claim accepted, or refused with its reason."""

    claim: str
    accepted: bool
    reason: str
    message: str


def instance_tokens_per_second(profile: Sequence[ProfilePoint]) -> float:
    """What one instance prefills per second, at the profile's longest prompt: offloaded prompts
    are the long ones, and once the fixed overhead is amortised T(l) grows faster than l, so the
    longest is the slowest rate among them and a guarantee sized on it holds."""
    longest = max(profile, key=lambda point: point.tokens)
    return longest.tokens / longest.seconds


def floor_tokens_per_second(pool: PrfaasPoolSpec) -> float:
    """What the pool prefills at its minimum replicas: the most its guarantees may add up to."""
    return pool.prefill.replicas_minimum() * instance_tokens_per_second(pool.prefill.prefill_profile)


def capacity_tokens_per_second(pool: PrfaasPoolSpec, ready_replicas: int | None) -> float:
    """What the ready instances prefill. While none is ready (the pool starting, its instances loading
    the model for minutes, or all of them restarting) or its StatefulSet is not observed yet (None),
    what the pool prefills at its minimum replicas by its measured profile, the capacity its
    guarantees are sized on: unknown is not zero, and the consumers' shares do not drop to 0 and back
    through every start. Nothing is offloaded meanwhile all the same: the claims' endpoints are empty."""
    if not ready_replicas:
        return floor_tokens_per_second(pool)
    return ready_replicas * instance_tokens_per_second(pool.prefill.prefill_profile)


# ---- the pool's prefill fleet ------------------------------------------------------------------


def pool_owner(metadata: Mapping[str, Any]) -> Owner:
    """The PrfaasPool as the owner of its prefill fleet (children beside it, with an ownerReference)."""
    return Owner(metadata["name"], metadata["namespace"], metadata.get("uid", ""), kind=POOL_KIND)


def fleet_replicas(pool: PrfaasPoolSpec, planned: int | None = None) -> int:
    """How many prefill instances the pool runs: `planned` (the joint planner's, issue 31 item 2; None
    until it drives the pool) or spec.prefill.replicas, within minReplicas..maxReplicas."""
    fleet = pool.prefill
    wanted = fleet.replicas if planned is None else planned
    return max(fleet.replicas_minimum(), min(fleet.max_replicas, wanted))


def fleet_objects(pool: PrfaasPoolSpec, owner: Owner, replicas: int) -> list[Manifest]:
    """The pool's prefill StatefulSet (a LeaderWorkerSet for a multi-node shape), headless Service and
    PodDisruptionBudget, named `<pool>-prfaas-prefill`, stamped with the pool's KV fingerprint.
    No rollout slots (a changed template rolls the StatefulSet in place) and no cache pool yet."""
    engine = prefill_fleet_role(
        pool.prefill, Names.of(owner.name).prfaas_prefill, owner.namespace, replicas, remote=False
    )
    return engine_objects(
        pool, desired_revision(pool.model, engine, owner, kv_fingerprint(pool.model)), owner
    )


@dataclass(frozen=True)
class FleetSeen:
    """The pool's prefill fleet as it runs."""

    ready_replicas: int | None
    """Its workload's ready instances; None while the workload is missing or its controller has not
    reported on it yet."""
    endpoints: list[PoolEndpoint]
    """Its ready instances of the pool's KV fingerprint, by name (a multi-node instance's leader)."""
    problem: str | None = None
    """Why applying it failed this pass (the cluster's answer, e.g. no LeaderWorkerSet served): the
    pool's Ready says so."""


def fleet_seen(
    pool: PrfaasPoolSpec, workload: Mapping[str, Any] | None, pods: Sequence[PodInfo]
) -> FleetSeen:
    """What the pool's workload and pods say: its ready instances, and the endpoints its claims get
    (only pods of the pool's fingerprint, the layout the claims were bound against)."""
    # observed once its controller has written its status (a LeaderWorkerSet has no observedGeneration)
    observed = bool((workload or {}).get("status"))
    fingerprint = kv_fingerprint(pool.model)
    fleet = pool.prefill
    mine = [pod for pod in pods if pod.fingerprint == fingerprint]
    return FleetSeen(
        ready_replicas=workloads.ready_replicas(workload) if observed else None,
        endpoints=[
            PoolEndpoint(name=e.name, url=e.url, bootstrap_port=fleet.bootstrap_port)
            for e in ready_endpoints(mine, Role.PRFAAS_PREFILL, fleet.port, fleet.bootstrap_port)
        ],
    )


def bind(pool: PrfaasPoolSpec | None, claims: Sequence[ClaimSeen]) -> list[Binding]:
    """Each of the claims naming this pool accepted or refused, in the order given; decided the bound
    ones first, then by creation time and name (so a newer claim never takes an older one's place)."""
    if pool is None:
        return [
            Binding(
                claim.name, False, POOL_NOT_FOUND, f"no PrfaasPool {claim.spec.pool_name} in this namespace"
            )
            for claim in claims
        ]
    layout = kv_layout(pool.model)
    floor = floor_tokens_per_second(pool)
    guaranteed = 0.0
    out: dict[str, Binding] = {}
    for claim in sorted(claims, key=lambda claim: (not claim.bound, claim.created, claim.name)):
        difference = layout_difference(claim.spec.kv_layout, layout)
        wanted = claim.spec.guaranteed_tokens_per_second
        if difference is not None:
            out[claim.name] = Binding(
                claim.name, False, KV_LAYOUT_MISMATCH, f"kvLayout.{difference} (claim against pool)"
            )
        elif not claim.bound and guaranteed + wanted > floor:
            out[claim.name] = Binding(
                claim.name,
                False,
                GUARANTEES_OVER_CAPACITY,
                f"guaranteedTokensPerSecond {wanted} on top of {guaranteed:.0f} already guaranteed exceeds "
                f"{floor:.0f} tokens/s, what the pool prefills at its minimum of "
                f"{pool.prefill.replicas_minimum()} instances",
            )
        else:
            guaranteed += wanted
            out[claim.name] = Binding(claim.name, True, BOUND, f"bound to PrfaasPool {claim.spec.pool_name}")
    return [out[claim.name] for claim in claims]


def divide(
    pool: PrfaasPoolSpec,
    claims: Sequence[ClaimSeen],
    bindings: Sequence[Binding],
    *,
    ready_replicas: int | None,
    demands: Mapping[str, float],
) -> shares.Division:
    """The ready instances' capacity divided among the accepted claims (`demands` in prefill tokens
    per second, by claim; a claim without one asks for all it may). `ready_replicas` None: the
    instances are not observed (see capacity_tokens_per_second)."""
    accepted = {binding.claim for binding in bindings if binding.accepted}
    kv_size = pool.model.kv.size()
    consumers = [
        shares.Consumer(
            name=claim.name,
            demand_tokens_per_second=demands.get(claim.name, math.inf),
            link=claim.spec.link.budget(),
            weight=claim.spec.weight,
            guaranteed_tokens_per_second=claim.spec.guaranteed_tokens_per_second,
            maximum_tokens_per_second=(
                math.inf
                if claim.spec.maximum_tokens_per_second is None
                else claim.spec.maximum_tokens_per_second
            ),
        )
        for claim in claims
        if claim.name in accepted
    ]
    return shares.divide(capacity_tokens_per_second(pool, ready_replicas), kv_size, consumers)


def _consumer(claim: ClaimSeen, division: shares.Division) -> PoolConsumer:
    share = division.share(claim.name)
    return PoolConsumer(
        claim=claim.name,
        weight=claim.spec.weight,
        tokens_per_second=math.floor(share.tokens_per_second),
        entitled_tokens_per_second=math.floor(share.entitled_tokens_per_second),
        bound=share.bound,
        reason=share.reason,
    )


def pool_status(
    pool: PrfaasPoolSpec,
    claims: Sequence[ClaimSeen],
    bindings: Sequence[Binding],
    division: shares.Division,
    *,
    ready_replicas: int | None,
    previous: PrfaasPoolStatus,
    generation: int | None,
    now: str,
    problem: str | None = None,
) -> PrfaasPoolStatus:
    """The pool's capacity, its consumers with their shares, the claims it refused, Ready and GuaranteesFit
    (no instance ready, or None: not observed; Ready False, CapacityFromProfile, says the capacity is
    assumed; `problem`: why applying its fleet failed, in Ready's message)."""
    by_name = {claim.name: claim for claim in claims}
    accepted = [by_name[binding.claim] for binding in bindings if binding.accepted]
    guaranteed = sum(claim.spec.guaranteed_tokens_per_second for claim in accepted)
    consumers = [_consumer(claim, division) for claim in accepted]
    floor = floor_tokens_per_second(pool)
    conditions = [
        _ready(pool, ready_replicas, problem, division, previous=previous, generation=generation, now=now),
        condition(
            GUARANTEES_FIT,
            guaranteed <= floor,
            "WithinMinimum" if guaranteed <= floor else "OverMinimum",
            f"the bound claims guarantee {guaranteed:.0f} tokens/s; the pool prefills {floor:.0f} at its "
            f"minimum of {pool.prefill.replicas_minimum()} instances",
            previous=previous.conditions,
            generation=generation,
            now=now,
        ),
    ]
    return PrfaasPoolStatus(
        observed_generation=generation,
        conditions=conditions,
        fingerprint=kv_fingerprint(pool.model),
        ready_replicas=ready_replicas or 0,
        capacity_tokens_per_second=math.floor(division.capacity_tokens_per_second),
        guaranteed_tokens_per_second=guaranteed,
        unclaimed_tokens_per_second=math.floor(division.unclaimed_tokens_per_second),
        shares=" ".join(f"{c.claim}={c.tokens_per_second}" for c in consumers),
        consumers=consumers,
        refused=[
            RefusedClaim(claim=binding.claim, reason=binding.reason, message=binding.message)
            for binding in bindings
            if not binding.accepted
        ],
    )


def _ready(
    pool: PrfaasPoolSpec,
    ready_replicas: int | None,
    problem: str | None,
    division: shares.Division,
    *,
    previous: PrfaasPoolStatus,
    generation: int | None,
    now: str,
) -> Condition:
    capacity = f"{division.capacity_tokens_per_second:.0f} tokens/s"
    wanted = fleet_replicas(pool)
    failed = "" if problem is None else f"; applying the fleet failed: {problem}"
    if ready_replicas:
        message = f"{ready_replicas}/{wanted} prefill instances ready, {capacity}{failed}"
        return condition(
            READY,
            True,
            "InstancesReady",
            message,
            previous=previous.conditions,
            generation=generation,
            now=now,
        )
    seen = (
        "its workload is not observed yet"
        if ready_replicas is None
        else f"0/{wanted} prefill instances ready"
    )
    message = (
        f"{seen}; capacity {capacity} is assumed from prefillProfile at minReplicas "
        f"({pool.prefill.replicas_minimum()} instances), and no endpoint is given to the claims{failed}"
    )
    return condition(
        READY,
        False,
        CAPACITY_FROM_PROFILE,
        message,
        previous=previous.conditions,
        generation=generation,
        now=now,
    )


def claim_status(
    claim: ClaimSeen,
    binding: Binding,
    division: shares.Division | None,
    *,
    pool_fingerprint: str | None,
    endpoints: Sequence[PoolEndpoint],
    previous: PoolClaimStatus,
    generation: int | None,
    now: str,
) -> PoolClaimStatus:
    """Bound, with its share and the pool's endpoints while the pool serves it; else why not.
    (`division` is None only when the pool is unknown.)"""
    bound = condition(
        BOUND,
        binding.accepted,
        binding.reason,
        binding.message,
        previous=previous.conditions,
        generation=generation,
        now=now,
    )
    share = _consumer(claim, division) if binding.accepted and division is not None else None
    return PoolClaimStatus(
        observed_generation=generation,
        conditions=[bound],
        pool_fingerprint=pool_fingerprint,
        share=share,
        unclaimed_tokens_per_second=(
            math.floor(division.unclaimed_tokens_per_second)
            if share is not None and division is not None
            else 0
        ),
        endpoints=list(endpoints) if share is not None else [],
    )


def claim_access(claim: str, namespace: str, subject: Mapping[str, str]) -> list[dict[str, Any]]:
    """The Role and RoleBinding a consumer's identity gets in the PrfaaS cluster: its own claim, by
    name, and nothing else. It creates the claim by server-side apply (a PATCH that names it, so
    `create` can be limited by name), reads its status (its share and the pool's endpoints) by get,
    or a list or watch whose field selector names it (metadata.name); it cannot write the status, list the claims, or read the pool, the
    pods or another consumer's claim. `subject` is an RBAC subject (a ServiceAccount or the user of
    the consumer's kubeconfig)."""
    name = f"prfaas-claim-{claim}"
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": name, "namespace": namespace},
            "rules": [
                {
                    "apiGroups": [GROUP],
                    "resources": [CLAIM_PLURAL],
                    "resourceNames": [claim],
                    "verbs": ["get", "list", "watch", "create", "patch", "delete"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": name, "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [dict(subject)],
        },
    ]


POOL_PROTECTION_FINALIZER = f"{GROUP}/pool-protection"
"""Holds a deleted pool while claims are bound to it, as kubernetes.io/pv-protection holds a bound volume."""


def holding_deletion(bindings: Sequence[Binding]) -> str | None:
    """Why a deleted pool is not let go yet (its finalizer stays): the claims still bound to it, which
    would all lose their prefill at once. None: let it go."""
    bound = sorted(binding.claim for binding in bindings if binding.accepted)
    if not bound:
        return None
    return f"deletion waits for the bound claims to be deleted: {', '.join(bound)}"


def pool_finalizers(finalizers: Sequence[str], *, deleting: bool, holding: str | None) -> list[str] | None:
    """The pool's finalizers as they should be, or None when they are: pool-protection added while the
    pool lives, kept while its deletion is held, removed once no claim is bound (the API server
    refuses a finalizer added to an object being deleted, so none is)."""
    has = POOL_PROTECTION_FINALIZER in finalizers
    if deleting:
        return [f for f in finalizers if f != POOL_PROTECTION_FINALIZER] if has and holding is None else None
    return None if has else [*finalizers, POOL_PROTECTION_FINALIZER]


@dataclass(frozen=True)
class PoolPass:
    """What one pass over a pool and the claims naming it writes: only what changed."""

    pool_status: PrfaasPoolStatus | None
    """None: unchanged, or no such pool."""
    claim_statuses: dict[str, PoolClaimStatus]
    """By claim name."""
    finalizers: list[str] | None
    """The pool's finalizers to write; None: they are right."""


def _seen(claim: PrfaasPoolClaim) -> ClaimSeen:
    bound = any(c.type == BOUND and c.status == "True" for c in claim.status.conditions)
    return ClaimSeen(claim.metadata["name"], claim.spec, claim.metadata.get("creationTimestamp", ""), bound)


def pool_pass(
    pool: PrfaasPool | None,
    claims: Sequence[PrfaasPoolClaim],
    *,
    fleet: FleetSeen,
    now: str,
) -> PoolPass:
    """Bind the claims naming `pool` (None: it does not exist), divide its capacity, and say which
    statuses and finalizers to write; the bound claims get `fleet`'s endpoints. A claim bound before
    stays bound (its Bound condition is read back), so a newer claim never displaces it."""
    ready_replicas = fleet.ready_replicas
    seen = [_seen(claim) for claim in claims]
    bindings = bind(None if pool is None else pool.spec, seen)
    division = (
        None if pool is None else divide(pool.spec, seen, bindings, ready_replicas=ready_replicas, demands={})
    )
    new_pool: PrfaasPoolStatus | None = None
    finalizers = holding = None
    if pool is not None and division is not None:
        generation = pool.metadata.get("generation")
        new_pool = pool_status(
            pool.spec,
            seen,
            bindings,
            division,
            ready_replicas=ready_replicas,
            previous=pool.status,
            generation=generation,
            now=now,
            problem=fleet.problem,
        )
        deleting = "deletionTimestamp" in pool.metadata
        holding = holding_deletion(bindings) if deleting else None
        if holding is not None:
            held = condition(
                DELETION_HELD,
                True,
                "ClaimsBound",
                holding,
                previous=pool.status.conditions,
                generation=generation,
                now=now,
            )
            new_pool.conditions.append(held)
        finalizers = pool_finalizers(pool.metadata.get("finalizers", []), deleting=deleting, holding=holding)
    claim_statuses = {}
    for claim, one, binding in zip(claims, seen, bindings, strict=True):
        status = claim_status(
            one,
            binding,
            division,
            pool_fingerprint=None if new_pool is None else new_pool.fingerprint,
            endpoints=fleet.endpoints,
            previous=claim.status,
            generation=claim.metadata.get("generation"),
            now=now,
        )
        if status != claim.status:
            claim_statuses[one.name] = status
    return PoolPass(
        pool_status=None if pool is None or new_pool == pool.status else new_pool,
        claim_statuses=claim_statuses,
        finalizers=finalizers,
    )
