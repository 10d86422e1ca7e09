//! The `transfer-service` binary: read settings, set up logs, build, run until SIGTERM
//! or SIGINT.

use std::process::ExitCode;

use tokio_util::sync::CancellationToken;
use transfer_service::config::Settings;
use transfer_service::startup::Application;
use transfer_service::telemetry;

#[tokio::main]
async fn main() -> ExitCode {
    let settings = match Settings::from_env() {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("transfer-service: {e}");
            return ExitCode::from(2);
        }
    };
    telemetry::init(settings.log_format, &settings.log_filter);
    let app = match Application::build(settings).await {
        Ok(app) => app,
        Err(e) => {
            tracing::error!(error = %telemetry::Chain(&e), "cannot start");
            return ExitCode::FAILURE;
        }
    };
    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    match app.run_until_stopped(shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "server failed");
            ExitCode::FAILURE
        }
    }
}

/// Cancels `shutdown` on the first SIGTERM or SIGINT.
async fn stop_on_signal(shutdown: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for SIGTERM");
                    let _ = ctrl_c.await;
                    shutdown.cancel();
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutdown requested");
    shutdown.cancel();
}
