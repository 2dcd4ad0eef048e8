"""The kube adapter's pure seams: kubeconfig vetting and error -> condition mapping (no cluster)."""

from __future__ import annotations

import base64
from typing import Any

import httpx2
import pytest
import yaml
from lightkube import ApiError
from prfaas_operator.adapters.kube import (
    ClusterError,
    describe_failure,
    kubeconfig_from_secret_data,
    redacted_server,
)
from prfaas_operator.api import SecretKeyRef

TOKEN = "s3cr3t-token-value"


def kubeconfig(user: dict[str, Any] | None = None, cluster: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": cluster or {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True},
            }
        ],
        "users": [{"name": "u", "user": user or {"token": TOKEN}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }


def data(document: Any, key: str = "kubeconfig") -> dict[str, str]:
    text = document if isinstance(document, str) else yaml.safe_dump(document)
    return {key: base64.b64encode(text.encode()).decode()}


REF = SecretKeyRef(name="remote", key="kubeconfig")


def refused(secret_data: dict[str, str] | None) -> str:
    with pytest.raises(ClusterError) as caught:
        kubeconfig_from_secret_data(secret_data, REF, "ns/remote")
    assert caught.value.problem.reason == "InvalidKubeconfig"
    message = caught.value.problem.message
    assert TOKEN not in message, "a credential leaked into a condition message"
    assert message.startswith("Secret ns/remote key 'kubeconfig': ")
    return message


def test_a_self_contained_kubeconfig_is_accepted() -> None:
    config = kubeconfig_from_secret_data(data(kubeconfig()), REF, "ns/remote")
    single = config.get()
    assert single is not None and single.cluster.server == "https://127.0.0.1:6443"


@pytest.mark.parametrize(
    ("secret_data", "why"),
    [
        (None, "no such key (keys: none)"),
        ({"other": "eA=="}, "no such key (keys: other)"),
        ({"kubeconfig": "%%% not base64"}, "not valid base64"),
        (data(f"users: [token: {TOKEN}\n  : ]"), "not valid YAML at line"),
        (data("just a string"), "not a kubeconfig"),
        (data(kubeconfig(user={"exec": {"command": "/bin/steal"}})), "uses exec"),
        (data(kubeconfig(user={"tokenFile": "/var/run/secrets/token"})), "uses tokenFile"),
        (
            data(kubeconfig(cluster={"server": "https://x", "certificate-authority": "/etc/ca"})),
            "certificate-authority",
        ),
        (data({**kubeconfig(), "current-context": "missing"}), "Context 'missing' not found"),
    ],
)
def test_bad_kubeconfigs_are_refused_with_the_reason_and_without_the_content(
    secret_data: dict[str, str] | None, why: str
) -> None:
    assert why in refused(secret_data)


def test_connection_refused_names_the_cluster_and_server() -> None:
    problem = describe_failure(
        httpx2.ConnectError("All connection attempts failed"),
        cluster="PrfaaS cluster",
        server="https://127.0.0.1:1",
        action="apply StatefulSet a/b",
    )
    assert (problem.reason, problem.message) == (
        "Unreachable",
        "cannot reach the PrfaaS cluster at https://127.0.0.1:1: connection refused",
    )
    timeout = describe_failure(httpx2.ReadTimeout("slow"), cluster="PrfaaS cluster", server="s", action="a")
    assert timeout.message.endswith("timed out")


def api_error(code: int, message: str) -> ApiError:
    request = httpx2.Request("PATCH", "https://127.0.0.1:6443/apis/apps/v1/namespaces/a/statefulsets/b")
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}
    return ApiError(request=request, response=httpx2.Response(code, json=body, request=request))


def test_forbidden_names_the_verb_and_resource() -> None:
    denied = 'statefulsets.apps "b" is forbidden: User "x" cannot patch resource "statefulsets" in the namespace "a"'
    problem = describe_failure(
        api_error(403, denied), cluster="PrfaaS cluster", server="s", action="apply StatefulSet a/b"
    )
    assert problem.reason == "Forbidden"
    assert (
        "apply StatefulSet a/b is forbidden" in problem.message
        and 'cannot patch resource "statefulsets"' in problem.message
    )
    unauthorized = describe_failure(
        api_error(401, "Unauthorized"), cluster="PrfaaS cluster", server="s", action="a"
    )
    assert unauthorized.reason == "Unauthorized"


def test_unexpected_exceptions_are_not_swallowed() -> None:
    with pytest.raises(KeyError):
        describe_failure(KeyError("bug"), cluster="c", server="s", action="a")


def test_server_urls_lose_any_userinfo() -> None:
    assert redacted_server("https://user:pass@10.0.0.1:6443/k8s") == "https://10.0.0.1:6443/k8s"
