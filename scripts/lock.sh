#!/usr/bin/env bash
# Makes the lock files in locks/ from the pyproject files: every Python distribution at one exact
# version with the sha256 of each of its wheels, so that the images and .venv install the same
# bytes every time (pip --require-hashes), whatever PyPI publishes later.
#   locks/product.txt  the product's dependencies (pyproject.toml): what both images install
#   locks/dev.txt      .venv's (.[dev], engine-sim/, testbed/, sim/): the product's pins, plus the rest
#   locks/build.txt    pip and the four distributions' build backend (setuptools, wheel)
#   locks/sglang-cpu.txt  real SGLang on CPU (scripts/setup-sglang-cpu.sh): testbed/sglang-cpu/requirements.in
#                      and, without its dependencies, the sglang of tests/conformance/requirements-sglang.txt
#                      (x86_64 only, glibc 2.34 or newer as the sglang wheel is; --sglang-cpu: only this one)
# Resolved for CPython 3.11 on Linux x86_64 (glibc 2.28 or newer), wheels only, then checked to
# resolve to the same pins on Linux aarch64 (the release's linux/arm64 images). A pin stays as it
# is while the pyproject files allow it; tests/unit/project/test_lock.py fails when they no longer do.
# Usage: scripts/lock.sh                       # after a pyproject change: keep what still fits
#        scripts/lock.sh --upgrade             # every distribution to its newest allowed release
#        scripts/lock.sh --upgrade-package NAME
# Needs PyPI; uv (pinned) runs from a throwaway venv.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.8
X86=x86_64-manylinux_2_28
ARM=aarch64-manylinux_2_28
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools"
"$tools/bin/pip" install -q "uv==$UV_VERSION"
uv=$tools/bin/uv
mkdir -p locks

# compile PLATFORM INPUT OUTPUT [uv options...]: INPUT is a requirements file, or - for stdin.
compile() {
  local platform=$1 input=$2 output=$3
  shift 3
  "$uv" pip compile --quiet --only-binary :all: --python-version 3.11 --python-platform "$platform" \
    --custom-compile-command scripts/lock.sh "$@" "$input" -o "$output"
}
# lock NAME INPUT [uv options...]: locks/NAME.txt for x86_64, and the same pins for aarch64.
# INPUT is a pyproject.toml, or - for requirements on stdin.
lock() {
  local name=$1 input=$2
  shift 2
  local stdin=
  [ "$input" != - ] || stdin=$(cat)
  compile "$X86" "$input" "locks/$name.txt" --generate-hashes "$@" "${UPGRADE[@]}" <<<"$stdin"
  compile "$ARM" "$input" "$tools/$name.aarch64.txt" --no-header --no-annotate -c "locks/$name.txt" "$@" <<<"$stdin"
  if ! diff <(sed -nE 's/^([a-z0-9][^ ]*==[^ ]*).*/\1/p' "locks/$name.txt") "$tools/$name.aarch64.txt" >&2; then
    echo "lock: locks/$name.txt resolves differently on aarch64 (above: < x86_64, > aarch64)" >&2
    exit 1
  fi
  echo "locks/$name.txt: $(grep -cE '^[a-z0-9]' "locks/$name.txt") distributions" >&2
}
# locks/sglang-cpu.txt: the real engine's venv; sglang's own GPU requirements are left out by
# installing it --no-deps, so it is locked apart from what requirements.in lists.
lock_sglang_cpu() {
  local platform=x86_64-manylinux_2_34 pin
  pin=$(grep -E '^sglang==' tests/conformance/requirements-sglang.txt)
  compile "$platform" testbed/sglang-cpu/requirements.in "$tools/sglang-deps.txt" --generate-hashes "${UPGRADE[@]}"
  echo "$pin" | compile "$platform" - "$tools/sglang.txt" --generate-hashes --no-deps --no-header
  cat "$tools/sglang-deps.txt" "$tools/sglang.txt" >locks/sglang-cpu.txt
  echo "locks/sglang-cpu.txt: $(grep -cE '^[a-z0-9]' locks/sglang-cpu.txt) distributions" >&2
}
if [ "${1:-}" = --sglang-cpu ]; then
  UPGRADE=()
  lock_sglang_cpu
  exit 0
fi
UPGRADE=("$@")
LOCAL=(prfaas prfaas-engine-sim prfaas-testbed prfaas-sim)  # ours: installed from the checkout, --no-deps

lock product pyproject.toml
printf -- '-e %s\n' '.[dev]' ./engine-sim ./testbed ./sim \
  | lock dev - -c locks/product.txt "${LOCAL[@]/#/--no-emit-package=}"
# The build backend every pyproject names, and pip itself (the installer, not a dependency).
{
  python3 -c 'import sys, tomllib
for path in sys.argv[1:]:
    print(*tomllib.load(open(path, "rb"))["build-system"]["requires"], sep="\n")' \
    pyproject.toml engine-sim/pyproject.toml testbed/pyproject.toml sim/pyproject.toml
  echo pip
} | sort -u | lock build - -c locks/dev.txt
lock_sglang_cpu
