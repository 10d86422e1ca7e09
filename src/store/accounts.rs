//! Operations on `accounts`. The protocol writes (apply a debit, apply a credit, pull the
//! markers, undo a change) are each guarded as in the tutorial: the guard on
//! `pendingTransactions` makes a retried step a no-op, so every step may be run again
//! after a crash. Debits, credits and pulls are group-committed with those of concurrent
//! transfers (`store::batch`); each keeps its own guards.
//!
//! All of it is the [`Accounts`] view (`store.accounts()`), which holds `accounts`, the
//! database's clock, the group-commit queues (with the entry copier), the availability
//! guard and the instance it writes for.

use std::sync::Arc;

use futures::TryStreamExt;
use mongodb::Collection;
use mongodb::bson::doc;
use mongodb::options::FindOptions;

use super::batch::{AccountChange, Batches, Essentials, Pull, Settle};
use super::clock::Clock;
use super::documents::{EventDue, Stored, domain, object_id, stored_time};
use super::entries::{Marker, Moved, changed_with_entry, opening_entry, room_changed};
use super::fields::account;
use super::guards::Amounts;
use super::{AccountDoc, Availability, StoreError, StoreResult};
use crate::domain::{
    Account, AccountId, Amount, Currency, DeploymentName, EntryKind, EventType, ParseError,
    Placement, Side, TenantName, Timestamp, TransferId,
};

/// The account book's writes and reads of `accounts` (from [`super::Store::accounts`]): the
/// protocol's guarded steps on an account, the fences, and the reads of an account's
/// amounts (its entries are the `Entries` view's). A step appends its entry to
/// the account's document, in the same write, and tells the entry copier.
#[derive(Clone, Copy, Debug)]
pub struct Accounts<'s> {
    pub(super) accounts: &'s Collection<AccountDoc>,
    /// The group-commit queues of the steps, and the entry copier they feed.
    pub(super) batches: &'s Arc<Batches>,
    /// Stamps an account's opening entry.
    pub(super) clock: Clock<'s>,
    /// What an account read here says of its place.
    pub(super) deployment: &'s DeploymentName,
    /// A step is not sent again while its deployment does not answer.
    pub(super) availability: &'s Availability,
    /// Names the pause points of the steps in the tests.
    #[cfg(feature = "failpoints")]
    pub(super) actor: &'s str,
}

#[cfg(feature = "failpoints")]
impl Accounts<'_> {
    /// The instance this view writes for (the name of its pause points).
    fn instance_id(&self) -> &str {
        self.actor
    }

    /// [`super::hold_back`] for this view's instance.
    fn hold_back(
        self,
        point: crate::failpoints::Point,
        write: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> StoreResult<()> {
        super::hold_back(self.actor, point, write)
    }
}

impl Accounts<'_> {
    /// What the entry copier knows is in `entries` of `account`: left out of the
    /// document by the write that changes it.
    fn entries_moved(self, account: &AccountId) -> Option<Moved> {
        self.batches.entry_copier.moved(account.as_str())
    }

    /// Tells the entry copier that `accounts` have new entries.
    fn entries_added<'a>(self, accounts: impl IntoIterator<Item = &'a str>) {
        self.batches.entry_copier.touched(accounts);
    }
}

