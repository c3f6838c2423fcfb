//! Everything the consumer kit reports happens once, in one function each, with structured
//! fields (the relay reports its own in its `telemetry` module). Per message only for what is rare
//! (dead letters, gaps given up, in-doubt effects); never an event id in a metric label.

use tracing::{debug, info, warn};

pub(crate) fn consumer_started(consumer: &str, queue: &str, prefetch: u16, ordered: bool) {
    info!(target: "outbox_relay::consumer", consumer, queue, prefetch, ordered, "consumer started");
}

pub(crate) fn session_lost(consumer: &str, error: &dyn std::fmt::Display, in_hand: usize) {
    warn!(target: "outbox_relay::consumer", consumer, error = %error, in_hand, "amqp session lost; unacked messages are redelivered; reconnecting");
}

pub(crate) fn stopping(consumer: &str, in_hand: usize) {
    info!(target: "outbox_relay::consumer", consumer, in_hand, "stopping: finishing the messages in hand");
}

pub(crate) fn stopped(consumer: &str) {
    info!(target: "outbox_relay::consumer", consumer, "consumer stopped");
}

pub(crate) fn retry_scheduled(
    consumer: &str,
    event_id: &str,
    attempt: u32,
    delay_ms: u64,
    error: &str,
) {
    debug!(target: "outbox_relay::consumer", consumer, event_id, attempt, delay_ms, error, "transient failure; retry scheduled");
}

pub(crate) fn dead_lettered(consumer: &str, event_id: &str, reason: &str) {
    warn!(target: "outbox_relay::consumer", consumer, event_id, reason, "message dead-lettered");
}

pub(crate) fn gap_waiting(
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    expected: i64,
    got: i64,
) {
    debug!(target: "outbox_relay::consumer", consumer, aggregate_type, aggregate_id, expected, got, "seq gap; waiting for the missing event");
}

pub(crate) fn gap_given_up(
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    expected: i64,
    got: i64,
    action: &str,
) {
    warn!(target: "outbox_relay::consumer", consumer, aggregate_type, aggregate_id, expected, got, action, "seq gap not filled within gap_timeout");
}

pub(crate) fn republish_failed(consumer: &str, error: &dyn std::fmt::Display) {
    warn!(target: "outbox_relay::consumer", consumer, error = %error, "could not hand a message to a retry queue or the dead-letter exchange; holding it and requeueing");
}
