//! One AMQP session of the runner: connect, declare the topology (a queue with retry
//! queues, or an ordered group's hash exchange and partition queues), open a consume
//! channel (with the prefetch) and a confirm-mode publish channel, and the unordered consume
//! loop, one `select!` over a closed set of wake-ups ([`Wake`]). `run` reconnects around
//! it; an ordered group's member (`group`) runs on the same session instead of the loop.
//!
//! Invariants: at most `prefetch` messages are in hand; on shutdown or a lost connection
//! no new message is taken and those in hand finish (their acks may fail; the broker
//! redelivers and the inbox absorbs it). A refused declaration ends the runner instead of
//! retrying for ever.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use lapin::message::Delivery;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
    ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Connection, ExchangeKind};
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, AmqpError, AmqpTarget, long_string};
use crate::consumer::events;
use crate::contract::headers::AGGREGATE_ID as H_AGGREGATE_ID;

use super::process::{Shared, process};
use super::{ConsumerConfig, Handler, RPC_TIMEOUT};

pub(super) enum Opened {
    /// Connection trouble: retry.
    Failed(String),
    /// The broker refused a declaration (channel closed with 403/406): retrying will not help.
    Refused(String),
}

pub(super) struct Session {
    pub(super) conn: Arc<Connection>,
    consume: Channel,
    pub(super) publish: Channel,
    pub(super) lost: CancellationToken,
}

/// The one `select!` of a session handles exactly these.
enum Wake {
    Shutdown,
    Delivery(Option<lapin::Result<Box<Delivery>>>),
    Finished,
    Lost(String),
}

pub(super) enum Ended {
    Shutdown,
    Lost(String, usize),
}

/// One round trip with a deadline.
async fn rpc<T>(
    what: &'static str,
    fut: impl Future<Output = lapin::Result<T>>,
) -> Result<T, Opened> {
    amqp::rpc(what, fut)
        .await
        .map_err(|e| refused_or_failed(what, e))
}

/// What the broker refuses for good (a declaration that conflicts, no permission) told
/// apart from what a reconnect may fix.
fn refused_or_failed(what: &str, e: AmqpError) -> Opened {
    let text = e.to_string();
    // The broker's answer (3.10): "COMMAND_INVALID - unknown exchange type 'x-consistent-hash'"
    // (tests/it/groups.rs pins the text).
    if text.contains("unknown exchange type") && text.contains("x-consistent-hash") {
        return Opened::Refused(format!(
            "{what}: {text}; the broker does not know the exchange type x-consistent-hash: enable the rabbitmq_consistent_hash_exchange plugin (rabbitmq-plugins enable rabbitmq_consistent_hash_exchange)"
        ));
    }
    // PRECONDITION_FAILED / ACCESS_REFUSED / NOT_FOUND on a declaration.
    if text.contains("PRECONDITION_FAILED")
        || text.contains("ACCESS_REFUSED")
        || text.contains("NOT_FOUND")
    {
        Opened::Refused(format!("{what}: {text}"))
    } else {
        Opened::Failed(format!("{what}: {text}"))
    }
}

