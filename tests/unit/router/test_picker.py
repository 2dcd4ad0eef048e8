"""The endpoint picker's pure pieces: what Envoy is told (headers, metadata, body chunks)."""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from envoy.config.core.v3 import base_pb2
from google.protobuf import struct_pb2
from prfaas_router.picker import (
    BODY_CHUNK_BYTES,
    chunks,
    forged,
    header_map,
    routed,
    self_signed,
    server_credentials,
    subset_hint,
)


def test_a_body_goes_back_in_chunks_of_at_most_62000_bytes_that_add_up_to_it() -> None:
    body = bytes(range(256)) * 900  # 230,400 bytes
    pieces = list(chunks(body))
    assert [len(piece) for piece in pieces] == [62_000, 62_000, 62_000, 44_400]
    assert b"".join(pieces) == body
    assert BODY_CHUNK_BYTES == 62_000
    assert list(chunks(b"")) == [b""]


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
