"""Per-revision (KV fingerprint) metrics of a real router process over real fake engines, as a
rollout's analysis reads them (issue 33): two revisions serve side by side, the new one's decode
fails a share of its attempts and is slower; the router's retries on the old revision save every
client, yet the new revision's attempts show its failures, and its TPOT its slowness. A config
that drops the new revision drops its series. A failed KV handoff and a client that left are
counted by their cause, and the handoffs by route (what the operator reads as the data path).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest
from prfaas_core import metrics_contract as contract
from prfaas_engine_sim.server import ErrorFaults
from prfaas_testbed.polling import eventually, eventually_async
from router_harness import (
    SHORT,
    Cluster,
    Engine,
    RouterFactory,
    chat,
    config_doc,
    http_get,
    metric_samples,
    running,
    sample,
    start_engine,
    total,
)
from router_harness import post as post_json

pytestmark = pytest.mark.timeout(120)

FINGERPRINT_ENV = "PRFAAS_KV_FINGERPRINT"
ERROR_RATIO, SEED, SLOWDOWN = 0.3, 3, 3.0
DECODE_TIME_SCALE = "0.2"  # 5 ms a token (15 ms slowed): TPOT well above the relay's own time
CHAT_PATH = "/v1/chat/completions"
KEEP_NEW_IN_SERVICE = ("--breaker-failure-threshold", "1000")
"""The analysis, not the breaker, is to judge the new revision: its decode stays routable."""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def two_revisions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("revisions")

    def engine(name: str, mode: str, host: str, profile: str, revision: str, *extra: str) -> Engine:
        time_scale = DECODE_TIME_SCALE if mode == "decode" else "0.01"
        env = {FINGERPRINT_ENV: revision}
        return start_engine(name, mode, host, profile, logs, *extra, time_scale=time_scale, env=env)

    faults = (
        "--fault-error-ratio",
        str(ERROR_RATIO),
        "--fault-seed",
        str(SEED),
        "--fault-slowdown",
        str(SLOWDOWN),
    )
    with running(
        Cluster(
            prfaas=[engine("p-old", "prefill", "127.0.1.81", "h200", "old")],
            local=[
                engine("l-old", "prefill", "127.0.2.81", "h20", "old"),
                engine("l-new", "prefill", "127.0.2.82", "h20", "new"),
            ],
            decode=[
                engine("d-old", "decode", "127.0.2.91", "h20", "old"),
                engine("d-new", "decode", "127.0.2.92", "h20", "new", *faults),
            ],
        )
    ) as engines:
        yield engines


def revisions_doc(cluster: Cluster, *, with_new: bool, version: int) -> dict[str, object]:
    revision = {"p-old": "old", "l-old": "old", "l-new": "new", "d-old": "old", "d-new": "new"}
    local = [e for e in cluster.local if with_new or revision[e.name] == "old"]
    decode = [e for e in cluster.decode if with_new or revision[e.name] == "old"]
    doc = config_doc(cluster.prfaas, local, decode, fingerprint="new" if with_new else "old", version=version)
    for endpoints in doc["pools"].values():
        for endpoint in endpoints:
            endpoint["fingerprint"] = revision[endpoint["name"]]
    return doc


def attempts(samples: Samples, fingerprint: str, outcome: str | None = None) -> float:
    labels = {contract.FINGERPRINT_LABEL: fingerprint} | ({} if outcome is None else {"outcome": outcome})
    return total(samples, contract.REVISION_ATTEMPTS_TOTAL, **labels)


def histogram(samples: Samples, name: str, fingerprint: str) -> tuple[float, float]:
    """(count, sum) of one revision's histogram."""
    labels = {contract.FINGERPRINT_LABEL: fingerprint}
    return sample(samples, name + "_count", **labels), sample(samples, name + "_sum", **labels)


def outcomes(samples: Samples, fingerprint: str) -> set[str]:
    return {
        dict(labels)["outcome"]
        for (name, labels), value in samples.items()
        if name == contract.REVISION_ATTEMPTS_TOTAL
        and dict(labels).get(contract.FINGERPRINT_LABEL) == fingerprint
        and value > 0
    }


