//! Builds the running application: connects to the database, applies migrations, binds
//! the listener (port 0 in tests) and serves until the shutdown token is cancelled.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::http::{self, AppState};
use crate::service::Bank;
use crate::store::{Deployments, Store, StoreError};

/// Longest a request may take before it is answered 503. A transfer takes milliseconds;
/// this bounds the pathological cases (a database that accepts connections but hangs).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long shutdown waits for in-flight transfers before giving them to the sweeper.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long start-up keeps trying a database that cannot be reached (not there yet, a
/// failover, a dropped connection) before it gives up; the pause between attempts doubles
/// from [`FIRST_PAUSE`] up to [`LONGEST_PAUSE`].
const STARTUP_PATIENCE: Duration = Duration::from_secs(60);
const FIRST_PAUSE: Duration = Duration::from_millis(250);
const LONGEST_PAUSE: Duration = Duration::from_secs(5);

/// How often each deployment is pinged to learn whether it answers (with several).
const WATCH_INTERVAL: Duration = Duration::from_millis(500);

/// A bound, ready-to-run instance.
pub struct Application {
    listener: TcpListener,
    bank: Bank,
    settings: Settings,
}

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("database")]
    Database(#[from] StoreError),
}

/// [`Store::migrate`], tried again while the database is unavailable, for at most
/// [`STARTUP_PATIENCE`].
async fn migrate_patiently(store: &Store) -> Result<Vec<String>, StoreError> {
    let give_up = tokio::time::Instant::now() + STARTUP_PATIENCE;
    let mut pause = FIRST_PAUSE;
    loop {
        match store.migrate().await {
            Err(StoreError::Unavailable(why)) if tokio::time::Instant::now() + pause < give_up => {
                tracing::warn!(error = %why, retry_in = ?pause, "database unavailable at start-up");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(LONGEST_PAUSE);
            }
            outcome => return outcome,
        }
    }
}

impl Application {
    /// Connects, migrates and binds. An instance that has not migrated does not serve: a
    /// database that cannot be reached is tried again for `STARTUP_PATIENCE` (every
    /// migration command is idempotent), then start-up fails; any other error fails it at
    /// once.
    pub async fn build(settings: Settings) -> Result<Application, StartupError> {
        let mut stores = Vec::with_capacity(settings.deployments.len());
        for d in &settings.deployments {
            let store = Store::connect_with(
                d.name.clone(),
                &d.uri,
                &settings.database,
                settings.group_commit_writes,
            )
            .await?;
            stores.push(store);
        }
        // Every deployment at once: each waits for its own database.
        let migrated = futures::future::join_all(stores.iter().map(migrate_patiently)).await;
        for (store, applied) in stores.iter().zip(migrated) {
            let applied = applied?;
            if !applied.is_empty() {
                tracing::info!(deployment = %store.deployment(), ?applied, "migrations applied");
            }
        }
        let deployments = Deployments::new(stores);
        let listener = TcpListener::bind(settings.bind_addr)
            .await
            .map_err(|source| StartupError::Bind {
                addr: settings.bind_addr,
                source,
            })?;
        let bank = Bank::new(
            deployments,
            settings.instance_id.clone(),
            settings.stale_after,
        )
        .with_strategy(settings.strategy)
        .with_max_in_flight(settings.max_transfers_in_flight)
        .with_default_hold_expiry(settings.hold_expires);
        Ok(Application {
            listener,
            bank,
            settings,
        })
    }

    pub fn port(&self) -> u16 {
        self.local_addr().port()
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    pub fn bank(&self) -> &Bank {
        &self.bank
    }

    /// Serves until `shutdown` is cancelled, then stops accepting, lets in-flight
    /// requests and background transfers finish (bounded), and returns.
    pub async fn run_until_stopped(self, shutdown: CancellationToken) -> std::io::Result<()> {
        let state = AppState {
            bank: self.bank.clone(),
        };
        let access = http::auth::Access {
            api_keys: self.settings.api_keys.clone(),
            cors_allowed_origins: self.settings.cors_allowed_origins.clone(),
        };
        let app = http::app(state, REQUEST_TIMEOUT, access);
        tracing::info!(
            addr = %self.local_addr(),
            instance = %self.settings.instance_id,
            api_keys = self.settings.api_keys.len(),
            cors_origins = self.settings.cors_allowed_origins.len(),
            "listening"
        );
        let watcher = tokio::spawn({
            let deployments = self.bank.deployments().clone();
            let shutdown = shutdown.clone();
            async move { deployments.watch(WATCH_INTERVAL, shutdown).await }
        });
        let sweeper = tokio::spawn(crate::sweeper::run(
            self.bank.clone(),
            self.settings.sweep_interval,
            shutdown.clone(),
        ));
        let limits = http::connections::Limits {
            max_connections: self.settings.max_connections,
            idle_timeout: self.settings.http_idle_timeout,
        };
        http::connections::serve(self.listener, app, limits, shutdown.clone()).await?;
        let background = self.bank.background_tasks();
        background.close();
        if tokio::time::timeout(DRAIN_TIMEOUT, background.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                "background transfers still running at shutdown; the sweeper of another instance will finish them"
            );
        }
        let _ = sweeper.await;
        let _ = watcher.await;
        tracing::info!("stopped");
        Ok(())
    }
}
