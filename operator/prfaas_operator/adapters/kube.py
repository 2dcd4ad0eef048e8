"""The only code that talks to Kubernetes API servers: lightkube AsyncClients, per cluster.

The operator's own (PD) cluster is reached the way kopf logs in (in-cluster service account,
else KUBECONFIG); the PrfaaS cluster through a self-contained kubeconfig in a Secret, with
clients of its own (never the process-global config). Clients are shared by every CR whose
Secret holds the same kubeconfig; a Secret is read again every SECRET_RECHECK_SECONDS, and at
the next try after its cluster failed (rejected credentials, say), so a rotated kubeconfig (a new
token) gets new clients without a restart and an unchanged one costs nothing to rebuild.

Every failure leaves this module as a ClusterError carrying a Problem: a condition reason
(Unreachable, Unauthorized, Forbidden, SecretNotFound, InvalidKubeconfig, ApiError) and a
message naming the cluster, server, object or verb. Kubeconfig contents, tokens and headers
never appear in a message or a log line.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import hashlib
import importlib.util
import logging
import time
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx2
import yaml
from lightkube import ApiError, AsyncClient, ConfigError, KubeConfig
from lightkube.core.resource import NamespacedResource
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.authorization_v1 import ResourceAttributes, SelfSubjectAccessReviewSpec
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.authorization_v1 import SelfSubjectAccessReview
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import ConfigMap, Namespace, Pod, Secret, Service, ServiceAccount
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding
from lightkube.types import PatchType
from prfaas_core.vocabulary import (
    CLAIM_KIND,
    CLAIM_PLURAL,
    GROUP,
    INFERENCE_POOL_GROUP,
    INFERENCE_POOL_KIND,
    INFERENCE_POOL_PLURAL,
    INFERENCE_POOL_VERSION,
    KIND,
    LWS_GROUP,
    LWS_KIND,
    LWS_PLURAL,
    LWS_VERSION,
    MANAGER,
    PLURAL,
    POOL_KIND,
    POOL_PLURAL,
    VERSION,
)

from prfaas_operator.api import SecretKeyRef
from prfaas_operator.planning.status import Problem

log = logging.getLogger(__name__)

FIELD_MANAGER = MANAGER

UNREACHABLE = "Unreachable"
UNAUTHORIZED = "Unauthorized"
FORBIDDEN = "Forbidden"
SECRET_NOT_FOUND = "SecretNotFound"
INVALID_KUBECONFIG = "InvalidKubeconfig"
API_ERROR = "ApiError"
EXPIRED = "Expired"
NOT_SERVED = "NotServed"
"""The cluster serves no such kind (e.g. LeaderWorkerSet where lws is not installed)."""

# Short timeouts: a dead remote cluster must not stall a reconcile of the local side for long.
REQUEST_TIMEOUT = httpx2.Timeout(10.0, connect=3.0)
HTTP2 = importlib.util.find_spec("h2") is not None  # httpx2 speaks HTTP/2 only with h2 installed

PrfaasDeploymentResource = create_namespaced_resource(GROUP, VERSION, KIND, PLURAL)
LeaderWorkerSetResource = create_namespaced_resource(LWS_GROUP, LWS_VERSION, LWS_KIND, LWS_PLURAL)
InferencePoolResource = create_namespaced_resource(
    INFERENCE_POOL_GROUP, INFERENCE_POOL_VERSION, INFERENCE_POOL_KIND, INFERENCE_POOL_PLURAL
)
PrfaasPoolResource = create_namespaced_resource(GROUP, VERSION, POOL_KIND, POOL_PLURAL)
PrfaasPoolClaimResource = create_namespaced_resource(GROUP, VERSION, CLAIM_KIND, CLAIM_PLURAL)

# Any: lightkube overloads its methods per resource flavour; this table mixes them.
_KINDS: dict[str, Any] = {
    "Namespace": Namespace,
    "StatefulSet": StatefulSet,
    "Service": Service,
    "ConfigMap": ConfigMap,
    "Deployment": Deployment,
    "Pod": Pod,
    "ServiceAccount": ServiceAccount,
    "Role": Role,
    "RoleBinding": RoleBinding,
    "Lease": Lease,
    "PodDisruptionBudget": PodDisruptionBudget,
    KIND: PrfaasDeploymentResource,
    LWS_KIND: LeaderWorkerSetResource,
    INFERENCE_POOL_KIND: InferencePoolResource,
    POOL_KIND: PrfaasPoolResource,
    CLAIM_KIND: PrfaasPoolClaimResource,
}


class ClusterError(Exception):
    """A cluster could not be used; `problem` is the condition reason and message."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(f"{problem.reason}: {problem.message}")
        self.problem = problem


