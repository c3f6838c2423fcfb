//! Measurement 3, steady latency: producers commit at a fixed rate; each event's latency
//! runs from its COMMIT returning to its arrival at a consumer, both read on this process's
//! clock. The same schedule runs against our relay (with LISTEN, traced stage by stage, and
//! with `--no-listen`), against the yardstick (the simplest correct relay, `yardstick.rs`)
//! and against no relay at all (the producers' own INSERT latency and load on Postgres).
//! Each run also reports Postgres CPU per event (its backends, from /proc) and WAL bytes
//! per event.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::amqp::{Arrivals, BenchBroker};
use crate::pg::{self, BenchDb};
use crate::procfs::{Snapshot, cpu_of};
use crate::relay::RelayProcess;
use crate::stages::{Breakdown, Trace};
use crate::stats::Summary;

use super::floor::{Floor, floor};
use super::{Ctx, open_loop, wait_until};

/// What takes the events from the table to the broker in one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runner {
    /// outbox-relay, with LISTEN or `--no-listen`.
    Relay { listen: bool },
    /// The simplest correct relay, woken by a NOTIFY per insert.
    Yardstick,
    /// Nothing: producers only.
    NoRelay,
}

impl Runner {
    /// The runs at each rate, in order.
    pub const ALL: [Runner; 4] = [
        Runner::Relay { listen: true },
        Runner::Relay { listen: false },
        Runner::Yardstick,
        Runner::NoRelay,
    ];

    pub fn id(self) -> &'static str {
        match self {
            Runner::Relay { listen: true } => "outbox_relay",
            Runner::Relay { listen: false } => "outbox_relay_no_listen",
            Runner::Yardstick => "yardstick",
            Runner::NoRelay => "no_relay",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Runner::Relay { listen: true } => "outbox-relay, LISTEN",
            Runner::Relay { listen: false } => "outbox-relay, --no-listen",
            Runner::Yardstick => "yardstick (NOTIFY per insert, SKIP LOCKED)",
            Runner::NoRelay => "no relay (producers only)",
        }
    }
}

/// CPU and WAL spent from the first producer commit to every event marked.
#[derive(Clone, Debug, Default)]
pub struct Load {
    /// Events committed over that span.
    pub events: usize,
    pub wall_s: f64,
    /// The relay process (or the yardstick's).
    pub relay_cpu_s: f64,
    /// Postgres backends of the relay's connections.
    pub pg_relay_cpu_s: f64,
    /// Postgres backends of the producers' connections.
    pub pg_producers_cpu_s: f64,
    /// WAL the whole cluster wrote (others' work included; the bench is meant to run alone).
    pub wal_bytes: f64,
}

impl Load {
    /// Microseconds (or bytes) per event.
    pub fn per_event(&self, x: f64) -> f64 {
        x / self.events.max(1) as f64
    }

    pub fn pg_cpu_s(&self) -> f64 {
        self.pg_relay_cpu_s + self.pg_producers_cpu_s
    }
}

#[derive(Clone, Debug)]
pub struct Latency {
    pub target_rate: u64,
    pub runner: Runner,
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
    /// The producers' INSERT (autocommit) round trips.
    pub insert: Summary,
    pub load: Load,
    /// The broker's and the wake-up's hops alone at this rate (beside our relay with LISTEN).
    pub floor: Option<Floor>,
    /// Per-stage latency of our relay with LISTEN (from its stage trace).
    pub stages: Option<Breakdown>,
}

impl Latency {
    pub fn listen(&self) -> bool {
        self.runner == Runner::Relay { listen: true }
    }
}

/// Producers commit one event per transaction at `rate` for the configured time; the
/// latency of each is from its COMMIT returning to the producer to its arrival at a
/// consumer of the bound queue. Both instants are read in this process, on one clock.
pub async fn latency(ctx: &Ctx, rate: u64, runner: Runner) -> Result<Latency> {
    // The floor first, on a quiet broker and database, beside the run it is compared with.
    let floor = match runner {
        Runner::Relay { listen: true } => Some(floor(ctx, rate).await?),
        _ => None,
    };
    let db = ctx.admin.create_db().await?;
    let broker = BenchBroker::new(&ctx.amqp, &ctx.tag("latency")).await?;
    let result = latency_inner(ctx, &db, &broker, rate, runner)
        .await
        .map(|l| Latency { floor, ..l });
    broker.delete().await;
    ctx.admin.drop_db(&db.name).await;
    result
}