impl Accounts<'_> {
    /// Opens `account` with its first entry, `opened`, in the same insert. The entry's
    /// time is a lower bound of the database's clock taken before the insert was sent
    /// (an insert cannot read `$$NOW`); every later entry's is the database's own clock
    /// when it lands, and never earlier than this one.
    pub async fn insert_account(self, account: &Account) -> StoreResult<()> {
        let at = self.clock.stamp_time().await?;
        let stored = AccountDoc {
            seq: 1,
            recent_entries: vec![opening_entry(account.balance, at)],
            last_entry_at: Some(at),
            events_due: vec![EventDue {
                kind: EventType::AccountOpened.as_str().to_owned(),
                at,
                balance: Some(account.balance),
            }],
            ..AccountDoc::from(account)
        };
        self.accounts.insert_one(stored).await?;
        Ok(())
    }

    pub async fn account(self, id: &AccountId) -> StoreResult<Option<Account>> {
        let found = self
            .accounts
            .find_one(doc! { "_id": id.as_str() })
            .projection(without_entries())
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        found.map(|d| d.into_domain(self.deployment)).transpose()
    }

    /// The places (here), currencies and tenants of two accounts (`None` for one that
    /// does not exist), read together with those of concurrent transfers (see
    /// `store::batch`).
    pub async fn placements(
        self,
        accounts: [&AccountId; 2],
    ) -> StoreResult<[Option<Placement>; 2]> {
        let found = self
            .batches
            .placements
            .submit(accounts.map(AccountId::to_string))
            .await?;
        let parse = |stored: Option<Essentials>| {
            stored
                .map(|(currency, tenant)| {
                    Ok(Placement {
                        deployment: self.deployment.clone(),
                        currency: Currency::parse(&currency)?,
                        tenant: tenant.as_deref().map(TenantName::parse).transpose()?,
                    })
                })
                .transpose()
                .map_err(|e: ParseError| {
                    StoreError::Malformed(format!("a stored currency or tenant: {e}").into())
                })
        };
        let [source, destination] = found;
        Ok([parse(source)?, parse(destination)?])
    }

    /// Accounts in id order, after `after` when given: keyset pagination, so a page costs
    /// the same however deep it is. Only `tenant`'s when given (index `tenant_id`: a
    /// tenant's page walks its own accounts only).
    pub async fn list_accounts(
        self,
        tenant: Option<&TenantName>,
        after: Option<&AccountId>,
        limit: u32,
    ) -> StoreResult<Vec<Account>> {
        let mut filter = match after {
            Some(after) => doc! { "_id": { "$gt": after.as_str() } },
            None => doc! {},
        };
        if let Some(tenant) = tenant {
            filter.insert(account::TENANT, tenant.as_str());
        }
        let options = FindOptions::builder()
            .sort(doc! { "_id": 1 })
            .limit(i64::from(limit))
            .projection(without_entries())
            .build();
        let cursor = self
            .accounts
            .find(filter)
            .with_options(options)
            .max_time(super::READ_TIME_LIMIT)
            .await?;
        domain(cursor.try_collect().await?, self.deployment)
    }

    /// The prepare of the receiving party of a one-leg transfer inserted before one
    /// protocol (`Transfer::pays_in_at_prepare`): credit the destination, unless already
    /// applied, fenced by a cancel, or the balance and pending credits would pass
    /// `MAX_MONEY`.
    ///
    /// `deadline` is the end of the caller's lease on the transfer, compared with the
    /// server's clock (`$$NOW`): a step that reaches the server late, after another
    /// instance may have taken the transfer over, is refused there.
    pub async fn apply_credit(
        self,
        account: &AccountId,
        tx: TransferId,
        amount: Amount,
        deadline: Timestamp,
    ) -> StoreResult<ForwardStep> {
        self.forward(Forward::Credit, account, tx, amount, deadline)
            .await
    }

    /// Steps 3 and 4 of a transfer or a hold: `kind` of `amount` on `account`.
    pub async fn forward(
        self,
        kind: Forward,
        account: &AccountId,
        tx: TransferId,
        amount: Amount,
        deadline: Timestamp,
    ) -> StoreResult<ForwardStep> {
        let step = Step::new(account, kind, amount.minor_units());
        let mut steps = self.change_accounts(tx, deadline, vec![step]).await?;
        Ok(steps.pop().expect("one answer per step"))
    }

    /// A transfer's prepare of its parties on this deployment (`docs/protocol.md`, step
    /// 3), in one write: each paying party's debit of its net (with its entry), each
    /// receiving party's room for it (`incoming`, no entry), or, for a hold, each one's
    /// reservation ([`Preparing::Reserve`]), each under the guards of every forward step
    /// and `deadline` (as for [`Accounts::apply_credit`]). One answer per party, in order.
    ///
    /// The parties go out as one unit of the batch writer, so a transfer's own two
    /// accounts are one write however the writer's task is scheduled.
    pub async fn prepare_parties(
        self,
        tx: TransferId,
        deadline: Timestamp,
        parties: &[(AccountId, i64, Preparing)],
    ) -> StoreResult<Vec<ForwardStep>> {
        let steps = parties
            .iter()
            .map(|(account, net, preparing)| Step::of_party(account, *net, *preparing))
            .collect();
        self.change_accounts(tx, deadline, steps).await
    }

    /// One party's prepare ([`Accounts::prepare_parties`]): a paying party's debit of its
    /// net, a receiving party's room for it.
    pub async fn prepare(
        self,
        account: &AccountId,
        tx: TransferId,
        net: i64,
        deadline: Timestamp,
    ) -> StoreResult<ForwardStep> {
        self.prepare_one(account, tx, net, Preparing::Prepare, deadline)
            .await
    }

    /// One party's reservation ([`Preparing::Reserve`]).
    pub async fn reserve(
        self,
        account: &AccountId,
        tx: TransferId,
        net: i64,
        deadline: Timestamp,
    ) -> StoreResult<ForwardStep> {
        self.prepare_one(account, tx, net, Preparing::Reserve, deadline)
            .await
    }

    async fn prepare_one(
        self,
        account: &AccountId,
        tx: TransferId,
        net: i64,
        preparing: Preparing,
        deadline: Timestamp,
    ) -> StoreResult<ForwardStep> {
        let party = [(account.clone(), net, preparing)];
        let mut steps = self.prepare_parties(tx, deadline, &party).await?;
        Ok(steps.pop().expect("one answer per party"))
    }

    /// The guarded forward writes behind steps 3 and 4, one unit of the batch writer
    /// (see `store::batch`), group-committed with the concurrent ones: each adds its
    /// change and pushes the marker, only if `tx` is neither applied nor fenced on its
    /// account, the account keeps its invariants (available balance not below zero;
    /// balance plus pending credits within `MAX_MONEY`), and the lease has not ended by
    /// the server's clock.
    ///
    /// A batched write is not a retryable write on a replica set, so a failover or a
    /// dropped connection fails it: it is sent again, a few times, under the same guards
    /// and the same deadline (the marker makes a second landing a no-op). The first
    /// attempt may still land after that, up to its deadline: the answers then say so
    /// ([`ForwardStep::uncertain_until`]), and the caller must not pull or undo the
    /// markers before then.
    async fn change_accounts(
        self,
        tx: TransferId,
        deadline: Timestamp,
        steps: Vec<Step>,
    ) -> StoreResult<Vec<ForwardStep>> {
        #[cfg(feature = "failpoints")]
        {
            let hits = steps
                .iter()
                .map(|s| crate::failpoints::hit(s.kind.point(), self.instance_id()));
            futures::future::join_all(hits).await;
        }
        let changes: Vec<AccountChange> = steps.iter().map(|s| s.to_change(tx, deadline)).collect();
        let (applied, failed_before) = super::retried_while(
            || self.availability.is_answering(),
            || self.send_changes(&steps, &changes),
        )
        .await;
        let applied = applied?;
        self.entries_added(
            steps
                .iter()
                .zip(&applied)
                .filter(|(_, applied)| **applied)
                .map(|(s, _)| s.account.as_str()),
        );
        Ok(applied
            .into_iter()
            .map(|applied| ForwardStep {
                applied,
                uncertain_until: failed_before.then_some(deadline),
            })
            .collect())
    }

    /// One attempt of [`Accounts::change_accounts`]: whether each change took effect.
    async fn send_changes(
        self,
        steps: &[Step],
        changes: &[AccountChange],
    ) -> StoreResult<Vec<bool>> {
        #[cfg(feature = "failpoints")]
        let (changes, held) = self.held_back_changes(steps, changes);
        #[cfg(not(feature = "failpoints"))]
        let _ = steps;
        let applied = if changes.is_empty() {
            Vec::new()
        } else {
            let answers = self
                .batches
                .account_changes
                .submit_all(changes.to_vec())
                .await?;
            answers.into_iter().collect::<StoreResult<Vec<bool>>>()?
        };
        #[cfg(feature = "failpoints")]
        {
            if held {
                return Err(super::StoreError::Unavailable(
                    "failpoint: the request was held back".into(),
                ));
            }
            if crate::failpoints::reply_lost(self.instance_id()).await {
                let lost = "failpoint: the reply was lost";
                return Err(super::StoreError::Unavailable(lost.into()));
            }
        }
        Ok(applied)
    }

    /// A settle of a paying party (and of a receiving one already paid in): forget the
    /// marker of `tx` on `account` and on no other account (group-committed, see
    /// `store::batch::Pull`).
    pub async fn pull_marker(self, account: &AccountId, tx: TransferId) -> StoreResult<()> {
        failpoint!(self, BeforePull);
        self.batches
            .pulls
            .submit(Pull {
                account: account.to_string(),
                tx: object_id(tx),
            })
            .await
    }

    /// Rollback: give back the `amount` a transfer moved on its `side` (to the source, out
    /// of the destination) and forget the marker, only where the transfer was applied.
    pub async fn undo(
        self,
        account: &AccountId,
        tx: TransferId,
        side: Side,
        amount: Amount,
    ) -> StoreResult<bool> {
        failpoint!(self, BeforeUndo);
        let (balance, kind) = match side {
            Side::Source => (amount.minor_units(), EntryKind::DebitUndone),
            Side::Destination => (-amount.minor_units(), EntryKind::CreditUndone),
        };
        let change = Change {
            balance,
            ..Change::default()
        };
        self.pull_marker_with(account, tx, change, kind).await
    }

    /// A void's (or a hold's rollback's) release: give back what the hold reserved here,
    /// `debits` out of the source or `credits` into the destination, and forget the
    /// marker, only where the reservation was made.
    pub async fn release(
        self,
        account: &AccountId,
        tx: TransferId,
        side: Side,
        held: Amount,
    ) -> StoreResult<bool> {
        failpoint!(self, BeforeUndo);
        let (change, kind) = match side {
            Side::Source => (
                Change {
                    debits: -held.minor_units(),
                    ..Change::default()
                },
                EntryKind::DebitReleased,
            ),
            Side::Destination => (
                Change {
                    credits: -held.minor_units(),
                    ..Change::default()
                },
                EntryKind::CreditReleased,
            ),
        };
        self.pull_marker_with(account, tx, change, kind).await
    }

    /// A capture's steps 6 and 7: move `captured` (out of the source, into the
    /// destination) and release the `held` reservation, in one write per account, only
    /// where the reservation is (its marker). Never refused for the balance: the
    /// reservation guaranteed room for it (see `docs/holds.md`).
    pub async fn capture(
        self,
        account: &AccountId,
        tx: TransferId,
        side: Side,
        held: Amount,
        captured: Amount,
    ) -> StoreResult<bool> {
        failpoint!(self, BeforeCapture);
        let (held, captured) = (held.minor_units(), captured.minor_units());
        let (change, kind) = match side {
            Side::Source => (
                Change {
                    balance: -captured,
                    debits: -held,
                    ..Change::default()
                },
                EntryKind::DebitCaptured,
            ),
            Side::Destination => (
                Change {
                    balance: captured,
                    credits: -held,
                    ..Change::default()
                },
                EntryKind::CreditCaptured,
            ),
        };
        self.pull_marker_with(account, tx, change, kind).await
    }

    /// The write behind an undo, a release and a capture: pull the marker of `tx`, adding
    /// `change` and appending its entry (`kind`), only where `tx` is applied (its marker
    /// is there), so that a second landing finds nothing.
    async fn pull_marker_with(
        self,
        account: &AccountId,
        tx: TransferId,
        change: Change,
        kind: EntryKind,
    ) -> StoreResult<bool> {
        let tx = object_id(tx);
        let change = Amounts {
            incoming: change.incoming.into(),
            ..Amounts::change(change.balance, change.debits, change.credits)
        };
        let result = self
            .accounts
            .update_one(
                doc! { "_id": account.as_str(), account::PENDING: tx },
                changed_with_entry(kind, tx, &change, Marker::Pull, self.entries_moved(account)),
            )
            .await?;
        let changed = result.modified_count == 1;
        if changed {
            self.entries_added([account.as_str()]);
        }
        Ok(changed)
    }

    /// A party's settle (`docs/protocol.md`, step 5): a receiving party's `pay_in` (zero
    /// or more) paid in out of the room its prepare made, with its credit entry, and the
    /// marker forgotten, only where the prepare landed (its marker is there); a party with
    /// nothing to pay in (`None`: a paying one, or one credited at its prepare) only loses
    /// its marker, in the same batch (`store::batch::Settle`). Never refused for the
    /// balance: the room guaranteed it.
    pub async fn settle(
        self,
        account: &AccountId,
        tx: TransferId,
        pay_in: Option<i64>,
    ) -> StoreResult<()> {
        self.settle_parties(tx, &[(account.clone(), pay_in)]).await
    }

    /// The settle of every party of `tx` on this deployment ([`Accounts::settle`] each), as
    /// one unit of the batch writer: one write, however the writer's task is scheduled.
    pub async fn settle_parties(
        self,
        tx: TransferId,
        parties: &[(AccountId, Option<i64>)],
    ) -> StoreResult<()> {
        failpoint!(self, BeforeCapture);
        let settles = parties
            .iter()
            .map(|(account, pay_in)| Settle {
                account: account.to_string(),
                tx: object_id(tx),
                pay_in: *pay_in,
            })
            .collect();
        let answers = self.batches.settles.submit_all(settles).await?;
        answers.into_iter().collect::<StoreResult<Vec<()>>>()?;
        self.entries_added(
            parties
                .iter()
                .filter(|(_, pay_in)| pay_in.is_some())
                .map(|(account, _)| account.as_str()),
        );
        Ok(())
    }

    /// A multi-leg transfer's rollback of a receiving party: give back the room its
    /// prepare made (`net`) and forget the marker, only where the prepare landed. No
    /// amount changes, so no entry.
    pub async fn release_room(
        self,
        account: &AccountId,
        tx: TransferId,
        net: i64,
    ) -> StoreResult<bool> {
        failpoint!(self, BeforeUndo);
        let tx = object_id(tx);
        let result = self
            .accounts
            .update_one(
                doc! { "_id": account.as_str(), account::PENDING: tx },
                room_changed(tx, -net, Marker::Pull),
            )
            .await?;
        Ok(result.modified_count == 1)
    }
}

