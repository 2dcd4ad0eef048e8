"""The container images, built by scripts/build-images.sh (buildah, no daemon) and checked for real.

The product image (ghcr.io/prfaas/prfaas) must hold the operator and the router and nothing of
the testbed, the fake engine, the simulator or their dependencies; run as UID 65532 on a
read-only root with only /tmp writable; start both entry points and stop on SIGTERM. The
engine-sim image must answer SGLang's command with the fake engine. The filesystem is read
through `buildah mount`; containers run with podman (runc), on the host network, loopback only.

Skipped only where nothing can be built: not root, or neither buildah nor apt-get to install it.
On the CI path (root, Debian) the images are built (once; later runs reuse the cache).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build-images.sh"
BASE = "docker.io/library/python:3.11-slim-bookworm"  # the Dockerfiles' FROM, made locally if absent
BUILD_TIMEOUT_S = 1500  # a cold build: debootstrap (~1 min) and pip through the proxy, on a busy machine
RUN_TIMEOUT_S = 60
FORBIDDEN_IN_PRODUCT = (
    "prfaas_engine_sim",
    "prfaas_testbed",
    "prfaas_sim",
    "sglang",
    "matplotlib",
    "scipy",
    "prometheus_api_client",
)
FORBIDDEN_DISTRIBUTIONS = (
    "prfaas_engine_sim",
    "prfaas_testbed",
    "prfaas_sim",
    "matplotlib",
    "scipy",
    "prometheus_api_client",
    "pytest",
)
OCI_LABELS = ("title", "description", "source", "version", "revision", "licenses")


def _cannot_build() -> str | None:
    if not sys.platform.startswith("linux"):
        return "container images are built on Linux only"
    if os.geteuid() != 0:
        return "building images needs root (scripts/build-images.sh)"
    if shutil.which("buildah") is None and shutil.which("apt-get") is None:
        return "no buildah, and no apt-get to install it"
    return None


pytestmark = [
    pytest.mark.images,
    pytest.mark.timeout(BUILD_TIMEOUT_S + 300),
    pytest.mark.skipif(_cannot_build() is not None, reason=_cannot_build() or ""),
]


@dataclass(frozen=True)
class Images:
    cache: Path
    driver: str
    version: str
    product: str
    engine_sim: str
    pause: str
    build_output: str

    def buildah(self, *args: str, timeout: float = RUN_TIMEOUT_S) -> str:
        return _run(["buildah", "--storage-driver", self.driver, *args], timeout)

    def podman(
        self, *args: str, timeout: float = RUN_TIMEOUT_S, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "CONTAINERS_CONF": str(self.cache / "containers.conf")}
        result = subprocess.run(
            ["podman", "--storage-driver", self.driver, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"podman {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}"
            )
        return result

    def config(self, image: str) -> dict[str, Any]:
        """The image's OCI config (config, rootfs, history)."""
        inspected = json.loads(self.buildah("inspect", "--type", "image", image))
        config: dict[str, Any] = inspected["OCIv1"]
        return config

    def run(self, image: str, *command: str, options: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
        """`podman run` as the product runs in its pods: UID 65532, read-only root, /tmp only."""
        return self.podman("run", "--rm", *LOCKED_DOWN, "--network", "none", *options, image, *command)


LOCKED_DOWN = (
    "--read-only",
    "--read-only-tmpfs=false",
    "--tmpfs",
    "/tmp:rw,size=64m",
    "--user",
    "65532:65532",
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
)


def _run(argv: list[str], timeout: float) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result.stdout


def _chart_app_version() -> str:
    text = (REPO / "charts" / "prfaas-operator" / "Chart.yaml").read_text()
    match = re.search(r'^appVersion:\s*"?([^"\s]+)"?\s*$', text, re.MULTILINE)
    assert match, "no appVersion in the chart"
    return match.group(1)


@pytest.fixture(scope="module")
def images() -> Images:
    """Builds (or reuses) the images with the project's script; fails, never skips, when it cannot."""
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"scripts/build-images.sh failed ({result.returncode}):\n{result.stderr[-4000:]}")
    cache = Path(result.stdout.strip().splitlines()[-1])
    listed: dict[str, str] = {}  # image -> its OCI archive
    for line in (cache / "images.txt").read_text().splitlines():
        archive, image = line.split(" ", 1)
        listed[image] = archive
    version = _chart_app_version()
    images = Images(
        cache=cache,
        driver=(cache / "storage-driver").read_text().strip(),
        version=version,
        product=f"ghcr.io/prfaas/prfaas:{version}",
        engine_sim=f"ghcr.io/prfaas/prfaas-engine-sim:{version}",
        pause="localhost/prfaas-testbed/pause:3.10",
        build_output=result.stderr,
    )
    for image in (images.product, images.engine_sim, images.pause):
        assert image in listed, f"{image} not in {cache}/images.txt"
        assert Path(listed[image]).is_file(), f"no archive {listed[image]}"
    return images


