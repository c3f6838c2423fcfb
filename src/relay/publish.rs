//! Publishing to RabbitMQ with publisher confirms. The only module that knows lapin.
//!
//! A [`Session`] is one AMQP connection with `--channels` lanes; each lane is a task that
//! owns a confirm-mode channel, publishes what the engine hands it and reports, per row,
//! how the broker settled it ([`Outcome`]).
//!
//! Invariant (the core one): a row is reported [`Outcome::Acked`] only for a broker ack
//! with no return for that row, matched by message_id. lapin pairs a returned message with
//! whichever confirm it resolves next (FIFO, and in hash order within a multiple-ack), so
//! the returned message a confirm carries may belong to another row. The lane therefore:
//! - records every returned message by its message_id, whatever confirm carried it;
//! - decides a round of confirms only after draining every confirm already resolved, so
//!   all confirms resolved before a given one are seen with it;
//! - treats an ack that carried nothing as clean unless its message_id was returned: at
//!   its resolution lapin's queue of returns was empty, so its own return, which always
//!   precedes its ack, was already handed to an earlier confirm that this lane has seen;
//! - holds an ack that carried another row's return as a suspect (its own return may still
//!   be queued) until a later round sees a confirm that carried nothing, and sends a probe
//!   (a message to an unbound routing key of the default exchange, not mandatory) when no
//!   other confirm would come;
//! - after a confirm timeout or channel error reports every later confirm as lost and
//!   ends: lapin may hand a return to a confirm we no longer watch;
//! - ends too when the broker has nacked every row for a confirm timeout with no ack
//!   between: a channel of a node that lost track of a queue's leader can nack for good,
//!   and only a new session gets past it (the engine then reconnects).
//!
//! Only this module can construct [`Acked`], the value that marks rows dispatched.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::{FutureExt, future::BoxFuture};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Confirmation, Connection, ExchangeKind};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use outbox_kit::amqp::{self, AmqpError, AmqpTarget, long_string, rpc};

use super::claim::ClaimedRow;
use super::hand::Key;

/// A broker ack without a return for this row. Only this module makes them; marking rows
/// dispatched takes nothing else.
#[derive(Debug)]
pub struct Acked {
    row_id: i64,
    seq: i64,
    body_bytes: usize,
}

impl Acked {
    pub fn row_id(&self) -> i64 {
        self.row_id
    }

    /// The number the row was published with (`x-outbox-seq`).
    pub fn seq(&self) -> i64 {
        self.seq
    }

    pub fn body_bytes(&self) -> usize {
        self.body_bytes
    }
}

/// How the broker settled one published row.
#[derive(Debug)]
pub enum Outcome {
    Acked(Acked),
    /// Unroutable: no queue is bound for the routing key.
    Returned {
        reply_code: u16,
        reply_text: String,
    },
    Nacked,
    TimedOut,
    /// The channel or connection failed before the row was confirmed.
    Lost(String),
}

#[derive(Debug)]
pub struct Settled {
    pub row_id: i64,
    pub key: Key,
    pub outcome: Outcome,
    /// From handing the message to the channel to the broker's answer.
    pub confirm_secs: f64,
}

/// Why a row cannot be published as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    TooLarge { bytes: usize, limit: usize },
    BadHeader(String),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::TooLarge { bytes, limit } => write!(
                f,
                "message too large: {bytes} bytes, more than --max-message-bytes {limit}"
            ),
            Refusal::BadHeader(why) => write!(f, "refused header: {why}"),
        }
    }
}

/// A message ready to publish (lapin's types stay in this module).
pub struct Prepared {
    row_id: i64,
    seq: i64,
    key: Key,
    event_id: String,
    routing_key: ShortString,
    body: Arc<str>,
    body_bytes: usize,
    properties: BasicProperties,
}

const RESERVED_PREFIX: &str = "x-outbox-";

/// How messages are built beyond the contract's fixed parts.
#[derive(Clone, Debug, Default)]
pub struct MessageOptions {
    /// `--cloudevents`: add the CloudEvents AMQP binding headers with this `source`.
    pub cloudevents_source: Option<String>,
}

const CLOUDEVENTS_PREFIX: &str = "cloudevents:";

