//! Measurement 8, the consumer: a backlog applied by a group of 1, 2 and 3 consumer
//! instances through the inbox, unordered and ordered (a consumer group), and ordered with
//! one effect per event through the effects ledger, as a ratio to the relay's drain rate
//! measured in the same run.
//!
//! The backlog is published straight to the exchange with the relay's headers
//! (`message_id`, `x-outbox-aggregate-type`/`-id`/`-seq`), so only the consumer is measured.
//! The instances are tasks of this process, each with its own Postgres pool and its own
//! broker connection (the runner connects itself); one instance first declares the
//! topology and stops, then the backlog is published, then the instances start together
//! and the clock runs until every event is applied (and, with effects, every effect sent).

use std::num::NonZeroU16;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use outbox_kit::amqp::AmqpTarget;
use outbox_kit::consumer::effects::{EffectError, EffectsConfig, NewEffect};
use outbox_kit::consumer::runner::{self, ConsumerConfig, ConsumerDeps, OnDead, Ordered};
use outbox_kit::consumer::{
    Destination, DestinationError, Effect, Handler, HandlerError, Ledger, Message,
};
use outbox_kit::contract::Schema;
use tokio_util::sync::CancellationToken;

use crate::pg::BenchDb;

use super::Ctx;

/// How the consumer applies its events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One queue, events applied as they come, deduplicated by the inbox.
    Unordered,
    /// A consumer group: per key one after another, through the group's inbox record.
    Ordered,
    /// A consumer group whose handler enqueues one effect per event in the ledger; each
    /// instance performs them (claim, send to an in-process destination, write back).
    OrderedEffect,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Unordered, Mode::Ordered, Mode::OrderedEffect];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Unordered => "unordered",
            Mode::Ordered => "ordered",
            Mode::OrderedEffect => "ordered_effect",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Mode::Unordered => "unordered, inbox",
            Mode::Ordered => "ordered group, inbox",
            Mode::OrderedEffect => "ordered group, inbox + one effect",
        }
    }
}

#[derive(Clone, Debug)]
pub struct ConsumerPoint {
    pub mode: Mode,
    pub instances: usize,
    /// From starting the instances to every event applied (and every effect sent).
    pub seconds: f64,
    pub rate: f64,
}

#[derive(Clone, Debug)]
pub struct ConsumerRuns {
    pub events: u64,
    pub keys: u64,
    pub partitions: u16,
    pub prefetch: u16,
    /// The relay's drain rate in this run (the drain section's, or a short drain's).
    pub drain_rate: f64,
    pub drain_events: u64,
    pub points: Vec<ConsumerPoint>,
}

impl ConsumerRuns {
    pub fn ratio(&self, p: &ConsumerPoint) -> f64 {
        p.rate / self.drain_rate
    }
}

/// Applies every event in the inbox's transaction; with `ledger`, enqueues one effect.
struct Apply {
    effect: bool,
}

impl Handler for Apply {
    async fn handle(&self, cx: &runner::Context<'_>, msg: &Message) -> Result<(), HandlerError> {
        if self.effect {
            let key = msg.event_id.to_string();
            Ledger::enqueue(
                cx.tx(),
                &NewEffect {
                    key: &key,
                    destination: "bench",
                    payload: serde_json::Value::Null,
                    budget: None,
                    reserve_now: false,
                },
            )
            .await
            .map_err(|e| HandlerError::Transient(e.to_string()))?;
        }
        Ok(())
    }
}

/// A destination that accepts everything at once.
struct Sink;

impl Destination for Sink {
    fn name(&self) -> &str {
        "bench"
    }

    async fn send(&self, effect: &Effect) -> Result<String, DestinationError> {
        Ok(effect.id.to_string())
    }

    async fn delete(&self, _external_id: &str) -> Result<(), DestinationError> {
        Ok(())
    }
}

/// Runs every (mode, instance count) on its own database and exchange.
pub async fn consumer(ctx: &Ctx, drain_rate: f64, drain_events: u64) -> Result<ConsumerRuns> {
    let s = &ctx.s;
    let mut points = Vec::new();
    for mode in Mode::ALL {
        for &n in &s.consumer_instances {
            crate::note(&format!(
                "8. consumer: {} events, {}, {n} instance(s)",
                s.consumer_events,
                mode.describe()
            ));
            points.push(one(ctx, mode, n).await?);
        }
    }
    Ok(ConsumerRuns {
        events: s.consumer_events,
        keys: s.consumer_keys,
        partitions: s.consumer_partitions,
        prefetch: s.consumer_prefetch,
        drain_rate,
        drain_events,
        points,
    })
}

