//! The public contract's vocabulary, shared by producers, the relay and consumers: the
//! schema name, the headers every published message carries, name rules for exchanges and
//! queues, the local defaults, and the error a bad setting gives.
//!
//! Architecture invariant: a leaf module. It imports nothing from this workspace, so every
//! other module can use it without running back up.

use std::fmt;
use std::time::Duration;

/// Header names the relay sets on every message (docs/contract.md). Producers may not
/// set names with [`RESERVED_HEADER_PREFIX`]; the relay strips them and says so.
pub mod headers {
    /// Every header the relay or the consumer kit writes starts with this.
    pub const RESERVED_HEADER_PREFIX: &str = "x-outbox-";
    /// The row's `aggregate_type`.
    pub const AGGREGATE_TYPE: &str = "x-outbox-aggregate-type";
    /// The row's `aggregate_id`.
    pub const AGGREGATE_ID: &str = "x-outbox-aggregate-id";
    /// The row's per-key `seq` (1, 2, 3, ... per key, in publish order).
    pub const SEQ: &str = "x-outbox-seq";
    /// The row's `created_at`, RFC 3339 with microseconds.
    pub const CREATED_AT: &str = "x-outbox-created-at";
    /// `true` on a message `outbox-relay replay` re-published (to one queue, through the
    /// default exchange); otherwise absent.
    pub const REPLAY: &str = "x-outbox-replay";
    /// The consumer kit's: how many times a message was tried.
    pub const ATTEMPT: &str = "x-outbox-attempt";
    /// The consumer kit's: the routing key a retried message was first published with.
    pub const ROUTING_KEY: &str = "x-outbox-routing-key";
    /// The consumer kit's: why a message was dead-lettered.
    pub const DEAD_REASON: &str = "x-outbox-dead-reason";
    /// The consumer kit's: which consumer dead-lettered it.
    pub const DEAD_CONSUMER: &str = "x-outbox-dead-consumer";
}

pub use headers::RESERVED_HEADER_PREFIX;

/// Where `DATABASE_URL` points when unset: the local Postgres.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
/// Where `AMQP_URL` points when unset: the local RabbitMQ.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A flag whose value cannot be used, and why.
#[derive(Debug, thiserror::Error)]
#[error("{flag}: {problem}")]
pub struct ConfigError {
    /// The flag as the user spells it, for example `--batch-size`.
    pub flag: &'static str,
    /// What is wrong and what to do, lowercase, no trailing period.
    pub problem: String,
}

impl ConfigError {
    /// The error for `flag`, with what is wrong and what to do.
    pub fn new(flag: &'static str, problem: impl Into<String>) -> Self {
        ConfigError {
            flag,
            problem: problem.into(),
        }
    }
}

/// A schema or other SQL identifier we interpolate: lowercase letters, digits and `_`,
/// starting with a letter or `_`, at most 63 bytes, so it never needs quoting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schema(String);

impl Schema {
    /// The name if it is one we never need to quote; otherwise why not.
    pub fn parse(s: &str) -> Result<Schema, String> {
        let ok_start = s
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
        let ok_rest = s
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !ok_start || !ok_rest || s.len() > 63 {
            return Err(format!(
                "'{s}' is not a valid schema name: use lowercase letters, digits and '_', starting with a letter, at most 63 characters"
            ));
        }
        Ok(Schema(s.to_owned()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The channel the insert trigger NOTIFYs and the relay LISTENs on for this schema.
    pub fn notify_channel(&self) -> String {
        format!("outbox_events:{self}")
    }
}

impl Default for Schema {
    fn default() -> Self {
        Schema("public".into())
    }
}

impl fmt::Display for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Parses durations such as `300ms`, `1s`, `7d`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("'{s}' is not a duration ({e}); write it like 500ms, 10s, 5m or 7d"))
}

/// Exchange and queue names we accept: 1-255 bytes of letters, digits, `-`, `_`, `.`, `:`.
pub fn validate_exchange(name: &str) -> Result<String, String> {
    if name.is_empty() || name.len() > 255 {
        return Err("must be 1 to 255 characters (the default exchange cannot be used)".into());
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
    {
        return Err(format!(
            "'{name}' may only contain letters, digits, '-', '_', '.' and ':'"
        ));
    }
    Ok(name.to_owned())
}

/// A value that must never be printed (a token, a password): Debug never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a value that must not be printed.
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }

    /// The value itself, for the one place that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}
