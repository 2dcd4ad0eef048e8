"""The consumer's side of a shared PrfaaS pool (pure): the PrfaasPoolClaim a PrfaasDeployment with
spec.poolClaim writes beside the pool, what its status says, and what the router gets from it.

The claim is the consumer's only object in the PrfaaS cluster (its identity there may write that
one claim and read it back, nothing else: pool.claim_access), so everything of the pool reaches
the router through the claim's status: its endpoints, its share, what is unclaimed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prfaas_core.router_config import Endpoint, PoolShare, RouterConfig
from prfaas_core.vocabulary import API_VERSION, CLAIM_KIND, LABEL_MANAGED_BY, LABEL_OWNER, MANAGER

from prfaas_operator.api import (
    PoolClaimPlacement,
    PoolClaimRef,
    PoolClaimSpec,
    PoolClaimStatus,
    PrfaasDeploymentSpec,
)
from prfaas_operator.planning.fingerprint import kv_layout
from prfaas_operator.planning.manifests import Owner, label_value
from prfaas_operator.planning.pool import BOUND
from prfaas_operator.planning.router_config_builder import PoolChoice, keep_unobserved
from prfaas_operator.planning.status import PROGRESSING, ClaimBinding, Problem


def claim_name(ref: PoolClaimRef, owner: Owner) -> str:
    """spec.poolClaim.claimName, else the PrfaasDeployment's name: the name the platform team's Role
    for this consumer pins (pool.claim_access)."""
    return ref.claim_name or owner.name


def cache_salt(ref: PoolClaimRef, owner: Owner) -> str:
    """The consumer's namespace in the pool's prefix caches: its claim's namespace and name. Unique
    among the pool's consumers (one name per namespace, and a pool's engines serve only the claims
    beside it), stable while the claim lives, and nothing secret goes in (the salt travels with
    every request)."""
    return f"prfaas-claim/{ref.namespace}/{claim_name(ref, owner)}"


def claim_manifest(spec: PrfaasDeploymentSpec, ref: PoolClaimRef, owner: Owner) -> dict[str, Any]:
    """The claim, for a server-side apply: kvLayout from spec.model by the function the engines'
    fingerprint hashes (so the pool compares what the decodes run), link from spec.link."""
    claim = PoolClaimSpec(
        pool_name=ref.pool_name,
        kv_layout=kv_layout(spec.model),
        link=spec.link,
        weight=ref.weight,
        guaranteed_tokens_per_second=ref.guaranteed_tokens_per_second,
        maximum_tokens_per_second=ref.maximum_tokens_per_second,
    )
    return {
        "apiVersion": API_VERSION,
        "kind": CLAIM_KIND,
        "metadata": {
            "name": claim_name(ref, owner),
            "namespace": ref.namespace,
            "labels": {LABEL_MANAGED_BY: MANAGER, LABEL_OWNER: label_value(owner.key)},
        },
        "spec": claim.model_dump(by_alias=True, mode="json", exclude_none=True),
    }


def claim_placement(spec: PrfaasDeploymentSpec, owner: Owner) -> PoolClaimPlacement | None:
    """Where spec.poolClaim's claim goes (None: no poolClaim): the Secret, the namespace, the name."""
    ref = spec.pool_claim
    if ref is None:
        return None
    return PoolClaimPlacement(
        kubeconfig_secret_ref=spec.prefill_cluster.kubeconfig_secret_ref,
        namespace=ref.namespace,
        name=claim_name(ref, owner),
    )


def claim_to_delete(
    placed: PoolClaimPlacement | None, now: PoolClaimPlacement | None
) -> PoolClaimPlacement | None:
    """The claim this CR wrote and no longer wants: the one last applied, once spec.poolClaim points
    elsewhere (`now`) or is gone (`now` None). Its share would otherwise stay taken from the pool."""
    return placed if placed is not None and placed != now else None


@dataclass(frozen=True)
class ClaimSeen:
    """The claim as this pass read it back: its status, or why it could not be read (unknown)."""

    status: PoolClaimStatus | None = None
    problem: Problem | None = None


def claim_in_use(
    spec: PrfaasDeploymentSpec, owner: Owner, seen: ClaimSeen | None, placed: PoolClaimPlacement | None
) -> PoolClaimPlacement | None:
    """The claim this CR uses now (`seen`: spec.poolClaim's as this pass applied it, None without
    one): spec's once applied; the one last applied (`placed`) while the PrfaaS cluster fails, so
    nothing is retired on a failure; None without poolClaim."""
    if seen is None:
        return None
    return claim_placement(spec, owner) if seen.problem is None else placed


def binding(seen: ClaimSeen) -> ClaimBinding:
    """The claim's Bound condition as the PrfaasDeployment tells it (condition PoolClaimBound):
    unknown while unread, Progressing until the pool's controller decides, else its verdict."""
    if seen.status is None:
        why = seen.problem.message if seen.problem is not None else "not read yet"
        return ClaimBinding(
            None, seen.problem.reason if seen.problem else PROGRESSING, f"claim not read: {why}"
        )
    bound = next((c for c in seen.status.conditions if c.type == BOUND), None)
    if bound is None or bound.status == "Unknown":
        return ClaimBinding(False, PROGRESSING, "the claim waits for the pool's controller to decide it")
    if bound.status != "True":
        return ClaimBinding(False, bound.reason, bound.message)
    share = seen.status.share
    figures = (
        f"share {share.tokens_per_second} tokens/s ({share.reason})" if share is not None else "no share"
    )
    endpoints = len(seen.status.endpoints)
    return ClaimBinding(
        True, bound.reason, f"{bound.message}; {figures}; {endpoints} prefill endpoint(s)", endpoints
    )


def pool_share(status: PoolClaimStatus) -> PoolShare | None:
    """What the router offloads within: the claim's share, its entitlement and what is unclaimed."""
    share = status.share
    if share is None:
        return None
    return PoolShare(
        tokens_per_second=share.tokens_per_second,
        entitled_tokens_per_second=share.entitled_tokens_per_second,
        unclaimed_tokens_per_second=status.unclaimed_tokens_per_second,
    )


def claim_pools(
    choice: PoolChoice, seen: ClaimSeen, last: RouterConfig | None, now: float, keep_seconds: float
) -> tuple[PoolChoice, PoolShare | None]:
    """The router's PrfaaS prefill endpoints and share from the claim (`choice` made without any).

    Bound: the claim's endpoints, each of the pool's fingerprint (the router pairs them only with
    decodes of that layout), and its share. Unbound or refused: none (every prompt prefills
    locally). Unread (the PrfaaS cluster unreachable): unknown is not zero, the last config's
    endpoints and share are kept as for a dedicated fleet not observed (keep_unobserved), for at
    most `keep_seconds`, each routed to only while its engine answers as the one listed.
    """
    if seen.status is None:
        kept = keep_unobserved(choice, last, now, keep_seconds)
        share = last.pool_share if last is not None and kept.pools.prfaas_prefill else None
        return kept, share
    if not binding(seen).ok:
        return choice, None
    fingerprint = seen.status.pool_fingerprint or ""
    endpoints = [
        Endpoint(name=e.name, url=e.url, bootstrap_port=e.bootstrap_port, fingerprint=fingerprint)
        for e in sorted(seen.status.endpoints, key=lambda e: e.name)
    ]
    pools = choice.pools.model_copy(update={"prfaas_prefill": endpoints})
    return PoolChoice(pools, choice.fingerprint, choice.note), pool_share(seen.status)
