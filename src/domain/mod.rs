//! The vocabulary of the service: values that parse instead of validate, and the
//! transfer state machine.
//!
//! Nothing here knows about HTTP or MongoDB. A value of one of these types is valid by
//! construction, so the layers above never re-check it:
//! - [`AccountId`], [`Currency`], [`Amount`], [`OpeningBalance`], [`TransferId`],
//!   [`IdempotencyKey`], [`Reference`] and [`AccountName`] are parsed once at the edge;
//! - [`ScopedKey`] is an idempotency key in its [`KeyScope`]: shared, or the
//!   [`ApiKeyId`] of the API key that sent it;
//! - [`Transfer`] and [`Account`] are what the service reasons about, built from those
//!   values; the store converts its documents to and from them;
//! - [`Strategy`] is how a transfer is carried out (`TRANSFER_STRATEGY`): the two-phase
//!   commit or one native transaction;
//! - [`Legs`] are the legs of a multi-leg transfer, and each account's net change over
//!   them, its [`Party`];
//! - [`Entry`] is one numbered change to an account's amounts ([`EntryKind`] says which
//!   step made it), [`BalanceAt`] an account's amounts as of a moment, [`Finality`]
//!   whether that answer can still change;
//! - [`Event`] is what the feed tells users happened ([`EventType`]), in [`Position`]
//!   order, read with a [`FeedCursor`]; a [`Webhook`] is an endpoint sent them, each
//!   [`Delivery`] signed with its [`WebhookSecret`];
//! - [`TenantName`] owns accounts; a request's [`Scope`] (a tenant's own, or the
//!   platform's everything) says what exists for it; [`Role`] what its key may do;
//! - [`TransferState`] is the two-phase-commit state machine of the MongoDB tutorial,
//!   with its transitions as an explicit function ([`TransferState::transition`]).

mod entry;
mod event;
mod legs;
mod state;
mod tenant;
mod transfer;
mod values;
mod webhook;

pub use entry::{Amounts, BalanceAt, Entry, EntryKind, Finality};
pub use event::{Event, EventData, EventType, FeedCursor, Position, event_id};
pub use legs::{LEGS, Leg, Legs, LegsError, MAX_LEG_ACCOUNTS, Party};
pub use state::{CancelReason, InvalidTransition, TransferEvent, TransferState};
pub use tenant::{KeyRecord, OtherTenant, Role, Scope, TenantName, Tenants};
pub use transfer::{
    Account, Hold, Placement, Side, Strategy, Timestamp, Transfer, TransferFilter, now,
};
pub use values::{
    AccountId, AccountName, Amount, ApiKeyId, Currency, DeploymentName, HOLD_EXPIRY_MS,
    IdempotencyKey, KeyScope, MAX_MONEY, OpeningBalance, ParseError, Reference, ScopedKey,
    TransferId,
};
pub use webhook::{
    Attempt, DEFAULT_MAX_WEBHOOKS, DEFAULT_MAX_WEBHOOKS_TOTAL, DEFAULT_ROTATION_OVERLAP, Delivery,
    DeliveryState, MAX_ROTATION_OVERLAP, Webhook, WebhookCap, WebhookSecret, WebhookSettings,
    WebhookUrl, backoff_ms, is_public_address,
};
