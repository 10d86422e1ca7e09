//! Builds the running application: connects to the database, applies migrations, binds
//! the listener (port 0 in tests) and serves until the shutdown token is cancelled.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::http::{self, AppState};
use crate::service::Bank;
use crate::store::{Store, StoreError};

/// Longest a request may take before it is answered 503. A transfer takes milliseconds;
/// this bounds the pathological cases (a database that accepts connections but hangs).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long shutdown waits for in-flight transfers before giving them to the sweeper.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

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
    #[error("database: {0}")]
    Database(#[from] StoreError),
}

impl Application {
    /// Connects, migrates and binds. Fails if the database is unreachable at start-up:
    /// an instance that cannot migrate must not serve.
    pub async fn build(settings: Settings) -> Result<Application, StartupError> {
        let store = Store::connect_with(
            &settings.mongodb_uri,
            &settings.database,
            settings.group_commit_writes,
        )
        .await?;
        let applied = store.migrate().await?;
        if !applied.is_empty() {
            tracing::info!(?applied, "migrations applied");
        }
        let listener = TcpListener::bind(settings.bind_addr)
            .await
            .map_err(|source| StartupError::Bind {
                addr: settings.bind_addr,
                source,
            })?;
        let bank = Bank::new(store, settings.instance_id.clone(), settings.stale_after)
            .with_strategy(settings.strategy)
            .with_max_in_flight(settings.max_transfers_in_flight);
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
        let sweeper = tokio::spawn(crate::sweeper::run(
            self.bank.clone(),
            self.settings.sweep_interval,
            shutdown.clone(),
        ));
        let stop = shutdown.clone();
        let listener =
            http::connections::BoundedListener::new(self.listener, self.settings.max_connections);
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await?;
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
        tracing::info!("stopped");
        Ok(())
    }
}
