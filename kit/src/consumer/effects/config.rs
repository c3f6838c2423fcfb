//! The ledger's settings: who claims, and the timeouts a claim's lease must outlive.
//!
//! Invariant: the lease is longer than two destination calls plus a write-back
//! ([`EffectsConfig::new`] refuses anything else), so a lease never runs out while its send
//! may still be running.

use std::time::Duration;

use crate::contract::ConfigError;

/// Timeouts of the work a claim guards, checked against the lease at construction.
#[derive(Clone, Debug)]
pub struct EffectsConfig {
    /// Who claims (`claimed_by`): unique per worker process.
    pub worker: String,
    /// Longest a destination call (send, lookup, delete) may take.
    pub send_timeout: Duration,
    /// Longest a write-back may take.
    pub write_timeout: Duration,
    /// How long a claim is ours: longer than a send plus its write-back.
    pub lease: Duration,
}

impl EffectsConfig {
    /// Checks that the lease outlives the work it guards: a lease that can run out while
    /// the send is still going would let the reconciler decide about a live send.
    pub fn new(
        worker: impl Into<String>,
        send_timeout: Duration,
        write_timeout: Duration,
        lease: Duration,
    ) -> Result<EffectsConfig, ConfigError> {
        let worker = worker.into();
        if worker.is_empty() {
            return Err(ConfigError::new("worker", "must not be empty"));
        }
        if send_timeout.is_zero() || write_timeout.is_zero() {
            return Err(ConfigError::new(
                "send_timeout",
                "send and write timeouts must be longer than zero",
            ));
        }
        // A send, then possibly a lookup or a withdraw, then the write-back.
        let guarded = send_timeout * 2 + write_timeout;
        if lease <= guarded {
            return Err(ConfigError::new(
                "lease",
                format!(
                    "{lease:?} is not longer than the work it guards (2 x send_timeout + write_timeout = {guarded:?}): raise the lease or lower the timeouts"
                ),
            ));
        }
        Ok(EffectsConfig {
            worker,
            send_timeout,
            write_timeout,
            lease,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_must_outlive_the_send_it_guards() {
        let s = Duration::from_secs;
        assert!(EffectsConfig::new("w", s(10), s(5), s(26)).is_ok());
        let err = EffectsConfig::new("w", s(10), s(5), s(25)).unwrap_err();
        assert_eq!(err.flag, "lease");
        assert!(err.problem.contains("work it guards"), "{}", err.problem);
        assert_eq!(
            EffectsConfig::new("", s(1), s(1), s(10)).unwrap_err().flag,
            "worker"
        );
    }
}
