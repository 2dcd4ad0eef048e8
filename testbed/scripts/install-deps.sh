#!/usr/bin/env bash
# Installs the system packages the testbed needs from Debian, once: Prometheus (with promtool),
# Lua 5.1 (the Argo CD health check's tests), libibverbs1 (real SGLang's Mooncake),
# and, when running as root, iproute2 (ip, tc) for the emulated link and containerd, runc, the
# CNI plugins, iptables and conntrack for the real nodes (without root the testbed cannot make
# network namespaces or run containers, and falls back to processes and the engines' token bucket).
# Idempotent: does nothing when the binaries are already on PATH. kubectl is expected on the
# machine already; the Kubernetes binaries are built by build-binaries.sh, not installed here.
set -euo pipefail
log() { echo "[install-deps] $*" >&2; }

missing=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
# Lua 5.1 runs the chart's Argo CD health check in tests (Argo CD's gopher-lua is Lua 5.1)
command -v lua5.1 >/dev/null 2>&1 || missing+=(lua5.1)
# real SGLang on CPU (scripts/setup-sglang-cpu.sh): Mooncake's engine.so links libibverbs even for TCP
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || missing+=(libibverbs1)
if [ "$(id -u)" -eq 0 ]; then
  command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || missing+=(iproute2)
  # the real node of each cluster (real-node.sh): the runtime, CNI, kube-proxy's iptables
  command -v containerd >/dev/null 2>&1 && command -v ctr >/dev/null 2>&1 || missing+=(containerd)
  command -v runc >/dev/null 2>&1 || missing+=(runc)
  [ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
  command -v iptables >/dev/null 2>&1 || missing+=(iptables)
  command -v conntrack >/dev/null 2>&1 || missing+=(conntrack)
fi
command -v kubectl >/dev/null 2>&1 || log "warning: kubectl not on PATH (kwokctl waits for clusters with it)"

if [ ${#missing[@]} -eq 0 ]; then
  log "all present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { log "need root (or sudo) to install: ${missing[*]}"; exit 1; }
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only when they cannot offer the package yet.
if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
  log "apt-get update"
  $SUDO apt-get update -qq
fi
log "installing: ${missing[*]}"
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
command -v prometheus >/dev/null && command -v promtool >/dev/null && command -v lua5.1 >/dev/null
log "installed: ${missing[*]}"
