//! The relay: claims committed outbox rows, publishes them with confirms, marks them
//! dispatched after the broker's ack, retries and parks.
//!
//! One engine task owns all state and reacts to one closed set of wake-ups ([`Wake`]) in
//! one `match`. Database round trips and the AMQP connect run as futures the engine polls
//! (so a slow mark never stops confirms from being handled); the LISTEN connection and the
//! AMQP lanes are tasks that report back through channels.
//!
//! Data path: `listen` (hint) → `claim` (rows of leased partitions, seq assigned) →
//! `hand` (per-key queues, one unconfirmed message per key) → `publish` (lanes, confirms,
//! returns matched by message_id) → `claim::mark_dispatched` (only from `Acked`).
//!
//! Architecture invariant: nothing here reads the environment or argv; `run` takes its
//! connections, its configuration and its shutdown signal from the caller.

pub mod claim;
pub mod hand;
pub mod listen;
pub mod publish;
pub mod retention;

use std::collections::{HashMap, HashSet, VecDeque};
use std::num::{NonZeroU32, NonZeroUsize};
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tokio_util::time::DelayQueue;

use outbox_kit::contract::Schema;
use outbox_kit::db::{DbError, DbTarget, deadline};
use outbox_kit::down::Down;

use crate::telemetry::{SettledCounts, Telemetry};
use claim::{Claimed, Failure, FailureKind, LeaseRound, Recorded};
use hand::{Hand, Key};
use listen::ListenEvent;
use outbox_kit::amqp::{AmqpError, AmqpTarget};
use outbox_kit::backoff::Backoff;
use publish::{Acked, Outcome, Session, SessionConfig, SettledBatch};

/// What a parked row does to the later rows of its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnPark {
    /// The key's later rows go on; consumers see a gap in x-outbox-seq.
    Continue,
    /// The key waits until an operator re-drives or deletes the parked row.
    BlockKey,
}

/// The relay's settings (see README for each flag).
#[derive(Clone, Debug)]
pub struct RelayConfig {
    pub exchange: String,
    pub declare_exchange: bool,
    pub batch_size: NonZeroUsize,
    pub poll_interval: Duration,
    /// How far back forward claims read again while they keep up (see `Pass`).
    pub late_commit_window: Duration,
    pub listen: bool,
    pub max_attempts: NonZeroU32,
    pub max_message_bytes: NonZeroUsize,
    pub shutdown_timeout: Duration,
    pub confirm_timeout: Duration,
    pub confirm_window: NonZeroUsize,
    pub channels: NonZeroUsize,
    pub lease: Duration,
    pub on_park: OnPark,
    pub retry_min: Duration,
    pub retry_max: Duration,
    pub max_in_memory_bytes: NonZeroUsize,
    /// Delete dispatched rows older than this (`--retention`); `None` keeps them.
    pub retention: Option<Duration>,
    /// `--cloudevents`: the CloudEvents `source` to publish with; `None` adds no such headers.
    pub cloudevents_source: Option<String>,
}

impl RelayConfig {
    /// Defaults as documented, publishing to `exchange`.
    pub fn new(exchange: &str) -> RelayConfig {
        RelayConfig {
            exchange: exchange.to_owned(),
            declare_exchange: true,
            batch_size: NonZeroUsize::new(500).expect("non-zero"),
            poll_interval: Duration::from_secs(1),
            late_commit_window: Duration::from_millis(100),
            listen: true,
            max_attempts: NonZeroU32::new(10).expect("non-zero"),
            max_message_bytes: NonZeroUsize::new(1 << 20).expect("non-zero"),
            shutdown_timeout: Duration::from_secs(10),
            confirm_timeout: Duration::from_secs(15),
            confirm_window: NonZeroUsize::new(1024).expect("non-zero"),
            channels: NonZeroUsize::new(2).expect("non-zero"),
            lease: Duration::from_secs(15),
            on_park: OnPark::Continue,
            retry_min: Duration::from_millis(500),
            retry_max: Duration::from_secs(60),
            max_in_memory_bytes: NonZeroUsize::new(64 << 20).expect("non-zero"),
            retention: None,
            cloudevents_source: None,
        }
    }
}

/// The connections the relay runs on.
#[derive(Clone)]
pub struct Deps {
    /// Pooled connections with `search_path` set to the schema (see `DbTarget::pool`).
    pub pool: Pool,
    /// For the dedicated LISTEN connection.
    pub db: DbTarget,
    pub schema: Schema,
    pub amqp: AmqpTarget,
    /// Where this relay logs and counts (one per relay; `Telemetry::default()` is fine).
    pub telemetry: Telemetry,
}

/// A failure retries cannot fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The schema has no outbox tables and functions.
    #[error(
        "schema '{0}' has no outbox tables: run `outbox-relay migrate` (or start without --no-migrate)"
    )]
    NotMigrated(String),
    /// The database refused a statement for a reason waiting will not fix (permissions,
    /// a changed schema).
    #[error("database refused the relay: {0}")]
    Refused(String),
}

