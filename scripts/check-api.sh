#!/usr/bin/env bash
# Checks the HTTP API as its clients meet it, against a running instance:
#
#   1. builds the service and starts it on a free port with a fresh database, on a
#      SecantusDB daemon of its own (or on MONGODB_URI when set);
#   2. lints openapi/openapi.json with Redocly (rules: redocly.yaml);
#   3. loads Swagger UI (/docs) in headless Chromium and checks it lists every operation;
#      and follows GET /events/stream with a browser's EventSource there, from another
#      origin (a second instance of the service allows it through CORS);
#   4. generates a Python client from openapi/openapi.json and runs
#      scripts/client_smoke.py with it against the service;
#   5. starts a third instance with an admin key in API_KEYS and walks tenants and API
#      keys with that Python client (scripts/client_tenants.py), and with a TypeScript
#      client typed from the document (scripts/ts-client: openapi-typescript's types,
#      openapi-fetch), which must pass `tsc --strict` before it runs;
#   6. fuzzes the service from its own /openapi.json with Schemathesis: no 5xx, and every
#      status, content type, header and body as documented.
#
# On a fresh Debian machine it installs what it needs: apt packages (chromium, curl,
# python3-venv, nodejs and npm when missing) and pinned npm and PyPI packages under
# ~/.cache/transfer-service (scripts/ts-client/package-lock.json with `npm ci`), so that
# later runs are fast. Everything it starts is stopped
# on exit. CI runs it after scripts/test.sh.
#
#   MONGODB_URI                 use this server instead of a local SecantusDB daemon
#   CHECK_API_MAX_EXAMPLES      Schemathesis test cases per operation (default 100)
#   CARGO_TARGET_DIR            respected, like cargo does
set -euo pipefail
cd "$(dirname "$0")/.."

redocly_version="1.34.20"
python_requirements="scripts/check-api-requirements.txt"
ts_client="scripts/ts-client"
max_examples="${CHECK_API_MAX_EXAMPLES:-100}"

cache="${XDG_CACHE_HOME:-$HOME/.cache}/transfer-service"
work=$(mktemp -d "${TMPDIR:-/tmp}/check-api.XXXXXX")
daemon_pid=""
service_pid=""
browser_service_pid=""
keys_service_pid=""
page_server_pid=""

