"""The fake SGLang engine over real HTTP and TCP on 127.0.0.1: PD legs, KV bytes, failures, queues, metrics.

Engines run in-process (FakeEngine) except where a process must die or be started from
SGLang's own arguments. Time scales are small so the whole file stays well under 30 s.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prfaas_engine_sim.protocol import output_text
from prfaas_engine_sim.server import FakeEngine
from prfaas_engine_sim.settings import EngineSettings
from prfaas_engine_sim.timing import kv_wire_bytes, load_profile
from prfaas_testbed.polling import eventually_async
from prfaas_testbed.ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from support.sse import sse_events

pytestmark = pytest.mark.timeout(60)

KV_PER_TOKEN = 1000.0
KV_FIXED = 5000.0
KV_SCALE = 0.5


def prefill_settings(**overrides: Any) -> EngineSettings:
    values: dict[str, Any] = {
        "mode": "prefill",
        "port": 0,
        "bootstrap_port": 0,
        "profile": "h200",
        "time_scale": 0.02,
        "kv_bytes_per_token": KV_PER_TOKEN,
        "kv_fixed_bytes": KV_FIXED,
        "kv_scale": KV_SCALE,
        "served_model_name": "kimi-fake",
    }
    return EngineSettings(**(values | overrides))


def decode_settings(**overrides: Any) -> EngineSettings:
    values: dict[str, Any] = {
        "mode": "decode",
        "port": 0,
        "profile": "h20",
        "time_scale": 0.02,
        "served_model_name": "kimi-fake",
        "decode_step_seconds": 0.25,  # 5 ms per token once scaled
    }
    return EngineSettings(**(values | overrides))


@asynccontextmanager
async def engines(*settings: EngineSettings) -> AsyncIterator[list[FakeEngine]]:
    started: list[FakeEngine] = []
    try:
        for one in settings:
            engine = FakeEngine(one)
            await engine.start()
            started.append(engine)
        yield started
    finally:
        for engine in reversed(started):
            await engine.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


def pd_fields(prefill_bootstrap_port: int, room: int | list[int]) -> dict[str, Any]:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill_bootstrap_port, "bootstrap_room": room}


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as response:
        text = await response.text()
        if response.content_type == "text/event-stream":
            return response.status, sse_events(text)
        return response.status, json.loads(text)


async def both_legs(
    http: aiohttp.ClientSession, prefill: FakeEngine, decode: FakeEngine, path: str, body: dict[str, Any]
) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """What a PD router does: the same body, bootstrap fields included, to both legs at once."""
    prefill_leg, decode_leg = await asyncio.gather(
        post(http, prefill.url + path, body), post(http, decode.url + path, body)
    )
    return prefill_leg, decode_leg


async def metrics(http: aiohttp.ClientSession, engine: FakeEngine) -> dict[str, float]:
    """Every sample of an engine's /metrics, keyed by name (labels dropped: one engine, one label set)."""
    async with http.get(engine.url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


async def kv_bytes_received(http: aiohttp.ClientSession, engine: FakeEngine) -> float:
    """The KV bytes `engine` has received so far (0 until the first one)."""
    return (await metrics(http, engine))["prfaas_fake_engine_kv_bytes_received_total"]


def kv_bytes(prompt_tokens: int) -> int:
    return round((KV_FIXED + KV_PER_TOKEN * prompt_tokens) * KV_SCALE)


# ----------------------------------------------------------------------------- PD happy paths


async def test_pd_generate_answers_on_both_legs_and_moves_exact_kv_bytes(http: aiohttp.ClientSession) -> None:
    async with engines(prefill_settings(), decode_settings()) as (prefill, decode):
        body = {"input_ids": list(range(1000)), "sampling_params": {"max_new_tokens": 5}} | pd_fields(
            prefill.bootstrap_port, 7
        )
        (p_status, p_body), (d_status, d_body) = await both_legs(http, prefill, decode, "/generate", body)
        assert (p_status, d_status) == (200, 200), (p_body, d_body)
        assert p_body["meta_info"]["completion_tokens"] == 1
        assert d_body["text"] == output_text(5)
        assert d_body["meta_info"]["completion_tokens"] == 5
        assert d_body["meta_info"]["prompt_tokens"] == 1000

        sent, received = await metrics(http, prefill), await metrics(http, decode)
        assert sent["prfaas_fake_engine_kv_bytes_sent_total"] == kv_bytes(1000) == 502500
        assert received["prfaas_fake_engine_kv_bytes_received_total"] == kv_bytes(1000)
        # SGLang's transfer histograms are the prefill's: bytes over wall time at the real link's rate
        real_bytes_in_wall_time = kv_bytes(1000) * prefill_settings().time_scale / KV_SCALE
        assert sent["sglang:kv_transfer_total_mb_count"] == 1
        assert sent["sglang:kv_transfer_total_mb_sum"] == pytest.approx(real_bytes_in_wall_time / 2**20)
        assert sent["sglang:kv_transfer_latency_ms_sum"] > 0
        assert "sglang:kv_transfer_total_mb_count" not in received  # SGLang's decode observes none


async def test_pd_batched_generate_moves_one_room_per_item(http: aiohttp.ClientSession) -> None:
    async with engines(prefill_settings(), decode_settings()) as (prefill, decode):
        texts = ["a" * 400, "b" * 800]  # 100 and 200 tokens at 4 characters per token
        body = {"text": texts, "sampling_params": {"max_new_tokens": 3}} | pd_fields(
            prefill.bootstrap_port, [11, 12]
        )
        (p_status, _), (d_status, d_body) = await both_legs(http, prefill, decode, "/generate", body)
        assert (p_status, d_status) == (200, 200)
        assert [item["meta_info"]["prompt_tokens"] for item in d_body] == [100, 200]
        assert all(item["text"] == output_text(3) for item in d_body)
        received = await metrics(http, decode)
        assert received["prfaas_fake_engine_kv_bytes_received_total"] == kv_bytes(100) + kv_bytes(200)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
async def test_pd_streams_every_api(http: aiohttp.ClientSession, path: str) -> None:
    async with engines(prefill_settings(), decode_settings()) as (prefill, decode):
        text = "x" * 2000  # 500 tokens
        if path == "/v1/chat/completions":
            body: dict[str, Any] = {"model": "kimi-fake", "messages": [{"role": "user", "content": text}]}
        elif path == "/v1/completions":
            body = {"model": "kimi-fake", "prompt": text}
        else:
            body = {"text": text, "sampling_params": {}}
        body |= {"stream": True, "max_tokens": 6, "stream_options": {"include_usage": True}}
        if path == "/generate":
            body["sampling_params"]["max_new_tokens"] = 6
        body |= pd_fields(prefill.bootstrap_port, 99)
        (p_status, p_events), (d_status, events) = await both_legs(http, prefill, decode, path, body)
        assert (p_status, d_status) == (200, 200)
        assert p_events[-1] == events[-1] == "[DONE]"
        chunks = events[:-1]
        if path == "/v1/chat/completions":
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
            assert content == output_text(6)
            assert chunks[-1]["usage"]["prompt_tokens"] == 500
            assert chunks[-1]["usage"]["completion_tokens"] == 6
            assert "cached_tokens" in chunks[-1]["usage"]["prompt_tokens_details"]
        elif path == "/v1/completions":
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == output_text(6)
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        else:
            assert chunks[-1]["text"] == output_text(6)
            assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


async def test_health_check_bootstrap_host_skips_the_transfer(http: aiohttp.ClientSession) -> None:
    async with engines(prefill_settings(), decode_settings()) as (prefill, decode):
        body = {
            "text": "ping",
            "sampling_params": {"max_new_tokens": 1},
            "bootstrap_host": "2.2.2.2",
            "bootstrap_room": 0,
        }
        (p_status, _), (d_status, d_body) = await both_legs(http, prefill, decode, "/generate", body)
        assert (p_status, d_status) == (200, 200)
        assert d_body["text"] == output_text(1)
        assert (await metrics(http, decode))["prfaas_fake_engine_kv_bytes_received_total"] == 0


def stream_body(path: str, text: str, room: int, port: int) -> dict[str, Any]:
    if path == "/generate":
        body: dict[str, Any] = {"text": text, "sampling_params": {"max_new_tokens": 4}}
    elif path == "/v1/completions":
        body = {"model": "kimi-fake", "prompt": text, "max_tokens": 4}
    else:
        body = {"model": "kimi-fake", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return body | {"stream": True} | pd_fields(port, room)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
async def test_openai_streams_send_nothing_before_the_first_token_and_generate_sends_its_headers_at_once(
    http: aiohttp.ClientSession, path: str
) -> None:
    async with engines(prefill_settings(), decode_settings()) as (prefill, decode):
        body = stream_body(path, "z" * 400, 5, prefill.bootstrap_port)
        decode_leg = asyncio.create_task(http.post(decode.url + path, json=body))
        await asyncio.sleep(0.5)  # the decode waits for its prefill: no token yet
        assert decode_leg.done() is (path == "/generate")
        status, _ = await post(http, prefill.url + path, body)
        async with await decode_leg as response:
            assert (status, response.status) == (200, 200)
            events = sse_events(await response.text())
        assert events[-1] == "[DONE]" and "error" not in events[0]


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
async def test_a_failed_kv_handoff_is_a_200_stream_ending_in_sglangs_abort_event(
    http: aiohttp.ClientSession, path: str, side: str
) -> None:
    async with engines(prefill_settings(), decode_settings()) as (prefill, decode):
        failing = prefill if side == "prefill" else decode
        async with http.post(failing.url + "/fake/fail_kv_transfers", json={"count": 1}) as response:
            assert (response.status, await response.json()) == (200, {"remaining": 1})
        body = stream_body(path, "w" * 400, 6, prefill.bootstrap_port)
        (p_status, p_events), (d_status, d_events) = await both_legs(http, prefill, decode, path, body)
        assert d_status == 200 and d_events[-1] == "[DONE]" and len(d_events) == 2
        if path == "/generate":
            reason = d_events[0]["meta_info"]["finish_reason"]
            assert (reason["type"], reason["status_code"]) == ("abort", 500)
            message = reason["message"]
        else:
            error = d_events[0]["error"]
            assert {k: error[k] for k in ("object", "type", "param", "code")} == {
                "object": "error",
                "type": "INTERNAL_SERVER_ERROR",
                "param": None,
                "code": 500,
            }
            message = error["message"]
        if side == "decode":
            assert "Decode transfer failed" in message and p_status == 200
        else:
            assert p_status == 200 and "Prefill transfer failed" in json.dumps(p_events)
        assert (await metrics(http, failing))["sglang:num_transfer_failed_reqs_total"] == 1
        (p_status, _), (d_status, d_events) = await both_legs(
            http, prefill, decode, path, body | {"bootstrap_room": 7}
        )
        assert (p_status, d_status) == (200, 200) and "error" not in json.dumps(
            d_events
        )  # one fault, then well


async def test_a_failed_kv_handoff_answers_a_plain_request_with_sglangs_error_shapes(
    http: aiohttp.ClientSession,
) -> None:
    async with engines(prefill_settings(), decode_settings(fail_kv_transfers=2)) as (prefill, decode):
        for path, room in (("/v1/completions", 8), ("/generate", 9)):
            body = stream_body(path, "v" * 400, room, prefill.bootstrap_port) | {"stream": False}
            _, (d_status, d_body) = await both_legs(http, prefill, decode, path, body)
            assert d_status == 500
            assert {k: d_body[k] for k in ("object", "type", "param", "code")} == {
                "object": "error",
                "type": "500",
                "param": None,
                "code": 500,
            }


async def timed_get(http: aiohttp.ClientSession, url: str) -> tuple[int, str, float]:
    began = time.monotonic()
    async with http.get(url) as response:
        return response.status, await response.text(), time.monotonic() - began


async def test_health_generates_one_token_and_never_answers_in_under_a_second_as_sglang_does(
    http: aiohttp.ClientSession,
) -> None:
    async with engines(prefill_settings(), decode_settings()) as pd_engines:
        for engine in pd_engines:
            for path in ("/health", "/health_generate"):
                status, text, seconds = await timed_get(http, engine.url + path)
                assert (status, text) == (200, "") and 1.0 <= seconds < 2.0, (
                    engine.settings.mode,
                    path,
                    seconds,
                )
            status, text, seconds = await timed_get(http, engine.url + "/ready")
            assert (status, text) == (200, "") and seconds < 0.5
            samples = await metrics(http, engine)
            # SGLang's health request has log_metrics=False: no request series appears
            assert "sglang:num_requests_total" not in samples and "sglang:prompt_tokens_total" not in samples
            assert "sglang:num_aborted_requests_total" not in samples  # as SGLang: none before the first


async def test_the_engine_listens_only_once_its_model_is_loaded_as_sglang_does(
    http: aiohttp.ClientSession,
) -> None:
    port = free_port()
    engine = FakeEngine(decode_settings(mode="null", port=port, model_load_seconds=1.5))
    started = time.monotonic()
    starting = asyncio.create_task(engine.start())
    try:
        await asyncio.sleep(0.5)
        with pytest.raises(aiohttp.ClientConnectionError):  # nothing binds the port while loading
            await http.get(f"http://127.0.0.1:{port}/ready")
        await starting
        assert time.monotonic() - started >= 1.5
        async with http.get(f"http://127.0.0.1:{port}/ready") as answer:
            assert answer.status == 200
    finally:
        await starting
        await engine.stop()


async def test_health_is_fast_only_when_asked_and_fails_when_the_engine_produces_nothing(
    http: aiohttp.ClientSession,
) -> None:
    fast = decode_settings(health_generation_delay=0.05)
    instant = decode_settings(health_endpoint_generation=False)
    stuck = EngineSettings(port=0, time_scale=1e6, health_generation_delay=0.05, health_check_timeout=0.3)
    async with engines(fast, instant, stuck) as (fast_engine, instant_engine, stuck_engine):
        status, _, seconds = await timed_get(http, fast_engine.url + "/health")
        assert status == 200 and 0.05 <= seconds < 0.5
        status, _, seconds = await timed_get(http, instant_engine.url + "/health")
        assert status == 200 and seconds < 0.5
        status, _, seconds = await timed_get(http, instant_engine.url + "/health_generate")
        assert (
            status == 200 and seconds >= 1.0
        )  # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION spares /health only
        status, _, _ = await timed_get(http, stuck_engine.url + "/ready")
        assert status == 200
        status, _, seconds = await timed_get(http, stuck_engine.url + "/health")
        assert status == 503 and 0.3 <= seconds < 1.0
        status, _, seconds = await timed_get(http, stuck_engine.url + "/ready")
        assert status == 503 and seconds < 0.5  # SGLang's server_status is UnHealthy until a check passes


# ----------------------------------------------------------------------------- PD failures


@pytest.mark.parametrize("mode", ["prefill", "decode"])
async def test_pd_engine_refuses_a_request_without_bootstrap_fields(
    http: aiohttp.ClientSession, mode: str
) -> None:
    settings = prefill_settings() if mode == "prefill" else decode_settings()
    async with engines(settings) as (engine,):
        status, body = await post(http, engine.url + "/v1/completions", {"prompt": "hello", "max_tokens": 2})
        assert status == 400
        assert body["message"] == f"bootstrap_room is required in {mode.upper()} mode"


async def test_prefill_refuses_a_room_already_in_use_and_times_out_without_its_decode(
    http: aiohttp.ClientSession,
) -> None:
    async with engines(prefill_settings(bootstrap_timeout=0.5)) as (prefill,):
        body = {"prompt": "hello", "max_tokens": 3} | pd_fields(prefill.bootstrap_port, 5)
        first = asyncio.ensure_future(post(http, prefill.url + "/v1/completions", body))
        await asyncio.sleep(0.1)
        status, error = await post(http, prefill.url + "/v1/completions", body)
        assert status == 400 and "bootstrap_room 5 is already in use" in error["message"]
        status, error = await first
        assert status == 500 and "no decode connected for bootstrap_room 5" in error["message"]
        assert (await metrics(http, prefill))["sglang:num_bootstrap_failed_reqs_total"] == 1


async def test_decode_without_its_prefill_leg_fails_after_the_bootstrap_timeout(
    http: aiohttp.ClientSession,
) -> None:
    async with engines(prefill_settings(), decode_settings(bootstrap_timeout=0.5)) as (prefill, decode):
        body = {"prompt": "hello " * 10, "max_tokens": 3} | pd_fields(prefill.bootstrap_port, 5)
        started = time.monotonic()
        status, error = await post(http, decode.url + "/v1/completions", body)
        elapsed = time.monotonic() - started
        assert status == 500
        assert "bootstrap timed out" in error["message"] and "bootstrap_room 5" in error["message"]
        assert 0.45 <= elapsed < 2.0

        stream_body = body | {"stream": True, "bootstrap_room": 6}
        status, events = await post(http, decode.url + "/v1/completions", stream_body)
        assert status == 200  # like SGLang, the stream has started; the failure is its last event
        assert "bootstrap timed out" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
        assert (await metrics(http, decode))["sglang:num_bootstrap_failed_reqs_total"] == 2


async def test_a_decode_counts_a_request_whose_kv_is_still_to_come_as_waiting_in_its_loads(
    http: aiohttp.ClientSession,
) -> None:
    # SGLang's /v1/loads adds the prealloc and transfer queues to a decode's num_waiting_reqs; the
    # sglang:num_queue_reqs gauge is the waiting queue alone (a router reading loads sees the KV coming)
    async with engines(prefill_settings(), decode_settings(bootstrap_timeout=1.0)) as (prefill, decode):
        body = {"prompt": "hello " * 10, "max_tokens": 3} | pd_fields(prefill.bootstrap_port, 7)
        pending = asyncio.ensure_future(post(http, decode.url + "/v1/completions", body))
        await asyncio.sleep(0.3)
        async with http.get(decode.url + "/v1/loads?include=core,disagg") as response:
            load = (await response.json())["loads"][0]
        gauges = await metrics(http, decode)
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1)
        assert load["disaggregation"]["decode_prealloc_queue_reqs"] == 1
        assert load["max_running_requests"] == 20  # the h20 profile's BS_max
        assert gauges["sglang:num_queue_reqs"] == 0 and gauges["sglang:num_decode_prealloc_queue_reqs"] == 1
        status, _ = await pending  # no prefill leg ever comes: the bootstrap times out
        assert status == 500


async def test_decode_asks_a_silent_bootstrap_server_15_times_a_scaled_second_apart_then_fails(
    http: aiohttp.ClientSession,
) -> None:
    async with engines(decode_settings(bootstrap_timeout=5.0)) as (decode,):  # time scale 0.02
        body = {"prompt": "hello", "max_tokens": 3} | pd_fields(free_port(), 5)
        started = time.monotonic()
        status, error = await post(http, decode.url + "/v1/completions", body)
        assert status == 500 and "cannot reach the bootstrap server" in error["message"]
        assert "after 15 attempts" in error["message"]
        assert time.monotonic() - started >= 14 * 0.02  # SGLang: 14 s between its first and last


@pytest.mark.parametrize(
    ("prefill_option", "expected"),
    [({"kv_cache_dtype": "fp8_e4m3"}, "KV cache dtype mismatch"), ({"page_size": 16}, "Page size mismatch")],
)
async def test_kv_layout_mismatch_fails_both_legs_at_once(
    http: aiohttp.ClientSession, prefill_option: dict[str, Any], expected: str
) -> None:
    async with engines(prefill_settings(**prefill_option), decode_settings()) as (prefill, decode):
        body = {"prompt": "hello " * 20, "max_tokens": 3} | pd_fields(prefill.bootstrap_port, 21)
        started = time.monotonic()
        (p_status, p_error), (d_status, d_error) = await both_legs(
            http, prefill, decode, "/v1/completions", body
        )
        assert (p_status, d_status) == (500, 500)
        assert expected in p_error["message"] and expected in d_error["message"]
        assert time.monotonic() - started < 2.0  # well before the 5 s bootstrap timeout


async def test_engines_of_different_kv_fingerprints_refuse_each_other_and_the_decode_counts_it(
    http: aiohttp.ClientSession,
) -> None:
    """Our own check beside SGLang's: a rollout must never pair layouts (see kv_transfer)."""
    async with engines(
        prefill_settings(kv_fingerprint="old"),
        prefill_settings(kv_fingerprint="new"),
        decode_settings(kv_fingerprint="new"),
    ) as (old, new, decode):
        same = {"prompt": "hello " * 20, "max_tokens": 3} | pd_fields(new.bootstrap_port, 31)
        statuses = await both_legs(http, new, decode, "/v1/completions", same)
        assert [status for status, _ in statuses] == [200, 200]
        other = {"prompt": "hello " * 20, "max_tokens": 3} | pd_fields(old.bootstrap_port, 32)
        (p_status, p_error), (d_status, d_error) = await both_legs(
            http, old, decode, "/v1/completions", other
        )
        assert (p_status, d_status) == (500, 500)
        for error in (p_error, d_error):
            assert "KV fingerprint mismatch: prefill old, decode new" in error["message"]
        counted = await metrics(http, decode)
        assert counted["prfaas_fake_engine_kv_handoffs_total"] == 2
        assert counted["prfaas_fake_engine_kv_mismatched_handoffs_total"] == 1


async def test_prefill_started_from_sglang_args_killed_mid_transfer_fails_the_decode_promptly(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    port, bootstrap_port = free_port(), free_port()
    log_path = tmp_path / "prefill.log"
    args = [
        *("--model-path", "/models/kimi-linear", "--served-model-name", "kimi-fake"),
        *("--host", "127.0.0.1", "--port", str(port), "--disaggregation-mode", "prefill"),
        *(
            "--disaggregation-bootstrap-port",
            str(bootstrap_port),
            "--disaggregation-transfer-backend",
            "mooncake_tcp",
        ),
        *("--page-size", "1", "--kv-cache-dtype", "auto", "--tp-size", "8", "--enable-metrics"),
        *("--trust-remote-code", "--revision", "main", "--chunked-prefill-size", "8192"),
        *("--schedule-policy", "lpm"),
        *("--profile", "h200", "--time-scale", "1.5", "--kv-scale", "0.001"),
    ]
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "prfaas_engine_sim", *args], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        prefill_url = f"http://127.0.0.1:{port}"
        await wait_healthy(http, prefill_url)
        async with http.get(prefill_url + "/server_info") as response:
            info = await response.json()
        assert info["disaggregation_mode"] == "prefill"
        assert info["disaggregation_bootstrap_port"] == bootstrap_port
        assert info["tp_size"] == 8 and info["served_model_name"] == "kimi-fake"
        assert info["model_path"] == "/models/kimi-linear"
        assert info["chunked_prefill_size"] == 8192
        assert "--schedule-policy lpm" in log_path.read_text()  # warned about, not fatal

        async with engines(decode_settings()) as (decode,):
            # 32768 tokens on the H200 profile: 1.84 s x 1.5 of compute, each 8192-token chunk's KV
            # sent as soon as its forward ends
            body = {"input_ids": [1] * 32768, "sampling_params": {"max_new_tokens": 4}} | pd_fields(
                bootstrap_port, 3
            )
            prefill_leg = asyncio.ensure_future(post(http, prefill_url + "/generate", body))
            decode_leg = asyncio.ensure_future(post(http, decode.url + "/generate", body))
            await eventually_async(
                lambda: kv_bytes_received(http, decode), timeout=5, interval=0.02, what="a KV byte to arrive"
            )
            process.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            decode_status, decode_error = await asyncio.wait_for(decode_leg, timeout=10)
            assert time.monotonic() - killed_at < 1.0
            with pytest.raises(aiohttp.ClientError):
                await prefill_leg  # the prefill itself is gone
            kv_size = load_profile("h200").kv_size
            assert kv_size is not None
            expected = kv_wire_bytes(kv_size, 32768, 0.001)
            assert decode_status == 500 and decode_error["type"] == "500"  # SGLang's HTTPException shape
            assert (
                "failed after" in decode_error["message"]
                and f"of {expected} bytes" in decode_error["message"]
            )
            assert (await metrics(http, decode))["sglang:num_transfer_failed_reqs_total"] == 1
    finally:
        process.kill()
        process.wait()


async def test_a_decode_leaving_fails_its_prefill_leg_at_once_if_queued_or_when_its_batch_ends(
    http: aiohttp.ClientSession,
) -> None:
    # 32768 tokens at time scale 0.5: about 0.9 s of compute, one batch each, KV streamed meanwhile
    async with engines(prefill_settings(time_scale=0.5), decode_settings()) as (prefill, decode):
        legs = {}
        for room in (8, 9):
            body = {"input_ids": [room] * 32768, "sampling_params": {"max_new_tokens": 2}}
            body |= pd_fields(prefill.bootstrap_port, room)
            legs[room] = (
                asyncio.ensure_future(post(http, prefill.url + "/generate", body)),
                asyncio.ensure_future(post(http, decode.url + "/generate", body)),
            )
            await asyncio.sleep(0.05)
        await eventually_async(
            lambda: kv_bytes_received(http, decode), timeout=5, interval=0.01, what="a KV byte to arrive"
        )
        for room in (9, 8):  # the router drops both decode legs: their clients went away
            legs[room][1].cancel()
        left_at = time.monotonic()
        queued_status, queued_error = await asyncio.wait_for(legs[9][0], timeout=5)
        assert time.monotonic() - left_at < 0.3  # room 9 was still queued behind room 8
        running_status, running_error = await asyncio.wait_for(legs[8][0], timeout=5)
        assert 0.3 < time.monotonic() - left_at < 1.5  # room 8 failed when its batch ended
        for status, error in ((queued_status, queued_error), (running_status, running_error)):
            assert status == 500 and "the decode disconnected" in error["message"]
        assert (await metrics(http, prefill))["sglang:num_transfer_failed_reqs_total"] == 2
        assert (await metrics(http, decode))["sglang:num_aborted_requests_total"] == 2


# ----------------------------------------------------------------------------- queues, cache, aborts, link


async def test_second_concurrent_prefill_waits_and_a_repeated_prompt_hits_the_cache(
    http: aiohttp.ClientSession,
) -> None:
    settings = EngineSettings(
        mode="null", port=0, profile="h200", time_scale=0.3, max_decode_batch=8, decode_step_seconds=0
    )
    async with engines(settings) as (engine,):
        # 12000 tokens each: two do not fit one 16384-token batch; T_h200(12000) x 0.3 ~ 0.27 s
        single = load_profile("h200").prefill_time.seconds_for(12000.0) * 0.3
        first = {"input_ids": [1] * 12000, "sampling_params": {"max_new_tokens": 1}}
        second = {"input_ids": [2] * 12000, "sampling_params": {"max_new_tokens": 1}}

        async def finished_at(body: dict[str, Any]) -> tuple[float, float]:
            status, answer = await post(http, engine.url + "/generate", body)
            assert status == 200
            return time.monotonic(), answer["meta_info"]["e2e_latency"]

        tasks = [asyncio.ensure_future(finished_at(first))]
        await asyncio.sleep(0.02)
        tasks.append(asyncio.ensure_future(finished_at(second)))
        seen = set()
        while not tasks[0].done():
            async with http.get(engine.url + "/v1/loads?include=core,queues") as response:
                load = (await response.json())["loads"][0]
            seen.add((load["num_running_reqs"], load["num_waiting_reqs"], load["queues"]["waiting"]))
            await asyncio.sleep(0.02)
        assert (1, 1, 1) in seen  # one computing, one queued behind it
        (first_end, first_latency), (second_end, second_latency) = await asyncio.gather(*tasks)
        assert first_latency >= single * 0.95
        assert second_end - first_end >= single * 0.9  # its compute only started when the first's ended
        assert second_latency >= (2 * single - 0.02) * 0.9  # queueing counts in its latency

        status, again = await post(http, engine.url + "/generate", first)
        assert status == 200
        assert again["meta_info"]["cached_tokens"] == 12000 // 64 * 64
        async with http.get(engine.url + "/metrics") as response:
            exposed = await response.text()
        assert 'sglang:cached_tokens_total{cache_source="device",' in exposed  # its first: it appears
        assert (await metrics(http, engine))["sglang:cached_tokens_total"] == 12000 // 64 * 64
        cached_single = load_profile("h200").prefill_time.seconds_for(12000.0 - 11968) * 0.3
        assert cached_single * 0.95 <= again["meta_info"]["e2e_latency"] < 0.7 * first_latency


async def test_a_prompt_hits_the_cache_only_under_the_salt_it_was_computed_under(
    http: aiohttp.ClientSession,
) -> None:
    """As SGLang's radix cache (tests/real_sglang/test_real_prefix_cache.py observes it)."""
    settings = EngineSettings(
        mode="null", port=0, profile="h200", time_scale=0.01, max_decode_batch=8, decode_step_seconds=0
    )
    async with engines(settings) as (engine,):
        cached = []
        for salt in ("a", "b", "a", None):
            body = {"input_ids": [3] * 1000, "sampling_params": {"max_new_tokens": 1}, "cache_salt": salt}
            status, answer = await post(http, engine.url + "/generate", body)
            assert status == 200, answer
            cached.append(answer["meta_info"]["cached_tokens"])
        assert cached == [0, 0, 1000 // 64 * 64, 0]


async def test_decode_slots_queue_requests_and_client_disconnects_free_queue_places_and_slots(
    http: aiohttp.ClientSession,
) -> None:
    settings = decode_settings(mode="null", max_decode_batch=1, decode_step_seconds=0.5)  # 10 ms per token
    async with engines(settings) as (engine,):
        url = engine.url + "/v1/completions"

        async def load() -> tuple[int, int]:
            async with http.get(engine.url + "/v1/loads?include=core") as response:
                core = (await response.json())["loads"][0]
            return core["num_running_reqs"], core["num_waiting_reqs"]

        long_body = {"model": "m", "prompt": "hi", "max_tokens": 1000, "stream": True}
        short_body = {"model": "m", "prompt": "hi", "max_tokens": 3}
        async with http.post(url, json=long_body) as streaming:
            await streaming.content.readline()  # the first chunk: the only slot is taken
            queued = asyncio.ensure_future(post(http, url, short_body))
            await asyncio.sleep(0.2)
            assert not queued.done() and await load() == (1, 1)
            queued.cancel()  # a non-streaming client leaves while queued
            await asyncio.sleep(0.1)
            assert await load() == (1, 0)
            waiting = asyncio.ensure_future(post(http, url, short_body))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            connection = streaming.connection
            assert connection is not None and connection.transport is not None
            connection.transport.abort()  # the streaming client leaves too
        started = time.monotonic()
        status, body = await asyncio.wait_for(waiting, timeout=5)
        assert status == 200 and body["choices"][0]["text"] == output_text(3)
        assert time.monotonic() - started < 0.5
        assert (await metrics(http, engine))["sglang:num_aborted_requests_total"] == 2


async def test_abort_request_ends_a_running_request(http: aiohttp.ClientSession) -> None:
    settings = decode_settings(mode="null", decode_step_seconds=0.5)
    async with engines(settings) as (engine,):
        body = {"text": "hi", "rid": "to-abort", "sampling_params": {"max_new_tokens": 1000}}
        pending = asyncio.ensure_future(post(http, engine.url + "/generate", body))
        await asyncio.sleep(0.2)
        async with http.post(engine.url + "/abort_request", json={"rid": "to-abort"}) as response:
            assert (await response.json())["aborted"] == 1
        status, result = await asyncio.wait_for(pending, timeout=2)
        assert status == 200
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < result["meta_info"]["completion_tokens"] < 1000


async def test_link_rate_paces_all_transfers_of_a_prefill_together(http: aiohttp.ClientSession) -> None:
    rate = 1_000_000.0
    async with engines(
        prefill_settings(time_scale=0, link_rate_bytes_per_second=rate), decode_settings(time_scale=0)
    ) as (prefill, decode):
        bodies = [
            {"input_ids": [room] * 800, "sampling_params": {"max_new_tokens": 1}}
            | pd_fields(prefill.bootstrap_port, room)
            for room in (1, 2)
        ]
        started = time.monotonic()
        results = await asyncio.gather(
            *(both_legs(http, prefill, decode, "/generate", body) for body in bodies)
        )
        elapsed = time.monotonic() - started
        assert all(p[0] == 200 and d[0] == 200 for p, d in results)
        total = 2 * kv_bytes(800)  # 805 000 bytes through one 1 MB/s bucket
        assert total / rate * 0.9 <= elapsed < total / rate + 1.0


# ----------------------------------------------------------------------------- null mode and the rest of the API


async def test_null_mode_serves_directly_with_sglang_shaped_answers(http: aiohttp.ClientSession) -> None:
    settings = EngineSettings(mode="null", port=0, profile="h20", time_scale=0, served_model_name="kimi-fake")
    async with engines(settings) as (engine,):
        url = engine.url
        status, body = await post(
            http, url + "/v1/completions", {"model": "kimi-fake", "prompt": ["abcd" * 10, "ab"]}
        )
        assert status == 200
        assert [c["text"] for c in body["choices"]] == [output_text(16)] * 2
        assert body["usage"] == {
            "prompt_tokens": 11,
            "completion_tokens": 32,
            "total_tokens": 43,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        chat = {
            "messages": [{"role": "system", "content": "ab"}, {"role": "user", "content": "cdefgh"}],
            "max_tokens": 2,
        }
        chat |= {"bootstrap_room": 5}  # ignored outside PD
        status, body = await post(http, url + "/v1/chat/completions", chat)
        assert status == 200 and body["choices"][0]["message"]["content"] == output_text(2)
        assert body["usage"]["prompt_tokens"] == 2  # "abcdefgh": 8 characters / 4

        for bad, message in [
            ({"messages": []}, "messages must be a non-empty list"),
            ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
        ]:
            status, error = await post(http, url + "/v1/chat/completions", bad)
            assert status == 400 and message in error["message"] and error["object"] == "error"
        async with http.post(
            url + "/generate", data=b"{not json", headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 400 and "malformed JSON" in (await r.json())["error"]["message"]

        async with http.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]
        assert (model["id"], model["root"], model["owned_by"]) == ("kimi-fake", "kimi-fake", "sglang")
        for path in ("/server_info", "/get_server_info"):
            async with http.get(url + path) as r:
                info = await r.json()
            assert info["disaggregation_mode"] == "null" and info["page_size"] == 1
            assert info["kv_cache_dtype"] == "auto" and info["served_model_name"] == "kimi-fake"
        for path in ("/model_info", "/get_model_info"):
            async with http.get(url + path) as r:
                assert (await r.json())["is_generation"] is True
        for path in ("/health", "/health_generate", "/ready", "/v1/loads"):
            async with http.get(url + path) as r:
                assert r.status == 200, path
        async with http.get(url + "/get_load") as r:
            assert r.status == 404  # SGLang 0.5.23 has none
        async with http.get(url + "/v1/loads?include=disagg") as r:
            (load,) = (await r.json())["loads"]
        ints = (
            "num_waiting_uncached_tokens",
            "num_active_tokens",
            "num_total_tokens",
            "max_running_requests",
        )
        assert all(type(load[key]) is int for key in ints), load  # core keys whatever include says
        assert "prefill_bootstrap_queue_reqs" in load["disaggregation"] and "queues" not in load
        async with http.get(url + "/v1/loads?include=everything") as r:
            assert r.status == 400
        async with http.post(url + "/flush_cache") as r:
            assert r.status == 200


async def test_metrics_carry_sglang_names_and_labels(http: aiohttp.ClientSession) -> None:
    async with engines(prefill_settings(), decode_settings()) as (prefill, decode):
        body = {"prompt": "y" * 400, "max_tokens": 2} | pd_fields(prefill.bootstrap_port, 77)
        await both_legs(http, prefill, decode, "/v1/completions", body)
        engine_labels = ("model_name", "engine_type")
        rank_labels = (*engine_labels, "tp_rank", "pp_rank", "moe_ep_rank")
        streaming_labels = (*engine_labels, "is_streaming")
        # metrics_collector.py: the scheduler's collector has the rank labels, the tokenizer's not
        labels_of = {
            **dict.fromkeys(
                [
                    *(
                        "num_running_reqs",
                        "num_queue_reqs",
                        "token_usage",
                        "cache_hit_rate",
                        "gen_throughput",
                    ),
                    *("num_prefill_inflight_queue_reqs", "num_decode_transfer_queue_reqs"),
                ],
                rank_labels,
            ),
            **dict.fromkeys(
                [
                    *("prompt_tokens_total", "generation_tokens_total", "num_requests_total"),
                    *("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count"),
                ],
                streaming_labels,
            ),
            **dict.fromkeys(
                [
                    "prompt_tokens_histogram_count",
                    *("uncached_prompt_tokens_histogram_count", "generation_tokens_histogram_count"),
                ],
                engine_labels,
            ),
        }
        transfer = dict.fromkeys(
            ["kv_transfer_speed_gb_s_count", "kv_transfer_latency_ms_count", "kv_transfer_total_mb_count"],
            rank_labels,
        )
        for engine, engine_type, expected in (
            (prefill, "prefill", labels_of | transfer),
            (decode, "decode", labels_of | {"request_time_per_output_token_seconds_count": streaming_labels}),
        ):
            async with http.get(engine.url + "/metrics") as response:
                text = await response.text()
            found = {
                sample.name.removeprefix("sglang:"): sample.labels
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name.startswith("sglang:")
            }
            for name, names in expected.items():
                assert name in found, (engine_type, name)
                labels = found[name]
                assert sorted(labels) == sorted(names), (engine_type, name, labels)
                assert (labels["model_name"], labels["engine_type"]) == ("kimi-fake", engine_type)
                assert labels.get("tp_rank", "0") == labels.get("pp_rank", "0") == "0"
                assert labels.get("is_streaming", "false") == "false"
            # as in SGLang, a series from its first observation: no failure, abort or cached token yet
            for absent in (
                "num_transfer_failed_reqs_total",
                "num_aborted_requests_total",
                "cached_tokens_total",
            ):
                assert absent not in found, (engine_type, absent)
        decode_samples = await metrics(http, decode)
        assert decode_samples["sglang:num_requests_total"] == 1
        assert decode_samples["sglang:prompt_tokens_total"] == 100
        assert decode_samples["sglang:generation_tokens_total"] == 2
        assert decode_samples["sglang:request_time_per_output_token_seconds_count"] == 1  # one gap


async def rank_samples(http: aiohttp.ClientSession, engine: FakeEngine, name: str) -> dict[str, float]:
    """One metric's samples of an engine, by tp_rank."""
    async with http.get(engine.url + "/metrics") as response:
        text = await response.text()
    return {
        sample.labels["tp_rank"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


async def test_every_tp_rank_observes_its_shard_and_mooncakes_latency_covers_the_last_chunk_only(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """A 4000-token prompt computed in 1 s (a linear profile), in chunks of 1000 tokens, on a
    link that carries a chunk in 0.125 s: the chunks before the last are delivered during
    compute, so the observed latency (last forward end to last byte) is about one chunk's,
    where a prompt in one chunk has to send all of it after its forward (0.5 s)."""
    profile = tmp_path / "linear.yaml"
    points = [{"tokens": tokens, "seconds": tokens / 1000} for tokens in (1000, 2000, 4000)]
    profile.write_text(json.dumps({"prefill_seconds_points": points}))
    shaped = {"profile": str(profile), "time_scale": 0.25, "link_rate_bytes_per_second": 4e6, "tp_size": 2}
    chunked, whole = prefill_settings(**shaped, chunked_prefill_size=1000), prefill_settings(**shaped)
    async with engines(chunked, whole, decode_settings()) as (chunked_prefill, whole_prefill, decode):
        latencies = []
        for prefill in (chunked_prefill, whole_prefill):
            body = {"input_ids": [prefill.port] * 4000, "sampling_params": {"max_new_tokens": 1}} | pd_fields(
                prefill.bootstrap_port, 9
            )
            (p_status, _), (d_status, _) = await both_legs(http, prefill, decode, "/generate", body)
            assert (p_status, d_status) == (200, 200)
            mib = await rank_samples(http, prefill, "sglang:kv_transfer_total_mb_sum")
            assert set(mib) == {"0", "1"} and mib["0"] == pytest.approx(mib["1"])
            real_bytes = kv_bytes(4000) * 0.25 / KV_SCALE  # the shards add up to the whole KV
            assert sum(mib.values()) == pytest.approx(real_bytes / 2**20)
            count = await rank_samples(http, prefill, "sglang:kv_transfer_latency_ms_count")
            assert count == {"0": 1.0, "1": 1.0}
            latency = await rank_samples(http, prefill, "sglang:kv_transfer_latency_ms_sum")
            assert latency["0"] == latency["1"]
            latencies.append(latency["0"] / 1000)
        last_chunk, all_of_it = latencies
        assert 0.1 <= last_chunk < 0.35, latencies  # 0.125 s of the last chunk's 500 kB at 4 MB/s
        assert 0.45 <= all_of_it < 0.9, latencies  # all 2 MB after the forward


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
async def test_n_copies_go_out_after_a_warm_up_on_their_prompts_room_and_collide(
    http: aiohttp.ClientSession, path: str
) -> None:
    """n = 2 sent to the engines as it is (the router sends n = 1 samples instead): the prompt's
    warm-up (max_new_tokens 0) moves its KV on the prompt's room, then both copies take that
    room at once (tokenizer_manager.py ``_handle_batch_request``), which SGLang cannot pair and
    the fake refuses."""
    async with engines(prefill_settings(), decode_settings()) as (prefill, decode):
        if path == "/generate":
            body: dict[str, Any] = {"text": "a" * 400, "sampling_params": {"max_new_tokens": 3, "n": 2}}
        else:
            body = {"prompt": "a" * 400, "max_tokens": 3, "n": 2}
        body |= pd_fields(prefill.bootstrap_port, 31)
        (p_status, p_body), (d_status, _) = await both_legs(http, prefill, decode, path, body)
        assert p_status == 400 and "bootstrap_room 31 is already in use" in json.dumps(p_body)
        assert d_status == 500
        sent, received = await metrics(http, prefill), await metrics(http, decode)
        assert sent["sglang:kv_transfer_total_mb_count"] == 1  # the warm-up's
        assert received["prfaas_fake_engine_kv_bytes_received_total"] == kv_bytes(100)
        assert received["sglang:num_requests_total"] == 1  # the warm-up is a request of its own


# ----------------------------------------------------------------------------- helpers


async def wait_healthy(http: aiohttp.ClientSession, url: str, seconds: float = 15.0) -> None:
    async def healthy() -> bool:
        async with http.get(url + "/health") as response:
            return response.status == 200

    await eventually_async(healthy, timeout=seconds, interval=0.05, what=f"{url} to become healthy")
