"""The link as it really is, live: its latency on the wire, and a rate drop the router follows.

One PrfaasDeployment (2 PrfaaS prefill instances, 2+2 PD instances, a 20 Gbit/s link with
5 ms latency) under long prompts that all want the PrfaaS cluster, about 3.5 Gbit/s of KV:

1. TCP's round trip to a PrfaaS prefill pod is the CR's, through the delay line;
2. mid-run `tc` cuts the link to 2 Gbit/s behind everyone's back (the CR still says 20): the
   router's measured bandwidth follows within TRACKING_SECONDS, the offload share drops, no
   request fails, the planner's input, read from Prometheus as the operator reads it, carries
   the measured bandwidth, and the planner's next decision (Advisory) plans with it and says
   so in status.planner.inputs.link.

Needs the testbed with network namespaces (the delay line and tc act on them); about 3 minutes:

    export PATH=$PWD/.venv/bin:$PATH
    testbed/scripts/testbed.sh up   # imports this tree's images
    python -m pytest -q -s tests/e2e/test_link_drop.py   # -s: the router's view, second by second
    testbed/scripts/testbed.sh down
"""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from live_traffic import E2E_TIME_SCALE, BackgroundTraffic, logs_hint, pd_kubectl
from prfaas_core.planning import NoData, Observation
from prfaas_core.vocabulary import ROUTE_PRFAAS, Pool
from prfaas_operator.adapters.prometheus import PrometheusObserver, SeriesSelector
from prfaas_testbed.link import (
    LinkMode,
    LinkShape,
    delay_line_devices,
    delay_seconds,
    scaled_rate_bits,
    tc_commands,
)
from prfaas_testbed.rtt import connect_rtt_seconds
from prfaas_testbed.system import LiveSystem, LiveSystemError, customise_cr, load_sample_cr, wait_until
from prfaas_testbed.traffic import PlannedRequest, RequestResult, TrafficSummary, lognormal_requests

pytestmark = [pytest.mark.e2e, pytest.mark.testbed, pytest.mark.prometheus, pytest.mark.timeout(600)]

E2E_NAME = "prfaas-link"
CR_NAME = "link"
CONFIGURED_GBPS = 20.0
DROPPED_GBPS = 2.0
LATENCY_MS = 5.0
TRAFFIC_SECONDS = 100.0  # wall
DROP_AFTER_SECONDS = 35.0
TRACKING_SECONDS = 30.0
"""The router's measured bandwidth is below MEASURED_AFTER_DROP_AT_MOST of the configured one this
long after the drop (router defaults: 1 s polls, 5 s half-life)."""
MEASURED_AFTER_DROP_AT_MOST = 0.4
PLANNER_SEES_WITHIN_SECONDS = 30.0  # Prometheus scrapes the router every few seconds
PLANNER_DECIDES_WITHIN_SECONDS = 60.0  # then the loop decides every 10 s, each decision a status write
BYTES_PER_GBIT = 1e9 / 8


@pytest.fixture(scope="module")
def deployment(live_system: LiveSystem) -> LiveSystem:
    if live_system.link_mode is not LinkMode.NETNS_TC:
        pytest.skip("the link's latency and a tc rate change need the testbed's network namespaces")
    assert live_system.prometheus is not None
    cr = customise_cr(
        load_sample_cr(),
        live_system.layout,
        name=CR_NAME,
        prometheus_url=live_system.prometheus.url,
        # the planner needs 50 finished requests in its window: this traffic (about 0.5 req/s, and
        # slower to finish once the link drops) left 43-50 in 60 s in a CI run; the measured
        # bandwidth it must name is the router's latest, whatever the window
        planner={"mode": "Advisory", "intervalSeconds": 10, "windowSeconds": 120},
    )
    spec = cr["spec"]
    spec["prefillCluster"].update(replicas=2, minReplicas=1, maxReplicas=3)
    spec["pdCluster"].update(instances=4, prefillInstances=2, decodeInstances=2)
    spec["link"].update(bandwidthGbps=CONFIGURED_GBPS, latencyMs=LATENCY_MS)
    live_system.apply(cr)
    live_system.wait_ready(150)
    return live_system


