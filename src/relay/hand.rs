//! The rows a relay holds between claiming them and their final write (dispatched or
//! parked): one queue per key, in publish (seq) order.
//!
//! Invariants:
//! - At most one message per key is unconfirmed at a time. A nack or a return can only be
//!   known after the fact, so a key's next event is published only once the previous one
//!   is settled; that is what keeps per-key order through failures.
//! - A row stays "held" (and is filtered out of later claims) until its final write has
//!   committed, so a claim racing with a mark never hands the same row back as new.
//! - Claims leave out the rows held when they start. What left the hand while a claim
//!   was running is remembered until that claim returns (its snapshot may predate the
//!   write), then forgotten: a row that reached its final state (marked, parked) is
//!   skipped in that claim's result, and a key with a row that was only dropped (lease
//!   lost, key blocked) gets none of that result's rows, so a key's rows never enter the
//!   hand with a hole before them.
//!
//! No IO here: the engine in `relay/engine.rs` drives it and tests drive it directly.

use std::collections::{HashMap, HashSet, VecDeque};
use tokio::time::Instant;

use super::claim::ClaimedRow;
pub use super::key::Key;

/// Where a key's head row is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Head {
    /// Can be published now (it is in the ready queue).
    Ready,
    /// Published, waiting for the broker's confirm.
    InFlight,
    /// Failed; waiting for its retry time (the engine holds the timer).
    Waiting,
    /// Waiting for the database to record a failure or park the row.
    Recording,
}

/// Why a key's head row keeps failing, when the broker said so: the key is held up by it
/// until that row goes through (or is parked), and operators see it (`outbox_keys_held`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Held {
    /// The broker nacked the head row (a full queue with `reject-publish`, a queue without
    /// its leader): retried with backoff for as long as it takes, never parked for it.
    Nack,
    /// The broker returned it as unroutable: parked after `--max-attempts`.
    Returned,
}

/// How many keys are held, by cause.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HeldKeys {
    pub(crate) nack: usize,
    pub(crate) returned: usize,
}

impl HeldKeys {
    fn count(&mut self, held: Option<Held>, delta: isize) {
        let slot = match held {
            Some(Held::Nack) => &mut self.nack,
            Some(Held::Returned) => &mut self.returned,
            None => return,
        };
        *slot = slot.saturating_add_signed(delta);
    }
}

#[derive(Debug)]
struct KeyQueue {
    rows: VecDeque<ClaimedRow>,
    head: Head,
    partition: u8,
    /// The last claim returned a full prefix for this key: more may be pending behind it.
    maybe_more: bool,
    /// The head's last failure, when it was a nack or a return; cleared when the head leaves.
    held: Option<Held>,
}

impl KeyQueue {
    /// Sets why the head is held, keeping `counts` in step.
    fn hold(&mut self, counts: &mut HeldKeys, held: Option<Held>) {
        counts.count(self.held, -1);
        counts.count(held, 1);
        self.held = held;
    }
}

/// What a claim's rows did to the hand.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Added {
    /// Rows new to the hand.
    pub(crate) rows: usize,
    /// Keys whose part of the claim was not (fully) added because a row of theirs left the
    /// hand while the claim ran: claim them again.
    pub(crate) stopped: Vec<Key>,
}

/// What the engine should do after a key's head settled.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Released {
    /// The key had more rows behind the claimed prefix; a new claim pass should look.
    pub(crate) wants_claim: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Hand {
    keys: HashMap<Key, KeyQueue>,
    ready: VecDeque<Key>,
    /// Every row id held: queued, in flight, or waiting for its final write.
    held: HashSet<i64>,
    /// Acked rows waiting for the dispatched mark to commit.
    awaiting_mark: usize,
    bytes: usize,
    in_flight: usize,
    /// Set while a claim is running: what left the hand meanwhile.
    claim_filter: Option<ClaimFilter>,
    /// Keys whose head the broker last nacked or returned.
    held_keys: HeldKeys,
}

