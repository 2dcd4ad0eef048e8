"""The router in front of real SGLang on CPU: every API, the greedy tokens, health, loads, the
link estimate and Prometheus (the fleet: conftest.py)."""

from __future__ import annotations

import asyncio
import math
import subprocess
import time
from typing import Any

import aiohttp
import pytest
from prfaas_core import metrics_contract as contract
from prfaas_core.planning import Observation
from prfaas_core.router_config import RouterConfig
from prfaas_core.routing.identity import SERVER_INFO_PATH, engine_identity_problem
from prfaas_core.vocabulary import Pool, Role
from prfaas_operator.adapters.prometheus import PrometheusObserver, SeriesSelector
from prfaas_operator.planning.manifests import Names
from prfaas_testbed import sglang_cpu
from prfaas_testbed.polling import eventually_async
from prfaas_testbed.prometheus import ScrapeJob, TargetGroup, start_prometheus
from real_fleet import ADDRESSES, Fleet
from router_harness import metric_samples, post, sample, total

pytestmark = pytest.mark.timeout(600)

MODEL = sglang_cpu.SERVED_MODEL
SHORT = "hello world, route this short prompt to the local prefill"  # 33 tokens
LONG = " ".join(f"w{i:05d}" for i in range(0, 2100, 7))  # 1469 tokens: over the threshold
MAX_TOKENS = 8


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **extra,
    }


def completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def generate(text: str, stream: bool = False, **sampling: Any) -> dict[str, Any]:
    sampling_params = {"max_new_tokens": MAX_TOKENS, "temperature": 0, **sampling}
    return {"text": text, "stream": stream, "sampling_params": sampling_params}


API = {"/v1/chat/completions": chat, "/v1/completions": completion, "/generate": generate}


def texts(path: str, body: Any, stream: bool) -> list[str]:
    """The generated text of each choice (or each output of /generate), streamed or not."""
    if stream:  # SSE events
        events = [e for e in body if e != "[DONE]"]
        assert body[-1] == "[DONE]" or path == "/generate", body[-3:]
        found: dict[int, str] = {}
        for event in events:
            assert "error" not in event, event
            if path == "/generate":
                found[event.get("index", 0)] = event["text"]  # cumulative in SGLang's stream
            else:
                for choice in event["choices"]:
                    piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                    found[choice["index"]] = found.get(choice["index"], "") + (piece or "")
        return [found[i] for i in sorted(found)]
    if path == "/generate":
        return [item["text"] for item in (body if isinstance(body, list) else [body])]
    return [c["message"]["content"] if "message" in c else c["text"] for c in body["choices"]]