impl Session {
    pub(super) async fn open(target: &AmqpTarget, cfg: &ConsumerConfig) -> Result<Session, Opened> {
        let conn = target
            .connect(&cfg.connection_name)
            .await
            .map_err(|e| Opened::Failed(e.to_string()))?;
        let setup = async {
            let consume = rpc("channel.open", conn.create_channel()).await?;
            if cfg.declare {
                if cfg.ordered.is_some() {
                    declare_group(&consume, cfg).await?;
                } else {
                    declare(&consume, cfg).await?;
                }
            }
            rpc(
                "basic.qos",
                consume.basic_qos(cfg.prefetch.get(), BasicQosOptions::default()),
            )
            .await?;
            let publish = rpc("channel.open", conn.create_channel()).await?;
            rpc(
                "confirm.select",
                publish.confirm_select(ConfirmSelectOptions::default()),
            )
            .await?;
            Ok::<_, Opened>((consume, publish))
        };
        let (consume, publish) = match setup.await {
            Ok(v) => v,
            Err(e) => {
                amqp::close_after_failed_setup(&conn).await;
                return Err(e);
            }
        };
        // Connection-level failures (heartbeat, broker closing us) end the session.
        let lost = CancellationToken::new();
        let connection_lost = amqp::connection_lost(&conn);
        let watch = lost.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = watch.cancelled() => {}
                _ = connection_lost => watch.cancel(),
            }
        });
        Ok(Session {
            conn: Arc::new(conn),
            consume,
            publish,
            lost,
        })
    }

    pub(super) async fn consume<H: Handler>(
        &self,
        shared: Arc<Shared>,
        handler: Arc<H>,
        shutdown: &CancellationToken,
    ) -> Ended {
        let cfg = &shared.cfg;
        let consumer = match rpc(
            "basic.consume",
            self.consume.basic_consume(
                cfg.queue.as_str().into(),
                ShortString::from(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await
        {
            Ok(c) => c,
            Err(Opened::Failed(e) | Opened::Refused(e)) => return Ended::Lost(e, 0),
        };
        let tag = consumer.tag();
        let mut consumer = std::pin::pin!(consumer);
        let mut in_hand = FuturesUnordered::new();
        let mut taking = true;
        let mut lost: Option<(String, usize)> = None;
        let prefetch = cfg.prefetch.get() as usize;
        loop {
            if !taking && in_hand.is_empty() {
                break;
            }
            let wake = tokio::select! {
                biased;
                _ = shutdown.cancelled(), if taking => Wake::Shutdown,
                Some(()) = in_hand.next(), if !in_hand.is_empty() => Wake::Finished,
                _ = self.lost.cancelled(), if lost.is_none() => Wake::Lost("amqp connection lost".into()),
                d = consumer.next(), if taking && in_hand.len() < prefetch => Wake::Delivery(d.map(|r| r.map(Box::new))),
            };
            match wake {
                Wake::Shutdown => {
                    events::stopping(&cfg.name, in_hand.len());
                    taking = false;
                    // Stop deliveries; what was prefetched but not started goes back to the
                    // queue when the channel closes.
                    let _ = tokio::time::timeout(
                        RPC_TIMEOUT,
                        self.consume
                            .basic_cancel(tag.clone(), BasicCancelOptions::default()),
                    )
                    .await;
                }
                Wake::Finished => {}
                Wake::Delivery(Some(Ok(d))) => {
                    in_hand.push(process(shared.clone(), handler.clone(), *d));
                }
                Wake::Delivery(Some(Err(e))) => {
                    taking = false;
                    lost = Some((e.to_string(), in_hand.len()));
                }
                Wake::Delivery(None) => {
                    taking = false;
                    lost = Some(("the broker cancelled the consumer".into(), in_hand.len()));
                }
                Wake::Lost(why) => {
                    // Let the messages in hand finish (bounded by handler_timeout); their
                    // acks fail and the broker redelivers them, which the inbox absorbs.
                    taking = false;
                    lost = Some((why, in_hand.len()));
                }
            }
        }
        match lost {
            Some((why, in_hand)) if !shutdown.is_cancelled() => Ended::Lost(why, in_hand),
            _ => Ended::Shutdown,
        }
    }

    pub(super) async fn close(self) {
        self.lost.cancel();
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            self.conn.close(200, "outbox consumer closing".into()),
        )
        .await;
    }
}

/// What both topologies share: the source exchange, the dead-letter exchange and its queue.
/// Returns the dead-letter exchange's name and the options every durable queue is declared with.
async fn declare_source_and_dead_letters(
    ch: &Channel,
    cfg: &ConsumerConfig,
) -> Result<(String, QueueDeclareOptions), Opened> {
    let declared = |e| refused_or_failed("exchange.declare", e);
    amqp::declare_exchange(ch, &cfg.exchange, ExchangeKind::Topic, false)
        .await
        .map_err(declared)?;
    let dlx = cfg.dead_letter_exchange();
    amqp::declare_exchange(ch, &dlx, ExchangeKind::Fanout, false)
        .await
        .map_err(declared)?;
    let queue_options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let dlq = cfg.dead_letter_queue();
    rpc(
        "queue.declare",
        ch.queue_declare(dlq.as_str().into(), queue_options, FieldTable::default()),
    )
    .await?;
    rpc(
        "queue.bind",
        ch.queue_bind(
            dlq.as_str().into(),
            dlx.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    Ok((dlx, queue_options))
}

async fn declare(ch: &Channel, cfg: &ConsumerConfig) -> Result<(), Opened> {
    let (dlx, queue_options) = declare_source_and_dead_letters(ch, cfg).await?;
    let mut args = FieldTable::default();
    // What the broker itself gives up on (a reject without requeue) lands there too.
    args.insert("x-dead-letter-exchange".into(), long_string(&dlx));
    rpc(
        "queue.declare",
        ch.queue_declare(cfg.queue.as_str().into(), queue_options, args),
    )
    .await?;
    for binding in &cfg.bindings {
        rpc(
            "queue.bind",
            ch.queue_bind(
                cfg.queue.as_str().into(),
                cfg.exchange.as_str().into(),
                binding.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
    }
    for delay in cfg.delay_tiers() {
        let mut args = FieldTable::default();
        args.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(delay.as_millis() as i64),
        );
        args.insert("x-dead-letter-exchange".into(), long_string(""));
        args.insert("x-dead-letter-routing-key".into(), long_string(&cfg.queue));
        let name = cfg.retry_queue(delay);
        rpc(
            "queue.declare",
            ch.queue_declare(name.as_str().into(), queue_options, args),
        )
        .await?;
    }
    Ok(())
}

/// An ordered group's topology: the source exchange, the dead-letter exchange and queue,
/// the consistent-hash exchange `<queue>.hash` (hashing `x-outbox-aggregate-id`, which the
/// relay sends as a long string, so a key's events share a partition) bound to the source
/// with each binding, and the partition queues, single-active-consumer, bound to the hash
/// exchange with weight "1" in sorted order (after a full broker restart the plugin rebuilds
/// its ring from the bindings in sorted order, so the ring stays the same).
async fn declare_group(ch: &Channel, cfg: &ConsumerConfig) -> Result<(), Opened> {
    let ordered = cfg.ordered.as_ref().expect("a group is ordered");
    let (dlx, queue_options) = declare_source_and_dead_letters(ch, cfg).await?;
    let hash = cfg.hash_exchange();
    let mut args = FieldTable::default();
    args.insert("hash-header".into(), long_string(H_AGGREGATE_ID));
    rpc(
        "exchange.declare",
        ch.exchange_declare(
            hash.as_str().into(),
            ExchangeKind::Custom("x-consistent-hash".into()),
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            args,
        ),
    )
    .await?;
    for binding in &cfg.bindings {
        rpc(
            "exchange.bind",
            ch.exchange_bind(
                hash.as_str().into(),
                cfg.exchange.as_str().into(),
                binding.as_str().into(),
                ExchangeBindOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
    }
    for p in 0..ordered.partitions.get() {
        let queue = cfg.partition_queue(p);
        let mut args = FieldTable::default();
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        args.insert("x-dead-letter-exchange".into(), long_string(&dlx));
        rpc(
            "queue.declare",
            ch.queue_declare(queue.as_str().into(), queue_options, args),
        )
        .await?;
        rpc(
            "queue.bind",
            ch.queue_bind(
                queue.as_str().into(),
                hash.as_str().into(),
                "1".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPHardError};

    #[test]
    fn a_missing_hash_exchange_plugin_is_named() {
        let broker = AMQPError::new(
            AMQPErrorKind::Hard(AMQPHardError::COMMANDINVALID),
            "COMMAND_INVALID - unknown exchange type 'x-consistent-hash'".into(),
        );
        let e = AmqpError::Amqp(lapin::ErrorKind::ProtocolError(broker).into());
        let Opened::Refused(why) = refused_or_failed("exchange.declare", e) else {
            panic!("a missing plugin is not worth retrying")
        };
        assert!(
            why.contains("enable the rabbitmq_consistent_hash_exchange plugin"),
            "{why}"
        );
    }
}
