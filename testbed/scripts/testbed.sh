#!/usr/bin/env bash
# The PrfaaS testbed: two local kwok clusters with fake GPU nodes and an emulated link.
#   prfaas : the PrfaaS cluster (H200 nodes), pods in 10.231.0.0/16 inside the testbed's own
#            network namespace (or 127.100.0.0/16 where namespaces are not allowed), nodes in
#            127.101.0.0/24
#   pd     : the local PD cluster (H20 nodes, operator and router), pods in 127.200.0.0/16,
#            nodes in 127.201.0.0/24
# Pod addresses are addresses the testbed owns, so a runner can start each pod's workload as a
# local process bound to its pod IP. The emulated cross-cluster link (docs/testbed.md): the PrfaaS
# cluster's pod range exists only inside the network namespace prfaas-<id>, joined to this one
# by a veth pair (10.230.255.1 here, .2 there) that the runner shapes with tc from the CR's link
# spec; a CR with a latency also gets the runner's delay line (prfaas_testbed/delay_line.py).
# Where the machine does not allow namespaces (not root, no iproute2) the PrfaaS pods use
# loopback too and the engines pace their KV sends instead; PRFAAS_TESTBED_LINK=loopback forces
# that. The choice is made at the first `up` of a state dir and kept. Nothing points elsewhere.
#
# With real nodes, LeaderWorkerSet (lws.sh) runs in both clusters, for multi-node engine pools.
#
# Usage: testbed.sh up | down | status | env
#   up     build or reuse the binaries, create the clusters (reusing healthy ones, recreating
#          broken ones), add the nodes, write self-contained kubeconfigs
#   down   delete both clusters and stop any process they left behind
#   status one line per cluster
#   env    shell exports (eval "$(testbed.sh env)"): kubeconfig paths, address ranges, binaries
# State: ${PRFAAS_TESTBED_DIR:-~/.cache/prfaas/testbed}. ~/.kube/config is never touched.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE_DIR=${PRFAAS_TESTBED_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/prfaas/testbed}
KWOK_DIR=$STATE_DIR/kwok
KUBECONFIG_DIR=$STATE_DIR/kubeconfig
KUBECTL=${KUBECTL:-$(command -v kubectl || true)}
CREATE_TIMEOUT=${PRFAAS_TESTBED_CREATE_TIMEOUT:-5m}
export KWOK_WORKDIR=$KWOK_DIR

CLUSTERS=(prfaas pd)
# Per cluster: GPU product label, GPU nodes, GPUs per node, CPU-only nodes, pod /16, node /24,
# service range. The sample CR needs 4 x 8 H200 GPUs and 8 x 8 H20 GPUs; the rest is spare.
declare -A GPU_PRODUCT=([prfaas]=NVIDIA-H200 [pd]=NVIDIA-H20)
declare -A GPU_NODES=([prfaas]=5 [pd]=10)
declare -A GPUS_PER_NODE=([prfaas]=8 [pd]=8)
declare -A CPU_NODES=([prfaas]=2 [pd]=2)
ID=$(printf '%s' "$STATE_DIR" | md5sum | cut -c1-6)
LINK_NETNS=prfaas-$ID
LINK_HOST_DEV=pf${ID}h
LINK_NS_DEV=pf${ID}n
LINK_HOST_IP=10.230.255.1
LINK_NS_IP=10.230.255.2
NETNS_POD_NET=10.231

