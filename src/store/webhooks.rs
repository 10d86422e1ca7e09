//! Webhooks and their deliveries (`docs/webhooks.md`), kept on the first deployment (one
//! list of endpoints for the whole service, like `accountDirectory`).
//!
//! - `webhooks`: one document per endpoint, its secret with it (a delivery is signed
//!   with it, so it is kept as is; the API shows it only at registration and rotation),
//!   the secret a rotation replaced and until when it signs too, and each deployment's
//!   cluster time at registration (`registeredAt`: its events after it are sent).
//! - `deliveries`: one document per event and endpoint (`_id` `<webhook>:<event>`, so a
//!   second dispatch of the same event is refused): the exact body to send, its state,
//!   its attempts, when the next is due, until when to try, and the lease of the instance
//!   sending it now.
//! - `webhookDispatcher`: the dispatcher's lease and its cursor in the event feed.
//! - `webhookCaps`: one document per scope of `MAX_WEBHOOKS`, and `total` for
//!   `MAX_WEBHOOKS_TOTAL`, written by every registration in the transaction that counts
//!   and inserts, so that two registrations at once cannot both pass a cap
//!   ([`Webhooks::insert_webhook_capped`]).
//!
//! Every change to a delivery is guarded: a claim by the lease being free (by the
//! database's clock), an attempt's outcome by the claimant still holding it, a manual
//! retry by the delivery having failed. A claim that ran out (a killed instance) is taken
//! by another; its late outcome is refused, and the delivery may be sent twice, never
//! lost: at least once.
//!
//! All of it is the [`Webhooks`] view (`store.webhooks()`), which holds the database (its
//! four collections, and the transaction of a registration) and its clock.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use mongodb::bson::{Bson, DateTime, Document, doc};
use mongodb::{Collection, Database};
use serde::{Deserialize, Serialize};

use super::clock::Clock;
use super::documents::stored_time;
use super::fields::{cap, delivery, dispatcher, path, webhook};
use super::{StoreError, StoreResult};
use crate::domain::{
    Attempt, Delivery, DeliveryState, DeploymentName, EventType, TenantName, Timestamp, Webhook,
    WebhookCap, WebhookSecret, WebhookUrl,
};

const WEBHOOKS: &str = "webhooks";
const DELIVERIES: &str = "deliveries";
const DISPATCHER: &str = "webhookDispatcher";
const DISPATCHER_ID: &str = "dispatcher";
/// One document per scope of the cap on webhooks (`MAX_WEBHOOKS`), and [`TOTAL_CAP`]:
/// what two registrations at once both write, so that they cannot both pass a cap.
const WEBHOOK_CAPS: &str = "webhookCaps";
/// The `_id` in `webhookCaps` of the cap on every webhook (`MAX_WEBHOOKS_TOTAL`).
const TOTAL_CAP: &str = "total";

/// The transaction of [`Webhooks::insert_webhook_capped`], on owned handles. Its callback
/// holds only owned values, its documents built before it: with a `&str` in it, rustc
/// could not prove the handler's future `Send` (rust-lang/rust#96865, named in
/// `and_run2`'s documentation).
async fn insert_capped(
    client: mongodb::Client,
    webhooks: Collection<WebhookDoc>,
    caps: Collection<Document>,
    doc: WebhookDoc,
    (cap, total): (usize, usize),
) -> StoreResult<Result<(), WebhookCap>> {
    let (filter, scope) = cap_scope(doc.tenant.as_deref());
    let (marks, inc) = (
        [doc! { "_id": scope }, doc! { "_id": TOTAL_CAP }],
        doc! { "$inc": { cap::REGISTRATIONS: 1_i64 } },
    );
    let counted = [
        (
            filter,
            u64::try_from(cap).unwrap_or(u64::MAX),
            WebhookCap::Scope(cap),
        ),
        (
            doc! {},
            u64::try_from(total).unwrap_or(u64::MAX),
            WebhookCap::Total(total),
        ),
    ];
    let mut session = client.start_session().await?;
    let registered = session
        .start_transaction()
        .write_concern(super::majority_journaled())
        .read_concern(mongodb::options::ReadConcern::snapshot())
        .and_run2(async move |session| {
            // The caps' documents first: a registration running at the same time
            // conflicts here, before either counts (on `total` whatever its scope; on
            // its scope's too, for an instance of a version without `total`).
            for mark in &marks {
                caps.update_one(mark.clone(), inc.clone())
                    .upsert(true)
                    .session(&mut *session)
                    .await?;
            }
            for (filter, cap, met) in &counted {
                let count = webhooks
                    .count_documents(filter.clone())
                    .session(&mut *session)
                    .await?;
                if count >= *cap {
                    session.abort_transaction().await?;
                    return Ok(Err(*met));
                }
            }
            webhooks
                .insert_one(doc.clone())
                .session(&mut *session)
                .await?;
            Ok(Ok(()))
        })
        .await?;
    Ok(registered)
}

/// The webhooks the cap counts, and the `_id` of its document in `webhookCaps`: a
/// tenant's webhooks (`tenant:<name>`), or the platform's (those of no tenant, `all`: the
/// name it had before tenants, when it counted every webhook).
fn cap_scope(tenant: Option<&str>) -> (Document, String) {
    match tenant {
        Some(tenant) => (doc! { webhook::TENANT: tenant }, format!("tenant:{tenant}")),
        None => (doc! { webhook::TENANT: null }, "all".to_owned()),
    }
}

/// A webhook as stored. No `Debug`: it holds the secrets, which are never logged.
#[derive(Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WebhookDoc {
    #[serde(rename = "_id")]
    id: String,
    url: String,
    types: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    description: Option<String>,
    /// The tenant that registered it (`docs/tenants.md`); absent: the platform's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tenant: Option<String>,
    /// `whsec_<base64>`.
    secret: String,
    /// The secret the last rotation replaced, and until when it signs too (the
    /// database's clock when the rotation was written, plus its overlap).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    previous_secret: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    previous_until: Option<DateTime>,
    created_at: DateTime,
    /// Per deployment name, its cluster time read at registration: its events after it
    /// are sent (absent in a webhook made before it was kept).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    registered_at: BTreeMap<String, mongodb::bson::Timestamp>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct AttemptDoc {
    at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    duration_ms: i64,
}

