//! One attempt of one claimed delivery: sent within its claim, its answer read, and what
//! follows decided (done, another attempt after the backoff, or given up), by the
//! database's clock. Its outcome goes to the attempt log, or to the dispatcher for a
//! first attempt (`firsts.rs`).
//!
//! An attempt that could not end before its claim runs out (it waited too long for its
//! places) is not made: the claim runs out, and the delivery is sent by whoever claims
//! it next; so no two instances send one delivery at once by design, and at worst twice
//! after a crash (at least once, with the same `webhook-id`).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;

use crate::domain::{self, Attempt, Webhook, WebhookSettings, backoff_ms};
use crate::error_chain::Chain;
use crate::store::webhooks::{AttemptOutcome, Claimed};
use crate::store::{Store, StoreError, StoreResult};

use super::ATTEMPT_TIMEOUT;
use super::addresses::refused_literal;
use super::attempt_log::Log;
use super::handover::First;
use super::signing::signed_request;
use super::slots::Slots;

/// Where an attempt's outcome goes.
pub enum Report {
    /// To the attempt log: its delivery is made, under its claim.
    Log,
    /// To the dispatcher, which makes the delivery with it if it ends in time, and to
    /// the attempt log once the delivery is made under its claim otherwise.
    First(Arc<First>),
}

/// Why an attempt got no answer: what the delivery's attempt says (`error`), word for
/// word.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The URL's host is an address a delivery may not connect to.
    #[error("{0} is not a public address")]
    NotPublic(IpAddr),
    /// The database gave no time to stamp and sign the request with.
    #[error("no time from the database: {}", Chain(.0))]
    NoTime(StoreError),
    /// No answer within [`ATTEMPT_TIMEOUT`].
    #[error("no answer within {} ms", .0.as_millis())]
    TimedOut(Duration),
    /// The request failed (refused, reset, no address the resolver allows...).
    #[error("{}", Chain(.0))]
    Failed(reqwest::Error),
}

/// One attempt of one claimed delivery.
pub struct Attempting {
    pub store: Store,
    pub client: reqwest::Client,
    pub settings: WebhookSettings,
    pub hook: Webhook,
    pub claimed: Claimed,
    /// Where its places are given back when it ends.
    pub slots: Arc<Slots>,
    /// Where its outcome is logged.
    pub log: Log,
    /// Told when it ends: its place may let the sender's next round claim more.
    pub ended: Arc<tokio::sync::Notify>,
    pub report: Report,
}

impl Attempting {
    /// Sends, holding `places` (its endpoint's and one of the instance's) until the
    /// answer, then reports. An attempt that could not end before its claim runs out
    /// (it waited too long for its places) is not made: the claim runs out, and the
    /// delivery is sent by whoever claims it next.
    pub async fn run(self, places: (OwnedSemaphorePermit, OwnedSemaphorePermit)) {
        if std::time::Instant::now() + ATTEMPT_TIMEOUT > self.claimed.claimed_until {
            drop(places);
            self.slots.release(&self.hook.id);
            self.ended.notify_one();
            tracing::warn!(delivery = %self.claimed.id, "a webhook attempt waited too long for its place to end within its claim; not made, its delivery is sent again once the claim runs out");
            return;
        }
        let at = domain::now();
        let started = std::time::Instant::now();
        let answer = self.send().await;
        let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        drop(places);
        self.slots.release(&self.hook.id);
        self.ended.notify_one();
        let (status, error) = match answer {
            Ok(status) => (Some(status), None),
            Err(why) => (None, Some(why.to_string())),
        };
        let succeeded = status.is_some_and(|s| (200..300).contains(&s));
        let attempt = Attempt {
            at,
            status,
            error,
            duration_ms,
        };
        let outcome = match self.outcome(succeeded).await {
            Ok(outcome) => outcome,
            Err(e) => {
                tracing::warn!(delivery = %self.claimed.id, error = %Chain(&e), "a webhook attempt not logged; the delivery is sent again once its claim runs out");
                return;
            }
        };
        let (attempt, outcome) = match &self.report {
            Report::Log => (attempt, outcome),
            Report::First(first) => match first.ended(attempt, outcome).await {
                Some(left) => left,
                None => return,
            },
        };
        let _ = self.log.send((self.claimed, attempt, outcome)).await;
    }

    /// Sends the delivery; the status answered, or why there was none.
    async fn send(&self) -> Result<u16, SendError> {
        if let Some(ip) = refused_literal(&self.hook.url, self.settings.allow_private) {
            return Err(SendError::NotPublic(ip));
        }
        // The database's clock, not this instance's: every instance stamps by the same
        // clock, and a receiver that refuses old timestamps judges them all alike.
        let now = self
            .store
            .server_time_lower_bound()
            .await
            .map_err(SendError::NoTime)?;
        let request = signed_request(
            &self.client,
            &self.hook,
            &self.claimed.event_id,
            &self.claimed.body,
            now,
        );
        match request.send().await {
            Ok(response) => Ok(response.status().as_u16()),
            Err(e) if e.is_timeout() => Err(SendError::TimedOut(ATTEMPT_TIMEOUT)),
            Err(e) => Err(SendError::Failed(e)),
        }
    }

    /// What follows the attempt: done, another attempt after the backoff, or failed once
    /// past the give-up time.
    async fn outcome(&self, succeeded: bool) -> StoreResult<AttemptOutcome> {
        if succeeded {
            return Ok(AttemptOutcome::Succeeded);
        }
        let wait = backoff_ms(
            self.claimed.tries + 1,
            millis(self.settings.retry_base),
            millis(self.settings.retry_max),
            rand::random::<f64>(),
        );
        let next = self.store.server_time_lower_bound().await?
            + chrono::TimeDelta::milliseconds(i64::try_from(wait).unwrap_or(i64::MAX));
        Ok(if next > self.claimed.give_up_at {
            AttemptOutcome::GaveUp
        } else {
            AttemptOutcome::Retry(next)
        })
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an attempt without an answer says, in the delivery's `error`, is what it
    /// said before the error had a type: the address refused, the missing time, the
    /// time-out, the request's failure and its causes.
    #[tokio::test]
    async fn why_an_attempt_got_no_answer_reads_as_before() {
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(
            SendError::NotPublic(ip).to_string(),
            "10.0.0.1 is not a public address"
        );
        assert_eq!(
            SendError::TimedOut(ATTEMPT_TIMEOUT).to_string(),
            "no answer within 5000 ms"
        );
        let no_time = StoreError::Unavailable("reset by peer".into());
        let said = SendError::NoTime(no_time).to_string();
        assert!(
            said.starts_with("no time from the database: ") && said.ends_with("reset by peer"),
            "{said}"
        );
        // A connection refused: nothing listens on a port just freed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let refused = reqwest::Client::new()
            .post(format!("http://127.0.0.1:{port}/"))
            .send()
            .await
            .unwrap_err();
        let chain = Chain(&refused).to_string();
        let said = SendError::Failed(refused).to_string();
        assert_eq!(said, chain);
        assert!(said.contains("error sending request"), "{said}");
    }
}
