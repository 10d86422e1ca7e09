//! Typed settings, read once at start-up from environment variables or the equivalent
//! command-line flags (`transfer-service --help`).
//!
//! clap only collects raw strings; [`Settings::from_args`] turns them into typed values,
//! so that a bad value stops the process with one line that names the variable, not a
//! usage screen. Durations carry their unit in the variable name (`_MS`) and become
//! [`Duration`]s here, at the edge.

use crate::service::Strategy;
use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

/// The raw flags and variables, exactly as given.
#[derive(Debug, Clone, Parser)]
#[command(name = "transfer-service", version, about)]
pub struct Args {
    /// MongoDB connection string; a replica set (or SecantusDB) is required for majority writes.
    #[arg(long, env = "MONGODB_URI", default_value = "mongodb://127.0.0.1:27017")]
    pub mongodb_uri: String,

    /// Database holding the `accounts`, `transactions` and `migrations` collections.
    #[arg(long, env = "MONGODB_DATABASE", default_value = "bank")]
    pub mongodb_database: String,

    /// Address the HTTP server listens on.
    #[arg(long, env = "BIND_ADDR", default_value = "127.0.0.1:8080")]
    pub bind_addr: String,

    /// This instance's name, written to the `application` field of the transfers it owns.
    /// Defaults to hostname-pid. Give a restarted instance its old name and it resumes its
    /// own transfers at once instead of waiting for their lease to lapse.
    #[arg(long, env = "INSTANCE_ID")]
    pub instance_id: Option<String>,

    /// Milliseconds between two passes of the recovery sweeper.
    #[arg(long, env = "SWEEP_INTERVAL_MS", default_value = "1000")]
    pub sweep_interval_ms: String,

    /// Milliseconds without progress after which another instance may take a transfer over.
    #[arg(long, env = "STALE_AFTER_MS", default_value = "10000")]
    pub stale_after_ms: String,

    /// Group-commit writes in flight to the database at once, across all kinds of step
    /// (1 to 64). Two suit SecantusDB, which runs write commands one at a time; a replica
    /// set whose journal serves concurrent writers with one flush may like more.
    #[arg(long, env = "GROUP_COMMIT_WRITES", default_value = "2")]
    pub group_commit_writes: String,

    /// Transfers this instance works on at once, at most (1 to 100000): new transfers and
    /// cancels beyond it are refused with 503 `overloaded` and `Retry-After`, recording
    /// nothing, so that queues stay short and every admitted transfer keeps its lease.
    #[arg(long, env = "MAX_TRANSFERS_IN_FLIGHT", default_value = "512")]
    pub max_transfers_in_flight: String,

    /// Client connections served at once, at most (1 to 100000); a connection beyond it
    /// is answered 503 `overloaded` with `Retry-After` and closed at once, so a burst
    /// from many clients neither waits unanswered nor grows this process's memory.
    #[arg(long, env = "MAX_CONNECTIONS", default_value = "1024")]
    pub max_connections: String,

    /// Milliseconds a connection may take to send a request's headers, counted from when
    /// it is opened or its previous answer was sent: an idle keep-alive connection is
    /// closed after it, and gives its place under `MAX_CONNECTIONS` back. Longer than
    /// the idle time-out of a load balancer in front (60 s is common), so that the
    /// balancer closes first.
    #[arg(long, env = "HTTP_IDLE_TIMEOUT_MS", default_value = "75000")]
    pub http_idle_timeout_ms: String,

    /// How a transfer is carried out: `two-phase` (the tutorial's protocol, the default) or
    /// `native` (one MongoDB multi-document transaction per transfer, for comparison).
    #[arg(long, env = "TRANSFER_STRATEGY", default_value = "two-phase")]
    pub transfer_strategy: String,

    /// Log output: `pretty` for people, `json` for one JSON object a line.
    #[arg(long, env = "LOG_FORMAT", default_value = "pretty")]
    pub log_format: String,

    /// Log filter in tracing's EnvFilter syntax, such as `info,transfer_service=debug`.
    #[arg(long, env = "RUST_LOG", default_value = "info")]
    pub rust_log: String,

