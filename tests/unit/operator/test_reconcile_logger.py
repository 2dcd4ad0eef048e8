"""One logger for a reconcile pass, whichever room writes the line (prfaas_operator.RECONCILE_LOGGER)."""

from __future__ import annotations

from prfaas_operator import RECONCILE_LOGGER
from prfaas_operator.loops import children, prefill_cluster, reconcile
from prfaas_operator.planning import reconcile_pass


def test_the_executor_its_hands_and_the_pure_pass_log_under_one_name() -> None:
    assert RECONCILE_LOGGER == "prfaas_operator.loops.reconcile"
    names = {module.log.name for module in (reconcile, children, prefill_cluster, reconcile_pass)}
    assert names == {RECONCILE_LOGGER}