/// The projection of an account read for its amounts and markers: its entries not
/// moved yet are read only by the ledger (`store::entries`).
fn without_entries() -> mongodb::bson::Document {
    doc! { account::RECENT: 0 }
}

/// What a forward step does to its account (see `docs/holds.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forward {
    /// A transfer's debit of the source's balance.
    Debit,
    /// A transfer's credit of the destination's balance.
    Credit,
    /// A hold's reservation out of the source's available balance (`pendingDebits`).
    ReserveOut,
    /// A hold's reservation into the destination (`pendingCredits`), refused if a
    /// capture could take the balance past `MAX_MONEY`.
    ReserveIn,
    /// A multi-leg transfer's prepare of a receiving party: room (`incoming`) for what
    /// it will pay in after its commit point, refused if that could take the balance
    /// past `MAX_MONEY` (`docs/legs.md`). No amount changes: no entry.
    MakeRoom,
}

impl Forward {
    /// The entry this step makes on its account, if any.
    fn entry(self) -> Option<EntryKind> {
        Some(match self {
            Forward::Debit => EntryKind::Debit,
            Forward::Credit => EntryKind::Credit,
            Forward::ReserveOut => EntryKind::DebitReserved,
            Forward::ReserveIn => EntryKind::CreditReserved,
            Forward::MakeRoom => return None,
        })
    }
}