    /// API keys, comma-separated `role:key` pairs: role `rw` may read and write, `ro` only
    /// read. Each key is 16 to 256 visible ASCII characters other than a comma. Unset or
    /// empty: no key is needed. Prefer the variable to the flag, which `ps` shows.
    #[arg(long, env = "API_KEYS", hide_env_values = true)]
    pub api_keys: Option<Secret>,

    /// Comma-separated origins (`scheme://host[:port]`) a browser may call the API from.
    /// Unset or empty: no CORS headers, so browsers allow only same-origin calls.
    #[arg(long, env = "CORS_ALLOWED_ORIGINS")]
    pub cors_allowed_origins: Option<String>,
}

/// A secret as given on the command line or in the environment; `Debug` never shows it.
#[derive(Clone)]
pub struct Secret(String);

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(raw: &str) -> Result<Secret, Self::Err> {
        Ok(Secret(raw.to_owned()))
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// What an API key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `ro`: safe methods only (GET, HEAD, OPTIONS).
    ReadOnly,
    /// `rw`: everything.
    ReadWrite,
}

/// A configured API key. Only its SHA-256 digest is kept: equal-length digests are what
/// the authentication compares in constant time, and the key itself then never sits in
/// the settings to be logged or dumped by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub role: Role,
    pub sha256: [u8; 32],
}

impl ApiKey {
    pub fn new(role: Role, key: &str) -> ApiKey {
        use sha2::{Digest, Sha256};
        ApiKey {
            role,
            sha256: Sha256::digest(key.as_bytes()).into(),
        }
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKey")
            .field("role", &self.role)
            .field("sha256", &"<redacted>")
            .finish()
    }
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Pretty,
    Json,
}

/// The validated settings the application runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub mongodb_uri: String,
    pub database: String,
    pub bind_addr: SocketAddr,
    pub instance_id: String,
    pub sweep_interval: Duration,
    pub stale_after: Duration,
    /// Batched writes in flight to the database at once (see `store::batch`).
    pub group_commit_writes: usize,
    /// Transfers worked on at once, at most (admission control, see `service`).
    pub max_transfers_in_flight: usize,
    /// Client connections served at once, at most (see `http::connections`).
    pub max_connections: usize,
    /// How long a connection may be idle before the headers of its next request.
    pub http_idle_timeout: Duration,
    /// Two-phase commit or one native transaction per transfer.
    pub strategy: Strategy,
    pub log_format: LogFormat,
    pub log_filter: String,
    /// The keys a request may present as `Authorization: Bearer <key>`. Empty: the API is
    /// open and the header is ignored.
    pub api_keys: Vec<ApiKey>,
    /// Exact origins (`https://app.example.com`, lowercase) given CORS headers. Empty: no
    /// CORS headers at all.
    pub cors_allowed_origins: Vec<String>,
}

/// A setting that could not be used; `Display` is the one line printed before exiting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {variable}: {message}")]
pub struct ConfigError {
    pub variable: &'static str,
    pub message: String,
}

fn invalid(variable: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        variable,
        message: message.into(),
    }
}

fn positive_millis(variable: &'static str, raw: &str) -> Result<Duration, ConfigError> {
    match raw.trim().parse::<u64>() {
        Ok(ms) if (1..=86_400_000).contains(&ms) => Ok(Duration::from_millis(ms)),
        _ => Err(invalid(
            variable,
            format!("{raw:?} is not a whole number of milliseconds from 1 to 86400000"),
        )),
    }
}

