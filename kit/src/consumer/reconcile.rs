//! The reconciler: settles what dead workers left behind, and deletes old ledger and inbox
//! rows.
//!
//! An effect still in `sending` after its claim's lease ran out and at least `stuck_after`
//! after its claim has lost its worker: the send may or may not have reached the destination.
//! With the destination's lookup the reconciler finds out (there: `sent`; not there: queued
//! again and sent, now knowingly); without lookup it lists the effect for review. It never
//! sends one again blindly. Every verdict is fenced on the claimer it saw, so a worker that
//! comes back in time keeps its row.
//!
//! Usually a worker gets there first: `Ledger::perform` takes over a claim whose lease ran out
//! when its destination has a lookup (`sql/0016_effect_order.sql`), since the key's later
//! effects wait for it. What is left here are effects nobody performs again, and those of
//! destinations without lookup, which only review can settle.
//!
//! Invariant: `stuck_after` is longer than the send timeout it guards and `retention` longer
//! than `stuck_after` ([`ReconcileConfig::new`] refuses anything else), and rows in `sending`
//! or `queued` are never deleted by retention.

use std::num::NonZeroUsize;
use std::time::{Duration, SystemTime};

use tokio_postgres::{Client, GenericClient};

use crate::consumer::effects::{Destination, EffectError, Ledger, Performed};
use crate::contract::ConfigError;
use crate::db::{DbError, deadline};

const STUCK: &str = "SELECT id, effect_key, destination, claimed_by, claimed_at, attempts,
                            cancel_requested, last_error
                       FROM outbox_effect_stuck($1, $2)";
const RESOLVE: &str = "SELECT outbox_effect_resolve($1, $2, $3, $4)";
const CANCEL: &str = "SELECT action FROM outbox_effect_cancel($1)";
const WITHDRAWN: &str = "SELECT outbox_effect_withdrawn($1, $2)";
const WITHDRAW_FAILED: &str = "SELECT outbox_effect_withdraw_failed($1, $2, $3)";
const PRUNE: &str = "SELECT effects_deleted, inbox_deleted
                       FROM outbox_consumer_prune(now() - make_interval(secs => $1), $2)";

/// The reconciler's thresholds, checked against the timeouts they guard.
#[derive(Clone, Debug)]
pub struct ReconcileConfig {
    /// How long after its claim an effect in `sending` (with its lease run out) counts as stuck.
    pub stuck_after: Duration,
    /// How long finished effects and inbox rows are kept.
    pub retention: Duration,
    /// Rows per statement, for the stuck list and for each prune round.
    pub batch_size: NonZeroUsize,
}

impl ReconcileConfig {
    /// `send_timeout`: the longest destination call any worker allows. A threshold shorter
    /// than it would judge sends that are still running.
    pub fn new(
        stuck_after: Duration,
        retention: Duration,
        batch_size: NonZeroUsize,
        send_timeout: Duration,
    ) -> Result<ReconcileConfig, ConfigError> {
        if stuck_after <= send_timeout {
            return Err(ConfigError::new(
                "--stuck-after",
                format!(
                    "{} is not longer than --send-timeout {}: an effect still being sent would be judged stuck",
                    humantime::format_duration(stuck_after),
                    humantime::format_duration(send_timeout)
                ),
            ));
        }
        if retention <= stuck_after {
            return Err(ConfigError::new(
                "--retention",
                format!(
                    "{} is not longer than --stuck-after {}: keep finished rows longer than it takes to notice a stuck one",
                    humantime::format_duration(retention),
                    humantime::format_duration(stuck_after)
                ),
            ));
        }
        Ok(ReconcileConfig {
            stuck_after,
            retention,
            batch_size,
        })
    }
}

/// An effect left in `sending` by a worker that is gone.
#[derive(Clone, Debug, PartialEq)]
pub struct Stuck {
    /// The ledger row's id.
    pub id: i64,
    /// The effect's key.
    pub key: String,
    /// The destination's name.
    pub destination: String,
    /// The worker that claimed it.
    pub claimed_by: String,
    /// When it was claimed.
    pub claimed_at: SystemTime,
    /// Claims so far.
    pub attempts: i32,
    /// A cancel is waiting for it.
    pub cancel_requested: bool,
    /// Why the last attempt failed, if one did.
    pub last_error: Option<String>,
}

