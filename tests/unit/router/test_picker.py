"""The endpoint picker's pure pieces: what Envoy is told (headers, metadata, body chunks), what it
reports back (the served endpoint), the TLS certificate, a lease following the decode that served,
and what is read of the answers it echoes."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2
from prfaas_core.router_config import Endpoint
from prfaas_core.routing.policy import Decision, Reason
from prfaas_core.routing.workers import CircuitBreaker, KvClaim, Worker
from prfaas_core.vocabulary import Pool
from prfaas_router.picker import (
    BODY_CHUNK_BYTES,
    AnswerReader,
    body_piece,
    chunks,
    forged,
    header_map,
    routed,
    self_signed,
    served_endpoint,
    server_credentials,
    subset_hint,
    wire,
)
from prfaas_router.proxy import Lease


def test_a_body_goes_back_in_chunks_of_at_most_62000_bytes_that_add_up_to_it() -> None:
    body = bytes(range(256)) * 900  # 230,400 bytes
    pieces = list(chunks(body))
    assert [len(piece) for piece in pieces] == [62_000, 62_000, 62_000, 44_400]
    assert b"".join(pieces) == body
    assert BODY_CHUNK_BYTES == 62_000
    assert list(chunks(b"")) == [b""]


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, BODY_CHUNK_BYTES])
@pytest.mark.parametrize("last", [False, True])
def test_a_body_piece_encoded_by_hand_is_the_message_envoy_expects(size: int, last: bool) -> None:
    piece = bytes(range(256)) * (size // 256) + bytes(size % 256)
    expected = ext_proc.ProcessingResponse(
        request_body=ext_proc.BodyResponse(
            response=ext_proc.CommonResponse(
                body_mutation=ext_proc.BodyMutation(
                    streamed_response=ext_proc.StreamedBodyResponse(body=piece, end_of_stream=last)
                )
            )
        )
    )
    assert ext_proc.ProcessingResponse.FromString(body_piece(piece, last)) == expected
    assert body_piece(piece, last) == expected.SerializeToString()
    assert wire(body_piece(piece, last)) == wire(expected)


def test_the_reserved_control_headers_a_client_sent_are_found_whatever_their_case() -> None:
    sent = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key="X-Prefiller-Host-Port", raw_value=b"10.0.0.1:8000"),
            base_pb2.HeaderValue(key="x-gateway-inference-objective", raw_value=b"gold"),
            base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
        ]
    )
    headers = header_map(sent)
    assert headers["x-prefiller-host-port"] == "10.0.0.1:8000"
    assert forged(headers) == ["x-gateway-inference-objective", "x-prefiller-host-port"]


def test_the_answer_names_the_decode_in_the_header_and_the_metadata_and_removes_forged_headers() -> None:
    answer = routed("127.0.2.11:30000", 1234, ["x-gateway-destination-endpoint", "x-prefiller-host-port"])
    common = answer.request_headers.response
    assert common.clear_route_cache
    set_headers = {
        option.header.key: option.header.raw_value for option in common.header_mutation.set_headers
    }
    assert set_headers == {"x-gateway-destination-endpoint": b"127.0.2.11:30000", "content-length": b"1234"}
    assert list(common.header_mutation.remove_headers) == ["x-prefiller-host-port"]
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert metadata["x-gateway-destination-endpoint"].string_value == "127.0.2.11:30000"


def test_the_subset_hint_is_read_from_the_filter_metadata_and_absent_means_no_limit() -> None:
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": ["10.0.0.1:8000", "10.0.0.2:8000"]})
    metadata = base_pb2.Metadata(filter_metadata={"envoy.lb.subset_hint": hint})
    assert subset_hint(metadata) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert subset_hint(base_pb2.Metadata()) is None
    empty = struct_pb2.Struct()
    empty.update({"x-gateway-destination-endpoint-subset": []})
    assert subset_hint(base_pb2.Metadata(filter_metadata={"envoy.lb.subset_hint": empty})) == frozenset()


def test_the_self_signed_certificate_is_signed_by_its_own_key_and_valid_from_before_now() -> None:
    now = datetime.datetime(2026, 12, 7, 23, 0, tzinfo=datetime.UTC)
    key_pem, certificate_pem = self_signed(now)
    certificate = x509.load_pem_x509_certificate(certificate_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert certificate.public_key() == key.public_key()
    assert certificate.issuer == certificate.subject
    assert certificate.not_valid_before_utc < now < certificate.not_valid_after_utc
    assert certificate.not_valid_after_utc - now == datetime.timedelta(days=3650)


def test_the_picker_port_is_plain_text_unless_asked_for_tls() -> None:
    assert server_credentials(None, self_signed_tls=False) is None
    assert server_credentials(None, self_signed_tls=True) is not None


def test_in_sidecar_mode_the_answer_names_the_prefill_for_the_sidecar_over_a_forged_one() -> None:
    answer = routed("127.0.2.11:30000", 10, ["x-prefiller-host-port"], prefiller="127.0.1.1:30000")
    mutation = answer.request_headers.response.header_mutation
    set_headers = {option.header.key: option.header.raw_value for option in mutation.set_headers}
    assert set_headers["x-prefiller-host-port"] == b"127.0.1.1:30000"
    assert list(mutation.remove_headers) == []


def test_the_served_endpoint_is_read_from_the_envoy_lb_metadata_and_absent_is_none() -> None:
    metadata = base_pb2.Metadata()
    assert served_endpoint(metadata) is None
    metadata.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint": "10.0.0.1:8000"})
    assert served_endpoint(metadata) is None
    metadata.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": "10.0.0.2:8000"})
    assert served_endpoint(metadata) == "10.0.0.2:8000"


def test_a_lease_moved_to_the_decode_that_served_holds_that_one_and_gives_it_back_there() -> None:
    def worker(pool: Pool, name: str) -> Worker:
        endpoint = Endpoint(name=name, url=f"http://{name}:1", bootstrap_port=8998)
        return Worker(pool, endpoint, CircuitBreaker(3, 1.0))

    prefill, chosen, served = (
        worker(Pool.LOCAL_PREFILL, "l0"),
        worker(Pool.DECODE, "d0"),
        worker(Pool.DECODE, "d1"),
    )
    claim = KvClaim(arrives_at=1.5, due_at=2.0)
    decision = Decision(
        "local", Reason.SHORT_UNCACHED, prefill, chosen, 100, 100, 0.5, 0.0, 0.0, 1.0, kv_claim=claim
    )
    ledger = SimpleNamespace(link_inflight_bytes=0.0, inflight_tokens=dict.fromkeys(Pool, 0))
    lease = Lease(ledger, decision, 1.0)  # type: ignore[arg-type]  # the ledger's two fields
    lease.move_decode(served, 1.2)
    assert lease.decision.decode is served and lease.decision.prefill is prefill
    assert (chosen.inflight, chosen.outstanding_tokens, chosen.claims) == (0, 0, [])
    assert (served.inflight, served.outstanding_tokens, served.claims) == (1, 100, [claim])
    lease.release_prefill()
    lease.release_decode()
    assert (served.inflight, served.outstanding_tokens, served.claims) == (0, 0, [])
    assert ledger.inflight_tokens == dict.fromkeys(Pool, 0)


def test_a_streamed_answer_is_read_as_the_routers_own_path_reads_it_its_first_event_timed() -> None:
    reader = AnswerReader(stream=True, limit=100)
    assert not reader.feed(b"", 1.0)  # no event yet: not its first token
    assert reader.feed(b'data: {"choices":[{"delta":{"content":" a"}}]}\n\n', 2.0)
    assert not reader.feed(b'data: {"choices":[{"delta":{"con', 3.0)  # an event split in two
    assert not reader.feed(b'tent":" b"}}]}\n\ndata: {"error": {"message": "aborted"}}\n\n', 4.0)
    assert reader.answered == 2.0 and reader.counter is not None
    assert reader.counter.output_tokens() == 2 and reader.counter.failed


def test_a_whole_answer_is_counted_from_its_usage_unless_it_was_larger_than_the_router_holds() -> None:
    usage = b'{"choices":[{"message":{"content":" a b"}}],"usage":{"completion_tokens":2}}'
    reader = AnswerReader(stream=False, limit=len(usage))
    assert not reader.feed(usage[:40], 1.0) and not reader.feed(usage[40:], 2.0)
    assert reader.whole(3.0).answered == 3.0 and reader.whole(3.0).output_tokens == 2
    larger = AnswerReader(stream=False, limit=len(usage) - 1)
    larger.feed(usage, 1.0)
    assert larger.whole(2.0).output_tokens is None
