//! The `outbox-relay` binary: parse flags, set up logging and signals, wire connections
//! from `Config`, run a command, map the result to an exit code (0 clean, 1 a failure
//! retries cannot fix, 2 bad configuration).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::error::ErrorKind;
mod cli;

use cli::{Cli, Command, Config, Database, Operator, Output, SecretFiles};
use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;
use outbox_kit::internal::Backoff;
use outbox_kit::internal::Down;
use outbox_kit::schema::{self, MigrateError};
use outbox_relay::demo::{self, DemoError};
use outbox_relay::http;
use outbox_relay::operator;
use outbox_relay::relay::{self, Deps};
use outbox_relay::replay;
use outbox_relay::telemetry::{self, Telemetry};
use outbox_relay::trace::StageTrace;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let cli = match Cli::parse_args(std::env::args_os()) {
        Ok(cli) => cli,
        Err(e) => return clap_exit(e),
    };
    // The demo draws a progress line on stderr: only warnings and errors log there.
    let default_filter = match cli.command {
        Command::Demo(_) => "warn,lapin=error",
        _ => "info,lapin=error",
    };
    let rust_log = std::env::var("RUST_LOG").ok();
    cli::logging::init(cli.log_format, default_filter, rust_log.as_deref());
    // Secrets may come from files (DATABASE_URL_FILE, ...); the names are read here, once.
    let files = SecretFiles {
        database_url: std::env::var_os("DATABASE_URL_FILE").map(Into::into),
        amqp_url: std::env::var_os("AMQP_URL_FILE").map(Into::into),
        admin_token: std::env::var_os("OUTBOX_ADMIN_TOKEN_FILE").map(Into::into),
    };
    let config = match cli.into_config(&files) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("outbox-relay: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outbox-relay: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<BadFlag>() => {
            eprintln!("outbox-relay: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("outbox-relay: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Help and version go to stdout with status 0; anything else is one line and status 2.
fn clap_exit(e: clap::Error) -> ExitCode {
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            ExitCode::from(2)
        }
        _ => {
            let text = e.render().to_string();
            let line = text.lines().next().unwrap_or("invalid arguments");
            let line = line.strip_prefix("error: ").unwrap_or(line);
            eprintln!("outbox-relay: {line} (see outbox-relay --help)");
            ExitCode::from(2)
        }
    }
}

/// A configuration problem found only at run time (a port in use): exit 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct BadFlag(String);

fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        t.cancel();
    });
    token
}

async fn run(config: Config) -> anyhow::Result<()> {
    match config {
        Config::Demo(cfg) => run_demo(cfg).await,
        Config::GroupRouter(cfg) => run_group_router(cfg).await,
        Config::Operator { db, command } => {
            let client = connect(&db, command.name()).await?;
            run_operator(client, &db, command).await
        }
        Config::Run {
            db,
            amqp,
            schema,
            migrate,
            relay: relay_config,
            http_listen,
            admin_token,
            stage_trace,
        } => {
            let shutdown = shutdown_on_signals();
            let telemetry = match stage_trace {
                Some(path) => Telemetry::default().with_stage_trace(
                    StageTrace::create(&path).map_err(|e| {
                        BadFlag(format!(
                            "--stage-trace: cannot create {}: {e}",
                            path.display()
                        ))
                    })?,
                ),
                None => Telemetry::default(),
            };
            let pool = db.pool(&schema, "outbox-relay", 8);
            // The endpoint comes up first, so probes see "not ready" while we wait for
            // Postgres, and stays up while the relay drains after SIGTERM.
            let http_stop = CancellationToken::new();
            let http = match http_listen {
                Some(addr) => {
                    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
                        BadFlag(format!("--http-listen: cannot listen on {addr}: {e}"))
                    })?;
                    // Its own pool: no request can hold a connection the relay needs.
                    let state = http::HttpState::new(telemetry.clone(), &db, &schema, admin_token);
                    Some(tokio::spawn(http::serve(
                        listener,
                        state,
                        http_stop.clone(),
                    )))
                }
                None => None,
            };
            if migrate && !migrate_when_reachable(&db, &schema, &shutdown).await? {
                return Ok(()); // stopped before the database came up
            }
            let deps = Deps {
                pool,
                db,
                schema,
                amqp,
                telemetry,
            };
            let result = relay::run(deps, relay_config, shutdown).await;
            http_stop.cancel();
            if let Some(h) = http {
                let _ = h.await;
            }
            result?;
            Ok(())
        }
    }
}

