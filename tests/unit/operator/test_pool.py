"""A PrfaasPool and its claims, no cluster: binding, shares, both statuses; and today's
PrfaasDeployment untouched by the pool's API (its engines' revisions are those it had before).

The pool is the sample's PrfaaS side (examples/prfaasdeployment.yaml): 8xH200 instances whose
longest profile point prefills 131072 tokens in 7.40 s, so one instance is 17712 tokens/s and the
pool's floor (minReplicas 1) is 17712 tokens/s.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from prfaas_core.shares import Bound
from prfaas_operator import api, crd
from prfaas_operator.api import PoolClaimSpec, PoolClaimStatus, PoolEndpoint, PrfaasPoolSpec, PrfaasPoolStatus
from prfaas_operator.planning import manifests, pool
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.fingerprint import kv_fingerprint, kv_layout
from prfaas_operator.planning.manifests import Owner
from pydantic import ValidationError
from support.sample_cr import SAMPLE, spec

NOW = "2026-12-07T20:00:00Z"
LATER = "2026-12-07T20:05:00Z"
INSTANCE = 131072 / 7.40
UNSEEN = pool.FleetSeen(ready_replicas=None, endpoints=[])
DEPLOYMENT_ONLY = ("namespace", "kubeconfigSecretRef", "keepUnobservedEndpointsSeconds")


def pool_spec(**prefill: Any) -> PrfaasPoolSpec:
    fleet = {k: v for k, v in SAMPLE["spec"]["prefillCluster"].items() if k not in DEPLOYMENT_ONLY}
    return PrfaasPoolSpec.model_validate({"model": SAMPLE["spec"]["model"], "prefill": {**fleet, **prefill}})


POOL = pool_spec()
LAYOUT = kv_layout(POOL.model).model_dump(by_alias=True)


def claim_spec(**fields: Any) -> PoolClaimSpec:
    raw = {"poolName": "shared", "kvLayout": LAYOUT, "link": {"bandwidthGbps": 100}, **fields}
    return PoolClaimSpec.model_validate(raw)


def seen(name: str, created: str = NOW, *, bound: bool = False, **fields: Any) -> pool.ClaimSeen:
    return pool.ClaimSeen(name, claim_spec(**fields), created, bound)


def accepted(bindings: list[pool.Binding]) -> set[str]:
    return {binding.claim for binding in bindings if binding.accepted}


# ---- the API ------------------------------------------------------------------------------------


def test_a_guarantee_above_the_maximum_and_a_weight_of_zero_are_refused() -> None:
    with pytest.raises(ValidationError, match="must be <= maximumTokensPerSecond 1000"):
        claim_spec(guaranteedTokensPerSecond=2000, maximumTokensPerSecond=1000)
    with pytest.raises(ValidationError, match="greater than 0"):
        claim_spec(weight=0)
    assert claim_spec(guaranteedTokensPerSecond=1000, maximumTokensPerSecond=1000).weight == 1


def test_the_claims_link_is_todays_link_type() -> None:
    assert type(claim_spec().link) is api.LinkSpec
    assert claim_spec().link.budget().budget_bytes_per_second == pytest.approx(100e9 / 8 * 0.8)


def test_todays_prfaasdeployment_renders_the_engines_it_rendered_before_the_pool_api() -> None:
    """Pinned from the commit before the pool's API: a changed revision would roll the engines."""
    s = spec()
    owner = Owner(name="kimi-linear", namespace="prfaas-demo", uid="0f6c7c2e-1111-2222-3333-444455556666")
    fingerprint = kv_fingerprint(s.model)
    revisions = manifests.desired_revisions(s, owner, effective_allocation(s, None).allocation, fingerprint)
    assert fingerprint == "5341646a1aeb"
    assert {role: desired.revision for role, desired in revisions.items()} == {
        "prfaas-prefill": "72e0b79a39",
        "pd-prefill": "df7eb7e4ef",
        "pd-decode": "465a4d1660",
    }


# ---- binding ------------------------------------------------------------------------------------


