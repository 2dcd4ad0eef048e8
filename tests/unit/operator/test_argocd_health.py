"""The chart's Argo CD health check (health.lua), run by Debian's Lua 5.1 as Argo CD would run it.

Argo CD runs health scripts with gopher-lua (Lua 5.1) and the object as the global `obj`. Each
directory `<group>/<Kind>/` under charts/prfaas-operator/argocd/ holds Argo CD's own test
format (health_test.yaml naming testdata/*.yaml and the expected status and message); every
case runs here, and statuses the operator's own `compute_status` writes are checked too.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prfaas_operator.planning.status import ClusterObservation, Problem, compute_status

from unit.operator.test_status import inputs

ARGOCD = Path(__file__).resolve().parents[3] / "charts/prfaas-operator/argocd"
CHECK = ARGOCD / "prfaas.io/PrfaasDeployment"


def lua_literal(value: Any) -> str:
    """A Lua 5.1 table constructor for a decoded YAML/JSON document (null keys are left out)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = "".join(
            ch if (ch.isprintable() and ch not in '"\\') or ord(ch) > 127 else f"\\{ord(ch):03d}"
            for ch in value
        )
        return f'"{escaped}"'
    if isinstance(value, list):
        return "{" + ", ".join(lua_literal(item) for item in value) + "}"
    if isinstance(value, dict):
        pairs = (f"[{lua_literal(k)}] = {lua_literal(v)}" for k, v in value.items() if v is not None)
        return "{" + ", ".join(pairs) + "}"
    raise TypeError(f"no Lua literal for {type(value).__name__}: quote timestamps in test data")


def health(check: Path, obj: dict[str, Any]) -> dict[str, str]:
    """What `check/health.lua` says of `obj`: {"status", "message"}."""
    lua = shutil.which("lua5.1")
    assert lua, "lua5.1 is missing: run testbed/scripts/install-deps.sh (Debian's lua5.1)"
    script = (
        f"obj = {lua_literal(obj)}\n"
        f"local function check()\n{(check / 'health.lua').read_text()}\nend\n"
        'local hs = check()\nio.write(hs.status, "\\0", hs.message or "")\n'
    )
    done = subprocess.run([lua, "-"], input=script, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    status, message = done.stdout.split("\0")
    return {"status": status, "message": message}


def argocd_cases() -> list[tuple[Path, dict[str, Any]]]:
    return [
        (test_file.parent, case)
        for test_file in sorted(ARGOCD.glob("*/*/health_test.yaml"))
        for case in yaml.safe_load(test_file.read_text())["tests"]
    ]


def test_every_check_directory_has_its_script_and_cases() -> None:
    checks = {path.parent for path in ARGOCD.glob("*/*/health.lua")}
    assert checks == {CHECK}
    assert {check for check, _ in argocd_cases()} == checks


@pytest.mark.parametrize(
    ("check", "case"), argocd_cases(), ids=lambda c: c["inputPath"] if isinstance(c, dict) else ""
)
def test_argocd_health_case(check: Path, case: dict[str, Any]) -> None:
    obj = yaml.safe_load((check / case["inputPath"]).read_text())
    assert health(check, obj) == case["healthStatus"]


def cr_with(status: Any, generation: int = 2) -> dict[str, Any]:
    document = status.model_dump(by_alias=True, mode="json", exclude_none=True)
    return {
        "metadata": {"name": "kimi", "namespace": "serving", "generation": generation},
        "status": document,
    }


def test_the_operators_own_statuses_read_as_healthy_progressing_and_degraded() -> None:
    ready = compute_status(inputs())
    assert health(CHECK, cr_with(ready))["status"] == "Healthy"
    assert health(CHECK, cr_with(ready, generation=3)) == {
        "status": "Progressing",
        "message": "Waiting for the operator to observe generation 3",
    }
    rolling = compute_status(
        inputs(pd_cluster=ClusterObservation(ready={"pd-prefill": 1, "pd-decode": 5, "router": 1}))
    )
    assert health(CHECK, cr_with(rolling)) == {
        "status": "Progressing",
        "message": "PDClusterReady is False (Progressing): 1/3 local prefill, 5/5 decode ready",
    }
    problem = Problem(
        "Unreachable", "cannot reach the PrfaaS cluster at https://127.0.0.1:1: connection refused"
    )
    unreachable = compute_status(inputs(prefill_cluster=ClusterObservation(problem)))
    assert health(CHECK, cr_with(unreachable)) == {
        "status": "Degraded",
        "message": "PrfaaS cluster: cannot reach the PrfaaS cluster at https://127.0.0.1:1: connection refused",
    }


def test_lua_literals_keep_quotes_backslashes_and_newlines() -> None:
    text = 'a "quoted" \\ back\nslash, ü'
    obj = {
        "metadata": {"generation": 1},
        "status": {
            "observedGeneration": 1,
            "conditions": [{"type": "Degraded", "status": "True", "reason": "X", "message": text}],
        },
    }
    assert health(CHECK, obj) == {"status": "Degraded", "message": text}