#[cfg(feature = "failpoints")]
impl Forward {
    /// The point right before each attempt of this step's write is sent.
    fn point(self) -> crate::failpoints::Point {
        match self {
            Forward::Debit | Forward::ReserveOut => crate::failpoints::Point::BeforeDebit,
            Forward::Credit | Forward::ReserveIn | Forward::MakeRoom => {
                crate::failpoints::Point::BeforeCredit
            }
        }
    }
}

/// What a party's prepare does (see [`Accounts::prepare_parties`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preparing {
    /// A transfer's: a paying party's debit, a receiving party's room.
    Prepare,
    /// A hold's: a paying party's `pendingDebits`, a receiving party's `pendingCredits`,
    /// each with its entry; a party whose net is zero carries the marker alone.
    Reserve,
    /// The receiving party of a one-leg transfer inserted before one protocol
    /// (`Transfer::pays_in_at_prepare`): its credit, the commit point of that protocol.
    Credit,
}

/// One account's forward step: what kind it is and what it adds.
#[derive(Debug, Clone)]
struct Step {
    account: AccountId,
    kind: Forward,
    change: Change,
}

impl Step {
    /// `kind` of `value` (zero or more) on `account`.
    fn new(account: &AccountId, kind: Forward, value: i64) -> Step {
        let mut change = Change::default();
        match kind {
            Forward::Debit => change.balance = -value,
            Forward::Credit => change.balance = value,
            Forward::ReserveOut => change.debits = value,
            Forward::ReserveIn => change.credits = value,
            Forward::MakeRoom => change.incoming = value,
        }
        Step {
            account: account.clone(),
            kind,
            change,
        }
    }

