"""Scale-down with a drain (operator/prfaas_operator/planning/drain.py): pure steps, time passed in."""

from __future__ import annotations

from prfaas_operator.planning.drain import (
    Drain,
    after_config_written,
    draining,
    finished,
    live_replicas,
    plan,
    pod_ordinal,
    release_due,
    replicas_to_apply,
    seconds_left,
)

DRAIN_SECONDS = 10.0


def test_a_scale_down_holds_the_replicas_until_the_config_has_been_in_force_for_the_drain_time() -> None:
    started = plan(None, "x-decode", desired=1, live=3)
    assert started == Drain("x-decode", target=1, held=3)
    assert replicas_to_apply(started, 1) == 3  # nothing is removed yet
    assert [draining(started, f"x-decode-{n}") for n in range(3)] == [False, True, True]
    # a config that still lists a leaving pod does not start the clock
    assert after_config_written(started, ["x-decode-0", "x-decode-2"], now=100.0).since is None
    clocked = after_config_written(started, ["x-decode-0", "x-prefill-5"], now=100.0)
    assert clocked.since == 100.0
    assert not release_due(clocked, 109.9, DRAIN_SECONDS)
    assert seconds_left(clocked, 104.0, DRAIN_SECONDS) == 6.0
    assert release_due(clocked, 110.0, DRAIN_SECONDS)


def test_a_released_drain_applies_the_target_and_lasts_until_its_pods_are_gone() -> None:
    released = Drain("x-decode", target=1, held=3, since=100.0, released=True)
    assert replicas_to_apply(released, 1) == 1
    # the cache may still show the old count right after the apply: no new drain starts
    assert plan(released, "x-decode", desired=1, live=3) is released
    assert plan(released, "x-decode", desired=1, live=1) is released
    assert not finished(released, 1, ["x-decode-0", "x-decode-2"])
    assert finished(released, 1, ["x-decode-0"])
    assert seconds_left(released, 200.0, DRAIN_SECONDS) is None


def test_a_new_target_replaces_the_drain_and_a_scale_up_cancels_it() -> None:
    clocked = Drain("x-decode", target=2, held=3, since=50.0)
    assert plan(clocked, "x-decode", desired=2, live=3) is clocked  # same target: the clock keeps running
    assert plan(clocked, "x-decode", desired=1, live=3) == Drain(
        "x-decode", target=1, held=3
    )  # lower: more pods leave, restart
    assert plan(clocked, "x-decode", desired=3, live=3) is None  # back up: nothing leaves
    assert plan(None, "x-decode", desired=4, live=3) is None
    assert plan(None, "x-decode", desired=0, live=None) is None  # no StatefulSet yet
    assert replicas_to_apply(None, 4) == 4


def test_names_and_live_counts() -> None:
    assert pod_ordinal("kimi-linear-pd-decode", "kimi-linear-pd-decode-12") == 12
    assert pod_ordinal("kimi-linear-pd-decode", "kimi-linear-pd-prefill-12") is None
    assert pod_ordinal("kimi-linear-router", "kimi-linear-router-5bd9f8bd86-jzpjt") is None
    assert not draining(None, "x-decode-9")
    assert not draining(Drain("x-decode", target=0, held=1), "x-prefill-0")
    assert live_replicas(None) is None
    assert live_replicas({"spec": {"replicas": 0}}) == 0
    assert live_replicas({"spec": {}}) == 1  # the API's default
