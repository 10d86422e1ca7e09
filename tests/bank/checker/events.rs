//! The event feed (`docs/events.md`) once everything is quiet: read through the API of
//! the live instances as a reader would, following `next` from no cursor ([`read_end`]),
//! and checked against the books and each deployment's stored events ([`check`]).
//!
//! Each deployment's recorder places the events marked due under a lease, so the feed may
//! lag the books after the nemesis (an instance killed, a database restarted). The reader
//! keeps its cursor and reads on (a pass ends with an empty page; the next one starts
//! from its `next`) until the feed holds the event of every transfer the logs hold
//! finished and of every account, or [`CATCH_UP`] has passed. Then it reads each
//! deployment's `events` straight from its database, reads on from its cursor once more
//! (nothing may come), and reads the whole feed again from no cursor (until it holds
//! those events too, for at most [`READ_AGAIN`]: an instance that believes a deployment
//! down leaves its events out of the page until it answers).
//!
//! Checked, over every deployment at once:
//!
//! - every page is answered (503s and lost connections retried on another live instance;
//!   a 410 `cursor_expired`, or any other answer, is a violation);
//! - no event id appears twice in a reading; each is `<type>:<subject>`, with a time;
//! - every event is about a transfer or an account in the books;
//! - every `done` transfer of the logs has one `transfer.done` event and no
//!   `transfer.canceled`, every `canceled` one one `transfer.canceled` and no
//!   `transfer.done`, the data as the log ends it (state, amount, accounts, currency,
//!   reason, reference, `reverses`, the held amount; no `reversedBy`);
//! - `transfer.held` only for holds, at most one each, its data `held` with the held
//!   amount and no reason (a hold refused while reserving was never held: none is
//!   required);
//! - every account the test opened has one `account.opened`, its data the account as
//!   opened (its deployment, the opening balance, `seq` 1);
//! - once the feed holds every finished transfer's and account's event, no event comes
//!   later (a `held` is placed before its hold's end, in its round or an earlier one);
//! - the order, per deployment: in each reading, a deployment's events come in the order
//!   of their stored `key`s, none missing and none that is not stored; every page's
//!   `next` moves each deployment's position forward only, to the `key` of the last of
//!   its events in the page; and what the order of the changes implies: an account's
//!   opening before the events of the transfers out of it (logged on its deployment), a
//!   hold's `held` before its end, and a transfer's `done` before its reversal's when
//!   both are logged on one deployment.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use mongodb::bson::{Document, doc};
use serde_json::{Value, json};
use transfer_service::domain::{Account, FeedCursor, Position, Transfer, TransferState};
use transfer_service::store::events::key;

use super::{Checks, End};
use crate::deployments::{Books, Layout};
use crate::workload::{ACCOUNTS, Bases, OPENING_BALANCE, account, live_base};

/// How long the reader waits for the feed to hold every expected event.
const CATCH_UP: Duration = Duration::from_secs(60);
/// How long the second reading, from no cursor, may take to hold them too.
const READ_AGAIN: Duration = Duration::from_secs(20);
/// Between two passes over the feed while it catches up.
const POLL_EVERY: Duration = Duration::from_millis(500);
/// Events a page, the most the API gives.
const PAGE: u32 = 1000;
/// Attempts at a page, each on a random live instance, [`RETRY_AFTER`] apart.
const PAGE_ATTEMPTS: usize = 40;
const RETRY_AFTER: Duration = Duration::from_millis(250);
/// Violations listed by id at most, where many could be.
const LISTED: usize = 20;

const OPENED: &str = "account.opened";
const HELD: &str = "transfer.held";
const DONE: &str = "transfer.done";
const CANCELED: &str = "transfer.canceled";

/// One event as the API answered it.
#[derive(Debug, Clone)]
pub struct FeedEvent {
    pub id: String,
    pub kind: String,
    pub at: String,
    pub data: Value,
}

impl FeedEvent {
    /// The id of the account or transfer it is about, as its data says.
    fn subject(&self) -> &str {
        self.data["id"].as_str().unwrap_or_default()
    }
}

/// A page of a reading: how many events it held, and its `next`.
pub struct PageSeen {
    pub events: usize,
    pub next: String,
}

