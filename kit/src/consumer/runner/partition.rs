//! One partition queue of an ordered group, consumed on a channel of its own: deliveries
//! arrive in queue order and are dispatched by key into FIFO lanes; keys run concurrently
//! (bounded by the instance's handler permits), a key's events strictly one after another.
//!
//! The channel's prefetch is the partition's window: at most that many of its events are
//! unacked here. A key keeps at most [`key_bound`] events waiting in memory behind the one
//! that runs; its later deliveries are parked (`outbox_group_park`: stored in
//! `outbox_inbox_held` behind the last one still in hand, then acked), so a key whose event
//! keeps failing holds its own lane and never the window of the partition's other keys.
//! Parked events are applied in seq order once the key has applied everything it had in
//! hand (the member's drain, woken when such a lane empties). A park that fails gives the
//! partition up: what is unacked comes back in queue order (parks finish in any order, so
//! keeping failed ones in memory could run a key's events out of order).
//!
//! Invariants: acks are per delivery tag, never `multiple`. The partition is given up by
//! closing its channel once the events in hand are finished, never by `basic.cancel`
//! (with single-active-consumer, a cancel activates the next consumer while this one still
//! holds unacked messages). Events waiting in a lane when the partition is given up are
//! not started: the channel's close returns them to the queue in their order. A lane whose
//! event was abandoned starts none of its later events. A delivery is parked only behind
//! an event of its key with a lower seq that is still in hand, and acked only after its
//! park committed.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use futures_util::stream::{FuturesUnordered, StreamExt};
use lapin::Connection;
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::amqp::{self, AmqpTarget};
use crate::consumer::events;
use crate::consumer::inbox::{self, HeldEvent, Parked};
use crate::db::deadline;

use super::message::{key_of, parse, seq_of};
use super::process::{GroupCx, Settled, process_in_group};
use super::settle::{Shared, ack};
use super::{Handler, RPC_TIMEOUT};

/// How many of a key's events wait in memory behind the one that runs, at most: a quarter
/// of the prefetch (at least one), so that a failing key leaves most of the partition's
/// window to its other keys however many of its own events queue behind it.
pub(super) fn key_bound(prefetch: u16) -> usize {
    usize::from(prefetch / 4).max(1)
}

/// A lane's events in hand: those waiting behind the one that runs, the highest seq among
/// all of them (the one a parked event waits for), and how many were parked.
struct InHand {
    waiting: VecDeque<Delivery>,
    last_seq: Option<i64>,
    parked: usize,
}

impl InHand {
    fn new(d: &Delivery) -> InHand {
        InHand {
            waiting: VecDeque::new(),
            last_seq: seq_of(d),
            parked: 0,
        }
    }

    fn keep(&mut self, d: Delivery) {
        self.last_seq = self.last_seq.max(seq_of(&d));
        self.waiting.push_back(d);
    }

    /// The seq a delivery would be parked behind: the highest of its key handed on so far
    /// (kept or parked), when the lane is full or has parked before and the delivery comes
    /// after everything handed on. Once a key parked one event, every later one is parked
    /// too, each behind the one before: nothing of the key in memory can overtake a park
    /// still under way, and a drain applies the parked events one after another.
    fn park_behind(&self, d: &Delivery, bound: usize) -> Option<i64> {
        let after = self.last_seq?;
        ((self.parked > 0 || self.waiting.len() >= bound) && seq_of(d)? > after).then_some(after)
    }

    /// `d` is being parked: the key's next parked event waits for it.
    fn parking(&mut self, d: &Delivery) {
        self.parked += 1;
        self.last_seq = self.last_seq.max(seq_of(d));
    }
}

/// Stores `d` in `outbox_inbox_held` behind seq `after` of its key (one transaction).
async fn park(shared: &Shared, p: u16, d: &Delivery, after: i64) -> Result<Parked, String> {
    let msg = parse(d, true)?;
    let headers = serde_json::Value::Object(msg.headers.clone());
    let held = HeldEvent {
        event: msg.event_ref(true),
        partition: p,
        event_type: &msg.event_type,
        routing_key: &msg.routing_key,
        headers: &headers,
        body: &msg.body,
    };
    let client = deadline(shared.pool.get())
        .await
        .map_err(|e| e.to_string())?;
    inbox::park(&**client, &shared.cfg.name, &held, after)
        .await
        .map_err(|e| e.to_string())
}

/// A lane: a key, or one delivery without a key (dead-lettered on its own).
#[derive(Clone, PartialEq, Eq, Hash)]
enum Lane {
    Key(String, String),
    Alone(u64),
}

