"""The router trusts nothing it is told: configs and engines that lie (issue 22).

Real router processes on loopback, real config files, misbehaving engines on raw sockets
(`faulty_engine.py`). Each broken case of the issue is a test here; each degraded one has its
bound. Only the engine that misbehaved is blamed; a refused report or config never stops the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prfaas_router.proxy import STREAM_EVENT_MARGIN
from prfaas_testbed.polling import eventually, eventually_async
from router_harness import (
    SHORT,
    Cluster,
    Router,
    RouterFactory,
    chat,
    config_doc,
    http_get,
    metric_samples,
    post,
    sample,
)
from test_router_faults import (
    CHAT_PATH,
    STRICT,
    assert_unharmed,
    breakers,
    parse_answer,
    raw_request,
    router_log,
    start_faulty,
)

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------ configs that lie

UNUSABLE_AT_START = [
    "http://127.0.0.1:99999",
    "http://127.0.0.1:abc",
    "http://\u20ac@127.0.0.1:8000",
    "http://127.0.0.1:8000\r\nX-Smuggled: 1",
]
UNUSABLE_AT_RELOAD = {
    "http://[::1:8000": "Invalid IPv6",
    "http://:30000": "host is not",
    "http://admin:s3cret@127.0.0.1:8000": "credentials",
}


@pytest.mark.parametrize("url", UNUSABLE_AT_START)
async def test_an_unusable_endpoint_url_is_refused_and_the_router_runs_on(
    url: str, cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    """Broken 1: a URL that passed validation stopped the router on every start (its health loop
    raised); one refused at hot reload left `last_error` empty."""
    bad = config_doc(cluster.prfaas, cluster.local, [{"name": "bad", "url": url}, *cluster.decode])
    router = start_router(bad, wait_ready=False)
    time.sleep(1.5)  # past the first health, load and link polls
    assert router.process.popen is not None and router.process.popen.poll() is None, router.process.log()
    page = router.config_page()
    assert page["version"] is None and "pools.decode.0.url" in page["last_error"], page

    router.write_config(config_doc(cluster.prfaas, cluster.local, cluster.decode, version=2))
    eventually(
        lambda: http_get(router.url, "/readiness")[0] == 200,
        timeout=30.0,
        interval=0.05,
        what="router ready on a good config",
    )
    for version, (later, why) in enumerate(UNUSABLE_AT_RELOAD.items(), start=3):
        doc = config_doc(
            cluster.prfaas, cluster.local, [*cluster.decode, {"name": "bad", "url": later}], version=version
        )
        router.write_config(doc)
        eventually(
            lambda why=why: why in str(router.config_page()["last_error"]),
            timeout=5,
            interval=0.05,
            what=f"refusal of {later!r}",
        )
        page = router.config_page()
        assert "pools.decode.1.url" in page["last_error"], page
        assert page["version"] == 2 and "keeping version 2" in page["last_error"], page
    answer = await post(client, router.url + CHAT_PATH, chat(SHORT))
    assert answer.status == 200, answer.body
    assert router.process.popen.poll() is None
    shown = str(router.config_page()) + router_log(router)
    assert "s3cret" not in shown and "background loop" not in shown and "Traceback" not in shown


# ------------------------------------------------------------------------------ engines that lie

DECODE_CAPACITY = {"max_running_requests": 8, "seconds_per_request": 0.1}


def loads_report(ranks: int, running: str) -> str:
    rank = (
        f'{{"dp_rank": 0, "num_running_reqs": {running}, "num_waiting_reqs": 0, "max_running_requests": 8}}'
    )
    return '{"loads": [' + ", ".join([rank] * ranks) + "]}"


async def refused_reports(client: aiohttp.ClientSession, router: Router, worker: str) -> float:
    samples = await metric_samples(client, router.url)
    return sample(samples, "prfaas_router_engine_reports_refused_total", worker=worker)


@pytest.mark.parametrize(
    "report",
    [
        loads_report(1, "1" + "0" * 400),  # 10^400 running: every request was a 500 (OverflowError)
        loads_report(100_000, "1"),  # 100000 ranks: 277 ms of event loop per poll
    ],
    ids=["huge-count", "huge-ranks"],
)
async def test_a_decode_whose_loads_lie_is_ignored_counted_and_the_others_serve(
    report: str, cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Broken 2: the liar's load is unknown (full, never idle), its report counted, nobody blamed."""
    lie = tmp_path / "loads.json"
    lie.write_text(report)
    liar = start_faulty("d-liar", "ok", "127.0.2.23", tmp_path, "--loads-file", str(lie))
    try:
        doc = config_doc(cluster.prfaas, cluster.local, [liar, *cluster.decode])
        doc["decode"] = DECODE_CAPACITY
        router = start_router(doc, *STRICT)
        await eventually_async(
            lambda: refused_reports(client, router, "d-liar"),
            timeout=10.0,
            interval=0.1,
            what="a refused report",
        )
        answers = [await post(client, router.url + CHAT_PATH, chat(f"{SHORT} {i}")) for i in range(4)]
        assert [a.status for a in answers] == [200] * 4, [a.body for a in answers]
        assert {a.headers.get("x-prfaas-route") for a in answers} <= {"local", "prfaas"}
        assert breakers(router)["d-liar"] == "closed"  # a bad report is no failed request
        await assert_unharmed(client, router, ["p0", "l0", "d0"])
        assert "Traceback" not in router_log(router)
    finally:
        liar.process.stop()


