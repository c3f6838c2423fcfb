//! The bench's side of Postgres: a migrated template, a fresh database per measurement
//! (named `bench_<pid>_<n>`, dropped afterwards; those of dead bench processes are dropped
//! at start), the event payload, bulk backlogs, and producer connections.
//!
//! The payload is about 500 bytes of JSON, the same shape whether Postgres builds it
//! (`PAYLOAD_SQL`, for bulk backlogs) or the bench sends it ([`payload_json`], for
//! producers); both print identically once stored as jsonb, so the broker ceiling can
//! publish the very bytes the relay would.

use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};
use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;
use tokio_postgres::Client;

mod counters;

use counters::PG_COUNTERS;
pub use counters::PgCounters;

/// Builds the payload of event `g` (a bigint) in SQL.
const PAYLOAD_SQL: &str = "jsonb_build_object(
    'order_id', g,
    'customer_id', 'cust-' || lpad((g % 1000)::text, 6, '0'),
    'status', 'created', 'currency', 'EUR',
    'total_cents', (g * 7919) % 1000000,
    'placed_at', '2026-01-01T00:00:00.000000Z',
    'shipping', jsonb_build_object('name', 'Customer ' || (g % 1000), 'street', (g % 977) || ' Example Street',
                                   'city', 'Springfield', 'postcode', lpad((g % 99999)::text, 5, '0'), 'country', 'DE'),
    'items', jsonb_build_array(
        jsonb_build_object('sku', 'SKU-' || (g % 5000), 'qty', 1 + g % 5, 'price_cents', (g * 31) % 10000),
        jsonb_build_object('sku', 'SKU-' || ((g * 7) % 5000), 'qty', 1 + g % 3, 'price_cents', (g * 17) % 10000)),
    'note', repeat('x', 100))";

/// The same payload as `PAYLOAD_SQL`, as jsonb prints it (keys by length, then bytes).
pub fn payload_json(g: u64) -> String {
    format!(
        concat!(
            r#"{{"note": "{note}", "items": [{{"qty": {q1}, "sku": "SKU-{s1}", "price_cents": {p1}}}, "#,
            r#"{{"qty": {q2}, "sku": "SKU-{s2}", "price_cents": {p2}}}], "status": "created", "#,
            r#""currency": "EUR", "order_id": {g}, "shipping": {{"city": "Springfield", "#,
            r#""name": "Customer {c}", "street": "{st} Example Street", "country": "DE", "#,
            r#""postcode": "{pc:05}"}}, "placed_at": "2026-01-01T00:00:00.000000Z", "#,
            r#""customer_id": "cust-{c:06}", "total_cents": {tc}}}"#
        ),
        note = "x".repeat(100),
        q1 = 1 + g % 5,
        s1 = g % 5000,
        p1 = (g * 31) % 10000,
        q2 = 1 + g % 3,
        s2 = (g * 7) % 5000,
        p2 = (g * 17) % 10000,
        g = g,
        c = g % 1000,
        st = g % 977,
        pc = g % 99999,
        tc = (g * 7919) % 1_000_000,
    )
}

/// Reads the event number back from a published body without parsing all of it.
pub fn order_id_of(body: &[u8]) -> Option<u64> {
    const NEEDLE: &[u8] = b"\"order_id\": ";
    let at = body.windows(NEEDLE.len()).position(|w| w == NEEDLE)? + NEEDLE.len();
    let digits = body[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&body[at..at + digits])
        .ok()?
        .parse()
        .ok()
}

/// The producer's statement: one event, the four required columns (a complete producer
/// per the contract). `{table}` is `outbox_events` or the trigger-free copy.
pub fn insert_one_sql(table: &str) -> String {
    format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload)
         VALUES ('order', $1, 'created', $2::text::jsonb)"
    )
}

/// Where the server is, and the name of this bench run's template.
pub struct Admin {
    base_url: String,
    target: DbTarget,
    client: Client,
    template: String,
    counter: AtomicU64,
    /// Databases whose drop waits for [`Admin::close`] (`--smoke`), see [`Admin::drop_db`].
    deferred: Option<std::sync::Mutex<Vec<String>>>,
    /// Log every statement of the bench databases' sessions with its duration (auto_explain).
    auto_explain: bool,
}

impl Admin {
    /// Connects with `url` (any database on the server; it names the server and user),
    /// drops databases left by bench runs that died, and builds a migrated template.
    /// `defer_drops`: drop the measurements' databases only at [`Admin::close`].
    /// `auto_explain`: log every statement of the bench databases with its duration.
    pub async fn connect(url: &str, defer_drops: bool, auto_explain: bool) -> Result<Admin> {
        let target = DbTarget::parse(url).map_err(|e| anyhow::anyhow!("--database-url: {e}"))?;
        let client = target
            .connect(&Schema::default(), "outbox-bench-admin")
            .await
            .with_context(|| format!("cannot connect to postgres at {target:?}"))?;
        let template = format!("bench_{}_tpl", std::process::id());
        let admin = Admin {
            base_url: url.to_owned(),
            target,
            client,
            template,
            counter: AtomicU64::new(0),
            deferred: defer_drops.then(Default::default),
            auto_explain,
        };
        admin.drop_stale().await?;
        admin.build_template().await?;
        Ok(admin)
    }

