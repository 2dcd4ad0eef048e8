"""Our PD router against SMG and against talking to the engines directly: one run, same engines, same load.

    .venv/bin/python benchmarks/bench_router.py [--quick] [--rounds N] [--json PATH] [--keep-logs]

Fake SGLang engines (`prfaas_engine_sim`) with zero-time compute (`--time-scale 0`)
and a tiny KV scale: a local prefill and a decode (the PD cluster) and a PrfaaS prefill (the
other cluster, on another loopback address). Three paths carry the same load to the same local
prefill and decode:

* `direct`: the load generator plays the router itself (both legs, bootstrap fields);
* `ours`:   `prfaas-router --config ...` (prompts are short, so every request stays local);
* `smg`:    `smg launch --pd-disaggregation --prefill URL BOOTSTRAP --decode URL` (SMG, defaults).

Before measuring, a second SMG behind a recording tap shows what SMG polls and that its two
legs carry `bootstrap_host/port/room`; in every phase the prefills' count of KV transfers (where
SGLang observes them) must equal the requests sent, which proves that each request crossed the
PD protocol.

Phases, each path in turn, in 3 rounds (1 with --quick) whose path order rotates, so that all
paths meet the same background load; the load generator is a separate process whose streams
each send one request after another until a deadline (a warm-up, then a 3-4 s window):

* `throughput`:  256 streams, non-streamed answers of 16 tokens: maximum requests/s;
* `latency-1`:   1 stream, streamed answers of 16 tokens: the hop's cost without queueing;
* `streams-256`: 256 streams always open: streamed answers of 64 tokens from a second decode
  whose token steps take 50 ms (its only non-zero time), starts staggered, so 256 streams are
  in flight and about 80 new ones arrive per second; added latency is measured here;
* `sse`:         16 streams of 1024-token answers: SSE events/s.

Added latency = a path's percentile minus the direct path's same percentile (of time to first
byte; end-to-end shown too), pooled over rounds; the target applies to `streams-256`.
Router CPU per request (from /proc) is printed next to the rates: on a shared machine it is
steadier than requests/s. Then an in-process micro-benchmark of the decision for a
128K-token prompt (the prompt's key, both prefix-index lookups, `policy.decide`).

Every number is measured in this run. The machine is shared: each phase prints the CPU that
processes outside the benchmark used meanwhile; ratios taken side by side mean more than the
absolute figures. Our router runs with its own defaults (health checks every 0.5 s, 0.5 s
timeout, one failure; a late answer from an engine that is streaming to us does not count).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prfaas_router.link_probe import parse_engine_transfers
from prfaas_router.settings import RouterSettings, to_flags

LOADGEN = Path(__file__).resolve().with_name("router_loadgen.py")
BIN = Path(sys.executable).parent
MODEL = "bench-model"
PATHS = ("direct", "ours", "smg")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

TARGET_ADDED_P50_S = 0.001
TARGET_ADDED_P99_S = 0.005
TARGET_RPS_RATIO = 0.5
TARGET_DECISION_S = 0.001

PROMPT_TOKENS = 512  # short: under the threshold, so our router keeps every request local
THRESHOLD_TOKENS = 8192
CHARS_PER_TOKEN = 4.0
KV_SCALE = "1e-6"  # a few hundred KV bytes per request really cross from prefill to decode
STREAM_STEP_SECONDS = 0.05  # the streams-256 decode's token step
STREAM_TOKENS = 64


# ----------------------------------------------------------------------------- processes


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def http_get(url: str, timeout: float = 1.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return int(reply.status), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@dataclass
class Server:
    """A process this benchmark started and stops."""

    name: str
    args: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        return self

    def cpu_seconds(self) -> float:
        """User + system CPU of the process so far (Linux /proc)."""
        assert self.popen is not None
        fields = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def wait_http(self, url: str, seconds: float = 60.0) -> None:
        deadline = time.monotonic() + seconds
        while True:
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                if http_get(url)[0] == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready at {url} after {seconds} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]


@dataclass
class Engine:
    server: Server
    host: str
    port: int
    bootstrap_port: int | None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def endpoint(self, name: str) -> dict[str, Any]:
        body: dict[str, Any] = {"name": name, "url": self.url}
        if self.bootstrap_port is not None:
            body["bootstrap_port"] = self.bootstrap_port
        return body


def start_engine(name: str, mode: str, host: str, profile: str, logs: Path, *extra: str) -> Engine:
    port = free_port(host)
    bootstrap = free_port(host) if mode == "prefill" else None
    args = [str(BIN / "prfaas-engine-sim"), "--mode", mode, "--host", host, "--port", str(port)]
    args += ["--profile", profile, "--time-scale", "0", "--kv-scale", KV_SCALE, "--bootstrap-timeout", "60"]
    args += [
        "--served-model-name",
        MODEL,
        "--chars-per-token",
        str(CHARS_PER_TOKEN),
        "--log-level",
        "warning",
    ]
    if bootstrap is not None:
        args += ["--bootstrap-port", str(bootstrap)]
    server = Server(name, [*args, *extra], logs / f"{name}.log").start()
    return Engine(server, host, port, bootstrap)


def config_doc(local: dict[str, Any], prfaas: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    """Our router's config: one instance per pool, the case study's KV size and prefill times."""
    return {
        "schema": "prfaas.io/router-config/v1",
        "version": 1,
        "served_model_name": MODEL,
        "threshold_tokens": THRESHOLD_TOKENS,
        "block_size_tokens": 512,
        "chars_per_token": CHARS_PER_TOKEN,
        "link": {"bandwidth_bytes_per_second": 1.25e9, "headroom": 0.8, "latency_seconds": 0.001},
        "kv_size": {"bytes_per_token": 17143.0, "fixed_bytes": 1.8e8},
        "prefill_time": {
            "prfaas": {"c0": 0.389, "c1": 4.107e-5, "c2": 9.476e-11},
            "local": {"c0": 0.570, "c1": 1.170e-4, "c2": 6.347e-10},
        },
        "slo": {"ttft_seconds": 1000.0, "tpot_seconds": 0.05},
        "pools": {"prfaas_prefill": [prfaas], "local_prefill": [local], "decode": [decode]},
    }


def router_config(local: Engine, prfaas: Engine, decode: Engine) -> dict[str, Any]:
    return config_doc(local.endpoint("local-0"), prfaas.endpoint("prfaas-0"), decode.endpoint("decode-0"))


def smg_args(smg: str, prefill: str, bootstrap_port: int, decode: str, port: int) -> list[str]:
    return [
        smg,
        "launch",
        "--pd-disaggregation",
        "--prefill",
        prefill,
        str(bootstrap_port),
        "--decode",
        decode,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn",
        "--shutdown-grace-period-secs",
        "1",
    ]


def kv_transfers(prefills: Sequence[Engine]) -> int:
    """KV transfers the prefills have sent: one per PD request that really crossed.

    Counted where SGLang counts them: its prefill observes `sglang:kv_transfer_*` when a transfer
    completes (disaggregation/prefill.py, process_disagg_prefill_inflight_queue), the decode
    observes none; each transfer once over the ranks' series (`link_estimate.engine_totals`).
    """
    total = 0.0
    for prefill in prefills:
        status, body = http_get(prefill.url + "/metrics", timeout=10.0)
        if status != 200:
            raise RuntimeError(f"prefill {prefill.url} /metrics answered {status}")
        total += parse_engine_transfers(body.decode()).totals.transfers
    return round(total)


# ----------------------------------------------------------------------------- CPU accounting


def machine_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine so far, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (sum(values) - values[3] - values[4]) / CLOCK_TICKS


class CpuWindow:
    """CPU used during one phase: ours by process, and everybody else's (the noise)."""

    def __init__(self, servers: Sequence[Server]) -> None:
        self.servers = servers
        self.by_process: dict[str, float] = {}
        self.others = 0.0

    def __enter__(self) -> CpuWindow:
        self._start = {server.name: server.cpu_seconds() for server in self.servers}
        self._busy = machine_busy_seconds()
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._children = usage.ru_utime + usage.ru_stime
        self._own = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.by_process = {s.name: s.cpu_seconds() - self._start[s.name] for s in self.servers}
        self.by_process["loadgen"] = usage.ru_utime + usage.ru_stime - self._children
        self.by_process["bench"] = time.process_time() - self._own
        busy = machine_busy_seconds() - self._busy
        self.others = max(0.0, busy - sum(self.by_process.values()))


