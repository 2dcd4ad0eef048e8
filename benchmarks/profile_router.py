"""Profile our router's hot path under the benchmark's throughput load (cProfile or pyinstrument).

    .venv/bin/python benchmarks/profile_router.py [--seconds 10] [--stream] [--pyinstrument]

Same fake engines and load generator as `bench_router.py`; the router runs under the profiler
and the top functions by own time (cProfile) or the call tree (pyinstrument) are printed.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--pyinstrument", action="store_true")
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
        out = logs / ("router.txt" if args.pyinstrument else "router.prof")
        profiler = (
            [str(BIN / "pyinstrument"), "-r", "text", "-o", str(out), "-m"]
            if args.pyinstrument
            else [sys.executable, "-m", "cProfile", "-o", str(out), "-m"]
        )
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
        done = subprocess.run(
            [sys.executable, str(LOADGEN), json.dumps(spec)], capture_output=True, check=True
        )
        result = json.loads(done.stdout)
        count = len(result["requests"])
        print(f"{count} ok, {len(result['errors'])} errors, {count / args.seconds:.1f} req/s")
        router.stop()
        if args.pyinstrument:
            print(out.read_text())
        else:
            stats = pstats.Stats(str(out))
            stats.sort_stats(args.sort).print_stats(args.top)
    finally:
        for server in reversed(servers):
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
