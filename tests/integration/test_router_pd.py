"""The router process in front of fake SGLang engine processes in two "clusters" on loopback.

PrfaaS cluster on 127.0.1.x (H200 profile), local PD cluster on 127.0.2.x (H20 profile); every
engine and router is a real process started with its own CLI, time-scaled to milliseconds.
The decode really pulls the KV bytes from the prefill's bootstrap port, so an answer proves
that both legs carried matching bootstrap fields.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prfaas_engine_sim.protocol import output_text
from prfaas_router.link_probe import parse_engine_transfers
from prfaas_testbed.polling import eventually_async
from prfaas_testbed.ports import free_port
from router_harness import (
    LONG,
    MODEL,
    SHORT,
    THRESHOLD,
    Cluster,
    Process,
    RouterFactory,
    chat,
    config_doc,
    fresh_long,
    http_get,
    metric_samples,
    post,
    sample,
    start_engine,
    total,
    wait_healthy,
)
from support.sse import sse_events

pytestmark = pytest.mark.timeout(120)

# ------------------------------------------------------------------------------------------- tests


async def test_answers_stream_and_not_with_both_legs_and_the_request_id(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = start_router(config_doc(cluster.prfaas, cluster.local, cluster.decode))
    status, models = http_get(router.url, "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(models)["data"]] == [MODEL]
    page = router.config_page()
    assert (page["version"], page["threshold_tokens"], page["last_error"]) == (1, THRESHOLD, None)
    assert {(w["name"], w["available"]) for w in page["workers"]} == {
        ("p0", True),
        ("l0", True),
        ("d0", True),
    }
    plain = await post(client, router.url + "/v1/chat/completions", chat(SHORT), **{"X-Request-Id": "req-42"})
    assert plain.status == 200, plain.body
    assert plain.body["choices"][0]["message"]["content"] == output_text(4)
    assert plain.headers["x-request-id"] == "req-42" and plain.body["id"] == "req-42"  # reached the engine
    assert plain.body["usage"]["completion_tokens"] == 4

    streamed = await post(client, router.url + "/v1/chat/completions", chat(LONG, stream=True))
    assert streamed.status == 200 and streamed.headers["x-prfaas-route"] == "prfaas"
    assert streamed.body[-1] == "[DONE]"
    text = "".join(event["choices"][0]["delta"].get("content", "") for event in streamed.body[:-1])
    assert text == output_text(4)
    assert len(streamed.headers["x-request-id"]) == 32  # generated when the client sent none

    completion = await post(client, router.url + "/v1/completions", {"prompt": SHORT, "max_tokens": 3})
    assert completion.status == 200 and completion.body["choices"][0]["text"] == output_text(3)

    other_long = LONG.replace("w", "v")  # LONG itself is cached in both clusters by now
    batch = {"text": [SHORT, other_long, "x" * 40], "sampling_params": {"max_new_tokens": 2}}
    generated = await post(client, router.url + "/generate", batch)
    assert generated.status == 200 and [item["text"] for item in generated.body] == [output_text(2)] * 3

    ids = {"input_ids": list(range(3000)), "sampling_params": {"max_new_tokens": 2}, "stream": True}
    streamed_ids = await post(client, router.url + "/generate", ids)
    assert streamed_ids.status == 200 and streamed_ids.headers["x-prfaas-route"] == "prfaas"
    assert streamed_ids.body[-2]["text"] == output_text(2)

    samples = await metric_samples(client, router.url)
    assert sample(samples, "prfaas_router_requests_total", route="prfaas", outcome="ok") == 3
    assert sample(samples, "prfaas_router_requests_total", route="local", outcome="ok") == 2
    assert sample(samples, "prfaas_router_output_tokens_count") == 5
    assert sample(samples, "prfaas_router_output_tokens_sum") == 4 + 4 + 3 + 6 + 2
    assert sample(samples, "prfaas_router_ttft_seconds_count", route="prfaas") == 2
    # a prefill leg may answer after its decode's stream ended (a CI run read 3000 tokens still in
    # flight on prfaas_prefill): the legs' tokens leave the gauge once both legs are done
    pools = ("prfaas_prefill", "local_prefill", "decode")
    deadline = time.monotonic() + 5
    while (
        any(sample(samples, "prfaas_router_inflight_tokens", pool=p) for p in pools)
        and time.monotonic() < deadline
    ):
        await asyncio.sleep(0.05)
        samples = await metric_samples(client, router.url)
    for pool in pools:
        assert sample(samples, "prfaas_router_inflight_tokens", pool=pool) == 0


async def test_long_uncached_prompts_go_to_prfaas_short_and_cached_ones_stay_local(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = start_router(config_doc(cluster.prfaas, cluster.local, cluster.decode))
    prfaas_before = total(await metric_samples(client, cluster.prfaas[0].url), "sglang:num_requests_total")

    url = router.url + "/v1/chat/completions"
    short = await post(client, url, chat(SHORT))
    long = await post(client, url, chat(LONG))
    # the decode received LONG's KV, but no local prefill can start from it: PrfaaS holds it
    follow_up = await post(client, url, chat(LONG + " and one more question"))
    head = fresh_long("local")[:3600]  # 900 tokens: prefilled locally
    local_head = await post(client, url, chat(head))
    extended = await post(client, url, chat(fresh_long("local")))  # 1402 tokens, 896 of them on l0
    answers = (short, long, follow_up, local_head, extended)
    assert [a.status for a in answers] == [200] * 5
    routes = [(a.headers["x-prfaas-route"], a.headers["x-prfaas-reason"]) for a in answers]
    assert routes == [
        ("local", "short_uncached"),
        ("prfaas", "long_uncached"),
        ("prfaas", "long_uncached"),
        ("local", "short_uncached"),
        ("local", "cached_prefix"),
    ]
    # what the router assumed its prefill reuses: LONG's 21 blocks of 64 on p0, the head's 14 on l0
    assert [int(a.headers["x-prfaas-cached-tokens"]) for a in answers] == [0, 0, 21 * 64, 0, 14 * 64]

    # the PrfaaS engine really prefilled exactly two of them, and their KV really crossed
    prfaas_after = total(await metric_samples(client, cluster.prfaas[0].url), "sglang:num_requests_total")
    assert prfaas_after - prfaas_before == 2
    samples = await metric_samples(client, router.url)
    assert sample(samples, "prfaas_router_decisions_total", route="prfaas", reason="long_uncached") == 2
    assert sample(samples, "prfaas_router_decisions_total", route="local", reason="cached_prefix") == 1
    egress = 2 * 1.8e8 + 17143.0 * (1400 + 1406)
    assert sample(samples, "prfaas_router_kv_egress_bytes_total") == pytest.approx(egress)
    assert sample(samples, "prfaas_router_uncached_tokens_count", route="local") == 3
    assert sample(samples, "prfaas_router_threshold_tokens") == THRESHOLD
    assert sample(samples, "prfaas_router_config_version") == 1


async def test_the_session_header_keeps_a_conversation_where_it_started(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    doc = config_doc(cluster.prfaas, cluster.local, cluster.decode, session_affinity_header="X-Session-Id")
    router = start_router(doc)
    url = router.url + "/v1/chat/completions"
    first = await post(client, url, chat(fresh_long("session")), **{"X-Session-Id": "conv-1"})
    assert (first.headers["x-prfaas-route"], first.headers["x-prfaas-reason"]) == ("prfaas", "long_uncached")
    turn = await post(client, url, chat(SHORT), **{"X-Session-Id": "conv-1"})
    assert (turn.headers["x-prfaas-route"], turn.headers["x-prfaas-reason"]) == ("prfaas", "session_affinity")
    other = await post(client, url, chat(SHORT), **{"X-Session-Id": "conv-2"})
    assert (other.headers["x-prfaas-route"], other.headers["x-prfaas-reason"]) == ("local", "short_uncached")


async def test_an_exhausted_link_budget_keeps_long_prompts_local(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    # 100 kB/s x 0.8 over a 1000 s SLO horizon is 80 MB; one 1400-token prompt's KV is 204 MB
    link = {"bandwidth_bytes_per_second": 1e5, "headroom": 0.8, "latency_seconds": 0.001}
    router = start_router(config_doc(cluster.prfaas, cluster.local, cluster.decode, link=link))
    answer = await post(client, router.url + "/v1/chat/completions", chat(LONG))
    assert answer.status == 200
    assert (answer.headers["x-prfaas-route"], answer.headers["x-prfaas-reason"]) == ("local", "link_budget")
    samples = await metric_samples(client, router.url)
    assert sample(samples, "prfaas_router_kv_egress_bytes_total") == 0


async def test_killing_the_prfaas_engines_moves_traffic_local_without_failing_requests(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # three times real time: a 1400-token prefill takes ~1.35 s on the H200 profile; in chunks of
    # 128 tokens its KV leaves chunk by chunk meanwhile (SGLang sends a chunk's KV at its forward's
    # end: in one chunk it would all leave at the end, and no kill could land mid-transfer). At
    # real time the ~0.4 s left after the first chunk was too short on a loaded CI machine: the
    # whole KV had arrived before the kill, and the request was served by the PrfaaS engine.
    doomed = start_engine(
        "p-doomed",
        "prefill",
        "127.0.1.9",
        "h200",
        tmp_path,
        "--chunked-prefill-size",
        "128",
        time_scale="3.0",
    )
    decode = cluster.decode[0]
    try:
        wait_healthy(doomed)
        doc = config_doc([doomed], cluster.local, cluster.decode)
        # passive: health checks too rare to notice, so the request in flight meets the dead engine
        passive = start_router(doc, "--health-interval-seconds", "60")
        active = start_router(doc)  # active checks every second; a refused one ejects at once
        for router in (passive, active):
            warm = await post(client, router.url + "/v1/chat/completions", chat(fresh_long("warm")))
            assert warm.status == 200 and warm.headers["x-prfaas-route"] == "prfaas"

        received = "prfaas_fake_engine_kv_bytes_received_total"
        before = sample(await metric_samples(client, decode.url), received)
        in_flight = asyncio.create_task(
            post(client, passive.url + "/v1/chat/completions", chat(fresh_long("mid")))
        )
        deadline = time.monotonic() + 5
        while sample(await metric_samples(client, decode.url), received) == before:
            assert time.monotonic() < deadline and not in_flight.done(), "no KV byte reached the decode"
            await asyncio.sleep(0.01)
        doomed.process.kill()  # mid-transfer: nothing has reached the client yet
        killed = time.monotonic()
        answer = await in_flight
        assert answer.status == 200, answer.body
        assert (answer.headers["x-prfaas-route"], answer.headers["x-prfaas-reason"]) == (
            "local",
            "prfaas_unavailable",
        )
        assert answer.body["choices"][0]["message"]["content"] == output_text(4)
        samples = await metric_samples(client, passive.url)
        assert sample(samples, "prfaas_router_upstream_retries_total", pool="prfaas_prefill") == 1
        assert sample(samples, "prfaas_router_upstream_retries_total", pool="decode") == 0

        def prfaas_available() -> bool:
            (worker,) = [w for w in active.config_page()["workers"] if w["pool"] == "prfaas_prefill"]
            return bool(worker["available"])

        while prfaas_available():
            await asyncio.sleep(0.02)
        noticed = time.monotonic() - killed
        assert noticed < 2.0, f"the active router took {noticed:.2f} s to eject the dead PrfaaS engine"

        prompts = [chat(fresh_long(f"variant {i}"), stream=i % 2 == 0) for i in range(6)]
        answers = await asyncio.gather(
            *(post(client, r.url + "/v1/chat/completions", p) for r in (passive, active) for p in prompts)
        )
        assert [a.status for a in answers] == [200] * 12
        assert {a.headers["x-prfaas-route"] for a in answers} == {"local"}
        assert http_get(active.url, "/readiness")[0] == 200  # local prefill and decode still serve
    finally:
        doomed.process.stop()


async def test_a_decode_that_dies_mid_stream_ends_the_stream_with_an_error_event(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    doomed = start_engine("d-doomed", "decode", "127.0.2.19", "h20", tmp_path)
    try:
        wait_healthy(doomed)
        router = start_router(config_doc(cluster.prfaas, cluster.local, [doomed]))
        body = chat(SHORT, stream=True, max_tokens=20_000)
        async with client.post(router.url + "/v1/chat/completions", json=body) as reply:
            assert reply.status == 200
            seen = b""
            while b'"content":" ' not in seen:
                seen += await asyncio.wait_for(reply.content.readany(), 5)
            doomed.process.kill()
            seen += await asyncio.wait_for(reply.content.read(), 5)
        last = sse_events(seen.decode())[-1]
        assert (
            last["error"]["type"] == "upstream_error"
            and "after the stream had started" in last["error"]["message"]
        )
        samples = await metric_samples(client, router.url)
        assert sample(samples, "prfaas_router_requests_total", route="local", outcome="stream_error") == 1
        answer = await post(client, router.url + "/v1/chat/completions", chat(SHORT))
        assert answer.status == 503 and answer.body["error"]["code"] == "no_decode"
    finally:
        doomed.process.stop()


async def test_no_healthy_decode_is_a_503_with_a_clear_body(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    nowhere = {"name": "d-missing", "url": f"http://127.0.2.99:{free_port('127.0.2.99')}"}  # nothing listens
    router = start_router(config_doc(cluster.prfaas, cluster.local, [nowhere]), wait_ready=False)
    time.sleep(0.3)  # a health round
    status, body = http_get(router.url, "/readiness")
    assert status == 503 and json.loads(body)["healthy_workers"]["decode"] == 0
    answer = await post(client, router.url + "/v1/chat/completions", chat(SHORT))
    assert answer.status == 503
    assert answer.body["error"]["code"] == "no_decode" and "decode" in answer.body["error"]["message"]


async def test_bad_input_gets_openai_errors_and_breaks_nothing(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = start_router(
        config_doc(cluster.prfaas, cluster.local, cluster.decode), "--max-body-bytes", "65536"
    )
    chat_url = router.url + "/v1/chat/completions"
    cases: list[tuple[str, bytes, int, str | None]] = [
        (chat_url, b'{"messages": [', 400, None),
        (chat_url, json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages"),
        (chat_url, json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages"),
        (chat_url, json.dumps(chat(SHORT, stream="yes")).encode(), 400, "stream"),
        (chat_url, json.dumps(chat(SHORT, max_tokens=-3)).encode(), 400, "max_tokens"),
        (chat_url, json.dumps(chat(SHORT) | {"model": "gpt-9"}).encode(), 404, "model"),
        (router.url + "/v1/completions", json.dumps({"prompt": 42}).encode(), 400, "prompt"),
        (router.url + "/generate", json.dumps({"input_ids": [1, [2], 3]}).encode(), 400, "input_ids"),
        (chat_url, json.dumps(chat("x" * 70_000)).encode(), 413, None),
    ]
    for url, raw, status, param in cases:
        answer = await post(client, url, raw)
        assert answer.status == status, (raw[:60], answer.body)
        error = answer.body["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert error["param"] == param, error
    # refused by the engine itself (its context is 262144, the router's default bound 1048576): its
    # 4xx comes back in the router's shape, nothing is retried
    too_long = await post(
        client, router.url + "/generate", {"text": "y", "sampling_params": {"max_new_tokens": 500_000}}
    )
    assert too_long.status == 400 and "context length" in too_long.body["error"]["message"]
    assert too_long.headers["x-prfaas-route"] == "local" and isinstance(too_long.body["error"]["code"], str)
    unknown = await post(client, router.url + "/v2/anything", b"{}")
    assert unknown.status == 404 and unknown.body["error"]["code"] == "not_found"

    healthy = await post(client, chat_url, chat(SHORT))
    assert healthy.status == 200 and healthy.body["choices"][0]["message"]["content"] == output_text(4)
    samples = await metric_samples(client, router.url)
    assert sample(samples, "prfaas_router_requests_total", route="none", outcome="bad_request") == 9
    assert sample(samples, "prfaas_router_upstream_retries_total", pool="local_prefill") == 0


async def test_a_client_that_goes_away_aborts_its_request_upstream(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = start_router(config_doc(cluster.prfaas, cluster.local, cluster.decode))
    decode = cluster.decode[0]
    aborted_before = sample(await metric_samples(client, decode.url), "sglang:num_aborted_requests_total")
    body = chat(SHORT, stream=True, max_tokens=20_000)  # 20000 x 0.25 ms: far longer than we wait
    async with client.post(router.url + "/v1/chat/completions", json=body) as reply:
        assert reply.status == 200
        seen = b""
        while b'"content":" ' not in seen:  # a real token: the KV has arrived, the decode is generating
            seen += await asyncio.wait_for(reply.content.readany(), 5)

    async def aborted_and_released() -> bool:
        """The decode saw the request aborted and the router let go of its tokens (one 5 s budget for both)."""
        if (
            sample(await metric_samples(client, decode.url), "sglang:num_aborted_requests_total")
            == aborted_before
        ):
            return False
        samples = await metric_samples(client, router.url)
        return sample(samples, "prfaas_router_inflight_tokens", pool="decode") == 0

    await eventually_async(
        aborted_and_released,
        timeout=5,
        interval=0.05,
        what="the decode engine to see the request aborted and the router to release its tokens",
    )
    samples = await metric_samples(client, router.url)
    assert sample(samples, "prfaas_router_requests_total", route="local", outcome="client_disconnected") == 1


async def test_hot_reload_applies_a_changed_config_and_refuses_an_invalid_one(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    doc = config_doc(cluster.prfaas, cluster.local, cluster.decode)
    router = start_router(doc)
    url = router.url + "/v1/chat/completions"
    assert (await post(client, url, chat(LONG))).headers["x-prfaas-route"] == "prfaas"

    async def wait_for(check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The config page once `check` holds for it."""

        def page_if_checked() -> dict[str, Any] | None:
            page = router.config_page()
            return page if check(page) else None

        return await eventually_async(
            page_if_checked, timeout=5, interval=0.05, what="the config page", seen=router.config_page
        )

    # a long-running stream started before the reload must finish afterwards
    slow = asyncio.create_task(post(client, url, chat(SHORT + " slow", stream=True, max_tokens=2000)))
    await asyncio.sleep(0.05)
    router.write_config(doc | {"version": 2, "threshold_tokens": 100_000})
    page = await wait_for(lambda p: p["version"] == 2)
    assert page["threshold_tokens"] == 100_000 and page["last_error"] is None
    again = await post(client, url, chat(LONG + " reloaded"))
    assert (again.headers["x-prfaas-route"], again.headers["x-prfaas-reason"]) == ("local", "short_uncached")
    finished = await slow
    assert finished.status == 200 and finished.body[-1] == "[DONE]"

    router.write_config(doc | {"version": 3, "threshold_tokens": -5})
    page = await wait_for(lambda p: p["last_error"] is not None)
    assert page["version"] == 2 and "threshold_tokens" in page["last_error"]
    assert "keeping version 2" in page["last_error"]
    router.write_config("{ not json")
    await wait_for(lambda p: "Invalid JSON" in (p["last_error"] or ""))
    router.write_config(doc | {"version": 1, "threshold_tokens": 0})
    page = await wait_for(lambda p: "older than the current 2" in (p["last_error"] or ""))
    assert page["threshold_tokens"] == 100_000
    assert (await post(client, url, chat(LONG + " still"))).headers["x-prfaas-route"] == "local"

    samples = await metric_samples(client, router.url)
    assert sample(samples, "prfaas_router_config_reload_errors_total") == 3
    assert sample(samples, "prfaas_router_config_version") == 2
    assert "refused" in router.process.log()


