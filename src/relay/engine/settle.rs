//! Verdicts: what the broker's settlements and the database's failure records do to the
//! rows in the hand. An ack queues the row's mark (the only way to a mark: an
//! [`Acked`](crate::relay::publish::Acked) comes from a confirm); a nack, return, timeout
//! or lost channel fails the row, which is recorded as pending (retried after its backoff)
//! or parked. A row whose key's rows all went out while more may be pending asks the next
//! claim for that key by name.

use tokio::time::Instant;

use super::Engine;
use crate::relay::OnPark;
use crate::relay::claim::{Failure, FailureKind, NACKED, Recorded, UNROUTABLE};
use crate::relay::hand::{Hand, Held};
use crate::relay::key::Key;
use crate::relay::publish::{Outcome, SettledBatch};
use crate::telemetry::SettledCounts;
use crate::trace::Stage;

impl Engine {
    pub(super) fn settled(&mut self, (generation, batch): SettledBatch) {
        if self
            .session
            .as_ref()
            .is_none_or(|s| s.generation() != generation)
        {
            return; // a lost session's late reports; its rows were failed already
        }
        let mut counts = SettledCounts::default();
        let mut confirm_secs = Vec::with_capacity(batch.len());
        let mut commit_secs = Vec::with_capacity(batch.len());
        let tracing = self.tel.stage_trace().is_some();
        let mut traced = Vec::new();
        let now_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        for s in batch {
            let (reason, kind, held) = match s.outcome {
                Outcome::Acked(acked) => {
                    counts.acked += 1;
                    self.published += 1;
                    if tracing {
                        traced.push(s.row_id);
                    }
                    confirm_secs.push(s.confirm_secs);
                    if let Some(row) = self.hand.head(&s.key, s.row_id) {
                        commit_secs.push((now_unix - row.created_epoch).max(0.0));
                    }
                    if self.hand.acked(&s.key, s.row_id).wants_claim {
                        self.pass.continue_key(s.key.clone());
                    }
                    self.marks.push((s.key, acked));
                    continue;
                }
                Outcome::Returned {
                    reply_code,
                    reply_text,
                } => {
                    counts.returned += 1;
                    let rk = self
                        .hand
                        .head(&s.key, s.row_id)
                        .map(|r| r.routing_key.clone())
                        .unwrap_or_default();
                    (
                        format!(
                            "{UNROUTABLE} exchange '{}' has no queue bound for routing key '{rk}' ({reply_code} {reply_text})",
                            self.cfg.exchange
                        ),
                        FailureKind::Permanent,
                        Some(Held::Returned),
                    )
                }
                Outcome::Nacked => {
                    counts.nacked += 1;
                    (NACKED.to_owned(), FailureKind::Transient, Some(Held::Nack))
                }
                Outcome::TimedOut => {
                    counts.timed_out += 1;
                    (
                        format!("no confirm within {:?}", self.cfg.confirm_timeout),
                        FailureKind::Transient,
                        None,
                    )
                }
                Outcome::Lost(why) => {
                    counts.lost += 1;
                    (
                        format!("channel lost before the confirm: {why}"),
                        FailureKind::Transient,
                        None,
                    )
                }
            };
            self.hand.failed_because(&s.key, s.row_id, held);
            self.failures.push((
                s.key,
                Failure {
                    id: s.row_id,
                    kind,
                    reason,
                },
            ));
        }
        if let Some(t) = self.tel.stage_trace() {
            t.record(Stage::Acked, traced);
        }
        self.tel
            .batch_settled(counts, &confirm_secs, &commit_secs, self.hand.in_flight());
    }

    pub(super) fn recorded(&mut self, batch: Vec<(Key, Failure)>, recorded: Vec<(i64, Recorded)>) {
        let now = Instant::now();
        for ((key, failure), (_, rec)) in batch.into_iter().zip(recorded) {
            match rec {
                Recorded::Pending { attempts } => {
                    self.hand.wait_retry(&key, failure.id);
                    let at = Hand::retry_at(attempts, self.cfg.retry_min, self.cfg.retry_max, now);
                    self.retries.insert_at(key, at);
                }
                Recorded::Parked => {
                    self.tel.row_parked(
                        failure.id,
                        &key.aggregate_type,
                        &key.aggregate_id,
                        &failure.reason,
                    );
                    let keep_going = self.cfg.on_park == OnPark::Continue;
                    if self.hand.parked(&key, failure.id, keep_going).wants_claim {
                        self.pass.continue_key(key.clone());
                    }
                    if !keep_going {
                        self.pass.want();
                    }
                }
                Recorded::Gone => {
                    self.hand.gone(&key, failure.id);
                    self.pass.want();
                }
            }
        }
    }
}
