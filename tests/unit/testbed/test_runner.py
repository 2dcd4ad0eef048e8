"""The testbed's pure parts: pod -> local process, link numbers, traffic plans and the traffic client.

Pods are built from the operator's own builders (the same templates the StatefulSets carry), so
a change to what the operator writes is a change to what these tests translate.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer
from prfaas_core.trace import TraceError
from prfaas_operator.api import GatewaySpec, PrfaasDeploymentSpec
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.gateway import picker_deployment
from prfaas_operator.planning.manifests import (
    Owner,
    pd_cluster_engine_objects,
    prefill_cluster_objects,
    router_deployment,
)
from prfaas_testbed.clusters import Cluster, GpuPool
from prfaas_testbed.link import (
    LinkMode,
    LinkShape,
    LinkSpecError,
    delay_line_devices,
    delay_seconds,
    describe,
    engine_link_rate,
    prfaas_instances_of,
    tc_commands,
)
from prfaas_testbed.pod_supervisor import probe_passes
from prfaas_testbed.pod_workloads import (
    GrpcProbe,
    PodFacts,
    PodNotYetRunnable,
    PodWorkloadError,
    Programs,
    Scales,
    WorkloadKind,
    classify,
    expand_references,
    local_process,
    pod_dns_names,
    pod_from,
)
from prfaas_testbed.system import across_nodes
from prfaas_testbed.traffic import (
    CHARS_PER_TOKEN,
    PlannedRequest,
    TrafficDriver,
    TrafficSummary,
    lognormal_requests,
    percentile,
    prompt_text,
    shrunk,
    trace_requests,
)

REPO = Path(__file__).resolve().parents[3]
SAMPLE: dict[str, Any] = yaml.safe_load((REPO / "examples" / "prfaasdeployment.yaml").read_text())
SPEC = PrfaasDeploymentSpec.model_validate(SAMPLE["spec"])
OWNER = Owner(name="kimi-linear", namespace="prfaas-demo", uid="uid-of-the-cr")
PROGRAMS = Programs(python="/venv/bin/python", router="/venv/bin/prfaas-router")
H200_NODE = {"metadata": {"name": "h200-0", "labels": {"nvidia.com/gpu.product": "NVIDIA-H200"}}}
H20_NODE = {"metadata": {"name": "h20-0", "labels": {"nvidia.com/gpu.product": "NVIDIA-H20"}}}


def workloads() -> dict[str, dict[str, Any]]:
    allocation = effective_allocation(SPEC, None).allocation
    found = {
        o["metadata"]["name"]: o
        for o in prefill_cluster_objects(SPEC, OWNER, allocation, "fp")
        + pd_cluster_engine_objects(SPEC, OWNER, allocation, "fp")
        if o["kind"] == "StatefulSet"
    }
    found["router"] = router_deployment(SPEC, OWNER, None)
    return found


def translate(pod: dict[str, Any], node: dict[str, Any], tmp_path: Path, **options: Any) -> Any:
    return local_process(
        PodFacts.of(pod, node),
        programs=PROGRAMS,
        scales=Scales(time_scale=0.5, kv_scale=1e-3),
        pod_dir=tmp_path,
        base_env={"PATH": "/usr/bin", "KUBECONFIG": "/root/.kube/admin", "HOME": "/root"},
        **options,
    )


def flag(argv: tuple[str, ...], name: str) -> str:
    values = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == name]
    assert values, f"{name} not in {argv}"
    return values[-1]


def test_prfaas_prefill_pod_becomes_a_fake_engine_on_its_pod_ip(tmp_path: Path) -> None:
    pod = pod_from(
        workloads()["kimi-linear-prfaas-prefill"], "kimi-linear-prfaas-prefill-0", "127.100.1.2", H200_NODE
    )
    process = translate(pod, H200_NODE, tmp_path, link_rate_bytes_per_second=3.125e6)
    assert process.kind is WorkloadKind.ENGINE
    assert process.role == "prfaas-prefill"
    assert process.argv[:3] == ("/venv/bin/python", "-m", "prfaas_engine_sim")
    assert flag(process.argv, "--host") == "127.100.1.2"  # the pod's 0.0.0.0
    assert "0.0.0.0" not in " ".join(process.argv)
    assert flag(process.argv, "--disaggregation-mode") == "prefill"
    assert flag(process.argv, "--profile") == "h200"  # from the node's GPU product
    assert flag(process.argv, "--time-scale") == "0.5"
    assert float(flag(process.argv, "--link-rate-bytes-per-second")) == pytest.approx(3.125e6)
    assert process.readiness is not None and process.readiness.url == "http://127.100.1.2:30000/health"
    # the operator's own timeout and threshold: SGLang's /health never answers in under a second
    assert (process.readiness.timeout_seconds, process.readiness.failure_threshold) == (20.0, 3)
    assert process.metrics_port == 30000
    assert process.env["SGLANG_HOST_IP"] == "127.100.1.2"  # $(POD_IP) expanded from the fieldRef
    assert "KUBECONFIG" not in process.env and "HOME" not in process.env  # the host's env stays out


def test_decode_pod_on_an_h20_node_is_timed_as_h20_and_never_paced(tmp_path: Path) -> None:
    pod = pod_from(workloads()["kimi-linear-pd-decode"], "kimi-linear-pd-decode-0", "127.200.1.3", H20_NODE)
    process = translate(pod, H20_NODE, tmp_path)
    assert flag(process.argv, "--profile") == "h20"
    assert flag(process.argv, "--disaggregation-mode") == "decode"
    assert "--link-rate-bytes-per-second" not in process.argv


def test_router_pod_reads_its_config_from_a_local_copy_of_the_configmap(tmp_path: Path) -> None:
    pod = pod_from(workloads()["router"], "kimi-linear-router-abc", "127.200.2.4", H20_NODE)
    process = translate(pod, H20_NODE, tmp_path)
    assert process.kind is WorkloadKind.ROUTER and process.role == "router"
    assert process.argv[0] == "/venv/bin/prfaas-router"
    [volume] = process.volumes
    assert (volume.kind, volume.name) == ("ConfigMap", "kimi-linear-router-config")
    assert flag(process.argv, "--config") == str(volume.directory / "router-config.json")
    assert volume.directory.is_relative_to(tmp_path)
    assert flag(process.argv, "--host") == "127.200.2.4"
    assert process.readiness is not None and process.readiness.path == "/readiness"


def test_picker_pod_runs_the_router_with_its_picker_ports_probed_over_grpc_health(tmp_path: Path) -> None:
    spec = SPEC.model_copy(
        update={"gateway": GatewaySpec.model_validate({"inferencePool": {"enabled": True}})}
    )
    pod = pod_from(picker_deployment(spec, OWNER, None), "kimi-linear-picker-abc", "127.200.2.5", H20_NODE)
    process = translate(pod, H20_NODE, tmp_path)
    assert process.kind is WorkloadKind.ROUTER and process.role == "picker"
    assert process.argv[0] == "/venv/bin/prfaas-router"
    assert (flag(process.argv, "--picker-port"), flag(process.argv, "--picker-health-port")) == (
        "9002",
        "9003",
    )
    assert process.readiness == GrpcProbe(
        host="127.200.2.5", port=9003, service="readiness", timeout_seconds=3.0, failure_threshold=3
    )


def test_a_picker_tls_secret_becomes_a_local_directory_the_picker_is_pointed_at(tmp_path: Path) -> None:
    gateway_spec = {"inferencePool": {"enabled": True}, "picker": {"tls": {"secretName": "picker-cert"}}}
    spec = SPEC.model_copy(update={"gateway": GatewaySpec.model_validate(gateway_spec)})
    pod = pod_from(picker_deployment(spec, OWNER, None), "kimi-linear-picker-abc", "127.200.2.5", H20_NODE)
    process = translate(pod, H20_NODE, tmp_path)
    [secret] = [volume for volume in process.volumes if volume.kind == "Secret"]
    assert secret.name == "picker-cert" and secret.directory.is_relative_to(tmp_path)
    assert flag(process.argv, "--picker-tls-dir") == str(secret.directory)


def test_a_grpc_probe_passes_only_while_its_service_is_serving(unused_tcp_port: int) -> None:
    """Against a real grpc.health.v1 server, as the kubelet's probe runs it."""
    health = HealthServicer()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"127.0.0.1:{unused_tcp_port}")
    server.start()
    probe = GrpcProbe(host="127.0.0.1", port=unused_tcp_port, service="readiness", timeout_seconds=2.0)
    try:
        health.set("readiness", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert not probe_passes(probe)
        health.set("readiness", health_pb2.HealthCheckResponse.SERVING)
        assert probe_passes(probe)
        assert not probe_passes(GrpcProbe(host="127.0.0.1", port=unused_tcp_port, service="unknown"))
    finally:
        server.stop(None).wait()
    assert not probe_passes(probe)  # nothing listens


OPERATOR_CONTAINER = {
    "name": "operator",
    "image": "ghcr.io/prfaas/prfaas:0.1.0",
    "command": ["python", "-m", "prfaas_operator"],
    "args": ["--namespace=prfaas-demo", "--liveness=http://0.0.0.0:8080/healthz", "--metrics-port=9090"],
    "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
    "ports": [{"name": "health", "containerPort": 8080}, {"name": "metrics", "containerPort": 9090}],
    "readinessProbe": {"httpGet": {"path": "/healthz", "port": "health"}},
    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
}


def operator_pod(container: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": "op-0", "namespace": "prfaas-system", "uid": "uid-op", "labels": {}},
        "spec": {
            "serviceAccountName": "prfaas-operator",
            "nodeName": "cpu-0",
            "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
        "status": {"phase": "Running", "podIP": "127.200.9.9"},
    }


def test_operator_pod_runs_as_its_service_account_on_its_pod_ip(tmp_path: Path) -> None:
    process = translate(operator_pod(OPERATOR_CONTAINER), {"metadata": {"labels": {}}}, tmp_path)
    assert process.kind is WorkloadKind.OPERATOR and process.role == "operator"
    assert process.argv[:3] == ("/venv/bin/python", "-m", "prfaas_operator")
    assert "--liveness=http://127.200.9.9:8080/healthz" in process.argv
    assert flag(process.argv, "--bind-address") == "127.200.9.9"
    assert process.service_account == "prfaas-operator"
    assert process.env["KUBECONFIG"] == str(tmp_path / "kubeconfig.yaml")  # its own, never the host's
    assert process.env["POD_NAMESPACE"] == "prfaas-system"
    assert process.metrics_port == 9090
    assert process.readiness is not None and process.readiness.url == "http://127.200.9.9:8080/healthz"


def test_unknown_containers_are_not_run() -> None:
    assert classify({"command": ["nginx"]}) is None
    assert classify({"command": ["python3", "-m", "http.server"]}) is None
    assert classify({"args": ["--port", "1"]}) is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda pod, node: node["metadata"]["labels"].update({"nvidia.com/gpu.product": "NVIDIA-B200"}),
            "NVIDIA-B200",
        ),
        (lambda pod, node: node["metadata"]["labels"].clear(), "has no nvidia.com/gpu.product"),
        (
            lambda pod, node: pod["spec"]["containers"][0]["env"].append(
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
            ),
            "valueFrom secretKeyRef",
        ),
        (lambda pod, node: pod["status"].pop("podIP"), "no pod IP"),
        (
            lambda pod, node: pod["spec"]["containers"][0]["readinessProbe"]["httpGet"].update(
                {"port": "nope"}
            ),
            "no container port named 'nope'",
        ),
    ],
)
def test_a_pod_the_testbed_cannot_run_is_refused_with_the_cause(
    tmp_path: Path, change: Any, expected: str
) -> None:
    node = json.loads(json.dumps(H200_NODE))
    pod = pod_from(
        workloads()["kimi-linear-prfaas-prefill"], "kimi-linear-prfaas-prefill-0", "127.100.1.2", node
    )
    change(pod, node)
    with pytest.raises(PodWorkloadError, match=expected) as caught:
        translate(pod, node, tmp_path)
    assert "prfaas-demo/kimi-linear-prfaas-prefill-0" in str(caught.value)


