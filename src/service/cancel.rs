//! `POST /transfers/{id}/cancel`, after the tutorial's rule: a transfer that is not yet
//! applied is rolled back; one that is applied is completed and then reversed by a
//! compensating transfer from the destination back to the source.
//!
//! The commit point is `pending -> applied`. Before it, the cancel fences every party of
//! the transfer, the receiving ones first, and from then on no forward step of the
//! transfer can land on them, even one already in flight from another instance; then it
//! takes `pending -> canceling`, which loses only to the owner's own commit. If the commit
//! won, the transfer goes forward and is reversed instead. (A one-leg transfer inserted
//! before one protocol commits by its credit: its destination is fenced only if the
//! credit is not there, in one write, which decides.)
//!
//! A reversal is claimed on the original (`reversedBy`, set once, guarded) before the
//! compensating transfer is inserted, so two cancels never make two reversals; if the
//! compensation ends `canceled` (the destination spent the money meanwhile), the claim is
//! released and the client is told, with nothing changed.

use super::{Driver, HoldConflict, Requests, ServiceError, ServiceResult};
use crate::domain::Side;
use crate::domain::{
    AccountId, CancelReason, Party, Timestamp, Transfer, TransferEvent, TransferId, TransferState,
};
use crate::store::accounts::{Fence, FenceWhen};
use crate::store::transfers::{Fenced, Mover, StepFields};
use crate::store::{Store, StoreError, StoreResult};

/// How a cancel takes a transfer over once its accounts are fenced.
enum Takeover {
    /// Take this event from the state the cancel read, storing these fields too.
    Force(TransferEvent, StepFields),
    /// Only become the owner: the remaining steps are the same whoever runs them.
    Claim,
}

/// Rounds of a cancel, at most: each one re-reads the transfer after another actor moved
/// it, or after a fence reached the server too late. Bounded so that a pathological race
/// cannot spin forever; the client may simply cancel again.
const CANCEL_ROUNDS: usize = 16;

