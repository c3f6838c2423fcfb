//! The consumer runner: consumes with manual acks and a prefetch, runs the handler inside a
//! Postgres transaction together with the inbox record, commits, then acks.
//!
//! Two modes. Unordered: one queue, events applied as they come; a transient failure
//! republishes the message (with a broker confirm) to one of a few retry queues, one per
//! delay tier (`retry_min`, doubling, up to `retry_max`), each with a queue-wide
//! `x-message-ttl` and dead-lettering back to the main queue, and then acks the original
//! (one TTL per queue, because RabbitMQ expires messages only at a queue's head). Ordered
//! ([`Ordered`]): the consumer is a group; its events enter an intake queue, and a router
//! moves each to the partition queue of its key (a fixed function of the key, so it holds
//! across broker restarts); the intake and each partition have one active consumer
//! (single-active-consumer), the group's live members share the partitions (heartbeats in
//! Postgres), and inside a member a key's events run one after another while keys run
//! concurrently. A failure is retried in place and holds its key only; no timer ever gives
//! up an event that exists.
//!
//! Topology the runner declares (unless `declare` is off): the source exchange (durable
//! topic), the dead-letter exchange `<queue>.dlx` (fanout) with queue `<queue>.dlq`, and
//! either the queue with its bindings and retry queues `<queue>.retry.<ms>ms`, or (ordered)
//! the intake queue `<queue>.intake` bound to the source with the bindings, the route
//! exchange `<queue>.route` and the partition queues `<queue>.p00`, `<queue>.p01`, ...
//!
//! The parts, in the order a message meets them: `config` (the settings and the names
//! they imply), `session` (connect, declare, the unordered consume loop; this file's [`run`]
//! reconnects around it), `group` (an ordered member: heartbeat, assignment, drain of
//! released keys), `router` (intake to partition queues) and `partition` (one partition
//! queue's key lanes), `message` (a
//! delivery's headers parsed into a [`Message`]), `process` (the inbox transaction around
//! the [`Handler`], in-place retries), `settle` (ack, retry tier, dead letter, each copy
//! published with a confirm on a channel replaced when it only nacks; and `Shared`, what
//! every message task shares), `handler` and `error` (what the user implements and what it
//! returns). No two of these files import each other, directly or in a circle.
//!
//! Invariants: a message is acked only after the inbox transaction committed, or after its
//! copy was confirmed by the broker in a retry queue or the dead-letter exchange. A graceful
//! stop takes no new message and finishes those in hand. The runner reconnects by itself.
//! Only this module (and its children) knows lapin; handlers get [`Message`].

mod config;
mod error;
mod group;
mod handler;
mod lone_router;
mod message;
mod partition;
mod process;
mod router;
mod session;
mod settle;

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::amqp::AmqpTarget;
use crate::backoff::Backoff;
use crate::consumer::events;
#[cfg(doc)]
use crate::consumer::inbox;
use crate::contract::ConfigError;

pub use config::{ConsumerConfig, OnDead, Ordered};
pub use error::HandlerError;
pub use handler::{Context, Handler};
pub use lone_router::{DepthProbe, GroupDepths, GroupRouter};
pub use message::Message;

use session::{Ended, Opened, Session};
use settle::Publisher;
use settle::Shared;

/// The deadline of one broker round trip made while settling or stopping (ack, nack,
/// cancel, a publish and its confirm).
const RPC_TIMEOUT: Duration = Duration::from_secs(15);

/// What the runner runs on.
#[derive(Clone)]
pub struct ConsumerDeps {
    /// Pooled connections with `search_path` set to the outbox schema.
    pub pool: Pool,
    /// Where the broker is; the runner connects (and reconnects) itself.
    pub amqp: AmqpTarget,
}

/// A failure retries cannot fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The settings contradict each other.
    #[error("consumer configuration: {0}")]
    Config(#[from] ConfigError),
    /// The broker refused the topology (a queue declared elsewhere with other arguments,
    /// missing permissions).
    #[error(
        "rabbitmq refused the consumer's topology: {0}; fix or delete the queue, or set declare off"
    )]
    Topology(String),
    /// The ordered group was recorded with another partition count (or the database
    /// refused to record it).
    #[error("consumer group: {0}")]
    Group(String),
}

const JOIN: &str = "SELECT outbox_group_join($1, $2)";

/// Records the group's partition count, or refuses a different one (SQLSTATE OB002).
async fn join_group(pool: &Pool, cfg: &ConsumerConfig) -> Result<(), Option<ConsumerError>> {
    let Some(o) = &cfg.ordered else { return Ok(()) };
    let client = crate::db::deadline(pool.get()).await.map_err(|_| None)?;
    let partitions = i32::from(o.partitions.get());
    match crate::db::deadline(client.query_one(JOIN, &[&cfg.name, &partitions])).await {
        Ok(_) => Ok(()),
        Err(e) if e.is_transient() => Err(None),
        // OB002: recorded with another partition count; the message says why and what to do.
        Err(crate::db::DbError::Postgres(e)) if e.as_db_error().is_some() => {
            Err(Some(ConsumerError::Group(
                e.as_db_error()
                    .map(|d| d.message().to_owned())
                    .unwrap_or_default(),
            )))
        }
        Err(e) => Err(Some(ConsumerError::Group(e.to_string()))),
    }
}

