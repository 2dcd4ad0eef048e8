"""The data path's verdict as the operator reads it (PrometheusObserver.handoffs, data_path.judge)
from a real Prometheus (Debian's) scraping a stand-in router: the router's own RouterMetrics on
loopback, as one deployment's router pod, fed KV handoffs as the proxy records them.

Nothing offloaded yet is unverified; handoffs of offloaded attempts that reached the decodes
verify the path (the local route's do not count); a bootstrap failure makes it failing with that
cause; a router nobody scrapes and a Prometheus that is down are unknown, never verified.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
from prfaas_core import metrics_contract as contract
from prfaas_core.vocabulary import ROUTE_LOCAL, ROUTE_PRFAAS
from prfaas_operator.adapters.prometheus import SeriesSelector
from prfaas_operator.loops.planner_loop import observe_handoffs
from prfaas_operator.planning import data_path
from prfaas_operator.planning.data_path import DataPath, Handoffs
from prfaas_router.metrics import RouterMetrics
from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port
from prometheus_client import start_http_server

if TYPE_CHECKING:
    from prfaas_testbed.prometheus import PrometheusServer

pytestmark = [pytest.mark.prometheus, pytest.mark.timeout(90)]

NAMESPACE, PREFILL_NAMESPACE, NAME = "serving", "prefill", "demo"
WINDOW = 60.0
SCRAPE_S = 0.5


@pytest.fixture
def router() -> Iterator[tuple[int, RouterMetrics]]:
    metrics = RouterMetrics()
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    yield port, metrics
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def look(url: str, name: str = NAME) -> Handoffs | str:
    return observe_handoffs(url, SeriesSelector.for_deployment(NAMESPACE, name, PREFILL_NAMESPACE), WINDOW)


def test_offloaded_handoffs_verify_the_data_path_a_failure_names_its_cause_and_unknown_is_never_verified(
    prometheus: Callable[..., PrometheusServer], router: tuple[int, RouterMetrics]
) -> None:
    from prfaas_testbed.prometheus import ScrapeJob, TargetGroup

    port, metrics = router
    prom = prometheus(jobs=(ScrapeJob("routers"),), scrape_interval_s=SCRAPE_S)
    prom.write_targets(
        "routers",
        [TargetGroup([f"127.0.0.1:{port}"], {"namespace": NAMESPACE, "pod": f"{NAME}-router-6c9f7-q2x8z"})],
    )

    def verdict_until(reason: str, what: str) -> tuple[Handoffs | str, DataPath]:
        def probe() -> tuple[Handoffs | str, DataPath]:
            seen = look(prom.url)
            return seen, data_path.judge(seen)

        return eventually(
            probe, timeout=20, interval=0.25, what=what, until=lambda found: found[1].reason == reason
        )

    # scraped, every series at zero: nothing offloaded, which is not "verified"
    _, verdict = verdict_until(data_path.UNVERIFIED, "the router scraped with nothing offloaded")
    assert "No request was offloaded to the PrfaaS pool in the last 60 s" in verdict.message

    last_ok = time.time()
    for _ in range(5):
        metrics.handoffs.record(ROUTE_PRFAAS, contract.HANDOFF_OK, last_ok)
    for _ in range(7):  # prefilled in the PD cluster: says nothing of the path from the PrfaaS pool
        metrics.handoffs.record(ROUTE_LOCAL, contract.HANDOFF_TRANSFER_FAILED, last_ok)
    seen, verdict = verdict_until(data_path.VERIFIED, "five offloaded handoffs seen")
    assert isinstance(seen, Handoffs)
    # increase() extrapolates to the window's end: over series a few scrapes old, by up to a third
    assert 4.5 <= seen.counts[contract.HANDOFF_OK] <= 7
    assert set(seen.counts) == {contract.HANDOFF_OK, *contract.HANDOFF_FAILURES}
    assert seen.counts[contract.HANDOFF_TRANSFER_FAILED] == 0  # the local route's failures are not read
    assert seen.last[contract.HANDOFF_OK].timestamp() == pytest.approx(last_ok, abs=0.01)
    assert f"{round(seen.counts[contract.HANDOFF_OK])} times in the last 60 s" in verdict.message

    failed_at = time.time()
    metrics.handoffs.record(ROUTE_PRFAAS, contract.HANDOFF_BOOTSTRAP_FAILED, failed_at)
    metrics.handoffs.record(ROUTE_PRFAAS, contract.HANDOFF_OK, failed_at + 0.5)  # a retry elsewhere worked
    seen, verdict = verdict_until(data_path.FAILING, "the bootstrap failure seen")
    assert isinstance(seen, Handoffs)
    assert seen.last[contract.HANDOFF_BOOTSTRAP_FAILED].timestamp() == pytest.approx(failed_at, abs=0.01)
    assert f": {contract.HANDOFF_BOOTSTRAP_FAILED};" in verdict.message and "failed once" in verdict.message

    absent = data_path.judge(look(prom.url, name="other"))
    assert absent.reason == data_path.UNKNOWN and "is the router scraped?" in absent.message
    down = data_path.judge(look(f"http://127.0.0.1:{free_port()}"))
    assert down.reason == data_path.UNKNOWN and "unreachable" in down.message
