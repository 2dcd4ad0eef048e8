"""Envoy + our picker against our router alone and against the engines directly: one run, same
engines, same load, 220 KB prompts (issue 32, item 5).

    .venv/bin/python benchmarks/bench_gateway.py [--quick] [--rounds N] [--json PATH] [--keep-logs]

The fake SGLang engines of `bench_router.py` (zero-time compute, a tiny KV scale): a local
prefill, a decode, a second decode whose token steps take 50 ms (its only non-zero time) and a
PrfaaS prefill the policy never picks. Three fronts carry the same load to the same local
prefill and decode:

* `direct`: the load generator plays the router itself (both legs, bootstrap fields);
* `router`: `prfaas-router --config ...` alone, its own HTTP front;
* `envoy`:  Envoy 1.40 (tests/support/envoy.py's config: ext_proc FULL_DUPLEX_STREAMED for the
  request body, answers not sent to the picker, no access log) in front of
  `prfaas-router --config ... --picker-port P`, which fires the prefill leg itself.

Both routers run the same config, with the threshold above the prompts and the prefill times
scaled to the fake engines' zero compute, so every request stays local, as `direct` sends it.

Phases, each front in turn, in rounds whose front order rotates (the load generator is
`router_loadgen.py`, a separate process; prompts are 220,000 characters, 55,000 tokens):

* `streams-1`:   1 stream, streamed answers of 16 tokens: the hop's cost without queueing;
* `streams-256`: 256 streams always open, streamed answers from the paced decode, starts
  staggered, so 256 requests are in flight: the target's case.

Added time to first byte = a front's percentile minus direct's, pooled over rounds. CPU per
request = the front's processes' user + system CPU over the phase (from /proc: the router's;
Envoy's plus its picker's, and each of the two apart) over the requests sent. Target (issue 32):
at 256 streams Envoy + picker adds at most 2 ms p50 over the router alone, and its CPU per
request is at most the router's (the picker's alone against the router's is printed beside it,
not counted). The machine is shared: each phase prints what other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_router import (
    BIN,
    STREAM_STEP_SECONDS,
    Engine,
    Phase,
    Run,
    Server,
    finish,
    free_port,
    machine_line,
    measured_run,
    ms,
    percentile,
    router_config,
    start_engines,
)
from prfaas_router.settings import RouterSettings, to_flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from support.envoy import envoy_args, envoy_config, fetch_envoy  # noqa: E402

FRONTS = ("direct", "router", "envoy")
PROMPT_CHARS = 220_000
TARGET_ADDED_P50_S = 0.002  # Envoy + picker over the router alone, at 256 streams


def phases(quick: bool) -> list[Phase]:
    """In --quick, fewer and shorter requests: a smoke test of the machinery (about 15 s), not a measure."""
    if quick:
        return [
            Phase("streams-1", 1, True, 4, 0.2, 0.05),
            Phase("streams-256", 256, True, 4, 0.15, 0.0, 0.05, True),  # about one request each
        ]
    tokens = 96  # 4.8 s per request: 256 in flight make ~53 requests/s of 220 KB
    lasts = tokens * STREAM_STEP_SECONDS
    return [
        Phase("streams-1", 1, True, 16, 3.0, 0.5),
        Phase("streams-256", 256, True, tokens, 4.0, lasts + 0.5, lasts, True),
    ]


def gateway_config(local: Engine, prfaas: Engine, decode: Engine) -> dict[str, Any]:
    """`bench_router`'s config, every 220 KB prompt kept local and never shed: the threshold above
    it, and prefill times of zero compute (the fake engines'; the case study's would make the
    policy see 256 such prompts as minutes of queue)."""
    doc = router_config(local, prfaas, decode)
    doc["threshold_tokens"] = 1_000_000
    zero = {"c0": 0.001, "c1": 1e-9, "c2": 0.0}
    doc["prefill_time"] = {"prfaas": zero, "local": zero}
    return doc


class Bench:
    def __init__(self, logs: Path, envoy: Path) -> None:
        self.logs = logs
        self.envoy = envoy
        self.servers: list[Server] = []
        self.targets: dict[tuple[str, bool], dict[str, Any]] = {}
        self.fronts: dict[tuple[str, bool], list[Server]] = {}
        self.runs: list[Run] = []
        self.tag = f"{time.time_ns():x}"
        self.ready: list[tuple[Server, str]] = []  # started, waited for together

    def start(self) -> None:
        logs = self.logs
        # SGLang's warm-up, scaled by time, is not what this measures
        engines = start_engines(logs, "--startup-seconds", "0")
        self.local, self.decode, self.prfaas, self.paced = engines
        self.servers += [engine.server for engine in engines]
        self.ready += [(engine.server, engine.url + "/ready") for engine in engines]
        for paced, decode in ((False, self.decode), (True, self.paced)):
            suffix = "-paced" if paced else ""
            config_path = logs / f"router-config{suffix}.json"
            config_path.write_text(json.dumps(gateway_config(self.local, self.prfaas, decode)))
            router = self._router(f"router{suffix}", config_path)
            self.fronts[("router", paced)] = [router]
            self.targets[("router", paced)] = {"kind": "router", "url": router.url}
            picker_port = free_port()
            picker = self._router(f"picker{suffix}", config_path, "--picker-port", str(picker_port))
            envoy = self._envoy(f"envoy{suffix}", picker_port)
            self.fronts[("envoy", paced)] = [envoy, picker]
            self.targets[("envoy", paced)] = {"kind": "router", "url": envoy.url}
            assert self.local.bootstrap_port is not None
            self.targets[("direct", paced)] = {
                "kind": "direct",
                "prefill": self.local.url,
                "decode": decode.url,
                "bootstrap_host": self.local.host,
                "bootstrap_port": self.local.bootstrap_port,
            }
        for server, url in self.ready:
            server.wait_http(url)

    def _router(self, name: str, config_path: Path, *extra: str) -> FrontServer:
        port = free_port()
        flags = to_flags(RouterSettings(config_path=config_path, port=port, log_level="WARNING"))
        server = FrontServer(name, [str(BIN / "prfaas-router"), *flags, *extra], self.logs / f"{name}.log")
        server.url = f"http://127.0.0.1:{port}"
        self.servers.append(server.start())
        self.ready.append((server, server.url + "/readiness"))
        return server

    def _envoy(self, name: str, picker_port: int) -> FrontServer:
        port, admin = free_port(), free_port()
        config = self.logs / f"{name}.yaml"
        config.write_text(envoy_config(port=port, admin=admin, picker=picker_port))
        server = FrontServer(name, [str(self.envoy), *envoy_args(config)], self.logs / f"{name}.log")
        server.url = f"http://127.0.0.1:{port}"
        self.servers.append(server.start())
        self.ready.append((server, f"http://127.0.0.1:{admin}/ready"))
        return server

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()

    def run_phase(self, phase: Phase, front: str, round_: int) -> Run:
        spec = {
            "target": self.targets[(front, phase.paced_decode)],
            "path": "/v1/chat/completions",
            "prompt_chars": PROMPT_CHARS,
            "max_tokens": phase.max_tokens,
            "stream": True,
            "concurrency": phase.concurrency,
            "seconds": phase.warmup + phase.seconds,
            "stagger": phase.stagger,
            "tag": f"{self.tag}-{phase.name}-{front}-{round_}",
        }
        return measured_run(spec, phase, front, round_, self.servers, (self.local, self.prfaas))

    def measure(self, rounds: int, quick: bool) -> None:
        for round_ in range(rounds):
            order = FRONTS[round_ % 3 :] + FRONTS[: round_ % 3]
            for phase in phases(quick):
                for front in order:
                    run = self.run_phase(phase, front, round_)
                    self.runs.append(run)
                    print(
                        f"  round {round_ + 1} {phase.name:<12} {front:<6} {run.sent:>5} sent"
                        f" {run.errors:>3} errors, in flight {run.in_flight:6.1f},"
                        f" front CPU {1000 * self.front_cpu(run) / max(1, run.sent):6.3f} ms/request,"
                        f" others' CPU {run.others_cores:4.2f} cores",
                        flush=True,
                    )

    def front_cpu(self, run: Run) -> float:
        """CPU seconds the run's front used (0 for direct): Envoy's and its picker's together."""
        return sum(
            run.cpu[server.name] for server in self.fronts.get((run.path, run.phase == "streams-256"), [])
        )


