"""The planner's Prometheus adapter against a real Prometheus (Debian's) holding backfilled history.

Router and engine series of several deployments are written with promtool, as a Kubernetes
scrape would label them (namespace, pod); the adapter must pick exactly one deployment's
series, rebuild its length distribution from the histograms, and say "no data" with the
cause (never zeros) when series are missing, stale, too thin, not a distribution, or when
Prometheus is unreachable or refuses the query.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest
from prfaas_core import metrics_contract as contract
from prfaas_core import vocabulary
from prfaas_core.planning import NoData, Observation, Reason
from prfaas_operator.adapters.prometheus import PrometheusObserver, SeriesSelector
from prfaas_testbed.ports import free_port

if TYPE_CHECKING:
    from prfaas_testbed.prometheus import PrometheusServer

pytestmark = [pytest.mark.prometheus, pytest.mark.timeout(120)]

NAMESPACE, PREFILL_NAMESPACE = "serving", "prefill"
WINDOW = 600
STEP = 15  # seconds between backfilled samples, as a scrape interval
OUTPUT_BUCKETS = contract.token_buckets(low=1, high=262144, ratio=2.0)  # the router's output buckets
STEADY_LENGTHS = (1000, 3000, 20000)  # uncached tokens, cycled: 2 requests/s in all
STEADY_OUTPUT = 200
EGRESS_PER_STEP = 3e9
MEASURED_LINK = 5e9  # bytes/s the steady router measured; the other's is NaN (nothing measured)


@dataclass
class History:
    """One router's cumulative series over time, rendered as OpenMetrics with timestamps."""

    labels: str  # 'namespace="..",pod=".."'
    points: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    _totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def step(
        self,
        at: int,
        requests: Sequence[tuple[int, int]],
        egress: float = 0.0,
        *,
        rejected: int = 0,
        rerouted: int = 0,
    ) -> None:
        """Requests (uncached, output tokens) served in the step ending at `at`, and the refused (429)
        and rerouted ones (by the link budget, among the served)."""
        totals = self._totals
        if rejected or rerouted:
            totals["rejected"] += rejected
            totals["rerouted"] += rerouted
        for route in vocabulary.ROUTES:
            totals[f"count|{route}"] += 0  # both routes exist from the start, as in the router
        for uncached, output in requests:
            route = vocabulary.ROUTE_PRFAAS if uncached > 8192 else vocabulary.ROUTE_LOCAL
            index = bisect.bisect_left(contract.TOKEN_BUCKETS, uncached)
            totals[f"unc|{route}|{index}"] += 1
            totals[f"count|{route}"] += 1
            totals[f"sum|{route}"] += uncached
            totals[f"out|{bisect.bisect_left(OUTPUT_BUCKETS, output)}"] += 1
            totals[f"req|{route}"] += 1
        totals["egress"] += egress
        self.points.append((at, dict(totals)))

    def families(self) -> dict[str, list[str]]:
        lines: dict[str, list[str]] = defaultdict(list)
        for route in vocabulary.ROUTES:
            for at, totals in self.points:
                lines[contract.UNCACHED_TOKENS] += _histogram_point(
                    contract.UNCACHED_TOKENS,
                    f'{self.labels},route="{route}"',
                    contract.TOKEN_BUCKETS,
                    lambda i, r=route, t=totals: t.get(f"unc|{r}|{i}", 0.0),  # type: ignore[misc]
                    totals.get(f"sum|{route}", 0.0),
                    at,
                )
        for at, totals in self.points:
            lines[contract.OUTPUT_TOKENS] += _histogram_point(
                contract.OUTPUT_TOKENS,
                self.labels,
                OUTPUT_BUCKETS,
                lambda i, t=totals: t.get(f"out|{i}", 0.0),  # type: ignore[misc]
                0.0,
                at,
            )
        for route in vocabulary.ROUTES:
            for at, totals in self.points:
                lines[contract.REQUESTS_TOTAL.removesuffix("_total")].append(
                    f'{contract.REQUESTS_TOTAL}{{{self.labels},route="{route}",outcome="ok"}} '
                    f"{totals.get(f'req|{route}', 0.0)} {at}"
                )
        for at, totals in self.points:
            if "rejected" in totals:
                lines[contract.REQUESTS_TOTAL.removesuffix("_total")].append(
                    f'{contract.REQUESTS_TOTAL}{{{self.labels},route="none",outcome="{contract.OUTCOME_REJECTED}"}} '
                    f"{totals['rejected']} {at}"
                )
                lines[contract.DECISIONS_TOTAL.removesuffix("_total")] += [
                    f'{contract.DECISIONS_TOTAL}{{{self.labels},route="none",reason="slo_reject"}} '
                    f"{totals['rejected']} {at}",
                    f'{contract.DECISIONS_TOTAL}{{{self.labels},route="local",reason="link_budget"}} '
                    f"{totals['rerouted']} {at}",
                ]
        for at, totals in self.points:
            lines[contract.KV_EGRESS_BYTES_TOTAL.removesuffix("_total")].append(
                f"{contract.KV_EGRESS_BYTES_TOTAL}{{{self.labels}}} {totals['egress']} {at}"
            )
        return lines


