//! Returns: what a finished database round trip or AMQP connect ([`Done`]) does to the
//! engine's state machines. Every database result first updates Postgres readiness; a
//! transient error is retried by the state machine that started the round trip (with its
//! backoff), any other ends the relay with a [`RelayError`].

use std::collections::{HashMap, HashSet};

use tokio::time::Instant;

use outbox_kit::db::DbError;

use super::{ClaimMeta, Done, Engine};
use crate::relay::RelayError;
use crate::relay::claim::{Claimed, LeaseRound};
use crate::relay::key::Key;

impl Engine {
    /// Readiness follows the database round trips: one failing marks Postgres down, the
    /// next that succeeds marks it up (and counts a reconnect).
    fn db_result<T>(&mut self, result: &Result<T, DbError>) {
        match result {
            Ok(_) if self.pg_down => {
                self.pg_down = false;
                self.tel.postgres_state(true);
                self.tel.postgres_reconnected();
            }
            Err(e) if e.is_transient() && !self.pg_down => {
                self.pg_down = true;
                self.tel.postgres_state(false);
            }
            _ => {}
        }
    }

    pub(super) fn done(&mut self, done: Done) -> Result<(), RelayError> {
        match &done {
            Done::Claim(_, r) => self.db_result(r),
            Done::Mark(_, r) => self.db_result(r),
            Done::Failures(_, r) => self.db_result(r),
            Done::Lease(_, _, r) => self.db_result(r),
            Done::Wakeup(_, r) => self.db_result(r),
            Done::Connected(..) => {}
        }
        match done {
            Done::Connected(generation, result) => {
                self.connecting = false;
                match result {
                    Ok(session) if generation == self.generation && self.stopping.is_none() => {
                        self.amqp.ok();
                        self.tel.amqp_connected(generation, self.cfg.channels.get());
                        self.session = Some(session);
                        self.pass.want();
                    }
                    Ok(session) => {
                        tokio::spawn(session.close());
                    }
                    Err(e) => self.amqp.failed(&e),
                }
            }
            Done::Claim(meta, result) => match result {
                Ok(claimed) => self.claimed(meta, claimed),
                Err(e) => {
                    self.hand.claim_returned(Vec::new(), &HashSet::new());
                    self.check_fatal(&e)?;
                    self.pass.failed(&e);
                }
            },
            Done::Mark(batch, result) => match result {
                Ok(changed) => {
                    self.marks.succeeded();
                    self.tel.rows_marked(batch.len(), changed);
                    self.hand
                        .marked(batch.iter().map(|(_, a)| (a.row_id(), a.body_bytes())));
                }
                Err(e) => {
                    self.check_fatal(&e)?;
                    self.marks.failed(batch, &e);
                }
            },
            Done::Failures(batch, result) => match result {
                Ok(recorded) => {
                    self.failures.succeeded();
                    self.recorded(batch, recorded);
                }
                Err(e) => {
                    self.check_fatal(&e)?;
                    self.failures.failed(batch, &e);
                }
            },
            Done::Lease(sent, released, result) => match result {
                Ok(round) => self.leased(sent, round),
                Err(e) => {
                    // Give back next round what we meant to give back now.
                    self.leases.round_failed(released);
                    self.check_fatal(&e)?;
                    tracing::warn!(target: "outbox_relay", error = %e, "lease renewal failed; partitions stop when their lease runs out");
                }
            },
            Done::Wakeup(wanted, result) => match result {
                Ok(()) => {
                    self.tel.wakeup_hint(wanted);
                    if self.pacing.wakeup_written(wanted) {
                        // Close the race with a producer that committed while the hint
                        // was off: poll once more now that it is on.
                        self.pass.want();
                    }
                }
                Err(e) => {
                    self.pacing.wakeup_failed();
                    self.check_fatal(&e)?;
                    tracing::debug!(target: "outbox_relay", error = %e, "wake-up flag not written; trying again");
                }
            },
        }
        Ok(())
    }

    /// Transient database errors are retried by the caller; others end the relay.
    fn check_fatal(&self, e: &DbError) -> Result<(), RelayError> {
        if e.is_transient() {
            return Ok(());
        }
        if let DbError::Postgres(pg) = e
            && pg
                .code()
                .is_some_and(|c| c.code() == "42883" || c.code() == "42P01")
        {
            return Err(RelayError::NotMigrated(self.deps.schema.to_string()));
        }
        Err(RelayError::Refused(e.to_string()))
    }

    fn claimed(&mut self, meta: ClaimMeta, claimed: Claimed) {
        let mut per_key: HashMap<Key, usize> = HashMap::new();
        for row in &claimed.rows {
            *per_key.entry(row.key()).or_default() += 1;
        }
        let full: HashSet<Key> = per_key
            .into_iter()
            .filter(|(_, n)| *n >= claimed.per_key)
            .map(|(k, _)| k)
            .collect();
        let added = self.hand.claim_returned(claimed.rows, &full);
        let new = added.rows;
        // Keys cut short because rows left the hand during the claim: ask for them again.
        self.pass.continue_keys(added.stopped);
        // Rows no NOTIFY announced although LISTEN was up and the hint was on.
        let unannounced = self.pacing.unannounced(new);
        self.tel
            .claimed(new, claimed.scanned, self.hand.rows(), unannounced);
        let now = Instant::now();
        if let Some(at) = claimed.next_due.and_then(|d| now.checked_add(d)) {
            self.pass.wake_at(at);
        }
        let reached_end = claimed.scanned < meta.limit;
        // Pacing first: a claim that makes the relay busy turns the producers' NOTIFY off,
        // and then the pass must claim again by itself.
        if !meta.sweeping {
            self.pacing.forward_claimed(new, reached_end);
        }
        let announced = self.pacing.commits_announced();
        self.pass.returned(
            now,
            meta.sweeping,
            claimed.scanned_to,
            reached_end,
            new,
            announced,
        );
    }

    fn leased(&mut self, sent: Instant, round: LeaseRound) {
        // Renew the producers' hint: it runs out three leases after its last renewal.
        self.pacing.lease_renewed();
        let renewed = self.leases.round_done(sent, &round, &mut self.hand);
        if renewed.gained > 0 {
            self.pass.want_sweep();
        }
        if renewed.gained > 0 || renewed.lost > 0 {
            self.tel.leases_changed(
                self.leases.len(),
                renewed.gained,
                renewed.lost,
                round.fair_share,
                round.relays_alive,
            );
        }
    }
}