@dataclass
class FrontServer(Server):
    """A front's process and the URL the load generator sends to."""

    url: str = ""


class Report:
    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.met = True

    def group(self, phase: str, front: str) -> list[Run]:
        return [run for run in self.bench.runs if run.phase == phase and run.path == front]

    def ttfb(self, phase: str, front: str) -> list[float]:
        return [x for run in self.group(phase, front) for x in run.ttft]

    def cpu_per_request(self, phase: str, front: str) -> float:
        group = self.group(phase, front)
        return sum(self.bench.front_cpu(run) for run in group) / max(1, sum(run.sent for run in group))

    def by_process(self, phase: str, front: str) -> dict[str, float]:
        """CPU seconds per request of each of the front's processes (Envoy's and its picker's apart)."""
        group = self.group(phase, front)
        sent = max(1, sum(run.sent for run in group))
        servers = self.bench.fronts.get((front, phase == "streams-256"), [])
        return {
            server.name.removesuffix("-paced"): sum(run.cpu[server.name] for run in group) / sent
            for server in servers
        }

    def verdict(self, ok: bool, counted: bool = True) -> str:
        """MET or MISSED; `counted` False for a reading shown beside the target, not part of it."""
        if counted:
            self.met &= ok
        return "MET" if ok else "MISSED"

    def protocol(self) -> None:
        print("\n=== PD protocol (the prefills' KV transfers against requests sent) ===")
        for front in FRONTS:
            runs = [run for run in self.bench.runs if run.path == front]
            sent, transfers = sum(run.sent for run in runs), sum(run.transfers for run in runs)
            errors = sum(run.errors for run in runs)
            ok = transfers == sent and errors == 0
            self.met &= ok
            print(
                f"  {front:<6} {sent:>6} requests sent, {transfers:>6} KV transfers, {errors} errors: {'OK' if ok else 'MISMATCH'}"
            )
            for run in runs:
                for sample in run.error_samples[:2]:
                    print(f"         {run.phase}: {sample}")

    def table(self, quick: bool) -> None:
        print("\n=== Time to first byte (ms, pooled over rounds) and the front's CPU per request (ms) ===")
        print(
            f"  {'phase':<12} {'front':<6} {'samples':>7} {'in flight':>9} {'p50':>8} {'p99':>8} {'added p50':>9} {'added p99':>9} {'CPU ms':>7} {'others':>6}"
        )
        for phase in phases(quick):
            base = self.ttfb(phase.name, "direct")
            for front in FRONTS:
                group = self.group(phase.name, front)
                ttfb = self.ttfb(phase.name, front)
                p50, p99 = percentile(ttfb, 50), percentile(ttfb, 99)
                added = (
                    f"{ms(p50 - percentile(base, 50)):>9} {ms(p99 - percentile(base, 99)):>9}"
                    if front != "direct"
                    else f"{'-':>9} {'-':>9}"
                )
                cpu = (
                    f"{1000 * self.cpu_per_request(phase.name, front):7.3f}"
                    if front != "direct"
                    else f"{'-':>7}"
                )
                in_flight = sum(run.in_flight for run in group) / len(group)
                others = sum(run.others_cores for run in group) / len(group)
                print(
                    f"  {phase.name:<12} {front:<6} {len(ttfb):>7} {in_flight:9.1f} {ms(p50)} {ms(p99)} {added} {cpu} {others:6.2f}"
                )
        print(
            "  (added = the front's percentile minus direct's; others = cores used by processes outside this benchmark)"
        )
        for phase in phases(quick):
            for front in ("router", "envoy"):
                each = self.by_process(phase.name, front)
                shown = ", ".join(f"{name} {1000 * cpu:.3f}" for name, cpu in each.items())
                print(f"  CPU ms/request by process, {phase.name} {front}: {shown}")

    def ratios(self, quick: bool) -> None:
        print("\n=== Envoy + picker against the router alone ===")
        for phase in phases(quick):
            router, envoy = self.ttfb(phase.name, "router"), self.ttfb(phase.name, "envoy")
            base = self.ttfb(phase.name, "direct")
            over = {q: percentile(envoy, q) - percentile(router, q) for q in (50, 99)}
            added = {
                front: percentile(self.ttfb(phase.name, front), 50) - percentile(base, 50)
                for front in ("router", "envoy")
            }
            cpu = {front: self.cpu_per_request(phase.name, front) for front in ("router", "envoy")}
            each = self.by_process(phase.name, "envoy")
            line = (
                f"  {phase.name:<12} first byte envoy - router: p50 {ms(over[50])} p99 {ms(over[99])} ms;"
                f" added p50 envoy/router {ratio(added['envoy'], added['router'])};"
                f" CPU/request against the router's: Envoy + picker {cpu['envoy'] / cpu['router']:.2f},"
                f" Envoy {each['envoy'] / cpu['router']:.2f}, picker {each['picker'] / cpu['router']:.2f}"
            )
            if phase.name == "streams-256":
                ok_latency = over[50] <= TARGET_ADDED_P50_S
                ok_cpu = cpu["envoy"] <= cpu["router"]
                ok_picker = each["picker"] <= cpu["router"]
                line += (
                    f"\n  {'':<12} target: p50 over the router <= 2 ms: {self.verdict(ok_latency)};"
                    f" CPU/request of Envoy + picker <= the router's: {self.verdict(ok_cpu)}"
                    f"\n  {'':<12} (the other reading, not counted: the picker's alone <= the router's:"
                    f" {self.verdict(ok_picker, counted=False)})"
                )
            print(line)


def ratio(a: float, b: float) -> str:
    """a/b, or the two values when b is too small for a ratio to mean anything."""
    return f"{a / b:.2f}" if b > 1e-4 else f"({ms(a).strip()} against {ms(b).strip()} ms)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short round: a smoke test, not a measure")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of all phases (default 2; quick 1)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs")
    parser.add_argument("--json", type=Path, default=None, help="also write the reduced runs here")
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 2)
    envoy = fetch_envoy()
    logs = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    print(f"machine at start: {machine_line()}")
    print(f"engines: fake SGLang, zero-time compute; prompts {PROMPT_CHARS} characters; {envoy}")
    bench = Bench(logs, envoy)
    started = time.monotonic()
    try:
        bench.start()
        bench.measure(rounds, args.quick)
    except BaseException:
        print(f"failed; logs kept in {logs}", file=sys.stderr)
        bench.stop()
        raise
    bench.stop()
    report = Report(bench)
    report.protocol()
    report.table(args.quick)
    report.ratios(args.quick)
    return finish(bench.runs, report.met, started, logs, args)


if __name__ == "__main__":
    raise SystemExit(main())
