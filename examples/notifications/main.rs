//! The consumer kit's worked example: ticket notifications.
//!
//! A ticket service changes ticket statuses; each change, in one transaction, inserts one
//! delivery per channel, reserves the tenant's message budget and enqueues an outbox event
//! (`tickets.rs`). The relay publishes the events. A consumer sends the deliveries through a
//! fake HTTP provider that answers ok, slowly (timeout), 503 or "invalid address"
//! (`consumer.rs`, `provider.rs`). The ticket service can cancel a delivery, which withdraws
//! a sent message at the provider.
//!
//! ```text
//! cargo run --example notifications                  # demo: everything in one process
//! cargo run --example notifications -- consumer \
//!     --exchange E --queue Q --provider http://127.0.0.1:PORT [--crash-after-send]
//! ```
//! Postgres and RabbitMQ come from DATABASE_URL and AMQP_URL (local defaults). The demo
//! creates its tables in the database it is given: point it at a scratch database.

mod consumer;
mod provider;
mod tickets;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::consumer::effects::{EffectsConfig, Ledger};
use outbox_kit::consumer::runner::{self, ConsumerConfig, ConsumerDeps};
use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;
use outbox_kit::producer::Outbox;
use outbox_relay::relay::{self, Deps, RelayConfig};
use tokio_util::sync::CancellationToken;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// `--flag value` pairs and bare `--flag`s, after the mode.
fn flags(args: &[String]) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut i = 0;
    while i < args.len() {
        let name = args[i].trim_start_matches("--").to_owned();
        match args.get(i + 1).filter(|v| !v.starts_with("--")) {
            Some(v) => {
                out.insert(name, v.clone());
                i += 2;
            }
            None => {
                out.insert(name, String::new());
                i += 1;
            }
        }
    }
    out
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

fn main() -> Result<(), Error> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,lapin=error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().cloned().unwrap_or_else(|| "demo".into());
    let flags = flags(args.get(1..).unwrap_or_default());
    let rt = tokio::runtime::Runtime::new()?;
    match mode.as_str() {
        "demo" => rt.block_on(demo(&flags)),
        "consumer" => rt.block_on(consume(&flags)),
        other => Err(format!("unknown mode '{other}': use demo or consumer").into()),
    }
}

fn targets() -> Result<(DbTarget, AmqpTarget), Error> {
    let db = DbTarget::parse(&env_or(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/postgres",
    ))?;
    let amqp = AmqpTarget::parse(&env_or("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"))?;
    Ok((db, amqp))
}

fn stop_on_ctrl_c() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        t.cancel();
    });
    token
}