@pytest.fixture(scope="module")
def product_root(images: Images) -> Iterator[Path]:
    """The product image's filesystem, mounted read-only through a working container."""
    container = images.buildah("from", "--pull-never", images.product).strip()
    try:
        yield Path(images.buildah("mount", container).strip())
    finally:
        images.buildah("rm", container)


def _site_packages(root: Path) -> Path:
    (found,) = (root / "opt" / "venv" / "lib").glob("python3*/site-packages")
    return found


def test_the_product_image_holds_no_testbed_fake_engine_or_simulator(product_root: Path) -> None:
    site = _site_packages(product_root)
    present = {p.name for p in site.iterdir()}
    for package in ("prfaas_core", "prfaas_operator", "prfaas_router"):
        assert package in present, f"{package} missing from the product image"
    assert not [name for name in FORBIDDEN_IN_PRODUCT if name in present]
    distributions = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    assert not [name for name in FORBIDDEN_DISTRIBUTIONS if name in distributions], sorted(distributions)
    strays = [
        str(path.relative_to(product_root))
        for pattern in ("prfaas_engine_sim*", "launch_server*", "prfaas_testbed*", "prfaas_sim*")
        for path in (product_root / "opt").rglob(pattern)
    ]
    assert strays == []


def test_the_product_image_holds_exactly_the_locked_dependencies(product_root: Path) -> None:
    """The dependency layer is locks/product.txt, version for version, and nothing else but prfaas."""
    locked = dict(
        re.findall(r"^([a-z0-9-]+)==(\S+)", (REPO / "locks" / "product.txt").read_text(), re.MULTILINE)
    )
    installed = dict(
        (re.sub(r"[-_.]+", "-", name).lower(), version)
        for name, version in (
            p.name.removesuffix(".dist-info").split("-")
            for p in _site_packages(product_root).glob("*.dist-info")
        )
    )
    assert installed.pop("prfaas") == _chart_app_version()
    assert installed == locked


def test_the_product_image_config_runs_non_root_with_labels(images: Images, product_root: Path) -> None:
    config = images.config(images.product)
    runtime = config["config"]
    assert runtime["User"] == "65532:65532"
    assert runtime.get("Entrypoint") in (None, [])
    assert runtime["Cmd"] == ["python", "-m", "prfaas_operator"]  # the chart's command; a pod sets its own
    env = dict(item.split("=", 1) for item in runtime["Env"])
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and env["PATH"].startswith("/opt/venv/bin:")
    labels = runtime["Labels"]
    for key in OCI_LABELS:
        assert labels.get(f"org.opencontainers.image.{key}"), f"label {key} missing: {labels}"
    assert labels["org.opencontainers.image.title"] == "prfaas"
    assert labels["org.opencontainers.image.version"] == images.version
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", labels["org.opencontainers.image.revision"])
    # nothing the build mounted (the host's pip.conf and CA bundle) stays in the image
    assert not (product_root / "etc" / "pip.conf").exists()
    base = images.buildah("from", "--pull-never", BASE).strip()
    try:
        base_root = Path(images.buildah("mount", base).strip())
        bundle = Path("etc/ssl/certs/ca-certificates.crt")
        assert (product_root / bundle).read_bytes() == (base_root / bundle).read_bytes()
    finally:
        images.buildah("rm", base)
    assert "nonroot:x:65532:65532:" in (product_root / "etc" / "passwd").read_text()


def test_the_product_entry_points_run_as_non_root_on_a_read_only_root(images: Images) -> None:
    for command in (["python", "-m", "prfaas_operator", "--help"], ["prfaas-router", "--help"]):
        result = images.run(images.product, *command)
        assert result.stdout.startswith("usage:"), result.stdout
    probe = """
import getpass, importlib, importlib.util, json, os, pkgutil, sys
import prfaas_core, prfaas_operator, prfaas_router
modules = [m.name for p in (prfaas_core, prfaas_operator, prfaas_router)
           for m in pkgutil.walk_packages(p.__path__, p.__name__ + ".") if m.name != "prfaas_operator.__main__"]
for name in modules:
    importlib.import_module(name)
try:
    open("/opt/venv/probe", "w")
    root_writable = True
except OSError:
    root_writable = False
open("/tmp/probe", "w").write("ok")
print(json.dumps({
    "uid": os.getuid(), "user": getpass.getuser(), "root_writable": root_writable,
    "no_bytecode_written": sys.flags.dont_write_bytecode, "modules": len(modules),
    "without_bytecode": [m.__name__ for m in list(sys.modules.values())
                         if getattr(m, "__file__", None) and m.__file__.endswith(".py")
                         and not os.path.exists(importlib.util.cache_from_source(m.__file__))],
}))
"""
    seen = json.loads(images.run(images.product, "python", "-c", probe).stdout)
    assert seen["uid"] == 65532 and seen["user"] == "nonroot"
    assert seen["root_writable"] is False and seen["no_bytecode_written"] == 1
    assert seen["modules"] > 20
    assert seen["without_bytecode"] == []  # every module imported was compiled at build time


