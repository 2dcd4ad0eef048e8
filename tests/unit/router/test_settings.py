"""The router's settings make its command line: every field a flag, the operator's args parse back."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
from prfaas_router.__main__ import parse_args
from prfaas_router.settings import RouterSettings, add_flags, flag_of, to_flags
from support.sample_cr import SAMPLE_ROUTER_ARGS

# what the operator writes into the router Deployment's args, with a tokenizer mounted
OPERATOR_ARGS = [*SAMPLE_ROUTER_ARGS, "--tokenizer", "/etc/prfaas-tokenizer/kimi/tokenizer.json"]


def test_every_field_is_a_flag_named_after_it() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, RouterSettings)
    flags = {option for action in parser._actions for option in action.option_strings} - {"-h", "--help"}
    fields = dataclasses.fields(RouterSettings)
    assert flags == {flag_of(item) for item in fields}
    renamed = {
        item.name: flag_of(item) for item in fields if flag_of(item) != "--" + item.name.replace("_", "-")
    }
    assert renamed == {"config_path": "--config", "tokenizer_path": "--tokenizer"}


def test_the_operators_args_give_the_settings_it_means() -> None:
    settings = parse_args(OPERATOR_ARGS)
    assert settings == RouterSettings(
        config_path=Path("/etc/prfaas/router-config.json"),
        config_map="prfaas-demo/kimi-linear-router-config",
        host="0.0.0.0",
        port=8000,
        shutdown_delay_seconds=5.0,
        drain_timeout_seconds=133.0,
        tokenizer_path=Path("/etc/prfaas-tokenizer/kimi/tokenizer.json"),
    )
    ref = settings.config_map_ref
    assert ref is not None and (ref.namespace, ref.name, ref.key) == (
        "prfaas-demo",
        "kimi-linear-router-config",
        "router-config.json",
    )


def test_settings_written_as_flags_parse_back_to_themselves() -> None:
    settings = RouterSettings(
        config_path=Path("/c.json"), port=9000, max_n=4, link_floor_fraction=0.2, log_level="WARNING"
    )
    flags = to_flags(settings)
    assert flags == [
        "--config",
        "/c.json",
        "--port",
        "9000",
        "--link-floor-fraction",
        "0.2",
        "--max-n",
        "4",
        "--log-level",
        "WARNING",
    ]
    assert parse_args(flags) == settings
    assert settings.limits.max_n == 4 and settings.link_estimate.floor_fraction == 0.2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-n", "0"], "--max-n must be at least 1, got 0"),
        (["--config-map", "only-a-name"], "--config-map takes NAMESPACE/NAME"),
        (["--drain-timeout-seconds", "0"], "--drain-timeout-seconds above 0"),
        (["--link-floor-fraction", "2"], "link estimate: floor_fraction must be in (0, 1]"),
        (["--picker-tls-dir", "/tls", "--picker-tls-self-signed"], "one TLS certificate, not both"),
        (["--picker-pd-mode", "router"], "invalid choice: 'router'"),
    ],
)
def test_settings_the_router_cannot_run_with_are_a_usage_error(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--config", "/c.json", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