/// A reading of the feed, following `next` from no cursor.
#[derive(Default)]
pub struct Reading {
    /// In feed order.
    pub events: Vec<FeedEvent>,
    pub pages: Vec<PageSeen>,
    /// Requests sent...
    pub requests: u64,
    /// ...and attempts that got no page (a 503, a connection lost, no live instance) and
    /// were retried.
    pub retried: u64,
    /// Why the reading stopped: a 410, an answer that is not a page, or no attempt got
    /// one.
    pub failed: Option<String>,
    /// From the start of the reading until it held every expected event; `None` when it
    /// did not within its time.
    pub complete_after: Option<Duration>,
}

/// What one request for a page came to.
enum Got {
    Page(Vec<FeedEvent>, String),
    /// Worth another attempt.
    Retry(String),
    /// A failure of the feed.
    Wrong(String),
}

impl Reading {
    /// The `next` of its last page: where it reads on from.
    fn cursor(&self) -> Option<&str> {
        self.pages.last().map(|p| p.next.as_str())
    }

    /// Reads on from its cursor until an empty page; false when it failed.
    async fn pass(&mut self, http: &reqwest::Client, bases: &Bases) -> bool {
        while self.failed.is_none() {
            match self.page(http, bases).await {
                Ok((events, next)) => {
                    let n = events.len();
                    self.events.extend(events);
                    self.pages.push(PageSeen { events: n, next });
                    if n == 0 {
                        return true;
                    }
                }
                Err(e) => self.failed = Some(e),
            }
        }
        false
    }

