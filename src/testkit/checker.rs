//! The checker every test (and the soak) reuses: given the events that committed and what a consumer
//! received (in arrival order), report lost, unexpected, duplicate and out-of-order
//! deliveries.
//!
//! Order rule (DESIGN guarantee 5, as a consumer sees it): for each key, the first
//! delivery of every event comes with a seq higher than every seq delivered before it for
//! that key, and one seq never names two different events. Redeliveries of an event
//! already delivered are duplicates, not order violations.

use std::collections::{HashMap, HashSet};

#[derive(Debug, Default, Clone, PartialEq, Eq)]
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
