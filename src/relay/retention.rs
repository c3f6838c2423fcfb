//! `--retention`: deletes dispatched rows older than the retention age, in small batches.
//!
//! Each batch is its own short statement (`LIMIT` + `SKIP LOCKED`), so no long lock is
//! held and several relays deleting at once do not wait on each other; batches walk the
//! primary key, so a sweep costs what it deletes. Shutdown stops a sweep between (or in
//! the middle of) batches. Parked and pending rows have no `dispatched_at` and are never
//! touched.

use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_postgres::types::ToSql;
use tokio_util::sync::CancellationToken;

use outbox_kit::db::DbError;
use outbox_kit::internal::Down;
use outbox_kit::internal::deadline;

use crate::telemetry::Telemetry;

const BATCH: i64 = 5_000;

/// The newest id a sweep may delete: rows above it are younger than the cutoff (or were
/// when the sweep began). Read once per sweep; `outbox_events_dispatched` (BRIN) finds the
/// old block ranges.
const UPPER_ID: &str = "SELECT max(id) FROM outbox_events
     WHERE dispatched_at IS NOT NULL AND dispatched_at < now() - make_interval(secs => $1)";

/// One batch, walking the primary key upwards from where the last batch stopped: each
/// batch costs its own rows, never a re-scan or a sort of everything still to delete
/// (ordering by `dispatched_at` made every batch sort all old rows: minutes per sweep
/// with millions of them). `= ANY (ARRAY(...))` keeps the delete itself on the primary
/// key: with `IN (...)` the planner may hash-join against a scan of the whole table.
const DELETE_BATCH: &str = "WITH gone AS (
    DELETE FROM outbox_events WHERE id = ANY (ARRAY(
        SELECT id FROM outbox_events
         WHERE id > $2 AND id <= $3
           AND dispatched_at IS NOT NULL AND dispatched_at < now() - make_interval(secs => $1)
         ORDER BY id
         LIMIT $4
           FOR UPDATE SKIP LOCKED))
    RETURNING id)
  SELECT count(*), max(id) FROM gone";

/// Deletes one round of old dispatched rows (batch after batch until none is left, or
/// until `stop` is cancelled: a shutdown never waits for a long sweep).
pub async fn sweep(
    pool: &Pool,
    retention: Duration,
    stop: &CancellationToken,
) -> Result<u64, DbError> {
    let client = deadline(pool.get()).await?;
    let secs = retention.as_secs_f64();
    let upper: Option<i64> = deadline(client.query_one(UPPER_ID, &[&secs]))
        .await?
        .try_get(0)?;
    let Some(upper) = upper else { return Ok(0) };
    let stmt = deadline(client.prepare_cached(DELETE_BATCH)).await?;
    let (mut total, mut after) = (0, 0_i64);
    loop {
        let params: [&(dyn ToSql + Sync); 4] = [&secs, &after, &upper, &BATCH];
        let row = tokio::select! {
            _ = stop.cancelled() => return Ok(total),
            row = deadline(client.query_one(&stmt, &params)) => row?,
        };
        let n: i64 = row.try_get(0)?;
        total += n as u64;
        match row.try_get::<_, Option<i64>>(1)? {
            Some(last) if n == BATCH => after = last,
            _ => return Ok(total),
        }
        // Let producers and the relay in between batches.
        tokio::task::yield_now().await;
    }
}

/// Sweeps every `retention / 10` (between 1 s and 1 min) until `shutdown`.
pub(crate) async fn run(
    pool: Pool,
    retention: Duration,
    tel: Telemetry,
    shutdown: CancellationToken,
) {
    let every = (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(60));
    let mut down = Down::new("retention");
    loop {
        match sweep(&pool, retention, &shutdown).await {
            Ok(n) => {
                down.recovered();
                tel.retention_deleted(n);
            }
            Err(e) => down.failed(&e, every),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}
