//! An ordered group's member: its heartbeat in Postgres, the partitions it owns, its
//! router (`router`: intake to partition queues), and the drain of released keys' held
//! events. One `select!` over a closed set of wake-ups
//! ([`Wake`]) per AMQP session.
//!
//! Assignment: every `member_lease / 3` the member renews its lease (`outbox_group_beat`,
//! database clock) and gets the live members in sorted order; member i of n owns the
//! partitions p with p % n = i. It starts a partition task (one channel, one consumer) for
//! each partition it gains and stops the task of each it loses (the task finishes the
//! events in hand, then closes its channel). Single-active-consumer on each partition queue
//! is the fence: while two members briefly consume one partition, only one is active, and
//! the broker activates the other when the first channel closes (or its connection dies).
//!
//! Invariants: a member that could not renew its lease for `member_lease` gives up all its
//! partitions (the others take them over after the same lease). A key's held events are
//! applied only by the member owning its partition, and under the key's row lock.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use lapin::Connection;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::amqp::AmqpTarget;
use crate::consumer::{events, inbox};
use crate::db::{DbError, deadline};

use super::process::{GroupCx, apply_held};
use super::session::Ended;
use super::settle::Shared;
use super::{Handler, Ordered};

const BEAT: &str = "SELECT m FROM outbox_group_beat($1, $2, $3) AS m";
const LEAVE: &str = "SELECT outbox_group_leave($1, $2)";
/// How often the owned partitions are checked for released keys with held events.
const DRAIN_EVERY: Duration = Duration::from_secs(1);
/// How long a router that ended waits before it starts again (at the next heartbeat).
const ROUTER_RESTART: Duration = Duration::from_secs(1);

/// A member id: the connection name, the process id and a random part, so that two
/// instances never share one.
pub(super) fn member_id(connection_name: &str) -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!(
        "{connection_name}#{}#{:016x}",
        std::process::id(),
        h.finish()
    )
}

/// The partitions member `index` of `members` owns.
pub(super) fn assigned(partitions: u16, index: usize, members: usize) -> Vec<u16> {
    (0..partitions)
        .filter(|p| usize::from(*p) % members.max(1) == index)
        .collect()
}

/// The one `select!` of a member handles exactly these.
enum Wake {
    Stop,
    Beat,
    Drain,
    PartitionEnded(u16, Result<(), String>),
    RouterEnded(Result<(), String>),
    Drained,
}

struct Owned {
    stop: CancellationToken,
}