/// Parses `API_KEYS`: comma-separated `role:key` pairs. Blank: no keys. The messages
/// name the entry by its position and never repeat any part of it, since a mistyped
/// entry may still be a real key.
pub fn parse_api_keys(raw: &str) -> Result<Vec<ApiKey>, ConfigError> {
    const VARIABLE: &str = "API_KEYS";
    if raw.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut keys: Vec<ApiKey> = Vec::new();
    for (index, entry) in raw.split(',').enumerate() {
        let n = index + 1;
        let entry = entry.trim();
        if entry.is_empty() {
            return Err(invalid(VARIABLE, format!("entry {n} is empty")));
        }
        let Some((role, key)) = entry.split_once(':') else {
            return Err(invalid(
                VARIABLE,
                format!("entry {n} is not role:key (role rw or ro)"),
            ));
        };
        let role = match role.trim() {
            "rw" => Role::ReadWrite,
            "ro" => Role::ReadOnly,
            _ => {
                return Err(invalid(
                    VARIABLE,
                    format!("entry {n} has a role other than rw or ro"),
                ));
            }
        };
        let key = key.trim();
        if !(16..=256).contains(&key.len()) || !key.chars().all(|c| c.is_ascii_graphic()) {
            return Err(invalid(
                VARIABLE,
                format!(
                    "the key of entry {n} must be 16 to 256 visible ASCII characters other than a comma"
                ),
            ));
        }
        let key = ApiKey::new(role, key);
        if let Some(earlier) = keys.iter().position(|k| k.sha256 == key.sha256) {
            return Err(invalid(
                VARIABLE,
                format!("entry {n} repeats the key of entry {}", earlier + 1),
            ));
        }
        keys.push(key);
    }
    Ok(keys)
}

/// Parses `CORS_ALLOWED_ORIGINS`: comma-separated origins, each exactly
/// `http(s)://host[:port]` with no path, as a browser sends it in `Origin`. Blank: none.
/// Returned lowercase, the form browsers use, because the match is exact.
pub fn parse_cors_origins(raw: &str) -> Result<Vec<String>, ConfigError> {
    const VARIABLE: &str = "CORS_ALLOWED_ORIGINS";
    if raw.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut origins: Vec<String> = Vec::new();
    for entry in raw.split(',') {
        let origin = entry.trim().to_ascii_lowercase();
        let parsed = origin.parse::<axum::http::Uri>().ok();
        let canonical = parsed.as_ref().and_then(|uri| {
            let scheme = uri.scheme_str().filter(|s| ["http", "https"].contains(s))?;
            let authority = uri.authority().filter(|a| !a.as_str().contains('@'))?;
            Some(format!("{scheme}://{authority}"))
        });
        if canonical.as_deref() != Some(origin.as_str()) {
            return Err(invalid(
                VARIABLE,
                format!(
                    "{:?} is not an origin such as https://app.example.com (scheme, host and optional port; no path, no wildcard)",
                    entry.trim()
                ),
            ));
        }
        if !origins.contains(&origin) {
            origins.push(origin);
        }
    }
    Ok(origins)
}

impl Settings {
    /// Reads the process's flags and environment.
    pub fn from_env() -> Result<Settings, ConfigError> {
        Settings::from_args(Args::parse())
    }