/// Who this relay is, in the database and at the broker.
#[derive(Clone, Debug)]
pub struct Identity {
    pub relay_id: String,
    pub host: String,
    pub pid: i32,
    pub connection_name: String,
}

impl Identity {
    pub fn of_this_process() -> Identity {
        use std::hash::{BuildHasher, Hasher};
        let host = hostname();
        let pid = std::process::id();
        // A random suffix tells apart two relays that reuse a pid on one host.
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
            & 0xffff_ffff;
        Identity {
            relay_id: format!("{host}:{pid}:{random:08x}"),
            host: host.clone(),
            pid: pid as i32,
            connection_name: format!("outbox-relay@{host}:{pid}"),
        }
    }
}

fn hostname() -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

/// New rows in one claim that mark the relay as busy: rows arrive faster than a NOTIFY per
/// transaction is worth; it turns the insert wake-up off and polls back to back.
const BUSY_CLAIM_ROWS: usize = 8;
/// Busy and a poll came back empty: the next one after this gap.
const BUSY_POLL_GAP: Duration = Duration::from_millis(5);
/// Busy polls empty for this long: idle again (the wake-up goes back on).
const IDLE_AFTER: Duration = Duration::from_millis(50);
/// Most rows of one key per claim.
const MAX_PER_KEY: usize = 64;
/// Forward claims remembered for that (claims run at most every millisecond or so).
const MAX_PASSED: usize = 256;

/// Runs the relay until `shutdown` is cancelled, then drains in-flight confirms (up to
/// `config.shutdown_timeout`), marks what was acked and returns.
pub async fn run(
    deps: Deps,
    config: RelayConfig,
    shutdown: CancellationToken,
) -> Result<(), RelayError> {
    run_as(deps, config, Identity::of_this_process(), shutdown).await
}

/// Whether autovacuum will clean outbox_events (server setting and table option).
const CHECK_AUTOVACUUM: &str = "SELECT current_setting('autovacuum') = 'on'
   AND NOT coalesce((SELECT 'autovacuum_enabled=false' = ANY (reloptions) FROM pg_class
                      WHERE oid = to_regclass('outbox_events')), false)";

const CHECK_SCHEMA: &str = "SELECT to_regprocedure('outbox_claim(text,bigint,integer,integer,boolean,integer,bigint,text[],text[],bigint,bigint[])') IS NOT NULL
   AND to_regprocedure('outbox_set_wakeup(text,boolean)') IS NOT NULL";

/// [`run`] with an explicit identity (tests run several relays in one process).
pub async fn run_as(
    deps: Deps,
    config: RelayConfig,
    id: Identity,
    shutdown: CancellationToken,
) -> Result<(), RelayError> {
    // Fail fast on a schema that was never migrated; everything else is retried.
    let mut down = Down::new("postgres");
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        let checked = async {
            let client = deadline(deps.pool.get()).await?;
            deadline(client.query_one(CHECK_SCHEMA, &[])).await
        }
        .await;
        match checked {
            Ok(row) if row.get::<_, bool>(0) => break,
            Ok(_) => return Err(RelayError::NotMigrated(deps.schema.to_string())),
            Err(e) if e.is_transient() => {
                let delay = backoff.next_delay();
                down.failed(&e, delay);
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
            Err(e) => return Err(RelayError::Refused(e.to_string())),
        }
    }
    down.recovered();
    if let Ok(client) = deadline(deps.pool.get()).await
        && let Ok(row) = deadline(client.query_one(CHECK_AUTOVACUUM, &[])).await
        && !row.get::<_, bool>(0)
    {
        deps.telemetry.autovacuum_off();
    }
    deps.telemetry
        .relay_started(&id.relay_id, &config.exchange, &deps.amqp, config.listen);
    deps.telemetry.postgres_state(true);

    let (listen_tx, listen_rx) = mpsc::channel(16);
    let listener_stop = shutdown.child_token();
    let listener = config.listen.then(|| {
        tokio::spawn(listen::run(
            deps.db.clone(),
            deps.schema.clone(),
            listen_tx,
            deps.telemetry.clone(),
            listener_stop.clone(),
        ))
    });
    let retention = config.retention.map(|age| {
        tokio::spawn(retention::run(
            deps.pool.clone(),
            age,
            deps.telemetry.clone(),
            listener_stop.clone(),
        ))
    });
    let engine = Engine::new(deps, config, id);
    let result = engine.run(listen_rx, shutdown).await;
    listener_stop.cancel();
    for task in [listener, retention].into_iter().flatten() {
        let _ = task.await;
    }
    result
}

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

#[derive(Debug)]
struct HeldLease {
    epoch: i64,
    valid_until: Instant,
    releasing: bool,
}

