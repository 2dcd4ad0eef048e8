"""Whole-system scenarios on the testbed: two clusters, pods that run, live traffic, both loops.

One PrfaasDeployment (2 PrfaaS prefill instances, 4 PD instances split 2/2, time scale 0.5)
serves every scenario, in this order, each starting from the state the previous one left:

0. Prometheus scrapes every pod the runner runs, through the runner's file_sd targets, and
   the KV of offloaded prefills crosses the emulated link (the veth into the PrfaaS pods'
   network namespace, rate-shaped as the CR says); with real nodes, the operator and the router
   are containers of the product image (non-root, read-only root, logs and exec work), a config
   change reaches the router through its ConfigMap watch in seconds, and a killed operator
   container is restarted by the kubelet with nothing changed; behind a gateway (spec.gateway on,
   the InferencePool kind installed for the module as a gateway's install does), a real Envoy
   built from the InferencePool the operator wrote sends a short prompt to a local decode and long
   ones (one streamed) offloaded to PrfaaS, as the picker decides, and turned off, all of it goes;
1. the operator restarts mid-traffic: no duplicate object, no rollout, no failed request;
2. the PrfaaS cluster's engines die: traffic goes local with no failed request among those
   sent after the outage began, PrefillClusterReady turns False, and all recovers; then its
   kube-apiserver stops while its engines live: the router keeps offloading to them (their
   endpoints kept, unobserved, for the router to check) with no failed request;
3. a scale-down of decode drains: the instance leaves the router config before its pod goes,
   and no request is lost;
4. the planner in Auto sees long prompts and rescales: threshold and split move, the
   StatefulSets and the router config follow;
5. a cache pool added to the PD cluster runs (the real mooncake_master and store), turns
   CachePoolReady True and the router's pool gauge 1; held down, its master turns both off while
   traffic is served, and both recover with it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_front import complete, envoy_in_front, read_pool, upstream_hosts
from lightkube import Client
from lightkube.resources.apps_v1 import Deployment, ReplicaSet, StatefulSet
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import ConfigMap, Pod, Service
from live_traffic import (
    E2E_TIME_SCALE,
    BackgroundTraffic,
    container_pods,
    cr_status,
    link_counters,
    logs_hint,
    patched,
    pd_kubectl,
    pd_real_node,
    quick_planner,
)
from prfaas_core.vocabulary import LABEL_INSTANCE, LABEL_ROLE, Pool
from prfaas_operator.adapters.kube import InferencePoolResource
from prfaas_testbed.clusters import Cluster, Testbed
from prfaas_testbed.control_plane import apiserver_stopped
from prfaas_testbed.inference_pool import inference_pool_crd
from prfaas_testbed.link import LinkMode, LinkShape
from prfaas_testbed.pod_workloads import WorkloadKind
from prfaas_testbed.system import LiveSystem, LiveSystemError, customise_cr, load_sample_cr, wait_until
from prfaas_testbed.traffic import PlannedRequest, lognormal_requests, prompt_text

pytestmark = [pytest.mark.e2e, pytest.mark.testbed, pytest.mark.prometheus, pytest.mark.timeout(420)]

CR_NAME = "e2e"
TESTBED_POOL_LABEL = "prfaas.io/testbed-pool"
"""The label of the testbed's node pools (gpu, cpu: testbed/scripts/testbed.sh NODE_LABEL)."""


def medium_traffic(
    seconds: float, *, wall_rps: float = 1.5, output_tokens: int = 64, seed: int = 1
) -> list[PlannedRequest]:
    """Prompts around 16K tokens (some above the 19456 threshold, most below), at ``wall_rps``."""
    return lognormal_requests(
        rate_rps=wall_rps * E2E_TIME_SCALE,
        seconds=seconds,
        time_scale=E2E_TIME_SCALE,
        seed=seed,
        median_tokens=16000,
        sigma=0.8,
        min_tokens=512,
        max_tokens=65536,
        output_tokens=output_tokens,
        phase="medium",
    )


@pytest.fixture(scope="module")
def inference_pool_kind(pd_client: Client) -> Iterator[None]:
    """The inference extension's InferencePool CRD, as a gateway's install puts it there."""
    with inference_pool_crd(pd_client):
        yield


@pytest.fixture(scope="module")
def live_system(inference_pool_kind: None, live_system: LiveSystem) -> LiveSystem:
    """The system with the InferencePool kind served from the start: the operator lists an add-on's
    kind it found unserved again only every 30 s."""
    return live_system


