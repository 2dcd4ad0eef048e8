# shellcheck shell=bash
# A real node for one testbed cluster, sourced by testbed.sh: containerd + runc, a CNI bridge,
# a kubelet built from the pinned Kubernetes module and, in the PD cluster, kube-proxy (the
# `kubernetes` Service is how an in-cluster client finds its apiserver). The operator and the
# router run there as containers from the project's images; the kwok GPU nodes stay fake.
#
# The node is also a GPU node of its own product (real_node_gpu_product): it advertises
# GPUS_PER_NODE `nvidia.com/gpu` as an extended resource in its status and carries GPU feature
# discovery's labels, so engine pools whose CR names that product run here as containers of the
# engine-sim image, from the operator's manifests as written. An extended resource rather than a
# device plugin: the scheduler and the kubelet's admission read the same capacity either way, and
# a plugin's one extra act, Allocate (device IDs, NVIDIA_VISIBLE_DEVICES), means nothing to a
# fake engine. The kubelet keeps a patched extended resource but zeroes it when it registers the
# node anew, so every `up` patches it again. A product of its own, not the kwok nodes': a CR that
# names NVIDIA-H20 keeps all its pools on kwok nodes, and the node is not tainted, since the
# operator and the router run on it too.
#
# Per cluster (C = pd | prfaas):
#   bridge  kb<id><c>      the node's interface and the pods' gateway (NODE_IP, a /24 of ours)
#   pods    NODE_POD_NET   host-local IPAM on that bridge, in network namespaces containerd makes
#   state   $STATE_DIR/node-C/   containerd root, kubelet root, CNI config, logs, pids
#   run     /run/prfaas-<id>-C/  containerd state and socket
#   cgroup  /prfaas-<id>-C       every cgroup the kubelet and containerd make for this node
# Side effects undone by node_down: the bridge, the KUBE-* chains kube-proxy and the kubelet
# wrote, the kubelet's mounts, the cgroups. See docs/testbed.md.

declare -A NODE_IP=([prfaas]=10.234.0.1 [pd]=10.232.0.1)
declare -A NODE_POD_NET=([prfaas]=10.234.0 [pd]=10.232.0)
declare -A NODE_SERVICE_CIDR=([prfaas]=10.234.128.0/24 [pd]=10.232.128.0/24)
declare -A NODE_KUBELET_PORT=([prfaas]=10260 [pd]=10250)
declare -A NODE_HEALTHZ_PORT=([prfaas]=10258 [pd]=10248)
PAUSE_IMAGE=localhost/prfaas-testbed/pause:3.10

node_name() { echo "node-$1"; }
real_node_gpu_product() { echo "${GPU_PRODUCT[$1]}-real-node"; }
node_dir() { echo "$STATE_DIR/node-$1"; }
node_run_dir() { echo "/run/prfaas-$ID-$1"; }
node_bridge() { echo "kb$ID${1:0:2}"; }
node_cgroup() { echo "/prfaas-$ID-$1"; }
node_socket() { echo "$(node_run_dir "$1")/containerd.sock"; }

real_nodes_possible() { # root, cgroups, the runtime and the kubelet: else the testbed runs pods as processes
  [ "$(id -u)" = 0 ] && [ -d /sys/fs/cgroup/memory ] && command -v containerd >/dev/null \
    && command -v runc >/dev/null && [ -x /usr/lib/cni/bridge ] && command -v iptables >/dev/null
}

