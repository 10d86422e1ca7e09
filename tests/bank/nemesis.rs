//! The nemesis: what the instances and their database servers go through while the
//! clients run ([`Nemesis::run`]).
//!
//! - killed instances: every 0.8 to 2 s an instance chosen at random is killed with
//!   SIGKILL and, 0.1 to 0.8 s later, started again in its slot, half the time under its
//!   old name (it takes back its own transfers at once), half the time as a new instance;
//! - a database restart: once, past half the run, instead of an instance, the server of
//!   the one deployment, or of one of the three chosen at random, is killed and, after
//!   [`down_for`], restarted on the same port and folder (only the test's own servers:
//!   with `MONGODB_URI` set there is none); across three deployments a probe client
//!   ([`probe_while_down`]) moves money between the two others meanwhile;
//! - a bad network: the instances of the slots in [`PROXIED`] (the first) reach each
//!   deployment's database server through a TCP proxy of its own on the loopback
//!   (`support::proxy`) that delays every chunk it forwards, in either direction, by 0 to
//!   [`PROXY_DELAY_MAX_MS`] ms (uniformly), or with a chance of [`PROXY_SLOW_CHANCE`] by up
//!   to [`PROXY_SLOW_DELAY_MAX_MS`] ms, and resets each connection (an RST to both sides)
//!   with a chance of about [`PROXY_RESETS_PER_SECOND`] in any second of its life; each
//!   holds at most [`PROXY_MAX_CONNECTIONS`] at once and forwards across its server's
//!   restart (the connections made while it is down are closed at once);
//! - wrong clocks: each slot's instances run with their wall clock [`CLOCK_SKEWS`] seconds
//!   off (+7 s and -7 s, several leases), under libfaketime, which must be installed (the
//!   `faketime` apt package; `scripts/test.sh` installs it); the database and the test
//!   keep the real clock, and every start checks the skew took;
//! - cancels of transfers being recovered: right after each kill, up to
//!   [`RECOVERY_CANCELS_PER_KILL`] unfinished transfers of the dead instance (those it
//!   owned, holds it was reserving or capturing among them, and those recorded for the
//!   requests that were outstanding on it) are
//!   canceled on the surviving instances, some twice at once, each within
//!   [`RECOVERY_CANCEL_WITHIN_MS`] ms of the kill, while the sweepers take them over.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mongodb::bson::doc;
use rand::Rng;
use rand::seq::SliceRandom;
use support::Daemon;
use support::process::{Instance, InstanceConfig, clock_offset, faketime_env};
use support::proxy::{Faults, Proxy};
use tokio::task::JoinHandle;

use crate::checker::history::History;
use crate::deployments::{Books, Layout};
use crate::workload::{Bases, Clients, cancel_one, live_base_except, probe_while_down};
use crate::{INSTANCES, STALE_AFTER_MS, SWEEP_INTERVAL_MS};

/// The instances (by slot) that reach the database through a fault-injecting proxy.
pub const PROXIED: [bool; INSTANCES] = [true, false, false];
/// Each instance's wall-clock skew in seconds, under libfaketime (0: the real clock).
const CLOCK_SKEWS: [i64; INSTANCES] = [0, 7, -7];
/// The proxy delays each chunk it forwards (either direction) by 0 to this...
const PROXY_DELAY_MAX_MS: u64 = 50;
/// ...or, with this chance, by up to [`PROXY_SLOW_DELAY_MAX_MS`].
const PROXY_SLOW_CHANCE: f64 = 0.02;
const PROXY_SLOW_DELAY_MAX_MS: u64 = 400;
/// Each proxied connection is reset with about this chance in any second of its life.
const PROXY_RESETS_PER_SECOND: f64 = 0.2;
/// Connections the proxy holds at once, at most.
const PROXY_MAX_CONNECTIONS: usize = 256;
/// After each kill, at most this many of the dead instance's unfinished transfers are
/// canceled on the survivors...
const RECOVERY_CANCELS_PER_KILL: usize = 8;
/// ...each at a random moment within this long after the kill (a lease and a half: some
/// before the sweepers may take it over, some while they do, some after).
const RECOVERY_CANCEL_WITHIN_MS: u64 = 1500;

