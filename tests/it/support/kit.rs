//! Consumer-kit helpers: an in-memory destination whose answers the test scripts, a raw
//! publisher (to deliver events out of order or twice, bypassing the relay), consumer
//! runners with test timings, and a reader for the dead-letter queue.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection};
use outbox_kit::amqp::AmqpTarget;
use outbox_kit::consumer::effects::{EffectsConfig, Ledger};
use outbox_kit::consumer::runner::{self, ConsumerConfig, ConsumerDeps, Handler};
use outbox_kit::consumer::{Destination, DestinationError, Effect};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{TestDb, amqp, amqp_best_effort, amqp_url, unique, wait_for};

/// A random-enough v4-shaped uuid without the `v4` feature: a hasher seeded per process,
/// fed a counter.
pub fn fresh_uuid() -> Uuid {
    use std::hash::{BuildHasher, Hasher};
    static SEED: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    static N: AtomicUsize = AtomicUsize::new(0);
    let seed = SEED.get_or_init(Default::default);
    let n = N.fetch_add(1, Ordering::Relaxed) as u64;
    let mut a = seed.build_hasher();
    a.write_u64(n);
    let mut b = seed.build_hasher();
    b.write_u64(!n);
    let raw = (u128::from(a.finish()) << 64) | u128::from(b.finish());
    uuid::Builder::from_random_bytes(raw.to_be_bytes()).into_uuid()
}

/// A destination kept in memory. Sends succeed unless `script` says otherwise (one scripted
/// answer per call, in order); `gate` holds every send until notified.
#[derive(Default)]
pub struct FakeDest {
    pub name: String,
    pub lookup: bool,
    pub delete_fails: Mutex<bool>,
    pub script: Mutex<VecDeque<Result<(), DestinationError>>>,
    /// effect key → how many times it was accepted (performed).
    pub accepted: Mutex<HashMap<String, usize>>,
    /// external id → effect key, for items currently out.
    pub live: Mutex<HashMap<String, String>>,
    pub deleted: Mutex<Vec<String>>,
    pub calls: AtomicUsize,
    pub gate: Option<Arc<Notify>>,
    pub entered: Arc<Notify>,
}

impl FakeDest {
    pub fn new(name: &str, lookup: bool) -> FakeDest {
        FakeDest {
            name: name.to_owned(),
            lookup,
            ..FakeDest::default()
        }
    }

    pub fn then(&self, answer: Result<(), DestinationError>) -> &Self {
        self.script.lock().unwrap().push_back(answer);
        self
    }

    pub fn accepted(&self, key: &str) -> usize {
        self.accepted.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    pub fn total_accepted(&self) -> usize {
        self.accepted.lock().unwrap().values().sum()
    }

    pub fn is_live(&self, key: &str) -> bool {
        self.live.lock().unwrap().values().any(|k| k == key)
    }

    /// Records the item as accepted, as a real destination would before answering.
    pub fn accept(&self, key: &str) -> String {
        let id = format!("ext-{key}-{}", fresh_uuid());
        *self
            .accepted
            .lock()
            .unwrap()
            .entry(key.to_owned())
            .or_default() += 1;
        self.live.lock().unwrap().insert(id.clone(), key.to_owned());
        id
    }
}

impl Destination for FakeDest {
    fn name(&self) -> &str {
        &self.name
    }

    async fn send(&self, effect: &Effect) -> Result<String, DestinationError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.entered.notify_one();
        if let Some(gate) = &self.gate {
            gate.notified().await;
        }
        let answer = self.script.lock().unwrap().pop_front();
        match answer {
            Some(Err(DestinationError::Unknown(why))) => {
                // Accepted, but the answer is lost.
                self.accept(&effect.key);
                Err(DestinationError::Unknown(why))
            }
            Some(Err(e)) => Err(e),
            Some(Ok(())) | None => Ok(self.accept(&effect.key)),
        }
    }

    async fn delete(&self, external_id: &str) -> Result<(), DestinationError> {
        if *self.delete_fails.lock().unwrap() {
            return Err(DestinationError::Transient("delete refused (503)".into()));
        }
        self.live.lock().unwrap().remove(external_id);
        self.deleted.lock().unwrap().push(external_id.to_owned());
        Ok(())
    }

    fn supports_lookup(&self) -> bool {
        self.lookup
    }

    async fn lookup(&self, effect: &Effect) -> Result<Option<String>, DestinationError> {
        let live = self.live.lock().unwrap();
        Ok(live
            .iter()
            .find(|(_, k)| **k == effect.key)
            .map(|(id, _)| id.clone()))
    }
}

