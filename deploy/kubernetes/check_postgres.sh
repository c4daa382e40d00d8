#!/bin/sh
# A hand check of base/postgres.yaml's assumptions, with this machine's Debian PostgreSQL (the
# official image is built from the same packages): run as root, no cluster needed.
#  1. PostgreSQL initialises and runs as a non-root user with no capabilities on a read-only root
#     filesystem, writing only PGDATA (a directory below the volume), /var/run/postgresql and /tmp;
#  2. SIGTERM (what the kubelet sends) is a "smart" shutdown: it waits while a client, as each
#     manager is, stays connected; hence the preStop `pg_ctl stop --mode=fast`, which returns at once.
set -eu
B=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1)
D=$(mktemp -d /tmp/check-postgres.XXXXXX)
trap 'rm -rf "$D"' EXIT
mkdir "$D/vol" && chown postgres:postgres "$D/vol" && chmod 755 "$D"
cat > "$D/run.sh" <<EOF
set -e
export PGDATA=/var/lib/postgresql/data/pgdata
$B/initdb -U kernelmode --auth-local=trust --auth-host=scram-sha-256 >/dev/null
$B/pg_ctl -l /tmp/pg.log -o "-c listen_addresses=127.0.0.1 -c max_connections=50 -c shared_buffers=128MB -p 55432" -w start >/dev/null
echo "1. started: non-root (uid \$(id -u)), no capabilities, read-only root, PGDATA below the volume"
(echo 'select 1;'; sleep 20) | psql -h /run/postgresql -p 55432 -U kernelmode -d postgres -qAt >/dev/null &
sleep 1
kill -TERM "\$(head -1 \$PGDATA/postmaster.pid)"
sleep 3
$B/pg_ctl status >/dev/null && echo "2. SIGTERM: still running 3 s later, a client connected (smart shutdown)"
$B/pg_ctl stop --mode=fast --wait --timeout=50 >/dev/null && echo "   pg_ctl stop --mode=fast: stopped"
if touch /probe 2>/dev/null; then echo "root filesystem writable: check broken"; exit 1; fi
EOF
runuser -u postgres -- bwrap --ro-bind / / --tmpfs /tmp --tmpfs /var/lib/postgresql \
  --bind "$D/vol" /var/lib/postgresql/data --tmpfs /run --dir /run/postgresql --dev /dev --proc /proc \
  --unshare-pid --unshare-ipc --cap-drop ALL bash -s < "$D/run.sh"
