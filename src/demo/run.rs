//! One demo run: re-create the demo database, start the relay and a consumer-kit runner in
//! this process, warm the path up with one event, produce at the rate until the stop
//! condition, drain, and stop in the data path's order (consumer, relay, HTTP).
//!
//! Invariant: only a database carrying [`DEMO_MARK`] is ever dropped.

use std::collections::HashSet;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{DEMO_MARK, DemoConfig, DemoError, LatencyHistogram, Progress, Stop, Summary};
use crate::relay::{self, Deps, RelayConfig};
use crate::telemetry::Telemetry;
use outbox_kit::consumer::runner::{
    self, ConsumerConfig, ConsumerDeps, Context, Handler, HandlerError, Message,
};
use outbox_kit::db::DbTarget;
use outbox_kit::internal::deadline;
use outbox_kit::producer::{NewEvent, Outbox};
use outbox_kit::schema;

/// How long the warm-up event may take to travel the whole path.
const WARM_UP_LIMIT: Duration = Duration::from_secs(30);
/// Most events per INSERT statement (a producer that fell behind catches up in chunks).
const MAX_BATCH: u64 = 1_000;
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
        let state = crate::http::HttpState::new(telemetry.clone(), &target, &cfg.schema, None);
        tokio::spawn(crate::http::serve(listener, state, stop_http.clone()));
    }
    let mut relay_config = RelayConfig::new(&cfg.exchange);
    // Quick retries: the warm-up may be returned until the consumer has bound its queue.
    relay_config.retry_min = Duration::from_millis(100);
    relay_config.retry_max = Duration::from_secs(1);
    relay_config.max_attempts = NonZeroU32::new(100).expect("non-zero");
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
