"""The router's added time to first byte in front of real SGLang on CPU, against talking to the
engines directly: one run, the same engines, side by side.

    .venv/bin/python benchmarks/bench_real_sglang.py [--requests N]

Starts the real-SGLang fleet of tests/real_sglang (a PrfaaS prefill, a local prefill, a decode
and a plain server, each from the operator's command line; about 2 minutes) and the router in
front. At 1 and at 16 concurrent streams, each stream sends streamed chat requests of a short
prompt (the local route), alternating two paths request by request so both meet the same load:

* `direct`: the benchmark plays the router (both legs to the local prefill and the decode, with
  bootstrap fields, the decode's stream timed);
* `router`: the same request to the router.

Prints each path's median and p90 time to first byte, the ratio router/direct and the added
milliseconds. The machine is shared and the engines are CPU-bound: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "tests" / "real_sglang")]

from prfaas_core.vocabulary import Role  # noqa: E402
from real_fleet import Fleet, pd_body, running_fleet  # noqa: E402
from test_real_engines import SHORT, chat  # noqa: E402


async def first_byte(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    began = time.monotonic()
    async with client.post(url, json=body) as reply:
        assert reply.status == 200, await reply.text()
        await reply.content.readany()
        ttfb = time.monotonic() - began
        await reply.read()
    return ttfb


async def direct(client: aiohttp.ClientSession, fleet: Fleet, body: dict[str, Any]) -> float:
    prefill, decode = fleet.engine(Role.PD_PREFILL), fleet.engine(Role.PD_DECODE)
    legs = pd_body(body, fleet.addresses[Role.PD_PREFILL])

    async def prefill_leg() -> None:
        async with client.post(prefill.url + "/v1/chat/completions", json=legs) as reply:
            await reply.read()

    leg = asyncio.create_task(prefill_leg())
    ttfb = await first_byte(client, decode.url + "/v1/chat/completions", legs)
    await leg
    return ttfb


async def measure(fleet: Fleet, streams: int, requests: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"direct": [], "router": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as client:

        async def stream(index: int) -> None:
            for i in range(requests):
                body = chat(f"[bench {streams} {index} {i}] {SHORT}", stream=True)
                path = "direct" if (index + i) % 2 == 0 else "router"
                if path == "direct":
                    times[path].append(await direct(client, fleet, body))
                else:
                    times[path].append(
                        await first_byte(client, fleet.router.url + "/v1/chat/completions", body)
                    )

        await stream(-1)  # warm-up, not counted
        times = {"direct": [], "router": []}
        await asyncio.gather(*(stream(index) for index in range(streams)))
    return times


def report(streams: int, times: dict[str, list[float]]) -> None:
    def quantile(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=10)[int(q * 10) - 1] if len(values) >= 2 else values[0]

    direct_p50, router_p50 = statistics.median(times["direct"]), statistics.median(times["router"])
    print(
        f"{streams:>2} streams: direct p50 {direct_p50 * 1e3:7.1f} ms p90 {quantile(times['direct'], 0.9) * 1e3:7.1f} ms"
        f" | router p50 {router_p50 * 1e3:7.1f} ms p90 {quantile(times['router'], 0.9) * 1e3:7.1f} ms"
        f" | router/direct p50 {router_p50 / direct_p50:.2f}, added {(router_p50 - direct_p50) * 1e3:+.1f} ms"
        f" ({len(times['direct'])}+{len(times['router'])} requests)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8, help="requests per stream (both paths)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs, running_fleet(Path(logs)) as fleet:
        for streams in (1, 16):
            report(streams, asyncio.run(measure(fleet, streams, args.requests)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
