"""The kube adapter's seams: kubeconfig vetting, error -> condition mapping, each verb's translation (no cluster)."""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import httpx2
import pytest
import yaml
from lightkube import ApiError
from prfaas_core.vocabulary import KIND
from prfaas_operator.adapters.kube import (
    Cluster,
    ClusterError,
    Clusters,
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


def test_other_failures_are_unreachable_or_an_api_error() -> None:
    tls = describe_failure(ssl.SSLError("bad cert"), cluster="PD cluster", server="s", action="a")
    assert (tls.reason, tls.message) == ("Unreachable", "cannot reach the PD cluster at s: SSLError")
    failed = describe_failure(
        api_error(500, "etcd down"), cluster="PD cluster", server="s", action="get Pod a/b"
    )
    assert (failed.reason, failed.message) == (
        "ApiError",
        "PD cluster: get Pod a/b failed with HTTP 500: etcd down",
    )


# ---- the verbs: each translates its failures in the one place (no cluster: a client that fails) ----


class FailingClient:
    """A lightkube AsyncClient whose every request raises `error` (after `objects`, for list/watch)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.config = SimpleNamespace(cluster=SimpleNamespace(server="https://user:pw@10.0.0.1:6443"))

    async def fail(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error

    get = create = replace = delete = patch = fail

    def list(self, *args: Any, **kwargs: Any) -> Any:
        error = self.error

        class Listing:
            resourceVersion = "1"

            def __aiter__(self) -> Any:
                return self

            async def __anext__(self) -> Any:
                raise error

        return Listing()

    async def watch(self, *args: Any, **kwargs: Any) -> AsyncIterator[tuple[str, Any]]:
        raise self.error
        yield  # an async generator


def failing(error: BaseException) -> Cluster:
    client: Any = FailingClient(error)
    return Cluster("PrfaaS cluster", client, client)


MANIFEST = {"kind": "ConfigMap", "metadata": {"name": "b", "namespace": "a"}}


async def watched(cluster: Cluster) -> list[tuple[str, dict[str, Any]]]:
    return [event async for event in cluster.watch("Pod", labels={}, resource_version="1")]


VERBS: dict[str, Callable[[Cluster], Awaitable[Any]]] = {
    "apply ConfigMap a/b": lambda c: c.apply(MANIFEST),
    "create ConfigMap a/b": lambda c: c.create_if_missing(MANIFEST),
    "replace ConfigMap a/b": lambda c: c.replace(MANIFEST),
    "get Pod a/b": lambda c: c.get("Pod", "b", "a"),
    "list Pod in namespace a": lambda c: c.list("Pod", namespace="a", labels={}),
    "watch Pod": watched,
    "delete Pod a/b": lambda c: c.delete("Pod", "b", "a"),
    f"patch the status of {KIND} a/b": lambda c: c.patch_status("b", "a", {}, "7"),
}


def translated(error: BaseException, verb: str) -> ClusterError:
    with pytest.raises(ClusterError) as caught:
        asyncio.run(VERBS[verb](failing(error)))
    assert caught.value.__cause__ is error
    return caught.value


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_translates_transport_tls_and_api_failures_naming_itself(verb: str) -> None:
    refused = translated(httpx2.ConnectError("All connection attempts failed"), verb)
    assert (refused.problem.reason, refused.problem.message) == (
        "Unreachable",
        "cannot reach the PrfaaS cluster at https://10.0.0.1:6443: connection refused",
    )
    assert translated(ssl.SSLError("handshake"), verb).problem.message.endswith(": SSLError")
    denied = translated(api_error(403, "no"), verb).problem
    assert (denied.reason, denied.message) == ("Forbidden", f"PrfaaS cluster: {verb} is forbidden: no")
    assert translated(api_error(401, "Unauthorized"), verb).problem.message == (
        f"PrfaaS cluster at https://10.0.0.1:6443 rejected the credentials ({verb}): expired, revoked or unknown"
    )
    assert translated(api_error(500, "boom"), verb).problem.reason == "ApiError"


@pytest.mark.parametrize("verb", VERBS)
def test_a_bug_in_a_verb_is_not_translated(verb: str) -> None:
    with pytest.raises(KeyError):
        asyncio.run(VERBS[verb](failing(KeyError("bug"))))


@pytest.mark.parametrize(
    ("verb", "code", "answer"),
    [
        ("create ConfigMap a/b", 409, False),
        ("replace ConfigMap a/b", 409, False),
        ("get Pod a/b", 404, None),
        ("delete Pod a/b", 404, False),
        (f"patch the status of {KIND} a/b", 404, False),
        (f"patch the status of {KIND} a/b", 409, False),
    ],
)
def test_the_codes_a_verb_expects_are_answers(verb: str, code: int, answer: object) -> None:
    assert asyncio.run(VERBS[verb](failing(api_error(code, "x")))) == answer
    assert translated(api_error(422, "x"), verb).problem.reason == "ApiError"  # another code fails


def test_a_missing_collection_is_a_kind_not_served_and_an_old_watch_expired() -> None:
    missing = api_error(404, "the server could not find the requested resource")
    not_served = translated(missing, "list Pod in namespace a").problem
    assert (not_served.reason, not_served.message) == ("NotServed", "the PrfaaS cluster serves no Pod")
    expired = translated(api_error(410, "too old resource version"), "watch Pod").problem
    assert (expired.reason, expired.message) == ("Expired", "PrfaaS cluster: watch of Pod expired")


def test_a_path_the_apiserver_does_not_serve_answers_like_a_missing_collection() -> None:
    """A real kube-apiserver answers the path of a group it does not serve (no LeaderWorkerSet
    CRD) with "404 page not found" in text, which lightkube raises as a bare HTTPStatusError: the
    kind is not served, and a get finds nothing; another such code is an API error."""

    def text(code: int) -> httpx2.HTTPStatusError:
        url = "https://127.0.0.1:6443/apis/leaderworkerset.x-k8s.io/v1/namespaces/a/leaderworkersets"
        request = httpx2.Request("GET", url)
        response = httpx2.Response(code, text="404 page not found", request=request)
        return httpx2.HTTPStatusError("404 page not found", request=request, response=response)

    not_served = translated(text(404), "list Pod in namespace a").problem
    assert (not_served.reason, not_served.message) == ("NotServed", "the PrfaaS cluster serves no Pod")
    assert asyncio.run(VERBS["get Pod a/b"](failing(text(404)))) is None
    failed = translated(text(503), "get Pod a/b").problem
    assert (failed.reason, failed.message) == ("ApiError", "PrfaaS cluster: get Pod a/b failed with HTTP 503")


def test_the_kubeconfig_secret_missing_unreachable_or_forbidden() -> None:
    def secret(error: BaseException) -> ClusterError:
        client: Any = FailingClient(error)
        clusters = Clusters(Cluster("PD cluster", client, client))
        with pytest.raises(ClusterError) as caught:
            asyncio.run(clusters.prefill_cluster("ns", REF))
        assert caught.value.__cause__ is error
        return caught.value

    missing = secret(api_error(404, "not found")).problem
    assert (missing.reason, missing.message) == (
        "SecretNotFound",
        "Secret ns/remote (the PrfaaS cluster's kubeconfig) not found",
    )
    down = secret(httpx2.ReadTimeout("slow")).problem
    assert (down.reason, down.message) == (
        "Unreachable",
        "cannot reach the PD cluster at https://10.0.0.1:6443: timed out",
    )
    denied = secret(api_error(403, "no")).problem
    assert (denied.reason, denied.message) == (
        "Forbidden",
        "PD cluster: get Secret ns/remote is forbidden: no",
    )


def test_an_http2_connection_closed_on_rejected_credentials_is_diagnosed_over_http1() -> None:
    """kube-apiserver closes (GOAWAY) an HTTP/2 connection whose token it rejects instead of
    answering 401: one request over HTTP/1.1 (the watch client) tells Unauthorized from Unreachable."""
    closed = httpx2.RemoteProtocolError("<ConnectionTerminated error_code:0>")
    unreachable = translated(closed, "get Pod a/b").problem
    assert unreachable.reason == "Unreachable"
    http2: Any = FailingClient(closed)
    revoked: Any = FailingClient(api_error(401, "Unauthorized"))
    diagnosed = asyncio.run(Cluster("PrfaaS cluster", http2, revoked).diagnosed(unreachable))
    assert diagnosed.reason == "Unauthorized" and "expired, revoked or unknown" in diagnosed.message
    down: Any = FailingClient(httpx2.ConnectError("All connection attempts failed"))
    assert asyncio.run(Cluster("PrfaaS cluster", down, down).diagnosed(unreachable)) == unreachable
