//! Measurement 2, the backlog drain (and 6, the relay's resources): a prepared backlog of
//! pending rows drained by one relay, timed until every row is dispatched and every message
//! is queued.

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};

use crate::amqp::BenchBroker;
use crate::pg::{self, BenchDb};
use crate::procfs::{CpuSplit, Snapshot};
use crate::relay::{Profiler, RelaySettings, Usage};

use super::{Ctx, wait_until};

/// A database with a backlog of `events` pending rows, ready to drain.
pub struct Backlog {
    pub db: BenchDb,
    pub after_id: i64,
    pub events: u64,
    pub insert_s: f64,
}

pub async fn prepare_backlog(ctx: &Ctx, events: u64, history: u64) -> Result<(Backlog, f64)> {
    let db = ctx.admin.create_db().await?;
    let t = Instant::now();
    if history > 0 {
        db.insert_history(history, ctx.s.keys).await?;
    }
    let history_s = t.elapsed().as_secs_f64();
    let after_id = db.max_id().await?;
    let t = Instant::now();
    db.insert_backlog(history, events, ctx.s.keys).await?;
    Ok((
        Backlog {
            db,
            after_id,
            events,
            insert_s: t.elapsed().as_secs_f64(),
        },
        history_s,
    ))
}

#[derive(Clone, Debug)]
pub struct Drain {
    pub events: u64,
    pub settings: RelaySettings,
    /// From starting the relay process to every row dispatched and every message queued.
    pub seconds: f64,
    pub rate: f64,
    /// From starting the relay process to the first dispatched_at.
    pub startup_s: f64,
    /// Rate between the first and the last dispatched_at (without start-up).
    pub steady_rate: f64,
    pub usage: Usage,
    pub cpu: CpuSplit,
    /// What Postgres counted for the bench database during the drain.
    pub pg: pg::PgCounters,
    pub payload_bytes: f64,
}

impl Drain {
    pub fn cpu_per_100k(&self, cpu_s: f64) -> f64 {
        cpu_s * 100_000.0 / self.events as f64
    }
}

/// Starts the relay on a prepared backlog and measures until every row is dispatched and
/// every message is in the bound queue. Drops the database afterwards.
pub async fn drain(
    ctx: &Ctx,
    backlog: Backlog,
    settings: &RelaySettings,
    profile: bool,
) -> Result<Drain> {
    let result = drain_keep(ctx, &backlog, settings, profile).await;
    ctx.admin.drop_db(&backlog.db.name).await;
    result
}

/// [`drain`] that keeps the database (its rows stay, dispatched).
pub(super) async fn drain_keep(
    ctx: &Ctx,
    backlog: &Backlog,
    settings: &RelaySettings,
    profile: bool,
) -> Result<Drain> {
    let broker = BenchBroker::new(&ctx.amqp, &ctx.tag("drain")).await?;
    let result = drain_inner(ctx, backlog, &broker, settings, profile).await;
    broker.purge().await.ok();
    broker.delete().await;
    result
}

async fn drain_inner(
    ctx: &Ctx,
    backlog: &Backlog,
    broker: &BenchBroker,
    settings: &RelaySettings,
    profile: bool,
) -> Result<Drain> {
    let db = &backlog.db;
    let n = backlog.events;
    let payload_bytes = db.mean_payload_bytes().await?;
    let name = format!(
        "{}-drain-b{}-c{}",
        db.name, settings.batch_size, settings.channels
    );
    let pg_before = db.pg_counters().await?;
    let before = Snapshot::take();
    let spawned_wall = SystemTime::now();
    let spawned = Instant::now();
    let mut relay = ctx.start_relay(&name, db, broker, settings)?;
    let profiler = match (&ctx.drain_profiler, profile) {
        (Some(cmd), true) => Some(Profiler::start(cmd)?),
        _ => None,
    };
    let limit = Duration::from_secs(60 + n / 200);
    let queued = wait_until(
        "every message in the queue",
        limit,
        std::slice::from_mut(&mut relay),
        || async move { Ok(u64::from(broker.depth().await?) >= n) },
    )
    .await;
    let marked = match queued {
        Ok(()) => {
            wait_until(
                "every row dispatched",
                limit,
                std::slice::from_mut(&mut relay),
                || async move { Ok(db.pending().await? == 0) },
            )
            .await
        }
        Err(e) => Err(e),
    };
    let seconds = spawned.elapsed().as_secs_f64();
    let backends: HashSet<u32> = db.backend_pids().await?.into_iter().collect();
    let after = Snapshot::take();
    if let Some(p) = profiler {
        p.stop();
    }
    let cpu = CpuSplit::between(&before, &after, Some(relay.pid), &backends);
    let usage = relay.stop()?;
    marked?;
    db.wait_alone().await?;
    let pg = db.pg_counters().await?.minus(&pg_before);

    let (dispatched, parked) = db.settled_counts().await?;
    let depth = broker.depth().await?;
    if dispatched < n as i64 || parked != 0 || u64::from(depth) != n {
        bail!("drain incomplete: {dispatched} dispatched, {parked} parked, {depth} queued of {n}");
    }
    let (first, last) = db
        .dispatch_span(backlog.after_id)
        .await?
        .context("no dispatched rows")?;
    let spawned_unix = spawned_wall
        .duration_since(SystemTime::UNIX_EPOCH)?
        .as_secs_f64();
    Ok(Drain {
        events: n,
        settings: settings.clone(),
        seconds,
        rate: n as f64 / seconds,
        startup_s: (first - spawned_unix).max(0.0),
        steady_rate: if last > first {
            n as f64 / (last - first)
        } else {
            0.0
        },
        usage,
        cpu,
        pg,
        payload_bytes,
    })
}