async fn latency_inner(
    ctx: &Ctx,
    db: &BenchDb,
    broker: &BenchBroker,
    rate: u64,
    runner: Runner,
) -> Result<Latency> {
    let total = ((rate as f64) * ctx.s.latency_secs).ceil().max(1.0) as usize;
    let warmup = ((rate as f64) * ctx.s.latency_warmup_secs) as usize;
    let warmup = warmup.min(total / 2);
    let probe = total; // one event before the run proves the whole path is up
    let arrivals = Arc::new(Arrivals::new(total + 1));
    let seen: &Arrivals = &arrivals;
    let stop_consumer = broker.consume(arrivals.clone()).await?;
    let mut settings = ctx.s.relay.clone();
    let name = format!("{}-latency-{rate}-{}", db.name, runner.id());
    let trace_path = ctx.launcher.log_dir.join(format!("{name}.trace"));
    let mut relay: Vec<RelayProcess> = match runner {
        Runner::Relay { listen } => {
            settings.listen = listen;
            settings.stage_trace = listen.then(|| trace_path.clone());
            vec![ctx.start_relay(&name, db, broker, &settings)?]
        }
        Runner::Yardstick => {
            db.client
                .batch_execute(crate::yardstick::INSTALL_TRIGGER)
                .await?;
            vec![
                ctx.launcher
                    .start_yardstick(&name, &db.url, &broker.exchange, &settings)?,
            ]
        }
        Runner::NoRelay => Vec::new(),
    };

    if !relay.is_empty() {
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
            &mut relay,
            || async move { Ok(seen.has_arrived(probe as u64)) },
        )
        .await?;
        wait_until(
            "the first event to be marked",
            Duration::from_secs(30),
            &mut relay,
            || async move { Ok(db.pending().await? == 0) },
        )
        .await?;
    }
    if runner == (Runner::Relay { listen: true }) {
        // Start from an idle relay that asked for the wake-up, as a quiet service would.
        wait_until(
            "the relay to go idle",
            Duration::from_secs(30),
            &mut relay,
            || async move { db.wakeup_wanted().await },
        )
        .await?;
    }

    let pg_before = db.pg_counters().await?;
    let wal_before = db.wal_position().await?;
    let cpu_before = Snapshot::take();
    // Producers that cannot keep the schedule (a NOTIFY per commit serializes commits) stop
    // taking events at twice the planned time: the run reports what they committed.
    let stop_after = Duration::from_secs_f64(ctx.s.latency_secs * 2.0 + 5.0);
    let producers = open_loop(
        db,
        ctx.s.latency_producers,
        rate,
        (total, stop_after),
        ctx.s.keys,
        &arrivals,
    )
    .await;
    let committed = arrivals.committed_count(0..total);
    let mut arrived = Ok(());
    if !relay.is_empty() && producers.is_ok() {
        let limit =
            Duration::from_secs(30) + humantime::parse_duration(&settings.poll_interval)? * 2;
        arrived = wait_until("every event to arrive", limit, &mut relay, || async move {
            Ok(seen.arrived_count() > committed)
        })
        .await;
        if arrived.is_ok() {
            arrived = wait_until("every event to be marked", limit, &mut relay, || async {
                Ok(db.pending().await? == 0)
            })
            .await;
        }
    }
    // Read while every connection is still open: a backend's CPU time goes with it.
    let backends = db.backends().await?;
    let cpu_after = Snapshot::take();
    let wal_after = db.wal_position().await?;
    let producers = producers?;
    let pids = |producer: bool| -> HashSet<u32> {
        backends
            .iter()
            .filter(|(_, app)| app != "outbox-bench")
            .filter(|(_, app)| app.starts_with("outbox-bench-producer") == producer)
            .map(|(pid, _)| *pid)
            .collect()
    };
    let load = Load {
        events: committed,
        wall_s: cpu_after.at().duration_since(cpu_before.at()).as_secs_f64(),
        relay_cpu_s: cpu_of(
            &cpu_before,
            &cpu_after,
            &relay.iter().map(|r| r.pid).collect(),
        ),
        pg_relay_cpu_s: cpu_of(&cpu_before, &cpu_after, &pids(false)),
        pg_producers_cpu_s: cpu_of(&cpu_before, &cpu_after, &pids(true)),
        wal_bytes: wal_after - wal_before,
    };
    drop(producers);
    stop_consumer.cancel();
    for r in relay {
        r.stop()?;
    }
    if let Err(e) = arrived {
        eprintln!("outbox-bench: {e}; reporting the missing events");
    }
    db.wait_alone().await?;
    let pg = db.pg_counters().await?.minus(&pg_before);
    let stages = if runner == (Runner::Relay { listen: true }) {
        Some(breakdown(db, &arrivals, warmup..total, &trace_path).await?)
    } else {
        None
    };
    let (samples, missing, early) = if runner == Runner::NoRelay {
        (Vec::new(), 0, 0)
    } else {
        arrivals.latencies(warmup..total)
    };
    let span = arrivals.commit_span_s(warmup..total);
    Ok(Latency {
        target_rate: rate,
        runner,
        poll_interval: settings.poll_interval.clone(),
        achieved_rate: if span > 0.0 {
            arrivals.committed_count(warmup..total) as f64 / span
        } else {
            0.0
        },
        summary: Summary::of(samples),
        missing,
        arrived_before_commit_returned: early,
        warmup_events: warmup,
        p50_by_5s: if runner == Runner::NoRelay {
            Vec::new()
        } else {
            arrivals.p50_by_window(warmup..total, Duration::from_secs(5))
        },
        pg,
        insert: Summary::of(arrivals.insert_ms(warmup..total)),
        load,
        floor: None,
        stages,
    })
}

/// Joins the relay's stage trace with the bench's commit and arrival times of `range`.
async fn breakdown(
    db: &BenchDb,
    arrivals: &Arrivals,
    range: std::ops::Range<usize>,
    trace: &std::path::Path,
) -> Result<Breakdown> {
    let text = std::fs::read_to_string(trace)
        .with_context(|| format!("read the relay's stage trace {}", trace.display()))?;
    let ids: HashMap<i64, i64> = db
        .event_ids()
        .await?
        .into_iter()
        .map(|(id, n)| (n, id))
        .collect();
    let events: Vec<(i64, u128, u128)> = range
        .filter_map(|n| {
            let id = ids.get(&(n as i64))?;
            let (c, a) = arrivals.commit_and_arrival_unix(n)?;
            Some((*id, c, a))
        })
        .collect();
    Ok(Breakdown::of(&Trace::parse(&text), &events))
}
