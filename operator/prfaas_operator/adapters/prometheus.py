"""Prometheus adapter of the planner loop: the metrics contract over a window -> Observation or NoData,
each engine revision's figures for rollout analysis (PrometheusObserver.revisions), and the
offloaded attempts' KV handoffs for the data path's verdict (PrometheusObserver.handoffs).

It reads only names of `prfaas_core.metrics_contract`: the router's uncached-token histogram
(summed over routes: the uncached distribution the model needs), its output-token histogram,
requests_total (all outcomes: what was offered; and the 429s), decisions_total (the reroutes),
kv_egress_bytes_total, link_measured_bytes_per_second (the least of the router replicas'), and the
engines' sglang:num_queue_reqs. Histograms are
read with increase() over the window on their _bucket series; planning.observe_histograms turns
them into the Observation, as it does for the simulator.

Anything that keeps a faithful picture from being drawn is NoData with the cause, never zeros:
Prometheus unreachable or answering errors, the router's series missing or stale, too few
requests in the window, or a histogram that is not a distribution.

Series of one deployment are picked by the labels a Kubernetes scrape gives them: `namespace`
and `pod` (the router's pods are `<cr>-router-...`, the engines' `<cr>-prfaas-prefill-N`,
`<cr>-pd-prefill-N`, `<cr>-pd-decode-N`). All queries of one observation are evaluated at the
same instant, the one Prometheus reports for the first, so no local clock is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx2
from prfaas_core import metrics_contract as contract
from prfaas_core.planning import DEFAULT_MIN_REQUESTS, NoData, Observation, Reason, observe_histograms
from prfaas_core.vocabulary import ENGINE_ROLES, ROUTE_PRFAAS

from prfaas_operator.adapters.kube import redacted_server
from prfaas_operator.planning.analysis import Figures, figures_by_fingerprint
from prfaas_operator.planning.data_path import Handoffs
from prfaas_operator.planning.manifests import Names

DEFAULT_MAX_STALENESS_SECONDS = 120.0
"""The router's newest sample may be at most this old; older means it is no longer scraped."""
REQUEST_TIMEOUT_SECONDS = 10.0

ROLE_LABEL = "role"


@dataclass(frozen=True)
class SeriesSelector:
    """PromQL label matchers (without braces) for one deployment's router and engine series."""

    router: str
    engines: str
    engine_pod_regex: str
    """Regex on the pod name whose first group is the engine role."""

    @classmethod
    def for_deployment(cls, namespace: str, name: str, prefill_namespace: str) -> SeriesSelector:
        roles = "|".join(ENGINE_ROLES)
        namespaces = "|".join(_regex_literal(ns) for ns in sorted({namespace, prefill_namespace}))
        engine_pods = f"{_regex_literal(name)}-({roles})-[0-9]+"
        return cls(
            router=f'namespace="{namespace}",pod=~"{_promql_string(_regex_literal(Names.of(name).router))}-.+"',
            engines=f'namespace=~"{_promql_string(namespaces)}",pod=~"{_promql_string(engine_pods)}"',
            engine_pod_regex=engine_pods,
        )


class QueryError(Exception):
    """Prometheus answered a query with something other than HTTP 200 and a result."""


# Prometheus could not be talked to: no connection, or it dropped before an answer (a read
# timeout is told apart: "did not answer in time").
_UNREACHABLE = (
    httpx2.ConnectError,
    httpx2.ConnectTimeout,
    httpx2.NetworkError,
    httpx2.ProxyError,
    httpx2.RemoteProtocolError,
)


