//! Measurement 4, producer cost: what the outbox's triggers and the relay's work cost
//! producers (commits/s against a table without triggers), and the idle relay's wake-up
//! latency.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use futures_util::StreamExt;
use outbox_kit::contract::Schema;
use tokio_postgres::AsyncMessage;

use crate::amqp::{Arrivals, BenchBroker};
use crate::pg::{self, BenchDb};
use crate::stats::Summary;

use super::{Ctx, Settings, wait_until};

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
        eprintln!("outbox-bench: producer run: {}", self.what);
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
