//! The runner's settings: [`ConsumerConfig`] with its ordered mode ([`Ordered`], [`OnDead`]),
//! the checks that refuse settings that contradict each other, and the names and delays
//! they imply (retry tiers, dead-letter exchange and queue, an ordered group's intake
//! queue, route exchange and partition queues, and the partition of a key).
//!
//! Invariant: every retry delay [`ConsumerConfig::retry_delay`] can return has a declared
//! queue among [`ConsumerConfig::delay_tiers`]; timeouts are shorter than what they guard.

use std::collections::BTreeSet;
use std::num::{NonZeroU16, NonZeroU32};
use std::time::Duration;

use crate::contract::{ConfigError, validate_exchange};

/// What an ordered group does with a key after one of its events was dead-lettered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum OnDead {
    /// The key waits for an operator: its later events are held in the database
    /// (`outbox_inbox_held`) and applied in seq order after `outbox_consumer_release` (or
    /// `outbox-relay consumer-release`). Other keys flow.
    #[default]
    BlockKey,
    /// The key goes on with its next event; the dead one stays in the dead-letter queue.
    Continue,
}

/// Ordered mode: the consumer is a group of instances sharing `partitions` partition
/// queues; per key, events are applied one after another in the order the broker keeps.
#[derive(Clone, Debug)]
pub struct Ordered {
    /// How many partition queues the group has. Fixed for the life of the group (recorded
    /// in `outbox_consumer_groups`; a different count is refused at start-up).
    pub partitions: NonZeroU16,
    /// What a key does after one of its events was dead-lettered.
    pub on_dead: OnDead,
    /// How long a member's heartbeat in Postgres stays valid; renewed every third of it. An
    /// instance that stops renewing loses its partitions to the others after this long.
    pub member_lease: Duration,
}

impl Default for Ordered {
    /// 8 partitions, block-key, a 6 s member lease.
    fn default() -> Self {
        Ordered {
            partitions: NonZeroU16::new(8).expect("non-zero"),
            on_dead: OnDead::BlockKey,
            member_lease: Duration::from_secs(6),
        }
    }
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
    /// Defaults for consumer `name` on `exchange` with `bindings`: queue `name`, prefetch 16, unordered, retries from 1 s to 60 s, 10 attempts, 30 s per message.
    /// The defaults also pass the checks of an ordered group (`ordered = Some(Ordered::default())`):
    /// 10 attempts of up to 30 s with their backoff keep an event unacked for at most about 9 min,
    /// under half the broker's 30 min redelivery timeout.
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
            max_attempts: NonZeroU32::new(10),
            handler_timeout: Duration::from_secs(30),
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
            self.validate_group(o)?;
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
        (1..=21).map(|a| self.retry_delay(a)).collect()
    }

    /// An ordered group's intake queue: bound to `exchange` with the bindings,
    /// single-active-consumer; the group's router moves its events to the partition queues.
    pub fn intake_queue(&self) -> String {
        format!("{}.intake", self.queue)
    }

    /// The direct exchange earlier versions' routers published to; each partition queue is
    /// bound to it with its own name, and its alternate exchange is the dead-letter exchange.
    /// Still declared for those routers during an upgrade; this version's router publishes
    /// to the partition queue by name with `mandatory`, so a copy nobody takes comes back.
    pub fn route_exchange(&self) -> String {
        format!("{}.route", self.queue)
    }

    /// The consistent-hash exchange earlier versions put in front of the partition queues.
    /// Its ring moves keys at a broker restart; start-up refuses a group that still has it.
    pub(super) fn legacy_hash_exchange(&self) -> String {
        format!("{}.hash", self.queue)
    }

    /// The name of partition queue `p` of an ordered group (zero-padded).
    pub fn partition_queue(&self, p: u16) -> String {
        let partitions = self.ordered.as_ref().map_or(1, |o| o.partitions.get());
        let width = (partitions - 1).max(10).ilog10() as usize + 1;
        format!("{}.p{p:0width$}", self.queue)
    }

    /// The partition of a key: CRC-32 (IEEE, as zlib's `crc32`) of the UTF-8 bytes of
    /// `aggregate_type`, one zero byte and `aggregate_id`, modulo the partition count. It
    /// depends on nothing else, so a key's partition never changes while the count does not.
    pub fn partition_of(&self, aggregate_type: &str, aggregate_id: &str) -> u16 {
        let partitions = self.ordered.as_ref().map_or(1, |o| o.partitions.get());
        let mut h = crc32fast::Hasher::new();
        h.update(aggregate_type.as_bytes());
        h.update(&[0]);
        h.update(aggregate_id.as_bytes());
        (h.finalize() % u32::from(partitions)) as u16
    }

    /// The longest one event can stay unacked while it is retried in place: every attempt
    /// taking `handler_timeout`, and the backoff between them.
    pub fn in_place_retry_budget(&self) -> Option<Duration> {
        let max = self.max_attempts?.get();
        let delays: Duration = (1..max).map(|a| self.retry_delay(a)).sum();
        Some(self.handler_timeout.saturating_mul(max) + delays)
    }

    fn validate_group(&self, o: &Ordered) -> Result<(), ConfigError> {
        if o.partitions.get() > 1000 {
            return Err(ConfigError::new(
                "partitions",
                "at most 1000 partitions per group",
            ));
        }
        if o.member_lease < Duration::from_secs(1) {
            return Err(ConfigError::new(
                "member_lease",
                "must be at least 1s: the heartbeat renews it every third of it",
            ));
        }
        let Some(budget) = self.in_place_retry_budget() else {
            return Err(ConfigError::new(
                "max_attempts",
                "an ordered group retries in place while the key's later events wait behind it: set max_attempts, so that a failing event is dead-lettered within the broker's redelivery timeout",
            ));
        };
        if budget * 2 > self.redelivery_timeout {
            return Err(ConfigError::new(
                "max_attempts",
                format!(
                    "{} attempts of up to handler_timeout {:?} with backoff up to retry_max {:?} keep an event unacked for up to {budget:?}, more than half the broker's redelivery timeout {:?}: lower max_attempts, handler_timeout or retry_max",
                    self.max_attempts.map_or(0, NonZeroU32::get),
                    self.handler_timeout,
                    self.retry_max,
                    self.redelivery_timeout
                ),
            ));
        }
        for b in &self.bindings {
            if let Err(why) = group_binding(b) {
                return Err(ConfigError::new(
                    "bindings",
                    format!("'{b}' cannot be used by an ordered group: {why}"),
                ));
            }
        }
        if self.bindings.is_empty() {
            return Err(ConfigError::new(
                "bindings",
                "an ordered group needs a binding: '#' or '<aggregate_type>.#'",
            ));
        }
        Ok(())
    }
}

