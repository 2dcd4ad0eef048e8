"""Rollout analysis's read of Prometheus (PrometheusObserver.revisions) against a real Prometheus
(Debian's) holding backfilled history of the router's per-revision series (metrics_contract.REVISION_*).

The adapter must pick one deployment's series, sum them over the window by KV fingerprint, count
client-ended attempts as neither attempts nor errors, and say why the figures are unknown (never
zeros) when the router is not scraped, a value is garbage, or Prometheus is unreachable.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import pytest
from prfaas_core import metrics_contract as contract
from prfaas_operator.adapters.prometheus import SeriesSelector
from prfaas_operator.loops.planner_loop import observe_revisions
from prfaas_operator.planning.analysis import Figures
from prfaas_testbed.ports import free_port

if TYPE_CHECKING:
    from prfaas_testbed.prometheus import PrometheusServer

pytestmark = [pytest.mark.prometheus, pytest.mark.timeout(120)]

NAMESPACE, PREFILL_NAMESPACE = "serving", "prefill"
STEP = 15
WINDOW = 300
OLD, NEW = "aaaaaaaaaaaa", "bbbbbbbbbbbb"
# per scrape interval: (fingerprint, outcome) -> attempts; TTFT and TPOT per answered attempt
TRAFFIC = {
    (OLD, contract.OUTCOME_OK): 30,
    (NEW, contract.OUTCOME_OK): 7,
    (NEW, "decode_failed"): 3,
    (NEW, "client_disconnected"): 5,
}
TTFT = {OLD: 0.2, NEW: 0.6}
TPOT = {OLD: 0.02, NEW: 0.05}


def router_lines(
    pod: str, times: list[int], *, nan: bool = False, config_until: int | None = None
) -> dict[str, list[str]]:
    """One router's series at `times`: the config_version gauge (up to `config_until`), the
    per-revision attempts counter and the TTFT and TPOT histograms' sums and counts."""
    labels = f'namespace="{NAMESPACE}",pod="{pod}"'
    lines: dict[str, list[str]] = {"config_version": [], "attempts": [], "ttft": [], "tpot": []}
    for n, at in enumerate(times, start=1):
        if config_until is None or at <= config_until:
            lines["config_version"].append(f"{contract.CONFIG_VERSION}{{{labels}}} 3 {at}")
        for (fingerprint, outcome), per_step in TRAFFIC.items():
            lines["attempts"].append(
                f'{contract.REVISION_ATTEMPTS_TOTAL}{{{labels},fingerprint="{fingerprint}",outcome="{outcome}"}} '
                f"{per_step * n} {at}"
            )
        for fingerprint in (OLD, NEW):
            answered = TRAFFIC[(fingerprint, contract.OUTCOME_OK)] * n
            for key, name, mean in (
                ("ttft", contract.REVISION_TTFT_SECONDS, TTFT),
                ("tpot", contract.REVISION_TPOT_SECONDS, TPOT),
            ):
                fp = f'{labels},fingerprint="{fingerprint}"'
                total = "NaN" if nan and key == "ttft" else repr(mean[fingerprint] * answered)
                lines[key] += [
                    f'{name}_bucket{{{fp},le="+Inf"}} {answered} {at}',
                    f"{name}_count{{{fp}}} {answered} {at}",
                    f"{name}_sum{{{fp}}} {total} {at}",
                ]
    return lines


@pytest.fixture(scope="module")
def prometheus_with_revisions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    """Ten minutes of history, ending now: a rolling router, one with garbage, one no longer scraped."""
    import time

    from prfaas_testbed.prometheus import backfill_openmetrics, start_prometheus

    now = int(time.time())
    times = list(range(now - 600, now + 1, STEP))
    routers = [
        router_lines("rolling-router-7d9f8-abcde", times),
        router_lines("garbage-router-7d9f8-abcde", times, nan=True),
        router_lines("gone-router-7d9f8-abcde", times, config_until=now - 200),
    ]
    kinds = {
        "config_version": (contract.CONFIG_VERSION, "gauge"),
        "attempts": (contract.REVISION_ATTEMPTS_TOTAL.removesuffix("_total"), "counter"),
        "ttft": (contract.REVISION_TTFT_SECONDS, "histogram"),
        "tpot": (contract.REVISION_TPOT_SECONDS, "histogram"),
    }
    text = []
    for key, (family, kind) in kinds.items():
        text.append(f"# TYPE {family} {kind}")
        for lines in routers:
            text += lines[key]
    workdir = tmp_path_factory.mktemp("prometheus-revisions")
    backfill_openmetrics("\n".join(text) + "\n", workdir / "tsdb")
    server = start_prometheus(workdir / "server", tsdb_dir=workdir / "tsdb")
    yield server
    server.stop()


def revisions(url: str, name: str) -> Mapping[str, Figures] | str:
    return observe_revisions(url, SeriesSelector.for_deployment(NAMESPACE, name, PREFILL_NAMESPACE), WINDOW)


def test_each_revision_is_summed_over_the_window_by_fingerprint(
    prometheus_with_revisions: PrometheusServer,
) -> None:
    found = revisions(prometheus_with_revisions.url, "rolling")
    assert isinstance(found, dict), found
    assert set(found) == {OLD, NEW}
    steps = WINDOW / STEP
    old, new = found[OLD], found[NEW]
    # increase() extrapolates to the window's edges: within a few percent
    assert old.attempts == pytest.approx(30 * steps, rel=0.05) and old.errors == 0
    assert new.attempts == pytest.approx(10 * steps, rel=0.05), "client-ended attempts are not counted"
    assert new.error_ratio == pytest.approx(0.3, rel=0.01)
    assert old.ttft_mean == pytest.approx(0.2, rel=0.01) and new.ttft_mean == pytest.approx(0.6, rel=0.01)
    assert old.tpot_mean == pytest.approx(0.02, rel=0.01) and new.tpot_mean == pytest.approx(0.05, rel=0.01)


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("garbage", "NaN"),
        ("gone", "no longer scraped"),
        ("absent", "is the router scraped?"),
    ],
)
def test_unknown_figures_say_why_never_zeros(
    prometheus_with_revisions: PrometheusServer, name: str, words: str
) -> None:
    found = revisions(prometheus_with_revisions.url, name)
    assert isinstance(found, str) and words in found, found


def test_an_unreachable_prometheus_is_unknown() -> None:
    found = revisions(f"http://127.0.0.1:{free_port()}", "rolling")
    assert isinstance(found, str) and "unreachable" in found