def test_reference_expansion_follows_kubernetes() -> None:
    env = {"A": "1", "B": "x"}
    assert expand_references("$(A)-$(B)-$(C)-$$(A)", env) == "1-x-$(C)-$(A)"


# ---- link ---------------------------------------------------------------------------------------


def test_engine_link_rate_keeps_the_ratio_of_bytes_to_time() -> None:
    shape = LinkShape.of_spec(SAMPLE["spec"])
    assert shape.bandwidth_bytes_per_second == pytest.approx(12.5e9)
    rate = engine_link_rate(shape, Scales(time_scale=0.5, kv_scale=1e-3), prfaas_instances=4)
    # 1e-3 of the bytes in half the time, shared by 4 senders
    assert rate == pytest.approx(12.5e9 * 1e-3 / 0.5 / 4)
    real_seconds = 700e6 / (12.5e9 / 4)
    assert 700e6 * 1e-3 / rate == pytest.approx(real_seconds * 0.5)  # a transfer takes its scaled time


def test_link_spec_errors_and_instance_counts() -> None:
    with pytest.raises(LinkSpecError, match="bandwidthGbps"):
        LinkShape.of_spec({"link": {"bandwidthGbps": 0}})
    with pytest.raises(LinkSpecError, match="latencyMs"):
        LinkShape.of_spec({"link": {"bandwidthGbps": 10, "latencyMs": -1}})
    assert prfaas_instances_of(SAMPLE["spec"], None) == 4
    assert prfaas_instances_of(SAMPLE["spec"], {"allocation": {"prefillClusterReplicas": 2}}) == 2
    with pytest.raises(LinkSpecError):
        engine_link_rate(LinkShape(1e9, 0), Scales(), 0)


