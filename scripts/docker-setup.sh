#!/usr/bin/env bash
# Sets up what the Docker sandbox backend needs, only what is missing, and says what it does:
#   1. the engine (Debian's docker.io: dockerd, containerd, runc) when there is none;
#   2. a running daemon: if `docker info` does not answer, dockerd is started in the background
#      with no container network at all (--bridge=none --iptables=false: kernels run with
#      --network none, only the none and host networks exist), its log in $DOCKERD_LOG;
#   3. the base image $BASE_IMAGE (python:3.11-slim); when it is not here and cannot be pulled
#      (no registry reachable), a local substitute: Debian bookworm (python3 is 3.11) made by
#      debootstrap and imported as kernelmode/base:bookworm;
#   4. the kernel image $KERNEL_IMAGE (kernelmode/kernel:latest) from kernel-image/, skipped when
#      an image labelled with the hash of kernel-image/'s files (and the base's name) is there;
#   5. kernel.extra_requirements (of $CONFIG, default ./kernelmode.yaml, or the environment's
#      KERNELMODE_KERNEL__EXTRA_REQUIREMENTS): a layer on top of the kernel image
#      (scripts/kernel-extras.Dockerfile), built only when the list is not empty or changed; the
#      image without it stays tagged ${KERNEL_IMAGE%:*}:no-extras.
# Idempotent: when everything is there it only checks (a few seconds).
#
# Environment: BASE_IMAGE, KERNEL_IMAGE, DOCKERD_LOG, DOCKERD_TIMEOUT (s, 60), PULL_TIMEOUT
# (s, 120), DEBIAN_MIRROR, REBUILD=1 (build the kernel image even when it is up to date),
# BUILD_CA (a PEM bundle that pip in the image build trusts; default: the host's bundle).
set -euo pipefail

cd "$(dirname "$0")/.."
BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim}"
KERNEL_IMAGE="${KERNEL_IMAGE:-kernelmode/kernel:latest}"
FALLBACK_BASE="kernelmode/base:bookworm"
FALLBACK_SUITE="bookworm"  # Debian 12: its python3 is 3.11, as in python:3.11-slim
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/kernelmode-dockerd.log}"
DOCKERD_TIMEOUT="${DOCKERD_TIMEOUT:-60}"
PULL_TIMEOUT="${PULL_TIMEOUT:-120}"
HASH_LABEL="kernelmode.build-hash"
CONTEXT_DIR="kernel-image"

say() { echo "docker-setup: $*"; }
die() { echo "docker-setup: ERROR: $*" >&2; exit 1; }
now() { date +%s.%N; }
T_ALL=$(now)
T_STEP=$T_ALL
step_done() { say "  ($1 took $(awk -v a="$T_STEP" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}') s)"; T_STEP=$(now); }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 && SUDO="sudo"
fi
need_root() {
  [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ] || die "$1 needs root: run as root or install sudo"
}

engine_answers() { docker info >/dev/null 2>&1; }

apt_install() {  # apt_install PKG...: install Debian packages, never starting their services
  need_root "installing $*"
  command -v apt-get >/dev/null 2>&1 || die "please install $* (no apt-get on this machine)"
  export DEBIAN_FRONTEND=noninteractive
  local own_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then  # the packages must not start a dockerd of their own
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod 755 /usr/sbin/policy-rc.d
    own_policy=1
  fi
  say "  apt-get install $*"
  $SUDO apt-get update -qq
  local rc=0
  $SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null || rc=$?
  [ -z "$own_policy" ] || $SUDO rm -f /usr/sbin/policy-rc.d
  [ "$rc" -eq 0 ] || die "apt-get install $* failed"
}

# --- 1. the engine -------------------------------------------------------------------------
say "1/4 engine"
if ! command -v docker >/dev/null 2>&1; then
  say "  no docker client: installing Debian's docker.io"
  apt_install docker.io containerd runc
elif engine_answers; then
  say "  an engine answers already ($(docker version -f 'server {{.Server.Version}}' 2>/dev/null))"
elif command -v dockerd >/dev/null 2>&1; then
  say "  dockerd is installed ($(command -v dockerd))"
else
  say "  no engine: installing Debian's docker.io (dockerd, containerd, runc)"
  apt_install docker.io containerd runc
fi
step_done "engine"

