//! The measurements, one function each. Every one builds its own database and
//! broker names, runs the relay as a child process, checks that what it measured really
//! happened (every row dispatched, every message queued or received) and cleans up.
//!
//! One file per measurement: `ceiling.rs` (1), `drain.rs` (2 and 6), `latency.rs` (3, with
//! `floor.rs`: the broker's and the wake-up's hops alone),
//! `producer.rs` (4), `growth.rs` (5), `sweep.rs`, `scale.rs` (7), `consumer.rs` (8); this file holds what they
//! share: the context, the settings, the wait with a deadline and the producers' steady
//! schedule (`open_loop`, for the latency runs and the floor's wake-up hop).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use outbox_kit::amqp::AmqpTarget;
use tokio_postgres::Client;

use crate::amqp::{Arrivals, BenchBroker};
use crate::pg::{self, Admin, BenchDb};
use crate::relay::{Launcher, RelayProcess, RelaySettings};

mod ceiling;
mod consumer;
mod drain;
mod floor;
mod growth;
mod latency;
mod producer;
mod scale;
mod sweep;

pub use ceiling::{CeilingRuns, broker_ceiling};
pub use consumer::{ConsumerRuns, consumer};
pub use drain::{Drain, drain, prepare_backlog};
pub use floor::Floor;
pub use growth::{Growth, growth};
pub use latency::{Latency, Runner, latency};
pub use producer::{ProducerCost, producer_cost};
pub use scale::{Scale, scale_out};
pub use sweep::{Sweep, SweepPoint, sweep};

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
    pub consumer_events: u64,
    pub consumer_keys: u64,
    pub consumer_instances: Vec<usize>,
    pub consumer_partitions: u16,
    pub consumer_prefetch: u16,
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

/// `producers` connections commit events `0..total` on a fixed schedule (event i is due
/// at start + i/rate, whoever is free takes it), recording each INSERT's start and commit;
/// no event is taken after `stop_after`.
/// Returns the connections, still open (their backends' CPU is read before they close).
async fn open_loop(
    db: &BenchDb,
    producers: usize,
    rate: u64,
    (total, stop_after): (usize, Duration),
    keys: u64,
    arrivals: &Arc<Arrivals>,
) -> Result<Vec<Client>> {
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
                if i >= total as u64 || start.elapsed() > stop_after {
                    return Ok::<_, anyhow::Error>(client);
                }
                let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
                tokio::time::sleep_until(due).await;
                let key = format!("k{}", i % keys.max(1));
                let payload = pg::payload_json(i);
                arrivals.started(i);
                client.execute(&stmt, &[&key, &payload]).await?;
                arrivals.committed(i);
            }
        }));
    }
    let mut clients = Vec::new();
    for t in tasks {
        clients.push(t.await??);
    }
    Ok(clients)
}
