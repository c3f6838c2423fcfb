//! One soak run: set up a database, proxies, the destination and the tap; start three
//! relays and the consumers as processes; produce while the seeded fault schedule plays;
//! heal, stop producing and drain (the quiet period); stop everything; check; report.
//!
//! Everything under test runs as real processes behind its own proxies (one for Postgres
//! and one for RabbitMQ per process), so one fault hits one process. The soak's own
//! connections (producers, tap, duplicator, reconciler, checks) go direct: they observe and
//! inject, they are not under test.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use outbox_kit::amqp::AmqpTarget;
use outbox_kit::consumer::Ledger;
use outbox_kit::consumer::effects::EffectsConfig;
use outbox_kit::consumer::reconcile::{self, ReconcileConfig};
use outbox_kit::contract::{Schema, parse_duration};
use outbox_kit::db::DbTarget;
use outbox_testkit::checker::{self, Applied, LedgerRow, Recovery};
use outbox_testkit::proxy::{Mode, TcpProxy};
use serde::Serialize;
use serde_json::json;
use tokio::sync::Notify;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::consumer;
use crate::destination::{self, Book, Local};
use crate::procs::{self, Slot, wait_until};
use crate::producer::{self, Load, now_ms};
use crate::rng::Rng;
use crate::schedule::{self, Fault, Planned, Service, Shape, Target};
use crate::tap::{self, Tap};

