#!/usr/bin/env bash
# Build the two Kubernetes images of deploy/kubernetes/images on this machine's Docker engine and
# check each as its pod runs it (no cluster needed): `make k8s-check`.
#   kernelmode/kernel-eg:latest              FROM the local kernelmode/kernel:latest (never rebuilt here)
#   kernelmode/enterprise-gateway:3.3.0      FROM kernelmode/base:bookworm (BASE_IMAGE=... to change)
# Then deploy/kubernetes/images/kernel/check_launcher.py and .../enterprise-gateway/check_gateway.py and
# check_pod_launch.py (a kernel started through EG's Kubernetes path against a stand-in API).
# pip in the builds trusts the host's CA bundle (copied into a temporary context as build-ca.crt).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
KERNEL_IMAGE=${KERNEL_IMAGE:-kernelmode/kernel:latest}
BASE_IMAGE=${BASE_IMAGE:-kernelmode/base:bookworm}
docker image inspect "$KERNEL_IMAGE" >/dev/null 2>&1 || { echo "$KERNEL_IMAGE missing: make docker-setup" >&2; exit 2; }
ca="${BUILD_CA:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}"
build() {  # build NAME DIR ARGS...
  local tag=$1 dir=$2; shift 2
  local ctx; ctx=$(mktemp -d /tmp/kernelmode-k8s-build.XXXXXX)
  cp -a "$dir"/. "$ctx"/
  if [ -f "$ca" ]; then cp "$ca" "$ctx/build-ca.crt"; fi
  echo "docker build $tag (log: /tmp/kernelmode-k8s-build.log)"
  if ! DOCKER_BUILDKIT=0 docker build --network host "$@" -t "$tag" "$ctx" >/tmp/kernelmode-k8s-build.log 2>&1; then
    tail -n 30 /tmp/kernelmode-k8s-build.log >&2; rm -rf "$ctx"; exit 1
  fi
  rm -rf "$ctx"
}
build kernelmode/kernel-eg:latest deploy/kubernetes/images/kernel --build-arg "KERNEL_IMAGE=$KERNEL_IMAGE"
build kernelmode/enterprise-gateway:3.3.0 deploy/kubernetes/images/enterprise-gateway --build-arg "BASE_IMAGE=$BASE_IMAGE"
"$VENV/bin/python" deploy/kubernetes/images/kernel/check_launcher.py kernelmode/kernel-eg:latest
"$VENV/bin/python" deploy/kubernetes/images/enterprise-gateway/check_gateway.py kernelmode/enterprise-gateway:3.3.0
"$VENV/bin/python" deploy/kubernetes/images/enterprise-gateway/check_pod_launch.py kernelmode/enterprise-gateway:3.3.0
