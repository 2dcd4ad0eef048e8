"""SGLang's PD protocol over the one pooled upstream client: both legs at once, the decode's answer back.

As SGLang's own router does it: the same JSON body, with `bootstrap_host` (the prefill's host),
`bootstrap_port` (its bootstrap port) and a random `bootstrap_room`, is POSTed to the prefill
and the decode instance on the same path at the same time; the decode pulls the KV from the
prefill and answers; the prefill's answer is drained. An attempt that fails before anything
reached the client is repeated on other workers (a new decision that excludes the failed one);
once bytes have been streamed, an upstream failure ends the stream with an SSE error event.
When the client goes away, both legs are cancelled, which closes their connections and makes
the engines abort the request. A streamed answer is relayed chunk by chunk from the decode's
socket to the client's without a coroutine in between (`_Relay`).

Errors inside a 200 (`stream_error`): SGLang answers a stream 200 before it knows the outcome
and ends a request that fails later with an error event (`data: {"error": ...}` on the OpenAI
routes, an abort `finish_reason` on `/generate`). The decode's first event is read before the
client gets its headers: an error there, like a failed status, fails the attempt, which is
retried since nothing reached the client. An error event after that is relayed as it came,
counted against the decode (it had generated, so its KV had arrived) and recorded as
`stream_error`, with no retry. A prefill leg fails on a failed status or an error event in its
drained body. 1xx and 3xx are failures (SGLang never sends them); a 4xx refuses the request,
passed back in the router's error shape and counted against no engine.

Blame: each leg is judged by its own behaviour, and a failure counts against one engine at most
(`at_fault`). A failing leg is at fault, except when the other leg failed too within a short
grace or is still out and the failure is the engine's report that the KV handoff failed. A
failed decode waits the grace for its prefill: a prefill that failed is the cause (one that dies
mid-transfer fails its decode). A prefill reporting a failed handoff blames its decode (no KV
pulled), unless the decode reports the failed handoff within the grace: SGLang's decode reports
a transfer its prefill failed as its stream's error, so a decode alive to say so is the victim.
A prefill leg that fails after its decode failed is not counted. Only an engine's behaviour
counts: an exception raised inside the router is answered 500 and opens no breaker, and a
client that stops reading is the client's fault (`_Relay` aborts both legs). Prefixes are
learned on the decode's first good event only: SGLang generates nothing before the KV arrived.

Each attempt also counts once under its pair's KV fingerprint (`RevisionMetrics`), by outcome
(`failure_outcome` names a failed leg by the blame above), with its TTFT and a stream's TPOT:
what a rollout compares the new revision on, retries included. And each attempt's KV handoff
counts by route (`HandoffMetrics`): done once the decode answered, else failed by the cause the
engine named (`handoff_cause`), which the operator reads as the data path's verdict.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from prfaas_core import metrics_contract as contract
from prfaas_core.router_config import RouterConfig
from prfaas_core.routing.policy import (
    Decision,
    PolicyModel,
    Rejection,
    RequestView,
    SessionPin,
    SessionTable,
    decide,
)
from prfaas_core.routing.prefix_index import NO_HIT, ClusterIndexes, PromptKey
from prfaas_core.routing.workers import Fleet, Worker
from prfaas_core.vocabulary import ROUTE_LOCAL, ROUTE_PRFAAS, Pool

from prfaas_router.http.client import (
    AnswerBudget,
    AnswerBudgetExceeded,
    Reply,
    Target,
    Upstream,
    UpstreamError,
    target,
)
from prfaas_router.http.server import Answer, Request, json_answer
from prfaas_router.link_probe import LinkProbe
from prfaas_router.metrics import RouterMetrics
from prfaas_router.payloads import (
    ApiError,
    ParsedRequest,
    answer_limit,
    completion_tokens,
    engine_error,
    last_completion_tokens,
    with_bootstrap,
)

log = logging.getLogger("prfaas_router.proxy")

ROUTE_HEADER = "X-Prfaas-Route"
REASON_HEADER = "X-Prfaas-Reason"
CACHED_HEADER = "X-Prfaas-Cached-Tokens"
"""The prompt tokens the router assumed its prefill reuses from cache (`Decision`'s total less
uncached): what a test compares with the engine's own `cached_tokens`."""
CACHE_SOURCE_HEADER = "X-Prfaas-Cache-Source"
"""Where those tokens come from: `instance` (the prefill's radix cache), `pool` (its cluster's
shared pool) or `none` (`policy.CacheSource`)."""
REQUEST_ID_HEADER = "X-Request-Id"
NO_ROUTE = "none"
_BLAME_GRACE_SECONDS = 0.05  # how long a failed decode waits to learn whether its prefill died first
_PASSED_HEADERS = {"content-type": "Content-Type", "cache-control": "Cache-Control"}
_RELAY_HIGH_WATER = 256 * 1024  # bytes waiting for a slow client before the decode's socket is paused
_RELAY_LOW_WATER = 64 * 1024
_RELAY_DRAIN_POLL_SECONDS = 0.005
RETRY_AFTER_SECONDS = 1  # what a 429 or 503 tells the client to wait
STREAM_EVENT_MARGIN = 64
"""Token events a stream may send beyond its request's output limit (at most one token each in
SGLang, which may also put several in one) before the router ends it as the decode's failure."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One config version and what was derived from it; a request keeps the one it started with."""

    config: RouterConfig
    model: PolicyModel
    indexes: ClusterIndexes


@dataclass(slots=True)
class Exchange:
    """One client request on its way through the router."""

    http: Request | None
    """The client's HTTP request on the router's own front; None behind the endpoint picker."""
    request_id: str
    raw: bytes
    body: dict[str, object]
    parsed: ParsedRequest
    keys: Sequence[PromptKey]
    session_key: bytes | None
    """`policy.session_key` of the session-affinity header, when the config names one and it came."""
    started: float


class LegFailure(Exception):
    """A leg failed before the client got anything, so the request may go to other workers.

    `handoff`: the engine answered that the KV handoff with its peer failed, and how
    (`handoff_cause`: one of `metrics_contract.HANDOFF_FAILURES`).
    """

    def __init__(
        self, worker: Worker, message: str, *, unreachable: bool = False, handoff: str | None = None
    ) -> None:
        super().__init__(f"{worker.pool.value} {worker.name}: {message}")
        self.worker = worker
        self.unreachable = unreachable
        self.handoff = handoff