/// How long a cancel waits for a compensating transfer another instance is driving
/// before answering that the reversal is still under way.
const REVERSAL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl Requests {
    /// Cancels a transfer; answers with the original transfer as it ends.
    ///
    /// Admitted like a new transfer (or refused with [`ServiceError::Overloaded`]), and
    /// run in a task of its own, so that a client hanging up does not stop it halfway.
    pub async fn cancel(&self, id: TransferId) -> ServiceResult<Transfer> {
        self.admitted("cancel", id, |service| async move {
            service
                .cancel_admitted(id, CancelReason::CanceledByRequest)
                .await
        })
        .await
    }

    /// Runs `work` (a cancel, a capture, a void of transfer `id`) admitted like a new
    /// transfer (or refused with [`ServiceError::Overloaded`]) and in a task of its own,
    /// so that a client hanging up does not stop it halfway.
    pub(super) async fn admitted<W, F>(
        &self,
        what: &str,
        id: TransferId,
        work: W,
    ) -> ServiceResult<Transfer>
    where
        W: FnOnce(Requests) -> F,
        F: std::future::Future<Output = ServiceResult<Transfer>> + Send + 'static,
    {
        let permit = self.admit().await?;
        let run = work(self.clone());
        let run = self
            .driver
            .background_tasks()
            .spawn(tracing::Instrument::instrument(
                async move {
                    let _permit = permit;
                    run.await
                },
                tracing::Span::current(),
            ));
        run.await.unwrap_or_else(|ended| {
            tracing::error!(transfer_id = %id, "the {what} of this transfer panicked");
            super::error::panicked(ended)
        })
    }

    /// Cancels transfer `id`, storing `reason` (`canceled_by_request`, or `voided` for
    /// a void of a hold still being reserved) if it rolls back.
    pub(super) async fn cancel_admitted(
        &self,
        id: TransferId,
        reason: CancelReason,
    ) -> ServiceResult<Transfer> {
        let mut transfer = self.driver.find_transfer(id).await?;
        // A void (of a hold still being reserved when it was asked for) takes this path
        // only to roll the reservation back: once a capture has won, the void is too
        // late, and says so, rather than undo the capture as a cancel would.
        let voiding = reason == CancelReason::Voided;
        for _ in 0..CANCEL_ROUNDS {
            if voiding
                && matches!(
                    transfer.state,
                    TransferState::Capturing | TransferState::Done
                )
            {
                return Err(ServiceError::Hold {
                    conflict: HoldConflict::AlreadyCaptured,
                    hold: id,
                });
            }
            transfer = match transfer.state {
                TransferState::Initial => {
                    // No account is touched before `initial -> pending`, which this
                    // write makes impossible: nothing to fence, nothing to undo.
                    let fields = StepFields {
                        reason: Some(reason),
                        ..StepFields::default()
                    };
                    self.force(&transfer, TransferEvent::Abandon, fields, None)
                        .await?
                }
                TransferState::Pending
                | TransferState::Applied
                | TransferState::Canceling
                | TransferState::Capturing => self.take_over_fenced(transfer, reason).await?,
                // A held hold is voided (nothing moved yet, so nothing to reverse). If a
                // capture won meanwhile, a void says so; a cancel reverses the capture
                // once done, as it reverses a done transfer.
                TransferState::Held => match self.void_held(transfer).await {
                    Err(ServiceError::Hold {
                        conflict: HoldConflict::AlreadyCaptured,
                        ..
                    }) if !voiding => self.driver.find_transfer(id).await?,
                    other => other?,
                },
                TransferState::Canceled => return Ok(transfer),
                TransferState::Done => return self.reverse(transfer).await,
            };
        }
        Err(StoreError::contended(
            Some(id),
            format!("cancel of transfer {id}: the transfer kept moving under it"),
        )
        .into())
    }

    /// Takes an unfinished transfer away from whoever owns it, without waiting for their
    /// lease, and drives it to its end: back to `canceled` if its credit has not landed,
    /// else forward to `done` (the `Done` branch then reverses it).
    ///
    /// **The rule for moving a transfer someone else owns**: its owner may still have a
    /// debit or credit on its way to the server (sent before a pause, a slow link, a
    /// failover), and once the markers are pulled or undone nothing in that step's own
    /// filter would stop it. So before taking over, a cancel fences every account against
    /// the transfer's forward steps. Every other takeover (the sweeper's) waits for the
    /// owner's lease instead, which outlives the deadline every such step carries.
    async fn take_over_fenced(
        &self,
        transfer: Transfer,
        reason: CancelReason,
    ) -> ServiceResult<Transfer> {
        let log = self.driver.log_store(&transfer)?;
        // The mark comes first, so whoever finishes the transfer, the sweeper later finds
        // the fences and drops them; its stamp starts the window the fences must land in.
        let Some(since) = log.transfers().mark_fenced(transfer.id).await? else {
            return Ok(self.driver.reload(&transfer).await?); // finished meanwhile
        };
        // By the log's clock; each account's deployment checks it by its own.
        let deadline = self.driver.lease_deadline_from(since);
        let Some(mut plan) = plan_takeover(&transfer, reason) else {
            return Ok(self.driver.reload(&transfer).await?);
        };
        let Some(fenced) = self
            .fence_parties(log, &transfer, deadline, &mut plan)
            .await?
        else {
            return Ok(self.driver.reload(&transfer).await?); // a fence came too late
        };
        self.execute_takeover(log, transfer, plan, fenced).await
    }

    /// Fences every party of `transfer` against its forward steps, by `deadline` on the
    /// clock of `log`: the receiving parties first, then the paying ones, each group at
    /// once (a fixed order, so that a test can stop a cancel between the two). The proof
    /// of it, or `None` when a fence reached the server too late. For a transfer that
    /// commits by its credit, the receiving party is fenced only if the credit has not
    /// landed, which decides `plan`: completed, then reversed, if it has.
    async fn fence_parties(
        &self,
        log: &Store,
        transfer: &Transfer,
        deadline: Timestamp,
        plan: &mut Takeover,
    ) -> StoreResult<Option<Fenced>> {
        let parties = transfer.parties();
        let mut fences = Vec::with_capacity(parties.len());
        let mut rest: Vec<&Party> = parties.iter().collect();
        if let Some(i) = deciding_party(transfer, &parties) {
            let party = rest.remove(i);
            match self
                .fence(log, transfer, party, FenceWhen::UnlessApplied, deadline)
                .await?
            {
                Fence::TooLate => return Ok(None),
                Fence::Applied => {
                    // The money may be spent already: complete, then reverse.
                    tracing::info!(transfer_id = %transfer.id, "cancel found the credit applied; completing, then reversing");
                    *plan = Takeover::Force(TransferEvent::MarkApplied, StepFields::default());
                    rest.insert(i, party);
                }
                placed => fences.push(placed),
            }
        }
        for paying in [false, true] {
            let group = rest.iter().filter(|p| p.pays() == paying);
            let placed = futures::future::join_all(
                group.map(|p| self.fence(log, transfer, p, FenceWhen::Always, deadline)),
            )
            .await;
            fences.extend(placed.into_iter().collect::<StoreResult<Vec<Fence>>>()?);
            if fences.contains(&Fence::TooLate) {
                return Ok(None);
            }
        }
        let fenced = Fenced::all(fences).unwrap_or_else(|| {
            panic!(
                "bug: transfer {}: an unconditional fence neither placed nor refused",
                transfer.id
            )
        });
        Ok(Some(fenced))
    }

    /// Fences `party`'s account against `transfer`'s forward steps (as `when` says), by
    /// `deadline` on the clock of `log`, carried over to the account's deployment.
    async fn fence(
        &self,
        log: &Store,
        transfer: &Transfer,
        party: &Party,
        when: FenceWhen,
        deadline: Timestamp,
    ) -> StoreResult<Fence> {
        let store = self.driver.deployments.of(&party.deployment)?;
        let deadline = log
            .deadline_on(deadline, store, self.driver.clock_allowance())
            .await?;
        store
            .accounts()
            .fence(&party.account, transfer.id, when, deadline)
            .await
    }

    /// Carries out `plan`, with the proof that every account is fenced, and drives the
    /// transfer to its end if the takeover won.
    async fn execute_takeover(
        &self,
        log: &Store,
        transfer: Transfer,
        plan: Takeover,
        fenced: Fenced,
    ) -> ServiceResult<Transfer> {
        let taken = match plan {
            Takeover::Force(event, fields) => {
                Some(self.force(&transfer, event, fields, Some(fenced)).await?)
            }
            Takeover::Claim => {
                let state = transfer.state;
                log.transfers()
                    .take_over(self.driver.owner(), transfer.id, state, fenced)
                    .await?
            }
        };
        Ok(match taken {
            Some(transfer) => self.driver.run(transfer).await?,
            None => self.driver.reload(&transfer).await?,
        })
    }

    /// Takes `event` from the transfer's current state whoever owns it, as a cancel may
    /// ([`Mover::Cancel`]: `fenced`, or the transfer still `initial`), logs and counts
    /// the change if this call made it, and answers with the transfer as it now stands.
    async fn force(
        &self,
        transfer: &Transfer,
        event: TransferEvent,
        fields: StepFields,
        fenced: Option<Fenced>,
    ) -> StoreResult<Transfer> {
        let from = transfer.state;
        let to = super::protocol::next_state(transfer, event);
        let by = Mover::Cancel {
            owner: self.driver.owner(),
            fenced,
        };
        let moved = self.driver.log_store(transfer)?.transfers().change_state(
            transfer.id,
            from,
            to,
            by,
            fields.clone(),
        );
        if moved.await?.is_some() {
            let reason = fields.reason;
            tracing::info!(transfer_id = %transfer.id, from = %from, to = %to, reason = ?reason, "transfer state changed");
            crate::metrics::transfer_finished(to, reason);
            if transfer.hold.is_some() {
                crate::metrics::hold_finished(to, reason);
            }
        }
        self.driver.reload(transfer).await
    }

    /// Reverses a done transfer with a compensating transfer, at most once.
    async fn reverse(&self, mut original: Transfer) -> ServiceResult<Transfer> {
        loop {
            if original.reversed_by.is_some() {
                return self.driver.finish_reversal(original).await;
            }
            if let Some(short) = self.short_of_funds_to_reverse(&original).await? {
                return Err(ServiceError::ReversalRefused {
                    reason: CancelReason::InsufficientFunds,
                    account: short,
                    attempt: None,
                });
            }
            let claimed = crate::store::new_transfer_id();
            if self
                .driver
                .log_store(&original)?
                .transfers()
                .claim_reversal(original.id, claimed)
                .await?
            {
                original.reversed_by = Some(claimed);
            } else {
                original = self.driver.find_transfer(original.id).await?;
            }
        }
    }

    /// The account that cannot give back what `original` paid into it, as it stands
    /// now: the destination of a one-leg transfer, or a receiving party of a multi-leg
    /// one. A check before the claim, so that a reversal that would surely be refused
    /// is not even inserted; the compensation's own guards decide.
    async fn short_of_funds_to_reverse(
        &self,
        original: &Transfer,
    ) -> StoreResult<Option<AccountId>> {
        let owed: Vec<(&AccountId, &crate::domain::DeploymentName, i64)> =
            match original.legs.as_deref() {
                None => vec![(
                    &original.destination,
                    &original.destination_deployment,
                    original.amount.minor_units(),
                )],
                Some(legs) => legs
                    .parties()
                    .iter()
                    .filter(|p| p.net > 0)
                    .map(|p| (&p.account, &p.deployment, p.net))
                    .collect(),
            };
        for (account, deployment, amount) in owed {
            let funds = self
                .driver
                .deployments
                .of(deployment)?
                .accounts()
                .account(account)
                .await?
                .map_or(0, |a| a.available_balance());
            if funds < amount {
                return Ok(Some(account.clone()));
            }
        }
        Ok(None)
    }
}

