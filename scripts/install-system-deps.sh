#!/usr/bin/env bash
# Installs the system packages kernelmode needs, only when missing: bubblewrap (the sandbox),
# libseccomp (its filter), Debian's python3 + venv (the kernel environment), and with --test
# chromium (the JupyterLab browser test) and PostgreSQL's server (the store tests). Debian/Ubuntu
# (apt); elsewhere it says what to install by hand.
set -euo pipefail

need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
# libseccomp compiles the kernels' seccomp filter (kernelmode/sandbox/seccomp.py, via pyseccomp).
ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || need+=(libseccomp2)
if ! /usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  need+=(python3 python3-venv)
fi
# With --test (`make setup`/`make test`, not `make run`): Debian's chromium, which the JupyterLab
# browser test drives (Playwright's own browsers are not used).
if [ "${1:-}" = "--test" ]; then
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  # The Enterprise Gateway rig (tests/cluster): an sshd per node namespace, nftables per node,
  # ip/bridge (iproute2).
  command -v /usr/sbin/sshd >/dev/null 2>&1 || need+=(openssh-server)
  command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
  command -v nft >/dev/null 2>&1 || command -v /usr/sbin/nft >/dev/null 2>&1 || need+=(nftables)
  command -v ip >/dev/null 2>&1 || command -v /usr/sbin/ip >/dev/null 2>&1 || need+=(iproute2)
  # PostgreSQL's server programs: the tests start their own throwaway cluster (tests/support/postgres.py).
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || need+=(postgresql)
fi
[ ${#need[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  echo "kernelmode: please install: ${need[*]} (no apt-get on this machine)" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "kernelmode: run as root or install sudo to install ${need[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "kernelmode: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
if [[ " ${need[*]} " == *" postgresql "* ]]; then
  # Debian's package would create and start a "main" cluster as a service: the tests need none.
  $sudo mkdir -p /etc/postgresql-common/createcluster.d
  echo "create_main_cluster = false" | $sudo tee /etc/postgresql-common/createcluster.d/kernelmode.conf >/dev/null
fi
$sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