# ----------------------------------------------------------------------------- phases


@dataclass(frozen=True)
class Phase:
    name: str
    concurrency: int
    stream: bool
    max_tokens: int
    seconds: float  # measured window
    warmup: float  # before the window
    stagger: float = 0.0
    paced_decode: bool = False


def phases(quick: bool) -> list[Phase]:
    """Short phases, repeated in rounds: on a shared machine every path meets the same weather."""
    scale = 0.5 if quick else 1.0
    stream_seconds = STREAM_TOKENS * STREAM_STEP_SECONDS
    return [
        Phase("throughput", 256, False, 16, 4 * scale, 1.0),
        Phase("latency-1", 1, True, 16, 4 * scale, 0.5),
        Phase("streams-256", 256, True, STREAM_TOKENS, 4 * scale, stream_seconds + 0.5, stream_seconds, True),
        Phase("sse", 16, True, 1024, 3 * scale, 1.0),
    ]


@dataclass
class Run:
    """One phase on one path in one round, reduced to its measured window."""

    phase: str
    path: str
    round: int
    window: float
    completed: int  # ok answers that ended in the window
    latency: list[float]  # end - start of those
    ttft: list[float]  # first byte - start of ok requests that started in the window
    events: int  # SSE events of the completed ones
    in_flight: float  # mean requests in flight during the window
    sent: int  # every request, warm-up included
    errors: int
    error_samples: list[str]
    transfers: int  # KV transfers the prefills sent meanwhile
    cpu: dict[str, float]
    others_cores: float

    @property
    def rate(self) -> float:
        return self.completed / self.window