impl Driver {
    /// Drives the claimed reversal of `original` to its end: inserts the compensating
    /// transfer if a crash came between the claim and its insert, runs it, then marks the
    /// reversal finished or, if the compensation was refused (the destination spent the
    /// money between our check and its debit), releases the claim so a later cancel may
    /// try again. Used by a cancel and by the sweeper, for a reversal a crash interrupted.
    ///
    /// If another instance is driving the compensation, returns `original` as it is: that
    /// instance, or the sweeper after it, finishes the reversal.
    pub async fn finish_reversal(&self, original: Transfer) -> ServiceResult<Transfer> {
        let Some(reversal_id) = original.reversed_by else {
            return Ok(original);
        };
        let reversal = self.claimed_reversal(&original, reversal_id).await?;
        let mut reversal = self.run(reversal).await?;
        if !reversal.state.is_terminal() {
            // Another instance drives the compensation: its outcome is the answer.
            reversal = self.wait_until_at_rest(reversal, REVERSAL_WAIT).await?;
        }
        match reversal.state {
            TransferState::Done => {
                self.log_store(&original)?
                    .transfers()
                    .reversal_finished(original.id, reversal_id)
                    .await?;
                Ok(self.reload(&original).await?)
            }
            TransferState::Canceled => {
                self.log_store(&original)?
                    .transfers()
                    .release_reversal(original.id, reversal_id)
                    .await?;
                let reason = reversal.reason.unwrap_or(CancelReason::InsufficientFunds);
                let account = match (&reversal.refused_account, reason) {
                    (Some(refused), _) => refused,
                    (None, CancelReason::InsufficientFunds) => &original.destination,
                    (None, _) => &original.source,
                };
                Err(ServiceError::ReversalRefused {
                    reason,
                    account: account.clone(),
                    attempt: Some(reversal_id),
                })
            }
            // Still running elsewhere: the original still says `reversing`, and the
            // answer says the reversal is under way (202), not that it is made.
            _ => Ok(self.reload(&original).await?),
        }
    }