def _histogram_point(
    name: str,
    labels: str,
    bounds: Sequence[float],
    count_in: Callable[[int], float],
    total: float,
    at: int,
) -> list[str]:
    lines, cumulative = [], 0.0
    for index, bound in enumerate([*bounds, float("inf")]):
        cumulative += count_in(index)
        le = "+Inf" if bound == float("inf") else repr(float(bound))
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative} {at}')
    lines.append(f"{name}_count{{{labels}}} {cumulative} {at}")
    lines.append(f"{name}_sum{{{labels}}} {total} {at}")
    return lines


def render(
    histories: Sequence[History],
    gauges: Sequence[tuple[str, float, Sequence[int]]],
    links: Sequence[tuple[str, float, Sequence[int]]],
) -> str:
    """OpenMetrics text: families contiguous, each series' points in time order."""
    by_family: dict[str, list[str]] = defaultdict(list)
    for history in histories:
        for family, lines in history.families().items():
            by_family[family] += lines
    kinds = {
        contract.UNCACHED_TOKENS: "histogram",
        contract.OUTPUT_TOKENS: "histogram",
        contract.REQUESTS_TOTAL.removesuffix("_total"): "counter",
        contract.DECISIONS_TOTAL.removesuffix("_total"): "counter",
        contract.KV_EGRESS_BYTES_TOTAL.removesuffix("_total"): "counter",
    }
    text = []
    for family, lines in by_family.items():
        text += [f"# TYPE {family} {kinds[family]}", *lines]
    text.append(f"# TYPE {contract.ENGINE_QUEUE_REQS} gauge")
    for labels, value, times in gauges:
        text += [f"{contract.ENGINE_QUEUE_REQS}{{{labels}}} {value} {at}" for at in times]
    text.append(f"# TYPE {contract.LINK_MEASURED_BYTES_PER_SECOND} gauge")
    for labels, value, times in links:
        text += [f"{contract.LINK_MEASURED_BYTES_PER_SECOND}{{{labels}}} {value} {at}" for at in times]
    return "\n".join(text) + "\n"


