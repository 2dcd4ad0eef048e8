#!/usr/bin/env bash
# Installs everything the project needs on a fresh machine, idempotently:
# the Python venv (.venv) with the project's four distributions editable (the product
# `prfaas` with its dev tools, the fake engine `prfaas-engine-sim` in engine-sim/, the testbed
# `prfaas-testbed` in e2e/, the simulator `prfaas-sim` in sim/), Debian's Prometheus, and the
# testbed binaries (Kubernetes, etcd, kwok, helm) built from the Go module proxy into a cache.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.prfaas-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ engine-sim/pyproject.toml -nt "$stamp" ] \
  || [ e2e/pyproject.toml -nt "$stamp" ] || [ sim/pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q -U pip
  .venv/bin/pip install -q -e '.[dev]' -e ./engine-sim -e ./e2e -e ./sim
  touch "$stamp"
fi
# SGLang itself, for the conformance suite (tests/conformance): its own venv, since .venv holds
# the testbed's sglang.launch_server shim; the pinned release without its GPU stack.
sglang_pin=tests/conformance/requirements-sglang.txt
if [ ! -f .venv-sglang/.prfaas-installed ] || [ "$sglang_pin" -nt .venv-sglang/.prfaas-installed ]; then
  [ -x .venv-sglang/bin/python ] || python3 -m venv .venv-sglang
  .venv-sglang/bin/pip install -q --no-deps "$(grep -E '^sglang==' "$sglang_pin")"
  grep -vE '^(sglang==|#|$)' "$sglang_pin" | .venv-sglang/bin/pip install -q -r /dev/stdin
  touch .venv-sglang/.prfaas-installed
fi
bash e2e/testbed/install-deps.sh
bash e2e/testbed/build-binaries.sh >/dev/null
bash scripts/build-tools.sh >/dev/null
