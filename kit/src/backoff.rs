//! Retry delays: exponential with jitter (backon's builder), for reconnect loops and for
//! rows the broker refused. A leaf module.

use std::time::Duration;

/// Exponential delays with jitter for reconnects and retries of database operations.
#[derive(Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    /// Delays from `min`, doubling up to `max`, starting at the first attempt.
    pub fn new(min: Duration, max: Duration) -> Backoff {
        Backoff {
            min,
            max,
            attempt: 0,
        }
    }

    /// The delay before the next attempt (one more than the last).
    pub fn next_delay(&mut self) -> Duration {
        self.attempt = self.attempt.saturating_add(1);
        retry_delay(self.attempt as i32, self.min, self.max)
    }

    /// Back to the first attempt, after a success.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// The delay before attempt `attempts + 1`: `min` doubling per attempt up to `max`, with
/// jitter (backon's exponential backoff).
pub fn retry_delay(attempts: i32, min: Duration, max: Duration) -> Duration {
    use backon::BackoffBuilder;
    let n = attempts.clamp(1, 64) as usize;
    backon::ExponentialBuilder::default()
        .with_min_delay(min)
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
        .nth(n - 1)
        .unwrap_or(max)
        .min(max)
}
