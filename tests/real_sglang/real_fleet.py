"""Real SGLang 0.5.23 on CPU behind the real router: the fleet of this tier.

One fleet for the whole folder: a PrfaaS prefill (127.0.1.1), a local prefill (127.0.2.1) and a
decode (127.0.2.11), each started from the command, args and env the operator writes for its
role (prfaas_testbed.sglang_cpu: the sample CR with the tiny model and the CPU workarounds in
extraArgs, translated by the testbed's kubelet), a plain server (127.0.3.1, the decode's command
line with `--disaggregation-mode null`) whose greedy answers are the reference, and the router
with the config the operator would write for those pods. The differential test starts the same
pods with the fake engine (prfaas_engine_sim, real time, every KV byte) on other addresses. Four servers take about 2 minutes to
start together on 2 cores and about 2 GiB each (PSS). Mooncake advertises each engine's
SGLANG_HOST_IP (its pod IP here): loopback only.

The fault tests (test_real_faults.py) kill engines, so they run last (conftest.py orders them).
The fixtures that use these live in conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prfaas_core.router_config import RouterConfig
from prfaas_core.vocabulary import ROUTE_LOCAL, ROUTE_PRFAAS, Role
from prfaas_router.settings import RouterSettings, to_flags
from prfaas_testbed import sglang_cpu
from prfaas_testbed.polling import eventually
from prfaas_testbed.ports import free_port
from router_harness import Engine, Process, Router, http_get

REPO = Path(__file__).resolve().parents[2]
ADDRESSES = {Role.PRFAAS_PREFILL: "127.0.1.1", Role.PD_PREFILL: "127.0.2.1", Role.PD_DECODE: "127.0.2.11"}
PLAIN_ADDRESS = "127.0.3.1"
FAKE_ADDRESSES = {
    Role.PRFAAS_PREFILL: "127.0.11.1",
    Role.PD_PREFILL: "127.0.12.1",
    Role.PD_DECODE: "127.0.12.11",
}
SGLANG_BOOTSTRAP_PORT = 8998
"""SGLang's default --disaggregation-bootstrap-port, the one the operator's engines keep."""
START_SECONDS = 420.0
"""Four servers starting together: 40-65 s alone, about 2 minutes together on 2 cores."""


@dataclass
class Fleet:
    cr: dict[str, Any]
    addresses: dict[Role, str]
    engines: dict[Role, Engine]
    plain: Engine | None
    router: Router
    logs: Path
    startup: dict[str, list[str]]
    """Each server's /ready answers from its start until ready, repeats collapsed:
    "refused", then status codes ("503", "200")."""

    def engine(self, role: Role) -> Engine:
        return self.engines[role]

    @property
    def reference(self) -> Engine:
        """The plain server (real fleets only)."""
        assert self.plain is not None, "a fake fleet has no plain server"
        return self.plain


CACHE_ADDRESSES = {
    Role.PRFAAS_PREFILL: ("127.0.21.1",),
    Role.PD_PREFILL: ("127.0.22.1", "127.0.22.2"),
    Role.PD_DECODE: ("127.0.22.11",),
}
"""The cache fleet's engines: two local prefills share the PD cluster's cache pool."""
POOL_MASTER, POOL_STORES = "127.0.22.21", ("127.0.22.22",)


def cache_cr(sample: dict[str, Any]) -> dict[str, Any]:
    """The tiny CR with two local prefills, a cache pool in the PD cluster (one store of 256 MiB)
    and the decode radix cache."""
    cr = sglang_cpu.cpu_cr(sample, name="cached")
    spec = cr["spec"]
    spec["pdCluster"].update(instances=3, prefillInstances=2, minPrefillInstances=2)
    spec["pdCluster"]["cachePool"] = {"storeReplicas": len(POOL_STORES), "segmentSize": "256Mi"}
    spec["prefixCache"] = {"decodeRadixCache": True}
    # a storage prefetch waits until it is done: SGLang's default policy gives up after 1 s +
    # 0.25 s per 1K tokens and computes instead, which a loaded 2-core machine can miss
    spec["model"]["extraArgs"] += ["--hicache-storage-prefetch-policy", "wait_complete"]
    return cr


@dataclass
class CacheFleet:
    cr: dict[str, Any]
    prefills: dict[str, list[Engine]]
    """By route: the PrfaaS prefill, the two local ones."""
    decode: Engine
    pool: list[Process]
    router: Router
    first_config: RouterConfig
    """The config the operator writes for these pods: every engine listed."""
    config: RouterConfig
    """The one the router runs now (`write_config`)."""
    logs: Path

    def write_config(self, config: RouterConfig) -> None:
        """A new router config (the router reloads it), as the operator writes one when pods change."""
        self.config = config
        tmp = self.router.config_path.with_suffix(".tmp")
        tmp.write_text(config.to_json())
        tmp.replace(self.router.config_path)


@contextlib.contextmanager
def running_cache_fleet(logs: Path) -> Iterator[CacheFleet]:
    """Real SGLang with the PD cluster's cache pool (real mooncake_master and mooncake_client from
    the operator's pool pods) and the decode radix cache, behind the router, until the block ends."""
    logs.mkdir(parents=True, exist_ok=True)
    cr = cache_cr(yaml.safe_load((REPO / "examples" / "prfaasdeployment.yaml").read_text()))
    (logs / "cr.json").write_text(json.dumps(cr, indent=2))
    pool = sglang_cpu.pool_processes(cr, ROUTE_LOCAL, POOL_MASTER, POOL_STORES)
    started: list[Process] = []
    engines: list[Engine] = []
    router = None
    try:
        for name, local in (
            ("kv-master", pool.master),
            *((f"kv-store-{i}", p) for i, p in enumerate(pool.stores)),
        ):
            process = Process(
                list(local.argv[1:]),
                logs / f"{name}.log",
                env=dict(local.env),
                program=local.argv[0],
                inherit_env=False,
                own_group=True,
            )
            started.append(process.start())
            if local is pool.master:
                eventually(
                    lambda: _answers(pool.cache_pool.health_url),
                    timeout=60,
                    interval=0.05,
                    what=f"{name}\n{process.log()}",
                )
        processes = sglang_cpu.instance_processes(cr, CACHE_ADDRESSES, services=pool.services)
        named: dict[Role, list[Engine]] = {}
        for role, instances in processes.items():
            for index, p in enumerate(instances):
                engine = _engine(
                    f"{role.value}-{index}",
                    p.argv,
                    dict(p.env),
                    f"http://{CACHE_ADDRESSES[role][index]}:{p.metrics_port}",
                    logs,
                )
                engines.append(engine)
                named.setdefault(role, []).append(engine)
        wait_ready(engines, START_SECONDS)
        config = sglang_cpu.router_config(cr, CACHE_ADDRESSES, {ROUTE_LOCAL: pool.cache_pool})
        router = start_router(cr, CACHE_ADDRESSES, logs, config)
        yield CacheFleet(
            cr,
            {ROUTE_PRFAAS: named[Role.PRFAAS_PREFILL], ROUTE_LOCAL: named[Role.PD_PREFILL]},
            named[Role.PD_DECODE][0],
            started,
            router,
            config,
            config,
            logs,
        )
    finally:
        stop(router, [*(engine.process for engine in engines), *started])


