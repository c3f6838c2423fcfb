//! `--retention`: deletes dispatched rows older than the retention age, in small batches.
//!
//! Each batch is its own short statement (`LIMIT` + `SKIP LOCKED`), so no long lock is
//! held and several relays deleting at once do not wait on each other. Parked and pending
//! rows have no `dispatched_at` and are never touched. Uses `outbox_events_dispatched`.

use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;

use crate::db::{DbError, deadline};
use crate::telemetry::{Down, Telemetry};

const BATCH: i64 = 5_000;

const DELETE_BATCH: &str = "DELETE FROM outbox_events WHERE id IN (
    SELECT id FROM outbox_events
     WHERE dispatched_at IS NOT NULL AND dispatched_at < now() - make_interval(secs => $1)
     ORDER BY dispatched_at
     LIMIT $2
       FOR UPDATE SKIP LOCKED)";

/// Deletes one round of old dispatched rows (batch after batch until none is left).
pub async fn sweep(pool: &Pool, retention: Duration) -> Result<u64, DbError> {
    let client = deadline(pool.get()).await?;
    let stmt = deadline(client.prepare_cached(DELETE_BATCH)).await?;
    let secs = retention.as_secs_f64();
    let mut total = 0;
    loop {
        let n = deadline(client.execute(&stmt, &[&secs, &BATCH])).await?;
        total += n;
        if n < BATCH as u64 {
            return Ok(total);
        }
        // Let producers and the relay in between batches.
        tokio::task::yield_now().await;
    }
}

/// Sweeps every `retention / 10` (between 1 s and 1 min) until `shutdown`.
pub async fn run(pool: Pool, retention: Duration, tel: Telemetry, shutdown: CancellationToken) {
    let every = (retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(60));
    let mut down = Down::new("retention");
    loop {
        match sweep(&pool, retention).await {
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
