//! The processes the benchmark owns: the release build of the service, one SecantusDB
//! daemon, and one service instance at a time; plus what /proc says about them.
//!
//! Every child is started from one thread that lives as long as the benchmark and asks
//! the kernel to SIGKILL it when that thread goes (PR_SET_PDEATHSIG), so nothing outlives
//! a crash or a Ctrl-C; on an orderly exit or a panic, `Drop` kills and reaps it first.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::Serialize;

/// The project root: where `Cargo.toml` and `scripts/` are.
pub fn project_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

type SpawnJob = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Spawns `command` from the long-lived spawner thread, with PR_SET_PDEATHSIG set.
fn spawn_owned(mut command: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnJob>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("bench-spawner".into())
            .spawn(move || {
                // The sender is a static, so this loop (and the thread) ends with the process.
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .expect("start the spawner thread");
        tx
    });
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: prctl, getppid and _exit are async-signal-safe. The child asks to be
    // killed when the spawner thread exits, and exits at once if the benchmark already
    // died between fork and prctl.
    unsafe {
        command.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let (reply_tx, reply_rx) = mpsc::channel();
    spawner
        .send((command, reply_tx))
        .expect("spawner thread is alive");
    reply_rx.recv().expect("spawner thread answers")
}

/// A child that is killed and reaped when dropped.
pub struct Owned {
    child: Child,
}

impl Owned {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `command` to the end as an owned child (so it dies with the benchmark), and
/// returns its status and whatever it printed on stdout (if piped).
fn run_owned(command: Command) -> std::io::Result<(ExitStatus, Vec<u8>)> {
    let mut owned = Owned {
        child: spawn_owned(command)?,
    };
    let mut stdout = Vec::new();
    if let Some(mut pipe) = owned.child.stdout.take() {
        pipe.read_to_end(&mut stdout)?;
    }
    let status = owned.child.wait()?;
    Ok((status, stdout))
}

/// Runs `cargo build --release --bin transfer-service` (honouring `CARGO_TARGET_DIR`) and
/// returns the path of the binary, found through `cargo metadata`.
pub fn build_server() -> Result<PathBuf, String> {
    eprintln!("[build] cargo build --release --bin transfer-service");
    let mut build = Command::new(cargo());
    build
        .args(["build", "--release", "--bin", "transfer-service"])
        .current_dir(project_root())
        .stdin(Stdio::null());
    let (status, _) = run_owned(build).map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build of the service failed ({status})"));
    }
    let mut metadata = Command::new(cargo());
    metadata
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(project_root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    let (status, stdout) =
        run_owned(metadata).map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    if !status.success() {
        return Err(format!("cargo metadata failed ({status})"));
    }
    let metadata: serde_json::Value = serde_json::from_slice(&stdout)
        .map_err(|e| format!("cargo metadata printed no JSON: {e}"))?;
    let target = metadata["target_directory"]
        .as_str()
        .ok_or("cargo metadata names no target_directory")?;
    let binary = Path::new(target).join("release").join("transfer-service");
    if !binary.is_file() {
        return Err(format!("{} is missing after the build", binary.display()));
    }
    Ok(binary)
}

/// `SECANTUSD_BIN`, else the last line printed by `scripts/install-secantus.sh` (which
/// installs the pinned version first if needed).
pub fn secantusd_binary() -> Result<PathBuf, String> {
    if let Ok(bin) = std::env::var("SECANTUSD_BIN")
        && !bin.trim().is_empty()
    {
        return Ok(PathBuf::from(bin));
    }
    let script = project_root().join("scripts/install-secantus.sh");
    let mut install = Command::new("bash");
    install
        .arg(&script)
        .current_dir(project_root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    let (status, stdout) =
        run_owned(install).map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !status.success() {
        return Err(format!("{} failed ({status})", script.display()));
    }
    let stdout = String::from_utf8_lossy(&stdout);
    let last = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .ok_or("install-secantus.sh printed no path")?;
    Ok(PathBuf::from(last.trim()))
}

/// One SecantusDB daemon for the whole run, its data in a temporary folder.
pub struct Daemon {
    pub uri: String,
    pub binary: PathBuf,
    // Field order: the child goes before its folder.
    child: Owned,
    _storage: tempfile::TempDir,
}

impl Daemon {
    pub fn start(binary: PathBuf) -> Result<Daemon, String> {
        let storage = tempfile::Builder::new()
            .prefix("transfer-service-bench-db")
            .tempdir()
            .map_err(|e| format!("temp dir: {e}"))?;
        let mut command = Command::new(&binary);
        command
            .args(["--host", "127.0.0.1", "--port", "0"])
            .arg("--storage-path")
            .arg(storage.path())
            .args(["--sync-on-commit", "--log-level", "WARNING"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = Owned {
            child: spawn_owned(command)
                .map_err(|e| format!("cannot start {}: {e}", binary.display()))?,
        };
        let stdout = child.child.stdout.take().expect("piped stdout");
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        reader
            .read_line(&mut line)
            .map_err(|e| format!("reading the daemon's first line: {e}"))?;
        let port: u16 = line
            .trim()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| format!("unexpected first line from secantusd-rs: {line:?}"))?;
        // Keep draining its stdout so that it never blocks on, or dies of, a full pipe.
        std::thread::spawn(move || {
            let mut sink = [0u8; 4096];
            while matches!(reader.read(&mut sink), Ok(n) if n > 0) {}
        });
        Ok(Daemon {
            uri: format!("mongodb://127.0.0.1:{port}/?directConnection=true"),
            binary,
            child,
            _storage: storage,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A running `transfer-service` process.
pub struct Server {
    pub base: String,
    child: Owned,
}

/// Why a server did not start.
pub enum StartError {
    /// It refused its settings (exit code 2): the strategy does not exist in this build.
    Rejected(String),
    Failed(String),
}

impl Server {
    /// Starts the service and waits until `/ready` answers 200 (at most 60 s). Its output
    /// (JSON logs at `warn`) goes to `log`. `env` is set after the defaults (so it may
    /// set `STALE_AFTER_MS`, which is otherwise left at the service's default).
    pub async fn start(
        binary: &Path,
        uri: &str,
        database: &str,
        strategy: &str,
        log: &Path,
        env: &[(&str, String)],
    ) -> Result<Server, StartError> {
        let port = free_port();
        let out = File::create(log).map_err(|e| StartError::Failed(format!("{e}")))?;
        let err = out
            .try_clone()
            .map_err(|e| StartError::Failed(format!("{e}")))?;
        let mut command = Command::new(binary);
        command
            .env("MONGODB_URI", uri)
            .env("MONGODB_DATABASE", database)
            .env("BIND_ADDR", format!("127.0.0.1:{port}"))
            .env("INSTANCE_ID", format!("bench-{strategy}"))
            .env("TRANSFER_STRATEGY", strategy)
            .env("RUST_LOG", "warn")
            .env("LOG_FORMAT", "json")
            .env_remove("API_KEYS")
            .env_remove("CORS_ALLOWED_ORIGINS")
            .env_remove("CRASH_AT")
            .env_remove("SWEEP_INTERVAL_MS")
            .env_remove("STALE_AFTER_MS")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let mut server = Server {
            base: format!("http://127.0.0.1:{port}"),
            child: Owned {
                child: spawn_owned(command).map_err(|e| {
                    StartError::Failed(format!("cannot start {}: {e}", binary.display()))
                })?,
            },
        };
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .expect("http client");
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = server.child.child.try_wait() {
                let said = std::fs::read_to_string(log).unwrap_or_default();
                let said = said.lines().next().unwrap_or("").trim().to_owned();
                return Err(if status.code() == Some(2) {
                    StartError::Rejected(said)
                } else {
                    StartError::Failed(format!("exited at start ({status}): {said}"))
                });
            }
            if let Ok(r) = http.get(format!("{}/ready", server.base)).send().await
                && r.status() == 200
            {
                return Ok(server);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        server.child.kill();
        Err(StartError::Failed(
            "not ready within 60 s (see its log)".into(),
        ))
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// SIGTERM, then up to 15 s to drain, then SIGKILL.
    pub async fn stop(mut self) {
        // SAFETY: kill(2) on our own, not yet reaped, child.
        unsafe {
            libc::kill(self.child.pid() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.child.try_wait() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.child.kill();
    }
}

/// CPU time and memory of a live process, from /proc.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ProcSample {
    /// utime + stime, seconds.
    pub cpu_seconds: f64,
    /// VmHWM: peak resident set size since start (or since [`reset_peak_rss`]).
    pub peak_rss_kib: u64,
    pub rss_kib: u64,
}

pub fn sample(pid: u32) -> Option<ProcSample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces:
    // [0] is field 3 (state), so utime (14) is [11] and stime (15) is [12].
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
    };
    Some(ProcSample {
        cpu_seconds: (utime + stime) / ticks,
        peak_rss_kib: kib("VmHWM:")?,
        rss_kib: kib("VmRSS:")?,
    })
}

/// Resets VmHWM to the current RSS (writes 5 to /proc/<pid>/clear_refs); false if the
/// kernel refused.
pub fn reset_peak_rss(pid: u32) -> bool {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}
