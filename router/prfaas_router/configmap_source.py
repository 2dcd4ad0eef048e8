"""The router config straight from its ConfigMap, through the Kubernetes API (a watch).

A ConfigMap volume is refreshed by the kubelet on its own schedule (a minute or more, measured
in README): too slow for a drain, a failover or a planner's apply. So the router also watches
its one ConfigMap, with the pod's projected ServiceAccount token, which may only read that
ConfigMap (the operator writes the Role). The mounted file stays the start-up source and the
fallback while the API cannot be reached; both feed the same validation (``ConfigWatcher.offer``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

log = logging.getLogger("prfaas_router.configmap")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WATCH_SECONDS = 240
"""The apiserver ends each watch after this long; the router watches again from where it was."""
RETRY_MAX_SECONDS = 30.0

Offer = Callable[[bytes, str], bool]


class NotInCluster(Exception):
    """--config-map was given, but the process has no in-cluster credentials."""


class WatchEnded(Exception):
    """The apiserver ended the watch with an error event; ``expired`` (410): list again."""

    def __init__(self, message: str, *, expired: bool) -> None:
        super().__init__(message)
        self.expired = expired


@dataclass(frozen=True)
class ConfigMapRef:
    namespace: str
    name: str
    key: str

    @classmethod
    def parse(cls, value: str, key: str) -> ConfigMapRef:
        """``NAMESPACE/NAME`` (the flag's form)."""
        namespace, sep, name = value.partition("/")
        if not sep or not namespace or not name or "/" in name:
            raise ValueError(f"--config-map takes NAMESPACE/NAME, got {value!r}")
        return cls(namespace, name, key)

    def __str__(self) -> str:
        return f"configmap {self.namespace}/{self.name}"


@dataclass(frozen=True)
class InCluster:
    """Where the apiserver is and how to prove who we are: the pod's own ServiceAccount."""

    server: str
    token_path: Path
    ca_path: Path

    @classmethod
    def from_environment(cls, directory: Path = SERVICE_ACCOUNT_DIR) -> InCluster:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise NotInCluster(
                "--config-map needs in-cluster credentials: KUBERNETES_SERVICE_HOST is not set"
            )
        if not (directory / "token").is_file():
            raise NotInCluster(
                f"--config-map needs the pod's ServiceAccount token: no {directory / 'token'} "
                "(automountServiceAccountToken must be true)"
            )
        if ":" in host:
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", directory / "token", directory / "ca.crt")

    def headers(self) -> dict[str, str]:
        # read at every connection: the kubelet rotates a projected token
        return {"Authorization": f"Bearer {self.token_path.read_text().strip()}"}

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_path))


def config_of(configmap: dict[str, Any], key: str) -> bytes | None:
    """The config document in a ConfigMap object, or None when it has no such key."""
    value = (configmap.get("data") or {}).get(key)
    return value.encode() if isinstance(value, str) else None


class ConfigMapSource:
    """Lists, then watches, one ConfigMap; every version of its key is offered to the watcher."""

    def __init__(self, ref: ConfigMapRef, credentials: InCluster, offer: Offer) -> None:
        self.ref = ref
        self._credentials = credentials
        self._offer = offer
        self._path = f"/api/v1/namespaces/{quote(ref.namespace)}/configmaps"
        self._selector = f"metadata.name={ref.name}"
        self.connected = False
        self.last_error: str | None = None

    async def run(self) -> None:
        delay = 1.0
        while True:
            try:
                async with aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(sock_connect=5, sock_read=WATCH_SECONDS + 30),
                    connector=aiohttp.TCPConnector(ssl=self._credentials.ssl_context()),
                ) as session:
                    version = await self._list(session)
                    delay = 1.0
                    while True:
                        version = await self._watch(session, version)
            except WatchEnded as ended:
                if not ended.expired:
                    self._failed(str(ended))
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as err:
                self._failed(f"{type(err).__name__}: {err}")
            self.connected = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_SECONDS)

    async def _request(
        self, session: aiohttp.ClientSession, params: dict[str, str]
    ) -> aiohttp.ClientResponse:
        response = await session.get(
            self._credentials.server + self._path,
            params={"fieldSelector": self._selector, **params},
            headers=self._credentials.headers(),
        )
        if response.status != 200:
            body = (await response.text())[:300]
            response.release()
            raise ValueError(f"{self.ref}: the apiserver answered {response.status}: {body}")
        return response

    async def _list(self, session: aiohttp.ClientSession) -> str:
        async with await self._request(session, {}) as response:
            listed = await response.json()
        for item in listed.get("items") or []:
            self._take(item)
        self._connected()
        return str((listed.get("metadata") or {}).get("resourceVersion", ""))

    async def _watch(self, session: aiohttp.ClientSession, version: str) -> str:
        """One watch, until the apiserver ends it; returns the resourceVersion to go on from."""
        params = {
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        async with await self._request(session, params) as response:
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    code = obj.get("code")
                    raise WatchEnded(
                        f"{self.ref}: watch error {code}: {obj.get('message')}", expired=code == 410
                    )
                version = str((obj.get("metadata") or {}).get("resourceVersion", version))
                if kind in ("ADDED", "MODIFIED"):
                    self._take(obj)
                # DELETED: the last good config stays (the operator writes it again)
        return version

    def _take(self, configmap: dict[str, Any]) -> None:
        content = config_of(configmap, self.ref.key)
        if content is not None:
            self._offer(content, str(self.ref))

    def _connected(self) -> None:
        if not self.connected:
            log.info("%s: watching through the API", self.ref)
        self.connected = True
        self.last_error = None

    def _failed(self, why: str) -> None:
        if why != self.last_error:  # once per distinct cause, not once per retry
            log.warning("%s: %s; the mounted file is used meanwhile", self.ref, why)
        self.last_error = why
