//! Typed settings, read once at start-up from environment variables or the equivalent
//! command-line flags (`transfer-service --help`).
//!
//! clap only collects raw strings; [`Settings::from_args`] turns them into typed values,
//! so that a bad value stops the process with one line that names the variable, not a
//! usage screen. Durations carry their unit in the variable name (`_MS`) and become
//! [`Duration`]s here, at the edge.

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

    /// Log output: `pretty` for people, `json` for one JSON object a line.
    #[arg(long, env = "LOG_FORMAT", default_value = "pretty")]
    pub log_format: String,

    /// Log filter in tracing's EnvFilter syntax, such as `info,transfer_service=debug`.
    #[arg(long, env = "RUST_LOG", default_value = "info")]
    pub rust_log: String,
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
    pub log_format: LogFormat,
    pub log_filter: String,
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
        Ok(Settings {
            mongodb_uri: uri,
            database,
            bind_addr,
            instance_id,
            sweep_interval,
            stale_after,
            log_format,
            log_filter,
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
        assert!(s.instance_id.ends_with(&format!("-{}", std::process::id())));
    }

    #[test]
    fn a_bad_value_names_its_variable() {
        let cases: [(&[&str], &str); 6] = [
            (&["--sweep-interval-ms", "soon"], "SWEEP_INTERVAL_MS"),
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
}
