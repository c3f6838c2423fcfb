//! `outbox-relay demo`: the whole path on local services, for a first-time user.
//!
//! Creates (drops and re-creates) a demo database, migrates it, and runs three things in
//! this process: a producer writing events at `--rate` through the Rust producer API, the
//! relay ([`crate::relay::run`]), and a consumer-kit runner bound to the demo exchange that
//! counts what arrives and measures commit→consume latency from `x-outbox-created-at`.
//! Before the clock starts, one warm-up event must travel the whole path (so a queue that
//! is not bound yet never makes the first events unroutable). At the end it waits (up to
//! `--drain-timeout`) for the backlog, stops everything and returns a [`Summary`]:
//! lost = produced − consumed (unique), duplicates = events handled twice.
//!
//! Invariants: only a database this command created (its comment says so) is ever
//! dropped; like the rest of the library it reads no environment and prints nothing:
//! `main` renders [`Progress`] and [`Summary`].
//!
//! Layout: `run.rs` (the run: database, relay, consumer, producer loop, drain),
//! `report.rs` ([`Progress`] and [`Summary`] as `main` prints them), `latency.rs`
//! ([`LatencyHistogram`], the consumer's commit→consume latencies).

use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::time::Duration;

use crate::relay::RelayError;
use outbox_kit::amqp::AmqpTarget;
use outbox_kit::consumer::runner::ConsumerError;
use outbox_kit::contract::Schema;
use outbox_kit::db::{DbError, DbTarget};
use outbox_kit::producer::ProduceError;
use outbox_kit::schema::MigrateError;

mod latency;
mod report;
mod run;

pub use latency::LatencyHistogram;
pub use report::{Progress, Summary};
pub use run::run;

/// The comment a demo database carries; a database without it is never dropped.
pub const DEMO_MARK: &str =
    "outbox-relay demo: dropped and re-created by every `outbox-relay demo`";

/// When production stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Produce for this long (`--duration`).
    After(Duration),
    /// Produce this many events (`--events`).
    Events(NonZeroU64),
}

/// Everything the demo needs, validated (the binary's `src/cli/demo.rs` builds it from the flags).
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// The server, through the database the URL names (the demo database is created from there).
    pub server: DbTarget,
    /// The demo database's name (a plain identifier, not the one `server` names).
    pub database: String,
    /// Schema of the outbox tables in the demo database.
    pub schema: Schema,
    /// The broker the relay publishes to and the consumer reads from.
    pub amqp: AmqpTarget,
    /// The exchange the demo's relay publishes to.
    pub exchange: String,
    /// The consumer's queue and its name in the inbox.
    pub queue: String,
    /// Events per second.
    pub rate: NonZeroU32,
    /// When production stops.
    pub stop: Stop,
    /// Distinct keys (aggregate ids) the events are spread over.
    pub keys: NonZeroU32,
    /// How long to wait for the backlog after production stopped.
    pub drain_timeout: Duration,
    /// Serve the relay's dashboard and metrics here while the demo runs.
    pub http_listen: Option<SocketAddr>,
}

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DemoError {
    /// The named database exists and was not made by the demo: it is left alone.
    #[error(
        "database '{0}' exists and was not created by outbox-relay demo; pick another --database-name (or drop it yourself)"
    )]
    NotADemoDatabase(String),
    /// Postgres failed or refused (creating the database needs CREATEDB).
    #[error("{0}")]
    Db(#[from] DbError),
    /// Migrating the fresh demo database failed.
    #[error("migrating the demo database: {0}")]
    Migrate(#[from] MigrateError),
    /// The producer's insert failed.
    #[error("producing: {0}")]
    Produce(#[from] ProduceError),
    /// The relay stopped with an error it could not retry.
    #[error("the relay stopped: {0}")]
    Relay(#[from] RelayError),
    /// The consumer stopped with an error it could not retry.
    #[error("the consumer stopped: {0}")]
    Consumer(#[from] ConsumerError),
    /// The warm-up event did not arrive: the broker or the topology is not working.
    #[error(
        "the warm-up event did not reach the consumer within {0:?}: is RabbitMQ reachable, and may this user declare and bind the demo exchange and queue?"
    )]
    WarmUp(Duration),
    /// `--http-listen` names an address we cannot listen on.
    #[error("--http-listen: cannot listen on {addr}: {source}")]
    Listen {
        /// The address of `--http-listen`.
        addr: SocketAddr,
        /// Why binding failed.
        source: std::io::Error,
    },
    /// Stopped (SIGINT/SIGTERM) before the first event was produced.
    #[error("interrupted before the first event was produced")]
    Interrupted,
    /// A task ended without saying why (a panic).
    #[error("{0} ended unexpectedly")]
    Task(&'static str),
}

impl From<tokio_postgres::Error> for DemoError {
    fn from(e: tokio_postgres::Error) -> Self {
        DemoError::Db(e.into())
    }
}