# --- 2. the daemon -------------------------------------------------------------------------
say "2/4 daemon"
if engine_answers; then
  say "  running (docker info answers)"
  extra=$(docker network ls --format '{{.Name}}' 2>/dev/null | grep -vxE 'none|host' || true)
  if [ -n "$extra" ]; then
    say "  note: this engine was not started by this script and has networks beyond none/host:" \
        "$(echo "$extra" | tr '\n' ' ')(kernels use --network none all the same)"
  fi
else
  need_root "starting dockerd"
  command -v dockerd >/dev/null 2>&1 || die "no dockerd found after the install step"
  say "  starting dockerd --bridge=none --iptables=false (log: $DOCKERD_LOG)"
  $SUDO mkdir -p "$(dirname "$DOCKERD_LOG")"
  # setsid + nohup: the daemon outlives this script and the terminal or job that ran it.
  # shellcheck disable=SC2016
  $SUDO sh -c 'exec setsid nohup dockerd --bridge=none --iptables=false >>"$1" 2>&1 </dev/null' \
    sh "$DOCKERD_LOG" &
  dockerd_pid=$!
  deadline=$(( $(date +%s) + DOCKERD_TIMEOUT ))
  until engine_answers; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      tail -n 20 "$DOCKERD_LOG" >&2 || true
      die "dockerd did not answer within ${DOCKERD_TIMEOUT}s (log above, whole log: $DOCKERD_LOG)"
    fi
    if [ ! -d "/proc/$dockerd_pid" ]; then
      tail -n 20 "$DOCKERD_LOG" >&2 || true
      die "dockerd exited at start (log above, whole log: $DOCKERD_LOG)"
    fi
    sleep 0.5
  done
  say "  dockerd answers (pid $(cat /var/run/docker.pid 2>/dev/null || echo '?'))," \
      "networks: $(docker network ls --format '{{.Name}}' | tr '\n' ' ')"
fi
step_done "daemon"

