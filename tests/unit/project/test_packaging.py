"""The four distributions of the repository, and what each may depend on.

`prfaas` (pyproject.toml: core, operator, router) is the product the image installs; the fake
engine (engine-sim/pyproject.toml), the testbed (testbed/pyproject.toml, which runs the fake engine)
and the simulator (sim/pyproject.toml) are distributions of their own. Every third-party module a distribution's code imports must come
from a dependency it declares (the product: its own list; the others: theirs or the product's
they pin), and every product dependency must be used by product code at runtime.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
PRODUCT_DIRS = ("core", "operator", "router")
FIRST_PARTY = (
    "prfaas_core",
    "prfaas_operator",
    "prfaas_router",
    "prfaas_engine_sim",
    "prfaas_testbed",
    "prfaas_sim",
    "prfaas_sglang_cpu",
    "sglang",
)
SGLANG_CPU = REPO / "testbed" / "sglang-cpu"
"""Not a distribution: copied into the real engine's venv (scripts/setup-sglang-cpu.sh), whose
requirements are its own (requirements.in, locked in locks/sglang-cpu.txt)."""
USED_WITHOUT_IMPORT = {"h2": "HTTP/2 to the API servers: kube.py looks it up with find_spec"}
COMES_WITH = {"pydantic-core": "pydantic", "lightkube-models": "lightkube"}
"""Imported directly, but versioned by the dependency that pins it (pydantic pins pydantic-core exactly)."""
NOT_IN_PRODUCT = ("matplotlib", "scipy", "prometheus-api-client", "requests", "pytest")


def project(path: str) -> dict[str, Any]:
    with (REPO / path).open("rb") as file:
        data: dict[str, Any] = tomllib.load(file)["project"]
        return data


DISTRIBUTION_OF = {"mooncake": "mooncake-transfer-engine-non-cuda"}
"""Imported names whose distribution is named otherwise."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    return {canonical(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in requirements}


def imported_distributions(directories: list[Path]) -> dict[str, set[str]]:
    """Third-party distribution -> the files importing it, for every .py under the directories.

    A top-level name several distributions install (lightkube and lightkube-models) counts for each.
    """
    providers = packages_distributions()
    found: dict[str, set[str]] = {}
    for directory in directories:
        for source in directory.rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text(), str(source))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in FIRST_PARTY:
                        continue
                    for distribution in providers.get(top, [top]):
                        found.setdefault(canonical(distribution), set()).add(str(source.relative_to(REPO)))
    return found


PRODUCT = project("pyproject.toml")
ENGINE_SIM = project("engine-sim/pyproject.toml")
TESTBED = project("testbed/pyproject.toml")
SIM = project("sim/pyproject.toml")


def test_the_four_distributions_share_one_version_with_the_chart() -> None:
    chart = (REPO / "charts" / "prfaas-operator" / "Chart.yaml").read_text()
    (app_version,) = re.findall(r'^appVersion:\s*"?([^"\s]+)"?', chart, re.MULTILINE)
    assert PRODUCT["version"] == ENGINE_SIM["version"] == TESTBED["version"] == SIM["version"] == app_version
    for other in (ENGINE_SIM, TESTBED, SIM):
        assert f"prfaas=={PRODUCT['version']}" in other["dependencies"]
    assert f"prfaas-engine-sim=={PRODUCT['version']}" in TESTBED["dependencies"]


def test_the_product_declares_what_it_imports_and_nothing_else() -> None:
    declared = requirement_names(PRODUCT["dependencies"])
    imported = imported_distributions([REPO / d for d in PRODUCT_DIRS])
    undeclared = {
        name: sorted(files) for name, files in imported.items() if COMES_WITH.get(name, name) not in declared
    }
    assert undeclared == {}
    unused = declared - set(imported) - set(USED_WITHOUT_IMPORT)
    assert unused == set(), "a product dependency no product module imports"
    assert not declared & {canonical(n) for n in NOT_IN_PRODUCT}


@pytest.mark.parametrize(
    ("meta", "directory"), [(ENGINE_SIM, "engine-sim"), (TESTBED, "testbed"), (SIM, "sim")]
)
def test_the_fake_engine_the_testbed_and_the_simulator_declare_what_they_import(
    meta: dict[str, Any], directory: str
) -> None:
    declared = requirement_names(meta["dependencies"]) | requirement_names(PRODUCT["dependencies"])
    imported = imported_distributions(
        [p for p in (REPO / directory).iterdir() if p.is_dir() and p != SGLANG_CPU]
    )
    undeclared = {
        name: sorted(files) for name, files in imported.items() if COMES_WITH.get(name, name) not in declared
    }
    assert undeclared == {}


def test_the_real_engines_workarounds_import_only_what_their_venv_installs() -> None:
    lines = (SGLANG_CPU / "requirements.in").read_text().splitlines()
    declared = requirement_names([line for line in lines if line and not line.startswith("#")])
    found: set[str] = set()
    sources = list(SGLANG_CPU.rglob("*.py"))
    local = {source.stem for source in sources}  # a script's sibling modules (experiments/)
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    third_party = {
        canonical(DISTRIBUTION_OF.get(n, n))
        for n in found
        if n not in sys.stdlib_module_names and n not in {*FIRST_PARTY, *local}
    }
    assert third_party and third_party <= declared, third_party - declared


def test_the_product_ships_no_testbed_or_simulator_package() -> None:
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert sorted(find["where"]) == sorted(PRODUCT_DIRS)
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"prfaas", "prfaas-router", "prfaas-router-drain"}
    assert ENGINE_SIM["scripts"] == {"prfaas-engine-sim": "prfaas_engine_sim.cli:main"}
    assert "scripts" not in TESTBED
    assert SIM["scripts"] == {"prfaas-sim": "prfaas_sim.cli:main"}
