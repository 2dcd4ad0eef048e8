"""The demo (the README's first command): the whole system on two local clusters, under live traffic.

    scripts/demo.sh [--duration SECONDS] [--time-scale X] [--keep] [--engines fake|sglang]

It builds or reuses the testbed, installs the chart (the operator in the PD cluster; the
least-privilege access identity in the PrfaaS cluster, with a kubeconfig Secret for it in the
PD cluster), applies the repository's sample PrfaasDeployment with the planner and routing in
Auto, runs the pods (the runner) and Prometheus, and drives traffic to the router's pod IP:
the Mooncake trace, then a shift to long prompts. It prints a progress line every few seconds
and a summary: requests served and failed, fraction offloaded, TTFT, KV egress, every planner
decision with its reason, and which link emulation ran.

With --engines sglang the engine pods run real SGLang 0.5.23 on CPU (scripts/setup-sglang-cpu.sh's
venv and tiny model; processes on kwok's nodes, as the fake's are), one of each role: the CR is
the sample's with the tiny model (prfaas_testbed.sglang_cpu), the router counts tokens with the
model's tokenizer (a ConfigMap), and the traffic is the same plan at 1/64 of its prompt lengths
(the model's context is 8192 tokens) with outputs capped and, unless --time-scale says otherwise,
the trace's gaps 4x longer.

Without --duration the traffic phases run once (about 3.5 minutes) and the system stays up for
kubectl until Ctrl-C; with --duration the traffic fills that time and the demo then tears
down. Tear-down deletes the CR, uninstalls the releases and stops the runner and Prometheus;
the clusters stay up with --keep, or when they were already running before the demo.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap
from prfaas_core import metrics_contract as contract
from prfaas_core.trace import TRACE_BLOCK_TOKENS
from prfaas_core.vocabulary import Pool

from prfaas_testbed.clusters import Testbed, TestbedError, ensure_testbed, is_testbed_up, teardown_testbed
from prfaas_testbed.leftovers import stop_processes_of
from prfaas_testbed.link import LinkMode, LinkShape, describe
from prfaas_testbed.pod_workloads import Scales
from prfaas_testbed.prometheus import PrometheusError
from prfaas_testbed.rtt import connect_rtt_seconds
from prfaas_testbed.sglang_cpu import MODEL_DIR, SglangCpuMissing, cpu_cr, engine_python
from prfaas_testbed.system import (
    FIELD_MANAGER,
    REPO,
    LiveSystem,
    LiveSystemError,
    across_nodes,
    customise_cr,
    load_sample_cr,
)
from prfaas_testbed.traffic import PlannedRequest, TrafficDriver, lognormal_requests, shrunk, trace_requests

TRACE = REPO / "data" / "traces" / "mooncake-synthetic.jsonl"
PROGRESS_SECONDS = 5.0
DEMO_PLANNER = {
    "mode": "Auto",
    "intervalSeconds": 10,
    "windowSeconds": 60,
    "hysteresis": 0.05,
    "cooldownSeconds": 30,
}
LONG_PROMPT_RATE_RPS = 1.0
"""Real-time arrival rate of the long-prompt phase: above what the trace's optimum serves, below the new one's."""
DEFAULT_PHASE_SECONDS = (90.0, 120.0)
TRACE_SHARE = 0.4
"""With --duration: the share of it the trace gets; the long prompts get the rest."""
SETTLE_SECONDS = 30.0
"""After the traffic plan: how long requests still in flight may take before the summary."""
REAL_PROMPT_FACTOR = 1 / 64
"""--engines sglang: prompts at this fraction of the plan's lengths, the trace's 512-token blocks
at 8. The prompt text is about 2.8 of the tiny model's tokens per planned token (4 characters;
measured: a 4096-token plan was 11598 tokens), so the longest plan, 131K, stays inside its
8192-token context: about 5800 tokens."""
REAL_TIME_SCALE = 4.0
"""--engines sglang without --time-scale: the trace's gaps times this (about 1 request a second).
Three CPU servers here serve about one a second; at the trace's own 3.9 they queued into 429s."""
REAL_MAX_OUTPUT_TOKENS = 64
REAL_READY_SECONDS = 600.0
"""Three real servers load their model together on this machine's cores: minutes, not seconds."""
TOKENIZER_CONFIGMAP = "tiny-gpt2-tokenizer"
IDLE_SECONDS = 15.0
"""After the traffic: how long the system idles before the router's readiness is read. SGLang's
/health never answers in under a second: an idle router must still keep every engine."""