    /// A party's prepare of `net` on `account`: a paying party's debit or reservation out,
    /// a receiving party's room, reservation in or (an older transfer's) credit; a hold's
    /// party whose net is zero carries the marker alone.
    fn of_party(account: &AccountId, net: i64, preparing: Preparing) -> Step {
        let kind = match (preparing, net) {
            (Preparing::Credit, _) => Forward::Credit,
            (Preparing::Prepare, n) if n < 0 => Forward::Debit,
            (Preparing::Reserve, n) if n < 0 => Forward::ReserveOut,
            (Preparing::Reserve, n) if n > 0 => Forward::ReserveIn,
            _ => Forward::MakeRoom,
        };
        Step::new(account, kind, net.abs())
    }

    /// The batch writer's form of this step of `tx`, refused past `deadline`.
    fn to_change(&self, tx: TransferId, deadline: Timestamp) -> AccountChange {
        AccountChange {
            account: self.account.to_string(),
            tx: object_id(tx),
            delta: self.change.balance,
            debits: self.change.debits,
            credits: self.change.credits,
            incoming: self.change.incoming,
            deadline: stored_time(deadline),
            kind: self.kind.entry(),
        }
    }
}

/// What a step adds to an account's amounts, and to its room.
#[derive(Debug, Clone, Copy, Default)]
struct Change {
    balance: i64,
    debits: i64,
    credits: i64,
    incoming: i64,
}

