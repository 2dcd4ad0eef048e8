"""The router config: the one document the operator writes and the router hot-reloads.

It carries everything the per-request policy needs and nothing it would have to ask a
Kubernetes API for: pool endpoints are plain addresses listed by the operator in both
clusters, so the router needs no credentials for the remote cluster.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from typing import Annotated, Literal, Protocol
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from prfaas_core.profiles import KvSizeModel, PrefillTimeModel, ProfileError
from prfaas_core.vocabulary import Pool

SCHEMA: Literal["prfaas.io/router-config/v1"] = "prfaas.io/router-config/v1"
CONFIG_FILE_NAME = "router-config.json"
MAX_ANSWER_BYTES = 64 * 1024 * 1024
"""The most of one engine's answer the router holds by default (`--max-answer-bytes`): the
operator sizes the router's budget for all held answers no lower."""
MAX_CACHE_SALT_CHARS = 256
"""A cache salt is a name, not a payload: it rides in every request body the router sends."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_DNS_NAME = re.compile(
    r"(?i)^(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*\.?$"
)
MAX_ENDPOINTS_PER_POOL = 512
"""More engines than a pool of one deployment has: past it every decision walks a list that
long (10000 made requests take 26 s), so the config is refused."""


def base_url_problem(url: str) -> str | None:
    """Why `url` is not an engine's base URL (``http[s]://host[:port]``), or None when it is one.

    Checked when the config is validated, so an endpoint the upstream client could not parse
    (a port out of range, a broken IPv6 literal, CR/LF that would split the request head) is a
    refused config, not a background loop that fails on every start. The reason never repeats
    the URL: a refused one may carry credentials.
    """
    if not url.isascii() or any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        return "the URL has spaces, control characters or non-ASCII characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:  # a port out of range or not a number, a broken [IPv6] literal
        return f"the URL does not parse ({str(err).split(':')[0]})"
    if parts.scheme not in ("http", "https"):
        return "the URL's scheme must be http or https"
    if "@" in parts.netloc:
        return "the URL carries credentials (user:password@); engines are addressed without any"
    if parts.path or parts.query or parts.fragment or url.endswith(("?", "#")):
        return "a base URL is scheme, host and port only (no path, query or fragment)"
    if port == 0:
        return "the URL's port must be 1-65535"
    host = parts.hostname or ""
    if parts.netloc.startswith("["):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return "the URL's [host] is not an IPv6 address"
    elif not _DNS_NAME.match(host):
        return "the URL's host is not a host name or an IPv4 address"
    return None


def _checked_base_url(value: str) -> str:
    problem = base_url_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


BaseUrl = Annotated[str, AfterValidator(_checked_base_url)]
"""An engine's or a pool master's base URL, refused as `base_url_problem` says."""


class Endpoint(_Strict):
    """One SGLang engine: its HTTP base URL and, for prefill, the bootstrap port."""

    name: str = Field(description="pod name, for logs and metrics")
    url: BaseUrl = Field(description="base URL, e.g. http://10.1.2.3:30000")
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    fingerprint: str = Field(
        default="",
        description="the engine's KV-layout fingerprint: the router pairs a prefill only with a decode of the "
        "same one (two are listed while a rollout changes the layout)",
    )
    unobserved_since: float | None = Field(
        default=None,
        ge=0,
        description="unix time since which the operator has not seen this engine's pod (its cluster could not "
        "be listed) and lists it from its last observation; the router then routes to it only while its "
        "/server_info says it is still the engine listed (engine_identity_problem). None: observed this pass",
    )


class LinkSpec(_Strict):
    """The cross-cluster link the KV of an offloaded prefill crosses."""

    bandwidth_bytes_per_second: float = Field(gt=0)
    headroom: float = Field(default=0.8, gt=0, le=1, description="fraction of the bandwidth offloads may use")
    latency_seconds: float = Field(default=0.0, ge=0)

    @property
    def budget_bytes_per_second(self) -> float:
        return self.bandwidth_bytes_per_second * self.headroom


class KvSize(_Strict):
    bytes_per_token: float = Field(gt=0)
    fixed_bytes: float = Field(default=0, ge=0)

    def model(self) -> KvSizeModel:
        return KvSizeModel(bytes_per_token=self.bytes_per_token, fixed_bytes=self.fixed_bytes)


class PrefillTime(_Strict):
    """Coefficients of T(l) = c0 + c1 l + c2 l^2, validated as positive and increasing."""

    c0: float
    c1: float
    c2: float
    min_tokens: float = 1.0
    max_tokens: float = 262144.0

    @model_validator(mode="after")
    def _usable(self) -> PrefillTime:
        try:
            self.model()
        except ProfileError as err:
            raise ValueError(str(err)) from err
        return self

    def model(self) -> PrefillTimeModel:
        return PrefillTimeModel(self.c0, self.c1, self.c2, self.min_tokens, self.max_tokens)

    @classmethod
    def of(cls, model: PrefillTimeModel) -> PrefillTime:
        return cls(
            c0=model.c0, c1=model.c1, c2=model.c2, min_tokens=model.min_tokens, max_tokens=model.max_tokens
        )


class MeasuredPoint(Protocol):
    """One measured prefill time as a profile holds it (the CR's ProfilePoint, the simulator's points)."""

    @property
    def tokens(self) -> float: ...
    @property
    def seconds(self) -> float: ...


def fitted_prefill_time(points: Sequence[MeasuredPoint]) -> PrefillTime:
    """T(l) fitted from a cluster's measured points, as the router config carries it (the planner fits
    the same way); raises ProfileError when the fit is not usable."""
    return PrefillTime.of(PrefillTimeModel.fit([(point.tokens, point.seconds) for point in points]))


DEFAULT_TTFT_SECONDS = 30
"""The CR's default time-to-first-token objective (prfaas_operator.api.SloSpec), which the simulator runs with too."""


