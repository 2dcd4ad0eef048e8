"""The router as an endpoint picker behind a gateway: Envoy's external processing (ext_proc) over gRPC.

One policy, two fronts: a request that comes through Envoy goes through the same intake
(`RouterService.intake`), decision (`Dispatcher.view`, `Dispatcher.choose`: admission, link
budget, breakers, metrics) and PD start (`Dispatcher.begin` or `Dispatcher.lease`) as one the
router serves itself. What differs is who carries the decode leg: Envoy does, to the endpoint
named in the header `x-gateway-destination-endpoint` (and the same value in the dynamic metadata
`envoy.lb`/`x-gateway-destination-endpoint`), as the Gateway API Inference Extension's
endpoint-picker protocol has it. Who fires the prefill leg is the router's `--picker-pd-mode`:
`picker` (the default) fires it itself, local or PrfaaS, with the body's bootstrap fields
rewritten as the router's own path does, and hands Envoy that body, so no sidecar is needed on the
decode; `sidecar` fires nothing and names the chosen prefill (`host:port`) in the request header
`x-prefiller-host-port` for llm-d's decode sidecar, which writes its own bootstrap fields (one
bootstrap port for every prefill, its SGLANG_BOOTSTRAP_PORT) and sends the prefill itself.

Protocol (Envoy's ext_proc filter, bodies in `FULL_DUPLEX_STREAMED`): the request's headers,
then its body in chunks, are read whole; the answer is the headers' mutation (destination,
Content-Length, the prefill in sidecar mode, the clients' forged control headers removed, the
route cache cleared), then the new body in chunks of at most `BODY_CHUNK_BYTES`. A gateway's
subset hint (`envoy.lb.subset_hint` in the request's metadata) limits the decodes the policy may
choose. A refusal is an immediate response in the router's error shape: 429 when admission sheds,
503 when nothing is routable. The decode's response headers close the attempt's accounting (its
breaker, the prefix index; in sidecar mode the prefill's part of the lease and the link budget
too, as the last the picker sees of a prefill it did not send). When the gateway reports that
another endpoint served (`envoy.lb`/`x-gateway-destination-endpoint-served` in the response's
metadata) the accounting follows that decode; in picker mode that is an error too (the room was
bound to the chosen decode), logged and counted as the outcome `served_elsewhere`. A prefill leg
of the picker's that fails before the decode answered ends the request with a 502 immediate
response, which makes Envoy reset the decode's connection, so the decode does not sit in its
bootstrap wait. No fallback endpoint is offered: once the room is bound, another decode could not
pull its KV.

When the gateway streams the answer through the picker too (`response_body_mode:
FULL_DUPLEX_STREAMED`, as the inference extension's gateways configure it), each piece is echoed
unchanged at once, then read as the router's own path reads the decode's answer, through the same
code (`EventCounter`, `Dispatcher.first_event`, `Dispatcher.stream_ended`): a stream's first event
is the route's TTFT, its output tokens and TPOT are counted, and SGLang's error event in it makes
the attempt a `stream_error` against the decode; a whole answer (`AnswerReader`, held up to the
router's answer limit) gives its output tokens from its usage. With `response_body_mode: NONE` the
picker never sees the answer: those figures then come from the router's own front only.

The picker port serves TLS with `--picker-tls-dir` (a kubernetes.io/tls Secret's files) or
`--picker-tls-self-signed` (made at start); the health port stays plain text.

Not done yet: a streamed answer the client leaves before its end counts as its status had it (the
picker cannot tell the client's leaving from the decode's), and is not cut at the request's token
bound or time limit; in sidecar mode the prefill's failures are seen only as its decode's.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prfaas_core import metrics_contract as contract
from prfaas_core.routing.policy import Decision
from prfaas_core.routing.workers import Worker
from prfaas_core.vocabulary import Pool

from prfaas_router.app import RouterService, error_answer
from prfaas_router.http.server import Answer, body_too_large
from prfaas_router.payloads import ApiError, Kind, completion_tokens, request_id
from prfaas_router.proxy import (
    REASON_HEADER,
    REQUEST_ID_HEADER,
    ROUTE_HEADER,
    Dispatcher,
    EventCounter,
    Exchange,
    Lease,
    Measured,
    error_response,
)
from prfaas_router.settings import PD_MODE_SIDECAR

log = logging.getLogger("prfaas_router.picker")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""Where Envoy sends the request (`ip:port`), in a header and in the dynamic metadata below."""
DESTINATION_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
"""Where the gateway reports the endpoint that served (`ip:port`), in the response's metadata under
`envoy.lb` (the same namespace as the destination's)."""
PREFILLER_HEADER = "x-prefiller-host-port"
"""In sidecar mode, the prefill (`host:port` of its HTTP port) llm-d's decode sidecar sends the
request to."""
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
"""The gateway's hint, in the request's filter metadata: the endpoints (`ip:port`) to pick from."""
RESERVED_HEADERS = (
    DESTINATION_HEADER,
    SUBSET_KEY,
    SERVED_KEY,
    "x-gateway-inference-objective",
    "x-gateway-inference-fairness-id",
    "x-gateway-model-name-rewrite",
    PREFILLER_HEADER,
)
"""Control headers only the gateway's picker sets: removed from every client request."""
BODY_CHUNK_BYTES = 62_000
"""The largest body chunk sent back to Envoy (what the inference extension's picker uses)."""
SELF_SIGNED_DAYS = 3650
"""A self-signed certificate lives as long as the process; ten years, as the inference extension's."""
LIVENESS = "liveness"
READINESS = "readiness"
_KINDS = {kind.value: kind for kind in Kind}