/// Runs the member on one AMQP connection until shutdown or the connection is lost.
pub(super) async fn run<H: Handler>(
    shared: Arc<Shared>,
    handler: Arc<H>,
    conn: Arc<Connection>,
    amqp: &AmqpTarget,
    member: &str,
    lost: &CancellationToken,
    shutdown: &CancellationToken,
) -> Ended {
    let cfg = shared.cfg.clone();
    let ordered: &Ordered = cfg.ordered.as_ref().expect("a group is ordered");
    let permits = Arc::new(Semaphore::new(usize::from(cfg.prefetch.get())));
    // A partition whose lane with parked events emptied asks for a drain at once.
    let drain_now = Arc::new(Notify::new());
    let mut owned: HashMap<u16, Owned> = HashMap::new();
    // Partitions whose last consumer ended in an error: probed before consuming again.
    let mut failed: HashSet<u16> = HashSet::new();
    let mut tasks: FuturesUnordered<JoinHandle<(u16, Result<(), String>)>> =
        FuturesUnordered::new();
    let mut task_partition: HashMap<tokio::task::Id, u16> = HashMap::new();
    let mut drain: Option<JoinHandle<()>> = None;
    // Every member runs a router; the intake's single-active-consumer lets one route.
    let mut router: Option<JoinHandle<Result<(), String>>> = None;
    let mut router_due = Instant::now();
    let mut beat = tokio::time::interval(ordered.member_lease / 3);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut drain_tick = tokio::time::interval(DRAIN_EVERY);
    drain_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_beat = Instant::now();
    let mut last_assignment: Vec<u16> = Vec::new();
    let stopping = CancellationToken::new();
    let mut why_lost: Option<String> = None;
    loop {
        let wake = tokio::select! {
            biased;
            _ = shutdown.cancelled(), if !stopping.is_cancelled() => Wake::Stop,
            _ = lost.cancelled(), if !stopping.is_cancelled() => {
                why_lost = Some("amqp connection lost".into());
                Wake::Stop
            }
            Some(done) = tasks.next(), if !tasks.is_empty() => match done {
                Ok((p, r)) => Wake::PartitionEnded(p, r),
                // A panic outside the handler (handlers' panics are caught in `process`):
                // forget the partition so the next heartbeat takes it again.
                Err(e) => {
                    let p = task_partition.get(&e.id()).copied().unwrap_or(u16::MAX);
                    Wake::PartitionEnded(p, Err(e.to_string()))
                }
            },
            _ = async { drain.as_mut().expect("guarded").await }, if drain.is_some() => Wake::Drained,
            r = async { router.as_mut().expect("guarded").await }, if router.is_some() => {
                Wake::RouterEnded(r.unwrap_or_else(|e| Err(e.to_string())))
            }
            _ = beat.tick(), if !stopping.is_cancelled() => Wake::Beat,
            _ = drain_tick.tick(), if !stopping.is_cancelled() && drain.is_none() => Wake::Drain,
            _ = drain_now.notified(), if !stopping.is_cancelled() && drain.is_none() => Wake::Drain,
        };
        match wake {
            Wake::Stop => {
                stopping.cancel();
                for o in owned.values() {
                    o.stop.cancel();
                }
            }
            Wake::PartitionEnded(p, r) => {
                if let Err(why) = r
                    && !stopping.is_cancelled()
                {
                    events::partition_ended(&cfg.name, p, &why);
                    failed.insert(p);
                } else {
                    failed.remove(&p);
                }
                owned.remove(&p);
                task_partition.retain(|_, q| *q != p);
            }
            Wake::Drained => drain = None,
            Wake::RouterEnded(r) => {
                router = None;
                router_due = Instant::now() + ROUTER_RESTART;
                if let Err(why) = r
                    && !stopping.is_cancelled()
                {
                    events::router_ended(&cfg.name, &why);
                }
            }
            Wake::Beat => {
                if router.is_none() && Instant::now() >= router_due {
                    router = Some(tokio::spawn(super::router::route(
                        cfg.clone(),
                        amqp.clone(),
                        stopping.child_token(),
                    )));
                }
                let (want, n) = match heartbeat(&shared, member, ordered).await {
                    Ok(members) => {
                        last_beat = Instant::now();
                        let index = members.iter().position(|m| m == member).unwrap_or(0);
                        (
                            assigned(ordered.partitions.get(), index, members.len()),
                            members.len(),
                        )
                    }
                    Err(e) => {
                        events::heartbeat_failed(&cfg.name, &e);
                        if last_beat.elapsed() < ordered.member_lease {
                            continue;
                        }
                        // Our lease ran out: the others own our partitions now.
                        (Vec::new(), 0)
                    }
                };
                if want != last_assignment {
                    events::group_assigned(&cfg.name, member, n, &want);
                    last_assignment = want.clone();
                }
                for (p, o) in &owned {
                    if !want.contains(p) {
                        o.stop.cancel();
                    }
                }
                for p in want {
                    if owned.contains_key(&p) {
                        continue;
                    }
                    let stop = CancellationToken::new();
                    owned.insert(p, Owned { stop: stop.clone() });
                    let task = super::partition::consume(
                        shared.clone(),
                        handler.clone(),
                        conn.clone(),
                        p,
                        permits.clone(),
                        drain_now.clone(),
                        stop,
                    );
                    // A partition whose last consumer failed may have lost its queue, and
                    // one this member does not declare may never have had it: ask on a
                    // connection of its own before consuming on the shared one.
                    let probe = (failed.contains(&p) || !cfg.declare).then(|| {
                        (
                            amqp.clone(),
                            cfg.connection_name.clone(),
                            cfg.partition_queue(p),
                        )
                    });
                    let handle = tokio::spawn(async move {
                        if let Some((amqp, name, queue)) = probe
                            && let Err(e) =
                                super::partition::queue_exists(&amqp, &name, &queue).await
                        {
                            return (p, Err(e));
                        }
                        (p, task.await)
                    });
                    task_partition.insert(handle.id(), p);
                    tasks.push(handle);
                }
            }
            Wake::Drain => {
                let mine: Vec<u16> = owned
                    .iter()
                    .filter(|(_, o)| !o.stop.is_cancelled())
                    .map(|(p, _)| *p)
                    .collect();
                if mine.is_empty() {
                    continue;
                }
                let (shared, handler, permits, stop) = (
                    shared.clone(),
                    handler.clone(),
                    permits.clone(),
                    stopping.child_token(),
                );
                drain = Some(tokio::spawn(async move {
                    drain_released(&shared, &*handler, &permits, &stop, &mine).await;
                }));
            }
        }
        if stopping.is_cancelled() && tasks.is_empty() && drain.is_none() && router.is_none() {
            break;
        }
    }
    if why_lost.is_none() {
        let left = async {
            let client = deadline(shared.pool.get()).await?;
            deadline(client.execute(LEAVE, &[&cfg.name, &member])).await?;
            Ok::<_, DbError>(())
        };
        let _ = left.await;
    }
    match why_lost {
        Some(why) if !shutdown.is_cancelled() => Ended::Lost(why, 0),
        _ => Ended::Shutdown,
    }
}

async fn heartbeat(shared: &Shared, member: &str, o: &Ordered) -> Result<Vec<String>, DbError> {
    let client = deadline(shared.pool.get()).await?;
    let lease_ms = i32::try_from(o.member_lease.as_millis()).unwrap_or(i32::MAX);
    let rows = deadline(client.query(BEAT, &[&shared.cfg.name, &member, &lease_ms])).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Applies the held events of every released key in `partitions`.
async fn drain_released<H: Handler>(
    shared: &Shared,
    handler: &H,
    permits: &Semaphore,
    stop: &CancellationToken,
    partitions: &[u16],
) {
    let keys = async {
        let client = deadline(shared.pool.get()).await?;
        inbox::releasable(&**client, &shared.cfg.name, partitions).await
    }
    .await;
    let Ok(keys) = keys else { return };
    let g = GroupCx {
        shared,
        handler,
        permits,
        stop,
    };
    for (t, id) in keys {
        let n = apply_held(&g, &t, &id).await;
        if n > 0 {
            events::held_applied(&shared.cfg.name, &t, &id, n);
        }
        if stop.is_cancelled() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_share_the_partitions_fairly() {
        assert_eq!(assigned(8, 0, 1), (0..8).collect::<Vec<_>>());
        let three: Vec<Vec<u16>> = (0..3).map(|i| assigned(8, i, 3)).collect();
        assert_eq!(three, [vec![0, 3, 6], vec![1, 4, 7], vec![2, 5]]);
        let mut all: Vec<u16> = three.concat();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        assert_ne!(member_id("a"), member_id("a"));
    }
}
