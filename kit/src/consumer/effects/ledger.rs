//! [`Ledger`]: the effects-ledger steps for one worker (enqueue, claim, complete, fail,
//! retry, cancel) and [`Ledger::perform`], the whole rule set for one effect. Every rule is a
//! SQL function of `sql/0003_consumer.sql` (order keys and take-over: `sql/0016_effect_order.sql`);
//! this file only calls them, with deadlines.
//!
//! Invariants: claim before send; write back only while the row is ours, else withdraw our
//! item at the destination; failed never overwrites sent; an unknown outcome is looked up
//! (or left for review), never sent again blindly; an effect of an order key is claimed only
//! once every earlier effect of that key is sent, failed or cancelled; and `perform` reports
//! "not claimed" only for an effect that is finished (or absent): one that another claim
//! holds is an error to retry ([`EffectError::InFlight`]), never "done".

use std::future::Future;
use std::time::{Duration, Instant};

use tokio_postgres::{Client, GenericClient};

use crate::db::{DbError, deadline};

use super::destination::within;
use super::error::db_or_budget;
use super::{
    Cancelled, Claimed, Completion, Destination, DestinationError, Effect, EffectError, EffectRow,
    EffectState, EffectsConfig, NewEffect, Performed,
};

const ENQUEUE: &str = "SELECT outbox_effect_enqueue($1, $2, $3, $4, $5, $6, $7, $8)";
const CLAIM: &str = "SELECT id, effect_key, destination, payload, attempts, uncertain, external_id
                       FROM outbox_effect_claim($1, $2, $3, $4, $5, $6)";
const COMPLETE: &str = "SELECT outbox_effect_complete($1, $2, $3)";
const STRAY: &str = "SELECT outbox_effect_stray($1, $2, $3, $4)";
const FAIL: &str = "SELECT outbox_effect_fail($1, $2, $3)";
const RETRY: &str = "SELECT outbox_effect_retry($1, $2, $3, $4)";
const CANCEL: &str = "SELECT action, effect_id, external_id FROM outbox_effect_cancel($1)";
const WITHDRAWN: &str = "SELECT outbox_effect_withdrawn($1, $2)";
const WITHDRAW_FAILED: &str = "SELECT outbox_effect_withdraw_failed($1, $2, $3)";
const GET: &str = "SELECT id, effect_key, destination, payload, state, claimed_by, external_id,
                          attempts, last_error, uncertain, cancel_requested_at IS NOT NULL,
                          withdrawn_at IS NOT NULL
                     FROM outbox_effects WHERE effect_key = $1";

/// The ledger API for one worker. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Ledger {
    cfg: EffectsConfig,
}

impl Ledger {
    /// The ledger for the worker and timeouts in `cfg`.
    pub fn new(cfg: EffectsConfig) -> Ledger {
        Ledger { cfg }
    }

    pub(crate) fn config(&self) -> &EffectsConfig {
        &self.cfg
    }

    /// Adds a queued effect once per key (in the caller's transaction, if it passes one);
    /// returns its id. With `reserve_now`, out of budget fails here. It has no order key:
    /// nothing waits for it and it waits for nothing ([`Ledger::enqueue_in_order`]).
    pub async fn enqueue(
        client: &impl GenericClient,
        effect: &NewEffect<'_>,
    ) -> Result<i64, EffectError> {
        Ledger::enqueue_ordered(client, effect, None).await
    }

    /// [`Ledger::enqueue`] under `order_key` (the event's key, say `ticket/42`): the
    /// effects of one order key go out in the order they were enqueued. A claim of a later
    /// one fails with [`EffectError::Behind`] while an earlier one is queued or being sent.
    /// Enqueue them in that order, each committed before the next one's claim (as a key's
    /// events are handled one after another).
    pub async fn enqueue_in_order(
        client: &impl GenericClient,
        effect: &NewEffect<'_>,
        order_key: &str,
    ) -> Result<i64, EffectError> {
        Ledger::enqueue_ordered(client, effect, Some(order_key)).await
    }