/// Builds the AMQP message for a row, per the contract (README, "Message published").
pub fn prepare(
    row: &ClaimedRow,
    max_message_bytes: usize,
    options: &MessageOptions,
) -> Result<Prepared, Refusal> {
    let Some(body) = row.body.clone() else {
        return Err(Refusal::TooLarge {
            bytes: row.body_bytes,
            limit: max_message_bytes,
        });
    };
    let mut size = body.len() + row.routing_key.len() + 128;
    // Most rows carry no headers of their own: skip the JSON parse for them.
    let user: serde_json::Map<String, Value> = if row.headers == "{}" {
        serde_json::Map::new()
    } else {
        match serde_json::from_str(&row.headers) {
            Ok(Value::Object(m)) => m,
            _ => return Err(Refusal::BadHeader("headers are not a JSON object".into())),
        }
    };
    let mut headers = FieldTable::default();
    for (name, value) in user {
        if options.cloudevents_source.is_some()
            && name.to_ascii_lowercase().starts_with(CLOUDEVENTS_PREFIX)
        {
            continue; // set below from the row's columns
        }
        let upper = name.to_ascii_uppercase();
        let lower = name.to_ascii_lowercase();
        if upper == "CC"
            || upper == "BCC"
            || lower.starts_with(RESERVED_PREFIX)
            || lower == "traceparent"
            || lower == "tracestate"
        {
            return Err(Refusal::BadHeader(format!(
                "'{name}' is a reserved header name"
            )));
        }
        if name.is_empty() || name.len() > 255 {
            return Err(Refusal::BadHeader(
                "header names must be 1 to 255 bytes".into(),
            ));
        }
        size += name.len() + json_size(&value);
        headers.insert(name.into(), amqp_value(value));
    }
    let mut put = |name: &str, value: AMQPValue| {
        headers.insert(name.into(), value);
    };
    put("x-outbox-aggregate-type", long_string(&row.aggregate_type));
    put("x-outbox-aggregate-id", long_string(&row.aggregate_id));
    put("x-outbox-seq", AMQPValue::LongLongInt(row.seq));
    put("x-outbox-created-at", long_string(&row.created_text));
    if let Some(source) = &options.cloudevents_source {
        // The CloudEvents AMQP binding: attributes as `cloudEvents:`-prefixed headers
        // (content type is the message property). A user header of the same name is
        // replaced: these describe the event the relay publishes.
        put("cloudEvents:specversion", long_string("1.0"));
        put("cloudEvents:id", long_string(&row.event_id.to_string()));
        put("cloudEvents:type", long_string(&row.event_type));
        put("cloudEvents:source", long_string(source));
        put(
            "cloudEvents:subject",
            long_string(&format!("{}/{}", row.aggregate_type, row.aggregate_id)),
        );
        put("cloudEvents:time", long_string(&row.created_text));
        size += 256 + source.len() + row.event_type.len();
    }
    if let Some(tp) = &row.traceparent {
        put("traceparent", long_string(tp));
    }
    if let Some(ts) = &row.tracestate {
        put("tracestate", long_string(ts));
    }
    size += row.aggregate_type.len() + row.aggregate_id.len() + 128;
    size += row.traceparent.as_ref().map_or(0, String::len)
        + row.tracestate.as_ref().map_or(0, String::len);
    if size > max_message_bytes {
        return Err(Refusal::TooLarge {
            bytes: size,
            limit: max_message_bytes,
        });
    }
    for (what, s) in [
        ("routing key", &row.routing_key),
        ("event_type", &row.event_type),
    ] {
        if s.len() > 255 {
            return Err(Refusal::BadHeader(format!(
                "{what} is longer than 255 bytes"
            )));
        }
    }
    let event_id = row.event_id.to_string();
    let properties = BasicProperties::default()
        .with_message_id(event_id.as_str().into())
        .with_content_type("application/json".into())
        .with_type(row.event_type.as_str().into())
        .with_timestamp(row.created_epoch.max(0.0) as u64)
        .with_delivery_mode(2)
        .with_headers(headers);
    Ok(Prepared {
        row_id: row.id,
        seq: row.seq,
        key: Key::of(row),
        event_id,
        routing_key: row.routing_key.as_str().into(),
        body_bytes: row.body_bytes,
        body,
        properties,
    })
}

