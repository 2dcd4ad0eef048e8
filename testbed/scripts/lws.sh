# shellcheck shell=bash
# LeaderWorkerSet (kubernetes-sigs/lws) in both testbed clusters, sourced by testbed.sh: the
# controller and its webhooks as upstream ships them (its Helm chart, from the module), running
# as a pod on each cluster's real node, as on any cluster. Multi-node engine pools need it.
#
# - The manager is built from the Go module proxy (pinned, cached, never committed), like the
#   Kubernetes binaries; `go install ...@VERSION` cannot be used (the proxy refuses the version
#   list), so the module is downloaded and `./cmd` built inside it.
# - Its image is made here from that binary (FROM scratch, non-root), exported as an OCI archive
#   and imported into each real node's containerd with the project's images (node_import_images);
#   the chart's pull policy is Never.
# - Its webhooks manage their own certificates (the chart's default, no cert-manager). The
#   apiservers run with --enable-aggregator-routing, so they call a webhook Service at its
#   endpoint's pod IP (the PrfaaS cluster has no kube-proxy to route a ClusterIP).
# - The manager reaches its apiserver at the node's address (KUBERNETES_SERVICE_HOST/PORT set
#   on its Deployment), for the same reason.
LWS_VERSION=v0.9.0
LWS_MODULE=sigs.k8s.io/lws
LWS_NAMESPACE=lws-system # the CRD's conversion webhook names this namespace
LWS_IMAGE_REPOSITORY=localhost/prfaas-testbed/lws
LWS_BIN_DIR=${PRFAAS_LWS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/prfaas/bin/lws-$LWS_VERSION}
LWS_ARCHIVE=$LWS_BIN_DIR/lws_$LWS_VERSION.oci.tar

lws_module_dir() { # the module's source in Go's module cache (downloaded once)
  GOFLAGS=-mod=mod GOTOOLCHAIN=${GOTOOLCHAIN:-local} go mod download -json "$LWS_MODULE@$LWS_VERSION" \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])'
}

lws_build() { # the manager binary and its image archive, once
  mkdir -p "$LWS_BIN_DIR"
  if [ ! -x "$LWS_BIN_DIR/manager" ]; then
    log "building LeaderWorkerSet $LWS_VERSION (first run: about 5 min)"
    (
      cd "$(lws_module_dir)"
      GOFLAGS=-mod=mod GOTOOLCHAIN=${GOTOOLCHAIN:-local} CGO_ENABLED=0 \
        go build -trimpath -ldflags "-s -w" -o "$LWS_BIN_DIR/manager.tmp" ./cmd
    ) || die "building LeaderWorkerSet $LWS_VERSION failed"
    mv -f "$LWS_BIN_DIR/manager.tmp" "$LWS_BIN_DIR/manager"
  fi
  [ "$LWS_ARCHIVE" -nt "$LWS_BIN_DIR/manager" ] && return 0
  local driver=vfs ctr image=$LWS_IMAGE_REPOSITORY:$LWS_VERSION
  buildah --storage-driver overlay images >/dev/null 2>&1 && driver=overlay
  ctr=$(buildah --storage-driver "$driver" from scratch)
  buildah --storage-driver "$driver" copy --chmod 0555 "$ctr" "$LWS_BIN_DIR/manager" /manager >/dev/null
  buildah --storage-driver "$driver" config --user 65532:65532 --entrypoint '["/manager"]' \
    --label "org.opencontainers.image.source=https://github.com/kubernetes-sigs/lws" \
    --label "org.opencontainers.image.version=$LWS_VERSION" "$ctr"
  buildah --storage-driver "$driver" commit --quiet --rm "$ctr" "$image" >/dev/null
  rm -f "$LWS_ARCHIVE.tmp"
  buildah --storage-driver "$driver" push --quiet "$image" "oci-archive:$LWS_ARCHIVE.tmp:$image" >/dev/null
  mv -f "$LWS_ARCHIVE.tmp" "$LWS_ARCHIVE"
  log "LeaderWorkerSet image $image: $(du -h "$LWS_ARCHIVE" | cut -f1)"
}

lws_webhook_ready() { # kubeconfig: the webhooks answer (a server-side dry run passes through them)
  "$KUBECTL" --kubeconfig "$1" create --dry-run=server -o name -f - >/dev/null 2>&1 <<EOF
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata: {name: testbed-probe, namespace: default}
spec:
  replicas: 1
  leaderWorkerTemplate:
    size: 2
    workerTemplate:
      spec:
        containers: [{name: probe, image: $PAUSE_IMAGE}]
EOF
}

lws_install() { # cluster bin_dir: the chart on the cluster's real node, ready to admit LeaderWorkerSets
  local cluster=$1 helm=$2/helm kubeconfig server port _
  kubeconfig=$(flat_kubeconfig "$cluster")
  server=$("$KUBECTL" config view --kubeconfig "$kubeconfig" -o jsonpath='{.clusters[0].cluster.server}')
  port=${server##*:}
  if ! "$helm" --kubeconfig "$kubeconfig" status lws -n "$LWS_NAMESPACE" >/dev/null 2>&1; then
    "$helm" --kubeconfig "$kubeconfig" upgrade --install lws "$(lws_module_dir)/charts/lws" \
      -n "$LWS_NAMESPACE" --create-namespace \
      --set image.manager.repository="$LWS_IMAGE_REPOSITORY" --set image.manager.tag="$LWS_VERSION" \
      --set image.manager.pullPolicy=Never \
      --set resources.requests.cpu=50m --set resources.requests.memory=64Mi \
      --set-string "nodeSelector.prfaas\.io/testbed-pool=real" >/dev/null \
      || die "$cluster: installing LeaderWorkerSet's chart failed"
  fi
  "$KUBECTL" --kubeconfig "$kubeconfig" -n "$LWS_NAMESPACE" set env deployment/lws-controller-manager \
    "KUBERNETES_SERVICE_HOST=${NODE_IP[$cluster]}" "KUBERNETES_SERVICE_PORT=$port" >/dev/null
  "$KUBECTL" --kubeconfig "$kubeconfig" -n "$LWS_NAMESPACE" rollout status deployment/lws-controller-manager \
    --timeout=180s >/dev/null || die "$cluster: the LeaderWorkerSet controller did not become ready"
  for _ in $(seq 90); do
    lws_webhook_ready "$kubeconfig" && return 0
    sleep 2
  done
  die "$cluster: LeaderWorkerSet's webhooks did not answer within 180 s"
}