@pytest.fixture(scope="module")
def prometheus_with_history(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    """Twenty minutes of history for five deployments, ending now; Prometheus started on it."""
    import time

    from prfaas_testbed.prometheus import backfill_openmetrics, start_prometheus

    now = int(time.time())
    times = list(range(now - 1200, now + 1, STEP))

    def router(name: str) -> History:
        return History(f'namespace="{NAMESPACE}",pod="{name}-router-7d9f8-abcde"')

    steady, other, quiet, stale, overflow = (
        router(n) for n in ("steady", "other", "quiet", "stale", "overflow")
    )
    for at in times:
        cycle = [(STEADY_LENGTHS[k % 3], STEADY_OUTPUT) for k in range(2 * STEP)]
        steady.step(at, cycle, egress=EGRESS_PER_STEP, rejected=STEP // 3, rerouted=STEP // 5)
        other.step(at, [(100000, 5000)] * 50)  # a neighbour with very different traffic
        quiet.step(at, [(2000, 100)] if at % 60 < STEP else [])  # one request a minute
        overflow.step(at, [(4000, 100), (300000, 100)] * 10)  # some beyond the largest bucket
        if at <= now - 200:  # its router has not been scraped for 200 s
            stale.step(at, [(4000, 100)] * 30)
    gauges = [
        (f'namespace="{NAMESPACE}",pod="steady-pd-decode-0"', 3.0, times),
        (f'namespace="{NAMESPACE}",pod="steady-pd-decode-1"', 1.0, times),
        (f'namespace="{PREFILL_NAMESPACE}",pod="steady-prfaas-prefill-0"', 2.0, times),
        (f'namespace="{NAMESPACE}",pod="other-pd-decode-0"', 50.0, times),
        (f'namespace="{NAMESPACE}",pod="steady-router-7d9f8-abcde"', 9.0, times),  # not an engine
    ]
    workdir = tmp_path_factory.mktemp("prometheus-adapter")
    links = [(steady.labels, MEASURED_LINK, times), (other.labels, float("nan"), times)]
    backfill_openmetrics(render([steady, other, quiet, stale, overflow], gauges, links), workdir / "tsdb")
    server = start_prometheus(workdir / "server", tsdb_dir=workdir / "tsdb")
    yield server
    server.stop()


def observe(server: PrometheusServer, name: str) -> Observation | NoData:
    observer = PrometheusObserver(server.url)
    try:
        return observer.observe(SeriesSelector.for_deployment(NAMESPACE, name, PREFILL_NAMESPACE), WINDOW)
    finally:
        observer.close()


def test_one_deployment_is_observed_from_its_own_series(prometheus_with_history: PrometheusServer) -> None:
    seen = observe(prometheus_with_history, "steady")
    assert isinstance(seen, Observation), seen
    assert seen.requests == pytest.approx(2 * WINDOW, rel=0.03)
    # offered: the 2 served and the 1/3 refused requests per second; 1/5 per second rerouted
    assert seen.arrival_rps == pytest.approx(2.0 + 1 / 3, rel=0.03)
    assert seen.rejected_rps == pytest.approx(1 / 3, rel=0.03)
    assert seen.rerouted_rps == pytest.approx(1 / 5, rel=0.03)
    assert seen.egress_bytes_per_second == pytest.approx(EGRESS_PER_STEP / STEP, rel=0.03)
    assert seen.offloaded_fraction == pytest.approx(1 / 3, rel=0.03)  # 20000 tokens went to PrfaaS
    assert seen.queue_depths == pytest.approx({"pd-decode": 4.0, "prfaas-prefill": 2.0})
    assert seen.measured_link_bytes_per_second == pytest.approx(MEASURED_LINK)
    workload = seen.workload
    # one support point per length, in the bucket that holds it, a third of the mass each
    assert len(workload.lengths) == 3
    bounds = (0.0, *contract.TOKEN_BUCKETS)
    for point, true_length in zip(workload.lengths, STEADY_LENGTHS, strict=True):
        index = bisect.bisect_left(contract.TOKEN_BUCKETS, true_length)
        assert bounds[index] < point <= bounds[index + 1]
    assert workload.weights == pytest.approx([1 / 3] * 3, rel=0.03)
    assert 128 < workload.mean_output_tokens <= 256  # the bucket holding 200


def test_a_link_the_router_has_not_measured_is_unknown_not_zero(
    prometheus_with_history: PrometheusServer,
) -> None:
    seen = observe(prometheus_with_history, "other")  # its gauge is NaN: no transfer seen lately
    assert isinstance(seen, Observation), seen
    assert seen.measured_link_bytes_per_second is None


@pytest.mark.parametrize(
    ("name", "code", "words"),
    [
        ("quiet", Reason.TOO_FEW_REQUESTS, "request(s) in the last 600s (at least 50 needed)"),
        ("stale", Reason.STALE_SERIES, "no longer scraped"),
        ("absent", Reason.MISSING_SERIES, "is the router scraped?"),
        ("overflow", Reason.BAD_HISTOGRAM, "above the largest finite bound"),
    ],
)
def test_unusable_series_are_no_data_with_the_cause(
    prometheus_with_history: PrometheusServer, name: str, code: Reason, words: str
) -> None:
    seen = observe(prometheus_with_history, name)
    assert isinstance(seen, NoData), seen
    assert seen.code is code and words in seen.reason, seen.reason


def test_an_unreachable_prometheus_is_no_data_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    observer = PrometheusObserver(url)
    try:
        seen = observer.observe(SeriesSelector.for_deployment(NAMESPACE, "steady", PREFILL_NAMESPACE), WINDOW)
    finally:
        observer.close()
    assert seen == NoData(
        Reason.PROMETHEUS_UNREACHABLE, f"Prometheus at {url} is unreachable: connection refused"
    )


def test_an_error_answer_is_no_data_and_credentials_stay_out_of_it(
    prometheus_with_history: PrometheusServer,
) -> None:
    host = prometheus_with_history.url.removeprefix("http://")
    observer = PrometheusObserver(f"http://planner:s3cret@{host}/not-prometheus")  # a wrong path: HTTP 404
    try:
        seen = observer.observe(SeriesSelector.for_deployment(NAMESPACE, "steady", PREFILL_NAMESPACE), WINDOW)
    finally:
        observer.close()
    assert isinstance(seen, NoData) and seen.code is Reason.PROMETHEUS_ERROR
    assert f"http://{host}/not-prometheus" in seen.reason and "404" in seen.reason
    assert "s3cret" not in seen.reason and "planner:" not in seen.reason


def test_revisions_over_a_hole_in_the_scrapes_are_none_and_from_an_erring_prometheus_unknown(
    prometheus: Callable[..., PrometheusServer],
) -> None:
    """Prometheus killed and started again while the router is gone keeps no scrape to mark the
    router's series stale: its last sample still looks recent, but the window holds none (empty
    vectors: no revision at all, which analysis.assess must not read as no traffic). Started with `--query.timeout=0s` it answers 503."""
    from prfaas_router.metrics import RouterMetrics
    from prfaas_testbed.prometheus import ScrapeJob, TargetGroup
    from prometheus_client import start_http_server

    metrics = RouterMetrics()
    metrics.revisions.serve(["aaaaaaaaaaaa"])
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    prom = prometheus(jobs=(ScrapeJob("routers"),), scrape_interval_s=0.5)
    prom.write_targets(
        "routers", [TargetGroup([f"127.0.0.1:{port}"], {"namespace": NAMESPACE, "pod": "r-router-1"})]
    )
    selector = SeriesSelector.for_deployment(NAMESPACE, "r", PREFILL_NAMESPACE)
    observer = PrometheusObserver(prom.url)
    try:
        prom.wait_for(
            f'increase({contract.REVISION_ATTEMPTS_TOTAL}{{namespace="{NAMESPACE}"}}[2s])', timeout_s=30
        )
        assert set(observer.revisions(selector, 2)) == {"aaaaaaaaaaaa"}
        prom.kill()
        server.shutdown()
        server.server_close()
        prom.start_again()
        time.sleep(3)  # the window (2 s) now lies after the router's last sample
        assert observer.revisions(selector, 2) == {}  # no figures, not zeros: the analysis Waits on that
        prom.kill()
        prom.start_again("--query.timeout=0s")
        seen = observer.revisions(selector, 2)
        assert isinstance(seen, str) and "HTTP Status Code 503" in seen, seen
    finally:
        observer.close()
        thread.join(timeout=5)
