//! Instances of the service as separate processes (the `transfer-service` binary of this
//! build), for tests that kill, signal or crash them.
//!
//! Only an integration test of the package knows where cargo built that binary
//! (`CARGO_BIN_EXE_transfer-service`, at compile time), so the test names it:
//! `InstanceConfig::new(service_binary!(), ..)`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How a process instance is started.
#[derive(Debug, Clone)]
pub struct InstanceConfig {
    /// The `transfer-service` binary: [`crate::service_binary!`].
    pub binary: PathBuf,
    pub uri: String,
    /// `DEPLOYMENTS`, when set (then `uri` is not used).
    pub deployments: Option<String>,
    pub database: String,
    /// `INSTANCE_ID`.
    pub name: String,
    /// `CRASH_AT`: a point's name, `Point::name` (needs a build with the `failpoints`
    /// feature: every test build of the binary has it, see Cargo.toml). A name, not a
    /// `failpoints::Point`: this crate also builds without the feature (the production
    /// clippy run), where that type does not exist.
    pub crash_at: Option<String>,
    pub stale_after_ms: u64,
    pub sweep_interval_ms: u64,
    /// More environment variables for the process (`LD_PRELOAD`, say), set last.
    pub env: Vec<(String, String)>,
}

impl InstanceConfig {
    pub fn new(binary: &Path, uri: &str, database: &str, name: &str) -> InstanceConfig {
        InstanceConfig {
            binary: binary.to_owned(),
            uri: uri.to_owned(),
            deployments: None,
            database: database.to_owned(),
            name: name.to_owned(),
            crash_at: None,
            stale_after_ms: 1000,
            sweep_interval_ms: 100,
            env: Vec::new(),
        }
    }
}

/// libfaketime, wherever the distribution put it; panics with what to install when it is
/// missing (tests that need it fail, they are never skipped).
pub fn libfaketime() -> PathBuf {
    let mut candidates = Vec::new();
    for root in ["/usr/lib", "/usr/lib64", "/usr/local/lib"] {
        candidates.push(Path::new(root).join("faketime/libfaketime.so.1"));
        // Debian and Ubuntu: /usr/lib/<multiarch triplet>/faketime/.
        if let Ok(entries) = std::fs::read_dir(root) {
            for entry in entries.flatten() {
                candidates.push(entry.path().join("faketime/libfaketime.so.1"));
            }
        }
    }
    candidates
        .into_iter()
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "libfaketime.so.1 not found (looked in /usr/lib, /usr/lib64, /usr/local/lib and \
                 their <triplet>/faketime/ folders): install the `faketime` apt package \
                 (apt-get install faketime), or run scripts/test.sh, which does"
            )
        })
}

/// The environment that runs an instance under libfaketime with its wall clock
/// `offset_secs` seconds off the real one and its monotonic clock left alone; empty for 0.
pub fn faketime_env(offset_secs: i64) -> Vec<(String, String)> {
    if offset_secs == 0 {
        return Vec::new();
    }
    vec![
        (
            "LD_PRELOAD".to_owned(),
            libfaketime().to_string_lossy().into_owned(),
        ),
        ("FAKETIME".to_owned(), format!("{offset_secs:+}s")),
        // Instant (timers, the server-clock lower bound) keeps running true.
        ("FAKETIME_DONT_FAKE_MONOTONIC".to_owned(), "1".to_owned()),
    ]
}

/// How many seconds the instance's wall clock is off the real one, from the `Date` header
/// it answers with (whole seconds, cached for up to one, so within ±2).
pub async fn clock_offset(http: &reqwest::Client, instance: &Instance) -> i64 {
    let answer = http.get(instance.url("/health")).send().await.unwrap();
    let real = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let date = answer
        .headers()
        .get(reqwest::header::DATE)
        .expect("a Date header")
        .to_str()
        .unwrap();
    let seen = chrono::DateTime::parse_from_rfc2822(date)
        .unwrap_or_else(|e| panic!("Date header {date:?}: {e}"))
        .timestamp();
    seen - real
}

/// A running `transfer-service` process; killed and reaped when dropped.
pub struct Instance {
    pub child: Child,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    pub name: String,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Instance {
    /// Starts the process and waits until `/ready` answers 200 (at most 30 s).
    pub async fn start(config: &InstanceConfig) -> Instance {
        let mut instance = Instance::spawn(config);
        instance.wait_ready(Duration::from_secs(30)).await;
        instance
    }

    /// Starts the process and returns at once.
    pub fn spawn(config: &InstanceConfig) -> Instance {
        let port = free_port();
        let mut command = Command::new(&config.binary);
        command
            .env("MONGODB_URI", &config.uri)
            .env("MONGODB_DATABASE", &config.database)
            .env("BIND_ADDR", format!("127.0.0.1:{port}"))
            .env("INSTANCE_ID", &config.name)
            .env("STALE_AFTER_MS", config.stale_after_ms.to_string())
            .env("SWEEP_INTERVAL_MS", config.sweep_interval_ms.to_string())
            .env("RUST_LOG", "warn")
            .env_remove("CRASH_AT")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(step) = &config.crash_at {
            command.env("CRASH_AT", step);
        }
        match &config.deployments {
            Some(deployments) => command.env("DEPLOYMENTS", deployments),
            None => command.env_remove("DEPLOYMENTS"),
        };
        command.envs(config.env.iter().cloned());
        // Owned at once, so that Drop kills and reaps it whatever happens next.
        Instance {
            child: command.spawn().expect("start transfer-service"),
            base: format!("http://127.0.0.1:{port}"),
            name: config.name.clone(),
        }
    }

    /// Waits until `/ready` answers 200; panics after `limit`, or at once if the process
    /// has exited.
    pub async fn wait_ready(&mut self, limit: Duration) {
        let http = reqwest::Client::new();
        let what = format!("instance {} did not become ready", self.name);
        let every = Duration::from_millis(50);
        crate::eventually(&what, limit, every, async || {
            if let Some(status) = self.child.try_wait().expect("poll the instance") {
                panic!(
                    "instance {} exited before it was ready: {status}",
                    self.name
                );
            }
            let ready = http.get(format!("{}/ready", self.base)).send().await;
            ready.is_ok_and(|r| r.status() == 200).then_some(())
        })
        .await;
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().expect("poll the instance").is_none()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// kill -9, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends `signal` (libc::SIGTERM, libc::SIGINT).
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.child.id() as i32, signal) };
        assert_eq!(rc, 0, "kill({signal})");
    }

    /// Waits for the process to exit, at most `limit`; None if it is still running.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let every = Duration::from_millis(20);
        crate::poll_until(limit, every, async || {
            self.child.try_wait().expect("try_wait").ok_or(())
        })
        .await
        .ok()
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.kill();
    }
}