fn json_size(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len() + 5,
        Value::Array(a) => a.iter().map(json_size).sum::<usize>() + 5,
        Value::Object(o) => {
            o.iter()
                .map(|(k, v)| k.len() + 1 + json_size(v))
                .sum::<usize>()
                + 5
        }
        _ => 9,
    }
}

fn amqp_value(v: Value) -> AMQPValue {
    match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => AMQPValue::LongString(LongString::from(s.into_bytes())),
        Value::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.into_iter().map(amqp_value).collect::<Vec<_>>(),
        )),
        Value::Object(o) => {
            let mut t = FieldTable::default();
            for (k, v) in o {
                if k.len() <= 255 {
                    t.insert(k.into(), amqp_value(v));
                }
            }
            AMQPValue::FieldTable(t)
        }
    }
}

/// Settings of one AMQP session.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    pub exchange: String,
    pub declare_exchange: bool,
    pub channels: usize,
    pub confirm_timeout: Duration,
    pub connection_name: String,
}

/// A batch of outcomes from one lane of session `generation`.
pub type SettledBatch = (u64, Vec<Settled>);

/// The end of a session, raised once by whatever ended it; the first reason given is kept.
#[derive(Clone, Default)]
struct Lost {
    token: CancellationToken,
    why: Arc<std::sync::OnceLock<String>>,
}

impl Lost {
    fn raise(&self, why: impl Into<String>) {
        let _ = self.why.set(why.into());
        self.token.cancel();
    }

    async fn raised(&self) {
        self.token.cancelled().await
    }

    fn is_raised(&self) -> bool {
        self.token.is_cancelled()
    }

    fn why(&self) -> &str {
        self.why.get().map_or("unknown", String::as_str)
    }
}

/// One AMQP connection and its publishing lanes.
pub struct Session {
    conn: Connection,
    lanes: Vec<mpsc::UnboundedSender<Prepared>>,
    lost: Lost,
    generation: u64,
}

impl Session {
    /// Connects, declares the exchange (unless told not to) and opens the lanes.
    pub async fn open(
        target: &AmqpTarget,
        config: &SessionConfig,
        generation: u64,
        settled: mpsc::UnboundedSender<SettledBatch>,
    ) -> Result<Session, AmqpError> {
        let conn = target.connect(&config.connection_name).await?;
        let lost = Lost::default();
        let setup = async {
            let ch = rpc("channel.open", conn.create_channel()).await?;
            amqp::declare_exchange(
                &ch,
                &config.exchange,
                ExchangeKind::Topic,
                !config.declare_exchange,
            )
            .await?;
            let _ = rpc("channel.close", ch.close(200, "ok".into())).await;
            let mut lanes = Vec::with_capacity(config.channels);
            for lane_no in 0..config.channels {
                let ch = rpc("channel.open", conn.create_channel()).await?;
                rpc(
                    "confirm.select",
                    ch.confirm_select(ConfirmSelectOptions::default()),
                )
                .await?;
                let (tx, rx) = mpsc::unbounded_channel();
                let lane = Lane {
                    channel: ch,
                    exchange: config.exchange.as_str().into(),
                    probe_key: format!("outbox-relay.probe.{}.{lane_no}", std::process::id())
                        .into(),
                    confirm_timeout: config.confirm_timeout,
                    generation,
                    settled: settled.clone(),
                    lost: lost.clone(),
                };
                tokio::spawn(lane.run(rx));
                lanes.push(tx);
            }
            Ok::<_, AmqpError>(lanes)
        };
        let lanes = match setup.await {
            Ok(lanes) => lanes,
            Err(e) => {
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    conn.close(320, "setup failed".into()),
                )
                .await;
                return Err(e);
            }
        };
        // Connection-level failures (heartbeat timeout, broker closing us) end the session.
        let events = conn.events_listener();
        let watch = lost.clone();
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            loop {
                tokio::select! {
                    _ = watch.raised() => return,
                    ev = events.next() => match ev {
                        Some(lapin::Event::Error(e)) => {
                            watch.raise(format!("connection error: {e}"));
                            return;
                        }
                        Some(_) => {}
                        None => { watch.raise("connection closed"); return; }
                    }
                }
            }
        });
        Ok(Session {
            conn,
            lanes,
            lost,
            generation,
        })
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Hands a message to the lane for its partition (a key always uses the same lane).
    pub fn publish(&self, partition: u8, message: Prepared) {
        let lane = partition as usize % self.lanes.len();
        if self.lanes[lane].send(message).is_err() {
            self.lost.raise("a publishing lane had ended");
        }
    }

    /// Resolves when the connection or any lane failed.
    pub async fn lost(&self) {
        self.lost.raised().await
    }

    pub fn is_lost(&self) -> bool {
        self.lost.is_raised()
    }

    /// Why the session ended (the first failure seen), once [`Session::is_lost`].
    pub fn lost_why(&self) -> &str {
        self.lost.why()
    }

    /// Closes the connection; lanes report what was in flight as lost.
    pub async fn close(self) {
        self.lost.raise("closed by the relay");
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            self.conn.close(200, "outbox-relay closing".into()),
        )
        .await;
    }
}

