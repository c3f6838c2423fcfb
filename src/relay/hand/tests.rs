//! Unit tests of the hand: per-key order, the claim filter, leases dropped mid-flight.

use super::*;

fn row(id: i64, key: &str, seq: i64) -> ClaimedRow {
    ClaimedRow::for_test(id, "order", key, seq)
}

fn none() -> HashSet<Key> {
    HashSet::new()
}

fn key(k: &str) -> Key {
    Key {
        aggregate_type: "order".into(),
        aggregate_id: k.into(),
    }
}

#[test]
fn one_message_per_key_in_flight() {
    let mut hand = Hand::default();
    hand.claim_started();
    assert_eq!(
        hand.claim_returned(
            vec![row(1, "a", 1), row(2, "a", 2), row(3, "b", 1)],
            &none()
        )
        .rows,
        3
    );
    let first = hand.next_ready(|_| true).unwrap().id;
    let second = hand.next_ready(|_| true).unwrap().id;
    assert_eq!((first, second), (1, 3));
    assert!(
        hand.next_ready(|_| true).is_none(),
        "a's second row must wait for the first"
    );
    hand.acked(&key("a"), 1);
    assert_eq!(hand.next_ready(|_| true).unwrap().id, 2);
}

#[test]
fn held_rows_are_not_added_twice_and_marked_rows_leave() {
    let mut hand = Hand::default();
    hand.claim_started();
    hand.claim_returned(vec![row(1, "a", 1)], &none());
    hand.next_ready(|_| true);
    hand.acked(&key("a"), 1);
    hand.claim_started();
    // The mark commits while the claim runs: the claim's snapshot may still see row 1.
    hand.marked([(1, 0)]);
    assert_eq!(
        hand.claim_returned(vec![row(1, "a", 1), row(2, "a", 2)], &none())
            .rows,
        1
    );
    assert_eq!(hand.rows(), 1);
}

/// A claim runs while the partition's lease lapses and comes back: the rows dropped
/// meanwhile must not leave a hole for the key's later rows to jump through.
#[test]
fn rows_dropped_during_a_claim_stop_their_key() {
    let mut hand = Hand::default();
    hand.claim_started();
    hand.claim_returned(vec![row(5, "a", 5)], &none());
    hand.claim_started();
    hand.drop_partition(0); // lease lapsed locally
    // The claim's snapshot still shows row 5 pending, and row 6 behind it.
    let added = hand.claim_returned(
        vec![row(5, "a", 5), row(6, "a", 6), row(7, "b", 1)],
        &none(),
    );
    assert_eq!(added.rows, 1);
    assert_eq!(added.stopped, vec![key("a")], "key a is asked for again");
    assert_eq!(hand.next_ready(|_| true).unwrap().id, 7);
    assert!(
        hand.next_ready(|_| true).is_none(),
        "nothing of key a before row 5 is back"
    );
    hand.claim_started();
    assert_eq!(
        hand.claim_returned(vec![row(5, "a", 5), row(6, "a", 6)], &none())
            .rows,
        2
    );
    assert_eq!(hand.next_ready(|_| true).unwrap().id, 5);
}

/// The claim leaves out the rows held when it starts. If one of them is dropped while
/// it runs, the result cannot show it, only the rows behind it: the key must still
/// stop, not take row 6 with row 5 missing before it.
#[test]
fn a_key_dropped_during_a_claim_that_left_its_held_rows_out_stops() {
    let mut hand = Hand::default();
    hand.claim_started();
    hand.claim_returned(vec![row(5, "a", 5), row(8, "c", 1)], &none());
    let mut held = hand.claim_started();
    held.sort_unstable();
    assert_eq!(held, vec![5, 8], "the claim is told what the hand holds");
    hand.drop_partition(0);
    let added = hand.claim_returned(vec![row(6, "a", 6), row(7, "b", 1)], &none());
    assert_eq!(added.rows, 1);
    assert_eq!(added.stopped, vec![key("a")]);
    assert_eq!(hand.next_ready(|_| true).unwrap().id, 7);
    assert!(hand.next_ready(|_| true).is_none());
}

/// A failure recorded for an attempt of a key that was dropped and claimed again must
/// not touch the head now in flight.
#[test]
fn late_results_do_not_move_a_head_in_another_state() {
    let mut hand = Hand::default();
    hand.claim_started();
    hand.claim_returned(vec![row(5, "a", 5)], &none());
    assert_eq!(hand.next_ready(|_| true).unwrap().id, 5);
    hand.failed(&key("a"), 5);
    hand.wait_retry(&key("a"), 5);
    hand.retry_due(&key("a"));
    assert_eq!(hand.next_ready(|_| true).unwrap().id, 5); // in flight again
    hand.wait_retry(&key("a"), 5); // a stale result: ignored
    hand.parked(&key("a"), 5, true); // likewise
    assert_eq!(hand.in_flight(), 1);
    assert!(hand.is_held(5));
    hand.acked(&key("a"), 5);
    assert_eq!(hand.in_flight(), 0);
    assert_eq!(hand.awaiting_mark(), 1);
}

#[test]
fn a_row_numbered_before_a_held_one_is_not_added() {
    let mut hand = Hand::default();
    hand.claim_started();
    hand.claim_returned(vec![row(6, "a", 6)], &none());
    hand.claim_started();
    assert_eq!(hand.claim_returned(vec![row(5, "a", 5)], &none()).rows, 0);
}

