//! The yardstick: the simplest correct relay, measured in the same run as ours so that our
//! latency and our load on Postgres have something to be compared with.
//!
//! A NOTIFY per insert (its own row trigger, installed only in the yardstick's database)
//! wakes it, and so does a poll interval; then it runs transactions that each select
//! pending rows `FOR UPDATE SKIP LOCKED`, publish them with publisher confirms, mark them
//! dispatched and commit, until a transaction finds fewer rows than its limit. No per-key
//! order, no numbering, no leases, no parking: it shows what the outbox's bare mechanics
//! cost on this machine. It runs as a process of its own (`outbox-bench yardstick`, a
//! hidden command), as our relay does, so that each has its own CPU and runtime.
//!
//! Correctness: notifications are drained before each round of transactions, so one that
//! arrives while a transaction runs (whose snapshot may predate that commit) starts another.

use std::time::Duration;

use anyhow::{Result, bail};
use futures_util::StreamExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Confirmation};
use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;
use tokio::signal::unix::{SignalKind, signal};
use tokio_postgres::AsyncMessage;

/// The channel its trigger notifies, and the trigger (a NOTIFY in every inserting
/// transaction; Postgres folds identical ones within a transaction).
pub const CHANNEL: &str = "outbox_bench_yardstick";
pub const INSTALL_TRIGGER: &str = "
CREATE FUNCTION outbox_bench_yardstick_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('outbox_bench_yardstick', ''); RETURN NULL; END $$;
CREATE TRIGGER outbox_bench_yardstick AFTER INSERT ON outbox_events
    FOR EACH ROW EXECUTE FUNCTION outbox_bench_yardstick_notify();";

const CLAIM: &str = "SELECT id, event_id::text, aggregate_type || '.' || event_type, payload::text
  FROM outbox_events WHERE dispatched_at IS NULL AND parked_at IS NULL
 ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED";
const MARK: &str = "UPDATE outbox_events SET dispatched_at = now() WHERE id = ANY ($1)";

/// `outbox-bench yardstick`: run until SIGTERM.
#[derive(Debug, clap::Args)]
pub struct YardstickArgs {
    #[arg(long)]
    database_url: String,
    #[arg(long)]
    amqp_url: String,
    #[arg(long)]
    exchange: String,
    #[arg(long, default_value_t = 500)]
    batch_size: i64,
    #[arg(long, default_value = "1s")]
    poll_interval: String,
}

impl YardstickArgs {
    /// The command line that starts it.
    pub fn command_line(
        db_url: &str,
        amqp_url: &str,
        exchange: &str,
        batch: usize,
        poll: &str,
    ) -> Vec<String> {
        [
            "yardstick",
            "--database-url",
            db_url,
            "--amqp-url",
            amqp_url,
            "--exchange",
            exchange,
            "--batch-size",
            &batch.to_string(),
            "--poll-interval",
            poll,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

pub async fn run(a: YardstickArgs) -> Result<()> {
    let db = DbTarget::parse(&a.database_url).map_err(anyhow::Error::msg)?;
    let poll = humantime::parse_duration(&a.poll_interval)?;
    let (listener, mut conn) = db
        .connect_dedicated(&Schema::default(), "outbox-bench-yardstick")
        .await?;
    let (woken_tx, mut woken) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            if let AsyncMessage::Notification(_) = m {
                let _ = woken_tx.send(());
            }
        }
    });
    listener.batch_execute(&format!("LISTEN {CHANNEL}")).await?;
    let mut client = db
        .connect(&Schema::default(), "outbox-bench-yardstick")
        .await?;
    let amqp = AmqpTarget::parse(&a.amqp_url).map_err(anyhow::Error::msg)?;
    let channel = amqp
        .connect("outbox-bench yardstick")
        .await?
        .create_channel()
        .await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let exchange: ShortString = a.exchange.as_str().into();
    let (claim, mark) = (client.prepare(CLAIM).await?, client.prepare(MARK).await?);
    let mut term = signal(SignalKind::terminate())?;
    loop {
        while woken.try_recv().is_ok() {} // this round's snapshot covers what they announced
        loop {
            let tx = client.transaction().await?;
            let rows = tx.query(&claim, &[&a.batch_size]).await?;
            let mut confirms = Vec::with_capacity(rows.len());
            for row in &rows {
                let (event_id, routing_key, body): (&str, &str, &str) =
                    (row.get(1), row.get(2), row.get(3));
                let props = BasicProperties::default()
                    .with_message_id(event_id.into())
                    .with_content_type("application/json".into())
                    .with_delivery_mode(2);
                let publish = BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                };
                confirms.push(
                    channel
                        .basic_publish(
                            exchange.clone(),
                            routing_key.into(),
                            publish,
                            body.as_bytes(),
                            props,
                        )
                        .await?,
                );
            }
            for confirm in confirms {
                match tokio::time::timeout(Duration::from_secs(30), confirm).await {
                    Ok(Ok(Confirmation::Ack(None))) => {}
                    other => bail!("the broker did not take a message: {other:?}"), // rolls back
                }
            }
            let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
            tx.execute(&mark, &[&ids]).await?;
            tx.commit().await?;
            if (rows.len() as i64) < a.batch_size {
                break;
            }
        }
        tokio::select! {
            _ = term.recv() => return Ok(()),
            Some(()) = woken.recv() => {}
            _ = tokio::time::sleep(poll) => {}
        }
    }
}