@pytest.fixture(scope="module")
def deployment(live_system: LiveSystem) -> LiveSystem:
    cr = customise_cr(load_sample_cr(), live_system.layout, name=CR_NAME)
    spec = cr["spec"]
    spec["prefillCluster"].update(replicas=2, minReplicas=1, maxReplicas=3)
    spec["pdCluster"].update(instances=4, prefillInstances=2, decodeInstances=2)
    live_system.apply(cr)
    live_system.wait_ready(150)
    return live_system


def start_traffic(system: LiveSystem, plan: list[PlannedRequest]) -> BackgroundTraffic:
    url = system.router_url()
    assert url is not None, f"the router is not ready {logs_hint(system)}"
    return BackgroundTraffic(url, "kimi-linear", plan)


def children(system: LiveSystem) -> dict[tuple[str, str, str], tuple[str, int | None]]:
    """(cluster, kind, name) -> (uid, generation) of every object of the deployment in both clusters.

    A Deployment's generation also counts annotation changes (the router config checksum), so
    only its uid is kept; its ReplicaSets show whether it rolled.
    """
    namespace = system.layout.deployment_namespace
    labels = {LABEL_INSTANCE: CR_NAME}
    found: dict[tuple[str, str, str], tuple[str, int | None]] = {}
    for cluster, client, kinds in (
        ("pd", system.pd, (StatefulSet, Deployment, ReplicaSet, Service, ConfigMap)),
        ("prfaas", system.prfaas, (StatefulSet, Service)),
    ):
        for kind in kinds:
            for item in client.list(kind, namespace=namespace, labels=labels):
                meta = item.metadata
                assert meta is not None and meta.name is not None
                generation = None if kind is Deployment else meta.generation
                found[(cluster, kind.__name__, meta.name)] = (str(meta.uid), generation)
    return found


def pods_by_role(system: LiveSystem, cluster: Cluster) -> dict[str, list[str]]:
    roles: dict[str, list[str]] = {}
    for pod in system.pods(cluster):
        role = (pod["metadata"].get("labels") or {}).get(LABEL_ROLE, "?")
        roles.setdefault(role, []).append(pod["metadata"]["name"])
    return roles


def statefulset_replicas(system: LiveSystem, cluster: Cluster, name: str) -> int | None:
    client = system.pd if cluster is Cluster.PD else system.prfaas
    found = client.get(StatefulSet, name, namespace=system.layout.deployment_namespace)
    return found.spec.replicas if found.spec is not None else None


def endpoints(system: LiveSystem, pool: str) -> list[str]:
    config = system.router_config() or {}
    return [endpoint["name"] for endpoint in (config.get("pools") or {}).get(pool, [])]


def condition_status(system: LiveSystem, kind: str) -> str | None:
    condition = system.condition(kind)
    return None if condition is None else str(condition.get("status"))


def test_prometheus_scrapes_every_pod_the_runner_runs(deployment: LiveSystem) -> None:
    """Targets come from the runner's file_sd: one job per role, labelled as the planner selects them."""
    system = deployment
    assert system.prometheus is not None
    expected = {
        ("router", system.layout.deployment_namespace): 1,
        ("prfaas-prefill", system.layout.deployment_namespace): 2,
        ("pd-prefill", system.layout.deployment_namespace): 2,
        ("pd-decode", system.layout.deployment_namespace): 2,
        ("operator", system.layout.system_namespace): 2,  # two replicas, one leading
    }

    def scraped() -> dict[tuple[str, str], int]:
        assert system.prometheus is not None
        counts: dict[tuple[str, str], int] = {}
        for series in system.prometheus.query("up == 1"):
            labels = series["metric"]
            key = (labels.get("job", ""), labels.get("namespace", ""))
            counts[key] = counts.get(key, 0) + 1
        return {key: count for key, count in counts.items() if key in expected}

    wait_until(f"Prometheus to scrape {expected}", lambda: scraped() == expected, 30)
    clusters = {s["metric"]["job"]: s["metric"]["cluster"] for s in system.prometheus.query("up == 1")}
    assert clusters["prfaas-prefill"] == "prfaas" and clusters["pd-decode"] == "pd"


