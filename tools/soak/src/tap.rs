//! The soak's own view of the broker: a tap queue bound to the exchange that records every
//! delivery in arrival order (the delivery checker's input: lost, unexpected, duplicates,
//! per-key order), and the duplicate publisher that sends copies of dispatched events
//! straight to the exchange, as a misbehaving producer or a replay would.
//!
//! Both use their own connections, direct to the broker: they observe and inject, they are
//! not under test. The tap's queue is durable and the tap connects again when its
//! connection is lost, so a broker restart costs it nothing (it may see a message twice:
//! a duplicate, never a loss).

use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Connection, ExchangeKind};
use outbox_kit::amqp::AmqpTarget;
use outbox_testkit::checker::Delivery;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

pub struct Tap {
    pub received: Arc<Mutex<Vec<Delivery>>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

/// Declares the exchange as the relay does (durable topic), so the tap can bind before the
/// first relay starts.
pub async fn declare_exchange(conn: &Connection, exchange: &str) -> anyhow::Result<()> {
    let ch = conn.create_channel().await?;
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    let _ = ch.close(200, "declared".into()).await;
    Ok(())
}

/// The tap queue's arguments: it deletes itself when nothing has used it for ten minutes
/// (a soak that was itself killed leaves nothing behind on a shared broker; a tap that
/// reconnects after a broker restart is back within seconds).
fn tap_queue_args() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(ShortString::from("x-expires"), AMQPValue::LongInt(600_000));
    args
}

/// Connects, declares and binds the tap queue, and consumes it; returns the consumer and
/// the connection and channel it lives on.
async fn subscribe(
    amqp: &AmqpTarget,
    exchange: &str,
    queue: &str,
) -> anyhow::Result<(Connection, lapin::Channel, lapin::Consumer)> {
    let conn = amqp.connect("outbox-soak-tap").await?;
    declare_exchange(&conn, exchange).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(TAP_PREFETCH, BasicQosOptions::default())
        .await?;
    // Durable, so it keeps what was routed to it across a restart of the broker (which
    // the soak injects on its own node) and across the tap's reconnects.
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        tap_queue_args(),
    )
    .await?;
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await?;
    let consumer = ch
        .basic_consume(
            queue.into(),
            "tap".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((conn, ch, consumer))
}

/// Messages the tap holds unacked at most: what a broker restart can deliver to it twice.
pub const TAP_PREFETCH: u16 = 1000;

impl Tap {
    /// Binds the tap queue (the first time directly, so nothing routed after this returns
    /// is missed), then consumes it, connecting again whenever the connection is lost.
    pub async fn start(amqp: &AmqpTarget, exchange: &str, queue: &str) -> anyhow::Result<Tap> {
        let first = subscribe(amqp, exchange, queue).await?;
        let received: Arc<Mutex<Vec<Delivery>>> = Arc::default();
        let stop = CancellationToken::new();
        let (sink, s) = (received.clone(), stop.clone());
        let (amqp, exchange, queue) = (amqp.clone(), exchange.to_owned(), queue.to_owned());
        let task = tokio::spawn(async move {
            let mut session = Some(first);
            while !s.is_cancelled() {
                let (conn, ch, mut consumer) = match session.take() {
                    Some(c) => c,
                    None => match subscribe(&amqp, &exchange, &queue).await {
                        Ok(c) => c,
                        Err(_) => {
                            tokio::select! {
                                _ = s.cancelled() => return,
                                _ = tokio::time::sleep(std::time::Duration::from_millis(300)) => continue,
                            }
                        }
                    },
                };
                let mut check = tokio::time::interval(std::time::Duration::from_millis(500));
                loop {
                    let d = tokio::select! {
                        _ = s.cancelled() => {
                            let _ = conn.close(200, "soak done".into()).await;
                            return;
                        }
                        d = consumer.next() => d,
                        // A consumer stream does not always end when its connection or
                        // channel does (a tap stuck after broker restarts was seen, once
                        // with its connection still up and 983 deliveries never taken):
                        // watch both.
                        _ = check.tick() => {
                            if conn.status().connected() && ch.status().connected() {
                                continue;
                            }
                            let _ = tokio::time::timeout(
                                std::time::Duration::from_secs(5),
                                conn.close(200, "tap channel gone".into()),
                            )
                            .await;
                            break;
                        }
                    };
                    // The connection went (a broker restart, a closed connection): what was
                    // not acked comes again on the next one.
                    let Some(Ok(d)) = d else { break };
                    sink.lock()
                        .unwrap()
                        .push(Delivery::from_amqp(&d.properties));
                    let acked = tokio::time::timeout(
                        std::time::Duration::from_secs(15),
                        d.ack(BasicAckOptions::default()),
                    )
                    .await;
                    if !matches!(acked, Ok(Ok(_))) {
                        // Not acked: it comes again on the next connection (a duplicate).
                        break;
                    }
                }
            }
        });
        Ok(Tap {
            received,
            stop,
            task,
        })
    }

