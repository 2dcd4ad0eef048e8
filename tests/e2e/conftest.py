"""Fixtures of the e2e scenarios: the whole system on the testbed, and traffic in the background.

One system per test module (Prometheus, the runner, both chart releases, the kubeconfig
Secret), in namespaces of its own so that it can share the testbed with other tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from prfaas_testbed.clusters import Testbed
    from prfaas_testbed.system import LiveSystem


@pytest.fixture(scope="module")
def live_system(
    testbed: Testbed, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LiveSystem]:
    """The system installed as a user would, in namespaces NAME and NAME-system.

    NAME is the test module's E2E_NAME (default prfaas-e2e): modules with different names can
    run on one testbed at the same time.
    """
    from live_traffic import E2E_TIME_SCALE
    from prfaas_testbed.pod_workloads import Scales
    from prfaas_testbed.system import Layout, LiveSystem

    name = getattr(request.module, "E2E_NAME", "prfaas-e2e")
    layout = Layout(
        deployment_namespace=name,
        system_namespace=f"{name}-system",
        operator_release=name,
        access_release=f"{name}-access",
        secret_name=f"{name}-kubeconfig",
        access_service_account=f"{name}-prefill-access",
    )
    work = tmp_path_factory.mktemp("e2e")
    system = LiveSystem(
        testbed,
        work,
        layout=layout,
        scales=Scales(time_scale=E2E_TIME_SCALE),
        # decodes here last seconds: a short drain keeps the scale-down scenarios quick
        operator_values=["--set", "extraArgs={--drain-seconds=8}"],
    )
    try:
        system.start()
        yield system
    finally:
        problems = system.stop()
        print(f"e2e system logs: {work}")
        assert not problems, f"tear-down problems: {problems}"
