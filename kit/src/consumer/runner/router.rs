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
//! is acked only after its copy was confirmed by the broker and not returned. A copy goes
//! to its partition queue by name through the default exchange with `mandatory`, so a
//! partition queue that is gone (or a copy nobody takes) comes back as a return, never
//! lands in an alternate exchange unseen; a copy that is returned, nacked or not confirmed
//! in time is published again after a backoff, holding its key (and only its key: other
//! keys, and other partitions, go on). Only a lost connection or publish channel ends the
//! router: the channel's close returns every unacked delivery to the intake in its order,
//! and the next router publishes them again (a copy twice in a partition queue is a
//! duplicate to the inbox).
//!
//! Returns: lapin hands a returned message to whichever confirm it resolves next, which
//! with many copies in flight can be another key's. So each copy carries a number of its
//! own (header [`COPY`]); every return seen is noted by that number, and a copy's fate is
//! decided only after every confirm that had resolved by then was read (the broker sends a
//! return before the confirm of the same publish).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use lapin::message::BasicReturnMessage;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Confirmation};
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, AmqpTarget};
use crate::backoff::Backoff;
use crate::consumer::events;

use super::message::{key_of, original_routing_key};
use super::settle::with_headers;
use super::{ConsumerConfig, RPC_TIMEOUT};

/// Intake deliveries in hand at most (published or waiting behind their key).
const PREFETCH: u16 = 512;

/// The header that numbers a router's copies, to tell which one a return belongs to.
pub const COPY: &str = "x-outbox-router-copy";

/// A copy's retries: from this delay, doubling, up to [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// One copy's end: its key and delivery, how many times it was tried, its number, what the
/// broker said, and the number of a copy whose return came with this confirm.
struct Copied {
    key: Option<(String, String)>,
    d: Delivery,
    tries: u32,
    id: u64,
    sent: Result<(), String>,
    returned: Option<u64>,
}

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
    // Per key, the deliveries waiting for the one in flight to be confirmed.
    let mut waiting: HashMap<Option<(String, String)>, VecDeque<Delivery>> = HashMap::new();
    let mut flying = FuturesUnordered::new();
    // Numbers of copies the broker returned, until their own confirm is read.
    let mut returned: HashSet<u64> = HashSet::new();
    let mut numbers = 0u64..;
    let copy = |key: Option<(String, String)>, d: Delivery, tries: u32, id: u64| {
        let publish = &publish;
        async move {
            let p = key.as_ref().map_or(0, |(t, id)| cfg.partition_of(t, id));
            let queue = cfg.partition_queue(p);
            if tries > 0 {
                let mut delay = Backoff::new(RETRY_MIN, RETRY_MAX);
                let delay = (0..tries).map(|_| delay.next_delay()).last();
                tokio::select! {
                    _ = stop.cancelled() => {
                        let sent = Err("stopping".to_owned());
                        return Copied { key, d, tries, id, sent, returned: None };
                    }
                    _ = tokio::time::sleep(delay.unwrap_or(RETRY_MIN)) => {}
                }
            }
            let (sent, returned) = forward(publish, &queue, &d, id).await;
            Copied {
                key,
                d,
                tries,
                id,
                sent,
                returned,
            }
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
            Some(first) = flying.next(), if !flying.is_empty() => {
                // Every confirm resolved so far, so that a return that came with another
                // copy's confirm is noted before its own copy is judged.
                let mut batch: Vec<Copied> = vec![first];
                while let Some(Some(c)) = flying.next().now_or_never() {
                    batch.push(c);
                }
                returned.extend(batch.iter().filter_map(|c: &Copied| c.returned));
                for c in batch {
                    let failed = match c.sent {
                        Err(e) => Some(e),
                        Ok(()) if returned.remove(&c.id) => Some(format!(
                            "returned: no partition queue took the copy (is {} there?)",
                            cfg.partition_queue(c.key.as_ref().map_or(0, |(t, id)| cfg.partition_of(t, id)))
                        )),
                        Ok(()) => None,
                    };
                    if let Some(why) = failed {
                        if !publish.status().connected() && ended.is_ok() {
                            ended = Err(format!("the router's publish channel closed: {why}"));
                            taking = false;
                        }
                        if taking {
                            if c.tries == 0 {
                                events::copy_failed(&cfg.name, &why);
                            }
                            let id = numbers.next().unwrap_or_default();
                            flying.push(copy(c.key, c.d, c.tries + 1, id));
                        }
                        // Else unacked: the channel's close returns it to the intake.
                        continue;
                    }
                    // A failed ack only means the delivery comes back and is routed again.
                    let _ = tokio::time::timeout(RPC_TIMEOUT, c.d.acker.ack(BasicAckOptions::default())).await;
                    let next = if taking {
                        waiting.get_mut(&c.key).and_then(VecDeque::pop_front)
                    } else {
                        None
                    };
                    match next {
                        Some(d) => {
                            let id = numbers.next().unwrap_or_default();
                            flying.push(copy(c.key, d, 0, id));
                        }
                        None => {
                            waiting.remove(&c.key);
                        }
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
                            let id = numbers.next().unwrap_or_default();
                            flying.push(copy(key, d, 0, id));
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

/// Publishes a copy of `d` (numbered `id`) to partition queue `queue` through the default
/// exchange with `mandatory`, and waits for the broker's confirm. The copy keeps the
/// original routing key in a header. Returns what the confirm said and the number of the
/// copy whose return came with it (not necessarily this one).
async fn forward(
    ch: &Channel,
    queue: &str,
    d: &Delivery,
    id: u64,
) -> (Result<(), String>, Option<u64>) {
    let mut extra = FieldTable::default();
    extra.insert(COPY.into(), AMQPValue::LongLongInt(id as i64));
    let props = with_headers(&d.properties, &original_routing_key(d), extra);
    let publish = async {
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &d.data,
                props,
            )
            .await?;
        confirm.await
    };
    let number = |r: Option<BasicReturnMessage>| {
        r.and_then(
            |r| match r.properties.headers().as_ref()?.inner().get(COPY)? {
                AMQPValue::LongLongInt(n) => Some(*n as u64),
                _ => None,
            },
        )
    };
    match tokio::time::timeout(RPC_TIMEOUT, publish).await {
        Ok(Ok(Confirmation::Ack(r))) => (Ok(()), number(r)),
        Ok(Ok(Confirmation::Nack(r))) => (
            Err(format!("the broker nacked a copy for {queue}")),
            number(r),
        ),
        Ok(Ok(Confirmation::NotRequested)) => {
            (Err("router channel not in confirm mode".into()), None)
        }
        Ok(Err(e)) => (Err(format!("publish to {queue}: {e}")), None),
        Err(_) => (
            Err(format!("no confirm in time for a copy to {queue}")),
            None,
        ),
    }
}