def header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    """Envoy's headers by lowercase name (it sends values as raw bytes; later repeats win)."""
    return {
        header.key.lower(): header.raw_value.decode("latin-1") if header.raw_value else header.value
        for header in headers.headers
    }


def forged(headers: Mapping[str, str]) -> list[str]:
    """The reserved control headers a client sent: the gateway alone may set them."""
    return [name for name in RESERVED_HEADERS if name in headers]


def subset_hint(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The endpoints the gateway allows for this request; None when it sent no hint (then any
    decode of the pool may serve)."""
    namespace = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    return frozenset(value.string_value for value in namespace.fields[SUBSET_KEY].list_value.values)


def served_endpoint(metadata: base_pb2.Metadata) -> str | None:
    """The endpoint the gateway reports as the one that served (the protocol's
    `envoy.lb`/`x-gateway-destination-endpoint-served`); None when it reports none (a plain Envoy)."""
    namespace = metadata.filter_metadata.get(DESTINATION_NAMESPACE)
    if namespace is None or SERVED_KEY not in namespace.fields:
        return None
    return namespace.fields[SERVED_KEY].string_value or None


def outside(subset: frozenset[str] | None, decodes: Iterable[Worker]) -> set[Worker]:
    """The decodes a subset hint rules out (an empty subset rules out every one: 503)."""
    if subset is None:
        return set()
    return {worker for worker in decodes if urlsplit(worker.url).netloc not in subset}


def chunks(body: bytes, size: int = BODY_CHUNK_BYTES) -> Iterator[bytes]:
    """The body in pieces of at most `size` bytes; one empty piece for an empty body."""
    if not body:
        yield b""
    for start in range(0, len(body), size):
        yield body[start : start + size]


def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode("latin-1")),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def immediate(answer: Answer) -> ext_proc.ProcessingResponse:
    """The router's own answer (an error, in its usual shape) sent by Envoy instead of upstream's."""
    mutation = ext_proc.HeaderMutation(set_headers=[_set(k, v) for k, v in answer.headers.items()])
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=answer.status),
            headers=mutation,
            body=answer.body,
        )
    )


def routed(
    destination: str, body_bytes: int, removed: list[str], prefiller: str | None = None
) -> ext_proc.ProcessingResponse:
    """The request headers' answer: where to send it, the new body's length, the prefill for the
    decode's sidecar when given (`host:port`), forged headers gone."""
    set_headers = [_set(DESTINATION_HEADER, destination), _set("content-length", str(body_bytes))]
    if prefiller is not None:
        set_headers.append(_set(PREFILLER_HEADER, prefiller))
    overwritten = {option.header.key for option in set_headers}
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(
            response=ext_proc.CommonResponse(
                header_mutation=ext_proc.HeaderMutation(
                    set_headers=set_headers,
                    remove_headers=[name for name in removed if name not in overwritten],
                ),
                clear_route_cache=True,
            )
        ),
        dynamic_metadata={DESTINATION_NAMESPACE: {DESTINATION_HEADER: destination}},
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field_number(message: Any, name: str) -> int:
    return int(message.DESCRIPTOR.fields_by_name[name].number)


_PIECE_PATH = tuple(
    _field_number(message, name)
    for message, name in (
        (ext_proc.ProcessingResponse, "request_body"),
        (ext_proc.BodyResponse, "response"),
        (ext_proc.CommonResponse, "body_mutation"),
        (ext_proc.BodyMutation, "streamed_response"),
        (ext_proc.StreamedBodyResponse, "body"),
    )
)
_END_OF_STREAM = _varint(_field_number(ext_proc.StreamedBodyResponse, "end_of_stream") << 3) + b"\x01"


def body_piece(piece: bytes, last: bool) -> bytes:
    """A piece of the new body: the wire bytes of a `ProcessingResponse` (request_body, its
    streamed_response), encoded here so that the piece is copied once (building the message and
    serialising it copied it twice more: about 0.1 ms of a 220 KB request's CPU)."""
    *outer, inner = _PIECE_PATH
    parts = [_varint(inner << 3 | 2) + _varint(len(piece)), piece] if piece else []
    if last:
        parts.append(_END_OF_STREAM)
    size = sum(map(len, parts))
    for field in reversed(outer):
        parts.insert(0, _varint(field << 3 | 2) + _varint(size))
        size += len(parts[0])
    return b"".join(parts)


def wire(response: ext_proc.ProcessingResponse | bytes) -> bytes:
    """A response as gRPC sends it (the picker's serializer): the body's pieces come encoded."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_picker(server: grpc.aio.Server, picker: Picker) -> None:
    """`add_ExternalProcessorServicer_to_server` with `wire` as the responses' serializer."""
    name = ext_proc.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
    handlers = {
        "Process": grpc.stream_stream_rpc_method_handler(
            picker.Process,
            request_deserializer=ext_proc.ProcessingRequest.FromString,
            response_serializer=wire,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def answered_headers(decision: Decision) -> ext_proc.ProcessingResponse:
    """The decode's response headers, with the route headers the router's own path adds."""
    mutation = ext_proc.HeaderMutation(
        set_headers=[_set(ROUTE_HEADER, decision.route), _set(REASON_HEADER, decision.reason.value)]
    )
    return ext_proc.ProcessingResponse(
        response_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(header_mutation=mutation))
    )


class AnswerReader:
    """What the picker reads of the decode's answer while it echoes it (when the gateway streams
    answers through it), as the router's own path reads it: a stream's events counted by
    `EventCounter`, a whole answer held up to `limit` bytes for its usage (`completion_tokens`)."""

    __slots__ = ("_body", "_limit", "answered", "counter")

    def __init__(self, stream: bool, limit: int) -> None:
        self.counter = EventCounter() if stream else None
        self._body: bytearray | None = None if stream else bytearray()
        self._limit = limit
        self.answered: float | None = None
        """When a stream's first event came (None before it, and for a whole answer)."""

    def feed(self, piece: bytes, now: float) -> bool:
        """One piece of the answer, read at `now`; True for a stream's first event (its TTFT)."""
        if self.counter is not None:
            self.counter.feed(piece)
            first = self.answered is None and bool(piece)
            if first:
                self.answered = now
            return first
        if self._body is not None:
            self._body += piece
            if len(self._body) > self._limit:  # more than the router would hold: not read
                self._body = None
        return False

    def whole(self, now: float) -> Measured:
        """A whole answer's end at `now`: its output tokens from its usage, when it was held."""
        return Measured(now, None if self._body is None else completion_tokens(bytes(self._body)))


class Picker(ext_proc_grpc.ExternalProcessorServicer):
    """Envoy's ext_proc stream for one HTTP request at a time, decided by the router's policy."""

    def __init__(self, service: RouterService) -> None:
        self._service = service
        self._sidecar = service.settings.picker_pd_mode == PD_MODE_SIDECAR

    async def Process(
        self,
        request_iterator: AsyncIterable[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[ext_proc.ProcessingResponse | bytes]:
        messages = aiter(request_iterator)
        first = await anext(messages, None)
        if first is None or first.WhichOneof("request") != "request_headers":
            return
        headers = header_map(first.request_headers.headers)
        removed = forged(headers)
        path = headers.get(":path", "").split("?", 1)[0]
        kind = _KINDS.get(path)
        if kind is None or headers.get(":method") != "POST":
            error = ApiError(404, f"the endpoint picker routes generation only, not {path}", code="not_found")
            yield immediate(error_response(error, request_id(headers.get(REQUEST_ID_HEADER.lower()))))
            return
        limit = self._service.settings.max_body_bytes  # the HTTP front's bound
        body = bytearray()
        ended = first.request_headers.end_of_stream
        while not ended and len(body) <= limit and int(headers.get("content-length") or 0) <= limit:
            message = await anext(messages, None)
            if message is None:
                return  # Envoy gave up on the request
            if message.WhichOneof("request") == "request_body":
                body += message.request_body.body
                ended = message.request_body.end_of_stream
            elif message.WhichOneof("request") == "request_trailers":
                ended = True
        if not ended or len(body) > limit:
            yield immediate(error_answer(body_too_large(limit), None))
            return
        subset = subset_hint(first.metadata_context)
        async for response in self._serve(kind, bytes(body), headers, removed, subset, messages):
            yield response

    async def _serve(
        self,
        kind: Kind,
        raw: bytes,
        headers: dict[str, str],
        removed: list[str],
        subset: frozenset[str] | None,
        messages: AsyncIterator[ext_proc.ProcessingRequest],
    ) -> AsyncIterator[ext_proc.ProcessingResponse | bytes]:
        service = self._service
        taken = await service.intake(kind, raw, lambda name: headers.get(name.lower()))
        if isinstance(taken, Answer):
            yield immediate(taken)
            return
        exchange, snapshot, dispatcher = taken
        excluded = outside(subset, service.fleet.pools[Pool.DECODE])
        decision = dispatcher.choose(exchange, snapshot, dispatcher.view(exchange, snapshot), excluded)
        if isinstance(decision, Answer):
            yield immediate(decision)
            return
        prefill_leg: asyncio.Future[tuple[int, bytes, str]] | None = None
        if self._sidecar:  # the decode's sidecar sends the prefill: the picker names it
            payload, _, limit, lease = dispatcher.lease(exchange, snapshot, decision)
            prefiller: str | None = urlsplit(decision.prefill.url).netloc
        else:
            payload, _, limit, lease, prefill_leg = dispatcher.begin(exchange, snapshot, decision)
            prefiller = None
        chosen = urlsplit(decision.decode.url).netloc
        outcome = contract.OUTCOME_CLIENT_DISCONNECTED  # until the decode's status came
        reader: AnswerReader | None = None  # reading a good answer, when the gateway streams it here
        measured: Measured | None = None  # what was read of it, once it ended
        next_message: asyncio.Future[ext_proc.ProcessingRequest | None] | None = None
        try:
            yield routed(chosen, len(payload), removed, prefiller)
            pieces = list(chunks(payload))
            for index, piece in enumerate(pieces):
                yield body_piece(piece, index == len(pieces) - 1)
            answered = False
            while True:
                ended = None
                if not answered and prefill_leg is not None:
                    ended = dispatcher.prefill_ended(prefill_leg, exchange, decision)
                if ended is not None:
                    outcome, answer = ended
                    yield immediate(answer)
                    return
                if next_message is None:
                    next_message = asyncio.ensure_future(anext(messages, None))
                waiting: set[asyncio.Future[Any]] = {next_message}
                if not answered and prefill_leg is not None and not prefill_leg.done():
                    waiting.add(prefill_leg)
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if not next_message.done():
                    continue
                message, next_message = next_message.result(), None
                if message is None:
                    return
                which = message.WhichOneof("request")
                if which == "response_headers":
                    status = int(header_map(message.response_headers.headers).get(":status", "0"))
                    answered = True
                    served = served_endpoint(message.metadata_context)
                    elsewhere = served is not None and served != chosen
                    if elsewhere:
                        assert served is not None
                        decode = self._served_elsewhere(exchange.request_id, chosen, served)
                        if decode is not None:
                            lease.move_decode(decode, time.monotonic())
                    outcome = dispatcher.decode_answered(exchange, snapshot, lease, status)
                    if outcome == contract.OUTCOME_OK:
                        reader = AnswerReader(exchange.parsed.stream, limit)
                    if prefill_leg is None:  # the last the picker sees of the sidecar's prefill
                        lease.release_prefill()
                    elif elsewhere:
                        outcome = contract.OUTCOME_SERVED_ELSEWHERE
                    yield answered_headers(decision)
                elif which == "response_body":  # when the filter streams answers: echoed at once, then read
                    piece, last = message.response_body.body, message.response_body.end_of_stream
                    yield ext_proc.ProcessingResponse(
                        response_body=ext_proc.BodyResponse(
                            response=ext_proc.CommonResponse(
                                body_mutation=ext_proc.BodyMutation(
                                    streamed_response=ext_proc.StreamedBodyResponse(
                                        body=piece, end_of_stream=last
                                    )
                                )
                            )
                        )
                    )
                    if reader is not None and measured is None:
                        if reader.feed(piece, time.monotonic()):
                            dispatcher.first_event(exchange, lease.decision)
                        if last:
                            outcome, measured = _read(dispatcher, exchange, lease, reader, outcome)
                elif which == "response_trailers":
                    yield ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())
                    if reader is not None and measured is None:
                        outcome, measured = _read(dispatcher, exchange, lease, reader, outcome)
        finally:
            if next_message is not None and not next_message.done():
                next_message.cancel()
            dispatcher.release(exchange, lease, prefill_leg, outcome, measured)

    def _served_elsewhere(self, request: str, chosen: str, served: str) -> Worker | None:
        """The gateway sent the request to another decode than the chosen one: the one that served,
        when it is in the pool (the attempt's accounting follows it). In picker mode the prefill's
        room was bound to the chosen decode: an error, logged here (the caller counts it)."""
        decode = next(
            (w for w in self._service.fleet.pools[Pool.DECODE] if urlsplit(w.url).netloc == served), None
        )
        if not self._sidecar:
            log.error(
                "request %s: the gateway sent it to %s%s, not to %s where its KV was bound: does the "
                "route retry?",
                request,
                served,
                "" if decode is not None else " (not a decode of the pool)",
                chosen,
            )
        return decode


def _read(
    dispatcher: Dispatcher, exchange: Exchange, lease: Lease, reader: AnswerReader, outcome: str
) -> tuple[str, Measured | None]:
    """The answer read to its end: the attempt's outcome and what was measured, as the router's
    own path has them (`Dispatcher.stream_ended` for a stream: its error event, tokens, TPOT)."""
    if reader.counter is None:
        return outcome, reader.whole(time.monotonic())
    if reader.answered is None:  # a stream with no event: nothing to time
        return outcome, None
    outcome, tokens, tpot = dispatcher.stream_ended(exchange, lease, reader.counter, outcome, reader.answered)
    return outcome, Measured(reader.answered, tokens, tpot)


class PickerHealth(health_pb2_grpc.HealthServicer):
    """gRPC health: `liveness` while the process serves; `readiness` (and the whole server, "")
    once the router has a config and is not draining."""

    def __init__(self, service: RouterService) -> None:
        self._service = service

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        serving = health_pb2.HealthCheckResponse.SERVING
        if request.service == LIVENESS:
            return health_pb2.HealthCheckResponse(status=serving)
        if request.service not in ("", READINESS):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r}")
        service = self._service
        ready = service.snapshot is not None and not service.drain.active
        return health_pb2.HealthCheckResponse(
            status=serving if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )


def self_signed(now: datetime.datetime, days: int = SELF_SIGNED_DAYS) -> tuple[bytes, bytes]:
    """A new private key and a self-signed certificate for it (PEM), valid from an hour before
    `now` for `days`: what a gateway that does not verify its picker (Istio) needs for TLS."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prfaas-picker")])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("prfaas-picker")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    private = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return private, certificate.public_bytes(pem)


def server_credentials(tls_dir: Path | None, self_signed_tls: bool) -> grpc.ServerCredentials | None:
    """The picker port's TLS (`--picker-tls-dir`: a kubernetes.io/tls Secret's files, read at
    start; `--picker-tls-self-signed`: made now); None for plain text."""
    if tls_dir is not None:
        pair = ((tls_dir / "tls.key").read_bytes(), (tls_dir / "tls.crt").read_bytes())
    elif self_signed_tls:
        pair = self_signed(datetime.datetime.now(datetime.UTC))
    else:
        return None
    return grpc.ssl_server_credentials([pair])


async def start_picker(
    service: RouterService,
    host: str,
    port: int,
    health_port: int | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> list[grpc.aio.Server]:
    """The picker's gRPC servers on the router's event loop: ext_proc and health on `port` (over
    TLS with `credentials`), and health alone on `health_port` when given, always plain text (a
    probe there never reaches the picker itself)."""
    health = PickerHealth(service)
    server = grpc.aio.server()
    add_picker(server, Picker(service))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if credentials is None:
        server.add_insecure_port(f"{host}:{port}")
    else:
        server.add_secure_port(f"{host}:{port}", credentials)
    servers = [server]
    if health_port is not None:
        servers.append(grpc.aio.server())
        health_pb2_grpc.add_HealthServicer_to_server(health, servers[-1])
        servers[-1].add_insecure_port(f"{host}:{health_port}")
    for each in servers:
        await each.start()
    return servers