/// What a debit or credit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardStep {
    /// True: the transfer is applied to the account, by this write (or, in a batch,
    /// which learns the outcome from the markers it reads back, by an earlier landing).
    /// False: this write did not apply it; read the account to learn why, which may be
    /// an earlier landing too.
    pub applied: bool,
    /// Set when an earlier attempt failed without an answer: a copy of the step may
    /// still land until this deadline, so its marker must stay until then.
    pub uncertain_until: Option<Timestamp>,
}

/// Whether a fence stands back from a transfer applied to its account (see
/// [`Accounts::fence`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceWhen {
    /// Placed whether or not the transfer is applied to the account.
    Always,
    /// Placed only if the transfer is not applied to the account (its marker is not
    /// there), in the same write: which decides between rolling back and completing.
    UnlessApplied,
}

/// What a fence write found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// The account now refuses every forward step of the transfer.
    Placed,
    /// Not placed: the transfer is applied to the account (its marker is there).
    Applied,
    /// Not placed: the account does not exist, so no step can land on it either.
    Missing,
    /// Not placed: the fence reached the server after its deadline; mark the transfer
    /// again and retry.
    TooLate,
}

impl Accounts<'_> {
    /// Makes the account refuse every later forward step of `tx`; `when` it is
    /// [`FenceWhen::UnlessApplied`], only if `tx` is not applied to it yet.
    ///
    /// `deadline` bounds when the fence may land, by the server's clock, exactly as a
    /// forward step's lease deadline does: the transfer was marked `fenced` (see
    /// [`super::Transfers::mark_fenced`]) no later than a lease before it, so fence collection,
    /// which waits a whole lease after the transfer's last change, can never run before
    /// a fence that is still on its way.
    pub async fn fence(
        self,
        account: &AccountId,
        transfer: TransferId,
        when: FenceWhen,
        deadline: Timestamp,
    ) -> StoreResult<Fence> {
        let unless_applied = when == FenceWhen::UnlessApplied;
        failpoint!(self, BeforeFence);
        let tx = object_id(transfer);
        let deadline = stored_time(deadline);
        let mut filter = doc! { "_id": account.as_str(), "$expr": { "$lt": ["$$NOW", deadline] } };
        if unless_applied {
            filter.insert(account::PENDING, doc! { "$ne": tx });
        }
        let result = self
            .accounts
            .update_one(filter, doc! { "$addToSet": { account::FENCED: tx } })
            .await?;
        if result.matched_count == 1 {
            return Ok(Fence::Placed);
        }
        Ok(match self.account(account).await? {
            None => Fence::Missing,
            Some(a) if unless_applied && a.pending_transactions.contains(&transfer) => {
                Fence::Applied
            }
            Some(_) => Fence::TooLate,
        })
    }

    /// Removes the fences of `tx` from its accounts. Only once no forward step of `tx`
    /// can land any more: see `sweeper::collect_fences`.
    pub async fn drop_fences(self, accounts: &[&AccountId], tx: TransferId) -> StoreResult<()> {
        let tx = object_id(tx);
        let accounts: Vec<&str> = accounts.iter().map(|a| a.as_str()).collect();
        self.accounts
            .update_many(
                doc! { "_id": { "$in": accounts }, account::FENCED: tx },
                doc! { "$pull": { account::FENCED: tx } },
            )
            .await?;
        Ok(())
    }
}

#[cfg(feature = "failpoints")]
impl Accounts<'_> {
    /// Fault injection (`failpoints::hold_back`): `changes` without those whose point is
    /// held back, each of which is kept to be sent later; and whether any was.
    fn held_back_changes(
        self,
        steps: &[Step],
        changes: &[AccountChange],
    ) -> (Vec<AccountChange>, bool) {
        let mut sent = Vec::new();
        let mut held = false;
        for (step, change) in steps.iter().zip(changes) {
            let (batches, copy) = (self.batches.clone(), change.clone());
            let late = async move {
                let _ = batches.account_changes.submit(copy).await;
            };
            match self.hold_back(step.kind.point(), late) {
                Ok(()) => sent.push(change.clone()),
                Err(_) => held = true,
            }
        }
        (sent, held)
    }
}
