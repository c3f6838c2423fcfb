//! Postgres's cumulative counters for a bench database, read before and after a measurement.

/// Postgres's own cumulative counters for the bench database's `outbox_events`; subtract
/// two readings to see what Postgres did in between.
#[derive(Clone, Debug, Default)]
pub struct PgCounters {
    pub xact_commit: i64,
    pub tup_upd: i64,
    pub tup_hot_upd: i64,
    /// Blocks read from outside shared_buffers (the OS cache or disk) and found inside.
    pub heap_blks_read: i64,
    pub heap_blks_hit: i64,
    pub idx_blks_read: i64,
    pub idx_blks_hit: i64,
    pub claim_calls: i64,
    pub claim_ms: f64,
    /// Blocks of the pending-rows index (the claim's scan) hit or read.
    pub pending_idx_blks: i64,
    /// Dead row versions in the table at the later reading (not a difference).
    pub dead_tup: i64,
    pub autovacuums: i64,
    /// Checkpoints started, whole cluster (the bench is its only busy user).
    pub checkpoints: i64,
    /// WAL written, whole cluster: bytes and full-page images.
    pub wal_bytes: i64,
    pub wal_fpi: i64,
}

impl PgCounters {
    pub fn minus(&self, before: &PgCounters) -> PgCounters {
        PgCounters {
            xact_commit: self.xact_commit - before.xact_commit,
            tup_upd: self.tup_upd - before.tup_upd,
            tup_hot_upd: self.tup_hot_upd - before.tup_hot_upd,
            heap_blks_read: self.heap_blks_read - before.heap_blks_read,
            heap_blks_hit: self.heap_blks_hit - before.heap_blks_hit,
            idx_blks_read: self.idx_blks_read - before.idx_blks_read,
            idx_blks_hit: self.idx_blks_hit - before.idx_blks_hit,
            claim_calls: self.claim_calls - before.claim_calls,
            claim_ms: self.claim_ms - before.claim_ms,
            pending_idx_blks: self.pending_idx_blks - before.pending_idx_blks,
            dead_tup: self.dead_tup,
            autovacuums: self.autovacuums - before.autovacuums,
            checkpoints: self.checkpoints - before.checkpoints,
            wal_bytes: self.wal_bytes - before.wal_bytes,
            wal_fpi: self.wal_fpi - before.wal_fpi,
        }
    }
}

pub(super) const PG_COUNTERS: &str = "SELECT
    (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),
    t.n_tup_upd, t.n_tup_hot_upd,
    coalesce(io.heap_blks_read, 0), coalesce(io.heap_blks_hit, 0),
    coalesce((SELECT sum(idx_blks_read) FROM pg_statio_user_indexes i WHERE i.relid = t.relid), 0)::bigint,
    coalesce((SELECT sum(idx_blks_hit) FROM pg_statio_user_indexes i WHERE i.relid = t.relid), 0)::bigint,
    coalesce((SELECT calls FROM pg_stat_user_functions WHERE funcname = 'outbox_claim'), 0),
    coalesce((SELECT total_time FROM pg_stat_user_functions WHERE funcname = 'outbox_claim'), 0)::float8,
    coalesce((SELECT idx_blks_hit + idx_blks_read FROM pg_statio_user_indexes
               WHERE indexrelname = 'outbox_events_pending'), 0),
    t.n_dead_tup, t.autovacuum_count,
    (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter),
    (SELECT wal_bytes::bigint FROM pg_stat_wal), (SELECT wal_fpi FROM pg_stat_wal)
  FROM pg_stat_user_tables t JOIN pg_statio_user_tables io USING (relid)
 WHERE t.relname = 'outbox_events'";