/// What the reconciler decided about one stuck effect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// The destination has it: recorded as sent.
    Found {
        /// The destination's id for it.
        external_id: String,
    },
    /// The destination does not have it: queued again and sent now.
    Resent {
        /// The destination's id for it.
        external_id: String,
    },
    /// The destination does not have it: queued again (someone else took it, or the send
    /// failed and the ledger recorded why).
    Requeued {
        /// What happened to the resend.
        detail: String,
    },
    /// A cancel was waiting: the item was withdrawn, or had never arrived.
    Cancelled,
    /// A cancel was waiting but the destination did not delete the item: still out.
    StillOut {
        /// Why the destination did not delete it.
        error: String,
    },
    /// Another worker or an operator settled it first.
    Raced,
}

/// What one reconcile pass did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Stuck effects settled through their destination's lookup, with the verdict.
    pub resolved: Vec<(Stuck, Resolution)>,
    /// Stuck effects nobody could settle (no lookup for their destination): for review.
    pub review: Vec<Stuck>,
    /// Finished effects deleted by retention.
    pub effects_deleted: u64,
    /// Inbox rows deleted by retention.
    pub inbox_deleted: u64,
}

/// Effects stuck in `sending` (lease run out, claimed more than `stuck_after` ago).
pub async fn stuck(
    client: &impl GenericClient,
    cfg: &ReconcileConfig,
) -> Result<Vec<Stuck>, DbError> {
    let limit = cfg.batch_size.get().min(i32::MAX as usize) as i32;
    let rows = deadline(client.query(STUCK, &[&cfg.stuck_after.as_secs_f64(), &limit])).await?;
    Ok(rows
        .iter()
        .map(|r| Stuck {
            id: r.get(0),
            key: r.get(1),
            destination: r.get(2),
            claimed_by: r.get::<_, Option<String>>(3).unwrap_or_default(),
            claimed_at: r.get(4),
            attempts: r.get(5),
            cancel_requested: r.get(6),
            last_error: r.get(7),
        })
        .collect())
}

/// Settles one stuck effect through the destination's lookup. Call only when
/// `dest.supports_lookup()`; `ledger` is the reconciler's own worker identity for a resend.
pub async fn resolve<D: Destination>(
    client: &Client,
    ledger: &Ledger,
    s: &Stuck,
    dest: &D,
) -> Result<Resolution, EffectError> {
    let effect = crate::consumer::Effect {
        id: s.id,
        key: s.key.clone(),
        destination: s.destination.clone(),
        payload: serde_json::Value::Null,
        attempts: s.attempts,
    };
    let limit = ledger.config().send_timeout;
    let found = match tokio::time::timeout(limit, dest.lookup(&effect)).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(EffectError::Destination(
                crate::consumer::DestinationError::Unknown(format!(
                    "lookup: no answer within {limit:?}"
                )),
            ));
        }
    };
    match (found, s.cancel_requested) {
        (Some(external_id), false) => {
            let done: bool = deadline(client.query_one(
                RESOLVE,
                &[&s.id, &s.claimed_by, &"sent", &Some(external_id.as_str())],
            ))
            .await?
            .get(0);
            Ok(if done {
                Resolution::Found { external_id }
            } else {
                Resolution::Raced
            })
        }
        (Some(external_id), true) => {
            match tokio::time::timeout(limit, dest.delete(&external_id)).await {
                Ok(Ok(())) => {
                    deadline(client.query_one(WITHDRAWN, &[&s.id, &external_id])).await?;
                    Ok(Resolution::Cancelled)
                }
                Ok(Err(e)) => {
                    let error = e.to_string();
                    deadline(client.execute(WITHDRAW_FAILED, &[&s.id, &external_id, &error]))
                        .await?;
                    Ok(Resolution::StillOut { error })
                }
                Err(_) => {
                    let error = format!("delete: no answer within {limit:?}");
                    deadline(client.execute(WITHDRAW_FAILED, &[&s.id, &external_id, &error]))
                        .await?;
                    Ok(Resolution::StillOut { error })
                }
            }
        }
        (None, cancel_requested) => {
            let none: Option<&str> = None;
            let requeued: bool =
                deadline(client.query_one(RESOLVE, &[&s.id, &s.claimed_by, &"queued", &none]))
                    .await?
                    .get(0);
            if !requeued {
                return Ok(Resolution::Raced);
            }
            if cancel_requested {
                deadline(client.query_one(CANCEL, &[&s.key])).await?;
                return Ok(Resolution::Cancelled);
            }
            // Absent at the destination, so sending it now is not blind.
            match ledger.perform(client, &s.key, dest).await {
                Ok(Performed::Sent { external_id, .. }) => Ok(Resolution::Resent { external_id }),
                Ok(other) => Ok(Resolution::Requeued {
                    detail: format!("{other:?}"),
                }),
                Err(e) => Ok(Resolution::Requeued {
                    detail: e.to_string(),
                }),
            }
        }
    }
}

