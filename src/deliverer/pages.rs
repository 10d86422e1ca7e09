//! What a page of events makes, bounded whatever the number of webhooks (issue 33): how
//! many events a page reads ([`page_limit`], by the webhooks one event can reach:
//! [`fan_out`]), which webhook is sent which event ([`wants`]), the deliveries of a page
//! made lazily ([`pairs`]) and cut into batches by bytes ([`batch`]) so that no command
//! that makes one passes MongoDB's 16 MiB.
//!
//! Pure: it reads nothing and writes nothing; the dispatcher does.

use std::collections::HashMap;
use std::sync::Arc;

use crate::domain::{self, Event, Webhook};
use crate::store::webhooks::{Made, NewDelivery, stored_bytes};

/// Events the dispatcher reads at a time, at most (fewer with many webhooks:
/// [`page_limit`]).
pub const PAGE: u32 = 500;
/// Deliveries a page makes at most (events times the webhooks that want them): 20 of
/// them to each of 1,000 webhooks. Bounds the work of a page, which a takeover repeats.
pub const PAGE_PAIRS: usize = 20_000;
/// The most bytes of the deliveries made in one batch, as
/// [`stored_bytes`](crate::store::webhooks::stored_bytes) counts them: each command that
/// makes a batch (the read of those made already, the insert) stays well under the 16 MiB
/// a MongoDB command may be, and what the dispatcher holds of a batch is bounded by it.
pub const COMMAND_BYTES: usize = 4 << 20;
/// Deliveries made in one batch, at most, whatever their size.
pub const BATCH: usize = 5_000;

/// How many deliveries one event can make for `hooks` (one at least): every platform
/// webhook, and those of the two tenants with the most (an event is seen by its
/// transfer's tenants: one, or two for a transfer a platform key made across tenants).
/// Tenants' webhooks that no event of a page goes to then do not shrink its page; a
/// multi-leg transfer across more tenants may make more, its batches still bounded by
/// bytes ([`COMMAND_BYTES`]).
pub fn fan_out(hooks: &[Webhook]) -> usize {
    let mut per_tenant: HashMap<&domain::TenantName, usize> = HashMap::new();
    let mut platform = 0;
    for hook in hooks {
        match &hook.tenant {
            None => platform += 1,
            Some(tenant) => *per_tenant.entry(tenant).or_default() += 1,
        }
    }
    let mut counts: Vec<usize> = per_tenant.into_values().collect();
    counts.sort_unstable_by(|a, b| b.cmp(a));
    (platform + counts.iter().take(2).sum::<usize>()).max(1)
}

/// The events of a page read for `hooks` deliveries an event: [`PAGE`] at most, and no more than
/// [`PAGE_PAIRS`] deliveries' worth (one at least), so that a page is made within a few
/// batches whatever the number of webhooks, and a page dispatched again after a crash or
/// a takeover repeats a bounded amount of work.
pub fn page_limit(hooks: usize) -> u32 {
    let events = PAGE_PAIRS / hooks.max(1);
    u32::try_from(events.clamp(1, PAGE as usize)).unwrap_or(PAGE)
}

/// Whether `hook` is sent `event`: a type it wants, after it was registered (by the
/// event's deployment's position, not by its clock), and one its tenant sees.
pub fn wants(hook: &Webhook, event: &Event) -> bool {
    hook.wants(event.kind) && hook.registered_before(event) && hook.sees(event)
}

/// The deliveries to make for a page: each event to each webhook that wants it, in the
/// order of the events, made lazily so that only one batch is held at a time.
pub fn pairs<'a>(
    events: &'a [Event],
    bodies: &'a HashMap<&'a str, Arc<str>>,
    hooks: &'a [Webhook],
    give_up_at: crate::domain::Timestamp,
) -> impl Iterator<Item = NewDelivery<'a>> + 'a {
    events.iter().flat_map(move |event| {
        hooks
            .iter()
            .filter(move |h| wants(h, event))
            .filter_map(move |hook| {
                Some(NewDelivery {
                    webhook: &hook.id,
                    event_id: &event.id,
                    event_type: event.kind,
                    body: bodies.get(event.id.as_str())?.clone(),
                    give_up_at,
                    made: Made::Unclaimed,
                })
            })
    })
}

/// The next batch of `pairs`: as many as fit in `budget` bytes by
/// [`stored_bytes`](crate::store::webhooks::stored_bytes) under a claim of `token` (one at
/// least, whatever its size), at most [`BATCH`]. Every command that makes a batch (the
/// read of those made already, the insert) is then at most `budget` and a little
/// framing: the bound of what the dispatcher sends, and of what it holds.
pub fn batch<'a>(
    pairs: &mut std::iter::Peekable<impl Iterator<Item = NewDelivery<'a>>>,
    token: &str,
    budget: usize,
) -> Vec<NewDelivery<'a>> {
    let mut batch = Vec::new();
    let mut bytes = 0;
    while batch.len() < BATCH {
        let Some(next) = pairs.peek() else { break };
        let size = stored_bytes(next, token);
        if !batch.is_empty() && bytes + size > budget {
            break;
        }
        bytes += size;
        batch.extend(pairs.next());
    }
    batch
}