fn settle(p: Pending, outcome: Outcome) -> Settled {
    Settled {
        row_id: p.row_id,
        confirm_secs: p.sent_at.elapsed().as_secs_f64(),
        key: p.key,
        outcome,
    }
}

impl Acked {
    fn of(p: &Pending) -> Acked {
        Acked {
            row_id: p.row_id,
            seq: p.seq,
            body_bytes: p.body_bytes,
        }
    }
}

/// What a lane is waiting on for one publish.
struct Pending {
    row_id: i64,
    seq: i64,
    key: Key,
    event_id: String,
    body_bytes: usize,
    sent_at: std::time::Instant,
}

/// A returned message, reduced to what matching and reporting need.
struct ReturnInfo {
    message_id: Option<String>,
    reply_code: u16,
    reply_text: String,
}

enum ConfirmResult {
    Ack(Option<ReturnInfo>),
    Nack(Option<ReturnInfo>),
    NotRequested,
    Failed(String),
    TimedOut,
}

impl ConfirmResult {
    fn of(c: lapin::Result<Confirmation>) -> ConfirmResult {
        let info = |m: lapin::message::BasicReturnMessage| ReturnInfo {
            message_id: m
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned()),
            reply_code: m.reply_code,
            reply_text: m.reply_text.as_str().to_owned(),
        };
        match c {
            Ok(Confirmation::Ack(m)) => ConfirmResult::Ack(m.map(info)),
            Ok(Confirmation::Nack(m)) => ConfirmResult::Nack(m.map(info)),
            Ok(Confirmation::NotRequested) => ConfirmResult::NotRequested,
            Err(e) => ConfirmResult::Failed(e.to_string()),
        }
    }

    fn returned(&self) -> Option<&ReturnInfo> {
        match self {
            ConfirmResult::Ack(r) | ConfirmResult::Nack(r) => r.as_ref(),
            _ => None,
        }
    }
}

struct Resolved {
    pending: Option<Pending>, // None for a probe
    result: ConfirmResult,
    round: u64,
}

/// Since when a lane has had nothing but nacks for its rows.
#[derive(Default)]
struct NackRun {
    since: Option<std::time::Instant>,
}

impl NackRun {
    /// Counts a round of outcomes; true once every row settled for `limit` was nacked.
    /// An ack (returned or not) ends the run; timeouts and losses end the lane anyway.
    fn for_good(&mut self, out: &[Settled], now: std::time::Instant, limit: Duration) -> bool {
        for s in out {
            match s.outcome {
                Outcome::Nacked => {
                    self.since.get_or_insert(now);
                }
                Outcome::Acked(_) | Outcome::Returned { .. } => self.since = None,
                Outcome::TimedOut | Outcome::Lost(_) => {}
            }
        }
        self.since.is_some_and(|t| now.duration_since(t) >= limit)
    }
}

struct Lane {
    channel: lapin::Channel,
    exchange: ShortString,
    probe_key: ShortString,
    confirm_timeout: Duration,
    generation: u64,
    settled: mpsc::UnboundedSender<SettledBatch>,
    lost: Lost,
}

type ConfirmFuture = BoxFuture<'static, (Option<Pending>, ConfirmResult)>;

