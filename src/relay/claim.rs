//! The relay's SQL: claiming rows, marking them dispatched, recording failures and
//! parking, leasing partitions, and the wake-up flag. One `const` per statement.
//!
//! Invariants: `dispatched_at` is written only by `mark_dispatched`, which takes
//! [`Acked`] values that only `relay/publish.rs` can make (from a broker ack without a
//! return); a parked row is never marked dispatched (`parked_at IS NULL` in the UPDATE);
//! marking and parking never touch a row that already has a final state. What a row holds
//! is the producers' data: reading it never panics (`try_get`, errors returned), and a row
//! whose text the server cannot send (not UTF-8, in a `SQL_ASCII` database) comes back
//! [`ClaimedRow::unreadable`], to be parked with that reason (sql/0011). On the steady
//! path a claim only reads (rows are numbered by their INSERT, sql/0015): what the relay
//! has in flight it tracks in memory and passes as `held`. Claim results are read by
//! column name.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_postgres::Row;
use tokio_postgres::types::Type;
use uuid::Uuid;

use super::key::Key;
use super::publish::Acked;
use outbox_kit::db::DbError;
use outbox_kit::internal::deadline;

/// A pending row as claimed, with everything needed to publish it.
#[derive(Clone, Debug)]
pub struct ClaimedRow {
    /// The row's `id`.
    pub id: i64,
    /// The event's identity: the AMQP `message_id`.
    pub event_id: Uuid,
    /// Half of the key; a header.
    pub aggregate_type: String,
    /// The other half of the key; a header.
    pub aggregate_id: String,
    /// The AMQP `type`.
    pub event_type: String,
    /// The row's routing key, or `<aggregate_type>.<event_type>`.
    pub routing_key: String,
    /// The payload's JSON text; `None` when the message is larger than
    /// `--max-message-bytes`.
    pub body: Option<Arc<str>>,
    /// The message's size in bytes as published: payload, user headers, trace context,
    /// key, type and routing key (also when `body` is `None`). What the row costs in
    /// memory, counted against `--max-in-memory-bytes`.
    pub body_bytes: usize,
    /// The row's user headers as JSON text (`{}` when the message is too large).
    pub headers: String,
    /// W3C trace context, passed on as a header.
    pub traceparent: Option<String>,
    /// W3C trace state, passed on as a header.
    pub tracestate: Option<String>,
    /// created_at in unix seconds (microsecond precision).
    pub created_epoch: f64,
    /// created_at in RFC 3339 with microseconds (`x-outbox-created-at`).
    pub created_text: String,
    /// Failed attempts so far.
    pub attempts: i32,
    /// The row's number within its key (`x-outbox-seq`).
    pub seq: i64,
    /// The partition (of the key) whose lease lets this relay publish the row.
    pub partition: u8,
    /// Why the row cannot be published as it is stored (text that is not UTF-8, which
    /// only a `SQL_ASCII` database holds): the claim then returns its key as hex and no
    /// other text, and the relay parks it with this reason.
    pub unreadable: Option<String>,
}

impl ClaimedRow {
    /// The row's key.
    pub fn key(&self) -> Key {
        Key {
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
        }
    }