/// A ledger with test timings: 1 s sends, 1 s write-backs, 4 s lease.
pub fn ledger(worker: &str) -> Ledger {
    Ledger::new(
        EffectsConfig::new(
            worker,
            Duration::from_secs(1),
            Duration::from_secs(1),
            Duration::from_secs(4),
        )
        .unwrap(),
    )
}

/// A consumer config with fast retries on a fresh exchange and queue.
pub fn consumer_config(exchange: &str) -> ConsumerConfig {
    let name = unique("it.consumer").replace('_', ".");
    let mut c = ConsumerConfig::new(&name, exchange, &["#"]);
    c.prefetch = std::num::NonZeroU16::new(8).unwrap();
    c.retry_min = Duration::from_millis(100);
    c.retry_max = Duration::from_millis(400);
    c.handler_timeout = Duration::from_secs(10);
    c
}

/// A consumer runner in this process.
pub struct Running {
    pub stop: CancellationToken,
    pub handle: tokio::task::JoinHandle<Result<(), runner::ConsumerError>>,
}

impl Running {
    pub fn start<H: Handler>(db: &TestDb, cfg: ConsumerConfig, handler: Arc<H>) -> Running {
        let deps = ConsumerDeps {
            pool: db.target.pool(&db.schema, "outbox-it-consumer", 32),
            amqp: AmqpTarget::parse(&amqp_url()).unwrap(),
        };
        let stop = CancellationToken::new();
        let handle = tokio::spawn(runner::run(deps, cfg, handler, stop.clone()));
        Running { stop, handle }
    }

    /// A runner on connections of the test's choosing (through fault proxies).
    pub fn start_with<H: Handler>(
        deps: ConsumerDeps,
        cfg: ConsumerConfig,
        handler: Arc<H>,
    ) -> Running {
        let stop = CancellationToken::new();
        let handle = tokio::spawn(runner::run(deps, cfg, handler, stop.clone()));
        Running { stop, handle }
    }

    pub async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("consumer stops within 30 s")
            .expect("consumer task")
            .expect("consumer ran without error");
    }
}

/// Publishes outbox-shaped messages directly (no relay), with publisher confirms.
pub struct RawPublisher {
    pub conn: Connection,
    pub channel: lapin::Channel,
    pub exchange: String,
}

/// One event as the relay would publish it.
#[derive(Clone, Debug)]
pub struct RawEvent {
    pub event_id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub seq: i64,
    pub body: serde_json::Value,
}

impl RawEvent {
    pub fn new(aggregate_id: &str, seq: i64, body: serde_json::Value) -> RawEvent {
        RawEvent {
            event_id: fresh_uuid(),
            aggregate_type: "order".into(),
            aggregate_id: aggregate_id.into(),
            seq,
            body,
        }
    }
}

impl RawPublisher {
    pub async fn new(exchange: &str) -> RawPublisher {
        RawPublisher::on(&amqp_url(), exchange).await
    }

