//! The fault schedule played: [`World`] holds what faults act on (process slots, proxies,
//! the destination's book, the tap, the run's own services), [`World::inject`] injects one
//! fault and waits until it is over, [`World::heal`] undoes everything after the schedule,
//! and [`play`] runs the schedule, one task per fault, recording what happened to each.
//!
//! The kill between ack and mark: a trip wire on the relay's AMQP proxy darkens its
//! Postgres proxy the instant the relay sends a publish (before the publish goes on), so
//! the broker's ack comes back and the mark cannot go out. Once the tap holds rows of that
//! relay's partitions that are not marked and bytes have come back from the broker since
//! the trip, the relay is SIGKILLed; its Postgres proxy then passes again, closing the dark
//! connections with the unsent marks in them. Those rows are recorded: the verdict demands
//! that each was published again (a duplicate, never a loss) and applied once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;
use outbox_testkit::postgres::Stop;
use outbox_testkit::proxy::Mode;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_postgres::Client;

use crate::consumer;
use crate::destination::{self, Book};
use crate::procs::wait_until;
use crate::procs::{self, Slot};
use crate::producer::now_ms;
use crate::schedule::{Fault, Planned, Service, Target};
use crate::tap::{self, Tap};

use super::wiring::{Proxies, app_name, queue_depth};
use super::{FaultRecord, Own};

/// Whether a chunk a client sends holds an AMQP `basic.publish`: a method frame (type 1,
/// channel, size) whose class and method are 60 and 40. Not the handshake, a heartbeat or
/// an ack: only a publish may trip the wire.
fn holds_a_publish(chunk: &[u8]) -> bool {
    chunk
        .windows(11)
        .any(|w| w[0] == 1 && w[7..11] == [0, 60, 0, 40])
}

/// The relay's rows among `ids` that are not marked dispatched, in partitions it leases.
const UNMARKED_OF_RELAY: &str = "
SELECT e.event_id FROM outbox_events e
  JOIN outbox_partitions p ON p.partition = outbox_partition_of(e.aggregate_type, e.aggregate_id)
  JOIN outbox_relays r ON r.relay_id = p.owner
 WHERE e.event_id = ANY($1) AND e.dispatched_at IS NULL AND r.pid = $2";

/// Everything the fault tasks act on.
pub(super) struct World {
    pub(super) db_name: String,
    pub(super) exchange: String,
    /// The consumer group's queue name (its partition queues are named after it).
    pub(super) queue: String,
    pub(super) amqp: AmqpTarget,
    pub(super) target: DbTarget,
    pub(super) relays: Vec<Slot>,
    pub(super) consumers: Vec<Slot>,
    pub(super) proxies: Proxies,
    pub(super) book: Arc<Book>,
    pub(super) crash_points: Vec<Notify>,
    pub(super) host: String,
    pub(super) injected_copies: Mutex<usize>,
    /// The run's own services (None: shared ones, never restarted).
    pub(super) own: Option<Arc<Own>>,
    /// The own RabbitMQ node's name, for `rabbitmqctl -n`.
    pub(super) rabbit_node: Option<String>,
    pub(super) tap: Tap,
    /// Rows acked by the broker and not marked when their relay was SIGKILLed.
    pub(super) ack_not_marked: Mutex<Vec<uuid::Uuid>>,
    /// Per service: a restart holds it for writing, a fault that needs the service for
    /// reading, so neither starts while the other runs (a restart can outlast its plan).
    pub(super) gates: [tokio::sync::RwLock<()>; 2],
}

impl World {
    fn slot(&self, target: Target) -> &Slot {
        match target {
            Target::Relay(i) => &self.relays[i],
            Target::Consumer(i) => &self.consumers[i],
        }
    }

    /// The name the process's AMQP connection carries (what `close_connection` looks for).
    async fn connection_name(&self, target: Target) -> Option<String> {
        let slot = self.slot(target);
        Some(match target {
            Target::Relay(_) => format!("outbox-relay@{}:{}\"", self.host, slot.pid().await?),
            Target::Consumer(i) => format!(
                "outbox-soak-consumer {}\"",
                destination::worker_name(i, slot.incarnation().await)
            ),
        })
    }

