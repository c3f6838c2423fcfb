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

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::relay::{self, Deps, RelayConfig, RelayError};
use crate::telemetry::Telemetry;
use outbox_kit::amqp::AmqpTarget;
use outbox_kit::consumer::runner::{
    self, ConsumerConfig, ConsumerDeps, ConsumerError, Context, Handler, HandlerError, Message,
};
use outbox_kit::contract::Schema;
use outbox_kit::db::{DbError, DbTarget, deadline};
use outbox_kit::producer::{NewEvent, Outbox, ProduceError};
use outbox_kit::schema::{self, MigrateError};

/// The comment a demo database carries; a database without it is never dropped.
pub const DEMO_MARK: &str =
    "outbox-relay demo: dropped and re-created by every `outbox-relay demo`";

/// How long the warm-up event may take to travel the whole path.
const WARM_UP_LIMIT: Duration = Duration::from_secs(30);
/// Most events per INSERT statement (a producer that fell behind catches up in chunks).
const MAX_BATCH: u64 = 1_000;

/// When production stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    After(Duration),
    Events(NonZeroU64),
}

/// Everything the demo needs, validated (`config.rs` builds it from the flags).
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// The server, through the database the URL names (the demo database is created from there).
    pub server: DbTarget,
    /// The demo database's name (a plain identifier, not the one `server` names).
    pub database: String,
    pub schema: Schema,
    pub amqp: AmqpTarget,
    pub exchange: String,
    /// The consumer's queue and its name in the inbox.
    pub queue: String,
    /// Events per second.
    pub rate: NonZeroU32,
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
    #[error("migrating the demo database: {0}")]
    Migrate(#[from] MigrateError),
    #[error("producing: {0}")]
    Produce(#[from] ProduceError),
    #[error("the relay stopped: {0}")]
    Relay(#[from] RelayError),
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
        addr: SocketAddr,
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

/// A live view, about once a second.
#[derive(Clone, Debug)]
pub struct Progress {
    pub elapsed: Duration,
    pub produced: u64,
    /// Rows the relay marked dispatched (the broker confirmed them).
    pub published: u64,
    /// Distinct events the consumer handled.
    pub consumed: u64,
    pub p50: Option<Duration>,
    pub p99: Option<Duration>,
    /// Producing is over; waiting for the backlog.
    pub draining: bool,
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "demo {:>4.0}s{}: produced {}, published {}, consumed {}, latency p50 {} p99 {}",
            self.elapsed.as_secs_f64(),
            if self.draining { " (draining)" } else { "" },
            self.produced,
            self.published,
            self.consumed,
            ms(self.p50),
            ms(self.p99),
        )
    }
}

/// How the demo ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    pub produced: u64,
    pub published: u64,
    /// Distinct events of this run the consumer handled.
    pub consumed: u64,
    /// Produced and never consumed (within the drain timeout).
    pub lost: u64,
    /// Events the handler saw again after it had handled them (the inbox should make this 0).
    pub duplicates: u64,
    /// Events consumed that this run did not produce (left in the queue by an earlier run).
    pub stray: u64,
    pub p50: Option<Duration>,
    pub p99: Option<Duration>,
    pub max: Option<Duration>,
    /// From the first event produced to the last one consumed (or the end of the drain).
    pub elapsed: Duration,
    /// The rate production reached.
    pub rate: f64,
    /// Producing was cut short by a signal.
    pub interrupted: bool,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "demo summary: produced {}, published {}, consumed {}, lost {}, duplicates {}, stray {}; \
             latency p50 {} p99 {} max {}; {:.1}s, produced at {:.1} events/s{}",
            self.produced,
            self.published,
            self.consumed,
            self.lost,
            self.duplicates,
            self.stray,
            ms(self.p50),
            ms(self.p99),
            ms(self.max),
            self.elapsed.as_secs_f64(),
            self.rate,
            if self.interrupted {
                " (interrupted)"
            } else {
                ""
            },
        )
    }
}

fn ms(d: Option<Duration>) -> String {
    match d {
        Some(d) => format!("{:.1}ms", d.as_secs_f64() * 1000.0),
        None => "-".into(),
    }
}

/// Latencies in log-spaced buckets (5 % apart, 50 µs to about 17 minutes): constant memory
/// whatever the run's length, percentiles within 5 %.
#[derive(Clone, Debug)]
pub struct LatencyHistogram {
    counts: Vec<u64>,
    total: u64,
    max: Duration,
}

const HIST_BASE_SECS: f64 = 50e-6;
const HIST_GROWTH: f64 = 1.05;
const HIST_BUCKETS: usize = 350;

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram {
            counts: vec![0; HIST_BUCKETS],
            total: 0,
            max: Duration::ZERO,
        }
    }
}

