"""``python3 -m sglang.launch_server ARGS``: the fake SGLang engine, started as SGLang would be.

A drop-in for the SGLang image's command, so the engine pods the operator writes run
unchanged on CPU-only nodes (the prfaas-engine-sim image). ARGS are SGLang's launch_server
arguments (the fake engine accepts the ones the operator writes and ignores others with a
warning). What SGLang's arguments cannot say comes from the environment, as defaults that
explicit ARGS (e.g. a PrfaasDeployment's ``spec.model.extraArgs``) override:

* ``PRFAAS_FAKE_ENGINE_PROFILE``: the timing profile, ``h200``, ``h20`` or ``PATH.yaml[#hw]``
  (default: the fake engine's, ``h20``);
* ``PRFAAS_FAKE_ENGINE_TIME_SCALE``: multiplies every simulated time (default 1);
* ``PRFAAS_FAKE_ENGINE_KV_SCALE``: the fraction of the real KV bytes actually sent (default
  the fake engine's, 1e-3);
* ``PRFAAS_FAKE_ENGINE_MODEL_LOAD_SECONDS``: wall-clock seconds before the engine listens, as
  SGLang loads its weights before it serves (the image sets 30; real engines take minutes);
* ``PRFAAS_FAKE_ENGINE_ARGS``: more fake-engine arguments, split as a shell would
  (e.g. ``--link-rate-bytes-per-second 1.25e9``).

KV is advertised at ``SGLANG_HOST_IP`` when it is set (the operator sets it to the pod IP), as
SGLang does.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence

ENVIRONMENT_OPTIONS = {
    "PRFAAS_FAKE_ENGINE_PROFILE": "--profile",
    "PRFAAS_FAKE_ENGINE_TIME_SCALE": "--time-scale",
    "PRFAAS_FAKE_ENGINE_KV_SCALE": "--kv-scale",
    "PRFAAS_FAKE_ENGINE_MODEL_LOAD_SECONDS": "--model-load-seconds",
}
EXTRA_ARGS_VARIABLE = "PRFAAS_FAKE_ENGINE_ARGS"


def fake_engine_argv(args: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The fake engine's arguments: environment defaults first, so that ARGS win (argparse keeps the last)."""
    defaults: list[str] = []
    for variable, option in ENVIRONMENT_OPTIONS.items():
        value = environ.get(variable, "").strip()
        if value:
            defaults += [option, value]
    defaults += shlex.split(environ.get(EXTRA_ARGS_VARIABLE, ""))
    return [*defaults, *args]


def main(argv: Sequence[str] | None = None) -> None:
    from prfaas_engine_sim import cli

    args = sys.argv[1:] if argv is None else argv
    cli.main(fake_engine_argv(args, os.environ))


if __name__ == "__main__":
    main()