stop() {
  local pid=$1
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  stop "$service_pid"
  stop "$browser_service_pid"
  stop "$keys_service_pid"
  stop "$page_server_pid"
  stop "$daemon_pid"
  if [[ $status -ne 0 ]]; then
    for log in service keys-service; do
      [[ -s "$work/$log.log" ]] || continue
      echo "-- last lines of $log.log:" >&2
      tail -n 40 "$work/$log.log" >&2
    done
  fi
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fail() {
  echo "check-api: $*" >&2
  exit 1
}

apt_updated=""
apt_install() {
  local sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  echo "installing $* (apt-get)" >&2
  if [[ -z "$apt_updated" ]]; then
    $sudo apt-get update -qq >&2
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >&2
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits up to 60 s for the instance at base URL $1, process $2, to answer /ready.
wait_ready() {
  local base=$1 pid=$2
  for _ in $(seq 1 600); do
    curl -fsS -o /dev/null "$base/ready" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || fail "the instance on $base stopped"
    sleep 0.1
  done
  fail "the instance on $base was not ready within 60 s"
}

echo "== tools"
missing=()
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
# venv needs ensurepip, which Debian ships separately.
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi
if [[ ${#missing[@]} -gt 0 ]]; then apt_install "${missing[@]}"; fi

# Redocly CLI, pinned; 1.34 runs on Debian's Node 18 as well as on newer ones.
redocly="$cache/npm/node_modules/.bin/redocly"
if [[ ! -x "$redocly" ]] || [[ "$("$redocly" --version 2>/dev/null)" != "$redocly_version" ]]; then
  echo "installing @redocly/cli@$redocly_version (npm)" >&2
  npm install --prefix "$cache/npm" --no-audit --no-fund --loglevel=error \
    "@redocly/cli@$redocly_version" >&2
fi
export REDOCLY_TELEMETRY=off REDOCLY_SUPPRESS_UPDATE_NOTICE=true

# openapi-python-client and Schemathesis, every package pinned, in a venv of their own,
# rebuilt whenever the pins change.
venv="$cache/venv-api"
pins=$(sha256sum "$python_requirements" | cut -d ' ' -f 1)
if [[ ! -x "$venv/bin/python" ]] || [[ "$(cat "$venv/.pins" 2>/dev/null)" != "$pins" ]]; then
  echo "installing $python_requirements (pip)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$python_requirements" >&2
  echo "$pins" >"$venv/.pins"
fi

# openapi-typescript, openapi-fetch and TypeScript, every package pinned in the committed
# lockfile, installed with `npm ci` into a folder of their own, again whenever the
# lockfile changes. Every package must come from the npm registry's ordinary tarballs
# with a sha512 integrity: a lockfile naming anything else (another host, a git URL, a
# local path) fails here, before npm fetches anything.
python3 - "$ts_client/package-lock.json" <<'EOF'
import json, sys
packages = json.load(open(sys.argv[1]))["packages"]
bad = []
for path, package in packages.items():
    if path == "":
        continue
    name = path.rsplit("node_modules/", 1)[-1]
    tarball = f"https://registry.npmjs.org/{name}/-/{name.split('/')[-1]}-{package.get('version')}.tgz"
    if package.get("resolved") != tarball or not package.get("integrity", "").startswith("sha512-"):
        bad.append(f"{path}: {package.get('resolved')}")
if bad or len(packages) < 2:
    sys.exit(f"{sys.argv[1]}: not all the npm registry's tarballs with a sha512 integrity: {bad}")
EOF
ts_tools="$cache/ts-client"
ts_pins=$(cat "$ts_client/package.json" "$ts_client/package-lock.json" | sha256sum | cut -d ' ' -f 1)
if [[ ! -d "$ts_tools/node_modules" ]] || [[ "$(cat "$ts_tools/.pins" 2>/dev/null)" != "$ts_pins" ]]; then
  echo "installing $ts_client/package-lock.json (npm ci)" >&2
  rm -rf "$ts_tools"
  mkdir -p "$ts_tools"
  cp "$ts_client/package.json" "$ts_client/package-lock.json" "$ts_tools/"
  # No package of the lockfile has an install script, nor needs one run.
  (cd "$ts_tools" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >&2)
  echo "$ts_pins" >"$ts_tools/.pins"
fi
echo "redocly $("$redocly" --version), $("$venv/bin/openapi-python-client" --version), $("$venv/bin/schemathesis" --version), $(chromium --version 2>/dev/null)"
ts_version() { node -p "require('$ts_tools/node_modules/$1/package.json').version"; }
echo "openapi-typescript $(ts_version openapi-typescript), openapi-fetch $(ts_version openapi-fetch), typescript $(ts_version typescript), node $(node --version)"

echo "== build"
cargo build --bin transfer-service
target_dir=$(cargo metadata --format-version 1 --no-deps \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
binary="$target_dir/debug/transfer-service"
[[ -x "$binary" ]] || fail "no binary at $binary"

echo "== start"
if [[ -z "${MONGODB_URI:-}" ]]; then
  secantusd=$(scripts/install-secantus.sh | tail -n 1)
  mkdir "$work/db"
  "$secantusd" --host 127.0.0.1 --port 0 --storage-path "$work/db" --sync-on-commit \
    --log-level WARNING >"$work/db.out" 2>"$work/db.err" &
  daemon_pid=$!
  # Its first line is `... listening on 127.0.0.1:<port>`.
  db_port=""
  for _ in $(seq 1 300); do
    db_port=$(head -n 1 "$work/db.out" | sed -n 's/.*:\([0-9][0-9]*\)$/\1/p')
    [[ -n "$db_port" ]] && break
    kill -0 "$daemon_pid" 2>/dev/null || fail "secantusd-rs stopped: $(cat "$work/db.err")"
    sleep 0.1
  done
  [[ -n "$db_port" ]] || fail "secantusd-rs did not say where it listens"
  export MONGODB_URI="mongodb://127.0.0.1:$db_port/?directConnection=true"
  echo "SecantusDB on 127.0.0.1:$db_port"
fi
port=$(free_port)
base="http://127.0.0.1:$port"
database="check_api_$(date +%s)_$$"
# No API keys and no CORS: the checks exercise the API itself.
env -u API_KEYS -u CORS_ALLOWED_ORIGINS \
  MONGODB_DATABASE="$database" BIND_ADDR="127.0.0.1:$port" INSTANCE_ID="check-api-$$" \
  LOG_FORMAT=json RUST_LOG=warn \
  "$binary" >"$work/service.log" 2>&1 &
service_pid=$!
wait_ready "$base" "$service_pid"
echo "service on $base, database $database"
# The committed document is the one the service serves (tests/openapi.rs keeps the file
# in step with the code; this checks the binary under test).
curl -fsS "$base/openapi.json" >"$work/served.json"
python3 - "$work/served.json" openapi/openapi.json <<'EOF'
import json, sys
served, committed = (json.load(open(path)) for path in sys.argv[1:])
if served != committed:
    sys.exit("the served /openapi.json differs from openapi/openapi.json")
EOF

echo "== lint (redocly $redocly_version)"
"$redocly" lint --config redocly.yaml --format stylish openapi/openapi.json

echo "== docs (headless chromium)"
timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$work/chromium" --virtual-time-budget=10000 \
  --dump-dom "$base/docs/" >"$work/docs.html" 2>"$work/chromium.log" \
  || fail "chromium failed: $(tail -n 20 "$work/chromium.log")"
# Swagger UI renders each operation as an element with id `operations-<tag>-<operationId>`
# and its path in `data-path`; every operation of the document must be there.
python3 - openapi/openapi.json "$work/docs.html" <<'EOF'
import html, json, sys
document = json.load(open(sys.argv[1]))
dom = open(sys.argv[2], encoding="utf-8").read()
missing = []
count = 0
for path, item in document["paths"].items():
    for method, operation in item.items():
        if method not in {"get", "put", "post", "delete", "patch", "head", "options", "trace"}:
            continue
        count += 1
        element = f'id="operations-{operation["tags"][0]}-{operation["operationId"]}"'
        shown = f'data-path="{html.escape(path)}"'
        summary = html.escape(operation.get("summary", ""), quote=False)
        if element not in dom or shown not in dom or summary not in dom:
            missing.append(f"{method.upper()} {path} ({operation.get('summary')})")
if "/transfers/{id}/cancel" not in dom:
    missing.append("the path /transfers/{id}/cancel")
if missing:
    sys.exit("Swagger UI at /docs does not show: " + "; ".join(missing))
print(f"Swagger UI shows all {count} operations")
EOF

echo "== event stream (a browser's EventSource, headless chromium)"
# Three events, made through the first instance; the page, served from another origin,
# follows the stream of a second instance whose CORS allows that origin.
for account in es-alice es-bob; do
  curl -fsS -o /dev/null -X POST "$base/accounts" -H 'content-type: application/json' \
    -d "{\"id\":\"$account\",\"balance\":100,\"currency\":\"EUR\"}"
done
curl -fsS -o /dev/null -X POST "$base/transfers" -H 'content-type: application/json' \
  -d '{"source":"es-alice","destination":"es-bob","amount":40}'
page_port=$(free_port)
mkdir "$work/page"
cp scripts/eventsource-check.html "$work/page/"
python3 -m http.server "$page_port" --bind 127.0.0.1 --directory "$work/page" \
  >"$work/page.log" 2>&1 &
page_server_pid=$!
browser_port=$(free_port)
env -u API_KEYS CORS_ALLOWED_ORIGINS="http://127.0.0.1:$page_port" \
  MONGODB_DATABASE="$database" BIND_ADDR="127.0.0.1:$browser_port" \
  INSTANCE_ID="check-api-browser-$$" LOG_FORMAT=json RUST_LOG=warn \
  "$binary" >"$work/browser-service.log" 2>&1 &
browser_service_pid=$!
wait_ready "http://127.0.0.1:$browser_port" "$browser_service_pid"
# The feed holds the three events once they are recorded (a few hundred ms).
expected=""
for _ in $(seq 1 100); do
  expected=$(curl -fsS "$base/events?limit=1000" \
    | python3 -c 'import json, sys; print(" ".join(e["id"] for e in json.load(sys.stdin)["items"]))')
  [[ $(wc -w <<<"$expected") -ge 3 ]] && break
  sleep 0.1
done
[[ $(wc -w <<<"$expected") -ge 3 ]] || fail "the feed did not record the three events: $expected"
stream="http://127.0.0.1:$browser_port/events/stream"
timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$work/chromium-es" --virtual-time-budget=10000 \
  --dump-dom "http://127.0.0.1:$page_port/eventsource-check.html?want=3&stream=$stream" \
  >"$work/es.html" 2>"$work/chromium-es.log" \
  || fail "chromium failed on the event stream: $(tail -n 20 "$work/chromium-es.log")"
# shellcheck disable=SC2086 # one argument per event id
python3 - "$work/es.html" $expected <<'EOF'
import re, sys
dom = open(sys.argv[1], encoding="utf-8").read()
expected = sys.argv[2:]
got = re.findall(r'<li class="event" data-type="([^"]+)" data-last-event-id="([^"]*)">([^<]*)</li>', dom)
ids = [event_id for _, _, event_id in got]
if ids != expected:
    sys.exit(f"EventSource received {ids}, the feed holds {expected}")
if any(not cursor for _, cursor, _ in got) or any(not i.startswith(t + ":") for t, _, i in got):
    sys.exit(f"each event needs its type and a Last-Event-ID: {got}")
print(f"EventSource received the feed's {len(ids)} events in order, each with its id")
EOF
stop "$browser_service_pid"
stop "$page_server_pid"

echo "== python client (openapi-python-client)"
PATH="$venv/bin:$PATH" openapi-python-client generate --path openapi/openapi.json \
  --output-path "$work/client" --meta setup --fail-on-warning
"$venv/bin/pip" install --quiet --disable-pip-version-check "$work/client"
"$venv/bin/python" scripts/client_smoke.py "$base"

echo "== tenants and API keys (python client; a third instance with API_KEYS)"
# The same database, served by an instance that asks for keys: a platform admin key of
# its own, random for this run, makes the tenants' keys through /api-keys.
admin_key=$(python3 -c 'import secrets; print(secrets.token_hex(24))')
keys_port=$(free_port)
keys_base="http://127.0.0.1:$keys_port"
env -u CORS_ALLOWED_ORIGINS API_KEYS="admin:$admin_key" \
  MONGODB_DATABASE="$database" BIND_ADDR="127.0.0.1:$keys_port" \
  INSTANCE_ID="check-api-keys-$$" LOG_FORMAT=json RUST_LOG=warn \
  "$binary" >"$work/keys-service.log" 2>&1 &
keys_service_pid=$!
wait_ready "$keys_base" "$keys_service_pid"
"$venv/bin/python" scripts/client_tenants.py "$keys_base" "$admin_key"

echo "== typescript client (openapi-typescript, openapi-fetch, tsc --strict)"
# The types are generated from the committed document at each run, next to a copy of
# smoke.ts; tsc (tsconfig.json: strict, nothing emitted on an error) must accept smoke.ts
# against them before it runs.
mkdir "$work/ts"
cp "$ts_client/package.json" "$ts_client/tsconfig.json" "$ts_client/smoke.ts" "$work/ts/"
ln -s "$ts_tools/node_modules" "$work/ts/node_modules"
# Run from that folder: in the repository openapi-typescript would apply redocly.yaml's
# lint rules without its ignore file (the lint step above applies both).
(cd "$work/ts" && "$ts_tools/node_modules/.bin/openapi-typescript" "$OLDPWD/openapi/openapi.json" \
  --output schema.d.ts >"$work/openapi-typescript.log" 2>&1) \
  || fail "openapi-typescript failed: $(cat "$work/openapi-typescript.log")"
"$ts_tools/node_modules/.bin/tsc" --project "$work/ts/tsconfig.json" \
  || fail "$ts_client/smoke.ts does not type-check against the types of openapi/openapi.json"
timeout 60 node "$work/ts/out/smoke.js" "$keys_base" "$admin_key"
stop "$keys_service_pid"

echo "== schemathesis (at most $max_examples cases per operation and phase)"
# Run from the temporary folder: Schemathesis keeps no files in the repository. One
# worker: with more, Hypothesis (6.170 on Python 3.11) sometimes fails in its own threads
# ("AST constructor recursion depth mismatch"), and the run is short anyway.
(
  cd "$work"
  # GET /events/stream never ends while the service runs: a valid request would wait for
  # the time-out. The EventSource check above and tests/api/events_stream.rs cover it.
  "$venv/bin/schemathesis" run "$base/openapi.json" \
    --exclude-path /events/stream \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance \
    --max-examples "$max_examples" \
    --workers 1 \
    --request-timeout 35 \
    --generation-database none \
    --no-color
)
echo "== check-api passed"
