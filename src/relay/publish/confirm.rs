//! The confirm decision: what one round of resolved confirms means for each row. A pure
//! function of the round, the returns recorded so far and the suspects held from earlier
//! rounds (no I/O, no clock), so every rule below is unit tested without a broker.
//!
//! Invariant (the core one): a row is reported [`Outcome::Acked`] only for a broker ack
//! with no return for that row, matched by message_id. lapin pairs a returned message with
//! whichever confirm it resolves next (FIFO, and in hash order within a multiple-ack), so
//! the returned message a confirm carries may belong to another row. The decision therefore:
//! - records every returned message by its message_id, whatever confirm carried it, before
//!   deciding any row of the round;
//! - treats an ack that carried nothing as clean unless its message_id was returned: at
//!   its resolution lapin's queue of returns was empty, so its own return, which always
//!   precedes its ack, was already handed to an earlier confirm that the lane has seen
//!   (the lane drains every confirm already resolved into one round, see `lane`);
//! - holds an ack that carried another row's return as a suspect (its own return may still
//!   be queued) until a later round sees a confirm that carried nothing;
//! - after a confirm timeout or channel error (a probe's too) ends the lane, so every
//!   later confirm counts as lost (the engine fails their rows): lapin may hand a return
//!   to a confirm we no longer watch. For the same reason no ack drained in the round of
//!   that timeout or error counts, nor does a suspect get cleared by it: those rows are
//!   reported lost and published again (a duplicate, never a loss) unless their own
//!   return was seen;
//! - ([`NackRun`]) ends the lane too when the broker has nacked every row for a confirm
//!   timeout with no ack between: a channel of a node that lost track of a queue's leader
//!   can nack for good, and only a new session gets past it (the engine then reconnects).
//!
//! Only this module builds [`Acked`], and only from a confirmation that passed these rules.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::super::key::Key;
use super::{Acked, Outcome};

#[cfg(test)]
mod tests;

/// What a lane is waiting on for one publish.
pub(super) struct Pending {
    pub(super) row_id: i64,
    pub(super) seq: i64,
    pub(super) key: Key,
    /// The message_id the row was published with: returns are matched by it.
    pub(super) event_id: String,
    pub(super) body_bytes: usize,
    pub(super) sent_at: Instant,
}

/// A returned message, reduced to what matching and reporting need.
pub(super) struct ReturnInfo {
    pub(super) message_id: Option<String>,
    pub(super) reply_code: u16,
    pub(super) reply_text: String,
}

/// How one confirm resolved, with the returned message lapin paired with it, if any.
pub(super) enum ConfirmResult {
    Ack(Option<ReturnInfo>),
    Nack(Option<ReturnInfo>),
    /// The channel was not in confirm mode: nothing it says can be trusted.
    NotRequested,
    /// The channel or connection failed before the confirm.
    Failed(String),
    /// No confirm within `--confirm-timeout`.
    TimedOut,
}

const NOT_REQUESTED: &str = "channel not in confirm mode";

impl ConfirmResult {
    /// Why this confirm ends the lane: it timed out or its channel failed.
    fn failure(&self) -> Option<String> {
        match self {
            ConfirmResult::TimedOut => Some("a confirm timed out".to_owned()),
            ConfirmResult::Failed(e) => Some(e.clone()),
            ConfirmResult::NotRequested => Some(NOT_REQUESTED.to_owned()),
            ConfirmResult::Ack(_) | ConfirmResult::Nack(_) => None,
        }
    }

    fn returned(&self) -> Option<&ReturnInfo> {
        match self {
            ConfirmResult::Ack(r) | ConfirmResult::Nack(r) => r.as_ref(),
            _ => None,
        }
    }
}

/// One confirm of a round, in the order the lane drained it.
pub(super) struct Resolved {
    /// The row it confirms; `None` for a probe.
    pub(super) pending: Option<Pending>,
    pub(super) result: ConfirmResult,
}

/// Returned messages seen on a lane, by message_id, until the row they belong to settles.
#[derive(Default)]
pub(super) struct Returns {
    by_id: HashMap<String, (u16, String)>,
    order: VecDeque<String>,
}

impl Returns {
    fn record(&mut self, message: &ReturnInfo) {
        let Some(id) = message.message_id.clone() else {
            return;
        };
        self.by_id
            .insert(id.clone(), (message.reply_code, message.reply_text.clone()));
        self.order.push_back(id);
        // Returns for rows that already settled otherwise (timed out, lost) are never
        // claimed; keep a bounded memory of them.
        while self.order.len() > 100_000 {
            if let Some(old) = self.order.pop_front() {
                self.by_id.remove(&old);
            }
        }
    }

    fn take(&mut self, id: &str) -> Option<Outcome> {
        self.by_id
            .remove(id)
            .map(|(reply_code, reply_text)| Outcome::Returned {
                reply_code,
                reply_text,
            })
    }
}