/// Deletes finished effects and inbox rows older than `retention`, a batch at a time.
pub async fn prune(
    client: &impl GenericClient,
    cfg: &ReconcileConfig,
) -> Result<(u64, u64), DbError> {
    let limit = cfg.batch_size.get().min(i32::MAX as usize) as i32;
    let (mut effects, mut inbox) = (0u64, 0u64);
    loop {
        let row =
            deadline(client.query_one(PRUNE, &[&cfg.retention.as_secs_f64(), &limit])).await?;
        let (e, i): (i64, i64) = (row.get(0), row.get(1));
        effects += e as u64;
        inbox += i as u64;
        if e < limit as i64 && i < limit as i64 {
            return Ok((effects, inbox));
        }
    }
}

/// One pass: settles the stuck effects of `dest` through its lookup (or lists them when it
/// has none), lists stuck effects of other destinations, then prunes.
pub async fn reconcile<D: Destination>(
    client: &Client,
    cfg: &ReconcileConfig,
    ledger: &Ledger,
    dest: &D,
) -> Result<Report, EffectError> {
    let mut report = Report::default();
    for s in stuck(client, cfg).await? {
        if s.destination != dest.name() || !dest.supports_lookup() {
            report.review.push(s);
            continue;
        }
        match resolve(client, ledger, &s, dest).await {
            Ok(r) => report.resolved.push((s, r)),
            Err(e) => {
                tracing::warn!(target: "outbox_relay::consumer", effect = s.key, error = %e, "stuck effect not resolved; listed for review");
                report.review.push(s);
            }
        }
    }
    let (effects, inbox) = prune(client, cfg).await?;
    report.effects_deleted = effects;
    report.inbox_deleted = inbox;
    Ok(report)
}

/// One pass without destinations (the `outbox-relay reconcile` command): lists every stuck
/// effect for review, then prunes.
pub async fn review(client: &impl GenericClient, cfg: &ReconcileConfig) -> Result<Report, DbError> {
    let review = stuck(client, cfg).await?;
    let (effects_deleted, inbox_deleted) = prune(client, cfg).await?;
    Ok(Report {
        resolved: Vec::new(),
        review,
        effects_deleted,
        inbox_deleted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_must_outlive_what_they_guard() {
        let s = Duration::from_secs;
        let n = NonZeroUsize::new(100).unwrap();
        assert!(ReconcileConfig::new(s(60), s(3600), n, s(30)).is_ok());
        assert_eq!(
            ReconcileConfig::new(s(30), s(3600), n, s(30))
                .unwrap_err()
                .flag,
            "--stuck-after"
        );
        assert_eq!(
            ReconcileConfig::new(s(60), s(60), n, s(30))
                .unwrap_err()
                .flag,
            "--retention"
        );
    }
}