def test_a_claim_on_an_unknown_pool_is_refused() -> None:
    (binding,) = pool.bind(None, [seen("eu")])
    assert (binding.accepted, binding.reason) == (False, pool.POOL_NOT_FOUND)
    assert "no PrfaasPool shared" in binding.message


@pytest.mark.parametrize(
    ("model_change", "field"),
    [
        ({"extraArgs": ["--page-size", "32"]}, "pageSize '32' against '64'"),
        (
            {"kv": {**SAMPLE["spec"]["model"]["kv"], "dtype": "fp8_e4m3"}},
            "kvCacheDtype 'fp8_e4m3' against 'auto'",
        ),
        ({"image": "lmsysorg/sglang:v0.5.24"}, "image 'lmsysorg/sglang:v0.5.24' against"),
        ({"revision": "r2"}, "revision 'r2' against 'main'"),
    ],
)
def test_a_claim_whose_kv_layout_differs_is_refused_naming_the_field(
    model_change: dict[str, Any], field: str
) -> None:
    theirs = api.ModelSpec.model_validate({**SAMPLE["spec"]["model"], **model_change})
    claim = pool.ClaimSeen(
        "eu", claim_spec(kvLayout=kv_layout(theirs).model_dump(by_alias=True)), NOW, bound=True
    )
    (binding,) = pool.bind(POOL, [claim])
    assert (binding.accepted, binding.reason) == (False, pool.KV_LAYOUT_MISMATCH)
    assert binding.message.startswith(f"kvLayout.{field}")


def test_the_served_model_name_and_tensor_parallelism_do_not_refuse_a_claim() -> None:
    theirs = api.ModelSpec.model_validate(
        {**SAMPLE["spec"]["model"], "servedModelName": "k", "extraArgs": ["--tp", "2"]}
    )
    (binding,) = pool.bind(POOL, [seen("eu", kvLayout=kv_layout(theirs).model_dump(by_alias=True))])
    assert binding.accepted and binding.reason == pool.BOUND


def test_guarantees_over_the_pools_minimum_refuse_the_newer_claim_and_never_unbind_an_older() -> None:
    claims = [
        seen("us", "2026-12-07T10:00:00Z", guaranteedTokensPerSecond=10000),
        seen("eu", "2026-12-07T09:00:00Z", guaranteedTokensPerSecond=8000),
        seen("ap", "2026-12-07T11:00:00Z", guaranteedTokensPerSecond=7000),
    ]
    bindings = pool.bind(POOL, claims)
    assert accepted(bindings) == {"eu", "ap"}  # eu first (8000), us would make 18000 > 17712, ap 15000 fits
    (refused,) = [b for b in bindings if not b.accepted]
    assert (refused.claim, refused.reason) == ("us", pool.GUARANTEES_OVER_CAPACITY)
    assert "10000 on top of 8000" in refused.message and "17712 tokens/s" in refused.message
    # the pool's minimum lowered under what is given: the bound claims keep their binding
    smaller = pool_spec(minReplicas=0, replicas=1)
    again = pool.bind(
        smaller, [pool.ClaimSeen(c.name, c.spec, c.created, c.name in {"eu", "ap"}) for c in claims]
    )
    assert accepted(again) == {"eu", "ap"}
    status = pool.pool_status(
        smaller,
        claims,
        again,
        pool.divide(smaller, claims, again, ready_replicas=1, demands={}),
        ready_replicas=1,
        previous=PrfaasPoolStatus(),
        generation=2,
        now=NOW,
    )
    fit = next(c for c in status.conditions if c.type == pool.GUARANTEES_FIT)
    assert (fit.status, fit.reason) == ("False", "OverMinimum")


claims_strategy = st.lists(st.tuples(st.integers(0, 20000), st.integers(0, 5)), max_size=8)