/// What a round of confirms decided.
pub(super) struct Decision {
    /// Rows settled by this round, in the order decided.
    pub(super) settled: Vec<(Pending, Outcome)>,
    /// Acks not yet proven clean: earlier suspects still unproven, then this round's.
    pub(super) suspects: Vec<Pending>,
    /// Why the lane must end, when it must.
    pub(super) end: Option<String>,
}

/// Settles a round of resolved confirms (see the module docs for the rule). `suspects` are
/// the acks held from earlier rounds; `returns` the returned messages not yet matched.
pub(super) fn decide(
    round: Vec<Resolved>,
    returns: &mut Returns,
    suspects: Vec<Pending>,
) -> Decision {
    // First record every return this round carried, whichever confirm carried it.
    for r in &round {
        if let Some(m) = r.result.returned() {
            returns.record(m);
        }
    }
    // A confirm that carried nothing (a probe's too) proves lapin's queue of returns was
    // empty when it resolved, so no return of an earlier round's suspect is still queued.
    let clean_seen = round.iter().any(|r| {
        matches!(
            r.result,
            ConfirmResult::Ack(None) | ConfirmResult::Nack(None)
        )
    });
    // A confirm we stop watching (timed out, or its channel failed) may still be paired by
    // lapin with the next queued return when its answer arrives: another row's return can
    // vanish there, and that row's ack, drained in the same round, then carries nothing.
    // No ack of such a round proves anything; its rows stay pending and are published
    // again (a duplicate, never a loss).
    // A probe's confirm counts like a row's: lapin pairs returns with it all the same.
    let failures: Vec<String> = round.iter().filter_map(|r| r.result.failure()).collect();
    let distrust = failures.first().cloned();
    // The lane ends on the last failure of the round, the reason it reports.
    let end = failures.last().cloned();
    let untrusted = |why: &str| Outcome::Lost(format!("ack not trusted: {why}"));
    let mut settled = Vec::new();
    let mut held = Vec::new();
    for r in round {
        let carried = r.result.returned().is_some();
        let Some(pending) = r.pending else {
            continue;
        };
        let outcome = match r.result {
            ConfirmResult::TimedOut => Outcome::TimedOut,
            ConfirmResult::Failed(e) => Outcome::Lost(e),
            ConfirmResult::NotRequested => Outcome::Lost(NOT_REQUESTED.to_owned()),
            ConfirmResult::Nack(_) => Outcome::Nacked,
            ConfirmResult::Ack(_) => {
                if let Some(returned) = returns.take(&pending.event_id) {
                    returned
                } else if let Some(why) = &distrust {
                    untrusted(why)
                } else if !carried {
                    Outcome::Acked(Acked::of(&pending))
                } else {
                    // Carried another row's return: its own may still be queued.
                    held.push(pending);
                    continue;
                }
            }
        };
        settled.push((pending, outcome));
    }
    // Suspects from earlier rounds: their own return has shown up, or a confirm that
    // carried nothing resolved after them, which proves no return of theirs is queued.
    let mut still = Vec::new();
    for p in suspects {
        if let Some(returned) = returns.take(&p.event_id) {
            settled.push((p, returned));
        } else if let Some(why) = &distrust {
            settled.push((p, untrusted(why)));
        } else if clean_seen {
            let acked = Outcome::Acked(Acked::of(&p));
            settled.push((p, acked));
        } else {
            still.push(p);
        }
    }
    // This round's suspects wait for a later round: a clean confirm of their own round may
    // have resolved before them.
    still.extend(held);
    Decision {
        settled,
        suspects: still,
        end,
    }
}

impl Acked {
    /// The only way to make an [`Acked`]: from a row whose ack passed [`decide`]'s rules.
    fn of(p: &Pending) -> Acked {
        Acked {
            row_id: p.row_id,
            seq: p.seq,
            body_bytes: p.body_bytes,
        }
    }
}

/// Since when a lane has had nothing but nacks for its rows.
#[derive(Default)]
pub(super) struct NackRun {
    since: Option<Instant>,
}

impl NackRun {
    /// Counts a round of outcomes; true once every row settled for `limit` was nacked.
    /// An ack (returned or not) ends the run; timeouts and losses end the lane anyway.
    pub(super) fn for_good<'a>(
        &mut self,
        round: impl IntoIterator<Item = &'a Outcome>,
        now: Instant,
        limit: Duration,
    ) -> bool {
        for outcome in round {
            match outcome {
                Outcome::Nacked => {
                    self.since.get_or_insert(now);
                }
                Outcome::Acked(_) | Outcome::Returned { .. } => self.since = None,
                Outcome::TimedOut | Outcome::Lost(_) => {}
            }
        }
        self.since.is_some_and(|t| now.duration_since(t) >= limit)
    }
}
