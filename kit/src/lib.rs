//! outbox-kit: what a service links to take part in a transactional outbox on Postgres and
//! RabbitMQ. No CLI, HTTP server, metrics exporter or log subscriber comes with it.
//!
//! - [`contract`]: the vocabulary of the public contract (schema name, message headers, name
//!   rules, local defaults) shared with the relay;
//! - [`schema`]: the SQL migrations (`sql/`) and [`schema::migrate`];
//! - [`producer`]: enqueue events inside the caller's transaction;
//! - [`consumer`]: inbox dedupe, ordered consumer groups, effects ledger, budgets, reconciler;
//! - [`db`], [`amqp`]: connecting to Postgres (TLS with libpq's `sslmode` meanings, in the
//!   private `tls` module) and RabbitMQ, every await with a deadline;
//! - [`backoff`], [`down`]: retry delays and rate-limited "still down" logging.
//!
//! Architecture invariant: the library never reads the environment or argv; callers pass
//! validated values in.

#![warn(missing_docs)]

pub mod amqp;
pub mod backoff;
pub mod consumer;
pub mod contract;
pub mod db;
pub mod down;
pub mod producer;
pub mod schema;
mod tls;
