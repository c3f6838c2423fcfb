//! Everything that happens once gets one method here: it logs with structured fields and
//! bumps the metric with the same labels. Called per batch or per state change, never per
//! row in a hot loop; no event ids in metric labels. Metric names follow
//! `outbox_<thing>_<unit>[_total]`.
//!
//! A [`Telemetry`] is made per relay and passed in (tests run several relays in one
//! process and assert each one's figures). [`Health`] is the readiness the HTTP endpoint
//! reports: Postgres reachable, an AMQP session open, not shutting down.
//!
//! A dependency that stays down is logged once at warn, then at most every 30 s with the
//! number of failures in between, and once more at info when it is back ([`outbox_kit::internal::Down`]).

use std::fmt::Display;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tracing::{debug, info, warn};

use crate::trace::StageTrace;

const DOWN_REPEAT: Duration = Duration::from_secs(30);

type Labels = Vec<(&'static str, &'static str)>;

/// The relay's metrics (docs/operating.md, "Health and metrics").
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub published: Counter,
    pub acked: Counter,
    pub nacked: Counter,
    pub returned: Counter,
    pub publish_failures: Family<Labels, Counter>,
    pub dispatched: Counter,
    pub parked: Counter,
    pub commit_to_confirm: Histogram,
    pub confirm_latency: Histogram,
    pub claim_rows: Histogram,
    pub claims: Family<Labels, Counter>,
    pub reconnects: Family<Labels, Counter>,
    pub listen_connected: Gauge,
    pub unannounced: Counter,
    pub pending_rows: Gauge,
    pub oldest_pending_age: Gauge<f64, AtomicU64>,
    pub parked_rows: Gauge,
    pub leased_partitions: Gauge,
    pub in_flight: Gauge,
    pub keys_held: Family<Labels, Gauge>,
    pub retention_deleted: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let latency = || Histogram::new(exponential_buckets(0.0005, 2.0, 18));
        let mut m = Metrics {
            registry: Registry::default(),
            published: Counter::default(),
            acked: Counter::default(),
            nacked: Counter::default(),
            returned: Counter::default(),
            publish_failures: Family::default(),
            dispatched: Counter::default(),
            parked: Counter::default(),
            commit_to_confirm: latency(),
            confirm_latency: latency(),
            claim_rows: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            claims: Family::default(),
            reconnects: Family::default(),
            listen_connected: Gauge::default(),
            unannounced: Counter::default(),
            pending_rows: Gauge::default(),
            oldest_pending_age: Gauge::default(),
            parked_rows: Gauge::default(),
            leased_partitions: Gauge::default(),
            in_flight: Gauge::default(),
            keys_held: Family::default(),
            retention_deleted: Counter::default(),
        };
        let r = &mut m.registry;
        r.register(
            "outbox_messages_published",
            "Messages handed to the broker",
            m.published.clone(),
        );
        r.register(
            "outbox_messages_acked",
            "Messages the broker acked without returning them",
            m.acked.clone(),
        );
        r.register(
            "outbox_messages_nacked",
            "Messages the broker nacked",
            m.nacked.clone(),
        );
        r.register(
            "outbox_messages_returned",
            "Messages returned as unroutable",
            m.returned.clone(),
        );
        r.register(
            "outbox_publish_failures",
            "Failed publish attempts by reason (nacked, returned, timeout, connection_lost, refused)",
            m.publish_failures.clone(),
        );
        r.register(
            "outbox_rows_dispatched",
            "Rows marked dispatched",
            m.dispatched.clone(),
        );
        r.register(
            "outbox_rows_parked",
            "Rows parked by this relay",
            m.parked.clone(),
        );
        r.register(
            "outbox_commit_to_confirm_seconds",
            "From the row's created_at to the broker's ack",
            m.commit_to_confirm.clone(),
        );
        r.register(
            "outbox_confirm_latency_seconds",
            "From publish to the broker's ack",
            m.confirm_latency.clone(),
        );
        r.register(
            "outbox_claim_batch_rows",
            "New rows per claim",
            m.claim_rows.clone(),
        );
        r.register(
            "outbox_claims",
            "Claims that returned, by whether they brought new rows (found: rows, none)",
            m.claims.clone(),
        );
        for found in ["rows", "none"] {
            m.claims.get_or_create(&vec![("found", found)]).inc_by(0); // shown from the start
        }
        r.register(
            "outbox_reconnects",
            "Connections re-established, by target",
            m.reconnects.clone(),
        );
        r.register(
            "outbox_listen_connected",
            "1 while the LISTEN connection is up",
            m.listen_connected.clone(),
        );
        r.register(
            "outbox_rows_unannounced",
            "Rows found by polling that no NOTIFY had announced while LISTEN was up",
            m.unannounced.clone(),
        );
        r.register(
            "outbox_pending_rows",
            "Rows waiting to be published",
            m.pending_rows.clone(),
        );
        r.register(
            "outbox_oldest_pending_age_seconds",
            "How long the oldest due pending row has been due (delayed rows count from available_at)",
            m.oldest_pending_age.clone(),
        );
        r.register(
            "outbox_parked_rows",
            "Rows parked, waiting for an operator",
            m.parked_rows.clone(),
        );
        r.register(
            "outbox_leased_partitions",
            "Partitions this relay holds",
            m.leased_partitions.clone(),
        );
        r.register(
            "outbox_in_flight_messages",
            "Messages published and not yet settled",
            m.in_flight.clone(),
        );
        r.register(
            "outbox_keys_held",
            "Keys of this relay whose next row the broker last nacked or returned, by reason (nack, returned)",
            m.keys_held.clone(),
        );
        for reason in ["nack", "returned"] {
            m.keys_held.get_or_create(&vec![("reason", reason)]).set(0); // shown from the start
        }
        r.register(
            "outbox_retention_deleted_rows",
            "Dispatched rows deleted by --retention",
            m.retention_deleted.clone(),
        );
        m
    }
}