class _Refused(Exception):
    """An engine refused the request itself (4xx), or the router will not hold its answer
    (`over_budget`): the client gets that answer, counted as `outcome`, nobody is retried."""

    def __init__(self, error: ApiError, outcome: str = "bad_request") -> None:
        super().__init__(error.message)
        self.error = error
        self.outcome = outcome


OUTCOME_ANSWER_BUDGET = "answer_budget"
OUTCOME_ROUTER_ERROR = "router_error"
"""An attempt ended by an exception raised inside the router (answered 500, no engine blamed)."""


def failure_outcome(failure: LegFailure) -> str:
    """The revision outcome of an attempt that failed on a leg (`RevisionMetrics`): a KV handoff
    either leg reported failed, else the leg held at fault."""
    if failure.handoff is not None:
        return contract.OUTCOME_KV_TRANSFER_FAILED
    return (
        contract.OUTCOME_DECODE_FAILED
        if failure.worker.pool is Pool.DECODE
        else contract.OUTCOME_PREFILL_FAILED
    )


def time_per_output_token(seconds: float, output_tokens: int, samples: int) -> float | None:
    """TPOT of a stream that took `seconds` from its first event to its end: the mean time of
    each sample's tokens after its first; None below two tokens a sample (no interval to time)."""
    per_sample = output_tokens / samples
    return seconds / (per_sample - 1) if per_sample >= 2 else None


def over_budget(error: AnswerBudgetExceeded) -> _Refused:
    """The router's answer when holding an engine's answer would pass `--answer-budget-bytes`:
    503 with Retry-After, as for any capacity the router lacks for a while (the engines are
    fine, the request is fine, other answers hold the memory), in OpenAI's error shape. Not
    retried on another engine: its answer would meet the same budget."""
    return _Refused(
        ApiError(
            503,
            f"the router is holding all it may of engines' answers ({error.budget_bytes} bytes at once); "
            "try again shortly",
            type_="service_unavailable",
            code="answer_budget_exceeded",
        ),
        OUTCOME_ANSWER_BUDGET,
    )


@dataclass(frozen=True, slots=True)
class AnswerBounds:
    """What the router holds of engines' answers: each request's at most `answer_limit` of it
    (`bytes_per_token`, never above `cap_bytes`), all of them within `budget`."""

    cap_bytes: int
    bytes_per_token: int
    budget: AnswerBudget


@dataclass(frozen=True, slots=True)
class Measured:
    """What a front that does not carry the decode leg itself (the endpoint picker) measured of the
    decode's answer that came to its end: when it came (a stream's first event, else the whole
    answer), its output tokens (None when it names none), a stream's TPOT (`stream_ended`)."""

    answered: float
    output_tokens: int | None
    tpot: float | None = None


class Culprit(enum.Enum):
    FAILED_LEG = "failed_leg"
    OTHER_LEG = "other_leg"


def at_fault(*, reports_handoff: bool, other_leg_out: bool) -> Culprit:
    """Which engine a leg's failure counts against (the other leg did not fail itself).

    An engine that reports a failed KV handoff while its peer is still out is the victim: its
    peer never sent (or never pulled) the KV. Any other failure is the failing engine's own.
    """
    return Culprit.OTHER_LEG if reports_handoff and other_leg_out else Culprit.FAILED_LEG


# every transfer error names its bootstrap room: a room named is not a bootstrap that failed
_BOOTSTRAP_FAILURE = re.compile(rb"(?i)handshake failed|bootstrap(?![ _-]?room)")
_TRANSFER_FAILURE = re.compile(rb"(?i)kv[ _-]?(?:cache|transfer)|transfer failed")


def handoff_cause(body: bytes) -> str | None:
    """How an engine's error body says the KV handoff failed, None when it does not (SGLang's and
    the fake engine's words): the bootstrap (timed out, never reached; SGLang 0.5.23's decode says
    "Decode handshake failed", observed with a prefill that is gone) before the transfer (failed KV
    transfers, a kvcache not received), since a bootstrap that failed fails the transfer too."""
    head = body[:_HANDOFF_SCAN_BYTES]
    if _BOOTSTRAP_FAILURE.search(head) is not None:
        return contract.HANDOFF_BOOTSTRAP_FAILED
    if _TRANSFER_FAILURE.search(head) is not None:
        return contract.HANDOFF_TRANSFER_FAILED
    return None


def reports_handoff(body: bytes) -> bool:
    """An engine's error body that says the KV handoff failed."""
    return handoff_cause(body) is not None


_HANDOFF_SCAN_BYTES = 4096


def failed_status(status: int) -> bool:
    """A status that is neither an answer (2xx) nor a refusal of the request (4xx): SGLang never
    redirects, so a 1xx or 3xx is not its answer."""
    return not (200 <= status < 300 or 400 <= status < 500)


_STREAM_ERROR = re.compile(
    rb'(?:^|\n)data:\s*\{\s*"error"\s*:|"finish_reason"\s*:\s*\{\s*"type"\s*:\s*"abort"'
)
_STREAM_ERROR_LONGEST = 64  # bytes kept between chunks: more than a match with SGLang's spacing


def stream_error(data: bytes) -> bool:
    """Whether SSE data holds an error event: SGLang's way of failing a stream it already
    answered 200. On the OpenAI routes an abort with a status code becomes `data: {"error": ...}`
    (openai/serving_chat.py, serving_completions.py); `/generate` yields the aborted output
    itself, its `meta_info.finish_reason` `{"type": "abort", ...}` (tokenizer_manager.py
    `_handle_abort_finish_reason`, FINISH_ABORT.to_json), and `{"error": ...}` only for a
    ValueError (http_server.py generate_request's stream_results). A key inside a JSON string
    has its quotes escaped, so generated text never matches. The regex has no literal prefix to
    search for, so it would try every byte of a whole answer; a match needs one of two words,
    which a bytes search finds at memchr speed (most answers have neither)."""
    return (b'"error"' in data or b'"abort"' in data) and _STREAM_ERROR.search(data) is not None


def _event_head(data: bytes) -> bytes:
    """The first SSE event of a stream's first bytes (more may have come in the same read)."""
    end = data.find(b"\n\n")
    return data if end < 0 else data[:end]


def _decode_answer(reply: Reply, stream: bool) -> asyncio.Future[tuple[Reply, bytes]]:
    """The decode's reply with its whole body or, for a stream, its first event: SGLang sends
    nothing before its first generated chunk (or the error that replaces it), so this is where
    a stream shows whether it will serve."""
    if stream:
        return reply.first_event(lambda first: (reply, first))
    return reply.whole(lambda body: (reply, body))