class _QueryClient:
    """Prometheus' instant-query API (GET /api/v1/query) on one HTTP connection pool.

    Credentials in the URL go out as basic auth; HTTP(S)_PROXY, NO_PROXY and SSL_CERT_FILE are
    honoured. A failed connection is tried once more at once: a dead Prometheus must not stall
    the loop for long.
    """

    def __init__(self, url: str, timeout_seconds: float) -> None:
        self._query_url = f"{url}/api/v1/query"
        self._http = httpx2.Client(
            timeout=timeout_seconds, transport=httpx2.HTTPTransport(retries=1), follow_redirects=False
        )

    def query(self, promql: str, params: Mapping[str, str] | None = None) -> Any:
        """The ``data.result`` of an instant query; raises httpx2 errors, QueryError or ValueError."""
        response = self._http.get(self._query_url, params={"query": promql, **(params or {})})
        if response.status_code != 200:
            raise QueryError(f"HTTP Status Code {response.status_code} ({response.content!r})")
        body = response.json()  # a ValueError when it is not JSON
        try:
            return body["data"]["result"]
        except (KeyError, TypeError):
            raise QueryError(f"no data.result in the answer: {response.text!r:.200}") from None

    def close(self) -> None:
        self._http.close()


class _Unusable(Exception):
    """An observation that cannot be made; carries the NoData to return."""

    def __init__(self, code: Reason, reason: str) -> None:
        super().__init__(reason)
        self.no_data = NoData(code, reason)