def test_the_link_description_says_what_ran_and_what_did_not() -> None:
    text = describe(LinkMode.ENGINE_TOKEN_BUCKET, LinkShape(12.5e9, 0.005), Scales())
    assert "token bucket" in text and "100 Gbit/s" in text and "5 ms latency is NOT emulated" in text
    assert "unshaped" in describe(LinkMode.UNSHAPED, None, Scales())
    veth = describe(LinkMode.NETNS_TC, LinkShape(12.5e9, 0.005), Scales(time_scale=1, kv_scale=1e-3))
    assert (
        "veth" in veth
        and "100 Mbit/s of scaled KV" in veth
        and "5 ms each way" in veth
        and "delay line" in veth
    )
    slow = describe(LinkMode.NETNS_TC, LinkShape(12.5e9, 0.005), Scales(time_scale=2, kv_scale=1e-3))
    assert "10 ms each way (the CR's 5 ms in testbed time)" in slow


def test_the_delay_line_holds_the_latency_in_testbed_time_beside_the_veth_pair() -> None:
    assert delay_seconds(LinkShape(12.5e9, 0.005), Scales(time_scale=2)) == pytest.approx(0.01)
    assert delay_seconds(None, Scales()) == 0.0
    assert delay_line_devices("pfa2ce57n") == ("pfa2ce57dh", "pfa2ce57dn")


