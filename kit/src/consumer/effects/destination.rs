//! The destination side of the ledger: [`Effect`] (what an adapter is asked to perform),
//! the [`Destination`] trait adapters implement, and [`DestinationError`], whose kind decides
//! what the ledger does next.
//!
//! Invariant: every destination call the ledger makes has a deadline ([`within`]); no
//! answer in time is an unknown outcome, never a failure, because the request may have
//! arrived.

use std::future::Future;
use std::time::Duration;

use serde_json::Value;

/// One effect as a destination sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Effect {
    /// The ledger row's id.
    pub id: i64,
    /// The caller's idempotency key (`outbox_effects.effect_key`), unique per effect; destinations with lookup find the item by it.
    pub key: String,
    /// The destination's name ([`Destination::name`]).
    pub destination: String,
    /// What to send, as enqueued.
    pub payload: Value,
    /// Claims so far, this one included.
    pub attempts: i32,
}

/// A destination's answer that was not a success.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DestinationError {
    /// Refused for now and certainly not performed (5xx, 429, connection refused): retry
    /// with backoff.
    #[error("destination refused for now: {0}")]
    Transient(String),
    /// Maybe performed (a timeout after the request left): look it up before trying again.
    #[error("destination outcome unknown: {0}")]
    Unknown(String),
    /// Refused for good (invalid address, rejected): do not retry.
    #[error("destination rejected it: {0}")]
    Terminal(String),
}

impl DestinationError {
    /// Whether trying again later can help: everything but [`DestinationError::Terminal`].
    pub fn is_transient(&self) -> bool {
        !matches!(self, DestinationError::Terminal(_))
    }
}

/// Where effects go. Adapters implement it; `send` must be safe to call once per claim.
pub trait Destination: Send + Sync {
    /// The name stored in `outbox_effects.destination`.
    fn name(&self) -> &str;

    /// Performs the effect; returns the destination's id for it (used to delete it).
    fn send(
        &self,
        effect: &Effect,
    ) -> impl Future<Output = Result<String, DestinationError>> + Send;

    /// Withdraws a performed effect by the id `send` returned.
    fn delete(
        &self,
        external_id: &str,
    ) -> impl Future<Output = Result<(), DestinationError>> + Send;

    /// Whether [`Destination::lookup`] works. Without it, an effect whose outcome is
    /// unknown is left for review instead of being sent again.
    fn supports_lookup(&self) -> bool {
        false
    }

    /// Finds the effect at the destination by its key; `Some(external_id)` if it is there.
    fn lookup(
        &self,
        effect: &Effect,
    ) -> impl Future<Output = Result<Option<String>, DestinationError>> + Send {
        let _ = effect;
        async { Err(DestinationError::Terminal("lookup is not supported".into())) }
    }
}

/// Runs a destination call with a deadline; no answer in time is an unknown outcome.
pub(super) async fn within<T>(
    limit: Duration,
    what: &str,
    fut: impl Future<Output = Result<T, DestinationError>>,
) -> Result<T, DestinationError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(DestinationError::Unknown(format!(
            "{what}: no answer within {limit:?}"
        ))),
    }
}
