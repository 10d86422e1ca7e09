//! Where a first attempt and the dispatcher meet ([`First`]): the attempt that ends
//! before the dispatcher seals it hands its outcome over ([`First::ended`]), and its
//! delivery is made with it; one still under way at the seal is made under the
//! dispatcher's claim ([`First::seal`]), and its outcome is logged once the dispatcher
//! says its delivery was made under that claim, never otherwise (a delivery made by
//! another dispatcher, or not made, is not this attempt's to write). Its own file, below
//! both the attempt that ends it and the first attempts that start it, so that neither
//! names the other back.

use std::sync::{Arc, Mutex};

use crate::domain::Attempt;
use crate::store::webhooks::{AttemptOutcome, Made};

/// A first attempt started before its delivery is made.
pub struct First {
    phase: Mutex<Phase>,
    /// Set by the dispatcher once it made the deliveries: whether this one was made under
    /// the claim (an attempt that ends after the seal is logged only then). A
    /// dispatcher that stopped before saying so (its sender dropped) means no.
    made: tokio::sync::watch::Receiver<Option<bool>>,
}

/// The dispatcher's side of [`First::made`].
pub type Told = tokio::sync::watch::Sender<Option<bool>>;

enum Phase {
    /// Under way; tells the dispatcher when it ends.
    Running(tokio::sync::mpsc::Sender<()>),
    /// Ended before the seal: made with its attempt.
    Ended(Attempt, AttemptOutcome),
    /// Sealed by the dispatcher while under way (or after its attempt was taken).
    Sealed,
}

impl First {
    /// A first attempt under way, that tells `ended` when it ends; and the dispatcher's
    /// side of its [`First::made`].
    pub fn new(ended: tokio::sync::mpsc::Sender<()>) -> (Arc<First>, Told) {
        let (told, made) = tokio::sync::watch::channel(None);
        let first = Arc::new(First {
            phase: Mutex::new(Phase::Running(ended)),
            made,
        });
        (first, told)
    }

    /// Seals it: how its delivery is made, with its attempt if it ended, under the claim
    /// if it is still under way (it is logged when it ends).
    pub fn seal(&self) -> Made {
        let mut phase = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        match std::mem::replace(&mut *phase, Phase::Sealed) {
            Phase::Ended(attempt, outcome) => Made::Attempted(attempt, outcome),
            _ => Made::Claimed,
        }
    }

    /// The attempt ended with `attempt`, which decided `outcome`. Before the seal, both
    /// go to the dispatcher, which makes the delivery with them: `None`. After it, they
    /// come back to be logged once the delivery is made under the claim, and `None` if
    /// it was not (or the dispatcher stopped before saying).
    pub async fn ended(
        &self,
        attempt: Attempt,
        outcome: AttemptOutcome,
    ) -> Option<(Attempt, AttemptOutcome)> {
        {
            let mut phase = self.phase.lock().unwrap_or_else(|e| e.into_inner());
            if let Phase::Running(told) = &*phase {
                let _ = told.try_send(());
                *phase = Phase::Ended(attempt, outcome);
                return None;
            }
        }
        // Sealed while under way: logged once made under the claim, if it was.
        let mut made = self.made.clone();
        let made = made.wait_for(Option::is_some).await.ok().and_then(|m| *m);
        (made == Some(true)).then_some((attempt, outcome))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(status: u16) -> Attempt {
        Attempt {
            at: chrono::Utc::now(),
            status: Some(status),
            error: None,
            duration_ms: 3,
        }
    }

    /// An attempt that ends before the seal tells the dispatcher and hands its outcome
    /// over: its delivery is made with it, and nothing is left to log.
    #[tokio::test]
    async fn a_first_attempt_that_ends_before_the_seal_is_made_with_its_delivery() {
        let (ended, mut endings) = tokio::sync::mpsc::channel(1);
        let (first, _told) = First::new(ended);
        let left = first.ended(attempt(204), AttemptOutcome::Succeeded).await;
        assert!(left.is_none(), "nothing to log");
        assert_eq!(endings.try_recv(), Ok(()), "the dispatcher is told");
        match first.seal() {
            Made::Attempted(a, AttemptOutcome::Succeeded) => assert_eq!(a.status, Some(204)),
            _ => panic!("made without its attempt"),
        }
        assert!(matches!(first.seal(), Made::Claimed), "sealed once");
    }

    /// An attempt still under way at the seal is made claimed; when it ends, it is
    /// logged only if the dispatcher says its delivery was made under the claim: not if
    /// the insert refused it, nor if the dispatcher stopped before saying.
    #[tokio::test]
    async fn a_first_attempt_sealed_under_way_is_logged_only_if_made_under_the_claim() {
        for (said, logged) in [(Some(true), true), (Some(false), false), (None, false)] {
            let (ended, _endings) = tokio::sync::mpsc::channel(1);
            let (first, told) = First::new(ended);
            assert!(matches!(first.seal(), Made::Claimed));
            let ending = first.ended(attempt(500), AttemptOutcome::GaveUp);
            tokio::pin!(ending);
            assert!(
                futures::poll!(ending.as_mut()).is_pending(),
                "waits for the dispatcher"
            );
            match said {
                Some(made) => {
                    told.send_replace(Some(made));
                }
                None => drop(told),
            }
            let left = ending.await;
            assert_eq!(left.is_some(), logged, "{said:?}");
            if let Some((a, outcome)) = left {
                assert_eq!(a.status, Some(500));
                assert!(matches!(outcome, AttemptOutcome::GaveUp));
            }
        }
    }
}