/// Opens an ordered group's dead-letter connection and its confirm channel; its loss ends
/// the session (`lost`), so that the next one opens both again.
async fn dead_letter_connection(
    amqp: &AmqpTarget,
    cfg: &ConsumerConfig,
    lost: &CancellationToken,
) -> Result<(Arc<lapin::Connection>, lapin::Channel), String> {
    let conn = amqp
        .connect(&format!("{} dead letters", cfg.connection_name))
        .await
        .map_err(|e| e.to_string())?;
    let open = async {
        let ch = crate::amqp::rpc("channel.open", conn.create_channel()).await?;
        crate::amqp::rpc(
            "confirm.select",
            ch.confirm_select(lapin::options::ConfirmSelectOptions::default()),
        )
        .await?;
        Ok::<_, crate::amqp::AmqpError>(ch)
    };
    let channel = match open.await {
        Ok(ch) => ch,
        Err(e) => {
            crate::amqp::close_after_failed_setup(&conn).await;
            return Err(e.to_string());
        }
    };
    let (gone, watch) = (crate::amqp::connection_lost(&conn), lost.clone());
    tokio::spawn(async move {
        tokio::select! {
            _ = watch.cancelled() => {}
            _ = gone => watch.cancel(),
        }
    });
    Ok((Arc::new(conn), channel))
}

/// Runs the consumer until `shutdown` is cancelled; then finishes the messages in hand.
pub async fn run<H: Handler>(
    deps: ConsumerDeps,
    cfg: ConsumerConfig,
    handler: Arc<H>,
    shutdown: CancellationToken,
) -> Result<(), ConsumerError> {
    cfg.validate(deps.pool.status().max_size)?;
    let cfg = Arc::new(cfg);
    events::consumer_started(
        &cfg.name,
        &cfg.queue,
        cfg.prefetch.get(),
        cfg.ordered.is_some(),
    );
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    let mut down = crate::down::Down::new("rabbitmq (consumer)");
    let member = group::member_id(&cfg.connection_name);
    loop {
        if shutdown.is_cancelled() {
            events::stopped(&cfg.name);
            return Ok(());
        }
        match join_group(&deps.pool, &cfg).await {
            Ok(()) => break,
            Err(Some(e)) => return Err(e),
            Err(None) => {
                let delay = backoff.next_delay();
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
    backoff.reset();
    loop {
        if shutdown.is_cancelled() {
            events::stopped(&cfg.name);
            return Ok(());
        }
        let session = match Session::open(&deps.amqp, &cfg).await {
            Ok(s) => s,
            Err(Opened::Refused(why)) => return Err(ConsumerError::Topology(why)),
            Err(Opened::Failed(e)) => {
                let delay = backoff.next_delay();
                down.failed(&e, delay);
                tokio::select! {
                    _ = shutdown.cancelled() => continue,
                    _ = tokio::time::sleep(delay) => continue,
                }
            }
        };
        // An ordered group's dead letters go out on a connection of their own: a broker
        // under a memory or disk alarm blocks a connection that publishes, and with it the
        // acks of the partition consumers on it (which free what the alarm is about).
        let (publisher, dead_letters) = if let Some(channel) = session.publish.clone() {
            (Publisher::new(session.conn.clone(), channel), None)
        } else {
            match dead_letter_connection(&deps.amqp, &cfg, &session.lost).await {
                Ok((conn, channel)) => (Publisher::new(conn.clone(), channel), Some(conn)),
                Err(e) => {
                    session.close().await;
                    let delay = backoff.next_delay();
                    down.failed(&e, delay);
                    tokio::select! {
                        _ = shutdown.cancelled() => continue,
                        _ = tokio::time::sleep(delay) => continue,
                    }
                }
            }
        };
        down.recovered();
        backoff.reset();
        let shared = Arc::new(Shared {
            cfg: cfg.clone(),
            pool: deps.pool.clone(),
            publisher: Mutex::new(publisher),
        });
        let ended = if cfg.ordered.is_some() {
            group::run(
                shared,
                handler.clone(),
                session.conn.clone(),
                &deps.amqp,
                &member,
                &session.lost,
                &shutdown,
            )
            .await
        } else {
            session.consume(shared, handler.clone(), &shutdown).await
        };
        session.close().await;
        if let Some(conn) = dead_letters {
            let _ =
                tokio::time::timeout(RPC_TIMEOUT, conn.close(200, "session ended".into())).await;
        }
        match ended {
            Ended::Shutdown => {
                events::stopped(&cfg.name);
                return Ok(());
            }
            Ended::Lost(why, in_hand) => {
                events::session_lost(&cfg.name, &why, in_hand);
                let delay = backoff.next_delay();
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}
