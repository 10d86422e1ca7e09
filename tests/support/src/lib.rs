//! Test support shared by every test binary (a library crate the package's tests
//! depend on): a real database server and a running instance of the service on a random
//! port, with its own database per test.
//!
//! The database is the server named by `MONGODB_URI` when it is set (a real mongod
//! replica set, say). Tests of several deployments ([`database_uris`]) take the others
//! from `MONGODB_URIS` (whitespace-separated URIs, one per further deployment) when it is
//! set. Otherwise each test binary starts its SecantusDB daemons (one, or one per
//! deployment)
//! (`secantusd-rs`, found through `SECANTUSD_BIN`, `PATH`, or the cache that
//! `scripts/install-secantus.sh` fills) with `--sync-on-commit`, in a temporary folder.
//! The daemon is started from a thread that lives as long as the test process and asks
//! the kernel to kill it when that thread goes, so no daemon outlives the tests; its
//! folder goes at exit too.
//!
//! Tests wait for what they cannot be told about through [`eventually`] and
//! [`poll_until`] ([`poll`]). The ledger's guarantees are checked by one module,
//! [`ledger`], for every binary that moves money.

pub mod ledger;
pub mod poll;
pub mod process;
pub mod proxy;

pub use poll::{eventually, poll_until};

/// The `transfer-service` binary cargo built for the calling integration test, as a
/// `&Path` (see [`process`]).
#[macro_export]
macro_rules! service_binary {
    () => {
        ::std::path::Path::new(env!("CARGO_BIN_EXE_transfer-service"))
    };
}

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use mongodb::bson::doc;
use tokio_util::sync::CancellationToken;
use transfer_service::config::{LogFormat, Settings};
use transfer_service::startup::Application;
use transfer_service::store::Store;

/// The URI of the database server the tests use.
pub fn database_uri() -> String {
    static URI: OnceLock<String> = OnceLock::new();
    URI.get_or_init(|| match std::env::var("MONGODB_URI") {
        Ok(uri) if !uri.trim().is_empty() => uri,
        _ => start_secantus(),
    })
    .clone()
}

/// The URIs of `n` separate database servers, standing for `n` deployments: the first
/// is [`database_uri`]; the others come from `MONGODB_URIS`, or are SecantusDB daemons of
/// this process, started once and shared by its tests.
///
/// # Panics
/// If `MONGODB_URIS` names fewer than `n - 1` servers.
pub fn database_uris(n: usize) -> Vec<String> {
    static MORE: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut uris = vec![database_uri()];
    let mut more = MORE.lock().unwrap_or_else(|e| e.into_inner());
    match std::env::var("MONGODB_URIS") {
        Ok(listed) if !listed.trim().is_empty() => {
            let listed: Vec<String> = listed.split_whitespace().map(str::to_owned).collect();
            assert!(
                listed.len() >= n - 1,
                "MONGODB_URIS names {} servers; this test needs {}",
                listed.len(),
                n - 1
            );
            *more = listed;
        }
        _ => {
            while more.len() < n - 1 {
                more.push(start_secantus());
            }
        }
    }
    uris.extend(more.iter().take(n - 1).cloned());
    uris
}

/// Where the SecantusDB daemon binary is.
pub fn secantusd_binary() -> PathBuf {
    if let Ok(bin) = std::env::var("SECANTUSD_BIN") {
        return PathBuf::from(bin);
    }
    if let Some(paths) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join("secantusd-rs");
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let cached = PathBuf::from(home).join(".cache/transfer-service/secantus/bin/secantusd-rs");
    assert!(
        cached.is_file(),
        "no database for the tests: set MONGODB_URI, or run scripts/test.sh, which installs secantusd-rs"
    );
    cached
}

/// A SecantusDB daemon owned by the test process.
pub struct Daemon {
    pub uri: String,
    pub port: u16,
    pub storage: PathBuf,
    child: std::process::Child,
}

impl Daemon {
    /// Starts a daemon on `port` (0: any free port) with its data in `storage`.
    pub fn start(storage: PathBuf, port: u16) -> Daemon {
        Daemon::start_with_env(storage, port, &[])
    }

