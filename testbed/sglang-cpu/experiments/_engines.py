"""Start real SGLang 0.5.23 servers on CPU for an experiment, send PD requests, read metrics.

Standard library only, for the real engine's venv python. Each server runs in its own process
group on a loopback address with `SGLANG_HOST_IP` set to it (Mooncake advertises that address),
and `servers()` kills every group when its block ends. Run an experiment under the machine's
engine lock: `flock /tmp/real-engines.lock ~/.cache/prfaas/sglang-cpu/bin/python <script>`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VENV = Path(os.environ.get("PRFAAS_SGLANG_CPU_VENV") or Path.home() / ".cache" / "prfaas" / "sglang-cpu")
PYTHON = VENV / "bin" / "python"
MODEL = VENV / "models" / "tiny-gpt2"
PORT = 30000
BOOTSTRAP_PORT = 8998
PAGE = 16
KV_BYTES_PER_TOKEN = 512
"""tiny-gpt2: 2 layers x (K + V) x 64 x float16."""


def cpu_args() -> list[str]:
    """The CPU workarounds' engine arguments (prfaas_sglang_cpu/workarounds.py)."""
    out = subprocess.run(
        [str(PYTHON), "-m", "prfaas_sglang_cpu", "args"], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def base_args(host: str, mode: str) -> list[str]:
    """What the operator writes for an engine pod (prfaas_operator/planning/manifests.py), at `host`."""
    args = [
        "--model-path",
        str(MODEL),
        "--served-model-name",
        "tiny-gpt2",
        "--host",
        host,
        "--port",
        str(PORT),
        "--tp-size",
        "1",
        "--page-size",
        str(PAGE),
        "--kv-cache-dtype",
        "auto",
        "--enable-metrics",
        *cpu_args(),
    ]
    if mode != "null":
        args += [
            "--disaggregation-mode", mode,
            "--disaggregation-transfer-backend", "mooncake_tcp",
            "--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT),
        ]  # fmt: skip
    return args


@dataclass
class Server:
    name: str
    host: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{PORT}"

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def start(name: str, host: str, args: list[str], logs: Path, env: dict[str, str] | None = None) -> Server:
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    # SGLANG_HOST_IP: what the PD transfer's Mooncake advertises; MOONCAKE_LOCAL_HOSTNAME: what a
    # Mooncake Store client (HiCache's mooncake backend) registers as (default "localhost")
    environment = {
        **os.environ,
        "SGLANG_HOST_IP": host,
        "MOONCAKE_LOCAL_HOSTNAME": host,
        "MC_FORCE_TCP": "1",
        **(env or {}),
    }
    with log.open("wb") as out:
        popen = subprocess.Popen(
            [str(PYTHON), "-m", "sglang.launch_server", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
        )
    return Server(name, host, popen, log)


def stop(server: Server) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.popen.pid, signal.SIGTERM)
    try:
        server.popen.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.popen.pid, signal.SIGKILL)
        server.popen.wait(10)


def wait_ready(servers: list[Server], seconds: float = 420) -> float:
    t0 = time.monotonic()
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.popen.poll() is not None:
                raise RuntimeError(f"{server.name} exited ({server.popen.returncode}):\n{server.tail()}")
            try:
                if http("GET", server.url + "/health_generate", timeout=5)[0] == 200:
                    pending.remove(server)
            except OSError:
                pass
        if time.monotonic() - t0 > seconds:
            raise RuntimeError(f"not ready after {seconds} s: {[s.name for s in pending]}")
        time.sleep(1)
    return time.monotonic() - t0


@contextlib.contextmanager
def servers(
    specs: list[tuple[str, str, list[str]]], logs: Path, env: dict[str, str] | None = None
) -> Iterator[list[Server]]:
    """(name, host, args) each; every server is killed (its process group) when the block ends."""
    started: list[Server] = []
    try:
        for name, host, args in specs:
            started.append(start(name, host, args, logs, env))
        took = wait_ready(started)
        print(f"# {len(started)} servers ready in {took:.0f} s; logs in {logs}", flush=True)
        yield started
    finally:
        for server in started:
            stop(server)


def http(method: str, url: str, body: Any = None, timeout: float = 300) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            raw = reply.read()
            status = reply.status
    except urllib.error.HTTPError as error:
        raw, status = error.read(), error.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def generate(url: str, ids: list[int], new_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}, **extra}
    status, answer = http("POST", url + "/generate", body)
    assert status == 200, (status, answer)
    return answer


def pd_generate(
    prefill: Server, decode: Server, ids: list[int], new_tokens: int = 8
) -> tuple[dict, dict, float]:
    """One PD request sent as the router does: both legs at once with the same bootstrap room.
    Returns (prefill's answer, decode's answer, seconds)."""
    pd = {
        "bootstrap_host": prefill.host,
        "bootstrap_port": BOOTSTRAP_PORT,
        "bootstrap_room": random.getrandbits(63),
    }
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        legs = [pool.submit(generate, s.url, ids, new_tokens, **pd) for s in (prefill, decode)]
        answers = [leg.result() for leg in legs]
    return answers[0], answers[1], time.monotonic() - t0


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metrics(server: Server) -> dict[str, float]:
    """Every `sglang:` sample, keyed by name and the labels that matter here (those not naming
    the engine), e.g. `sglang:cached_tokens_total{cache_source="device"}`."""
    status, text = http("GET", server.url + "/metrics")
    assert status == 200, text
    samples: dict[str, float] = {}
    for line in str(text).splitlines():
        match = _SAMPLE.match(line)
        if not match or not match.group(1).startswith("sglang:"):
            continue
        labels = re.findall(r'(\w+)="([^"]*)"', match.group(2) or "")
        kept = ",".join(f'{k}="{v}"' for k, v in labels if k in ("cache_source", "mode", "le") and k != "le")
        key = match.group(1) + ("{" + kept + "}" if kept else "")
        if any(k == "le" for k, _ in labels):
            continue
        samples[key] = samples.get(key, 0.0) + float(match.group(3))
    return samples


WATCHED = (
    "sglang:num_requests_total",
    "sglang:prompt_tokens_total",
    "sglang:cached_tokens_total",
    "sglang:realtime_tokens_total",
    "sglang:kv_transfer_total_mb_sum",
    "sglang:kv_transfer_total_mb_count",
)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The watched counters that moved."""
    moved = {}
    for key in sorted(set(before) | set(after)):
        if key.split("{")[0] in WATCHED:
            change = after.get(key, 0.0) - before.get(key, 0.0)
            if change:
                moved[key] = round(change, 4)
    return moved


def settle(servers_: list[Server], seconds: float = 6.0) -> None:
    """Metrics are counted when a request ends and realtime tokens on a log interval: wait."""
    time.sleep(seconds)


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(count)]


def main_guard() -> None:
    if not PYTHON.exists():
        sys.exit(f"no real SGLang venv at {VENV}: run scripts/setup-sglang-cpu.sh")