/// A delivery as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DeliveryDoc {
    #[serde(rename = "_id")]
    id: String,
    webhook: String,
    event_id: String,
    event_type: String,
    /// The body every attempt sends, as rendered when the delivery was made (left out of
    /// the reads that do not send).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    body: String,
    state: String,
    #[serde(default)]
    attempts: Vec<AttemptDoc>,
    /// The number of attempts made: what a claim expects, so that two claims of the same
    /// attempt cannot both win.
    #[serde(default)]
    tries: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    next_attempt_at: Option<DateTime>,
    give_up_at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    owner: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lease_until: Option<DateTime>,
    created_at: DateTime,
}

/// A delivery claimed by this instance: what it sends.
#[derive(Debug, Clone)]
pub struct Claimed {
    /// The claim's token (`owner` in the document): what logging its attempt is guarded by.
    pub owner: String,
    pub id: String,
    pub webhook: String,
    pub event_id: String,
    /// Shared by every delivery of the event this instance holds (rendered once).
    pub body: Arc<str>,
    /// Attempts made before this one.
    pub tries: u32,
    pub give_up_at: Timestamp,
    /// By this instance's clock, a time before the claim runs out: an attempt that could
    /// not end by then is not begun (another instance would send the delivery again).
    pub claimed_until: std::time::Instant,
}

/// What an attempt decided.
#[derive(Debug, Clone, Copy)]
pub enum AttemptOutcome {
    Succeeded,
    /// Try again at this time.
    Retry(Timestamp),
    /// Past the give-up time: failed.
    GaveUp,
}

/// A new delivery of an event to a webhook.
pub struct NewDelivery<'a> {
    pub webhook: &'a str,
    pub event_id: &'a str,
    pub event_type: EventType,
    /// The event's body, shared by all its deliveries in memory (rendered once per page);
    /// each delivery's document holds a copy ([`stored_bytes`] counts it).
    pub body: Arc<str>,
    pub give_up_at: Timestamp,
    pub made: Made,
}

/// How a new delivery is made.
#[derive(Debug, Clone, Default)]
pub enum Made {
    /// Due now, for any instance's sender to claim.
    #[default]
    Unclaimed,
    /// Under the caller's claim: its attempt is under way, and is logged under it.
    Claimed,
    /// With its first attempt made already (sent before the delivery was made, which a
    /// crash in between only makes sent again) and what it decided. A delivery that
    /// succeeded keeps no body: no attempt will send it again.
    Attempted(Attempt, AttemptOutcome),
}

/// The webhooks (from [`super::Store::webhooks`]): `webhooks`, their deliveries
/// (`deliveries`), the dispatcher's lease and cursor and the registration caps, all
/// named from the database it holds (a registration is a transaction on it).
#[derive(Clone, Copy, Debug)]
pub struct Webhooks<'s> {
    pub(super) db: &'s Database,
    /// Leases and due times, by the database's clock.
    pub(super) clock: Clock<'s>,
}