def _http_get(url: str) -> tuple[int, str] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""
    except (urllib.error.URLError, OSError):
        return None


def _http_post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


@pytest.fixture
def container_name(images: Images) -> Iterator[str]:
    name = f"prfaas-test-{os.getpid()}-{time.monotonic_ns()}"
    yield name
    images.podman("rm", "--force", "--time", "0", name, check=False)


def _stop(images: Images, name: str) -> tuple[int, float]:
    """SIGTERM (podman stop, 20 s before SIGKILL): the exit code and how long the stop took."""
    started = time.monotonic()
    images.podman("stop", "--time", "20", name)
    took = time.monotonic() - started
    code = int(images.podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip())
    return code, took


def _logs(images: Images, name: str) -> str:
    result = images.podman("logs", name, check=False)
    return (result.stdout + result.stderr)[-3000:]


ROUTER_CONFIG = {
    "schema": "prfaas.io/router-config/v1",
    "version": 1,
    "served_model_name": "m",
    "threshold_tokens": 8192,
    "link": {"bandwidth_bytes_per_second": 12.5e9},
    "kv_size": {"bytes_per_token": 17000.0},
    "prefill_time": {
        "prfaas": {"c0": 0.389, "c1": 4.107e-5, "c2": 9.476e-11},
        "local": {"c0": 0.570, "c1": 1.170e-4, "c2": 6.347e-10},
    },
    "slo": {"ttft_seconds": 30.0, "tpot_seconds": 0.05},
}


def test_the_router_serves_from_its_image_and_stops_on_sigterm(
    images: Images, container_name: str, tmp_path: Path
) -> None:
    config_dir = tmp_path / "router-config"  # as the operator's ConfigMap volume: read-only
    config_dir.mkdir(mode=0o755)
    (config_dir / "config.json").write_text(json.dumps(ROUTER_CONFIG))
    (config_dir / "config.json").chmod(0o644)
    port = free_port()
    images.podman(
        "run",
        "--detach",
        "--name",
        container_name,
        *LOCKED_DOWN,
        "--network",
        "host",
        "--volume",
        f"{config_dir}:/etc/prfaas/router:ro",
        images.product,
        "prfaas-router",
        "--config",
        "/etc/prfaas/router/config.json",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    )
    eventually(
        lambda: (_http_get(f"http://127.0.0.1:{port}/liveness") or (0, ""))[0] == 200,
        timeout=60,
        interval=0.25,
        what="the router's /liveness",
        seen=lambda: _logs(images, container_name),
    )
    status, metrics = _http_get(f"http://127.0.0.1:{port}/metrics") or (0, "")
    assert status == 200 and "prfaas_router_" in metrics
    code, took = _stop(images, container_name)
    assert code == 0, _logs(images, container_name)
    assert took < 15, f"the router took {took:.1f} s to stop on SIGTERM"


def test_the_operator_starts_from_its_image_and_stops_on_sigterm(
    images: Images, container_name: str, tmp_path: Path
) -> None:
    """Without a reachable cluster: it serves its metrics, keeps retrying, and stops on SIGTERM."""
    kube = tmp_path / "kube"
    kube.mkdir(mode=0o755)
    dead = free_port()
    (kube / "config").write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "x",
                "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{dead}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    (kube / "config").chmod(0o644)
    metrics = free_port()
    images.podman(
        "run",
        "--detach",
        "--name",
        container_name,
        *LOCKED_DOWN,
        "--network",
        "host",
        "--volume",
        f"{kube}:/kube:ro",
        "--env",
        "KUBECONFIG=/kube/config",
        images.product,
        "python",
        "-m",
        "prfaas_operator",
        "--bind-address",
        "127.0.0.1",
        "--metrics-port",
        str(metrics),
        "--liveness-port",
        str(free_port()),
    )
    status_body = eventually(
        lambda: _http_get(f"http://127.0.0.1:{metrics}/metrics"),
        timeout=60,
        interval=0.25,
        what="the operator's /metrics",
        seen=lambda: _logs(images, container_name),
    )
    assert status_body[0] == 200
    # /metrics answers before kopf's first login: wait for that login to fail and be retried
    eventually(
        lambda: "cannot reach the PD cluster" in _logs(images, container_name),
        timeout=60,
        interval=0.25,
        what="the operator's log to say the PD cluster is unreachable",
        seen=lambda: _logs(images, container_name),
    )
    assert images.podman("inspect", "--format", "{{.State.Running}}", container_name).stdout.strip() == "true"
    code, took = _stop(images, container_name)
    assert code == 0, _logs(images, container_name)
    assert took < 15, f"the operator took {took:.1f} s to stop on SIGTERM"