link_mode() { # netns or loopback: recorded by the first `up` of this state dir, else what would run
  if [ -f "$STATE_DIR/link-mode" ]; then
    cat "$STATE_DIR/link-mode"
  elif [ "${PRFAAS_TESTBED_LINK:-}" = loopback ]; then
    echo loopback
  elif [ "$(id -u)" = 0 ] && command -v ip >/dev/null && command -v tc >/dev/null \
    && ip netns add "$LINK_NETNS-probe" 2>/dev/null && ip netns del "$LINK_NETNS-probe" 2>/dev/null; then
    echo netns
  else
    echo loopback
  fi
}
LINK_MODE=$(link_mode)
# shellcheck source=real-node.sh
. "$HERE/real-node.sh"
# shellcheck source=lws.sh
. "$HERE/lws.sh"
IMAGE_DIR=""
node_mode() { # real (a kubelet node per cluster runs our containers) or process: recorded like link-mode
  if [ -f "$STATE_DIR/node-mode" ]; then
    cat "$STATE_DIR/node-mode"
  elif [ "${PRFAAS_TESTBED_NODES:-}" = process ] || [ "$LINK_MODE" != netns ] || ! real_nodes_possible; then
    echo process
  else
    echo real
  fi
}
NODE_MODE=$(node_mode)
# With real nodes the PD cluster's kwok pods live in a namespace of their own too (pd-<id>), so
# the containers on the real nodes can reach them (loopback addresses do not route between
# namespaces).
PD_NETNS=pd-$ID
PD_HOST_DEV=pd${ID}h
PD_NS_DEV=pd${ID}n
PD_HOST_IP=10.230.254.1
PD_NS_IP=10.230.254.2
PD_NETNS_POD_NET=10.233
if [ "$NODE_MODE" = real ]; then
  declare -A POD_NET=([prfaas]=$NETNS_POD_NET [pd]=$PD_NETNS_POD_NET)
  declare -A SERVICE_CIDR=([prfaas]=${NODE_SERVICE_CIDR[prfaas]} [pd]=${NODE_SERVICE_CIDR[pd]})
elif [ "$LINK_MODE" = netns ]; then
  declare -A POD_NET=([prfaas]=$NETNS_POD_NET [pd]=127.200)
  declare -A SERVICE_CIDR=([prfaas]=127.102.0.0/24 [pd]=127.202.0.0/24)
else
  declare -A POD_NET=([prfaas]=127.100 [pd]=127.200)
  declare -A SERVICE_CIDR=([prfaas]=127.102.0.0/24 [pd]=127.202.0.0/24)
fi
declare -A NODE_NET=([prfaas]=127.101.0 [pd]=127.201.0)
# Every testbed node carries this label with value gpu or cpu; other nodes (tests and
# benchmarks add their own) are left alone.
NODE_LABEL=prfaas.io/testbed-pool
NODE_SELECTOR="$NODE_LABEL in (gpu,cpu)"

log() { echo "[testbed] $*" >&2; }
die() { log "error: $*"; exit 1; }

build_bin_dir() {
  # build-binaries.sh prints the binary directory on its last line; it is a no-op when built.
  local out
  out=$("$HERE/build-binaries.sh") || die "building the testbed binaries failed (see above)"
  out=$(printf '%s\n' "$out" | tail -n 1)
  [ -x "$out/kwokctl" ] || die "build-binaries.sh did not leave kwokctl in '$out'"
  echo "$out" >"$STATE_DIR/bin-dir"
  echo "$out"
}

recorded_bin_dir() { # the binaries the last `up` used; builds only when there is no record
  if [ -f "$STATE_DIR/bin-dir" ] && [ -x "$(cat "$STATE_DIR/bin-dir")/kwokctl" ]; then
    cat "$STATE_DIR/bin-dir"
  else
    mkdir -p "$STATE_DIR"
    build_bin_dir
  fi
}

cluster_workdir() { echo "$KWOK_DIR/clusters/$1"; }
kwok_kubeconfig() { echo "$(cluster_workdir "$1")/kubeconfig.yaml"; }
flat_kubeconfig() { echo "$KUBECONFIG_DIR/$1.yaml"; }

render_config() { # cluster bin_dir -> kwokctl config on stdout
  # With a real node the apiserver also answers on the node's bridge (its containers reach it
  # there, and through the `kubernetes` Service), advertises that address and signs for it.
  local advertise=127.0.0.1 bind=127.0.0.1 reconciler=none sans="[]"
  if [ "$NODE_MODE" = real ]; then
    advertise=${NODE_IP[$1]} bind=0.0.0.0 reconciler=lease
    sans="[${NODE_IP[$1]}, ${SERVICE_CIDR[$1]%.0/24}.1]"
  fi
  sed -e "s#@BIN_DIR@#$2#g" -e "s#@KUBECTL@#$KUBECTL#g" \
    -e "s#@SERVICE_CIDR@#${SERVICE_CIDR[$1]}#g" \
    -e "s#@FALLBACK_POD_CIDR@#${POD_NET[$1]}.0.0/24#g" \
    -e "s#@ADVERTISE_ADDRESS@#$advertise#g" -e "s#@BIND_ADDRESS@#$bind#g" \
    -e "s#@ENDPOINT_RECONCILER@#$reconciler#g" -e "s#@CERT_SANS@#$sans#g" \
    -e "s#@PKI_DIR@#$(cluster_workdir "$1")/pki#g" \
    "$HERE/kwokctl.yaml.in"
}

