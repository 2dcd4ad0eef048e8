"""The load generator of `bench_router.py`: one phase of load against one path, in its own process.

Runs apart from the routers and the engines so that its CPU is its own, and prints one JSON
document of raw samples on stdout. Bounded: it stops starting requests at the deadline, and
every request has a timeout.

    python benchmarks/router_loadgen.py '<json spec>'

Paths: `router` sends each request once to a router URL (ours or SMG); `direct` plays the
router itself, as SGLang's PD protocol has it: the same body plus `bootstrap_host`,
`bootstrap_port` and a random `bootstrap_room`, POSTed to the prefill and the decode at once,
the decode's answer being the answer. A request is ok only when its answer is complete: HTTP
200 and the requested number of completion tokens, or, streamed, every token event and
`[DONE]`. `concurrency` streams each send one request after another (closed loop); stream i
starts `i * stagger / concurrency` seconds late, so long requests do not all start together.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

_FILLER = "".join(f"w{i:04d} " for i in range(100000))  # distinct words: no accidental block repeats


@dataclass(frozen=True)
class Target:
    kind: str  # "router" or "direct"
    url: str = ""  # router
    prefill: str = ""  # direct
    decode: str = ""  # direct
    bootstrap_host: str = ""
    bootstrap_port: int = 0


@dataclass(frozen=True)
class Spec:
    target: Target
    path: str
    prompt_chars: int
    max_tokens: int
    stream: bool
    concurrency: int
    seconds: float  # requests start until this long after the origin
    stagger: float  # stream i starts i * stagger / concurrency seconds after the origin
    tag: str  # makes prompts unique across phases


@dataclass
class Result:
    """Times are seconds after the origin: [start, first body bytes or None, end, SSE events]."""

    requests: list[list[float | int | None]] = field(default_factory=list)
    errors: list[list[float]] = field(default_factory=list)  # [start, end]
    error_samples: list[str] = field(default_factory=list)


def body_for(spec: Spec, index: int) -> bytes:
    head = f"[{spec.tag}-{index}] "
    text = head + _FILLER[: max(0, spec.prompt_chars - len(head))]
    body: dict[str, Any] = {"model": "bench-model", "max_tokens": spec.max_tokens, "stream": spec.stream}
    if spec.path == "/generate":
        body = {"text": text, "sampling_params": {"max_new_tokens": spec.max_tokens}, "stream": spec.stream}
    elif spec.path == "/v1/completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    return json.dumps(body).encode()


class Runner:
    def __init__(self, spec: Spec, session: aiohttp.ClientSession) -> None:
        self.spec = spec
        self.session = session
        self.result = Result()
        self._next = 0
        self._headers = {"Content-Type": "application/json"}
        self._expected_events = spec.max_tokens + 1  # token events plus [DONE] at the least
        self._origin = 0.0

    async def one(self) -> None:
        spec = self.spec
        body = body_for(spec, self._next)
        self._next += 1
        started = time.perf_counter()
        first: float | None = None
        try:
            if spec.target.kind == "direct":
                first, status, data = await self._direct(body)
            else:
                first, status, data = await self._post(spec.target.url + spec.path, body)
            done = time.perf_counter()
            problem = self._check(status, data)
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            done, problem, data = time.perf_counter(), repr(err), b""
        origin = self._origin
        if problem is not None:
            self.result.errors.append([started - origin, done - origin])
            if len(self.result.error_samples) < 5:
                self.result.error_samples.append(problem[:300])
            return
        events = data.count(b"data: ") if spec.stream else 0
        self.result.requests.append(
            [started - origin, None if first is None else first - origin, done - origin, events]
        )

    async def _post(self, url: str, body: bytes) -> tuple[float | None, int, bytes]:
        async with self.session.post(url, data=body, headers=self._headers) as reply:
            if not self.spec.stream or reply.status != 200:
                return None, reply.status, await reply.read()
            parts = []
            first: float | None = None
            async for chunk in reply.content.iter_any():
                if first is None:
                    first = time.perf_counter()
                parts.append(chunk)
            return first, reply.status, b"".join(parts)

    async def _direct(self, body: bytes) -> tuple[float | None, int, bytes]:
        target = self.spec.target
        fields = (
            f',"bootstrap_host":"{target.bootstrap_host}","bootstrap_port":{target.bootstrap_port},'
            f'"bootstrap_room":{random.getrandbits(63)}}}'
        )
        payload = body[:-1] + fields.encode()
        prefill = asyncio.ensure_future(self._drain(target.prefill + self.spec.path, payload))
        try:
            return await self._post(target.decode + self.spec.path, payload)
        finally:  # the answer is the decode's; the prefill's reply is drained, as a router does
            await prefill

    async def _drain(self, url: str, payload: bytes) -> None:
        async with self.session.post(url, data=payload, headers=self._headers) as reply:
            await reply.read()

    def _check(self, status: int, data: bytes) -> str | None:
        if status != 200:
            return f"HTTP {status}: {data[:200]!r}"
        if self.spec.stream:
            events = data.count(b"data: ")
            if events < self._expected_events or not data.rstrip().endswith(b"data: [DONE]"):
                return f"incomplete stream: {events} events, tail {data[-120:]!r}"
            return None
        answer = json.loads(data)
        usage = answer.get("usage") or answer.get("meta_info") or {}
        if usage.get("completion_tokens") != self.spec.max_tokens:
            return f"expected {self.spec.max_tokens} completion tokens, got {usage!r}"[:300]
        return None

    async def run(self) -> Result:
        spec = self.spec
        self._origin = time.perf_counter()
        deadline = self._origin + spec.seconds

        async def stream(slot: int) -> None:
            await asyncio.sleep(slot * spec.stagger / spec.concurrency)
            while time.perf_counter() < deadline:
                await self.one()

        await asyncio.gather(*(stream(slot) for slot in range(spec.concurrency)))
        return self.result


async def run(spec: Spec) -> Result:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=60, connect=5)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        return await Runner(spec, session).run()


def parse_spec(text: str) -> Spec:
    raw = json.loads(text)
    raw["target"] = Target(**raw["target"])
    return Spec(**raw)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    spec = parse_spec(argv[1])
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(run(spec))
    else:
        result = uvloop.run(run(spec))
    json.dump(asdict(result), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