def router_kv_egress_bytes(system: LiveSystem) -> float:
    url = system.router_url()
    assert url is not None
    with urllib.request.urlopen(url + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(r"^prfaas_router_kv_egress_bytes_total (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_the_kv_of_offloads_crosses_the_shaped_link(deployment: LiveSystem) -> None:
    """PrfaaS engines run inside the link namespace, and their KV leaves through its rate-shaped veth."""
    system = deployment
    link = system.testbed.link
    if link is None:
        assert system.link_mode is LinkMode.ENGINE_TOKEN_BUCKET
        pytest.skip("this machine gives the testbed no network namespace: the engines pace their KV instead")
    assert system.link_mode is LinkMode.NETNS_TC
    for pod in system.runner_pods(cluster="prfaas"):
        namespace = subprocess.run(
            ["ip", "netns", "identify", str(pod["pid"])], capture_output=True, text=True, check=True
        )
        assert namespace.stdout.strip() == link.netns, pod
    cr = system.cr()
    assert cr is not None
    shape = LinkShape.of_spec(cr["spec"])
    scales = system.scales
    before = link_counters(link)
    assert before["kind"] == "tbf"
    expected_rate = shape.bandwidth_bytes_per_second * scales.kv_scale / scales.time_scale
    assert before["options"]["rate"] == pytest.approx(expected_rate, rel=0.01)
    egress_before = router_kv_egress_bytes(system)
    with start_traffic(system, medium_traffic(12, seed=5)) as traffic:
        driver = traffic.wait()
    offloaded = [r for r in driver.results if r.outcome == "ok" and r.route == "prfaas"]
    assert offloaded, "nothing was offloaded"
    kv_sent = (router_kv_egress_bytes(system) - egress_before) * scales.kv_scale  # what engines really send
    crossed = link_counters(link)["bytes"] - before["bytes"]
    assert crossed >= 0.9 * kv_sent > 0, (crossed, kv_sent)


GATEWAY_LONG_TOKENS = 30_000
"""Above the sample's 19456-token threshold: offloaded to PrfaaS."""


def test_requests_through_a_real_envoy_to_the_picker_the_operator_writes_are_routed_by_the_policy(
    deployment: LiveSystem, tmp_path: Path
) -> None:
    """spec.gateway on: the operator writes the InferencePool and runs the picker; a real Envoy built
    from the pool (its endpointPickerRef's Service, the picker pod behind it over TLS, its targetPorts) serves
    a short prompt on a local PD decode, a long one offloaded to PrfaaS and a stream, routed as the
    router's policy says; off again, every gateway object goes and the router serves as before."""
    system = deployment
    started = time.monotonic()
    system.patch_spec({"gateway": {"inferencePool": {"enabled": True}}})
    try:
        wait_until("GatewayReady True", lambda: condition_status(system, "GatewayReady") == "True", 60)
        view = wait_until("the InferencePool's picker ready", lambda: read_pool(system), 60)
        assert view.tls, "the picker serves TLS by default (self-signed), and Envoy dials it so"
        assert view.pool["spec"]["targetPorts"] == [{"number": system.cr()["spec"]["pdCluster"]["port"]}]
        decodes = {
            pod["status"]["podIP"]
            for pod in system.pods(Cluster.PD)
            if pod["metadata"]["labels"].get(LABEL_ROLE) == "pd-decode"
        }
        assert {endpoint.rpartition(":")[0] for endpoint in view.endpoints} == decodes
        ready = time.monotonic() - started
        with envoy_in_front(view, tmp_path) as (url, access_log):
            unique = time.time_ns()  # prompts no earlier request shares a prefix with
            answers = {
                "short": complete(url, "kimi-linear", prompt_text([unique], 2_000), stream=False),
                "long": complete(
                    url, "kimi-linear", prompt_text([unique + 1], GATEWAY_LONG_TOKENS), stream=False
                ),
                "long streamed": complete(
                    url, "kimi-linear", prompt_text([unique + 2], GATEWAY_LONG_TOKENS), stream=True
                ),
            }
            upstream = upstream_hosts(access_log, len(answers))
        assert {name: (a.status, a.route) for name, a in answers.items()} == {
            "short": (200, "local"),
            "long": (200, "prfaas"),
            "long streamed": (200, "prfaas"),
        }, answers
        assert all(answer.text for answer in answers.values()), answers
        assert set(upstream) <= view.endpoints, (upstream, view.endpoints)
        served = time.monotonic() - started - ready
    finally:
        off = time.monotonic()
        system.patch_spec({"gateway": None})
        wait_until(
            "every gateway object gone",
            lambda: not gateway_leftovers(system) and system.condition("GatewayReady") is None,
            90,
        )
    assert system.router_url() is not None
    print(
        f"gateway: picker ready {ready:.1f} s after on, 3 requests through Envoy in {served:.1f} s, "
        f"gone {time.monotonic() - off:.1f} s after off"
    )


def gateway_leftovers(system: LiveSystem) -> list[str]:
    """The gateway's objects still there: the pool, and anything of the picker's role, pods included."""
    namespace = system.layout.deployment_namespace
    found = [
        f"InferencePool/{p['metadata']['name']}"
        for p in system.pd.list(InferencePoolResource, namespace=namespace)
    ]
    for kind in (Deployment, ReplicaSet, Service, Pod):
        for item in system.pd.list(
            kind, namespace=namespace, labels={LABEL_INSTANCE: CR_NAME, LABEL_ROLE: "picker"}
        ):
            found.append(f"{kind.__name__}/{item.metadata.name}")
    return found


IDLE_SECONDS = 15.0
"""SGLang's /health runs a generation and never answers under 1 s; an idle router must not eject."""


def test_an_idle_system_keeps_every_engine_healthy(deployment: LiveSystem) -> None:
    """After traffic, an idle router keeps every engine it knows healthy, and logs no ejection."""
    system = deployment
    pd_real_node(system)
    router = container_pod(system, "router")
    time.sleep(IDLE_SECONDS)
    url = system.router_url()
    assert url is not None
    with urllib.request.urlopen(url + "/readiness", timeout=5) as reply:
        readiness = json.loads(reply.read())
    print(f"router readiness after {IDLE_SECONDS:g} s idle: {readiness}")
    assert readiness["status"] == "ready", readiness
    assert readiness["healthy_workers"] == readiness["total_workers"], readiness
    assert all(readiness["total_workers"][pool] > 0 for pool in Pool), readiness
    namespace = system.layout.deployment_namespace
    logs = pd_kubectl(system).run("-n", namespace, "logs", router["pod"], f"--since={IDLE_SECONDS + 5:.0f}s")
    assert logs.returncode == 0, logs
    assert "is unhealthy" not in logs.stdout + logs.stderr, logs.stdout[-2000:]


def container_pod(system: LiveSystem, kind: str) -> dict[str, Any]:
    (pod,) = container_pods(system, kind, 1)
    return pod


def operator_lease_holder(system: LiveSystem) -> str | None:
    """The identity (`<pod>_<process id>`) holding the operators' leader Lease (the chart's, in its namespace)."""
    (lease,) = system.pd.list(Lease, namespace=system.layout.system_namespace)
    return lease.spec.holderIdentity if lease.spec is not None else None


def operator_logs(system: LiveSystem) -> str:
    """The Lease and the last lines of each operator container (and of its previous run), to tell why."""
    namespace = system.layout.system_namespace
    parts = [pd_kubectl(system).run("-n", namespace, "get", "lease", "-o", "yaml").stdout]
    for pod in system.runner_pods(kind="operator"):
        for previous in ((), ("--previous",)):
            shown = pd_kubectl(system).run("-n", namespace, "logs", pod["pod"], "--tail", "25", *previous)
            parts.append(f"--- {pod['pod']} {' '.join(previous)}\n{shown.stdout}{shown.stderr}")
    return "\n".join(parts)


def leading_operator(system: LiveSystem) -> dict[str, Any]:
    """The leader's pod (as the runner reports it), with its Lease identity under "identity"."""
    holder = operator_lease_holder(system) or ""
    (pod,) = [p for p in system.runner_pods(kind="operator") if p["pod"] == holder.rsplit("_", 1)[0]]
    return {**pod, "identity": holder}


def test_operator_and_router_are_containers_of_the_product_image_on_the_real_node(
    deployment: LiveSystem,
) -> None:
    """Under the kubelet: the image, non-root, a read-only root, the router's only token, logs and exec."""
    system = deployment
    node = pd_real_node(system)
    for kind, namespace, pod in (
        *(("operator", system.layout.system_namespace, pod) for pod in container_pods(system, "operator", 2)),
        ("router", system.layout.deployment_namespace, container_pod(system, "router")),
    ):
        assert pod["node"] == node.name and pod["ready"], pod
        live = system.pd.get(Pod, pod["pod"], namespace=namespace)
        assert live.status is not None and live.status.containerStatuses is not None
        (status,) = live.status.containerStatuses
        assert status.image == "ghcr.io/prfaas/prfaas:0.1.0" and status.containerID.startswith(
            "containerd://"
        )
        identity = pd_kubectl(system).run("-n", namespace, "exec", pod["pod"], "--", "id", "-u")
        assert identity.returncode == 0 and identity.stdout.strip() == "65532", identity
        write = pd_kubectl(system).run("-n", namespace, "exec", pod["pod"], "--", "touch", "/opt/written")
        assert write.returncode != 0 and "Read-only file system" in write.stderr, write
        scratch = pd_kubectl(system).run("-n", namespace, "exec", pod["pod"], "--", "touch", "/tmp/written")
        assert scratch.returncode == 0, scratch
        logs = pd_kubectl(system).run("-n", namespace, "logs", pod["pod"], "--tail", "200")
        assert logs.returncode == 0 and logs.stdout.strip(), logs
        if kind == "router":
            assert "watching through the API" in logs.stdout, logs.stdout[-2000:]
        # the router's token reads its config ConfigMap; the operator's is the chart's RBAC
        token = pd_kubectl(system).run(
            "-n",
            namespace,
            "exec",
            pod["pod"],
            "--",
            "cat",
            "/var/run/secrets/kubernetes.io/serviceaccount/token",
        )
        assert token.returncode == 0 and token.stdout.count(".") == 2, "no projected token"
        assert token.stdout.strip() not in logs.stdout, "a token in the log"


def router_config_page(system: LiveSystem) -> dict[str, Any]:
    url = system.router_url()
    assert url is not None
    with urllib.request.urlopen(url + "/config", timeout=5) as reply:
        page: dict[str, Any] = json.loads(reply.read())
    return page


def test_a_config_change_reaches_the_router_in_seconds_not_at_the_kubelets_pace(
    deployment: LiveSystem,
) -> None:
    """The operator writes a new threshold; the router applies it from the API watch, long before
    the kubelet refreshes the mounted file. Both delays are measured and printed."""
    system = deployment
    pd_real_node(system)
    router = container_pod(system, "router")
    namespace = system.layout.deployment_namespace
    cr = system.cr()
    assert cr is not None
    before = (system.router_config() or {})["version"]
    threshold = int(cr["spec"]["routing"]["thresholdTokens"]) + 64
    changed_at = time.monotonic()
    system.patch_spec({"routing": {"thresholdTokens": threshold}})
    wait_until(
        "the operator to write the new threshold",
        lambda: (system.router_config() or {}).get("threshold_tokens") == threshold,
        30,
        poll_s=0.1,
    )
    written = (system.router_config() or {})["version"]
    assert written > before
    wait_until(
        "the router to apply it",
        lambda: router_config_page(system).get("version") == written,
        30,
        poll_s=0.1,
    )
    api_delay = time.monotonic() - changed_at
    page = router_config_page(system)
    assert page["config_source"] == f"configmap {namespace}/{CR_NAME}-router-config", page
    assert page["config_map"] == {"watching": True, "last_error": None}, page

    def mounted_version() -> int | None:
        shown = pd_kubectl(system).run(
            "-n", namespace, "exec", router["pod"], "--", "cat", "/etc/prfaas/router-config.json"
        )
        return json.loads(shown.stdout)["version"] if shown.returncode == 0 else None

    wait_until(
        "the kubelet to refresh the mounted file", lambda: (mounted_version() or 0) >= written, 180, 1.0
    )
    file_delay = time.monotonic() - changed_at
    print(
        f"spec change -> router config: API watch {api_delay:.1f} s, kubelet's mounted file {file_delay:.1f} s"
    )
    assert api_delay < file_delay
    system.patch_spec({"routing": {"thresholdTokens": threshold - 64}})


def test_the_leading_operator_killed_mid_traffic_is_replaced_within_15_s_and_changes_nothing(
    deployment: LiveSystem,
) -> None:
    """SIGKILL to the leader's container: another process takes the Lease, the kubelet restarts the killed one."""
    system = deployment
    node = pd_real_node(system)
    before = children(system)
    container_pods(system, "operator", 2)
    leader = leading_operator(system)
    namespace = system.layout.system_namespace
    live = system.pd.get(Pod, leader["pod"], namespace=namespace)
    assert live.status is not None and live.status.containerStatuses is not None
    (status,) = live.status.containerStatuses
    container_id = status.containerID.removeprefix("containerd://")
    tasks = subprocess.run(
        ["ctr", "--address", str(node.containerd_socket), "-n", "k8s.io", "tasks", "ls"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    (pid,) = [
        int(line.split()[1]) for line in tasks.stdout.splitlines()[1:] if line.split()[0] == container_id
    ]
    with start_traffic(system, medium_traffic(20, seed=7)) as traffic:
        time.sleep(3)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        try:
            wait_until(
                "another operator process to take the Lease",
                # the follower, or the killed pod's container restarted by the kubelet if it is first
                lambda: operator_lease_holder(system) not in (None, leader["identity"]),
                30,
                0.2,
            )
        except LiveSystemError as err:
            raise AssertionError(f"{err}\n{operator_logs(system)}") from err
        takeover = time.monotonic() - killed
        restarted = wait_until(
            "the kubelet to restart the killed operator container in its pod",
            lambda: (
                (p := next(p for p in system.runner_pods(kind="operator") if p["uid"] == leader["uid"]))
                and p["restarts"] == leader["restarts"] + 1
                and p["ready"]
                and p
            ),
            90,
        )
        driver = traffic.wait()
    holder = operator_lease_holder(system) or ""
    which = "its restarted container" if holder.startswith(f"{leader['pod']}_") else "the follower"
    print(f"operator leader killed: {which} led {takeover:.1f} s later")
    assert takeover <= 15, f"another operator took the Lease {takeover:.1f} s after the leader died"
    assert restarted["pod"] == leader["pod"]
    time.sleep(3)  # the new leader's first passes
    after = children(system)
    assert after == before, f"objects changed across the takeover: {set(after.items()) ^ set(before.items())}"
    summary = driver.summary()
    assert summary.outcomes.get("ok", 0) == summary.sent > 10, f"{summary.line()} {summary.errors}"
    assert system.is_ready()


def test_operator_restart_mid_traffic_duplicates_nothing_and_drops_nothing(deployment: LiveSystem) -> None:
    system = deployment
    before = children(system)
    config_before = system.router_config() or {}
    old = leading_operator(system)
    with start_traffic(system, medium_traffic(25)) as traffic:
        time.sleep(5)
        system.pd.delete(Pod, old["pod"], namespace=system.layout.system_namespace)  # SIGTERM, then a new pod
        wait_until(
            "the other replica leading and a new operator pod ready",
            lambda: (
                operator_lease_holder(system) not in (None, old["identity"])
                and len(
                    [p for p in system.runner_pods(kind="operator") if p["ready"] and p["uid"] != old["uid"]]
                )
                == 2
            ),
            60,
        )
        driver = traffic.wait()
    time.sleep(3)  # the new operator's first passes are done by now
    after = children(system)
    assert after == before, f"objects changed across the restart: {set(after.items()) ^ set(before.items())}"
    config_after = system.router_config() or {}
    unversioned = {key for key in config_before if key != "version"}
    assert {k: config_after.get(k) for k in unversioned} == {k: config_before[k] for k in unversioned}
    assert {role: len(names) for role, names in pods_by_role(system, Cluster.PD).items()} == {
        "pd-prefill": 2,
        "pd-decode": 2,
        "router": 1,
    }
    assert {role: len(names) for role, names in pods_by_role(system, Cluster.PRFAAS).items()} == {
        "prfaas-prefill": 2
    }
    summary = driver.summary()
    assert summary.outcomes.get("ok", 0) >= 20, summary.line()
    assert summary.outcomes.get("ok", 0) == summary.sent, (
        f"{summary.line()} {summary.errors} {logs_hint(system)}"
    )
    assert system.is_ready()


def test_prfaas_outage_sends_traffic_local_and_recovers(deployment: LiveSystem) -> None:
    system = deployment
    with start_traffic(system, medium_traffic(55, seed=2)) as traffic:
        time.sleep(8)
        offloaded_before = [r for r in traffic.driver.results if r.outcome == "ok" and r.route == "prfaas"]
        assert offloaded_before, "nothing was offloaded before the outage"
        system.set_down([Cluster.PRFAAS.value])
        try:
            wait_until(
                "the PrfaaS engines to be killed",
                lambda: all(p["pid"] is None for p in system.runner_pods(cluster="prfaas")),
                10,
                poll_s=0.1,
            )
            outage_at = time.monotonic()  # requests sent before may have been on a killed engine
            wait_until(
                "PrefillClusterReady to turn False",
                lambda: condition_status(system, "PrefillClusterReady") == "False",
                30,
            )
            wait_until(
                "the router config to drop the PrfaaS endpoints",
                lambda: not endpoints(system, Pool.PRFAAS_PREFILL),
                30,
            )
            local_from = time.monotonic()
            assert condition_status(system, "Ready") == "False"
            time.sleep(8)
        finally:
            system.set_down([])
        recovery_at = time.monotonic()
        wait_until(
            "PrefillClusterReady to turn True again",
            lambda: condition_status(system, "PrefillClusterReady") == "True",
            60,
        )
        wait_until(
            "the router config to list both PrfaaS endpoints",
            lambda: len(endpoints(system, Pool.PRFAAS_PREFILL)) == 2,
            30,
        )
        driver = traffic.wait()
    after_outage = [r for r in driver.results if r.sent_at >= outage_at]
    failed = [r for r in after_outage if r.outcome != "ok"]
    assert not failed, (
        f"requests sent after the outage began failed: {[(r.outcome, r.error) for r in failed]}"
    )
    during = [r for r in after_outage if local_from <= r.sent_at < recovery_at]
    assert during and all(r.route == "local" for r in during), [(r.route, r.input_tokens) for r in during]
    assert any(r.route == "prfaas" for r in driver.results if r.sent_at > recovery_at + 5), (
        "no offload after recovery"
    )
    held = [p for p in system.runner_pods(cluster="prfaas") if p["restarts"] != 0 or not p["ready"]]
    assert all(p["ready"] for p in system.runner_pods(cluster="prfaas")), held
    assert system.is_ready()


def test_a_prfaas_apiserver_outage_keeps_the_prfaas_prefills_serving(
    deployment: LiveSystem, testbed: Testbed
) -> None:
    """The PrfaaS cluster's control plane goes, its engines do not: the operator keeps their
    endpoints (unobserved) and the router keeps offloading to them once their /server_info holds."""
    system = deployment
    url = system.router_url()
    assert url is not None

    def unobserved() -> list[str]:
        prfaas = ((system.router_config() or {}).get("pools") or {}).get(Pool.PRFAAS_PREFILL, [])
        return [e["name"] for e in prfaas if e.get("unobserved_since") is not None]

    with start_traffic(system, medium_traffic(45, seed=3)) as traffic:
        time.sleep(5)
        with apiserver_stopped(testbed, Cluster.PRFAAS):
            wait_until(
                "the router config to keep both PrfaaS endpoints, unobserved",
                lambda: len(unobserved()) == 2,
                30,
            )
            kept_from = time.monotonic()
            time.sleep(15)
            kept_until = time.monotonic()
            with urllib.request.urlopen(url + "/config", timeout=5) as answer:
                workers = json.loads(answer.read())["workers"]
            assert condition_status(system, "PrefillClusterReady") == "False"
        wait_until(
            "the router config to list both PrfaaS endpoints as observed",
            lambda: not unobserved() and len(endpoints(system, Pool.PRFAAS_PREFILL)) == 2,
            60,
        )
        driver = traffic.wait()
    prfaas = [w for w in workers if w["pool"] == Pool.PRFAAS_PREFILL]
    assert len(prfaas) == 2 and all(w["available"] and w["unobserved_since"] for w in prfaas), prfaas
    failed = [(r.outcome, r.error) for r in driver.results if r.outcome != "ok"]
    assert not failed, f"requests failed around the apiserver outage: {failed} {logs_hint(system)}"
    during = [r for r in driver.results if kept_from <= r.sent_at < kept_until]
    offloaded = [r for r in during if r.route == "prfaas"]
    print(
        f"apiserver outage: {len(during)} requests sent in 15 s with the endpoints kept, {len(offloaded)} offloaded"
    )
    assert offloaded, [(r.route, r.input_tokens) for r in during]
    assert system.is_ready()


def test_decode_scale_down_drains_before_the_pod_goes(deployment: LiveSystem) -> None:
    system = deployment
    draining = f"{CR_NAME}-pd-decode-1"
    samples: list[
        tuple[float, bool, bool]
    ] = []  # (time, listed in the router config, pod present and not deleting)

    def sample() -> None:
        present = any(
            p["metadata"]["name"] == draining and not p["metadata"].get("deletionTimestamp")
            for p in system.pods(Cluster.PD)
        )
        samples.append((time.monotonic(), draining in endpoints(system, "decode"), present))

    # long outputs keep every decode busy for seconds: an instance killed mid-stream loses requests
    with start_traffic(system, medium_traffic(30, output_tokens=200, seed=3)) as traffic:
        time.sleep(6)
        system.patch_spec({"pdCluster": {"prefillInstances": 3, "decodeInstances": 1}})

        def done() -> bool:
            sample()
            return (
                statefulset_replicas(system, Cluster.PD, f"{CR_NAME}-pd-decode") == 1 and not samples[-1][2]
            )

        wait_until("decode to scale down to 1 and its pod to go", done, 90, poll_s=0.2)
        driver = traffic.wait()
    summary = driver.summary()
    assert summary.outcomes.get("ok", 0) == summary.sent > 20, (
        f"{summary.line()} {summary.errors} {logs_hint(system)}"
    )
    unlisted_at = next(t for t, listed, _ in samples if not listed)
    gone_at = next(t for t, _, present in samples if not present)
    assert unlisted_at < gone_at, "the pod went before the router config dropped it"
    assert not [s for s in samples if s[1] and not s[2]], "the router config listed a pod that was gone"
    wait_until("the new split to be Ready", system.is_ready, 60)
    assert endpoints(system, "decode") == [f"{CR_NAME}-pd-decode-0"]
    assert len(endpoints(system, Pool.LOCAL_PREFILL)) == 3


def test_workload_shift_makes_the_planner_rescale(deployment: LiveSystem) -> None:
    system = deployment
    assert system.prometheus is not None
    spec_threshold = (system.cr() or {})["spec"]["routing"]["thresholdTokens"]
    system.patch_spec(
        {
            # the split's whole range: the default minimums (2 and 2 of 4) would pin it
            "pdCluster": {
                "prefillInstances": 2,
                "decodeInstances": 2,
                "minPrefillInstances": 0,
                "minDecodeInstances": 1,
            },
            "routing": {"mode": "Auto"},
            "planner": quick_planner(system),
        }
    )
    long_prompts = lognormal_requests(
        rate_rps=1.2 * E2E_TIME_SCALE, seconds=70, time_scale=E2E_TIME_SCALE, seed=4, output_tokens=64
    )

    def applied() -> dict[str, Any] | None:
        status = (system.cr() or {}).get("status") or {}
        allocation = status.get("allocation") or {}
        return allocation if allocation.get("source") == "Planner" else None

    with start_traffic(system, long_prompts) as traffic:
        allocation = wait_until("the planner to apply an allocation", applied, 120, poll_s=1.0)
        traffic.stop()
        driver = traffic.wait()
    planner = ((system.cr() or {}).get("status") or {}).get("planner") or {}
    moved = (allocation["thresholdTokens"], allocation["pdPrefillInstances"]) != (spec_threshold, 2)
    assert moved, f"the planner applied the spec's own point: {allocation}, {planner}"
    assert allocation["pdPrefillInstances"] + allocation["pdDecodeInstances"] == 4

    def followed() -> bool:
        config = system.router_config() or {}
        return (
            statefulset_replicas(system, Cluster.PD, f"{CR_NAME}-pd-prefill")
            == allocation["pdPrefillInstances"]
            and statefulset_replicas(system, Cluster.PD, f"{CR_NAME}-pd-decode")
            == allocation["pdDecodeInstances"]
            and config.get("threshold_tokens") == allocation["thresholdTokens"]
        )

    wait_until("the StatefulSets and the router config to follow the planner", followed, 90)
    events = system.events(["PlannerApplied"])
    assert events and "would take Λ as the router routes" in str(events[-1].get("message")), events
    summary = driver.summary()
    assert summary.outcomes.get("failed", 0) == 0, f"{summary.line()} {summary.errors} {logs_hint(system)}"


def router_pool_up(system: LiveSystem) -> float | None:
    """The router's prfaas_router_cache_pool_up for the PD cluster's pool (None: not exported)."""
    url = system.router_url()
    if url is None:
        return None
    with urllib.request.urlopen(url + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(r'^prfaas_router_cache_pool_up\{cluster="local"\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else None


def test_a_cache_pool_runs_and_its_master_outage_is_reported_not_felt(deployment: LiveSystem) -> None:
    system = deployment
    master = f"{system.layout.deployment_namespace}/{CR_NAME}-pd-kv-master-0"
    pool = {
        "storeReplicas": 1,
        "segmentSize": "64Mi",
        # the testbed's CPU nodes, whose runner runs the venv's real mooncake_master and
        # mooncake_client (no image on the real node holds them)
        "nodeSelector": {TESTBED_POOL_LABEL: "cpu"},
        "tolerations": [
            {"key": TESTBED_POOL_LABEL, "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}
        ],
    }
    rolled = patched(system, {"pdCluster": {"cachePool": pool}})  # the PD prefills roll onto HiCache's flags

    def pool_reported(status: str) -> dict[str, Any] | None:
        condition = system.condition("CachePoolReady")
        return condition if condition is not None and condition.get("status") == status else None

    ready = wait_until("CachePoolReady to turn True", lambda: pool_reported("True"), 150, poll_s=1.0)
    assert "1/1 stores ready, capacity 64 MiB" in ready["message"], ready
    assert ((system.router_config() or {}).get("cache_pools") or {}).get("local"), system.router_config()
    wait_until("the router to see the pool up", lambda: router_pool_up(system) == 1, 60)
    wait_until("the PD prefills to roll onto the pool", lambda: rolled(cr_status(system)), 180, poll_s=1.0)
    system.wait_ready(60)
    pool_pods = system.runner_pods(cluster=Cluster.PD.value, kind=WorkloadKind.KV_POOL)
    assert sorted(p["pod"] for p in pool_pods if p["ready"]) == [
        f"{CR_NAME}-pd-kv-{x}-0" for x in ("master", "store")
    ]
    with start_traffic(system, medium_traffic(30, seed=5)) as traffic:
        system.set_down([f"{Cluster.PD.value}/{master}"])
        try:
            down = wait_until("CachePoolReady to turn False", lambda: pool_reported("False"), 60, poll_s=0.5)
            assert down["reason"] == "MasterNotReady", down
            wait_until("the router to see the pool down", lambda: router_pool_up(system) == 0, 30)
            assert system.is_ready(), "a pool outage took Ready down"
        finally:
            system.set_down([])
        wait_until("CachePoolReady to turn True again", lambda: pool_reported("True"), 90, poll_s=1.0)
        wait_until("the router to see the pool up again", lambda: router_pool_up(system) == 1, 30)
        driver = traffic.wait()
    summary = driver.summary()
    assert summary.outcomes.get("ok", 0) == summary.sent > 10, (
        f"{summary.line()} {summary.errors} {logs_hint(system)}"
    )
