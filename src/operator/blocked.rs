//! `consumer-blocked`: the keys of ordered consumer groups that wait for an operator after a
//! dead letter (`OnDead::BlockKey`), with how many of their later events are held.

use serde_json::{Value, json};
use tokio_postgres::Client;

use outbox_kit::db::DbError;
use outbox_kit::internal::deadline;

/// One blocked key as the operator sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockedKey {
    pub consumer: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// The seq of the dead-lettered event that blocked the key.
    pub seq: i64,
    pub blocked_at: String,
    pub reason: Option<String>,
    /// Later events of the key waiting in `outbox_inbox_held`.
    pub held: i64,
}

const SELECT_BLOCKED: &str = "SELECT k.consumer, k.aggregate_type, k.aggregate_id, k.blocked_seq,
       to_char(k.blocked_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), k.blocked_reason,
       (SELECT count(*) FROM outbox_inbox_held h
         WHERE h.consumer = k.consumer AND h.aggregate_type = k.aggregate_type
           AND h.aggregate_id = k.aggregate_id)
  FROM outbox_inbox_keys k
 WHERE k.blocked_seq IS NOT NULL
   AND ($1::text IS NULL OR k.consumer = $1)
 ORDER BY k.blocked_at, k.consumer, k.aggregate_type, k.aggregate_id
 LIMIT $2";

/// Blocked keys of `consumer` (of every group when `None`), longest blocked first, at most
/// `limit`.
pub async fn blocked(
    client: &Client,
    consumer: Option<&str>,
    limit: i64,
) -> Result<Vec<BlockedKey>, DbError> {
    let rows = deadline(client.query(SELECT_BLOCKED, &[&consumer, &limit])).await?;
    Ok(rows
        .iter()
        .map(|r| BlockedKey {
            consumer: r.get(0),
            aggregate_type: r.get(1),
            aggregate_id: r.get(2),
            seq: r.get(3),
            blocked_at: r.get(4),
            reason: r.get(5),
            held: r.get(6),
        })
        .collect())
}

pub fn blocked_json(keys: &[BlockedKey]) -> Value {
    Value::Array(
        keys.iter()
            .map(|k| {
                json!({
                    "consumer": k.consumer, "aggregate_type": k.aggregate_type,
                    "aggregate_id": k.aggregate_id, "seq": k.seq, "blocked_at": k.blocked_at,
                    "reason": k.reason, "held": k.held,
                })
            })
            .collect(),
    )
}

/// One line per key, then how to release one.
pub fn blocked_text(keys: &[BlockedKey]) -> String {
    let mut out = String::new();
    for k in keys {
        out.push_str(&format!(
            "{} {}/{} blocked at seq {} since {}: {}; {} later event(s) held\n",
            k.consumer,
            k.aggregate_type,
            k.aggregate_id,
            k.seq,
            k.blocked_at,
            k.reason.as_deref().unwrap_or("no reason recorded"),
            k.held
        ));
    }
    match keys.first() {
        None => out.push_str("no blocked keys\n"),
        Some(k) => out.push_str(&format!(
            "{} blocked key(s) shown; release one with: outbox-relay consumer-release --consumer {} --key {}/{}\n",
            keys.len(),
            k.consumer,
            k.aggregate_type,
            k.aggregate_id
        )),
    }
    out
}
