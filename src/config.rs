//! Typed settings, read once at start-up from environment variables or the equivalent
//! command-line flags (`transfer-service --help`).
//!
//! clap parses every value with a typed parser declared on [`Args`]: its own ranged
//! integers and enums for the counts, durations and modes, and the functions below for
//! the values only this service knows (connection string, API keys, CORS origins). A value
//! clap rejects stops the process with one line that names the variable, not a usage
//! screen ([`ConfigError::from_clap`]); no line and no `Debug` output ever holds an API
//! key. Surrounding whitespace is ignored, as an `.env` file easily leaves some. Durations
//! carry their unit in the variable name (`_MS`) and become [`Duration`]s in
//! [`Settings::from_args`], at the edge.

use crate::domain::{ApiKeyId, DeploymentName, Strategy};
use std::error::Error as _;
use std::ffi::{OsStr, OsString};
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::time::Duration;

use clap::builder::{EnumValueParser, PossibleValue, RangedU64ValueParser, TypedValueParser};
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, Parser, ValueEnum};

/// The flags and variables, each parsed into its type by clap.
#[derive(Debug, Clone, Parser)]
#[command(name = "transfer-service", version, about)]
pub struct Args {
    /// MongoDB connection string; a replica set (or SecantusDB) is required for majority writes.
    #[arg(
        long,
        env = "MONGODB_URI",
        default_value = "mongodb://127.0.0.1:27017",
        value_parser = mongodb_uri
    )]
    pub mongodb_uri: String,

    /// Several deployments: comma-separated `name=uri` pairs, each name 1 to 32
    /// characters from `a-z0-9_-`, each URI a MongoDB connection string (which may list
    /// several hosts with commas itself: a new pair starts at a comma followed by
    /// `name=`). Accounts live on the deployment named when they are opened, the first one by
    /// default. Unset: `MONGODB_URI` alone, named `default`. Prefer the variable to the
    /// flag, which `ps` shows.
    // `std::vec::Vec` spelled out, as for `API_KEYS`: the whole list is one value.
    #[arg(long, env = "DEPLOYMENTS", hide_env_values = true, value_parser = deployments)]
    pub deployments: Option<std::vec::Vec<Deployment>>,

    /// Database holding the `accounts`, `transactions` and `migrations` collections.
    #[arg(long, env = "MONGODB_DATABASE", default_value = "bank", value_parser = database_name)]
    pub mongodb_database: String,

    /// Address the HTTP server listens on.
    #[arg(long, env = "BIND_ADDR", default_value = "127.0.0.1:8080", value_parser = socket_addr)]
    pub bind_addr: SocketAddr,

    /// This instance's name, written to the `application` field of the transfers it owns.
    /// Defaults to hostname-pid. Give a restarted instance its old name and it resumes its
    /// own transfers at once instead of waiting for their lease to lapse.
    #[arg(long, env = "INSTANCE_ID", value_parser = instance_id)]
    pub instance_id: Option<String>,

    /// Milliseconds between two passes of the recovery sweeper.
    #[arg(long, env = "SWEEP_INTERVAL_MS", default_value = "1000", value_parser = millis())]
    pub sweep_interval_ms: u64,

    /// Milliseconds without progress after which another instance may take a transfer over.
    #[arg(long, env = "STALE_AFTER_MS", default_value = "10000", value_parser = millis())]
    pub stale_after_ms: u64,

    /// Group-commit writes in flight to the database at once, across all kinds of step
    /// (1 to 64). Two suit SecantusDB, which runs write commands one at a time; a replica
    /// set whose journal serves concurrent writers with one flush may like more.
    #[arg(
        long,
        env = "GROUP_COMMIT_WRITES",
        default_value = "2",
        value_parser = whole_number(1..=64)
    )]
    pub group_commit_writes: usize,

    /// Transfers this instance works on at once, at most (1 to 100000): new transfers and
    /// cancels beyond it are refused with 503 `overloaded` and `Retry-After`, recording
    /// nothing, so that queues stay short and every admitted transfer keeps its lease.
    #[arg(
        long,
        env = "MAX_TRANSFERS_IN_FLIGHT",
        default_value = "512",
        value_parser = whole_number(1..=100_000)
    )]
    pub max_transfers_in_flight: usize,

    /// Milliseconds a new transfer or cancel beyond `MAX_TRANSFERS_IN_FLIGHT` waits for
    /// one of them to finish before it is refused (0 to 10000; 0 refuses at once).
    /// Requests wait in turn, at most one per connection, and only while the
    /// connections are below `MAX_CONNECTIONS` (at it, they are refused at once); they
    /// record nothing while they wait; a refusal is 503 `overloaded` with `Retry-After`. The wait keeps clients that retry at once, whatever `Retry-After`
    /// says, from turning into a storm of refusals that takes the CPU from the admitted
    /// transfers.
    #[arg(
        long,
        env = "ADMISSION_WAIT_MS",
        default_value = "1000",
        value_parser = millis_within(0..=10_000)
    )]
    pub admission_wait_ms: u64,

    /// Client connections served at once, at most (1 to 100000); a connection beyond it
    /// is answered 503 `overloaded` with `Retry-After` and closed at once, so a burst
    /// from many clients neither waits unanswered nor grows this process's memory.
    #[arg(
        long,
        env = "MAX_CONNECTIONS",
        default_value = "1024",
        value_parser = whole_number(1..=100_000)
    )]
    pub max_connections: usize,

    /// Milliseconds a connection may take to send a request's headers, counted from when
    /// it is opened or its previous answer was sent: an idle keep-alive connection is
    /// closed after it, and gives its place under `MAX_CONNECTIONS` back. Longer than
    /// the idle time-out of a load balancer in front (60 s is common), so that the
    /// balancer closes first.
    #[arg(long, env = "HTTP_IDLE_TIMEOUT_MS", default_value = "75000", value_parser = millis())]
    pub http_idle_timeout_ms: u64,

    /// Milliseconds a write to a client may wait for its socket to take any of it: a
    /// client that stops reading (an event stream's, above all) is then closed, and gives
    /// its places back (see `http/connections.rs`).
    #[arg(long, env = "HTTP_WRITE_TIMEOUT_MS", default_value = "20000", value_parser = millis())]
    pub http_write_timeout_ms: u64,

    /// Milliseconds start-up waits for the deployments to answer and be migrated. If none
    /// did by then, the process exits (non-zero). With several, once one is migrated the
    /// others are waited for 5 s more; then it serves those migrated and keeps migrating
    /// the others in the background, refusing what touches them until they are.
    #[arg(long, env = "STARTUP_PATIENCE_MS", default_value = "60000", value_parser = millis())]
    pub startup_patience_ms: u64,

    /// Milliseconds a hold lasts when its request does not say (`"hold": {}`), 1000 to
    /// 2592000000 (30 days): uncaptured by then, it expires and its money is available
    /// again.
    #[arg(
        long,
        env = "HOLD_EXPIRES_MS",
        default_value = "604800000",
        value_parser = hold_millis()
    )]
    pub hold_expires_ms: u64,

    /// Milliseconds an event is kept in the feed (`GET /events`), 1000 (so that tests can
    /// use seconds) to 3153600000000 (100 years); default 30 days. A cursor whose next
    /// events were removed answers 410 `cursor_expired`.
    #[arg(
        long,
        env = "EVENT_RETENTION_MS",
        default_value = "2592000000",
        value_parser = millis_within(1000..=3_153_600_000_000)
    )]
    pub event_retention_ms: u64,

    /// Event streams (`GET /events/stream`) open at once, at most, 1 to 100000; one more
    /// is refused with 503 `too_many_streams`.
    #[arg(long, env = "MAX_EVENT_STREAMS", default_value = "256", value_parser = whole_number(1..=100_000))]
    pub max_event_streams: usize,

    /// Event streams one tenant may hold open at once on this instance (the platform's
    /// keys count as one more tenant), 1 to 100000; one more is refused with 503
    /// `too_many_streams` while other tenants still get streams. Default: a quarter of
    /// `MAX_EVENT_STREAMS` (at least 1) with `API_KEYS`, all of them without (every caller
    /// is then the platform).
    #[arg(long, env = "MAX_EVENT_STREAMS_PER_TENANT", value_parser = whole_number(1..=100_000))]
    pub max_event_streams_per_tenant: Option<usize>,

    /// Milliseconds before the second attempt of a webhook delivery, doubled after each
    /// further failure (with jitter), 1 to 86400000.
    #[arg(long, env = "WEBHOOK_RETRY_BASE_MS", default_value = "1000", value_parser = millis())]
    pub webhook_retry_base_ms: u64,

    /// The longest wait between two attempts of a delivery, in milliseconds, 1 to
    /// 86400000.
    #[arg(long, env = "WEBHOOK_RETRY_MAX_MS", default_value = "3600000", value_parser = millis())]
    pub webhook_retry_max_ms: u64,

    /// How long a delivery is tried before it is marked failed, in milliseconds, 1 to
    /// 2592000000 (30 days); default 3 days.
    #[arg(long, env = "WEBHOOK_GIVE_UP_AFTER_MS", default_value = "259200000", value_parser = millis_within(1..=2_592_000_000))]
    pub webhook_give_up_after_ms: u64,

    /// `true`: webhooks may be sent to loopback, private, link-local and unique-local
    /// addresses (local development and tests). Default `false`.
    #[arg(long, env = "WEBHOOK_ALLOW_PRIVATE", default_value = "false", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub webhook_allow_private: bool,

    /// The most webhooks of one tenant (or of the platform's keys) registered at once, 1
    /// to 10000; one more is refused with 409 `webhook_limit_reached`.
    #[arg(long, env = "MAX_WEBHOOKS", default_value = "1000", value_parser = whole_number(1..=10_000))]
    pub max_webhooks: usize,

    /// The most webhooks registered at once in all, every tenant's and the platform's, 1
    /// to 100000; one more is refused with 409 `webhook_limit_reached`.
    #[arg(long, env = "MAX_WEBHOOKS_TOTAL", default_value = "10000", value_parser = whole_number(1..=100_000))]
    pub max_webhooks_total: usize,

    /// How a transfer is carried out: `two-phase` (the tutorial's protocol, the default) or
    /// `native` (one MongoDB multi-document transaction per transfer, for comparison).
    #[arg(
        long,
        env = "TRANSFER_STRATEGY",
        default_value = "two-phase",
        value_parser = one_of::<Strategy>()
    )]
    pub transfer_strategy: Strategy,

    /// Log output: `pretty` for people, `json` for one JSON object a line.
    #[arg(
        long,
        env = "LOG_FORMAT",
        default_value = "pretty",
        value_parser = one_of::<LogFormat>()
    )]
    pub log_format: LogFormat,

    /// Log filter in tracing's EnvFilter syntax, such as `info,transfer_service=debug`.
    #[arg(long, env = "RUST_LOG", default_value = "info", value_parser = log_filter)]
    pub rust_log: String,

    /// API keys, comma-separated `role:key` pairs: role `rw` may read and write, `ro` only
    /// read, `admin` also manage keys (`/api-keys`); all are platform keys, which see every
    /// tenant. Each key is 16 to 256 visible ASCII characters other than a comma. Unset or
    /// empty: no key is needed. Prefer the variable to the flag, which `ps` shows.
    // `std::vec::Vec` spelled out: clap's derive then takes the whole list as one value,
    // as the variable gives it, instead of collecting the flag given several times.
    #[arg(long, env = "API_KEYS", hide_env_values = true, value_parser = api_keys)]
    pub api_keys: Option<std::vec::Vec<ApiKey>>,

    /// Comma-separated origins (`scheme://host[:port]`) a browser may call the API from.
    /// Unset or empty: no CORS headers, so browsers allow only same-origin calls.
    #[arg(long, env = "CORS_ALLOWED_ORIGINS", value_parser = cors_origins)]
    pub cors_allowed_origins: Option<std::vec::Vec<String>>,
}

