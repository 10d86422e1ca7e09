//! Instances of the service as separate processes (the `transfer-service` binary of this
//! build), for tests that kill, signal or crash them.

use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How a process instance is started.
#[derive(Debug, Clone)]
pub struct InstanceConfig {
    pub uri: String,
    pub database: String,
    /// `INSTANCE_ID`.
    pub name: String,
    /// `CRASH_AT` (needs a build with the `failpoints` feature).
    pub crash_at: Option<String>,
    pub stale_after_ms: u64,
    pub sweep_interval_ms: u64,
    /// More environment variables for the process (`LD_PRELOAD`, say), set last.
    pub env: Vec<(String, String)>,
}

impl InstanceConfig {
    pub fn new(uri: &str, database: &str, name: &str) -> InstanceConfig {
        InstanceConfig {
            uri: uri.to_owned(),
            database: database.to_owned(),
            name: name.to_owned(),
            crash_at: None,
            stale_after_ms: 1000,
            sweep_interval_ms: 100,
            env: Vec::new(),
        }
    }
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
        let port = free_port();
        let mut command = Command::new(env!("CARGO_BIN_EXE_transfer-service"));
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
        command.envs(config.env.iter().cloned());
        // Owned at once, so that Drop kills and reaps it whatever happens next.
        let instance = Instance {
            child: command.spawn().expect("start transfer-service"),
            base: format!("http://127.0.0.1:{port}"),
            name: config.name.clone(),
        };
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(r) = http.get(format!("{}/ready", instance.base)).send().await {
                if r.status() == 200 {
                    return instance;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("instance {} did not become ready", config.name);
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
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.kill();
    }
}
