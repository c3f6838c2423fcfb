//! The partitions this relay holds: lease rounds (heartbeat, renew, release, acquire in
//! one round trip, see `claim::lease`), expiry, and giving back what is above the fair share.
//!
//! Invariants: a partition's rows are published only while its lease is valid and not being
//! given back ([`Leases::sendable`]); a lease counts as valid until 90% of its length after
//! the round that renewed it was *sent*, so a slow round trip never stretches it past the
//! database's view. A partition that is lost, expires, or comes back with a new epoch drops
//! its rows from the hand (someone else may publish them meanwhile). A partition is given
//! back only once nothing of it is in flight; a round that failed gives it back next round.
//! One lease round at a time.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio::time::Instant;

use super::claim::LeaseRound;
use super::hand::Hand;

#[derive(Debug)]
struct HeldLease {
    epoch: i64,
    valid_until: Instant,
    releasing: bool,
}

/// What a lease round changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Renewed {
    /// Partitions new to this relay (or taken back after a loss).
    pub(crate) gained: usize,
    /// Partitions another relay holds now.
    pub(crate) lost: usize,
}

/// The held leases and the lease round's bookkeeping.
#[derive(Debug)]
pub(crate) struct Leases {
    lease: Duration,
    held: HashMap<u8, HeldLease>,
    /// Partitions to give back in the next round.
    release_next: Vec<i32>,
    /// A round succeeded once: the relay is known to the database.
    registered: bool,
    /// A round is in flight.
    busy: bool,
}

impl Leases {
    /// No partitions yet; `lease` is `--lease`.
    pub(crate) fn new(lease: Duration) -> Leases {
        Leases {
            lease,
            held: HashMap::new(),
            release_next: Vec::new(),
            registered: false,
            busy: false,
        }
    }

    /// Partitions held (including those being given back).
    pub(crate) fn len(&self) -> usize {
        self.held.len()
    }

    /// No partitions held.
    pub(crate) fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// A lease round has succeeded.
    pub(crate) fn registered(&self) -> bool {
        self.registered
    }

    /// Rows of `partition` may be published at `now`.
    pub(crate) fn sendable(&self, now: Instant, partition: u8) -> bool {
        self.held
            .get(&partition)
            .is_some_and(|l| !l.releasing && l.valid_until > now)
    }

    /// When the first held lease runs out.
    /// The partitions held and the epoch of each, as the database's fenced writes take them.
    pub(crate) fn epochs(&self) -> (Vec<i32>, Vec<i64>) {
        self.held
            .iter()
            .map(|(p, l)| (i32::from(*p), l.epoch))
            .unzip()
    }

    pub(crate) fn next_expiry(&self) -> Option<Instant> {
        self.held.values().map(|l| l.valid_until).min()
    }

    /// Forgets the leases that ran out by `now` and drops their rows; returns how many.
    pub(crate) fn expire(&mut self, now: Instant, hand: &mut Hand) -> usize {
        let expired: Vec<u8> = self
            .held
            .iter()
            .filter(|(_, l)| l.valid_until <= now)
            .map(|(p, _)| *p)
            .collect();
        for p in &expired {
            self.held.remove(p);
            hand.drop_partition(*p);
        }
        expired.len()
    }

    /// Starts a round unless one is in flight: returns the partitions it gives back.
    pub(crate) fn start_round(&mut self) -> Option<Vec<i32>> {
        if self.busy {
            return None;
        }
        self.busy = true;
        Some(std::mem::take(&mut self.release_next))
    }

    /// The round failed: what it meant to give back goes in the next one.
    pub(crate) fn round_failed(&mut self, released: Vec<i32>) {
        self.busy = false;
        self.release_next.extend(released);
    }

