//! [`EffectError`]: how an effects-ledger step failed, and whether retrying can help.
//!
//! Invariant: out of budget (SQLSTATE `OB001`) and an earlier effect of the same order key
//! still unresolved (`OB003`) are told apart from other database errors wherever a claim or
//! an enqueue can raise them ([`db_or_budget`]).

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
    /// An earlier effect of the same order key is still queued or being sent: this one must
    /// not go out before it. Nothing was claimed. Transient: retry (the event, in a handler)
    /// until the earlier one is sent, failed or cancelled.
    #[error(
        "effect {key} waits for the earlier effect {earlier} ({state}) of order key {order_key}; retry once that one is resolved"
    )]
    Behind {
        /// The effect's key.
        key: String,
        /// The earliest unresolved effect of its order key.
        earlier: String,
        /// That effect's state (`queued` or `sending`).
        state: String,
        /// The order key they share.
        order_key: String,
    },
    /// Another claim on this effect is live (its lease has not run out): its claimer may be
    /// sending it right now. Not done: transient, retry once that claim is resolved (by its
    /// claimer, or after its lease by a take-over with lookup, the reconciler or an operator).
    #[error(
        "effect {key} is being sent under another claim ({claimed_by}); retry once that claim is resolved"
    )]
    InFlight {
        /// The effect's key.
        key: String,
        /// The worker that holds the claim.
        claimed_by: String,
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
            EffectError::LeaseRunOut { .. }
            | EffectError::Behind { .. }
            | EffectError::InFlight { .. } => true,
            EffectError::Destination(e) => e.is_transient(),
            EffectError::Db(e) => e.is_transient(),
        }
    }

    fn from_pg(e: tokio_postgres::Error) -> EffectError {
        if let Some(o) = OutOfBudget::from_db(&e) {
            return EffectError::OutOfBudget(o);
        }
        if let Some(behind) = behind(&e) {
            return behind;
        }
        EffectError::Db(e.into())
    }
}

/// The SQLSTATE `outbox_effect_claim` raises while an earlier effect of the order key is
/// unresolved.
const EARLIER_UNRESOLVED: &str = "OB003";

/// Recognizes the `OB003` error; its DETAIL is a JSON object naming both effects.
fn behind(e: &tokio_postgres::Error) -> Option<EffectError> {
    let db = e.as_db_error()?;
    if db.code().code() != EARLIER_UNRESOLVED {
        return None;
    }
    let detail: serde_json::Value = db
        .detail()
        .and_then(|d| serde_json::from_str(d).ok())
        .unwrap_or_default();
    let field = |name: &str| detail[name].as_str().unwrap_or_default().to_owned();
    Some(EffectError::Behind {
        key: field("effect_key"),
        earlier: field("earlier"),
        state: field("state"),
        order_key: field("order_key"),
    })
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
