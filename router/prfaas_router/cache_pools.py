"""Whether each cluster's shared KV pool serves: the router counts pool hits only while it does.

A cluster listed in the config's `cache_pools` runs SGLang HiCache on a Mooncake Store its
prefills share (the operator deploys the store's master). Every health interval the router GETs
the master's `health_url + "/health"`, every pool at once, with the health checks' timeout.
Mooncake's master answers 200 with a JSON object, `{"status":"ok","role":"leader",
"ha_state":"serving","service_ready":true,...}`; the pool is up only on such an answer
(`serving`). Anything else, no answer within the timeout, a refused connection, another status,
a body that is not that object or one whose state says otherwise, counts as down at once: a pool
that is down means per-instance radix caches (`policy.pool_hit`), never an error to a client,
and counting hits that are not there would send prompts to prefills that then compute them
whole.

A pool that comes back may have lost what it held (a restarted master knows no objects, and
the pages live in the engines' segments), so its index is cleared on every transition to up,
and the router learns prompts in it only while it is up (`Dispatcher._learn`). Each transition
is logged once and `prfaas_router_cache_pool_up{cluster}` says the state.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from prfaas_core.router_config import RouterConfig
from prfaas_core.routing.prefix_index import ClusterIndexes

from prfaas_router.http.client import Upstream, UpstreamError, target
from prfaas_router.metrics import RouterMetrics
from prfaas_router.periodic import Periodic

log = logging.getLogger("prfaas_router.cache_pools")

HEALTH_PATH = "/health"
MAX_HEALTH_BYTES = 64 * 1024
"""Mooncake's answer is about 120 bytes."""


def serving(status: int, body: bytes) -> str | None:
    """None when a master's /health answer says it serves, else why not (for the log)."""
    if status != 200:
        return f"HTTP {status}"
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return "the answer is not JSON"
    if not isinstance(answer, dict):
        return "the answer is not a JSON object"
    if answer.get("status") != "ok":
        return f"status {answer.get('status')!r}"
    if answer.get("service_ready", True) is not True:
        return "service_ready is not true"
    ha_state = answer.get("ha_state", "serving")
    if ha_state != "serving":
        return f"ha_state {ha_state!r}"
    return None


class CachePoolProbe(Periodic):
    """Probes the pools of the config in force; `up` is the set of clusters (routes) serving now."""

    def __init__(
        self,
        upstream: Upstream,
        metrics: RouterMetrics,
        config: Callable[[], RouterConfig | None],
        indexes: Callable[[], ClusterIndexes | None],
        *,
        interval_seconds: float,
        timeout_seconds: float,
    ) -> None:
        super().__init__(interval_seconds)
        self._upstream = upstream
        self._metrics = metrics
        self._config = config
        self._indexes = indexes
        self._timeout = timeout_seconds
        self.up: frozenset[str] = frozenset()
        self._state: dict[str, tuple[str, bool]] = {}  # cluster -> (health URL, up) at the last probe

    async def check_all(self) -> None:
        config = self._config()
        pools = dict(config.cache_pools) if config is not None else {}
        for cluster in set(self._state) - set(pools):
            del self._state[cluster]
            self._metrics.cache_pool_up.remove(cluster)
            log.info("cache pool %s is no longer configured", cluster)
        clusters = sorted(pools)
        answers = await asyncio.gather(*(self._check(pools[cluster].health_url) for cluster in clusters))
        for cluster, problem in zip(clusters, answers, strict=True):
            url = pools[cluster].health_url
            now_up = problem is None
            before = self._state.get(cluster)
            if before is None or before != (url, now_up):
                if now_up:
                    indexes = self._indexes()
                    if indexes is not None:  # what it held before is not known to be there now
                        indexes.pool(cluster).clear()
                    log.info("cache pool %s at %s is serving: its prefix hits count", cluster, url)
                else:
                    log.warning(
                        "cache pool %s at %s is down (%s): per-instance caches only", cluster, url, problem
                    )
            self._state[cluster] = (url, now_up)
            self._metrics.cache_pool_up.labels(cluster).set(1 if now_up else 0)
        self.up = frozenset(cluster for cluster, (_, up) in self._state.items() if up)

    async def _check(self, url: str) -> str | None:
        try:
            status, body = await self._upstream.get(
                target(url, HEALTH_PATH), self._timeout, max_bytes=MAX_HEALTH_BYTES
            )
        except TimeoutError:
            return f"no answer within {self._timeout:g} s"
        except UpstreamError as err:
            return repr(err)
        return serving(status, body)