/// Only the consumer: for running it as its own process (and for the crash test).
async fn consume(flags: &HashMap<String, String>) -> Result<(), Error> {
    let (db, amqp) = targets()?;
    let schema = Schema::default();
    let get = |name: &str| {
        flags
            .get(name)
            .cloned()
            .ok_or_else(|| format!("--{name} is required"))
    };
    let worker = flags
        .get("worker")
        .cloned()
        .unwrap_or_else(|| format!("notifier-{}", std::process::id()));
    let send_timeout = Duration::from_millis(
        flags
            .get("send-timeout-ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(1000),
    );
    let ledger = Ledger::new(EffectsConfig::new(
        worker,
        send_timeout,
        Duration::from_millis(500),
        send_timeout * 2 + Duration::from_secs(1),
    )?);
    let mut cfg = ConsumerConfig::new(&get("queue")?, &get("exchange")?, &["ticket.#"]);
    cfg.retry_min = Duration::from_millis(100);
    cfg.retry_max = Duration::from_secs(2);
    let deps = ConsumerDeps {
        pool: db.pool(&schema, "notifications-consumer", 32),
        amqp,
    };
    let provider = consumer::ProviderClient::new(&get("provider")?, send_timeout * 2);
    let shutdown = stop_on_ctrl_c();
    if flags.contains_key("crash-after-send") {
        let handler = Arc::new(consumer::Notifier {
            ledger,
            provider: Arc::new(consumer::CrashAfterSend(provider)),
        });
        runner::run(deps, cfg, handler, shutdown).await?;
    } else {
        let handler = Arc::new(consumer::Notifier {
            ledger,
            provider: Arc::new(provider),
        });
        runner::run(deps, cfg, handler, shutdown).await?;
    }
    Ok(())
}

/// Everything in one process: provider, relay, consumer, and a ticket service making changes.
async fn demo(flags: &HashMap<String, String>) -> Result<(), Error> {
    let (db, amqp) = targets()?;
    let schema = Schema::default();
    let changes: usize = flags
        .get("changes")
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let mut client = db.connect(&schema, "notifications-demo").await?;
    outbox_kit::schema::migrate(&mut client, &schema).await?;
    tickets::setup(&client).await?;

    let faults = provider::Faults {
        p_unavailable: 0.1,
        p_slow_accepted: 0.05,
        p_slow_dropped: 0.05,
        slow: Duration::from_millis(800),
        seed: 7,
    };
    let provider = provider::Provider::start(faults).await?;
    println!("provider listening on {}", provider.url());

    let exchange = "notifications.demo";
    let stop = CancellationToken::new();
    let mut relay_config = RelayConfig::new(exchange);
    relay_config.poll_interval = Duration::from_millis(200);
    let relay = tokio::spawn(relay::run(
        Deps {
            pool: db.pool(&schema, "notifications-relay", 8),
            db: db.clone(),
            schema: schema.clone(),
            amqp: amqp.clone(),
            telemetry: Default::default(),
        },
        relay_config,
        stop.clone(),
    ));
    let send_timeout = Duration::from_millis(300);
    let ledger = Ledger::new(EffectsConfig::new(
        format!("notifier-{}", std::process::id()),
        send_timeout,
        Duration::from_millis(500),
        Duration::from_secs(2),
    )?);
    let client_for_provider = consumer::ProviderClient::new(&provider.url(), send_timeout * 2);
    let mut cfg = ConsumerConfig::new("notifications.demo.notifier", exchange, &["ticket.#"]);
    cfg.retry_min = Duration::from_millis(100);
    cfg.retry_max = Duration::from_secs(1);
    let consumer = tokio::spawn(runner::run(
        ConsumerDeps {
            pool: db.pool(&schema, "notifications-consumer", 32),
            amqp,
        },
        cfg,
        Arc::new(consumer::Notifier {
            ledger: ledger.clone(),
            provider: Arc::new(client_for_provider.clone()),
        }),
        stop.clone(),
    ));

    // The ticket service: a few tenants, one with a small budget; a few bad addresses.
    let run = std::process::id() as i64 * 100_000;
    for (tenant, budget) in [("acme", 10_000), ("globex", 10_000), ("initech", 20)] {
        tickets::grant(&client, tenant, budget).await?;
    }
    let outbox = Outbox::new(schema.as_str())?;
    let statuses = ["open", "pending", "solved", "closed", "reopened"];
    let started = Instant::now();
    let mut keys = Vec::new();
    for n in 0..changes {
        let ticket = run + (n / statuses.len()) as i64;
        if n % statuses.len() == 0 {
            let tenant = ["acme", "globex", "initech"][n / statuses.len() % 3];
            let email = if n % 35 == 0 {
                format!("t{ticket}@invalid")
            } else {
                format!("t{ticket}@example.com")
            };
            tickets::open_ticket(&client, ticket, tenant, &email, "+15550100").await?;
        }
        let status = statuses[n % statuses.len()];
        keys.extend(tickets::change_status(&mut client, &outbox, ticket, status).await?);
    }
    // Withdraw a few, as a merge or an unsubscribe would.
    for key in keys.iter().step_by(25) {
        let outcome = tickets::cancel_delivery(&client, &ledger, &client_for_provider, key).await?;
        println!("cancel {key}: {outcome:?}");
    }
    // Wait until every delivery is finished, then report.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let open: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox_effects WHERE state IN ('queued', 'sending')",
                &[],
            )
            .await?
            .get(0);
        if open == 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for row in client
        .query(
            "SELECT state, count(*), min(last_error) FROM outbox_effects GROUP BY state ORDER BY state",
            &[],
        )
        .await?
    {
        let (state, n, example): (String, i64, Option<String>) = (row.get(0), row.get(1), row.get(2));
        println!("{state:>9}: {n}{}", example.map(|e| format!("  (e.g. {e})")).unwrap_or_default());
    }
    let twice = provider.book.per_key().values().filter(|n| **n > 1).count();
    println!(
        "{changes} status changes in {:.1}s; provider requests {}; messages accepted twice: {twice}",
        started.elapsed().as_secs_f64(),
        provider
            .book
            .requests
            .load(std::sync::atomic::Ordering::Relaxed)
    );
    stop.cancel();
    let _ = consumer.await;
    let _ = relay.await;
    Ok(())
}
