//! A transfer and an account as the service reasons about them: every field a value of
//! the domain, valid by construction. The store converts its documents to and from these
//! (`store::documents`); the HTTP layer builds its responses from them.

use super::{
    AccountId, AccountName, Amount, CancelReason, Currency, DeploymentName, Legs, Party, Reference,
    ScopedKey, TenantName, Tenants, TransferId, TransferState,
};

/// A point in time. Every time that another instance compares with another is the
/// database's, never an instance's own clock (see `store::clock`).
pub type Timestamp = chrono::DateTime<chrono::Utc>;

/// This instance's clock, to the millisecond (the precision that is stored and
/// answered, so that an answer and a later read agree). Only for times shown to people
/// (`createdAt`, `updatedAt`), never for one another instance compares with.
pub fn now() -> Timestamp {
    use chrono::SubsecRound;
    chrono::Utc::now().trunc_subsecs(3)
}

/// How a transfer is carried out (`TRANSFER_STRATEGY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// The tutorial's two-phase commit: guarded single-document writes, recoverable at
    /// every step.
    #[default]
    TwoPhase,
    /// One MongoDB multi-document transaction per transfer (`store::native`), for
    /// comparison. It writes the same documents; `Prefer: respond-async` is ignored (the
    /// transaction is the whole transfer), and cancels reverse with two-phase transfers.
    Native,
}

/// One transfer and where it is in the two-phase commit: a line of the transfer log.
#[derive(Debug, Clone, PartialEq)]
pub struct Transfer {
    pub id: TransferId,
    pub source: AccountId,
    pub destination: AccountId,
    /// Where the source account lives, and with it this line of the log: a transfer is
    /// logged on its source's deployment, so that an outage elsewhere never stops it.
    pub source_deployment: DeploymentName,
    /// Where the destination account lives.
    pub destination_deployment: DeploymentName,
    /// The tenants of its accounts (`docs/tenants.md`), set when it is inserted: a
    /// tenant's key sees it when one of them is its own.
    pub tenants: Tenants,
    /// What moves: for a hold, the held amount until a capture sets the captured one.
    pub amount: Amount,
    pub currency: Currency,
    pub state: TransferState,
    /// Set on a hold: what it reserves, and until when.
    pub hold: Option<Hold>,
    /// Set on a multi-leg transfer (`docs/legs.md`): its legs and parties. `source` and
    /// `destination` are then its first leg's (the log is its source's deployment) and
    /// `amount` the money that changes hands ([`Legs::moved`]).
    pub legs: Option<Box<Legs>>,
    /// Inserted before one protocol moved every transfer (a one-leg transfer whose
    /// document names no parties): its receiving party was credited by its prepare (the
    /// old step 4, its commit point), after its paying party, and only loses its marker
    /// at its settle. Every transfer inserted since makes room at its prepare and pays in
    /// at its settle. See `service::protocol`.
    pub credits_at_prepare: bool,
    /// When the transfer last changed, by the database's clock (`lastModified`, stored as
    /// a lower bound of it, and only ever moving forward): its owner's lease runs from
    /// here, and the sweeper takes it over once that lease has lapsed.
    pub last_modified: Timestamp,
    pub created_at: Timestamp,
    /// The process that drives the transfer (the tutorial's `application`); `None` until
    /// its first step.
    pub owner: Option<String>,
    /// Why it ended `canceled`.
    pub reason: Option<CancelReason>,
    /// The account that refused a multi-leg transfer's step, with `reason`.
    pub refused_account: Option<AccountId>,
    pub reference: Option<Reference>,
    /// The idempotency key the transfer was requested with, in its scope.
    pub idempotency_key: Option<ScopedKey>,
    /// A digest of the request that created the transfer, to tell a retry from a reuse of
    /// its idempotency key with another request.
    pub request_hash: Option<String>,
    /// Set on a compensating transfer: the transfer it reverses.
    pub reverses: Option<TransferId>,
    /// Set on a reversed transfer: its compensating transfer.
    pub reversed_by: Option<TransferId>,
    /// A cancel fenced the accounts against this transfer's forward steps, and the fences
    /// have not been collected yet.
    pub fenced: bool,
    /// The reversal was claimed and its compensation has not finished yet.
    pub reversing: bool,
}

