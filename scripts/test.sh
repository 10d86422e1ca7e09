#!/usr/bin/env bash
# Runs every check and test, on a fresh machine too. It installs what is missing (cmake,
# the SecantusDB daemon, faketime, docker-compose, hadolint, Chromium, the pinned Python
# and npm API tools), then runs formatting, lints, every test against a real database server, the
# offline checks of the container files, the checks of the API document against the
# running service, and a smoke run of the benchmark. With MONGODB_URI set, the tests use
# that server instead (a real mongod replica set, say).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${MONGODB_URI:-}" ]]; then
  SECANTUSD_BIN=$(scripts/install-secantus.sh | tail -n 1)
  export SECANTUSD_BIN
fi

# tests/clocks.rs runs instances under libfaketime.
if ! ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1; then
  echo "installing faketime (apt-get)" >&2
  if [[ $(id -u) -eq 0 ]]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq faketime
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
# The tests, examples and benches build with fault injection on (the package takes itself
# as a dev-dependency with `failpoints`, Cargo.toml): the plain commands check and run them
# all. The second clippy run checks the library and binary as production builds them,
# without fault injection, which no --all-targets build sees.
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo clippy (the production build, no fault injection)"
cargo clippy --workspace -- -D warnings
echo "== cargo test"
cargo test --all-targets
cargo test --doc
echo "== containers"
scripts/check-containers.sh
echo "== API document, Swagger UI, generated client, schemathesis"
scripts/check-api.sh
# The one test that needs a Python package: the Standard Webhooks library verifies the
# deliveries, with the Python check-api.sh installed it in.
echo "== webhooks verified by the standardwebhooks library"
STANDARDWEBHOOKS_PYTHON="${XDG_CACHE_HOME:-$HOME/.cache}/transfer-service/venv-api/bin/python" \
  cargo test --test api standardwebhooks -- --ignored
echo "== benchmark smoke run (proves the one command works; no speed is asserted)"
bench_out=$(mktemp -d)
cargo run --release --example bench -- --quick --out "$bench_out"
rm -rf "$bench_out"