impl Webhooks<'_> {
    fn webhooks(self) -> Collection<WebhookDoc> {
        self.db.collection(WEBHOOKS)
    }

    fn deliveries(self) -> Collection<DeliveryDoc> {
        self.db.collection(DELIVERIES)
    }

    fn dispatcher(self) -> Collection<Document> {
        self.db.collection(DISPATCHER)
    }

    fn webhook_caps(self) -> Collection<Document> {
        self.db.collection(WEBHOOK_CAPS)
    }

    /// Registers `w` unless `cap` webhooks of its scope (its tenant's, or the
    /// platform's: `cap_scope`), or `total` webhooks in all, are registered already; the
    /// cap it met otherwise (its scope's first).
    ///
    /// The counts and the insert are one transaction that also writes the caps' documents
    /// (`webhookCaps`: its scope's, and `total`, which every registration writes): two
    /// registrations at once, of any scopes, both write `total`, so one of them conflicts
    /// and runs again (the driver retries a transient conflict), and then counts the
    /// other's webhook. A count read before a plain insert would let both pass, on two
    /// instances as on one. The counts are of the webhooks themselves, never a counter
    /// kept beside them, so no crash can leave them wrong and a deletion needs nothing
    /// more than its own delete. Registrations are thus made one at a time service-wide,
    /// which their rarity allows.
    pub async fn insert_webhook_capped(
        self,
        w: &Webhook,
        cap: usize,
        total: usize,
    ) -> StoreResult<Result<(), WebhookCap>> {
        let doc = WebhookDoc {
            id: w.id.clone(),
            url: w.url.as_str().to_owned(),
            types: w.types.iter().map(|t| t.as_str().to_owned()).collect(),
            description: w.description.clone(),
            tenant: w.tenant.as_ref().map(|t| t.to_string()),
            secret: w.secret.expose(),
            previous_secret: None,
            previous_until: None,
            created_at: stored_time(w.created_at),
            registered_at: w
                .registered_at
                .iter()
                .map(|(name, &(time, increment))| {
                    (
                        name.as_str().to_owned(),
                        mongodb::bson::Timestamp { time, increment },
                    )
                })
                .collect(),
        };
        let client = self.db.client().clone();
        let caps = (cap, total);
        insert_capped(client, self.webhooks(), self.webhook_caps(), doc, caps).await
    }

    /// Every webhook, oldest first: all of them, however many (their number is capped
    /// where they are made, [`Webhooks::insert_webhook_capped`]; a limit here left those
    /// past it never served).
    pub async fn webhooks_all(self) -> StoreResult<Vec<Webhook>> {
        self.webhooks_where(doc! {}).await
    }

    async fn webhooks_where(self, filter: Document) -> StoreResult<Vec<Webhook>> {
        self.webhooks_sorted(filter, None).await
    }

    /// A page of the webhooks of `tenant` (every webhook when `None`), oldest first: at
    /// most `limit` after `after`, the creation time and id of the last of the previous
    /// page (the listing's order, so that a webhook registered meanwhile is met once, at
    /// its place).
    pub async fn webhooks_page(
        self,
        tenant: Option<&TenantName>,
        after: Option<(Timestamp, &str)>,
        limit: i64,
    ) -> StoreResult<Vec<Webhook>> {
        let mut filter = match tenant {
            Some(tenant) => doc! { webhook::TENANT: tenant.as_str() },
            None => doc! {},
        };
        if let Some((created_at, id)) = after {
            let at = stored_time(created_at);
            filter.insert(
                "$or",
                vec![
                    doc! { webhook::CREATED_AT: { "$gt": at } },
                    doc! { webhook::CREATED_AT: at, "_id": { "$gt": id } },
                ],
            );
        }
        self.webhooks_sorted(filter, Some(limit)).await
    }

    async fn webhooks_sorted(
        self,
        filter: Document,
        limit: Option<i64>,
    ) -> StoreResult<Vec<Webhook>> {
        let found: Vec<WebhookDoc> = self
            .webhooks()
            .find(filter)
            .sort(doc! { webhook::CREATED_AT: 1, "_id": 1 })
            .limit(limit.unwrap_or(0))
            .max_time(super::READ_TIME_LIMIT)
            .await?
            .try_collect()
            .await?;
        found.into_iter().map(webhook_from).collect()
    }

    /// Which of the webhooks `ids` exist: their ids only, read by `_id` in reads whose
    /// `$in` holds [`IDS_READ_BYTES`] of ids at most, however many are asked (at most
    /// every webhook, `MAX_WEBHOOKS_TOTAL`).
    pub async fn webhooks_among(
        self,
        ids: &[&str],
    ) -> StoreResult<std::collections::HashSet<String>> {
        let mut found = std::collections::HashSet::new();
        let mut rest = ids;
        while !rest.is_empty() {
            let mut bytes = 0;
            let take = rest
                .iter()
                .take_while(|id| {
                    bytes += id.len() + IN_ELEMENT_BYTES;
                    bytes <= IDS_READ_BYTES
                })
                .count()
                .max(1);
            let (chunk, after) = rest.split_at(take);
            rest = after;
            let read: Vec<Document> = self
                .webhooks()
                .clone_with_type::<Document>()
                .find(doc! { "_id": { "$in": chunk } })
                .projection(doc! { "_id": 1 })
                .max_time(super::READ_TIME_LIMIT)
                .await?
                .try_collect()
                .await?;
            found.extend(
                read.iter()
                    .filter_map(|d| d.get_str("_id").ok().map(str::to_owned)),
            );
        }
        Ok(found)
    }

    pub async fn webhook(self, id: &str) -> StoreResult<Option<Webhook>> {
        self.webhooks()
            .find_one(doc! { "_id": id })
            .await?
            .map(webhook_from)
            .transpose()
    }

    /// Gives webhook `id` the secret `new`; the one it replaces signs too for `overlap`
    /// more, by the database's clock (a lower bound of it; none when zero). One write:
    /// two rotations at once are applied one after the other, the second keeping the
    /// first's new secret as the previous one. The webhook after it, if it exists.
    pub async fn rotate_webhook_secret(
        self,
        id: &str,
        new: &WebhookSecret,
        overlap: Duration,
    ) -> StoreResult<Option<Webhook>> {
        let until = self.clock.server_time_lower_bound().await?
            + chrono::TimeDelta::from_std(overlap).unwrap_or(chrono::TimeDelta::MAX);
        let rotate = if overlap.is_zero() {
            doc! { "$set": {
                webhook::SECRET: new.expose(),
                webhook::PREVIOUS_SECRET: "$$REMOVE",
                webhook::PREVIOUS_UNTIL: "$$REMOVE",
            } }
        } else {
            doc! { "$set": {
                webhook::PREVIOUS_SECRET: path(webhook::SECRET),
                webhook::PREVIOUS_UNTIL: stored_time(until),
                webhook::SECRET: new.expose(),
            } }
        };
        self.webhooks()
            .find_one_and_update(doc! { "_id": id }, vec![rotate])
            .return_document(mongodb::options::ReturnDocument::After)
            .await?
            .map(webhook_from)
            .transpose()
    }

    /// Deletes webhook `id` and its deliveries; whether it existed.
    pub async fn delete_webhook(self, id: &str) -> StoreResult<bool> {
        let deleted = self.webhooks().delete_one(doc! { "_id": id }).await?;
        self.delete_deliveries_of(id).await?;
        Ok(deleted.deleted_count == 1)
    }

    /// Removes every delivery of `webhook` (one that is deleted).
    pub async fn delete_deliveries_of(self, webhook: &str) -> StoreResult<()> {
        self.deliveries()
            .delete_many(doc! { delivery::WEBHOOK: webhook })
            .await?;
        Ok(())
    }

    /// Which of the deliveries `ids` are made (under the claim `token` only, if named).
    pub async fn deliveries_made(
        self,
        ids: &[String],
        token: Option<&str>,
    ) -> StoreResult<std::collections::HashSet<String>> {
        let mut filter = doc! { "_id": { "$in": ids } };
        if let Some(token) = token {
            filter.insert(delivery::OWNER, token);
        }
        let found: Vec<Document> = self
            .deliveries()
            .clone_with_type::<Document>()
            .find(filter)
            .projection(doc! { "_id": 1 })
            .await?
            .try_collect()
            .await?;
        Ok(found
            .iter()
            .filter_map(|d| d.get_str("_id").ok().map(str::to_owned))
            .collect())
    }

    /// Inserts new deliveries; one already made (a dispatch repeated after a crash) is
    /// left as it is. Those [`Made::Claimed`] are made under a claim of `claim` (a claim
    /// token and its lease, by the database's clock), as [`Webhooks::claim_due`] would make
    /// it: the instance that makes them sends them without looking for them, and another
    /// takes them over only once the claim runs out. The ids of those already made
    /// (refused), whose attempts the caller must not log under its claim.
    pub async fn insert_deliveries(
        self,
        new: Vec<NewDelivery<'_>>,
        claim: (&str, Duration),
    ) -> StoreResult<Vec<String>> {
        if new.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.clock.server_time_lower_bound().await?;
        let until = now + chrono::TimeDelta::from_std(claim.1).unwrap_or(chrono::TimeDelta::MAX);
        let docs: Vec<DeliveryDoc> = new
            .into_iter()
            .map(|d| delivery_doc(d, now, (claim.0, until)))
            .collect();
        let ids: Vec<String> = docs.iter().map(|d| d.id.clone()).collect();
        match self.deliveries().insert_many(docs).ordered(false).await {
            Ok(_) => Ok(Vec::new()),
            Err(e) => match e.kind.as_ref() {
                mongodb::error::ErrorKind::InsertMany(f)
                    if f.write_concern_error.is_none()
                        && f.write_errors.iter().flatten().all(|w| w.code == 11000) =>
                {
                    Ok(f.write_errors
                        .iter()
                        .flatten()
                        .filter_map(|w| ids.get(w.index).cloned())
                        .collect())
                }
                _ => Err(StoreError::from(e)),
            },
        }
    }

    /// Claims for `owner`, for `lease` (by the database's clock), up to `per_webhook`
    /// deliveries due now of each webhook in `per_webhook` (those not named are left),
    /// at most `limit` in all, the longest due first: one read of the due ones, one
    /// `updateMany` that claims those still pending and unclaimed (or whose claim ran
    /// out), and one read of what this claim won. A claim carries a token of its own
    /// (`owner` and a random suffix), so a later claim of the same instance and a late
    /// log of an earlier one never mix.
    pub async fn claim_due(
        self,
        owner: &str,
        lease: Duration,
        per_webhook: &std::collections::HashMap<String, usize>,
        limit: i64,
    ) -> StoreResult<Vec<Claimed>> {
        // A lower bound of the database's clock: a claim that ran out is seen a little
        // late, never early.
        let now = self.clock.server_time_lower_bound().await?;
        let until = now + chrono::TimeDelta::from_std(lease).unwrap_or(chrono::TimeDelta::MAX);
        // By this instance's clock, a while before the claim runs out (its start is a lower
        // bound of the database's clock, a little behind it).
        let claimed_until = std::time::Instant::now() + lease.saturating_sub(lease / 6);
        let hooks: Vec<&str> = per_webhook
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(h, _)| h.as_str())
            .collect();
        if hooks.is_empty() {
            return Ok(Vec::new());
        }
        let due = self.due_for(&hooks, per_webhook, now, limit).await?;
        let ids: Vec<&str> = due.iter().map(String::as_str).collect();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let token = claim_token(owner);
        self.claim_deliveries(&ids, &token, now, until).await?;
        let won: Vec<DeliveryDoc> = self
            .deliveries()
            .find(doc! { "_id": { "$in": ids }, delivery::OWNER: &token })
            .projection(doc! { delivery::ATTEMPTS: 0 })
            .await?
            .try_collect()
            .await?;
        Ok(won
            .into_iter()
            .map(|d| Claimed {
                tries: u32::try_from(d.tries).unwrap_or(u32::MAX),
                give_up_at: d.give_up_at.to_chrono(),
                claimed_until,
                owner: token.clone(),
                id: d.id,
                webhook: d.webhook,
                event_id: d.event_id,
                body: d.body.into(),
            })
            .collect())
    }

    /// Claims for `token` until `until` those of deliveries `ids` still pending and
    /// unclaimed (or whose claim ran out) at `now`.
    async fn claim_deliveries(
        self,
        ids: &[&str],
        token: &str,
        now: Timestamp,
        until: Timestamp,
    ) -> StoreResult<()> {
        // Unclaimed, or its claim ran out: no `leaseUntil`, or one before now. Written as
        // a `$not` rather than an `$or`, which SecantusDB answers with a scan of the
        // whole collection (24 ms at 30,000 deliveries, against 1.7 ms).
        let claim = doc! {
            "_id": { "$in": ids },
            delivery::STATE: DeliveryState::Pending.as_str(),
            delivery::LEASE_UNTIL: { "$not": { "$gte": stored_time(now) } },
        };
        // Not due again before the claim runs out: the due read passes it by.
        let take = doc! { "$set": {
            delivery::OWNER: token,
            delivery::LEASE_UNTIL: stored_time(until),
            delivery::NEXT_ATTEMPT_AT: stored_time(until),
        } };
        let (claimed, _) = super::retried(|| async {
            self.deliveries()
                .update_many(claim.clone(), take.clone())
                .await
                .map_err(StoreError::from)
        })
        .await;
        claimed.map(|_| ())
    }

    /// The ids of up to `limit` deliveries due at `now` and not under a live claim, at
    /// most `per_webhook` of each of `hooks`, the longest due first.
    async fn due_for(
        self,
        hooks: &[&str],
        per_webhook: &std::collections::HashMap<String, usize>,
        now: Timestamp,
        limit: i64,
    ) -> StoreResult<Vec<String>> {
        // The due ones by the `{state, nextAttemptAt}` index; those under a live claim
        // (in flight here or elsewhere) are left out here rather than in the filter, an
        // `$or` that SecantusDB would answer with a scan.
        let filter = doc! {
            delivery::STATE: DeliveryState::Pending.as_str(),
            delivery::NEXT_ATTEMPT_AT: { "$lte": stored_time(now) },
            delivery::WEBHOOK: { "$in": hooks },
        };
        let due: Vec<Document> = self
            .deliveries()
            .clone_with_type::<Document>()
            .find(filter)
            .sort(doc! { delivery::NEXT_ATTEMPT_AT: 1 })
            .limit(limit + CLAIMED_ELSEWHERE)
            .projection(doc! { "_id": 1, delivery::WEBHOOK: 1, delivery::LEASE_UNTIL: 1 })
            .max_time(super::READ_TIME_LIMIT)
            .await?
            .try_collect()
            .await?;
        let due: Vec<Document> = due
            .into_iter()
            .filter(|d| {
                d.get_datetime(delivery::LEASE_UNTIL)
                    .map_or(true, |until| until.to_chrono() < now)
            })
            .collect();
        let mut room = per_webhook.clone();
        Ok(due
            .iter()
            .filter_map(|d| {
                let hook = d.get_str(delivery::WEBHOOK).ok()?;
                let left = room.get_mut(hook)?;
                (*left > 0).then(|| *left -= 1)?;
                d.get_str("_id").ok().map(str::to_owned)
            })
            .collect())
    }

    /// Logs attempts and what each decided (the deliverer's attempt log), in one
    /// `updateMany`, each only if its claim still holds (same claim token, still pending,
    /// at the same attempt): a claim that ran out and was taken by another instance
    /// refuses the late write. How many were logged.
    ///
    /// One `updateMany` with a pipeline that finds each delivery's logged attempt by its id,
    /// rather than one statement per delivery: SecantusDB commits (and syncs) each
    /// statement of an `update` on its own (44 ms for 64, against 5 ms for the same 64
    /// in one `updateMany`).
    pub async fn log_attempts(
        self,
        done: &[(Claimed, Attempt, AttemptOutcome)],
    ) -> StoreResult<u64> {
        if done.is_empty() {
            return Ok(0);
        }
        let ids: Vec<&str> = done.iter().map(|(c, _, _)| c.id.as_str()).collect();
        let logged = done
            .iter()
            .map(|(claimed, attempt, outcome)| logged_attempt(claimed, attempt, *outcome))
            .collect::<StoreResult<Vec<Document>>>()?;
        let filter =
            doc! { "_id": { "$in": &ids }, delivery::STATE: DeliveryState::Pending.as_str() };
        let update = logging(logged);
        // Not a retryable write on a replica set (it may change many documents): sent
        // again here on a failure, which each logged attempt's guard makes safe (one that
        // landed moved `tries` on).
        let (answer, _) = super::retried(|| async {
            self.deliveries()
                .update_many(filter.clone(), update.clone())
                .await
                .map_err(StoreError::from)
        })
        .await;
        Ok(answer?.modified_count)
    }

    /// The deliveries of `webhook` in `state` (all when `None`), newest first, at most
    /// `limit`, those before `before` only (the creation time and id of the last of the
    /// previous page) when it is given.
    pub async fn deliveries_of(
        self,
        webhook: &str,
        state: Option<DeliveryState>,
        before: Option<(Timestamp, &str)>,
        limit: i64,
    ) -> StoreResult<Vec<Delivery>> {
        let mut filter = doc! { delivery::WEBHOOK: webhook };
        if let Some(state) = state {
            filter.insert(delivery::STATE, state.as_str());
        }
        if let Some((created_at, id)) = before {
            let at = stored_time(created_at);
            filter.insert(
                "$or",
                vec![
                    doc! { delivery::CREATED_AT: { "$lt": at } },
                    doc! { delivery::CREATED_AT: at, "_id": { "$lt": id } },
                ],
            );
        }
        let found: Vec<DeliveryDoc> = self
            .deliveries()
            .find(filter)
            .sort(doc! { delivery::CREATED_AT: -1, "_id": -1 })
            .limit(limit)
            .projection(doc! { delivery::BODY: 0 })
            .max_time(super::READ_TIME_LIMIT)
            .await?
            .try_collect()
            .await?;
        found.into_iter().map(delivery_from).collect()
    }

    /// One delivery of `webhook`.
    pub async fn delivery(self, webhook: &str, id: &str) -> StoreResult<Option<Delivery>> {
        let found = self
            .deliveries()
            .find_one(doc! { "_id": id, delivery::WEBHOOK: webhook })
            .projection(doc! { delivery::BODY: 0 })
            .await?;
        found.map(delivery_from).transpose()
    }

    /// Makes failed delivery `id` of `webhook` pending again, due now, tried until
    /// `give_up_at`. Whether it was failed.
    pub async fn retry_delivery(
        self,
        webhook: &str,
        id: &str,
        give_up_at: Timestamp,
    ) -> StoreResult<bool> {
        let now = self.clock.server_time_lower_bound().await?;
        let again = self
            .deliveries()
            .update_one(
                doc! { "_id": id, delivery::WEBHOOK: webhook, delivery::STATE: DeliveryState::Failed.as_str() },
                doc! { "$set": {
                    delivery::STATE: DeliveryState::Pending.as_str(),
                    delivery::NEXT_ATTEMPT_AT: stored_time(now),
                    delivery::GIVE_UP_AT: stored_time(give_up_at),
                } },
            )
            .await?;
        Ok(again.matched_count == 1)
    }

    /// When the oldest pending delivery was made, if one is pending.
    pub async fn oldest_pending_delivery(self) -> StoreResult<Option<Timestamp>> {
        let found = self
            .deliveries()
            .clone_with_type::<Document>()
            .find_one(doc! { delivery::STATE: DeliveryState::Pending.as_str() })
            .sort(doc! { delivery::CREATED_AT: 1 })
            .projection(doc! { delivery::CREATED_AT: 1 })
            .await?;
        Ok(found.and_then(|d| {
            d.get_datetime(delivery::CREATED_AT)
                .ok()
                .map(|t| t.to_chrono())
        }))
    }

    /// Takes or renews the dispatcher's lease for `owner`, as
    /// [`super::Events::claim_recorder`] does the recorder's. The dispatcher's cursor in the
    /// feed when `owner` holds it.
    pub async fn claim_dispatcher(
        self,
        owner: &str,
        lease: Duration,
    ) -> StoreResult<Option<Option<String>>> {
        let now = self.clock.server_time().await?;
        let until = self.clock.server_time_lower_bound().await?
            + chrono::TimeDelta::from_std(lease).unwrap_or(chrono::TimeDelta::MAX);
        self.dispatcher()
            .update_one(
                doc! { "_id": DISPATCHER_ID },
                doc! { "$setOnInsert": { dispatcher::CREATED: stored_time(now) } },
            )
            .upsert(true)
            .await?;
        let filter = doc! { "_id": DISPATCHER_ID, "$or": [
            { dispatcher::OWNER: owner },
            { dispatcher::LEASE_UNTIL: { "$lt": stored_time(now) } },
            { dispatcher::LEASE_UNTIL: { "$exists": false } },
        ] };
        let claim = doc! { "$set": { dispatcher::OWNER: owner, dispatcher::LEASE_UNTIL: stored_time(until) } };
        let state = self
            .dispatcher()
            .find_one_and_update(filter, claim)
            .return_document(mongodb::options::ReturnDocument::After)
            .await?;
        Ok(state.map(|s| s.get_str(dispatcher::CURSOR).ok().map(str::to_owned)))
    }

    /// Gives up `owner`'s dispatcher lease (at shutdown), so another instance goes on at
    /// once.
    pub async fn release_dispatcher(self, owner: &str) -> StoreResult<()> {
        self.dispatcher()
            .update_one(
                doc! { "_id": DISPATCHER_ID, dispatcher::OWNER: owner },
                doc! { "$unset": { dispatcher::LEASE_UNTIL: "" } },
            )
            .await?;
        Ok(())
    }

    /// Saves the dispatcher's cursor, if `owner` still holds its lease.
    pub async fn save_dispatcher_cursor(self, owner: &str, cursor: &str) -> StoreResult<bool> {
        let saved = self
            .dispatcher()
            .update_one(
                doc! { "_id": DISPATCHER_ID, dispatcher::OWNER: owner },
                doc! { "$set": { dispatcher::CURSOR: cursor } },
            )
            .await?;
        Ok(saved.matched_count == 1)
    }
}