#[derive(Debug, Args)]
pub struct RunArgs {
    /// How long producers run and faults are injected (the quiet period comes after).
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Chooses the fault schedule (and the producers' choices): the same seed, the same
    /// schedule.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Events per second, all producers together. Keep it below what the consumers
    /// apply (README, "Soak": ordered consumers behind a long backlog give gaps up).
    #[arg(long, default_value_t = 100)]
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
    /// Consumer processes (one consumer group, one queue).
    #[arg(long, default_value_t = 2)]
    pub consumers: usize,
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
    /// Postgres server (a database `soak_<seed>_<pid>` is created there, and dropped after).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
    /// RabbitMQ (the first URL of a list); the relays and consumers reach it through proxies.
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
    /// Keep the database and the queues after the run (to investigate).
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

struct Proxies {
    relay_pg: Vec<TcpProxy>,
    relay_amqp: Vec<TcpProxy>,
    consumer_pg: Vec<TcpProxy>,
    consumer_amqp: Vec<TcpProxy>,
}

impl Proxies {
    fn get(&self, target: Target, service: Service) -> &TcpProxy {
        match (target, service) {
            (Target::Relay(i), Service::Postgres) => &self.relay_pg[i],
            (Target::Relay(i), Service::Rabbitmq) => &self.relay_amqp[i],
            (Target::Consumer(i), Service::Postgres) => &self.consumer_pg[i],
            (Target::Consumer(i), Service::Rabbitmq) => &self.consumer_amqp[i],
        }
    }

    fn all(&self) -> impl Iterator<Item = &TcpProxy> {
        self.relay_pg
            .iter()
            .chain(&self.relay_amqp)
            .chain(&self.consumer_pg)
            .chain(&self.consumer_amqp)
    }
}

/// Everything the fault tasks act on.
struct World {
    db_name: String,
    exchange: String,
    amqp: AmqpTarget,
    target: DbTarget,
    relays: Vec<Slot>,
    consumers: Vec<Slot>,
    proxies: Proxies,
    book: Arc<Book>,
    crash_points: Vec<Notify>,
    host: String,
    injected_copies: Mutex<usize>,
}

fn app_name(target: Target) -> String {
    match target {
        Target::Relay(i) => format!("soak_relay_{i}"),
        Target::Consumer(i) => format!("soak_consumer_{i}"),
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

impl World {
    fn slot(&self, target: Target) -> &Slot {
        match target {
            Target::Relay(i) => &self.relays[i],
            Target::Consumer(i) => &self.consumers[i],
        }
    }

    /// The name the process's AMQP connection carries (what `close_connection` looks for).
    async fn connection_name(&self, target: Target) -> Option<String> {
        let slot = self.slot(target);
        Some(match target {
            Target::Relay(_) => format!("outbox-relay@{}:{}\"", self.host, slot.pid().await?),
            Target::Consumer(i) => format!(
                "outbox-soak-consumer {}\"",
                destination::worker_name(i, slot.incarnation().await)
            ),
        })
    }

    /// Injects one fault and waits until it is over; returns a note.
    async fn inject(&self, fault: &Fault, client: &Client) -> anyhow::Result<(bool, String)> {
        match fault {
            Fault::KillRelay { relay, down_ms } => {
                let slot = &self.relays[*relay];
                slot.set_faulted(true).await;
                slot.signal("KILL").await?;
                slot.wait_exit(Duration::from_secs(10)).await?;
                tokio::time::sleep(Duration::from_millis(*down_ms)).await;
                let pid = slot.start().await?;
                Ok((true, format!("restarted as pid {pid}")))
            }
            Fault::PauseRelay { relay, pause_ms } => {
                let slot = &self.relays[*relay];
                slot.set_faulted(true).await;
                slot.signal("STOP").await?;
                tokio::time::sleep(Duration::from_millis(*pause_ms)).await;
                slot.signal("CONT").await?;
                slot.set_faulted(false).await;
                Ok((true, String::new()))
            }
            Fault::CloseAmqp { target } => {
                let Some(name) = self.connection_name(*target).await else {
                    return Ok((false, "process not running".into()));
                };
                let closed = procs::close_connections(&name).await?;
                Ok((
                    closed > 0,
                    format!("closed {closed} connection(s) named {name}"),
                ))
            }
            Fault::Blackhole {
                target,
                service,
                hold_ms,
            } => {
                self.hold(*target, *service, Mode::Blackhole, *hold_ms)
                    .await
            }
            Fault::Delay {
                target,
                service,
                delay_ms,
                hold_ms,
            } => {
                let mode = Mode::Delay(Duration::from_millis(*delay_ms));
                self.hold(*target, *service, mode, *hold_ms).await
            }
            Fault::Reset {
                target,
                service,
                hold_ms,
            } => self.hold(*target, *service, Mode::Reset, *hold_ms).await,
            Fault::TerminatePg { target } => {
                let n: i64 = client
                    .query_one(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                          WHERE datname = $1 AND application_name = $2",
                        &[&self.db_name, &app_name(*target)],
                    )
                    .await?
                    .get(0);
                Ok((n > 0, format!("terminated {n} session(s)")))
            }
            Fault::CrashConsumer { consumer } => {
                let slot = &self.consumers[*consumer];
                slot.set_faulted(true).await;
                self.book.arm(*consumer);
                let reached = tokio::time::timeout(
                    Duration::from_secs(20),
                    self.crash_points[*consumer].notified(),
                )
                .await
                .is_ok();
                if !reached {
                    self.book.disarm(*consumer);
                    slot.set_faulted(false).await;
                    return Ok((false, "no send came within 20 s".into()));
                }
                slot.signal("KILL").await?;
                slot.wait_exit(Duration::from_secs(10)).await?;
                tokio::time::sleep(Duration::from_millis(300)).await;
                let pid = slot.start().await?;
                Ok((
                    true,
                    format!("killed after an accepted send; restarted as pid {pid}"),
                ))
            }
            Fault::Duplicates { count } => {
                let n = tap::publish_copies(&self.amqp, client, &self.exchange, *count).await?;
                *self.injected_copies.lock().unwrap() += n;
                Ok((n > 0, format!("{n} copies confirmed by the broker")))
            }
        }
    }

    async fn hold(
        &self,
        target: Target,
        service: Service,
        mode: Mode,
        hold_ms: u64,
    ) -> anyhow::Result<(bool, String)> {
        let proxy = self.proxies.get(target, service);
        proxy.set(mode);
        tokio::time::sleep(Duration::from_millis(hold_ms)).await;
        proxy.set(Mode::Pass);
        Ok((true, String::new()))
    }

    /// After the schedule: every proxy passes, every process runs.
    async fn heal(&self) -> anyhow::Result<()> {
        for p in self.proxies.all() {
            p.set(Mode::Pass);
        }
        for slot in self.relays.iter().chain(&self.consumers) {
            if slot.pid().await.is_some() {
                let _ = slot.signal("CONT").await;
            }
            slot.set_faulted(false).await;
            slot.check_alive().await?;
            if slot.pid().await.is_none() {
                slot.start().await?;
            }
        }
        Ok(())
    }
}

/// Postgres and RabbitMQ addresses and credentials from the URLs, for the proxied URLs.
struct Upstreams {
    pg: SocketAddr,
    pg_user: String,
    pg_password: Option<String>,
    amqp: SocketAddr,
    amqp_user: String,
    amqp_password: String,
    vhost: String,
}

async fn upstreams(args: &RunArgs) -> anyhow::Result<Upstreams> {
    let pg = tokio_postgres::Config::from_str(&args.database_url)?;
    let host = match pg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => anyhow::bail!("--database-url must name a TCP host"),
    };
    let port = pg.get_ports().first().copied().unwrap_or(5432);
    let pg_addr = tokio::net::lookup_host((host.as_str(), port))
        .await?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{host} does not resolve"))?;
    let first = args.amqp_url.split(',').next().unwrap_or_default();
    let uri = lapin::uri::AMQPUri::from_str(first).map_err(anyhow::Error::msg)?;
    let a = &uri.authority;
    let amqp_addr = tokio::net::lookup_host((a.host.as_str(), a.port))
        .await?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{} does not resolve", a.host))?;
    Ok(Upstreams {
        pg: pg_addr,
        pg_user: pg.get_user().unwrap_or("postgres").to_owned(),
        pg_password: pg
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned()),
        amqp: amqp_addr,
        amqp_user: a.userinfo.username.clone(),
        amqp_password: a.userinfo.password.clone(),
        vhost: uri.vhost.clone(),
    })
}

impl Upstreams {
    fn pg_url(&self, port: u16, db: &str) -> String {
        let password = self
            .pg_password
            .as_ref()
            .map(|p| format!(":{p}"))
            .unwrap_or_default();
        format!(
            "postgres://{}{password}@127.0.0.1:{port}/{db}",
            self.pg_user
        )
    }

    fn amqp_url(&self, port: u16) -> String {
        let vhost = if self.vhost == "/" {
            "%2f".to_owned()
        } else {
            self.vhost.clone()
        };
        format!(
            "amqp://{}:{}@127.0.0.1:{port}/{vhost}",
            self.amqp_user, self.amqp_password
        )
    }
}

fn percentile(sorted: &[i64], p: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    Some(sorted[i])
}

/// Runs the soak; true when the verdict is PASS.
pub async fn run(args: RunArgs) -> anyhow::Result<bool> {
    let shape = Shape {
        duration: args.duration,
        relays: args.relays,
        consumers: args.consumers,
        lease: args.lease,
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
        &args, &shape, plan, &up, &target, &db_name, &work, &relay_bin, &exe,
    )
    .await;
    if args.keep {
        println!("kept database {db_name}");
    } else {
        let _ = admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {db_name} WITH (FORCE)"))
            .await;
    }
    outcome
}

#[allow(clippy::too_many_arguments)]
async fn soak(
    args: &RunArgs,
    shape: &Shape,
    plan: Vec<Planned>,
    up: &Upstreams,
    target: &DbTarget,
    db_name: &str,
    work: &std::path::Path,
    relay_bin: &std::path::Path,
    exe: &std::path::Path,
) -> anyhow::Result<bool> {
    let schema = Schema::default();
    let mut client = target.connect(&schema, "outbox-soak").await?;
    outbox_kit::schema::migrate(&mut client, &schema).await?;
    client.batch_execute(consumer::SOAK_TABLES).await?;

    let tag = db_name.trim_start_matches("soak_").replace('_', ".");
    let exchange = format!("soak.{tag}");
    let queue = format!("soak.{tag}.apply");
    let amqp = AmqpTarget::parse(&args.amqp_url).map_err(anyhow::Error::msg)?;

    let mut proxies = Proxies {
        relay_pg: Vec::new(),
        relay_amqp: Vec::new(),
        consumer_pg: Vec::new(),
        consumer_amqp: Vec::new(),
    };
    for _ in 0..args.relays {
        proxies.relay_pg.push(TcpProxy::start(up.pg).await);
        proxies.relay_amqp.push(TcpProxy::start(up.amqp).await);
    }
    for _ in 0..args.consumers {
        proxies.consumer_pg.push(TcpProxy::start(up.pg).await);
        proxies.consumer_amqp.push(TcpProxy::start(up.amqp).await);
    }
    let (dest_addr, book, mut crashed) = destination::start().await;
    let tap = Tap::start(&amqp, &exchange, &format!("soak.{tag}.tap")).await?;

    let lease = humantime::format_duration(args.lease).to_string();
    let relays: Vec<Slot> = (0..args.relays)
        .map(|i| {
            let db_url = format!(
                "{}?application_name={}",
                up.pg_url(proxies.relay_pg[i].port(), db_name),
                app_name(Target::Relay(i))
            );
            let amqp_url = up.amqp_url(proxies.relay_amqp[i].port());
            let exchange = exchange.clone();
            let lease = lease.clone();
            Slot::new(
                &format!("relay {i}"),
                relay_bin.to_owned(),
                move |_| {
                    [
                        "run",
                        "--database-url",
                        &db_url,
                        "--amqp-url",
                        &amqp_url,
                        "--exchange",
                        &exchange,
                        "--no-migrate",
                        "--poll-interval",
                        "200ms",
                        "--lease",
                        &lease,
                        "--retry-min",
                        "50ms",
                        "--retry-max",
                        "1s",
                        "--confirm-timeout",
                        "5s",
                        "--batch-size",
                        "200",
                        "--confirm-window",
                        "256",
                        "--shutdown-timeout",
                        "10s",
                        "--http-listen",
                        "127.0.0.1:0",
                    ]
                    .iter()
                    .map(|s| s.to_string())
                    .collect()
                },
                vec![
                    ("RUST_LOG".into(), "info,lapin=error".into()),
                    ("NO_COLOR".into(), "1".into()),
                ],
                work.join(format!("relay-{i}.log")),
            )
        })
        .collect();
    let consumers: Vec<Slot> = (0..args.consumers)
        .map(|i| {
            let db_url = up.pg_url(proxies.consumer_pg[i].port(), db_name);
            let amqp_url = up.amqp_url(proxies.consumer_amqp[i].port());
            let (exchange, queue) = (exchange.clone(), queue.clone());
            let prefetch = args.prefetch.max(1).to_string();
            Slot::new(
                &format!("consumer {i}"),
                exe.to_owned(),
                move |incarnation| {
                    vec![
                        "consumer".into(),
                        "--database-url".into(),
                        db_url.clone(),
                        "--amqp-url".into(),
                        amqp_url.clone(),
                        "--exchange".into(),
                        exchange.clone(),
                        "--queue".into(),
                        queue.clone(),
                        "--destination".into(),
                        dest_addr.to_string(),
                        "--worker".into(),
                        destination::worker_name(i, incarnation),
                        "--application-name".into(),
                        app_name(Target::Consumer(i)),
                        "--prefetch".into(),
                        prefetch.clone(),
                    ]
                },
                vec![
                    (
                        "RUST_LOG".into(),
                        "warn,outbox_relay=info,lapin=error".into(),
                    ),
                    ("NO_COLOR".into(), "1".into()),
                ],
                work.join(format!("consumer-{i}.log")),
            )
        })
        .collect();
    let world = Arc::new(World {
        db_name: db_name.to_owned(),
        exchange: exchange.clone(),
        amqp: amqp.clone(),
        target: target.clone(),
        relays,
        consumers,
        proxies,
        book: book.clone(),
        crash_points: (0..args.consumers).map(|_| Notify::new()).collect(),
        host: hostname(),
        injected_copies: Mutex::new(0),
    });
    {
        let w = world.clone();
        tokio::spawn(async move {
            while let Some(slot) = crashed.recv().await {
                if let Some(n) = w.crash_points.get(slot) {
                    n.notify_one();
                }
            }
        });
    }
    let result = drive(args, shape, plan, &world, &client, &tap, &queue, work).await;
    // Whatever happened, nothing of ours keeps running.
    for slot in world.relays.iter().chain(&world.consumers) {
        slot.kill().await;
    }
    if !args.keep {
        cleanup_broker(&amqp, &exchange, &queue).await;
    }
    tap.stop().await;
    result
}

async fn cleanup_broker(amqp: &AmqpTarget, exchange: &str, queue: &str) {
    let Ok(conn) = amqp.connect("outbox-soak-cleanup").await else {
        return;
    };
    if let Ok(ch) = conn.create_channel().await {
        let mut queues = vec![queue.to_owned(), format!("{queue}.dlq")];
        for ms in [100, 200, 400, 800, 1000] {
            queues.push(format!("{queue}.retry.{ms}ms"));
        }
        for q in queues {
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
        }
        for x in [format!("{queue}.dlx"), exchange.to_owned()] {
            let _ = ch
                .exchange_delete(x.as_str().into(), Default::default())
                .await;
        }
    }
    let _ = conn.close(200, "cleanup".into()).await;
}

/// How many messages wait in `queue`; None when it does not exist.
async fn queue_depth(amqp: &AmqpTarget, queue: &str) -> Option<(u32, u32)> {
    let conn = amqp.connect("outbox-soak-check").await.ok()?;
    let ch = conn.create_channel().await.ok()?;
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .ok();
    let _ = conn.close(200, "checked".into()).await;
    q.map(|q| (q.message_count(), q.consumer_count()))
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    args: &RunArgs,
    shape: &Shape,
    plan: Vec<Planned>,
    world: &Arc<World>,
    client: &Client,
    tap: &Tap,
    queue: &str,
    work: &std::path::Path,
) -> anyhow::Result<bool> {
    for slot in world.relays.iter().chain(&world.consumers) {
        slot.start().await?;
    }
    let partitions_held = wait_until(Duration::from_secs(60), Duration::from_millis(200), || async {
        client
            .query_one(
                "SELECT count(*) FROM outbox_partitions WHERE owner IS NOT NULL AND lease_until > now()",
                &[],
            )
            .await
            .map(|r| r.get::<_, i64>(0) == 64)
            .unwrap_or(false)
    })
    .await;
    anyhow::ensure!(
        partitions_held,
        "the relays did not take the 64 partitions within 60 s; see {}",
        work.display()
    );
    let consuming = wait_until(
        Duration::from_secs(60),
        Duration::from_millis(300),
        || async {
            queue_depth(&world.amqp, queue)
                .await
                .is_some_and(|(_, consumers)| consumers as usize >= world.consumers.len())
        },
    )
    .await;
    anyhow::ensure!(
        consuming,
        "the consumers did not start consuming {queue} within 60 s; see {}",
        work.display()
    );
    println!("relays hold the partitions, consumers consume; producing");

    // Producers.
    let stop_producing = CancellationToken::new();
    let produced: producer::Shared = Arc::default();
    let rng = Rng::new(args.seed);
    let load = Load {
        rate: args.rate,
        keys: args.keys,
        producers: args.producers,
    };
    let mut producers = Vec::new();
    for id in 0..=args.producers {
        let c = world.target.clone();
        let (r, l, s) = (
            rng.fork(100 + id as u64),
            produced.clone(),
            stop_producing.clone(),
        );
        producers.push(if id == args.producers {
            tokio::spawn(producer::late(id, c, r, load, l, s))
        } else {
            tokio::spawn(producer::steady(id, c, r, load, l, s))
        });
    }

    // The reconciler settles effects a dead consumer left in `sending`.
    let stop_reconciling = CancellationToken::new();
    let reconciled = {
        let target = world.target.clone();
        let cfg = ReconcileConfig::new(
            Duration::from_secs(3),
            Duration::from_secs(3600),
            std::num::NonZeroUsize::new(1000).expect("non-zero"),
            consumer::SEND_TIMEOUT,
        )?;
        let ledger = Ledger::new(EffectsConfig::new(
            "soak-reconciler",
            consumer::SEND_TIMEOUT,
            consumer::WRITE_TIMEOUT,
            consumer::EFFECT_LEASE,
        )?);
        let dest = Local(world.book.clone());
        let stop = stop_reconciling.clone();
        tokio::spawn(async move {
            let mut resolved = 0usize;
            let mut rc: Option<Client> = None;
            while !stop.is_cancelled() {
                if rc.as_ref().is_none_or(|c| c.is_closed()) {
                    rc = target
                        .connect(&Schema::default(), "outbox-soak-reconciler")
                        .await
                        .map_err(|e| eprintln!("soak: reconciler connection: {e}"))
                        .ok();
                }
                if let Some(c) = &rc {
                    match reconcile::reconcile(c, &cfg, &ledger, &dest).await {
                        Ok(r) => resolved += r.resolved.len(),
                        Err(e) => eprintln!("soak: reconcile: {e}"),
                    }
                }
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            resolved
        })
    };

    // Processes that exit by themselves are restarted (and reported).
    let stop_monitor = CancellationToken::new();
    let monitor = {
        let (w, stop) = (world.clone(), stop_monitor.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                for slot in w.relays.iter().chain(&w.consumers) {
                    if let Err(e) = slot.check_alive().await {
                        eprintln!("soak: {}: {e}", slot.name);
                    }
                }
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
        })
    };

    // The fault schedule.
    let t0 = tokio::time::Instant::now();
    let started_ms = now_ms();
    let records: Arc<Mutex<Vec<FaultRecord>>> = Arc::default();
    let mut faults = Vec::new();
    for p in plan {
        let (w, records) = (world.clone(), records.clone());
        faults.push(tokio::spawn(async move {
            tokio::time::sleep_until(t0 + Duration::from_millis(p.at_ms)).await;
            let started = now_ms();
            let what = p.fault.to_string();
            println!(
                "  +{:>6.1}s  {what}",
                (started - started_ms) as f64 / 1000.0
            );
            // A connection per fault, only while it runs: a long schedule has hundreds.
            let injected = match w
                .target
                .connect(&Schema::default(), "outbox-soak-faults")
                .await
            {
                Ok(c) => w.inject(&p.fault, &c).await,
                Err(e) => Err(e.into()),
            };
            let (injected, note) = match injected {
                Ok(r) => r,
                Err(e) => (false, format!("error: {e:#}")),
            };
            if !injected {
                println!("            not injected: {note}");
            }
            records.lock().unwrap().push(FaultRecord {
                planned: p,
                what,
                started_ms: started,
                ended_ms: now_ms(),
                injected,
                note,
                recovery_ms: None,
            });
        }));
    }
    if args.plant_unexpected {
        tokio::time::sleep_until(t0 + Duration::from_secs(2).min(shape.duration)).await;
        let id = tap::publish_stray(&world.amqp, &world.exchange).await?;
        println!("planted a stray event {id} (never committed): the verdict must fail");
    }
    tokio::time::sleep_until(t0 + shape.duration).await;
    for f in faults {
        // Every fault ends before the duration by construction; allow for slow commands.
        let _ = tokio::time::timeout(Duration::from_secs(60), f).await;
    }
    world.heal().await?;
    stop_producing.cancel();
    for p in producers {
        let _ = p.await;
    }
    let quiet_started = Instant::now();
    let produced_ms = now_ms() - started_ms;
    println!(
        "faults over, producers stopped after {:.1}s; quiet period: draining",
        produced_ms as f64 / 1000.0
    );

    // The quiet period: wait until everything committed is dispatched, seen by the tap,
    // applied once, and its effect is sent.
    let committed_ids: HashSet<String> = produced
        .lock()
        .unwrap()
        .committed
        .iter()
        .map(|c| c.event_id.to_string())
        .collect();
    let drained = wait_until(args.drain_timeout, Duration::from_millis(500), || async {
        let Ok(r) = client
            .query_one(
                "SELECT (SELECT count(*) FROM outbox_events WHERE dispatched_at IS NULL AND parked_at IS NULL),
                        (SELECT count(DISTINCT event_id) FROM soak_applied),
                        (SELECT count(*) FROM outbox_effects WHERE state <> 'sent')",
                &[],
            )
            .await
        else {
            return false;
        };
        let (pending, applied, open): (i64, i64, i64) = (r.get(0), r.get(1), r.get(2));
        if pending > 0 || (applied as usize) < committed_ids.len() || open > 0 {
            return false;
        }
        let seen: HashSet<String> = tap.deliveries().into_iter().map(|d| d.event_id).collect();
        committed_ids.iter().all(|id| seen.contains(id))
    })
    .await;
    let drain_ms = quiet_started.elapsed().as_millis() as i64;
    println!(
        "{} in {:.1}s",
        if drained { "drained" } else { "NOT drained" },
        drain_ms as f64 / 1000.0
    );
    stop_monitor.cancel();
    let _ = monitor.await;

    // Stop: SIGTERM, as an orchestrator would; a relay must exit 0.
    let mut exit_codes = Vec::new();
    for slot in world.relays.iter().chain(&world.consumers) {
        let code = match slot.signal("TERM").await {
            Ok(()) => slot.wait_exit(Duration::from_secs(30)).await.ok().flatten(),
            Err(_) => None,
        };
        exit_codes.push((slot.name.clone(), code));
    }
    stop_reconciling.cancel();
    let resolved_by_reconciler = reconciled.await.unwrap_or(0);
    // Let the last deliveries reach the tap: until its count holds still for a second.
    let mut last = tap.count();
    let _ = wait_until(Duration::from_secs(10), Duration::from_secs(1), || {
        let now = tap.count();
        let still = now == last;
        last = now;
        async move { still }
    })
    .await;

    let records = records.lock().unwrap().clone();
    let produced = std::mem::take(&mut *produced.lock().unwrap());
    let verdict = check(
        args,
        world,
        client,
        tap,
        queue,
        records,
        produced,
        Timing {
            started_ms,
            produced_ms,
            drain_ms,
            drained,
        },
        exit_codes,
        resolved_by_reconciler,
        work,
    )
    .await?;
    Ok(verdict)
}

struct Timing {
    started_ms: i64,
    produced_ms: i64,
    drain_ms: i64,
    drained: bool,
}

#[allow(clippy::too_many_arguments)]
async fn check(
    args: &RunArgs,
    world: &World,
    client: &Client,
    tap: &Tap,
    queue: &str,
    mut records: Vec<FaultRecord>,
    produced: producer::Ledger,
    timing: Timing,
    exit_codes: Vec<(String, Option<i32>)>,
    resolved_by_reconciler: usize,
    work: &std::path::Path,
) -> anyhow::Result<bool> {
    let committed_uuids: Vec<uuid::Uuid> = produced.committed.iter().map(|c| c.event_id).collect();
    let committed_set: HashSet<uuid::Uuid> = committed_uuids.iter().copied().collect();

    // The database agrees with the producers: every committed row is there, no rolled-back one.
    let in_db: HashSet<uuid::Uuid> = client
        .query("SELECT event_id FROM outbox_events", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let db_mismatch = in_db.symmetric_difference(&committed_set).count();
    let counts = client
        .query_one(
            "SELECT count(*) FILTER (WHERE parked_at IS NOT NULL),
                    count(*) FILTER (WHERE dispatched_at IS NULL AND parked_at IS NULL)
               FROM outbox_events",
            &[],
        )
        .await?;
    let (parked, pending): (i64, i64) = (counts.get(0), counts.get(1));

    // Deliveries at the broker.
    let deliveries = tap.deliveries();
    let delivery = checker::check(&committed_uuids, &deliveries);

    // Applies, in the order the consumers applied them.
    let rows = client
        .query(
            "SELECT event_id, aggregate_type, aggregate_id, seq,
                    (extract(epoch FROM applied_at) * 1000)::bigint
               FROM soak_applied ORDER BY n",
            &[],
        )
        .await?;
    let mut applied = Vec::with_capacity(rows.len());
    let mut applied_at: HashMap<String, i64> = HashMap::new();
    for r in &rows {
        let id = r.get::<_, uuid::Uuid>(0).to_string();
        applied_at.entry(id.clone()).or_insert(r.get(4));
        applied.push(Applied {
            event_id: id,
            key: (r.get(1), r.get(2)),
            seq: r.get(3),
        });
    }
    let committed_keys: Vec<(String, (String, String))> = produced
        .committed
        .iter()
        .map(|c| {
            (
                c.event_id.to_string(),
                ("acct".to_owned(), c.aggregate_id.clone()),
            )
        })
        .collect();
    let applied_report = checker::check_applied(&committed_keys, &applied);

    // Effects at the destination against the ledger.
    let expected: Vec<String> = committed_uuids.iter().map(consumer::effect_key).collect();
    let ledger: HashMap<String, LedgerRow> = client
        .query(
            "SELECT effect_key, state, external_id FROM outbox_effects",
            &[],
        )
        .await?
        .iter()
        .map(|r| {
            (
                r.get(0),
                LedgerRow {
                    state: r.get(1),
                    external_id: r.get(2),
                },
            )
        })
        .collect();
    let effects = checker::check_effects(&expected, &world.book.accepted(), &ledger);

    // Recovery after each fault.
    let commits: Vec<(String, i64)> = produced
        .committed
        .iter()
        .map(|c| (c.event_id.to_string(), c.at_ms))
        .collect();
    let recovery = Recovery::new(&commits, &applied_at);
    for r in &mut records {
        r.recovery_ms = recovery.after(r.ended_ms);
    }
    records.sort_by_key(|r| r.planned.at_ms);
    let mut times: Vec<i64> = records
        .iter()
        .filter(|r| r.injected)
        .filter_map(|r| r.recovery_ms)
        .collect();
    times.sort_unstable();

    let dead_lettered = queue_depth(&world.amqp, &format!("{queue}.dlq"))
        .await
        .map_or(0, |(n, _)| n);
    let injected_copies = *world.injected_copies.lock().unwrap();
    let relay_faults = records
        .iter()
        .filter(|r| r.injected && r.planned.fault.hits_a_relay())
        .count();
    // A relay fault can make a relay publish again what it published but had not marked:
    // at most its confirm window (256) plus the acked rows waiting for their mark (one
    // batch, 200). Everything else is the copies the soak itself published.
    let duplicate_bound = injected_copies + (relay_faults + 1) * (256 + 200);
    let mut unexpected_exits = Vec::new();
    for slot in world.relays.iter().chain(&world.consumers) {
        unexpected_exits.extend(slot.unexpected_exits().await);
    }

    let mut failures = Vec::new();
    let mut fail = |cond: bool, what: String| {
        if cond {
            failures.push(what);
        }
    };
    fail(
        !timing.drained,
        format!(
            "did not drain within {}",
            humantime::format_duration(args.drain_timeout)
        ),
    );
    fail(delivery.lost > 0, format!("lost {}", delivery.lost));
    fail(
        delivery.unexpected > 0,
        format!("unexpected {}", delivery.unexpected),
    );
    fail(
        delivery.order_violations > 0,
        format!("order violations {}", delivery.order_violations),
    );
    fail(
        !effects.exactly_once(),
        format!("effects not exactly once: {:?}", effects.examples),
    );
    fail(
        !applied_report.clean(),
        format!(
            "applies out of order or missing: {:?}",
            applied_report.examples
        ),
    );
    fail(
        delivery.duplicates > duplicate_bound,
        format!(
            "duplicates {} above the bound {duplicate_bound}",
            delivery.duplicates
        ),
    );
    fail(parked > 0, format!("parked {parked}"));
    fail(pending > 0, format!("pending {pending}"));
    fail(dead_lettered > 0, format!("dead-lettered {dead_lettered}"));
    fail(
        db_mismatch > 0,
        format!("database and producers disagree on {db_mismatch} events"),
    );
    fail(
        !unexpected_exits.is_empty(),
        format!("processes exited by themselves: {unexpected_exits:?}"),
    );
    for (name, code) in &exit_codes {
        fail(
            *code != Some(0),
            format!("{name} exited {code:?} after SIGTERM"),
        );
    }
    for r in records.iter().filter(|r| r.note.starts_with("error:")) {
        fail(true, format!("fault '{}' failed: {}", r.what, r.note));
    }
    let pass = failures.is_empty();

    let report = json!({
        "verdict": if pass { "PASS" } else { "FAIL" },
        "failures": failures,
        "seed": args.seed,
        "duration_s": args.duration.as_secs_f64(),
        "produced_s": timing.produced_ms as f64 / 1000.0,
        "drain_s": timing.drain_ms as f64 / 1000.0,
        "started_at_ms": timing.started_ms,
        "load": { "rate": args.rate, "keys": args.keys, "producers": args.producers + 1,
                  "relays": args.relays, "consumers": args.consumers,
                  "lease_s": args.lease.as_secs_f64() },
        "events": {
            "committed": produced.committed.len(),
            "rolled_back": produced.rolled_back.len(),
            "committed_late": produced.late,
            "producer_commits_failed": produced.unknown,
            "producer_transactions_failed": produced.failed,
            "parked": parked,
            "dead_lettered": dead_lettered,
        },
        "faults": records,
        "faults_injected": records.iter().filter(|r| r.injected).count(),
        "delivery": delivery,
        "duplicates": {
            "received": delivery.duplicates,
            "injected_copies": injected_copies,
            "bound": duplicate_bound,
        },
        "applied": applied_report,
        "effects": effects,
        "effects_resolved_by_reconciler": resolved_by_reconciler,
        "destination_accepted": world.book.count(),
        "destination_deleted": world.book.deleted(),
        "recovery_ms": {
            "max": times.last(),
            "p50": percentile(&times, 0.5),
            "p90": percentile(&times, 0.9),
        },
        "exit_codes_after_sigterm": exit_codes,
        "unexpected_exits": unexpected_exits,
        "proxies": world.proxies.all().map(|p| json!({"accepted": p.stats().accepted, "broken": p.stats().broken})).collect::<Vec<_>>(),
        "logs": work.display().to_string(),
    });
    let text = serde_json::to_string_pretty(&report)?;
    let path = args
        .report
        .clone()
        .unwrap_or_else(|| work.join("report.json"));
    std::fs::write(&path, &text)?;
    println!("{text}");
    println!("report: {}", path.display());
    let secs =
        |ms: Option<&i64>| ms.map_or("-".to_owned(), |m| format!("{:.1}s", *m as f64 / 1000.0));
    println!(
        "outbox-soak seed={} duration={}: {} | {} events ({} rolled back, {} committed late), {} of {} faults injected, duplicates {} (bound {duplicate_bound}), lost {}, unexpected {}, order violations {}, effects performed exactly once {}/{}, applied in seq order over {} keys: {}, recovery max {} median {}, drained in {:.1}s{}",
        args.seed,
        humantime::format_duration(args.duration),
        if pass { "PASS" } else { "FAIL" },
        produced.committed.len(),
        produced.rolled_back.len(),
        produced.late,
        records.iter().filter(|r| r.injected).count(),
        records.len(),
        delivery.duplicates,
        delivery.lost,
        delivery.unexpected,
        delivery.order_violations,
        effects.expected - effects.missing - effects.performed_twice,
        effects.expected,
        applied_report.keys,
        if applied_report.clean() { "yes" } else { "NO" },
        secs(times.last()),
        secs(percentile(&times, 0.5).as_ref()),
        timing.drain_ms as f64 / 1000.0,
        if pass {
            String::new()
        } else {
            format!(" | failures: {}", failures.join("; "))
        },
    );
    Ok(pass)
}
