//! The measurements of issue 6, one function each. Every one builds its own database and
//! broker names, runs the relay as a child process, checks that what it measured really
//! happened (every row dispatched, every message queued or received) and cleans up.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use futures_util::StreamExt;
use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::Schema;
use tokio_postgres::AsyncMessage;

use crate::amqp::{self, Arrivals, BenchBroker, Ceiling};
use crate::pg::{self, Admin, BenchDb};
use crate::procfs::{CpuSplit, Snapshot};
use crate::relay::{Launcher, Profiler, RelayProcess, RelaySettings, Usage};
use crate::stats::Summary;

/// Everything the measurements share.
pub struct Ctx {
    pub s: Settings,
    pub admin: Admin,
    pub amqp: AmqpTarget,
    pub launcher: Launcher,
    /// A command run around the main drain (for example `perf record -a -g -o FILE`).
    pub drain_profiler: Option<String>,
    runs: AtomicU64,
}

/// Sizes and durations of one bench run (full or smoke).
#[derive(Clone, Debug)]
pub struct Settings {
    pub smoke: bool,
    pub events: u64,
    pub keys: u64,
    pub relay: RelaySettings,
    pub latency_rates: Vec<u64>,
    pub latency_secs: f64,
    pub latency_warmup_secs: f64,
    pub latency_producers: usize,
    pub producer_secs: f64,
    pub producer_warmup_secs: f64,
    pub producers: usize,
    pub producer_rounds: usize,
    pub wakeup_samples: usize,
    pub wakeup_spacing: Duration,
    pub growth_rows: u64,
    pub growth_rounds: usize,
    pub sweep_batches: Vec<usize>,
    pub sweep_channels: Vec<usize>,
    pub sweep_events: u64,
    pub scale_relays: Vec<usize>,
    pub scale_events: u64,
}

impl Ctx {
    pub fn new(
        s: Settings,
        admin: Admin,
        amqp: AmqpTarget,
        launcher: Launcher,
        drain_profiler: Option<String>,
    ) -> Ctx {
        Ctx {
            s,
            admin,
            amqp,
            launcher,
            drain_profiler,
            runs: AtomicU64::new(0),
        }
    }

    fn tag(&self, what: &str) -> String {
        format!("{what}{}", self.runs.fetch_add(1, Ordering::Relaxed))
    }

    fn start_relay(
        &self,
        name: &str,
        db: &BenchDb,
        broker: &BenchBroker,
        s: &RelaySettings,
    ) -> Result<RelayProcess> {
        self.launcher.start(name, &db.url, &broker.exchange, s)
    }
}