    /// Passes over the feed, [`POLL_EVERY`] apart, until it holds every id of `expected`
    /// or `within` has passed since it began.
    async fn follow(
        &mut self,
        http: &reqwest::Client,
        bases: &Bases,
        expected: &HashSet<String>,
        within: Duration,
    ) {
        let started = Instant::now();
        let mut seen: HashSet<String> = HashSet::new();
        loop {
            let before = self.events.len();
            let ended = self.pass(http, bases).await;
            seen.extend(self.events[before..].iter().map(|e| e.id.clone()));
            if expected.is_subset(&seen) {
                self.complete_after = Some(started.elapsed());
                return;
            }
            if !ended || started.elapsed() >= within {
                return;
            }
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    /// The page after its cursor, from a random live instance, retried.
    async fn page(
        &mut self,
        http: &reqwest::Client,
        bases: &Bases,
    ) -> Result<(Vec<FeedEvent>, String), String> {
        let query = match self.cursor() {
            Some(cursor) => format!("/events?after={cursor}&limit={PAGE}"),
            None => format!("/events?limit={PAGE}"),
        };
        let mut last = "no live instance".to_owned();
        for _ in 0..PAGE_ATTEMPTS {
            let live = live_base(bases, &mut rand::rng());
            if let Some((_, base)) = live {
                self.requests += 1;
                match get_page(http, &format!("{base}{query}")).await {
                    Got::Page(events, next) => return Ok((events, next)),
                    Got::Retry(why) => last = why,
                    Got::Wrong(why) => return Err(why),
                }
            }
            self.retried += 1;
            tokio::time::sleep(RETRY_AFTER).await;
        }
        Err(format!(
            "no page after {PAGE_ATTEMPTS} attempts, the last: {last}"
        ))
    }
}

/// One request for a page of the feed.
async fn get_page(http: &reqwest::Client, url: &str) -> Got {
    let response = match http.get(url).send().await {
        Ok(response) => response,
        Err(e) => return Got::Retry(format!("{url}: {e}")),
    };
    let status = response.status().as_u16();
    let body = match response.text().await {
        Ok(body) => body,
        Err(e) => return Got::Retry(format!("{url} answered {status}, then: {e}")),
    };
    match status {
        200 => match parse_page(&body) {
            Ok((events, next)) => Got::Page(events, next),
            Err(e) => Got::Wrong(format!(
                "{url} answered a page that is not one ({e}): {body}"
            )),
        },
        503 => Got::Retry(format!("{url} answered 503: {body}")),
        _ => Got::Wrong(format!("{url} answered {status}: {body}")),
    }
}

/// The events and the `next` of a page as the API answers it.
fn parse_page(body: &str) -> Result<(Vec<FeedEvent>, String), String> {
    let page: Value = serde_json::from_str(body).map_err(|e| e.to_string())?;
    let items = page["items"].as_array().ok_or("no items")?;
    let next = page["next"].as_str().ok_or("no next")?.to_owned();
    let mut events = Vec::with_capacity(items.len());
    for item in items {
        let field = |name: &str| {
            item[name]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| format!("an item without {name}: {item}"))
        };
        if !item["data"].is_object() {
            return Err(format!("an item without data: {item}"));
        }
        events.push(FeedEvent {
            id: field("id")?,
            kind: field("type")?,
            at: field("at")?,
            data: item["data"].clone(),
        });
    }
    Ok((events, next))
}

/// Per deployment, its stored events' ids and keys in key order, read straight from its
/// database; `Err` when it could not be read.
pub type Stored = BTreeMap<String, Result<Vec<(String, String)>, String>>;

/// What the reader found once everything was quiet.
pub struct EventsSeen {
    /// The reading that followed its cursor until the feed held every expected event, and
    /// once more after the stored events were read.
    pub followed: Reading,
    /// The events that last pass brought.
    pub late: usize,
    /// The whole feed read again from no cursor, after the stored events were read.
    pub again: Reading,
    pub stored: Stored,
    /// The ids of the events every finished transfer and every account calls for.
    pub expected: usize,
}

/// The ids of the events the books call for: every finished transfer's end and every
/// account's opening.
fn expected_ids(end: &End) -> HashSet<String> {
    let mut expected: HashSet<String> = end
        .transfers
        .iter()
        .filter_map(|t| match t.state {
            TransferState::Done => Some(format!("{DONE}:{}", t.id)),
            TransferState::Canceled => Some(format!("{CANCELED}:{}", t.id)),
            _ => None,
        })
        .collect();
    expected.extend(end.accounts.iter().map(|a| format!("{OPENED}:{}", a.id)));
    expected
}

/// Reads the feed through the API of the live instances, and every deployment's stored
/// events (see the module doc). Once everything is quiet: after the transfers of `end`.
pub async fn read_end(books: &Books, bases: &Bases, end: &End) -> EventsSeen {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let expected = expected_ids(end);
    let mut followed = Reading::default();
    followed.follow(&http, bases, &expected, CATCH_UP).await;
    let stored = read_stored(books).await;
    let before = followed.events.len();
    followed.pass(&http, bases).await;
    let late = followed.events.len() - before;
    let mut again = Reading::default();
    again.follow(&http, bases, &expected, READ_AGAIN).await;
    EventsSeen {
        followed,
        late,
        again,
        stored,
        expected: expected.len(),
    }
}

/// Every deployment's stored events (`_id`, `key`), in key order: its feed's order.
async fn read_stored(books: &Books) -> Stored {
    let mut stored = BTreeMap::new();
    for store in &books.stores {
        let events = store.database().collection::<Document>("events");
        let read = async {
            events
                .find(doc! {})
                .projection(doc! { "key": 1 })
                .sort(doc! { "key": 1 })
                .await?
                .try_collect::<Vec<Document>>()
                .await
        };
        let found = match tokio::time::timeout(Duration::from_secs(30), read).await {
            Ok(Ok(found)) => found
                .iter()
                .map(|d| match (d.get_str("_id"), d.get_str("key")) {
                    (Ok(id), Ok(key)) => Ok((id.to_owned(), key.to_owned())),
                    _ => Err(format!("a stored event without _id or key: {d}")),
                })
                .collect(),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("no answer within 30 s".to_owned()),
        };
        stored.insert(store.deployment().to_string(), found);
    }
    stored
}

/// Every check of the module doc, on what `seen` holds and the books' final `transfers`
/// and `accounts`.
pub fn check(
    seen: &EventsSeen,
    layout: Layout,
    transfers: &[Transfer],
    accounts: &[Account],
    checks: &mut Checks,
) {
    let readings = [
        ("followed until complete", &seen.followed),
        ("read again from no cursor", &seen.again),
    ];
    for (name, reading) in readings {
        checks.check(
            "events: the feed is read to its end through the API (503s retried, no 410)",
            reading.failed.is_none(),
            || {
                format!(
                    "the reading {name} stopped: {}",
                    reading.failed.as_deref().unwrap_or("")
                )
            },
        );
        checks.check(
            "events: the feed holds every finished transfer's and every account's event in time",
            reading.complete_after.is_some(),
            || {
                format!(
                    "the reading {name} did not hold the {} events the books call for in time",
                    seen.expected
                )
            },
        );
        check_once(name, reading, checks);
    }
    if seen.followed.complete_after.is_some() {
        checks.check(
            "events: once the feed holds every finished transfer's and account's event, none comes later",
            seen.late == 0,
            || {
                let late = &seen.followed.events[seen.followed.events.len() - seen.late..];
                let ids: Vec<&str> = late.iter().take(LISTED).map(|e| e.id.as_str()).collect();
                format!("{} events came later: {ids:?}", seen.late)
            },
        );
    }
    let events = &seen.followed.events;
    let mut by_id: HashMap<&str, Vec<&FeedEvent>> = HashMap::new();
    for e in events {
        by_id.entry(e.id.as_str()).or_default().push(e);
    }
    check_subjects(events, transfers, accounts, checks);
    for t in transfers {
        check_transfer(t, &by_id, checks);
    }
    check_accounts(layout, accounts, &by_id, checks);
    let placed = check_stored(seen, checks);
    for (name, reading) in readings {
        check_order(name, reading, &seen.stored, &placed, checks);
        check_cursors(name, reading, &placed, checks);
    }
    check_causality(events, transfers, checks);
}

/// No event id twice in `reading`.
fn check_once(name: &str, reading: &Reading, checks: &mut Checks) {
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for e in &reading.events {
        *counts.entry(e.id.as_str()).or_default() += 1;
    }
    let mut twice: Vec<(&str, usize)> = counts.into_iter().filter(|(_, n)| *n > 1).collect();
    twice.sort();
    checks.check(
        "events: no event id appears twice in a reading of the feed",
        twice.is_empty(),
        || {
            format!(
                "the reading {name} gave {} ids more than once: {:?}",
                twice.len(),
                &twice[..twice.len().min(LISTED)]
            )
        },
    );
}

/// Every event read is well formed and about a transfer or an account in the books.
fn check_subjects(
    events: &[FeedEvent],
    transfers: &[Transfer],
    accounts: &[Account],
    checks: &mut Checks,
) {
    let transfer_ids: HashSet<String> = transfers.iter().map(|t| t.id.to_string()).collect();
    let account_ids: HashSet<&str> = accounts.iter().map(|a| a.id.as_str()).collect();
    for e in events {
        checks.check(
            "events: an event's id is its type and its subject, and it has a time",
            [OPENED, HELD, DONE, CANCELED].contains(&e.kind.as_str())
                && e.id == format!("{}:{}", e.kind, e.subject())
                && chrono::DateTime::parse_from_rfc3339(&e.at).is_ok(),
            || format!("{} ({}, at {}): {}", e.id, e.kind, e.at, e.data),
        );
        let in_books = match e.kind.as_str() {
            OPENED => account_ids.contains(e.subject()),
            _ => transfer_ids.contains(e.subject()),
        };
        checks.check(
            "events: every event is about a transfer or an account in the books",
            in_books,
            || format!("{} is about nothing in the books: {}", e.id, e.data),
        );
    }
}

/// The events read of `kind` about `subject`.
fn events_of<'a>(
    by_id: &HashMap<&str, Vec<&'a FeedEvent>>,
    kind: &str,
    subject: &str,
) -> Vec<&'a FeedEvent> {
    by_id
        .get(format!("{kind}:{subject}").as_str())
        .cloned()
        .unwrap_or_default()
}