def test_the_engine_sim_image_answers_sglangs_command(images: Images, container_name: str) -> None:
    help_text = images.run(images.engine_sim, "python3", "-m", "sglang.launch_server", "--help").stdout
    assert "fake SGLang engine" in help_text
    port = free_port()
    # the arguments the operator writes for a decode engine (manifests.sglang_args), host aside
    images.podman(
        "run",
        "--detach",
        "--name",
        container_name,
        *LOCKED_DOWN,
        "--network",
        "host",
        "--env",
        "PRFAAS_FAKE_ENGINE_PROFILE=h200",
        "--env",
        "PRFAAS_FAKE_ENGINE_TIME_SCALE=0",
        "--env",
        "PRFAAS_FAKE_ENGINE_KV_SCALE=0.5",
        "--env",
        "PRFAAS_FAKE_ENGINE_MODEL_LOAD_SECONDS=2",
        # h200 times prefill only: a null (prefill and decode) engine needs decode settings
        "--env",
        "PRFAAS_FAKE_ENGINE_ARGS=--max-decode-batch 7 --decode-step-seconds 0.01",
        images.engine_sim,
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "moonshotai/Kimi-Linear-48B-A3B-Instruct",
        "--revision",
        "main",
        "--served-model-name",
        "kimi-linear",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tp-size",
        "8",
        "--disaggregation-mode",
        "null",
        "--page-size",
        "1",
        "--kv-cache-dtype",
        "auto",
        "--enable-metrics",
        "--kv-scale",
        "0.25",
    )
    eventually(
        lambda: (_http_get(f"http://127.0.0.1:{port}/health") or (0, ""))[0] == 200,
        timeout=60,
        interval=0.25,
        what="the fake engine's /health",
        seen=lambda: _logs(images, container_name),
    )
    status, info_text = _http_get(f"http://127.0.0.1:{port}/get_server_info") or (0, "{}")
    info = json.loads(info_text)
    assert status == 200 and info["served_model_name"] == "kimi-linear" and info["tp_size"] == 8
    assert info["max_running_requests"] == 7
    fake = info["fake_engine"]
    assert fake["profile"] == "h200" and fake["time_scale"] == 0  # from the environment
    assert fake["kv_scale"] == 0.25  # an argument wins over the environment
    assert fake["model_load_seconds"] == 2
    assert "PRFAAS_FAKE_ENGINE_MODEL_LOAD_SECONDS=30" in images.config(images.engine_sim)["config"]["Env"]
    answer = _http_post(
        f"http://127.0.0.1:{port}/generate",
        {"text": "hello " * 50, "sampling_params": {"max_new_tokens": 4}},
    )
    assert answer["meta_info"]["completion_tokens"] == 4, answer
    code, took = _stop(images, container_name)
    assert code == 0, _logs(images, container_name)
    assert took < 15


def test_the_engine_sim_image_shares_every_layer_of_the_product(images: Images) -> None:
    product = images.config(images.product)["rootfs"]["diff_ids"]
    engine_sim = images.config(images.engine_sim)["rootfs"]["diff_ids"]
    assert engine_sim[: len(product)] == product
    assert len(engine_sim) == len(product) + 1  # the fake engine's packages, one layer
    assert images.config(images.engine_sim)["config"]["User"] == "65532:65532"


def test_the_pause_image_waits_for_sigterm(images: Images, container_name: str) -> None:
    config = images.config(images.pause)
    assert config["config"]["Entrypoint"] == ["/pause"]
    assert len(config["rootfs"]["diff_ids"]) == 1  # FROM scratch: the static binary only
    images.podman("run", "--detach", "--name", container_name, "--network", "none", images.pause)
    assert images.podman("inspect", "--format", "{{.State.Running}}", container_name).stdout.strip() == "true"
    code, took = _stop(images, container_name)
    assert code == 0 and took < 10


def test_a_second_build_reuses_every_image(images: Images) -> None:
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=300, check=False
    )
    took = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    for image in (images.product, images.engine_sim, images.pause):
        assert f"{image}: up to date" in result.stderr, result.stderr
    assert "building" not in result.stderr
    assert took < 60, f"a warm build took {took:.0f} s"
    assert result.stdout.strip().splitlines()[-1] == str(images.cache)