    pub fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }

    pub fn deliveries(&self) -> Vec<Delivery> {
        self.received.lock().unwrap().clone()
    }

    /// Event ids delivered from position `from` on (positions are [`Tap::count`]s).
    pub fn ids_since(&self, from: usize) -> Vec<String> {
        let r = self.received.lock().unwrap();
        r.get(from..)
            .unwrap_or_default()
            .iter()
            .map(|d| d.event_id.clone())
            .collect()
    }

    pub async fn stop(&self) {
        self.stop.cancel();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while !self.task.is_finished() {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        })
        .await;
    }
}

const DISPATCHED: &str = "SELECT event_id, aggregate_type, aggregate_id, event_type, payload::text, seq,
                                 to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
                            FROM outbox_events
                           WHERE dispatched_at IS NOT NULL
                           ORDER BY random() LIMIT $1";

/// Publishes copies of `count` dispatched events, as the relay publishes them (same
/// message_id, headers and seq), with confirms. Returns how many the broker confirmed.
pub async fn publish_copies(
    amqp: &AmqpTarget,
    db: &Client,
    exchange: &str,
    count: usize,
) -> anyhow::Result<usize> {
    let rows = db.query(DISPATCHED, &[&(count as i64)]).await?;
    let conn = amqp.connect("outbox-soak-duplicator").await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut confirmed = 0;
    for r in &rows {
        let event_id: uuid::Uuid = r.get(0);
        let (atype, aid, etype): (String, String, String) = (r.get(1), r.get(2), r.get(3));
        let body: String = r.get(4);
        let seq: Option<i64> = r.get(5);
        let created: String = r.get(6);
        let mut h = FieldTable::default();
        let s = |v: &str| AMQPValue::LongString(LongString::from(v.as_bytes().to_vec()));
        h.insert(ShortString::from("x-outbox-aggregate-type"), s(&atype));
        h.insert(ShortString::from("x-outbox-aggregate-id"), s(&aid));
        if let Some(seq) = seq {
            h.insert(
                ShortString::from("x-outbox-seq"),
                AMQPValue::LongLongInt(seq),
            );
        }
        h.insert(ShortString::from("x-outbox-created-at"), s(&created));
        let props = BasicProperties::default()
            .with_message_id(event_id.to_string().into())
            .with_content_type("application/json".into())
            .with_type(etype.as_str().into())
            .with_delivery_mode(2)
            .with_headers(h);
        let confirm = ch
            .basic_publish(
                exchange.into(),
                format!("{atype}.{etype}").as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await?
            .await?;
        if confirm.is_ack() {
            confirmed += 1;
        }
    }
    let _ = conn.close(200, "copies sent".into()).await;
    Ok(confirmed)
}

/// Publishes one event that never committed (a random id, its own key, seq 1), as a relay
/// with a bug that published a rolled-back row would: the verdict's self-test.
pub async fn publish_stray(amqp: &AmqpTarget, exchange: &str) -> anyhow::Result<uuid::Uuid> {
    let id = uuid::Uuid::from_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos(),
    );
    let conn = amqp.connect("outbox-soak-planter").await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut h = FieldTable::default();
    let s = |v: &str| AMQPValue::LongString(LongString::from(v.as_bytes().to_vec()));
    h.insert(ShortString::from("x-outbox-aggregate-type"), s("acct"));
    h.insert(ShortString::from("x-outbox-aggregate-id"), s("planted"));
    h.insert(ShortString::from("x-outbox-seq"), AMQPValue::LongLongInt(1));
    let props = BasicProperties::default()
        .with_message_id(id.to_string().into())
        .with_content_type("application/json".into())
        .with_type("changed".into())
        .with_delivery_mode(2)
        .with_headers(h);
    ch.basic_publish(
        exchange.into(),
        "acct.changed".into(),
        BasicPublishOptions::default(),
        b"{}",
        props,
    )
    .await?
    .await?;
    let _ = conn.close(200, "planted".into()).await;
    Ok(id)
}
