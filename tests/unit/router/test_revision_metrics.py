"""Per-revision (KV fingerprint) attempt metrics: what each attempt's end counts, and that a
revision the config drops leaves no series behind."""

from __future__ import annotations

import pytest
from prfaas_core import metrics_contract as contract
from prfaas_core.router_config import Endpoint
from prfaas_core.routing.workers import CircuitBreaker, Worker
from prfaas_core.vocabulary import Pool
from prfaas_router.metrics import HandoffMetrics, RevisionMetrics
from prfaas_router.proxy import LegFailure, failure_outcome, time_per_output_token
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def attempts(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], fingerprint: str, outcome: str
) -> float:
    key = frozenset({(contract.FINGERPRINT_LABEL, fingerprint), ("outcome", outcome)})
    return found.get((contract.REVISION_ATTEMPTS_TOTAL, key), -1.0)


def fingerprints_in(found: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> set[str]:
    return {
        dict(labels)[contract.FINGERPRINT_LABEL]
        for _, labels in found
        if contract.FINGERPRINT_LABEL in dict(labels)
    }


def test_each_attempt_counts_its_outcome_and_answered_ones_their_ttft_and_tpot() -> None:
    registry = CollectorRegistry()
    revisions = RevisionMetrics(registry)
    revisions.serve(["old", "new", "new"])
    found = samples(registry)
    assert attempts(found, "old", contract.OUTCOME_OK) == 0  # listed: a series at zero, before any attempt
    revisions.attempt("new", contract.OUTCOME_OK, 0.2, 0.03)
    revisions.attempt("new", contract.OUTCOME_DECODE_FAILED, None, None)
    revisions.attempt("new", contract.OUTCOME_DECODE_FAILED, None, None)
    revisions.attempt("old", contract.OUTCOME_OK, 0.1, None)  # a non-streamed answer: no TPOT
    found = samples(registry)
    assert attempts(found, "new", contract.OUTCOME_OK) == 1
    assert attempts(found, "new", contract.OUTCOME_DECODE_FAILED) == 2
    assert attempts(found, "old", contract.OUTCOME_DECODE_FAILED) == -1
    label = frozenset({(contract.FINGERPRINT_LABEL, "new")})
    assert found[(contract.REVISION_TTFT_SECONDS + "_count", label)] == 1
    assert found[(contract.REVISION_TTFT_SECONDS + "_sum", label)] == pytest.approx(0.2)
    assert found[(contract.REVISION_TPOT_SECONDS + "_count", label)] == 1
    old = frozenset({(contract.FINGERPRINT_LABEL, "old")})
    assert found[(contract.REVISION_TTFT_SECONDS + "_count", old)] == 1
    assert found[(contract.REVISION_TPOT_SECONDS + "_count", old)] == 0


def test_a_revision_the_config_drops_loses_its_series_and_its_late_attempts_are_not_counted() -> None:
    registry = CollectorRegistry()
    revisions = RevisionMetrics(registry)
    revisions.serve(["old", "new"])
    revisions.attempt("old", contract.OUTCOME_STREAM_ERROR, 0.3, None)
    revisions.attempt("new", contract.OUTCOME_OK, 0.2, 0.01)
    revisions.serve(["new"])  # the rollout finished
    revisions.attempt("old", contract.OUTCOME_OK, 0.2, 0.01)  # began before, ended after
    found = samples(registry)
    assert fingerprints_in(found) == {"new"}
    assert attempts(found, "new", contract.OUTCOME_OK) == 1
    revisions.serve(["new", "old"])  # listed again (a rollback): counted afresh from zero
    revisions.attempt("old", contract.OUTCOME_OK, 0.2, 0.01)
    found = samples(registry)
    assert fingerprints_in(found) == {"new", "old"}
    assert attempts(found, "old", contract.OUTCOME_OK) == 1
    assert attempts(found, "old", contract.OUTCOME_STREAM_ERROR) == -1


def test_each_kv_handoff_counts_by_route_and_cause_with_the_time_of_the_last() -> None:
    registry = CollectorRegistry()
    handoffs = HandoffMetrics(registry)
    found = samples(registry)

    def count(route: str, outcome: str) -> float:
        key = frozenset({("route", route), ("outcome", outcome)})
        return found.get((contract.KV_HANDOFFS_TOTAL, key), -1.0)

    def last(route: str, outcome: str) -> float | None:
        return found.get(
            (contract.KV_HANDOFF_LAST_SECONDS, frozenset({("route", route), ("outcome", outcome)}))
        )

    # from zero, so increase() sees the first handoff; no time before there was one
    assert (
        count("prfaas", contract.HANDOFF_OK) == 0 and count("prfaas", contract.HANDOFF_BOOTSTRAP_FAILED) == 0
    )
    assert last("prfaas", contract.HANDOFF_OK) is None
    handoffs.record("prfaas", contract.HANDOFF_OK, 100.0)
    handoffs.record("prfaas", contract.HANDOFF_OK, 160.0)
    handoffs.record("prfaas", contract.HANDOFF_BOOTSTRAP_FAILED, 130.0)
    handoffs.record("local", contract.HANDOFF_TRANSFER_FAILED, 150.0)
    found = samples(registry)
    assert count("prfaas", contract.HANDOFF_OK) == 2 and last("prfaas", contract.HANDOFF_OK) == 160.0
    assert count("prfaas", contract.HANDOFF_BOOTSTRAP_FAILED) == 1
    assert last("prfaas", contract.HANDOFF_BOOTSTRAP_FAILED) == 130.0
    assert count("prfaas", contract.HANDOFF_TRANSFER_FAILED) == 0
    assert count("local", contract.HANDOFF_TRANSFER_FAILED) == 1 and count("local", contract.HANDOFF_OK) == 0


def worker(pool: Pool) -> Worker:
    endpoint = Endpoint(
        name=f"{pool.value}-0", url="http://127.0.0.1:1", bootstrap_port=8998, fingerprint="new"
    )
    return Worker(pool, endpoint, CircuitBreaker(3, 1.0))


@pytest.mark.parametrize(
    ("pool", "handoff", "outcome"),
    [
        (Pool.DECODE, None, contract.OUTCOME_DECODE_FAILED),
        (Pool.LOCAL_PREFILL, None, contract.OUTCOME_PREFILL_FAILED),
        (Pool.PRFAAS_PREFILL, None, contract.OUTCOME_PREFILL_FAILED),
        (Pool.DECODE, contract.HANDOFF_TRANSFER_FAILED, contract.OUTCOME_KV_TRANSFER_FAILED),
        (Pool.LOCAL_PREFILL, contract.HANDOFF_BOOTSTRAP_FAILED, contract.OUTCOME_KV_TRANSFER_FAILED),
    ],
)
def test_a_failed_leg_is_named_by_the_handoff_else_by_the_leg_at_fault(
    pool: Pool, handoff: str | None, outcome: str
) -> None:
    assert failure_outcome(LegFailure(worker(pool), "failed", handoff=handoff)) == outcome


@pytest.mark.parametrize(
    ("seconds", "tokens", "samples_", "expected"),
    [
        (0.9, 10, 1, 0.1),  # nine intervals after the first token
        (0.9, 20, 2, 0.1),  # two samples side by side: ten tokens each
        (0.5, 1, 1, None),  # one token: no interval
        (0.5, 3, 2, None),  # 1.5 a sample
        (0.0, 2, 1, 0.0),
    ],
)
def test_tpot_is_the_time_after_the_first_event_per_later_token(
    seconds: float, tokens: int, samples_: int, expected: float | None
) -> None:
    got = time_per_output_token(seconds, tokens, samples_)
    assert got == (None if expected is None else pytest.approx(expected))
