"""The whole system on the testbed, as a user would install it: shared by the demo and the e2e tests.

``LiveSystem`` starts Prometheus and the runner (a child process playing the kubelet), installs
the Helm chart twice (the operator in the PD cluster; the least-privilege access identity in
the PrfaaS cluster), stores a kubeconfig Secret for that identity in the PD cluster, applies a
PrfaasDeployment and waits for it. ``stop()`` undoes it in the reverse order: the CR (while the
operator still runs, so its finalizer cleans both clusters), the releases, the runner's
processes, Prometheus.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from lightkube import ApiError, Client, KubeConfig
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.authentication_v1 import TokenRequestSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Event, Namespace, Pod, Secret, ServiceAccount
from lightkube.types import PatchType
from prfaas_core.vocabulary import GROUP, KIND, PLURAL, VERSION

from prfaas_testbed.clusters import KUBECONFIG_SECRET_KEY, Cluster, GpuPool, Testbed, store_kubeconfig_secret
from prfaas_testbed.link import LinkMode
from prfaas_testbed.link_emulation import resolve_link_mode
from prfaas_testbed.pod_workloads import Scales, WorkloadKind
from prfaas_testbed.polling import eventually
from prfaas_testbed.prometheus import PrometheusServer, start_prometheus
from prfaas_testbed.runner import scrape_jobs
from prfaas_testbed.runner_state import CONTROL_FILE, STATUS_FILE

log = logging.getLogger("prfaas_testbed.system")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "prfaas-operator"
SAMPLE_CR = REPO / "examples" / "prfaasdeployment.yaml"
FIELD_MANAGER = "prfaas-testbed"
PrfaasDeployment = create_namespaced_resource(GROUP, VERSION, KIND, PLURAL)


class LiveSystemError(RuntimeError):
    """A step of bringing the system up or down failed; the message says which and why."""


@dataclass(frozen=True)
class Layout:
    """Names of everything the system installs (distinct layouts can share one testbed)."""

    deployment_namespace: str = "prfaas-demo"
    """The CR's namespace in the PD cluster, and the prefill namespace in the PrfaaS cluster."""
    system_namespace: str = "prfaas-system"
    """The operator's release (PD cluster) and the access release (PrfaaS cluster)."""
    operator_release: str = "prfaas"
    access_release: str = "prfaas-access"
    secret_name: str = "prfaas-cluster-kubeconfig"
    access_service_account: str = "prfaas-prefill-access"

    def runner_namespaces(self) -> list[str]:
        return [
            f"{cluster.value}:{namespace}"
            for cluster in Cluster
            for namespace in (self.system_namespace, self.deployment_namespace)
        ]


def load_sample_cr(path: Path = SAMPLE_CR) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    return document


def customise_cr(
    cr: Mapping[str, Any],
    layout: Layout,
    *,
    name: str | None = None,
    prometheus_url: str | None = None,
    planner: Mapping[str, Any] | None = None,
    routing_mode: str | None = None,
) -> dict[str, Any]:
    """The CR placed in the layout's namespaces and Secret, with planner and routing overrides."""
    result = copy.deepcopy(dict(cr))
    metadata = result.setdefault("metadata", {})
    metadata["namespace"] = layout.deployment_namespace
    if name is not None:
        metadata["name"] = name
    spec = result["spec"]
    spec["prefillCluster"]["namespace"] = layout.deployment_namespace
    spec["prefillCluster"]["kubeconfigSecretRef"] = {"name": layout.secret_name, "key": KUBECONFIG_SECRET_KEY}
    if planner is not None:
        spec["planner"] = {**dict(planner), **({"prometheusUrl": prometheus_url} if prometheus_url else {})}
    if routing_mode is not None:
        spec["routing"]["mode"] = routing_mode
    return result


