"""The sample PrfaasDeployment (examples/) and variants of its spec, for the operator's pure tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from prfaas_operator.api import PrfaasDeploymentSpec

SAMPLE_PATH = Path(__file__).resolve().parents[2] / "examples" / "prfaasdeployment.yaml"
SAMPLE: dict[str, Any] = yaml.safe_load(SAMPLE_PATH.read_text())


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
