//! The floor under the relay's latency, measured at each latency rate in the same sitting:
//! the two hops a relay woken by commits cannot avoid, each alone, at the same steady
//! schedule as the latency runs (`open_loop`).
//! - The broker's hop: a publisher with confirms on a connection of its own, one message
//!   per scheduled instant, persistent and mandatory like the relay's; from handing the
//!   message to the channel to its delivery to a consumer on another connection.
//! - The wake-up hop: an autocommit INSERT into `outbox_events` whose row trigger sends a
//!   NOTIFY; from sending the INSERT to the notification reaching a LISTEN connection of
//!   its own (no relay runs: the relay's own wake-up flag stays off).
//!
//! Both are timed from the moment the bench hands the work over, on this process's clock:
//! a NOTIFY can reach the listener before its producer sees COMMIT return, so the wake-up
//! hop is not timed from the commit. The report puts them beside the relay's own share of
//! the latency (commit → published, from its stage trace).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, bail};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Confirmation};
use outbox_kit::contract::Schema;
use tokio_postgres::AsyncMessage;

use crate::amqp::{Arrivals, BenchBroker};
use crate::pg::{self, BenchDb};
use crate::stats::Summary;

use super::{Ctx, open_loop, wait_until};

/// The longest a floor run commits or publishes for: enough samples for a p99 at any rate,
/// without doubling the latency section's time.
const MAX_SECS: f64 = 10.0;
/// A confirm, a delivery or a notification later than this fails the run.
const LIMIT: Duration = Duration::from_secs(30);

/// The trigger the wake-up hop fires: one NOTIFY per row, naming the event (read back as
/// a message body is, by `pg::order_id_of`).
const NOTIFY_TRIGGER: &str = "
CREATE FUNCTION outbox_bench_floor_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_notify('outbox_bench_floor', '\"order_id\": ' || (NEW.payload->>'order_id')); RETURN NULL; END $$;
CREATE TRIGGER outbox_bench_floor AFTER INSERT ON outbox_events
    FOR EACH ROW EXECUTE FUNCTION outbox_bench_floor_notify();";

/// The two hops alone at one rate (the rate of the latency run it is attached to).
#[derive(Clone, Debug)]
pub struct Floor {
    /// Publish → delivered to a consumer on another connection.
    pub broker: Summary,
    /// INSERT sent → NOTIFY received on a LISTEN connection.
    pub wakeup: Summary,
}

/// Measures both hops at `rate` events/s.
pub async fn floor(ctx: &Ctx, rate: u64) -> Result<Floor> {
    let secs = ctx.s.latency_secs.min(MAX_SECS);
    let total = ((rate as f64) * secs).ceil().max(1.0) as usize;
    Ok(Floor {
        broker: broker_hop(ctx, rate, total).await?,
        wakeup: wakeup_hop(ctx, rate, total).await?,
    })
}

async fn broker_hop(ctx: &Ctx, rate: u64, total: usize) -> Result<Summary> {
    let broker = BenchBroker::new(&ctx.amqp, &ctx.tag("floor")).await?;
    let result = broker_hop_on(ctx, &broker, rate, total).await;
    broker.purge().await.ok();
    broker.delete().await;
    result
}

async fn broker_hop_on(
    ctx: &Ctx,
    broker: &BenchBroker,
    rate: u64,
    total: usize,
) -> Result<Summary> {
    let arrivals = Arc::new(Arrivals::new(total));
    let stop_consumer = broker.consume(arrivals.clone()).await?;
    let conn = ctx.amqp.connect("outbox-bench floor publisher").await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let exchange: lapin::types::ShortString = broker.exchange.as_str().into();
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into());
    let start = tokio::time::Instant::now() + Duration::from_millis(200);
    let mut confirms = FuturesUnordered::new();
    let mut acked = 0;
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
        // Confirms are taken in while the next message waits for its instant.
        loop {
            tokio::select! {
                biased;
                Some(c) = confirms.next(), if !confirms.is_empty() => acked += acked_one(c)?,
                _ = tokio::time::sleep_until(due) => break,
            }
        }
        let body = pg::payload_json(i as u64);
        arrivals.started(i as u64);
        let publish = ch.basic_publish(
            exchange.clone(),
            "order.created".into(),
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            body.as_bytes(),
            properties.clone(),
        );
        let confirm = tokio::time::timeout(LIMIT, publish).await??;
        confirms.push(tokio::time::timeout(LIMIT, confirm));
    }
    while let Some(c) = confirms.next().await {
        acked += acked_one(c)?;
    }
    let seen: &Arrivals = &arrivals;
    let arrived = wait_until(
        "the broker floor's messages to arrive",
        LIMIT,
        &mut [],
        || async { Ok(seen.arrived_count() == total) },
    )
    .await;
    stop_consumer.cancel();
    let _ = conn.close(200, "floor done".into()).await;
    arrived?;
    if acked != total {
        bail!("the broker acked {acked} of {total} floor messages");
    }
    Ok(Summary::of(arrivals.sent_to_arrival(0..total)))
}

fn acked_one(c: Result<lapin::Result<Confirmation>, tokio::time::error::Elapsed>) -> Result<usize> {
    match c {
        Ok(Ok(Confirmation::Ack(None))) => Ok(1),
        Ok(Ok(other)) => bail!("the broker did not ack a floor message cleanly: {other:?}"),
        Ok(Err(e)) => bail!("floor publish failed: {e}"),
        Err(_) => bail!("no confirm for a floor message within {LIMIT:?}"),
    }
}

async fn wakeup_hop(ctx: &Ctx, rate: u64, total: usize) -> Result<Summary> {
    let db = ctx.admin.create_db().await?;
    let result = wakeup_hop_on(ctx, &db, rate, total).await;
    ctx.admin.drop_db(&db.name).await;
    result
}

async fn wakeup_hop_on(ctx: &Ctx, db: &BenchDb, rate: u64, total: usize) -> Result<Summary> {
    db.client.batch_execute(NOTIFY_TRIGGER).await?;
    let arrivals = Arc::new(Arrivals::new(total));
    let (listen, mut connection) = db
        .target
        .connect_dedicated(&Schema::default(), "outbox-bench-listen")
        .await?;
    let a = arrivals.clone();
    let listener = tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            if let AsyncMessage::Notification(n) = m {
                a.arrived(n.payload().as_bytes());
            }
        }
    });
    let result = async {
        tokio::time::timeout(LIMIT, listen.batch_execute("LISTEN outbox_bench_floor")).await??;
        let stop_after = Duration::from_secs_f64(MAX_SECS * 2.0 + 5.0);
        let producers = open_loop(
            db,
            ctx.s.latency_producers,
            rate,
            (total, stop_after),
            ctx.s.keys,
            &arrivals,
        )
        .await?;
        let committed = arrivals.committed_count(0..total);
        let seen: &Arrivals = &arrivals;
        wait_until(
            "the floor's notifications to arrive",
            LIMIT,
            &mut [],
            || async { Ok(seen.arrived_count() >= committed) },
        )
        .await?;
        drop(producers);
        Ok(Summary::of(arrivals.sent_to_arrival(0..total)))
    }
    .await;
    listener.abort();
    result
}