def across_nodes(cr: Mapping[str, Any], nodes: int, pools: Mapping[Cluster, GpuPool]) -> dict[str, Any]:
    """The CR with instances of `nodes` whole nodes each in both clusters (LeaderWorkerSets when
    more than one), its counts cut to what each cluster's GPU nodes hold that way, the planner's
    bounds and minimums with them."""
    result = copy.deepcopy(dict(cr))
    spec = result["spec"]
    for cluster, key in ((Cluster.PRFAAS, "prefillCluster"), (Cluster.PD, "pdCluster")):
        pool = pools[cluster]
        spec[key].update(
            gpusPerNode=pool.gpus_per_node, gpusPerInstance=pool.gpus_per_node * nodes, nodesPerInstance=nodes
        )
    prefill, fits = spec["prefillCluster"], pools[Cluster.PRFAAS].nodes // nodes
    prefill["maxReplicas"] = min(int(prefill.get("maxReplicas", fits)), fits)
    prefill["replicas"] = min(int(prefill["replicas"]), prefill["maxReplicas"])
    prefill["minReplicas"] = min(int(prefill.get("minReplicas", 1)), prefill["replicas"])
    pd, fits = spec["pdCluster"], pools[Cluster.PD].nodes // nodes
    if int(pd["instances"]) > fits:
        decode = max(1, round(int(pd["decodeInstances"]) * fits / int(pd["instances"])))
        pd.update(instances=fits, prefillInstances=fits - decode, decodeInstances=decode)
        pd.update(minPrefillInstances=min(1, fits - decode), minDecodeInstances=1)
    return result


def _client(testbed: Testbed, cluster: Cluster) -> Client:
    return Client(
        config=KubeConfig.from_file(testbed.kubeconfig(cluster)), field_manager=FIELD_MANAGER, trust_env=False
    )


def _as_dict(obj: Any) -> dict[str, Any]:
    result: dict[str, Any] = obj if isinstance(obj, dict) else obj.to_dict()
    return result


def _copy_if_grown(source: str, target: str) -> None:
    """shutil.copy2 unless the target already has the source's size (a log only grows)."""
    if not os.path.exists(target) or os.path.getsize(target) != os.path.getsize(source):
        shutil.copy2(source, target)


def wait_until(what: str, check: Callable[[], Any], timeout_s: float, poll_s: float = 0.5) -> Any:
    """Poll ``check`` until it returns something truthy; LiveSystemError naming ``what`` on timeout.

    An exception from ``check`` goes through at once (the demo and the e2e tests stop on it)."""
    return eventually(
        check, timeout=timeout_s, interval=poll_s, what=what, retry_on=(), error=LiveSystemError
    )


