//! The relay: claims committed outbox rows, publishes them with confirms, marks them
//! dispatched after the broker's ack, retries and parks.
//!
//! One engine task (`engine`) owns all state and reacts to one closed set of wake-ups in
//! one `match`; its state machines each have their own file: the claim pass (`pass`),
//! leases (`leases`), wake-up pacing (`pacing`), the per-key hand (`hand`) and the batched
//! writers (`writer`). Database round trips and the AMQP connect run as futures the engine
//! polls (so a slow mark never stops confirms from being handled); the LISTEN connection
//! and the AMQP lanes are tasks that report back through channels.
//!
//! Data path: `listen` (hint) → `claim` (rows of leased partitions, seq assigned) →
//! `hand` (per-key queues, one unconfirmed message per key) → `publish` (lanes, confirms,
//! returns matched by message_id) → `claim::mark_dispatched` (only from `Acked`).
//! A [`hand::Key`] (module `key`) is what the claim, the hand and the lanes share: none of
//! them imports another for it.
//!
//! Architecture invariant: nothing here reads the environment or argv; `run` takes its
//! connections, its configuration and its shutdown signal from the caller.

pub mod claim;
mod engine;
pub mod hand;
mod key;
mod leases;
pub(crate) mod listen;
mod pacing;
mod pass;
pub mod publish;
pub mod retention;
mod writer;

use std::num::{NonZeroU32, NonZeroUsize};
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;
use outbox_kit::internal::Backoff;
use outbox_kit::internal::Down;
use outbox_kit::internal::deadline;

use crate::telemetry::Telemetry;
use engine::Engine;

/// What a parked row does to the later rows of its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnPark {
    /// The key's later rows go on; consumers see a gap in x-outbox-seq.
    Continue,
    /// The key waits until an operator re-drives or deletes the parked row.
    BlockKey,
}

/// The relay's settings (docs/running.md, "Flags of `run`", explains each flag).
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// `--exchange`: the topic exchange rows are published to.
    pub exchange: String,
    /// Declare the exchange at connect (`--no-declare` turns it off).
    pub declare_exchange: bool,
    /// `--batch-size`: most rows per claim.
    pub batch_size: NonZeroUsize,
    /// `--poll-interval`: the longest wait between claims, and between sweeps.
    pub poll_interval: Duration,
    /// How far back forward claims read again while they keep up (see `Pass`).
    pub late_commit_window: Duration,
    /// LISTEN for the producers' NOTIFY (`--no-listen`: polling only).
    pub listen: bool,
    /// `--max-attempts`: an unroutable row is parked after this many.
    pub max_attempts: NonZeroU32,
    /// `--max-message-bytes`: a larger row is parked at once.
    pub max_message_bytes: NonZeroUsize,
    /// `--shutdown-timeout`: how long a shutdown waits for confirms and marks (longer than
    /// `confirm_timeout`, or rows acked late in a shutdown are left unmarked).
    pub shutdown_timeout: Duration,
    /// `--confirm-timeout`: a message without a confirm by then is retried.
    pub confirm_timeout: Duration,
    /// `--confirm-window`: most unconfirmed messages at a time.
    pub confirm_window: NonZeroUsize,
    /// `--channels`: AMQP channels (lanes) to publish on.
    pub channels: NonZeroUsize,
    /// `--lease`: how long a partition lease lasts without renewal.
    pub lease: Duration,
    /// `--on-park`: what a parked row does to the later rows of its key.
    pub on_park: OnPark,
    /// `--retry-min`: the first retry delay of a refused row.
    pub retry_min: Duration,
    /// `--retry-max`: the longest retry delay of a refused row.
    pub retry_max: Duration,
    /// `--max-in-memory-bytes`: most payload bytes held between claim and mark.
    pub max_in_memory_bytes: NonZeroUsize,
    /// Delete dispatched rows older than this (`--retention`); `None` keeps them.
    pub retention: Option<Duration>,
    /// `--cloudevents`: the CloudEvents `source` to publish with; `None` adds no such headers.
    pub cloudevents_source: Option<String>,
}

impl RelayConfig {
    /// Defaults as documented, publishing to `exchange`.
    pub fn new(exchange: &str) -> RelayConfig {
        RelayConfig {
            exchange: exchange.to_owned(),
            declare_exchange: true,
            batch_size: NonZeroUsize::new(500).expect("non-zero"),
            poll_interval: Duration::from_secs(1),
            late_commit_window: Duration::from_millis(100),
            listen: true,
            max_attempts: NonZeroU32::new(10).expect("non-zero"),
            max_message_bytes: NonZeroUsize::new(1 << 20).expect("non-zero"),
            shutdown_timeout: Duration::from_secs(20),
            confirm_timeout: Duration::from_secs(15),
            confirm_window: NonZeroUsize::new(1024).expect("non-zero"),
            channels: NonZeroUsize::new(2).expect("non-zero"),
            lease: Duration::from_secs(15),
            on_park: OnPark::Continue,
            retry_min: Duration::from_millis(500),
            retry_max: Duration::from_secs(60),
            max_in_memory_bytes: NonZeroUsize::new(64 << 20).expect("non-zero"),
            retention: None,
            cloudevents_source: None,
        }
    }
}