def test_the_veth_is_one_token_bucket_for_the_whole_scaled_link() -> None:
    (command,) = tc_commands(
        LinkShape(12.5e9, 0.0), Scales(time_scale=0.5, kv_scale=1e-3), netns="ns", netns_device="dev"
    )
    assert command[:9] == ["tc", "-n", "ns", "qdisc", "replace", "dev", "dev", "root", "tbf"]
    options = dict(zip(command[9::2], command[10::2], strict=True))
    assert options["rate"] == f"{round(12.5e9 * 1e-3 / 0.5 * 8)}bit"  # 200 Mbit/s: bytes and time scaled
    assert int(options["burst"]) >= 256 * 1024  # never under a veth's 64 KiB GSO packets
    assert int(options["limit"]) >= 2 * 12.5e9 * 1e-3 / 0.5  # two seconds of KV may queue
    (unshaped,) = tc_commands(None, Scales(), netns="ns", netns_device="dev")
    assert unshaped[-1] == "pfifo_fast"


# ---- traffic plans ------------------------------------------------------------------------------

TRACE = REPO / "data" / "traces" / "mooncake-synthetic.jsonl"


def test_trace_plan_is_time_scaled_and_bounded() -> None:
    real = trace_requests(TRACE, time_scale=1.0, max_requests=1000, max_seconds=30)
    fast = trace_requests(TRACE, time_scale=0.5, max_requests=1000, max_seconds=15)
    assert len(real) == len(fast) > 10
    assert all(f.at == pytest.approx(r.at / 2) for r, f in zip(real, fast, strict=True))
    assert max(r.at for r in real) <= 30
    assert len(trace_requests(TRACE, time_scale=1.0, max_requests=7, max_seconds=1e9)) == 7


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n{"timestamp": 1}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl: line 2"):
        trace_requests(bad, time_scale=1, max_requests=10, max_seconds=10)