class LiveSystem:
    """Prometheus, the runner, both releases and the Secret; one CR at a time."""

    def __init__(
        self,
        testbed: Testbed,
        work_dir: Path,
        *,
        layout: Layout | None = None,
        scales: Scales | None = None,
        link_mode: LinkMode | None = None,
        operator_values: Sequence[str] = (),
        sglang_python: Path | None = None,
    ) -> None:
        self.testbed = testbed
        self.sglang_python = sglang_python
        self.work_dir = work_dir
        self.layout = layout or Layout()
        self.scales = scales or Scales()
        self.link_mode = resolve_link_mode(link_mode, testbed)
        self.operator_values = tuple(operator_values)
        self.pd = _client(testbed, Cluster.PD)
        self.prfaas = _client(testbed, Cluster.PRFAAS)
        self.prometheus: PrometheusServer | None = None
        self.runner: subprocess.Popen[bytes] | None = None
        self.runner_dir = work_dir / "runner"
        self.cr_name: str | None = None

    # ---- bring-up -------------------------------------------------------------------------------

    def start(self) -> None:
        """Prometheus, the runner, the namespaces, both releases and the kubeconfig Secret."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        pd_node = self.testbed.clusters[Cluster.PD].real_node
        self.prometheus = start_prometheus(
            self.work_dir / "prometheus",
            jobs=scrape_jobs(),
            scrape_interval_s=1.0,
            # the operator's planner reads it from a container on the PD node: its bridge address
            host=str(pd_node.ip) if pd_node is not None else "127.0.0.1",
        )
        self.start_runner()
        layout = self.layout
        for client in (self.pd, self.prfaas):
            for namespace in (layout.system_namespace, layout.deployment_namespace):
                client.apply(Namespace(metadata=ObjectMeta(name=namespace)), field_manager=FIELD_MANAGER)
        self._helm(
            Cluster.PRFAAS,
            layout.access_release,
            [
                "--skip-crds",
                "--set", "operator.enabled=false",
                "--set", "prefillClusterAccess.enabled=true",
                "--set", f"prefillClusterAccess.serviceAccount.name={layout.access_service_account}",
            ],
        )  # fmt: skip
        self.store_prefill_cluster_secret()
        images = ["--set", "image.pullPolicy=Never"] if self.testbed.real_nodes else []
        self._helm(
            Cluster.PD,
            layout.operator_release,
            ["--set", f"watchNamespaces={{{layout.deployment_namespace}}}", *images, *self.operator_values],
        )
        how = "its container on the real node" if self.testbed.real_nodes else "run by the runner"
        wait_until(f"the operator pod to be Ready ({how})", self.operator_ready, 120)

    def start_runner(self) -> None:
        self.runner_dir.mkdir(parents=True, exist_ok=True)
        assert self.prometheus is not None
        argv = [
            sys.executable, "-m", "prfaas_testbed.runner",
            "--state-dir", str(self.runner_dir),
            "--targets-dir", str(self.prometheus.targets_dir),
            "--time-scale", f"{self.scales.time_scale:g}",
            "--kv-scale", f"{self.scales.kv_scale:g}",
            "--link", self.link_mode.value,
        ]  # fmt: skip
        for namespace in self.layout.runner_namespaces():
            argv += ["--namespace", namespace]
        if self.sglang_python is not None:
            argv += ["--sglang-python", str(self.sglang_python)]
        env = {**os.environ, **self.testbed.env()}
        with open(self.work_dir / "runner.log", "ab") as output:
            self.runner = subprocess.Popen(
                argv,
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches the demo, which stops it in order
            )

    def _helm(self, cluster: Cluster, release: str, values: Sequence[str]) -> None:
        argv = [
            str(self.testbed.helm), "upgrade", "--install", release, str(CHART),
            "--kubeconfig", str(self.testbed.kubeconfig(cluster)),
            "--namespace", self.layout.system_namespace,
            *values,
        ]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
        if done.returncode != 0:
            raise LiveSystemError(
                f"helm install of {release} in the {cluster.value} cluster failed: {done.stderr[-2000:]}"
            )

    def store_prefill_cluster_secret(self) -> None:
        """A kubeconfig for the access identity (a TokenRequest token), stored as the CR's Secret in the PD cluster."""
        layout = self.layout
        answer = self.prfaas.create(
            ServiceAccount.Token(
                metadata=ObjectMeta(), spec=TokenRequestSpec(audiences=[], expirationSeconds=2 * 86400)
            ),
            layout.access_service_account,
            namespace=layout.system_namespace,
        )
        token = answer.status.token if answer.status is not None else None
        if not token:
            raise LiveSystemError(
                f"no token for ServiceAccount {layout.system_namespace}/{layout.access_service_account}"
            )
        admin = yaml.safe_load(self.testbed.prfaas_kubeconfig.read_text())
        server = admin["clusters"][0]["cluster"]
        prfaas_node = self.testbed.clusters[Cluster.PRFAAS].real_node
        if prfaas_node is not None:  # the operator's container reaches the PrfaaS apiserver at its node
            port = urllib.parse.urlsplit(server["server"]).port
            server = {**server, "server": f"https://{prfaas_node.ip}:{port}"}
        user = f"system:serviceaccount:{layout.system_namespace}:{layout.access_service_account}"
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "prfaas", "cluster": server}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "prfaas", "context": {"cluster": "prfaas", "user": user}}],
            "current-context": "prfaas",
        }
        path = self.work_dir / "prfaas-access.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig))
        path.chmod(0o600)
        store_kubeconfig_secret(self.pd, path, name=layout.secret_name, namespace=layout.deployment_namespace)

    # ---- observation ----------------------------------------------------------------------------

    def runner_status(self) -> dict[str, Any]:
        try:
            loaded: dict[str, Any] = json.loads((self.runner_dir / STATUS_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return {"pods": []}
        return loaded

    def runner_pods(self, **match: str) -> list[dict[str, Any]]:
        return [p for p in self.runner_status()["pods"] if all(p.get(k) == v for k, v in match.items())]

    def operator_ready(self) -> bool:
        return any(
            p["ready"]
            for p in self.runner_pods(kind=WorkloadKind.OPERATOR, namespace=self.layout.system_namespace)
        )

    def router_url(self) -> str | None:
        """The router pod's address (its pod IP), once its process is ready."""
        cr = self.cr()
        port = int(((cr or {}).get("spec") or {}).get("router", {}).get("port", 8000))
        for pod in self.runner_pods(kind=WorkloadKind.ROUTER, namespace=self.layout.deployment_namespace):
            if pod["ready"]:
                return f"http://{pod['ip']}:{port}"
        return None

    def cr(self) -> dict[str, Any] | None:
        if self.cr_name is None:
            return None
        try:
            return _as_dict(
                self.pd.get(PrfaasDeployment, self.cr_name, namespace=self.layout.deployment_namespace)
            )
        except ApiError as err:
            if err.status.code == 404:
                return None
            raise

    def condition(self, kind: str) -> dict[str, Any] | None:
        for condition in ((self.cr() or {}).get("status") or {}).get("conditions") or []:
            if condition.get("type") == kind:
                found: dict[str, Any] = condition
                return found
        return None

    def is_ready(self) -> bool:
        condition = self.condition("Ready")
        return condition is not None and condition.get("status") == "True"

    def events(self, reasons: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Events about the CR (this very object, not an earlier one of the same name), oldest first."""
        uid = ((self.cr() or {}).get("metadata") or {}).get("uid")
        found = []
        for event in self.pd.list(Event, namespace=self.layout.deployment_namespace):
            item = _as_dict(event)
            involved = item.get("involvedObject") or {}
            ours = involved.get("kind") == KIND and uid is not None and involved.get("uid") == uid
            if ours and (reasons is None or item.get("reason") in reasons):
                found.append(item)
        return sorted(found, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))

    def pods(self, cluster: Cluster) -> list[dict[str, Any]]:
        client = self.pd if cluster is Cluster.PD else self.prfaas
        return [_as_dict(p) for p in client.list(Pod, namespace=self.layout.deployment_namespace)]

    def router_config(self) -> dict[str, Any] | None:
        """The router config the operator wrote (the ConfigMap's document)."""
        if self.cr_name is None:
            return None
        try:
            found = _as_dict(
                self.pd.get(
                    ConfigMap, f"{self.cr_name}-router-config", namespace=self.layout.deployment_namespace
                )
            )
        except ApiError as err:
            if err.status.code == 404:
                return None
            raise
        text = (found.get("data") or {}).get("router-config.json")
        return json.loads(text) if text else None

    def set_down(self, entries: Sequence[str]) -> None:
        """Hold the processes of these clusters or pods (``cluster`` or ``cluster/ns/pod``) down, or none."""
        path = self.runner_dir / CONTROL_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"down": list(entries)}))
        os.replace(tmp, path)

    # ---- the CR ---------------------------------------------------------------------------------

    def apply(self, cr: Mapping[str, Any]) -> None:
        self.cr_name = str(cr["metadata"]["name"])
        self.pd.apply(PrfaasDeployment.from_dict(dict(cr)), field_manager=FIELD_MANAGER, force=True)

    def patch_spec(self, spec_patch: Mapping[str, Any]) -> None:
        assert self.cr_name is not None
        self.pd.patch(
            PrfaasDeployment,
            self.cr_name,
            {"spec": dict(spec_patch)},
            namespace=self.layout.deployment_namespace,
            patch_type=PatchType.MERGE,
        )

    def wait_ready(self, timeout_s: float = 180) -> None:
        def ready() -> bool:
            return self.is_ready() and self.router_url() is not None

        try:
            wait_until(
                f"PrfaasDeployment {self.cr_name} to be Ready with its router serving", ready, timeout_s
            )
        except LiveSystemError as err:
            raise LiveSystemError(f"{err}; Ready condition: {self.condition('Ready')}") from None

    def delete_cr(self, timeout_s: float = 90) -> None:
        if self.cr_name is None:
            return
        try:
            self.pd.delete(PrfaasDeployment, self.cr_name, namespace=self.layout.deployment_namespace)
        except ApiError as err:
            if err.status.code != 404:
                raise
        wait_until(f"PrfaasDeployment {self.cr_name} to be deleted", lambda: self.cr() is None, timeout_s)

    # ---- tear-down ------------------------------------------------------------------------------

    def keep_container_logs(self) -> None:
        """Copy the real nodes' logs of this system's pods into the work dir: the kubelet deletes
        them with their pods, and a failed test's router and operator logs are what explain it.
        Cheap to call often (a rollout's old pods): only files that grew are copied again."""
        namespaces = (self.layout.system_namespace, self.layout.deployment_namespace)
        for cluster, info in self.testbed.clusters.items():
            logs = info.real_node.pod_logs if info.real_node is not None else None
            pod_dirs = sorted(logs.glob("*_*")) if logs is not None and logs.is_dir() else []
            for pod_dir in (d for d in pod_dirs if d.name.split("_", 1)[0] in namespaces):
                kept = self.work_dir / "pod-logs" / cluster.value / pod_dir.name
                try:
                    shutil.copytree(pod_dir, kept, copy_function=_copy_if_grown, dirs_exist_ok=True)
                except (OSError, shutil.Error) as err:  # a pod going away meanwhile
                    log.warning("container logs of %s not kept: %s", pod_dir.name, err)

    def stop(self, *, uninstall: bool = True) -> list[str]:
        """Undo start(); returns problems met on the way (each step is tried regardless)."""
        problems: list[str] = []
        self.keep_container_logs()
        if self.cr_name is not None:
            try:
                self.delete_cr()
            except (LiveSystemError, ApiError) as err:
                problems.append(f"CR: {err}")
        if uninstall:
            for cluster, release in (
                (Cluster.PD, self.layout.operator_release),
                (Cluster.PRFAAS, self.layout.access_release),
            ):
                done = subprocess.run(
                    [
                        str(self.testbed.helm),
                        "uninstall",
                        release,
                        "--kubeconfig",
                        str(self.testbed.kubeconfig(cluster)),
                        "--namespace",
                        self.layout.system_namespace,
                        "--ignore-not-found",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=False,
                )
                if done.returncode != 0:
                    problems.append(f"helm uninstall {release}: {done.stderr.strip()[-500:]}")
            try:
                self.pd.delete(Secret, self.layout.secret_name, namespace=self.layout.deployment_namespace)
            except ApiError as err:
                if err.status.code != 404:
                    problems.append(f"Secret: {err.status.message}")
        if self.runner is not None and self.runner.poll() is None:
            self.runner.terminate()
            try:
                self.runner.wait(timeout=60)
            except subprocess.TimeoutExpired:
                problems.append("the runner did not stop within 60 s; killed")
                self.runner.kill()
                self.runner.wait(timeout=10)
        if self.prometheus is not None:
            self.prometheus.stop()
        self.pd.close()
        self.prfaas.close()
        return problems
