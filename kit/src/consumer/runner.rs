//! The consumer runner: consumes a queue with manual acks and a prefetch, runs the handler
//! inside a Postgres transaction together with the inbox record, commits, then acks.
//!
//! Per message: [`inbox::record`] says apply, duplicate (ack without running the handler) or
//! gap (ordered mode: an earlier seq of the key is missing). Handler errors are typed:
//! transient ones go to a retry queue, terminal ones to the dead-letter exchange.
//!
//! Retries do not spin the queue. A transient failure republishes the message (with a broker
//! confirm) to one of a few retry queues, one per delay tier (`retry_min`, doubling, up to
//! `retry_max`), each with a queue-wide `x-message-ttl` and dead-lettering back to the main
//! queue, and then acks the original. One TTL per queue, because RabbitMQ expires messages
//! only at a queue's head: per-message TTLs in one queue would make a short delay wait
//! behind a long one. The delay costs no prefetch slot and survives a consumer crash, which
//! holding the message in process and nacking it later would not. Gaps wait the same way,
//! with the first time the gap was seen carried in a header, so `gap_timeout` is measured
//! across redeliveries.
//!
//! Topology the runner declares (unless `declare` is off): the source exchange (durable
//! topic), the queue (durable, dead-lettering to `<queue>.dlx`), its bindings, the
//! dead-letter exchange `<queue>.dlx` (fanout) with queue `<queue>.dlq`, and the retry queues
//! `<queue>.retry.<ms>ms`.
//!
//! Invariants: a message is acked only after the inbox transaction committed, or after its
//! copy was confirmed by the broker in a retry queue or the dead-letter exchange. A graceful
//! stop takes no new message and finishes those in hand. The runner reconnects by itself.
//! Only this module knows lapin; handlers get [`Message`].

use std::collections::BTreeSet;
use std::future::Future;
use std::num::{NonZeroU16, NonZeroU32};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deadpool_postgres::Pool;
use futures_util::stream::{FuturesUnordered, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ExchangeKind, message::Delivery};
use serde_json::Value;
use tokio::sync::Mutex;
use tokio_postgres::Transaction;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::amqp::{self, AmqpError, AmqpTarget, long_string};
use crate::backoff::Backoff;
use crate::consumer::effects::EffectError;
use crate::consumer::events;
use crate::consumer::inbox::{self, Admission, EventRef, GapAction};
use crate::contract::ConfigError;
use crate::contract::validate_exchange;
use crate::db::{DbError, deadline};

use crate::contract::headers::{
    AGGREGATE_ID as H_AGGREGATE_ID, AGGREGATE_TYPE as H_AGGREGATE_TYPE, ATTEMPT as H_ATTEMPT,
    DEAD_CONSUMER as H_DEAD_CONSUMER, DEAD_REASON as H_DEAD_REASON, GAP_SINCE as H_GAP_SINCE,
    ROUTING_KEY as H_ROUTING_KEY, SEQ as H_SEQ,
};

const RPC_TIMEOUT: Duration = Duration::from_secs(15);

/// One delivered event, as a handler sees it (no lapin types).
#[derive(Clone, Debug)]
pub struct Message {
    /// The AMQP message_id: the outbox event_id.
    pub event_id: Uuid,
    /// The AMQP `type` property: the event type.
    pub event_type: String,
    pub routing_key: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// `x-outbox-seq`, per key 1, 2, 3, ...
    pub seq: Option<i64>,
    /// All headers, as JSON values.
    pub headers: serde_json::Map<String, Value>,
    pub body: Vec<u8>,
    /// The broker's redelivered flag (a consumer died or a channel closed with it unacked).
    pub redelivered: bool,
    /// How many times the runner retried it after transient errors.
    pub attempt: u32,
}

impl Message {
    /// The body parsed as JSON (the outbox payload).
    pub fn payload(&self) -> Result<Value, HandlerError> {
        serde_json::from_slice(&self.body)
            .map_err(|e| HandlerError::Terminal(format!("body is not JSON: {e}")))
    }

    fn event_ref(&self, ordered: bool) -> EventRef<'_> {
        EventRef {
            event_id: self.event_id,
            aggregate_type: &self.aggregate_type,
            aggregate_id: &self.aggregate_id,
            seq: if ordered { self.seq } else { None },
        }
    }
}