/// The document of new delivery `d`, made at `now` (under `claim`, a token and its end,
/// if it is [`Made::Claimed`]).
fn delivery_doc(d: NewDelivery<'_>, now: Timestamp, claim: (&str, Timestamp)) -> DeliveryDoc {
    let mut doc = DeliveryDoc {
        id: format!("{}:{}", d.webhook, d.event_id),
        webhook: d.webhook.to_owned(),
        event_id: d.event_id.to_owned(),
        event_type: d.event_type.as_str().to_owned(),
        body: String::from(&*d.body),
        state: DeliveryState::Pending.as_str().to_owned(),
        attempts: Vec::new(),
        tries: 0,
        next_attempt_at: Some(stored_time(now)),
        give_up_at: stored_time(d.give_up_at),
        owner: None,
        lease_until: None,
        created_at: stored_time(now),
    };
    match d.made {
        Made::Unclaimed => {}
        // Due only if the claim runs out.
        Made::Claimed => {
            doc.owner = Some(claim.0.to_owned());
            doc.lease_until = Some(stored_time(claim.1));
            doc.next_attempt_at = Some(stored_time(claim.1));
        }
        Made::Attempted(attempt, outcome) => {
            doc.attempts = vec![attempt_doc(&attempt)];
            doc.tries = 1;
            let (state, next) = after_attempt(outcome);
            doc.state = state.as_str().to_owned();
            doc.next_attempt_at = next;
            if matches!(outcome, AttemptOutcome::Succeeded) {
                doc.body = String::new();
            }
        }
    }
    doc
}

