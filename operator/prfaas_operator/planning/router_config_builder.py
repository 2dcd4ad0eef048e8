"""The router config the operator writes: spec + allocation + the ready endpoints it observed (pure).

Endpoints are taken from the pods the reconcile saw in both clusters, all of one KV fingerprint
(choose_pools), so the router never pairs engines that lay the KV cache out differently; the
version is bumped only when the content changes.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from prfaas_core.router_config import (
    CachePool,
    DecodeCapacity,
    Endpoint,
    Pools,
    PoolShare,
    RouterConfig,
    Slo,
    fitted_prefill_time,
)
from prfaas_core.vocabulary import Pool, Role

from prfaas_operator.api import Allocation, PrfaasDeploymentSpec
from prfaas_operator.planning.status import PodInfo

DEFAULT_CHARS_PER_TOKEN = 4.0


def base_url(ip: str, port: int) -> str:
    """`http://IP:PORT` of a pod (IPv6 in brackets)."""
    host = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    return f"http://{host}:{port}"


def ready_endpoints(
    pods: Iterable[PodInfo], role: str, port: int, bootstrap_port: int | None
) -> list[Endpoint]:
    """Endpoints of the pods of `role` that are ready, addressed and not being deleted, by name,
    each with its KV fingerprint; of a multi-node instance, its leader only."""
    return [
        Endpoint(
            name=pod.name,
            url=base_url(pod.ip, port),
            bootstrap_port=bootstrap_port,
            fingerprint=pod.fingerprint or "",
        )
        for pod in sorted(pods, key=lambda p: p.name)
        if pod.role == role and pod.ready and pod.ip and not pod.deleting and not pod.group_worker
    ]


@dataclass(frozen=True)
class PoolChoice:
    """The endpoints the router gets (of every KV layout that can serve), the fingerprint the
    config names, and a note while more than one layout serves or the desired one cannot yet."""

    pools: Pools
    fingerprint: str
    note: str | None = None


def choose_pools(
    spec: PrfaasDeploymentSpec,
    desired_fingerprint: str,
    prefill_cluster_pods: Sequence[PodInfo] | None,
    pd_cluster_pods: Sequence[PodInfo],
) -> PoolChoice:
    """Ready endpoints of every KV layout that has a ready prefill and a ready decode.

    The router pairs within a layout only (policy.decide), so during a rollout that changes the
    layout both the old and the new one serve, and traffic moves to the new one as its pods
    become ready; a layout with prefills and no decode (or the reverse) is left out, since none
    of its engines could serve a request. `prefill_cluster_pods` is None when the PrfaaS cluster
    could not be listed: its endpoints come from the last config for a while (keep_unobserved).
    """
    pc, pd = spec.prefill_cluster, spec.pd_cluster
    remote = list(prefill_cluster_pods or [])

    def pools_of(fingerprint: str) -> Pools:
        def mine(pods: Sequence[PodInfo]) -> list[PodInfo]:
            return [p for p in pods if p.fingerprint == fingerprint]

        return Pools(
            prfaas_prefill=ready_endpoints(mine(remote), Role.PRFAAS_PREFILL, pc.port, pc.bootstrap_port),
            local_prefill=ready_endpoints(mine(pd_cluster_pods), Role.PD_PREFILL, pd.port, pd.bootstrap_port),
            decode=ready_endpoints(mine(pd_cluster_pods), Role.PD_DECODE, pd.port, None),
        )

    def serviceable(pools: Pools) -> bool:
        return bool(pools.decode) and bool(pools.prfaas_prefill or pools.local_prefill)

    found = sorted({p.fingerprint for p in [*remote, *pd_cluster_pods] if p.ready and p.fingerprint})
    serving = {fingerprint: pools for fingerprint in found if serviceable(pools := pools_of(fingerprint))}
    if not serving:
        return PoolChoice(pools_of(desired_fingerprint), desired_fingerprint)
    others = sorted(set(serving) - {desired_fingerprint})
    merged = Pools(**{pool.value: [e for pools in serving.values() for e in pools.of(pool)] for pool in Pool})
    if desired_fingerprint not in serving:
        note = (
            f"serving KV fingerprint(s) {', '.join(others)} until {desired_fingerprint} has a ready prefill "
            "and a ready decode (layout rollout in progress)"
        )
        return PoolChoice(merged, desired_fingerprint, note)
    if others:
        note = (
            f"serving KV fingerprints {desired_fingerprint} and {', '.join(others)} side by side, each "
            "prefill paired with a decode of its own (layout rollout in progress)"
        )
        return PoolChoice(merged, desired_fingerprint, note)
    return PoolChoice(merged, desired_fingerprint)


def keep_unobserved(
    choice: PoolChoice, last: RouterConfig | None, now: float, keep_seconds: float
) -> PoolChoice:
    """The choice made without the PrfaaS cluster, with the PrfaaS prefill endpoints of the last
    config for at most `keep_seconds` after they were last observed (`now`, unix seconds).

    An apiserver outage stops nothing in its cluster: the engines keep serving, and dropping them
    would send every long prompt to the local prefills. But a pod may go and its IP be given to
    another, so each kept endpoint says since when it is unobserved, and the router routes there
    only while the engine at that address is the one listed (prfaas_core.routing.identity). Only
    endpoints of a KV layout that still has a decode listed are kept; the bound counts from the
    first pass that could not observe them, and survives a restart (it is in the config).
    """
    if last is None or keep_seconds <= 0:
        return choice
    decodes = {endpoint.fingerprint for endpoint in choice.pools.decode}
    since = {
        endpoint.name: now if endpoint.unobserved_since is None else endpoint.unobserved_since
        for endpoint in last.pools.prfaas_prefill
        if endpoint.fingerprint in decodes
    }
    within = {name: at for name, at in since.items() if now - at < keep_seconds}
    if not within:
        return choice
    kept = [
        endpoint.model_copy(update={"unobserved_since": within[endpoint.name]})
        for endpoint in last.pools.prfaas_prefill
        if endpoint.name in within
    ]
    oldest = min(within.values())
    note = (
        f"the PrfaaS cluster is not observed: {len(kept)} PrfaaS prefill endpoint(s) kept from the last "
        f"observation {now - oldest:.0f}s ago, for at most {keep_seconds:.0f}s, each routed to only while its "
        "engine answers as the one listed"
    )
    pools = choice.pools.model_copy(update={"prfaas_prefill": kept})
    return PoolChoice(pools, choice.fingerprint, "; ".join(filter(None, (choice.note, note))))


def decode_capacity(
    spec: PrfaasDeploymentSpec, measured_output_tokens: float | None, measured_output_cv: float | None = None
) -> DecodeCapacity | None:
    """What a decode slot holds a request for: BS_max and mean output x step time (None: unknown),
    and how widely outputs spread (the router's decode-wait P90 widens with it; 0 until measured).

    The planner's measured mean output wins over the spec's expectation; both measurements are
    rounded to two significant digits so that a new one every planner tick does not rewrite the config.
    """
    tokens = measured_output_tokens or spec.routing.expected_output_tokens
    if not tokens or not math.isfinite(tokens):
        return None
    cv = measured_output_cv if measured_output_cv is not None and 0 <= measured_output_cv <= 1000 else 0.0
    pd = spec.pd_cluster
    return DecodeCapacity(
        max_running_requests=pd.max_decode_batch,
        seconds_per_request=float(f"{tokens:.2g}") * pd.decode_step_seconds,
        output_tokens_cv=float(f"{cv:.2g}"),
    )


def build_router_config(
    spec: PrfaasDeploymentSpec,
    allocation: Allocation,
    choice: PoolChoice,
    previous: RouterConfig | None,
    min_version: int = 0,
    *,
    measured_output_tokens: float | None = None,
    measured_output_cv: float | None = None,
    cache_pools: Mapping[str, CachePool] | None = None,
    cache_salt: str | None = None,
    pool_share: PoolShare | None = None,
) -> RouterConfig:
    """The router config for this allocation and these endpoints; raises ProfileError on a refused fit.

    `cache_salt`: the consumer's namespace in the engines' prefix caches, for a PrfaaS pool that
    several PD clusters share; a PrfaasDeployment's pool serves it alone and has none.
    `pool_share`: its share of that shared pool, as its claim's status publishes it.

    The version is bumped only when the content changes, and never falls below `min_version`
    (the last version recorded in status), so a recreated ConfigMap is not older than what
    the router already runs.
    """
    candidate = RouterConfig(
        version=0,
        served_model_name=spec.model.served_model_name,
        threshold_tokens=allocation.threshold_tokens,
        block_size_tokens=spec.routing.block_size,
        bandwidth_mode=spec.routing.bandwidth_mode.value,
        chars_per_token=DEFAULT_CHARS_PER_TOKEN,
        session_affinity_header=spec.routing.session_affinity_header,
        router_replicas=spec.router.replicas,
        link=spec.link.budget(),
        kv_size=spec.model.kv.size(),
        prefill_time={
            "prfaas": fitted_prefill_time(spec.prefill_cluster.prefill_profile),
            "local": fitted_prefill_time(spec.pd_cluster.prefill_profile),
        },
        slo=Slo(ttft_seconds=spec.slo.ttft_seconds, tpot_seconds=spec.slo.tpot_seconds),
        decode=decode_capacity(spec, measured_output_tokens, measured_output_cv),
        pools=choice.pools,
        fingerprint=choice.fingerprint,
        cache_pools=dict(cache_pools or {}),
        decode_radix_cache=spec.prefix_cache.decode_radix_cache,
        cache_salt=cache_salt,
        pool_share=pool_share,
    )
    unchanged = (
        previous is not None and candidate.model_copy(update={"version": previous.version}) == previous
    )
    if previous is not None and unchanged and previous.version >= min_version:
        return previous
    floor = max(previous.version if previous is not None else 0, min_version)
    return candidate.model_copy(update={"version": floor + 1})


def endpoint_counts(config: RouterConfig) -> dict[str, int]:
    return {pool.value: len(config.pools.of(pool)) for pool in Pool}
