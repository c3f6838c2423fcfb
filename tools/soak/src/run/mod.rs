//! One soak run: start a private Postgres server and RabbitMQ node (or use the shared ones),
//! set up a database, proxies, the destination and the tap; start three relays and the
//! consumers as processes; produce while the seeded fault schedule plays; heal, stop
//! producing and drain (the quiet period); stop everything; check; report.
//!
//! Everything under test runs as real processes behind its own proxies (one for Postgres
//! and one for RabbitMQ per process), so one fault hits one process. The soak's own
//! connections (producers, tap, duplicator, reconciler, checks) go direct: they observe and
//! inject, they are not under test; they connect again after a restart of a service.
//!
//! Layout: `setup.rs` (the database, proxies and processes around one run, and the
//! broker's clean-up), `faults.rs` (what the fault tasks act on and how each fault is
//! injected and healed), `drive.rs` (start, produce while the schedule plays, the quiet
//! period, stop), `verdict.rs` (the checks and the report).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use outbox_kit::contract::{Schema, parse_duration};
use outbox_kit::db::DbTarget;
use outbox_testkit::postgres::PrivatePostgres;
use outbox_testkit::rabbitmq::RabbitNodes;
use serde::Serialize;

use crate::schedule::{self, Planned, Shape};

mod drive;
mod faults;
mod setup;
mod verdict;
mod wiring;

use setup::{soak, upstreams};

/// Where the run's Postgres and RabbitMQ come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Services {
    /// A private Postgres server and RabbitMQ node, started for this run and deleted after
    /// it; the schedule then also restarts them.
    Own,
    /// `--database-url` and `--amqp-url` (shared with others: never restarted).
    Shared,
}

/// The private services of a run; dropping them stops them and deletes their data, then
/// the directory that held them (fields drop in this order).
pub(crate) struct Own {
    pub(crate) pg: PrivatePostgres,
    pub(crate) rabbit: RabbitNodes,
    _dir: EmptyDir,
}

/// Removes its directory when dropped, once it is empty.
struct EmptyDir(PathBuf);

