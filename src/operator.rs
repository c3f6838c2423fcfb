//! The operator's side: `status`, `parked list`, `redrive` and `consumer-blocked`.
//!
//! Read-only commands read through the partial indexes (pending, parked, dispatched) so
//! they stay cheap on a large table. Re-driving goes through `outbox_redrive` (sql/0002),
//! the same function any other tool should call, so numbering rules live in one place;
//! `--dry-run` runs the same selection and reports without writing.

use std::time::SystemTime;

use serde_json::{Value, json};
use tokio_postgres::Client;
use uuid::Uuid;

use outbox_kit::db::DbError;
use outbox_kit::internal::deadline;

use crate::relay::claim::{NACKED, UNROUTABLE};

mod blocked;
pub use blocked::{BlockedKey, blocked, blocked_json, blocked_text};

/// Which parked rows a command is about. Empty fields do not filter.
#[derive(Clone, Debug, Default)]
pub struct ParkedFilter {
    pub ids: Vec<i64>,
    pub event_ids: Vec<Uuid>,
    pub event_type: Option<String>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    /// Parked at or after this time.
    pub since: Option<SystemTime>,
}

impl ParkedFilter {
    /// The parameters of `SELECT_PARKED`, in order.
    fn params<'a>(&'a self, limit: &'a i64) -> [&'a (dyn tokio_postgres::types::ToSql + Sync); 7] {
        [
            &self.ids,
            &self.event_ids,
            &self.event_type,
            &self.aggregate_type,
            &self.aggregate_id,
            &self.since,
            limit,
        ]
    }

    /// True when nothing narrows the selection.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
            && self.event_ids.is_empty()
            && self.event_type.is_none()
            && self.aggregate_type.is_none()
            && self.aggregate_id.is_none()
            && self.since.is_none()
    }
}

/// Counting pending or parked rows stops here, so a huge backlog costs a bounded read
/// (about 0.2 s for a million rows); more shows as "at least".
pub const COUNT_CAP: i64 = 1_000_000;
/// How many of the oldest pending rows `status` reads to say why rows wait (and, for the
/// lag, which is the oldest): a bounded walk of the pending index, whatever the backlog.
pub const LOOKED_AT: i64 = 10_000;

/// Pending and parked rows (each counted up to `$1`), how long the oldest due row among the
/// first `$2` pending rows by id has been due (since `available_at`, or `created_at` when that
/// is later: rows delayed into the future are not late), and the database clock.
const COUNTS: &str = "SELECT
    (SELECT count(*) FROM (SELECT FROM outbox_events
                            WHERE dispatched_at IS NULL AND parked_at IS NULL LIMIT $1) p),
    (SELECT coalesce(extract(epoch FROM now() - min(greatest(created_at, available_at))
                                  FILTER (WHERE available_at <= now()))::float8, 0)
       FROM (SELECT created_at, available_at FROM outbox_events
              WHERE dispatched_at IS NULL AND parked_at IS NULL
              ORDER BY id LIMIT $2) o),
    (SELECT count(*) FROM (SELECT FROM outbox_events WHERE parked_at IS NOT NULL LIMIT $1) p),
    extract(epoch FROM now())::float8";

/// The figures the dashboard's sampler takes every 2 s and `status` prints.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Counts {
    /// Pending rows, at most [`COUNT_CAP`].
    pub pending: i64,
    pub oldest_pending_seconds: f64,
    /// Parked rows, at most [`COUNT_CAP`].
    pub parked: i64,
    /// The database's clock, unix seconds.
    pub unix: f64,
}

impl Counts {
    /// The counts as JSON, with `*_capped` saying where counting stopped.
    fn json(&self) -> Value {
        json!({
            "pending": self.pending,
            "pending_capped": self.pending >= COUNT_CAP,
            "oldest_pending_seconds": self.oldest_pending_seconds,
            "parked": self.parked,
            "parked_capped": self.parked >= COUNT_CAP,
        })
    }
}

/// Pending and parked rows and the lag, in one bounded statement.
pub async fn counts(client: &Client) -> Result<Counts, DbError> {
    let row = deadline(client.query_one(COUNTS, &[&COUNT_CAP, &LOOKED_AT])).await?;
    Ok(Counts {
        pending: row.get(0),
        oldest_pending_seconds: row.get(1),
        parked: row.get(2),
        unix: row.get(3),
    })
}

