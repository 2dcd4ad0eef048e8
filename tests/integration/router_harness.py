"""The router and fake SGLang engines as real processes on loopback, for the integration tests.

PrfaaS cluster on 127.0.1.x (H200 profile), local PD cluster on 127.0.2.x (H20 profile); every
engine and router is a real process started with its own CLI, time-scaled to milliseconds.
The fixtures that use these live in conftest.py.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from support.sse import sse_events

MODEL = "kimi-fake"
THRESHOLD = 1000  # tokens; text counts 4 characters per token
SHORT = "hello " * 50  # 75 tokens
LONG = "".join(f"w{i:05d} " for i in range(800))  # 5600 characters = 1400 tokens
TIME_SCALE = "0.01"


def fresh_long(tag: str) -> str:
    """A long prompt no cluster has seen: it differs from LONG in its first block."""
    return f"[{tag}] {LONG}"


def http_get(url: str, path: str, timeout: float = 1.0) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@dataclass
class Process:
    args: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    """Added to this process's environment."""
    program: str = sys.executable
    inherit_env: bool = True
    """False: `env` is the whole environment (an engine pod's, as the testbed's kubelet builds it)."""
    own_group: bool = False
    """Its own process group, signalled whole (real SGLang runs its scheduler in child processes)."""

    def start(self) -> Process:
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                [self.program, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env} if self.inherit_env else dict(self.env),
                start_new_session=self.own_group,
            )
        return self

    def signal(self, number: int) -> None:
        assert self.popen is not None
        if self.own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, number)
        else:
            self.popen.send_signal(number)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.popen is not None
        self.popen.wait(5)

    def stop(self) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        if self.own_group:
            self.signal(signal.SIGKILL)  # children the leader left behind

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


@dataclass
class Engine:
    name: str
    url: str
    bootstrap_port: int | None
    process: Process

    def endpoint(self) -> dict[str, Any]:
        body: dict[str, Any] = {"name": self.name, "url": self.url}
        if self.bootstrap_port is not None:
            body["bootstrap_port"] = self.bootstrap_port
        return body


def start_engine(
    name: str,
    mode: str,
    host: str,
    profile: str,
    logs: Path,
    *extra: str,
    time_scale: str = TIME_SCALE,
    env: Mapping[str, str] | None = None,
) -> Engine:
    """A fake SGLang engine process; `extra` are more of its flags, `env` more of its environment."""
    port = free_port(host)
    bootstrap = free_port(host) if mode == "prefill" else None
    args = ["-m", "prfaas_engine_sim", "--mode", mode, "--host", host, "--port", str(port)]
    args += ["--profile", profile, "--time-scale", time_scale, "--served-model-name", MODEL, *extra]
    if bootstrap is not None:
        args += ["--bootstrap-port", str(bootstrap)]
    process = Process(args, logs / f"{name}.log", env=env or {}).start()
    return Engine(name, f"http://{host}:{port}", bootstrap, process)


def wait_healthy(engine: Engine) -> None:
    """Until the engine is ready: SGLang's /ready answers at once (its /health takes a second)."""
    eventually(
        lambda: http_get(engine.url, "/ready")[0] == 200,
        timeout=30.0,
        interval=0.05,
        what=f"engine {engine.name}\n{engine.process.log()}",
    )


@dataclass
class Cluster:
    prfaas: list[Engine]
    local: list[Engine]
    decode: list[Engine]


@contextlib.contextmanager
def healthy_cluster(logs: Path, *extra: str) -> Iterator[Cluster]:
    """One PrfaaS prefill, one local prefill and one decode, healthy until the block ends."""
    with running(
        Cluster(
            prfaas=[start_engine("p0", "prefill", "127.0.1.1", "h200", logs, *extra)],
            local=[start_engine("l0", "prefill", "127.0.2.1", "h20", logs, *extra)],
            decode=[start_engine("d0", "decode", "127.0.2.11", "h20", logs, *extra)],
        )
    ) as engines:
        yield engines


@contextlib.contextmanager
def running(engines: Cluster) -> Iterator[Cluster]:
    """Started engines, once healthy, until the block ends; stopped then."""
    everyone = [*engines.prfaas, *engines.local, *engines.decode]
    try:
        for engine in everyone:
            wait_healthy(engine)
        yield engines
    finally:
        for engine in everyone:
            engine.process.stop()


def config_doc(
    prfaas: Sequence[Engine],
    local: Sequence[Engine],
    decode: Sequence[Engine | dict[str, Any]],
    **overrides: Any,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema": "prfaas.io/router-config/v1",
        "version": 1,
        "served_model_name": MODEL,
        "threshold_tokens": THRESHOLD,
        "block_size_tokens": 64,
        "chars_per_token": 4.0,
        "link": {"bandwidth_bytes_per_second": 1.25e9, "headroom": 0.8, "latency_seconds": 0.001},
        "kv_size": {"bytes_per_token": 17143.0, "fixed_bytes": 1.8e8},  # the case study's S_kv(l)
        "prefill_time": {
            "prfaas": {"c0": 0.389, "c1": 4.107e-5, "c2": 9.476e-11},
            "local": {"c0": 0.570, "c1": 1.170e-4, "c2": 6.347e-10},
        },
        "slo": {"ttft_seconds": 1000.0, "tpot_seconds": 0.05},
        "pools": {
            "prfaas_prefill": [e.endpoint() for e in prfaas],
            "local_prefill": [e.endpoint() for e in local],
            "decode": [e if isinstance(e, dict) else e.endpoint() for e in decode],
        },
    }
    doc.update(overrides)
    return doc


@dataclass
class Router:
    url: str
    config_path: Path
    process: Process
    versions_written: list[int] = field(default_factory=list)

    def write_config(self, doc: dict[str, Any] | str) -> None:
        """Atomic replace, as a ConfigMap update does it."""
        staged = self.config_path.with_suffix(".tmp")
        staged.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        os.replace(staged, self.config_path)

    def config_page(self) -> dict[str, Any]:
        status, body = http_get(self.url, "/config")
        assert status == 200
        return json.loads(body)


RouterFactory = Callable[..., Router]


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: Any


async def post(client: aiohttp.ClientSession, url: str, body: Any, **headers: str) -> Answer:
    data: bytes | io.BytesIO = body if isinstance(body, bytes) else json.dumps(body).encode()
    if len(data) > aiohttp.payload.TOO_LARGE_BYTES_BODY:  # aiohttp warns of raw bytes past 1 MiB
        data = io.BytesIO(data)  # sent in chunks, its Content-Length still known
    async with client.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as reply:
        text = await reply.text()
        parsed: Any = sse_events(text) if reply.content_type == "text/event-stream" else json.loads(text)
        return Answer(reply.status, {k.lower(): v for k, v in reply.headers.items()}, parsed)


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


async def metric_samples(client: aiohttp.ClientSession, url: str) -> dict[tuple[str, frozenset[Any]], float]:
    async with client.get(url + "/metrics") as reply:
        assert reply.status == 200
        text = await reply.text()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: dict[tuple[str, frozenset[Any]], float], name: str, **labels: str) -> float:
    """One sample; engine samples are matched on the given labels only."""
    for (found, found_labels), value in samples.items():
        if found == name and set(labels.items()) <= found_labels:
            return value
    return 0.0


def total(samples: dict[tuple[str, frozenset[Any]], float], name: str, **labels: str) -> float:
    """The sum over every series that has the given labels (SGLang splits request counters by
    `is_streaming`, and series appear with their first observation)."""
    return sum(
        value
        for (found, found_labels), value in samples.items()
        if found == name and set(labels.items()) <= found_labels
    )