async def _first_ended(*legs: asyncio.Future[Any]) -> None:
    """Returns once one of `legs` has ended, raising nothing of theirs: `asyncio.wait` with
    FIRST_COMPLETED, less its sets, argument checks and timeout (up to two per attempt)."""
    for leg in legs:
        if leg.done():
            return
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake(_: asyncio.Future[Any]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    for leg in legs:
        leg.add_done_callback(wake)
    try:
        await waiter
    finally:
        for leg in legs:
            leg.remove_done_callback(wake)


def servable(first: bytes) -> bool:
    """Whether a decode's 2xx begins as an answer does: a JSON document, or an SSE event (SGLang
    sends no comment or blank line first). Checked on the first bytes only, not parsed."""
    start = first.lstrip()[:5]
    return start[:1] in (b"{", b"[") or start == b"data:"


def drop_frames(error: BaseException) -> None:
    """Forgets the tracebacks of a handled failure and of its causes.

    A traceback holds the frames it passed through, and those hold the exception (the variable
    it was caught in, or raised from): a reference cycle that keeps the failed attempt's
    payload, replies and tasks (tens of MiB for a large prompt) until a full collection, which
    the router's tuned gc thresholds (`__main__._tune_gc`) make rare. Without the tracebacks the
    frames go as soon as the attempt does.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += (current.__cause__, current.__context__)


def _drop_leg_frames(task: asyncio.Future[Any]) -> None:
    """A finished leg's failure, if any, without its frames: the reply it failed on holds the
    failure, whose traceback holds the leg's frame, which holds the reply (a cycle)."""
    error = task.exception()
    if error is not None:
        drop_frames(error)


def engine_fault(error: BaseException) -> bool:
    """Whether an exception of a leg is the engine's doing: only what the upstream client saw on
    the wire. Anything else was raised inside the router and must not eject an engine."""
    return isinstance(error, UpstreamError)


class Dispatcher:
    """Routes and forwards requests; owns the link ledger, the session pins and the accounting."""

    def __init__(
        self,
        upstream: Upstream,
        fleet: Fleet,
        metrics: RouterMetrics,
        sessions: SessionTable,
        max_attempts: int,
        client_stall_seconds: float,
        link: LinkProbe,
        answers: AnswerBounds,
        max_stream_seconds: float,
        pools_up: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        self._upstream = upstream
        self._pools_up = pools_up
        self._answers = answers
        self._max_stream_seconds = max_stream_seconds
        self._link = link
        self._client_stall_seconds = client_stall_seconds
        self._fleet = fleet
        self._metrics = metrics
        self._sessions = sessions
        self._max_attempts = max_attempts
        self._background: set[asyncio.Future[Any]] = set()
        self.link_inflight_bytes = 0.0
        # outstanding tokens per pool; the gauges read these when scraped, not on every request
        self.inflight_tokens = {pool: 0 for pool in Pool}
        for pool in Pool:
            metrics.inflight_tokens.labels(pool.value).set_function(self._inflight_reader(pool))
        metrics.link_inflight_bytes.set_function(lambda: self.link_inflight_bytes)

    def _inflight_reader(self, pool: Pool) -> Callable[[], float]:
        return lambda: self.inflight_tokens[pool]

    def view(self, exchange: Exchange, snapshot: Snapshot) -> RequestView:
        """What the policy sees of a request: its size, cache hits, session pin and pools up."""
        keys = exchange.keys
        pin = self._sessions.get(exchange.session_key) if exchange.session_key else None
        indexes = snapshot.indexes
        hit_local, hit_prfaas = indexes.hits(keys)
        pools_up = self._pools_up()
        pooled = snapshot.config.cache_pools
        return RequestView(
            total_tokens=sum(key.tokens for key in keys),
            sequences=len(keys),
            hit_local=hit_local,
            hit_prfaas=hit_prfaas,
            pin=pin,
            session=exchange.session_key,
            pool_local=indexes.pool_hit(ROUTE_LOCAL, keys)
            if ROUTE_LOCAL in pools_up and ROUTE_LOCAL in pooled
            else NO_HIT,
            pool_prfaas=indexes.pool_hit(ROUTE_PRFAAS, keys)
            if ROUTE_PRFAAS in pools_up and ROUTE_PRFAAS in pooled
            else NO_HIT,
            pools_up=pools_up,
            hit_decode=indexes.decode_hit(keys) if snapshot.config.decode_radix_cache else NO_HIT,
        )

    def choose(
        self,
        exchange: Exchange,
        snapshot: Snapshot,
        view: RequestView,
        excluded: set[Worker] | None = None,
        failures: Sequence[str] = (),
    ) -> Decision | Answer:
        """One decision over the workers not excluded, counted; a rejection as the error to answer
        (429 when admission sheds, 503 when nothing is routable)."""
        metrics = self._metrics
        pools = self._fleet.routable(time.monotonic(), excluded or set())
        decision = decide(
            self._link.limit(snapshot.model),
            view,
            pools,
            self.link_inflight_bytes,
            self.inflight_tokens[Pool.PRFAAS_PREFILL],
        )
        if isinstance(decision, Rejection):
            metrics.decisions.labels(NO_ROUTE, decision.reason.value).inc()
            metrics.requests.labels(NO_ROUTE, "rejected" if decision.status == 429 else "unavailable").inc()
            detail = f" (after: {'; '.join(failures)})" if failures else ""
            error = ApiError(
                decision.status,
                decision.message + detail,
                type_="rate_limit_error" if decision.status == 429 else "service_unavailable",
                code=decision.reason.value,
            )
            return error_response(error, exchange.request_id, reason=decision.reason.value)
        metrics.decisions.labels(decision.route, decision.reason.value).inc()
        return decision

    async def serve(self, exchange: Exchange, snapshot: Snapshot) -> Answer | None:
        metrics = self._metrics
        view = self.view(exchange, snapshot)
        excluded: set[Worker] = set()
        failures: list[str] = []
        for _ in range(self._max_attempts):
            decision = self.choose(exchange, snapshot, view, excluded, failures)
            if isinstance(decision, Answer):
                return decision
            try:
                return await self._attempt(exchange, snapshot, decision)
            except LegFailure as failure:
                log.warning("request %s: %s; trying other workers", exchange.request_id, failure)
                excluded.add(failure.worker)
                failures.append(str(failure))
                metrics.retries.labels(failure.worker.pool.value).inc()
                drop_frames(failure)
        metrics.requests.labels(NO_ROUTE, "upstream_error").inc()
        error = ApiError(
            502,
            f"upstream engines failed {len(failures)} times: {'; '.join(failures)}",
            type_="upstream_error",
            code="upstream_failed",
        )
        return error_response(error, exchange.request_id, reason="upstream_failed")

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def _attempt(self, exchange: Exchange, snapshot: Snapshot, decision: Decision) -> Answer | None:
        """The answer, or None when it was streamed to the client."""
        parsed = exchange.parsed
        prefill, decode = decision.prefill, decision.decode
        payload, headers, limit, lease, prefill_leg = self.begin(exchange, snapshot, decision)
        started = lease.started
        path = parsed.kind.value
        decode_task = self._decode_leg(target(decode.url, path), payload, headers, parsed.stream, limit)
        response: Reply | None = None
        delivered = False
        outcome = OUTCOME_ROUTER_ERROR
        answered: float | None = None
        tpot: float | None = None
        handoff: str | None = None  # the KV handoff's failure, when the attempt failed on it
        try:
            await _first_ended(prefill_leg, decode_task)
            if not decode_task.done():
                failure = _prefill_failure(prefill_leg, prefill)
                if failure is not None:  # the decode cannot finish
                    raise await self._judge_prefill(failure, decode_task, decode)
                await _first_ended(decode_task)
            try:
                response, first = _decode_result(decode_task, decode)
            except LegFailure as failure:
                lease.decode_failed = True
                judged = await self._judge_decode(failure, prefill_leg, prefill)
                raise judged from (None if judged is failure else failure)
            answered = time.monotonic()
            lease.decode_answered = True
            decode.breaker.record_success()
            self._learn(exchange, snapshot, lease)  # the decode answered: the KV reached it
            if parsed.stream:
                outcome, tpot = await self._stream(exchange, decision, lease, response, first, answered)
                delivered = outcome not in contract.CLIENT_OUTCOMES
                return None
            delivered = True
            outcome = contract.OUTCOME_OK
            return self._complete(exchange, decision, response, first)
        except LegFailure as failure:
            outcome, handoff = failure_outcome(failure), failure.handoff
            raise
        except _Refused as refused:
            outcome = refused.outcome
            self._metrics.requests.labels(decision.route, refused.outcome).inc()
            return error_response(
                refused.error, exchange.request_id, route=decision.route, reason=decision.reason.value
            )
        except asyncio.CancelledError:  # the client went away (the listener cancels the handler)
            outcome = (
                contract.OUTCOME_CLIENT_STALLED
                if lease.client_stalled
                else contract.OUTCOME_CLIENT_DISCONNECTED
            )
            if not lease.client_stalled:
                self._metrics.requests.labels(decision.route, outcome).inc()
            raise
        finally:
            self._metrics.revisions.attempt(
                decode.fingerprint, outcome, None if answered is None else answered - started, tpot
            )
            if answered is not None or handoff is not None:
                outcome_of_handoff = contract.HANDOFF_OK if handoff is None else handoff
                self._metrics.handoffs.record(decision.route, outcome_of_handoff, time.time())
            if not decode_task.done():
                decode_task.cancel()
            if response is not None:
                if delivered:  # a reply read to its end keeps its connection
                    response.release()
                else:  # closing the connection makes the engine abort the request
                    response.close()
            lease.release_decode()
            if decode_task.done() and not decode_task.cancelled():
                _drop_leg_frames(decode_task)
            if not prefill_leg.done():
                if delivered:  # answered: let the prefill's reply drain on its own
                    self._background.add(prefill_leg)
                    prefill_leg.add_done_callback(self._background.discard)
                else:
                    prefill_leg.cancel()

    def begin(
        self, exchange: Exchange, snapshot: Snapshot, decision: Decision
    ) -> tuple[bytes, dict[str, str], int, Lease, asyncio.Future[tuple[int, bytes, str]]]:
        """A decided attempt under way: the body with its bootstrap fields (what the decode must
        get), its headers and answer limit, the lease on the workers and the link, and the
        prefill leg fired (its end accounted by `_prefill_done`)."""
        payload, headers, limit, lease = self.lease(exchange, snapshot, decision)
        where = target(decision.prefill.url, exchange.parsed.kind.value)
        prefill_leg = self._prefill_leg(where, payload, headers, limit)
        prefill_leg.add_done_callback(lambda task: self._prefill_done(task, exchange, snapshot, lease))
        return payload, headers, limit, lease, prefill_leg

    def lease(
        self, exchange: Exchange, snapshot: Snapshot, decision: Decision
    ) -> tuple[bytes, dict[str, str], int, Lease]:
        """A decided attempt under way with no prefill leg fired: its body (bootstrap fields and
        the consumer's salt), headers, answer limit and lease. `begin` fires the leg; a front whose
        prefill another proxy sends (llm-d's decode sidecar, which rewrites the bootstrap fields)
        gives the prefill's part back itself (`Lease.release_prefill`)."""
        parsed = exchange.parsed
        prefill = decision.prefill
        rooms = [random.getrandbits(63) for _ in range(parsed.samples)]
        assert prefill.bootstrap_port is not None  # checked when the config was loaded
        payload = with_bootstrap(
            exchange.raw,
            exchange.body,
            parsed,
            prefill.host,
            prefill.bootstrap_port,
            rooms,
            snapshot.config.cache_salt,
        )
        headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: exchange.request_id}
        answers = self._answers
        limit = answer_limit(
            parsed,
            exchange.body,
            decision.total_tokens,
            bytes_per_token=answers.bytes_per_token,
            cap_bytes=answers.cap_bytes,
        )
        return payload, headers, limit, Lease(self, decision, time.monotonic())

    def prefill_ended(
        self, prefill_leg: asyncio.Future[tuple[int, bytes, str]], exchange: Exchange, decision: Decision
    ) -> tuple[str, Answer] | None:
        """For a front whose decode leg another proxy carries (the endpoint picker), once the
        prefill leg ended badly: the attempt's outcome and what the client gets instead of the
        decode's answer (502 for the engine's failure, counted against the prefill since its
        decode never answered; an engine's refusal as it came). None while it runs or after it
        answered well."""
        if not prefill_leg.done():
            return None
        route, reason = decision.route, decision.reason.value
        try:
            failure = _prefill_failure(prefill_leg, decision.prefill)
        except _Refused as refused:
            return refused.outcome, error_response(
                refused.error, exchange.request_id, route=route, reason=reason
            )
        if failure is None:
            return None
        self.count_failure(decision.prefill, fatal=failure.unreachable)
        if failure.handoff is not None:
            self._metrics.handoffs.record(route, failure.handoff, time.time())
        log.warning("request %s: %s; its decode is aborted", exchange.request_id, failure)
        error = ApiError(502, str(failure), type_="upstream_error", code="upstream_failed")
        return failure_outcome(failure), error_response(
            error, exchange.request_id, route=route, reason=reason
        )

    def decode_answered(self, exchange: Exchange, snapshot: Snapshot, lease: Lease, status: int) -> str:
        """The decode's response status, seen by that front: judged as the router's own path
        judges it; the attempt's outcome so far."""
        decode = lease.decision.decode
        if failed_status(status):
            lease.decode_failed = True
            self.count_failure(decode)
            return contract.OUTCOME_DECODE_FAILED
        if status >= 400:
            return "bad_request"
        lease.decode_answered = True
        decode.breaker.record_success()
        self._learn(exchange, snapshot, lease)
        self._metrics.handoffs.record(lease.decision.route, contract.HANDOFF_OK, time.time())
        return contract.OUTCOME_OK

    def release(
        self,
        exchange: Exchange,
        lease: Lease,
        prefill_leg: asyncio.Future[tuple[int, bytes, str]] | None,
        outcome: str,
        measured: Measured | None = None,
    ) -> None:
        """The end of an attempt carried by another proxy: the decode's part given back, the
        prefill left to drain when the decode answered (else cancelled; with no leg of ours, its
        part given back too), the request counted, with what that front `measured` of the answer."""
        decision = lease.decision
        lease.release_decode()
        ttft, tpot = (None, None) if measured is None else (measured.answered - lease.started, measured.tpot)
        self._metrics.revisions.attempt(decision.decode.fingerprint, outcome, ttft, tpot)
        if prefill_leg is None:
            lease.release_prefill()
        elif not prefill_leg.done():
            if lease.decode_answered:
                self._background.add(prefill_leg)
                prefill_leg.add_done_callback(self._background.discard)
            else:
                prefill_leg.cancel()
        if measured is not None or outcome == contract.OUTCOME_OK:
            self._finish(exchange, decision, outcome, None if measured is None else measured.output_tokens)
        else:
            self._metrics.requests.labels(decision.route, outcome).inc()

    async def _judge_prefill(
        self, failure: LegFailure, decode_task: asyncio.Future[tuple[Reply, bytes]], decode: Worker
    ) -> LegFailure:
        """The failure to retry around, for a prefill leg that failed while its decode was out.

        A prefill reporting a failed handoff blames its decode (it never pulled the KV), unless
        the decode answers within the grace that the handoff failed too: SGLang's decode reports
        a transfer its prefill failed to send ("Decode transfer failed", disaggregation/decode.py
        pop_transferred / the KVPoll.Failed branch) as its stream's error event, so a decode
        alive to say so is the victim and the prefill the cause.
        """
        if failure.handoff is not None:
            await asyncio.wait((decode_task,), timeout=_BLAME_GRACE_SECONDS)
            if decode_task.done() and not decode_task.cancelled() and decode_task.exception() is None:
                reply, first = decode_task.result()
                reply.close()  # the attempt is over either way
                if reports_handoff(first) and (
                    failed_status(reply.status) or stream_error(_event_head(first))
                ):
                    self.count_failure(failure.worker)
                    return failure
        return self._judge(failure, decode, other_leg_out=not decode_task.done())

    async def _judge_decode(
        self, failure: LegFailure, prefill_leg: asyncio.Future[tuple[int, bytes, str]], prefill: Worker
    ) -> LegFailure:
        """The failure to retry around, for a failed decode leg; counted against the engine at fault.

        A prefill that dies mid-transfer fails its decode too, so the prefill's fate is awaited
        briefly: a prefill that failed is the cause.
        """
        if not prefill_leg.done():
            await asyncio.wait((prefill_leg,), timeout=_BLAME_GRACE_SECONDS)
        prefill_failure = _prefill_failure(prefill_leg, prefill) if prefill_leg.done() else None
        if prefill_failure is not None:
            self.count_failure(prefill, fatal=prefill_failure.unreachable)
            return prefill_failure
        return self._judge(failure, prefill, other_leg_out=not prefill_leg.done())

    def _judge(self, failure: LegFailure, other: Worker, *, other_leg_out: bool) -> LegFailure:
        """Counts a leg's failure against the engine at fault (`at_fault`); the failure to retry around."""
        handoff = failure.handoff is not None
        if at_fault(reports_handoff=handoff, other_leg_out=other_leg_out) is Culprit.OTHER_LEG:
            self.count_failure(other)
            return LegFailure(
                other, f"its peer reported a failed KV handoff ({failure})", handoff=failure.handoff
            )
        self.count_failure(failure.worker, fatal=failure.unreachable)
        return failure

    def count_failure(self, worker: Worker, *, fatal: bool = False) -> None:
        """One failure of an engine's own making, for its breaker and the metric."""
        worker.breaker.record_failure(time.monotonic(), fatal=fatal)
        self._metrics.engine_failures.labels(worker.pool.value, worker.name).inc()

    def _prefill_leg(
        self, where: Target, payload: bytes, headers: dict[str, str], limit: int
    ) -> asyncio.Future[tuple[int, bytes, str]]:
        """The prefill's status, whole body (drained whether streamed or not) and content type
        (`Reply.outcome`), at most `limit` bytes of it held; a task only when no idle connection
        is at hand."""
        budget = self._answers.budget
        reply = self._upstream.send_pooled("POST", where, headers, payload, limit, budget)
        if reply is None:
            return asyncio.create_task(self._prefill_leg_connecting(where, payload, headers, limit))
        return reply.outcome()

    async def _prefill_leg_connecting(
        self, where: Target, payload: bytes, headers: dict[str, str], limit: int
    ) -> tuple[int, bytes, str]:
        reply = await self._upstream.request(
            "POST", where, headers, payload, max_bytes=limit, budget=self._answers.budget
        )
        return await reply.outcome()  # cancelled there, it closes the reply

    def _decode_leg(
        self, where: Target, payload: bytes, headers: dict[str, str], stream: bool, limit: int
    ) -> asyncio.Future[tuple[Reply, bytes]]:
        """The decode's reply and its first bytes (`_decode_answer`), at most `limit` bytes held;
        a task only when no idle connection is at hand."""
        budget = self._answers.budget
        reply = self._upstream.send_pooled("POST", where, headers, payload, limit, budget, stream=stream)
        if reply is None:
            return asyncio.create_task(self._open_decode(where, payload, headers, stream, limit))
        return _decode_answer(reply, stream)

    async def _open_decode(
        self, where: Target, payload: bytes, headers: dict[str, str], stream: bool, limit: int
    ) -> tuple[Reply, bytes]:
        reply = await self._upstream.request(
            "POST", where, headers, payload, max_bytes=limit, budget=self._answers.budget, stream=stream
        )
        return await _decode_answer(reply, stream)  # cancelled there, it closes the reply

    def _prefill_done(
        self,
        task: asyncio.Future[tuple[int, bytes, str]],
        exchange: Exchange,
        snapshot: Snapshot,
        lease: Lease,
    ) -> None:
        lease.release_prefill()
        decision = lease.decision
        worker = decision.prefill
        if task.cancelled():
            return
        error = task.exception()
        _drop_leg_frames(task)
        if isinstance(error, AnswerBudgetExceeded):  # the router's limit: no engine's doing
            return
        if error is not None and not engine_fault(error):
            log.error("request %s: prefill leg failed inside the router", exchange.request_id, exc_info=error)
            return
        status, body = (0, b"") if error is not None else task.result()[:2]
        if error is not None or failed_status(status) or (status < 300 and stream_error(body)):
            # judged by the attempt unless the decode had answered; after a decode failure, the
            # prefill's KV was never pulled: not its failure
            if lease.decode_answered and not lease.decode_failed:
                self.count_failure(worker, fatal=_unreachable(error))
            return
        worker.breaker.record_success()

    def _learn(self, exchange: Exchange, snapshot: Snapshot, lease: Lease) -> None:
        """The prefill that computed the prompt holds it in its radix cache; so does its
        cluster's pool while that serves (the prefill wrote it there), and with the decode radix
        cache the decode that received it. Once per attempt.

        Only the decode's first good answer tells (its first token, or its whole answer): SGLang
        generates nothing before the KV arrived, while a prefill that answered well may still
        have had its transfer aborted on the decode's side.
        """
        if lease.learned:
            return
        lease.learned = True
        decision = lease.decision
        config = snapshot.config
        if decision.route == ROUTE_PRFAAS:
            self._metrics.kv_egress_bytes.inc(decision.egress_bytes)
        snapshot.indexes.learn_computed(
            decision.route,
            decision.prefill.name,
            exchange.keys,
            pooled=decision.route in config.cache_pools and decision.route in self._pools_up(),
            decode=decision.decode.name if config.decode_radix_cache else None,
        )

    async def _stream(
        self,
        exchange: Exchange,
        decision: Decision,
        lease: Lease,
        reply: Reply,
        first: bytes,
        answered: float,
    ) -> tuple[str, float | None]:
        """Streams the decode's reply, whose first event came at `answered`: the attempt's outcome
        (`ok`, `stream_error`, or the client's doing when it went away before the end) and the
        stream's TPOT when it completed."""
        metrics = self._metrics
        request = exchange.http
        assert request is not None  # only the HTTP front streams through the router
        counter = EventCounter()
        outcome = contract.OUTCOME_OK
        try:
            parsed = exchange.parsed
            max_events = parsed.max_output_tokens * parsed.samples + STREAM_EVENT_MARGIN
            counter.feed(first)
            overran = counter.events > max_events
            if overran:  # its first event, then the failure
                first = first[: first.find(b"\n\n") + 2]
            request.start_stream(reply.status, _reply_headers(reply, exchange, decision), first)
            self.first_event(exchange, decision)
            relay = _Relay(
                request.transport,
                reply,
                counter,
                request.http11,  # chunks; HTTP/1.0 has none
                self._client_stall_seconds,
                lambda: self._client_stalled(exchange, decision, lease),
                max_events,
            )
            limit = self._max_stream_seconds
            timer = asyncio.get_running_loop().call_later(
                limit, relay.stop, f"the stream went on past the {limit} s limit"
            )
            if overran:
                relay.stop(f"the stream passed {max_events} token events, more than the request asked for")
            try:
                await reply.relay(relay.send)
            except UpstreamError as err:
                if not relay.client_gone:
                    outcome = contract.OUTCOME_STREAM_ERROR
                    lease.decode_failed = True
                    request.write(self._stream_failed(exchange, decision, err))
            finally:
                timer.cancel()
            if relay.client_gone:
                raise ConnectionResetError("the client went away")
            outcome, tokens, tpot = self.stream_ended(exchange, lease, counter, outcome, answered)
            request.end_stream()
        except ConnectionResetError:
            if lease.client_stalled:
                return contract.OUTCOME_CLIENT_STALLED, None
            metrics.requests.labels(decision.route, contract.OUTCOME_CLIENT_DISCONNECTED).inc()
            return contract.OUTCOME_CLIENT_DISCONNECTED, None
        self._finish(exchange, decision, outcome, tokens)
        return outcome, tpot

    def first_event(self, exchange: Exchange, decision: Decision) -> None:
        """A stream's first event went on to the client, on either front: its route's TTFT (from
        the request's arrival; the attempt's own goes to `RevisionMetrics`)."""
        self._metrics.ttft.labels(decision.route).observe(time.monotonic() - exchange.started)

    def stream_ended(
        self, exchange: Exchange, lease: Lease, counter: EventCounter, outcome: str, answered: float
    ) -> tuple[str, int, float | None]:
        """A stream relayed to its end, on either front, its first event at `answered`: the
        attempt's outcome (an engine's error event in it fails the attempt, against the decode),
        the stream's output tokens, and its TPOT when it completed."""
        decision = lease.decision
        if counter.failed and outcome == contract.OUTCOME_OK:
            # the engine's own error event reached the client (SGLang ends with it and [DONE]);
            # after tokens the KV had arrived, so the failure is the decode's
            outcome = contract.OUTCOME_STREAM_ERROR
            lease.decode_failed = True
            log.warning(
                "request %s: decode %s sent an error event mid-stream",
                exchange.request_id,
                decision.decode.name,
            )
            self.count_failure(decision.decode)
        tokens = counter.output_tokens()
        if outcome != contract.OUTCOME_OK:
            return outcome, tokens, None
        return (
            outcome,
            tokens,
            time_per_output_token(time.monotonic() - answered, tokens, exchange.parsed.samples),
        )

    def _client_stalled(self, exchange: Exchange, decision: Decision, lease: Lease) -> None:
        """A streaming client read nothing for the stall time: its fault, no engine's."""
        lease.client_stalled = True
        self._metrics.requests.labels(decision.route, contract.OUTCOME_CLIENT_STALLED).inc()
        log.warning(
            "request %s: the client read nothing for %g s with its backlog full; aborted on both legs",
            exchange.request_id,
            self._client_stall_seconds,
        )

    def _stream_failed(self, exchange: Exchange, decision: Decision, err: BaseException) -> bytes:
        """The terminal SSE event of a stream whose decode failed after tokens were sent."""
        log.warning(
            "request %s: decode %s broke mid-stream: %r", exchange.request_id, decision.decode.name, err
        )
        self.count_failure(decision.decode, fatal=_unreachable(err))
        error = ApiError(
            502,
            f"the decode engine failed after the stream had started: {err}",
            type_="upstream_error",
            code="decode_failed",
        )
        return b"data: " + json.dumps(error.body()).encode() + b"\n\n"

    def _complete(self, exchange: Exchange, decision: Decision, reply: Reply, body: bytes) -> Answer:
        out = Answer(reply.status, body, _reply_headers(reply, exchange, decision))
        self._finish(exchange, decision, contract.OUTCOME_OK, completion_tokens(body))
        return out

    def _finish(
        self, exchange: Exchange, decision: Decision, outcome: str, output_tokens: int | None
    ) -> None:
        metrics = self._metrics
        metrics.requests.labels(decision.route, outcome).inc()
        metrics.prompt_tokens.observe(decision.total_tokens)
        metrics.uncached_tokens.labels(decision.route).observe(decision.uncached_tokens)
        if output_tokens is not None:
            metrics.output_tokens.observe(output_tokens)
        if exchange.session_key and outcome == contract.OUTCOME_OK:
            self._sessions.put(
                exchange.session_key, SessionPin(decision.route, decision.prefill.name, decision.decode.name)
            )


class Lease:
    """What one attempt holds on its workers and the link; each part is given back exactly once.

    The prefill part (its queue, and the KV bytes on the link) is held until the prefill leg ends:
    SGLang's prefill answers once its KV has been delivered. The decode part ends with the attempt.
    """

    __slots__ = (
        "_decode_held",
        "_dispatcher",
        "_prefill_held",
        "client_stalled",
        "decision",
        "decode_answered",
        "decode_failed",
        "learned",
        "started",
    )

    def __init__(self, dispatcher: Dispatcher, decision: Decision, now: float) -> None:
        self._dispatcher = dispatcher
        self.decision = decision
        self.started = now
        decision.prefill.begin(now, decision.uncached_tokens, decision.prefill_seconds)
        decision.decode.begin(now, decision.total_tokens, 0.0)
        decision.decode.expect(decision.kv_claim)
        dispatcher.link_inflight_bytes += decision.link_bytes
        inflight = dispatcher.inflight_tokens
        inflight[decision.prefill.pool] += decision.uncached_tokens
        inflight[Pool.DECODE] += decision.total_tokens
        self._prefill_held = True
        self._decode_held = True
        self.learned = False
        self.client_stalled = False
        self.decode_answered = False  # from then on a failing prefill leg is judged on its own
        self.decode_failed = False  # counted against the decode: the prefill's later failure is not its own

    def release_prefill(self) -> None:
        if not self._prefill_held:
            return
        self._prefill_held = False
        decision, dispatcher = self.decision, self._dispatcher
        decision.prefill.end(decision.uncached_tokens, decision.prefill_seconds)
        decision.decode.kv_arrived(decision.kv_claim)  # the prefill answers once its KV is sent
        dispatcher.link_inflight_bytes = max(0.0, dispatcher.link_inflight_bytes - decision.link_bytes)
        dispatcher.inflight_tokens[decision.prefill.pool] -= decision.uncached_tokens

    def move_decode(self, decode: Worker, now: float) -> None:
        """Another decode than the chosen one served (the gateway's report): its parts held and
        the decision follow that one, so its breaker, the prefix index and the session pin do."""
        decision = self.decision
        if self._decode_held:
            decision.decode.end(decision.total_tokens, 0.0)
            decode.begin(now, decision.total_tokens, 0.0)
        if self._prefill_held:
            decision.decode.kv_arrived(decision.kv_claim)
            decode.expect(decision.kv_claim)
        self.decision = replace(decision, decode=decode)

    def release_decode(self) -> None:
        if not self._decode_held:
            return
        self._decode_held = False
        decision = self.decision
        decision.decode.end(decision.total_tokens, 0.0)
        self._dispatcher.inflight_tokens[Pool.DECODE] -= decision.total_tokens


class _Relay:
    """Writes each chunk of the decode's streamed body straight to the client's socket.

    Runs inside the upstream connection's read callback, so it must not raise. A client that
    reads slowly pauses the decode's socket until its buffer drains; a client that went away
    closes the decode leg (the engine aborts).
    """

    __slots__ = (
        "_chunked",
        "_counter",
        "_drainer",
        "_max_events",
        "_on_stall",
        "_reply",
        "_stall_seconds",
        "_transport",
        "client_gone",
        "overrun",
    )

    def __init__(
        self,
        transport: asyncio.Transport | None,
        reply: Reply,
        counter: EventCounter,
        chunked: bool,
        stall_seconds: float,
        on_stall: Callable[[], None],
        max_events: int,
    ) -> None:
        self._transport = transport
        self._max_events = max_events
        self.overrun: str | None = None
        """Why the router ended the stream (`stop`): the decode sent more than it may."""
        self._reply = reply
        self._counter = counter
        self._chunked = chunked
        self._stall_seconds = stall_seconds
        self._on_stall = on_stall
        self._drainer: asyncio.Task[None] | None = None
        self.client_gone = False

    def send(self, data: bytes) -> None:
        transport = self._transport
        if self.overrun is not None:
            return
        if transport is None or transport.is_closing():
            if not self.client_gone:
                self.client_gone = True
                self._reply.close()
            return
        counter = self._counter
        counter.feed(data)
        if counter.events > self._max_events:
            # the event the client has begun is finished, so the error event that follows parses
            end = data.find(b"\n\n") + 2
            if end > 1:
                transport.write(b"%x\r\n%b\r\n" % (end, data[:end]) if self._chunked else data[:end])
            self.stop(f"the stream passed {self._max_events} token events, more than the request asked for")
            return
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        if self._drainer is None and transport.get_write_buffer_size() > _RELAY_HIGH_WATER:
            self._reply.pause_reading()
            self._drainer = asyncio.get_running_loop().create_task(self._resume_when_drained(transport))

    def stop(self, why: str) -> None:
        """Ends a stream that overran its bounds; the reader sees the decode fail with `why`."""
        if self.overrun is None and not self.client_gone:
            self.overrun = why
            self._reply.close(UpstreamError(why, unreachable=False))

    async def _resume_when_drained(self, transport: asyncio.Transport) -> None:
        """Resumes the decode once the client has read its backlog; a client that reads nothing
        for `stall_seconds` is cut off and the decode leg closed (the engine aborts), no one blamed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._stall_seconds
        waiting = transport.get_write_buffer_size()
        try:
            while not transport.is_closing() and waiting > _RELAY_LOW_WATER:
                await asyncio.sleep(_RELAY_DRAIN_POLL_SECONDS)
                left = transport.get_write_buffer_size()
                if left < waiting:  # the client reads: it gets more time
                    deadline = loop.time() + self._stall_seconds
                elif loop.time() > deadline:
                    self.client_gone = True
                    self._on_stall()  # first: dropping the client cancels its handler
                    self._reply.close()
                    transport.abort()
                    return
                waiting = left
        finally:
            self._drainer = None
            self._reply.resume_reading()


class EventCounter:
    """Output tokens of a stream: the last reported completion_tokens, else events carrying text.

    Events with an empty text (a chat stream's role chunk, the finish chunk) and [DONE] carry no
    token. The window keeps a tail shorter than the shortest match, so a match split across two
    chunks is counted once and none is counted twice.
    """

    __slots__ = ("_error_tail", "_events", "_reported", "_tail", "failed")

    def __init__(self) -> None:
        self._events = 0
        self._tail = b""
        self._error_tail = b"\n"  # the stream starts an event
        self._reported: int | None = None
        self.failed = False
        """An error event came by (`stream_error`)."""

    def feed(self, chunk: bytes) -> None:
        window = self._tail + chunk
        self._events += len(_TOKEN_EVENT.findall(window))
        self._tail = window[-_TOKEN_EVENT_MIN_LENGTH + 1 :]
        if not self.failed:
            seen = self._error_tail + chunk
            self._error_tail = seen[-_STREAM_ERROR_LONGEST:]
            self.failed = stream_error(seen)
        if b"completion_tokens" in window:  # rare (usage, meta_info): spare the regex otherwise
            reported = last_completion_tokens(window)
            if reported is not None:
                self._reported = reported

    @property
    def events(self) -> int:
        """Events that carried text so far."""
        return self._events

    def output_tokens(self) -> int:
        return self._reported if self._reported is not None else self._events


_TOKEN_EVENT = re.compile(rb'"(?:content|text)"\s*:\s*"(?!")')
_TOKEN_EVENT_MIN_LENGTH = len(b'"text":"x')


def _prefill_failure(task: asyncio.Future[tuple[int, bytes, str]], worker: Worker) -> LegFailure | None:
    """How a finished prefill leg failed, if it did; raises for a refusal and for the router's own bugs."""
    if task.cancelled():  # by the router itself: no sign of the engine
        return None
    error = task.exception()
    if error is not None:
        if isinstance(error, AnswerBudgetExceeded):
            raise over_budget(error)
        if not engine_fault(error):
            raise error  # answered 500, no engine blamed
        return LegFailure(worker, f"prefill leg failed: {error}", unreachable=_unreachable(error))
    status, body, content_type = task.result()
    if failed_status(status) or (status < 300 and stream_error(body)):
        return LegFailure(
            worker, f"prefill answered HTTP {status}: {body[:200]!r}", handoff=handoff_cause(body)
        )
    if status >= 400:
        raise _Refused(engine_error(status, body, content_type))
    return None


def _decode_result(task: asyncio.Future[tuple[Reply, bytes]], worker: Worker) -> tuple[Reply, bytes]:
    error = task.exception()
    if error is not None:
        if isinstance(error, AnswerBudgetExceeded):
            raise over_budget(error)
        if not engine_fault(error):
            raise error
        raise LegFailure(worker, f"decode leg failed: {error}", unreachable=_unreachable(error)) from error
    reply, first = task.result()
    if failed_status(reply.status):
        reply.release()
        raise LegFailure(
            worker, f"decode answered HTTP {reply.status}: {first[:200]!r}", handoff=handoff_cause(first)
        )
    if reply.status >= 400:
        reply.release()
        raise _Refused(engine_error(reply.status, first, reply.content_type))
    if not servable(first):  # an empty 200 (or one of something else) answers nobody
        reply.close()
        raise LegFailure(worker, f"decode answered HTTP {reply.status} with no answer in it: {first[:200]!r}")
    if stream_error(_event_head(first)):  # nothing reached the client yet: retried like a failed status
        reply.close()
        raise LegFailure(
            worker, f"decode's stream began with an error: {first[:200]!r}", handoff=handoff_cause(first)
        )
    return reply, first


def _unreachable(error: BaseException | None) -> bool:
    """No connection, or one that broke before any answer: the worker is gone, not just failing."""
    return isinstance(error, UpstreamError) and error.unreachable


def _reply_headers(reply: Reply, exchange: Exchange, decision: Decision) -> dict[str, str]:
    headers = {name: reply.headers[key] for key, name in _PASSED_HEADERS.items() if key in reply.headers}
    headers[REQUEST_ID_HEADER] = exchange.request_id
    headers[ROUTE_HEADER] = decision.route
    headers[REASON_HEADER] = decision.reason.value
    headers[CACHED_HEADER] = str(decision.total_tokens - decision.uncached_tokens)
    headers[CACHE_SOURCE_HEADER] = decision.cache_source.value
    return headers


def error_response(
    error: ApiError, request_id: str | None, *, route: str = NO_ROUTE, reason: str = NO_ROUTE
) -> Answer:
    """Every error the router answers: OpenAI's shape, the route headers (`none` when no route was
    chosen) and, for 429 and 503, when to come back. No request id when no request was read."""
    response = json_answer(error.body(), status=error.status)
    headers = response.headers
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    headers[ROUTE_HEADER] = route
    headers[REASON_HEADER] = reason
    if error.status in (429, 503):
        headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response
