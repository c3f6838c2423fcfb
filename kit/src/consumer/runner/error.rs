//! What a handler may return: [`HandlerError`], typed; transient or terminal decides
//! retry (a retry tier, or in place in an ordered group) versus dead letter. Its own file,
//! so that `message` (whose [`super::Message::payload`] fails with it) and `handler` (whose
//! trait returns it) both depend on it and not on each other.

use crate::consumer::effects::EffectError;
use crate::db::DbError;

/// Why a handler did not apply a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// Try again later (with backoff): a dependency is down, a destination said 5xx.
    #[error("transient: {0}")]
    Transient(String),
    /// Never going to work: recorded and dead-lettered.
    #[error("terminal: {0}")]
    Terminal(String),
    /// The database failed; transient when [`DbError::is_transient`] says so.
    #[error(transparent)]
    Db(#[from] DbError),
    /// An effects-ledger step failed; transient when [`EffectError::is_transient`] says so.
    #[error(transparent)]
    Effect(#[from] EffectError),
}

impl HandlerError {
    /// Whether the message goes to a retry queue (true) or to the dead-letter exchange.
    pub fn is_transient(&self) -> bool {
        match self {
            HandlerError::Transient(_) => true,
            HandlerError::Terminal(_) => false,
            HandlerError::Db(e) => e.is_transient(),
            HandlerError::Effect(e) => e.is_transient(),
        }
    }
}

impl HandlerError {
    /// Whether this is a wait rather than a failure: an effect that must wait for an
    /// earlier one of its order key ([`EffectError::Behind`]) or for another live claim
    /// ([`EffectError::InFlight`]), or a database that gave no connection
    /// ([`DbError::is_no_connection`]: at its connection limit, restarting, out of reach),
    /// which is no fault of the event. A wait is retried with backoff like a transient
    /// error but spends none of the event's `max_attempts`: the event waits as long as what
    /// it waits for, as a held key does.
    pub fn is_wait(&self) -> bool {
        match self {
            HandlerError::Effect(EffectError::Behind { .. } | EffectError::InFlight { .. }) => true,
            HandlerError::Db(e) | HandlerError::Effect(EffectError::Db(e)) => e.is_no_connection(),
            _ => false,
        }
    }
}

impl From<tokio_postgres::Error> for HandlerError {
    fn from(e: tokio_postgres::Error) -> Self {
        HandlerError::Db(e.into())
    }
}
