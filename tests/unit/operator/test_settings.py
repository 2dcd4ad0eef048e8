"""The operator's settings make its command line: every field a flag, today's defaults, bad values refused."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from prfaas_core.flags import flag_of, to_flags
from prfaas_operator.__main__ import parse_args
from prfaas_operator.planning.lease import LeaseTiming
from prfaas_operator.planning.reconcile_pass import ReconcileOptions
from prfaas_operator.settings import OperatorSettings, parser

# what the Helm chart passes (charts/prfaas-operator/templates/deployment.yaml, leader election on)
CHART_ARGS = [
    "--namespace=prfaas-demo",
    "--liveness=http://0.0.0.0:8080/healthz",
    "--metrics-port=9090",
    "--log-level=info",
    "--leader-elect",
    "--leader-elect-lease=prfaas-prfaas-operator",
    "--leader-elect-lease-duration=10",
    "--leader-elect-renew-deadline=7",
    "--leader-elect-retry-period=2",
]


@pytest.fixture(autouse=True)
def no_pod_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)


def test_the_defaults_are_the_operators_own() -> None:
    settings = parse_args([])
    reconcile, timing = ReconcileOptions(), LeaseTiming()
    assert dataclasses.asdict(settings) == {
        "namespaces": (),
        "all_namespaces": False,
        "bind_address": "0.0.0.0",
        "liveness_port": 8080,
        "liveness": None,
        "metrics_port": 9090,
        "resync_seconds": 10.0,
        "remote_backoff_max_seconds": 30.0,
        "remote_cleanup_timeout_seconds": 300.0,
        "drain_seconds": 30.0,
        "pool_controller": False,
        "leader_elect": False,
        "leader_elect_lease": "prfaas-operator",
        "leader_elect_namespace": None,
        "leader_elect_lease_duration": 10.0,
        "leader_elect_renew_deadline": 7.0,
        "leader_elect_retry_period": 2.0,
        "verbose": False,
        "log_level": "info",
    }
    assert settings == OperatorSettings()
    assert settings.reconcile_options() == reconcile
    assert settings.lease_timing == timing
    assert settings.clusterwide and settings.liveness_url == "http://0.0.0.0:8080/healthz"


def test_every_field_is_a_flag_named_after_it() -> None:
    flags = {option for action in parser()._actions for option in action.option_strings} - {"-h", "--help"}
    fields = dataclasses.fields(OperatorSettings)
    assert flags == {flag_of(item) for item in fields} | {"-n", "-A", "-v"}
    renamed = {
        item.name: flag_of(item) for item in fields if flag_of(item) != "--" + item.name.replace("_", "-")
    }
    assert renamed == {"namespaces": "--namespace"}


@pytest.mark.parametrize(
    ("args", "field", "value"),
    [
        (["--namespace", "a"], "namespaces", ("a",)),
        (["-n", "a", "--namespace=team-*"], "namespaces", ("a", "team-*")),
        (["--all-namespaces"], "all_namespaces", True),
        (["-A"], "all_namespaces", True),
        (["--bind-address", "127.0.0.1"], "bind_address", "127.0.0.1"),
        (["--liveness-port", "8181"], "liveness_port", 8181),
        (["--liveness", "http://0.0.0.0:1/healthz"], "liveness", "http://0.0.0.0:1/healthz"),
        (["--metrics-port", "9191"], "metrics_port", 9191),
        (["--resync-seconds", "2"], "resync_seconds", 2.0),
        (["--remote-backoff-max-seconds", "4"], "remote_backoff_max_seconds", 4.0),
        (["--remote-cleanup-timeout-seconds", "10"], "remote_cleanup_timeout_seconds", 10.0),
        (["--drain-seconds=8"], "drain_seconds", 8.0),
        (["--pool-controller"], "pool_controller", True),
        (["--leader-elect", "--leader-elect-namespace", "ns"], "leader_elect", True),
        (["--leader-elect-lease", "l"], "leader_elect_lease", "l"),
        (["--leader-elect-namespace", "ns"], "leader_elect_namespace", "ns"),
        (["--leader-elect-lease-duration", "20"], "leader_elect_lease_duration", 20.0),
        (["--leader-elect-renew-deadline", "5"], "leader_elect_renew_deadline", 5.0),
        (["--leader-elect-retry-period", "1"], "leader_elect_retry_period", 1.0),
        (["--verbose"], "verbose", True),
        (["-v"], "verbose", True),
        (["--log-level", "debug"], "log_level", "debug"),
    ],
)
def test_each_flag_parses_to_its_field(args: list[str], field: str, value: object) -> None:
    settings = parse_args(args)
    assert getattr(settings, field) == value
    changed = {
        k for k, v in dataclasses.asdict(settings).items() if v != dataclasses.asdict(OperatorSettings())[k]
    }
    assert changed == {field} | ({"leader_elect_namespace"} if "--leader-elect-namespace" in args else set())


def test_the_charts_args_give_the_settings_it_means(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "prfaas-system")  # the chart sets it from the pod's namespace
    settings = parse_args(CHART_ARGS)
    assert settings == OperatorSettings(
        namespaces=("prfaas-demo",),
        liveness="http://0.0.0.0:8080/healthz",
        leader_elect=True,
        leader_elect_lease="prfaas-prfaas-operator",
        leader_elect_namespace="prfaas-system",
    )
    assert not settings.clusterwide and settings.liveness_url == "http://0.0.0.0:8080/healthz"
    assert settings.reconcile_options().watch_namespaces == ("prfaas-demo",)
    assert parse_args(["--leader-elect-namespace", "other"]).leader_elect_namespace == "other"


def test_settings_written_as_flags_parse_back_to_themselves() -> None:
    settings = OperatorSettings(
        namespaces=("a", "b"), metrics_port=9191, leader_elect=True, leader_elect_namespace="ns", verbose=True
    )
    flags = to_flags(settings)
    assert flags == [
        "--namespace",
        "a",
        "--namespace",
        "b",
        "--metrics-port",
        "9191",
        "--leader-elect",
        "--leader-elect-namespace",
        "ns",
        "--verbose",
    ]
    assert parse_args(flags) == settings


def test_the_parser_is_the_one_the_help_shows() -> None:
    help_text = parser("desc").format_help()
    assert "[--namespace NS | --all-namespaces]" in help_text
    assert "--namespace NS, -n NS" in help_text and "--all-namespaces, -A" in help_text
    assert "leader election:\n  several replicas, one reconciling" in help_text
    assert "--leader-elect-lease-duration S" in help_text and "{debug,info,warning,error}" in help_text
    assert isinstance(parser(), argparse.ArgumentParser)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--metrics-port", "x"], "argument --metrics-port: invalid int value: 'x'"),
        (["--resync-seconds", "soon"], "argument --resync-seconds: invalid float value: 'soon'"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["-n", "a", "-A"], "argument --all-namespaces/-A: not allowed with argument --namespace/-n"),
        (["--leader-elect"], "--leader-elect needs --leader-elect-namespace or $POD_NAMESPACE"),
        (
            ["--leader-elect", "--leader-elect-namespace", "ns", "--leader-elect-retry-period", "9"],
            "leader election needs lease duration > renew deadline > retry period > 0, got 10 > 7 > 9",
        ),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_value_the_operator_cannot_run_with_is_a_usage_error(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_lease_timing_is_checked_only_with_leader_election() -> None:
    # as before: the Lease's flags are read only by --leader-elect
    assert parse_args(["--leader-elect-retry-period", "9"]).leader_elect_retry_period == 9.0
    with pytest.raises(ValueError, match="--namespace and --all-namespaces exclude each other"):
        OperatorSettings(namespaces=("a",), all_namespaces=True)
    with pytest.raises(ValueError, match="--log-level must be one of debug, info, warning, error"):
        OperatorSettings(log_level="INFO")