    async fn drop_stale(&self) -> Result<()> {
        let rows = self
            .client
            .query(
                "SELECT datname FROM pg_database WHERE datname LIKE 'bench\\_%'",
                &[],
            )
            .await?;
        for row in rows {
            let name: String = row.get(0);
            let pid: Option<u32> = name.split('_').nth(1).and_then(|p| p.parse().ok());
            if pid.is_some_and(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()) {
                eprintln!("outbox-bench: dropping {name}, left by a bench run that died");
                self.drop_now(&name).await;
            }
        }
        Ok(())
    }

    async fn build_template(&self) -> Result<()> {
        self.drop_now(&self.template).await;
        self.client
            .batch_execute(&format!("CREATE DATABASE {}", self.template))
            .await
            .context("create the template database")?;
        let mut c = self
            .target
            .with_dbname(&self.template)
            .connect(&Schema::default(), "outbox-bench-admin")
            .await?;
        outbox_kit::schema::migrate(&mut c, &Schema::default())
            .await
            .context("migrate the template database")?;
        // The same table without the relay's triggers (LIKE copies columns, defaults,
        // identity, CHECK constraints and indexes, never triggers): the baseline producer.
        c.batch_execute("CREATE TABLE outbox_plain (LIKE outbox_events INCLUDING ALL)")
            .await?;
        Ok(())
    }

    /// A fresh migrated database.
    pub async fn create_db(&self) -> Result<BenchDb> {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let name = format!("bench_{}_{n}", std::process::id());
        self.client
            .batch_execute(&format!(
                "CREATE DATABASE {name} TEMPLATE {}",
                self.template
            ))
            .await
            .with_context(|| format!("create database {name}"))?;
        // Time spent inside outbox_claim, per call, for the profile (pg_stat_user_functions).
        // It costs two clock reads per PL/pgSQL call, the same in every run.
        self.client
            .batch_execute(&format!("ALTER DATABASE {name} SET track_functions = 'pl'"))
            .await?;
        if self.auto_explain {
            // For profiles: each statement, nested ones (inside outbox_claim) too, goes to
            // the server log with its executor time, named by this database.
            self.client
                .batch_execute(&format!(
                    "ALTER DATABASE {name} SET session_preload_libraries = 'auto_explain';
                     ALTER DATABASE {name} SET auto_explain.log_min_duration = 0;
                     ALTER DATABASE {name} SET auto_explain.log_nested_statements = on;
                     ALTER DATABASE {name} SET track_functions = 'all'"
                ))
                .await
                .context("--auto-explain")?;
        }
        let target = self.target.with_dbname(&name);
        let client = target
            .connect(&Schema::default(), "outbox-bench")
            .await
            .context("connect to the bench database")?;
        Ok(BenchDb {
            url: url_with_db(&self.base_url, &name),
            name,
            target,
            client,
        })
    }

    /// Drops a measurement's database, or with deferred drops notes it for
    /// [`Admin::close`]. Why defer: every DROP DATABASE waits for an immediate checkpoint,
    /// which flushes whatever the whole server wrote since the last one. The smoke makes
    /// about fifteen tiny databases; on a machine busy with other writers each drop took up
    /// to 9 s (0.2 s when idle), a third of a smoke run. The full bench drops at once: its
    /// databases hold millions of rows, and its drops fall between measurements anyway.
    pub async fn drop_db(&self, name: &str) {
        if let Some(deferred) = &self.deferred {
            deferred
                .lock()
                .expect("deferred drops")
                .push(name.to_owned());
            return;
        }
        self.drop_now(name).await;
    }

    async fn drop_now(&self, name: &str) {
        if let Err(e) = self
            .client
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await
        {
            eprintln!("outbox-bench: could not drop database {name}: {e}");
        }
    }

    pub async fn server_version(&self) -> Result<String> {
        let v: String = self
            .client
            .query_one("SHOW server_version", &[])
            .await?
            .get(0);
        Ok(format!("PostgreSQL {v}"))
    }

    /// Drops the deferred databases and the template.
    pub async fn close(self) {
        let deferred = self
            .deferred
            .as_ref()
            .map(|d| std::mem::take(&mut *d.lock().expect("deferred drops")))
            .unwrap_or_default();
        for name in deferred {
            self.drop_now(&name).await;
        }
        self.drop_now(&self.template).await;
    }
}