/// Why a handler did not apply a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// Try again later (with backoff): a dependency is down, a destination said 5xx.
    #[error("transient: {0}")]
    Transient(String),
    /// Never going to work: recorded and dead-lettered.
    #[error("terminal: {0}")]
    Terminal(String),
    /// The database failed; transient when [`DbError::is_transient`] says so.
    #[error(transparent)]
    Db(#[from] DbError),
    /// An effects-ledger step failed; transient when [`EffectError::is_transient`] says so.
    #[error(transparent)]
    Effect(#[from] EffectError),
}

impl HandlerError {
    pub fn is_transient(&self) -> bool {
        match self {
            HandlerError::Transient(_) => true,
            HandlerError::Terminal(_) => false,
            HandlerError::Db(e) => e.is_transient(),
            HandlerError::Effect(e) => e.is_transient(),
        }
    }
}

impl From<tokio_postgres::Error> for HandlerError {
    fn from(e: tokio_postgres::Error) -> Self {
        HandlerError::Db(e.into())
    }
}

/// What a handler gets besides the message.
pub struct Context<'a> {
    tx: &'a Transaction<'a>,
    pool: &'a Pool,
    consumer: &'a str,
}

impl<'a> Context<'a> {
    /// The inbox transaction: write here what must commit together with "handled".
    pub fn tx(&self) -> &'a Transaction<'a> {
        self.tx
    }

    /// Another pooled connection, in autocommit, for effects-ledger steps that must commit
    /// on their own before a send ([`crate::consumer::Ledger::perform`]).
    pub async fn connection(&self) -> Result<deadpool_postgres::Object, HandlerError> {
        Ok(deadline(self.pool.get()).await?)
    }

    /// This consumer's name (the inbox key).
    pub fn consumer(&self) -> &str {
        self.consumer
    }
}

/// What the runner calls for every message that is new (and, in ordered mode, next in line).
pub trait Handler: Send + Sync + 'static {
    fn handle(
        &self,
        cx: &Context<'_>,
        msg: &Message,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// What to do with an event whose predecessor did not come within `gap_timeout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnGap {
    /// Apply it; the missing seqs are recorded in `outbox_inbox_gaps` and given up.
    Skip,
    /// Dead-letter it; the key stays blocked at the gap until an operator moves it.
    DeadLetter,
}

/// Ordered mode: per key, seq n is applied only after n-1.
#[derive(Clone, Debug)]
pub struct Ordered {
    /// How long an event waits for its predecessor before the gap is reported.
    pub gap_timeout: Duration,
    /// How often a waiting event is tried again.
    pub gap_retry: Duration,
    pub on_gap: OnGap,
}

/// The runner's settings. Build with [`ConsumerConfig::new`], adjust, and `run` checks them.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// The inbox key: consumers with the same name share dedupe and order state.
    pub name: String,
    pub queue: String,
    /// The exchange the relay publishes to.
    pub exchange: String,
    pub bindings: Vec<String>,
    /// Declare the exchange, queues and bindings (off: they must exist as described).
    pub declare: bool,
    /// Unacked messages at most, and messages handled concurrently.
    pub prefetch: NonZeroU16,
    pub ordered: Option<Ordered>,
    pub retry_min: Duration,
    pub retry_max: Duration,
    /// Transient failures before a message is dead-lettered (None: retry forever).
    pub max_attempts: Option<NonZeroU32>,
    /// Longest one message may take (inbox, handler, commit).
    pub handler_timeout: Duration,
    /// The broker's delivery acknowledgement timeout (RabbitMQ `consumer_timeout`, 30 min by
    /// default): a handler must finish well within it or the broker closes the channel.
    pub redelivery_timeout: Duration,
    pub connection_name: String,
}

impl ConsumerConfig {
    pub fn new(name: &str, exchange: &str, bindings: &[&str]) -> ConsumerConfig {
        ConsumerConfig {
            name: name.to_owned(),
            queue: name.to_owned(),
            exchange: exchange.to_owned(),
            bindings: bindings.iter().map(|s| (*s).to_owned()).collect(),
            declare: true,
            prefetch: NonZeroU16::new(16).expect("non-zero"),
            ordered: None,
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
            max_attempts: NonZeroU32::new(20),
            handler_timeout: Duration::from_secs(60),
            redelivery_timeout: Duration::from_secs(30 * 60),
            connection_name: format!("outbox-consumer {name}"),
        }
    }