/// What left the hand while a claim ran (its snapshot may predate those writes).
#[derive(Debug, Default)]
struct ClaimFilter {
    /// Ids marked dispatched or parked: done, whatever the claim's snapshot says.
    finished: HashSet<i64>,
    /// Keys with a row dropped while still pending (lease lost, key blocked): someone
    /// publishes it later. The claim left out the rows the hand held when it started, so
    /// it cannot show a dropped one; rows after it would be added with a hole before them.
    dropped_keys: HashSet<Key>,
}

impl Hand {
    pub(crate) fn rows(&self) -> usize {
        self.held.len()
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }

    pub(crate) fn awaiting_mark(&self) -> usize {
        self.awaiting_mark
    }

    /// Keys held up by a head the broker last nacked or returned.
    pub(crate) fn held_keys(&self) -> HeldKeys {
        self.held_keys
    }

    /// Row `id` is held (only the tests ask; the claim gets all held ids at once).
    #[cfg(test)]
    pub(crate) fn is_held(&self, id: i64) -> bool {
        self.held.contains(&id)
    }

    /// A claim is about to run: remember what leaves the hand until it returns. Returns
    /// the ids held now, which the claim leaves out.
    pub(crate) fn claim_started(&mut self) -> Vec<i64> {
        self.claim_filter = Some(ClaimFilter::default());
        self.held.iter().copied().collect()
    }

    /// Adds the rows a claim returned (each key's rows in publish order), skipping rows
    /// already held or that left the hand while the claim ran. Returns how many were new.
    /// `full_prefix` lists keys for which the claim returned as many rows as it could.
    pub(crate) fn claim_returned(
        &mut self,
        rows: Vec<ClaimedRow>,
        full_prefix: &HashSet<Key>,
    ) -> Added {
        let filter = self.claim_filter.take().unwrap_or_default();
        let mut added = 0;
        // Keys whose part of this result must not be added (any further).
        let mut stopped: HashSet<Key> = HashSet::new();
        for row in rows {
            let key = row.key();
            if stopped.contains(&key) {
                continue;
            }
            if filter.dropped_keys.contains(&key) {
                stopped.insert(key);
                continue;
            }
            if self.held.contains(&row.id) || filter.finished.contains(&row.id) {
                continue;
            }
            let partition = row.partition;
            let queue = self.keys.entry(key.clone()).or_insert_with(|| KeyQueue {
                rows: VecDeque::new(),
                head: Head::Ready,
                partition,
                maybe_more: false,
                held: None,
            });
            if queue.rows.back().is_some_and(|last| last.seq >= row.seq) {
                // Claims return a key's rows in seq order and new rows number after held
                // ones; anything else would publish out of order. Leave the key to the
                // next claim.
                tracing::error!(
                    target: "outbox_relay",
                    id = row.id,
                    seq = row.seq,
                    "claimed row numbered before a row already held; skipped until the next claim"
                );
                stopped.insert(key);
                continue;
            }
            let was_empty = queue.rows.is_empty();
            self.held.insert(row.id);
            self.bytes += row.body_bytes;
            added += 1;
            queue.rows.push_back(row);
            if was_empty {
                queue.head = Head::Ready;
                self.ready.push_back(key);
            }
        }
        for key in full_prefix {
            if let Some(q) = self.keys.get_mut(key) {
                q.maybe_more = true;
            }
        }
        Added {
            rows: added,
            stopped: stopped.into_iter().collect(),
        }
    }

    /// The next row to publish whose partition `sendable` allows, marking it in flight.
    /// Keys of partitions not sendable are skipped and stay ready.
    pub(crate) fn next_ready(&mut self, sendable: impl Fn(u8) -> bool) -> Option<&ClaimedRow> {
        let mut skipped = 0;
        let n = self.ready.len();
        while skipped < n {
            let key = self.ready.pop_front()?;
            let Some(queue) = self.keys.get(&key) else {
                continue;
            };
            if queue.head != Head::Ready || queue.rows.is_empty() {
                continue;
            }
            if !sendable(queue.partition) {
                self.ready.push_back(key);
                skipped += 1;
                continue;
            }
            self.in_flight += 1;
            let queue = self.keys.get_mut(&key).expect("checked above");
            queue.head = Head::InFlight;
            return queue.rows.front();
        }
        None
    }