/// Where claims read. Claims read forward from a cursor (cheap: only rows not seen yet).
/// Every poll tick, after gaining partitions and after a failed claim, a sweep reads the
/// range below the cursor again from the first pending row, in claims that alternate with
/// forward ones, so a row that committed late with a lower id is found within about one poll
/// interval (no high-water mark on id) and a sweep never sets the forward cursor back.
///
/// Most late rows are only a little late: a producer's transaction takes its row's id at
/// the INSERT and commits a few milliseconds later, while other producers' rows with higher
/// ids are claimed. At 1,000 events/s from 8 producers that was over 1% of the rows, each
/// waiting for the next sweep (p99 latency 300-500 ms with a 1 s poll interval). So while
/// claims keep up (the last forward claim reached the end), a forward claim reads again
/// the ids that forward claims passed within the last `--late-commit-window`: the rows the
/// relay holds there are left out by the claim itself, so what it finds are the rows that
/// committed after their id was passed.
#[derive(Debug, Default)]
struct Pass {
    cursor: i64,
    /// When each of the last forward claims returned and the cursor it passed from,
    /// oldest first.
    passed: VecDeque<(Instant, i64)>,
    /// The last forward claim reached the end of the pending rows.
    caught_up: bool,
    /// Claim as soon as possible.
    wanted: bool,
    /// A sweep was asked for; it starts when none is running.
    sweep_wanted: bool,
    /// The running sweep: where it is, and where it stops.
    sweep: Option<(i64, i64)>,
    /// The last claim was a sweep claim: the next one reads forward.
    last_was_sweep: bool,
    /// Busy polling: the next claim waits until then.
    not_before: Option<Instant>,
}

impl Pass {
    /// Where the next forward claim starts: the cursor, or while claims keep up, where the
    /// forward claims of the last `window` started.
    fn forward_from(&mut self, now: Instant, window: Duration) -> i64 {
        while self
            .passed
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > window)
        {
            self.passed.pop_front();
        }
        match self.passed.front() {
            Some((_, from)) if self.caught_up => (*from).min(self.cursor),
            _ => self.cursor,
        }
    }

    /// A forward claim returned `scanned_to`; it passed the ids from the cursor up to there.
    fn forward_done(&mut self, now: Instant, scanned_to: i64, reached_end: bool) {
        let from = self.cursor;
        // A claim that stopped early (its limit) goes on from where it stopped, even below
        // the cursor when it started from further back; one that read to the end never
        // moves the cursor back.
        self.cursor = if reached_end {
            self.cursor.max(scanned_to)
        } else {
            scanned_to
        };
        self.caught_up = reached_end;
        if self.passed.len() == MAX_PASSED {
            self.passed.pop_front();
        }
        self.passed.push_back((now, from));
    }
}

/// When an operation that failed may run again.
struct Retry {
    backoff: Backoff,
    not_before: Option<Instant>,
    down: Down,
}

impl Retry {
    fn new(what: &'static str) -> Retry {
        Retry {
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(10)),
            not_before: None,
            down: Down::new(what),
        }
    }

    fn ready(&self, now: Instant) -> bool {
        self.not_before.is_none_or(|t| t <= now)
    }

    fn failed(&mut self, e: &dyn std::fmt::Display) {
        let delay = self.backoff.next_delay();
        self.down.failed(e, delay);
        self.not_before = Some(Instant::now() + delay);
    }

    fn ok(&mut self) {
        self.backoff.reset();
        self.not_before = None;
        self.down.recovered();
    }
}

struct Engine {
    message_options: publish::MessageOptions,
    cfg: RelayConfig,
    deps: Deps,
    tel: Telemetry,
    id: Identity,
    hand: Hand,
    leases: HashMap<u8, HeldLease>,
    release_next: Vec<i32>,
    registered: bool,
    session: Option<Session>,
    generation: u64,
    connecting: bool,
    amqp: Retry,
    settled_tx: mpsc::UnboundedSender<SettledBatch>,
    pass: Pass,
    claim_busy: bool,
    claim_retry: Retry,
    marks: Vec<(Key, Acked)>,
    mark_busy: bool,
    mark_retry: Retry,
    failures: Vec<(Key, Failure)>,
    failure_busy: bool,
    failure_retry: Retry,
    lease_busy: bool,
    wakeup_wanted: bool,
    wakeup_db: Option<bool>,
    wakeup_busy: bool,
    ops: FuturesUnordered<BoxFuture<'static, Done>>,
    retries: DelayQueue<Key>,
    stopping: Option<Instant>,
    /// Rows published and acked since start.
    published: u64,
    /// LISTEN is connected (as last reported by the listener).
    listen_up: bool,
    /// A NOTIFY arrived since the last claim started.
    notified: bool,
    /// The last database round trip failed.
    pg_down: bool,
    /// Rows keep coming: the relay polls back to back with the insert wake-up off.
    busy: bool,
    /// Busy, and claims have come back empty since then.
    empty_since: Option<Instant>,
    /// Keys whose held rows all went out while more of theirs may be pending: the next
    /// claim asks for them by name, wherever the cursor is.
    continue_keys: HashSet<Key>,
}

