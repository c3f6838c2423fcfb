//! Budgets: how much a tenant may still spend per quota key, and the reservation each
//! effect holds against it.
//!
//! Invariants (enforced in SQL): per budget, granted = remaining + held + consumed; an effect
//! holds at most one reservation; a reservation is taken in the same transaction as the
//! claim (or the enqueue) and out of budget raises SQLSTATE `OB001`, which aborts that
//! transaction, so a claim never exists without its reservation. Terminal failure and
//! cancel release; success consumes.

use tokio_postgres::GenericClient;

use crate::db::{DbError, deadline};

const SET: &str = "SELECT outbox_budget_set($1, $2, $3)";
const TOTALS: &str = "
SELECT b.remaining,
       coalesce(sum(r.amount) FILTER (WHERE r.state = 'held'), 0)::bigint,
       coalesce(sum(r.amount) FILTER (WHERE r.state = 'consumed'), 0)::bigint
  FROM outbox_budgets b
  LEFT JOIN outbox_budget_reservations r ON r.tenant = b.tenant AND r.quota_key = b.quota_key
 WHERE b.tenant = $1 AND b.quota_key = $2
 GROUP BY b.remaining";

/// The SQLSTATE `outbox_budget_reserve` raises when a budget is too small.
pub(crate) const OUT_OF_BUDGET: &str = "OB001";

/// Why a reservation was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "out of budget: tenant '{tenant}' has {remaining} of '{quota_key}' left and needs {needed}; \
     raise the budget (outbox_budget_set) or cancel the effect"
)]
pub struct OutOfBudget {
    /// Whose budget.
    pub tenant: String,
    /// Which of the tenant's quotas.
    pub quota_key: String,
    /// What the effect costs.
    pub needed: i64,
    /// What the budget has left.
    pub remaining: i64,
}

impl OutOfBudget {
    /// Recognizes the `OB001` error; its DETAIL is a JSON object with the numbers.
    pub(crate) fn from_db(e: &tokio_postgres::Error) -> Option<OutOfBudget> {
        let db = e.as_db_error()?;
        if db.code().code() != OUT_OF_BUDGET {
            return None;
        }
        let detail: serde_json::Value = db
            .detail()
            .and_then(|d| serde_json::from_str(d).ok())
            .unwrap_or_default();
        Some(OutOfBudget {
            tenant: detail["tenant"].as_str().unwrap_or_default().to_owned(),
            quota_key: detail["quota_key"].as_str().unwrap_or_default().to_owned(),
            needed: detail["needed"].as_i64().unwrap_or_default(),
            remaining: detail["remaining"].as_i64().unwrap_or_default(),
        })
    }
}

/// What a budget holds right now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Still free to reserve.
    pub remaining: i64,
    /// Reserved by effects not finished yet.
    pub held: i64,
    /// Spent by effects that were sent.
    pub consumed: i64,
}

impl Totals {
    /// What the budget was granted in all (what was released went back to `remaining`).
    pub fn granted(&self) -> i64 {
        self.remaining + self.held + self.consumed
    }
}

/// Sets a budget's remaining amount (creates it).
pub async fn set(
    client: &impl GenericClient,
    tenant: &str,
    quota_key: &str,
    remaining: i64,
) -> Result<(), DbError> {
    deadline(client.execute(SET, &[&tenant, &quota_key, &remaining])).await?;
    Ok(())
}

/// The budget's remaining, held and consumed amounts (None: no such budget).
pub async fn totals(
    client: &impl GenericClient,
    tenant: &str,
    quota_key: &str,
) -> Result<Option<Totals>, DbError> {
    let row = deadline(client.query_opt(TOTALS, &[&tenant, &quota_key])).await?;
    Ok(row.map(|r| Totals {
        remaining: r.get(0),
        held: r.get(1),
        consumed: r.get(2),
    }))
}