/// The most bytes of an attempt's `error` kept: what an attempt adds to a delivery's
/// document is bounded, so [`stored_bytes`] holds whatever the error.
pub const MAX_ERROR_BYTES: usize = 1024;

/// The bytes of a delivery's document other than its ids, body and claim token: the
/// field names, the type, state, times and counters, and one attempt (its error at most
/// [`MAX_ERROR_BYTES`]). Checked against the real encoding in this module's tests.
const DELIVERY_FIXED_BYTES: usize = 512 + MAX_ERROR_BYTES;

/// An upper bound of what new delivery `d` adds to each command that makes it, made
/// under a claim of `token`: its document in the insert (however its first attempt
/// ends, [`Made`] being decided after the batch is cut) and its id in the `$in` of the
/// read of those already made. The dispatcher cuts its batches by this
/// (`deliverer::batch`), so that no command it sends passes its bound.
pub fn stored_bytes(d: &NewDelivery<'_>, token: &str) -> usize {
    // The `_id` twice (the document and the `$in`), `webhook` and `eventId` once more.
    let ids = 3 * (d.webhook.len() + 1 + d.event_id.len());
    DELIVERY_FIXED_BYTES + ids + d.body.len() + token.len()
}

/// A claim's token: the instance's `owner` and a random suffix of this claim, so that a
/// later claim of the same instance and a late log of an earlier one never mix.
pub fn claim_token(owner: &str) -> String {
    format!("{owner}#{:016x}", rand::random::<u64>())
}