/// What an API key may do (`ro`, `rw`, `admin`).
pub use crate::domain::Role;

/// A configured API key. Only its SHA-256 digest is kept: equal-length digests are what
/// the authentication compares in constant time, and the key itself then never sits in
/// the settings to be logged or dumped by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub role: Role,
    pub sha256: [u8; 32],
    /// Scopes the idempotency keys this API key sends; stored with them.
    pub id: ApiKeyId,
}

impl ApiKey {
    pub fn new(role: Role, key: &str) -> ApiKey {
        use sha2::{Digest, Sha256};
        let sha256: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        // A digest of the digest under a label of its own, so that what is stored is
        // not what authentication compares; 128 bits, so that two keys never share one.
        let id = Sha256::new()
            .chain_update(b"transfer-service api key id\0")
            .chain_update(sha256)
            .finalize();
        let id = ApiKeyId::parse(&hex::encode(&id[..ApiKeyId::LEN / 2]))
            .expect("16 bytes are 32 lowercase hexadecimal digits");
        ApiKey { role, sha256, id }
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKey")
            .field("role", &self.role)
            .field("sha256", &"<redacted>")
            .field("id", &self.id.as_str())
            .finish()
    }
}

/// How logs are written (`LOG_FORMAT`: `pretty` or `json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Pretty,
    Json,
}