@settings(max_examples=60, deadline=None)
@given(claims_strategy, st.integers(0, 20000))
def test_accepted_claims_never_overcommit_the_guarantees_and_a_binding_holds(
    raw: list[tuple[int, int]], newcomer: int
) -> None:
    claims = [
        seen(f"c{index}", f"2026-12-07T1{hour}:00:00Z", guaranteedTokensPerSecond=guarantee)
        for index, (guarantee, hour) in enumerate(raw)
    ]
    bindings = pool.bind(POOL, claims)
    given_out = sum(c.spec.guaranteed_tokens_per_second for c in claims if c.name in accepted(bindings))
    assert given_out <= pool.floor_tokens_per_second(POOL)
    # the next pass sees them bound and a newer claim: none of them loses its binding
    next_pass = [pool.ClaimSeen(c.name, c.spec, c.created, c.name in accepted(bindings)) for c in claims]
    next_pass.append(seen("new", "2026-12-08T00:00:00Z", guaranteedTokensPerSecond=newcomer))
    rebound = pool.bind(POOL, next_pass)
    assert accepted(bindings) <= accepted(rebound)
    assert sum(c.spec.guaranteed_tokens_per_second for c in next_pass if c.name in accepted(rebound)) <= max(
        pool.floor_tokens_per_second(POOL), given_out
    )


# ---- the statuses -------------------------------------------------------------------------------


def test_the_pool_divides_its_ready_capacity_by_weight_and_lists_the_refused() -> None:
    claims = [
        seen("eu", weight=1),
        seen("us", weight=3),
        seen("bad", kvLayout={**LAYOUT, "pageSize": "32"}),
    ]
    bindings = pool.bind(POOL, claims)
    division = pool.divide(POOL, claims, bindings, ready_replicas=4, demands={})
    status = pool.pool_status(
        POOL, claims, bindings, division, ready_replicas=4, previous=PrfaasPoolStatus(), generation=3, now=NOW
    )
    assert status.capacity_tokens_per_second == math.floor(4 * INSTANCE)
    assert status.fingerprint == "5341646a1aeb"
    shares = {c.claim: c for c in status.consumers}
    assert set(shares) == {"eu", "us"}
    assert shares["us"].tokens_per_second == pytest.approx(3 * shares["eu"].tokens_per_second, abs=3)
    # whole tokens/s rounded down: the published shares never add up to more than the pool
    assert 4 * INSTANCE - 2 <= shares["eu"].tokens_per_second + shares["us"].tokens_per_second <= 4 * INSTANCE
    assert status.shares == f"eu={shares['eu'].tokens_per_second} us={shares['us'].tokens_per_second}"
    assert shares["eu"].bound is Bound.WEIGHT
    assert [(r.claim, r.reason) for r in status.refused] == [("bad", pool.KV_LAYOUT_MISMATCH)]
    ready = next(c for c in status.conditions if c.type == pool.READY)
    assert (ready.status, ready.observed_generation) == ("True", 3)


def test_a_consumer_that_asks_less_lends_the_rest_and_unknown_demand_asks_for_all() -> None:
    claims = [seen("eu"), seen("us")]
    bindings = pool.bind(POOL, claims)
    division = pool.divide(POOL, claims, bindings, ready_replicas=2, demands={"eu": 1000})
    assert division.share("eu").tokens_per_second == pytest.approx(1000)
    assert division.share("eu").bound is Bound.DEMAND
    assert division.share("us").tokens_per_second == pytest.approx(2 * INSTANCE - 1000)
    assert division.share("eu").entitled_tokens_per_second == pytest.approx(INSTANCE)