fn config(ctx: &Ctx, tag: &str, mode: Mode) -> ConsumerConfig {
    let s = &ctx.s;
    let exchange = format!("bench.{}.{tag}", std::process::id());
    let mut c = ConsumerConfig::new(&format!("{exchange}.c"), &exchange, &["#"]);
    c.prefetch = NonZeroU16::new(s.consumer_prefetch).expect("non-zero");
    c.connection_name = format!("outbox-bench {tag}");
    // Nothing fails here; these only keep a group's in-place retry budget within the
    // broker's redelivery timeout, which the defaults do not.
    c.handler_timeout = Duration::from_secs(10);
    c.retry_max = Duration::from_secs(2);
    c.max_attempts = std::num::NonZeroU32::new(5);
    if mode != Mode::Unordered {
        c.ordered = Some(Ordered {
            partitions: NonZeroU16::new(s.consumer_partitions).expect("non-zero"),
            on_dead: OnDead::BlockKey,
            member_lease: Duration::from_secs(6),
        });
    }
    c
}

/// The queues the consumer reads: its queue, or its partition queues and intake queue.
fn queues(cfg: &ConsumerConfig) -> Vec<String> {
    match &cfg.ordered {
        Some(o) => (0..o.partitions.get())
            .map(|p| cfg.partition_queue(p))
            .chain([cfg.intake_queue()])
            .collect(),
        None => vec![cfg.queue.clone()],
    }
}

struct Instance {
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<Result<(), runner::ConsumerError>>,
    performer: Option<tokio::task::JoinHandle<Result<()>>>,
}

fn start(ctx: &Ctx, db: &BenchDb, cfg: &ConsumerConfig, mode: Mode, i: usize) -> Instance {
    // What the runner requires (two per message in hand); the pool opens them lazily.
    let pool_size = 2 * usize::from(cfg.prefetch.get()) + 1;
    let deps = ConsumerDeps {
        pool: db
            .target
            .pool(&Schema::default(), "outbox-bench-consumer", pool_size),
        amqp: ctx.amqp.clone(),
    };
    let mut cfg = cfg.clone();
    cfg.connection_name = format!("{} i{i}", cfg.connection_name);
    let stop = CancellationToken::new();
    let effect = mode == Mode::OrderedEffect;
    let handle = tokio::spawn(runner::run(
        deps.clone(),
        cfg,
        Arc::new(Apply { effect }),
        stop.clone(),
    ));
    let performer = effect.then(|| tokio::spawn(perform(deps.pool, i, stop.clone())));
    Instance {
        stop,
        handle,
        performer,
    }
}

