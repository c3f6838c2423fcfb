//! The fault schedule played: [`World`] holds what faults act on (process slots, proxies,
//! the destination's book), [`World::inject`] injects one fault and waits until it is
//! over, [`World::heal`] undoes everything after the schedule, and [`play`] runs the
//! schedule, one task per fault, recording what happened to each.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_kit::amqp::AmqpTarget;
use outbox_kit::contract::Schema;
use outbox_kit::db::DbTarget;
use outbox_testkit::proxy::Mode;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_postgres::Client;

use crate::destination::{self, Book};
use crate::procs::{self, Slot};
use crate::producer::now_ms;
use crate::schedule::{Fault, Planned, Service, Target};
use crate::tap;

use super::FaultRecord;
use super::setup::{Proxies, app_name};

/// Everything the fault tasks act on.
pub(super) struct World {
    pub(super) db_name: String,
    pub(super) exchange: String,
    pub(super) amqp: AmqpTarget,
    pub(super) target: DbTarget,
    pub(super) relays: Vec<Slot>,
    pub(super) consumers: Vec<Slot>,
    pub(super) proxies: Proxies,
    pub(super) book: Arc<Book>,
    pub(super) crash_points: Vec<Notify>,
    pub(super) host: String,
    pub(super) injected_copies: Mutex<usize>,
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

    /// Injects one fault and waits until it is over; returns a note.
    async fn inject(&self, fault: &Fault, client: &Client) -> anyhow::Result<(bool, String)> {
        match fault {
            Fault::KillRelay { relay, down_ms } => {
                let slot = &self.relays[*relay];
                slot.set_faulted(true).await;
                slot.signal("KILL").await?;
                slot.wait_exit(Duration::from_secs(10)).await?;
                tokio::time::sleep(Duration::from_millis(*down_ms)).await;
                let pid = slot.start().await?;
                Ok((true, format!("restarted as pid {pid}")))
            }
            Fault::PauseRelay { relay, pause_ms } => {
                let slot = &self.relays[*relay];
                slot.set_faulted(true).await;
                slot.signal("STOP").await?;
                tokio::time::sleep(Duration::from_millis(*pause_ms)).await;
                slot.signal("CONT").await?;
                slot.set_faulted(false).await;
                Ok((true, String::new()))
            }
            Fault::CloseAmqp { target } => {
                let Some(name) = self.connection_name(*target).await else {
                    return Ok((false, "process not running".into()));
                };
                let closed = procs::close_connections(&name).await?;
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
                let n = tap::publish_copies(&self.amqp, client, &self.exchange, *count).await?;
                *self.injected_copies.lock().unwrap() += n;
                Ok((n > 0, format!("{n} copies confirmed by the broker")))
            }
        }
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
            // A connection per fault, only while it runs: a long schedule has hundreds.
            let injected = match w
                .target
                .connect(&Schema::default(), "outbox-soak-faults")
                .await
            {
                Ok(c) => w.inject(&p.fault, &c).await,
                Err(e) => Err(e.into()),
            };
            let (injected, note) = match injected {
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
