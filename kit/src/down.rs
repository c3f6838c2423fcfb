//! A dependency that stays down is logged once at warn, then at most every 30 s with the
//! number of failures in between, and once more at info when it is back. Shared by the
//! relay's connections and the consumer kit's. A leaf module.

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
    /// Nothing failed yet; `what` names the dependency in every log line.
    pub fn new(what: &'static str) -> Down {
        Down {
            what,
            since: None,
            last_log: None,
            failures: 0,
        }
    }

    /// Whether the last outcome was a success (or nothing failed yet).
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

    /// Success: logs recovery if it had been failing. Returns whether it had been.
    pub fn recovered(&mut self) -> bool {
        let was_down = self.since.is_some();
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
        was_down
    }
}