/// Transfer `t` as `GET /transfers/{id}` answers it in `state` with `amount`, in the
/// fields an event's data is compared on: `reason` as given, no `reversedBy`.
fn expected_data(t: &Transfer, state: TransferState, amount: i64, reason: Option<&str>) -> Value {
    // A multi-leg transfer shows its legs, and no source or destination.
    let legs = t.legs.as_deref().map(|legs| {
        legs.legs()
            .iter()
            .map(|l| {
                json!({
                    "source": l.source.as_str(),
                    "destination": l.destination.as_str(),
                    "amount": l.amount.minor_units(),
                })
            })
            .collect::<Vec<_>>()
    });
    let one_leg = legs.is_none();
    json!({
        "id": t.id.to_string(),
        "source": one_leg.then(|| t.source.as_str()),
        "destination": one_leg.then(|| t.destination.as_str()),
        "legs": legs,
        "amount": amount,
        "currency": t.currency.as_str(),
        "state": state.as_str(),
        "heldAmount": t.hold.map(|h| h.amount.minor_units()),
        "reason": reason,
        "reference": t.reference.as_ref().map(|r| r.as_str()),
        "reverses": t.reverses.map(|r| r.to_string()),
        "reversedBy": null,
    })
}

/// The fields of `expected` that `data` has otherwise (a field `expected` has null must
/// be absent); empty when it matches.
fn differences(data: &Value, expected: &Value) -> Vec<String> {
    let mut differ = Vec::new();
    for (field, want) in expected.as_object().into_iter().flatten() {
        let got = data.get(field).unwrap_or(&Value::Null);
        if got != want {
            differ.push(format!("{field} is {got}, not {want}"));
        }
    }
    differ
}