impl Metrics {
    /// The Prometheus/OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String");
        out
    }
}

/// What `/readyz` reports.
#[derive(Debug, Default)]
pub struct Health {
    postgres_up: AtomicBool,
    amqp_up: AtomicBool,
    stopping: AtomicBool,
}

impl Health {
    pub fn ready(&self) -> bool {
        self.postgres_up.load(Ordering::Relaxed)
            && self.amqp_up.load(Ordering::Relaxed)
            && !self.stopping.load(Ordering::Relaxed)
    }

    /// Why not ready, for the response body.
    pub fn describe(&self) -> String {
        format!(
            "postgres {}, rabbitmq {}{}",
            if self.postgres_up.load(Ordering::Relaxed) {
                "up"
            } else {
                "down"
            },
            if self.amqp_up.load(Ordering::Relaxed) {
                "up"
            } else {
                "down"
            },
            if self.stopping.load(Ordering::Relaxed) {
                ", shutting down"
            } else {
                ""
            }
        )
    }
}

/// Logging and metrics of one relay.
#[derive(Clone, Debug, Default)]
pub struct Telemetry {
    pub metrics: Arc<Metrics>,
    pub health: Arc<Health>,
    /// Failed publishes are logged at most every 30 s (a broker that nacks everything must
    /// not flood the log); the counts in between are summed into the next line.
    failures: Arc<std::sync::Mutex<FailureLog>>,
    /// Per-stage timestamps for the benchmark (`run --stage-trace`); off by default.
    stage_trace: Option<StageTrace>,
}

#[derive(Debug, Default)]
struct FailureLog {
    last: Option<Instant>,
    since: SettledCounts,
}

/// Per-batch counts of how the broker settled messages.
#[derive(Debug, Default, Clone, Copy)]
pub struct SettledCounts {
    pub acked: u64,
    pub returned: u64,
    pub nacked: u64,
    pub timed_out: u64,
    pub lost: u64,
}

pub fn migrations_applied(applied: &[String], already: usize) {
    if applied.is_empty() {
        debug!(target: "outbox_relay", already, "schema up to date");
    } else {
        info!(target: "outbox_relay", applied = ?applied, already, "migrations applied");
    }
}

