//! The engine: one task that owns the relay's state machines and wires them together. It
//! reacts to one closed set of wake-ups ([`Wake`]) in one `match` ([`Engine::handle`]) and
//! then starts whatever became due ([`Engine::pump`]).
//!
//! The state machines live beside it, each in its own file with no IO: the claim pass
//! (`pass`), the leases (`leases`), wake-up pacing (`pacing`), the per-key hand (`hand`)
//! and the batched writers for marks and failures (`writer`). Database round trips and the
//! AMQP connect run as futures the engine polls (so a slow mark never stops confirms from
//! being handled); what they return comes back as [`Done`].
//!
//! Invariants: rows are marked dispatched only from the [`Acked`] values of a settled batch
//! (ARCHITECTURE.md, "6. Mark"); a lost session's rows are failed (pending, retried) and its
//! late reports ignored; nothing is published or claimed while stopping.

use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::mpsc;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tokio_util::time::DelayQueue;

use outbox_kit::amqp::AmqpError;
use outbox_kit::db::DbError;

use super::claim::{self, Claimed, Failure, FailureKind, LeaseRound, Recorded};
use super::hand::Hand;
use super::key::Key;
use super::leases::Leases;
use super::listen::ListenEvent;
use super::pacing::Pacing;
use super::pass::Pass;
use super::publish::{self, Acked, Session, SessionConfig, SettledBatch};
use super::writer::{Retry, Writer};
use super::{Deps, Identity, OnPark, RelayConfig, RelayError};
use crate::telemetry::Telemetry;
use crate::trace::Stage;

mod done;
mod settle;

/// Most rows of one key per claim.
const MAX_PER_KEY: usize = 64;

/// Everything that can cause work. One `match` handles them all (`Engine::handle`).
enum Wake {
    Shutdown,
    Done(Box<Done>),
    Settled(SettledBatch),
    Listen(ListenEvent),
    RetryDue(Key),
    Tick,
    LeaseTick,
    SessionLost,
    Timer,
}

/// A finished database round trip or AMQP connect.
enum Done {
    Claim(ClaimMeta, Result<Claimed, DbError>),
    Mark(Vec<(Key, Acked)>, Result<u64, DbError>),
    Failures(Vec<(Key, Failure)>, Result<Vec<(i64, Recorded)>, DbError>),
    Lease(Instant, Vec<i32>, Result<LeaseRound, DbError>),
    Wakeup(bool, Result<(), DbError>),
    Connected(u64, Result<Session, AmqpError>),
}

struct ClaimMeta {
    limit: usize,
    /// A sweep claim (below the cursor), not a forward one.
    sweeping: bool,
}

/// The relay's state: the state machines, the AMQP session, and the round trips in flight.
pub(super) struct Engine {
    message_options: publish::MessageOptions,
    cfg: RelayConfig,
    deps: Deps,
    tel: Telemetry,
    id: Identity,
    hand: Hand,
    leases: Leases,
    pass: Pass,
    pacing: Pacing,
    marks: Writer<(Key, Acked)>,
    failures: Writer<(Key, Failure)>,
    session: Option<Session>,
    generation: u64,
    connecting: bool,
    amqp: Retry,
    settled_tx: mpsc::UnboundedSender<SettledBatch>,
    ops: FuturesUnordered<BoxFuture<'static, Done>>,
    retries: DelayQueue<Key>,
    stopping: Option<Instant>,
    /// Rows published and acked since start.
    published: u64,
    /// The last database round trip failed.
    pg_down: bool,
}

impl Engine {
    pub(super) fn new(deps: Deps, cfg: RelayConfig, id: Identity) -> Engine {
        let (settled_tx, _) = mpsc::unbounded_channel();
        Engine {
            message_options: publish::MessageOptions {
                cloudevents_source: cfg.cloudevents_source.clone(),
            },
            tel: deps.telemetry.clone(),
            hand: Hand::default(),
            leases: Leases::new(cfg.lease),
            pass: Pass::new(),
            pacing: Pacing::new(cfg.listen),
            marks: Writer::new("mark dispatched"),
            failures: Writer::new("record failures"),
            cfg,
            deps,
            id,
            session: None,
            generation: 0,
            connecting: false,
            amqp: Retry::new("rabbitmq"),
            settled_tx,
            ops: FuturesUnordered::new(),
            retries: DelayQueue::new(),
            stopping: None,
            published: 0,
            pg_down: false,
        }
    }

