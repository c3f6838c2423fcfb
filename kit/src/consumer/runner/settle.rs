//! How a message in hand ends: ack; a copy to a retry queue (unordered mode, transient
//! failure); a copy to the dead-letter exchange (terminal failure, too many attempts, no
//! outbox event); or, when the broker does not take the copy, held for `retry_min` and
//! nacked for redelivery (unordered mode; an ordered group retries the copy in place, see
//! `process`). Also the publish channel those copies go through ([`Publisher`]), and what
//! every message task shares ([`Shared`]: the settings, the pool and that channel).
//!
//! Invariants: an event is dead-lettered only after the inbox showed it is not recorded
//! ([`recorded_after_all`]): the last attempt's commit may have succeeded although the
//! attempt failed (a commit that timed out or lost its connection), and an event must never
//! be both applied and in the dead-letter queue. The original is acked only after its copy was confirmed (one publish at a
//! time on the shared publish channel, so a return belongs to that publish); a failed ack
//! costs nothing but a redelivery, which the inbox absorbs; a publish channel on which the
//! broker nacked every publish for `retry_max` is replaced by a new one, as the relay does
//! with a session that gets only nacks (a channel can nack for good after the node lost
//! track of a queue; only a new channel gets past it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::sync::Mutex;

use crate::amqp::long_string;
use crate::consumer::events;
use crate::consumer::inbox;
use crate::contract::headers::{
    ATTEMPT as H_ATTEMPT, DEAD_CONSUMER as H_DEAD_CONSUMER, DEAD_REASON as H_DEAD_REASON,
    ROUTING_KEY as H_ROUTING_KEY,
};
use crate::db::{DbError, deadline};

use super::message::original_routing_key;
use super::{ConsumerConfig, HandlerError, Message, RPC_TIMEOUT};

/// What every message task shares.
pub(super) struct Shared {
    pub(super) cfg: Arc<ConsumerConfig>,
    pub(super) pool: Pool,
    /// One publish at a time, each awaited to its confirm: lapin pairs a returned message
    /// with whichever confirm resolves next, so only a lone publish knows its own return.
    pub(super) publisher: Mutex<Publisher>,
}

/// What the inbox transaction ended with.
pub(super) enum Applied {
    Done,
    Duplicate,
}

/// The confirm-mode channel the runner publishes its copies on, and since when the broker
/// has answered nothing but nacks on it.
pub(super) struct Publisher {
    conn: Arc<Connection>,
    channel: Channel,
    nacked_since: Option<Instant>,
}

impl Publisher {
    pub(super) fn new(conn: Arc<Connection>, channel: Channel) -> Publisher {
        Publisher {
            conn,
            channel,
            nacked_since: None,
        }
    }

    /// Counts a nack; once nacks alone came for `limit`, opens a new confirm channel.
    async fn nacked(&mut self, consumer: &str, limit: Duration) {
        let since = *self.nacked_since.get_or_insert_with(Instant::now);
        if since.elapsed() < limit {
            return;
        }
        let fresh = async {
            let ch = self.conn.create_channel().await?;
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
            Ok::<_, lapin::Error>(ch)
        };
        if let Ok(Ok(ch)) = tokio::time::timeout(RPC_TIMEOUT, fresh).await {
            let old = std::mem::replace(&mut self.channel, ch);
            let _ = tokio::time::timeout(RPC_TIMEOUT, old.close(200, "only nacks".into())).await;
            self.nacked_since = None;
            events::publish_channel_replaced(consumer, since.elapsed().as_millis() as u64);
        }
    }
}