async def test_a_configured_tokenizer_counts_and_hashes_text_prompts_in_real_tokens(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """LONG is 5600 characters: 1400 tokens estimated (over the 1000 threshold), 800 real words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(LONG.split()) | {"and", "one", "more", "question"})
    vocabulary = {"[UNK]": 0} | {word: index + 1 for index, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer_path = tmp_path / "tokenizer.json"
    tokenizer.save(str(tokenizer_path))

    estimating = start_router(config_doc(cluster.prfaas, cluster.local, cluster.decode))
    estimated = await post(client, estimating.url + "/v1/chat/completions", chat(fresh_long("est")))
    assert estimated.headers["x-prfaas-route"] == "prfaas"  # the character estimate is over the threshold

    counting = start_router(
        config_doc(cluster.prfaas, cluster.local, cluster.decode), "--tokenizer", str(tokenizer_path)
    )
    assert counting.config_page()["tokenizer"] == str(tokenizer_path)
    first = await post(client, counting.url + "/v1/chat/completions", chat(LONG))
    follow_up = await post(
        client, counting.url + "/v1/chat/completions", chat(LONG + " and one more question")
    )
    assert (first.status, follow_up.status) == (200, 200)
    routes = [(a.headers["x-prfaas-route"], a.headers["x-prfaas-reason"]) for a in (first, follow_up)]
    assert routes == [("local", "short_uncached")] * 2  # 800 and 804 real tokens, under 1000
    samples = await metric_samples(client, counting.url)
    assert sample(samples, "prfaas_router_prompt_tokens_sum") == 800 + 804
    # the follow-up found the first 12 token blocks of 64 cached: 804 - 768 uncached
    assert sample(samples, "prfaas_router_uncached_tokens_sum", route="local") == 800 + 36
    assert counting.config_page()["prefix_blocks"]["local"] == 800 // 64

    broken = tmp_path / "broken.json"
    broken.write_text("{not a tokenizer")
    refused = Process(
        ["-m", "prfaas_router", "--config", str(counting.config_path), "--tokenizer", str(broken)],
        tmp_path / "refused.log",
    ).start()
    assert refused.popen is not None and refused.popen.wait(30) == 2
    assert "cannot load tokenizer" in refused.log()


async def test_a_decode_full_of_traffic_the_router_never_saw_turns_requests_away_early(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # another router replica's requests hold every slot of the decode (20 on the H20 profile):
    # only the engine's /v1/loads tells this router, which answers 429 decode_wait at once
    decode = start_engine("d-busy", "decode", "127.0.2.12", "h20", tmp_path, time_scale="1.0")
    hogs: list[aiohttp.ClientResponse] = []
    try:
        wait_healthy(decode)
        doc = config_doc(
            cluster.prfaas, cluster.local, [decode], slo={"ttft_seconds": 5.0, "tpot_seconds": 0.05}
        )
        doc["decode"] = {"max_running_requests": 20, "seconds_per_request": 100.0}  # a slot frees every 5 s
        router = start_router(doc, "--load-poll-interval-seconds", "0.2")
        assert (await post(client, router.url + "/v1/chat/completions", chat(SHORT))).status == 200

        elsewhere = {"text": "hi", "bootstrap_host": "2.2.2.2", "bootstrap_room": 0, "stream": True}
        elsewhere["sampling_params"] = {"max_new_tokens": 2000}  # 25 ms per token: 50 s
        for _ in range(21):
            hog = await client.post(decode.url + "/generate", json=elsewhere)
            hogs.append(hog)
        for hog in hogs[:20]:
            await hog.content.readline()  # its first token: it holds a slot
        await asyncio.sleep(0.6)  # a few load polls

        started = time.monotonic()
        refused = await post(client, router.url + "/v1/chat/completions", chat(SHORT))
        assert time.monotonic() - started < 1.0
        assert refused.status == 429 and refused.body["error"]["code"] == "decode_wait", refused
        samples = await metric_samples(client, router.url)
        assert sample(samples, "prfaas_router_decisions_total", reason="decode_wait") == 1

        for hog in hogs:  # the other replica's clients leave: the engine aborts them and frees the slots
            hog.close()
        hogs.clear()

        async def served() -> bool:
            return (await post(client, router.url + "/v1/chat/completions", chat(SHORT))).status == 200

        await eventually_async(
            served, timeout=10, interval=0.2, what="the router to serve once the decode's slots freed"
        )
    finally:
        for hog in hogs:
            hog.close()
        decode.process.stop()


async def transfers(client: aiohttp.ClientSession, url: str) -> float:
    """KV transfers an engine observed, where SGLang counts them (the prefill), each once over its
    ranks' series: the router's own reading (`link_probe.parse_engine_transfers`)."""
    async with client.get(url + "/metrics") as reply:
        assert reply.status == 200
        return parse_engine_transfers(await reply.text()).totals.transfers


@pytest.mark.parametrize("stream", [False, True])
async def test_n_two_on_completions_and_generate_pairs_every_sample_on_a_room_of_its_own(
    cluster: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession, stream: bool
) -> None:
    """n = 2 reaches the engines as two samples with a room each (SGLang pairs every sample of an
    n > 1 request on one room); both samples come back, indexed as n = 2 has them."""
    router = start_router(config_doc(cluster.prfaas, cluster.local, cluster.decode))
    prefills = [*cluster.prfaas, *cluster.local]
    before = [await transfers(client, engine.url) for engine in prefills]
    completion = await post(
        client, router.url + "/v1/completions", {"prompt": SHORT, "max_tokens": 3, "n": 2, "stream": stream}
    )
    assert completion.status == 200, completion.body
    if stream:
        assert completion.body[-1] == "[DONE]"
        indexes = {choice["index"] for event in completion.body[:-1] for choice in event["choices"]}
    else:
        indexes = {choice["index"] for choice in completion.body["choices"]}
        assert [choice["text"] for choice in completion.body["choices"]] == [output_text(3)] * 2
    assert indexes == {0, 1}

    generated = await post(
        client,
        router.url + "/generate",
        {"text": [SHORT, "y" * 40], "sampling_params": {"max_new_tokens": 2, "n": 2}, "stream": stream},
    )
    assert generated.status == 200, generated.body
    if stream:
        assert generated.body[-1] == "[DONE]"
        assert {event["index"] for event in generated.body[:-1]} == {0, 1, 2, 3}
    else:
        assert [item["text"] for item in generated.body] == [output_text(2)] * 4
    after = [await transfers(client, engine.url) for engine in prefills]
    assert sum(after) - sum(before) == 2 + 4  # one KV transfer per sample