/// What [`log_attempts`](Webhooks::log_attempts) writes into one delivery, if its
/// claim holds: the delivery (`i`), the claim (`o` its token, `t` the attempts before),
/// the attempt (`a`), the state after it (`s`) and when the next is due (`n`, null when
/// none is).
fn logged_attempt(
    claimed: &Claimed,
    attempt: &Attempt,
    outcome: AttemptOutcome,
) -> StoreResult<Document> {
    let stored = mongodb::bson::to_bson(&attempt_doc(attempt))
        // Its fields are a date, integers and a string: always BSON.
        .unwrap_or_else(|e| panic!("bug: an attempt cannot be stored: {e}"));
    let (state, next) = after_attempt(outcome);
    let next = next.map_or(Bson::Null, Bson::DateTime);
    Ok(doc! {
        "i": &claimed.id,
        "o": &claimed.owner,
        "t": i64::from(claimed.tries),
        "a": stored,
        "s": state.as_str(),
        "n": next,
    })
}

fn attempt_doc(attempt: &Attempt) -> AttemptDoc {
    AttemptDoc {
        at: stored_time(attempt.at),
        status: attempt.status.map(i32::from),
        error: attempt
            .error
            .as_deref()
            .map(|e| truncated(e, MAX_ERROR_BYTES)),
        duration_ms: i64::try_from(attempt.duration_ms).unwrap_or(i64::MAX),
    }
}

