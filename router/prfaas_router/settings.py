"""The router's process settings, defined once: each field carries its type, default and help,
and the command line is made from the fields (`add_flags`, `from_flags`, `to_flags`, shared
with the operator's settings in `prfaas_core.flags`).

Routing settings come from the hot-reloaded config file (`prfaas_core.router_config`); these
are what the process starts with. The operator writes some of them as flags into the router
Deployment's args, so a flag's spelling is part of that contract: the flag of a field is its
name with dashes (`config_poll_seconds` -> `--config-poll-seconds`) unless it names another.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prfaas_core.flags import add_flags, check_at_least, flag_of, setting, settings_from, to_flags
from prfaas_core.router_config import MAX_ANSWER_BYTES
from prfaas_core.routing.link_estimate import LINK_POLL_SECONDS, SGLANG_CHUNK_TOKENS, LinkEstimateRules
from prfaas_core.routing.workers import LOAD_POLL_SECONDS

from prfaas_router.configmap_source import ConfigMapRef
from prfaas_router.http.server import ClientLimits
from prfaas_router.payloads import Limits

# the command line made from the fields (prfaas_core.flags), where the router's callers find it
__all__ = ["LOG_LEVELS", "RouterSettings", "add_flags", "flag_of", "from_flags", "to_flags"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
PD_MODE_PICKER = "picker"
"""Behind a gateway the picker fires a PD request's prefill itself (prfaas_router.picker)."""
PD_MODE_SIDECAR = "sidecar"
"""Behind a gateway llm-d's decode sidecar fires it, to the prefill the picker names."""
# the defaults of the parts the flags fill in (slotted dataclasses keep them on instances only)
_LINK = LinkEstimateRules()
_CLIENTS = ClientLimits()
_LIMITS = Limits()
ANSWER_BUDGET_BYTES = 512 * 1024 * 1024
"""All answers held at once by default: eight answers at the 64 MiB cap."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings:
    """Process settings of one router (its flags, in the order `--help` lists them)."""

    config_path: Path = setting(help="router config JSON (hot-reloaded)", flag="--config")  # noqa: RUF009
    host: str = setting("127.0.0.1")
    port: int = setting(8000)
    picker_port: int | None = setting(
        None,
        "also serve as a gateway's endpoint picker on this port: Envoy's external processing and "
        "gRPC health (prfaas_router.picker); the same policy as the HTTP port's",
    )
    picker_health_port: int | None = setting(
        None,
        "with --picker-port: gRPC health alone on this port too, for the kubelet's probes and gateways "
        "that health-check a picker on its own port (GKE: 9003)",
    )
    picker_tls_dir: Path | None = setting(  # noqa: RUF009 (setting() is a dataclasses.field)
        None,
        "serve the picker port over TLS with DIR/tls.crt and DIR/tls.key (a mounted kubernetes.io/tls "
        "Secret); the health port stays plain text (the kubelet's gRPC probes speak no TLS)",
        metavar="DIR",
    )
    picker_tls_self_signed: bool = setting(
        False,
        "serve the picker port over TLS with a self-signed certificate made at start, as the inference "
        "extension's picker does (Istio accepts it without verifying)",
    )
    picker_pd_mode: str = setting(
        PD_MODE_PICKER,
        "who fires a PD request's prefill behind a gateway: picker (the picker itself, with the body's "
        "bootstrap fields; no sidecar) or sidecar (llm-d's decode sidecar: the picker names the prefill "
        "in x-prefiller-host-port and the sidecar sends it)",
        choices=(PD_MODE_PICKER, PD_MODE_SIDECAR),
    )
    config_poll_seconds: float = setting(1.0)
    # why these four: prfaas_router.health
    health_path: str = setting(
        "/ready",
        "SGLang's /ready answers at once; its /health runs a generation and never answers under 1 s",
    )
    health_interval_seconds: float = setting(1.0)
    health_timeout_seconds: float = setting(1.0)
    health_failure_threshold: int = setting(
        2, "timed-out checks in a row that eject a worker (a refusal or an error ejects at once)", at_least=1
    )
    # the decode engines' /v1/loads, for the decode-wait estimate
    load_poll_interval_seconds: float = setting(LOAD_POLL_SECONDS)
    load_poll_timeout_seconds: float = setting(1.0)
    # the PrfaaS prefill engines' /metrics, for the live link estimate; the answers cross the
    # link, behind the KV when it is congested (hence the longer timeout)
    link_poll_interval_seconds: float = setting(LINK_POLL_SECONDS)
    link_poll_timeout_seconds: float = setting(3.0)
    link_half_life_seconds: float = setting(_LINK.half_life_seconds)
    link_floor_fraction: float = setting(_LINK.floor_fraction)
    link_stale_after_seconds: float = setting(_LINK.stale_after_seconds)
    prefill_chunk_tokens: int = setting(
        SGLANG_CHUNK_TOKENS,
        "SGLang's --chunked-prefill-size on the PrfaaS prefills (8192 on H20/H200): their "
        "transfer latencies cover the last chunk only",
        at_least=1,
    )
    breaker_failure_threshold: int = setting(3, at_least=1)
    breaker_cooldown_seconds: float = setting(5.0)
    connect_timeout_seconds: float = setting(1.0)
    read_timeout_seconds: float = setting(600.0)
    upstream_keepalive_seconds: float = setting(
        4.0,
        "close idle engine connections after this long (under uvicorn's 5 s, so SGLang never closes one first)",
    )
    max_body_bytes: int = setting(32 * 1024 * 1024, at_least=1)
    max_stream_seconds: float = setting(
        6 * 3600.0,
        "a stream still going this long is ended as its decode's failure (a whole context at 80 ms a token)",
    )
    max_answer_bytes: int = setting(
        MAX_ANSWER_BYTES,
        "the most of an engine's answer the router holds (a whole answer, or a stream's first event); "
        "past it the engine failed",
        at_least=1,
    )
    answer_bytes_per_token: int = setting(
        1024,
        "a request's answer is held up to this per token it may generate (max tokens x n, plus "
        "256 per logprob alternative asked and the prompt when echoed; at least 64 KiB, at most "
        "--max-answer-bytes): past it the engine is lying and failed; 0: every answer up to "
        "--max-answer-bytes",
        at_least=0,
    )
    answer_budget_bytes: int = setting(
        ANSWER_BUDGET_BYTES,
        "the most of all engines' answers held at once; an answer that would pass it (beyond its "
        "first 64 KiB) is dropped and its client answered 503 with Retry-After (at least "
        "--max-answer-bytes)",
        at_least=1,
    )
    shutdown_delay_seconds: float = setting(
        0.0,
        "after SIGUSR1 (the preStop hook) or SIGTERM: not ready, connections closed after their "
        "response, the listener open this long from the drain's start",
    )
    drain_timeout_seconds: float = setting(60.0, "then requests in flight get this long to finish")
    max_client_connections: int = setting(
        _CLIENTS.max_connections,
        "past this many open client connections a new one gets 503 with Retry-After "
        "(lowered to fit the open file limit)",
        at_least=1,
    )
    client_idle_timeout_seconds: float = setting(
        _CLIENTS.idle_timeout_seconds,
        "close a client connection idle this long, or that has not sent a whole request head in that time",
    )
    client_body_timeout_seconds: float = setting(
        60.0, "a request body must arrive within this time (else 408)"
    )
    client_stall_seconds: float = setting(
        30.0,
        "a streaming client that reads nothing this long while the router holds its backlog is cut "
        "off and its request aborted on both engines",
    )
    max_header_bytes: int = setting(
        _CLIENTS.max_header_bytes, "the longest request line or header field (431 past it)", at_least=1
    )
    max_n: int = setting(_LIMITS.max_n, "the largest n (copies) of a request", at_least=1)
    max_batch: int = setting(
        _LIMITS.max_batch, "the most generations one request may ask for (prompts x n)", at_least=1
    )
    max_context_tokens: int = setting(
        _LIMITS.context_tokens,
        "the model's context length: a longer output (max_tokens), or token-id prompt plus output, is refused",
        at_least=1,
    )
    max_attempts: int = setting(3, at_least=1)
    prefix_index_blocks: int = setting(262144)
    prefix_index_prompts: int = setting(65536)
    session_capacity: int = setting(65536)
    tokenizer_path: Path | None = setting(  # noqa: RUF009 (setting() is a dataclasses.field)
        None,
        "the model's tokenizer.json: count and hash text prompts in real tokens (default: estimate)",
        flag="--tokenizer",
    )
    max_tokenize_chars: int = setting(
        256 * 1024,
        "a request whose texts are longer is not tokenized: its tokens are estimated from its characters",
        at_least=0,
    )
    config_map: str | None = setting(
        None,
        "also watch the config's ConfigMap through the API with the pod's ServiceAccount "
        "(seconds, where the kubelet refreshes the mounted file in a minute or more)",
        metavar="NAMESPACE/NAME",
    )
    log_level: str = setting("INFO", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        """Refuses settings the router cannot run with (ValueError, naming the flag)."""
        _ = self.config_map_ref
        if self.shutdown_delay_seconds < 0 or self.drain_timeout_seconds <= 0:
            raise ValueError(
                "--shutdown-delay-seconds must be at least 0 and --drain-timeout-seconds above 0"
            )
        check_at_least(self)
        if self.picker_tls_dir is not None and self.picker_tls_self_signed:
            raise ValueError("--picker-tls-dir and --picker-tls-self-signed: one TLS certificate, not both")
        if self.answer_budget_bytes < self.max_answer_bytes:
            raise ValueError("--answer-budget-bytes must be at least --max-answer-bytes (one whole answer)")
        try:
            _ = self.link_estimate
        except ValueError as err:
            raise ValueError(f"link estimate: {err}") from None

    @property
    def config_map_ref(self) -> ConfigMapRef | None:
        if self.config_map is None:
            return None
        return ConfigMapRef.parse(self.config_map, key=self.config_path.name)

    @property
    def link_estimate(self) -> LinkEstimateRules:
        return LinkEstimateRules(
            self.link_half_life_seconds, self.link_floor_fraction, self.link_stale_after_seconds
        )

    @property
    def clients(self) -> ClientLimits:
        return ClientLimits(
            self.max_client_connections, self.client_idle_timeout_seconds, self.max_header_bytes
        )

    @property
    def limits(self) -> Limits:
        return Limits(self.max_n, self.max_batch, self.max_context_tokens)


def from_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> RouterSettings:
    """The settings the flags give (a parser made by `add_flags`); bad ones end in a usage error."""
    namespace = parser.parse_args(argv)
    try:
        return settings_from(namespace, RouterSettings)
    except ValueError as err:
        parser.error(str(err))