    /// Checks the settings against each other and against the pool: timeouts shorter than
    /// what they guard are configuration errors.
    pub fn validate(&self, pool_size: usize) -> Result<(), ConfigError> {
        if self.name.is_empty() {
            return Err(ConfigError::new("name", "must not be empty"));
        }
        validate_exchange(&self.queue).map_err(|e| ConfigError::new("queue", e))?;
        validate_exchange(&self.exchange).map_err(|e| ConfigError::new("exchange", e))?;
        if self.retry_min.is_zero() || self.retry_max < self.retry_min {
            return Err(ConfigError::new(
                "retry_max",
                "retry_min must be longer than zero and retry_max at least retry_min",
            ));
        }
        if self.handler_timeout * 2 > self.redelivery_timeout {
            return Err(ConfigError::new(
                "handler_timeout",
                format!(
                    "{:?} is more than half the broker's redelivery timeout {:?}: a slow handler would have its message redelivered while it still runs",
                    self.handler_timeout, self.redelivery_timeout
                ),
            ));
        }
        if let Some(o) = &self.ordered {
            if o.gap_retry.is_zero() || o.gap_retry > o.gap_timeout {
                return Err(ConfigError::new(
                    "gap_retry",
                    "must be longer than zero and not longer than gap_timeout",
                ));
            }
            if o.gap_timeout <= self.retry_max {
                return Err(ConfigError::new(
                    "gap_timeout",
                    format!(
                        "{:?} is not longer than retry_max {:?}: a predecessor waiting in a retry queue would be given up as missing",
                        o.gap_timeout, self.retry_max
                    ),
                ));
            }
        }
        // Each message in hand holds its inbox transaction and may take one more connection
        // for effect steps; fewer would deadlock the pool under load.
        let needed = 2 * self.prefetch.get() as usize;
        if pool_size < needed {
            return Err(ConfigError::new(
                "prefetch",
                format!(
                    "{} needs a pool of at least {needed} connections (one for the inbox transaction and one for effects per message in hand), the pool has {pool_size}",
                    self.prefetch
                ),
            ));
        }
        Ok(())
    }

    fn retry_queue(&self, delay: Duration) -> String {
        format!("{}.retry.{}ms", self.queue, delay.as_millis())
    }

    fn dead_letter_exchange(&self) -> String {
        format!("{}.dlx", self.queue)
    }

    /// The dead-letter queue bound to the dead-letter exchange.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dlq", self.queue)
    }

    /// The delay before retry `attempt` (1-based): retry_min doubling up to retry_max.
    fn retry_delay(&self, attempt: u32) -> Duration {
        let factor = 1u32 << attempt.saturating_sub(1).min(20);
        self.retry_min.saturating_mul(factor).min(self.retry_max)
    }

    fn delay_tiers(&self) -> BTreeSet<Duration> {
        let mut tiers: BTreeSet<Duration> = (1..=21).map(|a| self.retry_delay(a)).collect();
        if let Some(o) = &self.ordered {
            tiers.insert(o.gap_retry);
        }
        tiers
    }
}

/// What the runner runs on.
#[derive(Clone)]
pub struct ConsumerDeps {
    /// Pooled connections with `search_path` set to the outbox schema.
    pub pool: Pool,
    pub amqp: AmqpTarget,
}

/// A failure retries cannot fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The settings contradict each other.
    #[error("consumer configuration: {0}")]
    Config(#[from] ConfigError),
    /// The broker refused the topology (a queue declared elsewhere with other arguments,
    /// missing permissions).
    #[error(
        "rabbitmq refused the consumer's topology: {0}; fix or delete the queue, or set declare off"
    )]
    Topology(String),
}

