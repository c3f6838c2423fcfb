//! Everything that happens once gets one function here: it logs with structured fields
//! (and, where it has one, bumps the metric with the same labels). Called per batch or per
//! state change, never per row in a hot loop; no event ids in metric labels.
//!
//! A dependency that stays down is logged once at warn, then at most every 30 s with the
//! number of failures in between, and once more at info when it is back ([`Down`]).

use std::fmt::Display;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

const DOWN_REPEAT: Duration = Duration::from_secs(30);

/// Rate-limited logging for one dependency or operation that can fail repeatedly.
#[derive(Debug)]
pub struct Down {
    what: &'static str,
    since: Option<Instant>,
    last_log: Option<Instant>,
    failures: u64,
}

impl Down {
    pub fn new(what: &'static str) -> Down {
        Down {
            what,
            since: None,
            last_log: None,
            failures: 0,
        }
    }

    pub fn is_up(&self) -> bool {
        self.since.is_none()
    }

    /// One more failure; logs the first and then at most every 30 s.
    pub fn failed(&mut self, error: &dyn Display, retry_in: Duration) {
        let now = Instant::now();
        self.failures += 1;
        let first = self.since.is_none();
        self.since.get_or_insert(now);
        let due = self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= DOWN_REPEAT);
        if first || due {
            warn!(
                target: "outbox_relay",
                what = self.what,
                error = %error,
                failures = self.failures,
                retry_in_ms = retry_in.as_millis() as u64,
                "{} failing; retrying",
                self.what
            );
            self.last_log = Some(now);
        } else {
            debug!(target: "outbox_relay", what = self.what, error = %error, "{} still failing", self.what);
        }
    }

    /// Success: logs recovery if it had been failing.
    pub fn recovered(&mut self) {
        if let Some(since) = self.since.take() {
            info!(
                target: "outbox_relay",
                what = self.what,
                down_ms = since.elapsed().as_millis() as u64,
                failures = self.failures,
                "{} recovered",
                self.what
            );
        }
        self.failures = 0;
        self.last_log = None;
    }
}

pub fn relay_started(relay_id: &str, exchange: &str, amqp: &dyn Display, listen: bool) {
    info!(target: "outbox_relay", relay_id, exchange, amqp = %amqp, listen, "relay started");
}

pub fn migrations_applied(applied: &[String], already: usize) {
    if applied.is_empty() {
        debug!(target: "outbox_relay", already, "schema up to date");
    } else {
        info!(target: "outbox_relay", applied = ?applied, already, "migrations applied");
    }
}

pub fn amqp_connected(generation: u64, channels: usize) {
    info!(target: "outbox_relay", generation, channels, "amqp session open");
}

pub fn amqp_session_lost(generation: u64, rows_in_flight: usize) {
    warn!(target: "outbox_relay", generation, rows_in_flight, "amqp session lost; unconfirmed rows stay pending and are retried");
}

pub fn listen_state(connected: bool) {
    debug!(target: "outbox_relay", connected, "listen connection");
}

pub fn claimed(new_rows: usize, scanned: usize, held: usize) {
    debug!(target: "outbox_relay", new_rows, scanned, held, "claimed");
}

#[derive(Debug, Default, Clone, Copy)]
pub struct SettledCounts {
    pub acked: usize,
    pub returned: usize,
    pub nacked: usize,
    pub timed_out: usize,
    pub lost: usize,
}

pub fn batch_settled(c: SettledCounts) {
    if c.returned + c.nacked + c.timed_out + c.lost > 0 {
        warn!(
            target: "outbox_relay",
            acked = c.acked,
            returned = c.returned,
            nacked = c.nacked,
            timed_out = c.timed_out,
            lost = c.lost,
            "publishes failed; rows stay pending and are retried with backoff"
        );
    } else {
        debug!(target: "outbox_relay", acked = c.acked, "batch confirmed");
    }
}

pub fn rows_marked(rows: usize, changed: u64) {
    debug!(target: "outbox_relay", rows, changed, "marked dispatched");
}

pub fn row_parked(id: i64, aggregate_type: &str, aggregate_id: &str, reason: &str) {
    warn!(target: "outbox_relay", id, aggregate_type, aggregate_id, reason, "row parked; re-drive it once the cause is fixed");
}

pub fn leases_changed(
    held: usize,
    gained: usize,
    lost: usize,
    fair_share: usize,
    relays_alive: usize,
) {
    info!(target: "outbox_relay", held, gained, lost, fair_share, relays_alive, "partition leases changed");
}

pub fn wakeup_hint(wanted: bool) {
    debug!(target: "outbox_relay", wanted, "insert wake-up hint");
}

pub fn shutdown_started(in_flight: usize) {
    info!(target: "outbox_relay", in_flight, "shutting down: no new claims, waiting for confirms");
}

pub fn shutdown_finished(abandoned_in_flight: usize, unmarked: usize) {
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
