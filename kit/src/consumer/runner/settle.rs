//! How a message in hand ends: ack; a copy to a retry queue (transient failure, or a gap
//! still within `gap_timeout`); a copy to the dead-letter exchange (terminal failure, too
//! many attempts, a gap given up with `on_gap = dead-letter`); or, when the broker does not
//! take the copy, held for `retry_min` and nacked for redelivery.
//!
//! Invariants: the original is acked only after its copy was confirmed (one publish at a
//! time on the shared publish channel, so a return belongs to that publish); a failed ack
//! costs nothing but a redelivery, which the inbox absorbs.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Confirmation};

use crate::amqp::long_string;
use crate::consumer::events;
use crate::consumer::inbox::{self, GapAction};
use crate::contract::headers::{
    ATTEMPT as H_ATTEMPT, DEAD_CONSUMER as H_DEAD_CONSUMER, DEAD_REASON as H_DEAD_REASON,
    GAP_SINCE as H_GAP_SINCE, ROUTING_KEY as H_ROUTING_KEY,
};
use crate::db::deadline;

use super::message::{header_i64, original_routing_key};
use super::process::{Applied, Shared, apply, within};
use super::{Handler, HandlerError, Message, OnGap, RPC_TIMEOUT};

pub(super) async fn settle<H: Handler>(
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

async fn ack(d: &Delivery) {
    // A failed ack means the channel is gone: the broker redelivers, the inbox absorbs it.
    let _ = tokio::time::timeout(RPC_TIMEOUT, d.acker.ack(BasicAckOptions::default())).await;
}

/// Sends the message to the dead-letter exchange, records it in the inbox, acks it.
pub(super) async fn dead_letter(
    shared: &Shared,
    d: &Delivery,
    msg: Option<&Message>,
    reason: &str,
) {
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

/// The delivery's properties with its headers plus `extra` (and the original routing key).
fn with_headers(d: &Delivery, routing_key: &str, extra: FieldTable) -> BasicProperties {
    let mut headers = d.properties.headers().clone().unwrap_or_default();
    headers.insert(H_ROUTING_KEY.into(), long_string(routing_key));
    for (k, v) in extra.inner() {
        headers.insert(k.clone(), v.clone());
    }
    d.properties.clone().with_headers(headers)
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