    /// The broker confirmed the key's head without a return: it waits for its mark, and
    /// the key's next row may go.
    pub(crate) fn acked(&mut self, key: &Key, id: i64) -> Released {
        let Some(queue) = head_in(&mut self.keys, key, id, Head::InFlight) else {
            return Released { wants_claim: false };
        };
        self.in_flight -= 1;
        queue.rows.pop_front();
        queue.hold(&mut self.held_keys, None);
        self.awaiting_mark += 1;
        self.advance(key)
    }

    /// The dispatched mark committed for these rows: they leave the hand.
    pub(crate) fn marked(&mut self, rows: impl IntoIterator<Item = (i64, usize)>) {
        for (id, bytes) in rows {
            if self.held.remove(&id) {
                self.awaiting_mark -= 1;
                self.bytes -= bytes;
                self.finished(id);
            }
        }
    }

    fn finished(&mut self, id: i64) {
        if let Some(f) = self.claim_filter.as_mut() {
            f.finished.insert(id);
        }
    }

    /// The key's head failed to publish; the engine records the failure.
    pub(crate) fn failed(&mut self, key: &Key, id: i64) {
        self.failed_because(key, id, None);
    }

    /// As [`Hand::failed`], with why when the broker said so (`None`: a timeout or a lost
    /// channel, which say nothing about the row).
    pub(crate) fn failed_because(&mut self, key: &Key, id: i64, held: Option<Held>) {
        if let Some(queue) = head_in(&mut self.keys, key, id, Head::InFlight) {
            self.in_flight -= 1;
            queue.head = Head::Recording;
            queue.hold(&mut self.held_keys, held);
        }
    }

    /// The key's head is to be parked without being published (too large, bad header).
    pub(crate) fn refuse(&mut self, key: &Key, id: i64) {
        self.failed(key, id);
    }

    /// The failure is recorded and the row will be retried when its timer fires.
    pub(crate) fn wait_retry(&mut self, key: &Key, id: i64) {
        if let Some(queue) = head_in(&mut self.keys, key, id, Head::Recording) {
            queue.head = Head::Waiting;
        }
    }

    /// The key's retry time came: its head may be published again.
    pub(crate) fn retry_due(&mut self, key: &Key) {
        if let Some(queue) = self.keys.get_mut(key)
            && queue.head == Head::Waiting
        {
            queue.head = Head::Ready;
            self.ready.push_back(key.clone());
        }
    }

    /// The key's head was parked (committed). With `keep_going` the key's next row may go;
    /// otherwise the key's rows leave the hand (they wait, pending, for an operator).
    pub(crate) fn parked(&mut self, key: &Key, id: i64, keep_going: bool) -> Released {
        let Some(queue) = head_in(&mut self.keys, key, id, Head::Recording) else {
            return Released { wants_claim: false };
        };
        let row = queue.rows.pop_front().expect("head exists");
        queue.head = Head::Ready; // whatever is behind it has not been published
        queue.hold(&mut self.held_keys, None);
        if self.forget(row.id, row.body_bytes) {
            self.finished(row.id);
        }
        if keep_going {
            self.advance(key)
        } else {
            self.drop_key(key);
            Released { wants_claim: false }
        }
    }
    /// The row is no longer ours to decide about (parked by an earlier try of ours whose
    /// answer was lost is `parked`, not this; here: dispatched or gone, or its partition is
    /// no longer ours at our epoch): it leaves the hand, and so do its key's other rows. They
    /// stay pending in the database, and the next claim (if the partition is still ours)
    /// hands them out again with the numbers the database holds; carrying the key on could
    /// publish rows whose numbers a park elsewhere has rewound.
    pub(crate) fn gone(&mut self, key: &Key, id: i64) -> Released {
        self.parked(key, id, false)
    }

