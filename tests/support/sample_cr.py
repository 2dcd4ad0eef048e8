"""The sample PrfaasDeployment (examples/) and variants of its spec, for the operator's pure tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from prfaas_operator.api import PrfaasDeploymentSpec

SAMPLE_PATH = Path(__file__).resolve().parents[2] / "examples" / "prfaasdeployment.yaml"
SAMPLE: dict[str, Any] = yaml.safe_load(SAMPLE_PATH.read_text())
SAMPLE_ROUTER_ARGS = [
    "--config",
    "/etc/prfaas/router-config.json",
    "--config-map",
    "prfaas-demo/kimi-linear-router-config",
    "--host",
    "0.0.0.0",
    "--port",
    "8000",
    "--shutdown-delay-seconds",
    "5",
    "--drain-timeout-seconds",
    "133",
]
"""What the operator writes into the sample's router Deployment (operator/test_manifests), which the
router must parse into the settings it means (router/test_settings): one list for both sides."""


def spec(**changes: Any) -> PrfaasDeploymentSpec:
    """The sample spec with dotted-path changes, e.g. spec(**{"pdCluster.decodeInstances": 3})."""
    raw = copy.deepcopy(SAMPLE["spec"])
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return PrfaasDeploymentSpec.model_validate(raw)