/// The spellings `TRANSFER_STRATEGY` accepts. Written here rather than derived in
/// `domain`, which knows nothing of flags and variables.
impl ValueEnum for Strategy {
    fn value_variants<'a>() -> &'a [Strategy] {
        &[Strategy::TwoPhase, Strategy::Native]
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(match self {
            Strategy::TwoPhase => "two-phase",
            Strategy::Native => "native",
        }))
    }
}

/// One deployment of `DEPLOYMENTS`: its name and its URI. `Debug` leaves the URI out,
/// since it may carry a password.
#[derive(Clone, PartialEq, Eq)]
pub struct Deployment {
    pub name: DeploymentName,
    pub uri: String,
}

impl std::fmt::Debug for Deployment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deployment")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The validated settings the application runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where the accounts live: `DEPLOYMENTS`, or `MONGODB_URI` as `default`. Never
    /// empty, names unique.
    pub deployments: Vec<Deployment>,
    /// The database (`MONGODB_DATABASE`) on every deployment.
    pub database: String,
    pub bind_addr: SocketAddr,
    pub instance_id: String,
    pub sweep_interval: Duration,
    pub stale_after: Duration,
    /// Batched writes in flight to the database at once (see `store::batch`).
    pub group_commit_writes: usize,
    /// Transfers worked on at once, at most (admission control, see `service`).
    pub max_transfers_in_flight: usize,
    /// How long a request beyond them waits for a permit before it is refused.
    pub admission_wait: Duration,
    /// Client connections served at once, at most (see `http::connections`).
    pub max_connections: usize,
    /// How long a connection may be idle before the headers of its next request.
    pub http_idle_timeout: Duration,
    /// How long a write to a client may wait for its socket.
    pub http_write_timeout: Duration,
    /// How long start-up waits for the deployments (see `startup`).
    pub startup_patience: Duration,
    /// How long a hold lasts when its request does not say.
    pub hold_expires: Duration,
    /// How long an event stays in the feed (see `recorder`).
    pub event_retention: Duration,
    /// Event streams open at once, at most.
    pub max_event_streams: usize,
    /// Event streams one tenant (or the platform) may hold at once; `None`: the default
    /// ([`Settings::streams_per_tenant`]).
    pub max_event_streams_per_tenant: Option<usize>,
    /// How webhooks are delivered (`WEBHOOK_*`).
    pub webhooks: crate::domain::WebhookSettings,
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
    /// The environment variable, also when the value came from its flag: the name an
    /// operator looks for in a deployment.
    pub variable: String,
    pub message: String,
}

impl ConfigError {
    /// Turns a value parser's rejection of one setting's value into the one line that
    /// names its variable. Any other error of clap's (`--help`, `--version`, an unknown
    /// flag, a flag without its value) is handed back for clap to answer with its usual
    /// screen.
    ///
    /// The message is what the parser said about the value: the complaint of a `Trimmed`
    /// parser, or the error of one of the functions below. clap's own rendering is never
    /// used, since it repeats the value, which for `API_KEYS` may be a real key.
    pub fn from_clap(error: clap::Error) -> Result<ConfigError, clap::Error> {
        if error.kind() != ErrorKind::ValueValidation {
            return Err(error);
        }
        // clap names the argument as its `Display` shows it: `--max-connections <MAX_CONNECTIONS>`.
        let Some(ContextValue::String(flag)) = error.get(ContextKind::InvalidArg) else {
            return Err(error);
        };
        let mut command = Args::command();
        command.build();
        let Some(variable) = command
            .get_arguments()
            .find(|arg| arg.to_string() == *flag)
            .and_then(|arg| arg.get_env())
        else {
            return Err(error);
        };
        let message = match (error.get(ContextKind::Custom), error.source()) {
            (Some(ContextValue::String(complaint)), _) => complaint.clone(),
            (_, Some(source)) => source.to_string(),
            _ => return Err(error),
        };
        Ok(ConfigError {
            variable: variable.to_string_lossy().into_owned(),
            message,
        })
    }
}