/// Runs the consumer until `shutdown` is cancelled; then finishes the messages in hand.
pub async fn run<H: Handler>(
    deps: ConsumerDeps,
    cfg: ConsumerConfig,
    handler: Arc<H>,
    shutdown: CancellationToken,
) -> Result<(), ConsumerError> {
    cfg.validate(deps.pool.status().max_size)?;
    let cfg = Arc::new(cfg);
    events::consumer_started(
        &cfg.name,
        &cfg.queue,
        cfg.prefetch.get(),
        cfg.ordered.is_some(),
    );
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    let mut down = crate::down::Down::new("rabbitmq (consumer)");
    loop {
        if shutdown.is_cancelled() {
            events::stopped(&cfg.name);
            return Ok(());
        }
        let session = match Session::open(&deps.amqp, &cfg).await {
            Ok(s) => s,
            Err(Opened::Refused(why)) => return Err(ConsumerError::Topology(why)),
            Err(Opened::Failed(e)) => {
                let delay = backoff.next_delay();
                down.failed(&e, delay);
                tokio::select! {
                    _ = shutdown.cancelled() => continue,
                    _ = tokio::time::sleep(delay) => continue,
                }
            }
        };
        down.recovered();
        backoff.reset();
        let shared = Arc::new(Shared {
            cfg: cfg.clone(),
            pool: deps.pool.clone(),
            publisher: Mutex::new(session.publish.clone()),
        });
        let ended = session.consume(shared, handler.clone(), &shutdown).await;
        session.close().await;
        match ended {
            Ended::Shutdown => {
                events::stopped(&cfg.name);
                return Ok(());
            }
            Ended::Lost(why, in_hand) => {
                events::session_lost(&cfg.name, &why, in_hand);
                let delay = backoff.next_delay();
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

enum Opened {
    /// Connection trouble: retry.
    Failed(String),
    /// The broker refused a declaration (channel closed with 403/406): retrying will not help.
    Refused(String),
}

struct Session {
    conn: Connection,
    consume: Channel,
    publish: Channel,
    lost: CancellationToken,
}

/// The one `select!` of a session handles exactly these.
enum Wake {
    Shutdown,
    Delivery(Option<lapin::Result<Box<Delivery>>>),
    Finished,
    Lost(String),
}

enum Ended {
    Shutdown,
    Lost(String, usize),
}

/// One round trip with a deadline.
async fn rpc<T>(
    what: &'static str,
    fut: impl Future<Output = lapin::Result<T>>,
) -> Result<T, Opened> {
    amqp::rpc(what, fut)
        .await
        .map_err(|e| refused_or_failed(what, e))
}

/// What the broker refuses for good (a declaration that conflicts, no permission) told
/// apart from what a reconnect may fix.
fn refused_or_failed(what: &str, e: AmqpError) -> Opened {
    let text = e.to_string();
    // PRECONDITION_FAILED / ACCESS_REFUSED / NOT_FOUND on a declaration.
    if text.contains("PRECONDITION_FAILED")
        || text.contains("ACCESS_REFUSED")
        || text.contains("NOT_FOUND")
    {
        Opened::Refused(format!("{what}: {text}"))
    } else {
        Opened::Failed(format!("{what}: {text}"))
    }
}

impl Session {
    async fn open(target: &AmqpTarget, cfg: &ConsumerConfig) -> Result<Session, Opened> {
        let conn = target
            .connect(&cfg.connection_name)
            .await
            .map_err(|e| Opened::Failed(e.to_string()))?;
        let setup = async {
            let consume = rpc("channel.open", conn.create_channel()).await?;
            if cfg.declare {
                declare(&consume, cfg).await?;
            }
            rpc(
                "basic.qos",
                consume.basic_qos(cfg.prefetch.get(), BasicQosOptions::default()),
            )
            .await?;
            let publish = rpc("channel.open", conn.create_channel()).await?;
            rpc(
                "confirm.select",
                publish.confirm_select(ConfirmSelectOptions::default()),
            )
            .await?;
            Ok::<_, Opened>((consume, publish))
        };
        let (consume, publish) = match setup.await {
            Ok(v) => v,
            Err(e) => {
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    conn.close(320, "setup failed".into()),
                )
                .await;
                return Err(e);
            }
        };
        // Connection-level failures (heartbeat, broker closing us) end the session.
        let lost = CancellationToken::new();
        let events = conn.events_listener();
        let watch = lost.clone();
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            loop {
                tokio::select! {
                    _ = watch.cancelled() => return,
                    ev = events.next() => match ev {
                        Some(lapin::Event::Error(_)) | None => { watch.cancel(); return; }
                        Some(_) => {}
                    }
                }
            }
        });
        Ok(Session {
            conn,
            consume,
            publish,
            lost,
        })
    }

    async fn consume<H: Handler>(
        &self,
        shared: Arc<Shared>,
        handler: Arc<H>,
        shutdown: &CancellationToken,
    ) -> Ended {
        let cfg = &shared.cfg;
        let consumer = match rpc(
            "basic.consume",
            self.consume.basic_consume(
                cfg.queue.as_str().into(),
                ShortString::from(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await
        {
            Ok(c) => c,
            Err(Opened::Failed(e) | Opened::Refused(e)) => return Ended::Lost(e, 0),
        };
        let tag = consumer.tag();
        let mut consumer = std::pin::pin!(consumer);
        let mut in_hand = FuturesUnordered::new();
        let mut taking = true;
        let mut lost: Option<(String, usize)> = None;
        let prefetch = cfg.prefetch.get() as usize;
        loop {
            if !taking && in_hand.is_empty() {
                break;
            }
            let wake = tokio::select! {
                biased;
                _ = shutdown.cancelled(), if taking => Wake::Shutdown,
                Some(()) = in_hand.next(), if !in_hand.is_empty() => Wake::Finished,
                _ = self.lost.cancelled(), if lost.is_none() => Wake::Lost("amqp connection lost".into()),
                d = consumer.next(), if taking && in_hand.len() < prefetch => Wake::Delivery(d.map(|r| r.map(Box::new))),
            };
            match wake {
                Wake::Shutdown => {
                    events::stopping(&cfg.name, in_hand.len());
                    taking = false;
                    // Stop deliveries; what was prefetched but not started goes back to the
                    // queue when the channel closes.
                    let _ = tokio::time::timeout(
                        RPC_TIMEOUT,
                        self.consume
                            .basic_cancel(tag.clone(), BasicCancelOptions::default()),
                    )
                    .await;
                }
                Wake::Finished => {}
                Wake::Delivery(Some(Ok(d))) => {
                    in_hand.push(process(shared.clone(), handler.clone(), *d));
                }
                Wake::Delivery(Some(Err(e))) => {
                    taking = false;
                    lost = Some((e.to_string(), in_hand.len()));
                }
                Wake::Delivery(None) => {
                    taking = false;
                    lost = Some(("the broker cancelled the consumer".into(), in_hand.len()));
                }
                Wake::Lost(why) => {
                    // Let the messages in hand finish (bounded by handler_timeout); their
                    // acks fail and the broker redelivers them, which the inbox absorbs.
                    taking = false;
                    lost = Some((why, in_hand.len()));
                }
            }
        }
        match lost {
            Some((why, in_hand)) if !shutdown.is_cancelled() => Ended::Lost(why, in_hand),
            _ => Ended::Shutdown,
        }
    }

    async fn close(self) {
        self.lost.cancel();
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            self.conn.close(200, "outbox consumer closing".into()),
        )
        .await;
    }
}

async fn declare(ch: &Channel, cfg: &ConsumerConfig) -> Result<(), Opened> {
    let declared = |e| refused_or_failed("exchange.declare", e);
    amqp::declare_exchange(ch, &cfg.exchange, ExchangeKind::Topic, false)
        .await
        .map_err(declared)?;
    let dlx = cfg.dead_letter_exchange();
    amqp::declare_exchange(ch, &dlx, ExchangeKind::Fanout, false)
        .await
        .map_err(declared)?;
    let queue_options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let dlq = cfg.dead_letter_queue();
    rpc(
        "queue.declare",
        ch.queue_declare(dlq.as_str().into(), queue_options, FieldTable::default()),
    )
    .await?;
    rpc(
        "queue.bind",
        ch.queue_bind(
            dlq.as_str().into(),
            dlx.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    let mut args = FieldTable::default();
    // What the broker itself gives up on (a reject without requeue) lands there too.
    args.insert("x-dead-letter-exchange".into(), long_string(&dlx));
    rpc(
        "queue.declare",
        ch.queue_declare(cfg.queue.as_str().into(), queue_options, args),
    )
    .await?;
    for binding in &cfg.bindings {
        rpc(
            "queue.bind",
            ch.queue_bind(
                cfg.queue.as_str().into(),
                cfg.exchange.as_str().into(),
                binding.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
    }
    for delay in cfg.delay_tiers() {
        let mut args = FieldTable::default();
        args.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(delay.as_millis() as i64),
        );
        args.insert("x-dead-letter-exchange".into(), long_string(""));
        args.insert("x-dead-letter-routing-key".into(), long_string(&cfg.queue));
        let name = cfg.retry_queue(delay);
        rpc(
            "queue.declare",
            ch.queue_declare(name.as_str().into(), queue_options, args),
        )
        .await?;
    }
    Ok(())
}

/// What every message task shares.
struct Shared {
    cfg: Arc<ConsumerConfig>,
    pool: Pool,
    /// One publish at a time, each awaited to its confirm: lapin pairs a returned message
    /// with whichever confirm resolves next, so only a lone publish knows its own return.
    publisher: Mutex<Channel>,
}

/// What the inbox transaction ended with.
enum Applied {
    Done,
    Duplicate,
    Gap { expected: i64 },
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// One message, start to ack. Never fails: what cannot be settled is nacked for redelivery.
async fn process<H: Handler>(shared: Arc<Shared>, handler: Arc<H>, d: Delivery) {
    let cfg = &shared.cfg;
    let msg = match parse(&d, cfg.ordered.is_some()) {
        Ok(m) => m,
        Err(reason) => {
            dead_letter(&shared, &d, None, &reason).await;
            return;
        }
    };
    let outcome = within(cfg.handler_timeout, apply(&shared, &*handler, &msg, None)).await;
    settle(&shared, &*handler, &d, &msg, outcome).await;
}

async fn within(
    limit: Duration,
    fut: impl Future<Output = Result<Applied, HandlerError>>,
) -> Result<Applied, HandlerError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(HandlerError::Transient(format!(
            "message not handled within handler_timeout {limit:?}"
        ))),
    }
}

async fn settle<H: Handler>(
    shared: &Shared,
    handler: &H,
    d: &Delivery,
    msg: &Message,
    outcome: Result<Applied, HandlerError>,
) {
    let cfg = &shared.cfg;
    let event_id = msg.event_id.to_string();
    match outcome {
        Ok(Applied::Done | Applied::Duplicate) => ack(d).await,
        Ok(Applied::Gap { expected }) => {
            let ordered = cfg.ordered.as_ref().expect("gaps only in ordered mode");
            let got = msg.seq.unwrap_or(expected);
            let since = header_i64(d, H_GAP_SINCE).unwrap_or_else(now_ms);
            let waited = Duration::from_millis((now_ms() - since).max(0) as u64);
            if waited < ordered.gap_timeout {
                events::gap_waiting(
                    &cfg.name,
                    &msg.aggregate_type,
                    &msg.aggregate_id,
                    expected,
                    got,
                );
                let mut extra = FieldTable::default();
                extra.insert(H_GAP_SINCE.into(), AMQPValue::LongLongInt(since));
                republish_delayed(shared, d, ordered.gap_retry, extra).await;
                return;
            }
            match ordered.on_gap {
                OnGap::Skip => {
                    events::gap_given_up(
                        &cfg.name,
                        &msg.aggregate_type,
                        &msg.aggregate_id,
                        expected,
                        got,
                        "skipped",
                    );
                    let outcome = within(
                        cfg.handler_timeout,
                        apply(shared, handler, msg, Some(expected)),
                    )
                    .await;
                    // After the skip the event is next in line; anything else is settled as usual.
                    Box::pin(settle(shared, handler, d, msg, outcome)).await;
                }
                OnGap::DeadLetter => {
                    events::gap_given_up(
                        &cfg.name,
                        &msg.aggregate_type,
                        &msg.aggregate_id,
                        expected,
                        got,
                        "dead",
                    );
                    let reason = format!(
                        "seq {expected} of {}/{} did not come within gap_timeout {:?} (this is seq {got})",
                        msg.aggregate_type, msg.aggregate_id, ordered.gap_timeout
                    );
                    if !publish_dead(shared, d, &reason).await {
                        return;
                    }
                    let recorded = async {
                        let client = deadline(shared.pool.get()).await?;
                        let ev = msg.event_ref(true);
                        inbox::gap(&**client, &cfg.name, &ev, expected, GapAction::Dead).await?;
                        inbox::dead(&**client, &cfg.name, &ev, &reason, false).await
                    }
                    .await;
                    if let Err(e) = recorded {
                        tracing::warn!(target: "outbox_relay::consumer", error = %e, event_id, "dead-lettered gap not recorded in the inbox");
                    }
                    events::dead_lettered(&cfg.name, &event_id, &reason);
                    ack(d).await;
                }
            }
        }
        Err(e) if e.is_transient() => {
            let attempt = msg.attempt + 1;
            if cfg.max_attempts.is_some_and(|max| attempt >= max.get()) {
                let reason = format!("gave up after {attempt} attempts: {e}");
                dead_letter(shared, d, Some(msg), &reason).await;
                return;
            }
            let delay = cfg.retry_delay(attempt);
            events::retry_scheduled(
                &cfg.name,
                &event_id,
                attempt,
                delay.as_millis() as u64,
                &e.to_string(),
            );
            let mut extra = FieldTable::default();
            extra.insert(H_ATTEMPT.into(), AMQPValue::LongLongInt(attempt as i64));
            republish_delayed(shared, d, delay, extra).await;
        }
        Err(e) => dead_letter(shared, d, Some(msg), &e.to_string()).await,
    }
}

/// The inbox transaction: record, maybe run the handler, commit. `skip_to` first gives up
/// the gap before this event (ordered mode, after gap_timeout, on_gap = skip).
async fn apply<H: Handler>(
    shared: &Shared,
    handler: &H,
    msg: &Message,
    skip_to: Option<i64>,
) -> Result<Applied, HandlerError> {
    let cfg = &shared.cfg;
    let ordered = cfg.ordered.is_some();
    let mut conn = deadline(shared.pool.get()).await?;
    // The plain tokio-postgres transaction, so handlers see one type whatever the pool.
    let client: &mut tokio_postgres::Client = &mut conn;
    let tx = deadline(client.transaction()).await?;
    let ev = msg.event_ref(ordered);
    if let Some(expected) = skip_to {
        inbox::gap(&tx, &cfg.name, &ev, expected, GapAction::Skipped).await?;
    }
    match inbox::record(&tx, &cfg.name, &ev).await? {
        Admission::Duplicate => {
            deadline(tx.commit()).await?;
            Ok(Applied::Duplicate)
        }
        Admission::Gap { expected } => {
            deadline(tx.rollback()).await?;
            Ok(Applied::Gap { expected })
        }
        Admission::Apply => {
            let cx = Context {
                tx: &tx,
                pool: &shared.pool,
                consumer: &cfg.name,
            };
            handler.handle(&cx, msg).await?;
            deadline(tx.commit()).await?;
            Ok(Applied::Done)
        }
    }
}

async fn ack(d: &Delivery) {
    // A failed ack means the channel is gone: the broker redelivers, the inbox absorbs it.
    let _ = tokio::time::timeout(RPC_TIMEOUT, d.acker.ack(BasicAckOptions::default())).await;
}

/// Sends the message to the dead-letter exchange, records it in the inbox, acks it.
async fn dead_letter(shared: &Shared, d: &Delivery, msg: Option<&Message>, reason: &str) {
    let cfg = &shared.cfg;
    if !publish_dead(shared, d, reason).await {
        return;
    }
    if let Some(msg) = msg {
        let advance = cfg
            .ordered
            .as_ref()
            .is_some_and(|o| o.on_gap == OnGap::Skip);
        let recorded = async {
            let client = deadline(shared.pool.get()).await?;
            inbox::dead(
                &**client,
                &cfg.name,
                &msg.event_ref(cfg.ordered.is_some()),
                reason,
                advance,
            )
            .await
        }
        .await;
        if let Err(e) = recorded {
            tracing::warn!(target: "outbox_relay::consumer", error = %e, event_id = %msg.event_id, "dead-lettered message not recorded in the inbox; a later copy will be handled again");
        }
    }
    let id = d
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str().to_owned())
        .unwrap_or_default();
    events::dead_lettered(&cfg.name, &id, reason);
    ack(d).await;
}

/// Publishes a copy to the dead-letter exchange; false if it was not confirmed (then the
/// original has been requeued after a delay).
async fn publish_dead(shared: &Shared, d: &Delivery, reason: &str) -> bool {
    let cfg = &shared.cfg;
    let mut extra = FieldTable::default();
    extra.insert(H_DEAD_REASON.into(), long_string(reason));
    extra.insert(H_DEAD_CONSUMER.into(), long_string(&cfg.name));
    let routing_key = original_routing_key(d);
    let props = with_headers(d, &routing_key, extra);
    match publish_confirmed(shared, &cfg.dead_letter_exchange(), &routing_key, d, props).await {
        Ok(()) => true,
        Err(e) => {
            hold_and_requeue(shared, d, &e).await;
            false
        }
    }
}

/// Publishes a copy to the retry queue for `delay`, then acks the original.
async fn republish_delayed(shared: &Shared, d: &Delivery, delay: Duration, extra: FieldTable) {
    let routing_key = original_routing_key(d);
    let props = with_headers(d, &routing_key, extra);
    let queue = shared.cfg.retry_queue(delay);
    match publish_confirmed(shared, "", &queue, d, props).await {
        Ok(()) => ack(d).await,
        Err(e) => hold_and_requeue(shared, d, &e).await,
    }
}

/// The broker would not take the copy: keep the original for a while (so the queue does not
/// spin), then give it back for redelivery.
async fn hold_and_requeue(shared: &Shared, d: &Delivery, error: &str) {
    events::republish_failed(&shared.cfg.name, &error);
    tokio::time::sleep(shared.cfg.retry_min).await;
    let _ = tokio::time::timeout(
        RPC_TIMEOUT,
        d.acker.nack(BasicNackOptions {
            requeue: true,
            multiple: false,
        }),
    )
    .await;
}

async fn publish_confirmed(
    shared: &Shared,
    exchange: &str,
    routing_key: &str,
    d: &Delivery,
    props: BasicProperties,
) -> Result<(), String> {
    let channel = shared.publisher.lock().await;
    let publish = async {
        let confirm = channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &d.data,
                props,
            )
            .await
            .map_err(|e| e.to_string())?;
        match confirm.await.map_err(|e| e.to_string())? {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(format!(
                "unroutable: nothing bound for '{routing_key}' at '{exchange}'"
            )),
            Confirmation::Nack(_) => Err("nacked by the broker".into()),
            Confirmation::NotRequested => Err("publish channel is not in confirm mode".into()),
        }
    };
    match tokio::time::timeout(RPC_TIMEOUT, publish).await {
        Ok(r) => r,
        Err(_) => Err("no confirm in time".into()),
    }
}

fn original_routing_key(d: &Delivery) -> String {
    header_string(d, H_ROUTING_KEY).unwrap_or_else(|| d.routing_key.as_str().to_owned())
}

/// The delivery's properties with its headers plus `extra` (and the original routing key).
fn with_headers(d: &Delivery, routing_key: &str, extra: FieldTable) -> BasicProperties {
    let mut headers = d.properties.headers().clone().unwrap_or_default();
    headers.insert(H_ROUTING_KEY.into(), long_string(routing_key));
    for (k, v) in extra.inner() {
        headers.insert(k.clone(), v.clone());
    }
    d.properties.clone().with_headers(headers)
}

fn header<'a>(d: &'a Delivery, name: &str) -> Option<&'a AMQPValue> {
    d.properties.headers().as_ref()?.inner().get(name)
}

fn header_string(d: &Delivery, name: &str) -> Option<String> {
    match header(d, name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

fn header_i64(d: &Delivery, name: &str) -> Option<i64> {
    header_value_i64(header(d, name)?)
}

fn json_of(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::LongString(s) => {
            Value::String(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_owned()),
        AMQPValue::Float(f) => serde_json::json!(f),
        AMQPValue::Double(f) => serde_json::json!(f),
        AMQPValue::Timestamp(t) => serde_json::json!(t),
        AMQPValue::FieldTable(t) => Value::Object(
            t.inner()
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), json_of(v)))
                .collect(),
        ),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(json_of).collect()),
        AMQPValue::Void => Value::Null,
        other => match header_value_i64(other) {
            Some(n) => serde_json::json!(n),
            None => Value::String(format!("{other:?}")),
        },
    }
}

