//! The consumer kit: what a service needs to make at-least-once delivery harmless.
//!
//! Data path of one message: [`runner`] (lapin: manual acks, prefetch, retry tiers or
//! in-place retries, dead letters; ordered consumer groups over partition queues) →
//! [`inbox`] (dedupe on event_id and per-key ordered apply, in the handler's transaction)
//! → the user's [`runner::Handler`] → [`effects`] (claim before sending, write back only
//! while still ours) with [`budget`] reservations → [`reconcile`] for what a dead worker
//! left behind and for retention.
//!
//! Every rule lives in a SQL function of `sql/0003_consumer.sql` and
//! `sql/0012_consumer_groups.sql`; the Rust API only calls them, so consumers in other
//! languages that call the same functions follow the same rules.
//!
//! Architecture invariant: only `consumer/runner/` knows lapin; handlers see [`Message`].
//! Architecture invariant: a message is acked only after the transaction that recorded it
//! in the inbox committed (or after its copy reached a retry queue or the dead-letter
//! exchange with a broker confirm).

pub mod budget;
pub mod effects;
mod events;
pub mod inbox;
pub mod reconcile;
pub mod runner;

pub use effects::{Destination, DestinationError, Effect, EffectError, Ledger};
pub use runner::{Handler, HandlerError, Message};