    /// A connection of the soak's own, for a fault that needs one; waits out a restart of
    /// Postgres (the schedule keeps them apart, but a start may take longer than planned).
    async fn connect(&self) -> anyhow::Result<Client> {
        let mut last = None;
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_secs(60) {
            match self
                .target
                .connect(&Schema::default(), "outbox-soak-faults")
                .await
            {
                Ok(c) => return Ok(c),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Err(last.map_or_else(|| anyhow::anyhow!("no connection"), Into::into))
    }

    fn gate(&self, service: Service) -> &tokio::sync::RwLock<()> {
        match service {
            Service::Postgres => &self.gates[0],
            Service::Rabbitmq => &self.gates[1],
        }
    }

    /// Injects one fault once the services it needs are up, and waits until it is over;
    /// returns a note.
    async fn inject(&self, fault: &Fault) -> anyhow::Result<(bool, String)> {
        let mut up = Vec::new();
        for s in fault.needs() {
            up.push(self.gate(*s).read().await);
        }
        let _down = match fault.restarts() {
            Some(s) => Some(self.gate(s).write().await),
            None => None,
        };
        match fault {
            Fault::KillRelay { relay, down_ms } => kill(&self.relays[*relay], *down_ms).await,
            Fault::PauseRelay { relay, pause_ms } => pause(&self.relays[*relay], *pause_ms).await,
            Fault::KillConsumer { consumer, down_ms } => {
                kill(&self.consumers[*consumer], *down_ms).await
            }
            Fault::PauseConsumer { consumer, pause_ms } => {
                pause(&self.consumers[*consumer], *pause_ms).await
            }
            Fault::StopConsumers { stop_ms } => self.stop_consumers(*stop_ms).await,
            Fault::CloseAmqp { target } => {
                let Some(name) = self.connection_name(*target).await else {
                    return Ok((false, "process not running".into()));
                };
                let closed = procs::close_connections(self.rabbit_node.as_deref(), &name).await?;
                Ok((
                    closed > 0,
                    format!("closed {closed} connection(s) named {name}"),
                ))
            }
            Fault::Blackhole {
                target,
                service,
                hold_ms,
            } => {
                self.hold(*target, *service, Mode::Blackhole, *hold_ms)
                    .await
            }
            Fault::Delay {
                target,
                service,
                delay_ms,
                hold_ms,
            } => {
                let mode = Mode::Delay(Duration::from_millis(*delay_ms));
                self.hold(*target, *service, mode, *hold_ms).await
            }
            Fault::Reset {
                target,
                service,
                hold_ms,
            } => self.hold(*target, *service, Mode::Reset, *hold_ms).await,
            Fault::TerminatePg { target } => {
                let client = self.connect().await?;
                let n: i64 = client
                    .query_one(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                          WHERE datname = $1 AND application_name = $2",
                        &[&self.db_name, &app_name(*target)],
                    )
                    .await?
                    .get(0);
                Ok((n > 0, format!("terminated {n} session(s)")))
            }
            Fault::CrashConsumer { consumer } => {
                let slot = &self.consumers[*consumer];
                slot.set_faulted(true).await;
                self.book.arm(*consumer);
                let reached = tokio::time::timeout(
                    Duration::from_secs(20),
                    self.crash_points[*consumer].notified(),
                )
                .await
                .is_ok();
                if !reached {
                    self.book.disarm(*consumer);
                    slot.set_faulted(false).await;
                    return Ok((false, "no send came within 20 s".into()));
                }
                slot.signal("KILL").await?;
                slot.wait_exit(Duration::from_secs(10)).await?;
                tokio::time::sleep(Duration::from_millis(300)).await;
                let pid = slot.start().await?;
                Ok((
                    true,
                    format!("killed after an accepted send; restarted as pid {pid}"),
                ))
            }
            Fault::Duplicates { count } => {
                let client = self.connect().await?;
                let n = tap::publish_copies(&self.amqp, &client, &self.exchange, *count).await?;
                *self.injected_copies.lock().unwrap() += n;
                Ok((n > 0, format!("{n} copies confirmed by the broker")))
            }
            Fault::KillBetweenAckAndMark { relay, down_ms } => {
                self.kill_between_ack_and_mark(*relay, *down_ms).await
            }
            Fault::RestartPostgres { down_ms, immediate } => {
                let Some(own) = &self.own else {
                    return Ok((false, "shared Postgres: never restarted".into()));
                };
                let how = if *immediate {
                    Stop::Immediate
                } else {
                    Stop::Fast
                };
                let t = std::time::Instant::now();
                own.pg.stop(how).await.map_err(anyhow::Error::msg)?;
                let stopped = t.elapsed();
                tokio::time::sleep(Duration::from_millis(*down_ms)).await;
                let t = std::time::Instant::now();
                own.pg.start_again().await.map_err(anyhow::Error::msg)?;
                Ok((true, took(stopped, t.elapsed())))
            }
            Fault::RestartRabbitmq { down_ms } => {
                let Some(own) = &self.own else {
                    return Ok((false, "shared RabbitMQ: never restarted".into()));
                };
                let t = std::time::Instant::now();
                own.rabbit.stop_node(0).await.map_err(anyhow::Error::msg)?;
                let stopped = t.elapsed();
                tokio::time::sleep(Duration::from_millis(*down_ms)).await;
                let t = std::time::Instant::now();
                own.rabbit.start_node(0).await.map_err(anyhow::Error::msg)?;
                Ok((true, took(stopped, t.elapsed())))
            }
        }
    }

    /// Every instance of the group stopped as a deploy stops it (SIGTERM, each finishes
    /// what it holds), the queues fill for `stop_ms`, then every instance starts again.
    async fn stop_consumers(&self, stop_ms: u64) -> anyhow::Result<(bool, String)> {
        let mut unclean = Vec::new();
        for slot in &self.consumers {
            slot.set_faulted(true).await;
            if slot.pid().await.is_some() {
                slot.signal("TERM").await?;
                let code = slot.wait_exit(Duration::from_secs(60)).await?;
                if code != Some(0) {
                    unclean.push(format!("{} exited {code:?}", slot.name));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(stop_ms)).await;
        let mut backlog = 0;
        for q in consumer::group_queues(&self.queue, &self.exchange) {
            backlog += queue_depth(&self.amqp, &q).await.map_or(0, |(n, _)| n);
        }
        for slot in &self.consumers {
            slot.start().await?;
        }
        // A clean stop is part of the guarantee: an instance that did not exit 0 is a
        // failure of the verdict ("error:").
        anyhow::ensure!(unclean.is_empty(), "SIGTERM: {}", unclean.join(", "));
        Ok((
            true,
            format!("a backlog of {backlog} messages when they started"),
        ))
    }

    /// See the module's doc.
    async fn kill_between_ack_and_mark(
        &self,
        relay: usize,
        down_ms: u64,
    ) -> anyhow::Result<(bool, String)> {
        let slot = &self.relays[relay];
        let Some(pid) = slot.pid().await else {
            return Ok((false, "relay not running".into()));
        };
        let client = self.connect().await?;
        let pg = self.proxies.get(Target::Relay(relay), Service::Postgres);
        let amqp = self.proxies.get(Target::Relay(relay), Service::Rabbitmq);
        slot.set_faulted(true).await;
        let from = self.tap.count();
        let (tripped, fired) = tokio::sync::oneshot::channel();
        let dark = pg.switch();
        amqp.trip_on_upstream(holds_a_publish, move || {
            dark.set(Mode::Blackhole);
            let _ = tripped.send(());
        });
        let released = |note: &'static str| async move {
            amqp.disarm();
            pg.set(Mode::Pass);
            slot.set_faulted(false).await;
            Ok((false, note.to_owned()))
        };
        if tokio::time::timeout(Duration::from_secs(20), fired)
            .await
            .is_err()
        {
            return released("the relay published nothing within 20 s").await;
        }
        let rows: Mutex<Vec<uuid::Uuid>> = Mutex::default();
        let caught = wait_until(
            Duration::from_secs(10),
            Duration::from_millis(100),
            || async {
                let stats = amqp.stats();
                let acked = stats
                    .bytes_down_at_trip
                    .is_some_and(|at| stats.bytes_down > at);
                let ids: Vec<uuid::Uuid> = self
                    .tap
                    .ids_since(from)
                    .iter()
                    .filter_map(|id| id.parse().ok())
                    .collect();
                let Ok(found) = client
                    .query(UNMARKED_OF_RELAY, &[&ids, &(pid as i32)])
                    .await
                else {
                    return false;
                };
                *rows.lock().unwrap() = found.iter().map(|r| r.get(0)).collect();
                acked && !rows.lock().unwrap().is_empty()
            },
        )
        .await;
        if !caught {
            return released("no acked, unmarked row of the relay within 10 s").await;
        }
        slot.signal("KILL").await?;
        slot.wait_exit(Duration::from_secs(10)).await?;
        // Closes the dark connections, and the marks waiting in them with them.
        pg.set(Mode::Pass);
        let rows = rows.into_inner().unwrap();
        let n = rows.len();
        self.ack_not_marked.lock().unwrap().extend(rows);
        tokio::time::sleep(Duration::from_millis(down_ms)).await;
        let pid = slot.start().await?;
        Ok((
            true,
            format!(
                "{n} row(s) routed and acked, not marked, when it died; restarted as pid {pid}"
            ),
        ))
    }

    async fn hold(
        &self,
        target: Target,
        service: Service,
        mode: Mode,
        hold_ms: u64,
    ) -> anyhow::Result<(bool, String)> {
        let proxy = self.proxies.get(target, service);
        proxy.set(mode);
        tokio::time::sleep(Duration::from_millis(hold_ms)).await;
        proxy.set(Mode::Pass);
        Ok((true, String::new()))
    }

    /// After the schedule: every proxy passes, every process runs.
    pub(super) async fn heal(&self) -> anyhow::Result<()> {
        for p in self.proxies.all() {
            p.set(Mode::Pass);
        }
        for slot in self.relays.iter().chain(&self.consumers) {
            if slot.pid().await.is_some() {
                let _ = slot.signal("CONT").await;
            }
            slot.set_faulted(false).await;
            slot.check_alive().await?;
            if slot.pid().await.is_none() {
                slot.start().await?;
            }
        }
        Ok(())
    }
}

/// SIGKILL, down for `down_ms`, then a new process in the same slot.
async fn kill(slot: &Slot, down_ms: u64) -> anyhow::Result<(bool, String)> {
    slot.set_faulted(true).await;
    slot.signal("KILL").await?;
    slot.wait_exit(Duration::from_secs(10)).await?;
    tokio::time::sleep(Duration::from_millis(down_ms)).await;
    let pid = slot.start().await?;
    Ok((true, format!("restarted as pid {pid}")))
}

/// SIGSTOP for `pause_ms`, then SIGCONT.
async fn pause(slot: &Slot, pause_ms: u64) -> anyhow::Result<(bool, String)> {
    slot.set_faulted(true).await;
    slot.signal("STOP").await?;
    tokio::time::sleep(Duration::from_millis(pause_ms)).await;
    slot.signal("CONT").await?;
    slot.set_faulted(false).await;
    Ok((true, String::new()))
}

fn took(stop: Duration, start: Duration) -> String {
    format!(
        "stopped in {:.1}s, started in {:.1}s",
        stop.as_secs_f64(),
        start.as_secs_f64()
    )
}

/// Spawns one task per planned fault, each sleeping until its time after `t0`, injecting
/// it and recording what happened; `started_ms` is when the schedule started (for the log).
pub(super) fn play(
    plan: Vec<Planned>,
    world: &Arc<World>,
    t0: tokio::time::Instant,
    started_ms: i64,
) -> (Arc<Mutex<Vec<FaultRecord>>>, Vec<JoinHandle<()>>) {
    let records: Arc<Mutex<Vec<FaultRecord>>> = Arc::default();
    let mut faults = Vec::new();
    for p in plan {
        let (w, records) = (world.clone(), records.clone());
        faults.push(tokio::spawn(async move {
            tokio::time::sleep_until(t0 + Duration::from_millis(p.at_ms)).await;
            let started = now_ms();
            let what = p.fault.to_string();
            println!(
                "  +{:>6.1}s  {what}",
                (started - started_ms) as f64 / 1000.0
            );
            // A fault that needs a connection opens one only while it runs: a long
            // schedule has hundreds.
            let (injected, note) = match w.inject(&p.fault).await {
                Ok(r) => r,
                Err(e) => (false, format!("error: {e:#}")),
            };
            if !injected {
                println!("            not injected: {note}");
            }
            records.lock().unwrap().push(FaultRecord {
                planned: p,
                what,
                started_ms: started,
                ended_ms: now_ms(),
                injected,
                note,
                recovery_ms: None,
            });
        }));
    }
    (records, faults)
}

#[cfg(test)]
mod tests {
    use super::holds_a_publish;

    #[test]
    fn only_a_publish_trips_the_wire() {
        // Frame type 1 on channel 1, payload size 20, class 60 (basic), method 40 (publish),
        // behind a heartbeat in the same chunk.
        let heartbeat = [8u8, 0, 0, 0, 0, 0, 0, 0xCE];
        let publish = [1u8, 0, 1, 0, 0, 0, 20, 0, 60, 0, 40, 0, 0];
        assert!(holds_a_publish(&[&heartbeat[..], &publish[..]].concat()));
        assert!(!holds_a_publish(&heartbeat));
        // basic.ack (60, 80) and connection.start-ok (10, 11) do not.
        assert!(!holds_a_publish(&[
            1, 0, 1, 0, 0, 0, 13, 0, 60, 0, 80, 0, 0
        ]));
        assert!(!holds_a_publish(&[1, 0, 0, 0, 0, 1, 0, 0, 10, 0, 11, 0, 0]));
    }
}