def test_a_bound_claim_gets_its_share_and_the_endpoints_a_refused_one_only_why() -> None:
    claims = [seen("eu", maximumTokensPerSecond=5000), seen("bad", kvLayout={**LAYOUT, "revision": "r2"})]
    bindings = pool.bind(POOL, claims)
    division = pool.divide(POOL, claims, bindings, ready_replicas=1, demands={})
    endpoints = [
        PoolEndpoint(name="shared-prfaas-prefill-0", url="http://10.0.0.5:30000", bootstrap_port=8998)
    ]
    good, bad = (
        pool.claim_status(
            claim,
            binding,
            division,
            pool_fingerprint="5341646a1aeb",
            endpoints=endpoints,
            previous=PoolClaimStatus(),
            generation=1,
            now=NOW,
        )
        for claim, binding in zip(claims, bindings, strict=True)
    )
    assert good.share is not None and good.share.tokens_per_second == pytest.approx(5000)
    assert good.share.bound is Bound.MAXIMUM
    assert good.unclaimed_tokens_per_second == math.floor(INSTANCE - 5000)
    assert good.endpoints == endpoints
    assert [(c.type, c.status, c.reason) for c in good.conditions] == [("Bound", "True", "Bound")]
    assert bad.share is None and bad.endpoints == [] and bad.unclaimed_tokens_per_second == 0
    (refused,) = bad.conditions
    assert (refused.status, refused.reason) == ("False", pool.KV_LAYOUT_MISMATCH)
    assert refused.message == "kvLayout.revision 'r2' against 'main' (claim against pool)"
    # the condition's transition time moves only when its status does
    later = pool.claim_status(
        claims[0],
        bindings[0],
        division,
        pool_fingerprint=None,
        endpoints=[],
        previous=good,
        generation=2,
        now=LATER,
    )
    assert later.conditions[0].last_transition_time == NOW
    unknown = pool.claim_status(
        claims[0],
        pool.bind(None, claims[:1])[0],
        None,
        pool_fingerprint=None,
        endpoints=endpoints,
        previous=good,
        generation=2,
        now=LATER,
    )
    assert unknown.share is None and unknown.endpoints == []
    assert (unknown.conditions[0].reason, unknown.conditions[0].last_transition_time) == (
        pool.POOL_NOT_FOUND,
        LATER,
    )


def test_no_claims_leave_the_whole_pool_unclaimed() -> None:
    division = pool.divide(POOL, [], [], ready_replicas=3, demands={})
    assert division.unclaimed_tokens_per_second == pytest.approx(3 * INSTANCE)
    assert math.isclose(pool.instance_tokens_per_second(POOL.prefill.prefill_profile), INSTANCE)


def test_the_example_pool_binds_its_claim() -> None:
    example_pool, example_claim = yaml.safe_load_all(
        (crd.repository_root() / "examples/prfaaspool.yaml").read_text()
    )
    resource = api.PrfaasPoolClaim.model_validate(example_claim)
    pool_resource = api.PrfaasPool.model_validate(example_pool)
    (binding,) = pool.bind(pool_resource.spec, [pool.ClaimSeen("pd-eu-west", resource.spec, NOW)])
    assert binding.accepted, binding.message


def test_a_consumers_role_names_its_claim_and_nothing_else() -> None:
    subject = {"kind": "User", "name": "pd-eu-west"}
    role, binding = pool.claim_access("pd-eu-west", "prfaas-pools", subject)
    (rule,) = role["rules"]
    assert (rule["resources"], rule["resourceNames"]) == (["prfaaspoolclaims"], ["pd-eu-west"])
    assert "update" not in rule["verbs"] and "deletecollection" not in rule["verbs"]
    assert binding["subjects"] == [subject] and binding["roleRef"]["name"] == role["metadata"]["name"]


def test_a_deleted_pool_waits_for_its_bound_claims_only() -> None:
    claims = [seen("us"), seen("eu"), seen("odd", kvLayout={**LAYOUT, "revision": "r2"})]
    held = pool.holding_deletion(pool.bind(POOL, claims))
    assert held == "deletion waits for the bound claims to be deleted: eu, us"
    assert pool.holding_deletion(pool.bind(POOL, claims[2:])) is None


# ---- one pass of the pool controller ------------------------------------------------------------


def pool_object(*, deleting: bool = False, finalizers: tuple[str, ...] = ()) -> api.PrfaasPool:
    metadata: dict[str, Any] = {"name": "shared", "generation": 1, "finalizers": list(finalizers)}
    if deleting:
        metadata["deletionTimestamp"] = NOW
    return api.PrfaasPool(metadata=metadata, spec=POOL)