/// Transfer `t`'s events: its end's once, with the data the log has; a `held` only for a
/// hold, at most once, with the held amount.
fn check_transfer(t: &Transfer, by_id: &HashMap<&str, Vec<&FeedEvent>>, checks: &mut Checks) {
    let id = t.id.to_string();
    let (done, canceled) = (events_of(by_id, DONE, &id), events_of(by_id, CANCELED, &id));
    let (ends, others) = match t.state {
        TransferState::Done => (&done, &canceled),
        TransferState::Canceled => (&canceled, &done),
        _ => (&done, &canceled),
    };
    if t.state.is_terminal() {
        checks.check(
            "events: a finished transfer has one event of its end and none of the other",
            ends.len() == 1 && others.is_empty(),
            || {
                format!(
                    "{id}, {} in the log, has {} {DONE} and {} {CANCELED} events: {t:?}",
                    t.state,
                    done.len(),
                    canceled.len()
                )
            },
        );
    } else {
        checks.check(
            "events: an unfinished transfer has no event of an end",
            done.is_empty() && canceled.is_empty(),
            || format!("{id} is {} in the log, and has an end's event", t.state),
        );
    }
    let reason = t.reason.map(|r| r.as_str());
    let expected = expected_data(t, t.state, t.amount.minor_units(), reason);
    for e in ends.iter().chain(others.iter()) {
        let differ = differences(&e.data, &expected);
        checks.check(
            "events: a transfer's done or canceled event has the transfer as the log ends it",
            differ.is_empty(),
            || {
                format!(
                    "{}: {} ({}); the log has {t:?}",
                    e.id,
                    differ.join(", "),
                    e.data
                )
            },
        );
    }
    let held = events_of(by_id, HELD, &id);
    let Some(hold) = t.hold else {
        checks.check(
            "events: transfer.held only for holds",
            held.is_empty(),
            || format!("{id} is no hold, and has {} held events: {t:?}", held.len()),
        );
        return;
    };
    checks.check(
        "events: a hold has at most one transfer.held event",
        held.len() <= 1,
        || format!("{id} has {} held events", held.len()),
    );
    let amount = hold.amount.minor_units();
    let expected = expected_data(t, TransferState::Held, amount, None);
    for e in held {
        let differ = differences(&e.data, &expected);
        checks.check(
            "events: a held event has the hold as it was held (state held, the held amount)",
            differ.is_empty(),
            || {
                format!(
                    "{}: {} ({}); the log has {t:?}",
                    e.id,
                    differ.join(", "),
                    e.data
                )
            },
        );
    }
}

/// Every account the test opened has one `account.opened`, with the account as opened.
fn check_accounts(
    layout: Layout,
    accounts: &[Account],
    by_id: &HashMap<&str, Vec<&FeedEvent>>,
    checks: &mut Checks,
) {
    let mut ids: Vec<String> = (0..ACCOUNTS).map(account).collect();
    ids.extend(
        accounts
            .iter()
            .map(|a| a.id.as_str().to_owned())
            .filter(|id| !id.starts_with("acct-")),
    );
    for id in ids {
        let opened = events_of(by_id, OPENED, &id);
        checks.check(
            "events: every account has one account.opened event",
            opened.len() == 1,
            || format!("{id} has {} {OPENED} events", opened.len()),
        );
        let expected = json!({
            "id": id,
            "deployment": layout.home_of(&id),
            "balance": OPENING_BALANCE,
            "pendingDebits": 0,
            "pendingCredits": 0,
            "seq": 1,
        });
        for e in opened {
            let differ = differences(&e.data, &expected);
            checks.check(
                "events: an account.opened event has the account as opened",
                differ.is_empty(),
                || format!("{}: {} ({})", e.id, differ.join(", "), e.data),
            );
        }
    }
}

