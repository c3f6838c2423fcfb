//! Everything the consumer kit reports happens once, in one function each, with structured
//! fields (the relay reports its own in its `telemetry` module). Per message only for what is rare
//! (dead letters, seq jumps, blocked keys, in-doubt effects); never an event id in a metric label.

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

pub(crate) fn applied_after_all(consumer: &str, event_id: &str, reason: &str) {
    warn!(target: "outbox_relay::consumer", consumer, event_id, reason, "the last attempt failed but its commit went through: the event is applied; acked, not dead-lettered");
}

pub(crate) fn seq_jumped(consumer: &str, aggregate_type: &str, aggregate_id: &str, seq: i64) {
    info!(target: "outbox_relay::consumer", consumer, aggregate_type, aggregate_id, seq, "seq jump applied (earlier seqs parked upstream or not routed here); recorded in outbox_inbox_gaps");
}

pub(crate) fn retrying_in_place(
    consumer: &str,
    event_id: &str,
    attempt: u32,
    delay_ms: u64,
    error: &str,
) {
    debug!(target: "outbox_relay::consumer", consumer, event_id, attempt, delay_ms, error, "transient failure; retrying in place while the key's later events wait");
}

pub(crate) fn key_blocked(consumer: &str, aggregate_type: &str, aggregate_id: &str, seq: i64) {
    warn!(target: "outbox_relay::consumer", consumer, aggregate_type, aggregate_id, seq, "key blocked after a dead letter; its later events are held until outbox_consumer_release");
}

pub(crate) fn held_applied(
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
    events: usize,
) {
    info!(target: "outbox_relay::consumer", consumer, aggregate_type, aggregate_id, events, "released key: held events applied");
}

pub(crate) fn group_assigned(consumer: &str, member: &str, members: usize, partitions: &[u16]) {
    info!(target: "outbox_relay::consumer", consumer, member, members, ?partitions, "consumer group assignment");
}

pub(crate) fn partition_ended(consumer: &str, partition: u16, why: &str) {
    warn!(target: "outbox_relay::consumer", consumer, partition, why, "partition consumer ended; taken again at the next heartbeat if still ours");
}

pub(crate) fn heartbeat_failed(consumer: &str, error: &dyn std::fmt::Display) {
    warn!(target: "outbox_relay::consumer", consumer, error = %error, "group heartbeat failed; partitions are given up once the lease runs out");
}

pub(crate) fn publish_channel_replaced(consumer: &str, nacked_for_ms: u64) {
    warn!(target: "outbox_relay::consumer", consumer, nacked_for_ms, "the broker nacked every publish on the publish channel; opened a new one");
}

pub(crate) fn republish_failed(consumer: &str, error: &dyn std::fmt::Display) {
    warn!(target: "outbox_relay::consumer", consumer, error = %error, "could not hand a message to a retry queue or the dead-letter exchange; holding it and requeueing");
}

pub(crate) fn router_ended(consumer: &str, why: &str) {
    warn!(target: "outbox_relay::consumer", consumer, why, "group router ended; its unacked intake messages go back to the intake and a router starts again");
}

pub(crate) fn key_parked(
    consumer: &str,
    partition: u16,
    aggregate_type: &str,
    aggregate_id: &str,
    events: usize,
) {
    info!(target: "outbox_relay::consumer", consumer, partition, aggregate_type, aggregate_id, events, "a key's later events were parked in outbox_inbox_held while its earlier ones were in hand; they are applied next, in seq order");
}

pub(crate) fn park_failed(consumer: &str, partition: u16, error: &str) {
    warn!(target: "outbox_relay::consumer", consumer, partition, error, "could not park a key's later event; the partition is given up and its unacked events come back in order");
}

pub(crate) fn copy_failed(consumer: &str, why: &str) {
    warn!(target: "outbox_relay::consumer", consumer, why, "the group router could not put a copy in its partition queue; retrying it with backoff while its key waits and other keys go on");
}