    /// A publisher on the broker at `url` (a test's own node).
    pub async fn on(url: &str, exchange: &str) -> RawPublisher {
        let conn = AmqpTarget::parse(url)
            .unwrap()
            .connect(&format!("outbox-it-publisher {exchange}"))
            .await
            .unwrap();
        let channel = amqp("channel.open", conn.create_channel()).await;
        amqp(
            "confirm.select",
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await;
        RawPublisher {
            conn,
            channel,
            exchange: exchange.to_owned(),
        }
    }

    pub async fn publish(&self, e: &RawEvent) {
        self.publish_with_seq(e, AMQPValue::LongLongInt(e.seq))
            .await;
    }

    /// Publishes `e` with `seq` as its `x-outbox-seq` header (a malformed one, say).
    pub async fn publish_with_seq(&self, e: &RawEvent, seq: AMQPValue) {
        let mut headers = FieldTable::default();
        let s = |v: &str| AMQPValue::LongString(LongString::from(v.as_bytes().to_vec()));
        headers.insert("x-outbox-aggregate-type".into(), s(&e.aggregate_type));
        headers.insert("x-outbox-aggregate-id".into(), s(&e.aggregate_id));
        headers.insert("x-outbox-seq".into(), seq);
        let props = BasicProperties::default()
            .with_message_id(e.event_id.to_string().as_str().into())
            .with_content_type("application/json".into())
            .with_type("created".into())
            .with_delivery_mode(2)
            .with_headers(headers);
        let body = serde_json::to_vec(&e.body).unwrap();
        let rk = format!("{}.created", e.aggregate_type);
        let confirm = amqp(
            "basic.publish",
            self.channel.basic_publish(
                self.exchange.as_str().into(),
                rk.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                props,
            ),
        )
        .await;
        // On a gone connection the confirm never comes: the deadline says so.
        amqp("the publisher confirm of a raw event", confirm).await;
    }
}

/// Waits until the consumer's queue exists and has a consumer (the runner declares it).
pub async fn wait_queue_ready(queue: &str) {
    wait_for(
        &format!("a consumer on queue {queue}"),
        Duration::from_secs(20),
        || async {
            queue_counts(&amqp_url(), queue)
                .await
                .filter(|(_, consumers)| *consumers > 0)
                .map(|_| ())
        },
    )
    .await;
}

/// Messages ready in `queue` on the broker at `url`, and its consumers, read with a passive
/// declare on a connection of its own; None when the queue is missing or the broker does not
/// answer in time (every call has a deadline: a node that restarts can leave one hanging).
pub async fn queue_counts(url: &str, queue: &str) -> Option<(u32, u32)> {
    let conn = AmqpTarget::parse(url)
        .ok()?
        .connect("outbox-it-probe")
        .await
        .ok()?;
    let q = async {
        let ch = outbox_kit::internal::rpc("channel.open", conn.create_channel())
            .await
            .ok()?;
        outbox_kit::internal::rpc(
            "queue.declare (passive)",
            ch.queue_declare(
                queue.into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )
        .await
        .ok()
    }
    .await;
    amqp_best_effort("connection.close", conn.close(200, "ok".into())).await;
    q.map(|q| (q.message_count(), q.consumer_count()))
}

/// A dead-lettered message: its event id and the reason header.
#[derive(Clone, Debug)]
pub struct Dead {
    pub event_id: String,
    pub reason: String,
}

/// Collects what arrives in `queue` (the dead-letter queue).
pub struct DeadLetters {
    pub got: Arc<Mutex<Vec<Dead>>>,
    stop: CancellationToken,
}

impl DeadLetters {
    pub async fn watch(queue: &str) -> DeadLetters {
        let conn = AmqpTarget::parse(&amqp_url())
            .unwrap()
            .connect("outbox-it-dlq")
            .await
            .unwrap();
        let ch = amqp("channel.open", conn.create_channel()).await;
        let got = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let mut consumer = amqp(
            "basic.consume",
            ch.basic_consume(
                queue.into(),
                "it-dlq".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await;
        let (sink, s) = (got.clone(), stop.clone());
        tokio::spawn(async move {
            let _conn = conn;
            loop {
                let d = tokio::select! {
                    _ = s.cancelled() => return,
                    d = consumer.next() => d,
                };
                let Some(Ok(d)) = d else { return };
                let reason = d
                    .properties
                    .headers()
                    .as_ref()
                    .and_then(|h| h.inner().get("x-outbox-dead-reason").cloned())
                    .map(|v| match v {
                        AMQPValue::LongString(s) => {
                            String::from_utf8_lossy(s.as_bytes()).into_owned()
                        }
                        other => format!("{other:?}"),
                    })
                    .unwrap_or_default();
                sink.lock().unwrap().push(Dead {
                    event_id: d
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|s| s.as_str().to_owned())
                        .unwrap_or_default(),
                    reason,
                });
                amqp_best_effort("basic.ack", d.ack(BasicAckOptions::default())).await;
            }
        });
        DeadLetters { got, stop }
    }

    pub fn all(&self) -> Vec<Dead> {
        self.got.lock().unwrap().clone()
    }
}

impl Drop for DeadLetters {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Deletes the queues and exchanges a runner declared for `cfg` (best effort).
pub async fn delete_topology(cfg: &ConsumerConfig) {
    let Ok(conn) = AmqpTarget::parse(&amqp_url())
        .unwrap()
        .connect("outbox-it-cleanup")
        .await
    else {
        return;
    };
    if let Ok(ch) = outbox_kit::internal::rpc("channel.open", conn.create_channel()).await {
        let mut queues = vec![cfg.queue.clone(), format!("{}.dlq", cfg.queue)];
        for ms in [100u64, 200, 300, 400, 50, 25] {
            queues.push(format!("{}.retry.{ms}ms", cfg.queue));
        }
        for q in queues {
            amqp_best_effort(
                "queue.delete",
                ch.queue_delete(q.as_str().into(), Default::default()),
            )
            .await;
        }
        amqp_best_effort(
            "exchange.delete",
            ch.exchange_delete(
                format!("{}.dlx", cfg.queue).as_str().into(),
                Default::default(),
            ),
        )
        .await;
    }
    amqp_best_effort("connection.close", conn.close(200, "cleanup".into())).await;
}

/// An ordered group's config on a fresh exchange: `partitions` partitions, a 2 s member
/// lease, 5 attempts, handler timeout 2 s (so a backlog outlasts every kit timeout).
pub fn group_config(exchange: &str, partitions: u16) -> ConsumerConfig {
    let mut c = consumer_config(exchange);
    c.ordered = Some(runner::Ordered {
        partitions: std::num::NonZeroU16::new(partitions).unwrap(),
        on_dead: runner::OnDead::BlockKey,
        member_lease: Duration::from_secs(2),
    });
    c.max_attempts = std::num::NonZeroU32::new(5);
    c.handler_timeout = Duration::from_secs(2);
    c
}

/// Waits until every partition queue of the group has a consumer.
pub async fn wait_group_ready(cfg: &ConsumerConfig) {
    let partitions = cfg.ordered.as_ref().unwrap().partitions.get();
    for p in 0..partitions {
        wait_queue_ready(&cfg.partition_queue(p)).await;
    }
    wait_queue_ready(&cfg.intake_queue()).await;
}

/// Deletes an ordered group's intake and partition queues, route exchange and dead letters.
pub async fn delete_group_topology(cfg: &ConsumerConfig) {
    let Ok(conn) = AmqpTarget::parse(&amqp_url())
        .unwrap()
        .connect("outbox-it-cleanup")
        .await
    else {
        return;
    };
    if let Ok(ch) = outbox_kit::internal::rpc("channel.open", conn.create_channel()).await {
        let partitions = cfg.ordered.as_ref().map_or(0, |o| o.partitions.get());
        let mut queues: Vec<String> = (0..partitions).map(|p| cfg.partition_queue(p)).collect();
        queues.push(cfg.dead_letter_queue());
        queues.push(cfg.intake_queue());
        for q in queues {
            amqp_best_effort(
                "queue.delete",
                ch.queue_delete(q.as_str().into(), Default::default()),
            )
            .await;
        }
        for x in [cfg.route_exchange(), format!("{}.dlx", cfg.queue)] {
            amqp_best_effort(
                "exchange.delete",
                ch.exchange_delete(x.as_str().into(), Default::default()),
            )
            .await;
        }
    }
    amqp_best_effort("connection.close", conn.close(200, "cleanup".into())).await;
}

/// What an ordered group's state is, for a wait's timeout: the inbox outcomes, held and
/// attempted rows, gaps, and the depth of each of its queues.
pub async fn group_state(client: &tokio_postgres::Client, cfg: &ConsumerConfig) -> String {
    let q = "SELECT 'inbox ' || coalesce(string_agg(outcome || '=' || n, ' '), 'empty') FROM
               (SELECT outcome, count(*) AS n FROM outbox_inbox WHERE consumer = $1
                 GROUP BY outcome ORDER BY outcome) AS o
             UNION ALL SELECT 'held ' || count(*) FROM outbox_inbox_held WHERE consumer = $1
             UNION ALL SELECT 'attempted ' || count(*) || ', most ' || coalesce(max(attempts), 0)
               FROM outbox_inbox_attempts WHERE consumer = $1
             UNION ALL SELECT 'gaps ' || count(*) FROM outbox_inbox_gaps WHERE consumer = $1
             UNION ALL (SELECT 'dead ' || coalesce(aggregate_id || '#' || seq, event_id::text) || ': '
                 || coalesce(reason, '')
               FROM outbox_inbox WHERE consumer = $1 AND outcome = 'dead' ORDER BY handled_at
               LIMIT 5)";
    let mut out = String::new();
    match tokio::time::timeout(Duration::from_secs(5), client.query(q, &[&cfg.name])).await {
        Ok(Ok(rows)) => {
            for r in rows {
                let line: Option<String> = r.get(0);
                out.push_str(&format!("\n  {}", line.unwrap_or_default()));
            }
        }
        Ok(Err(e)) => out.push_str(&format!("\n  state query failed: {e}")),
        Err(_) => out.push_str("\n  state query took over 5 s"),
    }
    let partitions = cfg.ordered.as_ref().map_or(0, |o| o.partitions.get());
    let mut queues: Vec<String> = (0..partitions).map(|p| cfg.partition_queue(p)).collect();
    queues.extend([cfg.intake_queue(), cfg.dead_letter_queue()]);
    for queue in queues {
        let counts = queue_counts(&amqp_url(), &queue).await;
        out.push_str(&format!("\n  {queue}: (ready, consumers) {counts:?}"));
    }
    out
}