/// Each stored event's deployment and key, by id; an event is stored on one deployment
/// only, and every deployment's stored events are read.
fn check_stored<'a>(
    seen: &'a EventsSeen,
    checks: &mut Checks,
) -> HashMap<&'a str, (&'a str, &'a str)> {
    let mut placed: HashMap<&str, (&str, &str)> = HashMap::new();
    for (deployment, stored) in &seen.stored {
        checks.check(
            "events: every deployment's stored events are read",
            stored.is_ok(),
            || {
                format!(
                    "{deployment}: {}",
                    stored.as_ref().err().cloned().unwrap_or_default()
                )
            },
        );
        for (id, key) in stored.iter().flatten() {
            let before = placed.insert(id, (deployment, key));
            checks.check(
                "events: an event is stored on one deployment only",
                before.is_none(),
                || {
                    format!(
                        "{id} is stored on {deployment} and {:?}",
                        before.map(|b| b.0)
                    )
                },
            );
        }
    }
    placed
}

/// In `reading`, every event is stored, and each deployment's events come in the order of
/// their stored keys, none missing.
fn check_order(
    name: &str,
    reading: &Reading,
    stored: &Stored,
    placed: &HashMap<&str, (&str, &str)>,
    checks: &mut Checks,
) {
    let unstored: Vec<&str> = reading
        .events
        .iter()
        .map(|e| e.id.as_str())
        .filter(|id| !placed.contains_key(id))
        .collect();
    checks.check(
        "events: every event the feed gives is stored on a deployment",
        unstored.is_empty(),
        || {
            format!(
                "the reading {name} gave {} events stored nowhere: {:?}",
                unstored.len(),
                &unstored[..unstored.len().min(LISTED)]
            )
        },
    );
    for (deployment, stored) in stored {
        let Ok(stored) = stored else { continue };
        let want: Vec<&str> = stored.iter().map(|(id, _)| id.as_str()).collect();
        let got: Vec<&str> = reading
            .events
            .iter()
            .map(|e| e.id.as_str())
            .filter(|id| placed.get(id).is_some_and(|(d, _)| d == deployment))
            .collect();
        checks.check(
            "events: a deployment's events come in the feed in its order, none missing",
            got == want,
            || {
                let from = got.iter().zip(&want).take_while(|(g, w)| g == w).count();
                format!(
                    "the reading {name} gave {} events of {deployment}, which stores {}; after \
                     the first {from}, which agree, it gave {:?} where the stored order has \
                     {:?}",
                    got.len(),
                    want.len(),
                    &got[from..got.len().min(from + 5)],
                    &want[from..want.len().min(from + 5)]
                )
            },
        );
    }
}