class Slo(_Strict):
    ttft_seconds: float = Field(gt=0)
    tpot_seconds: float = Field(gt=0)


class DecodeCapacity(_Strict):
    """What the router needs to estimate a request's wait for a decode slot (admission when decode binds)."""

    max_running_requests: int = Field(
        ge=1, description="requests one decode instance runs at once (BS_max); an engine's own report wins"
    )
    seconds_per_request: float = Field(
        gt=0, description="mean seconds a request holds a decode slot: mean output tokens x decode step"
    )
    output_tokens_cv: float = Field(
        default=0.0,
        ge=0,
        le=1000,
        description="coefficient of variation of output lengths (standard deviation / mean); the longer "
        "the tail, the longer a full batch may go without freeing a slot",
    )


class Pools(_Strict):
    prfaas_prefill: list[Endpoint] = Field(default_factory=list, max_length=MAX_ENDPOINTS_PER_POOL)
    local_prefill: list[Endpoint] = Field(default_factory=list, max_length=MAX_ENDPOINTS_PER_POOL)
    decode: list[Endpoint] = Field(default_factory=list, max_length=MAX_ENDPOINTS_PER_POOL)

    def of(self, pool: Pool) -> list[Endpoint]:
        return list(getattr(self, pool.value))


class CachePool(_Strict):
    """A cluster's shared KV pool (SGLang HiCache on a Mooncake Store the operator deploys): a
    prompt any prefill of the cluster computed is written to it, and each prefill of that cluster
    can fetch it from there instead of computing it again, at `fetch_bytes_per_second`."""

    health_url: BaseUrl = Field(
        description="the pool master's HTTP admin base URL; the router counts pool hits only while its "
        "/health answers serving (an unreachable pool means per-instance caches, never an error)"
    )
    fetch_bytes_per_second: float = Field(
        gt=0,
        description="KV read bandwidth from the pool into one prefill, for the TTFT estimate of a pool hit",
    )


