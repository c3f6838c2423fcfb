//! One AMQP session of the runner: connect, declare the topology (a queue with retry
//! queues, or an ordered group's intake queue, route exchange and partition queues), open a consume
//! channel (with the prefetch) and (unordered) a confirm-mode publish channel, and the
//! unordered consume loop, one `select!` over a closed set of wake-ups ([`Wake`]). `run`
//! reconnects around it; an ordered group's member (`group`) runs on the same session
//! instead of the loop, with its dead letters on a connection of their own.
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
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Connection, ExchangeKind};
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, AmqpError, AmqpTarget, long_string};
use crate::consumer::events;

use super::process::process;
use super::settle::Shared;
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
    /// The confirm channel of an unordered consumer's copies (none for an ordered group).
    pub(super) publish: Option<Channel>,
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
                    declare_group(&consume, &conn, cfg).await?;
                } else {
                    declare(&consume, cfg).await?;
                }
            }
            rpc(
                "basic.qos",
                consume.basic_qos(cfg.prefetch.get(), BasicQosOptions::default()),
            )
            .await?;
            // An ordered group publishes its dead letters on a connection of its own.
            let publish = if cfg.ordered.is_none() {
                let publish = rpc("channel.open", conn.create_channel()).await?;
                rpc(
                    "confirm.select",
                    publish.confirm_select(ConfirmSelectOptions::default()),
                )
                .await?;
                Some(publish)
            } else {
                None
            };
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
/// the intake queue (classic, single-active-consumer) bound to the source with each binding, the
/// route exchange of earlier versions' routers (direct, its alternate exchange the
/// dead-letter exchange) and the partition queues (classic, single-active-consumer), each bound to the route exchange with its
/// own name. Refused while the consistent-hash exchange of an earlier version is there.
async fn declare_group(
    ch: &Channel,
    conn: &Connection,
    cfg: &ConsumerConfig,
) -> Result<(), Opened> {
    let ordered = cfg.ordered.as_ref().expect("a group is ordered");
    refuse_legacy_hash_exchange(conn, cfg).await?;
    let (dlx, queue_options) = declare_source_and_dead_letters(ch, cfg).await?;
    let single_active = |dead_letters: bool| {
        let mut args = FieldTable::default();
        // Pinned: on a broker or vhost whose default type is quorum they would otherwise be
        // quorum queues, which move a returned message to the tail and drop (or dead-letter)
        // it after a delivery limit that channel closures count toward. A queue that already
        // exists as classic without the argument accepts it; one that exists as quorum is
        // refused (PRECONDITION_FAILED), and the runner stops saying so.
        args.insert("x-queue-type".into(), long_string("classic"));
        args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        if dead_letters {
            args.insert("x-dead-letter-exchange".into(), long_string(&dlx));
        }
        args
    };
    let intake = cfg.intake_queue();
    rpc(
        "queue.declare",
        ch.queue_declare(intake.as_str().into(), queue_options, single_active(false)),
    )
    .await?;
    for binding in &cfg.bindings {
        rpc(
            "queue.bind",
            ch.queue_bind(
                intake.as_str().into(),
                cfg.exchange.as_str().into(),
                binding.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
    }
    let route = cfg.route_exchange();
    let mut args = FieldTable::default();
    args.insert("alternate-exchange".into(), long_string(&dlx));
    rpc(
        "exchange.declare",
        ch.exchange_declare(
            route.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            args,
        ),
    )
    .await?;
    for p in 0..ordered.partitions.get() {
        let queue = cfg.partition_queue(p);
        rpc(
            "queue.declare",
            ch.queue_declare(queue.as_str().into(), queue_options, single_active(true)),
        )
        .await?;
        rpc(
            "queue.bind",
            ch.queue_bind(
                queue.as_str().into(),
                route.as_str().into(),
                queue.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
    }
    Ok(())
}

/// An earlier version spread a group's events with a consistent-hash exchange
/// `<queue>.hash`, whose ring moves keys to other partitions at a broker restart. While it
/// is bound it would keep putting events into the partition queues beside the router, so
/// start-up stops with what to do.
async fn refuse_legacy_hash_exchange(
    conn: &Connection,
    cfg: &ConsumerConfig,
) -> Result<(), Opened> {
    let hash = cfg.legacy_hash_exchange();
    // A passive declare of a missing exchange closes its channel: use one of its own.
    let ch = rpc("channel.open", conn.create_channel()).await?;
    let found = amqp::declare_exchange(&ch, &hash, ExchangeKind::Topic, true).await;
    match found {
        Ok(()) => {
            let _ = tokio::time::timeout(RPC_TIMEOUT, ch.close(200, "checked".into())).await;
            Err(Opened::Refused(format!(
                "the group still has the consistent-hash exchange '{hash}' of an earlier version, which moves keys between partitions when the broker restarts; unbind it from '{}' (new events then wait in '{}'), let the earlier version's members empty the partition queues, delete '{hash}' (rabbitmqctl delete_exchange {hash}) and start again",
                cfg.exchange,
                cfg.intake_queue()
            )))
        }
        Err(e) if e.to_string().contains("NOT_FOUND") => Ok(()),
        Err(e) => Err(Opened::Failed(format!("checking for '{hash}': {e}"))),
    }
}