render_node() { # name index pool(gpu|cpu) cluster -> one Node manifest on stdout
  local name=$1 index=$2 pool=$3 cluster=$4 labels resources
  local pod_cidr="${POD_NET[$cluster]}.$index.0/24" node_ip="${NODE_NET[$cluster]}.$index"
  # With a real node, the fake nodes are tainted, as GPU nodes are in production: what asks for
  # no GPU (the operator, the router) lands on the real node; a test pod may still tolerate cpu.
  local taints=""
  if [ "$NODE_MODE" = real ] && [ "$pool" = gpu ]; then
    taints="
  taints: [{key: nvidia.com/gpu, value: present, effect: NoSchedule}]"
  elif [ "$NODE_MODE" = real ]; then
    taints="
  taints: [{key: $NODE_LABEL, value: cpu, effect: NoSchedule}]"
  fi
  if [ "$pool" = gpu ]; then
    labels="
    nvidia.com/gpu.present: \"true\"
    nvidia.com/gpu.product: ${GPU_PRODUCT[$cluster]}
    nvidia.com/gpu.count: \"${GPUS_PER_NODE[$cluster]}\"
    nvidia.com/gpu.family: hopper"
    resources="{cpu: \"192\", memory: 2Ti, pods: \"110\", nvidia.com/gpu: \"${GPUS_PER_NODE[$cluster]}\"}"
  else
    labels=""
    resources="{cpu: \"64\", memory: 256Gi, pods: \"110\"}"
  fi
  cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: $name
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    type: kwok
    $NODE_LABEL: $pool
    kubernetes.io/hostname: $name
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64$labels
spec:
  podCIDR: $pod_cidr
  podCIDRs: [$pod_cidr]$taints
status:
  addresses:
    - {type: InternalIP, address: $node_ip}
    - {type: Hostname, address: $name}
  capacity: $resources
  allocatable: $resources
  nodeInfo: {architecture: amd64, operatingSystem: linux, kubeletVersion: fake, kubeProxyVersion: fake}
EOF
}

node_specs() { # cluster -> "name index pool" lines; node index i owns pod /24 .i and node IP .i
  local cluster=$1 i index=1 short
  short=$(echo "${GPU_PRODUCT[$cluster]#NVIDIA-}" | tr '[:upper:]' '[:lower:]')
  for ((i = 0; i < GPU_NODES[$cluster]; i++)); do echo "$short-$i $((index++)) gpu"; done
  for ((i = 0; i < CPU_NODES[$cluster]; i++)); do echo "cpu-$i $((index++)) cpu"; done
}

render_nodes() { # cluster -> all Node manifests
  local name index pool
  while read -r name index pool; do render_node "$name" "$index" "$pool" "$1"; done < <(node_specs "$1")
}

expected_node_summary() { # cluster -> "name gpus product True" per node, sorted
  local name index pool
  while read -r name index pool; do
    if [ "$pool" = gpu ]; then
      echo "$name ${GPUS_PER_NODE[$1]} ${GPU_PRODUCT[$1]} True"
    else
      echo "$name - - True"
    fi
  done < <(node_specs "$1") | sort
}

actual_node_summary() { # cluster -> the same summary, read from the apiserver
  "$KUBECTL" --kubeconfig "$(kwok_kubeconfig "$1")" get nodes -l "$NODE_SELECTOR" -o jsonpath='{range .items[*]}{.metadata.name} {.status.allocatable.nvidia\.com/gpu} {.metadata.labels.nvidia\.com/gpu\.product} {.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' \
    | awk '{ if (NF == 2) print $1, "-", "-", $2; else print }' | sort
}