/// The one connection of an operator command, named for `pg_stat_activity`.
async fn connect(db: &Database, command: &str) -> anyhow::Result<Client> {
    db.target
        .connect(&db.schema, &format!("outbox-relay-{command}"))
        .await
        .context("cannot connect to postgres")
}

impl Output {
    /// Prints a command's result: JSON on one line for scripts, or text.
    fn print(self, text: impl FnOnce() -> String, json: impl FnOnce() -> serde_json::Value) {
        match self {
            Output::Json => println!("{}", json()),
            Output::Text => print!("{}", text()),
        }
    }
}

/// The commands that connect to the database, do one job and exit.
async fn run_operator(mut client: Client, db: &Database, command: Operator) -> anyhow::Result<()> {
    match command {
        Operator::Migrate => {
            let schema = &db.schema;
            let report = schema::migrate(&mut client, schema).await?;
            let applied = report.changed();
            if applied.is_empty() {
                println!(
                    "schema {schema} is up to date ({} migrations)",
                    report.already
                );
            } else {
                println!("schema {schema}: applied {}", applied.join(", "));
            }
        }
        Operator::Status { output } => {
            let status = operator::status(&client).await?;
            output.print(|| operator::status_text(&status), || status.clone());
        }
        Operator::ParkedList {
            filter,
            limit,
            output,
        } => {
            let rows = operator::parked(&client, &filter, limit).await?;
            output.print(
                || {
                    format!(
                        "{}{} parked row(s) shown\n",
                        operator::parked_text(&rows),
                        rows.len()
                    )
                },
                || operator::parked_json(&rows),
            );
        }
        Operator::ConsumerBlocked {
            consumer,
            limit,
            output,
        } => {
            let keys = operator::blocked(&client, consumer.as_deref(), limit).await?;
            output.print(
                || operator::blocked_text(&keys),
                || operator::blocked_json(&keys),
            );
        }
        Operator::Redrive { filter, dry_run } => {
            let done = operator::redrive(&mut client, &filter, dry_run).await?;
            println!("{}", done.summary());
        }
        Operator::Reconcile { reconcile, every } => {
            let shutdown = shutdown_on_signals();
            loop {
                let report = outbox_kit::consumer::reconcile::review(&client, &reconcile)
                    .await
                    .context("reconcile failed")?;
                print_reconcile(&report, &reconcile);
                let Some(every) = every else { break };
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(every) => {}
                }
            }
        }
        Operator::ConsumerRelease {
            consumer,
            aggregate_type,
            aggregate_id,
        } => {
            let held = outbox_kit::consumer::inbox::release(
                &client,
                &consumer,
                &aggregate_type,
                &aggregate_id,
            )
            .await?;
            match held {
                Some(n) => println!(
                    "released {aggregate_type}/{aggregate_id} of consumer {consumer}: {n} held event(s) will be applied in seq order"
                ),
                None => println!(
                    "{aggregate_type}/{aggregate_id} of consumer {consumer} is not blocked: nothing changed"
                ),
            }
        }
        Operator::Replay { amqp, replay } => run_replay(&client, &amqp, &replay).await?,
    }
    Ok(())
}

/// A replay: the progress line on stderr after each batch (at most one a second), the
/// summary on stdout; a refused selection, name or queue exits 2.
async fn run_replay(
    client: &Client,
    amqp: &outbox_kit::amqp::AmqpTarget,
    config: &replay::ReplayConfig,
) -> anyhow::Result<()> {
    let shutdown = shutdown_on_signals();
    let mut shown: Option<std::time::Instant> = None;
    let result = replay::run(client, amqp, config, &shutdown, |p| {
        if shown.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
            eprintln!("{p}");
            shown = Some(std::time::Instant::now());
        }
    })
    .await;
    match result {
        Ok(summary) => {
            println!("{summary}");
            Ok(())
        }
        Err(e) if e.is_bad_flag() => Err(BadFlag(e.to_string()).into()),
        Err(e) => Err(anyhow::Error::new(e).context(format!("replay {} failed", config.name))),
    }
}

