//! One partition queue of an ordered group, consumed on a channel of its own: deliveries
//! arrive in queue order and are dispatched by key into FIFO lanes; keys run concurrently
//! (bounded by the instance's handler permits), a key's events strictly one after another.
//!
//! Invariants: acks are per delivery tag, never `multiple`. The partition is given up by
//! closing its channel once the events in hand are finished, never by `basic.cancel`
//! (with single-active-consumer, a cancel activates the next consumer while this one still
//! holds unacked messages). Events waiting in a lane when the partition is given up are
//! not started: the channel's close returns them to the queue in their order. A lane whose
//! event was abandoned starts none of its later events.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use futures_util::stream::{FuturesUnordered, StreamExt};
use lapin::Connection;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::amqp;

use super::message::key_of;
use super::process::{GroupCx, Settled, Shared, process_in_group};
use super::{Handler, RPC_TIMEOUT};

/// A lane: a key, or one delivery without a key (dead-lettered on its own).
#[derive(Clone, PartialEq, Eq, Hash)]
enum Lane {
    Key(String, String),
    Alone(u64),
}

/// Consumes partition `p` until `stop` is cancelled (or the channel fails), then finishes
/// the events in hand and closes the channel. Returns why it ended when not asked to.
pub(super) async fn consume<H: Handler>(
    shared: Arc<Shared>,
    handler: Arc<H>,
    conn: Arc<Connection>,
    p: u16,
    permits: Arc<Semaphore>,
    stop: CancellationToken,
) -> Result<(), String> {
    let cfg = shared.cfg.clone();
    let queue = cfg.partition_queue(p);
    let ch = amqp::rpc("channel.open", conn.create_channel())
        .await
        .map_err(|e| e.to_string())?;
    let setup = async {
        amqp::rpc(
            "basic.qos",
            ch.basic_qos(cfg.prefetch.get(), BasicQosOptions::default()),
        )
        .await?;
        amqp::rpc(
            "basic.consume",
            ch.basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await
    };
    let consumer = match setup.await {
        Ok(c) => c,
        Err(e) => {
            let _ = tokio::time::timeout(RPC_TIMEOUT, ch.close(200, "setup failed".into())).await;
            return Err(e.to_string());
        }
    };
    let mut consumer = std::pin::pin!(consumer);
    let g = GroupCx {
        shared: &shared,
        handler: &*handler,
        permits: &permits,
        stop: &stop,
    };
    let mut lanes: HashMap<Lane, VecDeque<Delivery>> = HashMap::new();
    let mut running = FuturesUnordered::new();
    let mut taking = true;
    let mut ended: Result<(), String> = Ok(());
    let run = |lane: Lane, d: Delivery| {
        let g = &g;
        async move {
            let settled = process_in_group(g, p, &d).await;
            (lane, settled)
        }
    };
    loop {
        if !taking && running.is_empty() {
            break;
        }
        tokio::select! {
            biased;
            _ = stop.cancelled(), if taking => taking = false,
            Some((lane, settled)) = running.next(), if !running.is_empty() => {
                let next = if settled == Settled::Done && !stop.is_cancelled() {
                    lanes.get_mut(&lane).and_then(VecDeque::pop_front)
                } else {
                    None
                };
                match next {
                    Some(d) => running.push(run(lane, d)),
                    None => {
                        // Its waiting events (if any) go back to the queue with the channel.
                        lanes.remove(&lane);
                    }
                }
            }
            d = consumer.next(), if taking => match d {
                Some(Ok(d)) => {
                    let lane = key_of(&d)
                        .map_or(Lane::Alone(d.delivery_tag), |(t, id)| Lane::Key(t, id));
                    match lanes.get_mut(&lane) {
                        Some(waiting) => waiting.push_back(d),
                        None => {
                            lanes.insert(lane.clone(), VecDeque::new());
                            running.push(run(lane, d));
                        }
                    }
                }
                Some(Err(e)) => {
                    taking = false;
                    stop.cancel();
                    ended = Err(e.to_string());
                }
                None => {
                    taking = false;
                    stop.cancel();
                    ended = Err("the broker cancelled the consumer".into());
                }
            },
        }
    }
    drop(running);
    drop(lanes);
    // Never basic.cancel: closing the channel hands the partition over only now that
    // nothing of it is in hand.
    let _ = tokio::time::timeout(RPC_TIMEOUT, ch.close(200, "partition given up".into())).await;
    ended
}
