//! The inbox: dedupe on (consumer, event_id) and, for ordered consumer groups, per-key
//! apply in seq order with held events of blocked keys, decided in the handler's own
//! transaction (`sql/0003_consumer.sql`, `sql/0012_consumer_groups.sql`).
//!
//! Invariants: [`record`] / [`record_in_group`] run first in the transaction that applies
//! the event, so the event counts as handled exactly when that transaction commits; two
//! transactions recording the same event (or the same key, in a group) serialize on a row
//! lock, so only one gets to apply. In a group a seq at or below the key's last is a
//! duplicate, a higher one is applied (a jump is recorded, never waited for), and a blocked
//! key's events are held in the database, and so are a failing key's later events parked to
//! keep its partition's prefetch window open ([`park`]). Key rows are never deleted (retention would
//! restart a key at seq 1).

use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use crate::db::{DbError, deadline};

const RECORD: &str = "SELECT outcome, expected_seq FROM outbox_inbox_record($1, $2, $3, $4, $5)";
const DEAD: &str = "SELECT outbox_inbox_dead($1, $2, $3, $4, $5, $6, $7)";
const GROUP_RECORD: &str =
    "SELECT outcome FROM outbox_group_record($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)";
const GROUP_DEAD: &str = "SELECT outbox_group_dead($1, $2, $3, $4, $5, $6, $7)";
const PARK: &str = "SELECT outbox_group_park($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";
const ATTEMPT: &str = "SELECT outbox_inbox_attempt($1, $2)";
const RELEASE: &str = "SELECT outbox_consumer_release($1, $2, $3)";
const RELEASABLE: &str = "SELECT aggregate_type, aggregate_id FROM outbox_group_releasable($1, $2)";
const TAKE_HELD: &str = "SELECT outcome, event_id, seq, event_type, routing_key, headers, body \
     FROM outbox_group_take_held($1, $2, $3)";

/// The identity of one event as the inbox sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventRef<'a> {
    /// The AMQP message_id: the outbox event_id.
    pub event_id: Uuid,
    /// The key's first half (`x-outbox-aggregate-type`).
    pub aggregate_type: &'a str,
    /// The key's second half (`x-outbox-aggregate-id`).
    pub aggregate_id: &'a str,
    /// `x-outbox-seq`; pass it only in ordered mode.
    pub seq: Option<i64>,
}

/// What the inbox says about an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// New (and, in ordered mode, next in line): run the handler, commit, then ack.
    Apply,
    /// Already handled, or older than what the key already applied: commit and ack.
    Duplicate,
    /// An earlier seq of the key has not been applied: roll back, try again later. Only
    /// from a seq passed outside a consumer group (`outbox_inbox_record`'s own rule);
    /// ordered groups use [`record_in_group`], which never waits.
    Gap {
        /// The seq the key waits for.
        expected: i64,
    },
}

/// Records the event in `tx` (the handler's transaction) and says whether to apply it.
pub async fn record(
    tx: &impl GenericClient,
    consumer: &str,
    event: &EventRef<'_>,
) -> Result<Admission, DbError> {
    let row = deadline(tx.query_one(
        RECORD,
        &[
            &consumer,
            &event.event_id,
            &event.aggregate_type,
            &event.aggregate_id,
            &event.seq,
        ],
    ))
    .await?;
    let outcome: &str = row.get(0);
    Ok(match outcome {
        "apply" => Admission::Apply,
        "gap" => Admission::Gap {
            expected: row.get::<_, Option<i64>>(1).unwrap_or(1),
        },
        _ => Admission::Duplicate,
    })
}

/// Records an event sent to the dead-letter exchange, so later copies are duplicates;
/// `advance` moves its key past it (ordered consumers that skip).
pub async fn dead(
    client: &impl GenericClient,
    consumer: &str,
    event: &EventRef<'_>,
    reason: &str,
    advance: bool,
) -> Result<(), DbError> {
    deadline(client.execute(
        DEAD,
        &[
            &consumer,
            &event.event_id,
            &event.aggregate_type,
            &event.aggregate_id,
            &event.seq,
            &reason,
            &advance,
        ],
    ))
    .await?;
    Ok(())
}

/// What the inbox of an ordered group says about an event (`outbox_group_record`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupAdmission {
    /// New and next for its key: run the handler, commit, ack.
    Apply,
    /// New, with seqs before it never seen (parked upstream, or never routed to the
    /// group): recorded in `outbox_inbox_gaps`; run the handler, commit, ack.
    Jumped,
    /// Already applied or dead-lettered, or older than the key: commit, ack.
    Duplicate,
    /// The key is blocked (or still has held events): the event was stored in
    /// `outbox_inbox_held`; commit, ack.
    Held,
}

impl GroupAdmission {
    fn parse(outcome: &str) -> GroupAdmission {
        match outcome {
            "apply" => GroupAdmission::Apply,
            "jumped" => GroupAdmission::Jumped,
            "held" => GroupAdmission::Held,
            _ => GroupAdmission::Duplicate,
        }
    }

    /// Whether the handler runs.
    pub fn applies(self) -> bool {
        matches!(self, GroupAdmission::Apply | GroupAdmission::Jumped)
    }
}

/// An event as an ordered group stores it while its key is blocked.
#[derive(Clone, Debug)]
pub struct HeldEvent<'a> {
    /// The event and its key (seq required).
    pub event: EventRef<'a>,
    /// The partition queue it came from.
    pub partition: u16,
    /// The AMQP type (event_type).
    pub event_type: &'a str,
    /// The routing key it was published with.
    pub routing_key: &'a str,
    /// Its headers as JSON.
    pub headers: &'a serde_json::Value,
    /// Its body.
    pub body: &'a [u8],
}

