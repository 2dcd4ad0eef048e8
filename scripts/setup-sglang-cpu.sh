#!/usr/bin/env bash
# Installs real SGLang for CPU (tests/real_sglang, `scripts/demo.sh --engines sglang`), idempotently:
# a venv outside the checkout (about 6 GB; PRFAAS_SGLANG_CPU_VENV, default ~/.cache/prfaas/sglang-cpu)
# from locks/sglang-cpu.txt (torch, Mooncake's non-CUDA transfer engine, sglang --no-deps, all hashed),
# the CPU workarounds of testbed/sglang-cpu/prfaas_sglang_cpu copied in with a .pth file that installs
# them in every interpreter there, and the tiny model built in it (models/tiny-gpt2). Redone when
# the lock (the venv, from scratch) or the package (the copy and the model) changes. Checks at the
# end that every workaround still holds against the installed SGLang (python -m prfaas_sglang_cpu check).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PRFAAS_SGLANG_CPU_VENV:-$HOME/.cache/prfaas/sglang-cpu}
lock=locks/sglang-cpu.txt
pin=$(grep -E '^sglang==' tests/conformance/requirements-sglang.txt)
grep -qxF "$pin \\" "$lock" || {
  echo "setup-sglang-cpu: $lock does not hold $pin (the conformance pin): run scripts/lock.sh --sglang-cpu" >&2
  exit 1
}
lock_inputs=$(grep -v '^ *#' "$lock" | sha256sum)  # its pins and hashes: a comment changes nothing
if [ "$(cat "$venv/.prfaas-lock" 2>/dev/null)" != "$lock_inputs" ]; then
  echo "[setup-sglang-cpu] installing $lock into $venv (first time: about 6 GB, minutes)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --require-hashes --no-deps -r locks/build.txt
  "$venv/bin/python" -m pip install -q --require-hashes --no-deps --no-compile -r "$lock"
  echo "$lock_inputs" >"$venv/.prfaas-lock"
fi
package=testbed/sglang-cpu/prfaas_sglang_cpu
package_inputs=$(cat "$package"/*.py | sha256sum)
if [ "$(cat "$venv/.prfaas-package" 2>/dev/null)" != "$package_inputs" ]; then
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf "$site/prfaas_sglang_cpu" "$venv/models"
  cp -r "$package" "$site/prfaas_sglang_cpu"
  echo 'import prfaas_sglang_cpu.workarounds as w; w.install()' >"$site/prfaas_sglang_cpu.pth"
  "$venv/bin/python" -m prfaas_sglang_cpu.tiny_model "$venv/models/tiny-gpt2"
  echo "$package_inputs" >"$venv/.prfaas-package"
fi
"$venv/bin/python" -m prfaas_sglang_cpu check >&2