/// A delivery's state after an attempt that decided `outcome`, and when its next attempt
/// is due, if one is.
fn after_attempt(outcome: AttemptOutcome) -> (DeliveryState, Option<DateTime>) {
    match outcome {
        AttemptOutcome::Succeeded => (DeliveryState::Succeeded, None),
        AttemptOutcome::Retry(at) => (DeliveryState::Pending, Some(stored_time(at))),
        AttemptOutcome::GaveUp => (DeliveryState::Failed, None),
    }
}

/// The update pipeline of [`Webhooks::log_attempts`]: each delivery takes the attempt
/// logged under the claim it is under now (its id, claim token and attempts before all
/// the same: a batch may hold a late log of an earlier claim of the same delivery
/// beside the live one), if it is still pending, and is left as it is otherwise. The
/// claim's `owner` and `leaseUntil` are emptied (null), the attempt pushed (the latest
/// [`MAX_ATTEMPTS_KEPT`] kept), `tries` counted.
fn logging(logged: Vec<Document>) -> Vec<Document> {
    let mine = doc! { "$arrayElemAt": [
        { "$filter": {
            "input": { "$literal": logged },
            "as": "c",
            "cond": { "$and": [
                { "$eq": ["$$c.i", "$_id"] },
                { "$eq": ["$$c.o", path(delivery::OWNER)] },
                { "$eq": ["$$c.t", path(delivery::TRIES)] },
            ] },
        } },
        0,
    ] };
    let holds = doc! { "$and": [
        { "$eq": [{ "$type": "$$r" }, "object"] },
        { "$eq": [path(delivery::STATE), DeliveryState::Pending.as_str()] },
    ] };
    let after = doc! {
        delivery::ATTEMPTS: { "$slice": [
            { "$concatArrays": [{ "$ifNull": [path(delivery::ATTEMPTS), []] }, ["$$r.a"]] },
            -MAX_ATTEMPTS_KEPT,
        ] },
        delivery::TRIES: { "$add": [path(delivery::TRIES), 1_i64] },
        delivery::STATE: "$$r.s",
        delivery::NEXT_ATTEMPT_AT: "$$r.n",
        delivery::OWNER: Bson::Null,
        delivery::LEASE_UNTIL: Bson::Null,
    };
    vec![doc! { "$replaceWith": { "$let": {
        "vars": { "r": mine },
        "in": { "$cond": [holds, { "$mergeObjects": ["$$ROOT", after] }, "$$ROOT"] },
    } } }]
}

/// The most bytes of ids in one read of [`Webhooks::webhooks_among`]: well under the 16 MiB
/// a MongoDB command may be.
const IDS_READ_BYTES: usize = 1 << 20;
/// What an id adds to an `$in` besides its own bytes, at most: a type byte, its index as
/// a key (up to seven digits and a NUL), its length and its NUL.
const IN_ELEMENT_BYTES: usize = 1 + 8 + 4 + 1;

/// How many due deliveries under live claims a claim's read looks past: the attempts
/// in flight across the instances.
const CLAIMED_ELSEWHERE: i64 = 512;

/// The attempts a delivery keeps (the latest): a delivery retried for days makes a few
/// dozen; the bound keeps a document small whatever the settings.
const MAX_ATTEMPTS_KEPT: i32 = 100;