    #[cfg(test)]
    pub(crate) fn for_test(
        id: i64,
        aggregate_type: &str,
        aggregate_id: &str,
        seq: i64,
    ) -> ClaimedRow {
        ClaimedRow {
            id,
            event_id: Uuid::nil(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: "created".into(),
            routing_key: format!("{aggregate_type}.created"),
            body: Some("{}".into()),
            body_bytes: 2,
            headers: "{}".into(),
            traceparent: None,
            tracestate: None,
            created_epoch: 0.0,
            created_text: "1970-01-01T00:00:00.000000Z".into(),
            attempts: 0,
            seq,
            partition: 0,
            unreadable: None,
        }
    }
}

/// What one claim call found.
#[derive(Debug)]
pub(crate) struct Claimed {
    /// Where the next claim continues from.
    pub(crate) scanned_to: i64,
    /// Candidate rows the scan looked at; fewer than the limit means it reached the end.
    pub(crate) scanned: usize,
    /// How many rows per key the claim took at most (a key that got this many may have more).
    pub(crate) per_key: usize,
    /// When the earliest scheduled row not yet due becomes due, from now (forward claims).
    pub(crate) next_due: Option<Duration>,
    pub(crate) rows: Vec<ClaimedRow>,
}

/// Arguments of one claim.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClaimRequest<'a> {
    pub(crate) relay_id: &'a str,
    pub(crate) after: i64,
    /// A sweep reads only up to here (the forward cursor).
    pub(crate) before: Option<i64>,
    pub(crate) limit: usize,
    pub(crate) per_key: usize,
    pub(crate) block_parked_keys: bool,
    pub(crate) max_message_bytes: usize,
    pub(crate) max_bytes: usize,
    /// Keys to continue whatever the cursor: their earlier rows were published and more
    /// may be waiting.
    pub(crate) keys: &'a [Key],
    /// Rows the relay holds: left out (they go out before anything new of their key).
    pub(crate) held: &'a [i64],
}

const CLAIM: &str = "SELECT * FROM outbox_claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

pub(crate) async fn claim(pool: &Pool, req: ClaimRequest<'_>) -> Result<Claimed, DbError> {
    let client = deadline(pool.get()).await?;
    let stmt = deadline(client.prepare_cached(CLAIM)).await?;
    let limit = i32::try_from(req.limit).unwrap_or(i32::MAX);
    let per_key = i32::try_from(req.per_key).unwrap_or(i32::MAX);
    let max_message = i32::try_from(req.max_message_bytes).unwrap_or(i32::MAX);
    let max_bytes = i64::try_from(req.max_bytes).unwrap_or(i64::MAX);
    let key_types: Vec<&str> = req.keys.iter().map(|k| k.aggregate_type.as_str()).collect();
    let key_ids: Vec<&str> = req.keys.iter().map(|k| k.aggregate_id.as_str()).collect();
    let rows = deadline(client.query(
        &stmt,
        &[
            &req.relay_id,
            &req.after,
            &limit,
            &per_key,
            &req.block_parked_keys,
            &max_message,
            &max_bytes,
            &key_types,
            &key_ids,
            &req.before,
            &req.held,
        ],
    ))
    .await?;
    let Some(first) = rows.first() else {
        return Ok(Claimed {
            scanned_to: req.after,
            scanned: 0,
            per_key: req.per_key,
            next_due: None,
            rows: Vec::new(),
        });
    };
    let cols = Columns::of(first)?;
    let mut out = Claimed {
        scanned_to: req.after,
        scanned: 0,
        per_key: req.per_key,
        next_due: None,
        rows: Vec::with_capacity(rows.len()),
    };
    for row in rows {
        let id: Option<i64> = row.try_get(cols.id)?;
        let Some(id) = id else {
            out.scanned_to = row
                .try_get::<_, Option<i64>>(cols.scanned_to)?
                .unwrap_or(req.after);
            out.scanned = row
                .try_get::<_, Option<i32>>(cols.scanned)?
                .unwrap_or(0)
                .max(0) as usize;
            out.per_key = row
                .try_get::<_, Option<i32>>(cols.per_key)?
                .unwrap_or(1)
                .max(1) as usize;
            out.next_due = row
                .try_get::<_, Option<f64>>(cols.next_due)?
                .map(|s| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX));
            continue;
        };
        out.rows.push(cols.claimed_row(id, &row)?);
    }
    Ok(out)
}

/// One row in the layout of outbox_claim's result, its columns found by name: `replay`
/// reads its rows through this, so a replayed message is built exactly as the relay built it.
pub(crate) fn claimed_row(id: i64, row: &Row) -> Result<ClaimedRow, DbError> {
    Columns::of(row)?.claimed_row(id, row)
}

