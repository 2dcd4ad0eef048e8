"""Router replicas on the testbed: one link budget between them, and a rolling update that loses nothing.

One PrfaasDeployment with three router replicas, containers on the PD cluster's real node, behind
their Service; traffic goes to the Service's ClusterIP, so kube-proxy picks a replica for each
new connection, as it does for a platform team's clients. The link is narrow (1.5 Gbit/s, shaped
by the runner from the CR) so that long prompts really contend for it:

1. bursts of long prompts: the replicas together never commit more KV bytes to the link than
   its budget carries in one TTFT SLO; the bursts press on it (offloads turned away for want of
   budget); what the routers count as sent is what crossed the shaped link;
2. a rolling update of the router during traffic: each old pod drains through its preStop hook
   while the new ones take over, and no request fails.
"""

from __future__ import annotations

import math
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import pytest
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Pod, Service
from live_traffic import (
    E2E_TIME_SCALE,
    BackgroundTraffic,
    container_pods,
    link_counters,
    pd_kubectl,
    pd_real_node,
)
from prfaas_core.trace import TRACE_BLOCK_TOKENS
from prfaas_core.vocabulary import LABEL_ROLE
from prfaas_testbed.system import LiveSystem, customise_cr, load_sample_cr, wait_until
from prfaas_testbed.traffic import PlannedRequest, lognormal_requests
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.e2e, pytest.mark.testbed, pytest.mark.prometheus, pytest.mark.timeout(600)]

E2E_NAME = "prfaas-ha"
CR_NAME = "ha"
REPLICAS = 3
NARROW_GBPS = 1.5
"""Horizon 4.5 GB at 0.8 headroom and a 30 s SLO: each replica's share holds one 48K-token prompt's KV."""
LONG_TOKENS = 48_000


@pytest.fixture(scope="module")
def replicated(live_system: LiveSystem) -> LiveSystem:
    pd_real_node(live_system)
    cr = customise_cr(load_sample_cr(), live_system.layout, name=CR_NAME)
    spec = cr["spec"]
    spec["router"]["replicas"] = REPLICAS
    spec["link"]["bandwidthGbps"] = NARROW_GBPS
    spec["prefillCluster"].update(replicas=2, minReplicas=1, maxReplicas=3)
    spec["pdCluster"].update(instances=4, prefillInstances=2, decodeInstances=2)
    live_system.apply(cr)
    live_system.wait_ready(150)
    wait_until(f"{REPLICAS} routers ready", lambda: len(ready_routers(live_system)) == REPLICAS, 120)
    return live_system


def ready_routers(system: LiveSystem) -> list[dict[str, object]]:
    return [
        p
        for p in system.runner_pods(kind="router", namespace=system.layout.deployment_namespace)
        if p.get("state") == "container" and p.get("ready")
    ]


def router_pods(system: LiveSystem) -> set[str]:
    """Every pod of the router Deployment the PD cluster still has, terminating ones included (the
    kubelet removes a pod once its container stopped; the runner stops listing it when it goes)."""
    pods = system.pd.list(Pod, namespace=system.layout.deployment_namespace, labels={LABEL_ROLE: "router"})
    return {str(pod.metadata.name) for pod in pods if pod.metadata is not None}


def service_url(system: LiveSystem) -> str:
    """The router Service's ClusterIP: kube-proxy on the PD node spreads connections over the replicas."""
    service = system.pd.get(Service, f"{CR_NAME}-router", namespace=system.layout.deployment_namespace)
    assert service.spec is not None and service.spec.clusterIP and service.spec.ports
    port = next(p.port for p in service.spec.ports if p.name == "http")
    return f"http://{service.spec.clusterIP}:{port}"


