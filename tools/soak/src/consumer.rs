//! The soak's consumer process (`outbox-soak consumer ...`, started by the soak itself): one
//! instance of an ordered consumer group (the consumer kit's runner; the instances share
//! [`PARTITIONS`] partition queues), with a handler that performs one effect per event
//! through the effects ledger at the fake destination and records the apply in the inbox
//! transaction (`soak_applied`), so the soak can check both "performed exactly once" and
//! "applied in seq order, gapless".

use std::net::SocketAddr;
use std::num::{NonZeroU16, NonZeroU32};
use std::sync::Arc;
use std::time::Duration;

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::consumer::effects::{EffectsConfig, NewEffect};
use outbox_kit::consumer::runner::{self, ConsumerConfig, ConsumerDeps, Context, OnDead, Ordered};
use outbox_kit::consumer::{Handler, HandlerError, Ledger, Message};
use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::destination::{self, Remote};

/// The consumer group's name (inbox key) and its queue's prefix.
pub const GROUP: &str = "soak";
/// The group's partition queues.
pub const PARTITIONS: u16 = 8;
/// An instance that stops renewing its membership loses its partitions after this long.
pub const MEMBER_LEASE: Duration = Duration::from_secs(6);
/// How long one destination call may take.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(1);
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// An effect's claim: longer than 2 x send + write, as the kit requires.
pub const EFFECT_LEASE: Duration = Duration::from_secs(4);

const APPLY: &str =
    "INSERT INTO soak_applied (consumer, worker, event_id, aggregate_type, aggregate_id, seq)
                     VALUES ($1, $2, $3, $4, $5, $6)";

/// The table the handler writes in its inbox transaction (created by the soak).
pub const SOAK_TABLES: &str = "
CREATE TABLE IF NOT EXISTS soak_applied (
    n bigserial PRIMARY KEY,
    consumer text NOT NULL,
    worker text NOT NULL,
    event_id uuid NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    seq bigint NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
)";

/// The effect key of an event.
pub fn effect_key(event_id: &uuid::Uuid) -> String {
    format!("soak:{event_id}")
}

pub fn config(queue: &str, exchange: &str, worker: &str, prefetch: NonZeroU16) -> ConsumerConfig {
    let mut cfg = ConsumerConfig::new(GROUP, exchange, &["#"]);
    cfg.queue = queue.to_owned();
    cfg.prefetch = prefetch;
    // An ordered consumer group: its instances share the partition queues
    // `<queue>.p00` .. `<queue>.p07`. A dead-lettered event must have its record; the key
    // goes on (nothing in the soak should be dead-lettered: the verdict counts them).
    cfg.ordered = Some(Ordered {
        partitions: NonZeroU16::new(PARTITIONS).expect("non-zero"),
        on_dead: OnDead::Continue,
        member_lease: MEMBER_LEASE,
    });
    cfg.retry_min = Duration::from_millis(100);
    cfg.retry_max = Duration::from_secs(1);
    // Retried in place; 30 attempts of up to 20 s stay under half the broker's 30 min
    // redelivery timeout (the kit refuses more).
    cfg.max_attempts = NonZeroU32::new(30);
    cfg.handler_timeout = Duration::from_secs(20);
    cfg.connection_name = format!("outbox-soak-consumer {worker}");
    cfg
}

/// The group's queues: its partition queues and its intake queue.
pub fn group_queues(queue: &str, exchange: &str) -> Vec<String> {
    let cfg = config(queue, exchange, "-", NonZeroU16::MIN);
    let mut queues: Vec<String> = (0..PARTITIONS).map(|p| cfg.partition_queue(p)).collect();
    queues.push(cfg.intake_queue());
    queues
}

struct Soak {
    ledger: Ledger,
    dest: Arc<Remote>,
    worker: String,
}

impl Handler for Soak {
    async fn handle(&self, cx: &Context<'_>, msg: &Message) -> Result<(), HandlerError> {
        let key = effect_key(&msg.event_id);
        let conn = cx.connection().await?;
        let client: &tokio_postgres::Client = &conn;
        // Idempotent per key: a redelivery finds the row the first attempt made.
        Ledger::enqueue(
            client,
            &NewEffect {
                key: &key,
                destination: destination::NAME,
                payload: json!({ "event_id": msg.event_id.to_string(), "seq": msg.seq }),
                budget: None,
                reserve_now: false,
            },
        )
        .await?;
        // Sent now, or not claimed because an earlier attempt has it (in `sending` after a
        // crash: the reconciler settles it through the destination's lookup).
        self.ledger.perform(client, &key, &*self.dest).await?;
        cx.tx()
            .execute(
                APPLY,
                &[
                    &cx.consumer(),
                    &self.worker,
                    &msg.event_id,
                    &msg.aggregate_type,
                    &msg.aggregate_id,
                    &msg.seq.unwrap_or(0),
                ],
            )
            .await?;
        Ok(())
    }
}

pub struct Args {
    pub database_url: String,
    pub amqp_url: String,
    pub exchange: String,
    pub queue: String,
    pub destination: SocketAddr,
    pub worker: String,
    pub application_name: String,
    /// Messages in hand at once; the pool is twice this.
    pub prefetch: NonZeroU16,
}

/// Runs until SIGTERM or SIGINT; then finishes the messages in hand.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let schema = Schema::default();
    let db = DbTarget::parse(&args.database_url).map_err(anyhow::Error::msg)?;
    let amqp = AmqpTarget::parse(&args.amqp_url).map_err(anyhow::Error::msg)?;
    let ledger = Ledger::new(EffectsConfig::new(
        args.worker.clone(),
        SEND_TIMEOUT,
        WRITE_TIMEOUT,
        EFFECT_LEASE,
    )?);
    let deps = ConsumerDeps {
        pool: db.pool(
            &schema,
            &args.application_name,
            2 * args.prefetch.get() as usize,
        ),
        amqp,
    };
    let handler = Arc::new(Soak {
        ledger,
        dest: Arc::new(Remote {
            addr: args.destination,
            worker: args.worker.clone(),
        }),
        worker: args.worker.clone(),
    });
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        s.cancel();
    });
    let cfg = config(&args.queue, &args.exchange, &args.worker, args.prefetch);
    runner::run(deps, cfg, handler, shutdown).await?;
    Ok(())
}