class PoolShare(_Strict):
    """This PD cluster's share of a PrfaaS pool that several PD clusters consume, as the pool's
    controller last published it (`shares.divide`): the router keeps its offloads within it
    (`shares.admit`). Prompt tokens prefilled per second, for the whole consumer: each router
    replica takes 1/router_replicas of the share and of the entitlement, as of the link budget."""

    tokens_per_second: float = Field(
        ge=0, description="what this cluster may offload now: its entitlement, what others lend it, or less"
    )
    entitled_tokens_per_second: float = Field(
        ge=0,
        description="its weight's part of the pool when every consumer asks for all it may: taken back at "
        "once, before the next division lends it back",
    )
    unclaimed_tokens_per_second: float = Field(
        default=0.0,
        ge=0,
        description="pool capacity no consumer can use now: borrowed beyond the share only while the "
        "pool's engines report a queue that leaves room for it",
    )


class RouterConfig(_Strict):
    """Versioned router config. `version` only grows; the router ignores an older one."""

    schema_: Literal["prfaas.io/router-config/v1"] = Field(default=SCHEMA, alias="schema")
    version: int = Field(ge=0, description="monotonic; the operator bumps it on every change")
    served_model_name: str = Field(min_length=1)
    threshold_tokens: int = Field(ge=0, description="uncached tokens above which a prefill is offloaded")
    block_size_tokens: int = Field(default=512, ge=1, description="prefix-hash block size")
    bandwidth_mode: Literal["Scarce", "Abundant"] = Field(
        default="Scarce", description="how prefix hits in the other cluster count (paper 3.4.3)"
    )
    chars_per_token: float = Field(
        default=4.0, gt=0, description="calibrated text-to-token estimate when a request carries no token ids"
    )
    session_affinity_header: str | None = Field(default=None, description="header that pins a conversation")
    router_replicas: int = Field(
        default=1,
        ge=1,
        description=(
            "router replicas serving this config: each commits 1/router_replicas of the link budget, "
            "and with more than one a conversation's instances follow from its session key alone"
        ),
    )
    link: LinkSpec
    kv_size: KvSize
    prefill_time: Annotated[dict[Literal["prfaas", "local"], PrefillTime], Field(min_length=2)]
    slo: Slo
    pools: Pools = Field(default_factory=Pools)
    decode: DecodeCapacity | None = Field(
        default=None,
        description="decode capacity; None: the TTFT estimate leaves out the wait for a decode slot",
    )
    fingerprint: str = Field(
        default="",
        description="the KV-layout fingerprint the spec asks for (each endpoint names its own)",
    )
    cache_pools: dict[Literal["prfaas", "local"], CachePool] = Field(
        default_factory=dict,
        description="the clusters whose engines use a shared KV pool; a cluster absent here has per-instance "
        "radix caches only",
    )
    decode_radix_cache: bool = Field(
        default=False,
        description="decodes keep finished requests' KV (--disaggregation-decode-enable-radix-cache): a "
        "prefill sends only the KV past the prefix its decode already holds",
    )
    cache_salt: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="the consumer's cache namespace on the engines (SGLang's `cache_salt`): the router sets it "
        "on every request it sends, replacing any a client sent, so a consumer of a shared PrfaaS pool never "
        "reuses KV another consumer computed (SGLang reads an empty one as none, so none is empty); None: requests "
        "go as the client sent them",
    )

    pool_share: PoolShare | None = Field(
        default=None,
        description="this cluster's published share of a PrfaaS pool shared with other PD clusters; None: "
        "a pool of its own, offloads bounded by the link and the TTFT SLO alone",
    )

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("session_affinity_header")
    @classmethod
    def _header_name(cls, value: str | None) -> str | None:
        if value is not None and (not value or any(c.isspace() or c == ":" for c in value)):
            raise ValueError("session_affinity_header must be a bare HTTP header name")
        return value.lower() if value else value

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> RouterConfig:
        return cls.model_validate_json(text)
