"""The `sglang.launch_server` shim of the engine-sim image: SGLang's command starts the fake engine.

The engine pods the operator writes must run unchanged: every argument the operator gives
SGLang is one the fake engine knows, environment defaults never beat explicit arguments, and
KV is advertised at SGLANG_HOST_IP (the pod IP the operator sets) when the engine binds 0.0.0.0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from prfaas_engine_sim.settings import advertised_host, parse_args
from prfaas_operator.api import PrfaasDeploymentSpec
from prfaas_operator.planning.allocation import effective_allocation
from prfaas_operator.planning.manifests import Owner, engine_roles, engine_workload
from sglang.launch_server import fake_engine_argv

SAMPLE = yaml.safe_load(
    (Path(__file__).resolve().parents[3] / "examples" / "prfaasdeployment.yaml").read_text()
)
OWNER = Owner(name="kimi-linear", namespace="prfaas-demo", uid="0f6c7c2e-1111-2222-3333-444455556666")


def engine_containers() -> list[dict[str, Any]]:
    spec = PrfaasDeploymentSpec.model_validate(SAMPLE["spec"])
    allocation = effective_allocation(spec, None).allocation
    return [
        engine_workload(spec.model, role, OWNER, "fp")["spec"]["template"]["spec"]["containers"][0]
        for role in engine_roles(spec, OWNER, allocation)
    ]


def test_the_operators_engine_pods_run_the_fake_engine_with_their_own_arguments() -> None:
    containers = engine_containers()
    # python3 -m sglang.launch_server
    assert {c["command"][2] for c in containers} == {"sglang.launch_server"}
    for container in containers:
        args = container["args"]
        environ = {"PRFAAS_FAKE_ENGINE_PROFILE": "h20"}  # h20 has a decode section for every mode
        settings, _, unknown = parse_args(fake_engine_argv(args, environ))
        assert unknown == [], f"the fake engine does not know {unknown}"
        assert settings.host == "0.0.0.0"
        assert settings.port == int(args[args.index("--port") + 1])
        assert settings.mode == args[args.index("--disaggregation-mode") + 1]
        assert settings.served_model_name == SAMPLE["spec"]["model"]["servedModelName"]
        assert settings.profile == "h20"


def test_environment_defaults_yield_to_explicit_arguments() -> None:
    environ = {
        "PRFAAS_FAKE_ENGINE_PROFILE": "h200",
        "PRFAAS_FAKE_ENGINE_TIME_SCALE": "0.5",
        "PRFAAS_FAKE_ENGINE_KV_SCALE": "0.01",
        "PRFAAS_FAKE_ENGINE_ARGS": "--max-decode-batch 7 --decode-step-seconds 0.02",
    }
    settings, _, _ = parse_args(fake_engine_argv(["--kv-scale", "0.2", "--port", "31000"], environ))
    assert (settings.profile, settings.time_scale, settings.kv_scale) == ("h200", 0.5, 0.2)
    assert (settings.max_decode_batch, settings.decode_step_seconds, settings.port) == (7, 0.02, 31000)
    settings, _, _ = parse_args(fake_engine_argv(["--profile", "h20"], environ))
    assert settings.profile == "h20"


def test_without_environment_the_arguments_pass_unchanged() -> None:
    args = ["--port", "30000", "--enable-metrics"]
    assert fake_engine_argv(args, {}) == args
    assert fake_engine_argv(args, {"PRFAAS_FAKE_ENGINE_PROFILE": " ", "PRFAAS_FAKE_ENGINE_ARGS": ""}) == args


def test_kv_is_advertised_at_sglang_host_ip_when_set() -> None:
    assert advertised_host("0.0.0.0", {"SGLANG_HOST_IP": "10.1.2.3"}) == "10.1.2.3"
    assert advertised_host("10.9.9.9", {}) == "10.9.9.9"
    assert advertised_host("127.0.0.1", {"SGLANG_HOST_IP": ""}) == "127.0.0.1"
