//! The runner's settings: [`ConsumerConfig`] with its ordered mode ([`Ordered`], [`OnGap`]),
//! the checks that refuse settings that contradict each other, and the names and delays
//! they imply (retry tiers, dead-letter exchange and queue).
//!
//! Invariant: every retry delay [`ConsumerConfig::retry_delay`] can return has a declared
//! queue among [`ConsumerConfig::delay_tiers`]; timeouts are shorter than what they guard.

use std::collections::BTreeSet;
use std::num::{NonZeroU16, NonZeroU32};
use std::time::Duration;

use crate::contract::{ConfigError, validate_exchange};

/// What to do with an event whose predecessor did not come within `gap_timeout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnGap {
    /// Apply it; the missing seqs are recorded in `outbox_inbox_gaps` and given up.
    Skip,
    /// Dead-letter it; the key stays blocked at the gap until an operator moves it.
    DeadLetter,
}

/// Ordered mode: per key, seq n is applied only after n-1.
#[derive(Clone, Debug)]
pub struct Ordered {
    /// How long an event waits for its predecessor before the gap is reported.
    pub gap_timeout: Duration,
    /// How often a waiting event is tried again.
    pub gap_retry: Duration,
    /// What to do when the predecessor does not come in time.
    pub on_gap: OnGap,
}

/// The runner's settings. Build with [`ConsumerConfig::new`], adjust, and `run` checks them.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// The inbox key: consumers with the same name share dedupe and order state.
    pub name: String,
    /// The queue to consume (default: the name).
    pub queue: String,
    /// The exchange the relay publishes to.
    pub exchange: String,
    /// Binding keys of the queue at the exchange (topic patterns).
    pub bindings: Vec<String>,
    /// Declare the exchange, queues and bindings (off: they must exist as described).
    pub declare: bool,
    /// Unacked messages at most, and messages handled concurrently.
    pub prefetch: NonZeroU16,
    /// Ordered mode (`None`: every event is applied as it comes).
    pub ordered: Option<Ordered>,
    /// The first retry delay; each further attempt doubles it.
    pub retry_min: Duration,
    /// The longest retry delay.
    pub retry_max: Duration,
    /// Transient failures before a message is dead-lettered (None: retry forever).
    pub max_attempts: Option<NonZeroU32>,
    /// Longest one message may take (inbox, handler, commit).
    pub handler_timeout: Duration,
    /// The broker's delivery acknowledgement timeout (RabbitMQ `consumer_timeout`, 30 min by
    /// default): a handler must finish well within it or the broker closes the channel.
    pub redelivery_timeout: Duration,
    /// The name the broker shows for the connection.
    pub connection_name: String,
}

impl ConsumerConfig {
    /// Defaults for consumer `name` on `exchange` with `bindings`: queue `name`, prefetch 16, unordered, retries from 1 s to 60 s, 20 attempts, 60 s per message.
    pub fn new(name: &str, exchange: &str, bindings: &[&str]) -> ConsumerConfig {
        ConsumerConfig {
            name: name.to_owned(),
            queue: name.to_owned(),
            exchange: exchange.to_owned(),
            bindings: bindings.iter().map(|s| (*s).to_owned()).collect(),
            declare: true,
            prefetch: NonZeroU16::new(16).expect("non-zero"),
            ordered: None,
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
            max_attempts: NonZeroU32::new(20),
            handler_timeout: Duration::from_secs(60),
            redelivery_timeout: Duration::from_secs(30 * 60),
            connection_name: format!("outbox-consumer {name}"),
        }
    }