/// Whether partition queue `queue` exists, asked with a passive declare on a connection of
/// its own. A `basic.consume` on a queue that is gone fails its channel, and with lapin
/// 4.12 the broker's channel.close can end the whole connection it came on (seen in
/// `groups::copies_for_a_missing_partition_queue_are_retried_while_the_others_flow`): on
/// the member's shared connection that stopped every partition's consumer at each retry.
pub(super) async fn queue_exists(amqp: &AmqpTarget, name: &str, queue: &str) -> Result<(), String> {
    let conn = amqp
        .connect(&format!("{name} probe"))
        .await
        .map_err(|e| e.to_string())?;
    let declared = async {
        let ch = amqp::rpc("channel.open", conn.create_channel()).await?;
        amqp::rpc(
            "queue.declare (passive)",
            ch.queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            ),
        )
        .await
    }
    .await;
    let _ = tokio::time::timeout(RPC_TIMEOUT, conn.close(200, "probed".into())).await;
    declared
        .map(|_| ())
        .map_err(|e| format!("partition queue {queue} not there: {e}"))
}

/// Consumes partition `p` until `stop` is cancelled (or the channel fails), then finishes
/// the events in hand and closes the channel. Returns why it ended when not asked to.
pub(super) async fn consume<H: Handler>(
    shared: Arc<Shared>,
    handler: Arc<H>,
    conn: Arc<Connection>,
    p: u16,
    permits: Arc<Semaphore>,
    drain_now: Arc<Notify>,
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
    let bound = key_bound(cfg.prefetch.get());
    let mut lanes: HashMap<Lane, InHand> = HashMap::new();
    let mut running = FuturesUnordered::new();
    let mut parking = FuturesUnordered::new();
    let mut taking = true;
    let mut ended: Result<(), String> = Ok(());
    let run = |lane: Lane, d: Delivery| {
        let g = &g;
        async move {
            let settled = process_in_group(g, p, &d).await;
            (lane, settled)
        }
    };
    let park_one = |lane: Lane, d: Delivery, after: i64| {
        let shared = &shared;
        async move {
            let parked: Result<Parked, String> = park(shared, p, &d, after).await;
            (lane, d, parked)
        }
    };
    loop {
        if !taking && running.is_empty() && parking.is_empty() {
            break;
        }
        tokio::select! {
            biased;
            _ = stop.cancelled(), if taking => taking = false,
            Some((lane, settled)) = running.next(), if !running.is_empty() => {
                let next = if settled == Settled::Done && !stop.is_cancelled() {
                    lanes.get_mut(&lane).and_then(|h| h.waiting.pop_front())
                } else {
                    None
                };
                match next {
                    Some(d) => running.push(run(lane, d)),
                    None => {
                        // Its waiting events (if any) go back to the queue with the channel.
                        if let Some(h) = lanes.remove(&lane)
                            && h.parked > 0
                        {
                            if let Lane::Key(t, id) = &lane {
                                events::key_parked(&cfg.name, p, t, id, h.parked);
                            }
                            // What it had in hand is done: its parked events may go now.
                            drain_now.notify_one();
                        }
                    }
                }
            }
            Some((lane, d, parked)) = parking.next(), if !parking.is_empty() => match parked {
                Ok(Parked::Parked | Parked::Duplicate) => ack(&d).await,
                Err::<_, String>(why) => {
                    // Unacked, it goes back to the queue with the channel, in its order.
                    // Keeping it in memory instead could run it after a later event of its
                    // key: parks finish in any order, so a later one that also failed may
                    // already be back in the lane (the soak saw seq 1472 applied after
                    // 1470 with 1471 late, when parks failed while Postgres restarted).
                    events::park_failed(&cfg.name, p, &why);
                    drop((lane, d));
                    if !stop.is_cancelled() {
                        taking = false;
                        stop.cancel();
                        ended = Err(format!("an event could not be parked: {why}"));
                    }
                }
            },
            d = consumer.next(), if taking => match d {
                Some(Ok(d)) => {
                    let lane = key_of(&d)
                        .map_or(Lane::Alone(d.delivery_tag), |(t, id)| Lane::Key(t, id));
                    match lanes.get_mut(&lane) {
                        Some(h) => match h.park_behind(&d, bound) {
                            Some(after) => {
                                h.parking(&d);
                                parking.push(park_one(lane, d, after));
                            }
                            None => h.keep(d),
                        },
                        None => {
                            lanes.insert(lane.clone(), InHand::new(&d));
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
    drop(parking);
    drop(lanes);
    // Never basic.cancel: closing the channel hands the partition over only now that
    // nothing of it is in hand.
    let _ = tokio::time::timeout(RPC_TIMEOUT, ch.close(200, "partition given up".into())).await;
    ended
}
