//! Readiness: whether each deployment answers now, as `/ready` asks, within the time a
//! readiness probe allows.

use std::time::Duration;

use super::Driver;
use crate::domain::DeploymentName;
use crate::error_chain::Chain;

/// With several deployments, how long `/ready` waits for each one's ping.
const READY_PING_LIMIT: Duration = Duration::from_millis(900);

impl Driver {
    /// One round trip to each deployment at once; `/ready` asks it. The names of those
    /// that did not answer (as unavailable, or at all within the driver's time-out).
    pub async fn unavailable_deployments(&self) -> Vec<DeploymentName> {
        // One the watch found silent is not asked again, and the others are given less
        // than a second: a readiness probe must answer within its own time-out (often
        // 1 s), not the driver's. With one deployment, nothing is watched and its answer,
        // however slow, is the answer (an instance that cannot reach it is not ready).
        let limit = match self.deployments.all().len() {
            1 => Duration::MAX,
            _ => READY_PING_LIMIT,
        };
        let pings = self.deployments.all().iter().map(|s| async move {
            if !s.is_answering() {
                return Some(s.deployment().clone());
            }
            match tokio::time::timeout(limit, s.ping()).await {
                Ok(Ok(())) => None,
                Ok(Err(e)) => {
                    tracing::warn!(deployment = %s.deployment(), error = %Chain(&e), "deployment does not answer");
                    Some(s.deployment().clone())
                }
                Err(_) => {
                    tracing::warn!(deployment = %s.deployment(), "deployment does not answer within the ping limit");
                    Some(s.deployment().clone())
                }
            }
        });
        futures::future::join_all(pings)
            .await
            .into_iter()
            .flatten()
            .collect()
    }
}