impl Engine {
    fn new(deps: Deps, cfg: RelayConfig, id: Identity) -> Engine {
        let (settled_tx, _) = mpsc::unbounded_channel();
        Engine {
            message_options: publish::MessageOptions {
                cloudevents_source: cfg.cloudevents_source.clone(),
            },
            wakeup_wanted: cfg.listen,
            tel: deps.telemetry.clone(),
            cfg,
            deps,
            id,
            hand: Hand::default(),
            leases: HashMap::new(),
            release_next: Vec::new(),
            registered: false,
            session: None,
            generation: 0,
            connecting: false,
            amqp: Retry::new("rabbitmq"),
            settled_tx,
            pass: Pass {
                wanted: true,
                sweep_wanted: true,
                ..Pass::default()
            },
            claim_busy: false,
            claim_retry: Retry::new("claim"),
            marks: Vec::new(),
            mark_busy: false,
            mark_retry: Retry::new("mark dispatched"),
            failures: Vec::new(),
            failure_busy: false,
            failure_retry: Retry::new("record failures"),
            lease_busy: false,
            wakeup_db: None,
            wakeup_busy: false,
            ops: FuturesUnordered::new(),
            retries: DelayQueue::new(),
            stopping: None,
            published: 0,
            listen_up: false,
            notified: false,
            pg_down: false,
            busy: false,
            empty_since: None,
            continue_keys: HashSet::new(),
        }
    }

    async fn run(
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
        let idle = self.hand.in_flight() == 0
            && self.marks.is_empty()
            && !self.mark_busy
            && self.failures.is_empty()
            && !self.failure_busy;
        idle || self.session.is_none() && self.marks.is_empty() && !self.mark_busy
            || Instant::now() >= deadline
    }

    async fn finish(&mut self) {
        self.tel.shutdown_finished(
            self.hand.in_flight(),
            self.marks.len() + self.hand.awaiting_mark(),
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
    }

    fn next_deadline(&self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut consider = |t: Option<Instant>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        };
        if self.session.is_none() && !self.connecting {
            consider(self.amqp.not_before);
        }
        if self.pass.wanted {
            consider(self.claim_retry.not_before);
            consider(self.pass.not_before);
        }
        if !self.marks.is_empty() {
            consider(self.mark_retry.not_before);
        }
        if !self.failures.is_empty() {
            consider(self.failure_retry.not_before);
        }
        consider(self.leases.values().map(|l| l.valid_until).min());
        consider(self.stopping);
        next
    }