impl Transfer {
    /// A transfer as step 1 inserts a reversal's compensation: `initial`, owned by nobody
    /// yet (a new transfer is then [`Transfer::started_by`] its instance), between
    /// accounts of the `default` deployment. Optional fields (the deployments, reference,
    /// idempotency key, reversal link) are set by the caller; the store
    /// stamps `last_modified` with the database's clock when it inserts it.
    pub fn initial(
        id: TransferId,
        source: AccountId,
        destination: AccountId,
        amount: Amount,
        currency: Currency,
    ) -> Transfer {
        let now = now();
        Transfer {
            // Not stamped yet: no lease. The store stamps a transfer with the database's
            // clock when it inserts it (the caller takes that stamp); a copy that missed
            // it has a lease that ended long ago, so its steps are refused, never late.
            last_modified: Timestamp::UNIX_EPOCH,
            id,
            source,
            destination,
            source_deployment: DeploymentName::default(),
            destination_deployment: DeploymentName::default(),
            tenants: Tenants::default(),
            amount,
            currency,
            state: TransferState::Initial,
            hold: None,
            legs: None,
            credits_at_prepare: false,
            created_at: now,
            owner: None,
            reason: None,
            refused_account: None,
            reference: None,
            idempotency_key: None,
            request_hash: None,
            reverses: None,
            reversed_by: None,
            fenced: false,
            reversing: false,
        }
    }

    /// The transfer as a request inserts it for its own run (step 1): `pending`, owned by
    /// `owner`, the instance that drives it, so that its first write after the insert is
    /// the prepare. A `pending` transfer with no marker on any account says what
    /// `initial` says: no account step landed (`docs/protocol.md`).
    pub fn started_by(self, owner: &str) -> Transfer {
        debug_assert_eq!(self.state, TransferState::Initial, "bug: started twice");
        Transfer {
            state: TransferState::Pending,
            owner: Some(owner.to_owned()),
            ..self
        }
    }
}

impl Transfer {
    /// The accounts the protocol moves, each once with its net change: a multi-leg
    /// transfer's parties, or a one-leg transfer's two (its source paying what moves,
    /// its destination receiving it; for a hold, what it reserves).
    pub fn parties(&self) -> std::borrow::Cow<'_, [Party]> {
        if let Some(legs) = &self.legs {
            return std::borrow::Cow::Borrowed(legs.parties());
        }
        let value = self.hold.map_or(self.amount, |h| h.amount).minor_units();
        std::borrow::Cow::Owned(vec![
            Party {
                account: self.source.clone(),
                net: -value,
                deployment: self.source_deployment.clone(),
            },
            Party {
                account: self.destination.clone(),
                net: value,
                deployment: self.destination_deployment.clone(),
            },
        ])
    }

    /// Whether its receiving party is paid in by its prepare, the credit being its
    /// commit point: a one-leg transfer inserted before one protocol
    /// ([`Transfer::credits_at_prepare`]). Never a multi-leg one.
    pub fn pays_in_at_prepare(&self) -> bool {
        self.credits_at_prepare && self.legs.is_none()
    }

    /// What a capture moves on `party`, a party of this hold: a one-leg hold's captured
    /// `amount` (all or part of what it reserves), a multi-leg hold's whole net.
    pub fn captured(&self, party: &Party) -> i64 {
        match &self.legs {
            Some(_) => party.net.abs(),
            None => self.amount.minor_units(),
        }
    }
}

