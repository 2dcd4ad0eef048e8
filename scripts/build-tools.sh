#!/usr/bin/env bash
# Builds the pinned developer tools from the Go module proxy into a cache, once:
# actionlint (lints .github/workflows; tests/unit/project/test_workflows.py runs it). Reused when
# present; never committed. shellcheck (which actionlint uses for `run:` scripts) comes from
# Debian's package when apt is there and we are root (PRFAAS_SKIP_APT=1: never); without it
# actionlint skips that check. Prints the binary directory on its last line.
set -euo pipefail
ACTIONLINT_VERSION=v1.7.12
BIN=${PRFAAS_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/prfaas/bin/tools-actionlint-$ACTIONLINT_VERSION}
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-mod=mod CGO_ENABLED=0
mkdir -p "$BIN"
log() { echo "[build-tools] $*" >&2; }

if [ ! -x "$BIN/actionlint" ]; then
  log "building actionlint $ACTIONLINT_VERSION"
  GOBIN="$BIN" go install -trimpath \
    -ldflags "-s -w -X github.com/rhysd/actionlint.version=$ACTIONLINT_VERSION" \
    "github.com/rhysd/actionlint/cmd/actionlint@$ACTIONLINT_VERSION"
fi

if [ "${PRFAAS_SKIP_APT:-0}" != 1 ] && ! command -v shellcheck >/dev/null 2>&1 \
  && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  log "installing shellcheck (Debian package)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q shellcheck >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q shellcheck >/dev/null; } \
    || log "shellcheck not installed: actionlint will skip its checks of run: scripts"
fi
echo "$BIN"
