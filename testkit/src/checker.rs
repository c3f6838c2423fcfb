//! The checker every test (and the soak) reuses: given the events that committed and what a consumer
//! received (in arrival order), report lost, unexpected, duplicate and out-of-order
//! deliveries. For consumers that use the consumer kit, two more checks: every event's
//! outward effect was performed exactly once ([`check_effects`]), and per key the applied
//! seqs go 1, 2, 3, ... with no gap, no repeat and no step back ([`check_applied`]). And a
//! figure for runs with faults: how long after each fault ended everything committed before
//! it was applied ([`recovery`]).
//!
//! Order rule (DESIGN guarantee 5, as a consumer sees it): for each key, the first
//! delivery of every event comes with a seq higher than every seq delivered before it for
//! that key, and one seq never names two different events. Redeliveries of an event
//! already delivered are duplicates, not order violations.

use std::collections::{HashMap, HashSet};

use serde::Serialize;

/// At most this many examples per report: enough to start an investigation.
const EXAMPLES: usize = 10;

fn example(examples: &mut Vec<String>, text: impl FnOnce() -> String) {
    if examples.len() < EXAMPLES {
        examples.push(text());
    }
}

#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub committed: usize,
    pub delivered: usize,
    pub lost: usize,
    pub unexpected: usize,
    pub duplicates: usize,
    pub order_violations: usize,
    pub examples: Vec<String>,
}

impl Report {
    /// Panics with the report unless nothing was lost, unexpected or out of order.
    pub fn assert_clean(&self) {
        assert!(
            self.lost == 0 && self.unexpected == 0 && self.order_violations == 0,
            "checker: {self:?}"
        );
    }
}

/// One message as a consumer received it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    /// The AMQP message_id (the event id).
    pub event_id: String,
    /// `x-outbox-aggregate-type` and `x-outbox-aggregate-id`.
    pub key: (String, String),
    /// `x-outbox-seq`.
    pub seq: Option<i64>,
}

impl Delivery {
    /// What the checker needs of a message as the relay published it: message_id, the key
    /// headers and `x-outbox-seq`. Missing fields stay empty (the checker then reports the
    /// message as unexpected).
    pub fn from_amqp(properties: &lapin::BasicProperties) -> Delivery {
        use lapin::types::AMQPValue;
        use outbox_kit::contract::headers;
        let h = properties.headers().clone().unwrap_or_default();
        let text = |name: &str| match h.inner().get(name) {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            Some(AMQPValue::ShortString(s)) => s.as_str().to_owned(),
            _ => String::new(),
        };
        let seq = match h.inner().get(headers::SEQ) {
            Some(AMQPValue::LongLongInt(n)) => Some(*n),
            Some(AMQPValue::LongInt(n)) => Some(i64::from(*n)),
            _ => None,
        };
        Delivery {
            event_id: properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default(),
            key: (text(headers::AGGREGATE_TYPE), text(headers::AGGREGATE_ID)),
            seq,
        }
    }
}

/// `committed`: the event ids that committed. `received`: deliveries in arrival order.
pub fn check(committed: &[uuid::Uuid], received: &[Delivery]) -> Report {
    let committed_set: HashSet<String> = committed.iter().map(|u| u.to_string()).collect();
    let mut report = Report {
        committed: committed_set.len(),
        delivered: received.len(),
        ..Report::default()
    };
    let mut seen: HashSet<&str> = HashSet::new();
    let mut max_seq: HashMap<(String, String), i64> = HashMap::new();
    let mut seq_owner: HashMap<((String, String), i64), &str> = HashMap::new();
    for r in received {
        let id = r.event_id.as_str();
        if !committed_set.contains(id) {
            report.unexpected += 1;
            if report.examples.len() < 10 {
                report.examples.push(format!("unexpected {id}"));
            }
        }
        let first = seen.insert(id);
        if !first {
            report.duplicates += 1;
        }
        let (Some(seq), key) = (r.seq, r.key.clone()) else {
            continue;
        };
        if let Some(owner) = seq_owner.get(&(key.clone(), seq)) {
            if *owner != id {
                report.order_violations += 1;
                if report.examples.len() < 10 {
                    report
                        .examples
                        .push(format!("seq {seq} of {key:?} names {owner} and {id}"));
                }
            }
        } else {
            seq_owner.insert((key.clone(), seq), id);
        }
        let max = max_seq.entry(key.clone()).or_insert(0);
        if first && seq < *max {
            report.order_violations += 1;
            if report.examples.len() < 10 {
                report.examples.push(format!(
                    "{key:?}: seq {seq} first delivered after seq {max}"
                ));
            }
        }
        *max = (*max).max(seq);
    }
    report.lost = committed_set
        .iter()
        .filter(|id| !seen.contains(id.as_str()))
        .count();
    report
}