    /// Starts whatever is due: connect, publish, claim, mark, record, wake-up flag.
    fn pump(&mut self) -> Result<(), RelayError> {
        let now = Instant::now();
        self.expire_leases(now);

        if self.session.is_none()
            && !self.connecting
            && self.stopping.is_none()
            && self.amqp.ready(now)
        {
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

        if self.stopping.is_none() {
            self.start_claim(now);
            self.publish_ready(now);
        }

        if !self.mark_busy && !self.marks.is_empty() && self.mark_retry.ready(now) {
            self.mark_busy = true;
            let batch = std::mem::take(&mut self.marks);
            let pool = self.deps.pool.clone();
            self.ops.push(
                async move {
                    let result = claim::mark_dispatched(&pool, batch.iter().map(|(_, a)| a)).await;
                    Done::Mark(batch, result)
                }
                .boxed(),
            );
        }

        if !self.failure_busy && !self.failures.is_empty() && self.failure_retry.ready(now) {
            self.failure_busy = true;
            let batch = std::mem::take(&mut self.failures);
            let pool = self.deps.pool.clone();
            let max = self.cfg.max_attempts.get().min(i32::MAX as u32) as i32;
            let block_key = self.cfg.on_park == OnPark::BlockKey;
            self.ops.push(
                async move {
                    let failures: Vec<Failure> = batch.iter().map(|(_, f)| f.clone()).collect();
                    let result = claim::record_failures(&pool, &failures, max, block_key).await;
                    Done::Failures(batch, result)
                }
                .boxed(),
            );
        }

        if self.cfg.listen
            && self.registered
            && !self.wakeup_busy
            && self.stopping.is_none()
            && self.wakeup_db != Some(self.wakeup_wanted)
        {
            self.wakeup_busy = true;
            let wanted = self.wakeup_wanted;
            let pool = self.deps.pool.clone();
            let relay_id = self.id.relay_id.clone();
            self.ops.push(async move { Done::Wakeup(wanted, claim::set_wakeup(&pool, &relay_id, wanted).await) }.boxed());
        }
        Ok(())
    }

    fn sendable(leases: &HashMap<u8, HeldLease>, now: Instant, partition: u8) -> bool {
        leases
            .get(&partition)
            .is_some_and(|l| !l.releasing && l.valid_until > now)
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
        while self.hand.in_flight() < window {
            let leases = &self.leases;
            let Some(row) = self.hand.next_ready(|p| Engine::sendable(leases, now, p)) else {
                break;
            };
            let (key, id, partition) = (Key::of(row), row.id, row.partition);
            match publish::prepare(row, max_message, &self.message_options) {
                Ok(message) => {
                    session.publish(partition, message);
                    sent += 1;
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
        }
        if refused > 0 {
            self.tel.rows_refused(refused);
        }
    }

    fn start_claim(&mut self, now: Instant) {
        if self.claim_busy
            || !(self.pass.wanted || self.pass.sweep_wanted || self.pass.sweep.is_some())
            || self.session.is_none()
            || self.leases.is_empty()
            || !self.claim_retry.ready(now)
            || self.pass.not_before.is_some_and(|t| t > now)
        {
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
        self.claim_busy = true;
        self.pass.not_before = None;
        if std::mem::take(&mut self.pass.sweep_wanted) && self.pass.sweep.is_none() {
            self.pass.sweep = Some((0, self.pass.cursor));
        }
        // Sweep and forward claims alternate while a sweep runs. A sweep claim leaves a
        // forward wake-up standing: it only reads below the cursor.
        let sweeping =
            self.pass.sweep.is_some() && (!self.pass.last_was_sweep || !self.pass.wanted);
        self.pass.last_was_sweep = sweeping;
        if !sweeping {
            self.pass.wanted = false;
        }
        let (after, before) = match self.pass.sweep {
            Some((at, until)) if sweeping => (at, Some(until)),
            _ => (
                self.pass.forward_from(now, self.cfg.late_commit_window),
                None,
            ),
        };
        // At most a quarter of the claim goes to keys asked for by name.
        let named: Vec<Key> = self
            .continue_keys
            .iter()
            .take((limit / 4).max(1))
            .cloned()
            .collect();
        for k in &named {
            self.continue_keys.remove(k);
        }
        let held = self.hand.claim_started();
        let pool = self.deps.pool.clone();
        let relay_id = self.id.relay_id.clone();
        let block = self.cfg.on_park == OnPark::BlockKey;
        let max_message = self.cfg.max_message_bytes.get();
        self.ops.push(
            async move {
                let req = claim::ClaimRequest {
                    relay_id: &relay_id,
                    after,
                    before,
                    limit,
                    per_key,
                    block_parked_keys: block,
                    max_message_bytes: max_message,
                    max_bytes: bytes_room,
                    keys: &named,
                    held: &held,
                };
                let result = claim::claim(&pool, req).await;
                Done::Claim(ClaimMeta { limit, sweeping }, result)
            }
            .boxed(),
        );
    }

    fn expire_leases(&mut self, now: Instant) {
        let expired: Vec<u8> = self
            .leases
            .iter()
            .filter(|(_, l)| l.valid_until <= now)
            .map(|(p, _)| *p)
            .collect();
        if expired.is_empty() {
            return;
        }
        for p in &expired {
            self.leases.remove(p);
            self.hand.drop_partition(*p);
        }
        self.tel
            .leases_changed(self.leases.len(), 0, expired.len(), 0, 0);
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
                self.listen_up = true;
                self.pass.wanted = true;
            }
            Wake::Listen(ListenEvent::Notified) => {
                self.notified = true;
                self.pass.wanted = true;
            }
            Wake::Listen(ListenEvent::Lost) => self.listen_up = false,
            Wake::RetryDue(key) => self.hand.retry_due(&key),
            Wake::Tick => {
                self.pass.wanted = true;
                self.pass.sweep_wanted = true;
            }
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
        if self.lease_busy {
            return;
        }
        self.lease_busy = true;
        let pool = self.deps.pool.clone();
        let id = self.id.clone();
        let lease_secs = self.cfg.lease.as_secs_f64();
        let release = std::mem::take(&mut self.release_next);
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

    /// Readiness follows the database round trips: one failing marks Postgres down, the
    /// next that succeeds marks it up (and counts a reconnect).
    fn db_result<T>(&mut self, result: &Result<T, DbError>) {
        match result {
            Ok(_) if self.pg_down => {
                self.pg_down = false;
                self.tel.postgres_state(true);
                self.tel.postgres_reconnected();
            }
            Err(e) if e.is_transient() && !self.pg_down => {
                self.pg_down = true;
                self.tel.postgres_state(false);
            }
            _ => {}
        }
    }

    fn done(&mut self, done: Done) -> Result<(), RelayError> {
        match &done {
            Done::Claim(_, r) => self.db_result(r),
            Done::Mark(_, r) => self.db_result(r),
            Done::Failures(_, r) => self.db_result(r),
            Done::Lease(_, _, r) => self.db_result(r),
            Done::Wakeup(_, r) => self.db_result(r),
            Done::Connected(..) => {}
        }
        match done {
            Done::Connected(generation, result) => {
                self.connecting = false;
                match result {
                    Ok(session) if generation == self.generation && self.stopping.is_none() => {
                        self.amqp.ok();
                        self.tel.amqp_connected(generation, self.cfg.channels.get());
                        self.session = Some(session);
                        self.pass.wanted = true;
                    }
                    Ok(session) => {
                        tokio::spawn(session.close());
                    }
                    Err(e) => self.amqp.failed(&e),
                }
            }
            Done::Claim(meta, result) => {
                self.claim_busy = false;
                match result {
                    Ok(claimed) => {
                        self.claim_retry.ok();
                        self.claimed(meta, claimed);
                    }
                    Err(e) => {
                        self.hand.claim_returned(Vec::new(), &HashSet::new());
                        self.pass.wanted = true;
                        self.pass.sweep_wanted = true;
                        self.check_fatal(&e)?;
                        self.claim_retry.failed(&e);
                    }
                }
            }
            Done::Mark(batch, result) => {
                self.mark_busy = false;
                match result {
                    Ok(changed) => {
                        self.mark_retry.ok();
                        self.tel.rows_marked(batch.len(), changed);
                        self.hand
                            .marked(batch.iter().map(|(_, a)| (a.row_id(), a.body_bytes())));
                    }
                    Err(e) => {
                        self.check_fatal(&e)?;
                        self.mark_retry.failed(&e);
                        let mut batch = batch;
                        batch.append(&mut self.marks);
                        self.marks = batch;
                    }
                }
            }
            Done::Failures(batch, result) => {
                self.failure_busy = false;
                match result {
                    Ok(recorded) => {
                        self.failure_retry.ok();
                        self.recorded(batch, recorded);
                    }
                    Err(e) => {
                        self.check_fatal(&e)?;
                        self.failure_retry.failed(&e);
                        let mut batch = batch;
                        batch.append(&mut self.failures);
                        self.failures = batch;
                    }
                }
            }
            Done::Lease(sent, released, result) => {
                self.lease_busy = false;
                match result {
                    Ok(round) => self.leased(sent, round),
                    Err(e) => {
                        self.check_fatal(&e)?;
                        // Give back next round what we meant to give back now.
                        self.release_next.extend(released);
                        tracing::warn!(target: "outbox_relay", error = %e, "lease renewal failed; partitions stop when their lease runs out");
                    }
                }
            }
            Done::Wakeup(wanted, result) => {
                self.wakeup_busy = false;
                match result {
                    Ok(()) => {
                        self.tel.wakeup_hint(wanted);
                        self.wakeup_db = Some(wanted);
                        if wanted {
                            // Close the race with a producer that committed while the hint
                            // was off: poll once more now that it is on.
                            self.pass.wanted = true;
                        }
                    }
                    Err(e) => {
                        self.check_fatal(&e)?;
                        tracing::debug!(target: "outbox_relay", error = %e, "wake-up flag not written; trying again");
                    }
                }
            }
        }
        Ok(())
    }

    /// Transient database errors are retried by the caller; others end the relay.
    fn check_fatal(&self, e: &DbError) -> Result<(), RelayError> {
        if e.is_transient() {
            return Ok(());
        }
        if let DbError::Postgres(pg) = e
            && pg
                .code()
                .is_some_and(|c| c.code() == "42883" || c.code() == "42P01")
        {
            return Err(RelayError::NotMigrated(self.deps.schema.to_string()));
        }
        Err(RelayError::Refused(e.to_string()))
    }

    fn claimed(&mut self, meta: ClaimMeta, claimed: Claimed) {
        let mut per_key: HashMap<Key, usize> = HashMap::new();
        for row in &claimed.rows {
            *per_key.entry(Key::of(row)).or_default() += 1;
        }
        let full: HashSet<Key> = per_key
            .into_iter()
            .filter(|(_, n)| *n >= claimed.per_key)
            .map(|(k, _)| k)
            .collect();
        let added = self.hand.claim_returned(claimed.rows, &full);
        let new = added.rows;
        // Keys cut short because rows left the hand during the claim: ask for them again.
        self.continue_keys.extend(added.stopped);
        // Rows no NOTIFY announced although LISTEN was up and the hint was on.
        let unannounced = if self.listen_up && self.wakeup_db == Some(true) && !self.notified {
            new
        } else {
            0
        };
        self.notified = false;
        self.tel
            .claimed(new, claimed.scanned, self.hand.rows(), unannounced);
        // `wanted` was cleared when this claim started; a wake-up that came while it ran
        // (its snapshot may predate that commit) has set it again and must survive.
        let reached_end = claimed.scanned < meta.limit;
        if meta.sweeping {
            // A sweep reaching its end is done; it never moves the forward cursor.
            self.pass.sweep = if reached_end {
                None
            } else {
                self.pass
                    .sweep
                    .map(|(_, until)| (claimed.scanned_to, until))
            };
            self.pass.wanted |= new > 0 || self.pass.sweep.is_some();
            return;
        }
        self.pass
            .forward_done(Instant::now(), claimed.scanned_to, reached_end);
        if !reached_end || new > 0 || !self.continue_keys.is_empty() || self.pass.sweep.is_some() {
            // More to read, or rows are coming: claim again at once.
            self.pass.wanted = true;
        }
        if new >= BUSY_CLAIM_ROWS && !self.busy {
            self.busy = true;
            self.wakeup_wanted = false; // producers stop sending NOTIFY; we poll
        }
        if new > 0 {
            self.empty_since = None;
        } else if reached_end && self.busy {
            // Busy and came back empty: poll again shortly; after a quiet spell, go idle
            // (the hint goes back on, then one more poll closes the race).
            let now = Instant::now();
            let since = *self.empty_since.get_or_insert(now);
            if now.duration_since(since) >= IDLE_AFTER {
                self.busy = false;
                self.empty_since = None;
                self.wakeup_wanted = self.cfg.listen;
            } else {
                self.pass.wanted = true;
                self.pass.not_before = Some(now + BUSY_POLL_GAP);
            }
        } else if reached_end && !self.pass.wanted {
            self.wakeup_wanted = self.cfg.listen;
        }
    }

    fn settled(&mut self, (generation, batch): SettledBatch) {
        if self
            .session
            .as_ref()
            .is_none_or(|s| s.generation() != generation)
        {
            return; // a lost session's late reports; its rows were failed already
        }
        let mut counts = SettledCounts::default();
        let mut confirm_secs = Vec::with_capacity(batch.len());
        let mut commit_secs = Vec::with_capacity(batch.len());
        let now_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        for s in batch {
            let (reason, kind) = match s.outcome {
                Outcome::Acked(acked) => {
                    counts.acked += 1;
                    self.published += 1;
                    confirm_secs.push(s.confirm_secs);
                    if let Some(row) = self.hand.head(&s.key, s.row_id) {
                        commit_secs.push((now_unix - row.created_epoch).max(0.0));
                    }
                    if self.hand.acked(&s.key, s.row_id).wants_claim {
                        self.continue_keys.insert(s.key.clone());
                        self.pass.wanted = true;
                    }
                    self.marks.push((s.key, acked));
                    continue;
                }
                Outcome::Returned {
                    reply_code,
                    reply_text,
                } => {
                    counts.returned += 1;
                    let rk = self
                        .hand
                        .head(&s.key, s.row_id)
                        .map(|r| r.routing_key.clone())
                        .unwrap_or_default();
                    (
                        format!(
                            "unroutable: exchange '{}' has no queue bound for routing key '{rk}' ({reply_code} {reply_text})",
                            self.cfg.exchange
                        ),
                        FailureKind::Permanent,
                    )
                }
                Outcome::Nacked => {
                    counts.nacked += 1;
                    ("nacked by the broker".to_owned(), FailureKind::Transient)
                }
                Outcome::TimedOut => {
                    counts.timed_out += 1;
                    (
                        format!("no confirm within {:?}", self.cfg.confirm_timeout),
                        FailureKind::Transient,
                    )
                }
                Outcome::Lost(why) => {
                    counts.lost += 1;
                    (
                        format!("channel lost before the confirm: {why}"),
                        FailureKind::Transient,
                    )
                }
            };
            self.hand.failed(&s.key, s.row_id);
            self.failures.push((
                s.key,
                Failure {
                    id: s.row_id,
                    kind,
                    reason,
                },
            ));
        }
        self.tel
            .batch_settled(counts, &confirm_secs, &commit_secs, self.hand.in_flight());
    }

    fn recorded(&mut self, batch: Vec<(Key, Failure)>, recorded: Vec<(i64, Recorded)>) {
        let now = Instant::now();
        for ((key, failure), (_, rec)) in batch.into_iter().zip(recorded) {
            match rec {
                Recorded::Pending { attempts } => {
                    self.hand.wait_retry(&key, failure.id);
                    let at = Hand::retry_at(attempts, self.cfg.retry_min, self.cfg.retry_max, now);
                    self.retries.insert_at(key, at.into());
                }
                Recorded::Parked => {
                    self.tel.row_parked(
                        failure.id,
                        &key.aggregate_type,
                        &key.aggregate_id,
                        &failure.reason,
                    );
                    let keep_going = self.cfg.on_park == OnPark::Continue;
                    if self.hand.parked(&key, failure.id, keep_going).wants_claim {
                        self.continue_keys.insert(key.clone());
                        self.pass.wanted = true;
                    }
                    if !keep_going {
                        self.pass.wanted = true;
                    }
                }
                Recorded::Gone => {
                    if self.hand.gone(&key, failure.id).wants_claim {
                        self.continue_keys.insert(key.clone());
                        self.pass.wanted = true;
                    }
                }
            }
        }
    }

    fn leased(&mut self, sent: Instant, round: LeaseRound) {
        self.registered = true;
        if self.wakeup_db == Some(true) {
            // Renew the producers' hint: it runs out three leases after its last renewal.
            self.wakeup_db = None;
        }
        let valid_until = sent + self.cfg.lease.mul_f64(0.9);
        let mut gained = 0;
        let held: HashSet<u8> = round.held.iter().map(|l| l.partition).collect();
        let lost: Vec<u8> = self
            .leases
            .keys()
            .filter(|p| !held.contains(p))
            .copied()
            .collect();
        for p in &lost {
            self.leases.remove(p);
            self.hand.drop_partition(*p);
        }
        for lease in &round.held {
            match self.leases.get_mut(&lease.partition) {
                Some(l) if l.epoch == lease.epoch => l.valid_until = valid_until,
                Some(_) | None => {
                    // New, or lost and taken back meanwhile: start clean.
                    self.hand.drop_partition(lease.partition);
                    self.leases.insert(
                        lease.partition,
                        HeldLease {
                            epoch: lease.epoch,
                            valid_until,
                            releasing: false,
                        },
                    );
                    gained += 1;
                }
            }
        }
        // Give back what is above the fair share, once it has nothing in flight.
        let releasing = self.leases.values().filter(|l| l.releasing).count();
        let excess = self.leases.len().saturating_sub(round.fair_share.max(1));
        if excess > releasing {
            let mut candidates: Vec<u8> = self
                .leases
                .iter()
                .filter(|(_, l)| !l.releasing)
                .map(|(p, _)| *p)
                .collect();
            candidates.sort_unstable_by(|a, b| b.cmp(a));
            for p in candidates.into_iter().take(excess - releasing) {
                if let Some(l) = self.leases.get_mut(&p) {
                    l.releasing = true;
                }
                self.hand.drop_partition(p);
            }
        }
        let ready: Vec<u8> = self
            .leases
            .iter()
            .filter(|(p, l)| l.releasing && !self.hand.busy_in_partition(**p))
            .map(|(p, _)| *p)
            .collect();
        for p in ready {
            self.release_next.push(p as i32);
        }
        if gained > 0 {
            self.pass.wanted = true;
            self.pass.sweep_wanted = true;
        }
        if gained > 0 || !lost.is_empty() {
            self.tel.leases_changed(
                self.leases.len(),
                gained,
                lost.len(),
                round.fair_share,
                round.relays_alive,
            );
        }
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
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_millis(100);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// While forward claims keep up, the next one reads again from where the claims of the
    /// last window started; that start moves up as claims age out of the window.
    #[test]
    fn caught_up_claims_read_the_last_window_again() {
        let t0 = Instant::now();
        let mut pass = Pass::default();
        assert_eq!(pass.forward_from(t0, W), 0);
        pass.forward_done(t0, 100, true);
        pass.forward_done(t0 + ms(40), 150, true);
        pass.forward_done(t0 + ms(80), 170, true);
        assert_eq!(pass.cursor, 170);
        // The first claim (from 0) is still within the window.
        assert_eq!(pass.forward_from(t0 + ms(90), W), 0);
        // It aged out; the second passed from 100.
        assert_eq!(pass.forward_from(t0 + ms(120), W), 100);
        assert_eq!(pass.forward_from(t0 + ms(170), W), 150);
        // Nothing passed in the last window: read from the cursor.
        assert_eq!(pass.forward_from(t0 + ms(400), W), 170);
    }

    /// A claim that read from further back and reached the end never moves the cursor back;
    /// one that stopped at its limit goes on from there (below the cursor), and until claims
    /// keep up again they read from the cursor only.
    #[test]
    fn a_claim_from_further_back_moves_the_cursor_back_only_when_cut() {
        let t0 = Instant::now();
        let mut pass = Pass::default();
        pass.forward_done(t0, 500, true);
        assert_eq!(pass.forward_from(t0 + ms(1), W), 0);
        pass.forward_done(t0 + ms(1), 300, true);
        assert_eq!(pass.cursor, 500, "reached the end below the cursor");
        pass.forward_done(t0 + ms(2), 200, false);
        assert_eq!(pass.cursor, 200, "cut at its limit: go on from there");
        assert_eq!(pass.forward_from(t0 + ms(3), W), 200, "not caught up");
    }
}