processes_alive() { # cluster: every process kwokctl started for it is alive
  local pids_dir pid_file
  pids_dir="$(cluster_workdir "$1")/pids"
  compgen -G "$pids_dir/*.pid" >/dev/null || return 1
  for pid_file in "$pids_dir"/*.pid; do
    kill -0 "$(cat "$pid_file")" 2>/dev/null || return 1
  done
}

cluster_healthy() { # cluster: processes up, apiserver ready, same config as we would render now
  local cluster=$1 bin=$2
  [ -f "$(kwok_kubeconfig "$cluster")" ] || return 1
  processes_alive "$cluster" || return 1
  cmp -s "$STATE_DIR/$cluster.kwokctl.yaml" <(render_config "$cluster" "$bin") || return 1
  apiserver_ready "$cluster"
}

apiserver_ready() { # cluster: /readyz answers ok; a few tries, so a busy machine is not "broken"
  local attempt
  for attempt in 1 2 3; do
    "$KUBECTL" --kubeconfig "$(kwok_kubeconfig "$1")" --request-timeout=5s get --raw /readyz >/dev/null 2>&1 && return 0
    [ "$attempt" -lt 3 ] && sleep 1
  done
  return 1
}

kill_leftovers() { # cluster: stop every process that names its workdir or runs in it, kwokctl's
  # or not (kwokctl deletes the pid files of what it stopped and knows nothing of the control-plane
  # processes control_plane.py started again); -P: only the standard library on sys.path
  python3 -P "$HERE/../prfaas_testbed/leftovers.py" "$(cluster_workdir "$1")" || log "$1: looking for leftovers failed"
}

delete_cluster() { # cluster
  local cluster=$1 kwokctl=$2
  if [ -d "$(cluster_workdir "$cluster")" ]; then
    "$kwokctl" delete cluster --name "$cluster" >/dev/null 2>&1 9>&- || log "kwokctl could not delete $cluster cleanly"
  fi
  kill_leftovers "$cluster" # also those of a workdir already gone
  rm -rf "$(cluster_workdir "$cluster")"
  rm -f "$(flat_kubeconfig "$cluster")" "$STATE_DIR/$cluster.kwokctl.yaml"
}

ensure_nodes() { # cluster: nodes exist with their GPU capacity and are Ready
  local cluster=$1 kc
  kc=$(kwok_kubeconfig "$cluster")
  [ "$(actual_node_summary "$cluster")" = "$(expected_node_summary "$cluster")" ] && return 0
  # Client-side apply creates missing nodes with their status (capacity, addresses) intact.
  render_nodes "$cluster" | "$KUBECTL" --kubeconfig "$kc" apply -f - >/dev/null
  "$KUBECTL" --kubeconfig "$kc" wait --for=condition=Ready node -l "$NODE_SELECTOR" --timeout=120s >/dev/null
  if [ "$(actual_node_summary "$cluster")" != "$(expected_node_summary "$cluster")" ]; then
    diff <(expected_node_summary "$cluster") <(actual_node_summary "$cluster") >&2 || true
    die "$cluster: nodes differ from the testbed's layout (expected < > found)"
  fi
}

ensure_pod_netns() { # netns host_dev ns_dev host_ip ns_ip pod_net: a namespace whose pod range
  # (pod_net.0.0/16) is local inside it, joined to this namespace by a veth pair and routed
  ip netns list | grep -qx "$1\( .*\)\?" || ip netns add "$1"
  if ! ip link show "$2" >/dev/null 2>&1; then
    ip link add "$2" type veth peer name "$3" netns "$1"
  fi
  ip addr replace "$4/30" dev "$2"
  ip link set "$2" up
  ip -n "$1" link set lo up
  ip -n "$1" addr replace "$5/30" dev "$3"
  ip -n "$1" link set "$3" up
  # every pod address is local inside the namespace (bind works without adding each one)
  ip -n "$1" route replace local "$6.0.0/16" dev lo
  ip -n "$1" route replace default via "$4" dev "$3"
  ip route replace "$6.0.0/16" via "$5" dev "$2"
}

delete_pod_netns() { # netns host_dev ns_ip pod_net
  ip route del "$4.0.0/16" via "$3" 2>/dev/null || true
  ip link del "$2" 2>/dev/null || true # its peer goes with it
  ip netns del "$1" 2>/dev/null || true
}

ensure_link() { # the PrfaaS pods' namespace and the veth pair to it (netns mode), idempotently
  [ "$LINK_MODE" = netns ] || return 0
  ensure_pod_netns "$LINK_NETNS" "$LINK_HOST_DEV" "$LINK_NS_DEV" "$LINK_HOST_IP" "$LINK_NS_IP" "$NETNS_POD_NET"
}

ensure_pd_netns() { # real-node mode: the PD cluster's kwok pods in their own namespace, routed from here
  [ "$NODE_MODE" = real ] || return 0
  ensure_pod_netns "$PD_NETNS" "$PD_HOST_DEV" "$PD_NS_DEV" "$PD_HOST_IP" "$PD_NS_IP" "$PD_NETNS_POD_NET"
  sysctl -qw net.ipv4.ip_forward=1 # PD <-> PrfaaS pods and containers -> kwok pods go through here
}

build_images() { # the project's images as archives (scripts/build-images.sh caches them); prints the dir
  local out
  out=$(bash "$HERE/../../scripts/build-images.sh") || die "building the images failed (see above)"
  out=$(printf '%s\n' "$out" | tail -n 1)
  [ -d "$out" ] || die "build-images.sh did not print its image directory (got '$out')"
  echo "$out"
}

delete_link() {
  delete_pod_netns "$LINK_NETNS" "$LINK_HOST_DEV" "$LINK_NS_IP" "$NETNS_POD_NET"
}

write_flat_kubeconfig() { # cluster: self-contained kubeconfig (inline certs) at a known path
  local cluster=$1 tmp
  mkdir -p "$KUBECONFIG_DIR"
  tmp=$(mktemp "$KUBECONFIG_DIR/.$cluster.XXXXXX")
  "$KUBECTL" config view --raw --minify --flatten --kubeconfig "$(kwok_kubeconfig "$cluster")" >"$tmp"
  chmod 600 "$tmp"
  mv -f "$tmp" "$(flat_kubeconfig "$cluster")"
}

up() {
  [ -n "$KUBECTL" ] || die "kubectl not found on PATH (set KUBECTL=/path/to/kubectl)"
  local bin cluster
  mkdir -p "$KWOK_DIR"
  echo "$LINK_MODE" >"$STATE_DIR/link-mode"
  echo "$NODE_MODE" >"$STATE_DIR/node-mode"
  ensure_link
  ensure_pd_netns
  bin=$(build_bin_dir)
  if [ "$NODE_MODE" = real ]; then
    IMAGE_DIR=$(build_images)
    echo "$IMAGE_DIR" >"$STATE_DIR/image-dir"
    lws_build
  fi
  for cluster in "${CLUSTERS[@]}"; do
    if cluster_healthy "$cluster" "$bin"; then
      log "$cluster: reusing the running cluster"
    else
      if [ -d "$(cluster_workdir "$cluster")" ]; then
        log "$cluster: not healthy or configured differently; recreating"
      fi
      node_down "$cluster" "$bin" # its kubelet knew the old cluster's CA and node
      delete_cluster "$cluster" "$bin/kwokctl"
      render_config "$cluster" "$bin" >"$STATE_DIR/$cluster.kwokctl.yaml"
      log "$cluster: creating"
      # 9>&-: the cluster's daemons must not inherit (and so hold forever) the state lock.
      if ! "$bin/kwokctl" -c "$STATE_DIR/$cluster.kwokctl.yaml" create cluster --name "$cluster" \
        --kubeconfig "" --wait "$CREATE_TIMEOUT" >"$STATE_DIR/$cluster.create.log" 2>&1 9>&-; then
        tail -n 30 "$STATE_DIR/$cluster.create.log" >&2
        die "$cluster: kwokctl create failed (log: $STATE_DIR/$cluster.create.log, component logs: $(cluster_workdir "$cluster")/logs)"
      fi
    fi
    ensure_nodes "$cluster"
    write_flat_kubeconfig "$cluster"
    if [ "$NODE_MODE" = real ]; then
      node_up "$cluster" "$bin"
      lws_install "$cluster" "$bin"
    fi
  done
  log "up ($NODE_MODE nodes): $(flat_kubeconfig prfaas) $(flat_kubeconfig pd)"
}

down() {
  local cluster kwokctl=true
  [ -f "$STATE_DIR/bin-dir" ] && kwokctl="$(cat "$STATE_DIR/bin-dir")/kwokctl"
  for cluster in "${CLUSTERS[@]}"; do
    node_down "$cluster" "$(dirname "$kwokctl")"
    delete_cluster "$cluster" "$kwokctl"
    log "$cluster: deleted"
  done
  delete_pod_netns "$PD_NETNS" "$PD_HOST_DEV" "$PD_NS_IP" "$PD_NETNS_POD_NET"
  if [ -f "$STATE_DIR/link-mode" ] && [ "$(cat "$STATE_DIR/link-mode")" = netns ]; then
    delete_link
    log "link namespace $LINK_NETNS: deleted"
  fi
  rm -f "$STATE_DIR/link-mode" "$STATE_DIR/node-mode" "$STATE_DIR/image-dir"
}

status() {
  local cluster kc nodes rc=0
  for cluster in "${CLUSTERS[@]}"; do
    kc=$(kwok_kubeconfig "$cluster")
    if [ -f "$kc" ] && processes_alive "$cluster" && apiserver_ready "$cluster"; then
      nodes=$("$KUBECTL" --kubeconfig "$kc" get nodes -l "$NODE_SELECTOR" --no-headers 2>/dev/null | grep -c ' Ready ' || true)
      echo "$cluster: up, $nodes nodes Ready, $("$KUBECTL" config view --kubeconfig "$kc" -o jsonpath='{.clusters[0].cluster.server}')"
    else
      echo "$cluster: down"
      rc=1
    fi
  done
  return $rc
}

env_exports() {
  local cluster upper bin
  bin=$(recorded_bin_dir)
  echo "export PRFAAS_TESTBED_DIR=$STATE_DIR"
  echo "export PRFAAS_TESTBED_BIN=$bin"
  echo "export PRFAAS_TESTBED_NODE_LABEL=$NODE_LABEL"
  echo "export PRFAAS_TESTBED_LINK=$LINK_MODE"
  echo "export PRFAAS_TESTBED_NODES=$NODE_MODE"
  if [ "$NODE_MODE" = real ]; then
    echo "export PD_TESTBED_POD_NETNS=$PD_NETNS"
    echo "export PRFAAS_TESTBED_IMAGE_DIR=$(cat "$STATE_DIR/image-dir" 2>/dev/null)"
  fi
  if [ "$LINK_MODE" = netns ]; then
    echo "export PRFAAS_TESTBED_LINK_NETNS=$LINK_NETNS"
    echo "export PRFAAS_TESTBED_LINK_HOST_DEV=$LINK_HOST_DEV"
    echo "export PRFAAS_TESTBED_LINK_NS_DEV=$LINK_NS_DEV"
    echo "export PRFAAS_TESTBED_LINK_HOST_IP=$LINK_HOST_IP"
  fi
  for cluster in "${CLUSTERS[@]}"; do
    upper=$(echo "$cluster" | tr '[:lower:]' '[:upper:]')
    echo "export ${upper}_KUBECONFIG=$(flat_kubeconfig "$cluster")"
    echo "export ${upper}_POD_CIDR=${POD_NET[$cluster]}.0.0/16"
    echo "export ${upper}_NODE_CIDR=${NODE_NET[$cluster]}.0/24"
    echo "export ${upper}_SERVICE_CIDR=${SERVICE_CIDR[$cluster]}"
    echo "export ${upper}_GPU_PRODUCT=${GPU_PRODUCT[$cluster]}"
    echo "export ${upper}_GPU_NODES=${GPU_NODES[$cluster]}"
    echo "export ${upper}_GPUS_PER_NODE=${GPUS_PER_NODE[$cluster]}"
    echo "export ${upper}_CPU_NODES=${CPU_NODES[$cluster]}"
    if [ "$NODE_MODE" = real ]; then
      echo "export ${upper}_REAL_NODE=$(node_name "$cluster")"
      echo "export ${upper}_REAL_NODE_IP=${NODE_IP[$cluster]}"
      echo "export ${upper}_REAL_NODE_GPU_PRODUCT=$(real_node_gpu_product "$cluster")"
      echo "export ${upper}_REAL_NODE_CONTAINERD=$(node_socket "$cluster")"
      echo "export ${upper}_REAL_NODE_POD_LOGS=$(node_dir "$cluster")/pod-logs"
    fi
  done
}

with_lock() { # serialise up/down of one state dir across processes
  mkdir -p "$STATE_DIR"
  exec 9>"$STATE_DIR/.lock"
  flock -w 900 9 || die "another testbed.sh holds $STATE_DIR/.lock"
  "$@"
}

case "${1:-}" in
  up) with_lock up ;;
  down) with_lock down ;;
  status) status ;;
  env) env_exports ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