/// The nemesis of one run: it kills and restarts instances, and restarts a database
/// server once, until the run's time is up.
pub struct Nemesis<'a> {
    servers: &'a mut Servers,
    slots: &'a Slots,
    instances: &'a mut [Instance],
    /// The clients' live instances (a killed one is taken out until it is back), their
    /// history (the requests outstanding on a killed instance) and their stop (a probe's
    /// too).
    clients: &'a Clients,
    /// To find a killed instance's unfinished transfers.
    books: &'a Books,
    havoc: Havoc,
    /// Instances started after a kill so far, for a new instance's name.
    generation: usize,
}

/// What the nemesis did, and what it left running when the time was up.
#[derive(Default)]
pub struct Havoc {
    /// Instances killed with SIGKILL and restarted...
    pub killed: usize,
    /// ...of which under a new name.
    pub renamed: usize,
    /// The database server restart, if there was one.
    pub outage: Option<Outage>,
    /// The cancels of the killed instances' transfers ([`cancel_recovering`]).
    recovery_cancels: Vec<JoinHandle<()>>,
    /// The probe of the outage ([`probe_while_down`]), across three deployments.
    probes: Vec<JoinHandle<()>>,
}

impl Havoc {
    /// Waits for the cancels and the probe the nemesis started (the probe stops with the
    /// clients).
    pub async fn finish(&mut self) {
        for c in self.recovery_cancels.drain(..).chain(self.probes.drain(..)) {
            c.await.unwrap();
        }
    }
}

impl<'a> Nemesis<'a> {
    pub fn new(
        servers: &'a mut Servers,
        slots: &'a Slots,
        instances: &'a mut [Instance],
        clients: &'a Clients,
        books: &'a Books,
    ) -> Nemesis<'a> {
        Nemesis {
            servers,
            slots,
            instances,
            clients,
            books,
            havoc: Havoc::default(),
            generation: 0,
        }
    }

    /// Every 0.8 to 2 s, kills an instance and starts it again, or once, past half of
    /// `run_for`, restarts a database server (the test's own only); returns once
    /// `run_for` has passed.
    pub async fn run(mut self, run_for: Duration) -> Havoc {
        let started = Instant::now();
        while started.elapsed() < run_for {
            let pause_ms = rand::rng().random_range(800..2000);
            tokio::time::sleep(Duration::from_millis(pause_ms)).await;
            if self.havoc.outage.is_none()
                && self.servers.owned()
                && started.elapsed() >= run_for / 2
            {
                self.restart_a_server().await;
                continue;
            }
            self.kill_an_instance().await;
        }
        self.havoc
    }

    /// The one deployment's server, or one of the three, at random, down for
    /// [`down_for`]; across three, a probe moves money between the two others while it
    /// is down.
    async fn restart_a_server(&mut self) {
        let layout = self.slots.layout;
        let d = rand::rng().random_range(0..layout.deployments().len());
        let from = self.servers.kill(d);
        let probing = self.clients.stop.child_token();
        if layout.deployments().len() > 1 {
            self.havoc.probes.push(tokio::spawn(probe_while_down(
                layout,
                d,
                self.clients.bases.clone(),
                self.clients.history.clone(),
                probing.clone(),
            )));
        }
        tokio::time::sleep(down_for(layout)).await;
        probing.cancel();
        let until = Instant::now();
        self.servers.revive(d);
        println!(
            "nemesis: the database server of deployment {} restarted after {:?} down",
            layout.deployments()[d],
            until - from
        );
        self.havoc.outage = Some(Outage {
            deployment: layout.deployments()[d],
            from,
            until,
        });
    }

    /// Kills an instance at random, cancels what it left unfinished on the survivors
    /// ([`cancel_recovering`]) and starts it again.
    async fn kill_an_instance(&mut self) {
        let bases = &self.clients.bases;
        let victim = rand::rng().random_range(0..INSTANCES);
        bases.lock().unwrap()[victim] = None;
        self.instances[victim].kill();
        self.havoc.killed += 1;
        // The requests outstanding on it have lost their answer; cancel what it left
        // while the survivors' sweepers take it over.
        let references: Vec<String> = self
            .clients
            .history
            .lock()
            .unwrap()
            .in_flight
            .iter()
            .filter(|(_, slot)| **slot == victim)
            .map(|(reference, _)| reference.clone())
            .collect();
        self.havoc
            .recovery_cancels
            .push(tokio::spawn(cancel_recovering(
                self.books.clone(),
                bases.clone(),
                self.clients.history.clone(),
                victim,
                self.instances[victim].name.clone(),
                references,
            )));
        tokio::time::sleep(Duration::from_millis(rand::rng().random_range(100..800))).await;
        // Half the time it comes back under its old name (and takes back its own
        // transfers at once), half the time as a new instance.
        self.generation += 1;
        let name = if rand::rng().random_bool(0.5) {
            format!("bank-{victim}")
        } else {
            self.havoc.renamed += 1;
            format!("bank-{victim}-{}", self.generation)
        };
        self.instances[victim] = self.slots.start(victim, &name).await;
        bases.lock().unwrap()[victim] = Some(self.instances[victim].base.clone());
    }
}