fn header_value_i64(v: &AMQPValue) -> Option<i64> {
    match v {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        _ => None,
    }
}

/// The handler's view of a delivery; an error is a reason to dead-letter it.
fn parse(d: &Delivery, ordered: bool) -> Result<Message, String> {
    let p = &d.properties;
    let event_id = p
        .message_id()
        .as_ref()
        .and_then(|s| Uuid::parse_str(s.as_str()).ok())
        .ok_or("no message_id holding a uuid: not an outbox event")?;
    let seq = header_i64(d, H_SEQ);
    if ordered && seq.is_none() {
        return Err(format!("no {H_SEQ} header: cannot be applied in order"));
    }
    let headers = p
        .headers()
        .as_ref()
        .map(|h| {
            h.inner()
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), json_of(v)))
                .collect()
        })
        .unwrap_or_default();
    Ok(Message {
        event_id,
        event_type: p
            .kind()
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .unwrap_or_default(),
        routing_key: original_routing_key(d),
        aggregate_type: header_string(d, H_AGGREGATE_TYPE).unwrap_or_default(),
        aggregate_id: header_string(d, H_AGGREGATE_ID).unwrap_or_default(),
        seq,
        headers,
        body: d.data.clone(),
        redelivered: d.redelivered,
        attempt: header_i64(d, H_ATTEMPT)
            .unwrap_or(0)
            .clamp(0, u32::MAX as i64) as u32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ConsumerConfig {
        let mut c = ConsumerConfig::new("billing", "outbox.events", &["#"]);
        c.retry_min = Duration::from_millis(100);
        c.retry_max = Duration::from_secs(2);
        c
    }

    #[test]
    fn retry_delays_double_up_to_the_max_and_match_declared_tiers() {
        let c = config();
        let delays: Vec<u64> = (1..=7)
            .map(|a| c.retry_delay(a).as_millis() as u64)
            .collect();
        assert_eq!(delays, [100, 200, 400, 800, 1600, 2000, 2000]);
        let tiers = c.delay_tiers();
        for a in 1..100 {
            assert!(
                tiers.contains(&c.retry_delay(a)),
                "attempt {a} has no queue"
            );
        }
        assert_eq!(tiers.len(), 6);
    }

    #[test]
    fn timeouts_shorter_than_what_they_guard_are_refused() {
        let mut c = config();
        assert!(c.validate(32).is_ok());
        c.handler_timeout = Duration::from_secs(20 * 60);
        assert_eq!(c.validate(32).unwrap_err().flag, "handler_timeout");

        let mut c = config();
        c.ordered = Some(Ordered {
            gap_timeout: Duration::from_secs(1),
            gap_retry: Duration::from_millis(100),
            on_gap: OnGap::Skip,
        });
        assert_eq!(c.validate(32).unwrap_err().flag, "gap_timeout");

        let c = config();
        let err = c.validate(8).unwrap_err();
        assert_eq!(err.flag, "prefetch");
        assert!(err.problem.contains("at least 32"), "{}", err.problem);
    }
}