impl LatencyHistogram {
    pub fn record(&mut self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = if secs <= HIST_BASE_SECS {
            0
        } else {
            ((secs / HIST_BASE_SECS).ln() / HIST_GROWTH.ln()).ceil() as usize
        };
        self.counts[i.min(HIST_BUCKETS - 1)] += 1;
        self.total += 1;
        self.max = self.max.max(d);
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn max(&self) -> Option<Duration> {
        (self.total > 0).then_some(self.max)
    }

    /// The upper bound of the bucket holding quantile `q` (0..=1), never above the maximum.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        if self.total == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank && i + 1 < HIST_BUCKETS {
                let upper = Duration::from_secs_f64(HIST_BASE_SECS * HIST_GROWTH.powi(i as i32));
                return Some(upper.min(self.max));
            }
        }
        Some(self.max)
    }
}

/// What the consumer saw, shared between its handler and the demo loop.
#[derive(Default)]
struct Seen {
    consumed: HashSet<Uuid>,
    duplicates: u64,
    warmed_up: bool,
    latency: LatencyHistogram,
    last_at: Option<Instant>,
}

struct Counter {
    seen: Arc<Mutex<Seen>>,
}

impl Handler for Counter {
    async fn handle(&self, _cx: &Context<'_>, msg: &Message) -> Result<(), HandlerError> {
        let now = SystemTime::now();
        // Created in the producer's statement, i.e. just before its commit.
        let latency = msg
            .headers
            .get("x-outbox-created-at")
            .and_then(|v| v.as_str())
            .and_then(|s| humantime::parse_rfc3339(s).ok())
            .map(|created| now.duration_since(created).unwrap_or(Duration::ZERO));
        let mut seen = self.seen.lock().expect("demo counters");
        if msg.event_type == "warm-up" {
            seen.warmed_up = true;
            return Ok(());
        }
        // The inbox already dropped redeliveries of events handled before; one seen here
        // again would be an exactly-once failure worth showing.
        if !seen.consumed.insert(msg.event_id) {
            seen.duplicates += 1;
            return Ok(());
        }
        if let Some(l) = latency {
            seen.latency.record(l);
        }
        seen.last_at = Some(Instant::now());
        Ok(())
    }
}

/// Creates the demo database (dropping an earlier demo's), refusing one the demo did not make.
async fn recreate_database(cfg: &DemoConfig) -> Result<DbTarget, DemoError> {
    let admin = cfg.server.connect(&cfg.schema, "outbox-relay-demo").await?;
    let existing = deadline(admin.query_opt(
        "SELECT coalesce(shobj_description(oid, 'pg_database'), '') FROM pg_database WHERE datname = $1",
        &[&cfg.database],
    ))
    .await?;
    if let Some(row) = existing {
        if row.get::<_, String>(0) != DEMO_MARK {
            return Err(DemoError::NotADemoDatabase(cfg.database.clone()));
        }
        // The name is a validated plain identifier: no quoting needed.
        deadline(admin.batch_execute(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            cfg.database
        )))
        .await?;
    }
    deadline(admin.batch_execute(&format!("CREATE DATABASE {}", cfg.database))).await?;
    deadline(admin.execute(
        &format!("COMMENT ON DATABASE {} IS '{DEMO_MARK}'", cfg.database),
        &[],
    ))
    .await?;
    Ok(cfg.server.with_dbname(&cfg.database))
}