    pub fn from_args(args: Args) -> Result<Settings, ConfigError> {
        let uri = args.mongodb_uri.trim().to_owned();
        if !(uri.starts_with("mongodb://") || uri.starts_with("mongodb+srv://")) {
            return Err(invalid(
                "MONGODB_URI",
                "must start with mongodb:// or mongodb+srv://",
            ));
        }
        let database = args.mongodb_database.trim().to_owned();
        if database.is_empty()
            || database.len() > 63
            || database.chars().any(|c| "/\\. \"$\0".contains(c))
        {
            return Err(invalid(
                "MONGODB_DATABASE",
                "must be 1 to 63 characters without / \\ . space \" or $",
            ));
        }
        let bind_addr = args.bind_addr.trim().parse::<SocketAddr>().map_err(|_| {
            invalid(
                "BIND_ADDR",
                format!(
                    "{:?} is not host:port, such as 127.0.0.1:8080",
                    args.bind_addr
                ),
            )
        })?;
        let instance_id = match args.instance_id {
            Some(id) => {
                let id = id.trim().to_owned();
                if id.is_empty() || id.len() > 128 || !id.chars().all(|c| c.is_ascii_graphic()) {
                    return Err(invalid(
                        "INSTANCE_ID",
                        "must be 1 to 128 visible ASCII characters",
                    ));
                }
                id
            }
            None => default_instance_id(),
        };
        let sweep_interval = positive_millis("SWEEP_INTERVAL_MS", &args.sweep_interval_ms)?;
        let stale_after = positive_millis("STALE_AFTER_MS", &args.stale_after_ms)?;
        let group_commit_writes = match args.group_commit_writes.trim().parse::<usize>() {
            Ok(n) if (1..=64).contains(&n) => n,
            _ => {
                return Err(invalid(
                    "GROUP_COMMIT_WRITES",
                    format!(
                        "{:?} is not a whole number from 1 to 64",
                        args.group_commit_writes
                    ),
                ));
            }
        };
        let max_transfers_in_flight = match args.max_transfers_in_flight.trim().parse::<usize>() {
            Ok(n) if (1..=100_000).contains(&n) => n,
            _ => {
                return Err(invalid(
                    "MAX_TRANSFERS_IN_FLIGHT",
                    format!(
                        "{:?} is not a whole number from 1 to 100000",
                        args.max_transfers_in_flight
                    ),
                ));
            }
        };
        let max_connections = match args.max_connections.trim().parse::<usize>() {
            Ok(n) if (1..=100_000).contains(&n) => n,
            _ => {
                return Err(invalid(
                    "MAX_CONNECTIONS",
                    format!(
                        "{:?} is not a whole number from 1 to 100000",
                        args.max_connections
                    ),
                ));
            }
        };
        let http_idle_timeout =
            positive_millis("HTTP_IDLE_TIMEOUT_MS", &args.http_idle_timeout_ms)?;
        let strategy = Strategy::parse(args.transfer_strategy.trim()).ok_or_else(|| {
            invalid(
                "TRANSFER_STRATEGY",
                format!(
                    "{:?} is neither two-phase nor native",
                    args.transfer_strategy
                ),
            )
        })?;
        let log_format = match args.log_format.trim() {
            "pretty" => LogFormat::Pretty,
            "json" => LogFormat::Json,
            other => {
                return Err(invalid(
                    "LOG_FORMAT",
                    format!("{other:?} is neither pretty nor json"),
                ));
            }
        };
        let log_filter = args.rust_log.trim().to_owned();
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&log_filter) {
            return Err(invalid("RUST_LOG", e.to_string()));
        }
        let api_keys = match &args.api_keys {
            Some(Secret(raw)) => parse_api_keys(raw)?,
            None => Vec::new(),
        };
        let cors_allowed_origins =
            parse_cors_origins(args.cors_allowed_origins.as_deref().unwrap_or_default())?;
        Ok(Settings {
            mongodb_uri: uri,
            database,
            bind_addr,
            instance_id,
            sweep_interval,
            stale_after,
            group_commit_writes,
            max_transfers_in_flight,
            max_connections,
            http_idle_timeout,
            strategy,
            log_format,
            log_filter,
            api_keys,
            cors_allowed_origins,
        })
    }
}