def reduce_run(phase: Phase, path: str, round_: int, raw: dict[str, Any]) -> dict[str, Any]:
    begin, end = phase.warmup, phase.warmup + phase.seconds
    requests = raw["requests"]
    done = [r for r in requests if begin <= r[2] <= end]
    overlap = sum(max(0.0, min(r[2], end) - max(r[0], begin)) for r in requests)
    return {
        "phase": phase.name,
        "path": path,
        "round": round_,
        "window": phase.seconds,
        "completed": len(done),
        "latency": [r[2] - r[0] for r in done],
        "ttft": [r[1] - r[0] for r in requests if begin <= r[0] <= end and r[1] is not None],
        "events": sum(r[3] for r in done),
        "in_flight": overlap / phase.seconds,
        "sent": len(requests) + len(raw["errors"]),
        "errors": len(raw["errors"]),
        "error_samples": raw["error_samples"],
    }


def start_engines(logs: Path, *paced_extra: str) -> tuple[Engine, Engine, Engine, Engine]:
    """The fake engines every front is measured on: a local prefill, a decode, a PrfaaS prefill and
    the streams-256 decode, whose tokens come STREAM_STEP_SECONDS apart, up to 1024 at once."""
    return (
        start_engine("local-prefill", "prefill", "127.0.0.1", "h20", logs),
        start_engine("decode", "decode", "127.0.0.1", "h20", logs),
        start_engine("prfaas-prefill", "prefill", "127.0.1.1", "h200", logs),
        start_engine(
            "paced-decode",
            "decode",
            "127.0.0.1",
            "h20",
            logs,
            "--time-scale",
            "1",
            "--decode-step-seconds",
            str(STREAM_STEP_SECONDS),
            "--max-running-requests",
            "1024",
            *paced_extra,
        ),
    )