# ------------------------------------------------------------------------------ clients' bytes


@pytest.mark.parametrize("key", [b"\xff\xfe", b"caf\xe9", b"k" * 8000], ids=["not-utf8", "latin1", "8kb"])
async def test_any_session_key_bytes_route_with_several_replicas(
    key: bytes, cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    """Broken 3: a session key that is not UTF-8 was a 500 and a traceback per request."""
    doc = config_doc(
        cluster.prfaas,
        cluster.local,
        cluster.decode,
        session_affinity_header="X-Session-Id",
        router_replicas=2,
    )
    router = start_router(doc, *STRICT)
    body = json.dumps(chat(SHORT)).encode()
    head = (
        b"POST " + CHAT_PATH.encode() + b" HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nX-Session-Id: " + key + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    for _ in range(2):  # the second turn finds the session's pin
        status, _, answer = parse_answer(await raw_request(router, head + body))
        assert status == 200, answer
    assert "Traceback" not in router_log(router)
    await assert_unharmed(client, router, ["p0", "l0", "d0"])


@contextlib.asynccontextmanager
async def blamed_alone(
    fault: str,
    host: str,
    cluster: Cluster,
    start_router: RouterFactory,
    client: aiohttp.ClientSession,
    logs: Path,
    *flags: str,
) -> AsyncIterator[Router]:
    """A router whose first decode misbehaves with `fault`; after the block that decode's breaker
    is open, no healthy engine was blamed, and a normal request is served."""
    sick = start_faulty("d-sick", fault, host, logs)
    try:
        router = start_router(
            config_doc(cluster.prfaas, cluster.local, [sick, *cluster.decode]), *STRICT, *flags
        )
        yield router
        assert breakers(router)["d-sick"] == "open"
        await assert_unharmed(client, router, ["p0", "l0", "d0"])
    finally:
        sick.process.stop()


# ------------------------------------------------------------------------------ answers that lie


async def test_a_decode_answering_3xx_is_blamed_alone(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Broken 7: a 302 counted as success, so the healthy prefill was blamed and ejected."""
    async with blamed_alone("302", "127.0.2.24", cluster, start_router, client, tmp_path) as router:
        answers = [await post(client, router.url + CHAT_PATH, chat(f"{SHORT} {i}")) for i in range(3)]
        assert [a.status for a in answers] == [200] * 3, [a.body for a in answers]


async def test_a_prefill_answering_3xx_is_blamed_alone(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Broken 7: a prefill's 302 got every decode ejected and all traffic 503."""
    sick = start_faulty("l-sick", "302", "127.0.2.25", tmp_path, prefill=True)
    try:
        router = start_router(config_doc(cluster.prfaas, [sick], cluster.decode), *STRICT)
        answers = [await post(client, router.url + CHAT_PATH, chat(f"{SHORT} {i}")) for i in range(3)]
        assert [a.status for a in answers] == [200] * 3, [a.body for a in answers]
        assert breakers(router)["l-sick"] == "open"
        await assert_unharmed(client, router, ["p0", "d0"])
    finally:
        sick.process.stop()


def rss_bytes(router: Router) -> int:
    """The router process's resident set (VmRSS of /proc/PID/status)."""
    assert router.process.popen is not None
    status = Path(f"/proc/{router.process.popen.pid}/status").read_text()
    (line,) = (line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


MIB = 1024 * 1024


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_answering_an_empty_200_is_blamed_and_the_request_served(
    stream: bool, cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Degraded: a decode answering 200 with an empty body was never ejected (40 of 40 clients
    got empty answers)."""
    async with blamed_alone("empty", "127.0.2.30", cluster, start_router, client, tmp_path) as router:
        answers = [
            await post(client, router.url + CHAT_PATH, chat(f"{SHORT} {i}", stream=stream)) for i in range(3)
        ]
        assert [a.status for a in answers] == [200] * 3, [a.body for a in answers]
        assert all(a.body for a in answers)


async def test_a_stream_past_its_token_limit_is_ended_as_its_decodes_failure(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Degraded: a stream's length was not bounded (974 events for `max_tokens: 5`, and on)."""
    async with blamed_alone(
        "endless-stream", "127.0.2.31", cluster, start_router, client, tmp_path
    ) as router:
        answer = await post(client, router.url + CHAT_PATH, chat(SHORT, stream=True, max_tokens=5))
        assert answer.status == 200
        tokens = [e for e in answer.body if isinstance(e, dict) and "choices" in e]
        assert len(tokens) <= 5 + STREAM_EVENT_MARGIN + 1, len(tokens)  # the begun event finished
        assert answer.body[-1]["error"]["code"] == "decode_failed", answer.body[-1]
        assert "token events" in answer.body[-1]["error"]["message"]


async def test_a_stream_past_its_time_limit_is_ended_as_its_decodes_failure(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """A stream still going at `--max-stream-seconds` (here a decode that sent one token and then
    nothing, under the 3 s read timeout) is ended with an error event and its decode blamed."""
    limit = ("--max-stream-seconds", "1")
    async with blamed_alone("stall", "127.0.2.40", cluster, start_router, client, tmp_path, *limit) as router:
        started = time.monotonic()
        answer = await post(client, router.url + CHAT_PATH, chat(SHORT, stream=True))
        assert answer.status == 200
        assert 1.0 <= time.monotonic() - started < 3.0, "ended by the stream limit, not the read timeout"
        assert answer.body[-1]["error"]["code"] == "decode_failed", answer.body[-1]
        assert "1.0 s limit" in answer.body[-1]["error"]["message"]


async def test_an_endless_answer_is_cut_at_the_cap_and_its_decode_blamed(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Broken 5: an endless non-streamed body grew the router by about 6 MB/s until the client left."""
    cap = ("--max-answer-bytes", str(4 * MIB))
    async with blamed_alone("endless", "127.0.2.26", cluster, start_router, client, tmp_path, *cap) as router:
        before = rss_bytes(router)
        answer = await post(client, router.url + CHAT_PATH, chat(SHORT))
        assert answer.status == 200, answer.body  # retried on the healthy decode
        assert rss_bytes(router) - before < 24 * MIB


async def test_a_huge_metrics_page_is_refused_without_stalling_the_router(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Broken 6: a 20 MiB /metrics page of a PrfaaS prefill froze the router up to 21.6 s a poll."""
    page = tmp_path / "metrics.txt"
    line = 'sglang:kv_transfer_total_mb_bucket{engine_type="prefill",le="1.0",tp_rank="%d"} 1.0\n'
    page.write_text("".join(line % rank for rank in range(20 * MIB // len(line))))
    liar = start_faulty("p-liar", "ok", "127.0.1.26", tmp_path, "--metrics-file", str(page), prefill=True)
    try:
        router = start_router(config_doc([liar, *cluster.prfaas], cluster.local, cluster.decode), *STRICT)
        slowest = 0.0
        deadline = time.monotonic() + 3.0  # three link polls
        while time.monotonic() < deadline:
            started = time.monotonic()
            async with client.get(router.url + "/liveness") as reply:
                assert reply.status == 200
            slowest = max(slowest, time.monotonic() - started)
            await asyncio.sleep(0.02)
        assert slowest < 0.25, slowest
        assert await refused_reports(client, router, "p-liar") >= 2
        await assert_unharmed(client, router, ["p0", "l0", "d0"])
    finally:
        liar.process.stop()


# ------------------------------------------------------------------------------ memory that comes back


async def test_retried_attempts_of_large_requests_give_their_memory_back(
    start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Broken 4: 8 requests of 24 MiB retried after a decode's 500 took RSS from 70 to 782 MB for
    good (reference cycles through exceptions and frames, which the router's tuned gc thresholds
    almost never collect). The router process runs its own gc settings (`__main__._tune_gc`)."""
    prefill = start_faulty("l-ok", "ok", "127.0.2.27", tmp_path, prefill=True)
    sick = start_faulty("d-sick", "500", "127.0.2.28", tmp_path)
    well = start_faulty("d-ok", "ok", "127.0.2.29", tmp_path)
    engines = [prefill, sick, well]
    try:
        # the breaker never opens: every request meets the sick decode first, then is retried; the
        # SLO admits a 6M-token prompt whatever the failed attempt's prefill leg left queued (in CI a
        # retry once met that queue and was refused with 429 decode_wait: this test is about memory)
        doc = config_doc([], [prefill], [sick, well], slo={"ttft_seconds": 1e9, "tpot_seconds": 0.05})
        router = start_router(doc, "--breaker-failure-threshold", "1000")
        large = chat("x" * (24 * MIB))

        async def one() -> None:
            answer = await post(client, router.url + CHAT_PATH, large)
            assert answer.status == 200, answer.body

        await one()  # warm: the router's own buffers at their size
        before = rss_bytes(router)
        for _ in range(8):
            await one()
        grown = rss_bytes(router) - before
        samples = await metric_samples(client, router.url)
        assert sample(samples, "prfaas_router_upstream_retries_total", pool="decode") == 9
        assert grown < 96 * MIB, f"RSS grew {grown / MIB:.0f} MiB over 8 retried requests"
    finally:
        for engine in engines:
            engine.process.stop()


async def test_prompts_past_the_tokenizer_cap_are_estimated_and_hold_nobody_up(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Degraded: 8 prompts of 2M characters made small requests wait 12.7 s in the shared thread
    pool (RSS 1.86 GB). Past the cap a prompt is estimated from its characters, never tokenized."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    router = start_router(config_doc(cluster.prfaas, cluster.local, cluster.decode), "--tokenizer", str(path))
    huge = "hello " * (150 * 1024)  # 900 KiB: past the 256 KiB cap, within the model's context

    async def timed(content: str) -> float:
        started = time.monotonic()
        answer = await post(client, router.url + CHAT_PATH, chat(content))
        assert answer.status == 200, answer.body
        return time.monotonic() - started

    big = [asyncio.create_task(timed(huge)) for _ in range(8)]
    await asyncio.sleep(0.2)
    small = await timed(SHORT)
    await asyncio.gather(*big)
    assert small < 2.0, small
    samples = await metric_samples(client, router.url)
    # SHORT tokenized: 50 words; each huge prompt estimated at 4 characters a token
    assert sample(samples, "prfaas_router_prompt_tokens_sum") == 50 + 8 * (len(huge) // 4)


async def test_an_http10_keep_alive_stream_is_closed_at_its_end(
    cluster: Cluster, start_router: RouterFactory
) -> None:
    """Degraded: an HTTP/1.0 keep-alive stream was held open to the 30 s idle timeout (it has no
    other end than the connection's)."""
    router = start_router(config_doc(cluster.prfaas, cluster.local, cluster.decode))
    body = json.dumps(chat(SHORT, stream=True)).encode()
    head = (
        b"POST " + CHAT_PATH.encode() + b" HTTP/1.0\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    started = time.monotonic()
    raw = await raw_request(router, head + body, read_seconds=10.0)
    assert time.monotonic() - started < 3.0
    assert raw.startswith(b"HTTP/1.") and b" 200 " in raw.split(b"\r\n", 1)[0], raw[:200]
    assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]


SOAK_ROUNDS = 60
SOAK_SECONDS = 90.0


async def test_a_soak_of_retries_large_answers_and_bad_reports_keeps_rss_flat(
    start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Done means: a bounded soak (SOAK_ROUNDS requests, SOAK_SECONDS at most) keeps the router's
    RSS flat. Every 4 MiB request meets a decode answering 500, then one whose answer never ends
    (cut at the cap), then a decode whose /v1/loads lies (10^400 running, polled every 0.1 s)."""
    lie = tmp_path / "loads.json"
    lie.write_text(loads_report(1, "1" + "0" * 400))
    engines = [
        start_faulty("l-ok", "ok", "127.0.2.32", tmp_path, prefill=True),
        start_faulty("d-sick", "500", "127.0.2.33", tmp_path),
        start_faulty("d-endless", "endless", "127.0.2.34", tmp_path),
        start_faulty("d-liar", "ok", "127.0.2.35", tmp_path, "--loads-file", str(lie)),
    ]
    try:
        prefill, *decodes = engines
        doc = config_doc([], [prefill], decodes)
        doc["decode"] = DECODE_CAPACITY
        router = start_router(
            doc,
            "--breaker-failure-threshold",
            "100000",
            "--max-answer-bytes",
            str(4 * MIB),
            "--load-poll-interval-seconds",
            "0.1",
        )
        request = chat("y" * (4 * MIB))
        deadline = time.monotonic() + SOAK_SECONDS
        rss: list[int] = []
        for round_ in range(SOAK_ROUNDS):
            assert time.monotonic() < deadline, f"the soak took over {SOAK_SECONDS} s at round {round_}"
            answer = await post(client, router.url + CHAT_PATH, request)
            assert answer.status == 200, answer.body
            rss.append(rss_bytes(router))
        warm = rss[SOAK_ROUNDS // 6]
        grown = max(rss[SOAK_ROUNDS // 6 :]) - warm
        assert grown < 32 * MIB, f"RSS grew {grown / MIB:.0f} MiB after warm-up: {[r // MIB for r in rss]}"
        samples = await metric_samples(client, router.url)
        assert sample(samples, "prfaas_router_upstream_retries_total", pool="decode") == 2 * SOAK_ROUNDS
        assert sample(samples, "prfaas_router_engine_reports_refused_total", worker="d-liar") > 0
    finally:
        for engine in engines:
            engine.process.stop()