impl Telemetry {
    /// The same, also writing stage timestamps to `trace` (see [`StageTrace`]).
    pub fn with_stage_trace(mut self, trace: StageTrace) -> Telemetry {
        self.stage_trace = Some(trace);
        self
    }

    /// Where stage timestamps go, when they are wanted.
    pub fn stage_trace(&self) -> Option<&StageTrace> {
        self.stage_trace.as_ref()
    }

    pub fn relay_started(&self, relay_id: &str, exchange: &str, amqp: &dyn Display, listen: bool) {
        info!(target: "outbox_relay", relay_id, exchange, amqp = %amqp, listen, "relay started");
    }

    /// Every event leaves two dead row versions behind; without autovacuum they pile up
    /// and claims slow down over time.
    pub fn autovacuum_off(&self) {
        warn!(
            target: "outbox_relay",
            "autovacuum is off for outbox_events: dead rows will slow claiming over time; turn it on or VACUUM outbox_events regularly"
        );
    }

    pub fn postgres_state(&self, up: bool) {
        self.health.postgres_up.store(up, Ordering::Relaxed);
    }

    /// A database operation succeeded after failures: the pool reconnected.
    pub fn postgres_reconnected(&self) {
        self.metrics
            .reconnects
            .get_or_create(&vec![("target", "postgres")])
            .inc();
    }

    pub fn amqp_connected(&self, generation: u64, channels: usize) {
        info!(target: "outbox_relay", generation, channels, "amqp session open");
        self.health.amqp_up.store(true, Ordering::Relaxed);
        if generation > 1 {
            self.metrics
                .reconnects
                .get_or_create(&vec![("target", "rabbitmq")])
                .inc();
        }
    }

    pub fn amqp_session_lost(&self, generation: u64, rows_in_flight: usize, why: &str) {
        warn!(
            target: "outbox_relay",
            generation,
            rows_in_flight,
            why,
            "amqp session lost; unconfirmed rows stay pending and are retried"
        );
        self.health.amqp_up.store(false, Ordering::Relaxed);
    }

    pub fn listen_state(&self, connected: bool, reconnect: bool) {
        debug!(target: "outbox_relay", connected, "listen connection");
        self.metrics.listen_connected.set(i64::from(connected));
        if connected && reconnect {
            self.metrics
                .reconnects
                .get_or_create(&vec![("target", "listen")])
                .inc();
        }
    }

    /// A claim returned; `unannounced` of its new rows came although LISTEN was up, the
    /// wake-up was on, and no NOTIFY had arrived.
    pub fn claimed(&self, new_rows: usize, scanned: usize, held: usize, unannounced: usize) {
        debug!(target: "outbox_relay", new_rows, scanned, held, unannounced, "claimed");
        if new_rows > 0 {
            self.metrics.claim_rows.observe(new_rows as f64);
        }
        let found = if new_rows > 0 { "rows" } else { "none" };
        self.metrics
            .claims
            .get_or_create(&vec![("found", found)])
            .inc();
        self.metrics.unannounced.inc_by(unannounced as u64);
    }

    pub fn published(&self, n: usize, in_flight: usize) {
        self.metrics.published.inc_by(n as u64);
        self.metrics.in_flight.set(in_flight as i64);
    }