    /// [`Daemon::start`] with more environment variables (libfaketime's, say).
    pub fn start_with_env(storage: PathBuf, port: u16, env: &[(String, String)]) -> Daemon {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new(secantusd_binary());
        command.envs(env.iter().cloned());
        command
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--log-level",
                "WARNING",
                "--sync-on-commit",
            ])
            .arg("--storage-path")
            .arg(&storage)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        // SAFETY: prctl is async-signal-safe; it only asks the kernel to SIGKILL the
        // daemon when the thread that started it exits.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = command.spawn().expect("start secantusd-rs");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the daemon's first line");
        let port: u16 = line
            .trim()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("unexpected first line from secantusd-rs: {line:?}"));
        Daemon {
            uri: format!("mongodb://127.0.0.1:{port}/?directConnection=true"),
            port,
            storage,
            child,
        }
    }

    /// kill -9.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends `signal` (libc::SIGSTOP freezes the daemon: its connections stay open and
    /// nothing answers; libc::SIGCONT thaws it).
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.child.id() as i32, signal) };
        assert_eq!(rc, 0, "kill({signal})");
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What the process-wide daemon's folder names start with; the process id follows, so
/// that a later run can tell the folders of runs that are gone.
const SHARED_FOLDER_PREFIX: &str = "transfer-service-test-db-";

/// The process-wide daemons and their folders, for the exit handler to remove.
static SHARED: std::sync::Mutex<Vec<(Daemon, tempfile::TempDir)>> =
    std::sync::Mutex::new(Vec::new());

/// The folder of the first process-wide daemon, once started (`None` with `MONGODB_URI`).
pub fn shared_daemon_folder() -> Option<PathBuf> {
    let shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    shared.first().map(|(_, dir)| dir.path().to_owned())
}

/// Starts a process-wide daemon on a thread that never exits, so that PDEATHSIG fires
/// only when the whole test process goes.
///
/// Its folder (about 130 MB once WiredTiger has preallocated its log) goes when the
/// process exits: the test harness exits through `exit`, which runs the handler
/// registered here, and no destructor runs for what a never-ending thread holds. A run
/// that never reached `exit` (killed, aborted) leaves its folder behind: the next run
/// removes the folders whose process is gone.
fn start_secantus() -> String {
    remove_folders_of_finished_runs();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{SHARED_FOLDER_PREFIX}{}-", std::process::id()))
            .tempdir()
            .expect("temp dir");
        let daemon = Daemon::start(dir.path().to_path_buf(), 0);
        let uri = daemon.uri.clone();
        let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if shared.is_empty() {
            // SAFETY: registers a plain function with the C library, once per process.
            let registered = unsafe { libc::atexit(stop_shared_daemons) };
            assert_eq!(registered, 0, "atexit");
        }
        shared.push((daemon, dir));
        drop(shared);
        tx.send(uri).expect("send uri");
        loop {
            std::thread::park();
        }
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("secantusd-rs did not start")
}

/// At exit: kills the process-wide daemons and removes their folders.
extern "C" fn stop_shared_daemons() {
    // try_lock: a thread still running at exit may hold it; then leave the folders to the
    // next run rather than hang.
    if let Ok(mut shared) = SHARED.try_lock() {
        for (mut daemon, dir) in shared.drain(..) {
            daemon.kill();
            drop(dir);
        }
    }
}

/// Removes the shared-daemon folders of test processes that no longer run.
fn remove_folders_of_finished_runs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name
            .to_str()
            .and_then(|n| n.strip_prefix(SHARED_FOLDER_PREFIX))
        else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: signal 0 only asks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A fresh database name, so tests never see each other's data.
pub fn fresh_database_name() -> String {
    format!("test_{}", mongodb::bson::oid::ObjectId::new().to_hex())
}

pub fn settings(uri: &str, database: &str) -> Settings {
    Settings {
        deployments: vec![transfer_service::config::Deployment {
            name: Default::default(),
            uri: uri.to_owned(),
        }],
        database: database.to_owned(),
        bind_addr: "127.0.0.1:0".parse().unwrap(),
        instance_id: format!("test-{}", mongodb::bson::oid::ObjectId::new().to_hex()),
        sweep_interval: Duration::from_millis(100),
        stale_after: Duration::from_millis(1000),
        group_commit_writes: transfer_service::store::DEFAULT_GROUP_COMMIT_WRITES,
        max_transfers_in_flight: 512,
        admission_wait: transfer_service::service::DEFAULT_ADMISSION_WAIT,
        max_connections: 1024,
        http_idle_timeout: Duration::from_secs(75),
        http_write_timeout: Duration::from_secs(20),
        startup_patience: Duration::from_secs(60),
        hold_expires: transfer_service::service::DEFAULT_HOLD_EXPIRY,
        event_retention: transfer_service::recorder::DEFAULT_RETENTION,
        max_event_streams: transfer_service::service::DEFAULT_MAX_FOLLOWERS,
        max_event_streams_per_tenant: None,
        // Tests send webhooks to receivers on this host.
        webhooks: transfer_service::service::WebhookSettings {
            allow_private: true,
            ..Default::default()
        },
        strategy: transfer_service::domain::Strategy::TwoPhase,
        log_format: LogFormat::Pretty,
        log_filter: "warn".into(),
        api_keys: Vec::new(),
        cors_allowed_origins: Vec::new(),
    }
}

