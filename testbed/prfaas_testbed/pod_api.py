"""The runner's reads and writes of the clusters, as a kubelet makes them for the pods it runs.

Pods and nodes to run, ConfigMaps for volumes, a pod-bound ServiceAccount token for the
operator's kubeconfig, and the pod's Ready condition and container status.
"""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import Any

import httpx2
import yaml
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.models.authentication_v1 import BoundObjectReference, TokenRequestSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Node, Pod, Secret, ServiceAccount

from prfaas_testbed.clusters import Cluster, Testbed
from prfaas_testbed.pod_workloads import PodFacts
from prfaas_testbed.runner_state import utc_now, write_atomically

log = logging.getLogger("prfaas_testbed.runner")

FIELD_MANAGER = "prfaas-testbed-runner"


def as_dict(obj: Any) -> dict[str, Any]:
    result: dict[str, Any] = obj if isinstance(obj, dict) else obj.to_dict()
    return result


class PodApi:
    """One client per cluster, with the calls the runner and its supervisors make."""

    def __init__(self, testbed: Testbed, token_seconds: int) -> None:
        self.testbed = testbed
        self._token_seconds = token_seconds
        self.clients = {
            cluster: AsyncClient(
                config=KubeConfig.from_file(testbed.kubeconfig(cluster)),
                field_manager=FIELD_MANAGER,
                trust_env=False,
            )
            for cluster in Cluster
        }
        self._nodes: dict[tuple[Cluster, str], dict[str, Any]] = {}

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()

    async def pods(self, cluster: Cluster, namespaces: tuple[str, ...]) -> list[dict[str, Any]]:
        pods: list[dict[str, Any]] = []
        for namespace in namespaces:
            pods += [as_dict(pod) async for pod in self.clients[cluster].list(Pod, namespace=namespace)]
        return pods

    async def node(self, cluster: Cluster, name: str) -> dict[str, Any] | None:
        key = (cluster, name)
        if key not in self._nodes:
            try:
                self._nodes[key] = as_dict(await self.clients[cluster].get(Node, name))
            except ApiError as err:
                if err.status.code == 404:
                    return None
                raise
        return self._nodes[key]

    async def volume_data(
        self, cluster: Cluster, namespace: str, kind: str, name: str
    ) -> dict[str, bytes] | None:
        """A ConfigMap's or Secret's keys as file contents, or None when it does not exist."""
        resource = Secret if kind == "Secret" else ConfigMap
        try:
            found = as_dict(await self.clients[cluster].get(resource, name, namespace=namespace))
        except ApiError as err:
            if err.status.code == 404:
                return None
            raise
        if resource is Secret:  # a Secret's data is base64, as binaryData is
            return {key: base64.b64decode(value) for key, value in (found.get("data") or {}).items()}
        data = {key: value.encode() for key, value in (found.get("data") or {}).items()}
        data.update({key: base64.b64decode(value) for key, value in (found.get("binaryData") or {}).items()})
        return data

    async def write_service_account_kubeconfig(self, facts: PodFacts, path: Path) -> None:
        """A kubeconfig for the pod's ServiceAccount (a pod-bound token), pointing at the pod's cluster.

        The operator pod runs in the PD cluster; the server and CA come from the testbed's admin
        kubeconfig of that cluster, the identity only from the token.
        """
        cluster = Cluster.PD
        request = ServiceAccount.Token(
            metadata=ObjectMeta(),
            spec=TokenRequestSpec(
                audiences=[],
                expirationSeconds=self._token_seconds,
                boundObjectRef=BoundObjectReference(
                    kind="Pod", apiVersion="v1", name=facts.name, uid=facts.uid
                ),
            ),
        )
        answer = await self.clients[cluster].create(request, facts.service_account, namespace=facts.namespace)
        token = answer.status.token if answer.status is not None else None
        if not token:
            raise OSError(f"no token for ServiceAccount {facts.namespace}/{facts.service_account}")
        admin = yaml.safe_load(self.testbed.kubeconfig(cluster).read_text())
        server = admin["clusters"][0]["cluster"]
        user = f"system:serviceaccount:{facts.namespace}:{facts.service_account}"
        document = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": cluster.value, "cluster": server}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {
                    "name": "pod",
                    "context": {"cluster": cluster.value, "user": user, "namespace": facts.namespace},
                }
            ],
            "current-context": "pod",
        }
        write_atomically(path, yaml.safe_dump(document).encode(), mode=0o600)

    async def patch_pod_readiness(
        self,
        cluster: Cluster,
        facts: PodFacts,
        *,
        ready: bool,
        running: bool,
        backoff: bool,
        restarts: int,
        waiting: tuple[str, str] | None = None,
    ) -> None:
        """Write Ready/ContainersReady and the container status as a kubelet would; `waiting`: the
        (reason, message) of a container that cannot start (e.g. ErrImagePull)."""
        now = utc_now()
        value = "True" if ready else "False"
        state: dict[str, Any]
        if running:
            state = {"running": {"startedAt": now}}
        elif waiting is not None:
            state = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
        else:
            reason = "CrashLoopBackOff" if backoff else "ContainerCreating"
            state = {"waiting": {"reason": reason}}
        container = facts.container
        body = {
            "status": {
                "conditions": [
                    {"type": "Ready", "status": value, "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": value, "lastTransitionTime": now},
                ],
                "containerStatuses": [
                    {
                        "name": container.get("name"),
                        "image": container.get("image", ""),
                        "imageID": "",
                        "ready": ready,
                        "started": running,
                        "restartCount": restarts,
                        "state": state,
                    }
                ],
            }
        }
        try:
            await self.clients[cluster].patch(Pod.Status, facts.name, body, namespace=facts.namespace)
        except ApiError as err:
            if err.status.code != 404:
                log.warning("%s/%s: cannot write readiness: %s", cluster.value, facts.key, err.status.message)
        except httpx2.TransportError as err:
            log.warning("%s/%s: cannot write readiness: %s", cluster.value, facts.key, err)