fn invalid(variable: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        variable: variable.to_owned(),
        message: message.into(),
    }
}

/// One of clap's parsers, given the value without surrounding whitespace, whose rejection
/// reads as one sentence about the value as given: `"0" is not a whole number from 1 to 64`.
#[derive(Clone)]
struct Trimmed<P> {
    parser: P,
    /// What is wrong with a rejected value; follows the quoted value.
    complaint: String,
}

impl<P: TypedValueParser> TypedValueParser for Trimmed<P> {
    type Value = P::Value;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<P::Value, clap::Error> {
        let trimmed = value.to_str().map_or(value, |v| OsStr::new(v.trim()));
        self.parser.parse_ref(cmd, arg, trimmed).map_err(|_| {
            let value = value.to_string_lossy();
            let mut error = clap::Error::new(ErrorKind::ValueValidation).with_cmd(cmd);
            if let Some(arg) = arg {
                error.insert(
                    ContextKind::InvalidArg,
                    ContextValue::String(arg.to_string()),
                );
            }
            error.insert(
                ContextKind::InvalidValue,
                ContextValue::String(value.clone().into_owned()),
            );
            error.insert(
                ContextKind::Custom,
                ContextValue::String(format!("{value:?} {}", self.complaint)),
            );
            error
        })
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        self.parser.possible_values()
    }
}

/// A count within `range`.
fn whole_number(range: RangeInclusive<u64>) -> Trimmed<RangedU64ValueParser<usize>> {
    Trimmed {
        complaint: format!(
            "is not a whole number from {} to {}",
            range.start(),
            range.end()
        ),
        parser: RangedU64ValueParser::new().range(range),
    }
}

/// How long a hold lasts, in milliseconds: one second to 30 days.
fn hold_millis() -> Trimmed<RangedU64ValueParser<u64>> {
    const MILLIS: RangeInclusive<u64> = crate::domain::HOLD_EXPIRY_MS;
    Trimmed {
        complaint: format!(
            "is not a whole number of milliseconds from {} to {}",
            MILLIS.start(),
            MILLIS.end()
        ),
        parser: clap::value_parser!(u64).range(MILLIS),
    }
}

/// A duration in milliseconds, from 1 ms to one day.
fn millis() -> Trimmed<RangedU64ValueParser<u64>> {
    millis_within(1..=86_400_000)
}

/// A duration in milliseconds within `range`.
fn millis_within(range: RangeInclusive<u64>) -> Trimmed<RangedU64ValueParser<u64>> {
    Trimmed {
        complaint: format!(
            "is not a whole number of milliseconds from {} to {}",
            range.start(),
            range.end()
        ),
        parser: clap::value_parser!(u64).range(range),
    }
}

/// One of a [`ValueEnum`]'s spellings, exactly (case matters).
fn one_of<E: ValueEnum + Clone + Send + Sync + 'static>() -> Trimmed<EnumValueParser<E>> {
    let names: Vec<String> = E::value_variants()
        .iter()
        .filter_map(E::to_possible_value)
        .map(|value| value.get_name().to_owned())
        .collect();
    let complaint = match names.as_slice() {
        [one, other] => format!("is neither {one} nor {other}"),
        _ => format!("is not one of {}", names.join(", ")),
    };
    Trimmed {
        parser: EnumValueParser::new(),
        complaint,
    }
}

