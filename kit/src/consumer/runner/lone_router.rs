//! An ordered group's router on its own, for groups whose members are not this runner (a
//! Python, Go or Node service on the SQL functions) or that want routing in a process of
//! its own (`outbox-relay group-router`). It is the router every Rust member runs
//! (`router`), with the same guarantees: a key has at most one unconfirmed copy, an intake
//! delivery is acked only after its copy was confirmed and not returned (copies go to the
//! partition queue by name with `mandatory`; a returned one is retried holding its key only),
//! and the router has a connection of its own. Several may run (Rust members and routers alike): the intake queue's
//! single-active-consumer lets one route at a time.
//!
//! Invariant: [`GroupRouter::prepare`] records the group's partition count
//! (`outbox_group_join`, refusing another count) and declares the group's topology before
//! any routing, so members that only consume partition queues find them there.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, AmqpTarget};
use crate::backoff::Backoff;
use crate::contract::ConfigError;
use crate::down::Down;

use super::session::{Opened, Session};
use super::{ConsumerConfig, ConsumerError, join_group};

/// An ordered group's router without partition consumers.
pub struct GroupRouter {
    cfg: Arc<ConsumerConfig>,
    amqp: AmqpTarget,
}

impl GroupRouter {
    /// The router of the group `cfg` describes (`cfg.ordered` must be set). The checks are
    /// the group's own ([`ConsumerConfig::validate`]), less the pool size: the router runs
    /// no handler.
    pub fn new(cfg: ConsumerConfig, amqp: AmqpTarget) -> Result<GroupRouter, ConsumerError> {
        if cfg.ordered.is_none() {
            return Err(ConfigError::new("partitions", "a router routes an ordered group").into());
        }
        cfg.validate(2 * usize::from(cfg.prefetch.get()))?;
        Ok(GroupRouter {
            cfg: Arc::new(cfg),
            amqp,
        })
    }

    /// The group's settings and the names they imply.
    pub fn config(&self) -> &ConsumerConfig {
        &self.cfg
    }

    /// Records the partition count and declares the topology (unless `declare` is off),
    /// retrying what a reconnect may fix until done or `shutdown`. Returns false when
    /// `shutdown` came first.
    pub async fn prepare(
        &self,
        pool: &Pool,
        shutdown: &CancellationToken,
    ) -> Result<bool, ConsumerError> {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        let mut down = Down::new("postgres (group router)");
        loop {
            match join_group(pool, &self.cfg).await {
                Ok(()) => break,
                Err(Some(e)) => return Err(e),
                Err(None) => {
                    let delay = backoff.next_delay();
                    down.failed(&"outbox_group_join failed", delay);
                    if !pause(shutdown, delay).await {
                        return Ok(false);
                    }
                }
            }
        }
        down.recovered();
        backoff.reset();
        let mut down = Down::new("rabbitmq (group router)");
        loop {
            match Session::open(&self.amqp, &self.cfg).await {
                Ok(session) => {
                    session.close().await;
                    down.recovered();
                    return Ok(true);
                }
                Err(Opened::Refused(why)) => return Err(ConsumerError::Topology(why)),
                Err(Opened::Failed(e)) => {
                    let delay = backoff.next_delay();
                    down.failed(&e, delay);
                    if !pause(shutdown, delay).await {
                        return Ok(false);
                    }
                }
            }
        }
    }

    /// Routes on a connection of its own until `stop` is cancelled (then finishes the
    /// copies in flight) or something fails; returns why it ended when not asked to. The
    /// caller starts it again after a pause: what was unacked went back to the intake.
    pub async fn route(&self, stop: CancellationToken) -> Result<(), String> {
        super::router::route(self.cfg.clone(), self.amqp.clone(), stop).await
    }

    /// A probe of the group's queues, on a connection of its own (opened at its first
    /// sample, and again after a failure).
    pub fn probe(&self) -> DepthProbe {
        DepthProbe {
            cfg: self.cfg.clone(),
            amqp: self.amqp.clone(),
            open: None,
        }
    }
}

/// How full the group's queues were at one look (messages ready, not those delivered and
/// unacked).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupDepths {
    /// Ready in the intake queue: events the router has not taken yet.
    pub intake: u64,
    /// Consumers of the intake queue: the routers (one active, the others waiting).
    pub intake_consumers: u64,
    /// Ready in all partition queues together: events no member has taken yet.
    pub partitions: u64,
    /// Partition queues without a consumer: their events wait for a member.
    pub partitions_unconsumed: u64,
}

/// Looks at the group's queues with passive declarations.
pub struct DepthProbe {
    cfg: Arc<ConsumerConfig>,
    amqp: AmqpTarget,
    open: Option<(lapin::Connection, lapin::Channel)>,
}

impl DepthProbe {
    /// One look at every queue of the group. A failure closes the probe's connection; the
    /// next sample opens another.
    pub async fn sample(&mut self) -> Result<GroupDepths, String> {
        let looked = self.look().await;
        if looked.is_err()
            && let Some((conn, _)) = self.open.take()
        {
            amqp::close_after_failed_setup(&conn).await;
        }
        looked
    }

    async fn look(&mut self) -> Result<GroupDepths, String> {
        if self.open.is_none() {
            let name = format!("{} probe", self.cfg.connection_name);
            let conn = self.amqp.connect(&name).await.map_err(|e| e.to_string())?;
            let ch = match amqp::rpc("channel.open", conn.create_channel()).await {
                Ok(ch) => ch,
                Err(e) => {
                    amqp::close_after_failed_setup(&conn).await;
                    return Err(e.to_string());
                }
            };
            self.open = Some((conn, ch));
        }
        let (_, ch) = self.open.as_ref().expect("opened above");
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let look = |queue: String| async move {
            amqp::rpc(
                "queue.declare",
                ch.queue_declare(queue.as_str().into(), passive, FieldTable::default()),
            )
            .await
            .map_err(|e| format!("{queue}: {e}"))
        };
        let intake = look(self.cfg.intake_queue()).await?;
        let mut depths = GroupDepths {
            intake: u64::from(intake.message_count()),
            intake_consumers: u64::from(intake.consumer_count()),
            ..GroupDepths::default()
        };
        let partitions = self.cfg.ordered.as_ref().map_or(0, |o| o.partitions.get());
        for p in 0..partitions {
            let q = look(self.cfg.partition_queue(p)).await?;
            depths.partitions += u64::from(q.message_count());
            if q.consumer_count() == 0 {
                depths.partitions_unconsumed += 1;
            }
        }
        Ok(depths)
    }
}

/// Waits `delay`; false if `shutdown` came first.
async fn pause(shutdown: &CancellationToken, delay: Duration) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(delay) => true,
    }
}