/// Runs the demo until production is over and the backlog drained (or `drain_timeout`),
/// calling `on_progress` about once a second. `shutdown` stops producing early.
pub async fn run(
    cfg: DemoConfig,
    shutdown: CancellationToken,
    mut on_progress: impl FnMut(&Progress),
) -> Result<Summary, DemoError> {
    // Bound first, so a port in use stops the demo before it touches the database.
    let listener = match cfg.http_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| DemoError::Listen { addr, source })?,
        ),
        None => None,
    };
    let target = recreate_database(&cfg).await?;
    {
        let mut client = target.connect(&cfg.schema, "outbox-relay-demo").await?;
        schema::migrate(&mut client, &cfg.schema).await?;
    }

    let telemetry = Telemetry::default();
    let relay_pool = target.pool(&cfg.schema, "outbox-relay", 8);
    let stop_http = CancellationToken::new();
    if let Some(listener) = listener {
        let state = crate::http::HttpState::new(telemetry.clone(), relay_pool.clone(), None);
        tokio::spawn(crate::http::serve(listener, state, stop_http.clone()));
    }
    let mut relay_config = RelayConfig::new(&cfg.exchange);
    // Quick retries: the warm-up may be returned until the consumer has bound its queue.
    relay_config.retry_min = Duration::from_millis(100);
    relay_config.retry_max = Duration::from_secs(1);
    relay_config.max_attempts = NonZeroU32::new(100).expect("non-zero");
    relay_config.shutdown_timeout = Duration::from_secs(5);
    let stop_relay = CancellationToken::new();
    let mut relay_task = tokio::spawn(relay::run(
        Deps {
            pool: relay_pool.clone(),
            db: target.clone(),
            schema: cfg.schema.clone(),
            amqp: cfg.amqp.clone(),
            telemetry: telemetry.clone(),
        },
        relay_config,
        stop_relay.clone(),
    ));

    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut consumer_config = ConsumerConfig::new(&cfg.queue, &cfg.exchange, &["#"]);
    consumer_config.prefetch = std::num::NonZeroU16::new(16).expect("non-zero");
    consumer_config.retry_min = Duration::from_millis(200);
    consumer_config.retry_max = Duration::from_secs(5);
    consumer_config.connection_name = format!("outbox-relay demo {}", cfg.queue);
    let stop_consumer = CancellationToken::new();
    let mut consumer_task = tokio::spawn(runner::run(
        ConsumerDeps {
            pool: target.pool(&cfg.schema, "outbox-relay-demo-consumer", 32),
            amqp: cfg.amqp.clone(),
        },
        consumer_config,
        Arc::new(Counter { seen: seen.clone() }),
        stop_consumer.clone(),
    ));

    // Dispatched rows before the clock started (the warm-up's); subtracted from the counts.
    let mut published_base = 0;
    let result = async {
        let producer = target
            .connect(&cfg.schema, "outbox-relay-demo-producer")
            .await?;
        let outbox = Outbox::new(cfg.schema.as_str()).map_err(DemoError::Produce)?;

        // Warm-up: one event through the whole path before the clock starts.
        outbox
            .enqueue(
                &producer,
                &NewEvent::new("demo", "warm-up", "warm-up", json!({ "warm_up": true })),
            )
            .await?;
        let warm_start = Instant::now();
        loop {
            // Consumed, and marked: the consumer may see the message before the relay's
            // mark commits, and the warm-up must not be counted as published.
            if seen.lock().expect("demo counters").warmed_up
                && telemetry.metrics.dispatched.get() >= 1
            {
                break;
            }
            if warm_start.elapsed() > WARM_UP_LIMIT {
                return Err(DemoError::WarmUp(WARM_UP_LIMIT));
            }
            tokio::select! {
                r = &mut relay_task => return Err(ended("the relay", r)),
                r = &mut consumer_task => return Err(ended("the consumer", r)),
                _ = shutdown.cancelled() => return Err(DemoError::Interrupted),
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
        // The warm-up row (dispatched once, the only row so far) is not part of the counts.
        published_base = telemetry.metrics.dispatched.get();

        let mut produced: HashSet<Uuid> = HashSet::new();
        let start = Instant::now();
        let mut next_progress = Duration::from_secs(1);
        let mut interrupted = false;
        let rate = f64::from(cfg.rate.get());
        let progress = |produced: u64, draining: bool| {
            let s = seen.lock().expect("demo counters");
            Progress {
                elapsed: start.elapsed(),
                produced,
                published: telemetry
                    .metrics
                    .dispatched
                    .get()
                    .saturating_sub(published_base),
                consumed: s.consumed.len() as u64,
                p50: s.latency.quantile(0.5),
                p99: s.latency.quantile(0.99),
                draining,
            }
        };
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        // With --duration, exactly rate × duration events when the producer keeps up (a
        // last catch-up batch at the deadline); a producer that cannot keep up stops at the
        // deadline all the same and the summary shows the rate it reached.
        let (target, deadline) = match cfg.stop {
            Stop::Events(n) => (n.get(), None),
            Stop::After(d) => ((rate * d.as_secs_f64()).round() as u64, Some(d)),
        };
        let produce_end;
        loop {
            let elapsed = start.elapsed();
            let due_total = ((rate * elapsed.as_secs_f64()) as u64).min(target);
            let due = due_total.saturating_sub(produced.len() as u64);
            if due > 0 {
                let first = produced.len() as u64;
                let n = due.min(MAX_BATCH);
                let ids: Vec<String> = (first..first + n)
                    .map(|i| format!("k{}", i % u64::from(cfg.keys.get())))
                    .collect();
                let events: Vec<NewEvent<'_>> = ids
                    .iter()
                    .enumerate()
                    .map(|(j, id)| {
                        NewEvent::new("demo", id, "tick", json!({ "n": first + j as u64 }))
                    })
                    .collect();
                produced.extend(outbox.enqueue_many(&producer, &events).await?);
            }
            if produced.len() as u64 >= target || deadline.is_some_and(|d| elapsed >= d) {
                produce_end = start.elapsed();
                break;
            }
            if start.elapsed() >= next_progress {
                on_progress(&progress(produced.len() as u64, false));
                next_progress += Duration::from_secs(1);
            }
            tokio::select! {
                r = &mut relay_task => return Err(ended("the relay", r)),
                r = &mut consumer_task => return Err(ended("the consumer", r)),
                _ = shutdown.cancelled() => {
                    interrupted = true;
                    produce_end = start.elapsed();
                    break;
                }
                _ = tick.tick() => {}
            }
        }

        // Drain: wait until every produced event was consumed, or the timeout.
        let drain_start = Instant::now();
        loop {
            let all = {
                let s = seen.lock().expect("demo counters");
                produced.iter().all(|id| s.consumed.contains(id))
            };
            if all || drain_start.elapsed() > cfg.drain_timeout {
                break;
            }
            if start.elapsed() >= next_progress {
                on_progress(&progress(produced.len() as u64, true));
                next_progress += Duration::from_secs(1);
            }
            tokio::select! {
                r = &mut relay_task => return Err(ended("the relay", r)),
                r = &mut consumer_task => return Err(ended("the consumer", r)),
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }

        let s = seen.lock().expect("demo counters");
        let consumed_ours = produced.iter().filter(|id| s.consumed.contains(id)).count() as u64;
        let end = s
            .last_at
            .map(|t| t.saturating_duration_since(start))
            .unwrap_or_else(|| start.elapsed());
        Ok(Summary {
            produced: produced.len() as u64,
            // Filled in once the relay has stopped: it marks the last acked rows then.
            published: 0,
            consumed: consumed_ours,
            lost: produced.len() as u64 - consumed_ours,
            duplicates: s.duplicates,
            stray: s.consumed.len() as u64 - consumed_ours,
            p50: s.latency.quantile(0.5),
            p99: s.latency.quantile(0.99),
            max: s.latency.max(),
            elapsed: end,
            rate: if produce_end.is_zero() {
                0.0
            } else {
                produced.len() as f64 / produce_end.as_secs_f64()
            },
            interrupted,
        })
    }
    .await;

    // Stop in the data path's order: nothing new is published once the consumer is gone.
    stop_consumer.cancel();
    stop_relay.cancel();
    stop_http.cancel();
    if !consumer_task.is_finished() {
        let _ = tokio::time::timeout(Duration::from_secs(10), &mut consumer_task).await;
    }
    if !relay_task.is_finished() {
        let _ = tokio::time::timeout(Duration::from_secs(10), &mut relay_task).await;
    }
    result.map(|mut summary| {
        summary.published = telemetry
            .metrics
            .dispatched
            .get()
            .saturating_sub(published_base);
        summary
    })
}

/// A task that was supposed to run until stopped ended: say why.
fn ended<E: Into<DemoError>>(
    what: &'static str,
    r: Result<Result<(), E>, tokio::task::JoinError>,
) -> DemoError {
    match r {
        Ok(Err(e)) => e.into(),
        _ => DemoError::Task(what),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_within_five_percent() {
        let mut h = LatencyHistogram::default();
        assert_eq!(h.quantile(0.5), None);
        for ms in 1..=1000u64 {
            h.record(Duration::from_millis(ms));
        }
        assert_eq!(h.count(), 1000);
        let p50 = h.quantile(0.5).unwrap().as_secs_f64() * 1000.0;
        let p99 = h.quantile(0.99).unwrap().as_secs_f64() * 1000.0;
        assert!((500.0..=525.0).contains(&p50), "p50 {p50}");
        assert!((990.0..=1000.0).contains(&p99), "p99 {p99}");
        assert_eq!(h.max(), Some(Duration::from_millis(1000)));
        assert_eq!(h.quantile(1.0), Some(Duration::from_millis(1000)));
    }

    #[test]
    fn histogram_keeps_tiny_and_huge_values() {
        let mut h = LatencyHistogram::default();
        h.record(Duration::ZERO);
        h.record(Duration::from_secs(100_000));
        assert_eq!(
            h.quantile(0.0).unwrap(),
            Duration::from_secs_f64(HIST_BASE_SECS)
        );
        assert_eq!(h.quantile(1.0), Some(Duration::from_secs(100_000)));
    }

    #[test]
    fn summary_line_names_every_figure() {
        let s = Summary {
            produced: 10,
            published: 10,
            consumed: 10,
            lost: 0,
            duplicates: 0,
            stray: 0,
            p50: Some(Duration::from_micros(1500)),
            p99: None,
            max: Some(Duration::from_millis(3)),
            elapsed: Duration::from_secs(2),
            rate: 5.0,
            interrupted: false,
        };
        assert_eq!(
            s.to_string(),
            "demo summary: produced 10, published 10, consumed 10, lost 0, duplicates 0, stray 0; \
             latency p50 1.5ms p99 - max 3.0ms; 2.0s, produced at 5.0 events/s"
        );
    }
}
