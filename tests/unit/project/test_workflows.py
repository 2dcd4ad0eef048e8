"""The GitHub Actions workflows: actionlint finds nothing, and the release does what docs/release.md says.

They run only on GitHub's hosted runners; here they are linted by the pinned actionlint that
scripts/build-tools.sh builds from the Go module proxy (this test builds it when it is missing),
with shellcheck checking their `run:` scripts when it is installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from prfaas_operator import crd

ROOT = crd.repository_root()
WORKFLOWS = ROOT / ".github/workflows"
CHART = ROOT / "charts/prfaas-operator"
DOCKERFILES = {"prfaas": "images/prfaas/Dockerfile", "prfaas-engine-sim": "images/engine-sim/Dockerfile"}


@pytest.fixture(scope="module")
def actionlint() -> Path:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts/build-tools.sh")],
        env={**os.environ, "PRFAAS_SKIP_APT": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"scripts/build-tools.sh failed:\n{done.stderr}"
    binary = Path(done.stdout.strip().splitlines()[-1]) / "actionlint"
    assert binary.is_file(), binary
    return binary


def load(name: str) -> dict[Any, Any]:
    document: dict[Any, Any] = yaml.safe_load((WORKFLOWS / name).read_text())
    return document


def triggers(workflow: dict[Any, Any]) -> dict[str, Any]:
    on: dict[str, Any] = workflow[True]  # YAML 1.1 reads the key `on` as the boolean true
    return on


def steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = job.get("steps", [])
    return found


def test_actionlint_finds_nothing(actionlint: Path) -> None:
    files = sorted(str(path) for path in WORKFLOWS.glob("*.y*ml"))
    assert files, "no workflows"
    done = subprocess.run(
        [str(actionlint), "-no-color", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_action_is_pinned_to_a_version() -> None:
    for path in WORKFLOWS.glob("*.y*ml"):
        for name, job in load(path.name)["jobs"].items():
            uses = [job["uses"]] if "uses" in job else [step["uses"] for step in steps(job) if "uses" in step]
            for action in uses:
                if action.startswith("./"):
                    continue  # a workflow of this repository
                assert re.search(r"@(v\d+(\.\d+)*|[0-9a-f]{40})$", action), f"{path.name} {name}: {action}"


def test_ci_runs_the_project_test_command() -> None:
    ci = load("ci.yaml")
    assert {"push", "pull_request", "workflow_call"} <= set(triggers(ci))
    assert ci["permissions"] == {"contents": "read"}
    (job,) = ci["jobs"].values()
    assert any("bash .ci/run" in step.get("run", "") for step in steps(job))
    assert job["timeout-minutes"] <= 90


def test_release_publishes_tested_multi_arch_images_and_the_chart_on_a_version_tag() -> None:
    release = load("release.yaml")
    assert triggers(release) == {"push": {"tags": ["v*"]}}
    assert release["permissions"] == {"contents": "read"}  # each job asks for what it needs
    jobs = release["jobs"]
    assert jobs["test"]["uses"] == "./.github/workflows/ci.yaml"
    assert release["env"]["PLATFORMS"] == "linux/amd64,linux/arm64"
    built = {}
    for name, job in jobs.items():
        for step in steps(job):
            if step.get("uses", "").startswith("docker/build-push-action@"):
                built[job["env"]["IMAGE"].rsplit("/", 1)[1]] = (name, step["with"])
    assert set(built) == set(DOCKERFILES)
    for image, (name, options) in built.items():
        assert options["file"] == DOCKERFILES[image] and options["context"] == "."
        assert options["push"] is True and options["platforms"] == "${{ env.PLATFORMS }}"
        assert "VERSION=${{ env.VERSION }}" in options["build-args"]
        assert "REVISION=${{ github.sha }}" in options["build-args"]
        assert {"test", "version"} <= set(jobs[name]["needs"]) or "product-image" in jobs[name]["needs"]
        assert jobs[name]["permissions"]["packages"] == "write"
    # the engine simulator is built FROM this release's product image
    assert "PRFAAS_IMAGE=${{ env.PRODUCT }}" in built["prfaas-engine-sim"][1]["build-args"]
    chart = jobs["chart"]
    assert {"product-image", "engine-sim-image"} <= set(chart["needs"])
    script = "\n".join(step.get("run", "") for step in steps(chart))
    assert 'helm push "dist/prfaas-operator-$VERSION.tgz" "oci://$CHARTS"' in script
    assert chart["env"]["CHARTS"] == "ghcr.io/${{ needs.version.outputs.namespace }}/charts"
    # nothing but the publishing jobs may write packages
    for name, job in jobs.items():
        if name not in {"product-image", "engine-sim-image", "chart"}:
            assert "packages" not in job.get("permissions", {}), name


def test_release_checks_the_tag_against_the_chart() -> None:
    (step,) = [s for s in steps(load("release.yaml")["jobs"]["version"]) if s.get("id") == "version"]
    script = step["run"]
    assert 'version="${TAG#v}"' in script
    assert '"$chart_version" != "$version"' in script and '"$app_version" != "$version"' in script


def test_the_dockerfiles_the_release_builds_exist() -> None:
    if not (ROOT / "images").is_dir():
        pytest.skip("images/ is not in this checkout yet")
    for dockerfile in DOCKERFILES.values():
        assert (ROOT / dockerfile).is_file(), dockerfile


def test_one_version_everywhere() -> None:
    """A release tag vX.Y.Z must match the chart, its appVersion (the image tag), every Python
    distribution of the repository, and the images the defaults name."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = chart["appVersion"]
    assert chart["version"] == version
    for pyproject in sorted([*ROOT.glob("pyproject.toml"), *ROOT.glob("*/pyproject.toml")]):
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        if "version" in project:
            assert project["version"] == version, pyproject.relative_to(ROOT)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"] == {"repository": "ghcr.io/prfaas/prfaas", "tag": "", "pullPolicy": "IfNotPresent"}
    sample = yaml.safe_load((ROOT / "examples/prfaasdeployment.yaml").read_text())
    assert sample["spec"]["router"]["image"] == f"ghcr.io/prfaas/prfaas:{version}"