def router_metrics(ip: object) -> dict[str, float]:
    """The link gauges and counters of one router replica, summed over their labels."""
    with urllib.request.urlopen(f"http://{ip}:8000/metrics", timeout=2) as reply:
        text = reply.read().decode()
    wanted = {
        "prfaas_router_link_inflight_bytes": "inflight",
        "prfaas_router_link_horizon_bytes": "horizon",
        "prfaas_router_kv_egress_bytes_total": "egress",
    }
    found = {"inflight": 0.0, "horizon": 0.0, "egress": 0.0, "link_budget": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                found[wanted[sample.name]] += sample.value
            elif (
                sample.name == "prfaas_router_decisions_total"
                and sample.labels.get("reason") == "link_budget"
            ):
                found["link_budget"] += sample.value
    return found


@dataclass
class LinkSampler:
    """Reads every replica's bytes in flight five times a second, in a thread, while traffic runs."""

    ips: list[object]
    peak_total: float = 0.0
    peak_each: dict[object, float] = field(default_factory=dict)
    samples: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                inflight = {ip: router_metrics(ip)["inflight"] for ip in self.ips}
            except OSError as err:
                self.errors.append(str(err))
                continue
            self.samples += 1
            self.peak_total = max(self.peak_total, sum(inflight.values()))
            for ip, value in inflight.items():
                self.peak_each[ip] = max(self.peak_each.get(ip, 0.0), value)

    def __enter__(self) -> LinkSampler:
        self._thread = threading.Thread(target=self._run, name="link-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def long_prompt_bursts(bursts: int, size: int, gap_s: float) -> list[PlannedRequest]:
    """`bursts` bursts of `size` unshared 48K-token prompts, 50 ms apart within a burst."""
    blocks = math.ceil(LONG_TOKENS / TRACE_BLOCK_TOKENS)
    plan = []
    for n in range(bursts * size):
        burst, k = divmod(n, size)
        first = 30_000_000 + n * blocks
        plan.append(
            PlannedRequest(
                burst * gap_s + k * 0.05, "burst", LONG_TOKENS, 16, tuple(range(first, first + blocks))
            )
        )
    return plan


def test_three_replicas_under_long_prompt_bursts_stay_within_the_link_budget_together(
    replicated: LiveSystem,
) -> None:
    system = replicated
    config = system.router_config()
    assert config is not None and config["router_replicas"] == REPLICAS
    horizon = (
        config["link"]["bandwidth_bytes_per_second"]
        * config["link"]["headroom"]
        * config["slo"]["ttft_seconds"]
    )
    ips = [pod["ip"] for pod in ready_routers(system)]
    before = {ip: router_metrics(ip) for ip in ips}
    assert sum(m["horizon"] for m in before.values()) == pytest.approx(horizon, rel=1e-9)
    link = system.testbed.link
    crossed_before = link_counters(link)["bytes"] if link is not None else 0

    with (
        LinkSampler(ips) as sampler,
        BackgroundTraffic(service_url(system), "kimi-linear", long_prompt_bursts(4, 8, 15.0)) as traffic,
    ):
        driver = traffic.wait(240)
    after = {ip: router_metrics(ip) for ip in ips}

    outcomes = [r.outcome for r in driver.results]
    failures = [r.error for r in driver.results if r.outcome not in ("ok", "rejected")]
    turned_away = sum(after[ip]["link_budget"] - before[ip]["link_budget"] for ip in ips)
    offloaded = sum(after[ip]["egress"] - before[ip]["egress"] for ip in ips)
    crossed = link_counters(link)["bytes"] - crossed_before if link is not None else None
    print(
        f"horizon {horizon / 1e9:.2f} GB; peak committed by {REPLICAS} replicas together "
        f"{sampler.peak_total / 1e9:.2f} GB ({sampler.peak_total / horizon:.0%}), each at most "
        f"{max(sampler.peak_each.values(), default=0) / 1e9:.2f} GB, {sampler.samples} samples; "
        f"{turned_away:.0f} offloads kept local for want of budget; {offloaded / 1e9:.1f} GB offloaded, "
        f"{crossed} bytes crossed the link; {outcomes.count('ok')} served, {outcomes.count('rejected')} "
        f"rejected (429) of {len(outcomes)}"
    )
    assert not failures, failures
    assert outcomes.count("ok") >= len(outcomes) / 2, outcomes
    assert sampler.samples >= 100 and not sampler.errors[:1], (sampler.samples, sampler.errors[:3])
    # every replica kept to its share, and so all of them to the budget
    for ip, peak in sampler.peak_each.items():
        assert peak <= before[ip]["horizon"] * (1 + 1e-9), (ip, peak, before[ip]["horizon"])
    assert sampler.peak_total <= horizon * (1 + 1e-9), (sampler.peak_total, horizon)
    # ...while the bursts pressed on it: more than one share in flight at once, offloads turned away
    assert sampler.peak_total > horizon / REPLICAS, (sampler.peak_total, horizon)
    assert turned_away >= 1
    assert offloaded > 0
    if crossed is not None:  # what the routers counted as sent is what crossed the shaped link
        assert crossed >= 0.9 * offloaded * system.scales.kv_scale, (crossed, offloaded)


def rollout_done(system: LiveSystem, old_pods: set[str]) -> bool:
    deployment = system.pd.get(Deployment, f"{CR_NAME}-router", namespace=system.layout.deployment_namespace)
    status = deployment.status
    pods = {str(p["pod"]) for p in ready_routers(system)}
    return (
        status is not None
        and status.updatedReplicas == REPLICAS
        and status.readyReplicas == REPLICAS
        and (status.replicas or 0) == REPLICAS
        and len(pods) == REPLICAS
        and not pods & old_pods
    )


def rollout_done_keeping_logs(system: LiveSystem, old_pods: set[str]) -> bool:
    """`rollout_done`, copying the routers' logs first: the old pods' go with them, and a lost
    request is explained by the log of the replica that answered it."""
    system.keep_container_logs()
    return rollout_done(system, old_pods)


def test_a_router_rolling_update_during_traffic_loses_no_request(replicated: LiveSystem) -> None:
    system = replicated
    old_pods = {str(p["pod"]) for p in container_pods(system, "router", REPLICAS)}
    plan = lognormal_requests(
        rate_rps=2.0 * E2E_TIME_SCALE,
        seconds=50,
        time_scale=E2E_TIME_SCALE,
        seed=11,
        median_tokens=8000,
        sigma=1.0,
        min_tokens=256,
        max_tokens=65536,
        output_tokens=64,
        phase="rollout",
    )
    with BackgroundTraffic(service_url(system), "kimi-linear", plan) as traffic:
        time.sleep(8)
        rolled_at = time.monotonic()
        # a new pod template: the operator rolls the router Deployment
        system.patch_spec({"router": {"resources": {"requests": {"cpu": "30m"}}}})
        wait_until("the router rollout to finish", lambda: rollout_done_keeping_logs(system, old_pods), 150)
        rolled_in = time.monotonic() - rolled_at
        # the old pods serve on, not ready, then drain: the window a request could be lost in ends
        # when the last of them is gone (the rollout alone took 4 s once: 2 requests in it)
        wait_until("the old routers to be gone", lambda: not old_pods & router_pods(system), 120)
        old_gone_in = time.monotonic() - rolled_at
        driver = traffic.wait(240)

    results = driver.results
    lost = [
        (f"sent {r.sent_at - rolled_at:+.1f} s after the patch", r.outcome, r.error)
        for r in results
        if r.outcome not in ("ok", "rejected")
    ]
    during = [r for r in results if rolled_at <= r.sent_at <= rolled_at + old_gone_in]
    assert not lost, lost
    assert len(during) >= 10, (
        f"only {len(during)} requests were sent in the {old_gone_in:.0f} s until the old routers were gone"
    )
    hooks = pd_kubectl(system).run(
        "-n",
        system.layout.deployment_namespace,
        "get",
        "events",
        "--field-selector",
        "reason=FailedPreStopHook",
        "-o",
        "name",
    )
    assert hooks.returncode == 0 and not hooks.stdout.strip(), hooks.stdout
    print(
        f"rollout of {REPLICAS} routers in {rolled_in:.0f} s, the old ones gone in {old_gone_in:.0f} s; "
        f"{len(during)} requests sent meanwhile; "
        f"{len(results)} in all: {sum(r.outcome == 'ok' for r in results)} ok, "
        f"{sum(r.outcome == 'rejected' for r in results)} rejected, 0 lost"
    )
