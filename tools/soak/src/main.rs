//! `outbox-soak`: the randomized fault soak. Producers, three relays (real `outbox-relay`
//! processes) and consumers on the consumer kit run at once while a schedule drawn from
//! the seed injects faults; then a quiet period, then the checker's verdict.
//!
//! ```text
//! cargo build --release --bins
//! target/release/outbox-soak --duration 120s --seed 7
//! ```
//! Exit status: 0 when the verdict is PASS, 1 when it is FAIL or the soak could not run,
//! 2 for bad arguments. docs/guarantees.md ("Soak") says what is injected and checked.
//!
//! Layout: `run/` (one run, start to verdict), `schedule.rs` (the seeded fault
//! schedule), `procs.rs` (process slots, signals, rabbitmqctl), `producer.rs`, `consumer.rs`
//! (the consumer process, `outbox-soak consumer`), `destination.rs` (the fake destination
//! that records every send), `tap.rs` (the tap queue and the duplicate publisher),
//! `rng.rs`. The checker and the proxy are the library's `testkit`, shared with the tests.

mod consumer;
mod destination;
mod procs;
mod producer;
mod rng;
mod run;
mod schedule;
mod tap;

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "outbox-soak",
    about = "Randomized fault soak of the outbox relay and the consumer kit, with a strict checker",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: run::RunArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// One consumer process (the soak starts these itself).
    #[command(hide = true)]
    Consumer(ConsumerArgs),
}

#[derive(Debug, clap::Args)]
struct ConsumerArgs {
    #[arg(long)]
    database_url: String,
    #[arg(long)]
    amqp_url: String,
    #[arg(long)]
    exchange: String,
    #[arg(long)]
    queue: String,
    #[arg(long)]
    destination: SocketAddr,
    #[arg(long)]
    worker: String,
    #[arg(long)]
    application_name: String,
    #[arg(long, default_value_t = std::num::NonZeroU16::new(4).expect("non-zero"))]
    prefetch: std::num::NonZeroU16,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match cli.command {
        Some(Command::Consumer(a)) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "warn,outbox_relay=info,lapin=error".into()),
                )
                .with_writer(std::io::stderr)
                .init();
            let args = consumer::Args {
                database_url: a.database_url,
                amqp_url: a.amqp_url,
                exchange: a.exchange,
                queue: a.queue,
                destination: a.destination,
                worker: a.worker,
                application_name: a.application_name,
                prefetch: a.prefetch,
            };
            match runtime.block_on(consumer::run(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("outbox-soak consumer: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        None => {
            let outcome = runtime.block_on(async {
                tokio::select! {
                    r = run::run(cli.run) => r,
                    _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted; the soak's database may be left behind (soak_<seed>_<pid>)")),
                }
            });
            match outcome {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::FAILURE,
                Err(e) => {
                    eprintln!("outbox-soak: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
