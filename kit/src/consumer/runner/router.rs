//! An ordered group's router: moves the group's events from its intake queue to the
//! partition queue of their key ([`ConsumerConfig::partition_of`]), one key's events one
//! after another in the intake's order. Every member runs one; the intake queue is
//! single-active-consumer, so one routes at a time and another takes over when its channel
//! closes (or its connection dies). It has a connection of its own: a broker under a
//! memory or disk alarm blocks the connections that publish, and the member's partition
//! consumers must still be able to ack (which frees what the alarm is about).
//!
//! Why a router of our own rather than the broker's consistent-hash exchange: that
//! exchange keeps its ring in memory and, after a node restart, rebuilds it from bindings
//! recovered in parallel, in whatever order they finish. Measured on RabbitMQ 3.10.8: six
//! restarts of one node gave five different rings for eight partition queues. A key then
//! moves to another partition while its older events still wait in the old one, and its
//! newer events are applied first. A key's partition computed here never changes.
//!
//! Invariants: a key has at most one copy in flight (published, not yet confirmed); its
//! next event is published only after the broker confirmed the previous one, so its events
//! enter the partition queue in intake order even when a publish fails. An intake delivery
//! is acked only after its copy was confirmed. Any failure ends the router: the channel's
//! close returns every unacked delivery to the intake in its order, and the next router
//! publishes them again (a copy twice in a partition queue is a duplicate to the inbox).
//! No `mandatory` flag: lapin pairs a returned message with whichever confirm resolves
//! next, which with many publishes in flight can be another key's. The route exchange's
//! alternate exchange (the group's dead-letter exchange) catches a copy whose partition
//! queue was deleted, so it is never dropped unseen.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use futures_util::stream::{FuturesUnordered, StreamExt};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Confirmation};
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, AmqpTarget};

use super::message::{key_of, original_routing_key};
use super::settle::with_headers;
use super::{ConsumerConfig, RPC_TIMEOUT};

/// Intake deliveries in hand at most (published or waiting behind their key).
const PREFETCH: u16 = 512;

/// Routes until `stop` is cancelled or something fails; then waits for the copies in
/// flight, acks those confirmed, and closes its channels. Returns why it ended when not
/// asked to.
pub(super) async fn route(
    cfg: Arc<ConsumerConfig>,
    target: AmqpTarget,
    stop: CancellationToken,
) -> Result<(), String> {
    let name = format!("{} router", cfg.connection_name);
    let conn = tokio::select! {
        _ = stop.cancelled() => return Ok(()),
        c = target.connect(&name) => c.map_err(|e| e.to_string())?,
    };
    let ended = route_on(&cfg, &conn, &stop).await;
    let _ = tokio::time::timeout(RPC_TIMEOUT, conn.close(200, "router stopped".into())).await;
    ended
}

