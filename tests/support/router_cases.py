"""Router configs and workers for the router's unit tests."""

from __future__ import annotations

from typing import Any

from prfaas_core.router_config import Endpoint, RouterConfig
from prfaas_core.routing.policy import PolicyModel
from prfaas_core.routing.workers import AvailableWorkers, CircuitBreaker, Worker
from prfaas_core.vocabulary import Pool

# the case study's curves (data/profiles/case-study.yaml) fitted with PrefillTimeModel.fit, rounded
H200 = {"c0": 0.389, "c1": 4.107e-5, "c2": 9.476e-11}
H20 = {"c0": 0.570, "c1": 1.170e-4, "c2": 6.347e-10}


def config_doc(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema": "prfaas.io/router-config/v1",
        "version": 1,
        "served_model_name": "kimi-linear",
        "threshold_tokens": 8192,
        "block_size_tokens": 512,
        "bandwidth_mode": "Scarce",
        "chars_per_token": 4.0,
        "link": {"bandwidth_bytes_per_second": 12.5e9, "headroom": 0.8, "latency_seconds": 0.002},
        "kv_size": {"bytes_per_token": 17000.0, "fixed_bytes": 1.8e8},
        "prefill_time": {"prfaas": H200, "local": H20},
        "slo": {"ttft_seconds": 30.0, "tpot_seconds": 0.05},
        "pools": {
            "prfaas_prefill": [
                {"name": "p0", "url": "http://127.0.1.1:30000", "bootstrap_port": 8998},
                {"name": "p1", "url": "http://127.0.1.2:30000", "bootstrap_port": 8998},
            ],
            "local_prefill": [
                {"name": "l0", "url": "http://127.0.2.1:30000", "bootstrap_port": 8998},
                {"name": "l1", "url": "http://127.0.2.2:30000", "bootstrap_port": 8998},
            ],
            "decode": [
                {"name": "d0", "url": "http://127.0.2.11:30000"},
                {"name": "d1", "url": "http://127.0.2.12:30000"},
            ],
        },
    }
    doc.update(overrides)
    return doc


def make_config(**overrides: Any) -> RouterConfig:
    return RouterConfig.model_validate(config_doc(**overrides))


def make_model(**overrides: Any) -> PolicyModel:
    return PolicyModel.from_config(make_config(**overrides))


def pools(local: int = 2, prfaas: int = 2, decode: int = 2) -> tuple[AvailableWorkers, dict[str, Worker]]:
    """Healthy workers l0.., p0.., d0..; the dict finds them by name."""
    by_name: dict[str, Worker] = {}
    made: dict[Pool, list[Worker]] = {}
    for pool, prefix, count in (
        (Pool.LOCAL_PREFILL, "l", local),
        (Pool.PRFAAS_PREFILL, "p", prfaas),
        (Pool.DECODE, "d", decode),
    ):
        made[pool] = []
        for i in range(count):
            w = Worker(
                pool,
                Endpoint(
                    name=f"{prefix}{i}",
                    url=f"http://127.0.0.{i + 1}:3000{i}",
                    bootstrap_port=None if pool is Pool.DECODE else 8998,
                ),
                CircuitBreaker(3, 5.0),
            )
            w.healthy = True
            made[pool].append(w)
            by_name[w.name] = w
    return AvailableWorkers(
        made[Pool.LOCAL_PREFILL], made[Pool.PRFAAS_PREFILL], made[Pool.DECODE], now=0.0
    ), by_name