/// How long the nemesis keeps a database server down: across three deployments, longer
/// than the driver's server selection time-out (3 s), so that the transfers touching
/// it are refused while the others go on.
fn down_for(layout: Layout) -> Duration {
    match layout {
        Layout::OneDeployment => Duration::from_millis(1000),
        Layout::ThreeDeployments => Duration::from_millis(4000),
    }
}

/// Right after the instance in slot `victim`, `owner`, was killed: cancels, on the
/// surviving instances, the transfers it left unfinished (those it owned, and those
/// recorded for the requests that were outstanding on it; holds it was reserving or
/// capturing among them; reversals aside), each at a
/// random moment within [`RECOVERY_CANCEL_WITHIN_MS`], some twice at once, so that the
/// cancels race the sweepers taking the same transfers over.
async fn cancel_recovering(
    books: Books,
    bases: Bases,
    history: Arc<Mutex<History>>,
    victim: usize,
    owner: String,
    references: Vec<String>,
) {
    let filter = doc! {
        "state": { "$in": ["initial", "pending", "applied", "canceling", "capturing"] },
        "reverses": { "$exists": false },
        "$or": [
            // Names are [a-z0-9-]: nothing to escape.
            { "application": { "$regex": format!("^{owner}/") } },
            { "reference": { "$in": references } },
        ],
    };
    // In every log (a deployment restarting gives no targets this time).
    let found = books.find_in_logs(filter).await;
    // (id, state) of each.
    let mut targets: Vec<(String, String)> = found
        .iter()
        .filter_map(|t| {
            let id = t.get_object_id("_id").ok()?.to_hex();
            Some((id, t.get_str("state").ok()?.to_owned()))
        })
        .collect();
    targets.shuffle(&mut rand::rng());
    targets.truncate(RECOVERY_CANCELS_PER_KILL);
    {
        let mut h = history.lock().unwrap();
        for (_, state) in &targets {
            *h.recovery_targets.entry(state.clone()).or_default() += 1;
        }
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut cancels = Vec::new();
    for (id, _) in targets {
        let copies = if rand::rng().random_bool(0.3) { 2 } else { 1 };
        for _ in 0..copies {
            let (http, bases, history) = (http.clone(), bases.clone(), history.clone());
            let id = id.clone();
            let delay = rand::rng().random_range(0..=RECOVERY_CANCEL_WITHIN_MS);
            cancels.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                let Some((_, base)) = live_base_except(&bases, &mut rand::rng(), victim) else {
                    return;
                };
                cancel_one(&http, &base, id, &history, "cancel (recovering)").await;
            }));
        }
    }
    for c in cancels {
        c.await.unwrap();
    }
}

