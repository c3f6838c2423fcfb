//! The effects ledger: side effects outside the database (an email, a payment, a webhook)
//! claimed in Postgres before they are performed, so a redelivered message never performs
//! one twice.
//!
//! Invariants (each a SQL function of `sql/0003_consumer.sql`, each with a test):
//! - claim is one UPDATE `queued → sending` with `claimed_by`; send only if it returned a row;
//! - the budget is reserved in the claim's statement; out of budget rolls the claim back;
//! - success is written back only while the row is still ours (`sending`, `claimed_by` = me,
//!   no cancel requested); otherwise our item is withdrawn at the destination, with a warning;
//! - failed never overwrites sent;
//! - an attempt whose outcome is unknown (timeout) is never sent again blindly: the next
//!   claimer looks it up first, and a destination without lookup leaves it for review;
//! - cancel deletes at the destination first and says cancelled only if that worked.
//!
//! Each step commits on its own: the claim must be durable before the send, so the steps
//! take a plain [`Client`] (a connection in autocommit), never a transaction.

use std::future::Future;
use std::time::Duration;

use serde_json::Value;
use tokio_postgres::{Client, GenericClient};

use crate::consumer::budget::OutOfBudget;
use crate::contract::ConfigError;
use crate::db::{DbError, deadline};

const ENQUEUE: &str = "SELECT outbox_effect_enqueue($1, $2, $3, $4, $5, $6, $7)";
const CLAIM: &str = "SELECT id, effect_key, destination, payload, attempts, uncertain, external_id
                       FROM outbox_effect_claim($1, $2, $3)";
const COMPLETE: &str = "SELECT outbox_effect_complete($1, $2, $3)";
const FAIL: &str = "SELECT outbox_effect_fail($1, $2, $3)";
const RETRY: &str = "SELECT outbox_effect_retry($1, $2, $3, $4)";
const CANCEL: &str = "SELECT action, effect_id, external_id FROM outbox_effect_cancel($1)";
const WITHDRAWN: &str = "SELECT outbox_effect_withdrawn($1, $2)";
const WITHDRAW_FAILED: &str = "SELECT outbox_effect_withdraw_failed($1, $2, $3)";
const GET: &str = "SELECT id, effect_key, destination, payload, state, claimed_by, external_id,
                          attempts, last_error, uncertain, cancel_requested_at IS NOT NULL,
                          withdrawn_at IS NOT NULL
                     FROM outbox_effects WHERE effect_key = $1";

/// How long a write-back (complete, fail, retry) may take; part of every lease.
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// One effect as a destination sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Effect {
    pub id: i64,
    pub key: String,
    pub destination: String,
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
    InDoubt { key: String, reason: String },
    /// The database failed.
    #[error(transparent)]
    Db(#[from] DbError),
}

impl EffectError {
    /// Transient: the database, or a destination that may take it later.
    pub fn is_transient(&self) -> bool {
        match self {
            EffectError::OutOfBudget(_) | EffectError::InDoubt { .. } => false,
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

fn db_or_budget(e: DbError) -> EffectError {
    match e {
        DbError::Postgres(pg) => EffectError::from_pg(pg),
        other => EffectError::Db(other),
    }
}

/// An effect's state (`outbox_effects.state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EffectState {
    Queued,
    Sending,
    Sent,
    Failed,
    Cancelled,
}

impl EffectState {
    pub fn parse(s: &str) -> Option<EffectState> {
        Some(match s {
            "queued" => EffectState::Queued,
            "sending" => EffectState::Sending,
            "sent" => EffectState::Sent,
            "failed" => EffectState::Failed,
            "cancelled" => EffectState::Cancelled,
            _ => return None,
        })
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            EffectState::Queued => "queued",
            EffectState::Sending => "sending",
            EffectState::Sent => "sent",
            EffectState::Failed => "failed",
            EffectState::Cancelled => "cancelled",
        }
    }
}

/// A new effect. `budget` is (tenant, quota key, cost).
#[derive(Clone, Debug)]
pub struct NewEffect<'a> {
    pub key: &'a str,
    pub destination: &'a str,
    pub payload: Value,
    pub budget: Option<(&'a str, &'a str, i64)>,
    /// Reserve the budget now (in the caller's transaction) rather than at the claim.
    pub reserve_now: bool,
}