/// The ids of deliveries `new`.
pub fn ids_of(new: &[NewDelivery<'_>]) -> Vec<String> {
    new.iter()
        .map(|d| format!("{}:{}", d.webhook, d.event_id))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::EventType;
    use crate::store::webhooks::claim_token;
    use crate::store::webhooks::tests::{encoded_bytes, read_bytes};

    /// The deliveries of `events` events to `hooks` webhooks, with ids as long as they
    /// may be and bodies of `body_len` bytes shared per event.
    fn all_pairs(hooks: &[String], events: &[(String, Arc<str>)]) -> Vec<NewDelivery<'static>> {
        let (hooks, events): (&'static [String], &'static [(String, Arc<str>)]) = (
            Box::leak(hooks.to_vec().into_boxed_slice()),
            Box::leak(events.to_vec().into_boxed_slice()),
        );
        events
            .iter()
            .flat_map(|(event, body)| {
                hooks.iter().map(move |hook| NewDelivery {
                    webhook: hook,
                    event_id: event,
                    event_type: EventType::TransferDone,
                    body: body.clone(),
                    give_up_at: chrono::Utc::now(),
                    made: Made::Unclaimed,
                })
            })
            .collect()
    }

    /// Issue 33: 900 webhooks and a page of 500 events made one read of 450,000 ids (past
    /// the driver's 48 MB, and MongoDB's 16 MiB) and copied each body 900 times. Cut by
    /// bytes, each batch's commands, as they are encoded, stay within the bound, however
    /// many webhooks and however large the bodies, and every delivery is in one batch.
    #[test]
    fn every_batch_of_a_page_fits_the_command_bound_whatever_the_number_of_webhooks() {
        let hooks: Vec<String> = (0..900).map(|i| format!("wh_{i:024x}")).collect();
        let token = claim_token(&"i".repeat(128));
        for body_len in [300, 20_000] {
            let events: Vec<(String, Arc<str>)> = (0..500)
                .map(|i| {
                    let id = format!("transfer.canceled:{:0>64}", i);
                    (id, Arc::from("b".repeat(body_len)))
                })
                .collect();
            let pairs = all_pairs(&hooks, &events);
            let total = pairs.len();
            let mut pairs = pairs.into_iter().peekable();
            let mut seen = 0;
            let mut batches = 0;
            while pairs.peek().is_some() {
                let batch = batch(&mut pairs, &token, COMMAND_BYTES);
                assert!(!batch.is_empty() && batch.len() <= BATCH);
                // By the bound (which bounds each document's encoding: the store's
                // test), and, for the first batch, by the encoding itself.
                let bound: usize = batch.iter().map(|d| stored_bytes(d, &token)).sum();
                assert!(bound <= COMMAND_BYTES, "a batch of {bound} bytes");
                if batches == 0 {
                    let documents: usize = batch.iter().map(|d| encoded_bytes(d, &token)).sum();
                    assert!(
                        documents <= COMMAND_BYTES,
                        "a batch of {} is {documents} bytes encoded, over {COMMAND_BYTES}",
                        batch.len()
                    );
                }
                let read = read_bytes(&ids_of(&batch));
                assert!(read <= COMMAND_BYTES, "the read is {read} bytes");
                seen += batch.len();
                batches += 1;
            }
            assert_eq!(seen, total, "every delivery is in a batch");
            assert!(batches > 1);
        }
    }

    #[test]
    fn a_delivery_larger_than_the_budget_is_a_batch_of_its_own() {
        let hooks = vec![format!("wh_{:024x}", 1), format!("wh_{:024x}", 2)];
        let events = vec![("account.opened:a".to_owned(), Arc::from("b".repeat(1000)))];
        let mut pairs = all_pairs(&hooks, &events).into_iter().peekable();
        assert_eq!(batch(&mut pairs, "t", 10).len(), 1);
        assert_eq!(batch(&mut pairs, "t", 10).len(), 1);
        assert!(pairs.peek().is_none());
    }

    #[test]
    fn an_event_goes_to_the_platforms_webhooks_and_two_tenants_at_most() {
        let hook = |tenant: Option<&str>| Webhook {
            id: "wh_000000000000000000000000".into(),
            url: domain::WebhookUrl::parse("https://example.com/h").unwrap(),
            types: Vec::new(),
            description: None,
            tenant: tenant.map(|t| domain::TenantName::parse(t).unwrap()),
            secret: domain::WebhookSecret::random(),
            previous: None,
            created_at: chrono::Utc::now(),
            registered_at: Default::default(),
        };
        assert_eq!(fan_out(&[]), 1);
        // 21 tenants with 1,000 webhooks each and one of the platform: an event reaches
        // at most 2,001, so a page keeps 9 events, not one (20,000 / 21,001).
        let mut hooks = vec![hook(None)];
        for t in 0..21 {
            let name = format!("t{t}");
            hooks.extend((0..1000).map(|_| hook(Some(&name))));
        }
        assert_eq!(fan_out(&hooks), 2001);
        assert_eq!(page_limit(fan_out(&hooks)), 9);
        hooks.extend((0..5).map(|_| hook(Some("big"))));
        assert_eq!(fan_out(&hooks), 2001, "the two largest tenants count");
        hooks.extend((0..1500).map(|_| hook(Some("big"))));
        assert_eq!(fan_out(&hooks), 1 + 1505 + 1000);
    }

    #[test]
    fn a_page_covers_at_most_page_pairs_deliveries_and_one_event_at_least() {
        assert_eq!(page_limit(0), PAGE);
        assert_eq!(page_limit(1), PAGE);
        for hooks in [40, 41, 450, 900, 1000, 10_000, 20_001, 1_000_000] {
            let events = page_limit(hooks) as usize;
            assert!(events >= 1);
            assert!(
                events == 1 || events * hooks <= PAGE_PAIRS,
                "{hooks}: {events}"
            );
        }
    }
}