/// Polls `check` every 20 ms until it returns true; fails after `limit` with `what`.
/// Each of `relays` is checked for an early exit on each round.
async fn wait_until<F, Fut>(
    what: &str,
    limit: Duration,
    relays: &mut [RelayProcess],
    mut check: F,
) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await? {
            return Ok(());
        }
        for r in relays.iter_mut() {
            r.check_alive()?;
        }
        if Instant::now() > deadline {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------------------------------
// 1. Broker ceiling

/// Publishes `n` messages raw (no database) with `channels` and the relay's window.
pub async fn broker_ceiling(
    ctx: &Ctx,
    bodies: Arc<Vec<String>>,
    n: u64,
    channels: usize,
) -> Result<Ceiling> {
    let broker = BenchBroker::new(&ctx.amqp, &ctx.tag("ceiling")).await?;
    let before = Snapshot::take();
    let result = amqp::ceiling(
        &ctx.amqp,
        &broker,
        bodies,
        n,
        ctx.s.keys,
        channels,
        ctx.s.relay.confirm_window,
    )
    .await;
    let after = Snapshot::take();
    // Every message confirmed must be in the bound queue.
    let depth = broker.depth().await.unwrap_or(0);
    broker.purge().await.ok();
    broker.delete().await;
    let mut c = result?;
    c.cpu = CpuSplit::between(&before, &after, None, &HashSet::new());
    if u64::from(depth) != n {
        bail!("broker confirmed {n} messages but the queue holds {depth}");
    }
    Ok(c)
}

/// The broker ceiling measured before and, when the drain ran, after it. The drain is
/// compared with their mean, so a machine that got busier or quieter in between shows up
/// as a spread between the two rather than as a wrong ratio.
#[derive(Clone, Debug)]
pub struct CeilingRuns {
    pub runs: Vec<Ceiling>,
}

impl CeilingRuns {
    pub fn rate(&self) -> f64 {
        self.runs.iter().map(|c| c.rate).sum::<f64>() / self.runs.len().max(1) as f64
    }

    pub fn first(&self) -> &Ceiling {
        &self.runs[0]
    }
}

// ---------------------------------------------------------------------------------------
// 2. Backlog drain (and 6. the relay's resources)

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
async fn drain_keep(
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

// ---------------------------------------------------------------------------------------
// 3. Steady latency

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

// ---------------------------------------------------------------------------------------
// 4. Producer cost

#[derive(Clone, Debug)]
pub struct ProducerRun {
    pub id: &'static str,
    pub what: &'static str,
    /// Which pair of busy runs it belongs to (1, 2, ...); `None` for the others.
    pub round: Option<usize>,
    pub tx_per_s: f64,
    pub commits: u64,
    /// NOTIFYs a listener saw during the run (`None` when nobody listened).
    pub notifies: Option<u64>,
}

#[derive(Clone, Debug)]
pub struct ProducerCost {
    pub producers: usize,
    pub seconds: f64,
    pub runs: Vec<ProducerRun>,
    pub wakeup: Summary,
    pub wakeup_missing: usize,
    /// The relay still had pending rows when the busy runs ended (so it was busy throughout).
    pub busy_throughout: bool,
    pub busy_backlog: u64,
}

impl ProducerCost {
    pub fn rate(&self, id: &str) -> Option<f64> {
        self.runs.iter().find(|r| r.id == id).map(|r| r.tx_per_s)
    }

    fn busy_rate(&self, id: &str, round: Option<usize>) -> Option<f64> {
        self.runs
            .iter()
            .find(|r| r.id == id && r.round == round)
            .map(|r| r.tx_per_s)
    }

    /// Per pair of busy runs: outbox_events against the table without triggers.
    pub fn busy_ratios(&self) -> Vec<f64> {
        (1..)
            .map_while(|round| {
                Some(
                    self.busy_rate("outbox_relay_busy", Some(round))?
                        / self.busy_rate("plain_relay_busy", Some(round))?,
                )
            })
            .collect()
    }

    /// The median of [`Self::busy_ratios`]: each pair ran back to back, so a drift of the
    /// machine's load over the section moves both of a pair alike.
    pub fn busy_ratio(&self) -> Option<f64> {
        let mut r = self.busy_ratios();
        r.sort_by(f64::total_cmp);
        r.get(r.len() / 2).copied()
    }

    /// The trigger-free baseline with the relay stopped: the mean of its first and last run.
    pub fn plain(&self) -> f64 {
        let v: Vec<f64> = ["plain", "plain_end"]
            .iter()
            .filter_map(|id| self.rate(id))
            .collect();
        v.iter().sum::<f64>() / v.len().max(1) as f64
    }

    /// What a run is compared with: the trigger-free table in the same relay state (a busy
    /// run: the other run of its pair).
    pub fn baseline_of(&self, run: &ProducerRun) -> f64 {
        if run.id == "outbox_relay_busy" {
            self.busy_rate("plain_relay_busy", run.round)
                .unwrap_or(f64::NAN)
        } else {
            self.plain()
        }
    }
}

/// Counts NOTIFYs on the relay's channel from a connection of the bench's own.
struct NotifyCounter {
    _client: tokio_postgres::Client,
    count: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl NotifyCounter {
    async fn start(db: &BenchDb) -> Result<NotifyCounter> {
        let schema = Schema::default();
        let (client, mut connection) = db
            .target
            .connect_dedicated(&schema, "outbox-bench-listen")
            .await?;
        let count = Arc::new(AtomicU64::new(0));
        let c = count.clone();
        let task = tokio::spawn(async move {
            let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(Ok(m)) = messages.next().await {
                if matches!(m, AsyncMessage::Notification(_)) {
                    c.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        let channel = schema.notify_channel();
        client
            .batch_execute(&format!("LISTEN \"{channel}\""))
            .await?;
        Ok(NotifyCounter {
            _client: client,
            count,
            task,
        })
    }

    fn get(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

impl Drop for NotifyCounter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// 8 producer connections (by default) insert one event per transaction as fast as they
/// can, into the table without triggers and into outbox_events in each relay state; then
/// the idle relay's wake-up latency.
pub async fn producer_cost(ctx: &Ctx, busy_backlog: u64) -> Result<ProducerCost> {
    let db = ctx.admin.create_db().await?;
    let broker = BenchBroker::new(&ctx.amqp, &ctx.tag("producer")).await?;
    let result = producer_cost_inner(ctx, &db, &broker, busy_backlog).await;
    broker.purge().await.ok();
    broker.delete().await;
    ctx.admin.drop_db(&db.name).await;
    result
}

async fn producer_cost_inner(
    ctx: &Ctx,
    db: &BenchDb,
    broker: &BenchBroker,
    busy_backlog: u64,
) -> Result<ProducerCost> {
    let s = &ctx.s;
    let order = Arc::new(AtomicU64::new(1_000_000_000));
    let mut runs = Vec::new();
    let run = |id, what, table| Measure {
        db,
        s,
        order: &order,
        id,
        what,
        table,
    };

    runs.push(
        run(
            "plain",
            "table without triggers, relay stopped",
            "outbox_plain",
        )
        .go(None)
        .await?,
    );
    runs.push(
        run(
            "outbox_stopped",
            "outbox_events, no relay running (trigger, no NOTIFY)",
            "outbox_events",
        )
        .go(None)
        .await?,
    );
    // What the wake-up would cost if it were always on: a relay registered as idle (the
    // bench listens in its place), so every producer transaction sends a NOTIFY.
    {
        let counter = NotifyCounter::start(db).await?;
        db.client
            .batch_execute(
                "INSERT INTO outbox_relays (relay_id, host, pid, lease_secs, wants_wakeup)
                 VALUES ('outbox-bench-idle', 'bench', 0, 3600, true);
                 SELECT outbox_set_wakeup('outbox-bench-idle', true);",
            )
            .await?;
        let r = run(
            "outbox_notify_always",
            "outbox_events, NOTIFY in every transaction",
            "outbox_events",
        )
        .go(Some(&counter))
        .await;
        db.client
            .batch_execute(
                "SELECT outbox_set_wakeup('outbox-bench-idle', false);
                 DELETE FROM outbox_relays WHERE relay_id = 'outbox-bench-idle';",
            )
            .await?;
        runs.push(r?);
    }

    // The real relay, idle: its wake-up latency first, then producers flat out.
    let counter = NotifyCounter::start(db).await?;
    let samples = s.wakeup_samples;
    let arrivals = Arc::new(Arrivals::new(samples + 1));
    let seen: &Arrivals = &arrivals;
    let stop_consumer = broker.consume(arrivals.clone()).await?;
    let name = format!("{}-producer", db.name);
    let mut relay = ctx.start_relay(&name, db, broker, &s.relay)?;
    let insert = db
        .client
        .prepare(&pg::insert_one_sql("outbox_events"))
        .await?;
    db.client
        .execute(&insert, &[&"k0", &pg::payload_json(samples as u64)])
        .await?;
    arrivals.committed(samples as u64);
    wait_until(
        "the first event to arrive",
        Duration::from_secs(60),
        std::slice::from_mut(&mut relay),
        || async move { Ok(seen.has_arrived(samples as u64)) },
    )
    .await?;
    for i in 0..samples {
        wait_until(
            "the relay to go idle",
            Duration::from_secs(30),
            std::slice::from_mut(&mut relay),
            || async move { db.wakeup_wanted().await },
        )
        .await?;
        tokio::time::sleep(s.wakeup_spacing).await;
        let key = format!("k{}", i as u64 % s.keys.max(1));
        db.client
            .execute(&insert, &[&key, &pg::payload_json(i as u64)])
            .await?;
        arrivals.committed(i as u64);
    }
    wait_until(
        "every wake-up event to arrive",
        Duration::from_secs(30),
        std::slice::from_mut(&mut relay),
        || async move { Ok(seen.arrived_count() > samples) },
    )
    .await
    .ok();
    stop_consumer.cancel();
    let (lat, wakeup_missing, _) = arrivals.latencies(0..samples);
    let wakeup = Summary::of(lat);
    wait_until(
        "the relay to go idle",
        Duration::from_secs(30),
        std::slice::from_mut(&mut relay),
        || async move { db.wakeup_wanted().await },
    )
    .await?;
    runs.push(
        run(
            "outbox_relay_idle",
            "outbox_events, relay running, idle at the start",
            "outbox_events",
        )
        .go(Some(&counter))
        .await?,
    );

    // Busy: a backlog keeps the relay claiming back to back (wake-up off) throughout.
    db.insert_backlog(2_000_000_000, busy_backlog, s.keys)
        .await?;
    wait_until(
        "the relay to turn the wake-up off",
        Duration::from_secs(30),
        std::slice::from_mut(&mut relay),
        || async move { Ok(!db.wakeup_wanted().await?) },
    )
    .await?;
    // In pairs, the order alternating, so that a drift over the section does not pass for a
    // cost of the triggers.
    for round in 1..=s.producer_rounds {
        let outbox = run(
            "outbox_relay_busy",
            "outbox_events, relay busy draining",
            "outbox_events",
        );
        let plain = run(
            "plain_relay_busy",
            "table without triggers, relay busy draining",
            "outbox_plain",
        );
        let pair = if round % 2 == 1 {
            [outbox, plain]
        } else {
            [plain, outbox]
        };
        for m in pair {
            let mut r = m.go(Some(&counter)).await?;
            r.round = Some(round);
            runs.push(r);
        }
    }
    let busy_throughout = db.pending().await? > 0 && !db.wakeup_wanted().await?;
    relay.check_alive()?;
    relay.stop()?;
    // The baseline again, so drift over the section shows (ratios use the mean of both).
    runs.push(
        run(
            "plain_end",
            "table without triggers, relay stopped (again)",
            "outbox_plain",
        )
        .go(None)
        .await?,
    );
    Ok(ProducerCost {
        producers: s.producers,
        seconds: s.producer_secs,
        runs,
        wakeup,
        wakeup_missing,
        busy_throughout,
        busy_backlog,
    })
}

/// One producer-cost run: which table, in which state, named how.
struct Measure<'a> {
    db: &'a BenchDb,
    s: &'a Settings,
    order: &'a Arc<AtomicU64>,
    id: &'static str,
    what: &'static str,
    table: &'static str,
}

impl Measure<'_> {
    async fn go(self, counter: Option<&NotifyCounter>) -> Result<ProducerRun> {
        let before = counter.map(NotifyCounter::get);
        let (tx_per_s, commits) = closed_loop(
            self.db,
            self.table,
            self.s.producers,
            self.s.producer_secs,
            self.s.producer_warmup_secs,
            self.s.keys,
            self.order,
        )
        .await?;
        let notifies = counter
            .map(NotifyCounter::get)
            .zip(before)
            .map(|(a, b)| a - b);
        Ok(ProducerRun {
            id: self.id,
            what: self.what,
            round: None,
            tx_per_s,
            commits,
            notifies,
        })
    }
}

/// `producers` connections insert one event per transaction (autocommit: the statement is
/// the transaction) back to back for `warmup + secs`; returns commits/s in the last `secs`.
async fn closed_loop(
    db: &BenchDb,
    table: &str,
    producers: usize,
    secs: f64,
    warmup: f64,
    keys: u64,
    order: &Arc<AtomicU64>,
) -> Result<(f64, u64)> {
    let sql = pg::insert_one_sql(table);
    let mut clients = Vec::new();
    for p in 0..producers.max(1) {
        let client = db.connect(&format!("outbox-bench-producer-{p}")).await?;
        let stmt = client.prepare(&sql).await?;
        clients.push((client, stmt));
    }
    let begin = Instant::now() + Duration::from_secs_f64(warmup);
    let end = begin + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for (client, stmt) in clients {
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let mut counted = 0u64;
            while Instant::now() < end {
                let n = order.fetch_add(1, Ordering::Relaxed);
                let key = format!("k{}", n % keys.max(1));
                client.execute(&stmt, &[&key, &pg::payload_json(n)]).await?;
                let t = Instant::now();
                if t > begin && t <= end {
                    counted += 1;
                }
            }
            Ok::<_, anyhow::Error>(counted)
        }));
    }
    let mut commits = 0;
    for t in tasks {
        commits += t.await??;
    }
    Ok((commits as f64 / secs, commits))
}

// ---------------------------------------------------------------------------------------
// 5. Growth

#[derive(Clone, Debug)]
pub struct Growth {
    pub history_rows: u64,
    pub history_s: f64,
    /// Drains with the dispatched rows in the table, one per round.
    pub loaded: Vec<Drain>,
    /// Drains of an empty table, each right after a loaded one.
    pub empty: Vec<Drain>,
    /// A last drain with the dispatched rows in the table while the relay's `--retention`
    /// deletes them, and how many it deleted by the end of that drain.
    pub retained: Option<(Drain, i64)>,
}

fn mean_rate(d: &[Drain]) -> f64 {
    d.iter().map(|d| d.rate).sum::<f64>() / d.len().max(1) as f64
}

impl Growth {
    pub fn loaded_rate(&self) -> f64 {
        mean_rate(&self.loaded)
    }

    pub fn empty_rate(&self) -> f64 {
        mean_rate(&self.empty)
    }

    pub fn ratio(&self) -> f64 {
        self.loaded_rate() / self.empty_rate()
    }

    /// The drain while retention deletes the history, against the empty table's.
    pub fn retained_ratio(&self) -> Option<f64> {
        Some(self.retained.as_ref()?.0.rate / self.empty_rate())
    }
}

/// Rounds of: the drain with `growth_rows` dispatched rows already in the table (a new
/// backlog on the same table each round), then the same drain on an empty table right
/// after it. Alternating and averaging keeps a change in the machine's load from passing
/// for an effect of the table's size.
pub async fn growth(ctx: &Ctx) -> Result<Growth> {
    let s = &ctx.s;
    let (mut big, history_s) = prepare_backlog(ctx, s.events, s.growth_rows).await?;
    let result = async {
        let mut out = Growth {
            history_rows: s.growth_rows,
            history_s,
            loaded: Vec::new(),
            empty: Vec::new(),
            retained: None,
        };
        for round in 0..s.growth_rounds.max(1) {
            if round > 0 {
                big.after_id = big.db.max_id().await?;
                let first = s.growth_rows + round as u64 * s.events;
                big.db.insert_backlog(first, s.events, s.keys).await?;
            }
            out.loaded
                .push(drain_keep(ctx, &big, &s.relay, false).await?);
            let (empty, _) = prepare_backlog(ctx, s.events, 0).await?;
            out.empty.push(drain(ctx, empty, &s.relay, false).await?);
            eprintln!(
                "outbox-bench: growth round {}: {:.0} events/s with history, {:.0} without",
                round + 1,
                out.loaded[round].rate,
                out.empty[round].rate
            );
        }
        // Then once more with retention on: the relay deletes the history (dispatched a
        // day ago) in batches while it drains the new backlog.
        big.after_id = big.db.max_id().await?;
        let first = s.growth_rows + out.loaded.len() as u64 * s.events;
        big.db.insert_backlog(first, s.events, s.keys).await?;
        let before = big.db.old_dispatched().await?;
        let settings = RelaySettings {
            retention: Some("1h".into()),
            ..s.relay.clone()
        };
        let d = drain_keep(ctx, &big, &settings, false).await?;
        let deleted = before - big.db.old_dispatched().await?;
        eprintln!(
            "outbox-bench: growth with retention: {:.0} events/s, {deleted} old rows deleted meanwhile",
            d.rate
        );
        out.retained = Some((d, deleted));
        Ok::<_, anyhow::Error>(out)
    }
    .await;
    ctx.admin.drop_db(&big.db.name).await;
    result
}

// ---------------------------------------------------------------------------------------
// Sweep

#[derive(Clone, Debug)]
pub struct SweepPoint {
    pub batch_size: usize,
    pub channels: usize,
    /// The broker ceiling with the same channel count, measured just before this drain.
    pub ceiling: Ceiling,
    pub drain: Drain,
}

impl SweepPoint {
    pub fn ratio(&self) -> f64 {
        self.drain.rate / self.ceiling.rate
    }
}

#[derive(Clone, Debug)]
pub struct Sweep {
    pub events: u64,
    pub points: Vec<SweepPoint>,
}

/// Drain rate for every batch size × channel count, each next to a fresh broker ceiling
/// with the same channel count (measured seconds apart, so the ratio holds up even while
/// the machine's load changes over the minutes a sweep takes).
pub async fn sweep(ctx: &Ctx, bodies: Arc<Vec<String>>) -> Result<Sweep> {
    let s = &ctx.s;
    let mut out = Sweep {
        events: s.sweep_events,
        points: Vec::new(),
    };
    for &channels in &s.sweep_channels {
        for &batch_size in &s.sweep_batches {
            let settings = RelaySettings {
                batch_size,
                channels,
                ..s.relay.clone()
            };
            let (backlog, _) = prepare_backlog(ctx, s.sweep_events, 0).await?;
            let ceiling = broker_ceiling(ctx, bodies.clone(), s.sweep_events, channels).await?;
            let drain = drain(ctx, backlog, &settings, false).await?;
            eprintln!(
                "outbox-bench: sweep batch {batch_size} channels {channels}: {:.0} events/s, ceiling {:.0}",
                drain.rate, ceiling.rate
            );
            out.points.push(SweepPoint {
                batch_size,
                channels,
                ceiling,
                drain,
            });
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// 7. Scale-out: the same backlog drained by one, two and three relays

#[derive(Clone, Debug)]
pub struct ScalePoint {
    pub relays: usize,
    /// The broker ceiling measured just before this drain.
    pub ceiling: Ceiling,
    /// From starting the relays to every row dispatched and every message queued.
    pub seconds: f64,
    pub rate: f64,
    /// Messages queued beyond one per event (partition hand-overs may republish a few).
    pub duplicates: u64,
}

impl ScalePoint {
    pub fn ratio(&self) -> f64 {
        self.rate / self.ceiling.rate
    }
}

#[derive(Clone, Debug)]
pub struct Scale {
    pub events: u64,
    pub points: Vec<ScalePoint>,
}

/// For each relay count: a fresh backlog, a fresh broker ceiling, then that many relay
/// processes started together on the backlog, timed until every row is dispatched and
/// every message queued. On one small machine the relays share its cores with Postgres
/// and RabbitMQ, so this shows what sharing costs or gains here, not what more machines
/// would give.
pub async fn scale_out(ctx: &Ctx, bodies: Arc<Vec<String>>) -> Result<Scale> {
    let s = &ctx.s;
    let mut out = Scale {
        events: s.scale_events,
        points: Vec::new(),
    };
    for &relays in &s.scale_relays {
        let (backlog, _) = prepare_backlog(ctx, s.scale_events, 0).await?;
        let measured = async {
            let ceiling =
                broker_ceiling(ctx, bodies.clone(), s.scale_events, s.relay.channels).await?;
            Ok::<_, anyhow::Error>((ceiling, shared_drain(ctx, &backlog, relays).await?))
        }
        .await;
        ctx.admin.drop_db(&backlog.db.name).await;
        let (ceiling, (seconds, duplicates)) = measured?;
        let rate = s.scale_events as f64 / seconds;
        eprintln!(
            "outbox-bench: scale {relays} relay(s): {rate:.0} events/s, ceiling {:.0}",
            ceiling.rate
        );
        out.points.push(ScalePoint {
            relays,
            ceiling,
            seconds,
            rate,
            duplicates,
        });
    }
    Ok(out)
}

/// Runs `relays` relay processes on the backlog; returns seconds to drain and duplicates.
async fn shared_drain(ctx: &Ctx, backlog: &Backlog, relays: usize) -> Result<(f64, u64)> {
    let broker = BenchBroker::new(&ctx.amqp, &ctx.tag("scale")).await?;
    let result = async {
        let (db, n) = (&backlog.db, backlog.events);
        let started = Instant::now();
        let mut procs = (0..relays)
            .map(|i| {
                let name = format!("{}-scale{relays}-{i}", db.name);
                ctx.start_relay(&name, db, &broker, &ctx.s.relay)
            })
            .collect::<Result<Vec<_>>>()?;
        let broker = &broker;
        wait_until(
            "every row dispatched and queued",
            Duration::from_secs(60 + n / 200),
            &mut procs,
            || async move { Ok(db.pending().await? == 0 && u64::from(broker.depth().await?) >= n) },
        )
        .await?;
        let seconds = started.elapsed().as_secs_f64();
        for p in procs {
            p.stop()?;
        }
        let depth = u64::from(broker.depth().await?);
        Ok((seconds, depth.saturating_sub(n)))
    }
    .await;
    broker.purge().await.ok();
    broker.delete().await;
    result
}