/// A running instance of the service with its own database.
pub struct TestApp {
    pub address: String,
    pub http: reqwest::Client,
    /// Direct access to the same database, to check what is stored.
    pub store: Store,
    pub database: String,
    /// The `INSTANCE_ID` of this instance: the owner it writes into `application`.
    pub instance_id: String,
    shutdown: CancellationToken,
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

/// Starts the service with settings adjusted by `adjust`.
pub async fn spawn_app_with(adjust: impl FnOnce(&mut Settings)) -> TestApp {
    let uri = database_uri();
    let database = fresh_database_name();
    let mut settings = settings(&uri, &database);
    adjust(&mut settings);
    let app = Application::build(settings.clone())
        .await
        .expect("build the application");
    let address = format!("http://127.0.0.1:{}", app.port());
    let shutdown = CancellationToken::new();
    tokio::spawn(app.run_until_stopped(shutdown.clone()));
    let store = Store::connect(&settings.deployments[0].uri, &settings.database)
        .await
        .expect("connect");
    TestApp {
        address,
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap(),
        store,
        database: settings.database,
        instance_id: settings.instance_id,
        shutdown,
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.address, path)
    }

    pub async fn post_json(&self, path: &str, body: serde_json::Value) -> reqwest::Response {
        self.http
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .expect("request")
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.http.get(self.url(path)).send().await.expect("request")
    }

    /// Opens an account through the API and asserts it worked.
    pub async fn open_account(&self, id: &str, balance: i64) {
        self.open_account_in(id, balance, "USD").await;
    }

    pub async fn open_account_in(&self, id: &str, balance: i64, currency: &str) {
        let response = self
            .post_json(
                "/accounts",
                serde_json::json!({ "id": id, "balance": balance, "currency": currency }),
            )
            .await;
        assert_eq!(
            response.status(),
            201,
            "opening {id}: {}",
            response.text().await.unwrap()
        );
    }

    /// A transfer request; returns the status and the JSON body.
    pub async fn transfer(
        &self,
        source: &str,
        destination: &str,
        amount: i64,
    ) -> (u16, serde_json::Value) {
        let response = self
            .post_json("/transfers", serde_json::json!({ "source": source, "destination": destination, "amount": amount }))
            .await;
        let status = response.status().as_u16();
        (status, response.json().await.expect("json body"))
    }

    /// The stored balance of an account.
    pub async fn balance(&self, id: &str) -> i64 {
        self.store
            .accounts()
            .account(&values::account(id))
            .await
            .unwrap()
            .expect("account exists")
            .balance
    }

    /// The sum of every stored balance: the invariant no transfer may change.
    pub async fn total_balance(&self) -> i64 {
        let accounts = self
            .store
            .accounts()
            .list_accounts(None, None, 10_000)
            .await
            .unwrap();
        accounts.iter().map(|a| a.balance).sum()
    }

    /// Every account with a leftover `pendingTransactions` entry.
    pub async fn accounts_with_pending(&self) -> Vec<String> {
        let accounts = self
            .store
            .accounts()
            .list_accounts(None, None, 10_000)
            .await
            .unwrap();
        accounts
            .into_iter()
            .filter(|a| !a.pending_transactions.is_empty())
            .map(|a| a.id.to_string())
            .collect()
    }

    pub async fn drop_database(&self) {
        let _ = self
            .store
            .database()
            .run_command(doc! { "dropDatabase": 1 })
            .await;
    }
}

/// Domain values for tests that write to the store directly, as an instance would.
pub mod values {
    use transfer_service::domain::{AccountId, Amount, Currency, Timestamp, Transfer, TransferId};

    pub fn account(raw: &str) -> AccountId {
        AccountId::parse(raw).expect("a valid account id")
    }

    pub fn amount(minor_units: i64) -> Amount {
        Amount::parse(minor_units).expect("a valid amount")
    }

    pub fn transfer_id(raw: &str) -> TransferId {
        TransferId::parse(raw).expect("a transfer id")
    }

    /// A new USD transfer in `initial`, as step 1 records it.
    pub fn initial(source: &str, destination: &str, value: i64) -> Transfer {
        Transfer::initial(
            transfer_service::store::new_transfer_id(),
            account(source),
            account(destination),
            amount(value),
            Currency::usd(),
        )
    }

    /// `ms` milliseconds after (or, negative, before) `at`.
    pub fn after(at: Timestamp, ms: i64) -> Timestamp {
        at + chrono::TimeDelta::milliseconds(ms)
    }

    /// `ms` milliseconds from now by this machine's clock.
    pub fn from_now(ms: i64) -> Timestamp {
        after(chrono::Utc::now(), ms)
    }
}
