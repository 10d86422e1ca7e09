//! Builds the running application: connects to the database, applies migrations, binds
//! the listener (port 0 in tests) and serves until the shutdown token is cancelled.

use std::net::SocketAddr;
use std::time::Duration;

use backon::Retryable;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::http::{self, AppState};
use crate::retry;
use crate::service::TransferService;
use crate::store::{Deployments, Store, StoreError};

/// Longest a request may take before it is answered 503. A transfer takes milliseconds;
/// this bounds the pathological cases (a database that accepts connections but hangs).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long shutdown waits for in-flight transfers before giving them to the sweeper.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// How often each deployment is pinged to learn whether it answers (with several).
const WATCH_INTERVAL: Duration = Duration::from_millis(500);

/// A bound, ready-to-run instance.
pub struct Application {
    listener: TcpListener,
    service: TransferService,
    /// The connection places (`MAX_CONNECTIONS`): the server takes one per connection,
    /// and admission control looks at how many are left.
    places: std::sync::Arc<tokio::sync::Semaphore>,
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

/// [`Store::migrate`], tried again while the database is unavailable (policy
/// [`retry::start_up`]), for at most `patience`.
async fn migrate_patiently(store: &Store, patience: Duration) -> Result<Vec<String>, StoreError> {
    let give_up = tokio::time::Instant::now() + patience;
    (|| store.migrate())
        .retry(retry::start_up())
        .when(|e| matches!(e, StoreError::Unavailable(_)))
        .adjust(|_, pause| pause.filter(|&p| tokio::time::Instant::now() + p < give_up))
        .notify(|why, pause| {
            tracing::warn!(error = %why, retry_in = ?pause, "database unavailable at start-up");
        })
        .await
}

/// How long start-up waits for the other deployments once one is migrated: an instance
/// started during an outage of one deployment serves the others after this, not after
/// the whole `STARTUP_PATIENCE_MS`.
const OTHERS_GRACE: Duration = Duration::from_secs(5);

/// Migrates every deployment at once, each tried again for up to `patience`; once one is
/// migrated, the others are waited for [`OTHERS_GRACE`] more. Each deployment's outcome,
/// in order; `None` for one still being tried when the grace ran out (its attempt is
/// dropped: every migration command is idempotent).
async fn migrate_at_start(
    stores: &[Store],
    patience: Duration,
) -> Vec<Option<Result<Vec<String>, StoreError>>> {
    use futures::StreamExt;
    let mut pending: futures::stream::FuturesUnordered<_> = stores
        .iter()
        .enumerate()
        .map(|(i, s)| async move { (i, migrate_patiently(s, patience).await) })
        .collect();
    let mut outcomes: Vec<Option<Result<Vec<String>, StoreError>>> =
        stores.iter().map(|_| None).collect();
    let mut until: Option<tokio::time::Instant> = None;
    loop {
        let next = match until {
            None => pending.next().await,
            Some(at) => match tokio::time::timeout_at(at, pending.next()).await {
                Ok(next) => next,
                Err(_) => break,
            },
        };
        let Some((i, outcome)) = next else { break };
        if outcome.is_ok() && until.is_none() {
            until = Some(tokio::time::Instant::now() + OTHERS_GRACE);
        }
        outcomes[i] = Some(outcome);
    }
    outcomes
}

/// Migrates `store` once its deployment answers, however long that takes, then lets the
/// service use it.
async fn migrate_when_back(store: Store) {
    loop {
        match migrate_patiently(&store, ONE_MINUTE).await {
            Ok(applied) => {
                tracing::info!(deployment = %store.deployment(), ?applied, "deployment migrated; in use");
                store.set_migrated(true);
                return;
            }
            Err(e) => {
                tracing::warn!(deployment = %store.deployment(), error = %crate::error_chain::Chain(&e), "deployment still not migrated");
                tokio::time::sleep(retry::STARTUP_LONGEST_PAUSE).await;
            }
        }
    }
}

/// How long each round of [`migrate_when_back`] tries before it logs again.
const ONE_MINUTE: Duration = Duration::from_secs(60);

/// Connects to every deployment and migrates each (see [`Application::build`]): those
/// still unavailable once one is migrated are migrated in the background.
async fn connect_and_migrate(settings: &Settings) -> Result<Deployments, StoreError> {
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
    // Every deployment at once: each waits for its own database. One that is still
    // unavailable then does not stop the others: it is migrated in the background,
    // and refused until it is (an outage of one deployment stops only its transfers,
    // also for an instance started during it).
    let migrated = migrate_at_start(&stores, settings.startup_patience).await;
    let mut later = Vec::new();
    for (store, applied) in stores.iter().zip(migrated) {
        let applied = applied.unwrap_or_else(|| {
            Err(StoreError::Unavailable(
                "not migrated within the grace after the first deployment".into(),
            ))
        });
        match applied {
            Ok(applied) if !applied.is_empty() => {
                tracing::info!(deployment = %store.deployment(), ?applied, "migrations applied");
            }
            Ok(_) => {}
            Err(StoreError::Unavailable(why)) if stores.len() > 1 => {
                tracing::warn!(deployment = %store.deployment(), error = %why, "deployment unavailable at start-up; starting without it, migrating it when it answers");
                store.set_migrated(false);
                later.push(store.clone());
            }
            Err(e) => return Err(e),
        }
    }
    if later.len() == stores.len() {
        return Err(StoreError::Unavailable(
            "no deployment could be migrated".into(),
        ));
    }
    for store in later {
        tokio::spawn(migrate_when_back(store));
    }
    Ok(Deployments::new(stores))
}

impl Application {
    /// Connects, migrates and binds. An instance that has not migrated does not serve: a
    /// database that cannot be reached is tried again for `STARTUP_PATIENCE_MS` (every
    /// migration command is idempotent), then start-up fails; any other error fails it at
    /// once. With several deployments, it fails only if none could be migrated; the
    /// others are migrated in the background and refused until then.
    pub async fn build(settings: Settings) -> Result<Application, StartupError> {
        // A test build asked to crash at a point that does not exist stops here, naming the
        // points, rather than serving without ever crashing.
        #[cfg(feature = "failpoints")]
        crate::failpoints::crash_point();
        let deployments = connect_and_migrate(&settings).await?;
        let listener = TcpListener::bind(settings.bind_addr)
            .await
            .map_err(|source| StartupError::Bind {
                addr: settings.bind_addr,
                source,
            })?;
        let places = http::connections::places(settings.max_connections);
        let service = TransferService::new(
            deployments,
            settings.instance_id.clone(),
            settings.stale_after,
        )
        .with_strategy(settings.strategy)
        .with_max_in_flight(settings.max_transfers_in_flight)
        .with_admission_wait(settings.admission_wait)
        .with_connection_places(places.clone())
        .with_default_hold_expiry(settings.hold_expires)
        .with_max_followers(settings.max_event_streams, settings.streams_per_tenant())
        .with_webhook_settings(settings.webhooks);
        Ok(Application {
            listener,
            service,
            places,
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

    pub fn service(&self) -> &TransferService {
        &self.service
    }

    /// The HTTP application: routes, the key check (the settings' keys, and those made
    /// through the API, kept on the first deployment) and CORS.
    fn app(&self, shutdown: CancellationToken) -> axum::Router {
        let state = AppState {
            service: self.service.clone(),
            keys: crate::service::KeyBook::new(crate::store::ApiKeyStore::new(
                self.service.deployments().first().database(),
            )),
            shutdown,
        };
        let access = http::auth::Access {
            api_keys: self.settings.api_keys.clone(),
            cors_allowed_origins: self.settings.cors_allowed_origins.clone(),
        };
        if self.settings.api_keys.is_empty() {
            tracing::warn!(
                "NO API KEYS: API_KEYS is not set, so every caller may read and move every account of every tenant and manage keys. Fine for local development only: set API_KEYS (with an admin: key) anywhere else"
            );
        }
        http::app(state, REQUEST_TIMEOUT, access)
    }

    /// Serves until `shutdown` is cancelled, then stops accepting, lets in-flight
    /// requests and background transfers finish (bounded), and returns.
    pub async fn run_until_stopped(self, shutdown: CancellationToken) -> std::io::Result<()> {
        let app = self.app(shutdown.clone());
        tracing::info!(
            addr = %self.local_addr(),
            instance = %self.settings.instance_id,
            api_keys = self.settings.api_keys.len(),
            cors_origins = self.settings.cors_allowed_origins.len(),
            "listening"
        );
        let watcher = tokio::spawn({
            let deployments = self.service.deployments().clone();
            let shutdown = shutdown.clone();
            async move { deployments.watch(WATCH_INTERVAL, shutdown).await }
        });
        let sweeper = tokio::spawn(crate::sweeper::run(
            self.service.recovery(),
            self.settings.sweep_interval,
            shutdown.clone(),
        ));
        let recorder = tokio::spawn(crate::recorder::run(
            self.service.deployments().clone(),
            self.settings.instance_id.clone(),
            self.settings.event_retention,
            shutdown.clone(),
        ));
        let signal = tokio::spawn({
            let feed = self.service.feed().clone();
            let shutdown = shutdown.clone();
            async move { feed.signal_new_events(shutdown).await }
        });
        let deliverer = tokio::spawn(crate::deliverer::run(
            self.service.feed().clone(),
            self.service.webhooks().clone(),
            self.service.driver().owner().to_owned(),
            std::sync::Arc::new(|event: &crate::domain::Event| {
                let response = http::events::EventResponse::from(event.clone());
                serde_json::to_string(&response).unwrap_or_default()
            }),
            shutdown.clone(),
        ));
        let limits = http::connections::Limits::new(self.places, &self.settings);
        http::connections::serve(self.listener, app, limits, shutdown.clone()).await?;
        let background = self.service.driver().background_tasks();
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
        let _ = recorder.await;
        let _ = signal.await;
        let _ = deliverer.await;
        let _ = watcher.await;
        tracing::info!("stopped");
        Ok(())
    }
}