/// The database servers of a run, one per deployment of its layout: SecantusDB daemons of
/// the test's own, each in a temporary folder of its own, which the nemesis may restart;
/// or, with `MONGODB_URI` set, the servers the test support names (`MONGODB_URIS` for the
/// further ones), left alone.
pub struct Servers {
    pub uris: Vec<String>,
    /// The test's daemons and their folders; `None` with external servers.
    pub daemons: Option<Vec<(Daemon, tempfile::TempDir)>>,
}

/// A deployment's database server down: which one, and when it surely was (from the
/// moment its kill returned to the moment its restart began, by the test's clock).
pub struct Outage {
    pub deployment: &'static str,
    pub from: Instant,
    pub until: Instant,
}

impl Servers {
    pub fn start(layout: Layout) -> Servers {
        let n = layout.deployments().len();
        let external = std::env::var("MONGODB_URI")
            .ok()
            .filter(|u| !u.trim().is_empty());
        if external.is_some() {
            return Servers {
                uris: support::database_uris(n),
                daemons: None,
            };
        }
        let daemons: Vec<(Daemon, tempfile::TempDir)> = (0..n)
            .map(|_| {
                let storage = tempfile::tempdir().unwrap();
                (Daemon::start(storage.path().to_path_buf(), 0), storage)
            })
            .collect();
        Servers {
            uris: daemons.iter().map(|(d, _)| d.uri.clone()).collect(),
            daemons: Some(daemons),
        }
    }

    /// Whether the test owns the servers (and so may restart them, and they keep its
    /// clock).
    pub fn owned(&self) -> bool {
        self.daemons.is_some()
    }

    /// Kills the server of deployment `d` (kill -9); returns when it is dead.
    pub fn kill(&mut self, d: usize) -> Instant {
        let (daemon, _) = &mut self.daemons.as_mut().expect("servers of the test")[d];
        daemon.kill();
        Instant::now()
    }

    /// Starts the server of deployment `d` again, on its port and with its folder.
    pub fn revive(&mut self, d: usize) {
        let (daemon, storage) = &mut self.daemons.as_mut().expect("servers of the test")[d];
        *daemon = Daemon::start(storage.path().to_path_buf(), daemon.port);
    }
}

/// The faulty network between the proxied slots ([`PROXIED`]) and every deployment: a
/// proxy for each; it lives as long as the test (across restarts of the instances and of
/// the database servers).
pub struct Network {
    /// Each proxy, with its slot and the deployment it leads to.
    proxies: Vec<(usize, &'static str, Proxy)>,
    /// Per slot, the URI of each deployment, in the layout's order: a proxy's for a
    /// proxied slot, the server's for the others.
    uris: Vec<Vec<String>>,
}

impl Network {
    /// Starts the proxies between the proxied slots and each of the servers at `uris`
    /// (in the layout's order).
    pub async fn start(layout: Layout, uris: &[String]) -> Network {
        let faults = Faults {
            delay_max: Duration::from_millis(PROXY_DELAY_MAX_MS),
            slow_chance: PROXY_SLOW_CHANCE,
            slow_delay_max: Duration::from_millis(PROXY_SLOW_DELAY_MAX_MS),
            resets_per_second: PROXY_RESETS_PER_SECOND,
            max_connections: PROXY_MAX_CONNECTIONS,
        };
        let mut proxies = Vec::new();
        let mut reached = Vec::new();
        for (slot, proxied) in PROXIED.iter().enumerate() {
            let mut reach = Vec::new();
            for (name, uri) in layout.deployments().iter().zip(uris) {
                if *proxied {
                    let proxy = Proxy::start(upstream_of(uri), faults).await;
                    reach.push(proxied_uri(uri, proxy.addr));
                    proxies.push((slot, *name, proxy));
                } else {
                    reach.push(uri.clone());
                }
            }
            reached.push(reach);
        }
        Network {
            proxies,
            uris: reached,
        }
    }