node_pid_alive() { # cluster component
  local f; f="$(node_dir "$1")/$2.pid"
  [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null
}

node_start() { # cluster component argv...: start a daemon of this node, its output in logs/
  local cluster=$1 component=$2 dir; shift 2
  dir=$(node_dir "$cluster")
  node_pid_alive "$cluster" "$component" && return 0
  mkdir -p "$dir/logs"
  # setsid: the daemon outlives this script; 9>&-: it must not hold the testbed's state lock
  setsid "$@" >>"$dir/logs/$component.log" 2>&1 </dev/null 9>&- &
  echo $! >"$dir/$component.pid"
}

node_stop() { # cluster component: SIGTERM, up to 10 s, then SIGKILL
  local f pid
  f="$(node_dir "$1")/$2.pid"
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$f"
}

node_cgroups() { # cluster mkdir|rmdir: the node's cgroup parent in every v1 hierarchy
  local hierarchy path
  for hierarchy in /sys/fs/cgroup/*/; do
    [ -d "$hierarchy" ] && [ ! -L "${hierarchy%/}" ] || continue
    path="${hierarchy%/}$(node_cgroup "$1")"
    if [ "$2" = mkdir ]; then
      mkdir -p "$path" 2>/dev/null || true
    elif [ -d "$path" ]; then
      # leaves first; a cgroup with a live process stays (and is reported by status)
      find "$path" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    fi
  done
}

write_if_changed() { # file < content: replaced atomically, and only when it differs (containerd
  # watches its CNI directory and would read a half-written file)
  local tmp
  tmp=$(mktemp "$(dirname "$1")/.tmp.XXXXXX")
  cat >"$tmp"
  if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv -f "$tmp" "$1"; fi
}

node_write_configs() { # cluster: containerd, CNI and kubelet configuration files
  local cluster=$1 dir run bridge kubeconfig
  dir=$(node_dir "$cluster")
  run=$(node_run_dir "$cluster")
  bridge=$(node_bridge "$cluster")
  kubeconfig=$(flat_kubeconfig "$cluster")
  mkdir -p "$dir/cni/net.d" "$dir/cni/ipam" "$dir/containerd" "$dir/kubelet" "$run"
  write_if_changed "$dir/containerd/config.toml" <<EOF
version = 2
root = "$dir/containerd/root"
state = "$run/state"
[grpc]
  address = "$run/containerd.sock"
[ttrpc]
  address = "$run/containerd.sock.ttrpc"
[debug]
  address = "$run/debug.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$dir/cni/net.d"
EOF
  write_if_changed "$dir/cni/net.d/10-prfaas-testbed.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "prfaas-testbed-$cluster",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$bridge",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$dir/cni/ipam",
        "ranges": [[{"subnet": "${NODE_POD_NET[$cluster]}.0/24", "rangeStart": "${NODE_POD_NET[$cluster]}.10", "rangeEnd": "${NODE_POD_NET[$cluster]}.250", "gateway": "${NODE_IP[$cluster]}"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "loopback"}
  ]
}
EOF
  write_if_changed "$dir/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 with cgroupfs on this kind of machine (Kubernetes 1.36 refuses v1 unless told)
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: $(node_cgroup "$cluster")
failSwapOn: false
address: ${NODE_IP[$cluster]}
port: ${NODE_KUBELET_PORT[$cluster]}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: ${NODE_HEALTHZ_PORT[$cluster]}
# Only the apiserver (a client certificate of the cluster's CA) may use the kubelet's API.
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $dir/kubelet/ca.crt}
authorization: {mode: AlwaysAllow}
# The machine is shared and small: never evict the testbed's pods for its disk or memory.
evictionHard: {memory.available: 50Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# The project's images are imported, never pulled.
serializeImagePulls: false
containerRuntimeEndpoint: unix://$(node_socket "$cluster")
# Not /var/log/pods: the other testbed node's kubelet would collect this one's logs as orphans.
podLogsDir: $dir/pod-logs
resolvConf: /etc/resolv.conf
containerLogMaxSize: 10Mi
maxPods: 30
registerNode: true
EOF
  "$KUBECTL" config view --raw --minify --flatten --kubeconfig "$kubeconfig" \
    -o jsonpath='{.clusters[0].cluster.certificate-authority-data}' | base64 -d >"$dir/kubelet/ca.crt"
}

node_import_images() { # cluster [archive...]: the pause, product and engine-sim images (and any
  # archive named) into containerd's k8s.io namespace; one imported unchanged (same path, size
  # and time) is skipped
  local cluster=$1 archive stamp
  shift
  for archive in "$IMAGE_DIR"/*.oci.tar "$@"; do
    [ -f "$archive" ] || continue
    stamp="$(node_dir "$cluster")/imported.$(basename "$archive")"
    [ "$(cat "$stamp" 2>/dev/null)" = "$(stat -c '%n %s %Y' "$archive")" ] && continue
    ctr --address "$(node_socket "$cluster")" -n k8s.io images import "$archive" >/dev/null \
      || die "$cluster node: importing $(basename "$archive") into containerd failed"
    stat -c '%n %s %Y' "$archive" >"$stamp"
  done
}

node_wait_socket() { # cluster
  local _
  for _ in $(seq 100); do
    ctr --address "$(node_socket "$1")" version >/dev/null 2>&1 && return 0
    node_pid_alive "$1" containerd || die "$1 node: containerd exited (log: $(node_dir "$1")/logs/containerd.log)"
    sleep 0.2
  done
  die "$1 node: containerd did not answer within 20 s"
}

node_up() { # cluster bin_dir: the node Ready in its cluster (idempotent)
  local cluster=$1 bin=$2 dir bridge name kubeconfig
  dir=$(node_dir "$cluster")
  bridge=$(node_bridge "$cluster")
  name=$(node_name "$cluster")
  kubeconfig=$(flat_kubeconfig "$cluster")
  [ -x "$bin/kubelet" ] || die "no kubelet in $bin (build-binaries.sh builds it)"
  # The bridge exists before the kubelet so the node IP is there; CNI attaches pods to it.
  ip link show "$bridge" >/dev/null 2>&1 || ip link add "$bridge" type bridge
  ip addr replace "${NODE_IP[$cluster]}/24" dev "$bridge"
  ip link set "$bridge" up
  sysctl -qw net.ipv4.ip_forward=1
  node_cgroups "$cluster" mkdir
  node_write_configs "$cluster"
  node_start "$cluster" containerd containerd --config "$dir/containerd/config.toml"
  node_wait_socket "$cluster"
  node_import_images "$cluster" "$LWS_ARCHIVE"
  node_start "$cluster" kubelet "$bin/kubelet" \
    --config "$dir/kubelet/config.yaml" \
    --kubeconfig "$kubeconfig" \
    --root-dir "$dir/kubelet/root" \
    --cert-dir "$dir/kubelet/pki" \
    --hostname-override "$name" \
    --node-ip "${NODE_IP[$cluster]}" \
    --node-labels "$NODE_LABEL=real,nvidia.com/gpu.present=true,nvidia.com/gpu.product=$(real_node_gpu_product "$cluster"),nvidia.com/gpu.count=${GPUS_PER_NODE[$cluster]}"
  if [ "$cluster" = pd ]; then
    # One kube-proxy on the machine (a second would fight over the same iptables chains).
    node_start "$cluster" kube-proxy "$bin/kube-proxy" \
      --kubeconfig "$kubeconfig" \
      --hostname-override "$name" \
      --proxy-mode iptables \
      --cluster-cidr "${NODE_POD_NET[$cluster]}.0/24" \
      --iptables-localhost-nodeports=false \
      --conntrack-max-per-core=0 \
      --metrics-bind-address 127.0.0.1:10249 \
      --healthz-bind-address 127.0.0.1:10256
  fi
  local _
  for _ in $(seq 60); do # the kubelet registers its node within seconds; `kubectl wait` needs it to exist
    "$KUBECTL" --kubeconfig "$kubeconfig" get "node/$name" >/dev/null 2>&1 && break
    sleep 1
  done
  if ! "$KUBECTL" --kubeconfig "$kubeconfig" wait --for=condition=Ready "node/$name" --timeout=120s >/dev/null 2>&1; then
    tail -n 20 "$dir/logs/kubelet.log" >&2
    die "$cluster: the real node $name did not become Ready (log: $dir/logs/kubelet.log)"
  fi
  local gpus="{\"nvidia.com/gpu\": \"${GPUS_PER_NODE[$cluster]}\"}"
  "$KUBECTL" --kubeconfig "$kubeconfig" patch "node/$name" --subresource=status --type=merge \
    -p "{\"status\": {\"capacity\": $gpus, \"allocatable\": $gpus}}" >/dev/null \
    || die "$cluster: advertising the real node's GPUs failed"
}

node_remove_kube_chains() { # what kube-proxy --cleanup leaves: the kubelet's KUBE-FIREWALL (its DROP
  # of non-loopback traffic to 127.0.0.0/8) and canaries. No other Kubernetes runs on a testbed
  # machine, so every KUBE- chain is the testbed's.
  local tool table chain
  for tool in iptables ip6tables; do
    command -v "$tool" >/dev/null || continue
    for table in filter nat mangle; do
      for chain in $("$tool" -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}'); do
        "$tool" -t "$table" -S 2>/dev/null | awk -v c="$chain" '$1 == "-A" && $2 !~ /^KUBE-/ && / -j / && $NF == c' \
          | while read -r rule; do eval "$tool -t $table ${rule/-A/-D}" 2>/dev/null || true; done
        "$tool" -t "$table" -F "$chain" 2>/dev/null || true
      done
      for chain in $("$tool" -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}'); do
        "$tool" -t "$table" -X "$chain" 2>/dev/null || true
      done
    done
  done
}

node_down() { # cluster bin_dir: stop the node and undo its side effects
  local cluster=$1 bin=$2 dir mount
  dir=$(node_dir "$cluster")
  [ -d "$dir" ] || return 0
  node_stop "$cluster" kubelet
  if [ -S "$(node_socket "$cluster")" ]; then # stop the pods' containers and sandboxes
    local task
    for task in $(ctr --address "$(node_socket "$cluster")" -n k8s.io tasks ls -q 2>/dev/null); do
      ctr --address "$(node_socket "$cluster")" -n k8s.io tasks kill -s KILL "$task" >/dev/null 2>&1 || true
    done
    sleep 1
  fi
  node_stop "$cluster" containerd
  if [ "$cluster" = pd ]; then
    node_stop "$cluster" kube-proxy
    [ -x "$bin/kube-proxy" ] && "$bin/kube-proxy" --cleanup >/dev/null 2>&1 || true
  fi
  node_remove_kube_chains
  for mount in $(awk -v d="$dir" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r); do
    umount -l "$mount" 2>/dev/null || true
  done
  for mount in $(awk -v d="$(node_run_dir "$cluster")" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r); do
    umount -l "$mount" 2>/dev/null || true
  done
  ip link del "$(node_bridge "$cluster")" 2>/dev/null || true
  node_cgroups "$cluster" rmdir
  rm -rf "$(node_run_dir "$cluster")" "$dir"
}