impl Transfer {
    /// The transfer as it stands at `now` (by the database's clock): a hold still `held`
    /// past its `expiresAt` is shown as it will end, `canceled` with reason `expired`,
    /// whether or not a sweeper has written that yet. Nothing can capture it any more
    /// (the capture's guard compares with the same clock).
    pub fn as_of(mut self, now: Timestamp) -> Transfer {
        if self.state == TransferState::Held && self.hold.is_some_and(|h| h.expires_at <= now) {
            self.state = TransferState::Canceled;
            self.reason = Some(CancelReason::Expired);
        }
        self
    }
}

/// What a hold reserves (see `docs/holds.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    /// The amount reserved: out of the source's available balance, into the
    /// destination's pending credits, until the hold is captured, voided or expires.
    pub amount: Amount,
    /// When an uncaptured hold expires, by the database's clock.
    pub expires_at: Timestamp,
}

/// What never changes about an account and a new transfer needs to know of it: where
/// it lives, its currency and its tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub deployment: DeploymentName,
    pub currency: Currency,
    pub tenant: Option<TenantName>,
}

/// An account: its balance in minor units, and the transfers the protocol has applied
/// to it whose markers are still there (not yet pulled, undone, released or captured).
#[derive(Debug, Clone, PartialEq)]
pub struct Account {
    pub id: AccountId,
    /// The deployment that keeps the account (and logs the transfers out of it).
    pub deployment: DeploymentName,
    /// The tenant that owns it, for ever; `None`: no tenant, seen by platform keys only.
    pub tenant: Option<TenantName>,
    pub name: Option<AccountName>,
    /// The posted balance in minor units, 0 ..= `MAX_MONEY`.
    pub balance: i64,
    /// The sum of the live holds out of the account; never above `balance`.
    pub pending_debits: i64,
    /// The sum of the live holds into the account; `balance + pending_credits +
    /// incoming` never passes `MAX_MONEY`, so every capture can land.
    pub pending_credits: i64,
    /// What multi-leg transfers prepared to pay into the account and have not paid yet:
    /// no amount of the account, only the room kept for them (`docs/legs.md`).
    pub incoming: i64,
    pub currency: Currency,
    /// Transfers applied to this account whose markers are not pulled yet (the tutorial's
    /// `pendingTransactions`): applying one of them again is a no-op.
    pub pending_transactions: Vec<TransferId>,
    /// Transfers a cancel fenced: their forward steps are refused here.
    pub fenced_transactions: Vec<TransferId>,
    /// The number of the account's last ledger entry (see [`super::Entry`]): 1 once
    /// opened, one more with every change to its amounts.
    pub seq: u64,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
}

impl Account {
    /// What the account may spend: the posted balance less what its holds reserve.
    pub fn available_balance(&self) -> i64 {
        self.balance - self.pending_debits
    }

    /// The account without the reservations of `expired`, holds past their `expiresAt`
    /// that are not captured: those whose reservation this read of the account still
    /// carries (its marker, which leaves in the same write as the amount) no longer count,
    /// as they will not once released.
    pub fn without(mut self, expired: &[Transfer]) -> Account {
        for t in expired {
            let Some(hold) = t.hold else { continue };
            if !self.pending_transactions.contains(&t.id) {
                continue;
            }
            let held = hold.amount.minor_units();
            match t.legs.as_deref() {
                // A multi-leg hold reserves each party's net on its side.
                Some(legs) => match legs.party(&self.id) {
                    Some(p) if p.pays() => self.pending_debits += p.net,
                    Some(p) => self.pending_credits -= p.net,
                    None => {}
                },
                None => {
                    if t.source == self.id {
                        self.pending_debits -= held;
                    }
                    if t.destination == self.id {
                        self.pending_credits -= held;
                    }
                }
            }
            self.pending_transactions.retain(|id| *id != t.id);
        }
        self
    }
}