/// `url` with its database name replaced (URL form; key=value strings are not supported).
fn url_with_db(url: &str, db: &str) -> String {
    let (main, query) = match url.split_once('?') {
        Some((m, q)) => (m, Some(q)),
        None => (url, None),
    };
    let scheme_end = main.find("://").map_or(0, |i| i + 3);
    let host_part = match main[scheme_end..].find('/') {
        Some(i) => &main[..scheme_end + i],
        None => main,
    };
    match query {
        Some(q) => format!("{host_part}/{db}?{q}"),
        None => format!("{host_part}/{db}"),
    }
}

/// One measurement's database.
pub struct BenchDb {
    pub name: String,
    pub url: String,
    pub target: DbTarget,
    pub client: Client,
}

impl BenchDb {
    /// A new connection of its own (producers get one each).
    pub async fn connect(&self, application_name: &str) -> Result<Client> {
        Ok(self
            .target
            .connect(&Schema::default(), application_name)
            .await?)
    }

    /// Inserts `n` pending events numbered `first..first+n` over `keys` keys, in chunks
    /// (so one statement never holds hundreds of MB of WAL), then VACUUM ANALYZE so the
    /// drain starts from settled hint bits, visibility map and statistics, as a long-lived
    /// table would have.
    pub async fn insert_backlog(&self, first: u64, n: u64, keys: u64) -> Result<()> {
        self.insert_rows(first, n, keys, false).await?;
        self.client
            .batch_execute("VACUUM ANALYZE outbox_events")
            .await?;
        Ok(())
    }

    /// Inserts `n` rows that the relay already dispatched (history, for the growth test),
    /// with per-key seq numbers and `outbox_key_seq` consistent with them.
    pub async fn insert_history(&self, n: u64, keys: u64) -> Result<()> {
        self.insert_rows(0, n, keys, true).await?;
        self.client
            .batch_execute(
                "INSERT INTO outbox_key_seq (aggregate_type, aggregate_id, last_seq)
                 SELECT aggregate_type, aggregate_id, max(seq) FROM outbox_events
                  WHERE seq IS NOT NULL GROUP BY 1, 2
                 ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = excluded.last_seq",
            )
            .await?;
        // VACUUM refuses to run inside a multi-statement string (an implicit transaction).
        for table in ["outbox_events", "outbox_key_seq"] {
            self.client
                .batch_execute(&format!("VACUUM ANALYZE {table}"))
                .await?;
        }
        Ok(())
    }

