//! The bench's side of RabbitMQ: an exchange and a durable queue of its own per
//! measurement, the raw publisher that measures the broker's ceiling, and a consumer
//! that timestamps every arrival.
//!
//! The ceiling publisher does what the relay's lanes do, minus the database: one
//! connection, `channels` confirm-mode channels, at most `window` unconfirmed messages over
//! all of them, the same body bytes, the same properties and headers (message_id,
//! content_type, type, timestamp, persistent, four `x-outbox-*` headers), mandatory, to the
//! same kind of exchange and queue. It is the best any relay could do on this broker.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ExchangeKind};
use outbox_kit::amqp::AmqpTarget;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// An exchange, a durable queue bound to it with `#`, and a connection to manage them.
pub struct BenchBroker {
    conn: Connection,
    ch: Channel,
    pub exchange: String,
    pub queue: String,
}

impl BenchBroker {
    /// Declares `bench.<pid>.<tag>` (topic, durable) and its queue.
    pub async fn new(target: &AmqpTarget, tag: &str) -> Result<BenchBroker> {
        let exchange = format!("bench.{}.{tag}", std::process::id());
        let queue = format!("{exchange}.q");
        let conn = target
            .connect(&format!("outbox-bench {exchange}"))
            .await
            .context("cannot connect to rabbitmq")?;
        let ch = conn.create_channel().await?;
        ch.exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        ch.queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        ch.queue_bind(
            queue.as_str().into(),
            exchange.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        Ok(BenchBroker {
            conn,
            ch,
            exchange,
            queue,
        })
    }

    /// Messages in the queue (ready, not yet delivered).
    pub async fn depth(&self) -> Result<u32> {
        let q = self
            .ch
            .queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        Ok(q.message_count())
    }

    /// Empties the queue (so a measurement does not leave the broker paging).
    pub async fn purge(&self) -> Result<()> {
        self.ch
            .queue_purge(self.queue.as_str().into(), QueuePurgeOptions::default())
            .await?;
        Ok(())
    }

    /// Consumes the queue (no acks: the bench measures arrival, not processing) and
    /// records each message's arrival by the event number in its body.
    pub async fn consume(&self, arrivals: Arc<Arrivals>) -> Result<CancellationToken> {
        let ch = self.conn.create_channel().await?;
        let mut consumer = ch
            .basic_consume(
                self.queue.as_str().into(),
                "outbox-bench".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        let stop = CancellationToken::new();
        let s = stop.clone();
        tokio::spawn(async move {
            let _ch = ch; // the consumer lives as long as its channel
            loop {
                let d = tokio::select! {
                    _ = s.cancelled() => return,
                    d = consumer.next() => d,
                };
                let Some(Ok(d)) = d else { return };
                arrivals.arrived(&d.data);
            }
        });
        Ok(stop)
    }

    pub async fn delete(self) {
        let _ = self
            .ch
            .queue_delete(self.queue.as_str().into(), Default::default())
            .await;
        let _ = self
            .ch
            .exchange_delete(self.exchange.as_str().into(), Default::default())
            .await;
        let _ = self.conn.close(200, "bench done".into()).await;
    }
}

/// Commit and arrival times of events numbered `0..len`, in nanoseconds since a common
/// origin plus one (zero means "not yet"). Atomics because producers and the consumer
/// write from different tasks and nothing else needs to be consistent.
pub struct Arrivals {
    origin: Instant,
    /// `origin` on the wall clock (Unix nanoseconds), to join with the relay's stage trace.
    origin_unix_ns: u128,
    /// When each producer sent the INSERT.
    started: Vec<AtomicU64>,
    committed: Vec<AtomicU64>,
    arrived: Vec<AtomicU64>,
    arrived_count: AtomicUsize,
    /// Messages whose body named no event of this run.
    pub strays: AtomicUsize,
}

impl Arrivals {
    pub fn new(len: usize) -> Arrivals {
        let origin = Instant::now();
        let origin_unix_ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        Arrivals {
            origin,
            origin_unix_ns,
            started: (0..len).map(|_| AtomicU64::new(0)).collect(),
            committed: (0..len).map(|_| AtomicU64::new(0)).collect(),
            arrived: (0..len).map(|_| AtomicU64::new(0)).collect(),
            arrived_count: AtomicUsize::new(0),
            strays: AtomicUsize::new(0),
        }
    }

    fn stamp(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64 + 1
    }

    /// Event `n`'s INSERT is about to be sent.
    pub fn started(&self, n: u64) {
        if let Some(slot) = self.started.get(n as usize) {
            slot.store(self.stamp(), Ordering::Relaxed);
        }
    }

    /// How long each producer's INSERT (autocommit) of events `range` took, ms.
    pub fn insert_ms(&self, range: std::ops::Range<usize>) -> Vec<f64> {
        between_ms(&self.started, &self.committed, range)
    }

    /// Event `n`'s commit and arrival on the wall clock (Unix ns), when both happened.
    pub fn commit_and_arrival_unix(&self, n: usize) -> Option<(u128, u128)> {
        let c = self.committed.get(n)?.load(Ordering::Relaxed);
        let a = self.arrived.get(n)?.load(Ordering::Relaxed);
        let unix = |stamp: u64| self.origin_unix_ns + u128::from(stamp - 1);
        (c != 0 && a != 0).then(|| (unix(c), unix(a)))
    }

    pub fn committed(&self, n: u64) {
        if let Some(slot) = self.committed.get(n as usize) {
            slot.store(self.stamp(), Ordering::Relaxed);
        }
    }

    /// A message (or a notification) whose body names event `n` arrived now.
    pub fn arrived(&self, body: &[u8]) {
        let at = self.stamp();
        match crate::pg::order_id_of(body).and_then(|n| self.arrived.get(n as usize)) {
            Some(slot) => {
                // Only the first delivery counts; a redelivery is not a new arrival.
                if slot
                    .compare_exchange(0, at, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    self.arrived_count.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                self.strays.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Events of `range` whose commit was recorded.
    pub fn committed_count(&self, range: std::ops::Range<usize>) -> usize {
        self.committed[range]
            .iter()
            .filter(|c| c.load(Ordering::Relaxed) != 0)
            .count()
    }

    pub fn arrived_count(&self) -> usize {
        self.arrived_count.load(Ordering::Relaxed)
    }

    pub fn has_arrived(&self, n: u64) -> bool {
        self.arrived
            .get(n as usize)
            .is_some_and(|a| a.load(Ordering::Relaxed) != 0)
    }

    /// Commit-to-arrival latencies (ms) of events `range`, the number committed but never
    /// arrived, and the number that arrived before their producer saw COMMIT return.
    pub fn latencies(&self, range: std::ops::Range<usize>) -> (Vec<f64>, usize, usize) {
        let mut out = Vec::with_capacity(range.len());
        let (mut missing, mut early) = (0, 0);
        for n in range {
            let c = self.committed[n].load(Ordering::Relaxed);
            let a = self.arrived[n].load(Ordering::Relaxed);
            match (c, a) {
                (0, _) => {}
                (_, 0) => missing += 1,
                (c, a) if a < c => {
                    early += 1;
                    out.push(0.0);
                }
                (c, a) => out.push((a - c) as f64 / 1e6),
            }
        }
        (out, missing, early)
    }

    /// From handing the work over ([`Arrivals::started`]) to arrival (ms), for the events of
    /// `range` that arrived: the floor's hops, which no commit precedes.
    pub fn sent_to_arrival(&self, range: std::ops::Range<usize>) -> Vec<f64> {
        between_ms(&self.started, &self.arrived, range)
    }

    /// Latency p50 (ms) per `window` of commit time, from the first commit in `range`:
    /// shows whether the relay keeps up or falls further behind as the run goes on.
    pub fn p50_by_window(&self, range: std::ops::Range<usize>, window: Duration) -> Vec<f64> {
        let w = window.as_nanos().max(1) as u64;
        let first = self.committed[range.clone()]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .filter(|c| *c != 0)
            .min()
            .unwrap_or(0);
        let mut buckets: Vec<Vec<f64>> = Vec::new();
        for n in range {
            let c = self.committed[n].load(Ordering::Relaxed);
            let a = self.arrived[n].load(Ordering::Relaxed);
            if c == 0 || a == 0 {
                continue;
            }
            let b = ((c - first) / w) as usize;
            if buckets.len() <= b {
                buckets.resize_with(b + 1, Vec::new);
            }
            buckets[b].push(a.saturating_sub(c) as f64 / 1e6);
        }
        buckets
            .into_iter()
            .map(|v| crate::stats::Summary::of(v).p50_ms)
            .collect()
    }

    /// Seconds between the first and the last commit recorded in `range`.
    pub fn commit_span_s(&self, range: std::ops::Range<usize>) -> f64 {
        let stamps = self.committed[range]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .filter(|c| *c != 0);
        let (lo, hi) = stamps.fold((u64::MAX, 0), |(lo, hi), c| (lo.min(c), hi.max(c)));
        if hi > lo { (hi - lo) as f64 / 1e9 } else { 0.0 }
    }
}

/// From one recorded instant to a later one (ms), for the events of `range` that have both.
fn between_ms(from: &[AtomicU64], to: &[AtomicU64], range: std::ops::Range<usize>) -> Vec<f64> {
    range
        .filter_map(|n| {
            let f = from[n].load(Ordering::Relaxed);
            let t = to[n].load(Ordering::Relaxed);
            (f != 0 && t >= f).then(|| (t - f) as f64 / 1e6)
        })
        .collect()
}

/// The broker ceiling's result.
#[derive(Clone, Debug)]
pub struct Ceiling {
    pub messages: u64,
    pub seconds: f64,
    pub rate: f64,
    pub channels: usize,
    pub window: usize,
    pub body_bytes: f64,
    /// Where the CPU went while publishing (set by the caller, which takes the snapshots).
    pub cpu: crate::procfs::CpuSplit,
}

/// Publishes `n` messages with confirms as fast as the broker takes them (see the module
/// docs for what is the same as the relay). Bodies cycle through `bodies`.
pub async fn ceiling(
    target: &AmqpTarget,
    broker: &BenchBroker,
    bodies: Arc<Vec<String>>,
    n: u64,
    keys: u64,
    channels: usize,
    window: usize,
) -> Result<Ceiling> {
    if bodies.is_empty() {
        bail!("no message bodies to publish");
    }
    let conn = target.connect("outbox-bench ceiling").await?;
    let mut chans = Vec::new();
    for _ in 0..channels {
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        chans.push(ch);
    }
    // The relay's window is global over its lanes; so is this one.
    let permits = Arc::new(Semaphore::new(window));
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for ch in chans {
        let (permits, next, bodies) = (permits.clone(), next.clone(), bodies.clone());
        let exchange = broker.exchange.clone();
        tasks.push(tokio::spawn(async move {
            publish_lane(ch, exchange, permits, next, bodies, n, keys).await
        }));
    }
    let mut acked = 0;
    for t in tasks {
        acked += t.await.context("ceiling lane panicked")??;
    }
    let seconds = start.elapsed().as_secs_f64();
    let _ = conn.close(200, "ceiling done".into()).await;
    if acked != n {
        bail!("broker acked {acked} of {n} messages");
    }
    let body_bytes = bodies.iter().map(String::len).sum::<usize>() as f64 / bodies.len() as f64;
    Ok(Ceiling {
        messages: n,
        seconds,
        rate: n as f64 / seconds,
        channels,
        window,
        body_bytes,
        cpu: crate::procfs::CpuSplit::default(),
    })
}

/// One channel: takes message numbers from `next` until `n`, keeps publishing while the
/// shared window has room, and counts acks. Returns how many were acked.
async fn publish_lane(
    ch: Channel,
    exchange: String,
    permits: Arc<Semaphore>,
    next: Arc<AtomicU64>,
    bodies: Arc<Vec<String>>,
    n: u64,
    keys: u64,
) -> Result<u64> {
    let exchange: lapin::types::ShortString = exchange.as_str().into();
    let mut in_flight = FuturesUnordered::new();
    let mut acked = 0;
    let mut exhausted = false;
    while !exhausted || !in_flight.is_empty() {
        tokio::select! {
            biased;
            Some(confirm) = in_flight.next(), if !in_flight.is_empty() => {
                match confirm {
                    Ok(Confirmation::Ack(None)) => acked += 1,
                    Ok(other) => bail!("broker did not ack cleanly: {other:?}"),
                    Err(e) => bail!("{e}"),
                }
            }
            permit = permits.clone().acquire_owned(), if !exhausted => {
                let permit = permit.context("window closed")?;
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    exhausted = true;
                    continue;
                }
                let body = &bodies[(i % bodies.len() as u64) as usize];
                let confirm = ch
                    .basic_publish(
                        exchange.clone(),
                        "order.created".into(),
                        BasicPublishOptions { mandatory: true, immediate: false },
                        body.as_bytes(),
                        properties(i, keys),
                    )
                    .await
                    .context("publish")?;
                in_flight.push(async move {
                    let c = tokio::time::timeout(Duration::from_secs(60), confirm).await;
                    drop(permit);
                    match c {
                        Ok(Ok(c)) => Ok(c),
                        Ok(Err(e)) => Err(format!("confirm failed: {e}")),
                        Err(_) => Err("no confirm within 60 s".to_owned()),
                    }
                });
            }
        }
    }
    Ok(acked)
}

/// The properties and headers the relay sets (relay/publish.rs `prepare`), with values of
/// the same sizes.
fn properties(i: u64, keys: u64) -> BasicProperties {
    let mut headers = FieldTable::default();
    let s = |v: String| AMQPValue::LongString(LongString::from(v.into_bytes()));
    headers.insert("x-outbox-aggregate-type".into(), s("order".into()));
    headers.insert(
        "x-outbox-aggregate-id".into(),
        s(format!("k{}", i % keys.max(1))),
    );
    headers.insert(
        "x-outbox-seq".into(),
        AMQPValue::LongLongInt((i / keys.max(1) + 1) as i64),
    );
    headers.insert(
        "x-outbox-created-at".into(),
        s("2026-01-01T00:00:00.000000Z".into()),
    );
    // A UUID-shaped message_id (36 characters, like the relay's event ids).
    let message_id = format!(
        "{:08x}-0000-4000-8000-{:012x}",
        std::process::id(),
        i & 0xffff_ffff_ffff
    );
    BasicProperties::default()
        .with_message_id(message_id.as_str().into())
        .with_content_type("application/json".into())
        .with_type("created".into())
        .with_timestamp(1_767_225_600)
        .with_delivery_mode(2)
        .with_headers(headers)
}
