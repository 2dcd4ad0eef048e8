"""Profile our router's hot path under the benchmark's throughput load (cProfile, pyinstrument or py-spy).

    .venv/bin/python benchmarks/profile_router.py [--seconds 10] [--stream] [--pyinstrument | --py-spy]

Same fake engines and load generator as `bench_router.py`; the router runs under the profiler
and the top functions by own time (cProfile) or the call tree (pyinstrument) are printed. py-spy
samples from outside the process, so it barely slows the router and sees time spent in C
(`--native`): the top functions by own samples and by samples under them are printed.
"""

from __future__ import annotations

import argparse
import collections
import json
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_router import (
    BIN,
    CHARS_PER_TOKEN,
    LOADGEN,
    PROMPT_TOKENS,
    Server,
    free_port,
    router_config,
    start_engine,
)
from prfaas_router.settings import RouterSettings, to_flags


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--stream", action="store_true", help="streamed answers (16 tokens)")
    profilers = parser.add_mutually_exclusive_group()
    profilers.add_argument("--pyinstrument", action="store_true")
    profilers.add_argument("--py-spy", action="store_true", help="sampled from outside, C frames included")
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--sort", default="tottime", help="cProfile order: tottime, cumulative, ncalls")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="profile-router-"))
    local = start_engine("local-prefill", "prefill", "127.0.0.1", "h20", logs)
    decode = start_engine("decode", "decode", "127.0.0.1", "h20", logs)
    prfaas = start_engine("prfaas-prefill", "prefill", "127.0.1.1", "h200", logs)
    servers = [local.server, decode.server, prfaas.server]
    try:
        for engine in (local, decode, prfaas):
            engine.server.wait_http(engine.url + "/ready")  # SGLang's /health takes a second
        config = logs / "router-config.json"
        config.write_text(json.dumps(router_config(local, prfaas, decode)))
        port = free_port()
        if args.py_spy:  # attached once the router is up, for the load's duration
            out = logs / "router.folded"
            profiler = [sys.executable, "-m"]
        elif args.pyinstrument:
            out = logs / "router.txt"
            profiler = [str(BIN / "pyinstrument"), "-r", "text", "-o", str(out), "-m"]
        else:
            out = logs / "router.prof"
            profiler = [sys.executable, "-m", "cProfile", "-o", str(out), "-m"]
        router = Server(
            "ours",
            [
                *profiler,
                "prfaas_router",
                *to_flags(RouterSettings(config_path=config, port=port, log_level="WARNING")),
            ],
            logs / "ours.log",
        ).start()
        servers.append(router)
        router.wait_http(f"http://127.0.0.1:{port}/readiness")
        spec = {
            "target": {"kind": "router", "url": f"http://127.0.0.1:{port}"},
            "path": "/v1/chat/completions",
            "prompt_chars": int(PROMPT_TOKENS * CHARS_PER_TOKEN),
            "max_tokens": 16,
            "stream": args.stream,
            "concurrency": args.concurrency,
            "seconds": args.seconds,
            "stagger": 0.0,
            "tag": "profile",
        }
        spy = None
        if args.py_spy:
            assert router.popen is not None
            spy = subprocess.Popen(
                [
                    *(str(BIN / "py-spy"), "record", "--pid", str(router.popen.pid), "--native"),
                    *("--nolineno", "--rate", "200", "--duration", str(round(args.seconds))),
                    *("--format", "raw", "--output", str(out)),
                ],
                stdout=subprocess.DEVNULL,
            )
        done = subprocess.run(
            [sys.executable, str(LOADGEN), json.dumps(spec)], capture_output=True, check=True
        )
        if spy is not None:
            spy.wait(30)
        result = json.loads(done.stdout)
        count = len(result["requests"])
        print(f"{count} ok, {len(result['errors'])} errors, {count / args.seconds:.1f} req/s")
        router.stop()
        if args.py_spy:
            print_folded(out, args.top)
        elif args.pyinstrument:
            print(out.read_text())
        else:
            stats = pstats.Stats(str(out))
            stats.sort_stats(args.sort).print_stats(args.top)
    finally:
        for server in reversed(servers):
            server.stop()
    return 0


def print_folded(path: Path, top: int) -> None:
    """The functions with most samples of their own, and most samples under them, from py-spy's
    folded stacks (`frame;frame;... count` per line)."""
    own: collections.Counter[str] = collections.Counter()
    under: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = stack.split(";")
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            under[frame] += count
    for title, counter in (("own samples", own), ("samples under it", under)):
        print(f"--- top {top} by {title} (of {total})")
        for frame, count in counter.most_common(top):
            print(f"{100 * count / total:6.1f}%  {frame}")


if __name__ == "__main__":
    raise SystemExit(main())