class PrometheusObserver:
    """Observes one Prometheus (one instance per URL; it keeps an HTTP session)."""

    def __init__(
        self,
        url: str,
        *,
        min_requests: float = DEFAULT_MIN_REQUESTS,
        max_staleness_seconds: float = DEFAULT_MAX_STALENESS_SECONDS,
        timeout_seconds: float = REQUEST_TIMEOUT_SECONDS,
    ) -> None:
        self.url = url.rstrip("/")
        self.where = redacted_server(self.url)
        self.min_requests = min_requests
        self.max_staleness_seconds = max_staleness_seconds
        self._client = _QueryClient(self.url, timeout_seconds)

    def close(self) -> None:
        self._client.close()

    def observe(self, selector: SeriesSelector, window_seconds: int) -> Observation | NoData:
        try:
            return self._observe(selector, window_seconds)
        except _Unusable as err:
            return err.no_data

    def _observe(self, selector: SeriesSelector, window_seconds: int) -> Observation | NoData:
        window = f"{window_seconds}s"
        router = selector.router
        count_name = f"{contract.UNCACHED_TOKENS}_count"
        at = self._fresh(count_name, router)
        by_route = {
            series["metric"].get("route", ""): _sample(series)[1]
            for series in self._query(f"sum by (route) (increase({count_name}{{{router}}}[{window}]))", at)
        }
        return observe_histograms(
            self._buckets(contract.UNCACHED_TOKENS, router, window, at),
            self._buckets(contract.OUTPUT_TOKENS, router, window, at),
            requests_by_route=by_route,
            window_seconds=window_seconds,
            arrival_rps=self._scalar(f"sum(rate({contract.REQUESTS_TOTAL}{{{router}}}[{window}]))", at),
            egress_bytes_per_second=self._scalar(
                f"sum(rate({contract.KV_EGRESS_BYTES_TOTAL}{{{router}}}[{window}]))", at
            ),
            queue_depths=self._queue_depths(selector, window, at),
            rejected_rps=self._event_rate(
                f'{contract.REQUESTS_TOTAL}{{{router},outcome="{contract.OUTCOME_REJECTED}"}}', window, at
            ),
            rerouted_rps=self._event_rate(
                f'{contract.DECISIONS_TOTAL}{{{router},reason=~"{"|".join(contract.REROUTE_REASONS)}"}}',
                window,
                at,
            ),
            # NaN (nothing measured lately) fails the comparison: no series, so None, never zero
            measured_link_bytes_per_second=self._scalar(
                f"min({contract.LINK_MEASURED_BYTES_PER_SECOND}{{{router}}} > 0)", at
            ),
            min_requests=self.min_requests,
            source=f"Prometheus, last {window}",
        )

    def revisions(self, selector: SeriesSelector, window_seconds: float) -> dict[str, Figures] | str:
        """Each engine revision's figures over the window, by KV fingerprint, for rollout analysis
        (metrics_contract.REVISION_*; a fingerprint absent served nothing), or why they are unknown:
        Prometheus unreachable or answering garbage, or the router not scraped (never zeros)."""
        try:
            return self._revisions(selector, window_seconds)
        except _Unusable as err:
            return str(err)

    def _revisions(self, selector: SeriesSelector, window_seconds: float) -> dict[str, Figures]:
        window, router = f"{max(1, round(window_seconds))}s", selector.router
        at = self._fresh(contract.CONFIG_VERSION, router)  # always exported: no series, not scraped
        by = contract.FINGERPRINT_LABEL
        attempts = {
            (series["metric"].get(by, ""), series["metric"].get("outcome", "")): _sample(series)[1]
            for series in self._query(
                f"sum by ({by}, outcome) (increase({contract.REVISION_ATTEMPTS_TOTAL}{{{router}}}[{window}]))",
                at,
            )
        }

        def sums(name: str) -> dict[str, tuple[float, float]]:
            def of(part: str) -> dict[str, float]:
                promql = f"sum by ({by}) (increase({name}_{part}{{{router}}}[{window}]))"
                return {
                    series["metric"].get(by, ""): _sample(series)[1] for series in self._query(promql, at)
                }

            total, count = of("sum"), of("count")
            return {fp: (total.get(fp, 0.0), count.get(fp, 0.0)) for fp in total.keys() | count.keys()}

        return figures_by_fingerprint(
            attempts, sums(contract.REVISION_TTFT_SECONDS), sums(contract.REVISION_TPOT_SECONDS)
        )

    def handoffs(self, selector: SeriesSelector, window_seconds: float) -> Handoffs | str:
        """The offloaded attempts' KV handoffs over the window (metrics_contract.KV_HANDOFFS_TOTAL
        and KV_HANDOFF_LAST_SECONDS of the prfaas route, summed over the router replicas), or why
        they are unknown: Prometheus unreachable or answering garbage, the router not scraped."""
        try:
            return self._handoffs(selector, window_seconds)
        except _Unusable as err:
            return str(err)

    def _handoffs(self, selector: SeriesSelector, window_seconds: float) -> Handoffs:
        window = f"{max(1, round(window_seconds))}s"
        offloaded = f'{selector.router},route="{ROUTE_PRFAAS}"'
        at = self._fresh(contract.CONFIG_VERSION, selector.router)  # always exported: no series, not scraped
        found = self._query(
            f"sum by (outcome) (increase({contract.KV_HANDOFFS_TOTAL}{{{offloaded}}}[{window}]))", at
        )
        if not found:  # the router exports every route's series from zero
            raise _Unusable(
                Reason.MISSING_SERIES,
                f"no {contract.KV_HANDOFFS_TOTAL} series matching {{{offloaded}}}: a router that does not "
                "export its KV handoffs?",
            )
        counts = {series["metric"].get("outcome", ""): _sample(series)[1] for series in found}
        last = {
            series["metric"].get("outcome", ""): datetime.fromtimestamp(_sample(series)[1], UTC)
            for series in self._query(
                f"max by (outcome) ({contract.KV_HANDOFF_LAST_SECONDS}{{{offloaded}}})", at
            )
        }
        return Handoffs(datetime.fromtimestamp(at, UTC), window_seconds, counts, last)

    def _fresh(self, name: str, router: str) -> float:
        """The evaluation instant of the observation, once the router's `name` is found scraped lately."""
        freshest = self._query(f"max(timestamp({name}{{{router}}}))", at=None)
        if not freshest:
            raise _Unusable(
                Reason.MISSING_SERIES,
                f"no {name} series matching {{{router}}} at {self.where}: is the router scraped?",
            )
        at, newest = _sample(freshest[0])
        age = at - newest
        if age > self.max_staleness_seconds:
            raise _Unusable(
                Reason.STALE_SERIES,
                f"the newest {name} sample is {age:.0f}s old (limit {self.max_staleness_seconds:g}s): "
                "the router is no longer scraped",
            )
        return at

    def _buckets(self, name: str, router: str, window: str, at: float) -> list[tuple[float, float]]:
        """Cumulative `(le, count)` pairs of a histogram over the window, summed over every other label."""
        result = self._query(f"sum by (le) (increase({name}_bucket{{{router}}}[{window}]))", at)
        if not result:
            raise _Unusable(Reason.MISSING_SERIES, f"no {name}_bucket series matching {{{router}}}")
        buckets = []
        for series in result:
            bound = series["metric"].get("le")
            try:
                buckets.append((float(bound), _sample(series)[1]))
            except (TypeError, ValueError):
                raise _Unusable(
                    Reason.BAD_HISTOGRAM, f"{name}_bucket has a bucket bound {bound!r} that is not a number"
                ) from None
        return sorted(buckets)

    def _queue_depths(self, selector: SeriesSelector, window: str, at: float) -> dict[str, float]:
        names = contract.stored_names(contract.ENGINE_QUEUE_REQS)
        inner = f'avg_over_time({{__name__=~"{names}",{selector.engines}}}[{window}])'
        promql = (
            f'sum by ({ROLE_LABEL}) (label_replace({inner}, "{ROLE_LABEL}", "$1", "pod", '
            f'"{_promql_string(selector.engine_pod_regex)}"))'
        )
        return {
            series["metric"].get(ROLE_LABEL, ""): _sample(series)[1] for series in self._query(promql, at)
        }

    def _event_rate(self, series: str, window: str, at: float) -> float:
        """The summed rate of a labelled counter of the router, whose freshness is already checked: a
        labelled series appears with its first event, so none at all means none happened."""
        return self._scalar(f"sum(rate({series}[{window}]))", at) or 0.0

    def _scalar(self, promql: str, at: float) -> float | None:
        """The single value of an aggregate, or None when no series matched (unknown, not zero)."""
        result = self._query(promql, at)
        return _sample(result[0])[1] if result else None

    def _query(self, promql: str, at: float | None) -> Sequence[Mapping[str, Any]]:
        params = {"time": f"{at:.3f}"} if at is not None else None
        try:
            result = self._client.query(promql, params=params)
        except _UNREACHABLE as err:
            raise _Unusable(
                Reason.PROMETHEUS_UNREACHABLE, f"Prometheus at {self.where} is unreachable: {_cause(err)}"
            ) from None
        except httpx2.TimeoutException:
            raise _Unusable(
                Reason.PROMETHEUS_UNREACHABLE, f"Prometheus at {self.where} did not answer in time"
            ) from None
        except (QueryError, httpx2.HTTPError, httpx2.InvalidURL, ValueError) as err:
            raise _Unusable(
                Reason.PROMETHEUS_ERROR, f"Prometheus at {self.where} refused {promql!r}: {_short(err)}"
            ) from None
        if not isinstance(result, list):
            raise _Unusable(Reason.PROMETHEUS_ERROR, f"Prometheus at {self.where} answered {promql!r} oddly")
        return result


