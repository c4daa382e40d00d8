#!/usr/bin/env bash
# The Enterprise Gateway rig's setup (tests/cluster, `make setup-cluster`): idempotent, cached.
# - system packages: openssh-server, nftables, iproute2 (install-system-deps.sh --test);
# - EG 3.3.0 in its own virtualenv .eg-venv (tests/cluster/eg-requirements.txt, exact pins);
# - EG's kernel launcher, which is not in EG's wheel but is in its sdist, extracted into
#   .eg-venv/share/eg-launchers/launch_ipykernel.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EG_VERSION=3.3.0
VENV=.eg-venv
REQS=tests/cluster/eg-requirements.txt
LAUNCHER=$VENV/share/eg-launchers/launch_ipykernel.py

bash scripts/install-system-deps.sh --test

if [ ! -f "$VENV/.stamp" ] || [ "$REQS" -nt "$VENV/.stamp" ]; then
  test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$REQS"
  touch "$VENV/.stamp"
fi

if [ ! -f "$LAUNCHER" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary :all: \
    "jupyter_enterprise_gateway==$EG_VERSION" -d "$tmp"
  tar -xzf "$tmp/jupyter_enterprise_gateway-$EG_VERSION.tar.gz" -C "$tmp" \
    "jupyter_enterprise_gateway-$EG_VERSION/etc/kernel-launchers/python/scripts/launch_ipykernel.py"
  mkdir -p "$(dirname "$LAUNCHER")"
  install -m 0644 "$tmp/jupyter_enterprise_gateway-$EG_VERSION/etc/kernel-launchers/python/scripts/launch_ipykernel.py" "$LAUNCHER"
fi