const RECENT: &str = "SELECT count(*) FROM outbox_events WHERE dispatched_at IS NOT NULL AND dispatched_at > now() - interval '1 minute'";
const RELAYS: &str = "SELECT r.relay_id, r.host, r.pid, r.published,
       extract(epoch FROM now() - r.heartbeat_at)::float8 AS heartbeat_age,
       r.heartbeat_at > now() - make_interval(secs => r.lease_secs) AS alive,
       to_char(r.started_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS started,
       coalesce((SELECT array_agg(p.partition ORDER BY p.partition) FROM outbox_partitions p
                  WHERE p.owner = r.relay_id AND p.lease_until > now()), '{}') AS partitions
  FROM outbox_relays r ORDER BY r.started_at, r.relay_id";

/// Why pending rows wait, from the oldest `$1` pending rows (by id: rows that keep failing
/// stay at the old end while others flow past): how many of them were looked at; the keys
/// whose row was last nacked (`last_error` = `$2`) or returned (begins with `$3`), and the
/// rows of those keys (a held key's later rows wait behind its head); the five
/// most common `last_error`s with their rows and keys; and up to ten such held keys, most
/// attempts first. A relay writes `last_error` at each failed attempt.
const WAITING: &str = "WITH oldest AS MATERIALIZED (
    SELECT aggregate_type, aggregate_id, attempts, last_error
      FROM outbox_events WHERE dispatched_at IS NULL AND parked_at IS NULL
     ORDER BY id LIMIT $1
)
SELECT (SELECT count(*) FROM oldest),
       (SELECT count(DISTINCT (aggregate_type, aggregate_id)) FROM oldest WHERE last_error = $2),
       (SELECT count(DISTINCT (aggregate_type, aggregate_id)) FROM oldest
         WHERE starts_with(last_error, $3)),
       (SELECT count(*) FROM oldest
         WHERE (aggregate_type, aggregate_id) IN (SELECT aggregate_type, aggregate_id FROM oldest
                                                   WHERE last_error = $2 OR starts_with(last_error, $3))),
       coalesce((SELECT json_agg(r) FROM (
           SELECT last_error, count(*) AS rows, count(DISTINCT (aggregate_type, aggregate_id)) AS keys
             FROM oldest WHERE last_error IS NOT NULL
            GROUP BY last_error ORDER BY count(*) DESC, last_error LIMIT 5) r), '[]'),
       coalesce((SELECT json_agg(k) FROM (
           SELECT aggregate_type, aggregate_id, max(attempts) AS attempts, min(last_error) AS last_error
             FROM oldest WHERE last_error = $2 OR starts_with(last_error, $3)
            GROUP BY aggregate_type, aggregate_id
            ORDER BY max(attempts) DESC, aggregate_type, aggregate_id LIMIT 10) k), '[]')";

/// Why pending rows are not moving, as `status` and the dashboard show it.
pub async fn waiting(client: &Client) -> Result<Value, DbError> {
    let row = deadline(client.query_one(WAITING, &[&LOOKED_AT, &NACKED, &UNROUTABLE])).await?;
    let mut keys: Value = row.get(5);
    for k in keys.as_array_mut().into_iter().flatten() {
        let cause = if k["last_error"] == NACKED {
            "nack"
        } else {
            "returned"
        };
        k["cause"] = json!(cause);
    }
    Ok(json!({
        "looked_at": row.get::<_, i64>(0),
        "keys_held": { "nack": row.get::<_, i64>(1), "returned": row.get::<_, i64>(2) },
        "rows_of_held_keys": row.get::<_, i64>(3),
        "reasons": row.get::<_, Value>(4),
        "held_keys": keys,
    }))
}

/// A point-in-time view of the outbox, as `status --json` prints it.
pub async fn status(client: &Client) -> Result<Value, DbError> {
    let counts = counts(client).await?;
    status_with(client, &counts).await
}

/// [`status`] with counts taken already (the dashboard's sampler takes them every 2 s, so
/// a page refresh does not count again).
pub async fn status_with(client: &Client, counts: &Counts) -> Result<Value, DbError> {
    let recent: i64 = deadline(client.query_one(RECENT, &[])).await?.get(0);
    let relays = deadline(client.query(RELAYS, &[])).await?;
    let waiting = waiting(client).await?;
    let relays: Vec<Value> = relays
        .iter()
        .map(|r| {
            json!({
                "relay_id": r.get::<_, String>("relay_id"),
                "host": r.get::<_, String>("host"),
                "pid": r.get::<_, i32>("pid"),
                "alive": r.get::<_, bool>("alive"),
                "started_at": r.get::<_, String>("started"),
                "heartbeat_age_seconds": r.get::<_, f64>("heartbeat_age"),
                "published": r.get::<_, i64>("published"),
                "partitions": r.get::<_, Vec<i32>>("partitions"),
            })
        })
        .collect();
    let mut out = counts.json();
    out["dispatched_last_minute"] = json!(recent);
    out["relays_alive"] = json!(relays.iter().filter(|r| r["alive"] == true).count());
    out["relays"] = Value::Array(relays);
    out["waiting"] = waiting;
    Ok(out)
}