/// Performs queued effects (claim, send, write back) until stopped.
async fn perform(pool: deadpool_postgres::Pool, i: usize, stop: CancellationToken) -> Result<()> {
    let ledger = Ledger::new(EffectsConfig::new(
        format!("outbox-bench-{}-{i}", std::process::id()),
        Duration::from_secs(5),
        Duration::from_secs(5),
        Duration::from_secs(30),
    )?);
    let client = pool.get().await?;
    while !stop.is_cancelled() {
        let keys: Vec<String> = client
            .query(
                "SELECT effect_key FROM outbox_effects WHERE state = 'queued' ORDER BY id LIMIT 200",
                &[],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if keys.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        for key in keys {
            match ledger.perform(&client, &key, &Sink).await {
                // Another instance claimed it since the list was read: it is theirs.
                Err(EffectError::InFlight { .. }) => {}
                r => {
                    r?;
                }
            }
        }
    }
    Ok(())
}

impl Instance {
    async fn stop(self) -> Result<()> {
        self.stop.cancel();
        self.handle.await?.context("consumer instance")?;
        if let Some(p) = self.performer {
            p.await??;
        }
        Ok(())
    }
}

async fn one(ctx: &Ctx, mode: Mode, n: usize) -> Result<ConsumerPoint> {
    let db = ctx.admin.create_db().await?;
    let tag = ctx.tag("cons");
    let cfg = config(ctx, &tag, mode);
    let result = one_inner(ctx, &db, &cfg, mode, n).await;
    cleanup(&ctx.amqp, &cfg).await;
    ctx.admin.drop_db(&db.name).await;
    result
}

async fn one_inner(
    ctx: &Ctx,
    db: &BenchDb,
    cfg: &ConsumerConfig,
    mode: Mode,
    n: usize,
) -> Result<ConsumerPoint> {
    let s = &ctx.s;
    // One instance declares the topology; the backlog then waits in the queues.
    let mut declarer = start(ctx, db, cfg, mode, 99);
    tokio::select! {
        r = wait_consumed(&ctx.amqp, cfg) => r?,
        r = &mut declarer.handle => {
            r?.context("the consumer declaring the topology")?;
            bail!("the consumer declaring the topology stopped");
        }
    }
    declarer.stop().await?;
    publish(&ctx.amqp, &cfg.exchange, s.consumer_events, s.consumer_keys).await?;
    let started = Instant::now();
    let instances: Vec<Instance> = (0..n).map(|i| start(ctx, db, cfg, mode, i)).collect();
    let want = s.consumer_events as i64;
    let count = if mode == Mode::OrderedEffect {
        "SELECT count(*) FROM outbox_effects WHERE state = 'sent'"
    } else {
        "SELECT count(*) FROM outbox_inbox WHERE consumer = $1"
    };
    let limit = Duration::from_secs(60 + s.consumer_events / 50);
    let deadline = started + limit;
    let mut done = 0;
    loop {
        let got: i64 = if mode == Mode::OrderedEffect {
            db.client.query_one(count, &[]).await?.get(0)
        } else {
            db.client.query_one(count, &[&cfg.name]).await?.get(0)
        };
        done = done.max(got);
        if got >= want {
            break;
        }
        if let Some(i) = instances.iter().find(|i| i.handle.is_finished()) {
            let _ = i;
            bail!("a consumer instance stopped early");
        }
        if Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    for i in instances {
        i.stop().await?;
    }
    if done < want {
        bail!("timed out after {limit:?}: {done} of {want} events applied");
    }
    Ok(ConsumerPoint {
        mode,
        instances: n,
        seconds,
        rate: want as f64 / seconds,
    })
}

/// Waits until every queue of the consumer has a consumer (its topology is declared).
async fn wait_consumed(amqp: &AmqpTarget, cfg: &ConsumerConfig) -> Result<()> {
    let conn = amqp.connect("outbox-bench consumer-check").await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    'outer: loop {
        if Instant::now() > deadline {
            bail!("the consumer did not declare its queues within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        for q in queues(cfg) {
            // A passive declare on a missing queue closes the channel: one per check.
            let ch = conn.create_channel().await?;
            let ok = ch
                .queue_declare(
                    q.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await;
            match ok {
                Ok(q) if q.consumer_count() > 0 => {
                    let _ = ch.close(200, "ok".into()).await;
                }
                _ => continue 'outer,
            }
        }
        let _ = conn.close(200, "done".into()).await;
        return Ok(());
    }
}

/// Publishes `events` over `keys` keys as the relay would (seq per key from 1), with
/// confirms, 1,000 in flight at most.
async fn publish(amqp: &AmqpTarget, exchange: &str, events: u64, keys: u64) -> Result<()> {
    let conn = amqp.connect("outbox-bench consumer-backlog").await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut pending = Vec::new();
    // Unique per bench process and publish: pid, a counter, the event number.
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let id_base = (u128::from(std::process::id()) << 96) | (u128::from(run) << 64);
    let s = |v: &str| AMQPValue::LongString(LongString::from(v.as_bytes().to_vec()));
    for g in 0..events {
        let key = g % keys.max(1);
        let seq = (g / keys.max(1) + 1) as i64;
        let mut headers = FieldTable::default();
        headers.insert("x-outbox-aggregate-type".into(), s("order"));
        headers.insert("x-outbox-aggregate-id".into(), s(&format!("order-{key}")));
        headers.insert("x-outbox-seq".into(), AMQPValue::LongLongInt(seq));
        let props = BasicProperties::default()
            .with_message_id(
                uuid::Uuid::from_u128(id_base | u128::from(g))
                    .to_string()
                    .as_str()
                    .into(),
            )
            .with_content_type("application/json".into())
            .with_type("order.created".into())
            .with_delivery_mode(2)
            .with_headers(headers);
        let body = crate::pg::payload_json(g);
        pending.push(
            ch.basic_publish(
                exchange.into(),
                "order.created".into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await?,
        );
        if pending.len() >= 1_000 {
            for c in pending.drain(..) {
                c.await?;
            }
        }
    }
    for c in pending {
        c.await?;
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// Deletes the consumer's queues and exchanges.
async fn cleanup(amqp: &AmqpTarget, cfg: &ConsumerConfig) {
    let Ok(conn) = amqp.connect("outbox-bench cleanup").await else {
        return;
    };
    if let Ok(ch) = conn.create_channel().await {
        let mut qs = queues(cfg);
        qs.push(cfg.dead_letter_queue());
        if cfg.ordered.is_none() {
            // The retry tiers: retry_min doubling up to retry_max.
            let mut d = cfg.retry_min;
            loop {
                qs.push(format!("{}.retry.{}ms", cfg.queue, d.as_millis()));
                if d >= cfg.retry_max {
                    break;
                }
                d = (d * 2).min(cfg.retry_max);
            }
        }
        for q in qs {
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
        }
        let mut xs = vec![cfg.exchange.clone(), format!("{}.dlx", cfg.queue)];
        if cfg.ordered.is_some() {
            xs.push(cfg.route_exchange());
        }
        for x in xs {
            let _ = ch
                .exchange_delete(x.as_str().into(), Default::default())
                .await;
        }
    }
    let _ = conn.close(200, "cleanup".into()).await;
}
