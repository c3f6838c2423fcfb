//! The operator's side: `status`, `parked list` and `redrive`.
//!
//! Read-only commands read through the partial indexes (pending, parked, dispatched) so
//! they stay cheap on a large table. Re-driving goes through `outbox_redrive` (sql/0002),
//! the same function any other tool should call, so numbering rules live in one place;
//! `--dry-run` runs the same selection and reports without writing.

use std::time::SystemTime;

use serde_json::{Value, json};
use tokio_postgres::Client;
use uuid::Uuid;

use outbox_kit::db::{DbError, deadline};

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

/// Pending rows, and how long the oldest due one has been due (rows delayed into the future
/// do not count: they are not late).
const PENDING: &str = "SELECT count(*),
       extract(epoch FROM now() - min(greatest(created_at, available_at))
                 FILTER (WHERE available_at <= now()))::float8
  FROM outbox_events WHERE dispatched_at IS NULL AND parked_at IS NULL";
const PARKED_COUNT: &str = "SELECT count(*) FROM outbox_events WHERE parked_at IS NOT NULL";
const RECENT: &str = "SELECT count(*) FROM outbox_events WHERE dispatched_at IS NOT NULL AND dispatched_at > now() - interval '1 minute'";
const RELAYS: &str = "SELECT r.relay_id, r.host, r.pid, r.published,
       extract(epoch FROM now() - r.heartbeat_at)::float8 AS heartbeat_age,
       r.heartbeat_at > now() - make_interval(secs => r.lease_secs) AS alive,
       to_char(r.started_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS started,
       coalesce((SELECT array_agg(p.partition ORDER BY p.partition) FROM outbox_partitions p
                  WHERE p.owner = r.relay_id AND p.lease_until > now()), '{}') AS partitions
  FROM outbox_relays r ORDER BY r.started_at, r.relay_id";

/// A point-in-time view of the outbox, as `status --json` prints it.
pub async fn status(client: &Client) -> Result<Value, DbError> {
    let pending = deadline(client.query_one(PENDING, &[])).await?;
    let parked: i64 = deadline(client.query_one(PARKED_COUNT, &[])).await?.get(0);
    let recent: i64 = deadline(client.query_one(RECENT, &[])).await?.get(0);
    let relays = deadline(client.query(RELAYS, &[])).await?;
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
    Ok(json!({
        "pending": pending.get::<_, i64>(0),
        "oldest_pending_seconds": pending.get::<_, Option<f64>>(1).unwrap_or(0.0),
        "parked": parked,
        "dispatched_last_minute": recent,
        "relays_alive": relays.iter().filter(|r| r["alive"] == true).count(),
        "relays": relays,
    }))
}

/// The text form of [`status`].
pub fn status_text(s: &Value) -> String {
    let mut out = format!(
        "pending                 {}\noldest pending          {:.1}s\nparked                  {}\ndispatched, last minute {}\nrelays alive            {}\n",
        s["pending"],
        s["oldest_pending_seconds"].as_f64().unwrap_or(0.0),
        s["parked"],
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