    /// What each proxy did, for the summary.
    pub fn counts(&self) -> Vec<String> {
        self.proxies
            .iter()
            .map(|(slot, deployment, proxy)| {
                let c = proxy.counts();
                format!(
                    "proxy of slot {slot} to {deployment}: {} connections ({} refused), {} of {} \
                     chunks delayed ({} slow), {} resets",
                    c.connections, c.refused, c.delayed, c.chunks, c.slow, c.resets
                )
            })
            .collect()
    }
}

/// What every instance started in a slot shares: where it reaches each deployment (the
/// slot's proxies for a proxied slot) and its clock skew.
pub struct Slots {
    layout: Layout,
    /// Per slot, the URI of each deployment, in the layout's order.
    uris: Vec<Vec<String>>,
    database: String,
}

impl Slots {
    /// The slots of a run on `layout`, each reaching the deployments as `network` says,
    /// each instance using `database`.
    pub fn new(layout: Layout, network: &Network, database: &str) -> Slots {
        Slots {
            layout,
            uris: network.uris.clone(),
            database: database.to_owned(),
        }
    }

    fn config(&self, slot: usize, name: &str) -> InstanceConfig {
        let uris = &self.uris[slot];
        let mut config =
            InstanceConfig::new(support::service_binary!(), &uris[0], &self.database, name);
        config.deployments = self.layout.deployments_variable(uris);
        config.stale_after_ms = STALE_AFTER_MS;
        config.sweep_interval_ms = SWEEP_INTERVAL_MS;
        config.env = faketime_env(CLOCK_SKEWS[slot]);
        config
    }

    /// Starts an instance in `slot` and checks that its clock is skewed as it should be,
    /// so that a libfaketime that did not take cannot pass unnoticed.
    async fn start(&self, slot: usize, name: &str) -> Instance {
        let instance = Instance::start(&self.config(slot, name)).await;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let off = clock_offset(&http, &instance).await;
        assert!(
            (off - CLOCK_SKEWS[slot]).abs() <= 2,
            "instance {name} should run {:+} s off the real clock, its Date header says {off:+} s",
            CLOCK_SKEWS[slot]
        );
        instance
    }

    /// Starts an instance in every slot, named `bank-<slot>`.
    pub async fn start_all(&self) -> Vec<Instance> {
        let mut instances: Vec<Instance> = Vec::new();
        for i in 0..INSTANCES {
            instances.push(self.start(i, &format!("bank-{i}")).await);
        }
        instances
    }
}

/// Each slot's clock skew, for the summary.
pub fn skews() -> Vec<String> {
    CLOCK_SKEWS
        .iter()
        .enumerate()
        .map(|(slot, skew)| format!("slot {slot} {skew:+} s"))
        .collect()
}

/// The database's address in `uri` (its first host), which must be on the loopback.
fn upstream_of(uri: &str) -> std::net::SocketAddr {
    use std::net::ToSocketAddrs;
    let authority = uri
        .strip_prefix("mongodb://")
        .unwrap_or_else(|| panic!("the proxy needs a mongodb:// URI, not {uri}"));
    let authority = authority.split('/').next().unwrap_or_default();
    let hosts = authority.rsplit('@').next().unwrap_or_default();
    let host = hosts.split(',').next().unwrap_or_default();
    let host = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:27017")
    };
    host.to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.find(|a| a.ip().is_loopback()))
        .unwrap_or_else(|| {
            panic!("the bank test proxies the database only on the loopback; {uri} is not")
        })
}

/// `uri` with its hosts replaced by the proxy's address, and `directConnection=true`.
fn proxied_uri(uri: &str, proxy: std::net::SocketAddr) -> String {
    let rest = uri.strip_prefix("mongodb://").unwrap_or(uri);
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let credentials = match authority.rfind('@') {
        Some(i) => &authority[..=i],
        None => "",
    };
    let path = if path.contains("directConnection=") {
        path.replace("directConnection=false", "directConnection=true")
    } else if path.contains('?') {
        format!("{path}&directConnection=true")
    } else {
        format!("{path}?directConnection=true")
    };
    format!("mongodb://{credentials}{proxy}{path}")
}