def long_prompts(seconds: float) -> list[PlannedRequest]:
    """Prompts of about 40K tokens, all above the 19456 threshold: ~0.87 GB of KV each."""
    return lognormal_requests(
        rate_rps=0.5,
        seconds=seconds,
        time_scale=E2E_TIME_SCALE,
        seed=13,
        median_tokens=40_000,
        sigma=0.3,
        min_tokens=24_000,
        max_tokens=80_000,
        output_tokens=16,
        phase="link",
    )


def router_gauge(system: LiveSystem, name: str) -> float | None:
    url = system.router_url()
    assert url is not None, f"the router is not ready {logs_hint(system)}"
    with urllib.request.urlopen(url + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    value = float(found.group(1)) if found else float("nan")
    return None if value != value else value  # NaN: nothing measured lately


def measured_gbps(system: LiveSystem, say_since: float | None = None) -> float | None:
    """The router's measured bandwidth; with `say_since`, printed with what it has in flight."""
    value = router_gauge(system, "prfaas_router_link_measured_bytes_per_second")
    gbps = None if value is None else value / BYTES_PER_GBIT
    if say_since is not None:
        inflight = router_gauge(system, "prfaas_router_link_inflight_bytes") or 0.0
        print(
            f"  t={time.monotonic() - say_since:5.1f}s measured {gbps} Gbit/s, KV in flight {inflight / 1e9:.1f} GB"
        )
    return gbps


def watch(system: LiveSystem, seconds: float, since: float) -> None:
    """Print the router's view of the link every 2 s for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        measured_gbps(system, say_since=since)
        time.sleep(min(2.0, max(0.0, end - time.monotonic())))


def planner_link_input(system: LiveSystem) -> str:
    """status.planner.inputs.link: the bandwidth the planner's last decision planned with."""
    cr = system.cr() or {}
    return str((((cr.get("status") or {}).get("planner") or {}).get("inputs") or {}).get("link", ""))


def operator_log_tail(system: LiveSystem) -> str:
    """The planner's last lines in the operators' logs, to tell why it did not decide."""
    lines = []
    for pod in system.runner_pods(kind="operator"):
        shown = pd_kubectl(system).run(
            "-n", system.layout.system_namespace, "logs", pod["pod"], "--tail", "400"
        )
        lines += [f"{pod['pod']}: {line}" for line in shown.stdout.splitlines() if "planner" in line][-8:]
    return "operator logs:\n" + "\n".join(lines)


def planned_measured_gbps(system: LiveSystem) -> float | None:
    """The measured bandwidth the planner's last decision planned with; None if it used the configured one."""
    found = re.match(r"([\d.]+) Gbit/s measured", planner_link_input(system))
    return float(found.group(1)) if found else None


def offloaded_share(results: list[RequestResult], start: float, end: float) -> float:
    served = [r for r in results if start <= r.sent_at < end and r.outcome == "ok"]
    assert served, f"nothing served between {start:.0f} and {end:.0f}"
    return sum(r.route == ROUTE_PRFAAS for r in served) / len(served)


def link_is_observed_low(system: LiveSystem, seen: list[Observation | NoData]) -> bool:
    """The operator's Prometheus adapter's observation of the last two minutes (kept in `seen`)."""
    assert system.prometheus is not None
    observer = PrometheusObserver(system.prometheus.url)
    namespace = system.layout.deployment_namespace
    try:
        seen.append(observer.observe(SeriesSelector.for_deployment(namespace, CR_NAME, namespace), 120))
    finally:
        observer.close()
    measured = seen[-1].measured_link_bytes_per_second if isinstance(seen[-1], Observation) else None
    return measured is not None and measured < MEASURED_AFTER_DROP_AT_MOST * CONFIGURED_GBPS * BYTES_PER_GBIT


def set_link_rate(system: LiveSystem, shape: LinkShape) -> None:
    """What the runner does on a CR change, done here without one: tbf on both of the link's devices."""
    link = system.testbed.link
    assert link is not None
    for device in (link.netns_device, delay_line_devices(link.netns_device)[1]):
        for command in tc_commands(shape, system.scales, netns=link.netns, netns_device=device):
            subprocess.run(command, check=True, capture_output=True, timeout=10)


@pytest.fixture
def configured_shape(deployment: LiveSystem) -> Iterator[LinkShape]:
    cr = deployment.cr()
    assert cr is not None
    shape = LinkShape.of_spec(cr["spec"])
    yield shape
    set_link_rate(deployment, shape)  # the runner reshapes only when the CR changes


def test_the_round_trip_to_the_prfaas_pods_is_the_crs_latency(deployment: LiveSystem) -> None:
    system = deployment
    cr = system.cr()
    assert cr is not None
    one_way = delay_seconds(LinkShape.of_spec(cr["spec"]), system.scales)
    config = system.router_config() or {}
    endpoint = urlsplit(config["pools"][Pool.PRFAAS_PREFILL][0]["url"])
    assert endpoint.hostname is not None and endpoint.port is not None
    rtt = connect_rtt_seconds(endpoint.hostname, endpoint.port, samples=9)
    print(f"RTT to {endpoint.netloc}: {rtt * 1000:.2f} ms (delay line {one_way * 1000:g} ms each way)")
    assert 2 * one_way <= rtt < 2 * one_way + 0.010


def test_a_link_drop_is_measured_and_offloads_give_way(
    deployment: LiveSystem, configured_shape: LinkShape
) -> None:
    system = deployment
    dropped = LinkShape(DROPPED_GBPS * BYTES_PER_GBIT, configured_shape.latency_seconds)
    with BackgroundTraffic(
        system.router_url() or "", "kimi-linear", long_prompts(TRAFFIC_SECONDS)
    ) as traffic:
        watch(system, DROP_AFTER_SECONDS, traffic.started_at)
        before = measured_gbps(system)
        set_link_rate(system, dropped)
        dropped_at = time.monotonic()
        print(
            f"tc: {scaled_rate_bits(dropped, system.scales)} bit/s of scaled KV (the CR still says {CONFIGURED_GBPS:g} Gbit/s)"
        )
        wait_until(
            f"the router to measure under {MEASURED_AFTER_DROP_AT_MOST:.0%} of {CONFIGURED_GBPS:g} Gbit/s",
            lambda: (
                (seen := measured_gbps(system, say_since=traffic.started_at)) is not None
                and seen < MEASURED_AFTER_DROP_AT_MOST * CONFIGURED_GBPS
            ),
            TRACKING_SECONDS,
        )
        tracked_after = time.monotonic() - dropped_at
        after = measured_gbps(system)
        # the planner's input, read from Prometheus as the operator's adapter reads it
        planner_sees: list[Observation | NoData] = []
        wait_until(
            "the planner's observation to carry the measured bandwidth",
            lambda: (
                measured_gbps(system, say_since=traffic.started_at) is not None
                and link_is_observed_low(system, planner_sees)
            ),
            PLANNER_SEES_WITHIN_SECONDS,
        )
        # ...and the planner's next decision plans with it and says so
        try:
            wait_until(
                "the planner's decision to name the measured bandwidth",
                lambda: (
                    (planned := planned_measured_gbps(system)) is not None
                    and planned < MEASURED_AFTER_DROP_AT_MOST * CONFIGURED_GBPS
                ),
                PLANNER_DECIDES_WITHIN_SECONDS,
            )
        except LiveSystemError as err:
            planner = ((system.cr() or {}).get("status") or {}).get("planner")
            raise AssertionError(f"{err}; status.planner: {planner}; {operator_log_tail(system)}") from None
        driver = traffic.wait(timeout_s=TRAFFIC_SECONDS + 120)
    print(
        f"measured {before} Gbit/s before the drop, {after} Gbit/s {tracked_after:.1f} s after it "
        f"(link {DROPPED_GBPS:g} Gbit/s)"
    )
    results = driver.results
    summary = TrafficSummary.of(results).line()
    assert not [r for r in results if r.outcome == "failed"], summary
    share_before = offloaded_share(results, traffic.started_at + 10, dropped_at)
    share_after = offloaded_share(results, dropped_at + TRACKING_SECONDS, dropped_at + TRAFFIC_SECONDS)
    print(f"offloaded {share_before:.0%} before the drop, {share_after:.0%} once measured; {summary}")
    print(f"the planner's observation: {planner_sees[-1]}")
    print(f"the planner's decision: link {planner_link_input(system)!r}")
    assert before is None or before > 0.5 * CONFIGURED_GBPS, (
        "the router thought the link slow before the drop"
    )
    assert share_after < 0.75 * share_before