/// Whether an ordered group may bind with `binding`: it must take every event of the keys
/// it takes (`#`, `<aggregate_type>.#`, `<aggregate_type>.*`), or a key's events would be
/// split between this group and nobody, and its seqs would jump for no reason anyone
/// recorded.
fn group_binding(binding: &str) -> Result<(), &'static str> {
    if binding == "#" {
        return Ok(());
    }
    let Some((head, tail)) = binding.split_once('.') else {
        return Err(
            "a binding without a '.' takes only some event types; use '#' or '<aggregate_type>.#'",
        );
    };
    if head.is_empty() || head.contains(['*', '#']) {
        return Err(
            "its first word must name one aggregate type: a wildcard there takes some event types of every aggregate type, splitting each key's events; use '#' or '<aggregate_type>.#'",
        );
    }
    if tail != "#" && tail != "*" {
        return Err(
            "it takes only some event types of the aggregate type, so each key's other events would never reach the group; use '<aggregate_type>.#' and filter in the handler",
        );
    }
    Ok(())
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
    fn the_defaults_pass_unordered_and_as_an_ordered_group() {
        let mut c = ConsumerConfig::new("billing", "outbox.events", &["#"]);
        assert!(c.validate(32).is_ok());
        c.ordered = Some(Ordered::default());
        assert!(c.validate(32).is_ok(), "{:?}", c.validate(32));
    }

    #[test]
    fn timeouts_shorter_than_what_they_guard_are_refused() {
        let mut c = config();
        assert!(c.validate(32).is_ok());
        c.handler_timeout = Duration::from_secs(20 * 60);
        assert_eq!(c.validate(32).unwrap_err().flag, "handler_timeout");

        let mut c = config();
        c.ordered = Some(Ordered::default());
        c.max_attempts = None;
        assert_eq!(c.validate(32).unwrap_err().flag, "max_attempts");
        c.max_attempts = NonZeroU32::new(5);
        assert!(c.validate(32).is_ok());
        c.handler_timeout = Duration::from_secs(4 * 60);
        let err = c.validate(32).unwrap_err();
        assert_eq!(err.flag, "max_attempts");
        assert!(
            err.problem.contains("redelivery timeout"),
            "{}",
            err.problem
        );

        let c = config();
        let err = c.validate(8).unwrap_err();
        assert_eq!(err.flag, "prefetch");
        assert!(err.problem.contains("at least 32"), "{}", err.problem);
    }

    #[test]
    fn ordered_groups_take_every_event_type_of_a_key() {
        for ok in ["#", "order.#", "order.*"] {
            assert!(group_binding(ok).is_ok(), "{ok}");
        }
        for refused in [
            "order.created",
            "*.created",
            "#.created",
            "order",
            "*.#",
            "order.created.#",
        ] {
            assert!(group_binding(refused).is_err(), "{refused}");
        }
        let mut c = config();
        c.max_attempts = NonZeroU32::new(5);
        c.ordered = Some(Ordered::default());
        c.bindings = vec!["order.#".into(), "order.created".into()];
        let err = c.validate(32).unwrap_err();
        assert_eq!(err.flag, "bindings");
        assert!(err.problem.contains("'order.created'"), "{}", err.problem);
    }

    #[test]
    fn a_keys_partition_is_the_crc32_of_the_key() {
        // The figures Python's zlib.crc32(b"<type>\0<id>") % n gives: a router in another
        // language computes the same partitions.
        let mut c = config();
        c.ordered = Some(Ordered::default());
        assert_eq!(
            [
                c.partition_of("acct", "k98"),
                c.partition_of("order", "42"),
                c.partition_of("acct", "k1")
            ],
            [2, 5, 3]
        );
        c.ordered = Some(Ordered {
            partitions: NonZeroU16::new(120).unwrap(),
            ..Ordered::default()
        });
        assert_eq!(c.partition_of("acct", "k98"), 106);
    }

    #[test]
    fn partition_queues_are_zero_padded() {
        let mut c = config();
        c.ordered = Some(Ordered::default());
        assert_eq!(c.partition_queue(3), "billing.p03");
        c.ordered = Some(Ordered {
            partitions: NonZeroU16::new(120).unwrap(),
            ..Ordered::default()
        });
        assert_eq!(c.partition_queue(7), "billing.p007");
        assert_eq!(c.intake_queue(), "billing.intake");
    }
}