def measured_run(
    spec: dict[str, Any],
    phase: Phase,
    path: str,
    round_: int,
    servers: Sequence[Server],
    prefills: Sequence[Engine],
) -> Run:
    """One phase of the load generator against one front, with the KV transfers and the CPU it took."""
    before = kv_transfers(prefills)
    started = time.monotonic()
    with CpuWindow(servers) as cpu:
        done = subprocess.run(
            [sys.executable, str(LOADGEN), json.dumps(spec)],
            capture_output=True,
            timeout=phase.warmup + phase.seconds + 120,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed ({done.returncode}):\n{done.stderr.decode()[-2000:]}")
    wall = time.monotonic() - started
    time.sleep(0.3)  # let drained prefill legs and the decode's counters settle
    return Run(
        **reduce_run(phase, path, round_, json.loads(done.stdout)),
        transfers=kv_transfers(prefills) - before,
        cpu=cpu.by_process,
        others_cores=cpu.others / wall,
    )


class Bench:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.servers: list[Server] = []
        self.targets: dict[tuple[str, bool], dict[str, Any]] = {}
        self.routers: dict[tuple[str, bool], Server] = {}
        self.runs: list[Run] = []
        self.tag = f"{random.getrandbits(32):08x}"
        self.commands: list[str] = []

    # ---- setup

    def start(self, smg: str) -> None:
        logs = self.logs
        self.local, self.decode, self.prfaas, self.paced = engines = start_engines(logs)
        self.servers += [engine.server for engine in engines]
        for engine in engines:
            engine.server.wait_http(engine.url + "/ready")  # SGLang's /health takes a second
        for paced, decode in ((False, self.decode), (True, self.paced)):
            suffix = "-paced" if paced else ""
            config_path = logs / f"router-config{suffix}.json"
            config_path.write_text(json.dumps(router_config(self.local, self.prfaas, decode)))
            port = free_port()
            ours = RouterSettings(config_path=config_path, port=port, log_level="WARNING")
            args = [str(BIN / "prfaas-router"), *to_flags(ours)]
            self._router(("ours", paced), f"ours{suffix}", args, port)
            port = free_port()
            args = smg_args(smg, self.local.url, self.bootstrap_port, decode.url, port)
            self._router(("smg", paced), f"smg{suffix}", args, port)
            self.targets[("direct", paced)] = {
                "kind": "direct",
                "prefill": self.local.url,
                "decode": decode.url,
                "bootstrap_host": self.local.host,
                "bootstrap_port": self.bootstrap_port,
            }
        for (path, _), server in self.routers.items():
            server.wait_http(self.targets[(path, _)]["url"] + "/readiness")

    def _router(self, key: tuple[str, bool], name: str, args: list[str], port: int) -> None:
        server = Server(name, args, self.logs / f"{name}.log").start()
        self.servers.append(server)
        self.routers[key] = server
        self.targets[key] = {"kind": "router", "url": f"http://127.0.0.1:{port}"}
        self.commands.append(" ".join(Path(args[0]).name if i == 0 else a for i, a in enumerate(args)))

    @property
    def prefills(self) -> tuple[Engine, ...]:
        return (self.local, self.prfaas)

    @property
    def bootstrap_port(self) -> int:
        assert self.local.bootstrap_port is not None
        return self.local.bootstrap_port

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()

    # ---- measuring

    def run_phase(self, phase: Phase, path: str, round_: int) -> Run:
        spec = {
            "target": self.targets[(path, phase.paced_decode)],
            "path": "/v1/chat/completions",
            "prompt_chars": int(PROMPT_TOKENS * CHARS_PER_TOKEN),
            "max_tokens": phase.max_tokens,
            "stream": phase.stream,
            "concurrency": phase.concurrency,
            "seconds": phase.warmup + phase.seconds,
            "stagger": phase.stagger,
            "tag": f"{self.tag}-{phase.name}-{path}-{round_}",
        }
        return measured_run(spec, phase, path, round_, self.servers, self.prefills)

    def measure(self, rounds: int, quick: bool) -> None:
        for round_ in range(rounds):
            order = PATHS[round_ % 3 :] + PATHS[: round_ % 3]
            for phase in phases(quick):
                for path in order:
                    run = self.run_phase(phase, path, round_)
                    self.runs.append(run)
                    print(
                        f"  round {round_ + 1} {phase.name:<12} {path:<6} {run.completed:>6} ok"
                        f" {run.errors:>3} errors {run.rate:8.1f} req/s, in flight {run.in_flight:6.1f},"
                        f" others' CPU {run.others_cores:4.2f} cores",
                        flush=True,
                    )

    def router_cpu(self, run: Run) -> float | None:
        """CPU seconds of the router the run went through (None for direct)."""
        for (path, paced), server in self.routers.items():
            if path == run.path and paced == (run.phase == "streams-256"):
                return run.cpu[server.name]
        return None


# ----------------------------------------------------------------------------- SMG verification


@dataclass
class TapRecord:
    gets: dict[str, int] = field(default_factory=dict)
    posts: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)