/// The connections the relay runs on.
#[derive(Clone)]
pub struct Deps {
    /// Pooled connections with `search_path` set to the schema (see `DbTarget::pool`).
    pub pool: Pool,
    /// For the dedicated LISTEN connection.
    pub db: DbTarget,
    /// The schema the outbox tables live in (`--schema`).
    pub schema: Schema,
    /// The broker to publish to.
    pub amqp: AmqpTarget,
    /// Where this relay logs and counts (one per relay; `Telemetry::default()` is fine).
    pub telemetry: Telemetry,
}

/// A failure retries cannot fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The schema has no outbox tables and functions.
    #[error(
        "schema '{0}' has no outbox tables: run `outbox-relay migrate` (or start without --no-migrate)"
    )]
    NotMigrated(String),
    /// The database refused a statement for a reason waiting will not fix (permissions,
    /// a changed schema).
    #[error("database refused the relay: {0}")]
    Refused(String),
}

/// Who this relay is, in the database and at the broker.
#[derive(Clone, Debug)]
pub struct Identity {
    /// Unique among live relays: the owner of leases in the database.
    pub relay_id: String,
    /// The host name shown by `status`.
    pub host: String,
    /// The process id shown by `status`.
    pub pid: i32,
    /// The AMQP connection name the broker shows.
    pub connection_name: String,
}

impl Identity {
    /// This process: host, pid and a random suffix.
    pub fn of_this_process() -> Identity {
        use std::hash::{BuildHasher, Hasher};
        let host = hostname();
        let pid = std::process::id();
        // A random suffix tells apart two relays that reuse a pid on one host.
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
            & 0xffff_ffff;
        Identity {
            relay_id: format!("{host}:{pid}:{random:08x}"),
            host: host.clone(),
            pid: pid as i32,
            connection_name: format!("outbox-relay@{host}:{pid}"),
        }
    }
}

fn hostname() -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

/// Runs the relay until `shutdown` is cancelled, then drains in-flight confirms (up to
/// `config.shutdown_timeout`), marks what was acked and returns.
pub async fn run(
    deps: Deps,
    config: RelayConfig,
    shutdown: CancellationToken,
) -> Result<(), RelayError> {
    run_as(deps, config, Identity::of_this_process(), shutdown).await
}

/// Whether autovacuum will clean outbox_events (server setting and table option).
const CHECK_AUTOVACUUM: &str = "SELECT current_setting('autovacuum') = 'on'
   AND NOT coalesce((SELECT 'autovacuum_enabled=false' = ANY (reloptions) FROM pg_class
                      WHERE oid = to_regclass('outbox_events')), false)";

const CHECK_SCHEMA: &str = "SELECT to_regprocedure('outbox_claim(text,bigint,integer,integer,boolean,integer,bigint,text[],text[],bigint,bigint[])') IS NOT NULL
   AND to_regprocedure('outbox_set_wakeup(text,boolean)') IS NOT NULL";

/// [`run`] with an explicit identity (tests run several relays in one process).
pub async fn run_as(
    deps: Deps,
    config: RelayConfig,
    id: Identity,
    shutdown: CancellationToken,
) -> Result<(), RelayError> {
    // Fail fast on a schema that was never migrated; everything else is retried.
    let mut down = Down::new("postgres");
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        let checked = async {
            let client = deadline(deps.pool.get()).await?;
            deadline(client.query_one(CHECK_SCHEMA, &[])).await
        }
        .await;
        match checked {
            Ok(row) if matches!(row.try_get::<_, bool>(0), Ok(true)) => break,
            Ok(_) => return Err(RelayError::NotMigrated(deps.schema.to_string())),
            Err(e) if e.is_transient() => {
                let delay = backoff.next_delay();
                down.failed(&e, delay);
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
            Err(e) => return Err(RelayError::Refused(e.to_string())),
        }
    }
    down.recovered();
    if let Ok(client) = deadline(deps.pool.get()).await
        && let Ok(row) = deadline(client.query_one(CHECK_AUTOVACUUM, &[])).await
        && matches!(row.try_get::<_, bool>(0), Ok(false))
    {
        deps.telemetry.autovacuum_off();
    }
    deps.telemetry
        .relay_started(&id.relay_id, &config.exchange, &deps.amqp, config.listen);
    deps.telemetry.postgres_state(true);

    let (listen_tx, listen_rx) = mpsc::channel(16);
    let listener_stop = shutdown.child_token();
    let listener = config.listen.then(|| {
        tokio::spawn(listen::run(
            deps.db.clone(),
            deps.schema.clone(),
            listen_tx,
            deps.telemetry.clone(),
            listener_stop.clone(),
        ))
    });
    let retention = config.retention.map(|age| {
        tokio::spawn(retention::run(
            deps.pool.clone(),
            age,
            deps.telemetry.clone(),
            listener_stop.clone(),
        ))
    });
    let engine = Engine::new(deps, config, id);
    let result = engine.run(listen_rx, shutdown).await;
    listener_stop.cancel();
    for task in [listener, retention].into_iter().flatten() {
        let _ = task.await;
    }
    result
}