def redacted_server(url: str) -> str:
    """The server URL without any user:password part."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _transport_cause(exc: httpx2.TransportError) -> str:
    if isinstance(exc, httpx2.TimeoutException):
        return "timed out"
    cause = str(exc) or type(exc).__name__
    if "refused" in cause.lower() or "all connection attempts failed" in cause.lower():
        return "connection refused"
    return cause


def describe_failure(exc: BaseException, *, cluster: str, server: str, action: str) -> Problem:
    """A Problem for an exception raised while doing `action` against `cluster` at `server`."""
    if isinstance(exc, ApiError):
        code = exc.status.code or exc.response.status_code
        detail = exc.status.message or exc.status.reason or f"HTTP {code}"
        if code == 403:
            return Problem(FORBIDDEN, f"{cluster}: {action} is forbidden: {detail}")
        if code == 401:
            return Problem(
                UNAUTHORIZED,
                f"{cluster} at {server} rejected the credentials ({action}): expired, revoked or unknown",
            )
        return Problem(API_ERROR, f"{cluster}: {action} failed with HTTP {code}: {detail}")
    if isinstance(exc, httpx2.HTTPStatusError):  # an answer that is no Status: see _Request
        return Problem(API_ERROR, f"{cluster}: {action} failed with HTTP {exc.response.status_code}")
    if isinstance(exc, httpx2.TransportError):
        return Problem(UNREACHABLE, f"cannot reach the {cluster} at {server}: {_transport_cause(exc)}")
    if isinstance(exc, OSError):  # e.g. an ssl.SSLError raised while connecting
        return Problem(UNREACHABLE, f"cannot reach the {cluster} at {server}: {type(exc).__name__}")
    raise exc


@dataclass
class Cluster:
    """One cluster: its clients plus how to name it in messages.

    Requests go over HTTP/2 when h2 is installed (as client-go does): the concurrent requests of
    every reconcile share one TLS connection instead of exhausting a pool and re-handshaking.
    Watches get an HTTP/1.1 client of their own: with httpx2's HTTP/2, a long-lived streaming
    watch stalls the other streams of its connection.
    """

    name: str  # "PD cluster", "PrfaaS cluster"
    client: AsyncClient
    watch_client: AsyncClient

    @classmethod
    def connect(cls, name: str, config: KubeConfig, *, trust_env: bool) -> Cluster:
        def client(http2: bool) -> AsyncClient:
            return AsyncClient(
                config=config,
                field_manager=FIELD_MANAGER,
                timeout=REQUEST_TIMEOUT,
                trust_env=trust_env,
                http2=http2,
            )

        return cls(name, client(http2=HTTP2), client(http2=False))

    @property
    def server(self) -> str:
        return redacted_server(self.client.config.cluster.server)

    def _failure(self, exc: BaseException, action: str) -> ClusterError:
        return ClusterError(describe_failure(exc, cluster=self.name, server=self.server, action=action))

    def _request(self, action: str, *, answers: Collection[int] = ()) -> _Request:
        """Where a request's failures become ClusterErrors naming `action` (see _Request)."""
        return _Request(self, action, answers)

    async def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply with our field manager, forcing ownership; returns the live object."""
        kind, metadata = manifest["kind"], manifest["metadata"]
        resource = _KINDS[kind]
        namespace = metadata.get("namespace") if issubclass(resource, NamespacedResource) else None
        action = f"apply {kind} {_where(metadata.get('name'), namespace)}"
        started = time.monotonic()
        with self._request(action):
            applied = await self.client.patch(
                resource,
                metadata["name"],
                dict(manifest),
                namespace=namespace,
                patch_type=PatchType.APPLY,
                field_manager=FIELD_MANAGER,
                force=True,
            )
        log.debug("%s: %s took %.3fs", self.name, action, time.monotonic() - started)
        return _as_dict(applied)

    async def create_if_missing(self, manifest: Mapping[str, Any]) -> bool:
        """Create the object unless it exists (one request either way); True when it was created."""
        return await self._write_unless_conflict("create", manifest)

    async def replace(self, manifest: Mapping[str, Any]) -> bool:
        """Write the object whole (PUT); False when its metadata.resourceVersion is no longer current."""
        return await self._write_unless_conflict("replace", manifest)

    async def _write_unless_conflict(self, verb: str, manifest: Mapping[str, Any]) -> bool:
        """POST (create) or PUT (replace); False on 409 Conflict (exists, or changed since read)."""
        kind, metadata = manifest["kind"], manifest["metadata"]
        action = f"{verb} {kind} {_where(metadata.get('name'), metadata.get('namespace'))}"
        obj = _KINDS[kind].from_dict(dict(manifest))
        with self._request(action, answers=(409,)):
            await (self.client.create(obj) if verb == "create" else self.client.replace(obj))
            return True
        return False

    async def probe(self) -> None:
        """One cheap request; raises ClusterError when the cluster does not answer properly."""
        await self.get("Namespace", "default")

    async def diagnosed(self, problem: Problem) -> Problem:
        """Why the cluster looked unreachable, asked once over HTTP/1.1: kube-apiserver answers an
        HTTP/2 request whose credentials it rejects by closing the connection (GOAWAY), not with
        401, so an expired or revoked token would read as Unreachable."""
        if problem.reason != UNREACHABLE or not HTTP2:
            return problem
        try:
            with self._request("get Namespace default", answers=(404,)):
                await self.watch_client.get(Namespace, "default")
        except ClusterError as err:
            if err.problem.reason == UNAUTHORIZED:
                return err.problem
        return problem

    async def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        with self._request(f"get {kind} {_where(name, namespace)}", answers=(404,)):
            return _as_dict(await self.client.get(_KINDS[kind], name, namespace=namespace))
        return None

    async def list(
        self, kind: str, *, namespace: str | None, labels: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        """Objects of `kind` matching `labels`, in `namespace` or (None) in all namespaces."""
        objects, _ = await self.list_with_version(kind, namespace=namespace, labels=labels)
        return objects

    async def list_with_version(
        self, kind: str, *, namespace: str | None, labels: Mapping[str, str]
    ) -> tuple[builtins.list[dict[str, Any]], str]:
        """Like list, plus the collection's resourceVersion (where a watch continues from)."""
        action = f"list {kind} in {f'namespace {namespace}' if namespace else 'all namespaces'}"
        resource = _KINDS[kind]
        selector: dict[str, Any] = dict(labels)
        with self._request(action, answers=(404,)) as request:
            if issubclass(resource, NamespacedResource):
                listing = self.client.list(resource, namespace=namespace or "*", labels=selector)
            else:
                listing = self.client.list(resource, labels=selector)
            objects = [_as_dict(item) async for item in listing]
            return objects, listing.resourceVersion
        # a collection that is not there: the kind is not served
        raise ClusterError(Problem(NOT_SERVED, f"the {self.name} serves no {kind}")) from request.answer

    async def watch(
        self, kind: str, *, labels: Mapping[str, str], resource_version: str, namespace: str | None = None
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(event type, object) of `kind` in `namespace` (None: all) from `resource_version` on.

        Raises ClusterError; reason Expired when the version is too old (HTTP 410: list again).
        """
        selector: dict[str, Any] = dict(labels)
        with self._request(f"watch {kind}", answers=(410,)) as request:
            async for event, obj in self.watch_client.watch(
                _KINDS[kind],
                namespace=namespace or "*",
                labels=selector,
                resource_version=resource_version,
                server_timeout=300,
            ):
                yield event, _as_dict(obj)
        if request.answer is not None:
            raise ClusterError(Problem(EXPIRED, f"{self.name}: watch of {kind} expired")) from request.answer

    async def may_list_everywhere(self, kinds: Collection[str]) -> bool:
        """Whether this identity may list and watch every one of `kinds` in all namespaces, as the
        API server answers a SelfSubjectAccessReview for each (which anyone may ask, and which
        lists nothing); False when it says no or cannot answer."""
        for kind, verb in ((kind, verb) for kind in kinds for verb in ("list", "watch")):
            api = _KINDS[kind]._api_info
            review = SelfSubjectAccessReview(
                spec=SelfSubjectAccessReviewSpec(
                    resourceAttributes=ResourceAttributes(
                        group=api.resource.group, resource=api.plural, verb=verb, namespace=""
                    )
                )
            )
            try:
                with self._request(f"review whether it may {verb} {kind} in all namespaces"):
                    answer = await self.client.create(review)
            except ClusterError as err:
                log.info("%s; taking it as no", err.problem.message)
                return False
            if answer.status is None or not answer.status.allowed:
                return False
        return True

    async def delete(self, kind: str, name: str, namespace: str | None = None) -> bool:
        """Delete (background propagation); False when it was already gone."""
        with self._request(f"delete {kind} {_where(name, namespace)}", answers=(404,)):
            await self.client.delete(_KINDS[kind], name, namespace=namespace)
            return True
        return False

    async def patch_status(
        self,
        name: str,
        namespace: str,
        status: Mapping[str, Any],
        resource_version: str | None,
        *,
        kind: str = KIND,
    ) -> bool:
        """Merge-patch the status of one of our kinds (a PrfaasDeployment unless `kind` names
        another); False when resourceVersion no longer matches (409) or the object is gone."""
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        with self._request(f"patch the status of {kind} {namespace}/{name}", answers=(404, 409)):
            await self.client.patch(
                _KINDS[kind].Status,
                name,
                body,
                namespace=namespace,
                patch_type=PatchType.MERGE,
                field_manager=FIELD_MANAGER,
            )
            return True
        return False

    async def set_finalizers(
        self, kind: str, name: str, namespace: str, finalizers: Sequence[str], resource_version: str
    ) -> bool:
        """Write an object's finalizers whole, as they were read at `resource_version`; False when it
        changed since (409) or is gone."""
        body = {"metadata": {"finalizers": list(finalizers), "resourceVersion": resource_version}}
        with self._request(f"set the finalizers of {kind} {namespace}/{name}", answers=(404, 409)):
            await self.client.patch(_KINDS[kind], name, body, namespace=namespace, patch_type=PatchType.MERGE)
            return True
        return False

    async def close(self) -> None:
        await self.client.close()
        await self.watch_client.close()


class _Request:
    """A context for one request of `cluster`: the one place its failures are translated.

    An HTTP error whose code is in `answers` is the API's answer, not a failure: it is kept in
    `answer` and the block ends (the code after it handles the answer). lightkube raises it as an
    ApiError when the body is a Status, and as a bare HTTPStatusError otherwise: the path of a
    group the apiserver does not serve (no LeaderWorkerSet CRD) answers "404 page not found" in
    text. Any other HTTP error, a transport error or an OSError (an ssl.SSLError while
    connecting) leaves as a ClusterError (describe_failure: reason and message, never the
    request's headers); anything else passes.
    """

    def __init__(self, cluster: Cluster, action: str, answers: Collection[int]) -> None:
        self.cluster, self.action, self.answers = cluster, action, answers
        self.answer: httpx2.HTTPStatusError | None = None

    def __enter__(self) -> _Request:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        if isinstance(exc, httpx2.HTTPStatusError) and _code(exc) in self.answers:
            self.answer = exc
            return True
        if isinstance(exc, (httpx2.HTTPStatusError, httpx2.TransportError, OSError)):
            raise self.cluster._failure(exc, self.action) from exc
        return False


def _code(exc: httpx2.HTTPStatusError) -> int:
    return (exc.status.code if isinstance(exc, ApiError) else None) or exc.response.status_code


def _where(name: str | None, namespace: str | None) -> str:
    return f"{namespace}/{name}" if namespace else str(name)


def _as_dict(obj: Any) -> dict[str, Any]:
    result: dict[str, Any] = obj if isinstance(obj, dict) else obj.to_dict()
    return result


# ---- kubeconfig from a Secret ------------------------------------------------------------------

_FILE_REFERENCES = {
    "cluster": ("certificate-authority",),
    "user": ("client-certificate", "client-key", "tokenFile", "exec", "auth-provider"),
}


def kubeconfig_from_secret_data(data: Mapping[str, str] | None, ref: SecretKeyRef, where: str) -> KubeConfig:
    """Parse and vet the kubeconfig in a Secret's data; raises ClusterError(InvalidKubeconfig).

    It must be self-contained: inline certificates and a token or client certificate. File
    paths, exec plugins and auth providers are refused: they would read the operator's own
    files or run commands named by whoever can write the Secret. Messages never quote the
    content (a YAML error would echo a line of it, which may be a token).
    """

    def invalid(why: str) -> ClusterError:
        return ClusterError(Problem(INVALID_KUBECONFIG, f"Secret {where} key {ref.key!r}: {why}"))

    encoded = (data or {}).get(ref.key)
    if encoded is None:
        keys = ", ".join(sorted(data or {})) or "none"
        raise invalid(f"no such key (keys: {keys})")
    try:
        document = yaml.safe_load(base64.b64decode(encoded, validate=True))
    except (binascii.Error, ValueError):
        raise invalid("not valid base64") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise invalid(f"not valid YAML{at}") from None
    if not isinstance(document, dict) or not document.get("clusters") or not document.get("contexts"):
        raise invalid("not a kubeconfig (no clusters or contexts)")
    for section, body_key in (("clusters", "cluster"), ("users", "user")):
        for entry in document.get(section) or []:
            body = (entry or {}).get(body_key) or {}
            refused = sorted(k for k in _FILE_REFERENCES[body_key] if k in body)
            if refused:
                uses = ", ".join(refused)
                raise invalid(f"not self-contained: {section} entry {entry.get('name')!r} uses {uses}")
    try:
        config = KubeConfig.from_dict(document)
        single = config.get()
    except (ConfigError, KeyError, TypeError, ValueError) as exc:
        what = f"missing {exc}" if isinstance(exc, KeyError) else type(exc).__name__
        if isinstance(exc, ConfigError):
            what = str(exc)  # lightkube's own messages name contexts, never credentials
        raise invalid(f"unusable: {what}") from None
    if single is None or not single.cluster.server:
        raise invalid("the current context has no server")
    return config


SECRET_RECHECK_SECONDS = 30.0
"""How long a Secret's client is used before the Secret is read again (rotation, deletion)."""


@dataclass
class _SecretUse:
    resource_version: str
    cluster: Cluster
    checked_at: float


class Clusters:
    """The local cluster plus PrfaaS clusters reached through kubeconfig Secrets.

    One client per distinct kubeconfig: CRs whose Secrets hold the same kubeconfig share it (and
    its one HTTP/2 connection); a rotated kubeconfig gets a new client. Clients are closed only at
    shutdown, so a reconcile never finds its client closed under its feet.
    """

    def __init__(self, local: Cluster) -> None:
        self.local = local
        self._by_secret: dict[tuple[str, str, str], _SecretUse] = {}
        self._by_content: dict[str, Cluster] = {}

    @classmethod
    def from_environment(cls) -> Clusters:
        """In-cluster service account if present, else KUBECONFIG (the same order kopf logs in with)."""
        return cls(Cluster.connect("PD cluster", KubeConfig.from_env(), trust_env=True))

    async def prefill_cluster(
        self, namespace: str, ref: SecretKeyRef | None, *, allow_cached: bool = False
    ) -> Cluster:
        """The PrfaaS cluster of a CR in `namespace`: its own client, or the local one when ref is None.

        allow_cached: when the Secret is gone, fall back to the last client built from it (a
        deletion of the CR together with its Secret can still clean up the remote side).
        """
        if ref is None:
            return Cluster("PrfaaS cluster (the operator's own)", self.local.client, self.local.watch_client)
        where = f"{namespace}/{ref.name}"
        key = (namespace, ref.name, ref.key)
        used = self._by_secret.get(key)
        if used is not None and time.monotonic() - used.checked_at < SECRET_RECHECK_SECONDS:
            return used.cluster
        secret: Secret | None = None
        with self.local._request(f"get Secret {where}", answers=(404,)) as request:
            secret = await self.local.client.get(Secret, ref.name, namespace=namespace)
        if secret is None:  # 404
            if allow_cached and used is not None:
                return used.cluster
            self._by_secret.pop(key, None)
            raise ClusterError(
                Problem(SECRET_NOT_FOUND, f"Secret {where} (the PrfaaS cluster's kubeconfig) not found")
            ) from request.answer
        version = (secret.metadata.resourceVersion if secret.metadata else None) or ""
        if used is None or used.resource_version != version:
            used = _SecretUse(version, self._client_for(secret.data, ref, where), 0.0)
            self._by_secret[key] = used
        used.checked_at = time.monotonic()
        return used.cluster

    def recheck(self, namespace: str, ref: SecretKeyRef | None) -> None:
        """Read this Secret again on its next use, not SECRET_RECHECK_SECONDS after the last read
        (its cluster failed: a rotated token or a fixed server may be there already)."""
        used = self._by_secret.get((namespace, ref.name, ref.key)) if ref is not None else None
        if used is not None:
            used.checked_at = float("-inf")

    def _client_for(self, data: Mapping[str, str] | None, ref: SecretKeyRef, where: str) -> Cluster:
        """The shared client of this kubeconfig, built (after vetting) the first time it is seen."""
        encoded = (data or {}).get(ref.key) or ""
        digest = hashlib.sha256(encoded.encode()).hexdigest()
        cluster = self._by_content.get(digest)
        if cluster is None:
            config = kubeconfig_from_secret_data(data, ref, where)
            cluster = self._by_content[digest] = Cluster.connect("PrfaaS cluster", config, trust_env=False)
            log.info("new client for the PrfaaS cluster of Secret %s at %s", where, cluster.server)
        return cluster

    async def close(self) -> None:
        for cluster in self._by_content.values():
            await cluster.close()
        self._by_content.clear()
        self._by_secret.clear()
        await self.local.close()