async def verify_smg(smg: str, bench: Bench) -> tuple[TapRecord, list[str]]:
    """A second SMG behind a recording tap: what it polls, and the bootstrap fields of its legs."""
    import aiohttp
    from aiohttp import web

    record = TapRecord()
    problems: list[str] = []
    session = aiohttp.ClientSession(auto_decompress=False)
    runners: list[web.AppRunner] = []

    def tap(target: str, leg: str) -> Callable[[web.Request], Any]:
        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            if request.method == "GET":
                record.gets[request.path_qs] = record.gets.get(request.path_qs, 0) + 1
            else:
                fields: dict[str, Any] = {}
                with contextlib.suppress(ValueError):
                    parsed = json.loads(body)
                    fields = {k: v for k, v in parsed.items() if k.startswith("bootstrap_")}
                record.posts.append((leg, request.path, fields))
            headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
            async with session.request(
                request.method, target + request.path_qs, data=body or None, headers=headers
            ) as reply:
                out = web.StreamResponse(status=reply.status)
                out.content_type = reply.content_type
                await out.prepare(request)
                async for chunk in reply.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out

        return forward

    ports = {}
    for leg, target in (("prefill", bench.local.url), ("decode", bench.decode.url)):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", tap(target, leg))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        runners.append(runner)
        ports[leg] = free_port()
        await web.TCPSite(runner, "127.0.0.1", ports[leg]).start()
    port = free_port()
    prefill_url, decode_url = (f"http://127.0.0.1:{ports[leg]}" for leg in ("prefill", "decode"))
    server = Server(
        "smg-verify",
        smg_args(smg, prefill_url, bench.bootstrap_port, decode_url, port),
        bench.logs / "smg-verify.log",
    ).start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/readiness") as reply:
                    if reply.status == 200:
                        break
            if time.monotonic() > deadline or (server.popen and server.popen.poll() is not None):
                raise RuntimeError(f"verification SMG not ready:\n{server.log_tail()}")
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # let its first polls land on the tap
        before = kv_transfers(bench.prefills)
        for stream in (False, True):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "verify " * 40}],
                "max_tokens": 8,
                "stream": stream,
            }
            async with session.post(url + "/v1/chat/completions", json=body) as reply:
                data = await reply.read()
                complete = data.rstrip().endswith(b"[DONE]") if stream else b'"completion_tokens": 8' in data
                if reply.status != 200 or not complete:
                    problems.append(f"stream={stream}: HTTP {reply.status} {data[:200]!r}")
        await asyncio.sleep(0.3)
        transfers = kv_transfers(bench.prefills) - before
        if transfers != 2:
            problems.append(f"the prefills sent {transfers} KV transfers for 2 requests")
        legs = [post for post in record.posts if post[1] == "/v1/chat/completions"]
        rooms: dict[str, list[str]] = {}
        for leg, _, fields in legs:
            rooms.setdefault(json.dumps(fields.get("bootstrap_room")), []).append(leg)
            if (
                fields.get("bootstrap_host") != "127.0.0.1"
                or fields.get("bootstrap_port") != bench.bootstrap_port
            ):
                problems.append(f"{leg} leg without the prefill's bootstrap host/port: {fields}")
        if len(legs) != 4 or sorted(map(sorted, rooms.values())) != [["decode", "prefill"]] * 2:
            problems.append(f"expected 2 requests, each a prefill and a decode leg sharing one room: {legs}")
    finally:
        server.stop()
        for runner in runners:
            await runner.cleanup()
        await session.close()
    return record, problems


# ----------------------------------------------------------------------------- decision micro-benchmark

DECISION_CASES = (
    "ids, fresh (no block held)",
    "ids, worst (all but the last block held)",
    "text, fresh",
    "text, worst",
)