/// The demo: a progress line on stderr (redrawn in place on a terminal, one line a second
/// otherwise), the summary on stdout; exit 1 when events were lost.
async fn run_demo(cfg: demo::DemoConfig) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let shutdown = shutdown_on_signals();
    let tty = std::io::stderr().is_terminal();
    let stop = match cfg.stop {
        demo::Stop::After(d) => format!("for {}", humantime::format_duration(d)),
        demo::Stop::Events(n) => format!("{n} events"),
    };
    eprintln!(
        "outbox-relay demo: database {} (re-created), exchange {}, queue {}; {} events/s over {} keys, {stop} (Ctrl-C stops early)",
        cfg.database, cfg.exchange, cfg.queue, cfg.rate, cfg.keys
    );
    if let Some(addr) = cfg.http_listen {
        eprintln!("dashboard and metrics: http://{addr}/");
    }
    let result = demo::run(cfg, shutdown, |p| {
        if tty {
            eprint!("\r\x1b[2K{p}");
        } else {
            eprintln!("{p}");
        }
    })
    .await;
    if tty {
        eprintln!();
    }
    match result {
        Ok(summary) => {
            println!("{summary}");
            if summary.lost > 0 {
                anyhow::bail!(
                    "{} events were produced and not consumed within --drain-timeout",
                    summary.lost
                );
            }
            Ok(())
        }
        Err(e @ DemoError::NotADemoDatabase(_)) => {
            Err(BadFlag(format!("--database-name: {e}")).into())
        }
        Err(e @ DemoError::Listen { .. }) => Err(BadFlag(e.to_string()).into()),
        Err(e @ DemoError::Interrupted) => {
            eprintln!("outbox-relay demo: {e}");
            Ok(())
        }
        Err(e) => Err(anyhow::Error::new(e).context("demo failed")),
    }
}

/// `group-router`: the HTTP endpoint first (probes see "not ready" until the group is
/// prepared), then the router until SIGTERM; the endpoint stays up while it drains.
async fn run_group_router(
    cfg: outbox_relay::group_router::GroupRouterConfig,
) -> anyhow::Result<()> {
    use outbox_relay::group_router::{self, RouterTelemetry};
    let shutdown = shutdown_on_signals();
    let telemetry = std::sync::Arc::new(RouterTelemetry::new(&cfg.group.name));
    let http_stop = CancellationToken::new();
    let http = match cfg.http_listen {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| BadFlag(format!("--http-listen: cannot listen on {addr}: {e}")))?;
            let app = group_router::app(telemetry.clone());
            Some(tokio::spawn(http::serve_app(
                listener,
                app,
                http::Limits::default(),
                http_stop.clone(),
            )))
        }
        None => None,
    };
    let pool = cfg.db.pool(&cfg.schema, "outbox-relay-group-router", 2);
    let result = group_router::run(cfg.router(), pool, telemetry, shutdown).await;
    http_stop.cancel();
    if let Some(h) = http {
        let _ = h.await;
    }
    result.context("group router failed")
}

/// One line per stuck effect (for review), then a summary line.
fn print_reconcile(
    report: &outbox_kit::consumer::reconcile::Report,
    cfg: &outbox_kit::consumer::reconcile::ReconcileConfig,
) {
    for s in &report.review {
        println!(
            "review: effect {} (destination {}) sending since {} claimed by {}, attempt {}{}{}",
            s.key,
            s.destination,
            humantime::format_rfc3339_seconds(s.claimed_at),
            s.claimed_by,
            s.attempts,
            if s.cancel_requested {
                ", cancel requested"
            } else {
                ""
            },
            s.last_error
                .as_deref()
                .map(|e| format!(", last error: {e}"))
                .unwrap_or_default(),
        );
    }
    println!(
        "reconcile: {} stuck effects for review; deleted {} finished effects and {} inbox rows older than {}",
        report.review.len(),
        report.effects_deleted,
        report.inbox_deleted,
        humantime::format_duration(cfg.retention),
    );
}

/// Applies migrations, waiting for Postgres if it is not up yet. Returns false if a
/// shutdown signal came first.
async fn migrate_when_reachable(
    db: &DbTarget,
    schema: &Schema,
    shutdown: &CancellationToken,
) -> anyhow::Result<bool> {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    let mut down = Down::new("postgres");
    loop {
        let attempt = async {
            let mut client = db.connect(schema, "outbox-relay-migrate").await?;
            schema::migrate(&mut client, schema).await
        };
        match attempt.await {
            Ok(report) => {
                down.recovered();
                telemetry::migrations_applied(&report.changed(), report.already);
                return Ok(true);
            }
            Err(MigrateError::Db(e)) if e.is_transient() => {
                let delay = backoff.next_delay();
                down.failed(&e, delay);
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(false),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
            Err(e) => return Err(e).context("migration failed"),
        }
    }
}