/// Settles an unordered message after the inbox transaction.
pub(super) async fn settle(
    shared: &Shared,
    d: &Delivery,
    msg: &Message,
    outcome: Result<Applied, HandlerError>,
) {
    let cfg = &shared.cfg;
    let event_id = msg.event_id.to_string();
    match outcome {
        Ok(_) => ack(d).await,
        Err(e) if e.is_transient() => {
            // A wait (an earlier effect of its order key, another live claim) spends no
            // attempt: the copy keeps its count and comes back after the next delay.
            let (attempt, delay_of) = if e.is_wait() {
                (msg.attempt, msg.attempt + 1)
            } else {
                (msg.attempt + 1, msg.attempt + 1)
            };
            if !e.is_wait() && cfg.max_attempts.is_some_and(|max| attempt >= max.get()) {
                let reason = format!("gave up after {attempt} attempts: {e}");
                dead_letter(shared, d, Some(msg), &reason).await;
                return;
            }
            let delay = cfg.retry_delay(delay_of);
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

pub(super) async fn ack(d: &Delivery) {
    // A failed ack means the channel is gone: the broker redelivers, the inbox absorbs it.
    let _ = tokio::time::timeout(RPC_TIMEOUT, d.acker.ack(BasicAckOptions::default())).await;
}

/// Unordered mode: sends the message to the dead-letter exchange, records it in the inbox,
/// acks it.
pub(super) async fn dead_letter(
    shared: &Shared,
    d: &Delivery,
    msg: Option<&Message>,
    reason: &str,
) {
    let cfg = &shared.cfg;
    if let Some(msg) = msg {
        match recorded_after_all(shared, msg).await {
            Ok(false) => {}
            Ok(true) => {
                events::applied_after_all(&cfg.name, &msg.event_id.to_string(), reason);
                ack(d).await;
                return;
            }
            Err(e) => {
                hold_and_requeue(
                    shared,
                    d,
                    &format!("inbox not readable before a dead letter: {e}"),
                )
                .await;
                return;
            }
        }
    }
    if let Err(e) = publish_dead(
        shared,
        &original_routing_key(d),
        &d.data,
        &d.properties,
        reason,
    )
    .await
    {
        hold_and_requeue(shared, d, &e).await;
        return;
    }
    if let Some(msg) = msg {
        let recorded = async {
            let client = deadline(shared.pool.get()).await?;
            inbox::dead(&**client, &cfg.name, &msg.event_ref(false), reason, false).await
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

/// Inserts the event's inbox row in a transaction that is always rolled back: the insert
/// waits for any transaction that recorded the event and has not ended (a commit still under
/// way after its attempt gave up on it), and inserts nothing when the event is recorded.
const PROBE: &str = "INSERT INTO outbox_inbox (consumer, event_id, outcome, reason)
                     VALUES ($1, $2, 'dead', 'probe: never committed')
                     ON CONFLICT DO NOTHING";

/// Whether the event is recorded in the inbox after all (applied, or dead-lettered before),
/// once every transaction that may still commit it has ended. Asked before a dead letter:
/// the last attempt's commit may have succeeded although the attempt failed.
pub(super) async fn recorded_after_all(shared: &Shared, msg: &Message) -> Result<bool, DbError> {
    let mut conn = deadline(shared.pool.get()).await?;
    let client: &mut tokio_postgres::Client = &mut conn;
    let tx = deadline(client.transaction()).await?;
    let inserted = deadline(tx.execute(PROBE, &[&shared.cfg.name, &msg.event_id])).await?;
    deadline(tx.rollback()).await?;
    Ok(inserted == 0)
}

/// Publishes a copy to the dead-letter exchange, with the reason and this consumer's name
/// in its headers, and waits for the broker's confirm.
pub(super) async fn publish_dead(
    shared: &Shared,
    routing_key: &str,
    body: &[u8],
    props: &BasicProperties,
    reason: &str,
) -> Result<(), String> {
    let cfg = &shared.cfg;
    let mut extra = FieldTable::default();
    extra.insert(H_DEAD_REASON.into(), long_string(reason));
    extra.insert(H_DEAD_CONSUMER.into(), long_string(&cfg.name));
    let props = with_headers(props, routing_key, extra);
    publish_confirmed(
        shared,
        &cfg.dead_letter_exchange(),
        routing_key,
        body,
        props,
    )
    .await
}

/// Publishes a copy to the retry queue for `delay`, then acks the original.
async fn republish_delayed(shared: &Shared, d: &Delivery, delay: Duration, extra: FieldTable) {
    let routing_key = original_routing_key(d);
    let props = with_headers(&d.properties, &routing_key, extra);
    let queue = shared.cfg.retry_queue(delay);
    match publish_confirmed(shared, "", &queue, &d.data, props).await {
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
    body: &[u8],
    props: BasicProperties,
) -> Result<(), String> {
    let mut publisher = shared.publisher.lock().await;
    let channel = publisher.channel.clone();
    let publish = async {
        let confirm = channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                props,
            )
            .await
            .map_err(|e| e.to_string())?;
        confirm.await.map_err(|e| e.to_string())
    };
    let confirmation = match tokio::time::timeout(RPC_TIMEOUT, publish).await {
        Ok(r) => r?,
        Err(_) => return Err("no confirm in time".into()),
    };
    match confirmation {
        Confirmation::Nack(_) => {
            publisher
                .nacked(&shared.cfg.name, shared.cfg.retry_max)
                .await;
            return Err("nacked by the broker".into());
        }
        Confirmation::NotRequested => {
            return Err("publish channel is not in confirm mode".into());
        }
        Confirmation::Ack(_) => publisher.nacked_since = None,
    }
    match confirmation {
        Confirmation::Ack(Some(_)) => Err(format!(
            "unroutable: nothing bound for '{routing_key}' at '{exchange}'"
        )),
        _ => Ok(()),
    }
}

/// `props` with its headers plus `extra` (and the original routing key).
pub(super) fn with_headers(
    props: &BasicProperties,
    routing_key: &str,
    extra: FieldTable,
) -> BasicProperties {
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(H_ROUTING_KEY.into(), long_string(routing_key));
    for (k, v) in extra.inner() {
        headers.insert(k.clone(), v.clone());
    }
    props.clone().with_headers(headers)
}
