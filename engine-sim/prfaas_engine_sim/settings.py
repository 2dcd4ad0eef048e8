"""The fake engine's settings and its CLI, which takes SGLang launch_server's argument names.

An engine pod's own SGLang arguments (``--disaggregation-mode prefill
--disaggregation-bootstrap-port 8998 ...``) parse as they are; arguments nobody knows are
returned so the entry point can warn about them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from prfaas_core.vocabulary import KV_FINGERPRINT_ENV

Mode = Literal["null", "prefill", "decode"]
MODES: tuple[Mode, ...] = ("null", "prefill", "decode")
ENGINE_TYPES: dict[Mode, str] = {"null": "unified", "prefill": "prefill", "decode": "decode"}


@dataclass(frozen=True)
class EngineSettings:
    """Everything one fake engine needs; the CLI maps SGLang's argument names onto these fields."""

    mode: Mode = "null"
    host: str = "127.0.0.1"
    port: int = 30000
    """0 picks a free port (tests); FakeEngine.port tells which."""
    bootstrap_port: int = 8998
    """Prefill: where the bootstrap server listens (0: a free port). Decode: used for bootstrap_port=null."""
    profile: str = "h20"
    """h200, h20, PATH.yaml or PATH.yaml#hardware (see engine_timing)."""
    time_scale: float = 1.0
    """Multiplies every simulated compute time; 0 means no sleeping at all."""
    served_model_name: str | None = None
    model_path: str = "prfaas/fake-hybrid-model"
    tokenizer_path: str | None = None
    kv_bytes_per_token: float | None = None
    """Overrides the profile's S_kv(l) slope (and then the fixed part defaults to 0)."""
    kv_fixed_bytes: float | None = None
    kv_scale: float = 1e-3
    """Fraction of the real KV bytes actually sent."""
    max_decode_batch: int | None = None
    decode_step_seconds: float | None = None
    page_size: int = 1
    kv_cache_dtype: str = "auto"
    link_rate_bytes_per_second: float | None = None
    """Prefill: pace all transfers of this instance to this rate (bytes actually sent per second)."""
    chars_per_token: float = 4.0
    transfer_backend: str = "mooncake"
    tp_size: int = 1
    dp_size: int = 1
    nnodes: int = 1
    """Nodes of this one instance (SGLang ``--nnodes``): rank 0 serves, the others join it (group)."""
    node_rank: int = 0
    dist_init_addr: str | None = None
    """``HOST:PORT`` where node rank 0 gathers the group (SGLang ``--dist-init-addr``)."""
    default_max_new_tokens: int = 16
    max_prefill_tokens: int = 16384
    max_total_tokens: int = 2_000_000
    """The KV pool in tokens: bounds the prefix cache and defines token_usage."""
    context_length: int = 262144
    prefix_cache_block_tokens: int = 64
    chunked_prefill_size: int = 8192
    """Tokens per prefill chunk: the KV of each chunk goes out once its forward ends (SGLang's
    default on H20 and H200, arg_groups/memory_hook.py ``_handle_gpu_memory_settings``)."""
    bootstrap_timeout: float | None = None
    """Wall-clock seconds a PD leg waits for the other to bootstrap; None: SGLang's, scaled (`PdTimeouts`)."""
    waiting_timeout: float | None = None
    """Wall-clock seconds a bootstrapped transfer may take; None: SGLang's, scaled (`PdTimeouts`)."""
    kv_heartbeat_seconds: float | None = None
    """Wall-clock heartbeat interval of a decode on its prefill; None: SGLang's, scaled (`PdTimeouts`)."""
    kv_heartbeat_max_failures: int = 2
    """Missed heartbeats in a row that fail a decode's transfers (SGLang:
    ``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE``, default 2)."""
    kv_fingerprint: str = ""
    """The pod's KV-layout fingerprint (the operator's downward-API env ``PRFAAS_KV_FINGERPRINT``; ""
    unknown). A decode sends it with each KV request and a prefill of another one refuses it: a
    rollout must never pair layouts, and the engines count it (SGLang itself knows no fingerprint;
    it checks page size and KV dtype alone)."""
    model_load_seconds: float = 0.0
    """Wall-clock seconds before the engine listens at all, as SGLang loads its weights before its
    HTTP and bootstrap servers bind (http_server.py ``launch_server``: ``_launch_subprocesses``
    returns once the schedulers have loaded the model; real engines take minutes)."""
    startup_seconds: float = 0.0
    """/health and /ready answer 503 for this long once listening, like an engine warming up (the
    command line's default is SGLang's warm-up, scaled: ``SGLANG_WARMUP_SECONDS``)."""
    fail_kv_transfers: int = 0
    """The next this-many KV handoffs of this PD engine fail (tests; ``POST /fake/fail_kv_transfers``
    adds more at run time). A prefill fails once its decode connected, so both legs fail (the
    decode's stream ends in an abort); a decode fails once its KV arrived, alone."""
    health_generation_delay: float = 1.0
    """How often /health looks whether the engine answered its one-token generation; it looks
    first after this long, so /health never answers sooner (SGLang: http_server.py
    ``health_generate``, ``await asyncio.sleep(1)``). Wall-clock seconds, not scaled; only
    tests lower it."""
    health_check_timeout: float = 20.0
    """/health answers 503 when the engine produced nothing for this long (SGLang:
    ``SGLANG_HEALTH_CHECK_TIMEOUT``, default 20 s; see ``health_check_timeout_from``)."""
    fault_error_ratio: float = 0.0
    """Each generate request answers HTTP 500 (SGLang's error body) with this probability, on
    whichever role the engine plays: a revision that is Ready but fails (tests, rollouts)."""
    fault_seed: int | None = None
    """Seeds the draws of ``fault_error_ratio``; None: a fresh seed, so that the engines of one
    revision do not fail the same requests in step."""
    fault_slowdown: float = 1.0
    """Multiplies every timing of the hardware profile (prefill, decode steps, the paced KV link):
    an engine this many times slower, still healthy. Not the time scale: the PD timeouts and the
    link metrics' real-time accounting stay as they are."""
    health_endpoint_generation: bool = True
    """False: ``/health`` answers 200 at once, ``/health_generate`` still generates (SGLang:
    ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``, see ``health_endpoint_generation_from``)."""

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("port", "bootstrap_port"):
            if not 0 <= getattr(self, name) <= 65535:
                problems.append(f"{name} must be a port number (0 for any free one)")
        for name in ("time_scale", "kv_scale", "model_load_seconds", "startup_seconds"):
            if not getattr(self, name) >= 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("chars_per_token", "health_generation_delay", "health_check_timeout"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("bootstrap_timeout", "waiting_timeout", "kv_heartbeat_seconds"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "page_size",
            "tp_size",
            "dp_size",
            "max_prefill_tokens",
            "max_total_tokens",
            "context_length",
            "prefix_cache_block_tokens",
            "chunked_prefill_size",
            "kv_heartbeat_max_failures",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            problems.append(f"node_rank must be in [0, nnodes), got {self.node_rank} of {self.nnodes}")
        if self.nnodes > 1:
            try:
                parse_address(self.dist_init_addr or "")
            except ValueError as err:  # SGLang would wait for ranks that cannot reach 127.0.0.1
                problems.append(f"nnodes > 1 needs dist_init_addr: {err}")
        if not 0 <= self.fault_error_ratio <= 1:
            problems.append(f"fault_error_ratio must be in [0, 1], got {self.fault_error_ratio}")
        if not self.fault_slowdown > 0:
            problems.append(f"fault_slowdown must be > 0, got {self.fault_slowdown}")
        if self.fail_kv_transfers < 0:
            problems.append("fail_kv_transfers must be >= 0")
        if self.default_max_new_tokens < 0:
            problems.append("default_max_new_tokens must be >= 0")
        if self.max_decode_batch is not None and self.max_decode_batch < 1:
            problems.append("max_decode_batch must be >= 1")
        if self.decode_step_seconds is not None and not self.decode_step_seconds >= 0:
            problems.append("decode_step_seconds must be >= 0")
        if self.link_rate_bytes_per_second is not None and not self.link_rate_bytes_per_second > 0:
            problems.append("link_rate_bytes_per_second must be > 0")
        if self.kv_bytes_per_token is not None and not self.kv_bytes_per_token > 0:
            problems.append("kv_bytes_per_token must be > 0")
        if self.kv_fixed_bytes is not None and (self.kv_bytes_per_token is None or self.kv_fixed_bytes < 0):
            problems.append("kv_fixed_bytes needs kv_bytes_per_token and must be >= 0")
        if self.max_total_tokens < self.prefix_cache_block_tokens:
            problems.append("max_total_tokens must hold at least one prefix cache block")
        if problems:
            raise ValueError("invalid fake engine settings: " + "; ".join(problems))

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def compute_scale(self) -> float:
        """What each time of the hardware profile is multiplied by: the time scale, slowed down."""
        return self.time_scale * self.fault_slowdown

    @property
    def paced_link_rate(self) -> float | None:
        """The rate the KV link is paced to, slowed down with the rest."""
        rate = self.link_rate_bytes_per_second
        return None if rate is None else rate / self.fault_slowdown

    @property
    def pd_timeouts(self) -> PdTimeouts:
        """The PD legs' timeouts and heartbeat: the explicit settings, else SGLang's scaled."""
        scale = self.time_scale or 1.0

        def scaled(sglang_seconds: float, floor: float) -> float:
            return max(sglang_seconds * scale, floor)

        return PdTimeouts(
            bootstrap=self.bootstrap_timeout or scaled(SGLANG_BOOTSTRAP_TIMEOUT, MIN_SCALED_TIMEOUT),
            waiting=self.waiting_timeout or scaled(SGLANG_WAITING_TIMEOUT, MIN_SCALED_TIMEOUT),
            heartbeat_interval=self.kv_heartbeat_seconds
            or scaled(SGLANG_HEARTBEAT_INTERVAL, MIN_SCALED_HEARTBEAT_INTERVAL),
            heartbeat_max_failures=self.kv_heartbeat_max_failures,
            info_retry_interval=SGLANG_PREFILL_INFO_RETRY_INTERVAL * self.time_scale,  # 0: at once
            info_attempts=SGLANG_PREFILL_INFO_ATTEMPTS,
        )


# SGLang 0.5.23's defaults (environ.py), in its own seconds
SGLANG_WARMUP_SECONDS = 2.5
"""/health and /ready answer 503 about this long once a PD engine listens: its warm-up generation
(observed on real SGLang on CPU, tests/real_sglang/test_differential.py). The command line's
default for --startup-seconds, times the time scale."""
SGLANG_BOOTSTRAP_TIMEOUT = 300.0
"""``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``: a prefill request whose decode never bootstraps
fails after this (common/conn.py ``CommonKVSender._check_bootstrap_timeout``)."""
SGLANG_WAITING_TIMEOUT = 300.0
"""``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``: a decode request whose KV never arrives fails after
this (common/conn.py ``CommonKVReceiver._poll`` and ``_check_waiting_timeout``)."""
SGLANG_HEARTBEAT_INTERVAL = 5.0
"""``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL``: a decode GETs each prefill's bootstrap ``/health``
this often (common/conn.py ``_start_heartbeat_checker_thread``; it never goes below 2 s there)."""

SGLANG_PREFILL_INFO_ATTEMPTS = 15
SGLANG_PREFILL_INFO_RETRY_INTERVAL = 1.0
"""A decode fetches its prefill's parallel info from the bootstrap server at most once a second,
15 times, then aborts the request (decode.py ``_ensure_prefill_info``, ``_max_ensure_retries``,
``_ensure_retry_interval``): observed, its error event comes about 14 s after the request."""
MIN_SCALED_TIMEOUT = 5.0
"""Scaled timeouts never go below this: at the tests' time scale (0.02) SGLang's 300 s would be
6 s, and a loaded 2-core machine must not fail a slow but healthy handoff."""
MIN_SCALED_HEARTBEAT_INTERVAL = 1.0
"""Scaled heartbeats never go below this: SGLang's 5 s at time scale 0.02 would be 0.1 s, and
two missed ones (0.2 s of silence) are an event-loop stall on a loaded machine, not a dead
prefill. A test that needs faster failover sets ``kv_heartbeat_seconds`` itself."""


@dataclass(frozen=True)
class PdTimeouts:
    """What the PD legs wait for, in wall-clock seconds."""

    bootstrap: float
    """Either leg waits this long for the other (no decode connected, no prefill request)."""
    waiting: float
    """A transfer that bootstrapped must deliver its last byte within this."""
    heartbeat_interval: float
    heartbeat_max_failures: int
    info_retry_interval: float
    """A decode whose prefill's bootstrap server does not answer asks again this often..."""
    info_attempts: int
    """...this many times in all, then fails the request."""

    @property
    def silence(self) -> float:
        """A prefill silent this long is lost to its decode (SGLang: ``_handle_node_failure``)."""
        return self.heartbeat_interval * self.heartbeat_max_failures


def advertised_host(bind_host: str, environ: Mapping[str, str]) -> str:
    """The address decode engines dial for this prefill's KV: ``SGLANG_HOST_IP`` when set (SGLang
    reads it too; the operator sets it to the pod IP), else the address the engine binds."""
    return environ.get("SGLANG_HOST_IP", "").strip() or bind_host


_TRUE, _FALSE = ("true", "1", "yes", "y"), ("false", "0", "no", "n")


def health_endpoint_generation_from(environ: Mapping[str, str]) -> bool:
    """``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` as SGLang parses it (environ.py ``EnvBool``,
    default true; any other value is an error there too)."""
    value = environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "").strip().lower()
    if not value or value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f'SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION: "{value}" is not a valid boolean value')