    /// A batch of confirms: counts, and the latencies measured for the acked ones.
    pub fn batch_settled(
        &self,
        c: SettledCounts,
        confirm_secs: &[f64],
        commit_secs: &[f64],
        in_flight: usize,
    ) {
        let m = &self.metrics;
        m.acked.inc_by(c.acked);
        m.returned.inc_by(c.returned);
        m.nacked.inc_by(c.nacked);
        m.in_flight.set(in_flight as i64);
        for (reason, n) in [
            ("nacked", c.nacked),
            ("returned", c.returned),
            ("timeout", c.timed_out),
            ("connection_lost", c.lost),
        ] {
            if n > 0 {
                m.publish_failures
                    .get_or_create(&vec![("reason", reason)])
                    .inc_by(n);
            }
        }
        for s in confirm_secs {
            m.confirm_latency.observe(*s);
        }
        for s in commit_secs {
            m.commit_to_confirm.observe(*s);
        }
        if c.returned + c.nacked + c.timed_out + c.lost > 0 {
            let mut log = self.failures.lock().unwrap_or_else(|e| e.into_inner());
            log.since.acked += c.acked;
            log.since.returned += c.returned;
            log.since.nacked += c.nacked;
            log.since.timed_out += c.timed_out;
            log.since.lost += c.lost;
            let now = Instant::now();
            if log
                .last
                .is_none_or(|t| now.duration_since(t) >= DOWN_REPEAT)
            {
                let t = std::mem::take(&mut log.since);
                log.last = Some(now);
                warn!(
                    target: "outbox_relay",
                    acked = t.acked,
                    returned = t.returned,
                    nacked = t.nacked,
                    timed_out = t.timed_out,
                    lost = t.lost,
                    "publishes failed; rows stay pending and are retried with backoff (counts since the last such line; at most one every 30 s)"
                );
            } else {
                debug!(target: "outbox_relay", returned = c.returned, nacked = c.nacked, "publishes failed");
            }
        } else {
            debug!(target: "outbox_relay", acked = c.acked, "batch confirmed");
        }
    }

    pub fn rows_refused(&self, n: usize) {
        self.metrics
            .publish_failures
            .get_or_create(&vec![("reason", "refused")])
            .inc_by(n as u64);
    }

    pub fn rows_marked(&self, rows: usize, changed: u64) {
        debug!(target: "outbox_relay", rows, changed, "marked dispatched");
        self.metrics.dispatched.inc_by(changed);
    }

    pub fn row_parked(&self, id: i64, aggregate_type: &str, aggregate_id: &str, reason: &str) {
        warn!(
            target: "outbox_relay",
            id,
            aggregate_type,
            aggregate_id,
            reason,
            "row parked; re-drive it once the cause is fixed"
        );
        self.metrics.parked.inc();
    }

    pub fn leases_changed(
        &self,
        held: usize,
        gained: usize,
        lost: usize,
        fair_share: usize,
        relays_alive: usize,
    ) {
        info!(target: "outbox_relay", held, gained, lost, fair_share, relays_alive, "partition leases changed");
        self.metrics.leased_partitions.set(held as i64);
    }

    /// Keys held up by a row the broker keeps nacking or returning (set after every wake-up
    /// of the engine; a gauge, so no log).
    pub fn keys_held(&self, nack: usize, returned: usize) {
        for (reason, n) in [("nack", nack), ("returned", returned)] {
            self.metrics
                .keys_held
                .get_or_create(&vec![("reason", reason)])
                .set(n as i64);
        }
    }

    pub fn wakeup_hint(&self, wanted: bool) {
        debug!(target: "outbox_relay", wanted, "insert wake-up hint");
    }

    /// The periodic look at the table (pending, oldest pending, parked).
    pub fn outbox_sampled(&self, pending: i64, oldest_pending_secs: f64, parked: i64) {
        self.metrics.pending_rows.set(pending);
        self.metrics.oldest_pending_age.set(oldest_pending_secs);
        self.metrics.parked_rows.set(parked);
    }

    pub fn retention_deleted(&self, rows: u64) {
        if rows > 0 {
            info!(target: "outbox_relay", rows, "retention deleted dispatched rows");
            self.metrics.retention_deleted.inc_by(rows);
        }
    }

    pub fn shutdown_started(&self, in_flight: usize) {
        info!(target: "outbox_relay", in_flight, "shutting down: no new claims, waiting for confirms");
        self.health.stopping.store(true, Ordering::Relaxed);
    }

    pub fn shutdown_finished(&self, abandoned_in_flight: usize, unmarked: usize) {
        self.health.amqp_up.store(false, Ordering::Relaxed);
        if abandoned_in_flight + unmarked > 0 {
            warn!(
                target: "outbox_relay",
                abandoned_in_flight,
                unmarked,
                "shutdown timeout reached; these rows stay pending and will be published again"
            );
        } else {
            info!(target: "outbox_relay", "relay stopped cleanly");
        }
    }
}