    async fn insert_rows(&self, first: u64, n: u64, keys: u64, dispatched: bool) -> Result<()> {
        // Small chunks: each row takes its key's number at INSERT (sql/0015), and a statement
        // that bumps every counter hundreds of times walks ever longer row-version chains.
        const CHUNK: u64 = 10_000;
        let (extra_cols, extra_vals) = if dispatched {
            // Dispatched a day ago: old enough for any retention the bench sets, so
            // the retention run deletes exactly this history and none of its own drain.
            (
                ", dispatched_at, seq, attempts",
                ", now() - interval '1 day', g / $3 + 1, 1",
            )
        } else {
            ("", "")
        };
        let sql = format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload{extra_cols})
             SELECT 'order', 'k' || (g % $3), 'created', {PAYLOAD_SQL}{extra_vals}
               FROM generate_series($1::bigint, $2::bigint) AS g"
        );
        let stmt = self.client.prepare(&sql).await?;
        let keys = keys.max(1) as i64;
        let mut at = first;
        let end = first + n;
        while at < end {
            let last = (at + CHUNK).min(end) - 1;
            self.client
                .execute(&stmt, &[&(at as i64), &(last as i64), &keys])
                .await
                .context("insert events")?;
            at = last + 1;
        }
        Ok(())
    }

    /// Rows neither dispatched nor parked.
    /// Rows dispatched more than an hour ago (the growth history, dispatched a day ago).
    pub async fn old_dispatched(&self) -> Result<i64> {
        let sql = "SELECT count(*) FROM outbox_events
                    WHERE dispatched_at < now() - interval '1 hour'";
        Ok(self.client.query_one(sql, &[]).await?.get(0))
    }

    pub async fn pending(&self) -> Result<i64> {
        Ok(self
            .client
            .query_one(
                "SELECT count(*) FROM outbox_events WHERE dispatched_at IS NULL AND parked_at IS NULL",
                &[],
            )
            .await?
            .get(0))
    }

    /// (dispatched, parked) row counts.
    pub async fn settled_counts(&self) -> Result<(i64, i64)> {
        let row = self
            .client
            .query_one(
                "SELECT count(*) FILTER (WHERE dispatched_at IS NOT NULL),
                        count(*) FILTER (WHERE parked_at IS NOT NULL)
                   FROM outbox_events",
                &[],
            )
            .await?;
        Ok((row.get(0), row.get(1)))
    }

    /// Seconds from the Unix epoch to the first and last dispatched_at among rows with
    /// id > `after_id` (server clock; the same host clock the bench reads).
    pub async fn dispatch_span(&self, after_id: i64) -> Result<Option<(f64, f64)>> {
        let row = self
            .client
            .query_one(
                "SELECT extract(epoch FROM min(dispatched_at))::float8,
                        extract(epoch FROM max(dispatched_at))::float8
                   FROM outbox_events WHERE id > $1",
                &[&after_id],
            )
            .await?;
        let (a, b): (Option<f64>, Option<f64>) = (row.get(0), row.get(1));
        Ok(a.zip(b))
    }

    pub async fn max_id(&self) -> Result<i64> {
        Ok(self
            .client
            .query_one("SELECT coalesce(max(id), 0) FROM outbox_events", &[])
            .await?
            .get(0))
    }

    /// Whether some live relay has asked producers for the insert wake-up (it is idle).
    pub async fn wakeup_wanted(&self) -> Result<bool> {
        Ok(self
            .client
            .query_one(
                "SELECT coalesce(bool_or(wants_wakeup), false) FROM outbox_relays
                  WHERE heartbeat_at > now() - make_interval(secs => 3 * lease_secs)",
                &[],
            )
            .await?
            .get(0))
    }

    /// Reads [`PgCounters`] (after making this connection's own pending statistics visible).
    pub async fn pg_counters(&self) -> Result<PgCounters> {
        self.client
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await?;
        self.client.batch_execute("SELECT 1").await?;
        let r = self.client.query_one(PG_COUNTERS, &[]).await?;
        Ok(PgCounters {
            xact_commit: r.get(0),
            tup_upd: r.get(1),
            tup_hot_upd: r.get(2),
            heap_blks_read: r.get(3),
            heap_blks_hit: r.get(4),
            idx_blks_read: r.get(5),
            idx_blks_hit: r.get(6),
            claim_calls: r.get(7),
            claim_ms: r.get(8),
            pending_idx_blks: r.get(9),
            dead_tup: r.get(10),
            autovacuums: r.get(11),
            checkpoints: r.get(12),
            wal_bytes: r.get(13),
            wal_fpi: r.get(14),
        })
    }

    /// Waits (up to 5 s) until no other session is connected: a backend publishes its last
    /// statistics as it exits, so counters read after that are complete.
    pub async fn wait_alone(&self) -> Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            let others: i64 = self
                .client
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                    &[&self.name],
                )
                .await?
                .get(0);
            if others == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// The row id of each event, by its number in the payload (to join the relay's stage
    /// trace, which names rows by id, with the bench's times, kept by event number).
    pub async fn event_ids(&self) -> Result<Vec<(i64, i64)>> {
        let rows = self
            .client
            .query(
                "SELECT id, (payload->>'order_id')::bigint FROM outbox_events",
                &[],
            )
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// WAL written so far by the whole cluster, bytes (`pg_current_wal_lsn`).
    pub async fn wal_position(&self) -> Result<f64> {
        Ok(self
            .client
            .query_one(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8",
                &[],
            )
            .await?
            .get(0))
    }

    /// Pids of the other backends connected to this database, with their application names.
    pub async fn backends(&self) -> Result<Vec<(u32, String)>> {
        let rows = self
            .client
            .query(
                "SELECT pid, coalesce(application_name, '') FROM pg_stat_activity
                  WHERE datname = $1 AND pid <> pg_backend_pid()",
                &[&self.name],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| (r.get::<_, i32>(0) as u32, r.get(1)))
            .collect())
    }

    /// Pids of the backends connected to this database (for CPU attribution).
    pub async fn backend_pids(&self) -> Result<Vec<u32>> {
        let rows = self
            .client
            .query(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1",
                &[&self.name],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get::<_, i32>(0) as u32).collect())
    }

    /// Average stored payload size in bytes (jsonb printed as text), over a sample.
    pub async fn mean_payload_bytes(&self) -> Result<f64> {
        Ok(self
            .client
            .query_one(
                "SELECT coalesce(avg(octet_length(payload::text)), 0)::float8
                   FROM (SELECT payload FROM outbox_events ORDER BY id LIMIT 1000) s",
                &[],
            )
            .await?
            .get(0))
    }

    /// The first `n` payloads as the relay would publish them (jsonb printed as text).
    pub async fn sample_bodies(&self, n: i64) -> Result<Vec<String>> {
        let rows = self
            .client
            .query(
                "SELECT payload::text FROM outbox_events ORDER BY id LIMIT $1",
                &[&n],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }
}

#[cfg(test)]
mod tests;
