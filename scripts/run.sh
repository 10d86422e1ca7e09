#!/usr/bin/env bash
# Runs the service. When MONGODB_URI is unset, installs (if needed) and starts a local
# SecantusDB daemon keeping its data under ./data, then the service against it; the
# daemon stops when the service does. Every setting of the service can be passed as an
# environment variable or as flags after the script name (see --help).
#
#   DB_PORT   port of the local daemon (default 27017)
set -euo pipefail
cd "$(dirname "$0")/.."

daemon_pid=""
cleanup() {
  if [[ -n "$daemon_pid" ]]; then
    kill "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT INT TERM

if [[ -z "${MONGODB_URI:-}" ]]; then
  secantusd=$(scripts/install-secantus.sh | tail -n 1)
  port="${DB_PORT:-27017}"
  mkdir -p data
  echo "starting SecantusDB on 127.0.0.1:$port with data in ./data" >&2
  "$secantusd" --host 127.0.0.1 --port "$port" --storage-path ./data --sync-on-commit --log-level WARNING &
  daemon_pid=$!
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then break; fi
    sleep 0.1
  done
  export MONGODB_URI="mongodb://127.0.0.1:$port/?directConnection=true"
fi

cargo build --release --bin transfer-service
set +e
./target/release/transfer-service "$@" &
service_pid=$!
# Ctrl-C or SIGTERM: let the service shut down gracefully, then stop the daemon.
trap 'kill -TERM "$service_pid" 2>/dev/null' INT TERM
status=0
while kill -0 "$service_pid" 2>/dev/null; do
  wait "$service_pid"
  status=$?
done
exit "$status"