    /// The row leaves the hand; returns whether it was held.
    fn forget(&mut self, id: i64, bytes: usize) -> bool {
        let held = self.held.remove(&id);
        if held {
            self.bytes -= bytes;
        }
        held
    }

    /// After the head left: the next row becomes ready, or the key leaves the hand.
    fn advance(&mut self, key: &Key) -> Released {
        let queue = self.keys.get_mut(key).expect("key exists");
        if queue.rows.is_empty() {
            let maybe_more = queue.maybe_more;
            self.keys.remove(key);
            return Released {
                wants_claim: maybe_more,
            };
        }
        queue.head = Head::Ready;
        self.ready.push_back(key.clone());
        Released { wants_claim: false }
    }

    /// Drops a key's rows that are not in flight (they stay pending in the database).
    fn drop_key(&mut self, key: &Key) {
        let Some(mut queue) = self.keys.remove(key) else {
            return;
        };
        let keep_head = queue.head == Head::InFlight || queue.head == Head::Recording;
        if !keep_head {
            queue.hold(&mut self.held_keys, None);
        }
        let head = if keep_head {
            queue.rows.pop_front()
        } else {
            None
        };
        if !queue.rows.is_empty()
            && let Some(f) = self.claim_filter.as_mut()
        {
            f.dropped_keys.insert(key.clone());
        }
        for row in queue.rows.drain(..) {
            self.forget(row.id, row.body_bytes);
        }
        if let Some(head) = head {
            // Its outcome is still coming; keep the key with just that row.
            queue.rows.push_back(head);
            queue.maybe_more = false;
            self.keys.insert(key.clone(), queue);
        }
    }

    /// The partition's lease was lost: drop its rows that are not in flight.
    pub(crate) fn drop_partition(&mut self, partition: u8) -> usize {
        let keys: Vec<Key> = self
            .keys
            .iter()
            .filter(|(_, q)| q.partition == partition)
            .map(|(k, _)| k.clone())
            .collect();
        let before = self.held.len();
        for key in &keys {
            self.drop_key(key);
        }
        before - self.held.len()
    }

    /// Rows in flight or waiting for a database write in this partition.
    pub(crate) fn busy_in_partition(&self, partition: u8) -> bool {
        self.keys
            .values()
            .any(|q| q.partition == partition && matches!(q.head, Head::InFlight | Head::Recording))
    }

    /// Every row currently in flight (for a lost AMQP session): `(key, id)`.
    pub(crate) fn in_flight_rows(&self) -> Vec<(Key, i64)> {
        self.keys
            .iter()
            .filter(|(_, q)| q.head == Head::InFlight)
            .filter_map(|(k, q)| q.rows.front().map(|r| (k.clone(), r.id)))
            .collect()
    }

    /// The key's head row, if it is `id`.
    pub(crate) fn head(&self, key: &Key, id: i64) -> Option<&ClaimedRow> {
        self.keys
            .get(key)
            .and_then(|q| q.rows.front())
            .filter(|r| r.id == id)
    }

    /// When a key's retry is due: the earliest time its head may go again.
    pub(crate) fn retry_at(
        attempts: i32,
        min: std::time::Duration,
        max: std::time::Duration,
        now: Instant,
    ) -> Instant {
        now + outbox_kit::internal::retry_delay(attempts, min, max)
    }
}

/// The key's queue if its head is row `id` in state `state`. Outcomes and database results
/// can arrive after the key was dropped and claimed again; they must not move a head that
/// is in another state (a retry timer for a row now in flight, say).
fn head_in<'a>(
    keys: &'a mut HashMap<Key, KeyQueue>,
    key: &Key,
    id: i64,
    state: Head,
) -> Option<&'a mut KeyQueue> {
    keys.get_mut(key)
        .filter(|q| q.head == state && q.rows.front().is_some_and(|r| r.id == id))
}

#[cfg(test)]
mod tests;