async def test_the_cpu_workarounds_hold_against_the_installed_sglang() -> None:
    check = subprocess.run(
        [str(sglang_cpu.engine_python()), "-m", "prfaas_sglang_cpu", "check"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


async def test_each_engine_is_the_one_the_router_checks_an_unobserved_endpoint_for(
    fleet: Fleet, client: aiohttp.ClientSession
) -> None:
    """The identity the router asks of an engine the operator lists from memory holds for real
    SGLang started as the operator starts it, and a wrong bootstrap port is named."""
    config = RouterConfig.from_json(fleet.router.config_path.read_text())
    checked = []
    for pool in Pool:
        for endpoint in config.pools.of(pool):
            async with client.get(endpoint.url + SERVER_INFO_PATH) as answer:
                assert answer.status == 200
                info = await answer.json()
            problem = engine_identity_problem(info, pool, config.served_model_name, endpoint.bootstrap_port)
            assert problem is None, (endpoint.name, problem)
            checked.append(pool)
            if pool is Pool.PRFAAS_PREFILL:
                wrong = engine_identity_problem(info, pool, config.served_model_name, 9)
                assert wrong == f"disaggregation_bootstrap_port is {endpoint.bootstrap_port}, not 9"
    assert sorted(checked) == sorted(Pool), "one engine of each pool"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", list(API))
async def test_every_api_answers_the_plain_servers_greedy_tokens_on_both_routes(
    fleet: Fleet, client: aiohttp.ClientSession, path: str, stream: bool
) -> None:
    fresh = f"[{path} stream={stream}] {LONG}"  # a long prompt already served is cached locally (issue 34)
    for prompt, route in ((SHORT, "local"), (fresh, "prfaas")):
        body = API[path](prompt, stream=stream)
        reference = await post(client, fleet.reference.url + path, body)
        answer = await post(client, fleet.router.url + path, body)
        assert reference.status == 200, reference.body
        assert answer.status == 200, answer.body
        assert answer.headers["x-prfaas-route"] == route
        expected, got = texts(path, reference.body, stream), texts(path, answer.body, stream)
        assert got == expected and len(got[0]) > 0


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
async def test_n_2_answers_two_greedy_choices_equal_to_the_plain_servers(
    fleet: Fleet, client: aiohttp.ClientSession, path: str
) -> None:
    prompt = f"[n=2 {path}] {LONG}"
    body = completion(prompt, n=2) if path == "/v1/completions" else generate(prompt, n=2)
    reference = await post(client, fleet.reference.url + path, body)
    answer = await post(client, fleet.router.url + path, body)
    assert answer.status == 200, answer.body
    got = texts(path, answer.body, False)
    assert len(got) == 2 and got == texts(path, reference.body, False)


async def test_a_different_prefix_changes_the_greedy_tokens(
    fleet: Fleet, client: aiohttp.ClientSession
) -> None:
    """The KV that crossed decides the answer: equal outputs above are not a constant model."""
    first = await post(client, fleet.router.url + "/generate", generate("[one] " + LONG))
    other = await post(client, fleet.router.url + "/generate", generate("[other] " + LONG))
    assert first.status == other.status == 200
    assert first.body["output_ids"] != other.body["output_ids"]


async def test_the_prefill_moved_the_prompts_kv_over_mooncake(
    fleet: Fleet, client: aiohttp.ClientSession
) -> None:
    prefill = fleet.engine(Role.PRFAAS_PREFILL).url
    before = await metric_samples(client, prefill)
    prompt = "[kv] " + LONG
    answer = await post(client, fleet.router.url + "/generate", generate(prompt))
    assert answer.status == 200 and answer.headers["x-prfaas-route"] == "prfaas"
    tokens = answer.body["meta_info"]["prompt_tokens"]
    after = await metric_samples(client, prefill)
    moved = total(after, contract.ENGINE_KV_TRANSFER_TOTAL_MB + "_sum") - total(
        before, contract.ENGINE_KV_TRANSFER_TOTAL_MB + "_sum"
    )
    pages = math.ceil(tokens / sglang_cpu.PAGE_SIZE)
    assert moved * contract.BYTES_PER_MIB == pytest.approx(
        pages * sglang_cpu.PAGE_SIZE * sglang_cpu.KV_BYTES_PER_TOKEN, rel=0.02
    )


async def test_every_loads_report_is_accepted_and_the_link_estimate_follows_real_transfers(
    fleet: Fleet, client: aiohttp.ClientSession
) -> None:
    for i in range(4):
        answer = await post(client, fleet.router.url + "/generate", generate(f"[link {i}] {LONG}"))
        assert answer.status == 200
    samples: dict[tuple[str, frozenset[Any]], float] = {}

    async def link_measured() -> float:
        nonlocal samples
        samples = await metric_samples(client, fleet.router.url)
        return sample(samples, contract.LINK_MEASURED_BYTES_PER_SECOND)

    measured = await eventually_async(
        link_measured,
        timeout=30,
        interval=1,
        until=lambda value: value > 0,
        retry_on=(),
        what="the link estimate to see a real transfer",
    )
    assert measured > 0 and not math.isnan(measured), "the link estimate never saw a real transfer"
    assert sample(samples, contract.LINK_ESTIMATE_BYTES_PER_SECOND) <= 12.5e9  # never above the configured
    assert total(samples, contract.PREFIX + "engine_reports_refused_total") == 0
    assert total(samples, contract.PREFIX + "engine_failures_total") == 0


async def test_an_idle_fleet_stays_healthy_for_15_seconds(
    fleet: Fleet, client: aiohttp.ClientSession
) -> None:
    workers = {
        (Pool.PRFAAS_PREFILL.value, "tiny-prfaas-prefill-0"),
        (Pool.LOCAL_PREFILL.value, "tiny-pd-prefill-0"),
        (Pool.DECODE.value, "tiny-pd-decode-0"),
    }
    for _ in range(16):
        samples = await metric_samples(client, fleet.router.url)
        available = {
            w: sample(samples, contract.PREFIX + "worker_available", pool=w[0], worker=w[1]) for w in workers
        }
        assert set(available.values()) == {1.0}, available
        await asyncio.sleep(1)
    assert total(samples, contract.PREFIX + "engine_failures_total") == 0


async def test_prometheus_scrapes_the_real_engines_and_the_planner_reads_every_query(
    fleet: Fleet, client: aiohttp.ClientSession
) -> None:
    namespace = fleet.cr["metadata"]["namespace"]
    names = Names.of(fleet.cr["metadata"]["name"])
    workloads = {
        Role.PRFAAS_PREFILL: names.prfaas_prefill,
        Role.PD_PREFILL: names.pd_prefill,
        Role.PD_DECODE: names.pd_decode,
    }
    engine_groups = [
        TargetGroup(
            [fleet.engine(role).url.removeprefix("http://")], {"namespace": namespace, "pod": f"{w}-0"}
        )
        for role, w in workloads.items()
    ]
    router_group = TargetGroup(
        [fleet.router.url.removeprefix("http://")], {"namespace": namespace, "pod": f"{names.router}-0"}
    )
    with start_prometheus(
        fleet.logs / "prometheus", jobs=[ScrapeJob("engines"), ScrapeJob("router")]
    ) as prometheus:
        prometheus.write_targets("engines", engine_groups)
        prometheus.write_targets("router", [router_group])
        prometheus.wait_for(
            "count(up == 1)",
            until=lambda result: bool(result) and float(result[0]["value"][1]) == 4,
            timeout_s=60,
        )
        await asyncio.sleep(2)  # a scrape before the requests: increase() needs the series' start
        for i in range(6):
            prompt = f"[prom {i}] {LONG}" if i % 2 else f"[prom {i}] {SHORT}"
            assert (
                await post(client, fleet.router.url + "/v1/completions", completion(prompt))
            ).status == 200
        observer = PrometheusObserver(prometheus.url, min_requests=1)
        selector = SeriesSelector.for_deployment(namespace, fleet.cr["metadata"]["name"], namespace)

        def complete(observation: Any) -> bool:
            return (
                isinstance(observation, Observation)
                and len(observation.queue_depths) == 3
                and observation.measured_link_bytes_per_second is not None
            )

        async def observed() -> Any:
            observation = observer.observe(selector, 60)
            if not complete(observation):
                # more offloads, so the link estimate has recent transfers to measure
                await post(
                    client, fleet.router.url + "/v1/completions", completion(f"[prom {time.time()}] {LONG}")
                )
            return observation

        try:
            observation = await eventually_async(
                observed,
                timeout=45,
                interval=1,
                until=complete,
                retry_on=(),
                what="an observation with three queue depths and a measured link",
            )
        finally:
            observer.close()
    assert isinstance(observation, Observation), observation
    assert set(observation.queue_depths) == {r.value for r in ADDRESSES}, observation
    # increase() extrapolates over the window: six requests read as 5.3 in one CI run
    assert observation.requests > 0 and observation.arrival_rps is not None and observation.arrival_rps > 0
    assert 0 < observation.offloaded_fraction < 1
    assert observation.egress_bytes_per_second is not None and observation.egress_bytes_per_second > 0
    # bytes per second, as the router's own gauge says (not MiB, not Gbit)
    assert observation.measured_link_bytes_per_second is not None
    assert 1e3 < observation.measured_link_bytes_per_second < 1e12