# --- the kernel image's build hash (it decides whether steps 3 and 4 have anything to do) ---
build_hash() {
  # Every file of the build context (Dockerfile, requirements.txt, ...) and the base's name.
  { echo "base=$BASE_IMAGE"
    find "$CONTEXT_DIR" -type f ! -name '*.md' ! -name build-ca.crt ! -path '*/__pycache__/*' \
      -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-32
}
HASH=$(build_hash)
image_hash() { docker image inspect -f "{{index .Config.Labels \"$HASH_LABEL\"}}" "$1" 2>/dev/null || true; }
up_to_date=""
if [ "${REBUILD:-0}" != 1 ]; then
  if [ "$(image_hash "$KERNEL_IMAGE")" = "$HASH" ]; then
    up_to_date=1
  else
    other=$(docker images -q --filter "label=$HASH_LABEL=$HASH" | head -n1)
    if [ -n "$other" ]; then
      say "an image built from the same files exists ($other): tagging it $KERNEL_IMAGE"
      docker tag "$other" "$KERNEL_IMAGE"
      up_to_date=1
    fi
  fi
fi

# --- 3. the base image ---------------------------------------------------------------------
make_fallback_base() {
  command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap debian-archive-keyring
  need_root "debootstrap"
  local tmp rootfs
  tmp=$(mktemp -d /var/tmp/kernelmode-rootfs.XXXXXX)
  rootfs="$tmp/rootfs"
  # shellcheck disable=SC2064
  trap "$SUDO rm -rf '$tmp'" EXIT
  say "  debootstrap --variant=minbase --include=python3 $FALLBACK_SUITE ($DEBIAN_MIRROR)"
  if ! $SUDO debootstrap --variant=minbase --include=python3 "$FALLBACK_SUITE" "$rootfs" \
       "$DEBIAN_MIRROR" >"$tmp/debootstrap.log" 2>&1; then
    tail -n 20 "$tmp/debootstrap.log" >&2
    die "debootstrap failed (log above)"
  fi
  say "  security updates, then trimming the rootfs"
  $SUDO tee "$rootfs/etc/apt/sources.list" >/dev/null <<EOF
deb $DEBIAN_MIRROR $FALLBACK_SUITE main
deb $DEBIAN_MIRROR $FALLBACK_SUITE-updates main
deb ${DEBIAN_MIRROR%/debian}/debian-security $FALLBACK_SUITE-security main
EOF
  # As Debian's own container images: apt installs in image builds start no service, keep no
  # package cache, and leave documentation, man pages and translations out.
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$rootfs/usr/sbin/policy-rc.d" >/dev/null
  $SUDO chmod 755 "$rootfs/usr/sbin/policy-rc.d"
  $SUDO tee "$rootfs/etc/apt/apt.conf.d/docker-clean" >/dev/null <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
APT::Install-Recommends "false";
EOF
  $SUDO tee "$rootfs/etc/dpkg/dpkg.cfg.d/docker-nodoc" >/dev/null <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
EOF
  if ! $SUDO chroot "$rootfs" /bin/sh -c \
      'export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && apt-get -y -qq upgrade' \
      >"$tmp/upgrade.log" 2>&1; then
    tail -n 20 "$tmp/upgrade.log" >&2
    die "apt-get upgrade in the new rootfs failed (log above)"
  fi
  $SUDO chroot "$rootfs" apt-get clean
  $SUDO find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  $SUDO find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
  $SUDO rm -rf "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* \
    "$rootfs"/usr/share/lintian/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* \
    "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/lib/dpkg/*-old "$rootfs"/var/log/* \
    "$rootfs"/tmp/* "$rootfs"/var/tmp/*
  # The engine provides these at run time; the host's must not be baked in.
  $SUDO rm -f "$rootfs/etc/resolv.conf" "$rootfs/etc/hostname"
  : | $SUDO tee "$rootfs/etc/hosts" >/dev/null
  say "  rootfs: $($SUDO du -sh "$rootfs" | cut -f1); docker import as $FALLBACK_BASE"
  $SUDO tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["bash"]' \
    --change "LABEL app=kernelmode kernelmode.base=debootstrap-$FALLBACK_SUITE-minbase" \
    --message "debootstrap --variant=minbase --include=python3 $FALLBACK_SUITE (kernelmode docker-setup)" \
    - "$FALLBACK_BASE" >/dev/null
  docker tag "$FALLBACK_BASE" "${FALLBACK_BASE%%:*}:latest"
  $SUDO rm -rf "$tmp"
  trap - EXIT
}

say "3/4 base image"
BUILD_BASE="$BASE_IMAGE"
if [ -n "$up_to_date" ]; then
  say "  not needed: $KERNEL_IMAGE is up to date"
elif docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  say "  $BASE_IMAGE is here"
else
  say "  $BASE_IMAGE is not here: docker pull (at most ${PULL_TIMEOUT}s)"
  if timeout "$PULL_TIMEOUT" docker pull -q "$BASE_IMAGE" >/dev/null 2>"/tmp/kernelmode-pull.$$"; then
    say "  pulled $BASE_IMAGE"
  else
    say "  pull failed: $(tail -n1 "/tmp/kernelmode-pull.$$" | cut -c1-200)"
    BUILD_BASE="$FALLBACK_BASE"
    if docker image inspect "$FALLBACK_BASE" >/dev/null 2>&1; then
      say "  using the local substitute $FALLBACK_BASE (made earlier)"
    else
      say "  making a local substitute: Debian $FALLBACK_SUITE + python3 (3.11) -> $FALLBACK_BASE"
      make_fallback_base
    fi
  fi
  rm -f "/tmp/kernelmode-pull.$$"
fi
step_done "base image"

# --- 4. the kernel image -------------------------------------------------------------------
say "4/4 kernel image $KERNEL_IMAGE"
if [ -n "$up_to_date" ]; then
  say "  up to date ($HASH_LABEL=$HASH): not rebuilt (REBUILD=1 forces it)"
else
  # The build context is kernel-image/ plus, in a temporary copy, the CA bundle the host
  # trusts (build-ca.crt): pip in the build stage then trusts what the host trusts (a TLS
  # proxy's CA, say). Only the build stage sees it: it is not in the final image.
  ctx=$(mktemp -d /tmp/kernelmode-build.XXXXXX)
  trap 'rm -rf "$ctx"' EXIT
  cp -a "$CONTEXT_DIR"/. "$ctx"/
  ca="${BUILD_CA:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}"
  if [ -n "$ca" ] && [ -f "$ca" ]; then
    cp "$ca" "$ctx/build-ca.crt"
    say "  pip in the build trusts $ca"
  fi
  old_id=$(docker image inspect -f '{{.Id}}' "$KERNEL_IMAGE" 2>/dev/null || true)
  say "  docker build --network host --build-arg BASE_IMAGE=$BUILD_BASE (log: /tmp/kernelmode-build.log)"
  # The classic builder: it needs no buildx plugin and takes --network host as it is.
  if ! DOCKER_BUILDKIT=0 docker build --network host --build-arg "BASE_IMAGE=$BUILD_BASE" \
       --label "$HASH_LABEL=$HASH" --label "kernelmode.base-image=$BUILD_BASE" \
       -t "$KERNEL_IMAGE" "$ctx" >/tmp/kernelmode-build.log 2>&1; then
    tail -n 30 /tmp/kernelmode-build.log >&2
    die "docker build failed (log above, whole log: /tmp/kernelmode-build.log)"
  fi
  rm -rf "$ctx"
  trap - EXIT
  # The image this one replaces, unless a container still uses it (then rmi refuses).
  if [ -n "$old_id" ] && [ "$old_id" != "$(docker image inspect -f '{{.Id}}' "$KERNEL_IMAGE")" ]; then
    if docker rmi "$old_id" >/dev/null 2>&1; then say "  removed the previous image ${old_id:7:12}"; fi
  fi
  say "  built $KERNEL_IMAGE ($(docker image inspect -f '{{.Size}}' "$KERNEL_IMAGE" |
      awk '{printf "%.0f MB", $1/1e6}'))"
fi
step_done "kernel image"

# --- 5. kernel.extra_requirements ------------------------------------------------------------
CONFIG="${CONFIG:-$([ -f kernelmode.yaml ] && echo kernelmode.yaml || true)}"
kernel_setting() {  # kernel_setting EXPR: a value of the settings (config file + environment)
  .venv/bin/python -c 'import sys; from kernelmode.config import load_settings
s = load_settings(sys.argv[1] or None); print(eval(sys.argv[2], {"s": s}) or "")' "$CONFIG" "$1"
}
EXTRAS_LABEL="kernelmode.extras-hash"
extras_label() { docker image inspect -f "{{index .Config.Labels \"$EXTRAS_LABEL\"}}" "$1" 2>/dev/null || true; }
EXTRA_REQUIREMENTS=""
if [ -x .venv/bin/python ]; then
  EXTRA_REQUIREMENTS=$(kernel_setting '"\n".join(s.kernel.extra_requirements)') ||
    die "cannot read kernel.extra_requirements (${CONFIG:-environment})"
fi
if [ -n "$EXTRA_REQUIREMENTS" ] || [ -n "$(extras_label "$KERNEL_IMAGE")" ]; then
  plain="${KERNEL_IMAGE%:*}:no-extras"
  [ -n "$(extras_label "$KERNEL_IMAGE")" ] || docker tag "$KERNEL_IMAGE" "$plain"
  want=""
  if [ -n "$EXTRA_REQUIREMENTS" ]; then
    want=$(printf '%s\n%s\n' "$(docker image inspect -f '{{.Id}}' "$plain")" "$EXTRA_REQUIREMENTS" |
           sha256sum | cut -c1-32)
  fi
  if [ "$(extras_label "$KERNEL_IMAGE")" = "$want" ]; then
    say "kernel.extra_requirements: up to date"
  elif [ -z "$want" ]; then
    docker tag "$plain" "$KERNEL_IMAGE"
    say "kernel.extra_requirements is empty: $KERNEL_IMAGE is the plain image again"
  else
    say "kernel.extra_requirements: $(echo "$EXTRA_REQUIREMENTS" | tr '\n' ' ')(log: /tmp/kernelmode-extras.log)"
    ectx=$(mktemp -d /tmp/kernelmode-extras.XXXXXX)
    cp "$CONTEXT_DIR/requirements.txt" "$ectx/"
    printf '%s\n' "$EXTRA_REQUIREMENTS" > "$ectx/extra-requirements.txt"
    ca="${BUILD_CA:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}"
    if [ -n "$ca" ] && [ -f "$ca" ]; then cp "$ca" "$ectx/build-ca.crt"; fi
    index=$(kernel_setting 's.packages.index_url') || index=""
    if ! DOCKER_BUILDKIT=0 docker build --network host -f scripts/kernel-extras.Dockerfile \
         --build-arg "KERNEL_IMAGE=$plain" ${index:+--build-arg "PIP_INDEX_URL=$index"} \
         --label "$EXTRAS_LABEL=$want" -t "$KERNEL_IMAGE" "$ectx" >/tmp/kernelmode-extras.log 2>&1; then
      rm -rf "$ectx"
      tail -n 30 /tmp/kernelmode-extras.log >&2
      die "the kernel.extra_requirements layer failed (log above; $KERNEL_IMAGE is unchanged)"
    fi
    rm -rf "$ectx"
  fi
  step_done "extra requirements"
fi

say "done in $(awk -v a="$T_ALL" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}') s: $KERNEL_IMAGE" \
    "($(docker image inspect -f '{{.Id}}' "$KERNEL_IMAGE" | cut -c8-19))"
