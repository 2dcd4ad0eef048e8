#!/usr/bin/env bash
# The Gateway API Inference Extension's InferencePool CRD (inference.networking.k8s.io, v1) for the
# gateway tests on the testbed (tests/integration/test_operator_gateway.py, tests/e2e): the file
# its pinned Go module ships (config/crd/bases), taken through the Go module proxy (go checks the
# module against the checksum database) into a cache, once; never committed. The CRD is the
# gateway's to install on a real cluster, so the tests install it and remove it afterwards.
# Prints the file's path on its last line.
set -euo pipefail
GIE_VERSION=v1.6.2
GIE_MODULE=sigs.k8s.io/gateway-api-inference-extension
CRD=config/crd/bases/inference.networking.k8s.io_inferencepools.yaml
DIR=${PRFAAS_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/prfaas/bin/tools-gie-$GIE_VERSION}
if [ ! -s "$DIR/inferencepools.yaml" ]; then
  echo "[fetch-inference-pool-crd] $GIE_MODULE@$GIE_VERSION" >&2
  module=$(
    GOFLAGS=-mod=mod GOTOOLCHAIN=${GOTOOLCHAIN:-local} go mod download -json "$GIE_MODULE@$GIE_VERSION" \
      | python3 -c 'import json, sys; d = json.load(sys.stdin); print(d["Dir"]) if "Dir" in d else sys.exit(d.get("Error", "no Dir"))'
  )
  mkdir -p "$DIR"
  cp "$module/$CRD" "$DIR/inferencepools.yaml.partial"
  mv "$DIR/inferencepools.yaml.partial" "$DIR/inferencepools.yaml"
fi
echo "$DIR/inferencepools.yaml"