def test_prompts_share_text_exactly_where_the_trace_shares_blocks() -> None:
    first = prompt_text((1, 2, 3), 1400)
    second = prompt_text((1, 2, 9), 1200)
    assert len(first) == 1400 * CHARS_PER_TOKEN and len(second) == 1200 * CHARS_PER_TOKEN
    block = 512 * CHARS_PER_TOKEN
    assert first[: 2 * block] == second[: 2 * block]
    assert first[2 * block : 2 * block + 16] != second[2 * block : 2 * block + 16]
    assert len(prompt_text((), 300)) == 300 * CHARS_PER_TOKEN  # ids missing: padded, still exact


def test_a_shrunk_plan_keeps_its_arrivals_and_its_sharing_at_the_smaller_block() -> None:
    plan = [
        PlannedRequest(0.5, "trace", 1400, 300, (1, 2, 3)),
        PlannedRequest(0.9, "trace", 10, 20, (1, 2, 9)),
    ]
    small = shrunk(plan, 1 / 32, max_output_tokens=64)
    assert [(r.at, r.phase, r.hash_ids) for r in small] == [(r.at, r.phase, r.hash_ids) for r in plan]
    assert [(r.input_tokens, r.output_tokens) for r in small] == [(44, 64), (1, 20)]
    first, second = (prompt_text((1, 2, 3), 44, 16), prompt_text((1, 2, 9), 40, 16))
    block = 16 * CHARS_PER_TOKEN
    assert first[: 2 * block] == second[: 2 * block]
    assert first[2 * block : 3 * block] != second[2 * block : 3 * block]


def test_long_prompt_plan_is_deterministic_bounded_and_unshared() -> None:
    plan = lognormal_requests(rate_rps=2.0, seconds=30, time_scale=0.5, seed=3)
    again = lognormal_requests(rate_rps=2.0, seconds=30, time_scale=0.5, seed=3)
    assert plan == again
    assert 60 < len(plan) < 180  # ~120 requests at 4 req/s of wall time
    assert all(8192 <= r.input_tokens <= 131072 and r.at < 30 for r in plan)
    ids = [h for r in plan for h in r.hash_ids]
    assert len(ids) == len(set(ids))


def test_percentile_and_summary() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.9) == 4.0


# ---- the client against a real HTTP server --------------------------------------------------------


async def test_driver_classifies_answers_and_reads_the_route(unused_tcp_port: int) -> None:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        tokens = len(body["prompt"]) // CHARS_PER_TOKEN
        if tokens == 100:
            return web.json_response({"error": {"message": "over SLO"}}, status=429)
        if tokens == 200:
            return web.json_response({"error": {"message": "boom"}}, status=502)
        reply = web.StreamResponse(headers={"X-Prfaas-Route": "prfaas" if tokens > 1000 else "local"})
        await reply.prepare(request)
        await reply.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        if tokens == 300:
            await reply.write(b'data: {"error": {"message": "decode died"}}\n\n')
            return reply
        await reply.write(b"data: [DONE]\n\n")
        return reply

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    try:
        driver = TrafficDriver(f"http://127.0.0.1:{unused_tcp_port}", "m", max_inflight=8)
        plan = [PlannedRequest(0.0, "p", tokens, 4) for tokens in (100, 200, 300, 500, 2000, 2000)]
        await asyncio.wait_for(driver.run(plan), 30)
    finally:
        await runner.cleanup()
    summary = driver.summary()
    assert summary.outcomes == {"rejected": 1, "failed": 2, "ok": 3}
    assert summary.offloaded_fraction == pytest.approx(2 / 3)
    assert summary.ttft_p50 is not None and summary.ttft_p50 > 0
    assert any("decode died" in e for e in summary.errors) and any("HTTP 502" in e for e in summary.errors)
    assert isinstance(TrafficSummary.of([]).line(), str)


