//! `outbox-bench`: measures the relay against the broker's own ceiling and, for latency and
//! load on Postgres, against the simplest correct relay run in the same sitting.
//!
//! One run reports, as a Markdown table on stdout and as JSON (`--json`): (1) the broker
//! ceiling, raw publishing with confirms and no database; (2) the drain of a backlog by
//! the relay, as a ratio to (1); (3) commit-to-consumer latency at steady producer rates,
//! with LISTEN and with `--no-listen`, next to the yardstick and to no relay (Postgres CPU
//! and WAL per event, the producers' INSERT latency), and our relay's latency stage by
//! stage; (4) producer commit throughput with the relay's
//! triggers in each relay state, against the same table without triggers, and the idle
//! wake-up latency; (5) the drain with millions of dispatched rows in the table against an
//! empty one, and with retention deleting them; (6) the relay's peak memory and CPU per
//! 100,000 events; (7) one backlog drained by 1, 2 and 3 relays; (8) a backlog
//! applied by 1, 2 and 3 consumer instances (unordered, an ordered group, a group with one
//! effect per event), as a ratio to (2). `--sweep` adds drain
//! rate against batch size and channel count, drawn as an SVG chart (`--svg`).
//!
//! The relay runs as the real binary in a child process (`outbox-relay run`), next to this
//! one unless `--relay-bin` says otherwise, so `cargo build --release` first. Every
//! measurement uses its own database (`bench_<pid>_<n>`) and its own exchange and queue
//! (`bench.<pid>.<tag>`), all dropped afterwards. `--smoke` runs every section at tiny
//! sizes in about a minute, dropping its databases at the end (the test suite runs it so
//! the bench cannot rot).

mod amqp;
mod pg;
mod procfs;
mod relay;
mod report;
mod sections;
mod stages;
mod stats;
mod svg;
mod yardstick;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result};
use clap::Parser;
use outbox_kit::amqp::AmqpTarget;

use relay::{Launcher, RelaySettings};
use report::{Machine, Outcome, Results};
use sections::{Ctx, Settings};

/// The sections `--only` can pick.
const SECTIONS: [&str; 8] = [
    "ceiling", "drain", "latency", "producer", "growth", "scale", "sweep", "consumer",
];

#[derive(Debug, Parser)]
#[command(
    name = "outbox-bench",
    about = "Benchmarks outbox-relay against the broker's own ceiling and a minimal relay measured in the same run; see docs/benchmarks.md"
)]
struct Args {
    #[command(subcommand)]
    command: Option<Hidden>,

    /// Every section at tiny sizes (seconds, not minutes): checks the bench works.
    #[arg(long)]
    smoke: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write the sweep chart (SVG) to this file (implies --sweep).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Also measure drain rate against batch size and channel count.
    #[arg(long)]
    sweep: bool,
    /// Run only these sections (comma-separated): ceiling, drain, latency, producer, growth, scale, sweep, consumer.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,