async fn route_on(
    cfg: &ConsumerConfig,
    conn: &lapin::Connection,
    stop: &CancellationToken,
) -> Result<(), String> {
    let lost = amqp::connection_lost(conn);
    let mut lost = std::pin::pin!(lost);
    let open = async {
        let consume = amqp::rpc("channel.open", conn.create_channel()).await?;
        let publish = amqp::rpc("channel.open", conn.create_channel()).await?;
        amqp::rpc(
            "confirm.select",
            publish.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        amqp::rpc(
            "basic.qos",
            consume.basic_qos(PREFETCH, BasicQosOptions::default()),
        )
        .await?;
        let consumer = amqp::rpc(
            "basic.consume",
            consume.basic_consume(
                cfg.intake_queue().as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
        Ok::<_, amqp::AmqpError>((consume, publish, consumer))
    };
    let (consume, publish, consumer) = open.await.map_err(|e| e.to_string())?;
    let mut consumer = std::pin::pin!(consumer);
    let exchange = cfg.route_exchange();
    // Per key, the deliveries waiting for the one in flight to be confirmed.
    let mut waiting: HashMap<Option<(String, String)>, VecDeque<Delivery>> = HashMap::new();
    let mut flying = FuturesUnordered::new();
    let copy = |key: Option<(String, String)>, d: Delivery| {
        let (publish, exchange) = (&publish, &exchange);
        async move {
            let p = key.as_ref().map_or(0, |(t, id)| cfg.partition_of(t, id));
            let sent = forward(publish, exchange, &cfg.partition_queue(p), &d).await;
            (key, d, sent)
        }
    };
    let mut taking = true;
    let mut ended: Result<(), String> = Ok(());
    loop {
        if !taking && flying.is_empty() {
            break;
        }
        tokio::select! {
            biased;
            _ = stop.cancelled(), if taking => taking = false,
            why = &mut lost, if taking => {
                taking = false;
                ended = Err(why);
            }
            Some((key, d, sent)) = flying.next(), if !flying.is_empty() => {
                let (d, sent): (Delivery, Result<(), String>) = (d, sent);
                if let Err(e) = sent {
                    // Nothing more of this key (or any other) goes out; the close below
                    // returns it and everything after it to the intake, in order.
                    if ended.is_ok() {
                        ended = Err(e);
                    }
                    taking = false;
                    continue;
                }
                // A failed ack only means the delivery comes back and is routed again.
                let _ = tokio::time::timeout(RPC_TIMEOUT, d.acker.ack(BasicAckOptions::default())).await;
                let next = if taking {
                    waiting.get_mut(&key).and_then(VecDeque::pop_front)
                } else {
                    None
                };
                match next {
                    Some(d) => flying.push(copy(key, d)),
                    None => {
                        waiting.remove(&key);
                    }
                }
            }
            d = consumer.next(), if taking => match d {
                Some(Ok(d)) => {
                    // Without the key headers the event cannot be ordered; it goes to
                    // partition 0, whose consumer dead-letters it.
                    let key = key_of(&d);
                    match waiting.get_mut(&key) {
                        Some(queue) if key.is_some() => queue.push_back(d),
                        _ => {
                            waiting.entry(key.clone()).or_default();
                            flying.push(copy(key, d));
                        }
                    }
                }
                Some(Err(e)) => {
                    taking = false;
                    ended = Err(e.to_string());
                }
                None => {
                    taking = false;
                    ended = Err("the broker cancelled the intake consumer".into());
                }
            },
        }
    }
    drop(flying);
    drop(waiting);
    // Closing (never basic.cancel) hands the intake over only now that nothing is in flight.
    let _ = tokio::time::timeout(RPC_TIMEOUT, consume.close(200, "router stopped".into())).await;
    let _ = tokio::time::timeout(RPC_TIMEOUT, publish.close(200, "router stopped".into())).await;
    ended
}

/// Publishes a copy of `d` to `queue` through the route exchange and waits for the
/// broker's confirm. The copy keeps the original routing key in a header.
async fn forward(ch: &Channel, exchange: &str, queue: &str, d: &Delivery) -> Result<(), String> {
    let props = with_headers(
        &d.properties,
        &original_routing_key(d),
        FieldTable::default(),
    );
    let publish = async {
        let confirm = ch
            .basic_publish(
                exchange.into(),
                queue.into(),
                BasicPublishOptions::default(),
                &d.data,
                props,
            )
            .await?;
        confirm.await
    };
    match tokio::time::timeout(RPC_TIMEOUT, publish).await {
        Ok(Ok(Confirmation::Ack(_))) => Ok(()),
        Ok(Ok(Confirmation::Nack(_))) => Err(format!("the broker nacked a copy for {queue}")),
        Ok(Ok(Confirmation::NotRequested)) => Err("router channel not in confirm mode".into()),
        Ok(Err(e)) => Err(format!("publish to {queue}: {e}")),
        Err(_) => Err(format!("no confirm in time for a copy to {queue}")),
    }
}
