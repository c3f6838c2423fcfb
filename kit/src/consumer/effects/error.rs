//! [`EffectError`]: how an effects-ledger step failed, and whether retrying can help.
//!
//! Invariant: out of budget (SQLSTATE `OB001`) is told apart from other database errors
//! wherever a statement can reserve a budget ([`db_or_budget`]).

use crate::consumer::budget::OutOfBudget;
use crate::db::DbError;

use super::DestinationError;

/// An effects-ledger error at the module boundary.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EffectError {
    /// The budget cannot cover the effect; the claim was rolled back (still queued).
    #[error(transparent)]
    OutOfBudget(#[from] OutOfBudget),
    /// The destination did not perform it; the ledger says what happens next (queued again
    /// for transient and unknown-with-lookup, failed for terminal).
    #[error(transparent)]
    Destination(#[from] DestinationError),
    /// The outcome is unknown and the destination has no lookup: the effect stays in
    /// `sending` for review by the reconciler; it is not sent again.
    #[error(
        "effect {key}: outcome unknown ({reason}) and the destination has no lookup; left in sending for review"
    )]
    InDoubt {
        /// The effect's key.
        key: String,
        /// Why its outcome is unknown.
        reason: String,
    },
    /// The claim was held so long before its send (a paused process, a claim that waited
    /// on a lock) that its lease might have run out; nothing was sent and the claim was
    /// given back. Transient: claiming again gives a fresh lease.
    #[error(
        "effect {key}: claim held {held:?} before sending, past what its lease covers; given back unsent"
    )]
    LeaseRunOut {
        /// The effect's key.
        key: String,
        /// How long the claim had been held.
        held: std::time::Duration,
    },
    /// The database failed.
    #[error(transparent)]
    Db(#[from] DbError),
}

impl EffectError {
    /// Transient: the database, or a destination that may take it later.
    pub fn is_transient(&self) -> bool {
        match self {
            EffectError::OutOfBudget(_) | EffectError::InDoubt { .. } => false,
            EffectError::LeaseRunOut { .. } => true,
            EffectError::Destination(e) => e.is_transient(),
            EffectError::Db(e) => e.is_transient(),
        }
    }

    fn from_pg(e: tokio_postgres::Error) -> EffectError {
        match OutOfBudget::from_db(&e) {
            Some(o) => EffectError::OutOfBudget(o),
            None => EffectError::Db(e.into()),
        }
    }
}

pub(super) fn db_or_budget(e: DbError) -> EffectError {
    match e {
        DbError::Postgres(pg) => EffectError::from_pg(pg),
        other => EffectError::Db(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_terminal_destination_errors_are_final() {
        assert!(DestinationError::Transient("503".into()).is_transient());
        assert!(DestinationError::Unknown("timeout".into()).is_transient());
        assert!(!DestinationError::Terminal("invalid address".into()).is_transient());
        let in_doubt = EffectError::InDoubt {
            key: "k".into(),
            reason: "timeout".into(),
        };
        assert!(!in_doubt.is_transient());
    }
}
