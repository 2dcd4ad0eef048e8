#!/usr/bin/env bash
# Builds the project's container images without a daemon (buildah, from Debian's packages) into
# a cache, once per content, as build-binaries.sh does for the Kubernetes binaries:
#   ghcr.io/prfaas/prfaas:VERSION             the product: operator + router (images/prfaas)
#   ghcr.io/prfaas/prfaas-engine-sim:VERSION  the fake SGLang engine (images/engine-sim)
#   localhost/prfaas-testbed/pause:3.10       containerd's pod sandbox image (images/pause)
# VERSION is the Helm chart's appVersion. Each image is left in buildah's local storage
# (/var/lib/containers/storage, podman sees it too) and exported as an OCI archive into the
# cache directory, for `ctr -n k8s.io images import FILE` (images.txt there lists FILE IMAGE).
# An image is rebuilt only when a hash of its inputs changed: its Dockerfile, the files it
# copies (the lock files and pyproject files among them), its base image, version and revision.
# The cache directory is this checkout's own (~/.cache/prfaas/images/CHECKOUT-PATHHASH): two
# checkouts on one machine share the storage's tags but never an archive. When the other one
# has re-tagged an image in storage since, it is put back from this checkout's archive.
#
# No registry can be pulled from here: when local storage has no
# docker.io/library/python:3.11-slim-bookworm, an equivalent is made with debootstrap and given
# that name, so the Dockerfiles' FROM is the same as with `docker build` (a real one wins).
# Needs root; installs buildah, podman, runc and debootstrap from Debian when missing.
# Environment: PRFAAS_IMAGE_DIR (the cache), PRFAAS_STORAGE_DRIVER (overlay, else vfs),
# PRFAAS_DEBIAN_MIRROR. Prints the cache directory on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGES_ROOT=${XDG_CACHE_HOME:-$HOME/.cache}/prfaas/images
CACHE=${PRFAAS_IMAGE_DIR:-$IMAGES_ROOT/$(basename "$PWD")-$(printf %s "$PWD" | sha256sum | cut -c1-8)}
BASE=docker.io/library/python:3.11-slim-bookworm
REGISTRY=ghcr.io/prfaas
PAUSE_IMAGE=localhost/prfaas-testbed/pause:3.10
MIRROR=${PRFAAS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
log() { echo "[build-images] $*" >&2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

if [ "$(id -u)" -ne 0 ]; then
  log "needs root (buildah builds as root here; rootless storage is not set up)"
  exit 1
fi
VERSION=$(sed -n 's/^appVersion:[[:space:]]*"\{0,1\}\([^"[:space:]]*\)"\{0,1\}[[:space:]]*$/\1/p' \
  charts/prfaas-operator/Chart.yaml)
[ -n "$VERSION" ] || { log "no appVersion in charts/prfaas-operator/Chart.yaml"; exit 1; }
mkdir -p "$CACHE" "$IMAGES_ROOT"
exec 9>"$IMAGES_ROOT/.lock"
flock 9  # one build at a time on this machine: checkouts share the storage's tags

# ---- tools --------------------------------------------------------------------------------
missing=()
for tool in buildah podman runc debootstrap; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
GO=$(command -v go || true)
[ -n "$GO" ] || [ ! -x /usr/local/go/bin/go ] || GO=/usr/local/go/bin/go
[ -n "$GO" ] || missing+=(golang-go)
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-cache show "${missing[@]}" >/dev/null 2>&1; then
    log "apt-get update"
    apt-get update -qq
  fi
  log "installing: ${missing[*]}"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  GO=${GO:-$(command -v go)}
fi

# Running containers (podman run, e.g. the image tests): runc (crun cannot run here: cgroups in
# hybrid mode), and ulimits root may set without CAP_SYS_RESOURCE. Our own copy always; the
# system-wide one only when there is none.
cat >"$CACHE/containers.conf" <<'EOF'
# Written by scripts/build-images.sh (use with CONTAINERS_CONF=THIS_FILE).
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
EOF
if [ ! -e /etc/containers/containers.conf ]; then
  mkdir -p /etc/containers
  cp "$CACHE/containers.conf" /etc/containers/containers.conf
  log "wrote /etc/containers/containers.conf (runtime runc, default ulimits)"
fi

DRIVER=${PRFAAS_STORAGE_DRIVER:-}
if [ -z "$DRIVER" ]; then
  DRIVER=vfs
  buildah --storage-driver overlay images >/dev/null 2>&1 && DRIVER=overlay
fi
echo "$DRIVER" >"$CACHE/storage-driver"
B=(buildah --storage-driver "$DRIVER")
image_id() { "${B[@]}" inspect --type image --format '{{.FromImageID}}' "$1" 2>/dev/null || true; }
image_size() { "${B[@]}" images --format '{{.Size}}' "$1" 2>/dev/null | head -1; }

# ---- the base image -------------------------------------------------------------------------
make_base() {
  local work rootfs ctr mnt started
  started=$(now)
  work=$(mktemp -d /var/tmp/prfaas-base.XXXXXX)
  trap 'rm -rf "$work"; trap - RETURN' RETURN
  rootfs=$work/rootfs
  log "no $BASE here: making one with debootstrap (bookworm, python3; ~1 min)"
  debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
    bookworm "$rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; return 1; }
  # As the official image: pip may install (no EXTERNALLY-MANAGED), `python` is python3.
  rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
  ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
  ln -sf /usr/bin/pip3 "$rootfs/usr/local/bin/pip"
  # As debian:bookworm-slim: no docs (but copyrights), man pages, locales or apt lists, now or
  # for packages installed later.
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
EOF
  find "$rootfs/usr/share/doc" -type f ! -name copyright -delete
  find "$rootfs/usr/share/doc" -type d -empty -delete
  rm -rf "$rootfs"/usr/share/{man,groff,info,lintian,locale}/* "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/var/cache/apt/* "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/log/* \
    "$rootfs"/tmp/* "$rootfs"/var/tmp/*
  : >"$rootfs/etc/resolv.conf"  # the runtime provides it; not this machine's
  echo localhost >"$rootfs/etc/hostname"
  ctr=$("${B[@]}" from scratch)
  mnt=$("${B[@]}" mount "$ctr")
  cp -a "$rootfs/." "$mnt/"
  "${B[@]}" umount "$ctr" >/dev/null
  "${B[@]}" config --os linux --arch "$(dpkg --print-architecture)" \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd '["python3"]' --label io.prfaas.base=debootstrap \
    --label "org.opencontainers.image.description=Debian bookworm + python3 (debootstrap), a stand-in for $BASE" \
    "$ctr"
  "${B[@]}" commit --quiet --rm "$ctr" "$BASE" >/dev/null
  log "base $BASE: made in $(since "$started") s, $(image_size "$BASE")"
}
if [ -z "$(image_id "$BASE")" ]; then make_base; fi
case "$("${B[@]}" inspect --type image --format '{{.OCIv1.Config.Labels}}' "$BASE" 2>/dev/null)" in
  *io.prfaas.base:debootstrap*) log "base $BASE: ours (debootstrap), $(image_size "$BASE")" ;;
  *) log "base $BASE: a real one, used as it is" ;;
esac

# ---- inputs and builds ----------------------------------------------------------------------
# Files under PATHS that a build context holds (tracked or not ignored), one per line.
context_files() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -co --exclude-standard -- "$@" | sort -u
  else
    find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path '*.egg-info/*' | sort
  fi
}
# The hash of a build's inputs: the files' paths, modes and contents, plus EXTRA lines.
inputs_hash() {  # EXTRA PATHS...
  local extra=$1; shift
  {
    printf '%s\n' "$extra"
    context_files "$@" | while IFS= read -r f; do
      [ -f "$f" ] || continue  # deleted, not yet staged
      printf '%s %s %s\n' "$f" "$(stat -c %a "$f")" "$(sha256sum <"$f" | cut -c1-64)"
    done
  } | sha256sum | cut -c1-64
}
# The commit the inputs come from, with -dirty when they differ from it.
revision() {
  git rev-parse --is-inside-work-tree >/dev/null 2>&1 || { echo unknown; return; }
  local commit
  commit=$(git log -1 --format=%H -- "$@")
  [ -n "$commit" ] || commit=$(git rev-parse HEAD)
  if [ -n "$(git status --porcelain -- "$@")" ]; then commit+=-dirty; fi
  echo "$commit"
}

# Mounted into every RUN, never committed: the host's CA bundle (PyPI is reached through a
# TLS-intercepting proxy here) and a pip.conf that points pip at it and at the host's index.
PIPCONF=$CACHE/pip.conf
{
  echo "[global]"
  [ ! -f /etc/ssl/certs/ca-certificates.crt ] || echo "cert = /etc/ssl/certs/ca-certificates.crt"
  [ -z "${PIP_INDEX_URL:-}" ] || echo "index-url = $PIP_INDEX_URL"
  [ -z "${PIP_EXTRA_INDEX_URL:-}" ] || echo "extra-index-url = $PIP_EXTRA_INDEX_URL"
  [ -z "${PIP_TRUSTED_HOST:-}" ] || echo "trusted-host = $PIP_TRUSTED_HOST"
  echo "timeout = ${PIP_DEFAULT_TIMEOUT:-60}"
} >"$PIPCONF"
MOUNTS=(-v "$PIPCONF:/etc/pip.conf:ro")
[ ! -f /etc/ssl/certs/ca-certificates.crt ] \
  || MOUNTS+=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)

: >"$CACHE/images.txt.new"
# build NAME IMAGE DOCKERFILE CONTEXT EXTRA_HASH_LINE INPUT_PATHS... -- BUILD_ARGS...
build() {
  local name=$1 image=$2 dockerfile=$3 context=$4 extra=$5
  shift 5
  local paths=() args=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do paths+=("$1"); shift; done
  [ $# -eq 0 ] || shift
  args=("$@")
  local archive="$CACHE/${name}_${image##*:}.oci.tar" stamp="$CACHE/$name.inputs"
  local hash started
  hash=$(inputs_hash "$extra ${args[*]}" "${paths[@]}")
  local want
  want=$(cat "$CACHE/$name.id" 2>/dev/null || true)
  if [ -f "$archive" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ] && [ -n "$want" ] \
    && [ "$(image_id "$image")" != "$want" ]; then
    # another checkout re-tagged it: ours comes back from our archive (its layers are in storage)
    local restored
    restored=$("${B[@]}" pull --quiet "oci-archive:$archive" 2>/dev/null | tail -1 || true)
    if [ "$restored" = "$want" ]; then
      "${B[@]}" tag "$restored" "$image"
      log "$image: restored from this checkout's archive"
    fi
  fi
  if [ -f "$archive" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ] \
    && [ "$(image_id "$image")" = "$want" ]; then
    log "$image: up to date ($(image_size "$image"), archive $(du -h "$archive" | cut -f1))"
  else
    started=$(now)
    log "$image: building"
    "${B[@]}" bud --quiet --isolation chroot --layers -f "$dockerfile" "${MOUNTS[@]}" \
      "${args[@]}" -t "$image" "$context" >"$CACHE/$name.build.log" 2>&1 \
      || { tail -30 "$CACHE/$name.build.log" >&2; log "$image: build failed (log: $CACHE/$name.build.log)"; return 1; }
    local built
    built=$(since "$started")
    rm -f "$archive" "$archive.tmp"
    "${B[@]}" push --quiet "$image" "oci-archive:$archive.tmp:$image" >/dev/null
    mv "$archive.tmp" "$archive"
    image_id "$image" >"$CACHE/$name.id"
    echo "$hash" >"$stamp"
    log "$image: built in $built s (exported in $(since "$started") s), $(image_size "$image"), archive $(du -h "$archive" | cut -f1)"
    echo "$(date -u +%FT%TZ) $name built_s=$built size=$(image_size "$image")" >>"$CACHE/timings.log"
  fi
  echo "$archive $image" >>"$CACHE/images.txt.new"
}

PRODUCT=$REGISTRY/prfaas:$VERSION
ENGINE_SIM=$REGISTRY/prfaas-engine-sim:$VERSION
product_paths=(images/prfaas/Dockerfile .dockerignore locks/build.txt locks/product.txt pyproject.toml core operator router)
build prfaas "$PRODUCT" images/prfaas/Dockerfile . "base=$(image_id "$BASE") revision=$(revision "${product_paths[@]}")" \
  "${product_paths[@]}" -- \
  --build-arg "BASE=$BASE" --build-arg "VERSION=$VERSION" \
  --build-arg "REVISION=$(revision "${product_paths[@]}")"
sim_paths=(images/engine-sim/Dockerfile .dockerignore locks/build.txt engine-sim/pyproject.toml engine-sim/prfaas_engine_sim engine-sim/sglang)
build engine-sim "$ENGINE_SIM" images/engine-sim/Dockerfile . "base=$(image_id "$PRODUCT") revision=$(revision "${sim_paths[@]}")" \
  "${sim_paths[@]}" -- \
  --build-arg "PRFAAS_IMAGE=$PRODUCT" --build-arg "VERSION=$VERSION" \
  --build-arg "REVISION=$(revision "${sim_paths[@]}")"

# The pause binary is built here (static Go), into a context of its own in the cache.
pause_context=$CACHE/pause-context
mkdir -p "$pause_context"
cp images/pause/Dockerfile "$pause_context/Dockerfile"
go_version=$("$GO" env GOVERSION)
pause_hash=$(inputs_hash "$go_version" images/pause)
if [ "$(cat "$pause_context/pause.inputs" 2>/dev/null)" != "$pause_hash" ] || [ ! -x "$pause_context/pause" ]; then
  (cd images/pause && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS='' \
    "$GO" build -trimpath -ldflags "-s -w" -o "$pause_context/pause" pause.go)
  echo "$pause_hash" >"$pause_context/pause.inputs"
fi
build pause "$PAUSE_IMAGE" "$pause_context/Dockerfile" "$pause_context" "go=$go_version" images/pause -- \
  --build-arg VERSION=3.10

mv "$CACHE/images.txt.new" "$CACHE/images.txt"
echo "$CACHE"