/// Effects as the destination saw them: was every event's effect performed exactly once?
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct EffectsReport {
    /// Effects that should have been performed (one per committed event).
    pub expected: usize,
    /// Sends the destination accepted, duplicates included.
    pub accepted: usize,
    /// Expected effects the destination never accepted.
    pub missing: usize,
    /// Effects the destination accepted more than once (each counts once here).
    pub performed_twice: usize,
    /// Accepted sends for effects nobody expected (a rolled-back event, a stray key).
    pub unexpected: usize,
    /// Expected effects whose ledger row does not say `sent` with the accepted item's id.
    pub ledger_wrong: usize,
    pub examples: Vec<String>,
}

impl EffectsReport {
    pub fn exactly_once(&self) -> bool {
        self.missing == 0
            && self.performed_twice == 0
            && self.unexpected == 0
            && self.ledger_wrong == 0
    }
}

/// One send the destination accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Accepted {
    pub effect_key: String,
    pub external_id: String,
}

/// A ledger row at the end of a run: its state and the destination id it recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerRow {
    pub state: String,
    pub external_id: Option<String>,
}

/// `expected`: the effect keys that must have been performed once each. `accepted`: every
/// send the destination accepted (recorded outside the consumers, so a consumer that died
/// after sending cannot hide one). `ledger`: the effects ledger by key.
pub fn check_effects(
    expected: &[String],
    accepted: &[Accepted],
    ledger: &HashMap<String, LedgerRow>,
) -> EffectsReport {
    let expected_set: HashSet<&str> = expected.iter().map(String::as_str).collect();
    let mut report = EffectsReport {
        expected: expected_set.len(),
        accepted: accepted.len(),
        ..EffectsReport::default()
    };
    let mut by_key: HashMap<&str, Vec<&str>> = HashMap::new();
    for a in accepted {
        by_key
            .entry(a.effect_key.as_str())
            .or_default()
            .push(a.external_id.as_str());
    }
    for (key, ids) in &by_key {
        if !expected_set.contains(key) {
            report.unexpected += 1;
            example(&mut report.examples, || {
                format!("effect {key} performed but never expected")
            });
        } else if ids.len() > 1 {
            report.performed_twice += 1;
            example(&mut report.examples, || {
                format!("effect {key} performed {} times: {ids:?}", ids.len())
            });
        }
    }
    for key in &expected_set {
        let Some(ids) = by_key.get(key) else {
            report.missing += 1;
            example(&mut report.examples, || {
                format!("effect {key} never performed")
            });
            continue;
        };
        match ledger.get(*key) {
            Some(row) if row.state == "sent" && row.external_id.as_deref() == Some(ids[0]) => {}
            other => {
                report.ledger_wrong += 1;
                example(&mut report.examples, || {
                    format!(
                        "effect {key}: destination has {}, ledger says {other:?}",
                        ids[0]
                    )
                });
            }
        }
    }
    report
}

/// One event a consumer applied (committed its inbox transaction for), in apply order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    pub event_id: String,
    pub key: (String, String),
    pub seq: i64,
}

/// Per key the applied seqs must be 1, 2, 3, ... up to the key's number of committed
/// events: strictly increasing, no gap, every event once.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct AppliedReport {
    pub keys: usize,
    pub applied: usize,
    /// Applies whose seq was not above the key's previous one (a step back or a repeat).
    pub not_increasing: usize,
    /// Applies whose seq skipped one or more numbers.
    pub gaps: usize,
    /// Events applied more than once.
    pub applied_twice: usize,
    /// Committed events never applied.
    pub missing: usize,
    /// Applied events that never committed.
    pub unexpected: usize,
    pub examples: Vec<String>,
}

impl AppliedReport {
    pub fn clean(&self) -> bool {
        self.not_increasing == 0
            && self.gaps == 0
            && self.applied_twice == 0
            && self.missing == 0
            && self.unexpected == 0
    }
}

/// `committed`: (event id, key) of every committed event. `applied`: what one consumer
/// group applied, in the order it applied it.
pub fn check_applied(
    committed: &[(String, (String, String))],
    applied: &[Applied],
) -> AppliedReport {
    check_applied_or_dead(committed, applied, &[])
}