/// Where each of outbox_claim's result columns is, found by name once per call (from its
/// first row), so that a change in the function's column order cannot shift what
/// the relay reads, and no row pays a name search per column.
struct Columns {
    id: usize,
    event_id: usize,
    aggregate_type: usize,
    aggregate_id: usize,
    event_type: usize,
    routing_key: usize,
    body: usize,
    body_bytes: usize,
    headers: usize,
    traceparent: usize,
    tracestate: usize,
    created_epoch: usize,
    created_text: usize,
    attempts: usize,
    seq: usize,
    partition: usize,
    scanned_to: usize,
    scanned: usize,
    per_key: usize,
    next_due: usize,
    unreadable: usize,
}

impl Columns {
    fn of(row: &Row) -> Result<Columns, DbError> {
        let at = |name: &str| match row.columns().iter().position(|c| c.name() == name) {
            Some(i) => Ok(i),
            // The driver's own error for a missing column, naming it.
            None => Err(DbError::from(
                row.try_get::<_, Option<i32>>(name)
                    .expect_err("no such column"),
            )),
        };
        Ok(Columns {
            id: at("id")?,
            event_id: at("event_id")?,
            aggregate_type: at("aggregate_type")?,
            aggregate_id: at("aggregate_id")?,
            event_type: at("event_type")?,
            routing_key: at("routing_key")?,
            body: at("body")?,
            body_bytes: at("body_bytes")?,
            headers: at("headers")?,
            traceparent: at("traceparent")?,
            tracestate: at("tracestate")?,
            created_epoch: at("created_epoch")?,
            created_text: at("created_text")?,
            attempts: at("attempts")?,
            seq: at("seq")?,
            partition: at("partition")?,
            scanned_to: at("scanned_to")?,
            scanned: at("scanned")?,
            per_key: at("per_key")?,
            next_due: at("next_due")?,
            unreadable: at("unreadable")?,
        })
    }

    /// One claimed row.
    fn claimed_row(&self, id: i64, row: &Row) -> Result<ClaimedRow, DbError> {
        let body: Option<String> = row.try_get(self.body)?;
        let body_bytes: i32 = row.try_get(self.body_bytes)?;
        let headers: Option<String> = row.try_get(self.headers)?;
        let partition: i32 = row.try_get(self.partition)?;
        Ok(ClaimedRow {
            id,
            event_id: row.try_get(self.event_id)?,
            aggregate_type: row.try_get(self.aggregate_type)?,
            aggregate_id: row.try_get(self.aggregate_id)?,
            event_type: row.try_get(self.event_type)?,
            routing_key: row.try_get(self.routing_key)?,
            body: body.map(Arc::from),
            body_bytes: body_bytes.max(0) as usize,
            headers: headers.unwrap_or_else(|| "{}".into()),
            traceparent: row.try_get(self.traceparent)?,
            tracestate: row.try_get(self.tracestate)?,
            created_epoch: row.try_get(self.created_epoch)?,
            created_text: row.try_get(self.created_text)?,
            attempts: row.try_get(self.attempts)?,
            seq: row.try_get(self.seq)?,
            partition: partition as u8,
            unreadable: row.try_get(self.unreadable)?,
        })
    }
}

/// The statement `mark_dispatched` runs: `$1` the acked ids, `$2` the numbers they were
/// published with (public for the plan tests). A row is marked only if it still carries
/// that number (its INSERT took it, sql/0015): the mark writes `dispatched_at` alone.
/// "Pending" is `coalesce(..) IS NULL`, which no partial index serves, so the rows are
/// found by primary key whatever Postgres believes about how many are pending. Written as
/// two IS NULLs, statistics taken while none were pending (a vacuum of an idle outbox, then
/// a burst) made it read every pending row for each mark (sql/0007, "Statistics").
pub const MARK: &str = "UPDATE outbox_events e SET dispatched_at = now()
  FROM unnest($1::bigint[], $2::bigint[]) AS m(id, seq),
       (SELECT set_config('synchronous_commit', 'off', true)) AS async
 WHERE e.id = m.id AND e.seq = m.seq AND coalesce(e.dispatched_at, e.parked_at) IS NULL";