/// Which transfers a listing returns, newest first.
#[derive(Debug, Clone, Default)]
pub struct TransferFilter {
    pub state: Option<TransferState>,
    /// Transfers whose source or destination is this account.
    pub account: Option<AccountId>,
    /// Keyset cursor: only transfers older than this one.
    pub before: Option<TransferId>,
    /// Only transfers touching this tenant's accounts.
    pub tenant: Option<TenantName>,
    /// Only holds not expired yet, by the clock of the deployment that logs each (for a
    /// listing of `held` ones).
    pub unexpired: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(expires_at: Timestamp) -> Transfer {
        let id = TransferId::from_bytes([7; 12]);
        let (alice, bob) = (
            AccountId::parse("alice").unwrap(),
            AccountId::parse("bob").unwrap(),
        );
        let amount = Amount::parse(300).unwrap();
        Transfer {
            state: TransferState::Held,
            hold: Some(Hold { amount, expires_at }),
            ..Transfer::initial(id, alice, bob, amount, Currency::usd())
        }
    }

    /// A transfer's lease starts when the database stamps it: before that, nothing an
    /// instance's own clock says may extend it (an instance running ahead would send
    /// steps with deadlines past the stored lease).
    #[test]
    fn a_transfer_not_yet_stamped_by_the_database_has_no_lease() {
        let t = Transfer::initial(
            TransferId::from_bytes([1; 12]),
            AccountId::parse("a").unwrap(),
            AccountId::parse("b").unwrap(),
            Amount::parse(1).unwrap(),
            Currency::usd(),
        );
        assert_eq!(t.last_modified, Timestamp::UNIX_EPOCH);
        assert!(t.created_at > Timestamp::UNIX_EPOCH);
    }

    #[test]
    fn a_held_hold_reads_as_expired_from_its_expiry_on_and_only_then() {
        let at = now();
        let before = hold(at).as_of(at - chrono::TimeDelta::milliseconds(1));
        assert_eq!((before.state, before.reason), (TransferState::Held, None));
        let from = hold(at).as_of(at);
        assert_eq!(
            (from.state, from.reason),
            (TransferState::Canceled, Some(CancelReason::Expired))
        );
        // Only `held` reads differently: a capture that won before stays what it is.
        let captured = Transfer {
            state: TransferState::Capturing,
            ..hold(at)
        };
        assert_eq!(captured.as_of(at).state, TransferState::Capturing);
    }

    #[test]
    fn an_account_drops_only_the_expired_reservations_it_still_carries() {
        let expired = hold(now());
        let account = |id: &str, debits, credits, markers: Vec<TransferId>| Account {
            id: AccountId::parse(id).unwrap(),
            deployment: DeploymentName::default(),
            tenant: None,
            name: None,
            balance: 1_000,
            pending_debits: debits,
            pending_credits: credits,
            incoming: 0,
            currency: Currency::usd(),
            pending_transactions: markers,
            fenced_transactions: Vec::new(),
            seq: 1,
            created_at: now(),
            updated_at: now(),
        };
        let alice =
            account("alice", 500, 0, vec![expired.id]).without(std::slice::from_ref(&expired));
        assert_eq!(
            (alice.pending_debits, alice.available_balance()),
            (200, 800)
        );
        let bob = account("bob", 0, 300, vec![expired.id]).without(std::slice::from_ref(&expired));
        assert_eq!(bob.pending_credits, 0);
        // Released already (no marker): its amount is not in the sums either.
        let released = account("alice", 200, 0, Vec::new()).without(std::slice::from_ref(&expired));
        assert_eq!(released.pending_debits, 200);
        // The marker leaves with the amount: the copy shows the hold released, and a hold
        // listed twice is still taken off once.
        let other = TransferId::from_bytes([8; 12]);
        let twice =
            account("alice", 500, 0, vec![other, expired.id]).without(&[expired.clone(), expired]);
        assert_eq!(
            (twice.pending_debits, twice.pending_transactions),
            (200, vec![other])
        );
    }
}

/// Which account of a one-leg transfer: its source or its destination. The account a
/// protocol step is on, and the account a refusal names (the source for funds, the
/// destination for overflow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}