def _json_of(url: str) -> dict[str, Any]:
    """A JSON answer, whatever its status (/readiness says why in a 503 too)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            body = reply.read()
    except urllib.error.HTTPError as err:
        body = err.read()
    found: dict[str, Any] = json.loads(body)
    return found


def size_text(count: float) -> str:
    """Bytes in GB from 1 GB up, else in MB (the tiny model's real KV is megabytes)."""
    return f"{count / 1e9:.1f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


def say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


def link_round_trip(system: LiveSystem) -> str:
    """The round trip TCP sees to the first PrfaaS prefill (a connect's handshake), measured now."""
    pools = (system.router_config() or {}).get("pools") or {}
    endpoints = pools.get(Pool.PRFAAS_PREFILL) or []
    if not endpoints:
        return "n/a (no PrfaaS prefill in the router config)"
    where = urlsplit(endpoints[0]["url"])
    if where.hostname is None or where.port is None:
        return f"n/a ({endpoints[0]['url']!r} has no host and port)"
    try:
        seconds = connect_rtt_seconds(where.hostname, where.port)
    except OSError as err:
        return f"n/a ({where.netloc}: {err})"
    return f"{seconds * 1000:.2f} ms to {where.netloc} (median TCP handshake of 5)"


@dataclass
class PlannerLog:
    """Every planner decision seen in status.planner (one per `time`), and every allocation in force."""

    decisions: list[dict[str, Any]] = field(default_factory=list)
    allocations: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    def observe(self, cr: dict[str, Any] | None, elapsed: float) -> None:
        status = (cr or {}).get("status") or {}
        planner = status.get("planner")
        if planner and (not self.decisions or self.decisions[-1].get("time") != planner.get("time")):
            self.decisions.append({**planner, "elapsed": elapsed})
        allocation = status.get("allocation")
        if allocation:
            point = {
                k: allocation.get(k)
                for k in (
                    "thresholdTokens",
                    "prefillClusterReplicas",
                    "pdPrefillInstances",
                    "pdDecodeInstances",
                    "source",
                )
            }
            if not self.allocations or self.allocations[-1][1] != point:
                self.allocations.append((elapsed, point))


def allocation_text(point: dict[str, Any]) -> str:
    return (
        f"threshold {point.get('thresholdTokens')}, PrfaaS {point.get('prefillClusterReplicas')} "
        f"local-prefill {point.get('pdPrefillInstances')} decode {point.get('pdDecodeInstances')} ({point.get('source')})"
    )


def plan_traffic(
    duration: float | None, time_scale: float, prompt_factor: float = 1.0
) -> tuple[list[PlannedRequest], float, float]:
    """The trace phase then the long-prompt phase, bounded; returns the plan, when the shift comes, the length."""
    trace_seconds, long_seconds = (
        (duration * TRACE_SHARE, duration * (1 - TRACE_SHARE))
        if duration is not None
        else DEFAULT_PHASE_SECONDS
    )
    trace = trace_requests(TRACE, time_scale=time_scale, max_requests=5000, max_seconds=trace_seconds)
    long = lognormal_requests(
        rate_rps=LONG_PROMPT_RATE_RPS, seconds=long_seconds, time_scale=time_scale, seed=7
    )
    shifted = [
        PlannedRequest(r.at + trace_seconds, r.phase, r.input_tokens, r.output_tokens, r.hash_ids)
        for r in long
    ]
    plan = trace + shifted
    if prompt_factor != 1:
        plan = shrunk(plan, prompt_factor, REAL_MAX_OUTPUT_TOKENS)
    return plan, trace_seconds, trace_seconds + long_seconds


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.real_engines = args.engines == "sglang"
        self.prompt_factor = REAL_PROMPT_FACTOR if self.real_engines else 1.0
        time_scale = args.time_scale or (REAL_TIME_SCALE if self.real_engines else 1.0)
        self.scales = Scales(time_scale=time_scale, kv_scale=args.kv_scale)
        self.system: LiveSystem | None = None
        self.testbed: Testbed | None = None
        self.was_up = False
        self.planner_log = PlannerLog()
        self.started = 0.0
        self.shift_at = 0.0

    # ---- setup ----------------------------------------------------------------------------------

    def bring_up(self) -> LiveSystem:
        self.was_up = is_testbed_up()
        say(
            "testbed: reusing the running clusters"
            if self.was_up
            else "testbed: creating the clusters (the first run builds Kubernetes from source: ~20 min)"
        )
        try:
            sglang_python = engine_python() if self.real_engines else None
        except SglangCpuMissing as err:
            raise LiveSystemError(str(err)) from None
        self.testbed = ensure_testbed()
        work = self.testbed.state_dir / "demo"
        stopped = stop_processes_of(work, timeout_s=30)
        if stopped:
            say(f"stopped {len(stopped)} process(es) a killed earlier demo left running")
        shutil.rmtree(work, ignore_errors=True)
        system = self.system = LiveSystem(self.testbed, work, scales=self.scales, sglang_python=sglang_python)
        t0 = time.monotonic()
        system.start()
        assert system.prometheus is not None
        layout = system.layout
        say(f"Prometheus {system.prometheus.url}; runner state and pod logs in {system.runner_dir}")
        say(
            f"chart installed: operator in pd/{layout.system_namespace} (watching {layout.deployment_namespace}), "
            f"access identity {layout.access_service_account} in prfaas/{layout.system_namespace}, "
            f"its kubeconfig in Secret pd/{layout.deployment_namespace}/{layout.secret_name} "
            f"({time.monotonic() - t0:.0f}s)"
        )
        cr = customise_cr(
            cpu_cr(load_sample_cr(), name="demo-sglang") if self.real_engines else load_sample_cr(),
            layout,
            prometheus_url=system.prometheus.url,
            planner=DEMO_PLANNER,
            routing_mode="Auto",
        )
        if self.real_engines:
            self.store_tokenizer(system)
            cr["spec"]["router"]["tokenizer"] = {"configMap": TOKENIZER_CONFIGMAP}
            say(
                f"engines: real SGLang on CPU ({sglang_python}), model {MODEL_DIR.name}; the router counts "
                f"tokens with its tokenizer (ConfigMap {TOKENIZER_CONFIGMAP})"
            )
        if self.args.nodes_per_instance > 1:
            if not self.testbed.real_nodes:
                raise LiveSystemError(
                    "--nodes-per-instance needs LeaderWorkerSet, which the testbed runs on its real nodes; "
                    "this machine cannot run containers"
                )
            pools = {cluster: info.gpu_pool for cluster, info in self.testbed.clusters.items()}
            cr = across_nodes(cr, self.args.nodes_per_instance, pools)
            spec = cr["spec"]
            say(
                f"instances across {self.args.nodes_per_instance} nodes (LeaderWorkerSets): PrfaaS prefill "
                f"{spec['prefillCluster']['replicas']} of {spec['prefillCluster']['gpusPerInstance']} GPUs, PD "
                f"{spec['pdCluster']['instances']} of {spec['pdCluster']['gpusPerInstance']} GPUs"
            )
        system.cr_name = str(cr["metadata"]["name"])
        if system.cr() is not None:
            say("deleting the PrfaasDeployment a previous run left")
            system.delete_cr()
        system.apply(cr)
        t0 = time.monotonic()
        say(
            f"applied PrfaasDeployment {layout.deployment_namespace}/{system.cr_name}: planner Auto every "
            f"{DEMO_PLANNER['intervalSeconds']}s over {DEMO_PLANNER['windowSeconds']}s, cooldown {DEMO_PLANNER['cooldownSeconds']}s, routing Auto"
        )
        system.wait_ready(REAL_READY_SECONDS if self.real_engines else 240)
        ready_cr = system.cr() or {}
        status = ready_cr.get("status") or {}
        say(
            f"Ready {time.monotonic() - t0:.0f}s after apply: PrfaaS prefill {status.get('prefillCluster', {}).get('ready')}, "
            f"local prefill {status.get('pdPrefill', {}).get('ready')}, decode {status.get('pdDecode', {}).get('ready')}; "
            f"router at {system.router_url()}"
        )
        say(f"link emulation: {self.link_text(system, ready_cr['spec'])}")
        say(
            "nodes: the operator and the router run as containers on a real kubelet node in the PD "
            "cluster, from the project's images"
            if self.testbed.real_nodes
            else "nodes: kwok only (this machine cannot run containers, or PRFAAS_TESTBED_NODES=process); "
            "the runner starts every pod as a process"
        )
        return system

    def link_text(self, system: LiveSystem, spec: dict[str, Any]) -> str:
        if self.real_engines and system.link_mode is LinkMode.ENGINE_TOKEN_BUCKET:
            return "unshaped: real SGLang cannot pace its KV sends, and this testbed has no link namespace for tc"
        text = describe(system.link_mode, LinkShape.of_spec(spec), self.scales)
        return text + ("; real SGLang sends the tiny model's own KV, unscaled" if self.real_engines else "")

    def store_tokenizer(self, system: LiveSystem) -> None:
        """The tiny model's tokenizer.json in a ConfigMap, where the CR's router.tokenizer finds it."""
        text = (MODEL_DIR / "tokenizer.json").read_text()
        metadata = ObjectMeta(name=TOKENIZER_CONFIGMAP, namespace=system.layout.deployment_namespace)
        system.pd.apply(
            ConfigMap(metadata=metadata, data={"tokenizer.json": text}), field_manager=FIELD_MANAGER
        )

    # ---- traffic ----------------------------------------------------------------------------------

    async def drive(self, system: LiveSystem, stop: asyncio.Event) -> TrafficDriver:
        url = system.router_url()
        if url is None:
            raise LiveSystemError("the router has no ready pod")
        plan, self.shift_at, seconds = plan_traffic(
            self.args.duration, self.scales.time_scale, self.prompt_factor
        )
        phases = {phase: sum(1 for r in plan if r.phase == phase) for phase in ("trace", "long")}
        say(
            f"traffic to {url}: {phases['trace']} requests of the Mooncake trace, then {phases['long']} long prompts "
            f"(~{50 * self.prompt_factor:.3g}K tokens, {LONG_PROMPT_RATE_RPS:g} req/s in model time) from "
            f"t={self.shift_at:.0f}s; {seconds:.0f}s in all at time scale {self.scales.time_scale:g}"
            + (
                f"; prompts at {self.prompt_factor:g} of their lengths, outputs at most {REAL_MAX_OUTPUT_TOKENS} tokens"
                if self.prompt_factor != 1
                else ""
            )
        )
        driver = TrafficDriver(
            url,
            str((system.cr() or {}).get("spec", {}).get("model", {}).get("servedModelName", "")),
            request_timeout_seconds=max(60.0, 300 * self.scales.time_scale),
            block_tokens=round(TRACE_BLOCK_TOKENS * self.prompt_factor),
        )
        self.started = time.monotonic()
        sending = asyncio.create_task(driver.run(plan, stop, settle_seconds=SETTLE_SECONDS))
        while not sending.done():
            await asyncio.wait({sending}, timeout=PROGRESS_SECONDS)
            await self.progress(system, driver)
        await sending
        return driver

    async def progress(self, system: LiveSystem, driver: TrafficDriver) -> None:
        elapsed = time.monotonic() - self.started
        cr = await asyncio.to_thread(system.cr)
        self.planner_log.observe(cr, elapsed)
        phase = "trace" if elapsed < self.shift_at else "long"
        summary = driver.summary()
        status = (cr or {}).get("status") or {}
        allocation = status.get("allocation") or {}
        planner = status.get("planner") or {}
        counts = summary.outcomes
        offloaded = "n/a" if summary.offloaded_fraction is None else f"{summary.offloaded_fraction:.0%}"
        p50 = "n/a" if summary.ttft_p50 is None else f"{summary.ttft_p50:.1f}s"
        print(
            f"  t={elapsed:4.0f}s {phase:5} sent {summary.sent:4} ok {counts.get('ok', 0):4} 429 {counts.get('rejected', 0):3} "
            f"fail {counts.get('failed', 0):3} inflight {driver.inflight:3} | offloaded {offloaded:>4} TTFT p50 {p50:>6} | "
            f"threshold {allocation.get('thresholdTokens')} prfaas {status.get('prefillCluster', {}).get('ready')}/{allocation.get('prefillClusterReplicas')} "
            f"local-prefill {status.get('pdPrefill', {}).get('ready')}/{allocation.get('pdPrefillInstances')} "
            f"decode {status.get('pdDecode', {}).get('ready')}/{allocation.get('pdDecodeInstances')} | "
            f"planner {planner.get('action', '-')}: {str(planner.get('reason', ''))[:60]}",
            flush=True,
        )

    async def idle_health(self, system: LiveSystem) -> str:
        """The router's workers after IDLE_SECONDS without traffic, and the ejections it logged."""
        say(f"traffic done; idling {IDLE_SECONDS:g} s, then reading the router's /readiness")
        await asyncio.sleep(IDLE_SECONDS)
        url = system.router_url()
        if url is None:
            return "unknown: the router has no ready pod"
        try:
            readiness = await asyncio.to_thread(_json_of, url + "/readiness")
        except (OSError, ValueError) as err:
            return f"unknown: /readiness did not answer ({err})"
        healthy, total = readiness.get("healthy_workers", {}), readiness.get("total_workers", {})
        pools = ", ".join(f"{pool} {healthy.get(pool, 0)}/{count}" for pool, count in total.items())
        await asyncio.to_thread(system.keep_container_logs)
        ejections = sum(
            path.read_text(errors="replace").count(" is unhealthy")
            for path in system.work_dir.rglob("*.log")
            if "-router-" in str(path)
        )
        return f"{readiness.get('status')}; healthy workers {pools}; ejections the router logged: {ejections}"

    # ---- summary ------------------------------------------------------------------------------------

    def egress(self, system: LiveSystem) -> tuple[float | None, float | None]:
        """KV egress: the router's estimate in real bytes, and the bytes the PrfaaS engines really sent
        (the fake's counter of its scaled bytes; SGLang's per-transfer histogram of MiB)."""
        assert system.prometheus is not None
        namespace = system.layout.deployment_namespace

        def total(promql: str) -> float | None:
            try:
                result = system.prometheus.query(promql) if system.prometheus else []
            except (PrometheusError, OSError):  # e.g. Prometheus stopped by a signal meant for the demo
                return None
            return float(result[0]["value"][1]) if result else None

        sent = (
            f'{{__name__=~"{contract.stored_names(contract.ENGINE_KV_TRANSFER_TOTAL_MB + "_sum")}",'
            f'cluster="prfaas",namespace="{namespace}"}}'
            if self.real_engines
            else f'prfaas_fake_engine_kv_bytes_sent_total{{cluster="prfaas",namespace="{namespace}"}}'
        )
        wire = total(f"sum(max_over_time({sent}[1h]))")
        return (
            total(f'sum(max_over_time(prfaas_router_kv_egress_bytes_total{{namespace="{namespace}"}}[1h]))'),
            wire * contract.BYTES_PER_MIB if wire is not None and self.real_engines else wire,
        )

    def summary(self, system: LiveSystem, driver: TrafficDriver, idle: str) -> None:
        say("summary")
        for phase, label in (("trace", "Mooncake trace"), ("long", "long prompts"), (None, "all")):
            print(f"  {label:15} {driver.summary(phase).line()}")
        print(f"  router after {IDLE_SECONDS:g} s idle: {idle}")
        errors = driver.summary().errors
        for text, count in sorted(errors.items(), key=lambda item: -item[1])[:5]:
            print(f"    failed x{count}: {text}")
        router_bytes, wire_bytes = self.egress(system)
        router_text = (
            "unknown (no router series in Prometheus)" if router_bytes is None else size_text(router_bytes)
        )
        wire_text = "unknown" if wire_bytes is None else size_text(wire_bytes)
        sent_text = (
            "sent over Mooncake TCP (SGLang's sglang:kv_transfer_total_mb)"
            if self.real_engines
            else f"really sent over TCP (kv-scale {self.scales.kv_scale:g})"
        )
        print(
            f"  KV egress PrfaaS -> PD: {router_text} in model bytes (router's estimate); {wire_text} {sent_text}"
        )
        print("  allocation in force over time:")
        for elapsed, point in self.planner_log.allocations:
            print(f"    t={elapsed:4.0f}s {allocation_text(point)}")
        print(f"  planner decisions ({len(self.planner_log.decisions)}):")
        for decision in self.planner_log.decisions:
            print(f"    t={decision['elapsed']:4.0f}s {decision.get('action'):6} {decision.get('reason')}")
        applied = system.events(["PlannerApplied"])
        print(f"  PlannerApplied events: {len(applied)}")
        for event in applied:
            print(f"    {event.get('lastTimestamp') or event.get('eventTime')}: {event.get('message')}")
        pods = system.runner_status()["pods"]
        processes = [p for p in pods if p.get("state") != "container"]
        print(
            f"  pods the runner runs as processes on kwok's nodes: {len(processes)}, "
            f"restarts {sum(p['restarts'] for p in processes)}"
        )
        for pod in (p for p in pods if p.get("state") == "container"):
            print(
                f"  {pod['kind']} pod {pod['namespace']}/{pod['pod']}: a container on {pod['node']} "
                f"(kubelet, containerd, image {pod.get('image')}), ready {pod['ready']}, restarts {pod['restarts']}"
            )
        cr = system.cr() or {}
        print(f"  link: {self.link_text(system, cr['spec']) if cr else 'n/a'}")
        print(f"  link round trip: {link_round_trip(system)}")
        if self.scales.time_scale != 1 and self.real_engines:
            print(
                f"  time scale {self.scales.time_scale:g}: the trace's gaps {self.scales.time_scale:g}x longer "
                "(real engines compute at their own speed); the link's rate as much lower"
            )
        elif self.scales.time_scale != 1:
            print(
                f"  time scale {self.scales.time_scale:g}: engines compute {1 / self.scales.time_scale:g}x faster and requests "
                "arrive as much faster, so rates Prometheus shows are that many times the model's"
            )

    def print_kubectl(self) -> None:
        assert self.testbed is not None
        say("the clusters are up; inspect them with kubectl:")
        print(
            f"  export KUBECONFIG={self.testbed.pd_kubeconfig}        # PD cluster (operator, router, local engines)"
        )
        print(
            "  kubectl get prfaas -A -o wide; kubectl -n prfaas-demo get pods,statefulsets,leaderworkersets"
        )
        print(f"  export KUBECONFIG={self.testbed.prfaas_kubeconfig}    # PrfaaS cluster (prefill engines)")

    def tear_down(self) -> None:
        if self.system is not None:
            say(
                "tearing down: deleting the PrfaasDeployment, uninstalling the releases, stopping the runner and Prometheus"
            )
            for problem in self.system.stop():
                say(f"tear-down problem: {problem}")
        if self.args.keep or self.was_up:
            say(
                "clusters left up"
                + (" (--keep)" if self.args.keep else " (they were running before the demo)")
            )
        elif self.testbed is not None:
            teardown_testbed()
            say("clusters deleted (the built binaries stay cached)")


async def _run(demo: Demo, system: LiveSystem) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()

    def on_signal() -> None:
        if interrupted.is_set():
            return
        interrupted.set()
        stop.set()
        say("stopping (Ctrl-C)")

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    driver = await demo.drive(system, stop)
    idle = await demo.idle_health(system) if not interrupted.is_set() else "not read (interrupted)"
    demo.summary(system, driver, idle)
    if demo.args.duration is None and not interrupted.is_set():
        demo.print_kubectl()
        say("Ctrl-C to tear down")
        await interrupted.wait()
    failed = driver.summary().outcomes.get("failed", 0)
    return 0 if driver.summary().outcomes.get("ok", 0) > 0 and failed == 0 else 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/demo.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of traffic, then tear down (default: run the phases once and stay up until Ctrl-C)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="engine compute times and trace gaps are multiplied by this (0.5: twice as fast); default 1, "
        f"with --engines sglang {REAL_TIME_SCALE:g} (its gaps only: real engines keep their speed)",
    )
    parser.add_argument(
        "--kv-scale", type=float, default=1e-3, help="fraction of the real KV bytes the engines send"
    )
    parser.add_argument(
        "--keep", action="store_true", help="leave the clusters up after tearing the system down"
    )
    parser.add_argument(
        "--engines",
        choices=("fake", "sglang"),
        default="fake",
        help="engine pods: the fake engine timed by H200/H20 profiles (default), or real SGLang on CPU "
        "(one instance of each role, the tiny model; needs scripts/setup-sglang-cpu.sh's venv)",
    )
    parser.add_argument(
        "--nodes-per-instance",
        type=int,
        default=1,
        help="nodes each engine instance spans (more than 1: LeaderWorkerSets, fewer instances)",
    )
    args = parser.parse_args(argv)
    if args.duration is not None and not args.duration >= 30:
        parser.error(f"--duration must be at least 30 seconds, got {args.duration:g}")
    if args.time_scale is not None and not 0 < args.time_scale <= 10:
        parser.error(f"--time-scale must be in (0, 10], got {args.time_scale:g}")
    if not 0 < args.kv_scale <= 1:
        parser.error(f"--kv-scale must be in (0, 1], got {args.kv_scale:g}")
    if args.engines == "sglang" and args.nodes_per_instance != 1:
        parser.error("--engines sglang runs one CPU server per instance: --nodes-per-instance must be 1")
    if not 1 <= args.nodes_per_instance <= 4:
        parser.error(
            f"--nodes-per-instance must be in [1, 4] (the testbed has 5 H200 nodes), got {args.nodes_per_instance}"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    demo = Demo(args)
    code = 1
    try:
        system = demo.bring_up()
        code = asyncio.run(_run(demo, system))
    except KeyboardInterrupt:
        say("interrupted")
    except (TestbedError, LiveSystemError, PrometheusError) as err:
        say(f"error: {err}")
        if demo.system is not None:
            say(f"logs: {demo.system.work_dir} (runner.log, runner/pods/*/*/*/process.log)")
    finally:
        demo.tear_down()
    return code


if __name__ == "__main__":
    sys.exit(main())
