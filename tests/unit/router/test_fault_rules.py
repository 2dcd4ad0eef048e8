"""The router's pure decisions under faults: whom a failure blames, when a slow check is forgiven,
and how an engine's report of a failure is read."""

from __future__ import annotations

import pytest
from prfaas_core import metrics_contract as contract
from prfaas_router.health import busy
from prfaas_router.http.client import UpstreamError
from prfaas_router.proxy import Culprit, at_fault, engine_fault, handoff_cause, reports_handoff, stream_error


@pytest.mark.parametrize(
    ("handoff", "other_out", "culprit"),
    [
        (False, True, Culprit.FAILED_LEG),  # a decode answering 500 while its prefill waits: the decode
        (False, False, Culprit.FAILED_LEG),
        (True, True, Culprit.OTHER_LEG),  # "no KV came" while the peer is still out: the peer
        (True, False, Culprit.FAILED_LEG),  # the peer finished well: the report is the engine's own
    ],
)
def test_a_failure_counts_against_the_failing_leg_unless_it_reports_its_peer(
    handoff: bool, other_out: bool, culprit: Culprit
) -> None:
    assert at_fault(reports_handoff=handoff, other_leg_out=other_out) is culprit


BOOTSTRAP, TRANSFER = contract.HANDOFF_BOOTSTRAP_FAILED, contract.HANDOFF_TRANSFER_FAILED


@pytest.mark.parametrize(
    ("body", "cause"),
    [
        (
            b'{"error": {"message": "bootstrap timed out: no decode connected for bootstrap_room 7"}}',
            BOOTSTRAP,
        ),
        (b'{"message": "bootstrap timed out: the bootstrap server 10.0.0.1:8998 did not answer"}', BOOTSTRAP),
        (
            b'{"message": "KV transfer from 10.0.0.1:8998 for bootstrap_room 3 failed after 0 of 9 bytes"}',
            TRANSFER,  # names its room, not a bootstrap that failed
        ),
        (b'{"message": "Decode transfer failed for request bootstrap_room=5 (injected)"}', TRANSFER),
        (
            b'{"message": "Decode transfer failed for request rank=0 with exception KVTransferError"}',
            TRANSFER,
        ),
        (b'{"message": "Failed to get kvcache from prefill instance"}', TRANSFER),
        (  # real SGLang 0.5.23's decode, its prefill gone (tests/real_sglang/test_differential.py)
            b'{"message": "Decode handshake failed for request rank=0 decode_req.req.rid=\'a\' '
            b"decode_req.req.bootstrap_room=5 with exception KVTransferError(bootstrap_room=5): "
            b'Aborted by AbortReq."}',
            BOOTSTRAP,
        ),
        (b'{"object": "error", "message": "boom", "code": 500}', None),
        (b"", None),
    ],
)
def test_engine_reports_of_a_failed_kv_handoff_are_recognised_by_cause(
    body: bytes, cause: str | None
) -> None:
    assert handoff_cause(body) == cause
    assert reports_handoff(body) is (cause is not None)


@pytest.mark.parametrize(
    ("data", "failed"),
    [
        (b'data: {"error": {"message": "Decode transfer failed", "code": 500}}\n\n', True),  # OpenAI routes
        (  # /generate: the aborted output itself (tokenizer_manager.py _handle_abort_finish_reason)
            b'data: {"text":"","output_ids":[],"meta_info":{"id":"1","finish_reason":'
            b'{"type":"abort","message":"KV transfer failed","status_code":500,"err_type":null}}}\n\n',
            True,
        ),
        (b'data: {"text":" a","meta_info":{"finish_reason":{"type":"length","length":4}}}\n\n', False),
        (b'data: {"text":"\\"finish_reason\\":{\\"type\\":\\"abort\\"","meta_info":{}}\n\n', False),
        (b'data: {"choices":[{"delta":{"content":"\\"error\\": no"}}]}\n\n', False),
    ],
)
def test_an_error_inside_a_200_stream_is_recognised_in_each_of_sglangs_shapes(
    data: bytes, failed: bool
) -> None:
    assert stream_error(data) is failed


def test_only_what_the_engine_did_on_the_wire_is_its_fault() -> None:
    assert engine_fault(UpstreamError("the engine sent invalid HTTP", unreachable=False))
    assert not engine_fault(UnicodeEncodeError("latin-1", "é", 0, 1, "ordinal not in range"))
    assert not engine_fault(KeyError("a bug in the router"))


@pytest.mark.parametrize(
    ("inflight", "heard", "forgiven"),
    [(1, float("inf"), True), (0, 0.2, True), (0, 5.0, False), (0, float("inf"), False)],
)
def test_a_slow_health_check_is_forgiven_while_the_engine_works_for_us(
    inflight: int, heard: float, forgiven: bool
) -> None:
    assert busy(inflight, heard, window_seconds=1.0) is forgiven