    async fn enqueue_ordered(
        client: &impl GenericClient,
        effect: &NewEffect<'_>,
        order_key: Option<&str>,
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
                &order_key,
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
    /// statement. `None`: it was not queued; do not send. [`EffectError::Behind`]: an
    /// earlier effect of its order key is unresolved; nothing was claimed.
    pub async fn claim(&self, client: &Client, key: &str) -> Result<Option<Claimed>, EffectError> {
        self.claim_or_take_over(client, key, false).await
    }

    /// [`Ledger::claim`], and with `take_over` also a claim in `sending` whose lease ran out
    /// (its claimer stopped, or was dropped mid-send): taken as uncertain, so it is looked up
    /// before anything is sent. Only for a destination with lookup.
    async fn claim_or_take_over(
        &self,
        client: &Client,
        key: &str,
        take_over: bool,
    ) -> Result<Option<Claimed>, EffectError> {
        let lease = self.cfg.lease.as_secs_f64();
        let send = self.cfg.send_timeout.as_secs_f64();
        let write = self.cfg.write_timeout.as_secs_f64();
        let row = deadline(client.query_opt(
            CLAIM,
            &[&key, &self.cfg.worker, &lease, &send, &write, &take_over],
        ))
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
    pub(crate) async fn complete(
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
    pub(crate) async fn retry(
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
    ///
    /// [`Performed::NotClaimed`] means finished (sent, failed, cancelled) or absent: done.
    /// An effect under another live claim is [`EffectError::InFlight`], one behind an
    /// unresolved earlier effect of its order key [`EffectError::Behind`]: both transient,
    /// so a handler that returns them has its event retried, and the key's later events
    /// (and their effects) wait. A claim whose lease ran out (its claimer stopped, or its
    /// handler was dropped mid-send) is taken over when the destination has a lookup: looked
    /// up first, sent only if it is not there.
    ///
    /// Nothing goes to the destination once the claim's lease may have run out: the lease
    /// is counted from before the claim was asked for (the database starts it when the
    /// statement starts, also when the claim then waited on a lock), and a lookup or a send
    /// starts only while the lease still covers it and the write-back. Past that (the
    /// process was paused, the claim waited), the reconciler may already have decided about
    /// the row; the claim is given back and [`EffectError::LeaseRunOut`] says to try again.
    pub async fn perform<D: Destination>(
        &self,
        client: &Client,
        key: &str,
        dest: &D,
    ) -> Result<Performed, EffectError> {
        let asked = Instant::now();
        let claimed = match self.claim(client, key).await? {
            Some(claimed) => claimed,
            None => match self.not_queued(client, key, dest).await? {
                Ok(claimed) => claimed,
                Err(finished) => return Ok(finished),
            },
        };
        let effect = &claimed.effect;
        // Before each destination call: that call, then the write-back, within the lease.
        let covered = |calls: u32| {
            asked.elapsed() + self.cfg.send_timeout * calls + self.cfg.write_timeout
                < self.cfg.lease
        };
        if !covered(if claimed.uncertain { 2 } else { 1 }) {
            return Err(self.lease_run_out(client, effect, asked).await);
        }
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
                // It never arrived: sending is not blind now, if the lease still covers it.
                Ok(None) if !covered(1) => {
                    return Err(self.lease_run_out(client, effect, asked).await);
                }
                Ok(None) => {}
                Err(DestinationError::Terminal(reason)) => {
                    // The lookup cannot answer, so the earlier attempt may still be out:
                    // "failed" would invite a resend and release the budget. It stays in
                    // doubt (sending, uncertain) for the reconciler or an operator.
                    tracing::warn!(target: "outbox_relay", effect = effect.key, reason, "lookup of an in-doubt effect failed for good; left for review");
                    return Err(EffectError::InDoubt {
                        key: key.to_owned(),
                        reason: format!(
                            "the lookup failed ({reason}); an earlier attempt may be out"
                        ),
                    });
                }
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

    /// `key` was not queued: finished (reported as not claimed), or under another claim,
    /// which is taken over when its lease ran out and the destination can look it up.
    async fn not_queued<D: Destination>(
        &self,
        client: &Client,
        key: &str,
        dest: &D,
    ) -> Result<Result<Claimed, Performed>, EffectError> {
        let Some(row) = Ledger::get(client, key).await? else {
            return Ok(Err(Performed::NotClaimed { state: None }));
        };
        match row.state {
            EffectState::Sent | EffectState::Failed | EffectState::Cancelled => {
                return Ok(Err(Performed::NotClaimed {
                    state: Some(row.state),
                }));
            }
            EffectState::Sending if dest.supports_lookup() => {
                if let Some(claimed) = self.claim_or_take_over(client, key, true).await? {
                    tracing::warn!(target: "outbox_relay", effect = key, previous = row.claimed_by, "took over a claim whose lease ran out; looking the effect up before sending");
                    return Ok(Ok(claimed));
                }
            }
            // Queued again since our claim looked (a racing retry): claim it now.
            EffectState::Queued => {
                if let Some(claimed) = self.claim(client, key).await? {
                    return Ok(Ok(claimed));
                }
            }
            EffectState::Sending => {}
        }
        Err(EffectError::InFlight {
            key: key.to_owned(),
            claimed_by: row.claimed_by.unwrap_or_default(),
        })
    }

    /// The claim is held too long to send under it: given back (queued again if still
    /// ours), and the error that says so.
    async fn lease_run_out(&self, client: &Client, effect: &Effect, asked: Instant) -> EffectError {
        let held = asked.elapsed();
        let reason = format!(
            "the claim was held {held:?} before sending, too long for its {:?} lease",
            self.cfg.lease
        );
        tracing::warn!(target: "outbox_relay", effect = effect.key, reason, "claim held too long; given back without sending");
        if let Err(e) = self.retry(client, effect.id, &reason, false).await {
            return EffectError::Db(e);
        }
        EffectError::LeaseRunOut {
            key: effect.key.clone(),
            held,
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
                // Someone decided about this row while we were sending (the database says
                // 'sent' when the row holds our own item): our item must not stay out.
                tracing::warn!(target: "outbox_relay", effect = effect.key, state, "effect changed while we were sending it; withdrawing our item at the destination");
                let gone = within(self.cfg.send_timeout, "delete", dest.delete(&external_id)).await;
                match gone {
                    Ok(()) => Ok(Performed::Withdrawn { external_id }),
                    Err(e) => {
                        // The ledger row is someone else's truth; our item is recorded
                        // beside it, so the ledger never hides an item that is out.
                        let error = e.to_string();
                        self.write(client.query_one(
                            STRAY,
                            &[&effect.id, &self.cfg.worker, &external_id, &error],
                        ))
                        .await?;
                        tracing::warn!(target: "outbox_relay", effect = effect.key, error, "could not withdraw our item; recorded as a stray for review");
                        Ok(Performed::StillOut { external_id, error })
                    }
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
