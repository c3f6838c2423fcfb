//! outbox-kit: what a service links to take part in a transactional outbox on Postgres and
//! RabbitMQ. No CLI, HTTP server, metrics exporter or log subscriber comes with it.
//!
//! - [`contract`]: the vocabulary of the public contract (schema name, message headers, name
//!   rules, local defaults) shared with the relay;
//! - [`schema`]: the SQL migrations (`sql/`) and [`schema::migrate`];
//! - [`producer`]: enqueue events inside the caller's transaction;
//! - [`consumer`]: inbox dedupe, ordered consumer groups, effects ledger, budgets, reconciler;
//! - [`db`], [`amqp`]: connecting to Postgres (TLS with libpq's `sslmode` meanings, in the
//!   private `tls` module) and RabbitMQ, every await with a deadline.
//!
//! The plumbing the relay shares with the kit (retry delays, rate-limited "still down"
//! logging, the deadline wrappers, connecting to a chosen broker node) is not part of the
//! API: the relay reaches it through the hidden `internal` module, which may change in any
//! release.
//!
//! Architecture invariant: the library never reads the environment or argv; callers pass
//! validated values in.

#![warn(missing_docs)]

pub mod amqp;
mod backoff;
pub mod consumer;
pub mod contract;
pub mod db;
mod down;
pub mod producer;
pub mod schema;
mod tls;

/// What the relay (`outbox-relay`, this workspace) shares with the kit and a service has no
/// use for. Not part of the kit's API: hidden from its documentation, and it may change in
/// any release.
///
/// The plumbing is reachable here only (each block below must fail to compile):
///
/// ```compile_fail
/// use outbox_kit::backoff::Backoff;
/// ```
/// ```compile_fail
/// use outbox_kit::down::Down;
/// ```
/// ```compile_fail
/// use outbox_kit::amqp::rpc;
/// ```
/// ```compile_fail
/// use outbox_kit::db::deadline;
/// ```
/// ```compile_fail
/// async fn f(t: &outbox_kit::amqp::AmqpTarget) {
///     let _ = t.connect_node("x").await;
/// }
/// ```
/// ```
/// use outbox_kit::internal::{Backoff, Down, connect_node, deadline, retry_delay, rpc};
/// ```
#[doc(hidden)]
pub mod internal {
    pub use crate::amqp::plumbing::{connect_node, rpc};
    pub use crate::backoff::{Backoff, retry_delay};
    pub use crate::db::plumbing::deadline;
    pub use crate::down::Down;
}