/// A count as `status` prints it: `at least N` where counting stopped.
fn count_text(s: &Value, name: &str) -> String {
    if s[format!("{name}_capped")] == true {
        format!("at least {} (counting stops there)", s[name])
    } else {
        s[name].to_string()
    }
}

/// The text form of [`status`].
pub fn status_text(s: &Value) -> String {
    let mut out = format!(
        "pending                 {}\noldest pending          {:.1}s\nparked                  {}\ndispatched, last minute {}\nrelays alive            {}\n",
        count_text(s, "pending"),
        s["oldest_pending_seconds"].as_f64().unwrap_or(0.0),
        count_text(s, "parked"),
        s["dispatched_last_minute"],
        s["relays_alive"]
    );
    for r in s["relays"].as_array().into_iter().flatten() {
        let parts: Vec<i64> = r["partitions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_i64)
            .collect();
        out.push_str(&format!(
            "  {} {} pid {}: {} partitions {}, published {}, heartbeat {:.1}s ago{}\n",
            r["relay_id"].as_str().unwrap_or_default(),
            r["host"].as_str().unwrap_or_default(),
            r["pid"],
            parts.len(),
            ranges(&parts),
            r["published"],
            r["heartbeat_age_seconds"].as_f64().unwrap_or(0.0),
            if r["alive"] == true {
                ""
            } else {
                " (not alive)"
            },
        ));
    }
    out.push_str(&waiting_text(
        &s["waiting"],
        s["pending"].as_i64().unwrap_or(0),
    ));
    out
}

/// The "why pending rows wait" part of [`status_text`].
fn waiting_text(w: &Value, pending: i64) -> String {
    if pending == 0 {
        return String::new();
    }
    let looked_at = w["looked_at"].as_i64().unwrap_or(0);
    let mut out =
        format!("why pending rows wait (the oldest {looked_at} pending rows looked at):\n");
    let reasons = w["reasons"].as_array().cloned().unwrap_or_default();
    if reasons.is_empty() {
        out.push_str(
            "  none of them has failed: waiting for their turn, for available_at, or for a relay to lease their partition\n",
        );
    }
    for r in &reasons {
        out.push_str(&format!(
            "  {} row(s) of {} key(s): {}\n",
            r["rows"],
            r["keys"],
            r["last_error"].as_str().unwrap_or_default()
        ));
    }
    out.push_str(&format!(
        "keys held: {} by nacks (retried with backoff until the broker takes them), {} by returns (no queue bound: parked after --max-attempts); {} of the rows looked at are theirs\n",
        w["keys_held"]["nack"], w["keys_held"]["returned"], w["rows_of_held_keys"]
    ));
    for k in w["held_keys"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "  {}/{} ({}, {} attempt(s))\n",
            k["aggregate_type"].as_str().unwrap_or_default(),
            k["aggregate_id"].as_str().unwrap_or_default(),
            k["cause"].as_str().unwrap_or_default(),
            k["attempts"]
        ));
    }
    out
}

/// `[0-3,7,9-10]` for a sorted list of partitions.
fn ranges(parts: &[i64]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < parts.len() {
        let start = parts[i];
        while i + 1 < parts.len() && parts[i + 1] == parts[i] + 1 {
            i += 1;
        }
        out.push(if parts[i] == start {
            start.to_string()
        } else {
            format!("{start}-{}", parts[i])
        });
        i += 1;
    }
    format!("[{}]", out.join(","))
}

/// One parked row as the operator sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct ParkedRow {
    pub id: i64,
    pub event_id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub seq: Option<i64>,
    pub attempts: i32,
    pub parked_at: String,
    pub reason: Option<String>,
}

