# transfer-service container image, in two stages:
#   builder  rust:1.95-bookworm (the project's toolchain) compiles the release binary;
#   runtime  debian:bookworm-slim (same glibc as the builder) runs it as a non-root user.
#
#   docker build -t transfer-service .
#   docker run --rm -p 8080:8080 -e MONGODB_URI='mongodb://db:27017/?replicaSet=rs0' transfer-service
#
# Works with the classic builder and with BuildKit alike: no RUN --mount cache mounts, so
# nothing here needs BuildKit or a `# syntax=` frontend image. Dependencies are cached as
# their own layer instead (below), which is rebuilt only when Cargo.toml or Cargo.lock
# changes. Checked offline by scripts/check-containers.sh (hadolint).

FROM rust:1.95-bookworm AS builder

# bash with pipefail for every RUN below, so that a failing command inside a pipe fails
# the build.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /app

# 1. Dependencies only. Cargo refuses to load a manifest whose declared targets are
# missing, so every target file named in Cargo.toml ([lib], [[bin]], [[bench]], [[test]],
# [[example]]: its `path`, or the path Cargo infers from its `name`) gets a stub. Then the
# stubs under src/ are removed again; the ones elsewhere (benches/, tests/, examples/,
# which the image never copies) stay so the manifest keeps loading. The test-support
# crate (tests/support) is a member of the workspace and a dev-dependency, so its manifest
# is copied and its library stubbed too; it is never compiled here. This layer is reused
# as long as the manifests and the lock file do not change.
COPY Cargo.toml Cargo.lock ./
COPY tests/support/Cargo.toml tests/support/
RUN set -eu; \
    mkdir -p src tests/support/src; \
    : > src/lib.rs; \
    : > tests/support/src/lib.rs; \
    echo 'fn main() {}' > src/main.rs; \
    awk -F "[\"']" ' \
      function flush() { \
        if (kind != "") { \
          if (path != "") print path; \
          else if (kind == "bin") { if (name != pkg) print "src/bin/" name ".rs" } \
          else if (kind != "lib") print kind "/" name ".rs"; \
        } \
        kind = ""; name = ""; path = ""; \
      } \
      /^[[:space:]]*\[/ { \
        flush(); sec = $0; gsub(/[[:space:]]|#.*/, "", sec); \
        if (sec == "[lib]") kind = "lib"; \
        else if (sec == "[[bin]]") kind = "bin"; \
        else if (sec == "[[bench]]") kind = "benches"; \
        else if (sec == "[[test]]") kind = "tests"; \
        else if (sec == "[[example]]") kind = "examples"; \
        next; \
      } \
      sec == "[package]" && /^[[:space:]]*name[[:space:]]*=/ { pkg = $2 } \
      kind != "" && /^[[:space:]]*name[[:space:]]*=/ { name = $2 } \
      kind != "" && /^[[:space:]]*path[[:space:]]*=/ { path = $2 } \
      END { flush() } \
    ' Cargo.toml > /tmp/cargo-targets; \
    while IFS= read -r target; do \
      mkdir -p "$(dirname "$target")"; \
      [ -e "$target" ] || echo 'fn main() {}' > "$target"; \
    done < /tmp/cargo-targets; \
    cargo build --release --locked --bin transfer-service; \
    rm -rf src /tmp/cargo-targets

# 2. The service itself. migrations/*.json are compiled in with include_str!; openapi/
# holds the committed API document. Copied files keep their own (older) modification
# times, so touch them: otherwise Cargo would take the stub build as up to date.
COPY src/ src/
COPY migrations/ migrations/
COPY openapi/ openapi/
RUN find src migrations -type f -exec touch {} + \
    && cargo build --release --locked --bin transfer-service \
    && cp target/release/transfer-service /usr/local/bin/transfer-service

FROM debian:bookworm-slim AS runtime

LABEL org.opencontainers.image.title="transfer-service" \
      org.opencontainers.image.description="Moves money between MongoDB accounts with the two-phase-commit pattern and recovers by itself from crashes." \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.base.name="docker.io/library/debian:bookworm-slim"

# ca-certificates for TLS connections to MongoDB, curl for the HEALTHCHECK. Versions are
# not pinned on purpose: Debian replaces a package's version in bookworm and
# bookworm-security when it ships a fix, so a pinned version stops installing after the
# next security update; the unpinned install takes those fixes.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*

# A fixed, numeric non-root user, so that runAsNonRoot-style checks can verify it.
RUN groupadd --system --gid 10001 transfer \
    && useradd --system --uid 10001 --gid transfer --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin transfer

COPY --from=builder /usr/local/bin/transfer-service /usr/local/bin/transfer-service

# Every other setting keeps the service's default (see README.md, Configuration, and
# docs/operations.md, Settings that tune). The default INSTANCE_ID is hostname-pid; in a
# container the hostname is the container's id, so each container stays unique and a
# restarted one keeps its name.
ENV BIND_ADDR=0.0.0.0:8080 \
    LOG_FORMAT=json

USER 10001:10001
EXPOSE 8080

# /health answers 200 as long as the process serves HTTP; /ready also checks the database.
# `|| exit 1` because Docker reads only 1 as "unhealthy"; curl fails with other codes.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["/bin/sh", "-c", "curl -fsS http://127.0.0.1:8080/health || exit 1"]

# On SIGTERM the service stops taking requests, drains for up to 10 s and lets the sweeper
# stop between two steps; give it more than that before SIGKILL (docker stop -t 30,
# stop_grace_period in docker-compose.yml).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/transfer-service"]