    /// Postgres server (any database; the bench creates its own).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres",
        hide_env_values = true
    )]
    database_url: String,
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    amqp_url: String,
    /// The relay binary [default: outbox-relay next to this binary].
    #[arg(long)]
    relay_bin: Option<PathBuf>,
    /// A command put in front of the relay, e.g. "valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.out".
    #[arg(long)]
    relay_wrapper: Option<String>,
    /// A command run during the main drain and stopped with SIGINT, e.g. "perf record -e cpu-clock -a -g -o /tmp/drain.perf".
    #[arg(long)]
    drain_profiler: Option<String>,
    /// Profile the database work: every statement of the bench databases' sessions, nested
    /// ones inside functions too, goes to the Postgres server log with its duration
    /// (auto_explain, loaded per database; needs a superuser). Slows every statement.
    #[arg(long)]
    auto_explain: bool,
    /// Where relay logs go [default: target/outbox-bench].
    #[arg(long)]
    work_dir: Option<PathBuf>,

    /// Backlog size for the drain and growth sections.
    #[arg(long)]
    events: Option<u64>,
    /// Distinct keys (aggregate ids) the events are spread over.
    #[arg(long)]
    keys: Option<u64>,
    /// The relay's --batch-size.
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// The relay's --channels (and the ceiling's).
    #[arg(long, default_value_t = 2)]
    channels: usize,
    /// The relay's --confirm-window (and the ceiling's).
    #[arg(long, default_value_t = 1024)]
    confirm_window: usize,
    /// The relay's --poll-interval [default: 1s, the relay's default; smoke 200ms].
    #[arg(long)]
    poll_interval: Option<String>,
    /// Producer rates (events/s) for the latency section.
    #[arg(long, value_delimiter = ',')]
    latency_rates: Vec<u64>,
    /// Seconds each latency run commits for.
    #[arg(long)]
    latency_secs: Option<f64>,
    /// Seconds each producer-cost run measures for.
    #[arg(long)]
    producer_secs: Option<f64>,
    /// Producer connections in the producer-cost section.
    #[arg(long, default_value_t = 8)]
    producers: usize,
    /// Pairs of busy-relay runs (outbox_events, the table without triggers, in alternating
    /// order) in the producer-cost section; their ratios' median is the figure.
    #[arg(long)]
    producer_rounds: Option<usize>,
    /// Events sent one at a time to an idle relay for the wake-up latency.
    #[arg(long)]
    wakeup_samples: Option<usize>,
    /// Dispatched rows already in the table for the growth section.
    #[arg(long)]
    growth_rows: Option<u64>,
    /// Rounds of (drain with history, drain of an empty table) in the growth section.
    #[arg(long)]
    growth_rounds: Option<usize>,
    /// Batch sizes for the sweep.
    #[arg(long, value_delimiter = ',')]
    sweep_batches: Vec<usize>,
    /// Channel counts for the sweep.
    #[arg(long, value_delimiter = ',')]
    sweep_channels: Vec<usize>,
    /// Backlog size of each sweep drain.
    #[arg(long)]
    sweep_events: Option<u64>,
    /// Relay counts for the scale-out section.
    #[arg(long, value_delimiter = ',')]
    scale_relays: Vec<usize>,
    /// Backlog size of each scale-out drain.
    #[arg(long)]
    scale_events: Option<u64>,
    /// Backlog size of each consumer run.
    #[arg(long)]
    consumer_events: Option<u64>,
    /// Distinct keys the consumer backlog is spread over.
    #[arg(long)]
    consumer_keys: Option<u64>,
    /// Consumer instance counts for the consumer section.
    #[arg(long, value_delimiter = ',')]
    consumer_instances: Vec<usize>,
    /// Partitions of the consumer group in the consumer section.
    #[arg(long, default_value_t = 8)]
    consumer_partitions: u16,
    /// The consumer instances' prefetch.
    #[arg(long, default_value_t = 16)]
    consumer_prefetch: u16,
}

/// Commands the bench runs itself, not meant for users.
#[derive(Debug, clap::Subcommand)]
enum Hidden {
    /// The yardstick relay of the latency section (the bench starts it as a child process).
    #[command(hide = true)]
    Yardstick(yardstick::YardstickArgs),
}

impl Args {
    fn settings(&self) -> Settings {
        let smoke = self.smoke;
        // A list option: what was given, else the full or the smoke default.
        fn pick<T: Clone>(given: &[T], full: &[T], small: &[T], smoke: bool) -> Vec<T> {
            match (given.is_empty(), smoke) {
                (false, _) => given.to_vec(),
                (true, true) => small.to_vec(),
                (true, false) => full.to_vec(),
            }
        }
        let size =
            |v: Option<u64>, full: u64, small: u64| v.unwrap_or(if smoke { small } else { full });
        let secs =
            |v: Option<f64>, full: f64, small: f64| v.unwrap_or(if smoke { small } else { full });
        Settings {
            smoke,
            events: size(self.events, 200_000, 2_000),
            keys: size(self.keys, 1_000, 50),
            relay: RelaySettings {
                batch_size: self.batch_size,
                channels: self.channels,
                confirm_window: self.confirm_window,
                poll_interval: self
                    .poll_interval
                    .clone()
                    .unwrap_or_else(|| if smoke { "200ms".into() } else { "1s".into() }),
                listen: true,
                retention: None,
                stage_trace: None,
            },
            latency_rates: pick(
                &self.latency_rates,
                &[500, 1_000, 5_000],
                &[200, 1_000],
                smoke,
            ),
            latency_secs: secs(self.latency_secs, 30.0, 1.0),
            latency_warmup_secs: if smoke { 0.0 } else { 1.0 },
            latency_producers: 8,
            producer_secs: secs(self.producer_secs, 10.0, 0.5),
            producer_warmup_secs: if smoke { 0.1 } else { 1.0 },
            producers: self.producers,
            producer_rounds: self
                .producer_rounds
                .unwrap_or(if smoke { 1 } else { 3 })
                .max(1),
            wakeup_samples: self.wakeup_samples.unwrap_or(if smoke { 10 } else { 200 }),
            wakeup_spacing: Duration::from_millis(if smoke { 20 } else { 100 }),
            growth_rows: size(self.growth_rows, 5_000_000, 20_000),
            growth_rounds: self.growth_rounds.unwrap_or(if smoke { 1 } else { 2 }),
            sweep_batches: pick(
                &self.sweep_batches,
                &[100, 250, 500, 1_000, 2_000],
                &[100, 500],
                smoke,
            ),
            sweep_channels: pick(&self.sweep_channels, &[1, 2, 4], &[1, 2], smoke),
            sweep_events: size(self.sweep_events, 50_000, 1_000),
            scale_relays: pick(&self.scale_relays, &[1, 2, 3], &[1, 2], smoke),
            scale_events: size(self.scale_events, 100_000, 1_000),
            consumer_events: size(self.consumer_events, 20_000, 300),
            consumer_keys: size(self.consumer_keys, 1_000, 50),
            consumer_instances: pick(&self.consumer_instances, &[1, 2, 3], &[2], smoke),
            consumer_partitions: self.consumer_partitions.max(1),
            consumer_prefetch: self.consumer_prefetch.max(1),
        }
    }