#[test]
fn a_failed_head_holds_its_key_until_retry() {
    let mut hand = Hand::default();
    hand.claim_started();
    hand.claim_returned(
        vec![row(1, "a", 1), row(2, "a", 2), row(3, "b", 1)],
        &none(),
    );
    assert_eq!(hand.next_ready(|_| true).unwrap().id, 1);
    hand.failed(&key("a"), 1);
    hand.wait_retry(&key("a"), 1);
    assert_eq!(hand.next_ready(|_| true).unwrap().id, 3, "other keys go on");
    assert!(hand.next_ready(|_| true).is_none());
    hand.retry_due(&key("a"));
    assert_eq!(
        hand.next_ready(|_| true).unwrap().id,
        1,
        "the same row again, before row 2"
    );
}

#[test]
fn parking_continues_or_blocks_the_key() {
    let mut hand = Hand::default();
    hand.claim_started();
    hand.claim_returned(
        vec![
            row(1, "a", 1),
            row(2, "a", 2),
            row(3, "b", 1),
            row(4, "b", 2),
        ],
        &none(),
    );
    hand.next_ready(|_| true);
    hand.next_ready(|_| true);
    hand.failed(&key("a"), 1);
    hand.parked(&key("a"), 1, true);
    assert_eq!(hand.next_ready(|_| true).unwrap().id, 2);
    hand.failed(&key("b"), 3);
    hand.parked(&key("b"), 3, false);
    assert!(!hand.is_held(4), "block-key drops the key's later rows");
    assert!(hand.next_ready(|_| true).is_none());
}

#[test]
fn a_row_that_is_gone_stops_its_key() {
    let mut hand = Hand::default();
    hand.claim_started();
    hand.claim_returned(
        vec![row(1, "a", 1), row(2, "a", 2), row(3, "b", 1)],
        &none(),
    );
    assert_eq!(hand.next_ready(|_| true).unwrap().id, 1);
    hand.failed(&key("a"), 1);
    hand.gone(&key("a"), 1);
    assert!(
        !hand.is_held(2),
        "the key's later rows wait for the next claim"
    );
    assert_eq!(hand.next_ready(|_| true).unwrap().id, 3, "other keys go on");
    assert!(hand.next_ready(|_| true).is_none());
}

#[test]
fn partitions_not_sendable_are_skipped() {
    let mut hand = Hand::default();
    hand.claim_started();
    let mut r = row(1, "a", 1);
    r.partition = 7;
    hand.claim_returned(vec![r, row(2, "b", 1)], &none());
    assert_eq!(hand.next_ready(|p| p != 7).unwrap().id, 2);
    assert!(hand.next_ready(|p| p != 7).is_none());
    assert_eq!(hand.drop_partition(7), 1);
    assert_eq!(hand.rows(), 1);
}

#[test]
fn a_drained_full_prefix_asks_for_a_claim() {
    let mut hand = Hand::default();
    hand.claim_started();
    let mut full = HashSet::new();
    full.insert(key("a"));
    hand.claim_returned(vec![row(1, "a", 1)], &full);
    hand.next_ready(|_| true);
    assert_eq!(hand.acked(&key("a"), 1), Released { wants_claim: true });
}

/// `outbox_keys_held`: a key counts as held by a nack or a return from that failure until
/// its head goes through, is parked, or leaves the hand; across retries of the same row.
#[test]
fn keys_held_by_nacks_and_returns_are_counted_until_the_head_leaves() {
    let held = |n, r| HeldKeys {
        nack: n,
        returned: r,
    };
    let mut hand = Hand::default();
    hand.claim_started();
    let mut other = row(3, "c", 1);
    other.partition = 7;
    hand.claim_returned(vec![row(1, "a", 1), row(2, "b", 1), other], &none());
    for _ in 0..3 {
        hand.next_ready(|_| true);
    }
    hand.failed_because(&key("a"), 1, Some(Held::Nack));
    hand.failed_because(&key("b"), 2, Some(Held::Returned));
    hand.failed_because(&key("c"), 3, Some(Held::Nack));
    assert_eq!(hand.held_keys(), held(2, 1));
    // Retried and nacked again: still one key.
    hand.wait_retry(&key("a"), 1);
    hand.retry_due(&key("a"));
    assert_eq!(hand.next_ready(|_| true).unwrap().id, 1);
    assert_eq!(
        hand.held_keys(),
        held(2, 1),
        "held while the retry is in flight"
    );
    hand.failed_because(&key("a"), 1, Some(Held::Nack));
    assert_eq!(hand.held_keys(), held(2, 1));
    // A timeout says nothing about the row.
    hand.wait_retry(&key("a"), 1);
    hand.retry_due(&key("a"));
    hand.next_ready(|_| true);
    hand.failed(&key("a"), 1);
    assert_eq!(hand.held_keys(), held(1, 1));
    hand.wait_retry(&key("a"), 1);
    hand.retry_due(&key("a"));
    hand.next_ready(|_| true);
    hand.failed_because(&key("a"), 1, Some(Held::Nack));
    hand.wait_retry(&key("a"), 1);
    hand.retry_due(&key("a"));
    hand.next_ready(|_| true);
    hand.acked(&key("a"), 1);
    assert_eq!(hand.held_keys(), held(1, 1), "acked: the key goes on");
    hand.parked(&key("b"), 2, true);
    assert_eq!(hand.held_keys(), held(1, 0), "parked");
    hand.wait_retry(&key("c"), 3);
    hand.drop_partition(7);
    assert_eq!(hand.held_keys(), held(0, 0), "the lease was lost");
}