impl Drop for EmptyDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// `own`: a private Postgres server and RabbitMQ node for this run, which the
    /// schedule restarts; `shared`: the servers of --database-url and --amqp-url, never
    /// restarted.
    #[arg(long, value_enum, default_value_t = Services::Own)]
    pub services: Services,
    /// How long producers run and faults are injected (the quiet period comes after).
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Chooses the fault schedule (and the producers' choices): the same seed, the same
    /// schedule.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Events per second, all producers together.
    #[arg(long, default_value_t = 300)]
    pub rate: u32,
    /// Distinct keys (aggregate ids); a quarter of the events go to eight hot ones.
    #[arg(long, default_value_t = 300)]
    pub keys: u32,
    /// Steady producers (one more holds its transactions open and commits late).
    #[arg(long, default_value_t = 3)]
    pub producers: u32,
    /// Relay processes.
    #[arg(long, default_value_t = 3)]
    pub relays: usize,
    /// Consumer processes: instances of one ordered consumer group over 8 partitions.
    #[arg(long, default_value_t = 3)]
    pub consumers: usize,
    /// The longest outage of every consumer instance at once (a fault of its own, drawn
    /// between half of it and all of it): the queues build a backlog that long. 0s: none.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub backlog: Duration,
    /// Messages each consumer handles at once (its Postgres pool is twice this: mind
    /// max_connections when the database is shared).
    #[arg(long, default_value_t = 6)]
    pub prefetch: u16,
    /// The relays' --lease; pauses outlast the takeover time (lease + lease/3).
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub lease: Duration,
    /// Longest wait in the quiet period for everything to be dispatched, applied and
    /// performed.
    #[arg(long, default_value = "180s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Postgres server with `--services shared` (a database `soak_<seed>_<pid>` is created
    /// there, and dropped after).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
    /// RabbitMQ with `--services shared` (the first URL of a list); the relays and
    /// consumers reach it through proxies.
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
    /// The relay binary (default: `outbox-relay` next to this binary).
    #[arg(long)]
    pub relay_bin: Option<PathBuf>,
    /// Logs and the report go here (default: `soak/seed-<seed>-<pid>` next to this binary).
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Where the JSON report goes (default: `report.json` in the work dir).
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Keep the database and the queues after the run (to investigate; with `--services
    /// shared`: a run's own services are always deleted with it).
    #[arg(long)]
    pub keep: bool,
    /// Print the fault schedule for the seed and duration, and exit.
    #[arg(long)]
    pub schedule_only: bool,
    /// Self-test of the verdict: publish one event that never committed straight to the
    /// exchange early in the run. The checker must report it and the soak must fail.
    #[arg(long)]
    pub plant_unexpected: bool,
}

/// What happened to one planned fault.
#[derive(Clone, Debug, Serialize)]
struct FaultRecord {
    #[serde(flatten)]
    planned: Planned,
    what: String,
    started_ms: i64,
    ended_ms: i64,
    /// False when the fault could not be injected (the note says why).
    injected: bool,
    note: String,
    /// From the fault's end until everything committed by then was applied.
    recovery_ms: Option<i64>,
}

/// Runs the soak; true when the verdict is PASS.
pub async fn run(mut args: RunArgs) -> anyhow::Result<bool> {
    let shape = Shape {
        duration: args.duration,
        relays: args.relays,
        consumers: args.consumers,
        lease: args.lease,
        own_services: args.services == Services::Own,
        backlog: args.backlog,
        member_lease: crate::consumer::MEMBER_LEASE,
    };
    anyhow::ensure!(
        args.relays >= 1 && args.consumers >= 1,
        "need a relay and a consumer"
    );
    let plan = schedule::draw(args.seed, &shape);
    println!(
        "outbox-soak seed={} duration={}: {} faults scheduled",
        args.seed,
        humantime::format_duration(args.duration),
        plan.len()
    );
    for p in &plan {
        println!("  +{:>6.1}s  {}", p.at_ms as f64 / 1000.0, p.fault);
    }
    if args.schedule_only {
        return Ok(true);
    }

    let exe = std::env::current_exe()?;
    let exe_dir = exe
        .parent()
        .expect("a binary lives in a directory")
        .to_owned();
    let relay_bin = outbox_testkit::relay_binary::relay_binary(args.relay_bin.as_deref(), "soak")
        .map_err(anyhow::Error::msg)?;
    anyhow::ensure!(
        relay_bin.exists(),
        "{} not found: build it first (cargo build --release --bins) or pass --relay-bin",
        relay_bin.display()
    );
    let tag = format!("{}_{}", args.seed, std::process::id());
    let work = args.work_dir.clone().unwrap_or_else(|| {
        exe_dir
            .join("soak")
            .join(format!("seed-{}-{}", args.seed, std::process::id()))
    });
    std::fs::create_dir_all(&work)?;
    println!("work dir (logs, report): {}", work.display());

    let own = match args.services {
        Services::Shared => None,
        Services::Own => {
            let base = std::env::temp_dir().join(format!("outbox-soak-{tag}"));
            println!(
                "starting a private Postgres server and RabbitMQ node under {}",
                base.display()
            );
            let pg = PrivatePostgres::start(&base.join("pg"))
                .await
                .map_err(anyhow::Error::msg)?;
            let rabbit = RabbitNodes::start(
                &format!("outbox-soak-{}", std::process::id()),
                1,
                &base.join("rabbitmq"),
                &[],
            )
            .await
            .map_err(anyhow::Error::msg)?;
            args.database_url = pg.url();
            args.amqp_url = rabbit.url(0);
            Some(std::sync::Arc::new(Own {
                pg,
                rabbit,
                _dir: EmptyDir(base),
            }))
        }
    };
    let schema = Schema::default();
    let up = upstreams(&args).await?;
    let admin_target = DbTarget::parse(&args.database_url).map_err(anyhow::Error::msg)?;
    let admin = admin_target.connect(&schema, "outbox-soak").await?;
    let db_name = format!("soak_{tag}");
    admin
        .batch_execute(&format!("CREATE DATABASE {db_name}"))
        .await?;
    let target = admin_target.with_dbname(&db_name);
    let outcome = soak(
        &args,
        &shape,
        plan,
        &up,
        &target,
        &db_name,
        &work,
        &relay_bin,
        &exe,
        own.clone(),
    )
    .await;
    if own.is_some() {
        // The private servers go with the run (the soak's admin connection did not survive
        // their restarts anyway).
        drop(own);
    } else if args.keep {
        println!("kept database {db_name}");
    } else {
        let _ = admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {db_name} WITH (FORCE)"))
            .await;
    }
    outcome
}
