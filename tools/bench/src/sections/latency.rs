//! Measurement 3, steady latency: producers commit at a fixed rate; each event's latency
//! runs from its COMMIT returning to its arrival at a consumer, both read on this process's
//! clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;

use crate::amqp::{Arrivals, BenchBroker};
use crate::pg::{self, BenchDb};
use crate::stats::Summary;

use super::{Ctx, wait_until};

#[derive(Clone, Debug)]
pub struct Latency {
    pub target_rate: u64,
    pub listen: bool,
    pub poll_interval: String,
    pub achieved_rate: f64,
    pub summary: Summary,
    pub missing: usize,
    pub arrived_before_commit_returned: usize,
    pub warmup_events: usize,
    /// p50 per 5 s of the run: a rising series means the relay fell behind.
    pub p50_by_5s: Vec<f64>,
    /// What Postgres counted from the first producer commit to the relay's exit.
    pub pg: pg::PgCounters,
}

/// Producers commit one event per transaction at `rate` for the configured time; the
/// latency of each is from its COMMIT returning to the producer to its arrival at a
/// consumer of the bound queue. Both instants are read in this process, on one clock.
pub async fn latency(ctx: &Ctx, rate: u64, listen: bool) -> Result<Latency> {
    let db = ctx.admin.create_db().await?;
    let broker = BenchBroker::new(&ctx.amqp, &ctx.tag("latency")).await?;
    let result = latency_inner(ctx, &db, &broker, rate, listen).await;
    broker.delete().await;
    ctx.admin.drop_db(&db.name).await;
    result
}

async fn latency_inner(
    ctx: &Ctx,
    db: &BenchDb,
    broker: &BenchBroker,
    rate: u64,
    listen: bool,
) -> Result<Latency> {
    let total = ((rate as f64) * ctx.s.latency_secs).ceil().max(1.0) as usize;
    let warmup = ((rate as f64) * ctx.s.latency_warmup_secs) as usize;
    let warmup = warmup.min(total / 2);
    let probe = total; // one event before the run proves the whole path is up
    let arrivals = Arc::new(Arrivals::new(total + 1));
    let seen: &Arrivals = &arrivals;
    let stop_consumer = broker.consume(arrivals.clone()).await?;
    let mut settings = ctx.s.relay.clone();
    settings.listen = listen;
    let name = format!(
        "{}-latency-{rate}-{}",
        db.name,
        if listen { "listen" } else { "nolisten" }
    );
    let mut relay = ctx.start_relay(&name, db, broker, &settings)?;

    let insert = db
        .client
        .prepare(&pg::insert_one_sql("outbox_events"))
        .await?;
    db.client
        .execute(&insert, &[&"k0", &pg::payload_json(probe as u64)])
        .await?;
    arrivals.committed(probe as u64);
    wait_until(
        "the first event to arrive",
        Duration::from_secs(60),
        std::slice::from_mut(&mut relay),
        || async move { Ok(seen.has_arrived(probe as u64)) },
    )
    .await?;
    if listen {
        // Start from an idle relay that asked for the wake-up, as a quiet service would.
        wait_until(
            "the relay to go idle",
            Duration::from_secs(30),
            std::slice::from_mut(&mut relay),
            || async move { db.wakeup_wanted().await },
        )
        .await?;
    }

    let pg_before = db.pg_counters().await?;
    let result = open_loop(
        db,
        ctx.s.latency_producers,
        rate,
        total,
        ctx.s.keys,
        &arrivals,
    )
    .await;
    let limit = Duration::from_secs(30) + humantime::parse_duration(&settings.poll_interval)? * 2;
    let arrived = wait_until(
        "every event to arrive",
        limit,
        std::slice::from_mut(&mut relay),
        || async move { Ok(seen.arrived_count() > total) },
    )
    .await;
    stop_consumer.cancel();
    relay.stop()?;
    result?;
    if let Err(e) = arrived {
        eprintln!("outbox-bench: {e}; reporting the missing events");
    }
    db.wait_alone().await?;
    let pg = db.pg_counters().await?.minus(&pg_before);
    let (samples, missing, early) = arrivals.latencies(warmup..total);
    let span = arrivals.commit_span_s(warmup..total);
    Ok(Latency {
        target_rate: rate,
        listen,
        poll_interval: settings.poll_interval.clone(),
        achieved_rate: if span > 0.0 {
            (total - warmup) as f64 / span
        } else {
            0.0
        },
        summary: Summary::of(samples),
        missing,
        arrived_before_commit_returned: early,
        warmup_events: warmup,
        p50_by_5s: arrivals.p50_by_window(warmup..total, Duration::from_secs(5)),
        pg,
    })
}

/// `producers` connections commit events `0..total` on a fixed schedule (event i is due
/// at start + i/rate, whoever is free takes it), recording each commit.
async fn open_loop(
    db: &BenchDb,
    producers: usize,
    rate: u64,
    total: usize,
    keys: u64,
    arrivals: &Arc<Arrivals>,
) -> Result<()> {
    let next = Arc::new(AtomicU64::new(0));
    let start = tokio::time::Instant::now() + Duration::from_millis(200);
    let mut tasks = Vec::new();
    for p in 0..producers.max(1) {
        let client = db.connect(&format!("outbox-bench-producer-{p}")).await?;
        let (next, arrivals) = (next.clone(), arrivals.clone());
        tasks.push(tokio::spawn(async move {
            let stmt = client.prepare(&pg::insert_one_sql("outbox_events")).await?;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total as u64 {
                    return Ok::<_, anyhow::Error>(());
                }
                let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
                tokio::time::sleep_until(due).await;
                let key = format!("k{}", i % keys.max(1));
                client.execute(&stmt, &[&key, &pg::payload_json(i)]).await?;
                arrivals.committed(i);
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}