    pub(super) async fn run(
        mut self,
        mut listen_rx: mpsc::Receiver<ListenEvent>,
        shutdown: CancellationToken,
    ) -> Result<(), RelayError> {
        let (settled_tx, mut settled_rx) = mpsc::unbounded_channel();
        self.settled_tx = settled_tx;
        let mut tick = tokio::time::interval(self.cfg.poll_interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut lease_tick = tokio::time::interval(self.cfg.lease / 3);
        lease_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut fatal = None;

        loop {
            if let Err(e) = self.pump() {
                fatal = Some(e);
                break;
            }
            if self.finished() {
                break;
            }
            let timer = self.next_deadline();
            let wake = tokio::select! {
                biased;
                _ = shutdown.cancelled(), if self.stopping.is_none() => Wake::Shutdown,
                Some(batch) = settled_rx.recv() => Wake::Settled(batch),
                Some(done) = self.ops.next(), if !self.ops.is_empty() => Wake::Done(Box::new(done)),
                _ = lost(&self.session), if self.session.as_ref().is_some_and(|_| true) => Wake::SessionLost,
                Some(ev) = listen_rx.recv() => Wake::Listen(ev),
                Some(expired) = self.retries.next(), if !self.retries.is_empty() => Wake::RetryDue(expired.into_inner()),
                _ = tick.tick() => Wake::Tick,
                _ = lease_tick.tick() => Wake::LeaseTick,
                _ = sleep_until(timer) => Wake::Timer,
            };
            if let Err(e) = self.handle(wake, &mut settled_rx) {
                fatal = Some(e);
                break;
            }
        }
        self.finish().await;
        match fatal {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Stopping, and nothing is left to wait for (or the shutdown timeout passed).
    fn finished(&self) -> bool {
        let Some(deadline) = self.stopping else {
            return false;
        };
        let idle = self.hand.in_flight() == 0 && self.marks.is_idle() && self.failures.is_idle();
        idle || self.session.is_none() && self.marks.is_idle() || Instant::now() >= deadline
    }

    async fn finish(&mut self) {
        self.tel.shutdown_finished(
            self.hand.in_flight(),
            self.marks.pending() + self.hand.awaiting_mark(),
        );
        if self.stopping.is_some() {
            let _ = tokio::time::timeout(
                Duration::from_secs(3),
                claim::leave(&self.deps.pool, &self.id.relay_id),
            )
            .await;
        }
        if let Some(session) = self.session.take() {
            session.close().await;
        }
        if let Some(t) = self.tel.stage_trace() {
            t.flush();
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let amqp = (self.session.is_none() && !self.connecting)
            .then(|| self.amqp.not_before())
            .flatten();
        [
            amqp,
            self.pass.next_due(),
            self.marks.next_due(),
            self.failures.next_due(),
            self.leases.next_expiry(),
            self.stopping,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Starts whatever is due: connect, publish, claim, mark, record, wake-up flag.
    fn pump(&mut self) -> Result<(), RelayError> {
        let now = Instant::now();
        let expired = self.leases.expire(now, &mut self.hand);
        if expired > 0 {
            self.tel.leases_changed(self.leases.len(), 0, expired, 0, 0);
        }
        let held = self.hand.held_keys();
        self.tel.keys_held(held.nack, held.returned);

        if self.session.is_none()
            && !self.connecting
            && self.stopping.is_none()
            && self.amqp.ready(now)
        {
            self.connect();
        }

        if self.stopping.is_none() {
            self.start_claim(now);
            self.publish_ready(now);
        }

        if let Some(batch) = self.marks.start(now) {
            let pool = self.deps.pool.clone();
            let trace = self.tel.stage_trace().cloned();
            self.ops.push(
                async move {
                    if let Some(t) = &trace {
                        t.record(Stage::MarkSent, []);
                    }
                    let result = claim::mark_dispatched(&pool, batch.iter().map(|(_, a)| a)).await;
                    if let (Some(t), Ok(_)) = (&trace, &result) {
                        t.record(Stage::Marked, batch.iter().map(|(_, a)| a.row_id()));
                    }
                    Done::Mark(batch, result)
                }
                .boxed(),
            );
        }

        if let Some(batch) = self.failures.start(now) {
            let pool = self.deps.pool.clone();
            let max = self.cfg.max_attempts.get().min(i32::MAX as u32) as i32;
            let block_key = self.cfg.on_park == OnPark::BlockKey;
            let relay = self.id.relay_id.clone();
            let leases = self.leases.epochs();
            self.ops.push(
                async move {
                    let failures: Vec<Failure> = batch.iter().map(|(_, f)| f.clone()).collect();
                    let result =
                        claim::record_failures(&pool, &failures, max, block_key, &relay, &leases)
                            .await;
                    Done::Failures(batch, result)
                }
                .boxed(),
            );
        }

        if let Some(wanted) = self
            .pacing
            .wakeup_due(self.leases.registered(), self.stopping.is_some())
        {
            let pool = self.deps.pool.clone();
            let relay_id = self.id.relay_id.clone();
            self.ops.push(async move { Done::Wakeup(wanted, claim::set_wakeup(&pool, &relay_id, wanted).await) }.boxed());
        }
        Ok(())
    }

    fn connect(&mut self) {
        self.connecting = true;
        self.generation += 1;
        let generation = self.generation;
        let target = self.deps.amqp.clone();
        let config = SessionConfig {
            exchange: self.cfg.exchange.clone(),
            declare_exchange: self.cfg.declare_exchange,
            channels: self.cfg.channels.get(),
            confirm_timeout: self.cfg.confirm_timeout,
            connection_name: self.id.connection_name.clone(),
        };
        let tx = self.settled_tx.clone();
        self.ops.push(
            async move {
                Done::Connected(
                    generation,
                    Session::open(&target, &config, generation, tx).await,
                )
            }
            .boxed(),
        );
    }

    fn publish_ready(&mut self, now: Instant) {
        let Some(session) = self.session.as_ref() else {
            return;
        };
        if session.is_lost() {
            return;
        }
        let window = self.cfg.confirm_window.get();
        let max_message = self.cfg.max_message_bytes.get();
        let (mut sent, mut refused) = (0, 0);
        let tracing = self.tel.stage_trace().is_some();
        let mut traced = Vec::new();
        while self.hand.in_flight() < window {
            let leases = &self.leases;
            let Some(row) = self.hand.next_ready(|p| leases.sendable(now, p)) else {
                break;
            };
            let (key, id, partition) = (row.key(), row.id, row.partition);
            match publish::prepare(row, max_message, &self.message_options) {
                Ok(message) => {
                    session.publish(partition, message);
                    sent += 1;
                    if tracing {
                        traced.push(id);
                    }
                }
                Err(refusal) => {
                    refused += 1;
                    self.hand.refuse(&key, id);
                    self.failures.push((
                        key,
                        Failure {
                            id,
                            kind: FailureKind::ParkNow,
                            reason: refusal.to_string(),
                        },
                    ));
                }
            }
        }
        if sent > 0 {
            self.tel.published(sent, self.hand.in_flight());
            if let Some(t) = self.tel.stage_trace() {
                t.record(Stage::Published, traced);
            }
        }
        if refused > 0 {
            self.tel.rows_refused(refused);
        }
    }

    fn start_claim(&mut self, now: Instant) {
        if !self.pass.due(now) || self.session.is_none() || self.leases.is_empty() {
            return;
        }
        let batch = self.cfg.batch_size.get();
        let max_held = batch * 2 + self.cfg.confirm_window.get();
        let room = max_held.saturating_sub(self.hand.rows());
        let bytes_room = self
            .cfg
            .max_in_memory_bytes
            .get()
            .saturating_sub(self.hand.bytes());
        if room < (batch / 4).max(1) && self.hand.rows() > 0 || bytes_room == 0 {
            return; // full: claims resume as rows are marked
        }
        let limit = room.min(batch);
        let per_key = MAX_PER_KEY.min(limit);
        let plan = self.pass.start(now, limit, self.cfg.late_commit_window);
        let sweeping = plan.sweeping;
        let held = self.hand.claim_started();
        let pool = self.deps.pool.clone();
        let relay_id = self.id.relay_id.clone();
        let block = self.cfg.on_park == OnPark::BlockKey;
        let max_message = self.cfg.max_message_bytes.get();
        let trace = self.tel.stage_trace().cloned();
        self.ops.push(
            async move {
                if let Some(t) = &trace {
                    t.record(Stage::ClaimSent, []);
                }
                let req = claim::ClaimRequest {
                    relay_id: &relay_id,
                    after: plan.after,
                    before: plan.before,
                    limit,
                    per_key,
                    block_parked_keys: block,
                    max_message_bytes: max_message,
                    max_bytes: bytes_room,
                    keys: &plan.keys,
                    held: &held,
                };
                let result = claim::claim(&pool, req).await;
                if let (Some(t), Ok(claimed)) = (&trace, &result) {
                    t.record(Stage::ClaimReturned, claimed.rows.iter().map(|r| r.id));
                }
                Done::Claim(ClaimMeta { limit, sweeping }, result)
            }
            .boxed(),
        );
    }

    fn handle(
        &mut self,
        wake: Wake,
        settled_rx: &mut mpsc::UnboundedReceiver<SettledBatch>,
    ) -> Result<(), RelayError> {
        match wake {
            Wake::Shutdown => {
                self.tel.shutdown_started(self.hand.in_flight());
                self.stopping = Some(Instant::now() + self.cfg.shutdown_timeout);
            }
            Wake::Done(done) => return self.done(*done),
            Wake::Settled(batch) => self.settled(batch),
            Wake::Listen(ListenEvent::Connected) => {
                self.pacing.listen_up(true);
                self.pass.want();
            }
            Wake::Listen(ListenEvent::Notified) => {
                if let Some(t) = self.tel.stage_trace() {
                    t.record(Stage::Notified, []);
                }
                self.pacing.notified();
                self.pass.want();
            }
            Wake::Listen(ListenEvent::Lost) => self.pacing.listen_up(false),
            Wake::RetryDue(key) => self.hand.retry_due(&key),
            Wake::Tick => self.pass.want_sweep(),
            Wake::LeaseTick => self.start_lease(),
            Wake::SessionLost => {
                // Decisions the lanes made before the loss still count.
                while let Ok(batch) = settled_rx.try_recv() {
                    self.settled(batch);
                }
                self.session_lost();
            }
            Wake::Timer => {}
        }
        Ok(())
    }

    fn session_lost(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        let in_flight = self.hand.in_flight_rows();
        let why = session.lost_why().to_owned();
        self.tel
            .amqp_session_lost(session.generation(), in_flight.len(), &why);
        for (key, id) in in_flight {
            self.hand.failed(&key, id);
            self.failures.push((
                key,
                Failure {
                    id,
                    kind: FailureKind::Transient,
                    reason: "amqp connection lost before the broker confirmed".into(),
                },
            ));
        }
        self.amqp.failed(&format!("session lost: {why}"));
        tokio::spawn(session.close());
    }

    fn start_lease(&mut self) {
        let Some(release) = self.leases.start_round() else {
            return;
        };
        let pool = self.deps.pool.clone();
        let id = self.id.clone();
        let lease_secs = self.cfg.lease.as_secs_f64();
        let acquire = self.stopping.is_none();
        let wants_wakeup = self.cfg.listen;
        let published = self.published as i64;
        self.ops.push(
            async move {
                let sent = Instant::now();
                let req = claim::LeaseRequest {
                    relay_id: &id.relay_id,
                    host: &id.host,
                    pid: id.pid,
                    lease_secs,
                    release: release.clone(),
                    acquire,
                    wants_wakeup,
                    published,
                };
                let result = claim::lease(&pool, &req).await;
                Done::Lease(sent, release, result)
            }
            .boxed(),
        );
    }
}

async fn lost(session: &Option<Session>) {
    match session {
        Some(s) => s.lost().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