/// At most `max` bytes of `text`, cut at a character's boundary.
fn truncated(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

fn webhook_from(d: WebhookDoc) -> StoreResult<Webhook> {
    let bad = |why: String| StoreError::Malformed(format!("webhook {}: {why}", d.id).into());
    let types = d
        .types
        .iter()
        .map(|t| EventType::parse(t).map_err(|e| bad(e.0)))
        .collect::<StoreResult<Vec<_>>>()?;
    let previous = match (&d.previous_secret, d.previous_until) {
        (Some(secret), Some(until)) => Some((
            WebhookSecret::parse(secret).map_err(|e| bad(e.0))?,
            until.to_chrono(),
        )),
        _ => None,
    };
    let registered_at = d
        .registered_at
        .iter()
        .map(|(name, at)| {
            let name = DeploymentName::parse(name).map_err(|e| bad(e.0))?;
            Ok((name, (at.time, at.increment)))
        })
        .collect::<StoreResult<BTreeMap<_, _>>>()?;
    Ok(Webhook {
        url: WebhookUrl::parse(&d.url).map_err(|e| bad(e.0))?,
        secret: WebhookSecret::parse(&d.secret).map_err(|e| bad(e.0))?,
        previous,
        registered_at,
        types,
        description: d.description.clone(),
        tenant: d
            .tenant
            .as_deref()
            .map(TenantName::parse)
            .transpose()
            .map_err(|e| bad(e.0))?,
        created_at: d.created_at.to_chrono(),
        id: d.id,
    })
}

fn delivery_from(d: DeliveryDoc) -> StoreResult<Delivery> {
    let bad = |why: String| StoreError::Malformed(format!("delivery {}: {why}", d.id).into());
    Ok(Delivery {
        event_type: EventType::parse(&d.event_type).map_err(|e| bad(e.0))?,
        state: DeliveryState::parse(&d.state).map_err(|e| bad(e.0))?,
        attempts: d
            .attempts
            .iter()
            .map(|a| Attempt {
                at: a.at.to_chrono(),
                status: a.status.and_then(|s| u16::try_from(s).ok()),
                error: a.error.clone(),
                duration_ms: u64::try_from(a.duration_ms).unwrap_or(0),
            })
            .collect(),
        next_attempt_at: d.next_attempt_at.map(DateTime::to_chrono),
        created_at: d.created_at.to_chrono(),
        id: d.id,
        webhook: d.webhook,
        event_id: d.event_id,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Each field of `webhooks` and `deliveries` named in `store::fields` is the name
    /// serde writes, and each name serde writes is there.
    #[test]
    fn the_webhook_and_delivery_fields_are_the_names_serde_writes() {
        use super::super::fields::{assert_same_keys, attempt};
        let now = DateTime::now();
        let hook = WebhookDoc {
            id: "wh_1".into(),
            url: "https://example.com/hook".into(),
            types: vec!["transfer.done".into()],
            description: Some("d".into()),
            tenant: Some("acme".into()),
            secret: "whsec_x".into(),
            previous_secret: Some("whsec_y".into()),
            previous_until: Some(now),
            created_at: now,
            registered_at: BTreeMap::from([(
                "default".to_owned(),
                mongodb::bson::Timestamp {
                    time: 1,
                    increment: 1,
                },
            )]),
        };
        assert_same_keys(webhook::ALL, &hook);
        let tried = AttemptDoc {
            at: now,
            status: Some(200),
            error: Some("e".into()),
            duration_ms: 3,
        };
        assert_same_keys(attempt::ALL, &tried);
        let made = DeliveryDoc {
            id: "wh_1:e".into(),
            webhook: "wh_1".into(),
            event_id: "e".into(),
            event_type: "transfer.done".into(),
            body: "{}".into(),
            state: "pending".into(),
            attempts: vec![tried],
            tries: 1,
            next_attempt_at: Some(now),
            give_up_at: now,
            owner: Some("token".into()),
            lease_until: Some(now),
            created_at: now,
        };
        assert_same_keys(delivery::ALL, &made);
    }

    /// The bytes of `d`'s document, whichever way it is made, at most (the largest of a
    /// delivery made under a claim and one made with an attempt of the longest error),
    /// and of its id as one element of an `$in`.
    pub(crate) fn encoded_bytes(d: &NewDelivery<'_>, token: &str) -> usize {
        let now = chrono::Utc::now();
        let until = now + chrono::TimeDelta::seconds(30);
        let attempt = Attempt {
            at: now,
            status: Some(503),
            error: Some("é".repeat(MAX_ERROR_BYTES)),
            duration_ms: u64::MAX,
        };
        let made = [
            Made::Unclaimed,
            Made::Claimed,
            Made::Attempted(attempt.clone(), AttemptOutcome::Retry(until)),
            Made::Attempted(attempt, AttemptOutcome::GaveUp),
        ];
        let document = made
            .into_iter()
            .map(|made| {
                let new = NewDelivery {
                    webhook: d.webhook,
                    event_id: d.event_id,
                    event_type: d.event_type,
                    body: d.body.clone(),
                    give_up_at: d.give_up_at,
                    made,
                };
                let doc = mongodb::bson::to_document(&delivery_doc(new, now, (token, until)))
                    .expect("a delivery's document");
                mongodb::bson::to_vec(&doc).expect("encoded").len()
            })
            .max()
            .unwrap_or(0);
        // In an array: a type byte, the index as a key ("1234567" and a NUL), the length,
        // the id and its NUL.
        let in_element = 1 + 8 + 4 + d.webhook.len() + 1 + d.event_id.len() + 1;
        document + in_element
    }

    /// The bytes of the filter of the read of deliveries `ids` made already.
    pub(crate) fn read_bytes(ids: &[String]) -> usize {
        let filter = doc! { "_id": { "$in": ids } };
        mongodb::bson::to_vec(&filter).expect("encoded").len()
    }

    #[test]
    fn stored_bytes_bounds_a_deliverys_document_and_its_id_whatever_their_sizes() {
        let webhook = format!("wh_{}", "a".repeat(24));
        let long_event = format!("transfer.canceled:{}", "x".repeat(64));
        let token = format!("{}#{:016x}", "i".repeat(128), u64::MAX);
        for event_id in ["account.opened:a", long_event.as_str()] {
            for body_len in [0, 1, 700, 65_536, 3 << 20] {
                let d = NewDelivery {
                    webhook: &webhook,
                    event_id,
                    event_type: EventType::TransferCanceled,
                    body: Arc::from("b".repeat(body_len)),
                    give_up_at: chrono::Utc::now(),
                    made: Made::Unclaimed,
                };
                let (bound, real) = (stored_bytes(&d, &token), encoded_bytes(&d, &token));
                assert!(
                    real <= bound,
                    "{event_id}, body {body_len}: {real} bytes encoded, bound {bound}"
                );
            }
        }
    }

    #[test]
    fn an_attempts_error_is_kept_to_its_bound_at_a_characters_boundary() {
        let error = "é".repeat(MAX_ERROR_BYTES);
        let kept = truncated(&error, MAX_ERROR_BYTES);
        assert_eq!(kept.len(), MAX_ERROR_BYTES);
        let odd = truncated(&error, MAX_ERROR_BYTES - 1);
        assert_eq!(odd.len(), MAX_ERROR_BYTES - 2);
        assert_eq!(truncated("short", MAX_ERROR_BYTES), "short");
    }
}