/// Every page's `next` is a cursor that moves each deployment's position forward only,
/// to the stored key of the last of its events in the page.
fn check_cursors(
    name: &str,
    reading: &Reading,
    placed: &HashMap<&str, (&str, &str)>,
    checks: &mut Checks,
) {
    let mut before: BTreeMap<String, Position> = BTreeMap::new();
    let mut start = 0;
    for (n, page) in reading.pages.iter().enumerate() {
        let events = &reading.events[start..start + page.events];
        start += page.events;
        let cursor = FeedCursor::parse(&page.next);
        checks.check(
            "events: every page's next is a cursor",
            cursor.is_ok(),
            || format!("the reading {name}'s page {n} gave next {}", page.next),
        );
        let Ok(cursor) = cursor else { continue };
        let now: BTreeMap<String, Position> = cursor
            .positions
            .into_iter()
            .map(|(d, p)| (d.as_str().to_owned(), p))
            .collect();
        for (deployment, was) in &before {
            let is = now.get(deployment);
            checks.check(
                "events: a page's next never moves a deployment's position back",
                is.is_some_and(|is| is >= was),
                || {
                    format!(
                        "the reading {name}'s page {n} moved {deployment} from {was:?} to {is:?}"
                    )
                },
            );
        }
        let mut last: BTreeMap<&str, &FeedEvent> = BTreeMap::new();
        for e in events {
            if let Some((deployment, _)) = placed.get(e.id.as_str()) {
                last.insert(deployment, e);
            }
        }
        for (deployment, e) in last {
            let (_, stored_key) = placed[e.id.as_str()];
            let at = now.get(deployment);
            checks.check(
                "events: a page's next holds each deployment at the last of its events in the page",
                at.is_some_and(|p| p.id == e.id && key(p) == stored_key),
                || {
                    format!(
                        "the reading {name}'s page {n} ends {deployment}'s events with {} (key \
                         {stored_key}), and its next holds {deployment} at {at:?}",
                        e.id
                    )
                },
            );
        }
        before = now;
    }
}

/// What the order of the changes implies of the order of the feed (within a deployment,
/// which the feed never reorders): an account's opening before the events of the
/// transfers out of it, a hold's `held` before its end, a transfer's `done` before its
/// reversal's when both are logged on one deployment.
fn check_causality(events: &[FeedEvent], transfers: &[Transfer], checks: &mut Checks) {
    let mut index: HashMap<&str, usize> = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        index.entry(e.id.as_str()).or_insert(i);
    }
    let at = |kind: &str, subject: &str| index.get(format!("{kind}:{subject}").as_str()).copied();
    let logs: HashMap<String, &Transfer> =
        transfers.iter().map(|t| (t.id.to_string(), t)).collect();
    for t in transfers {
        let id = t.id.to_string();
        let end = at(DONE, &id).or_else(|| at(CANCELED, &id));
        let held = at(HELD, &id);
        let first = [held, end].into_iter().flatten().min();
        if let (Some(first), Some(opened)) = (first, at(OPENED, t.source.as_str())) {
            checks.check(
                "events: an account's opening comes before the events of the transfers out of it",
                opened < first,
                || {
                    format!(
                        "{} comes after an event of {id} (from it) in the feed",
                        t.source
                    )
                },
            );
        }
        if let (Some(held), Some(end)) = (held, end) {
            checks.check(
                "events: a hold's held event comes before its end's",
                held < end,
                || format!("{id}'s end comes before its held event in the feed"),
            );
        }
        let original = t.reverses.and_then(|o| logs.get(&o.to_string()));
        if let (Some(original), Some(end)) = (original, at(DONE, &id)) {
            if original.source_deployment != t.source_deployment {
                continue;
            }
            let original_done = at(DONE, &original.id.to_string());
            checks.check(
                "events: a transfer's done comes before its reversal's (logged on one deployment)",
                original_done.is_some_and(|o| o < end),
                || {
                    format!(
                        "{id}, the reversal of {}, is done at {end} in the feed, its original at \
                         {original_done:?}",
                        original.id
                    )
                },
            );
        }
    }
}

/// Prints what the feed held and how reading it went.
pub fn describe(seen: &EventsSeen) {
    let mut by_type: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &seen.followed.events {
        *by_type.entry(e.kind.as_str()).or_default() += 1;
    }
    let stored: BTreeMap<&str, String> = seen
        .stored
        .iter()
        .map(|(d, s)| {
            let n = match s {
                Ok(s) => s.len().to_string(),
                Err(e) => format!("unread ({e})"),
            };
            (d.as_str(), n)
        })
        .collect();
    let (followed, again) = (&seen.followed, &seen.again);
    println!(
        "events: {} read by following the feed in {} pages of at most {PAGE} ({} requests, {} \
         retried), by type {by_type:?}; the {} events the books call for were all there {:?} \
         after the reading began; {} came later; stored by deployment {stored:?}; read again \
         from no cursor: {} in {} pages ({} retried), complete after {:?}",
        followed.events.len(),
        followed.pages.len(),
        followed.requests,
        followed.retried,
        seen.expected,
        followed.complete_after,
        seen.late,
        again.events.len(),
        again.pages.len(),
        again.retried,
        again.complete_after
    );
}