/// Marks acked rows dispatched, each only if it carries the number it was published with.
/// Only [`Acked`] values (broker confirmations without a return) can be passed. Returns how
/// many rows changed.
///
/// The mark commits without waiting for its WAL flush (`synchronous_commit = off` for its
/// own transaction only): a mark that a Postgres crash loses leaves its rows pending with
/// their numbers (taken at insert and committed with them), so they are published again
/// with the same `seq`, exactly as after a relay killed between ack and mark.
pub(crate) async fn mark_dispatched<'a>(
    pool: &Pool,
    acked: impl Iterator<Item = &'a Acked>,
) -> Result<u64, DbError> {
    let (ids, seqs): (Vec<i64>, Vec<i64>) = acked.map(|a| (a.row_id(), a.seq())).unzip();
    let client = deadline(pool.get()).await?;
    // Planned on every call (an unnamed statement, still one round trip), from the table as
    // it is then. A prepared statement's cached plan, made while the table was nearly empty
    // (a relay woken for its first rows), read the whole table for every mark however large
    // it grew: 1.95 ms per mark at 500 events/s where a fresh plan takes 0.26 ms.
    let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 2] =
        [(&ids, Type::INT8_ARRAY), (&seqs, Type::INT8_ARRAY)];
    deadline(client.execute_typed(MARK, &params)).await
}

/// `last_error` of a row the broker nacked; `status` and the dashboard find the keys
/// nacks hold by it.
pub const NACKED: &str = "nacked by the broker";
/// How `last_error` of a row returned as unroutable begins.
pub const UNROUTABLE: &str = "unroutable:";

/// How a failed attempt counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// Nack, confirm timeout, lost channel: retried for as long as it takes.
    Transient = 0,
    /// Returned unroutable: parked once attempts reach `--max-attempts`.
    Permanent = 1,
    /// Cannot ever be published as it is (too large, refused header): parked now.
    ParkNow = 2,
}

/// One failed attempt to record.
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    pub(crate) id: i64,
    pub(crate) kind: FailureKind,
    pub(crate) reason: String,
}

/// What the database recorded for a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// Still pending, with this many attempts so far.
    Pending { attempts: i32 },
    /// Parked: now, or by an earlier try of this same write whose answer was lost.
    Parked,
    /// Not ours to decide about any more: dispatched, gone, or its partition is no longer
    /// this relay's at the epoch it holds (the write was fenced and changed nothing).
    Gone,
}

const RECORD_FAILURES: &str = "SELECT id, attempts, parked, outcome
  FROM outbox_record_failures($1, $2, $3, $4, $5, $6, $7, $8)";

/// Records failed attempts (attempts + 1, last_error) and parks rows that reached their
/// limit, only for rows of partitions `relay` holds at the epochs in `leases` (pairs of
/// partition and epoch). Returns, per input row, what the database says about it.
pub(crate) async fn record_failures(
    pool: &Pool,
    failures: &[Failure],
    max_attempts: i32,
    block_key: bool,
    relay: &str,
    leases: &(Vec<i32>, Vec<i64>),
) -> Result<Vec<(i64, Recorded)>, DbError> {
    let ids: Vec<i64> = failures.iter().map(|f| f.id).collect();
    let reasons: Vec<&str> = failures.iter().map(|f| f.reason.as_str()).collect();
    let kinds: Vec<i16> = failures.iter().map(|f| f.kind as i16).collect();
    let client = deadline(pool.get()).await?;
    let stmt = deadline(client.prepare_cached(RECORD_FAILURES)).await?;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 8] = [
        &ids,
        &reasons,
        &kinds,
        &max_attempts,
        &block_key,
        &relay,
        &leases.0,
        &leases.1,
    ];
    let rows = deadline(client.query(&stmt, &params)).await?;
    let mut out: Vec<(i64, Recorded)> = ids.iter().map(|id| (*id, Recorded::Gone)).collect();
    for row in rows {
        let id: i64 = row.try_get(0)?;
        let attempts: i32 = row.try_get(1)?;
        let parked: bool = row.try_get(2)?;
        let outcome: &str = row.try_get(3)?;
        let recorded = match (outcome, parked) {
            ("recorded", false) => Recorded::Pending { attempts },
            ("recorded", true) | ("parked", _) => Recorded::Parked,
            _ => Recorded::Gone, // dispatched, fenced, gone
        };
        if let Some(slot) = out.iter_mut().find(|(i, _)| *i == id) {
            slot.1 = recorded;
        }
    }
    Ok(out)
}