def claim_object(
    name: str, created: str = NOW, status: PoolClaimStatus | None = None, **fields: Any
) -> api.PrfaasPoolClaim:
    return api.PrfaasPoolClaim(
        metadata={"name": name, "creationTimestamp": created, "generation": 1},
        spec=claim_spec(**fields),
        status=status or PoolClaimStatus(),
    )


def test_unobserved_instances_count_as_the_profiles_floor_never_as_zero() -> None:
    assert pool.capacity_tokens_per_second(POOL, None) == pytest.approx(pool.floor_tokens_per_second(POOL))
    assert pool.capacity_tokens_per_second(POOL, 0) == pytest.approx(pool.floor_tokens_per_second(POOL))
    passed = pool.pool_pass(pool_object(), [claim_object("eu")], fleet=UNSEEN, now=NOW)
    assert passed.pool_status is not None
    assert passed.pool_status.capacity_tokens_per_second == math.floor(INSTANCE) > 0
    ready = next(c for c in passed.pool_status.conditions if c.type == pool.READY)
    assert (ready.status, ready.reason) == ("False", pool.CAPACITY_FROM_PROFILE)
    assert "assumed from prefillProfile at minReplicas (1 instances)" in ready.message
    assert passed.claim_statuses["eu"].share is not None
    assert passed.claim_statuses["eu"].share.tokens_per_second == math.floor(INSTANCE)


def test_a_pass_writes_only_what_changed_and_keeps_a_binding() -> None:
    claims = [claim_object("eu", guaranteedTokensPerSecond=10000)]
    first = pool.pool_pass(pool_object(), claims, fleet=UNSEEN, now=NOW)
    assert first.finalizers == [pool.POOL_PROTECTION_FINALIZER] and first.pool_status is not None
    kept = api.PrfaasPool(
        metadata={**pool_object().metadata, "finalizers": first.finalizers},
        spec=POOL,
        status=first.pool_status,
    )
    written = [claim_object("eu", status=first.claim_statuses["eu"], guaranteedTokensPerSecond=10000)]
    again = pool.pool_pass(kept, written, fleet=UNSEEN, now=LATER)
    assert again == pool.PoolPass(pool_status=None, claim_statuses={}, finalizers=None)
    # a newer claim whose guarantee no longer fits is refused; the older keeps its binding
    newer = claim_object("us", LATER, guaranteedTokensPerSecond=10000)
    third = pool.pool_pass(kept, [newer, *written], fleet=UNSEEN, now=LATER)
    assert set(third.claim_statuses) == {"us"}
    assert third.claim_statuses["us"].conditions[0].reason == pool.GUARANTEES_OVER_CAPACITY


def test_a_deleted_pool_keeps_its_finalizer_while_a_claim_is_bound_then_lets_go() -> None:
    protected = (pool.POOL_PROTECTION_FINALIZER, "other")
    first = pool.pool_pass(pool_object(), [claim_object("eu")], fleet=UNSEEN, now=NOW)
    bound = claim_object("eu", status=first.claim_statuses["eu"])
    held = pool.pool_pass(pool_object(deleting=True, finalizers=protected), [bound], fleet=UNSEEN, now=NOW)
    assert held.finalizers is None and held.pool_status is not None
    condition = next(c for c in held.pool_status.conditions if c.type == pool.DELETION_HELD)
    assert condition.message == "deletion waits for the bound claims to be deleted: eu"
    gone = pool.pool_pass(pool_object(deleting=True, finalizers=protected), [], fleet=UNSEEN, now=NOW)
    assert gone.finalizers == ["other"]
    assert pool.pool_finalizers([], deleting=True, holding=None) is None


def test_claims_of_a_missing_pool_are_refused_pool_not_found() -> None:
    passed = pool.pool_pass(None, [claim_object("eu")], fleet=UNSEEN, now=NOW)
    assert passed.pool_status is None and passed.finalizers is None
    assert passed.claim_statuses["eu"].conditions[0].reason == pool.POOL_NOT_FOUND
    assert passed.claim_statuses["eu"].share is None