/// hostname-pid: unique among live processes on a network, and readable in logs.
fn default_instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned());
    format!("{host}-{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut argv = vec!["transfer-service"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).unwrap()
    }

    #[test]
    fn defaults_are_usable() {
        let s = Settings::from_args(args(&[])).unwrap();
        assert_eq!(s.database, "bank");
        assert_eq!(s.sweep_interval, Duration::from_millis(1000));
        assert_eq!(s.stale_after, Duration::from_millis(10_000));
        assert_eq!(s.group_commit_writes, 2);
        assert_eq!(s.max_transfers_in_flight, 512);
        assert_eq!(s.max_connections, 1024);
        assert_eq!(s.http_idle_timeout, Duration::from_millis(75_000));
        assert!(s.instance_id.ends_with(&format!("-{}", std::process::id())));
    }

    #[test]
    fn a_bad_value_names_its_variable() {
        let cases: [(&[&str], &str); 12] = [
            (&["--max-connections", "0"], "MAX_CONNECTIONS"),
            (&["--http-idle-timeout-ms", "0"], "HTTP_IDLE_TIMEOUT_MS"),
            (&["--sweep-interval-ms", "soon"], "SWEEP_INTERVAL_MS"),
            (&["--group-commit-writes", "0"], "GROUP_COMMIT_WRITES"),
            (&["--group-commit-writes", "65"], "GROUP_COMMIT_WRITES"),
            (
                &["--max-transfers-in-flight", "0"],
                "MAX_TRANSFERS_IN_FLIGHT",
            ),
            (
                &["--max-transfers-in-flight", "many"],
                "MAX_TRANSFERS_IN_FLIGHT",
            ),
            (&["--stale-after-ms", "0"], "STALE_AFTER_MS"),
            (&["--bind-addr", "localhost"], "BIND_ADDR"),
            (&["--log-format", "xml"], "LOG_FORMAT"),
            (&["--mongodb-uri", "http://x"], "MONGODB_URI"),
            (&["--mongodb-database", "a.b"], "MONGODB_DATABASE"),
        ];
        for (flags, variable) in cases {
            let err = Settings::from_args(args(flags)).unwrap_err();
            assert_eq!(err.variable, variable);
            assert!(
                err.to_string()
                    .starts_with(&format!("invalid {variable}: "))
            );
        }
    }

    const RW_KEY: &str = "rw-key-0123456789abcdef";
    const RO_KEY: &str = "ro-key-0123456789abcdef";

    #[test]
    fn api_keys_are_role_key_pairs_kept_only_as_digests() {
        let s = Settings::from_args(args(&[
            "--api-keys",
            &format!(" rw:{RW_KEY} , ro:{RO_KEY}"),
        ]))
        .unwrap();
        assert_eq!(
            s.api_keys,
            [
                ApiKey::new(Role::ReadWrite, RW_KEY),
                ApiKey::new(Role::ReadOnly, RO_KEY)
            ]
        );
        let debug = format!("{s:?}");
        assert!(
            !debug.contains(RW_KEY) && !debug.contains(RO_KEY),
            "{debug}"
        );
        assert!(!format!("{:?}", args(&["--api-keys", RW_KEY])).contains(RW_KEY));
    }

    #[test]
    fn without_api_keys_the_api_is_open() {
        assert!(Settings::from_args(args(&[])).unwrap().api_keys.is_empty());
        assert!(parse_api_keys("  ").unwrap().is_empty());
    }

    #[test]
    fn a_bad_api_keys_entry_names_the_variable_and_never_echoes_the_key() {
        let secret = "s3cret-0123456789abcdef";
        let cases = [
            (
                format!("admin:{secret}"),
                "entry 1 has a role other than rw or ro",
            ),
            (
                format!("{secret}:rw"),
                "entry 1 has a role other than rw or ro",
            ),
            (secret.to_owned(), "entry 1 is not role:key"),
            (format!("rw:{secret},"), "entry 2 is empty"),
            (
                format!("ro:{secret},rw:{secret}"),
                "entry 2 repeats the key of entry 1",
            ),
            (
                "rw:short".to_owned(),
                "the key of entry 1 must be 16 to 256",
            ),
            (
                format!("rw:{secret} x"),
                "the key of entry 1 must be 16 to 256",
            ),
        ];
        for (raw, expected) in cases {
            let err = Settings::from_args(args(&["--api-keys", &raw])).unwrap_err();
            let line = err.to_string();
            assert_eq!(err.variable, "API_KEYS");
            assert!(line.starts_with("invalid API_KEYS: "), "{line}");
            assert!(line.contains(expected), "{raw:?}: {line}");
            assert!(
                !line.contains("s3cret") && !line.contains("short"),
                "{line}"
            );
        }
    }

    #[test]
    fn cors_origins_are_exact_lowercase_origins() {
        let s = Settings::from_args(args(&[
            "--cors-allowed-origins",
            "https://App.Example.com, http://localhost:3000,https://app.example.com",
        ]))
        .unwrap();
        assert_eq!(
            s.cors_allowed_origins,
            ["https://app.example.com", "http://localhost:3000"]
        );
        assert!(
            Settings::from_args(args(&[]))
                .unwrap()
                .cors_allowed_origins
                .is_empty()
        );
        assert!(parse_cors_origins("").unwrap().is_empty());
    }

    #[test]
    fn a_bad_cors_origin_names_the_variable() {
        for raw in [
            "*",
            "null",
            "app.example.com",
            "https://app.example.com/",
            "https://app.example.com/path",
            "ftp://app.example.com",
            "https://user@app.example.com",
            "https://app.example.com,",
            "https://app.example.com?x=1",
        ] {
            let err = Settings::from_args(args(&["--cors-allowed-origins", raw])).unwrap_err();
            assert_eq!(err.variable, "CORS_ALLOWED_ORIGINS", "{raw}");
            assert!(
                err.to_string()
                    .starts_with("invalid CORS_ALLOWED_ORIGINS: "),
                "{err}"
            );
        }
    }
}
