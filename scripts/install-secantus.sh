#!/usr/bin/env bash
# Installs SecantusDB's Rust daemon, secantusd-rs, the MongoDB-wire-compatible server we
# develop and test against, unless the pinned version is already installed. Prints the
# path of the binary on its last line.
#
#   SECANTUS_ROOT   where to install (default: ~/.cache/transfer-service/secantus)
set -euo pipefail

version="0.5.3-beta.196"
root="${SECANTUS_ROOT:-$HOME/.cache/transfer-service/secantus}"
bin="$root/bin/secantusd-rs"
stamp="$root/.version"

if [[ -x "$bin" && -f "$stamp" && "$(cat "$stamp")" == "$version" ]]; then
  echo "$bin"
  exit 0
fi

# The crate builds WiredTiger with cmake.
if ! command -v cmake >/dev/null 2>&1; then
  echo "installing cmake (apt-get)" >&2
  if [[ $(id -u) -eq 0 ]]; then sudo=""; else sudo="sudo"; fi
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq cmake >&2
fi

echo "building secantus-mdb $version (about 5 minutes the first time)" >&2
mkdir -p "$root"
# The crate declares rust-version 1.98 but builds and runs on 1.95.
cargo install secantus-mdb --version "$version" --ignore-rust-version --locked --root "$root" >&2 \
  || cargo install secantus-mdb --version "$version" --ignore-rust-version --root "$root" >&2
echo "$version" > "$stamp"
echo "$bin"
