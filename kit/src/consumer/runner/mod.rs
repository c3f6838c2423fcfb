//! The consumer runner: consumes a queue with manual acks and a prefetch, runs the handler
//! inside a Postgres transaction together with the inbox record, commits, then acks.
//!
//! Per message: [`inbox::record`] says apply, duplicate (ack without running the handler) or
//! gap (ordered mode: an earlier seq of the key is missing). Handler errors are typed:
//! transient ones go to a retry queue, terminal ones to the dead-letter exchange.
//!
//! Retries do not spin the queue. A transient failure republishes the message (with a broker
//! confirm) to one of a few retry queues, one per delay tier (`retry_min`, doubling, up to
//! `retry_max`), each with a queue-wide `x-message-ttl` and dead-lettering back to the main
//! queue, and then acks the original. One TTL per queue, because RabbitMQ expires messages
//! only at a queue's head: per-message TTLs in one queue would make a short delay wait
//! behind a long one. The delay costs no prefetch slot and survives a consumer crash, which
//! holding the message in process and nacking it later would not. Gaps wait the same way,
//! with the first time the gap was seen carried in a header, so `gap_timeout` is measured
//! across redeliveries.
//!
//! Topology the runner declares (unless `declare` is off): the source exchange (durable
//! topic), the queue (durable, dead-lettering to `<queue>.dlx`), its bindings, the
//! dead-letter exchange `<queue>.dlx` (fanout) with queue `<queue>.dlq`, and the retry queues
//! `<queue>.retry.<ms>ms`.
//!
//! The parts, in the order a message meets them: `config` (the settings and the names
//! they imply), `session` (connect, declare, the consume loop; this file's [`run`] reconnects
//! around it), `message` (a delivery's headers parsed into a [`Message`]), `process` (the
//! inbox transaction around the [`Handler`]), `settle` (ack, retry tier, dead letter, each
//! copy published with a confirm).
//!
//! Invariants: a message is acked only after the inbox transaction committed, or after its
//! copy was confirmed by the broker in a retry queue or the dead-letter exchange. A graceful
//! stop takes no new message and finishes those in hand. The runner reconnects by itself.
//! Only this module (and its children) knows lapin; handlers get [`Message`].

mod config;
mod handler;
mod message;
mod process;
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

pub use config::{ConsumerConfig, OnGap, Ordered};
pub use handler::{Context, Handler, HandlerError};
pub use message::Message;

use process::Shared;
use session::{Ended, Opened, Session};

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
        down.recovered();
        backoff.reset();
        let shared = Arc::new(Shared {
            cfg: cfg.clone(),
            pool: deps.pool.clone(),
            publisher: Mutex::new(session.publish.clone()),
        });
        let ended = session.consume(shared, handler.clone(), &shutdown).await;
        session.close().await;
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
