"""The consumer's side of a shared pool without a cluster: the claim a PrfaasDeployment with
spec.poolClaim writes, and what its status makes of the router config and the deployment's status,
through the pure steps of a pass (reconcile_pass) as the executor chains them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prfaas_core.router_config import PoolShare, RouterConfig
from prfaas_core.vocabulary import CLAIM_KIND, Pool, Role
from prfaas_operator.adapters.kube import UNREACHABLE
from prfaas_operator.api import (
    Condition,
    PoolClaimSpec,
    PoolClaimStatus,
    PoolConsumer,
    PoolEndpoint,
    PrfaasDeploymentSpec,
    PrfaasDeploymentStatus,
)
from prfaas_operator.planning import pool
from prfaas_operator.planning.fingerprint import kv_fingerprint, kv_layout, layout_fingerprint
from prfaas_operator.planning.manifests import Names, Owner
from prfaas_operator.planning.pool_claim import (
    ClaimSeen,
    cache_salt,
    claim_in_use,
    claim_manifest,
    claim_placement,
    claim_to_delete,
)
from prfaas_operator.planning.reconcile_pass import (
    Applies,
    Instant,
    PassInput,
    PassPlan,
    PrefillClusterSeen,
    ReconcileOptions,
    conclude_pass,
    plan_pd_engines,
    plan_router_and_prefill_cluster,
)
from prfaas_operator.planning.rollout import Slot
from prfaas_operator.planning.status import ClusterObservation, PodInfo, Problem
from support.sample_cr import spec

OWNER = Owner(name="kimi-linear", namespace="prfaas-demo", uid="uid-1")
NAMES = Names.of(OWNER.name)
OPTIONS = ReconcileOptions()
WALL_NOW = datetime(2026, 1, 1, tzinfo=UTC)
CLAIM = {"poolName": "shared", "namespace": "prfaas-pools", "weight": 2, "guaranteedTokensPerSecond": 1000}


def pooled(**claim: object) -> PrfaasDeploymentSpec:
    return spec(poolClaim={**CLAIM, **claim})


def local_pods(s: PrfaasDeploymentSpec) -> ClusterObservation:
    fingerprint = kv_fingerprint(s.model)
    found = [
        *(
            PodInfo(f"{NAMES.pd_prefill}-{n}", Role.PD_PREFILL, fingerprint, f"10.2.0.{n + 1}", True)
            for n in range(3)
        ),
        *(
            PodInfo(f"{NAMES.pd_decode}-{n}", Role.PD_DECODE, fingerprint, f"10.3.0.{n + 1}", True)
            for n in range(5)
        ),
    ]
    return ClusterObservation(ready={Role.PD_PREFILL: 3, Role.PD_DECODE: 5, Role.ROUTER: 1}, pods=found)


def bound_status(s: PrfaasDeploymentSpec, endpoints: int = 2) -> PoolClaimStatus:
    """What the pool's controller writes for a bound claim (pool.claim_status's shape)."""
    return PoolClaimStatus(
        conditions=[
            Condition(type=pool.BOUND, status="True", reason=pool.BOUND, message="bound to PrfaasPool shared")
        ],
        pool_fingerprint=kv_fingerprint(s.model),
        share=PoolConsumer(
            claim=OWNER.name,
            weight=2,
            tokens_per_second=20000,
            entitled_tokens_per_second=15000,
            bound="demand",
            reason="its demand",
        ),
        unclaimed_tokens_per_second=5000,
        endpoints=[
            PoolEndpoint(name=f"shared-prefill-{n}", url=f"http://10.9.0.{n + 1}:30000", bootstrap_port=8998)
            for n in range(endpoints)
        ],
    )


def refused_status() -> PoolClaimStatus:
    message = "kvLayout.pageSize '32' against '64' (claim against pool)"
    return PoolClaimStatus(
        conditions=[
            Condition(type=pool.BOUND, status="False", reason=pool.KV_LAYOUT_MISMATCH, message=message)
        ]
    )


def run_pass(
    s: PrfaasDeploymentSpec,
    claim: ClaimSeen,
    last: RouterConfig | None = None,
    previous: PrfaasDeploymentStatus | None = None,
    seconds: float = 0,
) -> tuple[PassPlan, PrfaasDeploymentStatus]:
    """One pass as the executor runs it for a deployment on a shared pool: the claim read back, no
    PrfaaS cache (slots None), the local engines settled."""
    previous = previous or PrfaasDeploymentStatus()
    pass_input = PassInput(
        s, OWNER, 1, previous, Instant(100.0 + seconds, WALL_NOW + timedelta(seconds=seconds))
    )
    slots: dict[str, list[Slot] | None] = {Role.PD_PREFILL: [], Role.PD_DECODE: [], Role.PRFAAS_PREFILL: None}
    engines = plan_pd_engines(pass_input, {}, slots, OPTIONS)
    assert Role.PRFAAS_PREFILL not in engines.revisions, "the pool's controller runs its prefills"
    pd = local_pods(s)
    prefill = ClusterObservation(claim.problem)
    seen = PrefillClusterSeen(prefill, claim.problem is None, None, claim)
    plan = plan_router_and_prefill_cluster(pass_input, engines, seen, pd, last, None, OPTIONS)
    conclusion = conclude_pass(pass_input, engines, plan, (prefill, pd), Applies(), last, OPTIONS)
    return plan, conclusion.status


def condition(status: PrfaasDeploymentStatus, kind: str) -> tuple[str, str, str]:
    (found,) = [c for c in status.conditions if c.type == kind]
    return found.status, found.reason, found.message


def test_the_claim_carries_the_layout_the_engines_fingerprint_hashes_and_the_deployments_link() -> None:
    s = pooled(maximumTokensPerSecond=50000)
    assert s.pool_claim is not None
    manifest = claim_manifest(s, s.pool_claim, OWNER)
    assert manifest["kind"] == CLAIM_KIND
    assert manifest["metadata"]["name"] == OWNER.name, "named after the consumer by default"
    assert manifest["metadata"]["namespace"] == "prfaas-pools", "beside the pool"
    claim = PoolClaimSpec.model_validate(manifest["spec"])
    assert layout_fingerprint(claim.kv_layout) == kv_fingerprint(s.model)
    assert claim.kv_layout == kv_layout(s.model)
    assert (claim.pool_name, claim.link, claim.weight) == ("shared", s.link, 2)
    assert (claim.guaranteed_tokens_per_second, claim.maximum_tokens_per_second) == (1000, 50000)
    named = pooled(claimName="pd-eu-west")
    assert named.pool_claim is not None
    assert claim_manifest(named, named.pool_claim, OWNER)["metadata"]["name"] == "pd-eu-west"
    assert cache_salt(named.pool_claim, OWNER) == "prfaas-claim/prfaas-pools/pd-eu-west"
    assert (
        s.pool_claim is not None
        and cache_salt(s.pool_claim, OWNER) == "prfaas-claim/prfaas-pools/kimi-linear"
    )


def test_a_bound_claim_gives_the_router_its_endpoints_share_and_salt_and_nothing_is_applied_there() -> None:
    s = pooled()
    plan, status = run_pass(s, ClaimSeen(bound_status(s)))
    assert plan.prefill_cluster_manifests is None, "no StatefulSet of this CR in the PrfaaS cluster"
    config = plan.router_config.config
    assert config is not None
    assert [(e.name, e.url, e.bootstrap_port) for e in config.pools.prfaas_prefill] == [
        ("shared-prefill-0", "http://10.9.0.1:30000", 8998),
        ("shared-prefill-1", "http://10.9.0.2:30000", 8998),
    ]
    assert {e.fingerprint for e in config.pools.prfaas_prefill} == {config.fingerprint}
    assert len(config.pools.of(Pool.LOCAL_PREFILL)) == 3 and len(config.pools.decode) == 5
    assert config.pool_share == PoolShare(
        tokens_per_second=20000, entitled_tokens_per_second=15000, unclaimed_tokens_per_second=5000
    )
    assert config.cache_salt == "prfaas-claim/prfaas-pools/kimi-linear"
    ok, reason, message = condition(status, "PoolClaimBound")
    assert (ok, reason) == ("True", pool.BOUND)
    assert "share 20000 tokens/s" in message and "2 prefill endpoint(s)" in message
    assert condition(status, "PrefillClusterReady")[0] == "True"
    assert status.prefill_cluster.ready == 2
    assert condition(status, "Degraded")[0] == "False"
    assert status.rollout is None or all(r.role != Role.PRFAAS_PREFILL for r in status.rollout.roles)


def test_a_refused_claim_prefills_everything_locally_and_says_why() -> None:
    s = pooled()
    plan, status = run_pass(s, ClaimSeen(refused_status()))
    config = plan.router_config.config
    assert config is not None
    assert config.pools.prfaas_prefill == [] and config.pool_share is None
    assert len(config.pools.of(Pool.LOCAL_PREFILL)) == 3
    expected = ("False", pool.KV_LAYOUT_MISMATCH, "kvLayout.pageSize '32' against '64' (claim against pool)")
    assert condition(status, "PoolClaimBound") == expected
    assert condition(status, "PrefillClusterReady")[:2] == ("False", pool.KV_LAYOUT_MISMATCH)
    assert condition(status, "Degraded")[:2] == ("True", pool.KV_LAYOUT_MISMATCH)


def test_a_claim_not_decided_yet_is_progressing_not_degraded() -> None:
    s = pooled()
    plan, status = run_pass(s, ClaimSeen(PoolClaimStatus()))
    assert plan.router_config.config is not None and plan.router_config.config.pools.prfaas_prefill == []
    assert condition(status, "PoolClaimBound")[:2] == ("False", "Progressing")
    assert condition(status, "Degraded")[0] == "False"


def test_an_unread_claim_keeps_the_last_endpoints_and_share_for_a_bounded_time() -> None:
    s = pooled()
    before, status = run_pass(s, ClaimSeen(bound_status(s)))
    first = before.router_config.config
    assert first is not None
    unread = ClaimSeen(problem=Problem(UNREACHABLE, "the PrfaaS cluster does not answer"))
    cut, cut_status = run_pass(s, unread, first, status, seconds=10)
    kept = cut.router_config.config
    assert kept is not None
    assert [e.name for e in kept.pools.prfaas_prefill] == ["shared-prefill-0", "shared-prefill-1"], (
        "unknown is not zero"
    )
    assert {e.unobserved_since for e in kept.pools.prfaas_prefill} == {
        (WALL_NOW + timedelta(seconds=10)).timestamp()
    }
    assert kept.pool_share == first.pool_share and kept.cache_salt == first.cache_salt
    assert condition(cut_status, "PoolClaimBound")[:2] == ("Unknown", UNREACHABLE)
    keep = s.prefill_cluster.keep_unobserved_endpoints_seconds
    gone, _ = run_pass(s, unread, kept, cut_status, seconds=10 + keep)
    config = gone.router_config.config
    assert config is not None and config.pools.prfaas_prefill == [] and config.pool_share is None


def test_without_a_pool_claim_the_router_config_has_no_salt_nor_share() -> None:
    s = spec()
    assert s.pool_claim is None
    pass_input = PassInput(s, OWNER, 1, PrfaasDeploymentStatus(), Instant(100.0, WALL_NOW))
    slots: dict[str, list[Slot] | None] = {
        role: [] for role in (Role.PD_PREFILL, Role.PD_DECODE, Role.PRFAAS_PREFILL)
    }
    engines = plan_pd_engines(pass_input, {}, slots, OPTIONS)
    assert Role.PRFAAS_PREFILL in engines.revisions
    seen = PrefillClusterSeen(ClusterObservation(), True, [])
    plan = plan_router_and_prefill_cluster(pass_input, engines, seen, local_pods(s), None, None, OPTIONS)
    config = plan.router_config.config
    assert config is not None and config.cache_salt is None and config.pool_share is None
    assert plan.prefill_cluster_manifests, "its own fleet, as before"


def test_a_claim_moved_or_removed_is_retired_and_none_on_a_failure() -> None:
    s = pooled()
    placed = claim_placement(s, OWNER)
    assert placed is not None and (placed.namespace, placed.name) == ("prfaas-pools", "kimi-linear")
    assert placed.kubeconfig_secret_ref == s.prefill_cluster.kubeconfig_secret_ref
    renamed = claim_placement(pooled(claimName="pd-eu-west"), OWNER)
    assert claim_to_delete(placed, placed) is None, "steady"
    assert claim_to_delete(None, placed) is None, "the first claim"
    assert claim_to_delete(placed, renamed) == placed, "renamed: the old one goes"
    assert claim_to_delete(placed, None) == placed, "poolClaim removed: its claim goes"
    applied, failed = ClaimSeen(PoolClaimStatus()), ClaimSeen(problem=Problem(UNREACHABLE, "down"))
    assert claim_in_use(s, OWNER, applied, renamed) == placed
    assert claim_in_use(s, OWNER, failed, renamed) == renamed, "a failure retires nothing"
    assert claim_in_use(spec(), OWNER, None, renamed) is None