/// A ledger row as it is (for callers that inspect, and for tests).
#[derive(Clone, Debug, PartialEq)]
pub struct EffectRow {
    pub effect: Effect,
    pub state: EffectState,
    pub claimed_by: Option<String>,
    pub external_id: Option<String>,
    pub last_error: Option<String>,
    pub uncertain: bool,
    pub cancel_requested: bool,
    pub withdrawn: bool,
}

/// What `complete` found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// Written: the effect is `sent` and its reservation consumed.
    Sent,
    /// Still ours, but a cancel was requested meanwhile: withdraw the item.
    CancelRequested,
    /// Not ours any more (the reconciler or an operator changed it); the state it has.
    NotOurs(String),
}

/// What `perform` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Performed {
    /// Sent now, or found at the destination by lookup after an unknown outcome.
    Sent {
        external_id: String,
        found_by_lookup: bool,
    },
    /// Not claimed: someone else is sending it, or it is finished. Nothing was sent.
    NotClaimed { state: Option<EffectState> },
    /// Cancelled while we were sending: our item was withdrawn at the destination.
    Withdrawn { external_id: String },
    /// Cancelled while we were sending, but the destination did not delete it: still out.
    StillOut { external_id: String, error: String },
    /// Cancelled while we were sending, and the send did not go out: nothing to withdraw.
    Cancelled,
}

/// What `cancel` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// It was queued: nothing went out; the reservation was released.
    Cancelled,
    /// It was out and the destination deleted it.
    Withdrawn { external_id: String },
    /// It is out and the destination did not delete it; the ledger says sent, with the error.
    StillOut { external_id: String, error: String },
    /// It is being sent; its claimer withdraws it as soon as its send returns.
    Pending,
    /// It was already finished (failed or cancelled) or does not exist.
    Unchanged(Option<EffectState>),
}

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

/// The ledger API for one worker. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Ledger {
    cfg: EffectsConfig,
}