def decision_benchmark(samples: int) -> dict[str, dict[str, float]]:
    """Median and p99 (seconds) of what the router does to decide a 128K-token request.

    A decision = the prompt's keys (`prompt_keys` over the parsed request: token ids as the uint64
    buffers `payloads.parse` decodes), the lookups in both clusters' prefix indexes and
    `policy.decide`, as `Dispatcher.serve` does them. Keys hash lazily, so a fresh prompt costs
    one block; the worst case is a prompt whose every block but the last is held in both
    clusters, which walks (and hashes) the whole prompt. Shown apart, as not part of the
    decision: hashing all of a prompt (done when it is learnt, after its prefill) and decoding
    a 128K-id JSON body.
    """
    from prfaas_core.router_config import RouterConfig
    from prfaas_core.routing.policy import AvailableWorkers, PolicyModel, Rejection, RequestView, decide
    from prfaas_core.routing.prefix_index import PrefixIndex
    from prfaas_core.routing.workers import Fleet
    from prfaas_core.vocabulary import Pool
    from prfaas_router.payloads import Kind, ParsedRequest, parse, prompt_keys

    config = RouterConfig.model_validate(
        config_doc(
            {"name": "local-0", "url": "http://127.0.0.1:1", "bootstrap_port": 2},
            {"name": "prfaas-0", "url": "http://127.0.1.1:1", "bootstrap_port": 2},
            {"name": "decode-0", "url": "http://127.0.0.1:3"},
        )
    )
    model = PolicyModel.from_config(config)
    fleet = Fleet(3, 5.0)
    fleet.reconcile(config.pools)
    for worker in fleet.workers():
        worker.healthy = True
    now = time.monotonic()
    pools = AvailableWorkers(
        fleet.available(Pool.LOCAL_PREFILL, now),
        fleet.available(Pool.PRFAAS_PREFILL, now),
        fleet.available(Pool.DECODE, now),
        now=now,
    )
    rng = random.Random(7)
    tokens = 131072
    block = config.block_size_tokens
    ids = [rng.randrange(150000) for _ in range(tokens)]
    text = "".join(f"w{i:06d} " for i in range(tokens // 2))[: int(tokens * CHARS_PER_TOKEN)]
    block_chars = int(block * CHARS_PER_TOKEN)
    body = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 16}).encode()

    def request(prompt: object) -> ParsedRequest:
        raw = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 16}).encode()
        return parse(Kind.COMPLETION, raw)[1]

    by_ids, by_text = request(ids), request(text)
    fresh_ids, fresh_text = request([rng.randrange(150000) for _ in range(tokens)]), request("x" + text[1:])
    index_local, index_prfaas = PrefixIndex(262144, 65536), PrefixIndex(262144, 65536)
    held = (
        request(ids[:-block] + [(i + 1) % 150000 for i in ids[-block:]]),
        request(text[:-block_chars] + "z" * block_chars),
    )
    for index, holder in ((index_local, "local-0"), (index_prfaas, "prfaas-0")):
        for held_request in held:
            (key,) = prompt_keys(held_request, block, CHARS_PER_TOKEN)
            index.learn(key, holder)

    def decision(parsed: ParsedRequest, cached: bool) -> Callable[[], object]:
        def once() -> None:
            keys = prompt_keys(parsed, block, CHARS_PER_TOKEN)
            view = RequestView(
                total_tokens=sum(key.tokens for key in keys),
                sequences=len(keys),
                hit_local=index_local.lookup_all(keys),
                hit_prfaas=index_prfaas.lookup_all(keys),
            )
            chosen = decide(model, view, pools, 0.0)
            assert not isinstance(chosen, Rejection), chosen
            assert (view.hit_local.tokens == tokens - block) == cached, view.hit_local

        return once

    steps: dict[str, Callable[[], object]] = {
        DECISION_CASES[0]: decision(fresh_ids, cached=False),
        DECISION_CASES[1]: decision(by_ids, cached=True),
        DECISION_CASES[2]: decision(fresh_text, cached=False),
        DECISION_CASES[3]: decision(by_text, cached=True),
        "not decision: all block hashes of 128K ids": lambda: (
            prompt_keys(by_ids, block, CHARS_PER_TOKEN)[0].block_hashes
        ),
        "not decision: json-decode a 128K-id body": lambda: parse(Kind.COMPLETION, body),
    }
    out = {}
    for name, step in steps.items():
        step()
        times = []
        for _ in range(samples if "json" not in name else max(5, samples // 10)):
            begin = time.perf_counter()
            step()
            times.append(time.perf_counter() - begin)
        out[name] = {"p50": percentile(times, 50), "p99": percentile(times, 99)}
    return out


# ----------------------------------------------------------------------------- report


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.3f}"


def machine_line() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    load = Path("/proc/loadavg").read_text().split()[:3]
    return f"{os.cpu_count()} cores ({model}); load average {' '.join(load)}"


class Report:
    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.met = True

    def group(self, phase: str, path: str) -> list[Run]:
        return [run for run in self.bench.runs if run.phase == phase and run.path == path]

    def samples(self, phase: str, path: str, what: str) -> list[float]:
        return [x for run in self.group(phase, path) for x in getattr(run, what)]

    def rate(self, phase: str, path: str) -> float:
        group = self.group(phase, path)
        return sum(run.completed for run in group) / sum(run.window for run in group)

    def verdict(self, ok: bool) -> str:
        self.met &= ok
        return "MET" if ok else "MISSED"

    def smg(self, verify: tuple[TapRecord, list[str]]) -> None:
        print("\n=== SMG in PD mode (a second instance behind a recording tap) ===")
        record, problems = verify
        polled = ", ".join(f"{path} x{count}" for path, count in sorted(record.gets.items()))
        print(f"  SMG polled the engines: {polled or 'nothing'}")
        for leg, path, fields in record.posts:
            print(f"  {leg:<7} leg {path}: {json.dumps(fields)}")
        if problems:
            self.met = False
            print("  PROBLEM: " + "; ".join(problems))
        else:
            print("  OK: both legs of each request carry the prefill's bootstrap_host/port and one")
            print("      bootstrap_room, and the decode pulled the KV (one transfer per request).")

    def protocol(self) -> None:
        print("\n=== PD protocol during the phases (the prefills' KV transfers against requests sent) ===")
        for path in PATHS:
            runs = [run for run in self.bench.runs if run.path == path]
            sent, transfers = sum(run.sent for run in runs), sum(run.transfers for run in runs)
            errors = sum(run.errors for run in runs)
            verdict = "OK" if transfers == sent and errors == 0 else "MISMATCH"
            self.met &= verdict == "OK"
            print(
                f"  {path:<6} {sent:>7} requests sent, {transfers:>7} KV transfers, {errors} errors: {verdict}"
            )
            for run in runs:
                for sample in run.error_samples[:2]:
                    print(f"         {run.phase}: {sample}")

    def table(self) -> None:
        print("\n=== Results (ms; pooled over rounds; CPU = the router's own, per request) ===")
        print(
            f"  {'phase':<12} {'path':<6} {'req/s':>8} {'in flight':>9} {'p50':>8} {'p99':>8}"
            f" {'ttft p50':>8} {'ttft p99':>8} {'CPU ms':>7} {'others':>6}"
        )
        for phase in phases(False):
            for path in PATHS:
                group = self.group(phase.name, path)
                latency = self.samples(phase.name, path, "latency")
                ttft = self.samples(phase.name, path, "ttft")
                cpu = [self.bench.router_cpu(run) for run in group]
                cpu_ms = (
                    f"{1000 * sum(c for c in cpu if c is not None) / max(1, sum(r.completed for r in group)):7.3f}"
                    if None not in cpu
                    else f"{'-':>7}"
                )
                in_flight = statistics.mean(run.in_flight for run in group)
                others = statistics.mean(run.others_cores for run in group)
                ttft_cells = (
                    f"{ms(percentile(ttft, 50))} {ms(percentile(ttft, 99))}" if ttft else f"{'-':>8} {'-':>8}"
                )
                print(
                    f"  {phase.name:<12} {path:<6} {self.rate(phase.name, path):8.1f} {in_flight:9.1f}"
                    f" {ms(percentile(latency, 50))} {ms(percentile(latency, 99))} {ttft_cells} {cpu_ms} {others:6.2f}"
                )
        print("  (others = cores used by processes outside this benchmark during the phase)")

    def added_latency(self) -> None:
        print("\n=== Added latency: path minus direct, same percentile (ms) ===")
        for phase in ("latency-1", "streams-256"):
            for path in ("ours", "smg"):
                cells = []
                values = {}
                for what in ("ttft", "latency"):
                    base, mine = self.samples(phase, "direct", what), self.samples(phase, path, what)
                    for q in (50, 99):
                        values[(what, q)] = percentile(mine, q) - percentile(base, q)
                    cells.append(
                        f"{'first byte' if what == 'ttft' else 'complete'} p50 {ms(values[(what, 50)])}"
                        f" p99 {ms(values[(what, 99)])}"
                    )
                line = f"  {phase:<12} {path:<5} " + "   ".join(cells)
                if phase == "streams-256" and path == "ours":
                    ok = (
                        values[("ttft", 50)] <= TARGET_ADDED_P50_S
                        and values[("ttft", 99)] <= TARGET_ADDED_P99_S
                    )
                    line += f"   first byte vs p50 <= 1, p99 <= 5: {self.verdict(ok)}"
                print(line)

    def ratios(self) -> None:
        print("\n=== Ratios ===")
        runs = self.bench.runs
        ours, smg = self.rate("throughput", "ours"), self.rate("throughput", "smg")
        direct = self.rate("throughput", "direct")
        print(
            f"  max requests/s ours/SMG {ours / smg:5.2f}  (target >= {TARGET_RPS_RATIO}:"
            f" {self.verdict(ours / smg >= TARGET_RPS_RATIO)});  ours/direct {ours / direct:4.2f},"
            f" SMG/direct {smg / direct:4.2f}"
        )
        by_round = {
            run.round: run.rate / other.rate
            for run in runs
            for other in runs
            if run.phase == other.phase == "throughput"
            and (run.path, other.path) == ("ours", "smg")
            and run.round == other.round
        }
        print(f"  max requests/s ours/SMG by round: {', '.join(f'{r:.2f}' for r in by_round.values())}")
        cpu = {}
        for path in ("ours", "smg"):
            group = self.group("throughput", path)
            cpu[path] = sum(self.bench.router_cpu(run) or 0.0 for run in group) / sum(
                r.completed for r in group
            )
        print(
            f"  router CPU per request at max load: ours {cpu['ours'] * 1e3:.3f} ms, SMG {cpu['smg'] * 1e3:.3f} ms"
            f" (ours/SMG {cpu['ours'] / cpu['smg']:.2f})"
        )
        events = {
            path: sum(r.events for r in self.group("sse", path))
            / sum(r.window for r in self.group("sse", path))
            for path in PATHS
        }
        print(
            f"  SSE events/s: direct {events['direct']:.0f}, ours {events['ours']:.0f}, SMG {events['smg']:.0f}"
            f" (ours/SMG {events['ours'] / events['smg']:.2f}, ours/direct {events['ours'] / events['direct']:.2f})"
        )

    def decision(self, decision: dict[str, dict[str, float]]) -> None:
        print("\n=== Decision for a 128K-token prompt (in process, ms) ===")
        for name, values in decision.items():
            line = f"  {name:<44} p50 {ms(values['p50'])}  p99 {ms(values['p99'])}"
            if name in DECISION_CASES:
                line += f"   p50 <= 1 ms: {self.verdict(values['p50'] <= TARGET_DECISION_S)}"
            print(line)


def finish(runs: Sequence[Run], met: bool, started: float, logs: Path, args: argparse.Namespace) -> int:
    """A benchmark's last lines: the machine, the runs to --json, the logs kept or removed, the verdict."""
    print(f"\nmachine at end: {machine_line()}; took {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps([asdict(run) for run in runs]))
    if args.keep_logs:
        print(f"logs: {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    print("all targets met" if met else "some targets missed (see above)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short round (about a minute)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of all phases (default 3; quick 1)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs")
    parser.add_argument("--json", type=Path, default=None, help="also write the reduced runs here")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    smg = shutil.which("smg", path=str(BIN)) or shutil.which("smg")
    if smg is None:
        print("smg is not installed: `.venv/bin/pip install smg` (the SGLang model gateway)", file=sys.stderr)
        return 2
    version = subprocess.run([smg, "--version"], capture_output=True, text=True, check=False).stdout.strip()

    logs = Path(tempfile.mkdtemp(prefix="bench-router-"))
    print(f"machine at start: {machine_line()}")
    print(
        f"engines: fake SGLang, --time-scale 0, --kv-scale {KV_SCALE}; prompts {PROMPT_TOKENS} tokens; {version}"
    )
    bench = Bench(logs)
    started = time.monotonic()
    try:
        bench.start(smg)
        for command in bench.commands:
            print(f"  {command}")
        verify = asyncio.run(verify_smg(smg, bench))
        bench.measure(rounds, args.quick)
    except BaseException:
        print(f"failed; logs kept in {logs}", file=sys.stderr)
        bench.stop()
        raise
    bench.stop()
    decision = decision_benchmark(50 if args.quick else 200)
    report = Report(bench)
    report.smg(verify)
    report.protocol()
    report.table()
    report.added_latency()
    report.ratios()
    report.decision(decision)
    return finish(bench.runs, report.met, started, logs, args)


if __name__ == "__main__":
    raise SystemExit(main())