const SELECT_PARKED: &str = "SELECT id, event_id, aggregate_type, aggregate_id, event_type, seq, attempts,
       to_char(parked_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), last_error
  FROM outbox_events
 WHERE parked_at IS NOT NULL
   AND (cardinality($1::bigint[]) + cardinality($2::uuid[]) = 0 OR id = ANY ($1) OR event_id = ANY ($2))
   AND ($3::text IS NULL OR event_type = $3)
   AND ($4::text IS NULL OR aggregate_type = $4)
   AND ($5::text IS NULL OR aggregate_id = $5)
   AND ($6::timestamptz IS NULL OR parked_at >= $6)
 ORDER BY id
 LIMIT $7";

/// Parked rows matching `filter`, oldest first, at most `limit`.
pub async fn parked(
    client: &Client,
    filter: &ParkedFilter,
    limit: i64,
) -> Result<Vec<ParkedRow>, DbError> {
    let rows = deadline(client.query(SELECT_PARKED, &filter.params(&limit))).await?;
    Ok(rows
        .iter()
        .map(|r| ParkedRow {
            id: r.get(0),
            event_id: r.get(1),
            aggregate_type: r.get(2),
            aggregate_id: r.get(3),
            event_type: r.get(4),
            seq: r.get(5),
            attempts: r.get(6),
            parked_at: r.get(7),
            reason: r.get(8),
        })
        .collect())
}

pub fn parked_json(rows: &[ParkedRow]) -> Value {
    Value::Array(
        rows.iter()
            .map(|r| {
                json!({
                    "id": r.id, "event_id": r.event_id.to_string(), "aggregate_type": r.aggregate_type,
                    "aggregate_id": r.aggregate_id, "event_type": r.event_type, "seq": r.seq,
                    "attempts": r.attempts, "parked_at": r.parked_at, "reason": r.reason,
                })
            })
            .collect(),
    )
}

pub fn parked_text(rows: &[ParkedRow]) -> String {
    let mut out = String::new();
    for r in rows {
        out.push_str(&format!(
            "{} {} {}/{} {} seq {} attempts {} parked {}: {}\n",
            r.id,
            r.event_id,
            r.aggregate_type,
            r.aggregate_id,
            r.event_type,
            r.seq.map_or("-".into(), |s| s.to_string()),
            r.attempts,
            r.parked_at,
            r.reason.as_deref().unwrap_or("")
        ));
    }
    out
}

/// What a re-drive did (or, dry, would do).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Redriven {
    pub rows: usize,
    pub keys: usize,
    pub renumbered_keys: usize,
    pub dry_run: bool,
}

impl Redriven {
    pub fn summary(&self) -> String {
        let verb = if self.dry_run {
            "dry run: would re-drive"
        } else {
            "re-drove"
        };
        let tail = if self.dry_run {
            "; nothing changed"
        } else {
            ""
        };
        format!(
            "{verb} {} parked row(s) of {} key(s) ({} key(s) get new seq numbers after their last){tail}",
            self.rows, self.keys, self.renumbered_keys
        )
    }
}

const REDRIVE: &str =
    "SELECT id, aggregate_type, aggregate_id, renumbered FROM outbox_redrive($1, $2)";

/// Puts the parked rows matching `filter` (all parked rows when it is empty) back to
/// pending, in one transaction, through `outbox_redrive`.
pub async fn redrive(
    client: &mut Client,
    filter: &ParkedFilter,
    dry_run: bool,
) -> Result<Redriven, DbError> {
    let tx = deadline(client.transaction()).await?;
    let ids: Vec<i64> = deadline(tx.query(
        &format!("{SELECT_PARKED} FOR UPDATE"),
        &filter.params(&i64::MAX),
    ))
    .await?
    .iter()
    .map(|r| r.get(0))
    .collect();
    let rows = deadline(tx.query(REDRIVE, &[&ids, &dry_run])).await?;
    let mut keys = std::collections::HashSet::new();
    let mut renumbered = std::collections::HashSet::new();
    for r in &rows {
        let key = (r.get::<_, String>(1), r.get::<_, String>(2));
        if r.get::<_, bool>(3) {
            renumbered.insert(key.clone());
        }
        keys.insert(key);
    }
    if dry_run {
        deadline(tx.rollback()).await?;
    } else {
        deadline(tx.commit()).await?;
    }
    Ok(Redriven {
        rows: rows.len(),
        keys: keys.len(),
        renumbered_keys: renumbered.len(),
        dry_run,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_ranges_read_well() {
        assert_eq!(ranges(&[0, 1, 2, 3, 7, 9, 10]), "[0-3,7,9-10]");
        assert_eq!(ranges(&[]), "[]");
        assert_eq!(ranges(&[5]), "[5]");
    }
}
