//! The effects ledger: side effects outside the database (an email, a payment, a webhook)
//! claimed in Postgres before they are performed, so a redelivered message never performs
//! one twice.
//!
//! Invariants (each a SQL function of `sql/0003_consumer.sql`, each with a test):
//! - claim is one UPDATE `queued → sending` with `claimed_by`; send only if it returned a row;
//! - the budget is reserved in the claim's statement; out of budget rolls the claim back;
//! - success is written back only while the row is still ours (`sending`, `claimed_by` = me,
//!   no cancel requested); otherwise our item is withdrawn at the destination, with a warning;
//! - failed never overwrites sent;
//! - an attempt whose outcome is unknown (timeout) is never sent again blindly: the next
//!   claimer looks it up first, and a destination without lookup leaves it for review;
//! - cancel deletes at the destination first and says cancelled only if that worked.
//! - effects of one order key are claimed in the order they were enqueued: a later one is
//!   refused (`EffectError::Behind`, SQLSTATE `OB003`) while an earlier one is queued or
//!   sending (`sql/0016_effect_order.sql`); an effect under another live claim is never
//!   reported done, and a claim whose lease ran out is taken over only through a lookup.
//!
//! Each step commits on its own: the claim must be durable before the send, so the steps
//! take a plain [`Client`] (a connection in autocommit), never a transaction.
//!
//! The parts: [`Destination`] (what an adapter implements, with [`DestinationError`]),
//! [`Ledger`] (the steps, each one SQL function call), [`EffectsConfig`] (the lease checked
//! against the timeouts it guards), the states and outcomes the steps report
//! ([`EffectState`], [`Performed`], [`Cancelled`], ...), and [`EffectError`].
//!
//! [`Client`]: tokio_postgres::Client

mod config;
mod destination;
mod error;
mod ledger;
mod state;

pub use config::EffectsConfig;
pub use destination::{Destination, DestinationError, Effect};
pub use error::EffectError;
pub use ledger::Ledger;
pub(crate) use state::Completion;
pub use state::{Cancelled, Claimed, EffectRow, EffectState, NewEffect, Performed};