def health_check_timeout_from(environ: Mapping[str, str]) -> float:
    """``SGLANG_HEALTH_CHECK_TIMEOUT`` (http_server.py ``HEALTH_CHECK_TIMEOUT``: an int, default 20 s)."""
    return float(int(environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20")))


# ----------------------------------------------------------------------------- CLI

_IGNORED_SGLANG_FLAGS = ("--enable-metrics", "--trust-remote-code")
_IGNORED_SGLANG_OPTIONS = ("--revision", "--mem-fraction-static", "--disaggregation-ib-device")


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` too), as ``--dist-init-addr`` takes it."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"dist_init_addr must be HOST:PORT, got {address!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def build_arg_parser() -> argparse.ArgumentParser:
    """Our options plus SGLang launch_server's names for the same things (a pod's args work as they are)."""
    parser = argparse.ArgumentParser(
        prog="prfaas-engine-sim",
        description="A fake SGLang engine (HTTP API, PD bootstrap, sglang:* metrics) timed by a hardware profile.",
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--mode", "--disaggregation-mode", dest="mode", choices=MODES, default="null")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--bootstrap-port", "--disaggregation-bootstrap-port", dest="bootstrap_port", type=int, default=8998)
    add("--disaggregation-transfer-backend", dest="transfer_backend", default="mooncake")
    add("--profile", default="h20", help="h200, h20, PATH.yaml or PATH.yaml#hardware")
    add("--time-scale", type=float, default=1.0, help="multiplies all simulated times; 0 = zero-time compute")
    add("--served-model-name", default=None)
    add("--model-path", "--model", dest="model_path", default=EngineSettings.model_path)
    add("--tokenizer-path", default=None)
    add("--kv-bytes-per-token", type=float, default=None)
    add("--kv-fixed-bytes", type=float, default=None)
    add("--kv-scale", type=float, default=1e-3, help="fraction of the real KV bytes actually sent")
    add("--max-decode-batch", "--max-running-requests", dest="max_decode_batch", type=int, default=None)
    add("--decode-step-seconds", type=float, default=None)
    add("--page-size", type=int, default=1)
    add("--kv-cache-dtype", default="auto")
    add("--link-rate-bytes-per-second", type=float, default=None)
    add("--chars-per-token", type=float, default=4.0)
    add("--tp-size", "--tp", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    add("--dp-size", "--dp", "--data-parallel-size", dest="dp_size", type=int, default=1)
    add("--nnodes", type=int, default=1)
    add("--node-rank", type=int, default=0)
    add("--dist-init-addr", "--nccl-init-addr", dest="dist_init_addr", default=None)
    add("--default-max-new-tokens", type=int, default=16)
    add("--max-prefill-tokens", type=int, default=16384)
    add("--max-total-tokens", type=int, default=EngineSettings.max_total_tokens)
    add("--context-length", type=int, default=EngineSettings.context_length)
    add("--prefix-cache-block-tokens", type=int, default=64)
    add("--chunked-prefill-size", type=int, default=EngineSettings.chunked_prefill_size)
    add(
        "--bootstrap-timeout",
        type=float,
        default=None,
        help="wall-clock seconds (default: SGLang's 300 s, scaled)",
    )
    add(
        "--waiting-timeout",
        type=float,
        default=None,
        help="wall-clock seconds (default: SGLang's 300 s, scaled)",
    )
    add(
        "--kv-heartbeat-seconds",
        type=float,
        default=None,
        help="wall-clock seconds (default: SGLang's 5 s, scaled)",
    )
    add("--kv-heartbeat-max-failures", type=int, default=EngineSettings.kv_heartbeat_max_failures)
    add(
        "--model-load-seconds",
        type=float,
        default=0.0,
        help="wall-clock seconds before the engine listens (SGLang loads its weights first)",
    )
    add(
        "--startup-seconds",
        type=float,
        default=None,
        help="seconds of warm-up 503s (default: SGLang's, scaled)",
    )
    add("--fail-kv-transfers", type=int, default=0, help="the next N KV handoffs fail (tests)")
    add(
        "--fault-error-ratio",
        type=float,
        default=0.0,
        help="each generate request answers HTTP 500 with this probability (faults for tests and rollouts)",
    )
    add("--fault-seed", type=int, default=None, help="seed of --fault-error-ratio's draws (default: fresh)")
    add(
        "--fault-slowdown",
        type=float,
        default=1.0,
        help="multiplies every hardware time (prefill, decode steps, paced KV link): F times slower, healthy",
    )
    add(
        "--health-generation-delay",
        type=float,
        default=EngineSettings.health_generation_delay,
        help="seconds /health waits before it looks for the engine's answer (SGLang: 1; tests only lower it)",
    )
    add("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    for flag in _IGNORED_SGLANG_FLAGS:
        add(flag, action="store_true", help="accepted for SGLang compatibility; no effect")
    for option in _IGNORED_SGLANG_OPTIONS:
        add(option, default=None, help="accepted for SGLang compatibility; no effect")
    return parser


_NOT_SETTINGS = {"log_level", "enable_metrics", "trust_remote_code", "revision", "mem_fraction_static"}
_NOT_SETTINGS |= {"disaggregation_ib_device"}


def parse_args(argv: Sequence[str] | None = None) -> tuple[EngineSettings, argparse.Namespace, list[str]]:
    """Settings, the raw namespace, and the arguments nobody knows (to warn about)."""
    parser = build_arg_parser()
    namespace, unknown = parser.parse_known_args(argv)
    values = {k: v for k, v in vars(namespace).items() if k not in _NOT_SETTINGS}
    if values["startup_seconds"] is None:
        values["startup_seconds"] = SGLANG_WARMUP_SECONDS * values["time_scale"]
    try:
        values["health_check_timeout"] = health_check_timeout_from(os.environ)
        values["health_endpoint_generation"] = health_endpoint_generation_from(os.environ)
        values["kv_fingerprint"] = os.environ.get(KV_FINGERPRINT_ENV, "").strip()
        return EngineSettings(**values), namespace, unknown
    except ValueError as err:
        parser.error(str(err))
