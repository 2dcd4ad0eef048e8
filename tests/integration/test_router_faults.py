"""The router under faults and hostile clients: real processes, real sockets, on loopback.

Misbehaving engines are `faulty_engine.py` processes beside healthy fake engines; hostile
clients speak raw bytes to the router's port. Routers run with a breaker that opens at the first
failure, so any failure wrongly counted against a healthy engine shows as an open breaker. After
every fault: the healthy engines' breakers are closed, no failure was counted against them, and
a normal request is served.

The healthy engines give up on a KV handoff after 0.5 s, under the router's read timeout (3 s),
as SGLang's do in production (minutes, under the router's 600 s): a peer that hangs is then
reported by its healthy partner before the router's own timeout would have to guess.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prfaas_testbed.polling import eventually, eventually_async
from prfaas_testbed.ports import free_port
from router_harness import (
    LONG,
    SHORT,
    Cluster,
    Engine,
    Process,
    Router,
    RouterFactory,
    chat,
    config_doc,
    healthy_cluster,
    http_get,
    metric_samples,
    post,
    sample,
    start_engine,
    wait_healthy,
)

pytestmark = pytest.mark.timeout(120)

STRICT = (
    "--breaker-failure-threshold",
    "1",
    "--breaker-cooldown-seconds",
    "60",
    "--read-timeout-seconds",
    "3",
)
QUICK_KV = ("--bootstrap-timeout", "0.5")
HEALTHY = ["p0", "l0", "d0"]
FAULTY_ENGINE = Path(__file__).with_name("faulty_engine.py")
CHAT_PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Healthy engines that report a failed KV handoff after 0.5 s (this module's own)."""
    with healthy_cluster(tmp_path_factory.mktemp("engines"), *QUICK_KV) as engines:
        yield engines


def strict_router(start_router: RouterFactory, cluster: Cluster, *flags: str) -> Router:
    """A router in front of the healthy engines alone, its breakers opening at the first failure."""
    return start_router(config_doc(cluster.prfaas, cluster.local, cluster.decode), *STRICT, *flags)


def start_faulty(
    name: str,
    fault: str,
    host: str,
    logs: Path,
    *extra: str,
    prefill: bool = False,
    busy: float = 2.0,
) -> Engine:
    """A `faulty_engine.py` process; `extra` are more of its flags."""
    port = free_port(host)
    bootstrap = free_port(host) if prefill else None
    args = [
        str(FAULTY_ENGINE),
        "--host",
        host,
        "--port",
        str(port),
        "--fault",
        fault,
        "--busy-seconds",
        str(busy),
        *extra,
    ]
    if bootstrap is not None:
        args += ["--bootstrap-port", str(bootstrap)]
    engine = Engine(name, f"http://{host}:{port}", bootstrap, Process(args, logs / f"{name}.log").start())
    eventually(
        lambda: socket.create_connection((host, port), 1).close() is None,
        timeout=30.0,
        interval=0.05,
        what=f"faulty engine {name}",
    )
    return engine


def breakers(router: Router) -> dict[str, str]:
    return {worker["name"]: worker["breaker"] for worker in router.config_page()["workers"]}


async def assert_unharmed(client: aiohttp.ClientSession, router: Router, healthy: Sequence[str]) -> None:
    """No healthy engine was blamed, and a normal request is served."""
    states = breakers(router)
    assert {name: states[name] for name in healthy} == dict.fromkeys(healthy, "closed"), states
    samples = await metric_samples(client, router.url)
    blamed = {name: sample(samples, "prfaas_router_engine_failures_total", worker=name) for name in healthy}
    assert blamed == dict.fromkeys(healthy, 0.0)
    normal = await post(client, router.url + CHAT_PATH, chat(SHORT))
    assert normal.status == 200, normal.body


async def raw_request(router: Router, data: bytes, *, read_seconds: float = 5.0) -> bytes:
    """Sends raw bytes to the router and reads until it closes (or `read_seconds` pass)."""
    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        received = b""
        deadline = time.monotonic() + read_seconds
        while time.monotonic() < deadline:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
        return received
    finally:
        writer.close()