    /// The compensating transfer claimed as `reversal_id`, inserted now if a crash came
    /// between the claim and the insert.
    async fn claimed_reversal(
        &self,
        original: &Transfer,
        reversal_id: TransferId,
    ) -> ServiceResult<Transfer> {
        // Logged where its source, the original's destination, lives.
        let log = self.store_of(original, Side::Destination)?;
        if let Some(existing) = log.transfers().transfer(reversal_id).await? {
            return Ok(existing);
        }
        // A multi-leg transfer is reversed by one multi-leg transfer, every leg the other
        // way round: logged where its first leg's source, the original's first
        // destination, lives, as for one leg.
        let reversal = Transfer {
            reverses: Some(original.id),
            source_deployment: original.destination_deployment.clone(),
            destination_deployment: original.source_deployment.clone(),
            legs: original.legs.as_deref().map(|l| Box::new(l.reversed())),
            // The same accounts, so the same tenants: whoever saw the original sees it.
            tenants: original.tenants.clone(),
            ..Transfer::initial(
                reversal_id,
                original.destination.clone(),
                original.source.clone(),
                original.amount,
                original.currency.clone(),
            )
        };
        match log.transfers().insert_transfer(&reversal).await {
            // Its lease starts at the stamp the database's clock gave it.
            Ok(stamp) => Ok(Transfer {
                last_modified: stamp,
                ..reversal
            }),
            // A concurrent cancel inserted it first.
            Err(StoreError::DuplicateKey(_)) => Ok(self.find_transfer(reversal_id).await?),
            Err(e) => Err(e.into()),
        }
    }
}

/// What a cancel does with `transfer` once every party is fenced, by its state: a
/// `pending` one is rolled back by `pending -> canceling` (which loses only to the owner's
/// commit, both guarded by `pending`); one past it only has settles, pulls, undos,
/// releases or a capture's writes left, which no fence refuses, and is claimed. `None`
/// for a transfer past what a cancel takes over.
fn plan_takeover(transfer: &Transfer, reason: CancelReason) -> Option<Takeover> {
    Some(match transfer.state {
        TransferState::Pending => {
            let fields = StepFields {
                reason: Some(reason),
                ..StepFields::default()
            };
            Takeover::Force(TransferEvent::BeginRollback, fields)
        }
        TransferState::Applied | TransferState::Canceling | TransferState::Capturing => {
            Takeover::Claim
        }
        _ => return None,
    })
}

/// Where a cancel of `transfer` must decide by one party's fence, the index of that party
/// in `parties`: a `pending` one-leg transfer that credits at its prepare
/// ([`Transfer::pays_in_at_prepare`]) commits by that credit, so its receiving party is
/// fenced first and only where the credit has not landed. Any other transfer commits by
/// its own state change, so every party is fenced unconditionally and the state decides.
fn deciding_party(transfer: &Transfer, parties: &[Party]) -> Option<usize> {
    let commits_at_credit = transfer.state == TransferState::Pending
        && transfer.pays_in_at_prepare()
        && transfer.hold.is_none();
    if !commits_at_credit {
        return None;
    }
    parties.iter().position(|p| !p.pays())
}
