//! The attempt log: writes finished attempts to their deliveries as they come, many to
//! a command ([`crate::store::Webhooks::log_attempts`]), each only if its claim still holds: a claim that
//! ran out and was taken by another instance refuses the late write, and that instance
//! sends the delivery again.
//!
//! Bounded: the queue holds [`QUEUED`] finished attempts at most (each a claimed
//! delivery, already bounded by [`MAX_HELD`](super::MAX_HELD), with its shared body); a
//! command writes [`LOG_BATCH`] at most. It ends when every sender of attempts is gone,
//! after writing what they sent.
//!
//! ("Record" names the event recorder, `crate::recorder`; this is the attempt log.)

use std::time::Duration;

use tokio::sync::mpsc;

use crate::domain::Attempt;
use crate::error_chain::Chain;
use crate::store::Store;
use crate::store::webhooks::{AttemptOutcome, Claimed};

use super::MAX_SENDING;

/// An attempt made under its claim and what it decided, on its way to be logged.
pub type Finished = (Claimed, Attempt, AttemptOutcome);
/// Where attempts send what they finished.
pub type Log = mpsc::Sender<Finished>;

/// Finished attempts waiting to be logged, at most: twice the attempts in flight.
const QUEUED: usize = MAX_SENDING * 2;
/// Attempts logged in one command, at most: the command's pipeline looks each
/// delivery's attempt up in the batch, so its cost grows with the square of the batch.
const LOG_BATCH: usize = 64;
/// How long the log waits for more after the first.
const LOG_WAIT: Duration = Duration::from_millis(10);

/// The log's queue: its sending side for the attempts, its receiving side for [`run`].
pub fn channel() -> (Log, mpsc::Receiver<Finished>) {
    mpsc::channel(QUEUED)
}

/// Logs the attempts of `queue` as they finish, many in one command: up to
/// [`LOG_BATCH`], or what came within [`LOG_WAIT`] of the first.
pub async fn run(store: Store, mut queue: mpsc::Receiver<Finished>) {
    while let Some(batch) = next_batch(&mut queue).await {
        match store.webhooks().log_attempts(&batch).await {
            Ok(_) => {
                for (_, _, outcome) in &batch {
                    crate::metrics::delivery_attempted(match outcome {
                        AttemptOutcome::Succeeded => "succeeded",
                        AttemptOutcome::Retry(_) => "retried",
                        AttemptOutcome::GaveUp => "failed",
                    });
                }
            }
            Err(e) => {
                tracing::warn!(attempts = batch.len(), error = %Chain(&e), "webhook attempts not logged; those deliveries are sent again once their claims run out");
            }
        }
    }
}

/// The next batch: the first to come, and what follows it within [`LOG_WAIT`], up to
/// [`LOG_BATCH`]; `None` once every sender is gone and the queue is empty.
async fn next_batch(queue: &mut mpsc::Receiver<Finished>) -> Option<Vec<Finished>> {
    let first = queue.recv().await?;
    let mut batch = vec![first];
    let until = tokio::time::Instant::now() + LOG_WAIT;
    while batch.len() < LOG_BATCH {
        match tokio::time::timeout_at(until, queue.recv()).await {
            Ok(Some(finished)) => batch.push(finished),
            _ => break,
        }
    }
    Some(batch)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn finished(i: usize) -> Finished {
        let claimed = Claimed {
            owner: "token".into(),
            id: format!("wh_1:e{i}"),
            webhook: "wh_1".into(),
            event_id: format!("e{i}"),
            body: Arc::from("{}"),
            tries: 0,
            give_up_at: chrono::Utc::now(),
            claimed_until: std::time::Instant::now(),
        };
        let attempt = Attempt {
            at: chrono::Utc::now(),
            status: Some(204),
            error: None,
            duration_ms: 1,
        };
        (claimed, attempt, AttemptOutcome::Succeeded)
    }

    /// What is queued goes out in batches of [`LOG_BATCH`] at most, in the order it
    /// came, none left out; once the senders are gone the log ends after the last.
    #[tokio::test]
    async fn what_is_queued_is_logged_in_bounded_batches_in_order_and_the_log_ends_after_the_last()
    {
        let (log, mut queue) = channel();
        let n = LOG_BATCH * 2 + 5;
        let sending = tokio::spawn(async move {
            for i in 0..n {
                log.send(finished(i)).await.unwrap();
            }
        });
        let mut seen = Vec::new();
        while let Some(batch) = next_batch(&mut queue).await {
            assert!(
                !batch.is_empty() && batch.len() <= LOG_BATCH,
                "{}",
                batch.len()
            );
            seen.extend(batch.into_iter().map(|(c, _, _)| c.event_id));
        }
        sending.await.unwrap();
        let expected: Vec<String> = (0..n).map(|i| format!("e{i}")).collect();
        assert_eq!(seen, expected);
    }
}