/// Returned messages seen on a lane, by message_id, until the row they belong to settles.
#[derive(Default)]
struct Returns {
    by_id: HashMap<String, (u16, String)>,
    order: VecDeque<String>,
}

impl Returns {
    fn record(&mut self, message: &ReturnInfo) {
        let Some(id) = message.message_id.clone() else {
            return;
        };
        self.by_id
            .insert(id.clone(), (message.reply_code, message.reply_text.clone()));
        self.order.push_back(id);
        // Returns for rows that already settled otherwise (timed out, lost) are never
        // claimed; keep a bounded memory of them.
        while self.order.len() > 100_000 {
            if let Some(old) = self.order.pop_front() {
                self.by_id.remove(&old);
            }
        }
    }

    fn take(&mut self, id: &str) -> Option<(u16, String)> {
        self.by_id.remove(id)
    }
}

impl Lane {
    async fn run(self, mut rx: mpsc::UnboundedReceiver<Prepared>) {
        let mut in_flight: FuturesUnordered<ConfirmFuture> = FuturesUnordered::new();
        let mut returns = Returns::default();
        let mut suspects: Vec<Resolved> = Vec::new();
        let mut probe_out = false;
        let mut round: u64 = 0;
        let mut broken: Option<String> = None;
        let mut nacks = NackRun::default();
        loop {
            if broken.is_some() {
                break;
            }
            if !suspects.is_empty() && in_flight.is_empty() && !probe_out {
                match self.send_probe().await {
                    Ok(fut) => {
                        in_flight.push(fut);
                        probe_out = true;
                    }
                    Err(e) => broken = Some(e),
                }
                continue;
            }
            tokio::select! {
                biased;
                _ = self.lost.raised() => { broken = Some("amqp session closed".into()); }
                Some((pending, result)) = in_flight.next(), if !in_flight.is_empty() => {
                    round += 1;
                    let mut batch = vec![Resolved { pending, result, round }];
                    while let Some(Some((pending, result))) = in_flight.next().now_or_never() {
                        batch.push(Resolved { pending, result, round });
                    }
                    if batch.iter().any(|r| r.pending.is_none()) {
                        probe_out = false;
                    }
                    let out = self.decide(batch, &mut suspects, &mut returns, &mut broken);
                    if nacks.for_good(&out, std::time::Instant::now(), self.confirm_timeout) {
                        let limit = self.confirm_timeout;
                        broken = Some(format!("the broker nacked every publish for {limit:?}"));
                    }
                    self.send(out);
                }
                msg = rx.recv() => match msg {
                    Some(message) => match self.publish(message).await {
                        Ok(fut) => in_flight.push(fut),
                        Err(e) => broken = Some(e),
                    },
                    None => { broken = Some("amqp session closed".into()); }
                }
            }
        }
        // The lane is done. Rows still unsettled are failed by the engine when it sees the
        // session lost; confirms still outstanding may carry returns we would never see, so
        // none of them may count as acked.
        self.lost
            .raise(broken.unwrap_or_else(|| "amqp session closed".into()));
        drop(in_flight);
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            self.channel.close(200, "lane closed".into()),
        )
        .await;
    }

    fn send(&self, out: Vec<Settled>) {
        if !out.is_empty() {
            let _ = self.settled.send((self.generation, out));
        }
    }

    async fn publish(&self, message: Prepared) -> Result<ConfirmFuture, String> {
        let Prepared {
            row_id,
            seq,
            key,
            event_id,
            routing_key,
            body,
            body_bytes,
            properties,
        } = message;
        let pending = Pending {
            row_id,
            seq,
            key,
            event_id,
            body_bytes,
            sent_at: std::time::Instant::now(),
        };
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let publish = self.channel.basic_publish(
            self.exchange.clone(),
            routing_key,
            options,
            body.as_bytes(),
            properties,
        );
        let confirm = match tokio::time::timeout(self.confirm_timeout, publish).await {
            Ok(Ok(confirm)) => confirm,
            Ok(Err(e)) => return Err(format!("publish failed: {e}")),
            Err(_) => return Err("publish not written in time".into()),
        };
        let timeout = self.confirm_timeout;
        Ok(async move {
            let result = match tokio::time::timeout(timeout, confirm).await {
                Ok(c) => ConfirmResult::of(c),
                Err(_) => ConfirmResult::TimedOut,
            };
            (Some(pending), result)
        }
        .boxed())
    }

    async fn send_probe(&self) -> Result<ConfirmFuture, String> {
        let options = BasicPublishOptions {
            mandatory: false,
            immediate: false,
        };
        let publish = self.channel.basic_publish(
            "".into(),
            self.probe_key.clone(),
            options,
            b"",
            BasicProperties::default(),
        );
        let confirm = match tokio::time::timeout(self.confirm_timeout, publish).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(format!("probe publish failed: {e}")),
            Err(_) => return Err("probe not written in time".into()),
        };
        let timeout = self.confirm_timeout;
        Ok(async move {
            let result = match tokio::time::timeout(timeout, confirm).await {
                Ok(c) => ConfirmResult::of(c),
                Err(_) => ConfirmResult::TimedOut,
            };
            (None, result)
        }
        .boxed())
    }

    /// Settles a round of resolved confirms (see the module docs for the rule).
    fn decide(
        &self,
        batch: Vec<Resolved>,
        suspects: &mut Vec<Resolved>,
        returns: &mut Returns,
        broken: &mut Option<String>,
    ) -> Vec<Settled> {
        let round = batch.first().map_or(0, |r| r.round);
        // First record every return this round carried, whichever confirm carried it.
        for r in &batch {
            if let Some(m) = r.result.returned() {
                returns.record(m);
            }
        }
        let mut out = Vec::new();
        let mut clean_seen = false;
        for r in batch {
            let carried = r.result.returned().is_some();
            if matches!(
                r.result,
                ConfirmResult::Ack(None) | ConfirmResult::Nack(None)
            ) {
                clean_seen = true;
            }
            let Some(pending) = r.pending.as_ref() else {
                continue;
            };
            let outcome = match &r.result {
                ConfirmResult::TimedOut => {
                    *broken = Some("a confirm timed out".into());
                    Some(Outcome::TimedOut)
                }
                ConfirmResult::Failed(e) => {
                    *broken = Some(e.clone());
                    Some(Outcome::Lost(e.clone()))
                }
                ConfirmResult::NotRequested => {
                    *broken = Some("channel not in confirm mode".into());
                    Some(Outcome::Lost("channel not in confirm mode".into()))
                }
                ConfirmResult::Nack(_) => Some(Outcome::Nacked),
                ConfirmResult::Ack(_) => {
                    if let Some((reply_code, reply_text)) = returns.take(&pending.event_id) {
                        Some(Outcome::Returned {
                            reply_code,
                            reply_text,
                        })
                    } else if !carried {
                        Some(Outcome::Acked(Acked::of(pending)))
                    } else {
                        None // carried another row's return: its own may still be queued
                    }
                }
            };
            match outcome {
                Some(outcome) => out.push(settle(r.pending.expect("checked above"), outcome)),
                None => suspects.push(r),
            }
        }
        // Suspects from earlier rounds: their own return has shown up, or a confirm that
        // carried nothing resolved after them, which proves no return of theirs is queued.
        let mut still = Vec::new();
        for s in suspects.drain(..) {
            let p = s.pending.as_ref().expect("suspects are rows");
            if let Some((reply_code, reply_text)) = returns.take(&p.event_id) {
                let outcome = Outcome::Returned {
                    reply_code,
                    reply_text,
                };
                out.push(settle(s.pending.expect("checked"), outcome));
            } else if clean_seen && s.round < round {
                let p = s.pending.expect("checked");
                let acked = Outcome::Acked(Acked::of(&p));
                out.push(settle(p, acked));
            } else {
                still.push(s);
            }
        }
        *suspects = still;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_nacks_for_a_confirm_timeout_end_the_lane() {
        let settled = |outcome| Settled {
            row_id: 1,
            key: Key {
                aggregate_type: "order".into(),
                aggregate_id: "1".into(),
            },
            outcome,
            confirm_secs: 0.0,
        };
        let acked = || {
            settled(Outcome::Acked(Acked {
                row_id: 1,
                seq: 1,
                body_bytes: 1,
            }))
        };
        let limit = Duration::from_secs(5);
        let t0 = std::time::Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut run = NackRun::default();
        assert!(!run.for_good(&[settled(Outcome::Nacked)], at(0), limit));
        assert!(!run.for_good(&[settled(Outcome::Nacked)], at(4), limit));
        // An ack in the same round as nacks ends the run.
        assert!(!run.for_good(&[settled(Outcome::Nacked), acked()], at(5), limit));
        assert!(!run.for_good(&[settled(Outcome::Nacked)], at(6), limit));
        assert!(!run.for_good(&[], at(10), limit));
        assert!(run.for_good(&[settled(Outcome::Nacked)], at(11), limit));
        // A return is the broker's answer too: not a nack run.
        let mut run = NackRun::default();
        assert!(!run.for_good(&[settled(Outcome::Nacked)], at(0), limit));
        let returned = Outcome::Returned {
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
        };
        assert!(!run.for_good(&[settled(returned)], at(6), limit));
        assert!(!run.for_good(&[settled(Outcome::Nacked)], at(7), limit));
    }

    #[test]
    fn prepare_follows_the_contract() {
        let mut row = ClaimedRow::for_test(7, "order", "42", 3);
        row.headers = r#"{"tenant": "acme", "n": 5, "ok": true}"#.into();
        row.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
        let p = prepare(&row, 1 << 20, &MessageOptions::default()).unwrap();
        assert_eq!(
            p.properties.message_id().as_ref().unwrap().as_str(),
            row.event_id.to_string()
        );
        assert_eq!(
            p.properties.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        assert_eq!(p.properties.kind().as_ref().unwrap().as_str(), "created");
        assert_eq!(*p.properties.delivery_mode(), Some(2));
        let h = p.properties.headers().as_ref().unwrap().inner();
        assert_eq!(h.get("x-outbox-seq"), Some(&AMQPValue::LongLongInt(3)));
        assert_eq!(h.get("n"), Some(&AMQPValue::LongLongInt(5)));
        assert_eq!(h.get("ok"), Some(&AMQPValue::Boolean(true)));
        assert!(h.contains_key("traceparent"));
        assert!(h.contains_key("x-outbox-created-at"));
        assert_eq!(&*p.body, "{}");
    }

    #[test]
    fn cloudevents_headers_come_from_the_row() {
        let mut row = ClaimedRow::for_test(7, "order", "42", 3);
        row.headers = r#"{"cloudEvents:type": "forged"}"#.into();
        let options = MessageOptions {
            cloudevents_source: Some("/shop".into()),
        };
        let p = prepare(&row, 1 << 20, &options).unwrap();
        let h = p.properties.headers().as_ref().unwrap().inner();
        let text = |k: &str| match h.get(k) {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(text("cloudEvents:specversion"), "1.0");
        assert_eq!(text("cloudEvents:id"), row.event_id.to_string());
        assert_eq!(text("cloudEvents:type"), "created");
        assert_eq!(text("cloudEvents:source"), "/shop");
        assert_eq!(text("cloudEvents:subject"), "order/42");
        assert_eq!(text("cloudEvents:time"), row.created_text);
        let plain = prepare(&row, 1 << 20, &MessageOptions::default()).unwrap();
        assert!(
            !plain
                .properties
                .headers()
                .as_ref()
                .unwrap()
                .inner()
                .contains_key("cloudEvents:id")
        );
    }

    #[test]
    fn reserved_headers_and_oversize_are_refused() {
        let mut row = ClaimedRow::for_test(7, "order", "42", 1);
        row.headers = r#"{"CC": "other.key"}"#.into();
        assert!(matches!(
            prepare(&row, 1 << 20, &MessageOptions::default()),
            Err(Refusal::BadHeader(_))
        ));
        row.headers = r#"{"X-Outbox-Seq": 1}"#.into();
        assert!(matches!(
            prepare(&row, 1 << 20, &MessageOptions::default()),
            Err(Refusal::BadHeader(_))
        ));
        row.headers = "{}".into();
        row.body = None;
        row.body_bytes = 5_000_000;
        assert!(matches!(
            prepare(&row, 1 << 20, &MessageOptions::default()),
            Err(Refusal::TooLarge { .. })
        ));
        row.body = Some("x".repeat(1000).into());
        assert!(matches!(
            prepare(&row, 600, &MessageOptions::default()),
            Err(Refusal::TooLarge { .. })
        ));
    }
}