async def test_each_revision_counts_its_own_attempts_and_times_and_a_dropped_one_leaves_no_series(
    two_revisions: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = start_router(revisions_doc(two_revisions, with_new=True, version=1), *KEEP_NEW_IN_SERVICE)
    streamed, plain = 90, 30
    bodies = [chat(f"{SHORT} s{i}", max_tokens=8, stream=True) for i in range(streamed)]
    bodies += [chat(f"{SHORT} p{i}", max_tokens=8) for i in range(plain)]
    gate = asyncio.Semaphore(6)

    async def one(body: dict[str, object]) -> int:
        async with gate:
            return (await post_json(client, router.url + CHAT_PATH, body)).status

    statuses = await asyncio.gather(*(one(body) for body in bodies))
    assert statuses == [200] * len(bodies)  # the old revision took every retry
    found = await metric_samples(client, router.url)
    d_new = await metric_samples(client, two_revisions.decode[1].url)

    new_ok = attempts(found, "new", contract.OUTCOME_OK)
    new_failed = attempts(found, "new", contract.OUTCOME_DECODE_FAILED)
    old_ok = attempts(found, "old", contract.OUTCOME_OK)
    new_all = attempts(found, "new")
    print(f"new: {new_ok:.0f} ok, {new_failed:.0f} failed; old: {old_ok:.0f} ok")
    assert outcomes(found, "old") == {contract.OUTCOME_OK}
    assert outcomes(found, "new") == {contract.OUTCOME_OK, contract.OUTCOME_DECODE_FAILED}
    # each client request ended in exactly one good attempt; each failed one was retried once
    assert new_ok + old_ok == len(bodies)
    assert new_failed == sample(found, contract.PREFIX + "upstream_retries_total", pool="decode")
    # the router's count of the new revision's answers is the engine's own
    assert new_ok == total(d_new, "sglang:num_requests_total")
    assert new_all >= 20, "too few attempts on the new revision to judge its error ratio"
    assert 0.15 <= new_failed / new_all <= 0.45  # ERROR_RATIO, over a bounded sample
    # every attempt on the new revision was one draw of its decode's seeded faults, in order
    draws = ErrorFaults(ERROR_RATIO, SEED)
    assert new_failed == sum(draws.take() for _ in range(int(new_all)))

    for fingerprint, answered in (("new", new_ok), ("old", old_ok)):
        ttft_count, _ = histogram(found, contract.REVISION_TTFT_SECONDS, fingerprint)
        assert ttft_count == answered  # only attempts that answered have a TTFT
    tpot = {fp: histogram(found, contract.REVISION_TPOT_SECONDS, fp) for fp in ("new", "old")}
    assert tpot["new"][0] + tpot["old"][0] == streamed  # streamed answers only, one each
    assert tpot["new"][0] > 0 and tpot["old"][0] > 0
    mean_new, mean_old = (tpot[fp][1] / tpot[fp][0] for fp in ("new", "old"))
    print(f"TPOT mean: new {mean_new * 1000:.2f} ms, old {mean_old * 1000:.2f} ms")
    assert mean_new > SLOWDOWN / 2 * mean_old  # the relay's own time per token, under load, narrows it

    router.write_config(revisions_doc(two_revisions, with_new=False, version=2))  # rolled back
    eventually(
        lambda: router.config_page()["version"] == 2, timeout=10.0, interval=0.05, what="config v2 applied"
    )
    status, _ = http_get(router.url, "/readiness")
    assert status == 200
    after = await metric_samples(client, router.url)
    revision_series = {
        dict(labels).get(contract.FINGERPRINT_LABEL)
        for (name, labels) in after
        if name.startswith(contract.PREFIX + "revision_")
    }
    assert revision_series == {"old"}
    assert attempts(after, "old", contract.OUTCOME_OK) == old_ok  # the kept revision keeps its counts


async def test_a_failed_kv_handoff_and_a_client_that_left_are_counted_by_their_cause(
    two_revisions: Cluster, start_router: RouterFactory, client: aiohttp.ClientSession
) -> None:
    router = start_router(revisions_doc(two_revisions, with_new=False, version=1), *KEEP_NEW_IN_SERVICE)
    d_old = two_revisions.decode[0]
    async with client.post(d_old.url + "/fake/fail_kv_transfers", json={"count": 1}) as armed:
        assert armed.status == 200
    answers = [await post_json(client, router.url + CHAT_PATH, chat(f"{SHORT} kv{i}")) for i in range(3)]
    body = chat(f"{SHORT} gone", max_tokens=2000, stream=True)  # 10 s of tokens: the client leaves first
    async with client.post(router.url + CHAT_PATH, json=body) as streaming:
        assert streaming.status == 200
        await streaming.content.readuntil(b"\n\n")  # the first event, then the connection closes
    found = await metric_samples(client, router.url)
    # the first attempt's decode reported the handoff failed, and no other decode was left to retry on
    assert [a.status for a in answers] == [503, 200, 200]
    assert attempts(found, "old", contract.OUTCOME_KV_TRANSFER_FAILED) == 1
    assert attempts(found, "old", contract.OUTCOME_OK) == 2

    async def scraped() -> Samples:
        return await metric_samples(client, router.url)

    found = await eventually_async(
        scraped,
        timeout=10.0,
        interval=0.05,
        what="the attempt the client left counted",
        until=lambda now: attempts(now, "old", contract.OUTCOME_CLIENT_DISCONNECTED) == 1,
    )
    assert attempts(found, "old", contract.OUTCOME_CLIENT_DISCONNECTED) == 1
    assert outcomes(found, "old") == {
        contract.OUTCOME_OK,
        contract.OUTCOME_KV_TRANSFER_FAILED,
        contract.OUTCOME_CLIENT_DISCONNECTED,
    }
    ttft_count, _ = histogram(found, contract.REVISION_TTFT_SECONDS, "old")
    tpot_count, _ = histogram(found, contract.REVISION_TPOT_SECONDS, "old")
    assert ttft_count == 3  # two answers and the stream the client left: all answered
    assert tpot_count == 0  # no stream completed
    # the data path's view (short prompts: the local route): the decode's report names the transfer
    handoffs = {
        outcome: sample(found, contract.KV_HANDOFFS_TOTAL, route="local", outcome=outcome)
        for outcome in (contract.HANDOFF_OK, *contract.HANDOFF_FAILURES)
    }
    assert handoffs == {
        contract.HANDOFF_OK: 3,  # the decode answered: its KV had arrived (the client left later)
        contract.HANDOFF_TRANSFER_FAILED: 1,
        contract.HANDOFF_BOOTSTRAP_FAILED: 0,
    }
    failed_at = sample(
        found, contract.KV_HANDOFF_LAST_SECONDS, route="local", outcome=contract.HANDOFF_TRANSFER_FAILED
    )
    assert failed_at <= sample(
        found, contract.KV_HANDOFF_LAST_SECONDS, route="local", outcome=contract.HANDOFF_OK
    )