/// Why one of the value parsers below refused a value: what follows `invalid VARIABLE: `
/// on the line [`ConfigError::from_clap`] makes of it.
#[derive(Debug, thiserror::Error)]
enum BadValue {
    #[error("must start with mongodb:// or mongodb+srv://")]
    MongodbUri,
    #[error("must be 1 to 63 characters without / \\ . space \" or $")]
    DatabaseName,
    /// The value as given.
    #[error("{0:?} is not host:port, such as 127.0.0.1:8080")]
    SocketAddr(String),
    #[error("must be 1 to 128 visible ASCII characters")]
    InstanceId,
    #[error(transparent)]
    LogFilter(#[from] tracing_subscriber::filter::ParseError),
    /// A list's parser (`parse_api_keys`, `parse_deployments`, `parse_cors_origins`)
    /// refused it: its message, without the variable, which the line names already.
    #[error("{}", .0.message)]
    List(#[from] ConfigError),
}

fn mongodb_uri(raw: &str) -> Result<String, BadValue> {
    let uri = raw.trim();
    if uri.starts_with("mongodb://") || uri.starts_with("mongodb+srv://") {
        Ok(uri.to_owned())
    } else {
        Err(BadValue::MongodbUri)
    }
}

/// MongoDB's rules for a database name.
fn database_name(raw: &str) -> Result<String, BadValue> {
    let name = raw.trim();
    if name.is_empty() || name.len() > 63 || name.chars().any(|c| "/\\. \"$\0".contains(c)) {
        return Err(BadValue::DatabaseName);
    }
    Ok(name.to_owned())
}

fn socket_addr(raw: &str) -> Result<SocketAddr, BadValue> {
    raw.trim()
        .parse()
        .map_err(|_| BadValue::SocketAddr(raw.to_owned()))
}

fn instance_id(raw: &str) -> Result<String, BadValue> {
    let id = raw.trim();
    if id.is_empty() || id.len() > 128 || !id.chars().all(|c| c.is_ascii_graphic()) {
        return Err(BadValue::InstanceId);
    }
    Ok(id.to_owned())
}

fn log_filter(raw: &str) -> Result<String, BadValue> {
    let filter = raw.trim();
    tracing_subscriber::EnvFilter::try_new(filter)?;
    Ok(filter.to_owned())
}

fn api_keys(raw: &str) -> Result<Vec<ApiKey>, BadValue> {
    Ok(parse_api_keys(raw)?)
}

fn deployments(raw: &str) -> Result<Vec<Deployment>, BadValue> {
    Ok(parse_deployments(raw)?)
}

/// Parses `DEPLOYMENTS`: comma-separated `name=uri` pairs. The messages name an entry
/// by its position and name, never by its URI, which may carry a password.
pub fn parse_deployments(raw: &str) -> Result<Vec<Deployment>, ConfigError> {
    const VARIABLE: &str = "DEPLOYMENTS";
    if raw.trim().is_empty() {
        return Err(invalid(
            VARIABLE,
            "is empty; unset it to use MONGODB_URI alone",
        ));
    }
    // A URI's own commas (between hosts, in tag sets) are followed by a host or an
    // option value, never by `word=`, whose word has no `/ : ? @ &`.
    let starts_pair = |piece: &str| {
        piece
            .split_once('=')
            .is_some_and(|(before, _)| !before.contains(['/', ':', '?', '@', '&']))
    };
    let mut entries: Vec<String> = Vec::new();
    for piece in raw.split(',') {
        match entries.last_mut() {
            Some(entry) if !starts_pair(piece) => {
                entry.push(',');
                entry.push_str(piece);
            }
            _ => entries.push(piece.to_owned()),
        }
    }
    let mut list: Vec<Deployment> = Vec::new();
    for (index, entry) in entries.iter().enumerate() {
        let n = index + 1;
        let Some((name, uri)) = entry.trim().split_once('=') else {
            return Err(invalid(VARIABLE, format!("entry {n} is not name=uri")));
        };
        let name = DeploymentName::parse(name.trim())
            .map_err(|e| invalid(VARIABLE, format!("entry {n}: the name {e}")))?;
        let uri = mongodb_uri(uri)
            .map_err(|e| invalid(VARIABLE, format!("entry {n} ({name}): the URI {e}")))?;
        if list.iter().any(|d| d.name == name) {
            return Err(invalid(
                VARIABLE,
                format!("entry {n}: {name} is named twice"),
            ));
        }
        list.push(Deployment { name, uri });
    }
    Ok(list)
}

fn cors_origins(raw: &str) -> Result<Vec<String>, BadValue> {
    Ok(parse_cors_origins(raw)?)
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
                format!("entry {n} is not role:key (role rw, ro or admin)"),
            ));
        };
        let Ok(role) = Role::parse(role.trim()) else {
            return Err(invalid(
                VARIABLE,
                format!("entry {n} has a role other than rw, ro or admin"),
            ));
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
    /// Event streams one tenant (or the platform, counted as one more) may hold at once:
    /// `MAX_EVENT_STREAMS_PER_TENANT`, or by default a quarter of `MAX_EVENT_STREAMS`
    /// (at least 1), so that one tenant leaves three quarters to the others; all of them
    /// without `API_KEYS`, where every caller is the platform and there is no one to
    /// share with. Never more than `MAX_EVENT_STREAMS`.
    pub fn streams_per_tenant(&self) -> usize {
        let share = match self.max_event_streams_per_tenant {
            Some(share) => share,
            None if self.api_keys.is_empty() => self.max_event_streams,
            None => self.max_event_streams / 4,
        };
        share.clamp(1, self.max_event_streams.max(1))
    }

    /// Reads the process's flags and environment. `--help`, `--version` and a misused
    /// command line (an unknown flag) are answered by clap, which then exits.
    pub fn from_env() -> Result<Settings, ConfigError> {
        Settings::try_parse_from(std::env::args_os())
            .map_err(|error| ConfigError::from_clap(error).unwrap_or_else(|error| error.exit()))
    }

    /// Parses `argv` (the program's name first) and the environment. The error is clap's,
    /// for [`ConfigError::from_clap`] to word.
    pub fn try_parse_from<I, T>(argv: I) -> Result<Settings, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        Args::try_parse_from(argv).map(Settings::from_args)
    }

    /// Every value in `args` is already valid; what remains is units and defaults.
    pub fn from_args(args: Args) -> Settings {
        Settings {
            deployments: args.deployments.unwrap_or_else(|| {
                vec![Deployment {
                    name: DeploymentName::default(),
                    uri: args.mongodb_uri,
                }]
            }),
            database: args.mongodb_database,
            bind_addr: args.bind_addr,
            instance_id: args.instance_id.unwrap_or_else(default_instance_id),
            sweep_interval: Duration::from_millis(args.sweep_interval_ms),
            stale_after: Duration::from_millis(args.stale_after_ms),
            group_commit_writes: args.group_commit_writes,
            max_transfers_in_flight: args.max_transfers_in_flight,
            admission_wait: Duration::from_millis(args.admission_wait_ms),
            max_connections: args.max_connections,
            http_idle_timeout: Duration::from_millis(args.http_idle_timeout_ms),
            http_write_timeout: Duration::from_millis(args.http_write_timeout_ms),
            startup_patience: Duration::from_millis(args.startup_patience_ms),
            hold_expires: Duration::from_millis(args.hold_expires_ms),
            event_retention: Duration::from_millis(args.event_retention_ms),
            max_event_streams: args.max_event_streams,
            max_event_streams_per_tenant: args.max_event_streams_per_tenant,
            webhooks: crate::domain::WebhookSettings {
                retry_base: Duration::from_millis(args.webhook_retry_base_ms),
                retry_max: Duration::from_millis(args.webhook_retry_max_ms),
                give_up_after: Duration::from_millis(args.webhook_give_up_after_ms),
                allow_private: args.webhook_allow_private,
                max_webhooks: args.max_webhooks,
                max_webhooks_total: args.max_webhooks_total,
            },
            strategy: args.transfer_strategy,
            log_format: args.log_format,
            log_filter: args.rust_log,
            api_keys: args.api_keys.unwrap_or_default(),
            cors_allowed_origins: args.cors_allowed_origins.unwrap_or_default(),
        }
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

    /// The settings from these flags, or the one line `main` would print.
    fn settings(extra: &[&str]) -> Result<Settings, ConfigError> {
        let argv = std::iter::once("transfer-service").chain(extra.iter().copied());
        Settings::try_parse_from(argv).map_err(|error| {
            ConfigError::from_clap(error)
                .unwrap_or_else(|error| panic!("not about a value: {}", error.render()))
        })
    }

    #[test]
    fn defaults_are_usable() {
        let s = settings(&[]).unwrap();
        assert_eq!(s.database, "bank");
        assert_eq!(s.sweep_interval, Duration::from_millis(1000));
        assert_eq!(s.stale_after, Duration::from_millis(10_000));
        assert_eq!(s.group_commit_writes, 2);
        assert_eq!(s.max_transfers_in_flight, 512);
        assert_eq!(s.admission_wait, Duration::from_millis(1000));
        assert_eq!(s.max_connections, 1024);
        assert_eq!(s.http_idle_timeout, Duration::from_millis(75_000));
        assert_eq!(s.http_write_timeout, Duration::from_millis(20_000));
        assert_eq!(s.startup_patience, Duration::from_secs(60));
        assert!(s.instance_id.ends_with(&format!("-{}", std::process::id())));
    }

    #[test]
    fn max_webhooks_total_is_ten_thousand_unless_set_from_1_to_100000() {
        let total = |extra: &[&str]| settings(extra).map(|s| s.webhooks.max_webhooks_total);
        assert_eq!(total(&[]).unwrap(), 10_000);
        assert_eq!(total(&["--max-webhooks-total", "1"]).unwrap(), 1);
        assert_eq!(total(&["--max-webhooks-total", "100000"]).unwrap(), 100_000);
        for bad in ["0", "100001", "-1", "1.5"] {
            let line = total(&[&format!("--max-webhooks-total={bad}")])
                .unwrap_err()
                .to_string();
            let complaint = "is not a whole number from 1 to 100000";
            assert_eq!(
                line,
                format!("invalid MAX_WEBHOOKS_TOTAL: {bad:?} {complaint}")
            );
        }
    }

    #[test]
    fn a_tenants_share_of_the_streams_is_a_quarter_with_keys_and_all_without() {
        let keys = ["--api-keys", "admin:0123456789abcdef0123"];
        let share = |extra: &[&str]| settings(extra).unwrap().streams_per_tenant();
        assert_eq!(share(&keys), 64, "a quarter of the default 256");
        assert_eq!(share(&[]), 256, "without keys every caller is the platform");
        let few = [&keys[..], &["--max-event-streams", "3"]].concat();
        assert_eq!(share(&few), 1, "at least one");
        let set = [&few[..], &["--max-event-streams-per-tenant", "2"]].concat();
        assert_eq!(share(&set), 2);
        let over = [&few[..], &["--max-event-streams-per-tenant", "9"]].concat();
        assert_eq!(share(&over), 3, "never more than MAX_EVENT_STREAMS");
        for bad in ["0", "100001", "-1", "1.5"] {
            let line = settings(&[&format!("--max-event-streams-per-tenant={bad}")])
                .unwrap_err()
                .to_string();
            let complaint = "is not a whole number from 1 to 100000";
            assert_eq!(
                line,
                format!("invalid MAX_EVENT_STREAMS_PER_TENANT: {bad:?} {complaint}")
            );
        }
    }

    #[test]
    fn without_deployments_mongodb_uri_is_the_default_deployment() {
        let s = settings(&["--mongodb-uri", "mongodb://db:27017"]).unwrap();
        assert_eq!(s.deployments.len(), 1);
        assert_eq!(s.deployments[0].name.as_str(), "default");
        assert_eq!(s.deployments[0].uri, "mongodb://db:27017");
    }

    #[test]
    fn deployments_are_name_uri_pairs_in_order_and_a_uri_may_list_hosts() {
        let raw = "eu=mongodb://a:1,b:2,c:3/?replicaSet=rs&readPreferenceTags=dc:x,rack:1, us=mongodb+srv://user:pw@us.example.net/?w=majority,cn_1=mongodb://z";
        let s = settings(&["--deployments", raw]).unwrap();
        let names: Vec<&str> = s.deployments.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["eu", "us", "cn_1"]);
        assert_eq!(
            s.deployments[0].uri,
            "mongodb://a:1,b:2,c:3/?replicaSet=rs&readPreferenceTags=dc:x,rack:1"
        );
        assert_eq!(
            s.deployments[1].uri,
            "mongodb+srv://user:pw@us.example.net/?w=majority"
        );
        // The URI (and its password) never shows in the settings' Debug.
        let debug = format!("{s:?}");
        assert!(!debug.contains("pw@"), "{debug}");
    }

    #[test]
    fn a_bad_deployments_value_names_the_entry_and_never_its_uri() {
        let cases: [(&str, &str); 6] = [
            ("", "is empty"),
            ("eu", "entry 1 is not name=uri"),
            ("EU=mongodb://secret@a", "entry 1: the name must be 1 to 32"),
            (
                "eu=mongodb://a,us=http://secret@b",
                "entry 2 (us): the URI must start with mongodb://",
            ),
            (
                "eu=mongodb://a,eu=mongodb://secret@b",
                "entry 2: eu is named twice",
            ),
            (
                &format!("{}=mongodb://a", "d".repeat(33)),
                "entry 1: the name must be 1 to 32",
            ),
        ];
        for (raw, said) in cases {
            let err = settings(&["--deployments", raw]).unwrap_err();
            assert_eq!(err.variable, "DEPLOYMENTS", "{raw}");
            assert!(err.message.contains(said), "{raw}: {}", err.message);
            assert!(!err.to_string().contains("secret"), "{err}");
        }
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
            let err = settings(flags).unwrap_err();
            assert_eq!(err.variable, variable);
            assert!(
                err.to_string()
                    .starts_with(&format!("invalid {variable}: "))
            );
        }
    }

    #[test]
    fn each_count_and_duration_accepts_its_bounds_and_names_its_variable_beyond_them() {
        let millis = "is not a whole number of milliseconds from 1 to 86400000";
        let cases = [
            (
                "--sweep-interval-ms",
                "SWEEP_INTERVAL_MS",
                1,
                86_400_000,
                millis,
            ),
            ("--stale-after-ms", "STALE_AFTER_MS", 1, 86_400_000, millis),
            (
                "--http-idle-timeout-ms",
                "HTTP_IDLE_TIMEOUT_MS",
                1,
                86_400_000,
                millis,
            ),
            (
                "--group-commit-writes",
                "GROUP_COMMIT_WRITES",
                1,
                64,
                "is not a whole number from 1 to 64",
            ),
            (
                "--max-transfers-in-flight",
                "MAX_TRANSFERS_IN_FLIGHT",
                1,
                100_000,
                "is not a whole number from 1 to 100000",
            ),
            (
                "--max-connections",
                "MAX_CONNECTIONS",
                1,
                100_000,
                "is not a whole number from 1 to 100000",
            ),
            (
                "--admission-wait-ms",
                "ADMISSION_WAIT_MS",
                0,
                10_000,
                "is not a whole number of milliseconds from 0 to 10000",
            ),
        ];
        for (flag, variable, min, max, complaint) in cases {
            for good in [min, max] {
                assert!(
                    settings(&[flag, &good.to_string()]).is_ok(),
                    "{flag} {good}"
                );
            }
            let beyond = (max + 1).to_string();
            let below = (min > 0).then(|| (min - 1).to_string());
            let bad_values = [beyond.as_str(), "-1", "", "1.5", "1e3"];
            for bad in below.as_deref().into_iter().chain(bad_values) {
                let line = settings(&[&format!("{flag}={bad}")])
                    .unwrap_err()
                    .to_string();
                assert_eq!(line, format!("invalid {variable}: {bad:?} {complaint}"));
            }
        }
    }

    #[test]
    fn a_rejected_value_reads_as_before() {
        let cases: [(&[&str], &str); 9] = [
            (
                &["--max-connections", "0"],
                r#"invalid MAX_CONNECTIONS: "0" is not a whole number from 1 to 100000"#,
            ),
            (
                &["--sweep-interval-ms", " soon"],
                r#"invalid SWEEP_INTERVAL_MS: " soon" is not a whole number of milliseconds from 1 to 86400000"#,
            ),
            (
                &["--transfer-strategy", "Native"],
                r#"invalid TRANSFER_STRATEGY: "Native" is neither two-phase nor native"#,
            ),
            (
                &["--log-format", "xml"],
                r#"invalid LOG_FORMAT: "xml" is neither pretty nor json"#,
            ),
            (
                &["--bind-addr", "localhost"],
                r#"invalid BIND_ADDR: "localhost" is not host:port, such as 127.0.0.1:8080"#,
            ),
            (
                &["--instance-id", "a b"],
                "invalid INSTANCE_ID: must be 1 to 128 visible ASCII characters",
            ),
            (
                &["--mongodb-uri", "http://x"],
                "invalid MONGODB_URI: must start with mongodb:// or mongodb+srv://",
            ),
            (
                &["--mongodb-database", "a.b"],
                r#"invalid MONGODB_DATABASE: must be 1 to 63 characters without / \ . space " or $"#,
            ),
            (
                &["--api-keys", "rw"],
                "invalid API_KEYS: entry 1 is not role:key (role rw, ro or admin)",
            ),
        ];
        for (flags, line) in cases {
            assert_eq!(settings(flags).unwrap_err().to_string(), line);
        }
        let line = settings(&["--rust-log", "info,=x=y"])
            .unwrap_err()
            .to_string();
        assert!(line.starts_with("invalid RUST_LOG: "), "{line}");
    }

    #[test]
    fn surrounding_whitespace_is_ignored() {
        let s = settings(&[
            "--max-connections",
            " 7 ",
            "--stale-after-ms",
            "\t250\n",
            "--log-format",
            " json",
            "--transfer-strategy",
            "native ",
            "--bind-addr",
            " 0.0.0.0:9000 ",
            "--mongodb-database",
            " ledger ",
        ])
        .unwrap();
        assert_eq!(s.max_connections, 7);
        assert_eq!(s.stale_after, Duration::from_millis(250));
        assert_eq!(s.log_format, LogFormat::Json);
        assert_eq!(s.strategy, Strategy::Native);
        assert_eq!(s.bind_addr, "0.0.0.0:9000".parse().unwrap());
        assert_eq!(s.database, "ledger");
    }

    #[test]
    fn the_modes_have_their_spellings_exactly() {
        for (raw, strategy) in [
            ("two-phase", Strategy::TwoPhase),
            ("native", Strategy::Native),
        ] {
            assert_eq!(
                settings(&["--transfer-strategy", raw]).unwrap().strategy,
                strategy
            );
        }
        for (raw, format) in [("pretty", LogFormat::Pretty), ("json", LogFormat::Json)] {
            assert_eq!(settings(&["--log-format", raw]).unwrap().log_format, format);
        }
        for raw in ["two_phase", "twophase", "NATIVE", "Two-Phase"] {
            let err = settings(&["--transfer-strategy", raw]).unwrap_err();
            assert_eq!(err.variable, "TRANSFER_STRATEGY");
        }
        for raw in ["JSON", "Pretty", "text"] {
            let err = settings(&["--log-format", raw]).unwrap_err();
            assert_eq!(err.variable, "LOG_FORMAT");
        }
    }

    #[test]
    fn help_version_and_a_misused_command_line_are_left_to_clap() {
        let help = Settings::try_parse_from(["transfer-service", "--help"]).unwrap_err();
        let help = ConfigError::from_clap(help).unwrap_err();
        assert_eq!(help.kind(), ErrorKind::DisplayHelp);
        let text = help.render().to_string();
        for expected in [
            "--max-connections <MAX_CONNECTIONS>",
            "[env: MAX_CONNECTIONS=",
            "[default: 1024]",
            "[possible values: two-phase, native]",
            "[possible values: pretty, json]",
            "--api-keys <API_KEYS>",
        ] {
            assert!(text.contains(expected), "{expected:?} in {text}");
        }
        let version = Settings::try_parse_from(["transfer-service", "--version"]).unwrap_err();
        assert_eq!(
            ConfigError::from_clap(version).unwrap_err().kind(),
            ErrorKind::DisplayVersion
        );
        let unknown =
            Settings::try_parse_from(["transfer-service", "--max-connection", "5"]).unwrap_err();
        assert_eq!(
            ConfigError::from_clap(unknown).unwrap_err().kind(),
            ErrorKind::UnknownArgument
        );
        for flag in ["--max-connections", "--api-keys", "--log-format"] {
            let missing = Settings::try_parse_from(["transfer-service", flag]).unwrap_err();
            let missing = ConfigError::from_clap(missing).unwrap_err();
            assert!(
                missing.render().to_string().contains("a value is required"),
                "{flag}: {}",
                missing.render()
            );
        }
    }

    #[test]
    fn the_command_definition_passes_clap_s_own_checks() {
        Args::command().debug_assert();
    }

    const RW_KEY: &str = "rw-key-0123456789abcdef";
    const RO_KEY: &str = "ro-key-0123456789abcdef";

    #[test]
    fn api_keys_are_role_key_pairs_kept_only_as_digests() {
        let s = settings(&["--api-keys", &format!(" rw:{RW_KEY} , ro:{RO_KEY}")]).unwrap();
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
        let debug = format!("{:?}", args(&["--api-keys", &format!("rw:{RW_KEY}")]));
        assert!(!debug.contains(RW_KEY), "{debug}");
    }

    /// An API key's id scopes the idempotency keys stored with it: a change of how it is
    /// derived would make every retry of a request taken before it a new request.
    #[test]
    fn an_api_key_s_id_is_fixed_by_the_key_and_is_neither_the_key_nor_its_digest() {
        let rw = ApiKey::new(Role::ReadWrite, RW_KEY);
        assert_eq!(rw.id.as_str(), "159d9c9b27e891808bf706c97d704328");
        // The role is no part of it: a key moved from ro to rw keeps its keys.
        assert_eq!(ApiKey::new(Role::ReadOnly, RW_KEY).id, rw.id);
        assert_ne!(ApiKey::new(Role::ReadWrite, RO_KEY).id, rw.id);
        assert!(!hex::encode(rw.sha256).starts_with(rw.id.as_str()));
        assert!(!format!("{rw:?}").contains(RW_KEY));
    }

    #[test]
    fn without_api_keys_the_api_is_open() {
        assert!(settings(&[]).unwrap().api_keys.is_empty());
        assert!(settings(&["--api-keys", " "]).unwrap().api_keys.is_empty());
        assert!(parse_api_keys("  ").unwrap().is_empty());
    }

    #[test]
    fn a_bad_api_keys_entry_names_the_variable_and_never_echoes_the_key() {
        let secret = "s3cret-0123456789abcdef";
        let cases = [
            (
                format!("root:{secret}"),
                "entry 1 has a role other than rw, ro or admin",
            ),
            (
                format!("{secret}:rw"),
                "entry 1 has a role other than rw, ro or admin",
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
            let err = settings(&["--api-keys", &raw]).unwrap_err();
            let line = err.to_string();
            assert_eq!(err.variable, "API_KEYS");
            assert!(line.starts_with("invalid API_KEYS: "), "{line}");
            assert!(line.contains(expected), "{raw:?}: {line}");
            let debug = format!("{err:?}");
            for shown in [&line, &debug] {
                assert!(
                    !shown.contains("s3cret") && !shown.contains("short"),
                    "{shown}"
                );
            }
        }
    }

    #[test]
    fn cors_origins_are_exact_lowercase_origins() {
        let s = settings(&[
            "--cors-allowed-origins",
            "https://App.Example.com, http://localhost:3000,https://app.example.com",
        ])
        .unwrap();
        assert_eq!(
            s.cors_allowed_origins,
            ["https://app.example.com", "http://localhost:3000"]
        );
        assert!(settings(&[]).unwrap().cors_allowed_origins.is_empty());
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
            let err = settings(&["--cors-allowed-origins", raw]).unwrap_err();
            assert_eq!(err.variable, "CORS_ALLOWED_ORIGINS", "{raw}");
            assert!(
                err.to_string()
                    .starts_with("invalid CORS_ALLOWED_ORIGINS: "),
                "{err}"
            );
        }
    }
}
