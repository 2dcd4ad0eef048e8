"""Helpers of the e2e scenarios: traffic in a background thread, the link, the real node, kubectl, rollouts."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.kubectl import Kubectl

if TYPE_CHECKING:
    from prfaas_testbed.clusters import LinkNamespace, RealNode
    from prfaas_testbed.system import LiveSystem
    from prfaas_testbed.traffic import PlannedRequest, RequestResult, TrafficDriver

E2E_TIME_SCALE = 0.5
"""Engines compute in half the real time; request plans are scaled alike."""
WINDOW_SECONDS = 5.0
"""The window of served requests/s whose lowest a rollout scenario compares with before."""


class BackgroundTraffic:
    """A TrafficDriver on its own event loop in a thread, so a test can act while requests flow."""

    def __init__(
        self, url: str, model: str, plan: Sequence[PlannedRequest], *, timeout_s: float = 120
    ) -> None:
        from prfaas_testbed.traffic import TrafficDriver

        self.driver: TrafficDriver = TrafficDriver(url, model, request_timeout_seconds=timeout_s)
        self._plan = list(plan)
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="traffic", daemon=True)
        self._error: BaseException | None = None
        self.started_at = 0.0

    def _main(self) -> None:
        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await self.driver.run(self._plan, self._stop, settle_seconds=60)

        try:
            asyncio.run(run())
        except BaseException as err:  # surfaced in wait()
            self._error = err

    def __enter__(self) -> BackgroundTraffic:
        self.started_at = time.monotonic()
        self._thread.start()
        return self

    def wait(self, timeout_s: float = 180) -> TrafficDriver:
        """Until the plan is sent and its requests have finished (bounded)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.stop()
            self._thread.join(70)
            raise AssertionError(f"traffic did not finish within {timeout_s:.0f}s")
        if self._error is not None:
            raise self._error
        return self.driver

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self.stop()
            self._thread.join(90)


def logs_hint(system: LiveSystem) -> str:
    return f"(runner log {Path(system.work_dir) / 'runner.log'}, pod logs under {system.runner_dir / 'pods'})"


def link_counters(link: LinkNamespace) -> dict[str, Any]:
    """The KV direction's qdisc, as `tc -j -s` shows it: kind, options (rate in bytes/s), bytes sent."""
    shown = subprocess.run(
        ["tc", "-j", "-s", "-n", link.netns, "qdisc", "show", "dev", link.netns_device],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    (root,) = [qdisc for qdisc in json.loads(shown.stdout) if qdisc.get("root")]
    return dict(root)


def pd_kubectl(system: LiveSystem) -> Kubectl:
    """kubectl against the PD cluster, 30 s a run."""
    return Kubectl(system.testbed.pd_kubeconfig, timeout_s=30)


def container_pods(system: LiveSystem, kind: str, count: int) -> list[dict[str, Any]]:
    """The `count` pods of this kind the PD node's kubelet runs, as the runner reports them."""
    pods = [p for p in system.runner_pods(kind=kind) if p.get("state") == "container"]
    assert len(pods) == count, f"expected {count} {kind} container pods, got {pods}"
    return pods


def pd_real_node(system: LiveSystem) -> RealNode:
    """The PD cluster's kubelet node (the scenario is skipped where the machine cannot run containers)."""
    from prfaas_testbed.clusters import Cluster

    node = system.testbed.clusters[Cluster.PD].real_node
    if node is None:
        pytest.skip("this machine cannot run containers: the testbed runs every pod as a process")
    return node


def quick_planner(system: LiveSystem) -> dict[str, Any]:
    """The planner in Auto every 10 s over the last 60 s, no cooldown: what the rescaling
    scenarios patch in (with routing Auto, which needs it)."""
    assert system.prometheus is not None
    return {
        "mode": "Auto",
        "prometheusUrl": system.prometheus.url,
        "intervalSeconds": 10,
        "windowSeconds": 60,
        "cooldownSeconds": 0,
        "hysteresis": 0.05,
    }


def complete(router: str, prompt_words: int, word: str = "hello") -> dict[str, Any]:
    """One completion of `prompt_words` words through the router; its answer (a 200, asserted)."""
    body = {"model": "kimi-linear", "prompt": f"{word} " * prompt_words, "max_tokens": 4}
    request = urllib.request.Request(
        router + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.status == 200
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


def cr_status(system: LiveSystem) -> dict[str, Any]:
    """The CR's status (empty while it has none or the CR is gone)."""
    return (system.cr() or {}).get("status") or {}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    """The status condition of this type (empty when there is none)."""
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def rollout_over(status: dict[str, Any]) -> bool:
    """No rollout left and RolloutProgressing RevisionAvailable."""
    return (
        "rollout" not in status
        and condition(status, "RolloutProgressing").get("reason") == "RevisionAvailable"
    )


def patched(
    system: LiveSystem, spec: dict[str, Any], done: Callable[[dict[str, Any]], bool] = rollout_over
) -> Callable[[dict[str, Any]], bool]:
    """Patch the spec; a check on a status that it is of the patch's generation (or later) and
    `done` holds (by default: the rollout the patch starts is over)."""
    system.patch_spec(spec)
    generation = int(((system.cr() or {}).get("metadata") or {}).get("generation") or 0)

    def reached(status: dict[str, Any]) -> bool:
        return int(status.get("observedGeneration") or 0) >= generation and done(status)

    return reached


def status_of(router: str, prompt_words: int, word: str) -> tuple[int, str]:
    """The HTTP status of one completion through the router, and the body of an error."""
    try:
        complete(router, prompt_words, word)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")[:300]
    return 200, ""


def steady(seconds: float) -> list[PlannedRequest]:
    """Evenly spaced (not Poisson: a 5 s window then holds the same number of arrivals): four short
    prompts a second, prefilled locally, and a long one every 4 s, prefilled in the PrfaaS cluster."""
    from prfaas_testbed.traffic import PlannedRequest

    planned = [PlannedRequest(i * 0.25, "short", 800, 8, (20_000_000 + i,)) for i in range(int(seconds * 4))]
    planned += [
        PlannedRequest(
            i * 4.0 + 0.1, "long", 30_000, 8, tuple(range(30_000_000 + i * 100, 30_000_000 + i * 100 + 59))
        )
        for i in range(int(seconds / 4))
    ]
    return planned


def served_per_window(results: list[RequestResult], start: float, end: float) -> list[float]:
    """Requests answered in full per second, in each whole 5 s window of [start, end)."""
    done = [r.sent_at + (r.latency_seconds or 0) for r in results if r.outcome == "ok"]
    windows = int((end - start) // WINDOW_SECONDS)
    return [
        sum(1 for t in done if start + k * WINDOW_SECONDS <= t < start + (k + 1) * WINDOW_SECONDS)
        / WINDOW_SECONDS
        for k in range(windows)
    ]
