#!/usr/bin/env bash
# Builds the pinned testbed binaries from the Go module proxy into a cache, once.
# kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy (v1.36.1), etcd (v3.6.14),
# kwok and kwokctl (v0.8.0), helm (v3.21.4). Reused when present; never committed.
# Prints the binary directory on its last line.
set -euo pipefail
K8S_VERSION=v1.36.1
ETCD_VERSION=v3.6.14
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.21.4
BIN=${PRFAAS_BIN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/prfaas/bin/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION}
export GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS=-mod=mod CGO_ENABLED=0
mkdir -p "$BIN"
log() { echo "[build-binaries] $*" >&2; }

build_kubernetes() {
  local staging="v0.${K8S_VERSION#v1.}" minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
  local work; work=$(mktemp -d); trap 'rm -rf "$work"' RETURN
  (
    cd "$work"
    go mod init local.test/k8sbins >/dev/null 2>&1
    go mod edit -go=1.26.0
    local kgomod
    kgomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
      | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
    for m in $(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/.*#\1#p' "$kgomod"); do
      go mod edit -replace="$m=$m@$staging"
    done
    go mod edit -require="k8s.io/kubernetes@$K8S_VERSION"
    cat > tools.go <<'GO'
//go:build tools
package tools
import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
GO
    go mod tidy >/dev/null 2>&1 || go mod tidy
    local ld="-s -w"
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
      ld+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
      ld+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
    done
    go build -trimpath -ldflags "$ld" -o "$BIN/" \
      k8s.io/kubernetes/cmd/kube-apiserver \
      k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler \
      k8s.io/kubernetes/cmd/kubelet \
      k8s.io/kubernetes/cmd/kube-proxy
  )
}

build_etcd() {
  local work; work=$(mktemp -d); trap 'rm -rf "$work"' RETURN
  (
    cd "$work"
    go mod init local.test/etcdbin >/dev/null 2>&1
    go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >/dev/null 2>&1
    go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
  )
}

build_kwok() {
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w" \
    "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" "sigs.k8s.io/kwok/cmd/kwokctl@$KWOK_VERSION"
}

build_helm() {
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w \
    -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION \
    -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 \
    -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=36" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
}

need() { for b in "$@"; do [ -x "$BIN/$b" ] || return 0; done; return 1; }
if need kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; then log "building Kubernetes $K8S_VERSION (first run: 10-25 min)"; build_kubernetes; fi
if need etcd; then log "building etcd $ETCD_VERSION"; build_etcd; fi
if need kwok kwokctl; then log "building kwok $KWOK_VERSION"; build_kwok; fi
if need helm; then log "building helm $HELM_VERSION"; build_helm; fi
echo "$BIN"