def stop(router: Router | None, processes: Sequence[Process]) -> None:
    """The router first (no request reaches a stopping engine), then every process, each whatever
    the others did."""
    if router is not None:
        router.process.stop()
    for process in processes:
        with contextlib.suppress(Exception):
            process.stop()


def _answers(url: str) -> bool:
    """The master's /health answers 200 (it serves)."""
    try:
        return http_get(url, "/health")[0] == 200
    except OSError:
        return False


def pd_body(body: dict[str, Any], host: str, port: int = SGLANG_BOOTSTRAP_PORT) -> dict[str, Any]:
    """`body` with SGLang's PD fields: both legs carry it, the prefill at `host`, a fresh room."""
    return {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": random.getrandbits(63)}


def _engine(name: str, argv: tuple[str, ...], env: dict[str, str], url: str, logs: Path) -> Engine:
    process = Process(
        list(argv[1:]), logs / f"{name}.log", env=env, program=argv[0], inherit_env=False, own_group=True
    )
    return Engine(name, url, None, process.start())


def _start_engines(
    cr: dict[str, Any], addresses: dict[Role, str], logs: Path, *, fake: bool
) -> tuple[dict[Role, Engine], Engine | None]:
    processes = sglang_cpu.engine_processes(cr, addresses, fake_python=sys.executable if fake else None)
    engines = {
        role: _engine(role.value, p.argv, dict(p.env), f"http://{addresses[role]}:{p.metrics_port}", logs)
        for role, p in processes.items()
    }
    if fake:
        return engines, None
    decode = processes[Role.PD_DECODE]
    plain_argv = tuple(a.replace(addresses[Role.PD_DECODE], PLAIN_ADDRESS) for a in decode.argv)
    plain_env = {k: v.replace(addresses[Role.PD_DECODE], PLAIN_ADDRESS) for k, v in decode.env.items()}
    plain = _engine(
        "plain",
        (*plain_argv, "--disaggregation-mode", "null"),
        plain_env,
        f"http://{PLAIN_ADDRESS}:{decode.metrics_port}",
        logs,
    )
    return engines, plain


def _ready_state(url: str) -> str | None:
    """Its /ready status, "refused", or None: no answer in time (a loaded machine), ask again."""
    try:
        return str(http_get(url, "/ready", timeout=2.0)[0])
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return None


def wait_ready(engines: list[Engine], seconds: float) -> dict[str, list[str]]:
    """Until every engine's /ready answers 200, polling all of them together; what each said."""
    states: dict[str, list[str]] = {engine.name: [] for engine in engines}

    def all_ready() -> bool:
        for engine in engines:
            assert engine.process.popen is not None and engine.process.popen.poll() is None, (
                f"{engine.name} exited\n{engine.process.log()}"
            )
            seen = states[engine.name]
            if seen[-1:] != ["200"]:
                state = _ready_state(engine.url)
                if state is not None and seen[-1:] != [state]:
                    seen.append(state)
        return all(seen[-1:] == ["200"] for seen in states.values())

    eventually(
        all_ready,
        timeout=seconds,
        interval=0.1,
        retry_on=(),
        what="every engine's /ready to answer 200",
        seen=lambda: states,
    )
    return states


def start_router(
    cr: dict[str, Any],
    addresses: Mapping[Role, str | Sequence[str]],
    logs: Path,
    config: RouterConfig | None = None,
) -> Router:
    """The router with `config`, or the one the operator writes for these pods."""
    config_path = logs / "router-config.json"
    config_path.write_text((config or sglang_cpu.router_config(cr, addresses)).to_json())
    port = free_port("127.0.0.1")
    settings = RouterSettings(
        config_path=config_path,
        host="127.0.0.1",
        port=port,
        config_poll_seconds=0.2,
        # four CPU engines share 2 cores here: their /ready took over a second while the machine
        # was busy (observed), which the default 1 s timeout counts against them
        health_timeout_seconds=3.0,
        tokenizer_path=sglang_cpu.MODEL_DIR / "tokenizer.json",
    )
    router = Router(
        f"http://127.0.0.1:{port}",
        config_path,
        Process(["-m", "prfaas_router", *to_flags(settings)], logs / "router.log"),
    )
    router.process.start()
    eventually(
        lambda: http_get(router.url, "/readiness")[0] == 200,
        timeout=120,
        interval=0.05,
        what=f"router\n{router.process.log()}",
    )
    return router


@contextlib.contextmanager
def running_fleet(logs: Path, *, fake: bool = False) -> Iterator[Fleet]:
    """The fleet (real SGLang, or the fake engine), once every server is ready and the router is
    up, until the block ends."""
    logs.mkdir(parents=True, exist_ok=True)
    sample = yaml.safe_load((REPO / "examples" / "prfaasdeployment.yaml").read_text())
    cr = sglang_cpu.cpu_cr(sample)
    (logs / "cr.json").write_text(json.dumps(cr, indent=2))
    addresses = FAKE_ADDRESSES if fake else ADDRESSES
    engines, plain = _start_engines(cr, addresses, logs, fake=fake)
    everyone = [*engines.values(), *([plain] if plain else [])]
    router = None
    try:
        startup = wait_ready(everyone, START_SECONDS)
        router = start_router(cr, addresses, logs)
        yield Fleet(cr, addresses, engines, plain, router, logs, startup)
    finally:
        stop(router, [engine.process for engine in everyone])