    /// The round sent at `sent` returned `round`: renew, take on, forget and give back.
    pub(crate) fn round_done(
        &mut self,
        sent: Instant,
        round: &LeaseRound,
        hand: &mut Hand,
    ) -> Renewed {
        self.busy = false;
        self.registered = true;
        let valid_until = sent + self.lease.mul_f64(0.9);
        let mut gained = 0;
        let held: HashSet<u8> = round.held.iter().map(|l| l.partition).collect();
        let lost: Vec<u8> = self
            .held
            .keys()
            .filter(|p| !held.contains(p))
            .copied()
            .collect();
        for p in &lost {
            self.held.remove(p);
            hand.drop_partition(*p);
        }
        for lease in &round.held {
            match self.held.get_mut(&lease.partition) {
                Some(l) if l.epoch == lease.epoch => l.valid_until = valid_until,
                Some(_) | None => {
                    // New, or lost and taken back meanwhile: start clean.
                    hand.drop_partition(lease.partition);
                    self.held.insert(
                        lease.partition,
                        HeldLease {
                            epoch: lease.epoch,
                            valid_until,
                            releasing: false,
                        },
                    );
                    gained += 1;
                }
            }
        }
        // Give back what is above the fair share, once it has nothing in flight.
        let releasing = self.held.values().filter(|l| l.releasing).count();
        let excess = self.held.len().saturating_sub(round.fair_share.max(1));
        if excess > releasing {
            let mut candidates: Vec<u8> = self
                .held
                .iter()
                .filter(|(_, l)| !l.releasing)
                .map(|(p, _)| *p)
                .collect();
            candidates.sort_unstable_by(|a, b| b.cmp(a));
            for p in candidates.into_iter().take(excess - releasing) {
                if let Some(l) = self.held.get_mut(&p) {
                    l.releasing = true;
                }
                hand.drop_partition(p);
            }
        }
        let ready: Vec<u8> = self
            .held
            .iter()
            .filter(|(p, l)| l.releasing && !hand.busy_in_partition(**p))
            .map(|(p, _)| *p)
            .collect();
        for p in ready {
            self.release_next.push(p as i32);
        }
        Renewed {
            gained,
            lost: lost.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::claim::Lease;
    use super::*;

    const LEASE: Duration = Duration::from_secs(10);

    fn round(held: &[(u8, i64)], fair_share: usize) -> LeaseRound {
        LeaseRound {
            held: held
                .iter()
                .map(|&(partition, epoch)| Lease { partition, epoch })
                .collect(),
            fair_share,
            relays_alive: 1,
        }
    }

    /// A renewed lease is valid for 90% of its length from when the round was sent, then
    /// expires; a renewal before that moves the end.
    #[tokio::test(start_paused = true)]
    async fn renewal_and_expiry() {
        let mut hand = Hand::default();
        let mut leases = Leases::new(LEASE);
        assert!(!leases.registered());
        let sent = Instant::now();
        assert_eq!(leases.start_round(), Some(vec![]));
        assert_eq!(leases.start_round(), None, "one round at a time");
        tokio::time::advance(Duration::from_secs(1)).await; // a slow round trip
        let r = leases.round_done(sent, &round(&[(0, 1), (1, 1)], 2), &mut hand);
        assert_eq!(r, Renewed { gained: 2, lost: 0 });
        assert!(leases.registered());
        assert_eq!(leases.next_expiry(), Some(sent + Duration::from_secs(9)));
        assert!(leases.sendable(Instant::now(), 0));
        assert!(!leases.sendable(Instant::now(), 2), "not held");

        // Renewed with the same epoch: nothing gained, valid for longer.
        tokio::time::advance(Duration::from_secs(3)).await;
        let sent = Instant::now();
        leases.start_round();
        let r = leases.round_done(sent, &round(&[(0, 1), (1, 1)], 2), &mut hand);
        assert_eq!(r, Renewed::default());
        assert_eq!(leases.next_expiry(), Some(sent + Duration::from_secs(9)));

        tokio::time::advance(Duration::from_secs(9) - Duration::from_millis(1)).await;
        assert_eq!(leases.expire(Instant::now(), &mut hand), 0);
        assert!(leases.sendable(Instant::now(), 1));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!leases.sendable(Instant::now(), 1), "ran out");
        assert_eq!(leases.expire(Instant::now(), &mut hand), 2);
        assert!(leases.is_empty());
    }

    /// A partition missing from the round is lost; one back with a new epoch is gained again.
    #[tokio::test(start_paused = true)]
    async fn lost_and_taken_back() {
        let mut hand = Hand::default();
        let mut leases = Leases::new(LEASE);
        leases.start_round();
        leases.round_done(Instant::now(), &round(&[(0, 1), (1, 1)], 2), &mut hand);
        leases.start_round();
        let r = leases.round_done(Instant::now(), &round(&[(0, 2)], 2), &mut hand);
        assert_eq!(r, Renewed { gained: 1, lost: 1 });
        assert_eq!(leases.len(), 1);
    }

    /// Above the fair share, the highest partitions stop being sendable and are given back
    /// in the next round; a round that fails gives them back in the one after.
    #[tokio::test(start_paused = true)]
    async fn excess_is_given_back() {
        let mut hand = Hand::default();
        let mut leases = Leases::new(LEASE);
        leases.start_round();
        leases.round_done(
            Instant::now(),
            &round(&[(0, 1), (1, 1), (2, 1)], 1),
            &mut hand,
        );
        let now = Instant::now();
        assert!(leases.sendable(now, 0));
        assert!(!leases.sendable(now, 1), "being given back");
        assert!(!leases.sendable(now, 2), "being given back");
        let release = leases.start_round().expect("idle");
        let mut sorted = release.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![1, 2]);
        leases.round_failed(release);
        let mut again = leases.start_round().expect("idle");
        again.sort_unstable();
        assert_eq!(again, vec![1, 2], "given back next round");
        leases.round_done(Instant::now(), &round(&[(0, 1)], 1), &mut hand);
        assert_eq!(leases.len(), 1);
        assert_eq!(leases.start_round(), Some(vec![]));
    }
}