@pytest.mark.parametrize(
    ("image", "pulled"),
    [
        ("lmsysorg/sglang:v0.5.23", True),
        ("lmsysorg/sglang:v0.5.24", True),
        ("127.0.0.1:5000/prfaas-engine-sim:dev", True),
        ("lmsysorg/sglang:v0.5.99", False),
        ("lmsysorg/sglang", False),
    ],
)
def test_an_engine_image_outside_the_testbeds_registry_never_starts(
    tmp_path: Path, image: str, pulled: bool
) -> None:
    pod = pod_from(workloads()["kimi-linear-pd-decode"], "kimi-linear-pd-decode-0", "127.200.1.3", H20_NODE)
    pod["spec"]["containers"][0]["image"] = image
    process = translate(pod, H20_NODE, tmp_path)
    assert (process.pull_error is None) == pulled, process.pull_error
    if not pulled:
        assert f'Failed to pull image "{image}"' in process.pull_error
    assert process.env["PRFAAS_KV_FINGERPRINT"] == "fp"  # the operator's downward-API env, from the label


def test_a_group_workers_leader_address_resolves_to_the_leader_pod_as_cluster_dns_would(
    tmp_path: Path,
) -> None:
    """A LeaderWorkerSet worker: LWS's env expands into SGLang's group flags, and the leader's DNS
    name (no cluster DNS here) becomes the leader pod's IP; until the leader has one, not yet."""
    pools = {
        Cluster.PRFAAS: GpuPool("NVIDIA-H200", nodes=5, gpus_per_node=8, cpu_only_nodes=2),
        Cluster.PD: GpuPool("NVIDIA-H20", nodes=10, gpus_per_node=8, cpu_only_nodes=2),
    }
    spec = PrfaasDeploymentSpec.model_validate(across_nodes(SAMPLE, 2, pools)["spec"])
    (lws,) = [
        o
        for o in prefill_cluster_objects(spec, OWNER, effective_allocation(spec, None).allocation, "fp")
        if o["kind"] == "LeaderWorkerSet"
    ]
    workload = {
        "metadata": lws["metadata"],
        "spec": {"template": lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]},
    }
    leader = pod_from(workload, "kimi-linear-prfaas-prefill-1", "10.231.2.1", H200_NODE)
    leader["spec"].update(hostname="kimi-linear-prfaas-prefill-1", subdomain="kimi-linear-prfaas-prefill")
    worker = pod_from(workload, "kimi-linear-prfaas-prefill-1-1", "10.231.4.1", H200_NODE)
    lws_env = [
        {
            "name": "LWS_LEADER_ADDRESS",
            "value": "kimi-linear-prfaas-prefill-1.kimi-linear-prfaas-prefill.prfaas-demo",
        },
        {"name": "LWS_GROUP_SIZE", "value": "2"},
        {"name": "LWS_WORKER_INDEX", "value": "1"},
    ]
    (container,) = worker["spec"]["containers"]
    worker["spec"]["containers"] = [{**container, "env": [*lws_env, *container["env"]]}]
    with pytest.raises(PodNotYetRunnable, match="names no pod with an IP yet"):
        translate(worker, H200_NODE, tmp_path)
    hosts = {name: "10.231.2.1" for name in pod_dns_names(leader)}
    assert "kimi-linear-prfaas-prefill-1.kimi-linear-prfaas-prefill.prfaas-demo.svc.cluster.local" in hosts
    process = translate(worker, H200_NODE, tmp_path, hosts=hosts)
    assert flag(process.argv, "--dist-init-addr") == "10.231.2.1:20000"
    assert (flag(process.argv, "--nnodes"), flag(process.argv, "--node-rank")) == ("2", "1")
    assert flag(process.argv, "--tp-size") == "16"


def test_across_nodes_fits_the_sample_to_the_testbeds_nodes() -> None:
    pools = {
        Cluster.PRFAAS: GpuPool("NVIDIA-H200", nodes=5, gpus_per_node=8, cpu_only_nodes=2),
        Cluster.PD: GpuPool("NVIDIA-H20", nodes=10, gpus_per_node=8, cpu_only_nodes=2),
    }
    spec = PrfaasDeploymentSpec.model_validate(across_nodes(SAMPLE, 2, pools)["spec"])
    assert spec.prefill_cluster.nodes_per_instance == spec.pd_cluster.nodes_per_instance == 2
    assert spec.prefill_cluster.gpus_per_instance == 16
    assert spec.prefill_cluster.replicas * 2 <= 5 and spec.prefill_cluster.max_replicas * 2 <= 5
    assert spec.pd_cluster.instances * 2 <= 10 and spec.pd_cluster.decode_instances >= 1
    assert across_nodes(SAMPLE, 1, pools)["spec"]["pdCluster"]["instances"] == 8  # one node: as it was