/// As [`check_applied`], where `dead` are (event id, key, seq) of events the group
/// dead-lettered with a record: each of those must not be applied, counts as handled, and
/// its seq is no gap in its key's applies.
pub fn check_applied_or_dead(
    committed: &[(String, (String, String))],
    applied: &[Applied],
    dead: &[(String, (String, String), i64)],
) -> AppliedReport {
    let dead_ids: HashSet<&str> = dead.iter().map(|(id, _, _)| id.as_str()).collect();
    let dead_seqs: HashSet<(&(String, String), i64)> =
        dead.iter().map(|(_, k, seq)| (k, *seq)).collect();
    let keys_of: HashMap<&str, &(String, String)> =
        committed.iter().map(|(id, k)| (id.as_str(), k)).collect();
    let mut per_key: HashMap<&(String, String), usize> = HashMap::new();
    for (_, k) in committed {
        *per_key.entry(k).or_default() += 1;
    }
    let mut report = AppliedReport {
        keys: per_key.len(),
        applied: applied.len(),
        ..AppliedReport::default()
    };
    let mut last: HashMap<&(String, String), i64> = HashMap::new();
    let mut seen: HashSet<&str> = HashSet::new();
    for a in applied {
        if !keys_of.contains_key(a.event_id.as_str()) {
            report.unexpected += 1;
            example(&mut report.examples, || {
                format!("applied {} which never committed", a.event_id)
            });
        }
        if dead_ids.contains(a.event_id.as_str()) {
            report.applied_twice += 1;
            example(&mut report.examples, || {
                format!("{} applied and dead-lettered", a.event_id)
            });
        }
        if !seen.insert(a.event_id.as_str()) {
            report.applied_twice += 1;
            example(&mut report.examples, || {
                format!("{} applied twice", a.event_id)
            });
        }
        let prev = last.entry(&a.key).or_insert(0);
        if a.seq <= *prev {
            report.not_increasing += 1;
            example(&mut report.examples, || {
                format!("{:?}: seq {} applied after seq {}", a.key, a.seq, *prev)
            });
        } else if a.seq > *prev + 1
            && !(*prev + 1..a.seq).all(|seq| dead_seqs.contains(&(&a.key, seq)))
        {
            report.gaps += 1;
            example(&mut report.examples, || {
                format!(
                    "{:?}: seq {} applied after seq {} (gap)",
                    a.key, a.seq, *prev
                )
            });
        }
        *prev = (*prev).max(a.seq);
    }
    let handled = |id: &str| seen.contains(id) || dead_ids.contains(id);
    report.missing = committed.iter().filter(|(id, _)| !handled(id)).count();
    for (id, _) in committed.iter().filter(|(id, _)| !handled(id)) {
        example(&mut report.examples, || format!("{id} never applied"));
    }
    report
}

/// How long after `ended_at` everything committed by then was applied, in milliseconds
/// (all times in ms on one clock). `commits`: (event id, commit time). `applied_at`: when
/// each event was first applied. `None` when something committed by then was never applied
/// (that is a loss, reported elsewhere). Events committed before the fault count too: a
/// fault that stalls the backlog shows up as a long recovery.
pub struct Recovery {
    /// Commit times in order, and the latest first-apply time among events committed up
    /// to and including each one (`None` once any of them was never applied).
    commits: Vec<i64>,
    latest_apply: Vec<Option<i64>>,
}

impl Recovery {
    pub fn new(commits: &[(String, i64)], applied_at: &HashMap<String, i64>) -> Recovery {
        let mut sorted: Vec<(i64, Option<i64>)> = commits
            .iter()
            .map(|(id, t)| (*t, applied_at.get(id).copied()))
            .collect();
        sorted.sort_unstable_by_key(|(t, _)| *t);
        let mut latest: Option<i64> = Some(i64::MIN);
        let mut latest_apply = Vec::with_capacity(sorted.len());
        for (_, applied) in &sorted {
            latest = match (latest, applied) {
                (Some(l), Some(a)) => Some(l.max(*a)),
                _ => None,
            };
            latest_apply.push(latest);
        }
        Recovery {
            commits: sorted.into_iter().map(|(t, _)| t).collect(),
            latest_apply,
        }
    }

    /// Milliseconds from `ended_at` until everything committed by then was applied (0 when
    /// it already was).
    pub fn after(&self, ended_at: i64) -> Option<i64> {
        let n = self.commits.partition_point(|t| *t <= ended_at);
        if n == 0 {
            return Some(0);
        }
        self.latest_apply[n - 1].map(|latest| (latest - ended_at).max(0))
    }
}

/// Shorthand for [`Recovery::new`] + [`Recovery::after`] for each end time.
pub fn recovery(
    commits: &[(String, i64)],
    applied_at: &HashMap<String, i64>,
    ended_at: &[i64],
) -> Vec<Option<i64>> {
    let r = Recovery::new(commits, applied_at);
    ended_at.iter().map(|t| r.after(*t)).collect()
}

#[cfg(test)]
mod tests;