    fn wants(&self, section: &str) -> bool {
        if !self.only.is_empty() {
            return self.only.iter().any(|s| s == section);
        }
        section != "sweep" || self.sweep || self.svg.is_some() || self.smoke
    }
}

fn main() -> std::process::ExitCode {
    let mut args = Args::parse();
    if let Some(bad) = args.only.iter().find(|s| !SECTIONS.contains(&s.as_str())) {
        eprintln!(
            "outbox-bench: --only: '{bad}' is not one of {}",
            SECTIONS.join(", ")
        );
        return std::process::ExitCode::from(2);
    }
    // Two workers: the machine has two cores, and the bench should not take more of them
    // than producers and a consumer need.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outbox-bench: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    if let Some(Hidden::Yardstick(y)) = args.command.take() {
        return match runtime.block_on(yardstick::run(y)) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("outbox-bench yardstick: {e:#}");
                std::process::ExitCode::from(1)
            }
        };
    }
    match runtime.block_on(run(args)) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::from(1),
        Err(e) => {
            eprintln!("outbox-bench: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

fn note(what: &str) {
    eprintln!("outbox-bench: {what}");
}

/// Turns a section's result into an outcome, saying what failed.
fn outcome<T>(name: &str, r: Result<T>) -> Outcome<T> {
    Some(r.map_err(|e| {
        let msg = format!("{e:#}");
        eprintln!("outbox-bench: {name} failed: {msg}");
        msg
    }))
}

/// Runs the chosen sections; returns whether all of them succeeded.
async fn run(args: Args) -> Result<bool> {
    let started = Instant::now();
    let started_unix = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)?
        .as_secs_f64();
    let s = args.settings();
    let amqp = AmqpTarget::parse(&args.amqp_url).map_err(|e| anyhow::anyhow!("--amqp-url: {e}"))?;
    let work_dir = args
        .work_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("target/outbox-bench"));
    let launcher = Launcher {
        bin: outbox_testkit::relay_binary::relay_binary(args.relay_bin.as_deref(), "outbox-bench")
            .map_err(anyhow::Error::msg)?,
        wrapper: args.relay_wrapper.clone(),
        amqp_url: args.amqp_url.clone(),
        log_dir: work_dir,
    };
    let admin = pg::Admin::connect(&args.database_url, s.smoke, args.auto_explain).await?;
    let postgres = admin_version(&admin).await;
    let ctx = Ctx::new(
        s.clone(),
        admin,
        amqp,
        launcher,
        args.drain_profiler.clone(),
    );

    let mut results = Results {
        settings: s.clone(),
        machine: Machine::read(postgres),
        started_unix,
        duration_s: 0.0,
        ceiling: None,
        drain: None,
        latency: None,
        producer: None,
        growth: None,
        sweep: None,
        scale: None,
        consumer: None,
    };

    // The backlog is made first so that the ceiling publishes the very bodies the relay
    // will publish from it.
    let mut bodies: Option<Arc<Vec<String>>> = None;
    let mut backlog = None;
    if args.wants("drain") || args.wants("ceiling") || args.wants("sweep") {
        note(&format!("inserting a backlog of {} events", s.events));
        let (b, _) = sections::prepare_backlog(&ctx, s.events, 0).await?;
        bodies = Some(Arc::new(b.db.sample_bodies(1000).await?));
        note(&format!("backlog inserted in {:.1} s", b.insert_s));
        backlog = Some(b);
    }
    if args.wants("ceiling") {
        note("1. broker ceiling");
        let b = bodies.clone().context("bodies")?;
        let first = sections::broker_ceiling(&ctx, b, s.events, s.relay.channels).await;
        results.ceiling = outcome(
            "broker ceiling",
            first.map(|c| sections::CeilingRuns { runs: vec![c] }),
        );
    }
    if let Some(b) = backlog.take() {
        if args.wants("drain") {
            note("2. backlog drain");
            results.drain = outcome("drain", sections::drain(&ctx, b, &s.relay, true).await);
            if let (Some(Ok(runs)), Some(bodies)) = (&mut results.ceiling, &bodies) {
                note("1. broker ceiling again, after the drain");
                match sections::broker_ceiling(&ctx, bodies.clone(), s.events, s.relay.channels)
                    .await
                {
                    Ok(c) => runs.runs.push(c),
                    Err(e) => results.ceiling = outcome("broker ceiling", Err(e)),
                }
            }
        } else {
            ctx.admin.drop_db(&b.db.name).await;
        }
    }
    if args.wants("latency") {
        let mut runs = Vec::new();
        let mut failed = None;
        for &rate in &s.latency_rates {
            for runner in sections::Runner::ALL {
                note(&format!("3. latency at {rate}/s, {}", runner.describe()));
                match sections::latency(&ctx, rate, runner).await {
                    Ok(l) => runs.push(l),
                    Err(e) => failed = Some(e),
                }
            }
        }
        results.latency = outcome("latency", failed.map_or(Ok(runs), Err));
    }
    if args.wants("producer") {
        note("4. producer cost");
        // Enough backlog to keep the relay busy through both busy runs (measured drain rate
        // when known, else a generous guess), with room for start-up.
        let rate = results
            .drain
            .as_ref()
            .and_then(|d| d.as_ref().ok())
            .map_or(10_000.0, |d| d.rate.max(1_000.0));
        let slack = if s.smoke { 2.0 } else { 10.0 };
        let busy_secs =
            2.0 * s.producer_rounds as f64 * (s.producer_secs + s.producer_warmup_secs) + slack;
        let backlog = ((rate * busy_secs * 1.5) as u64).clamp(2_000, 1_000_000);
        results.producer = outcome(
            "producer cost",
            sections::producer_cost(&ctx, backlog).await,
        );
    }
    if args.wants("growth") {
        note(&format!(
            "5. growth: {} dispatched rows first",
            s.growth_rows
        ));
        results.growth = outcome("growth", sections::growth(&ctx).await);
    }
    let bodies = || match bodies.clone() {
        Some(b) => b,
        None => Arc::new((0..1000).map(pg::payload_json).collect()),
    };
    if args.wants("scale") {
        note("7. scale-out: one backlog, several relays");
        results.scale = outcome("scale-out", sections::scale_out(&ctx, bodies()).await);
    }
    if args.wants("sweep") {
        note("sweep: batch size x channels");
        results.sweep = outcome("sweep", sections::sweep(&ctx, bodies()).await);
    }
    if args.wants("consumer") {
        // The relay's drain rate in this run: the drain section's, else a short drain.
        let drained = match results.drain.as_ref().and_then(|d| d.as_ref().ok()) {
            Some(d) => Ok((d.rate, d.events)),
            None => {
                note(&format!(
                    "8. consumer: a drain of {} events to compare with",
                    s.consumer_events
                ));
                let (b, _) = sections::prepare_backlog(&ctx, s.consumer_events, 0).await?;
                sections::drain(&ctx, b, &s.relay, false)
                    .await
                    .map(|d| (d.rate, d.events))
            }
        };
        let runs = match drained {
            Ok((rate, events)) => sections::consumer(&ctx, rate, events).await,
            Err(e) => Err(e),
        };
        results.consumer = outcome("consumer", runs);
    }
    ctx.admin.close().await;
    results.duration_s = started.elapsed().as_secs_f64();

    print!("{}", results.markdown());
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&results.json())?;
        std::fs::write(path, text + "\n").with_context(|| format!("write {}", path.display()))?;
    }
    if let Some(path) = &args.svg {
        match results.svg() {
            Some(svg) => {
                std::fs::write(path, svg).with_context(|| format!("write {}", path.display()))?
            }
            None => note("no sweep results: the SVG chart was not written"),
        }
    }
    Ok(results.errors().is_empty())
}

async fn admin_version(admin: &pg::Admin) -> String {
    admin
        .server_version()
        .await
        .unwrap_or_else(|_| "PostgreSQL (version unknown)".into())
}
