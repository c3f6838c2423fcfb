//! The inbox: dedupe on (consumer, event_id) and per-key ordered apply, decided in the
//! handler's own transaction.
//!
//! Invariants: [`record`] runs first in the transaction that applies the event, so the
//! event counts as handled exactly when that transaction commits; two transactions recording
//! the same event (or the same key, in ordered mode) serialize on a row lock, so only one
//! gets [`Admission::Apply`]. In ordered mode seq n is applied only after n-1 committed for
//! the key; a lower seq is a duplicate. Key rows are never deleted (retention would restart
//! a key at seq 1).

use tokio_postgres::GenericClient;
use uuid::Uuid;

use crate::db::{DbError, deadline};

const RECORD: &str = "SELECT outcome, expected_seq FROM outbox_inbox_record($1, $2, $3, $4, $5)";
const GAP: &str = "SELECT outbox_inbox_gap($1, $2, $3, $4, $5, $6, $7)";
const DEAD: &str = "SELECT outbox_inbox_dead($1, $2, $3, $4, $5, $6, $7)";

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
    /// An earlier seq of the key has not been applied: roll back, try again later.
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

/// What to do with an event that waited longer than `gap_timeout` for its predecessor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GapAction {
    /// Apply it anyway; the missing seqs are given up (and recorded).
    Skipped,
    /// Send it to the dead-letter exchange; the key stays blocked at the gap.
    Dead,
}

/// Records a gap given up on; for [`GapAction::Skipped`] moves the key so that `got` is next.
pub async fn gap(
    tx: &impl GenericClient,
    consumer: &str,
    event: &EventRef<'_>,
    expected: i64,
    action: GapAction,
) -> Result<(), DbError> {
    let action = match action {
        GapAction::Skipped => "skipped",
        GapAction::Dead => "dead",
    };
    deadline(tx.execute(
        GAP,
        &[
            &consumer,
            &event.event_id,
            &event.aggregate_type,
            &event.aggregate_id,
            &expected,
            &event.seq.unwrap_or(expected),
            &action,
        ],
    ))
    .await?;
    Ok(())
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
