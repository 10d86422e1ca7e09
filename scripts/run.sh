#!/usr/bin/env bash
# Runs the service. When MONGODB_URI is unset, installs (if needed) and starts a local
# SecantusDB daemon keeping its data under ./data, then the service against it; the
# daemon stops when the service does. Every setting of the service can be passed as an
# environment variable or as flags after the script name (see --help).
#
#   DB_PORT            port of the local daemon (default 27017)
#   LOCAL_DEPLOYMENTS  names of several local deployments to try them out, for example
#                      "eu us cn": one daemon each, on DB_PORT, DB_PORT+1, ..., with its
#                      data under ./data-deployments/<name>, and DEPLOYMENTS set to them (unless
#                      DEPLOYMENTS or MONGODB_URI is set already)
set -euo pipefail
cd "$(dirname "$0")/.."

daemon_pids=()
cleanup() {
  for pid in "${daemon_pids[@]}"; do
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT INT TERM

# start_daemon PORT FOLDER: a SecantusDB daemon, waited for until it listens.
start_daemon() {
  local port="$1" folder="$2"
  mkdir -p "$folder"
  echo "starting SecantusDB on 127.0.0.1:$port with data in $folder" >&2
  "$secantusd" --host 127.0.0.1 --port "$port" --storage-path "$folder" --sync-on-commit --log-level WARNING &
  daemon_pids+=($!)
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return; fi
    sleep 0.1
  done
  echo "SecantusDB did not start on port $port" >&2
  exit 1
}

if [[ -z "${MONGODB_URI:-}" && -z "${DEPLOYMENTS:-}" ]]; then
  secantusd=$(scripts/install-secantus.sh | tail -n 1)
  port="${DB_PORT:-27017}"
  if [[ -n "${LOCAL_DEPLOYMENTS:-}" ]]; then
    deployments=""
    for name in $LOCAL_DEPLOYMENTS; do
      start_daemon "$port" "./data-deployments/$name"
      deployments+="${deployments:+,}$name=mongodb://127.0.0.1:$port/?directConnection=true"
      port=$((port + 1))
    done
    export DEPLOYMENTS="$deployments"
    echo "DEPLOYMENTS=$DEPLOYMENTS" >&2
  else
    start_daemon "$port" ./data
    export MONGODB_URI="mongodb://127.0.0.1:$port/?directConnection=true"
  fi
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