def _sample(series: Mapping[str, Any]) -> tuple[float, float]:
    """(evaluation time, value) of one instant-vector element; NaN or infinity is refused."""
    try:
        at, text = series["value"]
        at, value = float(at), float(text)
    except (KeyError, TypeError, ValueError):
        raise _Unusable(Reason.PROMETHEUS_ERROR, f"an unreadable sample: {series!r:.200}") from None
    if not math.isfinite(value):
        raise _Unusable(Reason.BAD_HISTOGRAM, f"a sample is {text} for {series.get('metric')}")
    return at, value


def _regex_literal(text: str) -> str:
    """`text` matched literally by a regex (Kubernetes names: only `.` needs escaping, done for all)."""
    return "".join(c if c.isalnum() or c in "-_" else "\\" + c for c in text)


def _promql_string(text: str) -> str:
    """`text` inside a double-quoted PromQL string (backslashes and quotes escaped)."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _cause(err: Exception) -> str:
    text = str(err).lower()
    if "refused" in text:
        return "connection refused"
    if "name or service not known" in text or "nodename nor servname" in text:
        return "unknown host"
    if "timed out" in text:
        return "timed out"
    return type(err).__name__


def _short(err: BaseException, limit: int = 300) -> str:
    text = str(err)
    return text if len(text) <= limit else text[:limit] + "..."