def parse_answer(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


def assert_error_shape(body: Any, param: str | None = None) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert isinstance(error["code"], str) and error["param"] == param, error


async def prefill_gave_up(client: aiohttp.ClientSession, prefill: Engine) -> float:
    """The requests a prefill engine ended without handing its KV over (aborted or timed out)."""
    samples = await metric_samples(client, prefill.url)
    return sample(samples, "sglang:num_aborted_requests_total") + sample(
        samples, "sglang:num_bootstrap_failed_reqs_total"
    )


def failed_event(event: Any) -> bool:
    """An SSE event that fails its stream: an OpenAI error event, or /generate's aborted output."""
    if not isinstance(event, dict):
        return False
    finish = event.get("meta_info", {}).get("finish_reason")
    return "error" in event or (isinstance(finish, dict) and finish.get("type") == "abort")


def router_log(router: Router) -> str:
    return router.process.log_path.read_text(errors="replace")


# ------------------------------------------------------------------------------ engines that fail


@pytest.mark.parametrize("fault", ["500", "garbage", "truncated", "hang"])
async def test_a_failing_decode_is_ejected_and_its_prefills_are_not(
    fault: str, cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sick = start_faulty("d-sick", fault, "127.0.2.21", tmp_path)
    try:
        # first in the list: the least-loaded choice takes it until its breaker opens
        router = start_router(config_doc(cluster.prfaas, cluster.local, [sick, *cluster.decode]), *STRICT)
        answers = [
            await post(client, router.url + CHAT_PATH, chat(f"{SHORT} {index}", stream=index % 2 == 1))
            for index in range(4)
        ]
        assert [answer.status for answer in answers] == [200] * 4, [a.body for a in answers]
        assert breakers(router)["d-sick"] == "open"
        samples = await metric_samples(client, router.url)
        assert sample(samples, "prfaas_router_engine_failures_total", worker="d-sick") == 1
        assert sample(samples, "prfaas_router_upstream_retries_total", pool="decode") == 1
        await assert_unharmed(client, router, HEALTHY)
    finally:
        sick.process.stop()


@pytest.mark.parametrize("fault", ["500", "garbage", "truncated", "hang"])
async def test_a_failing_prefill_is_ejected_and_its_decode_is_not(
    fault: str, cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sick = start_faulty("l-sick", fault, "127.0.2.22", tmp_path, prefill=True)
    try:
        router = start_router(config_doc(cluster.prfaas, [sick], cluster.decode), *STRICT)
        answer = await post(client, router.url + CHAT_PATH, chat(SHORT))
        assert answer.status == 200, answer.body
        assert answer.headers["x-prfaas-route"] == "prfaas"  # retried on the other cluster's prefill
        assert breakers(router)["l-sick"] == "open"
        await assert_unharmed(client, router, ["p0", "d0"])
    finally:
        sick.process.stop()


async def test_a_decode_cut_mid_stream_ends_the_stream_in_shape_and_its_drained_prefill_is_not_blamed(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # the prefill gives up on the KV nobody pulls after 0.5 s: its leg, drained after the stream
    # ended, then fails; that is the decode's doing
    prefill = cluster.local[0]
    cut = start_faulty("d-cut", "cut", "127.0.2.24", tmp_path)
    given_up_before = await prefill_gave_up(client, prefill)
    try:
        router = start_router(config_doc(cluster.prfaas, cluster.local, [cut, *cluster.decode]), *STRICT)
        streamed = await post(client, router.url + CHAT_PATH, chat(SHORT, stream=True))
        assert streamed.status == 200
        error = streamed.body[-1]["error"]
        assert error["code"] == "decode_failed" and error["type"] == "upstream_error"
        assert_error_shape(streamed.body[-1])

        async def prefill_leg_ended() -> bool:
            return await prefill_gave_up(client, prefill) != given_up_before

        await eventually_async(prefill_leg_ended, timeout=10, interval=0.1, what="the prefill leg to end")
        await asyncio.sleep(0.3)  # its answer reaches the router
        assert breakers(router)["d-cut"] == "open"
        await assert_unharmed(client, router, HEALTHY)
    finally:
        cut.process.stop()


async def test_an_abort_after_the_stream_started_reaches_the_client_and_counts_against_the_decode(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    late = start_faulty("d-abort", "abort", "127.0.2.33", tmp_path)
    try:
        router = start_router(config_doc(cluster.prfaas, cluster.local, [late]), *STRICT)
        streamed = await post(client, router.url + CHAT_PATH, chat(SHORT, stream=True))
        assert streamed.status == 200
        assert streamed.body[0]["choices"][0]["delta"]["content"] == " a"  # it had reached the client
        assert streamed.body[1]["error"]["type"] == "INTERNAL_SERVER_ERROR" and streamed.body[2] == "[DONE]"
        samples = await metric_samples(client, router.url)
        assert sample(samples, "prfaas_router_requests_total", route="local", outcome="stream_error") == 1
        assert sample(samples, "prfaas_router_requests_total", route="local", outcome="ok") == 0
        assert sample(samples, "prfaas_router_engine_failures_total", worker="d-abort") == 1
        assert sample(samples, "prfaas_router_upstream_retries_total", pool="decode") == 0  # no retry
        await asyncio.sleep(1.0)  # the prefill's KV was never pulled: its leg ends, not its failure
        assert breakers(router) == {"p0": "closed", "l0": "closed", "d-abort": "open"}
        samples = await metric_samples(client, router.url)
        assert sample(samples, "prfaas_router_engine_failures_total", worker="l0") == 0
    finally:
        late.process.stop()


@pytest.mark.parametrize("path", [CHAT_PATH, "/v1/completions", "/generate"])
async def test_a_handoff_abort_before_the_first_token_is_retried_and_counted_against_the_prefill(
    path: str, cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """SGLang's decode reports a transfer its prefill failed as a 200 whose first event is the
    error (on /generate, the output with an abort finish_reason); nothing has reached the
    client, so another prefill serves it."""
    failing = start_engine(
        "l-fail", "prefill", "127.0.2.34", "h20", tmp_path, *QUICK_KV, "--fail-kv-transfers", "1"
    )
    try:
        wait_healthy(failing)
        router = start_router(config_doc(cluster.prfaas, [failing], cluster.decode), *STRICT)
        body: dict[str, Any] = {"model": "kimi-fake", "stream": True}
        if path == CHAT_PATH:
            body = chat(SHORT, stream=True)
        elif path == "/generate":
            body = {"text": SHORT, "sampling_params": {"max_new_tokens": 4}, "stream": True}
        else:
            body |= {"prompt": SHORT, "max_tokens": 4}
        streamed = await post(client, router.url + path, body)
        assert streamed.status == 200
        assert not any(failed_event(event) for event in streamed.body), streamed.body
        assert streamed.headers["x-prfaas-route"] == "prfaas"  # retried on the other cluster's prefill
        samples = await metric_samples(client, router.url)
        assert sample(samples, "prfaas_router_engine_failures_total", worker="l-fail") == 1
        assert sample(samples, "prfaas_router_upstream_retries_total", pool="local_prefill") == 1
        assert breakers(router)["l-fail"] == "open"
        await assert_unharmed(client, router, ["p0", "d0"])
    finally:
        failing.process.stop()


async def test_an_engine_refusal_comes_back_in_the_routers_error_shape(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    refusing = start_faulty("d-413", "413", "127.0.2.25", tmp_path)
    try:
        router = start_router(config_doc(cluster.prfaas, cluster.local, [refusing]), *STRICT)
        answer = await post(client, router.url + CHAT_PATH, chat(SHORT))
        assert answer.status == 413 and answer.headers["content-type"].startswith("application/json")
        assert_error_shape(answer.body)
        assert answer.body["error"]["code"] == "engine_payload_too_large"
        assert "Request Entity Too Large" in answer.body["error"]["message"]
        assert (answer.headers["x-prfaas-route"], answer.headers["x-prfaas-reason"]) == (
            "local",
            "short_uncached",
        )
        assert breakers(router)["d-413"] == "closed"  # a refusal is an answer, not a failure
    finally:
        refusing.process.stop()


async def test_a_decode_busy_with_long_answers_is_kept_through_slow_health_checks(
    start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    prefill = start_faulty("l-ok", "ok", "127.0.2.26", tmp_path, prefill=True)
    busy = start_faulty("d-busy", "busy", "127.0.2.27", tmp_path, busy=2.5)
    try:
        router = start_router(config_doc([], [prefill], [busy]), *STRICT)
        request = asyncio.create_task(post(client, router.url + CHAT_PATH, chat(SHORT)))
        while not request.done():  # its health checks time out (1 s) for 2.5 s; it stays in
            states = {w["name"]: w["available"] for w in router.config_page()["workers"]}
            assert states["d-busy"], "a busy decode was ejected by a slow health check"
            await asyncio.sleep(0.1)
        assert (await request).status == 200
        await assert_unharmed(client, router, ["l-ok", "d-busy"])
    finally:
        busy.process.stop()
        prefill.process.stop()


async def test_a_decode_busy_for_another_replica_is_slow_to_this_one_and_still_serves_it(
    start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Two router replicas, one decode: busy with the first's request, it answers the second's
    health checks late, and the second (nothing in flight there) ejects it (at its first
    timeout here, to see it within the request). With no other decode the second still sends to
    it, as a last resort, instead of answering 503."""
    prefill = start_faulty("l-ok", "ok", "127.0.2.28", tmp_path, prefill=True)
    busy = start_faulty("d-busy", "busy", "127.0.2.29", tmp_path, busy=2.5)
    try:
        doc = config_doc([], [prefill], [busy])
        quick = ("--health-timeout-seconds", "0.5", "--health-failure-threshold", "1")
        first, second = start_router(doc, *STRICT), start_router(doc, *STRICT, *quick)
        request = asyncio.create_task(post(client, first.url + CHAT_PATH, chat(SHORT)))

        def ejected() -> bool:
            return not next(w for w in second.config_page()["workers"] if w["name"] == "d-busy")["available"]

        while not ejected():
            assert not request.done(), "the second replica never saw the decode's health check time out"
            await asyncio.sleep(0.05)
        status, body = http_get(second.url, "/readiness")
        assert status == 200 and json.loads(body)["routable_workers"]["decode"] == 1, body
        answer = await post(client, second.url + CHAT_PATH, chat(SHORT))
        assert answer.status == 200, answer.body
        assert (await request).status == 200
        await assert_unharmed(client, second, ["l-ok", "d-busy"])
    finally:
        busy.process.stop()
        prefill.process.stop()


# ------------------------------------------------------------------------------ hostile clients


async def test_request_ids_that_are_not_short_ascii_are_replaced_and_break_nothing(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = strict_router(start_router, cluster)
    body = json.dumps(chat(SHORT)).encode()
    for request_id in ("é€".encode(), b"x" * 200, b"tab\tin-it"):
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        head += b"X-Request-Id: " + request_id + b"\r\nConnection: close\r\n"
        raw = await raw_request(router, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        status, headers, answer = parse_answer(raw)
        assert status == 200, answer
        assert len(headers["x-request-id"]) == 32 and headers["x-request-id"] != request_id.decode("latin-1")
    kept = await post(client, router.url + CHAT_PATH, chat(SHORT), **{"X-Request-Id": "req-ok_1.2"})
    assert kept.status == 200 and kept.headers["x-request-id"] == "req-ok_1.2"
    await assert_unharmed(client, router, HEALTHY)


async def test_counts_and_lengths_past_the_bounds_are_refused_at_once_naming_the_field(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = strict_router(start_router, cluster, "--max-context-tokens", "4096")
    cases: list[tuple[str, dict[str, Any], str, str]] = [
        (CHAT_PATH, chat(SHORT, n=2_000_000), "n", "invalid_value"),
        ("/v1/completions", {"prompt": ["a"] * 2000, "max_tokens": 1}, "prompt", "batch_too_large"),
        ("/v1/completions", {"prompt": ["a"] * 20, "n": 100}, "n", "batch_too_large"),
        ("/generate", {"input_ids": [[1]] * 2000}, "input_ids", "batch_too_large"),
        ("/generate", {"text": "a", "sampling_params": {"n": 10**6}}, "sampling_params.n", "invalid_value"),
        (CHAT_PATH, chat(SHORT, max_tokens=10**9), "max_tokens", "context_length_exceeded"),
        (
            "/generate",
            {"input_ids": list(range(4000)), "sampling_params": {"max_new_tokens": 100}},
            "sampling_params.max_new_tokens",
            "context_length_exceeded",
        ),
    ]
    for path, body, param, code in cases:
        started = time.monotonic()
        answer = await post(client, router.url + path, body)
        took = time.monotonic() - started
        assert answer.status == 400, (param, answer.body)
        assert_error_shape(answer.body, param)
        assert answer.body["error"]["code"] == code
        assert (answer.headers["x-prfaas-route"], answer.headers["x-prfaas-reason"]) == ("none", "none")
        assert took < 0.5, f"{param}: {took:.2f} s"
    await assert_unharmed(client, router, HEALTHY)


async def test_a_client_that_stops_reading_a_stream_is_cut_off_without_blaming_the_decode(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # a decode with near-zero steps: its tokens fill every buffer to the client within a second or two
    decode = start_engine("d-flood", "decode", "127.0.2.28", "h20", tmp_path, *QUICK_KV, time_scale="0.001")
    try:
        wait_healthy(decode)
        router = start_router(
            config_doc(cluster.prfaas, cluster.local, [decode]), *STRICT, "--client-stall-seconds", "1"
        )
        host, port = router.url.removeprefix("http://").split(":")
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the router must buffer
        reader.connect((host, int(port)))
        try:
            body = json.dumps(chat(SHORT, stream=True, max_tokens=250_000)).encode()
            reader.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
            )

            async def stalled() -> float:
                samples = await metric_samples(client, router.url)
                return sample(samples, "prfaas_router_requests_total", outcome="client_stalled")

            await eventually_async(  # it never reads: cut off after 1 s without progress
                stalled,
                timeout=20,
                interval=0.2,
                what="a client_stalled request",
                seen=lambda: router_log(router)[-2000:],
            )
        finally:
            reader.close()

        async def aborted() -> float:
            return sample(await metric_samples(client, decode.url), "sglang:num_aborted_requests_total")

        await eventually_async(  # 250000 tokens take it far longer than 10 s
            aborted, timeout=10, interval=0.1, what="the decode to see the request aborted"
        )
        await asyncio.sleep(3.5)  # past the read timeout: the paused leg was not failed by it
        await assert_unharmed(client, router, ["p0", "l0", "d-flood"])
        assert "read nothing" in router_log(router)
    finally:
        decode.process.stop()


async def test_malformed_and_oversized_requests_get_json_errors_and_one_log_line_each(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = strict_router(start_router, cluster)
    huge = b"GET /v1/models HTTP/1.1\r\nHost: r\r\nX-Big: " + b"b" * 20_000 + b"\r\n\r\n"
    broken = b"GET /v1/models HTTP/1.1\r\nHost: r\r\nno colon here\r\n\r\n"
    for _ in range(10):
        for data, status, code in ((huge, 431, "header_too_large"), (broken, 400, "malformed_request")):
            answered, headers, body = parse_answer(await raw_request(router, data))
            assert answered == status, body
            assert_error_shape(body)
            assert body["error"]["code"] == code
            assert (headers["x-prfaas-route"], headers["x-prfaas-reason"]) == ("none", "none")
    await assert_unharmed(client, router, HEALTHY)
    log = router_log(router)
    assert "Traceback" not in log and log.count("malformed HTTP from 127.0.0.1") == 1, log[-2000:]
    samples = await metric_samples(client, router.url)
    assert sample(samples, "prfaas_router_client_refusals_total", reason="malformed_http") == 20


async def test_idle_and_half_sent_requests_are_closed_and_slow_bodies_refused(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = strict_router(
        start_router,
        cluster,
        "--client-idle-timeout-seconds",
        "1",
        "--client-body-timeout-seconds",
        "1",
    )
    started = time.monotonic()
    idle, slowloris = await asyncio.gather(
        raw_request(router, b"", read_seconds=10),
        raw_request(router, b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nX-A: 1", read_seconds=10),
    )
    assert (idle, slowloris) == (b"", b"")  # closed by the router, without an answer
    assert time.monotonic() - started < 5
    slow_body = b'POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 100\r\n\r\n{"mess'
    status, headers, body = parse_answer(await raw_request(router, slow_body, read_seconds=10))
    assert status == 408 and body["error"]["code"] == "body_timeout"
    assert headers["connection"] == "close"
    await assert_unharmed(client, router, HEALTHY)


async def test_past_the_connection_limit_clients_get_a_503_with_retry_after(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = strict_router(start_router, cluster, "--max-client-connections", "4")
    host, port = router.url.removeprefix("http://").split(":")
    held = [await asyncio.open_connection(host, int(port)) for _ in range(4)]
    try:
        await asyncio.sleep(0.2)
        status, headers, body = parse_answer(
            await raw_request(router, b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n")
        )
        assert status == 503 and headers["retry-after"] == "1"
        assert_error_shape(body)
        assert body["error"]["code"] == "too_many_connections"
        assert "refusing a client" in router_log(router)
    finally:
        for _, writer in held:
            writer.close()
    await asyncio.sleep(0.3)
    await assert_unharmed(client, router, HEALTHY)
    samples = await metric_samples(client, router.url)
    assert sample(samples, "prfaas_router_client_refusals_total", reason="connection_limit") == 1


async def test_every_error_carries_the_route_headers_and_unavailability_says_when_to_return(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    nowhere = {"name": "d-missing", "url": f"http://127.0.2.99:{free_port('127.0.2.99')}"}
    router = start_router(config_doc(cluster.prfaas, cluster.local, [nowhere]), wait_ready=False)
    answer = await post(client, router.url + CHAT_PATH, chat(LONG))
    assert answer.status == 503 and answer.headers["retry-after"] == "1"
    assert (answer.headers["x-prfaas-route"], answer.headers["x-prfaas-reason"]) == ("none", "no_decode")
    bad = await post(client, router.url + CHAT_PATH, b"{")
    assert bad.status == 400 and bad.headers["x-prfaas-route"] == "none" and "retry-after" not in bad.headers
    assert_error_shape(bad.body)


async def test_a_config_reusing_the_version_in_force_with_other_content_is_refused(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    doc = config_doc(cluster.prfaas, cluster.local, cluster.decode)
    router = start_router(doc)
    router.write_config(doc | {"threshold_tokens": 5})
    page = await eventually_async(
        lambda: (page := router.config_page())["last_error"] is not None and page,
        timeout=5,
        interval=0.05,
        what="a refusal on the config page",
    )
    assert "version 1 is already in force with different content" in page["last_error"]
    assert page["threshold_tokens"] == doc["threshold_tokens"]
    streamed = await post(client, router.url + CHAT_PATH, chat(SHORT, stream=True))
    assert streamed.status == 200 and streamed.body[-1] == "[DONE]"


def split_answers(raw: bytes, heads: Sequence[int] = ()) -> list[tuple[int, dict[str, str], bytes]]:
    """Answers that came one after another on one connection, each framed by its Content-Length
    (but those to HEAD requests, at the positions `heads`, which have no body)."""
    answers: list[tuple[int, dict[str, str], bytes]] = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        status, headers, _ = parse_answer(head)
        length = 0 if len(answers) in heads else int(headers.get("content-length", "0"))
        answers.append((status, headers, rest[:length]))
        raw = rest[length:]
    return answers


async def test_the_http_front_refuses_smuggling_and_answers_pipelined_requests_in_order(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    """The router's own HTTP server: llhttp's strict framing, in-order pipelining, HEAD, 405,
    chunked bodies and Expect: 100-continue, each on a connection of its own."""
    router = strict_router(start_router, cluster)
    body = json.dumps(chat(SHORT)).encode()
    smuggled = [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /config HTTP/1.1\r\nHost: r\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}",
    ]
    for data in smuggled:
        answers = split_answers(await raw_request(router, data))
        assert [(status, headers["connection"]) for status, headers, _ in answers] == [(400, "close")], (
            answers
        )
        assert json.loads(answers[0][2])["error"]["code"] == "malformed_request"

    chat_head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
    pipelined = (
        b"GET /v1/models HTTP/1.1\r\nHost: r\r\n\r\n"
        + chat_head
        + b"Content-Length: %d\r\nX-Request-Id: second\r\n\r\n%b" % (len(body), body)
        + b"HEAD /liveness HTTP/1.1\r\nHost: r\r\n\r\n"
        + b"GET /v1/chat/completions HTTP/1.1\r\nHost: r\r\n\r\n"
        + chat_head
        + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        + b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    )
    answers = split_answers(await raw_request(router, pipelined), heads=[2])
    assert [status for status, _, _ in answers] == [200, 200, 200, 405, 200], answers
    assert json.loads(answers[0][2])["data"][0]["object"] == "model"
    assert answers[1][1]["x-request-id"] == "second" and json.loads(answers[1][2])["choices"]
    assert int(answers[2][1]["content-length"]) > 0  # HEAD: the length of the body it does not get
    assert json.loads(answers[3][2])["error"]["code"] == "method_not_allowed"
    assert json.loads(answers[4][2])["choices"] and answers[4][1]["connection"] == "close"

    host, port = router.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(chat_head + b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(body))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        status, headers, _ = parse_answer(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5))
        assert status == 200 and "connection" not in headers  # kept alive
    finally:
        writer.close()
    await assert_unharmed(client, router, HEALTHY)