    /// Checks the settings against each other and against the pool: timeouts shorter than
    /// what they guard are configuration errors.
    pub fn validate(&self, pool_size: usize) -> Result<(), ConfigError> {
        if self.name.is_empty() {
            return Err(ConfigError::new("name", "must not be empty"));
        }
        validate_exchange(&self.queue).map_err(|e| ConfigError::new("queue", e))?;
        validate_exchange(&self.exchange).map_err(|e| ConfigError::new("exchange", e))?;
        if self.retry_min.is_zero() || self.retry_max < self.retry_min {
            return Err(ConfigError::new(
                "retry_max",
                "retry_min must be longer than zero and retry_max at least retry_min",
            ));
        }
        if self.handler_timeout * 2 > self.redelivery_timeout {
            return Err(ConfigError::new(
                "handler_timeout",
                format!(
                    "{:?} is more than half the broker's redelivery timeout {:?}: a slow handler would have its message redelivered while it still runs",
                    self.handler_timeout, self.redelivery_timeout
                ),
            ));
        }
        if let Some(o) = &self.ordered {
            if o.gap_retry.is_zero() || o.gap_retry > o.gap_timeout {
                return Err(ConfigError::new(
                    "gap_retry",
                    "must be longer than zero and not longer than gap_timeout",
                ));
            }
            if o.gap_timeout <= self.retry_max {
                return Err(ConfigError::new(
                    "gap_timeout",
                    format!(
                        "{:?} is not longer than retry_max {:?}: a predecessor waiting in a retry queue would be given up as missing",
                        o.gap_timeout, self.retry_max
                    ),
                ));
            }
        }
        // Each message in hand holds its inbox transaction and may take one more connection
        // for effect steps; fewer would deadlock the pool under load.
        let needed = 2 * self.prefetch.get() as usize;
        if pool_size < needed {
            return Err(ConfigError::new(
                "prefetch",
                format!(
                    "{} needs a pool of at least {needed} connections (one for the inbox transaction and one for effects per message in hand), the pool has {pool_size}",
                    self.prefetch
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn retry_queue(&self, delay: Duration) -> String {
        format!("{}.retry.{}ms", self.queue, delay.as_millis())
    }

    pub(super) fn dead_letter_exchange(&self) -> String {
        format!("{}.dlx", self.queue)
    }

    /// The dead-letter queue bound to the dead-letter exchange.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dlq", self.queue)
    }

    /// The delay before retry `attempt` (1-based): retry_min doubling up to retry_max.
    pub(super) fn retry_delay(&self, attempt: u32) -> Duration {
        let factor = 1u32 << attempt.saturating_sub(1).min(20);
        self.retry_min.saturating_mul(factor).min(self.retry_max)
    }

    pub(super) fn delay_tiers(&self) -> BTreeSet<Duration> {
        let mut tiers: BTreeSet<Duration> = (1..=21).map(|a| self.retry_delay(a)).collect();
        if let Some(o) = &self.ordered {
            tiers.insert(o.gap_retry);
        }
        tiers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ConsumerConfig {
        let mut c = ConsumerConfig::new("billing", "outbox.events", &["#"]);
        c.retry_min = Duration::from_millis(100);
        c.retry_max = Duration::from_secs(2);
        c
    }

    #[test]
    fn retry_delays_double_up_to_the_max_and_match_declared_tiers() {
        let c = config();
        let delays: Vec<u64> = (1..=7)
            .map(|a| c.retry_delay(a).as_millis() as u64)
            .collect();
        assert_eq!(delays, [100, 200, 400, 800, 1600, 2000, 2000]);
        let tiers = c.delay_tiers();
        for a in 1..100 {
            assert!(
                tiers.contains(&c.retry_delay(a)),
                "attempt {a} has no queue"
            );
        }
        assert_eq!(tiers.len(), 6);
    }

    #[test]
    fn timeouts_shorter_than_what_they_guard_are_refused() {
        let mut c = config();
        assert!(c.validate(32).is_ok());
        c.handler_timeout = Duration::from_secs(20 * 60);
        assert_eq!(c.validate(32).unwrap_err().flag, "handler_timeout");

        let mut c = config();
        c.ordered = Some(Ordered {
            gap_timeout: Duration::from_secs(1),
            gap_retry: Duration::from_millis(100),
            on_gap: OnGap::Skip,
        });
        assert_eq!(c.validate(32).unwrap_err().flag, "gap_timeout");

        let c = config();
        let err = c.validate(8).unwrap_err();
        assert_eq!(err.flag, "prefetch");
        assert!(err.problem.contains("at least 32"), "{}", err.problem);
    }
}