async fn within<T>(
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

impl Ledger {
    pub fn new(cfg: EffectsConfig) -> Ledger {
        Ledger { cfg }
    }

    pub fn config(&self) -> &EffectsConfig {
        &self.cfg
    }

    pub fn worker(&self) -> &str {
        &self.cfg.worker
    }

    /// Adds a queued effect once per key (in the caller's transaction, if it passes one);
    /// returns its id. With `reserve_now`, out of budget fails here.
    pub async fn enqueue(
        client: &impl GenericClient,
        effect: &NewEffect<'_>,
    ) -> Result<i64, EffectError> {
        let (tenant, quota, cost) = match effect.budget {
            Some((t, q, c)) => (Some(t), Some(q), Some(c)),
            None => (None, None, None),
        };
        let row = deadline(client.query_one(
            ENQUEUE,
            &[
                &effect.key,
                &effect.destination,
                &effect.payload,
                &tenant,
                &quota,
                &cost,
                &effect.reserve_now,
            ],
        ))
        .await
        .map_err(db_or_budget)?;
        Ok(row.get(0))
    }

    /// The row for `key`, if any.
    pub async fn get(client: &impl GenericClient, key: &str) -> Result<Option<EffectRow>, DbError> {
        let row = deadline(client.query_opt(GET, &[&key])).await?;
        Ok(row.map(|r| EffectRow {
            effect: Effect {
                id: r.get(0),
                key: r.get(1),
                destination: r.get(2),
                payload: r.get(3),
                attempts: r.get(7),
            },
            state: EffectState::parse(r.get(4)).unwrap_or(EffectState::Failed),
            claimed_by: r.get(5),
            external_id: r.get(6),
            last_error: r.get(8),
            uncertain: r.get(9),
            cancel_requested: r.get(10),
            withdrawn: r.get(11),
        }))
    }

    /// Claims `key` for this worker (queued → sending) and reserves its budget, in one
    /// statement. `None`: it was not queued; do not send.
    pub async fn claim(&self, client: &Client, key: &str) -> Result<Option<Claimed>, EffectError> {
        let lease = self.cfg.lease.as_secs_f64();
        let row = deadline(client.query_opt(CLAIM, &[&key, &self.cfg.worker, &lease]))
            .await
            .map_err(db_or_budget)?;
        Ok(row.map(|r| Claimed {
            effect: Effect {
                id: r.get(0),
                key: r.get(1),
                destination: r.get(2),
                payload: r.get(3),
                attempts: r.get(4),
            },
            uncertain: r.get(5),
        }))
    }

    /// Writes success back while the row is still ours.
    pub async fn complete(
        &self,
        client: &Client,
        effect_id: i64,
        external_id: &str,
    ) -> Result<Completion, DbError> {
        let row = self
            .write(client.query_one(COMPLETE, &[&effect_id, &self.cfg.worker, &external_id]))
            .await?;
        let state: String = row.get(0);
        Ok(match state.as_str() {
            "sent" => Completion::Sent,
            "cancel_requested" => Completion::CancelRequested,
            _ => Completion::NotOurs(state),
        })
    }

    /// Marks the effect failed (from queued, or from sending while ours) and releases its
    /// reservation. False: it was not ours or already finished; `sent` is never overwritten.
    pub async fn fail(
        &self,
        client: &Client,
        effect_id: i64,
        error: &str,
    ) -> Result<bool, DbError> {
        let worker = Some(self.cfg.worker.as_str());
        Ok(self
            .write(client.query_one(FAIL, &[&effect_id, &worker, &error]))
            .await?
            .get(0))
    }

    /// Gives our claim back after a transient error (queued again, reservation kept);
    /// `uncertain` makes the next claimer look it up before sending. Returns the state the
    /// row has afterwards: `Queued`; `Cancelled` (a cancel was waiting and nothing went out);
    /// `Sending` (a cancel was waiting and it may be out: look it up); or what it was when
    /// it was not ours.
    pub async fn retry(
        &self,
        client: &Client,
        effect_id: i64,
        error: &str,
        uncertain: bool,
    ) -> Result<Option<EffectState>, DbError> {
        let row = self
            .write(client.query_one(RETRY, &[&effect_id, &self.cfg.worker, &error, &uncertain]))
            .await?;
        Ok(EffectState::parse(row.get(0)))
    }

    async fn write<T>(
        &self,
        fut: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, DbError> {
        match tokio::time::timeout(self.cfg.write_timeout, fut).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(DbError::Timeout(self.cfg.write_timeout)),
        }
    }

    /// Claim, send, write back: the whole rule set for one effect.
    ///
    /// Errors leave the ledger consistent: transient destination errors queue the effect
    /// again (with the reservation), terminal ones fail it (releasing the reservation),
    /// out of budget leaves it queued and unclaimed.
    pub async fn perform<D: Destination>(
        &self,
        client: &Client,
        key: &str,
        dest: &D,
    ) -> Result<Performed, EffectError> {
        let Some(claimed) = self.claim(client, key).await? else {
            let state = Ledger::get(client, key).await?.map(|r| r.state);
            return Ok(Performed::NotClaimed { state });
        };
        let effect = &claimed.effect;
        if claimed.uncertain {
            if !dest.supports_lookup() {
                return Err(EffectError::InDoubt {
                    key: key.to_owned(),
                    reason: "an earlier attempt's outcome is unknown".into(),
                });
            }
            match within(self.cfg.send_timeout, "lookup", dest.lookup(effect)).await {
                Ok(Some(external_id)) => {
                    return self
                        .written_back(client, effect, dest, external_id, true)
                        .await;
                }
                Ok(None) => {} // it never arrived: sending is not blind now
                Err(e) => return self.not_sent(client, effect, dest, e).await,
            }
        }
        match within(self.cfg.send_timeout, "send", dest.send(effect)).await {
            Ok(external_id) => {
                self.written_back(client, effect, dest, external_id, false)
                    .await
            }
            Err(e) => self.not_sent(client, effect, dest, e).await,
        }
    }

    async fn not_sent<D: Destination>(
        &self,
        client: &Client,
        effect: &Effect,
        dest: &D,
        e: DestinationError,
    ) -> Result<Performed, EffectError> {
        match &e {
            DestinationError::Terminal(reason) => {
                self.fail(client, effect.id, reason).await?;
            }
            DestinationError::Transient(reason) => {
                if self.retry(client, effect.id, reason, false).await?
                    == Some(EffectState::Cancelled)
                {
                    return Ok(Performed::Cancelled);
                }
            }
            DestinationError::Unknown(reason) => {
                if !dest.supports_lookup() {
                    // Left in sending: the reconciler lists it once the lease ran out.
                    tracing::warn!(target: "outbox_relay", effect = effect.key, reason, "effect outcome unknown and the destination has no lookup; left for review");
                    return Err(EffectError::InDoubt {
                        key: effect.key.clone(),
                        reason: reason.clone(),
                    });
                }
                if self.retry(client, effect.id, reason, true).await? == Some(EffectState::Sending)
                {
                    // A cancel is waiting and the item may be out: find it and withdraw it.
                    let found = within(self.cfg.send_timeout, "lookup", dest.lookup(effect)).await;
                    if let Ok(Some(external_id)) = found {
                        return Ok(withdraw(
                            client,
                            dest,
                            effect.id,
                            &external_id,
                            self.cfg.send_timeout,
                        )
                        .await?);
                    }
                    return Err(EffectError::InDoubt {
                        key: effect.key.clone(),
                        reason: format!(
                            "cancel requested and the outcome is unknown ({reason}); the reconciler looks it up after the lease"
                        ),
                    });
                }
            }
        }
        Err(EffectError::Destination(e))
    }

    async fn written_back<D: Destination>(
        &self,
        client: &Client,
        effect: &Effect,
        dest: &D,
        external_id: String,
        found_by_lookup: bool,
    ) -> Result<Performed, EffectError> {
        match self.complete(client, effect.id, &external_id).await? {
            Completion::Sent => Ok(Performed::Sent {
                external_id,
                found_by_lookup,
            }),
            Completion::CancelRequested => {
                Ok(withdraw(client, dest, effect.id, &external_id, self.cfg.send_timeout).await?)
            }
            Completion::NotOurs(state) => {
                // Someone decided about this row while we were sending. If it already says
                // sent with our item, all is well; otherwise our item must not stay out.
                let row = Ledger::get(client, &effect.key).await?;
                if let Some(r) = &row
                    && r.state == EffectState::Sent
                    && r.external_id.as_deref() == Some(external_id.as_str())
                {
                    return Ok(Performed::Sent {
                        external_id,
                        found_by_lookup,
                    });
                }
                tracing::warn!(target: "outbox_relay", effect = effect.key, state, "effect changed while we were sending it; withdrawing our item at the destination");
                let gone = within(self.cfg.send_timeout, "delete", dest.delete(&external_id)).await;
                match gone {
                    Ok(()) => Ok(Performed::Withdrawn { external_id }),
                    Err(e) => Ok(Performed::StillOut {
                        external_id,
                        error: e.to_string(),
                    }),
                }
            }
        }
    }

    /// Cancels `key`: queued → cancelled; out → deleted at the destination first, and
    /// cancelled only if that worked; being sent → its claimer withdraws it.
    pub async fn cancel<D: Destination>(
        &self,
        client: &Client,
        key: &str,
        dest: &D,
    ) -> Result<Cancelled, EffectError> {
        let row = deadline(client.query_one(CANCEL, &[&key])).await?;
        let action: String = row.get(0);
        let effect_id: Option<i64> = row.get(1);
        let external_id: Option<String> = row.get(2);
        match (action.as_str(), effect_id, external_id) {
            ("cancelled", _, _) => Ok(Cancelled::Cancelled),
            ("pending", _, _) => Ok(Cancelled::Pending),
            ("withdraw", Some(id), Some(ext)) => Ok(
                match withdraw(client, dest, id, &ext, self.cfg.send_timeout).await? {
                    Performed::Withdrawn { external_id } => Cancelled::Withdrawn { external_id },
                    Performed::StillOut { external_id, error } => {
                        Cancelled::StillOut { external_id, error }
                    }
                    _ => unreachable!("withdraw returns Withdrawn or StillOut"),
                },
            ),
            (state, _, _) => Ok(Cancelled::Unchanged(EffectState::parse(state))),
        }
    }
}

/// Deletes our item at the destination and records the truth either way.
async fn withdraw<D: Destination>(
    client: &Client,
    dest: &D,
    effect_id: i64,
    external_id: &str,
    limit: Duration,
) -> Result<Performed, DbError> {
    match within(limit, "delete", dest.delete(external_id)).await {
        Ok(()) => {
            deadline(client.query_one(WITHDRAWN, &[&effect_id, &external_id])).await?;
            Ok(Performed::Withdrawn {
                external_id: external_id.to_owned(),
            })
        }
        Err(e) => {
            let error = e.to_string();
            tracing::warn!(target: "outbox_relay", effect_id, external_id, error, "cancel requested but the destination did not withdraw the item: it is still out");
            deadline(client.execute(WITHDRAW_FAILED, &[&effect_id, &external_id, &error])).await?;
            Ok(Performed::StillOut {
                external_id: external_id.to_owned(),
                error,
            })
        }
    }
}

/// A claim this worker holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Claimed {
    pub effect: Effect,
    /// An earlier attempt may have reached the destination: look it up before sending.
    pub uncertain: bool,
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