/// Runs `sql` with the consumer and the held event as its first ten parameters (the order
/// of `outbox_group_record` and `outbox_group_park`), then `extra`.
async fn query_held(
    client: &impl GenericClient,
    sql: &str,
    consumer: &str,
    held: &HeldEvent<'_>,
    extra: &[&(dyn ToSql + Sync)],
) -> Result<tokio_postgres::Row, DbError> {
    let e = &held.event;
    let partition = i32::from(held.partition);
    let mut params: Vec<&(dyn ToSql + Sync)> = vec![
        &consumer,
        &partition,
        &e.event_id,
        &e.aggregate_type,
        &e.aggregate_id,
        &e.seq,
        &held.event_type,
        &held.routing_key,
        held.headers,
        &held.body,
    ];
    params.extend_from_slice(extra);
    deadline(client.query_one(sql, &params)).await
}

/// Records a delivery of an ordered group's partition queue in `tx` and says what to do.
pub async fn record_in_group(
    tx: &impl GenericClient,
    consumer: &str,
    held: &HeldEvent<'_>,
) -> Result<GroupAdmission, DbError> {
    let row = query_held(tx, GROUP_RECORD, consumer, held, &[]).await?;
    Ok(GroupAdmission::parse(row.get(0)))
}

/// What [`park`] did with an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parked {
    /// Stored in `outbox_inbox_held` behind the key's events up to `after`: ack it.
    Parked,
    /// The key already has it (or a later event; recorded as late when never seen): ack it.
    Duplicate,
}

/// Parks a delivery of an ordered group (`outbox_group_park`): stores it in
/// `outbox_inbox_held`, where it waits until the key has applied or dead-lettered every seq
/// up to `after` (the last of the key's events still unacked in the caller's hand), then is
/// applied in seq order. Commits on its own; ack the delivery after it returned.
pub async fn park(
    client: &impl GenericClient,
    consumer: &str,
    held: &HeldEvent<'_>,
    after: i64,
) -> Result<Parked, DbError> {
    let row = query_held(client, PARK, consumer, held, &[&after]).await?;
    Ok(match row.get::<_, &str>(0) {
        "parked" => Parked::Parked,
        _ => Parked::Duplicate,
    })
}

/// Records an ordered group's event sent to the dead-letter exchange: later copies are
/// duplicates, its key moves past it, and with `block` the key is blocked at it.
pub async fn dead_in_group(
    client: &impl GenericClient,
    consumer: &str,
    event: &EventRef<'_>,
    reason: &str,
    block: bool,
) -> Result<(), DbError> {
    deadline(client.execute(
        GROUP_DEAD,
        &[
            &consumer,
            &event.event_id,
            &event.aggregate_type,
            &event.aggregate_id,
            &event.seq,
            &reason,
            &block,
        ],
    ))
    .await?;
    Ok(())
}

/// Counts one more attempt at an event (`outbox_inbox_attempt`; commits on its own, before
/// the attempt runs) and returns how many attempts it had before this one, the unrecorded
/// first attempt of its first delivery included. Called for a redelivered event, whose
/// earlier attempts a dead member's memory took with it.
pub async fn count_attempt(
    client: &impl GenericClient,
    consumer: &str,
    event_id: Uuid,
) -> Result<u32, DbError> {
    let row = deadline(client.query_one(ATTEMPT, &[&consumer, &event_id])).await?;
    Ok(row.get::<_, i32>(0).max(0) as u32)
}

/// Lets a blocked key go on (`outbox_consumer_release`): returns how many of its events are
/// held and will be applied in seq order, or `None` when the key was not blocked.
pub async fn release(
    client: &impl GenericClient,
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Result<Option<i64>, DbError> {
    let row =
        deadline(client.query_one(RELEASE, &[&consumer, &aggregate_type, &aggregate_id])).await?;
    Ok(row.get(0))
}

/// Keys of `partitions` with held events that may be applied now.
pub async fn releasable(
    client: &impl GenericClient,
    consumer: &str,
    partitions: &[u16],
) -> Result<Vec<(String, String)>, DbError> {
    let partitions: Vec<i32> = partitions.iter().map(|p| i32::from(*p)).collect();
    let rows = deadline(client.query(RELEASABLE, &[&consumer, &partitions])).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// A held event taken out of `outbox_inbox_held` in the transaction that applies it.
#[derive(Clone, Debug)]
pub struct TakenEvent {
    /// What the inbox says (apply, jumped or duplicate).
    pub admission: GroupAdmission,
    /// The event_id.
    pub event_id: Uuid,
    /// Its seq.
    pub seq: i64,
    /// The AMQP type.
    pub event_type: Option<String>,
    /// The routing key it was published with.
    pub routing_key: String,
    /// Its headers as JSON.
    pub headers: serde_json::Value,
    /// Its body.
    pub body: Vec<u8>,
}

/// Takes the next held event of a released key in `tx` (none while it is blocked or when
/// nothing is held); a rollback leaves it held.
pub async fn take_held(
    tx: &impl GenericClient,
    consumer: &str,
    aggregate_type: &str,
    aggregate_id: &str,
) -> Result<Option<TakenEvent>, DbError> {
    let row =
        deadline(tx.query_opt(TAKE_HELD, &[&consumer, &aggregate_type, &aggregate_id])).await?;
    Ok(row.map(|r| TakenEvent {
        admission: GroupAdmission::parse(r.get(0)),
        event_id: r.get(1),
        seq: r.get(2),
        event_type: r.get(3),
        routing_key: r.get(4),
        headers: r.get(5),
        body: r.get(6),
    }))
}