/// A partition this relay holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Lease {
    pub(crate) partition: u8,
    pub(crate) epoch: i64,
}

/// What a lease round returned.
#[derive(Clone, Debug, Default)]
pub(crate) struct LeaseRound {
    pub(crate) held: Vec<Lease>,
    pub(crate) fair_share: usize,
    pub(crate) relays_alive: usize,
}

/// Arguments of one lease round.
#[derive(Clone, Debug)]
pub(crate) struct LeaseRequest<'a> {
    pub(crate) relay_id: &'a str,
    pub(crate) host: &'a str,
    pub(crate) pid: i32,
    pub(crate) lease_secs: f64,
    pub(crate) release: Vec<i32>,
    pub(crate) acquire: bool,
    pub(crate) wants_wakeup: bool,
    /// Rows published and acked since start, shown by `status`.
    pub(crate) published: i64,
}

const LEASE: &str = "SELECT partition, epoch, fair_share, relays_alive FROM outbox_lease($1, $2, $3, $4, $5, $6, $7, $8)";

/// Heartbeat, renew, release and acquire partitions in one round trip.
pub(crate) async fn lease(pool: &Pool, req: &LeaseRequest<'_>) -> Result<LeaseRound, DbError> {
    let client = deadline(pool.get()).await?;
    let stmt = deadline(client.prepare_cached(LEASE)).await?;
    let rows = deadline(client.query(
        &stmt,
        &[
            &req.relay_id,
            &req.host,
            &req.pid,
            &req.lease_secs,
            &req.release,
            &req.acquire,
            &req.wants_wakeup,
            &req.published,
        ],
    ))
    .await?;
    let mut round = LeaseRound::default();
    for row in rows {
        let partition: i32 = row.try_get(0)?;
        round.held.push(Lease {
            partition: partition as u8,
            epoch: row.try_get(1)?,
        });
        round.fair_share = row.try_get::<_, i32>(2)?.max(0) as usize;
        round.relays_alive = row.try_get::<_, i32>(3)?.max(0) as usize;
    }
    Ok(round)
}

const LEAVE: &str = "SELECT outbox_leave($1)";

/// Gives back every partition at a clean shutdown so others take over at once.
pub(crate) async fn leave(pool: &Pool, relay_id: &str) -> Result<(), DbError> {
    let client = deadline(pool.get()).await?;
    deadline(client.execute(LEAVE, &[&relay_id])).await?;
    Ok(())
}

const SET_WAKEUP: &str = "SELECT outbox_set_wakeup($1, $2)";

/// Tells producers whether this relay wants a NOTIFY on insert (only while it is idle):
/// `outbox_set_wakeup` records it and publishes, for the insert trigger, until when some
/// relay wants one (sql/0008_wakeup_hint.sql). Sent again every lease round while wanted,
/// so the hint runs out once no live relay renews it.
pub(crate) async fn set_wakeup(pool: &Pool, relay_id: &str, wanted: bool) -> Result<(), DbError> {
    let client = deadline(pool.get()).await?;
    let stmt = deadline(client.prepare_cached(SET_WAKEUP)).await?;
    deadline(client.execute(&stmt, &[&relay_id, &wanted])).await?;
    Ok(())
}
